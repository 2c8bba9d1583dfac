//! `tern bench`: batch-1 greedy prefill and decode speed on the CPU, each decode figure beside its bandwidth
//! ceiling (bytes a decoded token must read / the measured memory bandwidth).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde_json::{json, Value};
use tern_engine::{read_logits, Backend, CpuBackend, Output, Sample, Verify, Want, Work};
use tern_model::mlx::QuantSpec;
use tern_model::random::RandomValues;
use tern_model::weights::{Linear, Mixer};
use tern_model::{Config, LayerKind, LoadOptions, Weights};
use tern_text::SamplingParams;

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
    /// Also decode with speculative decoding, this many drafts a step (1-4; the model's MTP block drafts): tokens a
    /// step, each draft position's acceptance, the verify step's time beside a plain step, and tokens/s. Random
    /// weights accept almost nothing; `tern random-model --mtp-accept P` writes a model that accepts a chosen share.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=4))]
    pub speculative: u64,
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
        "cuda" if args.speculative > 0 => return spec_cuda(&args),
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
    let w = std::sync::Arc::new(w);
    let k = args.speculative as usize;
    if k > 0 && w.mtp.is_none() {
        bail!("--speculative: {}", w.mtp_off_reason().unwrap_or_else(|| "the model has no MTP block".into()));
    }
    let drafting = CpuBackend::new(w.clone()).speculative(true);
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
        let mut row = json!({
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
        if k > 0 {
            spec_once(&drafting, &prompt, k, 8)?; // warm-up
            let runs = (0..args.repeats)
                .map(|_| spec_once(&drafting, &prompt, k, DECODE_STEPS))
                .collect::<Result<Vec<_>>>()?;
            let mid = runs.len() / 2;
            let mut by_time: Vec<&Spec> = runs.iter().collect();
            by_time.sort_by(|a, b| a.secs.total_cmp(&b.secs));
            let r = by_time[mid];
            let (tps, per_step) = (r.tokens as f64 / r.secs, r.tokens as f64 / r.steps as f64);
            let verify_ms = 1e3 * r.secs / r.steps as f64;
            let plain_ms = 1e3 * decode_s / DECODE_STEPS as f64;
            let accept: Vec<f64> =
                r.accepted.iter().zip(&r.checked).map(|(a, c)| *a as f64 / (*c).max(1) as f64).collect();
            row["speculative"] = json!({
                "drafts": k, "tokens_per_step": per_step, "acceptance_by_position": accept,
                "verify_step_ms": verify_ms, "plain_step_ms": plain_ms, "tok_s": tps, "speedup": tps / decode_tps,
            });
            if !args.json {
                let acc: Vec<String> = accept.iter().map(|a| format!("{a:.2}")).collect();
                println!(
                    "            speculative, {k} drafts: {per_step:.2} tokens a step (acceptance by position {}) | \
                     verify step {verify_ms:.2} ms, plain {plain_ms:.2} ms | {tps:>7.2} tok/s = {:.2}x plain",
                    acc.join(" / "),
                    tps / decode_tps
                );
            }
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

/// `--speculative K --backend cuda`: per context, plain greedy decoding through the backend's step (the batch-1
/// graph) beside speculative decoding through the one-forward pass with its verify rows and the MTP block on the
/// device (a second backend over the same weights), as the CPU rows report them.
fn spec_cuda(args: &Args) -> Result<()> {
    let k = args.speculative as usize;
    let max_ctx = args.ctx.iter().max().copied().unwrap_or(0) + DECODE_STEPS + 2 * (k + 1) + 64;
    let Some(m) = &args.model else {
        bail!("--speculative needs --model: random weights have no MTP block that agrees with the model (write one with `tern random-model --mtp-accept`)")
    };
    let w = Weights::load_with(&resolve_model(m)?, LoadOptions { quantize: true })?;
    if w.mtp.is_none() {
        bail!("--speculative: {}", w.mtp_off_reason().unwrap_or_else(|| "the model has no MTP block".into()));
    }
    let opts = tern_cuda::seq::CudaOptions::with_context(max_ctx);
    let be = tern_cuda::CudaBackend::new(&w, opts)?;
    let spec_opts = tern_cuda::seq::CudaOptions { speculative: true, ..opts };
    let drafting = tern_cuda::CudaSlots::new(tern_cuda::CudaBackend { model: be.model.clone(), opts: spec_opts });
    let plain = tern_cuda::CudaSlots::new(be);
    for &ctx in &args.ctx {
        let prompt = prompt_ids(ctx, w.config.vocab_size);
        greedy_once(&plain, &prompt, 1)?;
        let runs = (0..args.repeats).map(|_| greedy_once(&plain, &prompt, DECODE_STEPS)).collect::<Result<Vec<_>>>()?;
        let decode_s = median(runs.iter().map(|r| r.1).collect());
        let decode_tps = DECODE_STEPS as f64 / decode_s;
        spec_once(&drafting, &prompt, k, 8)?; // warm-up
        let runs =
            (0..args.repeats).map(|_| spec_once(&drafting, &prompt, k, DECODE_STEPS)).collect::<Result<Vec<_>>>()?;
        let mut by_time: Vec<&Spec> = runs.iter().collect();
        by_time.sort_by(|a, b| a.secs.total_cmp(&b.secs));
        let r = by_time[runs.len() / 2];
        let (tps, per_step) = (r.tokens as f64 / r.secs, r.tokens as f64 / r.steps as f64);
        let accept: Vec<String> =
            r.accepted.iter().zip(&r.checked).map(|(a, c)| format!("{:.2}", *a as f64 / (*c).max(1) as f64)).collect();
        println!(
            "ctx {ctx:>6}: plain decode {decode_tps:>7.1} tok/s ({:.3} ms a step) | speculative, {k} drafts: {per_step:.2} \
             tokens a step (acceptance by position {}) | verify step {:.3} ms | {tps:>7.1} tok/s = {:.2}x plain",
            1e3 * decode_s / DECODE_STEPS as f64,
            accept.join(" / "),
            1e3 * r.secs / r.steps as f64,
            tps / decode_tps
        );
    }
    Ok(())
}

/// One greedy run through the backend's step with device argmax draws (batch 1): (seconds to the first token,
/// seconds for `steps` decode steps).
fn greedy_once(b: &dyn Backend, prompt: &[u32], steps: usize) -> Result<(f64, f64)> {
    let seq = b.alloc(prompt.len() + steps + 1)?;
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let limit = b.vocab_size();
    let draw = |ids: &[u32]| -> Result<u32> {
        let s = Sample { params: &greedy, seed: 0, history: &[], top_logprobs: None, limit, mask: None };
        match b.step(&[Work { seq, ids, out: Want::Sample(s) }]).pop() {
            Some(Ok(Output::Token(t))) => Ok(t.token),
            Some(Ok(o)) => bail!("the backend returned {o:?} for a draw"),
            Some(Err(e)) => Err(e),
            None => bail!("the backend returned no result"),
        }
    };
    let t0 = Instant::now();
    let run = (|| {
        let mut next = draw(prompt)?;
        let ttft = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 0..steps {
            next = draw(&[next])?;
        }
        Ok((ttft, t1.elapsed().as_secs_f64()))
    })();
    b.free(seq);
    run
}

/// What one speculative run measured.
struct Spec {
    /// Tokens produced, verify steps, and their seconds.
    tokens: usize,
    steps: usize,
    secs: f64,
    /// Per draft position: drafts checked and accepted.
    checked: Vec<usize>,
    accepted: Vec<usize>,
}

/// One greedy run with `k` drafts a step through the backend's verify items (batch 1), until `tokens` tokens.
fn spec_once(b: &dyn Backend, prompt: &[u32], k: usize, tokens: usize) -> Result<Spec> {
    let seq = b.alloc(prompt.len() + tokens + k + 1)?;
    let run = (|| {
        let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
        let limit = b.vocab_size();
        let draws = |n: usize| -> Vec<Sample> {
            (0..n)
                .map(|_| Sample { params: &greedy, seed: 0, history: &[], top_logprobs: None, limit, mask: None })
                .collect()
        };
        let verify = |ids: &[u32], rows: usize| -> Result<(Vec<u32>, Vec<u32>)> {
            let out = Want::Verify(Verify { draws: draws(rows), drafts: k });
            match b.step(&[Work { seq, ids, out }]).pop() {
                Some(Ok(Output::Drafted { tokens, drafts })) => Ok((tokens.iter().map(|s| s.token).collect(), drafts)),
                Some(Ok(o)) => bail!("the backend returned {o:?} for a verify"),
                Some(Err(e)) => Err(e),
                None => bail!("the backend returned no result"),
            }
        };
        let (first, mut drafts) = verify(prompt, 1)?;
        let mut last = first.last().copied().context("no first token")?;
        let mut s = Spec { tokens: 0, steps: 0, secs: 0.0, checked: vec![0; k], accepted: vec![0; k] };
        let t0 = Instant::now();
        while s.tokens < tokens {
            let ids: Vec<u32> = std::iter::once(last).chain(drafts.iter().copied()).collect();
            let (got, next) = verify(&ids, ids.len())?;
            for j in 0..drafts.len() {
                s.checked[j] += 1;
                s.accepted[j] += (j + 1 < got.len()) as usize;
            }
            s.tokens += got.len();
            s.steps += 1;
            last = got.last().copied().context("a verify drew nothing")?;
            drafts = next;
        }
        s.secs = t0.elapsed().as_secs_f64();
        Ok(s)
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
