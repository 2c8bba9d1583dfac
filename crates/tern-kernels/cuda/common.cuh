// Shared device helpers for tern's kernels (included by every .cu; not compiled on its own).
// MLX affine quantisation: w = scale[g] * q + bias[g], q packed lowest bits first in u32 words, groups of `gs`
// columns of one row, bf16 scales/biases [rows, cols/gs].
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

// Programmatic dependent launch: every kernel is launched with programmatic stream serialization (gpu.rs), so
// its blocks may start while the previous kernel is still running. pdl_wait() returns once the previous kernel
// has completed (hence all earlier ones), then lets the next kernel launch; so when kernel K starts, K - 2 is
// complete. The one rule (stated here and in gpu.rs `KLaunch`): code before pdl_wait() may read only constants
// (weights, tables the host uploaded before the launch) and what kernels two or more launches back wrote, never
// what the kernel just before (K - 1) writes, and may write nothing K - 1 could still read. Without the launch
// attribute both instructions are no-ops.
// Step trace (`tern bench --trace`; off unless the host sets g_trace_on): every traced kernel's blocks append
// {entry time, time pdl_wait returned, exit time} (%globaltimer, ns) to this module's g_trace.
struct TraceRec {
    unsigned long long pre, wait, m1, m2, end;
    unsigned int code, nblocks, sm, block;  // block: blockIdx.x | blockIdx.y << 16 (z not kept)
};
#ifndef TRACE_CAP  // records per module (moe_seqs.cu holds more: a batched step's expert and dense blocks)
#define TRACE_CAP 32768
#endif
__device__ TraceRec g_trace[TRACE_CAP];
__device__ unsigned int g_trace_n;
__device__ int g_trace_on;
__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned long long& trace_wait_time() {
    __shared__ unsigned long long t;
    return t;
}
// Optional intermediate marks (thread 0's time at two points of the kernel; 0 when not marked).
__device__ __forceinline__ unsigned long long* trace_marks() {
    __shared__ unsigned long long t[2];
    return t;
}
__device__ __forceinline__ void trace_mark(int i) {
    if (threadIdx.x == 0 && *(volatile int*)&g_trace_on) trace_marks()[i] = gtime();
}
__device__ __forceinline__ unsigned int smid() {
    unsigned int r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}
struct KTrace {
    unsigned long long pre;
    unsigned int code;
    bool on;
    __device__ explicit KTrace(unsigned int c) : pre(0), code(c), on(*(volatile int*)&g_trace_on != 0) {
        if (on) {
            pre = gtime();
            if (threadIdx.x == 0) {  // 0: not marked, not waited (a block may leave before its wait)
                trace_marks()[0] = trace_marks()[1] = 0;
                trace_wait_time() = 0;
            }
        }
    }
    __device__ ~KTrace() {
        if (!on) return;
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned long long end = gtime();
            const unsigned int i = atomicAdd(&g_trace_n, 1u);
            if (i < TRACE_CAP) {
                TraceRec r;
                r.pre = pre;
                r.wait = trace_wait_time();
                r.m1 = trace_marks()[0];
                r.m2 = trace_marks()[1];
                r.end = end;
                r.code = code;
                r.nblocks = gridDim.x * gridDim.y * gridDim.z;
                r.sm = smid();
                r.block = blockIdx.x | blockIdx.y << 16;
                g_trace[i] = r;
            }
        }
    }
};
#ifdef TERN_NO_KTRACE
#define KTRACE(code)
#else
#define KTRACE(code) KTrace ktrace_(code)
#endif

__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0 && *(volatile int*)&g_trace_on) trace_wait_time() = gtime();
}

// The two halves of pdl_wait for kernels that let their dependents launch before they wait themselves.
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait_only() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// A prefill pass over several sequences (segments): its rows are the sequences' new tokens, sequence after
// sequence; segs[4 s .. 4 s + 3] = {first row, rows, first position, first chunk} of sequence s, its rows cut in
// chunks of 64 (the GDN chunks and flash query tiles) numbered on across the pass. The host writes the table
// before the pass (prefill.rs, Gpu::segs), so it may be read before pdl_wait. A pass of one sequence is
// {0, N, pos0, 0}.
struct Seg {
    int r0, k, pos0, c0;
};
__device__ __forceinline__ Seg seg_at(const int* segs, int s) {
    return Seg{segs[4 * s], segs[4 * s + 1], segs[4 * s + 2], segs[4 * s + 3]};
}
// The sequence whose rows (col 0) or chunks (col 3) hold index v: the last one starting at or before it.
__device__ __forceinline__ int seg_find(const int* segs, int nseg, int v, int col) {
    int s = 0;
    while (s + 1 < nseg && segs[4 * (s + 1) + col] <= v) s++;
    return s;
}

// Block-wide wait for a nonzero 64-bit flag another kernel sets (st.release after its data) and returns it: thread
// 0 polls with ld.acquire at gpu scope, the block barrier passes the ordering (and the value) on. A flag that is
// never set traps after 2 s instead of hanging the device. The trace records the moment as the kernel's wait.
__device__ __forceinline__ unsigned long long ld_acquire64(const unsigned long long* f) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(f) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long wait_flag64(const unsigned long long* f) {
    __shared__ unsigned long long seen;
    if (threadIdx.x == 0) {
        const unsigned long long t0 = gtime();
        unsigned long long v;
        for (;;) {
            v = ld_acquire64(f);
            if (v) break;
            if (gtime() - t0 > 2000000000ull) __trap();
        }
        seen = v;
        if (*(volatile int*)&g_trace_on) trace_wait_time() = gtime();
    }
    __syncthreads();
    return seen;
}

// atomicAdd with acquire-release semantics at gpu scope (replaces __threadfence + atomicAdd + __threadfence:
// the full fences are sequentially consistent and cost more).
__device__ __forceinline__ unsigned int atom_add_acq_rel(unsigned int* p, unsigned int v) {
    unsigned int old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ void set_flag64(unsigned long long* f, unsigned long long v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(f), "l"(v) : "memory");
}

// Index (in u32) of the router's ready flag in the MoE sync buffer: a 64-bit word on its own 128-byte line, away
// from the router's block counter at index 0, which the last blocks hit with atomics while moe_gate_up's blocks
// poll the flag. It carries the k <= 8 routed expert ids, one byte each (byte 7 = 0xff when k < 8, so the word is
// never zero once set).
#define MOE_FLAG 32

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
// An f32 result as the element type of an activation buffer (f32 for the decode GEMVs, bf16 for the GEMMs).
template <typename T>
__device__ __forceinline__ T to_act(float v);
template <>
__device__ __forceinline__ float to_act<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 to_act<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
// Fast exponentials (ex2.approx, ~2 ulp + |x| 2^-21 relative): the full-precision expf is ~10x the code, and code
// size matters here (instruction-cache misses were the largest stall of the decode kernels).
__device__ __forceinline__ float silu_f(float x) { return __fdividef(x, 1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : __logf(1.f + __expf(x)); }

// Index of column c in a shared-memory vector padded by 4 floats every 32: lanes reading 16-byte vectors at a
// stride of 32 (4-bit chunks) or 16 (8-bit chunks) floats hit distinct banks.
__device__ __forceinline__ int padx(int c) { return c + ((c >> 5) << 2); }
__host__ __device__ __forceinline__ int padx_len(int n) { return n + ((n >> 5) << 2) + 4; }

// Streamed weights: read-only path, no L1 allocation (each byte is used once per step).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// Denormal decode (DN): a masked field read as a float with exponent 0 is exactly field * 2^-149 (no implicit
// one, so no magic offset to subtract): one LOP3 (AND) + one FFMA per weight. x is staged pre-scaled by
// DN_XSCALE = 2^90 so the products stay normal; the per-chunk result is rescaled by 2^(149-90) (exact). Needs
// denormals honoured (no -ftz / fast-math), which is nvcc's default.
#define DN_XSCALE 1.2379400392853803e27f    // 2^90
#define DN_UNSCALE 5.764607523034235e17f    // 2^59
template <uint32_t MASK>
__device__ __forceinline__ float cv(uint32_t w) {
    return __uint_as_float(w & MASK);
}

// Dot of one 16-byte chunk of packed codes of R rows with the matching x values (registers), affine-corrected:
// tot[r] += scale[r] * sum(q*x) + bias[r] * xsum. Codes are extracted in place by the denormal decode above
// (one AND per code, one shift per 32-bit word: the upper half-word is shifted down so that no field reaches the
// exponent); a field at bit offset 4j (8j) is 16^j (256^j) times the code, so fields accumulate in per-offset
// buckets rescaled exactly by a power of two at the end of the chunk. x must be staged times DN_XSCALE; xsum
// stays unscaled. 4-bit: 32 columns per chunk, 8-bit: 16.
template <int BITS, int R>
__device__ __forceinline__ void chunk_dot(const uint4 (&wv)[R], const float* __restrict__ xp, const float (&sc)[R],
                                          const float (&bs)[R], float xsum, float (&tot)[R]) {
    float acc[R][4];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (BITS == 4) {
            const float4 xa = *reinterpret_cast<const float4*>(xp + 8 * j);
            const float4 xb = *reinterpret_cast<const float4*>(xp + 8 * j + 4);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t w = j == 0 ? wv[r].x : j == 1 ? wv[r].y : j == 2 ? wv[r].z : wv[r].w;
                const uint32_t h = w >> 16;
                acc[r][0] = fmaf(cv<0xFu>(w), xa.x, acc[r][0]);
                acc[r][1] = fmaf(cv<0xF0u>(w), xa.y, acc[r][1]);
                acc[r][2] = fmaf(cv<0xF00u>(w), xa.z, acc[r][2]);
                acc[r][3] = fmaf(cv<0xF000u>(w), xa.w, acc[r][3]);
                acc[r][0] = fmaf(cv<0xFu>(h), xb.x, acc[r][0]);
                acc[r][1] = fmaf(cv<0xF0u>(h), xb.y, acc[r][1]);
                acc[r][2] = fmaf(cv<0xF00u>(h), xb.z, acc[r][2]);
                acc[r][3] = fmaf(cv<0xF000u>(h), xb.w, acc[r][3]);
            }
        } else {
            const float4 xa = *reinterpret_cast<const float4*>(xp + 4 * j);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const uint32_t w = j == 0 ? wv[r].x : j == 1 ? wv[r].y : j == 2 ? wv[r].z : wv[r].w;
                const uint32_t h = w >> 16;  // byte 2 would touch bit 23 (the exponent) in place
                acc[r][0] = fmaf(cv<0xFFu>(w), xa.x, acc[r][0]);
                acc[r][1] = fmaf(cv<0xFF00u>(w), xa.y, acc[r][1]);
                acc[r][2] = fmaf(cv<0xFFu>(h), xa.z, acc[r][2]);
                acc[r][3] = fmaf(cv<0xFF00u>(h), xa.w, acc[r][3]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float q = BITS == 4 ? acc[r][0] + acc[r][1] * 0.0625f + acc[r][2] * (1.f / 256.f) + acc[r][3] * (1.f / 4096.f)
                            : (acc[r][0] + acc[r][2]) + (acc[r][1] + acc[r][3]) * (1.f / 256.f);
        q *= DN_UNSCALE;
        tot[r] = fmaf(sc[r], q, fmaf(bs[r], xsum, tot[r]));
    }
}

// One warp: partial dots (per lane; caller reduces) of R quantised rows with padded smem x. Row r's 16-byte
// chunks start at wr[r], its bf16 scales/biases at sr[r]/br[r]; chunk u uses group u >> gshift. Lanes take
// chunks lane, lane+32, ...; U chunks per row are loaded (R*U independent 16-byte loads) before any is used.
// cs[u]: sum of x over chunk u.
template <int BITS, int R, int U>
__device__ __forceinline__ void warp_rows_dot(const uint4* const (&wr)[R], const __nv_bfloat16* const (&sr)[R],
                                              const __nv_bfloat16* const (&br)[R], int nvec, int gshift,
                                              const float* xs, const float* cs, int lane, float (&tot)[R]) {
    constexpr int CPV = 128 / BITS;
    for (int u0 = lane; u0 < nvec; u0 += 32 * U) {
        uint4 wv[U][R];
        float sc[U][R], bs[U][R];
#pragma unroll
        for (int a = 0; a < U; a++) {
            const int u = min(u0 + 32 * a, nvec - 1);  // clamped: a valid address, result discarded below
            const int g = u >> gshift;
#pragma unroll
            for (int r = 0; r < R; r++) {
                wv[a][r] = ldg_stream(wr[r] + u);
                sc[a][r] = bf(sr[r][g]);
                bs[a][r] = bf(br[r][g]);
            }
        }
#pragma unroll
        for (int a = 0; a < U; a++) {
            const int u = u0 + 32 * a;
            if (u < nvec) chunk_dot<BITS, R>(wv[a], xs + padx(u * CPV), sc[a], bs[a], cs[u], tot);
        }
    }
}

// Prologue modes of the GEMV-like kernels (a template parameter, so that each kernel carries only its own path:
// instruction-cache misses were the largest stall of the GEMVs while every kernel held all three).
#define XM_PLAIN 0  // xn = x
#define XM_RMS 1    // xn = RMSNorm(x) * gain

// The gain of a GEMV prologue's norm, loaded into registers BEFORE the dependency wait (it is a weight): per
// thread the NV float4s of columns 4*(tid + 256 j). Loading it after the wait put a DRAM round
// trip (slow while other kernels stream weights) on every kernel's critical path. (The gated per-head norm of the
// GDN output lives in gdn_step.)
template <int NV>
struct GainRegs {
    float4 g[NV];
};
template <int NV, int MODE>
__device__ __forceinline__ GainRegs<NV> load_gain(const float* __restrict__ gain, int cols) {
    GainRegs<NV> r;
    const int n4 = cols >> 2;
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int c4 = threadIdx.x + 256 * j;
        r.g[j] = make_float4(1.f, 1.f, 1.f, 1.f);
        if (MODE == XM_RMS && c4 < n4) r.g[j] = reinterpret_cast<const float4*>(gain)[c4];
    }
    return r;
}

// Prologue of the GEMV-like kernels (blockDim.x == 256, cols % 4 == 0, cols <= 1024 * NV): stages xn * DN_XSCALE
// (for the denormal decode) into padded smem `xs` and the sums of xn over chunks of `cpv`
// columns into `cs`, xn = x (XM_PLAIN) or RMSNorm(x) * gain (XM_RMS; `gr` holds the gain, loaded before the
// wait). Each thread loads its float4s of x up front (one round trip), the norm reduces in registers/shuffles,
// chunk sums by shuffles over the cpv/4 threads that own a chunk; ends with one barrier.
template <int NV, int MODE>
__device__ __forceinline__ void stage_x(const float* __restrict__ x, const GainRegs<NV>& gr, float eps, int cols,
                                        int cpv, float* xs, float* cs, float* red) {
    const int tid = threadIdx.x, n4 = cols >> 2;
    float4 v[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int c4 = tid + 256 * j;
        v[j] = c4 < n4 ? __ldcg(reinterpret_cast<const float4*>(x) + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (MODE == XM_RMS) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < NV; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        const float r = rsqrtf(block_sum(ss, red) / cols + eps);
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const float4 g = gr.g[j];
            v[j] = make_float4(v[j].x * r * g.x, v[j].y * r * g.y, v[j].z * r * g.z, v[j].w * r * g.w);
        }
    }
    const int tpc = cpv >> 2;  // threads per chunk
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int c4 = tid + 256 * j;
        float t = v[j].x + v[j].y + v[j].z + v[j].w;
        for (int o = tpc >> 1; o > 0; o >>= 1) t += __shfl_xor_sync(FULL_MASK, t, o);
        if (c4 < n4) {
            *reinterpret_cast<float4*>(xs + padx(4 * c4)) =
                make_float4(v[j].x * DN_XSCALE, v[j].y * DN_XSCALE, v[j].z * DN_XSCALE, v[j].w * DN_XSCALE);
            if ((c4 & (tpc - 1)) == 0) cs[c4 / tpc] = t;
        }
    }
    __syncthreads();
}

// Router tail, one warp: softmax over E logits, top-k (ties -> lower index), renormalise; slot k = shared expert
// (index E) with weight sigmoid(logits[E]). Returns (in every lane) the first min(k, 8) ids packed one byte each,
// byte 7 = 0xff when k < 8 (the MOE_FLAG word; needs E <= 256). Logits are read through L2 (__ldcg): they may have been written by
// other blocks of the same launch (fused router GEMV tail).
__device__ __forceinline__ unsigned long long topk_warp(const float* logits, int E, int k, int* __restrict__ idx,
                                                        float* __restrict__ wts) {
    // one warp; lane holds experts lane + 32*j (E <= 256); k rounds of warp argmax, no block barriers
    const int lane = threadIdx.x & 31;
    float p[8];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int e = lane + 32 * j;
        p[j] = e < E ? __ldcg(logits + e) : -INFINITY;
        m = fmaxf(m, p[j]);
    }
    m = warp_max(m);
#pragma unroll
    for (int j = 0; j < 8; j++) p[j] = lane + 32 * j < E ? expf(p[j] - m) : -1.f;
    float total = 0.f, mine = 0.f;
    int mine_i = 0;
    // each round: the warp's largest value (one redux.sync over order-preserving keys of the lanes' maxima: every
    // value here is >= 0, or -1 for no expert, -2 for taken), then the lowest index holding it (a second redux):
    // the selection and order of k argmax rounds with ties to the lower index, in 2 reductions a round where the
    // (value, index) butterfly took 10 dependent shuffles. NaN never wins (fmaxf and == skip it), as before.
    for (int sel = 0; sel < k; sel++) {
        float lm = p[0];
#pragma unroll
        for (int j = 1; j < 8; j++) lm = fmaxf(lm, p[j]);
        const unsigned lu = lm == lm ? __float_as_uint(lm) : 0xc0400000u;  // NaN as -3
        const unsigned key = (lu & 0x80000000u) ? ~lu : (lu | 0x80000000u);
        const unsigned mk = __reduce_max_sync(FULL_MASK, key);
        const float bv = __uint_as_float((mk & 0x80000000u) ? (mk & 0x7fffffffu) : ~mk);
        unsigned cand = 0xffffffffu;
#pragma unroll
        for (int j = 7; j >= 0; j--)
            if (p[j] == bv) cand = lane + 32 * j;  // this lane's lowest index holding it
        const int bi = (int)__reduce_min_sync(FULL_MASK, cand);
        if ((bi & 31) == lane) {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j == bi >> 5) p[j] = -2.f;  // taken
        }
        total += bv;
        if (lane == sel) { mine = bv; mine_i = bi; }
    }
    if (lane < k) {
        idx[lane] = mine_i;
        wts[lane] = mine / total;
    }
    if (lane == 0) {
        idx[k] = E;
        wts[k] = sigmoid_f(__ldcg(logits + E));
    }
    const unsigned long long mine_b = lane < k && lane < 8 ? (unsigned long long)(mine_i & 0xff) << (8 * lane) : 0ull;
    const unsigned int lo = __reduce_or_sync(FULL_MASK, (unsigned int)mine_b);
    const unsigned int hi = __reduce_or_sync(FULL_MASK, (unsigned int)(mine_b >> 32));
    return ((unsigned long long)hi << 32 | lo) | (k < 8 ? 0xffull << 56 : 0ull);
}


// ---- bulk copies (TMA, 1-D) into shared memory, completed on an mbarrier ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

// Make initialised barriers visible to the async (TMA) proxy; follow with __syncthreads().
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also expects `bytes` of bulk-copy transactions on this phase.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Spin until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
    } while (!done);
}

// Global -> shared bulk copy of `bytes` (multiple of 16; both addresses 16-byte aligned), counted on `bar`.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

// Order earlier generic-proxy accesses to shared memory before later bulk copies into it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
