//! The CUDA backend of tern (NVIDIA Hopper, sm_90a): device weights (4-bit stays packed), hand-written kernels
//! (`crates/tern-kernels/cuda/*.cu`), and one forward pass over a flat batch of tokens a step.
//!
//! Modules, bottom up (each imports only from the ones before it; tests/layering.rs keeps it so):
//! - `gpu`: the driver: context, stream, the kernels' handles, safe launches with programmatic dependent launch.
//! - `prefill`, `sample`, `pool`: the multi-token kernels' and the sampler's launch wrappers (each checks shapes before
//!   its launch), and the page pool that holds every sequence's KV cache and recurrent state.
//! - `batch`: the few-row kernels' wrappers (the decode kernels' `_seqs` variants, the streamed dense and expert
//!   products).
//! - `workspace`: the buffers of a forward pass (activation rows, pass tables, decode buffers, captured graphs).
//! - `model`: the weights on the device (and the workspace they are used with).
//! - `seq`: a sequence's state, its batch-1 decode step as a plan and a CUDA graph, the backend's options.
//! - `forward`: the layer written once over a flat batch of rows (`layers_pass`), the one forward a step runs
//!   (`DeviceModel::forward_seqs`), the one-sequence prefill.
//! - `backend` (the engine's seam) and `bench` (`tern bench --backend cuda`).

pub mod backend;
pub mod batch;
pub mod bench;
pub mod forward;
pub mod gpu;
pub mod model;
pub mod pool;
pub mod prefill;
pub mod sample;
pub mod seq;
pub mod workspace;

pub use backend::CudaSlots;
pub use gpu::Gpu;
pub use model::DeviceModel;
pub use seq::{CudaBackend, DeviceState};

/// For GPU tests: `Some(gpu)`, or `None` after printing `NO GPU: <name> not run (no CUDA device)` (a panic instead when
/// `TERN_REQUIRE_CUDA=1`).
pub fn gpu_or_skip(name: &str) -> Option<std::sync::Arc<Gpu>> {
    match Gpu::new() {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("TERN_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("{name}: TERN_REQUIRE_CUDA=1 but no CUDA device: {e:#}");
            }
            println!("NO GPU: {name} not run: no CUDA device ({e:#}); TERN_REQUIRE_CUDA=1 makes this a failure");
            None
        }
    }
}
