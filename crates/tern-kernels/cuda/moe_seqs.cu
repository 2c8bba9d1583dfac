// Streamed MoE for a few tokens per expert (the batched decode step: B <= 64 tokens, so 1-4 tokens per routed
// expert): GEMV-style kernels over the expert-sorted pairs and tile list of moe_align (prefill.cu). Each block
// bulk-copies (TMA) a slice of ONE expert's rows into shared memory once and applies it to every token routed to
// that expert, GU_TG / DS_TG tokens per pass from shared memory (f32 activations x 2^90 for the denormal decode of
// common.cuh, with 32-column chunk sums); dequantisation is exact (s*q + b in f32), accumulation f32, no atomics
// (deterministic). Where the grouped tensor-core GEMMs (gemm.cu) dequantise every weight tile into shared memory
// for a 64-token tile that holds 1-4 tokens, these read each weight byte once and do 2 instructions per weight and
// token.
//
// router_seqs_q{4,8} logits[t, r] = W[r] . xn[t] for the n rows of xn [n, cols] and the rows of W (the router and
//                   the shared-expert gate, rows = E + 1): grid (rows / 16, n / 4); each block stages its 4 tokens
//                   (x 2^90, chunk sums) and each warp streams 2 weight rows from global memory (L2: the router is
//                   0.5 MB) through chunk_dot, the decode router's arithmetic. Where router_rows (prefill.cu) runs
//                   5 blocks of 64 x 64 outputs for any n <= 64, this runs (rows / 16) x (n / 4) small ones.
//                   Bytes rows*cols*BITS/8 per token group (L2) + 4*n*cols. FLOPs 2*n*rows*cols.
// moe_gate_up_seqs  act[p, j] = silu(G_e[j] . xn[t]) * (U_e[j] . xn[t]) for every pair p = (token t, expert e) of
//                   tile blockIdx.y (t = rowmap[p]), rows j in [16 blockIdx.x, +16) of the expert's n = I (or Is for
//                   the shared expert E); xn f32 [N, H] (the post-norm rows), act f32 [pairs, ld]. 256 threads, warp
//                   w owns j = 2w, 2w+1 (4 rows). Bytes: the routed experts' gate|up rows once + H*4 per pair (x
//                   from L2). FLOPs 2 * pairs * 2n * H.
// moe_down_seqs     ybuf[p, r] = D_e[r] . act[p] for the pairs of tile blockIdx.y and rows r in [64 blockIdx.x, +64)
//                   of H; the expert's n = I (or Is) columns. Lanes are grouped per row (the next power of two >= n/32
//                   lanes, segmented shuffle sums), 8 warps x 32/lanes-per-row rows per pass. Bytes: the experts' down
//                   rows once + n*4 per pair. FLOPs 2 * pairs * H * n.
// Requirements (checked on the host): H and n multiples of 32, group size 32 << gshift, per-expert strides words /
// groups (u32 words / scale entries), row bytes multiples of 16; tiles from moe_align over the same pairs.
#include "common.cuh"

#define RS_R 16   // router rows per block (2 per warp)
#define RS_TG 4   // router tokens per block
#define GU_J 16  // j per block (2 * GU_J rows: gate and up)
#define GU_TG 4  // tokens per pass
#define DS_RB 64  // output rows per block
#define DS_TG 8   // tokens per pass

// Stage rows rowmap[p0 + i] (or p0 + i when direct; i < nt, up to TG rows) of src [*, ld] (f32, n columns) into
// xs[i] (x DN_XSCALE, padded) and their CPV-column sums into cs[i][c]; rows i >= nt are zero. Every thread of the
// block calls it (shuffles over the CPV/4 threads of a chunk: n % CPV == 0).
template <int TG, int CPV = 32>
__device__ __forceinline__ void stage_rows(const float* __restrict__ src, long ld, const int* __restrict__ rowmap,
                                           int p0, int nt, int n, bool direct, float* xs, int xstride, float* cs) {
    constexpr int TPC = CPV / 4;  // threads per chunk
    const int n4 = n / 4, total = TG * n4;
    for (int i0 = 0; i0 < total; i0 += blockDim.x) {  // uniform trip count: the shuffles see every lane
        const int i = i0 + threadIdx.x;
        const int tt = i / n4, c4 = i - tt * n4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < total && tt < nt) {
            const long row = direct ? (long)(p0 + tt) : (long)rowmap[p0 + tt];
            v = *reinterpret_cast<const float4*>(src + row * ld + 4 * c4);
        }
        float sum = v.x + v.y + v.z + v.w;
#pragma unroll
        for (int o = 1; o < TPC; o <<= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        if (i < total) {
            *reinterpret_cast<float4*>(xs + tt * xstride + padx(4 * c4)) =
                make_float4(v.x * DN_XSCALE, v.y * DN_XSCALE, v.z * DN_XSCALE, v.w * DN_XSCALE);
            if ((c4 & (TPC - 1)) == 0) cs[tt * (n / CPV) + c4 / TPC] = sum;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up_seqs(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, int E, int I, int Is, int H, int gshift, const float* __restrict__ xn,
    const int* __restrict__ ntile, const int* __restrict__ tiles, const int* __restrict__ rowmap,
    float* __restrict__ act, int ld) {
    KTRACE(43);
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nvec = H / 32, ng = H >> (gshift + 5), rowb = H / 2;
    pdl_wait();  // the tile list comes from moe_align
    const int t = blockIdx.y;
    if (t >= *ntile) return;
    const int e = tiles[3 * t], p0 = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    const int n = e == E ? Is : I;
    const int j0 = blockIdx.x * GU_J;
    if (j0 >= n || cnt <= 0) return;
    const int nj = min(GU_J, n - j0);
    // shared memory: codes [2][GU_J][rowb] | scales, biases [2][GU_J][ng] f32 | x [GU_TG][padx_len(H)] | sums
    // [GU_TG][nvec]
    unsigned char* wsm = smem;
    float* ssm = reinterpret_cast<float*>(smem + 2 * GU_J * rowb);
    float* bsm = ssm + 2 * GU_J * ng;
    const int xstride = padx_len(H);
    float* xs = bsm + 2 * GU_J * ng;
    float* cs = xs + GU_TG * xstride;
    const unsigned char* we = reinterpret_cast<const unsigned char*>(w + e * words);
    if (tid == 0) {
        mbar_init(&full, 1);
        mbar_fence_init();
        mbar_expect_tx(&full, 2u * nj * rowb);
        bulk_g2s(wsm, we + (long)j0 * rowb, nj * rowb, &full);
        bulk_g2s(wsm + GU_J * rowb, we + (long)(n + j0) * rowb, nj * rowb, &full);
    }
    for (int i = tid; i < 2 * GU_J * ng; i += blockDim.x) {
        const int half = i / (GU_J * ng), jr = (i / ng) % GU_J, g = i % ng;
        if (jr < nj) {
            const long gi = e * groups + (long)((half ? n : 0) + j0 + jr) * ng + g;
            ssm[i] = bf(s[gi]);
            bsm[i] = bf(b[gi]);
        }
    }
    const int jw = 2 * warp;  // this warp's first j (rows r = 2q + up of j = jw + q)
    for (int g0 = 0; g0 < cnt; g0 += GU_TG) {
        const int nt = min(GU_TG, cnt - g0);
        __syncthreads();  // the previous pass is done with xs (and the barrier init / scales are visible)
        stage_rows<GU_TG>(xn, H, rowmap, p0 + g0, nt, H, false, xs, xstride, cs);
        __syncthreads();
        if (g0 == 0) mbar_wait(&full, 0);
        float tot[GU_TG][4];
#pragma unroll
        for (int i = 0; i < GU_TG; i++) tot[i][0] = tot[i][1] = tot[i][2] = tot[i][3] = 0.f;
        if (jw < nj) {
#pragma unroll 1
            for (int u = lane; u < nvec; u += 32) {
                const int gi = u >> gshift;
                uint4 wv[4];
                float sc[4], bs[4];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    // a row past nj (an expert whose n is not a multiple of 16) reads stale shared memory; its
                    // result is never stored
                    const int row = (r & 1) * GU_J + jw + (r >> 1);
                    wv[r] = reinterpret_cast<const uint4*>(wsm + row * rowb)[u];
                    sc[r] = ssm[row * ng + gi];
                    bs[r] = bsm[row * ng + gi];
                }
#pragma unroll
                for (int i = 0; i < GU_TG; i++)
                    if (i < nt) chunk_dot<4, 4>(wv, xs + i * xstride + padx(u * 32), sc, bs, cs[i * nvec + u], tot[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < GU_TG; i++)
#pragma unroll
            for (int r = 0; r < 4; r++) tot[i][r] = warp_sum(tot[i][r]);
        // lane 2i + q stores act of token i, j = jw + q
        float gv = 0.f, uv = 0.f;
#pragma unroll
        for (int i = 0; i < GU_TG; i++)
#pragma unroll
            for (int q = 0; q < 2; q++)
                if (lane == 2 * i + q) {
                    gv = tot[i][2 * q];
                    uv = tot[i][2 * q + 1];
                }
        const int i = lane >> 1, q = lane & 1;
        if (lane < 2 * GU_TG && i < nt && jw + q < nj) act[(long)(p0 + g0 + i) * ld + j0 + jw + q] = silu_f(gv) * uv;
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_down_seqs(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, int E, int I, int Is, int H, int gshift, const float* __restrict__ act, int ld,
    const int* __restrict__ ntile, const int* __restrict__ tiles, float* __restrict__ ybuf) {
    KTRACE(44);
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pdl_wait();  // the tile list comes from moe_align, act from moe_gate_up_seqs
    const int t = blockIdx.y;
    if (t >= *ntile) return;
    const int e = tiles[3 * t], p0 = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    const int n = e == E ? Is : I;
    const int r0 = blockIdx.x * DS_RB;
    if (r0 >= H || cnt <= 0) return;
    const int nr = min(DS_RB, H - r0);
    const int nvec = n / 32, ng = n >> (gshift + 5), rowb = n / 2;
    const int Imax = I > Is ? I : Is;
    // shared memory (sized for Imax): codes [DS_RB][rowb] | scales, biases [DS_RB][ng] f32 | act [DS_TG][padx_len(n)]
    // | sums [DS_TG][nvec]
    unsigned char* wsm = smem;
    float* ssm = reinterpret_cast<float*>(smem + DS_RB * (Imax / 2));
    float* bsm = ssm + DS_RB * (Imax >> (gshift + 5));
    const int xstride = padx_len(n);
    float* xs = bsm + DS_RB * (Imax >> (gshift + 5));
    float* cs = xs + DS_TG * padx_len(Imax);
    const unsigned char* we = reinterpret_cast<const unsigned char*>(w + e * words);
    if (tid == 0) {
        mbar_init(&full, 1);
        mbar_fence_init();
        mbar_expect_tx(&full, (uint32_t)(nr * rowb));
        bulk_g2s(wsm, we + (long)r0 * rowb, nr * rowb, &full);
    }
    for (int i = tid; i < nr * ng; i += blockDim.x) {
        const long gi = e * groups + (long)(r0 + i / ng) * ng + i % ng;
        ssm[i] = bf(s[gi]);
        bsm[i] = bf(b[gi]);
    }
    // lanes per row: the next power of two >= nvec (at most 32, then each lane takes several chunks)
    int lpr = 1;
    while (lpr < nvec && lpr < 32) lpr <<= 1;
    const int rpp = 32 / lpr, sub = lane & (lpr - 1), rsub = lane / lpr;
    for (int g0 = 0; g0 < cnt; g0 += DS_TG) {
        const int nt = min(DS_TG, cnt - g0);
        __syncthreads();
        stage_rows<DS_TG>(act, ld, nullptr, p0 + g0, nt, n, true, xs, xstride, cs);
        __syncthreads();
        if (g0 == 0) mbar_wait(&full, 0);
#pragma unroll 1
        for (int base = warp * rpp; base < nr; base += 8 * rpp) {  // uniform over the warp
            const int row = base + rsub;
            const bool valid = row < nr;
            float d[DS_TG];
#pragma unroll
            for (int i = 0; i < DS_TG; i++) d[i] = 0.f;
            if (valid) {
#pragma unroll 1
                for (int u = sub; u < nvec; u += lpr) {
                    const int gi = u >> gshift;
                    const uint4 wq[1] = {reinterpret_cast<const uint4*>(wsm + row * rowb)[u]};
                    const float sc[1] = {ssm[row * ng + gi]}, bs[1] = {bsm[row * ng + gi]};
#pragma unroll
                    for (int i = 0; i < DS_TG; i++) {
                        if (i < nt) {
                            float acc[1] = {d[i]};
                            chunk_dot<4, 1>(wq, xs + i * xstride + padx(u * 32), sc, bs, cs[i * nvec + u], acc);
                            d[i] = acc[0];
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < DS_TG; i++)
                for (int o = lpr >> 1; o > 0; o >>= 1) d[i] += __shfl_xor_sync(FULL_MASK, d[i], o);
            if (valid && sub == 0) {
#pragma unroll
                for (int i = 0; i < DS_TG; i++)
                    if (i < nt) ybuf[(long)(p0 + g0 + i) * H + r0 + row] = d[i];
            }
        }
    }
}

template <int BITS>
__device__ __forceinline__ void router_seqs_body(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                                 const __nv_bfloat16* __restrict__ b, int rows, int cols, int gshift,
                                                 const float* __restrict__ xn, int n, float* __restrict__ logits) {
    constexpr int CPV = 128 / BITS;  // columns per 16-byte chunk
    __shared__ __align__(16) float xs[RS_TG * (2048 + 2048 / 8 + 4)];
    __shared__ float cs[RS_TG * (2048 / 16)];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nvec = cols / CPV, ng = cols >> (gshift + (BITS == 4 ? 5 : 4)), xstride = padx_len(cols);
    const int t0 = blockIdx.y * RS_TG, nt = min(RS_TG, n - t0);
    pdl_wait();  // xn comes from the post-norm
    stage_rows<RS_TG, CPV>(xn, cols, nullptr, t0, nt, cols, true, xs, xstride, cs);
    __syncthreads();
    const int r0 = blockIdx.x * RS_R + 2 * warp;
    const uint4* wr[2];
    const __nv_bfloat16 *sr[2], *br[2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int row = min(r0 + q, rows - 1);  // a valid address; a row past the end is never stored
        wr[q] = reinterpret_cast<const uint4*>(w) + (long)row * nvec;
        sr[q] = s + (long)row * ng;
        br[q] = b + (long)row * ng;
    }
    float tot[RS_TG][2];
#pragma unroll
    for (int t = 0; t < RS_TG; t++) tot[t][0] = tot[t][1] = 0.f;
#pragma unroll 1
    for (int u = lane; u < nvec; u += 32) {
        const int g = u >> gshift;
        uint4 wv[2];
        float sc[2], bs[2];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            wv[q] = __ldg(wr[q] + u);
            sc[q] = bf(sr[q][g]);
            bs[q] = bf(br[q][g]);
        }
#pragma unroll
        for (int t = 0; t < RS_TG; t++)
            if (t < nt) chunk_dot<BITS, 2>(wv, xs + t * xstride + padx(u * CPV), sc, bs, cs[t * nvec + u], tot[t]);
    }
#pragma unroll
    for (int t = 0; t < RS_TG; t++) {
        tot[t][0] = warp_sum(tot[t][0]);
        tot[t][1] = warp_sum(tot[t][1]);
    }
    float v = 0.f;
#pragma unroll
    for (int t = 0; t < RS_TG; t++)
#pragma unroll
        for (int q = 0; q < 2; q++)
            if (lane == 2 * t + q) v = tot[t][q];
    const int t = lane >> 1, row = r0 + (lane & 1);
    if (lane < 2 * RS_TG && t < nt && row < rows) logits[(long)(t0 + t) * rows + row] = v;
}

#define ROUTER_SEQS(BITS)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) router_seqs_q##BITS(                                      \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols, int gshift,       \
        const float* xn, int n, float* logits) {                                                                 \
        KTRACE(45);                                                                                              \
        router_seqs_body<BITS>(w, s, b, rows, cols, gshift, xn, n, logits);                                      \
    }
ROUTER_SEQS(8)
ROUTER_SEQS(4)
