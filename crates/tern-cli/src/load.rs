//! Choosing the backend and loading a model for `run`, `chat` and `serve`.

use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::{bail, Result};
use tern_engine::Model;
use tern_model::{LoadOptions, Weights};

use tern_server::cli::Load;

use crate::hub::resolve_model;

/// The checkpoint tern is built for, served when no `--model` is given.
pub const DEFAULT_MODEL: &str = "mlx-community/Qwen3.6-35B-A3B-4bit";

/// Resolve `model` (directory or Hugging Face id) and load it on `backend`: `cpu`, `cuda`, or `auto` (CUDA
/// when this build has kernels and a device answers, else CPU). `ctx` is the context of one sequence, `state` the
/// bytes of the CUDA state pool (None: the default, see `CudaOptions::state_memory`), `speculative` the drafts a
/// step (0: off; the log says when it cannot be on).
pub fn load_model(what: &Load) -> Result<Model> {
    let Load { model, backend, ctx, state, speculative } = what.clone();
    let (model, backend) = (model.as_str(), backend.as_str());
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
        let opts = tern_cuda::seq::CudaOptions {
            state_memory: state,
            speculative: speculative > 0,
            ..tern_cuda::seq::CudaOptions::with_context(ctx)
        };
        let t0 = std::time::Instant::now();
        let tty = std::io::stderr().is_terminal();
        let mut shown = usize::MAX;
        let mut progress = |done: usize, n: usize| {
            let pct = 100 * done / n.max(1);
            // a bar redrawn in place on a terminal; a line per 25% in a log
            if tty {
                let bar = "#".repeat(pct / 4) + &" ".repeat(25 - pct / 4);
                eprint!("\rtern: uploading weights [{bar}] {pct:>3}% ({done}/{n} layers)");
            } else if pct / 25 != shown {
                shown = pct / 25;
                eprintln!("tern: uploading weights {pct}% ({done}/{n} layers)");
            }
        };
        let be = tern_cuda::CudaBackend::new_with_progress(&w, opts, &mut progress)?;
        let (bytes, secs) = (be.model.gpu.uploaded.load(Ordering::Relaxed) as f64, t0.elapsed().as_secs_f64());
        let derived = be.model.gpu.derived.load(Ordering::Relaxed) as f64;
        if tty {
            eprintln!();
        }
        eprintln!(
            "tern: weights on the GPU: {:.2} GB in {secs:.1} s ({:.1} GB/s, CUDA context start included), and {:.2} GB \
             of tile-major expert copies for the batched step",
            bytes / 1e9,
            bytes / 1e9 / secs.max(1e-9),
            derived / 1e9
        );
        eprintln!("tern: {}", capacity_line(&be, ctx));
        if speculative > 0 && w.mtp.is_none() {
            let why = w.mtp_off_reason().unwrap_or_else(|| "the model has no MTP block".into());
            eprintln!("tern: speculative decoding is off: {why}");
        }
        Model::with_backend(&dir, Arc::new(tern_cuda::CudaSlots::new(be)))?
    } else {
        Model::load_cpu_with(&dir, speculative > 0)?
    };
    eprintln!("tern: {} on {}", dir.display(), model.backend.name());
    if speculative > 0 && model.backend.max_drafts() > 0 {
        let k = speculative.min(model.backend.max_drafts());
        eprintln!("tern: speculative decoding: the MTP block drafts {k} tokens a step");
    }
    Ok(model)
}

/// The state pool's size, what a sequence takes from it, and how many fit (the startup log's sizing line).
fn capacity_line(be: &tern_cuda::CudaBackend, ctx: usize) -> String {
    let pool = &be.model.pool;
    let bytes = pool.limit_pages().saturating_mul(pool.page_bytes());
    let at = |tokens| tern_cuda::DeviceState::bytes_at(&be.model, ctx, tokens);
    let (short, full) = (at(2048), at(ctx));
    let gb = |v: usize| v as f64 / 1e9;
    let fit = |b: tern_cuda::seq::StateBytes| bytes / (b.kv + b.gdn).max(1);
    // a pool set larger than the device has: pages are created as needed, so requests wait once memory runs out
    let over = match be.model.gpu.ctx.mem_get_info() {
        Ok((free, _)) if bytes > free => {
            format!(" (more than the {:.1} GB free: past that, requests wait for memory or are refused)", gb(free))
        }
        _ => String::new(),
    };
    format!(
        "state pool {:.1} GB (--state-mib){over} in {} MiB pages: a sequence takes {:.0} MB of Gated DeltaNet state \
         and {:.0} KB of KV cache a token (+{:.1} MB of step buffers); room for {} sequences of up to 2,048 tokens, \
         {} of {ctx}, {} tokens in one",
        gb(bytes),
        pool.page_bytes() >> 20,
        full.gdn as f64 / 1e6,
        full.kv as f64 / ctx.max(1) as f64 / 1e3,
        full.step as f64 / 1e6,
        fit(short),
        fit(full),
        be.tokens_that_fit(),
    )
}
