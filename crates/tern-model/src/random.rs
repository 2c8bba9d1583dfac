//! `tern random-model`: a random checkpoint of any config, in the official names and layout.
//!
//! Values follow the same scales as tools/make_fixtures.py, chosen so activations and logits are O(1): unit-gain
//! linear layers (std 1/sqrt(in)), unit embeddings, (1+w) norm offsets in ±0.5, gated-norm gains in 0.5..1.5,
//! A_log in -1.5..0.5, dt_bias in ±1. Tensors are generated and written one at a time, so any size can be
//! written in bounded memory.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::config::{Config, LayerKind};
use crate::mlx::{self, Entry, Kind, QuantSpec, Values};
use crate::safetensors::{encode_floats, write, Dtype, TensorSpec};

/// How a tensor's random values are drawn.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Init {
    /// Normal with this standard deviation.
    Normal(f32),
    /// Uniform in [lo, hi).
    Uniform(f32, f32),
}

/// The official tensors of a config: name, shape, init. `A_log` and the gated-norm weight are f32 in the
/// official checkpoints (the flag). The MTP block (`mtp.*`, model-spec §3.3) comes last, so that the main
/// model's values for a seed do not depend on it.
pub(crate) fn official_tensors(c: &Config) -> Vec<(String, Vec<usize>, Init, bool)> {
    let h = c.hidden_size;
    let mut t = Vec::new();
    let mut add =
        |name: String, (shape, init): (Vec<usize>, Init), f32_always: bool| t.push((name, shape, init, f32_always));
    let p = "model.language_model.";
    add(format!("{p}embed_tokens.weight"), (vec![c.vocab_size, h], Init::Normal(1.0)), false);
    for (i, kind) in c.layer_types.iter().enumerate() {
        layer_tensors(c, &format!("{p}layers.{i}."), *kind, &mut add);
    }
    add(format!("{p}norm.weight"), (vec![h], Init::Uniform(-0.5, 0.5)), false);
    if !c.tie_word_embeddings {
        add("lm_head.weight".into(), lin(c.vocab_size, h), false);
    }
    if c.mtp_num_hidden_layers > 0 {
        add("mtp.fc.weight".into(), lin(h, 2 * h), false);
        add("mtp.pre_fc_norm_embedding.weight".into(), (vec![h], Init::Uniform(-0.5, 0.5)), false);
        add("mtp.pre_fc_norm_hidden.weight".into(), (vec![h], Init::Uniform(-0.5, 0.5)), false);
        for i in 0..c.mtp_num_hidden_layers {
            layer_tensors(c, &format!("mtp.layers.{i}."), LayerKind::Full, &mut add);
        }
        add("mtp.norm.weight".into(), (vec![h], Init::Uniform(-0.5, 0.5)), false);
    }
    t
}

/// A linear `[rows, cols]` at unit gain.
fn lin(rows: usize, cols: usize) -> (Vec<usize>, Init) {
    (vec![rows, cols], Init::Normal(1.0 / (cols as f32).sqrt()))
}

/// The tensors of one decoder layer whose names start with `l`.
fn layer_tensors(c: &Config, l: &str, kind: LayerKind, add: &mut impl FnMut(String, (Vec<usize>, Init), bool)) {
    let h = c.hidden_size;
    let norm1p = |n: usize| (vec![n], Init::Uniform(-0.5, 0.5));
    add(format!("{l}input_layernorm.weight"), norm1p(h), false);
    add(format!("{l}post_attention_layernorm.weight"), norm1p(h), false);
    match kind {
        LayerKind::Full => {
            let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            add(format!("{l}self_attn.q_proj.weight"), lin(nh * hd * 2, h), false);
            add(format!("{l}self_attn.k_proj.weight"), lin(nkv * hd, h), false);
            add(format!("{l}self_attn.v_proj.weight"), lin(nkv * hd, h), false);
            add(format!("{l}self_attn.o_proj.weight"), lin(h, nh * hd), false);
            add(format!("{l}self_attn.q_norm.weight"), norm1p(hd), false);
            add(format!("{l}self_attn.k_norm.weight"), norm1p(hd), false);
        }
        LayerKind::Linear => {
            let (hv, kk) = (c.linear_num_value_heads, c.linear_conv_kernel_dim);
            add(format!("{l}linear_attn.in_proj_qkv.weight"), lin(c.linear_conv_dim(), h), false);
            add(format!("{l}linear_attn.in_proj_z.weight"), lin(c.linear_value_dim(), h), false);
            add(format!("{l}linear_attn.in_proj_b.weight"), lin(hv, h), false);
            add(format!("{l}linear_attn.in_proj_a.weight"), lin(hv, h), false);
            add(format!("{l}linear_attn.conv1d.weight"), (vec![c.linear_conv_dim(), 1, kk], Init::Normal(0.5)), false);
            add(format!("{l}linear_attn.A_log"), (vec![hv], Init::Uniform(-1.5, 0.5)), true);
            add(format!("{l}linear_attn.dt_bias"), (vec![hv], Init::Uniform(-1.0, 1.0)), false);
            add(format!("{l}linear_attn.norm.weight"), (vec![c.linear_value_head_dim], Init::Uniform(0.5, 1.5)), true);
            add(format!("{l}linear_attn.out_proj.weight"), lin(h, c.linear_value_dim()), false);
        }
    }
    let (e, im, si) = (c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size);
    add(format!("{l}mlp.gate.weight"), (vec![e, h], Init::Normal(2.0 / (h as f32).sqrt())), false);
    add(format!("{l}mlp.experts.gate_up_proj"), (vec![e, 2 * im, h], Init::Normal(1.0 / (h as f32).sqrt())), false);
    add(format!("{l}mlp.experts.down_proj"), (vec![e, h, im], Init::Normal(1.0 / (im as f32).sqrt())), false);
    add(format!("{l}mlp.shared_expert.gate_proj.weight"), lin(si, h), false);
    add(format!("{l}mlp.shared_expert.up_proj.weight"), lin(si, h), false);
    add(format!("{l}mlp.shared_expert.down_proj.weight"), lin(h, si), false);
    add(format!("{l}mlp.shared_expert_gate.weight"), lin(1, h), false);
}

/// A small, fast, seedable generator (splitmix64) with uniform and normal draws.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Largest shard before the writer starts another file (with an index), like Hugging Face's default 5 GB.
const SHARD_BYTES: usize = 5_000_000_000;

/// Write a random checkpoint of `config_json` (a config.json value, nested or flat) to `out`.
pub fn write_random_model(
    config_json: &Value,
    out: &Path,
    dtype: Dtype,
    seed: u64,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        bail!("--dtype must be f32, f16 or bf16");
    }
    let c = Config::from_json(config_json)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut cfg = config_json.clone();
    let dname = match dtype {
        Dtype::F32 => "float32",
        Dtype::F16 => "float16",
        _ => "bfloat16",
    };
    match cfg.get_mut("text_config") {
        Some(t) => t["dtype"] = dname.into(),
        None => cfg["dtype"] = dname.into(),
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;

    let tensors = official_tensors(&c);
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0;
    for (i, (_, shape, _, f32_always)) in tensors.iter().enumerate() {
        let bytes = shape.iter().product::<usize>() * if *f32_always { 4 } else { dtype.size() };
        if size > 0 && size + bytes > SHARD_BYTES {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().unwrap().push(i);
        size += bytes;
    }
    let mut weight_map = serde_json::Map::new();
    let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    let mut rng = Rng::new(seed);
    for (si, members) in shards.iter().enumerate() {
        let file = if shards.len() == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, shards.len())
        };
        let specs: Vec<TensorSpec> = members
            .iter()
            .map(|&i| {
                let (name, shape, _, f32_always) = &tensors[i];
                weight_map.insert(name.clone(), file.clone().into());
                TensorSpec {
                    name: name.clone(),
                    dtype: if *f32_always { Dtype::F32 } else { dtype },
                    shape: shape.clone(),
                }
            })
            .collect();
        write(&out.join(&file), &specs, &meta, |k, buf| {
            let (_, shape, init, _) = &tensors[members[k]];
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n)
                .map(|_| match *init {
                    Init::Normal(std) => rng.normal() * std,
                    Init::Uniform(lo, hi) => lo + (hi - lo) * rng.uniform(),
                })
                .collect();
            encode_floats(&values, specs[k].dtype, buf)
        })?;
    }
    if shards.len() > 1 {
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(out.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)?)?;
    }
    if let Some(src) = tokenizer_from {
        copy_tokenizer_files(src, out)?;
    }
    Ok(())
}

/// Random weights in mlx layout, generated on demand: each matrix from its own seed (the entry name, expert and
/// `seed`), so any entry can be produced in any order or in parallel. Same scales as the official random model;
/// linear weights are uniform with the same standard deviation (cheaper to draw).
pub struct RandomValues {
    pub seed: u64,
}

impl Values for RandomValues {
    fn values(&self, e: &Entry, expert: usize) -> Result<Vec<f32>> {
        let h = e.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let mut rng = Rng::new(self.seed ^ h ^ (expert as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let n: usize = e.shape.iter().product::<usize>() / e.experts();
        let uniform = |rng: &mut Rng, lo: f32, hi: f32| (0..n).map(|_| lo + (hi - lo) * rng.uniform()).collect();
        let name = e.name.as_str();
        Ok(match e.kind {
            Kind::Linear => {
                let std = if name.ends_with("embed_tokens") {
                    1.0
                } else {
                    let fan_in = e.matrix().1 as f32;
                    (if name.ends_with("mlp.gate") { 2.0 } else { 1.0 }) / fan_in.sqrt()
                };
                let a = std * 3f32.sqrt();
                uniform(&mut rng, -a, a)
            }
            Kind::Norm1p => uniform(&mut rng, 0.5, 1.5),
            _ if name.ends_with("conv1d.weight") => (0..n).map(|_| 0.5 * rng.normal()).collect(),
            _ if name.ends_with("A_log") => uniform(&mut rng, -1.5, 0.5),
            _ if name.ends_with("dt_bias") => uniform(&mut rng, -1.0, 1.0),
            _ => uniform(&mut rng, 0.5, 1.5),
        })
    }
}

/// Write a random checkpoint of `config_json` in mlx 4-bit layout (what `tern quantize` writes), streaming:
/// the full model needs only one tensor in memory at a time.
pub fn write_random_mlx(config_json: &Value, out: &Path, seed: u64, tokenizer_from: Option<&Path>) -> Result<()> {
    let c = Config::from_json(config_json)?;
    let mut progress = mlx::progress_line("random-model");
    mlx::write_checkpoint(config_json, out, &RandomValues { seed }, &QuantSpec::q4(&c), &mut progress)?;
    if let Some(src) = tokenizer_from {
        copy_tokenizer_files(src, out)?;
    }
    Ok(())
}

/// Copy the tokenizer, chat template and generation config of a model directory.
pub fn copy_tokenizer_files(src: &Path, out: &Path) -> Result<()> {
    let files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"];
    let mut copied = 0;
    for f in files {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), out.join(f)).with_context(|| format!("copying {}", src.join(f).display()))?;
            copied += 1;
        }
    }
    if copied == 0 {
        bail!("--tokenizer-from {}: no tokenizer files there", src.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real config's MTP block in the official names and shapes (model-spec §3.3: 19 tensors).
    #[test]
    fn real_config_mtp_tensors_have_the_official_names_and_shapes() {
        let Some(dir) = crate::testutil::qwen_dir() else {
            println!("SKIPPED: real_config_mtp_tensors_have_the_official_names_and_shapes: TERN_QWEN_DIR not set");
            return;
        };
        let c = Config::from_dir(&dir).unwrap();
        let mtp: Vec<(String, Vec<usize>)> = official_tensors(&c)
            .into_iter()
            .filter(|t| t.0.starts_with("mtp."))
            .map(|(n, s, _, f32_always)| {
                assert!(!f32_always, "{n}");
                (n, s)
            })
            .collect();
        let want: Vec<(&str, Vec<usize>)> = vec![
            ("mtp.fc.weight", vec![2048, 4096]),
            ("mtp.pre_fc_norm_embedding.weight", vec![2048]),
            ("mtp.pre_fc_norm_hidden.weight", vec![2048]),
            ("mtp.layers.0.input_layernorm.weight", vec![2048]),
            ("mtp.layers.0.post_attention_layernorm.weight", vec![2048]),
            ("mtp.layers.0.self_attn.q_proj.weight", vec![8192, 2048]),
            ("mtp.layers.0.self_attn.k_proj.weight", vec![512, 2048]),
            ("mtp.layers.0.self_attn.v_proj.weight", vec![512, 2048]),
            ("mtp.layers.0.self_attn.o_proj.weight", vec![2048, 4096]),
            ("mtp.layers.0.self_attn.q_norm.weight", vec![256]),
            ("mtp.layers.0.self_attn.k_norm.weight", vec![256]),
            ("mtp.layers.0.mlp.gate.weight", vec![256, 2048]),
            ("mtp.layers.0.mlp.experts.gate_up_proj", vec![256, 1024, 2048]),
            ("mtp.layers.0.mlp.experts.down_proj", vec![256, 2048, 512]),
            ("mtp.layers.0.mlp.shared_expert.gate_proj.weight", vec![512, 2048]),
            ("mtp.layers.0.mlp.shared_expert.up_proj.weight", vec![512, 2048]),
            ("mtp.layers.0.mlp.shared_expert.down_proj.weight", vec![2048, 512]),
            ("mtp.layers.0.mlp.shared_expert_gate.weight", vec![1, 2048]),
            ("mtp.norm.weight", vec![2048]),
        ];
        let mut got = mtp.clone();
        got.sort();
        let mut want: Vec<(String, Vec<usize>)> = want.into_iter().map(|(n, s)| (n.to_owned(), s)).collect();
        want.sort();
        assert_eq!(got, want);
    }
}
