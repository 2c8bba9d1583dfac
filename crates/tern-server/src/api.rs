//! OpenAI request bodies: parsing and validation into engine requests, with OpenAI-shaped errors.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tern_engine::{EngineConfig, Request, SubmitError};
use tern_text::{ChatOptions, SamplingParams};

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
        SubmitError::EmptyPrompt | SubmitError::BadToken { .. } => ApiError::invalid(prompt_param, msg),
    }
}

/// A JSON object request body; `null` fields count as absent.
pub(crate) struct Body(Map<String, Value>);

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

    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn num(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
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
    fn int(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
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

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a boolean"))))
            .transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a string"))))
            .transpose()
    }

    fn object(&self, key: &str) -> Result<Option<Body>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Body(m.clone()))),
            Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be an object"))),
        }
    }
}

/// A validated generation request and how to present its output.
pub(crate) struct Job {
    pub request: Request,
    pub stream: bool,
    pub include_usage: bool,
    /// `None` for /v1/completions (raw text out).
    pub chat: Option<ChatOutput>,
    /// The field holding the prompt (`messages` or `prompt`), for errors about it.
    pub prompt_param: String,
}

/// How chat output is parsed.
pub(crate) struct ChatOutput {
    /// Tools whose calls are returned as `tool_calls` (others come back as content).
    pub tools: Vec<Value>,
    pub thinking: bool,
    /// Text already placed at the start of the reply by the prompt (a forced tool call opening).
    pub prefix: String,
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
/// Most alternatives per token (`top_logprobs`, or `logprobs` of /v1/completions).
pub(crate) const MAX_LOGPROBS: i64 = 20;

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
}

pub(crate) fn chat_job(r: &Ready, b: &Body) -> Result<Job, ApiError> {
    check_model(r, b.str("model")?)?;
    let logprobs = match (b.bool("logprobs")?, b.int("top_logprobs", 0, MAX_LOGPROBS)?) {
        (Some(true), k) => Some(k.unwrap_or(0) as usize),
        (_, Some(_)) => return Err(ApiError::invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")),
        _ => None,
    };
    let max = match b.get("max_completion_tokens") {
        Some(_) => max_tokens(b, "max_completion_tokens")?,
        None => max_tokens(b, "max_tokens")?,
    };
    let opts = options(r, b, logprobs, max)?;
    let (text, chat) = render_chat(r, b)?;
    let mut prompt = encode_prompt(r, &text, "messages")?;
    prompt.extend(encode(r, &chat.prefix)?);
    job(r, opts, prompt, "messages", Some(chat))
}

pub(crate) fn completion_job(r: &Ready, b: &Body) -> Result<Job, ApiError> {
    check_model(r, b.str("model")?)?;
    if b.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "'echo' is not supported"));
    }
    b.int("best_of", 1, 1).map_err(|_| ApiError::invalid("best_of", "only 'best_of': 1 is supported"))?;
    let logprobs = b.int("logprobs", 0, MAX_LOGPROBS)?.map(|k| k as usize);
    let opts = options(r, b, logprobs, max_tokens(b, "max_tokens")?)?;
    let prompt = completion_prompt(r, b)?;
    job(r, opts, prompt, "prompt", None)
}

fn max_tokens(b: &Body, key: &'static str) -> Result<Option<(usize, &'static str)>, ApiError> {
    Ok(b.int(key, 1, i64::MAX)?.map(|m| (usize::try_from(m).unwrap_or(usize::MAX), key)))
}

fn options(
    r: &Ready,
    b: &Body,
    logprobs: Option<usize>,
    max_tokens: Option<(usize, &'static str)>,
) -> Result<Options, ApiError> {
    b.int("n", 1, 1).map_err(|_| ApiError::invalid("n", "only 'n': 1 is supported"))?;
    b.str("user")?;
    if let Some(f) = b.object("response_format")? {
        match f.str("type")? {
            None | Some("text") => {}
            Some(t) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!("response_format type '{}' is not supported; only 'text' is", clip(t)),
                ))
            }
        }
    }
    let stream = b.bool("stream")?.unwrap_or(false);
    let include_usage = match b.object("stream_options")? {
        Some(o) => o.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    Ok(Options { stream, include_usage, sampling: sampling(r, b)?, stop_strings: stop(b)?, logprobs, max_tokens })
}

/// The context-length error, naming the field to shorten: the prompt's if the prompt alone leaves no room for a
/// token, else the requested completion length's.
fn too_long(param: &str, message: String) -> ApiError {
    ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(param, message) }
}

/// The request, once its prompt is known to fit the context with room for the reply.
fn job(r: &Ready, o: Options, prompt: Vec<u32>, prompt_param: &str, chat: Option<ChatOutput>) -> Result<Job, ApiError> {
    let (ctx, n) = (r.engine.config.ctx_size, prompt.len());
    if n == 0 {
        return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
    }
    if n >= ctx {
        return Err(too_long(
            prompt_param,
            format!(
                "this model's maximum context length is {ctx} tokens, but the prompt has {n} tokens, which leaves \
                 no room for the completion"
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
    let request = Request {
        prompt,
        sampling: o.sampling,
        max_tokens,
        stop_strings: o.stop_strings,
        stop_ids: r.stop_ids.clone(),
        logprobs: o.logprobs,
        constraint: None,
    };
    Ok(Job { request, stream: o.stream, include_usage: o.include_usage, chat, prompt_param: prompt_param.into() })
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

fn encode(r: &Ready, text: &str) -> Result<Vec<u32>, ApiError> {
    r.tokenizer.encode(text, false).map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
}

/// Tokenise a prompt, refusing at once (before the costly encoding) a text too long to fit the context whatever
/// its tokens: [`tern_text::Tokenizer::min_tokens`] is a lower bound of their number.
fn encode_prompt(r: &Ready, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
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
    encode(r, text)
}

/// The prompt of /v1/completions: a string, a list of token ids, or a one-element list of either.
fn completion_prompt(r: &Ready, b: &Body) -> Result<Vec<u32>, ApiError> {
    let bad = |m: &str| ApiError::invalid("prompt", m);
    let mut p = b.get("prompt").ok_or_else(|| bad("'prompt' is required"))?;
    if let Value::Array(a) = p {
        if a.len() == 1 && (a[0].is_string() || a[0].is_array()) {
            p = &a[0];
        } else if a.iter().any(|x| !x.is_number()) {
            return Err(bad("'prompt' must be a string or a list of token ids; only one prompt per request"));
        }
    }
    match p {
        Value::String(s) => encode_prompt(r, s, "prompt"),
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| bad("token ids must be integers")))
            .collect(),
        _ => Err(bad("'prompt' must be a string or a list of token ids")),
    }
}

/// The chat prompt text and how to parse the reply. tool_choice: `none` offers no tools (calls come back as
/// content), `auto` offers all, `required` offers all, a named function offers only that one; with thinking
/// off, `required` and a named function also open the reply with `<tool_call>\n` (and `<function=NAME>\n`),
/// so the model must call a tool.
fn render_chat(r: &Ready, b: &Body) -> Result<(String, ChatOutput), ApiError> {
    let messages = messages(b)?;
    let mut tools = tools(b)?;
    let names: Vec<String> = tools.iter().map(|t| t["function"]["name"].as_str().unwrap_or_default().into()).collect();
    let bad_choice = || {
        ApiError::invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    };
    let mut prefix = String::new();
    let forced = match b.get("tool_choice") {
        None => None,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => None,
            "none" => {
                tools.clear();
                None
            }
            "required" => Some(None),
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
            Some(Some(name.to_owned()))
        }
        Some(_) => return Err(bad_choice()),
    };
    if forced.is_some() && tools.is_empty() {
        return Err(ApiError::invalid("tool_choice", "tool_choice requires a tool call but no 'tools' are given"));
    }
    let mut extra = match b.object("chat_template_kwargs")? {
        Some(k) => k.0,
        None => Map::new(),
    };
    let thinking = match extra.remove("enable_thinking") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(t)) => Some(t),
        Some(_) => return Err(ApiError::invalid("chat_template_kwargs", "'enable_thinking' must be a boolean")),
    };
    if thinking == Some(false) {
        if let Some(name) = forced {
            prefix = "<tool_call>\n".into();
            if let Some(name) = name {
                prefix.push_str(&format!("<function={name}>\n"));
            }
        }
    }
    let options = ChatOptions {
        add_generation_prompt: b.bool("add_generation_prompt")?.unwrap_or(true),
        enable_thinking: thinking,
        tools: (!tools.is_empty()).then(|| tools.clone()),
        extra,
    };
    let text = r.template.render(&messages, &options).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    Ok((text, ChatOutput { tools, thinking: thinking != Some(false), prefix }))
}

fn messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let Some(Value::Array(list)) = b.get("messages") else {
        return Err(ApiError::invalid("messages", "'messages' must be a non-empty list of messages"));
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' must be a non-empty list of messages"));
    }
    list.iter()
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
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => Ok(t),
                        _ => {
                            Err(ApiError::invalid(&format!("{param}.content"), "only text content parts are supported"))
                        }
                    })
                    .collect::<Result<String, _>>()?,
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("{param}.content"),
                        "'content' must be a string or a list of parts",
                    ))
                }
            };
            m.insert("content".into(), content.into());
            Ok(Value::Object(m))
        })
        .collect()
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

/// `{"prompt": "..."}` or a chat request's `{"messages": [...], ...}` (rendered as for generation).
pub(crate) fn tokenize(r: &Ready, b: &Body) -> Result<Vec<u32>, ApiError> {
    if b.get("messages").is_some() {
        let (text, chat) = render_chat(r, b)?;
        return encode(r, &(text + &chat.prefix));
    }
    let text = b.str("prompt")?.ok_or_else(|| ApiError::invalid("prompt", "'prompt' or 'messages' is required"))?;
    encode(r, text)
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
