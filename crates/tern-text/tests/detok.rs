//! Detokenizer: UTF-8 hold-back, stop strings, stop ids, max tokens.

mod common;

use tern_text::{DetokConfig, Detokenizer, Finish, Step, Tokenizer};

fn load(test: &str) -> Option<Tokenizer> {
    common::model_dir(test).map(|dir| Tokenizer::from_dir(dir).unwrap())
}

/// Ids spelling `text` one character per encode call (so every char is its own token run).
fn char_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    text.chars().flat_map(|c| tok.encode(&c.to_string(), false).unwrap()).collect()
}

fn run(tok: &Tokenizer, config: DetokConfig, ids: &[u32]) -> (Vec<String>, Option<Finish>) {
    let mut detok = Detokenizer::new(tok, config);
    let mut texts = Vec::new();
    for &id in ids {
        let Step { text, finish } = detok.push(id).unwrap();
        texts.push(text);
        if finish.is_some() {
            return (texts, finish);
        }
    }
    texts.push(detok.flush());
    (texts, None)
}

#[test]
fn split_characters_are_held_back() {
    let Some(tok) = load("split_characters_are_held_back") else {
        return;
    };
    let text = "ok 😶‍🌫️ កាន់តែពិសេស 🦙 我想在apple工作";
    let ids = tok.encode(text, false).unwrap();
    let partial = ids.iter().filter(|&&id| std::str::from_utf8(&tok.token_bytes(id).unwrap()).is_err()).count();
    assert!(partial > 0, "test text must split a character across tokens");
    let (texts, finish) = run(&tok, DetokConfig::default(), &ids);
    assert_eq!(finish, None);
    assert!(texts.iter().all(|t| !t.contains('\u{FFFD}')));
    assert!(texts.iter().any(|t| t.is_empty()), "some token must be held back");
    assert_eq!(texts.concat(), text);
}

#[test]
fn stop_string_prefixes_are_held_and_released() {
    let Some(tok) = load("stop_string_prefixes_are_held_and_released") else {
        return;
    };
    let config = DetokConfig { stop_strings: vec!["</answer>".into(), "STOP".into()], ..DetokConfig::default() };
    let ids = char_ids(&tok, "a </ans b </answer> tail");
    let (texts, finish) = run(&tok, config.clone(), &ids);
    assert_eq!(finish, Some(Finish::StopString("</answer>".into())));
    assert_eq!(texts.concat(), "a </ans b ");
    // "</ans" is withheld until " " shows it is not a stop string.
    assert_eq!(texts[..7].concat(), "a ");
    assert_eq!(texts[7], "</ans ");
    // A stop string inside one token, and the earliest of two matches wins.
    let ids = tok.encode("xSTOP</answer>", false).unwrap();
    let (texts, finish) = run(&tok, config.clone(), &ids);
    assert_eq!((texts.concat(), finish), ("x".into(), Some(Finish::StopString("STOP".into()))));
    // A held prefix that never completes is released by flush.
    let (texts, finish) = run(&tok, config, &char_ids(&tok, "end </ans"));
    assert_eq!((texts.concat(), finish), ("end </ans".into(), None));
}

#[test]
fn stop_ids_and_max_tokens_finish() {
    let Some(tok) = load("stop_ids_and_max_tokens_finish") else {
        return;
    };
    let config = DetokConfig {
        stop_ids: tern_text::DEFAULT_STOP_IDS.to_vec(),
        stop_strings: vec!["xyz".into()],
        max_tokens: Some(4),
        min_tokens: 0,
    };
    let mut ids = char_ids(&tok, "Hi");
    ids.push(tern_text::IM_END_ID);
    let (texts, finish) = run(&tok, config.clone(), &ids);
    assert_eq!((texts.concat(), finish), ("Hi".into(), Some(Finish::StopId(248046))));
    // Length: the held stop prefix "x" is emitted since the stream ends.
    let (texts, finish) = run(&tok, config.clone(), &char_ids(&tok, "abcxyz"));
    assert_eq!((texts.concat(), finish), ("abcx".into(), Some(Finish::Length)));
    // After finishing, pushes return no text and the same reason; unknown ids are errors.
    let mut detok = Detokenizer::new(&tok, config);
    assert!(detok.push(u32::MAX).is_err());
    detok.push(tern_text::ENDOFTEXT_ID).unwrap();
    let step = detok.push(ids[0]).unwrap();
    assert_eq!(step, Step { text: String::new(), finish: Some(Finish::StopId(248044)) });
}

/// vLLM's `min_tokens`: no stop string ends the first tokens; their text comes out as it arrives.
#[test]
fn min_tokens_holds_off_stop_strings() {
    let Some(tok) = load("min_tokens_holds_off_stop_strings") else {
        return;
    };
    let config = DetokConfig { stop_strings: vec!["ab".into()], min_tokens: 4, ..DetokConfig::default() };
    let (texts, finish) = run(&tok, config.clone(), &char_ids(&tok, "abxaby"));
    assert_eq!((texts.concat(), finish), ("abx".into(), Some(Finish::StopString("ab".into()))));
    assert_eq!(texts[..2], ["a".to_string(), "b".to_string()], "no hold-back before min_tokens");
    let (texts, finish) = run(&tok, DetokConfig { min_tokens: 0, ..config.clone() }, &char_ids(&tok, "abxaby"));
    assert_eq!((texts.concat(), finish), ("".into(), Some(Finish::StopString("ab".into()))));
    // max_tokens still ends it.
    let (texts, finish) = run(&tok, DetokConfig { max_tokens: Some(2), ..config }, &char_ids(&tok, "abab"));
    assert_eq!((texts.concat(), finish), ("ab".into(), Some(Finish::Length)));
}
