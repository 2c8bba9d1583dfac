//! Constrained decoding: which tokens may come next under a JSON schema, a Lark grammar or a forced tool call,
//! as a bitset over the tokenizer's ids, computed by [llguidance] over the checkpoint's own tokenizer.
//!
//! * [`Grammars`] is made once per model (it loads `tokenizer.json` into llguidance's token trie: ~1 s) and
//!   compiles a [`Spec`] into a [`Constrained`] per request (a JSON schema: about a millisecond).
//! * [`Constrained`] is the state of one reply: [`Constrained::mask`] gives the bitset of the next draw (bit `i %
//!   32` of word `i / 32` set: id `i` allowed), [`Constrained::commit`] advances past the token drawn.
//! * With thinking on, the reply starts inside reasoning and the grammar starts after `</think>` (and the up to
//!   two newlines the template writes after it): until then the mask allows every token but the ones that would
//!   end or skip the reasoning (the stop ids, `<tool_call>`), so a constrained reply cannot end before its
//!   constrained part; an optional budget forces `</think>` after that many reasoning tokens.
//! * Once the grammar is complete the mask allows only the stop ids (llguidance's end of sequence).
//! * A mask's work is bounded: by llguidance's limits (lexer fuel, `INITIAL_LEXER_FUEL` for the first mask; Earley
//!   items), and where the grammar forces bytes, by `ForcedPrefix`. A mask over them is an error saying the
//!   grammar is too expensive to enforce.
//! * Compiling is in two parts: [`Grammars::prepare`] checks a spec against the [`Limits`] (in time linear in
//!   its size, without recursion) and writes its grammar (the Lark of tool calls, GBNF read as Lark); then
//!   [`Grammars::build`] runs llguidance's compile, which recurses over the grammar: run it on a thread with
//!   [`COMPILE_STACK_BYTES`] of stack (what the limits are sized for; [`Grammars::compile`] does both on such a
//!   thread). A panic inside llguidance is caught; no error holds llguidance's parser state or a backtrace.
//!
//! Tool calls follow the checkpoint's XML format (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
//! </parameter>\n</function>\n</tool_call>`): a parameter whose schema type is a string is raw text (its enum,
//! pattern and length bounds enforced), any other is JSON that follows its schema, exactly as
//! [`crate::parser`] reads them back into the OpenAI `arguments` object.

mod gbnf;
mod limits;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Map, Value};

use crate::parser::param_type;
use crate::{IM_END_ID, THINK_END_ID, TOOL_CALL_END_ID, TOOL_CALL_ID};
pub use limits::Limits;
use limits::SchemaTally;

/// Stack for [`Grammars::build`]: llguidance's compile recurses along rule and `$ref` chains (about 3 KiB of stack
/// per rule, 20 KiB per `$ref` link to an object); the [`Limits`] keep the deepest accepted chain under a tenth of
/// this. Only the pages touched are ever committed.
pub const COMPILE_STACK_BYTES: usize = 256 << 20;

/// llguidance's lexer fuel for a grammar's lexer before its first mask (its default: 1M), which the first mask's
/// forced bytes also draw on (about 4 a byte): with the default a 30-byte regex (`/((a{100}){100}){100}/`) spent
/// 1.1 s in its first mask before failing, 0.2 s with this; `/a{100000}/` fails there in ~80 ms. Every later mask
/// gets llguidance's `step_lexer_fuel` (200k). The largest grammars the [`Limits`] accept compile with 100k; the
/// first mask of a 64 KiB literal needs under 250k.
const INITIAL_LEXER_FUEL: u64 = 250_000;

/// Whether a `grammar` text is llama.cpp's GBNF (its first rule is `name ::= ...`) rather than Lark.
pub fn is_gbnf(text: &str) -> bool {
    gbnf::is_gbnf(text)
}

/// What a reply must follow.
#[derive(Clone, Copy, Debug)]
pub enum Spec<'a> {
    /// A JSON value valid under `schema`. `strict`: a keyword llguidance does not enforce is an error; else it
    /// is ignored.
    JsonSchema { schema: &'a Value, strict: bool },
    /// Any JSON object.
    JsonObject,
    /// A Lark grammar (llguidance's dialect: `%json { ... }`, special tokens as `<...>`).
    Lark(&'a str),
    /// A GBNF grammar (llama.cpp's: `root ::= ...`), read as Lark.
    Gbnf(&'a str),
    /// One tool call, or with `parallel` one or more ([`MAX_PARALLEL_CALLS`] at most), to the given OpenAI tools
    /// (`{"type": "function", "function": {"name", "parameters"}}`), arguments following each one's parameters.
    ToolCalls { tools: &'a [Value], parallel: bool },
    /// No grammar: only the reasoning rules (with thinking: no stop before `</think>`, the budget).
    Free,
}

/// The most calls a forced tool call with parallel calls may hold.
pub const MAX_PARALLEL_CALLS: usize = 16;

/// How the reply around the grammar goes.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    /// The reply starts inside reasoning: the grammar starts after `</think>`.
    pub thinking: bool,
    /// With thinking: after this many reasoning tokens, `</think>` is forced.
    pub reasoning_budget: Option<usize>,
    /// Ids that end the reply (allowed once the grammar is complete, never during reasoning).
    pub stop_ids: Vec<u32>,
}

/// A grammar, schema or set of tools the client sent that cannot be used: why, in words for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarError {
    /// What is wrong (no parser state, no backtrace).
    pub message: String,
    /// The [`Limits`] field it exceeds, if that is why.
    pub limit: Option<&'static str>,
    /// llguidance failed inside (it panicked): `message` says so in general, this is the detail for the server's
    /// log.
    pub internal: Option<String>,
}

impl GrammarError {
    pub fn new(message: String) -> GrammarError {
        GrammarError { message, limit: None, internal: None }
    }

    /// llguidance's error as a message for the client: a panic becomes a general message (its text and
    /// backtrace kept in `internal`); otherwise the lines of the error without the grammar source it quotes,
    /// joined and cut to 400 characters.
    fn from_llguidance(e: &str) -> GrammarError {
        if e.starts_with("panic:") || e.contains("<backtrace>") {
            return GrammarError {
                message: "the grammar compiler failed on this grammar (an internal error, logged by the server); \
                          try a simpler one"
                    .into(),
                limit: None,
                internal: Some(e.to_owned()),
            };
        }
        let lines = e.lines().map(str::trim).filter(|l| {
            let source = l.split_once(" | ").is_some_and(|(n, _)| n.trim().bytes().all(|b| b.is_ascii_digit()));
            let marker = l.starts_with('<') && l.ends_with("/>"); // `<non-verbose/>`
            !l.is_empty() && !source && !marker && !l.bytes().all(|b| b == b'^' || b == b' ')
        });
        let text = lines.collect::<Vec<_>>().join(" ");
        let message = match text.char_indices().nth(400) {
            Some((i, _)) => format!("{}...", &text[..i]),
            None => text,
        };
        GrammarError { message, limit: None, internal: None }
    }
}

/// A matcher's error while generating (the grammar cannot go on: no token extends it, too many parser items), as
/// a message for the client without llguidance's markers, state or backtrace.
fn runtime_error(e: &str) -> String {
    let e = GrammarError::from_llguidance(e);
    match e.internal {
        Some(_) => "the grammar failed while generating (an internal error of the grammar engine)".into(),
        None if e.message.contains("NoExtensionBias") => {
            "the grammar failed while generating: no token can continue it here".into()
        }
        // llguidance's limits on the work of one mask (lexer fuel and states, Earley items).
        None if ["too many expressions", "too many states", "Too many items", "Current row has"]
            .iter()
            .any(|m| e.message.contains(m)) =>
        {
            format!(
                "the grammar is too expensive to enforce: a token mask needed more work than allowed ({})",
                e.message
            )
        }
        None => format!("the grammar failed while generating: {}", e.message),
    }
}

impl std::fmt::Display for GrammarError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GrammarError {}

/// The compiler of constraints for one tokenizer.
pub struct Grammars {
    factory: ParserFactory,
    /// Ids of the tokenizer (bits of a mask).
    vocab: usize,
    /// The ids of "\n" and "\n\n", with their newline counts: what may follow `</think>` before the grammar.
    newlines: Arc<Vec<(u32, usize)>>,
    limits: Limits,
}

/// A spec checked against the [`Limits`], with its grammar written out: what [`Grammars::build`] compiles.
#[derive(Clone, Debug)]
pub struct Prepared {
    key: String,
    grammar: Option<TopLevelGrammar>,
}

impl Prepared {
    /// Everything the compiled grammar depends on, as text: equal keys compile to the same grammar (for caches).
    /// Empty when there is no grammar.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether there is a grammar to compile (else [`Grammars::build`] is free).
    pub fn has_grammar(&self) -> bool {
        self.grammar.is_some()
    }

    fn lark(text: String) -> Prepared {
        Prepared { key: format!("lark\n{text}"), grammar: Some(TopLevelGrammar::from_lark(text)) }
    }

    fn json(schema: Value) -> Prepared {
        let key = format!("json\n{}", serde_json::to_string(&schema).unwrap_or_default());
        Prepared { key, grammar: Some(TopLevelGrammar::from_json_schema(schema)) }
    }
}

/// A compiled grammar before any token: [`Compiled::fresh`] copies it for another reply.
pub struct Compiled(Option<Matcher>);

impl Compiled {
    /// An independent copy (its own lexer state: replies using copies do not wait on each other).
    pub fn fresh(&self) -> Compiled {
        Compiled(self.0.as_ref().map(Matcher::deep_clone))
    }
}

impl Grammars {
    /// Load `dir/tokenizer.json` into llguidance (about a second for this checkpoint's 248k tokens).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Grammars, GrammarError> {
        let path = dir.as_ref().join("tokenizer.json");
        let bt = toktrie_hf_tokenizers::ByteTokenizer::from_file(&path)
            .map_err(|e| GrammarError::new(format!("{}: {e:#}", path.display())))?;
        let env: TokEnv = bt.into_tok_env(None).map_err(|e| GrammarError::new(format!("{e:#}")))?;
        let env: TokEnv = Arc::new(ForcedPrefix(env));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::new(format!("{e:#}")))?;
        factory.quiet();
        let limits = factory.limits_mut();
        // Errors without the parser's state and the grammar (they go back to the client).
        limits.verbose_errors = false;
        limits.initial_lexer_fuel = INITIAL_LEXER_FUEL;
        let trie = env.tok_trie();
        let vocab = trie.vocab_size();
        let newlines = (0..vocab as u32)
            .filter_map(|id| match trie.token(id) {
                b"\n" => Some((id, 1)),
                b"\n\n" => Some((id, 2)),
                _ => None,
            })
            .collect();
        Ok(Grammars { factory, vocab, newlines: Arc::new(newlines), limits: Limits::default() })
    }

    /// These limits instead of the defaults.
    pub fn with_limits(mut self, limits: Limits) -> Grammars {
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Ids a mask covers (the tokenizer's).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Check `spec` against the limits and write its grammar: cheap (linear in its size, no recursion), on any
    /// thread. Errors are the client's.
    pub fn prepare(&self, spec: Spec) -> Result<Prepared, GrammarError> {
        let l = &self.limits;
        let lark = |text: String, what: &str| -> Result<Prepared, GrammarError> {
            l.check_lark(&text, what)?;
            Ok(Prepared::lark(text))
        };
        match spec {
            Spec::JsonSchema { schema, strict } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::new("the JSON schema must be an object".into()));
                }
                l.check_schema(schema, "the JSON schema", &mut SchemaTally::default())?;
                Ok(Prepared::json(with_options(schema, strict)))
            }
            Spec::JsonObject => Ok(Prepared::json(with_options(&json!({"type": "object"}), true))),
            Spec::Lark(text) | Spec::Gbnf(text) if text.trim().is_empty() => {
                Err(GrammarError::new("the grammar is empty".into()))
            }
            Spec::Lark(text) => lark(text.to_owned(), "the grammar"),
            Spec::Gbnf(text) => {
                if text.len() > l.grammar_bytes {
                    return Err(GrammarError {
                        limit: Some("grammar_bytes"),
                        ..GrammarError::new(format!(
                            "the grammar is {} bytes long; at most {} are accepted (grammar_bytes)",
                            text.len(),
                            l.grammar_bytes
                        ))
                    });
                }
                lark(gbnf::to_lark(text)?, "the GBNF grammar (read as Lark)")
            }
            Spec::ToolCalls { tools, parallel } => {
                let mut tally = SchemaTally::default();
                for t in tools {
                    let f = t.get("function").unwrap_or(t);
                    if let Some(p) = f.get("parameters") {
                        let name = clip(f.get("name").and_then(Value::as_str).unwrap_or_default());
                        l.check_schema(p, &format!("the parameters of tool '{name}'"), &mut tally)?;
                    }
                }
                lark(tool_calls_lark(tools, parallel)?, "the grammar of the forced tool call")
            }
            Spec::Free => Ok(Prepared { key: String::new(), grammar: None }),
        }
    }

    /// Compile a prepared spec with llguidance: milliseconds to (within the limits) a second, recursing along the
    /// grammar's chains: run it on a thread with [`COMPILE_STACK_BYTES`] of stack. A panic in llguidance is an
    /// error (with [`GrammarError::internal`] set).
    pub fn build(&self, p: &Prepared) -> Result<Compiled, GrammarError> {
        let Some(g) = &p.grammar else { return Ok(Compiled(None)) };
        let made = catch_unwind(AssertUnwindSafe(|| {
            let m = Matcher::new(self.factory.create_parser(g.clone()));
            match m.get_error() {
                Some(e) => Err(e),
                None => Ok(m),
            }
        }));
        match made {
            Ok(Ok(m)) => Ok(Compiled(Some(m))),
            Ok(Err(e)) => Err(GrammarError::from_llguidance(&e)),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(GrammarError::from_llguidance(&format!("panic: {what}")))
            }
        }
    }

    /// The constraint of one reply over a compiled grammar (cheap: the reasoning and stop masks).
    pub fn constrained(&self, compiled: Compiled, reply: &Reply) -> Constrained {
        let words = self.vocab.div_ceil(32);
        let bit = |w: &mut [u32], id: u32| {
            if (id as usize) < self.vocab {
                w[id as usize / 32] |= 1 << (id % 32);
            }
        };
        let mut stops = vec![0u32; words];
        for &id in &reply.stop_ids {
            bit(&mut stops, id);
        }
        let reasoning = reply.thinking.then(|| {
            // Every id but those that end the reply or skip the reasoning's end.
            let mut w = vec![u32::MAX; words];
            let clear = |w: &mut [u32], id: u32| {
                if (id as usize) < self.vocab {
                    w[id as usize / 32] &= !(1 << (id % 32));
                }
            };
            for &id in reply.stop_ids.iter().chain(&[TOOL_CALL_ID, TOOL_CALL_END_ID]) {
                clear(&mut w, id);
            }
            if !self.vocab.is_multiple_of(32) {
                w[words - 1] &= (1u32 << (self.vocab % 32)) - 1;
            }
            Arc::new(w)
        });
        Constrained {
            matcher: compiled.0,
            reasoning,
            lead: 0,
            newlines: self.newlines.clone(),
            reasoned: 0,
            budget: reply.reasoning_budget,
            stops: Arc::new(stops),
            vocab: self.vocab,
        }
    }

    /// [`Grammars::prepare`], [`Grammars::build`] on a thread of its own with [`COMPILE_STACK_BYTES`] of stack,
    /// and [`Grammars::constrained`]. Errors are the client's.
    pub fn compile(&self, spec: Spec, reply: &Reply) -> Result<Constrained, GrammarError> {
        let p = self.prepare(spec)?;
        let compiled = if p.has_grammar() {
            std::thread::scope(|s| {
                let t = std::thread::Builder::new()
                    .name("tern-grammar".into())
                    .stack_size(COMPILE_STACK_BYTES)
                    .spawn_scoped(s, || self.build(&p))
                    .map_err(|e| GrammarError::new(format!("cannot start a thread to compile the grammar: {e}")))?;
                t.join().unwrap_or_else(|_| Err(GrammarError::new("the grammar compiler failed".into())))
            })?
        } else {
            Compiled(None)
        };
        Ok(self.constrained(compiled, reply))
    }
}

/// Bytes of a forced run that llguidance tokenizes for one mask (see [`ForcedPrefix`]).
const FORCED_TOKENIZE_BYTES: usize = 4096;

/// The tokenizer llguidance sees, tokenizing at most the first [`FORCED_TOKENIZE_BYTES`] of what it is given.
/// llguidance calls it (here: no prompts are given to it) only for a mask where the grammar forces the next bytes:
/// it tokenizes all of them, and the mask is the first token. A grammar forcing 100k bytes (`/a{100000}/`, a long
/// literal) re-tokenized them for every token's mask (30-40 ms each, past every other limit of a mask; six such
/// requests held a 2-core server's steps a second); the first token of a 4 KiB prefix is the one of the whole run
/// (a token is at most a few hundred bytes long), at under 1 ms a mask.
struct ForcedPrefix(TokEnv);

impl ForcedPrefix {
    /// At most [`FORCED_TOKENIZE_BYTES`] of `s`, not cutting a UTF-8 character.
    fn cut(s: &[u8]) -> &[u8] {
        if s.len() <= FORCED_TOKENIZE_BYTES {
            return s;
        }
        let back = s[..=FORCED_TOKENIZE_BYTES].iter().rev().take(4).take_while(|&&b| b & 0xC0 == 0x80).count();
        &s[..FORCED_TOKENIZE_BYTES - back]
    }
}

impl TokenizerEnv for ForcedPrefix {
    fn tok_trie(&self) -> &TokTrie {
        self.0.tok_trie()
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.0.tokenize_bytes(Self::cut(s))
    }

    fn tokenize_bytes_marker(&self, s: &[u8]) -> (Vec<TokenId>, usize) {
        self.0.tokenize_bytes_marker(Self::cut(s))
    }

    fn tokenize_bytes_special(&self, s: &[u8]) -> Vec<TokenId> {
        self.0.tokenize_bytes_special(Self::cut(s))
    }

    fn eos_token(&self) -> TokenId {
        self.0.eos_token()
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.0.tokenize_is_canonical()
    }
}

/// At most 64 characters of `s` (with "..." when cut): client text quoted in messages.
fn clip(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

/// The JSON schema with llguidance's output options: compact separators with one space (`{"a": 1, "b": 2}`),
/// no other whitespace (a model cannot pad the reply forever), and `strict` deciding whether a keyword it cannot
/// enforce is an error (else it is ignored).
fn with_options(schema: &Value, strict: bool) -> Value {
    let options = json!({"whitespace_flexible": false, "key_separator": ": ", "item_separator": ", ",
                         "lenient": !strict});
    match schema {
        Value::Object(m) => {
            let mut m = m.clone();
            m.insert("x-guidance".into(), options);
            Value::Object(m)
        }
        // `true` (anything) as a schema with options.
        Value::Bool(true) => json!({"x-guidance": options}),
        other => other.clone(),
    }
}

/// One reply's constraint state.
#[derive(Clone)]
pub struct Constrained {
    /// `None`: no grammar (only the reasoning rules).
    matcher: Option<Matcher>,
    /// While the reply is inside reasoning: its mask (`None` once `</think>` is drawn, or without thinking).
    reasoning: Option<Arc<Vec<u32>>>,
    /// Newlines that may still come before the grammar (2 right after `</think>`, else 0), and their ids.
    lead: usize,
    newlines: Arc<Vec<(u32, usize)>>,
    /// Reasoning tokens drawn so far, and the most allowed before `</think>` is forced.
    reasoned: usize,
    budget: Option<usize>,
    /// The stop ids as a mask: what ends the reply once the grammar is complete.
    stops: Arc<Vec<u32>>,
    vocab: usize,
}

impl Constrained {
    /// The mask of the next draw, or `None` once nothing constrains the rest of the reply.
    pub fn mask(&mut self) -> Result<Option<Vec<u32>>, String> {
        if let Some(r) = &self.reasoning {
            if self.budget.is_some_and(|b| self.reasoned >= b) {
                let mut w = vec![0u32; r.len()];
                w[THINK_END_ID as usize / 32] |= 1 << (THINK_END_ID % 32);
                return Ok(Some(w));
            }
            return Ok(Some(r.to_vec()));
        }
        let Some(m) = &mut self.matcher else { return Ok(None) };
        if m.is_stopped() {
            if let Some(e) = m.get_error() {
                return Err(runtime_error(&e));
            }
            return Ok(Some(self.stops.to_vec()));
        }
        let vob = m.compute_mask().map_err(|e| runtime_error(&format!("{e:#}")))?;
        let mut words: Vec<u32> = vob.as_slice().iter().copied().take(self.stops.len()).collect();
        words.resize(self.stops.len(), 0);
        // llguidance's end of sequence (`<|endoftext|>`, and `<|im_end|>` where it counts it) means "complete":
        // the reply's own stop ids end it.
        let eos = m.tok_env().map(|e| e.tok_trie().eos_tokens().to_vec()).unwrap_or_default();
        let complete = eos.iter().chain(&[IM_END_ID]).any(|&t| vob.is_allowed(t));
        for &t in eos.iter().chain(&[IM_END_ID]) {
            if (t as usize) < self.vocab {
                words[t as usize / 32] &= !(1 << (t % 32));
            }
        }
        if complete {
            for (w, s) in words.iter_mut().zip(self.stops.iter()) {
                *w |= s;
            }
        }
        for &(id, n) in self.newlines.iter() {
            if n <= self.lead {
                words[id as usize / 32] |= 1 << (id % 32);
            }
        }
        if words.iter().all(|&w| w == 0) {
            return Err("the grammar failed while generating: it allows no token here".into());
        }
        Ok(Some(words))
    }

    /// Advance past `token`, drawn under the last mask.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.reasoning.is_some() {
            if token == THINK_END_ID {
                self.reasoning = None;
                self.lead = 2;
            } else {
                self.reasoned += 1;
            }
            return Ok(());
        }
        if self.lead > 0 {
            if let Some(&(_, n)) = self.newlines.iter().find(|(id, n)| *id == token && *n <= self.lead) {
                self.lead -= n;
                return Ok(());
            }
            self.lead = 0;
        }
        match &mut self.matcher {
            Some(m) if !m.is_stopped() => m.consume_token(token).map_err(|e| runtime_error(&format!("{e:#}"))),
            _ => Ok(()),
        }
    }

    /// Whether the grammar is complete (the reply may end here).
    pub fn is_complete(&mut self) -> bool {
        match &mut self.matcher {
            None => self.reasoning.is_none(),
            Some(m) => m.is_stopped() || m.is_accepting().unwrap_or(false),
        }
    }
}

/// A string as a Lark literal (JSON string syntax; llguidance also refuses a raw DEL).
fn lark_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The Lark grammar of forced tool calls in the checkpoint's XML format.
fn tool_calls_lark(tools: &[Value], parallel: bool) -> Result<String, GrammarError> {
    if tools.is_empty() {
        return Err(GrammarError::new("a forced tool call needs at least one tool".into()));
    }
    let mut g = String::new();
    if parallel {
        g += &format!("start: call (\"\\n\" call){{0,{}}}\n", MAX_PARALLEL_CALLS - 1);
    } else {
        g += "start: call\n";
    }
    let fns: Vec<String> = (0..tools.len()).map(|i| format!("fn_{i}")).collect();
    g += &format!("call: <tool_call> \"\\n\" ({}) \"</function>\\n\" </tool_call>\n", fns.join(" | "));
    for (i, tool) in tools.iter().enumerate() {
        let f = tool.get("function").unwrap_or(tool);
        let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let name = name.ok_or_else(|| GrammarError::new(format!("tool {i} has no name")))?;
        if name.contains(['>', '\n']) {
            return Err(GrammarError::new(format!("the tool name {:?} cannot be written in a tool call", clip(name))));
        }
        let strict = f.get("strict").and_then(Value::as_bool).unwrap_or(false);
        let empty = Map::new();
        let params = f.get("parameters").and_then(Value::as_object).unwrap_or(&empty);
        let props = params.get("properties").and_then(Value::as_object).unwrap_or(&empty);
        let required: Vec<&str> = params
            .get("required")
            .and_then(Value::as_array)
            .map_or(vec![], |r| r.iter().filter_map(Value::as_str).collect());
        let mut body = vec![lark_str(&format!("<function={name}>\n"))];
        for (k, (key, schema)) in props.iter().enumerate() {
            if key.contains(['>', '\n']) || key.is_empty() {
                return Err(GrammarError::new(format!(
                    "the parameter name {:?} of '{}' cannot be written",
                    clip(key),
                    clip(name)
                )));
            }
            let rule = format!("p_{i}_{k}");
            body.push(if required.contains(&key.as_str()) { rule.clone() } else { format!("{rule}?") });
            let head = lark_str(&format!("<parameter={key}>\n"));
            let value = param_value(&mut g, &format!("{i}_{k}"), &with_defs(schema, params), strict);
            g += &format!("{rule}: {head} {value}\n");
        }
        for r in &required {
            if !props.contains_key(*r) {
                return Err(GrammarError::new(format!(
                    "'{}' requires '{}', which its 'properties' does not define",
                    clip(name),
                    clip(r)
                )));
            }
        }
        g += &format!("fn_{i}: {}\n", body.join(" "));
    }
    Ok(g)
}

/// A parameter's schema with the definitions of the tool's parameters (`$defs`, `definitions`) it does not have
/// itself: its `$ref`s point into the whole parameters schema (`#/$defs/...`, as pydantic writes them), but it is
/// compiled on its own.
fn with_defs(schema: &Value, params: &Map<String, Value>) -> Value {
    let mut schema = schema.clone();
    let refers = || schema.to_string().contains("\"$ref\"");
    if !params.contains_key("$defs") && !params.contains_key("definitions") || !refers() {
        return schema;
    }
    if let Value::Object(m) = &mut schema {
        for key in ["$defs", "definitions"] {
            if let (Some(defs), false) = (params.get(key), m.contains_key(key)) {
                m.insert(key.into(), defs.clone());
            }
        }
    }
    schema
}

/// The grammar of one parameter's value with the line closing it, as the parser reads it back (see
/// [`crate::parser`]): a string-typed parameter is raw text that cannot hold the tags ending a value, any other is
/// JSON under its schema. Rules it needs are appended to `g`.
fn param_value(g: &mut String, id: &str, schema: &Value, strict: bool) -> String {
    let close = lark_str("\n</parameter>\n");
    if param_type(Some(schema)) == Some("string") {
        let strings = |key: &str| {
            schema.get(key).and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>())
        };
        let choices = strings("enum").or_else(|| schema.get("const").and_then(Value::as_str).map(|c| vec![c]));
        if let Some(choices) = choices.filter(|c| !c.is_empty()) {
            let alts: Vec<String> = choices.iter().map(|c| lark_str(c)).collect();
            return format!("({}) {close}", alts.join(" | "));
        }
        let n = |key: &str| schema.get(key).and_then(Value::as_u64);
        let (min, max) = (n("minLength").unwrap_or(0), n("maxLength"));
        let len = match max {
            Some(max) => format!("{{{min},{max}}}"),
            None => format!("{{{min},}}"),
        };
        let text = match schema.get("pattern").and_then(Value::as_str) {
            // A pattern is searched for in JSON Schema; here the whole value must match it.
            Some(p) => {
                let p = llguidance::regex_to_lark(p.trim_start_matches('^').trim_end_matches('$'), "dw");
                format!("/(?:{p})/ & /(?s:.){len}/")
            }
            None => format!("/(?s:.){len}/"),
        };
        *g += &format!("VAL_{id}: {text} & ~/(?s:.*)(<\\/parameter>|<parameter=|<\\/function>)(?s:.*)/\n");
        *g += &format!("val_{id}[suffix={close}]: VAL_{id}\n");
        return format!("val_{id}");
    }
    let schema = with_options(schema, strict);
    format!("%json {schema} {close}")
}

#[cfg(test)]
mod tests {
    use llguidance::toktrie::ApproximateTokEnv;

    use super::*;

    #[test]
    fn forced_runs_are_tokenized_up_to_the_cap_on_a_character_boundary() {
        // One token per byte: the tokens are the bytes tokenized.
        let env = ForcedPrefix(ApproximateTokEnv::single_byte_env());
        assert_eq!(env.tokenize_bytes(&[b'a'; 100_000]).len(), FORCED_TOKENIZE_BYTES);
        assert_eq!(env.tokenize_bytes_marker(&[b'a'; 100_000]).0.len(), FORCED_TOKENIZE_BYTES);
        assert_eq!(env.tokenize_bytes(b"short"), env.0.tokenize_bytes(b"short"));
        // Three-byte characters: 4096 = 3 * 1365 + 1, so the cap falls inside the 1366th; it is left out whole.
        let euros = "\u{20ac}".repeat(30_000);
        let cut = ForcedPrefix::cut(euros.as_bytes());
        assert_eq!(cut.len(), 3 * 1365);
        assert!(std::str::from_utf8(cut).is_ok());
    }
}
