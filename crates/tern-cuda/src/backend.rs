//! The engine's [`Backend`] on CUDA: a slot table of [`DeviceState`]s whose KV caches and recurrent states live in
//! the model's page pool ([`crate::pool`]).
//!
//! A sequence maps, when it is made, the pages its reservation (prompt + completion) needs: 67 MB of recurrent
//! state and one 2 MiB page per 2,048 positions of each K and V region; its step buffers and its batch-1 CUDA
//! graph are its own. A fork shares the source's full K/V pages. With [`CudaOptions::batched_decode`] on, a step's
//! one-token items go through one batched pass ([`crate::batch`], up to [`MAX_SEQS`] sequences) and its prompt
//! chunks through multi-sequence prefills (within the prefill chunk's tokens) when there are two or more of a kind;
//! otherwise each item runs alone: one token through its batch-1 decode graph, a prompt chunk through the prefill
//! kernels ([`CudaSequence::read`]). Plain greedy `Sample` work without logprobs takes the device argmax (4 bytes to
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

use crate::batch::{Draw, RowWant, MAX_SEQS};
use crate::pool::PoolFull;
use crate::prefill::pass_fits;
use crate::sample::SampleBatch;
use crate::seq::{CudaBackend, CudaOptions, CudaSequence, DeviceState};

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
            Want::Verify(_) => Err(anyhow!("the CUDA backend has no verify pass yet (max_drafts is 0)")),
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

    fn step(&self, work: &[Work]) -> Vec<Result<Output>> {
        let vocab = self.vocab_size();
        let taken = self.slots.lock().take(work);
        // each item's sequence (back into the table at the end, whatever happens) and the shared checks' verdict
        let mut items: Vec<Option<CudaSequence>> = Vec::with_capacity(work.len());
        let mut out: Vec<Option<Result<Output>>> = Vec::with_capacity(work.len());
        for (w, got) in work.iter().zip(taken) {
            match got {
                Ok((seq, reserved)) => {
                    let checked = check_item(w, vocab, seq.st.len, reserved).and_then(|()| match w.out {
                        Want::Verify(_) => Err(anyhow!("the CUDA backend has no verify pass yet (max_drafts is 0)")),
                        _ => Ok(()),
                    });
                    out.push(checked.err().map(Err));
                    items.push(Some(seq));
                }
                Err(e) => {
                    out.push(Some(Err(e)));
                    items.push(None);
                }
            }
        }
        if self.opts().batched_decode {
            // decode items (one token each) in batched passes when there are two or more
            let decodes: Vec<usize> = (0..work.len()).filter(|&i| out[i].is_none() && work[i].ids.len() == 1).collect();
            let mut groups: Vec<(Pass, Vec<usize>)> = Vec::new();
            if decodes.len() >= 2 {
                groups.extend(decodes.chunks(MAX_SEQS).map(|g| (Pass::Decode, g.to_vec())));
            }
            // prompt chunks (not asking for every position's logits) in multi-sequence prefills when there are two
            // or more, within the prefill chunk's tokens per pass
            let prompts: Vec<(usize, usize)> = (0..work.len())
                .filter(|&i| out[i].is_none() && work[i].ids.len() > 1 && !matches!(work[i].out, Want::All))
                .map(|i| (i, work[i].ids.len()))
                .collect();
            groups.extend(prefill_groups(&prompts, self.step_tokens()).into_iter().map(|g| (Pass::Prefill, g)));
            for (pass, group) in groups {
                let results = Self::run_batch(&self.cuda, work, &mut items, &group, pass);
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

/// The multi-sequence prefill passes for prompt chunks `(item, rows)`, in order: consecutive groups of at most
/// [`MAX_SEQS`] that [`pass_fits`] the buffers of a `chunk`-row prefill. A chunk that fits no pass by itself, and a
/// group of one, are left out (those run alone).
fn prefill_groups(prompts: &[(usize, usize)], chunk: usize) -> Vec<Vec<usize>> {
    let (mut groups, mut group, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    for &(i, k) in prompts {
        if !pass_fits(chunk, [k]) {
            continue;
        }
        if group.len() == MAX_SEQS || !pass_fits(chunk, rows.iter().copied().chain([k])) {
            groups.push(std::mem::take(&mut group));
            rows.clear();
        }
        group.push(i);
        rows.push(k);
    }
    groups.push(group);
    groups.retain(|g| g.len() >= 2);
    groups
}

/// Which batched pass a group of items takes.
#[derive(Clone, Copy)]
enum Pass {
    /// One token for each sequence ([`crate::DeviceModel::decode_seqs`]).
    Decode,
    /// A prompt chunk for each sequence ([`crate::DeviceModel::prefill_seqs`]).
    Prefill,
}

impl CudaSlots {
    /// The items `group` (indices into `work`, at most [`MAX_SEQS`]: one id each for a decode pass, prompt chunks
    /// within the prefill chunk for a prefill pass) in one batched pass: every item gets its own result; a failed
    /// pass (or a panic inside it) fails them all.
    fn run_batch(
        cuda: &CudaBackend,
        work: &[Work],
        items: &mut [Option<CudaSequence>],
        group: &[usize],
        pass: Pass,
    ) -> Vec<Result<Output>> {
        let gpu_sampling = cuda.opts.gpu_sampling;
        let want: Vec<RowWant> = group
            .iter()
            .map(|&i| match &work[i].out {
                Want::Nothing => RowWant { logits: false, draw: Draw::Nothing },
                Want::Last | Want::All => RowWant { logits: true, draw: Draw::Nothing },
                Want::Sample(s) if s.is_argmax() => RowWant { logits: false, draw: Draw::Argmax(s.limit) },
                Want::Sample(s) if gpu_sampling => RowWant { logits: false, draw: Draw::Sample(s) },
                // (never here: a verify item fails its checks in `step`)
                Want::Sample(_) | Want::Verify(_) => RowWant { logits: true, draw: Draw::Nothing },
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
        let run = || match pass {
            Pass::Decode => {
                let ids: Vec<u32> = group.iter().map(|&i| work[i].ids[0]).collect();
                model.decode_seqs(&mut seqs, &ids, &want)
            }
            Pass::Prefill => {
                let chunks: Vec<&[u32]> = group.iter().map(|&i| work[i].ids).collect();
                model.prefill_seqs(&mut seqs, &chunks, &want)
            }
        };
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

    /// Prompt chunks go into passes in order, each within the rows and chunks of one prefill chunk and MAX_SEQS
    /// sequences; lone chunks and chunks over the prefill chunk are left to run alone.
    #[test]
    fn prefill_groups_fill_passes_in_order() {
        let p = |lens: &[usize]| lens.iter().copied().enumerate().collect::<Vec<_>>();
        // 33 prompts of 80 rows: 32 fill a pass's 64 chunks of 64 rows, the 33rd is alone
        assert_eq!(prefill_groups(&p(&[80; 33]), 4096), vec![(0..32).collect::<Vec<_>>()]);
        // at most MAX_SEQS a pass
        let g = prefill_groups(&p(&[2; 70]), 4096);
        assert_eq!(g.iter().map(Vec::len).collect::<Vec<_>>(), vec![MAX_SEQS, 70 - MAX_SEQS]);
        // a chunk over the prefill chunk is skipped; the rest still group around it
        assert_eq!(prefill_groups(&p(&[3000, 5000, 1000, 64]), 4096), vec![vec![0, 2, 3]]);
        // 4,096 rows but 47 + 16 + 2 chunks: the last starts a pass of its own (left out alone)
        assert_eq!(prefill_groups(&p(&[3000, 1000, 96]), 4096), vec![vec![0, 1]]);
        // rows: 3000 + 1000 fit, + 200 does not; the 200 alone is left out
        assert_eq!(prefill_groups(&p(&[3000, 1000, 200]), 4096), vec![vec![0, 1]]);
        assert!(prefill_groups(&p(&[10]), 4096).is_empty());
        assert!(prefill_groups(&[], 4096).is_empty());
    }
}
