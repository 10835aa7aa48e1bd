//! `quince bench-batch`: continuous batching's throughput at 1, 2, 4, 8… concurrent streams,
//! beside mlx-lm's `BatchGenerator` on the same checkpoint and prompts in the same run
//! (`--compare`, through `tests/bench/mlx_lm_batch.py`).
//!
//! Each stream has its own synthetic prompt (the `bench` formula shifted per stream) and
//! decodes `--gen-tokens` greedy tokens; every stream starts at once. Per stream count:
//! aggregate decode tok/s (the tokens after each stream's first over the time from the first
//! token of the last stream to join until the last stream ends), and the p50/p99 time of one
//! decode step (what each stream waits per token), and the time until every stream has its
//! first token (the streams' prefills: one after another, or with `--together` as one padded
//! cohort, `Batch::join_together`). Medians over `--repeats` runs after a
//! warm-up at the largest count. With `--compare`, whether the greedy tokens of every stream
//! equal mlx-lm's. With `--lookup` every stream drafts by prompt lookup, with `--draft DIR` by
//! a draft model (each stream on caches of its own, the weights shared), and the streams
//! verify their drafts together (`Batch::join_drafting`), with the share of drafts kept; each
//! run is then paired with a plain run of the same streams (run after run, in the same
//! invocation), reported beside it with the ratio, and the tokens must be the same. mlx-lm's
//! `BatchGenerator` does not speculate, so beside it the same tokens must come faster. With
//! `--text FILE` the streams' prompts are consecutive `--prompt-tokens` slices of the file's
//! text as the model's tokenizer reads it, instead of synthetic ids (real text repeats itself,
//! as prompt lookup needs).

use std::time::Instant;

use anyhow::{Context, bail};
use engine::batch::{Batch, BatchEvent, StepTimes, VerifyHead};
use engine::generate::GenerateRequest;
use engine::models::Model;
use engine::speculative::draft_model::DraftModel;
use engine::speculative::lookup::PromptLookup;
use engine::speculative::{DraftLength, DraftMethod};
use serde_json::{Value, json};

use crate::options::LoadArgs;

/// Arguments of `quince bench-batch`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model directory.
    #[arg(long)]
    model: std::path::PathBuf,
    /// Prompt tokens per stream.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens each stream decodes.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Concurrent stream counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    streams: Vec<usize>,
    /// Timed runs per count; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Run mlx-lm's BatchGenerator on the same workload, in its own process, and print both.
    #[arg(long)]
    compare: bool,
    /// Python with mlx-lm installed, for --compare (default: .venv/bin/python, else python3).
    #[arg(long)]
    python: Option<std::path::PathBuf>,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
    /// Every stream drafts by prompt lookup; the streams verify their drafts together.
    #[arg(long, conflicts_with = "draft")]
    lookup: bool,
    /// With --lookup: the shortest n-gram a draft is looked up by (the default is prompt
    /// lookup's own).
    #[arg(long, requires = "lookup")]
    min_ngram: Option<usize>,
    /// The most tokens a stream drafts in one round (adapted between 1 and this).
    #[arg(long, default_value_t = DraftLength::default().max)]
    num_draft: usize,
    /// Every stream drafts with the draft model in this directory (same tokenizer); the
    /// streams verify their drafts together.
    #[arg(long)]
    draft: Option<std::path::PathBuf>,
    /// The streams join at once and prefill as one padded cohort (where the model's state
    /// pads), instead of one after another.
    #[arg(long, conflicts_with_all = ["draft", "lookup"])]
    together: bool,
    /// Verify every step a stream drafts in, even where rounds cost more than they emit (the
    /// app's batches run rounds only while they pay: `Batch::gating_rounds`).
    #[arg(long)]
    no_gate: bool,
    /// Print every step's time on stderr as it ends (to see where a slow run spends it).
    #[arg(long)]
    verbose: bool,
    /// The streams' prompts: consecutive `--prompt-tokens` slices of this file's text, read by
    /// the model's tokenizer (its BOS first), instead of synthetic ids.
    #[arg(long, conflicts_with = "compare")]
    text: Option<std::path::PathBuf>,
    /// How verify rounds read the output head (default: as the backend favours, by position
    /// on the CPU, the whole window elsewhere; for A/B runs).
    #[arg(long, value_enum)]
    verify_head: Option<VerifyHeadArg>,
    #[command(flatten)]
    load: LoadArgs,
}

/// `--verify-head`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum VerifyHeadArg {
    Window,
    ByPosition,
}

/// Stream `s`'s prompt: `bench`'s synthetic formula shifted by `101·s` (kept in step with
/// `tests/bench/mlx_lm_batch.py`).
fn stream_prompt(n: usize, vocab: u32, s: usize) -> Vec<u32> {
    let shift = 101 * s as u32;
    (0..n as u32).map(|i| 3 + (i * 7919 + 13 + shift) % (vocab - 3)).collect()
}

/// Every stream's prompt (`streams` of them): `--text`'s slices, or the synthetic ones.
fn prompts(model: &dyn Model, args: &Args, streams: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let Some(file) = &args.text else {
        let vocab = model.vocab_size() as u32;
        return Ok((0..streams).map(|s| stream_prompt(args.prompt_tokens, vocab, s)).collect());
    };
    let tokenizer = engine::tokenizer::Tokenizer::from_dir(&args.model)?
        .context("--text needs the model's tokenizer.json")?;
    let text = std::fs::read_to_string(file).with_context(|| file.display().to_string())?;
    let ids = tokenizer.encode(&text, true)?;
    let n = args.prompt_tokens;
    if ids.len() < n * streams {
        bail!("{} holds {} tokens, fewer than {streams} prompts of {n}", file.display(), ids.len());
    }
    Ok((0..streams).map(|s| ids[s * n..(s + 1) * n].to_vec()).collect())
}

/// One run at `streams` concurrent streams.
struct Run {
    decode_tok_s: f64,
    /// From the first join until every stream has its first token.
    first_tokens_ms: f64,
    step_ms: Vec<f64>,
    /// Where each step's time went, as the batch tells.
    times: Vec<StepTimes>,
    tokens: Vec<Vec<u32>>,
    /// Drafts proposed and kept (`--lookup`, `--draft`).
    drafts: (usize, usize),
}

/// One part of a step's time ([`StepTimes`]).
type Part = fn(&StepTimes) -> f64;

/// A step's parts, by name, as the batch reports them.
const PARTS: [(&str, Part); 7] = [
    ("read", |t| t.read_ms),
    ("propose", |t| t.propose_ms),
    ("build", |t| t.build_ms),
    ("submit", |t| t.submit_ms),
    ("pick", |t| t.pick_ms),
    ("settle", |t| t.settle_ms),
    ("total", |t| t.total_ms),
];

/// The medians of `times`' parts over the steps that are rounds (`round`) or not, with their
/// count; `None` when there is none.
fn median_parts(times: &[StepTimes], round: bool) -> Option<(usize, Value)> {
    let of: Vec<&StepTimes> = times.iter().filter(|t| t.round == round).collect();
    if of.is_empty() {
        return None;
    }
    let mut parts = serde_json::Map::new();
    for (name, part) in PARTS {
        let mut values: Vec<f64> = of.iter().map(|t| part(t)).collect();
        parts.insert(name.into(), json!(percentile(&mut values, 0.5)));
    }
    Some((of.len(), Value::Object(parts)))
}

/// `part` of each of [`PARTS`], on one line.
fn parts_line(part: impl Fn(&str, Part) -> f64) -> String {
    PARTS
        .iter()
        .map(|&(name, of)| format!("{name} {:.2}", part(name, of)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `drafter`: what every stream drafts with (each a fork of it), or `None` to decode plainly.
fn run_once(
    model: &dyn Model,
    drafter: Option<&dyn DraftMethod>,
    args: &Args,
    prompts: &[Vec<u32>],
) -> anyhow::Result<Run> {
    let streams = prompts.len();
    let batch = match args.verify_head {
        None => Batch::new(model),
        Some(VerifyHeadArg::Window) => Batch::with_verify_head(model, VerifyHead::Window),
        Some(VerifyHeadArg::ByPosition) => Batch::with_verify_head(model, VerifyHead::ByPosition),
    };
    let mut batch = batch.gating_rounds(!args.no_gate);
    let mut tokens = vec![Vec::new(); streams];
    let mut drafts = (0, 0);
    let mut record = |events: Vec<BatchEvent>, tokens: &mut Vec<Vec<u32>>| {
        for event in events {
            match event {
                BatchEvent::Token { id, token } => tokens[id as usize].push(token),
                BatchEvent::Finished(finished) => {
                    if let Some(spec) = finished.spec {
                        drafts.0 += spec.proposed;
                        drafts.1 += spec.accepted;
                    }
                }
            }
        }
    };
    let joining = Instant::now();
    let mut arriving = Vec::with_capacity(streams);
    for (s, prompt) in prompts.iter().enumerate() {
        let request = GenerateRequest::new(prompt.clone(), args.gen_tokens);
        let (id, caches) = (s as u64, model.fresh_caches()?);
        if args.together {
            arriving.push((id, caches, request));
            continue;
        }
        let events = match drafter {
            Some(drafter) => {
                let fork = drafter.fork();
                let length = DraftLength { max: args.num_draft, ..DraftLength::default() };
                batch.join_drafting(id, caches, &request, &[], fork, length)?
            }
            None => batch.join(id, caches, &request)?,
        };
        record(events, &mut tokens);
    }
    for events in batch.join_together(arriving) {
        record(events?, &mut tokens);
    }
    let mut first_tokens_ms = None;
    let mut start = Instant::now();
    let mut step_ms = Vec::new();
    let mut times = Vec::new();
    while !batch.is_empty() {
        if first_tokens_ms.is_none() && tokens.iter().all(|t| !t.is_empty()) {
            // Decoding is timed from here: every stream has its first token.
            start = Instant::now();
            first_tokens_ms = Some((start - joining).as_secs_f64() * 1e3);
        }
        let step = Instant::now();
        let events = batch.step()?;
        step_ms.push(step.elapsed().as_secs_f64() * 1e3);
        let parts = batch.last_step_times();
        times.push(parts);
        if args.verbose {
            let emitted = events.iter().filter(|e| matches!(e, BatchEvent::Token { .. })).count();
            eprintln!(
                "  step {}: {} rows, {emitted} tokens, {} ({})",
                step_ms.len(),
                batch.len(),
                if parts.round { "round" } else { "step" },
                parts_line(|_, of| of(&parts))
            );
        }
        record(events, &mut tokens);
    }
    let secs = start.elapsed().as_secs_f64();
    let decoded: usize = tokens.iter().map(|t| t.len().saturating_sub(1)).sum();
    Ok(Run {
        decode_tok_s: decoded as f64 / secs,
        first_tokens_ms: first_tokens_ms.unwrap_or_else(|| joining.elapsed().as_secs_f64() * 1e3),
        step_ms,
        times,
        tokens,
        drafts,
    })
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let at = ((values.len() - 1) as f64 * p).round() as usize;
    values[at]
}

/// `quince bench-batch`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens < 2 || args.repeats == 0 || args.num_draft == 0 {
        bail!(
            "--prompt-tokens, --repeats and --num-draft must be positive, --gen-tokens at least 2"
        );
    }
    if args.streams.is_empty() || args.streams.contains(&0) {
        bail!("--streams takes positive counts, e.g. 1,2,4,8");
    }
    let model = engine::registry::load_model(&args.model, &args.load.options())?;
    let drafter: Option<Box<dyn DraftMethod>> = match &args.draft {
        Some(dir) => {
            DraftModel::check_same_tokenizer(&args.model, dir)?;
            let loaded = engine::registry::load_model(dir, &args.load.options())?;
            Some(Box::new(DraftModel::new(loaded)))
        }
        None if args.lookup => {
            let default = PromptLookup::default();
            let min_ngram = args.min_ngram.unwrap_or(default.min_ngram);
            let max_ngram = default.max_ngram.max(min_ngram);
            Some(Box::new(PromptLookup { min_ngram, max_ngram, ..default }))
        }
        None => None,
    };
    let drafter = drafter.as_deref();
    let most = args.streams.iter().copied().max().unwrap_or(1);
    let all_prompts = prompts(model.as_ref(), args, most)?;
    // Warm-up at every stream count: builds the kernels of every shape (on CUDA, kernels
    // compiled on first use per row count take seconds each).
    for &streams in &args.streams {
        let began = Instant::now();
        run_once(model.as_ref(), drafter, args, &all_prompts[..streams])?;
        if drafter.is_some() {
            run_once(model.as_ref(), None, args, &all_prompts[..streams])?;
        }
        eprintln!("warm-up at {streams} streams: {:.1} s", began.elapsed().as_secs_f64());
    }
    let mut rows = Vec::new();
    for &streams in &args.streams {
        let prompts = &all_prompts[..streams];
        let mut rates = Vec::new();
        let mut plain_rates = Vec::new();
        let mut firsts = Vec::new();
        let mut steps = Vec::new();
        let mut times = Vec::new();
        let mut plain_times = Vec::new();
        let mut tokens = Vec::new();
        let mut drafts = (0, 0);
        for _ in 0..args.repeats {
            if drafter.is_some() {
                // The plain run of the same streams, paired with the drafting one.
                let plain = run_once(model.as_ref(), None, args, prompts)?;
                eprintln!("{streams} streams plain: {:.1} tok/s", plain.decode_tok_s);
                plain_rates.push(plain.decode_tok_s);
                plain_times.extend(plain.times);
                tokens = plain.tokens;
            }
            let began = Instant::now();
            let run = run_once(model.as_ref(), drafter, args, prompts)?;
            if drafter.is_some() && run.tokens != tokens {
                let same = run.tokens.iter().zip(&tokens).filter(|(a, b)| a == b).count();
                // On the CPU a verify window's arithmetic is a decode step's, row for row. GPU
                // kernels differ with the row count, so a near tie may flip there: said, not
                // refused.
                if mlx::Backend::current().name() == "cpu" {
                    bail!(
                        "at {streams} streams the drafting streams' tokens differ from plain ones"
                    );
                }
                eprintln!(
                    "at {streams} streams {same} of {} streams' tokens equal the plain run's \
                     ({} kernels differ between a verify window and a step)",
                    tokens.len(),
                    mlx::Backend::current().name()
                );
            }
            eprintln!(
                "{streams} streams: {:.1} tok/s, first tokens {:.1} ms, {} steps, {:.1} s",
                run.decode_tok_s,
                run.first_tokens_ms,
                run.step_ms.len(),
                began.elapsed().as_secs_f64()
            );
            rates.push(run.decode_tok_s);
            firsts.push(run.first_tokens_ms);
            steps.extend(run.step_ms);
            times.extend(run.times);
            tokens = run.tokens;
            drafts = (drafts.0 + run.drafts.0, drafts.1 + run.drafts.1);
        }
        let mut row = json!({
            "streams": streams,
            "decode_tok_s": percentile(&mut rates, 0.5),
            "step_ms_p50": percentile(&mut steps, 0.5),
            "step_ms_p99": percentile(&mut steps, 0.99),
            "first_tokens_ms": percentile(&mut firsts, 0.5),
            "tokens": tokens,
        });
        if drafter.is_some() {
            row["drafts_proposed"] = json!(drafts.0 / args.repeats);
            row["drafts_accepted"] = json!(drafts.1 / args.repeats);
            row["plain_decode_tok_s"] = json!(percentile(&mut plain_rates, 0.5));
        }
        // Where the time goes: the rounds, the drafting run's other steps, the plain run's (a
        // run without a drafter: its steps).
        let parts: Vec<(&str, &[StepTimes], bool)> = match drafter {
            Some(_) => vec![
                ("rounds", &times, true),
                ("steps_between_rounds", &times, false),
                ("plain_steps", &plain_times, false),
            ],
            None => vec![("steps", &times, false)],
        };
        for (key, times, round) in parts {
            if let Some((count, parts)) = median_parts(times, round) {
                eprintln!(
                    "{streams} streams, {count} {key}, median ms: {}",
                    parts_line(|name, _| parts[name].as_f64().unwrap_or(0.0))
                );
                row[key] = json!({ "count": count, "median_ms": parts });
            }
        }
        rows.push(row);
    }
    let reference = if args.compare { Some(reference(args)?) } else { None };
    print_table(&rows, reference.as_ref());
    if args.json {
        let strip = |rows: &[Value]| -> Vec<Value> {
            rows.iter()
                .map(|r| {
                    let mut r = r.clone();
                    r.as_object_mut().map(|o| o.remove("tokens"));
                    r
                })
                .collect()
        };
        let mut out = json!({ "quince": strip(&rows) });
        if let Some(reference) = &reference {
            out["mlx_lm"] = Value::Array(strip(reference_rows(reference)));
            out["tokens_match"] = json!(tokens_match(&rows, reference));
        }
        println!("{out}");
    }
    Ok(())
}

fn reference_rows(reference: &Value) -> &[Value] {
    reference["rows"].as_array().map(Vec::as_slice).unwrap_or_default()
}

/// Whether every stream's greedy tokens equal mlx-lm's, at every count both measured.
fn tokens_match(rows: &[Value], reference: &Value) -> bool {
    rows.iter().all(|row| {
        reference_rows(reference)
            .iter()
            .find(|r| r["streams"] == row["streams"])
            .is_some_and(|r| r["tokens"] == row["tokens"])
    })
}

fn reference(args: &Args) -> anyhow::Result<Value> {
    let python = args.python.clone().unwrap_or_else(super::ops::default_python);
    let streams: Vec<String> = args.streams.iter().map(usize::to_string).collect();
    let mut command = std::process::Command::new(&python);
    for var in crate::MLX_SETTINGS.get().into_iter().flatten() {
        command.env_remove(var);
    }
    let output = command
        .arg("tests/bench/mlx_lm_batch.py")
        .arg("--model")
        .arg(&args.model)
        .args(["--prompt-tokens", &args.prompt_tokens.to_string()])
        .args(["--gen-tokens", &args.gen_tokens.to_string()])
        .args(["--streams", &streams.join(",")])
        .args(["--repeats", &args.repeats.to_string()])
        .output()
        .with_context(|| format!("running {} tests/bench/mlx_lm_batch.py", python.display()))?;
    if !output.status.success() {
        bail!("mlx-lm's batch benchmark failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .context("parsing mlx-lm's batch benchmark JSON")
}

fn print_table(rows: &[Value], reference: Option<&Value>) {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    println!("streams  decode tok/s  step p50 ms  step p99 ms  first tokens ms   (quince)");
    for row in rows {
        print!(
            "{:>7}  {:>12.1}  {:>11.2}  {:>11.2}  {:>15.1}",
            row["streams"],
            f(&row["decode_tok_s"]),
            f(&row["step_ms_p50"]),
            f(&row["step_ms_p99"]),
            f(&row["first_tokens_ms"])
        );
        if let Some(proposed) = row["drafts_proposed"].as_u64() {
            let accepted = row["drafts_accepted"].as_u64().unwrap_or(0);
            let plain = f(&row["plain_decode_tok_s"]);
            let ratio = f(&row["decode_tok_s"]) / plain.max(f64::MIN_POSITIVE);
            print!(
                "   drafts kept {accepted:>4}/{proposed:<4}  plain {plain:>8.1} tok/s  {ratio:.2}×"
            );
        }
        if let Some(r) = reference
            .and_then(|r| reference_rows(r).iter().find(|r| r["streams"] == row["streams"]))
        {
            print!(
                "   mlx-lm {:>8.1} tok/s  p50 {:>6.2}  p99 {:>6.2}  first {:>8.1}  ratio {:.2}×",
                f(&r["decode_tok_s"]),
                f(&r["step_ms_p50"]),
                f(&r["step_ms_p99"]),
                f(&r["first_tokens_ms"]),
                f(&row["decode_tok_s"]) / f(&r["decode_tok_s"]).max(f64::MIN_POSITIVE)
            );
        }
        println!();
    }
    if let Some(reference) = reference {
        println!("greedy tokens equal mlx-lm's: {}", tokens_match(rows, reference));
    }
}
