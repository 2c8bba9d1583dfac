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

use anyhow::{anyhow, Result};
use cudarc::driver::{sys, DriverError};
use tern_engine::backend::{check_item, panic_message, Slots};
use tern_engine::{sample_host, AllocError, Backend, Output, Sampled, SeqId, StateMemory, Want, Work};

use crate::batch::MAX_SEQS;
use crate::forward::{Draw, RowWant};
use crate::pool::PoolFull;
use crate::sample::SampleBatch;
use crate::seq::{CudaBackend, CudaOptions, CudaSequence, DeviceState};
use crate::workspace::pass_fits;

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
            s.st.fork(&self.cuda.model, tokens).map(|st| CudaSequence {
                model: s.model.clone(),
                st,
                gpu_sampling: s.gpu_sampling,
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
                    out.push(check_item(w, vocab, seq.st.len, reserved).err().map(Err));
                    items.push(Some(seq));
                }
                Err(e) => {
                    out.push(Some(Err(e)));
                    items.push(None);
                }
            }
        }
        if self.opts().batched_decode {
            // one forward pass over the step's decodes and prompt chunks together (not items asking for every
            // position's logits), when there are two or more; prompt chunks past one pass's buffers in more passes
            let rows: Vec<(usize, usize)> = (0..work.len())
                .filter(|&i| out[i].is_none() && !(work[i].ids.len() > 1 && matches!(work[i].out, Want::All)))
                .map(|i| (i, work[i].ids.len()))
                .collect();
            for group in step_passes(&rows, self.step_tokens()) {
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
                Some(seq) => catch_unwind(AssertUnwindSafe(|| Self::run(seq, w)))
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

/// The forward passes of a step's items `(item, rows)`, in order: every one-token item (a decode row) and the prompt
/// chunks that [`pass_fits`] the buffers of a `chunk`-row prefill beside the passes' rows, at most [`MAX_SEQS`]
/// items a pass; the engine's budget makes that one pass a step. A chunk that fits no pass by itself is left out
/// (it runs alone), and so is a pass of one item (the batch-1 paths: the decode graph, the one-sequence prefill).
fn step_passes(items: &[(usize, usize)], chunk: usize) -> Vec<Vec<usize>> {
    let mut passes: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
    for &(i, k) in items {
        if k > 1 && !pass_fits(chunk, [k]) {
            continue;
        }
        let fits = |(group, chunks): &(Vec<usize>, Vec<usize>)| {
            group.len() < MAX_SEQS && (k == 1 || pass_fits(chunk, chunks.iter().copied().chain([k])))
        };
        match passes.iter().position(fits) {
            Some(p) => {
                passes[p].0.push(i);
                if k > 1 {
                    passes[p].1.push(k);
                }
            }
            None => passes.push((vec![i], if k > 1 { vec![k] } else { vec![] })),
        }
    }
    passes
        .into_iter()
        .map(|(mut g, _)| {
            g.sort_unstable();
            g
        })
        .filter(|g| g.len() >= 2)
        .collect()
}

impl CudaSlots {
    /// The items `group` (indices into `work`, ascending, at most [`MAX_SEQS`]: decode rows and prompt chunks within
    /// the prefill chunk) in one forward pass: every item gets its own result; a failed
    /// pass (or a panic inside it) fails them all.
    fn run_batch(
        cuda: &CudaBackend,
        work: &[Work],
        items: &mut [Option<CudaSequence>],
        group: &[usize],
    ) -> Vec<Result<Output>> {
        let gpu_sampling = cuda.opts.gpu_sampling;
        let want: Vec<RowWant> = group
            .iter()
            .map(|&i| match &work[i].out {
                Want::Nothing => RowWant { logits: false, draw: Draw::Nothing },
                Want::Last | Want::All => RowWant { logits: true, draw: Draw::Nothing },
                Want::Sample(s) if s.is_argmax() => RowWant { logits: false, draw: Draw::Argmax(s.limit) },
                Want::Sample(s) if gpu_sampling => RowWant { logits: false, draw: Draw::Sample(s) },
                Want::Sample(_) => RowWant { logits: true, draw: Draw::Nothing },
            })
            .collect();

        // the states in `group`'s order (ascending: the groups are cut from ascending item lists)
        debug_assert!(group.windows(2).all(|w| w[0] < w[1]), "batched items out of order");
        let mut seqs: Vec<&mut DeviceState> = Vec::with_capacity(group.len());
        for (i, it) in items.iter_mut().enumerate() {
            if let (true, Some(seq)) = (group.contains(&i), it.as_mut()) {
                seqs.push(&mut seq.st);
            }
        }
        if seqs.len() != group.len() {
            return group.iter().map(|_| Err(anyhow!("a batched step lost track of its sequences"))).collect();
        }
        let model = cuda.model.clone();
        let ids: Vec<&[u32]> = group.iter().map(|&i| work[i].ids).collect();
        let run = || model.forward_seqs(&mut seqs, &ids, &want);
        let result = catch_unwind(AssertUnwindSafe(run))
            .unwrap_or_else(|p| Err(anyhow!("internal error on the GPU: {}", panic_message(&*p))));
        match result {
            Err(e) => {
                let msg = format!("{e:#}");
                group.iter().map(|_| Err(anyhow!("{msg}"))).collect()
            }
            Ok(rows) => group
                .iter()
                .zip(rows)
                .map(|(&i, row)| match (&work[i].out, row.token, row.logits) {
                    (Want::Nothing, _, _) => Ok(Output::Nothing),
                    (Want::Sample(_), Some(t), _) => t.map(Output::Token),
                    (Want::Sample(s), None, Some(mut l)) => sample_host(&mut l, s).map(Output::Token),
                    (Want::Last | Want::All, _, Some(l)) => Ok(Output::Logits(l)),
                    _ => Err(anyhow!("a batched step returned neither a token nor a logits row")),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's items go into as few forward passes as fit: decode rows and prompt chunks together, prompt chunks
    /// within the rows and chunks of one prefill chunk, at most MAX_SEQS items a pass; chunks over the prefill chunk
    /// and passes of one item are left to run alone.
    #[test]
    fn step_passes_mix_decodes_and_prompt_chunks() {
        let p = |lens: &[usize]| lens.iter().copied().enumerate().collect::<Vec<_>>();
        // decodes and chunks in one pass
        assert_eq!(step_passes(&p(&[1, 1, 300, 1, 2000]), 4096), vec![vec![0, 1, 2, 3, 4]]);
        // 33 prompts of 80 rows: 32 fill a pass's 64 chunks of 64 rows, the 33rd is alone; a decode joins the first
        assert_eq!(step_passes(&p(&[80; 33]), 4096), vec![(0..32).collect::<Vec<_>>()]);
        let mut lens = vec![80; 33];
        lens.push(1);
        assert_eq!(step_passes(&p(&lens), 4096), vec![(0..32).chain([33]).collect::<Vec<_>>()]);
        // at most MAX_SEQS a pass
        let g = step_passes(&p(&[1; 300]), 4096);
        assert_eq!(g.iter().map(Vec::len).collect::<Vec<_>>(), vec![MAX_SEQS, 300 - MAX_SEQS]);
        // a chunk over the prefill chunk is skipped; the rest still group around it
        assert_eq!(step_passes(&p(&[3000, 5000, 1000, 64]), 4096), vec![vec![0, 2, 3]]);
        // rows: 3000 + 1000 fit, + 200 does not: it starts a pass of its own, which the decode after it joins
        assert_eq!(step_passes(&p(&[3000, 1000, 200, 1]), 4096), vec![vec![0, 1, 3]]);
        assert_eq!(step_passes(&p(&[3000, 1000, 200]), 4096), vec![vec![0, 1]]);
        assert!(step_passes(&p(&[10]), 4096).is_empty());
        assert!(step_passes(&p(&[1]), 4096).is_empty());
        assert!(step_passes(&[], 4096).is_empty());
    }
}
