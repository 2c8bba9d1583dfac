//! Correctness evidence for the CUDA backend: every kernel family against the CPU reference (tern-model's
//! f32 forward pass, its per-layer pieces and its quantised kernels) on random non-zero inputs, and the whole
//! decode step against the CPU forward with expert choices held equal (the CPU takes the GPU's routing), judged
//! by transformers' own bf16-vs-f32 distance on the same fixture.
//!
//! Tolerances follow the dtype: pure f32 math ~1e-5 relative (bounds 1e-4 where a GEMV's summation order
//! enters), paths through bf16 (KV cache) ~1e-2. Every measured error is printed.
//!
//! Without a CUDA device each test prints `NO GPU: <name> not run ...` and passes; `TERN_REQUIRE_CUDA=1` turns
//! that into a failure.

use cudarc::driver::CudaSlice;
use tern_cuda::model::DMixer;
use tern_cuda::seq::{CudaOptions, CudaSequence};
use tern_cuda::{gpu_or_skip, CudaBackend, Gpu};
use tern_model::forward::{attention_core, delta_net_core, moe, rms_norm, route};
use tern_model::mlx::QuantSpec;
use tern_model::quant::QuantMatrix;
use tern_model::random::RandomValues;
use tern_model::safetensors::SafeTensors;
use tern_model::testutil::fixtures_dir;
use tern_model::weights::Mixer;
use tern_model::{Config, LayerKind, Logits, State, Weights};

mod common;
use common::*;

fn set_pos(g: &Gpu, pos: &mut CudaSlice<i32>, p: usize) {
    g.stream.memcpy_htod(&[p as i32], pos).unwrap();
}

/// GDN core over consecutive steps: conv-ring update + SiLU + l2norm + gates + delta rule (f32 state) + the gated
/// RMSNorm (per-head sum gathered across a thread-block cluster), then out_proj. Checks the output, the f32 state
/// and the conv inputs every step.
#[test]
fn gdn_core_matches_cpu() {
    let Some(g) = gpu_or_skip("gdn_core_matches_cpu") else { return };
    let tiny = Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap();
    for (name, c) in [("full", small_moe(full_config())), ("tiny-b", small_moe(tiny))] {
        let (w, dm) = one_layer(&g, c.clone(), LayerKind::Linear, 11);
        let (Mixer::DeltaNet(gd), DMixer::Gdn { out, conv, a_log, dt_bias, norm, .. }) =
            (&w.layers[0].mixer, &dm.layers[0].mixer)
        else {
            unreachable!()
        };
        let (hk, hv, dk, dv, kk) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            c.linear_conv_kernel_dim,
        );
        let (cd, vd) = (c.linear_conv_dim(), c.linear_value_dim());
        let mut ring = g.zeros::<f32>(kk * cd).unwrap();
        let mut state = g.zeros::<f32>(hv * dk * dv).unwrap();
        let mut o = g.zeros::<f32>(vd).unwrap();
        let mut y = g.zeros::<f32>(c.hidden_size).unwrap();
        let mut pos = g.zeros::<i32>(1).unwrap();
        let mut cconv = vec![0.0f32; (kk - 1) * cd];
        let mut cs = vec![0.0f32; hv * dk * dv];
        let mut rng = Rng(5);
        let (mut e_core, mut e_out, mut e_state, mut e_conv) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for t in 0..12 {
            // qkv ±2, z ±2, b ±3, a ±3
            let mut proj = rng.vec(cd + vd, 2.0);
            proj.extend(rng.vec(2 * hv, 3.0));
            let (mixed, z, b, a) =
                (&proj[..cd], &proj[cd..cd + vd], &proj[cd + vd..cd + vd + hv], &proj[cd + vd + hv..]);
            let dproj = g.upload(&proj).unwrap();
            set_pos(&g, &mut pos, t);
            let eps = c.rms_norm_eps;
            let dims = (hk, hv, dk, dv, kk);
            g.gdn_step(&dproj, conv, &mut ring, a_log, dt_bias, &mut state, &mut o, &pos, norm, eps, dims).unwrap();
            g.gemv(out, &o, None, eps, &mut y, 0, false).unwrap();
            let want_o = delta_net_core(&c, gd, &mut cconv, &mut cs, mixed, z, b, a, 1);
            let mut want_y = vec![0.0; c.hidden_size];
            gd.out_proj.forward(&want_o, 1, &mut want_y);
            // the core with its gated norm, then out_proj
            e_core = e_core.max(rel(&g.download(&o).unwrap(), &want_o));
            e_out = e_out.max(rel(&g.download(&y).unwrap(), &want_y));
            e_state = e_state.max(rel(&g.download(&state).unwrap(), &cs));
            // ring slot p % K holds the pre-conv input of position p; the CPU keeps positions t-K+2..=t in order
            let got_ring = g.download(&ring).unwrap();
            for j in 0..kk - 1 {
                let p = t as isize - (kk as isize - 2) + j as isize;
                if p >= 0 {
                    let slot = p as usize % kk;
                    e_conv = e_conv.max(rel(&got_ring[slot * cd..(slot + 1) * cd], &cconv[j * cd..(j + 1) * cd]));
                }
            }
        }
        println!(
            "gdn core {name} (Hk {hk} Hv {hv} dk {dk} dv {dv}), 12 steps: rel err core+gated norm {e_core:.2e}, \
             +out_proj {e_out:.2e}, f32 state {e_state:.2e}, conv inputs {e_conv:.2e}"
        );
        assert!(e_core < 1e-4 && e_out < 1e-4 && e_state < 1e-4, "gdn {name}: {e_core} {e_out} {e_state}");
        assert!(e_conv == 0.0, "gdn {name}: conv ring differs from the CPU's inputs ({e_conv})");
    }
}

/// The batched step's GDN kernel (one block per value head and sequence, the head's state through shared memory)
/// against the batch-1 kernel that `gdn_core_matches_cpu` checks against the CPU: three sequences with random
/// states and rings at different positions (sequence s joins at step s, so the batch has 1, 2, then 3 rows),
/// projections in rows of a padded stride. The arithmetic is the same in the same order, so the states, the rings
/// and the output (bf16 of the batch-1 kernel's f32) must be equal bit for bit.
#[test]
fn gdn_step_seqs_equals_gdn_step() {
    use cudarc::driver::DevicePtr;
    let Some(g) = gpu_or_skip("gdn_step_seqs_equals_gdn_step") else { return };
    let tiny = Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap();
    for (name, c) in [("full", small_moe(full_config())), ("tiny-b", small_moe(tiny))] {
        let (_w, dm) = one_layer(&g, c.clone(), LayerKind::Linear, 13);
        let DMixer::Gdn { conv, a_log, dt_bias, norm, .. } = &dm.layers[0].mixer else { unreachable!() };
        let d = tern_cuda::prefill::GdnDims::of(&c);
        let (cd, vd) = (c.linear_conv_dim(), c.linear_value_dim());
        let dims = (d.hk, d.hv, d.dk, d.dv, d.taps);
        let (nseq, steps, eps) = (3, 10, c.rms_norm_eps);
        let ldp = cd + vd + 2 * d.hv + 5;
        let mut rng = Rng(17);
        let init_s: Vec<Vec<f32>> = (0..nseq).map(|_| rng.vec(d.hv * d.dk * d.dv, 0.5)).collect();
        let init_r: Vec<Vec<f32>> = (0..nseq).map(|_| rng.vec(d.taps * cd, 1.0)).collect();
        let up = |v: &Vec<f32>| g.upload(v).unwrap();
        let (mut sa, mut ra): (Vec<_>, Vec<_>) = (init_s.iter().map(up).collect(), init_r.iter().map(up).collect());
        let (sb, rb): (Vec<_>, Vec<_>) = (init_s.iter().map(up).collect(), init_r.iter().map(up).collect());
        let mut o = g.zeros::<f32>(vd).unwrap();
        let mut pos = g.zeros::<i32>(1).unwrap();
        let (mut worst_state, mut worst_out) = (0.0f32, 0.0f32);
        for t in 0..steps {
            let live: Vec<usize> = (0..nseq).filter(|&s| s <= t).collect();
            let n = live.len();
            let mut proj = vec![0.0f32; n * ldp];
            let mut want = Vec::with_capacity(n * vd);
            for (r, &s) in live.iter().enumerate() {
                let mut row = rng.vec(cd + vd, 2.0);
                row.extend(rng.vec(2 * d.hv, 3.0));
                proj[r * ldp..r * ldp + row.len()].copy_from_slice(&row);
                set_pos(&g, &mut pos, t - s);
                let dp = g.upload(&row).unwrap();
                g.gdn_step(&dp, conv, &mut ra[s], a_log, dt_bias, &mut sa[s], &mut o, &pos, norm, eps, dims).unwrap();
                want.extend(g.download(&o).unwrap().into_iter().map(round_bf16));
            }
            let ptrs =
                |v: &[CudaSlice<f32>]| -> Vec<u64> { live.iter().map(|&s| v[s].device_ptr(&g.stream).0).collect() };
            let (ta, tb) = (g.upload(&ptrs(&rb)).unwrap(), g.upload(&ptrs(&sb)).unwrap());
            let posv = g.upload(&live.iter().map(|&s| (t - s) as i32).collect::<Vec<i32>>()).unwrap();
            let dproj = g.upload(&proj).unwrap();
            let mut out = g.zeros::<u16>(n * vd).unwrap();
            let tables = (&ta.slice(..), &tb.slice(..), &posv);
            g.gdn_step_seqs(&dproj, ldp, 0, conv, a_log, dt_bias, tables, n, norm, eps, d, &mut out).unwrap();
            let got: Vec<f32> =
                g.download(&out).unwrap().into_iter().map(|b| f32::from_bits((b as u32) << 16)).collect();
            worst_out = worst_out.max(got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max));
            for &s in &live {
                let (a, b) = (g.download(&sa[s]).unwrap(), g.download(&sb[s]).unwrap());
                worst_state = worst_state.max(a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max));
                assert_eq!(g.download(&ra[s]).unwrap(), g.download(&rb[s]).unwrap(), "{name} step {t} seq {s}: rings");
            }
        }
        println!(
            "gdn_step_seqs {name} ({nseq} sequences, {steps} steps, 1-3 rows): max |state diff| {worst_state:e}, max \
             |out diff| {worst_out:e} against gdn_step"
        );
        assert!(worst_state == 0.0 && worst_out == 0.0, "{name}: gdn_step_seqs differs from gdn_step");
    }
}

/// A speculative verify's GDN rows (gdn_verify_seqs: each sequence's rows one after another, the state and ring only
/// read) and the commit of the rows kept (gdn_commit_seqs, then gdn_ring over the same rows) against gdn_step taking
/// the rows one by one (which `gdn_core_matches_cpu` checks against the CPU): four sequences of 1, 3, 5 and 4 rows
/// from positions 0, 2, 9 and 1 (the conv's taps before the segment from the ring, within it from the rows; taps
/// before position 0 are zero), rows in a padded stride after two rows of other work. Every output row equals the
/// step's (bf16 of its f32), the verify leaves states and rings as they were, and the commit of the first 1, 2, 5 and
/// 4 rows leaves the states and rings of that many steps, all bit for bit.
#[test]
fn gdn_verify_and_commit_equal_steps() {
    use cudarc::driver::DevicePtr;
    use tern_cuda::prefill::SegTable;
    let Some(g) = gpu_or_skip("gdn_verify_and_commit_equal_steps") else { return };
    let tiny = Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap();
    for (name, c) in [("full", small_moe(full_config())), ("tiny-b", small_moe(tiny))] {
        let (_w, dm) = one_layer(&g, c.clone(), LayerKind::Linear, 19);
        let DMixer::Gdn { conv, a_log, dt_bias, norm, .. } = &dm.layers[0].mixer else { unreachable!() };
        let d = tern_cuda::prefill::GdnDims::of(&c);
        let (cd, vd) = (c.linear_conv_dim(), c.linear_value_dim());
        let dims = (d.hk, d.hv, d.dk, d.dv, d.taps);
        let eps = c.rms_norm_eps;
        let (rows, pos0, kept) = ([1usize, 3, 5, 4], [0usize, 2, 9, 1], [1usize, 2, 5, 4]);
        let nseq = rows.len();
        let ldp = cd + vd + 2 * d.hv + 3;
        let row0 = 2;
        let total: usize = rows.iter().sum();
        let mut rng = Rng(23);
        // ring slots of positions at or past pos0 were never written (zero), as in a live sequence
        let init_s: Vec<Vec<f32>> = (0..nseq).map(|_| rng.vec(d.hv * d.dk * d.dv, 0.5)).collect();
        let init_r: Vec<Vec<f32>> = (0..nseq)
            .map(|s| {
                let mut r = rng.vec(d.taps * cd, 1.0);
                for slot in pos0[s]..d.taps {
                    r[slot * cd..(slot + 1) * cd].fill(0.0);
                }
                r
            })
            .collect();
        let mut proj = rng.vec((row0 + total) * ldp, 2.0);
        for r in 0..row0 + total {
            for v in &mut proj[r * ldp + cd + vd..r * ldp + cd + vd + 2 * d.hv] {
                *v *= 1.5; // gates +-3
            }
        }
        // the reference: gdn_step row by row, the output (bf16) and the state and ring after every row
        let mut want_out = vec![0u16; total * vd];
        let mut want_state: Vec<Vec<Vec<f32>>> = Vec::new();
        let mut want_ring: Vec<Vec<Vec<f32>>> = Vec::new();
        let mut o = g.zeros::<f32>(vd).unwrap();
        let mut pos = g.zeros::<i32>(1).unwrap();
        let mut r0 = 0;
        for s in 0..nseq {
            let (mut st, mut ring) = (g.upload(&init_s[s]).unwrap(), g.upload(&init_r[s]).unwrap());
            let (mut ss, mut rs) = (Vec::new(), Vec::new());
            for j in 0..rows[s] {
                let r = row0 + r0 + j;
                let dp = g.upload(&proj[r * ldp..r * ldp + cd + vd + 2 * d.hv]).unwrap();
                set_pos(&g, &mut pos, pos0[s] + j);
                g.gdn_step(&dp, conv, &mut ring, a_log, dt_bias, &mut st, &mut o, &pos, norm, eps, dims).unwrap();
                let got = g.download(&o).unwrap();
                for (k, v) in got.into_iter().enumerate() {
                    want_out[(r0 + j) * vd + k] = (round_bf16(v).to_bits() >> 16) as u16;
                }
                ss.push(g.download(&st).unwrap());
                rs.push(g.download(&ring).unwrap());
            }
            want_state.push(ss);
            want_ring.push(rs);
            r0 += rows[s];
        }
        // the verify
        let up = |v: &Vec<f32>| g.upload(v).unwrap();
        let (states, rings): (Vec<_>, Vec<_>) = (init_s.iter().map(up).collect(), init_r.iter().map(up).collect());
        let ptrs = |v: &[CudaSlice<f32>]| -> Vec<u64> { v.iter().map(|b| b.device_ptr(&g.stream).0).collect() };
        let (ta, tb) = (g.upload(&ptrs(&rings)).unwrap(), g.upload(&ptrs(&states)).unwrap());
        let mut segs = SegTable::new(&g, nseq).unwrap();
        let seg: Vec<(usize, usize)> = (0..nseq).map(|s| (rows[s], pos0[s])).collect();
        segs.set(&g, &seg).unwrap();
        let dproj = g.upload(&proj).unwrap();
        let mut out = g.zeros::<u16>((row0 + total) * vd).unwrap();
        let tables = (&ta.slice(..), &tb.slice(..));
        g.gdn_verify_seqs(&dproj, ldp, row0, conv, a_log, dt_bias, tables, &segs, norm, eps, d, &mut out).unwrap();
        let got = g.download(&out).unwrap();
        let diff = got[row0 * vd..].iter().zip(&want_out).filter(|(a, b)| a != b).count();
        for s in 0..nseq {
            assert_eq!(g.download(&states[s]).unwrap(), init_s[s], "{name}: the verify wrote state {s}");
            assert_eq!(g.download(&rings[s]).unwrap(), init_r[s], "{name}: the verify wrote ring {s}");
        }
        println!("gdn_verify_seqs {name}: {diff} of {} output values differ from gdn_step row by row", want_out.len());
        assert_eq!(diff, 0, "{name}: gdn_verify_seqs differs from gdn_step");
        // the commit of the kept rows, from a copy of their projections
        let mut saved = Vec::new();
        let mut r0 = 0;
        for s in 0..nseq {
            saved.extend_from_slice(&proj[(row0 + r0) * ldp..(row0 + r0 + kept[s]) * ldp]);
            r0 += rows[s];
        }
        let dsaved = g.upload(&saved).unwrap();
        let keep: Vec<(usize, usize)> = (0..nseq).map(|s| (kept[s], pos0[s])).collect();
        segs.set(&g, &keep).unwrap();
        g.gdn_commit_seqs(&dsaved.slice(..), ldp, conv, a_log, dt_bias, tables, &segs, d).unwrap();
        g.gdn_ring(&dsaved.slice(..), ldp, d, &segs, &ta.slice(..)).unwrap();
        for s in 0..nseq {
            let st = g.download(&states[s]).unwrap();
            let worst = st.iter().zip(&want_state[s][kept[s] - 1]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst == 0.0, "{name}: sequence {s}: the committed state is {worst} from {} steps'", kept[s]);
            assert_eq!(g.download(&rings[s]).unwrap(), want_ring[s][kept[s] - 1], "{name}: sequence {s}: ring");
        }
        println!("gdn_commit_seqs {name}: states and rings after 1, 2, 5 and 4 kept rows equal the steps'");
    }
}

/// The MTP block on the device ([`tern_cuda::DeviceModel::mtp_rows`]) against the CPU's (`Weights::mtp_forward`,
/// which `tern-model`'s tests hold to a transformers-built oracle) on two random 4-bit checkpoints with an MTP block
/// (tiny-mtp-a's layout at widths 128 and 256, sizes the kernels take), the CPU taking the GPU's expert choices: five rows of random hidden states read at positions 0..5 of an empty
/// sequence, then two chained one-row reads (each fed the previous row's device output) at positions 5 and 6. Every
/// row's logits and post-norm output within bf16 rounding of the activations (the device's products take bf16
/// inputs), and the same argmax where the top-2 gap exceeds 2%.
#[test]
fn mtp_rows_match_cpu() {
    use tern_cuda::forward::StepRoutes;
    let Some(_g) = gpu_or_skip("mtp_rows_match_cpu") else { return };
    for (name, hidden) in [("width 128", 128), ("width 256", 256)] {
        let w = mtp_model_q4(hidden, 512, None, hidden as u64);
        assert!(w.mtp.is_some(), "{name}: no MTP block");
        let c = w.config.clone();
        let (h, v, k) = (c.hidden_size, c.vocab_size, c.num_experts_per_tok);
        let be = CudaBackend::new(&w, CudaOptions::with_context(64)).unwrap();
        let (m, g) = (&be.model, &be.model.gpu);
        let st = be.new_cuda_sequence().unwrap().st;
        let mut cpu = State::new_mtp();
        let mut rng = Rng(31);
        let mut hidden = rng.vec(5 * h, 1.0);
        let (mut worst_l, mut worst_h, mut decided, mut same) = (0.0f32, 0.0f32, 0, 0);
        for (pos0, rows) in [(0usize, 5usize), (5, 1), (6, 1)] {
            let ids: Vec<u32> = (0..rows).map(|r| ((pos0 + r) * 7919 % v) as u32).collect();
            let dh = g.upload(&hidden).unwrap();
            let mut routes = vec![Vec::new(); 1];
            let got = m
                .mtp_rows(&[&st], &[(rows, pos0)], &ids, &dh, (true, v, true), Some(StepRoutes::Log(&mut routes)))
                .unwrap();
            let force: Vec<Vec<usize>> = vec![routes[0].chunks_exact(k).flatten().copied().collect()];
            cpu.routing.force = Some(force);
            let want = w.mtp_forward(&hidden, &ids, &mut cpu, Logits::All).unwrap();
            let gl = got.logits.unwrap();
            let gh = g.download(&got.hidden).unwrap();
            for r in 0..rows {
                let (a, b) = (&gl[r * v..(r + 1) * v], &want.logits[r * v..(r + 1) * v]);
                worst_l = worst_l.max(rel(a, b));
                worst_h = worst_h.max(rel(&gh[r * h..(r + 1) * h], &want.hidden[r * h..(r + 1) * h]));
                assert_eq!(got.argmax[r] as usize, argmax(a), "{name}: the device argmax vs its logits");
                if top2_gap(b) > 0.02 {
                    decided += 1;
                    same += (argmax(a) == argmax(b)) as usize;
                }
            }
            // the next read chains on the device's output of the last row
            hidden = gh[(rows - 1) * h..rows * h].to_vec();
        }
        println!(
            "MTP block {name}, 7 rows (5 at once, 2 chained): rel err logits {worst_l:.2e}, post-norm output \
             {worst_h:.2e}; argmax equal where the top-2 gap > 2%: {same}/{decided}"
        );
        assert!(worst_l < 3e-2 && worst_h < 3e-2, "{name}: MTP rows differ from the CPU's");
        assert!(same == decided, "{name}: MTP argmax differs");
    }
}

/// Decode attention: q/k norm + partial NeoX RoPE + bf16 KV append, split-K decode over the cache (GQA), merge
/// of the splits + sigmoid gate; every context length from 1 up, several split counts (empty splits included). The
/// batched step's attn_decode_seqs (positions from the host, a warp's first keys read before its dependency wait)
/// on the same cache right after the same attn_prep: the partials of attn_decode bit for bit.
#[test]
fn attention_decode_matches_cpu() {
    use cudarc::driver::DevicePtr;
    let Some(g) = gpu_or_skip("attention_decode_matches_cpu") else { return };
    let tiny = Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap();
    let full = small_moe(full_config());
    for (name, c, steps, nsplit) in
        [("full", full.clone(), 1100, 8), ("full", full, 300, 128), ("tiny-b", small_moe(tiny), 600, 4)]
    {
        let (w, dm) = one_layer(&g, c.clone(), LayerKind::Full, 12);
        let (Mixer::Attention(a), DMixer::Attn { qn, kn, .. }) = (&w.layers[0].mixer, &dm.layers[0].mixer) else {
            unreachable!()
        };
        let (nh, nkv, hd, rd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim);
        let mut kc = g.zeros::<u16>(steps * nkv * hd).unwrap();
        let mut vc = g.zeros::<u16>(steps * nkv * hd).unwrap();
        let mut qbuf = g.zeros::<f32>(nh * hd).unwrap();
        let mut part = g.zeros::<f32>(nh * nsplit * (hd + 2)).unwrap();
        let mut o = g.zeros::<f32>(nh * hd).unwrap();
        let mut pos = g.zeros::<i32>(1).unwrap();
        let (mut ck, mut cv) = (Vec::new(), Vec::new());
        let mut rng = Rng(9);
        let (mut worst, mut worst_at, mut e_kv) = (0.0f32, 0, 0.0f32);
        let mut at = Vec::new();
        for t in 0..steps {
            // q‖gate ±2, k ±2 (after RMSNorm: O(1) scores), v ±1
            let mut proj = rng.vec(2 * nh * hd + nkv * hd, 2.0);
            proj.extend(rng.vec(nkv * hd, 1.0));
            let dproj = g.upload(&proj).unwrap();
            set_pos(&g, &mut pos, t);
            let theta = c.rope_theta as f32;
            g.attn_prep(&dproj, qn, kn, &pos, (nh, nkv, hd, rd), theta, c.rms_norm_eps, &mut qbuf, &mut kc, &mut vc)
                .unwrap();
            g.attn_decode(&qbuf, &kc, &vc, &pos, (nh, nkv, hd), nsplit, &mut part).unwrap();
            if nh / nkv <= 8 {
                // attn_prep again (the same row), then attn_decode_seqs right behind it, as in the batched step
                let (tk, tv) = (
                    g.upload(&[kc.device_ptr(&g.stream).0]).unwrap(),
                    g.upload(&[vc.device_ptr(&g.stream).0]).unwrap(),
                );
                let posv = g.upload(&[t as i32]).unwrap();
                let mut part2 = g.zeros::<f32>(nh * nsplit * (hd + 2)).unwrap();
                let eps = c.rms_norm_eps;
                g.attn_prep(&dproj, qn, kn, &pos, (nh, nkv, hd, rd), theta, eps, &mut qbuf, &mut kc, &mut vc).unwrap();
                let tables = (&tk.slice(..), &tv.slice(..), &posv);
                g.attn_decode_seqs(&qbuf, tables, &posv, 1, (nh, nkv, hd), nsplit, &mut part2).unwrap();
                let bits =
                    |p: &CudaSlice<f32>| g.download(p).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                assert!(
                    bits(&part) == bits(&part2),
                    "attention {name} nsplit {nsplit} len {}: seqs partials differ",
                    t + 1
                );
            }
            g.attn_combine(&part, &dproj, nh, hd, nsplit, &mut o).unwrap();
            let (qg, k, v) =
                (&proj[..2 * nh * hd], &proj[2 * nh * hd..(2 * nh + nkv) * hd], &proj[(2 * nh + nkv) * hd..]);
            let want = attention_core(&c, a, &mut ck, &mut cv, t, qg, k.to_vec(), v, 1);
            let e = rel(&g.download(&o).unwrap(), &want);
            if e > worst {
                (worst, worst_at) = (e, t + 1);
            }
            if [1, 2, 7, 64, 129, 257, 600, 1100].contains(&(t + 1)) {
                at.push(format!("len {} {e:.1e}", t + 1));
            }
            if t % 97 == 0 || t + 1 == steps {
                // the cache row just written: bf16 of the CPU's normed+rotated k and of v
                let row = t * nkv * hd..(t + 1) * nkv * hd;
                let gk: Vec<f32> = g.download(&kc).unwrap()[row.clone()].iter().map(|&b| bf16_to_f32(b)).collect();
                let gv: Vec<f32> = g.download(&vc).unwrap()[row.clone()].iter().map(|&b| bf16_to_f32(b)).collect();
                e_kv = e_kv.max(rel(&gk, &ck[row.clone()])).max(rel(&gv, &cv[row]));
            }
        }
        println!(
            "attention {name} (nh {nh} nkv {nkv} hd {hd} rot {rd}) nsplit {nsplit}, lengths 1..={steps}: worst rel err \
             {worst:.2e} at len {worst_at}; {}; KV cache rows vs CPU {e_kv:.2e}",
            at.join(", ")
        );
        assert!(worst < 1e-2, "attention {name} nsplit {nsplit}: rel err {worst} at len {worst_at}");
        assert!(e_kv < 8e-3, "attention {name}: bf16 cache rows {e_kv}");
    }
}

/// Router softmax + top-k + renormalise (+ the shared-expert gate in slot k): indices exactly, weights to f32.
#[test]
fn moe_topk_matches_cpu_route() {
    let Some(g) = gpu_or_skip("moe_topk_matches_cpu_route") else { return };
    let mut rng = Rng(3);
    let mut e_w = 0.0f32;
    let mut cases = 0;
    for (e, k) in [(256, 8), (128, 8), (16, 4), (32, 32)] {
        let mut c = full_config();
        (c.num_experts, c.num_experts_per_tok) = (e, k);
        for trial in 0..40 {
            let mut logits = rng.vec(e + 1, 4.0);
            if trial == 0 {
                logits[..e].iter_mut().for_each(|v| *v = 0.5); // all tied: lowest indices win
            } else if trial == 1 {
                for i in 0..e / 2 {
                    logits[2 * i + 1] = logits[2 * i]; // pairwise ties
                }
            }
            let mut idx = g.zeros::<i32>(k + 1).unwrap();
            let mut wts = g.zeros::<f32>(k + 1).unwrap();
            g.moe_topk(&g.upload(&logits).unwrap(), e, k, &mut idx, &mut wts).unwrap();
            let (gi, gw) = (g.download(&idx).unwrap(), g.download(&wts).unwrap());
            let want = route(&c, &logits[..e]);
            let wi: Vec<i32> = want.iter().map(|r| r.0 as i32).collect();
            let ww: Vec<f32> = want.iter().map(|r| r.1).collect();
            assert_eq!(&gi[..k], &wi[..], "moe_topk E={e} k={k} trial {trial}: experts differ");
            assert_eq!(gi[k], e as i32, "slot k is the shared expert");
            e_w = e_w.max(rel(&gw[..k], &ww));
            let sg = 1.0 / (1.0 + (-logits[e]).exp());
            e_w = e_w.max((gw[k] - sg).abs() / sg);
            cases += 1;
        }
    }
    println!("moe_topk: {cases} cases (E 256/128/16/32, ties included): experts identical, weights rel err {e_w:.2e}");
    assert!(e_w < 1e-5, "moe_topk weights: {e_w}");
}

/// The MoE block of a decode step: fused router GEMV (8-bit, RMSNorm prologue) + top-k, routed + shared experts
/// (gate_up with the norm fused, down with the weighted combine and the residual add fused), against the CPU's
/// MoE on the GPU's routing (held equal; flips against the CPU's own top-k counted).
#[test]
fn moe_block_matches_cpu() {
    let Some(g) = gpu_or_skip("moe_block_matches_cpu") else { return };
    let mut full = full_config();
    full.vocab_size = 256;
    (full.linear_num_key_heads, full.linear_num_value_heads) = (2, 2);
    let mut tiny = Config::from_dir(&fixtures_dir().join("tiny-b")).unwrap();
    tiny.shared_expert_intermediate_size = 64; // Is != I: the shared expert's own stride
    for (name, c) in [("full", full), ("tiny-b", tiny)] {
        let (w, dm) = one_layer(&g, c.clone(), LayerKind::Linear, 13);
        let (l, dl) = (&w.layers[0], &dm.layers[0]);
        let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let sizes = (c.moe_intermediate_size, c.shared_expert_intermediate_size);
        let imax = sizes.0.max(sizes.1);
        let mut rl = g.zeros::<f32>(e + 1).unwrap();
        let mut idx = g.zeros::<i32>(k + 1).unwrap();
        let mut wts = g.zeros::<f32>(k + 1).unwrap();
        let mut act = g.zeros::<f32>((k + 1) * imax).unwrap();
        let mut counter = g.zeros::<u32>(tern_cuda::gpu::MOE_COUNTER_LEN).unwrap();
        let mut rng = Rng(21);
        let (mut e_router, mut e_out, mut flips) = (0.0f32, 0.0f32, 0);
        let trials = 16;
        for _ in 0..trials {
            let x = rng.vec(h, 2.0);
            let mut dx = g.upload(&x).unwrap();
            let eps = c.rms_norm_eps;
            // the step's path: router GEMV + softmax/top-k fused in one launch
            g.router_topk(&dl.router, &dx, &dl.post_norm, eps, k, &mut rl, &mut counter, &mut idx, &mut wts).unwrap();
            g.moe_gate_up(&dl.gate_up, e, k, sizes, &dx, &dl.post_norm, eps, &mut act, &counter).unwrap();
            g.moe_down(&dl.down, e, &wts, k, sizes, &act, &mut dx, &mut counter).unwrap();
            let gi: Vec<usize> = g.download(&idx).unwrap()[..k].iter().map(|&i| i as usize).collect();
            let mut u = x.clone();
            rms_norm(&mut u, &l.post_norm, eps);
            let mut rec = Vec::new();
            let want = moe(&c, &l.moe, &u, 1, Some(&gi), Some(&mut rec));
            let mut want_sg = [0.0f32];
            l.moe.shared_gate.forward(&u, 1, &mut want_sg);
            let mut want_rl = rec[0].clone();
            want_rl.push(want_sg[0]);
            e_router = e_router.max(rel(&g.download(&rl).unwrap(), &want_rl));
            let mine: Vec<usize> = route(&c, &rec[0]).iter().map(|r| r.0).collect();
            flips += (mine != gi) as usize;
            let got: Vec<f32> = g.download(&dx).unwrap().iter().zip(&x).map(|(a, b)| a - b).collect();
            e_out = e_out.max(rel(&got, &want));
        }
        println!(
            "moe block {name} (H {h} E {e} k {k} I {} Is {}), {trials} inputs: router logits rel err {e_router:.2e}, \
             MoE output (routed+shared, weighted, residual) rel err {e_out:.2e}, top-k flips vs CPU {flips}",
            sizes.0, sizes.1
        );
        assert!(e_router < 1e-4 && e_out < 1e-4, "moe {name}: router {e_router} out {e_out}");
    }
}

/// Embedding row dequantisation (4-bit) against the CPU's row dequant.
#[test]
fn embed_matches_cpu_dequant() {
    let Some(g) = gpu_or_skip("embed_matches_cpu_dequant") else { return };
    let mut rng = Rng(17);
    let mut worst = 0.0f32;
    for (rows, cols, gs) in [(3000, 2048, 64), (512, 96, 32)] {
        let q = QuantMatrix::quantize_grouped(&rng.vec(rows * cols, 1.0), rows, cols, 4, gs).unwrap();
        let dm = to_dev(&g, &q);
        let mut x = g.zeros::<f32>(cols).unwrap();
        for id in [0, 1, rows / 2, rows - 1] {
            g.embed(&dm, &g.upload(&[id as i32]).unwrap(), &mut x).unwrap();
            let mut want = vec![0.0; cols];
            q.dequantize_row(id, &mut want);
            worst = worst.max(rel(&g.download(&x).unwrap(), &want));
        }
    }
    println!("embed_q4: rel err {worst:.2e}");
    assert!(worst < 1e-6, "embed: {worst}");
}

/// The RMSNorm fusion of the GEMV prologue at the model's shapes (input/post norms: gain with the +1), with and
/// without the residual accumulate; and the plain prologue at out_proj's shape (2048 x 4096).
#[test]
fn rmsnorm_fusions_match_cpu() {
    let Some(g) = gpu_or_skip("rmsnorm_fusions_match_cpu") else { return };
    let mut rng = Rng(23);
    let eps = 1e-6;
    let mut report = Vec::new();
    // (rows, cols, bits, with the norm)
    for (rows, cols, bits, norm) in
        [(12352usize, 2048usize, 4u32, true), (257, 2048, 8, true), (2048, 4096, 4, false), (96, 192, 4, true)]
    {
        let gs = if cols % 64 == 0 { 64 } else { 32 };
        let q = QuantMatrix::quantize_grouped(&rng.vec(rows * cols, 1.0), rows, cols, bits, gs).unwrap();
        let dm = to_dev(&g, &q);
        let x = rng.vec(cols, 3.0);
        let y0 = rng.vec(rows, 1.0);
        let mut xn = x.clone();
        let gain: Vec<f32> = rng.vec(cols, 0.5).iter().map(|v| 1.0 + v).collect();
        if norm {
            rms_norm(&mut xn, &gain, eps);
        }
        let mut want = vec![0.0; rows];
        q.gemv(&xn, &mut want);
        let (dx, dgain) = (g.upload(&x).unwrap(), g.upload(&gain).unwrap());
        for acc in [false, true] {
            let mut dy = g.upload(&y0).unwrap();
            g.gemv(&dm, &dx, norm.then_some(&dgain), eps, &mut dy, 0, acc).unwrap();
            let got: Vec<f32> =
                g.download(&dy).unwrap().iter().zip(&y0).map(|(a, b)| if acc { a - b } else { *a }).collect();
            let e = rel(&got, &want);
            report.push(format!("{rows}x{cols} q{bits} {} acc={acc}: {e:.2e}", if norm { "rms" } else { "plain" }));
            assert!(e < 1e-4, "norm fusion {rows}x{cols} norm {norm} acc {acc}: {e}");
        }
    }
    println!("rmsnorm fusions: {}", report.join("; "));
}

/// Greedy argmax over the vocabulary (ties to the lower index) and the position advance.
#[test]
fn argmax_matches_cpu() {
    let Some(g) = gpu_or_skip("argmax_matches_cpu") else { return };
    let mut rng = Rng(29);
    let n = 248320;
    let mut pos = g.zeros::<i32>(1).unwrap();
    let mut tok = g.zeros::<i32>(1).unwrap();
    let nb = g.argmax_blocks();
    let (mut pv, mut pi) = (g.zeros::<f32>(nb).unwrap(), g.zeros::<i32>(nb).unwrap());
    let mut cases = 0;
    for case in 0..12 {
        let mut v = rng.vec(n, 10.0);
        match case {
            0 => v[n - 1] = 11.0,
            1 => v[0] = 11.0,
            2 => (v[100_000], v[200_000], v[7]) = (12.0, 12.0, 12.0), // ties: lowest index
            3 => v.iter_mut().for_each(|x| *x = -50.0 + x.abs()),
            4 => v.iter_mut().for_each(|x| *x = 1.0), // all equal -> 0
            _ => {}
        }
        g.argmax(&g.upload(&v).unwrap(), &mut pv, &mut pi, &mut tok, &mut pos).unwrap();
        let got = g.download(&tok).unwrap()[0] as usize;
        assert_eq!(got, argmax(&v), "argmax case {case}");
        cases += 1;
    }
    assert_eq!(g.download(&pos).unwrap()[0], cases, "argmax advances the position once per call");
    println!("argmax: {cases} cases over {n} logits (ties, extremes, all-equal) identical; position advanced {cases}x");
}

// ---------------------------------------------------------------------------------------------------------
// Whole decode step with expert choices held equal.

/// Per step: logits distance of the held CPU run, of a free-running CPU run, the CPU's top1-top2 gap relative
/// to its logit range, argmaxes, and the layers whose CPU top-k differs from the GPU's (with the CPU's
/// probability margin at the k-th place).
struct Step {
    held: f32,
    free: f32,
    gap: f32,
    same_argmax: bool,
    flips: Vec<(usize, f32)>,
}

/// Read `ids` one at a time on the GPU (graph step) and on the CPU twice: with the GPU's expert choices, and
/// with its own.
fn run_held(w: &Weights, seq: &mut CudaSequence, ids: &[u32]) -> Vec<Step> {
    let c = &w.config;
    let (layers, k) = (c.num_layers(), c.num_experts_per_tok);
    let g = seq.model.gpu.clone();
    seq.st.route_log = Some(g.zeros::<i32>(layers * (k + 1)).unwrap());
    let (mut held, mut free) = (State::new(c), State::new(c));
    held.routing.record = true;
    let mut out = Vec::new();
    for &id in ids {
        let gpu = seq.forward_ids(&[id]).unwrap();
        let log = g.download(seq.st.route_log.as_ref().unwrap()).unwrap();
        let force: Vec<Vec<usize>> =
            log.chunks_exact(k + 1).map(|r| r[..k].iter().map(|&e| e as usize).collect()).collect();
        held.routing.force = Some(force.clone());
        let cpu = w.forward(&[id], &mut held, Logits::Last);
        let cpu_free = w.forward(&[id], &mut free, Logits::Last);
        let mut flips = Vec::new();
        for (li, (lg, f)) in held.routing.logits.iter().zip(&force).enumerate() {
            let mine: Vec<usize> = route(c, lg).iter().map(|r| r.0).collect();
            if mine != *f {
                // CPU probabilities sorted: margin between the k-th and (k+1)-th expert
                let m = lg.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut p: Vec<f32> = lg.iter().map(|l| (l - m).exp()).collect();
                let s: f32 = p.iter().sum();
                p.iter_mut().for_each(|v| *v /= s);
                p.sort_by(|a, b| b.partial_cmp(a).unwrap());
                flips.push((li, p[k - 1] - p[k]));
            }
        }
        let (mx, mn) = cpu.iter().fold((f32::MIN, f32::MAX), |(a, b), &v| (a.max(v), b.min(v)));
        let mut sorted = cpu.clone();
        sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
        out.push(Step {
            held: rel(&gpu, &cpu),
            free: rel(&gpu, &cpu_free),
            gap: (sorted[0] - sorted[1]) / (mx - mn),
            same_argmax: argmax(&gpu) == argmax(&cpu),
            flips,
        });
    }
    out
}

fn summarize(name: &str, steps: &[Step]) -> (f32, f32, f32) {
    let held: Vec<f32> = steps.iter().map(|s| s.held).collect();
    let free: Vec<f32> = steps.iter().map(|s| s.free).collect();
    let (hm, hx, hp) = (pct(&held, 0.5), pct(&held, 1.0), pct(&held, 0.99));
    let worst_free = free.iter().enumerate().fold(0, |b, (i, v)| if *v > free[b] { i } else { b });
    let worst_held = held.iter().enumerate().fold(0, |b, (i, v)| if *v > held[b] { i } else { b });
    let flip_steps: Vec<String> = steps
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.flips.is_empty())
        .map(|(t, s)| {
            format!("{t}:{:?}", s.flips.iter().map(|(l, m)| format!("L{l} margin {m:.1e}")).collect::<Vec<_>>())
        })
        .collect();
    let decided = steps.iter().filter(|s| s.gap > 0.02).count();
    let decided_same = steps.iter().filter(|s| s.gap > 0.02 && s.same_argmax).count();
    let all_same = steps.iter().filter(|s| s.same_argmax).count();
    println!(
        "{name}: {} steps. held routing: median {hm:.2e} p99 {hp:.2e} max {hx:.2e} (step {worst_held}); free-running \
         CPU: median {:.2e} max {:.2e} (step {worst_free}). Argmax identical {all_same}/{}; where the CPU's top1-top2 \
         gap > 2% of the logit range: {decided_same}/{decided}. Top-k flips (GPU choice != CPU's own): {} steps {:?}",
        steps.len(),
        pct(&free, 0.5),
        pct(&free, 1.0),
        steps.len(),
        flip_steps.len(),
        &flip_steps[..flip_steps.len().min(8)]
    );
    assert_eq!(decided_same, decided, "{name}: argmax differs where the CPU's top1-top2 gap exceeds 2% of the range");
    (hm, hp, hx)
}

/// The fixture's own token ids (transformers' run), decoded one at a time on the GPU vs the CPU holding the
/// GPU's routing: the distance must not exceed transformers' own bf16-vs-f32 distance on the same model.
#[test]
fn decode_within_transformers_bf16_yardstick_tiny_b() {
    let Some(_g) = gpu_or_skip("decode_within_transformers_bf16_yardstick_tiny_b") else { return };
    let w = tiny_b_q4();
    let dir = fixtures_dir().join("tiny-b");
    let st = SafeTensors::open(&dir.join("expected.safetensors")).unwrap();
    let ids: Vec<u32> = st.get("ids").unwrap().to_f32().unwrap().into_iter().map(|v| v as u32).collect();
    let be = CudaBackend::new(&w, CudaOptions::with_context(128)).unwrap();
    let mut seq = be.new_cuda_sequence().unwrap();
    let steps = run_held(&w, &mut seq, &ids);
    let (hm, _, hx) = summarize("tiny-b fixture ids", &steps);
    let (ym, yx) = yardstick();
    println!("transformers bf16 vs f32 on tiny-b: median {ym:.2e} max {yx:.2e}; CUDA vs CPU (held): median {hm:.2e} max {hx:.2e}");
    assert!(hm <= ym && hx <= yx, "CUDA-vs-CPU distance exceeds transformers' bf16 yardstick");
}

/// 520 decode steps on tiny-b (several attention splits' worth of context), held routing vs free-running.
#[test]
fn decode_step_held_routing_tiny_b_520() {
    let Some(_g) = gpu_or_skip("decode_step_held_routing_tiny_b_520") else { return };
    let w = tiny_b_q4();
    let v = w.config.vocab_size;
    let be = CudaBackend::new(&w, CudaOptions::with_context(600)).unwrap();
    let mut seq = be.new_cuda_sequence().unwrap();
    let ids: Vec<u32> = (0..520u64).map(|i| ((i * 2654435761 + 17) % v as u64) as u32).collect();
    let steps = run_held(&w, &mut seq, &ids);
    let (hm, hp, hx) = summarize("tiny-b 520 steps", &steps);
    let (ym, yx) = yardstick();
    assert!(hm <= ym && hx <= yx, "CUDA-vs-CPU distance exceeds transformers' bf16 yardstick ({ym}, {yx})");
    assert!(hm < 5e-3 && hp < 2e-2 && hx < 3e-2, "held routing: median {hm} p99 {hp} max {hx}");
}

/// Full-shape check for the device (16 cores, 128 GB): a random full-shape 4-bit model generated on the CPU and
/// uploaded, `TERN_FULL_STEPS` (default 256) decoded positions, CUDA vs CPU held and free-running. Slow (weight
/// generation and the CPU side take minutes): `cargo test --release -p tern-cuda --test kernels -- --ignored`.
#[test]
#[ignore]
fn full_shape_random_q4_vs_cpu() {
    let Some(_g) = gpu_or_skip("full_shape_random_q4_vs_cpu") else { return };
    let n: usize = std::env::var("TERN_FULL_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let c = full_config();
    let t0 = std::time::Instant::now();
    let w = Weights::from_values(c.clone(), &RandomValues { seed: 7 }, Some(&QuantSpec::q4(&c))).unwrap();
    println!("full shape: weights generated in {:.0?}", t0.elapsed());
    let be = CudaBackend::new(&w, CudaOptions::with_context(n + 8)).unwrap();
    let mut seq = be.new_cuda_sequence().unwrap();
    let ids: Vec<u32> = (0..n as u64).map(|i| ((i * 2654435761 + 17) % c.vocab_size as u64) as u32).collect();
    let steps = run_held(&w, &mut seq, &ids);
    let (hm, hp, hx) = summarize("full shape random q4", &steps);
    println!("full shape: {:.0?} total; held median {hm:.2e} p99 {hp:.2e} max {hx:.2e}", t0.elapsed());
    assert!(hm < 2.5e-2 && hx < 0.17, "full shape held routing: median {hm} max {hx}");
}

/// The MTP test checkpoints (common::mtp_model_q4) are what the CUDA backend loads: every linear of the main layers
/// and of the MTP block 4- or 8-bit (this runs without a GPU).
#[test]
fn mtp_test_checkpoints_are_quantised() {
    use tern_model::weights::Linear;
    let accept = Some("0.8,0.5375".parse().unwrap());
    for (hidden, vocab, accept) in [(128, 512, None), (256, 512, None), (512, 2048, accept)] {
        let w = mtp_model_q4(hidden, vocab, accept, 5);
        let mtp = w.mtp.as_ref().expect("an MTP block");
        let mut linears: Vec<&Linear> = vec![&w.embed, &w.lm_head, &mtp.fc];
        for l in w.layers.iter().chain([&mtp.layer]) {
            match &l.mixer {
                Mixer::Attention(a) => linears.extend([&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]),
                Mixer::DeltaNet(d) => {
                    linears.extend([&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a, &d.out_proj])
                }
            }
            let m = &l.moe;
            linears.extend([&m.router, &m.shared_gate, &m.shared.gate, &m.shared.up, &m.shared.down]);
            linears.extend(m.experts.iter().flat_map(|e| [&e.gate, &e.up, &e.down]));
        }
        let f32s = linears.iter().filter(|l| !matches!(l, Linear::Quant(_))).count();
        assert_eq!(f32s, 0, "width {hidden}: {f32s} of {} linears left f32", linears.len());
    }
}
