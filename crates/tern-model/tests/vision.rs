//! The vision side against transformers (tools/make_vision_fixtures.py): the image preprocessing against its image
//! processor (tests/fixtures/vision-images), the tower's rows and the logits of prompts with one and two images
//! (M-RoPE positions included) on two tiny random vision-language checkpoints (tests/fixtures/tiny-vl-*), and
//! text-only prompts unchanged.

use std::path::Path;

use serde_json::Value;
use tern_model::forward::Part;
use tern_model::safetensors::SafeTensors;
use tern_model::testutil::fixtures_dir;
use tern_model::vision::{preprocess, ImageParams};
use tern_model::{ImageRows, Logits, State, Weights};

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
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
fn preprocessing_matches_the_image_processor() {
    let dir = fixtures_dir().join("vision-images");
    let meta = json(&dir.join("expected.json"));
    let px = SafeTensors::open(&dir.join("pixels.safetensors")).unwrap();
    let params = ImageParams {
        min_pixels: meta["min_pixels"].as_u64().unwrap() as usize,
        max_pixels: meta["max_pixels"].as_u64().unwrap() as usize,
        ..ImageParams::default()
    };
    assert_eq!((params.patch_size, params.merge_size, params.temporal_patch_size), (16, 2, 2));
    let (p, t) = (params.patch_size, params.temporal_patch_size);
    for im in meta["images"].as_array().unwrap() {
        let name = im["name"].as_str().unwrap();
        let file = im["file"].as_str().unwrap();
        let bytes = std::fs::read(dir.join(file)).unwrap();
        let got = preprocess(&bytes, &params).unwrap();
        // A JPEG: decoders may differ by a few levels (the `image` crate's vs PIL's libjpeg), so the pixels are
        // held to the processor's from PIL's decoded pixels (saved losslessly beside it); the JPEG itself must give
        // the same grid, and pixels within the decoders' difference.
        let pil_decoded = if file.ends_with(".jpg") {
            let ours = image::load_from_memory(&bytes).unwrap().to_rgb8();
            let pil_png = std::fs::read(dir.join(format!("{name}.decoded.png"))).unwrap();
            let pil = image::load_from_memory(&pil_png).unwrap().to_rgb8();
            let d = ours.as_raw().iter().zip(pil.as_raw()).map(|(a, b)| a.abs_diff(*b)).max().unwrap() as i32;
            println!("{name}: JPEG decoders differ by up to {d} 8-bit steps");
            assert!(d <= 4, "{name}: JPEG decoded {d} steps from PIL's");
            let from_jpeg = got.clone();
            let got = preprocess(&pil_png, &params).unwrap();
            assert_eq!(from_jpeg.grid, got.grid);
            let worst = from_jpeg.values.iter().zip(&got.values).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst * 0.5 * 255.0 <= d as f32 + 1.01, "{name}: JPEG path {worst} from the decoded path");
            Some(got)
        } else {
            None
        };
        let got = pil_decoded.unwrap_or(got);
        let grid: Vec<usize> =
            im["grid_thw"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(got.grid.to_vec(), grid, "{name}: grid");
        assert_eq!(got.tokens(params.merge_size), im["tokens"].as_u64().unwrap() as usize, "{name}: tokens");
        let size: Vec<usize> = im["size"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(params.smart_resize(size[0], size[1]).unwrap(), (grid[1] * p, grid[2] * p), "{name}: smart_resize");

        // Back to 8-bit levels (before normalisation), first temporal copy; the copies are equal.
        let dim = 3 * t * p * p;
        let n = grid.iter().product::<usize>();
        assert_eq!(got.values.len(), n * dim, "{name}: pixel values");
        let stride = im["stride"].as_u64().unwrap() as usize;
        let want = px.get(name).unwrap();
        let want = want.bytes;
        let mut levels = Vec::new();
        for row in got.values.chunks_exact(dim).step_by(stride) {
            for ch in 0..3 {
                let c0 = &row[ch * t * p * p..(ch * t + 1) * p * p];
                for k in 1..t {
                    assert_eq!(c0, &row[(ch * t + k) * p * p..(ch * t + k + 1) * p * p], "{name}: temporal copy {k}");
                }
                levels.extend(c0.iter().map(|v| ((v * params.std[ch] + params.mean[ch]) * 255.0).round() as i32));
            }
        }
        assert_eq!(levels.len(), want.len(), "{name}: rows kept");
        let diffs: Vec<i32> = levels.iter().zip(want).map(|(a, &b)| (a - b as i32).abs()).collect();
        let worst = *diffs.iter().max().unwrap();
        let off = diffs.iter().filter(|&&d| d != 0).count();
        println!("{name}: {grid:?}, {} values, {off} differ, worst {worst} steps", diffs.len());
        if name == "exact" {
            assert_eq!(worst, 0, "{name}: no resize, so the same pixels");
            // And the normalised values themselves, as the processor's f32 arithmetic gives them.
            let vl = SafeTensors::open(&fixtures_dir().join("tiny-vl-a/expected.safetensors")).unwrap();
            let pv = vl.get("pixel_values").unwrap().to_f32().unwrap();
            assert!(bits_equal(&got.values, &pv[..n * dim]), "{name}: pixel_values differ from the processor's");
        } else {
            // Within one 8-bit step where the filter decides: fast_image_resize weights the taps in fixed point as
            // PIL does, one pass at a time in PIL's order (the `image` crate's f32 kernel put 9 values of `big` two
            // steps off).
            assert!(worst <= 1, "{name}: a pixel is {worst} 8-bit steps from the processor's");
        }
    }
}

struct Expected {
    pixels: Vec<f32>,
    grids: Vec<[usize; 3]>,
    tower: Vec<f32>,
    ids1: Vec<u32>,
    logits1: Vec<f32>,
    positions1: Vec<f32>,
    ids2: Vec<u32>,
    logits2: Vec<f32>,
    positions2: Vec<f32>,
    text_ids: Vec<u32>,
    text_logits: Vec<f32>,
}

fn expected(dir: &Path) -> Expected {
    let st = SafeTensors::open(&dir.join("expected.safetensors")).unwrap();
    let get = |n: &str| st.get(n).unwrap().to_f32().unwrap();
    let ids = |n: &str| get(n).into_iter().map(|v| v as u32).collect();
    let g = get("grid_thw");
    Expected {
        pixels: get("pixel_values"),
        grids: g.chunks(3).map(|r| [r[0] as usize, r[1] as usize, r[2] as usize]).collect(),
        tower: get("tower"),
        ids1: ids("ids1"),
        logits1: get("logits1"),
        positions1: get("positions1"),
        ids2: ids("ids2"),
        logits2: get("logits2"),
        positions2: get("positions2"),
        text_ids: ids("text_ids"),
        text_logits: get("text_logits"),
    }
}

/// transformers' `[3, T]` position rows as per-token (t, h, w).
fn thw(rows: &[f32]) -> Vec<[i64; 3]> {
    let n = rows.len() / 3;
    (0..n).map(|i| [rows[i] as i64, rows[n + i] as i64, rows[2 * n + i] as i64]).collect()
}

#[test]
fn tower_and_image_prompts_match_transformers() {
    for name in ["tiny-vl-a", "tiny-vl-b"] {
        let dir = fixtures_dir().join(name);
        let w = Weights::load(&dir).unwrap();
        let vis = w.vision.as_ref().unwrap_or_else(|| panic!("{name}: vision tower loaded"));
        let e = expected(&dir);
        let (h, v) = (w.config.hidden_size, w.config.vocab_size);
        assert_eq!(vis.config.out_hidden_size, h);

        // The tower over both images at once, and each alone (attention stays within an image).
        let tower = vis.forward(&e.pixels, &e.grids).unwrap();
        compare(&format!("{name} tower"), &tower, &e.tower, h, 1e-4, false);
        let pd = vis.config.patch_dim();
        let n0 = e.grids[0].iter().product::<usize>();
        let tok0 = n0 / 4;
        let first = vis.forward(&e.pixels[..n0 * pd], &e.grids[..1]).unwrap();
        let second = vis.forward(&e.pixels[n0 * pd..], &e.grids[1..]).unwrap();
        compare(&format!("{name} tower, image 0 alone"), &first, &e.tower[..tok0 * h], h, 1e-4, false);
        compare(&format!("{name} tower, image 1 alone"), &second, &e.tower[tok0 * h..], h, 1e-4, false);
        let img = |k: usize| ImageRows {
            rows: if k == 0 { &tower[..tok0 * h] } else { &tower[tok0 * h..] },
            grid: e.grids[k],
        };

        // One image: positions, then logits in one call.
        let st = State::new(&w.config);
        let (pos1, _) = w.mrope_positions(&e.ids1, &e.grids[1..], &st, 2).unwrap();
        assert_eq!(pos1, thw(&e.positions1), "{name}: M-RoPE positions, one image");
        let mut st = State::new(&w.config);
        let got = w.forward_mm(&e.ids1, &[img(1)], &mut st, Logits::All).unwrap();
        compare(&format!("{name} logits, one image"), &got, &e.logits1, v, 1e-4, true);

        // Two images of different sizes.
        let st2 = State::new(&w.config);
        let (pos2, next) = w.mrope_positions(&e.ids2, &e.grids, &st2, 2).unwrap();
        assert_eq!(pos2, thw(&e.positions2), "{name}: M-RoPE positions, two images");
        assert_eq!(next, pos2.iter().flatten().max().unwrap() + 1);
        let mut st2 = State::new(&w.config);
        let got2 = w.forward_mm(&e.ids2, &[img(0), img(1)], &mut st2, Logits::All).unwrap();
        compare(&format!("{name} logits, two images"), &got2, &e.logits2, v, 1e-4, true);
        assert_eq!(st2.pos as i64 + st2.rope_delta, next, "{name}: text continues after the largest position");

        // The same prompt in pieces: text, then the first image's part, then the rest, then the last tokens one by
        // one with plain forward calls (their positions follow from the state's rope delta): the same bits.
        let s0 = e.ids2.iter().position(|&i| i == w.config.image_token_id).unwrap() - 1;
        let s1 = s0 + 1 + tok0 + 2;
        let t = e.ids2.len();
        let mut st3 = State::new(&w.config);
        let mut rows = w.forward(&e.ids2[..s0], &mut st3, Logits::All);
        rows.extend(w.forward_mm(&e.ids2[s0..s1], &[img(0)], &mut st3, Logits::All).unwrap());
        rows.extend(w.forward_mm(&e.ids2[s1..t - 3], &[img(1)], &mut st3, Logits::All).unwrap());
        for i in t - 3..t {
            rows.extend(w.forward(&e.ids2[i..i + 1], &mut st3, Logits::All));
        }
        assert!(bits_equal(&rows, &got2), "{name}: split prompt with images differs from one call");
        assert_eq!((st3.pos, st3.rope_delta), (st2.pos, st2.rope_delta));

        // In a batch beside a text-only sequence, each computes what it does alone.
        let text = &e.text_ids;
        let alone_text = w.forward(text, &mut State::new(&w.config), Logits::All);
        let (mut sa, mut sb) = (State::new(&w.config), State::new(&w.config));
        let out = w
            .forward_batch_mm(
                &mut [
                    Part { ids: text, state: &mut sa, logits: Logits::All },
                    Part { ids: &e.ids2, state: &mut sb, logits: Logits::All },
                ],
                &[&[], &[img(0), img(1)]],
                &[Logits::Skip, Logits::Skip],
            )
            .unwrap();
        assert!(bits_equal(&out[0].logits, &alone_text), "{name}: text part in a batch with images");
        assert!(bits_equal(&out[1].logits, &got2), "{name}: image part in a batch");
        assert_eq!((sb.pos, sb.rope_delta), (st2.pos, st2.rope_delta));

        // Bad input is an error, not a panic.
        let mut bad = State::new(&w.config);
        assert!(w.forward_mm(&e.ids2, &[img(0)], &mut bad, Logits::Last).is_err(), "pads without an image");
        assert!(w.forward_mm(&e.ids1, &[img(0)], &mut bad, Logits::Last).is_err(), "pads of another image");
        assert_eq!(bad.pos, 0);
    }
}

#[test]
fn text_only_prompts_are_unchanged() {
    for name in ["tiny-vl-a", "tiny-vl-b"] {
        let dir = fixtures_dir().join(name);
        let w = Weights::load(&dir).unwrap();
        let e = expected(&dir);
        let v = w.config.vocab_size;
        let plain = w.forward(&e.text_ids, &mut State::new(&w.config), Logits::All);
        compare(&format!("{name} text-only logits"), &plain, &e.text_logits, v, 1e-4, true);
        let mut st = State::new(&w.config);
        let mm = w.forward_mm(&e.text_ids, &[], &mut st, Logits::All).unwrap();
        assert!(bits_equal(&plain, &mm), "{name}: text through forward_mm differs");
        assert_eq!(st.rope_delta, 0);
        // The same model without its tower loads and computes the same text logits, bit for bit.
        let mut no_vision = w.clone();
        no_vision.vision = None;
        let again = no_vision.forward(&e.text_ids, &mut State::new(&w.config), Logits::All);
        assert!(bits_equal(&plain, &again));
    }
}

#[test]
fn image_params_and_bad_images() {
    let v: Value = serde_json::from_str(
        r#"{"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
            "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}"#,
    )
    .unwrap();
    let p = ImageParams::from_json(&v).unwrap();
    assert_eq!((p.min_pixels, p.max_pixels), (65_536, 16_777_216));
    // 256 x 256 is the floor of that budget; a 100 x 50 image goes up to it, keeping its aspect.
    assert_eq!(p.smart_resize(100, 50).unwrap(), (384, 192));
    let d = ImageParams::default();
    assert_eq!(d.smart_resize(1024, 1024).unwrap(), (992, 992));
    assert_eq!(d.smart_resize(10, 10).unwrap(), (64, 64));
    assert!(d.smart_resize(1, 300).is_err(), "aspect ratio over 200");
    assert!(preprocess(b"not an image", &d).is_err());
    // No preprocessor_config.json beside the real config: the defaults.
    assert_eq!(ImageParams::from_dir(&fixtures_dir().join("tiny-vl-a")).unwrap(), d);
}

#[test]
fn a_checkpoint_without_the_tower_loads_as_text_only() {
    let src = fixtures_dir().join("tiny-vl-a");
    let dir = std::env::temp_dir().join(format!("tern-vision-text-only-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let st = SafeTensors::open(&src.join("model.safetensors")).unwrap();
    let kept: Vec<(String, Vec<usize>, Vec<f32>)> = st
        .names()
        .filter(|n| !n.starts_with("model.visual."))
        .map(|n| {
            let t = st.get(n).unwrap();
            (n.to_string(), t.shape.to_vec(), t.to_f32().unwrap())
        })
        .collect();
    let refs: Vec<(&str, &[usize], &[f32])> =
        kept.iter().map(|(n, s, v)| (n.as_str(), s.as_slice(), v.as_slice())).collect();
    tern_model::safetensors::write_f32(&dir.join("model.safetensors"), &refs).unwrap();
    let text_only = Weights::load(&dir).unwrap();
    let full = Weights::load(&src).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(text_only.vision.is_none() && full.vision.is_some());
    let ids = expected(&src).text_ids;
    let a = text_only.forward(&ids, &mut State::new(&text_only.config), Logits::All);
    let b = full.forward(&ids, &mut State::new(&full.config), Logits::All);
    assert!(bits_equal(&a, &b));
}
