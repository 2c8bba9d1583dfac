//! tern's OpenAI- and Anthropic-compatible HTTP server (axum on hyper and tokio) over the engine's scheduler.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses` (OpenAI's Responses API,
//! stateless), `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's Messages API),
//! `GET /v1/models[/{id}]`, `GET /health` (503 while the model loads, once the engine has stopped, and during
//! shutdown), `GET /metrics` (Prometheus text; behind the API key unless `--metrics-public`), `POST /tokenize`,
//! `POST /detokenize`, and the chat page at `GET /`. Every error is `{"error": {"message", "type", "param",
//! "code"}}` (Anthropic's `{"type": "error", "error": {"type", "message"}}` under /v1/messages); a panicking
//! handler answers 500. POST bodies must be `application/json` (so that a web page cannot post to a local server
//! with a CORS "simple" request); `--cors ORIGINS` lets pages of other origins call the API (preflights
//! answered, off by default). The API key is read from `Authorization: Bearer KEY` or `x-api-key: KEY`; without
//! one, a request's `Host` must name this server (`host`: a defence against DNS rebinding; `--allowed-hosts`).
//!
//! Structured output: `response_format` (`json_object`, `json_schema`), a Lark or GBNF `grammar`, and
//! `tool_choice` `required` / named constrain decoding with llguidance masks (see tern-text's `constraint` and the
//! engine's constrained decoding); grammars are bounded before they compile, and compile on a pool of their own
//! (`grammar`).
//!
//! No request takes the server down: connections are capped and timed (`conn`), bodies are read within a
//! deadline, request preparation runs on a bounded blocking pool (`prep`), every sampling field is bounded
//! where it enters (`api`), and every request leaves a log line (`reqlog`). Shutdown has a deadline: on the
//! first signal the server stops accepting, answers requests without a token yet 503, lets the others run for
//! `--shutdown-grace`, then cuts them with a final chunk; a second signal exits at once.
//!
//! Each generation request gets a thread that forwards the engine's events into a tokio channel; the
//! response (or SSE body) owns that channel's receiver, so a client that goes away drops it, the thread's
//! next send fails, the thread drops the engine receiver and the engine cancels the request.

mod anthropic;
mod api;
pub mod cli;
mod conn;
mod generate;
mod grammar;
mod host;
mod images;
mod openai;
mod page;
mod prep;
mod reqlog;
mod responses;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tern_engine::{Engine, EngineConfig, Model};
use tern_text::{ChatTemplate, Grammars, SamplingParams, Tokenizer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower_http::catch_panic::CatchPanicLayer;

pub use api::ApiError;
pub use images::{ImageFetch, ImageLimits};
use reqlog::RequestInfo;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0 picks a free port (see the "listening on" line, or use [`bind`] + [`run`]).
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health (and /metrics with `metrics_public`).
    /// An empty key is refused at start.
    pub api_key: Option<String>,
    /// Serve /metrics without the API key.
    pub metrics_public: bool,
    pub ctx_size: usize,
    /// Sequences running at once (0: the backend's own [`tern_engine::Backend::max_seqs`]).
    pub max_concurrent: usize,
    /// Requests waiting beyond the running ones before the server answers 503 (0: none wait).
    pub max_queue: usize,
    /// Tokens one engine step reads (0: the backend's choice; see `EngineConfig::step_tokens`).
    pub step_tokens: usize,
    /// Drafts a step for speculative decoding (0: off; see `EngineConfig::speculative`).
    pub speculative: usize,
    /// Backend state the prefix cache may hold across requests, in bytes (0: no prefix cache).
    pub prefix_cache_bytes: usize,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// Open connections; past this a new connection gets a 503 and is closed.
    pub max_connections: usize,
    /// A connection must send a complete request head within this (from when it opens or its last response).
    pub header_timeout: Duration,
    /// A request body must arrive whole within this (408 otherwise).
    pub body_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub keep_alive_timeout: Duration,
    /// At shutdown, running requests may finish within this; then they are cut.
    pub shutdown_grace: Duration,
    /// Requests rendered and tokenised at once (on blocking threads); as many again of bodies of 256 KiB or more.
    pub tokenizer_threads: usize,
    /// Origins whose pages may call the API (CORS); `*` for any; empty: none (no CORS headers).
    pub cors: Vec<String>,
    /// Without `api_key`, the `Host` names served besides localhost, IP addresses, `host` and this machine's name
    /// (`.example.com`: it and the names under it; `*`: any); others get 403 (see `host`).
    pub allowed_hosts: Vec<String>,
    /// Read control tokens (`<|im_start|>`, `<think>`, ...) spelled in chat messages, tool results and tool
    /// definitions as those tokens, as transformers' template and vLLM do (by default they are text; see
    /// tern-text's `ChatTemplate::render_marked`).
    pub allow_special_in_content: bool,
    /// Bounds on the images of a request (count, bytes and pixels of each; each is a 400 naming it), and whether
    /// http(s) image URLs are fetched (`images.fetch`, off by default).
    pub images: ImageLimits,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            metrics_public: false,
            ctx_size: 32768,
            max_concurrent: 0,
            max_queue: 64,
            step_tokens: 0,
            speculative: 0,
            prefix_cache_bytes: EngineConfig::default().prefix_cache_bytes,
            max_body_bytes: 8 << 20,
            max_connections: 512,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            keep_alive_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(25),
            tokenizer_threads: default_tokenizer_threads(),
            cors: Vec::new(),
            allowed_hosts: Vec::new(),
            allow_special_in_content: false,
            images: ImageLimits::default(),
        }
    }
}

/// Half the cores (at least one): tokenising must not starve the scheduler thread of the CPU.
pub fn default_tokenizer_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

impl ServeOptions {
    /// Refuse settings that cannot work (before anything listens).
    pub fn check(&self) -> Result<()> {
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            bail!(
                "--api-key (or TERN_API_KEY) is empty, which no client could send: give a key, or leave both \
                 unset to serve without one"
            );
        }
        let positive = [
            ("--ctx-size", self.ctx_size),
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-connections", self.max_connections),
            ("--tokenizer-threads", self.tokenizer_threads),
        ];
        for (flag, v) in positive {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        let timeouts = [
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
            ("--keep-alive-timeout", self.keep_alive_timeout),
        ];
        for (flag, v) in timeouts {
            if v.is_zero() {
                bail!("{flag} must be more than 0 seconds");
            }
        }
        for h in &self.allowed_hosts {
            let bad = h.is_empty() || h.contains(['/', ' ']) || axum::http::HeaderValue::from_str(h).is_err();
            if bad {
                bail!(
                    "--allowed-hosts: '{h}' is not a host name (example.com; .example.com for it and the names under \
                     it; * for any)"
                );
            }
        }
        for o in &self.cors {
            if o != "*" && (axum::http::HeaderValue::from_str(o).is_err() || !o.contains("://")) {
                bail!("--cors: '{o}' is not an origin (scheme://host[:port], or * for any)");
            }
        }
        if self.images.fetch.enabled && self.images.fetch.timeout.is_zero() {
            bail!("--image-url-timeout must be more than 0 seconds");
        }
        Ok(())
    }
}

/// Serve a loaded model until SIGINT/SIGTERM, then shut down within the grace (see [`run`]).
pub async fn serve(model: Model, opts: ServeOptions) -> Result<()> {
    let listener = bind(&opts).await?;
    run(listener, move || Ok(model), opts, shutdown_signal()).await
}

pub async fn bind(opts: &ServeOptions) -> Result<TcpListener> {
    TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port))
}

/// Where shutdown stands; ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Serving,
    /// No new connections or requests; requests without a token yet get 503; the others run on.
    Draining,
    /// The grace is over: running requests are cut.
    Cut,
}

/// Serve on `listener`: answer at once (/health says 503) while `load` runs on a blocking thread, then serve the
/// model until `shutdown` resolves. Then stop accepting, answer requests that have no token yet 503, give the
/// others `shutdown_grace` to finish, cut those still running (a last chunk with `finish_reason: "length"` and
/// `[DONE]`), and return once every connection has closed (or a few seconds after the cut). A failed load is
/// returned as the error.
pub async fn run<L, S>(listener: TcpListener, load: L, mut opts: ServeOptions, shutdown: S) -> Result<()>
where
    L: FnOnce() -> Result<Model> + Send + 'static,
    S: Future<Output = ()> + Send + 'static,
{
    opts.check()?;
    opts.max_connections = conn::fit_fd_limit(opts.max_connections);
    let (phase_tx, phase) = watch::channel(Phase::Serving);
    prep::start_trimmer();
    let state = Arc::new(AppState {
        hosts: host::Allowed::new(&opts),
        conns: conn::Conns::new(opts.max_connections),
        prep: prep::Pool::new(opts.tokenizer_threads),
        opts,
        ready: OnceLock::new(),
        created: unix_time(),
        phase,
    });
    let o = &state.opts;
    eprintln!(
        "tern: listening on http://{} (--max-connections {}, --header-timeout {:?}, --body-timeout {:?}, \
         --keep-alive-timeout {:?}, --shutdown-grace {:?}, --tokenizer-threads {})",
        listener.local_addr()?,
        o.max_connections,
        o.header_timeout,
        o.body_timeout,
        o.keep_alive_timeout,
        o.shutdown_grace,
        o.tokenizer_threads
    );
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
    let accept = tokio::spawn(conn::accept(listener, router(state.clone()), state.clone()));
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut shutdown => {}
        r = loader => {
            r.context("the model loader panicked")?.context("loading the model")?;
            shutdown.await;
        }
    }
    let grace = state.opts.shutdown_grace;
    eprintln!(
        "tern: shutting down: not accepting; requests without a token yet get 503, running ones have {grace:?} \
         (--shutdown-grace); a second signal exits at once"
    );
    let _ = phase_tx.send(Phase::Draining);
    let _ = accept.await;
    if tokio::time::timeout(grace, state.conns.all_closed()).await.is_err() {
        let open = state.conns.open.load(Ordering::SeqCst);
        eprintln!("tern: shutdown grace over: cutting what is still running ({open} connections open)");
        let _ = phase_tx.send(Phase::Cut);
        let _ = tokio::time::timeout(Duration::from_secs(5), state.conns.all_closed()).await;
    }
    eprintln!("tern: stopped");
    Ok(())
}

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM; a second one exits the process at once.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, Signal, SignalKind};
    async fn recv(s: &mut Option<Signal>) {
        match s {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
    async fn either(term: &mut Option<Signal>, int: &mut Option<Signal>) -> &'static str {
        tokio::select! {
            _ = recv(term) => "SIGTERM",
            _ = recv(int) => "SIGINT",
        }
    }
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    let first = either(&mut term, &mut int).await;
    eprintln!("tern: {first}");
    tokio::spawn(async move {
        let second = either(&mut term, &mut int).await;
        eprintln!("tern: {second} again: exiting now");
        std::process::exit(if second == "SIGINT" { 130 } else { 143 });
    });
}

struct AppState {
    opts: ServeOptions,
    ready: OnceLock<Ready>,
    created: u64,
    phase: watch::Receiver<Phase>,
    conns: conn::Conns,
    prep: prep::Pool,
    /// The `Host` names served without a key (`None`: any).
    hosts: Option<host::Allowed>,
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
    /// Constrained decoding's compiler, or why there is none.
    grammars: Result<Arc<Grammars>, String>,
    /// Its compile pool and cache (see [`grammar`]).
    compiler: Result<grammar::Compiler, String>,
    /// The backend's name ("cpu", "cuda"), in the system fingerprint.
    engine_backend: String,
    /// `--allow-special-in-content`: chat text is tokenized with its control tokens read as such.
    special_in_content: bool,
    /// How the model reads images (`None`: it reads none, and image parts are a 400).
    images: Option<tern_engine::model::ImageInput>,
    /// The bounds on a request's images.
    image_limits: ImageLimits,
}

impl Ready {
    fn new(model: Model, opts: &ServeOptions) -> Ready {
        let config = EngineConfig {
            ctx_size: opts.ctx_size,
            max_concurrent: opts.max_concurrent,
            max_queue: opts.max_queue,
            step_tokens: opts.step_tokens,
            speculative: opts.speculative,
            prefix_cache_bytes: opts.prefix_cache_bytes,
            // Two mask workers at least, even on two cores: one slow grammar's masks do not hold up every other
            // constrained request's.
            constraint_threads: EngineConfig::default().constraint_threads.max(2),
            ..EngineConfig::default()
        };
        let t0 = Instant::now();
        let grammars = Grammars::from_dir(&model.dir).map(Arc::new).map_err(|e| e.to_string());
        match &grammars {
            Ok(_) => eprintln!("tern: constrained decoding ready in {:.1}s", t0.elapsed().as_secs_f64()),
            Err(e) => eprintln!("tern: constrained decoding unavailable: {e}"),
        }
        Ready {
            compiler: grammars.as_ref().map(|g| grammar::Compiler::start(g.clone())).map_err(Clone::clone),
            grammars,
            engine_backend: model.backend.name().to_owned(),
            engine: Engine::start(model.backend, model.tokenizer.clone(), config),
            name: model.name,
            tokenizer: model.tokenizer,
            template: model.template,
            sampling: model.sampling,
            stop_ids: model.stop_ids,
            special_in_content: opts.allow_special_in_content,
            images: model.images,
            image_limits: opts.images.clone(),
        }
    }
}

impl AppState {
    /// The model and a running engine, or why not (503).
    fn ready(&self) -> Result<&Ready, ApiError> {
        let ready =
            self.ready.get().ok_or_else(|| ApiError::unavailable("model_loading", "the model is still loading", 5))?;
        if !ready.engine.is_running() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "engine_stopped",
                "the engine has stopped; this server must be restarted (see its log)",
            ));
        }
        Ok(ready)
    }

    /// 503 once shutdown has begun.
    fn accepting(&self) -> Result<(), ApiError> {
        match *self.phase.borrow() {
            Phase::Serving => Ok(()),
            _ => Err(ApiError::unavailable("shutting_down", "the server is shutting down", 1)),
        }
    }
}

fn router(state: Shared) -> Router {
    let limit = state.opts.max_body_bytes;
    let cors = cors_layer(&state.opts.cors);
    let app = Router::new()
        .route("/", get(page::index))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
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
        .layer(middleware::from_fn_with_state(state.clone(), read_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.clone(), host::check))
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "internal server error")
                .into_response()
        }));
    // Outermost: a preflight is answered before auth (browsers send no key with it), and errors carry the headers.
    match cors {
        Some(cors) => app.layer(cors).with_state(state),
        None => app.with_state(state),
    }
}

/// CORS for `--cors` origins (`*`: any); `None` without any.
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| axum::http::HeaderValue::from_str(o).ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            // Authorization is never covered by a `*`: the headers a preflight asks for are allowed by name.
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(Duration::from_secs(600)),
    )
}

/// Every route needs the key when one is set, but /health (and /metrics with `--metrics-public`).
async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let public = match req.uri().path() {
        "/health" | "/" => true,
        "/metrics" => st.opts.metrics_public,
        _ => false,
    };
    if let (Some(key), false) = (&st.opts.api_key, public) {
        let bearer = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
        let x_api_key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
        if ![bearer, x_api_key].iter().flatten().any(|g| same_key(g.as_bytes(), key.as_bytes())) {
            let msg = "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)";
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key", msg)
                .into_response();
        }
    }
    next.run(req).await
}

/// Key comparison whose time does not depend on where the keys differ.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Read the whole request body within `--body-timeout` (408) and `--max-body-bytes` (413); POST bodies must be
/// JSON (415).
async fn read_body(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if req.method() == Method::POST {
        let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        let mime = ct.unwrap_or("").split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if mime != "application/json" && !(mime.starts_with("application/") && mime.ends_with("+json")) {
            let got = ct.map_or("none".to_owned(), |c| format!("'{}'", api::clip(c)));
            return ApiError {
                close: true,
                ..ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "invalid_request_error",
                    "unsupported_media_type",
                    format!("the request body must be JSON with Content-Type: application/json (got {got})"),
                )
            }
            .into_response();
        }
    }
    let (parts, body) = req.into_parts();
    let (limit, deadline) = (st.opts.max_body_bytes, st.opts.body_timeout);
    let bytes = match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => bytes,
        Err(_) => {
            let msg = format!("the request body did not arrive within {deadline:?} (--body-timeout)");
            let e = ApiError::new(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", "request_timeout", msg);
            return ApiError { close: true, ..e }.into_response();
        }
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            let e = if too_large {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "payload_too_large",
                    format!("the request body is larger than {limit} bytes (--max-body-bytes)"),
                )
            } else {
                let msg = format!("cannot read the request body: {e}");
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_body", msg)
            };
            return ApiError { close: true, ..e }.into_response();
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

type RawBody = Result<Bytes, BytesRejection>;

fn body_bytes(raw: RawBody) -> Result<Bytes, ApiError> {
    raw.map_err(|rej| {
        ApiError::new(rej.status(), "invalid_request_error", "invalid_body", format!("cannot read the body: {rej}"))
    })
}

/// The generation endpoints.
#[derive(Clone, Copy)]
enum Endpoint {
    Chat,
    Completions,
    Responses,
    Messages,
}

async fn chat(State(st): State<Shared>, Extension(info): Extension<Arc<RequestInfo>>, body: RawBody) -> Response {
    generation(st, info, body, Endpoint::Chat).await
}

async fn completions(
    State(st): State<Shared>,
    Extension(info): Extension<Arc<RequestInfo>>,
    body: RawBody,
) -> Response {
    generation(st, info, body, Endpoint::Completions).await
}

async fn responses(State(st): State<Shared>, Extension(info): Extension<Arc<RequestInfo>>, body: RawBody) -> Response {
    generation(st, info, body, Endpoint::Responses).await
}

async fn messages(State(st): State<Shared>, Extension(info): Extension<Arc<RequestInfo>>, body: RawBody) -> Response {
    generation(st, info, body, Endpoint::Messages).await
}

/// The job of a request to `ep`, and how to write its reply.
fn prepare(
    ready: &Ready,
    body: &[u8],
    ep: Endpoint,
) -> Result<(api::Job, Box<dyn generate::Writer>, &'static str), ApiError> {
    let b = api::Body::parse(body)?;
    Ok(match ep {
        Endpoint::Chat => {
            api::check_fields(&b, api::CHAT_FIELDS)?;
            let job = api::chat_job(ready, &b, &api::ChatExtras::default())?;
            (job, Box::new(openai::ChatWriter::default()), "chatcmpl-")
        }
        Endpoint::Completions => {
            api::check_fields(&b, api::COMPLETION_FIELDS)?;
            (api::completion_job(ready, &b)?, Box::new(openai::CompletionWriter::default()), "cmpl-")
        }
        Endpoint::Responses => {
            api::check_model(ready, b.str("model")?)?;
            let chat = responses::to_chat(&b)?;
            let job = api::chat_job(ready, &chat, &api::ChatExtras::default())?;
            (job, Box::new(responses::ResponsesWriter::new(responses::Echo::of(&b))), "resp_")
        }
        Endpoint::Messages => {
            let (chat, extras) = anthropic::to_chat(&b, false)?;
            (api::chat_job(ready, &chat, &extras)?, Box::new(anthropic::MessagesWriter::default()), "msg_")
        }
    })
}

/// Validate, render and tokenise on the pool, then generate.
async fn generation(st: Shared, info: Arc<RequestInfo>, body: RawBody, ep: Endpoint) -> Response {
    let r = async {
        st.accepting()?;
        st.ready()?;
        let body = body_bytes(body)?;
        let (mut job, writer, prefix) = st.prep.run(&st, body.len(), move |ready| prepare(ready, &body, ep)).await?;
        let ready = st.ready()?;
        grammar::attach(ready, &mut job).await?;
        generate::respond(&st, ready, job, info, writer, prefix).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as generation would render it.
async fn count_tokens(State(st): State<Shared>, body: RawBody) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(body)?;
    let n = st
        .prep
        .run(&st, body.len(), move |ready| {
            let (chat, _) = anthropic::to_chat(&api::Body::parse(&body)?, true)?;
            api::tokenize(ready, &chat).map(|t| t.len())
        })
        .await?;
    Ok(Json(json!({"input_tokens": n})))
}

fn model_card(st: &AppState, name: &str) -> Value {
    json!({"id": name, "object": "model", "created": st.created, "owned_by": "tern", "max_model_len": st.opts.ctx_size})
}

async fn models(State(st): State<Shared>) -> Result<Json<Value>, ApiError> {
    let ready = st.ready()?;
    Ok(Json(json!({"object": "list", "data": [model_card(&st, &ready.name)]})))
}

async fn model(State(st): State<Shared>, id: Result<Path<String>, PathRejection>) -> Result<Json<Value>, ApiError> {
    let Path(id) = id.map_err(|rej| ApiError {
        status: rej.status(),
        ..ApiError::invalid("model", format!("invalid model id in the path: {rej}"))
    })?;
    let ready = st.ready()?;
    api::check_model(ready, Some(&id))?;
    Ok(Json(model_card(&st, &ready.name)))
}

async fn health(State(st): State<Shared>) -> Response {
    let status = match st.ready.get() {
        None => "loading",
        Some(r) if !r.engine.is_running() => "engine_stopped",
        Some(_) if *st.phase.borrow() != Phase::Serving => "shutting_down",
        Some(r) => {
            // Requests waiting for their grammar to compile (they count against --max-queue).
            let (waiting, running) = r.compiler.as_ref().map_or((0, 0), grammar::Compiler::load);
            let compiles = json!({"waiting": waiting, "running": running});
            return Json(json!({"status": "ok", "grammar_compiles": compiles})).into_response();
        }
    };
    (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": status}))).into_response()
}

async fn tokenize(State(st): State<Shared>, body: RawBody) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(body)?;
    let tokens = st.prep.run(&st, body.len(), move |ready| api::tokenize(ready, &api::Body::parse(&body)?)).await?;
    Ok(Json(json!({"count": tokens.len(), "max_model_len": st.opts.ctx_size, "tokens": tokens})))
}

async fn detokenize(State(st): State<Shared>, body: RawBody) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(body)?;
    let text = st.prep.run(&st, body.len(), move |ready| api::detokenize(ready, &api::Body::parse(&body)?)).await?;
    Ok(Json(json!({"prompt": text})))
}

async fn metrics(State(st): State<Shared>) -> Response {
    let mut out = String::new();
    let mut histograms = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        out.push_str(&format!("# HELP tern_{name} {help}\n# TYPE tern_{name} {kind}\ntern_{name} {value}\n"));
    };
    let running = st.ready.get().is_some_and(|r| r.engine.is_running());
    metric("ready", "gauge", "1 once the model is loaded and while the engine runs", running as u8 as f64);
    metric("engine_running", "gauge", "0 once the engine's scheduler has stopped (restart the server)", {
        st.ready.get().is_none_or(|r| r.engine.is_running()) as u8 as f64
    });
    metric("shutting_down", "gauge", "1 once shutdown has begun", (*st.phase.borrow() != Phase::Serving) as u8 as f64);
    let c = &st.conns;
    metric("connections_open", "gauge", "open HTTP connections", c.open.load(Ordering::Relaxed) as f64);
    metric(
        "connections_refused_total",
        "counter",
        "connections refused over --max-connections",
        c.refused.load(Ordering::Relaxed) as f64,
    );
    metric(
        "connections_header_timeout_total",
        "counter",
        "connections closed by --header-timeout",
        c.header_timeouts.load(Ordering::Relaxed) as f64,
    );
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
        histograms.push_str(
            "# HELP tern_time_to_first_token_seconds time from a request's arrival at the engine to its first token\n\
             # TYPE tern_time_to_first_token_seconds histogram\n",
        );
        let mut below = 0.0;
        for (le, n) in tern_engine::engine::TTFT_BUCKETS.iter().zip(&s.ttft_buckets) {
            below += get(n);
            histograms.push_str(&format!("tern_time_to_first_token_seconds_bucket{{le=\"{le}\"}} {below}\n"));
        }
        histograms.push_str(&format!(
            "tern_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {ttft_n}\ntern_time_to_first_token_seconds_sum {}\n\
             tern_time_to_first_token_seconds_count {ttft_n}\n",
            get(&s.ttft_us) / 1e6
        ));
        let tps = if decode_s > 0.0 { (completion - ttft_n).max(0.0) / decode_s } else { 0.0 };
        metric("decode_tokens_per_second", "gauge", "tokens per second of one sequence after its first", tps);
        metric("queue_depth", "gauge", "requests waiting for a slot", s.waiting.load(Ordering::Relaxed) as f64);
        for (name, kind, help, value) in ready.compiler.as_ref().map(grammar::Compiler::metrics).unwrap_or_default() {
            metric(name, kind, help, value);
        }
        metric("constraint_masks_total", "counter", "token masks computed for constrained requests", get(&s.masks));
        metric(
            "constraint_mask_seconds_total",
            "counter",
            "time the mask workers spent computing masks",
            get(&s.mask_us) / 1e6,
        );
        metric(
            "constraint_mask_wait_seconds_total",
            "counter",
            "time steps waited for a mask (the part not hidden behind the forward pass)",
            get(&s.mask_wait_us) / 1e6,
        );
        metric("engine_steps_total", "counter", "backend steps run", get(&s.steps));
        metric(
            "engine_step_tokens_total",
            "counter",
            "tokens the steps read (decodes and prompt chunks)",
            get(&s.step_tokens),
        );
        metric("engine_step_seconds_total", "counter", "time the backend spent in steps", get(&s.step_us) / 1e6);
        metric(
            "engine_apply_seconds_total",
            "counter",
            "time between steps applying their results (prefix-cache snapshots included)",
            get(&s.apply_us) / 1e6,
        );
        metric(
            "speculative_verifies_total",
            "counter",
            "speculative decoding: steps that checked drafts",
            get(&s.spec_verifies),
        );
        metric("speculative_drafts_total", "counter", "speculative decoding: drafts checked", get(&s.spec_drafts));
        metric("speculative_accepted_total", "counter", "speculative decoding: drafts accepted", get(&s.spec_accepted));
        metric("requests_running", "gauge", "requests being decoded", s.active.load(Ordering::Relaxed) as f64);
        let (entries, bytes) =
            (s.prefix_cache_entries.load(Ordering::Relaxed), s.prefix_cache_bytes.load(Ordering::Relaxed));
        metric("prefix_cache_entries", "gauge", "sequence snapshots the prefix cache holds", entries as f64);
        metric("prefix_cache_bytes", "gauge", "backend state bytes the prefix cache holds (bounded)", bytes as f64);
        if s.state_memory_known.load(Ordering::Relaxed) {
            let used = s.state_memory_bytes.load(Ordering::Relaxed) as f64;
            let help = "bytes of sequence state held: running sequences and prefix-cache snapshots (CUDA: the state \
                        pool's pages in use, freed ranges kept for reuse included)";
            metric("state_memory_bytes", "gauge", help, used);
            let limit = s.state_memory_limit.load(Ordering::Relaxed);
            if limit != usize::MAX {
                let help = "bytes of sequence state the backend may hold (CUDA: --state-mib)";
                metric("state_memory_limit_bytes", "gauge", help, limit as f64);
            }
        }
    }
    out.push_str(&histograms);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
