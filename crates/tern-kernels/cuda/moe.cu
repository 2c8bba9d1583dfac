// Sparse MoE decode kernels (batch 1). Experts of one layer live in one buffer each for gate_up
// ([E+1, 2I, H]: gate rows then up rows; expert E is the shared expert, whose intermediate size Is may differ)
// and down ([E+1, H, I]), 4-bit MLX affine, group gs = 32 << gshift; routed experts have stride `*_words` /
// `*_groups`. Weight loads are 16 bytes, streamed (ld.global.nc, no L1 allocation), several per lane in flight.
//
// moe_topk      : softmax over E router logits, top-k (ties -> lower index), renormalise; slot k = shared expert
//                 with weight sigmoid(logits[E]). One warp. Bytes ~ 4E. FLOPs ~ E*(k+3).
// moe_gate_up   : act[slot, j] = silu(G_e[j] . xn) * (U_e[j] . xn), xn = RMSNorm(x)*gain computed in the
//                 prologue (smem, padded, with 32-column chunk sums); a warp owns 2 items = 4 rows; the shared
//                 expert's rows are prefetched into L2 before the dependency wait.
//                 Bytes: (k*2I + 2Is)*H/2 (+scales). FLOPs 2*(k*2I+2Is)*H.
// moe_down      : x[r] += sum_slot wt[slot] * (D_e[r] . act[slot]) (residual add fused); each block bulk-copies
//                 its rows of the k+1 experts into shared memory before the dependency wait (idx is two launches
//                 old). Bytes: H*(k*I + Is)/2 (+scales). FLOPs 2*H*(k*I+Is).
#include "common.cuh"

extern "C" __global__ void moe_topk(const float* __restrict__ logits, int E, int k, int* __restrict__ idx,
                                    float* __restrict__ wts) {
    KTRACE(40);
    pdl_wait();
    topk_warp(logits, E, k, idx, wts);
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, const int* __restrict__ idx, int k, int E, int I, int Is, int H, int gshift,
    const float* __restrict__ x, const float* __restrict__ gain, float eps, float* __restrict__ act) {
    KTRACE(41);
    extern __shared__ float xs[];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int Imax = I > Is ? I : Is;
    const int items = k * I + Is;
    const int nvec = H / 32, ngroups = H >> (gshift + 5), lI = 31 - __clz(I);
    {
        // before the dependency wait (idx comes from the previous kernel): only the shared expert's rows (expert E,
        // items k*I..) have a known address; pull this warp's share of them (gate and up rows) into L2
        for (int t = blockIdx.x * nw + warp; 2 * t < items; t += gridDim.x * nw) {
            const int it = 2 * t;
            if (it < k * I) continue;
            const long jj = it - k * I, nr = min(2, items - it);
            const uint32_t* we = w + (long)E * words;
            prefetch_l2(reinterpret_cast<const uint4*>(we) + jj * nvec, nr * nvec * 16, lane);
            prefetch_l2(reinterpret_cast<const uint4*>(we) + (Is + jj) * nvec, nr * nvec * 16, lane);
        }
    }
    const GainRegs<2> gr = load_gain<2, XM_RMS>(gain, H);
    pdl_wait();
    float* cs = xs + padx_len(H);
    stage_x<2, XM_RMS>(x, gr, eps, H, 32, xs, cs, red);
    // a warp owns 2 items (gate and up rows of each: 4 rows in flight)
    for (int t = blockIdx.x * nw + warp; 2 * t < items; t += gridDim.x * nw) {
        const uint4* wr[4];
        const __nv_bfloat16 *sr[4], *br[4];
        int slot[2], jj[2];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int it = min(2 * t + q, items - 1);
            slot[q] = it < k * I ? it >> lI : k;  // I a power of two (checked on the host)
            jj[q] = it < k * I ? it & (I - 1) : it - k * I;
            const int n = slot[q] < k ? I : Is;
            const long e = idx[slot[q]];
            const long rg = jj[q], ru = n + jj[q];
            wr[2 * q] = reinterpret_cast<const uint4*>(w + e * words) + rg * nvec;
            wr[2 * q + 1] = reinterpret_cast<const uint4*>(w + e * words) + ru * nvec;
            sr[2 * q] = s + e * groups + rg * ngroups;
            sr[2 * q + 1] = s + e * groups + ru * ngroups;
            br[2 * q] = b + e * groups + rg * ngroups;
            br[2 * q + 1] = b + e * groups + ru * ngroups;
        }
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        warp_rows_dot<4, 4, 1>(wr, sr, br, nvec, gshift, xs, cs, lane, tot);
#pragma unroll
        for (int r = 0; r < 4; r++) tot[r] = warp_sum(tot[r]);
#pragma unroll
        for (int q = 0; q < 2; q++)
            if (lane == q && 2 * t + q < items) act[slot[q] * Imax + jj[q]] = silu_f(tot[2 * q]) * tot[2 * q + 1];
    }
}

// Down projection, streamed: block b owns output rows [r0, r1) (an even split of H over the grid, <= DN_RB rows).
// Before the dependency wait (idx/wts come from the router, two launches back) it reads the k+1 expert ids and
// bulk-copies (TMA) those rows of each slot's down matrix into shared memory ([slot][DN_RB rows][n/2 bytes], n =
// I, or Is for the shared slot) and loads their scales/biases into shared memory. After the wait it stages act
// (x 2^90, padded, 32-column chunk sums by shuffles) and computes: warp w takes rows w, w+8, ...; a row's
// (slot, chunk) pairs are spread over the lanes, each weighted by wts[slot]; one warp sum per row; x[r] += it.
#define DN_RB 16
#define DN_MAXK 16

extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, const int* __restrict__ idx, const float* __restrict__ wts, int k, int I, int Is, int H,
    int gshift, const float* __restrict__ act, float* __restrict__ x) {
    KTRACE(42);
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full;
    __shared__ int sidx[DN_MAXK + 1];
    __shared__ float swt[DN_MAXK + 1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int Imax = I > Is ? I : Is;
    const int r0 = (int)((long)H * blockIdx.x / gridDim.x), r1 = (int)((long)H * (blockIdx.x + 1) / gridDim.x);
    const int nr = r1 - r0;
    const int gpc = gshift;                    // log2(chunks per group)
    const int ngI = I >> (gshift + 5), ngS = Is >> (gshift + 5), ngM = Imax >> (gshift + 5);
    const int stride = padx_len(Imax);
    // shared memory: weights [k+1][DN_RB][Imax/2] bytes | act [k+1][stride] f32 | chunk sums [k+1][Imax/32] f32 |
    // scales, biases [k+1][DN_RB][ngM] f32
    unsigned char* wsm = smem;
    float* as = reinterpret_cast<float*>(smem + (long)(k + 1) * DN_RB * (Imax / 2));
    float* cs = as + (k + 1) * stride;
    float* scs = cs + (k + 1) * (Imax / 32);
    float* bss = scs + (k + 1) * DN_RB * ngM;
    if (tid <= k) sidx[tid] = idx[tid];
    __syncthreads();
    if (tid == 0) {
        mbar_init(&full, 1);
        mbar_fence_init();
        uint32_t total = 0;
        for (int slot = 0; slot <= k; slot++) total += (uint32_t)nr * ((slot < k ? I : Is) / 2);
        mbar_expect_tx(&full, total);
        for (int slot = 0; slot <= k; slot++) {
            const int n = slot < k ? I : Is;
            const unsigned char* src = reinterpret_cast<const unsigned char*>(w + (long)sidx[slot] * words) + (long)r0 * (n / 2);
            bulk_g2s(wsm + (long)slot * DN_RB * (Imax / 2), src, (uint32_t)nr * (n / 2), &full);
        }
    }
    // index decompositions by shifts (I, Is, gs powers of two, checked on the host): integer divisions by runtime
    // values expand to long instruction sequences, and code size matters here
    const int lngM = 31 - __clz(ngM), lrow = 31 - __clz(DN_RB * ngM);
    {
        // scales/biases of the block's rows: all loads first (one round trip), then the shared-memory stores
        constexpr int NSB = 8;  // per thread: (k+1)*DN_RB*ngM <= 8*256 (checked on the host)
        __nv_bfloat16 sv[NSB], bv[NSB];
#pragma unroll
        for (int j = 0; j < NSB; j++) {
            const int t = tid + 256 * j;
            const int slot = t >> lrow, rr = (t >> lngM) & (DN_RB - 1), g = t & (ngM - 1);
            const int ng = slot < k ? ngI : ngS;
            if (slot <= k && rr < nr && g < ng) {
                const long gi = (long)sidx[slot] * groups + (r0 + rr) * ng + g;
                sv[j] = s[gi];
                bv[j] = b[gi];
            }
        }
#pragma unroll
        for (int j = 0; j < NSB; j++) {
            const int t = tid + 256 * j;
            const int slot = t >> lrow, rr = (t >> lngM) & (DN_RB - 1), g = t & (ngM - 1);
            const int ng = slot < k ? ngI : ngS;
            if (slot <= k && rr < nr && g < ng) {
                scs[t] = bf(sv[j]);
                bss[t] = bf(bv[j]);
            }
        }
    }
    pdl_wait();
    if (tid <= k) swt[tid] = wts[tid];
    // act -> smem (x 2^90), chunk sums of 32 columns (8 float4 = 8 consecutive threads) by shuffles; all loads
    // first (one round trip)
    const int n4 = Imax / 4, ln4 = 31 - __clz(n4);
    constexpr int NA = 8;  // float4s per thread: (k+1)*Imax/4 <= 8*256 (checked on the host)
    float4 av[NA];
#pragma unroll
    for (int j = 0; j < NA; j++) {
        const int t = tid + 256 * j;
        const int slot = t >> ln4, c4 = t & (n4 - 1);
        const int n = slot < k ? I : Is;
        av[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (slot <= k && 4 * c4 < n) av[j] = reinterpret_cast<const float4*>(act + slot * Imax)[c4];
    }
#pragma unroll
    for (int j = 0; j < NA; j++) {
        const int t = tid + 256 * j;
        const int slot = t >> ln4, c4 = t & (n4 - 1);
        const float4 v = av[j];
        float sum = v.x + v.y + v.z + v.w;
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        sum += __shfl_xor_sync(FULL_MASK, sum, 4);
        if (slot <= k) {
            *reinterpret_cast<float4*>(as + slot * stride + padx(4 * c4)) =
                make_float4(v.x * DN_XSCALE, v.y * DN_XSCALE, v.z * DN_XSCALE, v.w * DN_XSCALE);
            if ((c4 & 7) == 0) cs[slot * (Imax / 32) + c4 / 8] = sum;
        }
    }
    trace_mark(0);
    __syncthreads();
    mbar_wait(&full, 0);
    trace_mark(1);
    const int cI = I / 32, lcI = 31 - __clz(cI), npos = k * cI + Is / 32;
#pragma unroll 1
    for (int rr = warp; rr < nr; rr += 8) {
        float acc = 0.f;
#pragma unroll 1
        for (int p = lane; p < npos; p += 32) {
            const int slot = p < k * cI ? p >> lcI : k;
            const int c = p < k * cI ? p & (cI - 1) : p - k * cI;
            const int n = slot < k ? I : Is;
            const int g = c >> gpc;
            const uint4 wq[1] = {*reinterpret_cast<const uint4*>(wsm + (long)slot * DN_RB * (Imax / 2) + (long)rr * (n / 2) + c * 16)};
            const float sc[1] = {scs[(slot * DN_RB + rr) * ngM + g]}, bs[1] = {bss[(slot * DN_RB + rr) * ngM + g]};
            float d[1] = {0.f};
            chunk_dot<4, 1>(wq, as + slot * stride + padx(c * 32), sc, bs, cs[slot * (Imax / 32) + c], d);
            acc = fmaf(swt[slot], d[0], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) x[r0 + rr] += acc;
    }
}
