//! `tern quantize`: an HF bf16/f16/f32 checkpoint to an mlx-community-layout 4-bit checkpoint, streamed tensor by
//! tensor from the memory-mapped files.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tern_model::mlx::{self, HfValues, QuantSpec};
use tern_model::safetensors::Checkpoint;
use tern_model::Config;

use crate::hub::resolve_model;

#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face checkpoint: a directory or a model id.
    #[arg(long)]
    pub model: String,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Bits of the projections (the router and shared expert gate are always 8-bit).
    #[arg(long, default_value_t = 4)]
    pub bits: u32,
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
}

pub fn run(args: Args) -> Result<()> {
    if !matches!(args.bits, 4 | 8) || !matches!(args.group_size, 32 | 64 | 128) {
        bail!("--bits {} --group-size {}: expected 4 or 8 bits, group size 32, 64 or 128", args.bits, args.group_size);
    }
    let dir = resolve_model(&args.model)?;
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    if QuantSpec::from_config(&json)?.is_some() {
        bail!("{}: already quantised (has a quantization entry)", path.display());
    }
    let config = Config::from_json(&json).with_context(|| format!("in {}", path.display()))?;
    let ckpt = Checkpoint::open(&dir)?;
    let values = HfValues::new(&ckpt)?;
    let spec = QuantSpec::recipe(&config, args.bits, args.group_size);
    let t0 = Instant::now();
    mlx::write_checkpoint(&json, &args.out, &values, &spec, &mut mlx::progress_line("quantize"))?;
    if let Err(e) = tern_model::random::copy_tokenizer_files(&dir, &args.out) {
        eprintln!("warning: {e:#}");
    }
    eprintln!("wrote {} in {:.1}s", args.out.display(), t0.elapsed().as_secs_f64());
    Ok(())
}
