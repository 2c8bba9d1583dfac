//! The CUDA context, the loaded kernels, and one safe wrapper per kernel: each checks the shapes and buffer
//! lengths it is given before launching.

use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

/// One block's step-trace record (common.cuh `TraceRec`): %globaltimer ns at entry, when the dependency wait
/// returned, at the kernel's two optional marks (0 if unmarked) and at exit.
#[derive(Clone, Copy, Debug)]
pub struct TraceRec {
    pub pre: u64,
    pub wait: u64,
    pub m1: u64,
    pub m2: u64,
    pub end: u64,
    pub code: u32,
    pub nblocks: u32,
    /// The multiprocessor the block ran on.
    pub sm: u32,
    /// blockIdx.x | blockIdx.y << 16.
    pub block: u32,
}

/// Whether the batched step's ring kernels (moe_seqs.cu) take experts of these shapes: group size 64 and every size
/// (hidden, inner) a multiple of 256.
pub fn ring_shapes(gs: usize, sizes: &[usize]) -> bool {
    gs == 64 && sizes.iter().all(|&v| v >= 256 && v % 256 == 0)
}

/// A quantised matrix on the device (MLX affine, bf16 scales/biases kept as raw u16 bits).
pub struct QMat {
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub gs: usize,
    pub w: CudaSlice<u32>,
    pub s: CudaSlice<u16>,
    pub b: CudaSlice<u16>,
}

impl QMat {
    /// Bytes one full pass reads.
    pub fn bytes(&self) -> usize {
        self.w.len() * 4 + self.rows * (self.cols / self.gs) * 4
    }
}

/// Stacked experts `[n, rows_e, cols_e]` (the last one may be smaller): expert `e` starts at `e * words` /
/// `e * groups`.
pub struct Experts {
    pub w: CudaSlice<u32>,
    pub s: CudaSlice<u16>,
    pub b: CudaSlice<u16>,
    pub words: usize,
    pub groups: usize,
    pub gs: usize,
    /// The same experts in the batched step's ring kernels' tile-major order (made by [`Gpu::tile_experts`] where
    /// the shapes allow those kernels).
    pub tiled: Option<TiledExperts>,
}

/// An expert buffer's codes, scales and biases in moe_seqs.cu's tile-major order (`experts_tile`: each 16-row item's
/// 256-column chunks in 2 KB runs), at the same expert strides.
pub struct TiledExperts {
    pub w: CudaSlice<u32>,
    pub s: CudaSlice<u16>,
    pub b: CudaSlice<u16>,
}

/// Which expert buffer: gate|up rows (`[2n, H]`) or down rows (`[H, n]`), n = I (Is for the shared expert).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ExpertKind {
    GateUp,
    Down,
}

macro_rules! funcs {
    ($($name:ident: $file:literal),* $(,)?) => {
        /// Every kernel, loaded from the embedded cubins.
        pub struct Funcs { $(pub $name: CudaFunction,)* }
        impl Funcs {
            fn load(modules: &[(&str, Arc<CudaModule>)]) -> Result<Funcs> {
                let get = |file: &str, name: &str| -> Result<CudaFunction> {
                    let m = modules.iter().find(|(n, _)| *n == file).with_context(|| format!("no cubin {file}"))?;
                    m.1.load_function(name).with_context(|| format!("kernel {name} in {file}.cu"))
                };
                Ok(Funcs { $($name: get($file, stringify!($name))?,)* })
            }
            fn all(&self) -> Vec<&CudaFunction> {
                vec![$(&self.$name,)*]
            }
        }
    };
}

funcs! {
    router_topk_q8: "gemv", moe_topk: "moe", moe_gate_up: "moe", moe_down: "moe",
    gdn_step: "gdn",
    attn_prep: "attention", attn_decode: "attention", attn_decode_kv: "attention",
    attn_combine: "attention",
    // batched decode (one token for each of B sequences): see batch.rs
    gdn_step_seqs: "gdn", gdn_verify_seqs: "gdn", gdn_commit_seqs: "gdn", attn_prep_seqs: "attention", attn_decode_kv_seqs: "attention",
    attn_combine_seqs: "attention", moe_gate_up_seqs_w1: "moe_seqs", moe_gate_up_seqs_w2: "moe_seqs",
    moe_down_seqs_w1: "moe_seqs", moe_down_seqs_w2: "moe_seqs", moe_gate_up_ring_t4: "moe_seqs",
    moe_gate_up_ring_t8: "moe_seqs", moe_down_ring_t4: "moe_seqs", moe_down_ring_t8: "moe_seqs",
    experts_tile: "moe_seqs",
    router_seqs_q8: "moe_seqs", router_seqs_q4: "moe_seqs", topk_align_seqs: "moe_seqs",
    dense_seqs_w1_k1: "moe_seqs", dense_seqs_w2_k1: "moe_seqs", dense_seqs_w1_k4: "moe_seqs", dense_seqs_w2_k4: "moe_seqs",
    dense_ring_n1: "moe_seqs", dense_ring_n2: "moe_seqs", dense_ring_n4: "moe_seqs", dense_ring_n8: "moe_seqs",
    dense_tma_n1: "moe_seqs", dense_tma_n2: "moe_seqs", dense_tma_n4: "moe_seqs",
    embed_q4: "misc", argmax_partial: "misc", argmax_final: "misc", pdl_nop: "misc",
    fill_u32_hash: "misc", fill_bf16: "misc", fill_f32_uniform: "misc",
    // multi-token (prefill) kernels: see prefill.rs
    gemm_q4_store: "gemm", gemm_q4_add: "gemm", gemm_q4_swiglu: "gemm", gemm_q4_gstore: "gemm",
    gemm_q4_store_mma: "gemm", gemm_q4_add_mma: "gemm", gemm_q4_swiglu_mma: "gemm", gemm_q4_gstore_mma: "gemm",
    embed_rows: "prefill", rmsnorm_rows: "prefill", router_rows: "prefill", topk_rows: "prefill",
    moe_align: "prefill", moe_combine: "prefill", moe_combine_norm_j8: "prefill",
    moe_combine_norm_j16: "prefill", gdn_prep: "prefill", gdn_chunk_prep: "prefill",
    gdn_chunk_state: "prefill", gdn_chunk_out: "prefill", gdn_gated_norm: "prefill", gdn_ring: "prefill", attn_prep_rows: "prefill",
    flash_prefill_hd256: "flash", flash_prefill_hd128: "flash", flash_prefill_hd64: "flash",
    // sampling over many rows of logits: see sample.rs
    sample_rows: "sample", argmax_rows: "sample", sample_pre_max: "sample", sample_pre_hist: "sample", sample_pre_gather: "sample",
}

/// A kernel argument as the 8-byte word the launch passes a pointer to (little-endian: 4-byte arguments are the
/// low half).
pub trait KArg {
    fn word(&self, s: &CudaStream) -> u64;
}
impl<T> KArg for CudaSlice<T> {
    fn word(&self, s: &CudaStream) -> u64 {
        self.device_ptr(s).0
    }
}
impl<T> KArg for CudaView<'_, T> {
    fn word(&self, s: &CudaStream) -> u64 {
        self.device_ptr(s).0
    }
}
/// A device buffer a launch wrapper checks (`len`, in elements) and passes: a `CudaSlice` or a sequence's state
/// buffer (crate::pool::StateBuf).
pub trait DevBuf<T>: KArg {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
impl<T> DevBuf<T> for CudaSlice<T> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}

impl KArg for i32 {
    fn word(&self, _: &CudaStream) -> u64 {
        *self as u32 as u64
    }
}
impl KArg for i64 {
    fn word(&self, _: &CudaStream) -> u64 {
        *self as u64
    }
}
impl KArg for u64 {
    fn word(&self, _: &CudaStream) -> u64 {
        *self
    }
}
impl KArg for f32 {
    fn word(&self, _: &CudaStream) -> u64 {
        self.to_bits() as u64
    }
}

/// A kernel launch through `cuLaunchKernelEx` with programmatic stream serialization (programmatic dependent
/// launch, also inside CUDA graphs): the kernel's blocks may start before the previous kernel ends and must call
/// `pdl_wait()` (common.cuh) before reading anything that kernel writes. [`Gpu::pdl`] off leaves the attribute out
/// (the test that a pass is the same bit for bit either way).
///
/// What a kernel may read before its wait (the one rule every kernel's pre-wait reads follow): constants (weights,
/// tables the host uploaded before the launch) and what kernels two or more launches back wrote. `pdl_wait()`
/// lets the next kernel start only after this one's wait has returned, i.e. after the kernel before this one has
/// finished; so when kernel K starts, K - 2 is complete. Examples: moe_down reads moe_align's tile list and asks
/// for its experts' weights before its wait (gate|up between); moe_combine(_norm) reads the slots' positions and
/// weights and its residual row; gdn_step_seqs loads its state. Nothing may write, before its wait, what K - 1
/// could still read. A launch left out (the bench's `omit`) is replaced by a no-op kernel to keep the distance.
pub struct KLaunch<'a> {
    gpu: &'a Gpu,
    func: &'a CudaFunction,
    words: Vec<u64>,
    /// Thread-block cluster dimensions (launch attribute), if the kernel uses clusters.
    pub cluster: Option<(u32, u32, u32)>,
}

impl KLaunch<'_> {
    pub fn arg<A: KArg + ?Sized>(&mut self, a: &A) -> &mut Self {
        self.words.push(a.word(&self.gpu.stream));
        self
    }

    /// # Safety
    /// The arguments pushed must match the kernel's parameter list in number and type, and every buffer must
    /// hold what the kernel reads and writes for this configuration.
    pub unsafe fn launch(&mut self, c: LaunchConfig) -> Result<()> {
        if self.gpu.omit.load(std::sync::atomic::Ordering::Relaxed) {
            // a left-out launch still takes its place in the chain: a no-op kernel, so that what a later kernel
            // reads before its wait stays two launches away from its writer (see the struct's doc)
            let mut nop = KLaunch { gpu: self.gpu, func: &self.gpu.f.pdl_nop, words: Vec::new(), cluster: None };
            // SAFETY: pdl_nop (misc.cu) takes no arguments and touches no memory.
            return unsafe {
                nop.launch_now(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 })
            };
        }
        // SAFETY: the caller vouches for the arguments (above).
        unsafe { self.launch_now(c) }
    }

    /// # Safety
    /// As [`KLaunch::launch`]; this one launches whatever `omit` says.
    unsafe fn launch_now(&mut self, c: LaunchConfig) -> Result<()> {
        self.gpu.ctx.bind_to_thread()?;
        let mut ptrs: Vec<*mut std::ffi::c_void> =
            self.words.iter_mut().map(|w| w as *mut u64 as *mut std::ffi::c_void).collect();
        // SAFETY: an all-zero launch attribute is valid; ids and values are set below.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if self.gpu.pdl.load(std::sync::atomic::Ordering::Relaxed) {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if let Some((x, y, z)) = self.cluster {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = x;
            attrs[n].value.clusterDim.y = y;
            attrs[n].value.clusterDim.z = z;
            n += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: self.gpu.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: cfg, attrs and the argument words outlive the call, which copies them; the caller vouches for
        // the argument list (see above).
        unsafe { sys::cuLaunchKernelEx(&cfg, self.func.cu_function(), ptrs.as_mut_ptr(), std::ptr::null_mut()) }
            .result()?;
        Ok(())
    }
}

/// Bytes of each of the two pinned staging buffers of [`Gpu::upload_parts`].
const STAGE_BYTES: usize = 32 << 20;

/// Pinned staging buffers for uploads, and the event that marks each one's last copy as done.
struct Staging {
    bufs: [cudarc::driver::PinnedHostSlice<u8>; 2],
    done: [Option<cudarc::driver::CudaEvent>; 2],
    next: usize,
}

/// One GPU: context, the stream every kernel runs on, and the kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub f: Funcs,
    /// The streamed GEMV's instantiations (gemv.cu `gemv_tma_q{bits}_r{R}_m{mode}_n{NV}`), see [`Gpu::gemv_plan`].
    gemv: Vec<CudaFunction>,
    pub sms: u32,
    /// Bytes copied to the device by [`Gpu::upload_parts`] so far.
    pub uploaded: std::sync::atomic::AtomicUsize,
    /// Bytes of weight copies made on the device from uploaded ones (the experts' tile-major copies).
    pub derived: std::sync::atomic::AtomicUsize,
    staging: std::sync::Mutex<Option<Staging>>,
    /// The sampler's buffers, kept between draws (crate::sample's `SampleScratch`, which the sampler owns: the
    /// driver layer does not know its type).
    pub(crate) sampler: std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Launch with programmatic dependent launch (always on when serving; a test turns it off to show that a pass
    /// gives the same bits without it: the pre-wait rule of [`KLaunch`] holds).
    pub pdl: std::sync::atomic::AtomicBool,
    /// While set, [`KLaunch::launch`] launches nothing: the bench's timing of the batched step with one kernel
    /// family left out ([`crate::workspace::PrefillBuffers::omit`]).
    pub(crate) omit: std::sync::atomic::AtomicBool,
    /// Kernel choices the tests and the bench turn off to compare a fast kernel with the generic one it replaces
    /// (always on when serving; no environment switch): the streamed expert kernels' shared-memory ring variants
    /// where the shapes allow (moe_seqs.cu `moe_*_ring_t*`, the same results bit for bit, faster)...
    pub moe_ring: std::sync::atomic::AtomicBool,
    /// ... dense_seqs' ring kernel where the shapes allow (moe_seqs.cu `dense_ring_n*`)...
    pub dense_ring: std::sync::atomic::AtomicBool,
    /// ... dense_seqs' bulk-copy kernel where the shapes allow (moe_seqs.cu `dense_tma_n*`, ahead of the ring)...
    pub dense_tma: std::sync::atomic::AtomicBool,
    /// ... and a decode batch of at most [`crate::batch::TOPK_ALIGN_ROWS`] rows' top-k and align in one launch
    /// ([`Gpu::topk_align_seqs`]; off: topk_rows and moe_align).
    pub topk_align: std::sync::atomic::AtomicBool,
    /// The prefill GEMMs on wgmma (gemm.cu `WG`) rather than mma.sync (`gemm_q4_*_mma`). Off by default until a
    /// device run has checked and timed it (the tests check both; the bench prints the A/B).
    pub gemm_wgmma: std::sync::atomic::AtomicBool,
    _modules: Vec<Arc<CudaModule>>,
}

/// Blocks of the grid-stride GEMV-like kernels: enough to fill the chip, no more.
const BLOCKS_PER_SM: u32 = 4;
/// Threads of the GEMV-like kernels (8 warps).
const GEMV_THREADS: u32 = 256;
/// Shared memory the streamed GEMV may use for its ring of weight stages: small enough that the next kernel's
/// block fits on the same SM beside it (228 KB per SM).
const TMA_RING_BUDGET: usize = 110 * 1024;
/// Ring budget of a streamed GEMV whose blocks stream many stages (lm_head).
const TMA_RING_BUDGET_DEEP: usize = 180 * 1024;
/// Dynamic shared memory limit set on the streamed GEMV kernels.
const TMA_SMEM_MAX: usize = 200 * 1024;
/// Dynamic shared memory limit set on the multi-token and few-row kernels that need more than 48 KB (the per-block
/// opt-in limit, 227 KB on Hopper, minus room for the kernels' static shared memory).
pub const SMEM_MAX: usize = 200 * 1024;
/// Rows of x one moe_down block owns at most (DN_RB in moe.cu), and the largest k it takes (DN_MAXK + 1).
const MOE_DOWN_RB: usize = 16;
const MOE_DOWN_MAXK: usize = 17;
/// Length of the router / MoE sync buffer (`DeviceState::counter`): [0] the router's block counter, [32] its ready
/// flag for moe_gate_up (MOE_FLAG in common.cuh).
pub const MOE_COUNTER_LEN: usize = 64;
/// Stages the streamed GEMV's ring holds at most (GT_MAXS in gemv.cu).
const TMA_MAX_STAGES: usize = 6;
/// Bytes a quantised matrix's scale and bias buffers carry past their end: the streamed GEMV copies them in
/// 16-byte units.
pub const SB_PAD: usize = 8;

pub(crate) fn cfg(grid: (u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// Length of a shared-memory vector of `n` floats padded by 4 every 32 (`padx_len` in common.cuh).
fn padx_len(n: usize) -> usize {
    n + (n >> 5) * 4 + 4
}

/// log2(gs / (128 / bits)): 16-byte chunks per quantisation group, which must be a power of two.
pub(crate) fn group_shift(gs: usize, bits: u32) -> Result<i32> {
    let cpv = 128 / bits as usize;
    ensure!(gs % cpv == 0 && (gs / cpv).is_power_of_two(), "group size {gs} is not a power-of-two multiple of {cpv}");
    Ok((gs / cpv).trailing_zeros() as i32)
}

/// The null device pointer for optional kernel arguments.
pub(crate) const NULL: u64 = 0;

impl Gpu {
    /// Device 0 with the embedded kernels; a clear error without kernels, driver or device.
    pub fn new() -> Result<Arc<Gpu>> {
        if !tern_kernels::available() {
            bail!("tern was built without CUDA kernels (nvcc was not found at build time; see .ci/install-nvcc)");
        }
        // SAFETY: only probes whether libcuda can be loaded (cudarc would panic on first use otherwise).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            bail!("no CUDA driver (libcuda) could be loaded");
        }
        let n = CudaContext::device_count().context("no CUDA device: cuDeviceGetCount failed")?;
        ensure!(n > 0, "no CUDA device");
        let ctx = CudaContext::new(0).context("cannot create a CUDA context on device 0")?;
        keep_freed_memory(0)?;
        // SAFETY: tern uses a single stream per context; cross-stream event tracking is not needed, and it must
        // be off so that graph capture records kernels only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let mut modules = Vec::new();
        for (name, bin) in tern_kernels::CUBINS {
            let m = ctx.load_module(Ptx::from_binary(bin.to_vec())).with_context(|| format!("loading {name}.cubin"))?;
            modules.push((*name, m));
        }
        let f = Funcs::load(&modules)?;
        let gm = &modules.iter().find(|(n, _)| *n == "gemv").context("no cubin gemv")?.1;
        let mut gemv = Vec::new();
        for bits in [4, 8] {
            for r in [4, 1] {
                for mode in 0..2 {
                    for nv in [2, 4] {
                        let name = format!("gemv_tma_q{bits}_r{r}_m{mode}_n{nv}");
                        gemv.push(gm.load_function(&name).with_context(|| format!("kernel {name} in gemv.cu"))?);
                    }
                }
            }
        }
        for func in gemv.iter().chain([&f.moe_down, &f.router_topk_q8, &f.moe_gate_up]) {
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                TMA_SMEM_MAX as i32,
            )?;
        }
        for func in big_smem_kernels(&f) {
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                SMEM_MAX as i32,
            )?;
        }
        // Every kernel prefers the largest shared-memory carveout: an SM's L1/shared split is one setting for all the
        // blocks on it, so a kernel that asks for little shared memory would otherwise leave its SMs in a split where
        // the next kernel's streamed-GEMV or moe_down blocks (up to ~200 KB) do not fit until it has drained, and
        // their bulk copies could not start early.
        for func in gemv.iter().chain(f.all()) {
            func.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)?;
        }
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            f,
            gemv,
            sms,
            uploaded: Default::default(),
            derived: Default::default(),
            staging: Default::default(),
            sampler: Default::default(),
            pdl: std::sync::atomic::AtomicBool::new(true),
            omit: std::sync::atomic::AtomicBool::new(false),
            moe_ring: std::sync::atomic::AtomicBool::new(true),
            dense_ring: std::sync::atomic::AtomicBool::new(true),
            dense_tma: std::sync::atomic::AtomicBool::new(true),
            topk_align: std::sync::atomic::AtomicBool::new(true),
            gemm_wgmma: std::sync::atomic::AtomicBool::new(false),
            _modules: modules.into_iter().map(|m| m.1).collect(),
        }))
    }

    /// Add the tile-major copy ([`Experts::tiled`]) that the batched step's ring kernels read: `n_experts` routed
    /// experts of inner size `i` and the shared one (`is`) after them, hidden size `h`. Only for the shapes those kernels
    /// take ([`ring_shapes`]); the copy is as large as the buffer and is counted in [`Gpu::derived`].
    pub fn tile_experts(
        &self,
        x: &mut Experts,
        kind: ExpertKind,
        n_experts: usize,
        (i, is): (usize, usize),
        h: usize,
    ) -> Result<()> {
        ensure!(ring_shapes(x.gs, &[h, i, is]), "tile_experts: sizes {h}/{i}/{is}, group size {}", x.gs);
        let words = |n: usize| 2 * n * h / 8 / if kind == ExpertKind::Down { 2 } else { 1 };
        ensure!(
            x.words == words(i) && x.groups == x.words / 8,
            "tile_experts: expert strides {} / {}",
            x.words,
            x.groups
        );
        ensure!(x.w.len() >= n_experts * x.words + words(is), "tile_experts: expert buffer too short");
        ensure!(x.s.len() >= (n_experts * x.words + words(is)) / 8, "tile_experts: scales too short");
        ensure!(x.b.len() >= (n_experts * x.words + words(is)) / 8, "tile_experts: biases too short");
        let t = TiledExperts { w: self.zeros(x.w.len())?, s: self.zeros(x.s.len())?, b: self.zeros(x.b.len())? };
        let kd: i32 = if kind == ExpertKind::Down { 1 } else { 0 };
        for (first, ne, n) in [(0, n_experts, i), (n_experts, 1, is)] {
            let (wo, go) = (first * x.words, first * x.groups);
            let v = [ne as i32, kd, n as i32, h as i32];
            let (ws, gs) = (x.words as i64, x.groups as i64);
            let at = |p: u64, bytes: usize| p + bytes as u64;
            let st = &self.stream;
            let src =
                [at(x.w.device_ptr(st).0, 4 * wo), at(x.s.device_ptr(st).0, 2 * go), at(x.b.device_ptr(st).0, 2 * go)];
            let dst =
                [at(t.w.device_ptr(st).0, 4 * wo), at(t.s.device_ptr(st).0, 2 * go), at(t.b.device_ptr(st).0, 2 * go)];
            let mut l = self.launcher(&self.f.experts_tile);
            l.arg(&src[0]).arg(&src[1]).arg(&src[2]).arg(&ws).arg(&gs);
            l.arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&v[3]);
            l.arg(&dst[0]).arg(&dst[1]).arg(&dst[2]);
            // SAFETY: matches experts_tile (moe_seqs.cu): `ne` experts of `words(n)` codes and words / 8 scales and
            // biases from offset `first` of buffers that hold them (checked above; the copy is as long), group size
            // 64 and the sizes multiples of 256 (ring_shapes), so items of 16 rows and chunks of 256 columns are
            // whole; grid-stride, any grid.
            unsafe { l.launch(cfg((4 * self.sms, 1), 256, 0)) }?;
        }
        self.derived.fetch_add(x.w.len() * 4 + (x.s.len() + x.b.len()) * 2, std::sync::atomic::Ordering::Relaxed);
        x.tiled = Some(t);
        Ok(())
    }

    /// Turn the step trace on (emptying the trace buffers) or off in every module (common.cuh `KTrace`).
    pub fn trace_enable(&self, on: bool) -> Result<()> {
        for m in &self._modules {
            let mut v = m.get_global("g_trace_on", &self.stream)?;
            self.stream.memcpy_htod(&(on as i32).to_le_bytes(), &mut v)?;
            if on {
                let mut n = m.get_global("g_trace_n", &self.stream)?;
                self.stream.memcpy_htod(&0u32.to_le_bytes(), &mut n)?;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// The trace records of every module: (entry ns, wait-returned ns, exit ns, kernel code, grid blocks, SM).
    pub fn trace_read(&self) -> Result<Vec<TraceRec>> {
        let mut out = Vec::new();
        for m in &self._modules {
            let nv = m.get_global("g_trace_n", &self.stream)?;
            let mut nb = [0u8; 4];
            self.stream.memcpy_dtoh(&nv, &mut nb)?;
            let tv = m.get_global("g_trace", &self.stream)?;
            let mut raw = vec![0u8; tv.len()];
            self.stream.memcpy_dtoh(&tv, &mut raw)?;
            let n = (u32::from_le_bytes(nb) as usize).min(raw.len() / 56);
            for r in raw.chunks_exact(56).take(n) {
                let u64_at = |o: usize| u64::from_le_bytes(r[o..o + 8].try_into().unwrap());
                let u32_at = |o: usize| u32::from_le_bytes(r[o..o + 4].try_into().unwrap());
                out.push(TraceRec {
                    pre: u64_at(0),
                    wait: u64_at(8),
                    m1: u64_at(16),
                    m2: u64_at(24),
                    end: u64_at(32),
                    code: u32_at(40),
                    nblocks: u32_at(44),
                    sm: u32_at(48),
                    block: u32_at(52),
                });
            }
        }
        Ok(out)
    }

    /// A launch of `func` (see [`KLaunch`]).
    pub fn launcher<'a>(&'a self, func: &'a CudaFunction) -> KLaunch<'a> {
        KLaunch { gpu: self, func, words: Vec::with_capacity(16), cluster: None }
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        self.upload_parts(&[v], 0)
    }

    /// Upload the concatenation of `parts` followed by `pad` zeros, through two pinned (page-locked) staging
    /// buffers: each chunk is copied from `parts` (e.g. the memory-mapped checkpoint) into one buffer while the
    /// other one's DMA runs. Counts the bytes in [`Gpu::uploaded`].
    pub fn upload_parts<T: DeviceRepr + ValidAsZeroBits>(&self, parts: &[&[T]], pad: usize) -> Result<CudaSlice<T>> {
        let n: usize = parts.iter().map(|p| p.len()).sum::<usize>() + pad;
        let mut dst = self.stream.alloc_zeros::<T>(n.max(1))?;
        let base = dst.device_ptr_mut(&self.stream).0;
        let mut guard = self.staging.lock().map_err(|_| anyhow::anyhow!("staging buffers poisoned"))?;
        if guard.is_none() {
            // SAFETY: the buffers are written before any byte of them is read (below).
            let mk = || unsafe { self.ctx.alloc_pinned_with_flags::<u8>(STAGE_BYTES, 0) };
            *guard = Some(Staging { bufs: [mk()?, mk()?], done: [None, None], next: 0 });
        }
        let st = guard.as_mut().context("staging buffers")?;
        let mut off = 0u64;
        for part in parts {
            // SAFETY: T is a plain device type (DeviceRepr: u32/u16/f32/i32); viewing its bytes is sound.
            let bytes = unsafe { std::slice::from_raw_parts(part.as_ptr() as *const u8, std::mem::size_of_val(*part)) };
            for chunk in bytes.chunks(STAGE_BYTES) {
                let i = st.next;
                if let Some(ev) = st.done[i].take() {
                    ev.synchronize()?;
                }
                let buf = &mut st.bufs[i].as_mut_slice()?[..chunk.len()];
                buf.copy_from_slice(chunk);
                // SAFETY: dst holds n elements, off + chunk.len() <= n * size_of::<T>() by construction; buf is pinned
                // host memory that is not touched again until the event recorded after this copy has completed.
                unsafe { cudarc::driver::result::memcpy_htod_async(base + off, buf, self.stream.cu_stream()) }?;
                st.done[i] = Some(self.stream.record_event(None)?);
                st.next ^= 1;
                off += chunk.len() as u64;
            }
        }
        self.uploaded.fetch_add(off as usize, std::sync::atomic::Ordering::Relaxed);
        Ok(dst)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, s: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(s)?)
    }

    /// Blocks for `tiles` warp-sized work items (8 per block), capped at what stays resident on the chip
    /// (grid-stride kernels: the per-block prologue then runs once per resident block).
    fn grid_resident(&self, f: &CudaFunction, tiles: usize, smem: usize) -> u32 {
        let occ = f.occupancy_max_active_blocks_per_multiprocessor(GEMV_THREADS, smem, None).unwrap_or(BLOCKS_PER_SM);
        (tiles.div_ceil(8) as u32).min(self.sms * occ.max(1))
    }

    /// `y = W xn` (or `y += W xn` when `accumulate`), where xn is `x`, or `RMSNorm(x) * gain` when a gain is
    /// given. Streamed kernel (gemv.cu `gemv_tma_*`): the weights reach shared memory by bulk copies in stages of
    /// 8R rows (R = 4 for large matrices, 1 for small ones), issued before the dependency wait.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        m: &QMat,
        x: &CudaSlice<f32>,
        gain: Option<&CudaSlice<f32>>,
        eps: f32,
        y: &mut CudaSlice<f32>,
        y_off: usize,
        accumulate: bool,
    ) -> Result<()> {
        ensure!(x.len() >= m.cols && y.len() >= y_off + m.rows, "gemv: x {} / y {} too short", x.len(), y.len());
        ensure!(gain.is_none_or(|g| g.len() >= m.cols), "gemv: gain shorter than cols");
        let (func, grid, smem, nstages) = self.gemv_plan(m, gain.is_some(), false)?;
        let (rows, cols, gshift, acc) = (m.rows as i32, m.cols as i32, group_shift(m.gs, m.bits)?, accumulate as i32);
        let yv = y.slice(y_off..);
        let mut l = self.launcher(func);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&rows).arg(&cols).arg(&gshift).arg(x);
        match gain {
            Some(g) => l.arg(g),
            None => l.arg(&NULL),
        };
        l.arg(&eps).arg(&yv).arg(&acc).arg(&nstages);
        // SAFETY: argument list matches gemv_tma_* in gemv.cu; x, y and gain checked above; the bulk copies read
        // whole rows of w (cols*bits/8 is a multiple of 16) and at most 16 bytes past the scales/biases of the last
        // row (padding checked by gemv_plan); shared memory = x + chunk sums + ring.
        unsafe { l.launch(cfg((grid, 1), GEMV_THREADS, smem)) }?;
        Ok(())
    }

    /// Kernel, grid, shared memory and ring stages of the streamed GEMV for `m` (`router`: the router kernel,
    /// 8-bit, one row per warp).
    fn gemv_plan(&self, m: &QMat, rms: bool, router: bool) -> Result<(&CudaFunction, u32, usize, i32)> {
        ensure!(m.bits == 4 || m.bits == 8, "gemv: {}-bit weights", m.bits);
        ensure!(m.cols * m.bits as usize % 128 == 0 && m.gs % (128 / m.bits as usize) == 0, "gemv: bad layout");
        ensure!(m.cols <= 4096, "gemv: cols {} over the kernel's prologue (at most 4096)", m.cols);
        let ng = m.cols / m.gs;
        ensure!(
            m.s.len() >= m.rows * ng + SB_PAD && m.b.len() >= m.rows * ng + SB_PAD,
            "gemv: scale/bias buffers must carry {SB_PAD} values of padding"
        );
        let sms = self.sms as usize;
        // 4 rows per warp (32-row stages) when that still gives every SM two stages, else 1 row per warp
        let r4 = !router && m.rows.div_ceil(32) >= 2 * sms;
        let sr = if r4 { 32 } else { 8 };
        let nst = m.rows.div_ceil(sr);
        let grid = nst.min(sms);
        let rowb = m.cols * m.bits as usize / 8;
        let stage = sr * rowb + 2 * (sr * ng * 2).div_ceil(16) * 16;
        let per_block = nst.div_ceil(grid);
        // a block that streams many stages (lm_head) gets a deeper ring: nothing needs to sit beside it
        let budget = if per_block >= 8 { TMA_RING_BUDGET_DEEP } else { TMA_RING_BUDGET };
        let nstages = (budget / stage).clamp(1, TMA_MAX_STAGES).min(per_block);
        let nvec = m.cols * m.bits as usize / 128;
        let smem = ((padx_len(m.cols) + nvec) * 4).div_ceil(128) * 128 + nstages * stage;
        ensure!(smem <= TMA_SMEM_MAX, "gemv: {} x {} needs {smem} bytes of shared memory", m.rows, m.cols);
        let func = if router {
            &self.f.router_topk_q8
        } else {
            &self.gemv[(((m.bits == 8) as usize * 2 + !r4 as usize) * 2 + rms as usize) * 2 + (m.cols > 2048) as usize]
        };
        Ok((func, grid as u32, smem, nstages as i32))
    }

    /// Router softmax + top-k + renormalise (+ shared-expert gate in slot k).
    pub fn moe_topk(
        &self,
        logits: &CudaSlice<f32>,
        e: usize,
        k: usize,
        idx: &mut CudaSlice<i32>,
        wts: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(logits.len() > e && e <= 256 && k <= e.min(32) && idx.len() > k && wts.len() > k, "moe_topk: shapes");
        let (ei, ki) = (e as i32, k as i32);
        let mut l = self.launcher(&self.f.moe_topk);
        l.arg(logits).arg(&ei).arg(&ki).arg(&*idx).arg(&*wts);
        // SAFETY: matches moe_topk in moe.cu; logits hold E+1 values, idx/wts k+1 slots.
        unsafe { l.launch(cfg((1, 1), 32, 0)) }?;
        Ok(())
    }

    /// Router GEMV with the top-k fused: `logits = R · RMSNorm(x)*gain` (R 8-bit `[E+1, H]`: router rows then the
    /// shared-expert gate), then, in the launch's last block, softmax + top-k + renormalise into `idx`/`wts`
    /// (slot k = shared expert, weight sigmoid(logits[E])). Same result as [`Gpu::gemv`] + [`Gpu::moe_topk`].
    /// `counter`: [`MOE_COUNTER_LEN`] u32, zero before the first call: [0] counts finished blocks (the kernel leaves
    /// it zero), [32] (its own 128-byte line, away from the atomics) is the ready flag this kernel sets once idx/wts
    /// are written ([`Gpu::moe_gate_up`] waits on it, [`Gpu::moe_down`] clears it).
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk(
        &self,
        m: &QMat,
        x: &CudaSlice<f32>,
        gain: &CudaSlice<f32>,
        eps: f32,
        k: usize,
        logits: &mut CudaSlice<f32>,
        counter: &mut CudaSlice<u32>,
        idx: &mut CudaSlice<i32>,
        wts: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let e = m.rows.saturating_sub(1);
        ensure!(
            m.bits == 8 && m.rows >= 2 && e <= 256 && k <= e.min(32),
            "router_topk: {}x{} {}-bit",
            m.rows,
            m.cols,
            m.bits
        );
        ensure!(m.cols <= 2048, "router_topk: hidden size {} over the kernel's prologue (at most 2048)", m.cols);
        ensure!(x.len() >= m.cols && gain.len() >= m.cols, "router_topk: x/gain shorter than {}", m.cols);
        ensure!(
            logits.len() >= m.rows && idx.len() > k && wts.len() > k && counter.len() >= MOE_COUNTER_LEN,
            "router_topk: outputs"
        );
        let (func, grid, smem, nstages) = self.gemv_plan(m, true, true)?;
        let (rows, cols, gs, ki) = (m.rows as i32, m.cols as i32, group_shift(m.gs, 8)?, k as i32);
        let mut l = self.launcher(func);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&rows).arg(&cols).arg(&gs).arg(x).arg(gain).arg(&eps).arg(&*logits);
        l.arg(&nstages).arg(&ki).arg(&*counter).arg(&*idx).arg(&*wts);
        // SAFETY: matches router_topk_q8 in gemv.cu; buffers checked above (logits E+1, idx/wts k+1 slots);
        // counter[0] is only touched by this kernel, which returns it to zero, counter[32] only by it, moe_gate_up
        // and moe_down; the bulk copies and shared memory as in `gemv` (gemv_plan checked layout and padding).
        unsafe { l.launch(cfg((grid, 1), GEMV_THREADS, smem)) }?;
        Ok(())
    }

    /// `act[slot] = silu(G xn) * (U xn)` for the k routed experts `idx[..k]` and the shared one (slot k, expert
    /// `n_experts`), xn = RMSNorm(x) * gain. The routed items wait for `counter[32]`, the ready flag that
    /// [`Gpu::router_topk`] sets (the kernel traps after 2 s if no router ran); x must be complete when the kernel
    /// starts (two launches back in the step: it is read before the dependency wait).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up(
        &self,
        gu: &Experts,
        n_experts: usize,
        k: usize,
        (i, is): (usize, usize),
        x: &CudaSlice<f32>,
        gain: &CudaSlice<f32>,
        eps: f32,
        act: &mut CudaSlice<f32>,
        counter: &CudaSlice<u32>,
    ) -> Result<()> {
        let h = gain.len();
        let imax = i.max(is);
        ensure!(x.len() >= h && act.len() >= (k + 1) * imax && counter.len() >= MOE_COUNTER_LEN, "moe_gate_up: shapes");
        ensure!(gu.w.len() >= n_experts * gu.words + 2 * is * h / 8, "moe_gate_up: expert buffer too short");
        ensure!(
            (1..=8).contains(&k) && n_experts <= 256,
            "moe_gate_up: the router's ready flag carries at most 8 expert ids below 256 (k {k}, {n_experts} experts)"
        );
        ensure!(
            h % 32 == 0 && h <= 2048 && gu.gs % 32 == 0 && i.is_power_of_two() && is.is_power_of_two() && i >= 2,
            "moe_gate_up: needs hidden size % 32 == 0 and <= 2048 (got {h}), group size % 32 == 0 (got {}), \
             power-of-two expert sizes (got {i}, {is})",
            gu.gs
        );
        // x staged (padded) + chunk sums, then 4 rows of H/2 bytes per warp for the bulk copies
        let smem = ((padx_len(h) + h / 32) * 4).div_ceil(128) * 128 + 8 * 4 * (h / 2);
        let grid = self.grid_resident(&self.f.moe_gate_up, (k * i + is).div_ceil(2), smem).min(2 * self.sms);
        let (words, groups) = (gu.words as i64, gu.groups as i64);
        let (ki, ii, isi, hi, gs) = (k as i32, i as i32, is as i32, h as i32, group_shift(gu.gs, 4)?);
        let ei = n_experts as i32;
        let mut l = self.launcher(&self.f.moe_gate_up);
        l.arg(&gu.w).arg(&gu.s).arg(&gu.b).arg(&words).arg(&groups).arg(&ki).arg(&ei).arg(&ii).arg(&isi);
        l.arg(&hi).arg(&gs).arg(x).arg(gain).arg(&eps).arg(&*act).arg(counter);
        // SAFETY: matches moe_gate_up in moe.cu; the ids in the router's flag are < n_experts (top-k over the router
        // rows), the expert buffer holds n_experts routed experts plus the shared one (checked above), whole rows
        // are bulk-copied (H/2 bytes, a multiple of 16, into the 4 rows per warp of shared memory sized above);
        // counter holds MOE_COUNTER_LEN u32.
        unsafe { l.launch(cfg((grid, 1), GEMV_THREADS, smem)) }?;
        Ok(())
    }

    /// `x += Σ_slot wts[slot] · D_{e(slot)} act[slot]` over the k routed experts and the shared one (slot k,
    /// expert `n_experts`); the routed ids come from the router's ready flag `counter[32]`, which it then clears.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down(
        &self,
        down: &Experts,
        n_experts: usize,
        wts: &CudaSlice<f32>,
        k: usize,
        (i, is): (usize, usize),
        act: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        counter: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let h = x.len();
        let imax = i.max(is);
        ensure!(wts.len() > k && act.len() >= (k + 1) * imax && counter.len() >= MOE_COUNTER_LEN, "moe_down: shapes");
        ensure!(
            (1..=8).contains(&k) && n_experts <= 256,
            "moe_down: the router's ready flag carries at most 8 expert ids below 256 (k {k}, {n_experts} experts)"
        );
        ensure!(down.w.len() >= n_experts * down.words + h * is / 8, "moe_down: expert buffer too short");
        ensure!(i % 32 == 0 && is % 32 == 0 && k < MOE_DOWN_MAXK, "moe_down: layout");
        ensure!(
            i.is_power_of_two() && is.is_power_of_two() && down.gs.is_power_of_two(),
            "moe_down: inner sizes {i}/{is} and group size {} must be powers of two",
            down.gs
        );
        let gs = group_shift(down.gs, 4)?;
        ensure!(down.gs <= i.min(is), "moe_down: group size {} over the inner size", down.gs);
        ensure!(
            (k + 1) * MOE_DOWN_RB * (imax / down.gs) <= 8 * 256 && (k + 1) * imax / 4 <= 8 * 256,
            "moe_down: k {k} / inner size {imax} over the kernel's staging registers"
        );
        // rows per block <= DN_RB (moe.cu)
        let grid = h.min(self.sms as usize).max(h.div_ceil(MOE_DOWN_RB));
        let ngm = imax / down.gs;
        let smem =
            (k + 1) * MOE_DOWN_RB * imax / 2 + 4 * ((k + 1) * (padx_len(imax) + imax / 32 + 2 * MOE_DOWN_RB * ngm));
        ensure!(smem <= TMA_SMEM_MAX, "moe_down: {smem} bytes of shared memory");
        let (words, groups) = (down.words as i64, down.groups as i64);
        let (ki, ii, isi, hi) = (k as i32, i as i32, is as i32, h as i32);
        let mut l = self.launcher(&self.f.moe_down);
        let ei = n_experts as i32;
        l.arg(&down.w).arg(&down.s).arg(&down.b).arg(&words).arg(&groups).arg(&ei).arg(wts).arg(&ki).arg(&ii);
        l.arg(&isi).arg(&hi).arg(&gs).arg(act).arg(&*x).arg(&*counter);
        // SAFETY: matches moe_down in moe.cu; shapes checked above; the ids in the router's flag are < n_experts
        // (the shared expert is n_experts), so the bulk copies stay inside the expert buffer (whole rows: n/2 bytes, a multiple of 16); each block writes its
        // own rows of x; shared memory sized as the kernel lays it out.
        unsafe { l.launch(cfg((grid as u32, 1), GEMV_THREADS, smem)) }?;
        Ok(())
    }

    /// Gated DeltaNet core for one layer, gated RMSNorm included (see gdn.cu): `out` = norm(o_h) * gain * silu(z).
    /// `dims` = (Hk, Hv, dk, dv, K).
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step(
        &self,
        proj: &CudaSlice<f32>,
        conv_w: &CudaSlice<f32>,
        ring: &mut impl DevBuf<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        state: &mut impl DevBuf<f32>,
        out: &mut CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        (hk, hv, dk, dv, k): (usize, usize, usize, usize, usize),
    ) -> Result<()> {
        let conv_dim = 2 * hk * dk + hv * dv;
        ensure!(dk <= 128 && dv <= 256 && hv % hk == 0 && k >= 1, "gdn_step: dims");
        ensure!(proj.len() >= conv_dim + hv * dv + 2 * hv && conv_w.len() == conv_dim * k, "gdn_step: proj/conv");
        ensure!(ring.len() >= k * conv_dim && state.len() >= hv * dk * dv && out.len() >= hv * dv, "gdn_step: state");
        ensure!(a_log.len() >= hv && dt_bias.len() >= hv && !pos.is_empty() && norm.len() >= dv, "gdn_step: vectors");
        let d = [hk, hv, dk, dv, k].map(|v| v as i32);
        let chunks = dv.div_ceil(32) as u32;
        let mut l = self.launcher(&self.f.gdn_step);
        l.arg(proj).arg(conv_w).arg(&*ring).arg(a_log).arg(dt_bias).arg(&*state).arg(&*out).arg(pos).arg(norm);
        l.arg(&eps).arg(&d[0]).arg(&d[1]).arg(&d[2]).arg(&d[3]).arg(&d[4]);
        l.cluster = Some((1, chunks, 1));
        // SAFETY: matches gdn_step in gdn.cu; all buffers checked above; one block per (value head, 32 columns),
        // the blocks of one head form a cluster (<= 8 blocks: dv <= 256).
        unsafe { l.launch(cfg((hv as u32, chunks), 128, 0)) }?;
        Ok(())
    }

    /// q/k norm + RoPE, K/V append at *pos. `dims` = (nh, nkv, hd, rotary_dim).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prep(
        &self,
        proj: &CudaSlice<f32>,
        qn: &CudaSlice<f32>,
        kn: &CudaSlice<f32>,
        pos: &CudaSlice<i32>,
        (nh, nkv, hd, rd): (usize, usize, usize, usize),
        theta: f32,
        eps: f32,
        qbuf: &mut CudaSlice<f32>,
        kc: &mut impl DevBuf<u16>,
        vc: &mut impl DevBuf<u16>,
    ) -> Result<()> {
        ensure!(hd <= 256 && hd % 32 == 0 && rd <= hd && rd % 2 == 0, "attn_prep: dims");
        ensure!(proj.len() >= (2 * nh + 2 * nkv) * hd && qn.len() >= hd && kn.len() >= hd, "attn_prep: proj");
        ensure!(qbuf.len() >= nh * hd && kc.len() == vc.len() && kc.len() % (nkv * hd) == 0, "attn_prep: bufs");
        let d = [nh, nkv, hd, rd].map(|v| v as i32);
        let mut l = self.launcher(&self.f.attn_prep);
        l.arg(proj).arg(qn).arg(kn).arg(pos).arg(&d[0]).arg(&d[1]).arg(&d[2]).arg(&d[3]).arg(&theta).arg(&eps);
        l.arg(&*qbuf).arg(&*kc).arg(&*vc);
        // SAFETY: matches attn_prep in attention.cu; the caller keeps *pos below the cache capacity
        // (kc.len() / (nkv*hd) rows, enforced by the sequence before each step).
        unsafe { l.launch(cfg(((nh + nkv) as u32, 1), hd as u32, 0)) }?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode(
        &self,
        qbuf: &CudaSlice<f32>,
        kc: &impl DevBuf<u16>,
        vc: &impl DevBuf<u16>,
        pos: &CudaSlice<i32>,
        (nh, nkv, hd): (usize, usize, usize),
        nsplit: usize,
        part: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(hd <= 256 && hd % 8 == 0 && nh % nkv == 0 && nh / nkv <= 32 && nsplit >= 1, "attn_decode: dims");
        ensure!(qbuf.len() >= nh * hd && part.len() >= nh * nsplit * (hd + 2), "attn_decode: buffers");
        let scale = 1.0 / (hd as f32).sqrt();
        let d = [nh, nkv, hd].map(|v| v as i32);
        // one warp per kv-head key range for all its q heads (K/V read once) where the group fits in 8
        let per_kv = nh / nkv <= 8;
        let f = if per_kv { &self.f.attn_decode_kv } else { &self.f.attn_decode };
        let mut l = self.launcher(f);
        l.arg(qbuf).arg(kc).arg(vc).arg(pos).arg(&d[0]).arg(&d[1]).arg(&d[2]).arg(&scale).arg(&*part);
        let threads = if per_kv { 128 } else { 32 * (nh / nkv) as u32 };
        // SAFETY: matches attn_decode / attn_decode_kv (4 warps, static smem) in attention.cu; hd <= 256 and
        // the group (<= 8 for attn_decode_kv) checked above; keys 0..=*pos are inside the cache (see attn_prep).
        unsafe { l.launch(cfg((nkv as u32, nsplit as u32), threads, 0)) }?;
        Ok(())
    }

    pub fn attn_combine(
        &self,
        part: &CudaSlice<f32>,
        proj: &CudaSlice<f32>,
        nh: usize,
        hd: usize,
        nsplit: usize,
        o: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(
            nsplit <= 1024
                && hd <= 1024
                && part.len() >= nh * nsplit * (hd + 2)
                && proj.len() >= 2 * nh * hd
                && o.len() >= nh * hd,
            "attn_combine"
        );
        let (ns, hdi) = (nsplit as i32, hd as i32);
        let mut l = self.launcher(&self.f.attn_combine);
        l.arg(part).arg(proj).arg(&ns).arg(&hdi).arg(&*o);
        // SAFETY: matches attn_combine in attention.cu; shapes checked above; 1024 threads = 1024/hd groups of hd.
        unsafe { l.launch(cfg((nh as u32, 1), 1024, 0)) }?;
        Ok(())
    }

    pub fn embed(&self, m: &QMat, tok: &CudaSlice<i32>, x: &mut CudaSlice<f32>) -> Result<()> {
        ensure!(m.bits == 4 && m.cols % 8 == 0 && x.len() >= m.cols && !tok.is_empty(), "embed: shapes");
        let (cols, gs) = (m.cols as i32, m.gs as i32);
        let mut l = self.launcher(&self.f.embed_q4);
        l.arg(&m.w).arg(&m.s).arg(&m.b).arg(&cols).arg(&gs).arg(tok).arg(&*x);
        // SAFETY: matches embed_q4 in misc.cu; token ids are checked against the vocabulary on the host or come
        // from argmax over the vocabulary.
        unsafe { l.launch(cfg((m.cols.div_ceil(256) as u32, 1), 256, 0)) }?;
        Ok(())
    }

    /// Number of partial blocks used by [`Gpu::argmax`].
    pub fn argmax_blocks(&self) -> usize {
        (self.sms * 2) as usize
    }

    /// tok = argmax(v); pos += 1.
    pub fn argmax(
        &self,
        v: &CudaSlice<f32>,
        pv: &mut CudaSlice<f32>,
        pi: &mut CudaSlice<i32>,
        tok: &mut CudaSlice<i32>,
        pos: &mut CudaSlice<i32>,
    ) -> Result<()> {
        let nb = self.argmax_blocks();
        ensure!(pv.len() >= nb && pi.len() >= nb && !tok.is_empty() && !pos.is_empty(), "argmax: shapes");
        let (n, nbi) = (v.len() as i32, nb as i32);
        let mut l = self.launcher(&self.f.argmax_partial);
        l.arg(v).arg(&n).arg(&*pv).arg(&*pi);
        // SAFETY: matches argmax_partial in misc.cu; pv/pi hold one slot per block.
        unsafe { l.launch(cfg((nb as u32, 1), 256, 0)) }?;
        let mut l = self.launcher(&self.f.argmax_final);
        l.arg(&*pv).arg(&*pi).arg(&nbi).arg(&*tok).arg(&*pos);
        // SAFETY: matches argmax_final in misc.cu; one thread reads nb partials.
        unsafe { l.launch(cfg((1, 1), 32, 0)) }?;
        Ok(())
    }

    pub fn fill_random_u32(&self, p: &mut CudaSlice<u32>, seed: u64) -> Result<()> {
        let n = p.len() as i64;
        let mut l = self.launcher(&self.f.fill_u32_hash);
        l.arg(&*p).arg(&n).arg(&seed);
        // SAFETY: writes exactly p.len() elements.
        unsafe { l.launch(cfg((self.sms * 8, 1), 256, 0)) }?;
        Ok(())
    }

    pub fn fill_bf16(&self, p: &mut impl DevBuf<u16>, v: f32) -> Result<()> {
        let n = p.len() as i64;
        let mut l = self.launcher(&self.f.fill_bf16);
        l.arg(&*p).arg(&n).arg(&v);
        // SAFETY: writes exactly p.len() bf16 values.
        unsafe { l.launch(cfg((self.sms * 8, 1), 256, 0)) }?;
        Ok(())
    }

    pub fn fill_uniform(&self, p: &mut CudaSlice<f32>, seed: u64, lo: f32, hi: f32) -> Result<()> {
        let n = p.len() as i64;
        let mut l = self.launcher(&self.f.fill_f32_uniform);
        l.arg(&*p).arg(&n).arg(&seed).arg(&lo).arg(&hi);
        // SAFETY: writes exactly p.len() f32 values.
        unsafe { l.launch(cfg((self.sms * 8, 1), 256, 0)) }?;
        Ok(())
    }
}

/// Keep device memory that is freed (a finished sequence, a dropped prefix-cache snapshot) in the device's default
/// memory pool, where cudarc's stream-ordered allocations come from, instead of returning it to the driver at every
/// synchronisation (the pool's default release threshold is 0): the next sequence's buffers then come from the pool
/// without mapping new memory. Allocation still fails with an error once the device is full.
fn keep_freed_memory(ordinal: i32) -> Result<()> {
    let dev = cudarc::driver::result::device::get(ordinal)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on a valid device (its context was just created): the default pool's handle is
    // written to `pool`; the release-threshold attribute reads one u64 through the pointer.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, dev).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()?;
    }
    Ok(())
}

/// The kernels that take up to [`SMEM_MAX`] of dynamic shared memory (the attribute is set once, at load).
pub(crate) fn big_smem_kernels(f: &Funcs) -> Vec<&CudaFunction> {
    vec![
        &f.gemm_q4_store,
        &f.gemm_q4_add,
        &f.gemm_q4_swiglu,
        &f.gemm_q4_gstore,
        &f.gemm_q4_store_mma,
        &f.gemm_q4_add_mma,
        &f.gemm_q4_swiglu_mma,
        &f.gemm_q4_gstore_mma,
        &f.gdn_chunk_prep,
        &f.gdn_chunk_state,
        &f.gdn_chunk_out,
        &f.flash_prefill_hd256,
        &f.flash_prefill_hd128,
        &f.flash_prefill_hd64,
        &f.moe_gate_up_seqs_w1,
        &f.moe_gate_up_seqs_w2,
        &f.moe_down_seqs_w1,
        &f.moe_down_seqs_w2,
        &f.moe_gate_up_ring_t4,
        &f.moe_gate_up_ring_t8,
        &f.moe_down_ring_t4,
        &f.moe_down_ring_t8,
        &f.dense_seqs_w1_k1,
        &f.dense_seqs_w2_k1,
        &f.dense_seqs_w1_k4,
        &f.dense_seqs_w2_k4,
        &f.dense_ring_n1,
        &f.dense_ring_n2,
        &f.dense_ring_n4,
        &f.dense_ring_n8,
        &f.dense_tma_n1,
        &f.dense_tma_n2,
        &f.dense_tma_n4,
        &f.gdn_step_seqs,
        &f.gdn_verify_seqs,
        &f.gdn_commit_seqs,
    ]
}
