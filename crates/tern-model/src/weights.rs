//! The model's weights in memory, and loading them from a Hugging Face checkpoint.
//!
//! Accepted names: the official `model.language_model.*` + top-level `lm_head.weight`, plain `model.*`, and
//! mlx-style `language_model.model.*` / `language_model.lm_head.*`; fused experts (`mlp.experts.gate_up_proj`
//! `[E, 2I, H]` gate first, `mlp.experts.down_proj` `[E, H, I]`) or per-expert tensors
//! (`mlp.experts.{e}.{gate,up,down}_proj.weight`). `model.visual.*` and `mtp.*` are not read.
//!
//! Norm weights are stored as the gain the norm multiplies by: the (1+w) norms get their +1 here.

use std::path::Path;

use anyhow::{bail, Result};
use rayon::prelude::*;

use crate::config::{Config, LayerKind};
use crate::safetensors::{Checkpoint, TensorView};

/// A bias-free linear layer `y = W x`, `W` stored `[rows = out, cols = in]` row-major.
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub w: Vec<f32>,
}

impl Linear {
    pub fn new(rows: usize, cols: usize, w: Vec<f32>) -> Linear {
        assert_eq!(w.len(), rows * cols, "Linear: {rows}x{cols} needs {} values", rows * cols);
        Linear { rows, cols, w }
    }

    /// `y[t] = W x[t]` for `n` tokens: `x` is `[n, cols]`, `y` is `[n, rows]`. Parallel over output rows.
    pub fn forward(&self, x: &[f32], n: usize, y: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols);
        assert_eq!(y.len(), n * self.rows);
        if n == 1 {
            y.par_chunks_mut(64).enumerate().for_each(|(c, ys)| {
                for (i, yv) in ys.iter_mut().enumerate() {
                    let r = c * 64 + i;
                    *yv = dot(&self.w[r * self.cols..(r + 1) * self.cols], x);
                }
            });
            return;
        }
        // Row blocks in parallel; every token reads the same block of W while it is in cache.
        let block = 16;
        let cols = self.cols;
        let rows = self.rows;
        let parts: Vec<(usize, Vec<f32>)> = (0..rows.div_ceil(block))
            .into_par_iter()
            .map(|b| {
                let r0 = b * block;
                let r1 = (r0 + block).min(rows);
                let mut out = vec![0.0; n * (r1 - r0)];
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    for r in r0..r1 {
                        out[t * (r1 - r0) + r - r0] = dot(&self.w[r * cols..(r + 1) * cols], xt);
                    }
                }
                (r0, out)
            })
            .collect();
        for (r0, out) in parts {
            let w = out.len() / n;
            for t in 0..n {
                y[t * rows + r0..t * rows + r0 + w].copy_from_slice(&out[t * w..(t + 1) * w]);
            }
        }
    }

    /// Row `r` of W (an embedding lookup).
    pub fn row(&self, r: usize) -> &[f32] {
        &self.w[r * self.cols..(r + 1) * self.cols]
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

pub enum Mixer {
    Attention(Attention),
    DeltaNet(GatedDeltaNet),
}

/// A SwiGLU MLP: `down(silu(gate x) * up x)`.
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Moe {
    /// `[num_experts, hidden]`.
    pub router: Linear,
    pub experts: Vec<Mlp>,
    pub shared: Mlp,
    /// `[1, hidden]`.
    pub shared_gate: Linear,
}

pub struct Layer {
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_norm: Vec<f32>,
    pub moe: Moe,
}

pub struct Weights {
    pub config: Config,
    /// `[vocab, hidden]`.
    pub embed: Linear,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`.
    pub lm_head: Linear,
}

/// Finds tensors under whichever naming convention the checkpoint uses, and checks shapes.
struct Names<'a> {
    ckpt: &'a Checkpoint,
    prefix: &'static str,
}

impl<'a> Names<'a> {
    fn new(ckpt: &'a Checkpoint) -> Result<Names<'a>> {
        for prefix in ["model.language_model.", "model.", "language_model.model."] {
            if ckpt.contains(&format!("{prefix}embed_tokens.weight")) {
                return Ok(Names { ckpt, prefix });
            }
        }
        bail!(
            "missing tensor model.language_model.embed_tokens.weight in checkpoint {} (also looked for model.* and \
             language_model.model.* names)",
            ckpt.dir.display()
        )
    }

    fn view(&self, name: &str) -> Result<TensorView<'a>> {
        self.ckpt.require(name)
    }

    /// An f32 copy of tensor `name`, whose shape must equal `shape` (ignoring size-1 axes when `squeeze`).
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.view(name)?;
        check_shape(&t, shape)?;
        t.to_f32()
    }

    fn norm_1p(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        Ok(self.f32(name, &[n])?.into_iter().map(|w| 1.0 + w).collect())
    }

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        Ok(Linear::new(rows, cols, self.f32(name, &[rows, cols])?))
    }

    fn layer(&self, i: usize) -> String {
        format!("{}layers.{i}.", self.prefix)
    }
}

fn check_shape(t: &TensorView, shape: &[usize]) -> Result<()> {
    let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    let ok = t.shape == shape || (t.shape.len() != shape.len() && squeeze(t.shape) == squeeze(shape));
    if !ok {
        bail!("{}: tensor {} has shape {:?}, expected {:?}", t.file.display(), t.name, t.shape, shape);
    }
    Ok(())
}

impl Weights {
    /// Load a checkpoint directory (config.json + safetensors) as f32 weights.
    pub fn load(dir: &Path) -> Result<Weights> {
        let config = Config::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Weights::from_checkpoint(config, &ckpt)
    }

    pub fn from_checkpoint(config: Config, ckpt: &Checkpoint) -> Result<Weights> {
        let c = &config;
        let n = Names::new(ckpt)?;
        let h = c.hidden_size;
        let embed = n.linear(&format!("{}embed_tokens.weight", n.prefix), c.vocab_size, h)?;
        let norm = n.norm_1p(&format!("{}norm.weight", n.prefix), h)?;
        let head_name = ["lm_head.weight", "language_model.lm_head.weight"].into_iter().find(|k| ckpt.contains(k));
        let lm_head = match head_name {
            Some(k) => n.linear(k, c.vocab_size, h)?,
            None if c.tie_word_embeddings => Linear::new(c.vocab_size, h, embed.w.clone()),
            None => bail!("missing tensor lm_head.weight in checkpoint {}", ckpt.dir.display()),
        };
        let layers = (0..c.num_layers()).map(|i| load_layer(&n, c, i)).collect::<Result<Vec<_>>>()?;
        Ok(Weights { config, embed, layers, norm, lm_head })
    }
}

fn load_layer(n: &Names, c: &Config, i: usize) -> Result<Layer> {
    let p = n.layer(i);
    let h = c.hidden_size;
    let mixer = match c.layer_types[i] {
        LayerKind::Full => {
            let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let a = format!("{p}self_attn.");
            Mixer::Attention(Attention {
                q_proj: n.linear(&format!("{a}q_proj.weight"), nh * hd * 2, h)?,
                k_proj: n.linear(&format!("{a}k_proj.weight"), nkv * hd, h)?,
                v_proj: n.linear(&format!("{a}v_proj.weight"), nkv * hd, h)?,
                o_proj: n.linear(&format!("{a}o_proj.weight"), h, nh * hd)?,
                q_norm: n.norm_1p(&format!("{a}q_norm.weight"), hd)?,
                k_norm: n.norm_1p(&format!("{a}k_norm.weight"), hd)?,
            })
        }
        LayerKind::Linear => {
            let g = format!("{p}linear_attn.");
            let (cd, hv, kk) = (c.linear_conv_dim(), c.linear_num_value_heads, c.linear_conv_kernel_dim);
            Mixer::DeltaNet(GatedDeltaNet {
                in_proj_qkv: n.linear(&format!("{g}in_proj_qkv.weight"), cd, h)?,
                in_proj_z: n.linear(&format!("{g}in_proj_z.weight"), c.linear_value_dim(), h)?,
                in_proj_b: n.linear(&format!("{g}in_proj_b.weight"), hv, h)?,
                in_proj_a: n.linear(&format!("{g}in_proj_a.weight"), hv, h)?,
                conv: n.f32(&format!("{g}conv1d.weight"), &[cd, 1, kk]).or_else(|e| {
                    // mlx stores the conv as [C, K, 1].
                    n.f32(&format!("{g}conv1d.weight"), &[cd, kk]).map_err(|_| e)
                })?,
                a_log: n.f32(&format!("{g}A_log"), &[hv])?,
                dt_bias: n.f32(&format!("{g}dt_bias"), &[hv])?,
                norm: n.f32(&format!("{g}norm.weight"), &[c.linear_value_head_dim])?,
                out_proj: n.linear(&format!("{g}out_proj.weight"), h, c.linear_value_dim())?,
            })
        }
    };
    Ok(Layer {
        input_norm: n.norm_1p(&format!("{p}input_layernorm.weight"), h)?,
        mixer,
        post_norm: n.norm_1p(&format!("{p}post_attention_layernorm.weight"), h)?,
        moe: load_moe(n, c, &p)?,
    })
}

fn load_moe(n: &Names, c: &Config, p: &str) -> Result<Moe> {
    let (h, e, im, si) = (c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size);
    let m = format!("{p}mlp.");
    let fused = format!("{m}experts.gate_up_proj");
    let experts = if n.ckpt.contains(&fused) {
        let gu = n.f32(&fused, &[e, 2 * im, h])?;
        let down = n.f32(&format!("{m}experts.down_proj"), &[e, h, im])?;
        (0..e)
            .map(|x| {
                let base = x * 2 * im * h;
                Mlp {
                    gate: Linear::new(im, h, gu[base..base + im * h].to_vec()),
                    up: Linear::new(im, h, gu[base + im * h..base + 2 * im * h].to_vec()),
                    down: Linear::new(h, im, down[x * h * im..(x + 1) * h * im].to_vec()),
                }
            })
            .collect()
    } else {
        (0..e)
            .map(|x| {
                let q = format!("{m}experts.{x}.");
                Ok(Mlp {
                    gate: n.linear(&format!("{q}gate_proj.weight"), im, h)?,
                    up: n.linear(&format!("{q}up_proj.weight"), im, h)?,
                    down: n.linear(&format!("{q}down_proj.weight"), h, im)?,
                })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let s = format!("{m}shared_expert.");
    Ok(Moe {
        router: n.linear(&format!("{m}gate.weight"), e, h)?,
        experts,
        shared: Mlp {
            gate: n.linear(&format!("{s}gate_proj.weight"), si, h)?,
            up: n.linear(&format!("{s}up_proj.weight"), si, h)?,
            down: n.linear(&format!("{s}down_proj.weight"), h, si)?,
        },
        shared_gate: n.linear(&format!("{m}shared_expert_gate.weight"), 1, h)?,
    })
}
