//! The engine actor: one thread owns the model and every MLX array (MLX streams belong to the
//! thread that made them); the rest of the app sends it commands and receives events.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::generate::{Flow, GenerateRequest, StopReason, generate};
use engine::models::{self, Model};
use engine::sampling::SamplingParams;
use engine::tokenizer::{Content, Message, Part, TextStream, Tokenizer};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::view::ErrorKind;

/// What a loaded model can do, for the UI.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ModelInfo {
    /// The model folder.
    pub path: PathBuf,
    /// Whether it takes images.
    pub vision: bool,
    /// Its context length.
    pub max_context: usize,
}

/// One reply to generate.
#[derive(Debug, Clone)]
pub struct ReplyRequest {
    /// The conversation so far, last message the user's.
    pub messages: Vec<(String, String)>,
    /// Images of the last user message, in order.
    pub images: Vec<PathBuf>,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Soft tokens per image.
    pub max_soft_tokens: usize,
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
}

/// A handle to the engine thread. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Engine {
    commands: std::sync::mpsc::Sender<Command>,
}

struct Loaded {
    model: Box<dyn Model>,
    tokenizer: Tokenizer,
    info: ModelInfo,
}

impl Engine {
    /// Starts the engine thread.
    pub fn start() -> Result<Engine> {
        let (commands, inbox) = std::sync::mpsc::channel::<Command>();
        std::thread::Builder::new()
            .name("quince-engine".into())
            .spawn(move || {
                let mut loaded: Option<Loaded> = None;
                for command in inbox {
                    match command {
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
                            Some(model) => reply(model, &request, &events, &cancel),
                        },
                    }
                }
            })
            .map_err(|e| Error::Engine(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { commands })
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

/// Load stages, in order.
const LOAD_STAGES: [&str; 2] = ["Reading the weights", "Loading the tokenizer"];

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
    let tokenizer = Tokenizer::from_dir(path)?.ok_or_else(|| Error::Reported {
        kind: ErrorKind::ModelLoad,
        message: format!("{} has no tokenizer.json", path.display()),
    })?;
    if cancel.load(Ordering::SeqCst) {
        return Err(Error::Cancelled);
    }
    let info = ModelInfo {
        path: path.to_path_buf(),
        vision: model.image_token_id().is_some(),
        max_context: model.max_context(),
    };
    Ok(Loaded { model, tokenizer, info })
}

fn reply(
    loaded: &Loaded,
    request: &ReplyRequest,
    events: &mpsc::UnboundedSender<ReplyEvent>,
    cancel: &AtomicBool,
) {
    let outcome = (|| -> Result<()> {
        let model = loaded.model.as_ref();
        // Images first: a bad file fails here, before any prompt work.
        let mut features = Vec::new();
        for path in &request.images {
            if model.image_token_id().is_none() {
                return Err(Error::Invalid("this model does not take images".into()));
            }
            let rgb = engine::vision::image::load_rgb(path)?;
            let prepared = engine::vision::gemma4::preprocess(&rgb, request.max_soft_tokens)?;
            features.push(model.encode_image(&prepared.pixels)?);
        }
        let last = request.messages.len().saturating_sub(1);
        let messages: Vec<Message> = request
            .messages
            .iter()
            .enumerate()
            .map(|(i, (role, text))| {
                if i == last && !features.is_empty() {
                    let mut parts = vec![Part::Image; features.len()];
                    parts.push(Part::Text { text: text.clone() });
                    Message { role: role.clone(), content: Content::Parts(parts) }
                } else {
                    Message::text(role, text)
                }
            })
            .collect();
        let mut prompt = loaded.tokenizer.encode_chat(&messages, true)?;
        if !features.is_empty() {
            let (Some(image), Some((boi, eoi))) = (model.image_token_id(), model.boi_eoi()) else {
                return Err(Error::Invalid("this model does not take images".into()));
            };
            let counts: Vec<usize> = features
                .iter()
                .map(|f| f.dim(0).map(|n| n as usize))
                .collect::<mlx::Result<_>>()?;
            prompt =
                engine::vision::gemma4::expand_image_tokens(&prompt, image, boi, eoi, &counts)?;
        }
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
        stop_tokens.extend_from_slice(loaded.tokenizer.stop_tokens());
        let generation = GenerateRequest {
            sampling: request.sampling.clone(),
            stop_tokens: stop_tokens.clone(),
            images: features,
            ..GenerateRequest::new(prompt, max_tokens)
        };
        let mut caches = model.new_caches()?;
        let mut stream = TextStream::new(&loaded.tokenizer, Vec::new());
        let result = generate(model, &mut caches, &generation, |token| {
            if !stop_tokens.contains(&token)
                && let Ok((text, _)) = stream.push(token)
                && !text.is_empty()
            {
                let _ = events.send(ReplyEvent::Text { text });
            }
            if cancel.load(Ordering::SeqCst) { Flow::Stop } else { Flow::Continue }
        })?;
        let s = &result.stats;
        let _ = events.send(ReplyEvent::Done {
            stop_reason: match result.stop_reason {
                StopReason::Stopped => "stopped".into(),
                other => other.as_str().into(),
            },
            prompt_tokens: s.prompt_tokens,
            generated_tokens: s.generated_tokens,
            ttft_ms: s.ttft_ms,
            decode_tok_s: s.decode_tok_s,
            peak_mem_bytes: s.peak_mem_bytes,
        });
        Ok(())
    })();
    if let Err(error) = outcome {
        let _ = events.send(ReplyEvent::Failed { message: error.to_string(), kind: error.kind() });
    }
}
