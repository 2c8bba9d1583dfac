//! The mlx-community checkpoint layout (model-spec §4), tern's native weight format: what tensors it has, how a
//! model's f32 weights become them ([`convert`]), and the streaming writer behind `tern quantize` and
//! `tern random-model --quant q4` ([`write_checkpoint`]).
//!
//! Conventions (mlx-lm `sanitize` + `quantize_model`): names `language_model.model.*` and
//! `language_model.lm_head`; routed experts stacked as `mlp.switch_mlp.{gate,up,down}_proj` `[E, out, in]`;
//! `conv1d.weight` as `[C, K, 1]`; the five (1+w) norm families with the +1 folded in; everything bf16 except
//! `A_log` (f32). Every linear / embedding whose input dimension is a multiple of its group size is stored as
//! `{path}.weight` (u32 packed), `{path}.scales` and `{path}.biases` (bf16); the others as a bf16 `{path}.weight`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use half::bf16;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::config::{Config, LayerKind};
use crate::quant::{QuantMatrix, GROUP_SIZE};
use crate::safetensors::{encode_floats, write, Checkpoint, Dtype, TensorSpec, TensorView};

pub const PREFIX: &str = "language_model.model.";
pub const LM_HEAD: &str = "language_model.lm_head";
/// Where tern's mlx layout keeps the official `mtp.*` tensors (under `language_model.`, like every text tensor).
pub const MTP_PREFIX: &str = "language_model.mtp.";

/// Largest shard the writer produces, like mlx-lm and Hugging Face (5 GB).
pub const SHARD_BYTES: usize = 5_000_000_000;

/// How a tensor is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A linear or embedding weight `[out, in]`, or stacked experts `[E, out, in]`; `name` is the module path
    /// (no `.weight`). Quantised when `in` is a multiple of its group size.
    Linear,
    /// A (1+w) RMSNorm gain, stored with the +1 folded in (bf16).
    Norm1p,
    /// Stored as is in bf16 (conv1d `[C, K, 1]`, `dt_bias`, the gated norm).
    Plain,
    /// Stored as is in f32 (`A_log`).
    PlainF32,
}

/// One logical tensor of the layout.
#[derive(Clone, Debug)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: Kind,
}

impl Entry {
    /// Stacked experts: the leading dimension; 1 otherwise.
    pub fn experts(&self) -> usize {
        if self.kind == Kind::Linear && self.shape.len() == 3 {
            self.shape[0]
        } else {
            1
        }
    }

    /// `[out, in]` of one matrix of a linear entry.
    pub fn matrix(&self) -> (usize, usize) {
        let n = self.shape.len();
        (self.shape[n - 2], self.shape[n - 1])
    }
}

/// Every tensor of the main text model of a config in the mlx layout, in file order (the MTP block's are
/// [`mtp_entries`]).
pub fn entries(c: &Config) -> Vec<Entry> {
    let h = c.hidden_size;
    let mut v = Vec::new();
    v.push(Entry { name: format!("{PREFIX}embed_tokens"), shape: vec![c.vocab_size, h], kind: Kind::Linear });
    for (i, kind) in c.layer_types.iter().enumerate() {
        layer_entries(c, &format!("{PREFIX}layers.{i}."), *kind, &mut v);
    }
    v.push(Entry { name: format!("{PREFIX}norm.weight"), shape: vec![h], kind: Kind::Norm1p });
    if !c.tie_word_embeddings {
        v.push(Entry { name: LM_HEAD.to_owned(), shape: vec![c.vocab_size, h], kind: Kind::Linear });
    }
    v
}

/// The tensors of the multi-token-prediction block (model-spec §3.3) in tern's mlx layout: the official
/// `mtp.*` names under [`MTP_PREFIX`], with the main layers' conventions (experts stacked as
/// `mlp.switch_mlp.*`, (1+w) norms folded); empty when the config declares no MTP layer. mlx-lm drops these.
pub fn mtp_entries(c: &Config) -> Vec<Entry> {
    let h = c.hidden_size;
    let mut v = Vec::new();
    if c.mtp_num_hidden_layers == 0 {
        return v;
    }
    v.push(Entry { name: format!("{MTP_PREFIX}fc"), shape: vec![h, 2 * h], kind: Kind::Linear });
    for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden"] {
        v.push(Entry { name: format!("{MTP_PREFIX}{n}.weight"), shape: vec![h], kind: Kind::Norm1p });
    }
    for i in 0..c.mtp_num_hidden_layers {
        layer_entries(c, &format!("{MTP_PREFIX}layers.{i}."), LayerKind::Full, &mut v);
    }
    v.push(Entry { name: format!("{MTP_PREFIX}norm.weight"), shape: vec![h], kind: Kind::Norm1p });
    v
}

/// The tensors of one decoder layer whose names start with `l`.
fn layer_entries(c: &Config, l: &str, kind: LayerKind, v: &mut Vec<Entry>) {
    let h = c.hidden_size;
    let mut add = |name: String, shape: Vec<usize>, kind: Kind| v.push(Entry { name, shape, kind });
    add(format!("{l}input_layernorm.weight"), vec![h], Kind::Norm1p);
    add(format!("{l}post_attention_layernorm.weight"), vec![h], Kind::Norm1p);
    match kind {
        LayerKind::Full => {
            let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let a = format!("{l}self_attn.");
            add(format!("{a}q_proj"), vec![nh * hd * 2, h], Kind::Linear);
            add(format!("{a}k_proj"), vec![nkv * hd, h], Kind::Linear);
            add(format!("{a}v_proj"), vec![nkv * hd, h], Kind::Linear);
            add(format!("{a}o_proj"), vec![h, nh * hd], Kind::Linear);
            add(format!("{a}q_norm.weight"), vec![hd], Kind::Norm1p);
            add(format!("{a}k_norm.weight"), vec![hd], Kind::Norm1p);
        }
        LayerKind::Linear => {
            let (cd, hv, vd) = (c.linear_conv_dim(), c.linear_num_value_heads, c.linear_value_dim());
            let g = format!("{l}linear_attn.");
            add(format!("{g}in_proj_qkv"), vec![cd, h], Kind::Linear);
            add(format!("{g}in_proj_z"), vec![vd, h], Kind::Linear);
            add(format!("{g}in_proj_b"), vec![hv, h], Kind::Linear);
            add(format!("{g}in_proj_a"), vec![hv, h], Kind::Linear);
            add(format!("{g}conv1d.weight"), vec![cd, c.linear_conv_kernel_dim, 1], Kind::Plain);
            add(format!("{g}A_log"), vec![hv], Kind::PlainF32);
            add(format!("{g}dt_bias"), vec![hv], Kind::Plain);
            add(format!("{g}norm.weight"), vec![c.linear_value_head_dim], Kind::Plain);
            add(format!("{g}out_proj"), vec![h, vd], Kind::Linear);
        }
    }
    let (e, im, si) = (c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size);
    let m = format!("{l}mlp.");
    add(format!("{m}gate"), vec![e, h], Kind::Linear);
    add(format!("{m}switch_mlp.gate_proj"), vec![e, im, h], Kind::Linear);
    add(format!("{m}switch_mlp.up_proj"), vec![e, im, h], Kind::Linear);
    add(format!("{m}switch_mlp.down_proj"), vec![e, h, im], Kind::Linear);
    add(format!("{m}shared_expert.gate_proj"), vec![si, h], Kind::Linear);
    add(format!("{m}shared_expert.up_proj"), vec![si, h], Kind::Linear);
    add(format!("{m}shared_expert.down_proj"), vec![h, si], Kind::Linear);
    add(format!("{m}shared_expert_gate"), vec![1, h], Kind::Linear);
}

/// The `quantization` object of an mlx config.json: default group size and bits, and per-module overrides
/// (key = module path without `.weight`).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantSpec {
    pub group_size: usize,
    pub bits: u32,
    pub overrides: BTreeMap<String, (usize, u32)>,
}

impl QuantSpec {
    /// mlx-lm's recipe for this model: `bits` everywhere, 8-bit router (`mlp.gate`) and `mlp.shared_expert_gate`
    /// on every layer (the MTP block's included).
    pub fn recipe(c: &Config, bits: u32, group_size: usize) -> QuantSpec {
        let layers = (0..c.num_layers())
            .map(|i| format!("{PREFIX}layers.{i}."))
            .chain((0..c.mtp_num_hidden_layers).map(|i| format!("{MTP_PREFIX}layers.{i}.")));
        let overrides = layers
            .flat_map(|l| ["mlp.gate", "mlp.shared_expert_gate"].map(|m| format!("{l}{m}")))
            .map(|p| (p, (group_size, 8)))
            .collect();
        QuantSpec { group_size, bits, overrides }
    }

    /// The 4-bit, group-64 recipe of the mlx-community checkpoints.
    pub fn q4(c: &Config) -> QuantSpec {
        QuantSpec::recipe(c, 4, GROUP_SIZE)
    }

    /// Group size and bits of module `path`.
    pub fn params(&self, path: &str) -> (usize, u32) {
        self.overrides.get(path).copied().unwrap_or((self.group_size, self.bits))
    }

    /// Group size and bits if entry `e` is stored quantised (a linear whose input dimension the group divides).
    pub fn for_entry(&self, e: &Entry) -> Option<(usize, u32)> {
        let (gs, bits) = self.params(&e.name);
        (e.kind == Kind::Linear && e.matrix().1.is_multiple_of(gs)).then_some((gs, bits))
    }

    pub fn to_json(&self) -> Value {
        let mut o = serde_json::Map::new();
        o.insert("group_size".into(), self.group_size.into());
        o.insert("bits".into(), self.bits.into());
        o.insert("mode".into(), "affine".into());
        for (p, (gs, bits)) in &self.overrides {
            o.insert(p.clone(), json!({"group_size": gs, "bits": bits}));
        }
        Value::Object(o)
    }

    /// The spec of a config.json (`quantization`, else `quantization_config`); `None` when it has neither.
    pub fn from_config(root: &Value) -> Result<Option<QuantSpec>> {
        let Some(q) = root.get("quantization").or_else(|| root.get("quantization_config")) else {
            return Ok(None);
        };
        let pair = |v: &Value, what: &str| -> Result<(usize, u32)> {
            let gs = v.get("group_size").and_then(Value::as_u64).unwrap_or(GROUP_SIZE as u64);
            let bits = v.get("bits").and_then(Value::as_u64).with_context(|| format!("quantization{what}: no bits"))?;
            if !matches!(bits, 4 | 8) || !matches!(gs, 32 | 64 | 128) {
                bail!(
                    "quantization{what}: unsupported bits {bits} / group_size {gs} (tern reads 4 or 8 bits, 32/64/128)"
                );
            }
            Ok((gs as usize, bits as u32))
        };
        if let Some(mode) = q.get("mode").and_then(Value::as_str) {
            if mode != "affine" {
                bail!("quantization: unsupported mode {mode:?} (tern reads affine)");
            }
        }
        let (group_size, bits) = pair(q, "")?;
        let mut overrides = BTreeMap::new();
        for (k, v) in q.as_object().into_iter().flatten() {
            if v.is_object() {
                overrides.insert(k.clone(), pair(v, &format!(".{k}"))?);
            }
        }
        Ok(Some(QuantSpec { group_size, bits, overrides }))
    }
}

/// A model's f32 weights in mlx layout and conventions, one matrix at a time.
pub trait Values: Sync {
    /// Values of `e` (norms with +1 folded in, conv as `[C, K, 1]`); for stacked experts, expert `expert` only.
    fn values(&self, e: &Entry, expert: usize) -> Result<Vec<f32>>;

    /// Whether these values include the MTP block ([`mtp_entries`]) when the config declares one.
    fn has_mtp(&self) -> bool {
        true
    }
}

/// An entry as tern stores it: quantised matrices (one per expert), or floats as stored (bf16-rounded unless
/// `A_log`).
pub enum Stored {
    Quant(Vec<QuantMatrix>),
    Float(Vec<f32>),
}

/// The stored form of `e`: the one conversion behind both `tern quantize` and quantise-on-load.
pub fn convert(e: &Entry, values: &dyn Values, spec: &QuantSpec) -> Result<Stored> {
    if let Some((gs, bits)) = spec.for_entry(e) {
        let (rows, cols) = e.matrix();
        let mats = (0..e.experts())
            .into_par_iter()
            .map(|x| {
                let v = values.values(e, x)?;
                QuantMatrix::quantize_grouped(&v, rows, cols, bits, gs)
                    .with_context(|| format!("quantising {}", e.name))
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok(Stored::Quant(mats));
    }
    let mut v = Vec::with_capacity(e.shape.iter().product());
    for x in 0..e.experts() {
        v.extend(values.values(e, x)?);
    }
    if e.kind != Kind::PlainF32 {
        v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
    }
    Ok(Stored::Float(v))
}

/// Tensor name of a linear's `.weight` / a plain entry.
fn weight_name(e: &Entry) -> String {
    if e.kind == Kind::Linear {
        format!("{}.weight", e.name)
    } else {
        e.name.clone()
    }
}

/// The safetensors tensors of entry `e`.
fn specs(e: &Entry, spec: &QuantSpec) -> Vec<TensorSpec> {
    let Some((gs, bits)) = spec.for_entry(e) else {
        let dtype = if e.kind == Kind::PlainF32 { Dtype::F32 } else { Dtype::BF16 };
        return vec![TensorSpec { name: weight_name(e), dtype, shape: e.shape.clone() }];
    };
    let n = e.shape.len();
    let with_last = |d: usize| e.shape[..n - 1].iter().copied().chain([d]).collect::<Vec<_>>();
    let cols = e.shape[n - 1];
    vec![
        TensorSpec {
            name: format!("{}.weight", e.name),
            dtype: Dtype::U32,
            shape: with_last(cols * bits as usize / 32),
        },
        TensorSpec { name: format!("{}.scales", e.name), dtype: Dtype::BF16, shape: with_last(cols / gs) },
        TensorSpec { name: format!("{}.biases", e.name), dtype: Dtype::BF16, shape: with_last(cols / gs) },
    ]
}

/// Write an mlx-layout checkpoint of `config_json` to `out`: shards of at most [`SHARD_BYTES`],
/// `model.safetensors.index.json`, and config.json with `quantization` and `quantization_config`. Tensors are
/// produced and written one at a time; `progress(done, total)` is called with bytes after each.
pub fn write_checkpoint(
    config_json: &Value,
    out: &Path,
    values: &dyn Values,
    spec: &QuantSpec,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    let c = Config::from_json(config_json)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut cfg = config_json.clone();
    cfg["quantization"] = spec.to_json();
    cfg["quantization_config"] = spec.to_json();
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)
        .with_context(|| format!("cannot write {}", out.join("config.json").display()))?;

    let mut ents = entries(&c);
    if values.has_mtp() {
        ents.extend(mtp_entries(&c));
    }
    // Shards by entry, so a quantised module's three tensors stay in one file.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0;
    let mut total = 0u64;
    for (i, e) in ents.iter().enumerate() {
        let bytes: usize = specs(e, spec).iter().map(TensorSpec::bytes).sum();
        if size > 0 && size + bytes > SHARD_BYTES {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().unwrap().push(i);
        size += bytes;
        total += bytes as u64;
    }
    let names: Vec<String> = if shards.len() == 1 {
        vec!["model.safetensors".into()]
    } else {
        (1..=shards.len()).map(|i| format!("model-{i:05}-of-{:05}.safetensors", shards.len())).collect()
    };
    let mut weight_map = BTreeMap::new();
    let meta = BTreeMap::from([("format".to_owned(), "mlx".to_owned())]);
    let mut done = 0u64;
    for (members, file) in shards.iter().zip(&names) {
        let mut tensors = Vec::new(); // (entry, part) per tensor
        for &i in members {
            for (part, s) in specs(&ents[i], spec).into_iter().enumerate() {
                weight_map.insert(s.name.clone(), file.clone());
                tensors.push((i, part, s));
            }
        }
        let file_specs: Vec<TensorSpec> = tensors.iter().map(|t| t.2.clone()).collect();
        let mut current: Option<Stored> = None;
        write(&out.join(file), &file_specs, &meta, |k, buf| {
            let (i, part, _) = &tensors[k];
            let e = &ents[*i];
            if *part == 0 {
                current = Some(convert(e, values, spec)?);
            }
            match current.as_ref().context("internal: tensor parts out of order")? {
                Stored::Float(v) => encode_floats(v, file_specs[k].dtype, buf)?,
                Stored::Quant(mats) => {
                    let mut at = 0;
                    for m in mats {
                        let bytes: Vec<u8> = match part {
                            0 => m.packed().iter().flat_map(|w| w.to_le_bytes()).collect(),
                            1 => m.scales().iter().flat_map(|s| s.to_le_bytes()).collect(),
                            _ => m.biases().iter().flat_map(|s| s.to_le_bytes()).collect(),
                        };
                        buf[at..at + bytes.len()].copy_from_slice(&bytes);
                        at += bytes.len();
                    }
                }
            }
            done += buf.len() as u64;
            progress(done, total);
            Ok(())
        })?;
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(out.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index)?)?;
    Ok(())
}

/// A self-updating stderr progress line with bytes/s, for [`write_checkpoint`].
pub fn progress_line(what: &str) -> impl FnMut(u64, u64) + '_ {
    let t0 = Instant::now();
    let mut last = 0.0f64;
    move |done, total| {
        let t = t0.elapsed().as_secs_f64();
        if t - last < 0.25 && done < total {
            return;
        }
        last = t;
        let gb = |b: u64| b as f64 / 1e9;
        eprint!(
            "\r{what}: {:.2} / {:.2} GB ({:.0}%) at {:.1} MB/s   ",
            gb(done),
            gb(total),
            100.0 * done as f64 / total.max(1) as f64,
            done as f64 / t.max(1e-9) / 1e6
        );
        if done >= total {
            eprintln!();
        }
    }
}

/// The weights of a Hugging Face checkpoint (official `model.language_model.*` + `lm_head.weight`, or plain
/// `model.*`; fused `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate first) + `down_proj`, or per-expert tensors)
/// in mlx layout.
pub struct HfValues<'a> {
    ckpt: &'a Checkpoint,
    prefix: &'static str,
}

impl<'a> HfValues<'a> {
    pub fn new(ckpt: &'a Checkpoint) -> Result<HfValues<'a>> {
        for prefix in ["model.language_model.", "model."] {
            if ckpt.contains(&format!("{prefix}embed_tokens.weight")) {
                return Ok(HfValues { ckpt, prefix });
            }
        }
        bail!(
            "missing tensor model.language_model.embed_tokens.weight in checkpoint {} (also looked for model.* and \
             language_model.model.* names)",
            ckpt.dir.display()
        )
    }

    /// The HF name of an mlx tensor or module name.
    fn hf(&self, name: &str) -> String {
        if let Some(rest) = name.strip_prefix(MTP_PREFIX) {
            return format!("mtp.{rest}");
        }
        match name.strip_prefix(PREFIX) {
            Some(rest) => format!("{}{rest}", self.prefix),
            None if name == LM_HEAD => "lm_head".into(),
            None => name.into(),
        }
    }

    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.ckpt.require(name)?;
        check_shape(&t, shape)?;
        t.to_f32()
    }
}

/// `t` must have `shape`, ignoring size-1 axes when the ranks differ.
pub fn check_shape(t: &TensorView, shape: &[usize]) -> Result<()> {
    let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    let ok = t.shape == shape || (t.shape.len() != shape.len() && squeeze(t.shape) == squeeze(shape));
    if !ok {
        bail!("{}: tensor {} has shape {:?}, expected {:?}", t.file.display(), t.name, t.shape, shape);
    }
    Ok(())
}

impl Values for HfValues<'_> {
    fn has_mtp(&self) -> bool {
        self.ckpt.contains("mtp.fc.weight")
    }

    fn values(&self, e: &Entry, x: usize) -> Result<Vec<f32>> {
        let hf = self.hf(&e.name);
        match e.kind {
            Kind::Linear if e.experts() > 1 || e.name.contains(".switch_mlp.") => {
                let (rows, cols) = e.matrix();
                let (mlp, proj) = hf.split_once("switch_mlp.").context("stacked entry outside switch_mlp")?;
                let fused = format!("{mlp}experts.gate_up_proj");
                if !self.ckpt.contains(&fused) {
                    return self.f32(&format!("{mlp}experts.{x}.{proj}.weight"), &[rows, cols]);
                }
                let n = e.experts();
                let (name, shape, start) = match proj {
                    "gate_proj" => (fused, vec![n, 2 * rows, cols], 2 * x * rows * cols),
                    "up_proj" => (fused, vec![n, 2 * rows, cols], (2 * x + 1) * rows * cols),
                    _ => (format!("{mlp}experts.down_proj"), vec![n, rows, cols], x * rows * cols),
                };
                let t = self.ckpt.require(&name)?;
                check_shape(&t, &shape)?;
                t.to_f32_range(start..start + rows * cols)
            }
            Kind::Linear => self.f32(&format!("{hf}.weight"), &e.shape),
            Kind::Norm1p => Ok(self.f32(&hf, &e.shape)?.into_iter().map(|w| 1.0 + w).collect()),
            // HF stores the conv as [C, 1, K]: the same values in the same order as mlx's [C, K, 1].
            _ if hf.ends_with("conv1d.weight") => self.f32(&hf, &[e.shape[0], 1, e.shape[1]]),
            Kind::Plain | Kind::PlainF32 => self.f32(&hf, &e.shape),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real model's mlx 4-bit layout: model-spec §4.2 counts 1757 text tensors and ≈ 19.51 GB.
    #[test]
    fn real_layout_has_the_mlx_community_tensor_count_and_size() {
        let Some(dir) = crate::testutil::qwen_dir() else {
            println!("SKIPPED: real_layout_has_the_mlx_community_tensor_count_and_size: TERN_QWEN_DIR not set");
            return;
        };
        let c = Config::from_dir(&dir).unwrap();
        let spec = QuantSpec::q4(&c);
        let all: Vec<TensorSpec> = entries(&c).iter().flat_map(|e| specs(e, &spec)).collect();
        let bytes: usize = all.iter().map(TensorSpec::bytes).sum();
        println!("{} tensors, {bytes} bytes", all.len());
        assert_eq!(all.len(), 1757);
        assert!((19.4e9..19.6e9).contains(&(bytes as f64)), "{bytes}");
        assert_eq!(spec.to_json().as_object().unwrap().len(), 3 + 2 * (c.num_layers() + c.mtp_num_hidden_layers));
        // The MTP block (model-spec §3.3: 19 official tensors, ≈ 0.84 B parameters): 20 entries (the fused experts
        // split in two): 13 quantised linears and 7 norms.
        let mtp = mtp_entries(&c);
        assert_eq!(mtp.len(), 20);
        let params: usize = mtp.iter().map(|e| e.shape.iter().product::<usize>()).sum();
        assert!((0.83e9..0.86e9).contains(&(params as f64)), "{params}");
        let mtp_specs: Vec<TensorSpec> = mtp.iter().flat_map(|e| specs(e, &spec)).collect();
        assert_eq!(mtp_specs.len(), 13 * 3 + 7);
        let router = mtp_specs.iter().find(|s| s.name == format!("{MTP_PREFIX}layers.0.mlp.gate.weight")).unwrap();
        assert_eq!(router.shape, [256, 2048 * 8 / 32], "8-bit MTP router");
        assert_eq!(QuantSpec::from_config(&json!({ "quantization": spec.to_json() })).unwrap(), Some(spec));
    }
}
