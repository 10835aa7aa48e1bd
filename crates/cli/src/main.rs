//! `quince`: the command-line front end of the Quince engine.
//!
//! - `quince generate`: one turn through the engine's turn API (text or token ids in, text and
//!   ids out; `--json` for scripts);
//! - `quince chat`: one turn of a named conversation in the app's store (`crates/chat`);
//! - `quince logits`: write a forward pass's logits to safetensors (full or incremental);
//! - `quince bench`, `bench-spec`, `bench-batch`, `bench-ops`: speed, side by side with the reference;
//! - `quince doctor`: the MLX build this process runs on, and a smoke computation;
//! - `quince untrained-model`, `quince pull`: the untrained test model, and downloads from
//!   Hugging Face.

mod bench;
mod converse;
mod demo;
mod doctor;
mod eval;
mod generate;
mod logits;
mod options;
mod pull;
mod serve;

use clap::{Parser, Subcommand};

/// Quince: local chat models on MLX.
#[derive(Debug, Parser)]
#[command(name = "quince", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a reply to a prompt.
    Generate(generate::GenerateArgs),
    /// One turn of a named conversation, resuming from its KV checkpoints (same store as the app).
    Chat(converse::ChatArgs),
    /// Write the logits of a forward pass over token ids to a safetensors file.
    Logits(logits::LogitsArgs),
    /// Measure TTFT, prefill and decode speed on a synthetic prompt.
    Bench(bench::BenchArgs),
    /// Print the MLX version, backend, devices and memory, and run a tiny matmul + attention.
    Doctor(doctor::Args),
    /// Write the untrained demo model (a tiny Gemma 4 with vision, random weights, the same
    /// bytes every time) paired with a real tokenizer: what the tests chat with.
    UntrainedModel(demo::DemoArgs),
    /// Per-op overhead of this binding vs Python `mlx`, printed side by side.
    BenchOps(bench::ops::Args),
    /// Speculative decoding's costs and gains: verify windows vs a decode step, 0% acceptance,
    /// the model drafting for itself.
    BenchSpec(bench::spec::Args),
    /// Continuous batching's throughput at 1, 2, 4, 8 concurrent streams, beside mlx-lm's
    /// BatchGenerator.
    BenchBatch(bench::batch::Args),
    /// Download a model from Hugging Face into the shared cache (resumes what is on disk).
    Pull(pull::Args),
    /// Perplexity on a text, and each draft method's acceptance on prompts from it.
    Eval(eval::EvalArgs),
    /// The local server: OpenAI- and Anthropic-compatible routes on one model.
    Serve(serve::Args),
}

/// The MLX environment settings Quince applied itself (dropped again for the reference's
/// process in `bench --compare`, which runs MLX as shipped).
static MLX_SETTINGS: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();

fn main() -> anyhow::Result<()> {
    // Log lines (a discarded checkpoint, an eviction, timings at `debug`) go to stderr;
    // `QUINCE_LOG` filters them as `RUST_LOG` would (default: warnings).
    let filter = tracing_subscriber::EnvFilter::try_from_env("QUINCE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let _ = MLX_SETTINGS.set(engine::configure_mlx()?);
    match Cli::parse().command {
        Command::Generate(args) => generate::run(&args),
        Command::Chat(args) => converse::run(&args),
        Command::Logits(args) => logits::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Doctor(args) => doctor::run(&args),
        Command::UntrainedModel(args) => demo::run(&args),
        Command::BenchOps(args) => bench::ops::run(&args),
        Command::BenchSpec(args) => bench::spec::run(&args),
        Command::BenchBatch(args) => bench::batch::run(&args),
        Command::Pull(args) => pull::run(&args),
        Command::Eval(args) => eval::run(&args),
        Command::Serve(args) => serve::run(&args),
    }
}
