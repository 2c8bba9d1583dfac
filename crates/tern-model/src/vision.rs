//! The vision side of `Qwen3_5MoeForConditionalGeneration` on the CPU, as transformers 5.17 computes it:
//!
//! * [`preprocess`]: transformers' image processor for this model (`Qwen2VLImageProcessor`: RGB, `smart_resize` to
//!   a multiple of patch × merge within the pixel budget, bicubic resampling, rescale to [0, 1], normalise with the
//!   model's mean/std, patches in merge-block order, each frame repeated `temporal_patch_size` times), giving
//!   `pixel_values` rows `[patches, C * T * P * P]` and the grid `(t, h, w)` in patches. Decoding and resampling
//!   are the `image` crate's (PNG, JPEG; Catmull-Rom = PIL's bicubic, a = -0.5).
//! * [`Vision::forward`]: the tower (`Qwen3_5MoeVisionModel`): patch embedding (the Conv3d with stride = kernel is a
//!   linear map of each row), learned position embeddings resampled bilinearly (align_corners) to the grid, the
//!   blocks (LayerNorm, non-causal attention per image with 2-D rotary embeddings, GELU-tanh MLP), and the 2 × 2
//!   merger (LayerNorm, then fc1 → exact GELU → fc2 over the 4 concatenated patches of each block) into the text
//!   hidden size: one row per image token.
//!
//! Weights are `model.visual.*` (or `visual.*`), read in f32 from an HF checkpoint when present.

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde_json::Value;

use crate::safetensors::Checkpoint;
use crate::weights::{dot, Linear};

/// The activation of the tower's MLP (`vision_config.hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// `gelu_pytorch_tanh` (the model's).
    GeluTanh,
    /// `gelu` (erf).
    Gelu,
}

/// `vision_config` plus the top-level image token ids.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
    pub rope_theta: f64,
    pub hidden_act: Act,
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

impl VisionConfig {
    /// From the root of `config.json`; `None` when it has no `vision_config`.
    pub fn from_json(root: &Value) -> Result<Option<VisionConfig>> {
        let Some(v) = root.get("vision_config").filter(|v| !v.is_null()) else { return Ok(None) };
        let uint = |k: &str, d: usize| -> Result<usize> {
            match v.get(k).filter(|x| !x.is_null()) {
                None => Ok(d),
                Some(x) => match x.as_u64() {
                    Some(n) if n > 0 => Ok(n as usize),
                    _ => bail!("vision_config.{k}: expected a positive integer, got {x}"),
                },
            }
        };
        let id = |k: &str, d: u32| -> Result<u32> {
            match root.get(k).filter(|x| !x.is_null()) {
                None => Ok(d),
                Some(x) => x.as_u64().map(|n| n as u32).with_context(|| format!("{k}: expected an integer, got {x}")),
            }
        };
        let hidden_act = match v.get("hidden_act").and_then(Value::as_str).unwrap_or("gelu_pytorch_tanh") {
            "gelu_pytorch_tanh" => Act::GeluTanh,
            "gelu" => Act::Gelu,
            a => bail!("vision_config.hidden_act: {a:?} is not supported (gelu_pytorch_tanh or gelu)"),
        };
        let rope_theta = v
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .or_else(|| v.get("rope_theta").and_then(Value::as_f64))
            .unwrap_or(10_000.0);
        let c = VisionConfig {
            depth: uint("depth", 27)?,
            hidden_size: uint("hidden_size", 1152)?,
            intermediate_size: uint("intermediate_size", 4304)?,
            num_heads: uint("num_heads", 16)?,
            in_channels: uint("in_channels", 3)?,
            patch_size: uint("patch_size", 16)?,
            temporal_patch_size: uint("temporal_patch_size", 2)?,
            spatial_merge_size: uint("spatial_merge_size", 2)?,
            out_hidden_size: uint("out_hidden_size", 3584)?,
            num_position_embeddings: uint("num_position_embeddings", 2304)?,
            rope_theta,
            hidden_act,
            image_token_id: id("image_token_id", 248_056)?,
            vision_start_token_id: id("vision_start_token_id", 248_053)?,
            vision_end_token_id: id("vision_end_token_id", 248_054)?,
        };
        if !c.hidden_size.is_multiple_of(c.num_heads) || !(c.hidden_size / c.num_heads).is_multiple_of(4) {
            bail!("vision_config: head dim {} / {} must be a multiple of 4", c.hidden_size, c.num_heads);
        }
        let side = (c.num_position_embeddings as f64).sqrt() as usize;
        if side * side != c.num_position_embeddings {
            bail!("vision_config.num_position_embeddings: {} is not a square", c.num_position_embeddings);
        }
        Ok(Some(c))
    }

    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values of one patch row: `C * T * P * P`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// A linear layer with a bias.
#[derive(Clone)]
pub struct Affine {
    pub w: Linear,
    pub b: Vec<f32>,
}

impl Affine {
    fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0.0; n * self.w.rows()];
        self.w.forward(x, n, &mut y);
        y.chunks_exact_mut(self.b.len()).for_each(|r| r.iter_mut().zip(&self.b).for_each(|(v, b)| *v += b));
        y
    }
}

#[derive(Clone)]
pub struct LayerNorm {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
}

impl LayerNorm {
    /// torch's LayerNorm (eps 1e-6) over each row of `x`.
    fn forward(&self, x: &[f32]) -> Vec<f32> {
        let d = self.w.len();
        let mut y = x.to_vec();
        for r in y.chunks_exact_mut(d) {
            let mean = r.iter().sum::<f32>() / d as f32;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let inv = 1.0 / (var + 1e-6).sqrt();
            r.iter_mut().zip(&self.w).zip(&self.b).for_each(|((v, w), b)| *v = (*v - mean) * inv * w + b);
        }
        y
    }
}

#[derive(Clone)]
pub struct VisionBlock {
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    /// `[3 * hidden, hidden]`: q ‖ k ‖ v, heads contiguous within each.
    pub qkv: Affine,
    pub proj: Affine,
    pub fc1: Affine,
    pub fc2: Affine,
}

/// The vision tower's weights (f32).
#[derive(Clone)]
pub struct Vision {
    pub config: VisionConfig,
    /// The Conv3d as `[hidden, C * T * P * P]`.
    pub patch_embed: Affine,
    /// `[num_position_embeddings, hidden]`.
    pub pos_embed: Vec<f32>,
    pub blocks: Vec<VisionBlock>,
    pub merger_norm: LayerNorm,
    /// `[4 * hidden, 4 * hidden]`.
    pub merger_fc1: Affine,
    /// `[out_hidden, 4 * hidden]`.
    pub merger_fc2: Affine,
}

/// The name prefix of the tower's tensors in `ckpt` (`model.visual.` or `visual.`), if it has them.
pub fn vision_prefix(ckpt: &Checkpoint) -> Option<&'static str> {
    ["model.visual.", "visual."].into_iter().find(|p| ckpt.contains(&format!("{p}patch_embed.proj.weight")))
}

impl Vision {
    /// Read the tower under `prefix` from `ckpt` (f32 whatever the stored type).
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: VisionConfig) -> Result<Vision> {
        let c = &config;
        let tensor = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let full = format!("{prefix}{name}");
            let t = ckpt.require(&full)?;
            if t.shape != shape {
                bail!("{}: tensor {full} has shape {:?}, vision_config says {shape:?}", t.file.display(), t.shape);
            }
            t.to_f32()
        };
        let affine = |name: &str, rows: usize, cols: usize| -> Result<Affine> {
            Ok(Affine {
                w: Linear::new(rows, cols, tensor(&format!("{name}.weight"), &[rows, cols])?),
                b: tensor(&format!("{name}.bias"), &[rows])?,
            })
        };
        let norm = |name: &str, d: usize| -> Result<LayerNorm> {
            Ok(LayerNorm { w: tensor(&format!("{name}.weight"), &[d])?, b: tensor(&format!("{name}.bias"), &[d])? })
        };
        let (h, i, m) = (c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size.pow(2));
        let conv = [h, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size];
        let patch_embed = Affine {
            w: Linear::new(h, c.patch_dim(), tensor("patch_embed.proj.weight", &conv)?),
            b: tensor("patch_embed.proj.bias", &[h])?,
        };
        let blocks = (0..c.depth)
            .map(|b| {
                let p = format!("blocks.{b}.");
                Ok(VisionBlock {
                    norm1: norm(&format!("{p}norm1"), h)?,
                    norm2: norm(&format!("{p}norm2"), h)?,
                    qkv: affine(&format!("{p}attn.qkv"), 3 * h, h)?,
                    proj: affine(&format!("{p}attn.proj"), h, h)?,
                    fc1: affine(&format!("{p}mlp.linear_fc1"), i, h)?,
                    fc2: affine(&format!("{p}mlp.linear_fc2"), h, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Vision {
            pos_embed: tensor("pos_embed.weight", &[c.num_position_embeddings, h])?,
            patch_embed,
            blocks,
            merger_norm: norm("merger.norm", h)?,
            merger_fc1: affine("merger.linear_fc1", m, m)?,
            merger_fc2: affine("merger.linear_fc2", c.out_hidden_size, m)?,
            config,
        })
    }

    /// The tower over the `pixel_values` rows of one or more images (`grids[i]` = (t, h, w) in patches, rows in
    /// the processor's order): the merged rows `[Σ t·h·w / merge², out_hidden]`, images in order.
    pub fn forward(&self, pixels: &[f32], grids: &[[usize; 3]]) -> Result<Vec<f32>> {
        let c = &self.config;
        let (hd, m) = (c.hidden_size, c.spatial_merge_size);
        let n: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        if pixels.len() != n * c.patch_dim() {
            bail!("vision: {} pixel values for {n} patches of {} values", pixels.len(), c.patch_dim());
        }
        if let Some(g) = grids.iter().find(|g| g.contains(&0) || g[1] % m != 0 || g[2] % m != 0) {
            bail!("vision: grid {g:?} is not a positive multiple of the merge size {m}");
        }
        let mut x = self.patch_embed.forward(pixels, n);
        // Learned positions resampled to each grid (per frame, in merge-block order), and the rotary (h, w) ids.
        let mut hw = Vec::with_capacity(n);
        let side = (c.num_position_embeddings as f64).sqrt() as usize;
        let mut row = 0;
        for g in grids {
            for _ in 0..g[0] {
                for p in 0..g[1] * g[2] {
                    let (r, col) = block_order(p, g[2], m);
                    hw.push((r, col));
                    let xr = &mut x[row * hd..(row + 1) * hd];
                    let (ht, hwgt) = taps(r, g[1], side);
                    let (wt, wwgt) = taps(col, g[2], side);
                    let mut acc = vec![0.0f32; hd];
                    for (a, wa) in ht.iter().zip(hwgt) {
                        for (b, wb) in wt.iter().zip(wwgt) {
                            let e = &self.pos_embed[(a * side + b) * hd..(a * side + b + 1) * hd];
                            let wgt = wa * wb;
                            acc.iter_mut().zip(e).for_each(|(s, v)| *s += v * wgt);
                        }
                    }
                    xr.iter_mut().zip(&acc).for_each(|(v, a)| *v += a);
                    row += 1;
                }
            }
        }
        // Rotary cos/sin per patch over the head dim: [h freqs ‖ w freqs] twice.
        let head = c.head_dim();
        let quarter = head / 4;
        let inv: Vec<f32> =
            (0..quarter).map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / (head / 2) as f32)).collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = hw
            .iter()
            .flat_map(|&(r, col)| {
                let inv = &inv;
                (0..head / 2).map(move |i| {
                    let a = if i < quarter { r as f32 * inv[i] } else { col as f32 * inv[i - quarter] };
                    (a.cos(), a.sin())
                })
            })
            .unzip();
        // Each frame attends within itself.
        let mut spans = Vec::new();
        let mut start = 0;
        for g in grids {
            for _ in 0..g[0] {
                spans.push((start, g[1] * g[2]));
                start += g[1] * g[2];
            }
        }
        for blk in &self.blocks {
            let u = blk.norm1.forward(&x);
            let qkv = blk.qkv.forward(&u, n);
            let o = self.attention(&qkv, &cos, &sin, &spans, n);
            let a = blk.proj.forward(&o, n);
            x.iter_mut().zip(&a).for_each(|(v, d)| *v += d);
            let u = blk.norm2.forward(&x);
            let mut f = blk.fc1.forward(&u, n);
            f.iter_mut().for_each(|v| *v = act(c.hidden_act, *v));
            let d = blk.fc2.forward(&f, n);
            x.iter_mut().zip(&d).for_each(|(v, y)| *v += y);
        }
        let u = self.merger_norm.forward(&x);
        let tokens = n / (m * m);
        let mut f = self.merger_fc1.forward(&u, tokens);
        f.iter_mut().for_each(|v| *v = act(Act::Gelu, *v));
        Ok(self.merger_fc2.forward(&f, tokens))
    }

    /// Non-causal multi-head attention within each span, q and k rotated; `[n, hidden]` out.
    fn attention(&self, qkv: &[f32], cos: &[f32], sin: &[f32], spans: &[(usize, usize)], n: usize) -> Vec<f32> {
        let c = &self.config;
        let (dim, nh) = (c.hidden_size, c.num_heads);
        let hd = dim / nh;
        let half = hd / 2;
        let rot = |src: &[f32], t: usize| -> Vec<f32> {
            let (cs, sn) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            let mut r = vec![0.0; hd];
            for i in 0..half {
                let (x1, x2) = (src[i], src[i + half]);
                r[i] = x1 * cs[i] - x2 * sn[i];
                r[i + half] = x2 * cs[i] + x1 * sn[i];
            }
            r
        };
        // [n, heads, hd] rotated q and k.
        let mut q = vec![0.0; n * dim];
        let mut k = vec![0.0; n * dim];
        for t in 0..n {
            let row = &qkv[t * 3 * dim..(t + 1) * 3 * dim];
            for h in 0..nh {
                q[t * dim + h * hd..t * dim + (h + 1) * hd].copy_from_slice(&rot(&row[h * hd..(h + 1) * hd], t));
                k[t * dim + h * hd..t * dim + (h + 1) * hd]
                    .copy_from_slice(&rot(&row[dim + h * hd..dim + (h + 1) * hd], t));
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o = vec![0.0; n * dim];
        o.par_chunks_mut(hd).enumerate().for_each(|(idx, out)| {
            let (t, h) = (idx / nh, idx % nh);
            let &(s0, len) = spans.iter().find(|(s, l)| t >= *s && t < s + l).expect("a span holds every patch");
            let qr = &q[t * dim + h * hd..t * dim + (h + 1) * hd];
            let mut scores: Vec<f32> =
                (s0..s0 + len).map(|j| dot(qr, &k[j * dim + h * hd..j * dim + (h + 1) * hd]) * scale).collect();
            let mx = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0.0;
            scores.iter_mut().for_each(|s| {
                *s = (*s - mx).exp();
                sum += *s;
            });
            for (j, s) in (s0..s0 + len).zip(&scores) {
                let vr = &qkv[j * 3 * dim + 2 * dim + h * hd..j * 3 * dim + 2 * dim + (h + 1) * hd];
                out.iter_mut().zip(vr).for_each(|(acc, v)| *acc += s / sum * v);
            }
        });
        o
    }
}

/// (row, col) of patch `p` of a frame `w` patches wide, patches in merge-block order (block row, block col,
/// row in block, col in block).
fn block_order(p: usize, w: usize, m: usize) -> (usize, usize) {
    let (block, within) = (p / (m * m), p % (m * m));
    let (bw, ih, iw) = (w / m, within / m, within % m);
    ((block / bw) * m + ih, (block % bw) * m + iw)
}

/// The two bilinear taps (align_corners) into a `side`-long table for index `i` of `size`, and their weights, in
/// f32 as transformers computes them.
fn taps(i: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let fl = src.floor();
    let t = [fl as usize, (fl as usize + 1).min(side - 1)];
    let w = [(1.0 - (src - fl).abs()).max(0.0), (1.0 - (src - fl - 1.0).abs()).max(0.0)];
    (t, w)
}

fn act(a: Act, x: f32) -> f32 {
    match a {
        Act::GeluTanh => {
            let k = (2.0f32 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
        }
        Act::Gelu => (0.5 * x as f64 * (1.0 + erf(x as f64 / std::f64::consts::SQRT_2))) as f32,
    }
}

/// erf with a fractional error below 1.2e-7 (Numerical Recipes' Chebyshev fit of erfc).
fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let p = -z * z - 1.26551223
        + t * (1.00002368
            + t * (0.37409196
                + t * (0.09678418
                    + t * (-0.18628806
                        + t * (0.27886807
                            + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    let erfc = t * p.exp();
    if x >= 0.0 {
        1.0 - erfc
    } else {
        erfc - 1.0
    }
}

/// What the image processor needs: the model's patching and normalisation and the pixel budget.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageParams {
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Default for ImageParams {
    /// The model's patch 16, merge 2, temporal 2 and mean = std = 0.5, with transformers' default pixel budget
    /// (`Qwen2VLImageProcessor.size`: 56 × 56 to 28 × 28 × 1280).
    fn default() -> ImageParams {
        ImageParams {
            patch_size: 16,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            mean: [0.5; 3],
            std: [0.5; 3],
        }
    }
}

impl ImageParams {
    /// From a `preprocessor_config.json` (keys it lacks keep [`ImageParams::default`]).
    pub fn from_json(v: &Value) -> Result<ImageParams> {
        let mut p = ImageParams::default();
        let uint = |k: &str| v.get(k).and_then(Value::as_u64).map(|n| n as usize);
        let size = v.get("size");
        let sz = |k: &str| size.and_then(|s| s.get(k)).and_then(Value::as_u64).map(|n| n as usize);
        p.patch_size = uint("patch_size").unwrap_or(p.patch_size);
        p.merge_size = uint("merge_size").unwrap_or(p.merge_size);
        p.temporal_patch_size = uint("temporal_patch_size").unwrap_or(p.temporal_patch_size);
        p.min_pixels = uint("min_pixels").or_else(|| sz("shortest_edge")).unwrap_or(p.min_pixels);
        p.max_pixels = uint("max_pixels").or_else(|| sz("longest_edge")).unwrap_or(p.max_pixels);
        let triple = |k: &str| -> Result<Option<[f32; 3]>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => {
                    let a =
                        x.as_array().filter(|a| a.len() == 3).with_context(|| format!("{k}: expected 3 numbers"))?;
                    let f = |i: usize| a[i].as_f64().map(|f| f as f32).with_context(|| format!("{k}: not a number"));
                    Ok(Some([f(0)?, f(1)?, f(2)?]))
                }
            }
        };
        p.mean = triple("image_mean")?.unwrap_or(p.mean);
        p.std = triple("image_std")?.unwrap_or(p.std);
        if p.patch_size == 0 || p.merge_size == 0 || p.temporal_patch_size == 0 || p.min_pixels > p.max_pixels {
            bail!("preprocessor config: bad patch sizes or pixel budget");
        }
        Ok(p)
    }

    /// `preprocessor_config.json` of a model directory when present, else the defaults.
    pub fn from_dir(dir: &std::path::Path) -> Result<ImageParams> {
        let path = dir.join("preprocessor_config.json");
        if !path.exists() {
            return Ok(ImageParams::default());
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        ImageParams::from_json(&v).with_context(|| format!("in {}", path.display()))
    }

    /// The (height, width) transformers' `smart_resize` gives an image of `height × width` pixels.
    pub fn smart_resize(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let factor = (self.patch_size * self.merge_size) as f64;
        let (h, w) = (height as f64, width as f64);
        if height == 0 || width == 0 {
            bail!("image: {width}x{height} pixels");
        }
        if h.max(w) / h.min(w) > 200.0 {
            bail!("image: aspect ratio {width}x{height} is over 200");
        }
        let mut hb = (h / factor).round_ties_even() * factor;
        let mut wb = (w / factor).round_ties_even() * factor;
        if hb * wb > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            hb = factor.max((h / beta / factor).floor() * factor);
            wb = factor.max((w / beta / factor).floor() * factor);
        } else if hb * wb < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            hb = (h * beta / factor).ceil() * factor;
            wb = (w * beta / factor).ceil() * factor;
        }
        Ok((hb as usize, wb as usize))
    }
}

/// An image as the tower reads it: `pixel_values` rows `[t·h·w, C·T·P·P]` and the grid (t, h, w) in patches.
#[derive(Clone, Debug, PartialEq)]
pub struct Pixels {
    pub values: Vec<f32>,
    pub grid: [usize; 3],
}

impl Pixels {
    /// Image tokens (rows of the tower's output) for this grid and `merge_size`.
    pub fn tokens(&self, merge_size: usize) -> usize {
        self.grid[0] * self.grid[1] * self.grid[2] / (merge_size * merge_size)
    }
}

/// Decode `bytes` (PNG or JPEG) and preprocess it as transformers' image processor does.
pub fn preprocess(bytes: &[u8], params: &ImageParams) -> Result<Pixels> {
    let img = image::load_from_memory(bytes).context("image: cannot decode (PNG or JPEG expected)")?;
    preprocess_image(&img, params)
}

/// [`preprocess`] of a decoded image: RGB (alpha dropped, as PIL's `convert("RGB")`), resized with bicubic
/// (Catmull-Rom, PIL's a = -0.5; fast_image_resize, whose fixed-point taps round as PIL's do) to
/// [`ImageParams::smart_resize`], rescaled, normalised, patched.
pub fn preprocess_image(img: &image::DynamicImage, params: &ImageParams) -> Result<Pixels> {
    let rgb = img.to_rgb8();
    let (w0, h0) = rgb.dimensions();
    let (h, w) = params.smart_resize(h0 as usize, w0 as usize)?;
    // PIL resamples in two passes through an 8-bit image; one pass at a time here does the same (a Catmull-Rom pass
    // at scale 1 is the identity), which keeps PIL's intermediate rounding and clipping. The order matters by up to
    // a few levels on noisy images: Pillow 13 (transformers' PIL backend) was measured to start with the vertical
    // pass when its kernel is the wider one, else with the horizontal one (exact on 76 of 79 random shapes; the
    // rest within the intermediate rounding; measured with the `image` crate's kernel, whose f32 taps left 9 values
    // of a large downscale two levels off where fast_image_resize's leave none).
    let (h, w) = (h as u32, w as u32);
    let taps = |from: u32, to: u32| (2.0 * (from as f64 / to as f64).max(1.0)).ceil() as u32 * 2 + 1;
    let rgb = if h != h0 && w != w0 && taps(h0, h) > taps(w0, w) {
        let v = resample(&rgb, w0, h)?;
        resample(&v, w, h)?
    } else {
        let x = if w == w0 { rgb } else { resample(&rgb, w, h0)? };
        if h == h0 {
            x
        } else {
            resample(&x, w, h)?
        }
    };
    let (h, w) = (h as usize, w as usize);
    let (p, m, tp) = (params.patch_size, params.merge_size, params.temporal_patch_size);
    let (gh, gw) = (h / p, w / p);
    let dim = 3 * tp * p * p;
    let mut values = vec![0.0f32; gh * gw * dim];
    let raw = rgb.as_raw();
    let norm = |v: u8, ch: usize| -> f32 {
        let x = (v as f64 * (1.0 / 255.0)) as f32;
        ((x as f64 - params.mean[ch] as f64) / params.std[ch] as f64) as f32
    };
    let mut row = 0;
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for ih in 0..m {
                for iw in 0..m {
                    let out = &mut values[row * dim..(row + 1) * dim];
                    let (y0, x0) = ((bh * m + ih) * p, (bw * m + iw) * p);
                    for ch in 0..3 {
                        for t in 0..tp {
                            for py in 0..p {
                                for px in 0..p {
                                    let v = raw[((y0 + py) * w + x0 + px) * 3 + ch];
                                    out[((ch * tp + t) * p + py) * p + px] = norm(v, ch);
                                }
                            }
                        }
                    }
                    row += 1;
                }
            }
        }
    }
    Ok(Pixels { values, grid: [1, gh, gw] })
}

/// One Catmull-Rom resampling pass of an 8-bit RGB image (fast_image_resize: fixed-point weights, as PIL).
fn resample(src: &image::RgbImage, w: u32, h: u32) -> Result<image::RgbImage> {
    use fast_image_resize as fr;
    let (w0, h0) = src.dimensions();
    // The typed call instantiates the resizer for one pixel type; `Resizer::resize` dispatches over all of them
    // at run time, and their monomorphised code was most of this crate's build time (issue 36: CI's length).
    let from = fr::images::TypedImageRef::<fr::pixels::U8x3>::from_buffer(w0, h0, src.as_raw())?;
    let mut out = vec![0u8; w as usize * h as usize * 3];
    let mut to = fr::images::TypedImage::<fr::pixels::U8x3>::from_buffer(w, h, &mut out)?;
    let opts = fr::ResizeOptions::new().resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::CatmullRom));
    fr::Resizer::new().resize_typed(&from, &mut to, &opts)?;
    image::RgbImage::from_raw(w, h, out).context("image: resampled buffer of the wrong size")
}
