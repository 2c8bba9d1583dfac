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
        assert!(e.0.contains(what), "{what}: {e}");
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
