//! Every request through the application, and its log line: one stderr line per request, written when its
//! response body has been sent or dropped, or when the request is dropped before it has a response (its client
//! went away while it was queued or generating): method, path, status (`-`: none was sent), tokens, time, the
//! time from its arrival to its first generated token (`ttft=`, where it had one), and how it ended
//! (`end=stop|length|tool_calls|ok|client_gone|cut_at_shutdown|error ...`).
//!
//! Also the last guard of the error shape: an error response that is not JSON (a rejection from deep in the
//! framework) is rewritten as an OpenAI error.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use tower_service::Service;

use crate::api::{clip, ApiError, ErrorTag};
use crate::conn::Busy;
use crate::{Phase, Shared};

/// What a handler reports about its request, for the log line.
pub(crate) struct RequestInfo {
    start: Instant,
    prompt: AtomicUsize,
    completion: AtomicUsize,
    /// Microseconds from `start` to the first generated token (0: none yet).
    first_us: AtomicU64,
    end: Mutex<Option<String>>,
}

impl RequestInfo {
    fn new(start: Instant) -> RequestInfo {
        RequestInfo {
            start,
            prompt: AtomicUsize::new(0),
            completion: AtomicUsize::new(0),
            first_us: AtomicU64::new(0),
            end: Mutex::new(None),
        }
    }

    /// A token was generated (the first one sets the request's time to first token).
    pub fn token(&self) {
        if self.first_us.load(Ordering::Relaxed) == 0 {
            let us = (self.start.elapsed().as_micros() as u64).max(1);
            let _ = self.first_us.compare_exchange(0, us, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    pub fn tokens(&self, prompt: usize, completion: usize) {
        self.prompt.store(prompt, Ordering::Relaxed);
        self.completion.store(completion, Ordering::Relaxed);
    }

    /// How the request ended (a finish reason, `cut_at_shutdown`, an error in a stream).
    pub fn end(&self, why: impl Into<String>) {
        *self.end.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.into());
    }
}

/// Run one request through the application, with its log line.
pub(crate) async fn handle(
    mut app: Router,
    st: Shared,
    req: hyper::Request<Incoming>,
    busy: Busy,
) -> Result<Response, Infallible> {
    let t0 = Instant::now();
    let info = Arc::new(RequestInfo::new(t0));
    let mut line = Line {
        what: format!("{} {}", req.method(), clip(req.uri().path())),
        t0,
        info: info.clone(),
        status: None,
        error: None,
        completed: false,
        st: st.clone(),
        _busy: busy,
    };
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let mut req = req.map(Body::new);
    req.extensions_mut().insert(info);
    let res = match app.call(req).await {
        Ok(res) => res,
        Err(never) => match never {},
    };
    let mut res = openai_shaped(res).await;
    if anthropic {
        res = anthropic_shaped(res).await;
    }
    line.status = Some(res.status());
    line.error = res.extensions().get::<ErrorTag>().map(|t| t.0.clone());
    let (parts, body) = res.into_parts();
    Ok(Response::from_parts(parts, Body::new(Logged { inner: body, line: Some(line) })))
}

/// An error response that is not JSON, as an OpenAI error (with the original text as the message).
async fn openai_shaped(res: Response) -> Response {
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return res;
    }
    let text = match axum::body::to_bytes(res.into_body(), 4096).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).into_owned(),
        _ => status.canonical_reason().unwrap_or("error").to_owned(),
    };
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    ApiError::new(status, kind, "http_error", text).into_response()
}

/// An error response under /v1/messages in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`);
/// headers (CORS, Retry-After) are kept.
async fn anthropic_shaped(res: Response) -> Response {
    let status = res.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 16).await.unwrap_or_default();
    let openai: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let body = crate::anthropic::reshape_error(status.as_u16(), &openai).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(body))
}

/// The log line of one request, written when dropped.
struct Line {
    what: String,
    t0: Instant,
    info: Arc<RequestInfo>,
    /// `None`: the request was dropped before its handler answered.
    status: Option<StatusCode>,
    error: Option<String>,
    /// The response body was sent to its end.
    completed: bool,
    st: Shared,
    _busy: Busy,
}

impl Drop for Line {
    fn drop(&mut self) {
        let info = &self.info;
        let (p, c) = (info.prompt.load(Ordering::Relaxed), info.completion.load(Ordering::Relaxed));
        let ms = self.t0.elapsed().as_secs_f64() * 1e3;
        let reported = info.end.lock().unwrap_or_else(|e| e.into_inner()).take();
        let end = if !self.completed {
            // Dropped unfinished: the client went away (or the server stopped before it could finish).
            let stopped = *self.st.phase.borrow() == Phase::Cut;
            if stopped {
                "dropped_at_shutdown".to_owned()
            } else {
                "client_gone".to_owned()
            }
        } else {
            reported.or_else(|| self.error.clone()).unwrap_or_else(|| "ok".to_owned())
        };
        let status = self.status.map_or("-".to_owned(), |s| s.as_u16().to_string());
        let ttft = match info.first_us.load(Ordering::Relaxed) {
            0 => String::new(),
            us => format!(" ttft={:.0}ms", us as f64 / 1e3),
        };
        eprintln!("{} {status} prompt={p} completion={c} {ms:.0}ms{ttft} end={end}", self.what);
    }
}

/// A response body that completes its request's log line.
struct Logged {
    inner: Body,
    line: Option<Line>,
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        let done = match &r {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            _ => false,
        };
        if done {
            if let Some(mut line) = this.line.take() {
                line.completed = true;
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        use http_body::Body as _;
        if let Some(line) = &mut self.line {
            // A body with nothing to send (hyper never polls it) is complete.
            line.completed = self.inner.is_end_stream();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first token sets the time to first token; later ones leave it.
    #[test]
    fn first_token_sets_ttft_once() {
        let info = RequestInfo::new(Instant::now());
        assert_eq!(info.first_us.load(Ordering::Relaxed), 0, "no token yet");
        std::thread::sleep(std::time::Duration::from_millis(3));
        info.token();
        let first = info.first_us.load(Ordering::Relaxed);
        assert!(first >= 3000, "ttft {first} us after a 3 ms wait");
        std::thread::sleep(std::time::Duration::from_millis(3));
        info.token();
        assert_eq!(info.first_us.load(Ordering::Relaxed), first, "a later token moved the time to first token");
    }
}
