//! `tern bench`: batch-1 greedy prefill and decode speed on the CPU, each decode figure beside its bandwidth
//! ceiling (bytes a decoded token must read / the measured memory bandwidth).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde_json::{json, Value};
use tern_engine::{read_logits, Backend, CpuBackend};
use tern_model::mlx::QuantSpec;
use tern_model::random::RandomValues;
use tern_model::weights::{Linear, Mixer};
use tern_model::{Config, LayerKind, LoadOptions, Weights};

use crate::hub::resolve_model;

/// Timed decode steps per run.
const DECODE_STEPS: usize = 64;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory or Hugging Face id (HF checkpoints are quantised to 4-bit on load).
    #[arg(long, conflicts_with = "random_weights")]
    pub model: Option<String>,
    /// Random 4-bit weights generated in memory for the shape of --config (no disk).
    #[arg(long, requires = "config")]
    pub random_weights: bool,
    /// config.json, or a directory holding one (with --random-weights).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Prompt lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub ctx: Vec<usize>,
    /// Runs per context; the median is reported.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// CUDA: the bf16 tensor-core rate the prefill ceiling divides FLOPs by, TFLOP/s (the default is an 8192^3
    /// bf16 GEMM through PyTorch on the H200 these figures come from: 769-798 on random data).
    #[arg(long, default_value_t = 790.0)]
    pub peak_tflops: f64,
    /// CUDA: also trace one graph step at the first --ctx (per kernel launch: when its blocks entered, when its
    /// dependency wait returned, when it ended; totals per kernel family).
    #[arg(long)]
    pub trace: bool,
}

fn read_config(cfg: &std::path::Path) -> Result<Config> {
    let path = if cfg.is_dir() { cfg.join("config.json") } else { cfg.to_path_buf() };
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
    Config::from_json(&json).with_context(|| format!("in {}", path.display()))
}

pub fn run(args: Args) -> Result<()> {
    if args.repeats == 0 || args.ctx.contains(&0) {
        bail!("--repeats and every --ctx must be positive");
    }
    match args.backend.as_str() {
        "cpu" if args.trace => bail!("--trace traces the CUDA decode step: give --backend cuda"),
        "cpu" => {}
        "cuda" => {
            let max_ctx = args.ctx.iter().max().copied().unwrap_or(0) + 256;
            let opts = tern_cuda::seq::CudaOptions::with_context(max_ctx);
            let t0 = Instant::now();
            let be = match (&args.model, &args.config) {
                (Some(m), _) => {
                    let w = Weights::load_with(&resolve_model(m)?, LoadOptions { quantize: true })?;
                    tern_cuda::CudaBackend::new(&w, opts)?
                }
                (None, Some(cfg)) if args.random_weights => {
                    tern_cuda::CudaBackend::random(&read_config(cfg)?, 1, opts)?
                }
                _ => bail!("give --model DIR_OR_ID, or --random-weights --config CONFIG"),
            };
            eprintln!("model on the GPU in {:.1}s", t0.elapsed().as_secs_f64());
            if args.peak_tflops <= 0.0 {
                bail!("--peak-tflops must be positive");
            }
            return tern_cuda::bench::bench(&be, &args.ctx, args.repeats.max(3), args.trace, args.peak_tflops);
        }
        b => bail!("--backend {b}: expected cpu or cuda"),
    }
    let t0 = Instant::now();
    let w = match (&args.model, &args.config) {
        (Some(m), _) => Weights::load_with(&resolve_model(m)?, LoadOptions { quantize: true })?,
        (None, Some(cfg)) if args.random_weights => {
            let c = read_config(cfg)?;
            let spec = QuantSpec::q4(&c);
            Weights::from_values(c, &RandomValues { seed: 0 }, Some(&spec))?
        }
        _ => bail!("give --model DIR_OR_ID, or --random-weights --config CONFIG"),
    };
    let load_s = t0.elapsed().as_secs_f64();
    let backend = CpuBackend::new(w);
    let w = backend.weights();
    let bw = memory_bandwidth();
    if !args.json {
        eprintln!("weights ready in {load_s:.1}s; memcpy bandwidth {:.1} GB/s (read + write)", bw / 1e9);
    }
    let mut rows = Vec::new();
    for &ctx in &args.ctx {
        let prompt = prompt_ids(ctx, w.config.vocab_size);
        run_once(&backend, &prompt, 1)?; // exact-shape warm-up (prefill of this length, one decode step)
        let runs = (0..args.repeats).map(|_| run_once(&backend, &prompt, DECODE_STEPS)).collect::<Result<Vec<_>>>()?;
        let ttft = median(runs.iter().map(|r| r.0).collect());
        let decode_s = median(runs.iter().map(|r| r.1).collect());
        let bytes = decode_bytes(w, ctx);
        let (prefill_tps, decode_tps) = (ctx as f64 / ttft, DECODE_STEPS as f64 / decode_s);
        let ceiling = bw / bytes as f64;
        let row = json!({
            "ctx": ctx, "ttft_s": ttft, "prefill_tok_s": prefill_tps, "decode_tok_s": decode_tps,
            "decode_bytes_per_token": bytes, "ceiling_tok_s": ceiling, "pct_of_ceiling": 100.0 * decode_tps / ceiling,
        });
        if !args.json {
            println!(
                "ctx {ctx:>6}: prefill {prefill_tps:>8.1} tok/s (TTFT {ttft:.3}s) | decode {decode_tps:>7.2} tok/s | \
                 ceiling {ceiling:>7.2} tok/s ({:.1} MB/token) = {:.1}%",
                bytes as f64 / 1e6,
                100.0 * decode_tps / ceiling
            );
        }
        rows.push(row);
    }
    if args.json {
        let out = json!({
            "backend": "cpu", "threads": rayon::current_num_threads(), "load_s": load_s,
            "memcpy_bandwidth_bytes_s": bw, "decode_steps": DECODE_STEPS, "repeats": args.repeats, "results": rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

/// Synthetic prompt: `((i * 2654435761) mod 2^32) mod vocab`.
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ((i.wrapping_mul(2654435761) % (1 << 32)) % vocab as u64) as u32).collect()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold(0, |b, (i, x)| if *x > v[b] { i } else { b }) as u32
}

/// One greedy run through the backend's step (batch 1): (seconds to the first token, seconds for `steps` decode
/// steps).
fn run_once(b: &CpuBackend, prompt: &[u32], steps: usize) -> Result<(f64, f64)> {
    let seq = b.alloc(prompt.len() + steps)?;
    let t0 = Instant::now();
    let run = (|| {
        let mut next = argmax(&read_logits(b, seq, prompt, false)?);
        let ttft = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 0..steps {
            next = argmax(&read_logits(b, seq, &[next], false)?);
        }
        Ok((ttft, t1.elapsed().as_secs_f64()))
    })();
    b.free(seq);
    run
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Bytes one decoded token reads at context `ctx`: every dense projection, the router and shared expert, top-k
/// routed experts (their mean size), lm_head, one embedding row, the GDN recurrent + conv state (read and
/// written), and the KV cache (f32 on the CPU).
fn decode_bytes(w: &Weights, ctx: usize) -> usize {
    let c = &w.config;
    let mut b = w.lm_head.bytes() + w.embed.bytes() / c.vocab_size;
    let mlp = |m: &tern_model::weights::Mlp| m.gate.bytes() + m.up.bytes() + m.down.bytes();
    let sum = |ls: &[&Linear]| ls.iter().map(|l| l.bytes()).sum::<usize>();
    for (l, kind) in w.layers.iter().zip(&c.layer_types) {
        b += match &l.mixer {
            Mixer::Attention(a) => sum(&[&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]),
            Mixer::DeltaNet(g) => sum(&[&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj]),
        };
        let m = &l.moe;
        let expert_mean = m.experts.iter().map(mlp).sum::<usize>() / m.experts.len().max(1);
        b += sum(&[&m.router, &m.shared_gate]) + mlp(&m.shared) + c.num_experts_per_tok * expert_mean;
        b += match kind {
            LayerKind::Full => 2 * ctx * c.num_key_value_heads * c.head_dim * 4,
            LayerKind::Linear => {
                let s = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
                2 * 4 * (s + (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim())
            }
        };
    }
    b
}

/// Memory bandwidth in bytes/s from the best of several parallel 256 MiB copies (read + write counted).
fn memory_bandwidth() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let chunk = n / rayon::current_num_threads().max(1) / 4;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * n as f64 / best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_ids_follow_the_formula() {
        let ids = prompt_ids(4, 1000);
        assert_eq!(ids, [0, (2654435761u64 % 1000) as u32, ((2 * 2654435761u64) % (1 << 32) % 1000) as u32, ids[3]]);
        assert!(prompt_ids(300, 7).iter().all(|&i| i < 7));
    }
}
