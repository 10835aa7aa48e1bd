//! `quince`: the command-line front end of the Quince engine.
//!
//! Today: `quince doctor` (what MLX build this process runs on, and a tiny computation that
//! proves it works) and `quince bench-ops` (per-op overhead of our binding vs Python `mlx`,
//! side by side in one run). `generate`, `logits`, `bench` and `parity` arrive with the engine.

mod bench_ops;
mod doctor;

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
    /// Print the MLX version, backend, devices and memory, and run a tiny matmul + attention.
    Doctor(doctor::Args),
    /// Per-op overhead of this binding vs Python `mlx`, printed side by side.
    BenchOps(bench_ops::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Doctor(args) => doctor::run(&args),
        Command::BenchOps(args) => bench_ops::run(&args),
    }
}
