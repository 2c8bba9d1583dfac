//! `tern serve`: arguments and entry point.

use anyhow::Result;

use crate::ServeOptions;

/// Serve a model over an OpenAI-compatible HTTP API.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model directory or Hugging Face id (default: the checkpoint tern is built for).
    #[arg(long, default_value = "mlx-community/Qwen3.6-35B-A3B-4bit")]
    pub model: String,
    /// cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    pub backend: String,
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

/// Start a runtime, listen at once, load the model in the background with `load(model, backend, ctx_size)`
/// (/health answers 503 until it is ready), serve until SIGINT/SIGTERM and drain.
pub fn main(
    args: Args,
    load: impl FnOnce(&str, &str, usize) -> Result<tern_engine::Model> + Send + 'static,
) -> Result<()> {
    let opts = ServeOptions {
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        ctx_size: args.ctx_size,
        max_concurrent: args.max_concurrent,
        max_queue: args.max_queue,
        ..ServeOptions::default()
    };
    let (model, backend, ctx) = (args.model, args.backend, args.ctx_size);
    tokio::runtime::Runtime::new()?.block_on(async move {
        let listener = crate::bind(&opts).await?;
        crate::run(listener, move || load(&model, &backend, ctx), opts, crate::shutdown_signal()).await
    })
}
