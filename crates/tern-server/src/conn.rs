//! Connections: the accept loop, a cap on open connections (past it a new connection is answered 503 and
//! closed, never left hanging), the header-read and keep-alive idle timeouts, and the graceful close of every
//! connection at shutdown.
//!
//! hyper serves each connection (HTTP/1.1); its header-read timer runs from the moment a connection waits for a
//! request head (when it opens, and after each response), so a client that opens connections and sends half a
//! request head holds each for at most `--header-timeout`. Between requests, a connection with nothing in flight
//! is closed after `--keep-alive-timeout`. The request body has its own deadline (`--body-timeout`, read in
//! `lib.rs`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::ApiError;
use crate::{Phase, Shared};

/// Connections being answered 503 over the cap at once; past this, an over-cap connection is closed unanswered.
const REFUSING_AT_ONCE: usize = 64;
/// How long an over-cap connection may take to send its request head, and to take the 503.
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Open connections and their limit.
pub(crate) struct Conns {
    slots: Arc<Semaphore>,
    max: usize,
    refusing: Arc<Semaphore>,
    pub open: AtomicUsize,
    /// Connections answered 503 (or closed) because `max` were open.
    pub refused: AtomicU64,
    /// Connections closed by the header-read timeout.
    pub header_timeouts: AtomicU64,
    t0: Instant,
    /// Milliseconds after `t0` of the last log line about refusals (0: none yet).
    last_refusal_log: AtomicU64,
}

impl Conns {
    pub fn new(max: usize) -> Conns {
        Conns {
            slots: Arc::new(Semaphore::new(max)),
            max,
            refusing: Arc::new(Semaphore::new(REFUSING_AT_ONCE)),
            open: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            header_timeouts: AtomicU64::new(0),
            t0: Instant::now(),
            last_refusal_log: AtomicU64::new(0),
        }
    }

    /// One log line a second at most about refused connections.
    fn log_refusal(&self, max: usize) {
        let now = self.t0.elapsed().as_millis() as u64;
        let last = self.last_refusal_log.load(Ordering::Relaxed);
        if (last == 0 || now >= last + 1000)
            && self.last_refusal_log.compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            let n = self.refused.load(Ordering::Relaxed);
            eprintln!("tern: refusing connections over --max-connections {max} (503): {n} so far");
        }
    }

    /// Resolves once no connection is open.
    pub async fn all_closed(&self) {
        let n = u32::try_from(self.max).unwrap_or(u32::MAX);
        let _ = self.slots.acquire_many(n).await;
    }
}

/// The largest connection cap the process can hold file descriptors for: the soft descriptor limit is raised to
/// the hard one first, and a cap too close to it is lowered (with a warning) so that the cap, not the descriptor
/// limit, is what a flood of connections meets.
pub(crate) fn fit_fd_limit(max_connections: usize) -> usize {
    // Descriptors the process needs besides connections: the model files, stdio, the runtime, some slack.
    const RESERVED: u64 = 64;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed in.
    let soft = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return max_connections;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        lim.rlim_cur
    };
    let room = usize::try_from(soft.saturating_sub(RESERVED).max(1)).unwrap_or(usize::MAX);
    if max_connections > room {
        eprintln!(
            "tern: --max-connections {max_connections} is more than the {soft} file descriptors allowed can hold; \
             using {room}"
        );
        return room;
    }
    max_connections
}

/// Accept connections until shutdown begins (the listener is then dropped, so new connections are refused).
pub(crate) async fn accept(listener: TcpListener, app: Router, st: Shared) {
    let mut phase = st.phase.clone();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = phase.wait_for(|p| *p != Phase::Serving) => return,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // A connection reset before it was accepted needs nothing; anything else (out of descriptors)
                // needs a pause, or the loop spins.
                use std::io::ErrorKind::*;
                if !matches!(e.kind(), ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted) {
                    eprintln!("tern: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        match st.conns.slots.clone().try_acquire_owned() {
            Ok(slot) => {
                tokio::spawn(serve(tcp, app.clone(), st.clone(), slot));
            }
            Err(_) => {
                st.conns.refused.fetch_add(1, Ordering::Relaxed);
                if let Ok(turn) = st.conns.refusing.clone().try_acquire_owned() {
                    tokio::spawn(refuse(tcp, st.clone(), turn));
                }
            }
        }
    }
}

/// Whether a connection has a request in flight, and since when it has had none.
pub(crate) struct Activity {
    in_flight: AtomicUsize,
    idle_since: Mutex<Instant>,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity { in_flight: AtomicUsize::new(0), idle_since: Mutex::new(Instant::now()) })
    }

    /// Marks a request in flight until the returned guard is dropped (with its response body).
    fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }

    /// When the connection will have been idle for `idle`, if it stays so.
    fn idle_deadline(&self, idle: Duration) -> Instant {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Instant::now() + idle;
        }
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner()) + idle
    }
}

/// A request in flight on a connection (see [`Activity::begin`]).
pub(crate) struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serve one connection until it closes: by the client, by a timeout, or by shutdown (after its response).
async fn serve(tcp: TcpStream, app: Router, st: Shared, _slot: OwnedSemaphorePermit) {
    struct Open<'a>(&'a AtomicUsize);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    st.conns.open.fetch_add(1, Ordering::SeqCst);
    let _open = Open(&st.conns.open);
    let activity = Activity::new();
    let service = {
        let (activity, st) = (activity.clone(), st.clone());
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            crate::reqlog::handle(app.clone(), st.clone(), req, activity.begin())
        })
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(st.opts.header_timeout).keep_alive(true);
    let conn = http.serve_connection(TokioIo::new(tcp), service);
    tokio::pin!(conn);
    let idle = st.opts.keep_alive_timeout;
    let mut phase = st.phase.clone();
    let mut closing = false;
    loop {
        let wake = activity.idle_deadline(idle);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    if e.is_timeout() {
                        st.conns.header_timeouts.fetch_add(1, Ordering::Relaxed);
                        eprintln!("tern: closed a connection: no request head within {:?} (--header-timeout)",
                                  st.opts.header_timeout);
                    }
                }
                return;
            }
            _ = phase.wait_for(|p| *p != Phase::Serving), if !closing => {
                conn.as_mut().graceful_shutdown(); // now if idle, else after the response in flight
                closing = true;
            }
            _ = tokio::time::sleep_until(wake.into()), if !closing => {
                if activity.idle_deadline(idle) <= Instant::now() {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// Answer a connection over the cap: read its request head (briefly), send a 503 and close, reading what the
/// client still sends for a moment so that the close does not reset the connection before the 503 is read.
async fn refuse(mut tcp: TcpStream, st: Shared, _turn: OwnedSemaphorePermit) {
    let max = st.conns.max;
    st.conns.log_refusal(max);
    let e = ApiError::unavailable(
        "too_many_connections",
        format!("the server has {max} connections open, its limit (--max-connections); retry later"),
        1,
    );
    let body = e.json().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut buf = [0u8; 4096];
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, async {
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") && seen.len() < 16 << 10 {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await?;
        tcp.shutdown().await?;
        let mut drained = 0;
        while drained < 1 << 20 {
            match tcp.read(&mut buf).await? {
                0 => break,
                n => drained += n,
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
}
