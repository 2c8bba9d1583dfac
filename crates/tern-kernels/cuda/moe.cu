// Sparse MoE decode kernels (batch 1). Experts of one layer live in one buffer each for gate_up
// ([E+1, 2I, H]: gate rows then up rows; expert E is the shared expert, whose intermediate size Is may differ)
// and down ([E+1, H, I]), 4-bit MLX affine, group gs; routed experts have stride `*_words` / `*_groups`.
//
// moe_topk      : softmax over E router logits, top-k (ties -> lower index), renormalise; slot k = shared expert
//                 with weight sigmoid(logits[E]). One block. Bytes ~ 4E. FLOPs ~ E*(k+3).
// moe_gate_up   : act[slot, j] = silu(G_e[j] . xn) * (U_e[j] . xn), xn = RMSNorm(x)*gain computed in the
//                 prologue; warp per (slot, j). Bytes: (k*2I + 2Is)*H/2 (+scales). FLOPs 2*(k*2I+2Is)*H.
// moe_down      : x[r] += sum_slot wt[slot] * (D_e[r] . act[slot]) (residual add fused); warp per output row.
//                 Bytes: H*(k*I + Is)/2 (+scales). FLOPs 2*H*(k*I+Is).
#include "common.cuh"

extern "C" __global__ void moe_topk(const float* __restrict__ logits, int E, int k, int* __restrict__ idx,
                                    float* __restrict__ wts) {
    // one warp; lane holds experts lane + 32*j (E <= 256); k rounds of warp argmax, no block barriers
    const int lane = threadIdx.x & 31;
    float p[8];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int e = lane + 32 * j;
        p[j] = e < E ? logits[e] : -INFINITY;
        m = fmaxf(m, p[j]);
    }
    m = warp_max(m);
#pragma unroll
    for (int j = 0; j < 8; j++) p[j] = lane + 32 * j < E ? expf(p[j] - m) : -1.f;
    float total = 0.f, mine = 0.f;
    int mine_i = 0;
    for (int sel = 0; sel < k; sel++) {
        float bv = -1.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (p[j] > bv) { bv = p[j]; bi = lane + 32 * j; }  // ascending index: ties keep the lower
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (lane + 32 * j == bi) p[j] = -2.f;  // taken
        total += bv;
        if (lane == sel) { mine = bv; mine_i = bi; }
    }
    if (lane < k) {
        idx[lane] = mine_i;
        wts[lane] = mine / total;
    }
    if (lane == 0) {
        idx[k] = E;
        wts[k] = sigmoid_f(logits[E]);
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, const int* __restrict__ idx, int k, int I, int Is, int H, int gs,
    const float* __restrict__ x, const float* __restrict__ gain, float eps, float* __restrict__ act) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    float ss = 0.f;
    for (int c = tid; c < H; c += blockDim.x) ss += x[c] * x[c];
    float rr = rsqrtf(block_sum(ss, red) / H + eps);
    for (int c = tid; c < H; c += blockDim.x) xs[padi(c)] = x[c] * rr * gain[c];
    __syncthreads();
    const int Imax = I > Is ? I : Is;
    const int items = k * I + Is;
    for (int it = blockIdx.x * nw + warp; it < items; it += gridDim.x * nw) {
        int slot = it < k * I ? it / I : k;
        int j = it < k * I ? it % I : it - k * I;
        int n = slot < k ? I : Is;
        long e = idx[slot];
        const uint32_t* we = w + e * words;
        const __nv_bfloat16* se = s + e * groups;
        const __nv_bfloat16* be = b + e * groups;
        float g = warp_row_dot<4>(we, se, be, j, H, gs, xs, lane);
        float u = warp_row_dot<4>(we, se, be, n + j, H, gs, xs, lane);
        if (lane == 0) act[slot * Imax + j] = silu_f(g) * u;
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, const int* __restrict__ idx, const float* __restrict__ wts, int k, int I, int Is, int H,
    int gs, const float* __restrict__ act, float* __restrict__ x) {
    extern __shared__ float as[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int Imax = I > Is ? I : Is;
    const int stride = padded_len(Imax);
    for (int slot = 0; slot <= k; slot++) {
        int n = slot < k ? I : Is;
        for (int j = tid; j < n; j += blockDim.x) as[slot * stride + padi(j)] = act[slot * Imax + j];
    }
    __syncthreads();
    for (int r = blockIdx.x * nw + warp; r < H; r += gridDim.x * nw) {
        float acc = 0.f;
        for (int slot = 0; slot <= k; slot++) {
            int n = slot < k ? I : Is;
            long e = idx[slot];
            float d = warp_row_dot<4>(w + e * words, s + e * groups, b + e * groups, r, n, gs, as + slot * stride, lane);
            acc = fmaf(wts[slot], d, acc);
        }
        if (lane == 0) x[r] += acc;
    }
}
