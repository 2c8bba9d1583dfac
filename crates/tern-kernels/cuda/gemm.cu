// 4-bit weight x bf16 activation GEMM on tensor cores (prefill: many tokens at once), dense and grouped by expert.
//
//   Y[n, r] = sum_k X[n, k] * W[r, k],   W[r, k] = scale[r, k/gs] * q[r, k] + bias[r, k/gs]   (MLX affine 4-bit)
//
// W stays packed in global memory (u32 words, column 8j+i in nibble i of word j; bf16 scales/biases
// [rows, K/gs]); X is bf16 [N, K] row-major with row stride ldx. Block tile: 128 weight rows x BN tokens, k-steps
// of 64; 8 warps. Per k-step the packed codes (4 KB) and the X tile (BN x 128 B) arrive by cp.async in a ring of
// S stages; the block dequantises the codes ONCE into a bf16 tile in shared memory (exact s*q+b, one bf16
// rounding: dequant8 in mma.cuh) for the NEXT k-step while the tensor cores work on the current one. The products:
// wgmma (the production kernels): each warpgroup issues m64nBNk16 over its 64 weight rows straight from the two
// shared tiles (unpadded rows in the 128-byte swizzle, mma.cuh), then dequantises, then waits for it; or
// mma.sync m16n8k16 (the `_mma` kernels: the same tiles padded, fragments by ldmatrix; the bench's A/B). f32
// accumulators either way. One __syncthreads per k-step.
// K may be any multiple of 32 (a half k-step is zero-filled); rows and tokens past the end are zero-filled and
// never stored. gs is a power of two >= 32.
//
// Epilogues (MODE):
//   GE_STORE  dense:   y[n*ldy + r] = acc                 (f32)
//   GE_ADD    dense:   y[n*ldy + r] += acc                (f32, the residual add)
//   GE_SWIGLU grouped: act[p*ldy + j] = bf16(silu(G_e[j].x) * (U_e[j].x)) for the gate/up matrix of expert e
//                      ([2 I_e, K]: gate rows then up rows); the block's 128 rows are 64 gate rows and the 64
//                      matching up rows, arranged so that every warp holds both halves of its outputs.
//   GE_GSTORE grouped: y[p*ldy + r] = acc                 (f32; the down projection of expert e, K = I_e)
// Grouped launches: blockIdx.y = tile t of the expert-sorted (token, slot) pairs built by moe_align (prefill.cu):
// tiles[3t..3t+2] = (expert, first pair, pairs <= BN); *ntile tiles are valid, the rest of the grid exits. Expert
// e's weights start at e * e_words / e * e_groups; the shared expert is e == E with inner size Is (routed: I).
// GE_SWIGLU gathers X rows through rowmap (pair -> token); GE_GSTORE reads the pairs' rows of X (act) in order.
//
// Split K (dense only): grid z = KZ blocks (one cluster, KZ in 2, 4, 8) take k-steps [KT z / KZ, KT (z + 1) / KZ)
// each of the same tile; each leaves its sums in its shared memory and after a cluster barrier block z adds a KZ-th
// of the tile's sums over the cluster, in z order (from 0.f), and stores them. KZ is chosen by the weight's shape in
// short passes and is 1 in long ones (gemm_split in prefill.rs), so a row's sums depend on nothing else.
//
// Bytes: R*K/2 + R*K/gs*4 of weights (+ X from L2, once per 128-row tile); FLOPs 2*N*R*K (grouped: per pair).
#include "mma.cuh"
#include <cooperative_groups.h>
#include <type_traits>
namespace cg = cooperative_groups;

#define GE_STORE 0
#define GE_ADD 1
#define GE_SWIGLU 2
#define GE_GSTORE 3

#define GM_BM 128
#define GM_LDS 72  // shared row stride of the bf16 tiles, elements (64 + 8: ldmatrix rows hit distinct banks)

// WG: the products on wgmma (two warpgroups, each 64 weight rows x BN tokens; the bf16 tiles unpadded in the
// 128-byte swizzle, mma.cuh), else on mma.sync (warps WM x WN; the tiles' rows padded to GM_LDS).
template <int BN, int MODE, int S, bool WG>
struct GemmCfg {
    static constexpr int WM = WG ? 8 : BN == 128 ? 2 : 4;  // warps along M
    static constexpr int WN = 8 / WM;                     // warps along N
    static constexpr int WR = GM_BM / WM;                 // rows per warp
    static constexpr int WC = BN / WN;                    // tokens per warp
    static constexpr int MI = WR / 16;                    // m16 tiles per warp
    static constexpr int NI = WC / 8;                     // n8 tiles per warp
    static constexpr int LDS = WG ? 64 : GM_LDS;          // row stride of the bf16 tiles, elements
    static constexpr int XCH = BN * 8 / 256;              // 16-byte X chunks per thread per stage
    static constexpr int WQ_BYTES = GM_BM * 32;           // packed codes of one k-step
    static constexpr int XS_BYTES = BN * LDS * 2;
    static constexpr int WD_BYTES = GM_BM * LDS * 2;
    static constexpr int STAGE = WQ_BYTES + XS_BYTES;
    static constexpr int ALIGN = WG ? 1024 : 0;  // slack to align the swizzled tiles to 1024 bytes
    static constexpr int SMEM = S * STAGE + 2 * WD_BYTES + ALIGN;
    static_assert(WG ? (MI == 1 && NI == BN / 8 && (BN == 64 || BN == 128) && STAGE % 1024 == 0)
                     : (MI >= 2 && MI % 2 == 0 && NI % 2 == 0),
                  "tile shape");
};
// byte offset of the 16-byte chunk c of row r in a bf16 tile of row stride C::LDS (swizzled when WG)
template <class C, bool WG>
__device__ __forceinline__ int tile_off(int r, int c) {
    return WG ? r * 128 + ((c ^ (r & 7)) << 4) : (r * C::LDS + 8 * c) * 2;
}

template <int BN, int MODE, int S, bool WG>
__device__ __forceinline__ void gemm_q4_body(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ sc,
                                             const __nv_bfloat16* __restrict__ bi, long e_words, long e_groups,
                                             int R, int K, int glog, int I, int Is, int E,
                                             const __nv_bfloat16* __restrict__ x, int ldx, int N,
                                             const int* __restrict__ ntile, const int* __restrict__ tiles,
                                             const int* __restrict__ rowmap, void* __restrict__ y, int ldy) {
    using C = GemmCfg<BN, MODE, S, WG>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // the swizzled tiles need 1024-byte alignment (the dynamic window's start is only promised 16)
    unsigned char* smem = smem_raw + (WG ? (1024 - (smem_u32(smem_raw) & 1023)) & 1023 : 0);
    constexpr bool GROUPED = MODE == GE_SWIGLU || MODE == GE_GSTORE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / C::WN, wn = warp % C::WN;
    pdl_wait();

    // ---- what this block computes
    int e = 0, p0 = 0, cnt = 0, Ke = K, m0 = 0, j0 = 0, Ie = 0;
    if (GROUPED) {
        if ((int)blockIdx.y >= *ntile) return;
        e = tiles[3 * blockIdx.y];
        p0 = tiles[3 * blockIdx.y + 1];
        cnt = tiles[3 * blockIdx.y + 2];
        Ie = e == E ? Is : I;
        if (MODE == GE_SWIGLU) {
            j0 = blockIdx.x * (GM_BM / 2);
            if (j0 >= Ie) return;
        } else {
            Ke = Ie;
            m0 = blockIdx.x * GM_BM;
        }
    } else {
        m0 = blockIdx.x * GM_BM;
        p0 = blockIdx.y * BN;
        cnt = min(BN, N - p0);
    }
    const uint32_t* we = w + e * e_words;
    const __nv_bfloat16* se = sc + e * e_groups;
    const __nv_bfloat16* be = bi + e * e_groups;
    const int kwords = Ke >> 3, ngroups = Ke >> glog, KTA = (Ke + 63) >> 6;
    // this block's k-steps kt0 .. kt0 + KT - 1 (all of them unless the launch splits K: dense, gridDim.z > 1)
    const int kz = GROUPED ? 1 : (int)gridDim.z, zi = GROUPED ? 0 : (int)blockIdx.z;
    const int kt0 = KTA * zi / kz, KT = KTA * (zi + 1) / kz - kt0;

    // ---- this thread's weight row (loads, dequant) and X rows (loads), fixed for the whole k loop
    const int drow = tid >> 1, dhalf = tid & 1;  // dequant / W load: row drow, columns 32*dhalf..+31 of a k-step
    int wrow;
    bool wvalid;
    if (MODE == GE_SWIGLU) {
        constexpr int half = C::WR / 2;
        const int wq = drow / C::WR, o = drow % C::WR;
        const int j = j0 + wq * half + (o % half);
        wvalid = j < Ie;
        wrow = o >= half ? Ie + j : j;
    } else {
        wrow = m0 + drow;
        wvalid = wrow < (GROUPED ? R : R);
    }
    const uint32_t* wsrc = we + (long)(wvalid ? wrow : 0) * kwords;
    const __nv_bfloat16* ssrc = se + (long)(wvalid ? wrow : 0) * ngroups;
    const __nv_bfloat16* bsrc = be + (long)(wvalid ? wrow : 0) * ngroups;
    const __nv_bfloat16* xsrc[C::XCH];
    const int xc = tid & 7;  // this thread's 16-byte chunk of every X row it loads
#pragma unroll
    for (int j = 0; j < C::XCH; j++) {
        const int n = (tid >> 3) + 32 * j;
        const __nv_bfloat16* p = nullptr;
        if (n < cnt) {
            long row;
            if (MODE == GE_SWIGLU)
                row = rowmap[p0 + n];
            else
                row = p0 + n;
            p = x + row * (long)ldx;
        }
        xsrc[j] = p;
    }

    unsigned char* ring = smem;
    unsigned char* wd = smem + S * C::STAGE;
    auto load_stage = [&](int kt) {
        if (kt < KT) {
            unsigned char* st = ring + (kt % S) * C::STAGE;
            const int k0 = (kt0 + kt) * 64;
            {
                const int kc = k0 + 32 * dhalf;
                const bool ok = wvalid && kc < Ke;
                cp_async16(st + tid * 16, ok ? (const void*)(wsrc + (kc >> 3)) : (const void*)w, ok ? 16 : 0);
            }
            unsigned char* xs = st + C::WQ_BYTES;
#pragma unroll
            for (int j = 0; j < C::XCH; j++) {
                const int n = (tid >> 3) + 32 * j;
                const int kc = k0 + 8 * xc;
                const bool ok = xsrc[j] != nullptr && kc < Ke;
                cp_async16(xs + tile_off<C, WG>(n, xc), ok ? (const void*)(xsrc[j] + kc) : (const void*)x,
                           ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
    // scale/bias of this thread's row and half-k-step, one k-step ahead in registers
    auto load_sb = [&](int kt, __nv_bfloat162& s2, __nv_bfloat162& b2) {
        const int kc = (kt0 + kt) * 64 + 32 * dhalf;
        __nv_bfloat16 s = __float2bfloat16(0.f), b = __float2bfloat16(0.f);
        if (wvalid && kt < KT && kc < Ke) {
            s = ssrc[kc >> glog];
            b = bsrc[kc >> glog];
        }
        s2 = __halves2bfloat162(s, s);
        b2 = __halves2bfloat162(b, b);
    };
    auto dequant = [&](int kt, __nv_bfloat162 s2, __nv_bfloat162 b2) {
        const uint4 q = *reinterpret_cast<const uint4*>(ring + (kt % S) * C::STAGE + tid * 16);
        uint32_t o[4][4];
        dequant8(q.x, s2, b2, o[0]);
        dequant8(q.y, s2, b2, o[1]);
        dequant8(q.z, s2, b2, o[2]);
        dequant8(q.w, s2, b2, o[3]);
        unsigned char* dst = wd + (kt & 1) * C::WD_BYTES;
#pragma unroll
        for (int i = 0; i < 4; i++)
            *reinterpret_cast<uint4*>(dst + tile_off<C, WG>(drow, 4 * dhalf + i)) =
                make_uint4(o[i][0], o[i][1], o[i][2], o[i][3]);
        if (WG) fence_async_smem();  // visible to the wgmma (async proxy) after the next barrier
    };

    float acc[C::MI][C::NI][4];
#pragma unroll
    for (int i = 0; i < C::MI; i++)
#pragma unroll
        for (int j = 0; j < C::NI; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

    // prologue: stages 0..S-2 in flight; k-step 0 dequantised
#pragma unroll
    for (int s = 0; s < S - 1; s++) load_stage(s);
    __nv_bfloat162 s2, b2;
    load_sb(0, s2, b2);
    cp_async_wait<S - 2>();
    __syncthreads();
    dequant(0, s2, b2);
    load_sb(1, s2, b2);

#pragma unroll 1
    for (int kt = 0; kt < KT; kt++) {
        // stage kt+1 has landed (S-3 younger groups may be pending) and everyone's dequant of k-step kt is visible;
        // every warp is past k-step kt-1, whose stage the load below refills
        cp_async_wait<S - 3>();
        if (WG) fence_async_smem();  // the landed X tiles, to the wgmma's async proxy
        __syncthreads();
        load_stage(kt + S - 1);
        const unsigned char* wt = wd + (kt & 1) * C::WD_BYTES;
        const unsigned char* xt = ring + (kt % S) * C::STAGE + C::WQ_BYTES;
        if constexpr (WG) {
            // the warpgroup's 64 rows x BN tokens in 4 k16 slices, issued before the next k-step's dequant so that
            // the two overlap; waited for before the next barrier (which frees this k-step's tiles)
            auto& dv = *reinterpret_cast<float(*)[BN / 2]>(&acc[0][0][0]);
            const uint32_t a0 = smem_u32(wt) + (warp >> 2) * 64 * 128, b0 = smem_u32(xt);
            wgmma_reg_fence(dv);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                if constexpr (BN == 128)
                    wgmma_m64n128k16(dv, wgmma_desc(a0 + 32 * kk), wgmma_desc(b0 + 32 * kk));
                else
                    wgmma_m64n64k16(dv, wgmma_desc(a0 + 32 * kk), wgmma_desc(b0 + 32 * kk));
            }
            wgmma_commit();
            if (kt + 1 < KT) {
                dequant(kt + 1, s2, b2);
                load_sb(kt + 2, s2, b2);
            }
            wgmma_wait<0>();
            wgmma_reg_fence(dv);
        } else {
            if (kt + 1 < KT) {
                dequant(kt + 1, s2, b2);
                load_sb(kt + 2, s2, b2);
            }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                uint32_t a[C::MI][4];
#pragma unroll
                for (int mi = 0; mi < C::MI; mi++) {
                    const int r = wm * C::WR + mi * 16 + (lane & 15);
                    ldsm_x4(a[mi], wt + (r * GM_LDS + kk * 16 + (lane >> 4) * 8) * 2);
                }
#pragma unroll
                for (int nj = 0; nj < C::NI / 2; nj++) {
                    uint32_t b[4];
                    const int n = wn * C::WC + nj * 16 + (lane & 7) + (lane >> 4) * 8;
                    ldsm_x4(b, xt + (n * GM_LDS + kk * 16 + ((lane >> 3) & 1) * 8) * 2);
#pragma unroll
                    for (int mi = 0; mi < C::MI; mi++) {
                        mma_bf16(acc[mi][2 * nj], a[mi], b[0], b[1]);
                        mma_bf16(acc[mi][2 * nj + 1], a[mi], b[2], b[3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // ---- epilogue
    const int g = lane >> 2, t4 = lane & 3;
    if (MODE == GE_SWIGLU && WG) {
        // each warp's 16 rows are 8 gate rows (its row g) and their 8 up rows (g + 8): c = 0, 1 gate, c + 2 up
        __nv_bfloat16* act = reinterpret_cast<__nv_bfloat16*>(y);
        const int j = j0 + warp * 8 + g;
#pragma unroll
        for (int ni = 0; ni < C::NI; ni++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int n = ni * 8 + 2 * t4 + c;
                if (j < Ie && n < cnt)
                    act[(long)(p0 + n) * ldy + j] = __float2bfloat16(silu_f(acc[0][ni][c]) * acc[0][ni][c + 2]);
            }
    } else if (MODE == GE_SWIGLU) {
        constexpr int half = C::WR / 2;
        __nv_bfloat16* act = reinterpret_cast<__nv_bfloat16*>(y);
#pragma unroll
        for (int mi = 0; mi < C::MI / 2; mi++)
#pragma unroll
            for (int ni = 0; ni < C::NI; ni++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int j = j0 + wm * half + mi * 16 + g + (c >= 2 ? 8 : 0);
                    const int n = wn * C::WC + ni * 8 + 2 * t4 + (c & 1);
                    if (j < Ie && n < cnt) {
                        const float gv = acc[mi][ni][c], uv = acc[mi + C::MI / 2][ni][c];
                        act[(long)(p0 + n) * ldy + j] = __float2bfloat16(silu_f(gv) * uv);
                    }
                }
    } else {
        if (kz > 1) {
            // every block's sums into its shared memory (the ring and the dequant tiles after it, >= 64 KB: idle
            // once every warp is past the last k-step),
            // [sum index q][thread]; then block z adds the cluster's sums q of its share, in z order, and stores them
            float* zs = reinterpret_cast<float*>(smem);
            __syncthreads();
#pragma unroll
            for (int mi = 0; mi < C::MI; mi++)
#pragma unroll
                for (int ni = 0; ni < C::NI; ni++)
#pragma unroll
                    for (int c = 0; c < 4; c++) zs[((mi * C::NI + ni) * 4 + c) * 256 + tid] = acc[mi][ni][c];
            cg::cluster_group cluster = cg::this_cluster();
            cluster.sync();  // every block's sums are in its shared memory
            float* out = reinterpret_cast<float*>(y);
            auto share = [&](auto kzc) {
                constexpr int KZ = decltype(kzc)::value, PER = C::MI * C::NI * 4 / KZ;
                const float* src[KZ];
#pragma unroll
                for (int z = 0; z < KZ; z++) src[z] = cluster.map_shared_rank(zs, z) + tid;
#pragma unroll 4
                for (int i = 0; i < PER; i++) {
                    const int q = zi * PER + i, c = q & 3, ni = (q >> 2) % C::NI, mi = (q >> 2) / C::NI;
                    float v[KZ];
#pragma unroll
                    for (int z = 0; z < KZ; z++) v[z] = src[z][q * 256];
                    float sum = 0.f;
#pragma unroll
                    for (int z = 0; z < KZ; z++) sum += v[z];
                    const int r = m0 + wm * C::WR + mi * 16 + g + (c >= 2 ? 8 : 0);
                    const int n = wn * C::WC + ni * 8 + 2 * t4 + (c & 1);
                    if (r < R && n < cnt) {
                        float* o = out + (long)(p0 + n) * ldy + r;
                        *o = MODE == GE_ADD ? *o + sum : sum;
                    }
                }
            };
            if (kz == 2) share(std::integral_constant<int, 2>{});
            if (kz == 4) share(std::integral_constant<int, 4>{});
            if (kz == 8) share(std::integral_constant<int, 8>{});
            cluster.sync();  // no block leaves while another may still read its sums
            return;
        }
        float* out = reinterpret_cast<float*>(y);
#pragma unroll
        for (int mi = 0; mi < C::MI; mi++)
#pragma unroll
            for (int ni = 0; ni < C::NI; ni++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int r = m0 + wm * C::WR + mi * 16 + g + (c >= 2 ? 8 : 0);
                    const int n = wn * C::WC + ni * 8 + 2 * t4 + (c & 1);
                    if (r < R && n < cnt) {
                        float* o = out + (long)(p0 + n) * ldy + r;
                        if (MODE == GE_ADD)
                            *o += acc[mi][ni][c];
                        else
                            *o = acc[mi][ni][c];
                    }
                }
    }
}

#define GEMM_Q4(NAME, BN, MODE, S, WG)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                  \
        const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ sc, const __nv_bfloat16* __restrict__ bi, \
        long e_words, long e_groups, int R, int K, int glog, int I, int Is, int E,                              \
        const __nv_bfloat16* __restrict__ x, int ldx, int N, const int* __restrict__ ntile,                     \
        const int* __restrict__ tiles, const int* __restrict__ rowmap, void* __restrict__ y, int ldy) {         \
        gemm_q4_body<BN, MODE, S, WG>(w, sc, bi, e_words, e_groups, R, K, glog, I, Is, E, x, ldx, N, ntile, tiles, \
                                      rowmap, y, ldy);                                                         \
    }

GEMM_Q4(gemm_q4_store, 128, GE_STORE, 3, true)
GEMM_Q4(gemm_q4_add, 128, GE_ADD, 3, true)
GEMM_Q4(gemm_q4_swiglu, 64, GE_SWIGLU, 4, true)
GEMM_Q4(gemm_q4_gstore, 64, GE_GSTORE, 4, true)
GEMM_Q4(gemm_q4_store_mma, 128, GE_STORE, 3, false)
GEMM_Q4(gemm_q4_add_mma, 128, GE_ADD, 3, false)
GEMM_Q4(gemm_q4_swiglu_mma, 64, GE_SWIGLU, 4, false)
GEMM_Q4(gemm_q4_gstore_mma, 64, GE_GSTORE, 4, false)

// Shared memory each instantiation needs (the host mirrors these numbers in prefill.rs).
static_assert(GemmCfg<128, GE_STORE, 3, true>::SMEM - 1024 >= 64 * 1024, "split-K sums");
static_assert(GemmCfg<128, GE_STORE, 3, true>::SMEM == 3 * (4096 + 128 * 128) + 2 * 128 * 128 + 1024, "smem");
static_assert(GemmCfg<64, GE_SWIGLU, 4, true>::SMEM == 4 * (4096 + 64 * 128) + 2 * 128 * 128 + 1024, "smem");
static_assert(GemmCfg<128, GE_STORE, 3, false>::SMEM == 3 * (4096 + 128 * 144) + 2 * 128 * 144, "smem");
static_assert(GemmCfg<64, GE_SWIGLU, 4, false>::SMEM == 4 * (4096 + 64 * 144) + 2 * 128 * 144, "smem");
