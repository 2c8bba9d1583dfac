//! The chat page at `/` in a real headless Chromium (Debian's `chromium`, driven by playwright-core from npm):
//! tests/browser/page.mjs loads the page from an in-process server on a random model, sends messages, sees the
//! replies stream, folds the reasoning, stops a reply, starts a new chat and checks the phone layout.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use tern_engine::Model;
use tern_server::ServeOptions;

#[test]
fn chat_page_in_headless_chromium() {
    let Some(qwen) = common::setup("chat_page_in_headless_chromium") else { return };
    let browser = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/browser");
    let node_ok = Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success());
    if !node_ok || !Path::new("/usr/bin/chromium").exists() || !browser.join("node_modules/playwright-core").exists() {
        println!(
            "SKIPPED: chat_page_in_headless_chromium: needs node, /usr/bin/chromium and tests/browser/node_modules \
             (npm install in tests/browser; .ci/run does)"
        );
        return;
    }
    let dir = common::scratch("page");
    common::random_model(&qwen, &dir);
    let opts = ServeOptions { api_key: Some("page-key".into()), ctx_size: 2048, ..ServeOptions::default() };
    let load_dir = dir.clone();
    let server = common::Server::start(move || Model::load_cpu(&load_dir), opts);
    let t0 = Instant::now();
    let status = Command::new("node")
        .arg(browser.join("page.mjs"))
        .args([server.root.as_str(), "page-key"])
        .status()
        .expect("cannot run node");
    println!("page.mjs: {:.1} s", t0.elapsed().as_secs_f64());
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
    assert!(status.success(), "tests/browser/page.mjs failed");
}
