//! The OpenAI Responses API, stateless: `POST /v1/responses` with `store` false or absent.
//!
//! `input` (a string, or items: messages with `input_text` / `output_text` parts, `function_call`,
//! `function_call_output`, `reasoning` items), `instructions`, function `tools`, `tool_choice`,
//! `parallel_tool_calls`, `max_output_tokens`, temperature, top_p, `reasoning.effort` (none / minimal: thinking
//! off) and `text.format` (text, json_object, json_schema) are translated into a chat request. The output is
//! a `reasoning` item (the model's reasoning as `reasoning_text`), a `message` with one `output_text`, and
//! `function_call` items. Streaming sends `response.created`, `response.in_progress`, per item
//! `response.output_item.added`, its parts and deltas (`response.reasoning_text.delta`,
//! `response.output_text.delta`, `response.function_call_arguments.delta`) and `.done` events, then
//! `response.completed` (or `response.incomplete` when `max_output_tokens` cut it). What needs stored state
//! (`previous_response_id`, `conversation`, `store: true`, `background`) is a 400 naming the field.

use serde_json::{json, Map, Value};
use tern_engine::{FinishReason, TokenLogprob, Usage};

use crate::api::{clip, ApiError, Body};
use crate::generate::{new_id, sse_named, ChoiceEnd, Collected, Meta, Piece, Writer};

const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "reasoning",
    "text",
    "store",
    "metadata",
    "user",
    "truncation",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "include",
];
const STATEFUL: &[&str] = &["previous_response_id", "conversation", "background", "prompt"];

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// Message content as chat content: a string, or a list of text and `input_image` parts (the text joined when
/// there is no image, else chat `text` and `image_url` parts; images are checked where chat images are,
/// [`crate::images`]).
fn content_text(v: &Value, param: &str) -> Result<Value, ApiError> {
    let parts = match v {
        Value::String(s) => return Ok(Value::String(s.clone())),
        Value::Array(parts) => parts,
        _ => return Err(invalid(param, "'content' must be a string or a list of parts")),
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let part = match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
            (Some("input_text" | "output_text" | "text"), Some(t)) => json!({"type": "text", "text": t}),
            (Some(kind @ ("input_text" | "output_text" | "text")), None) => {
                let field = format!("{param}[{j}].text");
                return Err(invalid(&field, format!("{field}: an '{kind}' part needs a 'text' string")));
            }
            (Some("input_image"), _) => {
                let field = format!("{param}[{j}]");
                match (p.get("image_url").and_then(Value::as_str), p.get("file_id")) {
                    (Some(url), _) => json!({"type": "image_url", "image_url": {"url": url}}),
                    (None, Some(f)) if !f.is_null() => {
                        return Err(invalid(&field, "input_image 'file_id' is not supported (tern has no Files API); send a data: URL as 'image_url'"));
                    }
                    _ => return Err(invalid(&field, "an 'input_image' part needs an 'image_url' (a data: URL)")),
                }
            }
            (Some(t), _) => {
                return Err(invalid(param, format!("'{}' content is not supported (text and input_image)", clip(t))))
            }
            _ => return Err(invalid(param, "a content part needs a 'type' and a 'text'")),
        };
        out.push(part);
    }
    if out.iter().all(|p| p["type"] == "text") {
        return Ok(Value::String(out.iter().filter_map(|p| p["text"].as_str()).collect()));
    }
    Ok(Value::Array(out))
}

/// The chat messages of `input` (and `instructions`).
fn messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::new();
    if let Some(i) = b.str("instructions")? {
        out.push(json!({"role": "system", "content": i}));
    }
    let items = match b.get("input") {
        Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Value::Array(a)) if !a.is_empty() => a.clone(),
        _ => return Err(invalid("input", "'input' must be a string or a non-empty list of items")),
    };
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer") => "system",
                    Some(r @ ("system" | "user" | "assistant")) => r,
                    _ => {
                        return Err(invalid(
                            &format!("{param}.role"),
                            "'role' must be user, assistant, system or developer",
                        ))
                    }
                };
                let text = content_text(item.get("content").unwrap_or(&Value::Null), &format!("{param}.content"))?;
                let mut m = json!({"role": role, "content": text});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = r.into();
                    }
                }
                out.push(m);
            }
            "function_call" => {
                let name = item
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(&param, "a function_call needs a 'name'"))?;
                let args = item.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                let call = json!({"id": item.get("call_id").cloned().unwrap_or(Value::Null), "type": "function",
                                  "function": {"name": name, "arguments": args}});
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && reasoning.is_none() => {
                        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
                            calls.push(call);
                        } else {
                            m["tool_calls"] = json!([call]);
                        }
                    }
                    _ => {
                        let mut m = json!({"role": "assistant", "content": "", "tool_calls": [call]});
                        if let Some(r) = reasoning.take() {
                            m["reasoning_content"] = r.into();
                        }
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(v @ (Value::String(_) | Value::Array(_))) => content_text(v, &format!("{param}.output"))?,
                    _ => return Err(invalid(&param, "a function_call_output needs an 'output'")),
                };
                out.push(json!({"role": "tool", "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                                "content": output}));
            }
            "reasoning" => {
                let texts = |key: &str| {
                    item.get(key).and_then(Value::as_array).map_or(String::new(), |a| {
                        a.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
                    })
                };
                let text = Some(texts("content")).filter(|t| !t.is_empty()).unwrap_or_else(|| texts("summary"));
                reasoning = Some(reasoning.unwrap_or_default() + &text);
            }
            other => return Err(invalid(&param, format!("input items of type '{}' are not supported", clip(other)))),
        }
    }
    Ok(out)
}

/// Translate a Responses request into a chat request.
pub(crate) fn to_chat(b: &Body) -> Result<Body, ApiError> {
    for key in b.0.keys() {
        if STATEFUL.contains(&key.as_str()) && b.get(key).is_some_and(|v| v != &Value::Bool(false)) {
            return Err(invalid(key, format!("'{key}' is not supported: tern's Responses API is stateless")));
        }
        if !FIELDS.contains(&key.as_str()) && !STATEFUL.contains(&key.as_str()) {
            return Err(invalid(&clip(key), format!("unknown field '{}': tern does not implement it", clip(key))));
        }
    }
    if b.get("store").is_some_and(|s| s == &Value::Bool(true)) {
        return Err(invalid("store", "tern's Responses API is stateless: 'store' must be false or absent"));
    }
    if b.get("include").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        return Err(invalid("include", "'include' is not supported"));
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages(b)?));
    // (max_output_tokens keeps its name: errors about it name it)
    for (from, to) in [
        ("max_output_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ] {
        if let Some(v) = b.get(from) {
            chat.insert(to.into(), v.clone());
        }
    }
    if let Some(Value::Array(tools)) = b.get("tools") {
        let mut out = Vec::new();
        for t in tools {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                let kind = t.get("type").and_then(Value::as_str).unwrap_or("?");
                return Err(invalid(
                    "tools",
                    format!("'{}' tools are not supported (function tools only)", clip(kind)),
                ));
            }
            let mut f = Map::new();
            for k in ["name", "description", "parameters", "strict"] {
                if let Some(v) = t.get(k) {
                    f.insert(k.into(), v.clone());
                }
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    } else if b.get("tools").is_some() {
        return Err(invalid("tools", "'tools' must be a list"));
    }
    match b.get("tool_choice") {
        None => {}
        Some(Value::String(s)) => {
            chat.insert("tool_choice".into(), s.clone().into());
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").cloned().unwrap_or(Value::Null);
            chat.insert("tool_choice".into(), json!({"type": "function", "function": {"name": name}}));
        }
        Some(_) => return Err(invalid("tool_choice", "'tool_choice' must be auto, none, required or a function")),
    }
    if let Some(r) = b.object("reasoning")? {
        if let Some(e) = r.str("effort")? {
            chat.insert("reasoning_effort".into(), e.into());
        }
    }
    if let Some(t) = b.object("text")? {
        if let Some(f) = t.object("format")? {
            let rf = match f.str("type")? {
                None | Some("text") => json!({"type": "text"}),
                Some("json_object") => json!({"type": "json_object"}),
                Some("json_schema") => {
                    // (It answered 200 unconstrained without a schema; OpenAI requires one.)
                    let schema = f.get("schema").cloned().ok_or_else(|| {
                        invalid("text.format.schema", "text.format of type 'json_schema' needs a 'schema'")
                    })?;
                    let known = ["type", "name", "schema", "strict", "description"];
                    if let Some(k) = f.0.keys().find(|k| !known.contains(&k.as_str())) {
                        let msg = format!("unknown field '{}' in text.format: tern does not implement it", clip(k));
                        return Err(invalid(&format!("text.format.{}", clip(k)), msg));
                    }
                    json!({"type": "json_schema", "json_schema": {
                        "name": f.get("name").cloned().unwrap_or(Value::Null),
                        "schema": schema,
                        "strict": f.get("strict").cloned().unwrap_or(Value::Null)}})
                }
                Some(other) => return Err(invalid("text", format!("text.format '{}' is not supported", clip(other)))),
            };
            chat.insert("response_format".into(), rf);
        }
    }
    Ok(Body(chat))
}

/// The request's settings echoed in the response object.
pub(crate) struct Echo {
    pub tools: Value,
    pub tool_choice: Value,
    pub parallel: bool,
    pub temperature: Value,
    pub top_p: Value,
    pub max_output_tokens: Value,
    pub instructions: Value,
    pub metadata: Value,
    pub text: Value,
}

impl Echo {
    pub fn of(b: &Body) -> Echo {
        let get = |k: &str| b.get(k).cloned().unwrap_or(Value::Null);
        Echo {
            tools: b.get("tools").cloned().unwrap_or_else(|| json!([])),
            tool_choice: b.get("tool_choice").cloned().unwrap_or_else(|| json!("auto")),
            parallel: b.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(true),
            temperature: get("temperature"),
            top_p: get("top_p"),
            max_output_tokens: get("max_output_tokens"),
            instructions: get("instructions"),
            metadata: b.get("metadata").cloned().unwrap_or_else(|| json!({})),
            text: b.get("text").cloned().unwrap_or_else(|| json!({"format": {"type": "text"}})),
        }
    }
}

/// An output item being streamed.
enum Item {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call_id: String, name: String, args: String },
}

/// `/v1/responses`.
pub(crate) struct ResponsesWriter {
    echo: Echo,
    seq: u64,
    /// Items done, and the one open.
    done: Vec<Value>,
    open: Option<Item>,
}

impl ResponsesWriter {
    pub fn new(echo: Echo) -> ResponsesWriter {
        ResponsesWriter { echo, seq: 0, done: Vec::new(), open: None }
    }

    fn event(&mut self, kind: &str, mut v: Value) -> String {
        v["type"] = kind.into();
        v["sequence_number"] = self.seq.into();
        self.seq += 1;
        sse_named(kind, &v)
    }

    fn response(
        &self,
        m: &Meta,
        status: &str,
        output: Vec<Value>,
        usage: Option<&Usage>,
        end: Option<&ChoiceEnd>,
    ) -> Value {
        let incomplete =
            end.filter(|e| e.finish == FinishReason::Length).map(|_| json!({"reason": "max_output_tokens"}));
        let e = &self.echo;
        let mut r = json!({
            "id": m.id, "object": "response", "created_at": m.created, "status": status,
            "incomplete_details": incomplete, "error": null, "model": m.model, "output": output,
            "instructions": e.instructions, "metadata": e.metadata, "parallel_tool_calls": e.parallel,
            "temperature": e.temperature, "top_p": e.top_p, "tool_choice": e.tool_choice, "tools": e.tools,
            "max_output_tokens": e.max_output_tokens, "previous_response_id": null, "store": false,
            "reasoning": {"effort": null, "summary": null}, "text": e.text, "truncation": "disabled",
            "usage": null, "user": null,
        });
        if let Some(u) = usage {
            let reasoning = end.map_or(0, |e| e.reasoning_tokens);
            r["usage"] = json!({"input_tokens": u.prompt_tokens,
                                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                                "output_tokens": u.completion_tokens,
                                "output_tokens_details": {"reasoning_tokens": reasoning},
                                "total_tokens": u.prompt_tokens + u.completion_tokens});
        }
        r
    }

    fn item_json(item: &Item, status: &str) -> Value {
        match item {
            Item::Reasoning { id, text } => json!({"type": "reasoning", "id": id, "summary": [],
                                                   "content": [{"type": "reasoning_text", "text": text}],
                                                   "status": status}),
            Item::Message { id, text } => json!({"type": "message", "id": id, "role": "assistant", "status": status,
                                                 "content": [{"type": "output_text", "text": text,
                                                              "annotations": [], "logprobs": []}]}),
            Item::Call { id, call_id, name, args } => json!({"type": "function_call", "id": id, "call_id": call_id,
                                                             "name": name, "arguments": args, "status": status}),
        }
    }

    /// Close the open item: its `.done` events.
    fn close_item(&mut self) -> String {
        let Some(item) = self.open.take() else { return String::new() };
        let index = self.done.len();
        let mut out = String::new();
        match &item {
            Item::Reasoning { id, text } => {
                out += &self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                out += &self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index,
                    "content_index": 0, "part": {"type": "reasoning_text", "text": text}}),
                );
            }
            Item::Message { id, text } => {
                out += &self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index,
                    "content_index": 0, "text": text, "logprobs": []}),
                );
                out += &self.event("response.content_part.done", json!({"item_id": id, "output_index": index,
                    "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}));
            }
            Item::Call { id, name, args, .. } => {
                out += &self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": args, "name": name}),
                );
            }
        }
        let json = Self::item_json(&item, "completed");
        out += &self.event("response.output_item.done", json!({"output_index": index, "item": json.clone()}));
        self.done.push(json);
        out
    }

    fn open_item(&mut self, item: Item) -> String {
        let mut out = self.close_item();
        let index = self.done.len();
        out += &self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": Self::item_json(&item, "in_progress")}),
        );
        match &item {
            Item::Reasoning { id, .. } => {
                out += &self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index,
                    "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
                );
            }
            Item::Message { id, .. } => {
                out += &self.event("response.content_part.added", json!({"item_id": id, "output_index": index,
                    "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}));
            }
            Item::Call { .. } => {}
        }
        self.open = Some(item);
        out
    }
}

impl Writer for ResponsesWriter {
    fn open(&mut self, m: &Meta) -> String {
        let r = self.response(m, "in_progress", vec![], None, None);
        self.event("response.created", json!({"response": r.clone()}))
            + &self.event("response.in_progress", json!({"response": r}))
    }

    fn piece(&mut self, _m: &Meta, _i: usize, p: &Piece, _lps: Vec<TokenLogprob>) -> String {
        let index = self.done.len();
        match p {
            Piece::Reasoning(s) => {
                let mut out = String::new();
                if !matches!(self.open, Some(Item::Reasoning { .. })) {
                    out += &self.open_item(Item::Reasoning { id: new_id("rs_"), text: String::new() });
                }
                let index = self.done.len();
                let Some(Item::Reasoning { id, text }) = &mut self.open else { return out };
                text.push_str(s);
                let id = id.clone();
                out + &self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": s}),
                )
            }
            Piece::Content(s) => {
                let mut out = String::new();
                if !matches!(self.open, Some(Item::Message { .. })) {
                    out += &self.open_item(Item::Message { id: new_id("msg_"), text: String::new() });
                }
                let index = self.done.len();
                let Some(Item::Message { id, text }) = &mut self.open else { return out };
                text.push_str(s);
                let id = id.clone();
                out + &self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index,
                                  "content_index": 0, "delta": s, "logprobs": []}),
                )
            }
            Piece::CallStart { id, name, .. } => self.open_item(Item::Call {
                id: new_id("fc_"),
                call_id: id.clone(),
                name: name.clone(),
                args: String::new(),
            }),
            Piece::CallArgs { args, .. } => {
                let Some(Item::Call { id, args: all, .. }) = &mut self.open else { return String::new() };
                all.push_str(args);
                let id = id.clone();
                self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": args}),
                )
            }
            Piece::CallEnd => self.close_item(),
        }
    }

    fn choice_end(&mut self, m: &Meta, _i: usize, end: &ChoiceEnd, _lps: Vec<TokenLogprob>) -> String {
        let mut out = self.close_item();
        let status = if end.finish == FinishReason::Length { "incomplete" } else { "completed" };
        let usage = Usage { prompt_tokens: m.prompt_tokens, ..end.usage };
        let r = self.response(m, status, self.done.clone(), Some(&usage), Some(end));
        out += &self.event(&format!("response.{status}"), json!({"response": r}));
        out
    }

    fn close(&mut self, _m: &Meta, _usage: &Usage) -> String {
        String::new()
    }

    fn error(&mut self, _m: &Meta, message: &str) -> String {
        self.event("error", json!({"code": "server_error", "message": message, "param": null}))
    }

    fn body(&self, m: &Meta, choices: &[Collected], usage: &Usage) -> Value {
        let Some(c) = choices.first() else { return json!({}) };
        let mut output = Vec::new();
        if !c.reasoning.is_empty() {
            output
                .push(Self::item_json(&Item::Reasoning { id: new_id("rs_"), text: c.reasoning.clone() }, "completed"));
        }
        if !c.content.is_empty() || c.calls.is_empty() {
            output.push(Self::item_json(&Item::Message { id: new_id("msg_"), text: c.content.clone() }, "completed"));
        }
        for k in &c.calls {
            let item = Item::Call {
                id: new_id("fc_"),
                call_id: k.id.clone(),
                name: k.name.clone(),
                args: k.arguments.clone(),
            };
            output.push(Self::item_json(&item, "completed"));
        }
        let status = match &c.end {
            Some(e) if e.finish == FinishReason::Length => "incomplete",
            _ => "completed",
        };
        self.response(m, status, output, Some(usage), c.end.as_ref())
    }

    fn reason(&self, end: &ChoiceEnd) -> String {
        end.openai_reason().to_owned()
    }
}
