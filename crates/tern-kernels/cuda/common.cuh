// Shared device helpers for tern's kernels (included by every .cu; not compiled on its own).
// MLX affine quantisation: w = scale[g] * q + bias[g], q packed lowest bits first in u32 words, groups of `gs`
// columns of one row, bf16 scales/biases [rows, cols/gs].
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. `red`: 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ float bf(const __nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Index of column c in a shared-memory vector padded by one float every 32 (conflict-free strided reads).
__device__ __forceinline__ int padi(int c) { return c + (c >> 5); }
__host__ __device__ __forceinline__ int padded_len(int n) { return n + (n >> 5) + 1; }

// Code k (0-based) of a packed word as an exact float, via the 2^23 magic-number trick (no int->float convert).
template <int BITS>
__device__ __forceinline__ float code(uint32_t w, int k) {
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    return __uint_as_float(0x4B000000u | ((w >> (BITS * k)) & MASK)) - 8388608.f;
}

// Dot of one 16-byte chunk of packed codes with the matching x values (padded smem), affine-corrected:
// returns scale * sum(q*x) + bias * sum(x) over the 128/BITS columns starting at `col0`.
template <int BITS>
__device__ __forceinline__ float qdot16(uint4 wv, const float* xs, int col0, float scale, float bias) {
    constexpr int PER = 32 / BITS;  // codes per word
    uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
    float qx = 0.f, sx = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int k = 0; k < PER; k++) {
            float xv = xs[padi(col0 + j * PER + k)];
            qx = fmaf(code<BITS>(w[j], k), xv, qx);
            sx += xv;
        }
    }
    return fmaf(scale, qx, bias * sx);
}

// One warp: scale/bias-corrected dot of row `r` of a quantised [rows, cols] matrix with padded smem x.
// Requires cols*BITS/32 to be a multiple of 4 (16-byte rows) and gs a multiple of 128/BITS.
template <int BITS>
__device__ __forceinline__ float warp_row_dot(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                              const __nv_bfloat16* __restrict__ b, long r, int cols, int gs,
                                              const float* xs, int lane) {
    constexpr int COLS_PER_VEC = 128 / BITS;
    const int nvec = cols / COLS_PER_VEC;
    const uint4* row = reinterpret_cast<const uint4*>(w + r * (long)(cols * BITS / 32));
    const int ngroups = cols / gs;
    const __nv_bfloat16* srow = s + r * ngroups;
    const __nv_bfloat16* brow = b + r * ngroups;
    float acc = 0.f;
    for (int u = lane; u < nvec; u += 32) {
        uint4 wv = __ldg(row + u);
        int col0 = u * COLS_PER_VEC;
        int g = col0 / gs;
        acc += qdot16<BITS>(wv, xs, col0, bf(srow[g]), bf(brow[g]));
    }
    return warp_sum(acc);
}
