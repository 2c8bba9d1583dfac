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

// ---- wgmma (Hopper warpgroup MMA; sm_90a): both operands K-major bf16 tiles in shared memory, rows of 64 elements
// (128 bytes) in the 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r & 7), the tile 1024-aligned.
// A descriptor names one such tile: start address, LBO 16 B (unused by this swizzle), SBO 1024 B (the next 8 rows),
// swizzle mode 1 (128 B). The k16 slice kk of a 64-wide row starts 32*kk bytes in (the hardware applies the XOR).
// Accumulator of m64nNk16, thread 128*0 + 32*w + 4*g + t of the warpgroup: d[4i + c] = row 16w + g + 8*(c >= 2),
// column 8i + 2t + (c & 1) -- per warp the m16n8 C layout of mma.sync repeated over the N/8 column tiles.
// Order: writes to the tiles (st.shared, cp.async) -> fence_async_smem() by the writer -> barrier -> wgmma_fence()
// -> wgmma_* -> wgmma_commit() -> wgmma_wait<0>() before the accumulators or the tiles are touched again.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(16 >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// keeps the compiler from moving accumulator reads or writes across the asynchronous MMA
template <int R>
__device__ __forceinline__ void wgmma_reg_fence(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// d += A (64 x 16, descriptor da) * B^T (N x 16, descriptor db)
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 0, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, 1, 1, 1, 0, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
}
