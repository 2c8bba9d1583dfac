//! Images through the server, driven by the official `openai` and `anthropic` clients (tests/server/test_images.py):
//! a random vision-language model with the real vocabulary (a tiny tower), and a text-only one.

mod common;

use tern_engine::Model;
use tern_server::{ImageLimits, ServeOptions};

/// The bounds test_images.py's limits suite expects.
fn limited() -> ServeOptions {
    ServeOptions {
        api_key: Some("img-key".into()),
        ctx_size: 1024,
        images: ImageLimits { max_images: 3, max_bytes: 65536, max_pixels: 1_000_000, ..ImageLimits::default() },
        ..ServeOptions::default()
    }
}

/// A server of a random vision-language model, `suite` of test_images.py against it.
fn vl_suite(name: &str, suite: &str) {
    let Some(qwen) = common::setup(name) else { return };
    if !common::python_has(&["anthropic"]) {
        println!("SKIPPED: {name}: python anthropic package missing");
        return;
    }
    let dir = common::scratch(name);
    common::random_vl_model(&qwen, &dir);
    let load_dir = dir.clone();
    let server = common::Server::start(
        move || {
            let m = Model::load_cpu(&load_dir)?;
            assert!(m.images.is_some(), "the loader says the tower reads images");
            Ok(m)
        },
        limited(),
    );
    common::python_script("test_images.py", &["--suite", suite, "--root", &server.root, "--api-key", "img-key"]);
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Token counts of prompts with images, and every malformed, oversized, unsupported or surplus image a clear 400
/// naming its limit, in each API; the server then still serves. (Nothing here reaches the engine's image path.)
#[test]
fn image_limits_and_errors() {
    vl_suite("image_limits_and_errors", "limits");
}

/// An image in chat (plain and streamed), in an OpenAI tool message, in Responses, in Anthropic Messages and in a
/// tool_result gets an answer, its tokens counted as prompt tokens. Needs the engine to read images.
#[test]
fn images_answered_in_every_api() {
    vl_suite("images_answered_in_every_api", "answers");
}

/// A checkpoint without vision weights answers image parts with a 400 that says so, in every API.
#[test]
fn images_refused_without_vision_weights() {
    let name = "images_refused_without_vision_weights";
    let Some(qwen) = common::setup(name) else { return };
    if !common::python_has(&["anthropic"]) {
        println!("SKIPPED: {name}: python anthropic package missing");
        return;
    }
    let dir = common::scratch(name);
    common::random_model(&qwen, &dir);
    let load_dir = dir.clone();
    let server = common::Server::start(
        move || {
            let m = Model::load_cpu(&load_dir)?;
            assert!(m.images.is_none(), "no tower, no images");
            Ok(m)
        },
        limited(),
    );
    common::python_script("test_images.py", &["--suite", "text-only", "--root", &server.root, "--api-key", "img-key"]);
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A loopback HTTP server for image URLs: each path of `routes(port)` answered with its status line and headers
/// and its body, a byte every `pause` when that is not zero (a slow body). Its base URL.
fn image_host(routes: impl FnOnce(u16) -> Vec<(&'static str, String, Vec<u8>, std::time::Duration)>) -> String {
    use std::io::{BufRead as _, BufReader, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let routes = std::sync::Arc::new(routes(addr.port()));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let routes = routes.clone();
            std::thread::spawn(move || {
                let mut lines = BufReader::new(conn.try_clone().unwrap()).lines();
                let first = lines.next().and_then(Result::ok).unwrap_or_default();
                while lines.next().and_then(Result::ok).is_some_and(|l| !l.is_empty()) {}
                let path = first.split_whitespace().nth(1).unwrap_or_default().to_owned();
                let Some((_, head, body, pause)) = routes.iter().find(|r| r.0 == path) else {
                    let _ = conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
                    return;
                };
                let _ = conn.write_all(format!("{head}\r\nConnection: close\r\n\r\n").as_bytes());
                if pause.is_zero() {
                    let _ = conn.write_all(body);
                    return;
                }
                for b in body {
                    std::thread::sleep(*pause);
                    if conn.write_all(&[*b]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// `/tokenize` of a user message holding the image at `url`: the status and the JSON body.
fn tokenize_image(root: &str, url: &str) -> (u16, serde_json::Value) {
    let body = serde_json::json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]});
    let (status, text) = common::http(root, "POST", "/tokenize", Some(&body.to_string()));
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
}

/// The error message of a 400, after checking it is one.
fn refusal(root: &str, url: &str) -> String {
    let (status, body) = tokenize_image(root, url);
    assert_eq!(status, 400, "{url}: {body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    body["error"]["message"].as_str().unwrap_or_default().to_owned()
}

/// http(s) image URLs (`--image-urls`): refused when the flag is off; with it on, a loopback URL is still refused
/// (only public addresses are fetched), and with a test-only allowance for 127.0.0.1 the image is fetched (the same
/// tokens as its data: URL, and a chat reply), through a redirect too, while a redirect to another loopback
/// address, a body over --max-image-bytes and a body slower than --image-url-timeout are 400s; the server still
/// serves after them.
#[test]
fn image_urls_fetched_only_when_allowed() {
    use std::time::{Duration, Instant};
    let name = "image_urls_fetched_only_when_allowed";
    let Some(qwen) = common::setup(name) else { return };
    let dir = common::scratch(name);
    common::random_vl_model(&qwen, &dir);
    let cat =
        std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/vision-images/exact.png")).unwrap();
    let max_bytes = 30_000;
    let ms = Duration::from_millis;
    let png = |n: usize| format!("HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {n}");
    let to = |loc: String| format!("HTTP/1.1 302 Found\r\nLocation: {loc}\r\nContent-Length: 0");
    let base = image_host(|port| {
        vec![
            ("/cat.png", png(cat.len()), cat.clone(), ms(0)),
            ("/to-cat", to("/cat.png".into()), vec![], ms(0)),
            ("/to-loopback", to(format!("http://127.0.0.2:{port}/cat.png")), vec![], ms(0)),
            ("/to-v6-loopback", to(format!("http://[::1]:{port}/cat.png")), vec![], ms(0)),
            ("/big", png(max_bytes + 1), vec![7; max_bytes + 1], ms(0)),
            ("/big-unsized", "HTTP/1.1 200 OK\r\nContent-Type: image/png".into(), vec![7; max_bytes + 1], ms(0)),
            ("/slow", "HTTP/1.1 200 OK\r\nContent-Type: image/png".into(), cat.clone(), ms(100)),
        ]
    });
    let serve = |fetch: tern_server::ImageFetch| {
        let load_dir = dir.clone();
        let images = ImageLimits { max_bytes, fetch, ..ImageLimits::default() };
        common::Server::start(
            move || Model::load_cpu(&load_dir),
            ServeOptions { ctx_size: 1024, images, ..ServeOptions::default() },
        )
    };
    let wait = |root: &str| {
        let t0 = Instant::now();
        while common::http(root, "GET", "/health", None).0 != 200 {
            assert!(t0.elapsed() < Duration::from_secs(120), "the model did not load");
            std::thread::sleep(ms(50));
        }
    };
    let on = tern_server::ImageFetch { enabled: true, timeout: Duration::from_secs(2), ..Default::default() };
    let loopback: std::net::IpAddr = "127.0.0.1".parse().unwrap();

    // Off (the default): a 400 asking for a data: URL, and nothing fetched.
    let off = serve(tern_server::ImageFetch::default());
    wait(&off.root);
    let msg = refusal(&off.root, &format!("{base}/cat.png"));
    assert!(msg.contains("not fetched") && msg.contains("data:"), "{msg}");
    let data_url = format!("data:image/png;base64,{}", {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(&cat)
    });
    let (status, want) = tokenize_image(&off.root, &data_url);
    assert_eq!(status, 200, "{want}");
    off.stop();

    // On: loopback is still refused.
    let strict = serve(on.clone());
    wait(&strict.root);
    let msg = refusal(&strict.root, &format!("{base}/cat.png"));
    assert!(msg.contains("127.0.0.1 is a loopback address") && msg.contains("public"), "{msg}");
    strict.stop();

    // On, with the test-only allowance for 127.0.0.1.
    let open = serve(tern_server::ImageFetch { allow_addresses: vec![loopback], ..on });
    wait(&open.root);
    for path in ["/cat.png", "/to-cat"] {
        let (status, got) = tokenize_image(&open.root, &format!("{base}{path}"));
        assert_eq!(status, 200, "{path}: {got}");
        assert_eq!(got["tokens"], want["tokens"], "{path}: the same tokens as the data: URL");
        assert!(got["count"].as_u64().unwrap() > 10, "{got}");
    }
    let msg = refusal(&open.root, &format!("{base}/to-loopback"));
    assert!(msg.contains("redirected to") && msg.contains("127.0.0.2 is a loopback address"), "{msg}");
    let msg = refusal(&open.root, &format!("{base}/to-v6-loopback"));
    assert!(msg.contains("::1 is a loopback address"), "{msg}");
    for path in ["/big", "/big-unsized"] {
        let msg = refusal(&open.root, &format!("{base}{path}"));
        assert!(msg.contains("over the limit of 30000 bytes") && msg.contains("--max-image-bytes"), "{path}: {msg}");
    }
    let t0 = Instant::now();
    let msg = refusal(&open.root, &format!("{base}/slow"));
    assert!(msg.contains("--image-url-timeout"), "{msg}");
    assert!(t0.elapsed() < Duration::from_secs(30), "the slow body took {:?}", t0.elapsed());
    // A reply to a fetched image, and the server still serves.
    let chat = serde_json::json!({"max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": format!("{base}/to-cat")}},
    ]}]});
    let (status, reply) = common::http(&open.root, "POST", "/v1/chat/completions", Some(&chat.to_string()));
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["usage"]["prompt_tokens"].as_u64(), want["count"].as_u64(), "{reply}");
    assert_eq!(common::http(&open.root, "GET", "/health", None).0, 200);
    open.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
