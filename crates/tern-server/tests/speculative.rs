//! `tern serve --speculative K` on the CPU backend (a random model of the real vocabulary, with its MTP block):
//! greedy replies, plain and streamed, with logprobs and a stop string, are the same as without drafts, and
//! /metrics counts the drafts checked.

mod common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tern_engine::Model;
use tern_server::ServeOptions;

fn ready(root: &str) {
    let t0 = Instant::now();
    while common::http(root, "GET", "/health", None).0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(120), "the server did not get ready");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The replies of `bodies` from a server with `k` drafts a step, and its /metrics.
fn replies(dir: &std::path::Path, k: usize, bodies: &[Value]) -> (Vec<String>, String) {
    let dir = dir.to_path_buf();
    let opts = ServeOptions { ctx_size: 512, speculative: k, ..ServeOptions::default() };
    let server = common::Server::start(move || Model::load_cpu_with(&dir, k > 0), opts);
    ready(&server.root);
    let out = bodies
        .iter()
        .map(|b| {
            let (status, body) = common::http(&server.root, "POST", "/v1/chat/completions", Some(&b.to_string()));
            assert_eq!(status, 200, "{body}");
            if b["stream"] == json!(true) {
                // The streamed text and logprobs, chunk by chunk (ids differ per request).
                body.lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter(|l| *l != "[DONE]")
                    .map(|l| {
                        let v: Value = serde_json::from_str(l).unwrap();
                        format!("{}|{}", v["choices"][0]["delta"], v["choices"][0]["logprobs"])
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            } else {
                let v: Value = serde_json::from_str(&body).unwrap();
                format!("{}|{}|{}", v["choices"][0]["message"], v["choices"][0]["logprobs"], v["usage"])
            }
        })
        .collect();
    let (_, metrics) = common::http(&server.root, "GET", "/metrics", None);
    server.stop();
    (out, metrics)
}

#[test]
fn speculative_serving_replies_as_plain_decoding() {
    let Some(qwen) = common::setup("speculative_serving_replies_as_plain_decoding") else { return };
    let dir = common::scratch("speculative");
    common::random_model(&qwen, &dir);
    let msg = |text: &str| json!([{"role": "user", "content": text}]);
    let bodies = [
        json!({"messages": msg("Hello there"), "max_tokens": 40, "temperature": 0}),
        json!({"messages": msg("Count to ten"), "max_tokens": 40, "temperature": 0, "stream": true,
               "logprobs": true, "top_logprobs": 2}),
        json!({"messages": msg("A story"), "max_tokens": 60, "temperature": 0, "stop": ["e"]}),
    ];
    let (plain, _) = replies(&dir, 0, &bodies);
    let (drafted, metrics) = replies(&dir, 3, &bodies);
    for (i, (p, d)) in plain.iter().zip(&drafted).enumerate() {
        assert_eq!(p, d, "request {i}: the reply differs with drafts");
    }
    let checked = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tern_speculative_drafts_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no tern_speculative_drafts_total in /metrics:\n{metrics}"));
    assert!(checked > 0.0, "no draft was checked");
    println!("3 replies identical with 3 drafts a step; {checked} drafts checked");
    let _ = std::fs::remove_dir_all(&dir);
}
