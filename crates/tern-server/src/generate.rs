//! Running a job on the engine and writing its output as an OpenAI response: one JSON body, or SSE chunks.
//!
//! A response starts only once the engine has sent its first event: until then, a shutdown (the request is
//! still queued or reading its prompt) or a stopped engine is an HTTP status. At shutdown, requests without a
//! token yet are answered 503 at once; the others run on until the grace is over, and are then cut with a
//! `finish_reason: "length"` chunk (and `[DONE]`), or a reply of the text so far.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use tern_engine::{Event, FinishReason, TokenLogprob, Usage};
use tern_text::{OutputParser, ParseEvent, Tokenizer, ToolCall};
use tokio::sync::{mpsc, watch};

use crate::api::{self, ApiError, Job};
use crate::reqlog::RequestInfo;
use crate::{unix_time, Phase, Ready, Shared};

const ENGINE_GONE: &str = "the engine stopped before the request finished";

/// Submit `job` and answer with its output.
pub(crate) async fn respond(st: &Shared, r: &Ready, job: Job, info: Arc<RequestInfo>) -> Result<Response, ApiError> {
    st.accepting()?;
    let want_logprobs = job.request.logprobs.is_some();
    let prompt_tokens = job.request.prompt.len();
    let rx = r.engine.submit(job.request).map_err(|e| api::submit_error(e, &r.engine.config, &job.prompt_param))?;
    let events = forward(rx)?;
    let chat = job.chat.is_some();
    let mut turn = Turn {
        id: new_id(if chat { "chatcmpl" } else { "cmpl" }),
        created: unix_time(),
        model: r.name.clone(),
        chat,
        offered: job.chat.as_ref().map_or(vec![], |c| c.tools.iter().map(|t| t["function"]["name"].clone()).collect()),
        parser: job.chat.as_ref().map(|c| OutputParser::new(&c.tools, c.thinking)),
        tokenizer: r.tokenizer.clone(),
        logprobs: want_logprobs.then(Vec::new),
        calls: 0,
        include_usage: job.include_usage,
        prompt_tokens,
        tokens: 0,
        info,
    };
    if let (Some(p), Some(c)) = (&mut turn.parser, &job.chat) {
        p.feed(&c.prefix); // the forced opening of a tool call: yields nothing yet
    }
    let phase = st.phase.clone();
    if job.stream {
        stream(turn, events, phase).await
    } else {
        collect(turn, events, phase).await
    }
}

/// What a wait for the next engine event gave.
enum Next {
    Event(Option<Event>),
    /// Shutdown: it has begun (a request with no token yet) or the grace is over (one generating).
    Shutdown,
}

async fn next(events: &mut mpsc::Receiver<Event>, phase: &mut watch::Receiver<Phase>, started: bool) -> Next {
    let stop = if started { Phase::Cut } else { Phase::Draining };
    tokio::select! {
        ev = events.recv() => Next::Event(ev),
        _ = phase.wait_for(|p| *p >= stop) => Next::Shutdown,
    }
}

/// The 503 of a request that had not started when shutdown began.
fn not_started() -> ApiError {
    ApiError::unavailable("shutting_down", "the server is shutting down; the request was not started", 1)
}

/// Forward the engine's events into a tokio channel from a thread of its own; when the channel's receiver is
/// gone (the client went away), the thread ends and drops the engine's receiver, which cancels the request. While
/// no event comes (a request still queued or reading its prompt) the thread looks for a gone client every 50 ms,
/// so a queued request whose client left leaves the queue at once instead of at its first token.
fn forward(rx: tern_engine::Events) -> Result<mpsc::Receiver<Event>, ApiError> {
    let (tx, out) = mpsc::channel(64);
    std::thread::Builder::new()
        .name("tern-forward".into())
        .spawn(move || loop {
            match rx.recv_timeout(std::time::Duration::from_millis(50)) {
                Ok(ev) => {
                    if tx.blocking_send(ev).is_err() {
                        break;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !tx.is_closed() => {}
                Err(_) => break,
            }
        })
        .map_err(|e| ApiError::internal(format!("cannot start a thread: {e}")))?;
    Ok(out)
}

fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}-{nanos:x}{:04x}", N.fetch_add(1, Ordering::Relaxed) & 0xffff)
}

/// One piece of output.
enum Piece {
    Reasoning(String),
    Content(String),
    Call(ToolCall),
}

/// The output state of one request.
struct Turn {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    /// `None` for /v1/completions.
    parser: Option<OutputParser>,
    /// Names of the tools whose calls are returned as tool calls.
    offered: Vec<Value>,
    tokenizer: Arc<Tokenizer>,
    /// Log-probabilities not yet sent (`None`: not requested).
    logprobs: Option<Vec<TokenLogprob>>,
    calls: usize,
    include_usage: bool,
    prompt_tokens: usize,
    /// Tokens received so far.
    tokens: usize,
    info: Arc<RequestInfo>,
}

/// What an event ended with.
enum End {
    Done(FinishReason, Usage),
    Error(String),
}

impl End {
    /// The end of a request cut at shutdown: "length" (the reply is cut short), with the tokens counted so far.
    fn cut(turn: &mut Turn) -> (Vec<Piece>, End) {
        let usage = Usage { prompt_tokens: turn.prompt_tokens, completion_tokens: turn.tokens, cached_tokens: 0 };
        turn.info.tokens(usage.prompt_tokens, usage.completion_tokens);
        (turn.pieces("", true), End::Done(FinishReason::Length, usage))
    }
}

impl Turn {
    /// The pieces an engine event completes, and the end if it is the last one.
    fn on_event(&mut self, ev: Option<Event>) -> (Vec<Piece>, Option<End>) {
        match ev {
            Some(Event::Token { text, logprob, .. }) => {
                self.tokens += 1;
                if let (Some(all), Some(lp)) = (&mut self.logprobs, logprob) {
                    all.push(lp);
                }
                (self.pieces(&text, false), None)
            }
            Some(Event::Done { finish, usage }) => {
                self.info.tokens(usage.prompt_tokens, usage.completion_tokens);
                (self.pieces("", true), Some(End::Done(finish, usage)))
            }
            Some(Event::Error(e)) => (vec![], Some(End::Error(e))),
            None => (vec![], Some(End::Error(ENGINE_GONE.into()))),
        }
    }

    fn pieces(&mut self, text: &str, last: bool) -> Vec<Piece> {
        let Some(parser) = &mut self.parser else {
            return if text.is_empty() { vec![] } else { vec![Piece::Content(text.into())] };
        };
        let mut events = parser.feed(text);
        if last {
            events.extend(parser.finish());
        }
        events
            .into_iter()
            .map(|e| match e {
                ParseEvent::Reasoning(s) => Piece::Reasoning(s),
                ParseEvent::Content(s) => Piece::Content(s),
                ParseEvent::ToolCall(c) if self.offered.iter().any(|n| n == c.name.as_str()) => Piece::Call(c),
                ParseEvent::ToolCall(c) => Piece::Content(tool_call_text(&c)),
            })
            .collect()
    }

    fn finish_reason(&self, finish: FinishReason) -> &'static str {
        match finish {
            FinishReason::Stop if self.calls > 0 => "tool_calls",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }

    fn call_json(&mut self, c: ToolCall) -> Value {
        self.calls += 1;
        json!({"index": self.calls - 1, "id": new_id("call"), "type": "function",
               "function": {"name": c.name, "arguments": c.arguments}})
    }

    /// The pending log-probabilities in the endpoint's format (`null` when not requested).
    fn take_logprobs(&mut self) -> Value {
        let lps = match &mut self.logprobs {
            Some(all) if !all.is_empty() => std::mem::take(all),
            _ => return Value::Null,
        };
        let text = |id: u32| {
            let bytes = self.tokenizer.token_bytes(id).unwrap_or_default();
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        if self.chat {
            let entry = |id: u32, lp: f32| {
                let (token, bytes) = text(id);
                json!({"token": token, "logprob": lp, "bytes": bytes})
            };
            let content: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let mut e = entry(l.token, l.logprob);
                    e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                    e
                })
                .collect();
            json!({"content": content})
        } else {
            let tokens: Vec<String> = lps.iter().map(|l| text(l.token).0).collect();
            let token_logprobs: Vec<f32> = lps.iter().map(|l| l.logprob).collect();
            let top: Vec<Value> = lps
                .iter()
                .map(|l| Value::Object(l.top.iter().map(|&(id, lp)| (text(id).0, json!(lp))).collect()))
                .collect();
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top})
        }
    }

    fn usage(&self, u: Usage) -> Value {
        json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
               "total_tokens": u.prompt_tokens + u.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
    }

    /// One SSE event: a chunk whose choice carries `delta` (chat) or `text` (completions).
    fn chunk(&mut self, delta: Value, finish: Option<&str>) -> String {
        let logprobs = self.take_logprobs();
        let choice = if self.chat {
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish})
        };
        let object = if self.chat { "chat.completion.chunk" } else { "text_completion" };
        let mut c = json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
                           "choices": [choice]});
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        sse(&c)
    }

    fn piece_chunk(&mut self, p: Piece) -> String {
        let delta = match (p, self.chat) {
            (Piece::Content(s), false) => Value::String(s),
            (Piece::Content(s), true) => json!({"content": s}),
            (Piece::Reasoning(s), _) => json!({"reasoning_content": s, "reasoning": s}),
            (Piece::Call(c), _) => json!({"tool_calls": [self.call_json(c)]}),
        };
        self.chunk(delta, None)
    }

    /// The chunks after the last piece: the finish reason, the usage if asked for, `[DONE]`.
    fn end_chunks(&mut self, end: End) -> String {
        let mut out = match end {
            End::Done(finish, usage) => {
                let reason = self.finish_reason(finish);
                self.info.end(reason);
                let mut out = self.chunk(if self.chat { json!({}) } else { json!("") }, Some(reason));
                if self.include_usage {
                    let object = if self.chat { "chat.completion.chunk" } else { "text_completion" };
                    out += &sse(&json!({"id": self.id, "object": object, "created": self.created,
                                        "model": self.model, "choices": [], "usage": self.usage(usage)}));
                }
                out
            }
            End::Error(e) => {
                self.info.end(format!("error in the stream: {}", api::clip(&e)));
                sse(&ApiError::internal(e).json())
            }
        };
        out.push_str("data: [DONE]\n\n");
        out
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// A call to a function that was not offered, as the model wrote it.
fn tool_call_text(c: &ToolCall) -> String {
    let mut s = format!("<tool_call>\n<function={}>\n", c.name);
    if let Ok(Value::Object(args)) = serde_json::from_str::<Value>(&c.arguments) {
        for (k, v) in args {
            let v = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
        }
    }
    s + "</function>\n</tool_call>"
}

/// An SSE response, started once the first event is there; the body owns the event receiver, so a dropped
/// connection cancels the request.
async fn stream(
    mut turn: Turn,
    mut events: mpsc::Receiver<Event>,
    mut phase: watch::Receiver<Phase>,
) -> Result<Response, ApiError> {
    let first = match next(&mut events, &mut phase, false).await {
        Next::Shutdown => return Err(not_started()),
        Next::Event(Some(Event::Error(e))) => return Err(ApiError::internal(e)),
        Next::Event(None) => return Err(ApiError::internal(ENGINE_GONE)),
        Next::Event(Some(ev)) => ev,
    };
    let head = turn.chat.then(|| turn.chunk(json!({"role": "assistant", "content": ""}), None));
    let rest = stream::unfold(Some((turn, events, phase, Some(first))), |state| async move {
        let (mut turn, mut events, mut phase, mut pending) = state?;
        loop {
            let ev = match pending.take() {
                Some(ev) => Next::Event(Some(ev)),
                None => next(&mut events, &mut phase, true).await,
            };
            let cut = matches!(ev, Next::Shutdown);
            let (pieces, end) = match ev {
                Next::Event(ev) => turn.on_event(ev),
                Next::Shutdown => {
                    let (pieces, end) = End::cut(&mut turn);
                    (pieces, Some(end))
                }
            };
            let mut out: String = pieces.into_iter().map(|p| turn.piece_chunk(p)).collect();
            if let Some(end) = end {
                out += &turn.end_chunks(end);
                if cut {
                    turn.info.end("cut_at_shutdown");
                }
                return Some((out, None));
            }
            if !out.is_empty() {
                return Some((out, Some((turn, events, phase, None))));
            }
        }
    });
    let body = stream::iter(head).chain(rest).map(Ok::<_, std::convert::Infallible>);
    Ok(([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body))
        .into_response())
}

/// A non-streaming response, awaited in the handler (dropped with it when the client goes away).
async fn collect(
    mut turn: Turn,
    mut events: mpsc::Receiver<Event>,
    mut phase: watch::Receiver<Phase>,
) -> Result<Response, ApiError> {
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    let mut cut = false;
    let (finish, usage) = loop {
        let (pieces, end) = match next(&mut events, &mut phase, turn.tokens > 0).await {
            Next::Shutdown if turn.tokens == 0 => return Err(not_started()),
            Next::Shutdown => {
                cut = true;
                let (pieces, end) = End::cut(&mut turn);
                (pieces, Some(end))
            }
            Next::Event(ev) => turn.on_event(ev),
        };
        for p in pieces {
            match p {
                Piece::Reasoning(s) => reasoning += &s,
                Piece::Content(s) => content += &s,
                Piece::Call(c) => calls.push(turn.call_json(c)),
            }
        }
        match end {
            Some(End::Done(finish, usage)) => break (finish, usage),
            Some(End::Error(e)) => return Err(ApiError::internal(e)),
            None => {}
        }
    };
    let reason = turn.finish_reason(finish);
    turn.info.end(if cut { "cut_at_shutdown" } else { reason });
    let logprobs = turn.take_logprobs();
    let choice = if turn.chat {
        let reasoning = (!reasoning.is_empty()).then_some(reasoning);
        let mut message = json!({"role": "assistant", "content": content,
                                 "reasoning_content": reasoning, "reasoning": reasoning});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
            if content.is_empty() {
                message["content"] = Value::Null;
            }
        }
        json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason})
    } else {
        json!({"index": 0, "text": content, "logprobs": logprobs, "finish_reason": reason})
    };
    let object = if turn.chat { "chat.completion" } else { "text_completion" };
    Ok(Json(json!({"id": turn.id, "object": object, "created": turn.created, "model": turn.model,
                   "choices": [choice], "usage": turn.usage(usage)}))
    .into_response())
}
