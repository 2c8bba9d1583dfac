//! OpenAI request bodies: parsing and validation into engine requests, with OpenAI-shaped errors.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tern_engine::{Request, SubmitError};
use tern_text::{ChatOptions, SamplingParams};

use crate::{RawBody, Ready};

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, code: Some(code), param: None, message: message.into() }
    }

    /// 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: None,
            param: Some(param.into()),
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }

    pub fn json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.json())).into_response()
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        let msg = e.to_string();
        match e {
            SubmitError::QueueFull { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "queue_full", msg)
            }
            SubmitError::TooLong { .. } => {
                ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid("messages", msg) }
            }
            SubmitError::EmptyPrompt | SubmitError::BadToken { .. } => ApiError::invalid("prompt", msg),
        }
    }
}

/// A JSON object request body; `null` fields count as absent.
pub(crate) struct Body(Map<String, Value>);

impl Body {
    pub fn parse(raw: RawBody) -> Result<Body, ApiError> {
        let bytes = raw.map_err(|rej| {
            let status = rej.status();
            let (kind, code) = match status {
                StatusCode::PAYLOAD_TOO_LARGE => ("invalid_request_error", "payload_too_large"),
                _ => ("invalid_request_error", "invalid_body"),
            };
            ApiError::new(status, kind, code, format!("cannot read the request body: {}", rej.body_text()))
        })?;
        match serde_json::from_slice(&bytes) {
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

    fn int(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let x = v.as_i64().ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be an integer")))?;
        if !(lo..=hi).contains(&x) {
            return Err(ApiError::invalid(key, format!("'{key}' must be between {lo} and {hi}, got {x}")));
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
            ..ApiError::invalid("model", format!("the model '{m}' does not exist; this server serves '{}'", r.name))
        }),
        _ => Ok(()),
    }
}

pub(crate) fn chat_job(r: &Ready, b: &Body) -> Result<Job, ApiError> {
    check_model(r, b.str("model")?)?;
    let (text, chat) = render_chat(r, b)?;
    let mut prompt = encode(r, &text)?;
    prompt.extend(encode(r, &chat.prefix)?);
    let logprobs = match (b.bool("logprobs")?, b.int("top_logprobs", 0, 20)?) {
        (Some(true), k) => Some(k.unwrap_or(0) as usize),
        (_, Some(_)) => return Err(ApiError::invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")),
        _ => None,
    };
    let max = match b.get("max_completion_tokens") {
        Some(_) => b.int("max_completion_tokens", 1, i64::MAX)?,
        None => b.int("max_tokens", 1, i64::MAX)?,
    };
    job(r, b, prompt, max, logprobs, Some(chat))
}

pub(crate) fn completion_job(r: &Ready, b: &Body) -> Result<Job, ApiError> {
    check_model(r, b.str("model")?)?;
    let prompt = completion_prompt(r, b)?;
    if b.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "'echo' is not supported"));
    }
    b.int("best_of", 1, 1).map_err(|_| ApiError::invalid("best_of", "only 'best_of': 1 is supported"))?;
    let logprobs = b.int("logprobs", 0, 20)?.map(|k| k as usize);
    job(r, b, prompt, b.int("max_tokens", 1, i64::MAX)?, logprobs, None)
}

/// The fields shared by both endpoints.
fn job(
    r: &Ready,
    b: &Body,
    prompt: Vec<u32>,
    max_tokens: Option<i64>,
    logprobs: Option<usize>,
    chat: Option<ChatOutput>,
) -> Result<Job, ApiError> {
    b.int("n", 1, 1).map_err(|_| ApiError::invalid("n", "only 'n': 1 is supported"))?;
    b.str("user")?;
    if let Some(f) = b.object("response_format")? {
        match f.str("type")? {
            None | Some("text") => {}
            Some(t) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!("response_format type '{t}' is not supported; only 'text' is"),
                ))
            }
        }
    }
    let stream = b.bool("stream")?.unwrap_or(false);
    let include_usage = match b.object("stream_options")? {
        Some(o) => o.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    // Without max_tokens the reply may fill the context (at least one token, so an over-long prompt is an error).
    let max_tokens = max_tokens.map_or(r.engine.config.ctx_size.saturating_sub(prompt.len()).max(1), |m| m as usize);
    let request = Request {
        prompt,
        sampling: sampling(r, b)?,
        max_tokens,
        stop_strings: stop(b)?,
        stop_ids: r.stop_ids.clone(),
        logprobs,
    };
    Ok(Job { request, stream, include_usage, chat })
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
    if let Some(k) = b.int("top_k", -1, i64::MAX)? {
        s.top_k = k.max(0) as usize;
    }
    if let Some(seed) = b.get("seed") {
        let seed = seed.as_i64().map(|x| x as u64).or(seed.as_u64());
        s.seed = Some(seed.ok_or_else(|| ApiError::invalid("seed", "'seed' must be an integer"))?);
    }
    if let Some(bias) = b.object("logit_bias")? {
        let vocab = r.tokenizer.vocab_size();
        for (k, v) in bias.0 {
            let id = k.parse::<u32>().ok().filter(|&i| (i as usize) < vocab);
            let id =
                id.ok_or_else(|| ApiError::invalid("logit_bias", format!("'{k}' is not a token id below {vocab}")))?;
            let v = v.as_f64().filter(|v| (-100.0..=100.0).contains(v));
            let v =
                v.ok_or_else(|| ApiError::invalid("logit_bias", "logit_bias values must be numbers in -100..100"))?;
            s.logit_bias.insert(id, v as f32);
        }
    }
    Ok(s)
}

fn stop(b: &Body) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid("stop", "'stop' must be a string or a list of up to 16 non-empty strings");
    let list = match b.get("stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 16 => {
            a.iter().map(|v| v.as_str().map(str::to_owned).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad()),
    };
    if list.iter().any(String::is_empty) {
        return Err(bad());
    }
    Ok(list)
}

fn encode(r: &Ready, text: &str) -> Result<Vec<u32>, ApiError> {
    r.tokenizer.encode(text, false).map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
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
        Value::String(s) => encode(r, s),
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
                    format!("tool_choice names '{name}', which is not in 'tools'"),
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
