//! Choosing the backend and loading a model for `run`, `chat` and `serve`.

use std::sync::Arc;

use anyhow::{bail, Result};
use tern_engine::Model;
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
    let model = if use_cuda {
        // Quantised on load exactly as Model::load_cpu does; the kernels take 4-bit (and 8-bit) weights only.
        let w = Weights::load_with(&dir, LoadOptions { quantize: true })?;
        let opts = tern_cuda::seq::CudaOptions { max_context: ctx };
        Model::with_backend(&dir, Arc::new(tern_cuda::CudaBackend::new(&w, opts)?))?
    } else {
        Model::load_cpu(&dir)?
    };
    eprintln!("tern: {} on {}", dir.display(), model.backend.name());
    Ok(model)
}
