// Multi-token (prefill) kernels around the tensor-core GEMMs of gemm.cu and the flash attention of flash.cu: N
// rows, the new tokens of one or more sequences (segments, common.cuh: Seg), each continuing from the state it
// holds (KV cache rows, GDN conv ring and f32 recurrent state, from pointer tables indexed by the sequence, and its
// first position pos0). Activations are f32 [N, ...] row-major except GEMM inputs, which are bf16. All math in
// f32; precise expf/logf where the decode kernels' results must be met. A row's (or chunk's) arithmetic does not
// depend on the other sequences in the pass: a sequence's results are the same bit for bit alone or with others.
//
// embed_rows      x[n] = dequant(embed[ids[n]]) (4-bit). Grid N. Bytes N*H*(4 + 0.5).
// rmsnorm_rows    xb[n] = bf16(x[n] * rsqrt(mean(x[n]^2) + eps) * gain), and the f32 copy xn[n] when xn != 0.
//                 Grid N, 256 threads, H <= 4096. Bytes N*H*(4 + 2 (+4)).
// router_rows     logits[n, r] = sum_k W[r, k] xn[n, k], W 8-bit (or 4-bit) MLX affine, rows = E + 1 (router |
//                 shared-expert gate); f32 SIMT tile GEMM (64 tokens x 64 rows, k-steps of 64; the dequantised
//                 weight is exact s*q+b in f32, as the decode router computes it; cols % 64 == 0, gs >= 16).
//                 FLOPs 2*N*(E+1)*H.
// topk_rows       one warp per token: softmax over E logits, top-k, renormalise (topk_warp, common.cuh); slot k
//                 = shared expert E with weight sigmoid(logit E). idx/wts [N, k+1].
// moe_align       one block: counts per expert, prefix offsets, the (token, slot) pairs sorted by expert (rowmap:
//                 pair -> token, pos: (token, slot) -> pair; within an expert in no particular order: GEMM rows
//                 are independent, so results do not depend on it), shared expert E = pairs N*k .. N*k+N-1 in
//                 token order, and the tile list of the grouped GEMMs (expert, first pair, count <= bn) with its
//                 length; for tiles of bn <= 8 pairs also each tile's tokens, trows[t] = 8 u16 (rowmap of its pairs,
//                 low half first; N <= 65536), so that the streamed kernels read them with the tile (one round trip
//                 less). Bytes ~ N*(k+1)*12.
// moe_combine     x[n] += sum_{s <= k} wts[n, s] * ybuf[pos[n, s]] (slot order: deterministic). Grid N.
// moe_combine_norm_j{8,16}  moe_combine, then rmsnorm_rows of the new x (one launch, the same bits). Grid N.
// gdn_prep        per token: causal depthwise conv over q|k|v (K taps; inputs before pos0 from the ring, slot
//                 p % K holds position p), SiLU, l2-norm of q and k per key head (q also * dk^-1/2), beta =
//                 sigmoid(b), gl = -exp(A_log) * softplus(a + dt_bias) (the log of the decay). -> qkv [N,
//                 conv_dim] (same channel layout), beta/gl [N, Hv]. Grid N, 256 threads.
// gdn_chunk_prep  chunked delta rule, phase 1 (every chunk of a sequence's 64 tokens, of every sequence, and value
//                 head in parallel; operands by
//                 cp.async): G = cumsum gl, A[i,j] = beta_i e^{G_i-G_j} k_i.k_j (j < i), P[i,j] = e^{G_i-G_j} q_i.k_j
//                 (j <= i); solves (I + A) [U | W] = [diag(beta) V | diag(beta e^G) K] by forward substitution (one
//                 column per thread). -> U [c,h,64,dv], W [c,h,64,dk], P [c,h,64,64], G [c,h,64].
//                 FLOPs per chunk-head ~ 2*64*64*(2dk) + 64*64*(dk+dv).
// gdn_chunk_state phase 2a (sequential over a sequence's chunks), per (value head, 32-column slice, sequence), on
//                 tensor cores (3xTF32: ~f32 products, f32 sums): the state slice S^T [32, dk] as f32 mma
//                 accumulators, the next chunk's operands double-buffered: Sc[c] = S (as S^T); D = U - W S (over
//                 U); S <- e^{G_last} S + (diag(e^{G_last - G}) K)^T D. FLOPs per chunk-slice 2*64*32*2dk (x3).
// gdn_chunk_out   phase 2b (every chunk, head and 64-column slice in parallel; tf32 tensor cores, operands rounded
//                 to nearest): o = diag(e^G) Q Sc + P D -> o [N, Hv, dv] f32. FLOPs per chunk-head
//                 2*64*dv*(dk + 32).
// gdn_gated_norm  o * rsqrt(mean(o^2) + eps) * norm * silu(z) per (token, value head) -> bf16 [N, Hv*dv]. One warp
//                 per (token, head).
// gdn_ring        ring slot p % K <- the pre-conv input of position p for the last min(N, K) positions (after
//                 gdn_prep has read the old slots).
// attn_prep_rows  per (token, head): q = RMSNorm(q)*qn, k = RMSNorm(k)*kn, NeoX RoPE of the first rd dims at
//                 position pos0 + n (the decode kernel's arithmetic), q -> bf16 [N, nh, hd]; k, v -> bf16 cache
//                 rows pos0 + n. Grid (N, nh + nkv), hd threads.
#include "mma.cuh"

extern "C" __global__ void embed_rows(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                      const __nv_bfloat16* __restrict__ b, int cols, int glog,
                                      const int* __restrict__ ids, float* __restrict__ x) {
    pdl_wait();
    const long r = ids[blockIdx.x];
    float* xr = x + (long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const uint32_t word = w[r * (cols / 8) + c / 8];
        const long g = r * (cols >> glog) + (c >> glog);
        xr[c] = bf(s[g]) * (float)((word >> (4 * (c % 8))) & 0xF) + bf(b[g]);
    }
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_rows(const float* __restrict__ x,
                                                               const float* __restrict__ gain, float eps, int H,
                                                               __nv_bfloat16* __restrict__ xb,
                                                               float* __restrict__ xn) {
    KTRACE(60);
    __shared__ float red[32];
    float g[16];  // the gain is a weight: loaded before the dependency wait, its latency beside the previous kernel's
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int c = threadIdx.x + 256 * j;
        g[j] = c < H ? gain[c] : 0.f;
    }
    pdl_wait();
    const float* xr = x + (long)blockIdx.x * H;
    float v[16];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int c = threadIdx.x + 256 * j;
        v[j] = c < H ? xr[c] : 0.f;
        ss += v[j] * v[j];
    }
    const float r = rsqrtf(block_sum(ss, red) / H + eps);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int c = threadIdx.x + 256 * j;
        if (c < H) {
            const float y = v[j] * r * g[j];
            xb[(long)blockIdx.x * H + c] = __float2bfloat16(y);
            if (xn) xn[(long)blockIdx.x * H + c] = y;
        }
    }
}

// ---- router: f32 SIMT GEMM, 64 tokens x 64 rows per block, k-steps of 64, 256 threads (4 x 4 outputs each).
// Per k-step each thread loads one 16-column run of one weight row (one 16-byte load of 8-bit codes, or 8 bytes of
// 4-bit ones, one group: gs >= 16) and four float4s of x, for the next k-step while this one computes.
#define RT 64
extern "C" __global__ void __launch_bounds__(256) router_rows(const uint32_t* __restrict__ w,
                                                              const __nv_bfloat16* __restrict__ sc,
                                                              const __nv_bfloat16* __restrict__ bi, int rows,
                                                              int cols, int bits, int glog,
                                                              const float* __restrict__ xn, int N,
                                                              float* __restrict__ logits) {
    __shared__ __align__(16) float xs[RT][RT + 4];  // [k][token]
    __shared__ __align__(16) float ws[RT][RT + 4];  // [k][row]
    pdl_wait();
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int r0 = blockIdx.x * RT, n0 = blockIdx.y * RT;
    const int wpr = cols * bits / 32;  // words per row
    // this thread's weight run: row wr, columns 16*wq .. +15 of the k-step; x: token xt, float4s xq + 4j
    const int wr = tid >> 2, wq = tid & 3;
    const bool wok = r0 + wr < rows;
    const int xt = tid >> 2, xq = tid & 3;
    const bool xok = n0 + xt < N;
    uint4 wv = make_uint4(0, 0, 0, 0);
    float wsc = 0.f, wbi = 0.f;
    float4 xv[4];
    auto load = [&](int k0) {
        const int c = k0 + 16 * wq;
        wv = make_uint4(0, 0, 0, 0);
        wsc = wbi = 0.f;
        if (wok && c < cols) {
            const uint32_t* p = w + (long)(r0 + wr) * wpr + c * bits / 32;
            if (bits == 8) {
                wv = *reinterpret_cast<const uint4*>(p);
            } else {
                const uint2 v2 = *reinterpret_cast<const uint2*>(p);
                wv.x = v2.x, wv.y = v2.y;
            }
            const long g = (long)(r0 + wr) * (cols >> glog) + (c >> glog);
            wsc = bf(sc[g]);
            wbi = bf(bi[g]);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int kc = k0 + 4 * (xq + 4 * j);
            xv[j] = xok && kc < cols ? *reinterpret_cast<const float4*>(xn + (long)(n0 + xt) * cols + kc)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    float acc[4][4] = {};
    load(0);
    for (int k0 = 0; k0 < cols; k0 += RT) {
        __syncthreads();  // the previous k-step's readers are done
        // exact dequantisation of the 16 codes of this thread's run
#pragma unroll
        for (int i = 0; i < 16; i++) {
            uint32_t q;
            if (bits == 8) {
                const uint32_t word = i < 4 ? wv.x : i < 8 ? wv.y : i < 12 ? wv.z : wv.w;
                q = (word >> (8 * (i & 3))) & 0xFF;
            } else {
                const uint32_t word = i < 8 ? wv.x : wv.y;
                q = (word >> (4 * (i & 7))) & 0xF;
            }
            ws[16 * wq + i][wr] = fmaf(wsc, (float)q, wbi);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int k = 4 * (xq + 4 * j);
            xs[k][xt] = xv[j].x;
            xs[k + 1][xt] = xv[j].y;
            xs[k + 2][xt] = xv[j].z;
            xs[k + 3][xt] = xv[j].w;
        }
        __syncthreads();
        if (k0 + RT < cols) load(k0 + RT);
#pragma unroll 8
        for (int k = 0; k < RT; k++) {
            const float4 a = *reinterpret_cast<const float4*>(&ws[k][4 * tx]);
            const float4 b = *reinterpret_cast<const float4*>(&xs[k][4 * ty]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++) acc[i][jj] = fmaf(av[i], bv[jj], acc[i][jj]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            const int r = r0 + 4 * tx + i, n = n0 + 4 * ty + jj;
            if (r < rows && n < N) logits[(long)n * rows + r] = acc[i][jj];
        }
}

extern "C" __global__ void topk_rows(const float* __restrict__ logits, int E, int k, int N, int* __restrict__ idx,
                                     float* __restrict__ wts) {
    KTRACE(61);
    pdl_wait();
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    topk_warp(logits + (long)n * (E + 1), E, k, idx + (long)n * (k + 1), wts + (long)n * (k + 1));
}

// One block of 1024 threads. E + 1 <= 1024 experts (the shared one last).
extern "C" __global__ void __launch_bounds__(1024) moe_align(const int* __restrict__ idx, int N, int k, int E, int bn,
                                                             int* __restrict__ rowmap, int* __restrict__ pos,
                                                             int* __restrict__ ntile, int* __restrict__ tiles,
                                                             uint4* __restrict__ trows) {
    __shared__ int cnt[1024], off[1024], cur[1024];
    __shared__ int tile_off[1024];
    KTRACE(62);
    pdl_wait();
    const int tid = threadIdx.x;
    for (int e = tid; e <= E; e += blockDim.x) cnt[e] = e == E ? N : 0;
    __syncthreads();
    for (int i = tid; i < N * k; i += blockDim.x) {
        const int n = i / k, s = i % k;
        atomicAdd(&cnt[idx[n * (k + 1) + s]], 1);
    }
    __syncthreads();
    {
        // exclusive prefix sums of the counts and tile counts over the E + 1 <= blockDim experts, both in one 64-bit
        // word (counts high, tiles low; each total < 2^31): a warp scan, then a scan of the 32 warps' totals
        __shared__ unsigned long long wsum[32];
        const int lane = tid & 31, wid = tid >> 5;
        const unsigned long long v =
            tid <= E ? ((unsigned long long)cnt[tid] << 32) | (unsigned)((cnt[tid] + bn - 1) / bn) : 0ull;
        unsigned long long inc = v;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long t = __shfl_up_sync(FULL_MASK, inc, o);
            if (lane >= o) inc += t;
        }
        if (lane == 31) wsum[wid] = inc;
        __syncthreads();
        if (wid == 0) {
            unsigned long long w = lane < (int)(blockDim.x >> 5) ? wsum[lane] : 0ull;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long t = __shfl_up_sync(FULL_MASK, w, o);
                if (lane >= o) w += t;
            }
            wsum[lane] = w;
        }
        __syncthreads();
        const unsigned long long excl = inc - v + (wid > 0 ? wsum[wid - 1] : 0ull);
        if (tid <= E) {
            off[tid] = (int)(excl >> 32);
            tile_off[tid] = (int)(excl & 0xffffffffull);
        }
        if (tid == E) *ntile = (int)((excl + v) & 0xffffffffull);
    }
    __syncthreads();
    for (int e = tid; e <= E; e += blockDim.x) {
        cur[e] = off[e];
        int t = tile_off[e];
        for (int c = 0; c < cnt[e]; c += bn, t++) {
            tiles[3 * t] = e;
            tiles[3 * t + 1] = off[e] + c;
            tiles[3 * t + 2] = min(bn, cnt[e] - c);
        }
    }
    __syncthreads();
    for (int i = tid; i < N * k; i += blockDim.x) {
        const int n = i / k, s = i % k;
        const int e = idx[n * (k + 1) + s];
        const int p = atomicAdd(&cur[e], 1);
        rowmap[p] = n;
        pos[n * (k + 1) + s] = p;
    }
    for (int n = tid; n < N; n += blockDim.x) {
        const int p = off[E] + n;
        rowmap[p] = n;
        pos[n * (k + 1) + k] = p;
    }
    if (bn > 8) return;
    __syncthreads();  // every rowmap entry is written (a block's global writes are visible to it after the barrier)
    for (int e = tid; e <= E; e += blockDim.x) {
        int t = tile_off[e];
        for (int c = 0; c < cnt[e]; c += bn, t++) {
            const int m = min(bn, cnt[e] - c);
            unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (i < m) w[i >> 1] |= ((unsigned)rowmap[off[e] + c + i] & 0xffffu) << (16 * (i & 1));
            trows[t] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// grid (N, ceil(H / 1024)) of 256 threads, 4 columns a thread (H % 4 == 0); the k + 1 rows' loads are issued
// together (16 at a time), then summed in slot order.
extern "C" __global__ void __launch_bounds__(256) moe_combine(const float* __restrict__ ybuf,
                                                              const int* __restrict__ pos,
                                                              const float* __restrict__ wts, int k, int H,
                                                              float* __restrict__ x) {
    constexpr int SLOTS = 16;
    pdl_wait();
    const int n = blockIdx.x, c = 4 * (blockIdx.y * blockDim.x + threadIdx.x);
    if (c >= H) return;
    const int* pn = pos + (long)n * (k + 1);
    const float* wn = wts + (long)n * (k + 1);
    float4 acc = *reinterpret_cast<const float4*>(x + (long)n * H + c);
    for (int s0 = 0; s0 <= k; s0 += SLOTS) {
        float4 v[SLOTS];
        float wv[SLOTS];
#pragma unroll
        for (int j = 0; j < SLOTS; j++)
            if (s0 + j <= k) {
                wv[j] = wn[s0 + j];
                v[j] = *reinterpret_cast<const float4*>(ybuf + (long)pn[s0 + j] * H + c);
            }
#pragma unroll
        for (int j = 0; j < SLOTS; j++)
            if (s0 + j <= k) {
                acc.x = fmaf(wv[j], v[j].x, acc.x);
                acc.y = fmaf(wv[j], v[j].y, acc.y);
                acc.z = fmaf(wv[j], v[j].z, acc.z);
                acc.w = fmaf(wv[j], v[j].w, acc.w);
            }
    }
    *reinterpret_cast<float4*>(x + (long)n * H + c) = acc;
}

// k + 1 <= COMBINE_SLOTS (host): the slots' positions and weights staged in shared memory before the wait
#define COMBINE_SLOTS 64

// moe_combine, then rmsnorm_rows of the new rows (the next layer's input norm, or the final norm) in one launch: one
// block of 256 threads per row (H <= 256 NJ), columns c = tid + 256 j as in rmsnorm_rows. Each column's sum is
// moe_combine's (the residual, then fmaf(weight, expert row, acc) slot by slot) and the norm's sums rmsnorm_rows',
// so x, xb and xn come out the same bit for bit as the two kernels' (a launch and a dependency wait less a layer).
// The k + 1 slots' loads go CH at a time.
template <int NJ>
__device__ __forceinline__ void moe_combine_norm_body(const float* __restrict__ ybuf, const int* __restrict__ pos,
                                                      const float* __restrict__ wts, int k, int H,
                                                      float* __restrict__ x, const float* __restrict__ gain,
                                                      float eps, __nv_bfloat16* __restrict__ xb,
                                                      float* __restrict__ xn) {
    constexpr int CH = 72 / NJ;
    __shared__ float red[32];
    float g[NJ];  // a weight: loaded before the dependency wait
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int c = threadIdx.x + 256 * j;
        g[j] = c < H ? gain[c] : 0.f;
    }
    // the row's slots (pos, wts: moe_align's and the top-k's, three launches back) and its residual x (last written
    // by the mixer's output projection, before the router) are read before the dependency wait; only ybuf, the
    // experts' rows from moe_down, after it
    __shared__ int spos[COMBINE_SLOTS];
    __shared__ float swts[COMBINE_SLOTS];
    const int n = blockIdx.x;
    const int* pn = pos + (long)n * (k + 1);
    const float* wn = wts + (long)n * (k + 1);
    float* xr = x + (long)n * H;
    for (int i = threadIdx.x; i <= k; i += blockDim.x) {
        spos[i] = pn[i];
        swts[i] = wn[i];
    }
    float v[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int c = threadIdx.x + 256 * j;
        v[j] = c < H ? xr[c] : 0.f;
    }
    __syncthreads();
    pdl_wait();
    for (int s0 = 0; s0 <= k; s0 += CH) {
        float e[CH][NJ], wv[CH];
#pragma unroll
        for (int q = 0; q < CH; q++) {
            wv[q] = 0.f;
            if (s0 + q <= k) {
                wv[q] = swts[s0 + q];
                const float* yr = ybuf + (long)spos[s0 + q] * H;
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    const int c = threadIdx.x + 256 * j;
                    e[q][j] = c < H ? yr[c] : 0.f;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < CH; q++)
            if (s0 + q <= k)
#pragma unroll
                for (int j = 0; j < NJ; j++) v[j] = fmaf(wv[q], e[q][j], v[j]);
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int c = threadIdx.x + 256 * j;
        if (c < H) xr[c] = v[j];
        ss += v[j] * v[j];
    }
    const float r = rsqrtf(block_sum(ss, red) / H + eps);
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int c = threadIdx.x + 256 * j;
        if (c < H) {
            const float y = v[j] * r * g[j];
            xb[(long)n * H + c] = __float2bfloat16(y);
            if (xn) xn[(long)n * H + c] = y;
        }
    }
}

#define MOE_COMBINE_NORM(NJ)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) moe_combine_norm_j##NJ(                                     \
        const float* ybuf, const int* pos, const float* wts, int k, int H, float* x, const float* gain, float eps, \
        __nv_bfloat16* xb, float* xn) {                                                                           \
        KTRACE(63);                                                                                              \
        moe_combine_norm_body<NJ>(ybuf, pos, wts, k, H, x, gain, eps, xb, xn);                                     \
    }
MOE_COMBINE_NORM(8)
MOE_COMBINE_NORM(16)

// ---- Gated DeltaNet

__device__ __forceinline__ float softplus_p(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// the pre-conv input of channel ch at absolute position p (p < pos0: the ring; p < 0: zero)
__device__ __forceinline__ float conv_in(const float* proj, int ldp, const float* ring, int conv_dim, int K, int pos0,
                                         int p, int ch) {
    if (p >= pos0) return proj[(long)(p - pos0) * ldp + ch];
    if (p < 0) return 0.f;
    return ring[(p % K) * conv_dim + ch];
}

// Grid N (rows), 256 threads; row n's ring is rings[its sequence].
extern "C" __global__ void __launch_bounds__(256) gdn_prep(const float* __restrict__ proj, int ldp,
                                                           const unsigned long long* __restrict__ rings,
                                                           const float* __restrict__ conv_w,
                                                           const float* __restrict__ a_log,
                                                           const float* __restrict__ dt_bias, int Hk, int Hv, int dk,
                                                           int dv, int K, const int* __restrict__ segs, int nseg,
                                                           float* __restrict__ qkv, float* __restrict__ beta,
                                                           float* __restrict__ gl) {
    pdl_wait();
    const int n = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int si = seg_find(segs, nseg, n, 0);
    const Seg sg = seg_at(segs, si);
    const float* ring = reinterpret_cast<const float*>(rings[si]);
    const float* sproj = proj + (long)sg.r0 * ldp;  // the sequence's first row
    const int pos0 = sg.pos0, p = pos0 + n - sg.r0;
    auto conv = [&](int ch) {
        float acc = 0.f;
        for (int j = 0; j < K; j++)
            acc = fmaf(conv_w[ch * K + j], conv_in(sproj, ldp, ring, conv_dim, K, pos0, p - (K - 1) + j, ch), acc);
        return silu_f(acc);
    };
    float* out = qkv + (long)n * conv_dim;
    // q heads 0..Hk-1 then k heads: channel base i*dk; one warp per head, <= 4 channels per lane
    for (int hh = warp; hh < 2 * Hk; hh += blockDim.x >> 5) {
        float v[4];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = lane + 32 * j;
            v[j] = c < dk ? conv(hh * dk + c) : 0.f;
            ss += v[j] * v[j];
        }
        ss = warp_sum(ss);
        float sc = 1.f / sqrtf(ss + 1e-6f);
        if (hh < Hk) sc *= 1.f / sqrtf((float)dk);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int c = lane + 32 * j;
            if (c < dk) out[hh * dk + c] = v[j] * sc;
        }
    }
    for (int c = tid; c < Vd; c += blockDim.x) out[2 * Kd + c] = conv(2 * Kd + c);
    if (tid < Hv) {
        const float* row = proj + (long)n * ldp;
        const float b = row[conv_dim + Vd + tid], a = row[conv_dim + Vd + Hv + tid];
        beta[(long)n * Hv + tid] = 1.f / (1.f + expf(-b));
        gl[(long)n * Hv + tid] = -expf(a_log[tid]) * softplus_p(a + dt_bias[tid]);
    }
}

#define GC 64  // chunk length

// 16-byte async copy of `n4` float4s from global `src` (row-major, `ld` floats per row) rows r0.. into shared `dst`
// (row stride `lds` floats), rows >= nrows zero-filled. All threads of the block take part.
__device__ __forceinline__ void copy_rows(float* dst, int lds, const float* src, long ld, int rows, int nrows, int n4) {
    for (int i = threadIdx.x; i < rows * n4; i += blockDim.x) {
        const int r = i / n4, c = i % n4;
        const bool ok = r < nrows;
        cp_async16(dst + r * lds + 4 * c, ok ? (const void*)(src + r * ld + 4 * c) : (const void*)src, ok ? 16 : 0);
    }
}

// Phase 1. Grid (chunks of the pass, Hv), 256 threads; dk, dv <= 128, dk + dv <= 256, dk % 8 == 0, dv % 4 == 0.
// The Gram products K K^T and Q K^T on tensor cores (3xTF32: ~f32), warp w's tiles rows 16(w%4).., columns
// 32(w/4).. (those wholly above the diagonal skipped); the substitution in f32, one column per thread, its
// right-hand side loaded straight into registers (V from global, e^G K from shared).
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep(const float* __restrict__ qkv,
                                                                 const float* __restrict__ beta,
                                                                 const float* __restrict__ gl,
                                                                 const int* __restrict__ segs, int nseg, int Hk,
                                                                 int Hv, int dk, int dv, float* __restrict__ Ug,
                                                                 float* __restrict__ Wg, float* __restrict__ Pg,
                                                                 float* __restrict__ Gg) {
    extern __shared__ __align__(16) float sm[];
    const int ldk = dk + 4, lda = GC + 4, ncol = dk + dv;
    float* Ks = sm;             // [64][dk+4]
    float* Qs = Ks + GC * ldk;  // [64][dk+4], then (after the Gram products) A [64][68]
    float* As = Qs;
    __shared__ float Gs[GC], Bs[GC];
    pdl_wait();
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const Seg sg = seg_at(segs, seg_find(segs, nseg, c, 3));
    const int t0 = sg.r0 + (c - sg.c0) * GC, L = min(GC, sg.r0 + sg.k - t0);
    const float* rows = qkv + (long)t0 * conv_dim;
    copy_rows(Qs, ldk, rows + kh * dk, conv_dim, GC, L, dk / 4);
    copy_rows(Ks, ldk, rows + Kd + kh * dk, conv_dim, GC, L, dk / 4);
    cp_async_commit();
    if (tid < GC) {
        const bool ok = tid < L;
        Bs[tid] = ok ? beta[(long)(t0 + tid) * Hv + h] : 0.f;
        Gs[tid] = ok ? gl[(long)(t0 + tid) * Hv + h] : 0.f;
    }
    __syncthreads();
    if (tid < 32) {  // inclusive cumsum of the 64 log-decays: two per lane, then a warp scan
        const float a = Gs[2 * tid], b = a + Gs[2 * tid + 1];
        float v = b;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(FULL_MASK, v, o);
            if (tid >= o) v += u;
        }
        Gs[2 * tid] = v - b + a;
        Gs[2 * tid + 1] = v;
    }
    cp_async_wait<0>();
    __syncthreads();
    const long cb = (long)c * Hv + h;  // chunk-head index
    if (tid < GC) Gg[cb * GC + tid] = Gs[tid];
    // A[i,j] = beta_i e^{G_i-G_j} k_i.k_j (j < i) and P[i,j] = e^{G_i-G_j} q_i.k_j (j <= i)
    const int mt = w & 3, n0 = 32 * (w >> 2);
    const bool live = n0 <= 16 * mt + 15;  // any of the warp's columns on or below the diagonal
    float a[4][4] = {}, p[4][4] = {};
    if (live) {
        const int ar = (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * ldk + 4 * (lane >> 4);
        const int br = (n0 + 8 * (lane >> 4) + (lane & 7)) * ldk + 4 * ((lane >> 3) & 1);
        for (int k0 = 0; k0 < dk; k0 += 8) {
            uint32_t kr[4], qr[4], b[4], b2[4];
            ldsm_x4(kr, Ks + ar + k0);
            ldsm_x4(qr, Qs + ar + k0);
            ldsm_x4(b, Ks + br + k0);
            ldsm_x4(b2, Ks + br + 16 * ldk + k0);
            const Tf32A fk = tf32_a(kr), fq = tf32_a(qr);
            const uint32_t bb[4][2] = {{b[0], b[1]}, {b[2], b[3]}, {b2[0], b2[1]}, {b2[2], b2[3]}};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                mma_3xtf32(a[j], fk, bb[j][0], bb[j][1]);
                mma_3xtf32(p[j], fq, bb[j][0], bb[j][1]);
            }
        }
    }
    __syncthreads();  // Q read: its space becomes A
    if (live) {
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int i = 16 * mt + g + 8 * hf, jc = n0 + 8 * j + 2 * t4;
                float av[2], pv[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int jj = jc + e;
                    const float dec = jj <= i ? expf(Gs[i] - Gs[jj]) : 0.f;
                    av[e] = jj < i ? Bs[i] * dec * a[j][2 * hf + e] : 0.f;
                    pv[e] = p[j][2 * hf + e] * dec;
                }
                *reinterpret_cast<float2*>(As + i * lda + jc) = make_float2(av[0], av[1]);
                *reinterpret_cast<float2*>(Pg + cb * GC * GC + i * GC + jc) = make_float2(pv[0], pv[1]);
            }
    }
    // the right-hand sides, one column per thread, in registers: columns < dv are beta v, the rest beta e^G k
    const int col = tid;
    float x[GC];
    if (col < dv) {
        const float* vc = rows + 2 * Kd + h * dv + col;
#pragma unroll
        for (int i = 0; i < GC; i++) x[i] = i < L ? Bs[i] * vc[(long)i * conv_dim] : 0.f;
    } else if (col < ncol) {
#pragma unroll
        for (int i = 0; i < GC; i++) x[i] = Bs[i] * expf(Gs[i]) * Ks[i * ldk + col - dv];
    }
    __syncthreads();  // A written
    // forward substitution (I + A) X = RHS; each thread owns its column, held in registers (the loops unrolled: every
    // index is a constant), four partial sums per row (j mod 4, the remainder into the first), A's row read 4 at a time
    if (col < ncol) {
#pragma unroll
        for (int i = 1; i < GC; i++) {
            const float* ai = As + i * lda;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
            for (int j = 0; j + 4 <= i; j += 4) {
                const float4 av = *reinterpret_cast<const float4*>(ai + j);
                s0 = fmaf(av.x, x[j], s0);
                s1 = fmaf(av.y, x[j + 1], s1);
                s2 = fmaf(av.z, x[j + 2], s2);
                s3 = fmaf(av.w, x[j + 3], s3);
            }
#pragma unroll
            for (int j = i & ~3; j < i; j++) s0 = fmaf(ai[j], x[j], s0);
            x[i] -= (s0 + s1) + (s2 + s3);
        }
        if (col < dv) {
            float* U = Ug + cb * GC * dv + col;
#pragma unroll
            for (int i = 0; i < GC; i++) U[i * dv] = x[i];
        } else {
            float* W = Wg + cb * GC * dk + (col - dv);
#pragma unroll
            for (int i = 0; i < GC; i++) W[i * dk] = x[i];
        }
    }
}

#define GS_C 32  // state columns per block of the scan
// Phase 2a: a sequence's state through its chunks in order, on tensor cores (3xTF32: ~f32 products, f32 sums; the
// state itself never leaves f32 registers). Grid (Hv, ceil(dv / 32), sequences), 256 threads (8 warps); states[s]
// = sequence s's state [Hv, dk, dv]; dk <= 128, dk % 8 == 0, dv % 8 == 0. The block holds S^T (its 32 columns x
// dk) as mma accumulators: warp w owns key dims 16w..16w+15. Per chunk:
//   Sc[c] <- S (the chunk's starting state, for gdn_chunk_out, as S^T: [c, h, dv, dk]);
//   D = U - W S (warp w: tokens 16(w%4).., columns 16(w/4)..; written over U, [c, h, 64, dv]);
//   S^T <- e^{G_last} S^T + (diag(e^{G_last - G}) D)^T K.
// The next chunk's W, K, U, G arrive by cp.async while this one computes (two buffers).
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_state(const float* __restrict__ qkv,
                                                                  float* __restrict__ Ug,
                                                                  const float* __restrict__ Wg,
                                                                  const float* __restrict__ Gg,
                                                                  const int* __restrict__ segs, int Hk, int Hv, int dk,
                                                                  int dv, float* __restrict__ Sc,
                                                                  const unsigned long long* __restrict__ states) {
    extern __shared__ __align__(16) float sm[];
    // row strides: W and S^T dk + 4 (ldmatrix rows on distinct banks), K dk + 8 (its B fragments are read one
    // float a lane: rows t..t+3 then fall 8 banks apart), U 40 (float2 reads by rows g, columns 2t), D'^T 68
    const int lw = dk + 4, lk = dk + 8, lu = 40, ld = GC + 4;
    const int buf_f = GC * lw + GC * lk + GC * lu + GC;  // floats of one buffer: W, K, U slice, G
    float* St = sm;                   // [32][dk+4]: S^T, this chunk's starting state
    float* Dt = St + GS_C * lw;       // [32][68]: (diag(kdec) D)^T
    float* bufs = Dt + GS_C * ld;     // 2 x {W [64][dk+4], K [64][dk+8], U [64][40], G [64]}
    __shared__ float kdec[GC];
    pdl_wait();
    const int h = blockIdx.x, j0 = blockIdx.y * GS_C, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const int nc = min(GS_C, dv - j0);
    const Seg sg = seg_at(segs, blockIdx.z);
    const int nchunks = (sg.k + GC - 1) / GC;  // chunk c of the sequence is chunk sg.c0 + c of the pass
    float* S = reinterpret_cast<float*>(states[blockIdx.z]) + (long)h * dk * dv;
    auto issue = [&](int c) {
        float* b = bufs + (c & 1) * buf_f;
        const long cb = (long)(sg.c0 + c) * Hv + h;
        const int t0 = sg.r0 + c * GC, L = min(GC, sg.k - c * GC);
        copy_rows(b, lw, Wg + cb * GC * dk, dk, GC, GC, dk / 4);
        copy_rows(b + GC * lw, lk, qkv + (long)t0 * conv_dim + Kd + kh * dk, conv_dim, GC, L, dk / 4);
        copy_rows(b + GC * (lw + lk), lu, Ug + cb * GC * dv + j0, dv, GC, GC, nc / 4);
        copy_rows(b + GC * (lw + lk + lu), GC, Gg + cb * GC, GC, 1, 1, GC / 4);
        cp_async_commit();
    };
    issue(0);
    // S^T accumulators: sa[m][j] = columns 16m + g (+8), key dims 16w + 8j + 2t4 (+1)
    const bool owner = 16 * w < dk;
    float sa[2][2][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = 16 * m + g + 8 * (e >> 1), r = 16 * w + 8 * j + 2 * t4 + (e & 1);
                sa[m][j][e] = owner && r < dk && col < nc ? S[(long)r * dv + j0 + col] : 0.f;
            }
    const int mt = w & 3, nt0 = 2 * (w >> 2);  // the D tile of warp w: tokens 16mt.., column n-tiles nt0, nt0 + 1
    for (int c = 0; c < nchunks; c++) {
        const long cb = (long)(sg.c0 + c) * Hv + h;
        if (c + 1 < nchunks) {
            issue(c + 1);  // into the other buffer: its last readers finished before the previous chunk's last barrier
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const float* Wb = bufs + (c & 1) * buf_f;
        const float* Kb = Wb + GC * lw;
        const float* Ub = Kb + GC * lk;
        const float* Gb = Ub + GC * lu;
        if (tid < GC) kdec[tid] = expf(Gb[GC - 1] - Gb[tid]);
        // S^T into shared memory (the B operand of W S) and out to Sc (the chunk's starting state)
        if (owner) {
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int r = 16 * w + 8 * j + 2 * t4;
                    if (r >= dk) continue;
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        const int col = 16 * m + g + 8 * hf;
                        const float2 v = make_float2(sa[m][j][2 * hf], sa[m][j][2 * hf + 1]);
                        *reinterpret_cast<float2*>(St + col * lw + r) = v;
                        if (col < nc) *reinterpret_cast<float2*>(Sc + (cb * dv + j0 + col) * dk + r) = v;
                    }
                }
        }
        __syncthreads();
        // D = U - W S: warp tile 16 tokens x 16 columns, k over dk
        {
            float acc[2][4] = {};
            const float* wa = Wb + (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * lw + 4 * (lane >> 4);
            const float* sb = St + (8 * (nt0 + (lane >> 4)) + (lane & 7)) * lw + 4 * ((lane >> 3) & 1);
            for (int k0 = 0; k0 < dk; k0 += 8) {
                uint32_t ar[4], br[4];
                ldsm_x4(ar, wa + k0);
                ldsm_x4(br, sb + k0);
                const Tf32A a = tf32_a(ar);
                mma_3xtf32(acc[0], a, br[0], br[1]);
                mma_3xtf32(acc[1], a, br[2], br[3]);
            }
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int col = 8 * (nt0 + j) + 2 * t4;
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int t = 16 * mt + g + 8 * hf;
                    const float2 u = *reinterpret_cast<const float2*>(Ub + t * lu + col);
                    const float d0 = u.x - acc[j][2 * hf], d1 = u.y - acc[j][2 * hf + 1];
                    const bool ok = col < nc;
                    if (ok) *reinterpret_cast<float2*>(Ug + cb * GC * dv + (long)t * dv + j0 + col) = make_float2(d0, d1);
                    Dt[col * ld + t] = ok ? kdec[t] * d0 : 0.f;
                    Dt[(col + 1) * ld + t] = ok ? kdec[t] * d1 : 0.f;
                }
            }
        }
        __syncthreads();
        // S^T <- e^{G_last} S^T + D'^T K: warp w's key dims, both 16-column halves, k over the chunk's tokens
        if (owner) {
            const float elast = expf(Gb[GC - 1]);
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) sa[m][j][e] *= elast;
            const bool two = 16 * w + 8 < dk;
            const float* da = Dt + ((lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 4 * (lane >> 4);
            const float* kb = Kb + t4 * lk + 16 * w + g;
#pragma unroll 2
            for (int k0 = 0; k0 < GC; k0 += 8) {
                uint32_t a0[4], a1[4];
                ldsm_x4(a0, da + k0);
                ldsm_x4(a1, da + 16 * ld + k0);
                const Tf32A f0 = tf32_a(a0), f1 = tf32_a(a1);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    if (j == 1 && !two) break;
                    const uint32_t b0 = __float_as_uint(kb[k0 * lk + 8 * j]);
                    const uint32_t b1 = __float_as_uint(kb[(k0 + 4) * lk + 8 * j]);
                    mma_3xtf32(sa[0][j], f0, b0, b1);
                    mma_3xtf32(sa[1][j], f1, b0, b1);
                }
            }
        }
        __syncthreads();  // D'^T, kdec and this buffer may be rewritten
    }
    if (owner) {
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = 16 * m + g + 8 * (e >> 1), r = 16 * w + 8 * j + 2 * t4 + (e & 1);
                    if (r < dk && col < nc) S[(long)r * dv + j0 + col] = sa[m][j][e];
                }
    }
}

#define GO_C 64  // output columns per block of gdn_chunk_out
// Phase 2b: outputs, every (chunk, value head, 64-column slice) in parallel, on tensor cores (tf32 operands rounded
// to nearest, f32 sums): O = diag(e^G) Q Sc + P D. Grid (chunks of the pass, Hv, ceil(dv / 64)), 256 threads: warp w
// computes tokens 16(w%4).. x columns 32(w/4)..; dk <= 128, dv <= 128, both % 8 == 0.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_out(const float* __restrict__ qkv,
                                                                const float* __restrict__ Dg,
                                                                const float* __restrict__ Pg,
                                                                const float* __restrict__ Gg,
                                                                const float* __restrict__ Sc,
                                                                const int* __restrict__ segs, int nseg, int Hk, int Hv,
                                                                int dk, int dv, float* __restrict__ o) {
    extern __shared__ __align__(16) float sm[];
    const int lq = dk + 4, lp = GC + 4, ldd = GO_C + 8;
    float* Qs = sm;                 // [64][dk+4]
    float* Ss = Qs + GC * lq;       // [64][dk+4]: the chunk's starting state, S^T rows j0..
    float* Ps = Ss + GO_C * lq;     // [64][68]
    float* Ds = Ps + GC * lp;       // [64][72]: D, columns j0.. (B fragments read one float a lane)
    __shared__ float Gs[GC];
    pdl_wait();
    const int c = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * GO_C, tid = threadIdx.x, lane = tid & 31;
    const int w = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk), nc = min(GO_C, dv - j0);
    const Seg sg = seg_at(segs, seg_find(segs, nseg, c, 3));
    const int t0 = sg.r0 + (c - sg.c0) * GC, L = min(GC, sg.r0 + sg.k - t0);
    const long cb = (long)c * Hv + h;
    copy_rows(Qs, lq, qkv + (long)t0 * conv_dim + kh * dk, conv_dim, GC, L, dk / 4);
    copy_rows(Ss, lq, Sc + (cb * dv + j0) * dk, dk, GO_C, nc, dk / 4);
    copy_rows(Ps, lp, Pg + cb * GC * GC, GC, GC, GC, GC / 4);
    copy_rows(Ds, ldd, Dg + cb * GC * dv + j0, dv, GC, GC, nc / 4);
    cp_async_commit();
    if (tid < GC) Gs[tid] = Gg[cb * GC + tid];
    cp_async_wait<0>();
    __syncthreads();
    const int mt = w & 3, n0 = 32 * (w >> 2);  // tokens 16mt.., columns n0.. (four n-tiles)
    if (n0 >= nc) return;
    float acc[4][4] = {};
    {
        const float* qa = Qs + (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * lq + 4 * (lane >> 4);
        const float* sb = Ss + (n0 + 8 * (lane >> 4) + (lane & 7)) * lq + 4 * ((lane >> 3) & 1);
        for (int k0 = 0; k0 < dk; k0 += 8) {
            uint32_t a[4], b[4], b2[4];
            ldsm_x4(a, qa + k0);
            ldsm_x4(b, sb + k0);
            ldsm_x4(b2, sb + 16 * lq + k0);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                a[i] = tf32(__uint_as_float(a[i]));
                b[i] = tf32(__uint_as_float(b[i]));
                b2[i] = tf32(__uint_as_float(b2[i]));
            }
            mma_tf32(acc[0], a, b[0], b[1]);
            mma_tf32(acc[1], a, b[2], b[3]);
            mma_tf32(acc[2], a, b2[0], b2[1]);
            mma_tf32(acc[3], a, b2[2], b2[3]);
        }
    }
    const float e0 = expf(Gs[16 * mt + g]), e1 = expf(Gs[16 * mt + g + 8]);
#pragma unroll
    for (int j = 0; j < 4; j++) acc[j][0] *= e0, acc[j][1] *= e0, acc[j][2] *= e1, acc[j][3] *= e1;
    // + P D over s < 16(mt + 1) (P is zero above the diagonal)
    {
        const float* pa = Ps + (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * lp + 4 * (lane >> 4);
        const float* db = Ds + t4 * ldd + n0 + g;
        for (int k0 = 0; k0 < 16 * (mt + 1); k0 += 8) {
            uint32_t a[4];
            ldsm_x4(a, pa + k0);
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = tf32(__uint_as_float(a[i]));
#pragma unroll
            for (int j = 0; j < 4; j++)
                mma_tf32(acc[j], a, tf32(db[k0 * ldd + 8 * j]), tf32(db[(k0 + 4) * ldd + 8 * j]));
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int col = n0 + 8 * j + 2 * t4;
        if (col >= nc) continue;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int t = 16 * mt + g + 8 * hf;
            if (t < L)
                *reinterpret_cast<float2*>(o + (long)(t0 + t) * Hv * dv + h * dv + j0 + col) =
                    make_float2(acc[j][2 * hf], acc[j][2 * hf + 1]);
        }
    }
}

// One warp per (token, value head); dv <= 128.
extern "C" __global__ void __launch_bounds__(256) gdn_gated_norm(const float* __restrict__ o,
                                                                 const float* __restrict__ proj, int ldp, int N,
                                                                 int Hv, int dv, int zoff,
                                                                 const float* __restrict__ norm, float eps,
                                                                 __nv_bfloat16* __restrict__ out) {
    pdl_wait();
    const int wid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (wid >= N * Hv) return;
    const int n = wid / Hv, h = wid % Hv;
    const float* orow = o + (long)n * Hv * dv + h * dv;
    const float* z = proj + (long)n * ldp + zoff + h * dv;
    float v[4], ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int c = lane + 32 * j;
        v[j] = c < dv ? orow[c] : 0.f;
        ss += v[j] * v[j];
    }
    const float r = 1.f / sqrtf(warp_sum(ss) / dv + eps);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int c = lane + 32 * j;
        if (c < dv) out[(long)n * Hv * dv + h * dv + c] = __float2bfloat16(v[j] * r * norm[c] * silu_f(z[c]));
    }
}

// Grid (any, sequences): blockIdx.y's sequence, grid-stride over its last min(rows, K) rows.
extern "C" __global__ void gdn_ring(const float* __restrict__ proj, int ldp, int conv_dim, int K,
                                    const int* __restrict__ segs, const unsigned long long* __restrict__ rings) {
    pdl_wait();
    const Seg sg = seg_at(segs, blockIdx.y);
    float* ring = reinterpret_cast<float*>(rings[blockIdx.y]);
    const int N = sg.k, first = max(0, N - K);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (N - first) * conv_dim; i += gridDim.x * blockDim.x) {
        const int n = first + i / conv_dim, ch = i % conv_dim;
        ring[((sg.pos0 + n) % K) * conv_dim + ch] = proj[(long)(sg.r0 + n) * ldp + ch];
    }
}

// ---- attention

// Grid (N rows, nh + nkv), hd threads; row n's caches are kcs / vcs[its sequence].
extern "C" __global__ void attn_prep_rows(const float* __restrict__ proj, int ldp, const float* __restrict__ qn,
                                          const float* __restrict__ kn, const int* __restrict__ segs, int nseg, int nh,
                                          int nkv, int hd, int rd, float theta, float eps,
                                          __nv_bfloat16* __restrict__ qout, const unsigned long long* __restrict__ kcs,
                                          const unsigned long long* __restrict__ vcs) {
    __shared__ float red[32];
    __shared__ float xs[256];
    pdl_wait();
    const int n = blockIdx.x, bh = blockIdx.y, d = threadIdx.x;
    const bool is_q = bh < nh;
    const int kvh = bh - nh;
    const float* row = proj + (long)n * ldp;
    const float gd = (is_q ? qn : kn)[d];
    const int si = seg_find(segs, nseg, n, 0);
    const Seg sg = seg_at(segs, si);
    const int pos = sg.pos0 + n - sg.r0;
    const float x = is_q ? row[bh * 2 * hd + d] : row[nh * 2 * hd + kvh * hd + d];
    const float ss = block_sum(d < hd ? x * x : 0.f, red);
    float y = x * rsqrtf(ss / hd + eps) * gd;
    xs[d] = y;
    __syncthreads();
    const int half = rd / 2;
    if (d < rd) {
        const int i = d < half ? d : d - half;
        const float inv = 1.f / powf(theta, (float)(2 * i) / (float)rd);
        const float ang = inv * (float)pos;
        const float c = cosf(ang), s = sinf(ang);
        y = d < half ? xs[d] * c - xs[d + half] * s : xs[d] * c + xs[d - half] * s;
    }
    if (is_q) {
        qout[((long)n * nh + bh) * hd + d] = __float2bfloat16(y);
    } else {
        const long r = ((long)pos * nkv + kvh) * hd + d;
        reinterpret_cast<__nv_bfloat16*>(kcs[si])[r] = __float2bfloat16(y);
        reinterpret_cast<__nv_bfloat16*>(vcs[si])[r] = __float2bfloat16(row[nh * 2 * hd + nkv * hd + kvh * hd + d]);
    }
}
