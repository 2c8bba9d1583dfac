//! Speculative decoding on the CPU backend: the model's MTP block drafts, one step verifies. Greedy replies are
//! the ids of plain decoding exactly (batched, across a prefix-cache hit, under a JSON schema, a forced tool call
//! and a stateful constraint), and sampled ones are distributed as plain sampling's (a χ² test of the first three
//! tokens). A random model of the real vocabulary rejects almost every draft; a constructed checkpoint
//! (`tern random-model --mtp-accept`) accepts them at the published rates, so both paths run.

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use common::{drain, greedy, prompt};
use tern_engine::{Constraint, CpuBackend, Engine, EngineConfig, Event, Request, TokenConstraint};
use tern_model::random::{write_random_model_with, MtpAccept};
use tern_model::safetensors::Dtype;
use tern_model::testutil::{fixtures_dir, qwen_dir};
use tern_model::{LoadOptions, Weights};
use tern_text::constraint::{Grammars, Reply, Spec};
use tern_text::{SamplingParams, Tokenizer, DEFAULT_STOP_IDS};

/// An engine over `w`, drafting `k` tokens a step (0: plain decoding).
fn engine(w: &Arc<Weights>, tok: &Arc<Tokenizer>, k: usize, cache: bool) -> Engine {
    let backend = CpuBackend::new(w.clone()).speculative(k > 0);
    let cfg =
        EngineConfig { speculative: k, prefix_cache_bytes: if cache { 1 << 30 } else { 0 }, ..EngineConfig::default() };
    Engine::start(Arc::new(backend), tok.clone(), cfg)
}

/// Every request's ids and final event, all submitted at once (so they are batched).
fn run_all(e: &Engine, reqs: &[Request]) -> Vec<(Vec<u32>, Event)> {
    let rxs: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    rxs.into_iter().map(drain).collect()
}

/// Plain and speculative replies (`k` drafts a step, each of `ks`) are the same; returns per k (drafts checked,
/// drafts accepted) of the speculative run.
fn same_replies(w: &Arc<Weights>, tok: &Arc<Tokenizer>, reqs: &[Request], ks: &[usize], what: &str) -> Vec<(u64, u64)> {
    let want = run_all(&engine(w, tok, 0, false), reqs);
    let mut out = Vec::new();
    for &k in ks {
        let e = engine(w, tok, k, false);
        let got = run_all(&e, reqs);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(!matches!(w.1, Event::Error(_)), "{what}: request {i}: {:?}", w.1);
            assert_eq!(g.0, w.0, "{what}: k {k}: request {i}: drafted ids differ from plain decoding");
            assert_eq!(g.1, w.1, "{what}: k {k}: request {i}: final event differs");
        }
        let (checked, accepted) =
            (e.stats.spec_drafts.load(Ordering::Relaxed), e.stats.spec_accepted.load(Ordering::Relaxed));
        println!(
            "{what}: {} requests, {} tokens: identical; k = {k}: {} verifies, {checked} drafts checked, {accepted} \
             accepted",
            reqs.len(),
            got.iter().map(|g| g.0.len()).sum::<usize>(),
            e.stats.spec_verifies.load(Ordering::Relaxed),
        );
        assert!(checked > 0, "{what}: no draft was checked");
        out.push((checked, accepted));
    }
    out
}

fn with_mtp(w: Option<Arc<Weights>>, name: &str) -> Option<Arc<Weights>> {
    let w = w?;
    if w.mtp.is_none() {
        println!("SKIPPED: {name}: the model has no MTP block");
        return None;
    }
    Some(w)
}

/// Greedy with drafts = greedy without, 10 prompts × 200 tokens on a random model of the real vocabulary (whose
/// drafts are mostly rejected: the rejection path, and drafting paused and resumed), with 2 drafts.
#[test]
fn greedy_with_drafts_is_greedy_without_on_a_random_model() {
    let (tok, w) = real_or_skip!("greedy_with_drafts_is_greedy_without_on_a_random_model");
    let Some(w) = with_mtp(Some(w), "greedy_with_drafts_is_greedy_without_on_a_random_model") else { return };
    let reqs: Vec<Request> = (0..10).map(|i| greedy(prompt(i, 5 + 7 * i as usize), 200)).collect();
    same_replies(&w, &tok, &reqs, &[2], "random model");
}

/// A second turn that forks a snapshot of the first (the prefix cache) drafts from the snapshot's MTP cache and
/// still replies as plain decoding does.
#[test]
fn greedy_with_drafts_across_a_prefix_cache_hit() {
    let (tok, w) = real_or_skip!("greedy_with_drafts_across_a_prefix_cache_hit");
    let Some(w) = with_mtp(Some(w), "greedy_with_drafts_across_a_prefix_cache_hit") else { return };
    for k in [0, 3] {
        let e = engine(&w, &tok, k, true);
        let mut turns = Vec::new();
        let mut p = prompt(3, 40);
        for turn in 0..3 {
            let (ids, done) = drain(e.submit(greedy(p.clone(), 30)).unwrap());
            let Event::Done { usage, .. } = done else { panic!("turn {turn}: {done:?}") };
            if turn > 0 {
                assert!(usage.cached_tokens > 0, "k {k} turn {turn}: no prefix-cache hit");
            }
            p.extend_from_slice(&ids);
            p.extend_from_slice(&prompt(10 + turn, 9));
            turns.push(ids);
        }
        println!("k = {k}: turns {:?}", turns.iter().map(|t| t.len()).collect::<Vec<_>>());
        if k == 0 {
            PLAIN.with(|c| *c.borrow_mut() = turns);
        } else {
            PLAIN.with(|c| assert_eq!(*c.borrow(), turns, "replies across cache hits differ with drafts"));
        }
    }
}

thread_local! {
    static PLAIN: std::cell::RefCell<Vec<Vec<u32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Structured output with drafts: a JSON schema and a forced tool call give plain decoding's replies (drafts the
/// grammar forbids are never accepted; the masks after each draft are computed on a copy of the constraint).
#[test]
fn constrained_greedy_with_drafts_is_greedy_without() {
    let (tok, w) = real_or_skip!("constrained_greedy_with_drafts_is_greedy_without");
    let Some(w) = with_mtp(Some(w), "constrained_greedy_with_drafts_is_greedy_without") else { return };
    let Some(dir) = qwen_dir() else { return };
    let grammars = Grammars::from_dir(&dir).unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 5},
        "word": {"type": "string", "maxLength": 6}},
        "required": ["n", "word"], "additionalProperties": false});
    let tools = [serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}})];
    let reply = Reply { thinking: false, reasoning_budget: None, stop_ids: DEFAULT_STOP_IDS.to_vec() };
    let mut reqs = Vec::new();
    for i in 0..4 {
        let spec = if i % 2 == 0 {
            Spec::JsonSchema { schema: &schema, strict: true }
        } else {
            Spec::ToolCalls { tools: &tools, parallel: false }
        };
        let c = grammars.compile(spec, &reply).unwrap();
        let mut r = greedy(prompt(20 + i, 12), 120);
        r.stop_ids = DEFAULT_STOP_IDS.to_vec();
        r.constraint = Some(Constraint::new(c));
        reqs.push(r);
    }
    same_replies(&w, &tok, &reqs, &[3], "json schema and forced tool");
}

/// A checkpoint whose MTP block agrees with the model by construction (`tern random-model --mtp-accept
/// 0.8,0.5375`: first drafts right 80% of the time, second ones 43%, the published rates of this family): tiny-mtp-a's
/// shape at width 512 and 1,024 ids, quantised to 4 bits on load as the product runs. Made once per test binary.
fn constructed() -> Arc<Weights> {
    static W: OnceLock<Arc<Weights>> = OnceLock::new();
    W.get_or_init(|| {
        let path = fixtures_dir().join("tiny-mtp-a/config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        cfg.as_object_mut().unwrap().remove("vision_config");
        cfg["text_config"]["hidden_size"] = 512.into();
        cfg["text_config"]["vocab_size"] = 1024.into();
        let dir = std::env::temp_dir().join(format!("tern-spec-constructed-{}", std::process::id()));
        let accept = MtpAccept { first: 0.8, later: 0.5375 };
        write_random_model_with(&cfg, &dir, Dtype::BF16, 5, None, Some(accept)).unwrap();
        let w = Weights::load_with(&dir, LoadOptions { quantize: true }).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(w)
    })
    .clone()
}

/// Prompt `i` of the constructed model: `n` ordinary ids (2..1024).
fn small_prompt(i: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|j| 2 + (j * 389 + i * 97 + 5) % 1022).collect()
}

/// Greedy with drafts = greedy without on the constructed model, where most drafts are accepted: 10 prompts × 200
/// tokens, 3 drafts a step, batched; and the acceptance is what the construction promises.
#[test]
fn greedy_with_accepted_drafts_is_greedy_without() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: greedy_with_accepted_drafts_is_greedy_without: TERN_QWEN_DIR not set");
        return;
    };
    let w = constructed();
    let reqs: Vec<Request> = (0..10).map(|i| greedy(small_prompt(i, 3 + 5 * i as usize), 200)).collect();
    let got = same_replies(&w, &tok, &reqs, &[1, 3], "constructed model");
    // 1 draft: ~0.8 accepted; 3 drafts: 0.8 + 0.43 + 0.23 of 3 checked, ~0.49 (only while none before failed).
    let rate = |(c, a): (u64, u64)| a as f64 / c as f64;
    assert!((rate(got[0]) - 0.8).abs() < 0.08, "1 draft: {:.3} accepted", rate(got[0]));
    assert!(rate(got[1]) > 0.3, "3 drafts: {:.3} accepted", rate(got[1]));
}

/// A second turn that forks a snapshot (the prefix cache) drafts from the snapshot's MTP cache, accepts, and replies
/// as plain decoding does.
#[test]
fn accepted_drafts_across_a_prefix_cache_hit() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: accepted_drafts_across_a_prefix_cache_hit: TERN_QWEN_DIR not set");
        return;
    };
    let w = constructed();
    let mut all = Vec::new();
    for k in [0, 3] {
        let e = engine(&w, &tok, k, true);
        let mut p = small_prompt(1, 30);
        let mut turns = Vec::new();
        for turn in 0..3 {
            let (ids, done) = drain(e.submit(greedy(p.clone(), 40)).unwrap());
            let Event::Done { usage, .. } = done else { panic!("turn {turn}: {done:?}") };
            assert!(turn == 0 || usage.cached_tokens > 0, "k {k} turn {turn}: no prefix-cache hit");
            p.extend_from_slice(&ids);
            p.extend_from_slice(&small_prompt(10 + turn, 7));
            turns.push(ids);
        }
        if k > 0 {
            assert!(e.stats.spec_accepted.load(Ordering::Relaxed) > 0, "no draft accepted");
        }
        all.push(turns);
    }
    assert_eq!(all[0], all[1], "replies across cache hits differ with drafts");
}

/// A constraint that forbids, after each token, the ids congruent to the sum of the reply so far (mod 4): a
/// quarter of the cycle's next ids are forbidden, so drafts are checked against masks that change with them.
#[derive(Clone, Default)]
struct Mod4 {
    sum: u32,
}

impl TokenConstraint for Mod4 {
    fn mask(&mut self) -> anyhow::Result<Option<Vec<u32>>> {
        let limit = 248_320usize;
        let mut words = vec![0u32; limit.div_ceil(32)];
        for id in (0..limit as u32).filter(|id| id % 4 != self.sum % 4) {
            words[id as usize / 32] |= 1 << (id % 32);
        }
        Ok(Some(words))
    }
    fn commit(&mut self, token: u32) -> anyhow::Result<()> {
        self.sum = self.sum.wrapping_add(token);
        Ok(())
    }
    fn box_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(self.clone())
    }
}

/// Under a stateful constraint, drafts are accepted where the masks after them allow, and the replies are plain
/// decoding's.
#[test]
fn accepted_drafts_under_a_stateful_constraint() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: accepted_drafts_under_a_stateful_constraint: TERN_QWEN_DIR not set");
        return;
    };
    let w = constructed();
    let reqs: Vec<Request> = (0..6)
        .map(|i| {
            let mut r = greedy(small_prompt(40 + i, 9), 100);
            r.constraint = Some(Constraint::new(Mod4::default()));
            r
        })
        .collect();
    let got = same_replies(&w, &tok, &reqs, &[3], "mod-4 constraint");
    assert!(got[0].1 > 0, "no draft accepted under the constraint");
}

/// Sampled replies with drafts are distributed as plain sampling's: the joint distribution of the first three tokens
/// (top-k 3 at a temperature that spreads them: 27 cells) on the constructed model, whose drafts are often
/// accepted, 1,200 seeds each way, two-sample χ².
#[test]
fn sampled_with_drafts_is_distributed_as_without() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: sampled_with_drafts_is_distributed_as_without: TERN_QWEN_DIR not set");
        return;
    };
    let w = constructed();
    let n = 1200;
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            let mut r = greedy(small_prompt(77, 6), 3);
            r.sampling = SamplingParams { temperature: 12.0, top_k: 3, seed: Some(i), ..SamplingParams::default() };
            r
        })
        .collect();
    let count = |k: usize| {
        let e = engine(&w, &tok, k, false);
        let mut cells: HashMap<Vec<u32>, usize> = HashMap::new();
        for chunk in reqs.chunks(64) {
            for (ids, done) in run_all(&e, chunk) {
                assert!(matches!(done, Event::Done { .. }), "{done:?}");
                *cells.entry(ids).or_default() += 1;
            }
        }
        let (c, a) = (e.stats.spec_drafts.load(Ordering::Relaxed), e.stats.spec_accepted.load(Ordering::Relaxed));
        (cells, c, a)
    };
    let (plain, _, _) = count(0);
    let (spec, checked, accepted) = count(2);
    let keys: std::collections::BTreeSet<&Vec<u32>> = plain.keys().chain(spec.keys()).collect();
    let mut x2 = 0.0;
    for key in &keys {
        let (a, b) = (*plain.get(*key).unwrap_or(&0) as f64, *spec.get(*key).unwrap_or(&0) as f64);
        let e = (a + b) / 2.0;
        x2 += (a - e).powi(2) / e + (b - e).powi(2) / e;
    }
    println!("{} cells, χ² {x2:.1}; {checked} drafts checked, {accepted} accepted", keys.len());
    assert!(accepted > 0 && accepted < checked, "both paths: {accepted} of {checked} accepted");
    // 99.9th percentile of χ² with 26 degrees of freedom: 54.1.
    assert!(keys.len() <= 27 && x2 < 54.1, "χ² {x2:.1} over {} cells", keys.len());
}

/// The same seed gives the same sampled text with drafts, alone or batched with others.
#[test]
fn sampled_with_drafts_is_reproducible_by_seed() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: sampled_with_drafts_is_reproducible_by_seed: TERN_QWEN_DIR not set");
        return;
    };
    let w = constructed();
    let req = |seed: u64| {
        let mut r = greedy(small_prompt(5, 8), 60);
        r.sampling = SamplingParams { temperature: 12.0, top_k: 3, seed: Some(seed), ..SamplingParams::default() };
        r
    };
    let e = engine(&w, &tok, 3, false);
    let alone = drain(e.submit(req(42)).unwrap()).0;
    let batch: Vec<Request> = (40..46).map(req).collect();
    let together = run_all(&e, &batch);
    assert_eq!(together[2].0, alone, "seed 42 batched differs from alone");
    assert!(together.iter().any(|t| t.0 != alone), "different seeds gave the same text");
    assert!(e.stats.spec_accepted.load(Ordering::Relaxed) > 0);
}
