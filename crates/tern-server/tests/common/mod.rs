//! Shared by the server tests: skips, a tiny random model with the real vocabulary, an in-process server,
//! and running tests/server/test_openai.py.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;
use tern_engine::Model;
use tern_server::ServeOptions;

/// The real tokenizer directory, or `None` after printing why the test is skipped.
pub fn setup(name: &str) -> Option<PathBuf> {
    let Some(dir) = tern_model::testutil::qwen_dir() else {
        println!("SKIPPED: {name}: TERN_QWEN_DIR not set");
        return None;
    };
    let ok = Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        println!("SKIPPED: {name}: python openai package missing");
        return None;
    }
    Some(dir)
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tern-server-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Write a tiny random model (2 layers, hidden 64, 4 experts) with the real vocabulary and tokenizer.
pub fn random_model(qwen: &Path, out: &Path) {
    tern_model::random::write_random_model(
        &tiny_config(qwen),
        out,
        tern_model::safetensors::Dtype::BF16,
        7,
        Some(qwen),
    )
    .unwrap();
}

/// [`random_model`] with a tiny vision tower (1 block, width 32, into the text model's 64): a random
/// vision-language model with the real vocabulary and image token ids.
pub fn random_vl_model(qwen: &Path, out: &Path) {
    let mut cfg = tiny_config(qwen);
    cfg["vision_config"] = serde_json::json!({
        "model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
        "out_hidden_size": 64, "num_position_embeddings": 36, "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}
    });
    tern_model::random::write_random_vl_model(&cfg, out, tern_model::safetensors::Dtype::BF16, 7, Some(qwen)).unwrap();
}

/// The real config with the text model shrunk to 2 layers of width 64 and 4 experts.
fn tiny_config(qwen: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(qwen.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    let t = cfg.get_mut("text_config").unwrap().as_object_mut().unwrap();
    t.remove("layer_types");
    for (k, v) in [
        ("hidden_size", 64),
        ("num_hidden_layers", 2),
        ("full_attention_interval", 2),
        ("num_attention_heads", 2),
        ("num_key_value_heads", 1),
        ("head_dim", 32),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 2),
        ("linear_key_head_dim", 16),
        ("linear_value_head_dim", 16),
        ("num_experts", 4),
        ("num_experts_per_tok", 2),
        ("moe_intermediate_size", 32),
        ("shared_expert_intermediate_size", 32),
    ] {
        t.insert(k.into(), v.into());
    }
    cfg
}

/// An in-process server on a free loopback port, stopped (and drained) by [`Server::stop`].
pub struct Server {
    pub root: String,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<Result<()>>,
}

impl Server {
    pub fn start(load: impl FnOnce() -> Result<Model> + Send + 'static, opts: ServeOptions) -> Server {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            tokio::runtime::Runtime::new()?.block_on(async move {
                let listener = tern_server::bind(&ServeOptions { port: 0, ..opts.clone() }).await?;
                addr_tx.send(listener.local_addr()?).unwrap();
                tern_server::run(listener, load, opts, async {
                    let _ = stopped.await;
                })
                .await
            })
        });
        let addr = addr_rx.recv().expect("the server did not start");
        Server { root: format!("http://{addr}"), stop, thread }
    }

    pub fn stop(self) {
        let _ = self.stop.send(());
        self.thread.join().unwrap().unwrap();
    }
}

/// Run tests/server/test_openai.py with `args`; panics if it fails.
pub fn python(args: &[&str]) {
    python_script("test_openai.py", args)
}

/// Run tests/server/`script` with `args`; panics if it fails.
pub fn python_script(script: &str, args: &[&str]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/server").join(script);
    let status = Command::new("python3").arg(path).args(args).status().expect("cannot run python3");
    assert!(status.success(), "{script} {args:?} failed");
}

/// Whether python3 can import every one of `modules`.
pub fn python_has(modules: &[&str]) -> bool {
    let code = modules.iter().map(|m| format!("import {m}")).collect::<Vec<_>>().join("; ");
    Command::new("python3").args(["-c", &code]).output().is_ok_and(|o| o.status.success())
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`): the status and the body.
pub fn http(root: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let addr = root.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_owned());
    (status, body)
}
