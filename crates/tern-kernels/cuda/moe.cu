// Sparse MoE decode kernels (batch 1). Experts of one layer live in one buffer each for gate_up
// ([E+1, 2I, H]: gate rows then up rows; expert E is the shared expert, whose intermediate size Is may differ)
// and down ([E+1, H, I]), 4-bit MLX affine, group gs = 32 << gshift; routed experts have stride `*_words` /
// `*_groups`. Weight loads are 16 bytes, streamed (ld.global.nc, no L1 allocation), several per lane in flight.
//
// moe_topk      : softmax over E router logits, top-k (ties -> lower index), renormalise; slot k = shared expert
//                 with weight sigmoid(logits[E]). One warp. Bytes ~ 4E. FLOPs ~ E*(k+3).
// moe_gate_up   : act[slot, j] = silu(G_e[j] . xn) * (U_e[j] . xn), xn = RMSNorm(x)*gain computed in the
//                 prologue (smem, padded, with 32-column chunk sums); a warp owns 2 items = 4 rows.
//                 Bytes: (k*2I + 2Is)*H/2 (+scales). FLOPs 2*(k*2I+2Is)*H.
// moe_down      : x[r] += sum_slot wt[slot] * (D_e[r] . act[slot]) (residual add fused); lpr lanes per output
//                 row, up to 8 slots' loads in flight per lane; the block's expert rows are prefetched into L2
//                 before the dependency wait (idx is two launches old). Bytes: H*(k*I + Is)/2 (+scales).
//                 FLOPs 2*H*(k*I+Is).
#include "common.cuh"

extern "C" __global__ void moe_topk(const float* __restrict__ logits, int E, int k, int* __restrict__ idx,
                                    float* __restrict__ wts) {
    pdl_wait();
    topk_warp(logits, E, k, idx, wts);
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, const int* __restrict__ idx, int k, int I, int Is, int H, int gshift,
    const float* __restrict__ x, const float* __restrict__ gain, float eps, float* __restrict__ act) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    pdl_wait();  // idx comes from the previous kernel: nothing to prefetch
    float* cs = xs + padx_len(H);
    stage_x(x, gain, nullptr, 0, eps, H, 32, xs, cs, red);
    const int Imax = I > Is ? I : Is;
    const int items = k * I + Is;
    const int nvec = H / 32, ngroups = H >> (gshift + 5);
    // a warp owns 2 items (gate and up rows of each: 4 rows in flight)
    for (int t = blockIdx.x * nw + warp; 2 * t < items; t += gridDim.x * nw) {
        const uint4* wr[4];
        const __nv_bfloat16 *sr[4], *br[4];
        int slot[2], jj[2];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int it = min(2 * t + q, items - 1);
            slot[q] = it < k * I ? it / I : k;
            jj[q] = it < k * I ? it % I : it - k * I;
            const int n = slot[q] < k ? I : Is;
            const long e = idx[slot[q]];
            const long rg = jj[q], ru = n + jj[q];
            wr[2 * q] = reinterpret_cast<const uint4*>(w + e * words) + rg * nvec;
            wr[2 * q + 1] = reinterpret_cast<const uint4*>(w + e * words) + ru * nvec;
            sr[2 * q] = s + e * groups + rg * ngroups;
            sr[2 * q + 1] = s + e * groups + ru * ngroups;
            br[2 * q] = b + e * groups + rg * ngroups;
            br[2 * q + 1] = b + e * groups + ru * ngroups;
        }
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        warp_rows_dot<4, 4, 2>(wr, sr, br, nvec, gshift, xs, cs, lane, tot);
#pragma unroll
        for (int r = 0; r < 4; r++) tot[r] = warp_sum(tot[r]);
#pragma unroll
        for (int q = 0; q < 2; q++)
            if (lane == q && 2 * t + q < items) act[slot[q] * Imax + jj[q]] = silu_f(tot[2 * q]) * tot[2 * q + 1];
    }
}

// Down projection: lpr lanes (a power of two <= 32, ~ chunks per row) share one output row, 32/lpr rows per
// warp; each lane issues the 16-byte loads of up to 8 slots before using any.
extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, const int* __restrict__ idx, const float* __restrict__ wts, int k, int I, int Is, int H,
    int gshift, int lpr, const float* __restrict__ act, float* __restrict__ x) {
    extern __shared__ float as[];
    __shared__ int sidx[33];
    __shared__ float swt[33];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int Imax = I > Is ? I : Is;
    const int stride = padx_len(Imax);
    float* cs = as + (k + 1) * stride;  // [k+1][Imax/32]
    {
        // before the dependency wait: idx was written two launches ago (router), so this block's expert rows
        // can be pulled into L2 while moe_gate_up finishes
        const int rpw = 32 / lpr;
        const long r0 = ((long)blockIdx.x * nw + warp) * rpw;
        if (r0 < H) {
            const long nr = min((long)rpw, H - r0);
            for (int slot = 0; slot <= k; slot++) {
                const int n = slot < k ? I : Is;
                const long e = idx[slot];
                prefetch_l2(reinterpret_cast<const uint8_t*>(w + e * words) + r0 * n / 2, nr * n / 2, lane);
            }
        }
    }
    pdl_wait();
    for (int slot = 0; slot <= k; slot++) {
        int n = slot < k ? I : Is;
        for (int j = tid; j < n; j += blockDim.x) as[slot * stride + padx(j)] = act[slot * Imax + j] * DN_XSCALE;
    }
    if (tid <= k) {
        sidx[tid] = idx[tid];
        swt[tid] = wts[tid];
    }
    __syncthreads();
    for (int u = tid; u < (k + 1) * (Imax / 32); u += blockDim.x) {
        const int slot = u / (Imax / 32), c = u % (Imax / 32);
        const int n = slot < k ? I : Is;
        float t = 0.f;
        if (c < n / 32)
            for (int j = 0; j < 32; j++) t += as[slot * stride + padx(c * 32 + j)];
        cs[u] = t * (1.f / DN_XSCALE);  // exact: power of two
    }
    __syncthreads();
    const int rpw = 32 / lpr, sl = lane & (lpr - 1);
    const int nmax = Imax / 32;
    for (int rt = blockIdx.x * nw + warp; rt * rpw < H; rt += gridDim.x * nw) {
        const int r = rt * rpw + lane / lpr;
        const int rc = min(r, H - 1);
        float acc = 0.f;
        for (int u = sl; u < nmax; u += lpr) {
            for (int s0 = 0; s0 <= k; s0 += 8) {
                uint4 wv[8];
                float sc[8], bs[8];
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    const int slot = min(s0 + q, k);
                    const int n = slot < k ? I : Is;
                    const int nv = n / 32, uc = min(u, nv - 1);
                    const long e = sidx[slot];
                    const long g = (long)rc * (n >> (gshift + 5)) + (uc >> gshift);
                    wv[q] = ldg_stream(reinterpret_cast<const uint4*>(w + e * words) + (long)rc * nv + uc);
                    sc[q] = bf(s[e * groups + g]);
                    bs[q] = bf(b[e * groups + g]);
                }
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    const int slot = s0 + q;
                    const int n = slot < k ? I : Is;
                    if (slot <= k && u < n / 32) {
                        float d[1] = {0.f};
                        const uint4 wq[1] = {wv[q]};
                        const float scq[1] = {sc[q]}, bsq[1] = {bs[q]};
                        chunk_dot<4, 1>(wq, as + slot * stride + padx(u * 32), scq, bsq, cs[slot * nmax + u], d);
                        acc = fmaf(swt[slot], d[0], acc);
                    }
                }
            }
        }
        for (int o = lpr / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, o);
        if (sl == 0 && r < H) x[r] += acc;
    }
}
