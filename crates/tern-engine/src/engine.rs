//! The engine: a queue of generation requests served by one scheduler thread that interleaves all active
//! sequences fairly (one prefill chunk or one decoded token per sequence per round), streams events back, and
//! keeps a prefix cache of sequence states across requests.
//!
//! A request whose receiver is dropped (client gone) is cancelled at its next step and its state freed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tern_text::{DetokConfig, Detokenizer, Finish, Sampler, SamplingParams, Tokenizer, IM_START_ID};

use crate::backend::{Backend, Sequence};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Context length: prompt + generated tokens of one sequence.
    pub ctx_size: usize,
    /// Sequences decoded at once; the rest wait in the queue.
    pub max_concurrent: usize,
    /// Requests waiting beyond the active ones before `submit` answers `QueueFull`.
    pub max_queue: usize,
    /// Prompt tokens read per scheduler round (keeps other sequences streaming during a long prefill).
    pub prefill_chunk: usize,
    /// Sequence states kept for reuse by later requests that start with the same tokens.
    pub prefix_cache_entries: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { ctx_size: 32768, max_concurrent: 8, max_queue: 64, prefill_chunk: 512, prefix_cache_entries: 8 }
    }
}

/// One generation request, in tokens.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_strings: Vec<String>,
    pub stop_ids: Vec<u32>,
    /// Return the log-probability of each token and this many alternatives.
    pub logprobs: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens at this position, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id or stop string.
    Stop,
    /// max_tokens or the context size.
    Length,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose state came from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// One generated token and the text it completed (possibly empty: a split character or a possible stop
    /// string is held back until it resolves).
    Token {
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    Error(String),
}

#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    EmptyPrompt,
    /// Prompt plus max_tokens do not fit the context.
    TooLong {
        prompt: usize,
        max_tokens: usize,
        ctx: usize,
    },
    /// A prompt id outside the vocabulary.
    BadToken {
        id: u32,
        vocab: usize,
    },
    QueueFull {
        waiting: usize,
    },
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::EmptyPrompt => write!(f, "the prompt is empty"),
            SubmitError::TooLong { prompt, max_tokens, ctx } => write!(
                f,
                "this model's maximum context length is {ctx} tokens, but the prompt has {prompt} tokens and \
                 {max_tokens} were requested for the completion ({} in all)",
                prompt + max_tokens
            ),
            SubmitError::BadToken { id, vocab } => write!(f, "token id {id} is outside the vocabulary (size {vocab})"),
            SubmitError::QueueFull { waiting } => write!(f, "the server is busy: {waiting} requests are waiting"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Counters for /metrics.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// Sum of time-to-first-token, microseconds, and how many requests it covers.
    pub ttft_us: AtomicU64,
    pub ttft_count: AtomicU64,
    /// Time spent generating tokens after the first, microseconds.
    pub decode_us: AtomicU64,
    pub waiting: AtomicUsize,
    pub active: AtomicUsize,
}

struct Job {
    req: Request,
    events: Sender<Event>,
    received: Instant,
}

/// Handle to the engine; cheap to clone, shared by every request handler.
#[derive(Clone)]
pub struct Engine {
    jobs: Arc<Mutex<Sender<Job>>>,
    pub stats: Arc<Stats>,
    pub config: EngineConfig,
    vocab: usize,
    /// Cleared when the scheduler thread ends, however it ends (see [`Engine::is_running`]).
    running: Arc<AtomicBool>,
}

/// Clears the running flag when the scheduler thread ends, returning or unwinding.
struct RunningGuard(Arc<AtomicBool>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Engine {
    pub fn start(backend: Arc<dyn Backend>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Engine {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let vocab = backend.vocab_size();
        let (s, c) = (stats.clone(), config.clone());
        let running = Arc::new(AtomicBool::new(true));
        let guard = RunningGuard(running.clone());
        std::thread::Builder::new()
            .name("tern-scheduler".into())
            .spawn(move || {
                let _guard = guard;
                schedule(backend, tokenizer, rx, s, c)
            })
            .expect("cannot start the scheduler thread");
        Engine { jobs: Arc::new(Mutex::new(tx)), stats, config, vocab, running }
    }

    /// Whether the scheduler thread is still there to serve requests: false once it has ended (returned or
    /// panicked), after which no request will be served and a health check should fail.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Queue a request; events arrive on the returned receiver. Dropping it cancels the request.
    pub fn submit(&self, req: Request) -> Result<Receiver<Event>, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = req.prompt.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(SubmitError::BadToken { id, vocab: self.vocab });
        }
        if req.prompt.len() + req.max_tokens > self.config.ctx_size {
            return Err(SubmitError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                ctx: self.config.ctx_size,
            });
        }
        // Room for max_concurrent running and max_queue waiting (max_queue 0: no waiting room, not no room).
        let waiting = self.stats.waiting.load(Ordering::SeqCst);
        let active = self.stats.active.load(Ordering::SeqCst);
        if waiting + active >= self.config.max_concurrent.max(1) + self.config.max_queue {
            return Err(SubmitError::QueueFull { waiting });
        }
        let (tx, rx) = mpsc::channel();
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let job = Job { req, events: tx, received: Instant::now() };
        let sent = self.jobs.lock().map(|jobs| jobs.send(job).is_ok()).unwrap_or(false);
        if !sent {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            let (tx, rx) = mpsc::channel();
            let _ = tx.send(Event::Error("the engine has stopped".into()));
            return Ok(rx);
        }
        Ok(rx)
    }
}

struct Active<'t> {
    job: Job,
    seq: Box<dyn Sequence>,
    /// Every token the sequence has read.
    fed: Vec<u32>,
    /// Prompt tokens still to read.
    next: usize,
    /// Snapshot point: the last `<|im_start|>` of the prompt (the start of the turn being generated).
    boundary: usize,
    sampler: Sampler,
    detok: Detokenizer<'t>,
    generated: Vec<u32>,
    /// Sampled but not yet read by the sequence.
    pending: Option<u32>,
    /// Ids at or above this are embedding padding, not tokens.
    tokenizer_vocab: usize,
    usage: Usage,
    first_token: Option<Instant>,
}

enum Outcome {
    Continue,
    /// Finished or cancelled; the state may go to the prefix cache.
    Finished,
}

fn schedule(
    backend: Arc<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    rx: Receiver<Job>,
    stats: Arc<Stats>,
    cfg: EngineConfig,
) {
    let tok: &Tokenizer = &tokenizer;
    let mut active: VecDeque<Active> = VecDeque::new();
    let mut cache = PrefixCache { entries: Vec::new(), capacity: cfg.prefix_cache_entries };
    loop {
        // Admit waiting jobs (block when idle).
        while active.len() < cfg.max_concurrent.max(1) {
            let job = if active.is_empty() {
                match rx.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => break,
                }
            };
            stats.waiting.fetch_sub(1, Ordering::SeqCst);
            active.push_back(admit(job, &*backend, tok, &mut cache, &cfg));
        }
        stats.active.store(active.len(), Ordering::Relaxed);
        for _ in 0..active.len() {
            let mut a = active.pop_front().unwrap();
            match step(&mut a, &mut cache, &stats, &cfg) {
                Outcome::Continue => active.push_back(a),
                Outcome::Finished => {
                    let fed = std::mem::take(&mut a.fed);
                    cache.insert(fed, a.seq);
                }
            }
        }
        stats.active.store(active.len(), Ordering::Relaxed);
    }
}

fn admit<'t>(
    job: Job,
    backend: &dyn Backend,
    tok: &'t Tokenizer,
    cache: &mut PrefixCache,
    _cfg: &EngineConfig,
) -> Active<'t> {
    let prompt = &job.req.prompt;
    let (seq, cached) = match cache.lookup(prompt) {
        Some((seq, n)) => (seq, n),
        None => (backend.new_sequence(), 0),
    };
    let boundary = prompt.iter().rposition(|&t| t == IM_START_ID).unwrap_or(0);
    let detok = Detokenizer::new(
        tok,
        DetokConfig {
            stop_ids: job.req.stop_ids.clone(),
            stop_strings: job.req.stop_strings.clone(),
            max_tokens: Some(job.req.max_tokens),
        },
    );
    Active {
        sampler: Sampler::new(job.req.sampling.clone()),
        usage: Usage { prompt_tokens: prompt.len(), completion_tokens: 0, cached_tokens: cached },
        fed: prompt[..cached].to_vec(),
        next: cached,
        boundary,
        seq,
        detok,
        generated: Vec::new(),
        pending: None,
        tokenizer_vocab: tok.vocab_size(),
        first_token: None,
        job,
    }
}

fn step(a: &mut Active, cache: &mut PrefixCache, stats: &Stats, cfg: &EngineConfig) -> Outcome {
    let prompt_len = a.job.req.prompt.len();
    let ids: Vec<u32> = if a.next < prompt_len {
        let mut end = (a.next + cfg.prefill_chunk.max(1)).min(prompt_len);
        if a.next < a.boundary {
            end = end.min(a.boundary);
        }
        a.job.req.prompt[a.next..end].to_vec()
    } else {
        match a.pending.take() {
            Some(t) => vec![t],
            None => return Outcome::Finished,
        }
    };
    // The chunk that completes the prompt, and every decode step, yield a token: under plain greedy sampling the
    // backend may pick it where the logits are (the CUDA step's own argmax) instead of sending all of them.
    let yields_token = a.next + ids.len() >= prompt_len;
    let picked = if yields_token && a.job.req.logprobs.is_none() && a.sampler.is_plain_greedy() {
        a.seq.forward_argmax(&ids, a.tokenizer_vocab)
    } else {
        Ok(None)
    };
    let read = picked.and_then(|t| match t {
        Some(t) => Ok((Some(t), Vec::new())),
        None => a.seq.forward(&ids).map(|l| (None, l)),
    });
    let (greedy_id, logits) = match read {
        Ok(r) => r,
        Err(e) => {
            let _ = a.job.events.send(Event::Error(format!("{e:#}")));
            return Outcome::Finished;
        }
    };
    a.fed.extend_from_slice(&ids);
    if a.next < prompt_len {
        a.next += ids.len();
        if a.next == a.boundary && a.boundary > a.usage.cached_tokens {
            cache.insert(a.fed.clone(), a.seq.fork());
        }
        if a.next < prompt_len {
            // Still reading the prompt; a dropped receiver is noticed when the first token is sent.
            return Outcome::Continue;
        }
    }
    match greedy_id {
        Some(token) => emit_token(a, token, None, stats, cfg),
        None => emit(a, logits, stats, cfg),
    }
}

/// Sample the next token from `logits`, stream it, and decide whether generation goes on.
fn emit(a: &mut Active, mut logits: Vec<f32>, stats: &Stats, cfg: &EngineConfig) -> Outcome {
    // The embedding table is padded past the tokenizer's last id (248,320 rows for 248,077 tokens): those
    // rows are not tokens, so they can never be sampled.
    let tokens = a.tokenizer_vocab;
    if logits.len() > tokens {
        logits[tokens..].fill(f32::NEG_INFINITY);
    }
    // Log-probabilities are those of the model's distribution (before penalties and temperature).
    let lp = a.job.req.logprobs.map(|k| {
        let m = logits.iter().fold(f32::NEG_INFINITY, |x, &y| x.max(y));
        let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f32>().ln();
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let k = k.min(idx.len());
        if k > 0 {
            idx.select_nth_unstable_by(k - 1, |&i, &j| logits[j].total_cmp(&logits[i]));
        }
        idx.truncate(k);
        idx.sort_by(|&i, &j| logits[j].total_cmp(&logits[i]));
        let top: Vec<(u32, f32)> = idx.iter().map(|&i| (i as u32, logits[i] - lse)).collect();
        (logits.clone(), lse, top)
    });
    let token = a.sampler.sample(&mut logits, &a.generated);
    let logprob = lp.map(|(raw, lse, top)| TokenLogprob { token, logprob: raw[token as usize] - lse, top });
    emit_token(a, token, logprob, stats, cfg)
}

/// Stream the chosen `token`, and decide whether generation goes on.
fn emit_token(a: &mut Active, token: u32, logprob: Option<TokenLogprob>, stats: &Stats, cfg: &EngineConfig) -> Outcome {
    a.generated.push(token);
    a.usage.completion_tokens += 1;
    stats.completion_tokens.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    if a.first_token.is_none() {
        a.first_token = Some(now);
        stats.ttft_us.fetch_add((now - a.job.received).as_micros() as u64, Ordering::Relaxed);
        stats.ttft_count.fetch_add(1, Ordering::Relaxed);
        stats.prompt_tokens.fetch_add(a.usage.prompt_tokens as u64, Ordering::Relaxed);
        stats.cached_tokens.fetch_add(a.usage.cached_tokens as u64, Ordering::Relaxed);
    }
    let step = match a.detok.push(token) {
        Ok(s) => s,
        Err(e) => {
            let _ = a.job.events.send(Event::Error(format!("detokenizer: {e}")));
            return Outcome::Finished;
        }
    };
    let mut text = step.text;
    let mut finish = match &step.finish {
        None => None,
        Some(Finish::Length) => Some(FinishReason::Length),
        Some(Finish::StopId(_)) | Some(Finish::StopString(_)) => Some(FinishReason::Stop),
    };
    if finish.is_none() && a.fed.len() + 1 >= cfg.ctx_size {
        finish = Some(FinishReason::Length);
    }
    if finish.is_some() && !matches!(step.finish, Some(Finish::StopString(_))) {
        // Text held back as a possible stop-string prefix is real text after all.
        text.push_str(&a.detok.flush());
    }
    if a.job.events.send(Event::Token { token, text, logprob }).is_err() {
        return Outcome::Finished; // the client went away
    }
    if let Some(finish) = finish {
        if let Some(t0) = a.first_token {
            stats.decode_us.fetch_add((now - t0).as_micros() as u64, Ordering::Relaxed);
        }
        let _ = a.job.events.send(Event::Done { finish, usage: a.usage });
        return Outcome::Finished;
    }
    a.pending = Some(token);
    Outcome::Continue
}

/// Sequence states by the tokens they have read; a new request reuses the longest entry its prompt starts with.
struct PrefixCache {
    entries: Vec<(Vec<u32>, Box<dyn Sequence>)>,
    capacity: usize,
}

impl PrefixCache {
    /// A fork of the longest cached state whose tokens are a proper prefix of `prompt`, and its length.
    fn lookup(&mut self, prompt: &[u32]) -> Option<(Box<dyn Sequence>, usize)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, (ids, _))| !ids.is_empty() && ids.len() < prompt.len() && prompt.starts_with(ids))
            .max_by_key(|(_, (ids, _))| ids.len())
            .map(|(i, _)| i)?;
        let entry = self.entries.remove(best);
        let found = (entry.1.fork(), entry.0.len());
        self.entries.push(entry); // most recently used last
        Some(found)
    }

    fn insert(&mut self, ids: Vec<u32>, seq: Box<dyn Sequence>) {
        if self.capacity == 0 || ids.is_empty() || ids.len() != seq.len() {
            return;
        }
        self.entries.retain(|(k, _)| *k != ids);
        self.entries.push((ids, seq));
        while self.entries.len() > self.capacity {
            self.entries.remove(0);
        }
    }
}
