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
            return argmax(logits);
        }
        // Candidates sorted by logit, descending (ties: lower id first), -inf excluded; with a top-k cut, only the k
        // best (a full vocabulary is 248k logits: collecting and partitioning them all took ~1 ms a token). A top_k
        // at or past the vocabulary size is no cut (a client's "no limit"): never more work or memory than the
        // vocabulary needs, whatever the number.
        let cands =
            if p.top_k > 0 && p.top_k < logits.len() { top_k_desc(logits, p.top_k) } else { sorted_desc(logits) };
        if cands.is_empty() {
            return argmax(logits);
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
        let total: f64 = weights.iter().sum();
        let mut target = self.rng.next_f64() * total;
        for (i, w) in weights.iter().enumerate() {
            target -= w;
            if target < 0.0 {
                return cands[i].0;
            }
        }
        cands[weights.len() - 1].0
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
}
