//! Renders the checkpoint's own Jinja chat template with minijinja, configured to match
//! `transformers.AutoTokenizer.apply_chat_template(..., tokenize=False)` byte for byte:
//! `trim_blocks`/`lstrip_blocks`, Python string methods (pycompat), `raise_exception`,
//! a `tojson` equal to Python's `json.dumps(ensure_ascii=False)` and a Python-style `string`.
//!
//! [`ChatTemplate::render_marked`] renders the same text with the request's own text marked, so that
//! [`Rendered::encode`] reads control and added tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, ...) only where the
//! template wrote them: a message, tool result, tool definition or assistant turn holding `<|im_end|>` reaches the
//! model as that text, not as a turn boundary (as OpenAI's API does; transformers' template and vLLM read them).

use std::borrow::Cow;
use std::path::Path;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::tokenizer::Tokenizer;
use crate::{read_file, read_json, Result, TextError};

const TEMPLATE_NAME: &str = "chat_template";

/// Options for [`ChatTemplate::render`].
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// Append the assistant turn opener (`<|im_start|>assistant\n<think>\n`). Default true.
    pub add_generation_prompt: bool,
    /// `Some(false)` renders an empty think block; `None` leaves the variable undefined.
    pub enable_thinking: Option<bool>,
    /// OpenAI-style tool definitions (`{"type":"function","function":{...}}`), if any.
    pub tools: Option<Vec<Json>>,
    /// Further template variables (e.g. `preserve_thinking`), passed through as-is.
    pub extra: Map<String, Json>,
    /// Leave the last message open for the model to continue (assistant prefill): the prompt ends where that
    /// message's text ends, without the end of its turn (transformers' `continue_final_message`). Use it with
    /// `add_generation_prompt` false.
    pub continue_final_message: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            enable_thinking: None,
            tools: None,
            extra: Map::new(),
            continue_final_message: false,
        }
    }
}

/// A rendered prompt in which the text that came from the request is marked (see [`ChatTemplate::render_marked`]).
#[derive(Clone, Debug)]
pub struct Rendered {
    /// The rendering, with every `<` of the request's text written [`ESC`] `l` (and its [`ESC`]s [`ESC`] `e`).
    marked: String,
}

/// Marks a character of the request's text (Unicode private use: no tokenizer or template gives it a meaning).
const ESC: char = '\u{E000}';

impl Rendered {
    /// The prompt text (borrowed when the request's text holds no `<`).
    pub fn text(&self) -> Cow<'_, str> {
        unescape(&self.marked)
    }

    /// The prompt's token ids: an added token (`<|im_start|>`, `<think>`, ...) wherever the template wrote one, and
    /// the request's text encoded as text in between ([`Tokenizer::encode_text`]). For text holding no added
    /// token's string, the same ids as `tokenizer.encode(&self.text(), false)`, which splits at added tokens in
    /// the same way.
    pub fn encode(&self, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
        Ok(self.encode_within(tokenizer, usize::MAX)?.unwrap_or_default())
    }

    /// [`Self::encode`], or `None` once more than `limit` ids have come (the rest is not tokenised: see
    /// [`Tokenizer::encode_within`]).
    pub fn encode_within(&self, tokenizer: &Tokenizer, limit: usize) -> Result<Option<Vec<u32>>> {
        if !tokenizer.added_tokens_start_with('<') {
            return Err(TextError::Tokenizer(
                "this tokenizer has added tokens that do not start with '<': the request's text cannot be kept apart \
                 from them (serve with --allow-special-in-content)"
                    .into(),
            ));
        }
        let s = self.marked.as_str();
        let (mut ids, mut start, mut at) = (Vec::new(), 0, 0);
        // Every `<` left in the marked text is the template's own: the request's are escaped.
        while let Some(off) = s[at..].find('<') {
            let pos = at + off;
            match tokenizer.added_token_at(&s[pos..]) {
                Some((id, len)) => {
                    let Some(text) = tokenizer.encode_within(&unescape(&s[start..pos]), true, limit - ids.len())?
                    else {
                        return Ok(None);
                    };
                    ids.extend(text);
                    ids.push(id);
                    if ids.len() > limit {
                        return Ok(None);
                    }
                    start = pos + len;
                    at = start;
                }
                None => at = pos + 1,
            }
        }
        let Some(text) = tokenizer.encode_within(&unescape(&s[start..]), true, limit - ids.len())? else {
            return Ok(None);
        };
        ids.extend(text);
        Ok(Some(ids))
    }
}

/// The request's text with every `<` marked (and the marker itself escaped).
fn escape(s: &str) -> Cow<'_, str> {
    if !s.contains(['<', ESC]) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '<' => out.extend([ESC, 'l']),
            ESC => out.extend([ESC, 'e']),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Undoes [`escape`]; a marker the template cut from its letter stays as it is.
fn unescape(s: &str) -> Cow<'_, str> {
    if !s.contains(ESC) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            (ESC, Some('l')) => {
                chars.next();
                out.push('<');
            }
            (ESC, Some('e')) => {
                chars.next();
                out.push(ESC);
            }
            (c, _) => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Every string (and object key) of `v` escaped, in place (only what holds a `<` is rewritten).
fn escape_json(v: &mut Json) {
    match v {
        Json::String(s) => {
            if let Cow::Owned(e) = escape(s) {
                *s = e;
            }
        }
        Json::Array(items) => items.iter_mut().for_each(escape_json),
        Json::Object(map) => escape_map(map),
        _ => {}
    }
}

/// [`escape_json`] of an object's keys and values.
fn escape_map(map: &mut Map<String, Json>) {
    if map.keys().any(|k| k.contains(['<', ESC])) {
        for (k, mut v) in std::mem::take(map) {
            escape_json(&mut v);
            map.insert(escape(&k).into_owned(), v);
        }
    } else {
        map.values_mut().for_each(escape_json);
    }
}

/// What the template does with an assistant message's reasoning written inline (`<think>...</think>` in
/// `content`, no `reasoning_content` string), done before marking so that the template still finds it: the
/// reasoning goes to `reasoning_content` and `content` keeps what follows the last `</think>`. Left as it is
/// (then the tags are text) when that rest starts with a space the template would have kept but trims here.
fn split_inline_reasoning(message: &mut Json) {
    if message.get("role").and_then(Json::as_str) != Some("assistant")
        || matches!(message.get("reasoning_content"), Some(Json::String(_)))
    {
        return;
    }
    let Some(content) = message.get("content").and_then(Json::as_str).map(str::trim) else { return };
    if !content.contains("</think>") {
        return;
    }
    let before = content.split("</think>").next().unwrap_or_default().trim_end_matches('\n');
    let reasoning = before.rsplit("<think>").next().unwrap_or_default().trim_start_matches('\n').to_owned();
    let rest = content.rsplit("</think>").next().unwrap_or_default().trim_start_matches('\n').to_owned();
    if rest.starts_with(char::is_whitespace) {
        return;
    }
    message["reasoning_content"] = Json::String(reasoning);
    message["content"] = Json::String(rest);
}

/// The text the last message ends with, for `continue_final_message` (the last text part of a list).
fn final_text(messages: &[Json]) -> Result<String> {
    let missing =
        || TextError::Template("continue_final_message is set but the final message has no text to continue".into());
    let content = messages.last().and_then(|m| m.get("content")).ok_or_else(missing)?;
    let text = match content {
        Json::String(s) => s.clone(),
        Json::Array(parts) => {
            parts.iter().rev().find_map(|p| p.get("text").and_then(Json::as_str)).ok_or_else(missing)?.to_owned()
        }
        _ => return Err(missing()),
    };
    if text.trim().is_empty() {
        return Err(missing());
    }
    Ok(text)
}

/// transformers' `continue_final_message`: `rendered` cut where the final message's text ends (its trailing
/// whitespace kept if the template kept it).
fn cut_after(rendered: &str, last: &str) -> Result<String> {
    let stripped = last.trim();
    let at = rendered.rfind(stripped).ok_or_else(|| {
        TextError::Template(
            "continue_final_message is set but the final message does not appear in the chat after applying the \
             chat template"
                .into(),
        )
    })?;
    let keep = if last.trim_start().len() == last.len() && rendered[at..].starts_with(last) {
        last.len()
    } else {
        stripped.len()
    };
    Ok(rendered[..at + keep].to_owned())
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Loads `dir/chat_template.jinja`, else `chat_template` from `dir/tokenizer_config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            return Self::from_source(read_file(&jinja)?);
        }
        let config_path = dir.join("tokenizer_config.json");
        match read_json(&config_path)?.get("chat_template") {
            Some(Json::String(src)) => Self::from_source(src.clone()),
            _ => Err(TextError::NoChatTemplate { path: config_path }),
        }
    }

    /// Compiles template source text.
    pub fn from_source(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_filter("string", py_string);
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| TextError::Template(describe(&e)))?;
        Ok(Self { env })
    }

    /// Renders a conversation. Messages are OpenAI-style JSON objects (`role`, `content` as a
    /// string or a list of `{"type":"text","text":...}` parts, `reasoning_content`, `tool_calls`
    /// whose `function.arguments` may be an object or a JSON string). A `raise_exception(msg)`
    /// in the template becomes `Err(TextError::Template(msg))`.
    pub fn render(&self, messages: &[Json], options: &ChatOptions) -> Result<String> {
        let messages: Vec<Json> = messages.iter().map(normalize_message).collect();
        let last = if options.continue_final_message { Some(final_text(&messages)?) } else { None };
        let rendered = self.render_context(options.extra.clone(), messages, options.tools.clone(), options)?;
        match last {
            Some(last) => cut_after(&rendered, &last),
            None => Ok(rendered),
        }
    }

    /// Renders like [`Self::render`] with the request's text marked: every string of the messages, the tools and
    /// the extra variables, so that [`Rendered::encode`] tells the template's own control tokens from text that
    /// merely spells them. An assistant message's inline `<think>...</think>` is split off first as the template
    /// would (see `split_inline_reasoning`); other template tests on text that spells a token (a user message
    /// wrapped in `<tool_response>`) see text.
    pub fn render_marked(&self, messages: &[Json], options: &ChatOptions) -> Result<Rendered> {
        let mut marked: Vec<Json> = messages.iter().map(normalize_message).collect();
        marked.iter_mut().for_each(split_inline_reasoning);
        let last = if options.continue_final_message { Some(final_text(&marked)?) } else { None };
        marked.iter_mut().for_each(escape_json);
        let mut extra = options.extra.clone();
        escape_map(&mut extra);
        let mut tools = options.tools.clone();
        tools.iter_mut().flatten().for_each(escape_json);
        let mut rendered = self.render_context(extra, marked, tools, options)?;
        if let Some(last) = last {
            rendered = cut_after(&rendered, &escape(&last))?;
        }
        Ok(Rendered { marked: rendered })
    }

    fn render_context(
        &self,
        mut ctx: Map<String, Json>,
        messages: Vec<Json>,
        tools: Option<Vec<Json>>,
        options: &ChatOptions,
    ) -> Result<String> {
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert("tools".into(), tools.map_or(Json::Null, Json::Array));
        ctx.insert("add_generation_prompt".into(), Json::Bool(options.add_generation_prompt));
        if let Some(on) = options.enable_thinking {
            ctx.insert("enable_thinking".into(), Json::Bool(on));
        }
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| TextError::Template(describe(&e)))?;
        template.render(Value::from_serialize(&ctx)).map_err(|e| TextError::Template(describe(&e)))
    }
}

/// Parses `tool_calls[].function.arguments` given as a JSON string into an object, as the
/// template iterates arguments with `|items`.
fn normalize_message(message: &Json) -> Json {
    let mut message = message.clone();
    if let Some(Json::Array(calls)) = message.get_mut("tool_calls") {
        for call in calls {
            let target = match call.get_mut("function") {
                Some(f) => f,
                None => call,
            };
            if let Some(args) = target.get_mut("arguments") {
                if let Json::String(s) = args {
                    if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(s) {
                        *args = parsed;
                    }
                }
            }
        }
    }
    message
}

/// The innermost error message: for `raise_exception(msg)` exactly `msg`.
fn describe(err: &Error) -> String {
    let mut cur: &(dyn std::error::Error + 'static) = err;
    while let Some(next) = cur.source() {
        cur = next;
    }
    match cur.downcast_ref::<Error>() {
        Some(e) if e.kind() == ErrorKind::InvalidOperation => e.detail().unwrap_or_default().to_string(),
        _ => format!("{err:#}"),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False)`, i.e. key order
/// kept, `", "`/`": "` separators, no HTML escaping. Options (indent, ...) are rejected.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "tojson: unserializable value").with_source(e))?;
    let mut out = String::new();
    write_py_json(&json, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `str(x)` for scalars (`None`, `True`, `False`, float repr); other values as minijinja prints them.
fn py_string(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(f) if value.as_i64().is_none() => py_float(f),
            _ => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Writes `json.dumps(v, ensure_ascii=False)` output.
fn write_py_json(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => match (n.is_f64(), n.as_f64()) {
            (true, Some(f)) => out.push_str(&py_float(f)),
            _ => out.push_str(&n.to_string()),
        },
        Json::String(s) => write_py_str(s, out),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json(item, out);
            }
            out.push(']');
        }
        Json::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_str(k, out);
                out.push_str(": ");
                write_py_json(item, out);
            }
            out.push('}');
        }
    }
}

fn write_py_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4..1e16.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}"); // e.g. "-1.25e-7", shortest round-trip digits
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    if point <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if (point as usize) >= digits.len() {
        format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{sign}{int}.{frac}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn py_float_matches_python_repr() {
        for (f, want) in [
            (0.25, "0.25"),
            (3.0, "3.0"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(py_float(f), want);
        }
    }

    #[test]
    fn tojson_matches_json_dumps() {
        let v: Json = serde_json::from_str(r#"{"b": [1, 2.5, null, true], "a": "é<\"\n"}"#).unwrap();
        let mut out = String::new();
        write_py_json(&v, &mut out);
        assert_eq!(out, r#"{"b": [1, 2.5, null, true], "a": "é<\"\n"}"#);
    }

    #[test]
    fn raise_exception_becomes_error_message() {
        let t = ChatTemplate::from_source("{{ raise_exception('boom: ' ~ x) }}".into()).unwrap();
        let mut options = ChatOptions::default();
        options.extra.insert("x".into(), Json::from(1));
        match t.render(&[], &options) {
            Err(TextError::Template(msg)) => assert_eq!(msg, "boom: 1"),
            other => panic!("expected template error, got {other:?}"),
        }
    }
}
