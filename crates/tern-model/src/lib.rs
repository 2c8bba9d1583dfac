//! Qwen3.6-35B-A3B (`qwen3_5_moe`): config, checkpoint loading, and the CPU reference forward pass.

pub mod config;
pub mod forward;
pub mod mlx;
pub mod quant;
pub mod random;
pub mod safetensors;
pub mod vision;
pub mod weights;

pub use config::{Config, LayerKind};
pub use forward::{ImageRows, Logits, MtpPart, Output, State};
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

    /// The real config (the real 248,320-id vocabulary) with the `text_config` sizes in `sizes` (its layer list
    /// rebuilt from the layer count), as random 4-bit weights of `seed` (the recipe the product loads); `None`
    /// without [`qwen_dir`].
    pub fn real_vocab_q4(sizes: &[(&str, i64)], seed: u64) -> Option<crate::Weights> {
        let dir = qwen_dir()?;
        let text = std::fs::read_to_string(dir.join("config.json")).expect("the real config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&text).expect("the real config.json parses");
        let t = &mut cfg["text_config"];
        for &(k, v) in sizes {
            t[k] = v.into();
        }
        t.as_object_mut().expect("text_config is an object").remove("layer_types");
        let c = crate::Config::from_json(&cfg).expect("the shrunk config");
        let spec = crate::mlx::QuantSpec::q4(&c);
        Some(
            crate::Weights::from_values(c, &crate::random::RandomValues { seed }, Some(&spec)).expect("random weights"),
        )
    }
}
