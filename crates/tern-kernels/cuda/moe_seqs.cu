// Streamed MoE for a few tokens per expert (the batched decode step: B <= 64 tokens, so 1-4 tokens per routed
// expert), and a dense few-token GEMV: kernels over the expert-sorted pairs and tile list of moe_align (prefill.cu)
// that read each weight byte once from DRAM and apply it to every token routed to its expert. Every warp streams
// its own rows through a double-buffered pair of shared-memory slots (bulk copies, TMA, on one mbarrier each: the
// next rows are in flight while the warp computes on the current ones), against the block's GU_TG / DS_TG tokens
// staged in shared memory (f32 activations x 2^90 for the denormal decode of common.cuh, with 32-column chunk
// sums); more tokens than that take another pass. Dequantisation is exact (s*q + b in f32), accumulation f32, no
// atomics (deterministic). Where the grouped tensor-core GEMMs (gemm.cu) dequantise every weight tile into shared
// memory for a 64-token tile that holds 1-4 tokens, these do 2 instructions per weight and token. The expert
// kernels take moe_align's tiles of STREAM_TILE (prefill.rs) pairs: an expert many tokens share (the shared expert
// holds them all) is spread over many blocks, not looped over in one (the one block's passes were the whole
// kernel's critical path).
//
// router_seqs_q{4,8} logits[t, r] = W[r] . xn[t] for the n rows of xn [n, cols] and the rows of W (the router and
//                   the shared-expert gate, rows = E + 1): grid (rows / 16, n / 4); each block stages its 4 tokens
//                   (x 2^90, chunk sums) and each warp streams 2 weight rows from global memory (L2: the router is
//                   0.5 MB) through chunk_dot, the decode router's arithmetic. Where router_rows (prefill.cu) runs
//                   5 blocks of 64 x 64 outputs for any n <= 64, this runs (rows / 16) x (n / 4) small ones.
//                   Bytes rows*cols*BITS/8 per token group (L2) + 4*n*cols. FLOPs 2*n*rows*cols.
// gemv_seqs_q4      y[t, r] (+)= W[r] . x[t] for bf16 x [n, cols] (row stride cols), y f32 [n, ldy]: the dense
//                   projections of a few tokens whose matrices have few rows (out_proj, o_proj: 2048 rows, where the
//                   GEMM's 128-row tiles make 16 blocks): grid (n / 4, rows / 32), token groups fastest (the blocks
//                   of one row range run together, so the weights come from DRAM once and from L2 for the other
//                   token groups); each warp streams 4 rows, the first chunks loaded before the dependency wait.
//                   Bytes rows*cols/2 (+scales) + n*cols*2 per row block (L2). FLOPs 2*n*rows*cols. Measured on
//                   the H200 at n = 32: 49 us for 2048 x 4096 (the GEMM 108), but 137 us for 12352 x 2048 (the GEMM
//                   40: one block's staging and one round of loads, 12 waves), so only the few-row matrices use it.
// moe_gate_up_seqs  act[p, j] = silu(G_e[j] . xn[t]) * (U_e[j] . xn[t]) for every pair p = (token t, expert e) of
//                   tile blockIdx.y (t = rowmap[p]), j in [GU_J blockIdx.x, +GU_J) of the expert's n = I (or Is for
//                   the shared expert E); xn f32 [N, H] (the post-norm rows), act f32 [pairs, ld]. 256 threads; a
//                   warp item is 2 j (4 rows: gate j, j+1, up j, j+1, 4 * H/2 bytes in a slot), items w, w+8, ... of
//                   the block's GU_J / 2; scales/biases in registers (loaded while the rows are in flight; H <= 2048).
//                   Bytes: the routed experts' gate|up rows once (+ again per extra pass) + H*4 per pair (x from L2).
//                   FLOPs 2 * pairs * 2n * H.
// moe_down_seqs     ybuf[p, r] = D_e[r] . act[p] for the pairs of tile blockIdx.y and rows r in [DS_RB blockIdx.x,
//                   +DS_RB) of H; the expert's n = I (or Is) columns. A warp item is 8 rows with their scales and
//                   biases (8 * n/2 + 2 * 8 * n/gs * 2 bytes, one slot); lanes are grouped per row (the next power
//                   of two >= n/32 lanes, segmented shuffle sums). Bytes: the experts' down rows once + n*4 per pair.
//                   FLOPs 2 * pairs * H * n.
// Requirements (checked on the host): H and n multiples of 32, group size 32 << gshift, per-expert strides words /
// groups (u32 words / scale entries; groups a multiple of 8 for down's 16-byte scale copies), row bytes multiples
// of 16; tiles from moe_align over the same pairs.
#include "common.cuh"

#define RS_R 16   // router rows per block (2 per warp)
#define RS_TG 4   // router tokens per block
#define GV_R 32   // gemv_seqs rows per block (4 per warp)
#define GV_TG 4   // gemv_seqs tokens per block
#define GU_J 64   // j per block (2 * GU_J rows: gate and up)
#define GU_TG 4   // tokens per pass
#define DS_RB 256 // output rows per block
#define DS_RI 8   // rows per warp item
#define DS_TG 4   // tokens per pass

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

// Stage rows rowmap[p0 + i] (or p0 + i when direct; i < nt, up to TG rows) of src [*, ld] (f32 or bf16, n columns)
// into xs[i] (x DN_XSCALE, padded) and their CPV-column sums into cs[i][c]; rows i >= nt are zero. Every thread of
// the block calls it (shuffles over the CPV/4 threads of a chunk: n % CPV == 0).
template <int TG, int CPV = 32, typename T = float>
__device__ __forceinline__ void stage_rows(const T* __restrict__ src, long ld, const int* __restrict__ rowmap,
                                           int p0, int nt, int n, bool direct, float* xs, int xstride, float* cs) {
    constexpr int TPC = CPV / 4;  // threads per chunk
    const int n4 = n / 4, total = TG * n4;
    for (int i0 = 0; i0 < total; i0 += blockDim.x) {  // uniform trip count: the shuffles see every lane
        const int i = i0 + threadIdx.x;
        const int tt = i / n4, c4 = i - tt * n4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < total && tt < nt) {
            const long row = direct ? (long)(p0 + tt) : (long)rowmap[p0 + tt];
            v = load4(src + row * ld + 4 * c4);
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
    __shared__ __align__(8) uint64_t bar[8][2];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nvec = H / 32, ng = H >> (gshift + 5), rowb = H / 2;
    pdl_wait();  // the tile list comes from moe_align
    const int t = blockIdx.y;
    if (t >= *ntile) return;
    const int e = tiles[3 * t], p0 = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    const int n = e == E ? Is : I;
    const int j0 = blockIdx.x * GU_J;
    if (j0 >= n || cnt <= 0) return;
    const int items = min(GU_J, n - j0) / 2;
    // shared memory: x [GU_TG][padx_len(H)] | sums [GU_TG][nvec] | (128-aligned) slots [8 warps][2][4 rows][rowb]
    const int xstride = padx_len(H);
    float* xs = reinterpret_cast<float*>(smem);
    float* cs = xs + GU_TG * xstride;
    unsigned char* slots = smem + (((GU_TG * (xstride + nvec)) * 4 + 127) & ~127) + warp * 8 * rowb;
    const unsigned char* we = reinterpret_cast<const unsigned char*>(w + e * words);
    if (lane == 0) {
        mbar_init(&bar[warp][0], 1);
        mbar_init(&bar[warp][1], 1);
        mbar_fence_init();
    }
    // item q of this warp: j = j0 + 2 (warp + 8 q); its gate rows j, j+1 and up rows n + j, n + j + 1 into slot q & 1
    auto issue = [&](int q) {
        const int j = j0 + 2 * (warp + 8 * q);
        unsigned char* dst = slots + (q & 1) * 4 * rowb;
        fence_proxy_async();  // this warp's reads of the slot's previous rows come before the copies overwrite them
        mbar_expect_tx(&bar[warp][q & 1], 4 * rowb);
        bulk_g2s(dst, we + (long)j * rowb, 2 * rowb, &bar[warp][q & 1]);
        bulk_g2s(dst + 2 * rowb, we + (long)(n + j) * rowb, 2 * rowb, &bar[warp][q & 1]);
    };
    const int nq = warp < items ? (items - warp + 7) / 8 : 0;  // this warp's items
    uint32_t phase = 0u;  // bit i: the parity slot i waits for next
    for (int g0 = 0; g0 < cnt; g0 += GU_TG) {
        const int nt = min(GU_TG, cnt - g0);
        __syncthreads();  // the previous pass is done with xs and the slots (and the barrier inits are visible)
        if (lane == 0 && nq > 0) issue(0);
        stage_rows<GU_TG>(xn, H, rowmap, p0 + g0, nt, H, false, xs, xstride, cs);
        __syncthreads();
        for (int q = 0; q < nq; q++) {
            if (lane == 0 && q + 1 < nq) issue(q + 1);
            const int j = j0 + 2 * (warp + 8 * q);
            // this lane's chunks u = lane, lane + 32 (nvec <= 64): scales and biases while the rows are in flight
            float sc[2][4], bs[2][4];
#pragma unroll
            for (int a = 0; a < 2; a++) {
                const int g = min(lane + 32 * a, nvec - 1) >> gshift;
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const long gi = e * groups + (long)((r & 1 ? n : 0) + j + (r >> 1)) * ng + g;
                    sc[a][r] = bf(s[gi]);
                    bs[a][r] = bf(b[gi]);
                }
            }
            const uint4* rows = reinterpret_cast<const uint4*>(slots + (q & 1) * 4 * rowb);
            mbar_wait(&bar[warp][q & 1], (phase >> (q & 1)) & 1u);
            phase ^= 1u << (q & 1);
            float tot[GU_TG][4];
#pragma unroll
            for (int i = 0; i < GU_TG; i++) tot[i][0] = tot[i][1] = tot[i][2] = tot[i][3] = 0.f;
#pragma unroll
            for (int a = 0; a < 2; a++) {
                const int u = lane + 32 * a;
                if (u < nvec) {
                    uint4 wv[4];
#pragma unroll
                    for (int r = 0; r < 4; r++) wv[r] = rows[((r & 1) * 2 + (r >> 1)) * nvec + u];
#pragma unroll
                    for (int i = 0; i < GU_TG; i++)
                        if (i < nt) chunk_dot<4, 4>(wv, xs + i * xstride + padx(u * 32), sc[a], bs[a], cs[i * nvec + u], tot[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < GU_TG; i++)
#pragma unroll
                for (int r = 0; r < 4; r++) tot[i][r] = warp_sum(tot[i][r]);
            // lane 2i + c stores act of token i, j + c (tot[i][2c]: gate, tot[i][2c + 1]: up)
            float gv = 0.f, uv = 0.f;
#pragma unroll
            for (int i = 0; i < GU_TG; i++)
#pragma unroll
                for (int c = 0; c < 2; c++)
                    if (lane == 2 * i + c) {
                        gv = tot[i][2 * c];
                        uv = tot[i][2 * c + 1];
                    }
            const int i = lane >> 1, c = lane & 1;
            if (lane < 2 * GU_TG && i < nt) act[(long)(p0 + g0 + i) * ld + j + c] = silu_f(gv) * uv;
            __syncwarp();  // every lane is done with the slot before it is refilled
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 3) moe_down_seqs(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, int E, int I, int Is, int H, int gshift, const float* __restrict__ act, int ld,
    const int* __restrict__ ntile, const int* __restrict__ tiles, float* __restrict__ ybuf) {
    KTRACE(44);
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t bar[8][2];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pdl_wait();  // the tile list comes from moe_align, act from moe_gate_up_seqs
    const int t = blockIdx.y;
    if (t >= *ntile) return;
    const int e = tiles[3 * t], p0 = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    const int n = e == E ? Is : I;
    const int r0 = blockIdx.x * DS_RB;
    if (r0 >= H || cnt <= 0) return;
    const int items = min(DS_RB, H - r0) / DS_RI;  // H % 32 == 0
    const int nvec = n / 32, ng = n >> (gshift + 5), rowb = n / 2;
    const int Imax = I > Is ? I : Is;
    // a slot: codes [DS_RI][rowb] | scales [DS_RI][ng] bf16 | biases [DS_RI][ng] bf16 (sized for Imax)
    const int slotb = DS_RI * (Imax / 2) + 4 * DS_RI * (Imax >> (gshift + 5));
    // shared memory: act [DS_TG][padx_len(Imax)] | sums [DS_TG][Imax/32] | (128-aligned) slots [8 warps][2][slotb]
    const int xstride = padx_len(n);
    float* xs = reinterpret_cast<float*>(smem);
    float* cs = xs + DS_TG * padx_len(Imax);
    unsigned char* slots = smem + (((DS_TG * (padx_len(Imax) + Imax / 32)) * 4 + 127) & ~127) + warp * 2 * slotb;
    const unsigned char* we = reinterpret_cast<const unsigned char*>(w + e * words);
    const __nv_bfloat16* se = s + e * groups;
    const __nv_bfloat16* be = b + e * groups;
    if (lane == 0) {
        mbar_init(&bar[warp][0], 1);
        mbar_init(&bar[warp][1], 1);
        mbar_fence_init();
    }
    const uint32_t sbytes = DS_RI * ng * 2;  // a multiple of 16
    auto issue = [&](int q) {
        const int r = r0 + DS_RI * (warp + 8 * q);
        unsigned char* dst = slots + (q & 1) * slotb;
        fence_proxy_async();
        mbar_expect_tx(&bar[warp][q & 1], DS_RI * rowb + 2 * sbytes);
        bulk_g2s(dst, we + (long)r * rowb, DS_RI * rowb, &bar[warp][q & 1]);
        bulk_g2s(dst + DS_RI * rowb, se + (long)r * ng, sbytes, &bar[warp][q & 1]);
        bulk_g2s(dst + DS_RI * rowb + sbytes, be + (long)r * ng, sbytes, &bar[warp][q & 1]);
    };
    // lanes per row: the next power of two >= nvec (at most 32, then each lane takes several chunks)
    int lpr = 1;
    while (lpr < nvec && lpr < 32) lpr <<= 1;
    const int rpp = 32 / lpr, sub = lane & (lpr - 1), rsub = lane / lpr;
    const int nq = warp < items ? (items - warp + 7) / 8 : 0;
    uint32_t phase = 0u;  // bit i: the parity slot i waits for next
    for (int g0 = 0; g0 < cnt; g0 += DS_TG) {
        const int nt = min(DS_TG, cnt - g0);
        __syncthreads();
        if (lane == 0 && nq > 0) issue(0);
        stage_rows<DS_TG>(act, ld, nullptr, p0 + g0, nt, n, true, xs, xstride, cs);
        __syncthreads();
        for (int q = 0; q < nq; q++) {
            if (lane == 0 && q + 1 < nq) issue(q + 1);
            const unsigned char* slot = slots + (q & 1) * slotb;
            const uint4* codes = reinterpret_cast<const uint4*>(slot);
            const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(slot + DS_RI * rowb);
            const __nv_bfloat16* bb = ss + DS_RI * ng;
            const int rbase = r0 + DS_RI * (warp + 8 * q);
            mbar_wait(&bar[warp][q & 1], (phase >> (q & 1)) & 1u);
            phase ^= 1u << (q & 1);
#pragma unroll 1
            for (int base = 0; base < DS_RI; base += rpp) {  // uniform over the warp
                const int row = base + rsub;
                const bool valid = row < DS_RI;
                float d[DS_TG];
#pragma unroll
                for (int i = 0; i < DS_TG; i++) d[i] = 0.f;
                if (valid) {
#pragma unroll 1
                    for (int u = sub; u < nvec; u += lpr) {
                        const int gi = row * ng + (u >> gshift);
                        const uint4 wq[1] = {codes[row * nvec + u]};
                        const float sc[1] = {bf(ss[gi])}, bs[1] = {bf(bb[gi])};
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
                        if (i < nt) ybuf[(long)(p0 + g0 + i) * H + rbase + row] = d[i];
                }
            }
            __syncwarp();
        }
    }
}

// gemv_seqs_q4: see the contract at the top. Dynamic shared memory: x [GV_TG][padx_len(cols)] | sums [GV_TG][cols/32].
extern "C" __global__ void __launch_bounds__(256) gemv_seqs_q4(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    int rows, int cols, int gshift, const __nv_bfloat16* __restrict__ x, int n, float* __restrict__ y, int ldy,
    int add) {
    KTRACE(46);
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nvec = cols / 32, ng = cols >> (gshift + 5), xstride = padx_len(cols);
    float* xs = reinterpret_cast<float*>(smem);
    float* cs = xs + GV_TG * xstride;
    const int t0 = blockIdx.x * GV_TG, nt = min(GV_TG, n - t0);
    const int r0 = blockIdx.y * GV_R + 4 * warp;
    const uint4* wr[4];
    const __nv_bfloat16 *sr[4], *br[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int row = min(r0 + q, rows - 1);  // a valid address; a row past the end is never stored
        wr[q] = reinterpret_cast<const uint4*>(w) + (long)row * nvec;
        sr[q] = s + (long)row * ng;
        br[q] = b + (long)row * ng;
    }
    // chunks u0 + 32a of this lane's 4 rows, loaded into wv/sc/bs (clamped: a valid address, result unused)
    uint4 wv[2][4];
    float sc[2][4], bs[2][4];
    auto load = [&](int u0) {
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const int u = min(u0 + 32 * a, nvec - 1);
            const int g = u >> gshift;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                wv[a][q] = __ldg(wr[q] + u);
                sc[a][q] = bf(sr[q][g]);
                bs[a][q] = bf(br[q][g]);
            }
        }
    };
    load(lane);  // weights: in flight while the previous kernel finishes and x is staged
    pdl_wait();  // x comes from the previous kernel
    stage_rows<GV_TG, 32, __nv_bfloat16>(x, cols, nullptr, t0, nt, cols, true, xs, xstride, cs);
    __syncthreads();
    float tot[GV_TG][4];
#pragma unroll
    for (int t = 0; t < GV_TG; t++) tot[t][0] = tot[t][1] = tot[t][2] = tot[t][3] = 0.f;
#pragma unroll 1
    for (int u0 = lane; u0 < nvec; u0 += 64) {
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const int u = u0 + 32 * a;
            if (u < nvec) {
#pragma unroll
                for (int t = 0; t < GV_TG; t++)
                    if (t < nt) chunk_dot<4, 4>(wv[a], xs + t * xstride + padx(u * 32), sc[a], bs[a], cs[t * nvec + u], tot[t]);
            }
        }
        if (u0 + 64 < nvec) load(u0 + 64);
    }
#pragma unroll
    for (int t = 0; t < GV_TG; t++)
#pragma unroll
        for (int q = 0; q < 4; q++) tot[t][q] = warp_sum(tot[t][q]);
    // lane 4t + q stores token t, row r0 + q
    float v = 0.f;
#pragma unroll
    for (int t = 0; t < GV_TG; t++)
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (lane == 4 * t + q) v = tot[t][q];
    const int t = lane >> 2, row = r0 + (lane & 3);
    if (lane < 4 * GV_TG && t < nt && row < rows) {
        float* dst = y + (long)(t0 + t) * ldy + row;
        *dst = add ? *dst + v : v;
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
