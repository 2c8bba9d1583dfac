//! The server driven by the official `openai` Python client: a random model with the real vocabulary, and
//! ScriptedBackend servers for the reasoning and tool-call paths.

mod common;

use std::sync::Arc;

use tern_engine::{Model, ScriptedBackend};
use tern_server::ServeOptions;
use tern_text::{Tokenizer, IM_END_ID};

#[test]
fn openai_client_against_random_model() {
    let Some(qwen) = common::setup("openai_client_against_random_model") else { return };
    let dir = common::scratch("client");
    common::random_model(&qwen, &dir);
    let opts = ServeOptions { api_key: Some("test-key".into()), ctx_size: 512, ..ServeOptions::default() };
    let server = common::Server::start(move || Model::load_cpu(&dir), opts);
    common::python(&["--suite", "real", "--base-url", &format!("{}/v1", server.root), "--api-key", "test-key"]);
    server.stop();
    let _ = std::fs::remove_dir_all(common::scratch("client"));
}

#[test]
fn openai_client_reasoning_and_tool_calls() {
    let Some(qwen) = common::setup("openai_client_reasoning_and_tool_calls") else { return };
    let tok = Tokenizer::from_dir(&qwen).unwrap();
    let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";
    let scripted = |text: &str| {
        let (qwen, script) = (qwen.clone(), [tok.encode(text, false).unwrap(), vec![IM_END_ID]].concat());
        common::Server::start(
            move || Model::with_backend(&qwen, Arc::new(ScriptedBackend::new(248320, script))),
            ServeOptions::default(),
        )
    };
    let think = scripted(&format!("plan\n</think>\n\n{call}")); // the prompt opened "<think>\n"
    let content = scripted(&format!("Sunny in Paris.\n\n{call}"));
    let forced = scripted(call);
    common::python(&[
        "--suite",
        "scripted",
        "--base-url",
        &format!("{}/v1", think.root),
        "--content-url",
        &format!("{}/v1", content.root),
        "--forced-url",
        &format!("{}/v1", forced.root),
    ]);
    for s in [think, content, forced] {
        s.stop();
    }
}
