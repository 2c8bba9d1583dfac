//! The launch wrappers of the few-row kernels a pass's decode rows take (crates/tern-kernels/cuda/{gdn,attention,
//! moe_seqs}.cu): the decode kernels' `_seqs` variants, which take each row's recurrent state, conv ring and K/V
//! cache from pointer tables and its position from a device array the host uploads before the pass (gdn_step_seqs:
//! conv, gates, delta rule, gated norm → bf16; attn_prep_seqs, attn_decode_kv_seqs: flash-decoding splits over keys
//! `0..=pos`, attn_combine_seqs), and the streamed few-token kernels (each weight byte read once from DRAM and
//! applied to every row that needs it, on tensor cores): `dense_seqs` for the dense projections and the lm_head of a
//! pass of at most [`STREAM_ROWS`] decode rows, `router_seqs`, the top-k and sort of a few rows in one launch, and
//! the experts over the few tokens each gets. [`crate::forward`] decides which pass takes which.

use anyhow::{bail, ensure, Result};

use cudarc::driver::{CudaSlice, CudaView, DevicePtr};

use crate::gpu::SMEM_MAX;
use crate::gpu::{cfg, Gpu};
use crate::gpu::{Experts, QMat};
use crate::prefill::{check_dense, log2_exact, GdnDims, MoeSorted, SegTable, STREAM_ROWS};

/// The most sequences one forward pass takes (vLLM's default `max_num_seqs`): the pass tables, the decode rows'
/// attention buffers and the logits rows are sized for it.
pub const MAX_SEQS: usize = 256;
/// The most flash-decoding splits per (sequence, kv head) in a batched step.
pub(crate) const MAX_SPLIT: usize = 32;
/// Rows and tokens per block of router_seqs (RS_R, RS_TG in moe_seqs.cu).
const RS_R: usize = 16;
const RS_TG: usize = 4;
/// The most rows [`Gpu::topk_align_seqs`] takes (TA_ROWS in moe_seqs.cu: a warp each, one block).
pub const TOPK_ALIGN_ROWS: usize = 8;
/// j per block of moe_gate_up_seqs and output rows per block of moe_down_seqs (4 warps of 2 items: 8 j or 16 rows);
/// tokens per pass (MM_WARPS, MM_R, MM_TG in moe_seqs.cu).
const MM_J: usize = 64;
const MM_ROWS: usize = 128;
const MM_TG: usize = 8;

/// The per-row tables of a batched step's layer: the two state pointers of each row's sequence (GDN: conv ring,
/// recurrent state; attention: K cache, V cache) and the rows' positions.
pub type SeqTables<'a> = (&'a CudaView<'a, u64>, &'a CudaView<'a, u64>, &'a CudaSlice<i32>);

/// A buffer's device address (for the pointer tables).
pub(crate) fn ptr<T>(g: &Gpu, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(&g.stream).0
}

impl Gpu {
    /// [`Gpu::gdn_step`] for `n` sequences: row r's projections `proj[row0 + r]` (stride `ldp`), its conv ring and
    /// state at `rings[r]` / `states[r]`, its position `posv[r]`; output bf16 rows of `hv * dv` into `out` from row
    /// `row0` on (a pass's decode rows follow its prompt rows).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step_seqs(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
        row0: usize,
        conv_w: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        (rings, states, posv): SeqTables,
        n: usize,
        norm: &CudaSlice<f32>,
        eps: f32,
        d: GdnDims,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let conv_dim = d.conv_dim();
        let vd = d.hv * d.dv;
        ensure!(d.dk <= 128 && d.dv <= 256 && d.dv % 4 == 0 && d.hv % d.hk == 0 && d.taps >= 1, "gdn_step_seqs: dims");
        ensure!(n > 0 && n <= 65535, "gdn_step_seqs: {n} rows");
        ensure!(ldp >= conv_dim + vd + 2 * d.hv && proj.len() >= (row0 + n) * ldp, "gdn_step_seqs: proj");
        ensure!(conv_w.len() == conv_dim * d.taps && a_log.len() >= d.hv && dt_bias.len() >= d.hv, "gdn_step_seqs");
        ensure!(norm.len() >= d.dv && out.len() >= (row0 + n) * vd, "gdn_step_seqs: norm / out");
        let (proj, out) = (proj.slice(row0 * ldp..), out.slice(row0 * vd..));
        ensure!(rings.len() >= n && states.len() >= n && posv.len() >= n, "gdn_step_seqs: tables");
        // a head's value columns in blocks of 64 (whole 32-column chunks of the head, so that the chunk sums keep
        // gdn_step's order), or one block for a head of at most 64
        let parts = if d.dv % 64 == 0 { d.dv / 64 } else { 1 };
        let dvp = d.dv / parts;
        ensure!(dvp <= 64 && dvp % 4 == 0 && parts <= 8, "gdn_step_seqs: {} value columns a head", d.dv);
        let smem = d.dk * dvp * 4;
        ensure!(smem <= SMEM_MAX, "gdn_step_seqs: a block's state of {smem} bytes is over the shared memory limit");
        let v = [ldp, vd, d.hk, d.hv, d.dk, d.dv, d.taps, parts].map(|v| v as i32);
        let threads = 128 * dvp.div_ceil(32) as u32;
        let mut l = self.launcher(&self.f.gdn_step_seqs);
        l.arg(&proj).arg(&v[0]).arg(conv_w).arg(rings).arg(a_log).arg(dt_bias).arg(states).arg(&out).arg(&v[1]);
        l.arg(posv).arg(norm).arg(&eps).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&v[5]).arg(&v[6]).arg(&v[7]);
        l.cluster = Some((parts as u32, 1, 1));
        // SAFETY: matches gdn_step_seqs in gdn.cu: grid (hv * parts, n) in clusters of the parts (<= 8) of a head,
        // 128 threads per 32 of a block's dvp <= 64 value columns (at most its 256), the block's columns of the
        // head's state in dynamic shared memory (dk * dvp floats, checked against the opt-in limit; dvp % 4 == 0 for
        // its 16-byte copies), dk <= 128 (its q/k arrays); proj holds n rows of stride ldp, out n rows of hv*dv (both from
        // row0 on, checked); the
        // tables hold n pointers to whole rings ([taps, conv_dim] f32) and states ([hv, dk, dv] f32) of live
        // sequences (DeviceModel::decode_seqs builds them from the sequences' own buffers).
        unsafe { l.launch(cfg(((d.hv * parts) as u32, n as u32), threads, smem)) }?;
        Ok(())
    }

    /// A speculative verify's GDN rows: for each sequence `s` of `segs` (its rows `row0 + r0 ..` of `proj`, stride
    /// `ldp`, from position `pos0`), the rows one after another as [`Gpu::gdn_step_seqs`] steps would take them, each
    /// row's output (bf16, `hv * dv`) into `out`; the sequences' states and rings (`rings[s]` / `states[s]`) only
    /// read. [`Gpu::gdn_commit_seqs`] then advances the state over the rows kept.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_verify_seqs(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
        row0: usize,
        conv_w: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        (rings, states): (&CudaView<u64>, &CudaView<u64>),
        segs: &SegTable,
        norm: &CudaSlice<f32>,
        eps: f32,
        d: GdnDims,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let vd = d.hv * d.dv;
        let (parts, smem) = gdn_rows_check(d, ldp, proj.len(), row0, segs, rings, states, conv_w, a_log, dt_bias)?;
        ensure!(norm.len() >= d.dv && out.len() >= (row0 + segs.rows()) * vd, "gdn_verify_seqs: norm / out");
        let (proj, out) = (proj.slice(row0 * ldp..), out.slice(row0 * vd..));
        let v = [ldp, vd, d.hk, d.hv, d.dk, d.dv, d.taps, parts].map(|v| v as i32);
        let mut l = self.launcher(&self.f.gdn_verify_seqs);
        l.arg(&proj).arg(&v[0]).arg(conv_w).arg(rings).arg(a_log).arg(dt_bias).arg(states).arg(&out).arg(&v[1]);
        l.arg(&segs.dev).arg(norm).arg(&eps).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&v[5]).arg(&v[6]).arg(&v[7]);
        l.cluster = Some((parts as u32, 1, 1));
        // SAFETY: matches gdn_verify_seqs in gdn.cu, launched as gdn_step_seqs (grid (hv * parts, sequences) in
        // clusters of a head's parts, 128 threads per 32 of dvp <= 64 columns, dk * dvp floats of shared memory,
        // checked by gdn_rows_check); every segment's rows lie within proj and out (segs.rows() rows from row0,
        // checked), the tables hold a ring and a state of this layer's shape for each of the segments' sequences.
        unsafe { l.launch(cfg(((d.hv * parts) as u32, segs.n() as u32), 128 * (smem_cols(d, parts) as u32), smem)) }?;
        Ok(())
    }

    /// After a verify: the state of each sequence of `segs` advanced over its rows (the kept ones, their projections
    /// `proj` from row 0, stride `ldp`) and written back; the rings are left for [`Gpu::gdn_ring`] over the same rows.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_commit_seqs(
        &self,
        proj: &CudaView<f32>,
        ldp: usize,
        conv_w: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        (rings, states): (&CudaView<u64>, &CudaView<u64>),
        segs: &SegTable,
        d: GdnDims,
    ) -> Result<()> {
        let (parts, smem) = gdn_rows_check(d, ldp, proj.len(), 0, segs, rings, states, conv_w, a_log, dt_bias)?;
        let v = [ldp, d.hk, d.hv, d.dk, d.dv, d.taps, parts].map(|v| v as i32);
        let mut l = self.launcher(&self.f.gdn_commit_seqs);
        l.arg(proj).arg(&v[0]).arg(conv_w).arg(rings).arg(a_log).arg(dt_bias).arg(states).arg(&segs.dev);
        l.arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&v[5]).arg(&v[6]);
        l.cluster = Some((parts as u32, 1, 1));
        // SAFETY: matches gdn_commit_seqs in gdn.cu, launched as gdn_verify_seqs (same checks) without output.
        unsafe { l.launch(cfg(((d.hv * parts) as u32, segs.n() as u32), 128 * (smem_cols(d, parts) as u32), smem)) }?;
        Ok(())
    }

    /// [`Gpu::attn_prep`] for `n` sequences (projections `proj[row0 + r]`): q → `qbuf` rows (f32, `nh * hd`), k/v →
    /// row `posv[r]` of the caches at `kc[r]` / `vc[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prep_seqs(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
        row0: usize,
        qn: &CudaSlice<f32>,
        kn: &CudaSlice<f32>,
        (kc, vc, posv): SeqTables,
        n: usize,
        (nh, nkv, hd, rd): (usize, usize, usize, usize),
        theta: f32,
        eps: f32,
        qbuf: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(hd <= 256 && hd % 32 == 0 && rd <= hd && rd % 2 == 0 && nkv > 0, "attn_prep_seqs: dims");
        let rows = (2 * nh + 2 * nkv) * hd;
        ensure!(
            n > 0 && n <= 65535 && ldp >= rows && proj.len() >= (row0 + n - 1) * ldp + rows,
            "attn_prep_seqs: proj"
        );
        let proj = proj.slice(row0 * ldp..);
        ensure!(qn.len() >= hd && kn.len() >= hd && qbuf.len() >= n * nh * hd, "attn_prep_seqs: buffers");
        ensure!(kc.len() >= n && vc.len() >= n && posv.len() >= n, "attn_prep_seqs: tables");
        let v = [ldp, nh, nkv, hd, rd].map(|v| v as i32);
        let mut l = self.launcher(&self.f.attn_prep_seqs);
        l.arg(&proj).arg(&v[0]).arg(qn).arg(kn).arg(posv).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&theta);
        l.arg(&eps).arg(&*qbuf).arg(kc).arg(vc);
        // SAFETY: matches attn_prep_seqs in attention.cu; grid (nh + nkv, n) of hd threads; the caches in the tables
        // belong to live sequences whose position posv[r] is below their capacity (decode_seqs checks len < room).
        unsafe { l.launch(cfg(((nh + nkv) as u32, n as u32), hd as u32, 0)) }?;
        Ok(())
    }

    /// [`Gpu::attn_decode`] (the per-kv-head kernel) for `n` sequences over their keys `0..=posv[r]`: partials
    /// `[n, nh, nsplit, hd + 2]`. `freshv[r]`: the first position of row r's sequence this pass writes (`posv[r]`,
    /// or for a verify row the segment's first): only older keys are read before the dependency wait.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_seqs(
        &self,
        qbuf: &CudaSlice<f32>,
        (kc, vc, posv): SeqTables,
        freshv: &CudaSlice<i32>,
        n: usize,
        (nh, nkv, hd): (usize, usize, usize),
        nsplit: usize,
        part: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(hd <= 256 && hd % 8 == 0 && nkv > 0 && nh % nkv == 0 && nh / nkv <= 8, "attn_decode_seqs: dims");
        ensure!(
            (1..=65535).contains(&n) && (1..=1024).contains(&nsplit),
            "attn_decode_seqs: {n} rows, {nsplit} splits"
        );
        ensure!(qbuf.len() >= n * nh * hd && part.len() >= n * nh * nsplit * (hd + 2), "attn_decode_seqs: buffers");
        ensure!(kc.len() >= n && vc.len() >= n && posv.len() >= n && freshv.len() >= n, "attn_decode_seqs: tables");
        let scale = 1.0 / (hd as f32).sqrt();
        let v = [nh, nkv, hd].map(|v| v as i32);
        let mut l = self.launcher(&self.f.attn_decode_kv_seqs);
        l.arg(qbuf).arg(kc).arg(vc).arg(posv).arg(freshv).arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&scale).arg(&*part);
        let mut lc = cfg((nkv as u32, nsplit as u32), 128, 0);
        lc.grid_dim.2 = n as u32;
        // SAFETY: matches attn_decode_kv_seqs (4 warps, static smem) in attention.cu; group <= 8 and hd <= 256
        // checked; keys 0..=posv[r] were written (attn_prep_seqs wrote rows freshv[r]..=posv[r], the host uploaded
        // freshv[r] <= posv[r]; earlier rows by earlier steps).
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// [`Gpu::attn_combine`] for `n` sequences: bf16 rows of `nh * hd` into `out` from row `row0` on (gate from
    /// `proj` rows `row0..` of stride `ldp`).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_combine_seqs(
        &self,
        part: &CudaSlice<f32>,
        proj: &CudaSlice<f32>,
        ldp: usize,
        row0: usize,
        n: usize,
        nh: usize,
        hd: usize,
        nsplit: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        ensure!(nsplit <= 1024 && hd <= 1024 && (1..=65535).contains(&n), "attn_combine_seqs: dims");
        ensure!(
            part.len() >= n * nh * nsplit * (hd + 2) && out.len() >= (row0 + n) * nh * hd,
            "attn_combine_seqs: buffers"
        );
        ensure!(ldp >= 2 * nh * hd && proj.len() >= (row0 + n - 1) * ldp + 2 * nh * hd, "attn_combine_seqs: proj");
        let (proj, out) = (proj.slice(row0 * ldp..), out.slice(row0 * nh * hd..));
        let (ldpi, ns, hdi, ldo) = (ldp as i32, nsplit as i32, hd as i32, (nh * hd) as i32);
        let mut l = self.launcher(&self.f.attn_combine_seqs);
        l.arg(part).arg(&proj).arg(&ldpi).arg(&ns).arg(&hdi).arg(&out).arg(&ldo);
        // SAFETY: matches attn_combine_seqs in attention.cu; grid (nh, n) of 1024 threads (1024 / hd groups); shapes
        // checked above.
        unsafe { l.launch(cfg((nh as u32, n as u32), 1024, 0)) }?;
        Ok(())
    }

    /// Router logits `[n, rows]` of f32 `xn` `[n, cols]` for a few rows (the batched step): many small blocks of
    /// 16 weight rows × 4 tokens with the decode router's arithmetic, where [`Gpu::router_rows`]'s 64 × 64 tiles leave
    /// most of the GPU idle at n ≤ 64.
    pub fn router_seqs(&self, m: &QMat, xn: &CudaSlice<f32>, n: usize, logits: &mut CudaSlice<f32>) -> Result<()> {
        let cpv = 128 / m.bits as usize;
        let f = match m.bits {
            8 => &self.f.router_seqs_q8,
            4 => &self.f.router_seqs_q4,
            b => bail!("router_seqs: {b}-bit weights (4 or 8)"),
        };
        ensure!(
            m.cols % cpv == 0 && m.cols <= 2048,
            "router_seqs: {} columns (a multiple of {cpv}, at most 2048)",
            m.cols
        );
        ensure!(
            m.gs >= cpv && m.gs.is_power_of_two() && m.cols % m.gs == 0,
            "router_seqs: group size {} (a power of two >= {cpv} dividing {} columns)",
            m.gs,
            m.cols
        );
        ensure!((1..=65535 * RS_TG).contains(&n), "router_seqs: {n} rows");
        ensure!(xn.len() >= n * m.cols && logits.len() >= n * m.rows, "router_seqs: buffers");
        let gshift = log2_exact(m.gs / cpv, "router_seqs: group size")?;
        let (r, c, ni) = (m.rows as i32, m.cols as i32, n as i32);
        let mut l = self.launcher(f);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&r).arg(&c).arg(&gshift).arg(xn).arg(&ni).arg(&*logits);
        // SAFETY: matches router_seqs_q{4,8} in moe_seqs.cu (static shared memory for cols <= 2048, checked); W is a
        // whole QMat (rows x cols codes, scales/biases per group), row loads clamped to rows - 1 in the kernel; xn holds
        // n rows of cols, logits n rows of rows (checked); blocks past n tokens stage zeros and store nothing.
        unsafe { l.launch(cfg((m.rows.div_ceil(RS_R) as u32, n.div_ceil(RS_TG) as u32), 256, 0)) }?;
        Ok(())
    }

    /// Whether the batched step takes [`Gpu::topk_align_seqs`] for `n` rows of top-`k` over `experts` in tiles of
    /// `tile` pairs: turned on ([`Gpu::topk_align`]) and a shape it takes ([`topk_align_shapes`]).
    pub fn topk_align_fits(&self, n: usize, k: usize, experts: usize, tile: usize) -> bool {
        self.topk_align.load(std::sync::atomic::Ordering::Relaxed) && topk_align_shapes(n, k, experts, tile)
    }

    /// A decode batch's top-k and expert-sorted pairs in one launch (moe_seqs.cu `topk_align_seqs`, one block): what
    /// [`Gpu::topk_rows`] and [`Gpu::moe_align`] (tiles of `tile` pairs) write, the same bits but for the order of
    /// one expert's pairs within its run of `rowmap` (row order here). Shapes as [`topk_align_shapes`] says.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_align_seqs(
        &self,
        logits: &CudaSlice<f32>,
        experts: usize,
        k: usize,
        n: usize,
        tile: usize,
        idx: &mut CudaSlice<i32>,
        wts: &mut CudaSlice<f32>,
        out: &mut MoeSorted,
    ) -> Result<()> {
        ensure!(
            topk_align_shapes(n, k, experts, tile),
            "topk_align_seqs: {n} rows (1..={TOPK_ALIGN_ROWS}), top-{k} (<= 8) of {experts} experts (<= 256) in \
             tiles of {tile} (<= 8)"
        );
        let tiles = crate::prefill::max_moe_tiles(n, k, experts, tile);
        ensure!(logits.len() >= n * (experts + 1), "topk_align_seqs: logits");
        ensure!(idx.len() >= n * (k + 1) && wts.len() >= n * (k + 1), "topk_align_seqs: idx / wts");
        ensure!(
            out.rowmap.len() >= n * (k + 1)
                && out.pos.len() >= n * (k + 1)
                && out.tiles.len() >= 3 * tiles
                && out.trows.len() >= 4 * tiles,
            "topk_align_seqs: outputs sized for fewer tokens"
        );
        let [e, ki, ni, bn] = [experts, k, n, tile].map(|v| v as i32);
        let mut l = self.launcher(&self.f.topk_align_seqs);
        l.arg(logits).arg(&e).arg(&ki).arg(&ni).arg(&bn).arg(&*idx).arg(&*wts).arg(&out.rowmap).arg(&out.pos);
        l.arg(&out.ntile).arg(&out.tiles).arg(&out.trows);
        // SAFETY: matches topk_align_seqs in moe_seqs.cu: one block of 32 n threads (n <= TA_ROWS, k <= 8, experts
        // <= 256, tiles of <= 8 pairs: checked); logits hold n rows of experts + 1, idx / wts and the sorted outputs
        // n (k + 1) pairs and max_moe_tiles tiles (checked; trows 16-byte aligned: a fresh allocation).
        unsafe { l.launch(cfg((1, 1), 32 * n as u32, 0)) }?;
        out.holds(n, k, experts, tile, tiles);
        Ok(())
    }

    /// A decode pass's lm_head: [`Gpu::dense_seqs`] (above 16 rows its bulk-copy kernel in passes of 32 rows: alone
    /// on the H200, 211.3 / 421.1 us at 32 / 64 rows, against the prefill's 128-row GEMM's 452.4 at 64).
    pub fn lm_head_seqs(
        &self,
        m: &QMat,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        ldy: usize,
        add: bool,
    ) -> Result<()> {
        self.dense_seqs(m, x, n, y, ldy, add)
    }

    /// `y[t, r] (+)= W[r] · x[t]` for the `n` ≤ [`STREAM_ROWS`] bf16 rows of `x` (`[n, cols]`) and a 4-bit matrix (the
    /// batched step's dense projections and lm_head) on tensor cores: exact 4-bit codes, f32 scale/bias arithmetic and
    /// accumulation; y `[n, ldy]` f32, `add` adds to it (the residual). Where the shapes allow (group size 64, rows a
    /// multiple of 16, columns of 256) the ring kernel ([`Gpu::dense_ring`]: every weight read and dequantised once
    /// for all n tokens), else one block per 8 tokens and 128 rows (or 32 rows with the columns split over its warps,
    /// where 128-row blocks would not fill the GPU twice over). Shapes neither takes (fewer than 16 rows, columns not
    /// a multiple of 32 or of the group size) are refused.
    pub fn dense_seqs(
        &self,
        m: &QMat,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        ldy: usize,
        add: bool,
    ) -> Result<()> {
        ensure!(n <= STREAM_ROWS, "dense_seqs: {n} rows (1..={STREAM_ROWS})");
        check_dense(m, x, n, y, ldy, "dense_seqs")?;
        ensure!(m.rows >= 16, "dense_seqs: {} rows (at least 16)", m.rows);
        if self.dense_tma.load(std::sync::atomic::Ordering::Relaxed) {
            if let Some(s) = dense_tma_slots(m.rows, m.cols, m.gs, n, self.sms as usize) {
                return self.dense_tma(m, x, n, y, ldy, add, s);
            }
        }
        if self.dense_ring.load(std::sync::atomic::Ordering::Relaxed) && m.gs == 64 {
            if let Some(kz) = dense_ring_split(m.rows, m.cols, n, self.sms as usize) {
                return self.dense_ring(m, x, n, y, ldy, add, kz);
            }
        }
        let w = mma_words(m.gs, &[m.cols]);
        let full = n.div_ceil(MM_TG) * m.rows.div_ceil(MM_ROWS);
        let ks = match full < 2 * self.sms as usize && m.cols % (4 * 32 * w) == 0 && m.cols % (4 * m.gs) == 0 {
            true => 4,
            false => 1,
        };
        let rb = MM_ROWS / ks;
        ensure!(m.rows.div_ceil(rb) <= 65535, "dense_seqs: {} rows is over the grid limit", m.rows);
        let groups = n.div_ceil(MM_TG) * m.rows.div_ceil(rb);
        let kz = dense_split(groups, m.cols, ks * 32 * w, ks * m.gs, self.sms as usize);
        let smem = mma_smem(m.cols / kz, w, m.cols / m.gs, ks);
        ensure!(smem <= SMEM_MAX, "dense_seqs: {} columns need {smem} bytes of shared memory", m.cols);
        let gshift = log2_exact(m.gs, "dense_seqs: group size")? - 5;
        let (r, c, ni, ld, a) = (m.rows as i32, m.cols as i32, n as i32, ldy as i32, add as i32);
        let f = match (w, ks) {
            (1, 1) => &self.f.dense_seqs_w1_k1,
            (2, 1) => &self.f.dense_seqs_w2_k1,
            (1, _) => &self.f.dense_seqs_w1_k4,
            _ => &self.f.dense_seqs_w2_k4,
        };
        let mut l = self.launcher(f);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&r).arg(&c).arg(&gshift).arg(x).arg(&ni).arg(&*y).arg(&ld).arg(&a);
        if kz > 1 {
            l.cluster = Some((1, 1, kz as u32));
        }
        let mut lc = cfg((n.div_ceil(MM_TG) as u32, m.rows.div_ceil(rb) as u32), 128, smem);
        lc.grid_dim.2 = kz as u32;
        // SAFETY: matches dense_seqs_w{1,2}_k{1,4} (moe_seqs.cu); W is a whole 4-bit QMat (rows x cols/8 words,
        // rows x cols/gs scales/biases) with rows >= 16 (item starts clamp to rows - 16), cols a multiple of 32 W
        // and of the group size (>= 32 W), and for the split of 4 of 4 x 32 W and 4 x the group size, each of the
        // kz column ranges too (checked, dense_split); x holds n rows of cols bf16, y n rows of stride ldy >= rows
        // (check_dense); blocks past n tokens store nothing; shared memory as laid out there for cols / kz columns
        // (checked against the opt-in limit); with kz > 1 (<= 8, dense_split) the kz blocks of one (x, y) are one
        // cluster, as the kernel's sum over the ranges assumes.
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// [`Gpu::dense_seqs`] through moe_seqs.cu's `dense_ring_n{1,2,4,8}` with the columns split `kz` ways (one
    /// cluster; [`dense_ring_split`] picks it, the bench tries others): blocks of 128 rows that stream their weights
    /// as whole lines through shared memory and dequantise each k-block once for all n tokens (n / 8 groups of 8,
    /// rounded up to a power of two). Group size 64, rows a multiple of 16, columns of 256 kz, at most 32,768 staged
    /// token-columns a block (checked).
    #[allow(clippy::too_many_arguments)]
    pub fn dense_ring(
        &self,
        m: &QMat,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        ldy: usize,
        add: bool,
        kz: usize,
    ) -> Result<()> {
        ensure!((1..=STREAM_ROWS).contains(&n), "dense_ring: {n} rows (1..={STREAM_ROWS})");
        check_dense(m, x, n, y, ldy, "dense_ring")?;
        let tgs = ring_token_slots(n);
        ensure!(
            m.gs == 64 && m.rows >= 16 && m.rows % 16 == 0 && [1, 2, 4, 8].contains(&kz) && m.cols % (256 * kz) == 0,
            "dense_ring: {} x {} group {} in {kz} column ranges (group 64, rows of 16, columns of 256 a range)",
            m.rows,
            m.cols,
            m.gs
        );
        let cz = m.cols / kz;
        ensure!(cz * tgs <= DENSE_RING_X, "dense_ring: {cz} columns x {tgs} token slots a block");
        let smem = ring_smem(cz, tgs);
        ensure!(smem <= SMEM_MAX, "dense_ring: {smem} bytes of shared memory");
        let f = match tgs {
            8 => &self.f.dense_ring_n1,
            16 => &self.f.dense_ring_n2,
            32 => &self.f.dense_ring_n4,
            _ => &self.f.dense_ring_n8,
        };
        let (r, c, ni, ld, a) = (m.rows as i32, m.cols as i32, n as i32, ldy as i32, add as i32);
        let mut l = self.launcher(f);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&r).arg(&c).arg(x).arg(&ni).arg(&*y).arg(&ld).arg(&a);
        if kz > 1 {
            l.cluster = Some((1, 1, kz as u32));
        }
        let mut lc = cfg((m.rows.div_ceil(DENSE_RING_ROWS) as u32, 1), 128, smem);
        lc.grid_dim.2 = kz as u32;
        // SAFETY: matches dense_ring_n{1,2,4,8} (moe_seqs.cu) for tgs = 8 NT token slots >= n; W is a whole 4-bit QMat
        // (rows x cols/8 words, rows x cols/64 scales/biases) with rows a multiple of 16 (items past the end read valid
        // rows and store nothing), each of the kz column ranges whole 256-column chunks with cz * tgs within stage_mma's
        // exact division (checked); x holds n rows of cols bf16, y n rows of stride ldy >= rows (check_dense); shared
        // memory ring_smem(cz, tgs) as laid out there (checked against the opt-in limit; a warp's sums for its
        // cluster, 32 x tgs floats, fit in its ring); with kz > 1 (<= 8) the kz blocks of one row range are one cluster.
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// [`Gpu::dense_seqs`] through moe_seqs.cu's `dense_tma_n{1,2,4}` with a ring of `slots` units: at most one block
    /// a multiprocessor, each streaming a contiguous range of the matrix's 16-row units by bulk copies (the first
    /// `slots` requested before the dependency wait) and dequantising each k-block once for all the tokens of a pass
    /// ([`dense_tma_tgs`] tokens a pass: every token up to 16; above, 32 a pass of 2,048 columns and 16 of 4,096). Group
    /// size 64, rows a multiple of 16, 2,048 or 4,096 columns, n <= [`STREAM_ROWS`] (checked).
    #[allow(clippy::too_many_arguments)]
    pub fn dense_tma(
        &self,
        m: &QMat,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        ldy: usize,
        add: bool,
        slots: usize,
    ) -> Result<()> {
        ensure!((1..=STREAM_ROWS).contains(&n), "dense_tma: {n} rows (1..={STREAM_ROWS})");
        check_dense(m, x, n, y, ldy, "dense_tma")?;
        ensure!(
            dense_tma_shapes(m.rows, m.cols, m.gs),
            "dense_tma: {} x {} group {} (group 64, rows of 16, columns 2048 or 4096)",
            m.rows,
            m.cols,
            m.gs
        );
        ensure!((1..=DT_MAXS).contains(&slots), "dense_tma: {slots} ring slots (1..={DT_MAXS})");
        let tgs = dense_tma_tgs(m.cols, n);
        // stage_mma's division by the pass's token count is exact for cols / 64 k-blocks of up to 32 tokens
        ensure!(m.cols * tgs <= 65536, "dense_tma: {} columns x {tgs} tokens a pass", m.cols);
        let smem = dense_tma_smem(m.cols, tgs, slots);
        ensure!(smem <= SMEM_MAX, "dense_tma: {smem} bytes of shared memory");
        let units = m.rows / 16;
        let grid = units.min(self.sms as usize) as u32;
        // the kernel splits the units as units * block / grid in 32 bits
        ensure!(units as u64 * grid as u64 <= u32::MAX as u64, "dense_tma: {} rows", m.rows);
        let f = match tgs {
            8 => &self.f.dense_tma_n1,
            16 => &self.f.dense_tma_n2,
            _ => &self.f.dense_tma_n4,
        };
        let (r, c, ni, ld, a, sl) = (m.rows as i32, m.cols as i32, n as i32, ldy as i32, add as i32, slots as i32);
        let mut l = self.launcher(f);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&r).arg(&c).arg(x).arg(&ni).arg(&*y).arg(&ld).arg(&a).arg(&sl);
        // SAFETY: matches dense_tma_n{1,2,4} (moe_seqs.cu) for tgs = 8 NT token slots a pass (cols tgs <= 65,536,
        // checked), n <= STREAM_ROWS rows in passes of tgs; W is a whole 4-bit QMat
        // (rows x cols/8 words, rows x cols/64 scales/biases: every unit's bulk copies inside them) with rows a
        // multiple of 16 and cols of 2048 (16-byte aligned, whole copies of codes, scales and biases; a multiple of
        // 4 k-blocks a warp); x holds n rows of cols bf16, y n rows of stride ldy >= rows (check_dense); grid <=
        // units (every block has a unit) and units * grid within 32 bits (its split, checked); slots <= DT_MAXS;
        // shared memory dense_tma_smem(cols, tgs, slots) as laid out there (checked against the opt-in limit).
        unsafe { l.launch(cfg((grid, 1), (32 * DT_WARPS) as u32, smem)) }?;
        Ok(())
    }

    /// Streamed gate|up + SwiGLU over the expert-sorted pairs of [`Gpu::moe_align`] (few tokens per expert, on
    /// tensor cores): `act[p, j] = silu(G_e[j] · xb[rowmap[p]]) · (U_e[j] · xb[rowmap[p]])`, bf16 `[pairs, max(I, Is)]`
    /// (the prefill GEMMs' layout), from the bf16 post-norm rows `xb` (the mma's operands as the norm rounds them).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_seqs(
        &self,
        gu: &Experts,
        n_experts: usize,
        (i, is): (usize, usize),
        h: usize,
        xb: &CudaSlice<u16>,
        sorted: &MoeSorted,
        act: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let imax = i.max(is);
        let pairs = sorted.n * (sorted.k + 1);
        let w = mma_words(gu.gs, &[h]);
        ensure!(
            gu.gs >= 32 && gu.gs.is_power_of_two() && h % gu.gs == 0 && i % 8 == 0 && is % 8 == 0 && i > 0 && is > 0,
            "moe_gate_up_seqs: sizes {h}/{i}/{is}, group size {}",
            gu.gs
        );
        ensure!(gu.s.len() >= n_experts * gu.groups + 2 * is * h / gu.gs, "moe_gate_up_seqs: scales too short");
        ensure!(gu.b.len() >= n_experts * gu.groups + 2 * is * h / gu.gs, "moe_gate_up_seqs: biases too short");
        ensure!(xb.len() >= sorted.n * h && act.len() >= pairs * imax, "moe_gate_up_seqs: buffers");
        ensure!(gu.w.len() >= n_experts * gu.words + 2 * is * h / 8, "moe_gate_up_seqs: expert buffer too short");
        ensure!(sorted.experts == n_experts && sorted.max_tiles > 0, "moe_gate_up_seqs: align of another shape");
        ensure!(sorted.tile <= 8, "moe_gate_up_seqs: tiles of {} pairs (at most 8: trows)", sorted.tile);
        // the ring kernels where the shapes allow (the same products bit for bit), else the register-streamed ones;
        // both take the same arguments
        // (the ring kernels read the tile-major copy)
        let tiled = gu.tiled.as_ref().filter(|_| self.ring_fits(gu.gs, &[h, i, is]));
        let (f, smem) = match (tiled.is_some(), sorted.tile <= 4, w) {
            (true, true, _) => (&self.f.moe_gate_up_ring_t4, ring_smem(h, 4)),
            (true, false, _) => (&self.f.moe_gate_up_ring_t8, ring_smem(h, 8)),
            (false, _, 2) => (&self.f.moe_gate_up_seqs_w2, mma_smem(h, w, h / gu.gs, 1)),
            (false, _, _) => (&self.f.moe_gate_up_seqs_w1, mma_smem(h, w, h / gu.gs, 1)),
        };
        ensure!(smem <= SMEM_MAX, "moe_gate_up_seqs: hidden size {h} needs {smem} bytes of shared memory");
        let glog = log2_exact(gu.gs, "moe_gate_up_seqs: group size")? - 5;
        let (words, groups) = (gu.words as i64, gu.groups as i64);
        let v = [n_experts, i, is, h].map(|v| v as i32);
        let ld = imax as i32;
        let mut l = self.launcher(f);
        match tiled {
            Some(t) => l.arg(&t.w).arg(&t.s).arg(&t.b),
            None => l.arg(&gu.w).arg(&gu.s).arg(&gu.b),
        };
        l.arg(&words).arg(&groups).arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&v[3]);
        l.arg(&glog).arg(xb).arg(&sorted.ntile).arg(&sorted.tiles).arg(&sorted.trows).arg(&*act).arg(&ld);
        let grid = (imax.div_ceil(MM_J) as u32, sorted.max_tiles as u32);
        // SAFETY: matches moe_gate_up_seqs_w{1,2} and moe_gate_up_ring_t{4,8} (moe_seqs.cu; 64 j a block each); the
        // tiles come from moe_align over `sorted`'s n, k and experts: expert ids <= n_experts (the shared one last,
        // inside the buffer, checked), pairs < n*(k+1) rows of act, the tiles' tokens (trows, which moe_align
        // writes for tiles of <= 8 pairs, checked) < n rows of xb; every grid row's tile entry is inside the list's
        // room (read before its length); H a multiple of 32 W and of the group size (so of 32 W), the inner sizes
        // multiples of 8 (an item past n clamps its rows); the ring kernels only for group size 64 and H, I, Is
        // multiples of 256 (ring_fits: whole 128-byte chunks of each row, 16-byte aligned rows, 8-byte aligned scale
        // rows), reading the tile-major copy (tile_experts: the same lengths as the checked buffers); tiles of more pairs than a kernel's token slots take several passes; blocks past *ntile or the
        // expert's rows exit; shared memory as laid out there (checked against the opt-in limit).
        unsafe { l.launch(cfg(grid, 128, smem)) }?;
        Ok(())
    }

    /// Streamed down projection (tensor cores): `ybuf[p, r] = D_e[r] · act[p]` (f32 `[pairs, h]`; combined by
    /// [`Gpu::moe_combine`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_seqs(
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
        let w = mma_words(down.gs, &[i, is]);
        ensure!(
            down.gs >= 32
                && down.gs.is_power_of_two()
                && h % 16 == 0
                && h >= 16
                && i % down.gs == 0
                && is % down.gs == 0,
            "moe_down_seqs: sizes {h}/{i}/{is}, group size {}",
            down.gs
        );
        ensure!(down.s.len() >= n_experts * down.groups + h * is / down.gs, "moe_down_seqs: scales too short");
        ensure!(down.b.len() >= n_experts * down.groups + h * is / down.gs, "moe_down_seqs: biases too short");
        ensure!(act.len() >= pairs * imax && ybuf.len() >= pairs * h, "moe_down_seqs: buffers");
        ensure!(down.w.len() >= n_experts * down.words + h * is / 8, "moe_down_seqs: expert buffer too short");
        ensure!(sorted.experts == n_experts && sorted.max_tiles > 0, "moe_down_seqs: align of another shape");
        let tiled = down.tiled.as_ref().filter(|_| self.ring_fits(down.gs, &[h, i, is]));
        let (f, smem, rows) = match (tiled.is_some(), sorted.tile <= 4, w) {
            (true, true, _) => (&self.f.moe_down_ring_t4, ring_smem(imax, 4), RING_DOWN_ROWS),
            (true, false, _) => (&self.f.moe_down_ring_t8, ring_smem(imax, 8), RING_DOWN_ROWS),
            (false, _, 2) => (&self.f.moe_down_seqs_w2, mma_smem(imax, w, imax / down.gs, 1), MM_ROWS),
            (false, _, _) => (&self.f.moe_down_seqs_w1, mma_smem(imax, w, imax / down.gs, 1), MM_ROWS),
        };
        ensure!(smem <= SMEM_MAX, "moe_down_seqs: inner size {imax} needs {smem} bytes of shared memory");
        let glog = log2_exact(down.gs, "moe_down_seqs: group size")? - 5;
        let (words, groups) = (down.words as i64, down.groups as i64);
        let v = [n_experts, i, is, h].map(|v| v as i32);
        let ld = imax as i32;
        let mut l = self.launcher(f);
        match tiled {
            Some(t) => l.arg(&t.w).arg(&t.s).arg(&t.b),
            None => l.arg(&down.w).arg(&down.s).arg(&down.b),
        };
        l.arg(&words).arg(&groups).arg(&v[0]).arg(&v[1]).arg(&v[2]);
        l.arg(&v[3]).arg(&glog).arg(act).arg(&ld).arg(&sorted.ntile).arg(&sorted.tiles).arg(&*ybuf);
        let grid = (h.div_ceil(rows) as u32, sorted.max_tiles as u32);
        // SAFETY: matches moe_down_seqs_w{1,2} (128 rows a block) and moe_down_ring_t{4,8} (256) (moe_seqs.cu);
        // tiles from moe_align (see moe_gate_up_seqs; every grid row's entry inside the list's room): pairs < rows of
        // act and ybuf, expert ids inside the buffer;
        // each expert's inner size (I or Is) <= imax = act's row stride and a multiple of the group size (so of 32 W);
        // h a multiple of 16 (an item past h clamps its rows); the ring kernels only where ring_fits, on the
        // tile-major copy (see moe_gate_up_seqs); shared memory sized for imax (checked against the opt-in limit).
        unsafe { l.launch(cfg(grid, 128, smem)) }?;
        Ok(())
    }
}

/// The shapes [`Gpu::topk_align_seqs`] takes: 1..=[`TOPK_ALIGN_ROWS`] rows, top-k <= 8 of k..=256 experts, tiles of
/// <= 8 pairs.
pub fn topk_align_shapes(n: usize, k: usize, experts: usize, tile: usize) -> bool {
    (1..=TOPK_ALIGN_ROWS).contains(&n)
        && (1..=8).contains(&k)
        && (k..=256).contains(&experts)
        && (1..=8).contains(&tile)
}

/// Column ranges dense_seqs splits a product over (grid z, one cluster: `dense_mma` in moe_seqs.cu) where its `groups`
/// blocks (of 4 warps) would leave the GPU mostly idle: the most of 1, 2, 4, 8 (the portable cluster size) that keeps
/// the blocks' warps within 8 a multiprocessor, each range a multiple of `unit` columns (32 W times the in-block
/// split) and of `gunit` (the group size times it). 2,048-row matrices at B <= 8: 64 blocks, so 4 ways (each warp 4
/// k-blocks instead of 16).
fn dense_split(groups: usize, cols: usize, unit: usize, gunit: usize, sms: usize) -> usize {
    let fits = |kz: usize| groups * 4 * kz <= 8 * sms && cols % (kz * unit) == 0 && cols % (kz * gunit) == 0;
    [8, 4, 2].into_iter().find(|&kz| fits(kz)).unwrap_or(1)
}

/// Warps of dense_tma's blocks (DT_WARPS in moe_seqs.cu) and the most ring slots it takes (DT_MAXS).
const DT_WARPS: usize = 8;
const DT_MAXS: usize = 8;

/// Bytes of one dense_tma ring slot for `cols` columns: 16 rows of codes (cols / 2 bytes each), their scales and
/// biases (cols / 32 bytes a row each), to 128 bytes.
fn dense_tma_slot(cols: usize) -> usize {
    (16 * (cols / 2 + 2 * (cols / 32))).next_multiple_of(128)
}

/// Shared memory of dense_tma (moe_seqs.cu) for `cols` columns, `tgs` token slots and `slots` ring slots: the staged
/// bf16 tokens and their sums per 64-column k-block, the warps' partial sums (twice 16 rows x tgs), to 128 bytes,
/// then the ring.
fn dense_tma_smem(cols: usize, tgs: usize, slots: usize) -> usize {
    (cols / 8 * tgs * 16 + cols / 64 * tgs * 4 + 2 * DT_WARPS * 16 * tgs * 4).next_multiple_of(128)
        + slots * dense_tma_slot(cols)
}

/// The matrices dense_tma takes: group size 64, rows a multiple of 16, 2,048 or 4,096 columns.
fn dense_tma_shapes(rows: usize, cols: usize, gs: usize) -> bool {
    gs == 64 && rows >= 16 && rows % 16 == 0 && (cols == 2048 || cols == 4096)
}

/// Whether [`Gpu::dense_tma`] takes a `rows x cols` product (group size `gs`) at `n` tokens with `slots` ring slots:
/// its shapes, 1..=[`STREAM_ROWS`] tokens, 1..=DT_MAXS slots, and its shared memory within the limit.
pub fn dense_tma_takes(rows: usize, cols: usize, gs: usize, n: usize, slots: usize) -> bool {
    dense_tma_shapes(rows, cols, gs)
        && (1..=STREAM_ROWS).contains(&n)
        && (1..=DT_MAXS).contains(&slots)
        && dense_tma_smem(cols, dense_tma_tgs(cols, n), slots) <= SMEM_MAX
}

/// The ring slots dense_seqs gives dense_tma for a `rows x cols` product (group size `gs`) at `n` tokens on `sms`
/// multiprocessors, or None where it keeps the ring kernel or the register-streamed one. Up to 16 tokens: the shapes
/// dense_tma takes, at most [`DENSE_RING_X`] staged token-columns (out_proj / o_proj above 8 tokens) and at most
/// [`DT_UNITS`] units a block (not the lm_head). Two slots (one where a block has one unit): more kept the next
/// kernel's blocks off the multiprocessor and were slower (in_proj at 8 tokens 8.1 us with 2, 9.0 with 4). Above 16
/// tokens the 2,048-column matrices (in_proj, q|k|v and the lm_head, in passes of [`dense_tma_tgs`] tokens): measured
/// alone on the H200 (docs/decisions.md, step 40), us at 32 / 64 tokens, in_proj 18.2 / 35.1 against the
/// register-streamed kernel's 21.6 / 43.0, q|k|v 16.3 / 31.4 against 21.0 / 35.4, the lm_head 211.3 / 421.1 against
/// 427.9 and the GEMM's 452.4; not out_proj and o_proj, whose 128 blocks would each stage every token's 4,096 columns
/// for one unit (32 tokens 19.4 against the ring kernel's 12.4).
pub fn dense_tma_slots(rows: usize, cols: usize, gs: usize, n: usize, sms: usize) -> Option<usize> {
    if !dense_tma_shapes(rows, cols, gs) || !(1..=STREAM_ROWS).contains(&n) || sms == 0 {
        return None;
    }
    let units = rows / 16;
    let per = units.div_ceil(units.min(sms));
    let tgs = dense_tma_tgs(cols, n);
    let slots = per.min(2);
    let takes = match n > 16 {
        true => cols <= 2048,
        false => cols * tgs <= DENSE_RING_X && per <= DT_UNITS,
    };
    (takes && dense_tma_smem(cols, tgs, slots) <= SMEM_MAX).then_some(slots)
}

/// Token slots of a dense_tma pass for `n` tokens of `cols` columns: up to 16 tokens, all of them (8 or 16); above,
/// 32 a pass of 2,048 columns and 16 of 4,096 (128 KB of staged bf16 tokens, which leaves room for the ring).
pub fn dense_tma_tgs(cols: usize, n: usize) -> usize {
    match (n <= 16, cols <= 2048) {
        (true, _) => ring_token_slots(n),
        (false, true) => 32,
        (false, false) => 16,
    }
}

/// The most 16-row units a dense_tma block streams where dense_seqs takes it: the lm_head's 118 a block ran 111 us
/// against the ring kernel's 102 at 8 tokens (its per-unit barrier is exposed when a block streams many).
const DT_UNITS: usize = 8;

/// Rows per block of dense_ring (RING_NW warps x RING_R items of 16 rows).
const DENSE_RING_ROWS: usize = 128;
/// At most this many staged token-columns (columns x token slots) a dense_ring block: 64 KB of bf16 tokens, which
/// keeps two blocks a multiprocessor and stage_mma's division by the token count exact.
const DENSE_RING_X: usize = 32768;

/// Token slots of dense_ring for n tokens: 8 per group of 8, the groups rounded up to 1, 2, 4 or 8.
fn ring_token_slots(n: usize) -> usize {
    8 * n.div_ceil(8).next_power_of_two()
}

/// Column ranges dense_ring splits a `rows x cols` product at `n` tokens over (one cluster), or None where dense_seqs
/// keeps the register-streamed kernel: shapes the ring kernel does not take (rows not a multiple of 16, columns not of
/// 256), and above 16 tokens every matrix but the few-row ones (fewer than sms / 4 row blocks: out_proj, o_proj).
/// Otherwise the fewest of 1, 2, 4, 8 ranges that give at least 1.4 blocks a multiprocessor, within the staged-token
/// limit (DENSE_RING_X); where none does, the most that fits.
///
/// Measured on the H200 (tern bench, us a launch at n = 1 / 8 / 16 / 32 / 64, ring with 1 / 2 / 4 / 8 ranges against
/// the register-streamed kernel): in_proj (97 row blocks) best in 2 ranges up to 16 tokens (n = 8: 9.9 / 9.4 / 12.4 /
/// 15.7 against 12.9) and slower than it above (n = 32: 25.8 at best against 21.5); q|k|v (72) in 4 (n = 8: 8.1
/// against 12.6); out_proj / o_proj (16) in 8 at every n (n = 8 / 64: 6.4 / 22.0 against 10.0 / 28.7); the lm_head
/// (1,940) in 1 up to 16 tokens (n = 8 / 16: 102 / 150 against 127 / 226) and slower above (n = 32: 404 against 425
/// at best, n = 64: 799 against the GEMM's 448).
fn dense_ring_split(rows: usize, cols: usize, n: usize, sms: usize) -> Option<usize> {
    if rows < 16 || rows % 16 != 0 || cols % 256 != 0 || !(1..=STREAM_ROWS).contains(&n) {
        return None;
    }
    let blocks = rows.div_ceil(DENSE_RING_ROWS);
    if n > 16 && 4 * blocks >= sms {
        return None;
    }
    let tgs = ring_token_slots(n);
    let fits = |kz: &usize| cols % (256 * kz) == 0 && cols / kz * tgs <= DENSE_RING_X;
    let mut ways = [1, 2, 4, 8].into_iter().filter(fits);
    ways.clone().find(|kz| 5 * blocks * kz >= 7 * sms).or_else(|| ways.next_back())
}

/// Packed words per lane per k-block of the streamed expert kernels: 2 (k-blocks of 64 columns) where the group size
/// and every inner size allow it, else 1 (32 columns).
fn mma_words(gs: usize, ks: &[usize]) -> usize {
    if gs % 64 == 0 && ks.iter().all(|k| k % 64 == 0) {
        2
    } else {
        1
    }
}

/// Shared memory of the streamed tensor-core kernels (experts and dense_seqs) for `k` columns with the columns split
/// `ks` ways (1 for the experts): the staged bf16 tokens (16 bytes per 8 columns and token), their f32 sums per
/// k-block, the block's 128 / ks rows of scales and biases (`ng` groups a row), the splits' partial sums (`ks - 1`
/// of 128 / ks rows x 8 tokens) and the block's sums (128 / ks rows x 8 tokens, for its cluster).
fn mma_smem(k: usize, w: usize, ng: usize, ks: usize) -> usize {
    let rb = MM_ROWS / ks;
    k * 16 + k / (32 * w) * MM_TG * 4 + 2 * rb * mma_scale_stride(ng) * 2 + ks * rb * MM_TG * 4
}

/// Row stride of the kernels' shared copy of scales (`mma_scale_stride` in moe_seqs.cu).
fn mma_scale_stride(ng: usize) -> usize {
    8 * (ng.div_ceil(8) | 1)
}

/// Output rows per block of moe_down_ring (RING_NW warps x RING_R items of 16 rows x 2 sets).
const RING_DOWN_ROWS: usize = 256;
/// Bytes of one warp's ring in the ring kernels (RING_S stages of RING_SLOT) times RING_NW warps.
const RING_BYTES: usize = 4 * 2 * (2 * (2048 + 256));

/// Shared memory of the ring expert kernels for `cols` staged columns of `tgs` token slots (moe_seqs.cu
/// `ring_base`): the bf16 tokens and their sums per 64-column k-block, to 128 bytes, then the warps' rings.
fn ring_smem(cols: usize, tgs: usize) -> usize {
    (cols / 8 * tgs * 16 + cols / 64 * tgs * 4).next_multiple_of(128) + RING_BYTES
}

impl Gpu {
    /// Whether the streamed expert products take the ring kernels: turned on ([`Gpu::moe_ring`]), group size 64 and
    /// every inner size a multiple of their 256-column chunks.
    fn ring_fits(&self, gs: usize, sizes: &[usize]) -> bool {
        self.moe_ring.load(std::sync::atomic::Ordering::Relaxed) && crate::gpu::ring_shapes(gs, sizes)
    }
}

/// A head's value columns in blocks of 64 (whole 32-column chunks, keeping gdn_step's sums), or one block for a head
/// of at most 64: the blocks a head of the `_seqs` GDN kernels takes.
fn gdn_parts(d: GdnDims) -> usize {
    if d.dv % 64 == 0 {
        d.dv / 64
    } else {
        1
    }
}

/// Warps of 32 columns per row group of a block of the `_seqs` GDN kernels.
fn smem_cols(d: GdnDims, parts: usize) -> usize {
    (d.dv / parts).div_ceil(32)
}

/// The checks gdn_verify_seqs and gdn_commit_seqs share; their parts and shared memory.
#[allow(clippy::too_many_arguments)]
fn gdn_rows_check(
    d: GdnDims,
    ldp: usize,
    proj_len: usize,
    row0: usize,
    segs: &SegTable,
    rings: &CudaView<u64>,
    states: &CudaView<u64>,
    conv_w: &CudaSlice<f32>,
    a_log: &CudaSlice<f32>,
    dt_bias: &CudaSlice<f32>,
) -> Result<(usize, usize)> {
    let conv_dim = d.conv_dim();
    let vd = d.hv * d.dv;
    ensure!(d.dk <= 128 && d.dv <= 256 && d.dv % 4 == 0 && d.hv % d.hk == 0 && d.taps >= 1, "gdn rows: dims");
    ensure!(segs.n() > 0 && segs.n() <= 65535, "gdn rows: {} sequences", segs.n());
    ensure!(ldp >= conv_dim + vd + 2 * d.hv && proj_len >= (row0 + segs.rows()) * ldp, "gdn rows: proj");
    ensure!(conv_w.len() == conv_dim * d.taps && a_log.len() >= d.hv && dt_bias.len() >= d.hv, "gdn rows: weights");
    ensure!(rings.len() >= segs.n() && states.len() >= segs.n(), "gdn rows: tables");
    let parts = gdn_parts(d);
    let dvp = d.dv / parts;
    ensure!(dvp <= 64 && dvp % 4 == 0 && parts <= 8, "gdn rows: {} value columns a head", d.dv);
    let smem = d.dk * dvp * 4;
    ensure!(smem <= SMEM_MAX, "gdn rows: a block's state of {smem} bytes is over the shared memory limit");
    Ok((parts, smem))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// dense_ring's column ranges (host side, no GPU) for the model's matrices on 132 multiprocessors, and the shapes
    /// it leaves to the register-streamed kernel.
    #[test]
    fn dense_ring_split_fills_the_gpu_within_shared_memory() {
        let split = |rows, cols| [1, 8, 16, 32, 64].map(|n| dense_ring_split(rows, cols, n, 132));
        // in_proj (97 row blocks), q|gate|k|v (72), out_proj / o_proj (16), lm_head (1,940)
        assert_eq!(split(12352, 2048), [Some(2), Some(2), Some(2), None, None]);
        assert_eq!(split(9216, 2048), [Some(4), Some(4), Some(4), None, None]);
        assert_eq!(split(2048, 4096), [Some(8); 5]);
        assert_eq!(split(248320, 2048), [Some(1), Some(1), Some(1), None, None]);
        // few row blocks: the most ranges of whole chunks (1,024 columns: 4), whatever the tokens
        assert_eq!(dense_ring_split(512, 2048, 64, 132), Some(8));
        assert_eq!(dense_ring_split(512, 1024, 64, 132), Some(4));
        assert_eq!(dense_ring_split(512, 1024, 1, 132), Some(4));
        assert_eq!(ring_token_slots(1), 8);
        assert_eq!(ring_token_slots(9), 16);
        assert_eq!(ring_token_slots(33), 64);
        // rows not a multiple of 16, columns not of 256
        assert_eq!(dense_ring_split(1000, 2048, 8, 132), None);
        assert_eq!(dense_ring_split(2048, 96, 8, 132), None);
        // 1,280 columns (5 chunks) split no further: they fit 8 token slots, not 64
        assert_eq!(dense_ring_split(512, 1280, 8, 132), Some(1));
        assert_eq!(dense_ring_split(512, 1280, 64, 132), None);
    }

    /// dense_tma's ring slots (host side) for the model's matrices on 132 multiprocessors: two (one for a block of one
    /// unit), within the opt-in limit, none for the lm_head, for out_proj above 8 tokens and for the shapes it does
    /// not take.
    #[test]
    fn dense_tma_slots_pick_the_dense_matrices() {
        let slots = |rows, cols| [1, 8, 9, 16, 17, 64].map(|n| dense_tma_slots(rows, cols, 64, n, 132));
        // in_proj: 772 units, 6 a block; q|gate|k|v: 576, 5 a block; above 16 tokens in passes of 32
        assert_eq!(slots(12352, 2048), [Some(2); 6]);
        assert_eq!(slots(9216, 2048), [Some(2); 6]);
        // out_proj / o_proj: 128 units, one a block (all of it requested before the dependency wait), up to 8 tokens
        assert_eq!(slots(2048, 4096), [Some(1), Some(1), None, None, None, None]);
        // the lm_head: 118 units a block, above 16 tokens in passes of 32
        assert_eq!(slots(248320, 2048), [None, None, None, None, Some(2), Some(2)]);
        for (rows, cols) in [(12352, 2048), (9216, 2048), (2048, 4096), (248320, 2048)] {
            for n in 1..=STREAM_ROWS {
                if let Some(s) = dense_tma_slots(rows, cols, 64, n, 132) {
                    let tgs = dense_tma_tgs(cols, n);
                    assert!(dense_tma_smem(cols, tgs, s) <= SMEM_MAX && cols * tgs <= 65536, "{rows}x{cols} n {n}");
                }
            }
        }
        assert_eq!([1, 9, 16, 17, 64].map(|n| dense_tma_tgs(2048, n)), [8, 16, 16, 32, 32]);
        assert_eq!([1, 9, 16, 17, 64].map(|n| dense_tma_tgs(4096, n)), [8, 16, 16, 16, 16]);
        // group size, rows, columns it does not take
        assert_eq!(dense_tma_slots(2048, 4096, 32, 8, 132), None);
        assert_eq!(dense_tma_slots(1000, 2048, 64, 8, 132), None);
        assert_eq!(dense_tma_slots(2048, 1024, 64, 8, 132), None);
        assert_eq!(dense_tma_slots(2048, 8192, 64, 8, 132), None);
    }

    /// dense_seqs' column split (host side, no GPU): 4 / 2 / 1 ways for the 2,048-row matrices at 8 / 16 / 32 rows on
    /// 132 multiprocessors, never more ways than the columns, the group size or a cluster (8) allow.
    #[test]
    fn dense_split_follows_the_idle_gpu_and_the_shapes() {
        // out_proj / o_proj: 2,048 x 4,096, group 64, W = 2, 4 column splits in the block (unit 256, gunit 256)
        let groups = |n: usize| n.div_ceil(MM_TG) * 2048usize.div_ceil(MM_ROWS / 4);
        let split = |n: usize| dense_split(groups(n), 4096, 256, 256, 132);
        assert_eq!([split(1), split(8), split(16), split(32), split(64)], [4, 4, 2, 1, 1]);
        // in_proj at 8 rows: 386 blocks already keep the GPU busy
        assert_eq!(dense_split(386, 2048, 256, 256, 132), 1);
        // every way divides the columns into whole groups and k-blocks of each in-block split
        for (cols, unit, gunit) in [(4096, 256, 256), (2048, 128, 128), (512, 256, 512), (96, 32, 32)] {
            let kz = dense_split(16, cols, unit, gunit, 132);
            assert!(cols % (kz * unit) == 0 && cols % (kz * gunit) == 0, "{cols} columns in {kz} ways");
        }
        assert_eq!(dense_split(16, 512, 256, 512, 132), 1); // a group of 128 x 4 splits: no room
        assert_eq!(dense_split(1, 1 << 16, 32, 32, 132), 8); // one block's worth: at most a cluster of 8
    }
}
