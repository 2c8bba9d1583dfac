//! Streaming parser for model output: splits text deltas into reasoning, content and
//! Qwen XML tool calls, converted to OpenAI-style `{name, arguments: JSON string}`.
//!
//! Output starts inside reasoning (the generation prompt opens `<think>\n`) unless thinking
//! is off; `</think>` ends it, and so does a `<tool_call>` inside unfinished reasoning.
//! Newlines around tags that the template puts there (`\n</think>\n\n`, `\n\n<tool_call>`)
//! are dropped. Results do not depend on how the text is split into deltas.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

const THINK_END: &str = "</think>";
const TOOL_START: &str = "<tool_call>";
const TOOL_END: &str = "</tool_call>";

/// One parsed piece of output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseEvent {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// A complete tool call; `arguments` is a JSON object serialized as a string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    ToolCall,
}

/// Streaming output parser for one generation.
pub struct OutputParser {
    /// Tool name → parameter name → JSON schema of that parameter.
    schemas: HashMap<String, Map<String, Json>>,
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
            state: if thinking { State::Reasoning } else { State::Content },
            buf: String::new(),
            newlines: String::new(),
            skip_newlines: false,
        }
    }

    /// Feeds a text delta; returns the events it completes.
    pub fn feed(&mut self, delta: &str) -> Vec<ParseEvent> {
        self.buf.push_str(delta);
        let mut events = Vec::new();
        loop {
            match self.state {
                State::ToolCall => {
                    let Some(end) = self.buf.find(TOOL_END) else {
                        break;
                    };
                    let body: String = self.buf.drain(..end + TOOL_END.len()).collect();
                    events.push(self.tool_call_event(&body[..end]));
                    self.enter(State::Content);
                }
                state => {
                    let tags: &[&str] =
                        if state == State::Reasoning { &[THINK_END, TOOL_START] } else { &[TOOL_START] };
                    let found = tags.iter().filter_map(|t| self.buf.find(t).map(|pos| (pos, *t))).min();
                    let Some((pos, tag)) = found else {
                        let keep = partial_tag_len(&self.buf, tags);
                        let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.text(&text, false, &mut events);
                        break;
                    };
                    let text: String = self.buf.drain(..pos + tag.len()).collect();
                    self.text(&text[..pos], true, &mut events);
                    self.enter(if tag == TOOL_START { State::ToolCall } else { State::Content });
                }
            }
        }
        events
    }

    /// Ends the stream: emits withheld text; an unterminated tool call is parsed if it has a
    /// `<function=...>` header, else returned as content.
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.state == State::ToolCall {
            if rest.contains("<function=") {
                events.push(self.tool_call_event(&rest));
            } else {
                self.state = State::Content;
                self.newlines.clear();
                self.text(&format!("{TOOL_START}{rest}"), false, &mut events);
            }
        } else {
            self.text(&rest, false, &mut events);
        }
        let newlines = std::mem::take(&mut self.newlines);
        self.emit(newlines, &mut events);
        events
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

    /// Parses `<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...</function>`; a body
    /// without a function header is returned as content.
    fn tool_call_event(&self, body: &str) -> ParseEvent {
        match parse_function(body, &self.schemas) {
            Some(call) => ParseEvent::ToolCall(call),
            None => ParseEvent::Content(format!("{TOOL_START}{body}{TOOL_END}")),
        }
    }
}

fn parse_function(body: &str, schemas: &HashMap<String, Map<String, Json>>) -> Option<ToolCall> {
    let start = body.find("<function=")? + "<function=".len();
    let name_end = start + body[start..].find('>')?;
    let name = body[start..name_end].trim().to_string();
    let props = schemas.get(&name);
    let mut args = Map::new();
    let mut rest = &body[name_end + 1..];
    while let Some(p) = rest.find("<parameter=") {
        rest = &rest[p + "<parameter=".len()..];
        let Some(key_end) = rest.find('>') else {
            break;
        };
        let key = rest[..key_end].trim().to_string();
        rest = &rest[key_end + 1..];
        let value_end = ["</parameter>", "<parameter=", "</function>"]
            .iter()
            .filter_map(|t| rest.find(t))
            .min()
            .unwrap_or(rest.len());
        let raw = &rest[..value_end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let schema = props.and_then(|p| p.get(&key));
        args.insert(key, convert_value(raw, schema));
        rest = &rest[value_end..];
    }
    Some(ToolCall { name, arguments: Json::Object(args).to_string() })
}

/// Converts a parameter's text by its schema `type`; without a usable type (or if the text
/// does not fit it), parses it as JSON, falling back to the string itself.
fn convert_value(raw: &str, schema: Option<&Json>) -> Json {
    let json_or_string = || serde_json::from_str(raw.trim()).unwrap_or_else(|_| Json::String(raw.to_string()));
    let ty = schema.and_then(|s| match s.get("type") {
        Some(Json::String(t)) => Some(t.as_str()),
        Some(Json::Array(ts)) => ts.iter().filter_map(Json::as_str).find(|t| *t != "null"),
        _ => None,
    });
    let trimmed = raw.trim();
    match ty {
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
