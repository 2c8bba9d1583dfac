//! Grammar and schema compiles, off the request-preparation pool: a few threads of their own, each with
//! [`COMPILE_STACK_BYTES`] of stack (llguidance's compile recurses along rule and `$ref` chains; a 22 KB request
//! overflowed a 2 MiB blocking thread and aborted the process), fed by a queue that `--max-queue` counts.
//!
//! * Limits first: request preparation checks every grammar, schema and tool set against tern-text's `Limits`
//!   (cheap, linear) and writes its grammar ([`tern_text::Grammars::prepare`]); only what passes is queued here.
//! * A compile that waits counts as a waiting request: past `--max-concurrent` + `--max-queue` (running, queued
//!   and compiling together) a request gets 503 `queue_full`, as the engine's queue answers.
//! * Each request waits at most [`COMPILE_BUDGET`] for its compile: still queued then, 503 (retry); running, 400
//!   `grammar_too_complex` naming the field. A client that leaves takes its compile off the queue; one already
//!   running finishes and its result only goes to the cache: llguidance cannot stop a compile (its cancellation
//!   covers masks only), so the `Limits` are set so that every compile they accept ends well within the budget
//!   (the slowest found: 1.2 s).
//! * Compiled grammars are cached by their text ([`tern_text::constraint::Prepared::key`]; the whole key is
//!   compared, not only its hash), [`CACHE_ENTRIES`] of them and [`CACHE_KEY_BYTES`] of keys at most, least
//!   recently used out first: an agent loop that sends the same tools with every turn compiles them once. Each
//!   request gets its own copy (its own lexer state).

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use tern_engine::Constraint;
use tern_text::constraint::{Compiled, Prepared, COMPILE_STACK_BYTES};
use tern_text::{GrammarError, Grammars, Reply};
use tokio::sync::oneshot;

use crate::api::{self, ApiError, Job};
use crate::Ready;

/// Compile threads (one slow compile leaves another for everyone else).
pub(crate) const COMPILE_THREADS: usize = 2;
/// The longest a request waits for its compile, queue included.
pub(crate) const COMPILE_BUDGET: Duration = Duration::from_secs(5);
/// Compiled grammars kept, and the bytes of their keys (grammar texts) at most.
pub(crate) const CACHE_ENTRIES: usize = 64;
pub(crate) const CACHE_KEY_BYTES: usize = 16 << 20;

/// A request's constraint, checked and written out, to compile before the request is submitted.
pub(crate) struct PendingConstraint {
    pub prepared: Prepared,
    pub reply: Reply,
    /// The request field it comes from (errors name it).
    pub param: &'static str,
}

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const CANCELLED: u8 = 2;

struct Task {
    prepared: Prepared,
    state: AtomicU8,
    done: Mutex<Option<oneshot::Sender<Result<Compiled, GrammarError>>>>,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<VecDeque<Arc<Task>>>,
    wake: Condvar,
    /// Tasks queued (cancelled ones leave the count at once) and being compiled.
    waiting: AtomicUsize,
    running: AtomicUsize,
    cache: Mutex<Cache>,
    compiles: AtomicU64,
    compile_us: AtomicU64,
    cache_hits: AtomicU64,
    refused_budget: AtomicU64,
    /// The compiler is gone: its threads end.
    closed: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The compile pool of one model.
pub(crate) struct Compiler {
    grammars: Arc<Grammars>,
    shared: Arc<Shared>,
    threads: usize,
}

impl Compiler {
    /// Start [`COMPILE_THREADS`] threads (fewer if some cannot start).
    pub fn start(grammars: Arc<Grammars>) -> Compiler {
        let shared = Arc::new(Shared::default());
        let mut threads = 0;
        for i in 0..COMPILE_THREADS {
            let (g, s) = (grammars.clone(), shared.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("tern-grammar-{i}"))
                .stack_size(COMPILE_STACK_BYTES)
                .spawn(move || worker(&g, &s));
            match spawned {
                Ok(_) => threads += 1,
                Err(e) => eprintln!("tern: cannot start a grammar compile thread: {e}"),
            }
        }
        Compiler { grammars, shared, threads }
    }

    /// Compile `p` (from the cache if it is there) within the budget and admission rules.
    async fn compile(&self, ready: &Ready, p: &PendingConstraint) -> Result<Compiled, ApiError> {
        if !p.prepared.has_grammar() {
            return self.grammars.build(&p.prepared).map_err(|e| client_error(e, p.param));
        }
        if let Some(c) = lock(&self.shared.cache).get(p.prepared.key()) {
            self.shared.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(c);
        }
        if self.threads == 0 {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "constraints_unavailable",
                "constrained decoding is unavailable on this server (no compile thread could start)",
            ));
        }
        // Admission: a compile waiting is a request waiting.
        let (stats, cfg) = (&ready.engine.stats, &ready.engine.config);
        let compiling = self.shared.waiting.load(Ordering::SeqCst) + self.shared.running.load(Ordering::SeqCst);
        let engine = stats.waiting.load(Ordering::SeqCst) + stats.admitted.load(Ordering::SeqCst);
        if engine + compiling >= cfg.max_concurrent.max(1) + cfg.max_queue {
            let waiting = stats.waiting.load(Ordering::SeqCst) + compiling;
            return Err(api::submit_error(tern_engine::SubmitError::QueueFull { waiting }, cfg, "messages"));
        }
        let (tx, rx) = oneshot::channel();
        let task =
            Arc::new(Task { prepared: p.prepared.clone(), state: AtomicU8::new(QUEUED), done: Mutex::new(Some(tx)) });
        let ticket = Ticket { task: task.clone(), shared: self.shared.clone() };
        self.shared.waiting.fetch_add(1, Ordering::SeqCst);
        lock(&self.shared.queue).push_back(task);
        self.shared.wake.notify_one();
        match tokio::time::timeout(COMPILE_BUDGET, rx).await {
            Ok(Ok(r)) => r.map_err(|e| client_error(e, p.param)),
            Ok(Err(_)) => Err(ApiError::internal("the grammar compile thread ended")),
            Err(_) if ticket.cancel() => Err(ApiError::unavailable(
                "server_busy",
                format!(
                    "the server is busy compiling other requests' grammars: this one waited {}s for its turn; \
                     retry later",
                    COMPILE_BUDGET.as_secs()
                ),
                1,
            )),
            Err(_) => {
                self.shared.refused_budget.fetch_add(1, Ordering::Relaxed);
                Err(ApiError {
                    code: Some("grammar_too_complex"),
                    ..ApiError::invalid(
                        p.param,
                        format!(
                            "compiling this grammar took longer than {}s (the limit); simplify it",
                            COMPILE_BUDGET.as_secs()
                        ),
                    )
                })
            }
        }
    }

    /// Compiles queued and running, for /health and /metrics.
    pub fn load(&self) -> (usize, usize) {
        (self.shared.waiting.load(Ordering::Relaxed), self.shared.running.load(Ordering::Relaxed))
    }

    /// Prometheus lines (name, type, help, value).
    pub fn metrics(&self) -> Vec<(&'static str, &'static str, &'static str, f64)> {
        let s = &self.shared;
        let (waiting, running) = self.load();
        let entries = lock(&s.cache).map.len();
        vec![
            ("grammar_compiles_waiting", "gauge", "grammar compiles queued", waiting as f64),
            ("grammar_compiles_running", "gauge", "grammar compiles running", running as f64),
            ("grammar_compiles_total", "counter", "grammars compiled", s.compiles.load(Ordering::Relaxed) as f64),
            (
                "grammar_compile_seconds_total",
                "counter",
                "time spent compiling grammars",
                s.compile_us.load(Ordering::Relaxed) as f64 / 1e6,
            ),
            (
                "grammar_cache_hits_total",
                "counter",
                "compiles saved by the cache",
                s.cache_hits.load(Ordering::Relaxed) as f64,
            ),
            ("grammar_cache_entries", "gauge", "compiled grammars cached", entries as f64),
            (
                "grammar_compile_over_budget_total",
                "counter",
                "requests refused because their compile outlasted the budget",
                s.refused_budget.load(Ordering::Relaxed) as f64,
            ),
        ]
    }
}

impl Drop for Compiler {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        let _queue = lock(&self.shared.queue);
        self.shared.wake.notify_all();
    }
}

/// Compile the job's constraint, if it has one, and give each of its requests a copy.
pub(crate) async fn attach(ready: &Ready, job: &mut Job) -> Result<(), ApiError> {
    let Some(p) = &job.constraint else { return Ok(()) };
    let compiler = ready.compiler.as_ref().map_err(|e| ApiError::constraints_unavailable(e))?;
    let compiled = compiler.compile(ready, p).await?;
    let c = compiler.grammars.constrained(compiled, &p.reply);
    for r in &mut job.requests {
        r.constraint = Some(Constraint::new(c.clone()));
    }
    Ok(())
}

/// A grammar error as the client's 400 naming the field (`grammar_limit_exceeded` for a limit); an internal
/// failure of llguidance is logged here and answered in general words.
pub(crate) fn client_error(e: GrammarError, param: &str) -> ApiError {
    if let Some(detail) = &e.internal {
        let first = detail.lines().next().unwrap_or_default();
        eprintln!("tern: grammar compiler failure on a request's {param}: {}", api::clip(first));
    }
    let code = if e.limit.is_some() { "grammar_limit_exceeded" } else { "invalid_grammar" };
    ApiError { code: Some(code), ..ApiError::invalid(param, e.message) }
}

/// A request's hold on its queued task: dropping it (the client left) or cancelling it takes the task off the
/// queue if no thread has started it.
struct Ticket {
    task: Arc<Task>,
    shared: Arc<Shared>,
}

impl Ticket {
    /// Take the task off the queue; false if it has started.
    fn cancel(&self) -> bool {
        if self.task.state.compare_exchange(QUEUED, CANCELLED, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return false;
        }
        self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
        lock(&self.shared.queue).retain(|t| !Arc::ptr_eq(t, &self.task));
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.cancel();
    }
}

fn worker(grammars: &Grammars, s: &Shared) {
    loop {
        let task = {
            let mut q = lock(&s.queue);
            loop {
                if let Some(t) = q.pop_front() {
                    break t;
                }
                if s.closed.load(Ordering::SeqCst) {
                    return;
                }
                q = s.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        if task.state.compare_exchange(QUEUED, RUNNING, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            continue; // cancelled
        }
        s.running.fetch_add(1, Ordering::SeqCst);
        s.waiting.fetch_sub(1, Ordering::SeqCst);
        let t0 = Instant::now();
        let r = grammars.build(&task.prepared);
        s.compile_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        s.compiles.fetch_add(1, Ordering::Relaxed);
        if let Ok(c) = &r {
            lock(&s.cache).insert(task.prepared.key(), c.fresh());
        }
        s.running.fetch_sub(1, Ordering::SeqCst);
        let tx = lock(&task.done).take();
        if let Some(tx) = tx {
            let _ = tx.send(r); // the client may have left
        }
    }
}

/// Compiled grammars by key, least recently used out first.
#[derive(Default)]
struct Cache {
    map: HashMap<u64, Entry>,
    key_bytes: usize,
    clock: u64,
}

struct Entry {
    key: String,
    compiled: Compiled,
    used: u64,
}

fn hash(key: &str) -> u64 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

impl Cache {
    /// A fresh copy of the grammar compiled from `key`.
    fn get(&mut self, key: &str) -> Option<Compiled> {
        self.clock += 1;
        let e = self.map.get_mut(&hash(key)).filter(|e| e.key == key)?;
        e.used = self.clock;
        Some(e.compiled.fresh())
    }

    fn insert(&mut self, key: &str, compiled: Compiled) {
        if key.len() > CACHE_KEY_BYTES / 4 {
            return;
        }
        self.clock += 1;
        let h = hash(key);
        if let Some(old) = self.map.remove(&h) {
            self.key_bytes -= old.key.len();
        }
        while !self.map.is_empty() && (self.map.len() >= CACHE_ENTRIES || self.key_bytes + key.len() > CACHE_KEY_BYTES)
        {
            let Some((&oldest, _)) = self.map.iter().min_by_key(|(_, e)| e.used) else { break };
            if let Some(e) = self.map.remove(&oldest) {
                self.key_bytes -= e.key.len();
            }
        }
        self.key_bytes += key.len();
        self.map.insert(h, Entry { key: key.to_owned(), compiled, used: self.clock });
    }
}

#[cfg(test)]
mod tests {
    use tern_text::Spec;

    use super::*;

    fn grammars() -> Option<Grammars> {
        let Some(dir) = tern_model::testutil::qwen_dir() else {
            println!("SKIPPED: grammar tests: TERN_QWEN_DIR not set");
            return None;
        };
        Some(Grammars::from_dir(dir).unwrap())
    }

    #[test]
    fn the_cache_keeps_the_most_recent_and_compares_whole_keys() {
        let Some(g) = grammars() else { return };
        let prepared: Vec<Prepared> =
            (0..CACHE_ENTRIES + 6).map(|i| g.prepare(Spec::Lark(&format!("start: \"w{i}\""))).unwrap()).collect();
        let mut cache = Cache::default();
        for (i, p) in prepared.iter().enumerate() {
            cache.insert(p.key(), g.build(p).unwrap());
            if i >= 1 {
                // The first stays in use: never the least recent.
                assert!(cache.get(prepared[0].key()).is_some(), "entry 0 evicted at {i}");
            }
        }
        assert_eq!(cache.map.len(), CACHE_ENTRIES);
        assert!(cache.get(prepared[1].key()).is_none(), "the least recently used went first");
        assert!(cache.get(prepared[CACHE_ENTRIES + 5].key()).is_some());
        assert_eq!(cache.key_bytes, cache.map.values().map(|e| e.key.len()).sum::<usize>());
        // A key that differs but lands on the same hash is not a hit (entries hold their whole key).
        assert!(cache.get(prepared[10].key()).is_some());
        let e = cache.map.get_mut(&hash(prepared[10].key())).unwrap();
        e.key.push('x');
        assert!(cache.get(prepared[10].key()).is_none());
    }

    #[test]
    fn a_cancelled_task_leaves_the_queue_and_the_count() {
        let Some(g) = grammars() else { return };
        let shared = Arc::new(Shared::default());
        let (tx, _rx) = oneshot::channel();
        let task = Arc::new(Task {
            prepared: g.prepare(Spec::JsonObject).unwrap(),
            state: AtomicU8::new(QUEUED),
            done: Mutex::new(Some(tx)),
        });
        shared.waiting.fetch_add(1, Ordering::SeqCst);
        lock(&shared.queue).push_back(task.clone());
        drop(Ticket { task: task.clone(), shared: shared.clone() }); // the client left
        assert_eq!(shared.waiting.load(Ordering::SeqCst), 0);
        assert!(lock(&shared.queue).is_empty());
        // A started task is not cancelled (its compile runs on; the result goes to the cache only).
        task.state.store(RUNNING, Ordering::SeqCst);
        assert!(!Ticket { task, shared }.cancel());
    }
}
