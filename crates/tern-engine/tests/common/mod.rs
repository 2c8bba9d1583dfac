//! Shared by the engine tests: a small random model with the real 248,320-row vocabulary and the real tokenizer,
//! and a backend wrapper that records every step and can be told to fail.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tern_engine::{AllocError, Backend, CpuBackend, Event, Events, Output, Request, SeqId, Want, Work};
use tern_model::testutil::qwen_dir;
use tern_model::Weights;
use tern_text::{SamplingParams, Tokenizer};

pub fn tokenizer() -> Option<Arc<Tokenizer>> {
    static TOK: OnceLock<Option<Arc<Tokenizer>>> = OnceLock::new();
    TOK.get_or_init(|| Some(Arc::new(Tokenizer::from_dir(qwen_dir()?).unwrap()))).clone()
}

/// The real config shrunk to 4 layers (3 Gated DeltaNet + 1 attention) of width 64 with 8 experts, the real
/// vocabulary kept; random 4-bit weights (the recipe the product loads), made once per test binary.
pub fn real_vocab_weights() -> Option<Arc<Weights>> {
    static W: OnceLock<Option<Arc<Weights>>> = OnceLock::new();
    W.get_or_init(|| {
        let sizes = [
            ("hidden_size", 64),
            ("num_hidden_layers", 4),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("head_dim", 32),
            ("linear_num_key_heads", 2),
            ("linear_num_value_heads", 4),
            ("linear_key_head_dim", 16),
            ("linear_value_head_dim", 16),
            ("num_experts", 8),
            ("num_experts_per_tok", 2),
            ("moe_intermediate_size", 64),
            ("shared_expert_intermediate_size", 64),
        ];
        let w = tern_model::testutil::real_vocab_q4(&sizes, 11)?;
        assert_eq!(w.config.vocab_size, 248_320);
        Some(Arc::new(w))
    })
    .clone()
}

/// The real tokenizer, or print `SKIPPED: <name>` and return from the test.
#[macro_export]
macro_rules! tok_or_skip {
    ($name:literal) => {
        match common::tokenizer() {
            Some(t) => t,
            None => {
                println!(concat!("SKIPPED: ", $name, ": TERN_QWEN_DIR not set"));
                return;
            }
        }
    };
}

#[macro_export]
macro_rules! real_or_skip {
    ($name:literal) => {
        match (common::tokenizer(), common::real_vocab_weights()) {
            (Some(t), Some(w)) => (t, w),
            _ => {
                println!(concat!("SKIPPED: ", $name, ": TERN_QWEN_DIR not set"));
                return;
            }
        }
    };
}

pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
        max_tokens,
        stop_strings: vec![],
        stop_ids: vec![],
        logprobs: None,
        constraint: None,
        min_tokens: 0,
        images: Vec::new(),
    }
}

/// Tokens and the final event of a stream.
pub fn drain(rx: Events) -> (Vec<u32>, Event) {
    let mut toks = vec![];
    for ev in rx {
        match ev {
            Event::Token { token, .. } => toks.push(token),
            done => return (toks, done),
        }
    }
    panic!("stream ended without Done or Error");
}

/// Prompt `i` of a test: `n` ids spread over the vocabulary, distinct per `i`.
pub fn prompt(i: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|j| (j * 7919 + i * 104_729 + 13) % 248_000).collect()
}

/// One recorded step item: the sequence, how many ids it read, the first of them, and whether it sampled.
#[derive(Clone, Debug)]
pub struct Item {
    pub seq: SeqId,
    pub n: usize,
    pub ids: Vec<u32>,
    pub sample: bool,
}

/// A backend that records every step and delegates to a CPU backend; a step containing `panic_on` panics
/// (after the inner step ran: the states are half-updated), an item containing `fail_on` fails. While held
/// ([`Recorder::hold`]), a step waits before it runs.
pub struct Recorder {
    pub inner: CpuBackend,
    pub steps: Mutex<Vec<Vec<Item>>>,
    pub panic_on: Option<u32>,
    pub fail_on: Option<u32>,
    pub panics: AtomicUsize,
    held: Mutex<bool>,
    wake: Condvar,
}

impl Recorder {
    pub fn new(inner: CpuBackend) -> Recorder {
        Recorder {
            inner,
            steps: Mutex::new(vec![]),
            panic_on: None,
            fail_on: None,
            panics: AtomicUsize::new(0),
            held: Mutex::new(false),
            wake: Condvar::new(),
        }
    }

    pub fn steps(&self) -> Vec<Vec<Item>> {
        self.steps.lock().unwrap().clone()
    }

    pub fn hold(&self) {
        *self.held.lock().unwrap() = true;
    }

    pub fn release(&self) {
        *self.held.lock().unwrap() = false;
        self.wake.notify_all();
    }

    /// Wait until the scheduler has entered `n` steps (so that what is submitted next joins a later one).
    pub fn wait_for_steps(&self, n: usize) {
        let t0 = Instant::now();
        while self.steps.lock().unwrap().len() < n {
            assert!(t0.elapsed() < Duration::from_secs(30), "the scheduler did not step");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Submit `reqs` so that they all start in the same step: a one-token request first, held in its step until
/// the others are queued. Returns their streams (the first request's is drained).
pub fn submit_together(engine: &tern_engine::Engine, rec: &Recorder, reqs: &[Request]) -> Vec<Events> {
    rec.hold();
    let before = rec.steps.lock().unwrap().len();
    let first = engine.submit(greedy(prompt(1000, 3), 1)).unwrap();
    rec.wait_for_steps(before + 1);
    let rxs = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    rec.release();
    drain(first);
    rxs
}

impl Backend for Recorder {
    fn name(&self) -> &str {
        "recorder"
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
    fn max_drafts(&self) -> usize {
        self.inner.max_drafts()
    }
    fn step(&self, work: &[Work]) -> Vec<anyhow::Result<Output>> {
        let items = work
            .iter()
            .map(|w| Item {
                seq: w.seq,
                n: w.ids.len(),
                ids: w.ids.to_vec(),
                sample: matches!(w.out, Want::Sample(_) | Want::Verify(_)),
            })
            .collect();
        self.steps.lock().unwrap().push(items);
        let mut held = self.held.lock().unwrap();
        while *held {
            held = self.wake.wait(held).unwrap();
        }
        drop(held);
        let mut out = self.inner.step(work);
        if let Some(p) = self.panic_on {
            if work.iter().any(|w| w.ids.contains(&p)) {
                self.panics.fetch_add(1, Ordering::SeqCst);
                panic!("test panic: poison token {p} read");
            }
        }
        if let Some(f) = self.fail_on {
            for (w, r) in work.iter().zip(out.iter_mut()) {
                if w.ids.contains(&f) {
                    *r = Err(anyhow::anyhow!("test failure: token {f} read"));
                }
            }
        }
        out
    }
}
