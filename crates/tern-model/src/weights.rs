//! The model's weights in memory, and loading them from a checkpoint directory:
//!
//! * an mlx-community checkpoint (`language_model.model.*`, see [`crate::mlx`]): quantised tensors are used in
//!   place from the memory-mapped files (zero-copy), stacked experts cut with [`crate::quant::Slab::sub`];
//! * a Hugging Face checkpoint (official `model.language_model.*` / plain `model.*` names, fused or per-expert
//!   experts; see [`crate::mlx::HfValues`]): as f32 (the reference oracle), or with [`LoadOptions::quantize`]
//!   quantised on load by the same conversion as `tern quantize` ([`crate::mlx::convert`]).
//!
//! `model.visual.*` (the vision tower, [`crate::vision`]) is read in f32 when present; the multi-token-prediction block (`mtp.*`, [`Mtp`]) is read when the checkpoint
//! has it (the official bf16 one does; mlx-community's 4-bit ones drop it, and the load then says so in one
//! line). Norm weights are stored as the gain the norm multiplies by (the
//! (1+w) norms with their +1 folded in).

use std::path::Path;

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use half::bf16;
use rayon::prelude::*;
use serde_json::Value;

use crate::config::{Config, LayerKind};
use crate::mlx::{self, check_shape, convert, Entry, HfValues, QuantSpec, Stored, Values, LM_HEAD, MTP_PREFIX, PREFIX};
use crate::quant::{QuantMatrix, Slab};
use crate::safetensors::{Checkpoint, Dtype};

/// A bias-free linear layer `y = W x`, `W` logically `[rows = out, cols = in]` row-major: f32 (the reference
/// oracle, and matrices whose input dimension the group size does not divide) or MLX affine quantised.
#[derive(Clone)]
pub enum Linear {
    F32 { rows: usize, cols: usize, w: Vec<f32> },
    Quant(QuantMatrix),
}

impl Linear {
    pub fn new(rows: usize, cols: usize, w: Vec<f32>) -> Linear {
        assert_eq!(w.len(), rows * cols, "Linear: {rows}x{cols} needs {} values", rows * cols);
        Linear::F32 { rows, cols, w }
    }

    pub fn rows(&self) -> usize {
        match self {
            Linear::F32 { rows, .. } => *rows,
            Linear::Quant(q) => q.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Linear::F32 { cols, .. } => *cols,
            Linear::Quant(q) => q.cols(),
        }
    }

    /// Bytes of weight data read by one full pass over the matrix (packed codes + scales + biases when quantised).
    pub fn bytes(&self) -> usize {
        match self {
            Linear::F32 { w, .. } => w.len() * 4,
            Linear::Quant(q) => q.packed().len() * 4 + (q.scales().len() + q.biases().len()) * 2,
        }
    }

    /// The f32 form of this matrix (the reference oracle for a quantised one).
    pub fn dequantized(&self) -> Linear {
        match self {
            Linear::F32 { .. } => self.clone(),
            Linear::Quant(q) => Linear::new(q.rows(), q.cols(), q.dequantize()),
        }
    }

    /// `y[t] = W x[t]` for `n` tokens: `x` is `[n, cols]`, `y` is `[n, rows]`. Quantised matrices use the fused
    /// kernels (no f32 copy of the weights).
    pub fn forward(&self, x: &[f32], n: usize, y: &mut [f32]) {
        match self {
            Linear::F32 { rows, cols, w } => f32_forward(w, *rows, *cols, x, n, y),
            Linear::Quant(q) => q.gemm(x, n, y),
        }
    }

    /// Row `r` of W into `out` (an embedding lookup; dequantises one row).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match self {
            Linear::F32 { cols, w, .. } => out.copy_from_slice(&w[r * cols..(r + 1) * cols]),
            Linear::Quant(q) => q.dequantize_row(r, out),
        }
    }
}

/// The f32 path of [`Linear::forward`]: parallel over output rows.
fn f32_forward(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * cols);
    assert_eq!(y.len(), n * rows);
    if n == 1 {
        y.par_chunks_mut(64).enumerate().for_each(|(c, ys)| {
            for (i, yv) in ys.iter_mut().enumerate() {
                let r = c * 64 + i;
                *yv = dot(&w[r * cols..(r + 1) * cols], x);
            }
        });
        return;
    }
    // Row blocks in parallel; every token reads the same block of W while it is in cache.
    let block = 16;
    let parts: Vec<(usize, Vec<f32>)> = (0..rows.div_ceil(block))
        .into_par_iter()
        .map(|b| {
            let r0 = b * block;
            let r1 = (r0 + block).min(rows);
            let mut out = vec![0.0; n * (r1 - r0)];
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                for r in r0..r1 {
                    out[t * (r1 - r0) + r - r0] = dot(&w[r * cols..(r + 1) * cols], xt);
                }
            }
            (r0, out)
        })
        .collect();
    for (r0, out) in parts {
        let bw = out.len() / n;
        for t in 0..n {
            y[t * rows + r0..t * rows + r0 + bw].copy_from_slice(&out[t * bw..(t + 1) * bw]);
        }
    }
}

/// f32 dot product with 8 independent accumulators (lets the compiler vectorise).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[derive(Clone)]
pub struct Attention {
    /// `[num_heads * head_dim * 2, hidden]`: per head, head_dim query rows then head_dim gate rows.
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// (1+w) gains over head_dim.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Clone)]
pub struct GatedDeltaNet {
    /// `[2*key_dim + value_dim, hidden]`: q ‖ k ‖ v, flat.
    pub in_proj_qkv: Linear,
    pub in_proj_z: Linear,
    pub in_proj_b: Linear,
    pub in_proj_a: Linear,
    /// Depthwise causal conv, `[conv_dim, kernel]`; tap kernel-1 multiplies the current token.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Plain gain of the gated RMSNorm over value_head_dim.
    pub norm: Vec<f32>,
    pub out_proj: Linear,
}

#[derive(Clone)]
pub enum Mixer {
    Attention(Attention),
    DeltaNet(GatedDeltaNet),
}

/// A SwiGLU MLP: `down(silu(gate x) * up x)`.
#[derive(Clone)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

#[derive(Clone)]
pub struct Moe {
    /// `[num_experts, hidden]`.
    pub router: Linear,
    pub experts: Vec<Mlp>,
    pub shared: Mlp,
    /// `[1, hidden]`.
    pub shared_gate: Linear,
}

#[derive(Clone)]
pub struct Layer {
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_norm: Vec<f32>,
    pub moe: Moe,
}

/// The multi-token-prediction block (model-spec §3.3, vLLM `qwen3_5_mtp.py`): it shares `embed` and `lm_head`
/// with the main model. See [`crate::forward`] for its forward pass.
#[derive(Clone)]
pub struct Mtp {
    /// `[hidden, 2 * hidden]` over `[pre_fc_norm_embedding(embed(next id)) ; pre_fc_norm_hidden(hidden)]`.
    pub fc: Linear,
    /// (1+w) gains.
    pub pre_fc_norm_embedding: Vec<f32>,
    pub pre_fc_norm_hidden: Vec<f32>,
    /// One full-attention decoder layer with its MoE (`mtp.layers.0`).
    pub layer: Layer,
    /// The (1+w) final norm of the branch, before the shared lm_head.
    pub norm: Vec<f32>,
}

#[derive(Clone)]
pub struct Weights {
    pub config: Config,
    /// `[vocab, hidden]`.
    pub embed: Linear,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`.
    pub lm_head: Linear,
    /// The MTP block, when the checkpoint has one (see [`Weights::mtp_off_reason`]).
    pub mtp: Option<Mtp>,
    /// The vision tower (f32), when the checkpoint has `model.visual.*` (or `visual.*`) tensors and its config a
    /// `vision_config`; see [`crate::vision`].
    pub vision: Option<crate::vision::Vision>,
}

/// How [`Weights::load_with`] treats an unquantised (Hugging Face) checkpoint.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Quantise every projection to 4-bit on load (router and shared expert gate 8-bit), exactly as
    /// `tern quantize` would. mlx checkpoints are always used as stored.
    pub quantize: bool,
}

impl Weights {
    /// Load a checkpoint directory (config.json + safetensors): mlx checkpoints as stored, HF ones as f32.
    pub fn load(dir: &Path) -> Result<Weights> {
        Weights::load_with(dir, LoadOptions::default())
    }

    pub fn load_with(dir: &Path, opts: LoadOptions) -> Result<Weights> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let json: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        let config = Config::from_json(&json).with_context(|| format!("in {}", path.display()))?;
        let spec = QuantSpec::from_config(&json).with_context(|| format!("in {}", path.display()))?;
        let ckpt = Checkpoint::open(dir)?;
        let vision_config =
            crate::vision::VisionConfig::from_json(&json).with_context(|| format!("in {}", path.display()))?;
        let mut w = if ckpt.contains(&format!("{PREFIX}embed_tokens.weight")) {
            Weights::build(config, &Source::Mlx { ckpt: &ckpt, spec })?
        } else {
            let values = HfValues::new(&ckpt)?;
            let spec = opts.quantize.then(|| QuantSpec::q4(&config));
            Weights::from_values(config, &values, spec.as_ref())?
        };
        if let (Some(vc), Some(prefix)) = (vision_config, crate::vision::vision_prefix(&ckpt)) {
            w.vision = Some(crate::vision::Vision::load(&ckpt, prefix, vc)?);
        }
        if let Some(why) = w.mtp_off_reason() {
            eprintln!("tern: {}: multi-token prediction off: {why}", dir.display());
        }
        Ok(w)
    }

    /// Why this model has no MTP block, or `None` when it has one.
    pub fn mtp_off_reason(&self) -> Option<String> {
        match &self.mtp {
            Some(_) => None,
            // The config's reason if it has one, else the tensors were missing.
            None => mtp_off(&self.config, true).or_else(|| mtp_off(&self.config, false)),
        }
    }

    /// Weights from f32 values (an HF checkpoint, random values), stored as `spec` says (`None`: all f32).
    pub fn from_values(config: Config, values: &dyn Values, spec: Option<&QuantSpec>) -> Result<Weights> {
        Weights::build(config, &Source::Values { values, spec })
    }

    /// A copy with every quantised matrix dequantised to f32: the reference the fast path must match.
    pub fn dequantized(&self) -> Weights {
        let mut w = self.clone();
        w.linears_mut().into_iter().for_each(|l| *l = l.dequantized());
        w
    }

    /// Every linear of the model (embedding, lm_head and the MTP block's included).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut v = vec![&mut self.embed, &mut self.lm_head];
        let mtp = self.mtp.as_mut().map(|m| {
            v.push(&mut m.fc);
            &mut m.layer
        });
        for l in self.layers.iter_mut().chain(mtp) {
            match &mut l.mixer {
                Mixer::Attention(a) => v.extend([&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj]),
                Mixer::DeltaNet(g) => v.extend([
                    &mut g.in_proj_qkv,
                    &mut g.in_proj_z,
                    &mut g.in_proj_b,
                    &mut g.in_proj_a,
                    &mut g.out_proj,
                ]),
            }
            let m = &mut l.moe;
            v.extend([&mut m.router, &mut m.shared_gate]);
            for e in m.experts.iter_mut().chain([&mut m.shared]) {
                v.extend([&mut e.gate, &mut e.up, &mut e.down]);
            }
        }
        v
    }

    fn build(config: Config, src: &Source) -> Result<Weights> {
        let all = mlx::entries(&config).into_iter().chain(mlx::mtp_entries(&config));
        let ld = Loader { src, entries: all.map(|e| (e.name.clone(), e)).collect() };
        let c = &config;
        let embed = ld.linear(&format!("{PREFIX}embed_tokens"))?;
        let norm = ld.vector(&format!("{PREFIX}norm.weight"))?;
        let lm_head = if c.tie_word_embeddings { embed.clone() } else { ld.linear(LM_HEAD)? };
        let layers = (0..c.num_layers())
            .map(|i| load_layer(&ld, &format!("{PREFIX}layers.{i}."), c.layer_types[i]))
            .collect::<Result<Vec<_>>>()?;
        let has_mtp = match src {
            Source::Mlx { ckpt, .. } => ckpt.contains(&format!("{MTP_PREFIX}fc.weight")),
            Source::Values { values, .. } => values.has_mtp(),
        };
        let mtp = match mtp_off(c, has_mtp) {
            Some(_) => None,
            None => Some(Mtp {
                fc: ld.linear(&format!("{MTP_PREFIX}fc"))?,
                pre_fc_norm_embedding: ld.vector(&format!("{MTP_PREFIX}pre_fc_norm_embedding.weight"))?,
                pre_fc_norm_hidden: ld.vector(&format!("{MTP_PREFIX}pre_fc_norm_hidden.weight"))?,
                layer: load_layer(&ld, &format!("{MTP_PREFIX}layers.0."), LayerKind::Full)?,
                norm: ld.vector(&format!("{MTP_PREFIX}norm.weight"))?,
            }),
        };
        Ok(Weights { config, embed, layers, norm, lm_head, mtp, vision: None })
    }
}

/// Why the MTP block of `c` is not used (`has_tensors`: the checkpoint has `mtp.fc`), or `None` when it is.
fn mtp_off(c: &Config, has_tensors: bool) -> Option<String> {
    if c.mtp_num_hidden_layers == 0 {
        return Some("config.json declares no MTP layer (mtp_num_hidden_layers)".into());
    }
    if !has_tensors {
        return Some("the checkpoint has no mtp.* tensors (mlx-community checkpoints drop them)".into());
    }
    if c.mtp_num_hidden_layers != 1 {
        return Some(format!("mtp_num_hidden_layers is {}; tern runs exactly one MTP layer", c.mtp_num_hidden_layers));
    }
    if c.mtp_use_dedicated_embeddings {
        return Some("mtp_use_dedicated_embeddings is set; tern's MTP shares embed_tokens".into());
    }
    None
}

/// Where the loader gets each tensor.
enum Source<'a> {
    /// An mlx checkpoint: quantised tensors are mapped, not copied.
    Mlx { ckpt: &'a Checkpoint, spec: Option<QuantSpec> },
    /// f32 values, converted as `spec` says (`None`: f32).
    Values { values: &'a dyn Values, spec: Option<&'a QuantSpec> },
}

struct Loader<'a> {
    src: &'a Source<'a>,
    entries: HashMap<String, Entry>,
}

impl Loader<'_> {
    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).with_context(|| format!("internal: no layout entry {name}"))
    }

    /// A non-stacked linear.
    fn linear(&self, name: &str) -> Result<Linear> {
        Ok(self.stacked(name)?.swap_remove(0))
    }

    /// One linear per expert (one for a non-stacked entry).
    fn stacked(&self, name: &str) -> Result<Vec<Linear>> {
        let e = self.entry(name)?;
        let (rows, cols) = e.matrix();
        let n = e.experts();
        let split = |v: Vec<f32>| v.chunks_exact(rows * cols).map(|w| Linear::new(rows, cols, w.to_vec())).collect();
        match self.src {
            Source::Values { values, spec: None } => {
                (0..n).map(|x| Ok(Linear::new(rows, cols, values.values(e, x)?))).collect()
            }
            Source::Values { values, spec: Some(spec) } => Ok(match convert(e, *values, spec)? {
                Stored::Quant(m) => m.into_iter().map(Linear::Quant).collect(),
                Stored::Float(v) => split(v),
            }),
            Source::Mlx { ckpt, spec } => {
                let scales = format!("{name}.scales");
                let w = ckpt.require(&format!("{name}.weight"))?;
                if !ckpt.contains(&scales) {
                    check_shape(&w, &e.shape)?;
                    return Ok(split(w.to_f32()?));
                }
                let spec = spec.as_ref().with_context(|| {
                    format!("{}: tensor {scales} exists but config.json has no quantization", w.file.display())
                })?;
                let (gs, bits) = spec.params(name);
                let (s, b) = (ckpt.require(&scales)?, ckpt.require(&format!("{name}.biases"))?);
                let lead = &e.shape[..e.shape.len() - 1];
                let with = |d: usize| lead.iter().copied().chain([d]).collect::<Vec<_>>();
                check_shape(&w, &with(cols * bits as usize / 32))
                    .with_context(|| format!("{bits}-bit group {gs} (from config.json quantization)"))?;
                check_shape(&s, &with(cols / gs))?;
                check_shape(&b, &with(cols / gs))?;
                let (pw, ps, pb) =
                    (w.slab::<u32>(Dtype::U32)?, s.slab::<bf16>(Dtype::BF16)?, b.slab::<bf16>(Dtype::BF16)?);
                let (wn, gn) = (rows * cols * bits as usize / 32, rows * cols / gs);
                let cut = |x: usize| -> Result<Linear> {
                    let part = |sl: &Slab<bf16>| sl.sub(x * gn..(x + 1) * gn);
                    let m = QuantMatrix::from_parts(
                        rows,
                        cols,
                        bits,
                        gs,
                        pw.sub(x * wn..(x + 1) * wn)?,
                        part(&ps)?,
                        part(&pb)?,
                    )?;
                    Ok(Linear::Quant(m))
                };
                (0..n).map(|x| cut(x).with_context(|| format!("{}: tensor {name}.weight", w.file.display()))).collect()
            }
        }
    }

    /// A vector (norm gain, conv, A_log, dt_bias) as the model uses it.
    fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        match self.src {
            Source::Values { values, spec: None } => values.values(e, 0),
            Source::Values { values, spec: Some(spec) } => match convert(e, *values, spec)? {
                Stored::Float(v) => Ok(v),
                Stored::Quant(_) => bail!("internal: {name} is not a vector"),
            },
            Source::Mlx { ckpt, .. } => {
                let t = ckpt.require(name)?;
                check_shape(&t, &e.shape)?;
                t.to_f32()
            }
        }
    }
}

/// The decoder layer whose tensor names start with `p` (a main layer, or the MTP block's).
fn load_layer(ld: &Loader, p: &str, kind: LayerKind) -> Result<Layer> {
    let lin = |rel: &str| ld.linear(&format!("{p}{rel}"));
    let vec = |rel: &str| ld.vector(&format!("{p}{rel}"));
    let mixer = match kind {
        LayerKind::Full => Mixer::Attention(Attention {
            q_proj: lin("self_attn.q_proj")?,
            k_proj: lin("self_attn.k_proj")?,
            v_proj: lin("self_attn.v_proj")?,
            o_proj: lin("self_attn.o_proj")?,
            q_norm: vec("self_attn.q_norm.weight")?,
            k_norm: vec("self_attn.k_norm.weight")?,
        }),
        LayerKind::Linear => Mixer::DeltaNet(GatedDeltaNet {
            in_proj_qkv: lin("linear_attn.in_proj_qkv")?,
            in_proj_z: lin("linear_attn.in_proj_z")?,
            in_proj_b: lin("linear_attn.in_proj_b")?,
            in_proj_a: lin("linear_attn.in_proj_a")?,
            conv: vec("linear_attn.conv1d.weight")?,
            a_log: vec("linear_attn.A_log")?,
            dt_bias: vec("linear_attn.dt_bias")?,
            norm: vec("linear_attn.norm.weight")?,
            out_proj: lin("linear_attn.out_proj")?,
        }),
    };
    let stacked = |proj: &str| ld.stacked(&format!("{p}mlp.switch_mlp.{proj}"));
    let (gate, up, down) = (stacked("gate_proj")?, stacked("up_proj")?, stacked("down_proj")?);
    let experts = gate.into_iter().zip(up).zip(down).map(|((gate, up), down)| Mlp { gate, up, down }).collect();
    Ok(Layer {
        input_norm: vec("input_layernorm.weight")?,
        mixer,
        post_norm: vec("post_attention_layernorm.weight")?,
        moe: Moe {
            router: lin("mlp.gate")?,
            experts,
            shared: Mlp {
                gate: lin("mlp.shared_expert.gate_proj")?,
                up: lin("mlp.shared_expert.up_proj")?,
                down: lin("mlp.shared_expert.down_proj")?,
            },
            shared_gate: lin("mlp.shared_expert_gate")?,
        },
    })
}
