//! The engine actor: one thread owns the model and every MLX array (MLX streams belong to the
//! thread that made them); the rest of the app sends it commands and receives events.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::generate::{Flow, GenerateRequest, StopReason, generate, image_runs, prefill};
use engine::kv_file::{self, Identity};
use engine::models::{self, Model};
use engine::sampling::SamplingParams;
use engine::speculative::assistant::Gemma4Assistant;
use engine::speculative::draft_model::DraftModel;
use engine::speculative::lookup::PromptLookup;
use engine::speculative::{self, DraftLength, DraftMethod, SpecStats};
use engine::tokenizer::{Content, Message, Part, TextStream, Tokenizer};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::view::ErrorKind;

/// What a loaded model can do, for the UI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The model folder.
    pub path: PathBuf,
    /// Whether it takes images.
    pub vision: bool,
    /// Its context length.
    pub max_context: usize,
    /// Who its KV checkpoints belong to (the folder and the SHA-256 of its config).
    pub identity: Identity,
}

/// A message of the conversation to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Its text.
    pub text: String,
    /// Its images, in order (placed before the text).
    pub images: Vec<PathBuf>,
}

/// A checkpoint the reply may resume from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeCandidate {
    /// Its index row.
    pub id: i64,
    /// Its file.
    pub path: PathBuf,
    /// The file's recorded SHA-256.
    pub sha256: String,
    /// The token ids its caches hold.
    pub tokens: Vec<u32>,
}

/// One reply to generate.
#[derive(Debug, Clone)]
pub struct ReplyRequest {
    /// The conversation so far, last message the user's.
    pub messages: Vec<TurnMessage>,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Soft tokens per image.
    pub max_soft_tokens: usize,
    /// Checkpoints of this conversation's earlier nodes, longest first.
    pub resume: Vec<ResumeCandidate>,
    /// Where to write the checkpoint of the conversation after this reply (`None`: don't).
    pub checkpoint_to: Option<PathBuf>,
    /// The prompt as token ids, verbatim (no template, no tokenizer): raw token conversations.
    pub raw_prompt: Option<Vec<u32>>,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// How to decode.
    pub speculation: Speculation,
}

/// How a reply is decoded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Speculation {
    /// Plainly.
    #[default]
    Off,
    /// With prompt lookup.
    Lookup,
    /// With the draft model in this folder.
    Draft(PathBuf),
    /// With the Gemma 4 assistant in this folder.
    Assistant(PathBuf),
}

/// A checkpoint written after a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenCheckpoint {
    /// The file.
    pub file: kv_file::Written,
    /// The token ids its caches hold.
    pub tokens: Vec<u32>,
}

/// What a reply emits while it is generated.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyEvent {
    /// New text to append.
    Text {
        /// The piece.
        text: String,
    },
    /// Generation ended.
    Done {
        /// Prompt tokens restored from a checkpoint instead of prefilled.
        reused_tokens: usize,
        /// The checkpoint resumed from.
        resumed_from: Option<i64>,
        /// The checkpoint written after the reply.
        checkpoint: Option<Box<WrittenCheckpoint>>,
        /// Checkpoints found damaged or foreign on the way (id, why): the caller drops them.
        rejected: Vec<(i64, String)>,
        /// The generated ids (a stop token included).
        tokens: Vec<u32>,
        /// Prefill speed over the tokens actually prefilled.
        prefill_tok_s: f64,
        /// Time spent finding, verifying and restoring the checkpoint, ms (part of TTFT).
        restore_ms: f64,
        /// `stop`, `length` or `stopped`.
        stop_reason: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        generated_tokens: usize,
        /// Time to first token, ms.
        ttft_ms: f64,
        /// Decode speed.
        decode_tok_s: f64,
        /// Peak memory, bytes.
        peak_mem_bytes: usize,
        /// Speculative decoding's counts, when it ran.
        spec: Option<SpecStats>,
    },
    /// Generation failed; nothing more comes.
    Failed {
        /// A readable message.
        message: String,
        /// What kind of failure.
        kind: ErrorKind,
    },
}

enum Command {
    Load {
        path: PathBuf,
        progress: mpsc::UnboundedSender<(String, u32, u32)>,
        cancel: Arc<AtomicBool>,
        reply: oneshot::Sender<Result<ModelInfo>>,
    },
    Reply {
        request: ReplyRequest,
        events: mpsc::UnboundedSender<ReplyEvent>,
        cancel: Arc<AtomicBool>,
    },
    Shutdown,
}

/// A handle to the engine thread. Cheap to clone. The thread ends, freeing the model, when
/// [`Engine::shutdown`] is called or the last handle is dropped; both wait for it, so no MLX
/// work is still running while the process exits (MLX's globals are torn down at exit).
#[derive(Clone, Debug)]
pub struct Engine {
    commands: std::sync::mpsc::Sender<Command>,
    thread: Arc<EngineThread>,
}

/// Joins the engine thread when the last handle goes (after its sender has closed the channel).
#[derive(Debug)]
struct EngineThread(std::sync::Mutex<Option<std::thread::JoinHandle<()>>>);

impl EngineThread {
    fn join(&self) {
        let handle = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        self.join();
    }
}

impl Loaded {
    fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| Error::Reported {
            kind: ErrorKind::ModelLoad,
            message: format!(
                "{} has no tokenizer.json: only raw token ids can be sent to it",
                self.info.path.display()
            ),
        })
    }
}

struct Loaded {
    model: Box<dyn Model>,
    /// Absent for a checkpoint without tokenizer files (raw token conversations only).
    tokenizer: Option<Tokenizer>,
    info: ModelInfo,
}

impl Engine {
    /// Starts the engine thread.
    pub fn start() -> Result<Engine> {
        let (commands, inbox) = std::sync::mpsc::channel::<Command>();
        let thread = std::thread::Builder::new()
            .name("quince-engine".into())
            .spawn(move || {
                let mut loaded: Option<Loaded> = None;
                // The last draft model and assistant used, kept loaded for the next reply.
                let mut drafters = Drafters::default();
                for command in inbox {
                    match command {
                        Command::Shutdown => break,
                        Command::Load { path, progress, cancel, reply } => {
                            let result = load(&path, &progress, &cancel);
                            let _ = reply.send(
                                result
                                    .as_ref()
                                    .map(|l| l.info.clone())
                                    .map_err(Error::clone_message),
                            );
                            if let Ok(model) = result {
                                loaded = Some(model);
                            }
                        }
                        Command::Reply { request, events, cancel } => match &loaded {
                            None => {
                                let _ = events.send(ReplyEvent::Failed {
                                    message: "no model is loaded".into(),
                                    kind: ErrorKind::ModelMissing,
                                });
                            }
                            Some(model) => reply(model, &mut drafters, &request, &events, &cancel),
                        },
                    }
                }
            })
            .map_err(|e| Error::Engine(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { commands, thread: Arc::new(EngineThread(std::sync::Mutex::new(Some(thread)))) })
    }

    /// Stops the engine thread after the command it is running and waits for it; later
    /// commands fail with "the engine stopped".
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        self.thread.join();
    }

    /// Loads the model at `path`, replacing the current one when it succeeds. Stages arrive on
    /// `progress` as (stage, done, total); setting `cancel` stops between stages (the current
    /// model stays).
    pub async fn load(
        &self,
        path: PathBuf,
        progress: mpsc::UnboundedSender<(String, u32, u32)>,
        cancel: Arc<AtomicBool>,
    ) -> Result<ModelInfo> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Load { path, progress, cancel, reply })
            .map_err(|_| Error::Engine("the engine stopped".into()))?;
        answer.await.map_err(|_| Error::Engine("the engine stopped".into()))?
    }

    /// Starts a reply; events arrive on the returned channel until `Done` or `Failed`. Setting
    /// `cancel` stops it after the current token.
    pub fn reply(
        &self,
        request: ReplyRequest,
        cancel: Arc<AtomicBool>,
    ) -> Result<mpsc::UnboundedReceiver<ReplyEvent>> {
        let (events, receiver) = mpsc::unbounded_channel();
        self.commands
            .send(Command::Reply { request, events, cancel })
            .map_err(|_| Error::Engine("the engine stopped".into()))?;
        Ok(receiver)
    }
}

/// Runs two short turns on throwaway caches, so the weights are read and the kernels built
/// (MLX compiles kernels on first use) before the first reply: its TTFT then measures the
/// reply's own work. Where long reads run split ([`engine::cache::split_reads_above`], CUDA),
/// a third turn decodes past that many keys, so a reply that gets that long does not stall
/// while its kernels compile.
fn warm_up(model: &dyn Model) -> Result<()> {
    let mut caches = model.new_caches()?;
    // Past a typical sliding window (512), then a short next turn: the shapes of a first
    // turn and of a turn resumed deep into a conversation.
    let mut turns = vec![WARM_UP_TOKENS, 32];
    if let Some(keys) = engine::cache::split_reads_above() {
        // Each turn adds its prompt and one decoded token (the second is sampled, not
        // appended), so this turn's decode step reads `keys + 2` keys.
        let length = (keys + 2).saturating_sub(WARM_UP_TOKENS + 1 + 32 + 1).max(1);
        if keys + 8 < model.max_context() {
            turns.push(length);
        }
    }
    for length in turns {
        let request = GenerateRequest::new(vec![2; length], 2);
        generate(model, &mut caches, &request, |_| Flow::Continue)?;
    }
    Ok(())
}

/// Prompt length of the warm-up's first turn.
const WARM_UP_TOKENS: usize = 600;

/// Load stages, in order.
const LOAD_STAGES: [&str; 3] = ["Reading the weights", "Loading the tokenizer", "Warming up"];

fn load(
    path: &std::path::Path,
    progress: &mpsc::UnboundedSender<(String, u32, u32)>,
    cancel: &AtomicBool,
) -> Result<Loaded> {
    if !path.join("config.json").is_file() {
        return Err(Error::ModelMissing(format!(
            "no model at {}: the folder is gone or holds no config.json",
            path.display()
        )));
    }
    let total = LOAD_STAGES.len() as u32;
    let stage = |i: usize| -> Result<()> {
        if cancel.load(Ordering::SeqCst) {
            return Err(Error::Cancelled);
        }
        let _ = progress.send((LOAD_STAGES[i].to_string(), i as u32, total));
        Ok(())
    };
    stage(0)?;
    let model = models::load(path)?;
    stage(1)?;
    let tokenizer = Tokenizer::from_dir(path)?;
    stage(2)?;
    warm_up(model.as_ref())?;
    if cancel.load(Ordering::SeqCst) {
        return Err(Error::Cancelled);
    }
    let config = std::fs::read(path.join("config.json")).map_err(|e| Error::Reported {
        kind: ErrorKind::ModelLoad,
        message: format!("config.json: {e}"),
    })?;
    let info = ModelInfo {
        path: path.to_path_buf(),
        vision: model.image_token_id().is_some(),
        max_context: model.max_context(),
        identity: Identity {
            model_id: path.to_string_lossy().into_owned(),
            config_hash: kv_file::sha256_hex(&config),
        },
    };
    Ok(Loaded { model, tokenizer, info })
}

/// The rendered, image-expanded token ids of `messages` (with the generation prompt when
/// `open`), and each image prepared, in prompt order.
fn render(
    loaded: &Loaded,
    messages: &[TurnMessage],
    prepared: &[engine::vision::gemma4::PreparedImage],
    open: bool,
) -> Result<Vec<u32>> {
    let model = loaded.model.as_ref();
    let messages: Vec<Message> = messages
        .iter()
        .map(|m| {
            if m.images.is_empty() {
                Message::text(&m.role, &m.text)
            } else {
                let mut parts = vec![Part::Image; m.images.len()];
                parts.push(Part::Text { text: m.text.clone() });
                Message { role: m.role.clone(), content: Content::Parts(parts) }
            }
        })
        .collect();
    let tokens = loaded.tokenizer()?.encode_chat(&messages, open)?;
    if prepared.is_empty() {
        return Ok(tokens);
    }
    let (Some(image), Some((boi, eoi))) = (model.image_token_id(), model.boi_eoi()) else {
        return Err(Error::Invalid("this model does not take images".into()));
    };
    let counts: Vec<usize> = prepared.iter().map(|p| p.soft_tokens).collect();
    Ok(engine::vision::gemma4::expand_image_tokens(&tokens, image, boi, eoi, &counts)?)
}

/// Where a cut at `at` would fall inside a run of image tokens, the run's start instead (a
/// block is never split).
fn cut_outside_images(tokens: &[u32], image: Option<u32>, at: usize) -> usize {
    let Some(image) = image else { return at };
    image_runs(tokens, image)
        .into_iter()
        .find(|&(start, len)| start < at && at < start + len)
        .map_or(at, |(start, _)| start)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Restores the longest usable checkpoint into `caches`: one whose tokens share a prefix with
/// `prompt` (trimmed back to that prefix where the storages allow). Returns the positions
/// reused and the checkpoint's id with what its file held (every token, and the attachments);
/// damaged or foreign files are added to `rejected`.
fn resume(
    loaded: &Loaded,
    candidates: &[ResumeCandidate],
    prompt: &[u32],
    caches: &mut Vec<Box<dyn engine::cache::AttentionCache>>,
    rejected: &mut Vec<(i64, String)>,
) -> Result<(usize, Option<(i64, kv_file::Contents)>)> {
    let model = loaded.model.as_ref();
    for candidate in candidates {
        let shared = common_prefix(&candidate.tokens, prompt).min(prompt.len() - 1);
        let keep = cut_outside_images(prompt, model.image_token_id(), shared);
        if keep == 0 {
            continue;
        }
        let mut restored = model.new_caches()?;
        let read =
            kv_file::read(&candidate.path, &candidate.sha256, &loaded.info.identity, &mut restored);
        let contents = match read {
            Ok(contents) => contents,
            Err(error) => {
                rejected.push((candidate.id, error.to_string()));
                continue;
            }
        };
        let tokens = &contents.tokens;
        if *tokens != candidate.tokens {
            rejected.push((candidate.id, "its tokens differ from the index".into()));
            continue;
        }
        let drop = tokens.len() - keep;
        if drop > 0 {
            if !restored.iter().all(|c| c.is_trimmable()) {
                continue;
            }
            for cache in &mut restored {
                cache.trim(drop)?;
            }
        }
        *caches = restored;
        return Ok((keep, Some((candidate.id, contents))));
    }
    Ok((0, None))
}

fn reply(
    loaded: &Loaded,
    drafters: &mut Drafters,
    request: &ReplyRequest,
    events: &mpsc::UnboundedSender<ReplyEvent>,
    cancel: &AtomicBool,
) {
    // TTFT counts everything from here: images, template, the checkpoint read, the prefill.
    let started = std::time::Instant::now();
    let outcome = (|| -> Result<()> {
        let model = loaded.model.as_ref();
        // Every image of the conversation is read and sized first: a bad file fails here,
        // before any prompt work. Only those after the restored prefix are encoded.
        let mut prepared = Vec::new();
        for path in request.messages.iter().flat_map(|m| &m.images) {
            if model.image_token_id().is_none() {
                return Err(Error::Invalid("this model does not take images".into()));
            }
            let rgb = engine::vision::image::load_rgb(path)?;
            prepared.push(engine::vision::gemma4::preprocess(&rgb, request.max_soft_tokens)?);
        }
        let prompt = match &request.raw_prompt {
            Some(ids) if prepared.is_empty() => ids.clone(),
            Some(_) => return Err(Error::Invalid("raw token turns take no images".into())),
            None => render(loaded, &request.messages, &prepared, true)?,
        };
        let limit = model.max_context();
        if prompt.len() >= limit {
            return Err(Error::Reported {
                kind: ErrorKind::PromptTooLong,
                message: format!(
                    "This conversation is {} tokens long, more than the model's context of {limit} \
                     tokens. Start a new chat, or edit an earlier message to shorten it.",
                    prompt.len()
                ),
            });
        }
        // A reply may use the rest of the context, no more.
        let max_tokens = request.max_tokens.min(limit - prompt.len());
        let mut stop_tokens = model.eos_token_ids();
        if let Some(tokenizer) = &loaded.tokenizer {
            stop_tokens.extend_from_slice(tokenizer.stop_tokens());
        }
        if request.ignore_eos {
            stop_tokens.clear();
        }

        let mut caches = model.new_caches()?;
        let mut rejected = Vec::new();
        let resume_started = std::time::Instant::now();
        let (reused, resumed) =
            resume(loaded, &request.resume, &prompt, &mut caches, &mut rejected)?;
        let resumed_from = resumed.as_ref().map(|(id, _)| *id);
        if resumed_from.is_some() {
            let buffers: Vec<mlx::Array> = caches.iter().flat_map(|c| c.buffers()).collect();
            mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
        }
        let restore_ms = resume_started.elapsed().as_secs_f64() * 1e3;
        let runs = model.image_token_id().map(|t| image_runs(&prompt, t)).unwrap_or_default();
        let mut images = Vec::new();
        for ((start, _), image) in runs.iter().zip(&prepared) {
            if *start >= reused {
                images.push(model.encode_image(&image.pixels)?);
            }
        }
        let generation = GenerateRequest {
            sampling: request.sampling.clone(),
            stop_tokens: stop_tokens.clone(),
            images,
            ..GenerateRequest::new(prompt[reused..].to_vec(), max_tokens)
        };
        let mut stream = loaded.tokenizer.as_ref().map(|t| TextStream::new(t, Vec::new()));
        let mut text = String::new();
        let mut first_token = None;
        let on_token = |token| {
            first_token.get_or_insert_with(|| started.elapsed());
            if !stop_tokens.contains(&token)
                && let Some(stream) = stream.as_mut()
                && let Ok((piece, _)) = stream.push(token)
                && !piece.is_empty()
            {
                text.push_str(&piece);
                let _ = events.send(ReplyEvent::Text { text: piece });
            }
            if cancel.load(Ordering::SeqCst) { Flow::Stop } else { Flow::Continue }
        };
        let mut lookup = PromptLookup::default();
        let mut method: Option<&mut dyn DraftMethod> = match &request.speculation {
            Speculation::Off => None,
            Speculation::Lookup => Some(&mut lookup),
            Speculation::Draft(path) => Some(drafters.draft(loaded, path)?),
            Speculation::Assistant(path) => Some(drafters.assistant(path)?),
        };
        // A drafter made for another model is refused here, with the way out.
        if let (Some(m), Speculation::Draft(path) | Speculation::Assistant(path)) =
            (method.as_deref_mut(), &request.speculation)
        {
            let what = if m.name() == "assistant" { "assistant" } else { "draft model" };
            m.bind(model).map_err(|e| unusable(what, path, e))?;
        }
        // The method's own state kept with the checkpoint (a draft model's caches).
        if let (Some(m), Some((_, contents))) = (method.as_deref_mut(), &resumed) {
            m.resume(&contents.attachments, &contents.tokens)?;
        }
        let result = match method.as_deref_mut() {
            Some(method) => speculative::generate(
                model,
                &mut caches,
                &prompt[..reused],
                &generation,
                method,
                DraftLength::default(),
                on_token,
            )?,
            None => generate(model, &mut caches, &generation, on_token)?,
        };
        let checkpoint = match &request.checkpoint_to {
            Some(path) => {
                let held: Vec<u32> = prompt
                    .iter()
                    .chain(&result.tokens)
                    .copied()
                    .take(caches.first().map_or(0, |c| c.offset()))
                    .collect();
                let boundary = match &request.raw_prompt {
                    // Raw turns: the next prompt is this one and the reply, verbatim.
                    Some(_) => prompt.iter().chain(&result.tokens).copied().collect(),
                    None => {
                        let mut turn = request.messages.clone();
                        turn.push(TurnMessage {
                            role: "assistant".into(),
                            text: text.clone(),
                            images: Vec::new(),
                        });
                        render(loaded, &turn, &prepared, false)?
                    }
                };
                let attachments = match method.map(|m| m.checkpoint(&boundary)) {
                    Some(Ok(attachment)) => attachment.into_iter().collect(),
                    Some(Err(e)) => {
                        tracing::warn!("the draft method's state is not kept: {e}");
                        Vec::new()
                    }
                    None => Vec::new(),
                };
                // The reply stands without its checkpoint (a full disk, say): log and go on.
                checkpoint_after(loaded, boundary, held, &mut caches, path, &attachments)
                    .unwrap_or_else(|e| {
                        tracing::warn!(path = %path.display(), "no KV checkpoint written: {e}");
                        None
                    })
            }
            None => None,
        };
        let s = &result.stats;
        let _ = events.send(ReplyEvent::Done {
            reused_tokens: reused,
            resumed_from,
            checkpoint,
            rejected,
            stop_reason: match result.stop_reason {
                StopReason::Stopped => "stopped".into(),
                other => other.as_str().into(),
            },
            prompt_tokens: prompt.len(),
            tokens: result.tokens.clone(),
            prefill_tok_s: s.prefill_tok_s,
            restore_ms,
            generated_tokens: s.generated_tokens,
            ttft_ms: first_token.map_or(s.ttft_ms, |t| t.as_secs_f64() * 1e3),
            decode_tok_s: s.decode_tok_s,
            peak_mem_bytes: s.peak_mem_bytes,
            spec: result.spec.clone(),
        });
        Ok(())
    })();
    if let Err(error) = outcome {
        let _ = events.send(ReplyEvent::Failed { message: error.to_string(), kind: error.kind() });
    }
}

/// Draft models and assistants, loaded on first use and kept for the next replies.
#[derive(Default)]
struct Drafters {
    draft: Option<(PathBuf, DraftModel)>,
    assistant: Option<(PathBuf, Gemma4Assistant)>,
}

/// The error for a drafter that cannot serve this model: it says how to get out of it.
fn unusable(what: &str, path: &std::path::Path, e: impl std::fmt::Display) -> Error {
    Error::Reported {
        kind: ErrorKind::ModelLoad,
        message: format!(
            "The {what} in {} cannot be used: {e}. Pick another one, or turn speculative \
             decoding off in this conversation's settings.",
            path.display()
        ),
    }
}

impl Drafters {
    fn draft(&mut self, loaded: &Loaded, path: &std::path::Path) -> Result<&mut DraftModel> {
        if self.draft.as_ref().is_none_or(|(p, _)| p != path) {
            self.draft = None;
            let model = DraftModel::check_same_tokenizer(&loaded.info.path, path)
                .and_then(|()| DraftModel::load(path))
                .map_err(|e| unusable("draft model", path, e))?;
            self.draft = Some((path.to_path_buf(), model));
        }
        match &mut self.draft {
            Some((_, model)) => Ok(model),
            None => Err(Error::Engine("the draft model vanished".into())),
        }
    }

    fn assistant(&mut self, path: &std::path::Path) -> Result<&mut Gemma4Assistant> {
        if self.assistant.as_ref().is_none_or(|(p, _)| p != path) {
            self.assistant = None;
            let model = Gemma4Assistant::load(path).map_err(|e| unusable("assistant", path, e))?;
            self.assistant = Some((path.to_path_buf(), model));
        }
        match &mut self.assistant {
            Some((_, model)) => Ok(model),
            None => Err(Error::Engine("the assistant vanished".into())),
        }
    }
}

/// Brings `caches` (holding `held`) to the turn boundary the next prompt will start with —
/// the conversation with this reply, rendered without a generation prompt — and writes them to
/// `path`. The reply's own
/// tokens may re-tokenize differently: the caches are trimmed back to the shared prefix where
/// the storages allow it; where they cannot (a ring that wrapped), no checkpoint is written
/// and the next turn resumes from an earlier one.
fn checkpoint_after(
    loaded: &Loaded,
    boundary: Vec<u32>,
    held: Vec<u32>,
    caches: &mut [Box<dyn engine::cache::AttentionCache>],
    path: &std::path::Path,
    attachments: &[kv_file::Attachment],
) -> Result<Option<Box<WrittenCheckpoint>>> {
    let keep = cut_outside_images(
        &boundary,
        loaded.model.image_token_id(),
        common_prefix(&held, &boundary),
    );
    let drop = held.len() - keep;
    if drop > 0 {
        if !caches.iter().all(|c| c.is_trimmable()) {
            return Ok(None);
        }
        for cache in caches.iter_mut() {
            cache.trim(drop)?;
        }
    }
    if boundary.len() > keep {
        prefill(loaded.model.as_ref(), caches, &boundary[keep..], 512)?;
    }
    let file = kv_file::write(path, caches, &boundary, &loaded.info.identity, attachments)?;
    Ok(Some(Box::new(WrittenCheckpoint { file, tokens: boundary })))
}
