// Quantised GEMV, batch 1 (decode): y = W xn for an MLX affine 4-bit or 8-bit matrix W [rows, cols] (group gs,
// a power of two, bf16 scales/biases), x f32 [cols], y f32 [rows]. xn is staged once per block in shared memory
// (padded 4 floats every 32, with per-16-byte-chunk sums for the bias term) by a fused prologue (stage_x in
// common.cuh: one round of float4 loads, register/shuffle reductions, one barrier; the norm's gain is loaded
// before the dependency wait), 256 threads:
//   * plain copy of x;
//   * RMSNorm: x * rsqrt(mean(x^2) + eps) * gain  (gain already holds the +1 of the (1+w) norms).
// Epilogue: y = acc, or y += acc (residual add, each row owned by one warp). Decode of the codes: denormal trick,
// common.cuh (one LOP3 + one FFMA per weight).
// gemv_tma_*   : the decode step's GEMVs (every projection and lm_head), weights streamed through shared memory by
//                bulk copies issued before the dependency wait (see below).
// router_topk_q8: the router GEMV (streamed the same way) with the top-k fused into the last block.
// Bytes per call: rows*cols*BITS/8 + rows*(cols/gs)*4 (+ 4*cols per block for x, from L2).
// FLOPs per call: 2*rows*cols (+ 4 per 16-byte chunk for the affine correction).
#include <cuda_fp16.h>
#include "common.cuh"

// Streamed GEMV (gemv_tma_*): the same y = W xn with the same prologue and epilogue options, but the weights
// reach shared memory through bulk copies (TMA, cp.async.bulk) issued BEFORE the dependency wait, so that a
// matrix's bytes stream in while the previous kernel is still running. One block of 8 warps per SM at most
// (grid <= #SMs, shared memory <= ~120 KB so the next kernel's block can sit beside it and do the same).
// Rows are cut into stages of SR = 8*R rows (warp w owns rows w*R..w*R+R-1 of a stage); the matrix's stages
// are split evenly over the blocks (contiguous ranges); a block keeps S stages in a ring: stage i goes to slot
// i % S, completion on mbarrier full[slot] (phase parity (i / S) & 1); after every warp has used a slot
// (__syncthreads), thread 0 refills it with stage i + S. Stage slot layout: SR rows of packed codes | SR*ng
// bf16 scales (rounded up to 16 bytes) | SR*ng bf16 biases (same). Requirements: cols*BITS/8 % 16 == 0, the
// scale/bias buffers readable 16 bytes past their end (model.rs pads them), S <= GT_MAXS.
// Bytes per call: rows*cols*BITS/8 + 4*rows*cols/gs (+ 4*cols per block for x, from L2).
// FLOPs per call: 2*rows*cols.
#define GT_MAXS 6

template <int BITS, int R, int NV, int MODE>
__device__ void gemv_tma_body(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                              const __nv_bfloat16* __restrict__ b, int rows, int cols, int gshift,
                              const float* __restrict__ x, const float* __restrict__ gain, float eps,
                              float* __restrict__ y, int accumulate, int S) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[GT_MAXS];
    __shared__ float red[32];
    constexpr int CPV = 128 / BITS;
    constexpr int SR = 8 * R;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nvec = cols / CPV;
    const int ng = cols >> (gshift + (BITS == 4 ? 5 : 4));
    const int rowb = nvec * 16;
    const int sbb_full = (SR * ng * 2 + 15) & ~15;
    const int stage_bytes = SR * rowb + 2 * sbb_full;
    float* xs = reinterpret_cast<float*>(smem);
    float* cs = xs + padx_len(cols);
    unsigned char* ring = smem + (((padx_len(cols) + nvec) * 4 + 127) & ~127);
    // 32-bit arithmetic throughout (64-bit divisions expand to long SASS sequences: code size matters here)
    const int nst = (rows + SR - 1) / SR;
    const int st0 = (int)((unsigned)nst * blockIdx.x / gridDim.x);
    const int my = (int)((unsigned)nst * (blockIdx.x + 1) / gridDim.x) - st0;
    auto issue = [&](int i, int slot) {  // thread 0: stage st0 + i into `slot`
        unsigned char* d = ring + slot * stage_bytes;
        const int r0 = (st0 + i) * SR;
        const int nr = min(SR, rows - r0);
        const uint32_t wb = (uint32_t)nr * rowb, sbb = (uint32_t)((nr * ng * 2 + 15) & ~15);
        mbar_expect_tx(&full[slot], wb + 2 * sbb);
        bulk_g2s(d, reinterpret_cast<const unsigned char*>(w) + (size_t)r0 * rowb, wb, &full[slot]);
        bulk_g2s(d + SR * rowb, s + (size_t)r0 * ng, sbb, &full[slot]);
        bulk_g2s(d + SR * rowb + sbb_full, b + (size_t)r0 * ng, sbb, &full[slot]);
    };
    if (tid == 0) {
#pragma unroll 1
        for (int i = 0; i < S; i++) mbar_init(&full[i], 1);
        mbar_fence_init();
#pragma unroll 1
        for (int i = 0; i < min(S, my); i++) issue(i, i);  // weights are constants: safe before the wait
    }
    const GainRegs<NV> gr = load_gain<NV, MODE>(gain, cols);
    __syncthreads();
    pdl_wait();
    stage_x<NV, MODE>(x, gr, eps, cols, CPV, xs, cs, red);
    trace_mark(0);
    int slot = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (int i = 0; i < my; i++) {
        mbar_wait(&full[slot], phase);
        if (i == 0) trace_mark(1);
        const unsigned char* d = ring + slot * stage_bytes;
        const uint4* ws = reinterpret_cast<const uint4*>(d) + warp * R * nvec;
        const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(d + SR * rowb) + warp * R * ng;
        const __nv_bfloat16* bb = reinterpret_cast<const __nv_bfloat16*>(d + SR * rowb + sbb_full) + warp * R * ng;
        float tot[R];
#pragma unroll
        for (int r = 0; r < R; r++) tot[r] = 0.f;
#pragma unroll 1
        for (int u = lane; u < nvec; u += 32) {
            const int g = u >> gshift;
            uint4 wv[R];
            float sc[R], bs[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                wv[r] = ws[r * nvec + u];
                sc[r] = bf(ss[r * ng + g]);
                bs[r] = bf(bb[r * ng + g]);
            }
            chunk_dot<BITS, R>(wv, xs + padx(u * CPV), sc, bs, cs[u], tot);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float acc = warp_sum(tot[r]);
            const int row = (st0 + i) * SR + warp * R + r;
            if (lane == r && row < rows) y[row] = accumulate ? y[row] + acc : acc;
        }
        if (i + S < my) {
            __syncthreads();  // every warp is done reading this slot
            if (tid == 0) {
                fence_proxy_async();
                issue(i + S, slot);
            }
        }
        if (++slot == S) {
            slot = 0;
            phase ^= 1u;
        }
    }
}

// gemv_tma_q{BITS}_r{R}_m{MODE}_n{NV}: MODE = prologue (0 plain, 1 RMSNorm), NV = cols / 1024 rounded up to 2
// or 4 (cols <= 4096).
#define GEMV_TMA_KERNEL(BITS, R, MODE, NV)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2) gemv_tma_q##BITS##_r##R##_m##MODE##_n##NV(             \
        const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols, int gshift,         \
        const float* x, const float* gain, float eps, float* y, int accumulate, int S) {                           \
        KTRACE(12);                                                                                                \
        gemv_tma_body<BITS, R, NV, MODE>(w, s, b, rows, cols, gshift, x, gain, eps, y, accumulate, S);            \
    }
#define GEMV_TMA_MODES(BITS, R, NV) \
    GEMV_TMA_KERNEL(BITS, R, 0, NV) \
    GEMV_TMA_KERNEL(BITS, R, 1, NV)
GEMV_TMA_MODES(4, 4, 2)
GEMV_TMA_MODES(4, 4, 4)
GEMV_TMA_MODES(4, 1, 2)
GEMV_TMA_MODES(4, 1, 4)
GEMV_TMA_MODES(8, 4, 2)
GEMV_TMA_MODES(8, 4, 4)
GEMV_TMA_MODES(8, 1, 2)
GEMV_TMA_MODES(8, 1, 4)

// Router GEMV (8-bit, streamed as above, RMSNorm prologue) with the top-k fused as a tail: the last block to finish
// (device-wide counter[0], reset by that block, so the kernel can be replayed in a graph) runs topk_warp over the E+1
// logits, then sets the 64-bit ready flag at counter[MOE_FLAG] (moe_gate_up waits on it; moe_down clears it). rows = E + 1
// (router rows, then the shared-expert gate); cols <= 2048.
extern "C" __global__ void __launch_bounds__(256, 2) router_topk_q8(
    const uint32_t* w, const __nv_bfloat16* s, const __nv_bfloat16* b, int rows, int cols, int gshift,
    const float* x, const float* gain, float eps, float* y, int S, int k, unsigned int* counter, int* idx,
    float* wts) {
    KTRACE(11);
    gemv_tma_body<8, 1, 2, XM_RMS>(w, s, b, rows, cols, gshift, x, gain, eps, y, 0, S);
    __shared__ bool last;
    __syncthreads();  // the block's logits are written; thread 0's acq_rel atomic releases them (cumulative over
                      // the barrier) and, in the last block, acquires every other block's
    if (threadIdx.x == 0) last = atom_add_acq_rel(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x < 32) {
        // idx/wts are read by moe_down only after this kernel has completed; moe_gate_up needs only the flag word
        const unsigned long long ids = topk_warp(y, rows - 1, k, idx, wts);
        if (threadIdx.x == 0) {
            counter[0] = 0;
            // idx/wts are out: moe_gate_up's routed items may start (the flag carries the ids)
            set_flag64(reinterpret_cast<unsigned long long*>(counter + MOE_FLAG), ids);
        }
    }
}

// ---- Tensor-core GEMV (gemv_mma_q4_*): the streamed GEMV's job for 4-bit matrices, with the dot products on the
// tensor cores (mma.sync m16n8k16, f16 inputs, f32 accumulation). The ALU work per weight drops from an AND + FFMA
// to ~0.6 LOP3 (the decode) + 1/8 of an MMA.
// Layout (tile16_repack, misc.cu, done once at load): rows in tiles of 16 (the MMA's M); per tile and 64-column
// block q, 512 bytes: lane (g = lane/4, t = lane%4) of a warp owns 16 of them, words 2t, 2t+1 of the block in rows
// g and g+8 (one conflict-free 16-byte shared-memory load); then per tile the (scale, bias) bf16 pairs,
// [group][row 0..15]. One tile = one stage = two bulk copies; a ring of S stages per block, the first S issued
// before the dependency wait. Shapes: cols % 64 == 0 (cols <= 1024 * NV), group size gs = 64 << gsh.
// x is staged in f16 in MMA-fragment order, per 64-column block q with its own power-of-two scale sigma_q (the
// block's largest |x| lands in [2^13, 2^14): no overflow, full f16 precision); for lane (g, t) and word m of the
// block (columns c = 64q + 16t + 8m ..+7) the codes decode (LOP3 with 0x6400 = 1024.0) into halves (1024+n0,
// 1024+n4), (1024+16n1, 1024+16n5), (1024+n2, 1024+n6), (1024+16n3, 1024+16n7); the B fragments hold the matching
// x*sigma values, /16 where the code sits 4 bits up (all 8 B columns equal: every lane ends with its rows' dots).
// So tile row r gives D_r = sigma_q sum_k n_k x_k + Z_q, Z_q = 1024 * (sum of the staged halves), and
// y_r += scale_rq * (D_r - Z_q) / sigma_q + bias_rq * sum_k x_k (f32).
// The 16 warps split the 64-column blocks of a tile; their 16 partial row sums meet in shared memory (one barrier
// per stage). Error: x rounded to f16 (2^-11 relative), accumulation in f32.
// Bytes per call: rows*cols/2 + 4*rows*cols/gs. FLOPs: 2*rows*cols (16x on the tensor cores: 8 columns of B).
#define MM_MAXS 10
#define MM_WARPS 16  // 512 threads: twice the warps of the other GEMVs, to hide the MMA and load latencies
// (at most 72 registers each: the next kernel's blocks, e.g. the router's, fit beside one of these)

__device__ __forceinline__ uint32_t lop3_or_and(uint32_t a, uint32_t mask, uint32_t c) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(c));  // (a & mask) | c
    return r;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
    asm(  // not volatile: a pure function of its operands, so independent chains may interleave
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two MMAs for one word of row g (wa) and of row g+8 (wb) against that word's 4 B registers.
__device__ __forceinline__ void mma_word(float (&c)[4], uint32_t wa, uint32_t wb, uint4 bx) {
    constexpr uint32_t LO = 0x000F000Fu, HI = 0x00F000F0u, MAGIC = 0x64006400u;
    const uint32_t wa8 = wa >> 8, wb8 = wb >> 8;
    mma_f16(c, lop3_or_and(wa, LO, MAGIC), lop3_or_and(wb, LO, MAGIC), lop3_or_and(wa, HI, MAGIC),
            lop3_or_and(wb, HI, MAGIC), bx.x, bx.y);
    mma_f16(c, lop3_or_and(wa8, LO, MAGIC), lop3_or_and(wb8, LO, MAGIC), lop3_or_and(wa8, HI, MAGIC),
            lop3_or_and(wb8, HI, MAGIC), bx.z, bx.w);
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Stage x for the MMA GEMV (cols <= 8 * blockDim.x): thread u owns columns 8u..8u+7. xb: 16 bytes per unit in
// fragment order; gc[q] = {Z_q, sum x over block q, 1/sigma_q, 0}. The gain (MODE 1, two float4 per thread) is
// loaded before the wait.
struct GainMma {
    float4 a, b;
};
template <int MODE>
__device__ __forceinline__ GainMma load_gain_mma(const float* __restrict__ gain, int cols) {
    GainMma r{make_float4(1.f, 1.f, 1.f, 1.f), make_float4(1.f, 1.f, 1.f, 1.f)};
    const int u = threadIdx.x;
    if (MODE == XM_RMS && u < (cols >> 3)) {
        r.a = reinterpret_cast<const float4*>(gain)[2 * u];
        r.b = reinterpret_cast<const float4*>(gain)[2 * u + 1];
    }
    return r;
}

template <int MODE>
__device__ __forceinline__ void stage_x_mma(const float* __restrict__ x, const GainMma& gr, float eps, int cols,
                                            uint4* xb, float4* gc, float* red) {
    const int u = threadIdx.x, n8 = cols >> 3;
    const bool in = u < n8;
    float4 a = in ? __ldcg(reinterpret_cast<const float4*>(x) + 2 * u) : make_float4(0.f, 0.f, 0.f, 0.f);
    float4 b = in ? __ldcg(reinterpret_cast<const float4*>(x) + 2 * u + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
    if (MODE == XM_RMS) {
        const float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        const float r = rsqrtf(block_sum(ss, red) / cols + eps);
        a = make_float4(a.x * r * gr.a.x, a.y * r * gr.a.y, a.z * r * gr.a.z, a.w * r * gr.a.w);
        b = make_float4(b.x * r * gr.b.x, b.y * r * gr.b.y, b.z * r * gr.b.z, b.w * r * gr.b.w);
    }
    float amax = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                       fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
    float xsum = (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
        xsum += __shfl_xor_sync(FULL_MASK, xsum, o);
    }
    const int e = (int)((__float_as_uint(amax) >> 23) & 0xff) - 126;  // amax < 2^e
    const int sh = 14 - max(e, -100);                                  // x * 2^sh < 2^14
    const float sg = __uint_as_float((uint32_t)(sh + 127) << 23);
    const float sg16 = __uint_as_float((uint32_t)(sh + 123) << 23);
    uint4 h;
    h.x = pack_h2(a.x * sg, b.x * sg);      // columns 0, 4
    h.y = pack_h2(a.y * sg16, b.y * sg16);  // columns 1, 5 (codes 4 bits up: x / 16)
    h.z = pack_h2(a.z * sg, b.z * sg);      // columns 2, 6
    h.w = pack_h2(a.w * sg16, b.w * sg16);  // columns 3, 7
    float z = 0.f;
    {
        const __half2* hp = reinterpret_cast<const __half2*>(&h);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 f = __half22float2(hp[i]);
            z += f.x + f.y;
        }
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) z += __shfl_xor_sync(FULL_MASK, z, o);
    if (in) {
        const int q = u >> 3, t = (u >> 1) & 3, m = u & 1;
        xb[(q * 4 + t) * 2 + m] = h;
        if ((u & 7) == 0) gc[q] = make_float4(1024.f * z, xsum, __uint_as_float((uint32_t)(127 - sh) << 23), 0.f);
    }
    __syncthreads();
}

template <int NV, int MODE>
__device__ void gemv_mma_body(const uint32_t* __restrict__ tw, const uint32_t* __restrict__ tsb, int rows, int cols,
                              int gsh, const float* __restrict__ x, const float* __restrict__ gain, float eps,
                              float* __restrict__ y, int accumulate, int S) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[MM_MAXS];
    __shared__ float red[2][MM_WARPS][16];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nq = cols >> 6, ngs = cols >> (gsh + 6);
    const uint32_t wbytes = 8u * cols, sbytes = 64u * ngs;  // one tile: 16 rows x cols/2 bytes; 16 x ngs pairs
    const int stage_bytes = wbytes + sbytes;
    uint4* xb = reinterpret_cast<uint4*>(smem);
    float4* gc = reinterpret_cast<float4*>(smem + cols * 2);
    unsigned char* ring = smem + ((cols * 2 + nq * 16 + 127) & ~127);
    const int nst = (rows + 15) >> 4;
    const int st0 = (int)((unsigned)nst * blockIdx.x / gridDim.x);
    const int my = (int)((unsigned)nst * (blockIdx.x + 1) / gridDim.x) - st0;
    auto issue = [&](int i, int slot) {  // thread 0: tile st0 + i into `slot`
        unsigned char* d = ring + slot * stage_bytes;
        const size_t tile = st0 + i;
        mbar_expect_tx(&full[slot], wbytes + sbytes);
        bulk_g2s(d, reinterpret_cast<const unsigned char*>(tw) + tile * wbytes, wbytes, &full[slot]);
        bulk_g2s(d + wbytes, reinterpret_cast<const unsigned char*>(tsb) + tile * sbytes, sbytes, &full[slot]);
    };
    if (tid == 0) {
#pragma unroll 1
        for (int i = 0; i < S; i++) mbar_init(&full[i], 1);
        mbar_fence_init();
#pragma unroll 1
        for (int i = 0; i < min(S, my); i++) issue(i, i);  // weights are constants: safe before the wait
    }
    const GainMma gr = load_gain_mma<MODE>(gain, cols);
    __syncthreads();
    pdl_wait();
    stage_x_mma<MODE>(x, gr, eps, cols, xb, gc, &red[0][0][0]);
    trace_mark(0);
    // warp w owns the 64-column blocks q = w + 16 j (j < NV: cols <= 1024 NV) of every tile; blocks past nq are
    // clamped to a valid one and dropped
    int qs[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) qs[j] = min(warp + MM_WARPS * j, nq - 1);
    int slot = 0;
    uint32_t phase = 0;
#pragma unroll 1
    for (int i = 0; i < my; i++) {
        mbar_wait(&full[slot], phase);
        if (i == 0) trace_mark(1);
        const unsigned char* d = ring + slot * stage_bytes;
        const uint4* wq = reinterpret_cast<const uint4*>(d) + lane;
        const uint32_t* sb = reinterpret_cast<const uint32_t*>(d + wbytes) + g;
        // all operands first, then the NV independent MMA chains interleaved
        uint4 wv[NV], b0[NV], b1[NV];
        float4 k[NV];
        uint32_t pa[NV], pb[NV];
#pragma unroll
        for (int j = 0; j < NV; j++) {
            b0[j] = xb[(qs[j] * 4 + t) * 2];
            b1[j] = xb[(qs[j] * 4 + t) * 2 + 1];
            k[j] = gc[qs[j]];
            wv[j] = wq[qs[j] * 32];  // words 2t, 2t+1 of rows g, g+8
            pa[j] = sb[(qs[j] >> gsh) * 16];  // (scale, bias) of row g
            pb[j] = sb[(qs[j] >> gsh) * 16 + 8];  // of row g + 8
        }
        float c[NV][4];
#pragma unroll
        for (int j = 0; j < NV; j++) {
            c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
            mma_word(c[j], wv[j].x, wv[j].z, b0[j]);
        }
#pragma unroll
        for (int j = 0; j < NV; j++) mma_word(c[j], wv[j].y, wv[j].w, b1[j]);
        float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            if (warp + MM_WARPS * j < nq) {
                acc0 = fmaf(__uint_as_float(pa[j] << 16) * k[j].z, c[j][0] - k[j].x,
                            fmaf(__uint_as_float(pa[j] & 0xffff0000u), k[j].y, acc0));
                acc1 = fmaf(__uint_as_float(pb[j] << 16) * k[j].z, c[j][2] - k[j].x,
                            fmaf(__uint_as_float(pb[j] & 0xffff0000u), k[j].y, acc1));
            }
        }
        const int par = i & 1;
        if (t == 0) {
            red[par][warp][g] = acc0;
            red[par][warp][g + 8] = acc1;
        }
        __syncthreads();  // partials complete; every warp is done reading this slot
        if (i + S < my && tid == 0) {
            fence_proxy_async();
            issue(i + S, slot);
        }
        if (tid < 16) {
            const int row = (st0 + i) * 16 + tid;
            float a = 0.f;
#pragma unroll
            for (int v = 0; v < MM_WARPS; v++) a += red[par][v][tid];
            if (row < rows) y[row] = accumulate ? y[row] + a : a;
        }
        if (++slot == S) {
            slot = 0;
            phase ^= 1u;
        }
    }
}

#define GEMV_MMA_KERNEL(MODE, NV)                                                                                  \
    extern "C" __global__ void __maxnreg__(72) gemv_mma_q4_m##MODE##_n##NV(                                        \
        const uint32_t* tw, const uint32_t* tsb, int rows, int cols, int gsh, const float* x, const float* gain,    \
        float eps, float* y, int accumulate, int S) {                                                              \
        KTRACE(13);                                                                                                \
        gemv_mma_body<NV, MODE>(tw, tsb, rows, cols, gsh, x, gain, eps, y, accumulate, S);                         \
    }
GEMV_MMA_KERNEL(0, 2)
GEMV_MMA_KERNEL(1, 2)
GEMV_MMA_KERNEL(0, 4)
GEMV_MMA_KERNEL(1, 4)
