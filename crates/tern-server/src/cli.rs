//! `tern serve`: arguments and entry point.

use std::path::PathBuf;

use anyhow::Result;

use crate::ServeOptions;

/// Serve a model over an OpenAI-compatible HTTP API.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory (config.json, safetensors, tokenizer, chat template).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on (loopback by default; 0.0.0.0 to expose).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the "listening on" line says which).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (also read from TERN_API_KEY).
    #[arg(long, env = "TERN_API_KEY")]
    pub api_key: Option<String>,
    /// Context length per sequence (prompt + completion).
    #[arg(long, default_value_t = 32768)]
    pub ctx_size: usize,
    /// Sequences decoded at once.
    #[arg(long, default_value_t = 8)]
    pub max_concurrent: usize,
    /// Requests waiting beyond the running ones before the server answers 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
}

/// Start a runtime, listen at once, load the model in the background (/health answers 503 until it is
/// ready), serve until SIGINT/SIGTERM and drain.
pub fn main(args: Args) -> Result<()> {
    let opts = ServeOptions {
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        ctx_size: args.ctx_size,
        max_concurrent: args.max_concurrent,
        max_queue: args.max_queue,
        ..ServeOptions::default()
    };
    let model = args.model;
    tokio::runtime::Runtime::new()?.block_on(async move {
        let listener = crate::bind(&opts).await?;
        crate::run(listener, move || tern_engine::Model::load_cpu(&model), opts, crate::shutdown_signal()).await
    })
}
