// Causal flash attention for the prompt chunks of one or more sequences (a prefill pass's segments, common.cuh:
// Seg), on tensor cores (mma.sync m16n8k16 bf16, f32 accumulate).
//
// Queries: q bf16 [N, nh, HD] (normed + rotated: attn_prep_rows); a sequence's rows are its tokens at absolute
// positions pos0 .. pos0+k-1. Keys/values: the sequence's bf16 caches kcs/vcs[s], [max_ctx, nkv, HD] (rows pos0..
// already appended by attn_prep_rows), so a chunk that starts after cached tokens attends to them. Query head h
// uses kv head h / (nh / nkv). Token n attends to keys 0 ..= pos0 + n (scale HD^-1/2, online softmax in f32,
// base-2 exponentials).
// Output: o[n, h*HD + d] = bf16( softmax(q k^T) v * sigmoid(gate) ), gate = proj[n, h*2*HD + HD + d] (f32, the
// per-head interleaved q|gate projection, row stride ldp) -> the o_proj GEMM input.
// Grid (the pass's chunks of 64 rows, nh), 128 threads: warp w owns query rows 16w..16w+15 of the block's 64; K/V
// tiles of BKV keys stream through shared memory by cp.async, double-buffered. Tiles are scheduled last first (a
// sequence's heaviest first).
// Bytes: q + o ~ N*nh*HD*4 + (keys read once per query tile, from L2). FLOPs 4 * nh * HD * sum_n (pos0 + n + 1).
#include "mma.cuh"

template <int HD, int BKV>
struct FlashCfg {
    static constexpr int LD = HD + 8;  // shared row stride (elements): ldmatrix rows on distinct banks
    static constexpr int Q_BYTES = 64 * LD * 2;
    static constexpr int KV_BYTES = BKV * LD * 2;
    static constexpr int SMEM = Q_BYTES + 4 * KV_BYTES;  // Q, K[2], V[2]
    static constexpr int NT = HD / 8;                    // n8 tiles of the output per warp
    static constexpr int ST = BKV / 8;                   // n8 tiles of a score row block
};

template <int HD, int BKV>
__device__ __forceinline__ void flash_body(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
                                           const __nv_bfloat16* __restrict__ vc, const float* __restrict__ proj,
                                           int ldp, int N, int pos0, int qt, int nh, int nkv, float scale,
                                           __nv_bfloat16* __restrict__ out) {
    using C = FlashCfg<HD, BKV>;
    extern __shared__ __align__(128) unsigned char smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem + C::Q_BYTES);
    __nv_bfloat16* Vs = reinterpret_cast<__nv_bfloat16*>(smem + C::Q_BYTES + 2 * C::KV_BYTES);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y, kvh = h / (nh / nkv);
    const int n0 = qt * 64;
    const int nmax = min(N, n0 + 64) - 1;     // last valid query of the tile
    const int nkeys = pos0 + nmax + 1;        // keys this tile needs
    const int ntiles = (nkeys + BKV - 1) / BKV;

    // Q tile: 64 rows x HD (zero past N)
    constexpr int QCH = 64 * HD / 8;  // 16-byte chunks
    for (int i = tid; i < QCH; i += 128) {
        const int r = i / (HD / 8), c = i % (HD / 8);
        const bool ok = n0 + r < N;
        cp_async16(Qs + r * C::LD + 8 * c, ok ? (const void*)(q + ((long)(n0 + r) * nh + h) * HD + 8 * c) : (const void*)q,
                   ok ? 16 : 0);
    }
    auto load_kv = [&](int j) {
        const int buf = j & 1;
        constexpr int CH = BKV * HD / 8;
        for (int i = tid; i < CH; i += 128) {
            const int r = i / (HD / 8), c = i % (HD / 8);
            const int key = j * BKV + r;
            const bool ok = key < nkeys;
            const long off = ((long)key * nkv + kvh) * HD + 8 * c;
            cp_async16(Ks + buf * BKV * C::LD + r * C::LD + 8 * c, ok ? (const void*)(kc + off) : (const void*)kc,
                       ok ? 16 : 0);
            cp_async16(Vs + buf * BKV * C::LD + r * C::LD + 8 * c, ok ? (const void*)(vc + off) : (const void*)vc,
                       ok ? 16 : 0);
        }
    };
    load_kv(0);
    cp_async_commit();

    float o[C::NT][4];
#pragma unroll
    for (int i = 0; i < C::NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const float sl2 = scale * 1.4426950408889634f;
    const int g = lane >> 2, t4 = lane & 3;
    const int qrow0 = n0 + warp * 16 + g;  // this thread's rows qrow0 and qrow0 + 8 (chunk token index)

#pragma unroll 1
    for (int j = 0; j < ntiles; j++) {
        if (j + 1 < ntiles) load_kv(j + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const __nv_bfloat16* Kt = Ks + (j & 1) * BKV * C::LD;
        const __nv_bfloat16* Vt = Vs + (j & 1) * BKV * C::LD;
        // S = Q K^T (16 x BKV per warp)
        float s[C::ST][4];
#pragma unroll
        for (int i = 0; i < C::ST; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t a[4];
            ldsm_x4(a, Qs + (warp * 16 + (lane & 15)) * C::LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nj = 0; nj < C::ST / 2; nj++) {
                uint32_t b[4];
                ldsm_x4(b, Kt + (nj * 16 + (lane & 7) + (lane >> 4) * 8) * C::LD + kk * 16 + ((lane >> 3) & 1) * 8);
                mma_bf16(s[2 * nj], a, b[0], b[1]);
                mma_bf16(s[2 * nj + 1], a, b[2], b[3]);
            }
        }
        // mask (causal, and keys past the end), online softmax in base 2
        const bool diag = (j + 1) * BKV > pos0 + n0;  // some key of this tile may lie after some query
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int i = 0; i < C::ST; i++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float v = s[i][c] * sl2;
                if (diag) {
                    const int key = j * BKV + i * 8 + 2 * t4 + (c & 1);
                    const int qabs = pos0 + qrow0 + (c >= 2 ? 8 : 0);
                    if (key > qabs) v = -INFINITY;
                }
                s[i][c] = v;
                mx[c >> 1] = fmaxf(mx[c >> 1], v);
            }
        float corr[2], rs[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            corr[r] = exp2f(m[r] - mx[r]);  // m = -inf only before the first tile, where key 0 is valid: mx finite
            m[r] = mx[r];
        }
        uint32_t p[C::ST][2];
#pragma unroll
        for (int i = 0; i < C::ST; i++) {
            const float p0 = exp2f(s[i][0] - m[0]), p1 = exp2f(s[i][1] - m[0]);
            const float p2 = exp2f(s[i][2] - m[1]), p3 = exp2f(s[i][3] - m[1]);
            rs[0] += p0 + p1;
            rs[1] += p2 + p3;
            p[i][0] = pack_bf16(p0, p1);
            p[i][1] = pack_bf16(p2, p3);
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 1);
            rs[r] += __shfl_xor_sync(FULL_MASK, rs[r], 2);
            l[r] = l[r] * corr[r] + rs[r];
        }
#pragma unroll
        for (int i = 0; i < C::NT; i++) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[0];
            o[i][2] *= corr[1];
            o[i][3] *= corr[1];
        }
        // O += P V: k = keys (16 per step), n = dims
#pragma unroll
        for (int kk = 0; kk < BKV / 16; kk++) {
            const uint32_t a[4] = {p[2 * kk][0], p[2 * kk][1], p[2 * kk + 1][0], p[2 * kk + 1][1]};
#pragma unroll
            for (int nd = 0; nd < C::NT / 2; nd++) {
                uint32_t b[4];
                ldsm_x4_t(b, Vt + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * C::LD + nd * 16 + (lane >> 4) * 8);
                mma_bf16(o[2 * nd], a, b[0], b[1]);
                mma_bf16(o[2 * nd + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with buffer j & 1 before the next iteration's load refills it
    }
    cp_async_wait<0>();

    // out = O / l * sigmoid(gate)
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int n = qrow0 + 8 * r;
        if (n >= N) continue;
        const float inv = 1.f / l[r];
        const float* gate = proj + (long)n * ldp + h * 2 * HD + HD;
        __nv_bfloat16* orow = out + (long)n * nh * HD + h * HD;
#pragma unroll
        for (int i = 0; i < C::NT; i++) {
            const int d = i * 8 + 2 * t4;
            const float v0 = o[i][2 * r] * inv * sigmoid_f(gate[d]);
            const float v1 = o[i][2 * r + 1] * inv * sigmoid_f(gate[d + 1]);
            *reinterpret_cast<uint32_t*>(orow + d) = pack_bf16(v0, v1);
        }
    }
}

// Block (x, h): chunk gridDim.x - 1 - x of the pass, tile qt of its sequence s; q, proj and out from s's first row.
#define FLASH(NAME, HD, BKV)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                     \
        const __nv_bfloat16* __restrict__ q, const unsigned long long* __restrict__ kcs,                        \
        const unsigned long long* __restrict__ vcs, const float* __restrict__ proj, int ldp,                    \
        const int* __restrict__ segs, int nseg, int nh, int nkv, float scale, __nv_bfloat16* __restrict__ out) { \
        pdl_wait();                                                                                             \
        const int c = gridDim.x - 1 - blockIdx.x, si = seg_find(segs, nseg, c, 3);                             \
        const Seg sg = seg_at(segs, si);                                                                        \
        const long r0 = sg.r0;                                                                                  \
        flash_body<HD, BKV>(q + r0 * nh * HD, reinterpret_cast<const __nv_bfloat16*>(kcs[si]),                  \
                            reinterpret_cast<const __nv_bfloat16*>(vcs[si]), proj + r0 * ldp, ldp, sg.k, sg.pos0,  \
                            c - sg.c0, nh, nkv, scale, out + r0 * nh * HD);                                     \
    }

FLASH(flash_prefill_hd256, 256, 32)
FLASH(flash_prefill_hd128, 128, 64)
FLASH(flash_prefill_hd64, 64, 64)
