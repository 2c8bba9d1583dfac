//! A broken checkpoint gives an error that names the file and the tensor, never a panic or garbage.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tern_model::safetensors::{write, Dtype, SafeTensors, TensorSpec};
use tern_model::testutil::fixtures_dir;
use tern_model::Weights;

/// A copy of fixture tiny-a whose model.safetensors is rewritten by `edit` (name, dtype, shape, bytes).
fn broken_copy(tag: &str, edit: impl Fn(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) -> PathBuf {
    let src = fixtures_dir().join("tiny-a");
    let dir = std::env::temp_dir().join(format!("tern-loader-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let st = SafeTensors::open(&src.join("model.safetensors")).unwrap();
    let mut tensors: Vec<_> = st
        .names()
        .map(|n| {
            let t = st.get(n).unwrap();
            (n.to_owned(), t.dtype, t.shape.to_vec(), t.bytes.to_vec())
        })
        .collect();
    edit(&mut tensors);
    let specs: Vec<TensorSpec> =
        tensors.iter().map(|(n, d, s, _)| TensorSpec { name: n.clone(), dtype: *d, shape: s.clone() }).collect();
    write(&dir.join("model.safetensors"), &specs, &BTreeMap::new(), |i, buf| {
        buf.copy_from_slice(&tensors[i].3);
        Ok(())
    })
    .unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    match Weights::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

const QPROJ: &str = "model.language_model.layers.3.self_attn.q_proj.weight";

#[test]
fn intact_copy_loads() {
    let dir = broken_copy("intact", |_| {});
    Weights::load(&dir).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = broken_copy("missing", |t| t.retain(|(n, ..)| n != QPROJ));
    let e = load_err(&dir);
    assert!(e.contains("missing tensor") && e.contains(QPROJ), "{e}");
}

#[test]
fn wrong_shape_is_named() {
    let dir = broken_copy("shape", |t| {
        let e = t.iter_mut().find(|(n, ..)| n == QPROJ).unwrap();
        e.2 = vec![e.2[1], e.2[0]];
    });
    let e = load_err(&dir);
    assert!(e.contains(QPROJ) && e.contains("shape") && e.contains("model.safetensors"), "{e}");
}

#[test]
fn wrong_dtype_is_named() {
    let dir = broken_copy("dtype", |t| {
        let e = t.iter_mut().find(|(n, ..)| n == QPROJ).unwrap();
        e.1 = Dtype::U32;
    });
    let e = load_err(&dir);
    assert!(e.contains(QPROJ) && e.contains("U32"), "{e}");
}

#[test]
fn truncated_file_names_file_and_tensor() {
    let dir = broken_copy("truncated", |_| {});
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("truncated") && e.contains("model.safetensors") && e.contains("tensor "), "{e}");
}

#[test]
fn corrupt_header_names_file() {
    let dir = broken_copy("corrupt", |_| {});
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..20].copy_from_slice(b"not json at ");
    std::fs::write(&path, bytes).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors") && e.contains("not valid JSON"), "{e}");
    std::fs::write(&path, [1u8, 2, 3]).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("too short"), "{e}");
}

#[test]
fn unsupported_architecture_is_refused() {
    let dir = broken_copy("arch", |_| {});
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), cfg.replace("\"qwen3_5_moe_text\"", "\"llama\"")).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model_type") && e.contains("llama") && e.contains("config.json"), "{e}");
}
