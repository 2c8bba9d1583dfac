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
// gdn_step_seqs: the same step for B sequences of a batched decode step, P blocks per (value head h, row r), each
// taking dv / P value columns: grid (Hv P, B), clusters of the P blocks of a head, 128 * ceil(dv / P / 32) threads
// (warp w: the block's value columns 32 (w % C) + lane, C = ceil(dv / P / 32), and state rows i = w / C + 4 j). Row r's
// projections proj + r ldp, its ring and state from the pointer tables rings[r] / states[r], its position posv[r]
// (uploaded by the host before the step, so it may be read before the dependency wait), output bf16 row r (stride ldo)
// for out_proj. The block's columns of the head's state [dk][dv / P] go through dynamic shared memory (cp.async, issued
// first; dk * dv / P * 4 bytes, dv / P <= 64 and % 4 == 0); each block computes the head's conv and norms of q and k
// (the per-32-column blocks of the batch-1 kernel, 4,096 of them at B = 32, took 75 us where the state's bytes take
// ~31); the gated norm's sum of o^2 is gathered from the cluster. P = dv / 64 where dv allows (64-column blocks of 256
// threads, 6 a multiprocessor; with the whole head a block of 512, 2 a multiprocessor, B = 32 took 53.6 us a layer).
// The sums (m, o per column over the 4 row groups in order; o^2 over the head's 32-column chunks in order) are those of
// gdn_step, so the results are the same bit for bit.
// a traced batched step at B = 32 records 61k blocks of gdn_step_seqs (tern bench --trace): 7.3 MB of records
#define TRACE_CAP (1 << 17)
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

// 6 blocks of 256 threads a multiprocessor (40 registers; 32 KB of state and 2.7 KB of arrays each)
extern "C" __global__ void __launch_bounds__(256, 6) gdn_step_seqs(
    const float* __restrict__ proj, int ldp, const float* __restrict__ conv_w,
    const unsigned long long* __restrict__ rings, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const unsigned long long* __restrict__ states, __nv_bfloat16* __restrict__ out, int ldo,
    const int* __restrict__ posv, const float* __restrict__ norm, float eps, int Hk, int Hv, int dk, int dv, int K,
    int P) {
    KTRACE(21);
    __shared__ float red[3][32];                       // per-warp partial sums: |q|^2, |k|^2, |o|^2
    __shared__ float qs[128], ks[128], vs[64];        // normalised q, k; v (per column of this block: dvp <= 64)
    __shared__ float part[4][64];                      // per row group: m, then o, per column
    extern __shared__ __align__(16) float sst[];       // this block's columns of the head's state [dk][dv / P]
    const int h = blockIdx.x / P, p = blockIdx.x - h * P, r = blockIdx.y;
    const int dvp = dv / P, c0 = p * dvp;              // this block's value columns [c0, c0 + dvp)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int C = (dvp + 31) / 32, chunk = warp % C, rg = warp / C;  // column chunk, row group (0..3)
    const int col = chunk * 32 + lane;                 // local column; the head's column c0 + col
    const bool active = col < dvp;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int kh = h / (Hv / Hk);
    proj += (long)r * ldp;
    out += (long)r * ldo;
    float* ring = reinterpret_cast<float*>(rings[r]);
    float* S = reinterpret_cast<float*>(states[r]) + (long)h * dk * dv + c0;
    const int pos = posv[r];
    // the state first (it does not depend on this step's inputs): 16-byte copies, rows of dvp floats
    const int rq = dvp / 4;
    for (int idx = tid; idx < dk * rq; idx += blockDim.x) {
        const int i = idx / rq, u = idx - i * rq;
        cp_async16(sst + i * dvp + 4 * u, S + (long)i * dv + 4 * u, 16);
    }
    cp_async_commit();
    const int cur = pos % K, first = (pos + 1) % K;  // ring slot of this position, of the oldest input
    auto conv_past = [&](int ch, float& wlast) { return gdn_conv_past(conv_w, ring, conv_dim, K, first, ch, wlast); };
    // threads tid < dk: q and k channel tid (every block of the head: the norms need all of them); tid < dvp: v
    // channel c0 + tid (warps of row group 0: col == tid)
    const bool has_qk = tid < dk, has_v = tid < dvp;
    const int chq = kh * dk + tid, chk = Kd + kh * dk + tid, chv = 2 * Kd + h * dv + c0 + tid;
    float pq = 0.f, pk = 0.f, pv = 0.f, wq = 0.f, wk = 0.f, wv = 0.f;
    if (has_qk) {
        pq = conv_past(chq, wq);
        pk = conv_past(chk, wk);
    }
    if (has_v) pv = conv_past(chv, wv);
    const float ealog = __expf(a_log[h]), dtb = dt_bias[h];
    const float gn = active ? norm[c0 + col] : 0.f;
    pdl_wait();  // proj comes from the previous kernel
    const float xq = has_qk ? proj[chq] : 0.f, xk = has_qk ? proj[chk] : 0.f, xv = has_v ? proj[chv] : 0.f;
    const float xb = proj[conv_dim + Vd + h], xa = proj[conv_dim + Vd + Hv + h];
    const float xz = (active && rg == 0) ? proj[conv_dim + h * dv + c0 + col] : 0.f;
    if (has_qk && h % (Hv / Hk) == 0 && p == 0) {  // the key head's first value head writes its q/k ring slots
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
    trace_mark(0);
    float m = 0.f;
    if (active)
        for (int i = rg; i < dk; i += 4) {
            const float sv = sst[i * dvp + col] * decay;
            sst[i * dvp + col] = sv;  // only this thread reads or writes this (row, column)
            m = fmaf(sv, ks[i], m);
        }
    part[rg][col] = m;
    __syncthreads();
    m = part[0][col] + part[1][col] + part[2][col] + part[3][col];
    const float delta = active ? beta * (vs[col] - m) : 0.f;
    float o = 0.f;
    if (active)
        for (int i = rg; i < dk; i += 4) {
            const float sv = fmaf(ks[i], delta, sst[i * dvp + col]);
            S[(long)i * dv + col] = sv;
            o = fmaf(sv, qs[i], o);
        }
    __syncthreads();  // every thread has read part (m) before it is reused
    trace_mark(1);
    part[rg][col] = o;
    __syncthreads();
    o = part[0][col] + part[1][col] + part[2][col] + part[3][col];
    if (rg == 0) {
        const float t = warp_sum(active ? o * o : 0.f);
        if (lane == 0) red[2][chunk] = t;
    }
    // the head's sum of o^2: every block's chunk sums, in the head's chunk order (the blocks of a head are a
    // cluster of P; with P = 1 the cluster is this block)
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    if (rg == 0 && active) {
        float ss = 0.f;
        for (int b = 0; b < P; b++) {
            const float* rb = cluster.map_shared_rank(&red[2][0], b);
            for (int c = 0; c < C; c++) ss += rb[c];
        }
        out[h * dv + c0 + col] = to_act<__nv_bfloat16>(o * rsqrtf(ss / dv + eps) * gn * silu_f(xz));
    }
    cluster.sync();  // no block leaves while another may still read its sums
}

// gdn_verify_seqs / gdn_commit_seqs: the step of gdn_step_seqs over several consecutive rows of each sequence (a
// speculative verify's last token and drafts), row after row, the state of the block's columns kept in shared memory
// between rows, with the same sums in the same order (so row j's output and the state after it equal those of j + 1
// gdn_step_seqs steps bit for bit). Neither writes the conv ring, so no block can overwrite an input another still
// reads: a row's causal conv takes inputs of positions before the segment from the ring and later ones from the
// segment's own projection rows. gdn_verify_seqs writes each row's gated-norm output and leaves the state as it was;
// once the drafts are checked, gdn_commit_seqs runs over the kept rows (from a copy of their projections) and writes
// the state after the last of them, and gdn_ring (prefill.cu) writes their ring slots.
// Grid (Hv P, sequences), clusters of the P blocks of a head, threads and shared memory as gdn_step_seqs; segs[s] =
// {first row, rows, first position, -} (the SegTable of prefill.rs: host-uploaded), rings / states[s] the sequence's.
template <bool VERIFY>
__device__ __forceinline__ void gdn_rows_body(
    const float* __restrict__ proj, int ldp, const float* __restrict__ conv_w,
    const unsigned long long* __restrict__ rings, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const unsigned long long* __restrict__ states, __nv_bfloat16* __restrict__ out, int ldo,
    const int* __restrict__ segs, const float* __restrict__ norm, float eps, int Hk, int Hv, int dk, int dv, int K,
    int P) {
    __shared__ float red[3][32];
    __shared__ float qs[128], ks[128], vs[64];
    __shared__ float part[4][64];
    extern __shared__ __align__(16) float sst[];
    const int h = blockIdx.x / P, p = blockIdx.x - h * P, s = blockIdx.y;
    const int dvp = dv / P, c0 = p * dvp;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int C = (dvp + 31) / 32, chunk = warp % C, rg = warp / C;
    const int col = chunk * 32 + lane;
    const bool active = col < dvp;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int kh = h / (Hv / Hk);
    const Seg sg = seg_at(segs, s);
    const float* ring = reinterpret_cast<const float*>(rings[s]);
    float* S = reinterpret_cast<float*>(states[s]) + (long)h * dk * dv + c0;
    const int rq = dvp / 4;
    for (int idx = tid; idx < dk * rq; idx += blockDim.x) {
        const int i = idx / rq, u = idx - i * rq;
        cp_async16(sst + i * dvp + 4 * u, S + (long)i * dv + 4 * u, 16);
    }
    cp_async_commit();
    const bool has_qk = tid < dk, has_v = tid < dvp;
    const int chq = kh * dk + tid, chk = Kd + kh * dk + tid, chv = 2 * Kd + h * dv + c0 + tid;
    const float ealog = __expf(a_log[h]), dtb = dt_bias[h];
    const float gn = (VERIFY && active) ? norm[c0 + col] : 0.f;
    pdl_wait();  // proj comes from the previous kernel
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll 1
    for (int j = 0; j < sg.k; j++) {
        const int pos = sg.pos0 + j;
        const float* pr = proj + (long)(sg.r0 + j) * ldp;
        // the causal conv of channel ch at this row: taps of positions pos - K + 1 .. pos - 1 in order (from the ring
        // before the segment, from the segment's rows after its start), then the current input, as gdn_conv_past
        auto conv = [&](int ch) {
            float acc = 0.f;
#pragma unroll 1
            for (int i = 0; i < K - 1; i++) {
                const int q = pos - (K - 1) + i;
                const float x = q < sg.pos0 ? ring[(((q % K) + K) % K) * conv_dim + ch]
                                            : proj[(long)(sg.r0 + q - sg.pos0) * ldp + ch];
                acc += conv_w[ch * K + i] * x;
            }
            return fmaf(conv_w[ch * K + K - 1], pr[ch], acc);
        };
        const float q = has_qk ? silu_f(conv(chq)) : 0.f;
        const float k = has_qk ? silu_f(conv(chk)) : 0.f;
        if (has_v) vs[tid] = silu_f(conv(chv));
        const float xb = pr[conv_dim + Vd + h], xa = pr[conv_dim + Vd + Hv + h];
        const float xz = (active && rg == 0) ? pr[conv_dim + h * dv + c0 + col] : 0.f;
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
        __syncthreads();  // qs, ks, vs in place
        float m = 0.f;
        if (active)
            for (int i = rg; i < dk; i += 4) {
                const float sv = sst[i * dvp + col] * decay;
                sst[i * dvp + col] = sv;
                m = fmaf(sv, ks[i], m);
            }
        part[rg][col] = m;
        __syncthreads();
        m = part[0][col] + part[1][col] + part[2][col] + part[3][col];
        const float delta = active ? beta * (vs[col] - m) : 0.f;
        float o = 0.f;
        if (active)
            for (int i = rg; i < dk; i += 4) {
                const float sv = fmaf(ks[i], delta, sst[i * dvp + col]);
                sst[i * dvp + col] = sv;
                o = fmaf(sv, qs[i], o);
            }
        __syncthreads();  // every thread has read part (m) before it is reused
        if constexpr (VERIFY) {
            part[rg][col] = o;
            __syncthreads();
            o = part[0][col] + part[1][col] + part[2][col] + part[3][col];
            if (rg == 0) {
                const float t = warp_sum(active ? o * o : 0.f);
                if (lane == 0) red[2][chunk] = t;
            }
            cg::cluster_group cluster = cg::this_cluster();
            cluster.sync();
            if (rg == 0 && active) {
                float ss = 0.f;
                for (int b = 0; b < P; b++) {
                    const float* rb = cluster.map_shared_rank(&red[2][0], b);
                    for (int c = 0; c < C; c++) ss += rb[c];
                }
                out[(long)(sg.r0 + j) * ldo + h * dv + c0 + col] =
                    to_act<__nv_bfloat16>(o * rsqrtf(ss / dv + eps) * gn * silu_f(xz));
            }
            cluster.sync();  // the sums read before the next row overwrites them
        }
    }
    if constexpr (!VERIFY) {
        __syncthreads();
        for (int idx = tid; idx < dk * dvp; idx += blockDim.x) {
            const int i = idx / dvp, u = idx - i * dvp;
            S[(long)i * dv + u] = sst[idx];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) gdn_verify_seqs(
    const float* __restrict__ proj, int ldp, const float* __restrict__ conv_w,
    const unsigned long long* __restrict__ rings, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const unsigned long long* __restrict__ states, __nv_bfloat16* __restrict__ out, int ldo,
    const int* __restrict__ segs, const float* __restrict__ norm, float eps, int Hk, int Hv, int dk, int dv, int K,
    int P) {
    KTRACE(64);
    gdn_rows_body<true>(proj, ldp, conv_w, rings, a_log, dt_bias, states, out, ldo, segs, norm, eps, Hk, Hv, dk, dv, K,
                        P);
}

extern "C" __global__ void __launch_bounds__(256) gdn_commit_seqs(
    const float* __restrict__ proj, int ldp, const float* __restrict__ conv_w,
    const unsigned long long* __restrict__ rings, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const unsigned long long* __restrict__ states, const int* __restrict__ segs, int Hk, int Hv, int dk, int dv, int K,
    int P) {
    KTRACE(65);
    gdn_rows_body<false>(proj, ldp, conv_w, rings, a_log, dt_bias, states, nullptr, 0, segs, nullptr, 0.f, Hk, Hv, dk,
                         dv, K, P);
}
