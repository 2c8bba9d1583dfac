//! The CPU reference forward pass against Hugging Face transformers, on the committed fixtures
//! (tools/make_fixtures.py): every position, full prefill and prefill + token-by-token decode.

use std::path::Path;

use tern_model::safetensors::SafeTensors;
use tern_model::testutil::fixtures_dir;
use tern_model::{Logits, State, Weights};

struct Expected {
    ids: Vec<u32>,
    logits: Vec<f32>,
    logits_split: Vec<f32>,
    split: usize,
}

fn expected(dir: &Path) -> Expected {
    let st = SafeTensors::open(&dir.join("expected.safetensors")).unwrap();
    let get = |n: &str| st.get(n).unwrap().to_f32().unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    Expected {
        ids: get("ids").into_iter().map(|v| v as u32).collect(),
        logits: get("logits"),
        logits_split: get("logits_split"),
        split: meta["split"].as_u64().unwrap() as usize,
    }
}

/// Per position: max|a-b| / max|ref| must stay within `tol`, and the argmax must be identical.
fn compare(name: &str, got: &[f32], want: &[f32], vocab: usize, tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, v)| if *v > r[b] { i } else { b });
    let mut worst = 0.0f32;
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let scale = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let diff = g.iter().zip(w).fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        worst = worst.max(diff / scale);
        assert!(diff / scale <= tol, "{name}: position {t}: max|diff|/max|ref| = {:.3e} > {tol:e}", diff / scale);
        assert_eq!(argmax(g), argmax(w), "{name}: position {t}: argmax differs");
    }
    println!("{name}: worst max|diff|/max|ref| = {worst:.3e} over {} positions", got.len() / vocab);
}

fn run_split(w: &Weights, ids: &[u32], split: usize) -> Vec<f32> {
    let mut st = State::new(&w.config);
    let mut out = w.forward(&ids[..split], &mut st, Logits::All);
    for &id in &ids[split..] {
        out.extend(w.forward(&[id], &mut st, Logits::All));
    }
    out
}

#[test]
fn fixtures_match_transformers() {
    let root = fixtures_dir();
    for name in ["tiny-a", "tiny-b", "tiny-c"] {
        let dir = root.join(name);
        let w = Weights::load(&dir).unwrap();
        let e = expected(&dir);
        let v = w.config.vocab_size;
        let full = w.forward(&e.ids, &mut State::new(&w.config), Logits::All);
        compare(&format!("{name} prefill"), &full, &e.logits, v, 1e-4);
        let split = run_split(&w, &e.ids, e.split);
        compare(&format!("{name} split {}", e.split), &split, &e.logits_split, v, 1e-4);
    }
}

#[test]
fn prefill_then_decode_equals_one_prefill() {
    let dir = fixtures_dir().join("tiny-b");
    let w = Weights::load(&dir).unwrap();
    let ids = expected(&dir).ids;
    let v = w.config.vocab_size;
    let full = w.forward(&ids, &mut State::new(&w.config), Logits::All);
    for split in [1, 30, 64, 65, 79] {
        compare(&format!("split {split}"), &run_split(&w, &ids, split), &full, v, 2e-5);
    }
    // Prefill in uneven pieces, then the last row alone.
    let mut st = State::new(&w.config);
    w.forward(&ids[..10], &mut st, Logits::All);
    w.forward(&ids[10..47], &mut st, Logits::All);
    let last = w.forward(&ids[47..], &mut st, Logits::Last);
    compare("pieces", &last, &full[(ids.len() - 1) * v..], v, 2e-5);
    assert_eq!(st.pos, ids.len());
}
