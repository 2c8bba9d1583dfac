//! Sampler: generation_config defaults, greedy, determinism, distribution sanity, filters.

mod common;

use std::collections::HashMap;

use tern_text::{Sampler, SamplingParams};

fn params(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, seed: Some(seed), ..SamplingParams::default() }
}

fn draws(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut sampler = Sampler::new(p);
    (0..n).map(|_| sampler.sample(&mut logits.to_vec(), &[])).collect()
}

#[test]
fn defaults_come_from_generation_config() {
    let Some(dir) = common::model_dir("defaults_come_from_generation_config") else {
        return;
    };
    let p = SamplingParams::from_generation_config(dir).unwrap();
    assert_eq!((p.temperature, p.top_k, p.top_p), (0.6, 20, 0.95));
    assert_eq!((p.min_p, p.repetition_penalty), (0.0, 1.0));
    let missing = SamplingParams::from_generation_config("/nonexistent-dir");
    assert!(missing.unwrap_err().to_string().contains("generation_config.json"));
}

#[test]
fn greedy_is_argmax_and_same_seed_repeats() {
    let logits = [0.1, 2.0, 1.9, f32::NAN, -1.0];
    assert!(draws(params(0.0, 1), &logits, 20).iter().all(|&t| t == 1));
    let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
    let a = draws(params(1.0, 42), &logits, 200);
    assert_eq!(a, draws(params(1.0, 42), &logits, 200));
    assert_ne!(a, draws(params(1.0, 43), &logits, 200));
    assert_eq!(Sampler::new(params(1.0, 0)).sample(&mut [], &[]), 0);
}

#[test]
fn temperature_one_frequencies_match_softmax() {
    let logits = [1.0f32, 2.0, 0.5, 3.0];
    let z: f32 = logits.iter().map(|l| l.exp()).sum();
    let n = 40_000;
    let mut counts = [0usize; 4];
    for t in draws(params(1.0, 7), &logits, n) {
        counts[t as usize] += 1;
    }
    for (i, l) in logits.iter().enumerate() {
        let expected = l.exp() / z;
        let observed = counts[i] as f32 / n as f32;
        assert!((observed - expected).abs() < 0.015, "token {i}: {observed} vs {expected}");
    }
}

#[test]
fn top_k_top_p_min_p_never_pick_outside_their_sets() {
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let mut order: Vec<u32> = (0..50).collect();
    order.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
    let top3 = &order[..3];
    let p = SamplingParams { top_k: 3, ..params(2.0, 3) };
    let picked = draws(p, &logits, 2000);
    assert!(picked.iter().all(|t| top3.contains(t)));
    assert_eq!(top3.iter().filter(|t| picked.contains(t)).count(), 3);
    // top_p tiny → only the best token.
    let p = SamplingParams { top_p: 1e-6, ..params(1.0, 4) };
    assert!(draws(p, &logits, 500).iter().all(|&t| t == order[0]));
    // min_p 0.5 at temperature 1: only tokens with prob >= half the max.
    let p = SamplingParams { min_p: 0.5, ..params(1.0, 5) };
    let max = logits[order[0] as usize];
    for t in draws(p, &logits, 2000) {
        assert!(logits[t as usize] >= max + 0.5f32.ln() - 1e-6);
    }
}

#[test]
fn penalties_and_bias_change_the_choice() {
    let logits = [5.0f32, 4.9, 0.0];
    let greedy = |p: SamplingParams, history: &[u32]| Sampler::new(p).sample(&mut logits.to_vec(), history);
    assert_eq!(greedy(params(0.0, 0), &[0]), 0);
    let rep = SamplingParams { repetition_penalty: 1.1, ..params(0.0, 0) };
    assert_eq!(greedy(rep, &[0]), 1);
    let presence = SamplingParams { presence_penalty: 0.2, ..params(0.0, 0) };
    assert_eq!(greedy(presence.clone(), &[0]), 1);
    assert_eq!(greedy(presence, &[1]), 0);
    let freq = SamplingParams { frequency_penalty: 0.06, ..params(0.0, 0) };
    assert_eq!(greedy(freq.clone(), &[0]), 0);
    assert_eq!(greedy(freq, &[0, 0]), 1);
    let bias = SamplingParams { logit_bias: HashMap::from([(2, 10.0), (99, 1.0)]), ..params(0.0, 0) };
    assert_eq!(greedy(bias, &[]), 2);
}

/// A client's top_k is bounded by the vocabulary: any value (up to `usize::MAX`, which once asked for a
/// `Vec::with_capacity(k + 1)` and aborted the process) costs no more than the vocabulary, and a top_k at the
/// vocabulary size (once quadratic: ~2.3 s a token over 248k logits) draws what "no top_k" draws.
#[test]
fn top_k_of_any_size_is_bounded_by_the_vocabulary() {
    let n = 248_320;
    let mut x = 0x9E37_79B9u64;
    let logits: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 10_000) as f32 / 1000.0
        })
        .collect();
    let none = draws(SamplingParams { top_k: 0, ..params(1.0, 9) }, &logits, 5);
    for k in [n - 1, n, n + 1, 3_000_000_000, usize::MAX / 2, usize::MAX] {
        let t0 = std::time::Instant::now();
        let got = draws(SamplingParams { top_k: k, ..params(1.0, 9) }, &logits, 5);
        let per_token = t0.elapsed().as_secs_f64() / 5.0;
        println!("top_k {k}: {:.1} ms a token", per_token * 1e3);
        assert!(per_token < 0.25, "top_k {k}: {per_token:.3} s a token");
        if k >= n {
            assert_eq!(got, none, "top_k {k} is no cut");
        }
    }
}
