//! The `tern` binary end to end on a random model with the real 248,320-token vocabulary.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use tern_model::testutil::{fixtures_dir, qwen_dir};

fn tern() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tern"))
}

fn ok(out: Output) -> (String, String) {
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "tern failed: {e}");
    (o, e)
}

/// A tiny random model with the real tokenizer, written once per test run.
fn real_vocab_model() -> Option<PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let q = qwen_dir()?;
        let out = std::env::temp_dir().join(format!("tern-cli-test-{}", std::process::id()));
        let sets = [
            "hidden_size=64",
            "num_hidden_layers=4",
            "num_attention_heads=4",
            "num_key_value_heads=2",
            "head_dim=32",
            "linear_num_key_heads=2",
            "linear_num_value_heads=4",
            "linear_key_head_dim=16",
            "linear_value_head_dim=16",
            "num_experts=8",
            "num_experts_per_tok=2",
            "moe_intermediate_size=32",
            "shared_expert_intermediate_size=32",
        ];
        let mut cmd = tern();
        cmd.args(["random-model", "--dtype", "bf16", "--seed", "7", "--config"]).arg(&q).arg("--out").arg(&out);
        cmd.arg("--tokenizer-from").arg(&q);
        for s in sets {
            cmd.args(["--set", s]);
        }
        ok(cmd.output().unwrap());
        Some(out)
    })
    .clone()
}

macro_rules! model_or_skip {
    ($name:literal) => {
        match real_vocab_model() {
            Some(m) => m,
            None => {
                println!(concat!("SKIPPED: ", $name, ": TERN_QWEN_DIR not set"));
                return;
            }
        }
    };
}

#[test]
fn run_is_deterministic_with_greedy_sampling() {
    let m = model_or_skip!("run_is_deterministic_with_greedy_sampling");
    let go = || {
        ok(tern()
            .args(["run", "--backend", "cpu", "--max-tokens", "12", "--temperature", "0", "--no-think", "--prompt"])
            .arg("Say hello in French.")
            .arg("--model")
            .arg(&m)
            .output()
            .unwrap())
    };
    let (a, ea) = go();
    let (b, _) = go();
    assert!(!a.trim().is_empty(), "no answer; stderr: {ea}");
    assert_eq!(a, b);
    assert!(ea.contains("12 tokens") && ea.contains("tokens/s"), "{ea}");
}

#[test]
fn chat_keeps_history_and_obeys_commands() {
    let m = model_or_skip!("chat_keeps_history_and_obeys_commands");
    let mut child = tern()
        .args(["chat", "--backend", "cpu", "--max-tokens", "6", "--temperature", "0", "--model"])
        .arg(&m)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello\n/think off\nand again\n/reset\n/bogus\n/exit\nnever read\n")
        .unwrap();
    let (out, err) = ok(child.wait_with_output().unwrap());
    assert!(out.contains("[thinking off]"), "{out}");
    assert!(out.contains("[history cleared]"), "{out}");
    assert!(out.contains("[unknown command /bogus"), "{out}");
    assert_eq!(err.matches("tokens/s").count(), 2, "two answers expected: {err}");
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let m = model_or_skip!("tokenize_and_detokenize_round_trip");
    let text = "Hello, <|im_start|>world — 世界 🦙";
    let (ids, _) = ok(tern().args(["tokenize", "--text", text, "--model"]).arg(&m).output().unwrap());
    let ids: Vec<u32> = serde_json::from_str(ids.trim()).unwrap();
    assert!(ids.contains(&248045), "{ids:?}");
    let (back, _) =
        ok(tern().args(["detokenize", "--ids"]).arg(format!("{ids:?}")).arg("--model").arg(&m).output().unwrap());
    assert_eq!(back.trim_end_matches('\n'), text);
}

fn read_logits(path: &Path) -> Vec<f32> {
    let st = tern_model::safetensors::SafeTensors::open(path).unwrap();
    st.get("logits").unwrap().to_f32().unwrap()
}

#[test]
fn logits_split_gives_the_same_rows() {
    let dir = fixtures_dir().join("tiny-a");
    let tmp = std::env::temp_dir().join(format!("tern-logits-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let ids = "3 17 42 100 5 9 250 77 12";
    let mut rows = vec![];
    for split in [None, Some("1"), Some("4"), Some("9")] {
        let out = tmp.join(format!("l{}.safetensors", split.unwrap_or("all")));
        let mut cmd = tern();
        cmd.args(["logits", "--ids", ids, "--model"]).arg(&dir).arg("--out").arg(&out);
        if let Some(k) = split {
            cmd.args(["--split", k]);
        }
        ok(cmd.output().unwrap());
        rows.push(read_logits(&out));
    }
    assert_eq!(rows[0].len(), 9 * 384);
    for r in &rows[1..] {
        let d = r.iter().zip(&rows[0]).fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(d < 1e-5, "split changes logits by {d}");
    }
    let bad = tern().args(["logits", "--ids", "1 2", "--split", "3", "--out", "x", "--model"]).arg(&dir).output();
    let e = String::from_utf8_lossy(&bad.unwrap().stderr).into_owned();
    assert!(e.contains("--split 3"), "{e}");
}

#[test]
fn bench_trace_needs_the_cuda_backend() {
    let out = tern().args(["bench", "--trace", "--random-weights", "--config", "/nonexistent"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--trace traces the CUDA decode step"), "stderr: {err}");
}
