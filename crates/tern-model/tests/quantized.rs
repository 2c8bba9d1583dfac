//! The 4-bit path: quantise-on-load against the f32 reference on the dequantised weights, the mlx checkpoint
//! writer against the reader, and the per-path 8-bit overrides.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tern_model::mlx::{self, HfValues, QuantSpec};
use tern_model::safetensors::{Checkpoint, Dtype, SafeTensors};
use tern_model::testutil::fixtures_dir;
use tern_model::weights::Linear;
use tern_model::{Config, Logits, State, Weights};

/// Random non-zero token ids (fixed seed).
fn ids(vocab: usize, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ((i * 2654435761 + 17) % vocab as u64) as u32).collect()
}

/// Logits at every position: a prefill of all but the last 3 ids, then 3 decode steps.
fn logits(w: &Weights, ids: &[u32]) -> Vec<f32> {
    let mut st = State::new(&w.config);
    let k = ids.len() - 3;
    let mut out = w.forward(&ids[..k], &mut st, Logits::All);
    for &id in &ids[k..] {
        out.extend(w.forward(&[id], &mut st, Logits::All));
    }
    out
}

/// Worst max|a-b| / max|ref| over positions.
fn rel_diff(got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len());
    got.chunks(vocab).zip(want.chunks(vocab)).fold(0.0f32, |worst, (g, w)| {
        let scale = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let diff = g.iter().zip(w).fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        worst.max(diff / scale)
    })
}

fn config_json(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tern-quant-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// tiny-b (hidden 96) quantises completely with group size 32; tiny-a (hidden 64) with the real recipe
/// (group 64) leaves the expert down projections (in = 32) unquantised.
fn spec_for(name: &str, c: &Config) -> QuantSpec {
    match name {
        "tiny-b" => QuantSpec::recipe(c, 4, 32),
        _ => QuantSpec::q4(c),
    }
}

fn quantised(name: &str) -> (Weights, Weights) {
    let dir = fixtures_dir().join(name);
    let original = Weights::load(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let spec = spec_for(name, &original.config);
    let q = Weights::from_values(original.config.clone(), &HfValues::new(&ckpt).unwrap(), Some(&spec)).unwrap();
    (original, q)
}

#[test]
fn fast_4bit_path_matches_f32_reference_on_dequantised_weights() {
    for name in ["tiny-b", "tiny-a"] {
        let (original, mut q) = quantised(name);
        let n_quant = q.linears_mut().iter().filter(|l| matches!(l, Linear::Quant(_))).count();
        let n_all = q.linears_mut().len();
        if name == "tiny-b" {
            assert_eq!(n_quant, n_all, "tiny-b with group 32 quantises every linear");
        }
        let reference = q.dequantized();
        let v = q.config.vocab_size;
        let ids = ids(v, 40);
        let fast = logits(&q, &ids);
        let slow = logits(&reference, &ids);
        let d = rel_diff(&fast, &slow, v);
        println!("{name}: {n_quant}/{n_all} linears quantised; fast 4-bit vs f32 on dequantised weights: {d:.3e}");
        assert!(d <= 1e-4, "{name}: fast 4-bit path differs from the reference by {d:.3e}");
        let effect = rel_diff(&fast, &logits(&original, &ids), v);
        println!("{name}: quantisation effect (4-bit vs original weights): max|diff|/max|ref| = {effect:.3e}");
        // Tiny random models amplify weight error (top-k routing flips), so this is reported, not bounded.
        assert!(effect > 0.0 && effect.is_finite(), "{name}: quantisation had no effect ({effect})");
    }
}

#[test]
fn quantize_on_load_option_uses_the_q4_recipe() {
    let dir = fixtures_dir().join("tiny-a");
    let mut w = Weights::load_with(&dir, tern_model::LoadOptions { quantize: true }).unwrap();
    let bits = |l: &Linear| match l {
        Linear::Quant(m) => m.bits(),
        Linear::F32 { .. } => 32,
    };
    let m = &w.layers[0].moe;
    assert_eq!((bits(&m.router), bits(&m.shared_gate), bits(&m.shared.gate)), (8, 8, 4));
    assert_eq!(bits(&m.experts[0].down), 32, "in = 32 is not a multiple of 64: kept unquantised");
    assert!(w.linears_mut().iter().any(|l| matches!(l, Linear::Quant(_))));
}

#[test]
fn mlx_checkpoint_round_trip_equals_quantise_on_load() {
    for name in ["tiny-b", "tiny-a"] {
        let src = fixtures_dir().join(name);
        let out = tmp(name);
        let cfg = config_json(&src);
        let c = Config::from_json(&cfg).unwrap();
        let spec = spec_for(name, &c);
        let ckpt = Checkpoint::open(&src).unwrap();
        let values = HfValues::new(&ckpt).unwrap();
        let mut calls = 0;
        mlx::write_checkpoint(&cfg, &out, &values, &spec, &mut |done, total| {
            assert!(done <= total);
            calls += 1;
        })
        .unwrap();
        assert!(calls > 0);

        // mlx-lm's conventions on disk.
        let written = config_json(&out);
        assert_eq!(written["quantization"], written["quantization_config"]);
        for i in 0..c.num_layers() {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                let key = format!("language_model.model.layers.{i}.{m}");
                assert_eq!(written["quantization"][&key]["bits"], 8, "{key}");
            }
        }
        let index = config_json_file(&out.join("model.safetensors.index.json"));
        assert!(index["metadata"]["total_size"].as_u64().unwrap() > 0);
        let st = SafeTensors::open(&out.join("model.safetensors")).unwrap();
        let l0 = "language_model.model.layers.0.";
        let conv = st.get(&format!("{l0}linear_attn.conv1d.weight")).unwrap();
        assert_eq!(conv.shape, [c.linear_conv_dim(), c.linear_conv_kernel_dim, 1]);
        assert_eq!(st.get(&format!("{l0}linear_attn.A_log")).unwrap().dtype, Dtype::F32);
        let gate = st.get(&format!("{l0}mlp.switch_mlp.gate_proj.weight")).unwrap();
        assert_eq!(gate.shape[0], c.num_experts);
        let router = st.get(&format!("{l0}mlp.gate.weight")).unwrap();
        assert_eq!((router.dtype, router.shape), (Dtype::U32, &[c.num_experts, c.hidden_size / 4][..]));
        let norm = st.get(&format!("{l0}input_layernorm.weight")).unwrap().to_f32().unwrap();
        let hf_norm = ckpt.get("model.language_model.layers.0.input_layernorm.weight").unwrap();
        let hf_norm = hf_norm.to_f32().unwrap();
        assert!((norm[0] - (1.0 + hf_norm[0])).abs() < 1e-2, "+1 folded into the (1+w) norms");
        assert!(st.names().all(|n| n.starts_with("language_model.")));

        // Reader: quantised tensors are used in place from the mapped files, and give the same model as
        // quantised in memory, bit for bit.
        let mut loaded = Weights::load(&out).unwrap();
        let quant: Vec<bool> = loaded
            .linears_mut()
            .iter()
            .filter_map(|l| if let Linear::Quant(m) = l { Some(m.is_zero_copy()) } else { None })
            .collect();
        println!("{name}: {}/{} quantised matrices zero-copy", quant.iter().filter(|&&z| z).count(), quant.len());
        assert!(quant.iter().all(|&z| z), "{name}: quantised weights were copied");
        let (_, in_memory) = quantised(name);
        let v = c.vocab_size;
        let ids = ids(v, 24);
        let (a, b) = (logits(&loaded, &ids), logits(&in_memory, &ids));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{name}: logits differ");
        println!("{name}: mlx checkpoint written and read back: identical logits");

        // The 8-bit overrides are honoured: without them the router's packed width no longer fits.
        let mut cfg2 = written.clone();
        for k in ["quantization", "quantization_config"] {
            let o = cfg2[k].as_object_mut().unwrap();
            o.retain(|k, _| !k.ends_with("mlp.gate"));
        }
        std::fs::write(out.join("config.json"), serde_json::to_string(&cfg2).unwrap()).unwrap();
        let e = format!("{:#}", Weights::load(&out).err().expect("must fail without the 8-bit override"));
        assert!(e.contains("mlp.gate.weight") && e.contains("shape"), "{e}");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

fn config_json_file(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn random_mlx_checkpoint_loads() {
    let src = fixtures_dir().join("tiny-a");
    let out = tmp("random");
    tern_model::random::write_random_mlx(&config_json(&src), &out, 7, None).unwrap();
    let w = Weights::load(&out).unwrap();
    let l = logits(&w, &ids(w.config.vocab_size, 8));
    assert!(l.iter().all(|x| x.is_finite()) && l.iter().any(|&x| x != 0.0));
    std::fs::remove_dir_all(&out).unwrap();
}
