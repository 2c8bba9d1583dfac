//! Per-sequence device state, the decode step (all layers, one token), its CUDA graph, and the device model
//! handle (the engine's backend over it is in backend.rs).

use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::{sys, CudaGraph, CudaSlice};
use tern_model::{Config, Weights};

use crate::gpu::Gpu;
use crate::model::{DMixer, DeviceModel};
use crate::pool::{Layout, SeqMem, StateBuf};

/// A layer's state, inside the sequence's pages ([`crate::pool`]): K and V rows `[room, nkv, hd]` bf16 (an
/// attention layer) or the conv ring and recurrent state f32 (a Gated DeltaNet layer).
pub enum LState {
    Attn { k: StateBuf<u16>, v: StateBuf<u16> },
    Gdn { ring: StateBuf<f32>, s: StateBuf<f32> },
}

/// One sequence on the device: position counter, input/output token, scratch activations, and its state in the
/// pool's pages (`mem`; `layers` points into it).
pub struct DeviceState {
    /// The context the sequence's address range has room for (and its attention splits are sized by).
    pub max_ctx: usize,
    /// Positions whose K/V pages are mapped: the most tokens this sequence may hold (its reservation).
    pub room: usize,
    pub nsplit: usize,
    /// Tokens read so far (mirrors the device counter).
    pub len: usize,
    pub pos: CudaSlice<i32>,
    pub tok: CudaSlice<i32>,
    pub x: CudaSlice<f32>,
    pub proj: CudaSlice<f32>,
    pub o: CudaSlice<f32>,
    pub qbuf: CudaSlice<f32>,
    pub part: CudaSlice<f32>,
    pub act: CudaSlice<f32>,
    pub router: CudaSlice<f32>,
    pub idx: CudaSlice<i32>,
    pub wts: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    pub apv: CudaSlice<f32>,
    pub api: CudaSlice<i32>,
    /// [0]: completion counter of the fused router + top-k kernel (zero between launches); [32]: the router's
    /// ready flag for moe_gate_up (cleared by moe_down).
    pub counter: CudaSlice<u32>,
    pub layers: Vec<LState>,
    /// The MTP block's K and V rows, when the model has one (read one position behind nothing: the block's row at
    /// position p pairs the main model's hidden state at p with the token at p + 1).
    pub mtp: Option<LState>,
    /// The device position counter `pos` is behind `len` (a batched step advanced the sequence without it): the
    /// batch-1 graph writes it before its next step.
    pub pos_stale: bool,
    /// Test hook: when set (before the first step, which captures the graph), every step copies each layer's
    /// `idx` (the k routed experts + the shared one) here, `[layers, k + 1]`.
    pub route_log: Option<CudaSlice<i32>>,
    graph: Option<CudaGraph>,
    /// The pages behind `layers` (after `graph` and `layers`: dropped last, once nothing refers to them).
    pub mem: SeqMem,
}

/// Per-op timings of one non-graph step, by kernel family (ms).
#[derive(Default, Debug, Clone)]
pub struct Profile {
    pub ops: Vec<(String, f64, usize)>,
}

impl Profile {
    pub fn add(&mut self, name: &str, ms: f64) {
        match self.ops.iter_mut().find(|o| o.0 == name) {
            Some(o) => {
                o.1 += ms;
                o.2 += 1
            }
            None => self.ops.push((name.to_string(), ms, 1)),
        }
    }

    /// Add the time between each event and the next to the family named at the first (an empty name: a closing
    /// event, not a family).
    pub fn add_events(&mut self, events: &[(&'static str, cudarc::driver::CudaEvent)]) -> anyhow::Result<()> {
        for w in events.windows(2) {
            let ((name, a), (_, b)) = (&w[0], &w[1]);
            if !name.is_empty() {
                self.add(name, a.elapsed_ms(b)? as f64);
            }
        }
        Ok(())
    }
}

/// Element counts of one sequence's device buffers at a capacity of `max_ctx` tokens: what [`DeviceState::new`]
/// allocates, and what [`DeviceState::bytes_at`] adds up without allocating.
struct StateLens {
    /// Conv ring and recurrent state of one Gated DeltaNet layer, f32.
    ring: usize,
    s: usize,
    nsplit: usize,
    h: usize,
    proj: usize,
    o: usize,
    qbuf: usize,
    part: usize,
    act: usize,
    router: usize,
    k1: usize,
    logits: usize,
    nb: usize,
}

impl StateLens {
    fn of(m: &DeviceModel, max_ctx: usize) -> StateLens {
        let c = &m.config;
        let proj = (m.layers.iter())
            .map(|l| match &l.mixer {
                DMixer::Attn { qkv, .. } => qkv.rows,
                DMixer::Gdn { proj, .. } => proj.rows,
            })
            .max()
            .unwrap_or(0);
        // flash-decoding splits: at most 128 per kv head, so that the long-context grid (2 kv heads x 128 splits)
        // is one wave of attn_decode_kv (2 blocks per SM at 231 registers; 256 splits took two waves: 497 vs 527
        // tok/s at ctx 32,768); short contexts use fewer (at least 16 keys per split, the rest empty)
        let nsplit = (max_ctx / 16).clamp(1, 128);
        StateLens {
            ring: c.linear_conv_kernel_dim * c.linear_conv_dim(),
            s: c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim,
            nsplit,
            h: c.hidden_size,
            proj,
            o: (c.num_attention_heads * c.head_dim).max(c.linear_value_dim()),
            qbuf: c.num_attention_heads * c.head_dim,
            part: c.num_attention_heads * nsplit * (c.head_dim + 2),
            act: (c.num_experts_per_tok + 1) * c.moe_intermediate_size.max(c.shared_expert_intermediate_size),
            router: c.num_experts + 1,
            k1: c.num_experts_per_tok + 1,
            logits: c.vocab_size,
            nb: m.gpu.argmax_blocks(),
        }
    }

    fn step_bytes(&self) -> usize {
        let f32s = self.h + self.proj + self.o + self.qbuf + self.part + self.act + self.router + self.k1;
        let i32s = 1 + 1 + self.k1 + self.nb;
        4 * (f32s + self.logits + self.nb + i32s + crate::gpu::MOE_COUNTER_LEN)
    }
}

/// One sequence's device memory by part (see [`DeviceState::bytes_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateBytes {
    /// The attention layers' K and V pages.
    pub kv: usize,
    /// The Gated DeltaNet layers' conv rings and recurrent states (whole pages).
    pub gdn: usize,
    /// The step's own activations, logits and counters (outside the pool).
    pub step: usize,
}

impl StateBytes {
    pub fn total(&self) -> usize {
        self.kv + self.gdn + self.step
    }
}

impl DeviceState {
    /// Per layer of `m`, this sequence's state as the pass tables hold it: the GDN conv ring and recurrent state, or
    /// the attention K and V caches ([`crate::workspace::PassTables::set_states`]).
    pub(crate) fn layer_ptrs(&self, m: &DeviceModel) -> Result<Vec<(u64, u64)>> {
        ensure!(self.layers.len() == m.layers.len(), "a sequence of another model");
        m.layers
            .iter()
            .zip(&self.layers)
            .enumerate()
            .map(|(li, (l, ls))| match (&l.mixer, ls) {
                (DMixer::Gdn { .. }, LState::Gdn { ring, s }) => Ok((ring.ptr, s.ptr)),
                (DMixer::Attn { .. }, LState::Attn { k, v }) => Ok((k.ptr, v.ptr)),
                _ => bail!("layer {li}: state does not match the model's layer kind"),
            })
            .collect()
    }
}

impl DeviceState {
    /// Where a sequence of capacity `max_ctx` keeps its state in its pages.
    pub fn layout(m: &DeviceModel, max_ctx: usize) -> Layout {
        let n = StateLens::of(m, max_ctx);
        let c = &m.config;
        let attn = m.layers.iter().filter(|l| matches!(l.mixer, DMixer::Attn { .. })).count();
        let row = c.num_key_value_heads * c.head_dim * 2;
        let gdn = m.layers.len() - attn;
        // the MTP block's K/V: one more attention region, after the main layers'
        Layout::new(m.pool.page_bytes(), gdn, (n.ring, n.s), attn + m.mtp.is_some() as usize, row, max_ctx)
    }

    /// The device memory a sequence with room for `tokens` takes (of capacity `max_ctx`): the pages it maps and
    /// its step buffers, added up without allocating ([`DeviceState::bytes`] of a new one is the same total).
    pub fn bytes_at(m: &DeviceModel, max_ctx: usize, tokens: usize) -> StateBytes {
        let l = DeviceState::layout(m, max_ctx);
        StateBytes {
            kv: 2 * l.kv.len() * l.region_pages_for(tokens) * l.page,
            gdn: l.gdn_pages * l.page,
            step: StateLens::of(m, max_ctx).step_bytes(),
        }
    }

    /// The device memory this sequence maps and holds (pages shared with a fork's source or a snapshot counted
    /// in full).
    pub fn bytes(&self) -> usize {
        let f32s = [&self.x, &self.proj, &self.o, &self.qbuf, &self.part, &self.act, &self.router, &self.wts];
        let f32s = f32s.iter().chain([&&self.logits, &&self.apv]).map(|b| b.num_bytes()).sum::<usize>();
        let i32s = [&self.pos, &self.tok, &self.idx, &self.api].iter().map(|b| b.num_bytes()).sum::<usize>();
        self.mem.mapped_pages() * self.mem.layout.page + f32s + i32s + self.counter.num_bytes()
    }

    /// A sequence of capacity `max_ctx` with room for all of it (tests, benchmarks).
    pub fn new(m: &DeviceModel, max_ctx: usize) -> Result<DeviceState> {
        DeviceState::with_room(m, max_ctx, max_ctx)
    }

    /// A new sequence of capacity `max_ctx` whose pages hold `tokens` (at most `max_ctx`) positions; the pool's
    /// [`crate::pool::PoolFull`] when it has no room for them.
    pub fn with_room(m: &DeviceModel, max_ctx: usize, tokens: usize) -> Result<DeviceState> {
        let mem = SeqMem::new(&m.pool, &m.gpu.stream, DeviceState::layout(m, max_ctx), tokens.min(max_ctx))?;
        DeviceState::around(m, mem, 0)
    }

    /// The state of a sequence holding `len` tokens in `mem`: its layer buffers, and fresh step buffers.
    fn around(m: &DeviceModel, mem: SeqMem, len: usize) -> Result<DeviceState> {
        let g = &*m.gpu;
        let max_ctx = mem.layout.capacity;
        let n = StateLens::of(m, max_ctx);
        let room = mem.room();
        let c = &m.config;
        let kv = room * c.num_key_value_heads * c.head_dim;
        let (mut gi, mut ai) = (0, 0);
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in &m.layers {
            layers.push(match &l.mixer {
                DMixer::Attn { .. } => {
                    let (k, v) = *mem.layout.kv.get(ai).context("layout: attention layers")?;
                    ai += 1;
                    LState::Attn { k: mem.buf(k, kv), v: mem.buf(v, kv) }
                }
                DMixer::Gdn { .. } => {
                    let (r, s) = *mem.layout.gdn.get(gi).context("layout: GDN layers")?;
                    gi += 1;
                    LState::Gdn { ring: mem.buf(r, n.ring), s: mem.buf(s, n.s) }
                }
            });
        }
        let mtp = match &m.mtp {
            Some(_) => {
                let (k, v) = *mem.layout.kv.get(ai).context("layout: the MTP block's K/V")?;
                Some(LState::Attn { k: mem.buf(k, kv), v: mem.buf(v, kv) })
            }
            None => None,
        };
        Ok(DeviceState {
            max_ctx,
            room,
            nsplit: n.nsplit,
            len,
            pos: g.zeros(1)?,
            tok: g.zeros(1)?,
            x: g.zeros(n.h)?,
            proj: g.zeros(n.proj)?,
            o: g.zeros(n.o)?,
            qbuf: g.zeros(n.qbuf)?,
            part: g.zeros(n.part)?,
            act: g.zeros(n.act)?,
            router: g.zeros(n.router)?,
            idx: g.zeros(n.k1)?,
            wts: g.zeros(n.k1)?,
            logits: g.zeros(n.logits)?,
            apv: g.zeros(n.nb)?,
            api: g.zeros(n.nb)?,
            counter: g.zeros(crate::gpu::MOE_COUNTER_LEN)?,
            layers,
            mtp,
            pos_stale: false,
            route_log: None,
            graph: None,
            mem,
        })
    }

    /// An independent copy with room for `tokens` (at least what it holds): full K/V pages shared, the rest of
    /// the state copied ([`SeqMem::fork`]); the step buffers' contents copied too (the graph is not: it binds
    /// this state's buffers).
    pub fn fork(&self, m: &DeviceModel, tokens: usize) -> Result<DeviceState> {
        let g = &*m.gpu;
        let mem = SeqMem::fork(&self.mem, self.len, tokens.max(self.len).min(self.max_ctx))?;
        let mut st = DeviceState::around(m, mem, self.len)?;
        let s = &g.stream;
        for (to, from) in [
            (&mut st.x, &self.x),
            (&mut st.proj, &self.proj),
            (&mut st.o, &self.o),
            (&mut st.qbuf, &self.qbuf),
            (&mut st.part, &self.part),
            (&mut st.act, &self.act),
            (&mut st.router, &self.router),
            (&mut st.wts, &self.wts),
            (&mut st.logits, &self.logits),
            (&mut st.apv, &self.apv),
        ] {
            s.memcpy_dtod(from, to)?;
        }
        for (to, from) in
            [(&mut st.pos, &self.pos), (&mut st.tok, &self.tok), (&mut st.idx, &self.idx), (&mut st.api, &self.api)]
        {
            s.memcpy_dtod(from, to)?;
        }
        st.pos_stale = self.pos_stale;
        Ok(st)
    }

    /// Enqueue one decode step: the ops of [`step_plan`] in order (embed tok, 40 layers, final norm + lm_head into
    /// `logits`, tok = argmax, pos += 1). With `prof`, every op is bracketed by events (no graph).
    pub fn enqueue_step(&mut self, m: &DeviceModel, mut prof: Option<&mut Profile>) -> Result<()> {
        let g = &*m.gpu;
        let (k, e) = (m.config.num_experts_per_tok, m.config.num_experts);
        ensure!(m.layers.iter().all(|l| l.router.rows == e + 1), "router rows != num_experts + 1");
        ensure!(
            m.config.layer_types.len() == m.layers.len() && self.layers.len() == m.layers.len(),
            "the step's layers: {} kinds, {} on the device, {} states",
            m.config.layer_types.len(),
            m.layers.len(),
            self.layers.len()
        );
        for op in step_plan(&m.config) {
            match prof.as_deref_mut() {
                None => self.launch_op(m, op)?,
                Some(p) => {
                    let fl = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
                    let a = g.stream.record_event(fl)?;
                    self.launch_op(m, op)?;
                    let b = g.stream.record_event(fl)?;
                    p.add(op.name(), a.elapsed_ms(&b)? as f64);
                }
            }
            if let (StepOp::RouterTopk(li), Some(log)) = (op, self.route_log.as_mut()) {
                g.stream.memcpy_dtod(&self.idx.slice(..k + 1), &mut log.slice_mut(li * (k + 1)..(li + 1) * (k + 1)))?;
            }
        }
        Ok(())
    }

    /// Launch one op of the decode step on this state (the step's kernels, one place: [`enqueue_step`] and the
    /// bench's per-kernel timings both launch through here).
    ///
    /// [`enqueue_step`]: DeviceState::enqueue_step
    pub fn launch_op(&mut self, m: &DeviceModel, op: StepOp) -> Result<()> {
        let (g, c) = (&*m.gpu, &m.config);
        let eps = c.rms_norm_eps;
        let (k, e) = (c.num_experts_per_tok, c.num_experts);
        let sizes = (c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let st = self;
        let layer = |li: usize| m.layers.get(li).with_context(|| format!("step op {op:?}: no layer {li}"));
        match op {
            StepOp::Embed => g.embed(&m.embed, &st.tok, &mut st.x),
            StepOp::LmHead => g.gemv(&m.lm_head, &st.x, Some(&m.norm), eps, &mut st.logits, 0, false),
            StepOp::Argmax => g.argmax(&st.logits, &mut st.apv, &mut st.api, &mut st.tok, &mut st.pos),
            StepOp::RouterTopk(li) => {
                let l = layer(li)?;
                g.router_topk(
                    &l.router,
                    &st.x,
                    &l.post_norm,
                    eps,
                    k,
                    &mut st.router,
                    &mut st.counter,
                    &mut st.idx,
                    &mut st.wts,
                )
            }
            StepOp::GateUp(li) => {
                let l = layer(li)?;
                g.moe_gate_up(&l.gate_up, e, k, sizes, &st.x, &l.post_norm, eps, &mut st.act, &st.counter)
            }
            StepOp::Down(li) => {
                let l = layer(li)?;
                g.moe_down(&l.down, e, &st.wts, k, sizes, &st.act, &mut st.x, &mut st.counter)
            }
            StepOp::GdnInProj(li) | StepOp::GdnCore(li) | StepOp::GdnOutProj(li) => {
                let l = layer(li)?;
                let ls = st.layers.get_mut(li).with_context(|| format!("step op {op:?}: no state"))?;
                let (DMixer::Gdn { proj, out, conv, a_log, dt_bias, norm }, LState::Gdn { ring, s }) = (&l.mixer, ls)
                else {
                    anyhow::bail!("step op {op:?}: layer {li} is not a Gated DeltaNet layer");
                };
                match op {
                    StepOp::GdnInProj(_) => g.gemv(proj, &st.x, Some(&l.in_norm), eps, &mut st.proj, 0, false),
                    StepOp::GdnCore(_) => {
                        let dims = (
                            c.linear_num_key_heads,
                            c.linear_num_value_heads,
                            c.linear_key_head_dim,
                            c.linear_value_head_dim,
                            c.linear_conv_kernel_dim,
                        );
                        g.gdn_step(&st.proj, conv, ring, a_log, dt_bias, s, &mut st.o, &st.pos, norm, eps, dims)
                    }
                    _ => g.gemv(out, &st.o, None, eps, &mut st.x, 0, true),
                }
            }
            StepOp::AttnQkv(li)
            | StepOp::AttnPrep(li)
            | StepOp::AttnDecode(li)
            | StepOp::AttnCombine(li)
            | StepOp::AttnOProj(li) => {
                let l = layer(li)?;
                let ls = st.layers.get_mut(li).with_context(|| format!("step op {op:?}: no state"))?;
                let (DMixer::Attn { qkv, o, qn, kn }, LState::Attn { k: kc, v: vc }) = (&l.mixer, ls) else {
                    anyhow::bail!("step op {op:?}: layer {li} is not an attention layer");
                };
                let ns = st.nsplit;
                match op {
                    StepOp::AttnQkv(_) => g.gemv(qkv, &st.x, Some(&l.in_norm), eps, &mut st.proj, 0, false),
                    StepOp::AttnPrep(_) => g.attn_prep(
                        &st.proj,
                        qn,
                        kn,
                        &st.pos,
                        (nh, nkv, hd, c.rotary_dim),
                        c.rope_theta as f32,
                        eps,
                        &mut st.qbuf,
                        kc,
                        vc,
                    ),
                    StepOp::AttnDecode(_) => g.attn_decode(&st.qbuf, kc, vc, &st.pos, (nh, nkv, hd), ns, &mut st.part),
                    StepOp::AttnCombine(_) => g.attn_combine(&st.part, &st.proj, nh, hd, ns, &mut st.o),
                    _ => g.gemv(o, &st.o, None, eps, &mut st.x, 0, true),
                }
            }
        }
    }

    /// Capture the step in a CUDA graph (once) and replay it.
    pub fn step_graph(&mut self, m: &DeviceModel) -> Result<()> {
        ensure!(self.len < self.room, "context full: the sequence has room for {} tokens (its reservation)", self.room);
        self.sync_pos(&m.gpu)?;
        if self.graph.is_none() {
            let s = m.gpu.stream.clone();
            s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let r = self.enqueue_step(m, None);
            let graph = s.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            r?;
            self.graph = Some(graph?.context("empty graph")?);
        }
        self.graph.as_ref().context("the step graph")?.launch()?;
        self.len += 1;
        Ok(())
    }

    /// One step without a graph (optionally profiled).
    pub fn step_plain(&mut self, m: &DeviceModel, prof: Option<&mut Profile>) -> Result<()> {
        ensure!(self.len < self.room, "context full: the sequence has room for {} tokens (its reservation)", self.room);
        self.sync_pos(&m.gpu)?;
        self.enqueue_step(m, prof)?;
        self.len += 1;
        Ok(())
    }

    /// Bring the device position counter up to `len` if a batched step left it behind.
    fn sync_pos(&mut self, g: &Gpu) -> Result<()> {
        if self.pos_stale {
            g.stream.memcpy_htod(&[self.len as i32], &mut self.pos)?;
            self.pos_stale = false;
        }
        Ok(())
    }

    pub fn set_token(&mut self, g: &Gpu, id: u32) -> Result<()> {
        g.stream.memcpy_htod(&[id as i32], &mut self.tok)?;
        Ok(())
    }

    /// For benchmarks: pretend `len` tokens were read (the KV cache content is whatever it holds).
    pub fn set_len(&mut self, g: &Gpu, len: usize) -> Result<()> {
        ensure!(len < self.room, "set_len: {len} >= room {}", self.room);
        g.stream.memcpy_htod(&[len as i32], &mut self.pos)?;
        self.len = len;
        self.pos_stale = false;
        Ok(())
    }

    /// Fill the KV caches with non-zero bf16 constants (benchmarks at long context: the attention kernels'
    /// cost does not depend on the values, but zeros are never timed).
    pub fn fill_kv(&mut self, g: &Gpu) -> Result<()> {
        for l in self.layers.iter_mut() {
            if let LState::Attn { k, v } = l {
                g.fill_bf16(k, 0.05)?;
                g.fill_bf16(v, 0.5)?;
            }
        }
        Ok(())
    }
}

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// KV-cache capacity of each sequence, in tokens.
    pub max_context: usize,
    /// Tokens one prefill pass reads at most (longer reads go in chunks of this many).
    pub prefill_chunk: usize,
    /// A step's items go through one forward pass ([`crate::DeviceModel::forward_seqs`]) when there are two or more;
    /// otherwise (or with this off: tests compare the two) each through its own batch-1 graph or prefill. Default: on.
    pub batched_decode: bool,
    /// Draws other than plain greedy run on the device ([`crate::sample`]): only the ids and asked-for logprobs
    /// cross to the host. Default: on (tests compare it with the host sampler).
    pub gpu_sampling: bool,
    /// Bytes of device memory for sequence state (the page pool: KV caches and recurrent states of running
    /// sequences and prefix-cache snapshots). `None`: what is free once the weights are up, less
    /// [`STATE_MEMORY_MARGIN`] (the prefill and batched-pass buffers, graphs and step buffers come from there).
    pub state_memory: Option<usize>,
    /// Speculative decoding with the model's MTP block, when it has one ([`tern_engine::Backend::max_drafts`]):
    /// every sequence keeps the block's K/V in step and every item goes through the one-forward pass. Default: off.
    pub speculative: bool,
}

/// Device memory left outside the state pool by default (see [`CudaOptions::state_memory`]).
pub const STATE_MEMORY_MARGIN: usize = 8 << 30;

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_context: 8192,
            prefill_chunk: crate::model::DEFAULT_PREFILL_CHUNK,
            batched_decode: true,
            gpu_sampling: true,
            state_memory: None,
            speculative: false,
        }
    }
}

impl CudaOptions {
    /// `max_context` tokens per sequence, the default prefill chunk.
    pub fn with_context(max_context: usize) -> CudaOptions {
        CudaOptions { max_context, ..CudaOptions::default() }
    }
}

pub struct CudaBackend {
    pub model: Arc<DeviceModel>,
    pub opts: CudaOptions,
}

impl CudaBackend {
    /// Upload loaded (quantised) weights to device 0.
    pub fn new(w: &Weights, opts: CudaOptions) -> Result<CudaBackend> {
        CudaBackend::new_with_progress(w, opts, &mut |_, _| {})
    }

    /// [`CudaBackend::new`] reporting `progress(layers done, layers)` (see [`DeviceModel::upload_with_progress`]).
    pub fn new_with_progress(
        w: &Weights,
        opts: CudaOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaBackend> {
        let gpu = Gpu::new()?;
        let model = DeviceModel::upload_with_progress(gpu, w, progress)?;
        CudaBackend::around(model, opts)
    }

    /// The backend over an uploaded model: its prefill chunk and its state pool's size set.
    fn around(model: DeviceModel, opts: CudaOptions) -> Result<CudaBackend> {
        model.set_prefill_chunk(opts.prefill_chunk)?;
        let bytes = match opts.state_memory {
            Some(b) => b,
            None => model.gpu.ctx.mem_get_info()?.0.saturating_sub(STATE_MEMORY_MARGIN),
        };
        model.pool.set_limit(bytes);
        Ok(CudaBackend { model: Arc::new(model), opts })
    }

    /// The full-shape model with random weights generated on the GPU (benchmarks; no disk).
    pub fn random(config: &Config, seed: u64, opts: CudaOptions) -> Result<CudaBackend> {
        let gpu = Gpu::new()?;
        let model = DeviceModel::random(gpu, config, seed)?;
        CudaBackend::around(model, opts)
    }

    /// A new sequence with room for the whole context.
    pub fn new_cuda_sequence(&self) -> Result<CudaSequence> {
        self.new_cuda_sequence_for(self.opts.max_context)
    }

    /// A new sequence with room for `tokens` (its pages mapped now; [`crate::pool::PoolFull`] without room).
    pub fn new_cuda_sequence_for(&self, tokens: usize) -> Result<CudaSequence> {
        let st = DeviceState::with_room(&self.model, self.opts.max_context, tokens)?;
        let mtp = (self.opts.speculative && self.model.mtp.is_some()).then(MtpSeq::default);
        Ok(CudaSequence { model: self.model.clone(), st, gpu_sampling: self.opts.gpu_sampling, mtp })
    }

    /// The most tokens one sequence could hold in the whole pool (its recurrent state included).
    pub fn tokens_that_fit(&self) -> usize {
        let l = DeviceState::layout(&self.model, self.opts.max_context);
        let pages = self.model.pool.limit_pages().saturating_sub(l.gdn_pages);
        let per_page = l.page / l.row.max(1);
        (pages / (2 * l.kv.len()).max(1) * per_page).min(self.opts.max_context)
    }
}

pub struct CudaSequence {
    pub model: Arc<DeviceModel>,
    pub st: DeviceState,
    /// [`CudaOptions::gpu_sampling`] of the backend that made it.
    pub gpu_sampling: bool,
    /// With speculative decoding: where the MTP block's K/V stands (`None`: not drafting for this sequence).
    pub mtp: Option<MtpSeq>,
}

/// The MTP block's side of a sequence: its K/V holds positions `0..len`, one fewer than the sequence once it has
/// read anything (the row of position p pairs the hidden state at p with the token at p + 1), and `pending` is the
/// main model's post-norm hidden state of the last position read, waiting for the token after it.
#[derive(Default)]
pub struct MtpSeq {
    pub len: usize,
    pub pending: Option<CudaSlice<f32>>,
}

// SAFETY: the CUDA graph inside DeviceState is only touched through `&mut self` (one thread at a time); device
// buffers and the context are Send in cudarc.
unsafe impl Send for CudaSequence {}

impl CudaSequence {
    /// Read `ids` (checked against the vocabulary first): one token through the decode graph, several through
    /// the multi-token prefill kernels (never the decode graph once per prompt token).
    pub fn read(&mut self, ids: &[u32]) -> Result<()> {
        let g = &self.model.gpu;
        let vocab = self.model.config.vocab_size;
        ensure!(!ids.is_empty(), "forward needs at least one token");
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            anyhow::bail!("token id {bad} is outside the vocabulary (size {vocab})");
        }
        if let [id] = ids {
            self.st.set_token(g, *id)?;
            self.st.step_graph(&self.model)?;
        } else {
            self.st.prefill(&self.model, ids, false, false)?;
        }
        Ok(())
    }

    /// Read `ids`; logits after the last one.
    pub fn forward_ids(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        self.read(ids)?;
        self.model.gpu.download(&self.st.logits)
    }
}

/// One op of the batch-1 decode step: the step as data. [`step_plan`] lists them in launch order; the CUDA graph's
/// capture, the per-family profile and `tern bench`'s per-kernel timings all launch from that list
/// ([`DeviceState::launch_op`]), so none of them re-types the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOp {
    Embed,
    GdnInProj(usize),
    GdnCore(usize),
    GdnOutProj(usize),
    AttnQkv(usize),
    AttnPrep(usize),
    AttnDecode(usize),
    AttnCombine(usize),
    AttnOProj(usize),
    RouterTopk(usize),
    GateUp(usize),
    Down(usize),
    LmHead,
    Argmax,
}

impl StepOp {
    /// The op's family, as the profile and the timings name it.
    pub fn name(self) -> &'static str {
        match self {
            StepOp::Embed => "embed",
            StepOp::GdnInProj(_) => "gdn_in_proj",
            StepOp::GdnCore(_) => "gdn_core",
            StepOp::GdnOutProj(_) => "gdn_out_proj",
            StepOp::AttnQkv(_) => "attn_qkv",
            StepOp::AttnPrep(_) => "attn_prep",
            StepOp::AttnDecode(_) => "attn_decode",
            StepOp::AttnCombine(_) => "attn_combine",
            StepOp::AttnOProj(_) => "attn_o_proj",
            StepOp::RouterTopk(_) => "moe_router_topk",
            StepOp::GateUp(_) => "moe_gate_up",
            StepOp::Down(_) => "moe_down",
            StepOp::LmHead => "lm_head",
            StepOp::Argmax => "argmax",
        }
    }

    /// The layer the op belongs to (none for the embedding, the lm_head and the argmax).
    pub fn layer(self) -> Option<usize> {
        match self {
            StepOp::Embed | StepOp::LmHead | StepOp::Argmax => None,
            StepOp::GdnInProj(l)
            | StepOp::GdnCore(l)
            | StepOp::GdnOutProj(l)
            | StepOp::AttnQkv(l)
            | StepOp::AttnPrep(l)
            | StepOp::AttnDecode(l)
            | StepOp::AttnCombine(l)
            | StepOp::AttnOProj(l)
            | StepOp::RouterTopk(l)
            | StepOp::GateUp(l)
            | StepOp::Down(l) => Some(l),
        }
    }
}

/// The batch-1 decode step's ops in launch order for a model of this config: the embedding, per layer its mixer
/// (Gated DeltaNet: in_proj, core, out_proj; attention: q|k|v, prep, decode, combine, o_proj) and its MoE (router +
/// top-k, gate|up, down), then the lm_head and the argmax.
pub fn step_plan(c: &Config) -> Vec<StepOp> {
    use tern_model::LayerKind;
    let mut ops = vec![StepOp::Embed];
    for (li, kind) in c.layer_types.iter().enumerate() {
        match kind {
            LayerKind::Linear => ops.extend([StepOp::GdnInProj(li), StepOp::GdnCore(li), StepOp::GdnOutProj(li)]),
            LayerKind::Full => ops.extend([
                StepOp::AttnQkv(li),
                StepOp::AttnPrep(li),
                StepOp::AttnDecode(li),
                StepOp::AttnCombine(li),
                StepOp::AttnOProj(li),
            ]),
        }
        ops.extend([StepOp::RouterTopk(li), StepOp::GateUp(li), StepOp::Down(li)]);
    }
    ops.extend([StepOp::LmHead, StepOp::Argmax]);
    ops
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_model::LayerKind;

    /// The plan holds every layer's ops once, in launch order, with the layer each belongs to.
    #[test]
    fn step_plan_lists_every_layers_ops_in_launch_order() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-b");
        let mut c = Config::from_dir(&dir).unwrap();
        c.layer_types = vec![LayerKind::Linear, LayerKind::Full, LayerKind::Linear];
        let plan = step_plan(&c);
        use StepOp::*;
        let want = vec![
            Embed,
            GdnInProj(0),
            GdnCore(0),
            GdnOutProj(0),
            RouterTopk(0),
            GateUp(0),
            Down(0),
            AttnQkv(1),
            AttnPrep(1),
            AttnDecode(1),
            AttnCombine(1),
            AttnOProj(1),
            RouterTopk(1),
            GateUp(1),
            Down(1),
            GdnInProj(2),
            GdnCore(2),
            GdnOutProj(2),
            RouterTopk(2),
            GateUp(2),
            Down(2),
            LmHead,
            Argmax,
        ];
        assert_eq!(plan, want);
        assert_eq!(plan.iter().filter(|o| o.layer().is_none()).count(), 3);
        assert_eq!(plan.iter().map(|o| o.name()).filter(|n| *n == "moe_gate_up").count(), 3);
        // the real model: 30 Gated DeltaNet and 10 attention layers
        c.layer_types = (0..40).map(|i| if i % 4 == 3 { LayerKind::Full } else { LayerKind::Linear }).collect();
        assert_eq!(step_plan(&c).len(), 1 + 30 * 6 + 10 * 8 + 2);
    }
}
