//! `quince eval`: quality figures for a checkpoint on a text. Perplexity as mlx-lm's
//! `mlx_lm.perplexity` computes it (the tokens cut into rows of `--context`, each row's logits
//! over all but its last token scored against the next tokens), and, on prompts taken from the
//! same tokens, each draft method's acceptance rate, mean accepted length and decode speed
//! against plain greedy decoding.
//!
//! With a KV choice (`--kv-bits …`), speculation runs on that storage, and the storage is held
//! against full precision on the same text ([`kv_quality`]): bytes per token, perplexity of
//! each row's second half read over its first half in the cache, the KL divergence and argmax
//! agreement of the logits along a greedy continuation (teacher-forced with full precision's
//! tokens), where free-running greedy first departs, and the relative error of attention over
//! the stored values.

use std::path::PathBuf;

use anyhow::{Context, bail};
use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest};
use engine::models::{Model, Phase};
use engine::speculative::draft_model::DraftModel;
use engine::speculative::lookup::PromptLookup;
use engine::speculative::{DraftLength, DraftMethod};
use engine::tokens::ids;
use serde_json::json;

use engine::cache::{Cache, KvOptions};

use crate::options::{KvArgs, LoadArgs};

/// Arguments of `quince eval`.
#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 text to score, tokenized with the model's tokenizer (BOS added, as mlx-lm does).
    #[arg(long, conflicts_with = "tokens")]
    text: Option<PathBuf>,
    /// Token ids to score instead of a text, comma-separated.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Tokens per row: the text is cut into rows this long (the remainder is dropped).
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Score at most this many rows (0: all).
    #[arg(long, default_value_t = 0)]
    rows: usize,
    /// A draft model to measure besides prompt lookup.
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Speculation prompts: the first `--prompt-tokens` of this many rows (0: no speculation).
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Tokens of each speculation prompt.
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Tokens a round drafts at most.
    #[arg(long, default_value_t = 4)]
    num_draft: usize,
    /// Run each method once on the first prompt before timing (MLX builds kernels on first use).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    warmup: bool,
    /// Tokens of the greedy continuation the KV storage is compared along (with --kv-bits).
    #[arg(long, default_value_t = 512)]
    kv_tokens: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    load: LoadArgs,
}

/// Mean negative log-likelihood of each row's next tokens, and how many tokens were scored.
fn mean_nll(model: &dyn Model, rows: &[&[u32]]) -> anyhow::Result<(f64, usize)> {
    let mut total = 0.0f64;
    let mut count = 0usize;
    for row in rows {
        let mut caches = model.fresh_caches()?;
        let inputs = &row[..row.len() - 1];
        let logits = model
            .forward(&ids(inputs)?, &mut caches, Phase::Window)?
            .astype(mlx::Dtype::Float32)?
            .reshape(&[inputs.len() as i32, -1])?;
        let targets = mlx::Array::from_slice(
            &row[1..].iter().map(|&t| t as i32).collect::<Vec<_>>(),
            &[inputs.len() as i32, 1],
        )?;
        let picked = logits.take_along_axis(&targets, -1)?.reshape(&[-1])?;
        let nll = logits.logsumexp(&[-1], false)?.subtract(&picked)?;
        total += f64::from(nll.sum_all(false)?.item::<f32>()?);
        count += inputs.len();
    }
    Ok((total / count.max(1) as f64, count))
}

pub fn run(args: &EvalArgs) -> anyhow::Result<()> {
    let options = args.load.options();
    let kv = args.kv.options()?;
    let model = engine::registry::load_model(&args.model, &options)?;
    let tokens = match &args.text {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let tokenizer =
                engine::tokenizer::Tokenizer::from_dir(&args.model)?.with_context(|| {
                    format!("{} has no tokenizer: pass --tokens", args.model.display())
                })?;
            tokenizer.encode(&text, true)?
        }
        None => args.tokens.clone(),
    };
    if args.context < 2 {
        bail!("--context must be at least 2");
    }
    let mut rows: Vec<&[u32]> = tokens.chunks_exact(args.context).collect();
    if args.rows > 0 {
        rows.truncate(args.rows);
    }
    if rows.is_empty() {
        bail!(
            "the text has {} tokens, fewer than one row of --context {}",
            tokens.len(),
            args.context
        );
    }
    let (nll, scored) = mean_nll(model.as_ref(), &rows)?;
    let perplexity = nll.exp();

    // Speculation on prompts from the same rows, against plain greedy decoding.
    let prompts: Vec<Vec<u32>> = rows
        .iter()
        .take(args.prompts)
        .map(|row| row[..args.prompt_tokens.min(row.len())].to_vec())
        .collect();
    // Lookup looks up every token: what is measured is how well each method drafts on this
    // text, not when a batch would wait for a token to draft after it.
    let lookup = PromptLookup::waiting_for_every_token();
    let mut methods: Vec<(String, Box<dyn DraftMethod>)> =
        vec![("lookup".into(), Box::new(lookup))];
    if let Some(dir) = &args.draft {
        let draft = engine::registry::load_model(dir, &options)?;
        methods.push((format!("draft {}", dir.display()), Box::new(DraftModel::new(draft))));
    }
    let length = DraftLength { max: args.num_draft, adaptive: true };
    let mut plain_tok_s = Vec::new();
    let mut reports = Vec::new();
    let caches_kv = || caches_for(model.as_ref(), &kv);
    let plain = |prompt: &[u32]| -> anyhow::Result<engine::generate::Generation> {
        let request = GenerateRequest::new(prompt.to_vec(), args.gen_tokens);
        let mut caches = caches_kv()?;
        Ok(generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue)?)
    };
    let drafted = |method: &mut dyn DraftMethod, prompt: &[u32]| {
        let request = GenerateRequest::new(prompt.to_vec(), args.gen_tokens);
        let mut caches = caches_kv()?;
        engine::batch::speculate(model.as_ref(), &mut caches, &[], &request, method, length, |_| {
            Flow::Continue
        })
        .map_err(anyhow::Error::from)
    };
    // One untimed pass of every method first: MLX builds its kernels for each new shape on
    // first use (seconds each on CUDA), which would otherwise land in the timed runs.
    if let Some(prompt) = prompts.first().filter(|_| args.warmup) {
        plain(prompt)?;
        for (_, method) in &mut methods {
            drafted(method.as_mut(), prompt)?;
        }
    }
    let mut plain_tokens = Vec::new();
    for prompt in &prompts {
        let reply = plain(prompt)?;
        plain_tok_s.push(reply.stats.decode_tok_s);
        plain_tokens.push(reply.tokens);
    }
    for (name, method) in methods.iter_mut().filter(|_| !prompts.is_empty()) {
        let (mut proposed, mut accepted, mut rounds, mut tok_s) = (0, 0, 0, Vec::new());
        let mut same = true;
        for (prompt, expected) in prompts.iter().zip(&plain_tokens) {
            let (reply, stats) = drafted(method.as_mut(), prompt)?;
            proposed += stats.proposed;
            accepted += stats.accepted;
            rounds += stats.rounds;
            tok_s.push(reply.stats.decode_tok_s);
            same &= &reply.tokens == expected;
        }
        let rate = if proposed == 0 { 0.0 } else { accepted as f64 / proposed as f64 };
        let mean_len = if rounds == 0 { 0.0 } else { accepted as f64 / rounds as f64 };
        let speedup = median(&tok_s) / median(&plain_tok_s).max(f64::MIN_POSITIVE);
        reports.push(json!({
            "method": name, "proposed": proposed, "accepted": accepted, "rounds": rounds,
            "acceptance_rate": rate, "mean_accepted_length": mean_len,
            "decode_tok_s": median(&tok_s), "speedup": speedup,
            "same_tokens_as_plain": same,
        }));
    }
    let quality = if kv.is_full() {
        None
    } else {
        let prompt = &rows[0][..args.prompt_tokens.min(rows[0].len())];
        Some(kv_quality(model.as_ref(), &kv, &rows, prompt, args.kv_tokens)?)
    };
    let out = json!({
        "model": args.model.display().to_string(),
        "tokens": tokens.len(), "context": args.context, "rows": rows.len(),
        "scored_tokens": scored, "mean_nll": nll, "perplexity": perplexity,
        "plain_decode_tok_s": if plain_tok_s.is_empty() { 0.0 } else { median(&plain_tok_s) },
        "speculation": reports,
        "kv": quality,
    });
    if args.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} · {} tokens in {} rows of {}",
        args.model.display(),
        tokens.len(),
        rows.len(),
        args.context
    );
    println!("  perplexity {perplexity:.4} (mean NLL {nll:.5} over {scored} tokens)");
    if !plain_tok_s.is_empty() {
        println!(
            "  plain greedy decode {:.1} tok/s (median of {})",
            median(&plain_tok_s),
            prompts.len()
        );
    }
    if let Some(q) = &out["kv"].as_object() {
        println!(
            "  KV {}: {} bytes/token ({:.3}× full precision); second-half perplexity {:.4} \
             (full {:.4}); along {} greedy tokens: KL {:.3e}, argmax agreement {:.1}%, \
             free-running greedy identical for {}; attention relative error {:.3e}",
            q["storage"].as_str().unwrap_or_default(),
            q["bytes_per_token"],
            q["bytes_ratio"].as_f64().unwrap_or_default(),
            q["perplexity"].as_f64().unwrap_or_default(),
            q["perplexity_full"].as_f64().unwrap_or_default(),
            q["compared_tokens"],
            q["kl_mean"].as_f64().unwrap_or_default(),
            q["greedy_agreement"].as_f64().unwrap_or_default() * 100.0,
            q["identical_prefix"],
            q["attention_rel_error"].as_f64().unwrap_or_default(),
        );
    }
    for r in &reports {
        println!(
            "  {}: {:.1}% accepted ({}/{}), {:.2} per round, decode {:.2}× plain ({:.1} tok/s){}",
            r["method"].as_str().unwrap_or_default(),
            r["acceptance_rate"].as_f64().unwrap_or_default() * 100.0,
            r["accepted"],
            r["proposed"],
            r["mean_accepted_length"].as_f64().unwrap_or_default(),
            r["speedup"].as_f64().unwrap_or_default(),
            r["decode_tok_s"].as_f64().unwrap_or_default(),
            if r["same_tokens_as_plain"] == true { "" } else { ", tokens differ from plain" },
        );
    }
    Ok(())
}

/// Fresh caches for `model` under a KV choice.
fn caches_for(model: &dyn Model, kv: &KvOptions) -> anyhow::Result<Vec<Box<dyn Cache>>> {
    Ok(model.new_caches(&model.cache_plan().with_kv(kv)?)?)
}

/// Mean NLL of each row's second half, appended as one window after its first half (so the
/// second half reads the first from the cache, converted where the storage converts).
fn second_half_nll(model: &dyn Model, kv: &KvOptions, rows: &[&[u32]]) -> anyhow::Result<f64> {
    let (mut total, mut count) = (0.0f64, 0usize);
    for row in rows {
        let half = row.len() / 2;
        let mut caches = caches_for(model, kv)?;
        model.forward_rows(
            &ids(&row[..half])?,
            &mut caches,
            Phase::Window,
            engine::models::Rows::Last,
        )?;
        let inputs = &row[half..row.len() - 1];
        let logits = model
            .forward(&ids(inputs)?, &mut caches, Phase::Window)?
            .astype(mlx::Dtype::Float32)?
            .reshape(&[inputs.len() as i32, -1])?;
        let targets: Vec<i32> = row[half + 1..].iter().map(|&t| t as i32).collect();
        let targets = mlx::Array::from_slice(&targets, &[inputs.len() as i32, 1])?;
        let picked = logits.take_along_axis(&targets, -1)?.reshape(&[-1])?;
        let nll = logits.logsumexp(&[-1], false)?.subtract(&picked)?;
        total += f64::from(nll.sum_all(false)?.item::<f32>()?);
        count += inputs.len();
    }
    Ok(total / count.max(1) as f64)
}

/// The logits of each step of a continuation of `prompt` (`[V]` each, f32): greedy for
/// `steps` tokens, or fed `forced` tokens instead of its own picks.
fn continuation(
    model: &dyn Model,
    kv: &KvOptions,
    prompt: &[u32],
    steps: usize,
    forced: Option<&[u32]>,
) -> anyhow::Result<(Vec<mlx::Array>, Vec<u32>)> {
    let mut caches = caches_for(model, kv)?;
    let mut logits = engine::generate::prefill(model, &mut caches, prompt, 512)?;
    let (mut rows, mut tokens) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for i in 0..steps {
        let row = logits.astype(mlx::Dtype::Float32)?.reshape(&[-1])?;
        let token = match forced {
            Some(forced) => forced[i],
            None => row.argmax(-1, false)?.item::<u32>()?,
        };
        rows.push(row);
        tokens.push(token);
        logits = model.forward_decode(&ids(&[token])?, &mut caches)?;
    }
    Ok((rows, tokens))
}

/// `kv` against full precision on the same text: see the module docs.
fn kv_quality(
    model: &dyn Model,
    kv: &KvOptions,
    rows: &[&[u32]],
    prompt: &[u32],
    steps: usize,
) -> anyhow::Result<serde_json::Value> {
    let full = KvOptions::full();
    let plan = model.cache_plan().with_kv(kv)?;
    let full_plan = model.cache_plan();
    let (bytes, full_bytes) = (plan.bytes_per_token(), full_plan.bytes_per_token());
    let perplexity = second_half_nll(model, kv, rows)?.exp();
    let perplexity_full = second_half_nll(model, &full, rows)?.exp();
    // Along full precision's greedy continuation, each step's distributions.
    let (reference, greedy) = continuation(model, &full, prompt, steps, None)?;
    let (forced, _) = continuation(model, kv, prompt, steps, Some(&greedy))?;
    let (mut kl, mut agree) = (0.0f64, 0usize);
    for (p, q) in reference.iter().zip(&forced) {
        let log_p = p.subtract(&p.logsumexp(&[-1], true)?)?;
        let log_q = q.subtract(&q.logsumexp(&[-1], true)?)?;
        let d = log_p.exp()?.multiply(&log_p.subtract(&log_q)?)?.sum_all(false)?;
        kl += f64::from(d.item::<f32>()?);
        agree +=
            usize::from(p.argmax(-1, false)?.item::<u32>()? == q.argmax(-1, false)?.item::<u32>()?);
    }
    let (_, own) = continuation(model, kv, prompt, steps, None)?;
    let identical = own.iter().zip(&greedy).take_while(|(a, b)| a == b).count();
    Ok(json!({
        "storage": kv.describe(),
        "signature": plan.signature()?,
        "bytes_per_token": bytes,
        "bytes_per_token_full": full_bytes,
        "bytes_ratio": bytes as f64 / full_bytes.max(1) as f64,
        "perplexity": perplexity,
        "perplexity_full": perplexity_full,
        "compared_tokens": steps,
        "kl_mean": kl / steps.max(1) as f64,
        "greedy_agreement": agree as f64 / steps.max(1) as f64,
        "identical_prefix": identical,
        "attention_rel_error": attention_error(model, kv, rows[0])?,
    }))
}

/// The relative error `‖o − o_full‖ / ‖o_full‖` of attention over each layer's stored keys and
/// values through the storage's format against full precision, after a prefill of `row`, mean
/// over layers. The queries are the layer's own last 64 keys (queries and keys are normed and
/// rotated alike in the models Quince runs; the model's own queries are not kept).
fn attention_error(model: &dyn Model, kv: &KvOptions, row: &[u32]) -> anyhow::Result<f64> {
    let mut caches = caches_for(model, &KvOptions::full())?;
    model.forward_rows(&ids(row)?, &mut caches, Phase::Window, engine::models::Rows::Last)?;
    let plan = model.cache_plan().with_kv(kv)?;
    let mut errors = Vec::new();
    for (cache, storage) in caches.iter().zip(plan.layers()) {
        if storage.kv.format.is_full() {
            continue;
        }
        let state = cache.state()?;
        let (k, v) = (&state.tensors["keys"], &state.tensors["values"]);
        let (kq, vq) = storage.kv.format.round_trip(k, v)?;
        let (kq, vq) = (kq.astype(k.dtype())?, vq.astype(v.dtype())?);
        let n = k.dim(2)?;
        let queries = k.slice(&[0, 0, (n - 64).max(0), 0], &k.shape(), &[1, 1, 1, 1])?;
        let attend = |k: &mlx::Array, v: &mlx::Array| {
            mlx::fast::scaled_dot_product_attention(
                &queries,
                k,
                v,
                1.0 / (k.dim(3).unwrap_or(1) as f32).sqrt(),
                mlx::fast::AttentionMask::Causal,
                None,
            )
            .and_then(|o| o.astype(mlx::Dtype::Float32))
        };
        let (o, oq) = (attend(k, v)?, attend(&kq, &vq)?);
        let norm = |x: &mlx::Array| -> anyhow::Result<f64> {
            Ok(f64::from(x.square()?.sum_all(false)?.sqrt()?.item::<f32>()?))
        };
        errors.push(norm(&oq.subtract(&o)?)? / norm(&o)?.max(f64::MIN_POSITIVE));
    }
    Ok(errors.iter().sum::<f64>() / errors.len().max(1) as f64)
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}
