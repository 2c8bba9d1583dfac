// Quantised GEMV, batch 1 (decode): y = W x for an MLX affine 4-bit or 8-bit matrix W [rows, cols] (group gs,
// a power of two, bf16 scales/biases), x f32 [cols], y f32 [rows]. x is staged once per block in shared memory
// (padded 4 floats every 32, with per-16-byte-chunk sums of x for the bias term) by a fused prologue (stage_x in
// common.cuh: one round of float4 loads, register/shuffle reductions, one barrier), 256 threads:
//   * plain copy of x;
//   * RMSNorm: x * rsqrt(mean(x^2) + eps) * gain  (gain already holds the +1 of the (1+w) norms);
//   * gated RMSNorm per head of `hd` values (Gated DeltaNet output): norm(x_h) * gain[j] * silu(z).
// Main loop: a warp owns R consecutive rows (R = 4 for large matrices, 1 for small ones so the grid still covers
// the chip); each lane keeps R*U 16-byte weight loads (ld.global.nc, no L1 allocation) in flight, then decodes
// them against float4 reads of x (denormal decode, common.cuh: one LOP3 + one FFMA per weight). Grid-stride over
// row tiles with the grid sized to the resident capacity (occupancy query on the host), so the prologue runs
// once per resident block. Before pdl_wait() (programmatic dependent launch) each warp prefetches its first row
// tile into L2 while the previous kernel finishes.
// Epilogue: y = acc, or y += acc (residual add, each row owned by one warp).
// router_topk_q8: the router GEMV with moe_topk fused into the last block (see moe.cu for the top-k).
// Bytes per call: rows*cols*BITS/8 + rows*(cols/gs)*4 (+ 4*cols per block for x, from L2).
// FLOPs per call: 2*rows*cols (+ 4 per 16-byte chunk for the affine correction).
#include "common.cuh"

template <int BITS, int R, int U, bool DN = true>
__device__ void gemv_body(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                          const __nv_bfloat16* __restrict__ b, int rows, int cols, int gshift, const float* __restrict__ x,
                          const float* __restrict__ gain, const float* __restrict__ z, int hd, float eps,
                          float* __restrict__ y, int accumulate) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    constexpr int CPV = 128 / BITS;
    const int nvec = cols / CPV;
    {
        // before the dependency wait: pull this warp's first row tile into L2 (weights never change)
        const long t0 = (long)blockIdx.x * nw + warp;
        if (t0 * R < rows) {
            const long nr = min((long)R, rows - t0 * R);
            prefetch_l2(reinterpret_cast<const uint4*>(w) + t0 * R * nvec, nr * nvec * 16, lane);
        }
    }
    pdl_wait();
    float* cs = xs + padx_len(cols);
    stage_x(x, gain, z, hd, eps, cols, CPV, xs, cs, red, DN ? DN_XSCALE : 1.f);
    const int ngroups = cols >> (gshift + (BITS == 4 ? 5 : 4));
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const int tiles = (rows + R - 1) / R;
    for (int t = blockIdx.x * nw + warp; t < tiles; t += gridDim.x * nw) {
        const uint4* wr[R];
        const __nv_bfloat16 *sr[R], *br[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const long row = min(t * R + r, rows - 1);  // clamped tail rows: computed, never stored
            wr[r] = w4 + row * nvec;
            sr[r] = s + row * ngroups;
            br[r] = b + row * ngroups;
        }
        float tot[R];
#pragma unroll
        for (int r = 0; r < R; r++) tot[r] = 0.f;
        warp_rows_dot<BITS, R, U, DN>(wr, sr, br, nvec, gshift, xs, cs, lane, tot);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float acc = warp_sum(tot[r]);
            const int row = t * R + r;
            if (lane == r && row < rows) y[row] = accumulate ? y[row] + acc : acc;
        }
    }
}

// Router GEMV (8-bit, one row per warp) with the top-k fused as a tail: the last block to finish (device-wide
// counter, reset by that block, so the kernel can be replayed in a graph) runs topk_warp over the E+1 logits.
// rows = E + 1 (router rows, then the shared-expert gate).
extern "C" __global__ void __launch_bounds__(256) router_topk_q8(
    const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols, int gshift,
    const float* x, const float* gain, float eps, float* y, int k, unsigned int* counter, int* idx, float* wts) {
    gemv_body<8, 1, 4>(w, s, b, rows, cols, gshift, x, gain, nullptr, 0, eps, y, 0);
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < 32) topk_warp(y, rows - 1, k, idx, wts);
    if (threadIdx.x == 0) *counter = 0;
}

// gshift = log2(gs / (128/BITS)): chunks of 16 bytes per quantisation group.
#define GEMV_KERNEL(name, BITS, R, U, DN)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) name(                                                        \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols, int gshift,         \
        const float* x, const float* gain, const float* z, int hd, float eps, float* y, int accumulate) {          \
        gemv_body<BITS, R, U, DN>(w, s, b, rows, cols, gshift, x, gain, z, hd, eps, y, accumulate);                   \
    }

GEMV_KERNEL(gemv_q4, 4, 4, 2, true)
GEMV_KERNEL(gemv_q4_r1, 4, 1, 4, true)
GEMV_KERNEL(gemv_q8, 8, 4, 2, true)
GEMV_KERNEL(gemv_q8_r1, 8, 1, 4, true)
