//! Tokenizer round trips and special-token ids against the real checkpoint files.

mod common;

use tern_text::Tokenizer;

fn load(test: &str) -> Option<Tokenizer> {
    common::model_dir(test).map(|dir| Tokenizer::from_dir(dir).unwrap())
}

#[test]
fn round_trips_reference_text_and_code() {
    let Some(tok) = load("round_trips_reference_text_and_code") else {
        return;
    };
    let reference = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/docs/tokenizer-reference.txt");
    let mut texts = vec![
        "fn main() {\n    let x: Vec<u8> = vec![0xff; 3];\n\tprintln!(\"{x:?}\"); // done\n}\n".to_string(),
        "def f(a, b=2):\n    return {'k': a ** b}  # 🐍\n".to_string(),
        "Grüße aus Zürich — 你好，世界！ こんにちは 안녕하세요 مرحبا नमस्ते 🦙🦙".to_string(),
    ];
    if let Ok(text) = std::fs::read_to_string(reference) {
        texts.extend(text.lines().map(str::to_string));
        texts.push(text);
    }
    for text in &texts {
        let ids = tok.encode(text, false).unwrap();
        assert!(!ids.is_empty() || text.is_empty());
        assert_eq!(&tok.decode(&ids).unwrap(), text, "ids {ids:?}");
        // Piece-wise bytes agree with whole decode.
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
        assert_eq!(bytes, text.as_bytes());
    }
}

#[test]
fn special_tokens_have_expected_ids() {
    let Some(tok) = load("special_tokens_have_expected_ids") else {
        return;
    };
    let expected = [
        ("<|endoftext|>", tern_text::ENDOFTEXT_ID),
        ("<|im_start|>", tern_text::IM_START_ID),
        ("<|im_end|>", tern_text::IM_END_ID),
        ("<tool_call>", tern_text::TOOL_CALL_ID),
        ("</tool_call>", tern_text::TOOL_CALL_END_ID),
        ("<think>", tern_text::THINK_ID),
        ("</think>", tern_text::THINK_END_ID),
    ];
    for (text, id) in expected {
        assert_eq!(tok.id_of(text), Some(id), "{text}");
        assert_eq!(tok.encode(text, false).unwrap(), vec![id], "{text}");
        assert_eq!(tok.decode(&[id]).unwrap(), text);
    }
    assert!(tok.is_special(tern_text::IM_END_ID));
    assert!(!tok.is_special(tok.encode("hello", false).unwrap()[0]));
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", false).unwrap();
    assert_eq!(ids.first(), Some(&tern_text::IM_START_ID));
    assert!(ids.contains(&tern_text::IM_END_ID));
    assert_eq!(tok.vocab_size(), 248_077);
    // Ids from the Python `tokenizers` library (onig regex backend); NFC folds e + U+0301.
    assert_eq!(
        tok.encode("Hello, world! 你好 3333 e\u{301}", false).unwrap(),
        [9419, 11, 1814, 0, 220, 109266, 220, 18, 18, 18, 18, 3825]
    );
    assert!(tok.token_bytes(u32::MAX).is_none());
    assert!(tok.decode(&[u32::MAX]).is_err());
}

/// `min_tokens` never exceeds the real count (it is what lets the server refuse an over-long prompt before
/// encoding it), on the texts where the bound is tightest: runs of the longest token of each class (spaces,
/// punctuation, letters), digits, decomposed text that NFC composes (Hangul jamo 3x, Latin and Greek with several
/// marks) or turns into ASCII punctuation (U+037E), special tokens, mixed scripts.
#[test]
fn min_tokens_is_a_lower_bound() {
    let Some(tok) = load("min_tokens_is_a_lower_bound") else {
        return;
    };
    assert_eq!(tok.max_token_bytes(), 128);
    let jamo = "\u{1100}\u{1161}\u{11A8}"; // 각 decomposed: 9 bytes, one character after NFC
    let texts = [
        " ".repeat(128 * 40),
        " ".repeat(128 * 40 + 127),
        jamo.repeat(3000),
        "a\u{0308}\u{0304}".repeat(2000),                // ǟ
        "\u{03B1}\u{0313}\u{0301}\u{0345}".repeat(2000), // ᾄ
        "s\u{0323}\u{0307}".repeat(2000),                // ṩ
        "<|im_start|>".repeat(500),
        "Grüße 你好 안녕하세요 🦙 ".repeat(300),
        "x".repeat(20_000),
        "-".repeat(114 * 40),
        "//".to_owned() + &"-".repeat(112 * 40),
        "\u{2014}".repeat(16 * 300), // the longest word token: 16 em dashes
        "\n".repeat(5000),
        "\u{037E}".repeat(5000),
        "1234567890".repeat(1000),
        "x1 y2, z3; ".repeat(1000),
        "The quick brown fox jumps over the lazy dog. ".repeat(500),
        include_str!("../src/tokenizer.rs").to_owned(),
    ];
    for text in &texts {
        let n = tok.encode(text, false).unwrap().len();
        let bound = tok.min_tokens(text);
        assert!(bound <= n, "bound {bound} > {n} tokens for {:?}...", text.chars().take(8).collect::<String>());
    }
    // It is not vacuous: digits count one each; 4 MB of English or of letters cannot fit a 32k context (a bound of
    // bytes / 128 said 31k: it let them be tokenised, seconds each, before their 400), nor 4 MB of punctuation.
    assert_eq!(tok.min_tokens(&"1234567890".repeat(1000)), 10_000);
    let english = "The quick brown fox jumps over the lazy dog. ".repeat(4_000_000 / 45);
    assert!(tok.min_tokens(&english) > 60_000, "{}", tok.min_tokens(&english));
    assert_eq!(tok.min_tokens(&"x".repeat(4_000_000)), 83_333);
    assert_eq!(tok.min_tokens(&"-".repeat(4_000_000)), 35_087);
    // A run of spaces is what it says: 128 a token.
    assert_eq!(tok.min_tokens(&" ".repeat(4_000_000)), 31_250);
}

/// Tokenising in pieces ([`Tokenizer::encode_within`]) gives the ids of the whole text, with and without added
/// tokens read as such, on text mixing what the pre-tokenizer and NFC treat specially around the places it splits
/// at (newlines before letters and digits, spaces between letters); past the limit it answers `None`.
#[test]
fn encoding_in_pieces_gives_the_whole_texts_ids() {
    let Some(tok) = load("encoding_in_pieces_gives_the_whole_texts_ids") else {
        return;
    };
    let fragments = [
        "The quick brown fox",
        " jumps",
        "\n",
        "\n\n",
        "  \n",
        " \nX",
        ".\nY",
        "\r\nZ",
        "it's",
        " they'll go",
        "\t",
        "e\u{0301} x",
        "a\u{0308}",
        " \u{0301}b",
        "12 34\n5",
        "<|im_start|>user\nHello",
        "<|im_end|>\n",
        "<think>",
        "你好，世界",
        " 안녕하세요",
        "🦙 ",
        "x  y",
        "   ",
        "\u{1100}\u{1161}",
        "fn f() {\n    a\n}\n",
        "-- ",
        "A",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut text = String::new();
    while text.len() < 400_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        text.push_str(fragments[(state % fragments.len() as u64) as usize]);
    }
    let whole = tok.encode(&text, false).unwrap();
    assert_eq!(tok.encode_within(&text, false, usize::MAX).unwrap().as_ref(), Some(&whole));
    let as_text = tok.encode_text(&text).unwrap();
    assert_eq!(tok.encode_within(&text, true, usize::MAX).unwrap().as_ref(), Some(&as_text));
    assert_eq!(tok.encode_within(&text, false, whole.len()).unwrap().as_ref(), Some(&whole));
    assert_eq!(tok.encode_within(&text, false, whole.len() - 1).unwrap(), None);
    assert_eq!(tok.encode_within(&text, true, 1000).unwrap(), None);
}
