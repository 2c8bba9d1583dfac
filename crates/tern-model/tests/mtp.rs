//! The multi-token-prediction block: its CPU forward against the oracle tools/make_mtp_fixtures.py builds from
//! transformers' own classes (tests/fixtures/tiny-mtp-*), its cache (split calls, draft chains, rewind, batching),
//! and its weights through `tern random-model` and `tern quantize`.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tern_model::mlx::{self, HfValues, QuantSpec, MTP_PREFIX};
use tern_model::safetensors::{Checkpoint, Dtype, SafeTensors};
use tern_model::testutil::fixtures_dir;
use tern_model::weights::Linear;
use tern_model::{Logits, MtpPart, State, Weights};

struct Expected {
    ids: Vec<u32>,
    hidden: Vec<f32>,
    logits: Vec<f32>,
    mtp_logits: Vec<f32>,
    mtp_hidden: Vec<f32>,
    mtp_logits_split: Vec<f32>,
    chain_ids: Vec<u32>,
    chain_logits: Vec<f32>,
    split: usize,
}

fn expected(dir: &Path) -> Expected {
    let st = SafeTensors::open(&dir.join("expected.safetensors")).unwrap();
    let get = |n: &str| st.get(n).unwrap().to_f32().unwrap();
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    let ids = |n: &str| get(n).into_iter().map(|v| v as u32).collect();
    Expected {
        ids: ids("ids"),
        hidden: get("hidden"),
        logits: get("logits"),
        mtp_logits: get("mtp_logits"),
        mtp_hidden: get("mtp_hidden"),
        mtp_logits_split: get("mtp_logits_split"),
        chain_ids: ids("chain_ids"),
        chain_logits: get("chain_logits"),
        split: meta["split"].as_u64().unwrap() as usize,
    }
}

/// Per row of `width`: max|a-b| / max|ref| within `tol` (and, for logits, the same argmax).
fn compare(name: &str, got: &[f32], want: &[f32], width: usize, tol: f32, argmax: bool) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let top = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, v)| if *v > r[b] { i } else { b });
    let mut worst = 0.0f32;
    for (t, (g, w)) in got.chunks(width).zip(want.chunks(width)).enumerate() {
        let scale = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let diff = g.iter().zip(w).fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        worst = worst.max(diff / scale);
        assert!(diff / scale <= tol, "{name}: row {t}: max|diff|/max|ref| = {:.3e} > {tol:e}", diff / scale);
        if argmax {
            assert_eq!(top(g), top(w), "{name}: row {t}: argmax differs");
        }
    }
    println!("{name}: worst max|diff|/max|ref| = {worst:.3e} over {} rows", got.len() / width);
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn mtp_matches_the_transformers_built_oracle() {
    for name in ["tiny-mtp-a", "tiny-mtp-b"] {
        let dir = fixtures_dir().join(name);
        let w = Weights::load(&dir).unwrap();
        assert!(w.mtp.is_some(), "{name}: MTP block loaded");
        let e = expected(&dir);
        let (h, v, t) = (w.config.hidden_size, w.config.vocab_size, e.ids.len());

        // The main model's post-norm hidden state, the MTP block's input.
        let main = w.forward_hidden(&e.ids, &mut State::new(&w.config), Logits::All, Logits::All);
        compare(&format!("{name} main logits"), &main.logits, &e.logits, v, 1e-4, true);
        compare(&format!("{name} main hidden"), &main.hidden, &e.hidden, h, 1e-4, false);

        // Rows (hidden_i, id_{i+1}) at positions 0..t-2, one call.
        let mut st = State::new_mtp();
        let out = w.mtp_forward(&main.hidden[..(t - 1) * h], &e.ids[1..], &mut st, Logits::All).unwrap();
        compare(&format!("{name} mtp"), &out.logits, &e.mtp_logits, v, 1e-4, true);
        compare(&format!("{name} mtp hidden"), &out.hidden, &e.mtp_hidden, h, 1e-4, false);
        assert_eq!(st.pos, t - 1);

        // The same rows: `split` in one call, then one draft step at a time through the cache.
        let mut st = State::new_mtp();
        let s = e.split;
        let mut rows = w.mtp_forward(&main.hidden[..s * h], &e.ids[1..=s], &mut st, Logits::All).unwrap().logits;
        for i in s..t - 1 {
            rows.extend(w.mtp_logits(&main.hidden[i * h..(i + 1) * h], e.ids[i + 1], &mut st).unwrap());
        }
        compare(&format!("{name} mtp split {s}"), &rows, &e.mtp_logits_split, v, 1e-4, true);

        // A draft chain: the main model's last hidden state, then the MTP block's own output as the next input.
        let before = st.clone();
        let chain = |st: &mut State| {
            let mut hid = main.hidden[(t - 1) * h..].to_vec();
            let mut logits = Vec::new();
            for &id in &e.chain_ids {
                let o = w.mtp_forward(&hid, &[id], st, Logits::Last).unwrap();
                logits.extend(o.logits);
                hid = o.hidden;
            }
            logits
        };
        let got = chain(&mut st);
        compare(&format!("{name} mtp chain"), &got, &e.chain_logits, v, 1e-4, true);

        // Rejected drafts rewind: the chain again from the same point computes the same bits.
        st.rewind(t - 1).unwrap();
        assert_eq!(st.pos, before.pos);
        assert!(bits_equal(&chain(&mut st), &got), "{name}: chain after rewind differs");
    }
}

#[test]
fn mtp_batch_equals_alone_and_bad_input_is_an_error() {
    let dir = fixtures_dir().join("tiny-mtp-b");
    let w = Weights::load(&dir).unwrap();
    let e = expected(&dir);
    let (h, t) = (w.config.hidden_size, e.ids.len());
    let hid = &e.hidden;
    // Sequence A: rows 0..10 then 10..12; sequence B: rows 0..5. Batched, each part computes what it does alone.
    let alone = |rows: std::ops::Range<usize>, st: &mut State| {
        w.mtp_forward(&hid[rows.start * h..rows.end * h], &e.ids[rows.start + 1..rows.end + 1], st, Logits::All)
            .unwrap()
    };
    let (mut a1, mut b1) = (State::new_mtp(), State::new_mtp());
    alone(0..10, &mut a1);
    let (want_a, want_b) = (alone(10..12, &mut a1), alone(0..5, &mut b1));
    let (mut a2, mut b2) = (State::new_mtp(), State::new_mtp());
    alone(0..10, &mut a2);
    let got = w
        .mtp_forward_batch(&mut [
            MtpPart { hidden: &hid[10 * h..12 * h], ids: &e.ids[11..13], state: &mut a2, logits: Logits::All },
            MtpPart { hidden: &hid[..5 * h], ids: &e.ids[1..6], state: &mut b2, logits: Logits::Last },
        ])
        .unwrap();
    assert!(bits_equal(&got[0].logits, &want_a.logits) && bits_equal(&got[0].hidden, &want_a.hidden));
    let v = w.config.vocab_size;
    assert!(bits_equal(&got[1].logits, &want_b.logits[4 * v..]) && bits_equal(&got[1].hidden, &want_b.hidden));
    assert_eq!((a2.pos, b2.pos), (12, 5));

    let err = |r: anyhow::Result<tern_model::Output>| format!("{:#}", r.expect_err("must fail"));
    let mut st = State::new_mtp();
    assert!(err(w.mtp_forward(&hid[..h - 1], &e.ids[..1], &mut st, Logits::Last)).contains("hidden"));
    assert!(err(w.mtp_forward(&hid[..h], &[v as u32], &mut st, Logits::Last)).contains("vocabulary"));
    assert!(err(w.mtp_forward(&hid[..h], &[], &mut st, Logits::Last)).contains("no ids"));
    let mut main = State::new(&w.config);
    assert!(err(w.mtp_forward(&hid[..h], &e.ids[..1], &mut main, Logits::Last)).contains("not an MTP state"));
    w.forward(&e.ids[..3], &mut main, Logits::Skip);
    assert!(main.rewind(1).is_err() && main.pos == 3, "a Gated DeltaNet state goes back only to a kept row");
    assert!(st.rewind(1).is_err() && st.pos == 0);
    let c = &w.config;
    assert_eq!(State::mtp_bytes_for(c, 12), 4 * 12 * 2 * c.num_key_value_heads * c.head_dim);
    assert_eq!(t, 24);

    // A checkpoint without mtp.* (tiny-a, like mlx-community's): no block, and saying why.
    let plain = Weights::load(&fixtures_dir().join("tiny-a")).unwrap();
    assert!(plain.mtp.is_none());
    let hp = plain.config.hidden_size;
    let e = err(plain.mtp_forward(&vec![0.0; hp], &[1], &mut State::new_mtp(), Logits::Last));
    assert!(e.contains("no MTP block") && e.contains("mtp_num_hidden_layers"), "{e}");
}

fn config_json(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tern-mtp-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The MTP logits of a 6-row prompt then 2 draft steps (finite, not all zero).
fn mtp_run(w: &Weights) -> Vec<f32> {
    let v = w.config.vocab_size;
    let ids: Vec<u32> = (0..7u32).map(|i| (i * 37 + 5) % v as u32).collect();
    let main = w.forward_hidden(&ids, &mut State::new(&w.config), Logits::Last, Logits::All);
    let h = w.config.hidden_size;
    let mut st = State::new_mtp();
    let mut out = w.mtp_forward(&main.hidden[..6 * h], &ids[1..], &mut st, Logits::All).unwrap().logits;
    out.extend(w.mtp_logits(&main.hidden[6 * h..], 3, &mut st).unwrap());
    out
}

#[test]
fn random_model_writes_the_official_mtp_tensors_and_they_load_back() {
    let cfg = config_json(&fixtures_dir().join("tiny-mtp-a"));
    let out = tmp("random");
    tern_model::random::write_random_model(&cfg, &out, Dtype::BF16, 7, None).unwrap();
    let ckpt = Checkpoint::open(&out).unwrap();
    let mtp: Vec<&str> = ckpt.names().filter(|n| n.starts_with("mtp.")).collect();
    assert_eq!(mtp.len(), 19, "{mtp:?}");
    for (name, shape) in [
        ("mtp.fc.weight", vec![64, 128]),
        ("mtp.pre_fc_norm_embedding.weight", vec![64]),
        ("mtp.layers.0.self_attn.q_proj.weight", vec![4 * 32 * 2, 64]),
        ("mtp.layers.0.mlp.experts.gate_up_proj", vec![8, 64, 64]),
        ("mtp.norm.weight", vec![64]),
    ] {
        let t = ckpt.get(name).unwrap();
        assert_eq!((t.shape, t.dtype), (&shape[..], Dtype::BF16), "{name}");
    }
    let w = Weights::load(&out).unwrap();
    assert!(w.mtp.is_some());
    let l = mtp_run(&w);
    assert!(l.iter().all(|x| x.is_finite()) && l.iter().any(|&x| x != 0.0));
    std::fs::remove_dir_all(&out).unwrap();

    // Without an MTP layer in the config: none written, none loaded, and the reason.
    let mut cfg0 = cfg.clone();
    cfg0["text_config"]["mtp_num_hidden_layers"] = 0.into();
    tern_model::random::write_random_model(&cfg0, &out, Dtype::BF16, 7, None).unwrap();
    assert!(Checkpoint::open(&out).unwrap().names().all(|n| !n.starts_with("mtp.")));
    let w0 = Weights::load(&out).unwrap();
    assert!(w0.mtp.is_none() && w0.mtp_off_reason().unwrap().contains("mtp_num_hidden_layers"));
    std::fs::remove_dir_all(&out).unwrap();

    // The 4-bit random model (`tern random-model --dtype q4`) carries it too.
    tern_model::random::write_random_mlx(&cfg, &out, 7, None).unwrap();
    let mut q = Weights::load(&out).unwrap();
    assert!(q.mtp.is_some());
    let l = mtp_run(&q);
    assert!(l.iter().all(|x| x.is_finite()) && l.iter().any(|&x| x != 0.0));
    let fc = &mut q.mtp.as_mut().unwrap().fc;
    assert!(matches!(fc, Linear::Quant(_)), "mtp.fc is quantised");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn quantize_keeps_the_mtp_block() {
    // What `tern quantize` does, on the bf16 per-expert checkpoint: the MTP block is written (under
    // language_model.mtp.*, 8-bit router), read back in place, and computes what quantise-on-load computes.
    let src = fixtures_dir().join("tiny-mtp-b");
    let json = config_json(&src);
    let c = tern_model::Config::from_json(&json).unwrap();
    let ckpt = Checkpoint::open(&src).unwrap();
    let values = HfValues::new(&ckpt).unwrap();
    let spec = QuantSpec::recipe(&c, 4, 32);
    let out = tmp("quantize");
    mlx::write_checkpoint(&json, &out, &values, &spec, &mut |_, _| {}).unwrap();
    let written = Checkpoint::open(&out).unwrap();
    let router = written.get(&format!("{MTP_PREFIX}layers.0.mlp.gate.weight")).unwrap();
    assert_eq!((router.dtype, router.shape), (Dtype::U32, &[16, 96 * 8 / 32][..]));
    assert!(written.contains(&format!("{MTP_PREFIX}layers.0.mlp.switch_mlp.gate_proj.scales")));
    assert!(written.names().all(|n| n.starts_with("language_model.")));

    let mut loaded = Weights::load(&out).unwrap();
    let m = loaded.mtp.as_mut().expect("MTP block kept");
    assert!(matches!(&m.fc, Linear::Quant(q) if q.is_zero_copy()));
    let in_memory = Weights::from_values(c.clone(), &values, Some(&spec)).unwrap();
    assert!(bits_equal(&mtp_run(&loaded), &mtp_run(&in_memory)), "written and read back = quantised in memory");

    // The 4-bit MTP against the f32 reference on its dequantised weights.
    let reference = loaded.dequantized();
    let (fast, slow) = (mtp_run(&loaded), mtp_run(&reference));
    compare("tiny-mtp-b q4 mtp vs dequantised", &fast, &slow, c.vocab_size, 2e-3, false);
    std::fs::remove_dir_all(&out).unwrap();

    // A 4-bit checkpoint whose config declares MTP but which has no mtp.* tensors (as mlx-community's): the model
    // loads without the block, and says why.
    let plain = fixtures_dir().join("tiny-a");
    let mut json = config_json(&plain);
    json["text_config"]["mtp_num_hidden_layers"] = 1.into();
    let c = tern_model::Config::from_json(&json).unwrap();
    let ckpt = Checkpoint::open(&plain).unwrap();
    let out = tmp("no-mtp");
    mlx::write_checkpoint(&json, &out, &HfValues::new(&ckpt).unwrap(), &QuantSpec::q4(&c), &mut |_, _| {}).unwrap();
    assert!(Checkpoint::open(&out).unwrap().names().all(|n| !n.contains("mtp.")));
    let w = Weights::load(&out).unwrap();
    assert!(w.mtp.is_none() && w.mtp_off_reason().unwrap().contains("no mtp.* tensors"));
    std::fs::remove_dir_all(&out).unwrap();

    // Quantise-on-load of the official layout (tiny-mtp-a) keeps it as well.
    let w = Weights::load_with(&fixtures_dir().join("tiny-mtp-a"), tern_model::LoadOptions { quantize: true }).unwrap();
    assert!(w.mtp.is_some());
}

/// Verify rows: a call with `keep_rows` can go back to any of its rows, and the state is then bit for bit the
/// state of reading only the ids up to that row (the next logits are identical); other positions are refused.
#[test]
fn verify_rows_rewind_to_the_state_of_the_accepted_ids() {
    let w = Weights::load(&fixtures_dir().join("tiny-mtp-a")).unwrap();
    let e = expected(&fixtures_dir().join("tiny-mtp-a"));
    let (prompt, rows) = (&e.ids[..6], &e.ids[6..11]);
    let mut base = State::new(&w.config);
    w.forward(prompt, &mut base, Logits::Skip);
    for keep in 1..=rows.len() {
        let mut spec = base.clone();
        spec.keep_rows = true;
        let all = w.forward(rows, &mut spec, Logits::All);
        spec.rewind(6 + keep).unwrap();
        let mut plain = base.clone();
        let want = w.forward(&rows[..keep], &mut plain, Logits::All);
        let v = w.config.vocab_size;
        assert!(bits_equal(&all[..keep * v], &want), "keep {keep}: verify rows differ from reading them alone");
        // The next token from both states: identical bits.
        let next = [e.ids[11]];
        let (a, b) = (w.forward(&next, &mut spec, Logits::Last), w.forward(&next, &mut plain, Logits::Last));
        assert!(bits_equal(&a, &b), "keep {keep}: the state after rewinding differs");
        assert_eq!(spec.pos, plain.pos);
    }
    // Only positions inside the last call, and only once: the kept rows go with the rewind.
    let mut st = base.clone();
    st.keep_rows = true;
    w.forward(rows, &mut st, Logits::Skip);
    assert!(st.rewind(6).is_err(), "before the call's first row");
    st.rewind(8).unwrap();
    assert!(st.rewind(7).is_err(), "the kept rows were dropped by the first rewind");
    // A call without keep_rows keeps nothing.
    w.forward(rows, &mut st, Logits::Skip);
    assert!(st.rewind(9).is_err());
}
