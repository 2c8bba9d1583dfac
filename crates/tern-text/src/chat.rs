//! Renders the checkpoint's own Jinja chat template with minijinja, configured to match
//! `transformers.AutoTokenizer.apply_chat_template(..., tokenize=False)` byte for byte:
//! `trim_blocks`/`lstrip_blocks`, Python string methods (pycompat), `raise_exception`,
//! a `tojson` equal to Python's `json.dumps(ensure_ascii=False)` and a Python-style `string`.

use std::path::Path;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

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
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self { add_generation_prompt: true, enable_thinking: None, tools: None, extra: Map::new() }
    }
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
        let mut ctx = options.extra.clone();
        ctx.insert("messages".into(), Json::Array(messages.iter().map(normalize_message).collect()));
        ctx.insert("tools".into(), options.tools.clone().map_or(Json::Null, Json::Array));
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
