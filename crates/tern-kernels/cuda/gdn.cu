// Gated DeltaNet decode step for one layer (batch 1), everything but the projections:
// causal depthwise conv (K taps) over q|k|v with a ring of the last K pre-conv inputs, SiLU, l2norm of q and k
// (q also * dk^-1/2), beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)), then per value
// head h (key head h / (Hv/Hk)) with f32 state S [Hv, dk, dv]:
//   S <- decay*S;  m = S^T k;  S <- S + k (beta (v - m))^T;  o = S^T q
// then the gated RMSNorm of the head: out = o * rsqrt(mean(o^2) + eps) * norm * silu(z) (z from proj).
// Grid (Hv, ceil(dv/32)), 128 threads, clusters of the ceil(dv/32) blocks of one head (launch attribute): warp w
// owns state rows i = w, w+4, ..., lane = value column (registers); the state loads are issued first (they do not
// depend on the step's inputs) and overlap the conv/norm chain; the head's sum of squares is gathered from the
// cluster's blocks through distributed shared memory.
// Inputs: proj = [conv_dim (q|k|v) | value_dim (z) | Hv (b) | Hv (a)] f32; conv_w [conv_dim, K] f32;
// ring [K, conv_dim] f32 (slot p % K holds the pre-conv input of position p); pos: device position counter.
// Bytes per call: state 2 * Hv*dk*dv*4 (read+write) + ~(K+1)*conv_dim*4. FLOPs ~ 6*Hv*dk*dv.
// gdn_step_seqs: the same step for B sequences of a batched decode step, one block per (value head h, row r): grid
// (Hv, B), 128 * ceil(dv / 32) threads (warp w: value columns 32 (w % C) + lane, C = ceil(dv / 32), and state rows
// i = w / C + 4 j). Row r's projections proj + r ldp, its ring and state from the pointer tables rings[r] /
// states[r], its position posv[r] (uploaded by the host before the step, so it may be read before the dependency
// wait), output bf16 row r (stride ldo) for out_proj. The head's whole state [dk][dv] goes through dynamic shared
// memory (cp.async, issued first; dk * dv * 4 bytes, dv % 4 == 0): no cluster, and the conv and norms of a head are
// computed once instead of once per 32 columns (the per-32-column blocks of the batch-1 kernel, 4,096 of them at
// B = 32, took 75 us where the state's bytes take ~31).
#include "mma.cuh"  // cp_async
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define MAXR 32  // dk <= 4 * MAXR = 128

// The causal conv of channel ch over its K - 1 earlier inputs (ring slots first, first + 1, ... mod K), and in
// wlast the weight of the current input (both decode kernels: the current input joins as fmaf(wlast, x, acc)).
__device__ __forceinline__ float gdn_conv_past(const float* __restrict__ conv_w, const float* __restrict__ ring,
                                               int conv_dim, int K, int first, int ch, float& wlast) {
    float acc = 0.f;
    int slot = first;
#pragma unroll 1
    for (int j = 0; j < K - 1; j++) {
        acc += conv_w[ch * K + j] * ring[slot * conv_dim + ch];
        slot = slot + 1 == K ? 0 : slot + 1;
    }
    wlast = conv_w[ch * K + K - 1];
    return acc;
}


template <typename OutT>
__device__ __forceinline__ void gdn_step_body(
    const float* __restrict__ proj, const float* __restrict__ conv_w, float* __restrict__ ring,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ state,
    OutT* __restrict__ out, const int* __restrict__ pos_ptr, const float* __restrict__ norm, float eps, int Hk, int Hv,
    int dk, int dv, int K) {
    __shared__ float ssq;  // this block's sum of o^2 over its 32 columns (read by the cluster)
    __shared__ float red[2][4];
    __shared__ float qs[128], ks[128];
    __shared__ float part[4][32];
    const int h = blockIdx.x, chunk = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int kh = h / (Hv / Hk);
    const int col = chunk * 32 + lane;
    const bool active = col < dv;
    // Everything that does not depend on this step's projections is read before the dependency wait: the state
    // and the ring slots of earlier positions (this layer's, written by the previous token's step), the conv
    // weights and the gate constants. pos is written by the previous step's last kernel (argmax), which has
    // completed before this step's second kernel starts.
    const int pos = *pos_ptr;
    float* S = state + (long)h * dk * dv;
    float sreg[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        int i = warp + 4 * r;
        sreg[r] = (i < dk && active) ? S[i * dv + col] : 0.f;
    }
    auto srow = [&](int r) -> float& { return sreg[r]; };
    const int cur = pos % K, first = (pos + 1) % K;  // ring slot of this position, of the oldest input
    auto conv_past = [&](int ch, float& wlast) { return gdn_conv_past(conv_w, ring, conv_dim, K, first, ch, wlast); };
    const bool has_qk = tid < dk;
    const int chq = kh * dk + tid, chk = Kd + kh * dk + tid, chv = 2 * Kd + h * dv + col;
    float pq = 0.f, pk = 0.f, pv = 0.f, wq = 0.f, wk = 0.f, wv = 0.f;
    if (has_qk) {
        pq = conv_past(chq, wq);
        pk = conv_past(chk, wk);
    }
    if (active) pv = conv_past(chv, wv);
    const float ealog = __expf(a_log[h]), dtb = dt_bias[h];
    const float gn = active ? norm[col] : 0.f;
    pdl_wait();  // proj comes from the previous kernel
    // all of this block's projection inputs in one round trip
    const float xq = has_qk ? proj[chq] : 0.f, xk = has_qk ? proj[chk] : 0.f, xv = active ? proj[chv] : 0.f;
    const float xb = proj[conv_dim + Vd + h], xa = proj[conv_dim + Vd + Hv + h];
    const float xz = active ? proj[conv_dim + h * dv + col] : 0.f;
    const bool owner_qk = (h % (Hv / Hk) == 0) && chunk == 0;
    if (has_qk && owner_qk) {
        ring[cur * conv_dim + chq] = xq;
        ring[cur * conv_dim + chk] = xk;
    }
    if (active && warp == 0) ring[cur * conv_dim + chv] = xv;  // each v channel belongs to one block
    const float q = has_qk ? silu_f(fmaf(wq, xq, pq)) : 0.f;
    const float k = has_qk ? silu_f(fmaf(wk, xk, pk)) : 0.f;
    const float v = active ? silu_f(fmaf(wv, xv, pv)) : 0.f;
    // both l2 norms in one block reduction
    float sq = warp_sum(q * q), sk = warp_sum(k * k);
    if (lane == 0) {
        red[0][warp] = sq;
        red[1][warp] = sk;
    }
    __syncthreads();
    sq = red[0][0] + red[0][1] + red[0][2] + red[0][3];
    sk = red[1][0] + red[1][1] + red[1][2] + red[1][3];
    if (has_qk) {
        qs[tid] = q * rsqrtf(sq + 1e-6f) * rsqrtf((float)dk);
        ks[tid] = k * rsqrtf(sk + 1e-6f);
    }
    __syncthreads();
    const float beta = sigmoid_f(xb);
    const float decay = __expf(-ealog * softplus_f(xa + dtb));
    float m = 0.f;
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        int i = warp + 4 * r;
        if (i < dk && active) {
            srow(r) *= decay;
            m = fmaf(srow(r), ks[i], m);
        }
    }
    part[warp][lane] = m;
    __syncthreads();
    m = part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane];
    const float delta = beta * (v - m);
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        int i = warp + 4 * r;
        if (i < dk && active) {
            float sv = fmaf(ks[i], delta, srow(r));
            S[i * dv + col] = sv;
            o = fmaf(sv, qs[i], o);
        }
    }
    __syncthreads();
    part[warp][lane] = o;
    __syncthreads();
    o = part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane];
    if (warp == 0) {
        const float t = warp_sum(active ? o * o : 0.f);
        if (lane == 0) ssq = t;
    }
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block of the head has its ssq
    float ss = 0.f;
    for (unsigned int r = 0; r < cluster.num_blocks(); r++) ss += *cluster.map_shared_rank(&ssq, r);
    if (warp == 0 && active) out[h * dv + col] = to_act<OutT>(o * rsqrtf(ss / dv + eps) * gn * silu_f(xz));
    cluster.sync();  // no block leaves while another may still read its ssq
}

extern "C" __global__ void __launch_bounds__(128) gdn_step(
    const float* __restrict__ proj, const float* __restrict__ conv_w, float* __restrict__ ring,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ state,
    float* __restrict__ out, const int* __restrict__ pos_ptr, const float* __restrict__ norm, float eps, int Hk, int Hv,
    int dk, int dv, int K) {
    KTRACE(20);
    gdn_step_body<float>(proj, conv_w, ring, a_log, dt_bias, state, out, pos_ptr, norm, eps, Hk, Hv, dk, dv, K);
}

extern "C" __global__ void __launch_bounds__(1024) gdn_step_seqs(
    const float* __restrict__ proj, int ldp, const float* __restrict__ conv_w,
    const unsigned long long* __restrict__ rings, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const unsigned long long* __restrict__ states, __nv_bfloat16* __restrict__ out, int ldo,
    const int* __restrict__ posv, const float* __restrict__ norm, float eps, int Hk, int Hv, int dk, int dv, int K) {
    KTRACE(21);
    __shared__ float red[3][32];                       // per-warp partial sums: |q|^2, |k|^2, |o|^2
    __shared__ float qs[128], ks[128], vs[256];       // normalised q, k; v (per column)
    __shared__ float part[4][256];                     // per row group: m, then o, per column
    extern __shared__ __align__(16) float sst[];       // the head's state [dk][dv]
    const int h = blockIdx.x, r = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int C = (dv + 31) / 32, chunk = warp % C, rg = warp / C;  // column chunk, row group (0..3)
    const int col = chunk * 32 + lane;
    const bool active = col < dv;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int kh = h / (Hv / Hk);
    proj += (long)r * ldp;
    out += (long)r * ldo;
    float* ring = reinterpret_cast<float*>(rings[r]);
    float* S = reinterpret_cast<float*>(states[r]) + (long)h * dk * dv;
    const int pos = posv[r];
    // the state first (it does not depend on this step's inputs): 16-byte copies, row-major as in global memory
    for (int idx = tid; idx < dk * dv / 4; idx += blockDim.x) cp_async16(sst + 4 * idx, S + 4 * idx, 16);
    cp_async_commit();
    const int cur = pos % K, first = (pos + 1) % K;  // ring slot of this position, of the oldest input
    auto conv_past = [&](int ch, float& wlast) { return gdn_conv_past(conv_w, ring, conv_dim, K, first, ch, wlast); };
    // threads tid < dk: q and k channel tid; threads tid < dv: v channel tid (warps of row group 0: col == tid)
    const bool has_qk = tid < dk, has_v = tid < dv;
    const int chq = kh * dk + tid, chk = Kd + kh * dk + tid, chv = 2 * Kd + h * dv + tid;
    float pq = 0.f, pk = 0.f, pv = 0.f, wq = 0.f, wk = 0.f, wv = 0.f;
    if (has_qk) {
        pq = conv_past(chq, wq);
        pk = conv_past(chk, wk);
    }
    if (has_v) pv = conv_past(chv, wv);
    const float ealog = __expf(a_log[h]), dtb = dt_bias[h];
    const float gn = active ? norm[col] : 0.f;
    pdl_wait();  // proj comes from the previous kernel
    const float xq = has_qk ? proj[chq] : 0.f, xk = has_qk ? proj[chk] : 0.f, xv = has_v ? proj[chv] : 0.f;
    const float xb = proj[conv_dim + Vd + h], xa = proj[conv_dim + Vd + Hv + h];
    const float xz = (active && rg == 0) ? proj[conv_dim + h * dv + col] : 0.f;
    if (has_qk && h % (Hv / Hk) == 0) {  // the key head's first value head writes its q/k ring slots
        ring[cur * conv_dim + chq] = xq;
        ring[cur * conv_dim + chk] = xk;
    }
    if (has_v) ring[cur * conv_dim + chv] = xv;
    const float q = has_qk ? silu_f(fmaf(wq, xq, pq)) : 0.f;
    const float k = has_qk ? silu_f(fmaf(wk, xk, pk)) : 0.f;
    if (has_v) vs[tid] = silu_f(fmaf(wv, xv, pv));
    // both l2 norms in one block reduction (warps past dk contribute zeros)
    const float sq = warp_sum(q * q), sk = warp_sum(k * k);
    if (lane == 0) {
        red[0][warp] = sq;
        red[1][warp] = sk;
    }
    __syncthreads();
    float nq = 0.f, nk = 0.f;
    for (int w = 0; w < (dk + 31) / 32; w++) {
        nq += red[0][w];
        nk += red[1][w];
    }
    if (has_qk) {
        qs[tid] = q * rsqrtf(nq + 1e-6f) * rsqrtf((float)dk);
        ks[tid] = k * rsqrtf(nk + 1e-6f);
    }
    const float beta = sigmoid_f(xb);
    const float decay = __expf(-ealog * softplus_f(xa + dtb));
    cp_async_wait<0>();
    __syncthreads();  // qs, ks, vs and the state are in place
    float m = 0.f;
    if (active)
        for (int i = rg; i < dk; i += 4) {
            const float sv = sst[i * dv + col] * decay;
            sst[i * dv + col] = sv;  // only this thread reads or writes this (row, column)
            m = fmaf(sv, ks[i], m);
        }
    part[rg][col] = m;
    __syncthreads();
    m = part[0][col] + part[1][col] + part[2][col] + part[3][col];
    const float delta = active ? beta * (vs[col] - m) : 0.f;
    float o = 0.f;
    if (active)
        for (int i = rg; i < dk; i += 4) {
            const float sv = fmaf(ks[i], delta, sst[i * dv + col]);
            S[(long)i * dv + col] = sv;
            o = fmaf(sv, qs[i], o);
        }
    __syncthreads();  // every thread has read part (m) before it is reused
    part[rg][col] = o;
    __syncthreads();
    o = part[0][col] + part[1][col] + part[2][col] + part[3][col];
    if (rg == 0) {
        const float t = warp_sum(active ? o * o : 0.f);
        if (lane == 0) red[2][chunk] = t;
    }
    __syncthreads();
    if (rg == 0 && active) {
        float ss = 0.f;
        for (int c = 0; c < C; c++) ss += red[2][c];
        out[h * dv + col] = to_act<__nv_bfloat16>(o * rsqrtf(ss / dv + eps) * gn * silu_f(xz));
    }
}
