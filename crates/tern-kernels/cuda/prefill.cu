// Multi-token (prefill) kernels around the tensor-core GEMMs of gemm.cu and the flash attention of flash.cu: N
// tokens of one sequence, continuing from the state it holds (KV cache rows, GDN conv ring and f32 recurrent
// state, passed in as base pointers and the first position pos0). Activations are f32 [N, ...] row-major except
// GEMM inputs, which are bf16. All math in f32; precise expf/logf where the decode kernels' results must be met.
//
// embed_rows      x[n] = dequant(embed[ids[n]]) (4-bit). Grid N. Bytes N*H*(4 + 0.5).
// rmsnorm_rows    xb[n] = bf16(x[n] * rsqrt(mean(x[n]^2) + eps) * gain), and the f32 copy xn[n] when xn != 0.
//                 Grid N, 256 threads, H <= 4096. Bytes N*H*(4 + 2 (+4)).
// router_rows     logits[n, r] = sum_k W[r, k] xn[n, k], W 8-bit (or 4-bit) MLX affine, rows = E + 1 (router |
//                 shared-expert gate); f32 SIMT tile GEMM (64 tokens x 64 rows, k-steps of 64; the dequantised
//                 weight is exact s*q+b in f32, as the decode router computes it). FLOPs 2*N*(E+1)*H.
// topk_rows       one warp per token: softmax over E logits, top-k, renormalise (topk_warp, common.cuh); slot k
//                 = shared expert E with weight sigmoid(logit E). idx/wts [N, k+1].
// moe_align       one block: counts per expert, prefix offsets, the (token, slot) pairs sorted by expert (rowmap:
//                 pair -> token, pos: (token, slot) -> pair; within an expert in no particular order: GEMM rows
//                 are independent, so results do not depend on it), shared expert E = pairs N*k .. N*k+N-1 in
//                 token order, and the tile list of the grouped GEMMs (expert, first pair, count <= bn) with its
//                 length. Bytes ~ N*(k+1)*12.
// moe_combine     x[n] += sum_{s <= k} wts[n, s] * ybuf[pos[n, s]] (slot order: deterministic). Grid N.
// gdn_prep        per token: causal depthwise conv over q|k|v (K taps; inputs before pos0 from the ring, slot
//                 p % K holds position p), SiLU, l2-norm of q and k per key head (q also * dk^-1/2), beta =
//                 sigmoid(b), gl = -exp(A_log) * softplus(a + dt_bias) (the log of the decay). -> qkv [N,
//                 conv_dim] (same channel layout), beta/gl [N, Hv]. Grid N, 256 threads.
// gdn_chunk_prep  chunked delta rule, phase 1 (every chunk of 64 tokens and value head in parallel): G = cumsum gl,
//                 A[i,j] = beta_i e^{G_i-G_j} k_i.k_j (j < i), P[i,j] = e^{G_i-G_j} q_i.k_j (j <= i); solves
//                 (I + A) [U | W] = [diag(beta) V | diag(beta e^G) K] by forward substitution (one column per
//                 thread). -> U [c,h,64,dv], W [c,h,64,dk], P [c,h,64,64], G [c,h,64]. FLOPs ~ 64*64*(3dk+dv).
// gdn_chunk_scan  phase 2, per (value head, 32-column slice of the state), chunks in order, state slice S [dk,32]
//                 f32 in shared memory: D = U - W S; O = diag(e^G) Q S + P D; S <- e^{G_last} S + (diag(e^{G_last -
//                 G}) K)^T D. -> o [N, Hv, dv] f32, final state. FLOPs per chunk ~ 64*32*(3dk + 32).
// gdn_gated_norm  o * rsqrt(mean(o^2) + eps) * norm * silu(z) per (token, value head) -> bf16 [N, Hv*dv]. One warp
//                 per (token, head).
// gdn_ring        ring slot p % K <- the pre-conv input of position p for the last min(N, K) positions (after
//                 gdn_prep has read the old slots).
// attn_prep_rows  per (token, head): q = RMSNorm(q)*qn, k = RMSNorm(k)*kn, NeoX RoPE of the first rd dims at
//                 position pos0 + n (the decode kernel's arithmetic), q -> bf16 [N, nh, hd]; k, v -> bf16 cache
//                 rows pos0 + n. Grid (N, nh + nkv), hd threads.
#include "common.cuh"

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
    __shared__ float red[32];
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
            const float y = v[j] * r * gain[c];
            xb[(long)blockIdx.x * H + c] = __float2bfloat16(y);
            if (xn) xn[(long)blockIdx.x * H + c] = y;
        }
    }
}

// ---- router: f32 SIMT GEMM, 64 tokens x 64 rows per block, k-steps of 64, 256 threads (4 x 4 outputs each)
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
    const int per_word = 32 / bits, wpr = cols / per_word;
    const uint32_t mask = (1u << bits) - 1;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < cols; k0 += RT) {
        // x tile: 64 tokens x 64 k (16 per thread), transposed into xs[k][token]
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int i = tid + 256 * j, n = i / RT, k = i % RT;
            xs[k][n] = (n0 + n < N && k0 + k < cols) ? xn[(long)(n0 + n) * cols + k0 + k] : 0.f;
        }
        // weight tile: 64 rows x 64 k, dequantised exactly in f32
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const int i = tid + 256 * j, r = i / RT, k = i % RT;
            float v = 0.f;
            if (r0 + r < rows && k0 + k < cols) {
                const int c = k0 + k;
                const uint32_t word = w[(long)(r0 + r) * wpr + c / per_word];
                const long g = (long)(r0 + r) * (cols >> glog) + (c >> glog);
                v = bf(sc[g]) * (float)((word >> (bits * (c % per_word))) & mask) + bf(bi[g]);
            }
            ws[k][r] = v;
        }
        __syncthreads();
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
        __syncthreads();
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
    pdl_wait();
    const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    topk_warp(logits + (long)n * (E + 1), E, k, idx + (long)n * (k + 1), wts + (long)n * (k + 1));
}

// One block of 1024 threads. E + 1 <= 1024 experts (the shared one last).
extern "C" __global__ void __launch_bounds__(1024) moe_align(const int* __restrict__ idx, int N, int k, int E, int bn,
                                                             int* __restrict__ rowmap, int* __restrict__ pos,
                                                             int* __restrict__ ntile, int* __restrict__ tiles) {
    __shared__ int cnt[1024], off[1024], cur[1024];
    __shared__ int tile_off[1024];
    pdl_wait();
    const int tid = threadIdx.x;
    for (int e = tid; e <= E; e += blockDim.x) cnt[e] = e == E ? N : 0;
    __syncthreads();
    for (int i = tid; i < N * k; i += blockDim.x) {
        const int n = i / k, s = i % k;
        atomicAdd(&cnt[idx[n * (k + 1) + s]], 1);
    }
    __syncthreads();
    if (tid == 0) {
        int o = 0, t = 0;
        for (int e = 0; e <= E; e++) {
            off[e] = o;
            tile_off[e] = t;
            o += cnt[e];
            t += (cnt[e] + bn - 1) / bn;
        }
        *ntile = t;
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
}

extern "C" __global__ void __launch_bounds__(256) moe_combine(const float* __restrict__ ybuf,
                                                              const int* __restrict__ pos,
                                                              const float* __restrict__ wts, int k, int H,
                                                              float* __restrict__ x) {
    pdl_wait();
    const int n = blockIdx.x;
    const int* pn = pos + (long)n * (k + 1);
    const float* wn = wts + (long)n * (k + 1);
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
        float acc = x[(long)n * H + c];
        for (int s = 0; s <= k; s++) acc = fmaf(wn[s], ybuf[(long)pn[s] * H + c], acc);
        x[(long)n * H + c] = acc;
    }
}

// ---- Gated DeltaNet

__device__ __forceinline__ float softplus_p(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// the pre-conv input of channel ch at absolute position p (p < pos0: the ring; p < 0: zero)
__device__ __forceinline__ float conv_in(const float* proj, int ldp, const float* ring, int conv_dim, int K, int pos0,
                                         int p, int ch) {
    if (p >= pos0) return proj[(long)(p - pos0) * ldp + ch];
    if (p < 0) return 0.f;
    return ring[(p % K) * conv_dim + ch];
}

extern "C" __global__ void __launch_bounds__(256) gdn_prep(const float* __restrict__ proj, int ldp,
                                                           const float* __restrict__ ring,
                                                           const float* __restrict__ conv_w,
                                                           const float* __restrict__ a_log,
                                                           const float* __restrict__ dt_bias, int Hk, int Hv, int dk,
                                                           int dv, int K, int pos0, float* __restrict__ qkv,
                                                           float* __restrict__ beta, float* __restrict__ gl) {
    pdl_wait();
    const int n = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, Vd = Hv * dv;
    const int p = pos0 + n;
    auto conv = [&](int ch) {
        float acc = 0.f;
        for (int j = 0; j < K; j++)
            acc = fmaf(conv_w[ch * K + j], conv_in(proj, ldp, ring, conv_dim, K, pos0, p - (K - 1) + j, ch), acc);
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

// Phase 1. Grid (chunks, Hv), 256 threads; dk, dv <= 128 and dk + dv <= 256.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep(const float* __restrict__ qkv,
                                                                 const float* __restrict__ beta,
                                                                 const float* __restrict__ gl, int N, int Hk, int Hv,
                                                                 int dk, int dv, float* __restrict__ Ug,
                                                                 float* __restrict__ Wg, float* __restrict__ Pg,
                                                                 float* __restrict__ Gg) {
    extern __shared__ __align__(16) float sm[];
    const int ldk = dk + 1;
    float* Ks = sm;                // [64][dk+1]
    float* Qs = Ks + GC * ldk;     // [64][dk+1]
    float* As = Qs + GC * ldk;     // [64][65]
    float* Xs = As + GC * (GC + 1);  // [64][dk+dv] (solution, column per thread)
    __shared__ float Gs[GC], Bs[GC];
    pdl_wait();
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const int t0 = c * GC;
    for (int i = tid; i < GC * dk; i += blockDim.x) {
        const int r = i / dk, d = i % dk;
        const bool ok = t0 + r < N;
        const float* row = qkv + (long)(t0 + r) * conv_dim;
        Qs[r * ldk + d] = ok ? row[kh * dk + d] : 0.f;
        Ks[r * ldk + d] = ok ? row[Kd + kh * dk + d] : 0.f;
    }
    if (tid < GC) {
        const bool ok = t0 + tid < N;
        Bs[tid] = ok ? beta[(long)(t0 + tid) * Hv + h] : 0.f;
        Gs[tid] = ok ? gl[(long)(t0 + tid) * Hv + h] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        float s = 0.f;
        for (int i = 0; i < GC; i++) {
            s += Gs[i];
            Gs[i] = s;
        }
    }
    __syncthreads();
    const long cb = (long)c * Hv + h;  // chunk-head index
    if (tid < GC)
        Gg[cb * GC + tid] = Gs[tid];
    // A and P: thread (i = tid / 4, j = tid % 4 + 4 m)
    {
        const int i = tid >> 2, jb = tid & 3;
        float a[16], pp[16];
#pragma unroll
        for (int m = 0; m < 16; m++) a[m] = pp[m] = 0.f;
        for (int d = 0; d < dk; d++) {
            const float ki = Ks[i * ldk + d], qi = Qs[i * ldk + d];
#pragma unroll
            for (int m = 0; m < 16; m++) {
                const float kj = Ks[(jb + 4 * m) * ldk + d];
                a[m] = fmaf(ki, kj, a[m]);
                pp[m] = fmaf(qi, kj, pp[m]);
            }
        }
        float* P = Pg + cb * GC * GC + i * GC;
#pragma unroll
        for (int m = 0; m < 16; m++) {
            const int j = jb + 4 * m;
            const float dec = j <= i ? expf(Gs[i] - Gs[j]) : 0.f;
            As[i * (GC + 1) + j] = j < i ? Bs[i] * dec * a[m] : 0.f;
            P[j] = pp[m] * dec;
        }
    }
    __syncthreads();
    // forward substitution, one column per thread: columns 0..dv-1 are U (rhs beta v), dv.. are W (beta e^G k)
    const int col = tid;
    const int ncol = dk + dv;
    if (col < ncol) {
        const float* vsrc = qkv + 2 * Kd + h * dv + col;
        float* xc = Xs + col;
        for (int i = 0; i < GC; i++) {
            float r;
            if (col < dv)
                r = t0 + i < N ? Bs[i] * vsrc[(long)(t0 + i) * conv_dim] : 0.f;
            else
                r = Bs[i] * expf(Gs[i]) * Ks[i * ldk + (col - dv)];
            const float* ai = As + i * (GC + 1);
            for (int j = 0; j < i; j++) r = fmaf(-ai[j], xc[j * ncol], r);
            xc[i * ncol] = r;
        }
        if (col < dv) {
            float* U = Ug + cb * GC * dv + col;
            for (int i = 0; i < GC; i++) U[i * dv] = xc[i * ncol];
        } else {
            float* W = Wg + cb * GC * dk + (col - dv);
            for (int i = 0; i < GC; i++) W[i * dk] = xc[i * ncol];
        }
    }
}

#define GS_C 32  // state columns per block
// Phase 2. Grid (Hv, ceil(dv / 32)), 256 threads; dk <= 128, dk % 4 == 0.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan(const float* __restrict__ qkv,
                                                                 const float* __restrict__ Ug,
                                                                 const float* __restrict__ Wg,
                                                                 const float* __restrict__ Pg,
                                                                 const float* __restrict__ Gg, int N, int Hk, int Hv,
                                                                 int dk, int dv, float* __restrict__ state,
                                                                 float* __restrict__ o) {
    extern __shared__ __align__(16) float sm[];
    const int ldk = dk + 4;
    float* Ss = sm;                  // [dk][32]
    float* WQ = Ss + dk * GS_C;      // [128][dk+4]: rows 0..63 W, 64..127 Q
    float* Ks = WQ + 2 * GC * ldk;   // [64][dk+4]
    float* Ps = Ks + GC * ldk;       // [64][64]
    float* Us = Ps + GC * GC;        // [64][32]
    float* Ds = Us + GC * GS_C;      // [64][32]
    __shared__ float Gs[GC], kdec[GC];
    pdl_wait();
    const int h = blockIdx.x, j0 = blockIdx.y * GS_C, tid = threadIdx.x;
    const int Kd = Hk * dk, conv_dim = 2 * Kd + Hv * dv, kh = h / (Hv / Hk);
    const int nc = min(GS_C, dv - j0);  // valid columns of this slice
    float* S = state + (long)h * dk * dv;
    for (int i = tid; i < dk * GS_C; i += blockDim.x) {
        const int r = i / GS_C, j = i % GS_C;
        Ss[i] = j < nc ? S[r * dv + j0 + j] : 0.f;
    }
    const int rg = tid >> 3, cg = tid & 7;  // 4x4 output block: rows 4rg.., columns 4cg..
    const int nchunks = (N + GC - 1) / GC;
    for (int c = 0; c < nchunks; c++) {
        const int t0 = c * GC;
        const long cb = (long)c * Hv + h;
        __syncthreads();  // the previous chunk's readers of WQ/Ks/Ps/Us/Ds and writers of Ss are done
        for (int i = tid; i < GC * dk; i += blockDim.x) {
            const int r = i / dk, d = i % dk;
            const bool ok = t0 + r < N;
            const float* row = qkv + (long)(t0 + r) * conv_dim;
            WQ[r * ldk + d] = Wg[cb * GC * dk + i];
            WQ[(GC + r) * ldk + d] = ok ? row[kh * dk + d] : 0.f;
            Ks[r * ldk + d] = ok ? row[Kd + kh * dk + d] : 0.f;
        }
        for (int i = tid; i < GC * GC; i += blockDim.x) Ps[i] = Pg[cb * GC * GC + i];
        for (int i = tid; i < GC * GS_C; i += blockDim.x) {
            const int r = i / GS_C, j = i % GS_C;
            Us[i] = j < nc ? Ug[cb * GC * dv + r * dv + j0 + j] : 0.f;
        }
        if (tid < GC) Gs[tid] = Gg[cb * GC + tid];
        __syncthreads();
        if (tid < GC) kdec[tid] = expf(Gs[GC - 1] - Gs[tid]);
        // [W; Q] S: rows 4rg..4rg+3 of 128, columns 4cg..4cg+3
        float acc[4][4] = {};
        for (int d = 0; d < dk; d += 4) {
            float a[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float4 v = *reinterpret_cast<const float4*>(&WQ[(4 * rg + i) * ldk + d]);
                a[i][0] = v.x, a[i][1] = v.y, a[i][2] = v.z, a[i][3] = v.w;
            }
#pragma unroll
            for (int dd = 0; dd < 4; dd++) {
                const float4 b = *reinterpret_cast<const float4*>(&Ss[(d + dd) * GS_C + 4 * cg]);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[i][0] = fmaf(a[i][dd], b.x, acc[i][0]);
                    acc[i][1] = fmaf(a[i][dd], b.y, acc[i][1]);
                    acc[i][2] = fmaf(a[i][dd], b.z, acc[i][2]);
                    acc[i][3] = fmaf(a[i][dd], b.w, acc[i][3]);
                }
            }
        }
        const bool is_w = rg < GC / 4;  // rows 0..63: W S -> D = U - W S
        if (is_w) {
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    const int r = 4 * rg + i, j = 4 * cg + jj;
                    Ds[r * GS_C + j] = Us[r * GS_C + j] - acc[i][jj];
                }
        }
        __syncthreads();
        if (!is_w) {
            // O = e^G (Q S) + P D for tokens t = 4(rg-16) + i
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int t = 4 * (rg - GC / 4) + i;
                const float eg = expf(Gs[t]);
                float ov[4];
#pragma unroll
                for (int jj = 0; jj < 4; jj++) ov[jj] = eg * acc[i][jj];
                for (int s = 0; s <= t; s++) {
                    const float pv = Ps[t * GC + s];
                    const float4 dd = *reinterpret_cast<const float4*>(&Ds[s * GS_C + 4 * cg]);
                    ov[0] = fmaf(pv, dd.x, ov[0]);
                    ov[1] = fmaf(pv, dd.y, ov[1]);
                    ov[2] = fmaf(pv, dd.z, ov[2]);
                    ov[3] = fmaf(pv, dd.w, ov[3]);
                }
                if (t0 + t < N) {
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) {
                        const int j = 4 * cg + jj;
                        if (j < nc) o[(long)(t0 + t) * Hv * dv + h * dv + j0 + j] = ov[jj];
                    }
                }
            }
        }
        // S <- e^{G_last} S + sum_t kdec[t] k_t D_t^T : rows 4rg'.. of dk (rg' over dk/4 groups), columns 4cg..
        const float elast = expf(Gs[GC - 1]);
        for (int rb = rg; rb < dk / 4; rb += 32) {
            float sacc[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++) sacc[i][jj] = 0.f;
            for (int t = 0; t < GC; t++) {
                const float4 kv = *reinterpret_cast<const float4*>(&Ks[t * ldk + 4 * rb]);
                const float4 dd = *reinterpret_cast<const float4*>(&Ds[t * GS_C + 4 * cg]);
                const float kd = kdec[t];
                const float ka[4] = {kv.x * kd, kv.y * kd, kv.z * kd, kv.w * kd};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    sacc[i][0] = fmaf(ka[i], dd.x, sacc[i][0]);
                    sacc[i][1] = fmaf(ka[i], dd.y, sacc[i][1]);
                    sacc[i][2] = fmaf(ka[i], dd.z, sacc[i][2]);
                    sacc[i][3] = fmaf(ka[i], dd.w, sacc[i][3]);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4* sp = reinterpret_cast<float4*>(&Ss[(4 * rb + i) * GS_C + 4 * cg]);
                float4 sv = *sp;
                sv.x = fmaf(elast, sv.x, sacc[i][0]);
                sv.y = fmaf(elast, sv.y, sacc[i][1]);
                sv.z = fmaf(elast, sv.z, sacc[i][2]);
                sv.w = fmaf(elast, sv.w, sacc[i][3]);
                *sp = sv;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < dk * GS_C; i += blockDim.x) {
        const int r = i / GS_C, j = i % GS_C;
        if (j < nc) S[r * dv + j0 + j] = Ss[i];
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

extern "C" __global__ void gdn_ring(const float* __restrict__ proj, int ldp, int conv_dim, int K, int pos0, int N,
                                    float* __restrict__ ring) {
    pdl_wait();
    const int first = max(0, N - K);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (N - first) * conv_dim; i += gridDim.x * blockDim.x) {
        const int n = first + i / conv_dim, ch = i % conv_dim;
        ring[((pos0 + n) % K) * conv_dim + ch] = proj[(long)n * ldp + ch];
    }
}

// ---- attention

extern "C" __global__ void attn_prep_rows(const float* __restrict__ proj, int ldp, const float* __restrict__ qn,
                                          const float* __restrict__ kn, int pos0, int nh, int nkv, int hd, int rd,
                                          float theta, float eps, __nv_bfloat16* __restrict__ qout,
                                          __nv_bfloat16* __restrict__ kc, __nv_bfloat16* __restrict__ vc) {
    __shared__ float red[32];
    __shared__ float xs[256];
    pdl_wait();
    const int n = blockIdx.x, bh = blockIdx.y, d = threadIdx.x;
    const bool is_q = bh < nh;
    const int kvh = bh - nh;
    const float* row = proj + (long)n * ldp;
    const float gd = (is_q ? qn : kn)[d];
    const int pos = pos0 + n;
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
        kc[r] = __float2bfloat16(y);
        vc[r] = __float2bfloat16(row[nh * 2 * hd + nkv * hd + kvh * hd + d]);
    }
}
