//! MLX affine group quantisation (the `mlx-community` 4-bit checkpoint format, model-spec §4) and fused
//! quantised mat-vec / small mat-mat kernels.
//!
//! # Format
//! A logical `[rows, cols]` f32 matrix (`rows` = out features, `cols` = in features) is cut into groups of
//! `group_size` (64 for this model) consecutive columns of one row. Each group `g` of row `r` has a bf16 scale
//! `s = scales[r, g]` and bf16 bias `b = biases[r, g]`, and every element stores an unsigned code `q` of `bits`
//! (4 or 8) bits:
//!
//! ```text
//! w[r, c] = scales[r, c / gs] * q[r, c] + biases[r, c / gs]        q in [0, 2^bits - 1]
//! ```
//!
//! # Layout
//! Codes are packed into `u32` words as a little-endian bit stream per row: `packed` is `[rows, cols*bits/32]`,
//! and for 4-bit column `8j+k` is `(word[j] >> 4k) & 0xF` (lowest nibble first); for 8-bit column `4j+k` is byte
//! `k` of word `j`. `scales` and `biases` are `[rows, cols/gs]`. Stacked tensors (`[experts, out, in*bits/32]`)
//! are one `QuantMatrix` per leading index: see [`Slab::sub`].
//!
//! Storage is a [`Slab`]: either an owned `Arc<[T]>` or a zero-copy window into a shared byte buffer such as an
//! `Arc<memmap2::Mmap>` (falls back to a copy when the window is misaligned or the target is big-endian).
//!
//! # Quantiser ([`QuantMatrix::quantize`])
//! Per group: `scale = (max - min) / (2^bits - 1)`, `bias = min`, both rounded to bf16 (what MLX does when it
//! stores them: `static_cast<T>`), then `q = round_ties_even((w - bias) / scale)` clamped to the code range, with
//! `q = 0` when the rounded scale is 0. Unlike MLX, `q` is computed with the *bf16-rounded* scale and bias, so the
//! reconstruction error is at most half a (stored) step plus the bf16 rounding of `min` and of `max - min` at the
//! clamped ends. MLX's own quantiser (`mlx/backend/cpu/quantized.cpp`) differs in two more ways that do not affect
//! the format or our kernels: it snaps the larger-magnitude extreme to an exact code (so the scale may be
//! *negative*, with `bias = max`) and computes `q` with the unrounded f32 scale/bias. Loading therefore never
//! depends on the quantiser; it exists for tests and fixtures.
//!
//! # Kernels
//! Per group, `sum_c (s*q_c + b) * x_c = s * sum_c q_c*x_c + b * sum_c x_c`, so the gemv/gemm kernels never
//! materialise f32 weights: per call they precompute the group sums of `x` once, and per row and group do one
//! integer-code dot product (`q` unpacked to f32 in registers: AVX2 variable shifts / `cvtepu8`, or NEON) and
//! two multiply-adds. `gemm` (`n` activation rows, prefill / batch) unpacks each group's codes once into a small
//! stack buffer and reuses it for all `n` rows. Rows are split across the rayon pool. The SIMD path is chosen at
//! run time (AVX2+FMA on x86_64, NEON on aarch64, scalar otherwise); it sums in a different order, so results
//! match the dequantise-then-dot reference to f32 rounding (~1e-6 relative), not bit-for-bit.

use std::fmt;
use std::ops::{Deref, Range};
use std::sync::Arc;

use half::bf16;
use rayon::prelude::*;

/// Group size of every quantised tensor in the Qwen3.6 MLX checkpoints.
pub const GROUP_SIZE: usize = 64;
/// Largest supported group size (MLX allows 32, 64 and 128).
const MAX_GROUP: usize = 128;
/// Minimum rows per rayon task: keeps tiny matrices (router, gates) from paying for fine-grained splitting.
const MIN_ROWS_PER_TASK: usize = 16;

/// Why a quantised matrix (or one of its buffers) could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("unsupported bit width {0}: only 4 and 8 are supported")]
    Bits(u32),
    #[error("unsupported group size {0}: expected 32, 64 or 128")]
    GroupSize(usize),
    #[error(
        "invalid shape [{rows}, {cols}]: rows must be > 0 and cols a positive multiple of group size {group_size}"
    )]
    Shape { rows: usize, cols: usize, group_size: usize },
    #[error("{what}: expected {expected} elements, got {got}")]
    Length { what: &'static str, expected: usize, got: usize },
    #[error("range {start}..{end} is invalid for a buffer of {len} bytes holding {elem}-byte elements")]
    Range { start: usize, end: usize, len: usize, elem: usize },
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for half::bf16 {}
}

/// Element types a [`Slab`] may hold: plain data for which every bit pattern is valid and that has no padding
/// (sealed: `u32` and `bf16`).
pub trait Plain: Copy + Send + Sync + 'static + sealed::Sealed {
    /// Decodes one element from `size_of::<Self>()` little-endian bytes.
    fn from_le(bytes: &[u8]) -> Self;
}

impl Plain for u32 {
    fn from_le(bytes: &[u8]) -> Self {
        u32::from_le_bytes(bytes.try_into().expect("4 bytes"))
    }
}

impl Plain for bf16 {
    fn from_le(bytes: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes(bytes.try_into().expect("2 bytes")))
    }
}

/// A shared, immutable byte buffer (e.g. `Arc<memmap2::Mmap>`, `Arc<Vec<u8>>`) whose contents never move.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

#[derive(Clone)]
enum Owner<T> {
    /// Owned elements; `Slab::start` counts elements.
    Elems(Arc<[T]>),
    /// Little-endian bytes of a shared buffer; `Slab::start` counts bytes.
    Bytes(SharedBytes),
}

/// An immutable, cheaply clonable `[T]`: owned, or borrowed zero-copy from a shared byte buffer.
#[derive(Clone)]
pub struct Slab<T: Plain> {
    owner: Owner<T>,
    start: usize,
    len: usize,
}

impl<T: Plain> Slab<T> {
    /// Views `bytes[range]` (little-endian `T`s) without copying when it is aligned for `T` on a little-endian
    /// target, otherwise copies it. Fails if the range is out of bounds or not a whole number of elements.
    pub fn from_shared(bytes: SharedBytes, range: Range<usize>) -> Result<Self, QuantError> {
        let size = size_of::<T>();
        let all = (*bytes).as_ref();
        let err = QuantError::Range { start: range.start, end: range.end, len: all.len(), elem: size };
        let window = all.get(range.clone()).ok_or(err.clone())?;
        if !window.len().is_multiple_of(size) {
            return Err(err);
        }
        let len = window.len() / size;
        if cfg!(target_endian = "little") && window.as_ptr().align_offset(align_of::<T>()) == 0 {
            Ok(Slab { owner: Owner::Bytes(bytes), start: range.start, len })
        } else {
            Ok(window.chunks_exact(size).map(T::from_le).collect::<Vec<_>>().into())
        }
    }

    /// Whether this slab borrows a shared byte buffer (as opposed to owning a copy).
    pub fn is_zero_copy(&self) -> bool {
        matches!(self.owner, Owner::Bytes(_))
    }

    /// A sub-slab of elements `range` sharing the same storage (e.g. one expert of a stacked tensor).
    pub fn sub(&self, range: Range<usize>) -> Result<Self, QuantError> {
        let size = size_of::<T>();
        if range.start > range.end || range.end > self.len {
            let (start, end) = (range.start * size, range.end * size);
            return Err(QuantError::Range { start, end, len: self.len * size, elem: size });
        }
        let unit = if self.is_zero_copy() { size } else { 1 };
        Ok(Slab { owner: self.owner.clone(), start: self.start + range.start * unit, len: range.len() })
    }

    pub fn as_slice(&self) -> &[T] {
        match &self.owner {
            Owner::Elems(v) => &v[self.start..self.start + self.len],
            Owner::Bytes(b) => {
                let window = &(**b).as_ref()[self.start..self.start + self.len * size_of::<T>()];
                // Checked at construction; re-checked because `AsRef` could in principle return another buffer.
                assert_eq!(window.as_ptr().align_offset(align_of::<T>()), 0, "shared buffer moved");
                // SAFETY: `window` is borrowed from `self` (kept alive by the Arc), aligned for `T` (asserted) and
                // exactly `len * size_of::<T>()` bytes long; `T: Plain` is u32 or bf16, valid for any bit pattern.
                unsafe { std::slice::from_raw_parts(window.as_ptr().cast::<T>(), self.len) }
            }
        }
    }
}

impl<T: Plain> From<Vec<T>> for Slab<T> {
    fn from(v: Vec<T>) -> Self {
        Arc::<[T]>::from(v).into()
    }
}

impl<T: Plain> From<Arc<[T]>> for Slab<T> {
    fn from(v: Arc<[T]>) -> Self {
        let len = v.len();
        Slab { owner: Owner::Elems(v), start: 0, len }
    }
}

impl<T: Plain> Deref for Slab<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Plain> fmt::Debug for Slab<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_zero_copy() { "shared" } else { "owned" };
        write!(f, "Slab<{}>({} elements, {kind})", std::any::type_name::<T>(), self.len)
    }
}

/// A `[rows, cols]` matrix in MLX affine group-quantised form (see the module docs).
#[derive(Clone, Debug)]
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    bits: u32,
    group_size: usize,
    packed: Slab<u32>,
    scales: Slab<bf16>,
    biases: Slab<bf16>,
}

/// One row's packed codes, scales and biases (lengths consistent by construction).
#[derive(Clone, Copy)]
struct Row<'a> {
    bits: u32,
    gs: usize,
    words: &'a [u32],
    scales: &'a [bf16],
    biases: &'a [bf16],
}

impl QuantMatrix {
    /// Builds a matrix from its parts, checking bits, group size, shape and every buffer length.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
        packed: impl Into<Slab<u32>>,
        scales: impl Into<Slab<bf16>>,
        biases: impl Into<Slab<bf16>>,
    ) -> Result<Self, QuantError> {
        let (packed, scales, biases) = (packed.into(), scales.into(), biases.into());
        let numel = check_geometry(rows, cols, bits, group_size)?;
        let groups = numel / group_size;
        check_len("packed weight words", numel / (32 / bits as usize), packed.len())?;
        check_len("scales", groups, scales.len())?;
        check_len("biases", groups, biases.len())?;
        Ok(QuantMatrix { rows, cols, bits, group_size, packed, scales, biases })
    }

    /// Quantises a row-major `[rows, cols]` matrix with group size [`GROUP_SIZE`].
    pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: u32) -> Result<Self, QuantError> {
        Self::quantize_grouped(w, rows, cols, bits, GROUP_SIZE)
    }

    /// [`QuantMatrix::quantize`] with an explicit group size (32, 64 or 128).
    pub fn quantize_grouped(
        w: &[f32],
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
    ) -> Result<Self, QuantError> {
        let numel = check_geometry(rows, cols, bits, group_size)?;
        check_len("weights", numel, w.len())?;
        let per_word = 32 / bits as usize;
        let n_bins = ((1u32 << bits) - 1) as f32;
        let mut packed = vec![0u32; numel / per_word];
        let (mut scales, mut biases) = (Vec::new(), Vec::new());
        // Groups never straddle rows (cols % group_size == 0), so the flat chunking is per row.
        for (wg, pg) in w.chunks_exact(group_size).zip(packed.chunks_exact_mut(group_size / per_word)) {
            let (lo, hi) = wg.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
            let (s, b) = (bf16::from_f32((hi - lo) / n_bins), bf16::from_f32(lo));
            let (sf, bf) = (s.to_f32(), b.to_f32());
            for (c, &v) in wg.iter().enumerate() {
                let q = if sf == 0.0 { 0.0 } else { ((v - bf) / sf).round_ties_even().clamp(0.0, n_bins) };
                pg[c / per_word] |= (q as u32) << (bits as usize * (c % per_word));
            }
            scales.push(s);
            biases.push(b);
        }
        Self::from_parts(rows, cols, bits, group_size, packed, scales, biases)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn bits(&self) -> u32 {
        self.bits
    }
    pub fn group_size(&self) -> usize {
        self.group_size
    }
    pub fn packed(&self) -> &[u32] {
        &self.packed
    }
    pub fn scales(&self) -> &[bf16] {
        &self.scales
    }
    pub fn biases(&self) -> &[bf16] {
        &self.biases
    }
    /// Whether all three buffers borrow a shared (e.g. memory-mapped) buffer instead of owning copies.
    pub fn is_zero_copy(&self) -> bool {
        self.packed.is_zero_copy() && self.scales.is_zero_copy() && self.biases.is_zero_copy()
    }

    /// The code `q[r, c]`.
    pub fn q(&self, r: usize, c: usize) -> u32 {
        assert!(r < self.rows && c < self.cols, "q({r}, {c}) out of range for [{}, {}]", self.rows, self.cols);
        let per_word = 32 / self.bits as usize;
        unpack(self.bits, &self.packed[r * self.cols / per_word..], c)
    }

    /// Dequantises row `r` into `out` (`cols` values): the embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} out of range ({} rows)", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row: output length");
        let row = self.row(r, &self.packed, &self.scales, &self.biases);
        let wpg = row.words_per_group();
        for (g, og) in out.chunks_exact_mut(row.gs).enumerate() {
            let (s, b) = (row.scales[g].to_f32(), row.biases[g].to_f32());
            let words = &row.words[g * wpg..(g + 1) * wpg];
            for (c, o) in og.iter_mut().enumerate() {
                *o = s * unpack(row.bits, words, c) as f32 + b;
            }
        }
    }

    /// Gathers and dequantises rows `ids` into `out` (`[ids.len(), cols]`).
    pub fn gather_rows(&self, ids: &[usize], out: &mut [f32]) {
        assert_eq!(out.len(), ids.len() * self.cols, "gather_rows: output length");
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(self.cols)) {
            self.dequantize_row(id, o);
        }
    }

    /// The whole matrix as row-major f32 (reference / tests; the kernels never do this).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }

    /// `y = W x` with `x: [cols]`, `y: [rows]`. Panics on length mismatch.
    pub fn gemv(&self, x: &[f32], y: &mut [f32]) {
        self.gemv_with(Isa::detect(), x, y)
    }

    /// `y = x W^T` for `n` activation rows: `x: [n, cols]`, `y: [n, rows]` (row-major). Panics on length mismatch.
    pub fn gemm(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.gemm_with(Isa::detect(), x, n, y)
    }

    fn row<'a>(&self, r: usize, packed: &'a [u32], scales: &'a [bf16], biases: &'a [bf16]) -> Row<'a> {
        let (wpr, gpr) = (self.cols * self.bits as usize / 32, self.cols / self.group_size);
        Row {
            bits: self.bits,
            gs: self.group_size,
            words: &packed[r * wpr..(r + 1) * wpr],
            scales: &scales[r * gpr..(r + 1) * gpr],
            biases: &biases[r * gpr..(r + 1) * gpr],
        }
    }

    fn gemv_with(&self, isa: Isa, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "gemv: x length vs matrix columns");
        assert_eq!(y.len(), self.rows, "gemv: y length vs matrix rows");
        let xsum = group_sums(x, self.group_size);
        let (packed, scales, biases) = (&*self.packed, &*self.scales, &*self.biases);
        y.par_iter_mut().enumerate().with_min_len(MIN_ROWS_PER_TASK).for_each(|(r, yr)| {
            *yr = isa.row_dot(self.row(r, packed, scales, biases), x, &xsum);
        });
    }

    fn gemm_with(&self, isa: Isa, x: &[f32], n: usize, y: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "gemm: x length vs n * columns");
        assert_eq!(y.len(), n * self.rows, "gemm: y length vs n * rows");
        match n {
            0 => return,
            1 => return self.gemv_with(isa, x, y),
            _ => {}
        }
        let xsum: Vec<f32> = x.chunks_exact(self.cols).flat_map(|xt| group_sums(xt, self.group_size)).collect();
        let (packed, scales, biases) = (&*self.packed, &*self.scales, &*self.biases);
        let mut yt = vec![0.0f32; self.rows * n]; // [rows, n]: each task owns whole rows
        yt.par_chunks_mut(n).enumerate().with_min_len(MIN_ROWS_PER_TASK).for_each(|(r, out)| {
            isa.row_gemm(self.row(r, packed, scales, biases), x, &xsum, out);
        });
        for (r, yr) in yt.chunks_exact(n).enumerate() {
            for (t, &v) in yr.iter().enumerate() {
                y[t * self.rows + r] = v;
            }
        }
    }
}

impl Row<'_> {
    fn words_per_group(&self) -> usize {
        self.gs * self.bits as usize / 32
    }
}

fn check_geometry(rows: usize, cols: usize, bits: u32, group_size: usize) -> Result<usize, QuantError> {
    if bits != 4 && bits != 8 {
        return Err(QuantError::Bits(bits));
    }
    if ![32, 64, 128].contains(&group_size) {
        return Err(QuantError::GroupSize(group_size));
    }
    match rows.checked_mul(cols) {
        Some(numel) if rows > 0 && cols > 0 && cols.is_multiple_of(group_size) => Ok(numel),
        _ => Err(QuantError::Shape { rows, cols, group_size }),
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), QuantError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuantError::Length { what, expected, got })
    }
}

/// Code `c` of a little-endian packed bit stream.
fn unpack(bits: u32, words: &[u32], c: usize) -> u32 {
    let per_word = 32 / bits as usize;
    (words[c / per_word] >> (bits as usize * (c % per_word))) & ((1 << bits) - 1)
}

fn group_sums(x: &[f32], gs: usize) -> Vec<f32> {
    x.chunks_exact(gs).map(|g| g.iter().sum()).collect()
}

/// The instruction set the kernels use; SIMD variants are only constructed by [`Isa::detect`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Isa::Avx2Fma;
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Isa::Neon;
        }
        Isa::Scalar
    }

    /// `sum_g s_g * (q_g . x_g) + b_g * xsum_g` for one row.
    fn row_dot(self, row: Row, x: &[f32], xsum: &[f32]) -> f32 {
        match self {
            Isa::Scalar => scalar::row_dot(row, x, xsum),
            // SAFETY: `Avx2Fma` is only produced by `detect` after run-time detection of AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { avx2::row_dot(row, x, xsum) },
            // SAFETY: `Neon` is only produced by `detect` after run-time detection of NEON.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::row_dot(row, x, xsum) },
        }
    }

    /// One row of `gemm`: `out[t] = row . x[t]` for the `out.len()` activation rows of `x` (`xsum`: their
    /// group sums, `[n, groups]`). Each `out[t]` is computed by exactly the operations [`Isa::row_dot`] performs
    /// for that activation row alone, so a row's result does not depend on how many rows are batched with it.
    fn row_gemm(self, row: Row, x: &[f32], xsum: &[f32], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx2Fma {
            // SAFETY: as in `row_dot`.
            return unsafe { avx2::row_gemm(row, x, xsum, out) };
        }
        // Portable: one row_dot per activation row (a NEON kernel that unpacks each group once for several rows
        // while keeping row_dot's arithmetic is still to be written and checked on an ARM machine).
        let (cols, groups) = (row.gs * row.scales.len(), row.scales.len());
        for (t, o) in out.iter_mut().enumerate() {
            *o = self.row_dot(row, &x[t * cols..(t + 1) * cols], &xsum[t * groups..(t + 1) * groups]);
        }
    }
}

mod scalar {
    use super::{unpack, Row};

    pub fn row_dot(row: Row, x: &[f32], xsum: &[f32]) -> f32 {
        let wpg = row.words_per_group();
        let groups = row.words.chunks_exact(wpg).zip(x.chunks_exact(row.gs));
        let params = row.scales.iter().zip(row.biases).zip(xsum);
        groups
            .zip(params)
            .map(|((words, xg), ((s, b), xs))| {
                let qx: f32 = xg.iter().enumerate().map(|(c, &v)| unpack(row.bits, words, c) as f32 * v).sum();
                s.to_f32() * qx + b.to_f32() * xs
            })
            .sum()
    }
}

/// AVX2+FMA kernels. Every function requires AVX2 and FMA (guaranteed by `Isa::Avx2Fma`); all loads and stores
/// go through `chunks_exact` slices of the exact width they access, so they are in bounds by construction.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Row;
    use std::arch::x86_64::*;

    /// Eight 4-bit codes of one word, as f32 lanes in column order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4(w: u32) -> __m256 {
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), _mm256_set1_epi32(0xF));
        _mm256_cvtepi32_ps(codes)
    }

    /// Eight 8-bit codes of two words, as f32 lanes in column order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q8(w: &[u32]) -> __m256 {
        debug_assert_eq!(w.len(), 2);
        // SAFETY: `w` holds two u32 = 8 bytes, exactly what the unaligned 64-bit load reads.
        let bytes = _mm_loadl_epi64(w.as_ptr().cast());
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))
    }

    /// `q . x` for one group, as eight partial sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group_qx(bits: u32, words: &[u32], x: &[f32]) -> __m256 {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let per_pair = if bits == 4 { 2 } else { 4 }; // words per 16 columns
        for (w, xs) in words.chunks_exact(per_pair).zip(x.chunks_exact(16)) {
            let (q0, q1) = if bits == 4 { (q4(w[0]), q4(w[1])) } else { (q8(&w[..2]), q8(&w[2..])) };
            // SAFETY: `xs` holds exactly 16 f32s; the two unaligned loads read [0, 8) and [8, 16).
            let (x0, x1) = (_mm256_loadu_ps(xs.as_ptr()), _mm256_loadu_ps(xs.as_ptr().add(8)));
            a0 = _mm256_fmadd_ps(q0, x0, a0);
            a1 = _mm256_fmadd_ps(q1, x1, a1);
        }
        _mm256_add_ps(a0, a1)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row_dot(row: Row, x: &[f32], xsum: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut bias_acc = 0.0f32;
        let groups = row.words.chunks_exact(row.words_per_group()).zip(x.chunks_exact(row.gs));
        for ((words, xg), ((s, b), xs)) in groups.zip(row.scales.iter().zip(row.biases).zip(xsum)) {
            acc = _mm256_fmadd_ps(_mm256_set1_ps(s.to_f32()), group_qx(row.bits, words, xg), acc);
            bias_acc += b.to_f32() * xs;
        }
        hsum(acc) + bias_acc
    }

    /// `gemm` for one row: each group's codes are unpacked once into registers (a stack array the compiler
    /// keeps in L1 at worst) and reused for up to four activation rows, each with its own accumulator; per
    /// activation row the same operations in the same order as `row_dot` (same lanes, same fused multiply-adds).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row_gemm(row: Row, x: &[f32], xsum: &[f32], out: &mut [f32]) {
        let (gs, wpg, groups) = (row.gs, row.words_per_group(), row.scales.len());
        let cols = gs * groups;
        let mut q = [_mm256_setzero_ps(); super::MAX_GROUP / 8];
        let q = &mut q[..gs / 8];
        for (t0, out4) in out.chunks_mut(4).enumerate().map(|(i, o)| (4 * i, o)) {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (g, words) in row.words.chunks_exact(wpg).enumerate() {
                let per8 = if row.bits == 4 { 1 } else { 2 }; // words per 8 columns
                for (qv, w) in q.iter_mut().zip(words.chunks_exact(per8)) {
                    *qv = if row.bits == 4 { q4(w[0]) } else { q8(w) };
                }
                let s = _mm256_set1_ps(row.scales[g].to_f32());
                for (t, a) in acc.iter_mut().take(out4.len()).enumerate() {
                    let xg = &x[(t0 + t) * cols + g * gs..(t0 + t) * cols + (g + 1) * gs];
                    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for (qp, xs) in q.chunks_exact(2).zip(xg.chunks_exact(16)) {
                        // SAFETY: `xs` holds exactly 16 f32s; the two unaligned loads read [0, 8) and [8, 16).
                        let (x0, x1) = (_mm256_loadu_ps(xs.as_ptr()), _mm256_loadu_ps(xs.as_ptr().add(8)));
                        a0 = _mm256_fmadd_ps(qp[0], x0, a0);
                        a1 = _mm256_fmadd_ps(qp[1], x1, a1);
                    }
                    *a = _mm256_fmadd_ps(s, _mm256_add_ps(a0, a1), *a);
                }
            }
            for (t, (o, a)) in out4.iter_mut().zip(acc).enumerate() {
                let xs = &xsum[(t0 + t) * groups..(t0 + t + 1) * groups];
                let mut bias = 0.0f32; // as row_dot sums it (a fold from 0.0, not iterator sum's -0.0)
                for (b, x) in row.biases.iter().zip(xs) {
                    bias += b.to_f32() * x;
                }
                *o = hsum(a) + bias;
            }
        }
    }
}

/// NEON kernels, mirroring `avx2` with 4-lane vectors. Every function requires NEON (guaranteed by `Isa::Neon`);
/// all loads and stores go through `chunks_exact` slices of the exact width they access.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::Row;
    use std::arch::aarch64::*;

    /// Eight 4-bit codes of one word, as two f32x4 in column order.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn q4(w: u32) -> (float32x4_t, float32x4_t) {
        static LO: [i32; 4] = [0, -4, -8, -12]; // negative = right shift
        static HI: [i32; 4] = [-16, -20, -24, -28];
        let (v, mask) = (vdupq_n_u32(w), vdupq_n_u32(0xF));
        // SAFETY: LO and HI are 4-element i32 arrays, exactly what the loads read.
        let (lo, hi) = (vld1q_s32(LO.as_ptr()), vld1q_s32(HI.as_ptr()));
        (vcvtq_f32_u32(vandq_u32(vshlq_u32(v, lo), mask)), vcvtq_f32_u32(vandq_u32(vshlq_u32(v, hi), mask)))
    }

    /// Eight 8-bit codes of two words, as two f32x4 in column order.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn q8(w: &[u32]) -> (float32x4_t, float32x4_t) {
        debug_assert_eq!(w.len(), 2);
        // SAFETY: `w` holds two u32 = 8 bytes, exactly what the 8-lane u8 load reads.
        let h = vmovl_u8(vld1_u8(w.as_ptr().cast()));
        (vcvtq_f32_u32(vmovl_u16(vget_low_u16(h))), vcvtq_f32_u32(vmovl_high_u16(h)))
    }

    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn codes8(bits: u32, w: &[u32]) -> (float32x4_t, float32x4_t) {
        if bits == 4 {
            q4(w[0])
        } else {
            q8(w)
        }
    }

    #[target_feature(enable = "neon")]
    pub unsafe fn row_dot(row: Row, x: &[f32], xsum: &[f32]) -> f32 {
        let per8 = if row.bits == 4 { 1 } else { 2 }; // words per 8 columns
        let mut acc = vdupq_n_f32(0.0);
        let mut bias_acc = 0.0f32;
        let groups = row.words.chunks_exact(row.words_per_group()).zip(x.chunks_exact(row.gs));
        for ((words, xg), ((s, b), xs)) in groups.zip(row.scales.iter().zip(row.biases).zip(xsum)) {
            let (mut a0, mut a1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            for (w, x8) in words.chunks_exact(per8).zip(xg.chunks_exact(8)) {
                let (q0, q1) = codes8(row.bits, w);
                // SAFETY: `x8` holds exactly 8 f32s; the loads read [0, 4) and [4, 8).
                a0 = vfmaq_f32(a0, q0, vld1q_f32(x8.as_ptr()));
                a1 = vfmaq_f32(a1, q1, vld1q_f32(x8.as_ptr().add(4)));
            }
            acc = vfmaq_f32(acc, vdupq_n_f32(s.to_f32()), vaddq_f32(a0, a1));
            bias_acc += b.to_f32() * xs;
        }
        vaddvq_f32(acc) + bias_acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: tiny deterministic PRNG for test data.
    struct Rng(u64);

    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        fn sym(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.sym()).collect()
        }
    }

    /// Weights with per-row magnitude and per-group offsets (so biases matter), never exactly zero.
    fn weights(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
        let mut w = Vec::with_capacity(rows * cols);
        for _ in 0..rows {
            let mag = 0.05 + rng.sym().abs();
            for c in 0..cols {
                let offset = if c % GROUP_SIZE == 0 { 0.3 * rng.sym() } else { 0.0 };
                w.push(mag * (rng.sym() + offset) + 1e-3);
            }
        }
        w
    }

    /// `y[t, r] = sum_c deq[r, c] * x[t, c]`, accumulated in f64 from the f32 dequantised weights.
    fn reference(m: &QuantMatrix, x: &[f32], n: usize) -> Vec<f32> {
        let deq = m.dequantize();
        let mut y = vec![0.0; n * m.rows()];
        for t in 0..n {
            let xt = &x[t * m.cols()..(t + 1) * m.cols()];
            for (r, wr) in deq.chunks_exact(m.cols()).enumerate() {
                y[t * m.rows() + r] = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    fn rel_err(got: &[f32], want: &[f32]) -> f32 {
        let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let max_diff = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(max_ref > 0.0);
        max_diff / max_ref
    }

    const SHAPES: [(usize, usize); 7] = [(1, 64), (7, 64), (33, 192), (5, 2048), (130, 192), (17, 2048), (64, 64)];

    #[test]
    fn packing_4bit_pins_nibble_order() {
        // Columns 0..16 hold codes 0..16: lowest nibble first.
        let packed = vec![0x7654_3210u32, 0xFEDC_BA98, 0, 0, 0, 0, 0, 0x1000_000F];
        let m = QuantMatrix::from_parts(1, 64, 4, 64, packed, vec![bf16::ONE], vec![bf16::ZERO]).unwrap();
        let row = m.dequantize();
        assert_eq!(&row[..16], &(0..16).map(|c| c as f32).collect::<Vec<_>>()[..]);
        assert_eq!((row[56], row[62], row[63]), (15.0, 0.0, 1.0));
        assert_eq!(m.q(0, 9), 9);
        // And the quantiser packs the same way: codes c % 16 with scale 1, bias 0.
        let w: Vec<f32> = (0..64).map(|c| (c % 16) as f32).collect();
        let q = QuantMatrix::quantize(&w, 1, 64, 4).unwrap();
        assert_eq!(&q.packed()[..2], &[0x7654_3210, 0xFEDC_BA98]);
        assert_eq!((q.scales()[0], q.biases()[0]), (bf16::ONE, bf16::ZERO));
    }

    #[test]
    fn packing_8bit_pins_byte_order() {
        let mut packed = vec![0u32; 16];
        packed[0] = 0x0302_0100;
        packed[15] = 0xFF3E_3D3C;
        let (s, b) = (vec![bf16::from_f32(0.5)], vec![bf16::from_f32(-1.0)]);
        let m = QuantMatrix::from_parts(1, 64, 8, 64, packed, s, b).unwrap();
        let row = m.dequantize();
        assert_eq!(&row[..4], &[-1.0, -0.5, 0.0, 0.5]);
        assert_eq!(&row[60..], &[29.0, 29.5, 30.0, 126.5]);
        // Quantiser: codes 0..63 then 255 with scale exactly 1.
        let w: Vec<f32> = (0..64).map(|c| if c == 63 { 255.0 } else { c as f32 }).collect();
        let q = QuantMatrix::quantize(&w, 1, 64, 8).unwrap();
        assert_eq!((q.packed()[0], q.packed()[1], q.packed()[15]), (0x0302_0100, 0x0706_0504, 0xFF3E_3D3C));
    }

    #[test]
    fn quantize_error_within_half_step() {
        let mut rng = Rng(1);
        for bits in [4, 8] {
            for gs in [32, 64, 128] {
                let (rows, cols) = (9, 384);
                let w = weights(&mut rng, rows, cols);
                let m = QuantMatrix::quantize_grouped(&w, rows, cols, bits, gs).unwrap();
                let deq = m.dequantize();
                let n_bins = ((1 << bits) - 1) as f32;
                for (g, (wg, dg)) in w.chunks_exact(gs).zip(deq.chunks_exact(gs)).enumerate() {
                    let lo = wg.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                    let hi = wg.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                    let (s, b) = (m.scales()[g].to_f32(), m.biases()[g].to_f32());
                    // Half a step, plus bf16 rounding of min (bottom clamp) and of the range (top clamp).
                    let tol = s / 2.0 + (b - lo).abs() + n_bins * (s - (hi - lo) / n_bins).abs() + 1e-6 * hi.abs();
                    for (&a, &d) in wg.iter().zip(dg) {
                        assert!((a - d).abs() <= tol, "bits {bits} gs {gs} group {g}: {a} -> {d}, tol {tol}");
                    }
                }
            }
        }
    }

    #[test]
    fn constant_group_has_zero_scale() {
        let w = vec![0.75f32; 128];
        let m = QuantMatrix::quantize(&w, 2, 64, 4).unwrap();
        assert_eq!(m.scales()[0], bf16::ZERO);
        assert!(m.dequantize().iter().all(|&v| v == 0.75));
    }

    #[test]
    fn gemv_and_gemm_match_reference() {
        let mut rng = Rng(2);
        for bits in [4, 8] {
            for (rows, cols) in SHAPES {
                let m = QuantMatrix::quantize(&weights(&mut rng, rows, cols), rows, cols, bits).unwrap();
                for n in [1, 2, 3, 8] {
                    let x = rng.vec(n * cols);
                    let mut y = vec![f32::NAN; n * rows];
                    if n == 1 {
                        m.gemv(&x, &mut y)
                    } else {
                        m.gemm(&x, n, &mut y)
                    }
                    let err = rel_err(&y, &reference(&m, &x, n));
                    assert!(err <= 1e-5, "bits {bits} [{rows}, {cols}] n {n}: rel err {err}");
                }
            }
        }
    }

    /// A row of `gemm` is bit-identical to `gemv` of that activation row alone, on every kernel, whatever the
    /// number of rows beside it (what lets a sequence in a batch compute exactly what it computes alone).
    #[test]
    fn gemm_rows_equal_gemv_bit_for_bit() {
        let mut rng = Rng(4);
        for isa in [Isa::Scalar, Isa::detect()] {
            for bits in [4, 8] {
                for gs in [32, 64, 128] {
                    let (rows, cols) = (37, 384);
                    let m =
                        QuantMatrix::quantize_grouped(&weights(&mut rng, rows, cols), rows, cols, bits, gs).unwrap();
                    for n in [2, 3, 4, 5, 9] {
                        let x = rng.vec(n * cols);
                        let mut y = vec![0.0; n * rows];
                        m.gemm_with(isa, &x, n, &mut y);
                        for t in 0..n {
                            let mut one = vec![0.0; rows];
                            m.gemv_with(isa, &x[t * cols..(t + 1) * cols], &mut one);
                            let got: Vec<u32> = y[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                            let want: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                            assert_eq!(got, want, "{isa:?} bits {bits} gs {gs} n {n} row {t}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn simd_matches_scalar() {
        let isa = Isa::detect();
        eprintln!("quant kernels use {isa:?}");
        let mut rng = Rng(3);
        for bits in [4, 8] {
            for gs in [32, 64, 128] {
                for (rows, cols) in [(3, 128), (41, 384), (20, 2048)] {
                    let m =
                        QuantMatrix::quantize_grouped(&weights(&mut rng, rows, cols), rows, cols, bits, gs).unwrap();
                    for n in [1, 4] {
                        let x = rng.vec(n * cols);
                        let (mut fast, mut slow) = (vec![0.0; n * rows], vec![0.0; n * rows]);
                        m.gemm_with(isa, &x, n, &mut fast);
                        m.gemm_with(Isa::Scalar, &x, n, &mut slow);
                        let err = rel_err(&fast, &slow);
                        assert!(err <= 1e-5, "{isa:?} bits {bits} gs {gs} [{rows}, {cols}] n {n}: {err}");
                        assert!(rel_err(&slow, &reference(&m, &x, n)) <= 1e-5);
                    }
                }
            }
        }
    }

    #[test]
    fn rows_and_gather_match_full_dequantize() {
        let mut rng = Rng(4);
        let (rows, cols) = (11, 192);
        let m = QuantMatrix::quantize(&weights(&mut rng, rows, cols), rows, cols, 4).unwrap();
        let full = m.dequantize();
        let ids = [10, 0, 3, 3];
        let mut out = vec![0.0; ids.len() * cols];
        m.gather_rows(&ids, &mut out);
        for (&id, o) in ids.iter().zip(out.chunks_exact(cols)) {
            assert_eq!(o, &full[id * cols..(id + 1) * cols]);
        }
    }

    #[test]
    fn from_parts_rejects_bad_input() {
        let ok = |packed: usize, scales: usize, biases: usize| {
            let (p, s, b) = (vec![0u32; packed], vec![bf16::ONE; scales], vec![bf16::ZERO; biases]);
            QuantMatrix::from_parts(4, 128, 4, 64, p, s, b).map(|_| ()).map_err(|e| e.to_string())
        };
        assert_eq!(ok(64, 8, 8), Ok(()));
        assert_eq!(ok(63, 8, 8).unwrap_err(), "packed weight words: expected 64 elements, got 63");
        assert_eq!(ok(64, 7, 8).unwrap_err(), "scales: expected 8 elements, got 7");
        assert_eq!(ok(64, 8, 9).unwrap_err(), "biases: expected 8 elements, got 9");
        let err = |rows, cols, bits, gs| QuantMatrix::from_parts(rows, cols, bits, gs, vec![], vec![], vec![]);
        assert_eq!(err(4, 128, 3, 64).unwrap_err(), QuantError::Bits(3));
        assert_eq!(err(4, 128, 4, 48).unwrap_err(), QuantError::GroupSize(48));
        assert!(err(4, 96, 4, 64).unwrap_err().to_string().contains("multiple of group size 64"));
        assert!(matches!(err(0, 64, 4, 64), Err(QuantError::Shape { .. })));
        assert!(matches!(QuantMatrix::quantize(&[1.0; 10], 1, 64, 4), Err(QuantError::Length { .. })));
    }

    #[test]
    fn shared_bytes_zero_copy_and_fallback() {
        let mut rng = Rng(5);
        let (rows, cols) = (6, 128);
        let m = QuantMatrix::quantize(&weights(&mut rng, rows, cols), rows, cols, 4).unwrap();
        // A fake "file": 3 junk bytes, then packed words, scales, biases (so the first layout is misaligned).
        for pad in [3usize, 4] {
            let mut file = vec![0xAAu8; pad];
            let p0 = file.len();
            file.extend(m.packed().iter().flat_map(|w| w.to_le_bytes()));
            let s0 = file.len();
            file.extend(m.scales().iter().flat_map(|s| s.to_bits().to_le_bytes()));
            let b0 = file.len();
            file.extend(m.biases().iter().flat_map(|s| s.to_bits().to_le_bytes()));
            let end = file.len();
            let file: SharedBytes = Arc::new(file);
            let packed = Slab::<u32>::from_shared(file.clone(), p0..s0).unwrap();
            let scales = Slab::<bf16>::from_shared(file.clone(), s0..b0).unwrap();
            let biases = Slab::<bf16>::from_shared(file.clone(), b0..end).unwrap();
            assert_eq!(packed.is_zero_copy(), pad == 4 && (*file).as_ref().as_ptr().align_offset(4) == 0);
            let shared = QuantMatrix::from_parts(rows, cols, 4, 64, packed, scales, biases).unwrap();
            let x = rng.vec(cols);
            let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
            m.gemv(&x, &mut a);
            shared.gemv(&x, &mut b);
            assert_eq!(a, b);
            // Sub-slabs (one "expert" of a stack) view the same storage.
            let half = shared.packed.sub(rows / 2 * 16..rows * 16).unwrap();
            assert_eq!(&*half, &m.packed()[rows / 2 * 16..]);
            assert!(shared.packed.sub(0..rows * 16 + 1).is_err());
            assert!(Slab::<u32>::from_shared(file.clone(), p0..p0 + 6).is_err());
            assert!(Slab::<u32>::from_shared(file.clone(), end - 4..end + 4).is_err());
        }
    }
}
