//! `tern serve`: arguments and entry point.

use std::time::Duration;

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
    /// Require `Authorization: Bearer KEY` on every route but /health (also read from TERN_API_KEY; an empty
    /// key is refused).
    #[arg(long, env = "TERN_API_KEY")]
    pub api_key: Option<String>,
    /// Serve /metrics without the API key.
    #[arg(long)]
    pub metrics_public: bool,
    /// Context length per sequence (prompt + completion).
    #[arg(long, default_value_t = 32768)]
    pub ctx_size: usize,
    /// Sequences decoded at once, at most (admission is also by free memory: a request that does not fit waits
    /// for running ones to finish). On CUDA each takes, from the state pool (--state-mib), 67 MB of recurrent
    /// state and 20 KB a token of KV cache for its prompt + max_tokens, in 2 MiB pages (the startup log says how
    /// many fit). 0 (the default): what one step of the backend takes, 256 on CUDA (one forward pass's
    /// sequences), 64 on the CPU.
    #[arg(long, default_value_t = 0)]
    pub max_concurrent: usize,
    /// MiB of GPU memory for sequence state on CUDA: one pool of pages holding the KV caches and recurrent states
    /// of the running sequences and of the prefix cache's snapshots. 0: what is free once the weights are up,
    /// less 8 GiB (the prefill and batch buffers, CUDA graphs and per-sequence step buffers).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 30))]
    pub state_mib: u64,
    /// Requests waiting beyond the running ones before the server answers 503 (0: none wait).
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Tokens one engine step reads, all sequences together (running decodes first, then prompt chunks): larger
    /// means a faster first token for long prompts, smaller means shorter pauses for running streams. 0: the
    /// backend's choice (512 on the CPU, the prefill chunk of 4,096 on CUDA).
    #[arg(long, default_value_t = 0)]
    pub step_tokens: usize,
    /// Speculative decoding: tokens the model's multi-token-prediction block drafts a step for every stream, all
    /// checked by one forward pass (greedy replies are unchanged; sampled ones keep the model's distribution). 0
    /// (the default): off. Up to 4; needs a checkpoint with `mtp.*` weights and a backend with a verify pass (the
    /// CPU backend today); otherwise the startup log says why it is off.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=4))]
    pub speculative: u64,
    /// MiB of sequence state the prefix cache keeps across requests (snapshots at the start of a turn and after
    /// each reply; on CUDA in the state pool beside the running sequences, on the CPU in RAM). 0 turns it off; at
    /// most 1,048,576 (1 TiB).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub prefix_cache_mib: u64,
    /// Larger request bodies get 413.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Open connections; past this a new connection gets a 503 and is closed.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a connection has to send a complete request head (from when it opens or its last response).
    #[arg(long, default_value = "10", value_parser = seconds)]
    pub header_timeout: Duration,
    /// Seconds a request body has to arrive whole (408 otherwise).
    #[arg(long, default_value = "60", value_parser = seconds)]
    pub body_timeout: Duration,
    /// Seconds a connection with no request in flight is kept open.
    #[arg(long, default_value = "5", value_parser = seconds)]
    pub keep_alive_timeout: Duration,
    /// Seconds running requests have to finish after SIGTERM/SIGINT before they are cut with a final chunk (a
    /// second signal exits at once); under the 30 s Kubernetes waits before its SIGKILL.
    #[arg(long, default_value = "25", value_parser = seconds)]
    pub shutdown_grace: Duration,
    /// Requests rendered and tokenised at once, on threads of their own (default: half the cores); as many again
    /// for bodies of 256 KiB or more, so that large requests never hold up small ones.
    #[arg(long)]
    pub tokenizer_threads: Option<usize>,
    /// Let web pages of these origins call the API (CORS): comma-separated `scheme://host[:port]`, or `*` for
    /// any. Off by default (a page of another origin cannot read the replies); the page at `/` needs none.
    #[arg(long, value_delimiter = ',')]
    pub cors: Vec<String>,
    /// Without --api-key, requests are served only when their Host header is localhost (or a name under
    /// .localhost), an IP address, --host, this machine's name, or one of these (comma-separated; .example.com: it
    /// and the names under it; * for any); others get 403, so that a web page cannot reach the server through a
    /// name of its own pointed at it (DNS rebinding). With --api-key there is no check.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Read control tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, ...) written in chat messages, tool results
    /// and tool definitions as those tokens, as transformers' chat template and vLLM do. By default they are text:
    /// only the chat template's own turn markers are control tokens, so no message can open a system turn.
    /// (/v1/completions reads them in its raw prompt either way.)
    #[arg(long)]
    pub allow_special_in_content: bool,
    /// Images one request may hold, all messages together (0: none). Images come inline as base64 PNG or JPEG
    /// (data: URLs, Anthropic base64 sources), or as http(s) URLs with --image-urls. Each image's tokens count
    /// against the context (about one per 32 × 32 pixels after the processor's resize).
    #[arg(long, default_value_t = crate::ImageLimits::default().max_images)]
    pub max_images: usize,
    /// Bytes of one image file, decoded from its base64 (the request body is also held to --max-body-bytes).
    #[arg(long, default_value_t = crate::ImageLimits::default().max_bytes)]
    pub max_image_bytes: usize,
    /// Pixels (width × height) of one image as sent, read from its header before it is decoded (a guard against
    /// decompression bombs: decoding takes 4 bytes a pixel and more).
    #[arg(long, default_value_t = crate::ImageLimits::default().max_pixels)]
    pub max_image_pixels: u64,
    /// Fetch http(s) image URLs (off: they are a 400 asking for a data: URL). Only public addresses are reached:
    /// every address of every host, redirects included, is checked, and private, loopback, link-local, multicast
    /// and other special addresses are refused; at most 3 redirects, --max-image-bytes per image, and
    /// --image-url-timeout for all of a request's fetches.
    #[arg(long)]
    pub image_urls: bool,
    /// Seconds all the image URLs of one request may take to fetch (with --image-urls), lookups, redirects and
    /// bodies included; the request holds a preparation slot meanwhile.
    #[arg(long, value_parser = seconds, default_value = "5")]
    pub image_url_timeout: Duration,
    /// Addresses image URLs may reach although they are not public (tests only: a server on loopback).
    #[arg(long, value_delimiter = ',', hide = true)]
    pub image_url_allow_address: Vec<std::net::IpAddr>,
}

/// A number of seconds (fractions allowed) as a duration.
fn seconds(s: &str) -> Result<Duration, String> {
    let x: f64 = s.parse().map_err(|_| format!("'{s}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(x).map_err(|_| format!("'{s}' is not a number of seconds from 0 up"))
}

/// What `serve` loads: the model (directory or Hugging Face id) on a backend.
#[derive(Clone, Debug)]
pub struct Load {
    pub model: String,
    /// cpu, cuda or auto.
    pub backend: String,
    /// Context of one sequence.
    pub ctx: usize,
    /// Bytes of the CUDA state pool (`None`: the backend's default).
    pub state: Option<usize>,
    /// Drafts a step for speculative decoding (0: off): the backend keeps the MTP block's state beside each
    /// sequence's.
    pub speculative: usize,
}

/// Start a runtime, listen at once, load the model in the background with `load` (/health answers 503 until it
/// is ready), serve until SIGINT/SIGTERM and shut down within the grace.
pub fn main(args: Args, load: impl FnOnce(&Load) -> Result<tern_engine::Model> + Send + 'static) -> Result<()> {
    let opts = ServeOptions {
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        metrics_public: args.metrics_public,
        ctx_size: args.ctx_size,
        max_concurrent: args.max_concurrent,
        max_queue: args.max_queue,
        step_tokens: args.step_tokens,
        speculative: args.speculative as usize,
        prefix_cache_bytes: usize::try_from(args.prefix_cache_mib << 20).unwrap_or(usize::MAX),
        max_body_bytes: args.max_body_bytes,
        max_connections: args.max_connections,
        header_timeout: args.header_timeout,
        body_timeout: args.body_timeout,
        keep_alive_timeout: args.keep_alive_timeout,
        shutdown_grace: args.shutdown_grace,
        tokenizer_threads: args.tokenizer_threads.unwrap_or_else(crate::default_tokenizer_threads),
        cors: args.cors.into_iter().map(|o| o.trim().to_owned()).filter(|o| !o.is_empty()).collect(),
        allowed_hosts: args.allowed_hosts.into_iter().map(|h| h.trim().to_owned()).filter(|h| !h.is_empty()).collect(),
        allow_special_in_content: args.allow_special_in_content,
        images: crate::ImageLimits {
            max_images: args.max_images,
            max_bytes: args.max_image_bytes,
            max_pixels: args.max_image_pixels,
            fetch: crate::ImageFetch {
                enabled: args.image_urls,
                timeout: args.image_url_timeout,
                allow_addresses: args.image_url_allow_address,
                ..crate::ImageFetch::default()
            },
        },
    };
    opts.check()?;
    let what = Load {
        model: args.model,
        backend: args.backend,
        ctx: args.ctx_size,
        state: (args.state_mib > 0).then(|| usize::try_from(args.state_mib << 20).unwrap_or(usize::MAX)),
        speculative: args.speculative as usize,
    };
    let rt = tokio::runtime::Runtime::new()?;
    let served = rt.block_on(async move {
        let listener = crate::bind(&opts).await?;
        crate::run(listener, move || load(&what), opts, crate::shutdown_signal()).await
    });
    // Do not wait for blocking work still going (a model still loading, a prompt still tokenising).
    rt.shutdown_background();
    served
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: super::Args,
    }

    #[test]
    fn image_url_flags() {
        let off = Cli::try_parse_from(["tern"]).unwrap().serve;
        assert!(!off.image_urls && off.image_url_allow_address.is_empty());
        assert_eq!(off.image_url_timeout, std::time::Duration::from_secs(5));
        let on = Cli::try_parse_from(["tern", "--image-urls", "--image-url-timeout", "2.5"]).unwrap().serve;
        assert!(on.image_urls);
        assert_eq!(on.image_url_timeout, std::time::Duration::from_millis(2500));
        let allow = Cli::try_parse_from(["tern", "--image-url-allow-address", "127.0.0.1,::1"]).unwrap().serve;
        assert_eq!(allow.image_url_allow_address.len(), 2);
        assert!(Cli::try_parse_from(["tern", "--image-url-allow-address", "localhost"]).is_err());
        assert!(Cli::try_parse_from(["tern", "--image-url-timeout", "-1"]).is_err());
    }
}
