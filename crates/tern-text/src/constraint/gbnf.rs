//! llama.cpp's GBNF grammars (`root ::= "yes" | "no"`), read into llguidance's Lark.
//!
//! GBNF: rules `name ::= alternatives`, one per line (a rule goes on over newlines inside parentheses, and after
//! `::=` or `|`); literals `"..."` and character classes `[a-z]`, `[^"\\]` with the escapes `\n \r \t \\ \" \[ \]
//! \xHH \uHHHH \UHHHHHHHH`; `.` for any character; groups `( )`; repetitions `* + ? {m} {m,} {m,n}`; `#`
//! comments; special tokens `<...>` as llama.cpp writes them. `root` is where the reply starts. A rule defined
//! twice keeps its last definition, as in llama.cpp. The parse is recursive only over parentheses, whose nesting
//! is bounded.
//!
//! Every GBNF rule becomes a Lark rule (no lexer terminals: GBNF has no lexer, so none of its rules may match
//! greedily where the grammar would go on otherwise); literals become Lark literals and classes one-character
//! regexes written with `\x{...}` escapes.

use std::collections::HashMap;

use super::{clip, lark_str, GrammarError};

/// Deepest nesting of parentheses accepted (llguidance refuses Lark nested 30 deep).
const MAX_NESTING: usize = 25;

/// Whether `text` reads as GBNF: its first line that is not blank or a comment defines a rule with `::=`.
pub(crate) fn is_gbnf(text: &str) -> bool {
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') || t.starts_with("//") {
            continue;
        }
        let name = t.bytes().take_while(|&c| is_name_char(c)).count();
        return name > 0 && t[name..].trim_start().starts_with("::=");
    }
    false
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'-' || c == b'_'
}

/// The Lark grammar of a GBNF one, or what is wrong with it (with its line).
pub(crate) fn to_lark(text: &str) -> Result<String, GrammarError> {
    let mut p = Parser { s: text, i: 0, depth: 0, names: HashMap::new(), used: Vec::new() };
    let mut rules: Vec<(String, String)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    p.space(true);
    while !p.eof() {
        let name = p.name().ok_or_else(|| p.error("expected a rule name"))?;
        p.space(false);
        if !p.rest().starts_with("::=") {
            return Err(p.error(&format!("expected '::=' after the rule name '{}'", clip(name))));
        }
        p.i += 3;
        p.space(true);
        let body = p.alternatives(false)?;
        p.space(false);
        if !p.eof() && !matches!(p.peek(), Some(b'\n' | b'\r')) {
            return Err(p.error("expected the end of the rule's line"));
        }
        p.space(true);
        let lark = p.lark_name(name);
        match index.get(name) {
            Some(&k) => rules[k].1 = body,
            None => {
                index.insert(name.to_owned(), rules.len());
                rules.push((lark, body));
            }
        }
    }
    if !index.contains_key("root") {
        return Err(GrammarError::new("the GBNF grammar has no 'root' rule (where the reply starts)".into()));
    }
    if let Some(missing) = p.used.iter().find(|n| !index.contains_key(n.as_str())) {
        return Err(GrammarError::new(format!("the GBNF grammar uses '{}' but does not define it", clip(missing))));
    }
    let mut out = format!("start: {}\n", p.lark_name("root"));
    for (name, body) in rules {
        out += &format!("{name}: {body}\n");
    }
    Ok(out)
}

struct Parser<'a> {
    s: &'a str,
    i: usize,
    /// Parentheses open around the current position.
    depth: usize,
    /// GBNF name -> Lark name (lowercase, unique).
    names: HashMap<String, String>,
    /// Names referred to, to check that each is defined.
    used: Vec<String>,
}

impl<'a> Parser<'a> {
    fn eof(&self) -> bool {
        self.i >= self.s.len()
    }

    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.i).copied()
    }

    fn rest(&self) -> &'a str {
        &self.s[self.i..]
    }

    fn error(&self, what: &str) -> GrammarError {
        let line = self.s[..self.i].bytes().filter(|&c| c == b'\n').count() + 1;
        let at: String = self.rest().chars().take(20).collect();
        GrammarError::new(format!("GBNF grammar, line {line}: {what} (at {at:?})"))
    }

    /// Skip spaces, tabs and `#` comments, and newlines when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.i += 1,
                b'\r' | b'\n' if newlines => self.i += 1,
                b'#' => self.i += self.rest().find('\n').unwrap_or(self.rest().len()),
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<&'a str> {
        let n = self.rest().bytes().take_while(|&c| is_name_char(c)).count();
        let name = &self.s[self.i..self.i + n];
        self.i += n;
        (n > 0).then_some(name)
    }

    /// The Lark name of a GBNF rule: lowercase (Lark's uppercase names are lexer terminals), prefixed so that
    /// it cannot clash with `start`, made unique.
    fn lark_name(&mut self, name: &str) -> String {
        if let Some(n) = self.names.get(name) {
            return n.clone();
        }
        let base = format!("g_{}", name.to_ascii_lowercase().replace('-', "_"));
        let mut lark = base.clone();
        let mut k = 1;
        while self.names.values().any(|v| *v == lark) {
            lark = format!("{base}_{k}");
            k += 1;
        }
        self.names.insert(name.to_owned(), lark.clone());
        lark
    }

    /// `seq | seq | ...`; at the top level a line starting with `|` goes on with the rule.
    fn alternatives(&mut self, nested: bool) -> Result<String, GrammarError> {
        let mut alts = vec![self.sequence(nested)?];
        loop {
            let back = self.i;
            self.space(true);
            if self.peek() == Some(b'|') {
                self.i += 1;
                self.space(true);
                alts.push(self.sequence(nested)?);
            } else {
                self.i = back;
                return Ok(alts.join(" | "));
            }
        }
    }

    fn sequence(&mut self, nested: bool) -> Result<String, GrammarError> {
        let mut items: Vec<String> = Vec::new();
        loop {
            self.space(nested);
            let item = match self.peek() {
                Some(b'"') => self.literal()?,
                Some(b'[') => self.class()?,
                Some(b'.') => {
                    self.i += 1;
                    "/(?s:.)/".to_owned()
                }
                Some(b'(') => {
                    if self.depth >= MAX_NESTING {
                        return Err(self.error(&format!("parentheses nested more than {MAX_NESTING} deep")));
                    }
                    self.i += 1;
                    self.depth += 1;
                    self.space(true);
                    let inner = self.alternatives(true)?;
                    self.space(true);
                    if self.peek() != Some(b')') {
                        return Err(self.error("expected ')'"));
                    }
                    self.i += 1;
                    self.depth -= 1;
                    format!("({inner})")
                }
                Some(b'<') => {
                    let n = self.rest().find(['>', '\n']).filter(|&n| self.rest().as_bytes()[n] == b'>');
                    let n = n.ok_or_else(|| self.error("a special token '<...>' is not closed on its line"))?;
                    let token = self.rest()[..=n].to_owned();
                    self.i += n + 1;
                    token
                }
                Some(c) if is_name_char(c) => {
                    let Some(name) = self.name() else { break };
                    self.used.push(name.to_owned());
                    self.lark_name(name)
                }
                _ => break,
            };
            self.space(nested);
            let rep = self.repetition()?;
            items.push(item + &rep);
        }
        Ok(if items.is_empty() { "\"\"".to_owned() } else { items.join(" ") })
    }

    fn repetition(&mut self) -> Result<String, GrammarError> {
        match self.peek() {
            Some(c @ (b'*' | b'+' | b'?')) => {
                self.i += 1;
                Ok((c as char).to_string())
            }
            Some(b'{') => {
                self.i += 1;
                self.space(true);
                let min = self.number()?;
                self.space(true);
                let max = if self.peek() == Some(b',') {
                    self.i += 1;
                    self.space(true);
                    if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                        Some(Some(self.number()?))
                    } else {
                        Some(None)
                    }
                } else {
                    None
                };
                self.space(true);
                if self.peek() != Some(b'}') {
                    return Err(self.error("expected '}' closing a repetition"));
                }
                self.i += 1;
                match max {
                    None => Ok(format!("{{{min}}}")),
                    Some(None) => Ok(format!("{{{min},}}")),
                    Some(Some(max)) if max < min => Err(self.error(&format!("repetition {{{min},{max}}} is empty"))),
                    Some(Some(max)) => Ok(format!("{{{min},{max}}}")),
                }
            }
            _ => Ok(String::new()),
        }
    }

    fn number(&mut self) -> Result<u32, GrammarError> {
        let n = self.rest().bytes().take_while(u8::is_ascii_digit).count();
        let v = self.rest()[..n].parse().map_err(|_| self.error("expected a repetition count (up to 4294967295)"))?;
        self.i += n;
        Ok(v)
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<char, GrammarError> {
        let c = self.rest().chars().next().ok_or_else(|| self.error("unexpected end of the grammar"))?;
        self.i += c.len_utf8();
        if c != '\\' {
            return Ok(c);
        }
        let e = self.rest().chars().next().ok_or_else(|| self.error("unexpected end after '\\'"))?;
        self.i += e.len_utf8();
        let hex = |p: &mut Self, n: usize| -> Result<char, GrammarError> {
            let digits = p.rest().get(..n).filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()));
            let code = digits.and_then(|d| u32::from_str_radix(d, 16).ok()).and_then(char::from_u32);
            let c = code.ok_or_else(|| p.error(&format!("'\\{e}' needs {n} hex digits of a character")))?;
            p.i += n;
            Ok(c)
        };
        match e {
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            c if c.is_ascii_alphanumeric() => Err(self.error(&format!("unknown escape '\\{c}'"))),
            c => Ok(c),
        }
    }

    fn literal(&mut self) -> Result<String, GrammarError> {
        self.i += 1;
        let mut text = String::new();
        loop {
            if matches!(self.peek(), None | Some(b'\n')) {
                return Err(self.error("a literal is not closed on its line"));
            }
            if self.peek() == Some(b'"') {
                self.i += 1;
                return Ok(lark_str(&text));
            }
            text.push(self.char()?);
        }
    }

    fn class(&mut self) -> Result<String, GrammarError> {
        self.i += 1;
        let negated = self.peek() == Some(b'^');
        if negated {
            self.i += 1;
        }
        let mut rx = String::new();
        loop {
            match self.peek() {
                None | Some(b'\n') => return Err(self.error("a character class is not closed on its line")),
                Some(b']') => {
                    self.i += 1;
                    break;
                }
                _ => {}
            }
            let lo = self.char()?;
            rx += &class_char(lo);
            if self.peek() == Some(b'-') && self.rest().as_bytes().get(1).is_some_and(|&c| c != b']') {
                self.i += 1;
                let hi = self.char()?;
                if hi < lo {
                    return Err(self.error(&format!("the class range {lo:?}-{hi:?} is reversed")));
                }
                rx += "-";
                rx += &class_char(hi);
            }
        }
        Ok(match (rx.is_empty(), negated) {
            (true, true) => "/(?s:.)/".to_owned(),
            (true, false) => return Err(self.error("an empty character class '[]' matches nothing")),
            (false, true) => format!("/[^{rx}]/"),
            (false, false) => format!("/[{rx}]/"),
        })
    }
}

/// A character inside a regex class: letters and digits as they are, anything else escaped by its code.
fn class_char(c: char) -> String {
    if c.is_ascii_alphanumeric() {
        c.to_string()
    } else {
        format!("\\x{{{:X}}}", c as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_gbnf() {
        assert!(is_gbnf("root ::= \"yes\" | \"no\""));
        assert!(is_gbnf("# a comment\n\n  json-value ::= x\nx ::= \"1\""));
        assert!(!is_gbnf("start: \"yes\" | \"no\""));
        assert!(!is_gbnf("%llguidance {}\nstart: a ::= b"));
        assert!(!is_gbnf(""));
    }

    #[test]
    fn converts() {
        assert_eq!(to_lark("root ::= \"yes\" | \"no\"").unwrap(), "start: g_root\ng_root: \"yes\" | \"no\"\n");
        let g = r#"
# JSON-ish
root   ::= object
object ::= "{" ws ( pair ( "," ws pair )* )? "}"
pair   ::= [a-z]+ ":" ws value
value  ::= [0-9]{1,3} | "\"" [^"\\\n]* "\"" | .
  | "x\u00e9"
ws     ::= [ \t]*
"#;
        let lark = to_lark(g).unwrap();
        assert!(lark.starts_with("start: g_root\ng_root: g_object\n"), "{lark}");
        assert!(lark.contains(r#"g_object: "{" g_ws (g_pair ("," g_ws g_pair)*)? "}""#), "{lark}");
        assert!(
            lark.contains(r#"g_value: /[0-9]/{1,3} | "\"" /[^\x{22}\x{5C}\x{A}]/* "\"" | /(?s:.)/ | "xé""#),
            "{lark}"
        );
        assert!(lark.contains(r"g_ws: /[\x{20}\x{9}]/*"), "{lark}");
        // Names that differ only in case or dashes stay apart; a redefinition replaces.
        let lark = to_lark("root ::= a-b A_b a_b\na-b ::= \"1\"\nA_b ::= \"2\"\na_b ::= \"3\"\na_b ::= \"4\"").unwrap();
        assert_eq!(
            lark,
            "start: g_root\ng_root: g_a_b g_a_b_1 g_a_b_2\ng_a_b: \"1\"\ng_a_b_1: \"2\"\ng_a_b_2: \"4\"\n"
        );
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("root ::= foo", "does not define"),
            ("a ::= \"x\"", "no 'root'"),
            ("root ::= \"x", "not closed"),
            ("root ::= [z-a]", "reversed"),
            ("root ::= \"x\"\n  bad line", "line 2"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= \"x\"{3,1}", "empty"),
            ("root = \"x\"", "'::='"),
        ];
        for (g, what) in cases {
            let e = to_lark(g).unwrap_err();
            assert!(e.message.contains(what), "{g:?}: {e}");
        }
        let deep = format!("root ::= {}\"x\"{}", "(".repeat(100), ")".repeat(100));
        assert!(to_lark(&deep).unwrap_err().message.contains("nested"));
        let deep = format!("root ::= {}\"x\"{}", "(".repeat(20), ")".repeat(20));
        assert!(to_lark(&deep).is_ok());
    }
}
