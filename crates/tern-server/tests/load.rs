//! 32 concurrent streaming clients, a third disconnecting mid-stream, against an in-process server (alone in
//! this test binary so its RSS is the server's): every completed stream is well-formed, cancelled requests
//! leave the engine, /health stays 200 and RSS returns to near its level before the load.

mod common;

use std::time::Duration;

use tern_engine::Model;
use tern_server::ServeOptions;

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb / 1024.0
}

#[test]
fn concurrent_streams_with_disconnects() {
    let Some(qwen) = common::setup("concurrent_streams_with_disconnects") else { return };
    let dir = common::scratch("load");
    common::random_model(&qwen, &dir);
    let load_dir = dir.clone();
    let server = common::Server::start(
        move || Model::load_cpu(&load_dir),
        ServeOptions { ctx_size: 1024, ..ServeOptions::default() },
    );
    let args = ["--suite", "load", "--base-url", &format!("{}/v1", server.root)];
    common::python(&args); // warm-up: threads, arenas, prefix cache
    std::thread::sleep(Duration::from_millis(500));
    let before = rss_mib();
    common::python(&args);
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_mib();
    println!("RSS before {before:.1} MiB, after {after:.1} MiB");
    assert!(after <= before * 1.10 + 48.0, "RSS grew from {before:.1} MiB to {after:.1} MiB");
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}
