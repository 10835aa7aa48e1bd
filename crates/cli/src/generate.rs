//! `quince generate`: one turn through the engine's turn API, streamed to the terminal.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use engine::generate::Flow;
use engine::sampling::SamplingParams;
use engine::speculative::{DraftLength, SpecStats, Speculation};
use engine::turn::{ChatModel, Drafters, Prompt, Turn, TurnEvent, TurnMessage};
use serde_json::json;

use crate::options::{KvArgs, LoadArgs};

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
    /// With --prompt, ask a model whose chat template can think (Qwen's `enable_thinking`)
    /// to answer without thinking first.
    #[arg(long)]
    no_thinking: bool,
    /// Speculative decoding with the draft model in this folder (it must share the target's
    /// tokenizer).
    #[arg(long, conflicts_with_all = ["lookup", "assistant"])]
    draft: Option<PathBuf>,
    /// Speculative decoding with a drafter made for this model (a `gemma4_assistant` or
    /// `qwen3_5_mtp` folder) in this folder.
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
    #[command(flatten)]
    kv: KvArgs,
    #[command(flatten)]
    load: LoadArgs,
}

impl GenerateArgs {
    fn turn(&self) -> anyhow::Result<Turn> {
        let prompt = match (&self.tokens, &self.prompt) {
            (Some(ids), _) => Prompt::Tokens { ids: ids.clone(), images: self.image.clone() },
            (None, text) => {
                let mut messages = Vec::new();
                if let Some(system) = &self.system {
                    messages.push(TurnMessage::text("system", system));
                }
                messages.push(TurnMessage {
                    role: "user".into(),
                    text: text.clone().unwrap_or_default(),
                    images: self.image.clone(),
                    ..TurnMessage::default()
                });
                Prompt::Messages(messages)
            }
        };
        let speculation = match (&self.draft, &self.assistant) {
            (Some(model), _) => Speculation::Draft { model: model.clone() },
            (None, Some(model)) => Speculation::Assistant { model: model.clone() },
            (None, None) if self.lookup => Speculation::Lookup,
            (None, None) => Speculation::Off,
        };
        Ok(Turn {
            sampling: SamplingParams {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                min_p: self.min_p,
                repetition_penalty: self.repetition_penalty,
                seed: self.seed,
                ..SamplingParams::default()
            },
            max_tokens: self.max_tokens,
            stop_strings: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            max_soft_tokens: self.max_soft_tokens,
            speculation,
            draft_length: DraftLength { max: self.num_draft, adaptive: !self.fixed_draft },
            kv: self.kv.options()?,
            memory_share: self.kv.memory_share(),
            thinking: self.no_thinking.then_some(false),
            ..Turn::new(prompt)
        })
    }
}

/// Loads the model in `path` with its tokenizer.
pub(crate) fn load(path: &std::path::Path, load: &LoadArgs) -> anyhow::Result<ChatModel> {
    ChatModel::load(path, &load.options())
        .with_context(|| format!("loading the model at {}", path.display()))
}

/// Speculative decoding's counts, as the CLI's JSON names them.
pub(crate) fn spec_json(spec: &SpecStats) -> serde_json::Value {
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
pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let chat = load(&args.model, &args.load)?;
    let turn = args.turn()?;
    let options = args.load.options();
    let mut out = std::io::stdout().lock();
    let (json, raw) = (args.json, chat.tokenizer().is_none());
    let reply =
        chat.answer(&turn, &mut Drafters::new(options), |TurnEvent::Token { id, text }| {
            if !json {
                let _ = if raw { write!(out, "{id} ") } else { write!(out, "{text}") };
                let _ = out.flush();
            }
            Flow::Continue
        })?;
    let s = &reply.stats;
    if json {
        let mut line = json!({
            "token_ids": reply.tokens,
            "text": reply.text,
            "stop_reason": s.stop_reason,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.ttft_ms,
            "prefill_tok_s": s.prefill_tok_s,
            "decode_tok_s": s.decode_tok_s,
            "peak_mem_bytes": s.peak_mem_bytes,
            "kv_bytes": s.kv_bytes,
            "kv_storage": s.kv_storage,
            "compiled_decode_steps": chat.model().decode_graphs().map(|g| g.stats().steps),
        });
        if let Some(spec) = &s.spec {
            line["spec"] = spec_json(spec);
        }
        writeln!(out, "{line}")?;
    } else {
        writeln!(out)?;
        eprintln!(
            "{} tokens ({}) · TTFT {:.1} ms · prefill {:.1} tok/s · decode {:.1} tok/s · peak {:.1} MiB · KV {:.2} MiB",
            s.generated_tokens,
            s.stop_reason.as_str(),
            s.ttft_ms,
            s.prefill_tok_s,
            s.decode_tok_s,
            s.peak_mem_bytes as f64 / (1 << 20) as f64,
            s.kv_bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
