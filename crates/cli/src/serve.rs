//! `quince serve`: the local server (OpenAI- and Anthropic-compatible routes) on one model,
//! through the same command surface as the app (`crates/server` over `crates/chat`).

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;

/// `quince serve` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model folder.
    #[arg(long)]
    model: PathBuf,
    /// The data folder (prompt cache, images received); default: a `quince-serve` folder in
    /// the system's temporary folder.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The address to listen on; other than loopback needs --allow-lan.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// The port (0: any free one, printed at start).
    #[arg(long, default_value_t = server::DEFAULT_PORT)]
    port: u16,
    /// The key every request must carry (default: a new random one, printed at start).
    #[arg(long, env = "QUINCE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Listen on an address other machines can reach.
    #[arg(long)]
    allow_lan: bool,
    /// The largest request body, MiB.
    #[arg(long, default_value_t = server::DEFAULT_MAX_BODY_BYTES >> 20)]
    max_body_mib: usize,
    /// Seconds a request may wait for room before it gets a 503.
    #[arg(long, default_value_t = server::DEFAULT_QUEUE_TIMEOUT.as_secs())]
    queue_timeout: u64,
    /// Neither resume from nor write prompt-cache checkpoints.
    #[arg(long)]
    no_prompt_cache: bool,
}

/// Runs `quince serve` until interrupted.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: &Args) -> anyhow::Result<()> {
    let data_dir =
        args.data_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("quince-serve"));
    let chat = chat::Chat::open(&data_dir)
        .await?
        .with_hf_cache(None)
        .with_checkpoints(!args.no_prompt_cache);
    let model = std::fs::canonicalize(&args.model)
        .with_context(|| format!("no model folder at {}", args.model.display()))?;
    chat.load_model(&model, |_| {}).await?;
    let generated = args.api_key.is_none();
    let key = args.api_key.clone().unwrap_or_else(server::new_api_key);
    let options = server::ServeOptions {
        host: args.host,
        port: args.port,
        allow_lan: args.allow_lan,
        max_body_bytes: args.max_body_mib << 20,
        queue_timeout: std::time::Duration::from_secs(args.queue_timeout),
        ..server::ServeOptions::new(key.clone())
    };
    let server = server::Server::start(chat.clone(), options).await?;
    // The first line is the address, for scripts that start the server on port 0.
    println!("{}", server.base_url());
    if generated {
        println!("API key: {key}");
    }
    eprintln!("serving {} at {} (Ctrl-C stops)", model.display(), server.base_url());
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = server.wait() => {}
    }
    chat.shutdown();
    Ok(())
}
