//! The chat page at `/` in a real headless Chromium (Debian's `chromium`, driven by playwright-core from npm):
//! tests/browser/page.mjs loads the page from an in-process server on a random model, sends messages, sees the
//! replies stream, folds the reasoning, stops a reply, starts a new chat and checks the phone layout; and
//! tests/browser/page_images.mjs attaches images (file button, clipboard), sends them and sees them in the history
//! and a reply from a random vision-language model, and sees a text-only model's refusal shown. With
//! `TERN_PAGE_SHOTS=DIR` both save screenshots there.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use tern_engine::Model;
use tern_server::{ImageLimits, ServeOptions};

/// tests/browser, or `None` after printing why `name` is skipped (no node, Chromium or playwright-core).
fn browser(name: &str) -> Option<PathBuf> {
    let browser = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/browser");
    let node_ok = Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success());
    if !node_ok || !Path::new("/usr/bin/chromium").exists() || !browser.join("node_modules/playwright-core").exists() {
        println!(
            "SKIPPED: {name}: needs node, /usr/bin/chromium and tests/browser/node_modules (npm install in \
             tests/browser; .ci/run does)"
        );
        return None;
    }
    Some(browser)
}

/// `TERN_PAGE_SHOTS`, a directory for the scripts' screenshots, when set.
fn shots() -> Option<String> {
    std::env::var("TERN_PAGE_SHOTS").ok().filter(|d| !d.is_empty())
}

#[test]
fn chat_page_in_headless_chromium() {
    let Some(qwen) = common::setup("chat_page_in_headless_chromium") else { return };
    let Some(browser) = browser("chat_page_in_headless_chromium") else { return };
    let dir = common::scratch("page");
    common::random_model(&qwen, &dir);
    let opts = ServeOptions { api_key: Some("page-key".into()), ctx_size: 2048, ..ServeOptions::default() };
    let load_dir = dir.clone();
    let server = common::Server::start(move || Model::load_cpu(&load_dir), opts);
    let t0 = Instant::now();
    let status = Command::new("node")
        .arg(browser.join("page.mjs"))
        .args([server.root.as_str(), "page-key"])
        .args(shots())
        .status()
        .expect("cannot run node");
    println!("page.mjs: {:.1} s", t0.elapsed().as_secs_f64());
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
    assert!(status.success(), "tests/browser/page.mjs failed");
}

/// Images on the page: a server on a random vision-language model (16,000 bytes per image, so that big.png is
/// refused) and one on a text-only model, both without an API key.
#[test]
fn chat_page_images_in_headless_chromium() {
    let name = "chat_page_images_in_headless_chromium";
    let Some(qwen) = common::setup(name) else { return };
    let Some(browser) = browser(name) else { return };
    let dir = common::scratch("page-images");
    let (vl_dir, text_dir) = (dir.join("vl"), dir.join("text"));
    common::random_vl_model(&qwen, &vl_dir);
    common::random_model(&qwen, &text_dir);
    let images = ImageLimits { max_bytes: 16_000, ..ImageLimits::default() };
    let vl_opts = ServeOptions { ctx_size: 2048, images, ..ServeOptions::default() };
    let vl = common::Server::start(
        move || {
            let m = Model::load_cpu(&vl_dir)?;
            assert!(m.images.is_some(), "the random vision-language model reads images");
            Ok(m)
        },
        vl_opts,
    );
    let text_opts = ServeOptions { ctx_size: 2048, ..ServeOptions::default() };
    let text = common::Server::start(
        move || {
            let m = Model::load_cpu(&text_dir)?;
            assert!(m.images.is_none(), "the text-only model reads no images");
            Ok(m)
        },
        text_opts,
    );
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision-images");
    let t0 = Instant::now();
    let status = Command::new("node")
        .arg(browser.join("page_images.mjs"))
        .args([vl.root.as_str(), text.root.as_str()])
        .arg(&fixtures)
        .args(shots())
        .status()
        .expect("cannot run node");
    println!("page_images.mjs: {:.1} s", t0.elapsed().as_secs_f64());
    vl.stop();
    text.stop();
    let _ = std::fs::remove_dir_all(dir);
    assert!(status.success(), "tests/browser/page_images.mjs failed");
}
