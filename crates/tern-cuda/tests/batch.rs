//! The batched decode step (crates/tern-cuda/src/batch.rs) against the same sequences run alone through the batch-1
//! decode graph: logits within transformers' bf16-vs-f32 distance (the batched step's GEMMs take bf16 activations,
//! the graph's GEMVs f32), greedy ids identical wherever the top-2 gap exceeds 2%, for batches of sequences at
//! different positions (one of them empty), across many steps, with batch-1 steps between batched ones; through the
//! backend seam, a step mixing batched decodes, a prompt chunk and every kind of output gives each item what it gets
//! alone; bad input is a clear error that changes nothing.
//!
//! Without a CUDA device each test prints `NO GPU: <name> not run ...` and passes; `TERN_REQUIRE_CUDA=1` turns
//! that into a failure.

use tern_cuda::batch::MAX_SEQS;
use tern_cuda::forward::{Draw, RowWant, StepRoutes};
use tern_cuda::sample::{sample_reference, SampleBatch};
use tern_cuda::seq::CudaOptions;
use tern_cuda::{gpu_or_skip, CudaBackend, CudaSlots, DeviceState};
use tern_engine::{mask_allows, Backend, MaskSlot, Output, Sample, SamplingParams, SeqId, Want, Work};

mod common;
use common::*;

/// A prompt of `n` ids of a vocabulary of `v`, different for each `seed`.
fn prompt(seed: u64, n: usize, v: usize) -> Vec<u32> {
    (0..n as u64).map(|i| ((i * 2654435761 + seed * 97 + 13) % v as u64) as u32).collect()
}

/// `b` sequences at different positions (sequence 0 empty, the others prefilled with prompts of different lengths),
/// each twice: one copy for the batched steps, one to run alone; both log their decode steps' routes.
fn twins(be: &CudaBackend, b: usize) -> (Vec<DeviceState>, Vec<DeviceState>) {
    let (m, v) = (&be.model, be.model.config.vocab_size);
    let log_len = m.config.num_layers() * (m.config.num_experts_per_tok + 1);
    let (mut batched, mut alone) = (Vec::new(), Vec::new());
    for s in 0..b {
        let mut st = be.new_cuda_sequence().unwrap().st;
        if s > 0 {
            st.prefill(m, &prompt(s as u64, 1 + (s * 37) % 150, v), false, false).unwrap();
        }
        let mut twin = st.fork(m, usize::MAX).unwrap();
        twin.route_log = Some(m.gpu.zeros::<i32>(log_len).unwrap());
        st.route_log = Some(m.gpu.zeros::<i32>(log_len).unwrap());
        alone.push(twin);
        batched.push(st);
    }
    (batched, alone)
}

/// The routed experts of a batch-1 step, per layer (from `route_log`).
fn logged_routes(be: &CudaBackend, st: &DeviceState) -> Vec<Vec<usize>> {
    let k = be.model.config.num_experts_per_tok;
    let log = be.model.gpu.download(st.route_log.as_ref().unwrap()).unwrap();
    log.chunks_exact(k + 1).map(|l| l[..k].iter().map(|&e| e as usize).collect()).collect()
}

/// What [`compare`] saw: logits distances and greedy agreement where the top-2 gap exceeds 2%, over the rows
/// routed exactly alike in that step (a different expert choice in a near tie moves that token's hidden state by
/// more than rounding; the batched twin is then re-forked from the one alone, so every step starts from equal
/// states), and how many rows that was.
struct Seen {
    dist: Vec<f32>,
    tail: Vec<f32>,
    /// the prompt chunk read after the steps (its routing is not logged, so a near tie can move a row by more than
    /// rounding: bounded by the median)
    chunk: Vec<f32>,
    decided: usize,
    same: usize,
    rows: usize,
}

/// Batched steps vs the same sequences alone, `steps` tokens each (both fed the alone run's greedy ids, so that one
/// flip does not cascade); after `batched_until` steps the batched copies continue through the batch-1 graph too
/// (their device position counter was left behind by the batched steps). A twin whose step was routed differently
/// is re-forked from the sequence alone after that step. With `hold`, the batched steps take the experts the
/// sequences alone chose (their own router logits weight them), so every row is routed alike.
fn compare(be: &CudaBackend, b: usize, steps: usize, batched_until: usize, hold: bool) -> Seen {
    let m = &be.model;
    let (v, k, layers) = (m.config.vocab_size, m.config.num_experts_per_tok, m.config.num_layers());
    let log_len = layers * (k + 1);
    let (mut bat, mut alone) = twins(be, b);
    let mut next: Vec<u32> = (0..b).map(|s| (s * 7919 % v) as u32).collect();
    let mut seen = Seen { dist: Vec::new(), tail: Vec::new(), chunk: Vec::new(), decided: 0, same: 0, rows: 0 };
    let graph_step = |st: &mut DeviceState, id: u32| {
        st.set_token(&m.gpu, id).unwrap();
        st.step_graph(m).unwrap();
        (m.gpu.download(&st.logits).unwrap(), logged_routes(be, st))
    };
    for step in 0..steps {
        let (la, ra): (Vec<Vec<f32>>, Vec<Vec<Vec<usize>>>) =
            alone.iter_mut().zip(&next).map(|(st, &id)| graph_step(st, id)).unzip();
        let (lb, rb): (Vec<Vec<f32>>, Vec<Vec<Vec<usize>>>) = if step < batched_until {
            let mut refs: Vec<&mut DeviceState> = bat.iter_mut().collect();
            let want = vec![RowWant { logits: true, draw: Draw::Argmax(v) }; b];
            let mut routes = vec![Vec::new(); layers];
            if hold {
                routes = (0..layers).map(|li| ra.iter().flat_map(|r| r[li].iter().copied()).collect()).collect();
            }
            let ctl = if hold { StepRoutes::Hold(&routes) } else { StepRoutes::Log(&mut routes) };
            let rows = m.decode_seqs_profiled(&mut refs, &next, &want, None, Some(ctl)).unwrap();
            for (r, row) in rows.iter().enumerate() {
                let (l, t) = (row.logits.as_ref().unwrap(), row.token.as_ref().unwrap().as_ref().unwrap());
                assert_eq!(t.token as usize, argmax(l), "step {step} row {r}: the device's greedy draw vs its logits");
            }
            let per_row = (0..b).map(|r| routes.iter().map(|l| l[r * k..(r + 1) * k].to_vec()).collect()).collect();
            (rows.into_iter().map(|r| r.logits.unwrap()).collect(), per_row)
        } else {
            bat.iter_mut().zip(&next).map(|(st, &id)| graph_step(st, id)).unzip()
        };
        for s in 0..b {
            assert_eq!(bat[s].len, alone[s].len, "step {step} row {s}: lengths");
            if ra[s] != rb[s] {
                let mut twin = alone[s].fork(m, usize::MAX).unwrap();
                twin.route_log = Some(m.gpu.zeros::<i32>(log_len).unwrap());
                bat[s] = twin;
                continue;
            }
            seen.rows += 1;
            let d = rel(&lb[s], &la[s]);
            seen.dist.push(d);
            if step >= batched_until {
                seen.tail.push(d);
            }
            if top2_gap(&la[s]) > 0.02 {
                seen.decided += 1;
                seen.same += (argmax(&lb[s]) == argmax(&la[s])) as usize;
            }
        }
        next = la.iter().map(|l| argmax(l) as u32).collect();
    }
    // a prompt chunk after the steps (the prefill takes the position from the host, stale device counter or not)
    for s in 0..b {
        let more = prompt(77 + s as u64, 3, v);
        let pa = alone[s].prefill(m, &more, true, false).unwrap().logits;
        let pb = bat[s].prefill(m, &more, true, false).unwrap().logits;
        seen.chunk.push(rel(&pb, &pa));
    }
    seen
}

/// tiny-b (transformers' random checkpoint, 4-bit): batches of 2, 5 and MAX_SEQS sequences at different positions
/// for 24 steps, the last 6 of them through the batch-1 graph again, then a 3-token prompt chunk.
#[test]
fn batched_decode_matches_each_sequence_alone() {
    let Some(_g) = gpu_or_skip("batched_decode_matches_each_sequence_alone") else { return };
    let w = tiny_b_q4();
    let be = CudaBackend::new(&w, CudaOptions::with_context(256)).unwrap();
    let (ym, yx) = yardstick();
    for b in [2, 5, MAX_SEQS] {
        let seen = compare(&be, b, 24, 18, false);
        let (med, max) = (pct(&seen.dist, 0.5), pct(&seen.dist, 1.0));
        println!(
            "tiny-b batch of {b}, 24 steps (18 batched, then 6 batch-1), {} of {} rows routed alike: logits vs \
             alone median {med:.2e} max {max:.2e} (transformers bf16 vs f32: {ym:.2e} / {yx:.2e}); greedy ids equal \
             where the top-2 gap > 2%: {}/{}",
            seen.rows,
            24 * b,
            seen.same,
            seen.decided
        );
        // a near tie routed differently (bf16 projection inputs against the graph's f32 ones) leaves that row out
        assert!(seen.rows >= 24 * b / 3, "batch of {b}: only {} of {} rows routed alike", seen.rows, 24 * b);
        assert!(med <= ym && max <= yx, "batch of {b}: batched logits farther from alone than bf16 rounding");
        assert!(seen.decided > 0 && seen.same == seen.decided, "batch of {b}: greedy ids differ");
        // the steps after the batched ones are the graph's own on the batched state: within the same bound
        if !seen.tail.is_empty() {
            assert!(
                pct(&seen.tail, 1.0) <= yx,
                "batch-1 steps after batched ones drifted: {:.2e}",
                pct(&seen.tail, 1.0)
            );
        }
        let chunk = pct(&seen.chunk, 0.5);
        println!("  then a 3-token prompt chunk: logits vs alone median {chunk:.2e} max {:.2e}", pct(&seen.chunk, 1.0));
        assert!(chunk <= ym, "batch of {b}: the prompt chunk after the steps is {chunk:.2e} from alone (median)");
    }
}

/// The full shape (random weights generated on the GPU: 40 layers, 256 experts, head dim 256, vocab 248,320): a batch
/// of 16 sequences at different positions, 6 steps. Random full-shape routers have so many near ties that no step
/// of a sequence is routed alike in all 40 layers by two paths that round differently, so the batched steps hold
/// the experts the sequences alone chose: every row is then compared, and bounded by transformers' bf16 distance.
#[test]
fn batched_decode_full_shape() {
    let Some(_g) = gpu_or_skip("batched_decode_full_shape") else { return };
    let c = full_config();
    let be = CudaBackend::random(&c, 11, CudaOptions::with_context(256)).unwrap();
    let (_, yx) = yardstick();
    // 16 rows: the 8-row dense products; 40: the lm_head through the 128-row GEMM (Gpu::lm_head_seqs)
    for (b, steps) in [(16, 6), (40, 2)] {
        let seen = compare(&be, b, steps, steps, true);
        let (med, max) = (pct(&seen.dist, 0.5), pct(&seen.dist, 1.0));
        println!(
            "full shape batch of {b}, {steps} steps, routing held: {} of {} rows: logits vs alone median {med:.2e} \
             max {max:.2e}; greedy ids equal where the top-2 gap > 2%: {}/{}",
            seen.rows,
            b * steps,
            seen.same,
            seen.decided
        );
        assert_eq!(seen.rows, b * steps, "full shape: rows held alike");
        assert!(max <= yx && seen.same == seen.decided, "full shape, batch of {b}: median {med} max {max}");
    }
}

/// One forward pass mixing decode rows and prompt chunks ([`tern_cuda::DeviceModel::forward_seqs`]): 16 decodes at
/// different positions and 3 prompt chunks of different lengths (5, 64 and 130 tokens, one into an empty sequence),
/// interleaved in the item list, against each sequence alone (a decode through the batch-1 graph, a chunk through the
/// one-sequence prefill): each item's last-row logits within transformers' bf16-vs-f32 distance and greedy ids equal
/// where the top-2 gap exceeds 2%, over the items routed alike in every row (tiny-b), or with the routing held to
/// what the sequences alone chose (the full shape, whose random routers have near ties everywhere); then a decode-only
/// pass over all 19 sequences against the batch-1 graph again, so the mixed pass left every state as alone.
#[test]
fn mixed_step_matches_each_sequence_alone() {
    let Some(_g) = gpu_or_skip("mixed_step_matches_each_sequence_alone") else { return };
    let tiny = CudaBackend::new(&tiny_b_q4(), CudaOptions::with_context(512)).unwrap();
    let full = CudaBackend::random(&full_config(), 5, CudaOptions::with_context(512)).unwrap();
    let (ym, yx) = yardstick();
    for (name, be, hold) in [("tiny-b", &tiny, false), ("full shape", &full, true)] {
        let m = &be.model;
        let (v, k, layers) = (m.config.vocab_size, m.config.num_experts_per_tok, m.config.num_layers());
        let log_len = layers * (k + 1);
        // items 0..19: chunks at 2 (5 tokens), 9 (64 tokens, an empty sequence) and 17 (130 tokens)
        let chunk_len = |i: usize| match i {
            2 => Some(5),
            9 => Some(64),
            17 => Some(130),
            _ => None,
        };
        let n = 19;
        let (mut mixed, mut alone) = (Vec::new(), Vec::new());
        for i in 0..n {
            let mut st = be.new_cuda_sequence().unwrap().st;
            if i != 9 {
                st.prefill(m, &prompt(i as u64, 1 + (i * 37) % 150, v), false, false).unwrap();
            }
            let mut twin = st.fork(m, usize::MAX).unwrap();
            twin.route_log = Some(m.gpu.zeros::<i32>(log_len).unwrap());
            alone.push(twin);
            mixed.push(st);
        }
        let ids: Vec<Vec<u32>> = (0..n)
            .map(|i| match chunk_len(i) {
                Some(c) => prompt(100 + i as u64, c, v),
                None => vec![(i * 7919 % v) as u32],
            })
            .collect();
        // alone: logits of each item's last row, and every row's routed experts per layer
        let mut la = Vec::new();
        let mut ra: Vec<Vec<Vec<usize>>> = Vec::new();
        for (i, st) in alone.iter_mut().enumerate() {
            if chunk_len(i).is_some() {
                let out = st.prefill(m, &ids[i], true, true).unwrap();
                la.push(out.logits[(ids[i].len() - 1) * v..].to_vec());
                ra.push(out.routes);
            } else {
                st.set_token(&m.gpu, ids[i][0]).unwrap();
                st.step_graph(m).unwrap();
                la.push(m.gpu.download(&st.logits).unwrap());
                ra.push(logged_routes(be, st));
            }
        }
        // the pass's row order: the chunks' rows, then the decode rows (items in order within each)
        let order: Vec<usize> =
            (0..n).filter(|&i| chunk_len(i).is_some()).chain((0..n).filter(|&i| chunk_len(i).is_none())).collect();
        let mut routes: Vec<Vec<usize>> = vec![Vec::new(); layers];
        if hold {
            routes = (0..layers).map(|li| order.iter().flat_map(|&i| ra[i][li].iter().copied()).collect()).collect();
        }
        let want = vec![RowWant { logits: true, draw: Draw::Argmax(v) }; n];
        let refs: Vec<&[u32]> = ids.iter().map(|c| c.as_slice()).collect();
        let rows = {
            let mut mrefs: Vec<&mut DeviceState> = mixed.iter_mut().collect();
            let ctl = if hold { StepRoutes::Hold(&routes) } else { StepRoutes::Log(&mut routes) };
            m.forward_profiled(&mut mrefs, &refs, &want, None, Some(ctl), true).unwrap()
        };
        // which items were routed alike in every row (held: all)
        let mut alike = vec![true; n];
        let mut r0 = 0;
        for &i in &order {
            let len = ids[i].len();
            alike[i] = (0..layers).all(|li| routes[li][r0 * k..(r0 + len) * k] == ra[i][li][..len * k]);
            r0 += len;
        }
        let (mut dist, mut decided, mut same) = (Vec::new(), 0, 0);
        for (i, row) in rows.iter().enumerate() {
            let (l, t) = (row.logits.as_ref().unwrap(), row.token.as_ref().unwrap().as_ref().unwrap());
            assert_eq!(t.token as usize, argmax(l), "{name} item {i}: the device's greedy draw vs its logits");
            assert_eq!(mixed[i].len, alone[i].len, "{name} item {i}: lengths");
            if !alike[i] {
                continue;
            }
            dist.push(rel(l, &la[i]));
            if top2_gap(&la[i]) > 0.02 {
                decided += 1;
                same += (argmax(l) == argmax(&la[i])) as usize;
            }
        }
        let alike_n = alike.iter().filter(|&&a| a).count();
        let (med, max) = (pct(&dist, 0.5), pct(&dist, 1.0));
        println!(
            "{name}: one pass of 16 decodes + chunks of 5 / 64 / 130 tokens, {alike_n} of {n} items routed alike: \
             logits vs alone median {med:.2e} max {max:.2e} (transformers bf16 vs f32: {ym:.2e} / {yx:.2e}); greedy \
             ids equal where the top-2 gap > 2%: {same}/{decided}"
        );
        assert!(alike_n >= n / 2, "{name}: only {alike_n} of {n} items routed alike");
        assert!(med <= ym && max <= yx, "{name}: the mixed pass's logits farther from alone than bf16 rounding");
        assert!(same == decided, "{name}: greedy ids differ");
        // then every sequence decodes one token in a decode-only pass: the states the mixed pass left behind
        let next: Vec<u32> = la.iter().map(|l| argmax(l) as u32).collect();
        let mut la2 = Vec::new();
        let mut ra2 = Vec::new();
        for (st, &id) in alone.iter_mut().zip(&next) {
            st.set_token(&m.gpu, id).unwrap();
            st.step_graph(m).unwrap();
            la2.push(m.gpu.download(&st.logits).unwrap());
            ra2.push(logged_routes(be, st));
        }
        let mut routes2: Vec<Vec<usize>> =
            (0..layers).map(|li| ra2.iter().flat_map(|r: &Vec<Vec<usize>>| r[li].iter().copied()).collect()).collect();
        let rows2 = {
            let mut mrefs: Vec<&mut DeviceState> = mixed.iter_mut().collect();
            let ctl = if hold { StepRoutes::Hold(&routes2) } else { StepRoutes::Log(&mut routes2) };
            m.decode_seqs_profiled(&mut mrefs, &next, &want, None, Some(ctl)).unwrap()
        };
        let mut dist2 = Vec::new();
        for (i, row) in rows2.iter().enumerate() {
            let routed_alike = hold || (0..layers).all(|li| routes2[li][i * k..(i + 1) * k] == ra2[i][li][..]);
            if alike[i] && routed_alike {
                dist2.push(rel(row.logits.as_ref().unwrap(), &la2[i]));
            }
        }
        let (med2, max2) = (pct(&dist2, 0.5), pct(&dist2, 1.0));
        println!("  then a decode-only pass over all 19: {} compared, median {med2:.2e} max {max2:.2e}", dist2.len());
        assert!(dist2.len() >= n / 2 && med2 <= ym && max2 <= yx, "{name}: the states after the mixed pass");
    }
}

/// Through the backend seam with batched decode and GPU sampling on: five prompts read in one step (one
/// multi-sequence prefill), then steps holding five decodes (plain greedy draws, sampled draws with and without
/// logprobs, a logits row, nothing) and a prompt chunk give every item what the same steps give with both off (the
/// host sampler draws the same ids on the top-k path, up to the batched logits' bf16 rounding); a bad id fails its
/// own item only.
#[test]
fn backend_step_batches_decodes_and_keeps_items_apart() {
    let Some(_g) = gpu_or_skip("backend_step_batches_decodes_and_keeps_items_apart") else { return };
    let w = tiny_b_q4();
    let v = w.config.vocab_size;
    let make = |batched| {
        let opts = CudaOptions { batched_decode: batched, gpu_sampling: batched, ..CudaOptions::with_context(128) };
        CudaSlots::new(CudaBackend::new(&w, opts).unwrap())
    };
    let (on, off) = (make(true), make(false));
    let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
    let hot = SamplingParams { temperature: 0.8, top_k: 20, ..Default::default() };
    let sample = |p| Sample { params: p, seed: 5, history: &[], top_logprobs: Some(3), limit: v, mask: None };
    // each item's result as text, and for a logits row its top-2 gap (a near tie may flip between the two paths)
    let outs = |be: &CudaSlots| -> Vec<(String, f32)> {
        let seqs: Vec<SeqId> = (0..6).map(|_| be.alloc(100).unwrap()).collect();
        // the five prompts in one step (one multi-sequence prefill when batching is on), two of them drawing
        let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(i as u64, 3 + 11 * i, v)).collect();
        let plain = || Sample { top_logprobs: None, ..sample(&greedy) };
        let first: Vec<Want> =
            vec![Want::Nothing, Want::Sample(plain()), Want::Last, Want::Sample(sample(&hot)), Want::Nothing];
        let work: Vec<Work> =
            first.into_iter().enumerate().map(|(i, out)| Work { seq: seqs[i], ids: &prompts[i], out }).collect();
        let mut res = Vec::new();
        for r in be.step(&work) {
            res.push(match r.unwrap() {
                Output::Token(t) => (format!("first token {}", t.token), 1.0),
                Output::Logits(l) => (format!("prompt argmax {}", argmax(&l)), top2_gap(&l)),
                Output::Nothing => ("nothing".into(), 1.0),
                o @ Output::Drafted { .. } => panic!("no verify was asked for: {o:?}"),
            });
        }
        let chunk = prompt(9, 40, v);
        let ids: Vec<[u32; 1]> = (0..5u32).map(|i| [(i * 31 + 2) % v as u32]).collect();
        for round in 0..4 {
            let work = [
                Work { seq: seqs[0], ids: &ids[0], out: Want::Sample(plain()) },
                Work { seq: seqs[1], ids: &ids[1], out: Want::Sample(sample(&hot)) },
                Work { seq: seqs[2], ids: &ids[2], out: Want::Last },
                Work { seq: seqs[3], ids: &ids[3], out: Want::Nothing },
                Work { seq: seqs[4], ids: &ids[4], out: Want::Sample(sample(&greedy)) },
                Work { seq: seqs[5], ids: if round == 0 { &chunk } else { &ids[0] }, out: Want::Last },
            ];
            for r in be.step(&work) {
                res.push(match r.unwrap() {
                    Output::Token(t) => (format!("token {}", t.token), 1.0),
                    // logits rows: the argmax (the values differ by bf16 rounding between the two paths)
                    Output::Logits(l) => (format!("argmax {}", argmax(&l)), top2_gap(&l)),
                    Output::Nothing => ("nothing".into(), 1.0),
                    o @ Output::Drafted { .. } => panic!("no verify was asked for: {o:?}"),
                });
            }
        }
        // a fresh sequence's sampled decodes alone: the batch-1 graph, then the GPU sampler (on) or the host's (off)
        // on the same logits (the top-k path: the same ids)
        let lone = be.alloc(100).unwrap();
        be.step(&[Work { seq: lone, ids: &prompt(7, 20, v), out: Want::Nothing }]);
        for r in 0..6u32 {
            let id = [(r * 13 + 1) % v as u32];
            let one = be.step(&[Work { seq: lone, ids: &id, out: Want::Sample(sample(&hot)) }]);
            res.push(match one.into_iter().next().unwrap().unwrap() {
                Output::Token(t) => (format!("alone token {}", t.token), 1.0),
                o => panic!("{o:?}"),
            });
        }
        // a bad id fails alone
        let bad = [v as u32];
        let r = be.step(&[
            Work { seq: seqs[0], ids: &ids[0], out: Want::Sample(plain()) },
            Work { seq: seqs[1], ids: &bad, out: Want::Nothing },
            Work { seq: seqs[2], ids: &ids[2], out: Want::Sample(plain()) },
        ]);
        assert!(r[0].is_ok() && r[2].is_ok(), "good items of a step with a bad one failed");
        let e = r[1].as_ref().unwrap_err();
        assert!(format!("{e:#}").contains("outside the vocabulary"), "{e:#}");
        res
    };
    let (a, b) = (outs(&on), outs(&off));
    assert_eq!(a.len(), b.len());
    // the batched passes' logits differ from the one-by-one path's by bf16 rounding (GEMMs over bf16 activations vs
    // the graph's f32 GEMVs): a logits row's argmax must agree where its top-2 gap exceeds 2%; a drawn token (no
    // logits to judge the tie by) may flip now and then, a tenth of them would be a real difference; every kind of
    // output must match (an item given another's result, or none, shows there)
    let kind = |s: &str| s.split(' ').next().unwrap_or("").to_string();
    let differ: Vec<_> = a.iter().zip(&b).enumerate().filter(|(_, (x, y))| x.0 != y.0).collect();
    let logits_flips = differ.iter().filter(|(_, (x, y))| x.0.contains("argmax") && y.1 > 0.02).count();
    let tokens = b.iter().filter(|r| r.0.contains("token")).count();
    let token_flips = differ.iter().filter(|(_, (x, _))| x.0.contains("token")).count();
    println!("backend step, batched vs one by one: {} of {} item results differ: {differ:?}", differ.len(), a.len());
    assert!(a.iter().zip(&b).all(|(x, y)| kind(&x.0) == kind(&y.0)), "an item got another kind of result");
    assert_eq!(logits_flips, 0, "argmax of a logits row differs where its top-2 gap exceeds 2%: {differ:?}");
    assert!(token_flips <= (tokens / 10).max(2), "{token_flips} of {tokens} drawn tokens differ: {differ:?}");
}

/// Every kind of draw in one batched step, each against the sampler's reference on the logits row the step itself
/// produced (so the comparison is exact): nothing, greedy below a limit, sampled, sampled with logprobs, a mask that
/// allows a few ids (waited for after the pass is enqueued), and a bad request, which fails its own row alone.
#[test]
fn batched_draws_match_the_sampler_on_their_rows() {
    let Some(_g) = gpu_or_skip("batched_draws_match_the_sampler_on_their_rows") else { return };
    let w = tiny_b_q4();
    let v = w.config.vocab_size;
    let be = CudaBackend::new(&w, CudaOptions::with_context(64)).unwrap();
    let m = &be.model;
    let hot = SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.95, ..Default::default() };
    let wide = SamplingParams { temperature: 1.0, ..Default::default() };
    let mut words = vec![0u32; v.div_ceil(32)];
    for id in [3usize, 77, 200, 201, v - 1] {
        words[id / 32] |= 1 << (id % 32);
    }
    let slot = MaskSlot::pending();
    let draw = |p, seed, top: Option<usize>, mask| Sample {
        params: p,
        seed,
        history: &[5, 5, 9],
        top_logprobs: top,
        limit: v,
        mask,
    };
    let samples = [
        draw(&hot, 1, None, None),
        draw(&wide, 2, Some(3), None),
        draw(&wide, 3, None, Some(&slot)),
        draw(&hot, 4, Some(99), None), // more top logprobs than the sampler returns: this row fails alone
    ];
    let want = [
        RowWant { logits: true, draw: Draw::Nothing },
        RowWant { logits: true, draw: Draw::Argmax(v / 2) },
        RowWant { logits: true, draw: Draw::Sample(&samples[0]) },
        RowWant { logits: true, draw: Draw::Sample(&samples[1]) },
        RowWant { logits: true, draw: Draw::Sample(&samples[2]) },
        RowWant { logits: true, draw: Draw::Sample(&samples[3]) },
    ];
    let mut states: Vec<DeviceState> = (0..want.len()).map(|_| be.new_cuda_sequence().unwrap().st).collect();
    for (i, st) in states.iter_mut().enumerate() {
        st.prefill(m, &prompt(i as u64, 5 + i, v), false, false).unwrap();
    }
    let mut refs: Vec<&mut DeviceState> = states.iter_mut().collect();
    let ids: Vec<u32> = (0..want.len() as u32).collect();
    // the mask arrives from another thread while the step runs (as the constraint workers fill it)
    let rows = std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            slot.fill(Ok(Some(words.clone())));
        });
        m.decode_seqs(&mut refs, &ids, &want).unwrap()
    });
    assert!(rows[0].token.is_none());
    let l1 = rows[1].logits.as_ref().unwrap();
    let t1 = rows[1].token.as_ref().unwrap().as_ref().unwrap().token as usize;
    assert_eq!(t1, argmax(&l1[..v / 2]), "greedy below the limit");
    for (r, s) in [(2, &samples[0]), (3, &samples[1]), (4, &samples[2])] {
        let mut one = SampleBatch::new(v).unwrap();
        let mask = s.mask.and_then(|m| m.wait().unwrap());
        one.push(s, mask).unwrap();
        let l = rows[r].logits.as_ref().unwrap();
        let want = &sample_reference(l, &one).unwrap()[0];
        let got = rows[r].token.as_ref().unwrap().as_ref().unwrap();
        assert_eq!(got.token, want.out.token, "row {r}: batched draw vs the reference on its own row");
        if let Some(lp) = &got.logprob {
            assert!((lp.logprob - want.out.logprob).abs() < 1e-5, "row {r}: logprob");
            assert_eq!(lp.top.len(), 3);
        }
        if s.mask.is_some() {
            assert!(mask_allows(&words, got.token), "row {r}: drew {} outside the mask", got.token);
        }
    }
    let e = rows[5].token.as_ref().unwrap().as_ref().unwrap_err();
    assert!(format!("{e:#}").contains("top_logprobs"), "{e:#}");
    println!(
        "batched draws: greedy {t1}, sampled/logprobs/masked rows equal to the reference on their rows; bad row: {e:#}"
    );
}

/// A multi-sequence prefill (several prompt chunks in one pass, sequences at different positions, one empty) leaves
/// every sequence exactly as its own prefill does: the last row's logits equal bit for bit those of the one-sequence
/// prefill's all-positions lm_head, and the next decode steps (the batch-1 graph) give bit-identical logits; the
/// tiny-b fixture and the full shape. Two sets of chunks: passes of at most `STREAM_MAX_TOKENS` (the streamed expert
/// kernels, alone and together) and chunks each over it (the grouped GEMMs).
#[test]
fn multi_sequence_prefill_equals_each_prefill_alone() {
    let Some(_g) = gpu_or_skip("multi_sequence_prefill_equals_each_prefill_alone") else { return };
    let full = CudaBackend::random(&full_config(), 5, CudaOptions::with_context(2048)).unwrap();
    let tiny = CudaBackend::new(&tiny_b_q4(), CudaOptions::with_context(2048)).unwrap();
    let small = [2usize, 65, 1, 100, 17, 64];
    assert!(small.iter().sum::<usize>() <= tern_cuda::prefill::STREAM_MAX_TOKENS);
    let big = [900usize, 769];
    assert!(big.iter().all(|&b| b > tern_cuda::prefill::STREAM_MAX_TOKENS));
    for (name, be, lens) in [
        ("tiny-b", &tiny, &small[..]),
        ("tiny-b", &tiny, &big),
        ("full shape", &full, &small),
        ("full shape", &full, &big),
    ] {
        let m = &be.model;
        let v = m.config.vocab_size;
        let held = &[0usize, 1, 63, 64, 100, 7][..lens.len()];
        let chunks: Vec<Vec<u32>> = (0..lens.len()).map(|s| prompt(40 + s as u64, lens[s], v)).collect();
        let (mut multi, mut alone): (Vec<DeviceState>, Vec<DeviceState>) = (Vec::new(), Vec::new());
        for (s, &h) in held.iter().enumerate() {
            let mut st = be.new_cuda_sequence().unwrap().st;
            if h > 0 {
                st.prefill(m, &prompt(s as u64, h, v), false, false).unwrap();
            }
            alone.push(st.fork(m, usize::MAX).unwrap());
            multi.push(st);
        }
        let want = vec![RowWant { logits: true, draw: Draw::Argmax(v) }; chunks.len()];
        let refs: Vec<&[u32]> = chunks.iter().map(|c| c.as_slice()).collect();
        let mut mrefs: Vec<&mut DeviceState> = multi.iter_mut().collect();
        let rows = m.prefill_seqs(&mut mrefs, &refs, &want).unwrap();
        for (s, (row, st)) in rows.iter().zip(alone.iter_mut()).enumerate() {
            let all = st.prefill(m, &chunks[s], true, false).unwrap().logits;
            let last = &all[(chunks[s].len() - 1) * v..];
            let got = row.logits.as_ref().unwrap();
            let differ = got.iter().zip(last).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(
                differ,
                0,
                "{name} row {s}: {differ} logits differ from its own prefill ({:.1e})",
                rel(got, last)
            );
            let t = row.token.as_ref().unwrap().as_ref().unwrap().token as usize;
            assert_eq!(t, argmax(got), "{name} row {s}: the greedy draw vs its logits");
            assert_eq!(multi[s].len, st.len, "{name} row {s}: lengths");
        }
        // the states: three batch-1 decode steps each, bit for bit
        for step in 0..3u32 {
            for (s, (a, b)) in multi.iter_mut().zip(alone.iter_mut()).enumerate() {
                let id = (step * 31 + s as u32 * 7) % v as u32;
                for st in [&mut *a, &mut *b] {
                    st.set_token(&m.gpu, id).unwrap();
                    st.step_graph(m).unwrap();
                }
                let (la, lb) = (m.gpu.download(&a.logits).unwrap(), m.gpu.download(&b.logits).unwrap());
                let same = la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{name} row {s} step {step}: decode after the multi-sequence prefill differs");
            }
        }
        println!(
            "{name}: multi-sequence prefill of chunks {lens:?} = each prefill alone, bit for bit (then 3 decode steps)"
        );
    }
}

/// Bad input to the batched step is a clear error and changes no sequence.
#[test]
fn batched_decode_rejects_bad_input() {
    let Some(_g) = gpu_or_skip("batched_decode_rejects_bad_input") else { return };
    let w = tiny_b_q4();
    let v = w.config.vocab_size;
    let be = CudaBackend::new(&w, CudaOptions::with_context(8)).unwrap();
    let m = &be.model;
    let (mut a, mut b) = (be.new_cuda_sequence().unwrap().st, be.new_cuda_sequence().unwrap().st);
    let want = [RowWant { logits: false, draw: Draw::Argmax(v) }; 2];
    let e = m.decode_seqs(&mut [&mut a, &mut b], &[1, v as u32], &want).unwrap_err();
    assert!(format!("{e:#}").contains("outside the vocabulary"), "{e:#}");
    assert_eq!((a.len, b.len), (0, 0));
    b.prefill(m, &[1; 8], false, false).unwrap();
    let e = m.decode_seqs(&mut [&mut a, &mut b], &[1, 2], &want).unwrap_err();
    assert!(format!("{e:#}").contains("context full"), "{e:#}");
    assert_eq!((a.len, b.len), (0, 8));
    let e = m.decode_seqs(&mut [&mut a], &[1, 2], &want).unwrap_err();
    assert!(format!("{e:#}").contains("ids"), "{e:#}");
    let ok = m.decode_seqs(&mut [&mut a], &[1], &want[..1]).unwrap();
    assert_eq!((ok.len(), a.len), (1, 1));
    println!("batched decode bad input: clear errors, no sequence changed; still works");
}

/// The batched pass replayed as a CUDA graph gives exactly what its kernels launched one by one give: the same
/// sequences twice, one set stepped with graphs and one without, in batches of 3, then 2 (another graph), then 3
/// other sequences (the first graph at new positions with other pointer tables), for several rounds.
#[test]
fn batched_graph_equals_launches() {
    let Some(_g) = gpu_or_skip("batched_graph_equals_launches") else { return };
    let w = tiny_b_q4();
    let be = CudaBackend::new(&w, CudaOptions::with_context(256)).unwrap();
    let m = &be.model;
    let v = m.config.vocab_size;
    let (mut with, mut without) = twins(&be, 5);
    let set = |on: bool| m.prefill.lock().unwrap().graphs = on;
    let groups: [&[usize]; 3] = [&[0, 1, 2], &[3, 4], &[2, 3, 4]];
    let mut steps = 0;
    for round in 0..4 {
        for rows in groups {
            let ids: Vec<u32> = rows.iter().map(|&r| ((r * 131 + round * 17 + 5) % v) as u32).collect();
            let want = vec![RowWant { logits: true, draw: Draw::Argmax(v) }; rows.len()];
            let mut outs = Vec::new();
            for (states, on) in [(&mut with, true), (&mut without, false)] {
                set(on);
                let mut refs: Vec<&mut DeviceState> =
                    states.iter_mut().enumerate().filter(|(i, _)| rows.contains(i)).map(|(_, s)| s).collect();
                outs.push(m.decode_seqs(&mut refs, &ids, &want).unwrap());
                assert_eq!(m.prefill.lock().unwrap().graphs, on, "a capture failed and turned graphs off");
            }
            for (r, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
                assert_eq!(a.logits, b.logits, "round {round} rows {rows:?} row {r}: graph vs launches");
                let (ta, tb) =
                    (a.token.as_ref().unwrap().as_ref().unwrap(), b.token.as_ref().unwrap().as_ref().unwrap());
                assert_eq!(ta.token, tb.token, "round {round} rows {rows:?} row {r}: greedy ids");
            }
            steps += 1;
        }
    }
    set(true);
    println!("batched pass as a graph = launched one by one, bit for bit: {steps} steps of 2-3 of 5 sequences");
}

/// Speculative verify rows in one forward pass ([`tern_cuda::DeviceModel::forward_items`]): three sequences (one
/// empty, two at positions 20 and 70) each read a token and three drafts as verify rows beside a fourth sequence's
/// decode row. Against the same tokens decoded one by one (decode passes; the verify pass holds the experts those
/// chose, so every row is compared): every row's logits within transformers' bf16-vs-f32 distance, greedy ids equal
/// where the top-2 gap exceeds 2%. Then the pass keeps 1, 3 and 4 of the rows, and the sequences go on as copies that
/// decoded only the kept tokens: the next three decode passes' logits within the same bound (a commit of the wrong
/// rows, GDN state or conv inputs is far outside it). And the verify pass as a captured graph equals its launches one
/// by one, bit for bit.
#[test]
fn verify_rows_match_decoding_and_keep_the_accepted_rows() {
    use tern_cuda::forward::{ItemWant, RowOut};
    let Some(_g) = gpu_or_skip("verify_rows_match_decoding_and_keep_the_accepted_rows") else { return };
    let tiny = CudaBackend::new(&tiny_b_q4(), CudaOptions::with_context(512)).unwrap();
    let full = CudaBackend::random(&full_config(), 7, CudaOptions::with_context(512)).unwrap();
    let (ym, yx) = yardstick();
    for (name, be) in [("tiny-b", &tiny), ("full shape", &full)] {
        let m = &be.model;
        let (v, k, layers) = (m.config.vocab_size, m.config.num_experts_per_tok, m.config.num_layers());
        let (rows_per, kept, lens) = (4usize, [1usize, 3, 4], [0usize, 20, 70, 33]);
        let want1 = RowWant { logits: true, draw: Draw::Argmax(v) };
        let fresh = |i: usize| {
            let mut st = be.new_cuda_sequence().unwrap().st;
            if lens[i] > 0 {
                st.prefill(m, &prompt(i as u64, lens[i], v), false, false).unwrap();
            }
            st
        };
        // V verifies, B decodes every token one by one (its logits are the rows'), C decodes only the kept tokens
        let mut vs: Vec<DeviceState> = (0..4).map(fresh).collect();
        let mut bs: Vec<DeviceState> = vs.iter().map(|s| s.fork(m, usize::MAX).unwrap()).collect();
        let mut cs: Vec<DeviceState> = vs[..3].iter().map(|s| s.fork(m, usize::MAX).unwrap()).collect();
        let mut gs: Vec<DeviceState> = vs.iter().map(|s| s.fork(m, usize::MAX).unwrap()).collect();
        let mut ls: Vec<DeviceState> = vs.iter().map(|s| s.fork(m, usize::MAX).unwrap()).collect();
        let toks: Vec<Vec<u32>> = (0..4).map(|i| prompt(200 + i as u64, if i < 3 { rows_per } else { 1 }, v)).collect();
        // per sequence, per row: B's logits and experts per layer
        let mut lb: Vec<Vec<Vec<f32>>> = vec![vec![]; 4];
        let mut rb: Vec<Vec<Vec<Vec<usize>>>> = vec![vec![]; 4];
        for j in 0..rows_per {
            let live: Vec<usize> = (0..4).filter(|&i| j < toks[i].len()).collect();
            let mut refs: Vec<&mut DeviceState> =
                bs.iter_mut().enumerate().filter(|(i, _)| live.contains(i)).map(|(_, s)| s).collect();
            let ids: Vec<u32> = live.iter().map(|&i| toks[i][j]).collect();
            let mut routes = vec![Vec::new(); layers];
            let want = vec![want1; live.len()];
            let rows =
                m.decode_seqs_profiled(&mut refs, &ids, &want, None, Some(StepRoutes::Log(&mut routes))).unwrap();
            for (r, (&i, row)) in live.iter().zip(rows).enumerate() {
                lb[i].push(row.logits.unwrap());
                rb[i].push((0..layers).map(|li| routes[li][r * k..(r + 1) * k].to_vec()).collect());
            }
        }
        // the pass's rows: the decode row (item 3), then the verify rows of items 0, 1, 2
        let order = [3usize, 0, 1, 2];
        let held: Vec<Vec<usize>> = (0..layers)
            .map(|li| order.iter().flat_map(|&i| rb[i].iter().flat_map(move |r| r[li].iter().copied())).collect())
            .collect();
        let items: Vec<ItemWant> = (0..4)
            .map(|i| if i < 3 { ItemWant::Verify(vec![want1; rows_per]) } else { ItemWant::Last(want1) })
            .collect();
        let refs: Vec<&[u32]> = toks.iter().map(|x| x.as_slice()).collect();
        let mut asked = Vec::new();
        let out = {
            let mut mrefs: Vec<&mut DeviceState> = vs.iter_mut().collect();
            let mut accept = |i: usize, rows: &[RowOut]| -> anyhow::Result<usize> {
                asked.push((i, rows.len()));
                Ok(kept[i])
            };
            m.forward_items(&mut mrefs, &refs, &items, None, Some(StepRoutes::Hold(&held)), true, false, &mut accept)
                .unwrap()
                .rows
        };
        asked.sort();
        assert_eq!(asked, vec![(0, rows_per), (1, rows_per), (2, rows_per)], "{name}: accept asked per verify");
        let (mut dist, mut decided, mut same) = (Vec::new(), 0, 0);
        for i in 0..4 {
            assert_eq!(out[i].len(), toks[i].len(), "{name} item {i}: rows returned");
            for (j, row) in out[i].iter().enumerate() {
                let (l, t) = (row.logits.as_ref().unwrap(), row.token.as_ref().unwrap().as_ref().unwrap());
                assert_eq!(t.token as usize, argmax(l), "{name} item {i} row {j}: the greedy draw vs its logits");
                dist.push(rel(l, &lb[i][j]));
                if top2_gap(&lb[i][j]) > 0.02 {
                    decided += 1;
                    same += (argmax(l) == argmax(&lb[i][j])) as usize;
                }
            }
        }
        let (med, max) = (pct(&dist, 0.5), pct(&dist, 1.0));
        println!(
            "{name}: a pass of one decode row and 3 verifies of 4 rows, routing held: logits vs decoding one by one \
             median {med:.2e} max {max:.2e} (transformers bf16 vs f32: {ym:.2e} / {yx:.2e}); greedy ids equal where \
             the top-2 gap > 2%: {same}/{decided}"
        );
        assert!(med <= ym && max <= yx && same == decided, "{name}: verify rows differ from decoding");
        for i in 0..3 {
            assert_eq!(vs[i].len, lens[i] + kept[i], "{name}: sequence {i} holds its kept rows");
        }
        assert_eq!(vs[3].len, lens[3] + 1, "{name}: the decode row");
        // C decodes the kept tokens; then V and C decode three more tokens each (V holds C's experts)
        for (i, c) in cs.iter_mut().enumerate() {
            for &tok in &toks[i][..kept[i]] {
                m.decode_seqs(&mut [&mut *c], &[tok], &[want1]).unwrap();
            }
        }
        let mut after = Vec::new();
        for step in 0..3 {
            let ids: Vec<u32> = (0..3).map(|i| ((step * 131 + i * 977 + 11) % v) as u32).collect();
            let mut routes = vec![Vec::new(); layers];
            let lc = {
                let mut refs: Vec<&mut DeviceState> = cs.iter_mut().collect();
                let ctl = Some(StepRoutes::Log(&mut routes));
                m.decode_seqs_profiled(&mut refs, &ids, &[want1; 3], None, ctl).unwrap()
            };
            let lv = {
                let mut refs: Vec<&mut DeviceState> = vs[..3].iter_mut().collect();
                m.decode_seqs_profiled(&mut refs, &ids, &[want1; 3], None, Some(StepRoutes::Hold(&routes))).unwrap()
            };
            for (a, b) in lv.iter().zip(&lc) {
                after.push(rel(a.logits.as_ref().unwrap(), b.logits.as_ref().unwrap()));
            }
        }
        let (med, max) = (pct(&after, 0.5), pct(&after, 1.0));
        println!("  then 3 decode passes after keeping 1 / 3 / 4 rows: logits vs the kept tokens decoded alone median {med:.2e} max {max:.2e}");
        assert!(med <= ym && max <= yx, "{name}: the state after the commit differs from decoding the kept tokens");
        // the same verify pass as a captured graph and launched one by one
        let mut outs = Vec::new();
        for (states, graphs) in [(&mut gs, true), (&mut ls, false)] {
            m.prefill.lock().unwrap().graphs = graphs;
            let mut mrefs: Vec<&mut DeviceState> = states.iter_mut().collect();
            let mut accept = |i: usize, _: &[RowOut]| -> anyhow::Result<usize> { Ok(kept[i]) };
            let o = m.forward_items(&mut mrefs, &refs, &items, None, None, true, false, &mut accept).unwrap().rows;
            assert_eq!(m.prefill.lock().unwrap().graphs, graphs, "{name}: a capture failed and turned graphs off");
            outs.push(o);
        }
        for (a, b) in outs[0].iter().flatten().zip(outs[1].iter().flatten()) {
            assert_eq!(a.logits, b.logits, "{name}: the verify pass as a graph vs launched one by one");
        }
        let ids: Vec<u32> = (0..4).map(|i| (i * 31 + 5) as u32).collect();
        let mut next: Vec<Vec<RowOut>> = Vec::new();
        for states in [&mut gs, &mut ls] {
            let mut refs: Vec<&mut DeviceState> = states.iter_mut().collect();
            next.push(m.decode_seqs(&mut refs, &ids, &[want1; 4]).unwrap());
        }
        for (a, b) in next[0].iter().zip(&next[1]) {
            assert_eq!(a.logits, b.logits, "{name}: after the graphed and launched verifies");
        }
        println!("  the verify pass as a graph = launched one by one, and the decode after it, bit for bit");
    }
}

/// Speculative decoding through the backend seam (`CudaOptions::speculative`: verify rows in the one-forward pass,
/// the MTP block on the device) on a constructed checkpoint whose MTP block agrees with the model a chosen fraction
/// of the time (`tern random-model --mtp-accept 0.8,0.5375`, mlx 4-bit, tiny-mtp-a's layout at width 512): for five
/// prompts, 60 greedy tokens with 3 drafts a step are the tokens of plain greedy decoding (the batch-1 graph), one
/// for one; the first drafts are right about 80% of the time and a step yields more than one token on average.
#[test]
fn speculative_greedy_equals_plain_on_the_device() {
    use tern_engine::Verify;
    use tern_model::random::MtpAccept;
    let Some(_g) = gpu_or_skip("speculative_greedy_equals_plain_on_the_device") else { return };
    let accept: MtpAccept = "0.8,0.5375".parse().unwrap();
    let w = mtp_model_q4(512, 2048, Some(accept), 5);
    let opts = CudaOptions::with_context(256);
    let be = CudaBackend::new(&w, opts).unwrap();
    let spec = CudaSlots::new(CudaBackend { model: be.model.clone(), opts: CudaOptions { speculative: true, ..opts } });
    let plain = CudaSlots::new(be);
    assert_eq!((plain.max_drafts(), spec.max_drafts()), (0, 4));
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let v = plain.vocab_size();
    let s = || Sample { params: &greedy, seed: 0, history: &[], top_logprobs: None, limit: v, mask: None };
    let (k, n) = (3usize, 60usize);
    let (mut steps, mut tokens, mut first, mut first_right) = (0usize, 0usize, 0usize, 0usize);
    for p in 0..5u64 {
        let prompt = prompt(p, 5 + 9 * p as usize, v);
        // plain: device argmax through the batch-1 graph
        let seq = plain.alloc(prompt.len() + n + 1).unwrap();
        let mut want = Vec::new();
        let mut ids = prompt.clone();
        for _ in 0..n {
            let out = plain.step(&[Work { seq, ids: &ids, out: Want::Sample(s()) }]).pop().unwrap().unwrap();
            let Output::Token(t) = out else { panic!("plain: {out:?}") };
            want.push(t.token);
            ids = vec![t.token];
        }
        plain.free(seq);
        // speculative: the prompt with one draw and k drafts, then verifies of the last token and its drafts
        let seq = spec.alloc(prompt.len() + n + 2 * (k + 1)).unwrap();
        let mut got: Vec<u32> = Vec::new();
        let mut ids = prompt.clone();
        let mut draws = 1;
        while got.len() < n {
            let out = Want::Verify(Verify { draws: (0..draws).map(|_| s()).collect(), drafts: k });
            let r = spec.step(&[Work { seq, ids: &ids, out }]).pop().unwrap().unwrap();
            let Output::Drafted { tokens: t, drafts } = r else { panic!("speculative: {r:?}") };
            if draws > 1 {
                steps += 1;
                tokens += t.len();
                first += 1;
                first_right += (t.len() > 1) as usize;
            }
            got.extend(t.iter().map(|s| s.token));
            assert!(drafts.len() <= k, "{} drafts for {k} asked", drafts.len());
            ids = std::iter::once(got[got.len() - 1]).chain(drafts).collect();
            draws = ids.len();
        }
        spec.free(seq);
        got.truncate(n);
        assert_eq!(got, want, "prompt {p}: speculative greedy differs from plain greedy");
    }
    let (per_step, rate) = (tokens as f64 / steps as f64, first_right as f64 / first as f64);
    println!(
        "speculative greedy on the device = plain greedy, 5 prompts x {n} tokens; {per_step:.2} tokens a verify step, \
         first drafts right {rate:.2} (asked 0.80)"
    );
    assert!(per_step > 1.5 && (0.65..=0.95).contains(&rate), "drafting on the device: {per_step} {rate}");
}

/// The launch rule (gpu.rs `KLaunch`: what a kernel reads before its `pdl_wait()` was written two or more launches
/// back) holds for every kernel of every pass kind: the same work with programmatic dependent launch on and off gives
/// the same bits. Per setting, fresh sequences of tiny-b and of the full shape: one-sequence prefills of 100 and 900
/// tokens (the streamed experts and the grouped GEMMs; every row's logits), a multi-sequence prefill, two batched
/// decode passes (launched one by one) and two batch-1 steps (launched one by one).
#[test]
fn passes_are_the_same_bits_with_and_without_pdl() {
    let Some(_g) = gpu_or_skip("passes_are_the_same_bits_with_and_without_pdl") else { return };
    let tiny = CudaBackend::new(&tiny_b_q4(), CudaOptions::with_context(2048)).unwrap();
    let full = CudaBackend::random(&full_config(), 9, CudaOptions::with_context(2048)).unwrap();
    for (name, be) in [("tiny-b", &tiny), ("full shape", &full)] {
        let m = &be.model;
        let v = m.config.vocab_size;
        m.prefill.lock().unwrap().graphs = false;
        let mut runs: Vec<Vec<(String, Vec<u32>)>> = Vec::new();
        for pdl in [true, false] {
            m.gpu.pdl.store(pdl, std::sync::atomic::Ordering::Relaxed);
            let mut out: Vec<(String, Vec<u32>)> = Vec::new();
            let mut put = |what: String, l: &[f32]| out.push((what, l.iter().map(|x| x.to_bits()).collect()));
            let mut seqs: Vec<DeviceState> = (0..4).map(|_| be.new_cuda_sequence().unwrap().st).collect();
            for (s, n) in [(1usize, 100usize), (2, 900)] {
                let all = seqs[s].prefill(m, &prompt(s as u64, n, v), true, false).unwrap().logits;
                put(format!("prefill of {n}"), &all);
            }
            let chunks: Vec<Vec<u32>> = (0..3).map(|s| prompt(50 + s as u64, [5, 64, 130][s], v)).collect();
            let refs: Vec<&[u32]> = chunks.iter().map(|c| c.as_slice()).collect();
            let want = vec![RowWant { logits: true, draw: Draw::Argmax(v) }; 3];
            let mut mrefs: Vec<&mut DeviceState> = seqs[1..].iter_mut().collect();
            for (s, row) in m.prefill_seqs(&mut mrefs, &refs, &want).unwrap().iter().enumerate() {
                put(format!("multi-sequence prefill row {s}"), row.logits.as_ref().unwrap());
            }
            for step in 0..2u32 {
                let ids: Vec<u32> = (0..4u32).map(|s| (step * 131 + s * 17 + 5) % v as u32).collect();
                let want = vec![RowWant { logits: true, draw: Draw::Argmax(v) }; 4];
                let mut refs: Vec<&mut DeviceState> = seqs.iter_mut().collect();
                for (s, row) in m.decode_seqs(&mut refs, &ids, &want).unwrap().iter().enumerate() {
                    put(format!("batched step {step} row {s}"), row.logits.as_ref().unwrap());
                }
            }
            for step in 0..2u32 {
                seqs[3].set_token(&m.gpu, (step * 7 + 3) % v as u32).unwrap();
                seqs[3].step_plain(m, None).unwrap();
                put(format!("batch-1 step {step}"), &m.gpu.download(&seqs[3].logits).unwrap());
            }
            runs.push(out);
        }
        m.gpu.pdl.store(true, std::sync::atomic::Ordering::Relaxed);
        m.prefill.lock().unwrap().graphs = true;
        assert_eq!(runs[0].len(), runs[1].len());
        for ((what, a), (_, b)) in runs[0].iter().zip(&runs[1]) {
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            assert_eq!(differ, 0, "{name} {what}: {differ} of {} logits differ with PDL off", a.len());
        }
        println!("{name}: {} outputs the same bits with programmatic dependent launch on and off", runs[0].len());
    }
}
