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
        images: ImageLimits { max_images: 3, max_bytes: 65536, max_pixels: 1_000_000 },
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
