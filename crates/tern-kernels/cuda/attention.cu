// Gated full attention, decode (batch 1), bf16 KV cache [max_ctx, nkv, hd] per layer.
// attn_prep    : from the stacked projection proj = [q|gate interleaved per head: nh*2*hd | k: nkv*hd | v: nkv*hd]:
//                q = RMSNorm(q)*qn, k = RMSNorm(k)*kn (gains hold the +1), NeoX RoPE on the first `rd` dims
//                (pairs i, i+rd/2, theta^(-2i/rd), position = *pos); q -> qbuf f32 [nh*hd]; k, v -> cache row pos.
//                Grid nh+nkv blocks of hd threads. Bytes ~ (nh+2nkv)*hd*4. FLOPs ~ 10*(nh+nkv)*hd.
// attn_decode  : flash-decoding split: grid (nkv, nsplit), one warp per query head of the kv group; each block
//                takes a contiguous slice of keys 0..=pos (at least ATT_MIN_SPLIT keys; later splits may be empty)
//                and writes (acc[hd], max, sum) partials. Keys in batches of ATT_T: 2*ATT_T 16-byte bf16 loads per
//                lane in flight, ATT_T interleaved warp reductions, one online-softmax rescale per batch.
//                Bytes 2*(pos+1)*nkv*hd*2 (K and V once per block). FLOPs 4*(pos+1)*nh*hd. Used when nh/nkv > 8.
// attn_decode_kv: same splits and partials, but each K/V row is read by ONE warp for all (<= 8) query heads of
//                its kv head: grid (nkv, nsplit), AKV_W warps per block take interleaved batches of AKV_B keys of
//                the block's slice; lane owns dims 8*lane..+7; the 32 scores (key j, head g) of a batch are
//                reduce-scattered in 31 shuffles so lane = j*8+g holds one; p and the rescale factors go through
//                smem; the warps' (acc, max, sum) are merged in smem at the end. q (x scale) lives in smem. The next
//                batch's K/V loads are issued before the current batch's math (two-stage pipeline; 231 registers,
//                2 blocks/SM).
//                Bytes 2*(pos+1)*nkv*hd*2 + nh*hd*4. FLOPs 4*(pos+1)*nh*hd.
// attn_combine : merges the partials per head (only the non-empty prefix of splits; blockDim/hd thread groups
//                share the splits) and applies the sigmoid output gate -> o f32 [nh*hd].
// *_seqs       : the same three for B sequences of a batched decode step, grid dimension z (attn_decode_kv_seqs)
//                or y (the others) = row r: proj row r (stride ldp), q/partials/output row r, position posv[r] (host
//                uploaded before the step), row r's K/V cache of this layer from the pointer tables kc[r] / vc[r];
//                attn_combine_seqs writes bf16 rows (stride ldo) for the o_proj GEMM. attn_decode_kv_seqs needs
//                nh/nkv <= 8; it reads each warp's first batch of keys before its dependency wait where all of them
//                are older than the current position (attn_prep_seqs, the kernel before, writes only that row).
#include "common.cuh"


__device__ __forceinline__ void attn_prep_body(const float* __restrict__ proj, const float* __restrict__ qn,
                                               const float* __restrict__ kn, const int* __restrict__ pos_ptr, int nh,
                                               int nkv, int hd, int rd, float theta, float eps,
                                               float* __restrict__ qbuf, __nv_bfloat16* __restrict__ kc,
                                               __nv_bfloat16* __restrict__ vc) {
    __shared__ float red[32];
    __shared__ float xs[256];
    const int bh = blockIdx.x, d = threadIdx.x;
    const bool is_q = bh < nh;
    const int kvh = bh - nh;
    const float gd = (is_q ? qn : kn)[d];  // a weight: read before the dependency wait
    pdl_wait();
    const int pos = *pos_ptr;
    float x = is_q ? proj[bh * 2 * hd + d] : proj[nh * 2 * hd + kvh * hd + d];
    float ss = block_sum(d < hd ? x * x : 0.f, red);
    float y = x * rsqrtf(ss / hd + eps) * gd;
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

extern "C" __global__ void attn_prep(const float* __restrict__ proj, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const int* __restrict__ pos_ptr, int nh, int nkv,
                                     int hd, int rd, float theta, float eps, float* __restrict__ qbuf,
                                     __nv_bfloat16* __restrict__ kc, __nv_bfloat16* __restrict__ vc) {
    KTRACE(30);
    attn_prep_body(proj, qn, kn, pos_ptr, nh, nkv, hd, rd, theta, eps, qbuf, kc, vc);
}

extern "C" __global__ void attn_prep_seqs(const float* __restrict__ proj, int ldp, const float* __restrict__ qn,
                                          const float* __restrict__ kn, const int* __restrict__ posv, int nh, int nkv,
                                          int hd, int rd, float theta, float eps, float* __restrict__ qbuf,
                                          const unsigned long long* __restrict__ kc,
                                          const unsigned long long* __restrict__ vc) {
    KTRACE(34);
    const int r = blockIdx.y;
    attn_prep_body(proj + (long)r * ldp, qn, kn, posv + r, nh, nkv, hd, rd, theta, eps, qbuf + (long)r * nh * hd,
                   reinterpret_cast<__nv_bfloat16*>(kc[r]), reinterpret_cast<__nv_bfloat16*>(vc[r]));
}

#define ATT_T 8          // keys per batch: their K and V loads are all in flight before the first use
#define ATT_MIN_SPLIT 16  // at least this many keys per split (short contexts use fewer, fuller splits)

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
    KTRACE(31);
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
        const float corr = __expf(m - mn);
        l *= corr;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] *= corr;
#pragma unroll
        for (int j = 0; j < ATT_T; j++) {
            const float p = __expf(sc[j] - mn);
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

// one reduce-scatter level over H lanes: the lane keeps values [0, H) (lane & H clear) or [H, 2H) of s[0, 2H),
// summed with its partner's copy, in s[0, H)
template <int H>
__device__ __forceinline__ void rs_level(float* s, int lane) {
    const bool up = lane & H;
#pragma unroll
    for (int i = 0; i < H; i++) {
        const float lo = s[i], hi = s[i + H];
        const float keep = up ? hi : lo;
        const float send = up ? lo : hi;
        s[i] = keep + __shfl_xor_sync(FULL_MASK, send, H);
    }
}

#define AKV_W 4  // warps per block
#define AKV_B 4  // keys per warp batch (AKV_B * AKV_G = 32 scores: one per lane after the reduce-scatter)
#define AKV_G 8  // query heads per kv head (at most)

// K and V rows tb .. tb+AKV_B-1 (clamped to t1-1; t1 >= 1) of this lane's 8 dims
__device__ __forceinline__ void kv_batch(const __nv_bfloat16* kb, const __nv_bfloat16* vb, long rs, int tb, int t1,
                                         uint4 (&kv)[AKV_B], uint4 (&vv)[AKV_B]) {
#pragma unroll
    for (int j = 0; j < AKV_B; j++) {
        const long t = min(tb + j, t1 - 1);
        kv[j] = __ldg(reinterpret_cast<const uint4*>(kb + t * rs));
        vv[j] = __ldg(reinterpret_cast<const uint4*>(vb + t * rs));
    }
}

// PRE: the positions come from the host (pos_ptr uploaded before the step), so this warp's first batch of keys is
// loaded before the dependency wait where every key in it is older than `fresh`, the first position the pass writes
// for this row's sequence (the keys of earlier steps; attn_prep, the kernel before, writes the pass's rows: the
// current position's, and for a speculative verify's rows those of the drafts before it too).
template <bool PF, bool PRE = false>
__device__ __forceinline__ void attn_decode_kv_body(const float* __restrict__ qbuf,
                                                    const __nv_bfloat16* __restrict__ kc,
                                                    const __nv_bfloat16* __restrict__ vc,
                                                    const int* __restrict__ pos_ptr, int nh, int nkv, int hd,
                                                    float scale, float* __restrict__ part, int fresh = 0) {
    __shared__ __align__(16) float qs[AKV_G * 256];           // [g][256] q * scale, zero past hd / group
    __shared__ __align__(16) float accs[AKV_W][AKV_G * 256];  // per-warp partial acc, [g][256]
    __shared__ __align__(16) float ps[AKV_W][AKV_B * AKV_G + AKV_G];  // p[j][g], then corr[g]
    __shared__ float mws[AKV_W][AKV_G], lws[AKV_W][AKV_G];
    const int kvh = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = nh / nkv;
    if (!PRE) pdl_wait();
    const int len = *pos_ptr + 1;
    const int chunk = max((len + nsplit - 1) / nsplit, ATT_MIN_SPLIT);
    const int t0 = min(split * chunk, len), t1 = min(len, t0 + chunk);
    const bool on = 8 * lane < hd;
    const int d0 = on ? 8 * lane : 0;
    const long rs = (long)nkv * hd;
    const __nv_bfloat16* kb = kc + (long)kvh * hd + d0;
    const __nv_bfloat16* vb = vc + (long)kvh * hd + d0;
    // PF: two-stage pipeline, the next batch's K/V loads are in flight during this batch's math
    uint4 kn[AKV_B], vn[AKV_B];
    const int tfirst = t0 + warp * AKV_B;
    // every key the first batch reads (clamped to t1 - 1) is older than the first one the pass writes
    const bool early = PRE && PF && min(t1, tfirst + AKV_B) <= fresh;
    if (early) kv_batch(kb, vb, rs, tfirst, t1, kn, vn);
    if (PRE) pdl_wait();
    {
        // q of the group into smem: all loads first (one round trip)
        constexpr int NQ = AKV_G * 256 / (32 * AKV_W);
        float qv[NQ];
#pragma unroll
        for (int j = 0; j < NQ; j++) {
            const int i = threadIdx.x + 32 * AKV_W * j;
            const int g = i >> 8, d = i & 255;
            qv[j] = (g < group && d < hd) ? qbuf[(kvh * group + g) * hd + d] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < NQ; j++) qs[threadIdx.x + 32 * AKV_W * j] = qv[j] * scale;
    }
    float acc[AKV_G][8];
#pragma unroll
    for (int g = 0; g < AKV_G; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
    float m = -INFINITY, l = 0.f;  // of head lane & 7 (lanes with equal lane & 7 agree)
    __syncthreads();
    const float4* q4 = reinterpret_cast<const float4*>(qs) + 2 * lane;
    if (PF && !early) kv_batch(kb, vb, rs, tfirst, t1, kn, vn);
    for (int tb = tfirst; tb < t1; tb += AKV_W * AKV_B) {
        uint4 kv[AKV_B], vv[AKV_B];
        if (PF) {
#pragma unroll
            for (int j = 0; j < AKV_B; j++) {
                kv[j] = kn[j];
                vv[j] = vn[j];
            }
            if (tb + AKV_W * AKV_B < t1) kv_batch(kb, vb, rs, tb + AKV_W * AKV_B, t1, kn, vn);
        } else {
            kv_batch(kb, vb, rs, tb, t1, kv, vv);
        }
        float kf[AKV_B][8];
#pragma unroll
        for (int j = 0; j < AKV_B; j++) bf16x8(kv[j], kf[j]);
        float s[AKV_B * AKV_G];
#pragma unroll
        for (int g = 0; g < AKV_G; g++) {
            const float4 qa = q4[g * 64], qb = q4[g * 64 + 1];
            const float q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
            for (int j = 0; j < AKV_B; j++) {
                float sd = 0.f;
#pragma unroll
                for (int e = 0; e < 8; e++) sd = fmaf(q[e], kf[j][e], sd);
                s[j * AKV_G + g] = sd;
            }
        }
        // reduce-scatter: after level o the lane keeps the half of its values selected by (lane & o); in the end
        // lane L holds the full score of value index L = j*8 + g
        rs_level<16>(s, lane);
        rs_level<8>(s, lane);
        rs_level<4>(s, lane);
        rs_level<2>(s, lane);
        rs_level<1>(s, lane);
        const float sc = tb + (lane >> 3) < t1 ? s[0] : -INFINITY;
        float bm = fmaxf(sc, __shfl_xor_sync(FULL_MASK, sc, 8));
        bm = fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, 16));
        const float mn = fmaxf(m, bm);  // finite: key tb < t1 is valid
        const float corr = __expf(m - mn);
        const float p = __expf(sc - mn);
        float psum = p + __shfl_xor_sync(FULL_MASK, p, 8);
        psum += __shfl_xor_sync(FULL_MASK, psum, 16);
        l = l * corr + psum;
        m = mn;
        __syncwarp();  // the previous batch's reads of ps are done
        ps[warp][lane] = p;
        if (lane < AKV_G) ps[warp][32 + lane] = corr;
        __syncwarp();
        float pa[AKV_B * AKV_G + AKV_G];
#pragma unroll
        for (int i = 0; i < (AKV_B * AKV_G + AKV_G) / 4; i++) {
            const float4 v4 = reinterpret_cast<const float4*>(ps[warp])[i];
            pa[4 * i] = v4.x;
            pa[4 * i + 1] = v4.y;
            pa[4 * i + 2] = v4.z;
            pa[4 * i + 3] = v4.w;
        }
#pragma unroll
        for (int g = 0; g < AKV_G; g++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= pa[32 + g];
#pragma unroll
        for (int j = 0; j < AKV_B; j++) {
            float vf[8];
            bf16x8(vv[j], vf);
#pragma unroll
            for (int g = 0; g < AKV_G; g++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] = fmaf(pa[j * AKV_G + g], vf[e], acc[g][e]);
        }
    }
    if (lane < AKV_G) {
        mws[warp][lane] = m;
        lws[warp][lane] = l;
    }
    if (on) {
#pragma unroll
        for (int g = 0; g < AKV_G; g++) {
            float4* a4 = reinterpret_cast<float4*>(&accs[warp][g * 256 + 8 * lane]);
            a4[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            a4[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x) {
        const int g = i / hd, d = i % hd;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < AKV_W; w++) M = fmaxf(M, mws[w][g]);
        float num = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < AKV_W; w++) {
            const float f = mws[w][g] == -INFINITY ? 0.f : __expf(mws[w][g] - M);
            num = fmaf(f, accs[w][g * 256 + d], num);
            den = fmaf(f, lws[w][g], den);
        }
        float* out = part + ((long)(kvh * group + g) * nsplit + split) * (hd + 2);
        out[d] = num;
        if (d == 0) {
            out[hd] = M;
            out[hd + 1] = den;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * AKV_W) attn_decode_kv(
    const float* __restrict__ qbuf, const __nv_bfloat16* __restrict__ kc, const __nv_bfloat16* __restrict__ vc,
    const int* __restrict__ pos_ptr, int nh, int nkv, int hd, float scale, float* __restrict__ part) {
    KTRACE(32);
    attn_decode_kv_body<true>(qbuf, kc, vc, pos_ptr, nh, nkv, hd, scale, part);
}

extern "C" __global__ void __launch_bounds__(32 * AKV_W) attn_decode_kv_seqs(
    const float* __restrict__ qbuf, const unsigned long long* __restrict__ kc,
    const unsigned long long* __restrict__ vc, const int* __restrict__ posv, const int* __restrict__ freshv, int nh,
    int nkv, int hd, float scale, float* __restrict__ part) {
    KTRACE(35);
    const int r = blockIdx.z;
    attn_decode_kv_body<true, true>(qbuf + (long)r * nh * hd, reinterpret_cast<const __nv_bfloat16*>(kc[r]),
                                    reinterpret_cast<const __nv_bfloat16*>(vc[r]), posv + r, nh, nkv, hd, scale,
                                    part + (long)r * nh * gridDim.y * (hd + 2), freshv[r]);
}

template <typename OutT>
__device__ __forceinline__ void attn_combine_body(const float* __restrict__ part, const float* __restrict__ proj,
                                                  int nsplit, int hd, OutT* __restrict__ o) {
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
        float fs = ms == -INFINITY ? 0.f : __expf(ms - M);
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
        o[h * hd + threadIdx.x] = to_act<OutT>(num / den * sigmoid_f(gate));
    }
}

extern "C" __global__ void attn_combine(const float* __restrict__ part, const float* __restrict__ proj, int nsplit,
                                        int hd, float* __restrict__ o) {
    KTRACE(33);
    attn_combine_body<float>(part, proj, nsplit, hd, o);
}

extern "C" __global__ void attn_combine_seqs(const float* __restrict__ part, const float* __restrict__ proj, int ldp,
                                             int nsplit, int hd, __nv_bfloat16* __restrict__ o, int ldo) {
    KTRACE(36);
    const int r = blockIdx.y, nh = gridDim.x;
    attn_combine_body<__nv_bfloat16>(part + (long)r * nh * nsplit * (hd + 2), proj + (long)r * ldp, nsplit, hd,
                                     o + (long)r * ldo);
}
