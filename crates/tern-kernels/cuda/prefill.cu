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
// gdn_chunk_state phase 2a (sequential over a sequence's chunks), per (value head, 32-column slice, sequence),
//                 state slice S [dk,32] f32 in
//                 shared memory, the next chunk's operands double-buffered: Sc[c] = S; D = U - W S (over U);
//                 S <- e^{G_last} S + (diag(e^{G_last - G}) K)^T D. FLOPs per chunk-slice 2*64*32*2dk.
// gdn_chunk_out   phase 2b (every chunk and head in parallel): o = diag(e^G) Q Sc + P D -> o [N, Hv, dv] f32.
//                 FLOPs per chunk-head 2*64*dv*(dk + 32).
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

// Phase 1. Grid (chunks of the pass, Hv), 256 threads; dk, dv <= 128, dk + dv <= 256, both % 4 == 0.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep(const float* __restrict__ qkv,
                                                                 const float* __restrict__ beta,
                                                                 const float* __restrict__ gl,
                                                                 const int* __restrict__ segs, int nseg, int Hk,
                                                                 int Hv, int dk, int dv, float* __restrict__ Ug,
                                                                 float* __restrict__ Wg, float* __restrict__ Pg,
                                                                 float* __restrict__ Gg) {
    extern __shared__ __align__(16) float sm[];
    const int ldk = dk + 4, ncol = dk + dv;
    float* Ks = sm;                  // [64][dk+4]
    float* Qs = Ks + GC * ldk;       // [64][dk+4]
    float* Xs = Qs + GC * ldk;       // [64][dv+dk]: V, then the right-hand sides, then the solution
    float* As = Xs + GC * ncol;      // [64][68] (rows 16-byte aligned: float4 reads)
    __shared__ float Gs[GC], Bs[GC];
    pdl_wait();
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const Seg sg = seg_at(segs, seg_find(segs, nseg, c, 3));
    const int t0 = sg.r0 + (c - sg.c0) * GC, L = min(GC, sg.r0 + sg.k - t0);
    const float* rows = qkv + (long)t0 * conv_dim;
    copy_rows(Qs, ldk, rows + kh * dk, conv_dim, GC, L, dk / 4);
    copy_rows(Ks, ldk, rows + Kd + kh * dk, conv_dim, GC, L, dk / 4);
    copy_rows(Xs, ncol, rows + 2 * Kd + h * dv, conv_dim, GC, L, dv / 4);
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
    // A[i,j] = beta_i e^{G_i-G_j} k_i.k_j (j < i) and P[i,j] = e^{G_i-G_j} q_i.k_j (j <= i): 4x4 per thread
    {
        const int ti = tid >> 4, tj = tid & 15;
        float a[4][4] = {}, p[4][4] = {};
        for (int d = 0; d < dk; d += 4) {
            float4 ki[4], qi[4], kj[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                ki[r] = *reinterpret_cast<const float4*>(Ks + (4 * ti + r) * ldk + d);
                qi[r] = *reinterpret_cast<const float4*>(Qs + (4 * ti + r) * ldk + d);
                kj[r] = *reinterpret_cast<const float4*>(Ks + (4 * tj + r) * ldk + d);
            }
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    a[r][q] += ki[r].x * kj[q].x + ki[r].y * kj[q].y + ki[r].z * kj[q].z + ki[r].w * kj[q].w;
                    p[r][q] += qi[r].x * kj[q].x + qi[r].y * kj[q].y + qi[r].z * kj[q].z + qi[r].w * kj[q].w;
                }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int i = 4 * ti + r;
            float pv[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int j = 4 * tj + q;
                const float dec = j <= i ? expf(Gs[i] - Gs[j]) : 0.f;
                As[i * (GC + 4) + j] = j < i ? Bs[i] * dec * a[r][q] : 0.f;
                pv[q] = p[r][q] * dec;
            }
            *reinterpret_cast<float4*>(Pg + cb * GC * GC + i * GC + 4 * tj) = make_float4(pv[0], pv[1], pv[2], pv[3]);
        }
    }
    // right-hand sides, one column per thread: columns < dv are beta v (V already there), the rest beta e^G k
    const int col = tid;
    if (col < ncol) {
        for (int i = 0; i < GC; i++) {
            float* x = Xs + i * ncol + col;
            *x = col < dv ? Bs[i] * *x : Bs[i] * expf(Gs[i]) * Ks[i * ldk + col - dv];
        }
    }
    __syncthreads();
    // forward substitution (I + A) X = RHS; each thread owns its column, held in registers (the loops unrolled: every
    // index is a constant), four partial sums per row (j mod 4, the remainder into the first), A's row read 4 at a time
    if (col < ncol) {
        const float* xc = Xs + col;
        float x[GC];
#pragma unroll
        for (int i = 0; i < GC; i++) x[i] = xc[i * ncol];
#pragma unroll
        for (int i = 1; i < GC; i++) {
            const float* ai = As + i * (GC + 4);
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
            for (int j = 0; j + 4 <= i; j += 4) {
                const float4 a = *reinterpret_cast<const float4*>(ai + j);
                s0 = fmaf(a.x, x[j], s0);
                s1 = fmaf(a.y, x[j + 1], s1);
                s2 = fmaf(a.z, x[j + 2], s2);
                s3 = fmaf(a.w, x[j + 3], s3);
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
// Phase 2a: a sequence's state through its chunks in order. Grid (Hv, ceil(dv / 32), sequences), 256 threads;
// states[s] = sequence s's state [Hv, dk, dv]; dk <= 128, dk % 4 == 0,
// dv % 4 == 0. Per chunk: Sc[c] <- S (the chunk's starting state, for gdn_chunk_out); D = U - W S (written over
// U); S <- e^{G_last} S + (diag(e^{G_last - G}) K)^T D. The next chunk's W, K, U, G arrive by cp.async while
// this one computes (two buffers).
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_state(const float* __restrict__ qkv,
                                                                  float* __restrict__ Ug,
                                                                  const float* __restrict__ Wg,
                                                                  const float* __restrict__ Gg,
                                                                  const int* __restrict__ segs, int Hk, int Hv, int dk,
                                                                  int dv, float* __restrict__ Sc,
                                                                  const unsigned long long* __restrict__ states) {
    extern __shared__ __align__(16) float sm[];
    const int ldk = dk + 4;
    const int buf_f = 2 * GC * ldk + GC * GS_C + GC;  // floats of one buffer: W, K, U slice, G
    float* Ss = sm;                  // [dk][32]
    float* Ds = Ss + dk * GS_C;      // [64][32]
    float* bufs = Ds + GC * GS_C;    // 2 x {W [64][dk+4], K [64][dk+4], U [64][32], G [64]}
    __shared__ float kdec[GC];
    pdl_wait();
    const int h = blockIdx.x, j0 = blockIdx.y * GS_C, tid = threadIdx.x;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const int nc = min(GS_C, dv - j0);
    const Seg sg = seg_at(segs, blockIdx.z);
    const int nchunks = (sg.k + GC - 1) / GC;  // chunk c of the sequence is chunk sg.c0 + c of the pass
    float* S = reinterpret_cast<float*>(states[blockIdx.z]) + (long)h * dk * dv;
    auto issue = [&](int c) {
        float* b = bufs + (c & 1) * buf_f;
        const long cb = (long)(sg.c0 + c) * Hv + h;
        const int t0 = sg.r0 + c * GC, L = min(GC, sg.k - c * GC);
        copy_rows(b, ldk, Wg + cb * GC * dk, dk, GC, GC, dk / 4);
        copy_rows(b + GC * ldk, ldk, qkv + (long)t0 * conv_dim + Kd + kh * dk, conv_dim, GC, L, dk / 4);
        copy_rows(b + 2 * GC * ldk, GS_C, Ug + cb * GC * dv + j0, dv, GC, GC, nc / 4);
        copy_rows(b + 2 * GC * ldk + GC * GS_C, GC, Gg + cb * GC, GC, 1, 1, GC / 4);
        cp_async_commit();
    };
    issue(0);
    for (int i = tid; i < dk * GS_C; i += blockDim.x) {
        const int r = i / GS_C, j = i % GS_C;
        Ss[i] = j < nc ? S[r * dv + j0 + j] : 0.f;
    }
    const int rg = tid >> 3, cg = tid & 7;
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
        const float* Kb = Wb + GC * ldk;
        const float* Ub = Kb + GC * ldk;
        const float* Gb = Ub + GC * GS_C;
        if (tid < GC) kdec[tid] = expf(Gb[GC - 1] - Gb[tid]);
        // the chunk's starting state, for the output kernel
        for (int i = tid; i < dk * GS_C / 4; i += blockDim.x) {
            const int r = i / (GS_C / 4), j = 4 * (i % (GS_C / 4));
            if (j < nc)
                *reinterpret_cast<float4*>(Sc + (cb * dk + r) * dv + j0 + j) = *reinterpret_cast<const float4*>(Ss + r * GS_C + j);
        }
        // D = U - W S: rows 2rg, 2rg+1, columns 4cg..4cg+3
        {
            float acc[2][4] = {};
            for (int d = 0; d < dk; d += 4) {
                const float4 w0 = *reinterpret_cast<const float4*>(Wb + (2 * rg) * ldk + d);
                const float4 w1 = *reinterpret_cast<const float4*>(Wb + (2 * rg + 1) * ldk + d);
                const float wa[2][4] = {{w0.x, w0.y, w0.z, w0.w}, {w1.x, w1.y, w1.z, w1.w}};
#pragma unroll
                for (int dd = 0; dd < 4; dd++) {
                    const float4 sv = *reinterpret_cast<const float4*>(Ss + (d + dd) * GS_C + 4 * cg);
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        acc[r][0] = fmaf(wa[r][dd], sv.x, acc[r][0]);
                        acc[r][1] = fmaf(wa[r][dd], sv.y, acc[r][1]);
                        acc[r][2] = fmaf(wa[r][dd], sv.z, acc[r][2]);
                        acc[r][3] = fmaf(wa[r][dd], sv.w, acc[r][3]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int t = 2 * rg + r;
                const float4 u = *reinterpret_cast<const float4*>(Ub + t * GS_C + 4 * cg);
                const float4 dv4 = make_float4(u.x - acc[r][0], u.y - acc[r][1], u.z - acc[r][2], u.w - acc[r][3]);
                *reinterpret_cast<float4*>(Ds + t * GS_C + 4 * cg) = dv4;
                if (4 * cg < nc) *reinterpret_cast<float4*>(Ug + cb * GC * dv + t * dv + j0 + 4 * cg) = dv4;
            }
        }
        __syncthreads();
        // S <- e^{G_last} S + sum_t kdec_t k_t D_t^T: rows 4rb..4rb+3, columns 4cg..
        const float elast = expf(Gb[GC - 1]);
        for (int rb = rg; rb < dk / 4; rb += 32) {
            float sa[4][4] = {};
            for (int t = 0; t < GC; t++) {
                const float4 kv = *reinterpret_cast<const float4*>(Kb + t * ldk + 4 * rb);
                const float4 d4 = *reinterpret_cast<const float4*>(Ds + t * GS_C + 4 * cg);
                const float kd = kdec[t];
                const float ka[4] = {kv.x * kd, kv.y * kd, kv.z * kd, kv.w * kd};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    sa[i][0] = fmaf(ka[i], d4.x, sa[i][0]);
                    sa[i][1] = fmaf(ka[i], d4.y, sa[i][1]);
                    sa[i][2] = fmaf(ka[i], d4.z, sa[i][2]);
                    sa[i][3] = fmaf(ka[i], d4.w, sa[i][3]);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4* sp = reinterpret_cast<float4*>(Ss + (4 * rb + i) * GS_C + 4 * cg);
                float4 sv = *sp;
                sv.x = fmaf(elast, sv.x, sa[i][0]);
                sv.y = fmaf(elast, sv.y, sa[i][1]);
                sv.z = fmaf(elast, sv.z, sa[i][2]);
                sv.w = fmaf(elast, sv.w, sa[i][3]);
                *sp = sv;
            }
        }
        __syncthreads();  // S and D settled; this buffer may be refilled
    }
    for (int i = tid; i < dk * GS_C; i += blockDim.x) {
        const int r = i / GS_C, j = i % GS_C;
        if (j < nc) S[r * dv + j0 + j] = Ss[i];
    }
}

// Phase 2b: outputs, every (chunk, value head) in parallel: O = diag(e^G) Q Sc + P D. Grid (chunks of the pass, Hv), 256
// threads: 4 tokens x 8 columns each; dk <= 128, dv <= 128, both % 8 == 0 (dk % 4).
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_out(const float* __restrict__ qkv,
                                                                const float* __restrict__ Dg,
                                                                const float* __restrict__ Pg,
                                                                const float* __restrict__ Gg,
                                                                const float* __restrict__ Sc,
                                                                const int* __restrict__ segs, int nseg, int Hk, int Hv,
                                                                int dk, int dv, float* __restrict__ o) {
    extern __shared__ __align__(16) float sm[];
    const int ldk = dk + 4, ldv = dv + 4;
    float* Qs = sm;                 // [64][dk+4]
    float* Ss = Qs + GC * ldk;      // [dk][dv+4]
    float* Ds = Ss + dk * ldv;      // [64][dv+4]
    float* Ps = Ds + GC * ldv;      // [64][64]
    __shared__ float Gs[GC];
    pdl_wait();
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const Seg sg = seg_at(segs, seg_find(segs, nseg, c, 3));
    const int t0 = sg.r0 + (c - sg.c0) * GC, L = min(GC, sg.r0 + sg.k - t0);
    const long cb = (long)c * Hv + h;
    copy_rows(Qs, ldk, qkv + (long)t0 * conv_dim + kh * dk, conv_dim, GC, L, dk / 4);
    copy_rows(Ss, ldv, Sc + cb * dk * dv, dv, dk, dk, dv / 4);
    copy_rows(Ds, ldv, Dg + cb * GC * dv, dv, GC, GC, dv / 4);
    copy_rows(Ps, GC, Pg + cb * GC * GC, GC, GC, GC, GC / 4);
    cp_async_commit();
    if (tid < GC) Gs[tid] = Gg[cb * GC + tid];
    cp_async_wait<0>();
    __syncthreads();
    const int rg = tid >> 4, cg = tid & 15;  // tokens 4rg..4rg+3, columns 8cg..8cg+7
    if (8 * cg >= dv) return;
    float acc[4][8] = {};
    for (int d = 0; d < dk; d += 4) {
        float qa[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float4 q = *reinterpret_cast<const float4*>(Qs + (4 * rg + r) * ldk + d);
            qa[r][0] = q.x, qa[r][1] = q.y, qa[r][2] = q.z, qa[r][3] = q.w;
        }
#pragma unroll
        for (int dd = 0; dd < 4; dd++) {
            const float4 s0 = *reinterpret_cast<const float4*>(Ss + (d + dd) * ldv + 8 * cg);
            const float4 s1 = *reinterpret_cast<const float4*>(Ss + (d + dd) * ldv + 8 * cg + 4);
            const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[r][j] = fmaf(qa[r][dd], sv[j], acc[r][j]);
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const float eg = expf(Gs[4 * rg + r]);
#pragma unroll
        for (int j = 0; j < 8; j++) acc[r][j] *= eg;
    }
    // + P D over s <= t (P is zero above the diagonal)
    for (int s = 0; s < 4 * rg + 4; s++) {
        const float4 d0 = *reinterpret_cast<const float4*>(Ds + s * ldv + 8 * cg);
        const float4 d1 = *reinterpret_cast<const float4*>(Ds + s * ldv + 8 * cg + 4);
        const float dvv[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float pv = Ps[(4 * rg + r) * GC + s];
#pragma unroll
            for (int j = 0; j < 8; j++) acc[r][j] = fmaf(pv, dvv[j], acc[r][j]);
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int t = 4 * rg + r;
        if (t < L) {
            float* op = o + (long)(t0 + t) * Hv * dv + h * dv + 8 * cg;
            *reinterpret_cast<float4*>(op) = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            *reinterpret_cast<float4*>(op + 4) = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
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
