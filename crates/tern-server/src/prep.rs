//! Request preparation off the async threads: parsing the JSON body, rendering the chat template, tokenising
//! and detokenising run on tokio's blocking threads, at most `--tokenizer-threads` at once (others wait their
//! turn without holding a thread). On the async workers a many-megabyte prompt froze every other connection for
//! seconds (/health 7.6 s, another client's stream 15.9 s). Bodies of [`LARGE_BYTES`] or more take turns on
//! `--tokenizer-threads` slots of their own, so that a few large requests (seconds each to tokenise when they
//! fit the bound of [`tern_text::Tokenizer::min_tokens`]) never hold up the small ones: four 7 MB count_tokens
//! stalled every other client 25 s.
//!
//! The freed heap is handed back to the OS: glibc keeps the pages of freed allocations in its arenas (one per
//! thread that allocated, up to 8 per core), so RSS only grew: 249 MB -> 1.7 GB after two 8 MiB prompts, +110
//! MB (+28%) over 100 mixed requests of 0.1-7 MB (schema compiles, /tokenize, refused prompts). Three things,
//! set up by [`start_trimmer`]: allocations of [`MMAP_THRESHOLD`] or more (request bodies, their JSON, token
//! lists) get pages of their own, unmapped when freed (glibc raises that threshold to the size of each such
//! block freed, up to 32 MiB, so that after one large request every later one landed in the arenas, fragmenting
//! them: +14% over 100 requests of 0.15-2 MB even with trimming, +1% with the threshold held); the heap is
//! trimmed at once after a large input; and a thread trims it whenever the resident memory or the heap's free
//! bytes have grown by [`TRIM_GROWTH`] since the last trim, whatever allocated it (compiles, tokenising, the
//! engine).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::api::ApiError;
use crate::{Ready, Shared};

/// Inputs from this size on are followed by [`release_memory`].
const RELEASE_AFTER_BYTES: usize = 1 << 20;

/// Allocations from this size on are mapped on their own (glibc starts at 128 KiB and raises it as such blocks
/// are freed; here it is held).
const MMAP_THRESHOLD: usize = 256 << 10;

/// Inputs from this size on are prepared on the large requests' slots.
pub(crate) const LARGE_BYTES: usize = 256 << 10;

/// How often [`start_trimmer`] looks at the resident memory and the heap's free bytes; by how much one of them
/// must have grown since the last trim for another; and by how little both may have moved since the last look for
/// the process to count as quiet.
const TRIM_EVERY: Duration = Duration::from_millis(300);
const TRIM_GROWTH: usize = 8 << 20;
const TRIM_QUIET: usize = 1 << 20;

pub(crate) struct Pool {
    slots: Arc<Semaphore>,
    large: Arc<Semaphore>,
}

impl Pool {
    pub fn new(threads: usize) -> Pool {
        Pool { slots: Arc::new(Semaphore::new(threads.max(1))), large: Arc::new(Semaphore::new(threads.max(1))) }
    }

    /// Run `f` on a blocking thread once one of the pool's slots is free (of the large requests' slots from
    /// [`LARGE_BYTES`] on). `input_bytes` is the size of what `f` owns and frees (the request body): from
    /// [`RELEASE_AFTER_BYTES`] on, the heap is trimmed after it.
    pub async fn run<T, F>(&self, st: &Shared, input_bytes: usize, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&Ready) -> Result<T, ApiError> + Send + 'static,
    {
        let slots = if input_bytes >= LARGE_BYTES { &self.large } else { &self.slots };
        let slot = slots.clone().acquire_owned().await.map_err(|_| ApiError::internal("the pool is closed"))?;
        let st = st.clone();
        let task = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            let out = st.ready().and_then(f);
            if input_bytes >= RELEASE_AFTER_BYTES {
                release_memory();
            }
            out
        });
        task.await.map_err(|_| ApiError::internal("preparing the request failed (a panic; see the server log)"))?
    }
}

/// Once per process: hold malloc's mmap threshold at [`MMAP_THRESHOLD`], and start a thread that trims the heap
/// ([`release_memory`]) whenever, since the last trim, the resident memory has grown by [`TRIM_GROWTH`] (pages
/// touched again) or the heap's free bytes have (memory freed), and once more when the process is quiet after such
/// trims (what the requests running at the last one held is free by then), looking every [`TRIM_EVERY`]. Memory
/// held for good (the engine's state, the prefix cache) costs a trim per [`TRIM_GROWTH`] it grows. glibc only.
pub(crate) fn start_trimmer() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    static STARTED: std::sync::Once = std::sync::Once::new();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    STARTED.call_once(|| {
        // SAFETY: mallopt only changes malloc's settings (thread-safe; a failure leaves them as they were).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
        }
        let Some(mut rss) = resident_bytes() else { return };
        let mut free = free_heap_bytes();
        // The last look, and whether a trim is owed once the process is quiet.
        let (mut last, mut settle) = ((rss, free), true);
        let spawned = std::thread::Builder::new().name("tern-trim".into()).spawn(move || loop {
            std::thread::sleep(TRIM_EVERY);
            let Some(now) = resident_bytes() else { return };
            let now_free = free_heap_bytes();
            let quiet = now.abs_diff(last.0) < TRIM_QUIET && now_free.abs_diff(last.1) < TRIM_QUIET;
            last = (now, now_free);
            let grew = now >= rss + TRIM_GROWTH || now_free >= free + TRIM_GROWTH;
            if grew || (settle && quiet) {
                release_memory();
                (rss, free) = (resident_bytes().unwrap_or(now), free_heap_bytes());
                last = (rss, free);
                settle = grew;
            } else {
                (rss, free) = (rss.min(now), free.min(now_free));
            }
        });
        if let Err(e) = spawned {
            eprintln!("tern: cannot start the heap-trimming thread: {e}");
        }
    });
}

/// The process's resident memory (Linux: /proc/self/statm).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn resident_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system setting.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages.saturating_mul(usize::try_from(page).ok().filter(|&p| p > 0)?))
}

/// Bytes malloc holds free in its arenas (whether or not their pages were returned).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn free_heap_bytes() -> usize {
    // SAFETY: mallinfo2 takes no arguments and only reads malloc's bookkeeping (under its locks).
    unsafe { libc::mallinfo2() }.fordblks
}

/// Return the free pages of every malloc arena to the OS.
fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only releases memory malloc holds free, and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
