//! The engine: a queue of generation requests served by one scheduler thread with continuous batching, streaming
//! events back, and a prefix cache of sequence states across requests.
//!
//! # Scheduling
//!
//! Every iteration is one backend step ([`Backend::step`]) over many sequences, within a budget of
//! [`EngineConfig::step_tokens`] tokens:
//!
//! 1. every running decode reads its one token (all of them, round-robin if they alone exceed the budget);
//! 2. the prompts being read, and the waiting requests a free slot could take, share the budget left, a chunk
//!    each (a chunk also ends at the prompt's snapshot point, see below): the fewest tokens left to read first
//!    (a waiting request counts its whole prompt; ties in arrival order), except that the oldest prompt being
//!    read, the head, is kept half the budget (or what it has left), so that it is never starved. A waiting
//!    request is admitted when its turn comes with budget left, and reads its first chunk in the same step; the
//!    oldest waiting request is admitted first when no prompt being read is older (it then is the head).
//!    Admission is by the backend's free state: a sequence reserves room for prompt + `max_tokens`
//!    ([`Backend::alloc`]); when the backend is full, prefix-cache snapshots are evicted to make room, and if
//!    there still is none the request waits for running ones to finish, and no other is admitted in that step
//!    (or it is refused with the backend's reason when nothing is running or it can never fit).
//!    [`EngineConfig::max_concurrent`] is an upper bound on top.
//!
//! So a running stream gets a token in every step, and a long prompt costs it at most one step's budget of
//! prompt tokens per token; a short prompt arriving while a long one is read is read in the next step instead of
//! waiting out the long prompt's whole prefill, and the head still reads at least half of what the decodes leave
//! of every step's budget, so every prompt is read in bounded time.
//!
//! # Cancellation and failures
//!
//! Dropping a request's [`Events`] cancels it: a queued request leaves the queue at once (it stops counting as
//! waiting in the same instant and is never computed), a running one is freed before its next step. An error for
//! one item of a step fails that request only (an `Error` event). A step that panics is caught: alone, its one
//! request fails; batched, its members' states are freed (they may be half-updated) and each member is replayed
//! alone into a fresh sequence — its prompt and reply so far re-read, bit-identical — before it rejoins the batch;
//! a member that panics alone fails. The scheduler goes on either way; [`Engine::is_running`] says whether it has
//! stopped.
//!
//! # Prefix cache
//!
//! Snapshots of sequence states by the tokens they have read, taken at the start of the turn being generated (the
//! last `<|im_start|>` of the prompt: a chat or agent loop resends everything before it; only when that prefix
//! holds [`EngineConfig::snapshot_min_tokens`] uncached tokens, since the prompt is then read in two chunks) and at
//! the end of every finished reply (prompt + reply). A request whose prompt starts with a snapshot's tokens forks it and reads only
//! the rest (`cached_tokens` in its usage). Bounded by [`EngineConfig::prefix_cache_bytes`] of backend state;
//! what saves the least prefill per byte, discounted by how long ago it was last useful, is evicted first.
//!
//! # Constrained decoding
//!
//! A request with a [`Constraint`] draws every token under a mask ([`Sample::mask`]). The masks are computed by
//! [`EngineConfig::constraint_threads`] worker threads, never on the scheduler thread: the first one as soon as
//! the request is admitted (it is ready long before its prompt is read), each next one as soon as the token
//! before it is drawn, handed to the backend as a [`MaskSlot`] the worker fills while the next step's forward
//! pass runs. The backend waits on the slot only when it samples, so only the part of a mask's computation that
//! outlasts the forward pass delays the step ([`Stats::mask_wait_us`]; [`Stats::mask_us`] is the whole). That part
//! holds every stream of the step, so it is bounded: a draw whose mask is not there
//! [`EngineConfig::mask_wait_limit`] after the step reaches it fails, and a request whose masks have held steps
//! [`EngineConfig::mask_stall_budget`] in all ends with an error that says its grammar is too expensive.

//!
//! # Speculative decoding
//!
//! With [`EngineConfig::speculative`] K (and a backend that drafts, [`Backend::max_drafts`]), a request's draws are
//! [`crate::Verify`] items: the prompt's last chunk draws its first token and asks for K drafts; every decode then
//! reads its token and those drafts and draws one row per draft plus one, each with the seed of its place in the
//! reply, so the accepted drafts and the token after them arrive together (greedy: the ids of plain decoding;
//! sampled: the model's distribution). Drafts are cut to the step budget and to what `max_tokens` and the context
//! leave. Under a constraint, the mask worker computes the row after each draft on a copy of the constraint
//! advanced over the drafts before it, and commits the accepted tokens to the real one after the step. A request
//! whose drafts are accepted less than 20% of the time (`SPEC_FLOOR`), or, where the backend has measured what a
//! verify costs ([`Backend::verify_cost`]), whose accepted drafts no longer pay for it, pauses drafting, ever
//! longer. Both rules read only the acceptance, never a clock: the same seed gives the same text every run.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvError, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Result;
use tern_text::{DetokConfig, Detokenizer, Finish, SamplingParams, Tokenizer, IM_START_ID};

use crate::backend::{
    panic_message, AllocError, Backend, Image, MaskResult, MaskSlot, Output, Sample, SeqId, TokenLogprob, Verify, Want,
    Work,
};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Context length: prompt + generated tokens of one sequence.
    pub ctx_size: usize,
    /// At most this many sequences run at once (within it, admission is by the backend's free state); 0 (the
    /// default): the backend's own [`Backend::max_seqs`] (64 on the CPU, 256 on CUDA: one forward pass's sequences).
    pub max_concurrent: usize,
    /// Requests waiting beyond the running ones before `submit` answers `QueueFull`.
    pub max_queue: usize,
    /// Tokens one backend step reads, all sequences together: running decodes first, then prompt chunks (the most
    /// prompt tokens a running stream waits for between two of its tokens); 0 (the default): the backend's own
    /// [`Backend::step_tokens`] (512 on the CPU, the prefill chunk on CUDA).
    pub step_tokens: usize,
    /// Bytes of backend state the prefix cache may keep (0: no cache); 4 GiB (≈ 40 snapshots of the full model
    /// at 1k tokens on the CPU; on CUDA ≈ 37 snapshots of short chats, 109 MB each, fewer for long ones: a
    /// snapshot's shared KV pages count in full).
    pub prefix_cache_bytes: usize,
    /// Threads computing the token masks of constrained requests (beside the steps); half the cores, 1 to 8.
    pub constraint_threads: usize,
    /// The turn-start snapshot is taken only when the prompt before the turn start holds at least this many
    /// tokens beyond what was cached: reading the prompt in two chunks costs a step (on CUDA ~20 ms alone, ~90
    /// ms for 32 prompts at once), more than re-reading a short prefix next time; 256.
    pub snapshot_min_tokens: usize,
    /// The longest a step waits, beyond its forward pass, for one constrained draw's token mask before that draw
    /// fails (every other stream of the step waits with it); 0.5 s.
    pub mask_wait_limit: Duration,
    /// A constrained request fails with a clear error once the steps that waited for its masks have been held this
    /// long in all (by every mask they waited for: several slow grammars together reach it sooner); 1 s.
    pub mask_stall_budget: Duration,
    /// Speculative decoding: drafts per step for every running request (the model's multi-token-prediction block
    /// drafts them, one step verifies them; see the module's `# Speculative decoding`); at most the backend's
    /// [`Backend::max_drafts`] (0 there: off whatever this says). 0 (the default): off.
    pub speculative: usize,
    /// One line on stderr per step: items, tokens, the backend's time, the time applying the results (prefix-cache
    /// snapshots included), running and waiting requests. Off; `TERN_STEP_LOG=1` turns it on.
    pub step_log: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ctx_size: 32768,
            max_concurrent: 0,
            max_queue: 64,
            step_tokens: 0,
            prefix_cache_bytes: 4 << 30,
            constraint_threads: std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 8)),
            snapshot_min_tokens: 256,
            mask_wait_limit: Duration::from_millis(500),
            mask_stall_budget: Duration::from_secs(1),
            speculative: 0,
            step_log: std::env::var("TERN_STEP_LOG").is_ok_and(|v| v == "1"),
        }
    }
}

/// The state machine behind constrained decoding (a grammar, a JSON schema): which tokens may come next.
/// The engine calls it from its constraint workers, one call at a time per request.
pub trait TokenConstraint: Send {
    /// The mask of the next draw: a bitset over the tokenizer's ids in the form [`Sample::mask`] documents, or
    /// `None` when the constraint has ended and the rest of the reply is free.
    fn mask(&mut self) -> Result<Option<Vec<u32>>>;
    /// Advance past `token`, drawn under the last mask.
    fn commit(&mut self, token: u32) -> Result<()>;
    /// An independent copy in the same state (for several choices of one prompt).
    fn box_clone(&self) -> Box<dyn TokenConstraint>;
}

/// tern-text's llguidance constraints (JSON schema, Lark, forced tool calls).
impl TokenConstraint for tern_text::Constrained {
    fn mask(&mut self) -> Result<Option<Vec<u32>>> {
        tern_text::Constrained::mask(self).map_err(anyhow::Error::msg)
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        tern_text::Constrained::commit(self, token).map_err(anyhow::Error::msg)
    }

    fn box_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(self.clone())
    }
}

/// A request's output constraint.
pub struct Constraint(pub Box<dyn TokenConstraint>);

impl Constraint {
    pub fn new(c: impl TokenConstraint + 'static) -> Constraint {
        Constraint(Box::new(c))
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint(self.0.box_clone())
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
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
    /// Draw every token under this constraint's masks (structured output); `None`: free text.
    pub constraint: Option<Constraint>,
    /// vLLM's `min_tokens`: the first this many tokens are drawn with the stop ids kept out (a large negative
    /// bias, so that a constraint allowing nothing else can still end), and no stop string ends them.
    pub min_tokens: usize,
    /// The images of the prompt, in order: image `i` is the `i`-th run of the model's image pad tokens
    /// (`image_token_id`), exactly [`Image::tokens`] of them.
    pub images: Vec<Image>,
}

/// The bias that keeps stop ids out of the first `min_tokens` draws: finite (the samplers refuse infinities),
/// and far below any logit.
const STOP_ID_BIAS: f32 = -1.0e9;

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
        /// The stop string that ended the reply (not part of its text), if one did.
        stop_string: Option<String>,
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
    /// The images do not match the prompt's image pads, or the model reads none.
    BadImages(String),
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
            SubmitError::BadImages(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for SubmitError {}

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets (/metrics; +Inf is the count).
pub const TTFT_BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Counters for /metrics.
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// Sum of time-to-first-token, microseconds, and how many requests it covers; and how many fell at or below
    /// each of [`TTFT_BUCKETS`] (and above the one before: the histogram's non-cumulative counts).
    pub ttft_us: AtomicU64,
    pub ttft_count: AtomicU64,
    pub ttft_buckets: [AtomicU64; TTFT_BUCKETS.len()],
    /// Time spent generating tokens after the first, microseconds.
    pub decode_us: AtomicU64,
    /// Requests queued (a request whose client has gone stops counting at once).
    pub waiting: AtomicUsize,
    /// Requests taken off the queue and not yet ended (counted from the moment they leave it, so that `waiting +
    /// admitted` never misses one: what `submit` checks).
    pub admitted: AtomicUsize,
    /// Sequences in the scheduler's running set after its last step (for /metrics).
    pub active: AtomicUsize,
    /// Backend steps run, the tokens they read (decodes and prompt chunks), the microseconds the backend took for
    /// them, and the microseconds spent between steps applying their results (prefix-cache snapshots included).
    pub steps: AtomicU64,
    pub step_tokens: AtomicU64,
    pub step_us: AtomicU64,
    pub apply_us: AtomicU64,
    /// Snapshots in the prefix cache and the bytes of state they hold.
    pub prefix_cache_entries: AtomicUsize,
    pub prefix_cache_bytes: AtomicUsize,
    /// The backend's sequence state and its bound ([`crate::Backend::state_memory`]) after the last step: bytes
    /// held, the limit (`usize::MAX`: none), and whether the backend reports them at all.
    pub state_memory_bytes: AtomicUsize,
    pub state_memory_limit: AtomicUsize,
    pub state_memory_known: std::sync::atomic::AtomicBool,
    /// Token masks computed for constrained requests, and the microseconds their workers spent on them.
    pub masks: AtomicU64,
    pub mask_us: AtomicU64,
    /// Microseconds backends waited for a mask when sampling: the part of [`Stats::mask_us`] on the steps' path.
    pub mask_wait_us: AtomicU64,
    /// Speculative decoding: verify items run, the drafts they checked, and the drafts accepted.
    pub spec_verifies: AtomicU64,
    pub spec_drafts: AtomicU64,
    pub spec_accepted: AtomicU64,
}

const QUEUED: u8 = 0;
const TAKEN: u8 = 1;
const GONE: u8 = 2;

/// Where a request stands, shared by its [`Events`] (the client) and the scheduler.
struct Ticket {
    state: AtomicU8,
    stats: Arc<Stats>,
}

impl Ticket {
    /// The client is gone: a queued request stops counting as waiting now.
    fn cancel(&self) {
        if self.state.swap(GONE, Ordering::SeqCst) == QUEUED {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// The scheduler takes the request off the queue (`None` if its client has gone): it counts as admitted while
    /// the returned guard lives (the count goes up before `waiting` goes down, so a concurrent `submit` may see one
    /// request too many for an instant, never one too few).
    fn take(&self) -> Option<Admitted> {
        if self.state.load(Ordering::SeqCst) != QUEUED {
            return None;
        }
        self.stats.admitted.fetch_add(1, Ordering::SeqCst);
        if self.state.compare_exchange(QUEUED, TAKEN, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            Some(Admitted(self.stats.clone()))
        } else {
            self.stats.admitted.fetch_sub(1, Ordering::SeqCst);
            None
        }
    }

    fn gone(&self) -> bool {
        self.state.load(Ordering::SeqCst) == GONE
    }
}

/// A request off the queue and not yet ended: counted in [`Stats::admitted`] while this lives.
struct Admitted(Arc<Stats>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The events of one request, in order: tokens, then `Done` or `Error`. Dropping it cancels the request.
pub struct Events {
    rx: Receiver<Event>,
    ticket: Arc<Ticket>,
}

impl Events {
    pub fn recv(&self) -> Result<Event, RecvError> {
        self.rx.recv()
    }

    pub fn try_recv(&self) -> Result<Event, TryRecvError> {
        self.rx.try_recv()
    }

    pub fn recv_timeout(&self, timeout: Duration) -> Result<Event, RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }

    pub fn iter(&self) -> mpsc::Iter<'_, Event> {
        self.rx.iter()
    }
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.ticket.cancel();
    }
}

impl<'a> IntoIterator for &'a Events {
    type Item = Event;
    type IntoIter = mpsc::Iter<'a, Event>;
    fn into_iter(self) -> Self::IntoIter {
        self.rx.iter()
    }
}

/// The events of a request until its last; dropping it cancels the request.
pub struct EventsIter(Events);

impl Iterator for EventsIter {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.0.rx.recv().ok()
    }
}

impl IntoIterator for Events {
    type Item = Event;
    type IntoIter = EventsIter;
    fn into_iter(self) -> EventsIter {
        EventsIter(self)
    }
}

struct Job {
    req: Request,
    events: Sender<Event>,
    ticket: Arc<Ticket>,
    received: Instant,
}

/// Handle to the engine; cheap to clone, shared by every request handler.
#[derive(Clone)]
pub struct Engine {
    jobs: Sender<Job>,
    pub stats: Arc<Stats>,
    pub config: EngineConfig,
    vocab: usize,
    /// The model's image pad id when the backend reads images.
    image_pad: Option<u32>,
    running: Arc<AtomicBool>,
}

/// Clears the engine's running flag when the scheduler thread ends, however it ends.
struct RunningGuard(Arc<AtomicBool>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Engine {
    pub fn start(backend: Arc<dyn Backend>, tokenizer: Arc<Tokenizer>, mut config: EngineConfig) -> Engine {
        if config.max_concurrent == 0 {
            config.max_concurrent = backend.max_seqs().max(1);
        }
        config.speculative = config.speculative.min(backend.max_drafts());
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let vocab = backend.vocab_size();
        let image_pad = backend.image_token_id();
        let running = Arc::new(AtomicBool::new(true));
        let (s, c, guard) = (stats.clone(), config.clone(), RunningGuard(running.clone()));
        std::thread::Builder::new()
            .name("tern-scheduler".into())
            .spawn(move || {
                let _guard = guard;
                let masks = start_mask_workers(c.constraint_threads, &s);
                Scheduler::new(&*backend, &tokenizer, &s, &c, masks).run(rx)
            })
            .expect("cannot start the scheduler thread");
        Engine { jobs: tx, stats, config, vocab, image_pad, running }
    }

    /// Whether the scheduler thread is alive (false once it has ended, for whatever reason).
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// Queue a request; events arrive on the returned [`Events`]. Dropping it cancels the request.
    pub fn submit(&self, req: Request) -> Result<Events, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = req.prompt.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(SubmitError::BadToken { id, vocab: self.vocab });
        }
        if let Err(why) = check_images(&req, self.image_pad) {
            return Err(SubmitError::BadImages(why));
        }
        if req.prompt.len().saturating_add(req.max_tokens) > self.config.ctx_size {
            return Err(SubmitError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                ctx: self.config.ctx_size,
            });
        }
        // Room for max_concurrent running and max_queue waiting (max_queue 0: no waiting room, not no room).
        let waiting = self.stats.waiting.load(Ordering::SeqCst);
        let admitted = self.stats.admitted.load(Ordering::SeqCst);
        if waiting + admitted >= self.config.max_concurrent.max(1) + self.config.max_queue {
            return Err(SubmitError::QueueFull { waiting });
        }
        let (tx, rx) = mpsc::channel();
        let ticket = Arc::new(Ticket { state: AtomicU8::new(QUEUED), stats: self.stats.clone() });
        self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let events = Events { rx, ticket: ticket.clone() };
        if let Err(mpsc::SendError(job)) = self.jobs.send(Job { req, events: tx, ticket, received: Instant::now() }) {
            let _ = job.events.send(Event::Error("the engine has stopped".into()));
            drop(job.ticket.take());
        }
        Ok(events)
    }
}

/// A request being computed.
struct Active<'t> {
    job: Job,
    seq: SeqId,
    /// The prompt, then every generated token: what the sequence must have read before it draws the next token.
    tokens: Vec<u32>,
    /// Tokens of `tokens` the sequence has read.
    fed: usize,
    prompt_len: usize,
    /// Snapshot point: the last `<|im_start|>` of the prompt (the start of the turn being generated).
    boundary: usize,
    /// The prompt's image pad runs, `[start, end)`: a chunk never ends inside one.
    runs: Vec<(usize, usize)>,
    /// Room reserved on the backend: prompt + max_tokens.
    reserve: usize,
    seed: u64,
    detok: Detokenizer<'t>,
    generated: Vec<u32>,
    usage: Usage,
    first_token: Option<Instant>,
    /// In a batched step that panicked: replays alone until it has drawn a token again.
    suspect: bool,
    /// Constrained decoding: the constraint and the slot of the next draw's mask.
    masked: Option<Masked>,
    /// The sampling of the first `min_tokens` draws: the request's, with the stop ids biased out.
    early: Option<SamplingParams>,
    /// Speculative decoding (`None`: off for this request).
    spec: Option<Spec>,
    /// Counts the request in `Stats::admitted` until it ends (the Active is dropped).
    _admitted: Admitted,
}

/// A drawing item of a speculating request: its ids (its token or prompt chunk, then its drafts), the history of
/// its draws (the reply, then the drafts), and the drafts it asks for.
type VerifyItem = (Vec<u32>, Vec<u32>, usize);

/// A request's speculative decoding: the drafts its next step checks, and how well they have done.
struct Spec {
    /// Drafts asked for per step.
    k: usize,
    /// Proposed by the last step (checked by the next one).
    drafts: Vec<u32>,
    /// Drafts accepted per verify, a moving average (1/8 per verify), against [`SPEC_FLOOR`] · k.
    rate: f64,
    /// While drafting is paused (too few accepted): the generated length at which it resumes.
    paused_until: Option<usize>,
    /// Pauses so far: each is twice as long as the one before (up to 16 times [`SPEC_PAUSE_TOKENS`]).
    pauses: u32,
    /// What a verify of `k` drafts costs, in plain steps, where the backend has measured it
    /// ([`Backend::verify_cost`]): drafting pays only while `1 + paid` tokens a verify reach it.
    cost: Option<f64>,
    /// Drafts accepted per verify since drafting started or resumed, a moving average (1/8 per verify) that
    /// starts at the first verify's count (no prior, unlike `rate`).
    paid: f64,
    /// Verifies since drafting started or resumed: the cost is weighed from [`SPEC_SETTLE`] of them on.
    verifies: usize,
}

/// A request stops drafting when fewer than this fraction of its drafts are accepted on average (a verify row costs
/// more than a plain step's share, so drafts that mostly fail make the stream slower), for
/// [`SPEC_PAUSE_TOKENS`] tokens, then tries again; each further pause is twice as long (at most 16 times), so a
/// stream whose drafts never hold spends a vanishing share of its steps trying.
const SPEC_FLOOR: f64 = 0.2;
const SPEC_PAUSE_TOKENS: usize = 64;
/// Verifies before the measured cost is weighed against the acceptance.
const SPEC_SETTLE: usize = 8;

impl Spec {
    fn new(k: usize, cost: Option<f64>) -> Spec {
        Spec {
            k,
            drafts: Vec::new(),
            rate: 0.5 * k as f64,
            paused_until: None,
            pauses: 0,
            cost,
            paid: 0.0,
            verifies: 0,
        }
    }

    /// Drafts to ask the step after `generated` tokens for (0 while paused).
    fn ask(&mut self, generated: usize) -> usize {
        match self.paused_until {
            Some(t) if generated < t => 0,
            Some(_) => {
                (self.paused_until, self.rate, self.verifies) = (None, 0.5 * self.k as f64, 0);
                self.k
            }
            None => self.k,
        }
    }

    /// A verify of `checked` drafts accepted `accepted` of them.
    fn record(&mut self, checked: usize, accepted: usize, generated: usize) {
        if checked == 0 {
            return;
        }
        self.rate += (accepted as f64 - self.rate) / 8.0;
        self.paid = match self.verifies {
            0 => accepted as f64,
            _ => self.paid + (accepted as f64 - self.paid) / 8.0,
        };
        self.verifies += 1;
        let dearer = self.verifies >= SPEC_SETTLE && self.cost.is_some_and(|c| 1.0 + self.paid < c);
        if self.rate < SPEC_FLOOR * self.k as f64 || dearer {
            self.paused_until = Some(generated + (SPEC_PAUSE_TOKENS << self.pauses.min(4)));
            self.pauses += 1;
            self.drafts.clear();
        }
    }
}

/// A constrained request's constraint (shared with the worker computing its next mask) and that mask's slot.
struct Masked {
    constraint: Arc<Mutex<Box<dyn TokenConstraint>>>,
    slot: Arc<MaskSlot>,
    /// With speculative decoding, the masks of the rows after each draft (the constraint advanced over the drafts
    /// before it); a row after a draft its mask forbids is never reached, and its slot holds an error.
    draft_slots: Vec<Arc<MaskSlot>>,
    /// Nanoseconds the steps that waited for this request's masks were held in all, by every mask they waited for
    /// ([`EngineConfig::mask_stall_budget`]).
    stalled_ns: u64,
    /// Set when the request ends (this is dropped): its queued mask jobs are skipped, not computed.
    ended: Arc<AtomicBool>,
}

impl Drop for Masked {
    fn drop(&mut self) {
        self.ended.store(true, Ordering::SeqCst);
    }
}

/// One mask to compute: commit the token drawn (if any), then fill `slot` with the next draw's mask. A job
/// dropped unrun (the workers are gone) fills its slot with an error, so no step waits for it forever.
struct MaskJob {
    constraint: Arc<Mutex<Box<dyn TokenConstraint>>>,
    /// The request has ended: nothing to compute.
    ended: Arc<AtomicBool>,
    commit: Vec<u32>,
    slot: Arc<MaskSlot>,
    /// Drafts, and the slots of the masks after each (on a copy of the constraint advanced over them).
    drafts: Vec<u32>,
    draft_slots: Vec<Arc<MaskSlot>>,
}

impl Drop for MaskJob {
    fn drop(&mut self) {
        for s in std::iter::once(&self.slot).chain(&self.draft_slots) {
            s.fill(Err("no worker computed the mask (the engine is stopping)".into()));
        }
    }
}

impl MaskJob {
    fn run(&self, stats: &Stats) {
        if self.ended.load(Ordering::SeqCst) {
            return; // (dropping the job fills its slots with an error; nobody waits for them)
        }
        let t0 = Instant::now();
        let mut drafted: Option<Box<dyn TokenConstraint>> = None;
        let r: MaskResult = catch_unwind(AssertUnwindSafe(|| {
            let mut c = self.constraint.lock().unwrap_or_else(PoisonError::into_inner);
            for &t in &self.commit {
                c.commit(t).map_err(|e| format!("{e:#}"))?;
            }
            let r = c.mask().map_err(|e| format!("{e:#}"));
            if !self.drafts.is_empty() {
                drafted = Some(c.box_clone());
            }
            r
        }))
        .unwrap_or_else(|p| Err(format!("internal error in the constraint: {}", panic_message(&*p))));
        let mut prev = r.clone();
        self.slot.fill(r);
        // The rows after the drafts, on the copy (the next step draws them only as far as drafts are accepted).
        for (&d, slot) in self.drafts.iter().zip(&self.draft_slots) {
            let next: MaskResult = match (&prev, drafted.as_mut()) {
                (Ok(None), _) => Ok(None), // the constraint has ended: the rest is free
                (Ok(Some(words)), Some(c)) if crate::backend::mask_allows(words, d) => {
                    catch_unwind(AssertUnwindSafe(|| {
                        c.commit(d).map_err(|e| format!("{e:#}"))?;
                        c.mask().map_err(|e| format!("{e:#}"))
                    }))
                    .unwrap_or_else(|p| Err(format!("internal error in the constraint: {}", panic_message(&*p))))
                }
                _ => Err("not reached: the constraint forbids the draft before this row".into()),
            };
            prev = next.clone();
            slot.fill(next);
        }
        stats.mask_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        stats.masks.fetch_add(1 + self.drafts.len() as u64, Ordering::Relaxed);
    }
}

/// Start `n` mask workers (at least one); `None` if none could start (constrained requests then fail).
fn start_mask_workers(n: usize, stats: &Arc<Stats>) -> Option<Sender<MaskJob>> {
    let (tx, rx) = mpsc::channel::<MaskJob>();
    let rx = Arc::new(Mutex::new(rx));
    let mut started = 0;
    for i in 0..n.max(1) {
        let (rx, stats) = (rx.clone(), stats.clone());
        let spawned = std::thread::Builder::new().name(format!("tern-mask-{i}")).spawn(move || loop {
            // The lock is held only while waiting for a job, never while running one.
            let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
            match job {
                Ok(job) => job.run(&stats),
                Err(_) => return, // the scheduler has ended
            }
        });
        started += spawned.is_ok() as usize;
    }
    (started > 0).then_some(tx)
}

impl Active<'_> {
    /// The end of the next chunk this sequence reads, within `budget` tokens (0: nothing fits).
    fn chunk_end(&self, budget: usize) -> usize {
        let mut end = self.tokens.len().min(self.fed + budget);
        if self.fed < self.boundary {
            end = end.min(self.boundary);
        }
        // An image is read whole: back to its start, or past its end when it starts the chunk.
        if let Some(&(s, e)) = self.runs.iter().find(|&&(s, e)| s < end && end < e) {
            end = if s > self.fed { s } else { e };
        }
        end
    }

    fn is_decode(&self) -> bool {
        self.fed >= self.prompt_len
    }
}

/// What became of a request taken off the queue ([`Scheduler::admit`]).
enum Admit {
    /// Running: the last of `active`.
    Admitted,
    /// Its client left, or it got its error.
    Dropped,
    /// No room now: it waits on.
    Wait(Box<Job>),
}

enum Fate {
    Continue,
    /// Finished normally: the state may go to the prefix cache.
    Done,
    /// Failed or cancelled: the state is freed.
    Drop,
}

struct Scheduler<'a> {
    backend: &'a dyn Backend,
    tok: &'a Tokenizer,
    stats: &'a Stats,
    cfg: &'a EngineConfig,
    waiting: VecDeque<Job>,
    active: Vec<Active<'a>>,
    cache: PrefixCache,
    /// Where the round-robin over decodes starts when they alone exceed the budget.
    rotate: usize,
    /// The mask workers' queue (`None`: none could start).
    masks: Option<Sender<MaskJob>>,
    /// Nanoseconds the step being applied waited for masks, all its requests' together.
    step_mask_wait_ns: u64,
}

impl<'a> Scheduler<'a> {
    fn new(
        backend: &'a dyn Backend,
        tok: &'a Tokenizer,
        stats: &'a Stats,
        cfg: &'a EngineConfig,
        masks: Option<Sender<MaskJob>>,
    ) -> Self {
        Scheduler {
            backend,
            tok,
            stats,
            cfg,
            waiting: VecDeque::new(),
            active: Vec::new(),
            cache: PrefixCache::new(cfg.prefix_cache_bytes),
            rotate: 0,
            masks,
            step_mask_wait_ns: 0,
        }
    }

    fn run(mut self, rx: Receiver<Job>) {
        let mut open = true;
        loop {
            // Take new requests (block when there is nothing else to do).
            if self.active.is_empty() && self.waiting.is_empty() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.waiting.retain(|j| !j.ticket.gone());
            self.cancel_gone();
            if let Some(i) = self.active.iter().position(|a| a.suspect) {
                // Replay one suspect of a panicked step alone.
                let end = self.active[i].chunk_end(self.budget());
                self.run_step(vec![(i, end)]);
            }
            let plan = self.plan();
            if !plan.is_empty() {
                self.run_step(plan);
            }
            self.publish();
        }
    }

    fn budget(&self) -> usize {
        match self.cfg.step_tokens {
            0 => self.backend.step_tokens().max(1),
            n => n,
        }
    }

    fn publish(&self) {
        self.stats.active.store(self.active.len(), Ordering::Relaxed);
        self.stats.prefix_cache_entries.store(self.cache.entries.len(), Ordering::Relaxed);
        self.stats.prefix_cache_bytes.store(self.cache.bytes, Ordering::Relaxed);
        if let Some(m) = self.backend.state_memory() {
            self.stats.state_memory_bytes.store(m.used, Ordering::Relaxed);
            self.stats.state_memory_limit.store(m.limit.unwrap_or(usize::MAX), Ordering::Relaxed);
            self.stats.state_memory_known.store(true, Ordering::Relaxed);
        }
    }

    /// Free the sequences of running requests whose client has gone.
    fn cancel_gone(&mut self) {
        let backend = self.backend;
        self.active.retain(|a| {
            let gone = a.job.ticket.gone();
            if gone {
                backend.free(a.seq);
            }
            !gone
        });
    }

    /// This step's items: `(index into active, end of the chunk)`, decodes first, then the chunks of the prompts
    /// being read (newly admitted requests among them) in the order of `active` (see the module's `# Scheduling`).
    fn plan(&mut self) -> Vec<(usize, usize)> {
        let mut left = self.budget();
        let mut plan = Vec::new();
        let decodes: Vec<usize> =
            (0..self.active.len()).filter(|&i| !self.active[i].suspect && self.active[i].is_decode()).collect();
        if !decodes.is_empty() {
            // A decode reads its token and its drafts (fewer drafts when the budget runs short).
            let start = self.rotate % decodes.len();
            for &i in decodes[start..].iter().chain(&decodes[..start]) {
                if left == 0 {
                    break;
                }
                let a = &mut self.active[i];
                if let Some(spec) = &mut a.spec {
                    spec.drafts.truncate(left - 1);
                }
                left -= 1 + a.spec.as_ref().map_or(0, |s| s.drafts.len());
                plan.push((i, a.fed + 1));
            }
            self.rotate = self.rotate.wrapping_add(plan.len());
        }
        if left == 0 {
            return plan;
        }
        // The waiting requests a free slot could take, in arrival order.
        let free = self.cfg.max_concurrent.max(1).saturating_sub(self.active.len());
        let mut queued: Vec<Option<Job>> = Vec::new();
        while queued.len() < free {
            match self.waiting.pop_front() {
                Some(job) if job.ticket.gone() => {} // the client left while it waited
                Some(job) => queued.push(Some(job)),
                None => break,
            }
        }
        // The head, the oldest prompt, is read first among the waiting requests when none being read is older (and
        // when it does not fit, nobody jumps ahead of it into the backend's memory this step).
        let mut blocked = false;
        let oldest_reading = self.reading().map(|i| self.active[i].job.received).min();
        for slot in queued.iter_mut() {
            let Some(job) = slot.take() else { continue };
            if oldest_reading.is_some_and(|t| t <= job.received) {
                *slot = Some(job);
                break;
            }
            match self.admit(job) {
                Admit::Admitted => break,
                Admit::Dropped => {} // the next oldest is the head
                Admit::Wait(job) => {
                    *slot = Some(*job);
                    blocked = true;
                    break;
                }
            }
        }
        let head = self.reading().min_by_key(|&i| (self.active[i].job.received, i));
        // The shortest remaining first, the head within a reserve of half the budget (so it is never starved).
        #[derive(Clone, Copy)]
        enum Who {
            Reading(usize),
            Queued(usize),
        }
        let mut order: Vec<(usize, Instant, Who)> = self
            .reading()
            .map(|i| (self.active[i].prompt_len - self.active[i].fed, self.active[i].job.received, Who::Reading(i)))
            .collect();
        for (q, job) in queued.iter().enumerate() {
            if let Some(job) = job {
                order.push((job.req.prompt.len(), job.received, Who::Queued(q)));
            }
        }
        order.sort_by_key(|&(remaining, received, _)| (remaining, received));
        let mut reserve = head.map_or(0, |h| self.active[h].chunk_end(left.div_ceil(2)) - self.active[h].fed);
        let mut chunks = Vec::new();
        for (_, _, who) in order {
            let i = match who {
                Who::Reading(i) if Some(i) == head => {
                    reserve = 0;
                    i
                }
                Who::Reading(i) => i,
                Who::Queued(q) => {
                    if blocked || left <= reserve {
                        continue;
                    }
                    let Some(job) = queued[q].take() else { continue };
                    match self.admit(job) {
                        Admit::Admitted => self.active.len() - 1,
                        Admit::Dropped => continue,
                        Admit::Wait(job) => {
                            queued[q] = Some(*job);
                            blocked = true;
                            continue;
                        }
                    }
                }
            };
            let a = &self.active[i];
            let end = a.chunk_end(left.saturating_sub(reserve));
            if end > a.fed {
                // (an image read whole may take more than the budget left)
                left = left.saturating_sub(end - a.fed);
                chunks.push((i, end));
            }
        }
        // Those not admitted keep their places at the head of the queue.
        for job in queued.into_iter().rev().flatten() {
            self.waiting.push_front(job);
        }
        chunks.sort_unstable();
        plan.extend(chunks);
        plan
    }

    /// The prompts being read: indices into `active`.
    fn reading(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.active.len()).filter(|&i| !self.active[i].suspect && !self.active[i].is_decode())
    }

    /// Take `job` off the queue into a sequence (see [`Self::place`]); a request that cannot fit now while others
    /// run is handed back to wait, one that can never fit gets its error.
    fn admit(&mut self, job: Job) -> Admit {
        if job.ticket.gone() {
            return Admit::Dropped;
        }
        match self.place(&job.req) {
            Ok((seq, cached)) => {
                let Some(admitted) = job.ticket.take() else {
                    self.backend.free(seq); // it left just now
                    return Admit::Dropped;
                };
                let a = self.activate(job, seq, cached, admitted);
                self.active.push(a);
                Admit::Admitted
            }
            // Room comes back as running requests finish.
            Err(AllocError::Full { .. }) if !self.active.is_empty() => Admit::Wait(Box::new(job)),
            Err(e) => {
                if let Some(_admitted) = job.ticket.take() {
                    let _ = job.events.send(Event::Error(e.to_string()));
                }
                Admit::Dropped
            }
        }
    }

    /// A sequence for `req`, and how many of its prompt tokens it holds: a fork of the longest cached prefix of
    /// the prompt, else a new one; when the backend is full, cache snapshots are evicted until it is not (or
    /// there are none).
    fn place(&mut self, req: &Request) -> Result<(SeqId, usize), AllocError> {
        let reserve = req.prompt.len() + req.max_tokens;
        let runs = self.backend.image_token_id().map_or(Vec::new(), |pad| pad_runs(&req.prompt, pad));
        let key = cache_key(&req.prompt, &runs, &req.images);
        loop {
            let hit = self.cache.lookup(&key);
            let got = match hit {
                Some((src, n)) => self.backend.fork(src, reserve).map(|s| (s, n)),
                None => self.backend.alloc(reserve).map(|s| (s, 0)),
            };
            match got {
                Ok((seq, n)) => {
                    // The images after what the sequence holds.
                    let first = runs.iter().take_while(|r| r.0 < n).count();
                    let rest = req.images.get(first..).unwrap_or_default();
                    if let Err(e) = self.backend.set_images(seq, rest) {
                        self.backend.free(seq);
                        return Err(AllocError::Failed(format!("{e:#}")));
                    }
                    return Ok((seq, n));
                }
                Err(AllocError::Unknown(id)) => self.cache.forget(id),
                Err(AllocError::Full { .. }) if self.cache.evict(self.backend, hit.map(|h| h.0)) => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn activate(&self, mut job: Job, seq: SeqId, cached: usize, admitted: Admitted) -> Active<'a> {
        let masked = job.req.constraint.take().map(|c| {
            let slot = Arc::new(MaskSlot::pending_within(self.cfg.mask_wait_limit));
            let m = Masked {
                constraint: Arc::new(Mutex::new(c.0)),
                slot,
                draft_slots: Vec::new(),
                stalled_ns: 0,
                ended: Arc::new(AtomicBool::new(false)),
            };
            // The first mask, computed while the prompt is read.
            send_mask_job(&self.masks, &m, Vec::new(), Vec::new());
            m
        });
        let prompt = &job.req.prompt;
        let detok = Detokenizer::new(
            self.tok,
            DetokConfig {
                stop_ids: job.req.stop_ids.clone(),
                stop_strings: job.req.stop_strings.clone(),
                max_tokens: Some(job.req.max_tokens),
                min_tokens: job.req.min_tokens,
            },
        );
        let early = (job.req.min_tokens > 0 && !job.req.stop_ids.is_empty()).then(|| {
            let mut s = job.req.sampling.clone();
            for &id in &job.req.stop_ids {
                s.logit_bias.insert(id, STOP_ID_BIAS);
            }
            s
        });
        Active {
            _admitted: admitted,
            seed: job.req.sampling.seed.unwrap_or_else(random_seed),
            usage: Usage { prompt_tokens: prompt.len(), completion_tokens: 0, cached_tokens: cached },
            tokens: prompt.clone(),
            fed: cached,
            prompt_len: prompt.len(),
            boundary: match prompt.iter().rposition(|&t| t == IM_START_ID) {
                Some(b) if b >= cached + self.cfg.snapshot_min_tokens => b,
                _ => 0,
            },
            reserve: prompt.len() + job.req.max_tokens,
            runs: self.backend.image_token_id().map_or(Vec::new(), |pad| pad_runs(prompt, pad)),
            seq,
            detok,
            generated: Vec::new(),
            first_token: None,
            suspect: false,
            masked,
            early,
            spec: (self.cfg.speculative > 0)
                .then(|| Spec::new(self.cfg.speculative, self.backend.verify_cost(self.cfg.speculative))),
            job,
        }
    }

    /// Run one backend step over `plan` and apply its results.
    fn run_step(&mut self, plan: Vec<(usize, usize)>) {
        let limit = self.tok.vocab_size();
        let step_took;
        // Speculative decoding: a drawing item's ids (its token, or prompt chunk, then its drafts), the history of
        // its draws (the reply, then the drafts), and the drafts to ask for.
        let ctx = self.cfg.ctx_size;
        let verify: Vec<Option<VerifyItem>> = plan
            .iter()
            .map(|&(i, end)| {
                let a = &mut self.active[i];
                if end < a.tokens.len() {
                    return None;
                }
                let generated = a.generated.len();
                // Every token a verify may draw fits max_tokens, the context and the reserved room.
                let mut room = a.job.req.max_tokens.saturating_sub(generated + 1).min(ctx.saturating_sub(end));
                if !a.is_decode() {
                    room = 0; // the prompt's last chunk draws one row
                }
                if let Some(m) = &a.masked {
                    room = room.min(m.draft_slots.len());
                }
                let spec = a.spec.as_mut()?;
                let ask = spec.ask(generated);
                spec.drafts.truncate(room);
                let ids = [&a.tokens[a.fed..end], &spec.drafts[..]].concat();
                let history = [&a.generated[..], &spec.drafts[..]].concat();
                Some((ids, history, ask))
            })
            .collect();
        let outcome = {
            let work: Vec<Work> = plan
                .iter()
                .zip(&verify)
                .map(|(&(i, end), verify)| {
                    let a = &self.active[i];
                    let n = a.generated.len();
                    let sample = |j: usize, history| {
                        let params = match &a.early {
                            Some(early) if n + j < a.job.req.min_tokens => early,
                            _ => &a.job.req.sampling,
                        };
                        let mask = a.masked.as_ref().and_then(|m| match j {
                            0 => Some(&*m.slot),
                            _ => m.draft_slots.get(j - 1).map(|s| &**s),
                        });
                        Sample {
                            params,
                            seed: draw_seed(a.seed, n + j),
                            history,
                            top_logprobs: a.job.req.logprobs,
                            limit,
                            mask,
                        }
                    };
                    match verify {
                        Some((ids, history, ask)) => {
                            let rows = ids.len() - (end - a.fed) + 1;
                            let draws = (0..rows).map(|j| sample(j, &history[..n + j])).collect();
                            Work { seq: a.seq, ids, out: Want::Verify(Verify { draws, drafts: *ask }) }
                        }
                        None if end < a.tokens.len() => {
                            Work { seq: a.seq, ids: &a.tokens[a.fed..end], out: Want::Nothing }
                        }
                        None => {
                            Work { seq: a.seq, ids: &a.tokens[a.fed..end], out: Want::Sample(sample(0, &a.generated)) }
                        }
                    }
                })
                .collect();
            let backend = self.backend;
            let t0 = Instant::now();
            let r = catch_unwind(AssertUnwindSafe(|| backend.step(&work)));
            let tokens: usize = work.iter().map(|w| w.ids.len()).sum();
            step_took = (t0.elapsed(), work.len(), tokens);
            r
        };
        let t_apply = Instant::now();
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats.step_tokens.fetch_add(step_took.2 as u64, Ordering::Relaxed);
        self.stats.step_us.fetch_add(step_took.0.as_micros() as u64, Ordering::Relaxed);
        let mut fates: Vec<(usize, Fate)> = Vec::with_capacity(plan.len());
        match outcome {
            Ok(results) if results.len() == plan.len() => {
                // what the step waited for masks, all its requests' together: each request whose mask it waited
                // for is charged all of it (the step, and every stream in it, was held while that mask was pending)
                self.step_mask_wait_ns = plan
                    .iter()
                    .filter_map(|&(i, _)| self.active.get(i).and_then(|a| a.masked.as_ref()))
                    .map(|m| m.slot.waited_ns())
                    .sum();
                for ((&(i, end), r), v) in plan.iter().zip(results).zip(&verify) {
                    let checked = v.as_ref().map_or(0, |(ids, _, _)| ids.len() - (end - self.active[i].fed));
                    fates.push((i, self.apply(i, end, checked, r)));
                }
            }
            Ok(results) => {
                let msg =
                    format!("internal error: the backend returned {} results for {} items", results.len(), plan.len());
                for &(i, _) in &plan {
                    let _ = self.active[i].job.events.send(Event::Error(msg.clone()));
                    fates.push((i, Fate::Drop));
                }
            }
            Err(p) => {
                let msg = panic_message(&*p);
                if let [(i, _)] = plan[..] {
                    let e = format!("internal error while computing this request: {msg}");
                    let _ = self.active[i].job.events.send(Event::Error(e));
                    fates.push((i, Fate::Drop));
                } else {
                    for &(i, _) in &plan {
                        fates.push((i, self.replay(i)));
                    }
                }
            }
        }
        let applied = t_apply.elapsed();
        self.stats.apply_us.fetch_add(applied.as_micros() as u64, Ordering::Relaxed);
        if self.cfg.step_log {
            let (took, items, tokens) = step_took;
            eprintln!(
                "tern step {}: {items} items, {tokens} tokens, backend {:.2} ms, then {:.2} ms applying (snapshots \
                 included); {} running, {} waiting",
                self.stats.steps.load(Ordering::Relaxed),
                took.as_secs_f64() * 1e3,
                applied.as_secs_f64() * 1e3,
                self.active.len(),
                self.waiting.len()
            );
        }
        // Remove the finished, highest index first so the others keep theirs.
        fates.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, fate) in fates {
            match fate {
                Fate::Continue => {}
                Fate::Done => {
                    // (A reply that ended inside a verify's accepted drafts holds more than its tokens: the
                    // cache's length check then frees it.)
                    let a = self.active.remove(i);
                    let key = cache_key(&a.tokens[..a.fed.min(a.tokens.len())], &a.runs, &a.job.req.images);
                    self.cache.insert(self.backend, key, a.seq);
                }
                Fate::Drop => {
                    let a = self.active.remove(i);
                    self.backend.free(a.seq);
                }
            }
        }
    }

    /// After a batched step panicked: a fresh sequence for `active[i]`, to re-read everything alone.
    fn replay(&mut self, i: usize) -> Fate {
        let a = &mut self.active[i];
        self.backend.free(a.seq);
        match self.backend.alloc(a.reserve) {
            Ok(seq) => {
                if let Err(e) = self.backend.set_images(seq, &a.job.req.images) {
                    self.backend.free(seq);
                    let _ = a.job.events.send(Event::Error(format!("internal error, and cannot retry: {e:#}")));
                    return Fate::Drop;
                }
                (a.seq, a.fed, a.suspect) = (seq, 0, true);
                if let Some(spec) = &mut a.spec {
                    spec.drafts.clear();
                }
                Fate::Continue
            }
            Err(e) => {
                let _ = a.job.events.send(Event::Error(format!("internal error, and no room to retry: {e}")));
                Fate::Drop // (freeing the old id again is a no-op)
            }
        }
    }

    /// Apply one item's result: `active[i]` read its tokens up to `end`, and `checked` drafts after them.
    fn apply(&mut self, i: usize, end: usize, checked: usize, r: Result<Output>) -> Fate {
        let a = &mut self.active[i];
        let out = match r {
            Ok(o) => o,
            Err(e) => {
                let _ = a.job.events.send(Event::Error(format!("{e:#}")));
                return Fate::Drop;
            }
        };
        a.fed = end;
        if a.fed == a.boundary && a.boundary > a.usage.cached_tokens && self.cache.capacity > 0 {
            if let Ok(snap) = self.backend.fork(a.seq, a.fed) {
                self.cache.insert(self.backend, cache_key(&a.tokens[..a.fed], &a.runs, &a.job.req.images), snap);
            }
        }
        let (drawn, drafts) = match out {
            Output::Nothing if end < a.tokens.len() => return Fate::Continue,
            Output::Token(s) if end == a.tokens.len() => (vec![s], None),
            Output::Drafted { tokens, drafts }
                if end == a.tokens.len() && (1..=checked + 1).contains(&tokens.len()) =>
            {
                (tokens, Some(drafts))
            }
            other => {
                let _ = a.job.events.send(Event::Error(format!("internal error: the backend returned {other:?}")));
                return Fate::Drop;
            }
        };
        a.suspect = false;
        // The sequence holds the accepted drafts too.
        a.fed = end + drawn.len() - 1;
        let mut fate = Fate::Continue;
        for s in &drawn {
            fate = emit_token(a, s.token, s.logprob.clone(), self.stats, self.cfg);
            if !matches!(fate, Fate::Continue) {
                break;
            }
        }
        if let (Some(spec), Some(drafts)) = (&mut a.spec, drafts) {
            if checked > 0 {
                let accepted = drawn.len() - 1;
                self.stats.spec_verifies.fetch_add(1, Ordering::Relaxed);
                self.stats.spec_drafts.fetch_add(checked as u64, Ordering::Relaxed);
                self.stats.spec_accepted.fetch_add(accepted as u64, Ordering::Relaxed);
                spec.record(checked, accepted, a.generated.len());
            }
            spec.drafts = if spec.paused_until.is_some() { Vec::new() } else { drafts };
        }
        let Some(m) = &mut a.masked else { return fate };
        let slots: Vec<&Arc<MaskSlot>> = std::iter::once(&m.slot).chain(&m.draft_slots).collect();
        let waited: u64 = slots.iter().map(|s| s.waited_ns()).sum();
        self.stats.mask_wait_us.fetch_add(waited / 1000, Ordering::Relaxed);
        if waited > 0 {
            m.stalled_ns += self.step_mask_wait_ns.max(waited);
        }
        if m.stalled_ns > self.cfg.mask_stall_budget.as_nanos() as u64 && matches!(fate, Fate::Continue) {
            // Its masks have held the steps, and every stream in them, for too long: it ends here.
            let msg = format!(
                "the output constraint failed: its token masks held the server's steps for {:.1} s in all (over the \
                 {:.1} s a request may): the grammar or schema is too expensive to enforce",
                m.stalled_ns as f64 / 1e9,
                self.cfg.mask_stall_budget.as_secs_f64()
            );
            let _ = a.job.events.send(Event::Error(msg));
            return Fate::Drop;
        }
        // The mask the last token was drawn under.
        if matches!(slots.get(drawn.len() - 1).and_then(|s| s.peek()), Some(Ok(None))) {
            a.masked = None; // the constraint has ended: the rest is free
        } else if matches!(fate, Fate::Continue) {
            // The next masks, computed while the next step's forward pass runs.
            let drafts = a.spec.as_ref().map_or(Vec::new(), |s| s.drafts.clone());
            m.slot = Arc::new(MaskSlot::pending_within(self.cfg.mask_wait_limit));
            m.draft_slots =
                drafts.iter().map(|_| Arc::new(MaskSlot::pending_within(self.cfg.mask_wait_limit))).collect();
            send_mask_job(&self.masks, m, drawn.iter().map(|s| s.token).collect(), drafts);
        }
        fate
    }
}

/// Queue the computation of `m`'s next masks (after committing `commit`): its slot's, and its draft slots' after
/// each of `drafts`; without workers the slots get an error.
fn send_mask_job(workers: &Option<Sender<MaskJob>>, m: &Masked, commit: Vec<u32>, drafts: Vec<u32>) {
    let job = MaskJob {
        constraint: m.constraint.clone(),
        ended: m.ended.clone(),
        commit,
        slot: m.slot.clone(),
        drafts,
        draft_slots: m.draft_slots.clone(),
    };
    match workers {
        // A failed send drops the job, which fills the slots with an error.
        Some(tx) => drop(tx.send(job)),
        None => {
            m.slot.fill(Err("no constraint worker thread could be started".into()));
            drop(job);
        }
    }
}

/// Stream the chosen `token`, and decide whether generation goes on.
fn emit_token(a: &mut Active, token: u32, logprob: Option<TokenLogprob>, stats: &Stats, cfg: &EngineConfig) -> Fate {
    a.generated.push(token);
    a.tokens.push(token);
    a.usage.completion_tokens += 1;
    stats.completion_tokens.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    if a.first_token.is_none() {
        a.first_token = Some(now);
        let ttft = now - a.job.received;
        stats.ttft_us.fetch_add(ttft.as_micros() as u64, Ordering::Relaxed);
        stats.ttft_count.fetch_add(1, Ordering::Relaxed);
        if let Some(b) = TTFT_BUCKETS.iter().position(|&b| ttft.as_secs_f64() <= b) {
            stats.ttft_buckets[b].fetch_add(1, Ordering::Relaxed);
        }
        stats.prompt_tokens.fetch_add(a.usage.prompt_tokens as u64, Ordering::Relaxed);
        stats.cached_tokens.fetch_add(a.usage.cached_tokens as u64, Ordering::Relaxed);
    }
    let step = match a.detok.push(token) {
        Ok(s) => s,
        Err(e) => {
            let _ = a.job.events.send(Event::Error(format!("detokenizer: {e}")));
            return Fate::Drop;
        }
    };
    let mut text = step.text;
    let mut finish = match &step.finish {
        None => None,
        Some(Finish::Length) => Some(FinishReason::Length),
        Some(Finish::StopId(_)) | Some(Finish::StopString(_)) => Some(FinishReason::Stop),
    };
    if finish.is_none() && a.tokens.len() >= cfg.ctx_size {
        finish = Some(FinishReason::Length);
    }
    if finish.is_some() && !matches!(step.finish, Some(Finish::StopString(_))) {
        // Text held back as a possible stop-string prefix is real text after all.
        text.push_str(&a.detok.flush());
    }
    if a.job.events.send(Event::Token { token, text, logprob }).is_err() {
        return Fate::Drop; // the client went away
    }
    let Some(finish) = finish else { return Fate::Continue };
    if let Some(t0) = a.first_token {
        stats.decode_us.fetch_add((now - t0).as_micros() as u64, Ordering::Relaxed);
    }
    let stop_string = match step.finish {
        Some(Finish::StopString(s)) => Some(s),
        _ => None,
    };
    let _ = a.job.events.send(Event::Done { finish, usage: a.usage, stop_string });
    Fate::Done
}

/// The runs `[start, end)` of `pad` in `ids`.
fn pad_runs(ids: &[u32], pad: u32) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut t = 0;
    while t < ids.len() {
        if ids[t] == pad {
            let len = ids[t..].iter().take_while(|&&i| i == pad).count();
            runs.push((t, t + len));
            t += len;
        } else {
            t += 1;
        }
    }
    runs
}

/// A request's images against its prompt: one run of image pads per image, of the image's tokens.
fn check_images(req: &Request, pad: Option<u32>) -> Result<(), String> {
    if req.images.is_empty() {
        return Ok(());
    }
    let Some(pad) = pad else {
        return Err("this model reads no images: its checkpoint has no vision tower, or its backend none yet".into());
    };
    let runs = pad_runs(&req.prompt, pad);
    if runs.len() != req.images.len() {
        return Err(format!("{} images, but {} runs of image pads in the prompt", req.images.len(), runs.len()));
    }
    for (k, (&(s, e), im)) in runs.iter().zip(&req.images).enumerate() {
        if e - s != im.tokens {
            return Err(format!("image {k}: {} image pads in the prompt for an image of {} tokens", e - s, im.tokens));
        }
    }
    Ok(())
}

/// The prefix cache's key of `tokens`: their ids, each image pad run standing for its image (a value from its
/// hash, with the top bit set: no token id), so that a snapshot after one image never serves a prompt with another.
fn cache_key(tokens: &[u32], runs: &[(usize, usize)], images: &[Image]) -> Vec<u64> {
    let mut key: Vec<u64> = tokens.iter().map(|&t| u64::from(t)).collect();
    for (&(s, e), im) in runs.iter().zip(images) {
        for k in key.iter_mut().take(e).skip(s) {
            *k = (1 << 63) | (im.hash >> 1);
        }
    }
    key
}

/// The seed of draw `n` of a request seeded `seed` (splitmix64 of the pair).
fn draw_seed(seed: u64, n: usize) -> u64 {
    let mut z = seed ^ (n as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// Snapshots of sequence states (backend sequences the cache owns) by the tokens they have read.
struct PrefixCache {
    entries: Vec<Entry>,
    /// Bytes of backend state the entries may hold, and hold.
    capacity: usize,
    bytes: usize,
    /// Counts lookups that hit and inserts: the clock of `Entry::used`.
    clock: u64,
}

struct Entry {
    /// The tokens it has read ([`cache_key`]).
    ids: Vec<u64>,
    seq: SeqId,
    bytes: usize,
    /// `clock` when it was inserted or last hit.
    used: u64,
}

impl PrefixCache {
    fn new(capacity: usize) -> PrefixCache {
        PrefixCache { entries: Vec::new(), capacity, bytes: 0, clock: 0 }
    }

    /// The longest snapshot whose tokens are a proper prefix of `prompt` (its sequence and length; fork it).
    fn lookup(&mut self, prompt: &[u64]) -> Option<(SeqId, usize)> {
        let e = self
            .entries
            .iter_mut()
            .filter(|e| !e.ids.is_empty() && e.ids.len() < prompt.len() && prompt.starts_with(&e.ids))
            .max_by_key(|e| e.ids.len())?;
        self.clock += 1;
        e.used = self.clock;
        Some((e.seq, e.ids.len()))
    }

    /// Keep `seq` (which has read `ids`) as a snapshot, evicting others to stay within the byte bound; the cache
    /// owns it from now on (frees it when evicted or when it does not fit).
    fn insert(&mut self, backend: &dyn Backend, ids: Vec<u64>, seq: SeqId) {
        let bytes = backend.state_bytes(seq);
        if ids.is_empty() || bytes > self.capacity || backend.len(seq) != Some(ids.len()) {
            backend.free(seq);
            return;
        }
        if let Some(i) = self.entries.iter().position(|e| e.ids == ids) {
            let old = self.entries.swap_remove(i);
            self.bytes -= old.bytes;
            backend.free(old.seq);
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(Entry { ids, seq, bytes, used: self.clock });
        while self.bytes > self.capacity && self.evict(backend, Some(seq)) {}
    }

    /// Evict the entry worth least: prefill tokens saved per byte, divided by how many cache events ago it was
    /// last useful (plus one). `keep` goes last. False if the cache is empty.
    fn evict(&mut self, backend: &dyn Backend, keep: Option<SeqId>) -> bool {
        let clock = self.clock;
        let worth = |e: &Entry| e.ids.len() as f64 / e.bytes.max(1) as f64 / (1 + clock - e.used.min(clock)) as f64;
        let Some(i) = (0..self.entries.len()).min_by(|&i, &j| {
            let (a, b) = (&self.entries[i], &self.entries[j]);
            (Some(a.seq) == keep).cmp(&(Some(b.seq) == keep)).then(worth(a).total_cmp(&worth(b)))
        }) else {
            return false;
        };
        let e = self.entries.swap_remove(i);
        self.bytes -= e.bytes;
        backend.free(e.seq);
        true
    }

    /// Drop the entry of a sequence the backend no longer has.
    fn forget(&mut self, seq: SeqId) {
        if let Some(i) = self.entries.iter().position(|e| e.seq == seq) {
            let e = self.entries.swap_remove(i);
            self.bytes -= e.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScriptedBackend;

    fn seq_of(b: &dyn Backend, ids: &[u32]) -> SeqId {
        let s = b.alloc(ids.len()).unwrap();
        let r = b.step(&[Work { seq: s, ids, out: Want::Nothing }]);
        assert!(matches!(r[..], [Ok(Output::Nothing)]));
        s
    }

    /// The byte bound holds after every insert; what saves least per byte goes first; a hit keeps an entry.
    #[test]
    fn prefix_cache_evicts_least_prefill_per_byte_within_its_bound() {
        let b = ScriptedBackend::new(100, vec![1]);
        // Scripted state bytes: 64 + 4 per token. Room for about 3 entries of ~10 tokens.
        let key = |ids: &[u32]| cache_key(ids, &[], &[]);
        let mut c = PrefixCache::new(3 * (64 + 40) + 10);
        let long: Vec<u32> = (0..12).collect();
        let s = seq_of(&b, &long);
        c.insert(&b, key(&long), s);
        for k in 0..3u32 {
            let ids: Vec<u32> = (0..4).map(|i| 50 + 10 * k + i).collect();
            let s = seq_of(&b, &ids);
            c.insert(&b, key(&ids), s);
            assert!(c.bytes <= c.capacity, "{} > {}", c.bytes, c.capacity);
        }
        // Four entries did not fit: the oldest short one (fewest tokens per byte, least recent) went first.
        assert_eq!(c.entries.len(), 3);
        assert!(c.entries.iter().any(|e| e.ids == key(&long)), "the long entry saves the most per byte");
        assert!(c.entries.iter().all(|e| e.ids[0] != 50), "the oldest short entry is evicted first");
        assert_eq!(c.lookup(&[50, 51, 52, 53, 54]), None);
        let hit: Vec<u32> = [&long[..], &[99]].concat();
        assert_eq!(c.lookup(&key(&hit)).map(|h| h.1), Some(12));
        // Freed sequences are gone from the backend.
        assert_eq!(b.len(SeqId(2)), None);
        // An entry bigger than the bound is refused (and freed).
        let big: Vec<u32> = (0..100).collect();
        let s = seq_of(&b, &big);
        c.insert(&b, key(&big), s);
        assert!(c.bytes <= c.capacity && b.len(s).is_none());
    }

    /// Drafting pauses when drafts fail (after 7 verifies from the start), for 64 tokens, then 128, 256, ... 1,024;
    /// drafts that hold keep it on.
    #[test]
    fn drafting_pauses_ever_longer_while_drafts_fail() {
        let mut s = Spec::new(3, None);
        let mut generated = 0;
        let mut verifies = Vec::new();
        for pause in 0..6 {
            let mut n = 0;
            while s.ask(generated) > 0 {
                s.record(3, 0, generated);
                n += 1;
                if s.paused_until.is_some() {
                    break;
                }
                generated += 1;
            }
            verifies.push(n);
            let until = s.paused_until.unwrap();
            assert_eq!(until - generated, 64 << pause.min(4), "pause {pause}");
            assert_eq!(s.ask(until - 1), 0);
            generated = until;
        }
        assert_eq!(verifies, [7, 7, 7, 7, 7, 7]);
        let mut good = Spec::new(3, None);
        for g in 0..1000 {
            assert_eq!(good.ask(g), 3);
            good.record(3, 1, g); // one of three accepted: a third, over the floor
        }
    }

    /// Where the backend measured a verify's cost (in plain steps), drafting pauses once its accepted tokens no
    /// longer pay for it, after [`SPEC_SETTLE`] verifies: stop 44's H100 costs (K = 3: 3.0 plain steps; K = 1:
    /// 2.16) keep K = 3 at full acceptance on, and pause K = 3 at 1.5 accepted a verify and K = 1 at any.
    #[test]
    fn drafting_pauses_where_the_measured_verify_cost_is_not_paid() {
        // (k, cost, accepted per verify, pauses?)
        for (k, cost, accepted, pauses) in
            [(3, 3.0, 3, false), (3, 3.0, 2, false), (4, 3.52, 4, false), (3, 3.0, 1, true), (1, 2.16, 1, true)]
        {
            let mut s = Spec::new(k, Some(cost));
            let mut paused_at = None;
            for g in 0..200 {
                if s.ask(g) == 0 {
                    paused_at = Some(g);
                    break;
                }
                s.record(k, accepted, g);
            }
            assert_eq!(paused_at.is_some(), pauses, "k {k} cost {cost} accepted {accepted}: paused at {paused_at:?}");
            if let Some(g) = paused_at {
                assert_eq!(g, SPEC_SETTLE, "k {k}: pauses after {SPEC_SETTLE} verifies, not {g}");
            }
        }
        // Unmeasured (None), the same acceptance keeps drafting: only the floor applies.
        let mut s = Spec::new(1, None);
        for g in 0..200 {
            assert_eq!(s.ask(g), 1);
            s.record(1, 1, g);
        }
    }

    /// Image pad runs stand for their image in the prefix cache's keys: the same image gives the same key, another
    /// image (another hash) a key that shares only what comes before it; chunks never end inside a run.
    #[test]
    fn cache_keys_tell_images_apart_and_chunks_keep_images_whole() {
        let im = |hash: u64| Image {
            pixels: Arc::new(tern_model::vision::Pixels { values: vec![0.5; 4], grid: [1, 2, 2] }),
            hash,
            tokens: 3,
        };
        let prompt = [1u32, 2, 9, 9, 9, 3, 4];
        let runs = pad_runs(&prompt, 9);
        assert_eq!(runs, [(2, 5)]);
        let (a, b) = (cache_key(&prompt, &runs, &[im(7)]), cache_key(&prompt, &runs, &[im(8)]));
        assert_eq!(a, cache_key(&prompt, &runs, &[im(7)]));
        assert_eq!(a[..2], b[..2]);
        assert!(a[2..5] != b[2..5] && a[5..] == b[5..] && a[2] >> 63 == 1);
        let mut c = PrefixCache::new(1 << 20);
        let be = ScriptedBackend::new(100, vec![1]);
        let s = seq_of(&be, &prompt[..5]);
        c.insert(&be, a[..5].to_vec(), s);
        assert_eq!(c.lookup(&a).map(|h| h.1), Some(5), "the same image hits");
        assert_eq!(c.lookup(&b), None, "another image does not");
        let req = Request { prompt: prompt.to_vec(), images: vec![im(7)], ..common_request() };
        assert!(check_images(&req, Some(9)).is_ok());
        assert!(check_images(&req, None).unwrap_err().contains("reads no images"));
        let two = Request { images: vec![im(7), im(8)], ..req.clone() };
        assert!(check_images(&two, Some(9)).unwrap_err().contains("2 images, but 1 runs"));
        let short = Request { prompt: vec![1, 9, 9, 2], ..req };
        assert!(check_images(&short, Some(9)).unwrap_err().contains("2 image pads in the prompt for an image of 3"));
    }

    fn common_request() -> Request {
        Request {
            prompt: vec![1],
            sampling: SamplingParams::default(),
            max_tokens: 1,
            stop_strings: vec![],
            stop_ids: vec![],
            logprobs: None,
            constraint: None,
            min_tokens: 0,
            images: vec![],
        }
    }

    /// A mask job of a request that has ended is skipped (its slots get an error), one of a live request computed;
    /// draft slots get the masks after each draft, and rows after a forbidden draft an error.
    #[test]
    fn mask_jobs_skip_ended_requests_and_fill_draft_rows() {
        #[derive(Clone)]
        struct Even(Arc<AtomicUsize>);
        impl TokenConstraint for Even {
            fn mask(&mut self) -> Result<Option<Vec<u32>>> {
                self.0.fetch_add(1, Ordering::SeqCst);
                Ok(Some(vec![0x5555_5555; 2])) // the even ids below 64
            }
            fn commit(&mut self, _: u32) -> Result<()> {
                Ok(())
            }
            fn box_clone(&self) -> Box<dyn TokenConstraint> {
                Box::new(self.clone())
            }
        }
        let calls = Arc::new(AtomicUsize::new(0));
        let job = |ended: bool, drafts: Vec<u32>| MaskJob {
            constraint: Arc::new(Mutex::new(Box::new(Even(calls.clone())) as Box<dyn TokenConstraint>)),
            ended: Arc::new(AtomicBool::new(ended)),
            commit: vec![2],
            slot: Arc::new(MaskSlot::pending()),
            draft_slots: drafts.iter().map(|_| Arc::new(MaskSlot::pending())).collect(),
            drafts,
        };
        let stats = Stats::default();
        let ended = job(true, vec![4]);
        ended.run(&stats);
        let slots = (ended.slot.clone(), ended.draft_slots.clone());
        drop(ended);
        assert_eq!(calls.load(Ordering::SeqCst), 0, "an ended request's mask was computed");
        assert!(slots.0.wait().is_err() && slots.1[0].wait().is_err());
        let live = job(false, vec![4, 7, 8]);
        live.run(&stats);
        assert_eq!(calls.load(Ordering::SeqCst), 2, "the row's mask and the one after the allowed draft 4");
        assert_eq!(live.slot.wait().unwrap(), Some(&[0x5555_5555u32, 0x5555_5555][..]));
        assert!(live.draft_slots[0].wait().unwrap().is_some(), "the row after the allowed draft 4");
        assert!(live.draft_slots[1].wait().is_err(), "7 is forbidden: the row after it is never reached");
        assert!(live.draft_slots[2].wait().is_err(), "nor the one after that");
    }

    #[test]
    fn draw_seeds_differ_per_draw_and_request() {
        let mut seen = std::collections::HashSet::new();
        for seed in 0..50 {
            for n in 0..50 {
                assert!(seen.insert(draw_seed(seed, n)));
            }
        }
    }
}
