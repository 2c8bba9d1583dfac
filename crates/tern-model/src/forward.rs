//! The reference forward pass of the `qwen3_5_moe` text model, in f32, in the order of the model card
//! (../shared/docs/model-spec.md §2). Every later kernel is tested against this file.
//!
//! One call reads `n` new tokens at positions `state.pos ..` and advances the per-sequence state: a prefill of
//! N tokens followed by M single-token calls computes exactly what one call of N+M tokens computes.

use rayon::prelude::*;

use crate::config::Config;
use crate::weights::{dot, Attention, GatedDeltaNet, Layer, Linear, Mixer, Mlp, Moe, Weights};

/// Per-sequence state: the KV cache of every attention layer, the conv inputs and f32 recurrent state of every
/// Gated DeltaNet layer, and the number of tokens read so far.
#[derive(Clone)]
pub struct State {
    pub pos: usize,
    pub layers: Vec<LayerState>,
    /// Test hook (off by default): hold expert choices equal to another backend's, or record router logits.
    pub routing: Routing,
}

/// Test hook on the MoE routing of the next `forward` call. Comparisons between backends on random models
/// use it to hold expert choices equal, since near-tied router scores can flip a top-k choice.
#[derive(Clone, Default)]
pub struct Routing {
    /// Per layer, the experts each token of the next call uses (`[n * num_experts_per_tok]`) instead of the
    /// router's top-k; their weights still come from this router's softmax, renormalised over them. Taken
    /// (reset to `None`) by the call.
    pub force: Option<Vec<Vec<usize>>>,
    /// When set, each call stores every layer's router logits (`[n * num_experts]`) in `logits`.
    pub record: bool,
    pub logits: Vec<Vec<f32>>,
}

#[derive(Clone)]
pub enum LayerState {
    Attention {
        /// `[pos, kv_heads * head_dim]` each, keys after norm and RoPE.
        k: Vec<f32>,
        v: Vec<f32>,
    },
    DeltaNet {
        /// The last `kernel - 1` pre-conv inputs, oldest first: `[kernel - 1, conv_dim]`.
        conv: Vec<f32>,
        /// `[value_heads, key_head_dim, value_head_dim]`, f32 always.
        s: Vec<f32>,
    },
}

impl State {
    pub fn new(c: &Config) -> State {
        let layers = c
            .layer_types
            .iter()
            .map(|k| match k {
                crate::config::LayerKind::Full => LayerState::Attention { k: Vec::new(), v: Vec::new() },
                crate::config::LayerKind::Linear => LayerState::DeltaNet {
                    conv: vec![0.0; (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim()],
                    s: vec![0.0; c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim],
                },
            })
            .collect();
        State { pos: 0, layers, routing: Routing::default() }
    }
}

/// Which rows of logits to compute.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the row of the last token (generation).
    Last,
}

impl Weights {
    /// Read `ids` after what `state` holds; returns logits `[rows, vocab]` (rows = ids.len() or 1).
    pub fn forward(&self, ids: &[u32], state: &mut State, which: Logits) -> Vec<f32> {
        let c = &self.config;
        let (n, h) = (ids.len(), c.hidden_size);
        assert!(n > 0, "forward needs at least one token");
        let mut x = vec![0.0; n * h];
        for (&id, xt) in ids.iter().zip(x.chunks_exact_mut(h)) {
            self.embed.row_into(id as usize, xt);
        }
        let mut u = vec![0.0; n * h];
        let force = state.routing.force.take();
        state.routing.logits.clear();
        for (i, (layer, ls)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let forced = force.as_ref().map(|f| f[i].as_slice());
            let record = state.routing.record.then_some(&mut state.routing.logits);
            layer_forward(c, layer, ls, state.pos, &mut x, &mut u, n, forced, record);
        }
        state.pos += n;
        let rows = if which == Logits::All { n } else { 1 };
        let xs = &mut x[(n - rows) * h..];
        for t in 0..rows {
            rms_norm(&mut xs[t * h..(t + 1) * h], &self.norm, c.rms_norm_eps);
        }
        let mut logits = vec![0.0; rows * c.vocab_size];
        self.lm_head.forward(xs, rows, &mut logits);
        logits
    }
}

#[allow(clippy::too_many_arguments)]
fn layer_forward(
    c: &Config,
    layer: &Layer,
    ls: &mut LayerState,
    pos: usize,
    x: &mut [f32],
    u: &mut [f32],
    n: usize,
    forced: Option<&[usize]>,
    record: Option<&mut Vec<Vec<f32>>>,
) {
    let h = c.hidden_size;
    // h = h + Mixer(RMSNorm1p(h))
    u.copy_from_slice(x);
    u.chunks_exact_mut(h).for_each(|r| rms_norm(r, &layer.input_norm, c.rms_norm_eps));
    let mixed = match (&layer.mixer, ls) {
        (Mixer::Attention(a), LayerState::Attention { k, v }) => attention(c, a, k, v, pos, u, n),
        (Mixer::DeltaNet(g), LayerState::DeltaNet { conv, s }) => delta_net(c, g, conv, s, u, n),
        _ => unreachable!("state layout follows config.layer_types"),
    };
    x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
    // h = h + MoE(RMSNorm1p(h))
    u.copy_from_slice(x);
    u.chunks_exact_mut(h).for_each(|r| rms_norm(r, &layer.post_norm, c.rms_norm_eps));
    let out = moe(c, &layer.moe, u, n, forced, record);
    x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
}

/// In place: `x * rsqrt(mean(x²) + eps) * gain` (gain already includes the +1 of the (1+w) norms).
pub fn rms_norm(x: &mut [f32], gain: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter_mut().zip(gain).for_each(|(v, g)| *v = *v * r * g);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn project(l: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0.0; n * l.rows()];
    l.forward(x, n, &mut y);
    y
}

/// Gated full attention (§2.2): per-head interleaved query/gate, q/k (1+w) norms, NeoX RoPE on the first
/// `rotary_dim` dims, GQA causal softmax attention over the cache, sigmoid output gate, o_proj.
fn attention(
    c: &Config,
    a: &Attention,
    kc: &mut Vec<f32>,
    vc: &mut Vec<f32>,
    pos: usize,
    u: &[f32],
    n: usize,
) -> Vec<f32> {
    let qg = project(&a.q_proj, u, n);
    let k = project(&a.k_proj, u, n);
    let v = project(&a.v_proj, u, n);
    let o = attention_core(c, a, kc, vc, pos, &qg, k, &v, n);
    project(&a.o_proj, &o, n)
}

/// [`attention`] between the projections: from q‖gate, k, v of `n` tokens to the gated output `[n, nh*hd]`
/// (before o_proj); reads `a.q_norm` and `a.k_norm` only.
#[allow(clippy::too_many_arguments)]
pub fn attention_core(
    c: &Config,
    a: &Attention,
    kc: &mut Vec<f32>,
    vc: &mut Vec<f32>,
    pos: usize,
    qg: &[f32],
    mut k: Vec<f32>,
    v: &[f32],
    n: usize,
) -> Vec<f32> {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let mut q = vec![0.0; n * nh * hd];
    let mut gate = vec![0.0; n * nh * hd];
    for t in 0..n {
        for hh in 0..nh {
            let src = &qg[(t * nh + hh) * 2 * hd..(t * nh + hh + 1) * 2 * hd];
            let dst = (t * nh + hh) * hd;
            q[dst..dst + hd].copy_from_slice(&src[..hd]);
            gate[dst..dst + hd].copy_from_slice(&src[hd..]);
        }
    }
    q.chunks_exact_mut(hd).for_each(|r| rms_norm(r, &a.q_norm, c.rms_norm_eps));
    k.chunks_exact_mut(hd).for_each(|r| rms_norm(r, &a.k_norm, c.rms_norm_eps));
    let half = c.rotary_dim / 2;
    let inv_freq: Vec<f32> =
        (0..half).map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / c.rotary_dim as f32)).collect();
    for t in 0..n {
        let p = (pos + t) as f32;
        let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq.iter().map(|f| ((f * p).cos(), (f * p).sin())).unzip();
        let rope = |r: &mut [f32]| {
            for i in 0..half {
                let (x1, x2) = (r[i], r[i + half]);
                r[i] = x1 * cos[i] - x2 * sin[i];
                r[i + half] = x2 * cos[i] + x1 * sin[i];
            }
        };
        q[t * nh * hd..(t + 1) * nh * hd].chunks_exact_mut(hd).for_each(rope);
        k[t * nkv * hd..(t + 1) * nkv * hd].chunks_exact_mut(hd).for_each(rope);
    }
    kc.extend_from_slice(&k);
    vc.extend_from_slice(v);
    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let mut o = vec![0.0; n * nh * hd];
    o.par_chunks_mut(hd).enumerate().for_each(|(row, out)| {
        let (t, hh) = (row / nh, row % nh);
        let kv = hh / group;
        let qr = &q[row * hd..(row + 1) * hd];
        let len = pos + t + 1; // causal: keys 0..=pos+t
        let mut scores: Vec<f32> =
            (0..len).map(|j| dot(qr, &kc[(j * nkv + kv) * hd..(j * nkv + kv + 1) * hd]) * scale).collect();
        let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0.0;
        scores.iter_mut().for_each(|s| {
            *s = (*s - m).exp();
            sum += *s;
        });
        for (j, s) in scores.iter().enumerate() {
            let vr = &vc[(j * nkv + kv) * hd..(j * nkv + kv + 1) * hd];
            out.iter_mut().zip(vr).for_each(|(acc, vv)| *acc += s / sum * vv);
        }
    });
    o.iter_mut().zip(&gate).for_each(|(ov, g)| *ov *= sigmoid(*g));
    o
}

/// Gated DeltaNet (§2.3): projections, causal depthwise conv + SiLU over q‖k‖v, l2-normalised q and k, the
/// delta-rule recurrence with an f32 state per value head, gated RMSNorm, out_proj.
fn delta_net(c: &Config, g: &GatedDeltaNet, conv: &mut [f32], s: &mut [f32], u: &[f32], n: usize) -> Vec<f32> {
    let mixed = project(&g.in_proj_qkv, u, n);
    let z = project(&g.in_proj_z, u, n);
    let b = project(&g.in_proj_b, u, n);
    let a = project(&g.in_proj_a, u, n);
    let o = delta_net_core(c, g, conv, s, &mixed, &z, &b, &a, n);
    project(&g.out_proj, &o, n)
}

/// [`delta_net`] between the projections: from qkv, z, b, a of `n` tokens to the gated-normed output
/// `[n, value_dim]` (before out_proj), advancing `conv` and `s`; reads conv, a_log, dt_bias and norm of `g` only.
#[allow(clippy::too_many_arguments)]
pub fn delta_net_core(
    c: &Config,
    g: &GatedDeltaNet,
    conv: &mut [f32],
    s: &mut [f32],
    mixed: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    n: usize,
) -> Vec<f32> {
    let (cd, kk) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
    let (hk, hv, dk, dv) =
        (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);

    // Causal conv over [cached kernel-1 inputs ; n new inputs]: y[t,c] = Σ_j w[c,j] · in[t + j].
    let mut inputs = Vec::with_capacity((kk - 1 + n) * cd);
    inputs.extend_from_slice(conv);
    inputs.extend_from_slice(mixed);
    let mut qkv = vec![0.0; n * cd];
    for t in 0..n {
        for ch in 0..cd {
            let acc: f32 = (0..kk).map(|j| g.conv[ch * kk + j] * inputs[(t + j) * cd + ch]).sum();
            qkv[t * cd + ch] = silu(acc);
        }
    }
    conv.copy_from_slice(&inputs[n * cd..]);

    let kd = hk * dk;
    let qscale = 1.0 / (dk as f32).sqrt();
    let l2 = |r: &mut [f32]| {
        let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        r.iter_mut().for_each(|v| *v *= inv);
    };
    let mut o = vec![0.0; n * hv * dv];
    // Each value head owns its state slice; heads run in parallel, tokens in order.
    let ratio = hv / hk;
    let outs: Vec<Vec<f32>> = s
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, st)| {
            let kh = h / ratio; // value head h reads key head h / (Hv/Hk) (repeat_interleave)
            let mut out = vec![0.0; n * dv];
            let (mut q, mut k) = (vec![0.0; dk], vec![0.0; dk]);
            let mut m = vec![0.0; dv];
            for t in 0..n {
                let row = &qkv[t * cd..(t + 1) * cd];
                q.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
                k.copy_from_slice(&row[kd + kh * dk..kd + (kh + 1) * dk]);
                let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                l2(&mut q);
                l2(&mut k);
                q.iter_mut().for_each(|x| *x *= qscale);
                let beta = sigmoid(b[t * hv + h]);
                let decay = (-g.a_log[h].exp() * softplus(a[t * hv + h] + g.dt_bias[h])).exp();
                // S ← e^g S;  m = Sᵀk;  δ = β(v − m);  S ← S + k ⊗ δ;  o = Sᵀq
                st.iter_mut().for_each(|x| *x *= decay);
                m.iter_mut().for_each(|x| *x = 0.0);
                for i in 0..dk {
                    let srow = &st[i * dv..(i + 1) * dv];
                    m.iter_mut().zip(srow).for_each(|(mm, sv)| *mm += sv * k[i]);
                }
                let delta: Vec<f32> = v.iter().zip(&m).map(|(vv, mm)| beta * (vv - mm)).collect();
                let ot = &mut out[t * dv..(t + 1) * dv];
                for i in 0..dk {
                    let srow = &mut st[i * dv..(i + 1) * dv];
                    srow.iter_mut().zip(&delta).for_each(|(sv, d)| *sv += k[i] * d);
                    ot.iter_mut().zip(srow.iter()).for_each(|(ov, sv)| *ov += sv * q[i]);
                }
            }
            out
        })
        .collect();
    for (h, out) in outs.iter().enumerate() {
        for t in 0..n {
            o[(t * hv + h) * dv..(t * hv + h + 1) * dv].copy_from_slice(&out[t * dv..(t + 1) * dv]);
        }
    }
    // Gated RMSNorm per head: w · norm(o) · silu(z), plain weight.
    for (orow, zrow) in o.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        rms_norm(orow, &g.norm, c.rms_norm_eps);
        orow.iter_mut().zip(zrow).for_each(|(ov, zv)| *ov *= silu(*zv));
    }
    o
}

fn mlp(m: &Mlp, x: &[f32], n: usize) -> Vec<f32> {
    let gate = project(&m.gate, x, n);
    let up = project(&m.up, x, n);
    let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
    project(&m.down, &act, n)
}

/// The experts each token is routed to, with their weights: softmax over all experts, top-k, renormalised.
pub fn route(c: &Config, router_logits: &[f32]) -> Vec<(usize, f32)> {
    let m = router_logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let p: Vec<f32> = router_logits.iter().map(|l| (l - m).exp()).collect();
    let sum: f32 = p.iter().sum();
    let mut idx: Vec<usize> = (0..p.len()).collect();
    // Highest probability first; ties go to the lower index.
    idx.sort_by(|&i, &j| p[j].partial_cmp(&p[i]).unwrap().then(i.cmp(&j)));
    let top: Vec<(usize, f32)> = idx[..c.num_experts_per_tok].iter().map(|&e| (e, p[e] / sum)).collect();
    let total: f32 = top.iter().map(|(_, w)| w).sum();
    top.into_iter().map(|(e, w)| (e, w / total)).collect()
}

/// [`route`] with the experts given instead of chosen: their softmax probabilities, renormalised over them.
pub fn route_forced(router_logits: &[f32], experts: &[usize]) -> Vec<(usize, f32)> {
    let m = router_logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let p: Vec<f32> = router_logits.iter().map(|l| (l - m).exp()).collect();
    let sum: f32 = p.iter().sum();
    let top: Vec<(usize, f32)> = experts.iter().map(|&e| (e, p[e] / sum)).collect();
    let total: f32 = top.iter().map(|(_, w)| w).sum();
    top.into_iter().map(|(e, w)| (e, w / total)).collect()
}

/// Sparse MoE (§2.4): routed SwiGLU experts weighted by the renormalised top-k, plus the sigmoid-gated shared
/// expert. `forced`: the experts of each token (`[n * k]`) instead of the router's top-k (see [`Routing`]);
/// `record`: receives the router logits `[n * num_experts]`.
pub fn moe(
    c: &Config,
    m: &Moe,
    u: &[f32],
    n: usize,
    forced: Option<&[usize]>,
    record: Option<&mut Vec<Vec<f32>>>,
) -> Vec<f32> {
    let h = c.hidden_size;
    let logits = project(&m.router, u, n);
    let k = c.num_experts_per_tok;
    let routes: Vec<Vec<(usize, f32)>> = match forced {
        Some(f) => {
            assert_eq!(f.len(), n * k, "forced routing: {} experts for {n} tokens of top-{k}", f.len());
            logits.chunks_exact(c.num_experts).zip(f.chunks_exact(k)).map(|(l, e)| route_forced(l, e)).collect()
        }
        None => logits.chunks_exact(c.num_experts).map(|l| route(c, l)).collect(),
    };
    if let Some(r) = record {
        r.push(logits);
    }
    let mut out = mlp(&m.shared, u, n);
    let sg = project(&m.shared_gate, u, n);
    for t in 0..n {
        let gs = sigmoid(sg[t]);
        out[t * h..(t + 1) * h].iter_mut().for_each(|v| *v *= gs);
    }
    // Group tokens by expert so each expert runs once over its tokens.
    for e in 0..c.num_experts {
        let picks: Vec<(usize, f32)> = routes
            .iter()
            .enumerate()
            .filter_map(|(t, r)| r.iter().find(|(x, _)| *x == e).map(|(_, w)| (t, *w)))
            .collect();
        if picks.is_empty() {
            continue;
        }
        let xs: Vec<f32> = picks.iter().flat_map(|(t, _)| u[t * h..(t + 1) * h].iter().copied()).collect();
        let ys = mlp(&m.experts[e], &xs, picks.len());
        for (i, (t, w)) in picks.iter().enumerate() {
            out[t * h..(t + 1) * h].iter_mut().zip(&ys[i * h..(i + 1) * h]).for_each(|(o, y)| *o += w * y);
        }
    }
    out
}
