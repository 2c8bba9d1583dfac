//! Text in, text out for tern (Qwen3.6-35B-A3B).
//!
//! * [`tokenizer`] — the checkpoint's byte-level BPE tokenizer (`tokenizer.json`).
//! * [`chat`] — renders the checkpoint's own Jinja chat template, byte-identical to transformers.
//! * [`sampler`] — logits → next token (temperature, top-k/p, min-p, penalties, bias, seed).
//! * [`detok`] — incremental detokenizer with UTF-8 hold-back, stop ids/strings and max tokens.
//! * [`parser`] — streaming split of model output into reasoning, content and tool calls.
//! * [`constraint`] — constrained decoding (JSON schema, Lark grammar, forced tool calls) with llguidance.

pub mod chat;
pub mod constraint;
pub mod detok;
pub mod parser;
pub mod sampler;
pub mod tokenizer;

use std::path::PathBuf;

pub use chat::{ChatOptions, ChatTemplate, Rendered};
pub use constraint::{Constrained, GrammarError, Grammars, Reply, Spec};
pub use detok::{DetokConfig, Detokenizer, Finish, Step};
pub use parser::{OutputParser, ParseEvent, ToolCall};
pub use sampler::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;

/// `<|endoftext|>`
pub const ENDOFTEXT_ID: u32 = 248044;
/// `<|im_start|>`
pub const IM_START_ID: u32 = 248045;
/// `<|im_end|>`
pub const IM_END_ID: u32 = 248046;
/// `<tool_call>`
pub const TOOL_CALL_ID: u32 = 248058;
/// `</tool_call>`
pub const TOOL_CALL_END_ID: u32 = 248059;
/// `<think>`
pub const THINK_ID: u32 = 248068;
/// `</think>`
pub const THINK_END_ID: u32 = 248069;
/// Default stop ids (`eos_token_id` in generation_config.json).
pub const DEFAULT_STOP_IDS: [u32; 2] = [IM_END_ID, ENDOFTEXT_ID];

/// Errors from this crate. File-related errors name the file.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: cannot load tokenizer: {message}")]
    TokenizerLoad { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{path}: no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)")]
    NoChatTemplate { path: PathBuf },
    /// The template failed to compile or render; `raise_exception(msg)` yields `msg` here.
    #[error("chat template: {0}")]
    Template(String),
}

/// Result alias for this crate.
pub type Result<T, E = TextError> = std::result::Result<T, E>;

/// Reads a whole file as UTF-8, naming it in the error.
pub(crate) fn read_file(path: &std::path::Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TextError::Io { path: path.to_path_buf(), source })
}

/// Reads and parses a JSON file, naming it in errors.
pub(crate) fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    serde_json::from_str(&read_file(path)?).map_err(|source| TextError::Json { path: path.to_path_buf(), source })
}
