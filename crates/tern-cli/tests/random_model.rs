//! `tern random-model --mtp-accept`: the constructed checkpoint for measuring speculative decoding
//! (tern_model::random::Construction), written by the binary and read back by tern's loader.

use std::path::PathBuf;
use std::process::Command;

use tern_engine::{Backend, CpuBackend, Output, Sample, Verify, Want, Work};
use tern_model::random::{Construction, MtpAccept};
use tern_model::testutil::{fixtures_dir, qwen_dir};
use tern_model::{LoadOptions, Logits, State, Weights};
use tern_text::SamplingParams;

fn tern() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tern"))
}

fn ok(out: std::process::Output) -> (String, String) {
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "tern failed: {e}");
    (o, e)
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tern-cli-constructed-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn top(row: &[f32]) -> u32 {
    row.iter().enumerate().fold(0, |b, (i, v)| if *v > row[b] { i } else { b }) as u32
}

#[test]
fn mtp_accept_writes_a_model_whose_drafts_are_right_as_constructed() {
    for quant in [false, true] {
        let out = tmp(if quant { "q4" } else { "bf16" });
        let mut cmd = tern();
        cmd.args(["random-model", "--seed", "4", "--mtp-accept", "0.75,0.5", "--config"]);
        cmd.arg(fixtures_dir().join("tiny-mtp-a")).arg("--out").arg(&out);
        cmd.args(["--set", "hidden_size=512", "--set", "vocab_size=1024"]);
        if quant {
            cmd.args(["--quant", "q4"]);
        }
        let (_, err) = ok(cmd.output().unwrap());
        assert!(
            err.contains("first drafts right with probability 0.75, later drafts (after a right one) 0.5"),
            "{err}"
        );

        let cons = Construction::of_checkpoint(&out).unwrap().expect("config.json records the construction");
        assert_eq!(cons.accept(), MtpAccept { first: 0.75, later: 0.5 });
        let w = Weights::load(&out).unwrap();
        let h = w.config.hidden_size;
        // 200 greedy steps follow the cycle; each first draft is right exactly when the construction says, and
        // about 3 in 4 are.
        let mut st = State::new(&w.config);
        let mut mtp = State::new_mtp();
        let mut t = cons.cycle()[7];
        let mut out_main = w.forward_hidden(&[t], &mut st, Logits::Last, Logits::Last);
        let mut right = 0;
        for k in 0..200 {
            let next = top(&out_main.logits);
            assert_eq!(next, cons.next(t), "step {k}");
            let draft = top(&w.mtp_forward(&out_main.hidden, &[next], &mut mtp, Logits::Last).unwrap().logits);
            assert_eq!(draft == cons.next(next), cons.first_draft_right(next), "draft at {k}");
            right += usize::from(draft == cons.next(next));
            t = next;
            out_main = w.forward_hidden(&[t], &mut st, Logits::Last, Logits::Last);
            assert_eq!(out_main.hidden.len(), h);
        }
        println!("quant {quant}: {right} / 200 first drafts right (asked 0.75)");
        assert!((130..=170).contains(&right), "{right} / 200 first drafts right, asked 0.75");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// The acceptance `tern bench --speculative` reports, measured as it measures it: greedy verify items of 3 drafts
/// through the CPU backend (batch 1, 4-bit on load), and per draft position the share of verifies that accepted it
/// (and so every one before it). `--mtp-accept 0.8,0.5375` promises 0.80 / 0.43 / 0.23 (FIRST, FIRST·LATER,
/// FIRST·LATER²) in expectation; each id's draws are made once, so a run measures a sample of them: ~780 verifies
/// over 1,900 tokens of a 2,046-id cycle (no id read twice) hold each share within 4 binomial standard deviations
/// (±0.06; a 64-token run's ±0.08 is why the bench read 0.88 / 0.62 on one stretch of the cycle). Each verify also
/// accepts exactly the drafts the construction says.
#[test]
fn mtp_accept_is_the_acceptance_speculative_decoding_measures() {
    let out = tmp("bench");
    let mut cmd = tern();
    cmd.args(["random-model", "--seed", "4", "--mtp-accept", "0.8,0.5375", "--config"]);
    cmd.arg(fixtures_dir().join("tiny-mtp-a")).arg("--out").arg(&out);
    cmd.args(["--set", "hidden_size=512", "--set", "vocab_size=2048"]);
    ok(cmd.output().unwrap());
    let cons = Construction::of_checkpoint(&out).unwrap().expect("config.json records the construction");
    let w = Weights::load_with(&out, LoadOptions { quantize: true }).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    let b = CpuBackend::new(w).speculative(true);
    let (k, tokens) = (3, 1900);
    assert!(4 + tokens + k < cons.cycle().len(), "the run reads every id at most once");

    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let limit = b.vocab_size();
    let seq = b.alloc(tokens + 2 * k + 2).unwrap();
    let verify = |ids: &[u32], rows: usize| -> (Vec<u32>, Vec<u32>) {
        let draws = (0..rows)
            .map(|_| Sample { params: &greedy, seed: 0, history: &[], top_logprobs: None, limit, mask: None })
            .collect();
        let out = Want::Verify(Verify { draws, drafts: k });
        match b.step(&[Work { seq, ids, out }]).pop() {
            Some(Ok(Output::Drafted { tokens, drafts })) => (tokens.iter().map(|s| s.token).collect(), drafts),
            o => panic!("a verify returned {o:?}"),
        }
    };
    let prompt = &cons.cycle()[..4];
    let (first, mut drafts) = verify(prompt, 1);
    assert_eq!(first, [cons.cycle()[4]]);
    let mut last = first[0];
    let (mut produced, mut verifies) = (0, 0);
    let mut accepted = vec![0usize; k];
    while produced < tokens {
        // The construction's drafts after `last`: the first right with its FIRST draw, each later one, after a
        // right one, with its LATER draw.
        let mut want = 0;
        let mut t = last;
        for j in 0..k {
            if !(if j == 0 { cons.first_draft_right(t) } else { cons.later_draft_right(t) }) {
                break;
            }
            want += 1;
            t = cons.next(t);
        }
        let ids: Vec<u32> = std::iter::once(last).chain(drafts.iter().copied()).collect();
        let (got, next) = verify(&ids, ids.len());
        assert_eq!(got.len() - 1, want, "verify {verifies} after {last}: drafts {drafts:?}, drew {got:?}");
        for (j, g) in got.iter().enumerate() {
            assert_eq!(*g, (0..=j).fold(last, |t, _| cons.next(t)), "verify {verifies}: greedy leaves the cycle");
        }
        accepted.iter_mut().take(want).for_each(|a| *a += 1);
        produced += got.len();
        verifies += 1;
        last = *got.last().unwrap();
        drafts = next;
    }
    b.free(seq);
    let a = cons.accept();
    let mut promised = a.first;
    for (j, &n) in accepted.iter().enumerate() {
        let got = n as f64 / verifies as f64;
        let tol = 4.0 * (promised * (1.0 - promised) / verifies as f64).sqrt();
        let given = if j == 0 { got } else { n as f64 / accepted[j - 1] as f64 };
        println!(
            "position {}: {n} of {verifies} verifies accepted it: {got:.3} (promised {promised:.3} ± {tol:.3}); given \
             the one before accepted {given:.3}",
            j + 1
        );
        assert!((got - promised).abs() <= tol, "position {}: {got:.3}, promised {promised:.3} ± {tol:.3}", j + 1);
        promised *= a.later;
    }
}

#[test]
fn mtp_accept_rejects_bad_values_and_narrow_models() {
    let run = |accept: &str, sets: &[&str]| {
        let out = tmp("bad");
        let mut cmd = tern();
        cmd.args(["random-model", "--mtp-accept", accept, "--config"]).arg(fixtures_dir().join("tiny-mtp-a"));
        cmd.arg("--out").arg(&out);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let o = cmd.output().unwrap();
        let _ = std::fs::remove_dir_all(&out);
        assert!(!o.status.success(), "--mtp-accept {accept} {sets:?} accepted");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    assert!(run("1.5", &[]).contains("not a probability"));
    assert!(run("0.5,x", &[]).contains("not a number"));
    let e = run("0.5", &[]);
    assert!(e.contains("hidden_size 64") && e.contains("raise hidden_size"), "{e}");
    assert!(run("0.5", &["hidden_size=512", "mtp_num_hidden_layers=0"]).contains("no MTP layer"));
}

/// The real tokenizer and vocabulary: `tern run` on the constructed model produces every token it is asked for
/// (greedy never emits EOS, <|im_end|> or any other added token).
#[test]
fn constructed_real_vocabulary_model_never_stops_early() {
    let Some(q) = qwen_dir() else {
        println!("SKIPPED: constructed_real_vocabulary_model_never_stops_early: TERN_QWEN_DIR not set");
        return;
    };
    let out = tmp("real");
    let mut cmd = tern();
    cmd.args(["random-model", "--seed", "2", "--mtp-accept", "0.8", "--config"]).arg(&q).arg("--out").arg(&out);
    cmd.arg("--tokenizer-from").arg(&q);
    for s in [
        "hidden_size=512",
        "num_hidden_layers=2",
        "num_attention_heads=4",
        "num_key_value_heads=2",
        "head_dim=64",
        "linear_num_key_heads=2",
        "linear_num_value_heads=4",
        "linear_key_head_dim=32",
        "linear_value_head_dim=32",
        "num_experts=8",
        "num_experts_per_tok=2",
        "moe_intermediate_size=64",
        "shared_expert_intermediate_size=64",
    ] {
        cmd.args(["--set", s]);
    }
    ok(cmd.output().unwrap());
    let go = || {
        ok(tern()
            .args(["run", "--backend", "cpu", "--max-tokens", "40", "--temperature", "0", "--no-think", "--prompt"])
            .arg("Say hello in French.")
            .arg("--model")
            .arg(&out)
            .output()
            .unwrap())
    };
    let (a, ea) = go();
    assert!(ea.contains("40 tokens"), "stopped early: {ea}");
    assert_eq!(a, go().0, "greedy is deterministic");
    std::fs::remove_dir_all(&out).unwrap();
}
