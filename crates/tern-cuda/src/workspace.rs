//! The workspace of the forward passes: every buffer a pass uses besides the weights and the sequences' own state,
//! allocated once by the backend ([`PrefillBuffers`], behind the model's mutex) and sized for the largest pass: the
//! activation rows of a prefill chunk plus a decode batch ([`Scratch`]), the chunked GDN's per-chunk matrices, the
//! MoE's expert-sorted pairs, the pass tables through which the per-sequence kernels find each sequence's state
//! ([`PassTables`], [`SegTable`]), and the decode rows' attention buffers, logits and captured graphs
//! ([`SeqScratch`]).

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{ensure, Context, Result};
use cudarc::driver::{CudaGraph, CudaSlice, CudaView};

use tern_model::Config;

use crate::batch::{MAX_SEQS, MAX_SPLIT};
use crate::gpu::Gpu;
use crate::prefill::{pass_chunks, GdnChunkScratch, GdnDims, MoeSorted, SegTable};

/// What the workspace's sizes depend on: the device, the model's shapes, its widest mixer projection (rows of a GDN
/// in_proj or an attention q|gate|k|v) and its layers ([`crate::DeviceModel::shapes`]).
#[derive(Clone, Copy)]
pub struct Shapes<'a> {
    pub gpu: &'a Gpu,
    pub config: &'a Config,
    pub proj_rows: usize,
    pub layers: usize,
}

/// The tables a pass over several sequences reads the sequences' state through, uploaded before it (the
/// prefill's kernels and the batched decode's `_seqs` kernels): per layer, each sequence's GDN conv ring or
/// attention K cache (`a`) and GDN recurrent state or V cache (`b`), `[layer][sequence]` packed by the pass's
/// count (entries: the prompt chunks' sequences, one per step row — a decode row, or a speculative verify's row,
/// whose sequence then has an entry per row — and one per verifying sequence); the step rows' positions and the
/// first position the pass writes for each step row's sequence; the prefill's [`SegTable`] and the verifying
/// sequences' (`vsegs`). Allocated once for [`crate::batch::MAX_SEQS`] items of up to [`MAX_SEQS`] step rows, so
/// captured graphs may bake their addresses in.
pub struct PassTables {
    a: CudaSlice<u64>,
    b: CudaSlice<u64>,
    pub(crate) posv: CudaSlice<i32>,
    pub(crate) fromv: CudaSlice<i32>,
    pub(crate) segs: SegTable,
    pub(crate) vsegs: SegTable,
    pub(crate) n: usize,
}

impl PassTables {
    pub fn new(m: Shapes) -> Result<PassTables> {
        let (g, n, layers) = (m.gpu, MAX_SEQS, m.layers);
        let alloc = || -> Result<PassTables> {
            Ok(PassTables {
                a: g.zeros(layers * 2 * n)?,
                b: g.zeros(layers * 2 * n)?,
                posv: g.zeros(n)?,
                fromv: g.zeros(n)?,
                segs: SegTable::new(g, n)?,
                vsegs: SegTable::new(g, n)?,
                n: 0,
            })
        };
        alloc().context("cannot allocate the pass tables")
    }

    /// Upload the state pointers of the pass's entries (at most 2 [`MAX_SEQS`]): per entry, per layer, the GDN conv
    /// ring and recurrent state or the attention K and V caches (`crate::DeviceState::layer_ptrs`).
    pub(crate) fn set_states(&mut self, g: &Gpu, seqs: &[Vec<(u64, u64)>]) -> Result<()> {
        let n = seqs.len();
        let nl = seqs.first().map_or(0, Vec::len);
        ensure!(n > 0 && n * nl <= self.a.len(), "pass tables for {n} sequences of {nl} layers");
        let (mut ta, mut tb) = (vec![0u64; nl * n], vec![0u64; nl * n]);
        for (r, s) in seqs.iter().enumerate() {
            ensure!(s.len() == nl, "a sequence of another model");
            for (li, &(a, b)) in s.iter().enumerate() {
                ta[li * n + r] = a;
                tb[li * n + r] = b;
            }
        }
        g.stream.memcpy_htod(&ta, &mut self.a.slice_mut(..nl * n))?;
        g.stream.memcpy_htod(&tb, &mut self.b.slice_mut(..nl * n))?;
        self.n = n;
        Ok(())
    }

    /// Layer `li`'s tables `(a, b)` of the sequences last set.
    pub(crate) fn layer(&self, li: usize) -> (CudaView<'_, u64>, CudaView<'_, u64>) {
        self.layer_from(li, 0)
    }

    /// Layer `li`'s tables `(a, b)` of the sequences last set, from sequence `first` on (a pass's decode rows).
    pub(crate) fn layer_from(&self, li: usize, first: usize) -> (CudaView<'_, u64>, CudaView<'_, u64>) {
        let (n, f) = (self.n, first.min(self.n));
        (self.a.slice(li * n + f..(li + 1) * n), self.b.slice(li * n + f..(li + 1) * n))
    }

    pub fn bytes(&self) -> usize {
        8 * (self.a.len() + self.b.len())
            + 4 * (self.posv.len() + self.fromv.len() + self.segs.dev.len() + self.vsegs.dev.len())
    }
}

/// Activation buffers of one prefill chunk of at most `cap` tokens.
pub struct Scratch {
    pub cap: usize,
    pub(crate) ids: CudaSlice<i32>,
    pub(crate) x: CudaSlice<f32>,
    pub(crate) xb: CudaSlice<u16>,
    pub(crate) xn: CudaSlice<f32>,
    pub(crate) proj: CudaSlice<f32>,
    pub(crate) qkv: CudaSlice<f32>,
    pub(crate) beta: CudaSlice<f32>,
    pub(crate) gl: CudaSlice<f32>,
    pub(crate) chunks: GdnChunkScratch,
    pub(crate) o: CudaSlice<f32>,
    pub(crate) qb: CudaSlice<u16>,
    pub(crate) rlogits: CudaSlice<f32>,
    pub(crate) idx: CudaSlice<i32>,
    pub(crate) wts: CudaSlice<f32>,
    pub(crate) sorted: MoeSorted,
    pub(crate) act: CudaSlice<u16>,
    pub(crate) ybuf: CudaSlice<f32>,
}

impl Scratch {
    pub fn new(m: Shapes, cap: usize) -> Result<Scratch> {
        let (g, c, proj_rows) = (m.gpu, m.config, m.proj_rows);
        ensure!(cap > 0, "prefill chunk must hold at least one token");
        let h = c.hidden_size;
        let d = GdnDims::of(c);
        let wide = h.max(d.hv * d.dv).max(c.num_attention_heads * c.head_dim);
        let (k, e) = (c.num_experts_per_tok, c.num_experts);
        let imax = c.moe_intermediate_size.max(c.shared_expert_intermediate_size);
        let pairs = cap * (k + 1);
        let alloc = || -> Result<Scratch> {
            Ok(Scratch {
                cap,
                ids: g.zeros(cap)?,
                x: g.zeros(cap * h)?,
                xb: g.zeros(cap * wide)?,
                xn: g.zeros(cap * h)?,
                proj: g.zeros(cap * proj_rows)?,
                qkv: g.zeros(cap * d.conv_dim())?,
                beta: g.zeros(cap * d.hv)?,
                gl: g.zeros(cap * d.hv)?,
                chunks: GdnChunkScratch::new(g, d, cap)?,
                o: g.zeros(cap * d.hv * d.dv)?,
                qb: g.zeros(cap * c.num_attention_heads * c.head_dim)?,
                rlogits: g.zeros(cap * (e + 1))?,
                idx: g.zeros(cap * (k + 1))?,
                wts: g.zeros(cap * (k + 1))?,
                sorted: MoeSorted::new(g, cap, k, e)?,
                act: g.zeros(pairs * imax)?,
                ybuf: g.zeros(pairs * h)?,
            })
        };
        alloc().with_context(|| {
            format!("cannot allocate the prefill buffers for chunks of {cap} tokens (out of device memory?)")
        })
    }

    /// Device bytes these buffers hold.
    pub fn bytes(&self) -> usize {
        let f = |n: usize| n * 4;
        let hb = |n: usize| n * 2;
        f(self.ids.len() + self.x.len() + self.xn.len() + self.proj.len() + self.qkv.len() + self.beta.len())
            + f(self.gl.len() + self.chunks.u.len() + self.chunks.w.len() + self.chunks.p.len() + self.chunks.g.len())
            + f(self.chunks.s.len())
            + f(self.o.len() + self.rlogits.len() + self.idx.len() + self.wts.len() + self.ybuf.len())
            + f(self.sorted.rowmap.len() + self.sorted.pos.len() + self.sorted.tiles.len())
            + hb(self.xb.len() + self.qb.len() + self.act.len())
    }
}

/// The backend's prefill chunk length and its (lazily allocated) buffers, shared by all sequences: the activation
/// rows of a prefill chunk, which a batched decode step ([`crate::batch`]) also uses (one row per sequence), and
/// the batched step's own tables.
pub struct PrefillBuffers {
    pub chunk: usize,
    pub scratch: Option<Scratch>,
    pub seqs: Option<SeqScratch>,
    /// The state pointer and sequence tables of every pass (allocated once, on the first pass).
    pub tables: Option<PassTables>,
    /// The decode-only pass replays a CUDA graph per shape (default), or launches its kernels one by one (the bench
    /// times both; a failed capture turns it off).
    pub graphs: bool,
    /// The bench's in-graph cost of a kernel family: while set, the batched pass's graphs leave that family's
    /// launches out (captured apart from the full pass's: the results are not meaningful, only the time).
    pub omit: Option<String>,
}

impl PrefillBuffers {
    pub fn new(chunk: usize) -> Mutex<PrefillBuffers> {
        Mutex::new(PrefillBuffers {
            chunk: chunk.max(1),
            scratch: None,
            seqs: None,
            tables: None,
            graphs: true,
            omit: None,
        })
    }
}

/// Whether one prefill pass over sequences of these new rows fits buffers for prefill chunks of `chunk` rows: at most
/// `chunk` rows, and the sequences' chunks of 64 rows (each sequence's own) no more than those of `chunk` rows.
pub fn pass_fits(chunk: usize, rows: impl IntoIterator<Item = usize>) -> bool {
    let (r, c) = rows.into_iter().fold((0, 0), |(r, c), k| (r + k, c + pass_chunks(k)));
    r <= chunk && c <= pass_chunks(chunk)
}

/// The pass tables in `slot`, allocated on first use.
pub(crate) fn tables<'a>(slot: &'a mut Option<PassTables>, m: Shapes) -> Result<&'a mut PassTables> {
    if slot.is_none() {
        *slot = Some(PassTables::new(m)?);
    }
    slot.as_mut().context("pass tables")
}

/// The activation buffers in `slot`, holding at least `rows` rows: allocated on first use, replaced by larger ones
/// when too small.
pub(crate) fn scratch_rows<'a>(slot: &'a mut Option<Scratch>, m: Shapes, rows: usize) -> Result<&'a mut Scratch> {
    if slot.as_ref().is_none_or(|s| s.cap < rows) {
        *slot = None; // free the old buffers before allocating larger ones
        *slot = Some(Scratch::new(m, rows)?);
    }
    slot.as_mut().context("prefill buffers")
}

/// The batched step's own buffers (the activation rows are the prefill's [`Scratch`], the pointer
/// tables and positions its [`PassTables`]): attention queries and split partials, logits of [`MAX_SEQS`] rows.
pub struct SeqScratch {
    pub(crate) qbuf: CudaSlice<f32>,
    pub(crate) part: CudaSlice<f32>,
    pub(crate) logits: CudaSlice<f32>,
    /// The multi-sequence prefill's last hidden row of every sequence.
    pub(crate) last: CudaSlice<f32>,
    /// A speculative verify's GDN projections, `[gdn layer][verify rows][proj rows]`, kept for the commit of the
    /// rows accepted (allocated on the first verify, for `vsave_rows` rows; a larger one drops the graphs).
    pub(crate) vsave: Option<CudaSlice<f32>>,
    pub(crate) vsave_rows: usize,
    /// The batched pass captured as a CUDA graph, by (rows, attention splits, family left out): every address it
    /// bakes in is one of these buffers, of the [`PassTables`] (allocated once; uploaded before each launch) or of
    /// the pass's scratch rows, whose address at capture is `graph_x` (a reallocation clears them).
    pub(crate) graphs: PassGraphs,
    pub(crate) graph_x: u64,
}

/// Captured decode passes by (decode rows, verify rows, verifying sequences, attention splits, streamed experts, the
/// kernel family left out: [`PrefillBuffers::omit`]).
#[derive(Default)]
pub(crate) struct PassGraphs(pub(crate) HashMap<GraphKey, CudaGraph>);

pub(crate) type GraphKey = (usize, usize, usize, usize, bool, Option<String>);

// SAFETY: the graphs live in the model's prefill buffers, behind its mutex: one thread at a time launches or drops
// them (cudarc's CudaGraph holds raw handles, which are not Send by default; the context they belong to is).
unsafe impl Send for PassGraphs {}

impl SeqScratch {
    pub fn new(m: Shapes) -> Result<SeqScratch> {
        let (g, c) = (m.gpu, m.config);
        let (nh, hd) = (c.num_attention_heads, c.head_dim);
        let n = MAX_SEQS;
        let alloc = || -> Result<SeqScratch> {
            Ok(SeqScratch {
                qbuf: g.zeros(n * nh * hd)?,
                part: g.zeros(n * nh * MAX_SPLIT * (hd + 2))?,
                logits: g.zeros(n * c.vocab_size)?,
                last: g.zeros(n * c.hidden_size)?,
                vsave: None,
                vsave_rows: 0,
                graphs: PassGraphs::default(),
                graph_x: 0,
            })
        };
        alloc().context("cannot allocate the batched decode buffers (out of device memory?)")
    }

    /// Device bytes these buffers hold.
    pub fn bytes(&self) -> usize {
        4 * (self.qbuf.len() + self.part.len() + self.logits.len() + self.last.len())
            + 4 * self.vsave.as_ref().map_or(0, |v| v.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass fits by its rows and by its sequences' own chunks of 64 (each sequence starts a new chunk).
    #[test]
    fn pass_fits_counts_rows_and_each_sequences_chunks() {
        assert!(pass_fits(4096, [4096]));
        assert!(!pass_fits(4096, [4097]));
        assert!(pass_fits(4096, [80; 32]), "2,560 rows in 64 chunks");
        assert!(!pass_fits(4096, [80; 33]), "2,640 rows but 66 chunks");
        assert!(pass_fits(4096, [64; 64]));
        assert!(!pass_fits(4096, [65, 4000]), "4,065 rows in 2 + 63 chunks");
        assert!(pass_fits(100, [1, 1]), "a chunk of 100 rows has room for 2 chunks");
        assert!(!pass_fits(100, [1, 1, 1]));
        assert_eq!((pass_chunks(1), pass_chunks(64), pass_chunks(65)), (1, 1, 2));
    }
}
