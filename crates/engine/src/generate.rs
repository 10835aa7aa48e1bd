//! What a generation is asked and gives: the request ([`GenerateRequest`]), its prompt checked
//! against the model's context and prefilled in chunks through window appends ([`prefill`],
//! with images [`prefill_multimodal`]), why it ended ([`StopReason`]) and its timings
//! ([`GenerationStats`]). Decoding is the batch's ([`crate::batch`]): every reply is a row of
//! one, a reply alone a batch of one ([`crate::batch::generate`]).

use std::time::Instant;

use mlx::Array;
use serde::{Deserialize, Serialize};

use crate::cache::{Cache, stack_offset};
use crate::models::{Model, Phase, Rows};
use crate::sampling::SamplingParams;
use crate::{Error, Result};

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Token ids to append to the caches before generating (the whole prompt, or the part
    /// after a cached prefix).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Token ids that end the reply (emitted, then generation stops).
    pub stop_tokens: Vec<u32>,
    /// Positions per prefill chunk.
    pub prefill_step: usize,
    /// Image features `[n_i, hidden]` (from `Model::encode_image`), filling the prompt's runs
    /// of image tokens in order.
    pub images: Vec<Array>,
    /// What the reply must match (sampling masks the logits to it).
    pub constraint: Option<crate::constrain::Grammar>,
}

impl GenerateRequest {
    /// A greedy request for `prompt` with the model's default stop tokens left to the caller.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            prefill_step: 512,
            images: Vec::new(),
            constraint: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was generated (the end of the turn).
    #[serde(rename = "stop")]
    StopToken,
    /// `max_tokens` reached.
    #[serde(rename = "length")]
    MaxTokens,
    /// The callback asked to stop (user stop, stop string).
    Stopped,
}

impl StopReason {
    /// `stop`, `length` or `stopped` (the words the CLI's JSON uses).
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::StopToken => "stop",
            StopReason::MaxTokens => "length",
            StopReason::Stopped => "stopped",
        }
    }
}

/// What the token callback tells the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Keep going.
    Continue,
    /// Stop now (the token just passed is kept).
    Stop,
}

/// Timings and counts of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    /// Tokens prefilled.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// From the call to the first generated token, in ms.
    pub ttft_ms: f64,
    /// Prompt tokens per second of the prefill.
    pub prefill_tok_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    /// MLX's peak memory during the call, in bytes.
    pub peak_mem_bytes: usize,
    /// Host time spent building and submitting decode steps, in ms (MLX encodes each op on
    /// the calling thread as it is submitted). Decode is host-bound when this approaches the
    /// decode time, since the accelerator runs a step while the host builds the next.
    pub decode_host_ms: f64,
    /// The part of [`GenerationStats::decode_host_ms`] spent building the steps' graphs
    /// (Quince's own code); the rest is MLX evaluating them.
    pub decode_build_ms: f64,
    /// Time spent waiting for decoded tokens after the first, in ms: near zero while the host
    /// bounds decoding, most of a step when the accelerator does.
    pub decode_wait_ms: f64,
}

/// The result of a generation ([`crate::batch::generate`], a row of a batch).
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated ids, in order (a stop token included).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Timings.
    pub stats: GenerationStats,
}

/// Checks that a prompt fits: non-empty, ids in the vocabulary, and room for the reply.
pub fn check_prompt(
    model: &dyn Model,
    cached: usize,
    prompt: &[u32],
    max_tokens: usize,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::InvalidRequest("the prompt is empty".into()));
    }
    let vocab = model.vocab_size();
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::InvalidRequest(format!(
            "token id {bad} is outside the vocabulary of {vocab}"
        )));
    }
    let limit = model.max_context();
    if cached + prompt.len() + max_tokens > limit {
        return Err(Error::ContextOverflow {
            prompt_tokens: cached + prompt.len(),
            max_new_tokens: max_tokens,
            limit,
        });
    }
    Ok(())
}

/// Prefills `tokens` and returns the last position's logits `[1, V]`: every token but the last
/// through window appends in chunks of `step` (cut where a storage converts its precision),
/// then the last one as a decode step. This is
/// mlx-lm's split, kept on purpose: in bf16 the cached keys and values of a position depend on
/// the shape of the matmul that made them, and the same split gives the same cache (and the same
/// greedy tokens) as the reference.
pub fn prefill(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    tokens: &[u32],
    step: usize,
) -> Result<Array> {
    let Some((&last, head)) = tokens.split_last() else {
        return Err(Error::InvalidRequest("the prompt is empty".into()));
    };
    let mut start = 0;
    while start < head.len() {
        // A chunk ends where a storage converts, so its boundary lands on the same position
        // whatever the chunk size.
        let room = crate::cache::stack_max_append(caches).unwrap_or(usize::MAX);
        let end = (start + step.max(1).min(room)).min(head.len());
        let chunk = &head[start..end];
        start = end;
        let ids = crate::tokens::ids(chunk)?;
        // The chunk's logits are never read: evaluating the caches alone skips the output
        // head (a large matmul on big vocabularies), chunk by chunk so the graph and memory
        // stay bounded on long prompts.
        model.forward_rows(&ids, caches, Phase::Window, Rows::Last)?;
        let buffers: Vec<Array> = caches.iter().flat_map(|c| c.buffers()).collect();
        mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
    }
    let ids = crate::tokens::ids(&[last])?;
    let logits = model.forward(&ids, caches, Phase::Decode)?;
    let row = logits.reshape(&[1, -1])?;
    row.eval()?;
    Ok(row)
}

/// Prefills a prompt with images in chunks of about `step` positions; a chunk never ends
/// inside a run of image tokens (the run is one bidirectional block), and each image's
/// features go to the chunk holding its run. Returns the last position's logits `[1, V]`.
pub fn prefill_multimodal(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    tokens: &[u32],
    images: &[Array],
    step: usize,
) -> Result<Array> {
    let image_token = model
        .vision()
        .ok_or_else(|| Error::InvalidRequest("this model does not take images".into()))?
        .image_token();
    let runs = models::vision::image_runs(tokens, image_token);
    if runs.len() != images.len() {
        return Err(Error::InvalidRequest(format!(
            "the prompt has {} image blocks but {} images were given",
            runs.len(),
            images.len()
        )));
    }
    for (i, ((_, len), features)) in runs.iter().zip(images).enumerate() {
        let rows = crate::vision::soft_tokens(features);
        if rows != *len {
            return Err(Error::InvalidRequest(format!(
                "image {} has {rows} soft tokens but its block in the prompt has {len}",
                i + 1
            )));
        }
    }
    let step = step.max(1);
    let mut start = 0;
    let mut next_image = 0;
    let mut last = None;
    while start < tokens.len() {
        // A chunk ends where a storage converts (unless an image block spans the boundary:
        // a block is one append, and the conversion follows it).
        let room = crate::cache::stack_max_append(caches).unwrap_or(usize::MAX);
        let mut end = (start + step.min(room)).min(tokens.len());
        // Extend past any run that the cut would split.
        if let Some(&(run_start, run_len)) = runs.iter().find(|(s, l)| *s < end && s + l > end) {
            end = run_start + run_len;
        }
        let chunk = &tokens[start..end];
        let in_chunk = runs.iter().filter(|(s, _)| *s >= start && *s < end).count();
        let chunk_images = &images[next_image..next_image + in_chunk];
        next_image += in_chunk;
        let logits = model.forward_multimodal(chunk, chunk_images, caches, Rows::Last)?;
        let row = logits.reshape(&[1, -1])?;
        row.eval()?;
        last = Some(row);
        start = end;
    }
    last.ok_or_else(|| Error::InvalidRequest("the prompt is empty".into()))
}

/// Checks the request and prefills its prompt (with its images); returns the last position's
/// logits `[1, V]` and when the generation started.
pub(crate) fn start(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    request: &GenerateRequest,
) -> Result<(Array, Instant)> {
    let cached = stack_offset(caches);
    check_prompt(model, cached, &request.prompt, request.max_tokens)?;
    mlx::device::memory::reset_peak()?;
    let start = Instant::now();
    let logits = if request.images.is_empty() {
        prefill(model, caches, &request.prompt, request.prefill_step)?
    } else {
        prefill_multimodal(model, caches, &request.prompt, &request.images, request.prefill_step)?
    };
    Ok((logits, start))
}
