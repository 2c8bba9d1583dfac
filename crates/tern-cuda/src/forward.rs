//! The forward pass, written once: `layers_pass` is the layer over a flat batch of rows (prompt rows and decode
//! rows of many sequences), and [`crate::DeviceModel::forward_seqs`] the one forward an engine step runs (its last
//! rows' lm_head and draws; a decode-only pass replays a CUDA graph of its shape). [`DeviceState::prefill`] reads
//! one sequence's prompt through the same layer, chunk by chunk, leaving the batch-1 decode graph's state.

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::{sys, CudaEvent, CudaSlice};

use crate::batch::{ptr, MAX_SEQS, MAX_SPLIT};
use crate::gpu::{Gpu, QMat};
use crate::model::{DMixer, DeviceModel};
use crate::prefill::{stream_tile, GdnDims, MOE_TILE, STREAM_MAX_TOKENS, STREAM_ROWS};
use crate::sample::SampleBatch;
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
        layers_pass(m, sc, None, t, PassRows { np: n, nd: 0, ns: 0 }, false, routes, &mut mark)?;
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
/// of the pass tables), then `nd` decode rows (one token each of the next `nd` sequences of the tables, at the
/// positions `t.posv[0..nd]`). A decode row is a one-token read: the GDN and attention step kernels take it (the
/// `_seqs` kernels of gdn.cu / attention.cu), where a prompt row goes through the chunked GDN and flash attention;
/// every other op runs once over all `np + nd` rows. `ns`: the decode rows' flash-decoding splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PassRows {
    pub np: usize,
    pub nd: usize,
    pub ns: usize,
}

impl PassRows {
    pub fn n(&self) -> usize {
        self.np + self.nd
    }

    /// Whether the dense products take the streamed few-token kernels (`dense_seqs`): passes of decode rows only, at
    /// most [`STREAM_ROWS`] of them; every other pass takes the tensor-core GEMM (`gemm_q4`), so that a
    /// prompt row's arithmetic is the same in every pass that holds prompt rows (bit for bit, with the GEMM's K split
    /// and the experts' kernels on the same side of [`STREAM_MAX_TOKENS`]).
    pub fn streamed_dense(&self) -> bool {
        self.np == 0 && self.nd <= STREAM_ROWS
    }
}

/// What a pass does with its rows' expert choices, per layer (tests): append them to a log (`[layer][n * k]`, rows
/// in pass order), or hold them to given ones (the weights from the step's own router logits, renormalised over them;
/// a slow host path).
pub enum StepRoutes<'a> {
    Log(&'a mut [Vec<usize>]),
    Hold(&'a [Vec<usize>]),
}

/// The decode rows' attention buffers ([`crate::workspace::SeqScratch`]): queries `[nd, nh * hd]` and
/// split partials `[nd, nh, ns, hd + 2]`.
pub(crate) struct DecodeBufs<'a> {
    pub qbuf: &'a mut CudaSlice<f32>,
    pub part: &'a mut CudaSlice<f32>,
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
    let PassRows { np, nd, ns } = rows;
    let n = rows.n();
    ensure!(n > 0 && n <= sc.cap, "a pass of {n} rows over buffers of {}", sc.cap);
    ensure!(np == 0 || np == t.segs.rows(), "a pass of {np} prompt rows over a segment table of {}", t.segs.rows());
    ensure!(nd == 0 || dec.is_some(), "a pass with decode rows needs their attention buffers");
    if let Some(r) = &routes {
        let layers = match r {
            StepRoutes::Log(v) => v.len(),
            StepRoutes::Hold(v) => v.len(),
        };
        ensure!(layers == m.layers.len(), "a pass with routes for {layers} layers, not {}", m.layers.len());
    }
    let ps = if np > 0 { t.segs.n() } else { 0 };
    ensure!(t.n >= ps + nd, "pass tables for {} sequences, not {ps} prompts and {nd} decodes", t.n);
    let dense =
        |w: &QMat, x: &CudaSlice<u16>, y: &mut CudaSlice<f32>, ldy: usize, add: bool| match rows.streamed_dense() {
            true => g.dense_seqs(w, x, n, y, ldy, add),
            false => g.gemm_q4(w, x, n, y, ldy, add),
        };
    let tag = |streamed: &'static str, gemm: &'static str| if rows.streamed_dense() { streamed } else { gemm };
    for (li, l) in m.layers.iter().enumerate() {
        if li == 0 {
            mark("rmsnorm")?;
            g.rmsnorm_rows(&sc.x, n, &l.in_norm, eps, &mut sc.xb, None)?;
        }
        let (ta, tb) = t.layer(li);
        let (da, db) = t.layer_from(li, ps);
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
                    mark("gdn_chunk_scan")?;
                    g.gdn_chunk_scan(&sc.qkv, &mut sc.chunks, segs, d, &tb, &mut sc.o)?;
                    mark("gdn_ring+gated_norm")?;
                    g.gdn_ring(&sc.proj, ldp, d, segs, &ta)?;
                    g.gdn_gated_norm(&sc.o, &sc.proj, ldp, np, d, norm, eps, &mut sc.xb)?;
                }
                if nd > 0 {
                    mark("gdn_step_seqs")?;
                    let st = (&da, &db, &t.posv);
                    g.gdn_step_seqs(&sc.proj, ldp, np, conv, a_log, dt_bias, st, nd, norm, eps, d, &mut sc.xb)?;
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
                if let (true, Some(b)) = (nd > 0, dec.as_mut()) {
                    let kv = (&da, &db, &t.posv);
                    mark("attn_seqs (prep+decode+combine)")?;
                    g.attn_prep_seqs(&sc.proj, ldp, np, qn, kn, kv, nd, dims, theta, eps, b.qbuf)?;
                    g.attn_decode_seqs(b.qbuf, kv, nd, (nh, nkv, hd), ns, b.part)?;
                    g.attn_combine_seqs(b.part, &sc.proj, ldp, np, nd, nh, hd, ns, &mut sc.xb)?;
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
        let next = match m.layers.get(li + 1) {
            Some(l) => Some(&l.in_norm),
            None => final_norm.then_some(&m.norm),
        };
        moe_rows(m, li, sc, n, m.prefill_experts(n), held, next, mark)?;
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
    li: usize,
    sc: &mut Scratch,
    n: usize,
    how: MoeExperts,
    routes: Option<Routes>,
    next_norm: Option<&CudaSlice<f32>>,
    mark: &mut dyn FnMut(&'static str) -> Result<()>,
) -> Result<()> {
    let (g, c, l) = (&*m.gpu, &m.config, &m.layers[li]);
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    let (k, e) = (c.num_experts_per_tok, c.num_experts);
    let sizes = (c.moe_intermediate_size, c.shared_expert_intermediate_size);
    ensure!(l.router.rows == e + 1, "layer {li}: router rows {} != experts + 1", l.router.rows);
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
                "layer {li}: {} held expert ids for {n} rows of {k} (each < {e})",
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
        for (s, ids) in seqs.iter().zip(ids) {
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
        }
        if let Some(r) = &routes {
            let layers = match r {
                StepRoutes::Log(v) => v.len(),
                StepRoutes::Hold(v) => v.len(),
            };
            ensure!(layers == self.layers.len(), "a pass with routes for {layers} layers, not {}", self.layers.len());
        }
        // the pass's order: prompt chunks, then decode rows
        let is_decode = |i: usize| decode_rows && ids[i].len() == 1;
        let order: Vec<usize> = (0..n).filter(|&i| !is_decode(i)).chain((0..n).filter(|&i| is_decode(i))).collect();
        let ps = order.iter().filter(|&&i| !is_decode(i)).count();
        let (prompts, decodes) = order.split_at(ps);
        let np: usize = prompts.iter().map(|&i| ids[i].len()).sum();
        let nd = decodes.len();
        let nkv = c.num_key_value_heads;
        // the splits depend on the capacity, not the lengths, so that a captured pass serves any positions
        let max_ctx = decodes.iter().map(|&i| seqs[i].max_ctx).max().unwrap_or(1);
        let ns = if nd > 0 { splits(g, nd, nkv, max_ctx) } else { 0 };
        let rows = PassRows { np, nd, ns };

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
        let t = tables(tslot, self.shapes())?;
        let ptrs: Vec<Vec<(u64, u64)>> = order.iter().map(|&i| seqs[i].layer_ptrs(self)).collect::<Result<_>>()?;
        t.set_states(g, &ptrs)?;
        if nd > 0 {
            let posv: Vec<i32> = decodes.iter().map(|&i| seqs[i].len as i32).collect();
            g.stream.memcpy_htod(&posv, &mut t.posv.slice_mut(..nd))?;
        }
        if np > 0 {
            let segs: Vec<(usize, usize)> = prompts.iter().map(|&i| (ids[i].len(), seqs[i].len)).collect();
            t.segs.set(g, &segs)?;
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
            // decode rows only: kernels from the ids on the device to the logits, one graph per shape, captured on
            // first use; a capture that fails turns graphs off for good (the kernels then launch one by one: slower,
            // same results)
            let v: Vec<i32> = flat.iter().map(|&i| i as i32).collect();
            g.stream.memcpy_htod(&v, &mut sc.ids.slice_mut(..nd))?;
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
            // prompt chunks (and decode rows): launched one by one; then each sequence's last row
            let h = c.hidden_size;
            mark("embed")?;
            g.embed_rows(&self.embed, &flat, &mut sc.ids, &mut sc.x)?;
            let dec = DecodeBufs { qbuf: &mut sq.qbuf, part: &mut sq.part };
            layers_pass(self, sc, Some(dec), t, rows, false, routes, &mut mark)?;
            mark("lm_head (gemm) + sample")?;
            let mut r0 = 0;
            for (r, &i) in prompts.iter().enumerate() {
                let last = r0 + ids[i].len() - 1;
                g.stream
                    .memcpy_dtod(&sc.x.slice(last * h..(last + 1) * h), &mut sq.last.slice_mut(r * h..(r + 1) * h))?;
                r0 += ids[i].len();
            }
            if nd > 0 {
                g.stream.memcpy_dtod(&sc.x.slice(np * h..(np + nd) * h), &mut sq.last.slice_mut(ps * h..n * h))?;
            }
            g.rmsnorm_rows(&sq.last, n, &self.norm, c.rms_norm_eps, &mut sc.xb, None)?;
            g.gemm_q4(&self.lm_head, &sc.xb, n, &mut sq.logits, vocab, false)?;
        }
        let pass_want: Vec<RowWant> = order.iter().map(|&i| want[i]).collect();
        let drawn = draw_rows(g, vocab, &pass_want, &mut sq.logits)?;
        if timed {
            events.push(("", g.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?));
        }
        g.stream.synchronize()?;
        if let Some(p) = prof {
            p.add_events(&events)?;
        }
        for (s, ids) in seqs.iter_mut().zip(ids) {
            s.len += ids.len();
            s.pos_stale = true;
        }
        // back to the caller's order
        let mut out: Vec<Option<RowOut>> = (0..n).map(|_| None).collect();
        for (&i, row) in order.iter().zip(drawn) {
            out[i] = Some(row);
        }
        out.into_iter().map(|r| r.context("a pass row without a result")).collect()
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
        let key = (rows.nd, rows.ns, streamed, omit.map(str::to_string));
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
        let n = rows.nd;
        mark("embed")?;
        g.embed_rows_dev(&self.embed, &sc.ids, n, &mut sc.x)?;
        let dec = DecodeBufs { qbuf: &mut sq.qbuf, part: &mut sq.part };
        layers_pass(self, sc, Some(dec), t, rows, true, routes, mark)?;
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
