//! Honest health: after a backend panics while stepping a request, either that request failed alone (an
//! OpenAI-shaped 500) and the server goes on serving with /health 200, or the engine has stopped and the server
//! says so: /health 503 `engine_stopped`, /metrics `tern_engine_running 0`, new requests 503 (not 500s behind a
//! /health that says ok, as when a huge top_k panicked the scheduler thread).

mod common;

use std::sync::Arc;

use tern_engine::{Backend, Model, ScriptedBackend, StepHook, Work};
use tern_server::ServeOptions;

/// Reading this token id panics the backend.
const POISON: u32 = 1234;

/// A scripted backend (always answers token 11) whose step panics on the poison token.
fn poisoned() -> Arc<dyn Backend> {
    Arc::new(StepHook {
        inner: ScriptedBackend::new(248320, vec![11]),
        hook: |b: &ScriptedBackend, work: &[Work]| {
            assert!(!work.iter().any(|w| w.ids.contains(&POISON)), "a backend failure on the poison token");
            b.step(work)
        },
    })
}

fn error_code(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e["message"].is_string() && e.get("type").is_some() && e.get("param").is_some(), "shape: {body}");
    e["code"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn health_is_honest_after_a_backend_panic() {
    let Some(qwen) = common::setup("health_is_honest_after_a_backend_panic") else { return };
    let server = common::Server::start(move || Model::with_backend(&qwen, poisoned()), ServeOptions::default());
    let t0 = std::time::Instant::now();
    while common::http(&server.root, "GET", "/health", None).0 != 200 {
        assert!(t0.elapsed().as_secs() < 60, "never ready");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let ok = r#"{"prompt": [5, 6], "max_tokens": 2, "temperature": 0}"#;
    assert_eq!(common::http(&server.root, "POST", "/v1/completions", Some(ok)).0, 200);

    let poison = format!(r#"{{"prompt": [5, {POISON}], "max_tokens": 2}}"#);
    let (status, body) = common::http(&server.root, "POST", "/v1/completions", Some(&poison));
    assert!(status >= 500, "the poisoned request: {status} {body}");
    error_code(&body);

    std::thread::sleep(std::time::Duration::from_millis(200));
    let (health, hbody) = common::http(&server.root, "GET", "/health", None);
    let (next, nbody) = common::http(&server.root, "POST", "/v1/completions", Some(ok));
    let (_, metrics) = common::http(&server.root, "GET", "/metrics", None);
    println!("after the panic: /health {health} {hbody}; next request {next}");
    if health == 200 {
        assert_eq!(next, 200, "/health says ok but a request fails: {nbody}");
        assert!(metrics.contains("tern_engine_running 1"), "{metrics}");
    } else {
        assert_eq!(health, 503, "{hbody}");
        assert!(hbody.contains("engine_stopped"), "{hbody}");
        assert_eq!((next, error_code(&nbody).as_str()), (503, "engine_stopped"), "{nbody}");
        assert!(metrics.contains("tern_engine_running 0") && metrics.contains("tern_ready 0"), "{metrics}");
    }
    server.stop();
}

/// `--prefix-cache-mib`: a prompt that continues a finished one (its prompt, the reply, more) reuses that state
/// (`cached_tokens`), and a bound of 0 keeps nothing.
#[test]
fn prefix_cache_bound_of_zero_keeps_nothing() {
    let Some(qwen) = common::setup("prefix_cache_bound_of_zero_keeps_nothing") else { return };
    for (bytes, expect_hit) in [(ServeOptions::default().prefix_cache_bytes, true), (0, false)] {
        let q = qwen.clone();
        let server = common::Server::start(
            move || Model::with_backend(&q, Arc::new(ScriptedBackend::new(248320, vec![11, 12, 13]))),
            ServeOptions { prefix_cache_bytes: bytes, ..ServeOptions::default() },
        );
        let t0 = std::time::Instant::now();
        while common::http(&server.root, "GET", "/health", None).0 != 200 {
            assert!(t0.elapsed().as_secs() < 60, "never ready");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let first: Vec<u32> = (100..140).collect();
        let body = format!(r#"{{"prompt": {first:?}, "max_tokens": 3, "temperature": 0}}"#);
        let (status, reply) = common::http(&server.root, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 200, "{reply}");
        // the first prompt, its three scripted reply tokens, then more
        let next: Vec<u32> = first.iter().copied().chain([11, 12, 13, 200, 201]).collect();
        let body = format!(r#"{{"prompt": {next:?}, "max_tokens": 1, "temperature": 0}}"#);
        let (status, reply) = common::http(&server.root, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 200, "{reply}");
        let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        println!("prefix cache of {bytes} bytes: {cached} of {} prompt tokens cached", next.len());
        match expect_hit {
            true => assert!(cached >= first.len() as u64, "{reply}"),
            false => assert_eq!(cached, 0, "{reply}"),
        }
        server.stop();
    }
}

/// /metrics has the time to first token as a Prometheus histogram: cumulative buckets that never decrease, +Inf
/// equal to the count, one entry per request that got a token.
#[test]
fn metrics_time_to_first_token_is_a_histogram() {
    let Some(qwen) = common::setup("metrics_time_to_first_token_is_a_histogram") else { return };
    let server = common::Server::start(
        move || Model::with_backend(&qwen, Arc::new(ScriptedBackend::new(248320, vec![11, 12]))),
        ServeOptions::default(),
    );
    let t0 = std::time::Instant::now();
    while common::http(&server.root, "GET", "/health", None).0 != 200 {
        assert!(t0.elapsed().as_secs() < 60, "never ready");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for p in [[5, 6], [7, 8], [9, 10]] {
        let body = format!(r#"{{"prompt": {p:?}, "max_tokens": 2, "temperature": 0}}"#);
        assert_eq!(common::http(&server.root, "POST", "/v1/completions", Some(&body)).0, 200);
    }
    let (_, metrics) = common::http(&server.root, "GET", "/metrics", None);
    let name = "tern_time_to_first_token_seconds";
    assert!(metrics.contains(&format!("# TYPE {name} histogram")), "{metrics}");
    let value = |line: &str| line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
    let buckets: Vec<f64> =
        metrics.lines().filter(|l| l.starts_with(&format!("{name}_bucket{{"))).filter_map(value).collect();
    let count = metrics.lines().find(|l| l.starts_with(&format!("{name}_count "))).and_then(value);
    let sum = metrics.lines().find(|l| l.starts_with(&format!("{name}_sum "))).and_then(value);
    println!("ttft histogram: buckets {buckets:?}, count {count:?}, sum {sum:?}");
    assert!(buckets.len() > 2 && buckets.windows(2).all(|w| w[0] <= w[1]), "buckets not cumulative: {buckets:?}");
    assert_eq!(count, Some(3.0), "{metrics}");
    assert_eq!(buckets.last().copied(), count, "+Inf bucket != count");
    assert!(sum.is_some_and(|s| s > 0.0), "{metrics}");
    server.stop();
}
