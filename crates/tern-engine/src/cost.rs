//! The constrained-decoding cost measurement behind docs/perf.md's table, the same on every backend: one request
//! without a constraint and two under JSON schemas (sixty short strings: small masks; one 400-character string: a
//! ~224k-id mask every token), sampled as the checkpoint suggests (top-k 20, top-p 0.95, temperature 1, seeded).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tern_text::{Grammars, Reply, SamplingParams, Spec, Tokenizer, DEFAULT_STOP_IDS};

use crate::{Backend, Constraint, Engine, EngineConfig, Event, Request};

/// One reply of the measurement.
#[derive(Debug)]
pub struct CostRow {
    pub case: &'static str,
    pub tokens: usize,
    /// Decode time per token: between the first and the last token.
    pub ms_per_token: f64,
    /// Mask computation per token, and how much of it a step waited for (engine stats).
    pub mask_us: f64,
    pub wait_us: f64,
}

/// Run the three replies on `backend` with the tokenizer and chat grammar of the checkpoint directory `dir`; every
/// constrained reply must parse and follow its schema (else an error).
pub fn constrained_decoding_cost(backend: Arc<dyn Backend>, dir: &Path) -> Result<Vec<CostRow>> {
    let tok = Arc::new(Tokenizer::from_dir(dir)?);
    let grammars = Grammars::from_dir(dir)?;
    let prompt = tok.encode("<|im_start|>user\nData please<|im_end|>\n<|im_start|>assistant\n", false)?;
    let reply = Reply { thinking: false, reasoning_budget: None, stop_ids: DEFAULT_STOP_IDS.to_vec() };
    let short = serde_json::json!({"type": "array", "items": {"type": "string", "maxLength": 4},
                                   "minItems": 60, "maxItems": 60});
    let long = serde_json::json!({"type": "object", "properties": {"text": {"type": "string", "minLength": 400,
                                  "maxLength": 400}}, "required": ["text"], "additionalProperties": false});
    let cases: [(&'static str, Option<&serde_json::Value>); 3] =
        [("free text", None), ("short strings", Some(&short)), ("one long string", Some(&long))];
    let mut rows = Vec::new();
    for (case, schema) in cases {
        let engine = Engine::start(backend.clone(), tok.clone(), EngineConfig::default());
        let constraint = match schema {
            Some(s) => Some(Constraint::new(grammars.compile(Spec::JsonSchema { schema: s, strict: true }, &reply)?)),
            None => None,
        };
        let req = Request {
            prompt: prompt.clone(),
            sampling: SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.95, seed: Some(3), ..Default::default() },
            max_tokens: 200,
            stop_strings: vec![],
            // free text runs its 200 tokens; a schema ends where its JSON does (or at 200)
            stop_ids: if schema.is_some() { DEFAULT_STOP_IDS.to_vec() } else { vec![] },
            logprobs: None,
            constraint,
            min_tokens: 0,
            images: Vec::new(),
        };
        let (mut first, mut last, mut n, mut text) = (None, None, 0usize, String::new());
        for ev in engine.submit(req).map_err(|e| anyhow::anyhow!("{case}: {e}"))? {
            match ev {
                Event::Token { text: t, .. } => {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = Some(now);
                    n += 1;
                    text += &t;
                }
                Event::Error(e) => bail!("{case}: {e}"),
                Event::Done { .. } => {}
            }
        }
        let (Some(first), Some(last)) = (first, last) else { bail!("{case}: no tokens") };
        if schema.is_some() {
            let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{case}: {text}"))?;
            let ok = v.as_array().is_some_and(|a| a.len() == 60)
                || v["text"].as_str().is_some_and(|t| t.chars().count() == 400);
            if !ok {
                bail!("{case}: the reply does not follow its schema: {text}");
            }
        }
        let s = &engine.stats;
        let masks = s.masks.load(Ordering::Relaxed).max(1) as f64;
        rows.push(CostRow {
            case,
            tokens: n,
            ms_per_token: (last - first).as_secs_f64() * 1e3 / (n.max(2) - 1) as f64,
            mask_us: s.mask_us.load(Ordering::Relaxed) as f64 / masks,
            wait_us: s.mask_wait_us.load(Ordering::Relaxed) as f64 / masks,
        });
    }
    Ok(rows)
}
