//! `quince bench`: TTFT, prefill and decode speed on a synthetic prompt, with the reference
//! (mlx-lm, or mlx-vlm with an image) measured in the same invocation and printed beside it.
//! The other benchmarks live here too: `bench-spec` ([`spec`]), `bench-ops` ([`ops`]).

pub(crate) mod batch;
pub(crate) mod gpu_clock;
pub(crate) mod host_profile;
pub(crate) mod ops;
mod quince;
mod reference;
pub(crate) mod spec;

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use serde_json::json;

use crate::options::{KvArgs, LoadArgs, Switch};

/// Arguments of `quince bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Synthetic prompt lengths, each measured on its own (e.g. `512,4096`).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub(crate) prompt_tokens: Vec<usize>,
    /// Tokens to decode.
    #[arg(long, default_value_t = 128)]
    pub(crate) gen_tokens: usize,
    /// Timed runs after a full-length warm-up; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub(crate) repeats: usize,
    /// Put this image before the prompt (TTFT then includes reading and encoding it).
    #[arg(long)]
    pub(crate) image: Option<PathBuf>,
    /// Soft-token budget for --image.
    #[arg(long, default_value_t = 280)]
    pub(crate) max_soft_tokens: usize,
    /// Also run the reference (mlx-lm; mlx-vlm with --image) on the same checkpoint and
    /// prompt, and print both side by side.
    #[arg(long)]
    pub(crate) compare: bool,
    /// Python with mlx-lm installed, for --compare (default: .venv/bin/python, else python3).
    #[arg(long)]
    pub(crate) python: Option<PathBuf>,
    /// The reference half of --compare.
    #[arg(long, default_value = "tests/bench/mlx_lm_generate.py")]
    pub(crate) reference_script: PathBuf,
    /// Memory bandwidth of the device in GB/s (H200: 4800): adds decode as a fraction of the
    /// roofline, the weights and the KV cache read once per token.
    #[arg(long)]
    pub(crate) bandwidth_gbs: Option<f64>,
    /// Sleep this many µs on the host after each streamed token but the first (a diagnostic:
    /// if decode slows by as much, the host is what bounds a step; if not, the GPU is).
    #[arg(long, default_value_t = 0)]
    pub(crate) host_delay_us: u64,
    /// Sample the host's stacks while the timed runs decode and write them, folded (one
    /// `thread;outer;…;inner count` line per stack), to this file. Needs a build with
    /// `--features host-profile`.
    #[arg(long)]
    pub(crate) host_profile: Option<PathBuf>,
    /// After the timed runs, decode `--gen-tokens` more steps without reading any token back
    /// and read the GPU's own clock before and after each step (CUDA only): `gpu_ms_per_step`
    /// between the two reads, `gpu_gap_ms` from one step's last read to the next one's first.
    /// Then as many steps read back as the single-thread loop reads them, placed on the host's
    /// clock (`timeline`): when the GPU starts and ends each step against its submission, and
    /// when the host has the token.
    #[arg(long)]
    pub(crate) gpu_clock: bool,
    /// Measure each of these KV storages (e.g. `full,affine8,affine4,turbo3`), each against
    /// the reference with the same storage where it has one, in one table; the group size,
    /// start and layers come from the `--kv-*` flags.
    #[arg(long, value_delimiter = ',')]
    pub(crate) kv_sweep: Vec<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) kv: KvArgs,
    #[command(flatten)]
    pub(crate) load: LoadArgs,
}

/// The prompt `quince bench` and its mlx-lm counterpart both use: fixed pseudo-random ids that
/// avoid the lowest (special) ids.
pub(crate) fn synthetic_prompt(n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 7919 + 13) % (vocab - 3)).collect()
}

/// The median of `v` (0 for none).
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `quince bench`.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    if args.prompt_tokens.is_empty() || args.prompt_tokens.contains(&0) || args.gen_tokens == 0 {
        bail!("--prompt-tokens and --gen-tokens must be positive");
    }
    let options = args.load.options();
    let model = engine::registry::load_model(&args.model, &options)
        .with_context(|| format!("loading the model at {}", args.model.display()))?;
    if !args.kv_sweep.is_empty() {
        return sweep(args, model);
    }
    let kv = args.kv.options()?;
    let weight_bytes = model.decode_weight_bytes();
    let mut ours = Vec::new();
    for &prompt_tokens in &args.prompt_tokens {
        ours.push(quince::run(model.as_ref(), args, prompt_tokens, &kv)?);
    }
    let compiled = model.decode_graphs().is_some_and(|g| g.stats().steps > 0);
    let census = quince::decode_census(model.as_ref())?;
    drop(model);
    // The reference runs in its own process on the same device: nothing of ours stays held.
    mlx::device::memory::clear_cache()?;
    let mut references = Vec::new();
    if args.compare {
        let Some(flags) = KvArgs::reference_flags(&kv) else {
            bail!("the reference has no {}: measure it with --kv-sweep", kv.describe());
        };
        for &prompt_tokens in &args.prompt_tokens {
            references.push(reference::run(args, prompt_tokens, &flags)?);
        }
    }
    // Decode as a fraction of what the bandwidth allows: the weights and the last step's KV.
    let roofline = |run: &serde_json::Value, kv_bytes: f64| -> serde_json::Value {
        match (args.bandwidth_gbs, run["decode_tok_s"].as_f64()) {
            (Some(gbs), Some(tok_s)) if weight_bytes > 0 => {
                json!(tok_s * (weight_bytes as f64 + kv_bytes) / (gbs * 1e9))
            }
            _ => serde_json::Value::Null,
        }
    };
    for (i, run) in ours.iter_mut().enumerate() {
        let kv = run["kv_bytes_per_token"].as_f64().unwrap_or(0.0);
        run["roofline"] = roofline(run, kv);
        if let Some(reference) = references.get_mut(i) {
            reference["roofline"] = roofline(reference, kv);
        }
    }
    let side = |runs: &[serde_json::Value]| -> serde_json::Value {
        let mut first = runs[0].clone();
        first["by_prompt"] = json!(runs);
        first
    };
    let mut out = std::io::stdout().lock();
    let backend = mlx::Backend::current().name();
    let k = options.kernels;
    let kernels = if k.custom { "quince" } else { "mlx" };
    let fusion = Switch::word(k.custom && k.fused_decode);
    let qmv = Switch::word(k.custom && k.quantized_matvec);
    if args.json {
        let line = if args.compare {
            json!({
                "backend": backend,
                "compiled_decode": compiled,
                "kernels": kernels,
                "decode_fusion": fusion,
                "quantized_kernel": qmv,
                "decode_weight_bytes": weight_bytes,
                "decode_ops": census,
                "quince": side(&ours),
                "reference": side(&references),
            })
        } else {
            // Without a reference, the one object is ours (its fields at the top level).
            let mut flat = side(&ours);
            flat["backend"] = json!(backend);
            flat["compiled_decode"] = json!(compiled);
            flat["kernels"] = json!(kernels);
            flat["decode_fusion"] = json!(fusion);
            flat["quantized_kernel"] = json!(qmv);
            flat["decode_weight_bytes"] = json!(weight_bytes);
            flat["decode_ops"] = json!(census);
            flat
        };
        writeln!(out, "{line}")?;
        return Ok(());
    }
    let reference_name = if args.image.is_some() { "mlx-vlm" } else { "mlx-lm" };
    writeln!(
        out,
        "{}{} · {} generated · {backend} · compiled decode {}{}",
        args.model.display(),
        if args.image.is_some() { " (image included)" } else { "" },
        args.gen_tokens,
        if compiled { "on" } else { "off" },
        if backend == "cuda" {
            format!(" · kernels {kernels} · fused kernels {fusion} · 4-bit kernel {qmv}")
        } else {
            String::new()
        },
    )?;
    if args.compare {
        writeln!(out, "{:<28} {:>12} {:>12} {:>9}", "", "quince", reference_name, "ratio")?;
    }
    for (i, run) in ours.iter().enumerate() {
        writeln!(out, "prompt {} tokens", run["prompt_tokens"])?;
        for (key, label, higher_better) in [
            ("ttft_ms", "  TTFT (ms)", false),
            ("prefill_tok_s", "  prefill (tok/s)", true),
            ("decode_tok_s", "  decode (tok/s)", true),
            ("peak_mem_bytes", "  peak memory (MiB)", false),
            ("roofline", "  decode / roofline", true),
            ("host_share", "  host time / decode step", false),
            ("host_ms_per_step", "  host ms per step", false),
            ("build_ms_per_step", "  of which graph building", false),
            ("wait_ms_per_step", "  ms per step waiting for tokens", false),
        ] {
            let scale = if key == "peak_mem_bytes" { 1.0 / f64::from(1 << 20) } else { 1.0 };
            let Some(a) = run[key].as_f64().map(|v| v * scale) else { continue };
            match references.get(i).and_then(|r| r[key].as_f64()).map(|v| v * scale) {
                Some(b) => {
                    let ratio = if higher_better { a / b } else { b / a };
                    writeln!(out, "{label:<28} {a:>12.3} {b:>12.3} {ratio:>8.2}x")?;
                }
                None => writeln!(out, "{label:<28} {a:>12.3}")?,
            }
        }
        if let Some(c) = run.get("gpu_clock") {
            writeln!(
                out,
                "  GPU clock, {} unread steps: {:.3} ms per step on the GPU, {:.3} ms GPU wait \
                 between steps, {:.3} ms per step wall",
                c["steps"],
                c["gpu_ms_per_step"].as_f64().unwrap_or(0.0),
                c["gpu_gap_ms"].as_f64().unwrap_or(0.0),
                c["wall_ms_per_step"].as_f64().unwrap_or(0.0)
            )?;
            if let Some(t) = c["timeline"].as_object() {
                let figures: Vec<String> = t
                    .iter()
                    .map(|(k, v)| format!("{k} {:.3}", v.as_f64().unwrap_or(0.0)))
                    .collect();
                writeln!(
                    out,
                    "  steps read back, ms (GPU clock on the host's): {}",
                    figures.join(", ")
                )?;
            }
        }
        if let Some(reference) = references.get(i) {
            writeln!(
                out,
                "  decode tok/s per run: quince {} · {reference_name} {}",
                run["decode_tok_s_runs"], reference["decode_tok_s_runs"]
            )?;
        }
    }
    let total: usize = census.values().sum();
    let mut by_count: Vec<_> = census.iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let top: Vec<String> = by_count.iter().take(12).map(|(k, v)| format!("{k} {v}")).collect();
    writeln!(out, "ops in one decode step: {total} ({})", top.join(", "))?;
    if args.compare {
        writeln!(out, "ratio > 1: quince is better · medians of {} runs", args.repeats)?;
    }
    Ok(())
}

/// `quince bench --kv-sweep`: every prompt length with every storage, Quince's decode speed,
/// peak memory and KV bytes beside the reference's with the same storage (where it has it and
/// can run it: mlx-lm quantizes only full-attention caches, and on KV-shared layers not even
/// those), in one table.
fn sweep(args: &BenchArgs, model: Box<dyn engine::models::Model>) -> anyhow::Result<()> {
    let storages = args
        .kv_sweep
        .iter()
        .map(|name| Ok((name.clone(), args.kv.named(name)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut rows = Vec::new();
    for &prompt_tokens in &args.prompt_tokens {
        for (name, kv) in &storages {
            // A storage that fails (the device runs out of memory, say) is a row of the table.
            let ours = quince::run(model.as_ref(), args, prompt_tokens, kv)
                .unwrap_or_else(|e| json!({ "error": format!("{e:#}") }));
            rows.push(json!({ "prompt_tokens": prompt_tokens, "kv": name,
                              "storage": kv.describe(), "quince": ours }));
            mlx::device::memory::clear_cache()?;
        }
    }
    drop(model);
    mlx::device::memory::clear_cache()?;
    if args.compare {
        for row in &mut rows {
            let name = row["kv"].as_str().unwrap_or_default().to_string();
            let kv = args.kv.named(&name)?;
            let prompt_tokens = row["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            row["reference"] = match KvArgs::reference_flags(&kv) {
                Some(flags) => reference::run(args, prompt_tokens, &flags)?,
                None => json!({ "error": "mlx-lm has no TurboQuant KV cache" }),
            };
        }
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", json!({ "backend": mlx::Backend::current().name(), "runs": rows }))?;
        return Ok(());
    }
    writeln!(
        out,
        "{} · {} generated · {} · medians of {} runs",
        args.model.display(),
        args.gen_tokens,
        mlx::Backend::current().name(),
        args.repeats
    )?;
    writeln!(
        out,
        "{:>7} {:<9} {:>12} {:>12} {:>7} {:>13} {:>13} {:>10}",
        "prompt",
        "KV",
        "quince tok/s",
        "mlx-lm tok/s",
        "ratio",
        "quince peak",
        "mlx-lm peak",
        "KV MiB"
    )?;
    let mib = |v: &serde_json::Value| v.as_f64().map(|b| b / f64::from(1 << 20));
    for row in &rows {
        let (q, r) = (&row["quince"], &row["reference"]);
        let tok_s = q["decode_tok_s"].as_f64().unwrap_or(0.0);
        let kv_mib = q["kv_bytes_per_token"].as_f64().unwrap_or(0.0) / f64::from(1 << 20);
        let (reference, ratio, peak) = match r["decode_tok_s"].as_f64() {
            Some(theirs) => (
                format!("{theirs:.1}"),
                format!("{:.2}x", tok_s / theirs),
                format!("{:.0}", mib(&r["peak_mem_bytes"]).unwrap_or(0.0)),
            ),
            None if args.compare => ("—".into(), "".into(), "—".into()),
            None => (String::new(), String::new(), String::new()),
        };
        writeln!(
            out,
            "{:>7} {:<9} {:>12.1} {:>12} {:>7} {:>13.0} {:>13} {:>10.2}",
            row["prompt_tokens"].as_u64().unwrap_or(0),
            row["kv"].as_str().unwrap_or_default(),
            tok_s,
            reference,
            ratio,
            mib(&q["peak_mem_bytes"]).unwrap_or(0.0),
            peak,
            kv_mib
        )?;
        if let Some(error) = q["error"].as_str() {
            writeln!(out, "        quince: {error}")?;
        }
        if let Some(error) = r["error"].as_str() {
            writeln!(out, "        mlx-lm: {error}")?;
        }
    }
    Ok(())
}
