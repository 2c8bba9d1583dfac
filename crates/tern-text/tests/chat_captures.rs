//! Renders every transformers capture (tools/capture_chat_templates.py) and compares bytes.

mod common;

use serde_json::{json, Value};
use tern_text::{ChatOptions, ChatTemplate, TextError};

fn options_from(capture: &Value) -> ChatOptions {
    let mut options = ChatOptions { tools: capture["tools"].as_array().cloned(), ..ChatOptions::default() };
    for (key, value) in capture["kwargs"].as_object().expect("kwargs object") {
        match (key.as_str(), value) {
            ("add_generation_prompt", v) => options.add_generation_prompt = v.as_bool().unwrap(),
            ("enable_thinking", v) => options.enable_thinking = v.as_bool(),
            _ => {
                options.extra.insert(key.clone(), value.clone());
            }
        }
    }
    options
}

fn captures() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/chat_captures.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn renders_match_transformers_byte_for_byte() {
    let Some(dir) = common::model_dir("renders_match_transformers_byte_for_byte") else {
        return;
    };
    let template = ChatTemplate::from_dir(&dir).unwrap();
    let captures = captures();
    assert!(captures.len() >= 10, "too few captures");
    for capture in &captures {
        let name = capture["name"].as_str().unwrap();
        let messages = capture["messages"].as_array().unwrap();
        let rendered = template.render(messages, &options_from(capture)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(rendered, capture["rendered"].as_str().unwrap(), "capture {name}");
    }
}

#[test]
fn string_arguments_render_like_object_arguments() {
    let Some(dir) = common::model_dir("string_arguments_render_like_object_arguments") else {
        return;
    };
    let template = ChatTemplate::from_dir(&dir).unwrap();
    let call = |args: Value| {
        vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": args}}]}),
            json!({"role": "tool", "content": "ok"}),
        ]
    };
    let options = ChatOptions::default();
    let as_object = template.render(&call(json!({"a": 1, "b": [true]})), &options).unwrap();
    let as_string = template.render(&call(json!("{\"a\": 1, \"b\": [true]}")), &options).unwrap();
    assert_eq!(as_object, as_string);
    assert!(as_object.contains("<parameter=b>\n[true]\n</parameter>"));
}

#[test]
fn template_exceptions_become_errors() {
    let Some(dir) = common::model_dir("template_exceptions_become_errors") else {
        return;
    };
    let template = ChatTemplate::from_dir(&dir).unwrap();
    let options = ChatOptions::default();
    for (messages, want) in [
        (vec![], "No messages provided."),
        (
            vec![json!({"role": "robot", "content": "x"}), json!({"role": "user", "content": "y"})],
            "Unexpected message role.",
        ),
        (
            vec![json!({"role": "user", "content": "x"}), json!({"role": "system", "content": "y"})],
            "System message must be at the beginning.",
        ),
    ] {
        match template.render(&messages, &options) {
            Err(TextError::Template(msg)) => assert_eq!(msg, want),
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }
}
