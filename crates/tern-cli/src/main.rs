//! `tern`: the command line. Thin: every subcommand parses its arguments and calls a library.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::Value;
use tern_engine::{read_logits, Backend, CpuBackend};
use tern_model::safetensors::{self, Dtype};
use tern_model::Weights;

mod bench;
mod chat;
mod hub;
mod load;
mod quantize;
mod text;

#[derive(Parser)]
#[command(name = "tern", version, about = "An inference engine for Qwen3.6-35B-A3B")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Quantise a Hugging Face checkpoint to the mlx-community 4-bit layout.
    Quantize(quantize::Args),
    /// Download a model from Hugging Face into the local cache (or find it there) and print its directory.
    Pull(hub::Args),
    /// Prefill and decode speed (batch 1, greedy) beside the memory-bandwidth ceiling.
    Bench(bench::Args),
    /// Answer one prompt, streaming the answer to stdout (reasoning on stderr).
    Run(chat::RunArgs),
    /// An interactive chat in the terminal.
    Chat(chat::GenArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(text::TokenizeArgs),
    /// Print the text of token ids.
    Detokenize(text::DetokenizeArgs),
    /// Perplexity of a text file.
    Perplexity(text::PerplexityArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(tern_server::cli::Args),
    /// Write the logits of a sequence of token ids (one f32 tensor `logits` [n_ids, vocab]).
    Logits {
        /// Model directory (config.json + safetensors).
        #[arg(long)]
        model: PathBuf,
        /// Token ids separated by spaces or commas.
        #[arg(long)]
        ids: String,
        /// Output safetensors file.
        #[arg(long)]
        out: PathBuf,
        /// Prefill the first K ids, then decode the rest one token at a time.
        #[arg(long)]
        split: Option<usize>,
        /// cpu (the f32 reference) or cuda (4-bit weights: a bf16 checkpoint is quantised on load).
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// cpu: quantise a bf16 checkpoint to 4-bit on load, as the cuda backend does (compare like with like).
        #[arg(long)]
        quantize: bool,
    },
    /// Write a random checkpoint of a config in the official layout.
    RandomModel {
        /// config.json, or a directory holding one.
        #[arg(long)]
        config: PathBuf,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Storage dtype: bf16, f16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Copy tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json from here.
        #[arg(long)]
        tokenizer_from: Option<PathBuf>,
        /// Write the mlx 4-bit layout instead (`q4`; --dtype is then ignored).
        #[arg(long, value_parser = ["q4"])]
        quant: Option<String>,
        /// Override a text_config field, e.g. `--set hidden_size=64 --set num_hidden_layers=4` (JSON values).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Instead of plain random weights, a model built to measure speculative decoding: greedy decoding follows
        /// a fixed cycle through the ordinary token ids, and the MTP block's first draft is right (the token the
        /// model then produces) with probability FIRST, each later chained draft, after a right one, with
        /// probability LATER (default FIRST). Per-position acceptance is FIRST, FIRST·LATER, …: `0.8,0.5375`
        /// gives the published 0.80 / 0.43, in expectation (each id draws once: a run of m verifies measures each
        /// within about sqrt(p(1-p)/m), ±0.08 over `tern bench`'s 64 tokens). The layers still compute everything
        /// (full speed) but add nothing to the residual stream; config.json records the construction. Needs an MTP
        /// layer and a wide enough hidden size (for the real vocabulary ≥ 384 with one probability, ≥ 832 with
        /// two); see tern_model::random::Construction.
        #[arg(long, value_name = "FIRST[,LATER]")]
        mtp_accept: Option<tern_model::random::MtpAccept>,
    },
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Quantize(a) => quantize::run(a),
        Cmd::Pull(a) => hub::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Run(a) => chat::run(a),
        Cmd::Chat(a) => chat::chat(a),
        Cmd::Tokenize(a) => text::tokenize(a),
        Cmd::Detokenize(a) => text::detokenize(a),
        Cmd::Perplexity(a) => text::perplexity(a),
        Cmd::Serve(a) => tern_server::cli::main(a, load::load_model),
        Cmd::Logits { model, ids, out, split, backend, quantize } => {
            logits(&model, &ids, &out, split, &backend, quantize)
        }
        Cmd::RandomModel { config, out, dtype, seed, tokenizer_from, set, quant, mtp_accept } => {
            let dtype = quant.as_deref().unwrap_or(&dtype);
            random_model(&config, &out, dtype, seed, tokenizer_from.as_deref(), &set, mtp_accept)
        }
    }
}

fn parse_ids(s: &str, vocab: usize) -> Result<Vec<u32>> {
    let ids = s
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().with_context(|| format!("--ids: {t:?} is not a token id")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--ids: no token ids given");
    }
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("--ids: token id {bad} is outside the vocabulary (size {vocab})");
    }
    Ok(ids)
}

/// Weights of `dir` for `tern logits`: as stored, or quantised on load (group 64, or 32 where 64 does not divide
/// a matrix's columns, as in the tiny test models) when `quantize`. mlx checkpoints are used as stored.
fn logits_weights(dir: &Path, quantize: bool) -> Result<Weights> {
    let root: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json"))
            .with_context(|| format!("cannot read {}/config.json", dir.display()))?,
    )?;
    if !quantize || tern_model::mlx::QuantSpec::from_config(&root)?.is_some() {
        return Weights::load(dir);
    }
    let config = tern_model::Config::from_dir(dir)?;
    let gs = if config.hidden_size % 64 == 0 && config.moe_intermediate_size % 64 == 0 { 64 } else { 32 };
    let spec = tern_model::mlx::QuantSpec::recipe(&config, 4, gs);
    let ckpt = tern_model::safetensors::Checkpoint::open(dir)?;
    Weights::from_values(config, &tern_model::mlx::HfValues::new(&ckpt)?, Some(&spec))
}

fn logits(model: &Path, ids: &str, out: &Path, split: Option<usize>, backend: &str, quantize: bool) -> Result<()> {
    let t0 = Instant::now();
    let cuda = match backend {
        "cpu" => false,
        "cuda" => true,
        b => bail!("--backend {b}: expected cpu or cuda"),
    };
    let w = logits_weights(model, quantize || cuda)?;
    let ids = parse_ids(ids, w.config.vocab_size)?;
    let n = ids.len();
    let k = split.unwrap_or(n);
    if k == 0 || k > n {
        bail!("--split {k}: must be between 1 and the number of ids ({n})");
    }
    eprintln!("loaded {} in {:.2}s", model.display(), t0.elapsed().as_secs_f64());
    let t1 = Instant::now();
    let vocab = w.config.vocab_size;
    let be: Box<dyn Backend> = if cuda {
        let opts = tern_cuda::seq::CudaOptions::with_context(n + 1);
        Box::new(tern_cuda::CudaSlots::new(tern_cuda::CudaBackend::new(&w, opts)?))
    } else {
        Box::new(CpuBackend::new(w))
    };
    let seq = be.alloc(n)?;
    let mut rows = read_logits(&*be, seq, &ids[..k], true)?;
    for &id in &ids[k..] {
        rows.extend(read_logits(&*be, seq, &[id], true)?);
    }
    eprintln!("{n} positions ({k} prefilled, {} decoded) on {backend} in {:.2}s", n - k, t1.elapsed().as_secs_f64());
    safetensors::write_f32(out, &[("logits", &[n, vocab], &rows)])?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

fn random_model(
    config: &Path,
    out: &Path,
    dtype: &str,
    seed: u64,
    tok: Option<&Path>,
    set: &[String],
    mtp_accept: Option<tern_model::random::MtpAccept>,
) -> Result<()> {
    let path = if config.is_dir() { config.join("config.json") } else { config.to_path_buf() };
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut cfg: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    for kv in set {
        let (k, v) = kv.split_once('=').with_context(|| format!("--set {kv}: expected KEY=VALUE"))?;
        let v: Value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_owned()));
        let target = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
        target[k] = v;
        // An explicit layer count without explicit layer types: derive them from full_attention_interval.
        if k == "num_hidden_layers" && !set.iter().any(|s| s.starts_with("layer_types=")) {
            if let Some(o) = target.as_object_mut() {
                o.remove("layer_types");
            }
        }
    }
    let t0 = Instant::now();
    if dtype == "q4" {
        tern_model::random::write_random_mlx_with(&cfg, out, seed, tok, mtp_accept)?;
    } else {
        let dtype = match dtype {
            "bf16" | "bfloat16" => Dtype::BF16,
            "f16" | "float16" => Dtype::F16,
            "f32" | "float32" => Dtype::F32,
            d => bail!("--dtype {d}: expected bf16, f16 or f32"),
        };
        tern_model::random::write_random_model_with(&cfg, out, dtype, seed, tok, mtp_accept)?;
    }
    eprintln!("wrote {} in {:.1}s", out.display(), t0.elapsed().as_secs_f64());
    if let Some(a) = mtp_accept {
        eprintln!(
            "constructed MTP: first drafts right with probability {}, later drafts (after a right one) {}",
            a.first, a.later
        );
    }
    Ok(())
}
