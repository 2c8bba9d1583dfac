//! `config.json` of a `qwen3_5_moe` checkpoint: the official nested layout (`text_config`) or a flat one.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet ("linear_attention").
    Linear,
    /// Gated full attention ("full_attention").
    Full,
}

/// The text model's hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub hidden_size: usize,
    pub layer_types: Vec<LayerKind>,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    // gated attention
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Dimensions that rotate: `head_dim * partial_rotary_factor`.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// M-RoPE: how many of the `rotary_dim / 2` frequencies follow the (time, height, width) position streams,
    /// interleaved as transformers' Qwen3_5Moe does (frequency `i` follows height when `i % 3 == 1` and
    /// `i < 3 * section[1]`, width when `i % 3 == 2` and `i < 3 * section[2]`, time otherwise). Text-only
    /// positions are equal in all three streams, so it only matters with images.
    pub mrope_section: [usize; 3],
    /// The id of the image placeholder token (`image_token_id`, top level).
    pub image_token_id: u32,
    // Gated DeltaNet
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // MoE
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    // multi-token prediction (model-spec §3.3)
    /// MTP decoder layers (`mtp_num_hidden_layers`; 0 when the config has none). The real model has 1.
    pub mtp_num_hidden_layers: usize,
    /// `mtp_use_dedicated_embeddings`: the MTP block has its own embedding table (false in the real model: it
    /// shares `embed_tokens` and `lm_head`).
    pub mtp_use_dedicated_embeddings: bool,
}

impl Config {
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }
    /// GDN key dimension over all key heads.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// GDN value dimension over all value heads.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the causal conv: q ‖ k ‖ v.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// Read `config.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        Config::from_json(&v).with_context(|| format!("in {}", path.display()))
    }

    /// Parse the official nested layout (hyper-parameters under `text_config`) or a flat one.
    pub fn from_json(root: &Value) -> Result<Config> {
        let known = ["qwen3_5_moe", "qwen3_5_moe_text"];
        let arch_ok = |v: &Value| -> Result<()> {
            if let Some(mt) = v.get("model_type").and_then(Value::as_str) {
                if !known.contains(&mt) {
                    bail!("model_type: unsupported architecture {mt:?} (tern runs only qwen3_5_moe)");
                }
            }
            Ok(())
        };
        arch_ok(root)?;
        if let Some(archs) = root.get("architectures").and_then(Value::as_array) {
            for a in archs.iter().filter_map(Value::as_str) {
                if !a.starts_with("Qwen3_5Moe") {
                    bail!("architectures: unsupported architecture {a:?} (tern runs only Qwen3_5Moe*)");
                }
            }
        }
        let t = root.get("text_config").unwrap_or(root);
        arch_ok(t)?;
        if t.get("model_type").is_none() && root.get("model_type").is_none() {
            bail!("model_type: missing (expected \"qwen3_5_moe\")");
        }

        let get = |k: &str| t.get(k).filter(|v| !v.is_null());
        let uint = |k: &str| -> Result<usize> {
            let v = get(k).with_context(|| format!("{k}: missing"))?;
            let n = v.as_u64().with_context(|| format!("{k}: expected a positive integer, got {v}"))?;
            if n == 0 {
                bail!("{k}: must be positive, got 0");
            }
            Ok(n as usize)
        };
        let float_or = |k: &str, d: f64| -> Result<f64> {
            match get(k) {
                None => Ok(d),
                Some(v) => v.as_f64().with_context(|| format!("{k}: expected a number, got {v}")),
            }
        };

        let num_layers = uint("num_hidden_layers")?;
        let layer_types = match get("layer_types") {
            Some(v) => {
                let arr = v.as_array().context("layer_types: expected a list")?;
                let kinds = arr
                    .iter()
                    .enumerate()
                    .map(|(i, s)| match s.as_str() {
                        Some("linear_attention") => Ok(LayerKind::Linear),
                        Some("full_attention") => Ok(LayerKind::Full),
                        _ => bail!("layer_types[{i}]: expected \"linear_attention\" or \"full_attention\", got {s}"),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if kinds.len() != num_layers {
                    bail!("layer_types: {} entries but num_hidden_layers is {num_layers}", kinds.len());
                }
                kinds
            }
            None => {
                let interval = match get("full_attention_interval") {
                    None => 4,
                    Some(_) => uint("full_attention_interval")?,
                };
                (0..num_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerKind::Full } else { LayerKind::Linear })
                    .collect()
            }
        };

        let rope = get("rope_parameters");
        let rope_get = |k: &str| rope.and_then(|r| r.get(k)).filter(|v| !v.is_null());
        if let Some(rt) = rope_get("rope_type").or_else(|| get("rope_scaling").and_then(|r| r.get("rope_type"))) {
            if rt.as_str() != Some("default") {
                bail!("rope_parameters.rope_type: only \"default\" is supported, got {rt}");
            }
        }
        let rope_theta = match rope_get("rope_theta") {
            Some(v) => v.as_f64().with_context(|| format!("rope_parameters.rope_theta: expected a number, got {v}"))?,
            None => float_or("rope_theta", 10_000.0)?,
        };
        let partial = match rope_get("partial_rotary_factor") {
            Some(v) => v
                .as_f64()
                .with_context(|| format!("rope_parameters.partial_rotary_factor: expected a number, got {v}"))?,
            None => float_or("partial_rotary_factor", 0.25)?,
        };

        let mrope_section =
            match rope_get("mrope_section").or_else(|| get("rope_scaling").and_then(|r| r.get("mrope_section"))) {
                None => [11, 11, 10],
                Some(v) => {
                    let a = v
                        .as_array()
                        .filter(|a| a.len() == 3)
                        .with_context(|| format!("mrope_section: expected 3 integers, got {v}"))?;
                    let f = |i: usize| {
                        a[i].as_u64()
                            .map(|n| n as usize)
                            .with_context(|| format!("mrope_section: expected 3 integers, got {v}"))
                    };
                    [f(0)?, f(1)?, f(2)?]
                }
            };
        let image_token_id = match root.get("image_token_id").or_else(|| get("image_token_id")).filter(|v| !v.is_null())
        {
            None => 248_056,
            Some(v) => v.as_u64().with_context(|| format!("image_token_id: expected an integer, got {v}"))? as u32,
        };
        let head_dim = uint("head_dim")?;
        let c = Config {
            hidden_size: uint("hidden_size")?,
            layer_types,
            vocab_size: uint("vocab_size")?,
            rms_norm_eps: float_or("rms_norm_eps", 1e-6)? as f32,
            tie_word_embeddings: get("tie_word_embeddings")
                .or_else(|| root.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_position_embeddings: match get("max_position_embeddings") {
                None => 262_144,
                Some(_) => uint("max_position_embeddings")?,
            },
            num_attention_heads: uint("num_attention_heads")?,
            num_key_value_heads: uint("num_key_value_heads")?,
            head_dim,
            rotary_dim: (head_dim as f64 * partial) as usize,
            rope_theta,
            mrope_section,
            image_token_id,
            linear_num_key_heads: uint("linear_num_key_heads")?,
            linear_num_value_heads: uint("linear_num_value_heads")?,
            linear_key_head_dim: uint("linear_key_head_dim")?,
            linear_value_head_dim: uint("linear_value_head_dim")?,
            linear_conv_kernel_dim: uint("linear_conv_kernel_dim")?,
            num_experts: uint("num_experts")?,
            num_experts_per_tok: uint("num_experts_per_tok")?,
            moe_intermediate_size: uint("moe_intermediate_size")?,
            shared_expert_intermediate_size: uint("shared_expert_intermediate_size")?,
            mtp_num_hidden_layers: match get("mtp_num_hidden_layers") {
                None => 0,
                Some(v) => {
                    v.as_u64().with_context(|| format!("mtp_num_hidden_layers: expected an integer, got {v}"))? as usize
                }
            },
            mtp_use_dedicated_embeddings: match get("mtp_use_dedicated_embeddings") {
                None => false,
                Some(v) => v
                    .as_bool()
                    .with_context(|| format!("mtp_use_dedicated_embeddings: expected true or false, got {v}"))?,
            },
        };
        c.validate(partial)?;
        Ok(c)
    }

    fn validate(&self, partial: f64) -> Result<()> {
        if partial.is_nan() || partial <= 0.0 || partial > 1.0 {
            bail!("partial_rotary_factor: must be in (0, 1], got {partial}");
        }
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) {
            bail!(
                "partial_rotary_factor: head_dim {} × {partial} gives rotary dim {}, which must be even and positive",
                self.head_dim,
                self.rotary_dim
            );
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "num_key_value_heads: {} does not divide num_attention_heads {}",
                self.num_key_value_heads,
                self.num_attention_heads
            );
        }
        if !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            bail!(
                "linear_num_key_heads: {} does not divide linear_num_value_heads {}",
                self.linear_num_key_heads,
                self.linear_num_value_heads
            );
        }
        if self.num_experts_per_tok > self.num_experts {
            bail!("num_experts_per_tok: {} exceeds num_experts {}", self.num_experts_per_tok, self.num_experts);
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 || self.rms_norm_eps >= 1.0 {
            bail!("rms_norm_eps: must be in (0, 1), got {}", self.rms_norm_eps);
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 1.0 {
            bail!("rope_theta: must be > 1, got {}", self.rope_theta);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn flat() -> Value {
        json!({
            "model_type": "qwen3_5_moe", "hidden_size": 64, "num_hidden_layers": 8, "full_attention_interval": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100,
            "partial_rotary_factor": 0.25, "rope_theta": 1e7,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "rms_norm_eps": 1e-6
        })
    }

    #[test]
    fn flat_layout_with_interval() {
        let c = Config::from_json(&flat()).unwrap();
        assert_eq!(c.num_layers(), 8);
        assert_eq!(c.layer_types[3], LayerKind::Full);
        assert_eq!(c.layer_types[7], LayerKind::Full);
        assert_eq!(c.layer_types[4], LayerKind::Linear);
        assert_eq!(c.rotary_dim, 8);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(c.linear_conv_dim(), 2 * 32 + 32);
    }

    #[test]
    fn nested_layout_matches_flat() {
        let mut f = flat();
        let nested = json!({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                            "text_config": f.clone()});
        f["model_type"] = json!("qwen3_5_moe_text");
        assert_eq!(Config::from_json(&nested).unwrap(), Config::from_json(&f).unwrap());
    }

    #[test]
    fn real_config_if_present() {
        let Some(dir) = crate::testutil::qwen_dir() else {
            println!("SKIPPED: real_config_if_present: TERN_QWEN_DIR not set");
            return;
        };
        let c = Config::from_dir(&dir).unwrap();
        assert_eq!(c.hidden_size, 2048);
        assert_eq!(c.num_layers(), 40);
        assert_eq!(c.layer_types.iter().filter(|k| **k == LayerKind::Full).count(), 10);
        assert_eq!(c.rotary_dim, 64);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(c.linear_conv_dim(), 8192);
        assert_eq!(c.vocab_size, 248_320);
        assert_eq!((c.num_experts, c.num_experts_per_tok), (256, 8));
        assert_eq!((c.mtp_num_hidden_layers, c.mtp_use_dedicated_embeddings), (1, false));
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(&str, Value, &str)> = vec![
            ("model_type", json!("llama"), "model_type"),
            ("num_key_value_heads", json!(3), "num_key_value_heads"),
            ("linear_num_value_heads", json!(5), "linear_num_key_heads"),
            ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
            ("hidden_size", json!(0), "hidden_size"),
            ("head_dim", json!("x"), "head_dim"),
            ("layer_types", json!(["linear_attention"]), "layer_types"),
            ("partial_rotary_factor", json!(1.5), "partial_rotary_factor"),
        ];
        for (field, value, expect) in cases {
            let mut v = flat();
            v[field] = value;
            let err = format!("{:#}", Config::from_json(&v).unwrap_err());
            assert!(err.contains(expect), "{field}: {err}");
        }
        let mut v = flat();
        v.as_object_mut().unwrap().remove("vocab_size");
        assert!(format!("{:#}", Config::from_json(&v).unwrap_err()).contains("vocab_size: missing"));
        let arch = json!({"architectures": ["LlamaForCausalLM"], "text_config": flat()});
        assert!(format!("{:#}", Config::from_json(&arch).unwrap_err()).contains("architectures"));
    }
}
