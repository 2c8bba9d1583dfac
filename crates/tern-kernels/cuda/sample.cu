// Sampling on the device: one block of 1024 threads per row of a logits matrix [B, ld] (f32, row-major), each row
// drawn with its own parameters, so that only the chosen ids (and requested log-probabilities) cross to the host.
// The same steps as tern_engine::sample_host + tern_text::Sampler::sample; crates/tern-cuda/src/sample.rs holds
// the row layout (SampleRow & co., mirrored exactly below), the host-side packing and `sample_reference`, a
// pure-Rust copy of this algorithm that the tests compare against.
//
// sample_rows(logits, ld, rows, pens, biases, masks, outs, pre), grid B, 1024 threads (pre: null, or row 0's
// first passes made by sample_pre_*):
//   rows[b]   SampleRow: temperature, top_k, top_p, min_p, repetition/presence/frequency penalty, limit (ids >= limit
//             are padding: never read), seed, logprobs (-1 none, else how many top entries, <= 20), the row's
//             slices pens[pen_off..+pen_len] (id, count: the history counted on the host) and
//             biases[bias_off..+bias_len] (id, bias) (ids unique and < limit within a row), and mask_off: -1, or
//             the row's mask bitset masks[mask_off..+ceil(limit/32)] (bit i of word i/32 = id i allowed).
//   outs[b]   SampleOut: token, status (S_OK / S_NO_TOKEN: the mask allows no id below limit), the token's
//             log-probability and the top-N (id, log-probability), best first.
//   Scratch: the row's logits are overwritten, and every pens/biases entry's `raw` gets the logit it changed.
// Steps per row (n = limit):
//   1. NaN -> -inf (in place).
//   2. logprobs: lse = max + ln sum exp(l - max) over the raw logits (f64 sum of exp_det terms); the top-N by
//      (logit desc, id asc); the token's log-probability from its raw logit (saved in `raw` where bias/penalty
//      changed it).
//   3. mask: disallowed -> -inf (status S_NO_TOKEN if none allowed); 4. logit bias; 5. penalties (repetition
//      HF-style on the sign, then presence + frequency * count), all f32 as the host does them.
//   6. temperature <= 0: argmax (first id on ties; -inf everywhere: id 0). Otherwise, with M the largest logit:
//      (a) 0 < top_k <= S_KMAX: the top_k best composite keys (order-preserving logit key << 32 | ~id: logit
//          desc, id asc, the host's order): a counting pass over S_HBINS bins below the maximum key finds the
//          nearest bins holding >= top_k keys (at most S_KMAX: else a radix select), those candidates are gathered
//          into shared memory, bitonic-sorted and cut to top_k; then the host's own f64 steps on them (weights
//          exp((l - M)/T), top-p smallest prefix, min-p, target = u*total, walk): the host's id except where f64
//          exp rounds differently at a boundary.
//      (b) otherwise no sort: the kept set is {key >= lo} & {w >= min(min_p, 1)}, w = exp_det((l - M)/T) (f32,
//          a fixed polynomial the reference computes bit for bit), lo = the top_k-th key (radix select) if
//          top_k > 0, raised to the smallest prefix in key order whose fixed-point mass (w * 2^43 truncated, exact
//          integer sums) reaches top_p * total (radix search over the keys with per-bin masses). These are the
//          host's sets, up to rounding. Draw: target = u * total, found by a prefix scan in id order (thread t
//          owns ids [t*C, t*C + C), C = ceil(n/1024): per-thread f64 sums, sequential scans per warp and over the
//          warps, the thread whose range holds the target walks it). Same distribution as the host, not the
//          same ids.
//      u is the first next_f64() of xoshiro256** seeded through splitmix64 with the row's seed (the host's RNG).
//      If every logit is -inf: id 0; with a mask, a drawn id the mask does not allow (only that fallback) becomes
//      the first allowed id.
// Where it differs from the host by design: NaN is -inf in the log-probabilities too (the host's are NaN then);
// ties at the last top log-probability go to the lower ids (the host's selection takes any of them); +inf logits
// share the mass equally (the host's weights are NaN there).
// Determinism: no float atomics; integer atomics only count, sum fixed-point masses or claim slots whose contents
// are sorted afterwards; float reductions have a fixed order. Same logits, parameters and seed: same outputs.
// Bytes per row: ~4n per pass over the row (L2-resident after the first; every pass loads 4 float4 per thread
// at a time, row_each): the NaN + argmax pass (the argmax pass again after a mask, bias or penalty), then (a) the
// counting pass and the gather, or (b) 1-4 radix levels (each one pass; ties at the threshold add levels) and a
// scan pass (+2 passes and a top-N select with logprobs, +1 with a mask, +1 for the top-p mass). FLOPs per row:
// ~20n per pass that needs weights (exp_det). On the H200 (a row of 248k, top-k 20, top-p 0.95) a batch of one row
// took 0.08 ms longer sampled than greedy (whose argmax is this kernel's first pass), one block on one SM walking
// the row three times; such a lone row's first three passes now run over the whole GPU first (sample_pre_max,
// sample_pre_hist, sample_pre_gather: their contract is above their code, below; `pre`), the same id bit for bit.
#include "common.cuh"

#define S_THREADS 1024
#define S_KMAX 1024
#define S_MAXTOP 20
// Path (a)'s prefilter: S_HBINS bins of 2^S_HSHIFT order-key units below the maximum key (2^23 units = a factor of 2
// in value: the bins cover one binade under the maximum).
#define S_HBINS 2048
#define S_HSHIFT 12
#define S_OK 0u
#define S_NO_TOKEN 1u
// Composite keys at or above this have a logit above -inf.
#define S_LO_FINITE (0x00800000ull << 32)
// Fixed-point scale of the masses (2^43): a row of up to 2^20 weights <= 1 sums to at most 2^63 (fits a u64).
#define S_FX_SCALE 8796093022208.0

struct SampleRow {
    float temperature;
    uint32_t top_k;
    float top_p;
    float min_p;
    float repetition_penalty;
    float presence_penalty;
    float frequency_penalty;
    uint32_t limit;
    unsigned long long seed;
    int32_t logprobs;
    uint32_t pen_off;
    uint32_t pen_len;
    uint32_t bias_off;
    uint32_t bias_len;
    int32_t mask_off;
};
static_assert(sizeof(SampleRow) == 64, "SampleRow layout (sample.rs)");
struct SamplePenalty {
    uint32_t id;
    uint32_t count;
    float raw;
};
struct SampleBias {
    uint32_t id;
    float bias;
    float raw;
};
static_assert(sizeof(SamplePenalty) == 12 && sizeof(SampleBias) == 12, "entry layout (sample.rs)");
struct SampleTop {
    uint32_t id;
    float logprob;
};
struct SampleOut {
    uint32_t token;
    uint32_t status;
    float logprob;
    uint32_t n_top;
    SampleTop top[S_MAXTOP];
};
static_assert(sizeof(SampleOut) == 176, "SampleOut layout (sample.rs)");

struct SampleSmem {
    unsigned long long cand[S_KMAX];  // gathered composite keys
    double w[S_KMAX];                 // (a) weights; (b) per-thread sums, then their inclusive scan
    double q[S_KMAX];                 // (a) weights / total
    unsigned long long mass[256];     // radix bins: fixed-point masses
    unsigned int cnt[256];            //             and counts
    unsigned int hist[S_HBINS];       // (a) counts by distance below the maximum key
    unsigned long long red[32];       // block reductions
    double wex[32];                   // (b) per-warp totals, then their exclusive scan
    unsigned long long rs_prefix, rs_above, rs_result;
    double total;
    int rs_done, ncand, winner, found_b, found_p;
    uint32_t token;
    float raw_b, raw_p;
};

// What sample_pre_* found for a lone row (see there).
struct SamplePre {
    unsigned long long am;  // max composite key of (v + 0, i) over the row: the argmax
    unsigned long long c;   // the prefilter's threshold (0: sample_rows searches the row itself)
    unsigned int ncand;     // candidates claimed (<= S_KMAX when c != 0)
    unsigned int pad;
    unsigned int hist[S_HBINS];
    unsigned long long cand[S_KMAX];
};

// Order-preserving key of a float (total order: -0 below +0; NaN never reaches here) and back.
__device__ __forceinline__ uint32_t ord_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }
// Larger key = drawn first: logit descending, then id ascending.
__device__ __forceinline__ unsigned long long comp_key(float v, int i) {
    return ((unsigned long long)ord_key(v) << 32) | (uint32_t)~(uint32_t)i;
}

// exp(x) for x <= 0 in f32 from IEEE-exact operations only (round-half-even reduction, fma Horner of degree 7,
// ~2 ulp), so that sample.rs computes the same bits; 0 below -86 (and for NaN). Constants by their bits: log2(e),
// ln 2 in two parts (the high one exact times any n here), 1/7! .. 1/3!.
__device__ __forceinline__ float exp_det(float x) {
    if (!(x >= -86.f)) return 0.f;
    const float n = rintf(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)));
    float r = __fmaf_rn(n, -__uint_as_float(0x3f317200u), x);
    r = __fmaf_rn(n, -__uint_as_float(0x35bfbe8eu), r);
    float p = __uint_as_float(0x39500d01u);
    p = __fmaf_rn(p, r, __uint_as_float(0x3ab60b61u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3c088889u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3d2aaaabu));
    p = __fmaf_rn(p, r, __uint_as_float(0x3e2aaaabu));
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.f);
    p = __fmaf_rn(p, r, 1.f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

// Path (b) weight of logit v: exp((v - M) / T) with invT = 1/T; 1 at the maximum (also when M is +inf).
__device__ __forceinline__ float weight_b(float v, float M, double invT) {
    return v == M ? 1.f : exp_det(__double2float_rn(__dmul_rn(__dsub_rn((double)v, (double)M), invT)));
}
__device__ __forceinline__ unsigned long long fixed_weight(float v, float M, double invT) {
    return __double2ull_rz(__dmul_rn((double)weight_b(v, M, invT), S_FX_SCALE));
}

// The first next_f64() of xoshiro256** seeded through splitmix64 (tern_text's Xoshiro256): it reads only s[1].
__device__ __forceinline__ double first_uniform(unsigned long long seed) {
    unsigned long long xs = seed, s1 = 0;
    for (int j = 0; j < 2; j++) {
        xs += 0x9E3779B97F4A7C15ull;
        unsigned long long z = xs;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        s1 = z ^ (z >> 31);
    }
    unsigned long long r = s1 * 5ull;
    r = ((r << 7) | (r >> 57)) * 9ull;
    return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

struct OpMaxU64 {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a > b ? a : b; }
};
struct OpMinU64 {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a < b ? a : b; }
};
struct OpAddU64 {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a + b; }
};
struct OpAddD {
    __device__ double operator()(double a, double b) const { return __dadd_rn(a, b); }
};

// Reduction over the block (1024 threads); every thread gets the same bits (butterfly, then the 32 warp results).
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, SampleSmem& sm) {
    T* red = reinterpret_cast<T*>(sm.red);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[threadIdx.x & 31];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// f(i, x[i], i < n) for this thread's share of the row, every thread the same number of calls (so f may use warp
// collectives): float4 units u = tid + k S_THREADS, four of them loaded together per trip. A strided loop of one
// element per trip waited on L2 at every element (~40 us a pass over a 248k row, several passes a draw).
template <typename F>
__device__ __forceinline__ void row_each(const float* x, int n, F f) {
    constexpr int U = 4;
    const int nu = (n + 3) >> 2;
    const bool vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    for (int u0 = 0; u0 < nu; u0 += U * S_THREADS) {
        float4 v[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int u = u0 + k * S_THREADS + threadIdx.x, i = 4 * u;
            if (vec && i + 3 < n) {
                v[k] = reinterpret_cast<const float4*>(x)[u];
            } else {
                v[k].x = i < n ? x[i] : 0.f;
                v[k].y = i + 1 < n ? x[i + 1] : 0.f;
                v[k].z = i + 2 < n ? x[i + 2] : 0.f;
                v[k].w = i + 3 < n ? x[i + 3] : 0.f;
            }
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int i = 4 * (u0 + k * S_THREADS + threadIdx.x);
            f(i, v[k].x, i < n);
            f(i + 1, v[k].y, i + 1 < n);
            f(i + 2, v[k].z, i + 2 < n);
            f(i + 3, v[k].w, i + 3 < n);
        }
    }
}

// The largest composite key C >= lo such that F(keys >= C) >= need over ids < n, F = the count of keys (mass
// false) or the sum of their fixed-point weights (mass true: weights relative to M at invT); lo when F over every
// key >= lo stays below need. Radix descent over 8-bit digits from the top, one pass over the row per digit; stops
// as soon as the chosen bin holds one key (or, counting, when the whole bin completes the count).
__device__ unsigned long long radix_search(const float* x, int n, unsigned long long lo, double need, bool mass,
                                           float M, double invT, SampleSmem& sm) {
    const int tid = threadIdx.x;
    unsigned long long prefix = 0, above = 0;
    for (int shift = 56;; shift -= 8) {
        for (int b = tid; b < 256; b += S_THREADS) {
            sm.cnt[b] = 0;
            sm.mass[b] = 0;
        }
        __syncthreads();
        // the lanes of a warp that fall in one bin add their count once (most keys share the few bins of the top
        // digits: one shared-memory atomic per lane serialises on them)
        row_each(x, n, [&](int i, float v, bool ok) {
            int b = 256;  // no bin
            if (ok) {
                const unsigned long long c = comp_key(v, i);
                if (c >= lo && (shift == 56 || (c >> (shift + 8)) == prefix)) b = (int)((c >> shift) & 255);
            }
            const unsigned int same = __match_any_sync(FULL_MASK, b);
            const bool leader = (threadIdx.x & 31) == __ffs(same) - 1;
            if (mass) {  // uniform: the group's exact sum of u64 masses (each <= 2^43) in three 21-bit parts
                const unsigned long long w = b < 256 ? fixed_weight(v, M, invT) : 0ull;
                const unsigned int p0 = __reduce_add_sync(same, (unsigned int)(w & 0x1FFFFFu));
                const unsigned int p1 = __reduce_add_sync(same, (unsigned int)((w >> 21) & 0x1FFFFFu));
                const unsigned int p2 = __reduce_add_sync(same, (unsigned int)(w >> 42));
                if (b < 256 && leader)
                    atomicAdd(&sm.mass[b], (unsigned long long)p0 + ((unsigned long long)p1 << 21) +
                                               ((unsigned long long)p2 << 42));
            }
            if (b < 256 && leader) atomicAdd(&sm.cnt[b], (unsigned int)__popc(same));
        });
        __syncthreads();
        if (tid == 0) {
            unsigned long long cum = 0;
            int chosen = -1;
            for (int b = 255; b >= 0; b--) {
                const unsigned long long f = mass ? sm.mass[b] : sm.cnt[b];
                if (sm.cnt[b] && __ull2double_rn(above + cum + f) >= need) {
                    chosen = b;
                    break;
                }
                cum += f;
            }
            int done = 1;
            unsigned long long res = lo;
            if (chosen >= 0) {
                above += cum;
                prefix = (prefix << 8) | (unsigned long long)chosen;
                const bool whole = !mass && __ull2double_rn(above + sm.cnt[chosen]) == need;
                if (sm.cnt[chosen] == 1 || whole || shift == 0) {
                    res = prefix << shift;
                    res = res > lo ? res : lo;
                } else {
                    done = 0;
                }
            }
            sm.rs_prefix = prefix;
            sm.rs_above = above;
            sm.rs_done = done;
            sm.rs_result = res;
        }
        __syncthreads();
        if (sm.rs_done) return sm.rs_result;
        prefix = sm.rs_prefix;
        above = sm.rs_above;
    }
}

// Every composite key >= c into sm.cand (in no particular order); returns how many (<= S_KMAX by the caller's c).
__device__ int gather(const float* x, int n, unsigned long long c, SampleSmem& sm) {
    __syncthreads();
    if (threadIdx.x == 0) sm.ncand = 0;
    __syncthreads();
    row_each(x, n, [&](int i, float v, bool ok) {
        const unsigned long long k = comp_key(v, i);
        if (ok && k >= c) {
            const int s = atomicAdd(&sm.ncand, 1);
            if (s < S_KMAX) sm.cand[s] = k;
        }
    });
    __syncthreads();
    return min(sm.ncand, S_KMAX);
}

// Bitonic sort of sm.cand[0..nc) descending (padded with zeros, below every key, to a power of two <= S_KMAX).
__device__ void sort_desc(int nc, SampleSmem& sm) {
    int m = 1;
    while (m < nc) m <<= 1;
    for (int i = nc + threadIdx.x; i < m; i += S_THREADS) sm.cand[i] = 0;
    __syncthreads();
    for (int k = 2; k <= m; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < m; i += S_THREADS) {
                const int l = i ^ j;
                if (l > i) {
                    const unsigned long long a = sm.cand[i], b = sm.cand[l];
                    if ((i & k) == 0 ? a < b : a > b) {
                        sm.cand[i] = b;
                        sm.cand[l] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Warp 0's part of the prefilter (every lane of the warp returns it): from the counts by distance below the
// maximum key km, the threshold of the nearest bins that hold k keys (0: they hold fewer, or more than S_KMAX).
__device__ unsigned long long prefilter_cut(const unsigned int* hist, uint32_t km, int k) {
    const int lane = threadIdx.x & 31;
    constexpr int PER = S_HBINS / 32;  // lane l sums bins [64 l, 64 l + 64); the first bin where the count reaches k
    unsigned int own = 0;
    for (int b = 0; b < PER; b++) own += hist[lane * PER + b];
    unsigned int inc = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned int t = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += t;
    }
    const unsigned int before = inc - own;
    const unsigned int hit = __ballot_sync(FULL_MASK, inc >= (unsigned int)k);
    if (!hit) return 0ull;
    unsigned long long res = 0ull;
    if (lane == __ffs(hit) - 1) {
        unsigned int cum = before;
        int b = lane * PER;
        while (true) {
            cum += hist[b];
            if (cum >= (unsigned int)k) break;
            b++;
        }
        const uint32_t span = (uint32_t)(b + 1) << S_HSHIFT;  // keys with km - key < span
        const uint32_t lo32 = km >= span ? km - span + 1 : 0u;
        unsigned long long c = (unsigned long long)lo32 << 32;
        c = c > S_LO_FINITE ? c : S_LO_FINITE;
        res = cum <= S_KMAX ? c : 0ull;
    }
    return __shfl_sync(FULL_MASK, res, __ffs(hit) - 1);
}

// Path (a): the top_k best keys, then the host's f64 steps. Returns the id (every thread).
// The composite key threshold c of the top_k keys' candidates: every key >= c, at least top_k of them and at most
// S_KMAX, from one counting pass over the bins below the maximum key km (the nearest bins that hold top_k keys);
// 0 when those bins hold fewer than top_k finite keys or one bin overflows S_KMAX (the caller then searches).
__device__ unsigned long long topk_prefilter(const float* x, int n, uint32_t km, int k, SampleSmem& sm) {
    const int tid = threadIdx.x, lane = tid & 31;
    for (int b = tid; b < S_HBINS; b += S_THREADS) sm.hist[b] = 0;
    __syncthreads();
    row_each(x, n, [&](int, float v, bool ok) {
        const uint32_t d = km - ord_key(v);  // raw keys are at most km (the -0 -> +0 maximum)
        if (ok && v > -INFINITY && d < ((uint32_t)S_HBINS << S_HSHIFT)) atomicAdd(&sm.hist[d >> S_HSHIFT], 1u);
    });
    __syncthreads();
    if (tid < 32) {
        const unsigned long long c = prefilter_cut(sm.hist, km, k);
        if (lane == 0) sm.rs_result = c;
    }
    __syncthreads();
    return sm.rs_result;
}

__device__ uint32_t draw_topk(const float* x, int n, const SampleRow& p, uint32_t km, double u, SampleSmem& sm,
                              const SamplePre* pre) {
    const int tid = threadIdx.x;
    // the top_k keys: a prefilter's candidates sorted and cut (two passes over the row, or the grid's sample_pre_*),
    // else a radix search
    int nc;
    if (pre && pre->c) {
        nc = min(pre->ncand, (unsigned int)S_KMAX);
        for (int j = tid; j < nc; j += S_THREADS) sm.cand[j] = pre->cand[j];
        __syncthreads();
    } else {
        unsigned long long c = topk_prefilter(x, n, km, (int)p.top_k, sm);
        if (c == 0) c = radix_search(x, n, S_LO_FINITE, (double)p.top_k, false, 0.f, 0.0, sm);
        nc = gather(x, n, c, sm);
    }
    sort_desc(nc, sm);
    nc = min(nc, (int)p.top_k);
    const double mx = (double)key_value((uint32_t)(sm.cand[0] >> 32)), temp = (double)p.temperature;
    for (int j = tid; j < nc; j += S_THREADS) {
        const double l = (double)key_value((uint32_t)(sm.cand[j] >> 32));
        sm.w[j] = l == mx ? 1.0 : exp(__ddiv_rn(__dsub_rn(l, mx), temp));
    }
    __syncthreads();
    if (tid == 0) {
        double t = 0.0;
        for (int j = 0; j < nc; j++) t = __dadd_rn(t, sm.w[j]);
        sm.total = t;
    }
    __syncthreads();
    for (int j = tid; j < nc; j += S_THREADS) sm.q[j] = __ddiv_rn(sm.w[j], sm.total);
    __syncthreads();
    if (tid == 0) {
        int keep = nc;
        if (p.top_p < 1.f) {
            double acc = 0.0;
            for (int j = 0; j < nc; j++) {
                acc = __dadd_rn(acc, sm.q[j]);
                if (acc >= (double)p.top_p) {
                    keep = j + 1;
                    break;
                }
            }
        }
        if (p.min_p > 0.f) {
            int m = 0;
            while (m < keep && sm.w[m] >= (double)p.min_p) m++;
            keep = max(m, 1);
        }
        double t = 0.0;
        for (int j = 0; j < keep; j++) t = __dadd_rn(t, sm.w[j]);
        double target = __dmul_rn(u, t);
        int pick = keep - 1;
        for (int j = 0; j < keep; j++) {
            target = __dsub_rn(target, sm.w[j]);
            if (target < 0.0) {
                pick = j;
                break;
            }
        }
        sm.token = ~(uint32_t)sm.cand[pick];
    }
    __syncthreads();
    return sm.token;
}

// Path (b): thresholds on the keys, then the id-order scan. Returns the id (every thread).
__device__ uint32_t draw_scan(const float* x, int n, const SampleRow& p, float M, double u, SampleSmem& sm) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const double invT = __ddiv_rn(1.0, (double)p.temperature);
    unsigned long long lo = S_LO_FINITE;
    if (p.top_k > 0) lo = radix_search(x, n, lo, (double)p.top_k, false, 0.f, 0.0, sm);
    if (p.top_p < 1.f) {
        unsigned long long tot = 0;
        row_each(x, n, [&](int i, float v, bool ok) {
            if (ok && comp_key(v, i) >= lo) tot += fixed_weight(v, M, invT);
        });
        tot = block_reduce(tot, OpAddU64(), sm);
        lo = radix_search(x, n, lo, __dmul_rn((double)p.top_p, __ull2double_rn(tot)), true, M, invT, sm);
    }
    const float mp = p.min_p > 0.f ? fminf(p.min_p, 1.f) : 0.f;
    const int per = (n + S_THREADS - 1) / S_THREADS;
    const int i0 = min(n, tid * per), i1 = min(n, i0 + per);
    double s = 0.0;
    for (int i = i0; i < i1; i++) {
        const float v = x[i];
        if (comp_key(v, i) < lo) continue;
        const float w = weight_b(v, M, invT);
        if (w >= mp) s = __dadd_rn(s, (double)w);
    }
    sm.w[tid] = s;
    if (tid == 0) sm.winner = -1;
    __syncthreads();
    if (lane == 0) {
        double a = 0.0;
        for (int j = 0; j < 32; j++) {
            a = __dadd_rn(a, sm.w[tid + j]);
            sm.w[tid + j] = a;
        }
        sm.wex[warp] = a;
    }
    __syncthreads();
    if (tid == 0) {
        double a = 0.0;
        for (int j = 0; j < 32; j++) {
            const double t = sm.wex[j];
            sm.wex[j] = a;
            a = __dadd_rn(a, t);
        }
    }
    __syncthreads();
    const double inc = __dadd_rn(sm.wex[warp], sm.w[tid]);
    __syncthreads();
    sm.w[tid] = inc;
    __syncthreads();
    const double total = sm.w[S_THREADS - 1], target = __dmul_rn(u, total);
    const double prev = tid ? sm.w[tid - 1] : 0.0;
    // The scan is monotone, so the ranges [prev, inc) of the threads with inc > prev tile [0, total): the last of
    // them that starts at or below the target holds it (or, should u * total round up to total, the last one).
    if (prev <= target && inc > prev) atomicMax(&sm.winner, tid);
    __syncthreads();
    if (tid == sm.winner) {
        double acc = prev;
        int pick = -1, last = -1;
        for (int i = i0; i < i1 && pick < 0; i++) {
            const float v = x[i];
            if (comp_key(v, i) < lo) continue;
            const float w = weight_b(v, M, invT);
            if (!(w >= mp) || w == 0.f) continue;
            last = i;
            acc = __dadd_rn(acc, (double)w);
            if (acc > target) pick = i;
        }
        sm.token = (uint32_t)(pick >= 0 ? pick : last);
    }
    __syncthreads();
    return sm.token;
}

// ---- a lone row over the whole GPU: sample_pre_max, sample_pre_hist, sample_pre_gather
// A batch of one row leaves every SM but one idle while sample_rows walks the row three times for path (a) (the
// maximum, the prefilter's counts, the gather: ~25 us a pass over 248k logits on one SM). For a row that takes path
// (a) with nothing changing its logits (no mask, bias or penalty) and no log-probabilities, these three grid-wide
// kernels (any grid, blockDim a multiple of 32, <= 1024) make those passes into a SamplePre zeroed before the first,
// and sample_rows (row 0, `pre` non-null) takes their results instead: the same maximum (a max), the same counts
// (integer sums), the same threshold (prefilter_cut) and the same candidate set (claimed in another order, sorted
// after): the same id, bit for bit. x: the row (NaN -> -inf in place, as step 1), n its limit, k its top_k.

// Grid-stride over float4 units of the row: f(i, x[i]) for every i < n.
template <typename F>
__device__ __forceinline__ void grid_each(const float* x, int n, F f) {
    const int nu = (n + 3) >> 2, step = gridDim.x * blockDim.x;
    const bool vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < nu; u += step) {
        const int i = 4 * u;
        if (vec && i + 3 < n) {
            const float4 v = reinterpret_cast<const float4*>(x)[u];
            f(i, v.x);
            f(i + 1, v.y);
            f(i + 2, v.z);
            f(i + 3, v.w);
        } else {
            for (int j = i; j < min(n, i + 4); j++) f(j, x[j]);
        }
    }
}

// Step 1's argmax over this warp's share of a grid-wide pass over x[0, n) (grid_each): the largest comp_key(v + 0, i),
// -0 as +0 and NaN as -inf (written back: the rows are scratch), in every lane; 0 where the share is empty.
__device__ __forceinline__ unsigned long long warp_max_key(float* x, int n) {
    unsigned long long am = 0;
    grid_each(x, n, [&](int i, float v) {
        if (v != v) {
            v = -INFINITY;
            x[i] = v;
        }
        am = max(am, comp_key(__fadd_rn(v, 0.f), i));
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = max(am, __shfl_xor_sync(FULL_MASK, am, o));
    return am;
}

extern "C" __global__ void sample_pre_max(float* __restrict__ x, int n, SamplePre* __restrict__ pre) {
    KTRACE(51);
    pdl_wait();
    const unsigned long long am = warp_max_key(x, n);
    if ((threadIdx.x & 31) == 0) atomicMax(&pre->am, am);
}

extern "C" __global__ void sample_pre_hist(const float* __restrict__ x, int n, SamplePre* __restrict__ pre) {
    KTRACE(52);
    __shared__ unsigned int h[S_HBINS];
    for (int b = threadIdx.x; b < S_HBINS; b += blockDim.x) h[b] = 0;
    __syncthreads();
    pdl_wait();
    const uint32_t km = (uint32_t)(pre->am >> 32);
    grid_each(x, n, [&](int, float v) {
        const uint32_t d = km - ord_key(v);
        if (v > -INFINITY && d < ((uint32_t)S_HBINS << S_HSHIFT)) atomicAdd(&h[d >> S_HSHIFT], 1u);
    });
    __syncthreads();
    for (int b = threadIdx.x; b < S_HBINS; b += blockDim.x)
        if (h[b]) atomicAdd(&pre->hist[b], h[b]);
}

extern "C" __global__ void sample_pre_gather(const float* __restrict__ x, int n, int k, SamplePre* __restrict__ pre) {
    KTRACE(53);
    __shared__ unsigned long long cut;
    pdl_wait();
    if (threadIdx.x < 32) {
        const unsigned long long c = prefilter_cut(pre->hist, (uint32_t)(pre->am >> 32), k);
        if (threadIdx.x == 0) {
            cut = c;
            if (blockIdx.x == 0) pre->c = c;
        }
    }
    __syncthreads();
    const unsigned long long c = cut;
    if (c == 0) return;
    grid_each(x, n, [&](int i, float v) {
        const unsigned long long key = comp_key(v, i);
        if (key >= c) {
            const unsigned int s = atomicAdd(&pre->ncand, 1u);
            if (s < S_KMAX) pre->cand[s] = key;
        }
    });
}

// ---- argmax_rows: a batch of plain greedy rows (temperature <= 0; no mask, bias, penalty or log-probabilities) ----
// keys[b] = the largest comp_key(v + 0, i) over row b's first rows[b].limit logits, NaN as -inf (written back, as
// sample_rows' step 1 does): step 6's argmax of sample_rows (largest logit, -0 as +0, the lowest id on ties; all -inf:
// id 0), its token ~(uint32)keys[b]. Grid (G, B): G blocks split each row (warp_max_key, sample_pre_max's pass); one
// u64 atomicMax a warp into keys, zeroed before (a max: the same result in any order). sample_rows walks a row with
// one block (33 us a step at every B on the H200, 213 KB of code); this is two small launches' worth.
extern "C" __global__ void argmax_rows(float* __restrict__ logits, long long ld, const SampleRow* __restrict__ rows,
                                       unsigned long long* __restrict__ keys) {
    KTRACE(54);
    pdl_wait();
    const int b = blockIdx.y;
    const unsigned long long am = warp_max_key(logits + (size_t)b * (size_t)ld, (int)rows[b].limit);
    if ((threadIdx.x & 31) == 0 && am) atomicMax(&keys[b], am);
}

extern "C" __global__ void __launch_bounds__(S_THREADS, 1)
    sample_rows(float* __restrict__ logits, long long ld, const SampleRow* __restrict__ rows,
                SamplePenalty* __restrict__ pens, SampleBias* __restrict__ biases, const uint32_t* __restrict__ masks,
                SampleOut* __restrict__ outs, const SamplePre* __restrict__ pre) {
    KTRACE(50);
    __shared__ SampleSmem sm;
    const int tid = threadIdx.x;
    pdl_wait();
    const SampleRow p = rows[blockIdx.x];
    const SamplePre* pr = blockIdx.x == 0 ? pre : nullptr;  // sample_pre_* made row 0's first passes
    float* x = logits + (size_t)blockIdx.x * (size_t)ld;
    SampleOut* out = outs + blockIdx.x;
    const int n = (int)p.limit;

    // 1. NaN -> -inf, the raw maximum and the argmax (-0 counted as +0, as the host's `>` does): the draw's argmax
    // too when neither a mask, a bias nor a penalty changes the row (one pass fewer)
    unsigned long long cm = 0, am = 0;
    const bool lps = p.logprobs >= 0;  // the raw maximum is only for the log-probabilities
    if (pr) {
        am = pr->am;  // (no log-probabilities on that path)
    } else {
        row_each(x, n, [&](int i, float v, bool ok) {
            if (!ok) return;
            if (v != v) {
                v = -INFINITY;
                x[i] = v;
            }
            if (lps) cm = max(cm, comp_key(v, i));
            am = max(am, comp_key(__fadd_rn(v, 0.f), i));
        });
    }
    // 2. log-probabilities of the raw logits
    double lse = 0.0;
    int ntop = 0;
    if (p.logprobs >= 0) {
        const float m = key_value((uint32_t)(block_reduce(cm, OpMaxU64(), sm) >> 32));
        double s = 0.0;
        row_each(x, n, [&](int, float v, bool ok) {
            if (ok) s = __dadd_rn(s, (double)exp_det(__fsub_rn(v, m)));
        });
        s = block_reduce(s, OpAddD(), sm);
        lse = __dadd_rn((double)m, log(s));
        ntop = min(p.logprobs, min(n, S_MAXTOP));
        if (ntop > 0) {
            const unsigned long long c = radix_search(x, n, 0ull, (double)ntop, false, 0.f, 0.0, sm);
            const int nc = gather(x, n, c, sm);
            sort_desc(nc, sm);
            for (int j = tid; j < nc; j += S_THREADS) {
                const unsigned long long k = sm.cand[j];
                out->top[j].id = ~(uint32_t)k;
                out->top[j].logprob = __double2float_rn(__dsub_rn((double)key_value((uint32_t)(k >> 32)), lse));
            }
        }
    }
    // 3. the mask
    const uint32_t* words = p.mask_off >= 0 ? masks + p.mask_off : nullptr;
    uint32_t first = 0;
    if (words) {
        const int nw = (n + 31) >> 5;
        unsigned long long cnt = 0, fst = ~0ull;
        for (int j = tid; j < nw; j += S_THREADS) {
            uint32_t w = words[j];
            if (j == nw - 1 && (n & 31)) w &= (1u << (n & 31)) - 1u;
            cnt += __popc(w);
            if (w && fst == ~0ull) fst = 32ull * j + (unsigned long long)(__ffs(w) - 1);
        }
        cnt = block_reduce(cnt, OpAddU64(), sm);
        fst = block_reduce(fst, OpMinU64(), sm);
        if (cnt == 0) {
            if (tid == 0) {
                out->token = 0;
                out->status = S_NO_TOKEN;
                out->logprob = 0.f;
                out->n_top = 0;
            }
            return;
        }
        first = (uint32_t)fst;
        for (int i = tid; i < n; i += S_THREADS)
            if (!((words[i >> 5] >> (i & 31)) & 1u)) x[i] = -INFINITY;
    }
    __syncthreads();
    // 4. logit bias, 5. penalties (ids unique within a row: one thread per id)
    for (uint32_t j = tid; j < p.bias_len; j += S_THREADS) {
        SampleBias* e = biases + p.bias_off + j;
        if (e->id < (uint32_t)n) {
            const float v = x[e->id];
            e->raw = v;
            x[e->id] = __fadd_rn(v, e->bias);
        }
    }
    __syncthreads();
    const float rep = p.repetition_penalty;
    for (uint32_t j = tid; j < p.pen_len; j += S_THREADS) {
        SamplePenalty* e = pens + p.pen_off + j;
        if (e->id < (uint32_t)n) {
            float v = x[e->id];
            e->raw = v;
            if (rep != 1.f && rep > 0.f) v = v > 0.f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
            x[e->id] = __fsub_rn(v, __fadd_rn(p.presence_penalty, __fmul_rn(p.frequency_penalty, (float)e->count)));
        }
    }
    __syncthreads();
    // 6. the draw; the argmax is also the fallback
    cm = am;
    if (words || p.bias_len || p.pen_len) {
        cm = 0;
        row_each(x, n, [&](int i, float v, bool ok) {
            if (ok) cm = max(cm, comp_key(__fadd_rn(v, 0.f), i));
        });
    }
    cm = block_reduce(cm, OpMaxU64(), sm);
    uint32_t token = ~(uint32_t)cm;
    if (p.temperature > 0.f && cm >= S_LO_FINITE) {
        const double u = first_uniform(p.seed);
        if (p.top_k > 0 && p.top_k <= S_KMAX)
            token = draw_topk(x, n, p, (uint32_t)(cm >> 32), u, sm, pr);
        else
            token = draw_scan(x, n, p, key_value((uint32_t)(cm >> 32)), u, sm);
    }
    if (words && !((words[token >> 5] >> (token & 31)) & 1u)) token = first;
    // the token's log-probability, from its raw logit
    float lp = 0.f;
    if (p.logprobs >= 0) {
        if (tid == 0) sm.found_b = sm.found_p = 0;
        __syncthreads();
        for (uint32_t j = tid; j < p.bias_len; j += S_THREADS)
            if (biases[p.bias_off + j].id == token) {
                sm.raw_b = biases[p.bias_off + j].raw;
                sm.found_b = 1;
            }
        for (uint32_t j = tid; j < p.pen_len; j += S_THREADS)
            if (pens[p.pen_off + j].id == token) {
                sm.raw_p = pens[p.pen_off + j].raw;
                sm.found_p = 1;
            }
        __syncthreads();
        const float raw = sm.found_b ? sm.raw_b : sm.found_p ? sm.raw_p : x[token];
        lp = __double2float_rn(__dsub_rn((double)raw, lse));
    }
    if (tid == 0) {
        out->token = token;
        out->status = S_OK;
        out->logprob = lp;
        out->n_top = (uint32_t)ntop;
    }
}
