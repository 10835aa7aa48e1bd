//! `quince bench-ops`: what one MLX op costs through this binding vs through Python `mlx`,
//! measured in one run on the same machine and the same libmlx.
//!
//! Three figures, each the median of `--repeats` runs:
//! - `add_eval_us`: one small `add` built and evaluated, 10,000 times, per op: binding +
//!   graph + scheduler + kernel launch, i.e. the cost a decode loop pays per synchronous op;
//! - `add_graph_us`: one small `add` built and dropped without evaluation, per op: the binding
//!   and graph-node cost alone;
//! - `chain_us`: a chain of 1,000 dependent `add`s built, then evaluated once, per op: the
//!   shape of a model's forward pass (many small ops, one eval);
//! - `matmul_ms`: one `n × n` f32 matmul evaluated, where the binding cost is noise next to
//!   the kernel (a check that both sides run the same kernel).
//!
//! The Python side is `tests/bench/ops_overhead.py`, run with `--python` (the project venv's
//! interpreter by default).

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use mlx::{Array, Dtype, ops};
use serde_json::{Value, json};

/// Arguments of `quince bench-ops`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Small ops per measurement.
    #[arg(long, default_value_t = 10_000)]
    ops: usize,
    /// Side of the square matmul.
    #[arg(long, default_value_t = 2048)]
    matmul_size: i32,
    /// Runs of each measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Python interpreter with `mlx` installed (default: .venv/bin/python if present, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The Python half of the benchmark.
    #[arg(long, default_value = "tests/bench/ops_overhead.py")]
    script: PathBuf,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs both sides and prints them side by side.
pub fn run(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.ops > 0 && args.repeats > 0, "--ops and --repeats must be positive");
    let ours = measure(args).context("measuring the Rust binding")?;
    let python = args.python.clone().unwrap_or_else(default_python);
    let output = Command::new(&python)
        .arg(&args.script)
        .args(["--ops", &args.ops.to_string()])
        .args(["--matmul-size", &args.matmul_size.to_string()])
        .args(["--repeats", &args.repeats.to_string()])
        .output()
        .with_context(|| format!("running {} {}", python.display(), args.script.display()))?;
    if !output.status.success() {
        bail!(
            "the Python benchmark failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let reference: Value = serde_json::from_str(last)
        .with_context(|| format!("parsing the Python result {last:?}"))?;

    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", json!({"quince": ours, "python_mlx": reference}))?;
        return Ok(());
    }
    writeln!(
        out,
        "MLX {} on {} · median of {} runs",
        mlx::device::version(),
        mlx::Backend::current().name(),
        args.repeats
    )?;
    writeln!(
        out,
        "{:<40} {:>14} {:>14} {:>10}",
        "measure", "quince (Rust)", "python mlx", "py/quince"
    )?;
    let rows = [
        ("add_eval_us", format!("add [4] + eval, per op (µs, {} ops)", args.ops)),
        ("add_graph_us", format!("add [4] graph only, per op (µs, {} ops)", args.ops)),
        ("chain_us", "1000-add chain, one eval, per op (µs)".to_string()),
        ("matmul_ms", format!("matmul {0}x{0} f32 + eval (ms)", args.matmul_size)),
    ];
    for (key, label) in rows {
        let a = ours[key].as_f64().unwrap_or(f64::NAN);
        let b = reference[key].as_f64().unwrap_or(f64::NAN);
        writeln!(out, "{label:<42} {a:>14.3} {b:>14.3} {:>9.2}x", b / a)?;
    }
    Ok(())
}

/// The project venv's interpreter when present, else `python3` (the GPU machine's).
pub fn default_python() -> PathBuf {
    let venv = PathBuf::from(".venv/bin/python");
    if venv.exists() { venv } else { PathBuf::from("python3") }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn measure(args: &Args) -> anyhow::Result<Value> {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4])?;
    let b = Array::from_slice(&[0.5f32, 0.5, 0.5, 0.5], &[4])?;
    a.eval()?;
    b.eval()?;

    // Warm up the allocator and the kernel path once.
    for _ in 0..100 {
        a.add(&b)?.eval()?;
    }

    let mut eval_runs = Vec::new();
    let mut graph_runs = Vec::new();
    for _ in 0..args.repeats {
        let start = Instant::now();
        for _ in 0..args.ops {
            a.add(&b)?.eval()?;
        }
        eval_runs.push(start.elapsed().as_secs_f64() * 1e6 / args.ops as f64);

        let start = Instant::now();
        for _ in 0..args.ops {
            drop(a.add(&b)?);
        }
        graph_runs.push(start.elapsed().as_secs_f64() * 1e6 / args.ops as f64);
    }

    let mut chain_runs = Vec::new();
    for _ in 0..args.repeats {
        let start = Instant::now();
        for _ in 0..10 {
            let mut x = a.clone();
            for _ in 0..1000 {
                x = x.add(&b)?;
            }
            x.eval()?;
        }
        chain_runs.push(start.elapsed().as_secs_f64() * 1e6 / 10_000.0);
    }

    let n = args.matmul_size;
    let key = mlx::random::key(0)?;
    let x = mlx::random::normal(&[n, n], Dtype::Float32, 0.0, 1.0, Some(&key))?;
    let y = ops::ones(&[n, n], Dtype::Float32)?;
    mlx::eval(&[&x, &y])?;
    x.matmul(&y)?.eval()?; // warm-up: library handles, kernel selection
    let mut matmul_runs = Vec::new();
    for _ in 0..args.repeats {
        let start = Instant::now();
        x.matmul(&y)?.eval()?;
        matmul_runs.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(json!({
        "add_eval_us": median(eval_runs),
        "add_graph_us": median(graph_runs),
        "chain_us": median(chain_runs),
        "matmul_ms": median(matmul_runs),
    }))
}
