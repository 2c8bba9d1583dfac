// Few-token kernels of the batched decode step (B <= 64 tokens: 1-8 tokens per routed expert): the experts over the
// expert-sorted pairs and tile list of moe_align (prefill.cu), the router, and a dense few-token GEMV. Each reads
// every weight byte once from DRAM and applies it to all the tokens of its tile. The expert kernels take moe_align's
// tiles of STREAM_TILE (prefill.rs) = 8 pairs, one mma n-tile: an expert many tokens share (the shared expert holds
// them all) is spread over many blocks rather than looped over in one. No atomics (deterministic).
//
// router_seqs_q{4,8} logits[t, r] = W[r] . xn[t] for the n rows of xn [n, cols] and the rows of W (the router and
//                   the shared-expert gate, rows = E + 1): grid (rows / 16, n / 4); each block stages its 4 tokens
//                   (x 2^90, chunk sums) and each warp streams 2 weight rows from global memory (L2: the router is
//                   0.5 MB) through chunk_dot, the decode router's arithmetic. Where router_rows (prefill.cu) runs
//                   5 blocks of 64 x 64 outputs for any n <= 64, this runs (rows / 16) x (n / 4) small ones.
//                   Bytes rows*cols*BITS/8 per token group (L2) + 4*n*cols. FLOPs 2*n*rows*cols.
// dense_seqs_w{1,2}_k{1,4}  y[t, r] (+)= W[r] . x[t] for the n <= 64 bf16 rows of x [n, cols] (row stride cols)
//                   and a 4-bit matrix W [rows, cols], y f32 [n, ldy] (add: += , the residual): the batched step's
//                   dense projections and lm_head, on tensor cores like the experts below (W = 2 k-blocks of 64
//                   columns where the group size and cols allow). Grid (ceil(n / 8), ceil(rows / (128 / KS))): one
//                   block per 8 tokens and 128 / KS rows, token groups fastest (the blocks of one row range run
//                   together, so the weights come from DRAM once and from L2 for the other token groups); KS = 4
//                   splits each block's columns over its 4 warps (32 rows a block) for matrices that would make too
//                   few blocks (out_proj, o_proj: 2048 rows; any matrix at n <= 8); where even that leaves the GPU
//                   idle, grid z = KZ blocks (a cluster) take a column range each and the first of them sums their
//                   partial sums from the others' shared memory (dense_mma). Requirements (host): rows >= 16, cols a
//                   multiple of 32 W KS KZ and of the group size x KS KZ, group size 32 << gshift >= 32 W, KZ <= 8.
//                   Bytes rows*cols/2 (+ scales) from DRAM + 16*cols per block (x, L2). FLOPs 2*n*rows*cols.
// dense_ring_n{1,2,4,8}  the same product for group size 64, rows a multiple of 16 and columns of 256: blocks of 128
//                   rows stream their weights as whole 128-byte lines through the ring kernels' warp rings (below) and
//                   dequantise each k-block once for all n <= 8 NT tokens; grid (rows / 128, 1, KZ), the KZ column
//                   ranges one cluster (dense_ring below). Bytes rows*cols/2 (+ scales) + 2*n*cols per block (x, L2).
// dense_tma_n{1,2}  the same product for n <= 16 tokens, group size 64, rows a multiple of 16 and 2,048 or 4,096
//                   columns: at most one block a multiprocessor streaming an even share of the matrix's 16-row units
//                   by bulk copies through a block-wide ring (dense_tma below). Bytes as dense_ring's, x once a block.
// moe_gate_up_seqs_w{1,2}  act[p, j] = silu(G_e[j] . xn[t]) * (U_e[j] . xn[t]) for every pair p = (token t,
//                   expert e) of tile blockIdx.y (t = rowmap[p], as moe_align's trows[y] packs them), j in [64
//                   blockIdx.x, +64) of the expert's n = I (or Is for the shared expert E); xn bf16 [N, H] (the
//                   post-norm rows as the norm rounds them: the mma's operands), act bf16 [pairs, ld]. 128
//                   threads, a warp 2 items of 8 j (16 rows: 8 gate, 8 up) on tensor cores (below); W = 2 needs a
//                   group size and H that are multiples of 64. Bytes: the routed experts' gate|up rows (+ scales) once
//                   per pass of 8 tokens + H*2 per pair (xn from L2) + n*2 per pair (act). FLOPs 2 * pairs * 2n * H.
// moe_down_seqs_w{1,2}  ybuf[p, r] = D_e[r] . act[p] for the pairs of tile blockIdx.y and rows r in [128 blockIdx.x,
//                   +128) of H; the expert's n = I (or Is) columns of act (bf16: what the mma reads, and the layout
//                   of the prefill GEMMs' act): a warp 2 items of 16 rows. Bytes: the experts' down rows once + n*2
//                   per pair. FLOPs 2 * pairs * H * n.
// The expert kernels' numerics: exact 4-bit codes and f32 scale/bias arithmetic; activations rounded to bf16 (the
// mma's operands), f32 accumulation. Requirements (checked on the host): H and n multiples of 32 W (and of 16 for
// the item rows), group size 32 << gshift >= 32 W, per-expert strides words / groups (u32 words / scale entries);
// tiles from moe_align over the same pairs.
// a traced batched step at B = 32 records ~200k blocks of this module (tern bench --trace): 14.7 MB of records
#define TRACE_CAP (1 << 18)
#include "mma.cuh"
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define RS_R 16   // router rows per block (2 per warp)
#define RS_TG 4   // router tokens per block

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

// Stage rows rowmap[p0 + i] (or p0 + i when direct; i < nt, up to TG rows) of src [*, ld] (f32 or bf16, n columns)
// into xs[i] (x DN_XSCALE, padded) and their CPV-column sums into cs[i][c]; rows i >= nt are zero. Every thread of
// the block calls it (shuffles over the CPV/4 threads of a chunk: n % CPV == 0). A thread's loads of up to SR_PER
// units are issued together, then used: one L2 round trip where a unit a trip took one each (the router's 4 rows of
// 2,048 f32 columns are 8 units a thread of 256).
#define SR_PER 8
template <int TG, int CPV = 32, typename T = float>
__device__ __forceinline__ void stage_rows(const T* __restrict__ src, long ld, const int* __restrict__ rowmap,
                                           int p0, int nt, int n, bool direct, float* xs, int xstride, float* cs) {
    constexpr int TPC = CPV / 4;  // threads per chunk
    const int n4 = n / 4, total = TG * n4;
    for (int i0 = 0; i0 < total; i0 += SR_PER * blockDim.x) {  // uniform trip count: the shuffles see every lane
        float4 v[SR_PER];
#pragma unroll
        for (int k = 0; k < SR_PER; k++) {
            const int i = i0 + k * blockDim.x + threadIdx.x;
            const int tt = i / n4, c4 = i - tt * n4;
            v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < total && tt < nt) {
                const long row = direct ? (long)(p0 + tt) : (long)rowmap[p0 + tt];
                v[k] = load4(src + row * ld + 4 * c4);
            }
        }
#pragma unroll
        for (int k = 0; k < SR_PER; k++) {
            const int i = i0 + k * blockDim.x + threadIdx.x;
            const int tt = i / n4, c4 = i - tt * n4;
            float sum = v[k].x + v[k].y + v[k].z + v[k].w;
#pragma unroll
            for (int o = 1; o < TPC; o <<= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
            if (i < total) {
                *reinterpret_cast<float4*>(xs + tt * xstride + padx(4 * c4)) =
                    make_float4(v[k].x * DN_XSCALE, v[k].y * DN_XSCALE, v[k].z * DN_XSCALE, v[k].w * DN_XSCALE);
                if ((c4 & (TPC - 1)) == 0) cs[tt * (n / CPV) + c4 / TPC] = sum;
            }
        }
    }
}

// ---- the expert kernels on tensor cores (moe_gate_up_seqs_w{1,2}, moe_down_seqs_w{1,2}) ----
// A warp computes 16 weight rows x 8 tokens with mma.sync m16n8k16 (mma.cuh's fragment layouts) over k-blocks of
// KB = 32 W columns (W = 2 where the group size and the inner sizes allow 64, else 1). The A operand is the exact
// 4-bit code plus 128: ((w >> 4p) & 0x000F000F) | 0x43004300 is the bf16 pair (128 + q_p, 128 + q_p+4) of one
// packed word (columns p and p + 4 of its 8), so dequantisation is one shift and one LOP3 per two weights and
// exact; the scale and bias of the k-block's group are applied once per k-block in f32 on the accumulators:
//   sum_k (s q_k + b) x_k = s * C + (b - 128 s) * X,   C = sum_k (128 + q_k) x_k,  X = sum_k x_k
// (C accumulated from zero per k-block, X the sum of the bf16 activations the mma reads). Lane (g, c) (lane =
// 4g + c) holds rows g and g + 8 of a 16-row item and, within every k-block, the W words c W + i (i < W) of each
// row: columns 8 (c W + i) + 0..7, a group-pure k-block on every lane. The mma's k index 2c, 2c+1 / 2c+8, 2c+9 of
// step (i, h) maps to pairs 2h / 2h+1 of word i, so the activations are staged (stage_mma) in that order: for
// k-block kb, word i, token t and lane quad c, 16 bytes at ((kb W + i) 8 + t) 4 + c holding columns 8 (c W + i) +
// {0,4,1,5,2,6,3,7} of token t as bf16 (one conflict-free 16-byte load per lane per word), with X per (kb, t) in
// f32. Lanes whose token is past the tile's count read zeros instead (their columns are never stored). Weights come
// straight from global memory (8- or 4-byte loads that fill whole sectors per row), MM_PF k-blocks ahead in
// registers; the block's scales and biases are copied once into shared memory (copy_scales: as 2-byte loads per
// k-block they were 2/3 of the L2 traffic); the first k-blocks and the scales are in flight while the block stages
// its activations. Measured on the H200 at B = 32: gate|up 96 us, down 54 us a call (2.4x / 2.7x the bytes' floor;
// Nsight Compute's stall sampling puts most stalls on the first use of each k-block's weights).
#define MM_PF 6      // k-blocks in flight per warp
#define MM_R 2       // 16-row items per warp
#define MM_WARPS 4   // warps per block (128 threads)
#define MM_TG 8      // tokens per pass (the mma's n)

// Stage rows row_of(t) (t < nt <= TGS) of src [*, ld] (f32 or bf16), cols columns
// (a multiple of 32 W), into xs (the layout above; uint4 [cols / 8 * MM_TG], only the slots of tokens < nt
// written) and xsum [cols / (32 W)][MM_TG]; every thread of the block calls it; ends with a barrier. The loads of
// up to PER units per thread are issued together (one round trip for up to PER * blockDim units; a loop of one unit
// per trip over all 8 token slots cost gate|up 183 against 170 us): PERB (default 8) for bf16 rows (one 16-byte
// register load a unit), 4 for f32 (two). `mid()` runs once, right after the first round's loads are issued (before they are
// used): the ring kernels issue their first weight copies there, behind these loads rather than ahead of them.
template <int W, int TGS = MM_TG, int PERB = 8, typename T, typename RowOf, typename Mid>
__device__ __forceinline__ void stage_mma(const T* __restrict__ src, long ld, RowOf row_of, int nt, int cols,
                                          uint4* xs, float* xsum, Mid mid) {
    // TGS token slots (MM_TG for rows_mma; the ring kernels stage 4 or 8)
    // unit u = ((kb nt + t) 4 + c) W + i: 8 columns of one token (column 8 (c W + i) of its k-block: adjacent lanes
    // read adjacent 32 bytes); the 4 W units of one (kb, t) are adjacent lanes, and units is a multiple of 4 W, so a
    // shuffle group is all in range or all out
    const int units = nt * (cols / 8);
    // q / nt as a multiply and a shift (exact while q (magic nt - 2^16) < 2^16: for nt <= 8 and q < 8192, and for
    // dense_ring's nt <= 64 with q < 1024; q < nt cols / (32 W) here): the runtime divisions were most of the
    // staging's instructions
    const unsigned magic = (65536u + nt - 1) / nt;
    constexpr int PER = sizeof(T) == 4 ? 4 : PERB;
    for (int u0 = 0; u0 < units; u0 += PER * blockDim.x) {  // uniform trip count: the shuffles see every lane
        // f32: two float4 of the unit's 8 columns; bf16: one uint4 (as raw words in va[k].x..w)
        float4 va[PER], vb[PER];
        int slot[PER];  // where the unit goes: ((kb W + i) TGS + t) 4 + c
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int u = u0 + k * blockDim.x + threadIdx.x;
            va[k] = vb[k] = make_float4(0.f, 0.f, 0.f, 0.f);
            slot[k] = 0;
            if (u < units) {
                const int i = u & (W - 1), c = (u / W) & 3, q = u / (4 * W);
                const int kb = (int)(((unsigned)q * magic) >> 16), t = q - kb * nt;
                slot[k] = ((kb * W + i) * TGS + t) * 4 + c;
                const long row = row_of(t);
                const T* p = src + row * ld + kb * 32 * W + 8 * (c * W + i);
                if constexpr (sizeof(T) == 4) {
                    va[k] = *reinterpret_cast<const float4*>(p);
                    vb[k] = *reinterpret_cast<const float4*>(p + 4);
                } else {
                    const uint4 r = *reinterpret_cast<const uint4*>(p);
                    va[k] = make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z),
                                        __uint_as_float(r.w));
                }
            }
        }
        if (u0 == 0) mid();
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int u = u0 + k * blockDim.x + threadIdx.x;
            // bf16 pairs (x_p, x_p+4), p = 0..3, and the sum of the rounded values
            uint4 q;
            if constexpr (sizeof(T) == 4) {
                q.x = pack_bf16(va[k].x, vb[k].x);
                q.y = pack_bf16(va[k].y, vb[k].y);
                q.z = pack_bf16(va[k].z, vb[k].z);
                q.w = pack_bf16(va[k].w, vb[k].w);
            } else {  // words (x0 x1) (x2 x3) (x4 x5) (x6 x7) -> (x0 x4) (x1 x5) (x2 x6) (x3 x7)
                const uint32_t a = __float_as_uint(va[k].x), b = __float_as_uint(va[k].y);
                const uint32_t c2 = __float_as_uint(va[k].z), d = __float_as_uint(va[k].w);
                q.x = prmt(a, c2, 0x5410);
                q.y = prmt(a, c2, 0x7632);
                q.z = prmt(b, d, 0x5410);
                q.w = prmt(b, d, 0x7632);
            }
            const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) sum += __uint_as_float(qs[j] << 16) + __uint_as_float(qs[j] & 0xffff0000u);
#pragma unroll
            for (int o = 1; o < 4 * W; o <<= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
            if (u < units) {
                xs[slot[k]] = q;
                // the first unit of a (kb, t) has slot (kb W TGS + t) 4: xsum index kb TGS + t
                const int kt = slot[k] >> 2;
                if ((u & (4 * W - 1)) == 0) xsum[kt / (W * TGS) * TGS + (kt & (TGS - 1))] = sum;
            }
        }
    }
    if (units == 0) mid();
    __syncthreads();
}
template <int W, int TGS = MM_TG, int PERB = 8, typename T, typename RowOf>
__device__ __forceinline__ void stage_mma(const T* __restrict__ src, long ld, RowOf row_of, int nt, int cols,
                                          uint4* xs, float* xsum) {
    stage_mma<W, TGS, PERB>(src, ld, row_of, nt, cols, xs, xsum, [] {});
}

// A weight load: the read-only path with a 256-byte L2 prefetch (ld.global.nc.L2::256B). Measured on the H200 (one
// binary switching between them): against plain __ldg, the B = 32 step 14.6 -> 13.7 ms; .cg 14.3, a coherent
// ld.global 14.7, .cs 17.0, L1::no_allocate 16.5.
__device__ __forceinline__ uint2 mm_load2(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.nc.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// bf16 pair (128 + q_p, 128 + q_p+4) of packed word w: one LOP3 (w' & 0x000F000F) | 0x43004300 after the shift (the
// compiler, given the C expression, emitted an AND and an OR, each with its immediate: 32 of the ~184 instructions
// of a k-block). mask and hi hold 0x000F000F and 0x43004300 (registers: LOP3 takes one immediate).
__device__ __forceinline__ uint32_t q4_pair(uint32_t w, int p, uint32_t mask, uint32_t hi) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * p)), "r"(mask), "r"(hi));
    return r;
}

// The weight loads of one k-block for this lane: W words of rows g and g + 8 of each item, the groups' scale and bias.
template <int W>
struct MmaBlock {
    uint32_t w[MM_R][2][W];
};

// The rows of one lane: item r's row g at words wr[r] (already offset by this lane's c W), its scales at sr[r] in
// the block's shared copy (biases at + bdelta); its row g + 8 at wr[r] + wstep and sr[r] + sstep.
struct MmaRows {
    const uint32_t* wr[MM_R];
    const __nv_bfloat16* sr[MM_R];
    long wstep;
    int sstep, bdelta;
};

// Row stride (bf16) of the block's shared copy of its rows' scales and biases: 8 m >= ng with m odd, so that the
// 8 rows g of a warp's reads fall in distinct banks and every row starts 16-byte aligned (mma_scale_stride in
// batch.rs).
__device__ __forceinline__ int mma_scale_stride(int ng) {
    const int m = (ng + 7) / 8;
    return 8 * (m | 1);
}

// Copy the scales and biases of rows [row0, row0 + nrows) of expert arrays s, b (ng groups per row) into rows
// [lrow0, +nrows) of the block's copy ss (scales: [*][sst], biases at ss + bdelta): 16-byte cp.async where ng % 8
// == 0 (the model's shapes), else plain loads. Every thread calls it; cp_async_wait and a barrier make it visible.
__device__ __forceinline__ void copy_scales(const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
                                            long base, int row0, int nrows, int ng, __nv_bfloat16* ss, int sst,
                                            int bdelta, int lrow0) {
    if (ng % 8 == 0) {
        const int per = ng / 8, total = nrows * per;
        for (int q = threadIdx.x; q < 2 * total; q += blockDim.x) {
            const int a = q >= total, qq = q - a * total, row = qq / per, col = 8 * (qq - row * per);
            const __nv_bfloat16* src = (a ? b : s) + base + (long)(row0 + row) * ng + col;
            cp_async16(ss + a * bdelta + (lrow0 + row) * sst + col, src, 16);
        }
    } else {
        for (int q = threadIdx.x; q < 2 * nrows * ng; q += blockDim.x) {
            const int a = q >= nrows * ng, qq = q - a * nrows * ng, row = qq / ng, col = qq - row * ng;
            ss[a * bdelta + (lrow0 + row) * sst + col] = (a ? b : s)[base + (long)(row0 + row) * ng + col];
        }
    }
    cp_async_commit();
}

// A k-block's A operands, dequantised once (frag_mma) and applied to one or more 8-token groups (apply_mma).
template <int W>
struct MmaFrag {
    uint32_t a[W][2][4];  // word i: the A fragments of its pairs 0, 1 and 2, 3 (rows g and g + 8)
};

// The dequantised A fragments of one k-block of rows g (w0s) and g + 8 (w1s).
template <int W>
__device__ __forceinline__ void frag_mma(const uint32_t (&w0s)[W], const uint32_t (&w1s)[W], uint32_t mask,
                                         uint32_t hi, MmaFrag<W>& f) {
#pragma unroll
    for (int i = 0; i < W; i++) {
        const uint32_t w0 = w0s[i], w1 = w1s[i];
        f.a[i][0][0] = q4_pair(w0, 0, mask, hi);
        f.a[i][0][1] = q4_pair(w1, 0, mask, hi);
        f.a[i][0][2] = q4_pair(w0, 1, mask, hi);
        f.a[i][0][3] = q4_pair(w1, 1, mask, hi);
        f.a[i][1][0] = q4_pair(w0, 2, mask, hi);
        f.a[i][1][1] = q4_pair(w1, 2, mask, hi);
        f.a[i][1][2] = q4_pair(w0, 3, mask, hi);
        f.a[i][1][3] = q4_pair(w1, 3, mask, hi);
    }
}

// A k-block's sums into tot: the two mma accumulators' C (cb + cb2), then s C + (b - 128 s) X per row and token.
__device__ __forceinline__ void kblock_sum(float (&cb)[4], const float (&cb2)[4], float2 xsm, float s0, float s1,
                                           float c0, float c1, float (&tot)[4]) {
#pragma unroll
    for (int v = 0; v < 4; v++) cb[v] += cb2[v];
    const float b0 = fmaf(-128.f, s0, c0), b1 = fmaf(-128.f, s1, c1);
    tot[0] = fmaf(s0, cb[0], fmaf(b0, xsm.x, tot[0]));
    tot[1] = fmaf(s0, cb[1], fmaf(b0, xsm.y, tot[1]));
    tot[2] = fmaf(s1, cb[2], fmaf(b1, xsm.x, tot[2]));
    tot[3] = fmaf(s1, cb[3], fmaf(b1, xsm.y, tot[3]));
}

// kblock_mma's arithmetic (below) on fragments dequantised beforehand (frag_mma): the same sums bit for bit.
template <int W>
__device__ __forceinline__ void apply_mma(const MmaFrag<W>& f, const uint4 (&x)[W], float2 xsm, float s0, float s1,
                                          float c0, float c1, float (&tot)[4]) {
    float cb[4] = {0.f, 0.f, 0.f, 0.f}, cb2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < W; i++) {
        mma_bf16(cb, f.a[i][0], x[i].x, x[i].y);
        mma_bf16(cb2, f.a[i][1], x[i].z, x[i].w);
    }
    kblock_sum(cb, cb2, xsm, s0, s1, c0, c1, tot);
}

// One item's k-block applied to every token group of the staged activations (stage_mma's layout, TGS slots, NT groups
// of 8): the fragments f dequantised once (frag_mma), tot(t) (+)= group t's sums (apply_mma). The ring kernels'
// items (rows_ring with NT > 1) and dense_tma's units. Slots of tokens past the count hold stale values: their sums
// are never stored.
template <int NT, int TGS, typename Tot>
__device__ __forceinline__ void apply_groups(const MmaFrag<2>& f, const uint4* xs, const float* xsum, int kb, int lane,
                                             float s0, float s1, float c0, float c1, Tot tot) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        uint4 x[2];
#pragma unroll
        for (int i = 0; i < 2; i++) x[i] = xs[(kb * 2 + i) * (4 * TGS) + 32 * t + lane];
        const float2 xsm = *reinterpret_cast<const float2*>(xsum + kb * TGS + 8 * t + 2 * (lane & 3));
        apply_mma<2>(f, x, xsm, s0, s1, c0, c1, tot(t));
    }
}

// One item's k-block on tensor cores, shared by rows_mma and rows_ring: tot (+)= s (C - 128 X) + b X for rows g, g + 8
// (tot[0..1] and [2..3]) and the lane's tokens 2c, 2c + 1, where C = sum (128 + q) x over the k-block's W words of each
// row (w0s: row g, w1s: row g + 8; x the staged activations of those words), X = xsm (the tokens' sums), s0 / s1
// and the raw biases c0 / c1 the group's scale and bias of rows g / g + 8. Two accumulators: the mma chains of a
// k-block are half as long.
template <int W>
__device__ __forceinline__ void kblock_mma(const uint32_t (&w0s)[W], const uint32_t (&w1s)[W], const uint4 (&x)[W],
                                           float2 xsm, float s0, float s1, float c0, float c1, uint32_t mask,
                                           uint32_t hi, float (&tot)[4]) {
    float cb[4] = {0.f, 0.f, 0.f, 0.f}, cb2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < W; i++) {
        const uint32_t w0 = w0s[i], w1 = w1s[i];
        const uint32_t a0[4] = {q4_pair(w0, 0, mask, hi), q4_pair(w1, 0, mask, hi), q4_pair(w0, 1, mask, hi),
                                q4_pair(w1, 1, mask, hi)};
        mma_bf16(cb, a0, x[i].x, x[i].y);
        const uint32_t a1[4] = {q4_pair(w0, 2, mask, hi), q4_pair(w1, 2, mask, hi), q4_pair(w0, 3, mask, hi),
                                q4_pair(w1, 3, mask, hi)};
        mma_bf16(cb2, a1, x[i].z, x[i].w);
    }
    kblock_sum(cb, cb2, xsm, s0, s1, c0, c1, tot);
}

// tot[r][0..3] = (row g, tokens 2c, 2c+1), (row g + 8, tokens 2c, 2c+1) of item r: the products of the lane's rows
// with the staged tokens, over nk k-blocks (columns of tokens >= nt are not meaningful). `stage` runs once the
// first k-blocks are in flight (it stages xs/xsum and ends with a barrier).
template <int W, typename Stage>
__device__ __forceinline__ void rows_mma(const MmaRows& m, int nk, int gshift, int nt, const uint4* xs,
                                         const float* xsum, Stage stage, float (&tot)[MM_R][4]) {
    const int lane = threadIdx.x & 31, c = lane & 3;
    const bool tok = (lane >> 2) < nt;  // this lane's B column is a token of the tile (else zeros)
    uint32_t mask = 0x000F000Fu, hi = 0x43004300u;
    asm volatile("" : "+r"(mask), "+r"(hi));  // kept in registers (q4_pair)
    // the lane's 2 MM_R row pointers and one word offset for all of them, advanced a k-block (4 W words) per load
    // (the address computed from kb per load took ~4 instructions, a 64-bit increment per pointer as many)
    const uint32_t* wp[MM_R][2];
#pragma unroll
    for (int r = 0; r < MM_R; r++) {
        wp[r][0] = m.wr[r];
        wp[r][1] = m.wr[r] + m.wstep;
    }
    unsigned off = 0;
    // the lane's scale and bias rows in the block's shared copy: (scale g, scale g + 8, bias g, bias g + 8) per item
    const __nv_bfloat16* sp[MM_R][4];
#pragma unroll
    for (int r = 0; r < MM_R; r++) {
        sp[r][0] = m.sr[r];
        sp[r][1] = m.sr[r] + m.sstep;
        sp[r][2] = m.sr[r] + m.bdelta;
        sp[r][3] = m.sr[r] + m.bdelta + m.sstep;
    }
    MmaBlock<W> buf[MM_PF];
    auto load = [&](MmaBlock<W>& blk) {
#pragma unroll
        for (int r = 0; r < MM_R; r++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint32_t* p = wp[r][h] + off;
                if (W == 2) {
                    const uint2 v = mm_load2(reinterpret_cast<const uint2*>(p));
                    blk.w[r][h][0] = v.x;
                    blk.w[r][h][W - 1] = v.y;
                } else {
                    blk.w[r][h][0] = __ldg(p);
                }
            }
        off += 4 * W;
    };
#pragma unroll
    for (int u = 0; u < MM_PF; u++)
        if (u < nk) load(buf[u]);
    stage();
#pragma unroll
    for (int r = 0; r < MM_R; r++) tot[r][0] = tot[r][1] = tot[r][2] = tot[r][3] = 0.f;
    for (int kb0 = 0; kb0 < nk; kb0 += MM_PF) {
#pragma unroll
        for (int u = 0; u < MM_PF; u++) {
            const int kb = kb0 + u;
            if (kb < nk) {
                uint4 x[W];
#pragma unroll
                for (int i = 0; i < W; i++) x[i] = tok ? xs[(kb * W + i) * 32 + lane] : make_uint4(0u, 0u, 0u, 0u);
                const float2 xsm = *reinterpret_cast<const float2*>(xsum + kb * MM_TG + 2 * c);
#pragma unroll
                for (int r = 0; r < MM_R; r++) {
                    const int gi = (kb * W) >> gshift;
                    kblock_mma<W>(buf[u].w[r][0], buf[u].w[r][1], x, xsm, bf(sp[r][0][gi]), bf(sp[r][1][gi]),
                                  bf(sp[r][2][gi]), bf(sp[r][3][gi]), mask, hi, tot[r]);
                }
                if (kb + MM_PF < nk) load(buf[u]);  // k-block kb + MM_PF
            }
        }
    }
}

// The tile of this block's grid row (blockIdx.y) of moe_align's list, once the previous kernel has finished (the
// list comes from moe_align, the activations from the kernel before): its expert e, first pair p0, pair count cnt,
// the expert's inner size n (Is for the shared expert E, else I) and, where trows is given, its pairs' tokens
// (moe_align's trows: 8 u16); false where the row is past the list's length. The entry (and the tokens) are read
// together with the length (the grid has as many rows as the list has room for): one round trip after the wait where
// there were three (count, entry, rowmap). Traced at B = 8 (tern bench --trace, the slowest gate|up block's wait ->
// tokens staged, means over the layers): 14.8 -> 10.0 us; the median block's 7.0 -> 6.8.
struct MoeTile {
    int e, p0, cnt, n;
    uint4 rows;
    __device__ int row(int i) const {  // the token of the tile's pair i < 8
        const unsigned w = i < 4 ? (i < 2 ? rows.x : rows.y) : (i < 6 ? rows.z : rows.w);
        return (int)((w >> (16 * (i & 1))) & 0xffffu);
    }
};
// `wait` false: the caller waits itself, later (moe_down: the list is two launches old when it starts, so it may be
// read, and the weights it names requested, before the wait).
__device__ __forceinline__ bool moe_tile(const int* __restrict__ ntile, const int* __restrict__ tiles,
                                         const uint4* __restrict__ trows, int E, int I, int Is, MoeTile& m,
                                         bool wait = true) {
    if (wait) pdl_wait();
    const int t = blockIdx.y;
    const int len = *ntile;
    m.e = tiles[3 * t];
    m.p0 = tiles[3 * t + 1];
    m.cnt = tiles[3 * t + 2];
    if (trows) m.rows = trows[t];
    if (t >= len) return false;
    m.n = m.e == E ? Is : I;
    return true;
}

// act[p, j] = silu(G_e[j] . xn[rowmap[p]]) * (U_e[j] . xn[rowmap[p]]) (the tile's tokens from trows): item r of
// warp w is j in [j0 + 8 (w R + r), +8): A rows 0-7 are its gate rows, 8-15 its up rows (rows n + j), so every
// lane holds a gate and its up.
template <int W>
__device__ __forceinline__ void moe_gate_up_mma(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                                const __nv_bfloat16* __restrict__ b, long words, long groups, int E,
                                                int I, int Is, int H, int gshift,
                                                const __nv_bfloat16* __restrict__ xn,
                                                const int* __restrict__ ntile, const int* __restrict__ tiles,
                                                const uint4* __restrict__ trows, __nv_bfloat16* __restrict__ act,
                                                int ld) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    MoeTile tl;
    if (!moe_tile(ntile, tiles, trows, E, I, Is, tl)) return;
    const int e = tl.e, p0 = tl.p0, cnt = tl.cnt, n = tl.n;
    const int j0 = blockIdx.x * (MM_WARPS * MM_R * 8);
    if (j0 >= n || cnt <= 0) return;
    const int nk = H / (32 * W), ng = H >> (gshift + 5), rw = H / 8;
    // shared memory: xs [H / 8 * MM_TG] uint4 | xsum [nk][MM_TG] | scales, biases [2][64 (gate) + 64 (up)][sst]
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + H);
    __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(xsum + nk * MM_TG);
    const int sst = mma_scale_stride(ng), nj = min(MM_WARPS * MM_R * 8, n - j0);
    MmaRows m;
    m.wstep = (long)n * rw;  // the up rows
    m.sstep = 64 * sst;
    m.bdelta = 128 * sst;
    copy_scales(s, b, e * groups, j0, nj, ng, ss, sst, m.bdelta, 0);
    copy_scales(s, b, e * groups, n + j0, nj, ng, ss, sst, m.bdelta, 64);
    int jr[MM_R];
#pragma unroll
    for (int r = 0; r < MM_R; r++) {
        jr[r] = j0 + 8 * (warp * MM_R + r);
        const int jl = min(jr[r], n - 8) + g;  // an item past n reads a valid row and stores nothing
        m.wr[r] = w + e * words + (long)jl * rw + c * W;
        m.sr[r] = ss + (jl - j0) * sst;
    }
    for (int g0 = 0; g0 < cnt; g0 += MM_TG) {
        const int nt = min(MM_TG, cnt - g0);
        if (g0 > 0) __syncthreads();  // the previous pass is done with xs
        float tot[MM_R][4];
        rows_mma<W>(m, nk, gshift, nt, xs, xsum,
                    [&] {
                        cp_async_wait<0>();  // the scales (made visible by stage_mma's barrier)
                        stage_mma<W>(xn, H, [&](int t) { return tl.row(g0 + t); }, nt, H, xs, xsum);
                    },
                    tot);
#pragma unroll
        for (int r = 0; r < MM_R; r++) {
            if (jr[r] >= n) continue;
            const int j = jr[r] + g;
            if (2 * c < nt) act[(long)(p0 + g0 + 2 * c) * ld + j] = __float2bfloat16(silu_f(tot[r][0]) * tot[r][2]);
            if (2 * c + 1 < nt)
                act[(long)(p0 + g0 + 2 * c + 1) * ld + j] = __float2bfloat16(silu_f(tot[r][1]) * tot[r][3]);
        }
    }
}

// ybuf[p, r] = D_e[r] . act[p]: item q of warp w is rows [r0 + 16 (w R + q), +16) of H.
template <int W>
__device__ __forceinline__ void moe_down_mma(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                             const __nv_bfloat16* __restrict__ b, long words, long groups, int E,
                                             int I, int Is, int H, int gshift, const __nv_bfloat16* __restrict__ act,
                                             int ld,
                                             const int* __restrict__ ntile, const int* __restrict__ tiles,
                                             float* __restrict__ ybuf) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    MoeTile tl;
    if (!moe_tile(ntile, tiles, nullptr, E, I, Is, tl)) return;
    const int e = tl.e, p0 = tl.p0, cnt = tl.cnt, n = tl.n;
    const int r0 = blockIdx.x * (MM_WARPS * MM_R * 16);
    if (r0 >= H || cnt <= 0) return;
    const int nk = n / (32 * W), ng = n >> (gshift + 5), rw = n / 8;
    // shared memory: xs [Imax / 8 * MM_TG] uint4 | xsum [Imax / (32 W)][MM_TG] | scales, biases [2][128][sst]
    const int imax = I > Is ? I : Is;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + imax);
    __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(xsum + imax / (32 * W) * MM_TG);
    const int sst = mma_scale_stride(ng);
    MmaRows m;
    m.wstep = 8L * rw;  // rows g + 8
    m.sstep = 8 * sst;
    m.bdelta = 128 * sst;
    copy_scales(s, b, e * groups, r0, min(MM_WARPS * MM_R * 16, H - r0), ng, ss, sst, m.bdelta, 0);
    int rr[MM_R];
#pragma unroll
    for (int q = 0; q < MM_R; q++) {
        rr[q] = r0 + 16 * (warp * MM_R + q);
        const int rl = min(rr[q], H - 16) + g;  // an item past H reads valid rows and stores nothing
        m.wr[q] = w + e * words + (long)rl * rw + c * W;
        m.sr[q] = ss + (rl - r0) * sst;
    }
    for (int g0 = 0; g0 < cnt; g0 += MM_TG) {
        const int nt = min(MM_TG, cnt - g0);
        if (g0 > 0) __syncthreads();
        float tot[MM_R][4];
        rows_mma<W>(m, nk, gshift, nt, xs, xsum,
                    [&] {
                        cp_async_wait<0>();
                        stage_mma<W>(act, ld, [&](int t) { return p0 + g0 + t; }, nt, n, xs, xsum);
                    },
                    tot);
#pragma unroll
        for (int q = 0; q < MM_R; q++) {
            if (rr[q] >= H) continue;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = rr[q] + g + 8 * h;
                if (2 * c < nt) ybuf[(long)(p0 + g0 + 2 * c) * H + row] = tot[q][2 * h];
                if (2 * c + 1 < nt) ybuf[(long)(p0 + g0 + 2 * c + 1) * H + row] = tot[q][2 * h + 1];
            }
        }
    }
}

#define MOE_MMA(W)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_gate_up_seqs_w##W(                                    \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, long words, long groups, int E, int I, \
        int Is, int H, int gshift, const __nv_bfloat16* xn, const int* ntile, const int* tiles,                  \
        const uint4* trows,                                                                                      \
        __nv_bfloat16* act, int ld) {                                                                            \
        KTRACE(43);                                                                                              \
        moe_gate_up_mma<W>(w, s, b, words, groups, E, I, Is, H, gshift, xn, ntile, tiles, trows, act, ld);       \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_down_seqs_w##W(                                       \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, long words, long groups, int E, int I, \
        int Is, int H, int gshift, const __nv_bfloat16* act, int ld, const int* ntile, const int* tiles,          \
        float* ybuf) {                                                                                           \
        KTRACE(44);                                                                                              \
        moe_down_mma<W>(w, s, b, words, groups, E, I, Is, H, gshift, act, ld, ntile, tiles, ybuf);               \
    }
MOE_MMA(1)
MOE_MMA(2)

// ---- the ring kernels (moe_gate_up_ring_t{4,8}, moe_down_ring_t{4,8}): the experts' rows through shared memory ----
// Same products, arithmetic and results (bit for bit) as moe_gate_up_seqs_w2 / moe_down_seqs_w2, for group size 64
// and inner sizes that are multiples of 256; what differs is how the weights reach the tensor cores. There, every
// weight load of a warp touched 8 rows x 32 bytes (8 lines, one sector each) and held its data in registers until
// used; measured on the H200 (tools/moe_bench.cu), that access pattern alone moved a B = 32 layer's gate|up bytes in
// 65 us where whole-line loads take 42, and with the weights hot in L2 the kernel still took 68 of its 83 us. Here
// each warp streams its items through a private ring of RING_S stages in shared memory with 16-byte cp.async (8
// lanes a row: whole 128-byte lines, 4 rows an instruction, nothing held in registers), and reads them back as the
// mma fragments.
//
// A chunk is 256 columns of an item's 16 rows (128 bytes a row: 4 k-blocks of 64 columns, one group each) with the
// rows' 4 scales and 4 biases (8 bytes each, copied beside them: no block-wide scale copy before the first k-block).
// Stage layout (bytes): weights [RING_R items][16 rows][128], row q's 16-byte unit u at ((u ^ (q & 7)) << 4) so that
// the 8 rows g of one mma read distinct banks; then scales [RING_R][16][8] and biases [RING_R][16][8]. Lane (g, c)
// reads 8 bytes of rows g and g + 8 per k-block: the words c W + i (W = 2) of rows_mma's layout, so the activations
// are staged exactly as there (stage_mma, TGS token slots) and the mma, scale and bias steps are rows_mma's.
//
// moe_gate_up_ring_t{TGS}  as moe_gate_up_seqs_w2: block (x, y) = tile y (at most TGS pairs per pass), j in
//                   [64 x, +64): 4 warps of 2 items (8 gate rows + their 8 up rows). Shared memory: xs [H / 8 * TGS]
//                   uint4 | xsum [H / 64][TGS] (to 128 bytes) | 4 rings of RING_S stages (ring_smem in batch.rs).
// moe_down_ring_t{TGS}  as moe_down_seqs_w2: block (x, y) = tile y, rows [256 x, +256) of H: warp w takes items
//                   (s 4 + w) 2 + r (16 rows each) for sets s = 0, 1, streamed as one run of chunks. Shared memory:
//                   xs [Imax / 8 * TGS] | xsum [Imax / 64][TGS] (to 128 bytes) | 4 rings.
// Measured alone (tools/moe_bench.cu, H200, one layer, uniform routing, B = 1 / 8 / 32 / 64, tiles of 4): gate|up
// 15.3 / 33.6 / 80.8 / 110.9 -> 10.5 / 29.1 / 69.5 / 94.1 us, down 6.4 / 19.4 / 47.1 / 62.2 -> 5.9 / 15.2 / 34.9 / 46.1 us.
// The weights come from the experts' tile-major copy (experts_tile below), where every chunk of an item, 16 rows x 128
// bytes, is 2 KB in one run (and its scales and biases 128 bytes each): from the checkpoint's row-major layout each
// stage read 128 bytes at a 1 KB stride (gate|up) and DRAM delivered less (tools/moe_bench.cu, H200, tiles of 4, the
// same kernels reading either layout: gate|up 28.1 -> 24.1 us at B = 8, 67.7 -> 59.8 at 32, 91.2 -> 82.8 at 64; down
// 14.9 -> 13.7, 36.6 -> 34.3, 47.7 -> 46.7). The other expert kernels (batch 1, the prefill GEMMs, the
// register-streamed ones) keep reading the row-major buffers.
// Requirements (host): group size 64, H and the inner sizes multiples of 256, tiles of at most TGS pairs
// (or more: then passes of TGS, each streaming the rows again). They take the register-streamed kernels' arguments,
// gshift included (always 1 here), so that the host launches either with one argument list (the weights' three
// pointers then at the tile-major copy).
#define RING_R 2      // items per warp, computed together
#ifndef RING_S  // (tools/moe_bench.cu builds other depths to compare)
#define RING_S 2  // stages per warp ring
#endif
#define RING_NW 4     // warps per block
#define RING_SLOT (RING_R * (2048 + 256))

// experts_tile: the ring kernels' tile-major copy of `ne` experts of one expert buffer (w, s, b at expert 0 of the
// range; strides words / groups u32 / bf16 entries, the same in the copy). An expert's rows form items of 16: gate|up
// (kind 0, rows 2n x H columns) item q < n / 8 is gate rows 8q + (0..7) then their up rows n + 8q + (0..7), the ring's
// item; down (kind 1, H x n) item q < H / 16 is rows 16q + (0..15). Unit (q, cc, ri) = item q's row ri, columns
// [256 cc, +256), at ((q nc + cc) 16 + ri) (nc = cols / 256): 128 bytes of codes at that unit x 128, its 4 scales and
// 4 biases at that unit x 8 bytes. One thread a 16-byte unit of codes (and, for the first of a row's 8, its scales
// and biases); grid-stride. Requirements (host): group size 64, cols a multiple of 256, rows of whole items.
extern "C" __global__ void experts_tile(const uint4* __restrict__ w, const uint2* __restrict__ s,
                                        const uint2* __restrict__ b, long words, long groups, int ne, int kind, int n,
                                        int H, uint4* __restrict__ wt, uint2* __restrict__ st, uint2* __restrict__ bt) {
    const int rows = kind == 0 ? 2 * n : H, cols = kind == 0 ? H : n, nc = cols / 256;
    const long per = (long)rows * cols / 32;  // 16-byte units of codes an expert
    for (long v = (long)blockIdx.x * blockDim.x + threadIdx.x; v < per * ne; v += (long)gridDim.x * blockDim.x) {
        const long e = v / per, u = v - e * per;
        const int k = (int)(u & 7), ri = (int)((u >> 3) & 15);
        const long qc = u >> 7;
        const int q = (int)(qc / nc), cc = (int)(qc - (long)q * nc);
        const long row = kind == 0 ? 8L * q + (ri & 7) + (ri >> 3) * (long)n : 16L * q + ri;
        wt[e * words / 4 + (u >> 3) * 8 + k] = w[e * words / 4 + row * (cols / 32) + cc * 8 + k];
        if (k == 0) {
            const long src = e * groups / 4 + row * (cols / 256) + cc, dst = e * groups / 4 + (u >> 3);
            st[dst] = s[src];
            bt[dst] = b[src];
        }
    }
}

__device__ __forceinline__ void cp_async16_l2(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ uint2 lds64(const unsigned char* p) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(smem_u32(p)));
    return v;
}

// Where item r of a warp's set starts: its row 0's weights, scales and biases (bytes, column 0).
struct RingItem {
    const unsigned char *w, *s, *b;
};

// The products of this warp's item sets: set it (< sets), item r: rows 0-7 at item(it, r).w with row stride rs
// bytes, rows 8-15 at + wstep, chunk cc at + cc cw (scales likewise: srs, swstep, cs), over nc chunks, with the staged tokens (xs, xsum; nt of
// them in TGS slots, NT groups of 8 when NT > 1: each k-block's weights dequantised once for all of them); emit(it,
// tot) gets each set's sums, tot[t][r][0..3] as rows_mma's for token group t (tokens 8 t + 2c, + 1). `stg` stages xs / xsum (block-wide, ending
// with a barrier) once the first stage is in flight. The ring is this warp's RING_S stages. Every lane of the warp
// calls it; cp.async groups are committed one per unit (empty ones too), so that waiting for all but the newest
// RING_S - 2 leaves the unit about to be used complete; the __syncwarp after that wait makes every lane's copies
// visible to the warp, and (one unit later) keeps a stage from being refilled while a lane still reads it.
template <int TGS, int NT = 1, typename Item, typename Stage, typename Emit>
__device__ __forceinline__ void rows_ring(Item item, int sets, int nc, long rs, long wstep, long srs, long swstep,
                                          int nt, const uint4* xs, const float* xsum, unsigned char* ring, Stage stg,
                                          Emit emit, long cw, long cs) {
    constexpr int R = RING_R, S = RING_S;
    const int lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
    const bool tok = g < nt;
    uint32_t mask = 0x000F000Fu, hi = 0x43004300u;
    asm volatile("" : "+r"(mask), "+r"(hi));
    // this lane's copies: weight unit k (0..3) is row 4k + lane / 8, 16-byte unit lane % 8 of the row's 128 bytes
    const int l8 = lane >> 3, u = lane & 7;
    long src_w[4];
    uint32_t dst_w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int row = 4 * k + l8;
        src_w[k] = (long)(row & 7) * rs + (row >> 3) * wstep + 16 * u;
        dst_w[k] = row * 128 + ((u ^ (row & 7)) << 4);
    }
    // scales and biases: lanes 0-15 copy the scales of row lane, lanes 16-31 the biases of row lane - 16
    const int qs = lane & 15;
    const long src_s = (long)(qs & 7) * srs + (qs >> 3) * swstep;
    const uint32_t dst_s = R * 2048 + (lane >> 4) * (R * 128) + qs * 8;
    const int units = sets * nc;
    int iit = 0, icc = 0, islot = 0;  // the next unit to copy (set, chunk) and its stage: counters, no divisions
    auto issue = [&]() {
        unsigned char* slot = ring + islot * RING_SLOT;
        const int it = iit, cc = icc;
        if (++icc == nc) {
            icc = 0;
            iit++;
        }
        islot = islot == S - 1 ? 0 : islot + 1;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const RingItem ip = item(it, r);
#pragma unroll
            for (int k = 0; k < 4; k++) cp_async16_l2(slot + r * 2048 + dst_w[k], ip.w + src_w[k] + cc * cw);
            cp_async8(slot + dst_s + r * 128, (lane < 16 ? ip.s : ip.b) + src_s + cc * cs);
        }
    };
    // the first S - 1 units' copies: stg issues them (its `first` argument) where its own loads allow
    stg([&] {
#pragma unroll
        for (int v = 0; v < S - 1; v++) {
            if (v < units) issue();
            cp_async_commit();
        }
    });
    float tot[NT][R][4];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int r = 0; r < R; r++) tot[t][r][0] = tot[t][r][1] = tot[t][r][2] = tot[t][r][3] = 0.f;
    int un = 0, cslot = 0;
    for (int it = 0; it < sets; it++)
        for (int cc = 0; cc < nc; cc++, un++) {
            cp_async_wait<S - 2>();
            __syncwarp();
            if (un + S - 1 < units) issue();
            cp_async_commit();
            const unsigned char* slot = ring + cslot * RING_SLOT;
            cslot = cslot == S - 1 ? 0 : cslot + 1;
            // the 4 groups' scales and biases of rows g and g + 8 of each item (bf16 pairs: groups 0 1 | 2 3)
            uint2 sv[R][2], bv[R][2];
#pragma unroll
            for (int r = 0; r < R; r++) {
                sv[r][0] = lds64(slot + R * 2048 + r * 128 + g * 8);
                sv[r][1] = lds64(slot + R * 2048 + r * 128 + (g + 8) * 8);
                bv[r][0] = lds64(slot + R * 2048 + R * 128 + r * 128 + g * 8);
                bv[r][1] = lds64(slot + R * 2048 + R * 128 + r * 128 + (g + 8) * 8);
            }
#pragma unroll
            for (int kbl = 0; kbl < 4; kbl++) {
                const int kb = cc * 4 + kbl;
                const int woff = g * 128 + (((2 * kbl + (q4 >> 1)) ^ g) << 4) + (q4 & 1) * 8;
                // group kbl's scale and bias of rows g and g + 8 (bf16 in the low or high half of a pair)
                auto half = [&](const uint2& v) {
                    const uint32_t p = kbl < 2 ? v.x : v.y;
                    return __uint_as_float((kbl & 1) ? p & 0xffff0000u : p << 16);
                };
                if constexpr (NT == 1) {
                    uint4 x[2];
#pragma unroll
                    for (int i = 0; i < 2; i++)
                        x[i] = tok ? xs[(kb * 2 + i) * (4 * TGS) + lane] : make_uint4(0u, 0u, 0u, 0u);
                    float2 xsm = make_float2(0.f, 0.f);
                    if (2 * q4 < TGS) xsm = *reinterpret_cast<const float2*>(xsum + kb * TGS + 2 * q4);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const uint2 wl = lds64(slot + r * 2048 + woff), wh = lds64(slot + r * 2048 + 1024 + woff);
                        const uint32_t w0s[2] = {wl.x, wl.y}, w1s[2] = {wh.x, wh.y};
                        kblock_mma<2>(w0s, w1s, x, xsm, half(sv[r][0]), half(sv[r][1]), half(bv[r][0]),
                                      half(bv[r][1]), mask, hi, tot[0][r]);
                    }
                } else {
                    // each item's fragments once, then every token group's activations applied to them
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const uint2 wl = lds64(slot + r * 2048 + woff), wh = lds64(slot + r * 2048 + 1024 + woff);
                        const uint32_t w0s[2] = {wl.x, wl.y}, w1s[2] = {wh.x, wh.y};
                        MmaFrag<2> fr;
                        frag_mma<2>(w0s, w1s, mask, hi, fr);
                        apply_groups<NT, TGS>(fr, xs, xsum, kb, lane, half(sv[r][0]), half(sv[r][1]), half(bv[r][0]),
                                              half(bv[r][1]), [&](int t) -> float(&)[4] { return tot[t][r]; });
                    }
                }
            }
            if (cc == nc - 1) {
                emit(it, tot);
#pragma unroll
                for (int t = 0; t < NT; t++)
#pragma unroll
                    for (int r = 0; r < R; r++) tot[t][r][0] = tot[t][r][1] = tot[t][r][2] = tot[t][r][3] = 0.f;
            }
        }
    trace_mark(1);
    cp_async_wait<0>();  // nothing of this warp's ring is left in flight when the caller reuses it
    __syncwarp();
}

// Offset of the rings in the ring kernels' shared memory: after xs and xsum for `cols` columns, to 128 bytes.
__device__ __forceinline__ int ring_base(int cols, int tgs) { return (cols / 8 * tgs * 16 + cols / 64 * tgs * 4 + 127) & ~127; }

template <int TGS>
__device__ __forceinline__ void moe_gate_up_ring(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                                 const __nv_bfloat16* __restrict__ b, long words, long groups, int E,
                                                 int I, int Is, int H, const __nv_bfloat16* __restrict__ xn,
                                                 const int* __restrict__ ntile, const int* __restrict__ tiles,
                                                 const uint4* __restrict__ trows, __nv_bfloat16* __restrict__ act,
                                                 int ld) {
    constexpr int JB = RING_NW * RING_R * 8;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    MoeTile tl;
    if (!moe_tile(ntile, tiles, trows, E, I, Is, tl)) return;
    const int e = tl.e, p0 = tl.p0, cnt = tl.cnt, n = tl.n;
    const int j0 = blockIdx.x * JB;
    if (j0 >= n || cnt <= 0) return;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + H / 8 * TGS);
    unsigned char* ring = smem + ring_base(H, TGS) + warp * RING_S * RING_SLOT;
    const unsigned char* wb = reinterpret_cast<const unsigned char*>(w + e * words);
    const unsigned char* sb = reinterpret_cast<const unsigned char*>(s + e * groups);
    const unsigned char* bb = reinterpret_cast<const unsigned char*>(b + e * groups);
    // item r: gate rows j .. j + 7 and up rows n + j .., tile-major item j / 8 (H / 256 chunks of 16 rows x 128 bytes,
    // and 16 x 8 bytes of scales); an item past n reads valid rows and stores nothing
    auto item = [&](int, int r) {
        const long q = min(j0 + 8 * (warp * RING_R + r), n - 8) / 8;
        return RingItem{wb + q * H * 8, sb + q * H / 2, bb + q * H / 2};
    };
    for (int g0 = 0; g0 < cnt; g0 += TGS) {
        const int nt = min(TGS, cnt - g0);
        if (g0 > 0) __syncthreads();  // the previous pass is done with xs
        rows_ring<TGS>(
            item, 1, H / 256, 128, 1024, 8, 64, nt, xs, xsum, ring,
            [&](auto first) {
                stage_mma<2, TGS>(xn, H, [&](int t) { return tl.row(g0 + t); }, nt, H, xs, xsum, first);
                trace_mark(0);
            },
            [&](int, float(&tot)[1][RING_R][4]) {
#pragma unroll
                for (int r = 0; r < RING_R; r++) {
                    const int jr = j0 + 8 * (warp * RING_R + r);
                    if (jr >= n) continue;
#pragma unroll
                    for (int q = 0; q < 2; q++)
                        if (2 * c + q < nt)
                            act[(long)(p0 + g0 + 2 * c + q) * ld + jr + g] =
                                __float2bfloat16(silu_f(tot[0][r][q]) * tot[0][r][2 + q]);
                }
            },
            2048, 128);
    }
}

template <int TGS>
__device__ __forceinline__ void moe_down_ring(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                              const __nv_bfloat16* __restrict__ b, long words, long groups, int E,
                                              int I, int Is, int H, const __nv_bfloat16* __restrict__ act, int ld,
                                              const int* __restrict__ ntile, const int* __restrict__ tiles,
                                              float* __restrict__ ybuf) {
    constexpr int SETS = 2, RB = RING_NW * RING_R * 16 * SETS;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    MoeTile tl;
    // the tile list is moe_align's, two launches back (gate|up between): read, and its expert's first weights
    // requested, before the dependency wait; act (gate|up's) after it
    if (!moe_tile(ntile, tiles, nullptr, E, I, Is, tl, false)) return;
    const int e = tl.e, p0 = tl.p0, cnt = tl.cnt, n = tl.n;
    const int r0 = blockIdx.x * RB;
    if (r0 >= H || cnt <= 0) return;
    const int imax = I > Is ? I : Is;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + imax / 8 * TGS);
    unsigned char* ring = smem + ring_base(imax, TGS) + warp * RING_S * RING_SLOT;
    const unsigned char* wb = reinterpret_cast<const unsigned char*>(w + e * words);
    const unsigned char* sb = reinterpret_cast<const unsigned char*>(s + e * groups);
    const unsigned char* bb = reinterpret_cast<const unsigned char*>(b + e * groups);
    auto start = [&](int it, int r) { return r0 + 16 * ((it * RING_NW + warp) * RING_R + r); };
    // tile-major item rl / 16 (n / 256 chunks of 16 rows x 128 bytes, 16 x 8 bytes of scales); an item past H reads
    // valid rows and stores nothing
    auto item = [&](int it, int r) {
        const long q = min(start(it, r), H - 16) / 16;
        return RingItem{wb + q * n * 8, sb + q * n / 2, bb + q * n / 2};
    };
    for (int g0 = 0; g0 < cnt; g0 += TGS) {
        const int nt = min(TGS, cnt - g0);
        if (g0 > 0) __syncthreads();
        rows_ring<TGS>(
            item, SETS, n / 256, 128, 1024, 8, 64, nt, xs, xsum, ring,
            [&](auto first) {
                if (g0 == 0) {  // the first pass's first weights before the wait, later passes' behind their loads
                    first();
                    pdl_wait();
                }
                // one inlined copy of the staging (two made the kernel 41 KB of code where it was 29)
                stage_mma<2, TGS>(act, ld, [&](int t) { return p0 + g0 + t; }, nt, n, xs, xsum, [&] {
                    if (g0 > 0) first();
                });
                trace_mark(0);
            },
            [&](int it, float(&tot)[1][RING_R][4]) {
#pragma unroll
                for (int q = 0; q < RING_R; q++) {
                    const int rr = start(it, q);
                    if (rr >= H) continue;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int row = rr + g + 8 * h;
                        if (2 * c < nt) ybuf[(long)(p0 + g0 + 2 * c) * H + row] = tot[0][q][2 * h];
                        if (2 * c + 1 < nt) ybuf[(long)(p0 + g0 + 2 * c + 1) * H + row] = tot[0][q][2 * h + 1];
                    }
                }
            },
            2048, 128);
    }
}

#define MOE_RING(TGS, MINB)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128, MINB) moe_gate_up_ring_t##TGS(                               \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, long words, long groups, int E, int I, \
        int Is, int H, int, const __nv_bfloat16* xn, const int* ntile, const int* tiles, const uint4* trows,     \
        __nv_bfloat16* act, int ld) {                                                                            \
        KTRACE(43);                                                                                              \
        moe_gate_up_ring<TGS>(w, s, b, words, groups, E, I, Is, H, xn, ntile, tiles, trows, act, ld);            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, 4) moe_down_ring_t##TGS(                                     \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, long words, long groups, int E, int I, \
        int Is, int H, int, const __nv_bfloat16* act, int ld, const int* ntile, const int* tiles, float* ybuf) { \
        KTRACE(44);                                                                                              \
        moe_down_ring<TGS>(w, s, b, words, groups, E, I, Is, H, act, ld, ntile, tiles, ybuf);                    \
    }
MOE_RING(4, 4)
MOE_RING(8, 3)

// dense_ring_n{NT}: y[t, r] (+)= W[r] . x[t] as dense_seqs (the contract at the top), through the ring kernels'
// whole-line weight stream (rows_ring) with every k-block's weights dequantised once for all the n <= 8 NT tokens
// (NT groups of 8), where dense_seqs' blocks of 8 tokens each read and dequantise every weight again (n / 8 times).
// Block (x, 0, z): rows [128 x, +128) (4 warps x 2 items of 16 rows), columns [cz z, +cz) with cz = cols / KZ
// (KZ = gridDim.z, one cluster); x of the block's columns staged as the ring kernels stage tokens (TGS = 8 NT
// slots). KZ = 1: each lane stores its sums. KZ > 1: each warp leaves its 32 x TGS sums in its own ring (8 KB of its
// 9 KB) once it has read its last chunk, and after a cluster barrier block z adds up outputs [z, z + 1) 128 TGS / KZ
// of the tile over the cluster's blocks in z order (the same bits for any z: a partial sum per range, then the ranges
// in order).
// Requirements (host): group size 64, rows a multiple of 16 (an item past the end reads valid rows and stores
// nothing), cz a multiple of 256 with cz TGS <= 32768 (stage_mma's division), KZ <= 8. Shared memory ring_smem(cz,
// TGS) (a ring 4 stages deep was no faster: lm_head at 8 tokens 102 -> 112 us, in_proj 9.5 -> 9.8).
template <int NT>
__device__ __forceinline__ void dense_ring(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                           const __nv_bfloat16* __restrict__ b, int rows, int cols,
                                           const __nv_bfloat16* __restrict__ x, int n, float* __restrict__ y, int ldy,
                                           int add) {
    constexpr int TGS = 8 * NT, RB = RING_NW * RING_R * 16;
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int r0 = blockIdx.x * RB;
    const int KZ = gridDim.z, cz = cols / KZ, c0 = blockIdx.z * cz;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + cz / 8 * TGS);
    unsigned char* rings = smem + ring_base(cz, TGS);
    const long rs = cols / 2, srs = cols / 32;  // bytes per row: codes, and scales (64-column groups, bf16)
    const unsigned char* wb = reinterpret_cast<const unsigned char*>(w) + c0 / 2;
    const unsigned char* sb = reinterpret_cast<const unsigned char*>(s) + c0 / 32;
    const unsigned char* bb = reinterpret_cast<const unsigned char*>(b) + c0 / 32;
    auto start = [&](int r) { return r0 + 16 * (warp * RING_R + r); };
    auto item = [&](int, int r) {
        const int rl = min(start(r), rows - 16);
        return RingItem{wb + rl * rs, sb + rl * srs, bb + rl * srs};
    };
    const int KZ1 = KZ == 1;
    // KZ > 1: the warp's sums [32 rows][TGS] go to its own ring once its last chunk is read (no copy is in flight
    // then), for its cluster
    float* zw = reinterpret_cast<float*>(rings + warp * RING_S * RING_SLOT);
    rows_ring<TGS, NT>(
        item, 1, cz / 256, rs, 8 * rs, srs, 8 * srs, n, xs, xsum, rings + warp * RING_S * RING_SLOT,
        [&](auto first) {
            first();     // the weights do not depend on the previous kernels: in flight before the wait
            pdl_wait();  // x (and y when adding) come from the previous kernels
            stage_mma<2, TGS>(x + c0, cols, [](int t) { return t; }, n, cz, xs, xsum);
            trace_mark(0);
        },
        [&](int, float(&tot)[NT][RING_R][4]) {
            if (!KZ1) __syncwarp();  // every lane is done reading the ring
            // token group t, item r, v = 2 h + j: row start(r) + g + 8 h, token 8 t + 2 c + j
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int r = 0; r < RING_R; r++)
#pragma unroll
                    for (int v = 0; v < 4; v++) {
                        const int rl = 16 * r + g + 8 * (v >> 1), tk = 8 * t + 2 * c + (v & 1);
                        if (KZ1) {
                            const int row = start(0) + rl;
                            if (row < rows && tk < n) {
                                float* dst = y + (long)tk * ldy + row;
                                *dst = add ? *dst + tot[t][r][v] : tot[t][r][v];
                            }
                        } else {
                            zw[rl * TGS + tk] = tot[t][r][v];
                        }
                    }
        },
        128, 8);  // the dense matrices' own row-major layout
    if (KZ1) return;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's sums are in its shared memory
    // output o = (row r0 + o / TGS, token o % TGS) is at float (o / TGS / 32) RING_S RING_SLOT / 4 + o % (32 TGS)
    const int per = RB * TGS / KZ, o0 = blockIdx.z * per;
    for (int o = o0 + threadIdx.x; o < o0 + per; o += blockDim.x) {
        const int row = r0 + o / TGS, tk = o % TGS;
        if (row >= rows || tk >= n) continue;
        const int at = (o / (32 * TGS)) * (RING_S * RING_SLOT / 4) + o % (32 * TGS);
        float v = 0.f;
        for (int z = 0; z < KZ; z++) v += cluster.map_shared_rank(reinterpret_cast<float*>(rings), z)[at];
        float* dst = y + (long)tk * ldy + row;
        *dst = add ? *dst + v : v;
    }
    cluster.sync();  // no block leaves while another may still read its sums
}

#define DENSE_RING(NT, MINB)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128, MINB) dense_ring_n##NT(                                      \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols,                   \
        const __nv_bfloat16* x, int n, float* y, int ldy, int add) {                                             \
        KTRACE(46);                                                                                              \
        dense_ring<NT>(w, s, b, rows, cols, x, n, y, ldy, add);                                                  \
    }
DENSE_RING(1, 3)
DENSE_RING(2, 3)
DENSE_RING(4, 2)
DENSE_RING(8, 2)

// dense_tma_n{NT}: y[t, r] (+)= W[r] . x[t] as dense_seqs (the contract at the top) for any n <= 64, in passes of up
// to TGS = 8 NT tokens, the weights streamed through a block-wide ring as gemv_tma streams batch 1's: at most one
// block of DT_WARPS warps a multiprocessor, each taking a contiguous range of the matrix's 16-row units (u0 .. u0 +
// my), a unit = 16 whole rows with their scales and biases, one ring slot (S of them, each with an mbarrier). Thread 0
// copies a unit with three bulk copies (TMA: its codes, scales, biases, each one contiguous run). The ring runs over
// the block's items j = pass my + unit, so the next pass's first units are in flight while a pass ends; where the
// block's units all fit in the ring (my <= S) they are copied once and every pass reads them again. The first S items
// are requested before the dependency wait (the weights are constants); a pass's tokens are staged at its first item
// (stage_mma). Warp w takes the k-blocks [w nkw, (w + 1) nkw) (nkw = cols / 64 / DT_WARPS) of every unit,
// dequantising each k-block once for all the pass's token groups (frag_mma, apply_mma: the ring kernels' arithmetic),
// and leaves its 16 x TGS partial sums in red[j & 1][w] (token-major); one barrier an item, after which thread 0
// refills the item's slot with item j + S and thread (token, row) adds the warps' partials in warp order and stores
// (or adds) y. Deterministic, and the same bits for any TGS and S (a token's sums do not depend on its pass). The rows
// keep their stride of cols / 2 bytes in a slot, so the 8-byte loads of rows g = 0..3 of an mma meet in the same
// banks (4-way); measured on the H200 (docs/decisions.md, step 38), a bulk copy per row into padded rows (48 small
// copies a unit from one thread) was 2-3x slower, and 16-byte cp.async from every thread into swizzled rows no
// faster. Also measured (step 40): warps that run ahead (no barrier within a pass; the last warp done with an item
// refills its slot and adds the partials) were slower at every n (in_proj at 8 tokens 8.0 -> 12.1 us): one warp's
// sum of the partials is on the next item's path where 256 threads' was short.
// Requirements (host): group size 64, rows a multiple of 16, cols 2048 or 4096 (whole 16-byte scale rows, a multiple
// of 4 k-blocks a warp), cols TGS <= 65536 (stage_mma's division exact), S <= DT_MAXS; shared memory
// dense_tma_smem(cols, TGS, S).
#define DT_WARPS 8
#define DT_MAXS 8
template <int NT>
__device__ __forceinline__ void dense_tma(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                          const __nv_bfloat16* __restrict__ b, int rows, int cols,
                                          const __nv_bfloat16* __restrict__ x, int n, float* __restrict__ y, int ldy,
                                          int add, int S) {
    constexpr int TGS = 8 * NT;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[DT_MAXS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int rb = cols / 2, sbr = cols / 32;  // bytes a row: codes, scales (and biases)
    const int slot_bytes = (16 * (rb + 2 * sbr) + 127) & ~127;
    const int units = rows / 16;
    const int u0 = (int)((unsigned)units * blockIdx.x / gridDim.x);
    const int my = (int)((unsigned)units * (blockIdx.x + 1) / gridDim.x) - u0;
    const int passes = (n + TGS - 1) / TGS, items = passes * my;
    const bool resident = my <= S;  // every unit stays in its slot for all the passes
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + cols / 8 * TGS);
    float* red = xsum + cols / 64 * TGS;  // [2][DT_WARPS][TGS tokens][16 rows]
    unsigned char* ring = smem + ((cols / 8 * TGS * 16 + cols / 64 * TGS * 4 + 2 * DT_WARPS * 16 * TGS * 4 + 127) & ~127);
    const unsigned char* wb = reinterpret_cast<const unsigned char*>(w);
    const unsigned char* sb = reinterpret_cast<const unsigned char*>(s);
    const unsigned char* bb = reinterpret_cast<const unsigned char*>(b);
    auto issue = [&](int j, int slot) {  // thread 0: the unit of item j into `slot`
        unsigned char* d = ring + slot * slot_bytes;
        const long r0 = (long)(u0 + j % my) * 16;
        mbar_expect_tx(&full[slot], 16 * (rb + 2 * sbr));
        bulk_g2s(d, wb + r0 * rb, 16 * rb, &full[slot]);
        bulk_g2s(d + 16 * rb, sb + r0 * sbr, 16 * sbr, &full[slot]);
        bulk_g2s(d + 16 * rb + 16 * sbr, bb + r0 * sbr, 16 * sbr, &full[slot]);
    };
    if (tid == 0) {
#pragma unroll 1
        for (int i = 0; i < S; i++) mbar_init(&full[i], 1);
        mbar_fence_init();
#pragma unroll 1
        for (int j = 0; j < min(S, resident ? my : items); j++) issue(j, j);  // constants: before the wait
    }
    __syncthreads();  // the barriers are initialised for every thread
    pdl_wait();       // x (and y when adding) come from the previous kernels
    uint32_t mask = 0x000F000Fu, hi = 0x43004300u;
    asm volatile("" : "+r"(mask), "+r"(hi));
    const int nkw = cols / 64 / DT_WARPS, kw0 = warp * nkw;
    int slot = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (int p = 0; p < passes; p++) {
        const int t0 = p * TGS, nt = min(TGS, n - t0);
        // the pass's tokens (every warp is past the last pass's reads of xs: the barrier at its last item)
        // (32 tokens: 16 loads a thread a round, two rounds; 8 took four)
        stage_mma<2, TGS, NT >= 4 ? 16 : 8>(x + (long)t0 * cols, cols, [](int t) { return t; }, nt, cols, xs, xsum);
        if (p == 0) trace_mark(0);
#pragma unroll 1
        for (int i = 0; i < my; i++) {
            const int j = p * my + i;
            if (resident) slot = i;
            if (!resident || p == 0) mbar_wait(&full[slot], phase);
            if (j == 0) trace_mark(1);
            const unsigned char* d = ring + slot * slot_bytes;
            float tot[NT][4];
#pragma unroll
            for (int t = 0; t < NT; t++) tot[t][0] = tot[t][1] = tot[t][2] = tot[t][3] = 0.f;
#pragma unroll 1
            for (int kq = 0; kq < nkw; kq += 4) {
                // the 4 groups' scales and biases of rows g and g + 8 (bf16 pairs: groups 0 1 | 2 3)
                const unsigned char* sp = d + 16 * rb + (kw0 + kq) * 2;
                const uint2 sv0 = lds64(sp + g * sbr), sv1 = lds64(sp + (g + 8) * sbr);
                const uint2 bv0 = lds64(sp + 16 * sbr + g * sbr), bv1 = lds64(sp + 16 * sbr + (g + 8) * sbr);
#pragma unroll
                for (int kbl = 0; kbl < 4; kbl++) {
                    const int kb = kw0 + kq + kbl;
                    auto half = [&](const uint2& v) {
                        const uint32_t pv = kbl < 2 ? v.x : v.y;
                        return __uint_as_float((kbl & 1) ? pv & 0xffff0000u : pv << 16);
                    };
                    // the lane's 8 bytes of the k-block in rows g and g + 8
                    const uint2 wl = lds64(d + g * rb + kb * 32 + c * 8);
                    const uint2 wh = lds64(d + (g + 8) * rb + kb * 32 + c * 8);
                    const uint32_t w0s[2] = {wl.x, wl.y}, w1s[2] = {wh.x, wh.y};
                    MmaFrag<2> fr;
                    frag_mma<2>(w0s, w1s, mask, hi, fr);
                    apply_groups<NT, TGS>(fr, xs, xsum, kb, lane, half(sv0), half(sv1), half(bv0), half(bv1),
                                          [&](int t) -> float(&)[4] { return tot[t]; });
                }
            }
            // tot[t][v]: row g + 8 (v >> 1), token 8 t + 2 c + (v & 1)
            float* rw = red + ((j & 1) * DT_WARPS + warp) * 16 * TGS;
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int v = 0; v < 4; v++) rw[(8 * t + 2 * c + (v & 1)) * 16 + g + 8 * (v >> 1)] = tot[t][v];
            __syncthreads();  // every warp is done with the slot (and with xs) and has left its partial sums
            if (tid == 0 && !resident && j + S < items) {
                fence_proxy_async();
                issue(j + S, slot);
            }
            const float* rr = red + (j & 1) * DT_WARPS * 16 * TGS;
            for (int o = tid; o < 16 * nt; o += blockDim.x) {
                float v = 0.f;
#pragma unroll
                for (int q = 0; q < DT_WARPS; q++) v += rr[q * 16 * TGS + o];
                float* dst = y + (long)(t0 + (o >> 4)) * ldy + (u0 + i) * 16 + (o & 15);
                *dst = add ? *dst + v : v;
            }
            if (!resident && ++slot == S) {
                slot = 0;
                phase ^= 1u;
            }
        }
    }
}

#define DENSE_TMA(NT)                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * DT_WARPS, 1) dense_tma_n##NT(                                \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols,                   \
        const __nv_bfloat16* x, int n, float* y, int ldy, int add, int S) {                                      \
        KTRACE(46);                                                                                              \
        dense_tma<NT>(w, s, b, rows, cols, x, n, y, ldy, add, S);                                                \
    }
DENSE_TMA(1)
DENSE_TMA(2)
DENSE_TMA(4)

// dense_seqs_w{W}_k{KS}: see the contract at the top. Block: 4 warps over 128 / KS rows; warp w takes the k-blocks of
// split w % KS (KS contiguous ranges, each a whole number of groups) for 2 items of 16 rows at (w / KS) 32; the splits'
// sums meet in shared memory in split order (deterministic). Item starts are clamped to rows - 16 (an item past the end
// recomputes rows of the one before and stores only its own). Shared memory: xs [cz / 8 * MM_TG] uint4 |
// xsum [nk][MM_TG] | scales, biases [2][128 / KS][sst] | partials [KS - 1][128 / KS rows x 8 tokens] |
// the block's sums [128 / KS rows][8 tokens] (read by its cluster where KZ > 1). Where even that leaves the GPU idle
// (2,048-row matrices at B <= 8: 64 blocks of 4 warps), the columns are also split over gridDim.z = KZ blocks (cz =
// cols / KZ each, staged alone), launched as one cluster: each leaves its sums in its shared memory, and after a
// cluster barrier the block of rank 0 adds the KZ blocks' sums in z order into y (the same bits as the one-block sum
// would give: a partial sum per range, then the ranges in order). Before, the blocks wrote their sums to global
// memory, fenced, counted themselves with an atomic and the last one re-read them: out_proj at B = 8 13.5 -> 11.0 us a
// launch (tern bench --trace, from its first dependency wait to its last exit).
template <int W, int KS>
__device__ __forceinline__ void dense_mma(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                          const __nv_bfloat16* __restrict__ b, int rows, int cols, int gshift,
                                          const __nv_bfloat16* __restrict__ x, int n, float* __restrict__ y, int ldy,
                                          int add) {
    constexpr int RB = MM_WARPS * MM_R * 16 / KS;  // rows per block
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int ks = warp % KS, wi = warp / KS;
    const int t0 = blockIdx.x * MM_TG, nt = min(MM_TG, n - t0);
    const int r0 = blockIdx.y * RB;
    const int KZ = gridDim.z, cz = cols / KZ, c0 = blockIdx.z * cz;  // this block's columns [c0, c0 + cz)
    const int nk = cz / (32 * W), ng = cols >> (gshift + 5), rw = cols / 8, nkw = nk / KS;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    float* xsum = reinterpret_cast<float*>(xs + cz);
    __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(xsum + nk * MM_TG);
    const int sst = mma_scale_stride(ng);
    float* red = reinterpret_cast<float*>(ss + 2 * RB * sst);
    // the block's scale rows [sb, re): its rows, or the last 16 when fewer are left
    const int sb = max(0, min(r0, rows - 16)), re = min(r0 + RB, rows);
    MmaRows m;
    m.wstep = 8L * rw;  // rows g + 8
    m.sstep = 8 * sst;
    m.bdelta = RB * sst;
    copy_scales(s, b, 0, sb, re - sb, ng, ss, sst, m.bdelta, 0);
    int rr[MM_R], rs[MM_R];
    const int k0 = c0 / (32 * W) + ks * nkw;  // the warp's first k-block in the row
#pragma unroll
    for (int q = 0; q < MM_R; q++) {
        rr[q] = r0 + 32 * wi + 16 * q;
        rs[q] = max(0, min(rr[q], rows - 16));
        m.wr[q] = w + (long)(rs[q] + g) * rw + c * W + (long)k0 * 4 * W;
        m.sr[q] = ss + (rs[q] + g - sb) * sst + ((k0 * W) >> gshift);
    }
    float tot[MM_R][4];
    rows_mma<W>(m, nkw, gshift, nt, xs + ks * nkw * W * 32, xsum + ks * nkw * MM_TG,
                [&] {
                    pdl_wait();          // x (and y when adding) come from the previous kernels
                    cp_async_wait<0>();  // the scales (made visible by stage_mma's barrier)
                    stage_mma<W>(x + c0, cols, [&](int t) { return t0 + t; }, nt, cz, xs, xsum);
                    trace_mark(0);
                },
                tot);
    trace_mark(1);
    if (KS > 1) {
        float* mine = red + ((ks - 1) * (RB / 32) + wi) * (MM_R * 4 * 32);
        if (ks > 0)
#pragma unroll
            for (int q = 0; q < MM_R; q++)
#pragma unroll
                for (int v = 0; v < 4; v++) mine[(q * 4 + v) * 32 + lane] = tot[q][v];
        __syncthreads();
        if (ks == 0)
            for (int k2 = 1; k2 < KS; k2++) {
                const float* o = red + ((k2 - 1) * (RB / 32) + wi) * (MM_R * 4 * 32);
#pragma unroll
                for (int q = 0; q < MM_R; q++)
#pragma unroll
                    for (int v = 0; v < 4; v++) tot[q][v] += o[(q * 4 + v) * 32 + lane];
            }
    }
    // the outputs of warp (ks 0, wi): (row, token) of item q, h, j, where the item owns the row and the token is one
    // of the block's
    auto each = [&](auto&& f) {
#pragma unroll
        for (int q = 0; q < MM_R; q++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = rs[q] + g + 8 * h;
                if (row < rr[q] || row >= re) continue;  // another item's row, or past the end
#pragma unroll
                for (int j = 0; j < 2; j++)
                    if (2 * c + j < nt) f(row, t0 + 2 * c + j, tot[q][2 * h + j]);
            }
    };
    if (KZ > 1) {
        // the block's sums at [row - r0][token - t0]; the cluster is this block's KZ z-blocks, rank = blockIdx.z
        float* zs = red + (KS - 1) * RB * MM_TG;
        if (ks == 0) each([&](int row, int t, float v) { zs[(row - r0) * MM_TG + t - t0] = v; });
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();  // every block's sums are in its shared memory
        if (blockIdx.z == 0 && ks == 0)
            each([&](int row, int t, float) {
                float v = 0.f;
                for (int z = 0; z < KZ; z++) v += cluster.map_shared_rank(zs, z)[(row - r0) * MM_TG + t - t0];
                float* dst = y + (long)t * ldy + row;
                *dst = add ? *dst + v : v;
            });
        cluster.sync();  // no block leaves while rank 0 may still read its sums
        return;
    }
    if (ks == 0)
        each([&](int row, int t, float v) {
            float* dst = y + (long)t * ldy + row;
            *dst = add ? *dst + v : v;
        });
}

#define DENSE_MMA(W, KS)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 4) dense_seqs_w##W##_k##KS(                                  \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols, int gshift,       \
        const __nv_bfloat16* x, int n, float* y, int ldy, int add) {                                             \
        KTRACE(46);                                                                                              \
        dense_mma<W, KS>(w, s, b, rows, cols, gshift, x, n, y, ldy, add);                                        \
    }
DENSE_MMA(1, 1)
DENSE_MMA(2, 1)
DENSE_MMA(1, 4)
DENSE_MMA(2, 4)

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
    const int r0 = blockIdx.x * RS_R + 2 * warp;
    // the warp's two weight rows, all of them (cols <= 2048: U chunks a lane), and their scales are loaded before
    // the dependency wait (they are weights): their latency overlaps the post-norm instead of following it
    constexpr int U = 2048 / CPV / 32;
    uint4 wv[U][2];
    float sc[U][2], bs[U][2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int row = min(r0 + q, rows - 1);  // a valid address; a row past the end is never stored
        const uint4* wr = reinterpret_cast<const uint4*>(w) + (long)row * nvec;
#pragma unroll
        for (int a = 0; a < U; a++) {
            const int u = min(lane + 32 * a, nvec - 1), g = u >> gshift;  // a chunk past nvec is never used
            wv[a][q] = __ldg(wr + u);
            sc[a][q] = bf(s[(long)row * ng + g]);
            bs[a][q] = bf(b[(long)row * ng + g]);
        }
    }
    pdl_wait();  // xn comes from the post-norm
    stage_rows<RS_TG, CPV>(xn, cols, nullptr, t0, nt, cols, true, xs, xstride, cs);
    __syncthreads();
    float tot[RS_TG][2];
#pragma unroll
    for (int t = 0; t < RS_TG; t++) tot[t][0] = tot[t][1] = 0.f;
#pragma unroll
    for (int a = 0; a < U; a++) {
        const int u = lane + 32 * a;
        if (u >= nvec) break;
#pragma unroll
        for (int t = 0; t < RS_TG; t++)
            if (t < nt) chunk_dot<BITS, 2>(wv[a], xs + t * xstride + padx(u * CPV), sc[a], bs[a], cs[t * nvec + u], tot[t]);
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

// ---- topk_align_seqs: a decode batch's top-k and expert-sorted pairs in one launch ----
// For n <= TA_ROWS rows of router logits [n, E + 1] (the shared-expert gate last): topk_rows' top-k (topk_warp, warp w
// for row w: idx, wts [n, k + 1]) and moe_align's outputs for tiles of bn <= 8 pairs (rowmap, pos, ntile, tiles,
// trows), the same bits except the order of one expert's pairs within its run of rowmap (row order here, any order
// from moe_align's atomics). One block of 32 n threads; the n (k + 1) pairs are sorted in shared memory: pair i's
// position is the number of pairs of lower experts plus its own expert's earlier pairs (E, the shared expert, last),
// and a tile starts at every bn-th pair of an expert. Two launches and moe_align's 1,024-thread phases (its rowmap
// written to and read back from global memory) become one: at B = 32 the two took 3.1 + 3.4 us a layer, with a
// launch boundary between them (tern bench --trace). Up to 8 rows (one warp of top-k each on one multiprocessor): with
// 16 the step at B = 16 was 1.4% slower than with the two launches. Requirements (host): k <= 8, E <= 256, bn <= 8,
// n <= TA_ROWS.
#define TA_ROWS 8
extern "C" __global__ void __launch_bounds__(32 * TA_ROWS) topk_align_seqs(
    const float* __restrict__ logits, int E, int k, int n, int bn, int* __restrict__ idx, float* __restrict__ wts,
    int* __restrict__ rowmap, int* __restrict__ pos, int* __restrict__ ntile, int* __restrict__ tiles,
    uint4* __restrict__ trows) {
    KTRACE(47);
    __shared__ int sid[TA_ROWS * 9], srow[TA_ROWS * 9], sstart[TA_ROWS * 9];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kp = k + 1, P = n * kp;
    pdl_wait();  // the logits come from the router
    if (warp < n) {
        const unsigned long long ids = topk_warp(logits + (long)warp * (E + 1), E, k, idx + warp * kp, wts + warp * kp);
        if (lane < k) sid[warp * kp + lane] = (int)((ids >> (8 * lane)) & 0xff);
        if (lane == k) sid[warp * kp + k] = E;
    }
    __syncthreads();
    int e = 0, p = 0, cnt = 0, r = 0;
    if (tid < P) {
        e = sid[tid];
        int before = 0;
#pragma unroll 8
        for (int j = 0; j < P; j++) {  // unrolled: 8 shared loads in flight, not one a trip
            const int ej = sid[j];
            before += ej < e;
            cnt += ej == e;
            r += ej == e && j < tid;
        }
        p = before + r;
        pos[tid] = p;
        rowmap[p] = tid / kp;
        srow[p] = tid / kp;
        sstart[p] = r % bn == 0;
    }
    __syncthreads();
    if (tid < P && r % bn == 0) {
        int ti = 0;
#pragma unroll 8
        for (int q = 0; q < p; q++) ti += sstart[q];
        const int m = min(bn, cnt - r);
        tiles[3 * ti] = e;
        tiles[3 * ti + 1] = p;
        tiles[3 * ti + 2] = m;
        unsigned wq[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < m) wq[i >> 1] |= ((unsigned)srow[p + i] & 0xffffu) << (16 * (i & 1));
        trows[ti] = make_uint4(wq[0], wq[1], wq[2], wq[3]);
    }
    if (tid == 0) {
        int t = 0;
#pragma unroll 8
        for (int q = 0; q < P; q++) t += sstart[q];
        *ntile = t;
    }
}
