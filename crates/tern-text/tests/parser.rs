//! Output parser: typed tool calls, reasoning/content split, and split-invariance (proptest).

use proptest::prelude::*;
use serde_json::{json, Value};
use tern_text::{OutputParser, ParseEvent, ToolCall};

fn tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "ratio": {"type": ["number", "null"]}, "filters": {"type": "object"},
            "tags": {"type": "array"}}}}})]
}

/// Final (reasoning, content, tool calls) after feeding `chunks`.
fn parse(chunks: &[&str], thinking: bool) -> (String, String, Vec<ToolCall>) {
    let mut parser = OutputParser::new(&tools(), thinking);
    let mut events: Vec<ParseEvent> = chunks.iter().flat_map(|c| parser.feed(c)).collect();
    events.extend(parser.finish());
    let (mut reasoning, mut content) = (String::new(), String::new());
    for event in &events {
        match event {
            ParseEvent::Reasoning(t) => reasoning += t,
            ParseEvent::Content(t) => content += t,
            _ => {}
        }
    }
    (reasoning, content, ToolCall::collect(&events))
}

const TOOL_OUTPUT: &str = "Need weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=filters>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>";

#[test]
fn qwen_xml_tool_call_becomes_typed_openai_call() {
    let (reasoning, content, calls) = parse(&[TOOL_OUTPUT], true);
    assert_eq!(reasoning, "Need weather.");
    assert_eq!(content, "Checking.");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "get_weather");
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(
        args,
        json!({"city": "New York", "days": 3, "metric": true, "ratio": 0.5,
               "filters": {"a": [1, 2]}, "tags": ["x"], "extra": 42})
    );
    // Argument order follows the output.
    assert!(calls[0].arguments.starts_with("{\"city\":"));
}

#[test]
fn string_parameters_stay_strings_and_multiline() {
    let text =
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n123\nline two\n</parameter>\n</function>\n</tool_call>";
    let (_, content, calls) = parse(&[text], false);
    assert_eq!(content, "");
    assert_eq!(calls[0].arguments, r#"{"city":"123\nline two"}"#);
}

#[test]
fn tool_call_inside_reasoning_ends_reasoning() {
    let text = "thinking about it\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\nafter";
    let (reasoning, content, calls) = parse(&[text], true);
    assert_eq!(reasoning, "thinking about it");
    assert_eq!(content, "after");
    assert_eq!(calls[0].name, "get_weather");
}

#[test]
fn thinking_off_is_all_content_and_unfinished_call_is_recovered() {
    let (reasoning, content, calls) = parse(&["Hi </think> there\n"], false);
    assert_eq!((reasoning.as_str(), content.as_str()), ("", "Hi </think> there\n"));
    assert!(calls.is_empty());
    // Stream cut before </tool_call> (stop id): the call is still parsed.
    let (_, _, calls) = parse(&["<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"], false);
    assert_eq!(calls, vec![ToolCall { name: "f".into(), arguments: r#"{"x":1}"#.into() }]);
    // A tool_call block without a function header is kept as text.
    let (_, content, calls) = parse(&["a <tool_call>oops</tool_call> b"], false);
    assert_eq!(content, "a <tool_call>oops</tool_call> b");
    assert!(calls.is_empty());
}

/// Pieces that exercise tags, partial tags, newlines and multi-byte text.
const PIECES: &[&str] = &[
    "plain ",
    "\n",
    "\n\n",
    "</think>",
    "</thi",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<parameter=city>",
    "</parameter>",
    "<parameter=days>",
    "7",
    "</function>",
    "ünï 😀 ",
    "<",
    ">",
    "think",
    "x",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_split_gives_identical_results(
        pieces in prop::collection::vec(prop::sample::select(PIECES), 0..40),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        thinking in any::<bool>(),
    ) {
        let text: String = pieces.concat() + TOOL_OUTPUT;
        let mut points: Vec<usize> = cuts
            .iter()
            .map(|i| i.index(text.len() + 1))
            .filter(|&p| text.is_char_boundary(p))
            .collect();
        points.sort_unstable();
        points.dedup();
        let mut chunks = Vec::new();
        let mut last = 0;
        for p in points.into_iter().chain([text.len()]) {
            chunks.push(&text[last..p]);
            last = p;
        }
        let whole = parse(&[&text], thinking);
        prop_assert_eq!(&parse(&chunks, thinking), &whole);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        prop_assert_eq!(&parse(&chars, thinking), &whole);
    }
}

/// Streamed char by char, a call gives its name first, then its arguments in pieces (a string parameter's text
/// as it arrives), then its end; the pieces make the same arguments as the whole call.
#[test]
fn tool_call_arguments_stream_in_pieces() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York City\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let mut parser = OutputParser::new(&tools(), false).only_offered();
    let mut events = Vec::new();
    for c in text.chars() {
        events.extend(parser.feed(&c.to_string()));
    }
    events.extend(parser.finish());
    assert_eq!(events[0], ParseEvent::ToolCallStart { name: "get_weather".into() });
    assert_eq!(events.last(), Some(&ParseEvent::ToolCallEnd));
    let pieces: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            ParseEvent::ToolCallArgs(a) => Some(a.as_str()),
            _ => None,
        })
        .collect();
    assert!(pieces.len() > 8, "the city streams as it comes: {pieces:?}");
    assert_eq!(pieces.concat(), r#"{"city":"New York City","days":3}"#);
    // A call to a function that was not offered is the text the model wrote.
    let mut parser = OutputParser::new(&tools(), false).only_offered();
    let mut events =
        parser.feed("<tool_call>\n<function=other>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>");
    events.extend(parser.finish());
    assert_eq!(
        events,
        vec![ParseEvent::Content(
            "<tool_call>\n<function=other>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>".into()
        )]
    );
}
