//! `quince`: the command-line front end of the Quince engine.
//!
//! - `quince generate`: stream a reply (token ids in, ids and text out; `--json` for scripts);
//! - `quince logits`: write a forward pass's logits to safetensors (full or incremental);
//! - `quince bench`: prefill and decode speed on a synthetic prompt;
//! - `quince doctor`: the MLX build this process runs on, and a smoke computation;
//! - `quince bench-ops`: per-op overhead of our binding vs Python `mlx`, side by side.

mod bench_ops;
mod bench_spec;
mod converse;
mod doctor;
mod host_profile;
mod pull;
mod run;

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
    Generate(run::GenerateArgs),
    /// One turn of a named conversation, resuming from its KV checkpoints (same store as the app).
    Chat(converse::ChatArgs),
    /// Write the logits of a forward pass over token ids to a safetensors file.
    Logits(run::LogitsArgs),
    /// Measure TTFT, prefill and decode speed on a synthetic prompt.
    Bench(run::BenchArgs),
    /// Print the MLX version, backend, devices and memory, and run a tiny matmul + attention.
    Doctor(doctor::Args),
    /// Write the demo model (tiny, untrained Gemma 4 with vision) paired with a real tokenizer.
    DemoModel(run::DemoArgs),
    /// Per-op overhead of this binding vs Python `mlx`, printed side by side.
    BenchOps(bench_ops::Args),
    /// Speculative decoding's costs and gains: verify windows vs a decode step, 0% acceptance,
    /// the model drafting for itself.
    BenchSpec(bench_spec::Args),
    /// Download a model from Hugging Face into the shared cache (resumes what is on disk).
    Pull(pull::Args),
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
        Command::Generate(args) => run::generate(&args),
        Command::Chat(args) => converse::run(&args),
        Command::Logits(args) => run::logits(&args),
        Command::Bench(args) => run::bench(&args),
        Command::Doctor(args) => doctor::run(&args),
        Command::DemoModel(args) => run::demo_model(&args),
        Command::BenchOps(args) => bench_ops::run(&args),
        Command::BenchSpec(args) => bench_spec::run(&args),
        Command::Pull(args) => pull::run(&args),
    }
}
