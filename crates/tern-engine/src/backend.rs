//! The seam between the engine and a backend: the backend owns the state of every sequence and runs one step
//! over many of them at once.
//!
//! # Contract
//!
//! * **Sequences are ids.** A backend keeps each sequence's state (KV cache, conv and recurrent state) and hands
//!   out [`SeqId`]s, never reused. [`Backend::alloc`] makes an empty sequence, [`Backend::fork`] an independent
//!   copy of one (the prefix cache's snapshots and hits), [`Backend::free`] drops one (any id, any number of
//!   times: unknown ids are ignored).
//! * **Room is reserved, and running out is an answer, not a panic.** `alloc` and `fork` take the most tokens the
//!   new sequence will ever hold (prompt + completion) and reserve room for them, so a step never runs out of
//!   memory half-way through a reply. Without room they return [`AllocError::Full`] (wait: freeing other
//!   sequences may make room) or [`AllocError::TooLarge`] (never: refuse the request). This is how the engine
//!   admits requests: by the backend's free state, not by a count.
//! * **One step, many sequences.** [`Backend::step`] takes [`Work`] items — for each, the sequence, the ids it
//!   reads after what it holds (a prompt chunk or one decoded token), and what to return ([`Want`]: nothing,
//!   the last or every logits row, or a sampled token) — and returns one result per item, in order. A sequence
//!   appears at most once per step. The backend computes the step as one batch where it can (the CPU backend
//!   reads every weight once for all rows of all items).
//! * **Results are per item.** An item's error (an unknown sequence, no ids, an id outside the vocabulary, more
//!   tokens than reserved, a device error) fails that item only; the others are computed as if it were not
//!   there. After an error the failed sequence's state is unspecified: the engine frees it.
//! * **A sequence's results do not depend on its company.** Reading the same ids in the same order gives the same
//!   results whatever else is in the step and however the ids are split into steps: bit for bit on the CPU
//!   backend ([`tern_model::Weights::forward_batch`]); a backend that cannot promise bits states its tolerance.
//! * **Sampling is behind the seam.** [`Want::Sample`] carries the request's parameters, the seed of this draw,
//!   the tokens penalties count, how many top log-probabilities to return and the id limit past which logits
//!   rows are embedding padding (never sampled). The draw is a function of the logits and these alone, so the
//!   same seed gives the same id on the same backend, also when a step is retried. The CPU backend samples with
//!   [`sample_host`] (tern-text's sampler); a GPU backend may sample on the device.
//! * **Constrained draws carry a token mask.** [`Sample::mask`] (structured output: a JSON schema, a grammar, a
//!   forced tool call) says which ids the draw may choose. It is a [`MaskSlot`] that a constraint worker fills
//!   *while the step runs*: a backend reads it ([`MaskSlot::wait`]) only once the logits are there, so the mask
//!   is computed beside the forward pass, not before it. Its form is a plain bitset, the same for every backend:
//!   `words: &[u32]` of `limit.div_ceil(32)` words, id `i` allowed ⇔ `words[i / 32] >> (i % 32) & 1 == 1`
//!   ([`mask_allows`]); ids past the words are not allowed. A backend sets the logit of every disallowed id to
//!   -inf *after* computing log-probabilities (they describe the model's distribution) and *before* logit bias,
//!   penalties, temperature and the cuts; the id drawn is always an allowed one (if every allowed logit is -inf
//!   or NaN, the lowest allowed id). A masked draw is never [`Sample::is_argmax`]: a device argmax over the raw
//!   logits would ignore the mask. [`apply_mask`] is the host version; a GPU sampler uploads the words and does
//!   the same on the device.
//! * **Speculative decoding** (a backend whose [`Backend::max_drafts`] is not 0). A [`Want::Verify`] item's ids
//!   are a token and the drafts after it (or a prompt's last chunk); its last `draws.len()` rows are drawn, each
//!   with its own [`Sample`] (seed, history up to that row, mask), and row `j` checks the id after it
//!   ([`draw_host`]: accepted with its probability, else a token drawn from the rest). Drawing stops at the first
//!   rejected draft; the sequence then holds the ids up to the last accepted one, as if the rejected ones had never
//!   been read, and the item returns the accepted drafts and the token drawn after them ([`Output::Drafted`]) with
//!   `drafts` new drafts for the next step. A row's mask is read only when its row is drawn.
//! * **Images.** [`Backend::set_images`] gives a sequence the images behind the image pad runs it reads next; an
//!   item reads whole runs.
//! * **Panics.** A step may panic (a bug). The engine catches it; every sequence in that step may then have lost
//!   or half-updated state, so the engine frees them all and goes on with fresh sequences. A backend must stay
//!   usable after a panicking step: no lock held across model code, nothing left poisoned ([`Slots`] does this
//!   for the backends here).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;
use tern_model::forward::{ImageRows, MtpPart, Part};
use tern_model::{Logits, State, Weights};
use tern_text::{Sampler, SamplingParams};

/// A sequence on a backend. Ids are never reused, so a stale id names nothing rather than someone else's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

/// Why [`Backend::alloc`] or [`Backend::fork`] made no sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// Not now: the state other sequences hold is in the way (`need` bytes, `free` free); freeing some makes room.
    Full { need: usize, free: usize },
    /// Never: a sequence of `tokens` tokens is more than this backend can hold (`max_tokens` at most; 0: not even
    /// an empty one).
    TooLarge { tokens: usize, max_tokens: usize },
    /// `fork` of an id the backend does not hold.
    Unknown(SeqId),
    /// The backend failed for another reason (a device error).
    Failed(String),
}

impl std::fmt::Display for AllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocError::Full { need, free } => write!(
                f,
                "no room for another sequence now: it needs {:.1} MiB of state, {:.1} MiB are free",
                *need as f64 / 1048576.0,
                *free as f64 / 1048576.0
            ),
            AllocError::TooLarge { tokens, max_tokens: 0 } => {
                write!(f, "this backend has no room for a sequence of {tokens} tokens, nor for any sequence")
            }
            AllocError::TooLarge { tokens, max_tokens } => write!(
                f,
                "a sequence of {tokens} tokens (prompt + max_tokens) does not fit: this backend holds at most \
                 {max_tokens} tokens per sequence"
            ),
            AllocError::Unknown(id) => write!(f, "no {id} on this backend"),
            AllocError::Failed(e) => write!(f, "cannot allocate a sequence: {e}"),
        }
    }
}

impl std::error::Error for AllocError {}

/// An image of a prompt, ready for the vision tower.
#[derive(Clone, Debug)]
pub struct Image {
    /// Its pixel rows and grid, preprocessed ([`tern_model::vision::preprocess`]).
    pub pixels: Arc<tern_model::vision::Pixels>,
    /// A hash of the image's bytes: the prefix cache keys the snapshots after an image by it, so that one image's
    /// snapshot never serves another.
    pub hash: u64,
    /// Image pad tokens it takes in the prompt ([`tern_model::vision::Pixels::tokens`] at the model's merge size).
    pub tokens: usize,
}

/// One sequence's part of a step.
pub struct Work<'a> {
    pub seq: SeqId,
    /// Read after what the sequence holds (at least one id).
    pub ids: &'a [u32],
    pub out: Want<'a>,
}

/// What a [`Work`] item returns.
pub enum Want<'a> {
    /// Nothing ([`Output::Nothing`]): a prompt chunk that does not end the prompt.
    Nothing,
    /// The logits after the last id, `[vocab]` ([`Output::Logits`]).
    Last,
    /// The logits after every id, `[ids.len(), vocab]` ([`Output::Logits`]).
    All,
    /// A token drawn from the logits after the last id ([`Output::Token`]).
    Sample(Sample<'a>),
    /// Speculative decoding ([`Output::Drafted`]; only for a backend whose [`Backend::max_drafts`] is not 0).
    Verify(Verify<'a>),
}

/// Draws over the last rows of an item, checking drafts, and the drafts of the next step (see the module's
/// contract, "Speculative decoding").
pub struct Verify<'a> {
    /// One per drawn row: the last `draws.len()` rows of the item's ids (at least one, at most all of them).
    pub draws: Vec<Sample<'a>>,
    /// Drafts to propose for the next step, after the token drawn last (0: none); at most [`Backend::max_drafts`].
    pub drafts: usize,
}

/// How to draw a token.
pub struct Sample<'a> {
    /// Temperature, top-k/p, min-p, penalties, logit bias; `params.seed` is not read (see `seed`).
    pub params: &'a SamplingParams,
    /// The seed of this draw: the same seed (with the same logits and parameters) gives the same id.
    pub seed: u64,
    /// The tokens repetition, presence and frequency penalties count (the reply so far).
    pub history: &'a [u32],
    /// Also return the chosen token's log-probability and this many of the most likely tokens'.
    pub top_logprobs: Option<usize>,
    /// Ids at or above this are embedding padding past the tokenizer's last id: never drawn, not in logprobs.
    pub limit: usize,
    /// Constrained decoding: the ids this draw may choose (see the module documentation); `None`: any id below
    /// `limit`.
    pub mask: Option<&'a MaskSlot>,
}

impl Sample<'_> {
    /// Whether the draw is the plain argmax of the first `limit` logits (temperature 0, no penalty or bias, no
    /// logprobs, no mask), which a backend may find where the logits are instead of moving them.
    pub fn is_argmax(&self) -> bool {
        self.top_logprobs.is_none()
            && self.mask.is_none()
            && Sampler::new(SamplingParams { seed: Some(0), ..self.params.clone() }).is_plain_greedy()
    }
}

/// What a mask worker puts in a [`MaskSlot`]: the bitset, `None` when the draw turned out unconstrained (the
/// constraint has ended), or why no mask could be computed (the draw fails).
pub type MaskResult = Result<Option<Vec<u32>>, String>;

/// The token mask of one draw, filled once by whoever computes it (a constraint worker) and read by the backend
/// when it samples, which blocks until it is there, or until the slot's limit has passed: then the draw fails (the
/// slot is filled with that error; the worker's late result is dropped), so that one request's slow grammar holds
/// a step, and every other stream in it, for a bounded time. Whoever takes on filling a slot must fill it, also on
/// failure (a slot never filled and without a limit would block its step forever): the engine's workers fill it
/// from a guard.
#[derive(Debug, Default)]
pub struct MaskSlot {
    cell: OnceLock<MaskResult>,
    /// Nanoseconds readers spent blocked in [`MaskSlot::wait`]: the part of the mask's cost on the step's path.
    waited_ns: AtomicU64,
    /// Rung by [`MaskSlot::fill`] for readers blocked in [`MaskSlot::wait`].
    bell: (Mutex<()>, Condvar),
    /// The longest [`MaskSlot::wait`] blocks (`None`: as long as it takes).
    limit: Option<Duration>,
}

impl MaskSlot {
    /// A slot to be filled later.
    pub fn pending() -> MaskSlot {
        MaskSlot::default()
    }

    /// A slot to be filled later, whose reader waits at most `limit` for it.
    pub fn pending_within(limit: Duration) -> MaskSlot {
        MaskSlot { limit: Some(limit), ..MaskSlot::default() }
    }

    /// A slot holding `words` already.
    pub fn ready(words: Vec<u32>) -> MaskSlot {
        let slot = MaskSlot::default();
        slot.fill(Ok(Some(words)));
        slot
    }

    /// Put the result in (the first fill wins; later ones are ignored).
    pub fn fill(&self, r: MaskResult) {
        let _ = self.cell.set(r);
        let _rung = self.bell.0.lock().unwrap_or_else(PoisonError::into_inner);
        self.bell.1.notify_all();
    }

    pub fn is_filled(&self) -> bool {
        self.cell.get().is_some()
    }

    /// The mask, once filled (blocking until then, or until the slot's limit: then the draw fails): `Ok(None)`
    /// means no constraint on this draw.
    pub fn wait(&self) -> Result<Option<&[u32]>> {
        if self.cell.get().is_none() {
            let t0 = Instant::now();
            let mut rung = self.bell.0.lock().unwrap_or_else(PoisonError::into_inner);
            // checked under the bell's lock: a fill between the check and the wait rings after the wait begins
            while self.cell.get().is_none() {
                let left = self.limit.map(|l| l.saturating_sub(t0.elapsed()));
                if left.is_some_and(|l| l.is_zero()) {
                    drop(rung);
                    let secs = self.limit.map_or(0.0, |l| l.as_secs_f64());
                    self.fill(Err(format!(
                        "computing a token mask took over {secs:.1} s, which would hold every other stream: the \
                         grammar or schema is too expensive to enforce"
                    )));
                    rung = self.bell.0.lock().unwrap_or_else(PoisonError::into_inner);
                    continue;
                }
                rung = match left {
                    Some(l) => self.bell.1.wait_timeout(rung, l).unwrap_or_else(PoisonError::into_inner).0,
                    None => self.bell.1.wait(rung).unwrap_or_else(PoisonError::into_inner),
                };
            }
            drop(rung);
            self.waited_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        let r = self.cell.get().ok_or_else(|| anyhow!("a token mask slot without a result"))?;
        match r {
            Ok(w) => Ok(w.as_deref()),
            Err(e) => Err(anyhow!("the output constraint failed: {e}")),
        }
    }

    /// The result without blocking (`None` while pending).
    pub fn peek(&self) -> Option<&MaskResult> {
        self.cell.get()
    }

    /// Nanoseconds [`MaskSlot::wait`] has blocked so far.
    pub fn waited_ns(&self) -> u64 {
        self.waited_ns.load(Ordering::Relaxed)
    }
}

/// Whether bit `id` of a mask bitset is set (ids past its words: no).
pub fn mask_allows(words: &[u32], id: u32) -> bool {
    words.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// Set every logit the mask does not allow to -inf; returns how many ids it allows among `logits`.
pub fn apply_mask(logits: &mut [f32], words: &[u32]) -> usize {
    let mut allowed = 0;
    for (i, chunk) in logits.chunks_mut(32).enumerate() {
        let w = words.get(i).copied().unwrap_or(0);
        if w == u32::MAX && chunk.len() == 32 {
            allowed += 32;
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if w >> b & 1 == 1 {
                allowed += 1;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    allowed
}

/// What one [`Work`] item produced.
#[derive(Debug, PartialEq)]
pub enum Output {
    Nothing,
    Logits(Vec<f32>),
    Token(Sampled),
    /// What a [`Want::Verify`] drew: the accepted drafts, then the token drawn after them (1 to `draws.len()`
    /// tokens), and the drafts proposed for the next step.
    Drafted {
        tokens: Vec<Sampled>,
        drafts: Vec<u32>,
    },
}

/// A drawn token and, when asked, log-probabilities of the model's distribution (before penalties and
/// temperature).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens at this position, best first.
    pub top: Vec<(u32, f32)>,
}

/// A backend's sequence state against its bound (see [`Backend::state_memory`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateMemory {
    /// Bytes held now: running sequences and prefix-cache snapshots (the CPU backend counts their reservations; the
    /// CUDA backend its pool's pages in use, freed ranges kept mapped for reuse included).
    pub used: usize,
    /// Bytes it may hold at most (`None`: no bound but the machine's).
    pub limit: Option<usize>,
}

pub trait Backend: Send + Sync {
    /// "cpu", "cuda", ...
    fn name(&self) -> &str;
    /// Rows of logits (the model's vocabulary, embedding padding included).
    fn vocab_size(&self) -> usize;
    /// A new empty sequence with room for `tokens` tokens.
    fn alloc(&self, tokens: usize) -> Result<SeqId, AllocError>;
    /// A new sequence holding a copy of `seq`'s state, with room for `tokens` tokens (at least what it holds).
    fn fork(&self, seq: SeqId, tokens: usize) -> Result<SeqId, AllocError>;
    /// Drop a sequence's state (unknown ids: nothing happens).
    fn free(&self, seq: SeqId);
    /// Tokens the sequence has read (`None`: unknown id).
    fn len(&self, seq: SeqId) -> Option<usize>;
    /// Bytes of memory the sequence's state takes now (0 for an unknown id): what the prefix cache counts.
    fn state_bytes(&self, seq: SeqId) -> usize;
    /// What all sequence state takes of the memory the backend may use (/metrics); `None`: not tracked.
    fn state_memory(&self) -> Option<StateMemory> {
        None
    }
    /// Run one step: one result per item, in order (see the module documentation).
    fn step(&self, work: &[Work]) -> Vec<Result<Output>>;
    /// Tokens one step should read when the engine is not told otherwise ([`crate::EngineConfig::step_tokens`]
    /// 0): the trade between a long prompt's time to first token (fewer, larger steps) and how long running
    /// streams wait between two of their tokens (one step). 512 unless a backend knows better.
    fn step_tokens(&self) -> usize {
        512
    }

    /// Sequences to run at once when the engine is not told otherwise ([`crate::EngineConfig::max_concurrent`] 0):
    /// what one step takes well. 64 unless a backend knows better.
    fn max_seqs(&self) -> usize {
        64
    }

    /// The most drafts one [`Want::Verify`] may ask for (the backend drafts with the model's multi-token-prediction
    /// block); 0 (the default): no speculative decoding, and no item may be a [`Want::Verify`].
    fn max_drafts(&self) -> usize {
        0
    }

    /// What one verify of `drafts` drafts costs a lone sequence, in plain decode steps (its pass of `drafts + 1`
    /// rows and the drafting of the next ones), where the backend has measured it. The engine pauses a request's
    /// drafting while its accepted drafts do not pay for that; `None` (the default): unmeasured, and only the
    /// acceptance floor pauses it. A fixed figure, not a timing taken while serving, so that a seed gives the same
    /// text every run.
    fn verify_cost(&self, drafts: usize) -> Option<f64> {
        let _ = drafts;
        None
    }

    /// The model's image pad id when this backend reads images (the model has a vision tower), else `None`.
    fn image_token_id(&self) -> Option<u32> {
        None
    }

    /// The images behind the image pad runs `seq` reads next, in order (replacing any it was given before): each
    /// step item reads whole runs, and the backend puts the vision tower's rows of the next image in place of each
    /// run's pads. An error when the backend does not read images.
    fn set_images(&self, seq: SeqId, images: &[Image]) -> Result<()> {
        match images {
            [] => Ok(()),
            _ => bail!("{}: this backend does not read images", seq),
        }
    }
}

/// Read `ids` into `seq` as a step of its own and return its logits: every row (`all`) or the last.
pub fn read_logits(b: &dyn Backend, seq: SeqId, ids: &[u32], all: bool) -> Result<Vec<f32>> {
    let out = if all { Want::All } else { Want::Last };
    match b.step(&[Work { seq, ids, out }]).pop() {
        Some(Ok(Output::Logits(l))) => Ok(l),
        Some(Ok(o)) => bail!("the backend returned {o:?} for logits"),
        Some(Err(e)) => Err(e),
        None => bail!("the backend returned no result"),
    }
}

/// The host sampler behind [`Want::Sample`]: padding rows masked, log-probabilities of the raw distribution,
/// then tern-text's sampler seeded with the draw's seed. `logits` is modified.
pub fn sample_host(logits: &mut [f32], s: &Sample) -> Result<Sampled> {
    draw_host(logits, s, None).map(|(sampled, _)| sampled)
}

/// [`sample_host`], or with a `draft`, tern-text's check of the draft ([`Sampler::verify`]: accepted with its
/// probability, else a draw from the rest); returns the token and whether it is the accepted draft.
pub fn draw_host(logits: &mut [f32], s: &Sample, draft: Option<u32>) -> Result<(Sampled, bool)> {
    if logits.is_empty() {
        bail!("no logits to sample from");
    }
    let limit = s.limit.clamp(1, logits.len());
    logits[limit..].fill(f32::NEG_INFINITY);
    let logprob = s.top_logprobs.map(|k| {
        let l = &logits[..limit];
        let m = l.iter().fold(f32::NEG_INFINITY, |x, &y| x.max(y));
        let lse = m + l.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
        let mut idx: Vec<usize> = (0..limit).collect();
        let k = k.min(limit);
        if k > 0 {
            idx.select_nth_unstable_by(k - 1, |&i, &j| l[j].total_cmp(&l[i]));
        }
        idx.truncate(k);
        idx.sort_by(|&i, &j| l[j].total_cmp(&l[i]).then(i.cmp(&j)));
        (lse, idx.iter().map(|&i| (i as u32, l[i] - lse)).collect::<Vec<_>>())
    });
    // A top-k of at least every candidate is no cut at all (and the one-pass top-k is quadratic in k).
    let top_k = if s.params.top_k >= limit { 0 } else { s.params.top_k };
    let params = SamplingParams { seed: Some(s.seed), top_k, ..s.params.clone() };
    let raw = logprob.as_ref().map(|_| logits[..limit].to_vec());
    let mask = match s.mask {
        Some(slot) => slot.wait()?,
        None => None,
    };
    if let Some(words) = mask {
        if apply_mask(&mut logits[..limit], words) == 0 {
            bail!("the output constraint allows no token here");
        }
    }
    let mut sampler = Sampler::new(params);
    let (mut token, mut accepted) = match draft {
        Some(d) if (d as usize) < limit => sampler.verify(&mut logits[..limit], s.history, d),
        _ => (sampler.sample(&mut logits[..limit], s.history), false),
    };
    if let Some(words) = mask {
        if !mask_allows(words, token) {
            // Only when every allowed logit is -inf or NaN: the sampler's fallback ignores the mask.
            token = (0..limit as u32).find(|&i| mask_allows(words, i)).unwrap_or(token);
            accepted = draft == Some(token);
        }
    }
    let logprob =
        logprob.zip(raw).map(|((lse, top), raw)| TokenLogprob { token, logprob: raw[token as usize] - lse, top });
    Ok((Sampled { token, logprob }, accepted))
}

/// A [`Want::Verify`]'s draws over `rows` (its last `draws.len()` logits rows): row `j` checks `drafts[j]` (the id
/// after it; the last row has none), until a draft is rejected. Returns the accepted drafts and the token drawn
/// after them ([`Output::Drafted`] without the next drafts).
pub fn verify_host(rows: &mut [f32], v: &Verify, drafts: &[u32]) -> Result<Vec<Sampled>> {
    let m = v.draws.len();
    if m == 0 || rows.is_empty() || !rows.len().is_multiple_of(m) || drafts.len() + 1 != m {
        bail!("a verify item with {m} draws, {} drafts and {} logits", drafts.len(), rows.len());
    }
    let width = rows.len() / m;
    let mut tokens = Vec::with_capacity(m);
    for (j, (row, s)) in rows.chunks_exact_mut(width).zip(&v.draws).enumerate() {
        let (sampled, accepted) = draw_host(row, s, drafts.get(j).copied())?;
        tokens.push(sampled);
        if !accepted {
            break;
        }
    }
    Ok(tokens)
}

/// Sampling, logits copy or nothing, as `want` asks, from the rows a step computed; a panic in the sampler fails
/// this item only. `ids` are the item's (a verify's drafts are among them).
fn finish_item(want: &Want, ids: &[u32], mut logits: Vec<f32>) -> Result<Output> {
    let caught = |f: &mut dyn FnMut() -> Result<Output>| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(anyhow!("the sampler failed: {}", panic_message(&*p))),
    };
    match want {
        Want::Nothing => Ok(Output::Nothing),
        Want::Last | Want::All => Ok(Output::Logits(logits)),
        Want::Sample(s) => caught(&mut || sample_host(&mut logits, s).map(Output::Token)),
        Want::Verify(v) => {
            let drafts = &ids[(ids.len() + 1).saturating_sub(v.draws.len())..];
            caught(&mut || {
                let tokens = verify_host(&mut logits, v, drafts)?;
                Ok(Output::Drafted { tokens, drafts: Vec::new() })
            })
        }
    }
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The sequence table of a backend: states by id, with the room each reserved. States are taken out for a step
/// and put back after it ([`Table::take`], [`Table::put`]), so the table is never locked while model code runs: a
/// panic there loses the states it held (their ids then fail with "lost") and poisons nothing.
pub struct Slots<S> {
    table: Mutex<Table<S>>,
}

pub struct Table<S> {
    next: u64,
    live: HashMap<u64, Slot<S>>,
    reserved_bytes: usize,
}

pub struct Slot<S> {
    /// `None` while a step has it, or after a step that had it panicked.
    pub state: Option<S>,
    /// Tokens reserved.
    pub tokens: usize,
    /// Bytes reserved.
    pub bytes: usize,
}

impl<S> Default for Slots<S> {
    fn default() -> Self {
        Slots { table: Mutex::new(Table { next: 1, live: HashMap::new(), reserved_bytes: 0 }) }
    }
}

impl<S> Slots<S> {
    pub fn lock(&self) -> MutexGuard<'_, Table<S>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<S> Table<S> {
    pub fn insert(&mut self, state: S, tokens: usize, bytes: usize) -> SeqId {
        let id = self.next;
        self.next += 1;
        self.reserved_bytes += bytes;
        self.live.insert(id, Slot { state: Some(state), tokens, bytes });
        SeqId(id)
    }

    pub fn remove(&mut self, id: SeqId) -> Option<Slot<S>> {
        let slot = self.live.remove(&id.0)?;
        self.reserved_bytes -= slot.bytes;
        Some(slot)
    }

    pub fn get(&self, id: SeqId) -> Option<&Slot<S>> {
        self.live.get(&id.0)
    }

    /// Bytes reserved by every sequence.
    pub fn reserved_bytes(&self) -> usize {
        self.reserved_bytes
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The states of a step's items, with their reserved tokens; `Err` for an unknown id, a sequence given twice,
    /// or one whose state a panicking step lost.
    pub fn take(&mut self, work: &[Work]) -> Vec<Result<(S, usize)>> {
        let mut seen = std::collections::HashSet::new();
        work.iter()
            .map(|w| {
                let slot = self.live.get_mut(&w.seq.0).ok_or_else(|| anyhow!("no {} on this backend", w.seq))?;
                if !seen.insert(w.seq) {
                    bail!("{} appears twice in one step", w.seq);
                }
                let st =
                    slot.state.take().ok_or_else(|| anyhow!("the state of {} was lost in a failed step", w.seq))?;
                Ok((st, slot.tokens))
            })
            .collect()
    }

    /// Return a state taken for a step (a freed id: the state is dropped).
    pub fn put(&mut self, id: SeqId, state: S) {
        if let Some(slot) = self.live.get_mut(&id.0) {
            slot.state = Some(state);
        }
    }
}

/// Checks every backend makes of an item before reading it: some ids, all in the vocabulary, within the room
/// reserved (`len` tokens held, `reserved` reserved).
pub fn check_item(w: &Work, vocab: usize, len: usize, reserved: usize) -> Result<()> {
    if w.ids.is_empty() {
        bail!("a step item with no ids for {}", w.seq);
    }
    if let Some(bad) = w.ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary (size {vocab})");
    }
    if len + w.ids.len() > reserved {
        bail!("{} would hold {} tokens, more than the {reserved} reserved for it", w.seq, len + w.ids.len());
    }
    Ok(())
}

/// The CPU backend: the reference forward pass on all cores, one [`Weights::forward_batch`] per step.
///
/// With speculative decoding on ([`CpuBackend::speculative`], a model with an MTP block), every sequence also
/// keeps the MTP block's KV cache in step with what it has read: a step feeds the block the rows `(hidden_i,
/// id_{i+1})` of the positions whose next id it now knows (the last position's hidden state waits for the next
/// id, in `Mtp::pending`), so the block's cache always holds one row fewer than the sequence has read. Drafts
/// are chained from the block (its argmax, fed its own output) after the last drawn token, then those rows are
/// dropped again. Rejected drafts leave nothing behind: the verify rows keep their Gated DeltaNet states
/// ([`State::keep_rows`]) and the sequence goes back to the last accepted one ([`State::rewind`]) — a copy of the
/// recurrent state per verify row instead of a second pass over the accepted ones.
pub struct CpuBackend {
    weights: Arc<Weights>,
    /// Bytes of sequence state it may hold (`None`: no limit but the machine's).
    capacity: Option<usize>,
    /// Speculative decoding: every sequence keeps an MTP cache ([`Seq::mtp`]).
    mtp: bool,
    slots: Slots<Seq>,
}

/// A CPU sequence: the model's state and, with speculative decoding, the MTP block's.
#[derive(Clone)]
pub struct Seq {
    main: State,
    mtp: Option<Mtp>,
    /// The images behind the image pad runs it reads next ([`Backend::set_images`]).
    images: std::collections::VecDeque<Image>,
}

/// The MTP block's side of a sequence (see [`CpuBackend`]).
#[derive(Clone)]
pub struct Mtp {
    /// Its KV cache: one row per position the sequence has read, but the last.
    state: State,
    /// The main model's post-norm hidden state of the last position read (empty before the first).
    pending: Vec<f32>,
}

/// The most drafts a CPU verify takes.
const CPU_MAX_DRAFTS: usize = 4;

impl CpuBackend {
    /// No limit on sequence state beyond the machine's memory (the engine's `max_concurrent` bounds it).
    pub fn new(weights: impl Into<Arc<Weights>>) -> CpuBackend {
        CpuBackend { weights: weights.into(), capacity: None, mtp: false, slots: Slots::default() }
    }

    /// At most `bytes` of sequence state ([`State::bytes_for`] of each sequence's reserved tokens).
    pub fn with_capacity(weights: impl Into<Arc<Weights>>, bytes: usize) -> CpuBackend {
        CpuBackend { capacity: Some(bytes), ..CpuBackend::new(weights) }
    }

    /// Speculative decoding with the model's MTP block, when `on` and the model has one ([`Backend::max_drafts`]
    /// says which); before any sequence is made.
    pub fn speculative(mut self, on: bool) -> CpuBackend {
        self.mtp = on && self.weights.mtp.is_some();
        self
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    fn bytes_for(&self, tokens: usize) -> usize {
        let c = &self.weights.config;
        State::bytes_for(c, tokens) + if self.mtp { State::mtp_bytes_for(c, tokens) } else { 0 }
    }

    fn new_seq(&self) -> Seq {
        let mtp = self.mtp.then(|| Mtp { state: State::new_mtp(), pending: Vec::new() });
        Seq { main: State::new(&self.weights.config), mtp, images: Default::default() }
    }

    /// The vision tower's rows (and grid) of the next images of `seq`, one per image pad run of `ids`.
    fn tower_rows(&self, ids: &[u32], seq: &mut Seq) -> Result<Vec<(Vec<f32>, [usize; 3])>> {
        let (Some(pad), Some(vision)) = (self.image_token_id(), self.weights.vision.as_ref()) else {
            return Ok(Vec::new());
        };
        if seq.images.is_empty() {
            return Ok(Vec::new()); // pads without images are read as the ids they are
        }
        let mut out = Vec::new();
        let mut t = 0;
        while t < ids.len() {
            if ids[t] != pad {
                t += 1;
                continue;
            }
            let len = ids[t..].iter().take_while(|&&i| i == pad).count();
            let Some(im) = seq.images.pop_front() else {
                bail!("image pads at {t} without an image (more pad runs than images)");
            };
            if im.tokens != len {
                bail!("a run of {len} image pads at {t} for an image of {} tokens", im.tokens);
            }
            out.push((vision.forward(&im.pixels.values, &[im.pixels.grid])?, im.pixels.grid));
            t += len;
        }
        Ok(out)
    }

    fn reserve(&self, t: &Table<Seq>, tokens: usize) -> Result<usize, AllocError> {
        let need = self.bytes_for(tokens);
        let Some(cap) = self.capacity else { return Ok(need) };
        if need > cap {
            let (fixed, per_token) = (self.bytes_for(0), self.bytes_for(1) - self.bytes_for(0));
            let max_tokens = cap.saturating_sub(fixed).checked_div(per_token).unwrap_or(usize::MAX);
            return Err(AllocError::TooLarge { tokens, max_tokens: if cap < fixed { 0 } else { max_tokens } });
        }
        let free = cap.saturating_sub(t.reserved_bytes());
        if need > free {
            return Err(AllocError::Full { need, free });
        }
        Ok(need)
    }

    /// The MTP side of a step: feed each item's newly known rows into its sequence's MTP cache, then chain the
    /// drafts the verify items ask for. `done[j]` is item `j`'s result and the ids its sequence kept.
    fn mtp_step(&self, work: &[Work], taken: &mut [(usize, Seq)], hidden: &[Vec<f32>], done: &mut [Result<Output>]) {
        let h = self.weights.config.hidden_size;
        // Rows (hidden_i, id_{i+1}) of the positions whose next id is known now.
        let mut feeds: Vec<(usize, Vec<f32>, Vec<u32>)> = Vec::new();
        for (j, (i, seq)) in taken.iter_mut().enumerate() {
            let (w, Some(m)) = (&work[*i], seq.mtp.as_mut()) else { continue };
            let Ok(out) = &done[j] else { continue };
            let kept = match out {
                Output::Drafted { tokens, .. } => w.ids.len() + tokens.len() - verify_rows(&w.out),
                _ => w.ids.len(),
            };
            let (mut hid, mut ids) = (std::mem::take(&mut m.pending), w.ids[..kept].to_vec());
            if hid.is_empty() {
                ids.remove(0);
            }
            hid.extend_from_slice(&hidden[j][..(kept - 1) * h]);
            m.pending = hidden[j][(kept - 1) * h..kept * h].to_vec();
            if !ids.is_empty() {
                feeds.push((j, hid, ids));
            }
        }
        let errs = {
            let mut states: Vec<(usize, &mut State)> = Vec::new();
            let mut by_item: HashMap<usize, &mut State> =
                taken.iter_mut().enumerate().filter_map(|(j, (_, s))| Some((j, &mut s.mtp.as_mut()?.state))).collect();
            for (j, _, _) in &feeds {
                if let Some(st) = by_item.remove(j) {
                    states.push((*j, st));
                }
            }
            let mut parts: Vec<MtpPart> = feeds
                .iter()
                .zip(states.iter_mut())
                .map(|((_, hid, ids), (_, st))| MtpPart { hidden: hid, ids, state: st, logits: Logits::Skip })
                .collect();
            match self.weights.mtp_forward_batch(&mut parts) {
                Ok(_) => Vec::new(),
                Err(e) => feeds.iter().map(|f| (f.0, format!("{e:#}"))).collect::<Vec<_>>(),
            }
        };
        for (j, e) in errs {
            done[j] = Err(anyhow!("the MTP block failed: {e}"));
        }
        // Text after an image sits at M-RoPE positions past the image's: the block's rows from here on too (the
        // rows just fed that came after an image in the same call kept the positions before it).
        for (_, seq) in taken.iter_mut() {
            if let Some(m) = seq.mtp.as_mut() {
                m.state.rope_delta = seq.main.rope_delta;
            }
        }
        // Draft chains: (the last hidden state, the token drawn) → d1, (its output, d1) → d2, ...
        let mut chains: Vec<(usize, usize, Vec<f32>, u32, usize)> = Vec::new(); // (item, drafts, hidden, id, limit)
        for (j, (i, seq)) in taken.iter().enumerate() {
            let (Want::Verify(v), Some(m), Ok(Output::Drafted { tokens, .. })) = (&work[*i].out, &seq.mtp, &done[j])
            else {
                continue;
            };
            if let (Some(last), Some(s)) = (tokens.last(), v.draws.first()) {
                if v.drafts > 0 && !m.pending.is_empty() {
                    chains.push((j, v.drafts.min(CPU_MAX_DRAFTS), m.pending.clone(), last.token, s.limit));
                }
            }
        }
        let mut drafted: HashMap<usize, Vec<u32>> = HashMap::new();
        let rounds = chains.iter().map(|c| c.1).max().unwrap_or(0);
        let starts: HashMap<usize, usize> =
            chains.iter().filter_map(|c| Some((c.0, taken[c.0].1.mtp.as_ref()?.state.pos))).collect();
        for r in 0..rounds {
            let live: Vec<usize> = (0..chains.len()).filter(|&c| chains[c].1 > r).collect();
            let ids: Vec<[u32; 1]> = live.iter().map(|&c| [chains[c].3]).collect();
            let (used, outs) = {
                let mut by_item: HashMap<usize, &mut State> = taken
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(j, (_, s))| Some((j, &mut s.mtp.as_mut()?.state)))
                    .collect();
                let mut used = Vec::with_capacity(live.len());
                let mut parts: Vec<MtpPart> = Vec::with_capacity(live.len());
                for (k, &c) in live.iter().enumerate() {
                    if let Some(st) = by_item.remove(&chains[c].0) {
                        used.push(c);
                        parts.push(MtpPart { hidden: &chains[c].2, ids: &ids[k], state: st, logits: Logits::Last });
                    }
                }
                (used, self.weights.mtp_forward_batch(&mut parts))
            };
            let Ok(outs) = outs else { break }; // fewer drafts this step (the rows fed above stand)
            for (c, o) in used.into_iter().zip(outs) {
                let limit = chains[c].4.clamp(1, o.logits.len().max(1)).min(o.logits.len());
                let d = o.logits[..limit]
                    .iter()
                    .enumerate()
                    .fold((0usize, f32::NEG_INFINITY), |b, (id, &l)| if l > b.1 { (id, l) } else { b })
                    .0 as u32;
                drafted.entry(chains[c].0).or_default().push(d);
                (chains[c].2, chains[c].3) = (o.hidden, d);
            }
        }
        // The chained rows are guesses: the cache goes back to the rows of what was read.
        for (j, start) in starts {
            if let Some(m) = taken[j].1.mtp.as_mut() {
                let _ = m.state.rewind(start);
            }
            if let (Ok(Output::Drafted { drafts, .. }), Some(d)) = (&mut done[j], drafted.remove(&j)) {
                *drafts = d;
            }
        }
    }
}

/// Rows a want draws from (a verify's draws; 0 for the others).
fn verify_rows(want: &Want) -> usize {
    match want {
        Want::Verify(v) => v.draws.len(),
        _ => 0,
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn vocab_size(&self) -> usize {
        self.weights.config.vocab_size
    }

    fn alloc(&self, tokens: usize) -> Result<SeqId, AllocError> {
        let mut t = self.slots.lock();
        let bytes = self.reserve(&t, tokens)?;
        Ok(t.insert(self.new_seq(), tokens, bytes))
    }

    fn fork(&self, seq: SeqId, tokens: usize) -> Result<SeqId, AllocError> {
        let mut t = self.slots.lock();
        let st = t.get(seq).and_then(|s| s.state.clone()).ok_or(AllocError::Unknown(seq))?;
        let tokens = tokens.max(st.main.pos);
        let bytes = self.reserve(&t, tokens)?;
        Ok(t.insert(st, tokens, bytes))
    }

    fn free(&self, seq: SeqId) {
        let slot = self.slots.lock().remove(seq);
        drop(slot); // outside the lock
    }

    fn len(&self, seq: SeqId) -> Option<usize> {
        self.slots.lock().get(seq)?.state.as_ref().map(|s| s.main.pos)
    }

    fn state_bytes(&self, seq: SeqId) -> usize {
        self.len(seq).map_or(0, |n| self.bytes_for(n))
    }

    fn state_memory(&self) -> Option<StateMemory> {
        Some(StateMemory { used: self.slots.lock().reserved_bytes(), limit: self.capacity })
    }

    fn max_drafts(&self) -> usize {
        if self.mtp {
            CPU_MAX_DRAFTS
        } else {
            0
        }
    }

    fn image_token_id(&self) -> Option<u32> {
        self.weights.vision.as_ref().map(|_| self.weights.config.image_token_id)
    }

    fn set_images(&self, seq: SeqId, images: &[Image]) -> Result<()> {
        if !images.is_empty() && self.image_token_id().is_none() {
            bail!("this model reads no images (its checkpoint has no vision tower)");
        }
        let mut t = self.slots.lock();
        let Some(slot) = t.live.get_mut(&seq.0) else { bail!("no {seq} on this backend") };
        let Some(st) = slot.state.as_mut() else { bail!("the state of {seq} was lost in a failed step") };
        st.images = images.iter().cloned().collect();
        Ok(())
    }

    fn step(&self, work: &[Work]) -> Vec<Result<Output>> {
        let vocab = self.vocab_size();
        let mut results: Vec<Option<Result<Output>>> = work.iter().map(|_| None).collect();
        let mut taken: Vec<(usize, Seq)> = Vec::with_capacity(work.len());
        {
            let mut t = self.slots.lock();
            for (i, (w, got)) in work.iter().zip(t.take(work)).enumerate() {
                let checked = got.and_then(|(st, reserved)| {
                    let ok = check_item(w, vocab, st.main.pos, reserved).and_then(|()| self.check_verify(w));
                    match ok {
                        Ok(()) => Ok(st),
                        Err(e) => {
                            t.put(w.seq, st);
                            Err(e)
                        }
                    }
                });
                match checked {
                    Ok(st) => taken.push((i, st)),
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
        }
        // The vision tower's rows of the images the items read (outside the lock); an item whose images do not
        // match its pads fails alone.
        let mut towers: Vec<Vec<(Vec<f32>, [usize; 3])>> = Vec::with_capacity(taken.len());
        let mut failed = Vec::new();
        for (j, (i, st)) in taken.iter_mut().enumerate() {
            match self.tower_rows(work[*i].ids, st) {
                Ok(r) => towers.push(r),
                Err(e) => {
                    towers.push(Vec::new());
                    failed.push((j, e));
                }
            }
        }
        if !failed.is_empty() {
            let mut t = self.slots.lock();
            for (j, e) in failed.into_iter().rev() {
                let (i, st) = taken.remove(j);
                towers.remove(j);
                t.put(work[i].seq, st);
                results[i] = Some(Err(e.context("image")));
            }
        }
        let starts: Vec<usize> = taken.iter().map(|(_, s)| s.main.pos).collect();
        let outs = {
            let hidden = vec![if self.mtp { Logits::All } else { Logits::Skip }; taken.len()];
            let mut parts: Vec<Part> = taken
                .iter_mut()
                .map(|(i, st)| {
                    let w = &work[*i];
                    let logits = match &w.out {
                        Want::Nothing => Logits::Skip,
                        Want::All => Logits::All,
                        Want::Verify(v) if v.draws.len() > 1 => {
                            st.main.keep_rows = true;
                            Logits::All
                        }
                        Want::Last | Want::Sample(_) | Want::Verify(_) => Logits::Last,
                    };
                    Part { ids: w.ids, state: &mut st.main, logits }
                })
                .collect();
            if towers.iter().all(Vec::is_empty) {
                Ok(self.weights.forward_batch_hidden(&mut parts, &hidden))
            } else {
                let rows: Vec<Vec<ImageRows>> = towers
                    .iter()
                    .map(|t| t.iter().map(|(rows, grid)| ImageRows { rows, grid: *grid }).collect())
                    .collect();
                let refs: Vec<&[ImageRows]> = rows.iter().map(Vec::as_slice).collect();
                self.weights.forward_batch_mm(&mut parts, &refs, &hidden)
            }
        };
        let outs = match outs {
            Ok(o) => o,
            Err(e) => {
                // (checked before anything was computed: the states are as they were)
                let mut t = self.slots.lock();
                for (i, st) in taken {
                    t.put(work[i].seq, st);
                    results[i] = Some(Err(anyhow!("{e:#}")));
                }
                drop(t);
                return results.into_iter().map(|r| r.unwrap_or_else(|| Err(anyhow!("internal: no result")))).collect();
            }
        };
        let (logits, hidden): (Vec<Vec<f32>>, Vec<Vec<f32>>) = outs.into_iter().map(|o| (o.logits, o.hidden)).unzip();
        let mut done: Vec<Result<Output>> = taken
            .par_iter()
            .zip(logits)
            .map(|((i, _), mut l)| {
                let w = &work[*i];
                let m = verify_rows(&w.out);
                if m > 1 {
                    // Only the drawn rows (the last m).
                    let v = l.len() / w.ids.len();
                    l.drain(..(w.ids.len() - m) * v);
                }
                finish_item(&w.out, w.ids, l)
            })
            .collect();
        // Back to the last accepted draft.
        for (j, ((i, st), start)) in taken.iter_mut().zip(&starts).enumerate() {
            let w = &work[*i];
            let kept = match &done[j] {
                Ok(Output::Drafted { tokens, .. }) => w.ids.len() + tokens.len() - verify_rows(&w.out),
                _ => w.ids.len(),
            };
            if let Err(e) = st.main.rewind(start + kept) {
                done[j] = Err(anyhow!("cannot go back to the last accepted draft: {e:#}"));
            }
        }
        if self.mtp {
            self.mtp_step(work, &mut taken, &hidden, &mut done);
        }
        {
            let mut t = self.slots.lock();
            for ((i, st), r) in taken.into_iter().zip(done) {
                t.put(work[i].seq, st);
                results[i] = Some(r);
            }
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(anyhow!("internal: step item without a result")))).collect()
    }
}

impl CpuBackend {
    /// A verify item's shape: draws over some of its rows, drafts within [`Backend::max_drafts`].
    fn check_verify(&self, w: &Work) -> Result<()> {
        let Want::Verify(v) = &w.out else { return Ok(()) };
        if !self.mtp {
            bail!("speculative decoding is off on this backend (a model without an MTP block, or not asked for)");
        }
        if v.draws.is_empty() || v.draws.len() > w.ids.len() || v.draws.len() > CPU_MAX_DRAFTS + 1 {
            bail!("a verify item draws {} rows of {} ids (1 to {})", v.draws.len(), w.ids.len(), CPU_MAX_DRAFTS + 1);
        }
        if v.drafts > CPU_MAX_DRAFTS {
            bail!("{} drafts asked for; this backend drafts at most {CPU_MAX_DRAFTS}", v.drafts);
        }
        Ok(())
    }
}

/// A backend that emits a fixed token script whatever the prompt: for testing the text and HTTP paths
/// (reasoning, tool calls) with exact model output. Token `i` of the reply is `script[i]`, then the last id
/// repeats; the reply starts over after a read of several ids, a prompt chunk ([`Want::Nothing`]) or a fork, so a
/// prompt read in chunks or partly from the prefix cache gets the same reply. Its logits put 30 on the scripted
/// id and 0 elsewhere; tokens are drawn from them by [`sample_host`].
pub struct ScriptedBackend {
    vocab: usize,
    script: Vec<u32>,
    slots: Slots<Scripted>,
}

#[derive(Clone)]
struct Scripted {
    read: usize,
    calls: usize,
}

impl ScriptedBackend {
    pub fn new(vocab: usize, script: Vec<u32>) -> ScriptedBackend {
        ScriptedBackend { vocab, script, slots: Slots::default() }
    }

    fn logits(&self, next: u32) -> Vec<f32> {
        let mut logits = vec![0.0; self.vocab];
        if let Some(l) = logits.get_mut(next as usize) {
            *l = 30.0;
        }
        logits
    }
}

impl Backend for ScriptedBackend {
    fn name(&self) -> &str {
        "scripted"
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn alloc(&self, tokens: usize) -> Result<SeqId, AllocError> {
        Ok(self.slots.lock().insert(Scripted { read: 0, calls: 0 }, tokens, 0))
    }

    fn fork(&self, seq: SeqId, tokens: usize) -> Result<SeqId, AllocError> {
        let mut t = self.slots.lock();
        let s = t.get(seq).and_then(|s| s.state.clone()).ok_or(AllocError::Unknown(seq))?;
        Ok(t.insert(Scripted { read: s.read, calls: 0 }, tokens.max(s.read), 0))
    }

    fn free(&self, seq: SeqId) {
        self.slots.lock().remove(seq);
    }

    fn len(&self, seq: SeqId) -> Option<usize> {
        self.slots.lock().get(seq)?.state.as_ref().map(|s| s.read)
    }

    fn state_bytes(&self, seq: SeqId) -> usize {
        self.len(seq).map_or(0, |n| 64 + 4 * n)
    }

    fn step(&self, work: &[Work]) -> Vec<Result<Output>> {
        // The scripted id of each item, under the lock; the sampling after it.
        let next: Vec<Result<u32>> = {
            let mut t = self.slots.lock();
            let taken = t.take(work);
            work.iter()
                .zip(taken)
                .map(|(w, got)| {
                    let (mut s, reserved) = got?;
                    let checked = check_item(w, self.vocab, s.read, reserved);
                    if checked.is_ok() {
                        s.read += w.ids.len();
                        if w.ids.len() > 1 || matches!(w.out, Want::Nothing) {
                            s.calls = 0;
                        }
                    }
                    let next = self.script.get(s.calls.min(self.script.len().saturating_sub(1))).copied();
                    s.calls += 1;
                    t.put(w.seq, s);
                    checked?;
                    next.ok_or_else(|| anyhow!("the scripted backend has an empty script"))
                })
                .collect()
        };
        work.iter()
            .zip(next)
            .map(|(w, next)| {
                if matches!(w.out, Want::Verify(_)) {
                    bail!("the scripted backend has no verify pass (max_drafts is 0)");
                }
                let rows = if matches!(w.out, Want::All) { w.ids.len() } else { 1 };
                finish_item(&w.out, w.ids, self.logits(next?).repeat(rows))
            })
            .collect()
    }
}

/// A backend that keeps its sequences in `inner` and runs each step through `hook(inner, work)`: for tests that
/// delay, fail, panic or log steps without writing a whole backend.
pub struct StepHook<B, F> {
    pub inner: B,
    pub hook: F,
}

impl<B, F> Backend for StepHook<B, F>
where
    B: Backend,
    F: Fn(&B, &[Work]) -> Vec<Result<Output>> + Send + Sync,
{
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn alloc(&self, tokens: usize) -> Result<SeqId, AllocError> {
        self.inner.alloc(tokens)
    }
    fn fork(&self, seq: SeqId, tokens: usize) -> Result<SeqId, AllocError> {
        self.inner.fork(seq, tokens)
    }
    fn free(&self, seq: SeqId) {
        self.inner.free(seq)
    }
    fn len(&self, seq: SeqId) -> Option<usize> {
        self.inner.len(seq)
    }
    fn state_bytes(&self, seq: SeqId) -> usize {
        self.inner.state_bytes(seq)
    }
    fn state_memory(&self) -> Option<StateMemory> {
        self.inner.state_memory()
    }
    fn step(&self, work: &[Work]) -> Vec<Result<Output>> {
        (self.hook)(&self.inner, work)
    }
    fn step_tokens(&self) -> usize {
        self.inner.step_tokens()
    }
    fn max_seqs(&self) -> usize {
        self.inner.max_seqs()
    }
    fn max_drafts(&self) -> usize {
        self.inner.max_drafts()
    }
    fn verify_cost(&self, drafts: usize) -> Option<f64> {
        self.inner.verify_cost(drafts)
    }
    fn image_token_id(&self) -> Option<u32> {
        self.inner.image_token_id()
    }
    fn set_images(&self, seq: SeqId, images: &[Image]) -> Result<()> {
        self.inner.set_images(seq, images)
    }
}
