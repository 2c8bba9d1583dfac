//! Issue 13 against one in-process server on a random model with the real vocabulary: structured output
//! (every constrained reply validates, several seeds, stream and not), forced tool calls, the rest of the OpenAI
//! surface (n, prompt lists, echo, text_offset, system_fingerprint, named 400s, CORS, x-api-key), the Anthropic
//! Messages API with the official `anthropic` client and the Responses API with the official `openai` client
//! (tests/server/test_agents.py).

mod common;

use std::time::Instant;

use tern_engine::Model;
use tern_server::ServeOptions;

#[test]
fn agents_structured_output_anthropic_and_responses() {
    let Some(qwen) = common::setup("agents_structured_output_anthropic_and_responses") else { return };
    if !common::python_has(&["anthropic", "jsonschema"]) {
        println!("SKIPPED: agents_structured_output_anthropic_and_responses: python anthropic or jsonschema missing");
        return;
    }
    let dir = common::scratch("agents");
    common::random_model(&qwen, &dir);
    let opts = ServeOptions {
        api_key: Some("agent-key".into()),
        ctx_size: 2048,
        cors: vec!["http://page.example".into()],
        ..ServeOptions::default()
    };
    let load_dir = dir.clone();
    let server = common::Server::start(move || Model::load_cpu(&load_dir), opts);
    let base = format!("{}/v1", server.root);
    for suite in ["structured", "surface", "anthropic", "responses"] {
        let t0 = Instant::now();
        common::python_script("test_agents.py", &["--suite", suite, "--base-url", &base, "--api-key", "agent-key"]);
        println!("test_agents.py --suite {suite}: {:.1} s", t0.elapsed().as_secs_f64());
    }
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}
