//! Constrained decoding through the engine: every draw of a constrained request follows its masks, masks are
//! computed beside the step (not before it), a failing constraint fails its request only, and with the real
//! tokenizer a JSON schema holds on the CPU backend of a random model.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tern_engine::{
    mask_allows, sample_host, Backend, Constraint, CpuBackend, Engine, EngineConfig, Event, FinishReason, MaskSlot,
    Request, Sample, SamplingParams, ScriptedBackend, StepHook, TokenConstraint, Work,
};
use tern_model::testutil::qwen_dir;
use tern_text::{Grammars, Reply, Spec, Tokenizer, DEFAULT_STOP_IDS};

const VOCAB: usize = 384;

/// The tests that time steps or use the cores take turns (the others are light).
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}
const STOP: u32 = 300;

fn words(ids: &[u32]) -> Vec<u32> {
    let mut w = vec![0u32; VOCAB.div_ceil(32)];
    for &i in ids {
        w[i as usize / 32] |= 1 << (i % 32);
    }
    w
}

/// Forces `seq`, then `STOP`; then (with `then_free`) no constraint. Each mask takes `delay`; `fail_at` fails that
/// draw's mask.
#[derive(Clone)]
struct Forced {
    seq: Vec<u32>,
    at: usize,
    delay: Duration,
    fail_at: Option<usize>,
    then_free: bool,
    masks: Arc<AtomicUsize>,
}

impl TokenConstraint for Forced {
    fn mask(&mut self) -> Result<Option<Vec<u32>>> {
        std::thread::sleep(self.delay);
        self.masks.fetch_add(1, Ordering::SeqCst);
        if self.fail_at == Some(self.at) {
            bail!("constraint broke at {}", self.at);
        }
        Ok(match self.seq.get(self.at) {
            Some(&t) => Some(words(&[t])),
            None if self.then_free => None,
            None => Some(words(&[STOP])),
        })
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        if self.seq.get(self.at) != Some(&token) {
            bail!("drew {token}, which the mask did not allow");
        }
        self.at += 1;
        Ok(())
    }

    fn box_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(self.clone())
    }
}

fn forced(seq: &[u32], delay: Duration) -> Forced {
    Forced { seq: seq.to_vec(), at: 0, delay, fail_at: None, then_free: false, masks: Arc::default() }
}

fn request(max_tokens: usize, c: Option<Forced>) -> Request {
    Request {
        prompt: vec![1, 2, 3],
        sampling: SamplingParams { temperature: 1.0, seed: Some(5), ..SamplingParams::default() },
        max_tokens,
        stop_strings: vec![],
        stop_ids: vec![STOP],
        logprobs: None,
        constraint: c.map(Constraint::new),
        min_tokens: 0,
        images: Vec::new(),
    }
}

fn run(engine: &Engine, req: Request) -> (Vec<u32>, Event) {
    let mut toks = vec![];
    for ev in engine.submit(req).unwrap() {
        match ev {
            Event::Token { token, .. } => toks.push(token),
            done => return (toks, done),
        }
    }
    panic!("no final event");
}

/// A scripted backend whose steps take `delay` (the forward pass a mask is computed beside).
fn slow(delay: Duration) -> Arc<dyn Backend> {
    Arc::new(StepHook {
        inner: ScriptedBackend::new(VOCAB, vec![7]),
        hook: move |b: &ScriptedBackend, work: &[Work]| {
            std::thread::sleep(delay);
            b.step(work)
        },
    })
}

#[test]
fn constrained_requests_draw_what_the_masks_allow() {
    let tok = tok_or_skip!("constrained_requests_draw_what_the_masks_allow");
    // The script says 7 every time (logit 30); the masks say otherwise.
    let backend = Arc::new(ScriptedBackend::new(VOCAB, vec![7]));
    let engine = Engine::start(backend, tok, EngineConfig::default());
    let (toks, done) = run(&engine, request(20, Some(forced(&[40, 41, 42], Duration::ZERO))));
    assert_eq!(toks, vec![40, 41, 42, STOP]);
    assert!(matches!(done, Event::Done { finish: FinishReason::Stop, .. }), "{done:?}");
    // A constraint that ends leaves the rest free: the script's 7s follow.
    let c = Forced { then_free: true, ..forced(&[40], Duration::ZERO) };
    let (toks, _) = run(&engine, request(4, Some(c)));
    assert_eq!(toks, vec![40, 7, 7, 7]);
    // Unconstrained requests in the same engine are untouched; several constrained ones run side by side.
    let rxs: Vec<_> = (0..4u32)
        .map(|i| {
            engine.submit(request(6, i.is_multiple_of(2).then(|| forced(&[50 + i, 60 + i], Duration::ZERO)))).unwrap()
        })
        .collect();
    for (i, rx) in rxs.into_iter().enumerate() {
        let toks: Vec<u32> = rx
            .into_iter()
            .filter_map(|e| match e {
                Event::Token { token, .. } => Some(token),
                _ => None,
            })
            .collect();
        let i = i as u32;
        let want = if i.is_multiple_of(2) { vec![50 + i, 60 + i, STOP] } else { vec![7; 6] };
        assert_eq!(toks, want, "request {i}");
    }
    // A failing constraint fails its request with the reason; the engine goes on.
    let c = Forced { fail_at: Some(1), ..forced(&[40, 41], Duration::ZERO) };
    let (toks, done) = run(&engine, request(10, Some(c)));
    assert_eq!(toks, vec![40]);
    assert!(matches!(&done, Event::Error(e) if e.contains("constraint broke at 1")), "{done:?}");
    let (toks, _) = run(&engine, request(3, None));
    assert_eq!(toks, vec![7, 7, 7]);
    assert!(engine.stats.masks.load(Ordering::Relaxed) >= 12);
}

/// With steps of 60 ms and masks of 40 ms, the masks cost the steps (almost) nothing: each is computed while the
/// step that needs it runs its forward pass.
#[test]
fn masks_are_computed_beside_the_step() {
    let _turn = turn();
    let tok = tok_or_skip!("masks_are_computed_beside_the_step");
    let (step, mask) = (Duration::from_millis(60), Duration::from_millis(40));
    let backend = slow(step);
    let engine = Engine::start(backend, tok, EngineConfig::default());
    let seq: Vec<u32> = (100..110).collect();
    let t0 = Instant::now();
    let (toks, _) = run(&engine, request(20, Some(forced(&seq, mask))));
    let took = t0.elapsed();
    assert_eq!(toks.len(), 11);
    let (masks, mask_us, wait_us) = (
        engine.stats.masks.load(Ordering::Relaxed),
        engine.stats.mask_us.load(Ordering::Relaxed),
        engine.stats.mask_wait_us.load(Ordering::Relaxed),
    );
    println!(
        "11 steps of {step:?} with masks of {mask:?}: {took:?} in all; masks {:.1} ms, waited for {:.1} ms",
        mask_us as f64 / 1e3,
        wait_us as f64 / 1e3
    );
    assert_eq!(masks, 11);
    assert!(mask_us >= 11 * 40_000, "{mask_us}");
    // Serial would be 11 * 100 ms; beside the step it is about 11 * 60 ms.
    assert!(wait_us < mask_us / 4, "waited {wait_us} us of {mask_us}");
    assert!(took < Duration::from_millis(11 * 90), "{took:?}");
}

/// A grammar whose masks are slow holds every stream of the steps it is in, so its hold is bounded: a mask not there
/// `mask_wait_limit` after the step reaches it fails the request, and a request whose masks have held the steps
/// `mask_stall_budget` in all ends with an error; an unconstrained request beside it runs to its end meanwhile.
#[test]
fn slow_masks_hold_the_steps_for_a_bounded_time() {
    let _turn = turn();
    let tok = tok_or_skip!("slow_masks_hold_the_steps_for_a_bounded_time");
    let cfg = EngineConfig {
        mask_wait_limit: Duration::from_millis(300),
        mask_stall_budget: Duration::from_millis(400),
        ..EngineConfig::default()
    };
    let engine = Engine::start(slow(Duration::from_millis(5)), tok, cfg);
    // masks of 150 ms beside steps of 5 ms: each draw holds its step ~145 ms; the budget ends it after a few
    let seq: Vec<u32> = (100..140).collect();
    let t0 = Instant::now();
    let slow_rx = engine.submit(request(40, Some(forced(&seq, Duration::from_millis(150))))).unwrap();
    let free_rx = engine.submit(request(60, None)).unwrap();
    let (mut toks, mut end) = (vec![], None);
    for ev in slow_rx {
        match ev {
            Event::Token { token, .. } => toks.push(token),
            done => {
                end = Some(done);
                break;
            }
        }
    }
    let (ended, slow_tokens) = (t0.elapsed(), toks.len());
    let end = end.expect("a final event");
    assert!(matches!(&end, Event::Error(e) if e.contains("too expensive")), "{end:?}");
    assert!(toks.len() >= 2 && toks.len() < 10, "{} tokens before the budget ended it", toks.len());
    assert_eq!(toks, seq[..toks.len()], "every draw followed its mask");
    assert!(ended < Duration::from_secs(2), "ended after {ended:?}");
    let free: Vec<u32> = free_rx
        .into_iter()
        .filter_map(|e| match e {
            Event::Token { token, .. } => Some(token),
            _ => None,
        })
        .collect();
    assert_eq!(free, vec![7; 60], "the unconstrained request beside it");
    // one mask that takes far longer than the limit: the draw fails at the limit, not when the mask is done
    let t0 = Instant::now();
    let (toks, done) = run(&engine, request(5, Some(forced(&[40, 41], Duration::from_secs(3)))));
    let took = t0.elapsed();
    assert!(toks.is_empty() && matches!(&done, Event::Error(e) if e.contains("took over 0.3 s")), "{toks:?} {done:?}");
    assert!(took < Duration::from_millis(3000), "a 3 s mask failed after {took:?}");
    println!(
        "slow masks: {} tokens, then the stall budget ended the request after {ended:?}; a 3 s mask failed its draw after \
         {took:?}; the free request beside them ran its 60 tokens",
        slow_tokens
    );
}

#[test]
fn sample_host_applies_the_mask() {
    let slot = MaskSlot::ready(words(&[3, 9, 200]));
    let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let mut seen = std::collections::HashSet::new();
    for seed in 0..200 {
        let mut logits = vec![0.0f32; VOCAB];
        logits[5] = 50.0; // the model's favourite, not allowed
        let s = Sample { params: &params, seed, history: &[], top_logprobs: Some(2), limit: VOCAB, mask: Some(&slot) };
        assert!(!s.is_argmax());
        let got = sample_host(&mut logits, &s).unwrap();
        assert!(mask_allows(&words(&[3, 9, 200]), got.token), "{}", got.token);
        // Log-probabilities describe the model's distribution, before the mask.
        assert_eq!(got.logprob.unwrap().top[0].0, 5);
        seen.insert(got.token);
    }
    assert_eq!(seen.len(), 3, "every allowed id is drawn sometimes");
    // Every allowed logit -inf: the lowest allowed id. An empty mask: an error. A failed mask: its reason.
    let mut logits = vec![f32::NEG_INFINITY; VOCAB];
    let s = Sample { params: &params, seed: 1, history: &[], top_logprobs: None, limit: VOCAB, mask: Some(&slot) };
    assert_eq!(sample_host(&mut logits, &s).unwrap().token, 3);
    let empty = MaskSlot::ready(words(&[]));
    let s = Sample { mask: Some(&empty), ..s };
    assert!(sample_host(&mut vec![0.0; VOCAB], &s).is_err());
    let failed = MaskSlot::pending();
    failed.fill(Err("bad grammar state".into()));
    let s = Sample { mask: Some(&failed), ..s };
    let e = sample_host(&mut vec![0.0; VOCAB], &s).unwrap_err().to_string();
    assert!(e.contains("bad grammar state"), "{e}");
    // Ok(None): unconstrained after all.
    let free = MaskSlot::pending();
    free.fill(Ok(None));
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let s = Sample { params: &greedy, mask: Some(&free), ..s };
    let mut logits = vec![0.0; VOCAB];
    logits[5] = 1.0;
    assert_eq!(sample_host(&mut logits, &s).unwrap().token, 5);
}

/// A JSON schema on the CPU backend of a random model with the real vocabulary: every reply parses and follows it.
#[test]
fn json_schema_on_a_random_model() {
    let _turn = turn();
    let Some(dir) = qwen_dir() else {
        println!("SKIPPED: json_schema_on_a_random_model: TERN_QWEN_DIR not set");
        return;
    };
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let Some(weights) = common::real_vocab_weights() else { return };
    let grammars = Grammars::from_dir(&dir).unwrap();
    let engine = Engine::start(Arc::new(CpuBackend::new(weights)), tok.clone(), EngineConfig::default());
    let schema = serde_json::json!({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 5},
        "word": {"type": "string", "maxLength": 6},
        "pick": {"enum": ["a", "b", null]}},
        "required": ["n", "word", "pick"], "additionalProperties": false});
    let reply = Reply { thinking: false, reasoning_budget: None, stop_ids: DEFAULT_STOP_IDS.to_vec() };
    for seed in 0..4 {
        let c = grammars.compile(Spec::JsonSchema { schema: &schema, strict: true }, &reply).unwrap();
        let req = Request {
            prompt: tok.encode("<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n", false).unwrap(),
            sampling: SamplingParams { temperature: 1.0, seed: Some(seed), ..SamplingParams::default() },
            max_tokens: 200,
            stop_strings: vec![],
            stop_ids: DEFAULT_STOP_IDS.to_vec(),
            logprobs: None,
            constraint: Some(Constraint::new(c)),
            min_tokens: 0,
            images: Vec::new(),
        };
        let mut text = String::new();
        let mut finish = None;
        for ev in engine.submit(req).unwrap() {
            match ev {
                Event::Token { text: t, .. } => text += &t,
                Event::Done { finish: f, .. } => finish = Some(f),
                Event::Error(e) => panic!("{e}"),
            }
        }
        assert_eq!(finish, Some(FinishReason::Stop), "seed {seed}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        // (-0 is an integer JSON parsers may read as a float)
        assert!(v["n"].as_f64().is_some_and(|n| n.fract() == 0.0 && (-5.0..=5.0).contains(&n)), "{text}");
        assert!(v["word"].as_str().is_some_and(|w| w.chars().count() <= 6), "{text}");
        assert!(["a", "b"].contains(&v["pick"].as_str().unwrap_or("a")) && v.as_object().unwrap().len() == 3, "{text}");
    }
}

/// Time per token on the CPU backend (random 4-layer model, the real 248k vocabulary) without a constraint and
/// with JSON schemas: the figures of docs/perf.md's constrained-decoding row (tern_engine::cost; the CUDA backend's
/// are tern-cuda's gpu test `constrained_decoding_cost_on_cuda`).
#[test]
fn constrained_decoding_cost_on_the_cpu_backend() {
    let _turn = turn();
    let Some(dir) = qwen_dir() else {
        println!("SKIPPED: constrained_decoding_cost_on_the_cpu_backend: TERN_QWEN_DIR not set");
        return;
    };
    let Some(weights) = common::real_vocab_weights() else { return };
    for r in tern_engine::cost::constrained_decoding_cost(Arc::new(CpuBackend::new(weights)), &dir).unwrap() {
        println!(
            "constrained decoding cost, CPU backend, {}: {} tokens, {:.2} ms a token (decode); masks {:.0} us a token \
             computed, {:.0} us a token waited for",
            r.case, r.tokens, r.ms_per_token, r.mask_us, r.wait_us
        );
    }
}
