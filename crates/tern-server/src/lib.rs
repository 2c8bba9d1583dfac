//! tern's OpenAI-compatible HTTP server (axum + tokio) over the engine's scheduler.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models[/{id}]`, `GET /health`
//! (503 while the model loads), `GET /metrics` (Prometheus text), `POST /tokenize`, `POST /detokenize`.
//! Every error is `{"error": {"message", "type", "param", "code"}}`; a panicking handler answers 500.
//!
//! Each generation request gets a thread that forwards the engine's events into a tokio channel; the
//! response (or SSE body) owns that channel's receiver, so a client that goes away drops it, the thread's
//! next send fails, the thread drops the engine receiver and the engine cancels the request.

mod api;
pub mod cli;
mod generate;

use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tern_engine::{Engine, EngineConfig, Model};
use tern_text::{ChatTemplate, SamplingParams, Tokenizer};
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;

pub use api::ApiError;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0 picks a free port (see the "listening on" line, or use [`bind`] + [`run`]).
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health and /metrics.
    pub api_key: Option<String>,
    pub ctx_size: usize,
    pub max_concurrent: usize,
    /// Requests waiting beyond the running ones before the server answers 503.
    pub max_queue: usize,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            ctx_size: 32768,
            max_concurrent: 8,
            max_queue: 64,
            max_body_bytes: 8 << 20,
        }
    }
}

/// Serve a loaded model until SIGINT/SIGTERM, then stop accepting, drain in-flight requests and return.
pub async fn serve(model: Model, opts: ServeOptions) -> Result<()> {
    let listener = bind(&opts).await?;
    run(listener, move || Ok(model), opts, shutdown_signal()).await
}

pub async fn bind(opts: &ServeOptions) -> Result<TcpListener> {
    TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port))
}

/// Serve on `listener`: answer at once (/health says 503) while `load` runs on a blocking thread, then serve the
/// model until `shutdown` resolves; in-flight requests are drained before this returns. A failed load is
/// returned as the error.
pub async fn run<L, S>(listener: TcpListener, load: L, opts: ServeOptions, shutdown: S) -> Result<()>
where
    L: FnOnce() -> Result<Model> + Send + 'static,
    S: Future<Output = ()> + Send + 'static,
{
    let state = Arc::new(AppState { opts, ready: OnceLock::new(), created: unix_time() });
    eprintln!("tern: listening on http://{}", listener.local_addr()?);
    let loader = {
        let state = state.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let t0 = Instant::now();
            let ready = Ready::new(load()?, &state.opts);
            eprintln!("tern: model {} ready in {:.1}s", ready.name, t0.elapsed().as_secs_f64());
            let _ = state.ready.set(ready);
            Ok(())
        })
    };
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).into_future();
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => r?,
        r = loader => {
            r.context("the model loader panicked")?.context("loading the model")?;
            server.await?;
        }
    }
    eprintln!("tern: stopped");
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    eprintln!("tern: shutting down: draining in-flight requests");
}

struct AppState {
    opts: ServeOptions,
    ready: OnceLock<Ready>,
    created: u64,
}

type Shared = Arc<AppState>;

/// The loaded model and its engine.
struct Ready {
    name: String,
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    sampling: SamplingParams,
    stop_ids: Vec<u32>,
}

impl Ready {
    fn new(model: Model, opts: &ServeOptions) -> Ready {
        let config = EngineConfig {
            ctx_size: opts.ctx_size,
            max_concurrent: opts.max_concurrent,
            max_queue: opts.max_queue,
            ..EngineConfig::default()
        };
        Ready {
            engine: Engine::start(model.backend, model.tokenizer.clone(), config),
            name: model.name,
            tokenizer: model.tokenizer,
            template: model.template,
            sampling: model.sampling,
            stop_ids: model.stop_ids,
        }
    }
}

impl AppState {
    fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "model_loading",
                "the model is still loading",
            )
        })
    }
}

/// Tokens of one request, filled in by the handler, printed by the request log line.
#[derive(Default)]
struct TokenCount {
    prompt: AtomicUsize,
    completion: AtomicUsize,
}

fn router(state: Shared) -> Router {
    let limit = state.opts.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such route")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
                "method not allowed",
            )
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "internal server error")
                .into_response()
        }))
        .layer(middleware::from_fn(log))
        .with_state(state)
}

/// One stderr line per request when its response body is finished (or dropped): method, path, status, tokens, ms.
async fn log(mut req: Request, next: Next) -> Response {
    struct Line {
        what: String,
        status: StatusCode,
        count: Arc<TokenCount>,
        t0: Instant,
    }
    impl Drop for Line {
        fn drop(&mut self) {
            let (p, c) = (self.count.prompt.load(Ordering::Relaxed), self.count.completion.load(Ordering::Relaxed));
            let ms = self.t0.elapsed().as_secs_f64() * 1e3;
            eprintln!("{} {} prompt={p} completion={c} {ms:.0}ms", self.what, self.status.as_u16());
        }
    }
    let count = Arc::new(TokenCount::default());
    req.extensions_mut().insert(count.clone());
    let what = format!("{} {}", req.method(), req.uri().path());
    let t0 = Instant::now();
    let res = next.run(req).await;
    let line = Line { what, status: res.status(), count, t0 };
    let (parts, body) = res.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _ = &line;
        chunk
    }));
    Response::from_parts(parts, body)
}

async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.opts.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if given.and_then(|v| v.strip_prefix("Bearer ")) != Some(key.as_str()) {
            let msg = "invalid or missing API key (Authorization: Bearer ...)";
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key", msg)
                .into_response();
        }
    }
    next.run(req).await
}

type RawBody = Result<Bytes, BytesRejection>;

async fn chat(State(st): State<Shared>, Extension(count): Extension<Arc<TokenCount>>, body: RawBody) -> Response {
    let r = async {
        let ready = st.ready()?;
        let job = api::chat_job(ready, &api::Body::parse(body)?)?;
        generate::respond(ready, job, count).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(st): State<Shared>,
    Extension(count): Extension<Arc<TokenCount>>,
    body: RawBody,
) -> Response {
    let r = async {
        let ready = st.ready()?;
        let job = api::completion_job(ready, &api::Body::parse(body)?)?;
        generate::respond(ready, job, count).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

fn model_card(st: &AppState, name: &str) -> Value {
    json!({"id": name, "object": "model", "created": st.created, "owned_by": "tern", "max_model_len": st.opts.ctx_size})
}

async fn models(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    let ready = st.ready()?;
    Ok(Json(json!({"object": "list", "data": [model_card(&st, &ready.name)]})))
}

async fn model(State(st): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let ready = st.ready()?;
    api::check_model(ready, Some(&id))?;
    Ok(Json(model_card(&st, &ready.name)))
}

async fn health(State(st): State<Shared>) -> Response {
    match st.ready.get() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response(),
    }
}

async fn tokenize(State(st): State<Shared>, body: RawBody) -> Result<Json<Value>, ApiError> {
    let ready = st.ready()?;
    let tokens = api::tokenize(ready, &api::Body::parse(body)?)?;
    Ok(Json(json!({"count": tokens.len(), "max_model_len": st.opts.ctx_size, "tokens": tokens})))
}

async fn detokenize(State(st): State<Shared>, body: RawBody) -> Result<Json<Value>, ApiError> {
    let ready = st.ready()?;
    let text = api::detokenize(ready, &api::Body::parse(body)?)?;
    Ok(Json(json!({"prompt": text})))
}

async fn metrics(State(st): State<Shared>) -> Response {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        out.push_str(&format!("# HELP tern_{name} {help}\n# TYPE tern_{name} {kind}\ntern_{name} {value}\n"));
    };
    metric("ready", "gauge", "1 once the model is loaded", st.ready.get().is_some() as u8 as f64);
    if let Some(ready) = st.ready.get() {
        let s = &ready.engine.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
        let (completion, ttft_n, decode_s) = (get(&s.completion_tokens), get(&s.ttft_count), get(&s.decode_us) / 1e6);
        metric("requests_total", "counter", "generation requests accepted", get(&s.requests));
        metric("prompt_tokens_total", "counter", "prompt tokens processed", get(&s.prompt_tokens));
        metric(
            "cached_prompt_tokens_total",
            "counter",
            "prompt tokens served from the prefix cache",
            get(&s.cached_tokens),
        );
        metric("completion_tokens_total", "counter", "tokens generated", completion);
        metric("time_to_first_token_seconds_sum", "counter", "sum of time to first token", get(&s.ttft_us) / 1e6);
        metric("time_to_first_token_seconds_count", "counter", "requests with a first token", ttft_n);
        let tps = if decode_s > 0.0 { (completion - ttft_n).max(0.0) / decode_s } else { 0.0 };
        metric("decode_tokens_per_second", "gauge", "tokens per second of one sequence after its first", tps);
        metric("queue_depth", "gauge", "requests waiting for a slot", s.waiting.load(Ordering::Relaxed) as f64);
        metric("requests_running", "gauge", "requests being decoded", s.active.load(Ordering::Relaxed) as f64);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
