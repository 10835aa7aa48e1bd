//! `quince chat`: one turn of a named conversation, through the same store and KV-checkpoint
//! policy as the app (`crates/chat`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use chat::view::{Settings, StreamEvent};
use serde_json::json;

/// `quince chat` arguments.
#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// The app data folder (database, attachments, checkpoints); made when missing.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// The conversation's name: continued when it exists, started otherwise.
    #[arg(long)]
    pub conversation: String,
    /// The model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// The user's message (rendered with the chat template).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    pub prompt: Option<String>,
    /// Token ids appended verbatim after the previous reply's (no template, no tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Generate past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON line with the reply and its statistics instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Neither resume from nor write KV checkpoints (a cold re-prefill every turn).
    #[arg(long)]
    pub no_checkpoints: bool,
}

/// Runs `quince chat`.
pub fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    runtime.block_on(turn(args))
}

async fn turn(args: &ChatArgs) -> anyhow::Result<()> {
    let chat = chat::Chat::open(&args.data_dir)
        .await?
        .with_hf_cache(None)
        .with_checkpoints(!args.no_checkpoints);
    let model = std::fs::canonicalize(&args.model)
        .with_context(|| format!("no model folder at {}", args.model.display()))?;
    chat.load_model(&model, |_| {}).await?;
    let existing =
        chat.conversations(None).await?.into_iter().find(|c| c.title == args.conversation);
    let id = match existing {
        Some(c) => c.id,
        None => {
            let c = chat.create_conversation().await?;
            chat.store().rename_conversation(c.id, &args.conversation).await?;
            c.id
        }
    };
    let settings = Settings {
        temperature: args.temperature,
        max_tokens: args.max_tokens,
        top_p: 1.0,
        top_k: 0,
        ..Settings::default()
    };
    chat.set_settings(id, &settings).await?;
    chat.set_raw_options(id, args.tokens.is_some(), args.ignore_eos).await?;
    let json_out = args.json;
    let mut out = std::io::stdout().lock();
    let on_event = |event: StreamEvent| {
        if let StreamEvent::Text { text } = event
            && !json_out
        {
            let _ = write!(std::io::stdout(), "{text}");
            let _ = std::io::stdout().flush();
        }
    };
    let reply = match (&args.tokens, &args.prompt) {
        (Some(ids), _) => chat.send_tokens(id, ids, on_event).await?,
        (None, Some(text)) => chat.send(id, text, &[], on_event).await?,
        (None, None) => anyhow::bail!("give --prompt or --tokens"),
    };
    let stored = chat.store().message(reply.id).await?.stats.unwrap_or_default();
    let stats = reply.stats.clone().context("the reply has no statistics")?;
    let checkpoint = chat.checkpoint_file(reply.id).await?.filter(|f| f.is_file());
    let checkpoint = checkpoint.map(|f| f.display().to_string());
    if json_out {
        let line = json!({
            "token_ids": stored.get("token_ids").cloned().unwrap_or_default(),
            "text": if args.tokens.is_some() { String::new() } else { reply.content.clone() },
            "stop_reason": stats.stop_reason,
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "ttft_ms": stats.ttft_ms,
            "prefill_tok_s": stored.get("prefill_tok_s").cloned().unwrap_or_default(),
            "restore_ms": stored.get("restore_ms").cloned().unwrap_or_default(),
            "decode_tok_s": stats.decode_tok_s,
            "peak_mem_bytes": stats.peak_mem_bytes,
            "reused_tokens": stats.reused_tokens,
            "prefilled_tokens": stats.prompt_tokens - stats.reused_tokens,
            "checkpoint": checkpoint,
        });
        writeln!(out, "{line}")?;
    } else {
        writeln!(out)?;
        eprintln!(
            "{} tokens ({}) · TTFT {:.1} ms · {} reused + {} prefilled prompt tokens · checkpoint {}",
            stats.generated_tokens,
            stats.stop_reason.as_str(),
            stats.ttft_ms,
            stats.reused_tokens,
            stats.prompt_tokens - stats.reused_tokens,
            checkpoint.as_deref().unwrap_or("none")
        );
    }
    // The model is freed on the engine thread before the process exits.
    chat.shutdown();
    Ok(())
}
