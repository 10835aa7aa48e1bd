//! One turn of a conversation, end to end: what every front end (the app, `quince chat`,
//! `quince generate`) calls to answer a message.
//!
//! [`ChatModel::answer`] takes the conversation as messages with images ([`Turn`]) and:
//!
//! 1. admits it once ([`ChatModel::admit`], an [`Admission`]): renders it with the model's chat
//!    template, each image decoded and sized by the model's own preprocessor and expanded into
//!    its soft tokens ([`Prompt`]), and refuses it, before anything runs, when an image is
//!    unreadable, the prompt passes the context or its KV cache the memory limit;
//! 2. restores the longest checkpoint offered whose tokens the prompt starts with, trimmed back
//!    to where they part where the storage allows ([`ResumeCandidate`]), and refuses damaged
//!    or foreign files without losing the turn;
//! 3. encodes the images after the restored prefix and prefills the rest;
//! 4. decodes as a row of a batch ([`TurnBatch`]: with the turns decoding beside it, or alone
//!    in a batch of one), plainly or with the chosen draft method ([`Speculation`],
//!    [`Drafters`]), streaming each token with its text ([`TurnEvent`]);
//! 5. brings the caches to the turn boundary — the conversation with this reply, as the next
//!    turn's prompt will start — and writes the checkpoint there, with the draft method's own
//!    state attached.
//!
//! It returns a [`TurnOutcome`]: the reply and one [`TurnStats`], whose [`StopReason`] and
//! [`SpecStats`] front ends show as they are.

mod batch;
mod drafters;
mod prompt;
mod resume;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use batch::{Joined, OnEvent, TurnBatch};
pub use drafters::Drafters;

use crate::LoadOptions;
use crate::cache::{KvOptions, stack_offset};
use crate::generate::{Flow, GenerateRequest, Generation, StopReason};
use crate::kv_file::{self, Identity};
use crate::memory::{Beside, Fit};
use crate::models::Model;
use crate::sampling::SamplingParams;
use crate::speculative::{DraftLength, DraftMethod, SpecStats, Speculation};
use crate::tokenizer::{TemplateOptions, TextStream, Tokenizer};
use crate::{Error, Result};

/// A model ready to answer turns: its weights, its tokenizer (absent for a checkpoint without
/// tokenizer files: raw token turns only) and who its checkpoints belong to.
#[derive(Debug)]
pub struct ChatModel {
    model: Box<dyn Model>,
    tokenizer: Option<Tokenizer>,
    identity: Identity,
    path: PathBuf,
}

/// A message of the conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnMessage {
    /// `system`, `user`, `assistant` or `tool` (a call's result).
    pub role: String,
    /// Its text.
    pub text: String,
    /// Its images, in order (placed before the text).
    pub images: Vec<PathBuf>,
    /// An assistant message's tool calls, OpenAI's shape
    /// (`{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments an
    /// object): what templates read.
    pub tool_calls: Vec<serde_json::Value>,
    /// A `tool` message's answer to the call of this id.
    pub tool_call_id: Option<String>,
}

impl TurnMessage {
    /// A message without images.
    pub fn text(role: &str, text: &str) -> TurnMessage {
        TurnMessage { role: role.into(), text: text.into(), ..TurnMessage::default() }
    }
}

/// What the turn answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// The conversation so far, rendered with the model's chat template (the last message the
    /// user's). Without a template, the last message's text is tokenized with the tokenizer's
    /// special tokens.
    Messages(Vec<TurnMessage>),
    /// Token ids fed verbatim (no template, no BOS added); `images` fill the runs of the
    /// model's image token, in order.
    Tokens {
        /// The ids.
        ids: Vec<u32>,
        /// The images.
        images: Vec<PathBuf>,
    },
    /// Text tokenized as it is, with the tokenizer's special tokens (its BOS) and no template:
    /// a raw completion's prompt.
    Text(String),
}

/// A checkpoint the turn may resume from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeCandidate {
    /// The caller's key for it (its index row).
    pub id: i64,
    /// Its file.
    pub path: PathBuf,
    /// The file's recorded digest ([`kv_file::file_digest`]).
    pub sha256: String,
    /// The token ids its caches hold.
    pub tokens: Vec<u32>,
    /// The storages it was written with, as the index recorded them ([`kv_file::Written`]'s
    /// signature); a candidate of another storage than the turn's is passed over (kept, not
    /// rejected: the conversation may switch back). `None`: not recorded.
    pub signature: Option<String>,
}

/// One turn to answer.
#[derive(Debug, Clone)]
pub struct Turn {
    /// What it answers.
    pub prompt: Prompt,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Most tokens to generate (fewer when the context ends first).
    pub max_tokens: usize,
    /// Stop when the reply contains one of these (needs a tokenizer).
    pub stop_strings: Vec<String>,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Soft tokens per image (one of the model's [`crate::vision::Vision::budgets`]).
    pub max_soft_tokens: usize,
    /// How to decode.
    pub speculation: Speculation,
    /// How many tokens a speculative round drafts.
    pub draft_length: DraftLength,
    /// How the KV cache is stored (a checkpoint of another storage is not resumed).
    pub kv: KvOptions,
    /// The share of the memory MLX recommends for the device that the weights and this
    /// reply's KV cache may fill; a reply whose projected KV cache would pass it is refused
    /// ([`crate::memory`]). `None`: no limit.
    pub memory_share: Option<f64>,
    /// Checkpoints of this conversation's earlier turns, longest first.
    pub resume: Vec<ResumeCandidate>,
    /// Where to write the checkpoint at this turn's boundary (`None`: nowhere).
    pub checkpoint_to: Option<PathBuf>,
    /// Whether that checkpoint is synced to disk before the turn ends.
    pub checkpoint_durability: kv_file::Durability,
    /// `enable_thinking` for templates that take it (Qwen's): `None` is the template's
    /// default.
    pub thinking: Option<bool>,
    /// Tools the model may call (OpenAI's function definitions), rendered into the prompt.
    pub tools: Vec<serde_json::Value>,
    /// What the reply must be: sampling keeps to it (no speculation with one).
    pub constraint: Option<crate::constrain::Constraint>,
}

impl Turn {
    /// A greedy turn of up to 256 tokens, no checkpoints, no speculation.
    pub fn new(prompt: Prompt) -> Turn {
        Turn {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop_strings: Vec::new(),
            ignore_eos: false,
            max_soft_tokens: 280,
            speculation: Speculation::Off,
            draft_length: DraftLength::default(),
            kv: KvOptions::full(),
            memory_share: Some(crate::memory::DEFAULT_SHARE),
            resume: Vec::new(),
            checkpoint_to: None,
            checkpoint_durability: kv_file::Durability::Synced,
            thinking: None,
            tools: Vec::new(),
            constraint: None,
        }
    }

    /// The template variables this turn renders with.
    pub fn template_options(&self) -> TemplateOptions {
        TemplateOptions { enable_thinking: self.thinking, tools: self.tools.clone() }
    }
}

/// What a turn streams while it decodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnEvent {
    /// A generated token and the text it adds to the reply (empty for a stop token, a piece of
    /// a character still incomplete, text held back while it may begin a stop string, or a
    /// model without a tokenizer).
    Token {
        /// Its id.
        id: u32,
        /// Its text.
        text: String,
    },
}

/// The statistics of one turn, as the app stores and shows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct TurnStats {
    /// Why the reply ended.
    pub stop_reason: StopReason,
    /// Tokens in the prompt, images included.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from a checkpoint (the rest were prefilled).
    #[serde(default)]
    pub reused_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// From the start of the turn (images, template, checkpoint, prefill) to the first token,
    /// in ms.
    pub ttft_ms: f64,
    /// Prefill speed over the tokens actually prefilled, tokens per second.
    #[serde(default)]
    pub prefill_tok_s: f64,
    /// Decode speed after the first token, tokens per second.
    pub decode_tok_s: f64,
    /// Time spent finding, verifying and restoring the checkpoint, in ms (part of the TTFT).
    #[serde(default)]
    pub restore_ms: f64,
    /// MLX's peak memory during the turn, in bytes.
    #[cfg_attr(feature = "ts", ts(type = "number"))]
    pub peak_mem_bytes: u64,
    /// Bytes the KV cache held at the end of the reply.
    #[serde(default)]
    #[cfg_attr(feature = "ts", ts(type = "number"))]
    pub kv_bytes: u64,
    /// The KV cache's storage, layer by layer (`;`-joined signatures, as checkpoints record
    /// it).
    #[serde(default)]
    pub kv_storage: String,
    /// Speculative decoding's counts, when it ran.
    #[serde(default)]
    pub spec: Option<SpecStats>,
}

/// A checkpoint written at a turn's boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenCheckpoint {
    /// The file.
    pub file: kv_file::Written,
    /// The token ids its caches hold.
    pub tokens: Vec<u32>,
}

/// How a turn ended.
#[derive(Debug, Clone)]
pub struct TurnOutcome {
    /// The generated ids (a stop token included).
    pub tokens: Vec<u32>,
    /// The reply's text: every piece streamed, in order.
    pub text: String,
    /// Its statistics.
    pub stats: TurnStats,
    /// The candidate it resumed from.
    pub resumed_from: Option<i64>,
    /// The checkpoint written at its boundary.
    pub checkpoint: Option<WrittenCheckpoint>,
    /// Candidates found damaged or foreign (id, why): the caller drops them.
    pub rejected: Vec<(i64, String)>,
    /// The stop string that ended the reply, if one did.
    pub stop_string: Option<String>,
}

/// A turn [`ChatModel::open`] set up: everything [`ChatModel::close`] needs after the reply.
struct Opened {
    /// When the turn began (TTFT counts from here).
    started: Instant,
    /// The whole prompt, images expanded.
    prompt: Vec<u32>,
    prepared: Vec<crate::vision::PreparedImage>,
    stop_tokens: Vec<u32>,
    /// Candidates found damaged or foreign.
    rejected: Vec<(i64, String)>,
    restore_ms: f64,
    /// The candidate restored and what its file held.
    resumed: Option<(i64, kv_file::Contents)>,
    /// The caches (moved into a batch while the turn decodes in one).
    caches: Vec<Box<dyn crate::cache::Cache>>,
    /// The caches' layout, storage chosen.
    plan: crate::cache::CachePlan,
    /// Prompt positions restored.
    reused: usize,
    /// What generation appends and decodes.
    request: GenerateRequest,
    /// The state at the prompt's history end, for state that cannot be trimmed.
    prompt_state: Option<(Vec<u32>, Vec<crate::cache::CacheState>)>,
    early_prefill_s: f64,
}

/// The reply's text as its tokens stream: each token's piece, stop strings watched, the first
/// token's time.
struct ReplyText<'t> {
    stream: Option<TextStream<'t>>,
    text: String,
    started: Instant,
    first_token: Option<std::time::Duration>,
    failed: Option<Error>,
}

impl<'t> ReplyText<'t> {
    fn new(chat: &'t ChatModel, turn: &Turn, started: Instant) -> ReplyText<'t> {
        ReplyText {
            stream: chat.tokenizer.as_ref().map(|t| {
                let stream = TextStream::new(t, turn.stop_strings.clone());
                if turn.tools.is_empty() {
                    return stream;
                }
                // The markers of tool calls reach the text (Gemma 4's are special tokens).
                let syntax = t.tool_syntax();
                let markers = [syntax.start(), syntax.end(), crate::tools::GEMMA4_QUOTE];
                stream.keeping(markers.iter().filter_map(|m| t.token_id(m)).collect())
            }),
            text: String::new(),
            started,
            first_token: None,
            failed: None,
        }
    }

    /// Streams `token` to `on_event` with its text; [`Flow::Stop`] when a stop string ended
    /// the reply, the text could not be decoded, or `on_event` asked to stop.
    fn push(
        &mut self,
        token: u32,
        stop_tokens: &[u32],
        on_event: &mut dyn FnMut(TurnEvent) -> Flow,
    ) -> Flow {
        let started = self.started;
        self.first_token.get_or_insert_with(|| started.elapsed());
        let mut flow = Flow::Continue;
        let mut piece = String::new();
        if !stop_tokens.contains(&token)
            && let Some(stream) = self.stream.as_mut()
        {
            match stream.push(token) {
                Ok((fresh, stopped)) => {
                    piece = fresh;
                    if stopped {
                        flow = Flow::Stop;
                    }
                }
                Err(e) => {
                    self.failed = Some(e);
                    flow = Flow::Stop;
                }
            }
        }
        self.text.push_str(&piece);
        if on_event(TurnEvent::Token { id: token, text: piece }) == Flow::Stop {
            flow = Flow::Stop;
        }
        flow
    }
}

/// A turn [`ChatModel::admit`] let through, with what admitting it computed: its images read
/// and sized, its prompt rendered, the reply's length within the context, the caches' plan.
/// The turn is opened from it, however long it waits to join a batch: nothing is read or
/// rendered twice.
pub struct Admission {
    /// How long admitting took (it counts toward the time to first token).
    took: Duration,
    prepared: Vec<crate::vision::PreparedImage>,
    prompt: Vec<u32>,
    max_tokens: usize,
    plan: crate::cache::CachePlan,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("images", &self.prepared.len())
            .field("prompt_tokens", &self.prompt.len())
            .field("max_tokens", &self.max_tokens)
            .finish()
    }
}

impl Admission {
    /// Tokens in the prompt, images expanded.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt.len()
    }

    /// Most tokens the reply may generate (the turn's, cut where the context ends).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Whether the turn's KV cache, projected at its longest reply, fits the memory limit
    /// beside the replies decoding (`beside`): now, only once they end, or never (an error).
    fn fit(&self, turn: &Turn, beside: Beside) -> Result<Fit> {
        match turn.memory_share {
            Some(share) => crate::memory::check_kv(
                &self.plan,
                &turn.kv,
                self.prompt.len() + self.max_tokens,
                share,
                beside,
            ),
            None => Ok(Fit::Now),
        }
    }
}

impl ChatModel {
    /// Loads the model and tokenizer in `path`.
    pub fn load(path: &Path, options: &LoadOptions) -> Result<ChatModel> {
        let model = crate::registry::load_model(path, options)?;
        ChatModel::new(path, model, Tokenizer::from_dir(path)?)
    }

    /// A model loaded from `path` with its tokenizer; its checkpoints belong to the folder and
    /// the SHA-256 of its `config.json`.
    pub fn new(
        path: &Path,
        model: Box<dyn Model>,
        tokenizer: Option<Tokenizer>,
    ) -> Result<ChatModel> {
        let config = path.join("config.json");
        let bytes =
            std::fs::read(&config).map_err(|source| Error::Io { path: config.clone(), source })?;
        let identity = Identity {
            model_id: path.to_string_lossy().into_owned(),
            config_hash: kv_file::sha256_hex(&bytes),
        };
        Ok(ChatModel { model, tokenizer, identity, path: path.to_path_buf() })
    }

    /// The model.
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// Its tokenizer, when the folder has one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// Who its checkpoints belong to.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Its folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs two short turns on throwaway caches, so the weights are read and the kernels built
    /// (MLX compiles kernels on first use) before the first reply: its TTFT then measures the
    /// reply's own work. Where long reads run split ([`crate::backend::Ops::split_reads_above`]),
    /// a third turn decodes past that many keys, so a reply that gets that long does not stall
    /// while its kernels compile.
    pub fn warm_up(&self) -> Result<()> {
        const FIRST: usize = 600;
        let model = self.model();
        let mut caches = model.fresh_caches()?;
        // Past a typical sliding window (512), then a short next turn: the shapes of a first
        // turn and of a turn resumed deep into a conversation.
        let mut turns = vec![FIRST, 32];
        if let Some(keys) = model.ops().split_reads_above() {
            // Each turn adds its prompt and one decoded token (the second is sampled, not
            // appended), so this turn's decode step reads `keys + 2` keys.
            let length = (keys + 2).saturating_sub(FIRST + 1 + 32 + 1).max(1);
            if keys + 8 < model.max_context() {
                turns.push(length);
            }
        }
        for length in turns {
            let request = GenerateRequest::new(vec![2; length], 2);
            crate::batch::generate(model, &mut caches, &request, |_| Flow::Continue)?;
        }
        Ok(())
    }

    /// Admits `turn` beside the replies decoding (`beside`; [`Beside::NONE`] alone): its
    /// images read and sized, its prompt rendered within the context, its KV cache within the
    /// memory limit at least once those replies end. Every refusal of a turn is made here,
    /// before anything of it runs; what it computed comes back for the turn to open from.
    pub fn admit(&self, turn: &Turn, beside: Beside) -> Result<Admission> {
        // TTFT counts everything from here: images, template, the checkpoint read, the prefill.
        let started = Instant::now();
        let model = self.model();
        if !turn.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(Error::InvalidRequest(format!(
                "stop strings need a tokenizer; {} has none",
                self.path.display()
            )));
        }
        if turn.constraint.is_some() && turn.speculation != Speculation::Off {
            return Err(Error::InvalidRequest(
                "an output format and speculative decoding do not go together yet".into(),
            ));
        }
        // Every image is read and sized first: a bad file fails here, before any prompt work.
        let prepared = prompt::prepare_images(model, &turn.prompt, turn.max_soft_tokens)?;
        let prompt = prompt::render(self, &turn.prompt, &prepared, true, &turn.template_options())?;
        let limit = model.max_context();
        if prompt.len() >= limit {
            return Err(Error::PromptTooLong { prompt_tokens: prompt.len(), limit });
        }
        // A reply may use the rest of the context, no more.
        let max_tokens = turn.max_tokens.min(limit - prompt.len());
        let plan = model.cache_plan().with_kv(&turn.kv)?;
        let mut admission = Admission { took: Duration::ZERO, prepared, prompt, max_tokens, plan };
        // Refused here only when it would not fit even alone; beside others it may wait.
        admission.fit(turn, beside)?;
        admission.took = started.elapsed();
        Ok(admission)
    }

    /// Answers `turn` (see the module docs), streaming each token to `on_event`, which may stop
    /// it after the token it was given: a [`TurnBatch`] of one, as every reply is a row of a
    /// batch. Draft methods come from `drafters`, which keeps them loaded for the next turns.
    pub fn answer<'c>(
        &'c self,
        turn: &Turn,
        drafters: &mut Drafters,
        on_event: impl FnMut(TurnEvent) -> Flow + 'c,
    ) -> Result<TurnOutcome> {
        let mut batch = TurnBatch::new(self);
        let admission = batch.admit(turn)?;
        match batch.join(0, turn, admission, drafters, on_event)? {
            Joined::Ended(outcome) => Ok(*outcome),
            Joined::Decoding => loop {
                if let Some((_, outcome)) = batch.step()?.pop() {
                    return outcome;
                }
            },
            Joined::Waits { .. } | Joined::Behind(_) => {
                Err(Error::InvalidRequest("a turn alone waited for others to end".into()))
            }
        }
    }

    /// What [`ChatModel::answer`] does before the first token, once the turn is admitted:
    /// its best checkpoint restored, the request made (and, for state that cannot be trimmed,
    /// the prompt's history prefilled).
    fn open(&self, turn: &Turn, admission: Admission) -> Result<Opened> {
        let model = self.model();
        let Admission { took, prepared, prompt, max_tokens, plan } = admission;
        // The time to first token counts admitting, not waiting to join a batch.
        let started = Instant::now().checked_sub(took).unwrap_or_else(Instant::now);
        let mut stop_tokens = model.eos_token_ids();
        if let Some(tokenizer) = &self.tokenizer {
            stop_tokens.extend_from_slice(tokenizer.stop_tokens());
        }
        if turn.ignore_eos {
            stop_tokens.clear();
        }

        let mut rejected = Vec::new();
        let restore_started = Instant::now();
        let resumed = resume::restore(self, &plan, &turn.resume, &prompt, &mut rejected)?;
        let restore_ms = restore_started.elapsed().as_secs_f64() * 1e3;
        let (mut caches, reused) = (resumed.caches, resumed.reused);
        let images = prompt::encode_after(model, &prompt, &prepared, reused)?;
        let constraint = match (&turn.constraint, &self.tokenizer) {
            (None, _) => None,
            (Some(c), Some(tokenizer)) => {
                let c = match c {
                    crate::constrain::Constraint::ToolCall { name } => {
                        let syntax = tokenizer.tool_syntax();
                        let grammar = syntax
                            .call_grammar(&turn.tools, name.as_deref(), |m| tokenizer.token_id(m))
                            .map_err(Error::InvalidRequest)?;
                        crate::constrain::Constraint::Lark(grammar)
                    }
                    other => other.clone(),
                };
                Some(tokenizer.vocabulary()?.grammar(&c, &stop_tokens)?)
            }
            (Some(_), None) => {
                return Err(Error::InvalidRequest(
                    "an output format needs the model's tokenizer.json".into(),
                ));
            }
        };
        let mut request = GenerateRequest {
            sampling: turn.sampling.clone(),
            stop_tokens: stop_tokens.clone(),
            images,
            constraint,
            ..GenerateRequest::new(prompt[reused..].to_vec(), max_tokens)
        };
        // State that cannot be trimmed (recurrent layers) cannot go back from the reply to the
        // boundary the next turn starts with when the reply re-tokenizes differently: keep
        // its state at the end of the prompt (all but its last token) to write the boundary
        // from.
        let prefill_started = Instant::now();
        let prompt_state = match &turn.checkpoint_to {
            Some(_) if plan.has_recurrent_state() && request.images.is_empty() => {
                let options = turn.template_options();
                let split = prompt::history_end(self, &turn.prompt, &prompt, &prepared, &options)?;
                resume::prompt_state(model, &mut caches, &prompt, reused, split, &mut request)?
            }
            _ => None,
        };
        let early_prefill_s = prefill_started.elapsed().as_secs_f64();
        Ok(Opened {
            started,
            prompt,
            prepared,
            stop_tokens,
            rejected,
            restore_ms,
            resumed: resumed.from,
            caches,
            plan,
            reused,
            request,
            prompt_state,
            early_prefill_s,
        })
    }

    /// What [`ChatModel::answer`] does after the last token: the checkpoint written at the
    /// turn's boundary (with the draft method's state), the statistics.
    fn close(
        &self,
        turn: &Turn,
        opened: Opened,
        generation: Generation,
        spec: Option<SpecStats>,
        reply: ReplyText<'_>,
        method: Option<&mut dyn DraftMethod>,
    ) -> Result<TurnOutcome> {
        let Opened { prompt, prepared, mut caches, prompt_state, .. } = opened;
        let stop_string = reply.stream.as_ref().and_then(|s| s.stopped_by()).map(str::to_string);
        let ReplyText { text, first_token, failed, .. } = reply;
        if let Some(e) = failed {
            return Err(e);
        }
        let checkpoint = match &turn.checkpoint_to {
            Some(path) => {
                let boundary = prompt::boundary(
                    self,
                    &turn.prompt,
                    &prompt,
                    &prepared,
                    &generation.tokens,
                    &text,
                    &turn.template_options(),
                )?;
                let attachments = match method.map(|m| m.checkpoint(&boundary)) {
                    Some(Ok(attachment)) => attachment.into_iter().collect(),
                    Some(Err(e)) => {
                        tracing::warn!("the draft method's state is not kept: {e}");
                        Vec::new()
                    }
                    None => Vec::new(),
                };
                let held: Vec<u32> = prompt
                    .iter()
                    .chain(&generation.tokens)
                    .copied()
                    .take(stack_offset(&caches))
                    .collect();
                // A template may render the reply otherwise once a later turn follows (Qwen's
                // drops its thinking): state that cannot be trimmed is then kept where the
                // history ends instead.
                let at_prompt = match &prompt_state {
                    Some((tokens, states)) => {
                        let options = turn.template_options();
                        let rewritten = !prompt::later_turns_keep(
                            self,
                            &turn.prompt,
                            &prepared,
                            &boundary,
                            &text,
                            &options,
                        )?;
                        Some((tokens.as_slice(), states.as_slice(), rewritten))
                    }
                    None => None,
                };
                // The reply stands without its checkpoint (a full disk, say): log and go on.
                resume::write_boundary(
                    self,
                    boundary,
                    held,
                    &mut caches,
                    at_prompt,
                    &resume::Destination {
                        path,
                        durability: turn.checkpoint_durability,
                        attachments: &attachments,
                    },
                )
                .unwrap_or_else(|e| {
                    tracing::warn!(path = %path.display(), "no KV checkpoint written: {e}");
                    None
                })
            }
            None => None,
        };
        let s = &generation.stats;
        let reused = opened.reused;
        let kv_bytes =
            caches.iter().map(|c| c.bytes_per_token() * c.stored_positions()).sum::<usize>();
        let stats = TurnStats {
            stop_reason: generation.stop_reason,
            prompt_tokens: prompt.len(),
            reused_tokens: reused,
            generated_tokens: s.generated_tokens,
            ttft_ms: first_token.map_or(s.ttft_ms, |t| t.as_secs_f64() * 1e3),
            prefill_tok_s: match prompt_state {
                // The prompt was prefilled in two steps: up to where its history ends, then the rest.
                Some(_) if s.prefill_tok_s > 0.0 => {
                    (prompt.len() - reused) as f64
                        / (opened.early_prefill_s + 1.0 / s.prefill_tok_s)
                }
                _ => s.prefill_tok_s,
            },
            decode_tok_s: s.decode_tok_s,
            restore_ms: opened.restore_ms,
            peak_mem_bytes: s.peak_mem_bytes as u64,
            kv_bytes: kv_bytes as u64,
            kv_storage: kv_file::stack_signature(&caches),
            spec,
        };
        Ok(TurnOutcome {
            tokens: generation.tokens,
            text,
            stats,
            resumed_from: opened.resumed.map(|(id, _)| id),
            checkpoint,
            rejected: opened.rejected,
            stop_string,
        })
    }
}
