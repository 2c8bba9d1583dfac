//! The reference forward pass of the `qwen3_5_moe` text model, in f32, in the order of the model card
//! (../shared/docs/model-spec.md §2). Every later kernel is tested against this file.
//!
//! One call reads `n` new tokens at positions `state.pos ..` and advances the per-sequence state; one batched call
//! ([`Weights::forward_batch`]) does so for several sequences, with their tokens stacked for every weight. A
//! prefill of N tokens followed by M single-token calls computes exactly (bit for bit) what one call of N+M tokens
//! computes, and a sequence in a batch exactly what it computes alone.
//!
//! Images ([`Weights::forward_mm`]): the vision tower's rows ([`crate::vision`]) replace the embeddings of the image
//! pad tokens, and attention rotates by M-RoPE (three position streams, time / height / width, over the interleaved
//! `mrope_section`), as transformers' Qwen3_5Moe does. Text positions are equal in the three streams, so a
//! text-only prompt computes exactly what it did before M-RoPE (the rotation reads the same position for every
//! frequency); after an image, text continues from [`State::rope_delta`].
//!
//! The multi-token-prediction block (model-spec §3.3, [`Weights::mtp_forward_batch`]) runs here too, with vLLM's
//! semantics: it reads the main model's post-norm hidden state ([`Weights::forward_batch_hidden`]) and the next
//! token, through one full-attention decoder layer over its own KV cache ([`State::new_mtp`]), and drafts with
//! the shared lm_head; tests/mtp.rs holds it to an oracle built from transformers' classes.

use anyhow::{bail, Context, Result};
use rayon::prelude::*;

use crate::config::Config;
use crate::weights::{dot, Attention, GatedDeltaNet, Layer, Linear, Mixer, Mlp, Moe, Weights};

/// Per-sequence state: the KV cache of every attention layer, the conv inputs and f32 recurrent state of every
/// Gated DeltaNet layer, and the number of tokens read so far.
#[derive(Clone)]
pub struct State {
    pub pos: usize,
    /// M-RoPE offset of text positions (transformers' `rope_deltas`): the token at cache index `i` that is text
    /// sits at position `i + rope_delta` in all three streams. 0 until an image is read
    /// ([`Weights::forward_mm`]); then the largest position used + 1 minus the tokens read, so text continues
    /// after the image's positions.
    pub rope_delta: i64,
    pub layers: Vec<LayerState>,
    /// Test hook (off by default): hold expert choices equal to another backend's, or record router logits.
    pub routing: Routing,
    /// Set before a call (speculative decoding's verify rows): the call keeps every Gated DeltaNet layer's state
    /// after each of its rows, so that [`State::rewind`] can go back to any of them when drafts are rejected.
    /// Taken (reset to false) by the call.
    pub keep_rows: bool,
    /// The position before the last call, when that call kept its rows (see `keep_rows`).
    kept_from: Option<usize>,
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
        /// `(conv, s)` after each row of the last call, when it kept them ([`State::keep_rows`]); else empty.
        kept: Vec<(Vec<f32>, Vec<f32>)>,
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
                    kept: Vec::new(),
                },
            })
            .collect();
        State { pos: 0, rope_delta: 0, layers, routing: Routing::default(), keep_rows: false, kept_from: None }
    }

    /// The state of the MTP block ([`Weights::mtp_forward_batch`]): its one attention layer's KV cache. `pos`
    /// counts its rows; row `i` holds the main model's position `i` (vLLM's convention: the MTP row pairing the
    /// hidden state of position `i` with the token at `i + 1` is at position `i`).
    pub fn new_mtp() -> State {
        let layers = vec![LayerState::Attention { k: Vec::new(), v: Vec::new() }];
        State { pos: 0, rope_delta: 0, layers, routing: Routing::default(), keep_rows: false, kept_from: None }
    }

    /// Bytes of an MTP state ([`State::new_mtp`]) that has read `tokens` rows: f32 keys and values of one
    /// attention layer.
    pub fn mtp_bytes_for(c: &Config, tokens: usize) -> usize {
        4 * tokens * 2 * c.num_key_value_heads * c.head_dim
    }

    /// Forget everything after the first `pos` tokens (rejected drafts). Attention layers drop the keys and values
    /// past `pos`; a Gated DeltaNet state holds no history, so it goes back only to a row the last call kept
    /// ([`State::keep_rows`]): `pos` after that call's start. The kept rows are dropped either way.
    pub fn rewind(&mut self, pos: usize) -> Result<()> {
        if pos > self.pos {
            bail!("rewind to {pos}: the state holds only {} tokens", self.pos);
        }
        let recurrent = self.layers.iter().any(|l| matches!(l, LayerState::DeltaNet { .. }));
        let row = match self.kept_from {
            _ if !recurrent || pos == self.pos => None,
            Some(from) if pos > from => Some(pos - from - 1),
            _ => bail!(
                "rewind to {pos} of {}: a Gated DeltaNet state goes back only to a row its last call kept",
                self.pos
            ),
        };
        if let Some(r) = row {
            if self.layers.iter().any(|l| matches!(l, LayerState::DeltaNet { kept, .. } if kept.len() <= r)) {
                bail!("rewind to {pos}: row {r} of the last call was not kept");
            }
        }
        let n = self.pos;
        for l in &mut self.layers {
            match l {
                LayerState::Attention { k, v } => {
                    let width = k.len().checked_div(n).unwrap_or(0);
                    k.truncate(pos * width);
                    v.truncate(pos * width);
                }
                LayerState::DeltaNet { conv, s, kept } => {
                    if let Some((c, st)) = row.and_then(|r| kept.get(r)) {
                        conv.copy_from_slice(c);
                        s.copy_from_slice(st);
                    }
                    kept.clear();
                }
            }
        }
        self.kept_from = None;
        self.pos = pos;
        Ok(())
    }

    /// Bytes of the state of a sequence that has read `tokens` tokens: the fixed conv inputs and recurrent state
    /// of every Gated DeltaNet layer, plus the keys and values (f32) of every attention layer per token.
    pub fn bytes_for(c: &Config, tokens: usize) -> usize {
        let per_token = 2 * c.num_key_value_heads * c.head_dim;
        let floats: usize = c
            .layer_types
            .iter()
            .map(|k| match k {
                crate::config::LayerKind::Full => tokens * per_token,
                crate::config::LayerKind::Linear => {
                    (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim()
                        + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
                }
            })
            .sum();
        4 * floats
    }
}

/// Which rows of logits to compute.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the row of the last token (generation).
    Last,
    /// None (a prompt chunk that does not end the prompt): the final norm and lm_head are skipped.
    Skip,
}

/// One sequence's part of a [`Weights::forward_batch`]: the ids it reads after what its state holds, and the
/// logits rows it wants back.
pub struct Part<'a> {
    pub ids: &'a [u32],
    pub state: &'a mut State,
    pub logits: Logits,
}

/// One image of a [`Weights::forward_mm`] prompt: the tower's rows for it and its grid.
#[derive(Clone, Copy, Debug)]
pub struct ImageRows<'a> {
    /// `[tokens, hidden]`: [`crate::vision::Vision::forward`]'s rows for this image, spliced in place of its
    /// image pad tokens.
    pub rows: &'a [f32],
    /// (t, h, w) in patches, as the processor gives it ([`crate::vision::Pixels::grid`]).
    pub grid: [usize; 3],
}

/// The image part of one sequence's call: rows to put in place of embeddings, and every token's M-RoPE
/// position.
struct Mm {
    /// (row of the part, values `[hidden]`) for each image pad token.
    rows: Vec<(usize, Vec<f32>)>,
    positions: Vec<[i64; 3]>,
    /// The next text position after the call.
    next: i64,
}

/// What [`Weights::forward_batch_hidden`] and [`Weights::mtp_forward_batch`] return for one part.
#[derive(Clone, Debug, Default)]
pub struct Output {
    /// `[rows, vocab]`, the rows the part's `logits` asks for.
    pub logits: Vec<f32>,
    /// `[rows, hidden]`: the last hidden state after the final norm (what the lm_head reads). From the main model
    /// it is the MTP block's input (vLLM passes the main model's post-norm output); from the MTP block (all rows)
    /// it is the input of the next chained draft step.
    pub hidden: Vec<f32>,
}

/// One sequence's part of a [`Weights::mtp_forward_batch`]: `n` rows, row `i` pairing a hidden state of position
/// `state.pos + i` with the id of the token at the position after it.
pub struct MtpPart<'a> {
    /// `[n, hidden]`: the main model's post-norm hidden states ([`Output::hidden`] of
    /// [`Weights::forward_batch_hidden`]), or, for a chained draft, the MTP block's own previous output.
    pub hidden: &'a [f32],
    /// `[n]`: the token after each hidden row's position.
    pub ids: &'a [u32],
    /// The MTP block's KV cache ([`State::new_mtp`]).
    pub state: &'a mut State,
    pub logits: Logits,
}

/// Where one part's rows sit in the stacked activations, and where its sequence stands.
#[derive(Clone, Copy)]
struct Seg {
    /// First row in the stacked `[rows, hidden]` activations.
    row: usize,
    /// Rows (tokens) of this part.
    n: usize,
    /// Tokens its state held before this call.
    pos: usize,
    /// Keep the Gated DeltaNet state after each row ([`State::keep_rows`]).
    keep: bool,
}

impl Seg {
    fn rows(&self, width: usize) -> std::ops::Range<usize> {
        self.row * width..(self.row + self.n) * width
    }
}

impl Weights {
    /// Read `ids` after what `state` holds; returns logits `[rows, vocab]` (rows = ids.len(), 1 or 0 as `which`
    /// says). The batch of one of [`Weights::forward_batch`].
    pub fn forward(&self, ids: &[u32], state: &mut State, which: Logits) -> Vec<f32> {
        let mut out = self.forward_batch(&mut [Part { ids, state, logits: which }]);
        out.pop().unwrap_or_default()
    }

    /// [`Weights::forward`] that also returns the rows `hidden` asks for of the last hidden state (after the final
    /// norm: the MTP block's input).
    pub fn forward_hidden(&self, ids: &[u32], state: &mut State, which: Logits, hidden: Logits) -> Output {
        let mut out = self.forward_batch_hidden(&mut [Part { ids, state, logits: which }], &[hidden]);
        out.pop().unwrap_or_default()
    }

    /// Several sequences in one pass: their tokens are stacked so that every projection, the router, the shared
    /// expert and each routed expert read their weights once for all rows, while the conv and recurrent state,
    /// the Gated DeltaNet recurrence and attention run per sequence over its own state. Returns each part's
    /// logits (as [`Weights::forward`] would), in order.
    ///
    /// Every row is computed by the same operations in the same order whatever else is in the batch or how a
    /// sequence's tokens are split into calls (each projection computes each row on its own; attention, the
    /// conv and the recurrence read only the sequence's own values), so a part's logits are bit-identical to
    /// the same tokens read alone, in one call or several (tests/batch.rs).
    pub fn forward_batch(&self, parts: &mut [Part]) -> Vec<Vec<f32>> {
        let skip = vec![Logits::Skip; parts.len()];
        self.forward_batch_hidden(parts, &skip).into_iter().map(|o| o.logits).collect()
    }

    /// [`Weights::forward_batch`] that also returns, per part, the rows `hidden[j]` asks for of the last hidden
    /// state after the final norm (the input of the MTP block, [`Weights::mtp_forward_batch`]).
    pub fn forward_batch_hidden(&self, parts: &mut [Part], hidden: &[Logits]) -> Vec<Output> {
        self.run(parts, hidden, &[])
    }

    /// Read `ids` with images after what `state` holds: each run of `image_token_id` ids takes the rows of the
    /// next image of `images` (as many pads as the image has tokens; an image does not span calls), and every
    /// token gets transformers' M-RoPE position (`get_rope_index`: text continues from the state's next
    /// position; an image's tokens are at (t, h, w) = start + (0, row, col) of its merged grid; text after it
    /// continues from the largest position used + 1). Returns logits as [`Weights::forward`]. Text-only calls
    /// before or after it are ordinary [`Weights::forward`] calls.
    pub fn forward_mm(&self, ids: &[u32], images: &[ImageRows], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        let merge = self.vision.as_ref().map_or(2, |v| v.config.spatial_merge_size);
        let mm = self.mm_part(ids, images, state, merge)?;
        let mut out = self.run(&mut [Part { ids, state, logits: which }], &[Logits::Skip], &[Some(mm)]);
        Ok(out.pop().unwrap_or_default().logits)
    }

    /// [`Weights::forward_batch_hidden`] where part `j` reads the images `images[j]` (empty: a text part, as in
    /// [`Weights::forward_batch`]) as [`Weights::forward_mm`] does; every part computes exactly what it does alone.
    pub fn forward_batch_mm(
        &self,
        parts: &mut [Part],
        images: &[&[ImageRows]],
        hidden: &[Logits],
    ) -> Result<Vec<Output>> {
        if images.len() != parts.len() || hidden.len() != parts.len() {
            bail!(
                "forward_batch_mm: {} parts, {} image lists, {} hidden choices",
                parts.len(),
                images.len(),
                hidden.len()
            );
        }
        let merge = self.vision.as_ref().map_or(2, |v| v.config.spatial_merge_size);
        let mm = parts
            .iter()
            .zip(images)
            .enumerate()
            .map(|(j, (p, im))| {
                let has_pads = p.ids.contains(&self.config.image_token_id);
                if im.is_empty() && !has_pads {
                    return Ok(None);
                }
                self.mm_part(p.ids, im, p.state, merge).map(Some).with_context(|| format!("part {j}"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.run(parts, hidden, &mm))
    }

    /// transformers' M-RoPE positions (t, h, w) of `ids` read after `state` (see [`Weights::forward_mm`]), with
    /// images of `grids` (patches) merged `merge × merge`; and the next text position after them.
    pub fn mrope_positions(
        &self,
        ids: &[u32],
        grids: &[[usize; 3]],
        state: &State,
        merge: usize,
    ) -> Result<(Vec<[i64; 3]>, i64)> {
        let image = self.config.image_token_id;
        let mut cur = state.pos as i64 + state.rope_delta;
        let mut out = Vec::with_capacity(ids.len());
        let mut next_image = 0;
        let mut t = 0;
        while t < ids.len() {
            if ids[t] != image {
                out.push([cur; 3]);
                cur += 1;
                t += 1;
                continue;
            }
            let Some(g) = grids.get(next_image) else {
                bail!("image pad token at {t}: more image pads than images ({})", grids.len());
            };
            let (lt, lh, lw) = (g[0], g[1] / merge, g[2] / merge);
            let n = lt * lh * lw;
            if n == 0 || ids.len() < t + n || ids[t..t + n].iter().any(|&i| i != image) {
                bail!("image {next_image}: {n} image pad tokens expected at {t} for grid {g:?}");
            }
            for it in 0..lt {
                for r in 0..lh {
                    for c in 0..lw {
                        out.push([cur + it as i64, cur + r as i64, cur + c as i64]);
                    }
                }
            }
            cur += lh.max(lw) as i64;
            t += n;
            next_image += 1;
        }
        if next_image != grids.len() {
            bail!("{} images but pads for {next_image}", grids.len());
        }
        Ok((out, cur))
    }

    fn mm_part(&self, ids: &[u32], images: &[ImageRows], state: &State, merge: usize) -> Result<Mm> {
        let h = self.config.hidden_size;
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid).collect();
        let (positions, next) = self.mrope_positions(ids, &grids, state, merge)?;
        let mut rows = Vec::new();
        let pads = ids.iter().enumerate().filter(|(_, &i)| i == self.config.image_token_id).map(|(t, _)| t);
        let mut pads = pads.peekable();
        for (k, im) in images.iter().enumerate() {
            let n = im.grid.iter().product::<usize>() / (merge * merge);
            if im.rows.len() != n * h {
                bail!("image {k}: {} values for {n} tokens of hidden size {h}", im.rows.len());
            }
            for r in im.rows.chunks_exact(h) {
                let t = pads.next().context("fewer image pads than image rows")?;
                rows.push((t, r.to_vec()));
            }
        }
        if pads.peek().is_some() {
            bail!("more image pads than image rows");
        }
        Ok(Mm { rows, positions, next })
    }

    /// [`Weights::forward_batch_hidden`] with, per part, optional image rows and M-RoPE positions (`mm` empty:
    /// none for any part).
    fn run(&self, parts: &mut [Part], hidden: &[Logits], mm: &[Option<Mm>]) -> Vec<Output> {
        assert_eq!(hidden.len(), parts.len(), "forward_batch_hidden: one hidden choice per part");
        let c = &self.config;
        let h = c.hidden_size;
        let mut segs = Vec::with_capacity(parts.len());
        let mut rows = 0;
        for p in parts.iter() {
            assert!(!p.ids.is_empty(), "forward needs at least one token per sequence");
            segs.push(Seg { row: rows, n: p.ids.len(), pos: p.state.pos, keep: p.state.keep_rows });
            rows += p.ids.len();
        }
        let mut x = vec![0.0; rows * h];
        for (&id, xt) in parts.iter().flat_map(|p| p.ids).zip(x.chunks_exact_mut(h)) {
            self.embed.row_into(id as usize, xt);
        }
        let mut pos3 = Vec::with_capacity(parts.len());
        for (j, (p, s)) in parts.iter().zip(&segs).enumerate() {
            match mm.get(j).and_then(Option::as_ref) {
                Some(m) => {
                    for (t, r) in &m.rows {
                        x[(s.row + t) * h..(s.row + t + 1) * h].copy_from_slice(r);
                    }
                    pos3.push(m.positions.clone());
                }
                None => pos3.push(text_positions(s, p.state.rope_delta)),
            }
        }
        let mut u = vec![0.0; rows * h];
        let forced: Vec<Option<Vec<Vec<usize>>>> = parts.iter_mut().map(|p| p.state.routing.force.take()).collect();
        for p in parts.iter_mut() {
            p.state.routing.logits.clear();
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let mut states: Vec<&mut State> = parts.iter_mut().map(|p| &mut *p.state).collect();
            let forced_i: Vec<Option<&[usize]>> = forced.iter().map(|f| f.as_ref().map(|f| f[i].as_slice())).collect();
            layer_forward(c, layer, i, &mut states, &segs, &pos3, &mut x, &mut u, &forced_i);
        }
        for (j, (p, s)) in parts.iter_mut().zip(&segs).enumerate() {
            p.state.kept_from = s.keep.then_some(s.pos);
            p.state.keep_rows = false;
            p.state.pos += s.n;
            if let Some(m) = mm.get(j).and_then(Option::as_ref) {
                p.state.rope_delta = m.next - p.state.pos as i64;
            }
        }
        let wants: Vec<(Logits, Logits)> = parts.iter().map(|p| p.logits).zip(hidden.iter().copied()).collect();
        self.head(&self.norm, &x, &segs, &wants)
    }

    /// The final norm `norm` over the rows each part wants (`wants[j]`: its logits rows, its hidden rows), then one
    /// lm_head pass over the stacked logits rows.
    fn head(&self, norm: &[f32], x: &[f32], segs: &[Seg], wants: &[(Logits, Logits)]) -> Vec<Output> {
        let c = &self.config;
        let h = c.hidden_size;
        let mut picked: Vec<(usize, usize)> = Vec::with_capacity(segs.len()); // (first row, rows) per part
        let mut xs = Vec::new();
        let mut hiddens = Vec::with_capacity(segs.len());
        for (s, &(lw, hw)) in segs.iter().zip(wants) {
            let rows = |w: Logits| match w {
                Logits::All => s.n,
                Logits::Last => 1,
                Logits::Skip => 0,
            };
            let (want, hwant) = (rows(lw), rows(hw));
            let mut normed = x[(s.row + s.n - want.max(hwant)) * h..(s.row + s.n) * h].to_vec();
            normed.chunks_exact_mut(h).for_each(|r| rms_norm(r, norm, c.rms_norm_eps));
            let k = normed.len() / h;
            picked.push((xs.len() / h, want));
            xs.extend_from_slice(&normed[(k - want) * h..]);
            normed.drain(..(k - hwant) * h);
            hiddens.push(normed);
        }
        let out_rows = xs.len() / h;
        let v = c.vocab_size;
        let mut logits = vec![0.0; out_rows * v];
        if out_rows > 0 {
            self.lm_head.forward(&xs, out_rows, &mut logits);
        }
        if picked.len() == 1 {
            // A batch of one: no copy (a prefill's every row can be hundreds of MB).
            return vec![Output { logits, hidden: hiddens.pop().unwrap_or_default() }];
        }
        picked
            .iter()
            .zip(hiddens)
            .map(|(&(r, n), hidden)| Output { logits: logits[r * v..(r + n) * v].to_vec(), hidden })
            .collect()
    }

    /// One step of the multi-token-prediction block (model-spec §3.3; vLLM `Qwen3_5MultiTokenPredictor`) for
    /// one sequence: see [`Weights::mtp_forward_batch`].
    pub fn mtp_forward(&self, hidden: &[f32], ids: &[u32], state: &mut State, which: Logits) -> Result<Output> {
        let mut out = self.mtp_forward_batch(&mut [MtpPart { hidden, ids, state, logits: which }])?;
        out.pop().context("internal: no MTP output")
    }

    /// One draft step: the MTP block's logits `[vocab]` for the token after `next_id`, given the hidden state of
    /// the position before `next_id` (the main model's post-norm hidden state, or the MTP block's own output for
    /// a chained draft); appends one row to `state`.
    pub fn mtp_logits(&self, hidden: &[f32], next_id: u32, state: &mut State) -> Result<Vec<f32>> {
        Ok(self.mtp_forward(hidden, &[next_id], state, Logits::Last)?.logits)
    }

    /// The MTP block over several sequences' rows, stacked like [`Weights::forward_batch`]. Per row (vLLM's
    /// semantics): `u = fc([pre_fc_norm_embedding(embed(id)) ; pre_fc_norm_hidden(hidden)])` (embedding first),
    /// then one full-attention decoder layer with its MoE over the part's own KV cache (`state`, positions
    /// `state.pos ..`), then `mtp.norm` and the shared lm_head. Returns per part the logits rows it asks for and
    /// every row's post-norm hidden state (the next chained step's input).
    ///
    /// To keep the cache in step with the main model, read every position through it: the prompt's rows
    /// `(hidden_i, id_{i+1})`, and after each verify pass the accepted ones ([`State::rewind`] drops drafts).
    pub fn mtp_forward_batch(&self, parts: &mut [MtpPart]) -> Result<Vec<Output>> {
        let mtp = self
            .mtp
            .as_ref()
            .with_context(|| format!("this model has no MTP block: {}", self.mtp_off_reason().unwrap_or_default()))?;
        let c = &self.config;
        let h = c.hidden_size;
        let mut segs = Vec::with_capacity(parts.len());
        let mut rows = 0;
        for p in parts.iter() {
            let n = p.ids.len();
            if n == 0 {
                bail!("MTP forward: no ids");
            }
            if p.hidden.len() != n * h {
                bail!("MTP forward: {} hidden values for {n} ids of hidden size {h}", p.hidden.len());
            }
            if let Some(bad) = p.ids.iter().find(|&&id| id as usize >= c.vocab_size) {
                bail!("MTP forward: token id {bad} is outside the vocabulary (size {})", c.vocab_size);
            }
            if !matches!(p.state.layers[..], [LayerState::Attention { .. }]) {
                bail!("MTP forward: the state is not an MTP state (State::new_mtp)");
            }
            segs.push(Seg { row: rows, n, pos: p.state.pos, keep: false });
            rows += n;
        }
        // fc over [norm_e(embed(id)) ; norm_h(hidden)], per row.
        let mut cat = vec![0.0; rows * 2 * h];
        let ids = parts.iter().flat_map(|p| p.ids.iter());
        let hid = parts.iter().flat_map(|p| p.hidden.chunks_exact(h));
        for ((&id, hr), row) in ids.zip(hid).zip(cat.chunks_exact_mut(2 * h)) {
            let (e, hh) = row.split_at_mut(h);
            self.embed.row_into(id as usize, e);
            rms_norm(e, &mtp.pre_fc_norm_embedding, c.rms_norm_eps);
            hh.copy_from_slice(hr);
            rms_norm(hh, &mtp.pre_fc_norm_hidden, c.rms_norm_eps);
        }
        let mut x = project(&mtp.fc, &cat, rows);
        let mut u = vec![0.0; rows * h];
        // The routing test hook, as for the main model (the MTP layer is layer 0 of its state).
        let taken: Vec<Option<Vec<Vec<usize>>>> = parts.iter_mut().map(|p| p.state.routing.force.take()).collect();
        let forced: Vec<Option<&[usize]>> =
            taken.iter().map(|f| f.as_ref().and_then(|f| f.first()).map(Vec::as_slice)).collect();
        for p in parts.iter_mut() {
            p.state.routing.logits.clear();
        }
        let mut states: Vec<&mut State> = parts.iter_mut().map(|p| &mut *p.state).collect();
        let pos3: Vec<Vec<[i64; 3]>> =
            segs.iter().zip(&states).map(|(s, st)| text_positions(s, st.rope_delta)).collect();
        layer_forward(c, &mtp.layer, 0, &mut states, &segs, &pos3, &mut x, &mut u, &forced);
        for (p, s) in parts.iter_mut().zip(&segs) {
            p.state.pos += s.n;
        }
        let wants: Vec<(Logits, Logits)> = parts.iter().map(|p| (p.logits, Logits::All)).collect();
        Ok(self.head(&mtp.norm, &x, &segs, &wants))
    }
}

/// One decoder layer over the stacked rows of every sequence: `states[j]` and `segs[j]` belong to sequence `j`.
#[allow(clippy::too_many_arguments)]
fn layer_forward(
    c: &Config,
    layer: &Layer,
    li: usize,
    states: &mut [&mut State],
    segs: &[Seg],
    pos3: &[Vec<[i64; 3]>],
    x: &mut [f32],
    u: &mut [f32],
    forced: &[Option<&[usize]>],
) {
    let (h, rows) = (c.hidden_size, x.len() / c.hidden_size);
    // h = h + Mixer(RMSNorm1p(h))
    u.copy_from_slice(x);
    u.chunks_exact_mut(h).for_each(|r| rms_norm(r, &layer.input_norm, c.rms_norm_eps));
    let mut ls: Vec<&mut LayerState> = states.iter_mut().map(|s| &mut s.layers[li]).collect();
    let mixed = match &layer.mixer {
        Mixer::Attention(a) => {
            let qg = project(&a.q_proj, u, rows);
            let k = project(&a.k_proj, u, rows);
            let v = project(&a.v_proj, u, rows);
            let (wq, wk) = (a.q_proj.rows(), a.k_proj.rows());
            let segs3: Vec<(Seg, &[[i64; 3]])> = segs.iter().copied().zip(pos3.iter().map(Vec::as_slice)).collect();
            let o = per_sequence(&mut ls, &segs3, |ls, (s, p3)| {
                let LayerState::Attention { k: kc, v: vc } = ls else { unreachable!("state follows layer_types") };
                let kt = k[s.rows(wk)].to_vec();
                attention_core_at(c, a, kc, vc, s.pos, p3, &qg[s.rows(wq)], kt, &v[s.rows(wk)], s.n)
            });
            project(&a.o_proj, &o, rows)
        }
        Mixer::DeltaNet(g) => {
            let qkv = project(&g.in_proj_qkv, u, rows);
            let z = project(&g.in_proj_z, u, rows);
            let b = project(&g.in_proj_b, u, rows);
            let a = project(&g.in_proj_a, u, rows);
            let w = [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a].map(|l| l.rows());
            let o = per_sequence(&mut ls, segs, |ls, s| {
                let LayerState::DeltaNet { conv, s: st, kept } = ls else { unreachable!("state follows layer_types") };
                let (qkv, z, b, a) = (&qkv[s.rows(w[0])], &z[s.rows(w[1])], &b[s.rows(w[2])], &a[s.rows(w[3])]);
                kept.clear();
                delta_net_rows(c, g, conv, st, qkv, z, b, a, s.n, s.keep.then_some(kept))
            });
            project(&g.out_proj, &o, rows)
        }
    };
    x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
    // h = h + MoE(RMSNorm1p(h))
    u.copy_from_slice(x);
    u.chunks_exact_mut(h).for_each(|r| rms_norm(r, &layer.post_norm, c.rms_norm_eps));
    let m = &layer.moe;
    let logits = project(&m.router, u, rows);
    let e = c.num_experts;
    let mut routes = Vec::with_capacity(rows);
    for ((st, s), f) in states.iter_mut().zip(segs).zip(forced) {
        let lg = &logits[s.rows(e)];
        routes.extend(routes_of(c, lg, s.n, *f));
        if st.routing.record {
            st.routing.logits.push(lg.to_vec());
        }
    }
    let out = moe_experts(c, m, u, rows, &routes);
    x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
}

/// `f` over each sequence's state and rows, in parallel (the states are disjoint); the outputs concatenated in
/// sequence order.
fn per_sequence<S: Sync, F>(ls: &mut [&mut LayerState], segs: &[S], f: F) -> Vec<f32>
where
    F: Fn(&mut LayerState, &S) -> Vec<f32> + Sync,
{
    let outs: Vec<Vec<f32>> = ls.par_iter_mut().zip(segs).map(|(l, s)| f(l, s)).collect();
    outs.concat()
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

/// Gated full attention (§2.2) between the projections (q‖gate, k, v from the layer input; o_proj after): per-head
/// interleaved query/gate, q/k (1+w) norms, NeoX RoPE on the first `rotary_dim` dims, GQA causal softmax attention
/// over the cache, sigmoid output gate. From q‖gate, k, v of `n` tokens to the gated output `[n, nh*hd]`
/// (before o_proj); reads `a.q_norm` and `a.k_norm` only.
#[allow(clippy::too_many_arguments)]
pub fn attention_core(
    c: &Config,
    a: &Attention,
    kc: &mut Vec<f32>,
    vc: &mut Vec<f32>,
    pos: usize,
    qg: &[f32],
    k: Vec<f32>,
    v: &[f32],
    n: usize,
) -> Vec<f32> {
    let p3: Vec<[i64; 3]> = (0..n).map(|t| [(pos + t) as i64; 3]).collect();
    attention_core_at(c, a, kc, vc, pos, &p3, qg, k, v, n)
}

/// The text positions (all three M-RoPE streams equal) of a part's tokens: cache index + `delta`.
fn text_positions(s: &Seg, delta: i64) -> Vec<[i64; 3]> {
    (0..s.n).map(|t| [(s.pos + t) as i64 + delta; 3]).collect()
}

/// The M-RoPE stream (0 time, 1 height, 2 width) frequency `i` follows: transformers' interleaved layout.
pub fn mrope_stream(section: &[usize; 3], i: usize) -> usize {
    if i % 3 == 1 && i < 3 * section[1] {
        1
    } else if i % 3 == 2 && i < 3 * section[2] {
        2
    } else {
        0
    }
}

/// [`attention_core`] with each token's M-RoPE position `p3[t]` (t, h, w) given; `pos` is still the cache index
/// of the first token (the causal extent).
#[allow(clippy::too_many_arguments)]
pub fn attention_core_at(
    c: &Config,
    a: &Attention,
    kc: &mut Vec<f32>,
    vc: &mut Vec<f32>,
    pos: usize,
    p3: &[[i64; 3]],
    qg: &[f32],
    mut k: Vec<f32>,
    v: &[f32],
    n: usize,
) -> Vec<f32> {
    assert_eq!(p3.len(), n, "attention: one position per token");
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
    let stream: Vec<usize> = (0..half).map(|i| mrope_stream(&c.mrope_section, i)).collect();
    for t in 0..n {
        let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq
            .iter()
            .zip(&stream)
            .map(|(f, &st)| {
                let p = p3[t][st] as f32;
                ((f * p).cos(), (f * p).sin())
            })
            .unzip();
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

/// Gated DeltaNet (§2.3) between the projections (qkv, z, b, a from the layer input; out_proj after): causal
/// depthwise conv + SiLU over q‖k‖v, l2-normalised q and k, the delta-rule recurrence with an f32 state per value
/// head, gated RMSNorm. From qkv, z, b, a of `n` tokens to the gated-normed output
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
    delta_net_rows(c, g, conv, s, mixed, z, b, a, n, None)
}

/// [`delta_net_core`] that also pushes `(conv, s)` after each row onto `kept` when given (verify rows).
#[allow(clippy::too_many_arguments)]
fn delta_net_rows(
    c: &Config,
    g: &GatedDeltaNet,
    conv: &mut [f32],
    s: &mut [f32],
    mixed: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    n: usize,
    kept: Option<&mut Vec<(Vec<f32>, Vec<f32>)>>,
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
    let keep = kept.is_some();

    let kd = hk * dk;
    let qscale = 1.0 / (dk as f32).sqrt();
    let l2 = |r: &mut [f32]| {
        let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        r.iter_mut().for_each(|v| *v *= inv);
    };
    let mut o = vec![0.0; n * hv * dv];
    // Each value head owns its state slice; heads run in parallel, tokens in order.
    let ratio = hv / hk;
    // Per head: its output rows and, when keeping rows, its state after each row.
    let outs: Vec<(Vec<f32>, Vec<f32>)> = s
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, st)| {
            let kh = h / ratio; // value head h reads key head h / (Hv/Hk) (repeat_interleave)
            let mut out = vec![0.0; n * dv];
            let mut rows = Vec::with_capacity(if keep { n * dk * dv } else { 0 });
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
                if keep {
                    rows.extend_from_slice(st);
                }
            }
            (out, rows)
        })
        .collect();
    if let Some(kept) = kept {
        let hs = dk * dv;
        for t in 0..n {
            let mut st = Vec::with_capacity(hv * hs);
            for (_, rows) in &outs {
                st.extend_from_slice(&rows[t * hs..(t + 1) * hs]);
            }
            kept.push((inputs[(t + 1) * cd..(t + kk) * cd].to_vec(), st));
        }
    }
    for (h, (out, _)) in outs.iter().enumerate() {
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
    // Highest probability first; ties go to the lower index (a total order: a NaN logit cannot panic here).
    idx.sort_by(|&i, &j| p[j].total_cmp(&p[i]).then(i.cmp(&j)));
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
    let logits = project(&m.router, u, n);
    let routes = routes_of(c, &logits, n, forced);
    if let Some(r) = record {
        r.push(logits);
    }
    moe_experts(c, m, u, n, &routes)
}

/// The experts and weights of `n` tokens from their router logits `[n * num_experts]`: the router's top-k, or
/// the `forced` experts (`[n * k]`).
fn routes_of(c: &Config, logits: &[f32], n: usize, forced: Option<&[usize]>) -> Vec<Vec<(usize, f32)>> {
    let k = c.num_experts_per_tok;
    match forced {
        Some(f) => {
            assert_eq!(f.len(), n * k, "forced routing: {} experts for {n} tokens of top-{k}", f.len());
            logits.chunks_exact(c.num_experts).zip(f.chunks_exact(k)).map(|(l, e)| route_forced(l, e)).collect()
        }
        None => logits.chunks_exact(c.num_experts).map(|l| route(c, l)).collect(),
    }
}

/// The shared expert and the routed experts of `n` tokens given their routes; each expert runs once over the
/// tokens routed to it, and each token adds its experts' outputs in expert order.
fn moe_experts(c: &Config, m: &Moe, u: &[f32], n: usize, routes: &[Vec<(usize, f32)>]) -> Vec<f32> {
    let h = c.hidden_size;
    let mut out = mlp(&m.shared, u, n);
    let sg = project(&m.shared_gate, u, n);
    for t in 0..n {
        let gs = sigmoid(sg[t]);
        out[t * h..(t + 1) * h].iter_mut().for_each(|v| *v *= gs);
    }
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
