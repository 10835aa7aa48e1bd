//! `quince pull`: downloads a model repo into the Hugging Face cache through the same code as
//! the app (`hub::pull`), with a progress bar; resumes what is on disk; prints the snapshot
//! folder last.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use anyhow::Context;

/// `quince pull` arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The repo, e.g. `mlx-community/gemma-3-4b-it-4bit`.
    pub repo: String,
    /// Branch, tag or commit.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The hub (default: `HF_ENDPOINT`, else `https://huggingface.co`).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// The Hugging Face cache (default: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// A token for gated or private repos (default: `HF_TOKEN`).
    #[arg(long)]
    pub token: Option<String>,
}

/// Runs `quince pull`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let endpoint = args.endpoint.clone().unwrap_or_else(hub::endpoint_from_env);
    let cache = match &args.cache_dir {
        Some(dir) => dir.clone(),
        None => hub::cache::default_dir().context("no home folder for the Hugging Face cache")?,
    };
    let token = args.token.clone().or_else(|| std::env::var("HF_TOKEN").ok());
    let client = hub::Client::new(&endpoint, token)?;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:30!} [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        )?
        .progress_chars("=> "),
    );
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let never = AtomicBool::new(false);
    let snapshot =
        runtime.block_on(hub::pull(&client, &args.repo, &args.revision, &cache, &never, |p| {
            bar.set_length(p.total);
            bar.set_position(p.done);
            bar.set_message(format!("{} ({}/{})", p.file, p.files_done, p.files));
        }));
    bar.finish_and_clear();
    let snapshot = snapshot?;
    println!("{}", snapshot.display());
    Ok(())
}
