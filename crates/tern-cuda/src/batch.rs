//! Batched decode: one token for each of up to [`MAX_SEQS`] sequences in one pass of kernels per layer, so that
//! every weight is read once per step for all of them instead of once per sequence.
//!
//! The token-independent work runs over the B rows with the streamed few-token kernels of moe_seqs.cu (each weight
//! byte read once from DRAM and applied to every row that needs it, on tensor cores): `dense_seqs` for the dense
//! projections and the lm_head, the router, and the experts over the few tokens each gets; the per-sequence work runs
//! in one launch
//! for all rows with the decode kernels' `_seqs` variants (crates/tern-kernels/cuda/{gdn,attention}.cu), which
//! take each row's recurrent state, conv ring and K/V cache from pointer tables and its position from a device
//! array the host uploads before the step:
//! - GDN: rmsnorm_rows → dense_seqs (in_proj) → gdn_step_seqs (conv, gates, delta rule, gated norm → bf16) →
//!   dense_seqs (out_proj, + residual).
//! - Attention: rmsnorm_rows → dense_seqs (q|gate, k, v) → attn_prep_seqs (norms, RoPE, K/V row at the position) →
//!   attn_decode_kv_seqs (flash-decoding splits over keys 0..=pos) → attn_combine_seqs (+ output gate → bf16) →
//!   dense_seqs (o_proj, + residual).
//! - MoE: router and sort as the prefill (`prefill::moe_rows`), then the streamed expert kernels of moe_seqs.cu.
//! - Then the final norm, the lm_head (dense_seqs) into `[B, vocab]` logits and one `sample_rows` launch for every
//!   row's draw (crates/tern-cuda/src/sample.rs: greedy rows are temperature-0 draws below their limit).
//!
//! [`DeviceModel::prefill_seqs`] does the same for prompt chunks of several sequences: the projections and the MoE
//! over all their rows at once, the prefill's GDN and attention kernels over all of them too (each row on its own
//! sequence's state, through the pass tables), then
//! the last rows' lm_head and draws; it leaves each sequence bit for bit as its own prefill would where both passes
//! take the same router and expert kernels (both of at most `STREAM_MAX_TOKENS` rows, or both longer).
//!
//! Projection inputs are bf16 (the batch-1 decode graph keeps f32 activations), so a sequence's logits in a batch
//! differ from its logits alone by bf16 rounding, as the prefill's do. The step leaves each sequence's length
//! advanced by one and its device position counter stale ([`DeviceState::pos_stale`]: the batch-1 graph
//! refreshes it before its next step).

use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;

use cudarc::driver::{sys, CudaEvent, CudaGraph, CudaSlice, CudaView, DevicePtr};

use crate::gpu::{cfg, Gpu};
use crate::gpu::{Experts, QMat};
use crate::model::{DMixer, DeviceModel};
use crate::prefill::{
    check_dense, log2_exact, moe_rows, pass_fits, prefill_layers, scratch_rows, tables, GdnDims, MoeExperts, MoeSorted,
    PassTables, PrefillBuffers, Routes, SMEM_MAX,
};
use crate::sample::SampleBatch;
use crate::seq::{DeviceState, Profile};
use tern_engine::{Sample, Sampled, SamplingParams};

/// The most sequences one batched step takes (a larger batch is split by the caller).
pub const MAX_SEQS: usize = 64;
/// The most flash-decoding splits per (sequence, kv head) in a batched step.
const MAX_SPLIT: usize = 32;
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

/// A batched step's expert choices, per layer (`[layer][n * k]`, rows in order; tests): appended to a log, or
/// held to given ones (the weights from the step's own router logits, renormalised over them; a slow host path).
pub enum StepRoutes<'a> {
    Log(&'a mut [Vec<usize>]),
    Hold(&'a [Vec<usize>]),
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

/// The batched step's own buffers (the activation rows are the prefill's [`crate::prefill::Scratch`], the pointer
/// tables and positions its [`PassTables`]): attention queries and split partials, logits of [`MAX_SEQS`] rows.
pub struct SeqScratch {
    qbuf: CudaSlice<f32>,
    part: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// The multi-sequence prefill's last hidden row of every sequence.
    last: CudaSlice<f32>,
    /// The batched pass captured as a CUDA graph, by (rows, attention splits, family left out): every address it
    /// bakes in is one of these buffers, of the [`PassTables`] (allocated once; uploaded before each launch) or of
    /// the pass's scratch rows, whose address at capture is `graph_x` (a reallocation clears them).
    graphs: PassGraphs,
    graph_x: u64,
}

/// Captured batched passes by (rows, attention splits, the kernel family left out: [`PrefillBuffers::omit`]).
#[derive(Default)]
struct PassGraphs(HashMap<(usize, usize, Option<String>), CudaGraph>);

// SAFETY: the graphs live in the model's prefill buffers, behind its mutex: one thread at a time launches or drops
// them (cudarc's CudaGraph holds raw handles, which are not Send by default; the context they belong to is).
unsafe impl Send for PassGraphs {}

impl SeqScratch {
    pub fn new(m: &DeviceModel) -> Result<SeqScratch> {
        let (g, c) = (&*m.gpu, &m.config);
        let (nh, hd) = (c.num_attention_heads, c.head_dim);
        let n = MAX_SEQS;
        let alloc = || -> Result<SeqScratch> {
            Ok(SeqScratch {
                qbuf: g.zeros(n * nh * hd)?,
                part: g.zeros(n * nh * MAX_SPLIT * (hd + 2))?,
                logits: g.zeros(n * c.vocab_size)?,
                last: g.zeros(n * c.hidden_size)?,
                graphs: PassGraphs::default(),
                graph_x: 0,
            })
        };
        alloc().context("cannot allocate the batched decode buffers (out of device memory?)")
    }

    /// Device bytes these buffers hold.
    pub fn bytes(&self) -> usize {
        4 * (self.qbuf.len() + self.part.len() + self.logits.len() + self.last.len())
    }
}

/// Flash-decoding splits for `n` rows whose longest context is `max_len` keys: as many blocks as fit the chip at
/// once (rows × kv heads × splits ≤ 2 per SM, attn_decode_kv_seqs' occupancy; rounded up, B = 8 made 272 blocks
/// for 264 places), at least 16 keys per split, at most [`MAX_SPLIT`].
fn splits(g: &Gpu, n: usize, nkv: usize, max_len: usize) -> usize {
    let fill = (2 * g.sms as usize) / (n * nkv);
    fill.min(max_len.div_ceil(16)).clamp(1, MAX_SPLIT)
}

impl DeviceModel {
    /// Read one token for each sequence (`ids[r]` into `seqs[r]`, distinct sequences) in one batched pass and draw
    /// each row's token on the device as `want[r]` says (the chosen ids and asked-for logprobs cross to the host;
    /// a logits row only when asked for). Input and shape checks come first and change nothing; a failed launch
    /// leaves the sequences' states undefined; a row's own bad draw fails that row alone.
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
        let (g, c) = (&*self.gpu, &self.config);
        let n = seqs.len();
        ensure!(n > 0 && n <= MAX_SEQS, "a batched decode step takes 1..={MAX_SEQS} sequences, not {n}");
        ensure!(
            ids.len() == n && want.len() == n,
            "decode_seqs: {n} sequences, {} ids, {} wants",
            ids.len(),
            want.len()
        );
        let vocab = c.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        for s in seqs.iter() {
            ensure!(s.len < s.room, "context full: the sequence has room for {} tokens (its reservation)", s.room);
            ensure!(s.layers.len() == self.layers.len(), "a sequence of another model");
        }
        if let Some(r) = &routes {
            let layers = match r {
                StepRoutes::Log(v) => v.len(),
                StepRoutes::Hold(v) => v.len(),
            };
            ensure!(layers == self.layers.len(), "decode_seqs: routes for {layers} layers, not {}", self.layers.len());
        }
        let nkv = c.num_key_value_heads;
        let posv: Vec<i32> = seqs.iter().map(|s| s.len as i32).collect();
        // the splits depend on the capacity, not the lengths, so that a captured pass serves any positions
        let max_ctx = seqs.iter().map(|s| s.max_ctx).max().unwrap_or(1);
        let ns = splits(g, n, nkv, max_ctx);

        let mut guard =
            self.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned by an earlier panic"))?;
        let PrefillBuffers { chunk, scratch, seqs: seq_scratch, tables: tslot, graphs, omit } = &mut *guard;
        let use_graph = *graphs && prof.is_none() && routes.is_none();
        let sc = scratch_rows(scratch, self, n.max(*chunk))?;
        if seq_scratch.is_none() {
            *seq_scratch = Some(SeqScratch::new(self)?);
        }
        let sq = seq_scratch.as_mut().context("batched decode buffers")?;
        let t = tables(tslot, self)?;
        t.set_states(self, seqs.iter().map(|s| &**s))?;
        g.stream.memcpy_htod(&posv, &mut t.posv.slice_mut(..n))?;

        let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        g.stream.memcpy_htod(&v, &mut sc.ids.slice_mut(..n))?;
        let streamed = self.streamed_moe();
        let pass = PassShape { n, ns, streamed };
        let mut events: Vec<(&'static str, CudaEvent)> = Vec::new();
        let mut graphed = false;
        if use_graph {
            // kernels only from here to the logits: one graph per shape, captured on first use; a capture that
            // fails turns graphs off for good (the kernels then launch one by one: slower, same results)
            match self.replay_pass(sc, sq, t, pass, omit.as_deref()) {
                Ok(()) => graphed = true,
                Err(e) => {
                    *graphs = false;
                    eprintln!("tern: capturing the batched decode pass failed ({e:#}); its kernels launch one by one");
                }
            }
        }
        if !graphed {
            // profiling: an event before each kernel family's launch (the name is the family that follows)
            let timed = prof.is_some();
            let mut mark = |name: &'static str| -> Result<()> {
                if timed {
                    events.push((name, g.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?));
                }
                Ok(())
            };
            self.batched_pass(sc, sq, t, pass, routes, &mut mark)?;
        }
        let out = draw_rows(g, vocab, want, &mut sq.logits)?;
        if prof.is_some() {
            events.push(("", g.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?));
        }
        g.stream.synchronize()?;
        if let Some(p) = prof {
            for w in events.windows(2) {
                let ((name, a), (_, b)) = (&w[0], &w[1]);
                if !name.is_empty() {
                    p.add(name, a.elapsed_ms(b)? as f64);
                }
            }
        }
        for s in seqs.iter_mut() {
            s.len += 1;
            s.pos_stale = true;
        }
        Ok(out)
    }
}

/// What a batched pass's launches depend on besides the buffers' addresses: rows, attention splits, and whether the
/// experts take the streamed kernels.
#[derive(Clone, Copy)]
struct PassShape {
    n: usize,
    ns: usize,
    streamed: bool,
}

impl DeviceModel {
    /// Launch the batched pass as the CUDA graph of its shape, capturing it first if there is none (graphs whose
    /// scratch rows have moved are dropped).
    fn replay_pass(
        &self,
        sc: &mut crate::prefill::Scratch,
        sq: &mut SeqScratch,
        t: &PassTables,
        pass: PassShape,
        omit: Option<&str>,
    ) -> Result<()> {
        let g = &*self.gpu;
        let x = ptr(g, &sc.x);
        if sq.graph_x != x {
            sq.graphs.0.clear();
            sq.graph_x = x;
        }
        let key = (pass.n, pass.ns, omit.map(str::to_string));
        if !sq.graphs.0.contains_key(&key) {
            let st = g.stream.clone();
            st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            // a family left out: its launches (from its mark to the next) are not made
            let mut mark = |name: &'static str| {
                g.omit.store(omit == Some(name), std::sync::atomic::Ordering::Relaxed);
                Ok(())
            };
            let r = self.batched_pass(sc, sq, t, pass, None, &mut mark);
            g.omit.store(false, std::sync::atomic::Ordering::Relaxed);
            let graph = st.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            r?;
            sq.graphs.0.insert(key.clone(), graph?.context("empty graph of the batched pass")?);
        }
        sq.graphs.0.get(&key).context("the batched pass's graph")?.launch()?;
        Ok(())
    }

    /// The batched pass's launches, from the ids in `sc.ids` to the logits in `sq.logits` (pointer tables and
    /// positions already uploaded): kernels only, unless `routes` asks for a host round trip per layer, so that it
    /// can be captured as a graph. `mark` names each kernel family before its launch (profiling); the lm_head is
    /// the last family.
    fn batched_pass(
        &self,
        sc: &mut crate::prefill::Scratch,
        sq: &mut SeqScratch,
        t: &PassTables,
        PassShape { n, ns, streamed }: PassShape,
        mut routes: Option<StepRoutes>,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<()> {
        let (g, c) = (&*self.gpu, &self.config);
        let (h, eps, d) = (c.hidden_size, c.rms_norm_eps, GdnDims::of(c));
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        mark("embed")?;
        g.embed_rows_dev(&self.embed, &sc.ids, n, &mut sc.x)?;
        for (li, l) in self.layers.iter().enumerate() {
            let (ta, tb) = t.layer(li);
            if li == 0 {
                // later layers' input norms and the final norm go with the combine before them (moe_rows)
                mark("rmsnorm")?;
                g.rmsnorm_rows(&sc.x, n, &l.in_norm, eps, &mut sc.xb, None)?;
            }
            match &l.mixer {
                DMixer::Gdn { proj, out, conv, a_log, dt_bias, norm } => {
                    let ldp = proj.rows;
                    mark("gdn_in_proj (dense)")?;
                    g.dense_seqs(proj, &sc.xb, n, &mut sc.proj, ldp, false)?;
                    mark("gdn_step_seqs")?;
                    let st = (&ta, &tb, &t.posv);
                    g.gdn_step_seqs(&sc.proj, ldp, conv, a_log, dt_bias, st, n, norm, eps, d, &mut sc.xb)?;
                    mark("gdn_out_proj (dense)")?;
                    g.dense_seqs(out, &sc.xb, n, &mut sc.x, h, true)?;
                }
                DMixer::Attn { qkv, o, qn, kn } => {
                    let ldp = qkv.rows;
                    mark("attn_qkv (dense)")?;
                    g.dense_seqs(qkv, &sc.xb, n, &mut sc.proj, ldp, false)?;
                    let (theta, dims) = (c.rope_theta as f32, (nh, nkv, hd, c.rotary_dim));
                    let kv = (&ta, &tb, &t.posv);
                    mark("attn_seqs (prep+decode+combine)")?;
                    g.attn_prep_seqs(&sc.proj, ldp, qn, kn, kv, n, dims, theta, eps, &mut sq.qbuf)?;
                    g.attn_decode_seqs(&sq.qbuf, kv, n, (nh, nkv, hd), ns, &mut sq.part)?;
                    g.attn_combine_seqs(&sq.part, &sc.proj, ldp, n, nh, hd, ns, &mut sc.xb)?;
                    mark("attn_o_proj (dense)")?;
                    g.dense_seqs(o, &sc.xb, n, &mut sc.x, h, true)?;
                }
            }
            let how = match streamed {
                true => MoeExperts::Streamed,
                false => MoeExperts::Gemm,
            };
            let held = match routes.as_mut() {
                Some(StepRoutes::Log(log)) => Some(Routes::Log(&mut log[li])),
                Some(StepRoutes::Hold(held)) => Some(Routes::Hold(&held[li])),
                None => None,
            };
            let next = self.layers.get(li + 1).map_or(&self.norm, |l| &l.in_norm);
            moe_rows(self, li, sc, n, how, held, Some(next), mark)?;
        }
        mark("lm_head (dense) + sample")?;
        g.lm_head_seqs(&self.lm_head, &sc.xb, n, &mut sq.logits, c.vocab_size, false)
    }
}

impl DeviceModel {
    /// Read a prompt chunk for each of up to [`MAX_SEQS`] sequences (`chunks[r]` into `seqs[r]`, distinct sequences,
    /// at most the prefill chunk's tokens and chunks in all: [`crate::prefill::pass_fits`]) in one pass: the
    /// projections, the router and the experts run once over every sequence's rows together, and so do the prefill's
    /// GDN and attention kernels, each row (and chunk of 64) on its own sequence's state through the pass tables,
    /// continuing from what it holds. Then each sequence's last row gives its logits and draw as `want[r]` says. Every row's arithmetic is that of the
    /// one-sequence prefill ([`DeviceState::prefill`]) of as many rows as the pass, so the state left behind is the
    /// same bit for bit as the sequence's own prefill where both take the same router and expert kernels (both passes
    /// of at most [`crate::prefill::STREAM_MAX_TOKENS`] rows, or both longer; across that line the router's sums, the
    /// experts' bf16-rounded GEMM weights and the dense GEMMs' K split differ by rounding). The last row's logits are
    /// those of its all-positions lm_head GEMM. Input checks first; a failed launch leaves the sequences' states undefined.
    pub fn prefill_seqs(
        &self,
        seqs: &mut [&mut DeviceState],
        chunks: &[&[u32]],
        want: &[RowWant],
    ) -> Result<Vec<RowOut>> {
        let (g, c) = (&*self.gpu, &self.config);
        let n = seqs.len();
        ensure!(n > 0 && n <= MAX_SEQS, "a multi-sequence prefill takes 1..={MAX_SEQS} sequences, not {n}");
        ensure!(chunks.len() == n && want.len() == n, "prefill_seqs: {n} sequences, {} chunks", chunks.len());
        let vocab = c.vocab_size;
        for (s, ids) in seqs.iter().zip(chunks) {
            ensure!(!ids.is_empty(), "prefill needs at least one token");
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                bail!("token id {bad} is outside the vocabulary (size {vocab})");
            }
            ensure!(
                s.len + ids.len() <= s.room,
                "the prompt does not fit: {} tokens held + {} new > the sequence's room of {} tokens",
                s.len,
                ids.len(),
                s.room
            );
            ensure!(s.layers.len() == self.layers.len(), "a sequence of another model");
        }
        let total: usize = chunks.iter().map(|c| c.len()).sum();
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let mut guard =
            self.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned by an earlier panic"))?;
        ensure!(
            pass_fits(guard.chunk, chunks.iter().map(|c| c.len())),
            "a multi-sequence prefill of {total} tokens in {n} sequences over the prefill chunk of {}",
            guard.chunk
        );
        let PrefillBuffers { chunk, scratch, seqs: seq_scratch, tables: tslot, .. } = &mut *guard;
        let sc = scratch_rows(scratch, self, *chunk)?;
        if seq_scratch.is_none() {
            *seq_scratch = Some(SeqScratch::new(self)?);
        }
        let sq = seq_scratch.as_mut().context("batched decode buffers")?;
        let t = tables(tslot, self)?;
        t.set_states(self, seqs.iter().map(|s| &**s))?;
        let rows: Vec<(usize, usize)> = seqs.iter().zip(chunks).map(|(s, ids)| (ids.len(), s.len)).collect();
        t.segs.set(g, &rows)?;
        let all: Vec<u32> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        let starts: Vec<usize> = chunks.iter().scan(0, |r, c| Some(std::mem::replace(r, *r + c.len()))).collect();
        g.embed_rows(&self.embed, &all, &mut sc.ids, &mut sc.x)?;
        prefill_layers(self, sc, t, total, None, &mut |_| Ok(()))?;
        for (r, k) in chunks.iter().map(|c| c.len()).enumerate() {
            let last = starts[r] + k - 1;
            g.stream.memcpy_dtod(&sc.x.slice(last * h..(last + 1) * h), &mut sq.last.slice_mut(r * h..(r + 1) * h))?;
        }
        g.rmsnorm_rows(&sq.last, n, &self.norm, eps, &mut sc.xb, None)?;
        g.gemm_q4(&self.lm_head, &sc.xb, n, &mut sq.logits, vocab, false)?;
        let out = draw_rows(g, vocab, want, &mut sq.logits)?;
        g.stream.synchronize()?;
        for (s, ids) in seqs.iter_mut().zip(chunks) {
            s.len += ids.len();
            s.pos_stale = true;
        }
        Ok(out)
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

/// The per-row tables of a batched step's layer: the two state pointers of each row's sequence (GDN: conv ring,
/// recurrent state; attention: K cache, V cache) and the rows' positions.
pub type SeqTables<'a> = (&'a CudaView<'a, u64>, &'a CudaView<'a, u64>, &'a CudaSlice<i32>);

/// A buffer's device address (for the pointer tables).
fn ptr<T>(g: &Gpu, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(&g.stream).0
}

impl Gpu {
    /// [`Gpu::gdn_step`] for `n` sequences: row r's projections `proj[r]` (stride `ldp`), its conv ring and state
    /// at `rings[r]` / `states[r]`, its position `posv[r]`; output bf16 rows of `hv * dv` into `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step_seqs(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
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
        ensure!(ldp >= conv_dim + vd + 2 * d.hv && proj.len() >= (n - 1) * ldp + ldp, "gdn_step_seqs: proj");
        ensure!(conv_w.len() == conv_dim * d.taps && a_log.len() >= d.hv && dt_bias.len() >= d.hv, "gdn_step_seqs");
        ensure!(norm.len() >= d.dv && out.len() >= n * vd, "gdn_step_seqs: norm / out");
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
        l.arg(proj).arg(&v[0]).arg(conv_w).arg(rings).arg(a_log).arg(dt_bias).arg(states).arg(&*out).arg(&v[1]);
        l.arg(posv).arg(norm).arg(&eps).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&v[5]).arg(&v[6]).arg(&v[7]);
        l.cluster = Some((parts as u32, 1, 1));
        // SAFETY: matches gdn_step_seqs in gdn.cu: grid (hv * parts, n) in clusters of the parts (<= 8) of a head,
        // 128 threads per 32 of a block's dvp <= 64 value columns (at most its 256), the block's columns of the
        // head's state in dynamic shared memory (dk * dvp floats, checked against the opt-in limit; dvp % 4 == 0 for
        // its 16-byte copies), dk <= 128 (its q/k arrays); proj holds n rows of stride ldp, out n rows of hv*dv; the
        // tables hold n pointers to whole rings ([taps, conv_dim] f32) and states ([hv, dk, dv] f32) of live
        // sequences (DeviceModel::decode_seqs builds them from the sequences' own buffers).
        unsafe { l.launch(cfg(((d.hv * parts) as u32, n as u32), threads, smem)) }?;
        Ok(())
    }

    /// [`Gpu::attn_prep`] for `n` sequences: q → `qbuf` rows (f32, `nh * hd`), k/v → row `posv[r]` of the caches
    /// at `kc[r]` / `vc[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prep_seqs(
        &self,
        proj: &CudaSlice<f32>,
        ldp: usize,
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
        ensure!(n > 0 && n <= 65535 && ldp >= rows && proj.len() >= (n - 1) * ldp + rows, "attn_prep_seqs: proj");
        ensure!(qn.len() >= hd && kn.len() >= hd && qbuf.len() >= n * nh * hd, "attn_prep_seqs: buffers");
        ensure!(kc.len() >= n && vc.len() >= n && posv.len() >= n, "attn_prep_seqs: tables");
        let v = [ldp, nh, nkv, hd, rd].map(|v| v as i32);
        let mut l = self.launcher(&self.f.attn_prep_seqs);
        l.arg(proj).arg(&v[0]).arg(qn).arg(kn).arg(posv).arg(&v[1]).arg(&v[2]).arg(&v[3]).arg(&v[4]).arg(&theta);
        l.arg(&eps).arg(&*qbuf).arg(kc).arg(vc);
        // SAFETY: matches attn_prep_seqs in attention.cu; grid (nh + nkv, n) of hd threads; the caches in the tables
        // belong to live sequences whose position posv[r] is below their capacity (decode_seqs checks len < room).
        unsafe { l.launch(cfg(((nh + nkv) as u32, n as u32), hd as u32, 0)) }?;
        Ok(())
    }

    /// [`Gpu::attn_decode`] (the per-kv-head kernel) for `n` sequences over their keys `0..=posv[r]`: partials
    /// `[n, nh, nsplit, hd + 2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode_seqs(
        &self,
        qbuf: &CudaSlice<f32>,
        (kc, vc, posv): SeqTables,
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
        ensure!(kc.len() >= n && vc.len() >= n && posv.len() >= n, "attn_decode_seqs: tables");
        let scale = 1.0 / (hd as f32).sqrt();
        let v = [nh, nkv, hd].map(|v| v as i32);
        let mut l = self.launcher(&self.f.attn_decode_kv_seqs);
        l.arg(qbuf).arg(kc).arg(vc).arg(posv).arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&scale).arg(&*part);
        let mut lc = cfg((nkv as u32, nsplit as u32), 128, 0);
        lc.grid_dim.2 = n as u32;
        // SAFETY: matches attn_decode_kv_seqs (4 warps, static smem) in attention.cu; group <= 8 and hd <= 256
        // checked; keys 0..=posv[r] were written (attn_prep_seqs wrote row posv[r]; earlier rows by earlier steps).
        unsafe { l.launch(lc) }?;
        Ok(())
    }

    /// [`Gpu::attn_combine`] for `n` sequences: bf16 rows of `nh * hd` (gate from `proj` rows of stride `ldp`).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_combine_seqs(
        &self,
        part: &CudaSlice<f32>,
        proj: &CudaSlice<f32>,
        ldp: usize,
        n: usize,
        nh: usize,
        hd: usize,
        nsplit: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<()> {
        ensure!(nsplit <= 1024 && hd <= 1024 && (1..=65535).contains(&n), "attn_combine_seqs: dims");
        ensure!(part.len() >= n * nh * nsplit * (hd + 2) && out.len() >= n * nh * hd, "attn_combine_seqs: buffers");
        ensure!(ldp >= 2 * nh * hd && proj.len() >= (n - 1) * ldp + 2 * nh * hd, "attn_combine_seqs: proj");
        let (ldpi, ns, hdi, ldo) = (ldp as i32, nsplit as i32, hd as i32, (nh * hd) as i32);
        let mut l = self.launcher(&self.f.attn_combine_seqs);
        l.arg(part).arg(proj).arg(&ldpi).arg(&ns).arg(&hdi).arg(&*out).arg(&ldo);
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

    /// The batched step's lm_head: [`Gpu::dense_seqs`] (above 16 rows its bulk-copy kernel in passes of 32 rows:
    /// alone on the H200, 211.3 / 421.1 us at 32 / 64 rows), or with [`Gpu::dense_gemm`] set (`TERN_DENSE_GEMM=1`),
    /// above 32 rows of a vocabulary-sized matrix the prefill's [`Gpu::gemm_q4`] (weights dequantised once per
    /// 128-token tile, rounded to bf16: 452.4 us at 64), which was the default while dense_seqs' 8-row tiles
    /// dequantised every weight n / 8 times (840 us at 64).
    pub fn lm_head_seqs(
        &self,
        m: &QMat,
        x: &CudaSlice<u16>,
        n: usize,
        y: &mut CudaSlice<f32>,
        ldy: usize,
        add: bool,
    ) -> Result<()> {
        let gemm = self.dense_gemm.load(std::sync::atomic::Ordering::Relaxed);
        match gemm && n > 32 && m.rows >= 65536 && m.cols <= 2048 {
            true => self.gemm_q4(m, x, n, y, ldy, add),
            false => self.dense_seqs(m, x, n, y, ldy, add),
        }
    }

    /// `y[t, r] (+)= W[r] · x[t]` for the `n` ≤ [`MAX_SEQS`] bf16 rows of `x` (`[n, cols]`) and a 4-bit matrix (the
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
        ensure!(n <= MAX_SEQS, "dense_seqs: {n} rows (1..={MAX_SEQS})");
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
        ensure!((1..=MAX_SEQS).contains(&n), "dense_ring: {n} rows (1..={MAX_SEQS})");
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
    /// size 64, rows a multiple of 16, 2,048 or 4,096 columns, n <= [`MAX_SEQS`] (checked).
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
        ensure!((1..=MAX_SEQS).contains(&n), "dense_tma: {n} rows (1..={MAX_SEQS})");
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
        // checked), n <= MAX_SEQS rows in passes of tgs; W is a whole 4-bit QMat
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
/// its shapes, 1..=[`MAX_SEQS`] tokens, 1..=DT_MAXS slots, and its shared memory within the limit.
pub fn dense_tma_takes(rows: usize, cols: usize, gs: usize, n: usize, slots: usize) -> bool {
    dense_tma_shapes(rows, cols, gs)
        && (1..=MAX_SEQS).contains(&n)
        && (1..=DT_MAXS).contains(&slots)
        && dense_tma_smem(cols, dense_tma_tgs(cols, n), slots) <= SMEM_MAX
}

/// The ring slots dense_seqs gives dense_tma for a `rows x cols` product (group size `gs`) at `n` tokens on `sms`
/// multiprocessors, or None where it keeps the ring kernel or the register-streamed one. Up to 16 tokens: the shapes
/// dense_tma takes, at most [`DENSE_RING_X`] staged token-columns (out_proj / o_proj above 8 tokens) and at most
/// [`DT_UNITS`] units a block (not the lm_head). Two slots (one where a block has one unit): more kept the next
/// kernel's blocks off the multiprocessor and were slower (in_proj at 8 tokens 8.1 us with 2, 9.0 with 4). Above 16
/// tokens the 2,048-column matrices (in_proj, q|k|v and the lm_head, in passes of [`dense_tma_tgs`] tokens): measured
/// alone on the H200 (docs/cuda-notes.md step 40), us at 32 / 64 tokens, in_proj 18.2 / 35.1 against the
/// register-streamed kernel's 21.6 / 43.0, q|k|v 16.3 / 31.4 against 21.0 / 35.4, the lm_head 211.3 / 421.1 against
/// 427.9 and the GEMM's 452.4; not out_proj and o_proj, whose 128 blocks would each stage every token's 4,096 columns
/// for one unit (32 tokens 19.4 against the ring kernel's 12.4).
pub fn dense_tma_slots(rows: usize, cols: usize, gs: usize, n: usize, sms: usize) -> Option<usize> {
    if !dense_tma_shapes(rows, cols, gs) || !(1..=MAX_SEQS).contains(&n) || sms == 0 {
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
    if rows < 16 || rows % 16 != 0 || cols % 256 != 0 || !(1..=MAX_SEQS).contains(&n) {
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
            for n in 1..=MAX_SEQS {
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
