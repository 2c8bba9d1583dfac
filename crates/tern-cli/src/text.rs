//! `tern tokenize`, `tern detokenize` and `tern perplexity`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tern_engine::{read_logits, Backend, CpuBackend};
use tern_model::Weights;
use tern_text::Tokenizer;

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Model directory (its tokenizer.json is used).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, conflicts_with = "text_file")]
    text: Option<String>,
    #[arg(long)]
    text_file: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct DetokenizeArgs {
    #[arg(long)]
    model: PathBuf,
    /// Token ids: a JSON array or ids separated by spaces or commas.
    #[arg(long)]
    ids: String,
}

#[derive(clap::Args)]
pub struct PerplexityArgs {
    #[arg(long)]
    model: PathBuf,
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Tokens per window (each window starts with a fresh state).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
}

fn read_text(text: Option<String>, file: Option<PathBuf>) -> Result<String> {
    match (text, file) {
        (Some(t), None) => Ok(t),
        (None, Some(f)) => std::fs::read_to_string(&f).with_context(|| format!("cannot read {}", f.display())),
        _ => bail!("give exactly one of --text or --text-file"),
    }
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let tok = Tokenizer::from_dir(&a.model)?;
    let ids = tok.encode(&read_text(a.text, a.text_file)?, false)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

pub fn parse_id_list(s: &str) -> Result<Vec<u32>> {
    s.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().with_context(|| format!("{t:?} is not a token id")))
        .collect()
}

pub fn detokenize(a: DetokenizeArgs) -> Result<()> {
    let tok = Tokenizer::from_dir(&a.model)?;
    let ids = parse_id_list(&a.ids).context("--ids")?;
    println!("{}", tok.decode(&ids)?);
    Ok(())
}

/// Perplexity of a text: exp of the mean negative log-likelihood of each token given the ones before it,
/// over consecutive windows of `ctx` tokens.
pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let tok = Tokenizer::from_dir(&a.model)?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let ids = tok.encode(&text, false)?;
    if ids.len() < 2 {
        bail!("{}: needs at least 2 tokens, has {}", a.file.display(), ids.len());
    }
    let backend = CpuBackend::new(Weights::load(&a.model)?);
    let v = backend.vocab_size();
    let t0 = Instant::now();
    let (mut nll, mut count) = (0.0f64, 0usize);
    for window in ids.chunks(a.ctx).filter(|c| c.len() >= 2) {
        let seq = backend.alloc(window.len())?;
        let logits = read_logits(&backend, seq, window, true);
        backend.free(seq);
        let logits = logits?;
        for (t, &next) in window[1..].iter().enumerate() {
            let row = &logits[t * v..(t + 1) * v];
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let lse = m as f64 + row.iter().map(|&l| ((l - m) as f64).exp()).sum::<f64>().ln();
            nll += lse - row[next as usize] as f64;
            count += 1;
        }
    }
    let ppl = (nll / count as f64).exp();
    println!("perplexity {ppl:.4} over {count} tokens ({:.1}s)", t0.elapsed().as_secs_f64());
    Ok(())
}
