//! Helpers shared by the GPU test files (each file uses a subset).
#![allow(dead_code)]

use std::sync::Arc;

use tern_cuda::gpu::QMat;
use tern_cuda::model::DeviceModel;
use tern_cuda::Gpu;
use tern_model::mlx::{HfValues, QuantSpec};
use tern_model::quant::QuantMatrix;
use tern_model::random::RandomValues;
use tern_model::safetensors::Checkpoint;
use tern_model::testutil::fixtures_dir;
use tern_model::{Config, LayerKind, Weights};

pub struct Rng(pub u64);
impl Rng {
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// 64 random bits (the state mixed through splitmix64's finaliser).
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| amp * self.f()).collect()
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (((self.f() + 1.0) * 0.5 * n as f32) as usize).min(n - 1)
    }
}

/// max |a-b| / max |b| (NaN in `a` counts as infinite).
pub fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = a.iter().zip(b).fold(0.0f32, |m, (x, y)| if x.is_nan() { f32::INFINITY } else { m.max((x - y).abs()) });
    d / scale
}

/// ‖a - b‖ / ‖b‖ (NaN in `a` counts as infinite).
pub fn rel2(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    if a.iter().any(|v| v.is_nan()) {
        return f32::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt() as f32
}

pub fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold(0, |b, (i, &v)| if v > x[b] { i } else { b })
}

/// (top1 - top2) / (max - min) of a logits row.
pub fn top2_gap(x: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::MIN, f32::MIN);
    let (mut mx, mut mn) = (f32::MIN, f32::MAX);
    for &v in x {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
        mx = mx.max(v);
        mn = mn.min(v);
    }
    (a - b) / (mx - mn)
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round to bf16 (nearest even), as the GPU's conversions do.
pub fn round_bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

pub fn to_dev(g: &Gpu, m: &QuantMatrix) -> QMat {
    tern_cuda::model::stack(g, &[m], "test matrix").unwrap()
}

pub fn pct(v: &[f32], q: f32) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s[((s.len() - 1) as f32 * q).round() as usize]
}

/// Qwen3.6-35B-A3B's shapes (40 layers, 256 experts, vocab 248320), from the tiny-b config with every size set.
pub fn full_config() -> Config {
    let mut c = Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap();
    c.hidden_size = 2048;
    c.layer_types = (0..40).map(|i| if i % 4 == 3 { LayerKind::Full } else { LayerKind::Linear }).collect();
    c.vocab_size = 248320;
    (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim) = (16, 2, 256, 64);
    c.rope_theta = 1e7;
    (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) =
        (16, 32, 128, 128);
    c.linear_conv_kernel_dim = 4;
    (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) =
        (256, 8, 512, 512);
    c
}

pub fn tiny_b_config() -> Config {
    Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap()
}

/// A one-layer model of `c`'s shapes with `kind`, random 4-bit weights (8-bit router), on the CPU and uploaded.
pub fn one_layer(g: &Arc<Gpu>, mut c: Config, kind: LayerKind, seed: u64) -> (Weights, DeviceModel) {
    c.layer_types = vec![kind];
    let gs = if c.hidden_size % 64 == 0 { 64 } else { 32 };
    let w = Weights::from_values(c.clone(), &RandomValues { seed }, Some(&QuantSpec::recipe(&c, 4, gs))).unwrap();
    let dm = DeviceModel::upload(g.clone(), &w).unwrap();
    (w, dm)
}

/// `c` with a small vocabulary and small experts (8 experts, top-2, inner size 64).
pub fn small_moe(mut c: Config) -> Config {
    c.vocab_size = 256;
    (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) = (8, 2, 64, 64);
    c
}

/// The tiny-b fixture (transformers' random checkpoint) quantised to 4-bit, group 32.
pub fn tiny_b_q4() -> Weights {
    fixture_q4("tiny-b")
}

/// A fixture checkpoint quantised as tern's recipe does (4-bit, groups of 32).
pub fn fixture_q4(name: &str) -> Weights {
    let dir = fixtures_dir().join(name);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let config = Config::from_dir(&dir).unwrap();
    let spec = QuantSpec::recipe(&config, 4, 32);
    Weights::from_values(config, &HfValues::new(&ckpt).unwrap(), Some(&spec)).unwrap()
}

/// transformers' own bf16-vs-f32 distance on tiny-b (median, max), from the fixture's meta.json.
pub fn yardstick() -> (f32, f32) {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures_dir().join("tiny-b/meta.json")).unwrap()).unwrap();
    let b = &meta["bf16_vs_f32_prefill"];
    (b["median"].as_f64().unwrap() as f32, b["max"].as_f64().unwrap() as f32)
}

/// A random checkpoint with an MTP block in tiny-mtp-a's layout, written as mlx 4-bit (groups of 64) and loaded:
/// width `hidden`, vocabulary `vocab`, head and expert sizes the CUDA kernels take (head dim 64, GDN value heads of
/// 32, experts of 64); with `accept`, the MTP block agrees with the model as `tern random-model --mtp-accept` makes
/// it.
pub fn mtp_model_q4(hidden: usize, vocab: usize, accept: Option<tern_model::random::MtpAccept>, seed: u64) -> Weights {
    let path = fixtures_dir().join("tiny-mtp-a/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("vision_config");
    let t = &mut cfg["text_config"];
    for (k, v) in [
        ("hidden_size", hidden),
        ("vocab_size", vocab),
        ("head_dim", 64),
        ("linear_value_head_dim", 32),
        ("moe_intermediate_size", 64),
        ("shared_expert_intermediate_size", 64),
    ] {
        t[k] = v.into();
    }
    let dir = std::env::temp_dir().join(format!("tern-mtp-q4-{hidden}-{seed}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tern_model::random::write_random_mlx_with(&cfg, &dir, seed, None, accept).unwrap();
    let w = Weights::load(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    w
}
