//! The model's weights on the device: quantised matrices stay packed; projections read by one launch are
//! stacked row-wise (GDN: qkv|z|b|a, attention: q+gate|k|v, router|shared gate); the experts of a layer live in
//! one gate_up and one down buffer with the shared expert appended as expert `num_experts`.

use std::sync::Arc;

use anyhow::{bail, ensure, Result};
use tern_model::quant::QuantMatrix;
use tern_model::weights::{Linear, Mixer};
use tern_model::{Config, LayerKind, Weights};

use crate::gpu::{ExpertKind, Experts, Gpu, QMat};
use crate::workspace::PrefillBuffers;

/// Tokens one prefill pass reads at most (a longer prompt is read in chunks of this many): large enough that the
/// GEMMs fill the chip, small enough that the buffers stay around 1 GB at the full shape.
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;

pub enum DMixer {
    Attn {
        qkv: QMat,
        o: QMat,
        qn: cudarc::driver::CudaSlice<f32>,
        kn: cudarc::driver::CudaSlice<f32>,
    },
    Gdn {
        proj: QMat,
        out: QMat,
        conv: cudarc::driver::CudaSlice<f32>,
        a_log: cudarc::driver::CudaSlice<f32>,
        dt_bias: cudarc::driver::CudaSlice<f32>,
        norm: cudarc::driver::CudaSlice<f32>,
    },
}

pub struct DLayer {
    pub in_norm: cudarc::driver::CudaSlice<f32>,
    pub post_norm: cudarc::driver::CudaSlice<f32>,
    pub mixer: DMixer,
    /// `[num_experts + 1, hidden]`, 8-bit: router rows then the shared expert gate.
    pub router: QMat,
    pub gate_up: Experts,
    pub down: Experts,
}

/// The multi-token-prediction block (model-spec §3.3): `fc` over `[pre_e(embed(id)) ; pre_h(hidden)]` as its two
/// column halves (`fc_e`, `fc_h`: one product each, the second added), one full-attention layer with its MoE (its
/// own K/V region in every sequence's pages), the final norm, the shared lm_head.
pub struct DMtp {
    pub fc_e: QMat,
    pub fc_h: QMat,
    pub pre_e: cudarc::driver::CudaSlice<f32>,
    pub pre_h: cudarc::driver::CudaSlice<f32>,
    pub layer: DLayer,
    pub norm: cudarc::driver::CudaSlice<f32>,
}

pub struct DeviceModel {
    pub gpu: Arc<Gpu>,
    pub config: Config,
    pub embed: QMat,
    pub lm_head: QMat,
    pub norm: cudarc::driver::CudaSlice<f32>,
    pub layers: Vec<DLayer>,
    /// The MTP block, when the weights have one.
    pub mtp: Option<DMtp>,
    /// The prefill chunk length and its buffers, shared by every sequence (one prefill at a time).
    pub prefill: std::sync::Mutex<PrefillBuffers>,
    /// The pages every sequence's KV cache and recurrent state come from ([`crate::pool`]).
    pub pool: Arc<crate::pool::PagePool>,
}

fn quant<'a>(l: &'a Linear, what: &str) -> Result<&'a QuantMatrix> {
    match l {
        Linear::Quant(q) => Ok(q),
        Linear::F32 { rows, cols, .. } => {
            bail!("{what} [{rows}x{cols}] is f32: the CUDA backend needs every linear quantised (4/8-bit)")
        }
    }
}

/// Upload matrices sharing cols, bits and group size as one device matrix, rows concatenated (one matrix:
/// `stack(gpu, &[m], name)`). Packed words stay packed; scales and biases go up as raw bf16 bits.
pub fn stack(gpu: &Gpu, ms: &[&QuantMatrix], what: &str) -> Result<QMat> {
    let f = ms[0];
    for m in ms {
        ensure!(
            m.cols() == f.cols() && m.bits() == f.bits() && m.group_size() == f.group_size(),
            "{what}: stacked matrices differ in cols/bits/group size"
        );
    }
    let rows = ms.iter().map(|m| m.rows()).sum();
    // packed words go up straight from the (memory-mapped) matrices; scales/biases as raw bf16 bits + padding
    let w: Vec<&[u32]> = ms.iter().map(|m| m.packed()).collect();
    let s: Vec<u16> = ms.iter().flat_map(|m| m.scales().iter().map(|v| v.to_bits())).collect();
    let b: Vec<u16> = ms.iter().flat_map(|m| m.biases().iter().map(|v| v.to_bits())).collect();
    Ok(QMat {
        rows,
        cols: f.cols(),
        bits: f.bits(),
        gs: f.group_size(),
        w: gpu.upload_parts(&w, 0)?,
        s: gpu.upload_parts(&[&s], crate::gpu::SB_PAD)?,
        b: gpu.upload_parts(&[&b], crate::gpu::SB_PAD)?,
    })
}

/// Experts stacked with stride = size of expert 0; the last (shared) may be smaller.
fn experts(gpu: &Gpu, ms: &[Vec<&QuantMatrix>], what: &str) -> Result<Experts> {
    let first: Vec<&QuantMatrix> = ms[0].clone();
    let words: usize = first.iter().map(|m| m.packed().len()).sum();
    let groups: usize = first.iter().map(|m| m.scales().len()).sum();
    let mut w: Vec<&[u32]> = Vec::with_capacity(2 * ms.len());
    let mut s = Vec::with_capacity(groups * ms.len());
    let mut b = Vec::with_capacity(groups * ms.len());
    let mut nw = 0;
    for (e, parts) in ms.iter().enumerate() {
        for m in parts {
            ensure!(m.bits() == 4 && m.group_size() == first[0].group_size(), "{what}: experts must be 4-bit");
            w.push(m.packed());
            nw += m.packed().len();
            s.extend(m.scales().iter().map(|v| v.to_bits()));
            b.extend(m.biases().iter().map(|v| v.to_bits()));
        }
        ensure!(e + 1 == ms.len() || nw == (e + 1) * words, "{what}: routed experts differ in size");
    }
    let (w, s, b) = (gpu.upload_parts(&w, 0)?, gpu.upload(&s)?, gpu.upload(&b)?);
    Ok(Experts { w, s, b, words, groups, gs: first[0].group_size(), tiled: None })
}

/// `x` with its tile-major copy for the batched step's ring kernels where the shapes allow them ([`Gpu::tile_experts`]).
fn tiled(g: &Gpu, mut x: Experts, kind: ExpertKind, c: &Config) -> Result<Experts> {
    let (h, i, is) = (c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size);
    if crate::gpu::ring_shapes(x.gs, &[h, i, is]) {
        g.tile_experts(&mut x, kind, c.num_experts, (i, is), h)?;
    }
    Ok(x)
}

/// One decoder layer's weights on the device (a main layer, or the MTP block's).
fn upload_layer(g: &Gpu, c: &Config, l: &tern_model::weights::Layer) -> Result<DLayer> {
    let q = quant;
    let mixer = match &l.mixer {
        Mixer::Attention(a) => DMixer::Attn {
            qkv: stack(g, &[q(&a.q_proj, "q_proj")?, q(&a.k_proj, "k_proj")?, q(&a.v_proj, "v_proj")?], "attn")?,
            o: stack(g, &[q(&a.o_proj, "o_proj")?], "o_proj")?,
            qn: g.upload(&a.q_norm)?,
            kn: g.upload(&a.k_norm)?,
        },
        Mixer::DeltaNet(d) => DMixer::Gdn {
            proj: stack(
                g,
                &[
                    q(&d.in_proj_qkv, "in_proj_qkv")?,
                    q(&d.in_proj_z, "in_proj_z")?,
                    q(&d.in_proj_b, "in_proj_b")?,
                    q(&d.in_proj_a, "in_proj_a")?,
                ],
                "gdn in_proj",
            )?,
            out: stack(g, &[q(&d.out_proj, "out_proj")?], "out_proj")?,
            conv: g.upload(&d.conv)?,
            a_log: g.upload(&d.a_log)?,
            dt_bias: g.upload(&d.dt_bias)?,
            norm: g.upload(&d.norm)?,
        },
    };
    let m = &l.moe;
    let router = stack(g, &[q(&m.router, "router")?, q(&m.shared_gate, "shared_gate")?], "router")?;
    let all: Vec<_> = m.experts.iter().chain([&m.shared]).collect();
    let gu = all.iter().map(|e| Ok(vec![q(&e.gate, "gate")?, q(&e.up, "up")?])).collect::<Result<Vec<_>>>()?;
    let dn = all.iter().map(|e| Ok(vec![q(&e.down, "down")?])).collect::<Result<Vec<_>>>()?;
    Ok(DLayer {
        in_norm: g.upload(&l.input_norm)?,
        post_norm: g.upload(&l.post_norm)?,
        mixer,
        router,
        gate_up: tiled(g, experts(g, &gu, "gate_up")?, ExpertKind::GateUp, c)?,
        down: tiled(g, experts(g, &dn, "down")?, ExpertKind::Down, c)?,
    })
}

/// A quantised matrix split by columns at `at` (a multiple of its group size) into two device matrices: the
/// product over the concatenation `[x ; y]` is then one product over `x` plus one over `y`.
fn split_cols(g: &Gpu, m: &QuantMatrix, at: usize, what: &str) -> Result<(QMat, QMat)> {
    let (rows, cols, bits, gs) = (m.rows(), m.cols(), m.bits(), m.group_size());
    let per_word = 32 / bits as usize;
    ensure!(
        at > 0 && at < cols && at % gs == 0 && at % per_word == 0,
        "{what}: cannot split {cols} columns at {at} (groups of {gs})"
    );
    let (wr, gr) = (cols / per_word, cols / gs);
    let (wa, ga) = (at / per_word, at / gs);
    let half = |lo: bool| -> Result<QMat> {
        let pick = |r: usize, n: usize, a: usize| if lo { r * n..r * n + a } else { r * n + a..(r + 1) * n };
        let w: Vec<u32> = (0..rows).flat_map(|r| m.packed()[pick(r, wr, wa)].iter().copied()).collect();
        let s: Vec<u16> = (0..rows).flat_map(|r| m.scales()[pick(r, gr, ga)].iter().map(|v| v.to_bits())).collect();
        let b: Vec<u16> = (0..rows).flat_map(|r| m.biases()[pick(r, gr, ga)].iter().map(|v| v.to_bits())).collect();
        Ok(QMat {
            rows,
            cols: if lo { at } else { cols - at },
            bits,
            gs,
            w: g.upload_parts(&[&w], 0)?,
            s: g.upload_parts(&[&s], crate::gpu::SB_PAD)?,
            b: g.upload_parts(&[&b], crate::gpu::SB_PAD)?,
        })
    };
    Ok((half(true)?, half(false)?))
}

impl DeviceModel {
    /// What the forward pass's workspace is sized by ([`crate::workspace::Shapes`]).
    pub fn shapes(&self) -> crate::workspace::Shapes<'_> {
        let proj_rows = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                DMixer::Gdn { proj, .. } => proj.rows,
                DMixer::Attn { qkv, .. } => qkv.rows,
            })
            .max()
            .unwrap_or(0);
        crate::workspace::Shapes { gpu: &self.gpu, config: &self.config, proj_rows, layers: self.layers.len() }
    }
}

impl DeviceModel {
    /// Upload quantised weights (every linear 4-bit or 8-bit, as in the mlx checkpoints).
    pub fn upload(gpu: Arc<Gpu>, w: &Weights) -> Result<DeviceModel> {
        DeviceModel::upload_with_progress(gpu, w, &mut |_, _| {})
    }

    /// [`DeviceModel::upload`], calling `progress(layers done, layers)` after each layer (bytes so far:
    /// [`Gpu::uploaded`]).
    pub fn upload_with_progress(
        gpu: Arc<Gpu>,
        w: &Weights,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<DeviceModel> {
        let c = &w.config;
        let g = &*gpu;
        let mut layers = Vec::new();
        for (i, l) in w.layers.iter().enumerate() {
            progress(i, w.layers.len());
            layers.push(upload_layer(g, c, l)?);
        }
        let mtp = match &w.mtp {
            Some(m) => {
                let (fc_e, fc_h) = split_cols(g, quant(&m.fc, "mtp.fc")?, c.hidden_size, "mtp.fc")?;
                Some(DMtp {
                    fc_e,
                    fc_h,
                    pre_e: g.upload(&m.pre_fc_norm_embedding)?,
                    pre_h: g.upload(&m.pre_fc_norm_hidden)?,
                    layer: upload_layer(g, c, &m.layer)?,
                    norm: g.upload(&m.norm)?,
                })
            }
            None => None,
        };
        let embed = stack(g, &[quant(&w.embed, "embed")?], "embed")?;
        let lm_head = stack(g, &[quant(&w.lm_head, "lm_head")?], "lm_head")?;
        let norm = g.upload(&w.norm)?;
        g.stream.synchronize()?;
        progress(w.layers.len(), w.layers.len());
        let prefill = PrefillBuffers::new(DEFAULT_PREFILL_CHUNK);
        let pool = Arc::new(crate::pool::PagePool::new(gpu.ctx.clone())?);
        Ok(DeviceModel { gpu, config: c.clone(), embed, lm_head, norm, layers, mtp, prefill, pool })
    }

    /// The full-shape model with random 4-bit weights (8-bit router), generated on the device: codes uniform,
    /// scale/bias per matrix chosen so that each row has unit norm in expectation (activations stay O(1)).
    pub fn random(gpu: Arc<Gpu>, c: &Config, seed: u64) -> Result<DeviceModel> {
        let g = &*gpu;
        let cell = std::cell::Cell::new(seed);
        let next = || {
            cell.set(cell.get().wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407));
            cell.get()
        };
        let qmat = |rows: usize, cols: usize, bits: u32, unit: bool| -> Result<QMat> {
            let gs = 64;
            let mut w = g.zeros::<u32>(rows * cols * bits as usize / 32)?;
            let mut s = g.zeros::<u16>(rows * cols / gs + crate::gpu::SB_PAD)?;
            let mut b = g.zeros::<u16>(rows * cols / gs + crate::gpu::SB_PAD)?;
            g.fill_random_u32(&mut w, next())?;
            let levels = ((1u32 << bits) - 1) as f32;
            let std_q = ((levels + 1.0) * (levels + 1.0) - 1.0).sqrt() / 12f32.sqrt();
            let target = if unit { 1.0 } else { 1.0 / (cols as f32).sqrt() };
            let sc = target / std_q;
            g.fill_bf16(&mut s, sc)?;
            g.fill_bf16(&mut b, -sc * levels / 2.0)?;
            Ok(QMat { rows, cols, bits, gs, w, s, b })
        };
        let (h, e, i, is) = (c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let mut layers = Vec::new();
        for kind in &c.layer_types {
            let ones = |n: usize| g.upload(&vec![1.0f32; n]);
            let mixer = match kind {
                LayerKind::Full => {
                    let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    DMixer::Attn {
                        qkv: qmat(2 * nh * hd + 2 * nkv * hd, h, 4, false)?,
                        o: qmat(h, nh * hd, 4, false)?,
                        qn: ones(hd)?,
                        kn: ones(hd)?,
                    }
                }
                LayerKind::Linear => {
                    let (cd, vd, hv) = (c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads);
                    let mut conv = g.zeros::<f32>(cd * c.linear_conv_kernel_dim)?;
                    g.fill_uniform(&mut conv, next(), -0.5, 0.5)?;
                    let mut a_log = g.zeros::<f32>(hv)?;
                    g.fill_uniform(&mut a_log, next(), -1.0, 1.0)?;
                    let mut dt_bias = g.zeros::<f32>(hv)?;
                    g.fill_uniform(&mut dt_bias, next(), -1.0, 1.0)?;
                    DMixer::Gdn {
                        proj: qmat(cd + vd + 2 * hv, h, 4, false)?,
                        out: qmat(h, vd, 4, false)?,
                        conv,
                        a_log,
                        dt_bias,
                        norm: ones(c.linear_value_head_dim)?,
                    }
                }
            };
            let router = qmat(e + 1, h, 8, false)?;
            // experts: E routed [2I, H] + shared [2Is, H] in one buffer; likewise down.
            let mk = |n_words: usize, n_groups: usize, cols: usize| -> Result<Experts> {
                let mut w = g.zeros::<u32>(n_words)?;
                let mut s = g.zeros::<u16>(n_groups)?;
                let mut b = g.zeros::<u16>(n_groups)?;
                g.fill_random_u32(&mut w, next())?;
                let sc = (1.0 / (cols as f32).sqrt()) / (255.0f32 / 12.0).sqrt();
                g.fill_bf16(&mut s, sc)?;
                g.fill_bf16(&mut b, -sc * 7.5)?;
                Ok(Experts { w, s, b, words: 0, groups: 0, gs: 64, tiled: None })
            };
            let mut gate_up = mk((e * 2 * i + 2 * is) * h / 8, (e * 2 * i + 2 * is) * h / 64, h)?;
            gate_up.words = 2 * i * h / 8;
            gate_up.groups = 2 * i * h / 64;
            let mut down = mk((e * i + is) * h / 8, (e * i + is) * h / 64, i)?;
            down.words = i * h / 8;
            down.groups = i * h / 64;
            let (gate_up, down) = (tiled(g, gate_up, ExpertKind::GateUp, c)?, tiled(g, down, ExpertKind::Down, c)?);
            layers.push(DLayer { in_norm: ones(h)?, post_norm: ones(h)?, mixer, router, gate_up, down });
        }
        let embed = qmat(c.vocab_size, h, 4, true)?;
        let lm_head = qmat(c.vocab_size, h, 4, false)?;
        let norm = g.upload(&vec![1.0f32; h])?;
        g.stream.synchronize()?;
        let prefill = PrefillBuffers::new(DEFAULT_PREFILL_CHUNK);
        let pool = Arc::new(crate::pool::PagePool::new(gpu.ctx.clone())?);
        Ok(DeviceModel { gpu, config: c.clone(), embed, lm_head, norm, layers, mtp: None, prefill, pool })
    }

    /// Set the prefill chunk (tokens per pass; the buffers are reallocated at the next prefill if they are smaller).
    pub fn set_prefill_chunk(&self, n: usize) -> Result<()> {
        ensure!(n > 0, "the prefill chunk must be at least one token");
        let mut b = self.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned by an earlier panic"))?;
        b.chunk = n;
        Ok(())
    }

    /// Weight bytes one decode step reads (experts: top-k routed + shared), without KV cache and GDN state.
    pub fn weight_bytes_per_token(&self) -> usize {
        let c = &self.config;
        let (h, k, i, is) =
            (c.hidden_size, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let q4 = |rows: usize, cols: usize| rows * cols / 2 + rows * cols / 64 * 4;
        let mut total = self.lm_head.bytes() + h / 2;
        for l in &self.layers {
            total += match &l.mixer {
                DMixer::Attn { qkv, o, .. } => qkv.bytes() + o.bytes(),
                DMixer::Gdn { proj, out, .. } => proj.bytes() + out.bytes(),
            };
            total += l.router.bytes() + k * (q4(2 * i, h) + q4(h, i)) + q4(2 * is, h) + q4(h, is);
        }
        total
    }
}
