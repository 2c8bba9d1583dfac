// Gated full attention, decode (batch 1), bf16 KV cache [max_ctx, nkv, hd] per layer.
// attn_prep    : from the stacked projection proj = [q|gate interleaved per head: nh*2*hd | k: nkv*hd | v: nkv*hd]:
//                q = RMSNorm(q)*qn, k = RMSNorm(k)*kn (gains hold the +1), NeoX RoPE on the first `rd` dims
//                (pairs i, i+rd/2, theta^(-2i/rd), position = *pos); q -> qbuf f32 [nh*hd]; k, v -> cache row pos.
//                Grid nh+nkv blocks of hd threads. Bytes ~ (nh+2nkv)*hd*4. FLOPs ~ 10*(nh+nkv)*hd.
// attn_decode  : flash-decoding split: grid (nkv, nsplit), one warp per query head of the kv group; each block
//                takes a contiguous slice of keys 0..=pos and writes (acc[hd], max, sum) partials.
//                Bytes 2*(pos+1)*nkv*hd*2 (K and V once per block). FLOPs 4*(pos+1)*nh*hd.
// attn_combine : merges the partials per head and applies the sigmoid output gate -> o f32 [nh*hd].
#include "common.cuh"

extern "C" __global__ void attn_prep(const float* __restrict__ proj, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const int* __restrict__ pos_ptr, int nh, int nkv,
                                     int hd, int rd, float theta, float eps, float* __restrict__ qbuf,
                                     __nv_bfloat16* __restrict__ kc, __nv_bfloat16* __restrict__ vc) {
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

#define MAXE 8  // hd <= 256

extern "C" __global__ void attn_decode(const float* __restrict__ qbuf, const __nv_bfloat16* __restrict__ kc,
                                       const __nv_bfloat16* __restrict__ vc, const int* __restrict__ pos_ptr, int nh,
                                       int nkv, int hd, float scale, float* __restrict__ part) {
    const int kvh = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = nh / nkv;
    const int qh = kvh * group + warp;
    const int len = *pos_ptr + 1;
    const int chunk = (len + nsplit - 1) / nsplit;
    const int t0 = split * chunk, t1 = min(len, t0 + chunk);
    float q[MAXE], acc[MAXE];
#pragma unroll
    for (int e = 0; e < MAXE; e++) {
        int d = lane + 32 * e;
        q[e] = d < hd ? qbuf[qh * hd + d] * scale : 0.f;
        acc[e] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int t = t0; t < t1; t++) {
        const __nv_bfloat16* kr = kc + ((long)t * nkv + kvh) * hd;
        const __nv_bfloat16* vr = vc + ((long)t * nkv + kvh) * hd;
        float sdot = 0.f;
#pragma unroll
        for (int e = 0; e < MAXE; e++) {
            int d = lane + 32 * e;
            if (d < hd) sdot = fmaf(q[e], bf(kr[d]), sdot);
        }
        float sc = warp_sum(sdot);
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn), p = expf(sc - mn);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < MAXE; e++) {
            int d = lane + 32 * e;
            if (d < hd) acc[e] = acc[e] * corr + p * bf(vr[d]);
        }
        m = mn;
    }
    float* out = part + ((long)qh * nsplit + split) * (hd + 2);
#pragma unroll
    for (int e = 0; e < MAXE; e++) {
        int d = lane + 32 * e;
        if (d < hd) out[d] = acc[e];
    }
    if (lane == 0) {
        out[hd] = m;
        out[hd + 1] = l;
    }
}

extern "C" __global__ void attn_combine(const float* __restrict__ part, const float* __restrict__ proj, int nsplit,
                                        int hd, float* __restrict__ o) {
    // nsplit <= 1024: split weights staged in shared memory in parallel, then one pass over the partial sums
    __shared__ float f[1024];
    __shared__ float red[32];
    const int h = blockIdx.x;
    const float* p = part + (long)h * nsplit * (hd + 2);
    float mloc = -INFINITY;
    for (int s = threadIdx.x; s < nsplit; s += blockDim.x) mloc = fmaxf(mloc, p[s * (hd + 2) + hd]);
    mloc = warp_max(mloc);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mloc;
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red[w]);
    __syncthreads();
    float dl = 0.f;
    for (int s = threadIdx.x; s < nsplit; s += blockDim.x) {
        float ms = p[s * (hd + 2) + hd];
        float fs = ms == -INFINITY ? 0.f : expf(ms - M);
        f[s] = fs;
        dl += fs * p[s * (hd + 2) + hd + 1];
    }
    float den = block_sum(dl, red);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.f;
#pragma unroll 8
        for (int s = 0; s < nsplit; s++) num += f[s] * p[s * (hd + 2) + d];
        float gate = proj[h * 2 * hd + hd + d];
        o[h * hd + d] = num / den * sigmoid_f(gate);
    }
}
