//! `generate`, `logits` and `bench`: the engine from the command line.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use engine::generate::{Flow, GenerateRequest, generate as run_generation, prefill};
use engine::models::{self, Model, Phase};
use engine::sampling::SamplingParams;
use mlx::ops;
use serde_json::json;

/// Arguments of `quince generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma-separated, fed verbatim (no template, no BOS added).
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass (1.0: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below min-p × the most likely (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1.0: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// Arguments of `quince logits`.
#[derive(Debug, clap::Args)]
pub struct LogitsArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Output safetensors file; float32 logits [T, V] under `logits`.
    #[arg(long)]
    out: PathBuf,
    /// Prefill the first token, then one decode step per remaining token.
    #[arg(long)]
    incremental: bool,
}

/// Arguments of `quince bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Synthetic prompt length.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens to decode.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn load(path: &PathBuf) -> anyhow::Result<Box<dyn Model>> {
    models::load(path).with_context(|| format!("loading the model at {}", path.display()))
}

/// `quince generate`.
pub fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let model = load(&args.model)?;
    let mut caches = model.new_caches()?;
    let request = GenerateRequest {
        prompt: args.tokens.clone(),
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop_tokens: if args.ignore_eos { Vec::new() } else { model.eos_token_ids() },
        prefill_step: 512,
    };
    let mut out = std::io::stdout().lock();
    let json = args.json;
    let reply = run_generation(model.as_ref(), &mut caches, &request, |token| {
        if !json {
            let _ = write!(out, "{token} ");
            let _ = out.flush();
        }
        Flow::Continue
    })?;
    let s = &reply.stats;
    if json {
        let line = json!({
            "token_ids": reply.tokens,
            "text": "",
            "stop_reason": reply.stop_reason.as_str(),
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.ttft_ms,
            "prefill_tok_s": s.prefill_tok_s,
            "decode_tok_s": s.decode_tok_s,
            "peak_mem_bytes": s.peak_mem_bytes,
        });
        writeln!(out, "{line}")?;
    } else {
        writeln!(out)?;
        eprintln!(
            "{} tokens ({}) · TTFT {:.1} ms · prefill {:.1} tok/s · decode {:.1} tok/s · peak {:.1} MiB",
            s.generated_tokens,
            reply.stop_reason.as_str(),
            s.ttft_ms,
            s.prefill_tok_s,
            s.decode_tok_s,
            s.peak_mem_bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}

/// `quince logits`.
pub fn logits(args: &LogitsArgs) -> anyhow::Result<()> {
    let model = load(&args.model)?;
    engine::generate::check_prompt(model.as_ref(), 0, &args.tokens, 0)?;
    let mut caches = model.new_caches()?;
    let ids = |t: &[u32]| engine::models::gemma4::token_array(t);
    let logits = if args.incremental {
        let mut rows = vec![model.forward(&ids(&args.tokens[..1])?, &mut caches, Phase::Window)?];
        for &token in &args.tokens[1..] {
            let row = model.forward(&ids(&[token])?, &mut caches, Phase::Decode)?;
            row.eval()?;
            rows.push(row);
        }
        ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)?
    } else {
        model.forward(&ids(&args.tokens)?, &mut caches, Phase::Window)?
    };
    let t = args.tokens.len() as i32;
    let logits = logits.reshape(&[t, -1])?.astype(mlx::Dtype::Float32)?;
    let mut tensors = BTreeMap::new();
    tensors.insert("logits".to_string(), logits);
    let mut metadata = BTreeMap::new();
    metadata.insert(
        "path".to_string(),
        if args.incremental { "incremental" } else { "full" }.to_string(),
    );
    mlx::io::save_safetensors(&args.out, &tensors, &metadata)
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}

/// `quince bench`.
pub fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 {
        bail!("--prompt-tokens and --gen-tokens must be positive");
    }
    let model = load(&args.model)?;
    let vocab = model.vocab_size() as u32;
    // A fixed pseudo-random prompt that avoids the lowest (special) ids.
    let prompt: Vec<u32> =
        (0..args.prompt_tokens as u32).map(|i| 3 + (i * 7919 + 13) % (vocab - 3)).collect();
    // Warm-up: compile kernels and fill allocator caches on a short run.
    {
        let mut caches = model.new_caches()?;
        let warm = GenerateRequest::new(prompt[..prompt.len().min(16)].to_vec(), 4);
        run_generation(model.as_ref(), &mut caches, &warm, |_| Flow::Continue)?;
        let logits = prefill(model.as_ref(), &mut caches, &prompt[..1], 512)?;
        logits.eval()?;
    }
    let mut caches = model.new_caches()?;
    let request = GenerateRequest::new(prompt, args.gen_tokens);
    let reply = run_generation(model.as_ref(), &mut caches, &request, |_| Flow::Continue)?;
    let s = &reply.stats;
    let mut out = std::io::stdout().lock();
    if args.json {
        let line = json!({
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.ttft_ms,
            "prefill_tok_s": s.prefill_tok_s,
            "decode_tok_s": s.decode_tok_s,
            "peak_mem_bytes": s.peak_mem_bytes,
            "backend": mlx::Backend::current().name(),
        });
        writeln!(out, "{line}")?;
    } else {
        writeln!(out, "prompt {} tokens · generated {}", s.prompt_tokens, s.generated_tokens)?;
        writeln!(out, "TTFT           {:.1} ms", s.ttft_ms)?;
        writeln!(out, "prefill        {:.1} tok/s", s.prefill_tok_s)?;
        writeln!(out, "decode         {:.1} tok/s", s.decode_tok_s)?;
        writeln!(out, "peak memory    {:.1} MiB", s.peak_mem_bytes as f64 / (1 << 20) as f64)?;
    }
    Ok(())
}
