//! Sampling on the device: one launch of `sample_rows` (crates/tern-kernels/cuda/sample.cu, whose header states the
//! algorithm) draws a token for every row of a logits matrix `[B, vocab]`, so that only the chosen ids and the
//! requested log-probabilities cross to the host.
//!
//! * [`SampleBatch`] packs a list of [`Sample`]s (masks already resolved) into the kernel's arrays: one
//!   [`SampleRow`] per row, the penalty pairs counted from each history, the logit-bias pairs and the mask words.
//! * [`sample_reference`] is the kernel's algorithm in plain Rust, step for step (the same keys, thresholds,
//!   fixed-point masses, `exp_det`, random generator and id-order scan; the top-k set by a radix select where the
//!   kernel first tries a counting prefilter, the same set either way; the log-probabilities' f64 sums in another
//!   order), for the tests: it matches [`tern_engine::sample_host`] in distribution, and in ids on the top-k path.
//! * [`Gpu::sample_download`] is the checked launch (the batch in one copy into buffers kept between draws) and
//!   returns the raw outputs; [`Gpu::sample_logits`] returns them as [`Sampled`]s.
//!
//! Unlike the host sampler, non-finite parameters and logit biases are refused, at most [`MAX_TOP`] top
//! log-probabilities are returned, NaN logits count as -inf in the log-probabilities too, ties at the last top
//! log-probability go to the lower ids, and +inf logits share the mass equally.

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};
use tern_engine::{Sample, Sampled, TokenLogprob};

use crate::gpu::{cfg, Gpu};

/// Threads per row (one block).
pub const THREADS: usize = 1024;
/// The largest top_k drawn by selecting and sorting the candidates (path (a)); a larger one is a threshold.
pub const KMAX: usize = 1024;
/// The most top log-probabilities a row returns.
pub const MAX_TOP: usize = 20;
/// The longest row (fixed-point masses of 2^20 weights <= 1 at scale 2^43 sum to at most 2^63: a u64 holds them).
pub const MAX_VOCAB: usize = 1 << 20;
/// [`SampleOut::status`]: a token was drawn.
pub const STATUS_OK: u32 = 0;
/// [`SampleOut::status`]: the mask allows no id below the limit.
pub const STATUS_NO_TOKEN: u32 = 1;
/// Composite keys at or above this have a logit above -inf.
const LO_FINITE: u64 = 0x0080_0000 << 32;
const FX_SCALE: f64 = 8796093022208.0; // 2^43

/// One row's parameters (`SampleRow` in sample.cu). Built by [`SampleBatch::push`], which keeps its slices inside the
/// batch's arrays.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleRow {
    pub temperature: f32,
    /// 0: no cut (also for a top_k at or past the limit).
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Ids at or past this are never read (1..=vocab).
    pub limit: u32,
    pub seed: u64,
    /// -1: no log-probabilities; else the chosen token's and this many top entries (<= [`MAX_TOP`]).
    pub logprobs: i32,
    pub pen_off: u32,
    pub pen_len: u32,
    pub bias_off: u32,
    pub bias_len: u32,
    /// Offset of the row's `limit.div_ceil(32)` mask words, or -1.
    pub mask_off: i32,
}

/// A penalised id and how often the history holds it; `raw` is scratch (the kernel stores the logit it changed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplePenalty {
    pub id: u32,
    pub count: u32,
    pub raw: f32,
}

/// A logit bias; `raw` as in [`SamplePenalty`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleBias {
    pub id: u32,
    pub bias: f32,
    pub raw: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleTop {
    pub id: u32,
    pub logprob: f32,
}

/// One row's result (`SampleOut` in sample.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleOut {
    pub token: u32,
    pub status: u32,
    pub logprob: f32,
    pub n_top: u32,
    pub top: [SampleTop; MAX_TOP],
}

const _: () = assert!(
    std::mem::size_of::<SampleRow>() == 64
        && std::mem::size_of::<SamplePenalty>() == 12
        && std::mem::size_of::<SampleBias>() == 12
        && std::mem::size_of::<SampleOut>() == 176
);

// SAFETY: #[repr(C)] structs of 4- and 8-byte integers and floats laid out without padding (sizes asserted above and
// in sample.cu), valid for every bit pattern, all-zero included.
unsafe impl DeviceRepr for SampleRow {}
unsafe impl ValidAsZeroBits for SampleRow {}
unsafe impl DeviceRepr for SamplePenalty {}
unsafe impl ValidAsZeroBits for SamplePenalty {}
unsafe impl DeviceRepr for SampleBias {}
unsafe impl ValidAsZeroBits for SampleBias {}
unsafe impl DeviceRepr for SampleOut {}
unsafe impl ValidAsZeroBits for SampleOut {}

/// The kernel's inputs for a batch of rows of `vocab` logits each.
#[derive(Clone, Debug)]
pub struct SampleBatch {
    vocab: usize,
    rows: Vec<SampleRow>,
    pens: Vec<SamplePenalty>,
    biases: Vec<SampleBias>,
    masks: Vec<u32>,
}

/// The offset of `add` more entries after `have` (u32, the kernel's index type, for the end as well).
fn offset(have: usize, add: usize, what: &str) -> Result<u32> {
    u32::try_from(have + add).map(|_| have as u32).with_context(|| format!("too many {what} in one batch"))
}

impl SampleBatch {
    /// An empty batch for logits rows of `vocab` values (the row stride of the matrix).
    pub fn new(vocab: usize) -> Result<SampleBatch> {
        ensure!(vocab > 0, "no logits to sample from");
        ensure!(vocab <= MAX_VOCAB, "a vocabulary of {vocab} is more than the GPU sampler takes ({MAX_VOCAB})");
        Ok(SampleBatch { vocab, rows: Vec::new(), pens: Vec::new(), biases: Vec::new(), masks: Vec::new() })
    }

    /// Append the row of `s`, with its mask already resolved ([`tern_engine::MaskSlot::wait`]; the bitset of
    /// [`tern_engine::mask_allows`]). On an error the batch is unchanged, so that one bad request fails alone.
    pub fn push(&mut self, s: &Sample, mask: Option<&[u32]>) -> Result<()> {
        let p = s.params;
        for (name, v) in [
            ("temperature", p.temperature),
            ("top_p", p.top_p),
            ("min_p", p.min_p),
            ("repetition_penalty", p.repetition_penalty),
            ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty),
        ] {
            ensure!(v.is_finite(), "sampling parameter {name} is {v}, not a finite number");
        }
        if let Some((id, b)) = p.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            bail!("the logit bias of token {id} is {b}, not a finite number");
        }
        let logprobs = match s.top_logprobs {
            None => -1,
            Some(k) if k <= MAX_TOP => k as i32,
            Some(k) => bail!("top_logprobs {k} is more than the {MAX_TOP} the GPU sampler returns"),
        };
        let limit = s.limit.clamp(1, self.vocab);
        let nw = limit.div_ceil(32);
        let mask_off = match mask {
            Some(_) => i32::try_from(self.masks.len() + nw)
                .map(|_| self.masks.len() as i32)
                .context("too many mask words in one batch")?,
            None => -1,
        };
        let mut pens = Vec::new();
        if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &id in s.history.iter().filter(|&&id| (id as usize) < limit) {
                let c = counts.entry(id).or_default();
                *c = c.saturating_add(1);
            }
            pens = counts.into_iter().map(|(id, count)| SamplePenalty { id, count, raw: 0.0 }).collect();
            pens.sort_unstable_by_key(|e| e.id);
        }
        let mut biases: Vec<SampleBias> = (p.logit_bias.iter())
            .filter(|(&id, _)| (id as usize) < limit)
            .map(|(&id, &bias)| SampleBias { id, bias, raw: 0.0 })
            .collect();
        biases.sort_unstable_by_key(|e| e.id);
        let pen_off = offset(self.pens.len(), pens.len(), "penalty entries")?;
        let bias_off = offset(self.biases.len(), biases.len(), "logit biases")?;
        self.rows.push(SampleRow {
            // min-p above 1 keeps only the first candidate (the host's `keep.max(1)`): the argmax, first on ties
            temperature: if p.min_p > 1.0 { 0.0 } else { p.temperature },
            top_k: if p.top_k >= limit { 0 } else { p.top_k as u32 },
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            limit: limit as u32,
            seed: s.seed,
            logprobs,
            pen_off,
            pen_len: pens.len() as u32,
            bias_off,
            bias_len: biases.len() as u32,
            mask_off,
        });
        self.pens.extend(pens);
        self.biases.extend(biases);
        if let Some(words) = mask {
            // exactly the row's words: ids past the given words are not allowed
            self.masks.extend(words.iter().take(nw));
            self.masks.resize(mask_off as usize + nw, 0);
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Logits per row.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    pub fn rows(&self) -> &[SampleRow] {
        &self.rows
    }

    /// The kernel's (or the reference's) outputs, row by row, as the engine's results.
    pub fn sampled(&self, outs: &[SampleOut]) -> Vec<Result<Sampled>> {
        self.rows.iter().zip(outs).map(|(row, out)| sampled(row, out)).collect()
    }

    /// The arrays as the kernel reads them, in one buffer: the rows, then the penalties, biases and mask words
    /// (each 4-byte aligned; the rows' 8-byte fields at offset 0) and the word offsets of those three.
    fn pack(&self) -> Result<(Vec<u32>, [usize; 3])> {
        ensure!(!self.rows.is_empty(), "no rows to sample");
        let mut words: Vec<u32> =
            Vec::with_capacity(16 * self.rows.len() + 3 * (self.pens.len() + self.biases.len()) + self.masks.len());
        words.extend_from_slice(as_words(&self.rows));
        let pens = words.len();
        words.extend_from_slice(as_words(&self.pens));
        let biases = words.len();
        words.extend_from_slice(as_words(&self.biases));
        let masks = words.len();
        words.extend_from_slice(&self.masks);
        Ok((words, [pens, biases, masks]))
    }
}

/// The sampler's device buffers, kept between launches (one copy a draw instead of five allocations, copies and
/// frees; on the H200 that changed the single-stream sampled rate by less than its noise): the packed batch and
/// the outputs.
pub(crate) struct SampleScratch {
    words: CudaSlice<u32>,
    out: CudaSlice<SampleOut>,
    /// sample.cu's `SamplePre` (a lone row's first passes over the whole GPU), as bytes.
    pre: CudaSlice<u8>,
    /// argmax_rows' keys, one a row (as long as `out`).
    keys: CudaSlice<u64>,
}

/// Bytes of sample.cu's `SamplePre`: two u64, two u32, the prefilter's 2,048 counts and [`KMAX`] u64 candidates.
const PRE_BYTES: usize = 8 + 8 + 4 + 4 + 4 * 2048 + 8 * KMAX;

/// A batch whose one row takes path (a) of sample.cu (0 < top_k <= KMAX, temperature > 0) with nothing that
/// changes its logits (no mask, bias or penalty) and no log-probabilities: its first three passes go over the
/// whole GPU (sample_pre_*), the same id bit for bit.
fn lone_topk_row(rows: &[SampleRow]) -> Option<&SampleRow> {
    match rows {
        [r] if r.temperature > 0.0
            && r.top_k > 0
            && r.top_k as usize <= KMAX
            && r.logprobs < 0
            && r.mask_off < 0
            && r.pen_len == 0
            && r.bias_len == 0 =>
        {
            Some(r)
        }
        _ => None,
    }
}

/// A batch of plain greedy rows (temperature <= 0; no mask, bias, penalty or log-probabilities): sample.cu's
/// argmax_rows draws them, the ids sample_rows draws (its step 6), over the whole GPU.
fn plain_greedy(rows: &[SampleRow]) -> bool {
    !rows.is_empty()
        && rows
            .iter()
            .all(|r| r.temperature <= 0.0 && r.logprobs < 0 && r.mask_off < 0 && r.pen_len == 0 && r.bias_len == 0)
}

/// The 4-byte words of a slice of the kernel's parameter structs.
fn as_words<T: DeviceRepr>(v: &[T]) -> &[u32] {
    const { assert!(std::mem::size_of::<T>() % 4 == 0 && std::mem::align_of::<T>() >= 4) };
    // SAFETY: T is one of the #[repr(C)] structs above (no padding, sizes multiples of 4 and alignment >= 4,
    // asserted): its bytes are initialised and may be read as u32 words.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u32, std::mem::size_of_val(v) / 4) }
}

/// One row's output as the engine's result: the mask's "no token" as an error, log-probabilities if asked.
pub fn sampled(row: &SampleRow, out: &SampleOut) -> Result<Sampled> {
    match out.status {
        STATUS_OK => {}
        STATUS_NO_TOKEN => bail!("the output constraint allows no token here"),
        s => bail!("the GPU sampler returned an unknown status {s}"),
    }
    ensure!(out.token < row.limit, "the GPU sampler drew id {}, past the limit {}", out.token, row.limit);
    let logprob = (row.logprobs >= 0).then(|| TokenLogprob {
        token: out.token,
        logprob: out.logprob,
        top: out.top[..(out.n_top as usize).min(MAX_TOP)].iter().map(|t| (t.id, t.logprob)).collect(),
    });
    Ok(Sampled { token: out.token, logprob })
}

impl Gpu {
    /// Draw one token for each row `b < batch.len()` of `logits` (`[rows, vocab]` row-major, `vocab` = the batch's)
    /// and download the raw outputs. The rows' logits are overwritten (scratch). The batch goes to the device in one
    /// copy into buffers kept for the next draw (grown when a batch needs more).
    pub fn sample_download(&self, logits: &mut CudaSlice<f32>, batch: &SampleBatch) -> Result<Vec<SampleOut>> {
        let (b, vocab) = (batch.len(), batch.vocab);
        let (words, [pens, biases, masks]) = batch.pack()?;
        ensure!(b <= i32::MAX as usize, "sample_rows: {b} rows");
        ensure!(logits.len() >= b * vocab, "sample_rows: {} logits for {b} rows of {vocab}", logits.len());
        let mut guard = self.sampler.lock().map_err(|_| anyhow::anyhow!("sampler buffers poisoned"))?;
        let held = guard.as_ref().and_then(|s| s.downcast_ref::<SampleScratch>());
        if held.is_none_or(|s| s.words.len() < words.len() || s.out.len() < b) {
            let (nw, no) = (words.len().next_power_of_two().max(4096), b.next_power_of_two().max(64));
            *guard = Some(Box::new(SampleScratch {
                words: self.zeros(nw)?,
                out: self.zeros(no)?,
                pre: self.zeros(PRE_BYTES)?,
                keys: self.zeros(no)?,
            }));
        }
        let sc = guard.as_mut().and_then(|s| s.downcast_mut::<SampleScratch>()).context("sampler buffers")?;
        self.stream.memcpy_htod(&words, &mut sc.words.slice_mut(..words.len()))?;
        let ld = vocab as i64;
        let base = sc.words.device_ptr(&self.stream).0;
        let [pens, biases, masks] = [pens, biases, masks].map(|w| base + 4 * w as u64);
        if plain_greedy(&batch.rows) && b <= 65_535 {
            self.stream.memset_zeros(&mut sc.keys.slice_mut(..b))?;
            let split = (2 * self.sms as usize / b).clamp(1, 64) as u32;
            let mut l = self.launcher(&self.f.argmax_rows);
            l.arg(&*logits).arg(&ld).arg(&base).arg(&sc.keys);
            // SAFETY: matches argmax_rows in sample.cu: grid (split, b <= 65,535, the grid's y limit), row b reads
            // logits[b*vocab .. b*vocab + limit] (limit <= vocab, SampleBatch::push; inside the length checked above;
            // NaNs there become -inf: the rows are scratch, held mutably) and adds its maximum into keys[b] (b <= the
            // keys' length, grown with the outputs above; zeroed just before).
            unsafe { l.launch(cfg((split, b as u32), 256, 0)) }?;
            let keys = self.stream.clone_dtoh(&sc.keys.slice(..b))?;
            let out = |k: &u64| SampleOut {
                token: !(*k as u32),
                status: STATUS_OK,
                logprob: 0.0,
                n_top: 0,
                top: [SampleTop::default(); MAX_TOP],
            };
            return Ok(keys.iter().map(out).collect());
        }
        let mut pre = crate::gpu::NULL;
        if let Some(r) = lone_topk_row(&batch.rows) {
            let (n, k) = (r.limit as i32, r.top_k as i32);
            ensure!(r.limit as usize <= vocab, "sample_pre: limit {} over the row of {vocab}", r.limit);
            self.stream.memset_zeros(&mut sc.pre)?;
            let grid = cfg((2 * self.sms, 1), 256, 0);
            let mut l = self.launcher(&self.f.sample_pre_max);
            l.arg(&*logits).arg(&n).arg(&sc.pre);
            // SAFETY: matches sample_pre_max in sample.cu: row 0's first n <= vocab logits (inside the length checked
            // above), the SamplePre just zeroed (PRE_BYTES, sample.cu's layout).
            unsafe { l.launch(grid) }?;
            let mut l = self.launcher(&self.f.sample_pre_hist);
            l.arg(&*logits).arg(&n).arg(&sc.pre);
            // SAFETY: as sample_pre_max (reads the row and the maximum it wrote; static shared memory).
            unsafe { l.launch(grid) }?;
            let mut l = self.launcher(&self.f.sample_pre_gather);
            l.arg(&*logits).arg(&n).arg(&k).arg(&sc.pre);
            // SAFETY: as sample_pre_max; at most KMAX candidates are stored (k <= KMAX checked by lone_topk_row).
            unsafe { l.launch(grid) }?;
            pre = sc.pre.device_ptr(&self.stream).0;
        }
        let mut l = self.launcher(&self.f.sample_rows);
        l.arg(&*logits).arg(&ld).arg(&base).arg(&pens).arg(&biases).arg(&masks).arg(&sc.out).arg(&pre);
        // SAFETY: matches sample_rows in sample.cu (1024 threads, static shared memory); one block per row of the
        // batch, b <= the outputs' length (grown above); the rows were built by SampleBatch::push for this vocab:
        // limit <= vocab (row b reads and writes logits[b*vocab .. b*vocab + limit], inside the length checked
        // above), the penalty, bias and mask slices inside the packed arrays (copied whole into `words`, each array
        // at its word offset, the rows at 0: 8-byte aligned), entry ids unique and below the limit, mask_off -1 or
        // ceil(limit/32) words; `pre` null or the SamplePre that sample_pre_* filled for the batch's one row.
        unsafe { l.launch(cfg((b as u32, 1), THREADS as u32, 0)) }?;
        Ok(self.stream.clone_dtoh(&sc.out.slice(..b))?)
    }

    /// Sample every row of the batch from `logits` (overwritten): one result per row, in order.
    pub fn sample_logits(&self, logits: &mut CudaSlice<f32>, batch: &SampleBatch) -> Result<Vec<Result<Sampled>>> {
        Ok(batch.sampled(&self.sample_download(logits, batch)?))
    }
}

// ---- the kernel's arithmetic, bit for bit ----

/// Order-preserving key of a float (total order; NaN never reaches here).
fn ord_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

fn key_value(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 { k & 0x7fff_ffff } else { !k })
}

/// Larger key = drawn first: logit descending, then id ascending.
fn comp_key(v: f32, i: usize) -> u64 {
    (u64::from(ord_key(v)) << 32) | u64::from(!(i as u32))
}

fn comp_value(c: u64) -> f32 {
    key_value((c >> 32) as u32)
}

fn comp_id(c: u64) -> u32 {
    !(c as u32)
}

/// `exp_det` of sample.cu: exp(x) for x <= 0 from IEEE-exact operations only (~2 ulp); 0 below -86 and for NaN.
/// The constants are given by their bits, as in sample.cu: log2(e), ln 2 in two parts, 1/7! .. 1/3!.
pub fn exp_det(x: f32) -> f32 {
    if x.is_nan() || x < -86.0 {
        return 0.0;
    }
    let c = f32::from_bits;
    let n = (x * c(0x3fb8_aa3b)).round_ties_even();
    let r = n.mul_add(-c(0x3f31_7200), x);
    let r = n.mul_add(-c(0x35bf_be8e), r);
    let mut p = c(0x3950_0d01);
    for k in [c(0x3ab6_0b61), c(0x3c08_8889), c(0x3d2a_aaab), c(0x3e2a_aaab), 0.5, 1.0, 1.0] {
        p = p.mul_add(r, k);
    }
    p * c(((n as i32 + 127) as u32) << 23)
}

/// Path (b) weight: exp((v - m) / T) with `inv_t` = 1/T; 1 at the maximum.
fn weight_b(v: f32, m: f32, inv_t: f64) -> f32 {
    if v == m {
        1.0
    } else {
        exp_det(((f64::from(v) - f64::from(m)) * inv_t) as f32)
    }
}

fn fixed_weight(v: f32, m: f32, inv_t: f64) -> u64 {
    (f64::from(weight_b(v, m, inv_t)) * FX_SCALE) as u64
}

/// The first `next_f64()` of tern-text's xoshiro256** seeded through splitmix64: it reads only the second state
/// word.
fn first_uniform(seed: u64) -> f64 {
    let (mut xs, mut s1) = (seed, 0u64);
    for _ in 0..2 {
        xs = xs.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = xs;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        s1 = z ^ (z >> 31);
    }
    let r = s1.wrapping_mul(5).rotate_left(7).wrapping_mul(9);
    (r >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Every composite key >= `lo` of `x`, descending.
fn keys_desc(x: &[f32], lo: u64) -> Vec<u64> {
    let mut k: Vec<u64> = x.iter().enumerate().map(|(i, &v)| comp_key(v, i)).filter(|&c| c >= lo).collect();
    k.sort_unstable_by(|a, b| b.cmp(a));
    k
}

/// A reference draw: the kernel's output, and how close the draw came to choosing a neighbour: the distance of the
/// target from the nearest edge of the chosen token's interval, relative to the total (infinite without a draw,
/// 0 where a rounding fallback chose).
#[derive(Clone, Debug, PartialEq)]
pub struct RefSample {
    pub out: SampleOut,
    pub margin: f64,
}

/// The kernel's algorithm on the host, row by row: `logits` is the `[batch.len(), batch.vocab()]` matrix (not
/// modified).
pub fn sample_reference(logits: &[f32], batch: &SampleBatch) -> Result<Vec<RefSample>> {
    let v = batch.vocab;
    ensure!(logits.len() >= batch.len() * v, "{} logits for {} rows of {v}", logits.len(), batch.len());
    Ok(batch.rows.iter().enumerate().map(|(b, row)| reference_row(&logits[b * v..(b + 1) * v], row, batch)).collect())
}

fn reference_row(raw: &[f32], p: &SampleRow, batch: &SampleBatch) -> RefSample {
    let n = p.limit as usize;
    let mut x: Vec<f32> = raw[..n].iter().map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v }).collect();
    let mut out = SampleOut::default();
    let mut lse = 0.0;
    if p.logprobs >= 0 {
        let m = comp_value(x.iter().enumerate().map(|(i, &v)| comp_key(v, i)).max().unwrap_or(0));
        let s: f64 = x.iter().map(|&v| f64::from(exp_det(v - m))).sum();
        lse = f64::from(m) + s.ln();
        let ntop = (p.logprobs as usize).min(n).min(MAX_TOP);
        for (t, &c) in out.top.iter_mut().zip(&keys_desc(&x, 0)[..ntop]) {
            *t = SampleTop { id: comp_id(c), logprob: (f64::from(comp_value(c)) - lse) as f32 };
        }
        out.n_top = ntop as u32;
    }
    let words = (p.mask_off >= 0).then(|| &batch.masks[p.mask_off as usize..p.mask_off as usize + n.div_ceil(32)]);
    let allowed = |words: &[u32], i: usize| words[i / 32] >> (i % 32) & 1 == 1;
    let mut first = 0;
    if let Some(words) = words {
        let Some(f) = (0..n).find(|&i| allowed(words, i)) else {
            let out = SampleOut { status: STATUS_NO_TOKEN, ..SampleOut::default() };
            return RefSample { out, margin: f64::INFINITY };
        };
        first = f as u32;
        for (i, l) in x.iter_mut().enumerate() {
            if !allowed(words, i) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    let biases = &batch.biases[p.bias_off as usize..(p.bias_off + p.bias_len) as usize];
    let pens = &batch.pens[p.pen_off as usize..(p.pen_off + p.pen_len) as usize];
    let mut saved: HashMap<u32, f32> = HashMap::new();
    for e in biases {
        saved.insert(e.id, x[e.id as usize]);
        x[e.id as usize] += e.bias;
    }
    let rep = p.repetition_penalty;
    for e in pens {
        let l = &mut x[e.id as usize];
        saved.entry(e.id).or_insert(*l);
        if rep != 1.0 && rep > 0.0 {
            *l = if *l > 0.0 { *l / rep } else { *l * rep };
        }
        *l -= p.presence_penalty + p.frequency_penalty * e.count as f32;
    }
    let cm = x.iter().enumerate().map(|(i, &v)| comp_key(v + 0.0, i)).max().unwrap_or(0);
    let (mut token, mut margin) = (comp_id(cm), f64::INFINITY);
    if p.temperature > 0.0 && cm >= LO_FINITE {
        let u = first_uniform(p.seed);
        (token, margin) = if p.top_k > 0 && p.top_k as usize <= KMAX {
            ref_draw_topk(&x, p, u)
        } else {
            ref_draw_scan(&x, p, comp_value(cm), u)
        };
    }
    if let Some(words) = words {
        if !allowed(words, token as usize) {
            token = first;
        }
    }
    if p.logprobs >= 0 {
        let raw = saved.get(&token).copied().unwrap_or(x[token as usize]);
        out.logprob = (f64::from(raw) - lse) as f32;
    }
    out.token = token;
    RefSample { out, margin }
}

/// Path (a): the host's steps on the top_k best candidates.
fn ref_draw_topk(x: &[f32], p: &SampleRow, u: f64) -> (u32, f64) {
    let mut cands = keys_desc(x, LO_FINITE);
    cands.truncate(p.top_k as usize);
    let (mx, temp) = (f64::from(comp_value(cands[0])), f64::from(p.temperature));
    let w: Vec<f64> = cands
        .iter()
        .map(|&c| {
            let l = f64::from(comp_value(c));
            if l == mx {
                1.0
            } else {
                ((l - mx) / temp).exp()
            }
        })
        .collect();
    let total = w.iter().fold(0.0, |a, b| a + b);
    let mut keep = w.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        if let Some(j) = w.iter().position(|wj| {
            acc += wj / total;
            acc >= f64::from(p.top_p)
        }) {
            keep = j + 1;
        }
    }
    if p.min_p > 0.0 {
        keep = w[..keep].iter().take_while(|&&wj| wj >= f64::from(p.min_p)).count().max(1);
    }
    let t = w[..keep].iter().fold(0.0, |a, b| a + b);
    let mut target = u * t;
    for (j, &wj) in w[..keep].iter().enumerate() {
        let before = target;
        target -= wj;
        if target < 0.0 {
            return (comp_id(cands[j]), before.min(wj - before) / t);
        }
    }
    (comp_id(cands[keep - 1]), 0.0)
}

/// Path (b): the thresholds, then the kernel's id-order scan with its per-thread ranges and summation order.
fn ref_draw_scan(x: &[f32], p: &SampleRow, m: f32, u: f64) -> (u32, f64) {
    let n = x.len();
    let inv_t = 1.0 / f64::from(p.temperature);
    let mut lo = LO_FINITE;
    let keys = if p.top_k > 0 || p.top_p < 1.0 { keys_desc(x, LO_FINITE) } else { Vec::new() };
    if p.top_k > 0 && keys.len() >= p.top_k as usize {
        lo = keys[p.top_k as usize - 1];
    }
    if p.top_p < 1.0 {
        let kept = || keys.iter().copied().take_while(|&c| c >= lo);
        let total: u64 = kept().map(|c| fixed_weight(comp_value(c), m, inv_t)).sum();
        let need = f64::from(p.top_p) * total as f64;
        let mut acc = 0u64;
        if let Some(c) = kept().find(|&c| {
            acc += fixed_weight(comp_value(c), m, inv_t);
            acc as f64 >= need
        }) {
            lo = c;
        }
    }
    let mp = if p.min_p > 0.0 { p.min_p.min(1.0) } else { 0.0 };
    let weight = |i: usize| -> Option<f32> {
        let w = (comp_key(x[i], i) >= lo).then(|| weight_b(x[i], m, inv_t))?;
        (w >= mp).then_some(w)
    };
    let per = n.div_ceil(THREADS);
    let range = |t: usize| (t * per).min(n)..((t * per).min(n) + per).min(n);
    let sums: Vec<f64> = (0..THREADS).map(|t| range(t).filter_map(weight).fold(0.0, |a, w| a + f64::from(w))).collect();
    let mut inc = vec![0.0f64; THREADS];
    let (mut warp_total, mut base) = (0.0f64, 0.0f64);
    for w in 0..THREADS / 32 {
        base += warp_total;
        let mut a = 0.0;
        for j in 0..32 {
            a += sums[32 * w + j];
            inc[32 * w + j] = a;
        }
        warp_total = a;
        for v in &mut inc[32 * w..32 * w + 32] {
            *v += base;
        }
    }
    let total = inc[THREADS - 1];
    let target = u * total;
    let prev = |t: usize| if t == 0 { 0.0 } else { inc[t - 1] };
    let winner = (0..THREADS).filter(|&t| prev(t) <= target && inc[t] > prev(t)).max().unwrap_or(0);
    let mut acc = prev(winner);
    let mut last = 0;
    for i in range(winner) {
        let Some(w) = weight(i).filter(|&w| w > 0.0) else { continue };
        last = i;
        let before = acc;
        acc += f64::from(w);
        if acc > target {
            return (i as u32, (acc - target).min(target - before) / total);
        }
    }
    (last as u32, 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_as_the_host_does() {
        let vals = [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(ord_key(w[0]) < ord_key(w[1]), "{} {}", w[0], w[1]);
            assert_eq!(w[0].total_cmp(&w[1]), ord_key(w[0]).cmp(&ord_key(w[1])));
        }
        for v in vals {
            assert_eq!(key_value(ord_key(v)).to_bits(), v.to_bits());
        }
        // equal logits: the lower id first
        assert!(comp_key(1.0, 3) > comp_key(1.0, 4) && comp_key(1.5, 9) > comp_key(1.0, 0));
        assert!(comp_key(f32::NEG_INFINITY, 0) < LO_FINITE && comp_key(f32::MIN, 1 << 20) >= LO_FINITE);
    }

    /// `radix_search` of sample.cu, one digit level after the other as the block runs it (histogram, then thread 0's
    /// scan of the bins from the top).
    fn radix_search(x: &[f32], lo: u64, need: f64, mass: Option<(f32, f64)>) -> u64 {
        let (mut prefix, mut above) = (0u64, 0u64);
        let mut shift = 56;
        loop {
            let (mut cnt, mut ms) = ([0u64; 256], [0u64; 256]);
            for (i, &v) in x.iter().enumerate() {
                let c = comp_key(v, i);
                if c < lo || (shift < 56 && (c >> (shift + 8)) != prefix) {
                    continue;
                }
                let b = ((c >> shift) & 255) as usize;
                cnt[b] += 1;
                if let Some((m, inv_t)) = mass {
                    ms[b] += fixed_weight(v, m, inv_t);
                }
            }
            let mut cum = 0;
            let Some(b) = (0..256).rev().find(|&b| {
                let f = if mass.is_some() { ms[b] } else { cnt[b] };
                let hit = cnt[b] > 0 && (above + cum + f) as f64 >= need;
                cum += if hit { 0 } else { f };
                hit
            }) else {
                return lo;
            };
            above += cum;
            prefix = (prefix << 8) | b as u64;
            let whole = mass.is_none() && (above + cnt[b]) as f64 == need;
            if cnt[b] == 1 || whole || shift == 0 {
                return (prefix << shift).max(lo);
            }
            shift -= 8;
        }
    }

    /// The kernel's radix search keeps the same sets as the reference's sorted walks: the first k keys (count), the
    /// smallest prefix reaching a mass (top-p), with ties, -inf, a lower bound, and needs past the total.
    #[test]
    fn radix_search_keeps_the_sorted_prefix() {
        let mut s = 1u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            s >> 33
        };
        for trial in 0..300 {
            let n = 1 + (next() % 3000) as usize;
            let x: Vec<f32> = (0..n)
                .map(|_| match next() % 10 {
                    0 => f32::NEG_INFINITY,
                    1..=4 => (next() % 5) as f32 - 2.0, // ties
                    _ => (next() % 100_000) as f32 * 1e-4 - 5.0,
                })
                .collect();
            let keys = keys_desc(&x, LO_FINITE);
            let set = |c: u64| keys.iter().filter(|&&k| k >= c).count();
            for k in [1, 2, 7, 100, 1024, n, n + 5] {
                let want = keys.len().min(k);
                assert_eq!(set(radix_search(&x, LO_FINITE, k as f64, None)), want, "trial {trial} n {n} k {k}");
                let all = radix_search(&x, 0, k as f64, None);
                assert_eq!(x.iter().enumerate().filter(|&(i, &v)| comp_key(v, i) >= all).count(), n.min(k));
            }
            let Some(&top) = keys.first() else { continue };
            let (m, inv_t) = (comp_value(top), 1.0 / 0.8);
            for lo in [LO_FINITE, keys[keys.len() / 2]] {
                let kept: Vec<u64> = keys.iter().copied().filter(|&c| c >= lo).collect();
                let total: u64 = kept.iter().map(|&c| fixed_weight(comp_value(c), m, inv_t)).sum();
                for top_p in [-1.0f64, 0.0, 0.3, 0.9, 0.999, 1.0] {
                    let need = top_p * total as f64;
                    let mut acc = 0;
                    let want = kept
                        .iter()
                        .position(|&c| {
                            acc += fixed_weight(comp_value(c), m, inv_t);
                            acc as f64 >= need
                        })
                        .map_or(kept.len(), |j| j + 1);
                    let got = radix_search(&x, lo, need, Some((m, inv_t)));
                    assert_eq!(set(got.max(lo)), want, "trial {trial} n {n} top_p {top_p}");
                }
            }
        }
    }

    #[test]
    fn exp_det_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=860_000 {
            let x = -(i as f32) * 1e-4;
            let want = f64::from(x).exp();
            let e = (f64::from(exp_det(x)) - want).abs() / want;
            worst = worst.max(e);
        }
        println!("exp_det worst relative error on [-86, 0]: {worst:.2e}");
        assert!(worst < 3.0e-7, "exp_det relative error {worst}");
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-0.0), 1.0);
        assert_eq!(exp_det(-86.5), 0.0);
        assert_eq!(exp_det(f32::NAN), 0.0);
        assert_eq!(exp_det(f32::NEG_INFINITY), 0.0);
    }
}
