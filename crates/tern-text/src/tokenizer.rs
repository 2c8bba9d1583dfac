//! The checkpoint's tokenizer (`tokenizer.json`, byte-level BPE, NFC normalizer), via the
//! `tokenizers` crate with its pure-Rust regex backend.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use unicode_normalization_alignments::IsNormalized;

use crate::{Result, TextError};

/// Byte-level BPE tokenizer loaded from `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Added tokens: id → (content, special). Their text is literal, not byte-level.
    added: HashMap<u32, (String, bool)>,
    /// Added tokens' contents with their ids, longest first (for [`Self::added_token_at`]).
    added_longest_first: Vec<(String, u32)>,
    /// Inverse of GPT-2's `bytes_to_unicode`: char of a vocab piece → raw byte.
    char_to_byte: HashMap<char, u8>,
    /// The most bytes a token of each class stands for (computed on first use; see [`Self::min_tokens`]).
    bounds: OnceLock<TokenBounds>,
    /// `inner.get_vocab_size(true)`, which builds the whole vocabulary map on every call (80 ms here; the engine
    /// asks once per request, on the scheduler thread).
    vocab_size: usize,
    /// Whether a text may be tokenised in pieces ([`Self::encode_within`]): the normaliser, pre-tokenizer and added
    /// tokens are the ones whose splitting [`pieces`] relies on.
    piecewise: bool,
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
        let added: HashMap<u32, (String, bool)> =
            inner.get_added_tokens_decoder().into_iter().map(|(id, tok)| (id, (tok.content, tok.special))).collect();
        let char_to_byte = byte_level_chars().into_iter().enumerate().map(|(b, c)| (c, b as u8)).collect();
        let vocab_size = inner.get_vocab_size(true);
        let mut added_longest_first: Vec<(String, u32)> =
            added.iter().filter(|(_, (c, _))| !c.is_empty()).map(|(&id, (c, _))| (c.clone(), id)).collect();
        added_longest_first.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let json = |v: Option<String>| v.unwrap_or_default();
        let piecewise = json(inner.get_pre_tokenizer().and_then(|p| serde_json::to_string(p).ok()))
            == QWEN_PRE_TOKENIZER
            && json(inner.get_normalizer().and_then(|n| serde_json::to_string(n).ok())) == r#"{"type":"NFC"}"#
            && inner
                .get_added_tokens_decoder()
                .values()
                .all(|t| !(t.lstrip || t.rstrip || t.single_word || t.content.contains([' ', '\n', '\r'])));
        Ok(Self { inner, added, added_longest_first, char_to_byte, bounds: OnceLock::new(), vocab_size, piecewise })
    }

    /// [`Self::encode`] (or, `as_text`, [`Self::encode_text`]) of a text, or `None` if it has more than `limit`
    /// tokens: the text is tokenised in pieces of about 64 KiB, split where its tokens split anyway (so the
    /// ids are the same), and the count stops at the first piece that takes it past `limit`. A prompt too long for
    /// the context is refused after tokenising about as much of it as the context holds, not all of it (600 kB of
    /// prose: 110k tokens).
    pub fn encode_within(&self, text: &str, as_text: bool, limit: usize) -> Result<Option<Vec<u32>>> {
        let mut ids = Vec::new();
        for piece in pieces(text, if self.piecewise { PIECE_BYTES } else { usize::MAX }) {
            ids.extend(if as_text { self.encode_text(piece)? } else { self.encode(piece, false)? });
            if ids.len() > limit {
                return Ok(None);
            }
        }
        Ok(Some(ids))
    }

    /// Encodes text. Special tokens written in the text (e.g. `<|im_start|>`) map to their ids.
    /// `add_special` applies the post-processor (a no-op for this checkpoint: no BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special).map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes text as text: strings of added tokens in it (`<|im_start|>`, `<think>`, ...) are split like any
    /// other text, never read as those tokens. For a text holding no such string this is [`Self::encode`]
    /// (without the post-processor): the same normalizer, pre-tokenizer and BPE, which `encode` runs on the
    /// pieces between added tokens.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        use tokenizers::{Model, Normalizer, OffsetType, PreTokenizedString, PreTokenizer};
        let err = |e: tokenizers::Error| TextError::Tokenizer(e.to_string());
        if text.is_empty() {
            return Ok(Vec::new());
        }
        let mut pieces = PreTokenizedString::from(text);
        if let Some(n) = self.inner.get_normalizer() {
            pieces.normalize(|s| n.normalize(s)).map_err(err)?;
        }
        if let Some(p) = self.inner.get_pre_tokenizer() {
            p.pre_tokenize(&mut pieces).map_err(err)?;
        }
        let model = self.inner.get_model();
        pieces.tokenize(|s| model.tokenize(s.get())).map_err(err)?;
        let enc = pieces.into_encoding(None, 0, OffsetType::None).map_err(err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// The added token (e.g. `<|im_end|>`) that `text` starts with, the longest if several do: its id and
    /// length in bytes.
    pub fn added_token_at(&self, text: &str) -> Option<(u32, usize)> {
        self.added_longest_first.iter().find(|(c, _)| text.starts_with(c.as_str())).map(|(c, id)| (*id, c.len()))
    }

    /// Whether every added token starts with `c` (`<` for this checkpoint).
    pub fn added_tokens_start_with(&self, c: char) -> bool {
        self.added_longest_first.iter().all(|(t, _)| t.starts_with(c))
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
        self.bounds().space
    }

    fn bounds(&self) -> &TokenBounds {
        self.bounds.get_or_init(|| {
            let mut b = TokenBounds { word: 1, punct: 1, space: 1, digits_alone: false };
            for id in 0..self.vocab_size() as u32 {
                let Some(bytes) = self.token_bytes(id) else { continue };
                let max = match bytes.iter().map(|&x| ByteClass::of(x)).min() {
                    Some(ByteClass::Word | ByteClass::Digit) => &mut b.word,
                    Some(ByteClass::Punct) => &mut b.punct,
                    Some(ByteClass::Space) => &mut b.space,
                    None => continue,
                };
                *max = (*max).max(bytes.len());
            }
            // A class's bytes may also be covered by the tokens of the classes before it.
            b.punct = b.punct.max(b.word);
            b.space = b.space.max(b.punct);
            // The Qwen pre-tokenizer's `\p{N}` alternative makes every digit a piece, hence a token, of its own
            // (unless an added token, matched before pre-tokenizing, holds one).
            let pre = self.inner.get_pre_tokenizer().and_then(|p| serde_json::to_string(p).ok()).unwrap_or_default();
            b.digits_alone = pre.contains(r"|\\p{N}|")
                && self.added.values().all(|(content, _)| !content.bytes().any(|x| x.is_ascii_digit()));
            b
        })
    }

    /// A lower bound on `encode(text, false).len()` (and on [`Self::encode_text`]'s), from a count of the text's
    /// bytes by class (no tokenising; ~2 ms a MB): the tokens' bytes concatenate to the NFC-normalised text, and a
    /// token of letters (digits, non-ASCII: `word`) is at most 48 bytes long, one of ASCII punctuation and control
    /// characters 114, one of spaces 128 (the longest of each class in the vocabulary); every ASCII digit is a
    /// token of its own. A text that NFC leaves as it is (the quick check says so for almost every text) is
    /// counted as it is; otherwise NFC may compose non-ASCII text (at most 3x: Hangul jamo, 9 bytes to 3) and
    /// turn it into ASCII punctuation (U+037E to `;`): its non-ASCII bytes count a quarter, as punctuation. A text
    /// whose bound exceeds the context cannot fit it, so it can be refused before the (costly) encoding: 4 MB of
    /// English is at least ~70k tokens (a flat bytes / 128 said 31k, under a 32k context).
    pub fn min_tokens(&self, text: &str) -> usize {
        let b = self.bounds();
        let mut counts = [0u64; 4];
        for &x in text.as_bytes() {
            counts[ByteClass::of(x) as usize] += 1;
        }
        let [mut word, mut digit, mut punct, space] = counts;
        if !b.digits_alone {
            (word, digit) = (word + digit, 0);
        }
        let non_ascii = text.bytes().filter(|x| !x.is_ascii()).count() as u64;
        if non_ascii > 0 && unicode_normalization_alignments::is_nfc_quick(text.chars()) != IsNormalized::Yes {
            (word, punct) = (word - non_ascii, punct + non_ascii / 4);
        }
        let (w, p, s) = (b.word as u128, b.punct as u128, b.space as u128);
        let rest = (word as u128 * p * s + punct as u128 * w * s + space as u128 * w * p) / (w * p * s);
        usize::try_from(digit as u128 + rest).unwrap_or(usize::MAX)
    }

    /// Whether `id` is a special added token (e.g. `<|im_end|>`, `<think>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(&id).is_some_and(|(_, special)| *special)
    }
}

/// The pre-tokenizer of this checkpoint's tokenizer.json (as the `tokenizers` crate writes it back), whose splits
/// [`pieces`] relies on.
const QWEN_PRE_TOKENIZER: &str = r#"{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":false}]}"#;

/// The size [`Tokenizer::encode_within`] tokenises a text in, about.
const PIECE_BYTES: usize = 64 << 10;

/// `text` in consecutive pieces of at least `min` bytes (but the last), each ending where no token of the
/// whole text's tokenisation crosses: between a newline and an ASCII letter or digit, or between an ASCII letter
/// and a space followed by one. [`QWEN_PRE_TOKENIZER`] never puts either pair in one piece (a piece holding a
/// newline ends at its last newline; one holding letters and a space starts with that space), NFC composes
/// neither (both are starters that compose with nothing before them), and no added token holds a space or newline
/// (checked where [`Tokenizer::piecewise`] is set). A text without such places is one piece.
fn pieces(text: &str, min: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let b = rest.as_bytes();
        let cut = (min.max(1)..b.len())
            .find(|&i| {
                let (prev, next) = (b[i - 1], b[i]);
                (prev == b'\n' && next.is_ascii_alphanumeric())
                    || (prev.is_ascii_alphabetic() && next == b' ' && b.get(i + 1).is_some_and(u8::is_ascii_alphabetic))
            })
            .unwrap_or(b.len());
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// The longest token of each class of [`ByteClass`] (a token's class: its first class in that order), in bytes,
/// each at least the one before; and whether every ASCII digit is a token of its own.
#[derive(Clone, Copy, Debug)]
struct TokenBounds {
    word: usize,
    punct: usize,
    space: usize,
    digits_alone: bool,
}

/// What [`Tokenizer::min_tokens`] counts a byte as: a byte of a word (an ASCII letter or any non-ASCII byte), an
/// ASCII digit, ASCII punctuation or control, or a space.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum ByteClass {
    Word = 0,
    Digit = 1,
    Punct = 2,
    Space = 3,
}

impl ByteClass {
    fn of(x: u8) -> ByteClass {
        match x {
            b' ' => ByteClass::Space,
            b'0'..=b'9' => ByteClass::Digit,
            b'a'..=b'z' | b'A'..=b'Z' | 0x80.. => ByteClass::Word,
            _ => ByteClass::Punct,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_and_end_at_the_splits_only() {
        let text = "Some words here.\nAnd a 2nd line\n\n".repeat(20_000);
        let cut: Vec<&str> = pieces(&text, PIECE_BYTES).collect();
        assert!(cut.len() > 5, "{} pieces", cut.len());
        assert_eq!(cut.concat(), text);
        for (p, next) in cut.iter().zip(&cut[1..]) {
            assert!(p.len() >= PIECE_BYTES, "{}", p.len());
            let (a, b) = (p.as_bytes()[p.len() - 1], next.as_bytes());
            let split = (a == b'\n' && b[0].is_ascii_alphanumeric())
                || (a.is_ascii_alphabetic() && b[0] == b' ' && b[1].is_ascii_alphabetic());
            assert!(split, "{:?} | {:?}", &p[p.len() - 5..], &next[..5]);
        }
        // No place to split: one piece.
        let run = "\u{4f60}".repeat(100_000);
        assert_eq!(pieces(&run, PIECE_BYTES).collect::<Vec<_>>(), [run.as_str()]);
        assert_eq!(pieces(&text, usize::MAX).collect::<Vec<_>>(), [text.as_str()]);
    }

    #[test]
    fn the_checkpoints_tokenizer_is_tokenised_in_pieces() {
        let Ok(dir) = std::env::var("TERN_QWEN_DIR") else {
            println!("SKIPPED: the_checkpoints_tokenizer_is_tokenised_in_pieces: TERN_QWEN_DIR not set");
            return;
        };
        // (relative to the workspace, as the integration tests read it)
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(dir);
        assert!(Tokenizer::from_dir(dir).unwrap().piecewise, "its pre-tokenizer, normaliser or added tokens changed");
    }
}
