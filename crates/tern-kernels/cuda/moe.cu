// Sparse MoE decode kernels (batch 1). Experts of one layer live in one buffer each for gate_up
// ([E+1, 2I, H]: gate rows then up rows; expert E is the shared expert, whose intermediate size Is may differ)
// and down ([E+1, H, I]), 4-bit MLX affine, group gs = 32 << gshift; routed experts have stride `*_words` /
// `*_groups`. Weight loads are 16 bytes, streamed (ld.global.nc, no L1 allocation), several per lane in flight.
//
// moe_topk      : softmax over E router logits, top-k (ties -> lower index), renormalise; slot k = shared expert
//                 with weight sigmoid(logits[E]). One warp. Bytes ~ 4E. FLOPs ~ E*(k+3).
// moe_gate_up   : act[slot, j] = silu(G_e[j] . xn) * (U_e[j] . xn), xn = RMSNorm(x)*gain computed in the
//                 prologue (smem, padded, with 32-column chunk sums); a warp owns 2 items = 4 rows; the shared
//                 expert's items run before the router's top-k is known, the routed ones once the router's
//                 ready flag (counter[MOE_FLAG]) is set, each warp's 4 rows bulk-copied into shared memory.
//                 Bytes: (k*2I + 2Is)*H/2 (+scales). FLOPs 2*(k*2I+2Is)*H.
// moe_down      : x[r] += sum_slot wt[slot] * (D_e[r] . act[slot]) (residual add fused); each block bulk-copies
//                 its rows of the k+1 experts into shared memory before the dependency wait (the ids from the
//                 router's ready flag). Bytes: H*(k*I + Is)/2 (+scales). FLOPs 2*H*(k*I+Is).
#include "common.cuh"

extern "C" __global__ void moe_topk(const float* __restrict__ logits, int E, int k, int* __restrict__ idx,
                                    float* __restrict__ wts) {
    KTRACE(40);
    pdl_wait();
    topk_warp(logits, E, k, idx, wts);
}

// Two items (gate and up rows of each: 4 rows) of expert e, rows j0, j0+1 of n: gate rows j0.., up rows n+j0..,
// straight from global memory (streamed loads); warp-reduced dots in tot.
__device__ __forceinline__ void gate_up_rows(const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s,
                                             const __nv_bfloat16* __restrict__ b, long e, long words, long groups,
                                             int n, int j0, int nvec, int ngroups, int gshift, const float* xs,
                                             const float* cs, int lane, float (&tot)[4]) {
    // tot[r], r = 2q + (up ? 1 : 0): row (up ? n : 0) + j0 + q
    for (int u = lane; u < nvec; u += 32) {
        const int g = u >> gshift;
        uint4 wv[4];
        float sc[4], bs[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int row = (r & 1 ? n : 0) + j0 + (r >> 1);
            wv[r] = ldg_stream(reinterpret_cast<const uint4*>(w + e * words) + (long)row * nvec + u);
            sc[r] = bf(s[e * groups + (long)row * ngroups + g]);
            bs[r] = bf(b[e * groups + (long)row * ngroups + g]);
        }
        chunk_dot<4, 4>(wv, xs + padx(u * 32), sc, bs, cs[u], tot);
    }
#pragma unroll
    for (int r = 0; r < 4; r++) tot[r] = warp_sum(tot[r]);
}

// The shared expert's items (slot k) need only xn, so they run before the router's top-k is known; the routed
// items wait for the router's ready flag counter[MOE_FLAG..+1] (a 64-bit word carrying the k expert ids, set by
// router_topk_q8's last block, cleared by moe_down), then each warp bulk-copies its 4 rows into shared memory
// (one round trip for all of them, where register loads took two) and computes from there. x is the residual
// written two launches back (complete when this kernel starts under programmatic launch), so the norm and the
// staging also run while the router is still working. At most 96 registers: two blocks per SM leave room for a
// moe_down block, which then streams its expert rows in while this kernel runs.
extern "C" __global__ void __maxnreg__(96) moe_gate_up(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, int k, int E, int I, int Is, int H, int gshift, const float* __restrict__ x,
    const float* __restrict__ gain, float eps, float* __restrict__ act, const unsigned int* __restrict__ counter) {
    KTRACE(41);
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float red[32];
    __shared__ __align__(8) uint64_t bar[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int Imax = I > Is ? I : Is;
    const int nvec = H / 32, ngroups = H >> (gshift + 5), lI = 31 - __clz(I), rowb = H / 2;
    const int gw = blockIdx.x * nw + warp, nwarps = gridDim.x * nw;
    float* xs = reinterpret_cast<float*>(smem);
    float* cs = xs + padx_len(H);
    unsigned char* rows = smem + (((padx_len(H) + nvec) * 4 + 127) & ~127) + warp * 4 * rowb;
    if (lane == 0) {
        mbar_init(&bar[warp], 1);
        mbar_fence_init();
    }
    const GainRegs<2> gr = load_gain<2, XM_RMS>(gain, H);
    stage_x<2, XM_RMS>(x, gr, eps, H, 32, xs, cs, red);  // ends with a block barrier (also for the mbarriers)
    for (int t = gw; 2 * t < Is; t += nwarps) {
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        gate_up_rows(w, s, b, E, words, groups, Is, 2 * t, nvec, ngroups, gshift, xs, cs, lane, tot);
        if (lane < 2) act[k * Imax + 2 * t + lane] = silu_f(tot[2 * lane]) * tot[2 * lane + 1];
    }
    const unsigned long long ids = wait_flag64(reinterpret_cast<const unsigned long long*>(counter + MOE_FLAG));
    pdl_launch_dependents();
    uint32_t phase = 0;
    for (int t = gw; 2 * t < k * I; t += nwarps) {
        const int slot = (2 * t) >> lI, j0 = (2 * t) & (I - 1);  // I a power of two (checked on the host)
        const long e = (ids >> (8 * slot)) & 0xff;
        if (lane == 0) {
            const unsigned char* we = reinterpret_cast<const unsigned char*>(w + e * words);
            fence_proxy_async();  // this warp's reads of the previous rows come before the copies overwrite them
            mbar_expect_tx(&bar[warp], 4 * rowb);
            bulk_g2s(rows, we + (long)j0 * rowb, 2 * rowb, &bar[warp]);
            bulk_g2s(rows + 2 * rowb, we + (long)(I + j0) * rowb, 2 * rowb, &bar[warp]);
        }
        // scales and biases of this lane's chunks (u = lane, lane + 32; H <= 2048) load while the rows are in flight
        float sc[2][4], bs[2][4];
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const int g = min(lane + 32 * a, nvec - 1) >> gshift;
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const long gi = e * groups + (long)((r & 1 ? I : 0) + j0 + (r >> 1)) * ngroups + g;
                sc[a][r] = bf(s[gi]);
                bs[a][r] = bf(b[gi]);
            }
        }
        mbar_wait(&bar[warp], phase);
        phase ^= 1u;
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int a = 0; a < 2; a++) {
            const int u = lane + 32 * a;
            if (u < nvec) {
                uint4 wv[4];
#pragma unroll
                for (int r = 0; r < 4; r++) wv[r] = reinterpret_cast<const uint4*>(rows)[((r & 1) * 2 + (r >> 1)) * nvec + u];
                chunk_dot<4, 4>(wv, xs + padx(u * 32), sc[a], bs[a], cs[u], tot);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) tot[r] = warp_sum(tot[r]);
        if (lane < 2) act[slot * Imax + j0 + lane] = silu_f(tot[2 * lane]) * tot[2 * lane + 1];
        __syncwarp();
    }
    pdl_wait_only();  // formally after the router (finished by now): keeps the launch chain's ordering
}

// Down projection, streamed: block b owns output rows [r0, r1) (an even split of H over the grid, <= DN_RB rows).
// Before the dependency wait it reads the k+1 expert ids (the routed ones from the router's ready flag) and
// bulk-copies (TMA) those rows of each slot's down matrix into shared memory ([slot][DN_RB rows][n/2 bytes], n =
// I, or Is for the shared slot) and loads their scales/biases into shared memory. After the wait it stages act
// (x 2^90, padded, 32-column chunk sums by shuffles) and computes: warp w takes rows w, w+8, ...; a row's
// (slot, chunk) pairs are spread over the lanes, each weighted by wts[slot]; one warp sum per row; x[r] += it.
#define DN_RB 16
#define DN_MAXK 16

extern "C" __global__ void __launch_bounds__(256) moe_down(
    const uint32_t* __restrict__ w, const __nv_bfloat16* __restrict__ s, const __nv_bfloat16* __restrict__ b,
    long words, long groups, int E, const float* __restrict__ wts, int k, int I, int Is, int H, int gshift,
    const float* __restrict__ act, float* __restrict__ x, unsigned int* __restrict__ counter) {
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
    if (tid <= k) {
        // the routed ids come with the router's ready flag (set, and acquired here, before this kernel could
        // launch: moe_gate_up lets it launch only after seeing the flag); slot k is the shared expert, id E
        const unsigned long long ids = ld_acquire64(reinterpret_cast<const unsigned long long*>(counter + MOE_FLAG));
        sidx[tid] = tid < k ? (int)((ids >> (8 * tid)) & 0xff) : E;
    }
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
    if (tid == 0) *reinterpret_cast<unsigned long long*>(counter + MOE_FLAG) = 0ull;  // its only reader (moe_gate_up) has finished; the next router sets it
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
