//! `tern run` (one prompt, streamed) and `tern chat` (an interactive conversation in the terminal).

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tern_engine::{Engine, EngineConfig, Event, Model, Request};
use tern_text::{ChatOptions, OutputParser, ParseEvent};

#[derive(clap::Args)]
pub struct GenArgs {
    /// Model directory or Hugging Face id.
    #[arg(long, default_value = crate::load::DEFAULT_MODEL)]
    pub model: String,
    /// cpu, cuda or auto (auto: cuda when available, else cpu).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens per answer.
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: usize,
    /// Sampling temperature (default: the model's generation_config.json; 0 = greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Answer without a <think> reasoning phase.
    #[arg(long)]
    pub no_think: bool,
    /// Context size in tokens.
    #[arg(long, default_value_t = 32768)]
    pub ctx_size: usize,
    /// Speculative decoding: tokens the model's MTP block drafts a step (0: off; see `tern serve --help`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=4))]
    pub speculative: u64,
}

#[derive(clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub gen: GenArgs,
    /// The user message.
    #[arg(long)]
    pub prompt: String,
}

struct Session {
    model: Model,
    engine: Engine,
    args: GenArgs,
    thinking: bool,
}

/// What one answer produced.
struct Answer {
    reasoning: String,
    content: String,
    tool_calls: Vec<Value>,
    tokens: usize,
    seconds: f64,
}

impl Session {
    fn new(args: GenArgs) -> Result<Session> {
        let model = crate::load::load_model(&tern_server::cli::Load {
            model: args.model.clone(),
            backend: args.backend.clone(),
            ctx: args.ctx_size,
            state: None,
            speculative: args.speculative as usize,
        })?;
        let cfg =
            EngineConfig { ctx_size: args.ctx_size, speculative: args.speculative as usize, ..EngineConfig::default() };
        let engine = Engine::start(model.backend.clone(), model.tokenizer.clone(), cfg);
        let thinking = !args.no_think;
        Ok(Session { model, engine, args, thinking })
    }

    /// Generate the assistant's answer to `messages`, streaming content to `out` and reasoning to `err`.
    fn answer(&self, messages: &[Value], out: &mut dyn Write, err: &mut dyn Write) -> Result<Answer> {
        let opts = ChatOptions { enable_thinking: Some(self.thinking), ..ChatOptions::default() };
        let prompt = self.model.template.render(messages, &opts)?;
        let ids = self.model.tokenizer.encode(&prompt, false)?;
        let mut sampling = self.model.sampling.clone();
        if let Some(t) = self.args.temperature {
            sampling.temperature = t;
        }
        if let Some(p) = self.args.top_p {
            sampling.top_p = p;
        }
        if let Some(k) = self.args.top_k {
            sampling.top_k = k;
        }
        sampling.seed = self.args.seed;
        let req = Request {
            prompt: ids,
            sampling,
            max_tokens: self.args.max_tokens,
            stop_strings: vec![],
            stop_ids: self.model.stop_ids.clone(),
            logprobs: None,
            constraint: None,
            min_tokens: 0,
            images: Vec::new(),
        };
        let rx = self.engine.submit(req)?;
        let mut parser = OutputParser::new(&[], self.thinking);
        let mut ans =
            Answer { reasoning: String::new(), content: String::new(), tool_calls: vec![], tokens: 0, seconds: 0.0 };
        let dim = std::io::stderr().is_terminal();
        let mut call: Option<(String, String)> = None;
        let mut show = |events: Vec<ParseEvent>, ans: &mut Answer| -> Result<()> {
            for ev in events {
                match ev {
                    ParseEvent::Reasoning(t) => {
                        if dim {
                            write!(err, "\x1b[2m{t}\x1b[0m")?;
                        } else {
                            write!(err, "{t}")?;
                        }
                        err.flush()?;
                        ans.reasoning.push_str(&t);
                    }
                    ParseEvent::Content(t) => {
                        write!(out, "{t}")?;
                        out.flush()?;
                        ans.content.push_str(&t);
                    }
                    ParseEvent::ToolCallStart { name } => {
                        call = Some((name, String::new()));
                    }
                    ParseEvent::ToolCallArgs(a) => {
                        if let Some((_, args)) = &mut call {
                            args.push_str(&a);
                        }
                    }
                    ParseEvent::ToolCallEnd => {
                        if let Some((name, arguments)) = call.take() {
                            let call = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
                            writeln!(out, "[tool call] {call}")?;
                            ans.tool_calls.push(call);
                        }
                    }
                }
            }
            Ok(())
        };
        let mut t0 = None;
        for ev in rx {
            match ev {
                Event::Token { text, .. } => {
                    t0.get_or_insert_with(Instant::now);
                    ans.tokens += 1;
                    show(parser.feed(&text), &mut ans)?;
                }
                Event::Done { .. } => break,
                Event::Error(e) => bail!("generation failed: {e}"),
            }
        }
        show(parser.finish(), &mut ans)?;
        ans.seconds = t0.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
        Ok(ans)
    }
}

fn system_messages(args: &GenArgs) -> Vec<Value> {
    args.system.iter().map(|s| json!({"role": "system", "content": s})).collect()
}

pub fn run(args: RunArgs) -> Result<()> {
    let session = Session::new(args.gen)?;
    let mut messages = system_messages(&session.args);
    messages.push(json!({"role": "user", "content": args.prompt}));
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let ans = session.answer(&messages, &mut out, &mut err)?;
    writeln!(out)?;
    eprintln!("[{} tokens, {:.1} tokens/s]", ans.tokens, rate(&ans));
    Ok(())
}

fn rate(a: &Answer) -> f64 {
    if a.seconds > 0.0 && a.tokens > 1 {
        (a.tokens - 1) as f64 / a.seconds
    } else {
        0.0
    }
}

pub fn chat(args: GenArgs) -> Result<()> {
    let mut session = Session::new(args).context("loading the model")?;
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut messages = system_messages(&session.args);
    eprintln!(
        "tern chat: {} on {}. /reset clears the history, /think on|off, /exit quits.",
        session.model.name,
        session.model.backend.name()
    );
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            write!(out, "\n> ")?;
            out.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = system_messages(&session.args);
                writeln!(out, "[history cleared]")?;
                continue;
            }
            "/think on" | "/think off" => {
                session.thinking = line == "/think on";
                writeln!(out, "[thinking {}]", if session.thinking { "on" } else { "off" })?;
                continue;
            }
            l if l.starts_with('/') => {
                writeln!(out, "[unknown command {l}; try /reset, /think on|off, /exit]")?;
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": line}));
        let ans = match session.answer(&messages, &mut out, &mut err) {
            Ok(a) => a,
            Err(e) => {
                messages.pop();
                writeln!(out, "\n[error: {e:#}]")?;
                continue;
            }
        };
        writeln!(out)?;
        eprintln!("[{} tokens, {:.1} tokens/s]", ans.tokens, rate(&ans));
        let mut m = json!({"role": "assistant", "content": ans.content});
        if !ans.reasoning.is_empty() {
            m["reasoning_content"] = json!(ans.reasoning);
        }
        if !ans.tool_calls.is_empty() {
            m["tool_calls"] = json!(ans.tool_calls);
        }
        messages.push(m);
    }
    Ok(())
}
