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
// logits, then sets the 64-bit ready flag at counter[MOE_FLAG] (moe_gate_up waits on it; moe_down clears it).
// rows = E + 1 (router rows, then the shared-expert gate); cols <= 2048.
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
        const unsigned long long ids = topk_warp(y, rows - 1, k, idx, wts);
        __syncwarp();  // the warp's idx/wts writes come before lane 0's release of the flag
        if (threadIdx.x == 0) {
            counter[0] = 0;
            // idx/wts are out: moe_gate_up's routed items may start (the flag carries the ids)
            set_flag64(reinterpret_cast<unsigned long long*>(counter + MOE_FLAG), ids);
        }
    }
}
