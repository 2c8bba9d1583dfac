//! The GPU sampler's CPU reference (`tern_cuda::sample::sample_reference`, the kernel's algorithm step for step)
//! against the host sampler (`tern_engine::sample_host`): in distribution (chi-square of 20,000 draws of each against
//! the exact f64 probabilities, a test shown to reject a 20% temperature error), in ids on the top-k path, and on
//! the edge cases (greedy, log-probabilities, masks, the limit, NaN, bad input). Runs without a GPU.

use std::collections::HashMap;

use tern_cuda::sample::{sample_reference, RefSample, SampleBatch, KMAX, MAX_TOP, MAX_VOCAB, STATUS_NO_TOKEN};
use tern_engine::{mask_allows, sample_host, MaskSlot, Sample, Sampled, SamplingParams};

mod common;
use common::Rng;

const VOCAB: usize = 3000;
const DRAWS: u64 = 20_000;
/// Chi-square p-values below this fail.
const P_MIN: f64 = 1e-6;

/// Random non-zero logits with a head and a long tail: 2 * (u1 + u2 + u3), so that hundreds of tokens carry mass.
fn random_logits(seed: u64, n: usize) -> Vec<f32> {
    let mut r = Rng(seed);
    (0..n).map(|_| 2.0 * (r.f() + r.f() + r.f()) + 1e-3).collect()
}

/// The bitset allowing exactly the ids `allow` says yes to, below `n`.
fn mask_of(n: usize, allow: impl Fn(usize) -> bool) -> Vec<u32> {
    let mut w = vec![0u32; n.div_ceil(32)];
    for i in (0..n).filter(|&i| allow(i)) {
        w[i / 32] |= 1 << (i % 32);
    }
    w
}

struct Case {
    name: &'static str,
    params: SamplingParams,
    history: Vec<u32>,
    mask: Option<Vec<u32>>,
    limit: usize,
    logits: Vec<f32>,
}

impl Case {
    fn new(name: &'static str, params: SamplingParams) -> Case {
        Case { name, params, history: Vec::new(), mask: None, limit: VOCAB, logits: random_logits(7, VOCAB) }
    }

    fn sample<'a>(&'a self, seed: u64, top_logprobs: Option<usize>, slot: Option<&'a MaskSlot>) -> Sample<'a> {
        Sample { params: &self.params, seed, history: &self.history, top_logprobs, limit: self.limit, mask: slot }
    }

    fn slot(&self) -> Option<MaskSlot> {
        self.mask.clone().map(MaskSlot::ready)
    }

    fn host(&self, seed: u64, top_logprobs: Option<usize>) -> anyhow::Result<Sampled> {
        let slot = self.slot();
        sample_host(&mut self.logits.clone(), &self.sample(seed, top_logprobs, slot.as_ref()))
    }

    /// A batch of one row per seed, for the reference.
    fn batch(&self, seeds: impl Iterator<Item = u64>, top_logprobs: Option<usize>) -> SampleBatch {
        let mut batch = SampleBatch::new(self.logits.len()).unwrap();
        for seed in seeds {
            batch.push(&self.sample(seed, top_logprobs, None), self.mask.as_deref()).unwrap();
        }
        batch
    }

    /// The reference's draws for `seeds`.
    fn reference(&self, seeds: impl Iterator<Item = u64>, top_logprobs: Option<usize>) -> Vec<RefSample> {
        let batch = self.batch(seeds, top_logprobs);
        sample_reference(&self.logits.repeat(batch.len()), &batch).unwrap()
    }
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::default() }
}

/// The parameter sets of the distribution test.
fn cases() -> Vec<Case> {
    let logits = random_logits(7, VOCAB);
    let mut by_logit: Vec<usize> = (0..VOCAB).collect();
    by_logit.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let mut penalties = Case::new(
        "T0.9 top_p0.95 rep1.3 pres0.4 freq0.2 + bias",
        SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            logit_bias: HashMap::from([(by_logit[40] as u32, 3.0), (by_logit[0] as u32, -2.0), (17, 1.5)]),
            ..params(0.9, 0, 0.95, 0.0)
        },
    );
    // the 30 best tokens, 1-3 times each, and some others
    penalties.history = (0..30).flat_map(|j| vec![by_logit[j] as u32; 1 + j % 3]).chain([5, 900, 2999]).collect();
    let mut masked = Case::new("T1 mask (every 3rd id, not the best 10)", params(1.0, 0, 1.0, 0.0));
    let best10: Vec<usize> = by_logit[..10].to_vec();
    masked.mask = Some(mask_of(VOCAB, |i| i % 3 == 0 && !best10.contains(&i)));
    let mut masked_k = Case::new("T0.8 top_k50 + mask", params(0.8, 50, 1.0, 0.0));
    masked_k.mask = masked.mask.clone();
    let mut padded = Case::new("T1 top_p0.95 limit 2900 (padding logits 9)", params(1.0, 0, 0.95, 0.0));
    padded.limit = 2900;
    padded.logits[2900..].fill(9.0);
    vec![
        Case::new("T0.7 top_k20 top_p0.95", params(0.7, 20, 0.95, 0.0)),
        Case::new("T1 no cuts", params(1.0, 0, 1.0, 0.0)),
        Case::new("T0.8 top_p0.9", params(0.8, 0, 0.9, 0.0)),
        Case::new("T1 min_p0.1", params(1.0, 0, 1.0, 0.1)),
        Case::new("T0.9 top_k2000 (> KMAX: a threshold)", params(0.9, 2000, 1.0, 0.0)),
        Case::new("T1 top_k200 min_p0.2", params(1.0, 200, 1.0, 0.2)),
        penalties,
        masked,
        masked_k,
        padded,
    ]
}

/// The host sampler's exact distribution over the row's ids, in f64: NaN -> -inf, mask, bias, penalties, then the
/// candidates in (logit desc, id asc) order, top-k, softmax at temperature, top-p prefix, min-p.
fn exact_probs(c: &Case) -> Vec<f64> {
    let p = &c.params;
    let n = c.limit.clamp(1, c.logits.len());
    let mut x: Vec<f32> = c.logits[..n].iter().map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v }).collect();
    if let Some(m) = &c.mask {
        for (i, l) in x.iter_mut().enumerate() {
            if !mask_allows(m, i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    for (&id, &b) in &p.logit_bias {
        if let Some(l) = x.get_mut(id as usize) {
            *l += b;
        }
    }
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &id in &c.history {
        *counts.entry(id).or_default() += 1;
    }
    for (id, k) in counts {
        if let Some(l) = x.get_mut(id as usize) {
            *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            *l -= p.presence_penalty + p.frequency_penalty * k as f32;
        }
    }
    let mut order: Vec<usize> = (0..n).filter(|&i| x[i] > f32::NEG_INFINITY).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    if p.top_k > 0 && p.top_k < n {
        order.truncate(p.top_k);
    }
    let max = f64::from(x[order[0]]);
    let w: Vec<f64> = order.iter().map(|&i| ((f64::from(x[i]) - max) / f64::from(p.temperature)).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut keep = w.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        keep = w
            .iter()
            .position(|v| {
                acc += v / total;
                acc >= f64::from(p.top_p)
            })
            .map_or(w.len(), |j| j + 1);
    }
    if p.min_p > 0.0 {
        keep = w[..keep].iter().take_while(|&&v| v >= f64::from(p.min_p)).count().max(1);
    }
    let total: f64 = w[..keep].iter().sum();
    let mut probs = vec![0.0; c.logits.len()];
    for (&i, &v) in order.iter().zip(&w[..keep]) {
        probs[i] = v / total;
    }
    probs
}

/// erfc (Numerical Recipes' erfcc, fractional error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let c = [
        -1.26551223,
        1.00002368,
        0.37409196,
        0.09678418,
        -0.18628806,
        0.27886807,
        -1.13520398,
        1.48851587,
        -0.82215223,
        0.17087277,
    ];
    let poly = c.iter().rev().fold(0.0, |acc, &ci| acc * t + ci);
    let r = t * (-z * z + poly).exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Pearson's chi-square of the draws against `probs` (tokens expected fewer than 5 times merged into one bin):
/// (chi2, degrees of freedom, p-value by the Wilson-Hilferty normal approximation). A draw of an id of probability 0
/// is a rejection: chi2 infinite, p-value 0.
fn chi_square(draws: &[u32], probs: &[f64]) -> (f64, usize, f64) {
    let n = draws.len() as f64;
    let mut seen = vec![0u64; probs.len()];
    for &d in draws {
        if probs[d as usize] == 0.0 {
            return (f64::INFINITY, 0, 0.0);
        }
        seen[d as usize] += 1;
    }
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let (mut rest_e, mut rest_o) = (0.0, 0.0);
    for (i, &p) in probs.iter().enumerate().filter(|(_, &p)| p > 0.0) {
        if p * n >= 5.0 {
            bins.push((p * n, seen[i] as f64));
        } else {
            rest_e += p * n;
            rest_o += seen[i] as f64;
        }
    }
    if rest_e >= 5.0 || bins.is_empty() {
        bins.push((rest_e, rest_o));
    } else if let Some(last) = bins.last_mut() {
        last.0 += rest_e;
        last.1 += rest_o;
    }
    let chi2: f64 = bins.iter().map(|(e, o)| (o - e) * (o - e) / e).sum();
    let dof = bins.len().saturating_sub(1).max(1);
    let k = dof as f64;
    let z = ((chi2 / k).cbrt() - (1.0 - 2.0 / (9.0 * k))) / (2.0 / (9.0 * k)).sqrt();
    (chi2, dof, 0.5 * erfc(z / std::f64::consts::SQRT_2))
}

/// (i) + (ii): 20,000 draws from the reference and from the host (seeds 0..N), both judged against the exact
/// distribution; on the top-k path the ids themselves agree.
fn distribution(cases: impl Iterator<Item = Case>) {
    for c in cases {
        let probs = exact_probs(&c);
        let support = probs.iter().filter(|&&p| p > 0.0).count();
        let reference: Vec<u32> = c.reference(0..DRAWS, None).iter().map(|r| r.out.token).collect();
        let host: Vec<u32> = (0..DRAWS).map(|s| c.host(s, None).unwrap().token).collect();
        let (rc, rd, rp) = chi_square(&reference, &probs);
        let (hc, hd, hp) = chi_square(&host, &probs);
        let same = reference.iter().zip(&host).filter(|(a, b)| a == b).count() as f64 / DRAWS as f64;
        let topk_path = c.params.top_k > 0 && c.params.top_k <= KMAX && c.params.top_k < c.limit;
        println!(
            "{:<48} support {support:>4}: reference chi2 {rc:>7.1} / {rd} dof p {rp:.3}; host chi2 {hc:>7.1} / {hd} \
             dof p {hp:.3}; same id {:.2}%{}",
            c.name,
            100.0 * same,
            if topk_path { " (top-k path)" } else { "" }
        );
        assert!(rp > P_MIN && hp > P_MIN, "{}: chi-square p-values reference {rp:e}, host {hp:e}", c.name);
        if topk_path {
            assert!(same >= 0.999, "{}: the reference and the host agree on {same} of the ids", c.name);
        }
    }
}

#[test]
fn reference_matches_the_host_in_distribution_cuts() {
    distribution(cases().into_iter().take(6));
}

#[test]
fn reference_matches_the_host_in_distribution_penalties_masks_limit() {
    distribution(cases().into_iter().skip(6));
}

/// The chi-square test can fail: the reference drawing at a temperature 20% too high is rejected.
#[test]
fn chi_square_rejects_a_wrong_temperature() {
    for c in [Case::new("T1 no cuts", params(1.0, 0, 1.0, 0.0)), Case::new("T0.8 top_p0.9", params(0.8, 0, 0.9, 0.0))] {
        let probs = exact_probs(&c);
        let wrong =
            Case { params: SamplingParams { temperature: c.params.temperature * 1.2, ..c.params.clone() }, ..c };
        let draws: Vec<u32> = wrong.reference(0..DRAWS, None).iter().map(|r| r.out.token).collect();
        let (chi2, dof, p) = chi_square(&draws, &probs);
        println!("{} drawn at T x 1.2: chi2 {chi2:.1} / {dof} dof, p {p:.2e}", wrong.name);
        assert!(p < P_MIN, "{}: a 20% temperature error passed the chi-square test (p {p})", wrong.name);
    }
}

/// Log-probabilities within 1e-5 (NaN where the host has NaN too).
fn close(a: f32, b: f32) -> bool {
    a == b || (a - b).abs() < 1e-5 || (a.is_nan() && b.is_nan())
}

/// The reference's draw, log-probabilities and status against the host's for one sample. Off the top-k path
/// (`same_id` false) the ids may differ: the drawn token's log-probability is then checked against its raw logit
/// minus the f64 log-sum-exp of the row. The top ids are the first of (raw logit desc, id asc), values as the host's
/// (the host's own top ids are any of the tied ones at the last place).
fn check_against_host(what: &str, c: &Case, seed: u64, top_logprobs: Option<usize>, same_id: bool) {
    let host = c.host(seed, top_logprobs);
    let batch = c.batch(seed..seed + 1, top_logprobs);
    let got = batch.sampled(&[sample_reference(&c.logits, &batch).unwrap()[0].out]).remove(0);
    let (g, h) = match (&got, &host) {
        (Ok(g), Ok(h)) => (g, h),
        (Err(g), Err(h)) => return assert_eq!(g.to_string(), h.to_string(), "{what}: errors"),
        _ => panic!("{what}: reference {got:?} vs host {host:?}"),
    };
    if same_id {
        assert_eq!(g.token, h.token, "{what}: token");
    }
    assert_eq!(g.logprob.is_some(), h.logprob.is_some(), "{what}: logprobs present");
    let (Some(gl), Some(hl)) = (&g.logprob, &h.logprob) else { return };
    let row: Vec<f32> = c.logits[..c.limit.clamp(1, c.logits.len())]
        .iter()
        .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v })
        .collect();
    let want = if same_id {
        hl.logprob
    } else {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let lse = f64::from(m) + row.iter().map(|&v| (f64::from(v) - f64::from(m)).exp()).sum::<f64>().ln();
        (f64::from(row[g.token as usize]) - lse) as f32
    };
    assert!(close(gl.logprob, want), "{what}: logprob {} vs {want}", gl.logprob);
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let ids: Vec<u32> = gl.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, order[..hl.top.len()], "{what}: top ids (host {:?})", hl.top);
    for ((_, a), (_, b)) in gl.top.iter().zip(&hl.top) {
        assert!(close(*a, *b), "{what}: top logprobs {:?} vs host {:?}", gl.top, hl.top);
    }
}

/// (iii) greedy, log-probabilities, the limit and NaN logits: the same tokens, log-probabilities within 1e-5.
#[test]
fn greedy_logprobs_limit_and_nan_match_the_host() {
    let mut bias = Case::new("greedy + penalties + bias", params(0.0, 0, 1.0, 0.0));
    bias.params.repetition_penalty = 1.5;
    bias.params.frequency_penalty = 0.7;
    bias.params.logit_bias = HashMap::from([(3, 20.0), (11, -1.0)]);
    bias.history = vec![3, 3, 11, 200, 5000];
    for seed in 0..20 {
        bias.logits = random_logits(100 + seed, 500);
        check_against_host("greedy + penalties + bias", &bias, seed, Some(5), true);
    }
    // ties: the first id wins, also between -0.0 and +0.0
    let mut ties = Case::new("greedy ties", params(0.0, 0, 1.0, 0.0));
    for row in [vec![1.0, 2.0, 2.0, 0.5], vec![-0.0, 0.0, -1.0], vec![0.0, -0.0], vec![f32::NEG_INFINITY; 4]] {
        ties.limit = row.len();
        ties.logits = row;
        check_against_host("greedy ties", &ties, 0, Some(2), true);
    }
    // min-p above 1 keeps only the first candidate, as the host does (tied maxima: the lowest id), on both paths
    for top_k in [0, 2] {
        let mut over = Case::new("min_p > 1", params(1.0, top_k, 1.0, 1.5));
        over.logits = vec![0.5, 3.0, 1.0, 3.0, 3.0, -2.0];
        over.limit = over.logits.len();
        for seed in 0..20 {
            check_against_host("min_p > 1", &over, seed, Some(2), true);
        }
    }
    // log-probabilities on both paths, with bias, penalties and a mask (raw logits, not the modified ones)
    for (name, p) in [("top-k path", params(0.7, 20, 0.95, 0.0)), ("threshold path", params(1.0, 0, 0.9, 0.05))] {
        let mut c = Case::new(name, p);
        c.params.logit_bias = HashMap::from([(1, 4.0), (2, -4.0)]);
        c.params.presence_penalty = 0.5;
        c.history = vec![1, 2, 7, 7];
        for seed in 0..30 {
            c.logits = random_logits(200 + seed, 4000);
            c.mask = (seed % 2 == 1).then(|| mask_of(4000, |i| i % 5 != 0));
            for k in [0, 1, 5, MAX_TOP] {
                check_against_host(name, &c, seed, Some(k), c.params.top_k > 0);
            }
        }
    }
    // the limit: padding never drawn nor listed; limit 0 is 1, past the row is the row
    let mut lim = Case::new("limit", params(1.0, 0, 1.0, 0.0));
    lim.logits = random_logits(9, 300);
    lim.logits[250..].fill(50.0);
    for (limit, k) in [(250, 0), (250, 40), (1, 0), (0, 0), (10_000, 0), (300, 7)] {
        lim.limit = limit;
        lim.params.top_k = k;
        for seed in 0..20 {
            check_against_host("limit", &lim, seed, Some(MAX_TOP), k > 0 && k < limit);
            let t = lim.reference(seed..seed + 1, None)[0].out.token as usize;
            assert!(t < limit.clamp(1, 300), "limit {limit}: drew {t}");
        }
    }
    // NaN logits count as -inf (the host's log-probabilities of a row with NaN are NaN: compared on the row with
    // NaN replaced, ids on the row itself)
    let mut nan = Case::new("NaN", params(0.9, 30, 1.0, 0.0));
    for (k, t) in [(30, 0.9), (0, 0.9), (0, 0.0)] {
        (nan.params.top_k, nan.params.temperature) = (k, t);
        for seed in 0..20 {
            nan.logits = random_logits(300 + seed, 1000);
            for i in (0..1000).step_by(3) {
                nan.logits[i] = f32::NAN;
            }
            let (host, got) = (nan.host(seed, None).unwrap().token, nan.reference(seed..seed + 1, None)[0].out.token);
            if k > 0 || t == 0.0 {
                assert_eq!(got, host, "NaN row, top_k {k} T {t}");
            }
            assert!(host % 3 != 0 && got % 3 != 0, "a NaN id drawn: host {host}, reference {got}");
            let mut clean = Case::new("NaN replaced", nan.params.clone());
            clean.logits = nan.logits.iter().map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v }).collect();
            clean.limit = 1000;
            check_against_host("NaN replaced", &clean, seed, Some(4), k > 0 || t == 0.0);
        }
    }
    nan.logits = vec![f32::NAN; 64];
    nan.limit = 64;
    assert_eq!(nan.reference(0..1, None)[0].out.token, nan.host(0, None).unwrap().token);
}

/// (iii) masks: allowing nothing is the host's error; every allowed logit -inf gives the first allowed id; ids past
/// the mask's words and bits past the limit are not drawn.
#[test]
fn mask_edge_cases_match_the_host() {
    let mut c = Case::new("mask", params(1.0, 0, 1.0, 0.0));
    c.logits = random_logits(11, 200);
    c.limit = 200;
    // nothing allowed below the limit (bits past it do not count)
    c.limit = 190;
    c.mask = Some(mask_of(200, |i| i >= 190));
    let r = c.reference(0..1, Some(3));
    assert_eq!(r[0].out.status, STATUS_NO_TOKEN);
    check_against_host("mask allows nothing", &c, 0, Some(3), true);
    c.mask = Some(vec![]);
    check_against_host("empty mask", &c, 0, None, true);
    // the allowed ids all -inf: the first allowed one, on both paths and greedy
    c.limit = 200;
    c.mask = Some(mask_of(200, |i| i == 77 || i == 150));
    c.logits[77] = f32::NEG_INFINITY;
    c.logits[150] = f32::NEG_INFINITY;
    for (k, t) in [(0, 1.0), (10, 1.0), (0, 0.0)] {
        (c.params.top_k, c.params.temperature) = (k, t);
        check_against_host("allowed ids -inf", &c, 5, Some(2), true);
        assert_eq!(c.reference(5..6, None)[0].out.token, 77);
    }
    // a short mask: ids past its words are not allowed; a bias cannot bring back a disallowed id
    c.logits = random_logits(12, 200);
    c.mask = Some(vec![0xF0F0_F0F0, 0x0000_0001]);
    c.params.logit_bias = HashMap::from([(100, 30.0), (4, 10.0)]);
    for (k, t) in [(0, 1.0), (20, 0.7), (0, 0.0)] {
        (c.params.top_k, c.params.temperature) = (k, t);
        for seed in 0..50 {
            check_against_host("short mask", &c, seed, Some(1), k > 0 || t == 0.0);
            let tok = c.reference(seed..seed + 1, None)[0].out.token;
            assert!(tok < 64 && mask_allows(&[0xF0F0_F0F0, 1], tok), "short mask drew {tok}");
        }
    }
}

fn sample_of(params: &SamplingParams, top_logprobs: Option<usize>) -> Sample<'_> {
    Sample { params, seed: 1, history: &[], top_logprobs, limit: 100, mask: None }
}

/// Bad input is an error naming the problem, and leaves the batch as it was.
#[test]
fn bad_input_is_a_clear_error() {
    assert!(SampleBatch::new(0).unwrap_err().to_string().contains("no logits"));
    assert!(SampleBatch::new(MAX_VOCAB + 1).is_err());
    let mut batch = SampleBatch::new(100).unwrap();
    let good = params(1.0, 0, 1.0, 0.0);
    batch.push(&sample_of(&good, Some(MAX_TOP)), None).unwrap();
    let e = batch.push(&sample_of(&good, Some(MAX_TOP + 1)), None).unwrap_err().to_string();
    assert!(e.contains("top_logprobs 21"), "{e}");
    let e = batch.push(&sample_of(&params(f32::NAN, 0, 1.0, 0.0), None), None).unwrap_err().to_string();
    assert!(e.contains("temperature"), "{e}");
    let inf_bias = SamplingParams { logit_bias: HashMap::from([(3, f32::INFINITY)]), ..good.clone() };
    let e = batch.push(&sample_of(&inf_bias, None), None).unwrap_err().to_string();
    assert!(e.contains("logit bias of token 3"), "{e}");
    assert_eq!(batch.len(), 1, "failed pushes left the batch as it was");
    assert!(sample_reference(&[0.0; 99], &batch).is_err(), "a matrix shorter than the batch");
}
