//! `tern bench --backend cuda`: decode speed on the GPU beside the bandwidth ceiling, and a per-kernel profile.

use anyhow::Result;
use cudarc::driver::sys;
use tern_model::{Config, LayerKind};

use crate::seq::{CudaOptions, Profile};
use crate::CudaBackend;

const BW: f64 = 4.3e12;

/// Decode speed of the full-shape model `c` with random weights generated on the GPU: per context, the median
/// over `repeats` runs of 64 graph-replayed steps after 8 warm-up steps, beside the ceiling (bytes moved per
/// token / 4.3 TB/s, the H200's measured device-to-device copy rate); then a per-kernel-family profile of one
/// non-graph step (CUDA events around each op) at 4,096 and 32,768 tokens of context.
pub fn bench(c: &Config, ctxs: &[usize], repeats: usize) -> Result<()> {
    anyhow::ensure!(!ctxs.is_empty() && repeats > 0, "bench needs at least one context and one repeat");
    let max_ctx = ctxs.iter().max().unwrap() + 256;
    let t0 = std::time::Instant::now();
    let be = CudaBackend::random(c, 1, CudaOptions { max_context: max_ctx })?;
    let m = &be.model;
    let g = m.gpu.clone();
    println!("random model on GPU in {:.1}s; {} SMs", t0.elapsed().as_secs_f64(), g.sms);
    let mut seq = be.new_cuda_sequence()?;
    seq.st.fill_kv(&g)?;
    let n_attn = c.layer_types.iter().filter(|k| **k == LayerKind::Full).count();
    let n_gdn = c.layer_types.len() - n_attn;
    let wbytes = m.weight_bytes_per_token();
    let gdn_state = 2 * n_gdn * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    println!("weights read per token {:.1} MB, GDN state r+w {:.1} MB", wbytes as f64 / 1e6, gdn_state as f64 / 1e6);
    println!("{:>8} {:>10} {:>9} {:>10} {:>9} {:>6}", "ctx", "us/token", "tok/s", "MB/token", "ceil t/s", "%");
    let fl = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    seq.st.set_token(&g, 1)?;
    let mut rows = Vec::new();
    for &ctx in ctxs {
        seq.st.set_len(&g, ctx)?;
        for _ in 0..8 {
            seq.st.step_graph(m)?;
        }
        let mut times = Vec::new();
        for _ in 0..repeats {
            seq.st.set_len(&g, ctx)?;
            let a = g.stream.record_event(fl)?;
            for _ in 0..64 {
                seq.st.step_graph(m)?;
            }
            let b = g.stream.record_event(fl)?;
            times.push(a.elapsed_ms(&b)? as f64 * 1e3 / 64.0);
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let us = times[times.len() / 2];
        let kv = n_attn * (ctx + 32) * c.num_key_value_heads * c.head_dim * 2 * 2;
        let bytes = (wbytes + gdn_state + kv) as f64;
        let ceil = BW / bytes;
        let tps = 1e6 / us;
        println!("{ctx:>8} {us:>10.1} {tps:>9.1} {:>10.1} {ceil:>9.0} {:>5.1}%", bytes / 1e6, 100.0 * tps / ceil);
        rows.push((ctx, us, times));
    }
    let tok = g.download(&seq.st.tok)?;
    println!("last greedy token {} (sanity: inside vocab {})", tok[0], (tok[0] as usize) < c.vocab_size);
    for pctx in [4096usize, 32768] {
        if pctx >= max_ctx {
            continue;
        }
        seq.st.set_len(&g, pctx)?;
        seq.st.step_plain(m, None)?;
        let mut p = Profile::default();
        seq.st.set_len(&g, pctx)?;
        seq.st.step_plain(m, Some(&mut p))?;
        let total: f64 = p.ops.iter().map(|o| o.1).sum();
        println!("profile (non-graph, ctx {pctx}): sum of kernel times {:.1} us", total * 1e3);
        for (name, ms, n) in &p.ops {
            println!("  {name:<14} {:>5} calls {:>9.1} us {:>5.1}%", n, ms * 1e3, 100.0 * ms / total);
        }
    }
    Ok(())
}
