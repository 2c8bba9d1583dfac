//! Incremental detokenizer: token ids in, newly completed text out.
//!
//! Never emits part of a UTF-8 character (bytes of a character split across byte-level tokens
//! are held back) and never emits text that might still turn out to be the start of a stop
//! string. Generation finishes on a stop id, a stop string (text up to it is emitted, the stop
//! string itself is not) or after `max_tokens` tokens.

use crate::tokenizer::Tokenizer;
use crate::{Result, TextError};

/// When to stop.
#[derive(Clone, Debug, Default)]
pub struct DetokConfig {
    /// Ids that end generation; they produce no text (e.g. [`crate::DEFAULT_STOP_IDS`]).
    pub stop_ids: Vec<u32>,
    /// Strings that end generation; the text before the first match is emitted.
    pub stop_strings: Vec<String>,
    /// Maximum number of tokens to accept (stop ids included); `None` = unlimited.
    pub max_tokens: Option<usize>,
    /// Stop strings are not looked for in the text of the first this many tokens (vLLM's `min_tokens`; keeping
    /// stop ids from being drawn so early is the sampler's part). Their text is emitted as it comes.
    pub min_tokens: usize,
}

/// Why generation finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop id was produced.
    StopId(u32),
    /// A stop string was produced (the string itself is not emitted).
    StopString(String),
    /// `max_tokens` reached.
    Length,
}

/// Result of one [`Detokenizer::push`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Text that became final with this token (may be empty).
    pub text: String,
    /// Set once generation is over; later pushes return no text and the same reason.
    pub finish: Option<Finish>,
}

/// Streaming detokenizer for one generation.
pub struct Detokenizer<'t> {
    tokenizer: &'t Tokenizer,
    config: DetokConfig,
    /// Trailing bytes of an incomplete UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text not yet emitted because it may begin a stop string.
    held: String,
    tokens: usize,
    finish: Option<Finish>,
}

impl<'t> Detokenizer<'t> {
    pub fn new(tokenizer: &'t Tokenizer, config: DetokConfig) -> Self {
        Self { tokenizer, config, pending: Vec::new(), held: String::new(), tokens: 0, finish: None }
    }

    /// The finish reason, once finished.
    pub fn finish(&self) -> Option<&Finish> {
        self.finish.as_ref()
    }

    /// Number of tokens accepted so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Feeds one generated id. Errors only on ids the tokenizer does not know.
    pub fn push(&mut self, id: u32) -> Result<Step> {
        if let Some(finish) = &self.finish {
            return Ok(Step { text: String::new(), finish: Some(finish.clone()) });
        }
        self.tokens += 1;
        if self.config.stop_ids.contains(&id) {
            return Ok(self.end(Finish::StopId(id)));
        }
        let bytes =
            self.tokenizer.token_bytes(id).ok_or_else(|| TextError::Tokenizer(format!("unknown token id {id}")))?;
        Ok(self.push_bytes(&bytes))
    }

    /// Ends the stream without a finish reason (e.g. the caller aborted) and returns all text
    /// still held back; an incomplete character becomes U+FFFD.
    pub fn flush(&mut self) -> String {
        let mut text = std::mem::take(&mut self.held);
        text.push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.pending)));
        text
    }

    /// Core of [`Self::push`] on a token's raw bytes.
    fn push_bytes(&mut self, bytes: &[u8]) -> Step {
        self.pending.extend_from_slice(bytes);
        self.held.push_str(&take_complete_utf8(&mut self.pending));
        if self.tokens < self.config.min_tokens {
            if self.config.max_tokens.is_some_and(|max| self.tokens >= max) {
                return self.end(Finish::Length);
            }
            return Step { text: std::mem::take(&mut self.held), finish: None };
        }
        // A stop string can only start inside `held`: everything before it was checked.
        let first_stop = self
            .config
            .stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, s)| (*pos, std::cmp::Reverse(s.len())));
        if let Some((pos, stop)) = first_stop {
            let stop = stop.clone();
            self.held.truncate(pos);
            self.pending.clear();
            return self.end(Finish::StopString(stop));
        }
        if self.config.max_tokens.is_some_and(|max| self.tokens >= max) {
            return self.end(Finish::Length);
        }
        let keep = self.stop_prefix_len();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Step { text, finish: None }
    }

    fn end(&mut self, finish: Finish) -> Step {
        let text = self.flush();
        self.finish = Some(finish.clone());
        Step { text, finish: Some(finish) }
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string (prefixes longer than
    /// `held` cannot be its suffix: not tried, so the usual few held bytes cost a few compares per stop string).
    fn stop_prefix_len(&self) -> usize {
        let held = self.held.as_str();
        self.config
            .stop_strings
            .iter()
            .flat_map(|stop| {
                stop.char_indices()
                    .map(|(i, _)| i)
                    .skip(1)
                    .take_while(|&i| i <= held.len())
                    .filter(|&i| held.ends_with(&stop[..i]))
            })
            .max()
            .unwrap_or(0)
    }
}

/// Removes and returns the longest decodable prefix of `bytes`, keeping only an incomplete
/// trailing character; invalid bytes become U+FFFD.
fn take_complete_utf8(bytes: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut rest: &[u8] = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        rest = &after[bad..];
                    }
                    None => {
                        rest = after;
                        break;
                    }
                }
            }
        }
    }
    *bytes = rest.to_vec();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_is_held_until_complete() {
        let mut buf = "é".as_bytes()[..1].to_vec();
        assert_eq!(take_complete_utf8(&mut buf), "");
        buf.push("é".as_bytes()[1]);
        assert_eq!(take_complete_utf8(&mut buf), "é");
        assert!(buf.is_empty());
        let mut bad = vec![b'a', 0xff, b'b', 0xf0, 0x9f];
        assert_eq!(take_complete_utf8(&mut bad), "a\u{FFFD}b");
        assert_eq!(bad, vec![0xf0, 0x9f]);
    }
}
