//! `tern bench --backend cuda`: prefill (time to first token) and decode speed on the GPU beside their ceilings, and
//! per-kernel profiles.

use anyhow::{Context, Result};
use cudarc::driver::sys;
use tern_model::{Config, LayerKind};

use crate::gpu::{Gpu, TraceRec};
use crate::model::DMixer;
use crate::seq::{step_plan, LState, Profile, StepOp};
use crate::CudaBackend;

const BW: f64 = 4.3e12;
/// Timed decode steps per context after the prefill.
const DECODE_STEPS: usize = 64;

/// Bytes of a 4-bit `rows x cols` matrix: half a byte a weight, a bf16 scale and bias per 64 columns.
fn q4(rows: usize, cols: usize) -> usize {
    rows * cols / 2 + rows * cols / 64 * 4
}

/// Synthetic prompt: `((i * 2654435761) mod 2^32) mod vocab` (the CPU bench's ids).
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ((i.wrapping_mul(2654435761) % (1 << 32)) % vocab as u64) as u32).collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `tern bench --backend cuda` on `be`: per context, from an empty sequence, one timed prefill of the whole prompt
/// (time to the first token: ids up, every layer, the last position's logits and argmax, the id back) and then
/// `DECODE_STEPS` graph-replayed decode steps at that depth; medians over `repeats`. Prefill is shown beside its
/// compute ceiling (FLOPs / `peak_tflops`, a bf16 GEMM rate measured on the card), decode beside its bandwidth
/// ceiling (bytes moved per token / 4.3 TB/s, the H200's measured device-to-device copy rate). Then a per-kernel
/// profile of one prefill at the largest context up to 4,096 and of one decode step at 4,096 and 32,768 tokens
/// (CUDA events around each op); with `trace`, the in-kernel trace of one decode step at the first context.
pub fn bench(be: &CudaBackend, ctxs: &[usize], repeats: usize, trace: bool, peak_tflops: f64) -> Result<()> {
    anyhow::ensure!(!ctxs.is_empty() && repeats > 0, "bench needs at least one context and one repeat");
    let m = &be.model;
    let (g, c) = (m.gpu.clone(), &m.config);
    let max_ctx = ctxs.iter().max().copied().unwrap_or(0) + DECODE_STEPS + 8;
    anyhow::ensure!(
        max_ctx <= be.opts.max_context,
        "--ctx {} needs a backend with {max_ctx} tokens of context",
        max_ctx - DECODE_STEPS - 8
    );
    println!("{} SMs; prefill chunk {} tokens", g.sms, m.prefill.lock().map(|p| p.chunk).unwrap_or(0));
    let mut seq = be.new_cuda_sequence()?;
    let n_attn = c.layer_types.iter().filter(|k| **k == LayerKind::Full).count();
    let n_gdn = c.layer_types.len() - n_attn;
    let wbytes = m.weight_bytes_per_token();
    let gdn_state = 2 * n_gdn * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    println!(
        "weights read per decoded token {:.1} MB, GDN state r+w {:.1} MB",
        wbytes as f64 / 1e6,
        gdn_state as f64 / 1e6
    );
    // warm-up: buffers, modules, the decode graph
    let warm = prompt_ids(ctxs[0].clamp(2, 512), c.vocab_size);
    seq.st.reset(&g)?;
    seq.st.prefill(m, &warm, false, false)?;
    seq.st.step_graph(m)?;
    g.stream.synchronize()?;
    println!(
        "{:>8} {:>9} {:>10} {:>8} {:>10} {:>6} | {:>9} {:>9} {:>9} {:>6}",
        "ctx", "TTFT ms", "prefill/s", "TFLOP/s", "ceil t/s", "%", "us/token", "decode/s", "ceil t/s", "%"
    );
    let fl = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    for &ctx in ctxs {
        let prompt = prompt_ids(ctx, c.vocab_size);
        let (mut ttft, mut dec) = (Vec::new(), Vec::new());
        let mut last_tok = 0;
        for _ in 0..repeats {
            seq.st.reset(&g)?;
            g.stream.synchronize()?;
            let t0 = std::time::Instant::now();
            seq.st.prefill(m, &prompt, false, false)?;
            last_tok = g.download(&seq.st.tok)?[0];
            ttft.push(t0.elapsed().as_secs_f64());
            let a = g.stream.record_event(fl)?;
            for _ in 0..DECODE_STEPS {
                seq.st.step_graph(m)?;
            }
            let b = g.stream.record_event(fl)?;
            dec.push(a.elapsed_ms(&b)? as f64 * 1e3 / DECODE_STEPS as f64);
        }
        let (t, us) = (median(&mut ttft), median(&mut dec));
        let flops = prefill_flops(c, m, 0, ctx);
        let pceil = ctx as f64 / (flops / (peak_tflops * 1e12));
        let kv = n_attn * (ctx + DECODE_STEPS / 2) * c.num_key_value_heads * c.head_dim * 2 * 2;
        let dceil = BW / (wbytes + gdn_state + kv) as f64;
        let (ptps, dtps) = (ctx as f64 / t, 1e6 / us);
        println!(
            "{ctx:>8} {:>9.1} {ptps:>10.0} {:>8.1} {pceil:>10.0} {:>5.1}% | {us:>9.1} {dtps:>9.1} {dceil:>9.0} {:>5.1}%",
            t * 1e3,
            flops / t / 1e12,
            100.0 * ptps / pceil,
            100.0 * dtps / dceil
        );
        anyhow::ensure!((last_tok as usize) < c.vocab_size, "prefill's greedy token {last_tok} outside the vocabulary");
    }
    println!("(prefill ceiling: FLOPs / {peak_tflops:.0} TFLOP/s; decode ceiling: bytes / 4.3 TB/s)");
    // the prefill's GEMMs on mma.sync against wgmma (Gpu::gemm_wgmma), the same binary, median TTFT
    let (mut ab, was) = (Vec::new(), g.gemm_wgmma.load(std::sync::atomic::Ordering::Relaxed));
    for &ctx in ctxs {
        let prompt = prompt_ids(ctx, c.vocab_size);
        let mut ms = [0.0; 2];
        for (on, ms) in [false, true].into_iter().zip(ms.iter_mut()) {
            g.gemm_wgmma.store(on, std::sync::atomic::Ordering::Relaxed);
            let mut t = Vec::new();
            for _ in 0..repeats {
                seq.st.reset(&g)?;
                g.stream.synchronize()?;
                let t0 = std::time::Instant::now();
                seq.st.prefill(m, &prompt, false, false)?;
                g.stream.synchronize()?;
                t.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            *ms = median(&mut t);
        }
        ab.push(format!("{ctx}: {:.1} -> {:.1} ms", ms[0], ms[1]));
    }
    g.gemm_wgmma.store(was, std::sync::atomic::Ordering::Relaxed);
    println!("prefill GEMMs, mma.sync -> wgmma (TTFT): {}", ab.join(", "));
    // where a prefill's time goes: at the largest context up to 4,096 and at the smallest
    let big = ctxs.iter().copied().filter(|&x| x <= 4096).max().unwrap_or(ctxs[0]);
    let small = ctxs.iter().copied().min().unwrap_or(big);
    for pctx in if small < big { vec![big, small] } else { vec![big] } {
        seq.st.reset(&g)?;
        let mut p = Profile::default();
        seq.st.prefill_profiled(m, &prompt_ids(pctx, c.vocab_size), false, false, Some(&mut p))?;
        let total: f64 = p.ops.iter().map(|o| o.1).sum();
        println!("prefill profile ({pctx} tokens, events around each kernel family): {total:.2} ms");
        for (name, ms, n) in &p.ops {
            println!("  {name:<26} {n:>5} calls {ms:>9.3} ms {:>5.1}%", 100.0 * ms / total);
        }
    }
    if trace {
        seq.st.set_len(&g, ctxs[0])?;
        seq.st.step_graph(m)?;
        g.trace_enable(true)?;
        seq.st.set_len(&g, ctxs[0])?;
        seq.st.step_graph(m)?;
        g.stream.synchronize()?;
        g.trace_enable(false)?;
        print_trace(&g.trace_read()?, c)?;
    }
    for pctx in [4096usize, 32768] {
        if pctx + 2 >= max_ctx {
            continue;
        }
        seq.st.set_len(&g, pctx)?;
        seq.st.step_plain(m, None)?;
        let mut p = Profile::default();
        seq.st.set_len(&g, pctx)?;
        seq.st.step_plain(m, Some(&mut p))?;
        let total: f64 = p.ops.iter().map(|o| o.1).sum();
        println!("decode profile (non-graph, ctx {pctx}): sum of kernel times {:.1} us", total * 1e3);
        for (name, ms, n) in &p.ops {
            println!("  {name:<14} {:>5} calls {:>9.1} us {:>5.1}%", n, ms * 1e3, 100.0 * ms / total);
        }
    }
    kernel_times(be, &mut seq.st, 32768.min(max_ctx - 2))?;
    drop(seq);
    bench_batched(be, BATCH_CTX, repeats, trace)?;
    Ok(())
}

/// The model's pass buffers, where the bench sets whether batched passes run as CUDA graphs
/// ([`crate::workspace::PrefillBuffers::graphs`]) and which kernel family their graphs leave out (`omit`).
fn buffers(m: &crate::model::DeviceModel) -> Result<std::sync::MutexGuard<'_, crate::workspace::PrefillBuffers>> {
    m.prefill.lock().map_err(|_| anyhow::anyhow!("prefill buffers poisoned"))
}

/// Context of every sequence in the batched decode table.
const BATCH_CTX: usize = 512;
/// Batch sizes of the batched decode table.
const BATCHES: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// Median over `repeats` runs (after one to warm up: buffers, modules, graphs) of 8 batched steps of the first `b`
/// sequences at `ctx` tokens each, in ms a step.
fn step_ms(
    m: &crate::model::DeviceModel,
    seqs: &mut [crate::seq::DeviceState],
    b: usize,
    ctx: usize,
    ids: &[u32],
    want: &[crate::forward::RowWant],
    repeats: usize,
) -> Result<f64> {
    let g = &m.gpu;
    let fl = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::new();
    for rep in 0..=repeats {
        let mut refs: Vec<&mut crate::seq::DeviceState> = seqs.iter_mut().take(b).collect();
        for s in refs.iter_mut() {
            s.set_len(g, ctx)?;
        }
        let a = g.stream.record_event(fl)?;
        for _ in 0..8 {
            m.decode_seqs(&mut refs, ids, want)?;
        }
        let z = g.stream.record_event(fl)?;
        if rep > 0 {
            times.push(a.elapsed_ms(&z)? as f64 / 8.0);
        }
    }
    Ok(median(&mut times))
}

/// Batched decode (`DeviceModel::decode_seqs`, one token for each of B sequences per step) at `ctx` tokens of context
/// each: median step time over `repeats` runs of 8 steps, tokens/s = B / step, beside the bandwidth ceiling of a step
/// (the non-expert weights and lm_head once, the distinct experts the B tokens route to — expected for uniform
/// routing, 1 - (1 - k/E)^B of them — once each, every sequence's GDN state read and written and its KV read, at 4.3
/// TB/s); then per-kernel profiles of one step at 8 and 32 sequences.
pub fn bench_batched(be: &CudaBackend, ctx: usize, repeats: usize, trace: bool) -> Result<()> {
    use crate::batch::MAX_SEQS;
    use crate::forward::{Draw, RowWant};
    use crate::seq::DeviceState;
    let m = &be.model;
    let (g, c) = (m.gpu.clone(), &m.config);
    let bmax = BATCHES.iter().copied().filter(|&b| b <= MAX_SEQS).max().unwrap_or(1);
    let mut seqs = Vec::with_capacity(bmax);
    for s in 0..bmax {
        let mut st = DeviceState::new(m, ctx + 16)?;
        let ids: Vec<u32> =
            prompt_ids(ctx, c.vocab_size).iter().map(|&t| (t + s as u32) % c.vocab_size as u32).collect();
        st.prefill(m, &ids, false, false)?;
        seqs.push(st);
    }
    let n_attn = c.layer_types.iter().filter(|k| **k == LayerKind::Full).count();
    let n_gdn = c.layer_types.len() - n_attn;
    let (h, k, e) = (c.hidden_size, c.num_experts_per_tok, c.num_experts);
    let i = c.moe_intermediate_size;
    let expert = q4(2 * i, h) + q4(h, i);
    let layers = c.layer_types.len();
    // weights every step reads once: all but the routed experts (weight_bytes_per_token counts k of them)
    let dense = m.weight_bytes_per_token() - layers * k * expert;
    let gdn_state = 2 * n_gdn * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    let kv = n_attn * ctx * c.num_key_value_heads * c.head_dim * 2 * 2;
    println!("batched decode, {ctx} tokens of context per sequence (DeviceModel::decode_seqs, a CUDA graph per batch");
    println!("size); greedy, sampled on the GPU at temperature 0.7, top-p 0.95, top-k 20, and greedy without graphs:");
    println!(
        "{:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>10} {:>6}",
        "seqs", "ms/step", "tok/s", "sampled/s", "no graph", "experts", "ceil t/s", "%"
    );
    let fl = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let hot = tern_engine::SamplingParams { temperature: 0.7, top_p: 0.95, top_k: 20, ..Default::default() };
    let sample = |r: u64| tern_engine::Sample {
        params: &hot,
        seed: r,
        history: &[],
        top_logprobs: None,
        limit: c.vocab_size,
        mask: None,
    };
    let samples: Vec<tern_engine::Sample> = (0..bmax as u64).map(sample).collect();
    for &b in BATCHES.iter().filter(|&&b| b <= bmax) {
        let ids: Vec<u32> = (0..b as u32).map(|r| (r * 7919 + 3) % c.vocab_size as u32).collect();
        let greedy = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b];
        let sampled: Vec<RowWant> =
            samples[..b].iter().map(|s| RowWant { logits: false, draw: Draw::Sample(s) }).collect();
        let mut ms = [0.0; 3];
        for ((want, graphs), ms) in [(&greedy, true), (&sampled, true), (&greedy, false)].into_iter().zip(ms.iter_mut())
        {
            buffers(m)?.graphs = graphs;
            *ms = step_ms(m, &mut seqs, b, ctx, &ids, want, repeats)?;
        }
        let distinct = e as f64 * (1.0 - (1.0 - k as f64 / e as f64).powi(b as i32));
        let bytes = dense as f64 + layers as f64 * distinct * expert as f64 + b as f64 * (gdn_state + kv) as f64;
        let ceil = b as f64 * BW / bytes;
        let (tps, sps, nps) = (b as f64 * 1e3 / ms[0], b as f64 * 1e3 / ms[1], b as f64 * 1e3 / ms[2]);
        println!(
            "{b:>6} {:>10.3} {tps:>10.0} {sps:>10.0} {nps:>9.0} {distinct:>9.1} {ceil:>10.0} {:>5.1}%",
            ms[0],
            100.0 * tps / ceil
        );
    }
    buffers(m)?.graphs = true;
    println!("(ceiling: bytes per step / 4.3 TB/s; experts: expected distinct routed experts per layer)");
    // the same binary with a kernel choice off, then on (each setting's graphs captured afresh), greedy with graphs:
    // the streamed experts through the shared-memory ring kernels or the register-streamed ones (Gpu::moe_ring; the
    // same results bit for bit)
    let mut ab = |flag: &std::sync::atomic::AtomicBool, sizes: &[usize]| -> Result<String> {
        let was = flag.load(std::sync::atomic::Ordering::Relaxed);
        let mut out: Vec<String> = Vec::new();
        for &b in sizes.iter().filter(|&&b| b <= bmax) {
            let ids: Vec<u32> = (0..b as u32).map(|r| (r * 7919 + 3) % c.vocab_size as u32).collect();
            let want = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b];
            let mut ms = [0.0; 2];
            for (on, ms) in [false, true].into_iter().zip(ms.iter_mut()) {
                flag.store(on, std::sync::atomic::Ordering::Relaxed);
                buffers(m)?.seqs = None;
                *ms = step_ms(m, &mut seqs, b, ctx, &ids, &want, repeats)?;
            }
            out.push(format!("B = {b}: {:.3} -> {:.3} ms", ms[0], ms[1]));
        }
        flag.store(was, std::sync::atomic::Ordering::Relaxed);
        buffers(m)?.seqs = None;
        Ok(out.join(", "))
    };
    println!("streamed experts, register-streamed -> ring kernels (ms a step): {}", ab(&g.moe_ring, &[1, 8, 32, 64])?);
    let tma_was = g.dense_tma.swap(false, std::sync::atomic::Ordering::Relaxed);
    println!("dense products, register-streamed -> ring (ms a step): {}", ab(&g.dense_ring, &[1, 8, 32, 64])?);
    g.dense_tma.store(tma_was, std::sync::atomic::Ordering::Relaxed);
    println!("dense products, ring -> bulk copies (ms a step): {}", ab(&g.dense_tma, &[1, 2, 4, 8, 16, 32, 64])?);
    println!("top-k and align, two launches -> one (ms a step): {}", ab(&g.topk_align, &[1, 2, 4, 8])?);
    // per-kernel-family profiles of one step at 8 and 32 sequences, side by side
    let sizes: Vec<usize> = [8, 32].into_iter().filter(|&b| b <= bmax).collect();
    let mut profiles = Vec::new();
    for &b in &sizes {
        let mut refs: Vec<&mut DeviceState> = seqs.iter_mut().take(b).collect();
        for s in refs.iter_mut() {
            s.set_len(&g, ctx)?;
        }
        let ids: Vec<u32> = (0..b as u32).map(|r| (r * 7919 + 3) % c.vocab_size as u32).collect();
        let want = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b];
        let mut p = Profile::default();
        m.decode_seqs_profiled(&mut refs, &ids, &want, Some(&mut p), None)?;
        profiles.push(p);
    }
    let totals: Vec<String> = sizes
        .iter()
        .zip(&profiles)
        .map(|(b, p)| format!("{b} sequences {:.2} ms", p.ops.iter().map(|o| o.1).sum::<f64>()))
        .collect();
    println!("batched decode profile (events around each kernel family; ms per step): {}", totals.join(", "));
    if let Some(first) = profiles.first() {
        for (name, _, n) in &first.ops {
            let cols: Vec<String> = profiles
                .iter()
                .map(|p| p.ops.iter().find(|o| o.0 == *name).map_or("-".into(), |o| format!("{:>9.3}", o.1)))
                .collect();
            println!("  {name:<32} {n:>5} calls {}", cols.join(" "));
        }
    }
    // each family's cost inside the graph: the step's graph with that family's launches left out, against the whole
    // (the events above also count each launch's own gap; this is what the family adds to the replayed step)
    let names: Vec<String> = profiles.first().map(|p| p.ops.iter().map(|o| o.0.clone()).collect()).unwrap_or_default();
    let mut cols = Vec::new();
    for &b in &sizes {
        let ids: Vec<u32> = (0..b as u32).map(|r| (r * 7919 + 3) % c.vocab_size as u32).collect();
        let want = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b];
        let mut step = |omit: Option<&String>| -> Result<f64> {
            let mut times = Vec::new();
            for rep in 0..=repeats.max(2) {
                let mut refs: Vec<&mut DeviceState> = seqs.iter_mut().take(b).collect();
                for s in refs.iter_mut() {
                    s.set_len(&g, ctx)?;
                }
                // a whole step first: what a left-out family would have written (tile lists, rows) is this size's
                buffers(m)?.omit = None;
                m.decode_seqs(&mut refs, &ids, &want)?;
                buffers(m)?.omit = omit.cloned();
                let a = g.stream.record_event(fl)?;
                for _ in 0..8 {
                    m.decode_seqs(&mut refs, &ids, &want)?;
                }
                let z = g.stream.record_event(fl)?;
                buffers(m)?.omit = None;
                if rep > 0 {
                    times.push(a.elapsed_ms(&z)? as f64 / 8.0);
                }
            }
            Ok(median(&mut times))
        };
        let whole = step(None)?;
        let mut col = vec![whole];
        for name in &names {
            col.push(whole - step(Some(name))?);
        }
        cols.push(col);
    }
    buffers(m)?.omit = None;
    buffers(m)?.seqs = None; // the extra graphs
    if !cols.is_empty() {
        let head: Vec<String> = sizes.iter().zip(&cols).map(|(b, c)| format!("{b} seqs {:.3} ms", c[0])).collect();
        println!(
            "batched decode step in the graph, less each kernel family left out (ms per step): {}",
            head.join(", ")
        );
        for (i, name) in names.iter().enumerate() {
            let v: Vec<String> = cols.iter().map(|c| format!("{:>9.3}", c[i + 1])).collect();
            println!("  {name:<32} {}", v.join(" "));
        }
    }
    dense_ab(m)?;
    if trace {
        for &b in &sizes {
            let ids: Vec<u32> = (0..b as u32).map(|r| (r * 7919 + 3) % c.vocab_size as u32).collect();
            let want = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b];
            let mut step = || -> Result<()> {
                let mut refs: Vec<&mut DeviceState> = seqs.iter_mut().take(b).collect();
                for s in refs.iter_mut() {
                    s.set_len(&g, ctx)?;
                }
                m.decode_seqs(&mut refs, &ids, &want)?;
                Ok(())
            };
            step()?; // the graph of this size, captured untraced
            g.stream.synchronize()?;
            g.trace_enable(true)?;
            step()?;
            g.stream.synchronize()?;
            g.trace_enable(false)?;
            println!("trace of one batched step at {b} sequences (graph replay; us):");
            let recs = g.trace_read()?;
            print_batched_trace(&recs)?;
            print_block_spread(&recs, 43, "moe_gate_up")?;
            print_block_spread(&recs, 44, "moe_down")?;
        }
    }
    let b = 32.min(bmax);
    let want = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b];
    // the first tokens of 32 users who send 80-token prompts at once: one prefill after another, or one pass
    let prompts: Vec<Vec<u32>> = (0..b as u64)
        .map(|r| prompt_ids(80, c.vocab_size).iter().map(|&t| (t + r as u32 * 3) % c.vocab_size as u32).collect())
        .collect();
    let mut times = [Vec::new(), Vec::new()];
    for _ in 0..repeats {
        for s in seqs.iter_mut().take(b) {
            s.reset(&g)?;
        }
        g.stream.synchronize()?;
        let t0 = std::time::Instant::now();
        for (s, p) in seqs.iter_mut().zip(&prompts) {
            s.prefill(m, p, false, false)?;
            g.download(&s.tok)?;
        }
        times[0].push(t0.elapsed().as_secs_f64() * 1e3);
        for s in seqs.iter_mut().take(b) {
            s.reset(&g)?;
        }
        g.stream.synchronize()?;
        let t0 = std::time::Instant::now();
        let mut refs: Vec<&mut DeviceState> = seqs.iter_mut().take(b).collect();
        let chunks: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
        m.prefill_seqs(&mut refs, &chunks, &want)?;
        times[1].push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let [one, all] = times.map(|mut t| median(&mut t));
    println!(
        "first tokens of {b} prompts of 80 tokens (prefill and draw, ids back): one prefill after another {one:.1} ms, \
         one multi-sequence pass {all:.1} ms"
    );
    mixed_steps(m, &mut seqs, ctx, repeats)?;
    pool_costs(be, repeats)
}

/// A step while a prompt is read: B decodes and a prompt chunk of P tokens, as two passes (the decode pass, then
/// the one-sequence prefill: what the backend ran before the one forward) against one forward over all the rows
/// ([`crate::DeviceModel::forward_seqs`]); wall ms of the step, ids back, median over `repeats`.
fn mixed_steps(
    m: &crate::model::DeviceModel,
    seqs: &mut [crate::seq::DeviceState],
    ctx: usize,
    repeats: usize,
) -> Result<()> {
    use crate::forward::{Draw, RowWant};
    use crate::seq::DeviceState;
    let (g, c) = (&m.gpu, &m.config);
    let chunk = buffers(m)?.chunk;
    println!("a step with a prompt chunk of P tokens beside B decodes ({ctx} tokens of context): two passes (decodes,");
    println!("then the prefill) -> one forward, ms a step:");
    for p in [512usize, 2048].into_iter().filter(|&p| p <= chunk) {
        let mut prompt_seq = DeviceState::new(m, p + 16)?;
        let prompt: Vec<u32> = prompt_ids(p, c.vocab_size);
        let mut line = Vec::new();
        let have = seqs.len();
        // the prompt is a pass's sequence too: at most MAX_SEQS - 1 decodes beside it
        let most = have.min(crate::batch::MAX_SEQS - 1);
        for b in [16usize, 64, 128, 255].into_iter().filter(|&b| b <= most) {
            let ids: Vec<u32> = (0..b as u32).map(|r| (r * 7919 + 3) % c.vocab_size as u32).collect();
            let want = vec![RowWant { logits: false, draw: Draw::Argmax(c.vocab_size) }; b + 1];
            let mut times = [Vec::new(), Vec::new()];
            for rep in 0..=repeats {
                for (way, t) in times.iter_mut().enumerate() {
                    prompt_seq.reset(g)?;
                    let mut refs: Vec<&mut DeviceState> = seqs.iter_mut().take(b).collect();
                    for s in refs.iter_mut() {
                        s.set_len(g, ctx)?;
                    }
                    g.stream.synchronize()?;
                    let t0 = std::time::Instant::now();
                    if way == 0 {
                        m.decode_seqs(&mut refs, &ids, &want[..b])?;
                        prompt_seq.prefill(m, &prompt, false, false)?;
                        g.download(&prompt_seq.tok)?;
                    } else {
                        refs.push(&mut prompt_seq);
                        let rows: Vec<&[u32]> =
                            ids.iter().map(std::slice::from_ref).chain([prompt.as_slice()]).collect();
                        m.forward_seqs(&mut refs, &rows, &want)?;
                    }
                    if rep > 0 {
                        t.push(t0.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            let [two, one] = times.map(|mut t| median(&mut t));
            line.push(format!("B = {b}: {two:.1} -> {one:.1}"));
        }
        println!("  P = {p}: {}", line.join(", "));
    }
    Ok(())
}

/// The batched step's dense products alone (50 launches in one graph, us a launch): `dense_seqs` (8-token tiles,
/// exact codes) against the prefill's `gemm_q4` (128-token tiles, weights dequantised once per tile) at n rows, for
/// the first GDN and attention layer's matrices and the lm_head.
fn dense_ab(m: &crate::model::DeviceModel) -> Result<()> {
    let g = &m.gpu;
    let gdn = m.layers.iter().find_map(|l| match &l.mixer {
        DMixer::Gdn { proj, out, .. } => Some([("gdn in_proj", proj), ("gdn out_proj", out)]),
        _ => None,
    });
    let attn = m.layers.iter().find_map(|l| match &l.mixer {
        DMixer::Attn { qkv, o, .. } => Some([("attn qkv", qkv), ("attn o_proj", o)]),
        _ => None,
    });
    let mats: Vec<(&str, &crate::gpu::QMat)> =
        gdn.into_iter().flatten().chain(attn.into_iter().flatten()).chain([("lm_head", &m.lm_head)]).collect();
    let ns = [1usize, 8, 16, 32, 64];
    println!(
        "dense products alone (us a launch, 50 in a graph): dense_seqs (as the step takes it) / ring / \
         register-streamed / gemm_q4 at n = 1 / 8 / 16 / 32 / 64; then the ring kernel with its columns in 1 / 2 / 4 / \
         8 ranges | the bulk-copy kernel (dense_tma) with 1 / 2 / 3 ring slots (- where it does not fit)"
    );
    let ring = |on: bool| g.dense_ring.store(on, std::sync::atomic::Ordering::Relaxed);
    let tma = |on: bool| g.dense_tma.store(on, std::sync::atomic::Ordering::Relaxed);
    let was = g.dense_ring.load(std::sync::atomic::Ordering::Relaxed);
    let tma_was = g.dense_tma.load(std::sync::atomic::Ordering::Relaxed);
    for (name, q) in mats {
        let mut x = g.zeros::<u16>(64 * q.cols)?;
        g.fill_bf16(&mut x, 0.01)?;
        let mut y = g.zeros::<f32>(64 * q.rows)?;
        let reps = if q.rows > 100_000 { 8 } else { 50 };
        let (mut cells, mut ways) = (Vec::new(), Vec::new());
        for &n in &ns {
            ring(true);
            tma(true);
            let a = graph_time(g, reps, &mut || g.dense_seqs(q, &x, n, &mut y, q.rows, false))?;
            tma(false);
            let r = graph_time(g, reps, &mut || g.dense_seqs(q, &x, n, &mut y, q.rows, false))?;
            ring(false);
            let b = graph_time(g, reps, &mut || g.dense_seqs(q, &x, n, &mut y, q.rows, false))?;
            let c = graph_time(g, reps, &mut || g.gemm_q4(q, &x, n, &mut y, q.rows, false))?;
            cells.push(format!("{a:>6.1} /{r:>6.1} /{b:>6.1} /{c:>6.1}"));
            let mut w = Vec::new();
            for kz in [1, 2, 4, 8] {
                w.push(match g.dense_ring(q, &x, n, &mut y, q.rows, false, kz) {
                    Ok(()) => format!(
                        "{:.1}",
                        graph_time(g, reps, &mut || g.dense_ring(q, &x, n, &mut y, q.rows, false, kz))?
                    ),
                    Err(_) => "-".to_string(),
                });
            }
            let mut t = Vec::new();
            for sl in [1, 2, 3] {
                t.push(match g.dense_tma(q, &x, n, &mut y, q.rows, false, sl) {
                    Ok(()) => {
                        format!("{:.1}", graph_time(g, reps, &mut || g.dense_tma(q, &x, n, &mut y, q.rows, false, sl))?)
                    }
                    Err(_) => "-".to_string(),
                });
            }
            ways.push(format!("{} | {}", w.join("/"), t.join("/")));
        }
        println!("  {name:<13} {:>6} x {:>5}  {}", q.rows, q.cols, cells.join("   "));
        println!("  {:<28} {}", "", ways.join("   "));
    }
    ring(was);
    tma(tma_was);
    Ok(())
}

/// What a sequence's memory costs the host (crate::pool): a new sequence with room for 208 tokens (an 80-token
/// prompt and 128 to generate), mapped afresh and from a parked range; a fork of one holding 4,100 tokens (fewer if
/// the context is smaller: the recurrent state and the partial pages copied, the rest shared) and of one holding
/// 200 (a prefix-cache snapshot of a short reply); a free; each until the stream is idle; medians of 20.
fn pool_costs(be: &CudaBackend, repeats: usize) -> Result<()> {
    let (m, g) = (&be.model, &be.model.gpu);
    let n = 20 * repeats.max(1);
    let ctx = be.opts.max_context;
    let held = 4100.min(ctx.saturating_sub(209));
    let mut src = crate::seq::DeviceState::with_room(m, ctx, held + 208)?;
    src.set_len(g, held)?;
    let mut short = crate::seq::DeviceState::with_room(m, ctx, 208)?;
    short.set_len(g, 200)?;
    let [mut fresh, mut new, mut fork, mut snap, mut free] = [(); 5].map(|_| Vec::new());
    let time = |v: &mut Vec<f64>, t0: std::time::Instant| v.push(t0.elapsed().as_secs_f64() * 1e3);
    for _ in 0..n {
        m.pool.release_parked();
        let t0 = std::time::Instant::now();
        let a = crate::seq::DeviceState::with_room(m, ctx, 208)?;
        g.stream.synchronize()?;
        time(&mut fresh, t0);
        drop(a); // parked
        let t0 = std::time::Instant::now();
        let a = crate::seq::DeviceState::with_room(m, ctx, 208)?;
        g.stream.synchronize()?;
        time(&mut new, t0);
        let t0 = std::time::Instant::now();
        let b = src.fork(m, held)?;
        g.stream.synchronize()?;
        time(&mut fork, t0);
        drop(b);
        let t0 = std::time::Instant::now();
        let c = short.fork(m, 200)?;
        g.stream.synchronize()?;
        time(&mut snap, t0);
        let t0 = std::time::Instant::now();
        drop(a);
        drop(c);
        free.push(t0.elapsed().as_secs_f64() * 1e3 / 2.0);
    }
    m.pool.release_parked();
    let [fresh, new, fork, snap, free] = [fresh, new, fork, snap, free].map(|mut t| median(&mut t));
    let l = crate::seq::DeviceState::layout(m, ctx);
    println!(
        "state pool ({} MiB pages, context {ctx}): a new sequence for 208 tokens ({} pages) {fresh:.3} ms mapped \
         afresh, {new:.3} ms from a parked range; a fork at {held} tokens ({} pages shared) {fork:.3} ms, at 200 \
         tokens (a parked range) {snap:.3} ms; a free {free:.3} ms",
        l.page >> 20,
        l.pages_for(208),
        2 * l.kv.len() * l.full_pages(held),
    );
    Ok(())
}

/// Median time of one launch of `f` inside a CUDA graph of `n` back-to-back launches (launch gaps included,
/// unlike the event profile, whose per-op host round trips inflate small kernels).
fn graph_time(g: &Gpu, n: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let s = g.stream.clone();
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let mut r = Ok(());
    for _ in 0..n {
        r = f();
        if r.is_err() {
            break;
        }
    }
    let graph = s.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    r?;
    let graph = graph?.context("empty graph")?;
    graph.launch()?;
    let fl = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut t = Vec::new();
    for _ in 0..5 {
        let a = g.stream.record_event(fl)?;
        graph.launch()?;
        let b = g.stream.record_event(fl)?;
        t.push(a.elapsed_ms(&b)? as f64 * 1e3 / n as f64);
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(t[t.len() / 2])
}

/// Graph-timed cost of each kernel family (one layer of each kind) at context `ctx`, with bytes moved and TB/s.
fn kernel_times(be: &CudaBackend, st: &mut crate::seq::DeviceState, ctx: usize) -> Result<()> {
    let m = &be.model;
    let (g, c) = (&*m.gpu, &m.config);
    let n = 50;
    st.set_len(g, ctx)?;
    println!("graph-timed kernels ({n} back-to-back launches each, ctx {ctx}):");
    // the ops of the first Gated DeltaNet layer and the first attention layer (each with its MoE), then the rest
    let first = |kind| c.layer_types.iter().position(|t| *t == kind);
    let (gi, ai) = (first(LayerKind::Linear), first(LayerKind::Full));
    let shown = |op: &StepOp| match op.layer() {
        None => !matches!(op, StepOp::Argmax),
        Some(l) => {
            Some(l) == gi
                || (Some(l) == ai && !matches!(op, StepOp::RouterTopk(_) | StepOp::GateUp(_) | StepOp::Down(_)))
        }
    };
    for op in step_plan(c).into_iter().filter(shown) {
        let t = graph_time(g, n, &mut || st.launch_op(m, op))?;
        let bytes = op_bytes(m, st, op, ctx);
        println!("  {:<16} {t:>8.2} us {:>8.2} MB {:>6.2} TB/s", op.name(), bytes as f64 / 1e6, bytes as f64 / t / 1e6);
    }
    Ok(())
}

/// Bytes an op of the decode step must read: its weights (4-bit rows: half a byte a weight plus a scale and a bias
/// per 64), the recurrent state read and written, the K/V rows of `ctx + 1` positions; 0 for the small ones.
fn op_bytes(m: &crate::model::DeviceModel, st: &crate::seq::DeviceState, op: StepOp, ctx: usize) -> usize {
    let c = &m.config;
    let (h, i, is, k) =
        (c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size, c.num_experts_per_tok);
    let layer = |l: usize| m.layers.get(l);
    match op {
        StepOp::GdnInProj(l) | StepOp::GdnOutProj(l) | StepOp::AttnQkv(l) | StepOp::AttnOProj(l) => {
            match layer(l).map(|l| &l.mixer) {
                Some(DMixer::Gdn { proj, out, .. }) => {
                    if matches!(op, StepOp::GdnInProj(_)) {
                        proj.bytes()
                    } else {
                        out.bytes()
                    }
                }
                Some(DMixer::Attn { qkv, o, .. }) => {
                    if matches!(op, StepOp::AttnQkv(_)) {
                        qkv.bytes()
                    } else {
                        o.bytes()
                    }
                }
                None => 0,
            }
        }
        StepOp::GdnCore(l) => match st.layers.get(l) {
            Some(LState::Gdn { s, .. }) => 2 * s.len * 4,
            _ => 0,
        },
        StepOp::AttnDecode(_) => (ctx + 1) * c.num_key_value_heads * c.head_dim * 4,
        StepOp::RouterTopk(l) => layer(l).map_or(0, |l| l.router.bytes()),
        StepOp::GateUp(_) => k * q4(2 * i, h) + q4(2 * is, h),
        StepOp::Down(_) => k * q4(h, i) + q4(h, is),
        StepOp::LmHead => m.lm_head.bytes(),
        StepOp::Embed | StepOp::AttnPrep(_) | StepOp::AttnCombine(_) | StepOp::Argmax => 0,
    }
}

/// The records of each launch of a traced step, in wait order: the next `nblocks` records of one code (fewer where
/// the code changes first). Blocks that left before their dependency wait (wait 0: moe_down's blocks past the tile
/// list) are not in any launch ([`print_block_spread`] counts them).
fn trace_groups(recs: &[TraceRec]) -> Vec<Vec<TraceRec>> {
    let mut r: Vec<TraceRec> = recs.iter().filter(|x| x.wait != 0).cloned().collect();
    r.sort_by_key(|x| x.wait);
    let mut out = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let (code, nb) = (r[i].code, r[i].nblocks);
        let mut j = i;
        while j < r.len() && j - i < (nb as usize).max(1) && r[j].code == code && r[j].nblocks == nb {
            j += 1;
        }
        out.push(r[i..j].to_vec());
        i = j;
    }
    out
}

/// One launch of a traced step: its kernel code, blocks, and (ns from the step's first entry) its first entry,
/// first and last dependency wait, last exit, and the longest wait -> mark 1 -> mark 2 -> exit stretches of its
/// marked blocks.
struct TraceLaunch {
    code: u32,
    n: usize,
    pre: u64,
    w0: u64,
    w1: u64,
    end: u64,
    marks: [u64; 3],
}

/// The launches of a traced step: the records in wait order, a launch the next `nblocks` of one code (fewer where
/// the code changes first).
fn trace_launches(recs: &[TraceRec]) -> Result<Vec<TraceLaunch>> {
    anyhow::ensure!(!recs.is_empty(), "trace: no records");
    let t0 = recs.iter().map(|x| x.pre).min().unwrap_or(0);
    let mut launches = Vec::new();
    for g in trace_groups(recs) {
        let code = g[0].code;
        let mut marks = [0u64; 3];
        for x in g.iter().filter(|x| x.m1 > 0 && x.m2 > 0) {
            marks[0] = marks[0].max(x.m1.saturating_sub(x.wait));
            marks[1] = marks[1].max(x.m2.saturating_sub(x.m1));
            marks[2] = marks[2].max(x.end.saturating_sub(x.m2));
        }
        let span = |f: fn(&TraceRec) -> u64, max: bool| {
            let v = g.iter().map(f);
            (if max { v.max() } else { v.min() }).unwrap_or(t0).saturating_sub(t0)
        };
        launches.push(TraceLaunch {
            code,
            n: g.len(),
            pre: span(|x| x.pre, false),
            w0: span(|x| x.wait, false),
            w1: span(|x| x.wait, true),
            end: span(|x| x.end, true),
            marks,
        });
    }
    Ok(launches)
}

/// A traced batched step, per kernel family: launches, and per launch the mean of `gap` (from the previous traced
/// launch's last exit to this one's first wait return: the launch and dependency latency, and any untraced kernel
/// between them), `run` (first wait return to last
/// exit) and `early` (first entry to first wait return: how far its blocks got in before their dependency); gap +
/// run over all launches is the step. Kernels that mark two points (trace_mark) show their blocks' longest stretch
/// from the wait to mark 1, mark 1 to 2 and mark 2 to the exit (means over launches). A launch is the records of one
/// code in wait order, `nblocks` of them.
fn print_batched_trace(recs: &[TraceRec]) -> Result<()> {
    let launches = trace_launches(recs)?;
    // dense_seqs by the traced launch before and after it
    let name = |k: usize| -> &'static str {
        let code_at = |j: Option<usize>| j.and_then(|j| launches.get(j)).map_or(0, |l| l.code);
        match launches[k].code {
            46 => match (code_at(k.checked_sub(1)), code_at(Some(k + 1))) {
                (21, _) => "gdn_out_proj",
                (36, _) => "attn_o_proj",
                (_, 21) => "gdn_in_proj",
                (_, 34) => "attn_qkv",
                _ => "lm_head",
            },
            21 => "gdn_step_seqs",
            34 => "attn_prep_seqs",
            35 => "attn_decode_seqs",
            36 => "attn_combine_seqs",
            43 => "moe_gate_up",
            44 => "moe_down",
            45 => "router_seqs",
            47 => "topk_align_seqs",
            50 => "sample_rows",
            54 => "argmax_rows",
            60 => "rmsnorm_rows",
            61 => "topk_rows",
            62 => "moe_align",
            63 => "moe_combine_norm",
            64 => "gdn_verify_seqs",
            65 => "gdn_commit_seqs",
            _ => "other",
        }
    };
    #[derive(Default)]
    struct Fam {
        name: &'static str,
        launches: u64,
        blocks: usize,
        gap: u64,
        run: u64,
        early: u64,
        marks: [u64; 3],
    }
    let mut fam: Vec<Fam> = Vec::new();
    let mut prev_end = 0;
    for (k, l) in launches.iter().enumerate() {
        let f = name(k);
        let i = match fam.iter().position(|t| t.name == f) {
            Some(i) => i,
            None => {
                fam.push(Fam { name: f, ..Default::default() });
                fam.len() - 1
            }
        };
        let t = &mut fam[i];
        t.launches += 1;
        t.blocks += l.n;
        t.gap += l.w0.saturating_sub(prev_end);
        t.run += l.end.saturating_sub(l.w0);
        t.early += l.w0.saturating_sub(l.pre);
        for q in 0..3 {
            t.marks[q] += l.marks[q];
        }
        prev_end = prev_end.max(l.end);
    }
    println!(
        "  {} launches, {} blocks, {:.1} us from the first entry to the last exit",
        launches.len(),
        recs.len(),
        prev_end as f64 / 1e3
    );
    println!(
        "  {:<18} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>9}",
        "family", "launches", "blocks", "gap", "run", "early", "w-m1", "m1-m2", "m2-end", "total us"
    );
    for t in &fam {
        let per = |v: u64| v as f64 / 1e3 / t.launches as f64;
        println!(
            "  {:<18} {:>8} {:>7} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>9.1}",
            t.name,
            t.launches,
            t.blocks / t.launches as usize,
            per(t.gap),
            per(t.run),
            per(t.early),
            per(t.marks[0]),
            per(t.marks[1]),
            per(t.marks[2]),
            (t.gap + t.run) as f64 / 1e3
        );
    }
    Ok(())
}

/// How the blocks of one traced kernel spread over a step (code `code`): for each launch, every block's stretches
/// from the launch's first wait return (w0): entry, its own wait, wait -> mark 1 (`stage`), mark 1 -> mark 2
/// (`loop`), mark 2 -> exit (`tail`) and its exit, with the launch's working blocks (those that marked) on its
/// multiprocessor. Prints the blocks at ranks of exit time, in us, as means over the launches, then the empty blocks.
fn print_block_spread(recs: &[TraceRec], code: u32, name: &str) -> Result<()> {
    let ranks = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0];
    // per rank: sums of [entry, wait, stage, loop, tail, exit, blocks on its sm], over launches
    let mut sums = vec![[0f64; 7]; ranks.len()];
    let (mut launches, mut working, mut empty, mut empty_exit) = (0usize, 0usize, 0usize, 0f64);
    let mut slowest_sm = Vec::new();
    for g in trace_groups(recs).iter().filter(|g| g[0].code == code) {
        launches += 1;
        let w0 = g.iter().map(|x| x.wait).min().unwrap_or(0) as f64;
        let us = |t: u64| (t as f64 - w0) / 1e3;
        let mut marked: Vec<&TraceRec> = g.iter().filter(|x| x.m1 > 0 && x.m2 > 0).collect();
        for x in g.iter().filter(|x| x.m1 == 0) {
            empty += 1;
            empty_exit += us(x.end);
        }
        working += marked.len();
        marked.sort_by_key(|x| x.end);
        let on_sm = |sm: u32| marked.iter().filter(|y| y.sm == sm).count() as f64;
        for (k, q) in ranks.iter().enumerate() {
            let Some(x) = marked.get(((marked.len().saturating_sub(1)) as f64 * q).round() as usize) else {
                continue;
            };
            let v = [
                us(x.pre),
                us(x.wait),
                (x.m1 as f64 - x.wait as f64) / 1e3,
                (x.m2 as f64 - x.m1 as f64) / 1e3,
                (x.end as f64 - x.m2 as f64) / 1e3,
                us(x.end),
                on_sm(x.sm),
            ];
            for (s, v) in sums[k].iter_mut().zip(v) {
                *s += v;
            }
        }
        if let Some(x) = marked.last() {
            slowest_sm.push(format!("{}:{}x{}", x.sm, x.block & 0xffff, x.block >> 16));
        }
    }
    if launches == 0 {
        return Ok(());
    }
    let n = launches as f64;
    println!(
        "  {name}: blocks by exit time (means over {launches} launches, us from the launch's first wait; {:.0} working \
         blocks a launch)",
        working as f64 / n
    );
    println!(
        "    {:>5} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>6}",
        "rank", "entry", "wait", "stage", "loop", "tail", "exit", "on sm"
    );
    for (q, s) in ranks.iter().zip(&sums) {
        println!(
            "    {:>4.0}% {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>6.2}",
            q * 100.0,
            s[0] / n,
            s[1] / n,
            s[2] / n,
            s[3] / n,
            s[4] / n,
            s[5] / n,
            s[6] / n
        );
    }
    if empty > 0 {
        println!(
            "    {:.0} empty blocks a launch, exit at {:.2} us on average",
            empty as f64 / n,
            empty_exit / empty as f64
        );
    }
    let unwaited = recs.iter().filter(|x| x.code == code && x.wait == 0).count();
    if unwaited > 0 {
        println!("    {:.0} blocks a launch left before their dependency wait (no work)", unwaited as f64 / n);
    }
    println!("    slowest block (sm:x*y) per launch: {}", slowest_sm.join(" "));
    Ok(())
}

/// One traced graph step: per launch (grouped in the order their waits returned), when its first block entered,
/// when its waits returned (first, last), when its last block left; then totals per kernel family, with the
/// slowest block's time from wait to mark 1, mark 1 to mark 2 and mark 2 to exit where the kernel marks them.
fn print_trace(recs: &[TraceRec], c: &Config) -> Result<()> {
    let launches = trace_launches(recs)?;
    let name = |code: u32| match code {
        1 => "embed",
        2 => "argmax_partial",
        3 => "argmax_final",
        10 => "gemv_reg",
        11 => "router_topk",
        12 => "gemv_tma",
        20 => "gdn_step",
        21 => "gdn_step_seqs",
        30 => "attn_prep",
        31 => "attn_decode",
        32 => "attn_decode_kv",
        33 => "attn_combine",
        34 => "attn_prep_seqs",
        35 => "attn_decode_kv_seqs",
        36 => "attn_combine_seqs",
        40 => "moe_topk",
        41 => "moe_gate_up",
        42 => "moe_down",
        43 => "moe_gate_up_seqs",
        44 => "moe_down_seqs",
        45 => "router_seqs",
        46 => "dense_seqs",
        47 => "topk_align_seqs",
        50 => "sample_rows",
        51 => "sample_pre_max",
        52 => "sample_pre_hist",
        53 => "sample_pre_gather",
        54 => "argmax_rows",
        60 => "rmsnorm_rows",
        61 => "topk_rows",
        62 => "moe_align",
        63 => "moe_combine_norm",
        64 => "gdn_verify_seqs",
        65 => "gdn_commit_seqs",
        _ => "?",
    };
    let mut fam: Vec<String> = Vec::new();
    let mut layer = 0usize;
    for TraceLaunch { code, .. } in &launches {
        let f = match code {
            12 | 10 => {
                let prev = fam.last().map(|s| s.as_str()).unwrap_or("");
                match (prev, c.layer_types.get(layer)) {
                    ("gdn_step", _) => "gdn_out_proj",
                    ("attn_combine", _) => "attn_o_proj",
                    (_, Some(LayerKind::Linear)) => "gdn_in_proj",
                    (_, Some(LayerKind::Full)) => "attn_qkv",
                    _ => "lm_head",
                }
            }
            _ => name(*code),
        };
        if *code == 42 {
            layer += 1;
        }
        fam.push(f.to_string());
    }
    println!("trace of one graph step (ns from the first block's entry; wait = griddepcontrol.wait returned):");
    println!(
        "  {:>3} {:<16} {:>6} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "#", "kernel", "blocks", "entry", "wait0", "wait1", "end", "gap", "run", "w-m1", "m1-m2", "m2-end"
    );
    let mut prev_end = 0u64;
    let mut tot: Vec<(String, u64, u64, usize, [u64; 3])> = Vec::new();
    for (k, (l, f)) in launches.iter().zip(&fam).enumerate() {
        let gap = l.w0.saturating_sub(prev_end);
        let run = l.end.saturating_sub(l.w0);
        if k < 16 || k + 3 >= launches.len() || (f.starts_with("attn") && k < 50) {
            println!(
                "  {k:>3} {f:<16} {:>6} {:>9} {:>9} {:>9} {:>9} {gap:>7} {run:>7} {:>7} {:>7} {:>7}",
                l.n, l.pre, l.w0, l.w1, l.end, l.marks[0], l.marks[1], l.marks[2]
            );
        }
        match tot.iter_mut().find(|t| &t.0 == f) {
            Some(t) => {
                t.1 += gap;
                t.2 += run;
                t.3 += 1;
                for j in 0..3 {
                    t.4[j] += l.marks[j];
                }
            }
            None => tot.push((f.clone(), gap, run, 1, l.marks)),
        }
        prev_end = l.end;
    }
    let (sg, sr) = tot.iter().fold((0u64, 0u64), |a, t| (a.0 + t.1, a.1 + t.2));
    println!(
        "  step: {} launches, {:.1} us from first entry to last exit; waits after the previous exit {:.1} us, runs {:.1} us",
        launches.len(),
        prev_end as f64 / 1e3,
        sg as f64 / 1e3,
        sr as f64 / 1e3
    );
    for (f, g, r, n, m) in &tot {
        let per = |v: u64| v as f64 / 1e3 / *n as f64;
        println!(
            "  {f:<16} {n:>4} launches  gap {:>6.2}  run {:>6.2} us/launch (w-m1 {:>5.2} m1-m2 {:>5.2} m2-end {:>5.2})  total {:>7.1} us",
            per(*g),
            per(*r),
            per(m[0]),
            per(m[1]),
            per(m[2]),
            (*g + *r) as f64 / 1e3
        );
    }
    Ok(())
}

/// FLOPs of a prefill of `n` tokens after `pos0` cached ones (matrix products, the chunked GDN and attention;
/// the lm_head for the last token only): the numerator of the compute ceiling.
pub fn prefill_flops(c: &Config, m: &crate::model::DeviceModel, pos0: usize, n: usize) -> f64 {
    let (h, k) = (c.hidden_size as f64, c.num_experts_per_tok as f64);
    let (i, is) = (c.moe_intermediate_size as f64, c.shared_expert_intermediate_size as f64);
    let d = crate::prefill::GdnDims::of(c);
    let nf = n as f64;
    let mut total = 0.0;
    for (l, kind) in m.layers.iter().zip(&c.layer_types) {
        total += match &l.mixer {
            crate::model::DMixer::Gdn { proj, out, .. } => {
                2.0 * nf * (proj.rows * proj.cols + out.rows * out.cols) as f64
            }
            crate::model::DMixer::Attn { qkv, o, .. } => 2.0 * nf * (qkv.rows * qkv.cols + o.rows * o.cols) as f64,
        };
        // router, routed and shared experts
        total += 2.0 * nf * (l.router.rows as f64 * h + k * 3.0 * i * h + 3.0 * is * h);
        total += match kind {
            // per token and value head (multiply-adds): A and P rows 2*64*dk, the triangular solve 32*(dk+dv),
            // [W;Q] S 2*dk*dv, the state update dk*dv, P D 32*dv
            LayerKind::Linear => {
                let (dk, dv) = (d.dk as f64, d.dv as f64);
                2.0 * nf * d.hv as f64 * (128.0 * dk + 32.0 * (dk + dv) + 3.0 * dk * dv + 32.0 * dv)
            }
            LayerKind::Full => {
                let keys = nf * pos0 as f64 + nf * (nf + 1.0) / 2.0;
                4.0 * (c.num_attention_heads * c.head_dim) as f64 * keys
            }
        };
    }
    total + 2.0 * (m.lm_head.rows * m.lm_head.cols) as f64
}
