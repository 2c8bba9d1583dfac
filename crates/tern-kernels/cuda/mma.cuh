// Tensor-core and asynchronous-copy primitives for the multi-token (prefill) kernels (included by gemm.cu and
// flash.cu; not compiled on its own).
//
// Fragment layouts of mma.sync.m16n8k16 (bf16 operands, f32 accumulators), lane = 4*g + t (g = lane/4, t = lane%4):
//   A (16x16, row-major M x K): a[0] = (row g,   k 2t..2t+1), a[1] = (row g+8, k 2t..2t+1),
//                               a[2] = (row g,   k 2t+8..+9), a[3] = (row g+8, k 2t+8..+9)   (bf16x2 each)
//   B (16x8, "col": K x N with k contiguous per n): b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8..+9, n g)
//   C (16x8 f32): c[0], c[1] = (row g, n 2t, 2t+1), c[2], c[3] = (row g+8, n 2t, 2t+1)
// ldmatrix.x4 of four 8x8 bf16 matrices whose rows are 16-byte runs in shared memory: lanes 8i..8i+7 give the row
// addresses of matrix i, and register i of every lane receives (row lane/4, elements 2(lane%4), +1) of matrix i
// (.trans: element [2(lane%4)][lane/4] and [2(lane%4)+1][lane/4] instead).
#pragma once
#include "common.cuh"

// 16-byte asynchronous global -> shared copy (L2 only); src_bytes 0 writes zeros (src is not read then, but must be
// a valid address expression).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// d += a * b (m16n8k16, bf16 in, f32 accumulate)
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two floats -> bf16x2 (round to nearest even), lo in the low half
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ uint32_t bf2_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 u32_bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// Eight 4-bit codes of one packed word (column 8j+i in nibble i) -> eight bf16 weights s*q + b in column order,
// packed two per u32 (out[i] = columns 2i, 2i+1). Exact: 0x4300|q is the bf16 128+q, minus 128 is q exactly, and
// the fused multiply-add rounds s*q + b once (the same value as rounding the f32 s*q + b to bf16).
__device__ __forceinline__ void dequant8(uint32_t w, __nv_bfloat162 s2, __nv_bfloat162 b2, uint32_t (&out)[4]) {
    const __nv_bfloat162 k128 = __float2bfloat162_rn(128.f);
    uint32_t p[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t v = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;  // columns i (low) and i+4 (high)
        p[i] = bf2_u32(__hfma2(__hsub2(u32_bf2(v), k128), s2, b2));
    }
    out[0] = prmt(p[0], p[1], 0x5410);  // columns 0, 1
    out[1] = prmt(p[2], p[3], 0x5410);  // 2, 3
    out[2] = prmt(p[0], p[1], 0x7632);  // 4, 5
    out[3] = prmt(p[2], p[3], 0x7632);  // 6, 7
}

// ---- tf32 (the chunked Gated DeltaNet: f32 data, tensor cores)
// Fragments of mma.sync.m16n8k8 (tf32 operands, f32 accumulators), lane = 4*g + t:
//   A (16x8, row-major M x K): a[0] = (row g, k t), a[1] = (row g+8, k t), a[2] = (row g, k t+4), a[3] = (g+8, t+4)
//   B (8x8, K x N):            b[0] = (k t, n g), b[1] = (k t+4, n g)
//   C as m16n8k16's.
// ldmatrix.x4 reads f32 data as b16 pairs: matrix i's row r is 4 floats, and register i of lane 4g + t receives
// float t of row g. So an A fragment is one x4 of rows 0-7 / 8-15 at k, k+4 of a row-major [M][K] tile, and two B
// fragments (n-tiles j, j+1) one x4 of a [N][K] tile (k contiguous per n).

// x rounded to tf32 (nearest, ties away), as f32 bits with the low 13 bits zero
__device__ __forceinline__ uint32_t tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// x = hi + lo, both tf32: the 3xTF32 split (hi*hi + hi*lo + lo*hi carries ~f32 precision)
__device__ __forceinline__ void tf32_split(uint32_t x, uint32_t& hi, uint32_t& lo) {
    hi = tf32(__uint_as_float(x));
    lo = tf32(__uint_as_float(x) - __uint_as_float(hi));
}

// d += a * b (m16n8k8, tf32 in, f32 accumulate)
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An A fragment split for 3xTF32, and d += a * b in three tf32 products (the small ones first).
struct Tf32A {
    uint32_t hi[4], lo[4];
};
__device__ __forceinline__ Tf32A tf32_a(const uint32_t (&raw)[4]) {
    Tf32A f;
#pragma unroll
    for (int i = 0; i < 4; i++) tf32_split(raw[i], f.hi[i], f.lo[i]);
    return f;
}
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32A& a, uint32_t b0, uint32_t b1) {
    uint32_t h0, l0, h1, l1;
    tf32_split(b0, h0, l0);
    tf32_split(b1, h1, l1);
    mma_tf32(d, a.lo, h0, h1);
    mma_tf32(d, a.hi, l0, l1);
    mma_tf32(d, a.hi, h0, h1);
}
