//! The sampling kernel (sample.cu `sample_rows`) against its CPU reference (`tern_cuda::sample::sample_reference`,
//! which tests/sample_cpu.rs holds against the host sampler) on random non-zero logits: the real vocabulary (248,320
//! rows, limit 248,077) and small awkward ones (1, 31, 1000), batches of 1, 3 and 64 rows, every parameter set of
//! the CPU test and more (the path boundaries top_k = 1024 / 1025, greedy, NaN, masks that allow nothing or only
//! -inf), log-probabilities on every other row.
//!
//! Ids must be identical, but for at most 1 draw in 10,000 where the reference's target lies within 1e-9 (relative)
//! of an edge of the chosen token's interval (f64 exp on the device and the host may differ in the last bit);
//! statuses equal, log-probabilities within 1e-5. The same seed twice gives the same outputs, bit for bit.
//!
//! Without a CUDA device each test prints `NO GPU: <name> not run ...` and passes; `TERN_REQUIRE_CUDA=1` turns
//! that into a failure.

use std::collections::HashMap;

use tern_cuda::gpu_or_skip;
use tern_cuda::sample::{sample_reference, SampleBatch, SampleOut, MAX_TOP};
use tern_cuda::Gpu;
use tern_engine::{Sample, SamplingParams};

mod common;
use common::Rng;

const REAL_VOCAB: usize = 248_320;
const REAL_LIMIT: usize = 248_077;

/// One row of a batch: its logits and what the engine would ask.
struct Row {
    logits: Vec<f32>,
    params: SamplingParams,
    history: Vec<u32>,
    mask: Option<Vec<u32>>,
    limit: usize,
    top_logprobs: Option<usize>,
    seed: u64,
}

/// The parameter sets (name, what a row of it looks like).
const SETS: &[&str] = &[
    "T0.7 top_k20 top_p0.95",
    "T1 no cuts",
    "T0.8 top_p0.9",
    "T1 min_p0.1",
    "T0.9 top_k2000",
    "T0.9 top_p0.95 penalties + bias",
    "T1 mask",
    "T0.8 top_k50 + mask",
    "T1 top_p0.95 padded limit",
    "greedy + penalties",
    "T1 top_k1024 (path a)",
    "T1 top_k1025 (path b)",
    "T0.05 top_p0.5",
    "edge rows",
];

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::default() }
}

/// Row `r` of set `set` for rows of `vocab` logits (limit `limit` unless the set pads further).
fn row(set: &str, vocab: usize, limit: usize, r: usize, seed: u64) -> Row {
    let mut g = Rng(seed ^ 0x5eed);
    // a long tail, and on odd rows a few tokens far ahead (a confident model)
    let mut logits: Vec<f32> = (0..vocab).map(|_| 2.0 * (g.f() + g.f() + g.f()) + 1e-3).collect();
    if r % 2 == 1 {
        for _ in 0..4 {
            let i = (g.next() % vocab as u64) as usize;
            logits[i] += 9.0;
        }
    }
    // ids by logit, best first (for the penalty sets: their history and biases hit the head)
    let mut by_logit: Vec<u32> = if set.contains("penalties") { (0..limit as u32).collect() } else { vec![0] };
    by_logit.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let mut row = Row {
        logits,
        params: params(1.0, 0, 1.0, 0.0),
        history: Vec::new(),
        mask: None,
        limit,
        top_logprobs: [None, Some(0), Some(5), Some(MAX_TOP)][r % 4],
        seed,
    };
    let mask_every_3rd = |n: usize| {
        let mut w = vec![0u32; n.div_ceil(32)];
        for i in (0..n).step_by(3) {
            w[i / 32] |= 1 << (i % 32);
        }
        w
    };
    let penalties = |row: &mut Row| {
        row.params.repetition_penalty = 1.3;
        row.params.presence_penalty = 0.4;
        row.params.frequency_penalty = 0.2;
        let b = |j: usize| by_logit[j.min(by_logit.len() - 1)];
        row.params.logit_bias = HashMap::from([(b(40), 3.0), (b(0), -2.0), (b(7), 0.5)]);
        row.history = (0..30).flat_map(|j| vec![b(j); 1 + j % 3]).chain([0, (vocab - 1) as u32]).collect();
    };
    match set {
        "T0.7 top_k20 top_p0.95" => row.params = params(0.7, 20, 0.95, 0.0),
        "T1 no cuts" => {}
        "T0.8 top_p0.9" => row.params = params(0.8, 0, 0.9, 0.0),
        "T1 min_p0.1" => row.params = params(1.0, 0, 1.0, 0.1),
        "T0.9 top_k2000" => row.params = params(0.9, 2000, 1.0, 0.0),
        "T0.9 top_p0.95 penalties + bias" => {
            row.params = params(0.9, 0, 0.95, 0.0);
            penalties(&mut row);
        }
        "T1 mask" => row.mask = Some(mask_every_3rd(limit)),
        "T0.8 top_k50 + mask" => {
            row.params = params(0.8, 50, 1.0, 0.0);
            row.mask = Some(mask_every_3rd(limit));
        }
        "T1 top_p0.95 padded limit" => {
            row.params = params(1.0, 0, 0.95, 0.0);
            row.limit = limit - limit / 8;
            row.logits[row.limit..].fill(9.0);
        }
        "greedy + penalties" => {
            row.params = params(0.0, 0, 1.0, 0.0);
            penalties(&mut row);
        }
        "T1 top_k1024 (path a)" => row.params = params(1.0, 1024, 1.0, 0.0),
        "T1 top_k1025 (path b)" => row.params = params(1.0, 1025, 1.0, 0.0),
        "T0.05 top_p0.5" => row.params = params(0.05, 0, 0.5, 0.0),
        "edge rows" => match r % 6 {
            0 => row.logits.iter_mut().step_by(2).for_each(|l| *l = f32::NAN),
            1 => row.mask = Some(vec![0; limit.div_ceil(32)]), // allows nothing
            2 => {
                // the allowed ids are -inf: the first allowed one
                let last = limit - 1;
                row.logits[last] = f32::NEG_INFINITY;
                let mut w = vec![0u32; limit.div_ceil(32)];
                w[last / 32] |= 1 << (last % 32);
                row.mask = Some(w);
            }
            3 => row.logits.fill(f32::NAN),
            4 => row.limit = 1,
            _ => {
                // ties everywhere, greedy and drawn
                row.logits.iter_mut().for_each(|l| *l = (*l * 2.0).round());
                row.params = params((r % 12 / 6) as f32, 0, 0.9, 0.0);
            }
        },
        _ => unreachable!("unknown set {set}"),
    }
    row
}

fn batch_of(rows: &[Row], vocab: usize) -> SampleBatch {
    let mut batch = SampleBatch::new(vocab).unwrap();
    for r in rows {
        let s = Sample {
            params: &r.params,
            seed: r.seed,
            history: &r.history,
            top_logprobs: r.top_logprobs,
            limit: r.limit,
            mask: None,
        };
        batch.push(&s, r.mask.as_deref()).unwrap();
    }
    batch
}

/// The kernel's outputs for `rows` (their logits uploaded afresh: the kernel overwrites them).
fn run(g: &Gpu, rows: &[Row], batch: &SampleBatch) -> Vec<SampleOut> {
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
    let mut dev = g.upload(&flat).unwrap();
    g.sample_download(&mut dev, batch).unwrap()
}

fn close(a: f32, b: f32) -> bool {
    a == b || (a - b).abs() <= 1e-5 || (a.is_nan() && b.is_nan())
}

#[derive(Default)]
struct Tally {
    draws: usize,
    mismatches: Vec<String>,
    worst_logprob: f32,
}

impl Tally {
    /// Compare one launch's outputs with the reference's.
    fn check(&mut self, what: &str, rows: &[Row], batch: &SampleBatch, got: &[SampleOut]) {
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
        let want = sample_reference(&flat, batch).unwrap();
        assert_eq!(got.len(), want.len());
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            let w_out = &w.out;
            assert_eq!(g.status, w_out.status, "{what} row {b}: status");
            self.draws += 1;
            if g.token != w_out.token {
                let m =
                    format!("{what} row {b}: kernel {} reference {} (margin {:.1e})", g.token, w_out.token, w.margin);
                assert!(w.margin < 1e-9, "{m}: not a rounding boundary");
                self.mismatches.push(m);
            }
            if rows[b].top_logprobs.is_none() || g.status != w_out.status {
                continue;
            }
            assert_eq!(g.n_top, w_out.n_top, "{what} row {b}: top entries");
            if g.token == w_out.token {
                assert!(close(g.logprob, w_out.logprob), "{what} row {b}: logprob {} vs {}", g.logprob, w_out.logprob);
                self.worst_logprob = self.worst_logprob.max((g.logprob - w_out.logprob).abs());
            }
            for (gt, wt) in g.top.iter().zip(&w_out.top).take(g.n_top as usize) {
                assert_eq!(gt.id, wt.id, "{what} row {b}: top ids");
                assert!(close(gt.logprob, wt.logprob), "{what} row {b}: top logprob {} vs {}", gt.logprob, wt.logprob);
                self.worst_logprob = self.worst_logprob.max((gt.logprob - wt.logprob).abs());
            }
        }
    }

    fn finish(&self, name: &str) {
        let nan_free = if self.worst_logprob.is_nan() { 0.0 } else { self.worst_logprob };
        println!(
            "{name}: {} draws, {} id mismatches (each at a rounding boundary), worst logprob difference {nan_free:.1e}",
            self.draws,
            self.mismatches.len()
        );
        for m in &self.mismatches {
            println!("  {m}");
        }
        assert!(
            self.mismatches.len() <= self.draws.div_ceil(10_000),
            "{name}: {} mismatches in {} draws",
            self.mismatches.len(),
            self.draws
        );
    }
}

fn kernel_vs_reference(g: &Gpu, name: &str, vocabs: &[(usize, usize)], launches: usize) {
    let mut tally = Tally::default();
    for &(vocab, limit) in vocabs {
        for (si, set) in SETS.iter().enumerate() {
            for (li, b) in [1usize, 3, 64].iter().cycle().take(3 * launches).enumerate() {
                let seed0 = ((vocab * 31 + si) * 1000 + li * 64) as u64;
                let rows: Vec<Row> = (0..*b).map(|r| row(set, vocab, limit, r, seed0 + r as u64)).collect();
                let batch = batch_of(&rows, vocab);
                let got = run(g, &rows, &batch);
                tally.check(&format!("vocab {vocab} {set} B {b} launch {li}"), &rows, &batch, &got);
            }
        }
    }
    tally.finish(name);
}

/// Small awkward vocabularies, many seeds: 14 sets x 3 sizes x (1 + 3 + 64) rows x 12 rounds.
#[test]
fn kernel_matches_reference_small_vocab() {
    let Some(g) = gpu_or_skip("kernel_matches_reference_small_vocab") else { return };
    kernel_vs_reference(&g, "small vocabularies", &[(1, 1), (31, 31), (1000, 1000), (1000, 997)], 12);
}

/// The real vocabulary with its padding: 14 sets x (1 + 3 + 64) rows.
#[test]
fn kernel_matches_reference_real_vocab() {
    let Some(g) = gpu_or_skip("kernel_matches_reference_real_vocab") else { return };
    kernel_vs_reference(&g, "vocab 248,320 limit 248,077", &[(REAL_VOCAB, REAL_LIMIT)], 1);
}

/// Determinism: the same rows and seeds twice give the same outputs, bit for bit; the convenience that returns
/// `Sampled`s agrees.
#[test]
fn same_seed_same_outputs() {
    let Some(g) = gpu_or_skip("same_seed_same_outputs") else { return };
    let bits = |o: &SampleOut| {
        let top: Vec<(u32, u32)> = o.top[..o.n_top as usize].iter().map(|t| (t.id, t.logprob.to_bits())).collect();
        (o.token, o.status, o.logprob.to_bits(), top)
    };
    for (vocab, limit) in [(REAL_VOCAB, REAL_LIMIT), (1000, 1000)] {
        for set in SETS {
            let rows: Vec<Row> = (0..64).map(|r| row(set, vocab, limit, r, 77 + r as u64)).collect();
            let batch = batch_of(&rows, vocab);
            let (a, b) = (run(&g, &rows, &batch), run(&g, &rows, &batch));
            for (r, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(bits(x), bits(y), "vocab {vocab} {set} row {r}: two runs differ");
            }
            let flat: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
            let mut dev = g.upload(&flat).unwrap();
            let sampled = g.sample_logits(&mut dev, &batch).unwrap();
            for (r, (s, o)) in sampled.iter().zip(&a).enumerate() {
                match s {
                    Ok(s) => assert_eq!(s.token, o.token, "vocab {vocab} {set} row {r}: sample_logits"),
                    Err(e) => assert!(o.status != 0, "vocab {vocab} {set} row {r}: {e}"),
                }
            }
        }
    }
    println!("same seeds, same outputs: {} sets x 64 rows x 2 vocabularies", SETS.len());
}

/// A lone top-k row (a batch of one, no mask, bias, penalty or log-probabilities) takes its first three passes over
/// the whole GPU (sample.cu `sample_pre_*`): its outputs equal, bit for bit, those of the same row drawn by the
/// one-block path (as row 0 of a batch of two), over top-k 1, 20, 50 and 1024, confident and flat rows, NaN logits,
/// ties, and the reference agrees.
#[test]
fn lone_row_over_the_grid_equals_the_block_path() {
    let Some(g) = gpu_or_skip("lone_row_over_the_grid_equals_the_block_path") else { return };
    let mut tally = Tally::default();
    let mut same = 0;
    for (k, temp) in [(1usize, 1.0f32), (20, 0.7), (50, 0.8), (1024, 1.0)] {
        for s in 0..24u64 {
            let seed = 7000 + 100 * k as u64 + s;
            let mut one = row("T1 no cuts", REAL_VOCAB, REAL_LIMIT, s as usize, seed);
            one.params = params(temp, k, 0.95, 0.0);
            one.top_logprobs = None;
            match s % 6 {
                4 => one.logits.iter_mut().step_by(3).for_each(|l| *l = f32::NAN),
                5 => one.logits.iter_mut().for_each(|l| *l = (*l * 2.0).round()),
                _ => {}
            }
            let mut other = row("T1 no cuts", REAL_VOCAB, REAL_LIMIT, 1, seed + 1);
            other.top_logprobs = None;
            let alone = [one];
            let got = run(&g, &alone, &batch_of(&alone, REAL_VOCAB));
            tally.check(&format!("lone top_k {k} seed {seed}"), &alone, &batch_of(&alone, REAL_VOCAB), &got);
            let [one] = alone;
            let pair = [one, other];
            let both = run(&g, &pair, &batch_of(&pair, REAL_VOCAB));
            let bits = |o: &SampleOut| (o.token, o.status, o.logprob.to_bits());
            assert_eq!(bits(&got[0]), bits(&both[0]), "top_k {k} seed {seed}: the lone row vs the block path");
            same += 1;
        }
    }
    tally.finish("lone top-k rows");
    println!("lone top-k rows: {same} draws equal to the one-block path's, bit for bit");
}

/// A batch of plain greedy rows takes argmax_rows (the rows split over the GPU) instead of sample_rows: the same ids
/// as sample_rows draws for those rows (in a batch with a sampled row, which keeps every row on sample_rows) and as
/// the reference, with NaNs, ties, -0 beside +0, a row of -inf and a limit below the vocabulary.
#[test]
fn greedy_rows_over_the_grid_equal_the_block_path() {
    let Some(g) = gpu_or_skip("greedy_rows_over_the_grid_equal_the_block_path") else { return };
    let mut tally = Tally::default();
    let mut same = 0;
    for (vocab, limit) in [(REAL_VOCAB, REAL_LIMIT), (1000, 997)] {
        for n in [1usize, 3, 8, 33] {
            let rows: Vec<Row> = (0..n)
                .map(|r| {
                    let mut one = row("T1 no cuts", vocab, limit, r, 9000 + r as u64 + 100 * n as u64);
                    one.params = params(0.0, 0, 1.0, 0.0);
                    one.top_logprobs = None;
                    match r % 5 {
                        1 => one.logits.iter_mut().step_by(3).for_each(|l| *l = f32::NAN),
                        2 => one.logits.iter_mut().for_each(|l| *l = (*l * 0.5).round()), // many ties at the top
                        3 => {
                            // zeros everywhere, -0 first: the lowest id holding the largest value (-0 counts as +0)
                            one.logits.iter_mut().for_each(|l| *l = 0.0);
                            one.logits[..7].iter_mut().for_each(|l| *l = -0.0);
                        }
                        4 if r % 2 == 0 => one.logits.iter_mut().for_each(|l| *l = f32::NEG_INFINITY),
                        _ => {}
                    }
                    one
                })
                .collect();
            let greedy = run(&g, &rows, &batch_of(&rows, vocab));
            tally.check(&format!("greedy vocab {vocab} n {n}"), &rows, &batch_of(&rows, vocab), &greedy);
            let mut with_sampled = rows;
            let mut other = row("T1 no cuts", vocab, limit, 1, 77);
            other.top_logprobs = None;
            with_sampled.push(other);
            let block = run(&g, &with_sampled, &batch_of(&with_sampled, vocab));
            for (r, (a, b)) in greedy.iter().zip(&block).enumerate() {
                assert_eq!((a.token, a.status), (b.token, b.status), "vocab {vocab} n {n} row {r}: grid vs block path");
                same += 1;
            }
        }
    }
    tally.finish("greedy rows over the grid");
    println!("greedy rows: {same} ids equal to sample_rows' own");
}
