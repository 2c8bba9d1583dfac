// Gated DeltaNet decode step for one layer (batch 1), everything but the projections:
// causal depthwise conv (K taps) over q|k|v with a ring of the last K pre-conv inputs, SiLU, l2norm of q and k
// (q also * dk^-1/2), beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)), then per value
// head h (key head h / (Hv/Hk)) with f32 state S [Hv, dk, dv]:
//   S <- decay*S;  m = S^T k;  S <- S + k (beta (v - m))^T;  o = S^T q
// The gated RMSNorm of o is fused into the out_proj GEMV prologue (gemv.cu).
// Grid (Hv, ceil(dv/32)), 128 threads: warp w owns state rows i = w, w+4, ..., lane = value column (registers);
// the state loads are issued first (they do not depend on the step's inputs) and overlap the conv/norm chain.
// Inputs: proj = [conv_dim (q|k|v) | value_dim (z) | Hv (b) | Hv (a)] f32; conv_w [conv_dim, K] f32;
// ring [K, conv_dim] f32 (slot p % K holds the pre-conv input of position p); pos: device position counter.
// Bytes per call: state 2 * Hv*dk*dv*4 (read+write) + ~(K+1)*conv_dim*4. FLOPs ~ 6*Hv*dk*dv.
#include "common.cuh"

#define MAXR 32  // dk <= 4 * MAXR = 128

extern "C" __global__ void __launch_bounds__(128) gdn_step(
    const float* __restrict__ proj, const float* __restrict__ conv_w, float* __restrict__ ring,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ state,
    float* __restrict__ out, const int* __restrict__ pos_ptr, int Hk, int Hv, int dk, int dv, int K) {
    __shared__ float red[32];
    __shared__ float qs[128], ks[128];
    __shared__ float part[4][32];
    const int h = blockIdx.x, chunk = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pos = *pos_ptr;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int kh = h / (Hv / Hk);
    const int col = chunk * 32 + lane;
    const bool active = col < dv;
    // The state does not depend on this step's inputs: issue its loads first so they overlap the conv/norm chain.
    float* S = state + (long)h * dk * dv;
    float sreg[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        int i = warp + 4 * r;
        sreg[r] = (i < dk && active) ? S[i * dv + col] : 0.f;
    }
    pdl_wait();  // proj comes from the previous kernel; the state is this layer's, from the previous token
    const int cur = pos % K;
    // conv + SiLU of one channel; writes the ring slot of this position when `write`
    auto conv = [&](int ch, bool write) {
        float xin = proj[ch];
        float acc = conv_w[ch * K + K - 1] * xin;
        for (int j = 0; j < K - 1; j++) acc += conv_w[ch * K + j] * ring[((pos + 1 + j) % K) * conv_dim + ch];
        if (write) ring[cur * conv_dim + ch] = xin;
        return silu_f(acc);
    };
    const bool owner_qk = (h % (Hv / Hk) == 0) && chunk == 0;
    float q = 0.f, k = 0.f;
    if (tid < dk) {
        q = conv(kh * dk + tid, owner_qk);
        k = conv(Kd + kh * dk + tid, owner_qk);
    }
    float sq = block_sum(q * q, red);
    float sk = block_sum(k * k, red);
    if (tid < dk) {
        qs[tid] = q * rsqrtf(sq + 1e-6f) * rsqrtf((float)dk);
        ks[tid] = k * rsqrtf(sk + 1e-6f);
    }
    float v = 0.f;
    if (active) v = conv(2 * Kd + h * dv + col, warp == 0);  // each v channel belongs to one block; warp 0 writes
    __syncthreads();
    const float beta = sigmoid_f(proj[conv_dim + Vd + h]);
    const float decay = expf(-expf(a_log[h]) * softplus_f(proj[conv_dim + Vd + Hv + h] + dt_bias[h]));
    float m = 0.f;
#pragma unroll
    for (int r = 0; r < MAXR; r++) {
        int i = warp + 4 * r;
        sreg[r] *= decay;
        if (i < dk && active) m = fmaf(sreg[r], ks[i], m);
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
            float sv = fmaf(ks[i], delta, sreg[r]);
            S[i * dv + col] = sv;
            o = fmaf(sv, qs[i], o);
        }
    }
    __syncthreads();
    part[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && active) out[h * dv + col] = part[0][lane] + part[1][lane] + part[2][lane] + part[3][lane];
}
