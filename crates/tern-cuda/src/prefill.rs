//! The launch wrappers of the multi-token kernels (crates/tern-kernels/cuda/{gemm,prefill,flash}.cu), which the
//! forward pass ([`crate::forward::layers_pass`]) runs over a pass's prompt rows, and the buffers whose layout they
//! define: the tensor-core GEMM over 4-bit weights (dense and grouped by expert), the embedding, norms, router,
//! top-k, expert sort and combine over rows, the chunked Gated DeltaNet (gdn_prep: conv + SiLU + l2-norms + gates;
//! gdn_chunk_prep: the UT transform of chunks of 64; gdn_chunk_scan: the state across chunks, fp32; gdn_ring;
//! gdn_gated_norm), and attention's prep (norms, RoPE, K/V into the cache) and causal flash attention. The
//! per-sequence kernels read each sequence's state through the pass tables and its rows through a [`SegTable`], so
//! one launch serves every sequence of a pass.
//!
//! Activations are f32 except GEMM inputs (bf16); weights stay 4-bit. Every launch goes through a safe wrapper
//! below that checks the shapes and buffer lengths it is given.

use anyhow::{bail, ensure, Result};
use cudarc::driver::{CudaSlice, CudaView};
use tern_model::Config;

use crate::gpu::{cfg, Experts, Gpu, QMat, NULL};

/// The most rows of the streamed few-token dense kernels (`Gpu::dense_seqs`, the lm_head of a decode pass) and the
/// decode batches' expert tile ([`stream_tile`]): a decode pass of more rows takes the GEMMs.
pub const STREAM_ROWS: usize = 64;
/// Chunk length of the chunked Gated DeltaNet (GC in prefill.cu).
pub(crate) const GDN_CHUNK: usize = 64;
/// State columns per block of `gdn_chunk_state` and output columns per block of `gdn_chunk_out` (prefill.cu `GS_C`,
/// `GO_C`): the launch grids and shared-memory sizes below follow them.
const GDN_STATE_COLS: usize = 32;
const GDN_OUT_COLS: usize = 64;
/// Token tile of the grouped MoE GEMMs (BN of gemm_q4_swiglu / gemm_q4_gstore).
pub(crate) const MOE_TILE: usize = 64;
/// Shared memory of the GEMM instantiations (GemmCfg in gemm.cu; static_asserts there): on wgmma (the tiles
/// unpadded, 1 KB of alignment slack) and on mma.sync.
const GEMM_DENSE_SMEM: usize = 3 * (4096 + 128 * 128) + 2 * 128 * 128 + 1024;
const GEMM_GROUPED_SMEM: usize = 4 * (4096 + 64 * 128) + 2 * 128 * 128 + 1024;
const GEMM_DENSE_SMEM_MMA: usize = 3 * (4096 + 128 * 144) + 2 * 128 * 144;
const GEMM_GROUPED_SMEM_MMA: usize = 4 * (4096 + 64 * 144) + 2 * 128 * 144;

pub(crate) fn log2_exact(v: usize, what: &str) -> Result<i32> {
    ensure!(v.is_power_of_two(), "{what} {v} is not a power of two");
    Ok(v.trailing_zeros() as i32)
}

/// Pairs per tile of the streamed expert kernels (moe_seqs.cu: MM_TG, the mma's n): one pass over a tile's tokens,
/// so that an expert many tokens share (the shared expert holds every token) is spread over many blocks rather than
/// looped over in one. Decode batches take tiles of [`STREAM_TILE_DECODE`] ([`stream_tile`]).
pub const STREAM_TILE: usize = 8;
/// Pairs per tile of the streamed expert kernels in a pass of at most [`STREAM_ROWS`] rows (a decode
/// batch): most routed experts get 1-2 of its pairs, and the ring kernels' 4 token slots halve their staged
/// activations (shared memory: 4 blocks a multiprocessor instead of 3). Measured on the H200 (tools/moe_bench.cu, the
/// ring kernels): gate|up at B = 8 / 32 / 64 29.1 / 69.5 / 94.1 us in tiles of 4 against 33.3 / 73.3 / 94.2 in tiles
/// of 8, down 15.2 / 34.9 / 46.1 against 15.5 / 35.1 / 44.6.
pub const STREAM_TILE_DECODE: usize = 4;

/// The streamed expert kernels' tile for a pass of `n` rows.
pub fn stream_tile(n: usize) -> usize {
    match n <= STREAM_ROWS {
        true => STREAM_TILE_DECODE,
        false => STREAM_TILE,
    }
}

/// Upper bound of moe_align's tiles of `tile` pairs for `n` tokens of `k` routed pairs each and the shared expert's
/// `n`: the routed experts' counts c_e (sum n k, at most min(experts, n k) of them nonzero) give sum ceil(c_e / tile)
/// <= (n k + min(experts, n k) (tile - 1)) / tile tiles, and never more than n k; the shared expert ceil(n / tile).
/// The expert kernels' grids have this many rows (blocks past the list's length exit at once). The earlier bound,
/// n (k + 1) / tile + experts + 1, made 275 rows at B = 8 where at most 66 hold work; the step was no faster for
/// the tighter one (tern bench, H200: 4.157 -> 4.162 ms), but the down kernel's blocks now find room beside the
/// gate|up blocks and wait there (their trace's early 3.5 -> 30 us, run 15.2 -> 14.6 us).
pub fn max_moe_tiles(n: usize, k: usize, experts: usize, tile: usize) -> usize {
    let routed = n * k;
    let spread = (routed + routed.min(experts) * (tile - 1)) / tile;
    routed.min(spread) + n.div_ceil(tile)
}

/// Dimensions of a Gated DeltaNet layer: (key heads, value heads, key dim, value dim, conv taps).
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub taps: usize,
}

impl GdnDims {
    pub fn of(c: &Config) -> GdnDims {
        GdnDims {
            hk: c.linear_num_key_heads,
            hv: c.linear_num_value_heads,
            dk: c.linear_key_head_dim,
            dv: c.linear_value_head_dim,
            taps: c.linear_conv_kernel_dim,
        }
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
    fn check(&self) -> Result<()> {
        let d = self;
        ensure!(
            d.hk > 0 && d.hv % d.hk == 0 && d.dk <= 128 && d.dv <= 128 && d.dk % 4 == 0 && d.dv > 0 && d.taps >= 1,
            "gdn: needs value heads a multiple of key heads, key/value head dims <= 128 (key dim % 4 == 0): {d:?}"
        );
        Ok(())
    }
    /// Scratch floats of the chunked kernels for `chunks` chunks of 64 tokens: (U, W, P, G, chunk states).
    fn chunk_sizes(&self, chunks: usize) -> [usize; 5] {
        let ch = chunks * self.hv * GDN_CHUNK;
        [ch * self.dv, ch * self.dk, ch * GDN_CHUNK, ch, chunks * self.hv * self.dk * self.dv]
    }
}

/// The 64-row chunks a sequence's `rows` new rows take in a prefill pass (GDN chunks, flash query tiles).
pub fn pass_chunks(rows: usize) -> usize {
    rows.div_ceil(GDN_CHUNK)
}

/// The sequences of a prefill pass as its per-sequence kernels read them (`Seg` in common.cuh): sequence s owns
/// the next `rows` rows of the pass after the sequences before it, from its position `pos0` on, and the next
/// [`pass_chunks`]`(rows)` chunks; `[first row, rows, pos0, first chunk]` per sequence on the device. A pass of
/// one sequence is one entry.
pub struct SegTable {
    pub(crate) dev: CudaSlice<i32>,
    n: usize,
    rows: usize,
    chunks: usize,
}

impl SegTable {
    /// A table with room for `max` sequences (empty until [`SegTable::set`]).
    pub fn new(g: &Gpu, max: usize) -> Result<SegTable> {
        Ok(SegTable { dev: g.zeros(4 * max.max(1))?, n: 0, rows: 0, chunks: 0 })
    }

    /// Upload the sequences of a pass: `(rows, pos0)` each, every one at least one row.
    pub fn set(&mut self, g: &Gpu, seqs: &[(usize, usize)]) -> Result<()> {
        let max = self.dev.len() / 4;
        ensure!(!seqs.is_empty() && seqs.len() <= max, "a prefill pass of {} sequences (1..={max})", seqs.len());
        let (mut host, mut rows, mut chunks) = (Vec::with_capacity(4 * seqs.len()), 0usize, 0usize);
        for &(k, pos0) in seqs {
            ensure!(k > 0, "a sequence of a prefill pass without rows");
            ensure!(rows + k + pos0 <= i32::MAX as usize, "a prefill pass past 2^31 rows or positions");
            host.extend([rows, k, pos0, chunks].map(|v| v as i32));
            rows += k;
            chunks += pass_chunks(k);
        }
        g.stream.memcpy_htod(&host, &mut self.dev.slice_mut(..host.len()))?;
        (self.n, self.rows, self.chunks) = (seqs.len(), rows, chunks);
        Ok(())
    }

    /// Sequences whose rows are not laid end to end: `(first row, rows, pos0)` each (a verify's kept rows within the
    /// rows it read); `rows()` is then the end of the last row used. The chunk column is left 0 (for the kernels that
    /// take rows one by one: gdn_ring and the GDN commit, not the chunked ones).
    pub fn set_at(&mut self, g: &Gpu, seqs: &[(usize, usize, usize)]) -> Result<()> {
        let max = self.dev.len() / 4;
        ensure!(!seqs.is_empty() && seqs.len() <= max, "a pass of {} sequences (1..={max})", seqs.len());
        let (mut host, mut end) = (Vec::with_capacity(4 * seqs.len()), 0usize);
        for &(r0, k, pos0) in seqs {
            ensure!(k > 0, "a sequence of a pass without rows");
            ensure!(r0 + k + pos0 <= i32::MAX as usize, "a pass past 2^31 rows or positions");
            host.extend([r0, k, pos0, 0].map(|v| v as i32));
            end = end.max(r0 + k);
        }
        g.stream.memcpy_htod(&host, &mut self.dev.slice_mut(..host.len()))?;
        (self.n, self.rows, self.chunks) = (seqs.len(), end, 0);
        Ok(())
    }

    /// Sequences, rows and chunks of the pass.
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn chunks(&self) -> usize {
        self.chunks
    }
}

/// The expert-sorted (token, slot) pairs of one MoE layer and their tile list (moe_align): tiles of at most `tile`
/// pairs of one expert (the grouped GEMMs take 64, the streamed kernels [`stream_tile`]).
pub struct MoeSorted {
    pub rowmap: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    pub ntile: CudaSlice<i32>,
    pub tiles: CudaSlice<i32>,
    /// Each tile's tokens for tiles of at most 8 pairs (moe_align's `trows`: 8 u16 a tile, as 4 u32).
    pub trows: CudaSlice<u32>,
    pub n: usize,
    pub k: usize,
    pub experts: usize,
    pub tile: usize,
    pub max_tiles: usize,
}

impl MoeSorted {
    /// Record what the buffers now hold: `n` rows' top-`k` over `experts` in `max_tiles` tiles of `tile` pairs.
    pub(crate) fn holds(&mut self, n: usize, k: usize, experts: usize, tile: usize, max_tiles: usize) {
        (self.n, self.k, self.experts, self.tile, self.max_tiles) = (n, k, experts, tile, max_tiles);
    }

    pub fn new(g: &Gpu, cap: usize, k: usize, experts: usize) -> Result<MoeSorted> {
        let pairs = cap * (k + 1);
        Ok(MoeSorted {
            rowmap: g.zeros(pairs)?,
            pos: g.zeros(pairs)?,
            ntile: g.zeros(1)?,
            tiles: g.zeros(3 * max_moe_tiles(cap, k, experts, STREAM_TILE_DECODE))?,
            trows: g.zeros(4 * max_moe_tiles(cap, k, experts, STREAM_TILE_DECODE))?,
            n: 0,
            k,
            experts,
            tile: 0,
            max_tiles: 0,
        })
    }
}

/// U (then D), W, P, G and the chunks' starting states of the chunked delta rule.
pub struct GdnChunkScratch {
    pub u: CudaSlice<f32>,
    pub w: CudaSlice<f32>,
    pub p: CudaSlice<f32>,
    pub g: CudaSlice<f32>,
    pub s: CudaSlice<f32>,
}

impl GdnChunkScratch {
    /// Room for the chunks of a pass of `cap` rows of one sequence (a pass of several takes up to one chunk more
    /// per sequence: [`pass_fits`]).
    pub fn new(gpu: &Gpu, d: GdnDims, cap: usize) -> Result<GdnChunkScratch> {
        let [u, w, p, g, s] = d.chunk_sizes(pass_chunks(cap));
        Ok(GdnChunkScratch { u: gpu.zeros(u)?, w: gpu.zeros(w)?, p: gpu.zeros(p)?, g: gpu.zeros(g)?, s: gpu.zeros(s)? })
    }

    fn holds(&self, d: GdnDims, chunks: usize) -> bool {
        let [u, w, p, g, s] = d.chunk_sizes(chunks);
        self.u.len() >= u && self.w.len() >= w && self.p.len() >= p && self.g.len() >= g && self.s.len() >= s
    }
}

/// A prefill pass of at most this many tokens takes the streamed expert kernels where the model's shapes allow
/// ([`DeviceModel::streamed_moe`]): with a few pairs per routed expert the grouped GEMMs' 64-token tiles are mostly
/// empty (a 256-token pass: 0.34 ms a layer for gate|up, measured), while the streamed kernels read each expert once
/// per 8 pairs. The same line splits the dense GEMMs' K ([`gemm_split`]). The line is where the two meet on the
/// H200 (TTFT of one prompt, streamed / GEMM: 384 tokens 32.4 / 43.7 ms, 512 37.0 / 48.9, 768 51.0 / 53.2, 1,024
/// 64.8 / 60.5).
pub const STREAM_MAX_TOKENS: usize = 768;

/// The K-split of the dense GEMM in a short pass (at most [`STREAM_MAX_TOKENS`] rows; longer ones fill the GPU with
/// token tiles and take 1) for a weight of `rows` x `cols`: doubled while the blocks of one 128-token tile would
/// still fill at most half the multiprocessors' two slots each, up to 8 (a cluster) and at least 8 k-steps of 64 a
/// block. out_proj and o_proj (2,048 rows of 4,096): 4, so a 128-token launch has 64 blocks instead of 16 (74 -> 21
/// us at 8 rows on the H200). A row's sums so depend only on the weight and on which side of the line the pass is,
/// as the MoE's kernels do ([`DeviceModel::prefill_experts`]); at 4,096 rows the split cost 2.4 ms a prefill.
pub(crate) fn gemm_split(rows: usize, cols: usize, sms: usize) -> usize {
    let (tiles, ksteps) = (rows.div_ceil(128), cols.div_ceil(64));
    let mut kz = 1;
    while kz < 8 && 2 * tiles * 2 * kz <= sms && ksteps >= 2 * kz * 8 {
        kz *= 2;
    }
    kz
}

/// The shapes a dense 4-bit product over `n` bf16 rows takes (gemm_q4, dense_seqs): 4-bit W, cols a multiple of
/// 32, a power-of-two group size ≥ 32 dividing them; x holding n rows of cols, y n rows of stride ldy ≥ W.rows.
pub(crate) fn check_dense(
    m: &QMat,
    x: &CudaSlice<u16>,
    n: usize,
    y: &CudaSlice<f32>,
    ldy: usize,
    what: &str,
) -> Result<()> {
    ensure!(m.bits == 4, "{what}: {}-bit weights (4-bit only)", m.bits);
    ensure!(
        m.cols % 32 == 0 && m.gs >= 32 && m.gs.is_power_of_two() && m.cols % m.gs == 0,
        "{what}: cols {} / group size {} (need multiples of 32)",
        m.cols,
        m.gs
    );
    ensure!(n > 0 && x.len() >= n * m.cols, "{what}: x holds {} values, {n} rows of {} needed", x.len(), m.cols);
    ensure!(ldy >= m.rows && y.len() >= (n - 1) * ldy + m.rows, "{what}: y too short for {n} rows of stride {ldy}");
    Ok(())
}

impl Gpu {
    /// `y[n, r] = Σ_k x[n, k] W[r, k]` (or `+=` when `add`) for `n` token rows of bf16 `x` (`[n, W.cols]`), `y`
    /// f32 with row stride `ldy` ≥ W.rows. W 4-bit, cols a multiple of 32, group size a power of two ≥ 32.
    pub fn gemm_q4(
        &self,
        m: &QMat,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        ldy: usize,
        add: bool,
    ) -> Result<()> {
        check_dense(m, x, n, y, ldy, "gemm_q4")?;
        ensure!(n.div_ceil(128) <= 65535, "gemm_q4: {n} rows is over the grid limit");
        let glog = log2_exact(m.gs, "gemm_q4: group size")?;
        let wg = self.gemm_wgmma.load(std::sync::atomic::Ordering::Relaxed);
        let (f, smem) = match (wg, add) {
            (true, true) => (&self.f.gemm_q4_add, GEMM_DENSE_SMEM),
            (true, false) => (&self.f.gemm_q4_store, GEMM_DENSE_SMEM),
            (false, true) => (&self.f.gemm_q4_add_mma, GEMM_DENSE_SMEM_MMA),
            (false, false) => (&self.f.gemm_q4_store_mma, GEMM_DENSE_SMEM_MMA),
        };
        let (z64, z32) = (0i64, 0i32);
        let (r, k, ni, ld) = (m.rows as i32, m.cols as i32, n as i32, ldy as i32);
        let kz = if n <= STREAM_MAX_TOKENS { gemm_split(m.rows, m.cols, self.sms as usize) } else { 1 };
        let mut l = self.launcher(f);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&z64).arg(&z64).arg(&r).arg(&k).arg(&glog).arg(&z32).arg(&z32).arg(&z32);
        l.arg(x).arg(&k).arg(&ni).arg(&NULL).arg(&NULL).arg(&NULL).arg(&*y).arg(&ld);
        l.cluster = (kz > 1).then_some((1, 1, kz as u32));
        let mut lc = cfg((m.rows.div_ceil(128) as u32, n.div_ceil(128) as u32), 256, smem);
        lc.grid_dim.2 = kz as u32;
        // SAFETY: matches gemm_q4_store/_add (GEMM_Q4 in gemm.cu); x holds n rows of cols bf16, y n rows of stride
        // ldy >= rows (checked above); W is a whole QMat (rows x cols/8 words, rows x cols/gs scales/biases); rows and
        // tokens past the ends are zero-filled and never stored; shared memory as GemmCfg<128, *, 3, wg> (its ring
        // and dequant tiles hold a block's 64 KB of split sums); kz <= 8 blocks a cluster, each with at least one k-step (gemm_split).
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// Grouped gate|up + SwiGLU over the expert-sorted pairs of [`Gpu::moe_align`]: `act[p, j] = bf16(silu(G_e[j] ·
    /// x[rowmap[p]]) · (U_e[j] · x[rowmap[p]]))`, act `[pairs, max(I, Is)]`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_rows(
        &self,
        gu: &Experts,
        n_experts: usize,
        (i, is): (usize, usize),
        h: usize,
        x: &CudaSlice<u16>,
        n: usize,
        k: usize,
        sorted: &MoeSorted,
        act: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let imax = i.max(is);
        let pairs = n * (k + 1);
        ensure!(h % 32 == 0 && gu.gs >= 32 && i % 8 == 0 && is % 8 == 0, "moe_gate_up_rows: sizes {h}/{i}/{is}");
        ensure!(x.len() >= n * h && act.len() >= pairs * imax, "moe_gate_up_rows: buffers");
        ensure!(gu.w.len() >= n_experts * gu.words + 2 * is * h / 8, "moe_gate_up_rows: expert buffer too short");
        ensure!(
            sorted.n == n && sorted.k == k && sorted.experts == n_experts,
            "moe_gate_up_rows: align of another shape"
        );
        let glog = log2_exact(gu.gs, "moe_gate_up_rows: group size")?;
        let (words, groups) = (gu.words as i64, gu.groups as i64);
        let (hi, ii, isi, ei, ni, ld) = (h as i32, i as i32, is as i32, n_experts as i32, n as i32, imax as i32);
        let (f, smem) = match self.gemm_wgmma.load(std::sync::atomic::Ordering::Relaxed) {
            true => (&self.f.gemm_q4_swiglu, GEMM_GROUPED_SMEM),
            false => (&self.f.gemm_q4_swiglu_mma, GEMM_GROUPED_SMEM_MMA),
        };
        let mut l = self.launcher(f);
        l.arg(&gu.w).arg(&gu.s).arg(&gu.b).arg(&words).arg(&groups).arg(&hi).arg(&hi).arg(&glog).arg(&ii).arg(&isi);
        l.arg(&ei)
            .arg(x)
            .arg(&hi)
            .arg(&ni)
            .arg(&sorted.ntile)
            .arg(&sorted.tiles)
            .arg(&sorted.rowmap)
            .arg(&*act)
            .arg(&ld);
        let grid = (imax.div_ceil(64) as u32, sorted.max_tiles as u32);
        // SAFETY: matches gemm_q4_swiglu (gemm.cu); the tiles come from moe_align over the same n, k and experts
        // (checked above): expert ids <= n_experts (the shared one last, inside the buffer), pairs < n*(k+1) rows of act,
        // rowmap entries < n rows of x; blocks past *ntile exit; shared memory as GemmCfg<64, GE_SWIGLU, 4, wg>.
        unsafe { l.launch(cfg(grid, 256, smem)) }?;
        Ok(())
    }

    /// Grouped down projection: `ybuf[p, r] = D_e[r] · act[p]` (f32 `[pairs, h]`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_rows(
        &self,
        down: &Experts,
        n_experts: usize,
        (i, is): (usize, usize),
        h: usize,
        act: &CudaSlice<u16>,
        sorted: &MoeSorted,
        ybuf: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let imax = i.max(is);
        let pairs = sorted.n * (sorted.k + 1);
        ensure!(i % 32 == 0 && is % 32 == 0 && down.gs >= 32, "moe_down_rows: inner sizes {i}/{is} (need % 32)");
        ensure!(act.len() >= pairs * imax && ybuf.len() >= pairs * h, "moe_down_rows: buffers");
        ensure!(down.w.len() >= n_experts * down.words + h * is / 8, "moe_down_rows: expert buffer too short");
        ensure!(sorted.experts == n_experts, "moe_down_rows: align of another shape");
        let glog = log2_exact(down.gs, "moe_down_rows: group size")?;
        let (words, groups) = (down.words as i64, down.groups as i64);
        let (hi, ii, isi, ei, ld, np) = (h as i32, i as i32, is as i32, n_experts as i32, imax as i32, pairs as i32);
        let (f, smem) = match self.gemm_wgmma.load(std::sync::atomic::Ordering::Relaxed) {
            true => (&self.f.gemm_q4_gstore, GEMM_GROUPED_SMEM),
            false => (&self.f.gemm_q4_gstore_mma, GEMM_GROUPED_SMEM_MMA),
        };
        let mut l = self.launcher(f);
        l.arg(&down.w).arg(&down.s).arg(&down.b).arg(&words).arg(&groups).arg(&hi).arg(&ii).arg(&glog).arg(&ii);
        l.arg(&isi).arg(&ei).arg(act).arg(&ld).arg(&np).arg(&sorted.ntile).arg(&sorted.tiles).arg(&NULL).arg(&*ybuf);
        l.arg(&hi);
        let grid = (h.div_ceil(128) as u32, sorted.max_tiles as u32);
        // SAFETY: matches gemm_q4_gstore (gemm.cu); tiles from moe_align (see moe_gate_up_rows): pairs < rows of act
        // and ybuf, expert ids inside the buffer; K per expert = its inner size (<= imax = act's row stride).
        unsafe { l.launch(cfg(grid, 256, smem)) }?;
        Ok(())
    }

    /// `x[r] = dequant(embed[ids[r]])` for the host ids (checked against the table, uploaded into `dev_ids`).
    pub fn embed_rows(
        &self,
        m: &QMat,
        ids: &[u32],
        dev_ids: &mut CudaSlice<i32>,
        x: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(m.bits == 4 && m.cols % 8 == 0, "embed_rows: {}-bit / {} cols", m.bits, m.cols);
        ensure!(!ids.is_empty() && dev_ids.len() >= ids.len() && x.len() >= ids.len() * m.cols, "embed_rows: buffers");
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= m.rows) {
            bail!("token id {bad} is outside the vocabulary (size {})", m.rows);
        }
        let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        self.stream.memcpy_htod(&v, &mut dev_ids.slice_mut(..v.len()))?;
        self.embed_rows_dev(m, dev_ids, ids.len(), x)
    }

    /// [`Gpu::embed_rows`] of the first `n` ids already on the device (each `< m.rows`: the caller checked them
    /// before uploading; the kernel reads whatever is there), a launch only (graph capture).
    pub fn embed_rows_dev(&self, m: &QMat, dev_ids: &CudaSlice<i32>, n: usize, x: &mut CudaSlice<f32>) -> Result<()> {
        ensure!(m.bits == 4 && m.cols % 8 == 0, "embed_rows: {}-bit / {} cols", m.bits, m.cols);
        ensure!(n > 0 && dev_ids.len() >= n && x.len() >= n * m.cols, "embed_rows: buffers");
        let glog = log2_exact(m.gs, "embed_rows: group size")?;
        let cols = m.cols as i32;
        let mut l = self.launcher(&self.f.embed_rows);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&cols).arg(&glog).arg(dev_ids).arg(&*x);
        // SAFETY: matches embed_rows (prefill.cu); the first n device ids are < rows (the callers check the ids
        // they upload), x holds n rows.
        unsafe { l.launch(cfg((n as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// `xb[r] = bf16(RMSNorm(x[r]) * gain)` (and the f32 values into `xn`) for `n` rows of `h`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_rows(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        gain: &CudaSlice<f32>,
        eps: f32,
        xb: &mut CudaSlice<u16>,
        xn: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let h = gain.len();
        ensure!(h <= 4096 && n > 0, "rmsnorm_rows: {n} rows of {h} (at most 4096 columns)");
        ensure!(x.len() >= n * h && xb.len() >= n * h, "rmsnorm_rows: buffers");
        ensure!(xn.as_ref().is_none_or(|v| v.len() >= n * h), "rmsnorm_rows: f32 output too short");
        let hi = h as i32;
        let mut l = self.launcher(&self.f.rmsnorm_rows);
        l.arg(x).arg(gain).arg(&eps).arg(&hi).arg(&*xb);
        match xn {
            Some(v) => l.arg(&*v),
            None => l.arg(&NULL),
        };
        // SAFETY: matches rmsnorm_rows (prefill.cu): 256 threads x 16 columns cover h <= 4096; buffers checked.
        unsafe { l.launch(cfg((n as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// Router logits `[n, rows]` (f32 SIMT, exact dequantisation) of f32 `xn` `[n, cols]`.
    pub fn router_rows(&self, m: &QMat, xn: &CudaSlice<f32>, n: usize, logits: &mut CudaSlice<f32>) -> Result<()> {
        ensure!(m.bits == 4 || m.bits == 8, "router_rows: {}-bit", m.bits);
        ensure!(
            m.cols % 16 == 0 && m.gs >= 16,
            "router_rows: cols {} / group size {} (need % 16, >= 16)",
            m.cols,
            m.gs
        );
        ensure!(n > 0 && xn.len() >= n * m.cols && logits.len() >= n * m.rows, "router_rows: buffers");
        let glog = log2_exact(m.gs, "router_rows: group size")?;
        let (r, c, b, ni) = (m.rows as i32, m.cols as i32, m.bits as i32, n as i32);
        let mut l = self.launcher(&self.f.router_rows);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&r).arg(&c).arg(&b).arg(&glog).arg(xn).arg(&ni).arg(&*logits);
        // SAFETY: matches router_rows (prefill.cu); every load is bounds-checked against rows/cols/n in the kernel
        // (16-column runs: cols % 16, one group per run); buffers checked above.
        unsafe { l.launch(cfg((m.rows.div_ceil(64) as u32, n.div_ceil(64) as u32), 256, 0)) }?;
        Ok(())
    }

    /// Per row: softmax over `e` logits, top-`k`, renormalised; slot k = the shared expert (id e, weight sigmoid
    /// of logit e). `logits` `[n, e + 1]`, idx/wts `[n, k + 1]`.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_rows(
        &self,
        logits: &CudaSlice<f32>,
        e: usize,
        k: usize,
        n: usize,
        idx: &mut CudaSlice<i32>,
        wts: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(e <= 256 && (1..=e.min(32)).contains(&k) && n > 0, "topk_rows: {e} experts, top-{k}");
        ensure!(
            logits.len() >= n * (e + 1) && idx.len() >= n * (k + 1) && wts.len() >= n * (k + 1),
            "topk_rows: buffers"
        );
        let (ei, ki, ni) = (e as i32, k as i32, n as i32);
        let mut l = self.launcher(&self.f.topk_rows);
        l.arg(logits).arg(&ei).arg(&ki).arg(&ni).arg(&*idx).arg(&*wts);
        // SAFETY: matches topk_rows (prefill.cu): one warp per row, 8 per block, rows < n; buffers checked.
        unsafe { l.launch(cfg((n.div_ceil(8) as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// Sort the `n * k` routed (token, slot) pairs of `idx` (written by [`Gpu::topk_rows`]) by expert, append the
    /// shared expert's `n` pairs, and build the grouped GEMMs' tile list (and, for tiles of at most 8 pairs, each
    /// tile's tokens: the streamed kernels').
    pub fn moe_align(
        &self,
        idx: &CudaSlice<i32>,
        n: usize,
        k: usize,
        experts: usize,
        tile: usize,
        out: &mut MoeSorted,
    ) -> Result<()> {
        ensure!(experts < 1024 && n > 0 && k >= 1, "moe_align: {experts} experts, k {k}");
        ensure!((1..=MOE_TILE).contains(&tile), "moe_align: tiles of {tile} pairs (1..={MOE_TILE})");
        ensure!(idx.len() >= n * (k + 1), "moe_align: idx");
        let tiles = max_moe_tiles(n, k, experts, tile);
        ensure!(
            out.rowmap.len() >= n * (k + 1) && out.pos.len() >= n * (k + 1) && out.tiles.len() >= 3 * tiles,
            "moe_align: outputs sized for fewer tokens"
        );
        ensure!(tile > 8 || (out.trows.len() >= 4 * tiles && n <= 1 << 16), "moe_align: tile rows for {n} tokens");
        ensure!(tiles <= 65535, "moe_align: {tiles} tiles over the grid limit");
        let (ni, ki, ei, bn) = (n as i32, k as i32, experts as i32, tile as i32);
        let mut l = self.launcher(&self.f.moe_align);
        l.arg(idx).arg(&ni).arg(&ki).arg(&ei).arg(&bn).arg(&out.rowmap).arg(&out.pos).arg(&out.ntile).arg(&out.tiles);
        l.arg(&out.trows);
        // SAFETY: matches moe_align (prefill.cu), one block of 1024 threads, experts + 1 <= 1024 counters in shared
        // memory; idx holds expert ids < experts for the first k slots of every row (topk_rows writes them); the
        // tile list fits max_moe_tiles (checked), and so do the tile rows where tiles hold at most 8 pairs (the
        // kernel writes them only then; 16-byte aligned: a fresh allocation).
        unsafe { l.launch(cfg((1, 1), 1024, 0)) }?;
        out.holds(n, k, experts, tile, tiles);
        Ok(())
    }

    /// `x[t] += Σ_s wts[t, s] · ybuf[pos[t, s]]` over the k routed slots and the shared one.
    pub fn moe_combine(
        &self,
        ybuf: &CudaSlice<f32>,
        sorted: &MoeSorted,
        wts: &CudaSlice<f32>,
        h: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (n, k) = (sorted.n, sorted.k);
        ensure!(ybuf.len() >= n * (k + 1) * h && wts.len() >= n * (k + 1) && x.len() >= n * h, "moe_combine: buffers");
        ensure!(h % 4 == 0 && n <= i32::MAX as usize, "moe_combine: hidden size {h} (a multiple of 4)");
        let (ki, hi) = (k as i32, h as i32);
        let mut l = self.launcher(&self.f.moe_combine);
        l.arg(ybuf).arg(&sorted.pos).arg(wts).arg(&ki).arg(&hi).arg(&*x);
        // SAFETY: matches moe_combine (prefill.cu): grid (n, h / 1024) of 256 threads, 4 columns each (h % 4 == 0,
        // checked; the buffers' f32 rows of h are 16-byte aligned); pos entries < n*(k+1) rows of ybuf (moe_align
        // over n, k).
        unsafe { l.launch(cfg((n as u32, h.div_ceil(1024) as u32), 256, 0)) }?;
        Ok(())
    }

    /// [`Gpu::moe_combine`] and then [`Gpu::rmsnorm_rows`] of the new rows with `gain` into `xb` (and `xn`): one
    /// launch, the same results bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_norm(
        &self,
        ybuf: &CudaSlice<f32>,
        sorted: &MoeSorted,
        wts: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        gain: &CudaSlice<f32>,
        eps: f32,
        xb: &mut CudaSlice<u16>,
        xn: Option<&mut CudaSlice<f32>>,
    ) -> Result<()> {
        let (n, k, h) = (sorted.n, sorted.k, gain.len());
        ensure!(h <= 4096 && n > 0 && n <= u32::MAX as usize, "moe_combine_norm: {n} rows of {h} (at most 4096)");
        ensure!(k < 64, "moe_combine_norm: {k} routed slots a row (at most 63: COMBINE_SLOTS)");
        ensure!(ybuf.len() >= n * (k + 1) * h && wts.len() >= n * (k + 1), "moe_combine_norm: expert rows");
        ensure!(x.len() >= n * h && xb.len() >= n * h, "moe_combine_norm: buffers");
        ensure!(xn.as_ref().is_none_or(|v| v.len() >= n * h), "moe_combine_norm: f32 output too short");
        let (ki, hi) = (k as i32, h as i32);
        let f = if h <= 2048 { &self.f.moe_combine_norm_j8 } else { &self.f.moe_combine_norm_j16 };
        let mut l = self.launcher(f);
        l.arg(ybuf).arg(&sorted.pos).arg(wts).arg(&ki).arg(&hi).arg(&*x).arg(gain).arg(&eps).arg(&*xb);
        match xn {
            Some(v) => l.arg(&*v),
            None => l.arg(&NULL),
        };
        // SAFETY: matches moe_combine_norm_j{8,16} (prefill.cu): one block of 256 threads a row, 8 or 16 columns a
        // thread (h <= 2048 or 4096), k + 1 <= COMBINE_SLOTS (checked); pos entries < n*(k+1) rows of ybuf
        // (moe_align over n, k); buffers checked.
        unsafe { l.launch(cfg((n as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// Conv + SiLU + l2-norms + gates of a GDN layer for the pass's rows (`segs`): from `proj` (`[rows, ldp]`: qkv | z
    /// | b | a) and each sequence's ring of earlier conv inputs (`rings[s]`, `[taps, conv_dim]` f32) to `qkv` `[rows,
    /// conv_dim]`, `beta`/`gl` `[rows, hv]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_prep(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
        rings: &CudaView<u64>,
        conv_w: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        d: GdnDims,
        segs: &SegTable,
        qkv: &mut CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
        gl: &mut CudaSlice<f32>,
    ) -> Result<()> {
        d.check()?;
        let (cd, n) = (d.conv_dim(), segs.rows);
        ensure!(
            n > 0 && ldp >= cd + d.hv * d.dv + 2 * d.hv && proj.len() >= (n - 1) * ldp + cd + d.hv * d.dv + 2 * d.hv,
            "gdn_prep: proj"
        );
        ensure!(rings.len() >= segs.n && conv_w.len() >= cd * d.taps, "gdn_prep: ring table / conv weights");
        ensure!(a_log.len() >= d.hv && dt_bias.len() >= d.hv && d.hv <= 256, "gdn_prep: gate vectors");
        ensure!(qkv.len() >= n * cd && beta.len() >= n * d.hv && gl.len() >= n * d.hv, "gdn_prep: outputs");
        let v = [ldp, d.hk, d.hv, d.dk, d.dv, d.taps, segs.n].map(|v| v as i32);
        let mut l = self.launcher(&self.f.gdn_prep);
        l.arg(proj).arg(&v[0]).arg(rings).arg(conv_w).arg(a_log).arg(dt_bias).arg(&v[1]).arg(&v[2]).arg(&v[3]);
        l.arg(&v[4]).arg(&v[5]).arg(&segs.dev).arg(&v[6]).arg(&*qkv).arg(&*beta).arg(&*gl);
        // SAFETY: matches gdn_prep (prefill.cu); one block per row, buffers checked above (dk <= 128: 4 channels per
        // lane; hv <= 256 threads for the gates); the ring table holds a whole ring per sequence of the table (its
        // builder's contract: PassTables::set_states, or the caller's own table of live buffers).
        unsafe { l.launch(cfg((n as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// Chunked delta rule, phase 1: U, W, P, G of every chunk of 64 tokens of each sequence, and value head.
    pub fn gdn_chunk_prep(
        &self,
        qkv: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        gl: &CudaSlice<f32>,
        segs: &SegTable,
        d: GdnDims,
        sc: &mut GdnChunkScratch,
    ) -> Result<()> {
        d.check()?;
        let n = segs.rows;
        ensure!(
            d.dk + d.dv <= 256 && d.dv % 4 == 0 && d.dk % 8 == 0,
            "gdn_chunk_prep: key + value head dims over 256 (or dv % 4, dk % 8)"
        );
        ensure!(
            n > 0 && qkv.len() >= n * d.conv_dim() && beta.len() >= n * d.hv && gl.len() >= n * d.hv,
            "gdn_chunk_prep: inputs"
        );
        ensure!(sc.holds(d, segs.chunks), "gdn_chunk_prep: scratch for {} chunks", segs.chunks);
        let smem = GDN_CHUNK * ((d.dk + 4) + (d.dk + 4).max(GDN_CHUNK + 4)) * 4;
        let v = [segs.n, d.hk, d.hv, d.dk, d.dv].map(|v| v as i32);
        let mut l = self.launcher(&self.f.gdn_chunk_prep);
        l.arg(qkv).arg(beta).arg(gl).arg(&segs.dev).arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]);
        l.arg(&sc.u).arg(&sc.w).arg(&sc.p).arg(&sc.g);
        // SAFETY: matches gdn_chunk_prep (prefill.cu); grid (chunks, hv), one solution column per thread (dk + dv <=
        // 256), dk % 8 for the tensor-core tiles (checked), shared memory as laid out there (K, then Q and A);
        // scratch holds the table's chunks (checked), each chunk's rows lie in the pass's n rows (SegTable::set).
        unsafe { l.launch(cfg((segs.chunks as u32, d.hv as u32), 256, smem)) }?;
        Ok(())
    }

    /// Chunked delta rule, phase 2: each sequence's state (`states[s]`, `[hv, dk, dv]` f32) through its chunks in
    /// order ([`Gpu::gdn_chunk_state`]: the state updated, each chunk's starting state kept, D written over U), then
    /// every chunk's outputs in parallel ([`Gpu::gdn_chunk_out`]): `o` `[rows, hv, dv]`.
    pub fn gdn_chunk_scan(
        &self,
        qkv: &CudaSlice<f32>,
        sc: &mut GdnChunkScratch,
        segs: &SegTable,
        d: GdnDims,
        states: &CudaView<u64>,
        o: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.gdn_chunk_state(qkv, sc, segs, d, states)?;
        self.gdn_chunk_out(qkv, sc, segs, d, o)
    }

    fn gdn_scan_check(&self, qkv: &CudaSlice<f32>, sc: &GdnChunkScratch, segs: &SegTable, d: GdnDims) -> Result<()> {
        d.check()?;
        ensure!(
            d.dk % 8 == 0 && d.dv % 8 == 0,
            "gdn_chunk_scan: key / value head dims {} / {} (tensor-core tiles: both % 8)",
            d.dk,
            d.dv
        );
        ensure!(sc.holds(d, segs.chunks), "gdn_chunk_scan: scratch for {} chunks", segs.chunks);
        ensure!(segs.rows > 0 && qkv.len() >= segs.rows * d.conv_dim(), "gdn_chunk_scan: qkv");
        ensure!(segs.n <= 65535, "gdn_chunk_scan: {} sequences", segs.n);
        Ok(())
    }

    /// The sequential half of [`Gpu::gdn_chunk_scan`]: each sequence's state through its chunks.
    pub fn gdn_chunk_state(
        &self,
        qkv: &CudaSlice<f32>,
        sc: &mut GdnChunkScratch,
        segs: &SegTable,
        d: GdnDims,
        states: &CudaView<u64>,
    ) -> Result<()> {
        self.gdn_scan_check(qkv, sc, segs, d)?;
        ensure!(states.len() >= segs.n, "gdn_chunk_scan: state table");
        let v = [segs.n, d.hk, d.hv, d.dk, d.dv].map(|v| v as i32);
        let (c, sc_cols) = (GDN_CHUNK, GDN_STATE_COLS);
        // two buffers of {W, K, the U slice (row stride 40), G}, then S^T and (diag(kdec) D)^T
        let buf = c * (d.dk + 4) + c * (d.dk + 8) + c * 40 + c;
        let smem = (2 * buf + sc_cols * (d.dk + 4) + sc_cols * (c + 4)) * 4;
        let mut l = self.launcher(&self.f.gdn_chunk_state);
        l.arg(qkv).arg(&sc.u).arg(&sc.w).arg(&sc.g).arg(&segs.dev).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]);
        l.arg(&sc.s).arg(states);
        let mut lc = cfg((d.hv as u32, d.dv.div_ceil(sc_cols) as u32), 256, smem);
        lc.grid_dim.2 = segs.n as u32;
        // SAFETY: matches gdn_chunk_state (prefill.cu); grid (hv, ceil(dv/32), sequences), dk <= 128 (d.check) and
        // dk, dv % 8 (checked); scratch holds the table's chunks (checked), shared memory as laid out there (<=
        // SMEM_MAX for dk <= 128); the state table holds a whole state per sequence (its builder's contract, as
        // gdn_prep's rings).
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// The parallel half of [`Gpu::gdn_chunk_scan`]: every chunk's outputs from the D and chunk states
    /// [`Gpu::gdn_chunk_state`] left in `sc`.
    pub fn gdn_chunk_out(
        &self,
        qkv: &CudaSlice<f32>,
        sc: &mut GdnChunkScratch,
        segs: &SegTable,
        d: GdnDims,
        o: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.gdn_scan_check(qkv, sc, segs, d)?;
        ensure!(o.len() >= segs.rows * d.hv * d.dv, "gdn_chunk_scan: output");
        let v = [segs.n, d.hk, d.hv, d.dk, d.dv].map(|v| v as i32);
        let (c, out_cols) = (GDN_CHUNK, GDN_OUT_COLS);
        // Q, the S^T slice, P, the D slice (row stride + 8)
        let smem = (c * (d.dk + 4) + out_cols * (d.dk + 4) + c * (c + 4) + c * (out_cols + 8)) * 4;
        let mut l = self.launcher(&self.f.gdn_chunk_out);
        l.arg(qkv).arg(&sc.u).arg(&sc.p).arg(&sc.g).arg(&sc.s).arg(&segs.dev).arg(&v[0]).arg(&v[1]).arg(&v[2]);
        l.arg(&v[3]).arg(&v[4]).arg(&*o);
        let mut lc = cfg((segs.chunks as u32, d.hv as u32), 256, smem);
        lc.grid_dim.2 = d.dv.div_ceil(out_cols) as u32;
        // SAFETY: matches gdn_chunk_out (prefill.cu); grid (chunks, hv, ceil(dv/64)), dk, dv <= 128 and % 8
        // (checked); reads the D and chunk states of the scratch (gdn_chunk_state's, or stale but in-bounds values if
        // it did not run: the buffers hold the table's chunks, checked); shared memory as laid out there.
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// Gated RMSNorm of the GDN output per (token, value head) with z from `proj` (column `zoff + h*dv`) -> bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_gated_norm(
        &self,
        o: &CudaSlice<f32>,
        proj: &CudaSlice<f32>,
        ldp: usize,
        n: usize,
        d: GdnDims,
        norm: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let (zoff, vd) = (d.conv_dim(), d.hv * d.dv);
        ensure!(d.dv <= 128 && norm.len() >= d.dv, "gdn_gated_norm: value head dim {}", d.dv);
        ensure!(n > 0 && o.len() >= n * vd && out.len() >= n * vd, "gdn_gated_norm: buffers");
        ensure!(ldp >= zoff + vd && proj.len() >= (n - 1) * ldp + zoff + vd, "gdn_gated_norm: proj");
        let v = [ldp, n, d.hv, d.dv, zoff].map(|v| v as i32);
        let mut l = self.launcher(&self.f.gdn_gated_norm);
        l.arg(o).arg(proj).arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(norm).arg(&eps).arg(&*out);
        // SAFETY: matches gdn_gated_norm (prefill.cu): one warp per (token, head), 8 per block; buffers checked.
        unsafe { l.launch(cfg(((n * d.hv).div_ceil(8) as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// Each sequence's conv ring after its rows (`segs`): slot p % taps = the pre-conv input of position p (the
    /// last min(rows, taps) positions).
    pub fn gdn_ring(
        &self,
        proj: &CudaView<f32>,
        ldp: usize,
        d: GdnDims,
        segs: &SegTable,
        rings: &CudaView<u64>,
    ) -> Result<()> {
        let (cd, n) = (d.conv_dim(), segs.rows);
        ensure!(n > 0 && ldp >= cd && proj.len() >= (n - 1) * ldp + cd, "gdn_ring: proj");
        ensure!(rings.len() >= segs.n && segs.n <= 65535, "gdn_ring: ring table");
        let v = [ldp, cd, d.taps].map(|v| v as i32);
        let mut l = self.launcher(&self.f.gdn_ring);
        l.arg(proj).arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&segs.dev).arg(rings);
        let blocks = (self.sms as usize / segs.n).max(2) as u32;
        // SAFETY: matches gdn_ring (prefill.cu): grid (blocks, sequences), grid-stride over each sequence's last
        // min(rows, taps) rows of cd channels; proj checked; the table's rings are whole ([taps, cd], as gdn_prep's).
        unsafe { l.launch(cfg((blocks, segs.n as u32), 256, 0)) }?;
        Ok(())
    }

    /// q/k norm + RoPE for the pass's rows (`segs`): q -> bf16 `[rows, nh, hd]`, k/v -> rows pos0.. of each
    /// sequence's caches (`kcs[s]` / `vcs[s]`, bf16 `[positions, nkv, hd]`).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prep_rows(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
        qn: &CudaSlice<f32>,
        kn: &CudaSlice<f32>,
        segs: &SegTable,
        (nh, nkv, hd, rd): (usize, usize, usize, usize),
        theta: f32,
        eps: f32,
        qout: &mut CudaSlice<u16>,
        (kcs, vcs): (&CudaView<u64>, &CudaView<u64>),
    ) -> Result<()> {
        ensure!(hd <= 256 && hd % 32 == 0 && rd <= hd && rd % 2 == 0 && nkv > 0, "attn_prep_rows: dims");
        let (rows, n) = ((2 * nh + 2 * nkv) * hd, segs.rows);
        ensure!(n > 0 && ldp >= rows && proj.len() >= (n - 1) * ldp + rows, "attn_prep_rows: proj");
        ensure!(qn.len() >= hd && kn.len() >= hd && qout.len() >= n * nh * hd, "attn_prep_rows: buffers");
        ensure!(kcs.len() >= segs.n && vcs.len() >= segs.n, "attn_prep_rows: cache tables");
        let v = [ldp, segs.n, nh, nkv, hd, rd].map(|v| v as i32);
        let mut l = self.launcher(&self.f.attn_prep_rows);
        l.arg(proj).arg(&v[0]).arg(qn).arg(kn).arg(&segs.dev).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&v[5]);
        l.arg(&theta).arg(&eps).arg(&*qout).arg(kcs).arg(vcs);
        // SAFETY: matches attn_prep_rows (prefill.cu); grid (rows, nh + nkv) of hd threads; each sequence's caches
        // hold rows pos0..pos0+k (its table builder's contract: DeviceModel::prefill_seqs and DeviceState::prefill
        // check the positions against the sequence's room).
        unsafe { l.launch(cfg((n as u32, (nh + nkv) as u32), hd as u32, 0)) }?;
        Ok(())
    }

    /// Causal flash attention of the pass's rows (`segs`): a sequence's rows, at positions pos0.., over its cache keys
    /// `0..pos0+k` (`kcs[s]` / `vcs[s]`), output gate from `proj` -> bf16 `[rows, nh*hd]`.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill(
        &self,
        q: &CudaSlice<u16>,
        (kcs, vcs): (&CudaView<u64>, &CudaView<u64>),
        proj: &CudaSlice<f32>,
        ldp: usize,
        segs: &SegTable,
        (nh, nkv, hd): (usize, usize, usize),
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let (f, bkv) = match hd {
            256 => (&self.f.flash_prefill_hd256, 32),
            128 => (&self.f.flash_prefill_hd128, 64),
            64 => (&self.f.flash_prefill_hd64, 64),
            _ => bail!("flash_prefill: head dim {hd} (kernels for 64, 128 and 256)"),
        };
        let n = segs.rows;
        ensure!(nkv > 0 && nh % nkv == 0 && n > 0, "flash_prefill: {nh} query heads over {nkv} kv heads");
        ensure!(q.len() >= n * nh * hd && out.len() >= n * nh * hd, "flash_prefill: q / out");
        ensure!(ldp >= 2 * nh * hd && proj.len() >= (n - 1) * ldp + 2 * nh * hd, "flash_prefill: proj (gates)");
        ensure!(kcs.len() >= segs.n && vcs.len() >= segs.n, "flash_prefill: cache tables");
        ensure!(segs.chunks <= 65535 * 32, "flash_prefill: {} query tiles", segs.chunks);
        let smem = 64 * (hd + 8) * 2 + 4 * bkv * (hd + 8) * 2;
        let scale = 1.0 / (hd as f32).sqrt();
        let v = [ldp, segs.n, nh, nkv].map(|v| v as i32);
        let mut l = self.launcher(f);
        l.arg(q).arg(kcs).arg(vcs).arg(proj).arg(&v[0]).arg(&segs.dev).arg(&v[1]).arg(&v[2]).arg(&v[3]);
        l.arg(&scale).arg(&*out);
        // SAFETY: matches flash_prefill_hd* (flash.cu); a tile's queries are rows of its sequence (< n), its keys <
        // pos0 + k, rows its table builder guarantees the caches hold (as attn_prep_rows'); shared memory as
        // FlashCfg<hd, bkv>.
        unsafe { l.launch(cfg((segs.chunks as u32, nh as u32), 128, smem)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile bound against the tiles moe_align makes for random and adversarial routings (counts per expert,
    /// each rounded up to the tile), and reached by the spread-out one.
    #[test]
    fn max_moe_tiles_bounds_every_routing() {
        let tiles =
            |counts: &[usize], n: usize, t: usize| counts.iter().map(|c| c.div_ceil(t)).sum::<usize>() + n.div_ceil(t);
        let mut seed = 7u64;
        let mut next = |m: usize| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as usize) % m
        };
        for &(n, k, e) in
            &[(1, 8, 256), (8, 8, 256), (16, 8, 256), (32, 8, 256), (64, 8, 256), (4096, 8, 256), (5, 3, 4)]
        {
            for &t in &[1, 4, 8, 64] {
                let bound = max_moe_tiles(n, k, e, t);
                // tokens' picks: k distinct experts from a random subset of a few, of all, or spread round-robin
                for trial in 0..20 {
                    let pool = if trial % 3 == 1 { k.max(1 + next(e)) } else { e };
                    let mut counts = vec![0usize; e];
                    for tok in 0..n {
                        let mut picked: Vec<usize> = Vec::new();
                        while picked.len() < k {
                            let c = if trial % 3 == 2 { (tok * k + picked.len()) % e } else { next(pool) };
                            if !picked.contains(&c) {
                                picked.push(c);
                            }
                        }
                        picked.iter().for_each(|&c| counts[c] += 1);
                    }
                    let got = tiles(&counts, n, t);
                    assert!(got <= bound, "n {n} k {k} e {e} tile {t}: {got} tiles > bound {bound}");
                }
            }
        }
        // reached: 8 tokens spread over 64 experts, one pair each, tiles of 4: 64 + 2
        let mut counts = vec![0usize; 256];
        counts[..64].iter_mut().for_each(|c| *c = 1);
        assert_eq!(tiles(&counts, 8, 4), max_moe_tiles(8, 8, 256, 4));
        assert_eq!(max_moe_tiles(8, 8, 256, 4), 66);
    }

    /// The dense GEMM splits K only for short, wide weights, by shape alone, within a cluster.
    #[test]
    fn gemm_split_follows_the_shape() {
        assert_eq!(gemm_split(2048, 4096, 132), 4, "out_proj / o_proj");
        assert_eq!(gemm_split(12352, 2048, 132), 1, "GDN in_proj");
        assert_eq!(gemm_split(248320, 2048, 132), 1, "lm_head");
        assert_eq!(gemm_split(256, 4096, 132), 8, "a cluster at most");
        assert_eq!(gemm_split(256, 1024, 132), 2, "8 k-steps a block at least");
        assert_eq!(gemm_split(256, 512, 132), 1);
    }
}
