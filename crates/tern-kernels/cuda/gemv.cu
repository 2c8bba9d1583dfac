// Quantised GEMV, batch 1 (decode): y = W x for an MLX affine 4-bit or 8-bit matrix W [rows, cols] (group gs,
// bf16 scales/biases), x f32 [cols], y f32 [rows]. One warp per row, 16-byte weight loads, x staged in shared
// memory (padded) by a fused prologue:
//   * plain copy of x;
//   * RMSNorm: x * rsqrt(mean(x^2) + eps) * gain  (gain already holds the +1 of the (1+w) norms);
//   * gated RMSNorm per head of `hd` values (Gated DeltaNet output): norm(x_h) * gain[j] * silu(z).
// Epilogue: y = acc, or y += acc (residual add, each row owned by one warp).
// Bytes per call: rows*cols*BITS/8 + rows*(cols/gs)*4 (+ 4*cols per block for x, from L2).
// FLOPs per call: 2*rows*cols (+ 3 per weight for the affine correction, done per 16-byte chunk).
#include "common.cuh"

template <int BITS>
__device__ void gemv_body(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                          const __nv_bfloat16* __restrict__ b, int rows, int cols, int gs, const float* __restrict__ x,
                          const float* __restrict__ gain, const float* __restrict__ z, int hd, float eps,
                          float* __restrict__ y, int accumulate) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    if (z != nullptr) {
        // gated RMSNorm: one warp per head
        for (int h = warp; h < cols / hd; h += nw) {
            float ss = 0.f;
            for (int j = lane; j < hd; j += 32) ss += x[h * hd + j] * x[h * hd + j];
            float r = rsqrtf(warp_sum(ss) / hd + eps);
            for (int j = lane; j < hd; j += 32) {
                int c = h * hd + j;
                xs[padi(c)] = x[c] * r * gain[j] * silu_f(z[c]);
            }
        }
    } else if (gain != nullptr) {
        float ss = 0.f;
        for (int c = tid; c < cols; c += blockDim.x) ss += x[c] * x[c];
        float r = rsqrtf(block_sum(ss, red) / cols + eps);
        for (int c = tid; c < cols; c += blockDim.x) xs[padi(c)] = x[c] * r * gain[c];
    } else {
        for (int c = tid; c < cols; c += blockDim.x) xs[padi(c)] = x[c];
    }
    __syncthreads();
    for (int r = blockIdx.x * nw + warp; r < rows; r += gridDim.x * nw) {
        float acc = warp_row_dot<BITS>(w, s, b, r, cols, gs, xs, lane);
        if (lane == 0) y[r] = accumulate ? y[r] + acc : acc;
    }
}

extern "C" __global__ void __launch_bounds__(256) gemv_q4(const uint32_t* w, const __nv_bfloat16* s,
                                                          const __nv_bfloat16* b, int rows, int cols, int gs,
                                                          const float* x, const float* gain, const float* z, int hd,
                                                          float eps, float* y, int accumulate) {
    gemv_body<4>(w, s, b, rows, cols, gs, x, gain, z, hd, eps, y, accumulate);
}

extern "C" __global__ void __launch_bounds__(256) gemv_q8(const uint32_t* w, const __nv_bfloat16* s,
                                                          const __nv_bfloat16* b, int rows, int cols, int gs,
                                                          const float* x, const float* gain, const float* z, int hd,
                                                          float eps, float* y, int accumulate) {
    gemv_body<8>(w, s, b, rows, cols, gs, x, gain, z, hd, eps, y, accumulate);
}
