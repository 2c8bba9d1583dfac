//! Streaming parser for model output: splits text deltas into reasoning, content and
//! Qwen XML tool calls, converted to OpenAI-style `{name, arguments: JSON string}`.
//!
//! Output starts inside reasoning (the generation prompt opens `<think>\n`) unless thinking
//! is off; `</think>` ends it, and so does a `<tool_call>` inside unfinished reasoning.
//! Newlines around tags that the template puts there (`\n</think>\n\n`, `\n\n<tool_call>`)
//! are dropped. Results do not depend on how the text is split into deltas.
//!
//! Tool calls stream as OpenAI clients read them: the name as soon as `<function=NAME>` is
//! complete, then the arguments object in pieces — a string-typed parameter's text as it
//! arrives, any other parameter when its value is complete — then the end of the call.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

const THINK_END: &str = "</think>";
const TOOL_START: &str = "<tool_call>";
const TOOL_END: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAM: &str = "<parameter=";
const PARAM_END: &str = "</parameter>";
/// What ends a parameter's value (the first of them).
const VALUE_ENDS: [&str; 4] = [PARAM_END, PARAM, FUNCTION_END, TOOL_END];
/// What the body of a function holds besides parameters.
const BODY_TAGS: [&str; 3] = [PARAM, FUNCTION_END, TOOL_END];

/// One parsed piece of output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseEvent {
    Reasoning(String),
    Content(String),
    /// A tool call begins; its name is known.
    ToolCallStart {
        name: String,
    },
    /// More of the current call's arguments: the pieces of one call concatenate to its arguments, a JSON object
    /// (compact, in the order the model wrote the parameters).
    ToolCallArgs(String),
    /// The current call is complete.
    ToolCallEnd,
}

/// A complete tool call; `arguments` is a JSON object serialized as a string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// The calls among `events` (the start and argument events of each put together).
    pub fn collect(events: &[ParseEvent]) -> Vec<ToolCall> {
        let mut calls: Vec<ToolCall> = Vec::new();
        for e in events {
            match e {
                ParseEvent::ToolCallStart { name } => {
                    calls.push(ToolCall { name: name.clone(), arguments: String::new() })
                }
                ParseEvent::ToolCallArgs(a) => {
                    if let Some(c) = calls.last_mut() {
                        c.arguments.push_str(a);
                    }
                }
                _ => {}
            }
        }
        calls
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    ToolCall(Call),
}

/// Where a tool call stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    /// After `<tool_call>`, before `<function=NAME>`.
    Head,
    /// In the function's body; `params` parameters written so far.
    Body { name: String, params: usize },
    /// In a parameter's value.
    Value(Value),
    /// After `</function>`, before `</tool_call>`.
    Closed,
    /// A call kept as text (a function not offered, or no function header): all of it so far.
    Raw(String),
}

/// A parameter value being read. A string-typed one streams as it comes (JSON-escaped, after its opening
/// quote); any other is converted whole at its end.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Value {
    name: String,
    key: String,
    /// Parameters of the call before this one.
    index: usize,
    string: bool,
    /// String-typed: the opening `"key":"` went out; the leading newline (stripped) is settled.
    open: bool,
    lead_done: bool,
    /// Text not sent yet: the whole value (not string-typed), or a withheld final newline.
    pending: String,
}

/// Streaming output parser for one generation.
pub struct OutputParser {
    /// Tool name → parameter name → JSON schema of that parameter.
    schemas: HashMap<String, Map<String, Json>>,
    /// Calls to functions not in `schemas` come back as text (else every call is a call).
    only_offered: bool,
    state: State,
    /// Unprocessed text (a possible partial tag, or a tool call body).
    buf: String,
    /// Newlines withheld at the end of the current text segment.
    newlines: String,
    /// Drop leading newlines of the next text (just after a closing tag).
    skip_newlines: bool,
}

impl OutputParser {
    /// `tools` are the OpenAI tool definitions offered in the prompt (used to type arguments);
    /// `thinking` says whether output starts inside reasoning.
    pub fn new(tools: &[Json], thinking: bool) -> Self {
        let schemas = tools
            .iter()
            .filter_map(|tool| {
                let f = tool.get("function").unwrap_or(tool);
                let name = f.get("name")?.as_str()?.to_string();
                let props = f.pointer("/parameters/properties").and_then(Json::as_object).cloned().unwrap_or_default();
                Some((name, props))
            })
            .collect();
        Self {
            schemas,
            only_offered: false,
            state: if thinking { State::Reasoning } else { State::Content },
            buf: String::new(),
            newlines: String::new(),
            skip_newlines: false,
        }
    }

    /// Calls to a function that is not among the tools come back as content, the text the model wrote.
    pub fn only_offered(mut self) -> Self {
        self.only_offered = true;
        self
    }

    /// Feeds a text delta; returns the events it completes.
    pub fn feed(&mut self, delta: &str) -> Vec<ParseEvent> {
        self.buf.push_str(delta);
        let mut events = Vec::new();
        loop {
            match std::mem::replace(&mut self.state, State::Content) {
                State::ToolCall(call) => {
                    let (next, more) = self.advance(call, &mut events);
                    match next {
                        Some(call) => self.state = State::ToolCall(call),
                        None => self.enter(State::Content),
                    }
                    if !more {
                        break;
                    }
                }
                state => {
                    let reasoning = state == State::Reasoning;
                    self.state = state;
                    let tags: &[&str] = if reasoning { &[THINK_END, TOOL_START] } else { &[TOOL_START] };
                    let Some((pos, tag)) = first_of(&self.buf, tags) else {
                        let keep = partial_tag_len(&self.buf, tags);
                        let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.text(&text, false, &mut events);
                        break;
                    };
                    let text: String = self.buf.drain(..pos + tag.len()).collect();
                    self.text(&text[..pos], true, &mut events);
                    self.enter(if tag == TOOL_START { State::ToolCall(Call::Head) } else { State::Content });
                }
            }
        }
        events
    }

    /// Ends the stream: emits withheld text; an unterminated tool call is completed if it has a
    /// `<function=...>` header, else returned as content.
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match std::mem::replace(&mut self.state, State::Content) {
            State::ToolCall(call) => {
                self.newlines.clear();
                match call {
                    Call::Head => self.text(&format!("{TOOL_START}{rest}"), false, &mut events),
                    Call::Raw(raw) => self.text(&(raw + &rest), false, &mut events),
                    Call::Body { .. } => events.extend([ParseEvent::ToolCallArgs("}".into()), ParseEvent::ToolCallEnd]),
                    Call::Value(mut v) => {
                        let mut args = self.value_end(&mut v, &rest);
                        args.push('}');
                        events.extend([ParseEvent::ToolCallArgs(args), ParseEvent::ToolCallEnd]);
                    }
                    Call::Closed => {}
                }
            }
            state => {
                self.state = state;
                self.text(&rest, false, &mut events);
            }
        }
        let newlines = std::mem::take(&mut self.newlines);
        self.emit(newlines, &mut events);
        events
    }

    /// One move of the tool-call state machine over `buf`: the next state (`None`: back to content) and whether
    /// to go on (false: it needs more text).
    fn advance(&mut self, call: Call, events: &mut Vec<ParseEvent>) -> (Option<Call>, bool) {
        match call {
            Call::Head => {
                let lead = self.buf.len() - self.buf.trim_start().len();
                let rest = &self.buf[lead..];
                if rest.starts_with(FUNCTION) {
                    let Some(end) = rest.find('>') else {
                        // A header cut by the end of the call is no header.
                        if rest.contains(TOOL_END) {
                            return (Some(Call::Raw(TOOL_START.to_owned())), true);
                        }
                        return (Some(Call::Head), false);
                    };
                    let name = rest[FUNCTION.len()..end].trim().to_string();
                    if self.only_offered && !self.schemas.contains_key(&name) {
                        return (Some(Call::Raw(TOOL_START.to_owned())), true);
                    }
                    self.buf.drain(..lead + end + 1);
                    events.push(ParseEvent::ToolCallStart { name: name.clone() });
                    events.push(ParseEvent::ToolCallArgs("{".into()));
                    (Some(Call::Body { name, params: 0 }), true)
                } else if FUNCTION.starts_with(rest) {
                    (Some(Call::Head), false)
                } else {
                    (Some(Call::Raw(TOOL_START.to_owned())), true)
                }
            }
            Call::Raw(mut raw) => match self.buf.find(TOOL_END) {
                Some(end) => {
                    raw.extend(self.buf.drain(..end + TOOL_END.len()));
                    self.state = State::Content;
                    self.text(&raw, true, events);
                    (None, true)
                }
                None => {
                    let keep = partial_tag_len(&self.buf, &[TOOL_END]);
                    raw.extend(self.buf.drain(..self.buf.len() - keep));
                    (Some(Call::Raw(raw)), false)
                }
            },
            Call::Body { name, params } => {
                let Some((pos, tag)) = first_of(&self.buf, &BODY_TAGS) else {
                    // Text between parameters is dropped; a partial tag waits.
                    let keep = partial_tag_len(&self.buf, &BODY_TAGS);
                    self.buf.drain(..self.buf.len() - keep);
                    return (Some(Call::Body { name, params }), false);
                };
                if tag == PARAM {
                    let Some(end) = self.buf[pos..].find('>') else {
                        return (Some(Call::Body { name, params }), false);
                    };
                    let key = self.buf[pos + PARAM.len()..pos + end].trim().to_string();
                    self.buf.drain(..pos + end + 1);
                    let string = param_type(self.schemas.get(&name).and_then(|p| p.get(&key))) == Some("string");
                    let v = Value {
                        name,
                        key,
                        index: params,
                        string,
                        open: false,
                        lead_done: false,
                        pending: String::new(),
                    };
                    return (Some(Call::Value(v)), true);
                }
                self.buf.drain(..pos + tag.len());
                events.extend([ParseEvent::ToolCallArgs("}".into()), ParseEvent::ToolCallEnd]);
                if tag == FUNCTION_END {
                    (Some(Call::Closed), true)
                } else {
                    (None, true)
                }
            }
            Call::Value(mut v) => match first_of(&self.buf, &VALUE_ENDS) {
                Some((pos, tag)) => {
                    let text: String = self.buf.drain(..pos).collect();
                    if tag == PARAM_END {
                        self.buf.drain(..tag.len());
                    }
                    let args = self.value_end(&mut v, &text);
                    events.push(ParseEvent::ToolCallArgs(args));
                    (Some(Call::Body { name: v.name, params: v.index + 1 }), true)
                }
                None => {
                    let keep = partial_tag_len(&self.buf, &VALUE_ENDS);
                    let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                    v.pending.push_str(&text);
                    if v.string {
                        if let Some(out) = stream_string(&mut v) {
                            events.push(ParseEvent::ToolCallArgs(out));
                        }
                    }
                    (Some(Call::Value(v)), false)
                }
            },
            Call::Closed => match self.buf.find(TOOL_END) {
                Some(end) => {
                    self.buf.drain(..end + TOOL_END.len());
                    (None, true)
                }
                None => {
                    let keep = partial_tag_len(&self.buf, &[TOOL_END]);
                    self.buf.drain(..self.buf.len() - keep);
                    (Some(Call::Closed), false)
                }
            },
        }
    }

    /// The arguments text that completes value `v`, whose last text is `text`.
    fn value_end(&self, v: &mut Value, text: &str) -> String {
        v.pending.push_str(text);
        let mut raw = v.pending.as_str();
        if !v.lead_done {
            raw = raw.strip_prefix('\n').unwrap_or(raw);
        }
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        if v.string {
            let mut out = if v.open { String::new() } else { key_prefix(&v.key, v.index) + "\"" };
            out.push_str(&json_escape(raw));
            out.push('"');
            return out;
        }
        let schema = self.schemas.get(&v.name).and_then(|p| p.get(&v.key));
        key_prefix(&v.key, v.index) + &convert_value(raw, schema).to_string()
    }

    fn enter(&mut self, state: State) {
        self.state = state;
        self.newlines.clear();
        self.skip_newlines = true;
    }

    /// Emits a text segment of the current state, withholding trailing newlines; at a tag
    /// (`at_tag`) withheld newlines are dropped.
    fn text(&mut self, text: &str, at_tag: bool, events: &mut Vec<ParseEvent>) {
        let mut text = text;
        if self.skip_newlines {
            text = text.trim_start_matches('\n');
            self.skip_newlines = text.is_empty();
        }
        let body = text.trim_end_matches('\n');
        if !body.is_empty() {
            let out = std::mem::take(&mut self.newlines) + body;
            self.emit(out, events);
        }
        if at_tag {
            self.newlines.clear();
        } else {
            self.newlines.push_str(&text[body.len()..]);
        }
    }

    fn emit(&self, text: String, events: &mut Vec<ParseEvent>) {
        if text.is_empty() {
            return;
        }
        events.push(match self.state {
            State::Reasoning => ParseEvent::Reasoning(text),
            _ => ParseEvent::Content(text),
        });
    }
}

/// The arguments text a string-typed value's pending text settles: everything but its first character if that is
/// the (stripped) leading newline, and but a final newline (maybe the stripped trailing one), which stays pending.
fn stream_string(v: &mut Value) -> Option<String> {
    if !v.lead_done {
        if v.pending.is_empty() {
            return None;
        }
        if v.pending.starts_with('\n') {
            v.pending.remove(0);
        }
        v.lead_done = true;
    }
    let keep = usize::from(v.pending.ends_with('\n'));
    let text: String = v.pending.drain(..v.pending.len() - keep).collect();
    if text.is_empty() && v.open {
        return None;
    }
    let mut out = if v.open { String::new() } else { key_prefix(&v.key, v.index) + "\"" };
    v.open = true;
    out.push_str(&json_escape(&text));
    Some(out)
}

/// `"key":` (after a comma unless it is the first parameter).
fn key_prefix(key: &str, index: usize) -> String {
    let sep = if index > 0 { "," } else { "" };
    format!("{sep}{}:", Json::String(key.to_owned()))
}

/// `s` as the inside of a JSON string.
fn json_escape(s: &str) -> String {
    let quoted = Json::String(s.to_owned()).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

/// The earliest of `tags` in `text`, with its position.
fn first_of<'t>(text: &str, tags: &[&'t str]) -> Option<(usize, &'t str)> {
    tags.iter().filter_map(|t| text.find(t).map(|pos| (pos, *t))).min()
}

/// The type a parameter's value is read as: its schema's `type`, or the first of a list of types that is not
/// `null`. A value read as a string is the raw text; any other is converted (see [`convert_value`]).
pub(crate) fn param_type(schema: Option<&Json>) -> Option<&str> {
    schema.and_then(|s| match s.get("type") {
        Some(Json::String(t)) => Some(t.as_str()),
        Some(Json::Array(ts)) => ts.iter().filter_map(Json::as_str).find(|t| *t != "null"),
        _ => None,
    })
}

/// Converts a parameter's text by its schema `type`; without a usable type (or if the text
/// does not fit it), parses it as JSON, falling back to the string itself.
fn convert_value(raw: &str, schema: Option<&Json>) -> Json {
    let json_or_string = || serde_json::from_str(raw.trim()).unwrap_or_else(|_| Json::String(raw.to_string()));
    let trimmed = raw.trim();
    match param_type(schema) {
        Some("string") => Json::String(raw.to_string()),
        Some("integer" | "number") => trimmed
            .parse::<i64>()
            .map(Json::from)
            .ok()
            .or_else(|| trimmed.parse::<f64>().ok().and_then(serde_json::Number::from_f64).map(Json::Number))
            .unwrap_or_else(json_or_string),
        Some("boolean") => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Json::Bool(true),
            "false" => Json::Bool(false),
            _ => json_or_string(),
        },
        _ => json_or_string(),
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    tags.iter().flat_map(|tag| (1..tag.len()).filter(|&n| text.ends_with(&tag[..n]))).max().unwrap_or(0)
}
