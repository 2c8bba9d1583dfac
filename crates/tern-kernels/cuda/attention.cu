// Gated full attention, decode (batch 1), bf16 KV cache [max_ctx, nkv, hd] per layer.
// attn_prep    : from the stacked projection proj = [q|gate interleaved per head: nh*2*hd | k: nkv*hd | v: nkv*hd]:
//                q = RMSNorm(q)*qn, k = RMSNorm(k)*kn (gains hold the +1), NeoX RoPE on the first `rd` dims
//                (pairs i, i+rd/2, theta^(-2i/rd), position = *pos); q -> qbuf f32 [nh*hd]; k, v -> cache row pos.
//                Grid nh+nkv blocks of hd threads. Bytes ~ (nh+2nkv)*hd*4. FLOPs ~ 10*(nh+nkv)*hd.
// attn_decode  : flash-decoding split: grid (nkv, nsplit), one warp per query head of the kv group; each block
//                takes a contiguous slice of keys 0..=pos (at least ATT_MIN_SPLIT keys; later splits may be empty)
//                and writes (acc[hd], max, sum) partials. Keys in batches of ATT_T: 2*ATT_T 16-byte bf16 loads per
//                lane in flight, ATT_T interleaved warp reductions, one online-softmax rescale per batch.
//                Bytes 2*(pos+1)*nkv*hd*2 (K and V once per block). FLOPs 4*(pos+1)*nh*hd.
// attn_combine : merges the partials per head (only the non-empty prefix of splits; blockDim/hd thread groups
//                share the splits) and applies the sigmoid output gate -> o f32 [nh*hd].
#include "common.cuh"

extern "C" __global__ void attn_prep(const float* __restrict__ proj, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const int* __restrict__ pos_ptr, int nh, int nkv,
                                     int hd, int rd, float theta, float eps, float* __restrict__ qbuf,
                                     __nv_bfloat16* __restrict__ kc, __nv_bfloat16* __restrict__ vc) {
    pdl_wait();
    __shared__ float red[32];
    __shared__ float xs[256];
    const int bh = blockIdx.x, d = threadIdx.x;
    const int pos = *pos_ptr;
    const bool is_q = bh < nh;
    const int kvh = bh - nh;
    float x = is_q ? proj[bh * 2 * hd + d] : proj[nh * 2 * hd + kvh * hd + d];
    float ss = block_sum(d < hd ? x * x : 0.f, red);
    const float* g = is_q ? qn : kn;
    float y = x * rsqrtf(ss / hd + eps) * g[d];
    xs[d] = y;
    __syncthreads();
    const int half = rd / 2;
    if (d < rd) {
        int i = d < half ? d : d - half;
        float inv = 1.f / powf(theta, (float)(2 * i) / (float)rd);
        float ang = inv * (float)pos;
        float c = cosf(ang), s = sinf(ang);
        y = d < half ? xs[d] * c - xs[d + half] * s : xs[d] * c + xs[d - half] * s;
    }
    if (is_q) {
        qbuf[bh * hd + d] = y;
    } else {
        long row = ((long)pos * nkv + kvh) * hd + d;
        kc[row] = __float2bfloat16(y);
        vc[row] = __float2bfloat16(proj[nh * 2 * hd + nkv * hd + kvh * hd + d]);
    }
}

#define ATT_T 8          // keys per batch: their K and V loads are all in flight before the first use
#define ATT_MIN_SPLIT 32  // at least this many keys per split (short contexts use fewer, fuller splits)

__device__ __forceinline__ void bf16x8(uint4 v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

extern "C" __global__ void attn_decode(const float* __restrict__ qbuf, const __nv_bfloat16* __restrict__ kc,
                                       const __nv_bfloat16* __restrict__ vc, const int* __restrict__ pos_ptr, int nh,
                                       int nkv, int hd, float scale, float* __restrict__ part) {
    pdl_wait();
    // lane owns dims 8*lane .. 8*lane+7 (one 16-byte bf16 load per K/V row); the warps of a block (the query heads
    // of one kv head) read the same K/V rows, which L1 serves after the first.
    const int kvh = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = nh / nkv;
    const int qh = kvh * group + warp;
    const int len = *pos_ptr + 1;
    const int chunk = max((len + nsplit - 1) / nsplit, ATT_MIN_SPLIT);
    const int t0 = min(split * chunk, len), t1 = min(len, t0 + chunk);
    const bool on = 8 * lane < hd;
    const int d0 = on ? 8 * lane : 0;
    float q[8], acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        q[e] = on ? qbuf[qh * hd + d0 + e] * scale : 0.f;
        acc[e] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const long rs = (long)nkv * hd;  // elements between consecutive keys
    const __nv_bfloat16* kb = kc + (long)kvh * hd + d0;
    const __nv_bfloat16* vb = vc + (long)kvh * hd + d0;
    for (int tb = t0; tb < t1; tb += ATT_T) {
        uint4 kv[ATT_T], vv[ATT_T];
#pragma unroll
        for (int j = 0; j < ATT_T; j++) {
            const long t = min(tb + j, t1 - 1);
            kv[j] = __ldg(reinterpret_cast<const uint4*>(kb + t * rs));
            vv[j] = __ldg(reinterpret_cast<const uint4*>(vb + t * rs));
        }
        float sc[ATT_T];
#pragma unroll
        for (int j = 0; j < ATT_T; j++) {
            float kf[8];
            bf16x8(kv[j], kf);
            float sdot = 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++) sdot = fmaf(q[e], kf[e], sdot);
            sc[j] = sdot;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int j = 0; j < ATT_T; j++) sc[j] += __shfl_xor_sync(FULL_MASK, sc[j], o);
        float mn = m;
#pragma unroll
        for (int j = 0; j < ATT_T; j++) {
            if (tb + j >= t1) sc[j] = -INFINITY;
            mn = fmaxf(mn, sc[j]);
        }
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= corr;
#pragma unroll
        for (int j = 0; j < ATT_T; j++) {
            const float p = expf(sc[j] - mn);
            l += p;
            float vf[8];
            bf16x8(vv[j], vf);
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = fmaf(p, vf[e], acc[e]);
        }
        m = mn;
    }
    float* out = part + ((long)qh * nsplit + split) * (hd + 2);
    if (on) {
#pragma unroll
        for (int e = 0; e < 8; e++) out[d0 + e] = acc[e];
    }
    if (lane == 0) {
        out[hd] = m;
        out[hd + 1] = l;
    }
}

extern "C" __global__ void attn_combine(const float* __restrict__ part, const float* __restrict__ proj, int nsplit,
                                        int hd, float* __restrict__ o) {
    pdl_wait();
    // nsplit <= 1024. Non-empty splits form a prefix 0..na (attn_decode); the block's threads are
    // blockDim/hd groups, each summing an interleaved subset of the splits for every dim d, merged in smem.
    __shared__ float f[1024];
    __shared__ float red[32];
    __shared__ float acc[1024];
    __shared__ int na_s;
    const int h = blockIdx.x;
    const float* p = part + (long)h * nsplit * (hd + 2);
    if (threadIdx.x == 0) na_s = 0;
    float mloc = -INFINITY;
    int nloc = 0;
    for (int s = threadIdx.x; s < nsplit; s += blockDim.x) {
        const float ms = p[s * (hd + 2) + hd];
        mloc = fmaxf(mloc, ms);
        if (ms != -INFINITY) nloc = s + 1;
    }
    mloc = warp_max(mloc);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mloc;
    __syncthreads();
    if (nloc > 0) atomicMax(&na_s, nloc);
    float M = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red[w]);
    __syncthreads();
    const int na = na_s;
    float dl = 0.f;
    for (int s = threadIdx.x; s < na; s += blockDim.x) {
        float ms = p[s * (hd + 2) + hd];
        float fs = ms == -INFINITY ? 0.f : expf(ms - M);
        f[s] = fs;
        dl += fs * p[s * (hd + 2) + hd + 1];
    }
    float den = block_sum(dl, red);  // (its barriers also publish f)
    const int groups = blockDim.x / hd, grp = threadIdx.x / hd, d = threadIdx.x % hd;
    if (grp < groups) {
        float num = 0.f;
#pragma unroll 8
        for (int s = grp; s < na; s += groups) num += f[s] * p[s * (hd + 2) + d];
        acc[threadIdx.x] = num;
    }
    __syncthreads();
    if (threadIdx.x < hd) {
        float num = 0.f;
        for (int g = 0; g < groups; g++) num += acc[g * hd + threadIdx.x];
        float gate = proj[h * 2 * hd + hd + threadIdx.x];
        o[h * hd + threadIdx.x] = num / den * sigmoid_f(gate);
    }
}
