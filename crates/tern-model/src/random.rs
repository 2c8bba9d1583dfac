//! `tern random-model`: a random checkpoint of any config, in the official names and layout.
//!
//! Values follow the same scales as tools/make_fixtures.py, chosen so activations and logits are O(1): unit-gain
//! linear layers (std 1/sqrt(in)), unit embeddings, (1+w) norm offsets in ±0.5, gated-norm gains in 0.5..1.5,
//! A_log in -1.5..0.5, dt_bias in ±1. Tensors are generated and written one at a time, so any size can be
//! written in bounded memory.
//!
//! `--mtp-accept FIRST[,LATER]` writes a [`Construction`] instead: the same random layers (the same work per
//! token) but a model whose greedy next token is a fixed function of the current one and whose MTP block drafts
//! it right with the asked probabilities, to measure speculative decoding without trained weights.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use rayon::prelude::*;

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

/// The vision tower's tensors (`model.visual.*`, as [`crate::vision::Vision::load`] reads them), for
/// [`write_random_vl_model`]: unit-gain linear layers, LayerNorm gains in 0.5..1.5 and small biases.
fn vision_tensors(c: &crate::vision::VisionConfig) -> Vec<(String, Vec<usize>, Init, bool)> {
    let (h, i, m) = (c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size.pow(2));
    let mut t = Vec::new();
    let mut add =
        |name: String, shape: Vec<usize>, init: Init| t.push((format!("model.visual.{name}"), shape, init, false));
    let bias = Init::Uniform(-0.1, 0.1);
    let gain = Init::Uniform(0.5, 1.5);
    let conv = vec![h, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size];
    add("patch_embed.proj.weight".into(), conv, Init::Normal(1.0 / (c.patch_dim() as f32).sqrt()));
    add("patch_embed.proj.bias".into(), vec![h], bias);
    add("pos_embed.weight".into(), vec![c.num_position_embeddings, h], Init::Normal(0.5));
    let affine = |add: &mut dyn FnMut(String, Vec<usize>, Init), name: String, rows: usize, cols: usize| {
        let (shape, init) = lin(rows, cols);
        add(format!("{name}.weight"), shape, init);
        add(format!("{name}.bias"), vec![rows], bias);
    };
    for b in 0..c.depth {
        let p = format!("blocks.{b}.");
        for n in ["norm1", "norm2"] {
            add(format!("{p}{n}.weight"), vec![h], gain);
            add(format!("{p}{n}.bias"), vec![h], bias);
        }
        affine(&mut add, format!("{p}attn.qkv"), 3 * h, h);
        affine(&mut add, format!("{p}attn.proj"), h, h);
        affine(&mut add, format!("{p}mlp.linear_fc1"), i, h);
        affine(&mut add, format!("{p}mlp.linear_fc2"), h, i);
    }
    add("merger.norm.weight".into(), vec![h], gain);
    add("merger.norm.bias".into(), vec![h], bias);
    affine(&mut add, "merger.linear_fc1".into(), m, m);
    affine(&mut add, "merger.linear_fc2".into(), c.out_hidden_size, m);
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
    write_random_model_with(config_json, out, dtype, seed, tokenizer_from, None)
}

/// [`write_random_model`], or with `mtp_accept` the checkpoint of a [`Construction`]: an MTP block that agrees
/// with the main model as often as `mtp_accept` says (`tern random-model --mtp-accept`).
pub fn write_random_model_with(
    config_json: &Value,
    out: &Path,
    dtype: Dtype,
    seed: u64,
    tokenizer_from: Option<&Path>,
    mtp_accept: Option<MtpAccept>,
) -> Result<()> {
    write_checkpoint(config_json, out, dtype, seed, tokenizer_from, mtp_accept, false)
}

/// [`write_random_model`] with the vision tower of the config's `vision_config` (`model.visual.*`, after the text
/// model's tensors, so that those are the same as [`write_random_model`]'s for a seed): a random
/// vision-language checkpoint. The tower's `out_hidden_size` must be the text model's hidden size.
pub fn write_random_vl_model(
    config_json: &Value,
    out: &Path,
    dtype: Dtype,
    seed: u64,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    write_checkpoint(config_json, out, dtype, seed, tokenizer_from, None, true)
}

fn write_checkpoint(
    config_json: &Value,
    out: &Path,
    dtype: Dtype,
    seed: u64,
    tokenizer_from: Option<&Path>,
    mtp_accept: Option<MtpAccept>,
    vision: bool,
) -> Result<()> {
    if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
        bail!("--dtype must be f32, f16 or bf16");
    }
    let c = Config::from_json(config_json)?;
    let construction = mtp_accept.map(|a| Construction::new(config_json, a, seed, tokenizer_from)).transpose()?;
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
    if let Some(cons) = &construction {
        cons.record(&mut cfg);
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;

    let mut tensors = official_tensors(&c);
    if vision {
        let Some(vc) = crate::vision::VisionConfig::from_json(config_json)? else {
            bail!("a vision-language checkpoint needs a vision_config in its config");
        };
        if vc.out_hidden_size != c.hidden_size {
            bail!(
                "vision_config.out_hidden_size {} must be the text model's hidden_size {}",
                vc.out_hidden_size,
                c.hidden_size
            );
        }
        tensors.extend(vision_tensors(&vc));
    }
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
            let (name, shape, init, _) = &tensors[members[k]];
            let n: usize = shape.iter().product();
            if let Some((cons, r)) = construction.as_ref().and_then(|c| Some((c, role(name)?))) {
                return encode_floats(&cons.values(r, n, false)?, specs[k].dtype, buf);
            }
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
    write_random_mlx_with(config_json, out, seed, tokenizer_from, None)
}

/// [`write_random_mlx`], or with `mtp_accept` the checkpoint of a [`Construction`] (see
/// [`write_random_model_with`]).
pub fn write_random_mlx_with(
    config_json: &Value,
    out: &Path,
    seed: u64,
    tokenizer_from: Option<&Path>,
    mtp_accept: Option<MtpAccept>,
) -> Result<()> {
    let c = Config::from_json(config_json)?;
    let mut progress = mlx::progress_line("random-model");
    let random = RandomValues { seed };
    let spec = QuantSpec::q4(&c);
    match mtp_accept {
        None => mlx::write_checkpoint(config_json, out, &random, &spec, &mut progress)?,
        Some(a) => {
            let construction = Construction::new(config_json, a, seed, tokenizer_from)?;
            let mut cfg = config_json.clone();
            construction.record(&mut cfg);
            let values = ConstructedValues { random, construction };
            mlx::write_checkpoint(&cfg, out, &values, &spec, &mut progress)?
        }
    }
    if let Some(src) = tokenizer_from {
        copy_tokenizer_files(src, out)?;
    }
    Ok(())
}

/// The acceptance knob of a constructed checkpoint (`tern random-model --mtp-accept FIRST[,LATER]`, see
/// [`Construction`]): `first` is the probability that the MTP block's first draft of a step is right (the token the
/// main model then produces), `later` the probability that each later draft of a chain is right given that the one
/// before it was. A draft is accepted when it and every one before it are right, so per-position acceptance as
/// `tern bench --speculative` prints it (the share of verifies that accepted position i) is `first`, `first·later`,
/// `first·later²`, …; vLLM's published 0.80 / 0.43 for this family is `0.8,0.5375`.
///
/// These are expectations. Each id draws once whether its drafts are right, so a run measures the draws of the ids
/// it passes, a binomial sample: over m verifies a position's share is within about `sqrt(p(1−p)/m)` of its
/// expectation. The bench's 64 tokens are ~25 verifies (±0.08): on the full shape, seed 0, they read 0.88 / 0.62 for
/// `0.8,0.5375`, which is what that stretch of the cycle draws (0.80 / 0.43 over 200k tokens); a run longer than
/// the cycle reads the same ids again. The draws are independent on purpose: a verify's outcome decides which id
/// the next one starts from, so draws balanced along the cycle (a fixed share per block of ids) would be read
/// selectively and bias the shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MtpAccept {
    pub first: f64,
    pub later: f64,
}

impl MtpAccept {
    /// The same probability at every draft position.
    pub fn uniform(p: f64) -> MtpAccept {
        MtpAccept { first: p, later: p }
    }
}

impl std::str::FromStr for MtpAccept {
    type Err = anyhow::Error;

    /// `P` or `FIRST,LATER`, each a probability in [0, 1].
    fn from_str(s: &str) -> Result<MtpAccept> {
        let p = |v: &str| -> Result<f64> {
            let x: f64 = v.trim().parse().with_context(|| format!("{v:?} is not a number"))?;
            if !(0.0..=1.0).contains(&x) {
                bail!("{x} is not a probability in [0, 1]");
            }
            Ok(x)
        };
        let parsed = match s.split_once(',') {
            None => MtpAccept::uniform(p(s)?),
            Some((a, b)) => MtpAccept { first: p(a)?, later: p(b)? },
        };
        Ok(parsed)
    }
}

/// How a constructed checkpoint sets one official or mlx tensor (the others stay random).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Embed,
    LmHead,
    /// A (1+w) RMSNorm whose gain is exactly 1: the final norm, `mtp.norm` and the MTP block's two pre-fc norms.
    UnitGain,
    /// Zero: every projection that writes into the residual stream (attention `o_proj`, Gated DeltaNet `out_proj`,
    /// routed and shared experts' `down_proj`), the MTP layer's included.
    Zero,
    /// `mtp.fc`: copies between the segments of the hidden state.
    Fc,
}

/// The role of a tensor, by its official (`model.language_model.*`, `lm_head.weight`, `mtp.*`) or mlx
/// (`language_model.model.*`, `language_model.lm_head`, `language_model.mtp.*`) name; `None`: random.
fn role(name: &str) -> Option<Role> {
    let n = name.strip_suffix(".weight").unwrap_or(name);
    let n = ["model.language_model.", "language_model.model.", "language_model."]
        .iter()
        .find_map(|p| n.strip_prefix(p))
        .unwrap_or(n);
    const ZERO: [&str; 5] = [
        ".self_attn.o_proj",
        ".linear_attn.out_proj",
        ".mlp.experts.down_proj",
        ".mlp.switch_mlp.down_proj",
        ".mlp.shared_expert.down_proj",
    ];
    Some(match n {
        "embed_tokens" => Role::Embed,
        "lm_head" => Role::LmHead,
        "norm" | "mtp.norm" | "mtp.pre_fc_norm_embedding" | "mtp.pre_fc_norm_hidden" => Role::UnitGain,
        "mtp.fc" => Role::Fc,
        _ if ZERO.iter().any(|s| n.ends_with(s)) => Role::Zero,
        // Per-expert official names (`mlp.experts.{e}.down_proj`), should a caller use them.
        _ if n.contains(".mlp.experts.") && n.ends_with(".down_proj") => Role::Zero,
        _ => return None,
    })
}

/// The config.json key where a constructed checkpoint records its [`Construction`].
pub const RECORD_KEY: &str = "tern_constructed_mtp";

/// The top logit of a constructed model (main model and MTP block alike): far enough above every other logit
/// (≥ ~20 at full shape) that sampling at temperature 1 leaves the intended token with probability < 1e-7.
const TOP_LOGIT: f32 = 32.0;

/// A checkpoint whose MTP block agrees with the main model by construction, to measure speculative decoding
/// without trained weights (random weights accept about nothing). Everything that costs time is random as in
/// [`write_random_model`] (so a full-shape model reads and computes exactly as much), but:
///
/// * **Every decoder layer adds nothing to the residual stream**: attention `o_proj`, Gated DeltaNet `out_proj`,
///   the routed experts' and the shared expert's `down_proj` are zero (the layers still compute everything
///   before them). So the main model's final hidden state is `norm(embed(t))` for the current token `t`, and
///   the MTP layer passes its fc output through unchanged. The final norm, `mtp.norm` and the MTP block's
///   pre-fc norms have gain exactly 1 (stored offset 0 in the official (1+w) layout, folded gain 1 in mlx).
/// * **A fixed next-token function.** The ordinary token ids (not the config's special ids, not the tokenizer's
///   added tokens, not the padding rows past the tokenizer) form one random cycle `f`. Each id `t` has a random
///   unit *code* `c_t` of `d` dims; the embedding carries `c_t` in its first segment U, and lm_head row `f(t)`
///   is `s·c_t` on U and zero elsewhere (the rows of special and padding ids are zero). Greedy decoding then
///   emits `f(t)` after `t`: the logit of `f(t)` is [`TOP_LOGIT`], every other one is `TOP_LOGIT` times the
///   cosine of two random codes, about `±sqrt(2 ln V / d)` at most for one id (0.24 at full shape), and 0 for the zero
///   rows — so greedy never emits EOS or a control token. Special and padding ids embed like an ordinary id
///   (`ids[t mod n]`), so a prompt of any ids has a well-defined next token.
/// * **MTP first drafts right with probability `first`.** The embedding's second segment A holds `a_t`: `c_t`
///   for ids whose first draft is right (drawn per id with probability `first`), else the code of the id half
///   a cycle away. `mtp.fc` copies the normed embedding's A segment into the U segment of its output, so the MTP
///   block's logits after (hidden, `t'`) peak at `f(id of a_t')`: `f(t')`, exactly the main model's token after
///   `t'`, or a wrong one. It also copies the embedding's U into its output's A, so that output has the norm of
///   an embedding and a chained step reads it like the main model's hidden state.
/// * **Later drafts right with probability `later`** (only when it differs from `first`; else later drafts
///   follow the same rule as the first). fc is linear, so a chained step (fed the MTP block's own output
///   hidden state and its own draft `s`) can differ from a first step only through the hidden state it reads:
///   the embedding's segment P is zero, so a first step reads nothing there, while the MTP block writes into P
///   the embedding's segment D, `D_t = b_{f(t)} − a_{f(t)}` (`b`: like `a`, drawn with probability `later`),
///   and fc adds the hidden state's P to its output's U. A chained step after a right draft `s = f(t')` then
///   gets `a_s + b_s − a_s = b_s`. A last segment F (one quantisation group) pads every embedding and every fc
///   output to the same norm (`|c|² + |a|² + |D|² + |F|² = 6`), so both kinds of hidden state are scaled
///   alike by the norms and the cancellation is exact up to rounding.
///
/// Segments (`d` a multiple of the group size `g` where possible): U `0..d`, A `d..2d`, then with `later`
/// P `2d..3d`, D `3d..4d`, F `4d..4d+g`; the rest of the hidden state is zero. Writing costs O(vocab · hidden).
///
/// Everything holds for the f32, bf16 and 4-bit stored forms: the top logit's margin over the next one is about
/// 0.7 × [`TOP_LOGIT`] at full shape (0.33 the largest cosine of two of the 248,044 448-dim codes), far above
/// rounding (tests/constructed_mtp.rs measures it). The checkpoint records the construction in its config.json
/// ([`Construction::of_checkpoint`]).
pub struct Construction {
    hidden: usize,
    vocab: usize,
    seed: u64,
    accept: MtpAccept,
    /// The ordinary ids in cycle order: `f(ids[i]) = ids[(i + 1) % n]`.
    ids: Vec<u32>,
    /// Per vocabulary id, its index in `ids`; `u32::MAX` for special and padding ids.
    at: Vec<u32>,
    /// Width of a code (segments U, A, P, D).
    d: usize,
    /// Width of segment F when later drafts have their own probability; `None` otherwise.
    fill: Option<usize>,
    /// lm_head gain: the top logit is [`TOP_LOGIT`].
    scale: f32,
}

/// The probability masses drawn per id: `salt` picks an independent stream.
fn mix(seed: u64, t: u64, salt: u64) -> u64 {
    let mut r = Rng::new(seed ^ t.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ salt.wrapping_mul(0xA076_1D64_78BD_642F));
    r.next_u64()
}

impl Construction {
    /// The construction for `config_json` (nested or flat). The ordinary ids are those of the tokenizer in
    /// `tokenizer_from` (its `model.vocab`, less its added tokens), when given; else every id below the vocabulary
    /// size except the config's special ids (eos, bos, pad, image, video, vision start / end) and, Qwen keeping its
    /// added tokens in one block at the end, every id from the lowest special id in the upper half of the
    /// vocabulary on (248,044 for the real config).
    pub fn new(config_json: &Value, accept: MtpAccept, seed: u64, tokenizer_from: Option<&Path>) -> Result<Self> {
        let c = Config::from_json(config_json)?;
        if c.mtp_num_hidden_layers == 0 {
            bail!("--mtp-accept: the config declares no MTP layer (mtp_num_hidden_layers is 0)");
        }
        if c.tie_word_embeddings {
            bail!("--mtp-accept: needs separate embed_tokens and lm_head (tie_word_embeddings is true)");
        }
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let mut ordinary = ordinary_ids(config_json, vocab, tokenizer_from)?;
        let n = ordinary.len();
        if n < 4 {
            bail!("--mtp-accept: only {n} ordinary token ids in a vocabulary of {vocab}; the construction needs 4");
        }
        let chained = accept.later != accept.first;
        let (d, fill) = segments(h, chained);
        // Random unit codes of d dims: the largest of n·n cosines is about sqrt(4 ln n / d); it must stay well
        // below 1 (the right token's cosine) through 4-bit rounding.
        let need = (12.0 * (n as f64).ln()).ceil() as usize;
        if d < need {
            bail!(
                "--mtp-accept: hidden_size {h} leaves {d}-dim token codes{}; {n} ordinary ids need at least {need} \
                 (raise hidden_size or shrink the vocabulary)",
                if chained { " (four segments: FIRST != LATER)" } else { "" }
            );
        }
        let mut rng = Rng::new(seed ^ 0x5EED_C7C1_E000_0001);
        for i in (1..n).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            ordinary.swap(i, j);
        }
        let mut at = vec![u32::MAX; vocab];
        for (i, &t) in ordinary.iter().enumerate() {
            at[t as usize] = i as u32;
        }
        let norm2 = if chained { 6.0 } else { 2.0 };
        let scale = TOP_LOGIT * (norm2 / h as f32).sqrt();
        Ok(Construction { hidden: h, vocab, seed, accept, ids: ordinary, at, d, fill: chained.then_some(fill), scale })
    }

    /// Record the construction in a config.json value (top-level key [`RECORD_KEY`]: `first`, `later`, `seed`,
    /// and the number of ordinary ids), so that [`Construction::of_checkpoint`] can rebuild it and tools can
    /// say what acceptance to expect. Hugging Face and tern's config parsing ignore the key.
    fn record(&self, config_json: &mut Value) {
        config_json[RECORD_KEY] = serde_json::json!({
            "first": self.accept.first,
            "later": self.accept.later,
            "seed": self.seed,
            "ordinary_ids": self.ids.len(),
        });
    }

    /// The construction of a checkpoint written with `--mtp-accept` (its config.json's [`RECORD_KEY`], and its
    /// tokenizer.json when it has one, as when it was written with `--tokenizer-from`); `None` for any other
    /// checkpoint.
    pub fn of_checkpoint(dir: &Path) -> Result<Option<Construction>> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let json: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        let Some(r) = json.get(RECORD_KEY) else {
            return Ok(None);
        };
        let num = |k: &str| r.get(k).and_then(Value::as_f64).with_context(|| format!("{RECORD_KEY}.{k}: missing"));
        let accept = MtpAccept { first: num("first")?, later: num("later")? };
        let seed = r.get("seed").and_then(Value::as_u64).with_context(|| format!("{RECORD_KEY}.seed: missing"))?;
        let cons = Construction::new(&json, accept, seed, Some(dir))?;
        if let Some(n) = r.get("ordinary_ids").and_then(Value::as_u64) {
            if n as usize != cons.ids.len() {
                bail!(
                    "{}: written with {n} ordinary token ids, but {} here (a different tokenizer.json?)",
                    path.display(),
                    cons.ids.len()
                );
            }
        }
        Ok(Some(cons))
    }

    /// The ordinary ids, in the order of the cycle.
    pub fn cycle(&self) -> &[u32] {
        &self.ids
    }

    /// Whether `t` is an ordinary id (on the cycle; greedy decoding only emits those).
    pub fn is_ordinary(&self, t: u32) -> bool {
        self.at.get(t as usize).is_some_and(|&i| i != u32::MAX)
    }

    /// The width of a token code.
    pub fn code_dims(&self) -> usize {
        self.d
    }

    pub fn accept(&self) -> MtpAccept {
        self.accept
    }

    /// The cycle index `t` behaves as: its own, or `t mod n` for special and padding ids.
    fn index(&self, t: u32) -> usize {
        match self.at.get(t as usize) {
            Some(&i) if i != u32::MAX => i as usize,
            _ => t as usize % self.ids.len(),
        }
    }

    /// The main model's greedy next token after `t`.
    pub fn next(&self, t: u32) -> u32 {
        self.ids[(self.index(t) + 1) % self.ids.len()]
    }

    /// Whether the MTP block's first draft after (hidden state of the token before `t`, `t`) is `next(t)`.
    pub fn first_draft_right(&self, t: u32) -> bool {
        self.right(self.index(t), 1)
    }

    /// Whether a chained draft after (the MTP block's own previous output, `t`) is `next(t)`, when the draft `t`
    /// was right.
    pub fn later_draft_right(&self, t: u32) -> bool {
        self.right(self.index(t), if self.fill.is_some() { 2 } else { 1 })
    }

    /// Whether the draft rule `which` (1: first, 2: later) is right for cycle index `i`: a draw of its own per id
    /// and rule, independent of every other (see [`MtpAccept`] on why).
    fn right(&self, i: usize, which: u64) -> bool {
        let p = if which == 1 { self.accept.first } else { self.accept.later };
        let u = (mix(self.seed, self.ids[i] as u64, which) >> 11) as f64 / (1u64 << 53) as f64;
        u < p
    }

    /// The cycle index whose code rule `which` places for index `i`: `i` when right, else an index half (first)
    /// or a third (later) of the cycle away, whose `f` differs from `f(ids[i])`.
    fn source(&self, i: usize, which: u64) -> usize {
        let n = self.ids.len();
        match (self.right(i, which), which) {
            (true, _) => i,
            (false, 1) => (i + n / 2) % n,
            (false, _) => (i + n / 3) % n,
        }
    }

    /// The unit code of cycle index `i`, into `out` (`d` values).
    fn code_into(&self, i: usize, out: &mut [f32]) {
        let mut rng = Rng::new(mix(self.seed, self.ids[i] as u64, 3));
        out.iter_mut().for_each(|v| *v = rng.normal());
        let inv = 1.0 / out.iter().map(|v| v * v).sum::<f32>().sqrt();
        out.iter_mut().for_each(|v| *v *= inv);
    }

    /// Embedding row of id `t` (`hidden` values, zeroed by the caller).
    fn embed_row(&self, t: usize, row: &mut [f32]) {
        let (d, n) = (self.d, self.ids.len());
        let i = self.index(t as u32);
        self.code_into(i, &mut row[..d]);
        self.code_into(self.source(i, 1), &mut row[d..2 * d]);
        if let Some(g) = self.fill {
            let j = (i + 1) % n;
            let (mut b, mut a) = (vec![0.0; d], vec![0.0; d]);
            self.code_into(self.source(j, 2), &mut b);
            self.code_into(self.source(j, 1), &mut a);
            let seg = &mut row[3 * d..4 * d];
            seg.iter_mut().zip(b.iter().zip(&a)).for_each(|(o, (b, a))| *o = b - a);
            let dd: f32 = seg.iter().map(|v| v * v).sum();
            let f = ((4.0 - dd).max(0.0) / g as f32).sqrt();
            row[4 * d..4 * d + g].iter_mut().for_each(|v| *v = f);
        }
    }

    /// The values of a tensor of role `role` and `numel` values (per expert for mlx's stacked experts);
    /// `folded`: (1+w) norms store their gain (mlx) rather than the offset (official).
    fn values(&self, role: Role, numel: usize, folded: bool) -> Result<Vec<f32>> {
        let (h, d, v) = (self.hidden, self.d, self.vocab);
        let want = match role {
            Role::Embed | Role::LmHead => v * h,
            Role::UnitGain => h,
            Role::Fc => 2 * h * h,
            Role::Zero => numel,
        };
        if numel != want {
            bail!("constructed {role:?}: {numel} values, expected {want}");
        }
        let mut out = vec![0.0f32; numel];
        match role {
            Role::Zero => {}
            Role::UnitGain => out.iter_mut().for_each(|x| *x = if folded { 1.0 } else { 0.0 }),
            Role::Embed => out.par_chunks_mut(h).enumerate().for_each(|(t, row)| self.embed_row(t, row)),
            Role::LmHead => out.par_chunks_mut(h).enumerate().for_each(|(j, row)| {
                // Row f(t) reads t's code: row ids[i] is the code of ids[i - 1].
                if let Some(&i) = self.at.get(j).filter(|&&i| i != u32::MAX) {
                    let n = self.ids.len();
                    self.code_into((i as usize + n - 1) % n, &mut row[..d]);
                    row[..d].iter_mut().for_each(|x| *x *= self.scale);
                }
            }),
            Role::Fc => {
                // out[r, c]: input columns 0..h read the normed embedding, h..2h the normed hidden state.
                let mut one = |r: usize, c: usize| out[r * 2 * h + c] = 1.0;
                for k in 0..d {
                    one(k, d + k); // U ← embedding A
                    one(d + k, k); // A ← embedding U (norm filler)
                }
                if let Some(g) = self.fill {
                    for k in 0..d {
                        one(k, h + 2 * d + k); // U += hidden P
                        one(2 * d + k, 3 * d + k); // P ← embedding D
                    }
                    for k in 0..g {
                        one(4 * d + k, 4 * d + k); // F ← embedding F
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Code width and fill width for hidden size `h`: two segments of `h/2`, or (`chained`) four code segments and
/// one fill segment, aligned to the largest of 64, 32, … that leaves codes of at least twice it.
fn segments(h: usize, chained: bool) -> (usize, usize) {
    for g in [64, 32, 16, 8, 4, 2, 1] {
        let d = if chained { (h.saturating_sub(g) / 4) / g * g } else { (h / 2) / g * g };
        if d >= 2 * g || g == 1 {
            return (d, g);
        }
    }
    (0, 1)
}

/// The ordinary token ids (see [`Construction::new`]), ascending.
fn ordinary_ids(config_json: &Value, vocab: usize, tokenizer_from: Option<&Path>) -> Result<Vec<u32>> {
    let t = config_json.get("text_config").unwrap_or(config_json);
    let mut special = std::collections::BTreeSet::new();
    let keys = [
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ];
    for v in keys.iter().flat_map(|k| [t.get(*k), config_json.get(*k)]).flatten() {
        match v {
            Value::Array(a) => special.extend(a.iter().filter_map(Value::as_u64)),
            v => special.extend(v.as_u64()),
        }
    }
    let mut ok = vec![true; vocab];
    match tokenizer_from.map(|d| d.join("tokenizer.json")).filter(|p| p.exists()) {
        Some(path) => {
            let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
            let tok: Value =
                serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
            let model = tok.pointer("/model/vocab").and_then(Value::as_object);
            let model = model.with_context(|| format!("{}: no model.vocab", path.display()))?;
            ok.iter_mut().for_each(|o| *o = false);
            for id in model.values().filter_map(Value::as_u64) {
                if let Some(o) = ok.get_mut(id as usize) {
                    *o = true;
                }
            }
            let added = tok.get("added_tokens").and_then(Value::as_array).into_iter().flatten();
            special.extend(added.filter_map(|a| a.get("id").and_then(Value::as_u64)));
        }
        None => {
            let block = special.iter().copied().filter(|&s| s as usize >= vocab / 2).min().unwrap_or(vocab as u64);
            ok.iter_mut().skip(block as usize).for_each(|o| *o = false);
        }
    }
    for s in special {
        if let Some(o) = ok.get_mut(s as usize) {
            *o = false;
        }
    }
    Ok(ok.iter().enumerate().filter(|(_, &o)| o).map(|(i, _)| i as u32).collect())
}

/// [`RandomValues`] with the tensors of a [`Construction`] in place of random ones: a constructed model in mlx
/// layout and conventions, for [`mlx::write_checkpoint`] or [`crate::Weights::from_values`].
pub struct ConstructedValues {
    pub random: RandomValues,
    pub construction: Construction,
}

impl Values for ConstructedValues {
    fn values(&self, e: &Entry, expert: usize) -> Result<Vec<f32>> {
        match role(&e.name) {
            Some(r) => self.construction.values(r, e.shape.iter().product::<usize>() / e.experts(), true),
            None => self.random.values(e, expert),
        }
    }
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

    /// Every tensor a constructed checkpoint sets, found by name in both layouts: per decoder layer (the MTP
    /// layer's included) the mixer's output projection and the two expert down projections, plus the embedding,
    /// lm_head, the four unit-gain norms and mtp.fc; nothing else.
    #[test]
    fn construction_roles_cover_both_layouts() {
        let path = crate::testutil::fixtures_dir().join("tiny-mtp-a/config.json");
        let c = Config::from_dir(path.parent().unwrap()).unwrap();
        let layers = c.num_layers() + c.mtp_num_hidden_layers;
        let count = |names: Vec<String>| {
            let mut n = BTreeMap::new();
            for name in names {
                if let Some(r) = role(&name) {
                    *n.entry(format!("{r:?}")).or_insert(0usize) += 1;
                }
            }
            n
        };
        let want = BTreeMap::from([
            ("Embed".to_owned(), 1),
            ("LmHead".to_owned(), 1),
            ("UnitGain".to_owned(), 4),
            ("Fc".to_owned(), 1),
            ("Zero".to_owned(), 3 * layers),
        ]);
        assert_eq!(count(official_tensors(&c).into_iter().map(|t| t.0).collect()), want);
        let ents = mlx::entries(&c).into_iter().chain(mlx::mtp_entries(&c));
        assert_eq!(count(ents.map(|e| e.name).collect()), want);
    }

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

#[cfg(test)]
mod vision_tests {
    use super::*;

    /// A random vision-language checkpoint loads with its tower, whose output has one row of the text model's
    /// width per image token; its text tensors are those of the text-only checkpoint of the same seed.
    #[test]
    fn random_vl_model_loads_its_tower() {
        let dir = crate::testutil::fixtures_dir().join("tiny-vl-a");
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let tmp = std::env::temp_dir().join(format!("tern-random-vl-{}", std::process::id()));
        let (vl, text) = (tmp.join("vl"), tmp.join("text"));
        write_random_vl_model(&cfg, &vl, Dtype::BF16, 3, None).unwrap();
        write_random_model(&cfg, &text, Dtype::BF16, 3, None).unwrap();
        let w = crate::Weights::load(&vl).unwrap();
        let v = w.vision.as_ref().expect("the tower is read");
        let params = crate::vision::ImageParams::default();
        let img = image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(64, 96, |x, y| {
            image::Rgb([x as u8 * 3, y as u8 * 2, 7])
        }));
        let pixels = crate::vision::preprocess_image(&img, &params).unwrap();
        let rows = v.forward(&pixels.values, &[pixels.grid]).unwrap();
        assert_eq!(rows.len(), pixels.tokens(2) * w.config.hidden_size);
        assert!(rows.iter().all(|x| x.is_finite()) && rows.iter().any(|&x| x != 0.0));
        assert!(crate::Weights::load(&text).unwrap().vision.is_none());
        // The text tensors are the same bytes.
        let a = crate::safetensors::Checkpoint::open(&vl).unwrap();
        let b = crate::safetensors::Checkpoint::open(&text).unwrap();
        let name = "model.language_model.embed_tokens.weight";
        assert_eq!(a.require(name).unwrap().to_f32().unwrap(), b.require(name).unwrap().to_f32().unwrap());
        // A tower whose output is not the text width is refused.
        let mut bad = cfg.clone();
        bad["vision_config"]["out_hidden_size"] = 48.into();
        assert!(write_random_vl_model(&bad, &tmp.join("bad"), Dtype::BF16, 3, None).is_err());
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
