//! Bounds on a client's grammar or schema, checked before llguidance sees it, in time linear in its size and
//! without recursion (the checks run on any thread; what they bound is what llguidance's compile recurses and
//! spends time on).
//!
//! Measured on this checkpoint's tokenizer (llguidance 1.9.1, optimised): a Lark chain of N rules takes about
//! 3 KiB of stack per rule while compiling (800 rules overflowed a 2 MiB thread), a `$ref` chain whose
//! definitions are objects about 20 KiB per link (300 overflowed 2 MiB); 10k alternatives compile in ~0.1 s but
//! 50k in 4 s and 100k in 22 s (then llguidance panics on its symbol table); a sequence of 20k literals costs
//! 0.1 s a mask. In a JSON schema, an object's optional properties cost quadratic time (1000: 0.08 s, 3000: 0.9 s,
//! 6000: 3.6 s) and its `patternProperties` cubic (100: 0.06 s, 200: 0.5 s, 400: 13 s). llguidance cannot stop a
//! compile once begun (its cancellation covers masks, not compiles; its fuel and size limits bound size, not these
//! times): these limits are what keeps every compile within the server's budget. With the defaults the slowest
//! compiles found take about 1.2 s (nine objects of 1000 optional properties) and their stack well under
//! [`super::COMPILE_STACK_BYTES`].

use std::collections::HashSet;

use serde_json::Value;

use super::GrammarError;

/// What a grammar, JSON schema or set of tools may hold. A request over one gets a [`GrammarError`] naming it.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Bytes of grammar text (Lark or GBNF, or the Lark of forced tool calls).
    pub grammar_bytes: usize,
    /// Rules of a grammar (each `name:` of a Lark grammar, `name ::=` of a GBNF one).
    pub rules: usize,
    /// Alternatives (`|`) in a grammar, in all.
    pub alternatives: usize,
    /// Items of a grammar in all: literals, regexes, names, special tokens, embedded JSON schemas.
    pub symbols: usize,
    /// Bytes inside a grammar's literals and regexes, in all.
    pub literal_bytes: usize,
    /// Nesting of a JSON schema document (objects and arrays within each other).
    pub schema_depth: usize,
    /// JSON values in a schema (or the tools' parameters), in all.
    pub schema_nodes: usize,
    /// What `$ref`s may inline: the nesting of the schema plus that of every definition a `$ref` points to (the
    /// deepest chain a compile can follow, whatever the order it takes them in).
    pub ref_depth: usize,
    /// Values of `enum` lists in a schema (or the tools' parameters), in all.
    pub enum_values: usize,
    /// Properties of one object (its `properties`): llguidance's compile is quadratic in them.
    pub object_properties: usize,
    /// `patternProperties` entries of a schema (or the tools' parameters), in all: llguidance's compile checks
    /// that those of an object are disjoint, cubic in their number.
    pub pattern_properties: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            grammar_bytes: 512 << 10,
            rules: 5_000,
            alternatives: 10_000,
            symbols: 20_000,
            literal_bytes: 64 << 10,
            schema_depth: 64,
            schema_nodes: 20_000,
            ref_depth: 4_000,
            enum_values: 5_000,
            object_properties: 1_000,
            pattern_properties: 100,
        }
    }
}

fn over(limit: &'static str, message: String) -> GrammarError {
    GrammarError { message, limit: Some(limit), internal: None }
}

/// Counts over the schemas of one request (several tools' parameters share the node and enum budgets).
#[derive(Default)]
pub(crate) struct SchemaTally {
    nodes: usize,
    enum_values: usize,
    pattern_properties: usize,
}

impl Limits {
    /// Check one JSON schema document (`what` names it in errors, e.g. "the JSON schema").
    pub(crate) fn check_schema(&self, root: &Value, what: &str, tally: &mut SchemaTally) -> Result<(), GrammarError> {
        let mut refs: HashSet<&str> = HashSet::new();
        let mut stack: Vec<(&Value, usize)> = vec![(root, 1)];
        let mut depth = 0;
        while let Some((v, d)) = stack.pop() {
            tally.nodes += 1;
            if tally.nodes > self.schema_nodes {
                return Err(over(
                    "schema_nodes",
                    format!("{what}: more than {} JSON values (schema_nodes)", self.schema_nodes),
                ));
            }
            depth = depth.max(d);
            if d > self.schema_depth {
                return Err(over(
                    "schema_depth",
                    format!("{what}: nested more than {} levels deep (schema_depth)", self.schema_depth),
                ));
            }
            match v {
                Value::Object(m) => {
                    if let Some(Value::Array(e)) = m.get("enum") {
                        tally.enum_values += e.len();
                        if tally.enum_values > self.enum_values {
                            return Err(over(
                                "enum_values",
                                format!(
                                    "{what}: more than {} enum values in all (enum_values); an enum of {} values \
                                     is one of them",
                                    self.enum_values,
                                    e.len()
                                ),
                            ));
                        }
                    }
                    if let Some(Value::Object(p)) = m.get("properties") {
                        if p.len() > self.object_properties {
                            return Err(over(
                                "object_properties",
                                format!(
                                    "{what}: an object with {} properties; at most {} are accepted in one object \
                                     (object_properties)",
                                    p.len(),
                                    self.object_properties
                                ),
                            ));
                        }
                    }
                    if let Some(Value::Object(p)) = m.get("patternProperties") {
                        tally.pattern_properties += p.len();
                        if tally.pattern_properties > self.pattern_properties {
                            return Err(over(
                                "pattern_properties",
                                format!(
                                    "{what}: more than {} patternProperties in all (pattern_properties)",
                                    self.pattern_properties
                                ),
                            ));
                        }
                    }
                    if let Some(Value::String(r)) = m.get("$ref") {
                        refs.insert(r);
                    }
                    stack.extend(m.values().map(|c| (c, d + 1)));
                }
                Value::Array(a) => stack.extend(a.iter().map(|c| (c, d + 1))),
                _ => {}
            }
        }
        // A compile inlines what a `$ref` points to where the `$ref` is; a chain of them nests each definition
        // in the one before. Whatever order it follows them in, no chain visits a definition twice (the compiler
        // reuses what it has compiled): the document's depth plus the depths of all definitions pointed to
        // bounds every chain.
        let mut inlined = depth;
        for r in refs {
            let Some(target) = local_ref(root, r) else { continue };
            inlined += max_depth(target);
            if inlined > self.ref_depth {
                return Err(over(
                    "ref_depth",
                    format!(
                        "{what}: its `$ref`s point to definitions nested more than {} levels deep in all \
                         (ref_depth: the schema's depth plus that of each definition a `$ref` names)",
                        self.ref_depth
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Check a Lark grammar (llguidance's dialect), its `%json` schemas included.
    pub(crate) fn check_lark(&self, text: &str, what: &str) -> Result<(), GrammarError> {
        if text.len() > self.grammar_bytes {
            return Err(over(
                "grammar_bytes",
                format!(
                    "{what} is {} bytes long; at most {} are accepted (grammar_bytes)",
                    text.len(),
                    self.grammar_bytes
                ),
            ));
        }
        let b = text.as_bytes();
        let (mut rules, mut alternatives, mut symbols, mut literal_bytes) = (0usize, 0usize, 0usize, 0usize);
        let mut tally = SchemaTally::default();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'"' => {
                    let end = literal_end(b, i, b'"');
                    literal_bytes += end - i;
                    symbols += 1;
                    i = end;
                }
                b'/' if b.get(i + 1) == Some(&b'/') => i = line_end(b, i),
                b'/' => {
                    let end = literal_end(b, i, b'/');
                    literal_bytes += end - i;
                    symbols += 1;
                    i = end;
                }
                b'#' => i = line_end(b, i),
                b'<' => {
                    // A special token (`<|im_end|>`, `<[123]>`): its `|` are not alternatives.
                    let close = b[i..].iter().take(256).position(|&c| c == b'>' || c == b'\n');
                    i = match close {
                        Some(n) if b[i + n] == b'>' => i + n + 1,
                        _ => i + 1,
                    };
                    symbols += 1;
                }
                b'%' => {
                    let word_end = i + 1 + b[i + 1..].iter().take_while(|c| c.is_ascii_alphanumeric()).count();
                    let directive = &text[i + 1..word_end];
                    let brace = word_end + b[word_end..].iter().take_while(|c| c.is_ascii_whitespace()).count();
                    i = word_end;
                    if b.get(brace) == Some(&b'{') {
                        // A JSON argument (`%json {...}`, `%regex {...}`, `%llguidance {...}`).
                        let mut values = serde_json::Deserializer::from_str(&text[brace..]).into_iter::<Value>();
                        let v = match values.next() {
                            Some(Ok(v)) => v,
                            Some(Err(e)) => {
                                return Err(GrammarError::new(format!(
                                    "{what}: the JSON after %{directive} is not valid: {e}"
                                )))
                            }
                            None => return Err(GrammarError::new(format!("{what}: %{directive} needs a JSON value"))),
                        };
                        i = brace + values.byte_offset();
                        if directive == "json" {
                            self.check_schema(&v, &format!("a %json schema in {what}"), &mut tally)?;
                        }
                        symbols += 1;
                    }
                }
                b'|' => {
                    alternatives += 1;
                    i += 1;
                }
                b':' => {
                    rules += 1;
                    i += 1;
                }
                c if c.is_ascii_alphabetic() || c == b'_' => {
                    i += b[i..]
                        .iter()
                        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
                        .count();
                    symbols += 1;
                }
                _ => i += 1,
            }
        }
        let counts = [
            ("rules", rules, self.rules, "rules"),
            ("alternatives", alternatives, self.alternatives, "alternatives ('|')"),
            ("symbols", symbols, self.symbols, "items (literals, regexes, names)"),
            ("literal_bytes", literal_bytes, self.literal_bytes, "bytes of literals and regexes"),
        ];
        for (limit, n, max, what_items) in counts {
            if n > max {
                return Err(over(limit, format!("{what} has {n} {what_items}; at most {max} are accepted ({limit})")));
            }
        }
        Ok(())
    }
}

/// Where the literal or regex opening at `i` (delimited by `quote`, with backslash escapes) ends: after its
/// closing quote (and flags), or at the end of the line if it has none.
fn literal_end(b: &[u8], i: usize, quote: u8) -> usize {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'\n' => return j,
            c if c == quote => {
                j += 1;
                return j + b[j..].iter().take_while(|c| c.is_ascii_alphabetic()).count();
            }
            _ => j += 1,
        }
    }
    b.len()
}

fn line_end(b: &[u8], i: usize) -> usize {
    b[i..].iter().position(|&c| c == b'\n').map_or(b.len(), |n| i + n)
}

/// The value a local `$ref` (`#`, `#/json/pointer`) points to in `root`.
fn local_ref<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    root.pointer(pointer)
}

/// The nesting of `v` (1 for a scalar), without recursion.
fn max_depth(v: &Value) -> usize {
    let mut stack = vec![(v, 1)];
    let mut depth = 0;
    while let Some((v, d)) = stack.pop() {
        depth = depth.max(d);
        match v {
            Value::Object(m) => stack.extend(m.values().map(|c| (c, d + 1))),
            Value::Array(a) => stack.extend(a.iter().map(|c| (c, d + 1))),
            _ => {}
        }
    }
    depth
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let next = json!({"$ref": format!("#/$defs/d{}", i + 1)});
            let v = if i + 1 < n {
                json!({"type": "object", "properties": {"next": next}, "required": ["next"]})
            } else {
                json!({"type": "string"})
            };
            defs.insert(format!("d{i}"), v);
        }
        json!({"$ref": "#/$defs/d0", "$defs": defs})
    }

    fn nested(n: usize) -> Value {
        let mut s = json!({"type": "string"});
        for _ in 0..n {
            s = json!({"type": "object", "properties": {"a": s}});
        }
        s
    }

    fn limit_of(r: Result<(), GrammarError>) -> Option<&'static str> {
        r.err().and_then(|e| e.limit)
    }

    #[test]
    fn schema_limits() {
        let l = Limits::default();
        let check = |v: &Value| l.check_schema(v, "the schema", &mut SchemaTally::default());
        assert!(check(&ref_chain(300)).is_ok(), "a 300-link $ref chain is within the limits");
        assert_eq!(limit_of(check(&ref_chain(1200))), Some("ref_depth"));
        // Nesting counts objects and arrays: two levels per `properties` step.
        assert!(check(&nested(30)).is_ok());
        assert_eq!(limit_of(check(&nested(40))), Some("schema_depth"));
        let e: Vec<Value> = (0..100_000).map(|i| json!(format!("v{i}"))).collect();
        let big_enum = json!({"type": "object", "properties": {"a": {"enum": e}}});
        assert_eq!(limit_of(check(&big_enum)), Some("enum_values"));
        let props: serde_json::Map<String, Value> = (0..1000).map(|i| (format!("p{i}"), json!({}))).collect();
        assert!(check(&json!({"properties": {"a": {"properties": props}}})).is_ok());
        let many: Vec<Value> = (0..30).map(|_| json!({"properties": props})).collect();
        assert_eq!(limit_of(check(&json!({"anyOf": many}))), Some("schema_nodes"));
        let props: serde_json::Map<String, Value> = (0..1001).map(|i| (format!("p{i}"), json!({}))).collect();
        assert_eq!(limit_of(check(&json!({"properties": props}))), Some("object_properties"));
        let pats = |n: usize| -> Value {
            let p: serde_json::Map<String, Value> = (0..n).map(|i| (format!("^x{i}"), json!({}))).collect();
            json!({"type": "object", "patternProperties": p})
        };
        assert!(check(&pats(100)).is_ok());
        assert_eq!(limit_of(check(&pats(101))), Some("pattern_properties"));
        assert_eq!(limit_of(check(&json!({"anyOf": [pats(60), pats(60)]}))), Some("pattern_properties"));
        // Budgets are shared by the schemas of one request.
        let e: Vec<Value> = (0..3000).map(|i| json!(i)).collect();
        let half = json!({"enum": e});
        let mut tally = SchemaTally::default();
        assert!(l.check_schema(&half, "a", &mut tally).is_ok());
        assert_eq!(limit_of(l.check_schema(&half, "b", &mut tally)), Some("enum_values"));
        // A `$ref` to the root (recursion) counts once; unresolvable ones are llguidance's to judge.
        assert!(check(&json!({"type": "array", "items": {"$ref": "#"}})).is_ok());
        assert!(check(&json!({"$ref": "https://example.com/x.json"})).is_ok());
    }

    #[test]
    fn a_deep_document_is_checked_without_recursion() {
        // Deeper than any request body can hold (serde_json stops at 128), built by hand: the check must not
        // recurse over it (a 2 MiB test thread would overflow long before 100k levels).
        let mut v = json!(1);
        for _ in 0..100_000 {
            v = Value::Array(vec![v]);
        }
        let l = Limits { schema_depth: usize::MAX, schema_nodes: usize::MAX, ..Limits::default() };
        let r = l.check_schema(&v, "x", &mut SchemaTally::default());
        assert!(r.is_ok());
        assert_eq!(max_depth(&v), 100_001);
        // Dropping it would recurse: leak it instead (a test-only value).
        std::mem::forget(v);
    }

    #[test]
    fn lark_limits() {
        let l = Limits::default();
        let check = |t: &str| l.check_lark(t, "the grammar");
        let mut chain = String::from("start: r0\n");
        for i in 0..800 {
            chain += &format!("r{i}: \"a\" r{}\n", i + 1);
        }
        chain += "r800: \"b\"\n";
        assert!(check(&chain).is_ok(), "an 800-rule chain is within the limits");
        let mut chain = String::new();
        for i in 0..6000 {
            chain += &format!("r{i}: r{}\n", i + 1);
        }
        assert_eq!(limit_of(check(&chain)), Some("rules"));
        let alts: Vec<String> = (0..100_000).map(|i| format!("\"w{i}\"")).collect();
        assert_eq!(limit_of(check(&format!("start: {}\n", alts.join(" | ")))), Some("grammar_bytes"));
        assert_eq!(limit_of(check(&format!("start: {}\n", alts[..20_000].join("|")))), Some("alternatives"));
        let seq: Vec<String> = (0..30_000).map(|i| format!("\"w{i}\"")).collect();
        assert_eq!(limit_of(check(&format!("start: {}\n", seq.join(" ")))), Some("symbols"));
        assert_eq!(limit_of(check(&format!("start: \"{}\"\n", "a".repeat(100_000)))), Some("literal_bytes"));
        assert_eq!(limit_of(check(&format!("start: \"a\"\n// {}\n", "x".repeat(600_000)))), Some("grammar_bytes"));
        // `|` inside literals, regexes, special tokens and comments are not alternatives.
        let pipes = format!("start: \"{}\" /a|b/ <|im_end|> // |\n# |\n", "|".repeat(20_000));
        assert!(check(&pipes).is_ok());
        // Embedded schemas are checked as schemas.
        let e: Vec<Value> = (0..10_000).map(|i| json!(i)).collect();
        let g = format!("start: %json {}\n", json!({"enum": e}));
        assert_eq!(limit_of(check(&g)), Some("enum_values"));
        let g = format!("start: %json {}\n", ref_chain(1200));
        assert_eq!(limit_of(check(&g)), Some("ref_depth"));
        let bad = check("start: %json {\"type\": ").unwrap_err();
        assert!(bad.limit.is_none() && bad.message.contains("%json"), "{bad}");
    }
}
