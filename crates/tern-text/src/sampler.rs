//! Next-token sampling: logit bias, repetition/presence/frequency penalties, temperature,
//! top-k, top-p, min-p, then a draw from a seeded xoshiro256** generator.

use std::collections::HashMap;
use std::path::Path;

use crate::{read_json, Result};

/// Sampling settings. Neutral values disable a step (`top_k` 0, `top_p` 1, `min_p` 0,
/// `repetition_penalty` 1, presence/frequency 0). `temperature <= 0` means greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// HF-style: logits of seen tokens are divided (if > 0) or multiplied (if < 0) by this.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token seen in `history`.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in `history`.
    pub frequency_penalty: f32,
    /// Added to the logit of the given ids before anything else.
    pub logit_bias: HashMap<u32, f32>,
    /// `None` seeds from OS randomness.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: HashMap::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Defaults from `dir/generation_config.json` (temperature, top_k, top_p, min_p,
    /// repetition_penalty, presence/frequency penalties; `do_sample: false` → greedy).
    /// Missing keys keep [`Default`] values.
    pub fn from_generation_config(dir: impl AsRef<Path>) -> Result<Self> {
        let config = read_json(&dir.as_ref().join("generation_config.json"))?;
        let float = |key: &str, default: f32| config.get(key).and_then(|v| v.as_f64()).map_or(default, |v| v as f32);
        let mut params = Self::default();
        params.temperature = float("temperature", params.temperature);
        params.top_p = float("top_p", params.top_p);
        params.min_p = float("min_p", params.min_p);
        params.repetition_penalty = float("repetition_penalty", params.repetition_penalty);
        params.presence_penalty = float("presence_penalty", params.presence_penalty);
        params.frequency_penalty = float("frequency_penalty", params.frequency_penalty);
        if let Some(k) = config.get("top_k").and_then(|v| v.as_u64()) {
            params.top_k = k as usize;
        }
        if config.get("do_sample").and_then(|v| v.as_bool()) == Some(false) {
            params.temperature = 0.0;
        }
        Ok(params)
    }
}

/// What a draw is made from ([`Sampler::distribution`]).
enum Dist {
    One(u32),
    Weighted(Vec<(u32, f32)>, Vec<f64>),
}

/// Stateful sampler: owns the parameters and the random generator.
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(random_seed);
        Self { params, rng: Xoshiro256::new(seed) }
    }

    /// Whether sampling is the plain argmax of the model's logits (temperature <= 0, no penalties, no logit
    /// bias), so that a backend may pick the token where the logits are ([`Sampler::sample`] gives the same id).
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.logit_bias.is_empty()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `logits` (one per vocabulary id) are modified in place;
    /// `history` is the token sequence penalties apply to (typically the tokens generated so
    /// far). NaN logits count as -inf. Returns 0 for an empty slice; if every logit is -inf,
    /// returns the argmax (the first id).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        match self.distribution(logits, history) {
            Dist::One(id) => id,
            Dist::Weighted(cands, weights) => self.draw(&cands, &weights),
        }
    }

    /// Speculative decoding's check of a `draft` token against the distribution [`Sampler::sample`] would draw
    /// from (rejection sampling with a deterministic draft, as vLLM does for its drafts): the draft is accepted with
    /// its probability p(draft); otherwise a token is drawn from p with the draft taken out, renormalised. The
    /// token returned is distributed exactly as [`Sampler::sample`]'s; greedy (temperature <= 0) accepts the draft
    /// exactly when it is the argmax, else returns the argmax. Returns the token and whether it is the draft
    /// accepted.
    pub fn verify(&mut self, logits: &mut [f32], history: &[u32], draft: u32) -> (u32, bool) {
        match self.distribution(logits, history) {
            Dist::One(id) => (id, id == draft),
            Dist::Weighted(cands, mut weights) => {
                let total: f64 = weights.iter().sum();
                let at = cands[..weights.len()].iter().position(|c| c.0 == draft);
                let p = at.map_or(0.0, |i| weights[i] / total);
                if self.rng.next_f64() < p {
                    return (draft, true);
                }
                match at {
                    // p < 1, so another candidate has weight left.
                    Some(i) if weights.len() > 1 => weights[i] = 0.0,
                    Some(_) => return (draft, true),
                    None => {}
                }
                (self.draw(&cands, &weights), false)
            }
        }
    }

    /// What [`Sampler::sample`] draws from: penalties, bias, temperature and the cuts applied; either the one id it
    /// returns without drawing, or candidates (descending) and the unnormalised weights of the first
    /// `weights.len()` of them.
    fn distribution(&self, logits: &mut [f32], history: &[u32]) -> Dist {
        let p = &self.params;
        for l in logits.iter_mut().filter(|l| l.is_nan()) {
            *l = f32::NEG_INFINITY;
        }
        for (&id, &bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        self.apply_penalties(logits, history);
        if p.temperature <= 0.0 {
            return Dist::One(argmax(logits));
        }
        // Candidates sorted by logit, descending (ties: lower id first), -inf excluded; with a top-k cut, only the k
        // best (a full vocabulary is 248k logits: collecting and partitioning them all took ~1 ms a token). A top_k
        // at or past the vocabulary size is no cut (a client's "no limit"): never more work or memory than the
        // vocabulary needs, whatever the number.
        let cands =
            if p.top_k > 0 && p.top_k < logits.len() { top_k_desc(logits, p.top_k) } else { sorted_desc(logits) };
        if cands.is_empty() {
            return Dist::One(argmax(logits));
        }
        // Softmax at temperature (max-subtracted), as f64 weights.
        let max = f64::from(cands[0].1);
        let temp = f64::from(p.temperature);
        let mut weights: Vec<f64> = cands.iter().map(|(_, l)| ((f64::from(*l) - max) / temp).exp()).collect();
        let total: f64 = weights.iter().sum();
        // Top-p: keep the smallest prefix whose probability reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = weights
                .iter()
                .position(|w| {
                    acc += w / total;
                    acc >= f64::from(p.top_p)
                })
                .map_or(weights.len(), |i| i + 1);
            weights.truncate(keep);
        }
        // Min-p: drop tokens below min_p times the top probability (weights[0] == 1).
        if p.min_p > 0.0 {
            let keep = weights.iter().take_while(|w| **w >= f64::from(p.min_p)).count();
            weights.truncate(keep.max(1));
        }
        Dist::Weighted(cands, weights)
    }

    /// One draw from `weights` over the first candidates.
    fn draw(&mut self, cands: &[(u32, f32)], weights: &[f64]) -> u32 {
        let total: f64 = weights.iter().sum();
        let mut target = self.rng.next_f64() * total;
        for (i, w) in weights.iter().enumerate() {
            target -= w;
            if target < 0.0 {
                return cands[i].0;
            }
        }
        // Rounding: the last candidate with weight (the draft a rejection zeroed is never it).
        let last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(weights.len() - 1);
        cands[last].0
    }

    fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
            return;
        }
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &id in history {
            *counts.entry(id).or_default() += 1;
        }
        for (id, count) in counts {
            let Some(l) = logits.get_mut(id as usize) else {
                continue;
            };
            if p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0 {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
            *l -= p.presence_penalty + p.frequency_penalty * count as f32;
        }
    }
}

/// Past this `k`, [`top_k_desc`] selects instead of inserting: an insertion costs O(k), and near the vocabulary
/// size nearly every logit is inserted (quadratic: seconds a token at 248k).
const INSERTION_MAX_K: usize = 128;

/// The order candidates are drawn in: logit descending, ties by ascending id.
fn desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Every logit above -inf with its id, in [`desc`] order.
fn sorted_desc(logits: &[f32]) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> =
        (0u32..).zip(logits.iter().copied()).filter(|(_, l)| *l > f32::NEG_INFINITY).collect();
    all.sort_unstable_by(desc);
    all
}

/// The `k` largest finite-or-+inf logits (NaN must already be -inf) with their ids, in [`desc`] order: the first
/// `k` of [`sorted_desc`]. Memory and time are bounded by the number of logits whatever `k` is: a small `k` in one
/// pass that keeps the k best (ids arrive in ascending order, so a newcomer equal to the current k-th loses the tie
/// and is skipped), a large one by selection and a sort of the k selected.
fn top_k_desc(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    use std::cmp::Ordering;
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    if k > INSERTION_MAX_K {
        let mut all: Vec<(u32, f32)> =
            (0u32..).zip(logits.iter().copied()).filter(|(_, l)| *l > f32::NEG_INFINITY).collect();
        if all.len() > k {
            all.select_nth_unstable_by(k - 1, desc);
            all.truncate(k);
        }
        all.sort_unstable_by(desc);
        return all;
    }
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    let mut floor = f32::NEG_INFINITY; // admits nothing that is not above the k-th best (-inf: never)
    for (i, &l) in logits.iter().enumerate() {
        // `l < floor` settles almost every logit with one compare; total_cmp decides the rest (equal, signed zeros)
        if l >= floor && l.total_cmp(&floor) == Ordering::Greater {
            let pos = best.partition_point(|&(_, b)| b.total_cmp(&l) != Ordering::Less);
            best.insert(pos, (i as u32, l));
            if best.len() > k {
                best.pop();
            }
            if best.len() == k {
                floor = best[k - 1].1;
            }
        }
    }
    best
}

/// Index of the largest logit (first on ties); 0 for an empty slice.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, l) in logits.iter().enumerate() {
        if *l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// xoshiro256** seeded through splitmix64.
struct Xoshiro256([u64; 4]);

impl Xoshiro256 {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut splitmix = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self([splitmix(), splitmix(), splitmix(), splitmix()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass top-k equals the first k of the full (logit desc, id asc) sort, with ties, -inf, +inf and
    /// signed zeros in the input.
    #[test]
    fn top_k_desc_equals_the_sorted_prefix() {
        let mut rng = Xoshiro256::new(3);
        for trial in 0..200 {
            let n = 1 + (rng.next_u64() % 3000) as usize;
            let logits: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 20 {
                    0 => f32::NEG_INFINITY,
                    1 => f32::INFINITY,
                    2 => -0.0,
                    3 => 0.0,
                    // few distinct values: many ties
                    r if r < 12 => (rng.next_u64() % 7) as f32 - 3.0,
                    _ => (rng.next_f64() * 20.0 - 10.0) as f32,
                })
                .collect();
            let mut all: Vec<(u32, f32)> =
                (0u32..).zip(logits.iter().copied()).filter(|(_, l)| *l > f32::NEG_INFINITY).collect();
            all.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for k in [1, 2, 5, 20, 64, INSERTION_MAX_K, INSERTION_MAX_K + 1, 500, n, n + 3, usize::MAX] {
                let want: Vec<(u32, u32)> = all.iter().take(k).map(|(i, l)| (*i, l.to_bits())).collect();
                let got: Vec<(u32, u32)> = top_k_desc(&logits, k).iter().map(|(i, l)| (*i, l.to_bits())).collect();
                assert_eq!(got, want, "trial {trial} n {n} k {k}");
            }
        }
    }

    /// Pearson's χ² of `counts` against `probs` over `n` draws (cells with expected count ≥ 5 each).
    fn chi2(counts: &[usize], probs: &[f64], n: usize) -> f64 {
        counts.iter().zip(probs).map(|(&c, &p)| (c as f64 - p * n as f64).powi(2) / (p * n as f64)).sum()
    }

    /// A draft checked by `verify` yields tokens distributed as `sample` draws them (rejection sampling with a
    /// deterministic draft): for a draft in the distribution's support, one out of it, and one cut by top-k/top-p,
    /// at two temperatures, with a penalty; and greedy accepts exactly the argmax.
    #[test]
    fn verify_draws_are_distributed_as_plain_draws() {
        let logits = [2.0f32, 1.5, 1.0, 0.2, -0.5, -1.0];
        let n = 60_000;
        let cases = [
            (SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, ..Default::default() }, 0u32),
            (SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, ..Default::default() }, 3),
            (SamplingParams { temperature: 0.7, top_k: 4, top_p: 1.0, ..Default::default() }, 5), // cut by top-k
            (SamplingParams { temperature: 1.3, top_k: 0, top_p: 0.8, ..Default::default() }, 1),
            (SamplingParams { temperature: 1.0, top_k: 0, presence_penalty: 1.0, ..Default::default() }, 0),
        ];
        for (ci, (params, draft)) in cases.iter().enumerate() {
            let history = [0u32, 2];
            // The plain distribution, estimated from many seeds of `sample`, and `verify`'s with other seeds.
            let mut plain = vec![0usize; logits.len()];
            let mut spec = vec![0usize; logits.len()];
            let mut accepted = 0;
            for i in 0..n {
                let mut l = logits;
                plain[Sampler::new(SamplingParams { seed: Some(i as u64), ..params.clone() }).sample(&mut l, &history)
                    as usize] += 1;
                let mut l = logits;
                let seed = Some(1_000_000 + i as u64);
                let (t, acc) = Sampler::new(SamplingParams { seed, ..params.clone() }).verify(&mut l, &history, *draft);
                assert_eq!(acc, t == *draft && acc, "case {ci}: accepted means the draft");
                accepted += acc as usize;
                spec[t as usize] += 1;
            }
            // Two-sample χ² over the cells both ever hit (the expected shares from the pooled counts).
            let cells: Vec<usize> = (0..logits.len()).filter(|&c| plain[c] + spec[c] > 0).collect();
            let pooled: Vec<f64> = cells.iter().map(|&c| (plain[c] + spec[c]) as f64 / (2 * n) as f64).collect();
            let x2 = chi2(&cells.iter().map(|&c| plain[c]).collect::<Vec<_>>(), &pooled, n)
                + chi2(&cells.iter().map(|&c| spec[c]).collect::<Vec<_>>(), &pooled, n);
            // 99.9th percentile of χ² with up to 5 degrees of freedom: 20.5.
            assert!(x2 < 20.5, "case {ci}: χ² {x2:.1}: plain {plain:?} vs verify {spec:?}");
            // The draft is accepted as often as plain sampling draws it.
            let (a, p) = (accepted as f64 / n as f64, plain[*draft as usize] as f64 / n as f64);
            assert!((a - p).abs() < 0.01, "case {ci}: accepted {a:.3} vs p(draft) {p:.3}");
        }
        // Greedy: the argmax whatever the draft, accepted only when it is the draft.
        let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
        for d in 0..logits.len() as u32 {
            let mut l = logits;
            assert_eq!(Sampler::new(greedy.clone()).verify(&mut l, &[], d), (0, d == 0));
        }
    }
}
