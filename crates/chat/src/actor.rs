//! The engine actor: one thread owns the model and every MLX array (MLX streams belong to the
//! thread that made them); the rest of the app sends it commands and receives events. A reply
//! is one [`engine::turn::Turn`], and every reply is a row of one [`TurnBatch`] (each joins
//! after its own prefill and leaves when it ends, whatever it drafts with and whatever KV
//! storage its chat chose; each reply that drafts does so with a drafter of its own), so a
//! second conversation streams while the first does.
//!
//! Each reply is admitted once, when it arrives ([`TurnBatch::admit`]: its template rendered,
//! its images read, its context and memory checked): it is told it was admitted
//! ([`ReplyEvent::Admitted`]) or why not ([`ReplyEvent::Failed`]) before anything else of it
//! runs, and joins, now or later, with that admission.
//!
//! A reply never waits unseen and is never dropped for another: one that must wait (its KV
//! cache fits the memory limit only once replies decoding have ended, or a command sent before
//! it, a model load, waits for them) is told so ([`ReplyEvent::Queued`]) and runs when its turn
//! comes, in the order the replies came; one stopped while it waits ends without running
//! ([`ReplyEvent::StoppedWaiting`]).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::LoadOptions;
use engine::batch::RowId;
use engine::generate::Flow;
use engine::kv_file::Identity;
use engine::tokenizer::Tokenizer;
use engine::turn::{
    Admission, ChatModel, Drafters, Joined, Turn, TurnBatch, TurnEvent, TurnOutcome,
};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::view::{ErrorKind, KvCosts};

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
    /// Its KV cache's bytes per token under each choice the settings offer.
    pub kv_costs: KvCosts,
    /// Whether its chat template turns thinking on and off (`enable_thinking`).
    pub thinking: bool,
    /// How it writes tool calls (Hermes without a tokenizer).
    pub tool_syntax: engine::tools::ToolSyntax,
}

/// What a reply emits while it is generated.
#[derive(Debug, Clone)]
pub enum ReplyEvent {
    /// The reply was admitted: its prompt fits the context and its KV cache the memory limit
    /// (at least once the replies running now end). The first event of every reply that is
    /// not refused, unless a model load queued it first.
    Admitted,
    /// New text to append.
    Text {
        /// The piece.
        text: String,
    },
    /// The reply waits for replies running now to end before it starts (sent once, before
    /// any text).
    Queued {
        /// Why, in words.
        reason: String,
    },
    /// The reply was stopped while it waited: nothing ran, nothing more comes.
    StoppedWaiting,
    /// Generation ended.
    Done(Box<TurnOutcome>),
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
        turn: Box<Turn>,
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

impl Engine {
    /// Starts the engine thread; models load with `options`.
    pub fn start(options: LoadOptions) -> Result<Engine> {
        let (commands, inbox) = std::sync::mpsc::channel::<Command>();
        let thread = std::thread::Builder::new()
            .name("quince-engine".into())
            .spawn(move || {
                let mut loaded: Option<ChatModel> = None;
                // The last draft method used, kept loaded for the next reply.
                let mut drafters = Drafters::new(options.clone());
                // Commands that waited for a batch of replies to end, in the order they came.
                let mut deferred = VecDeque::new();
                loop {
                    let command = match deferred.pop_front() {
                        Some(command) => command,
                        None => match inbox.recv() {
                            Ok(command) => command,
                            Err(_) => break,
                        },
                    };
                    match command {
                        Command::Shutdown => break,
                        Command::Load { path, progress, cancel, reply } => {
                            let result = load(&path, &options, &progress, &cancel);
                            let _ =
                                reply.send(result.as_ref().map(info).map_err(Error::clone_message));
                            if let Ok(model) = result {
                                loaded = Some(model);
                            }
                        }
                        Command::Reply { events, cancel, .. } if cancel.load(Ordering::SeqCst) => {
                            let _ = events.send(ReplyEvent::StoppedWaiting);
                        }
                        Command::Reply { turn, events, cancel } => match &loaded {
                            None => {
                                let _ = events.send(ReplyEvent::Failed {
                                    message: "no model is loaded".into(),
                                    kind: ErrorKind::ModelMissing,
                                });
                            }
                            Some(model) => {
                                let first = Pending::new(turn, events, cancel);
                                serve_together(model, &mut drafters, first, &inbox, &mut deferred);
                            }
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

    /// Starts a reply; events arrive on the returned channel until `Done` or `Failed`, the
    /// first of them `Admitted` or why it was refused (see the module docs). Setting `cancel`
    /// stops it after the current token.
    pub fn reply(
        &self,
        turn: Turn,
        cancel: Arc<AtomicBool>,
    ) -> Result<mpsc::UnboundedReceiver<ReplyEvent>> {
        let (events, receiver) = mpsc::unbounded_channel();
        self.commands
            .send(Command::Reply { turn: Box::new(turn), events, cancel })
            .map_err(|_| Error::Engine("the engine stopped".into()))?;
        Ok(receiver)
    }
}

/// Load stages, in order.
pub(crate) const LOAD_STAGES: [&str; 3] =
    ["Reading the weights", "Loading the tokenizer", "Warming up"];

fn load(
    path: &std::path::Path,
    options: &LoadOptions,
    progress: &mpsc::UnboundedSender<(String, u32, u32)>,
    cancel: &AtomicBool,
) -> Result<ChatModel> {
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
    let model = engine::registry::load_model(path, options)?;
    stage(1)?;
    let chat = ChatModel::new(path, model, Tokenizer::from_dir(path)?)?;
    stage(2)?;
    chat.warm_up()?;
    if cancel.load(Ordering::SeqCst) {
        return Err(Error::Cancelled);
    }
    Ok(chat)
}

fn info(chat: &ChatModel) -> ModelInfo {
    let plan = chat.model().cache_plan();
    // A choice the model's head widths do not take costs 0 (the settings offer it greyed).
    let cost = |format: engine::cache::KvFormat| {
        let kv = engine::cache::KvOptions { format, ..Default::default() };
        plan.with_kv(&kv).map_or(0, |p| p.bytes_per_token() as u64)
    };
    let affine = |bits| engine::cache::KvFormat::Affine { bits, group_size: 64 };
    ModelInfo {
        path: chat.path().to_path_buf(),
        vision: chat.model().vision().is_some(),
        max_context: chat.model().max_context(),
        identity: chat.identity().clone(),
        kv_costs: KvCosts {
            full: cost(engine::cache::KvFormat::Full),
            affine8: cost(affine(8)),
            affine4: cost(affine(4)),
            turbo3: engine::cache::KvFormat::turbo(3.0).map_or(0, cost),
        },
        thinking: chat.tokenizer().is_some_and(|t| t.takes_thinking()),
        tool_syntax: chat
            .tokenizer()
            .map_or(engine::tools::ToolSyntax::Hermes, |t| t.tool_syntax()),
    }
}

/// A reply waiting to join a batch.
struct Pending {
    turn: Box<Turn>,
    /// What admitting it computed, once it was admitted.
    admission: Option<Box<Admission>>,
    events: mpsc::UnboundedSender<ReplyEvent>,
    cancel: Arc<AtomicBool>,
    /// Whether it was told it waits.
    queued: bool,
}

impl Pending {
    fn new(
        turn: Box<Turn>,
        events: mpsc::UnboundedSender<ReplyEvent>,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        Pending { turn, admission: None, events, cancel, queued: false }
    }
}

/// Answers `first` and every reply that comes while it runs, together in one [`TurnBatch`],
/// until none is left. Each joins after its own prefill and leaves when it ends or is
/// stopped; one whose KV cache fits only once others end waits in line, and replies after it
/// wait behind it. Any other command (a load, shutdown) waits in `deferred` until the batch is
/// empty, and every command after it waits too, so commands still take effect in the order
/// they were sent.
fn serve_together(
    chat: &ChatModel,
    drafters: &mut Drafters,
    first: Pending,
    inbox: &std::sync::mpsc::Receiver<Command>,
    deferred: &mut VecDeque<Command>,
) {
    let mut together = Together {
        batch: TurnBatch::new(chat),
        drafters,
        live: HashMap::new(),
        waiting: VecDeque::new(),
        next: 0,
    };
    together.arrive(first);
    // Replies that waited behind the batch's first join now.
    while let Some(Command::Reply { .. }) = deferred.front() {
        if let Some(Command::Reply { turn, events, cancel }) = deferred.pop_front() {
            together.arrive(Pending::new(turn, events, cancel));
        }
    }
    loop {
        // Plain replies that came since the last step, of one KV storage: they join together.
        let mut arrivals: Vec<Pending> = Vec::new();
        while let Ok(command) = inbox.try_recv() {
            if !deferred.is_empty() {
                defer(deferred, command);
                continue;
            }
            if let Command::Reply { turn, .. } = &command
                && let Some(first) = arrivals.first()
                && !(plain(turn) && turn.kv == first.turn.kv)
            {
                together.arrive_all(std::mem::take(&mut arrivals));
            }
            match command {
                Command::Reply { turn, events, cancel } => {
                    let pending = Pending::new(turn, events, cancel);
                    match plain(&pending.turn) {
                        true => arrivals.push(pending),
                        false => together.arrive(pending),
                    }
                }
                other => defer(deferred, other),
            }
        }
        together.arrive_all(arrivals);
        together.drop_stopped();
        if together.batch.is_empty() {
            if together.waiting.is_empty() {
                return;
            }
            together.admit_waiting();
            continue;
        }
        match together.step() {
            Some(0) => {}
            Some(_) => together.admit_waiting(),
            None => {
                // The batch failed: the replies waiting start a new one.
                together.batch = TurnBatch::new(chat);
            }
        }
    }
}

/// Whether `turn` decodes plainly (no draft method): what may prefill in a padded cohort.
fn plain(turn: &Turn) -> bool {
    turn.speculation == engine::speculative::Speculation::Off
}

/// Puts `command` behind the batch, telling a reply it waits.
fn defer(deferred: &mut VecDeque<Command>, command: Command) {
    if let Command::Reply { events, .. } = &command {
        let _ = events.send(ReplyEvent::Queued {
            reason: "it starts when the replies running now have finished".into(),
        });
    }
    deferred.push_back(command);
}

/// The replies of [`serve_together`]'s batch, the drafters their forks come from, where each
/// reply's events go, and the replies waiting for memory, in the order they came.
struct Together<'c, 'd> {
    batch: TurnBatch<'c>,
    drafters: &'d mut Drafters,
    live: HashMap<RowId, mpsc::UnboundedSender<ReplyEvent>>,
    waiting: VecDeque<Pending>,
    next: RowId,
}

impl Together<'_, '_> {
    /// Admits `pending` beside the batch, once, telling it so, or fails it; `false` when it
    /// was refused.
    fn admit(&self, pending: &mut Pending) -> bool {
        if pending.admission.is_some() {
            return true;
        }
        match self.batch.admit(&pending.turn) {
            Ok(admission) => {
                pending.admission = Some(Box::new(admission));
                let _ = pending.events.send(ReplyEvent::Admitted);
                true
            }
            Err(error) => {
                let _ = pending.events.send(failed(error.into()));
                false
            }
        }
    }

    /// A reply that came: admitted, it joins now or waits behind those already waiting.
    fn arrive(&mut self, mut pending: Pending) {
        if !self.admit(&mut pending) {
            return;
        }
        if self.waiting.is_empty() {
            self.join(pending);
        } else {
            self.wait(pending, "replies that came before it are waiting too".into());
        }
    }

    /// Replies that came together: they join together ([`TurnBatch::join_all`]: those that
    /// start fresh prefill as one padded cohort), or wait behind those already waiting. Each
    /// is admitted first; those refused leave the group.
    fn arrive_all(&mut self, arrivals: Vec<Pending>) {
        if arrivals.len() < 2 || !self.waiting.is_empty() {
            arrivals.into_iter().for_each(|p| self.arrive(p));
            return;
        }
        let mut arrivals = arrivals;
        arrivals.retain_mut(|p| self.admit(p));
        let ids: Vec<RowId> = (0..arrivals.len() as RowId).map(|i| self.next + i).collect();
        self.next += arrivals.len() as RowId;
        let group = arrivals
            .iter_mut()
            .zip(&ids)
            .filter_map(|(p, &id)| {
                let admission = *p.admission.take()?;
                let p: &Pending = p;
                Some((id, &*p.turn, admission, stream_to(p)))
            })
            .collect();
        let results = self.batch.join_all(group, self.drafters);
        for ((pending, id), joined) in arrivals.into_iter().zip(ids).zip(results) {
            self.joined(pending, id, joined, false);
        }
    }

    /// Joins the replies waiting, in order, until one still does not fit.
    fn admit_waiting(&mut self) {
        while self.waiting.front().is_some() {
            let Some(pending) = self.waiting.pop_front() else { break };
            if !self.join_or_wait(pending, true) {
                break;
            }
        }
    }

    /// Ends the waiting replies that were stopped.
    fn drop_stopped(&mut self) {
        self.waiting.retain(|p| {
            let stopped = p.cancel.load(Ordering::SeqCst);
            if stopped {
                let _ = p.events.send(ReplyEvent::StoppedWaiting);
            }
            !stopped
        });
    }

    fn join(&mut self, pending: Pending) {
        self.join_or_wait(pending, false);
    }

    /// Joins `pending` (admitted already), or puts it back in line (at the front when it was
    /// first in line); `false` when it waits.
    fn join_or_wait(&mut self, mut pending: Pending, front: bool) -> bool {
        if !self.admit(&mut pending) {
            return true;
        }
        let Some(admission) = pending.admission.take() else { return true };
        let id = self.next;
        self.next += 1;
        let on_event = stream_to(&pending);
        let joined = self.batch.join(id, &pending.turn, *admission, self.drafters, on_event);
        self.joined(pending, id, joined, front)
    }

    /// What became of `pending`, joined as `id`: it decodes, ended, failed, or waits in line
    /// with its admission (at the front when it was first in line); `false` when it waits.
    fn joined(
        &mut self,
        mut pending: Pending,
        id: RowId,
        joined: engine::Result<Joined>,
        front: bool,
    ) -> bool {
        match joined {
            Ok(Joined::Decoding) => {
                self.live.insert(id, pending.events);
            }
            Ok(Joined::Ended(outcome)) => {
                let _ = pending.events.send(ReplyEvent::Done(outcome));
            }
            Ok(Joined::Behind(admission)) => {
                pending.admission = Some(admission);
                self.wait(pending, "a reply that came before it is waiting".into());
                return false;
            }
            Ok(Joined::Waits { admission, needed, available }) => {
                pending.admission = Some(admission);
                let reason = format!(
                    "its KV cache ({}) fits the memory limit only once a reply running now has \
                     finished ({} free beside them)",
                    engine::units::human(needed),
                    engine::units::human(available)
                );
                if front {
                    self.tell(&pending, reason);
                    self.waiting.push_front(pending);
                } else {
                    self.wait(pending, reason);
                }
                return false;
            }
            Err(error) => {
                let _ = pending.events.send(failed(error.into()));
            }
        }
        true
    }

    /// Puts `pending` last in line.
    fn wait(&mut self, mut pending: Pending, reason: String) {
        self.tell(&pending, reason);
        pending.queued = true;
        self.waiting.push_back(pending);
    }

    /// Tells a reply, once, that it waits.
    fn tell(&self, pending: &Pending, reason: String) {
        if !pending.queued {
            let _ = pending.events.send(ReplyEvent::Queued { reason });
        }
    }

    /// One step of every reply: how many ended, `None` when the batched pass failed (every
    /// reply in it is told, and the batch is over).
    fn step(&mut self) -> Option<usize> {
        match self.batch.step() {
            Ok(ended) => {
                let count = ended.len();
                for (id, outcome) in ended {
                    let Some(events) = self.live.remove(&id) else { continue };
                    let _ = events.send(match outcome {
                        Ok(outcome) => ReplyEvent::Done(Box::new(outcome)),
                        Err(error) => failed(error.into()),
                    });
                }
                Some(count)
            }
            Err(error) => {
                let error = Error::from(error);
                for (_, events) in self.live.drain() {
                    let _ = events.send(failed(error.clone_message()));
                }
                None
            }
        }
    }
}

/// The callback a reply's turn streams to: its text to the reply's events; a stop once the
/// reply is cancelled.
fn stream_to(pending: &Pending) -> engine::turn::OnEvent<'static> {
    let (stream, cancel) = (pending.events.clone(), pending.cancel.clone());
    Box::new(move |TurnEvent::Token { text, .. }| {
        if !text.is_empty() {
            let _ = stream.send(ReplyEvent::Text { text });
        }
        if cancel.load(Ordering::SeqCst) { Flow::Stop } else { Flow::Continue }
    })
}

fn failed(error: Error) -> ReplyEvent {
    ReplyEvent::Failed { message: error.to_string(), kind: error.kind() }
}
