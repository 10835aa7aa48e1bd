//! `quince bench-spec`: what speculative decoding costs and gains on one checkpoint, in one run.
//!
//! - `verify_ratio_k`: a verify window of k tokens (round begun, window appended, its logits'
//!   argmax read, rolled back) over one decode step (one token appended, its argmax read), both
//!   over the same prompt, medians of `--repeats`; and a window of 4 that keeps one token per
//!   run, so that every run sees a new key length as a generation's rounds do;
//! - `zero_acceptance`: tok/s of speculative decoding with a method whose drafts are never the
//!   target's picks, over plain decoding (the overhead of speculating for nothing);
//! - `draft_equals_target`: tok/s with the model drafting for itself (every draft accepted: the
//!   upper bound of a draft model's gain, paid with the draft's own steps) over plain decoding;
//! - `drafter` (with `--drafter DIR`): tok/s with that drafter (a draft model, a Gemma 4
//!   assistant or a Qwen3.5 MTP head) over plain decoding, and what it got accepted; on random
//!   weights its drafts are almost never right, so this is its overhead.

use std::time::Instant;

use anyhow::bail;
use engine::batch::generate;
use engine::cache::Cache;
use engine::generate::{Flow, GenerateRequest};
use engine::models::{Model, Phase};
use engine::speculative::draft_model::DraftModel;
use engine::speculative::{DraftLength, DraftMethod, Target};
use serde_json::json;

use crate::bench::synthetic_prompt;
use crate::options::LoadArgs;

/// Arguments of `quince bench-spec`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model directory.
    #[arg(long)]
    model: std::path::PathBuf,
    /// Synthetic prompt length.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens to decode in the speed runs.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs per measurement; medians are reported.
    #[arg(long, default_value_t = 20)]
    repeats: usize,
    /// Drafts per round in the speed runs.
    #[arg(long, default_value_t = 4)]
    num_draft: usize,
    /// A drafter folder to time as well (its `model_type` picks the method).
    #[arg(long)]
    drafter: Option<std::path::PathBuf>,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    load: LoadArgs,
}

/// Drafts that are never the target's pick: the token after the bonus, each time (the target
/// repeating the previous token plus one is as unlikely on random weights as any).
#[derive(Debug)]
struct NeverRight;

impl DraftMethod for NeverRight {
    fn name(&self) -> &'static str {
        "never-right"
    }
    fn bind(&mut self, _: &dyn Model) -> engine::Result<()> {
        Ok(())
    }
    fn start(&mut self, _: Target<'_>, _: &[u32]) -> engine::Result<usize> {
        Ok(0)
    }
    fn propose(&mut self, t: Target<'_>, context: &[u32], max: usize) -> engine::Result<Vec<u32>> {
        let vocab = t.model.vocab_size() as u32;
        let last = context.last().copied().unwrap_or(0);
        Ok((1..=max as u32).map(|i| (last + i) % vocab).collect())
    }
    fn settle(&mut self, _: Target<'_>, _: usize) -> engine::Result<()> {
        Ok(())
    }
    fn fork(&self) -> Box<dyn DraftMethod> {
        Box::new(NeverRight)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of appending `length` tokens to caches holding the prompt and reading the argmax
/// of every row: a decode step for 1, a verify window otherwise; each run is then rolled back
/// to `keep` of its tokens (0: every run sees the same key length).
fn step_ms(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    length: usize,
    repeats: usize,
    keep: usize,
) -> anyhow::Result<f64> {
    let vocab = model.vocab_size() as u32;
    let mut times = Vec::new();
    for r in 0..repeats + 2 {
        let tokens: Vec<u32> =
            (0..length as u32).map(|i| (7 + 31 * (r as u32 + i)) % vocab).collect();
        let ids = engine::tokens::ids(&tokens)?;
        let phase = if length == 1 { Phase::Decode } else { Phase::Window };
        let start = Instant::now();
        // Inside a round, so that the rollback leaves the prompt alone for the next run.
        for cache in caches.iter_mut() {
            cache.spec_round_begin()?;
        }
        let logits = model.forward(&ids, caches, phase)?;
        let _ = logits.argmax(-1, false)?.to_vec::<u32>()?;
        let elapsed = start.elapsed().as_secs_f64() * 1e3;
        for cache in caches.iter_mut() {
            cache.spec_round_rollback(keep)?;
        }
        if r >= 2 {
            times.push(elapsed);
        }
    }
    Ok(median(times))
}

/// `quince bench-spec`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens < 2 || args.num_draft == 0 {
        bail!("--prompt-tokens and --num-draft must be positive, --gen-tokens at least 2");
    }
    let options = args.load.options();
    let model = engine::registry::load_model(&args.model, &options)?;
    let prompt = synthetic_prompt(args.prompt_tokens, model.vocab_size() as u32);

    // Verify windows against one decode step, over the same prefilled prompt.
    let mut caches = model.fresh_caches()?;
    engine::generate::prefill(model.as_ref(), &mut caches, &prompt, 512)?;
    let decode = step_ms(model.as_ref(), &mut caches, 1, args.repeats, 0)?;
    let mut windows = Vec::new();
    for k in [2usize, 4, 8] {
        let ms = step_ms(model.as_ref(), &mut caches, k, args.repeats, 0)?;
        windows.push((k, ms, ms / decode));
    }
    // As in a generation: each round keeps one token, so every window sees a new key length.
    let growing = step_ms(model.as_ref(), &mut caches, 4, args.repeats, 1)?;

    // Speed: plain, speculating for nothing, and the model drafting for itself.
    let request = GenerateRequest::new(prompt.clone(), args.gen_tokens);
    let plain = |model: &dyn Model| -> anyhow::Result<f64> {
        let mut caches = model.fresh_caches()?;
        Ok(generate(model, &mut caches, &request, |_| Flow::Continue)?.stats.decode_tok_s)
    };
    let spec = |model: &dyn Model, method: &mut dyn DraftMethod, adaptive: bool| {
        let mut caches = model.fresh_caches()?;
        let length = DraftLength { max: args.num_draft, adaptive };
        let (reply, stats) =
            engine::batch::speculate(model, &mut caches, &[], &request, method, length, |_| {
                Flow::Continue
            })?;
        anyhow::Ok((reply.stats.decode_tok_s, stats))
    };
    let mut self_draft = DraftModel::new(engine::registry::load_model(&args.model, &options)?);
    let mut drafter = match &args.drafter {
        Some(dir) => Some(engine::registry::load_drafter(dir, &options)?),
        None => None,
    };
    // Warm-up of every path, then alternating timed runs.
    plain(model.as_ref())?;
    spec(model.as_ref(), &mut NeverRight, true)?;
    spec(model.as_ref(), &mut self_draft, false)?;
    if let Some(d) = drafter.as_mut() {
        spec(model.as_ref(), d.as_mut(), true)?;
    }
    let mut drafter_runs = Vec::new();
    let mut drafter_stats = Default::default();
    let (mut plain_runs, mut never_runs, mut never_fixed_runs, mut self_runs) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let runs = (args.repeats / 4).max(3);
    let mut never_stats = Default::default();
    let mut self_stats = Default::default();
    for _ in 0..runs {
        plain_runs.push(plain(model.as_ref())?);
        let (tok_s, stats) = spec(model.as_ref(), &mut NeverRight, true)?;
        never_runs.push(tok_s);
        never_stats = stats;
        never_fixed_runs.push(spec(model.as_ref(), &mut NeverRight, false)?.0);
        let (tok_s, stats) = spec(model.as_ref(), &mut self_draft, false)?;
        self_runs.push(tok_s);
        self_stats = stats;
        if let Some(d) = drafter.as_mut() {
            let (tok_s, stats) = spec(model.as_ref(), d.as_mut(), true)?;
            drafter_runs.push(tok_s);
            drafter_stats = stats;
        }
    }
    let drafter_tok_s = (!drafter_runs.is_empty()).then(|| median(drafter_runs));
    let plain_tok_s = median(plain_runs);
    let never_tok_s = median(never_runs);
    let never_fixed_tok_s = median(never_fixed_runs);
    let self_tok_s = median(self_runs);

    let device = mlx::Device::default_device().map(|d| format!("{d:?}")).unwrap_or_default();
    println!(
        "speculative decoding on {} ({device}), prompt {} tokens",
        args.model.display(),
        prompt.len()
    );
    println!("  decode step            {decode:8.2} ms");
    for (k, ms, ratio) in &windows {
        println!("  verify window of {k}     {ms:8.2} ms   {ratio:5.2}x a decode step");
    }
    println!("  window of 4, keys grow {growing:8.2} ms   {:5.2}x a decode step", growing / decode);
    println!("  plain decoding         {plain_tok_s:8.1} tok/s");
    println!(
        "  0% acceptance          {never_tok_s:8.1} tok/s   overhead {:+.1}% (adaptive; {:+.1}% at a fixed {} drafts); accepted {}/{}",
        (plain_tok_s / never_tok_s - 1.0) * 100.0,
        (plain_tok_s / never_fixed_tok_s - 1.0) * 100.0,
        args.num_draft,
        never_stats.accepted,
        never_stats.proposed
    );
    println!(
        "  draft = target         {self_tok_s:8.1} tok/s   {:.2}x plain; accepted {}/{} in {} rounds",
        self_tok_s / plain_tok_s,
        self_stats.accepted,
        self_stats.proposed,
        self_stats.rounds
    );
    if let (Some(tok_s), Some(dir)) = (drafter_tok_s, &args.drafter) {
        println!(
            "  drafter                {tok_s:8.1} tok/s   {:.2}x plain; accepted {}/{} in {} rounds ({})",
            tok_s / plain_tok_s,
            drafter_stats.accepted,
            drafter_stats.proposed,
            drafter_stats.rounds,
            dir.display()
        );
    }
    if args.json {
        let line = json!({
            "model": args.model.display().to_string(),
            "device": device,
            "prompt_tokens": prompt.len(),
            "decode_step_ms": decode,
            "verify": windows.iter().map(|(k, ms, ratio)| json!({"tokens": k, "ms": ms, "ratio": ratio})).collect::<Vec<_>>(),
            "verify_4_growing": {"ms": growing, "ratio": growing / decode},
            "plain_tok_s": plain_tok_s,
            "zero_acceptance": {
                "tok_s": never_tok_s,
                "overhead": plain_tok_s / never_tok_s - 1.0,
                "fixed_tok_s": never_fixed_tok_s,
                "fixed_overhead": plain_tok_s / never_fixed_tok_s - 1.0,
                "accepted": never_stats.accepted,
                "proposed": never_stats.proposed,
            },
            "draft_equals_target": {
                "tok_s": self_tok_s,
                "speedup": self_tok_s / plain_tok_s,
                "accepted": self_stats.accepted,
                "proposed": self_stats.proposed,
                "rounds": self_stats.rounds,
            },
            "drafter": drafter_tok_s.map(|tok_s| json!({
                "path": args.drafter.as_ref().map(|d| d.display().to_string()),
                "tok_s": tok_s,
                "speedup": tok_s / plain_tok_s,
                "accepted": drafter_stats.accepted,
                "proposed": drafter_stats.proposed,
                "rounds": drafter_stats.rounds,
            })),
        });
        println!("{line}");
    }
    Ok(())
}
