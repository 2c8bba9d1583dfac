//! The forward pass, written once: `layers_pass` is the layer over a flat batch of rows (prompt rows and decode
//! rows of many sequences), and [`crate::DeviceModel::forward_seqs`] the one forward an engine step runs (its last
//! rows' lm_head and draws; a decode-only pass replays a CUDA graph of its shape). [`DeviceState::prefill`] reads
//! one sequence's prompt through the same layer, chunk by chunk, leaving the batch-1 decode graph's state.

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::{sys, CudaEvent, CudaSlice};

use crate::batch::{ptr, MAX_SEQS, MAX_SPLIT};
use crate::gpu::{Gpu, QMat};
use crate::model::{DLayer, DMixer, DeviceModel};
use crate::prefill::{stream_tile, GdnDims, MOE_TILE, STREAM_MAX_TOKENS, STREAM_ROWS};
use crate::sample::SampleBatch;
use crate::seq::LState;
use crate::seq::{DeviceState, Profile};
use crate::workspace::{pass_fits, scratch_rows, tables, PassTables, PrefillBuffers, Scratch, SeqScratch};
use tern_engine::{Sample, Sampled, SamplingParams};

/// What a prefill returns besides the state it leaves.
#[derive(Default, Debug)]
pub struct PrefillOut {
    /// `[n, vocab]` when asked for every position's logits.
    pub logits: Vec<f32>,
    /// Per layer, the routed experts of every token (`[n * k]`), when asked (tests hold routing equal with them).
    pub routes: Vec<Vec<usize>>,
}

impl DeviceState {
    /// Read `ids` after what the sequence holds through the multi-token kernels, in chunks of the backend's prefill
    /// chunk: afterwards `logits` holds the last position's logits, `tok` their argmax and the position counter the
    /// new length (as after `ids.len()` decode steps). With `all_logits`, every position's logits are returned;
    /// with `log_routes`, every layer's expert choices. On error the sequence's state is undefined (discard it).
    pub fn prefill(&mut self, m: &DeviceModel, ids: &[u32], all_logits: bool, log_routes: bool) -> Result<PrefillOut> {
        self.prefill_profiled(m, ids, all_logits, log_routes, None)
    }

    /// [`DeviceState::prefill`]; with `prof`, every launch is bracketed by events and timed by kernel family
    /// (the stream is not synchronised in between, so the sum is close to the real pass).
    pub fn prefill_profiled(
        &mut self,
        m: &DeviceModel,
        ids: &[u32],
        all_logits: bool,
        log_routes: bool,
        prof: Option<&mut Profile>,
    ) -> Result<PrefillOut> {
        let (g, c) = (&*m.gpu, &m.config);
        ensure!(!ids.is_empty(), "prefill needs at least one token");
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the vocabulary (size {})", c.vocab_size);
        }
        ensure!(
            self.len + ids.len() <= self.room,
            "the prompt does not fit: {} tokens held + {} new > the sequence's room of {} tokens",
            self.len,
            ids.len(),
            self.room
        );
        let mut guard =
            m.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned by an earlier panic"))?;
        let PrefillBuffers { chunk, scratch, tables: tslot, .. } = &mut *guard;
        let chunk = *chunk;
        let sc = scratch_rows(scratch, m.shapes(), chunk)?;
        let t = tables(tslot, m.shapes())?;
        t.set_states(g, &[self.layer_ptrs(m)?])?;
        let mut out = PrefillOut::default();
        if log_routes {
            out.routes = vec![Vec::with_capacity(ids.len() * c.num_experts_per_tok); c.num_layers()];
        }
        let mut events = Vec::new();
        for part in ids.chunks(chunk) {
            let logits = all_logits.then_some(&mut out.logits);
            let routes = log_routes.then_some(&mut out.routes);
            self.prefill_chunk(m, sc, t, part, logits, routes, prof.is_some().then_some(&mut events))?;
        }
        g.stream.synchronize()?;
        if let Some(p) = prof {
            p.add_events(&events)?;
        }
        Ok(out)
    }

    /// One chunk through every layer, the sequence's state pointers already in `t`.
    #[allow(clippy::too_many_arguments)]
    fn prefill_chunk(
        &mut self,
        m: &DeviceModel,
        sc: &mut Scratch,
        t: &mut PassTables,
        ids: &[u32],
        all_logits: Option<&mut Vec<f32>>,
        routes: Option<&mut Vec<Vec<usize>>>,
        mut events: Option<&mut Vec<(&'static str, CudaEvent)>>,
    ) -> Result<()> {
        let (g, c) = (&*m.gpu, &m.config);
        let n = ids.len();
        // profiling: an event before each kernel family's launch (the name is the family that follows)
        let mut mark = |name: &'static str| -> Result<()> {
            if let Some(ev) = events.as_deref_mut() {
                ev.push((name, g.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?));
            }
            Ok(())
        };
        ensure!(n <= sc.cap, "prefill chunk of {n} tokens over the buffers' {}", sc.cap);
        let pos0 = self.len;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        t.segs.set(g, &[(n, pos0)])?;
        mark("embed")?;
        g.embed_rows(&m.embed, ids, &mut sc.ids, &mut sc.x)?;
        let routes = routes.map(|r| StepRoutes::Log(&mut r[..]));
        let rows = PassRows { np: n, nd: 0, nv: 0, nvs: 0, ns: 0 };
        layers_pass(m, &m.layers, sc, None, t, rows, false, routes, &mut mark)?;
        if let Some(out) = all_logits {
            let v = c.vocab_size;
            mark("lm_head all rows")?;
            g.rmsnorm_rows(&sc.x, n, &m.norm, eps, &mut sc.xb, None)?;
            let mut dl = g.zeros::<f32>(n * v)?;
            g.gemm_q4(&m.lm_head, &sc.xb, n, &mut dl, v, false)?;
            out.extend(g.download(&dl)?);
        }
        // the last row through the decode step's own tail: logits, argmax -> tok, position -> pos0 + n
        mark("lm_head+argmax (last row)")?;
        g.stream.memcpy_dtod(&sc.x.slice((n - 1) * h..n * h), &mut self.x.slice_mut(..h))?;
        g.stream.memcpy_htod(&[(pos0 + n - 1) as i32], &mut self.pos)?;
        g.gemv(&m.lm_head, &self.x, Some(&m.norm), eps, &mut self.logits, 0, false)?;
        g.argmax(&self.logits, &mut self.apv, &mut self.api, &mut self.tok, &mut self.pos)?;
        mark("")?;
        self.len = pos0 + n;
        self.pos_stale = false;
        Ok(())
    }

    /// Zero the recurrent state, conv rings and position: an empty sequence again (the KV rows are left as they
    /// are; nothing reads rows past the length).
    pub fn reset(&mut self, g: &Gpu) -> Result<()> {
        self.mem.zero_gdn()?;
        g.stream.memcpy_htod(&[0i32], &mut self.pos)?;
        self.len = 0;
        self.pos_stale = false;
        Ok(())
    }
}

/// The rows of one forward pass, in this order: `np` prompt rows (the segments of `t.segs`, sequences `0..segs.n()`
/// of the pass tables), then `nd` decode rows (one token each of the next `nd` entries of the tables, at the
/// positions `t.posv[0..nd]`), then `nv` verify rows (a speculative verify's token and drafts, `nvs` sequences of
/// `t.vsegs`, each row an entry of the tables at its position `t.posv[nd..]`, then each sequence an entry of its
/// own). A decode row is a one-token read: the GDN and attention step kernels take it (the `_seqs` kernels of gdn.cu /
/// attention.cu), where a prompt row goes through the chunked GDN and flash attention; a verify row is a decode row
/// but for the GDN, where gdn_verify_seqs reads each sequence's rows in order without writing its state (the commit
/// does, for the rows kept). Every other op runs once over all the rows. `ns`: the step rows' flash-decoding splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PassRows {
    pub np: usize,
    pub nd: usize,
    pub nv: usize,
    pub nvs: usize,
    pub ns: usize,
}

impl PassRows {
    pub fn n(&self) -> usize {
        self.np + self.nd + self.nv
    }

    /// The rows the step kernels take: decode rows and verify rows.
    pub fn step(&self) -> usize {
        self.nd + self.nv
    }

    /// Whether the dense products take the streamed few-token kernels (`dense_seqs`): passes of decode rows only, at
    /// most [`STREAM_ROWS`] of them; every other pass takes the tensor-core GEMM (`gemm_q4`), so that a
    /// prompt row's arithmetic is the same in every pass that holds prompt rows (bit for bit, with the GEMM's K split
    /// and the experts' kernels on the same side of [`STREAM_MAX_TOKENS`]).
    pub fn streamed_dense(&self) -> bool {
        self.np == 0 && self.step() <= STREAM_ROWS
    }
}

/// What a pass does with its rows' expert choices, per layer (tests): append them to a log (`[layer][n * k]`, rows
/// in pass order), or hold them to given ones (the weights from the step's own router logits, renormalised over them;
/// a slow host path).
pub enum StepRoutes<'a> {
    Log(&'a mut [Vec<usize>]),
    Hold(&'a [Vec<usize>]),
}

/// The step rows' attention buffers ([`crate::workspace::SeqScratch`]): queries `[nd + nv, nh * hd]` and
/// split partials `[nd + nv, nh, ns, hd + 2]`; and where a pass has verify rows, the copy of their GDN projections
/// for the commit (`[gdn layer][save_rows][proj rows]`).
pub(crate) struct DecodeBufs<'a> {
    pub qbuf: &'a mut CudaSlice<f32>,
    pub part: &'a mut CudaSlice<f32>,
    pub save: Option<&'a mut CudaSlice<f32>>,
    pub save_rows: usize,
}

/// The layer, written once: every layer over a pass's rows of `sc.x` (embedded; the sequences' state pointers,
/// segments and decode positions in `t`), leaving the last layer's output in `sc.x` and, with `final_norm`, the final
/// norm of every row in `sc.xb` (decode-only passes, whose rows are all last rows). Per layer: the input norm (before
/// layer 0; later ones go with the combine before them), the mixer's projections over all rows, its per-sequence
/// kernels (prompt rows chunked, decode rows stepped: [`PassRows`]), the output projection, the MoE block. `routes`
/// logs or holds every layer's expert choices; `mark` names each kernel family before its launch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layers_pass(
    m: &DeviceModel,
    layers: &[DLayer],
    sc: &mut Scratch,
    mut dec: Option<DecodeBufs>,
    t: &PassTables,
    rows: PassRows,
    final_norm: bool,
    mut routes: Option<StepRoutes>,
    mark: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<()> {
    let (g, c) = (&*m.gpu, &m.config);
    let (h, eps, d) = (c.hidden_size, c.rms_norm_eps, GdnDims::of(c));
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let PassRows { np, nd, nv, nvs, ns } = rows;
    let (n, nst) = (rows.n(), rows.step());
    ensure!(n > 0 && n <= sc.cap, "a pass of {n} rows over buffers of {}", sc.cap);
    ensure!(np == 0 || np == t.segs.rows(), "a pass of {np} prompt rows over a segment table of {}", t.segs.rows());
    ensure!(nst == 0 || dec.is_some(), "a pass with decode rows needs their attention buffers");
    ensure!(
        nv == 0 || (nvs == t.vsegs.n() && nv == t.vsegs.rows()),
        "a pass of {nv} verify rows of {nvs} sequences over a table of {} rows of {}",
        t.vsegs.rows(),
        t.vsegs.n()
    );
    let ldp_max = m.shapes().proj_rows;
    if nv > 0 {
        let gdn = layers.iter().filter(|l| matches!(l.mixer, DMixer::Gdn { .. })).count();
        let fits = dec.as_ref().and_then(|b| b.save.as_ref().map(|v| (b.save_rows, v.len())));
        ensure!(
            fits.is_some_and(|(rows, len)| rows >= nv && len >= gdn * rows * ldp_max),
            "a pass with verify rows needs room to keep their GDN projections"
        );
    }
    if let Some(r) = &routes {
        let n_routes = match r {
            StepRoutes::Log(v) => v.len(),
            StepRoutes::Hold(v) => v.len(),
        };
        ensure!(n_routes == layers.len(), "a pass with routes for {n_routes} layers, not {}", layers.len());
    }
    let ps = if np > 0 { t.segs.n() } else { 0 };
    ensure!(
        t.n >= ps + nst + nvs,
        "pass tables of {} entries, not {ps} prompts, {nst} step rows and {nvs} verifying sequences",
        t.n
    );
    let dense =
        |w: &QMat, x: &CudaSlice<u16>, y: &mut CudaSlice<f32>, ldy: usize, add: bool| match rows.streamed_dense() {
            true => g.dense_seqs(w, x, n, y, ldy, add),
            false => g.gemm_q4(w, x, n, y, ldy, add),
        };
    let tag = |streamed: &'static str, gemm: &'static str| if rows.streamed_dense() { streamed } else { gemm };
    for (li, l) in layers.iter().enumerate() {
        if li == 0 {
            mark("rmsnorm")?;
            g.rmsnorm_rows(&sc.x, n, &l.in_norm, eps, &mut sc.xb, None)?;
        }
        let (ta, tb) = t.layer(li);
        let (da, db) = t.layer_from(li, ps);
        let (va, vb) = t.layer_from(li, ps + nst);
        let gdn_index = layers[..li].iter().filter(|l| matches!(l.mixer, DMixer::Gdn { .. })).count();
        let segs = &t.segs;
        match &l.mixer {
            DMixer::Gdn { proj, out, conv, a_log, dt_bias, norm } => {
                let ldp = proj.rows;
                mark(tag("gdn_in_proj (dense)", "gdn_in_proj (gemm)"))?;
                dense(proj, &sc.xb, &mut sc.proj, ldp, false)?;
                if np > 0 {
                    mark("gdn_prep")?;
                    let (qkv, beta, gl) = (&mut sc.qkv, &mut sc.beta, &mut sc.gl);
                    g.gdn_prep(&sc.proj, ldp, &ta, conv, a_log, dt_bias, d, segs, qkv, beta, gl)?;
                    mark("gdn_chunk_prep")?;
                    g.gdn_chunk_prep(&sc.qkv, &sc.beta, &sc.gl, segs, d, &mut sc.chunks)?;
                    mark("gdn_chunk_state")?;
                    g.gdn_chunk_state(&sc.qkv, &mut sc.chunks, segs, d, &tb)?;
                    mark("gdn_chunk_out")?;
                    g.gdn_chunk_out(&sc.qkv, &mut sc.chunks, segs, d, &mut sc.o)?;
                    mark("gdn_ring+gated_norm")?;
                    g.gdn_ring(&sc.proj.slice(..), ldp, d, segs, &ta)?;
                    g.gdn_gated_norm(&sc.o, &sc.proj, ldp, np, d, norm, eps, &mut sc.xb)?;
                }
                if nd > 0 {
                    mark("gdn_step_seqs")?;
                    let st = (&da, &db, &t.posv);
                    g.gdn_step_seqs(&sc.proj, ldp, np, conv, a_log, dt_bias, st, nd, norm, eps, d, &mut sc.xb)?;
                }
                if let (true, Some(b)) = (nv > 0, dec.as_mut()) {
                    mark("gdn_verify_seqs")?;
                    let (r0, st) = (np + nd, (&va, &vb));
                    g.gdn_verify_seqs(&sc.proj, ldp, r0, conv, a_log, dt_bias, st, &t.vsegs, norm, eps, d, &mut sc.xb)?;
                    let save = b.save.as_deref_mut().context("verify rows without their save buffer")?;
                    let at = gdn_index * b.save_rows * ldp_max;
                    let mut dst = save.slice_mut(at..at + nv * ldp);
                    g.stream.memcpy_dtod(&sc.proj.slice(r0 * ldp..(r0 + nv) * ldp), &mut dst)?;
                }
                mark(tag("gdn_out_proj (dense)", "gdn_out_proj (gemm)"))?;
                dense(out, &sc.xb, &mut sc.x, h, true)?;
            }
            DMixer::Attn { qkv, o, qn, kn } => {
                let ldp = qkv.rows;
                mark(tag("attn_qkv (dense)", "attn_qkv (gemm)"))?;
                dense(qkv, &sc.xb, &mut sc.proj, ldp, false)?;
                let (theta, dims) = (c.rope_theta as f32, (nh, nkv, hd, c.rotary_dim));
                if np > 0 {
                    mark("attn_prep")?;
                    g.attn_prep_rows(&sc.proj, ldp, qn, kn, segs, dims, theta, eps, &mut sc.qb, (&ta, &tb))?;
                    mark("attn_flash")?;
                    g.flash_prefill(&sc.qb, (&ta, &tb), &sc.proj, ldp, segs, (nh, nkv, hd), &mut sc.xb)?;
                }
                if let (true, Some(b)) = (nst > 0, dec.as_mut()) {
                    let kv = (&da, &db, &t.posv);
                    mark("attn_seqs (prep+decode+combine)")?;
                    g.attn_prep_seqs(&sc.proj, ldp, np, qn, kn, kv, nst, dims, theta, eps, b.qbuf)?;
                    g.attn_decode_seqs(b.qbuf, kv, &t.fromv, nst, (nh, nkv, hd), ns, b.part)?;
                    g.attn_combine_seqs(b.part, &sc.proj, ldp, np, nst, nh, hd, ns, &mut sc.xb)?;
                }
                mark(tag("attn_o_proj (dense)", "attn_o_proj (gemm)"))?;
                dense(o, &sc.xb, &mut sc.x, h, true)?;
            }
        }
        let held = match routes.as_mut() {
            Some(StepRoutes::Log(log)) => Some(Routes::Log(&mut log[li])),
            Some(StepRoutes::Hold(held)) => Some(Routes::Hold(&held[li])),
            None => None,
        };
        let next = match layers.get(li + 1) {
            Some(l) => Some(&l.in_norm),
            None => final_norm.then_some(&m.norm),
        };
        moe_rows(m, l, sc, n, m.prefill_experts(n), held, next, mark)?;
    }
    Ok(())
}

/// How the MoE block's router and expert products run: router_rows and tensor-core GEMMs over 64-token tiles (long
/// prefill passes), or router_seqs and the streamed few-token kernels of moe_seqs.cu over the few tokens each expert
/// gets (decode batches, passes of at most [`STREAM_MAX_TOKENS`]; f32 activations in `act`, `[n * (k + 1), max(I,
/// Is)]`).
pub(crate) enum MoeExperts {
    Gemm,
    Streamed,
}

impl DeviceModel {
    /// Whether the streamed router and expert kernels take this model's shapes: sizes in multiples of their group
    /// sizes (powers of two >= 32), a router of at most 2,048 columns (the model's shapes); other shapes take
    /// router_rows and the GEMMs.
    pub(crate) fn streamed_moe(&self) -> bool {
        let c = &self.config;
        self.layers.iter().all(|l| {
            let sizes = [c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size];
            let fits = |gs: usize| gs >= 32 && gs.is_power_of_two() && sizes.iter().all(|v| v % gs == 0);
            fits(l.gate_up.gs) && fits(l.down.gs) && l.router.cols <= 2048 && l.router.gs.is_power_of_two()
        })
    }

    /// The expert kernels of a pass of `n` tokens (the line at [`STREAM_MAX_TOKENS`]).
    pub(crate) fn prefill_experts(&self, n: usize) -> MoeExperts {
        match n <= STREAM_MAX_TOKENS && self.streamed_moe() {
            true => MoeExperts::Streamed,
            false => MoeExperts::Gemm,
        }
    }
}

/// What a pass does with one layer's expert choices (tests): append the rows' routed experts to a log (`[n * k]`),
/// or hold them to given ones (`[n * k]`: weighted by the router's softmax renormalised over them, as
/// `tern_model::forward::route_forced`; the host computes the weights, so it is a slow path for tests).
pub enum Routes<'a> {
    Log(&'a mut Vec<usize>),
    Hold(&'a [usize]),
}

/// The MoE block of layer `li` for the `n` rows of `sc.x` (residual added in place): post-norm, f32 router, top-k,
/// the pairs sorted by expert, gate|up + SwiGLU and down products (`how`), combine. `routes` logs or holds the
/// expert choices; `next_norm`, the gain of the RMSNorm that follows (the next layer's input norm or the final
/// one), fuses that norm into the combine (x and `sc.xb` as the two launches leave them); `mark` names each kernel
/// family before its launch (profiling).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_rows(
    m: &DeviceModel,
    l: &DLayer,
    sc: &mut Scratch,
    n: usize,
    how: MoeExperts,
    routes: Option<Routes>,
    next_norm: Option<&CudaSlice<f32>>,
    mark: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<()> {
    let (g, c) = (&*m.gpu, &m.config);
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let (k, e) = (c.num_experts_per_tok, c.num_experts);
    let sizes = (c.moe_intermediate_size, c.shared_expert_intermediate_size);
    ensure!(l.router.rows == e + 1, "router rows {} != experts + 1", l.router.rows);
    let tile = match how {
        MoeExperts::Gemm => MOE_TILE,
        MoeExperts::Streamed => stream_tile(n),
    };
    mark("rmsnorm")?;
    g.rmsnorm_rows(&sc.x, n, &l.post_norm, eps, &mut sc.xb, Some(&mut sc.xn))?;
    // the router goes with the experts: router_seqs with the streamed kernels (decode batches, passes of <= 256
    // tokens: router_rows' 64 x 64 tiles took 4.3 of a 256-token prefill's 31 ms, mostly idle), router_rows with the
    // GEMMs (at 4,096 tokens router_seqs took 18.7 ms against its 9.4: every 4-token block re-reads the weights)
    match how {
        MoeExperts::Streamed => {
            mark("moe_router (seqs)")?;
            g.router_seqs(&l.router, &sc.xn, n, &mut sc.rlogits)?;
        }
        MoeExperts::Gemm => {
            mark("moe_router (f32)")?;
            g.router_rows(&l.router, &sc.xn, n, &mut sc.rlogits)?;
        }
    }
    mark("moe_topk+align")?;
    // a decode batch of a few rows: the top-k and the align in one launch (not with held routes: they replace idx)
    let fused = matches!(how, MoeExperts::Streamed)
        && !matches!(routes, Some(Routes::Hold(_)))
        && g.topk_align_fits(n, k, e, tile);
    match fused {
        true => g.topk_align_seqs(&sc.rlogits, e, k, n, tile, &mut sc.idx, &mut sc.wts, &mut sc.sorted)?,
        false => g.topk_rows(&sc.rlogits, e, k, n, &mut sc.idx, &mut sc.wts)?,
    }
    match routes {
        Some(Routes::Log(r)) => {
            let idx = g.stream.clone_dtoh(&sc.idx.slice(..n * (k + 1)))?;
            r.extend(idx.chunks_exact(k + 1).flat_map(|t| t[..k].iter().map(|&v| v as usize)));
        }
        Some(Routes::Hold(held)) => {
            ensure!(
                held.len() == n * k && held.iter().all(|&x| x < e),
                "{} held expert ids for {n} rows of {k} (each < {e})",
                held.len()
            );
            let logits = g.stream.clone_dtoh(&sc.rlogits.slice(..n * (e + 1)))?;
            let (mut idx, mut wts) = (Vec::with_capacity(n * (k + 1)), Vec::with_capacity(n * (k + 1)));
            for (t, row) in logits.chunks_exact(e + 1).enumerate() {
                let rw = tern_model::forward::route_forced(&row[..e], &held[t * k..(t + 1) * k]);
                idx.extend(rw.iter().map(|r| r.0 as i32).chain([e as i32]));
                wts.extend(rw.iter().map(|r| r.1).chain([1.0 / (1.0 + (-row[e]).exp())]));
            }
            g.stream.memcpy_htod(&idx, &mut sc.idx.slice_mut(..n * (k + 1)))?;
            g.stream.memcpy_htod(&wts, &mut sc.wts.slice_mut(..n * (k + 1)))?;
        }
        None => {}
    }
    if !fused {
        g.moe_align(&sc.idx, n, k, e, tile, &mut sc.sorted)?;
    }
    match how {
        MoeExperts::Gemm => {
            mark("moe_gate_up (gemm)")?;
            g.moe_gate_up_rows(&l.gate_up, e, sizes, h, &sc.xb, n, k, &sc.sorted, &mut sc.act)?;
            mark("moe_down (gemm)")?;
            g.moe_down_rows(&l.down, e, sizes, h, &sc.act, &sc.sorted, &mut sc.ybuf)?;
        }
        MoeExperts::Streamed => {
            mark("moe_gate_up (streamed)")?;
            g.moe_gate_up_seqs(&l.gate_up, e, sizes, h, &sc.xb, &sc.sorted, &mut sc.act)?;
            mark("moe_down (streamed)")?;
            g.moe_down_seqs(&l.down, e, sizes, h, &sc.act, &sc.sorted, &mut sc.ybuf)?;
        }
    }
    mark("moe_combine")?;
    match next_norm {
        Some(gain) => g.moe_combine_norm(&sc.ybuf, &sc.sorted, &sc.wts, &mut sc.x, gain, eps, &mut sc.xb, None),
        None => g.moe_combine(&sc.ybuf, &sc.sorted, &sc.wts, h, &mut sc.x),
    }
}

/// The token a batched step draws for one row.
#[derive(Clone, Copy)]
pub enum Draw<'a> {
    /// None (the row is read for its state, or only its logits are wanted).
    Nothing,
    /// The argmax over ids below this limit (ids past it are embedding padding).
    Argmax(usize),
    /// A draw on the device ([`crate::sample`]): penalties, bias, the mask (waited for after the forward pass is
    /// enqueued), temperature, top-k/p, min-p, logprobs.
    Sample(&'a Sample<'a>),
}

/// What [`DeviceModel::forward_items`] returns: each item's drawn rows, and when asked every row's hidden state.
pub struct PassOut {
    pub rows: Vec<Vec<RowOut>>,
    pub hidden: Option<PassHidden>,
}

/// Every row's post-norm hidden state after a pass (f32 `[rows, hidden]` on the device, rows in the pass's order:
/// prompts, decodes, verifies) and each item's first row in it.
pub struct PassHidden {
    pub rows: CudaSlice<f32>,
    pub first: Vec<usize>,
}

/// What [`DeviceModel::mtp_rows`] returns.
pub struct MtpRows {
    /// Every row's argmax (the drafts).
    pub argmax: Vec<u32>,
    /// `[rows, vocab]`, when asked for.
    pub logits: Option<Vec<f32>>,
    /// Every row's post-norm output `[rows, hidden]` (f32, on the device): the next chained draft's hidden input.
    pub hidden: CudaSlice<f32>,
}

/// The most rows of one speculative verify (4 drafts and the token before them).
pub const MAX_VERIFY_ROWS: usize = 5;

/// What one item of a pass draws: its last row ([`DeviceModel::forward_seqs`]), or every row of a speculative verify
/// ([`DeviceModel::forward_items`]: the item's ids are the token drawn last and the drafts after it).
#[derive(Clone)]
pub enum ItemWant<'a> {
    Last(RowWant<'a>),
    Verify(Vec<RowWant<'a>>),
}

/// What a batched step returns for one row.
#[derive(Clone, Copy)]
pub struct RowWant<'a> {
    /// The whole logits row (as the forward pass left it, before any draw).
    pub logits: bool,
    pub draw: Draw<'a>,
}

/// One row's results.
#[derive(Debug)]
pub struct RowOut {
    /// The drawn token, unless the row asked for none (or its own draw failed: a bad parameter, a mask that allows
    /// nothing).
    pub token: Option<Result<Sampled>>,
    pub logits: Option<Vec<f32>>,
}

/// Flash-decoding splits for `n` rows whose longest context is `max_len` keys: as many blocks as fit the chip at
/// once (rows × kv heads × splits ≤ 2 per SM, attn_decode_kv_seqs' occupancy; rounded up, B = 8 made 272 blocks
/// for 264 places), at least 16 keys per split, at most [`MAX_SPLIT`].
fn splits(g: &Gpu, n: usize, nkv: usize, max_len: usize) -> usize {
    let fill = (2 * g.sms as usize) / (n * nkv);
    fill.min(max_len.div_ceil(16)).clamp(1, MAX_SPLIT)
}

impl DeviceModel {
    /// One forward pass over a flat batch of tokens: `ids[r]` into `seqs[r]` (distinct sequences), each item one token
    /// (a decode row: the GDN and attention step kernels) or a prompt chunk of several (the chunked kernels), every
    /// other op once over all the rows ([`layers_pass`]); then each item's last row gives its logits
    /// and draw as `want[r]` says (the chosen ids and asked-for logprobs cross to the host; a logits row only when
    /// asked for). The prompt chunks must fit one prefill chunk's buffers ([`pass_fits`]); at most [`MAX_SEQS`] items.
    /// A pass of decode rows only replays a CUDA graph of its shape. Input and shape checks come first and change
    /// nothing; a failed launch leaves the sequences' states undefined; a row's own bad draw fails that row alone.
    pub fn forward_seqs(&self, seqs: &mut [&mut DeviceState], ids: &[&[u32]], want: &[RowWant]) -> Result<Vec<RowOut>> {
        self.forward_profiled(seqs, ids, want, None, None, true)
    }

    /// Read one token for each sequence (`ids[r]` into `seqs[r]`): [`DeviceModel::forward_seqs`] of decode rows.
    pub fn decode_seqs(&self, seqs: &mut [&mut DeviceState], ids: &[u32], want: &[RowWant]) -> Result<Vec<RowOut>> {
        self.decode_seqs_profiled(seqs, ids, want, None, None)
    }

    /// [`DeviceModel::decode_seqs`]; with `prof`, every launch is bracketed by events and timed by kernel family;
    /// with `routes`, every layer's routed experts of the rows are logged or held to given ones ([`StepRoutes`]).
    pub fn decode_seqs_profiled(
        &self,
        seqs: &mut [&mut DeviceState],
        ids: &[u32],
        want: &[RowWant],
        prof: Option<&mut Profile>,
        routes: Option<StepRoutes>,
    ) -> Result<Vec<RowOut>> {
        ensure!(ids.len() == seqs.len(), "decode_seqs: {} sequences, {} ids", seqs.len(), ids.len());
        let rows: Vec<&[u32]> = ids.iter().map(std::slice::from_ref).collect();
        self.forward_profiled(seqs, &rows, want, prof, routes, true)
    }

    /// Read a prompt chunk for each of up to [`MAX_SEQS`] sequences (`chunks[r]` into `seqs[r]`) in one pass, every
    /// chunk through the chunked kernels (a one-token chunk too): the state left behind is the same bit for bit as
    /// the sequence's own prefill ([`DeviceState::prefill`]) where both take the same router and expert kernels (both
    /// passes of at most [`crate::prefill::STREAM_MAX_TOKENS`] rows, or both longer; across that line the router's
    /// sums, the experts' bf16-rounded GEMM weights and the dense GEMMs' K split differ by rounding). The last row's
    /// logits are those of its all-positions lm_head GEMM.
    pub fn prefill_seqs(
        &self,
        seqs: &mut [&mut DeviceState],
        chunks: &[&[u32]],
        want: &[RowWant],
    ) -> Result<Vec<RowOut>> {
        self.forward_profiled(seqs, chunks, want, None, None, false)
    }

    /// [`DeviceModel::forward_seqs`] with profiling and routes (as [`DeviceModel::decode_seqs_profiled`]); with
    /// `decode_rows` false every item is a prompt chunk, a one-token one too ([`DeviceModel::prefill_seqs`]).
    pub fn forward_profiled(
        &self,
        seqs: &mut [&mut DeviceState],
        ids: &[&[u32]],
        want: &[RowWant],
        prof: Option<&mut Profile>,
        routes: Option<StepRoutes>,
        decode_rows: bool,
    ) -> Result<Vec<RowOut>> {
        let items: Vec<ItemWant> = want.iter().map(|&w| ItemWant::Last(w)).collect();
        let never = &mut |_: usize, _: &[RowOut]| -> Result<usize> { bail!("no verify items in this pass") };
        let out = self.forward_items(seqs, ids, &items, prof, routes, decode_rows, false, never)?;
        out.rows.into_iter().map(|mut rows| rows.pop().context("a pass item without its row")).collect()
    }

    /// One forward pass whose items may also be speculative verifies ([`ItemWant::Verify`]: the item's ids are a
    /// token and the drafts after it, every row drawn). Their rows are step rows ([`PassRows`]); after the draws,
    /// `accept(item, rows)` says how many of a verify's rows the sequence keeps (1 to all: the accepted drafts and
    /// the token before them), and the pass commits their GDN state and conv inputs (gdn_commit_seqs, gdn_ring): the
    /// sequence then holds those rows as if the rejected ones had never been read. Items come back in order, each
    /// with its drawn rows (one for [`ItemWant::Last`]); with `hidden_rows`, also every row's post-norm hidden state
    /// (the MTP block's input).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_items(
        &self,
        seqs: &mut [&mut DeviceState],
        ids: &[&[u32]],
        want: &[ItemWant],
        prof: Option<&mut Profile>,
        routes: Option<StepRoutes>,
        decode_rows: bool,
        hidden_rows: bool,
        accept: &mut dyn FnMut(usize, &[RowOut]) -> Result<usize>,
    ) -> Result<PassOut> {
        let (g, c) = (&*self.gpu, &self.config);
        let n = seqs.len();
        ensure!(n > 0 && n <= MAX_SEQS, "a forward pass takes 1..={MAX_SEQS} sequences, not {n}");
        ensure!(
            ids.len() == n && want.len() == n,
            "a pass of {n} sequences, {} token lists, {} wants",
            ids.len(),
            want.len()
        );
        let vocab = c.vocab_size;
        for ((s, ids), w) in seqs.iter().zip(ids).zip(want) {
            ensure!(!ids.is_empty(), "a pass item without tokens");
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                bail!("token id {bad} is outside the vocabulary (size {vocab})");
            }
            ensure!(
                s.len + ids.len() <= s.room,
                "context full: {} tokens held + {} new > the sequence's room of {} tokens (its reservation)",
                s.len,
                ids.len(),
                s.room
            );
            ensure!(s.layers.len() == self.layers.len(), "a sequence of another model");
            if let ItemWant::Verify(rows) = w {
                ensure!(
                    rows.len() == ids.len() && (1..=MAX_VERIFY_ROWS).contains(&rows.len()),
                    "a verify of {} tokens draws every row (1..={MAX_VERIFY_ROWS} of them), not {}",
                    ids.len(),
                    rows.len()
                );
                ensure!(decode_rows, "a verify item in a pass of prompt chunks only");
            }
        }
        if let Some(r) = &routes {
            let layers = match r {
                StepRoutes::Log(v) => v.len(),
                StepRoutes::Hold(v) => v.len(),
            };
            ensure!(layers == self.layers.len(), "a pass with routes for {layers} layers, not {}", self.layers.len());
        }
        // the pass's order: prompt chunks, then decode rows, then verifies (a verify of one row is a decode row)
        let is_verify = |i: usize| matches!(&want[i], ItemWant::Verify(r) if r.len() > 1);
        let is_decode = |i: usize| decode_rows && ids[i].len() == 1;
        let prompts: Vec<usize> = (0..n).filter(|&i| !is_decode(i) && !is_verify(i)).collect();
        let decodes: Vec<usize> = (0..n).filter(|&i| is_decode(i)).collect();
        let verifies: Vec<usize> = (0..n).filter(|&i| is_verify(i)).collect();
        let order: Vec<usize> = prompts.iter().chain(&decodes).chain(&verifies).copied().collect();
        let ps = prompts.len();
        let np: usize = prompts.iter().map(|&i| ids[i].len()).sum();
        let (nd, nvs) = (decodes.len(), verifies.len());
        let nv: usize = verifies.iter().map(|&i| ids[i].len()).sum();
        ensure!(
            ps + nd + nv <= MAX_SEQS,
            "a pass of {ps} prompt chunks, {nd} decode rows and {nv} verify rows: over {MAX_SEQS} logits rows"
        );
        let nkv = c.num_key_value_heads;
        // the splits depend on the capacity, not the lengths, so that a captured pass serves any positions
        let max_ctx = decodes.iter().chain(&verifies).map(|&i| seqs[i].max_ctx).max().unwrap_or(1);
        let ns = if nd + nv > 0 { splits(g, nd + nv, nkv, max_ctx) } else { 0 };
        let rows = PassRows { np, nd, nv, nvs, ns };

        let mut guard =
            self.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned by an earlier panic"))?;
        let PrefillBuffers { chunk, scratch, seqs: seq_scratch, tables: tslot, graphs, omit } = &mut *guard;
        ensure!(
            pass_fits(*chunk, prompts.iter().map(|&i| ids[i].len())),
            "prompt chunks of {np} tokens in {ps} sequences over the prefill chunk of {}",
            *chunk
        );
        let cap = if rows.n() > *chunk { *chunk + MAX_SEQS } else { *chunk };
        let sc = scratch_rows(scratch, self.shapes(), cap)?;
        if seq_scratch.is_none() {
            *seq_scratch = Some(SeqScratch::new(self.shapes())?);
        }
        let sq = seq_scratch.as_mut().context("batched decode buffers")?;
        if nv > sq.vsave_rows {
            // room for the verify rows' GDN projections (the captured passes bake the old address in)
            let gdn = self.layers.iter().filter(|l| matches!(l.mixer, DMixer::Gdn { .. })).count();
            let rows = nv.next_power_of_two().clamp(8, MAX_SEQS);
            sq.vsave = None;
            sq.vsave = Some(g.zeros(gdn.max(1) * rows * self.shapes().proj_rows)?);
            sq.vsave_rows = rows;
            sq.graphs.0.clear();
        }
        let t = tables(tslot, self.shapes())?;
        // table entries: the prompts', one per step row (a verify's sequence once per row), one per verify
        let entries: Vec<usize> = prompts
            .iter()
            .chain(&decodes)
            .copied()
            .chain(verifies.iter().flat_map(|&i| std::iter::repeat_n(i, ids[i].len())))
            .chain(verifies.iter().copied())
            .collect();
        let ptrs: Vec<Vec<(u64, u64)>> = entries.iter().map(|&i| seqs[i].layer_ptrs(self)).collect::<Result<_>>()?;
        t.set_states(g, &ptrs)?;
        if nd + nv > 0 {
            let at = |i: usize| (0..ids[i].len()).map(move |j| (i, j));
            let step: Vec<(usize, usize)> = decodes.iter().chain(&verifies).flat_map(|&i| at(i)).collect();
            let posv: Vec<i32> = step.iter().map(|&(i, j)| (seqs[i].len + j) as i32).collect();
            let fromv: Vec<i32> = step.iter().map(|&(i, _)| seqs[i].len as i32).collect();
            g.stream.memcpy_htod(&posv, &mut t.posv.slice_mut(..nd + nv))?;
            g.stream.memcpy_htod(&fromv, &mut t.fromv.slice_mut(..nd + nv))?;
        }
        if np > 0 {
            let segs: Vec<(usize, usize)> = prompts.iter().map(|&i| (ids[i].len(), seqs[i].len)).collect();
            t.segs.set(g, &segs)?;
        }
        if nv > 0 {
            let segs: Vec<(usize, usize)> = verifies.iter().map(|&i| (ids[i].len(), seqs[i].len)).collect();
            t.vsegs.set(g, &segs)?;
        }
        let flat: Vec<u32> = order.iter().flat_map(|&i| ids[i].iter().copied()).collect();

        let mut events: Vec<(&'static str, CudaEvent)> = Vec::new();
        let timed = prof.is_some();
        let mut mark = |name: &'static str| -> Result<()> {
            if timed {
                events.push((name, g.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?));
            }
            Ok(())
        };
        if np == 0 {
            // step rows only: kernels from the ids on the device to the logits, one graph per shape, captured on
            // first use; a capture that fails turns graphs off for good (the kernels then launch one by one: slower,
            // same results)
            let v: Vec<i32> = flat.iter().map(|&i| i as i32).collect();
            g.stream.memcpy_htod(&v, &mut sc.ids.slice_mut(..nd + nv))?;
            let streamed = self.streamed_moe();
            let mut graphed = false;
            if *graphs && !timed && routes.is_none() {
                match self.replay_pass(sc, sq, t, rows, streamed, omit.as_deref()) {
                    Ok(()) => graphed = true,
                    Err(e) => {
                        *graphs = false;
                        eprintln!(
                            "tern: capturing the batched decode pass failed ({e:#}); its kernels launch one by one"
                        );
                    }
                }
            }
            if !graphed {
                self.decode_pass(sc, sq, t, rows, routes, &mut mark)?;
            }
        } else {
            // prompt chunks (and step rows): launched one by one; then each prompt's last row and every step row
            let h = c.hidden_size;
            mark("embed")?;
            g.embed_rows(&self.embed, &flat, &mut sc.ids, &mut sc.x)?;
            let dec = DecodeBufs {
                qbuf: &mut sq.qbuf,
                part: &mut sq.part,
                save: sq.vsave.as_mut(),
                save_rows: sq.vsave_rows,
            };
            layers_pass(self, &self.layers, sc, Some(dec), t, rows, false, routes, &mut mark)?;
            mark("lm_head (gemm) + sample")?;
            let mut r0 = 0;
            for (r, &i) in prompts.iter().enumerate() {
                let last = r0 + ids[i].len() - 1;
                g.stream
                    .memcpy_dtod(&sc.x.slice(last * h..(last + 1) * h), &mut sq.last.slice_mut(r * h..(r + 1) * h))?;
                r0 += ids[i].len();
            }
            let nst = nd + nv;
            if nst > 0 {
                g.stream
                    .memcpy_dtod(&sc.x.slice(np * h..(np + nst) * h), &mut sq.last.slice_mut(ps * h..(ps + nst) * h))?;
            }
            g.rmsnorm_rows(&sq.last, ps + nst, &self.norm, c.rms_norm_eps, &mut sc.xb, None)?;
            g.gemm_q4(&self.lm_head, &sc.xb, ps + nst, &mut sq.logits, vocab, false)?;
        }
        // every row's post-norm hidden state (sc.x holds the last layer's output; xb is free once the lm_head ran)
        let hidden = match hidden_rows {
            true => {
                let rows = rows.n();
                let mut hid = g.zeros::<f32>(rows * c.hidden_size)?;
                g.rmsnorm_rows(&sc.x, rows, &self.norm, c.rms_norm_eps, &mut sc.xb, Some(&mut hid))?;
                let mut first = vec![0usize; n];
                let mut r = 0;
                for &i in &order {
                    first[i] = r;
                    r += ids[i].len();
                }
                Some(PassHidden { rows: hid, first })
            }
            false => None,
        };
        // one logits row per prompt and decode item, one per verify row
        let pass_want: Vec<RowWant> = order
            .iter()
            .flat_map(|&i| match &want[i] {
                ItemWant::Last(w) => std::slice::from_ref(w),
                ItemWant::Verify(r) => &r[..],
            })
            .copied()
            .collect();
        let mut drawn = draw_rows(g, vocab, &pass_want, &mut sq.logits)?.into_iter();
        let mut out: Vec<Vec<RowOut>> = (0..n).map(|_| Vec::new()).collect();
        for &i in &order {
            let k = match &want[i] {
                ItemWant::Last(_) => 1,
                ItemWant::Verify(r) => r.len(),
            };
            out[i] = drawn.by_ref().take(k).collect();
            ensure!(out[i].len() == k, "a pass item without its rows");
        }
        // the verifies' rows kept, their GDN state and conv inputs committed
        let mut kept = vec![0usize; n];
        if nv > 0 {
            let mut at = Vec::with_capacity(nvs);
            let mut r0 = 0;
            for &i in &verifies {
                let k = accept(i, &out[i])?;
                ensure!((1..=ids[i].len()).contains(&k), "a verify of {} rows keeps {k}", ids[i].len());
                kept[i] = k;
                at.push((r0, k, seqs[i].len));
                r0 += ids[i].len();
            }
            t.vsegs.set_at(g, &at)?;
            mark("gdn_commit_seqs + ring")?;
            self.commit_verify(sq, t, ps + nd + nv)?;
        }
        if timed {
            events.push(("", g.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?));
        }
        g.stream.synchronize()?;
        if let Some(p) = prof {
            p.add_events(&events)?;
        }
        for (i, (s, ids)) in seqs.iter_mut().zip(ids).enumerate() {
            s.len += if is_verify(i) { kept[i] } else { ids.len() };
            s.pos_stale = true;
        }
        Ok(PassOut { rows: out, hidden })
    }

    /// After a pass's draws: every GDN layer's state of each verifying sequence (the entries from `first` on of the
    /// pass tables) advanced over its kept rows, from the projections the pass kept, and their ring slots written
    /// (`t.vsegs`: each sequence's kept rows within the kept projections).
    fn commit_verify(&self, sq: &SeqScratch, t: &PassTables, first: usize) -> Result<()> {
        let g = &*self.gpu;
        let (d, ldp_max) = (GdnDims::of(&self.config), self.shapes().proj_rows);
        let save = sq.vsave.as_ref().context("a verify without its kept projections")?;
        let mut gi = 0;
        for (li, l) in self.layers.iter().enumerate() {
            let DMixer::Gdn { proj, conv, a_log, dt_bias, .. } = &l.mixer else { continue };
            let (va, vb) = t.layer_from(li, first);
            let at = gi * sq.vsave_rows * ldp_max;
            let rows = save.slice(at..at + sq.vsave_rows * proj.rows);
            g.gdn_commit_seqs(&rows, proj.rows, conv, a_log, dt_bias, (&va, &vb), &t.vsegs, d)?;
            g.gdn_ring(&rows, proj.rows, d, &t.vsegs, &va)?;
            gi += 1;
        }
        Ok(())
    }

    /// The MTP block ([`crate::model::DMtp`]) over rows of several sequences: sequence `s` reads `segs[s] = (rows,
    /// pos0)` rows at positions `pos0 ..` of its MTP K/V; row r pairs `hidden` row r (`[n, hidden]` f32: the main
    /// model's post-norm hidden state at that position, or the block's own output for a chained draft) with
    /// `ids[r]`, the token after it. Per row: `fc([pre_e(embed(id)) ; pre_h(hidden)])`, the block's layer (one row a
    /// sequence: as a pass's decode rows; more: as prompt rows, chunked attention and GEMMs), the norm, and with
    /// `head` the lm_head and its argmax below `limit` (at most [`MAX_SEQS`] rows). Returns the argmax of every row
    /// (with `head`), the logits when asked, and every row's post-norm output (the next chained draft's hidden
    /// input). `routes` logs or holds the layer's expert choices (tests).
    #[allow(clippy::too_many_arguments)]
    pub fn mtp_rows(
        &self,
        seqs: &[&DeviceState],
        segs: &[(usize, usize)],
        ids: &[u32],
        hidden: &CudaSlice<f32>,
        (head, limit, logits): (bool, usize, bool),
        routes: Option<StepRoutes>,
    ) -> Result<MtpRows> {
        let (g, c) = (&*self.gpu, &self.config);
        let mtp = self.mtp.as_ref().context("this model has no MTP block")?;
        let (h, eps, vocab) = (c.hidden_size, c.rms_norm_eps, c.vocab_size);
        let n: usize = segs.iter().map(|s| s.0).sum();
        ensure!(
            seqs.len() == segs.len() && !seqs.is_empty(),
            "MTP rows: {} sequences, {} segments",
            seqs.len(),
            segs.len()
        );
        let prompt = segs.iter().any(|s| s.0 > 1);
        ensure!(n > 0 && ids.len() == n, "MTP rows: {n} rows, {} ids", ids.len());
        ensure!(prompt || n <= MAX_SEQS, "MTP rows: {n} sequences of one row (at most {MAX_SEQS})");
        ensure!(!head || n <= MAX_SEQS, "MTP rows: logits of {n} rows (at most {MAX_SEQS})");
        ensure!(hidden.len() >= n * h, "MTP rows: hidden rows for {n} rows");
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        let mut entries = Vec::with_capacity(n);
        let (mut posv, mut fromv) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (s, &(k, pos0)) in seqs.iter().zip(segs) {
            let Some(LState::Attn { k: kc, v: vc }) = &s.mtp else { bail!("a sequence without the MTP block's state") };
            ensure!(
                k > 0 && pos0 + k <= s.room,
                "MTP rows {pos0}..{} past the sequence's room of {}",
                pos0 + k,
                s.room
            );
            for j in 0..if prompt { 1 } else { k } {
                entries.push(vec![(kc.ptr, vc.ptr)]);
                posv.push((pos0 + j) as i32);
                fromv.push(pos0 as i32);
            }
        }
        let max_ctx = seqs.iter().map(|s| s.max_ctx).max().unwrap_or(1);
        let rows = match prompt {
            true => PassRows { np: n, nd: 0, nv: 0, nvs: 0, ns: 0 },
            false => PassRows { np: 0, nd: n, nv: 0, nvs: 0, ns: splits(g, n, c.num_key_value_heads, max_ctx) },
        };
        let mut guard =
            self.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned by an earlier panic"))?;
        let PrefillBuffers { chunk, scratch, seqs: seq_scratch, tables: tslot, .. } = &mut *guard;
        ensure!(!prompt || pass_fits(*chunk, segs.iter().map(|s| s.0)), "MTP rows: {n} rows over the prefill chunk");
        let sc = scratch_rows(scratch, self.shapes(), *chunk)?;
        if seq_scratch.is_none() {
            *seq_scratch = Some(SeqScratch::new(self.shapes())?);
        }
        let sq = seq_scratch.as_mut().context("batched decode buffers")?;
        let t = tables(tslot, self.shapes())?;
        t.set_states(g, &entries)?;
        match prompt {
            true => t.segs.set(g, segs)?,
            false => {
                g.stream.memcpy_htod(&posv, &mut t.posv.slice_mut(..n))?;
                g.stream.memcpy_htod(&fromv, &mut t.fromv.slice_mut(..n))?;
            }
        }
        let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        g.stream.memcpy_htod(&v, &mut sc.ids.slice_mut(..n))?;
        // fc over [pre_e(embed(id)) ; pre_h(hidden)]: one product per column half, into xn, then the residual x
        let dense = |w: &QMat, x: &CudaSlice<u16>, y: &mut CudaSlice<f32>, add: bool| match rows.streamed_dense() {
            true => g.dense_seqs(w, x, n, y, h, add),
            false => g.gemm_q4(w, x, n, y, h, add),
        };
        g.embed_rows_dev(&self.embed, &sc.ids, n, &mut sc.x)?;
        g.rmsnorm_rows(&sc.x, n, &mtp.pre_e, eps, &mut sc.xb, None)?;
        dense(&mtp.fc_e, &sc.xb, &mut sc.xn, false)?;
        g.rmsnorm_rows(hidden, n, &mtp.pre_h, eps, &mut sc.xb, None)?;
        dense(&mtp.fc_h, &sc.xb, &mut sc.xn, true)?;
        g.stream.memcpy_dtod(&sc.xn.slice(..n * h), &mut sc.x.slice_mut(..n * h))?;
        let dec = DecodeBufs { qbuf: &mut sq.qbuf, part: &mut sq.part, save: None, save_rows: 0 };
        let layers = std::slice::from_ref(&mtp.layer);
        layers_pass(self, layers, sc, Some(dec), t, rows, false, routes, &mut |_| Ok(()))?;
        let mut out = g.zeros::<f32>(n * h)?;
        g.rmsnorm_rows(&sc.x, n, &mtp.norm, eps, &mut sc.xb, Some(&mut out))?;
        if !head {
            g.stream.synchronize()?;
            return Ok(MtpRows { argmax: Vec::new(), logits: None, hidden: out });
        }
        match rows.streamed_dense() {
            true => g.lm_head_seqs(&self.lm_head, &sc.xb, n, &mut sq.logits, vocab, false)?,
            false => g.gemm_q4(&self.lm_head, &sc.xb, n, &mut sq.logits, vocab, false)?,
        }
        let want = vec![RowWant { logits, draw: Draw::Argmax(limit) }; n];
        let drawn = draw_rows(g, vocab, &want, &mut sq.logits)?;
        g.stream.synchronize()?;
        let mut argmax = Vec::with_capacity(n);
        let mut rows_out = Vec::new();
        for d in drawn {
            let t = d.token.context("an MTP row without its argmax")??;
            argmax.push(t.token);
            if let Some(l) = d.logits {
                rows_out.extend(l);
            }
        }
        Ok(MtpRows { argmax, logits: logits.then_some(rows_out), hidden: out })
    }

    /// Launch the decode-only pass as the CUDA graph of its shape, capturing it first if there is none (graphs whose
    /// scratch rows have moved are dropped).
    fn replay_pass(
        &self,
        sc: &mut Scratch,
        sq: &mut SeqScratch,
        t: &PassTables,
        rows: PassRows,
        streamed: bool,
        omit: Option<&str>,
    ) -> Result<()> {
        let g = &*self.gpu;
        let x = ptr(g, &sc.x);
        if sq.graph_x != x {
            sq.graphs.0.clear();
            sq.graph_x = x;
        }
        let key = (rows.nd, rows.nv, rows.nvs, rows.ns, streamed, omit.map(str::to_string));
        if !sq.graphs.0.contains_key(&key) {
            let st = g.stream.clone();
            st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            // a family left out: its launches (from its mark to the next) are not made
            let mut mark = |name: &'static str| {
                g.omit.store(omit == Some(name), std::sync::atomic::Ordering::Relaxed);
                Ok(())
            };
            let r = self.decode_pass(sc, sq, t, rows, None, &mut mark);
            g.omit.store(false, std::sync::atomic::Ordering::Relaxed);
            let graph = st.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            r?;
            sq.graphs.0.insert(key.clone(), graph?.context("empty graph of the batched pass")?);
        }
        sq.graphs.0.get(&key).context("the batched pass's graph")?.launch()?;
        Ok(())
    }

    /// A decode-only pass's launches, from the ids in `sc.ids` to the logits in `sq.logits` (pointer tables and
    /// positions already uploaded): kernels only, unless `routes` asks for a host round trip per layer, so that it
    /// can be captured as a graph. `mark` names each kernel family before its launch; the lm_head is the last.
    fn decode_pass(
        &self,
        sc: &mut Scratch,
        sq: &mut SeqScratch,
        t: &PassTables,
        rows: PassRows,
        routes: Option<StepRoutes>,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<()> {
        let (g, c) = (&*self.gpu, &self.config);
        let n = rows.step();
        mark("embed")?;
        g.embed_rows_dev(&self.embed, &sc.ids, n, &mut sc.x)?;
        let dec =
            DecodeBufs { qbuf: &mut sq.qbuf, part: &mut sq.part, save: sq.vsave.as_mut(), save_rows: sq.vsave_rows };
        layers_pass(self, &self.layers, sc, Some(dec), t, rows, true, routes, mark)?;
        match rows.streamed_dense() {
            true => {
                mark("lm_head (dense) + sample")?;
                g.lm_head_seqs(&self.lm_head, &sc.xb, n, &mut sq.logits, c.vocab_size, false)
            }
            false => {
                mark("lm_head (gemm) + sample")?;
                g.gemm_q4(&self.lm_head, &sc.xb, n, &mut sq.logits, c.vocab_size, false)
            }
        }
    }
}

/// The draws of `want.len()` rows of `logits` (`[rows, vocab]`, just written by the pass): while the pass runs, the
/// draws' parameters (masks are waited for here), one row each (rows that draw nothing or fail to pack take a
/// greedy draw, so that row r stays at index r); then the logits rows asked for, before the sampler overwrites
/// them; then one `sample_rows` launch for every row.
fn draw_rows(g: &Gpu, vocab: usize, want: &[RowWant], logits: &mut CudaSlice<f32>) -> Result<Vec<RowOut>> {
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let plain = |limit| Sample { params: &greedy, seed: 0, history: &[], top_logprobs: None, limit, mask: None };
    let mut batch = SampleBatch::new(vocab)?;
    let mut failed: Vec<Option<anyhow::Error>> = Vec::with_capacity(want.len());
    for w in want {
        let packed = match w.draw {
            Draw::Nothing => batch.push(&plain(vocab), None),
            Draw::Argmax(limit) => batch.push(&plain(limit), None),
            Draw::Sample(s) => match s.mask.map(|m| m.wait()).transpose() {
                Ok(mask) => batch.push(s, mask.flatten()),
                Err(e) => Err(e),
            },
        };
        failed.push(packed.err());
        if failed.last().is_some_and(|f| f.is_some()) {
            batch.push(&plain(vocab), None)?;
        }
    }
    let mut out: Vec<RowOut> = Vec::with_capacity(want.len());
    for (r, w) in want.iter().enumerate() {
        let row = match w.logits {
            true => Some(g.stream.clone_dtoh(&logits.slice(r * vocab..(r + 1) * vocab))?),
            false => None,
        };
        out.push(RowOut { token: None, logits: row });
    }
    let outs = g.sample_download(logits, &batch)?;
    for (r, ((w, o), f)) in want.iter().zip(batch.sampled(&outs)).zip(failed).enumerate() {
        out[r].token = match (w.draw, f) {
            (Draw::Nothing, _) => None,
            (_, Some(e)) => Some(Err(e)),
            (_, None) => Some(o),
        };
    }
    Ok(out)
}
