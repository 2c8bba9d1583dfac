//! Constrained decoding against the real tokenizer: random "models" (random logits, a few seeds) drawing under the
//! masks always produce text that follows the schema, the grammar or the tool's parameters.

mod common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tern_text::{
    Constrained, Grammars, OutputParser, ParseEvent, Reply, Spec, Tokenizer, ToolCall, DEFAULT_STOP_IDS, IM_END_ID,
    THINK_END_ID, TOOL_CALL_ID,
};

fn load(test: &str) -> Option<&'static (Grammars, Tokenizer)> {
    static BOTH: OnceLock<Option<(Grammars, Tokenizer)>> = OnceLock::new();
    let dir = common::model_dir(test)?;
    BOTH.get_or_init(|| Some((Grammars::from_dir(&dir).unwrap(), Tokenizer::from_dir(&dir).unwrap()))).as_ref()
}

fn allows(words: &[u32], id: u32) -> bool {
    words.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Draw up to `max` tokens under `c`: each draw the allowed id with the highest random score (plus `bias(id)`),
/// as a random model at temperature 0 would. Returns the ids (the stop id last if one was drawn) and the time
/// spent computing masks.
fn generate(
    c: &mut Constrained,
    seed: u64,
    max: usize,
    mut bias: impl FnMut(u32, usize) -> f32,
) -> (Vec<u32>, Duration) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut out = Vec::new();
    let mut spent = Duration::ZERO;
    for step in 0..max {
        let t0 = Instant::now();
        let mask = c.mask().unwrap();
        spent += t0.elapsed();
        let Some(words) = mask else { panic!("a grammar never ends by itself") };
        let mut best = (f32::NEG_INFINITY, u32::MAX);
        for (w, &bits) in words.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let id = w as u32 * 32 + bits.trailing_zeros();
                bits &= bits - 1;
                let score = (rng.next() % 1000) as f32 / 100.0 + bias(id, step);
                if score > best.0 {
                    best = (score, id);
                }
            }
        }
        assert!(best.1 != u32::MAX, "the mask allows nothing");
        out.push(best.1);
        if DEFAULT_STOP_IDS.contains(&best.1) {
            break;
        }
        c.commit(best.1).unwrap();
    }
    (out, spent)
}

fn text_of(tok: &Tokenizer, ids: &[u32]) -> String {
    let ids: Vec<u32> = ids.iter().copied().filter(|i| !DEFAULT_STOP_IDS.contains(i)).collect();
    tok.decode(&ids).unwrap()
}

fn reply(thinking: bool) -> Reply {
    Reply { thinking, reasoning_budget: None, stop_ids: DEFAULT_STOP_IDS.to_vec() }
}

/// Bias toward ids whose text closes things (`"`, `}`, `]`), so that unbounded strings end in a few tokens.
fn closing(tok: &Tokenizer) -> Vec<bool> {
    (0..tok.vocab_size() as u32)
        .map(|id| tok.token_bytes(id).is_some_and(|b| b.iter().any(|c| matches!(c, b'"' | b'}' | b']'))))
        .collect()
}

#[test]
fn json_schema_replies_parse_and_validate() {
    let Some((g, tok)) = load("json_schema_replies_parse_and_validate") else { return };
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "nested": {"type": "object", "properties": {"x": {"type": "number", "maximum": 10}}, "required": ["x"],
                       "additionalProperties": false}
        },
        "required": ["name", "age", "color", "tags", "ok", "nested"],
        "additionalProperties": false
    });
    let mut spent = Duration::ZERO;
    let mut tokens = 0;
    for seed in 0..12 {
        let mut c = g.compile(Spec::JsonSchema { schema: &schema, strict: true }, &reply(false)).unwrap();
        let (ids, t) = generate(&mut c, seed, 300, |_, _| 0.0);
        spent += t;
        tokens += ids.len();
        assert!(DEFAULT_STOP_IDS.contains(ids.last().unwrap()), "seed {seed}: no stop in {} tokens", ids.len());
        let text = text_of(tok, &ids);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        let name = v["name"].as_str().unwrap();
        assert!(name.chars().count() <= 12, "{text}");
        let age = v["age"].as_i64().unwrap();
        assert!((0..=120).contains(&age), "{text}");
        assert!(["red", "green", "blue"].contains(&v["color"].as_str().unwrap()), "{text}");
        let tags = v["tags"].as_array().unwrap();
        assert!(tags.len() <= 3 && tags.iter().all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 5)), "{text}");
        assert!(v["ok"].is_boolean() && v["nested"]["x"].as_f64().is_some_and(|x| x <= 10.0), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 6, "{text}");
        assert!(text.starts_with("{\"name\": \""), "compact with one space: {text}");
    }
    println!(
        "json schema: {tokens} tokens, mask {:.1} us a token on average",
        spent.as_secs_f64() * 1e6 / tokens as f64
    );
}

#[test]
fn json_object_and_lark_grammars() {
    let Some((g, tok)) = load("json_object_and_lark_grammars") else { return };
    let close = closing(tok);
    for seed in 0..6 {
        let mut c = g.compile(Spec::JsonObject, &reply(false)).unwrap();
        let (ids, _) = generate(&mut c, seed, 400, |id, _| if close[id as usize] { 8.0 } else { 0.0 });
        let text = text_of(tok, &ids);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        assert!(v.is_object(), "{text}");
    }
    let lark = r#"start: answer " because " REASON
answer: "yes" | "no"
REASON: /[a-z ]{1,20}/
"#;
    for seed in 0..6 {
        let mut c = g.compile(Spec::Lark(lark), &reply(false)).unwrap();
        let (ids, _) = generate(&mut c, seed, 100, |_, _| 0.0);
        let text = text_of(tok, &ids);
        let (a, reason) = text.split_once(" because ").unwrap_or_else(|| panic!("{text}"));
        assert!(["yes", "no"].contains(&a) && (1..=20).contains(&reason.len()), "{text}");
        assert!(reason.bytes().all(|b| b.is_ascii_lowercase() || b == b' '), "{text}");
    }
    // Bad input is the client's error, with llguidance's reason.
    for (spec, what) in [
        (Spec::Lark("start: nonexistent_rule"), "nonexistent_rule"),
        (Spec::Lark("  "), "empty"),
        (Spec::JsonSchema { schema: &json!("x"), strict: false }, "object"),
    ] {
        let e = g.compile(spec, &reply(false)).err().unwrap_or_else(|| panic!("{what}: compiled"));
        assert!(e.message.contains(what), "{what}: {e}");
    }
    let strict = g.compile(
        Spec::JsonSchema { schema: &json!({"type": "string", "format": "no-such"}), strict: true },
        &reply(false),
    );
    let lenient = g.compile(
        Spec::JsonSchema { schema: &json!({"type": "string", "format": "no-such"}), strict: false },
        &reply(false),
    );
    assert!(strict.is_err() && lenient.is_ok(), "strict refuses what it cannot enforce, lenient ignores it");
}

fn weather_tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "detailed": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 2}
            },
            "required": ["city", "unit", "days"]}}}),
        json!({"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"]}}}),
    ]
}

fn check_weather_call(call: &ToolCall, text: &str) {
    let args: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|e| panic!("{e}: {text}"));
    match call.name.as_str() {
        "get_weather" => {
            assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 8), "{text}");
            assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")), "{text}");
            assert!(args["days"].as_i64().is_some_and(|d| (1..=7).contains(&d)), "{text}");
            assert!(args.get("detailed").is_none_or(Value::is_boolean), "{text}");
            if let Some(h) = args.get("hours") {
                let h = h.as_array().unwrap_or_else(|| panic!("{text}"));
                assert!(h.len() <= 2 && h.iter().all(|x| x.as_i64().is_some_and(|x| (0..=23).contains(&x))), "{text}");
            }
            assert!(args
                .as_object()
                .unwrap()
                .keys()
                .all(|k| ["city", "unit", "days", "detailed", "hours"].contains(&k.as_str())));
        }
        "get_time" => {
            let z = args["zone"].as_str().unwrap_or_else(|| panic!("{text}"));
            assert!(z.len() == 3 && z.bytes().all(|b| b.is_ascii_uppercase()), "{text}");
        }
        other => panic!("unknown tool {other}: {text}"),
    }
}

#[test]
fn forced_tool_calls_follow_the_parameters_with_and_without_thinking() {
    let Some((g, tok)) = load("forced_tool_calls_follow_the_parameters_with_and_without_thinking") else { return };
    let tools = weather_tools();
    let close = tok.encode("\n</parameter>", false).unwrap();
    for (seed, thinking, parallel) in (0..12).map(|s| (s, s % 2 == 1, s % 3 == 0)) {
        let mut c = g.compile(Spec::ToolCalls { tools: &tools, parallel }, &reply(thinking)).unwrap();
        // Think for 5 tokens, then close the reasoning; nudge free strings to their end.
        let (ids, _) = generate(&mut c, seed, 600, |id, step| {
            if id == THINK_END_ID && step >= 5 {
                100.0
            } else if close.contains(&id) {
                9.5
            } else if DEFAULT_STOP_IDS.contains(&id) {
                5.0 // a few parallel calls, not the 16 allowed
            } else {
                0.0
            }
        });
        assert!(DEFAULT_STOP_IDS.contains(ids.last().unwrap()), "seed {seed}: {}", text_of(tok, &ids));
        if thinking {
            let end = ids.iter().position(|&i| i == THINK_END_ID).unwrap();
            assert!(end >= 5 && !ids[..end].contains(&TOOL_CALL_ID), "free reasoning, then </think>");
        } else {
            assert_eq!(ids[0], TOOL_CALL_ID, "the reply is the call");
        }
        let text = text_of(tok, &ids);
        let mut p = OutputParser::new(&tools, thinking).only_offered();
        let mut events = p.feed(&text);
        events.extend(p.finish());
        let calls = ToolCall::collect(&events);
        assert!(!calls.is_empty(), "seed {seed}: no call in {text:?}");
        assert!(parallel || calls.len() == 1, "parallel_tool_calls false: one call: {text}");
        for call in &calls {
            check_weather_call(call, &text);
        }
        assert!(!events.iter().any(|e| matches!(e, ParseEvent::Content(t) if !t.trim().is_empty())), "{text:?}");
    }
}

#[test]
fn reasoning_cannot_end_the_reply_and_a_budget_closes_it() {
    let Some((g, _)) = load("reasoning_cannot_end_the_reply_and_a_budget_closes_it") else { return };
    let r = Reply { thinking: true, reasoning_budget: Some(3), stop_ids: DEFAULT_STOP_IDS.to_vec() };
    let mut c = g.compile(Spec::Free, &r).unwrap();
    for _ in 0..3 {
        let m = c.mask().unwrap().unwrap();
        assert!(!allows(&m, IM_END_ID) && !allows(&m, TOOL_CALL_ID) && allows(&m, 15) && allows(&m, THINK_END_ID));
        c.commit(15).unwrap();
    }
    let m = c.mask().unwrap().unwrap();
    assert_eq!(m.iter().map(|w| w.count_ones()).sum::<u32>(), 1);
    assert!(allows(&m, THINK_END_ID), "budget spent: </think> is forced");
    c.commit(THINK_END_ID).unwrap();
    assert_eq!(c.mask().unwrap(), None, "no grammar: free after the reasoning");
}

/// Issue 39: a 300-link `$ref` chain or an 800-rule Lark chain overflowed a 2 MiB thread's stack while compiling
/// (the process aborted). They compile now (on a thread of their own with a large stack, here from an ordinary
/// test thread), and longer chains are refused before llguidance sees them, naming the limit.
#[test]
fn deep_chains_compile_or_are_refused_and_never_overflow() {
    let Some((g, _)) = load("deep_chains_compile_or_are_refused_and_never_overflow") else { return };
    let ref_chain = |n: usize| {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let v = if i + 1 < n {
                json!({"type": "object", "properties": {"next": {"$ref": format!("#/$defs/d{}", i + 1)}},
                       "required": ["next"]})
            } else {
                json!({"type": "string"})
            };
            defs.insert(format!("d{i}"), v);
        }
        json!({"$ref": "#/$defs/d0", "$defs": defs})
    };
    let rule_chain = |n: usize| {
        let mut t = String::from("start: r0\n");
        for i in 0..n {
            t += &format!("r{i}: \"a\" r{}\n", i + 1);
        }
        t + &format!("r{n}: \"b\"\n")
    };
    let t0 = Instant::now();
    let schema = ref_chain(300);
    g.compile(Spec::JsonSchema { schema: &schema, strict: false }, &reply(false)).unwrap();
    g.compile(Spec::Lark(&rule_chain(800)), &reply(false)).unwrap();
    // The longest accepted chains, with the margin the stack is sized for.
    let schema = ref_chain(900);
    g.compile(Spec::JsonSchema { schema: &schema, strict: false }, &reply(false)).unwrap();
    g.compile(Spec::Lark(&rule_chain(4900)), &reply(false)).unwrap();
    println!("deep chains compiled in {:.2} s", t0.elapsed().as_secs_f64());
    let schema = ref_chain(2000);
    let e = g.compile(Spec::JsonSchema { schema: &schema, strict: false }, &reply(false)).err().unwrap();
    assert_eq!(e.limit, Some("ref_depth"), "{e}");
    let e = g.compile(Spec::Lark(&rule_chain(6000)), &reply(false)).err().unwrap();
    assert_eq!(e.limit, Some("rules"), "{e}");
    // The same chain in a forced tool's parameter (its `$ref` points into the parameters' `$defs`).
    let chain = ref_chain(300);
    let params = json!({"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"],
                        "$defs": chain["$defs"]});
    let tools = [json!({"type": "function", "function": {"name": "f", "parameters": params}})];
    g.compile(Spec::ToolCalls { tools: &tools, parallel: false }, &reply(false)).unwrap();
}

/// A tool parameter whose `$ref` points into the parameters' `$defs` (pydantic's way) follows the definition (it
/// was compiled without the `$defs`, and refused).
#[test]
fn tool_parameters_follow_refs_to_the_parameters_defs() {
    let Some((g, tok)) = load("tool_parameters_follow_refs_to_the_parameters_defs") else { return };
    let tools = vec![json!({"type": "function", "function": {"name": "put", "parameters": {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"],
        "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                           "required": ["n"], "additionalProperties": false}}}}})];
    for seed in 0..4 {
        let mut c = g.compile(Spec::ToolCalls { tools: &tools, parallel: false }, &reply(false)).unwrap();
        let (ids, _) = generate(&mut c, seed, 80, |_, _| 0.0);
        let text = text_of(tok, &ids);
        let mut p = OutputParser::new(&tools, false).only_offered();
        let mut events = p.feed(&text);
        events.extend(p.finish());
        let calls = ToolCall::collect(&events);
        assert_eq!(calls.len(), 1, "{text:?}");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert!(args["item"]["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)), "{text:?}");
    }
}

/// Issue 39: 100k alternatives compiled for 17-22 s (then llguidance panicked on its symbol table, and the panic
/// came back with a backtrace); a 100k-value enum in a forced tool the same. Both are refused at once now.
#[test]
fn huge_grammars_are_refused_at_once() {
    let Some((g, _)) = load("huge_grammars_are_refused_at_once") else { return };
    let t0 = Instant::now();
    let alts: Vec<String> = (0..100_000).map(|i| format!("\"w{i}\"")).collect();
    let e = g.compile(Spec::Lark(&format!("start: {}\n", alts.join(" | "))), &reply(false)).err().unwrap();
    assert!(e.limit.is_some() && e.message.contains("at most"), "{e}");
    let short: Vec<String> = (0..20_000).map(|i| format!("\"{}\"", i % 10)).collect();
    let e = g.compile(Spec::Lark(&format!("start: {}\n", short.join("|"))), &reply(false)).err().unwrap();
    assert_eq!(e.limit, Some("alternatives"), "{e}");
    let values: Vec<Value> = (0..100_000).map(|i| json!(format!("v{i}"))).collect();
    let tools = [json!({"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": {"type": "string", "enum": values}}, "required": ["v"]}}})];
    let e = g.compile(Spec::ToolCalls { tools: &tools, parallel: false }, &reply(false)).err().unwrap();
    assert_eq!(e.limit, Some("enum_values"), "{e}");
    let schema = json!({"type": "object", "properties": {"v": {"enum": values}}});
    let e = g.compile(Spec::JsonSchema { schema: &schema, strict: false }, &reply(false)).err().unwrap();
    assert_eq!(e.limit, Some("enum_values"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2), "refusing took {:?}", t0.elapsed());
    // Within the limits, the largest still compile quickly.
    let t0 = Instant::now();
    let alts: Vec<String> = (0..9_000).map(|i| format!("\"w{i}\"")).collect();
    g.compile(Spec::Lark(&format!("start: {}\n", alts.join(" | "))), &reply(false)).unwrap();
    let values: Vec<Value> = (0..5_000).map(|i| json!(format!("v{i}"))).collect();
    let tools = [json!({"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": {"type": "string", "enum": values}}, "required": ["v"]}}})];
    g.compile(Spec::ToolCalls { tools: &tools, parallel: false }, &reply(false)).unwrap();
    println!("9k alternatives and a 5k enum compiled in {:.2} s", t0.elapsed().as_secs_f64());
}

/// Issue 39: errors held llguidance's parser state and the grammar quoted back; now a few lines of reason.
#[test]
fn grammar_errors_are_short_and_hold_no_internals() {
    let Some((g, _)) = load("grammar_errors_are_short_and_hold_no_internals") else { return };
    let long_line = format!("start: \"a\" {}bad\nbad: /[z-a]/\n", "\"b\" ".repeat(200));
    for (spec, what) in [
        (Spec::Lark(&long_line), "range"),
        (Spec::Lark("start: %json {\"type\": \"string\", \"pattern\": \"(?=a)\"}"), "look-around"),
        (Spec::Lark("start: x\nx: \"a\" {5,1}"), ""),
        (Spec::Gbnf("root ::= missing"), "missing"),
    ] {
        let e = g.compile(spec, &reply(false)).err().unwrap_or_else(|| panic!("{what}: compiled"));
        assert!(e.message.contains(what), "{what}: {e}");
        assert!(e.message.len() < 500 && !e.message.contains('\n'), "{e}");
        assert!(!e.message.contains("<backtrace>") && !e.message.contains("\"b\" \"b\" \"b\""), "{e}");
        assert!(e.internal.is_none(), "{e:?}");
    }
}

/// llama.cpp's GBNF in `grammar`: read as Lark, it constrains the reply like a Lark grammar.
#[test]
fn gbnf_grammars_constrain_the_reply() {
    let Some((g, tok)) = load("gbnf_grammars_constrain_the_reply") else { return };
    assert!(tern_text::constraint::is_gbnf("root ::= \"yes\" | \"no\""));
    for seed in 0..4 {
        let mut c = g.compile(Spec::Gbnf("root ::= \"yes\" | \"no\""), &reply(false)).unwrap();
        let (ids, _) = generate(&mut c, seed, 20, |_, _| 0.0);
        let text = text_of(tok, &ids);
        assert!(text == "yes" || text == "no", "{text:?}");
    }
    let gbnf = r#"# a small list
root ::= "[" item ("," ws item){0,3} "]"
item ::= [0-9] | [a-c]+ | "\"" [^"\\\n,]{1,4} "\""
ws ::= [ ]?
"#;
    let close = closing(tok);
    for seed in 0..6 {
        let mut c = g.compile(Spec::Gbnf(gbnf), &reply(false)).unwrap();
        let (ids, _) = generate(&mut c, seed, 60, |id, _| if close[id as usize] { 6.0 } else { 0.0 });
        let text = text_of(tok, &ids);
        let inner = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or_else(|| panic!("{text:?}"));
        for item in inner.split(',').map(|i| i.trim_start_matches(' ')) {
            let digit = item.len() == 1 && item.bytes().all(|b| b.is_ascii_digit());
            let abc = !item.is_empty() && item.bytes().all(|b| (b'a'..=b'c').contains(&b));
            let quoted = item.len() >= 3 && item.starts_with('"') && item.ends_with('"');
            assert!(digit || abc || quoted, "{item:?} in {text:?}");
        }
    }
}

/// A grammar forcing a 50k-byte run (`/a{50000}/`) masks only what the run's own tokenization starts with, each
/// step (llguidance tokenizes a bounded prefix of the run for it: the first token is the same); a 100k-byte run
/// outlasts the lexer's fuel in the first mask and fails with an error that says so.
#[test]
fn a_long_forced_run_masks_its_canonical_first_token() {
    let Some((g, tok)) = load("a_long_forced_run_masks_its_canonical_first_token") else { return };
    let mut c = g.compile(Spec::Lark("start: /a{50000}/\n"), &reply(false)).unwrap();
    let mut left = 50_000;
    for step in 0..5 {
        let words = c.mask().unwrap().unwrap();
        let allowed: Vec<u32> = (0..words.len() as u32 * 32).filter(|&id| allows(&words, id)).collect();
        let canonical = tok.encode_text(&"a".repeat(left)).unwrap()[0];
        assert_eq!(allowed, [canonical], "step {step}: the mask of {left} forced bytes");
        c.commit(canonical).unwrap();
        left -= tok.token_bytes(canonical).unwrap().len();
    }
    let mut c = g.compile(Spec::Lark("start: /a{100000}/\n"), &reply(false)).unwrap();
    // (The first mask forces as much of the run as the fuel lasts for; drawing from it ends the grammar.)
    let words = c.mask().unwrap().unwrap();
    let e = c.commit((0..).find(|&id| allows(&words, id)).unwrap()).unwrap_err();
    assert!(e.starts_with("the grammar is too expensive to enforce") && e.contains("too many expressions"), "{e}");
}
