// Small decode kernels and device-side initialisation.
// embed_q4      : x[c] = scale * q + bias for row tok[0] of the 4-bit embedding [vocab, H]. Bytes H/2 + scales.
// argmax_partial: per-block (max, index) of logits [n] (ties -> lower index). Bytes 4n.
// argmax_final  : reduces the partials, writes tok[0] = argmax and advances the position counter pos[0] += 1.
// fill_u32_hash / fill_bf16 / fill_f32_uniform: random weights generated on the device (benchmark model).
// pdl_nop       : nothing but the dependency wait: stands in for a launch the bench leaves out (gpu.rs KLaunch), so
//                 that the chain's distances (what a kernel may read before its wait) stay as in the real step.
#include "common.cuh"

extern "C" __global__ void pdl_nop() { pdl_wait(); }

extern "C" __global__ void embed_q4(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                    const __nv_bfloat16* __restrict__ b, int cols, int gs,
                                    const int* __restrict__ tok, float* __restrict__ x) {
    KTRACE(1);
    pdl_wait();
    const long r = tok[0];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        uint32_t word = w[r * (cols / 8) + c / 8];
        long g = r * (cols / gs) + c / gs;
        x[c] = bf(s[g]) * (float)((word >> (4 * (c % 8))) & 0xF) + bf(b[g]);
    }
}

extern "C" __global__ void argmax_partial(const float* __restrict__ v, int n, float* __restrict__ pv,
                                          int* __restrict__ pi) {
    KTRACE(2);
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float x = v[i];
        if (x > bv || (x == bv && i < bi)) { bv = x; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w2 = 1; w2 < (int)(blockDim.x >> 5); w2++)
            if (sv[w2] > bv || (sv[w2] == bv && si[w2] < bi)) { bv = sv[w2]; bi = si[w2]; }
        bv = sv[0] > bv || (sv[0] == bv && si[0] < bi) ? sv[0] : bv;
        pv[blockIdx.x] = bv;
        pi[blockIdx.x] = bi;
    }
}

extern "C" __global__ void argmax_final(const float* __restrict__ pv, const int* __restrict__ pi, int n,
                                        int* __restrict__ tok, int* __restrict__ pos) {
    KTRACE(3);
    pdl_wait();
    // one warp: lanes scan interleaved partials (independent loads), then a shuffle reduction (ties -> lower index)
    const int lane = threadIdx.x & 31;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lane; i < n; i += 32) {
        const float v = pv[i];
        const int j = pi[i];
        if (v > bv || (v == bv && j < bi)) { bv = v; bi = j; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (threadIdx.x == 0) {
        tok[0] = bi == 0x7fffffff ? 0 : bi;
        pos[0] += 1;
    }
}

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return (uint32_t)x;
}

extern "C" __global__ void fill_u32_hash(uint32_t* p, long n, unsigned long long seed) {
    pdl_wait();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        p[i] = hash32(seed * 0x9E3779B97F4A7C15ull + (uint64_t)i);
}

extern "C" __global__ void fill_bf16(__nv_bfloat16* p, long n, float v) {
    pdl_wait();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(v);
}

extern "C" __global__ void fill_f32_uniform(float* p, long n, unsigned long long seed, float lo, float hi) {
    pdl_wait();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        p[i] = lo + (hi - lo) * (hash32(seed * 0x9E3779B97F4A7C15ull + (uint64_t)i) >> 8) * (1.f / 16777216.f);
}
