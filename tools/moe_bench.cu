// Standalone timing of the batched step's streamed expert kernels (moe_seqs.cu) on one layer's worth of full-shape
// random 4-bit experts (H 2048, I = Is = 512, 256 experts + the shared one, top-8, group 64), B tokens routed
// uniformly at random, pairs sorted and tiled as moe_align does. Each launch is timed as 24 launches in one CUDA graph
// over 6 copies of the layer (the weights come from DRAM, as in a step; median of 5). Prints, per B:
//   - the register-streamed kernels (moe_gate_up_seqs_w2, moe_down_seqs_w2) in tiles of 8, and where their time goes:
//     the same launches with the weights hot in L2 (one layer) and with every expert aliased to one (words = groups =
//     0: arithmetic and on-chip latency only), and the same bytes alone, read with whole-line 16-byte loads
//     (read_rows) and in the kernels' own pattern of 8 rows x 32 bytes a load (read_pattern);
//   - the ring kernels (moe_gate_up_ring_t{4,8}, moe_down_ring_t{4,8}) in tiles of 4 and of 8, each checked equal to
//     the register-streamed kernels bit for bit on the same pairs.
// Built by tools/cuda-check.sh into .carry/moe_bench; run on the H200 by `bash tools/cuda-run.sh moe`.
// docs/decisions.md (step 31) has what it measured and the variants it ruled out.
#include "../crates/tern-kernels/cuda/moe_seqs.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

// The bytes of moe_gate_up_seqs' blocks alone: block (x, y) reads tile y's expert's gate and up rows [64 x, +64)
// (2 x 64 KB, contiguous) with 16-byte loads, 8 in flight per thread, and keeps only an XOR of them.
__global__ void __launch_bounds__(128) read_rows(const uint4* __restrict__ w, long words16, int I, int H,
                                                 const int* __restrict__ ntile, const int* __restrict__ tiles,
                                                 unsigned* __restrict__ sink) {
    const int t = blockIdx.y;
    if (t >= *ntile) return;
    const int e = tiles[3 * t], j0 = blockIdx.x * 64, rv = H / 32;
    unsigned acc = 0;
    for (int span = 0; span < 2; span++) {
        const uint4* p = w + e * words16 + (long)(span * I + j0) * rv;
        for (int i = threadIdx.x; i < 64 * rv; i += 128 * 8) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = ldg_stream(p + i + u * 128);
#pragma unroll
            for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// The same bytes in moe_gate_up_seqs' own access pattern (lane (g, c) of warp w: 8 bytes of rows g and g + 8 of
// its 2 items per k-block of 64 columns, ld.global.nc.L2::256B), 8 k-blocks in flight, no arithmetic.
__global__ void __launch_bounds__(128) read_pattern(const uint32_t* __restrict__ w, long words, int I, int H,
                                                    const int* __restrict__ ntile, const int* __restrict__ tiles,
                                                    unsigned* __restrict__ sink) {
    const int t = blockIdx.y;
    if (t >= *ntile) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int e = tiles[3 * t], j0 = blockIdx.x * 64, rw = H / 8;
    const uint32_t* p[4];
    for (int r = 0; r < 2; r++) {
        const int j = j0 + 8 * (warp * 2 + r) + g;
        p[2 * r] = w + e * words + (long)j * rw + 2 * c;
        p[2 * r + 1] = w + e * words + (long)(I + j) * rw + 2 * c;
    }
    unsigned acc = 0;
    for (int kb0 = 0; kb0 < H / 64; kb0 += 8) {
        uint2 v[8][4];
#pragma unroll
        for (int u = 0; u < 8; u++)
#pragma unroll
            for (int q = 0; q < 4; q++) v[u][q] = mm_load2(reinterpret_cast<const uint2*>(p[q] + (kb0 + u) * 8));
#pragma unroll
        for (int u = 0; u < 8; u++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc ^= v[u][q].x ^ v[u][q].y;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// ---------------- host ----------------
static const int H = 2048, I = 512, IS = 512, E = 256, K = 8, GS = 64, LAYERS = 6;

__global__ void fill_words(uint32_t* p, long n, uint32_t seed) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = x;
    }
}
__global__ void fill_bf16(__nv_bfloat16* p, long n, uint32_t seed, float lo, float hi) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2246822519u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = __float2bfloat16(lo + (hi - lo) * (x >> 8) * (1.f / 16777216.f));
    }
}

struct Layer {
    uint32_t *gw, *dw;
    __nv_bfloat16 *gs, *gb, *ds, *db;
    // the ring kernels' tile-major copies (experts_tile)
    uint32_t *tgw, *tdw;
    __nv_bfloat16 *tgs, *tgb, *tds, *tdb;
};

struct Routing {
    int n, pairs, ntiles;
    std::vector<int> rowmap, tiles;
};

// Uniform top-8 of 256 per token, pairs sorted by expert (the shared expert's n pairs last, in token order), tiles of
// at most `tile` pairs of one expert: moe_align's layout.
static Routing route(int n, int tile, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<std::vector<int>> by(E + 1);
    for (int t = 0; t < n; t++) {
        std::vector<int> ex(E);
        for (int i = 0; i < E; i++) ex[i] = i;
        for (int i = 0; i < K; i++) {
            std::uniform_int_distribution<int> d(i, E - 1);
            std::swap(ex[i], ex[d(rng)]);
            by[ex[i]].push_back(t);
        }
        by[E].push_back(t);
    }
    Routing r;
    r.n = n;
    r.pairs = n * (K + 1);
    for (int e = 0; e <= E; e++) {
        const int p0 = (int)r.rowmap.size();
        for (int t : by[e]) r.rowmap.push_back(t);
        for (int q = 0; q < (int)by[e].size(); q += tile) {
            r.tiles.push_back(e);
            r.tiles.push_back(p0 + q);
            r.tiles.push_back(std::min(tile, (int)by[e].size() - q));
        }
    }
    r.ntiles = (int)r.tiles.size() / 3;
    return r;
}

struct DevRouting {
    int *rowmap, *tiles, *ntile;
    uint4* trows;  // each tile's tokens, 8 u16 (moe_align's trows)
    int ntiles;
};

static DevRouting upload(const Routing& r) {
    DevRouting d;
    CK(cudaMalloc(&d.rowmap, r.rowmap.size() * 4));
    CK(cudaMalloc(&d.tiles, r.tiles.size() * 4));
    CK(cudaMalloc(&d.ntile, 4));
    CK(cudaMemcpy(d.rowmap, r.rowmap.data(), r.rowmap.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.tiles, r.tiles.data(), r.tiles.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.ntile, &r.ntiles, 4, cudaMemcpyHostToDevice));
    std::vector<unsigned> tr(4 * r.ntiles, 0u);
    for (int t = 0; t < r.ntiles; t++)
        for (int i = 0; i < r.tiles[3 * t + 2] && i < 8; i++)
            tr[4 * t + i / 2] |= (unsigned)r.rowmap[r.tiles[3 * t + 1] + i] << (16 * (i & 1));
    CK(cudaMalloc(&d.trows, tr.size() * 4));
    CK(cudaMemcpy(d.trows, tr.data(), tr.size() * 4, cudaMemcpyHostToDevice));
    d.ntiles = r.ntiles;
    return d;
}

static std::vector<float> bf16_host(const __nv_bfloat16* d, long n) {
    std::vector<__nv_bfloat16> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> f(n);
    for (long i = 0; i < n; i++) f[i] = __bfloat162float(h[i]);
    return f;
}

static double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
    double m = 0, d = 0;
    for (size_t i = 0; i < a.size(); i++) {
        m = std::max(m, (double)std::fabs(ref[i]));
        d = std::max(d, (double)std::fabs(a[i] - ref[i]));
    }
    return d / std::max(m, 1e-30);
}

// Median over 5 runs of (24 launches in a graph) / 24, in microseconds.
template <typename F>
static double time_us(F launch) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    launch(st, 0);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    cudaGraph_t graph;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < 24; i++) launch(st, i % LAYERS);
    CK(cudaStreamEndCapture(st, &graph));
    cudaGraphExec_t ex;
    CK(cudaGraphInstantiate(&ex, graph, 0));
    cudaEvent_t a, z;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&z));
    std::vector<double> v;
    for (int rep = 0; rep < 6; rep++) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(ex, st));
        CK(cudaEventRecord(z, st));
        CK(cudaEventSynchronize(z));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, z));
        if (rep > 0) v.push_back(ms * 1e3 / 24);
    }
    std::sort(v.begin(), v.end());
    CK(cudaGraphExecDestroy(ex));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(st));
    return v[v.size() / 2];
}


static std::vector<Layer> g_layers;
static __nv_bfloat16* g_xn;  // the post-norm rows, bf16 (as the norm rounds them)
static __nv_bfloat16 *g_act_ref, *g_act;
static float *g_y_ref, *g_y;
static unsigned* g_sink;
static const long GW = (long)(E + 1) * 2 * I * H / 8, GG = (long)(E + 1) * 2 * I * H / GS;
static const long DW = (long)(E + 1) * H * I / 8, DG = (long)(E + 1) * H * I / GS;
static const long GU_WORDS = (long)2 * I * H / 8, GU_GROUPS = (long)2 * I * H / GS;
static const long DN_WORDS = (long)H * I / 8, DN_GROUPS = (long)H * I / GS;
static const int PCAP = 64 * (K + 1);

// Shared memory of the kernels (batch.rs mma_smem / ring_smem for these shapes).
static int mma_smem(int k) { return k * 16 + k / 64 * 8 * 4 + 2 * 128 * (8 * (((k / GS + 7) / 8) | 1)) * 2; }
static int ring_smem(int cols, int tgs) {
    return ((cols / 8 * tgs * 16 + cols / 64 * tgs * 4 + 127) & ~127) + RING_NW * RING_S * RING_SLOT;
}

// Both kinds of each projection take the same arguments (the ring kernels ignore gshift).
typedef void (*GuKernel)(const uint32_t*, const __nv_bfloat16*, const __nv_bfloat16*, long, long, int, int, int, int,
                         int, const __nv_bfloat16*, const int*, const int*, const uint4*, __nv_bfloat16*, int);
typedef void (*DnKernel)(const uint32_t*, const __nv_bfloat16*, const __nv_bfloat16*, long, long, int, int, int, int,
                         int, const __nv_bfloat16*, int, const int*, const int*, float*);

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    g_layers.resize(LAYERS);
    for (int l = 0; l < LAYERS; l++) {
        Layer& L = g_layers[l];
        // the row-major buffers, then the ring kernels' tile-major copies of them
        for (uint32_t** p : {&L.gw, &L.tgw}) CK(cudaMalloc(p, GW * 4));
        for (uint32_t** p : {&L.dw, &L.tdw}) CK(cudaMalloc(p, DW * 4));
        for (__nv_bfloat16** p : {&L.gs, &L.gb, &L.tgs, &L.tgb}) CK(cudaMalloc(p, GG * 2));
        for (__nv_bfloat16** p : {&L.ds, &L.db, &L.tds, &L.tdb}) CK(cudaMalloc(p, DG * 2));
        fill_words<<<1024, 256>>>(L.gw, GW, 17 + l);
        fill_words<<<1024, 256>>>(L.dw, DW, 91 + l);
        fill_bf16<<<1024, 256>>>(L.gs, GG, 3 + l, 0.002f, 0.02f);
        fill_bf16<<<1024, 256>>>(L.gb, GG, 5 + l, -0.1f, 0.1f);
        fill_bf16<<<1024, 256>>>(L.ds, DG, 7 + l, 0.002f, 0.02f);
        fill_bf16<<<1024, 256>>>(L.db, DG, 9 + l, -0.1f, 0.1f);
        static_assert(IS == I, "one experts_tile launch a buffer needs the shared expert's size to be I");
        experts_tile<<<1024, 256>>>((const uint4*)L.gw, (const uint2*)L.gs, (const uint2*)L.gb, GU_WORDS, GU_GROUPS,
                                    E + 1, 0, I, H, (uint4*)L.tgw, (uint2*)L.tgs, (uint2*)L.tgb);
        experts_tile<<<1024, 256>>>((const uint4*)L.dw, (const uint2*)L.ds, (const uint2*)L.db, DN_WORDS, DN_GROUPS,
                                    E + 1, 1, I, H, (uint4*)L.tdw, (uint2*)L.tds, (uint2*)L.tdb);
        CK(cudaGetLastError());
    }
    CK(cudaMalloc(&g_xn, 64L * H * 2));
    {
        std::vector<__nv_bfloat16> x(64L * H);
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-1.f, 1.f);
        for (auto& v : x) v = __float2bfloat16(u(rng));
        CK(cudaMemcpy(g_xn, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    }
    CK(cudaMalloc(&g_act_ref, (size_t)PCAP * I * 2));
    CK(cudaMalloc(&g_act, (size_t)PCAP * I * 2));
    CK(cudaMalloc(&g_y_ref, (size_t)PCAP * H * 4));
    CK(cudaMalloc(&g_y, (size_t)PCAP * H * 4));
    CK(cudaMalloc(&g_sink, 4));
    const GuKernel gu_ring[2] = {moe_gate_up_ring_t4, moe_gate_up_ring_t8};
    const DnKernel dn_ring[2] = {moe_down_ring_t4, moe_down_ring_t8};
    for (auto k : {moe_gate_up_seqs_w2, gu_ring[0], gu_ring[1]})
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
    for (auto k : {moe_down_seqs_w2, dn_ring[0], dn_ring[1]})
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
    CK(cudaDeviceSynchronize());
    int bad = 0;
    for (int n : {1, 8, 32, 64}) {
        for (int tile : {8, 4}) {
            const Routing r = route(n, tile, 1234 + n);
            const DevRouting d = upload(r);
            int distinct = 0;
            for (int t = 0; t < r.ntiles; t++)
                if (t == 0 || r.tiles[3 * t] != r.tiles[3 * (t - 1)]) distinct++;
            const double gbytes = distinct * (2.0 * I * H / 2 + 2.0 * I * H / GS * 4);
            const double dbytes = distinct * (1.0 * I * H / 2 + 1.0 * I * H / GS * 4);
            auto gu_w2 = [&](cudaStream_t st, int li, long words, long groups) {
                const Layer& L = g_layers[li];
                moe_gate_up_seqs_w2<<<dim3(I / 64, d.ntiles), 128, mma_smem(H), st>>>(
                    L.gw, L.gs, L.gb, words, groups, E, I, IS, H, 1, g_xn, d.ntile, d.tiles, d.trows, g_act_ref, I);
            };
            auto dn_w2 = [&](cudaStream_t st, int li) {
                const Layer& L = g_layers[li];
                moe_down_seqs_w2<<<dim3(H / 128, d.ntiles), 128, mma_smem(I), st>>>(
                    L.dw, L.ds, L.db, DN_WORDS, DN_GROUPS, E, I, IS, H, 1, g_act_ref, I, d.ntile, d.tiles, g_y_ref);
            };
            const int tg = tile == 4 ? 0 : 1;
            auto gu_r = [&](cudaStream_t st, int li) {
                const Layer& L = g_layers[li];
                gu_ring[tg]<<<dim3(I / 64, d.ntiles), 128, ring_smem(H, tile), st>>>(
                    L.tgw, L.tgs, L.tgb, GU_WORDS, GU_GROUPS, E, I, IS, H, 1, g_xn, d.ntile, d.tiles, d.trows, g_act, I);
            };
            auto dn_r = [&](cudaStream_t st, int li) {
                const Layer& L = g_layers[li];
                dn_ring[tg]<<<dim3(H / 256, d.ntiles), 128, ring_smem(I, tile), st>>>(
                    L.tdw, L.tds, L.tdb, DN_WORDS, DN_GROUPS, E, I, IS, H, 1, g_act_ref, I, d.ntile, d.tiles, g_y);
            };
            printf("B=%d, tiles of %d: %d distinct experts (with the shared one), %d tiles; gate|up %.1f MB, down %.1f MB\n",
                   n, tile, distinct, d.ntiles, gbytes / 1e6, dbytes / 1e6);
            auto row = [&](const char* what, double us, double bytes) {
                printf("  %-46s %8.2f us  %5.2f TB/s\n", what, us, bytes / us * 1e-6);
            };
            row("gate|up, register-streamed (w2)", time_us([&](cudaStream_t st, int li) { gu_w2(st, li, GU_WORDS, GU_GROUPS); }), gbytes);
            if (tile == 8) {
                row("  the same, weights hot in L2 (one layer)", time_us([&](cudaStream_t st, int) { gu_w2(st, 0, GU_WORDS, GU_GROUPS); }), gbytes);
                row("  the same, every expert aliased to one", time_us([&](cudaStream_t st, int li) { gu_w2(st, li, 0, 0); }), gbytes);
                row("  its bytes alone, whole lines (read_rows)", time_us([&](cudaStream_t st, int li) {
                    read_rows<<<dim3(I / 64, d.ntiles), 128, 0, st>>>(reinterpret_cast<const uint4*>(g_layers[li].gw),
                                                                     GU_WORDS / 4, I, H, d.ntile, d.tiles, g_sink);
                }), gbytes);
                row("  its bytes alone, its pattern (read_pattern)", time_us([&](cudaStream_t st, int li) {
                    read_pattern<<<dim3(I / 64, d.ntiles), 128, 0, st>>>(g_layers[li].gw, GU_WORDS, I, H, d.ntile,
                                                                        d.tiles, g_sink);
                }), gbytes);
            }
            row(tile == 4 ? "gate|up, ring (moe_gate_up_ring_t4)" : "gate|up, ring (moe_gate_up_ring_t8)", time_us(gu_r), gbytes);
            row("down, register-streamed (w2)", time_us(dn_w2), dbytes);
            row(tile == 4 ? "down, ring (moe_down_ring_t4)" : "down, ring (moe_down_ring_t8)", time_us(dn_r), dbytes);
            // the ring kernels against the register-streamed ones on layer 0: bit for bit
            gu_w2(0, 0, GU_WORDS, GU_GROUPS);
            gu_r(0, 0);
            dn_w2(0, 0);
            dn_r(0, 0);
            CK(cudaDeviceSynchronize());
            const std::vector<float> a0 = bf16_host(g_act_ref, (long)r.pairs * I), a1 = bf16_host(g_act, (long)r.pairs * I);
            std::vector<float> y0((long)r.pairs * H), y1((long)r.pairs * H);
            CK(cudaMemcpy(y0.data(), g_y_ref, y0.size() * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(y1.data(), g_y, y1.size() * 4, cudaMemcpyDeviceToHost));
            const bool same = a0 == a1 && y0 == y1;
            bad += !same;
            printf("  ring = register-streamed, bit for bit: %s (gate|up %.1e, down %.1e)\n", same ? "yes" : "NO",
                   rel_err(a1, a0), rel_err(y1, y0));
            CK(cudaFree(d.rowmap));
            CK(cudaFree(d.trows));
            CK(cudaFree(d.tiles));
            CK(cudaFree(d.ntile));
        }
    }
    return bad ? 1 : 0;
}
