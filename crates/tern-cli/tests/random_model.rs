//! `tern random-model --mtp-accept`: the constructed checkpoint for measuring speculative decoding
//! (tern_model::random::Construction), written by the binary and read back by tern's loader.

use std::path::PathBuf;
use std::process::{Command, Output};

use tern_model::random::{Construction, MtpAccept};
use tern_model::testutil::{fixtures_dir, qwen_dir};
use tern_model::{Logits, State, Weights};

fn tern() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tern"))
}

fn ok(out: Output) -> (String, String) {
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
