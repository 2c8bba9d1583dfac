//! The checkpoint's tokenizer (`tokenizer.json`, byte-level BPE, NFC normalizer), via the
//! `tokenizers` crate with its pure-Rust regex backend.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use crate::{Result, TextError};

/// Byte-level BPE tokenizer loaded from `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Added tokens: id → (content, special). Their text is literal, not byte-level.
    added: HashMap<u32, (String, bool)>,
    /// Inverse of GPT-2's `bytes_to_unicode`: char of a vocab piece → raw byte.
    char_to_byte: HashMap<char, u8>,
    /// The most bytes one token stands for (computed on first use).
    max_token_bytes: OnceLock<usize>,
    /// `inner.get_vocab_size(true)`, which builds the whole vocabulary map on every call (80 ms here; the engine
    /// asks once per request, on the scheduler thread).
    vocab_size: usize,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TextError::TokenizerLoad { path: path.to_path_buf(), message: e.to_string() })?;
        let added =
            inner.get_added_tokens_decoder().into_iter().map(|(id, tok)| (id, (tok.content, tok.special))).collect();
        let char_to_byte = byte_level_chars().into_iter().enumerate().map(|(b, c)| (c, b as u8)).collect();
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self { inner, added, char_to_byte, max_token_bytes: OnceLock::new(), vocab_size })
    }

    /// Encodes text. Special tokens written in the text (e.g. `<|im_start|>`) map to their ids.
    /// `add_special` applies the post-processor (a no-op for this checkpoint: no BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special).map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text (special tokens included as text); invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend(self.token_bytes(id).ok_or_else(|| TextError::Tokenizer(format!("unknown token id {id}")))?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes a token stands for (a piece may be part of a multi-byte UTF-8 character).
    /// `None` for ids outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if let Some((content, _)) = self.added.get(&id) {
            return Some(content.as_bytes().to_vec());
        }
        let piece = self.inner.id_to_token(id)?;
        piece.chars().map(|c| self.char_to_byte.get(&c).copied()).collect()
    }

    /// The vocabulary entry (byte-level encoded piece, or added token content) of an id.
    pub fn piece(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry or added token, e.g. `id_of("<|im_end|>") == Some(248046)`.
    pub fn id_of(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer knows (BPE vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The most bytes any one token stands for (128 for this checkpoint: a run of spaces).
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            let ids = 0..self.vocab_size() as u32;
            ids.filter_map(|id| self.token_bytes(id).map(|b| b.len())).max().unwrap_or(1).max(1)
        })
    }

    /// A lower bound on `encode(text, false).len()`, from the length alone (no tokenising): the tokens' bytes
    /// concatenate to the NFC-normalised text, no token is longer than [`Self::max_token_bytes`], NFC leaves ASCII
    /// as it is, and NFC composition shrinks other text at most 3x (Hangul jamo: 9 bytes to 3), counted here as 4x.
    /// A text whose bound exceeds the context cannot fit it, so it can be refused before the (costly) encoding.
    pub fn min_tokens(&self, text: &str) -> usize {
        let ascii = text.bytes().filter(u8::is_ascii).count();
        let normalised_at_least = ascii + (text.len() - ascii) / 4;
        normalised_at_least / self.max_token_bytes()
    }

    /// Whether `id` is a special added token (e.g. `<|im_end|>`, `<think>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(&id).is_some_and(|(_, special)| *special)
    }
}

/// GPT-2's `bytes_to_unicode`: the printable char standing for each byte 0..=255.
fn byte_level_chars() -> Vec<char> {
    let printable = |b: u32| {
        (u32::from(b'!')..=u32::from(b'~')).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).unwrap_or('\u{FFFD}')
        })
        .collect()
}
