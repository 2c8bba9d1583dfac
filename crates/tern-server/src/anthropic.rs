//! The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, as the official SDKs
//! and Claude Code speak it.
//!
//! A request is translated into a chat request (system, messages of text / `tool_use` / `tool_result` /
//! `thinking` blocks, tools with their `input_schema`, `tool_choice` auto / any / tool / none and
//! `disable_parallel_tool_use`, `stop_sequences`, temperature, top_p, top_k, `thinking` enabled with its
//! `budget_tokens` or disabled: without `thinking` the model does not think, and thinking with a forced tool is a
//! 400, as in Anthropic's API; a last assistant message is continued) and generated as one; the reply comes back
//! as content blocks (`thinking` from the model's reasoning, with a `signature`; `text`, `tool_use`) with
//! `stop_reason` end_turn / max_tokens / stop_sequence / tool_use.
//! Streaming sends `message_start`, `ping`, then per block `content_block_start`, its deltas (`thinking_delta`
//! then a `signature_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta`
//! (stop reason, output tokens) and `message_stop`. Errors are `{"type": "error", "error": {"type", "message"}}` (reshaped in `reqlog`).
//!
//! The server serves one model: any `model` name is accepted (Claude Code asks for its own model names).

use std::hash::{DefaultHasher, Hasher};

use serde_json::{json, Map, Value};
use tern_engine::{FinishReason, TokenLogprob, Usage};

use crate::api::{clip, ApiError, Body, ChatExtras, MAX_STOP_BYTES, MAX_STOP_SEQUENCES};
use crate::generate::{sse_named, ChoiceEnd, Collected, Meta, Piece, Writer};

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
    "output_config",
    "cache_control",
    "inference_geo",
    "speed",
];
const COUNT_FIELDS: &[&str] = &["model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"];

/// The Anthropic error `type` of an HTTP status.
pub(crate) fn error_type(status: u16) -> &'static str {
    match status {
        400 | 405 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An OpenAI-shaped error body as Anthropic's.
pub(crate) fn reshape_error(status: u16, openai: &Value) -> Value {
    let message = openai["error"]["message"].as_str().unwrap_or("error");
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

fn check_fields(b: &Body, known: &[&str]) -> Result<(), ApiError> {
    for key in b.0.keys() {
        if !known.contains(&key.as_str()) {
            let msg = match key.as_str() {
                "mcp_servers" | "container" => format!("'{key}' is not supported"),
                _ => format!("unknown field '{}': tern does not implement it", clip(key)),
            };
            return Err(invalid(&clip(key), msg));
        }
    }
    Ok(())
}

/// The `text` of text block `blk` (a 400 naming it when it has none, as Anthropic's API answers).
fn block_text<'a>(blk: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    blk.get("text")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(&format!("{param}.text"), format!("{param}.text: a text block needs a 'text' string")))
}

/// The text of a `content` that is a string or a list of text blocks.
fn text_of(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, b)| match b.get("type").and_then(Value::as_str) {
                Some("text") => block_text(b, &format!("{param}.{j}")),
                _ => Err(invalid(param, "only text blocks are supported here")),
            })
            .collect(),
        Value::Null => Ok(String::new()),
        _ => Err(invalid(param, "must be a string or a list of text blocks")),
    }
}

/// An `image` block as a chat `image_url` part: a `base64` source as a data: URL (its media type and bytes are
/// checked where chat images are, [`crate::images`]), a `url` source as its URL (fetched only with `--image-urls`,
/// as chat image URLs are); `file` sources are refused.
fn image_part(blk: &Value, param: &str) -> Result<Value, ApiError> {
    let src = blk.get("source").filter(|s| s.is_object());
    let src = src.ok_or_else(|| invalid(param, "an image block needs a 'source' object"))?;
    match src.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let media = src.get("media_type").and_then(Value::as_str).unwrap_or_default();
            let data = src.get("data").and_then(Value::as_str);
            let data = data.ok_or_else(|| invalid(param, "a base64 image source needs a 'data' string"))?;
            Ok(json!({"type": "image_url", "image_url": {"url": format!("data:{media};base64,{data}")}}))
        }
        // Fetched or refused as a chat image URL is (`--image-urls`).
        Some("url") => {
            let url = src.get("url").and_then(Value::as_str);
            let url = url.ok_or_else(|| invalid(param, "a url image source needs a 'url' string"))?;
            Ok(json!({"type": "image_url", "image_url": {"url": url}}))
        }
        Some("file") => Err(invalid(param, "file sources are not supported (tern has no Files API); send base64")),
        _ => Err(invalid(param, "an image source must be {\"type\": \"base64\", \"media_type\", \"data\"}")),
    }
}

/// Chat content of text parts and image parts: the text joined when there is no image (as text-only content
/// always was), else the list.
fn chat_content(parts: Vec<Value>) -> Value {
    if parts.iter().all(|p| p["type"] == "text") {
        return Value::String(parts.iter().filter_map(|p| p["text"].as_str()).collect());
    }
    Value::Array(parts)
}

/// The content of a `tool_result`: a string, or a list of text and image blocks.
fn tool_result_content(v: &Value, param: &str) -> Result<Vec<Value>, ApiError> {
    match v {
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, b)| {
                let at = format!("{param}.content.{j}");
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => Ok(json!({"type": "text", "text": block_text(b, &at)?})),
                    Some("image") => image_part(b, &at),
                    _ => Err(invalid(param, "only text and image blocks are supported in a tool_result")),
                }
            })
            .collect(),
        v => Ok(vec![json!({"type": "text", "text": text_of(v, param)?})]),
    }
}

/// The chat messages of an Anthropic request (system first).
fn messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = b.get("system") {
        let text = text_of(system, "system")?;
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
    }
    let Some(Value::Array(list)) = b.get("messages") else {
        return Err(invalid("messages", "'messages' must be a non-empty list of messages"));
    };
    if list.is_empty() {
        return Err(invalid("messages", "'messages' must be a non-empty list of messages"));
    }
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages.{i}");
        let role = m.get("role").and_then(Value::as_str);
        let blocks: Vec<Value> = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(a)) => a.clone(),
            _ => return Err(invalid(&param, "'content' must be a string or a list of content blocks")),
        };
        match role {
            Some("user") => {
                let mut parts = Vec::new();
                for (j, blk) in blocks.iter().enumerate() {
                    let at = format!("{param}.content.{j}");
                    match blk.get("type").and_then(Value::as_str) {
                        Some("text") => parts.push(json!({"type": "text", "text": block_text(blk, &at)?})),
                        Some("image") => parts.push(image_part(blk, &at)?),
                        Some("tool_result") => {
                            let id = blk.get("tool_use_id").and_then(Value::as_str).unwrap_or_default();
                            let mut content = tool_result_content(blk.get("content").unwrap_or(&Value::Null), &at)?;
                            if blk.get("is_error").and_then(Value::as_bool) == Some(true) {
                                content.insert(0, json!({"type": "text", "text": "Error: "}));
                            }
                            out.push(json!({"role": "tool", "tool_call_id": id, "content": chat_content(content)}));
                        }
                        Some(t @ ("document" | "search_result")) => {
                            return Err(invalid(&param, format!("'{t}' blocks are not supported (text and images)")))
                        }
                        _ => return Err(invalid(&param, "unknown content block type")),
                    }
                }
                let content = chat_content(parts);
                if content.as_str() != Some("") || !blocks.iter().any(|b| b["type"] == "tool_result") {
                    out.push(json!({"role": "user", "content": content}));
                }
            }
            Some("assistant") => {
                let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
                for (j, blk) in blocks.iter().enumerate() {
                    match blk.get("type").and_then(Value::as_str) {
                        Some("text") => text += block_text(blk, &format!("{param}.content.{j}"))?,
                        Some("thinking") => {
                            reasoning += blk.get("thinking").and_then(Value::as_str).unwrap_or_default()
                        }
                        Some("redacted_thinking") => {}
                        Some("tool_use") => {
                            let name = blk.get("name").and_then(Value::as_str).unwrap_or_default();
                            let input = blk.get("input").cloned().unwrap_or_else(|| json!({}));
                            calls.push(json!({"id": blk.get("id").cloned().unwrap_or(Value::Null), "type": "function",
                                              "function": {"name": name, "arguments": input}}));
                        }
                        _ => return Err(invalid(&param, "unknown content block type")),
                    }
                }
                let mut msg = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = reasoning.into();
                }
                if !calls.is_empty() {
                    msg["tool_calls"] = Value::Array(calls);
                }
                out.push(msg);
            }
            _ => return Err(invalid(&format!("{param}.role"), "'role' must be user or assistant")),
        }
    }
    Ok(out)
}

/// `stop_sequences`: a list of up to [`MAX_STOP_SEQUENCES`] strings of 1 to [`MAX_STOP_BYTES`] bytes.
fn stop_sequences(v: &Value) -> Result<Vec<String>, ApiError> {
    let bad = || {
        invalid(
            "stop_sequences",
            format!(
                "'stop_sequences' must be a list of up to {MAX_STOP_SEQUENCES} strings, each of 1 to {MAX_STOP_BYTES} \
                 bytes"
            ),
        )
    };
    let Value::Array(list) = v else { return Err(bad()) };
    if list.len() > MAX_STOP_SEQUENCES {
        return Err(bad());
    }
    list.iter()
        .map(|s| s.as_str().filter(|s| !s.is_empty() && s.len() <= MAX_STOP_BYTES).map(str::to_owned).ok_or_else(bad))
        .collect()
}

/// Translate an Anthropic request into a chat request (and what only Anthropic has).
///
/// As in Anthropic's API, the model thinks only when `thinking` enables it (no `thinking`: the chat template's
/// `enable_thinking` false), thinking cannot be combined with a forced tool (`tool_choice` `any` or `tool`), and a
/// last message of the assistant's is continued (prefill).
pub(crate) fn to_chat(b: &Body, count_only: bool) -> Result<(Body, ChatExtras), ApiError> {
    check_fields(b, if count_only { COUNT_FIELDS } else { FIELDS })?;
    let mut chat = Map::new();
    let messages = messages(b)?;
    // Prefill: a last assistant message with text (and no tool call) is continued, not closed.
    let prefill = b
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .is_some_and(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        && messages.last().is_some_and(|m| {
            m.get("tool_calls").is_none()
                && m.get("content").and_then(Value::as_str).is_some_and(|t| !t.trim().is_empty())
        });
    if prefill {
        chat.insert("continue_final_message".into(), true.into());
    }
    chat.insert("messages".into(), Value::Array(messages));
    let mut extras = ChatExtras::default();
    if !count_only {
        let max = b.get("max_tokens").ok_or_else(|| invalid("max_tokens", "'max_tokens' is required"))?;
        chat.insert("max_tokens".into(), max.clone());
        for (from, to) in [("top_p", "top_p"), ("top_k", "top_k"), ("stream", "stream")] {
            if let Some(v) = b.get(from) {
                chat.insert(to.into(), v.clone());
            }
        }
        if let Some(t) = b.num("temperature", 0.0, 1.0)? {
            chat.insert("temperature".into(), t.into());
        }
        if let Some(s) = b.get("stop_sequences") {
            extras.stop_strings = Some(stop_sequences(s)?);
        }
    }
    if let Some(tools) = b.get("tools") {
        let Value::Array(list) = tools else { return Err(invalid("tools", "'tools' must be a list")) };
        let mut out = Vec::new();
        for t in list {
            let name = t.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| invalid("tools", "every tool needs a 'name'"))?;
            if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
                return Err(invalid("tools", format!("server tools ('{}') are not supported", clip(kind))));
            }
            let schema = t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}));
            let mut f = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    let mut forced = false;
    if let Some(choice) = b.object("tool_choice")? {
        forced = matches!(choice.str("type")?, Some("any" | "tool"));
        let v = match choice.str("type")? {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                let name = choice.str("name")?.ok_or_else(|| invalid("tool_choice", "'tool' needs a 'name'"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            _ => return Err(invalid("tool_choice", "'tool_choice.type' must be auto, any, tool or none")),
        };
        chat.insert("tool_choice".into(), v);
        if choice.bool("disable_parallel_tool_use")? == Some(true) {
            chat.insert("parallel_tool_calls".into(), false.into());
        }
    }
    if let Some(oc) = b.object("output_config")? {
        if let Some(f) = oc.object("format")? {
            match (f.str("type")?, f.get("schema")) {
                (Some("json_schema"), Some(schema)) => {
                    let rf = json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema,
                                                                          "strict": true}});
                    chat.insert("response_format".into(), rf);
                }
                _ => {
                    let msg = "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": ...}";
                    return Err(invalid("output_config", msg));
                }
            }
        }
    }
    let mut thinking = false;
    if let Some(t) = b.object("thinking")? {
        thinking = match t.str("type")? {
            Some("enabled" | "adaptive" | "between_tools") => true,
            Some("disabled") => false,
            _ => return Err(invalid("thinking", "'thinking.type' must be enabled, adaptive or disabled")),
        };
        if thinking {
            if let Some(budget) = t.int("budget_tokens", 1, i64::from(u32::MAX))? {
                extras.reasoning_budget = Some(budget as usize);
            }
        }
    }
    if thinking && forced {
        return Err(invalid(
            "tool_choice",
            "Thinking may not be enabled when tool_choice forces tool use: use tool_choice 'auto' or 'none', or \
             disable thinking",
        ));
    }
    chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": thinking}));
    Ok((Body(chat), extras))
}

/// The Anthropic stop reason of a choice.
fn stop_reason(end: &ChoiceEnd) -> &'static str {
    match end.finish {
        FinishReason::Length => "max_tokens",
        FinishReason::Stop if end.calls > 0 => "tool_use",
        FinishReason::Stop if end.stop_string.is_some() => "stop_sequence",
        FinishReason::Stop => "end_turn",
    }
}

fn tool_id(id: &str) -> String {
    format!("toolu_{}", id.trim_start_matches("call_"))
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

/// The kind of content block open in a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    Tool,
}

/// The `signature` of a thinking block whose text hashed to `h`. Anthropic's clients expect one (streamed as a
/// `signature_delta` before the block's end) and send it back with the block; tern does not check it. Streamed
/// and not, the same text gets the same signature.
fn signature(h: &DefaultHasher) -> String {
    format!("tern{:016x}", h.finish())
}

fn signature_of(text: &str) -> String {
    let mut h = DefaultHasher::new();
    h.write(text.as_bytes());
    signature(&h)
}

/// `/v1/messages`.
#[derive(Default)]
pub(crate) struct MessagesWriter {
    /// The open block and its index; blocks so far.
    open: Option<Block>,
    blocks: usize,
    /// The open thinking block's text, hashed for its signature.
    thinking: DefaultHasher,
}

impl MessagesWriter {
    fn stop_block(&mut self) -> String {
        match self.open.take() {
            Some(kind) => {
                let mut out = String::new();
                if kind == Block::Thinking {
                    out += &self.delta(json!({"type": "signature_delta", "signature": signature(&self.thinking)}));
                }
                out + &sse_named("content_block_stop", &json!({"type": "content_block_stop", "index": self.blocks - 1}))
            }
            None => String::new(),
        }
    }

    fn start_block(&mut self, kind: Block, block: Value) -> String {
        let mut out = self.stop_block();
        out += &sse_named(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.blocks, "content_block": block}),
        );
        self.open = Some(kind);
        self.blocks += 1;
        out
    }

    fn delta(&self, delta: Value) -> String {
        sse_named(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}),
        )
    }
}

impl Writer for MessagesWriter {
    fn open(&mut self, m: &Meta) -> String {
        let message = json!({"id": m.id, "type": "message", "role": "assistant", "model": m.model, "content": [],
                             "stop_reason": null, "stop_sequence": null,
                             "usage": {"input_tokens": m.prompt_tokens, "output_tokens": 0,
                                       "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}});
        sse_named("message_start", &json!({"type": "message_start", "message": message}))
            + &sse_named("ping", &json!({"type": "ping"}))
    }

    fn piece(&mut self, _m: &Meta, _i: usize, p: &Piece, _lps: Vec<TokenLogprob>) -> String {
        match p {
            Piece::Reasoning(s) => {
                let mut out = String::new();
                if self.open != Some(Block::Thinking) {
                    out += &self
                        .start_block(Block::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}));
                    self.thinking = DefaultHasher::new();
                }
                self.thinking.write(s.as_bytes());
                out + &self.delta(json!({"type": "thinking_delta", "thinking": s}))
            }
            Piece::Content(s) => {
                let mut out = String::new();
                if self.open != Some(Block::Text) {
                    out += &self.start_block(Block::Text, json!({"type": "text", "text": ""}));
                }
                out + &self.delta(json!({"type": "text_delta", "text": s}))
            }
            Piece::CallStart { id, name, .. } => {
                self.start_block(Block::Tool, json!({"type": "tool_use", "id": tool_id(id), "name": name, "input": {}}))
            }
            Piece::CallArgs { args, .. } => self.delta(json!({"type": "input_json_delta", "partial_json": args})),
            Piece::CallEnd => self.stop_block(),
        }
    }

    fn choice_end(&mut self, _m: &Meta, _i: usize, end: &ChoiceEnd, _lps: Vec<TokenLogprob>) -> String {
        let mut out = self.stop_block();
        out += &sse_named(
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(end), "stop_sequence": end.stop_string},
                    "usage": {"output_tokens": end.usage.completion_tokens}}),
        );
        out + &sse_named("message_stop", &json!({"type": "message_stop"}))
    }

    fn close(&mut self, _m: &Meta, _usage: &Usage) -> String {
        String::new()
    }

    fn error(&mut self, _m: &Meta, message: &str) -> String {
        sse_named("error", &json!({"type": "error", "error": {"type": "api_error", "message": message}}))
    }

    fn body(&self, m: &Meta, choices: &[Collected], usage: &Usage) -> Value {
        let Some(c) = choices.first() else { return json!({}) };
        let mut content: Vec<Value> = Vec::new();
        for p in &c.order {
            let last = content.last_mut();
            match p {
                Piece::Reasoning(s) => match last {
                    Some(b) if b["type"] == "thinking" => {
                        b["thinking"] = format!("{}{s}", b["thinking"].as_str().unwrap_or_default()).into()
                    }
                    _ => content.push(json!({"type": "thinking", "thinking": s, "signature": ""})),
                },
                Piece::Content(s) => match last {
                    Some(b) if b["type"] == "text" => {
                        b["text"] = format!("{}{s}", b["text"].as_str().unwrap_or_default()).into()
                    }
                    _ => content.push(json!({"type": "text", "text": s})),
                },
                Piece::CallStart { index, id, name } => {
                    let args = c.calls.get(*index).map_or("{}", |k| k.arguments.as_str());
                    let input: Value = serde_json::from_str(args).unwrap_or_else(|_| json!({}));
                    content.push(json!({"type": "tool_use", "id": tool_id(id), "name": name, "input": input}));
                }
                Piece::CallArgs { .. } | Piece::CallEnd => {}
            }
        }
        for b in content.iter_mut().filter(|b| b["type"] == "thinking") {
            b["signature"] = signature_of(b["thinking"].as_str().unwrap_or_default()).into();
        }
        let (reason, stop) = c.end.as_ref().map_or(("end_turn", None), |e| (stop_reason(e), e.stop_string.clone()));
        json!({"id": m.id, "type": "message", "role": "assistant", "model": m.model, "content": content,
               "stop_reason": reason, "stop_sequence": stop, "usage": usage_json(usage)})
    }

    fn reason(&self, end: &ChoiceEnd) -> String {
        stop_reason(end).to_owned()
    }
}
