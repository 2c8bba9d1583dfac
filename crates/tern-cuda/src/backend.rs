//! The engine's [`Backend`] on CUDA: a slot table of [`DeviceState`]s whose KV caches and recurrent states live in
//! the model's page pool ([`crate::pool`]).
//!
//! A sequence maps, when it is made, the pages its reservation (prompt + completion) needs: 67 MB of recurrent
//! state and one 2 MiB page per 2,048 positions of each K and V region; its step buffers and its batch-1 CUDA
//! graph are its own. A fork shares the source's full K/V pages. With [`CudaOptions::batched_decode`] on, a step is
//! one forward pass over all its items ([`crate::DeviceModel::forward_seqs`], up to [`MAX_SEQS`] sequences): the
//! decodes' one-token rows and the prompt chunks (within the prefill chunk's tokens, which the engine's budget keeps
//! a step to) together, when there are two or more items; a lone item runs alone: one token through its batch-1
//! decode graph, a prompt chunk through the one-sequence prefill ([`CudaSequence::read`]). Plain greedy `Sample` work without logprobs takes the device argmax (4 bytes to
//! the host); other draws run on the device with [`CudaOptions::gpu_sampling`] (only the ids and asked-for logprobs
//! come back), else download the logits row and sample on the host with [`sample_host`]. Allocation and fork are
//! fallible: a pool without room is [`AllocError::Full`] (the engine waits or evicts cache snapshots) unless the
//! whole pool could never hold the sequence ([`AllocError::TooLarge`]); a context above `max_context` is `TooLarge`
//! at once.

use std::panic::{catch_unwind, AssertUnwindSafe};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{sys, CudaSlice, DriverError};
use tern_engine::backend::{check_item, panic_message, verify_host, Slots};
use tern_engine::{sample_host, AllocError, Backend, Output, Sample, Sampled, SeqId, StateMemory, Want, Work};

use crate::batch::MAX_SEQS;
use crate::forward::{Draw, ItemWant, PassHidden, RowOut, RowWant, MAX_VERIFY_ROWS};
use crate::model::DeviceModel;
use crate::pool::PoolFull;
use crate::sample::SampleBatch;
use crate::seq::{CudaBackend, CudaOptions, CudaSequence, DeviceState, MtpSeq};
use crate::workspace::pass_fits;

/// What a verify of K drafts costs one stream, in plain decode steps, at K = 0..=4: `tern bench --backend cuda
/// --model DIR --speculative K --ctx 256` on the constructed checkpoint at full acceptance (its verify step against
/// the batch-1 graph's 1.79 ms; stop 44, an H100, docs/perf.md). The engine pauses a request's drafting while its
/// accepted drafts do not pay for this ([`Backend::verify_cost`]); re-measure it when the verify path changes.
pub const VERIFY_COST: [f64; MAX_VERIFY_ROWS] = [1.0, 2.16, 2.54, 3.0, 3.52];

/// The CUDA backend behind the engine's seam (interim: one [`DeviceState`] per sequence, see the module doc).
pub struct CudaSlots {
    pub cuda: CudaBackend,
    slots: Slots<CudaSequence>,
}

impl CudaSlots {
    pub fn new(cuda: CudaBackend) -> CudaSlots {
        CudaSlots { cuda, slots: Slots::default() }
    }

    fn opts(&self) -> CudaOptions {
        self.cuda.opts
    }

    /// `AllocError` for a failed allocation: the pool without room for the sequence is "full" (wait: running
    /// sequences and cache snapshots give pages back) unless the whole pool could not hold it ("too large");
    /// the device out of memory for the step buffers is "full" while other sequences hold memory.
    fn no_room(&self, e: anyhow::Error, tokens: usize, others: bool) -> AllocError {
        let pool = &self.cuda.model.pool;
        if let Some(f) = e.downcast_ref::<PoolFull>() {
            let limit = pool.limit_pages().saturating_mul(pool.page_bytes());
            return if f.need > limit {
                AllocError::TooLarge { tokens, max_tokens: self.cuda.tokens_that_fit() }
            } else {
                AllocError::Full { need: f.need, free: f.free }
            };
        }
        let oom = e
            .chain()
            .any(|c| c.downcast_ref::<DriverError>().is_some_and(|d| d.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        match (oom, others) {
            (true, true) => {
                let free = self.cuda.model.gpu.ctx.mem_get_info().map_or(0, |(free, _)| free);
                let need = DeviceState::bytes_at(&self.cuda.model, self.opts().max_context, tokens).step;
                AllocError::Full { need, free }
            }
            (true, false) => AllocError::TooLarge { tokens, max_tokens: 0 },
            (false, _) => AllocError::Failed(format!("{e:#}")),
        }
    }

    fn check_tokens(&self, tokens: usize) -> Result<(), AllocError> {
        let max = self.opts().max_context;
        if tokens > max {
            return Err(AllocError::TooLarge { tokens, max_tokens: max });
        }
        Ok(())
    }

    fn insert(&self, seq: Result<CudaSequence>, tokens: usize) -> Result<SeqId, AllocError> {
        let mut t = self.slots.lock();
        let others = !t.is_empty();
        match seq {
            Ok(s) => {
                let bytes = s.st.bytes();
                Ok(t.insert(s, tokens, bytes))
            }
            Err(e) => Err(self.no_room(e, tokens, others)),
        }
    }

    /// One item, alone, through the batch-1 graph.
    fn run(seq: &mut CudaSequence, w: &Work) -> Result<Output> {
        match &w.out {
            Want::Nothing => seq.read(w.ids).map(|()| Output::Nothing),
            Want::Last => seq.forward_ids(w.ids).map(Output::Logits),
            Want::All if w.ids.len() > 1 => {
                let model = seq.model.clone();
                seq.st.prefill(&model, w.ids, true, false).map(|o| Output::Logits(o.logits))
            }
            Want::All => seq.forward_ids(w.ids).map(Output::Logits),
            Want::Sample(s) if s.is_argmax() => {
                seq.read(w.ids)?;
                Ok(Output::Token(Sampled { token: device_argmax(seq, s.limit)?, logprob: None }))
            }
            Want::Sample(s) if seq.gpu_sampling => {
                seq.read(w.ids)?;
                let mut batch = SampleBatch::new(seq.model.config.vocab_size)?;
                batch.push(s, s.mask.map(|m| m.wait()).transpose()?.flatten())?;
                let g = &seq.model.gpu;
                let drawn = g.sample_logits(&mut seq.st.logits, &batch)?.pop();
                drawn.ok_or_else(|| anyhow!("the GPU sampler returned no row"))?.map(Output::Token)
            }
            Want::Sample(s) => {
                let mut logits = seq.forward_ids(w.ids)?;
                sample_host(&mut logits, s).map(Output::Token)
            }
            Want::Verify(_) => Err(anyhow!("a verify item outside a forward pass (it takes no batch-1 path)")),
        }
    }
}

/// The step's own argmax (over the whole vocabulary, on the device): 4 bytes cross to the host instead of the
/// logits; only if it lands at or past `limit` (a padded row beyond the tokenizer's ids) are the logits fetched.
fn device_argmax(seq: &CudaSequence, limit: usize) -> Result<u32> {
    let g = &seq.model.gpu;
    let limit = limit.clamp(1, seq.model.config.vocab_size);
    let t = g.download(&seq.st.tok)?.first().copied().ok_or_else(|| anyhow!("no argmax on the device"))? as usize;
    if t < limit {
        return Ok(t as u32);
    }
    let logits = g.download(&seq.st.logits)?;
    let l = &logits[..limit.min(logits.len())];
    Ok(l.iter().enumerate().fold(0, |b, (i, &v)| if v > l[b] { i } else { b }) as u32)
}

impl Backend for CudaSlots {
    fn name(&self) -> &str {
        "cuda"
    }

    fn vocab_size(&self) -> usize {
        self.cuda.model.config.vocab_size
    }

    fn alloc(&self, tokens: usize) -> Result<SeqId, AllocError> {
        self.check_tokens(tokens)?;
        self.insert(self.cuda.new_cuda_sequence_for(tokens), tokens)
    }

    fn fork(&self, seq: SeqId, tokens: usize) -> Result<SeqId, AllocError> {
        self.check_tokens(tokens)?;
        let copy = {
            let t = self.slots.lock();
            let s = t.get(seq).and_then(|s| s.state.as_ref()).ok_or(AllocError::Unknown(seq))?;
            let stream = &self.cuda.model.gpu.stream;
            let mtp = |m: &MtpSeq| -> Result<MtpSeq> {
                Ok(MtpSeq { len: m.len, pending: m.pending.as_ref().map(|p| stream.clone_dtod(p)).transpose()? })
            };
            s.st.fork(&self.cuda.model, tokens).and_then(|st| {
                let mtp = s.mtp.as_ref().map(mtp).transpose()?;
                Ok(CudaSequence { model: s.model.clone(), st, gpu_sampling: s.gpu_sampling, mtp })
            })
        };
        let len = self.len(seq).unwrap_or(0);
        self.insert(copy, tokens.max(len))
    }

    fn free(&self, seq: SeqId) {
        let slot = self.slots.lock().remove(seq);
        drop(slot); // device memory released outside the lock
    }

    fn len(&self, seq: SeqId) -> Option<usize> {
        self.slots.lock().get(seq)?.state.as_ref().map(|s| s.st.len)
    }

    fn state_bytes(&self, seq: SeqId) -> usize {
        self.slots.lock().get(seq).map_or(0, |s| s.bytes)
    }

    fn state_memory(&self) -> Option<StateMemory> {
        let pool = &self.cuda.model.pool;
        let page = pool.page_bytes();
        Some(StateMemory { used: pool.used_pages() * page, limit: Some(pool.limit_pages().saturating_mul(page)) })
    }

    /// The prefill chunk: a prompt of up to that many tokens is read in one pass (a 4k prompt in ~0.2 s on an H200),
    /// and running streams wait at most one such pass between two tokens.
    fn step_tokens(&self) -> usize {
        self.cuda.model.prefill.lock().map_or(crate::model::DEFAULT_PREFILL_CHUNK, |p| p.chunk)
    }

    /// [`VERIFY_COST`]: measured, one stream.
    fn verify_cost(&self, drafts: usize) -> Option<f64> {
        VERIFY_COST.get(drafts).copied()
    }

    /// With speculative decoding on and a model with an MTP block: 4 (a verify of 5 rows).
    fn max_drafts(&self) -> usize {
        match self.speculative() {
            true => MAX_VERIFY_ROWS - 1,
            false => 0,
        }
    }

    /// One forward pass's sequences ([`MAX_SEQS`]): with batched decode on, a step of that many decodes is one pass.
    fn max_seqs(&self) -> usize {
        match self.opts().batched_decode {
            true => MAX_SEQS,
            false => 64,
        }
    }

    fn step(&self, work: &[Work]) -> Vec<Result<Output>> {
        let vocab = self.vocab_size();
        let taken = self.slots.lock().take(work);
        // each item's sequence (back into the table at the end, whatever happens) and the shared checks' verdict
        let mut items: Vec<Option<CudaSequence>> = Vec::with_capacity(work.len());
        let mut out: Vec<Option<Result<Output>>> = Vec::with_capacity(work.len());
        for (w, got) in work.iter().zip(taken) {
            match got {
                Ok((seq, reserved)) => {
                    let checked = check_item(w, vocab, seq.st.len, reserved).and_then(|()| self.check_verify(w));
                    out.push(checked.err().map(Err));
                    items.push(Some(seq));
                }
                Err(e) => {
                    out.push(Some(Err(e)));
                    items.push(None);
                }
            }
        }
        let spec = self.speculative();
        if self.opts().batched_decode || spec {
            // one forward pass over the step's decodes and prompt chunks together (not items asking for every
            // position's logits), when there are two or more (with speculative decoding, one too: the MTP block
            // reads the pass's hidden states); prompt chunks past one pass's buffers in more passes
            let rows: Vec<PassItem> = (0..work.len())
                .filter(|&i| out[i].is_none() && !(work[i].ids.len() > 1 && matches!(work[i].out, Want::All)))
                .map(|i| {
                    let k = work[i].ids.len();
                    match &work[i].out {
                        Want::Verify(v) if v.draws.len() > 1 => PassItem { i, prompt: 0, rows: k },
                        _ if k > 1 => PassItem { i, prompt: k, rows: 1 },
                        _ => PassItem { i, prompt: 0, rows: 1 },
                    }
                })
                .collect();
            for group in step_passes(&rows, self.step_tokens(), if spec { 1 } else { 2 }) {
                let results = Self::run_batch(&self.cuda, work, &mut items, &group);
                for (&i, r) in group.iter().zip(results) {
                    out[i] = Some(r);
                }
            }
        }
        // everything else one by one (a panic in one fails that item only)
        for (i, w) in work.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let r = match items[i].as_mut() {
                Some(seq) => catch_unwind(AssertUnwindSafe(|| {
                    seq.mtp = None; // read outside the pass: the MTP block can no longer follow (no more drafts)
                    Self::run(seq, w)
                }))
                .unwrap_or_else(|p| Err(anyhow!("internal error on the GPU: {}", panic_message(&*p)))),
                None => Err(anyhow!("the state of {} is not available", w.seq)),
            };
            out[i] = Some(r);
        }
        let mut t = self.slots.lock();
        for (w, seq) in work.iter().zip(items) {
            if let Some(seq) = seq {
                t.put(w.seq, seq);
            }
        }
        drop(t);
        out.into_iter().map(|o| o.unwrap_or_else(|| Err(anyhow!("step item left without a result")))).collect()
    }
}

/// One item of a step as [`step_passes`] packs it: its index, its prompt rows (a prompt chunk; 0 for a decode or a
/// verify) and the logits rows it takes (1, or a verify's rows).
#[derive(Clone, Copy)]
struct PassItem {
    i: usize,
    prompt: usize,
    rows: usize,
}

/// The forward passes of a step's items, in order: every decode row, verify and the prompt chunks that [`pass_fits`]
/// the buffers of a `chunk`-row prefill beside the passes' rows, at most [`MAX_SEQS`] logits rows (items, and a
/// verify's every row) a pass; the engine's budget makes that one pass a step. A chunk that fits no pass by itself
/// is left out (it runs alone), and so is a pass of fewer than `min_items` items (2: the batch-1 paths, the decode
/// graph and the one-sequence prefill, take one).
fn step_passes(items: &[PassItem], chunk: usize, min_items: usize) -> Vec<Vec<usize>> {
    struct Pass {
        items: Vec<usize>,
        chunks: Vec<usize>,
        rows: usize,
    }
    let mut passes: Vec<Pass> = Vec::new();
    for it in items {
        if it.prompt > 0 && !pass_fits(chunk, [it.prompt]) {
            continue;
        }
        let fits = |p: &Pass| {
            p.rows + it.rows <= MAX_SEQS
                && (it.prompt == 0 || pass_fits(chunk, p.chunks.iter().copied().chain([it.prompt])))
        };
        let p = match passes.iter().position(fits) {
            Some(p) => p,
            None => {
                passes.push(Pass { items: Vec::new(), chunks: Vec::new(), rows: 0 });
                passes.len() - 1
            }
        };
        passes[p].items.push(it.i);
        passes[p].rows += it.rows;
        if it.prompt > 0 {
            passes[p].chunks.push(it.prompt);
        }
    }
    passes
        .into_iter()
        .map(|mut p| {
            p.items.sort_unstable();
            p.items
        })
        .filter(|g| g.len() >= min_items)
        .collect()
}

impl CudaSlots {
    /// Speculative decoding: asked for, and the model has an MTP block.
    fn speculative(&self) -> bool {
        self.opts().speculative && self.cuda.model.mtp.is_some()
    }

    /// A verify item's shape: speculative decoding on, draws over its last row (a prompt's last chunk, or a token
    /// without drafts) or over every row (a token and its drafts, at most [`MAX_VERIFY_ROWS`]).
    fn check_verify(&self, w: &Work) -> Result<()> {
        let Want::Verify(v) = &w.out else { return Ok(()) };
        if !self.speculative() {
            bail!("speculative decoding is off on this backend (a model without an MTP block, or not asked for)");
        }
        let rows = v.draws.len();
        if !(rows == 1 || rows == w.ids.len()) || rows > MAX_VERIFY_ROWS {
            bail!(
                "a verify item draws {rows} rows of {} ids (its last row, or all of at most {MAX_VERIFY_ROWS})",
                w.ids.len()
            );
        }
        if v.drafts > MAX_VERIFY_ROWS - 1 {
            bail!("{} drafts asked for; this backend drafts at most {}", v.drafts, MAX_VERIFY_ROWS - 1);
        }
        Ok(())
    }

    /// The items `group` (indices into `work`, ascending, at most [`MAX_SEQS`]: decode rows, prompt chunks within
    /// the prefill chunk, speculative verifies) in one forward pass: every item gets its own result; a failed pass
    /// (or a panic inside it) fails them all. With speculative decoding, the MTP block then reads the rows each
    /// sequence kept and drafts for the verifies that ask ([`CudaSlots::mtp_step`]).
    fn run_batch(
        cuda: &CudaBackend,
        work: &[Work],
        items: &mut [Option<CudaSequence>],
        group: &[usize],
    ) -> Vec<Result<Output>> {
        let gpu_sampling = cuda.opts.gpu_sampling;
        fn row<'a>(s: &'a Sample<'a>, gpu_sampling: bool) -> RowWant<'a> {
            match () {
                _ if s.is_argmax() => RowWant { logits: false, draw: Draw::Argmax(s.limit) },
                _ if gpu_sampling => RowWant { logits: false, draw: Draw::Sample(s) },
                _ => RowWant { logits: true, draw: Draw::Nothing },
            }
        }
        let want: Vec<ItemWant> = group
            .iter()
            .map(|&i| match &work[i].out {
                Want::Nothing => ItemWant::Last(RowWant { logits: false, draw: Draw::Nothing }),
                Want::Last | Want::All => ItemWant::Last(RowWant { logits: true, draw: Draw::Nothing }),
                Want::Sample(s) => ItemWant::Last(row(s, gpu_sampling)),
                Want::Verify(v) if v.draws.len() == 1 => ItemWant::Last(row(&v.draws[0], gpu_sampling)),
                // greedy verifies compare the device's argmax with the drafts; others draw on the host
                Want::Verify(v) if v.draws.iter().all(|s| s.is_argmax()) => ItemWant::Verify(
                    v.draws.iter().map(|s| RowWant { logits: false, draw: Draw::Argmax(s.limit) }).collect(),
                ),
                Want::Verify(v) => {
                    ItemWant::Verify(v.draws.iter().map(|_| RowWant { logits: true, draw: Draw::Nothing }).collect())
                }
            })
            .collect();

        // the states in `group`'s order (ascending: the groups are cut from ascending item lists)
        debug_assert!(group.windows(2).all(|w| w[0] < w[1]), "batched items out of order");
        let mut seqs: Vec<&mut CudaSequence> = Vec::with_capacity(group.len());
        for (i, it) in items.iter_mut().enumerate() {
            if let (true, Some(seq)) = (group.contains(&i), it.as_mut()) {
                seqs.push(seq);
            }
        }
        if seqs.len() != group.len() {
            return group.iter().map(|_| Err(anyhow!("a batched step lost track of its sequences"))).collect();
        }
        let model = cuda.model.clone();
        let ids: Vec<&[u32]> = group.iter().map(|&i| work[i].ids).collect();
        let hidden_rows = seqs.iter().any(|s| s.mtp.is_some());
        // a verify's draws: the accepted drafts and the token after them (kept rows: as many)
        let mut verified: Vec<Option<Result<Vec<Sampled>>>> = (0..group.len()).map(|_| None).collect();
        let mut accept = |k: usize, rows: &[RowOut]| -> Result<usize> {
            let (w, drafts) = (&work[group[k]], &work[group[k]].ids[1..]);
            let Want::Verify(v) = &w.out else { bail!("a verify row for an item that is no verify") };
            let drawn = match rows.iter().all(|r| r.logits.is_none()) {
                true => {
                    let mut t = Vec::with_capacity(rows.len());
                    for (j, r) in rows.iter().enumerate() {
                        let s = match &r.token {
                            Some(Ok(s)) => s.clone(),
                            Some(Err(e)) => bail!("{e:#}"),
                            None => bail!("a verify row without its draw"),
                        };
                        let go_on = drafts.get(j) == Some(&s.token);
                        t.push(s);
                        if !go_on {
                            break;
                        }
                    }
                    Ok(t)
                }
                false => {
                    let mut l: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().flatten().copied()).collect();
                    verify_host(&mut l, v, drafts)
                }
            };
            let kept = drawn.as_ref().map_or(1, |t| t.len().clamp(1, rows.len()));
            verified[k] = Some(drawn);
            Ok(kept)
        };
        let result = {
            let mut states: Vec<&mut DeviceState> = seqs.iter_mut().map(|s| &mut s.st).collect();
            let run = || model.forward_items(&mut states, &ids, &want, None, None, true, hidden_rows, &mut accept);
            catch_unwind(AssertUnwindSafe(run))
                .unwrap_or_else(|p| Err(anyhow!("internal error on the GPU: {}", panic_message(&*p))))
        };
        let pass = match result {
            Err(e) => {
                let msg = format!("{e:#}");
                return group.iter().map(|_| Err(anyhow!("{msg}"))).collect();
            }
            Ok(p) => p,
        };
        let mut done: Vec<Result<Output>> = group
            .iter()
            .zip(pass.rows)
            .zip(verified.iter_mut())
            .map(|((&i, mut rows), verified)| {
                let last = rows.pop();
                let drawn = |row: Option<RowOut>, s: &Sample| match row.map(|r| (r.token, r.logits)) {
                    Some((Some(t), _)) => t,
                    Some((None, Some(mut l))) => sample_host(&mut l, s),
                    _ => Err(anyhow!("a batched step returned neither a token nor a logits row")),
                };
                match &work[i].out {
                    Want::Nothing => Ok(Output::Nothing),
                    Want::Sample(s) => drawn(last, s).map(Output::Token),
                    Want::Last | Want::All => match last.and_then(|r| r.logits) {
                        Some(l) => Ok(Output::Logits(l)),
                        None => Err(anyhow!("a batched step returned no logits row")),
                    },
                    Want::Verify(v) if v.draws.len() == 1 => {
                        drawn(last, &v.draws[0]).map(|t| Output::Drafted { tokens: vec![t], drafts: Vec::new() })
                    }
                    Want::Verify(_) => match verified.take() {
                        Some(Ok(tokens)) => Ok(Output::Drafted { tokens, drafts: Vec::new() }),
                        Some(Err(e)) => Err(e),
                        None => Err(anyhow!("a verify without its draws")),
                    },
                }
            })
            .collect();
        if let Some(hidden) = pass.hidden {
            Self::mtp_step(&model, work, group, &mut seqs, &hidden, &mut done);
        }
        done
    }

    /// The MTP side of a pass (the CPU backend's `mtp_step`, on the device): each sequence that drafts reads the
    /// rows `(hidden_p, id_{p+1})` of the positions whose next id it now knows (the pending hidden state of its last
    /// position, then the pass's rows it kept), its last kept row's hidden state becomes the pending one; then the
    /// verifies that ask chain their drafts (the block's argmax, fed its own output) after the token drawn. A
    /// sequence whose block fails stops drafting; its item keeps its result.
    fn mtp_step(
        model: &DeviceModel,
        work: &[Work],
        group: &[usize],
        seqs: &mut [&mut CudaSequence],
        hidden: &PassHidden,
        done: &mut [Result<Output>],
    ) {
        let (g, h) = (&*model.gpu, model.config.hidden_size);
        // the rows of what each sequence kept: (k, ids, the pass's first row, rows kept)
        let mut feeds: Vec<(usize, Vec<u32>, usize, usize)> = Vec::new();
        let mut failed: Vec<usize> = Vec::new();
        for (k, seq) in seqs.iter().enumerate() {
            let (w, Some(m)) = (&work[group[k]], seq.mtp.as_ref()) else { continue };
            let Ok(out) = &done[k] else {
                failed.push(k); // the pass read this item, its block did not: no more drafts for it
                continue;
            };
            let kept = match out {
                Output::Drafted { tokens, .. } if matches!(&w.out, Want::Verify(v) if v.draws.len() > 1) => {
                    tokens.len()
                }
                _ => w.ids.len(),
            };
            let ids = if m.pending.is_some() { w.ids[..kept].to_vec() } else { w.ids[1..kept].to_vec() };
            feeds.push((k, ids, hidden.first[k], kept));
        }
        let feed = (|| -> Result<()> {
            let rows: usize = feeds.iter().map(|f| f.1.len()).sum();
            if rows == 0 {
                return Ok(());
            }
            let mut hid = g.zeros::<f32>(rows * h)?;
            let mut r = 0;
            for (k, ids, first, kept) in &feeds {
                if ids.is_empty() {
                    continue;
                }
                let mut n = 0;
                if let Some(p) = seqs[*k].mtp.as_ref().and_then(|m| m.pending.as_ref()) {
                    g.stream.memcpy_dtod(p, &mut hid.slice_mut(r * h..(r + 1) * h))?;
                    n = 1;
                }
                let more = kept - 1;
                if more > 0 {
                    let src = hidden.rows.slice(first * h..(first + more) * h);
                    g.stream.memcpy_dtod(&src, &mut hid.slice_mut((r + n) * h..(r + n + more) * h))?;
                }
                r += ids.len();
            }
            let live: Vec<&(usize, Vec<u32>, usize, usize)> = feeds.iter().filter(|f| !f.1.is_empty()).collect();
            let states: Vec<&DeviceState> = live.iter().map(|f| &seqs[f.0].st).collect();
            let segs: Vec<(usize, usize)> =
                live.iter().map(|f| (f.1.len(), seqs[f.0].mtp.as_ref().map_or(0, |m| m.len))).collect();
            let ids: Vec<u32> = live.iter().flat_map(|f| f.1.iter().copied()).collect();
            model.mtp_rows(&states, &segs, &ids, &hid, (false, 0, false), None)?;
            Ok(())
        })();
        if let Err(e) = feed {
            eprintln!("tern: the MTP block failed ({e:#}); drafting stops for these sequences");
            failed.extend(feeds.iter().map(|f| f.0));
        }
        for (k, ids, first, kept) in &feeds {
            let Some(m) = seqs[*k].mtp.as_mut() else { continue };
            let row = hidden.rows.slice((first + kept - 1) * h..(first + kept) * h);
            match g.stream.clone_dtod(&row) {
                Ok(p) => {
                    m.len += ids.len();
                    m.pending = Some(p);
                }
                Err(_) => failed.push(*k),
            }
        }
        for k in failed {
            seqs[k].mtp = None;
        }
        // draft chains: (pending, the token drawn) -> d1, (its output, d1) -> d2, ...
        let mut chains: Vec<(usize, usize, u32, usize)> = Vec::new(); // (k, drafts, last id, limit)
        for (k, seq) in seqs.iter().enumerate() {
            let (Want::Verify(v), Some(m), Ok(Output::Drafted { tokens, .. })) =
                (&work[group[k]].out, seq.mtp.as_ref(), &done[k])
            else {
                continue;
            };
            if let (Some(last), Some(s), true) = (tokens.last(), v.draws.first(), m.pending.is_some()) {
                if v.drafts > 0 {
                    chains.push((k, v.drafts.min(MAX_VERIFY_ROWS - 1), last.token, s.limit));
                }
            }
        }
        let mut drafted: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
        let mut hid: Option<CudaSlice<f32>> = None;
        for r in 0..chains.iter().map(|c| c.1).max().unwrap_or(0) {
            let live: Vec<usize> = (0..chains.len()).filter(|&c| chains[c].1 > r).collect();
            let round = (|| -> Result<(Vec<u32>, CudaSlice<f32>)> {
                // this round's hidden rows: the pending states (round 0) or the last round's outputs of the chains
                // still going (they are a prefix of the last round's: chains are cut by their draft counts)
                let mut rows = g.zeros::<f32>(live.len() * h)?;
                for (j, &c) in live.iter().enumerate() {
                    let mut dst = rows.slice_mut(j * h..(j + 1) * h);
                    match (&hid, r) {
                        (_, 0) => {
                            let p = seqs[chains[c].0].mtp.as_ref().and_then(|m| m.pending.as_ref());
                            g.stream.memcpy_dtod(p.context("a draft chain without its pending state")?, &mut dst)?;
                        }
                        (Some(prev), _) => {
                            let at = chain_rank(&chains, r - 1, c);
                            g.stream.memcpy_dtod(&prev.slice(at * h..(at + 1) * h), &mut dst)?;
                        }
                        (None, _) => bail!("a draft round without the last one's outputs"),
                    }
                }
                let states: Vec<&DeviceState> = live.iter().map(|&c| &seqs[chains[c].0].st).collect();
                let segs: Vec<(usize, usize)> =
                    live.iter().map(|&c| (1, seqs[chains[c].0].mtp.as_ref().map_or(0, |m| m.len) + r)).collect();
                let ids: Vec<u32> = live.iter().map(|&c| chains[c].2).collect();
                let limit = live.iter().map(|&c| chains[c].3).min().unwrap_or(1);
                let out = model.mtp_rows(&states, &segs, &ids, &rows, (true, limit, false), None)?;
                Ok((out.argmax, out.hidden))
            })();
            let Ok((ids, out)) = round else { break }; // fewer drafts this step
            for (&c, d) in live.iter().zip(ids) {
                drafted[chains[c].0].push(d);
                chains[c].2 = d;
            }
            hid = Some(out);
        }
        for (k, d) in drafted.into_iter().enumerate() {
            if let Ok(Output::Drafted { drafts, .. }) = &mut done[k] {
                *drafts = d;
            }
        }
    }
}

/// The row of chain `c` among the chains live in round `r` (those with more than `r` drafts, in order).
fn chain_rank(chains: &[(usize, usize, u32, usize)], r: usize, c: usize) -> usize {
    chains[..c].iter().filter(|x| x.1 > r).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's items go into as few forward passes as fit: decode rows and prompt chunks together, prompt chunks
    /// within the rows and chunks of one prefill chunk, at most MAX_SEQS items a pass; chunks over the prefill chunk
    /// and passes of one item are left to run alone.
    fn step_passes2(items: &[(usize, usize)], chunk: usize) -> Vec<Vec<usize>> {
        let items: Vec<PassItem> =
            items.iter().map(|&(i, k)| PassItem { i, prompt: if k > 1 { k } else { 0 }, rows: 1 }).collect();
        step_passes(&items, chunk, 2)
    }

    /// A verify takes a logits row per row: 64 verifies of 5 rows fill a pass's MAX_SEQS rows at 51; with
    /// speculative decoding a lone item is a pass of its own.
    #[test]
    fn step_passes_count_a_verifys_rows() {
        let items: Vec<PassItem> = (0..64).map(|i| PassItem { i, prompt: 0, rows: 5 }).collect();
        let g = step_passes(&items, 4096, 1);
        assert_eq!(g.iter().map(Vec::len).collect::<Vec<_>>(), vec![MAX_SEQS / 5, 64 - MAX_SEQS / 5]);
        let one = [PassItem { i: 0, prompt: 300, rows: 1 }];
        assert_eq!(step_passes(&one, 4096, 1), vec![vec![0]]);
        assert!(step_passes(&one, 4096, 2).is_empty());
    }

    #[test]
    fn step_passes_mix_decodes_and_prompt_chunks() {
        let p = |lens: &[usize]| lens.iter().copied().enumerate().collect::<Vec<_>>();
        // decodes and chunks in one pass
        assert_eq!(step_passes2(&p(&[1, 1, 300, 1, 2000]), 4096), vec![vec![0, 1, 2, 3, 4]]);
        // 33 prompts of 80 rows: 32 fill a pass's 64 chunks of 64 rows, the 33rd is alone; a decode joins the first
        assert_eq!(step_passes2(&p(&[80; 33]), 4096), vec![(0..32).collect::<Vec<_>>()]);
        let mut lens = vec![80; 33];
        lens.push(1);
        assert_eq!(step_passes2(&p(&lens), 4096), vec![(0..32).chain([33]).collect::<Vec<_>>()]);
        // at most MAX_SEQS a pass
        let g = step_passes2(&p(&[1; 300]), 4096);
        assert_eq!(g.iter().map(Vec::len).collect::<Vec<_>>(), vec![MAX_SEQS, 300 - MAX_SEQS]);
        // a chunk over the prefill chunk is skipped; the rest still group around it
        assert_eq!(step_passes2(&p(&[3000, 5000, 1000, 64]), 4096), vec![vec![0, 2, 3]]);
        // rows: 3000 + 1000 fit, + 200 does not: it starts a pass of its own, which the decode after it joins
        assert_eq!(step_passes2(&p(&[3000, 1000, 200, 1]), 4096), vec![vec![0, 1, 3]]);
        assert_eq!(step_passes2(&p(&[3000, 1000, 200]), 4096), vec![vec![0, 1]]);
        assert!(step_passes2(&p(&[10]), 4096).is_empty());
        assert!(step_passes2(&p(&[1]), 4096).is_empty());
        assert!(step_passes2(&[], 4096).is_empty());
    }
}
