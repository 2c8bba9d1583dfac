//! Request preparation off the async threads: parsing the JSON body, rendering the chat template, tokenising
//! and detokenising run on tokio's blocking threads, at most `--tokenizer-threads` at once (others wait their
//! turn without holding a thread). On the async workers a many-megabyte prompt froze every other connection for
//! seconds (/health 7.6 s, another client's stream 15.9 s).
//!
//! After a large request the freed heap is handed back to the OS: glibc keeps the pages of freed large
//! allocations in per-thread arenas (RSS 249 MB -> 1.7 GB after two 8 MiB prompts, and it stayed).

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::api::ApiError;
use crate::{Ready, Shared};

/// Inputs from this size on are followed by [`release_memory`].
const RELEASE_AFTER_BYTES: usize = 1 << 20;

pub(crate) struct Pool {
    slots: Arc<Semaphore>,
}

impl Pool {
    pub fn new(threads: usize) -> Pool {
        Pool { slots: Arc::new(Semaphore::new(threads.max(1))) }
    }

    /// Run `f` on a blocking thread once one of the pool's slots is free. `input_bytes` is the size of what `f`
    /// owns and frees (the request body): from [`RELEASE_AFTER_BYTES`] on, the heap is trimmed after it.
    pub async fn run<T, F>(&self, st: &Shared, input_bytes: usize, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&Ready) -> Result<T, ApiError> + Send + 'static,
    {
        let slot = self.slots.clone().acquire_owned().await.map_err(|_| ApiError::internal("the pool is closed"))?;
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

/// Return the free pages of every malloc arena to the OS.
fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only releases memory malloc holds free, and is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
