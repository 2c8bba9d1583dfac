//! Images through the engine on the CPU backend (tiny-vl-a: a random vision-language checkpoint written by
//! transformers, with two preprocessed images): a prompt with images read in chunks that never split an image
//! gives the reference forward's greedy reply; the prefix cache serves a snapshot after an image only to a prompt
//! with the same image.

mod common;

use std::sync::Arc;

use tern_engine::{CpuBackend, Engine, EngineConfig, Event, Image, Request, SubmitError};
use tern_model::forward::ImageRows;
use tern_model::safetensors::SafeTensors;
use tern_model::testutil::fixtures_dir;
use tern_model::vision::Pixels;
use tern_model::{Logits, State, Weights};

struct Fixture {
    w: Arc<Weights>,
    ids: Vec<u32>,
    images: Vec<Image>,
}

fn fixture() -> Fixture {
    let dir = fixtures_dir().join("tiny-vl-a");
    let w = Weights::load(&dir).unwrap();
    let st = SafeTensors::open(&dir.join("expected.safetensors")).unwrap();
    let get = |n: &str| st.get(n).unwrap().to_f32().unwrap();
    let g = get("grid_thw");
    let grids: Vec<[usize; 3]> = g.chunks(3).map(|r| [r[0] as usize, r[1] as usize, r[2] as usize]).collect();
    let pixels = get("pixel_values");
    let pd = w.vision.as_ref().unwrap().config.patch_dim();
    let n0 = grids[0].iter().product::<usize>() * pd;
    let images = [(&pixels[..n0], grids[0]), (&pixels[n0..], grids[1])]
        .iter()
        .enumerate()
        .map(|(k, (values, grid))| {
            let p = Pixels { values: values.to_vec(), grid: *grid };
            Image { tokens: p.tokens(2), pixels: Arc::new(p), hash: 1000 + k as u64 }
        })
        .collect();
    Fixture { w: Arc::new(w), ids: get("ids2").into_iter().map(|v| v as u32).collect(), images }
}

/// The reference: the prompt through `forward_mm` in one call, then greedy decoding token by token.
fn reference(w: &Weights, ids: &[u32], images: &[Image], n: usize) -> Vec<u32> {
    let vis = w.vision.as_ref().unwrap();
    let towers: Vec<Vec<f32>> =
        images.iter().map(|i| vis.forward(&i.pixels.values, &[i.pixels.grid]).unwrap()).collect();
    let rows: Vec<ImageRows> =
        towers.iter().zip(images).map(|(t, i)| ImageRows { rows: t, grid: i.pixels.grid }).collect();
    let mut st = State::new(&w.config);
    let mut logits = w.forward_mm(ids, &rows, &mut st, Logits::Last).unwrap();
    let argmax = |l: &[f32]| l.iter().enumerate().fold(0, |b, (i, x)| if *x > l[b] { i } else { b }) as u32;
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = w.forward(&[t], &mut st, Logits::Last);
    }
    out
}

fn request(ids: &[u32], images: &[Image], n: usize) -> Request {
    let mut r = common::greedy(ids.to_vec(), n);
    r.images = images.to_vec();
    r
}

fn reply(e: &Engine, r: Request) -> (Vec<u32>, usize) {
    let (ids, done) = common::drain(e.submit(r).unwrap());
    match done {
        Event::Done { usage, .. } => (ids, usage.cached_tokens),
        other => panic!("{other:?}"),
    }
}

#[test]
fn image_prompts_read_in_chunks_reply_as_the_reference() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: image_prompts_read_in_chunks_reply_as_the_reference: TERN_QWEN_DIR not set");
        return;
    };
    let f = fixture();
    let want = reference(&f.w, &f.ids, &f.images, 8);
    // Steps of 5 tokens: shorter than either image's run of pads, so chunks must stretch to keep images whole.
    for step_tokens in [5, 4096] {
        let cfg = EngineConfig { step_tokens, prefix_cache_bytes: 0, ..EngineConfig::default() };
        let e = Engine::start(Arc::new(CpuBackend::new(f.w.clone())), tok.clone(), cfg);
        let (got, _) = reply(&e, request(&f.ids, &f.images, 8));
        assert_eq!(got, want, "step_tokens {step_tokens}: the reply differs from the reference");
    }
    println!(
        "{} prompt tokens with 2 images ({} + {} pads): reply {want:?}",
        f.ids.len(),
        f.images[0].tokens,
        f.images[1].tokens
    );
}

#[test]
fn the_prefix_cache_serves_an_image_snapshot_only_to_the_same_image() {
    let Some(tok) = common::tokenizer() else {
        println!("SKIPPED: the_prefix_cache_serves_an_image_snapshot_only_to_the_same_image: TERN_QWEN_DIR not set");
        return;
    };
    let f = fixture();
    let cfg = EngineConfig { prefix_cache_bytes: 1 << 30, ..EngineConfig::default() };
    let e = Engine::start(Arc::new(CpuBackend::new(f.w.clone())), tok.clone(), cfg);
    let (first, _) = reply(&e, request(&f.ids, &f.images, 6));
    // A second turn: the whole first exchange, then more text. The same images: a cache hit past them.
    let next: Vec<u32> = [&f.ids[..], &first, &[5, 6, 7]].concat();
    let (second, cached) = reply(&e, request(&next, &f.images, 6));
    assert!(cached > f.ids.len(), "the second turn did not hit the snapshot after the images ({cached} cached)");
    assert_eq!(second, reference(&f.w, &next, &f.images, 6));
    // The same ids with the second image's pixels changed (another hash): no snapshot after it may serve.
    let mut other = f.images.clone();
    let mut p = (*other[1].pixels).clone();
    p.values.iter_mut().for_each(|v| *v = -*v);
    other[1] = Image { pixels: Arc::new(p), hash: 77, tokens: other[1].tokens };
    let second_run = f.ids.iter().rposition(|&t| t != 250).map_or(0, |_| {
        let first_pad = f.ids.iter().position(|&t| t == 250).unwrap();
        let after_first = first_pad + f.images[0].tokens;
        after_first + f.ids[after_first..].iter().position(|&t| t == 250).unwrap()
    });
    let (third, cached) = reply(&e, request(&next, &other, 6));
    assert!(cached <= second_run, "a snapshot holding another image served this prompt ({cached} cached)");
    assert_eq!(third, reference(&f.w, &next, &other, 6), "the reply with the other image is not its own");
    // Bad image lists are refused at submit.
    let err = e.submit(request(&f.ids, &f.images[..1], 2)).unwrap_err();
    assert!(matches!(&err, SubmitError::BadImages(m) if m.contains("1 images, but 2 runs")), "{err}");
    let text =
        Engine::start(Arc::new(CpuBackend::new(common::real_vocab_weights().unwrap())), tok, EngineConfig::default());
    let err = text.submit(request(&[1, 2], &f.images[..1], 2)).unwrap_err();
    assert!(matches!(&err, SubmitError::BadImages(m) if m.contains("reads no images")), "{err}");
}
