//! Shared test helpers: locating the model directory.

use std::path::{Path, PathBuf};

/// The checkpoint directory with tokenizer.json etc.: `$TERN_QWEN_DIR` (relative paths are
/// tried from the current dir, then from the workspace root), else `../../../shared/qwen3.6-35b-a3b`
/// relative to this crate. Prints `SKIPPED: <test>: TERN_QWEN_DIR not set` and returns `None`
/// when neither is available.
pub fn model_dir(test: &str) -> Option<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Ok(dir) = std::env::var("TERN_QWEN_DIR") {
        let dir = PathBuf::from(dir);
        let candidates = [dir.clone(), manifest.join("../..").join(&dir)];
        return match candidates.iter().find(|d| d.join("tokenizer.json").exists()) {
            Some(found) => Some(found.clone()),
            None => panic!("TERN_QWEN_DIR={} has no tokenizer.json", dir.display()),
        };
    }
    let fallback = manifest.join("../../../shared/qwen3.6-35b-a3b");
    if fallback.join("tokenizer.json").exists() {
        return Some(fallback);
    }
    println!("SKIPPED: {test}: TERN_QWEN_DIR not set");
    None
}
