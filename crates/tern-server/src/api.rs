//! OpenAI request bodies: parsing and validation into engine requests, with OpenAI-shaped errors.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tern_engine::{EngineConfig, Request, SubmitError};
use tern_text::{ChatOptions, Rendered, Reply, SamplingParams, Spec, TOOL_CALL_END_ID};

use crate::grammar::{self, PendingConstraint};
use crate::images::{self, ImageBytes};
use crate::Ready;

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
    /// Seconds for a `Retry-After` header (503s the client should retry).
    pub retry_after: Option<u32>,
    /// Close the connection after this response (the client misbehaved, or its body was not read).
    pub close: bool,
}

/// How an error response is described in the request log (set on every [`ApiError`] response).
#[derive(Clone, Debug)]
pub(crate) struct ErrorTag(pub String);

/// At most this many characters of a client's value are echoed in an error message.
const ECHO_CHARS: usize = 64;

/// `s`, cut to [`ECHO_CHARS`] characters (with "..." when cut): client text quoted back in errors and logs.
pub(crate) fn clip(s: &str) -> String {
    match s.char_indices().nth(ECHO_CHARS) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

impl ApiError {
    /// 503: the server could not load constrained decoding (`why`), so no request with a grammar can run.
    pub(crate) fn constraints_unavailable(why: &str) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "constraints_unavailable",
            format!("constrained decoding is unavailable on this server: {why}"),
        )
    }

    pub fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            code: Some(code),
            param: None,
            message: message.into(),
            retry_after: None,
            close: false,
        }
    }

    /// 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: Some(param.into()),
            message: message.into(),
            retry_after: None,
            close: false,
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }

    /// 503 with `Retry-After: seconds`.
    pub fn unavailable(code: &'static str, message: impl Into<String>, retry_after: u32) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", code, message)
        }
    }

    pub fn json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let tag = match (&self.code, &self.param) {
            (Some(code), _) => format!("error {code}: {}", clip(&self.message)),
            (None, Some(param)) => format!("error param={param}: {}", clip(&self.message)),
            (None, None) => format!("error: {}", clip(&self.message)),
        };
        let mut res = (self.status, Json(self.json())).into_response();
        if let Some(s) = self.retry_after {
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.close {
            res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        res.extensions_mut().insert(ErrorTag(tag));
        res
    }
}

/// A refused submission as an OpenAI error; `prompt_param` names the prompt field (`messages` or `prompt`).
pub(crate) fn submit_error(e: SubmitError, cfg: &EngineConfig, prompt_param: &str) -> ApiError {
    let msg = e.to_string();
    match e {
        SubmitError::QueueFull { waiting } => ApiError::unavailable(
            "queue_full",
            format!(
                "the server is busy: every one of its {} slots is taken and {waiting} requests are waiting \
                 (--max-concurrent {}, --max-queue {}); retry later",
                cfg.max_concurrent, cfg.max_concurrent, cfg.max_queue
            ),
            1,
        ),
        SubmitError::TooLong { .. } => {
            ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(prompt_param, msg) }
        }
        SubmitError::EmptyPrompt | SubmitError::BadToken { .. } | SubmitError::BadImages(_) => {
            ApiError::invalid(prompt_param, msg)
        }
    }
}

/// A JSON object request body; `null` fields count as absent.
pub(crate) struct Body(pub Map<String, Value>);

impl Body {
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        match serde_json::from_slice(bytes) {
            Ok(Value::Object(map)) => Ok(Body(map)),
            Ok(_) => Err(ApiError::invalid("body", "the request body must be a JSON object")),
            Err(e) => {
                Err(ApiError { code: Some("invalid_json"), ..ApiError::invalid("body", format!("invalid JSON: {e}")) })
            }
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn num(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a number")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(key, format!("'{key}' must be between {lo} and {hi}, got {x}")));
        }
        Ok(Some(x))
    }

    /// An integer in `lo..=hi`. Integers past 64 bits (which JSON parsing reads as floats) and integral floats
    /// saturate to `i64`, so that they are refused or clamped with the others instead of reading as "not an
    /// integer".
    pub fn int(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let x = v
            .as_i64()
            .or_else(|| v.as_u64().map(|_| i64::MAX))
            .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be an integer")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(key, format!("'{key}' must be between {lo} and {hi}, got {v}")));
        }
        Ok(Some(x))
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a boolean"))))
            .transpose()
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a string"))))
            .transpose()
    }

    pub fn object(&self, key: &str) -> Result<Option<Body>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Body(m.clone()))),
            Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be an object"))),
        }
    }
}

/// A validated generation request and how to present its output.
pub(crate) struct Job {
    /// One engine request per choice (`n` per prompt, prompts in order).
    pub requests: Vec<Request>,
    /// Per choice: text shown before its output (the prompt, for /v1/completions with `echo`).
    pub echo: Vec<String>,
    /// Prompt tokens of the request (each distinct prompt once).
    pub prompt_tokens: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// `None` for /v1/completions (raw text out).
    pub chat: Option<ChatOutput>,
    /// The field holding the prompt (`messages` or `prompt`), for errors about it.
    pub prompt_param: String,
    /// The constraint of every request, checked, to compile before they are submitted (see [`grammar`]).
    pub constraint: Option<PendingConstraint>,
}

/// How chat output is parsed.
#[derive(Clone)]
pub(crate) struct ChatOutput {
    /// Tools whose calls are returned as `tool_calls` (others come back as content).
    pub tools: Vec<Value>,
    pub thinking: bool,
}

/// What a front end other than OpenAI's chat adds to a chat request.
#[derive(Default)]
pub(crate) struct ChatExtras {
    /// With thinking: force `</think>` after this many reasoning tokens (Anthropic's `budget_tokens`).
    pub reasoning_budget: Option<usize>,
    /// Stop strings validated by the front end under its own name and bounds (Anthropic's `stop_sequences`).
    pub stop_strings: Option<Vec<String>>,
}

/// 404 unless `model` is absent or names the served model.
pub(crate) fn check_model(r: &Ready, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != r.name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..ApiError::invalid(
                "model",
                format!("the model '{}' does not exist; this server serves '{}'", clip(m), r.name),
            )
        }),
        _ => Ok(()),
    }
}

/// Most entries of `logit_bias` (each is applied to every token's logits).
pub(crate) const MAX_LOGIT_BIAS: usize = 1024;
/// Most stop strings, and bytes in each (each is matched against the output at every token).
pub(crate) const MAX_STOP_STRINGS: usize = 16;
pub(crate) const MAX_STOP_BYTES: usize = 512;
/// Most of Anthropic's `stop_sequences` (Anthropic documents no limit; matching one costs a few compares of the
/// bytes held back at each token, so a few hundred stay cheap).
pub(crate) const MAX_STOP_SEQUENCES: usize = 256;
/// Most alternatives per token (`top_logprobs`, or `logprobs` of /v1/completions).
pub(crate) const MAX_LOGPROBS: i64 = 20;
/// Most choices of one prompt (`n`), and choices of one request in all (prompts × n).
pub(crate) const MAX_N: i64 = 16;
pub(crate) const MAX_CHOICES: usize = 64;

/// The fields of /v1/chat/completions: those tern implements, those it accepts and ignores (bookkeeping with
/// no effect on the reply), and those it refuses by name.
pub(crate) const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "grammar",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "reasoning_effort",
    "ignore_eos",
    "min_tokens",
];
pub(crate) const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "logit_bias",
    "echo",
    "best_of",
    "response_format",
    "grammar",
    "ignore_eos",
    "min_tokens",
];
/// Accepted everywhere and ignored: they describe the request, not the reply.
const BOOKKEEPING: &[&str] = &["user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "store"];
/// Known OpenAI fields tern does not implement, with what to use instead.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("functions", "use 'tools'"),
    ("function_call", "use 'tool_choice'"),
    ("suffix", "tern does not fill in the middle"),
    ("audio", "tern serves text only"),
    ("modalities", "tern serves text only"),
    ("prediction", "predicted outputs are not implemented"),
    ("web_search_options", "tern has no web search"),
    ("verbosity", "not implemented"),
];

/// A 400 naming the first field of `b` that is not in `known` (nor bookkeeping).
pub(crate) fn check_fields(b: &Body, known: &[&str]) -> Result<(), ApiError> {
    for key in b.0.keys() {
        if known.contains(&key.as_str()) || BOOKKEEPING.contains(&key.as_str()) {
            continue;
        }
        let msg = match UNSUPPORTED.iter().find(|(k, _)| k == key) {
            Some((_, why)) => format!("'{key}' is not supported ({why})"),
            None => format!("unknown field '{}': tern does not implement it", clip(key)),
        };
        return Err(ApiError { code: Some("unsupported_field"), ..ApiError::invalid(&clip(key), msg) });
    }
    if b.get("store").is_some_and(|s| s != &Value::Bool(false)) {
        return Err(ApiError::invalid("store", "tern is stateless: 'store' must be false or absent"));
    }
    Ok(())
}

/// The fields both endpoints share, validated before any prompt is rendered or tokenised (a bad field costs
/// nothing, however long the prompt).
struct Options {
    stream: bool,
    include_usage: bool,
    sampling: SamplingParams,
    stop_strings: Vec<String>,
    logprobs: Option<usize>,
    /// The requested completion length and the field it came from.
    max_tokens: Option<(usize, &'static str)>,
    n: usize,
    format: Format,
    /// vLLM's `ignore_eos`: the model's end-of-text ids do not end the reply (max_tokens or the context does).
    ignore_eos: bool,
    /// vLLM's `min_tokens`: no stop id or stop string ends the reply before this many tokens.
    min_tokens: usize,
}

pub(crate) fn chat_job(r: &Ready, b: &Body, extras: &ChatExtras) -> Result<Job, ApiError> {
    check_model(r, b.str("model")?)?;
    let logprobs = match (b.bool("logprobs")?, b.int("top_logprobs", 0, MAX_LOGPROBS)?) {
        (Some(true), k) => Some(k.unwrap_or(0) as usize),
        (_, Some(_)) => return Err(ApiError::invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")),
        _ => None,
    };
    // (max_output_tokens: the Responses API's, which reaches here under its own name)
    let max = match (b.get("max_completion_tokens"), b.get("max_output_tokens")) {
        (Some(_), _) => max_tokens(b, "max_completion_tokens")?,
        (None, Some(_)) => max_tokens(b, "max_output_tokens")?,
        (None, None) => max_tokens(b, "max_tokens")?,
    };
    let mut opts = options(r, b, logprobs, max)?;
    if let Some(stop) = &extras.stop_strings {
        opts.stop_strings = stop.clone();
    }
    let (rendered, chat, tools, pictures) = render_chat(r, b)?;
    let mut stop_ids = r.stop_ids.clone();
    if let Some(Forced { parallel: false, forced: false, .. }) = &tools {
        // parallel_tool_calls false: the reply ends with the first call.
        stop_ids.push(TOOL_CALL_END_ID);
    }
    let spec = match (tools, &opts.format) {
        (Some(Forced { tools, parallel, forced: true }), Format::Text) => Some(Owned::Tools(tools, parallel)),
        (Some(Forced { forced: true, .. }), _) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "a forced tool call ('required' or a named function) cannot be combined with a response_format or \
                 grammar",
            ))
        }
        _ => opts.format.spec(),
    };
    let reply =
        Reply { thinking: chat.thinking, reasoning_budget: extras.reasoning_budget, stop_ids: stop_ids.clone() };
    let needs = spec.is_some() || (chat.thinking && extras.reasoning_budget.is_some());
    let constraint = if needs { Some(constraint(r, spec.as_ref(), &reply)?) } else { None };
    opts.format = Format::Text;
    let prompt = encode_chat(r, &rendered, Fit::Reply, &pictures)?;
    let stop_ids = reply_stop_ids(r, &opts, stop_ids);
    let mut job = job(r, opts, vec![(prompt, String::new())], "messages", Some(chat), constraint, stop_ids)?;
    // Decoded once the prompt is known to fit (the costly part), here on the preparation pool.
    if let (Some(input), false) = (&r.images, pictures.is_empty()) {
        let decoded = images::decode_all(&pictures, input, &r.image_limits)?;
        for req in &mut job.requests {
            req.images = decoded.clone();
        }
    }
    Ok(job)
}

/// The ids that end a reply: without `ignore_eos` all of `stop_ids`, with it those that are not the model's
/// end-of-text ids (a reply limited to one tool call still ends after it).
fn reply_stop_ids(r: &Ready, o: &Options, mut stop_ids: Vec<u32>) -> Vec<u32> {
    if o.ignore_eos {
        stop_ids.retain(|id| !r.stop_ids.contains(id));
    }
    stop_ids
}

pub(crate) fn completion_job(r: &Ready, b: &Body) -> Result<Job, ApiError> {
    check_model(r, b.str("model")?)?;
    b.int("best_of", 1, 1).map_err(|_| ApiError::invalid("best_of", "only 'best_of': 1 is supported"))?;
    let echo = b.bool("echo")?.unwrap_or(false);
    let logprobs = b.int("logprobs", 0, MAX_LOGPROBS)?.map(|k| k as usize);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "'echo' with 'logprobs' is not supported (tern does not return log-probabilities of the prompt)",
        ));
    }
    let opts = options(r, b, logprobs, max_tokens(b, "max_tokens")?)?;
    let reply = Reply { thinking: false, reasoning_budget: None, stop_ids: r.stop_ids.clone() };
    let constraint = match opts.format.spec() {
        Some(spec) => Some(constraint(r, Some(&spec), &reply)?),
        None => None,
    };
    let prompts = completion_prompts(r, b)?
        .into_iter()
        .map(|(ids, text)| {
            let shown = match (echo, text) {
                (false, _) => String::new(),
                (true, Some(t)) => t,
                (true, None) => r.tokenizer.decode(&ids).map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
            };
            Ok((ids, shown))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let stop_ids = reply_stop_ids(r, &opts, r.stop_ids.clone());
    job(r, opts, prompts, "prompt", None, constraint, stop_ids)
}

fn max_tokens(b: &Body, key: &'static str) -> Result<Option<(usize, &'static str)>, ApiError> {
    Ok(b.int(key, 1, i64::MAX)?.map(|m| (usize::try_from(m).unwrap_or(usize::MAX), key)))
}

/// What the reply must follow (`response_format`, `grammar`).
#[derive(Clone, Debug)]
pub(crate) enum Format {
    Text,
    JsonObject,
    JsonSchema { schema: Value, strict: bool },
    Lark(String),
}

/// A constraint spec with owned parts.
enum Owned {
    Format(Format),
    Tools(Vec<Value>, bool),
}

impl Format {
    fn spec(&self) -> Option<Owned> {
        (!matches!(self, Format::Text)).then(|| Owned::Format(self.clone()))
    }
}

/// The keys each `response_format` type takes (others are refused, as unknown top-level fields are: a client
/// that sends one means something tern would otherwise ignore).
const FORMAT_KEYS: &[(&str, &[&str])] = &[
    ("text", &["type"]),
    // llama.cpp's `{"type": "json_object", "schema": {...}}`: a JSON object following the schema.
    ("json_object", &["type", "schema"]),
    ("json_schema", &["type", "json_schema"]),
    ("grammar", &["type", "grammar"]),
];
const JSON_SCHEMA_KEYS: &[&str] = &["name", "description", "schema", "strict"];

/// A 400 naming the first key of `o` not in `known`.
fn check_keys(o: &Body, known: &[&str], param: &str, what: &str) -> Result<(), ApiError> {
    match o.0.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(ApiError {
            code: Some("unsupported_field"),
            ..ApiError::invalid(
                &format!("{param}.{}", clip(k)),
                format!(
                    "unknown field '{}' in {what}: tern does not implement it (it takes {})",
                    clip(k),
                    known.join(", ")
                ),
            )
        }),
    }
}

/// `response_format` (`text`; `json_object`, with llama.cpp's `schema`; `json_schema` with `schema` and
/// `strict`; `grammar` with a `grammar`) and the top-level `grammar`. A grammar is Lark, or GBNF (llama.cpp's) when
/// its first rule is `name ::= ...`.
fn format(b: &Body) -> Result<Format, ApiError> {
    let bad = |m: String| ApiError::invalid("response_format", m);
    let mut f = match b.object("response_format")? {
        None => Format::Text,
        Some(f) => {
            let kind = f.str("type")?.unwrap_or("text");
            let Some((_, keys)) = FORMAT_KEYS.iter().find(|(k, _)| *k == kind) else {
                return Err(bad(format!(
                    "response_format type '{}' is not supported; use text, json_object, json_schema or grammar",
                    clip(kind)
                )));
            };
            check_keys(&f, keys, "response_format", &format!("a response_format of type '{kind}'"))?;
            match kind {
                "json_object" => match f.get("schema") {
                    None => Format::JsonObject,
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => {
                        Format::JsonSchema { schema: s.clone(), strict: false }
                    }
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "response_format.schema",
                            "response_format.schema must be a JSON schema (an object)",
                        ))
                    }
                },
                "json_schema" => {
                    let js = f.object("json_schema")?.ok_or_else(|| {
                        bad("response_format 'json_schema' needs \"json_schema\": {\"name\", \"schema\", \"strict\"}"
                            .into())
                    })?;
                    check_keys(&js, JSON_SCHEMA_KEYS, "response_format.json_schema", "response_format.json_schema")?;
                    let schema = match js.get("schema") {
                        Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                        None => Value::Bool(true),
                        Some(_) => return Err(bad("json_schema.schema must be a JSON schema (an object)".into())),
                    };
                    Format::JsonSchema { schema, strict: js.bool("strict")?.unwrap_or(false) }
                }
                "grammar" => match f.str("grammar")? {
                    Some(g) => Format::Lark(g.to_owned()),
                    None => return Err(bad("response_format 'grammar' needs a \"grammar\" (Lark or GBNF)".into())),
                },
                _ => Format::Text,
            }
        }
    };
    if let Some(g) = b.str("grammar")? {
        if !matches!(f, Format::Text) {
            return Err(ApiError::invalid("grammar", "give either 'grammar' or a response_format, not both"));
        }
        f = Format::Lark(g.to_owned());
    }
    Ok(f)
}

/// The request's constraint, checked against the grammar limits and written out (400 naming the field for one
/// that cannot be used); compiled later, off this thread ([`grammar::attach`]).
fn constraint(r: &Ready, spec: Option<&Owned>, reply: &Reply) -> Result<PendingConstraint, ApiError> {
    let g = r.grammars.as_ref().map_err(|e| ApiError::constraints_unavailable(e))?;
    let (spec, param) = match spec {
        None => (Spec::Free, "chat_template_kwargs"),
        Some(Owned::Tools(tools, parallel)) => (Spec::ToolCalls { tools, parallel: *parallel }, "tools"),
        Some(Owned::Format(f)) => match f {
            Format::Text => (Spec::Free, "response_format"),
            Format::JsonObject => (Spec::JsonObject, "response_format"),
            Format::JsonSchema { schema, strict } => (Spec::JsonSchema { schema, strict: *strict }, "response_format"),
            Format::Lark(g) if tern_text::constraint::is_gbnf(g) => (Spec::Gbnf(g), "grammar"),
            Format::Lark(g) => (Spec::Lark(g), "grammar"),
        },
    };
    let prepared = g.prepare(spec).map_err(|e| grammar::client_error(e, param))?;
    Ok(PendingConstraint { prepared, reply: reply.clone(), param })
}

fn options(
    r: &Ready,
    b: &Body,
    logprobs: Option<usize>,
    max_tokens: Option<(usize, &'static str)>,
) -> Result<Options, ApiError> {
    let n = b.int("n", 1, MAX_N)?.unwrap_or(1) as usize;
    let stream = b.bool("stream")?.unwrap_or(false);
    let include_usage = match b.object("stream_options")? {
        Some(o) => o.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let ctx = r.engine.config.ctx_size;
    let min_tokens = b.int("min_tokens", 0, ctx as i64)?.unwrap_or(0) as usize;
    if let Some((max, param)) = max_tokens.filter(|&(max, _)| min_tokens > max) {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("'min_tokens' ({min_tokens}) must not be more than '{param}' ({max})"),
        ));
    }
    Ok(Options {
        ignore_eos: b.bool("ignore_eos")?.unwrap_or(false),
        min_tokens,
        stream,
        include_usage,
        sampling: sampling(r, b)?,
        stop_strings: stop(b)?,
        logprobs,
        max_tokens,
        n,
        format: format(b)?,
    })
}

/// The context-length error, naming the field to shorten: the prompt's if the prompt alone leaves no room for a
/// token, else the requested completion length's.
fn too_long(param: &str, message: String) -> ApiError {
    ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(param, message) }
}

/// The requests, once each prompt is known to fit the context with room for the reply: `n` per prompt.
fn job(
    r: &Ready,
    o: Options,
    prompts: Vec<(Vec<u32>, String)>,
    prompt_param: &str,
    chat: Option<ChatOutput>,
    constraint: Option<PendingConstraint>,
    stop_ids: Vec<u32>,
) -> Result<Job, ApiError> {
    let ctx = r.engine.config.ctx_size;
    if prompts.len() * o.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!("at most {MAX_CHOICES} choices per request (prompts × n), got {}", prompts.len() * o.n),
        ));
    }
    let (mut requests, mut echo, mut prompt_tokens) = (Vec::new(), Vec::new(), 0);
    for (prompt, shown) in prompts {
        let n = prompt.len();
        if n == 0 {
            return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
        }
        if n >= ctx {
            return Err(too_long(
                prompt_param,
                format!(
                    "this model's maximum context length is {ctx} tokens, but the prompt has {n} tokens, which \
                     leaves no room for the completion"
                ),
            ));
        }
        // Without max_tokens the reply may fill the context.
        let max_tokens = match o.max_tokens {
            None => ctx - n,
            Some((m, param)) if n.saturating_add(m) > ctx => {
                return Err(too_long(
                    param,
                    format!(
                        "this model's maximum context length is {ctx} tokens, but the prompt has {n} tokens and {m} \
                         were requested for the completion ({} in all)",
                        n.saturating_add(m)
                    ),
                ))
            }
            Some((m, _)) => m,
        };
        if o.min_tokens > max_tokens {
            return Err(too_long(
                "min_tokens",
                format!(
                    "this model's maximum context length is {ctx} tokens: the prompt has {n} tokens, which leaves \
                     {max_tokens} for the completion, fewer than 'min_tokens' ({})",
                    o.min_tokens
                ),
            ));
        }
        prompt_tokens += n;
        for i in 0..o.n {
            let mut sampling = o.sampling.clone();
            // Several choices of one seeded request: different draws, the same for the same seed.
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
            requests.push(Request {
                prompt: prompt.clone(),
                sampling,
                max_tokens,
                stop_strings: o.stop_strings.clone(),
                stop_ids: stop_ids.clone(),
                logprobs: o.logprobs,
                constraint: None, // compiled once the job is prepared (grammar::attach)
                min_tokens: o.min_tokens,
                images: Vec::new(),
            });
            echo.push(shown.clone());
        }
    }
    Ok(Job {
        requests,
        echo,
        prompt_tokens,
        stream: o.stream,
        include_usage: o.include_usage,
        chat,
        prompt_param: prompt_param.into(),
        constraint,
    })
}

fn sampling(r: &Ready, b: &Body) -> Result<SamplingParams, ApiError> {
    let mut s = r.sampling.clone();
    let set = |dst: &mut f32, v: Option<f64>| {
        if let Some(v) = v {
            *dst = v as f32;
        }
    };
    set(&mut s.temperature, b.num("temperature", 0.0, 2.0)?);
    set(&mut s.top_p, b.num("top_p", 0.0, 1.0)?);
    set(&mut s.min_p, b.num("min_p", 0.0, 1.0)?);
    set(&mut s.presence_penalty, b.num("presence_penalty", -2.0, 2.0)?);
    set(&mut s.frequency_penalty, b.num("frequency_penalty", -2.0, 2.0)?);
    set(&mut s.repetition_penalty, b.num("repetition_penalty", 0.01, 10.0)?);
    let vocab = r.tokenizer.vocab_size();
    // -1 or 0: no cut; past the vocabulary: clamped to it (the same: no cut).
    if let Some(k) = b.int("top_k", -1, i64::MAX)? {
        s.top_k = usize::try_from(k.max(0)).unwrap_or(usize::MAX).min(vocab);
    }
    if let Some(seed) = b.get("seed") {
        let seed = seed.as_i64().map(|x| x as u64).or(seed.as_u64());
        s.seed = Some(seed.ok_or_else(|| ApiError::invalid("seed", "'seed' must be an integer"))?);
    }
    if let Some(bias) = b.object("logit_bias")? {
        if bias.0.len() > MAX_LOGIT_BIAS {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {}", bias.0.len()),
            ));
        }
        for (k, v) in bias.0 {
            let id = k.parse::<u32>().ok().filter(|&i| (i as usize) < vocab);
            let id = id.ok_or_else(|| {
                ApiError::invalid("logit_bias", format!("'{}' is not a token id below {vocab}", clip(&k)))
            })?;
            let v = v.as_f64().filter(|v| (-100.0..=100.0).contains(v));
            let v =
                v.ok_or_else(|| ApiError::invalid("logit_bias", "logit_bias values must be numbers in -100..100"))?;
            s.logit_bias.insert(id, v as f32);
        }
    }
    Ok(s)
}

fn stop(b: &Body) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "stop",
            format!(
                "'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings, each of 1 to \
                 {MAX_STOP_BYTES} bytes"
            ),
        )
    };
    let list = match b.get("stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOP_STRINGS => {
            a.iter().map(|v| v.as_str().map(str::to_owned).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad()),
    };
    if list.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(bad());
    }
    Ok(list)
}

/// Raw text (/v1/completions' prompt, /tokenize's): control tokens written in it are read as such, as vLLM and
/// OpenAI's legacy completions do (a raw prompt is the whole prompt, its turn markers included). `None` past `limit`
/// ids (see [`tern_text::Tokenizer::encode_within`]).
fn encode(r: &Ready, text: &str, limit: usize) -> Result<Option<Vec<u32>>, ApiError> {
    r.tokenizer.encode_within(text, false, limit).map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
}

/// A rendered chat: control tokens only where the template put them (the request's text is text), or, with
/// `--allow-special-in-content`, wherever the text spells them. `None` past `limit` ids.
fn encode_rendered(r: &Ready, rendered: &Rendered, limit: usize) -> Result<Option<Vec<u32>>, ApiError> {
    if r.special_in_content {
        return encode(r, &rendered.text(), limit);
    }
    rendered.encode_within(&r.tokenizer, limit).map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
}

/// [`encode_rendered`] after [`check_length`], with each image's placeholder written as its image tokens; see
/// [`Fit`] (the images' tokens count against it).
fn encode_chat(r: &Ready, rendered: &Rendered, fit: Fit, pictures: &[ImageBytes]) -> Result<Vec<u32>, ApiError> {
    check_length(r, &rendered.text(), "messages")?;
    let Some(input) = r.images.as_ref().filter(|_| !pictures.is_empty()) else {
        return encode_rendered(r, rendered, fit.limit(r))?.ok_or_else(|| no_room(r, "messages"));
    };
    // Each image's placeholder becomes its tokens: the text may take what they leave.
    let extra = pictures.iter().fold(0usize, |n, p| n.saturating_add(p.tokens.saturating_sub(1)));
    let limit = fit.limit(r).checked_sub(extra).ok_or_else(|| no_room(r, "messages"))?;
    let ids = encode_rendered(r, rendered, limit)?.ok_or_else(|| no_room(r, "messages"))?;
    images::expand(ids, input.image_token_id, pictures, "messages")
}

/// Tokenise a prompt after [`check_length`]; see [`Fit`].
fn encode_prompt(r: &Ready, text: &str, param: &str, fit: Fit) -> Result<Vec<u32>, ApiError> {
    check_length(r, text, param)?;
    encode(r, text, fit.limit(r))?.ok_or_else(|| no_room(r, param))
}

/// Whether a prompt must leave room for a reply in the context: a generation's prompt is refused as soon as its
/// tokens fill the context, before the rest is tokenised; /tokenize and count_tokens count every token.
#[derive(Clone, Copy)]
enum Fit {
    Reply,
    Count,
}

impl Fit {
    /// The most ids worth tokenising.
    fn limit(self, r: &Ready) -> usize {
        match self {
            Fit::Reply => r.engine.config.ctx_size.saturating_sub(1),
            Fit::Count => usize::MAX,
        }
    }
}

/// The error of a prompt whose tokens fill the context (found while tokenising it).
fn no_room(r: &Ready, param: &str) -> ApiError {
    let ctx = r.engine.config.ctx_size;
    too_long(
        param,
        format!(
            "this model's maximum context length is {ctx} tokens, but the prompt has more than {} tokens, which \
             leaves no room for the completion",
            ctx.saturating_sub(1)
        ),
    )
}

/// Refuse at once (before the costly encoding) a text too long to fit the context whatever its tokens:
/// [`tern_text::Tokenizer::min_tokens`] is a lower bound of their number.
fn check_length(r: &Ready, text: &str, param: &str) -> Result<(), ApiError> {
    let ctx = r.engine.config.ctx_size;
    let at_least = r.tokenizer.min_tokens(text);
    if at_least >= ctx {
        return Err(too_long(
            param,
            format!(
                "this model's maximum context length is {ctx} tokens, but the prompt is {} bytes long: at least \
                 {at_least} tokens",
                text.len()
            ),
        ));
    }
    Ok(())
}

/// The prompts of /v1/completions with their text when given as text: a string, a list of token ids, or a list
/// of either.
/// A prompt's ids, and its text when it was given as text.
type Prompt = (Vec<u32>, Option<String>);

fn completion_prompts(r: &Ready, b: &Body) -> Result<Vec<Prompt>, ApiError> {
    let bad = |m: &str| ApiError::invalid("prompt", m);
    let shape = "'prompt' must be a string, a list of token ids, or a list of strings or of token-id lists";
    let p = b.get("prompt").ok_or_else(|| bad("'prompt' is required"))?;
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| bad("token ids must be integers")))
            .collect()
    };
    let one = |p: &Value| -> Result<Prompt, ApiError> {
        match p {
            Value::String(s) => Ok((encode_prompt(r, s, "prompt", Fit::Reply)?, Some(s.clone()))),
            Value::Array(a) => Ok((ids(a)?, None)),
            _ => Err(bad(shape)),
        }
    };
    match p {
        Value::Array(a) if a.is_empty() => Err(bad("'prompt' is an empty list")),
        Value::Array(a) if a.iter().all(Value::is_number) => Ok(vec![one(p)?]),
        Value::Array(a) if a.len() <= MAX_CHOICES && a.iter().all(|x| x.is_string() || x.is_array()) => {
            a.iter().map(one).collect()
        }
        Value::Array(a) if a.len() > MAX_CHOICES => {
            Err(bad(&format!("at most {MAX_CHOICES} prompts per request, got {}", a.len())))
        }
        Value::String(_) => Ok(vec![one(p)?]),
        _ => Err(bad(shape)),
    }
}

/// A forced or restricted tool call: which tools, whether several calls may come, whether one must.
struct Forced {
    tools: Vec<Value>,
    parallel: bool,
    forced: bool,
}

/// The chat prompt text and how to parse the reply. tool_choice: `none` offers no tools (calls come back as
/// content), `auto` offers all, `required` offers all, a named function offers only that one; `required` and a
/// named function constrain the reply to calls (with thinking: after `</think>`) whose arguments follow the tool's
/// parameters. `parallel_tool_calls: false` allows one call. The third value says how calls are restricted.
/// `continue_final_message` (vLLM's assistant prefill) leaves the last message open, with no generation prompt:
/// the reply continues its text (as content, its think block being closed).
fn render_chat(r: &Ready, b: &Body) -> Result<(Rendered, ChatOutput, Option<Forced>, Vec<ImageBytes>), ApiError> {
    let (messages, pictures) = messages(r, b)?;
    let mut tools = tools(b)?;
    let names: Vec<String> = tools.iter().map(|t| t["function"]["name"].as_str().unwrap_or_default().into()).collect();
    let bad_choice = || {
        ApiError::invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    };
    let forced = match b.get("tool_choice") {
        None => false,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => false,
            "none" => {
                tools.clear();
                false
            }
            "required" => true,
            _ => return Err(bad_choice()),
        },
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(bad_choice)?;
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names '{}', which is not in 'tools'", clip(name)),
                ));
            }
            tools.retain(|t| t["function"]["name"] == name);
            true
        }
        Some(_) => return Err(bad_choice()),
    };
    if forced && tools.is_empty() {
        return Err(ApiError::invalid("tool_choice", "tool_choice requires a tool call but no 'tools' are given"));
    }
    let parallel = b.bool("parallel_tool_calls")?.unwrap_or(true);
    let mut extra = match b.object("chat_template_kwargs")? {
        Some(k) => k.0,
        None => Map::new(),
    };
    let mut thinking = match extra.remove("enable_thinking") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(t)) => Some(t),
        Some(_) => return Err(ApiError::invalid("chat_template_kwargs", "'enable_thinking' must be a boolean")),
    };
    match b.str("reasoning_effort")? {
        None => {}
        Some("none" | "minimal") => thinking = thinking.or(Some(false)),
        Some("low" | "medium" | "high") => thinking = thinking.or(Some(true)),
        Some(e) => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!("'reasoning_effort' must be none, minimal, low, medium or high, got '{}'", clip(e)),
            ))
        }
    }
    let continue_final = b.bool("continue_final_message")?.unwrap_or(false);
    let add_generation_prompt =
        match (b.bool("add_generation_prompt")?, continue_final) {
            (Some(true), true) => return Err(ApiError::invalid(
                "continue_final_message",
                "'continue_final_message' and 'add_generation_prompt' cannot both be true: continue the last message, \
                 or start a new assistant turn",
            )),
            (set, continue_final) => set.unwrap_or(!continue_final),
        };
    let options = ChatOptions {
        add_generation_prompt,
        enable_thinking: thinking,
        tools: (!tools.is_empty()).then(|| tools.clone()),
        extra,
        continue_final_message: continue_final,
    };
    let rendered =
        r.template.render_marked(&messages, &options).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let restricted =
        (!tools.is_empty() && (forced || !parallel)).then(|| Forced { tools: tools.clone(), parallel, forced });
    let chat = ChatOutput { tools, thinking: thinking != Some(false) && !continue_final };
    Ok((rendered, chat, restricted, pictures))
}

/// The messages, their content as the template reads it (text joined into a string; with images a list of text
/// parts and `{"type": "image"}` placeholders), and the images' bytes in the order of the prompt.
fn messages(r: &Ready, b: &Body) -> Result<(Vec<Value>, Vec<ImageBytes>), ApiError> {
    let Some(Value::Array(list)) = b.get("messages") else {
        return Err(ApiError::invalid("messages", "'messages' must be a non-empty list of messages"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' must be a non-empty list of messages"));
    }
    let mut pictures = Vec::new();
    // When the request's image URLs must be fetched by (set by the first).
    let mut fetch_by = None;
    let messages = list
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let Some(m) = m.as_object() else { return Err(ApiError::invalid(&param, "a message must be an object")) };
            let mut m = m.clone();
            let role = match m.get("role").and_then(Value::as_str) {
                Some("developer") => "system",
                Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
                _ => {
                    let msg = "'role' must be one of system, developer, user, assistant, tool";
                    return Err(ApiError::invalid(&format!("{param}.role"), msg));
                }
            };
            m.insert("role".into(), role.into());
            let content = match m.get("content") {
                None | Some(Value::Null) => Value::from(""),
                Some(Value::String(s)) => Value::from(s.as_str()),
                Some(Value::Array(parts)) => {
                    content_parts(r, parts, &format!("{param}.content"), &mut pictures, &mut fetch_by)?
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("{param}.content"),
                        "'content' must be a string or a list of parts",
                    ))
                }
            };
            m.insert("content".into(), content);
            Ok(Value::Object(m))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    Ok((messages, pictures))
}

/// A message's list of parts (`text`, `image_url`) as the template reads it: the text joined into a string, or
/// with images a list of text parts and `{"type": "image"}` placeholders (the template writes each as
/// `<|vision_start|><|image_pad|><|vision_end|>`); the images' bytes are pushed to `pictures`, each measured
/// against the limits (http(s) URLs fetched by `fetch_by`, see [`images::from_url`]).
fn content_parts(
    r: &Ready,
    parts: &[Value],
    param: &str,
    pictures: &mut Vec<ImageBytes>,
    fetch_by: &mut Option<std::time::Instant>,
) -> Result<Value, ApiError> {
    let mut out = Vec::new();
    for (j, p) in parts.iter().enumerate() {
        let at = format!("{param}[{j}]");
        match p.get("type").and_then(Value::as_str) {
            Some("text") => {
                let t = p.get("text").and_then(Value::as_str);
                let t = t.ok_or_else(|| ApiError::invalid(&at, "a 'text' part needs a 'text' string"))?;
                out.push(json!({"type": "text", "text": t}));
            }
            Some("image_url") => {
                let input = r.images.as_ref().ok_or_else(|| images::unsupported(&at))?;
                let limits = &r.image_limits;
                let ordinal = pictures.len() + 1;
                if ordinal > limits.max_images {
                    return Err(ApiError {
                        code: Some("too_many_images"),
                        ..ApiError::invalid(
                            &at,
                            format!("at most {} images per request (--max-images)", limits.max_images),
                        )
                    });
                }
                let url = match p.get("image_url") {
                    Some(Value::String(u)) => Some(u.as_str()),
                    Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
                    _ => None,
                };
                let url = url.ok_or_else(|| {
                    ApiError::invalid(&at, "an 'image_url' part needs \"image_url\": {\"url\": \"data:...\"}")
                })?;
                let bytes = images::from_url(url, &at, ordinal, limits, fetch_by)?;
                let tokens = images::probe(&bytes, input, limits, &at, ordinal)?;
                pictures.push(ImageBytes { bytes, param: at, ordinal, tokens });
                out.push(json!({"type": "image"}));
            }
            Some(t) => {
                return Err(ApiError::invalid(
                    &at,
                    format!("'{}' content parts are not supported (text and image_url)", clip(t)),
                ))
            }
            None => return Err(ApiError::invalid(&at, "a content part needs a 'type'")),
        }
    }
    if out.iter().all(|p| p["type"] == "text") {
        let text: String = out.iter().filter_map(|p| p["text"].as_str()).collect();
        return Ok(Value::String(text));
    }
    Ok(Value::Array(out))
}

fn tools(b: &Body) -> Result<Vec<Value>, ApiError> {
    let bad = || {
        ApiError::invalid("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    };
    match b.get("tools") {
        None => Ok(vec![]),
        Some(Value::Array(list)) => {
            for t in list {
                let ok = t.get("type").and_then(Value::as_str) == Some("function")
                    && t.get("function")
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        .is_some_and(|n| !n.is_empty());
                if !ok {
                    return Err(bad());
                }
            }
            Ok(list.clone())
        }
        Some(_) => Err(bad()),
    }
}

/// `{"prompt": "..."}` or a chat request's `{"messages": [...], ...}` (rendered as for generation); a text too long
/// to fit the context whatever its tokens is refused before tokenising, as a prompt is (/tokenize, count_tokens).
pub(crate) fn tokenize(r: &Ready, b: &Body) -> Result<Vec<u32>, ApiError> {
    if b.get("messages").is_some() {
        let (rendered, _, _, pictures) = render_chat(r, b)?;
        return encode_chat(r, &rendered, Fit::Count, &pictures);
    }
    let text = b.str("prompt")?.ok_or_else(|| ApiError::invalid("prompt", "'prompt' or 'messages' is required"))?;
    encode_prompt(r, text, "prompt", Fit::Count)
}

pub(crate) fn detokenize(r: &Ready, b: &Body) -> Result<String, ApiError> {
    let bad = || ApiError::invalid("tokens", "'tokens' must be a list of token ids");
    let Some(Value::Array(ids)) = b.get("tokens") else { return Err(bad()) };
    let vocab = r.tokenizer.vocab_size();
    let ids = ids
        .iter()
        .map(|x| x.as_u64().filter(|&i| (i as usize) < vocab).map(|i| i as u32).ok_or_else(bad))
        .collect::<Result<Vec<_>, _>>()?;
    r.tokenizer.decode(&ids).map_err(|e| ApiError::invalid("tokens", e.to_string()))
}
