//! Continuous batching on the CPU backend with a random model of the real vocabulary: batched requests produce
//! exactly what each produces alone, a long prompt never pauses running streams, a backend too small for the
//! load queues or refuses, a panic or an error stays with its request, a queued request whose client left is
//! never computed, and the prefix cache serves multi-turn chats within its byte bound. Every scheduling claim is
//! checked on the recorded steps, not on wall time.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{drain, greedy, prompt, submit_together, Recorder};
use tern_engine::{CpuBackend, Engine, EngineConfig, Event, FinishReason, Request, SeqId};
use tern_model::State;
use tern_text::{ChatOptions, ChatTemplate, IM_END_ID, IM_START_ID};

fn done_usage(e: &Event) -> tern_engine::Usage {
    match e {
        Event::Done { usage, .. } => *usage,
        e => panic!("expected Done, got {e:?}"),
    }
}

/// Requests of every shape: short and long prompts, greedy and seeded sampling, logprobs.
fn mixed_requests() -> Vec<Request> {
    let mut reqs: Vec<Request> =
        [5, 40, 1, 23, 70, 9].iter().enumerate().map(|(i, &n)| greedy(prompt(i as u32, n), 10)).collect();
    reqs[1].sampling =
        tern_text::SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.95, seed: Some(5), ..Default::default() };
    reqs[3].sampling.repetition_penalty = 1.3;
    reqs[4].logprobs = Some(3);
    reqs
}

#[test]
fn concurrent_requests_produce_exactly_what_each_produces_alone() {
    let (tok, w) = real_or_skip!("concurrent_requests_produce_exactly_what_each_produces_alone");
    let reqs = mixed_requests();
    // Alone: one request at a time, no cache.
    let alone_cfg = EngineConfig { prefix_cache_bytes: 0, ..EngineConfig::default() };
    let alone = Engine::start(Arc::new(CpuBackend::new(w.clone())), tok.clone(), alone_cfg);
    let want: Vec<(Vec<u32>, Event)> = reqs.iter().map(|r| drain(alone.submit(r.clone()).unwrap())).collect();
    // Together, with a small step budget so that prompts are chunked beside other sequences' decodes.
    let rec = Arc::new(Recorder::new(CpuBackend::new(w)));
    let cfg = EngineConfig { step_tokens: 24, ..EngineConfig::default() };
    let engine = Engine::start(rec.clone(), tok, cfg);
    let rxs = submit_together(&engine, &rec, &reqs);
    let got: Vec<(Vec<u32>, Event)> = rxs.into_iter().map(drain).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "request {i}: batched ids differ from alone");
        assert_eq!(g.1, w.1, "request {i}: final event differs");
        assert_eq!(g.0.len(), 10);
    }
    let steps = rec.steps();
    let widest = steps.iter().map(|s| s.len()).max().unwrap();
    assert!(widest >= 6, "the requests were not batched (at most {widest} per step)");
    assert!(steps.iter().all(|s| s.iter().map(|i| i.n).sum::<usize>() <= 24), "a step read more than its budget");
    println!(
        "{} requests, {} steps, up to {widest} sequences per step: ids identical to each alone",
        reqs.len(),
        steps.len()
    );
}

#[test]
fn a_long_prompt_admitted_while_8_streams_run_does_not_pause_them() {
    let (tok, w) = real_or_skip!("a_long_prompt_admitted_while_8_streams_run_does_not_pause_them");
    let rec = Arc::new(Recorder::new(CpuBackend::new(w)));
    let budget = 32;
    let cfg = EngineConfig { step_tokens: budget, prefix_cache_bytes: 0, ..EngineConfig::default() };
    let engine = Engine::start(rec.clone(), tok, cfg);
    let streams: Vec<_> = (0..8).map(|i| engine.submit(greedy(prompt(i, 6), 48)).unwrap()).collect();
    for rx in &streams {
        assert!(matches!(rx.recv().unwrap(), Event::Token { .. }));
    }
    let long = prompt(99, 300);
    let (long_toks, long_done) = drain(engine.submit(greedy(long.clone(), 4)).unwrap());
    assert_eq!(long_toks.len(), 4, "{long_done:?}");
    for rx in streams {
        let (toks, done) = drain(rx);
        assert_eq!(toks.len(), 47, "{done:?}");
    }
    let steps = rec.steps();
    // Which sequence is which: the long prompt's starts with its first id; streams read 6 ids first.
    let long_seq = steps.iter().flatten().find(|i| i.ids[0] == long[0] && i.n > 1).map(|i| i.seq).unwrap();
    // The steps in which each stream drew a token: its first (the end of its prompt) and every decode after.
    let mut draws: BTreeMap<SeqId, Vec<usize>> = BTreeMap::new();
    for (s, items) in steps.iter().enumerate() {
        assert!(items.iter().map(|i| i.n).sum::<usize>() <= budget, "step {s} read more than {budget} tokens");
        for i in items.iter().filter(|i| i.seq != long_seq && i.sample) {
            draws.entry(i.seq).or_default().push(s);
        }
    }
    assert_eq!(draws.len(), 8);
    let chunk_steps: Vec<usize> =
        (0..steps.len()).filter(|&s| steps[s].iter().any(|i| i.seq == long_seq && !i.sample)).collect();
    assert!(chunk_steps.len() >= 300 / budget, "the long prompt was not chunked: {} chunks", chunk_steps.len());
    for (seq, at) in &draws {
        // A stream draws a token in every step from its first to its last: never paused, not even for one step.
        assert_eq!(at.len(), 48, "{seq}");
        assert_eq!(at[at.len() - 1] - at[0] + 1, at.len(), "{seq} skipped steps: drew at {at:?}");
        let (first, last) = (at[0], at[at.len() - 1]);
        assert!(
            first < chunk_steps[0] && chunk_steps[chunk_steps.len() - 1] < last,
            "{seq} was not running while the long prompt was read (tokens {first}..={last}, chunks {chunk_steps:?})"
        );
    }
    println!(
        "300-token prompt read in {} chunks of at most {} tokens while 8 streams decoded in every step",
        chunk_steps.len(),
        budget - 8
    );
}

#[test]
fn a_backend_too_small_queues_requests_and_refuses_what_cannot_fit() {
    let (tok, w) = real_or_skip!("a_backend_too_small_queues_requests_and_refuses_what_cannot_fit");
    let c = w.config.clone();
    // Room for two sequences of 8 + 12 tokens, not three.
    let per = State::bytes_for(&c, 20);
    let rec = Arc::new(Recorder::new(CpuBackend::with_capacity(w.clone(), 2 * per + per / 2)));
    let engine = Engine::start(rec.clone(), tok.clone(), EngineConfig::default());
    let reqs: Vec<Request> = (0..5).map(|i| greedy(prompt(i, 8), 12)).collect();
    let rxs: Vec<_> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    // More than the whole backend holds: refused at once, with the numbers, while the others run.
    let huge = engine.submit(greedy(prompt(9, 8), 30_000)).unwrap();
    match huge.recv().unwrap() {
        Event::Error(e) => assert!(e.contains("does not fit") && e.contains("30008"), "{e}"),
        e => panic!("expected an error, got {e:?}"),
    }
    let alone = Engine::start(Arc::new(CpuBackend::new(w)), tok, EngineConfig::default());
    for (i, (rx, r)) in rxs.into_iter().zip(&reqs).enumerate() {
        let (got, done) = drain(rx);
        assert!(matches!(done, Event::Done { finish: FinishReason::Length, .. }), "request {i}: {done:?}");
        assert_eq!(got, drain(alone.submit(r.clone()).unwrap()).0, "request {i}");
    }
    let steps = rec.steps();
    let widest = steps.iter().map(|s| s.len()).max().unwrap();
    assert_eq!(widest, 2, "two sequences fit at once, and two ran together");
    println!("5 requests through room for 2: at most {widest} per step over {} steps, all complete", steps.len());
}

#[test]
fn a_panic_or_an_error_in_a_step_fails_only_its_request() {
    let (tok, w) = real_or_skip!("a_panic_or_an_error_in_a_step_fails_only_its_request");
    let (poison, bad) = (247_001, 247_002);
    let mut rec = Recorder::new(CpuBackend::new(w.clone()));
    (rec.panic_on, rec.fail_on) = (Some(poison), Some(bad));
    let rec = Arc::new(rec);
    let engine = Engine::start(rec.clone(), tok.clone(), EngineConfig::default());
    let alone = Engine::start(Arc::new(CpuBackend::new(w)), tok, EngineConfig::default());
    let reqs: Vec<Request> = (0..4).map(|i| greedy(prompt(i, 10 + 5 * i as usize), 10)).collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| drain(alone.submit(r.clone()).unwrap()).0).collect();
    let mut poisoned = greedy(prompt(7, 12), 10);
    poisoned.prompt[6] = poison;
    let mut failing = greedy(prompt(8, 12), 10);
    failing.prompt[3] = bad;
    // All six start in the same step: the panic hits a batch of six.
    let all = [&reqs[..1], &[poisoned], &reqs[1..2], &[failing], &reqs[2..]].concat();
    let got: Vec<(Vec<u32>, Event)> = submit_together(&engine, &rec, &all).into_iter().map(drain).collect();
    match &got[1].1 {
        Event::Error(e) => assert!(e.contains("internal error") && e.contains("poison token"), "{e}"),
        e => panic!("the poisoned request should fail, got {e:?}"),
    }
    match &got[3].1 {
        Event::Error(e) => assert!(e.contains("test failure"), "{e}"),
        e => panic!("the failing request should fail, got {e:?}"),
    }
    let innocent: Vec<&(Vec<u32>, Event)> =
        got.iter().enumerate().filter(|(i, _)| ![1, 3].contains(i)).map(|x| x.1).collect();
    for (i, (g, want)) in innocent.iter().zip(&want).enumerate() {
        assert_eq!(&g.0, want, "request {i}: ids differ from alone after the panic and the replay");
        assert!(matches!(g.1, Event::Done { .. }), "{:?}", g.1);
    }
    assert_eq!(rec.steps()[1].len(), 6, "the poisoned request was not batched with the others");
    assert_eq!(rec.panics.load(Ordering::SeqCst), 2, "the batch panicked, then the poisoned request alone");
    assert!(engine.is_running());
    let (toks, _) = drain(engine.submit(greedy(prompt(5, 4), 3)).unwrap());
    assert_eq!(toks.len(), 3, "the engine goes on serving");
}

#[test]
fn a_queued_request_whose_client_left_leaves_the_queue_at_once_and_is_never_computed() {
    let (tok, w) = real_or_skip!("a_queued_request_whose_client_left_leaves_the_queue_at_once_and_is_never_computed");
    let rec = Arc::new(Recorder::new(CpuBackend::new(w)));
    let cfg = EngineConfig { max_concurrent: 1, max_queue: 1, ..EngineConfig::default() };
    let engine = Engine::start(rec.clone(), tok, cfg);
    let running = engine.submit(greedy(prompt(0, 5), 1000)).unwrap();
    assert!(matches!(running.recv().unwrap(), Event::Token { .. }));
    let marker = prompt(42, 9);
    let queued = engine.submit(greedy(marker.clone(), 5)).unwrap();
    assert_eq!(engine.stats.waiting.load(Ordering::SeqCst), 1);
    assert!(matches!(engine.submit(greedy(prompt(1, 3), 5)), Err(tern_engine::SubmitError::QueueFull { .. })));
    drop(queued);
    // No longer waiting, at once: the queue has room again.
    assert_eq!(engine.stats.waiting.load(Ordering::SeqCst), 0);
    let next = engine.submit(greedy(prompt(2, 3), 5)).unwrap();
    drop(running); // cancel the long one: the next request runs
    let (toks, done) = drain(next);
    assert_eq!(toks.len(), 5, "{done:?}");
    let read: HashSet<Vec<u32>> = rec.steps().iter().flatten().map(|i| i.ids.clone()).collect();
    assert!(!read.iter().any(|ids| ids.contains(&marker[0])), "the abandoned request was computed");
    let t0 = Instant::now();
    while engine.stats.active.load(Ordering::SeqCst) != 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "a cancelled request is still active");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn prefix_cache_serves_multi_turn_chats_within_its_byte_bound() {
    let (tok, w) = real_or_skip!("prefix_cache_serves_multi_turn_chats_within_its_byte_bound");
    let template = ChatTemplate::from_dir(tern_model::testutil::qwen_dir().unwrap()).unwrap();
    let c = w.config.clone();
    let bound = 6 * State::bytes_for(&c, 60); // about one and a half conversations
    let cfg = EngineConfig { prefix_cache_bytes: bound, snapshot_min_tokens: 0, ..EngineConfig::default() };
    let engine = Arc::new(Engine::start(Arc::new(CpuBackend::new(w)), tok.clone(), cfg));
    // The cache's published size, sampled all along.
    let (stop, peak) =
        (Arc::new(std::sync::atomic::AtomicBool::new(false)), Arc::new(std::sync::atomic::AtomicUsize::new(0)));
    let watcher = {
        let (e, stop, peak) = (engine.clone(), stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(e.stats.prefix_cache_bytes.load(Ordering::SeqCst), Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let encode = |s: &str| tok.encode(s, false).unwrap();
    let ask = |ids: Vec<u32>| {
        let mut r = greedy(ids, 6);
        r.stop_ids = vec![IM_END_ID];
        drain(engine.submit(r).unwrap())
    };
    let opts = ChatOptions::default();
    let mut first_hits = vec![];
    let mut turn2s = vec![];
    for k in 0..4 {
        let mut msgs = vec![
            serde_json::json!({"role": "system", "content": format!("You are test assistant number {k}.")}),
            serde_json::json!({"role": "user", "content": format!("Question {k}: what is {k} + {k}?")}),
        ];
        let ids1 = encode(&template.render(&msgs, &opts).unwrap());
        let boundary = ids1.iter().rposition(|&t| t == IM_START_ID).unwrap();
        let (reply, done) = ask(ids1.clone());
        assert_eq!(done_usage(&done).cached_tokens, 0, "conversation {k} shares nothing with the others");
        // Turn 2 rendered by the template from the history: at least the turn-start snapshot of turn 1 is hit.
        msgs.push(serde_json::json!({"role": "assistant", "content": tok.decode(&reply).unwrap()}));
        msgs.push(serde_json::json!({"role": "user", "content": "And times two?"}));
        let chat2 = encode(&template.render(&msgs, &opts).unwrap());
        let (_, done) = ask(chat2);
        let hit = done_usage(&done).cached_tokens;
        assert!(hit >= boundary, "conversation {k}: template turn 2 reused {hit} tokens, the turn start is {boundary}");
        // Turn 2 as an agent loop resends it: prompt + reply exactly, so the end-of-reply snapshot is hit.
        let mut agent2 = [&ids1[..], &reply[..]].concat();
        if reply.last() != Some(&IM_END_ID) {
            agent2.push(IM_END_ID);
        }
        agent2.extend(encode("\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"));
        let (_, done) = ask(agent2.clone());
        let hit = done_usage(&done).cached_tokens;
        assert_eq!(hit, ids1.len() + reply.len() - 1, "conversation {k}: the finished reply's snapshot");
        first_hits.push(hit);
        turn2s.push(agent2);
    }
    // Older conversations were evicted to stay within the bound: re-sending the first one's turn 2 hits less.
    let (_, done) = ask(turn2s[0].clone());
    let again = done_usage(&done).cached_tokens;
    assert!(again < first_hits[0], "conversation 0 was not evicted ({again} cached, bound {bound} bytes)");
    stop.store(true, Ordering::SeqCst);
    watcher.join().unwrap();
    let peak = peak.load(Ordering::SeqCst);
    let entries = engine.stats.prefix_cache_entries.load(Ordering::SeqCst);
    assert!(peak > 0 && peak <= bound, "prefix cache held {peak} bytes, bound {bound}");
    assert!(engine.stats.prefix_cache_bytes.load(Ordering::SeqCst) <= bound);
    println!("4 two-turn chats: hits {first_hits:?}; cache peak {peak} of {bound} bytes, {entries} entries at the end");
}

/// Issue 39: a 13-token request waited out an earlier long prompt's whole prefill (27k tokens: 35 s on the CPU).
/// Now short prompts arriving while a long one is read are read in the next steps, shortest first, while the long
/// one (the oldest prompt, the head) keeps reading at least half of every step's budget: it is never starved.
#[test]
fn short_prompts_are_not_held_behind_a_long_prefill_and_the_long_one_is_not_starved() {
    let (tok, w) = real_or_skip!("short_prompts_are_not_held_behind_a_long_prefill_and_the_long_one_is_not_starved");
    let rec = Arc::new(Recorder::new(CpuBackend::new(w.clone())));
    let budget = 32;
    let cfg = EngineConfig { step_tokens: budget, prefix_cache_bytes: 0, ..EngineConfig::default() };
    let engine = Engine::start(rec.clone(), tok.clone(), cfg);
    let long = prompt(50, 1280); // 40 steps alone
    let long_rx = engine.submit(greedy(long.clone(), 2)).unwrap();
    rec.wait_for_steps(3);
    // While it is read: one 13-token request, then five more at once (13 to 17 tokens, longest first).
    let short = greedy(prompt(51, 13), 3);
    let at = rec.steps().len();
    let (short_toks, short_done) = drain(engine.submit(short.clone()).unwrap());
    let long_first = long_rx.try_recv();
    assert!(long_first.is_err(), "the 13-token request waited out the long prompt's prefill: {long_first:?}");
    let shorts: Vec<Request> = (0..5).map(|i| greedy(prompt(60 + i, 17 - i as usize), 2)).collect();
    // They arrive together: while a step is held.
    rec.hold();
    rec.wait_for_steps(rec.steps().len() + 1);
    let rxs: Vec<_> = shorts.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    rec.release();
    let short_outs: Vec<(Vec<u32>, Event)> = rxs.into_iter().map(drain).collect();
    let (long_toks, long_done) = drain(long_rx);
    assert_eq!(long_toks.len(), 2, "{long_done:?}");
    assert_eq!(short_toks.len(), 3, "{short_done:?}");
    // Each produces what it produces alone.
    let alone =
        Engine::start(Arc::new(CpuBackend::new(w)), tok, EngineConfig { prefix_cache_bytes: 0, ..Default::default() });
    assert_eq!(short_toks, drain(alone.submit(short).unwrap()).0);
    for (r, got) in shorts.iter().zip(&short_outs) {
        assert_eq!(got.0, drain(alone.submit(r.clone()).unwrap()).0);
    }
    assert_eq!(long_toks, drain(alone.submit(greedy(long.clone(), 2)).unwrap()).0);

    let steps = rec.steps();
    let seq_of = |first: u32| steps.iter().flatten().find(|i| i.ids[0] == first && i.n > 1).map(|i| i.seq).unwrap();
    let long_seq = seq_of(long[0]);
    let read_by = |seq: SeqId, s: usize| steps[s].iter().filter(|i| i.seq == seq).map(|i| i.n).sum::<usize>();
    let first_draw = |seq: SeqId| steps.iter().position(|s| s.iter().any(|i| i.seq == seq && i.sample)).unwrap();
    let long_end = first_draw(long_seq);
    // The 13-token request: read whole in one step right after it arrived, long before the long prompt's end.
    let short_seq = seq_of(prompt(51, 13)[0]);
    let short_first = first_draw(short_seq);
    assert!(short_first <= at + 2, "the short request drew its first token in step {short_first}, it came at {at}");
    assert!(short_first + 5 < long_end, "short first token in step {short_first}, the long prompt ended in {long_end}");
    // The five: shortest first, and all before the long prompt's end.
    let firsts: Vec<usize> = shorts.iter().map(|r| first_draw(seq_of(r.prompt[0]))).collect();
    assert!(firsts.iter().all(|&f| f < long_end), "{firsts:?} vs the long prompt's end {long_end}");
    assert!(firsts.windows(2).all(|w| w[0] >= w[1]), "not shortest first: {firsts:?}");
    // The long prompt read in every step from its start to its end, at least half the budget the decodes left.
    let long_start = steps.iter().position(|s| s.iter().any(|i| i.seq == long_seq)).unwrap();
    for (s, items) in steps.iter().enumerate().take(long_end).skip(long_start) {
        let decodes = items.iter().filter(|i| i.n == 1 && i.sample && i.seq != long_seq).count();
        let got = read_by(long_seq, s);
        assert!(got >= (budget - decodes).div_ceil(2), "step {s}: the long prompt read only {got} tokens");
        assert!(items.iter().map(|i| i.n).sum::<usize>() <= budget, "step {s} read more than its budget");
    }
    println!(
        "1280-token prompt read over steps {long_start}..={long_end}; a 13-token request arriving at step {at} drew \
         its first token in step {short_first}; five more in steps {firsts:?}"
    );
}
