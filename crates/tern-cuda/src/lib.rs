//! The CUDA backend of tern (NVIDIA Hopper, sm_90a): device weights (4-bit stays packed), one kernel family per
//! decode op (`crates/tern-kernels/cuda/*.cu`), and a decode step captured once in a CUDA graph and replayed:
//! the step reads the token id and the position from device memory and writes the next (greedy) id and
//! position back, so the same graph replays every step. Prompt chunks go through the multi-token kernels instead
//! (tensor-core GEMMs, grouped MoE, chunked Gated DeltaNet, flash attention: `prefill`), which leave the state
//! as the decode steps would. `backend` puts it behind the engine's seam.

pub mod backend;
pub mod batch;
pub mod bench;
pub mod gpu;
pub mod model;
pub mod pool;
pub mod prefill;
pub mod sample;
pub mod seq;

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
