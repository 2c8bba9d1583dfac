//! Qwen3.6-35B-A3B (`qwen3_5_moe`): config, checkpoint loading, and the CPU reference forward pass.

pub mod config;
pub mod forward;
pub mod mlx;
pub mod quant;
pub mod random;
pub mod safetensors;
pub mod weights;

pub use config::{Config, LayerKind};
pub use forward::{Logits, State};
pub use weights::{LoadOptions, Weights};

/// Helpers shared by the tests of this crate and others.
pub mod testutil {
    use std::path::PathBuf;

    /// The real model directory without weights (../shared/qwen3.6-35b-a3b), from `TERN_QWEN_DIR`, or found
    /// beside the checkout. `None` means tests that need it print `SKIPPED:` and return.
    pub fn qwen_dir() -> Option<PathBuf> {
        if let Some(d) = std::env::var_os("TERN_QWEN_DIR") {
            return Some(PathBuf::from(d));
        }
        let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/qwen3.6-35b-a3b");
        beside.join("config.json").exists().then_some(beside)
    }

    /// The committed fixtures written by tools/make_fixtures.py.
    pub fn fixtures_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
    }
}
