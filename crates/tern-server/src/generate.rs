//! Running a job on the engine and writing its output in one API's shape ([`Writer`]: OpenAI chat and
//! completions, Anthropic messages, OpenAI responses): one JSON body, or a stream of SSE events.
//!
//! A job is one engine request per choice (`n`, or a list of prompts); their events are merged here and turned
//! into [`Piece`]s (reasoning, content, tool-call starts, argument pieces and ends) by each choice's output
//! parser. A response starts only once the engine has sent a first event: until then, a shutdown (the request
//! is still queued or reading its prompt) or a stopped engine is an HTTP status. At shutdown, requests without a
//! token yet are answered 503 at once; the others run on until the grace is over, and are then cut (every choice
//! still running ends with "length"), as a last event or a body of the text so far.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::Value;
use tern_engine::{Event, FinishReason, TokenLogprob, Usage};
use tern_text::{OutputParser, ParseEvent, THINK_END_ID};
use tokio::sync::{mpsc, watch};

use crate::api::{self, ApiError, Job};
use crate::reqlog::RequestInfo;
use crate::{unix_time, Phase, Ready, Shared};

const ENGINE_GONE: &str = "the engine stopped before the request finished";

/// One piece of a choice's output.
#[derive(Clone, Debug)]
pub(crate) enum Piece {
    Reasoning(String),
    Content(String),
    /// A tool call begins: its index among the choice's calls, its id and the function's name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments (the pieces concatenate to a JSON object).
    CallArgs {
        index: usize,
        args: String,
    },
    CallEnd,
}

/// How a choice ended.
#[derive(Clone, Debug)]
pub(crate) struct ChoiceEnd {
    pub finish: FinishReason,
    /// The stop string that ended it.
    pub stop_string: Option<String>,
    /// Tool calls it made.
    pub calls: usize,
    pub usage: Usage,
    /// Of `usage.completion_tokens`, those of the reasoning (up to and including `</think>`).
    pub reasoning_tokens: usize,
}

impl ChoiceEnd {
    /// OpenAI's finish reason.
    pub fn openai_reason(&self) -> &'static str {
        match self.finish {
            FinishReason::Stop if self.calls > 0 => "tool_calls",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Request-wide facts for writers.
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
    pub prompt_tokens: usize,
    pub include_usage: bool,
    pub choices: usize,
    /// Per choice: the text shown before its output (completions with `echo`).
    pub echo: Vec<String>,
    pub tokenizer: Arc<tern_text::Tokenizer>,
    /// Log-probabilities were asked for.
    pub logprobs: bool,
}

/// A tool call as collected for a body.
#[derive(Clone, Debug, Default)]
pub(crate) struct CallOut {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// Everything one choice produced, for a body.
#[derive(Default)]
pub(crate) struct Collected {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<CallOut>,
    pub logprobs: Vec<TokenLogprob>,
    pub end: Option<ChoiceEnd>,
    /// The order pieces came in: reasoning, content and calls interleaved (for APIs that keep it).
    pub order: Vec<Piece>,
}

/// An API's output shape.
pub(crate) trait Writer: Send + Sync + 'static {
    /// The SSE text that opens a stream.
    fn open(&mut self, m: &Meta) -> String;
    /// One piece of choice `i`, with the log-probabilities of the tokens that completed it.
    fn piece(&mut self, m: &Meta, i: usize, p: &Piece, lps: Vec<TokenLogprob>) -> String;
    /// Choice `i` ended (with the log-probabilities still pending).
    fn choice_end(&mut self, m: &Meta, i: usize, end: &ChoiceEnd, lps: Vec<TokenLogprob>) -> String;
    /// Every choice ended: the closing events.
    fn close(&mut self, m: &Meta, usage: &Usage) -> String;
    /// An error ended the stream: the closing events.
    fn error(&mut self, m: &Meta, message: &str) -> String;
    /// The whole reply as one body.
    fn body(&self, m: &Meta, choices: &[Collected], usage: &Usage) -> Value;
    /// How a choice ended, for the request log.
    fn reason(&self, end: &ChoiceEnd) -> String {
        end.openai_reason().to_owned()
    }
}

/// The system fingerprint of this server's replies: its version and backend.
pub(crate) fn fingerprint(r: &Ready) -> String {
    format!("tern-{}-{}", env!("CARGO_PKG_VERSION"), r.engine_backend)
}

/// Submit `job` and answer with its output in `writer`'s shape; `id_prefix` starts the response id.
pub(crate) async fn respond(
    st: &Shared,
    r: &Ready,
    job: Job,
    info: Arc<RequestInfo>,
    writer: Box<dyn Writer>,
    id_prefix: &str,
) -> Result<Response, ApiError> {
    st.accepting()?;
    let logprobs = job.requests.iter().any(|q| q.logprobs.is_some());
    let (tx, events) = mpsc::channel(64);
    let mut receivers = Vec::with_capacity(job.requests.len());
    for q in job.requests {
        // A refusal drops the receivers submitted before it, which cancels them.
        receivers.push(r.engine.submit(q).map_err(|e| api::submit_error(e, &r.engine.config, &job.prompt_param))?);
    }
    let n = receivers.len();
    for (i, rx) in receivers.into_iter().enumerate() {
        forward(i, rx, tx.clone())?;
    }
    drop(tx);
    let meta = Meta {
        id: new_id(id_prefix),
        created: unix_time(),
        model: r.name.clone(),
        fingerprint: fingerprint(r),
        prompt_tokens: job.prompt_tokens,
        include_usage: job.include_usage,
        choices: n,
        echo: job.echo,
        tokenizer: r.tokenizer.clone(),
        logprobs,
    };
    let choices = (0..n)
        .map(|_| Choice {
            parser: job.chat.as_ref().map(|c| OutputParser::new(&c.tools, c.thinking).only_offered()),
            logprobs: Vec::new(),
            calls: 0,
            tokens: 0,
            thinking: job.chat.as_ref().is_some_and(|c| c.thinking),
            reasoning: 0,
            end: None,
        })
        .collect();
    let grammar = job.constraint.as_ref().map(|c| c.param);
    let run = Run { meta, choices, events, phase: st.phase.clone(), info, writer, open: n, grammar };
    if job.stream {
        stream(run).await
    } else {
        collect(run).await
    }
}

/// Forward the engine's events of choice `i` into the job's channel from a thread of its own; when the channel's
/// receiver is gone (the client went away), the thread ends and drops the engine's receiver, which cancels the
/// request. While no event comes (a request still queued or reading its prompt) the thread looks for a gone
/// client every 50 ms, so a queued request whose client left leaves the queue at once instead of at its first
/// token.
fn forward(i: usize, rx: tern_engine::Events, tx: mpsc::Sender<(usize, Event)>) -> Result<(), ApiError> {
    std::thread::Builder::new()
        .name("tern-forward".into())
        .spawn(move || loop {
            match rx.recv_timeout(std::time::Duration::from_millis(50)) {
                Ok(ev) => {
                    if tx.blocking_send((i, ev)).is_err() {
                        break;
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !tx.is_closed() => {}
                Err(_) => break,
            }
        })
        .map_err(|e| ApiError::internal(format!("cannot start a thread: {e}")))?;
    Ok(())
}

pub(crate) fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}{nanos:x}{:04x}", N.fetch_add(1, Ordering::Relaxed) & 0xffff)
}

/// The output state of one choice.
struct Choice {
    /// `None` for /v1/completions.
    parser: Option<OutputParser>,
    /// Log-probabilities not yet sent.
    logprobs: Vec<TokenLogprob>,
    calls: usize,
    tokens: usize,
    /// Still in the reasoning (a thinking reply until its `</think>`).
    thinking: bool,
    /// Tokens of the reasoning.
    reasoning: usize,
    end: Option<ChoiceEnd>,
}

/// What the merged events give.
enum Out {
    Piece(usize, Piece, Vec<TokenLogprob>),
    End(usize, ChoiceEnd, Vec<TokenLogprob>),
    Error(String),
}

/// One job's run.
struct Run {
    meta: Meta,
    choices: Vec<Choice>,
    events: mpsc::Receiver<(usize, Event)>,
    phase: watch::Receiver<Phase>,
    info: Arc<RequestInfo>,
    writer: Box<dyn Writer>,
    /// Choices still running.
    open: usize,
    /// The field of the request's grammar, if it has one (errors of the grammar name it).
    grammar: Option<&'static str>,
}

/// An error event before the response has started: the request's grammar failing while decoding (no token can
/// continue it, too many parser items) is the client's 400 naming its field; anything else is the server's 500.
fn event_error(e: String, grammar: Option<&'static str>) -> ApiError {
    // (The engine's words for a failed mask; tern-text's say what failed.)
    match (grammar, e.strip_prefix("the output constraint failed: ")) {
        (Some(param), Some(why)) => {
            if why.contains("internal error") {
                eprintln!("tern: the {param} of a request failed while generating: {}", api::clip(why));
            }
            ApiError { code: Some("grammar_failed"), ..ApiError::invalid(param, why) }
        }
        _ => ApiError::internal(e),
    }
}

/// What a wait for the next engine event gave.
enum Next {
    Event(Option<(usize, Event)>),
    /// Shutdown: it has begun (a request with no token yet) or the grace is over (one generating).
    Shutdown,
}

/// The 503 of a request that had not started when shutdown began.
fn not_started() -> ApiError {
    ApiError::unavailable("shutting_down", "the server is shutting down; the request was not started", 1)
}

impl Run {
    async fn next(&mut self, started: bool) -> Next {
        let stop = if started { Phase::Cut } else { Phase::Draining };
        tokio::select! {
            ev = self.events.recv() => Next::Event(ev),
            _ = self.phase.wait_for(|p| *p >= stop) => Next::Shutdown,
        }
    }

    fn tokens(&self) -> usize {
        self.choices.iter().map(|c| c.tokens).sum()
    }

    /// What an event (`None`: every forwarding thread is gone) completes.
    fn on_event(&mut self, ev: Option<(usize, Event)>) -> Vec<Out> {
        let Some((i, ev)) = ev else { return vec![Out::Error(ENGINE_GONE.into())] };
        let Some(c) = self.choices.get_mut(i) else { return vec![] };
        match ev {
            Event::Token { token, text, logprob } => {
                c.tokens += 1;
                if c.thinking {
                    c.reasoning += 1;
                    c.thinking = token != THINK_END_ID;
                }
                self.info.token();
                if let Some(lp) = logprob {
                    c.logprobs.push(lp);
                }
                pieces(i, c, &text, false)
            }
            Event::Done { finish, usage, stop_string } => self.end_choice(i, finish, usage, stop_string),
            Event::Error(e) => vec![Out::Error(e)],
        }
    }

    fn end_choice(&mut self, i: usize, finish: FinishReason, usage: Usage, stop_string: Option<String>) -> Vec<Out> {
        let Some(c) = self.choices.get_mut(i) else { return vec![] };
        if c.end.is_some() {
            return vec![];
        }
        let mut out = pieces(i, c, "", true);
        let end = ChoiceEnd { finish, stop_string, calls: c.calls, usage, reasoning_tokens: c.reasoning };
        c.end = Some(end.clone());
        self.open -= 1;
        out.push(Out::End(i, end, std::mem::take(&mut c.logprobs)));
        out
    }

    /// Shutdown's cut: every running choice ends with "length", its tokens so far counted.
    fn cut(&mut self) -> Vec<Out> {
        let prompt = self.meta.prompt_tokens / self.choices.len().max(1);
        (0..self.choices.len())
            .flat_map(|i| {
                let usage =
                    Usage { prompt_tokens: prompt, completion_tokens: self.choices[i].tokens, cached_tokens: 0 };
                self.end_choice(i, FinishReason::Length, usage, None)
            })
            .collect()
    }

    fn usage(&self) -> Usage {
        let (completion, cached) = self
            .choices
            .iter()
            .filter_map(|c| c.end.as_ref())
            .fold((0, 0), |(a, b), e| (a + e.usage.completion_tokens, b + e.usage.cached_tokens));
        let completion = completion.max(self.tokens());
        Usage {
            prompt_tokens: self.meta.prompt_tokens,
            completion_tokens: completion,
            cached_tokens: cached.min(self.meta.prompt_tokens),
        }
    }

    /// The log line's tokens and end.
    fn log_end(&self, cut: bool) {
        let u = self.usage();
        self.info.tokens(u.prompt_tokens, u.completion_tokens);
        let first = self.choices.iter().find_map(|c| c.end.as_ref()).map(|e| self.writer.reason(e));
        self.info.end(if cut { "cut_at_shutdown".to_owned() } else { first.unwrap_or_else(|| "stop".into()) });
    }

    /// The SSE text of outputs.
    fn write(&mut self, outs: Vec<Out>) -> (String, bool) {
        let mut text = String::new();
        for o in outs {
            match o {
                Out::Piece(i, p, lps) => text += &self.writer.piece(&self.meta, i, &p, lps),
                Out::End(i, end, lps) => text += &self.writer.choice_end(&self.meta, i, &end, lps),
                Out::Error(e) => {
                    self.info.end(format!("error in the stream: {}", api::clip(&e)));
                    let u = self.usage();
                    self.info.tokens(u.prompt_tokens, u.completion_tokens);
                    text += &self.writer.error(&self.meta, &e);
                    return (text, true);
                }
            }
        }
        (text, false)
    }
}

/// The pieces `text` completes in choice `c` (`last`: its output is over).
fn pieces(i: usize, c: &mut Choice, text: &str, last: bool) -> Vec<Out> {
    let events = match &mut c.parser {
        None if text.is_empty() => vec![],
        None => vec![ParseEvent::Content(text.to_owned())],
        Some(p) => {
            let mut ev = p.feed(text);
            if last {
                ev.extend(p.finish());
            }
            ev
        }
    };
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        let piece = match e {
            ParseEvent::Reasoning(s) => Piece::Reasoning(s),
            ParseEvent::Content(s) => Piece::Content(s),
            ParseEvent::ToolCallStart { name } => {
                c.calls += 1;
                Piece::CallStart { index: c.calls - 1, id: new_id("call_"), name }
            }
            ParseEvent::ToolCallArgs(args) => Piece::CallArgs { index: c.calls.saturating_sub(1), args },
            ParseEvent::ToolCallEnd => Piece::CallEnd,
        };
        // The pending log-probabilities go with the first piece their tokens completed.
        out.push(Out::Piece(i, piece, std::mem::take(&mut c.logprobs)));
    }
    out
}

/// An SSE response, started once the first event is there; the body owns the event receiver, so a dropped
/// connection cancels the request.
async fn stream(mut run: Run) -> Result<Response, ApiError> {
    let first = match run.next(false).await {
        Next::Shutdown => return Err(not_started()),
        Next::Event(Some((_, Event::Error(e)))) => return Err(event_error(e, run.grammar)),
        Next::Event(None) => return Err(ApiError::internal(ENGINE_GONE)),
        Next::Event(Some(ev)) => ev,
    };
    let head = run.writer.open(&run.meta);
    let body = stream::unfold(Some((run, Some(first))), |state| async move {
        let (mut run, mut pending) = state?;
        loop {
            let ev = match pending.take() {
                Some(ev) => Next::Event(Some(ev)),
                None => run.next(true).await,
            };
            let cut = matches!(ev, Next::Shutdown);
            let outs = match ev {
                Next::Event(ev) => run.on_event(ev),
                Next::Shutdown => run.cut(),
            };
            let (mut text, failed) = run.write(outs);
            if failed {
                return Some((text, None));
            }
            if run.open == 0 {
                let usage = run.usage();
                text += &run.writer.close(&run.meta, &usage);
                run.log_end(cut);
                return Some((text, None));
            }
            if !text.is_empty() {
                return Some((text, Some((run, None))));
            }
        }
    });
    let body = stream::iter([head]).chain(body).map(Ok::<_, std::convert::Infallible>);
    Ok(([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body))
        .into_response())
}

/// A non-streaming response, awaited in the handler (dropped with it when the client goes away).
async fn collect(mut run: Run) -> Result<Response, ApiError> {
    let mut got: Vec<Collected> = (0..run.choices.len()).map(|_| Collected::default()).collect();
    let mut cut = false;
    while run.open > 0 {
        let outs = match run.next(run.tokens() > 0).await {
            Next::Shutdown if run.tokens() == 0 => return Err(not_started()),
            Next::Shutdown => {
                cut = true;
                run.cut()
            }
            Next::Event(ev) => run.on_event(ev),
        };
        for o in outs {
            match o {
                Out::Piece(i, p, lps) => {
                    let c = &mut got[i];
                    c.logprobs.extend(lps);
                    match &p {
                        Piece::Reasoning(s) => c.reasoning += s,
                        Piece::Content(s) => c.content += s,
                        Piece::CallStart { id, name, .. } => {
                            c.calls.push(CallOut { id: id.clone(), name: name.clone(), arguments: String::new() })
                        }
                        Piece::CallArgs { args, .. } => {
                            if let Some(call) = c.calls.last_mut() {
                                call.arguments += args;
                            }
                        }
                        Piece::CallEnd => {}
                    }
                    c.order.push(p);
                }
                Out::End(i, end, lps) => {
                    got[i].logprobs.extend(lps);
                    got[i].end = Some(end);
                }
                Out::Error(e) => return Err(event_error(e, run.grammar)),
            }
        }
    }
    run.log_end(cut);
    let usage = run.usage();
    Ok(Json(run.writer.body(&run.meta, &got, &usage)).into_response())
}

/// One SSE `data:` event.
pub(crate) fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// One SSE event with a name (`event: NAME`).
pub(crate) fn sse_named(name: &str, v: &Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}
