//! Choosing the backend and loading a model for `run`, `chat` and `serve`.

use std::sync::Arc;

use anyhow::{bail, Result};
use tern_engine::{Backend, CpuBackend, Model};
use tern_model::{LoadOptions, Weights};

use crate::hub::resolve_model;

/// The checkpoint tern is built for, served when no `--model` is given.
pub const DEFAULT_MODEL: &str = "mlx-community/Qwen3.6-35B-A3B-4bit";

/// Resolve `model` (directory or Hugging Face id) and load it on `backend`: `cpu`, `cuda`, or `auto` (CUDA
/// when this build has kernels and a device answers, else CPU). `ctx` sizes the CUDA KV cache.
pub fn load_model(model: &str, backend: &str, ctx: usize) -> Result<Model> {
    let dir = resolve_model(model)?;
    let use_cuda = match backend {
        "cpu" => false,
        "cuda" => true,
        "auto" => !tern_kernels::CUBINS.is_empty() && tern_cuda::Gpu::new().is_ok(),
        b => bail!("--backend {b}: expected cpu, cuda or auto"),
    };
    // The product runs in 4 bits: a bf16 checkpoint is quantised on load, an mlx one is used as stored.
    let w = Weights::load_with(&dir, LoadOptions { quantize: true })?;
    let backend: Arc<dyn Backend> = if use_cuda {
        Arc::new(tern_cuda::CudaBackend::new(&w, tern_cuda::seq::CudaOptions { max_context: ctx })?)
    } else {
        Arc::new(CpuBackend::new(w))
    };
    eprintln!("tern: {} on {}", dir.display(), backend.name());
    Model::with_backend(&dir, backend)
}
