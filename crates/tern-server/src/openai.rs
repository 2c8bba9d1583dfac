//! The OpenAI shapes of a reply: `chat.completion` / `chat.completion.chunk` and `text_completion`.
//!
//! Chat streams the way the official clients read it: a role chunk per choice, then deltas of reasoning
//! (`reasoning_content` and `reasoning`), content, and tool calls — a call's id and name first (`arguments: ""`),
//! then its arguments in pieces under the same `index` — then a chunk with the finish reason per choice, the
//! usage chunk if `stream_options.include_usage`, and `[DONE]`.

use serde_json::{json, Value};
use tern_engine::{TokenLogprob, Usage};

use crate::api::ApiError;
use crate::generate::{sse, ChoiceEnd, Collected, Meta, Piece, Writer};

fn token_text(m: &Meta, id: u32) -> (String, Vec<u8>) {
    let bytes = m.tokenizer.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The usage object; chat's (`reasoning`: the reasoning tokens of every choice) has `completion_tokens_details`.
fn usage_json(u: &Usage, reasoning: Option<usize>) -> Value {
    let mut v = json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                       "total_tokens": u.prompt_tokens + u.completion_tokens,
                       "prompt_tokens_details": {"cached_tokens": u.cached_tokens}});
    if let Some(r) = reasoning {
        v["completion_tokens_details"] = json!({"reasoning_tokens": r});
    }
    v
}

fn error_events(message: &str) -> String {
    sse(&ApiError::internal(message).json()) + "data: [DONE]\n\n"
}

/// `/v1/chat/completions`.
#[derive(Default)]
pub(crate) struct ChatWriter {
    /// Per choice: log-probabilities of pieces that made no chunk, for the next one.
    held: Vec<Vec<TokenLogprob>>,
    /// Reasoning tokens of the choices ended so far.
    reasoning: usize,
}

impl ChatWriter {
    fn logprobs(m: &Meta, lps: &[TokenLogprob]) -> Value {
        if !m.logprobs {
            return Value::Null;
        }
        let entry = |id: u32, lp: f32| {
            let (token, bytes) = token_text(m, id);
            json!({"token": token, "logprob": lp, "bytes": bytes})
        };
        let content: Vec<Value> = lps
            .iter()
            .map(|l| {
                let mut e = entry(l.token, l.logprob);
                e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                e
            })
            .collect();
        json!({"content": content})
    }

    fn chunk(&mut self, m: &Meta, i: usize, delta: Value, mut lps: Vec<TokenLogprob>, finish: Option<&str>) -> String {
        if self.held.len() < m.choices {
            self.held.resize_with(m.choices, Vec::new);
        }
        let mut all = std::mem::take(&mut self.held[i]);
        all.append(&mut lps);
        let logprobs = if all.is_empty() { Value::Null } else { Self::logprobs(m, &all) };
        let choice = json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish});
        let mut c = json!({"id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": m.model,
                           "system_fingerprint": m.fingerprint, "choices": [choice]});
        if m.include_usage {
            c["usage"] = Value::Null;
        }
        sse(&c)
    }
}

impl Writer for ChatWriter {
    fn open(&mut self, m: &Meta) -> String {
        (0..m.choices).map(|i| self.chunk(m, i, json!({"role": "assistant", "content": ""}), vec![], None)).collect()
    }

    fn piece(&mut self, m: &Meta, i: usize, p: &Piece, lps: Vec<TokenLogprob>) -> String {
        let delta = match p {
            Piece::Reasoning(s) => json!({"reasoning_content": s, "reasoning": s}),
            Piece::Content(s) => json!({"content": s}),
            Piece::CallStart { index, id, name } => {
                json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                                                                         "function": {"name": name, "arguments": ""}}]})
            }
            Piece::CallArgs { index, args } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
            }
            Piece::CallEnd => {
                if self.held.len() < m.choices {
                    self.held.resize_with(m.choices, Vec::new);
                }
                self.held[i].extend(lps);
                return String::new();
            }
        };
        self.chunk(m, i, delta, lps, None)
    }

    fn choice_end(&mut self, m: &Meta, i: usize, end: &ChoiceEnd, lps: Vec<TokenLogprob>) -> String {
        self.reasoning += end.reasoning_tokens;
        self.chunk(m, i, json!({}), lps, Some(end.openai_reason()))
    }

    fn close(&mut self, m: &Meta, usage: &Usage) -> String {
        let mut out = String::new();
        if m.include_usage {
            out += &sse(&json!({"id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": m.model,
                                "system_fingerprint": m.fingerprint, "choices": [],
                                "usage": usage_json(usage, Some(self.reasoning))}));
        }
        out + "data: [DONE]\n\n"
    }

    fn error(&mut self, _m: &Meta, message: &str) -> String {
        error_events(message)
    }

    fn body(&self, m: &Meta, choices: &[Collected], usage: &Usage) -> Value {
        let reasoning_tokens: usize = choices.iter().filter_map(|c| c.end.as_ref()).map(|e| e.reasoning_tokens).sum();
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let reasoning = (!c.reasoning.is_empty()).then_some(&c.reasoning);
                let mut message = json!({"role": "assistant", "content": c.content,
                                         "reasoning_content": reasoning, "reasoning": reasoning});
                if !c.calls.is_empty() {
                    let calls: Vec<Value> = c
                        .calls
                        .iter()
                        .map(|k| {
                            json!({"id": k.id, "type": "function",
                                        "function": {"name": k.name, "arguments": k.arguments}})
                        })
                        .collect();
                    message["tool_calls"] = Value::Array(calls);
                    if c.content.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                let logprobs = if m.logprobs { Self::logprobs(m, &c.logprobs) } else { Value::Null };
                let reason = c.end.as_ref().map_or("stop", ChoiceEnd::openai_reason);
                json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
            })
            .collect();
        json!({"id": m.id, "object": "chat.completion", "created": m.created, "model": m.model,
               "system_fingerprint": m.fingerprint, "choices": choices,
               "usage": usage_json(usage, Some(reasoning_tokens))})
    }
}

/// `/v1/completions`: text, with `echo` the prompt first; log-probabilities with `text_offset` (characters from
/// the start of the choice's text, the echoed prompt included).
#[derive(Default)]
pub(crate) struct CompletionWriter {
    /// Per choice: characters of text before the next token.
    offsets: Vec<usize>,
}

impl CompletionWriter {
    fn offsets(&mut self, m: &Meta) -> &mut Vec<usize> {
        if self.offsets.len() < m.choices {
            self.offsets = m.echo.iter().map(|e| e.chars().count()).collect();
            self.offsets.resize(m.choices, 0);
        }
        &mut self.offsets
    }

    fn logprobs(&mut self, m: &Meta, i: usize, lps: &[TokenLogprob]) -> Value {
        if !m.logprobs {
            return Value::Null;
        }
        let mut text_offset = Vec::with_capacity(lps.len());
        let mut tokens = Vec::with_capacity(lps.len());
        for l in lps {
            let t = token_text(m, l.token).0;
            let at = &mut self.offsets(m)[i];
            text_offset.push(*at);
            *at += t.chars().count();
            tokens.push(t);
        }
        let token_logprobs: Vec<f32> = lps.iter().map(|l| l.logprob).collect();
        let top: Vec<Value> = lps
            .iter()
            .map(|l| Value::Object(l.top.iter().map(|&(id, lp)| (token_text(m, id).0, json!(lp))).collect()))
            .collect();
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset})
    }

    fn chunk(&mut self, m: &Meta, i: usize, text: &str, lps: &[TokenLogprob], finish: Option<&str>) -> String {
        let logprobs = if lps.is_empty() { Value::Null } else { self.logprobs(m, i, lps) };
        let choice = json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish});
        let mut c = json!({"id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
                           "system_fingerprint": m.fingerprint, "choices": [choice]});
        if m.include_usage {
            c["usage"] = Value::Null;
        }
        sse(&c)
    }
}

impl Writer for CompletionWriter {
    fn open(&mut self, m: &Meta) -> String {
        self.offsets(m);
        let echo = m.echo.clone();
        echo.iter().enumerate().filter(|(_, e)| !e.is_empty()).map(|(i, e)| self.chunk(m, i, e, &[], None)).collect()
    }

    fn piece(&mut self, m: &Meta, i: usize, p: &Piece, lps: Vec<TokenLogprob>) -> String {
        match p {
            Piece::Content(s) => self.chunk(m, i, s, &lps, None),
            _ => String::new(),
        }
    }

    fn choice_end(&mut self, m: &Meta, i: usize, end: &ChoiceEnd, lps: Vec<TokenLogprob>) -> String {
        self.chunk(m, i, "", &lps, Some(end.openai_reason()))
    }

    fn close(&mut self, m: &Meta, usage: &Usage) -> String {
        let mut out = String::new();
        if m.include_usage {
            out += &sse(&json!({"id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
                                "system_fingerprint": m.fingerprint, "choices": [], "usage": usage_json(usage, None)}));
        }
        out + "data: [DONE]\n\n"
    }

    fn error(&mut self, _m: &Meta, message: &str) -> String {
        error_events(message)
    }

    fn body(&self, m: &Meta, choices: &[Collected], usage: &Usage) -> Value {
        let mut me = CompletionWriter::default();
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let echo = m.echo.get(i).map_or("", String::as_str);
                let logprobs = if m.logprobs { me.logprobs(m, i, &c.logprobs) } else { Value::Null };
                let reason = c.end.as_ref().map_or("stop", ChoiceEnd::openai_reason);
                json!({"index": i, "text": format!("{echo}{}", c.content), "logprobs": logprobs,
                       "finish_reason": reason})
            })
            .collect();
        json!({"id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
               "system_fingerprint": m.fingerprint, "choices": choices, "usage": usage_json(usage, None)})
    }
}
