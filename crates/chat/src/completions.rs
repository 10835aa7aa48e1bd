//! Completions: requests answered by the loaded model without a conversation in the store (the
//! local server's). Each resumes from the prompt cache — KV checkpoint files of earlier
//! completions, indexed in memory and kept within their share of the disk budget, least
//! recently used out first — at the longest prefix its prompt shares with one, and writes a
//! checkpoint at its own end, so a client that resends a conversation with a turn more only
//! prefills the new turn.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use engine::kv_file::Identity;
use engine::sampling::SamplingParams;
use engine::turn::{Prompt, ResumeCandidate, Turn, TurnOutcome};
use tokio::sync::mpsc;

use crate::{Chat, Error, ReplyEvent, Result, lock};

/// Most checkpoints the prompt cache indexes.
const MOST_ENTRIES: usize = 64;

/// One request to answer.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The messages (rendered with the model's template) or raw token ids.
    pub prompt: Prompt,
    /// Sampling settings, seed included.
    pub sampling: SamplingParams,
    /// Most tokens to generate; `None`: until the context ends.
    pub max_tokens: Option<usize>,
    /// Stop when the reply contains one of these (left out of the text).
    pub stop: Vec<String>,
    /// `enable_thinking` for templates that take it; `None`: the template's default.
    pub thinking: Option<bool>,
    /// Tools the model may call (OpenAI's function definitions).
    pub tools: Vec<serde_json::Value>,
    /// What the reply must match (a JSON schema, a grammar).
    pub constraint: Option<engine::constrain::Constraint>,
}

impl Completion {
    /// A greedy completion of `prompt` up to the context.
    pub fn new(prompt: Prompt) -> Completion {
        Completion {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: None,
            stop: Vec::new(),
            thinking: None,
            tools: Vec::new(),
            constraint: None,
        }
    }
}

/// A checkpoint file in the prompt cache.
#[derive(Debug, Clone)]
struct Entry {
    candidate: ResumeCandidate,
    identity: Identity,
    bytes: u64,
}

/// The prompt cache's index: most recently used last.
#[derive(Debug)]
pub(crate) struct PromptCache {
    dir: PathBuf,
    budget: AtomicU64,
    entries: std::sync::Mutex<VecDeque<Entry>>,
    next: AtomicU64,
    /// The cancel flags of completions started: one is running while the engine (or its
    /// stream) still holds its flag.
    running: std::sync::Mutex<Vec<std::sync::Weak<AtomicBool>>>,
}

impl PromptCache {
    /// An empty cache in `dir`; the files an earlier process left there are not indexed, so
    /// they go.
    pub(crate) fn open(dir: PathBuf, budget: u64) -> PromptCache {
        let _ = std::fs::remove_dir_all(&dir);
        PromptCache {
            dir,
            budget: AtomicU64::new(budget),
            entries: Default::default(),
            next: AtomicU64::new(1),
            running: Default::default(),
        }
    }

    /// Sets the most bytes its files may hold.
    pub(crate) fn set_budget(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::Relaxed);
    }

    /// Candidates for a turn of the model `identity`: every entry of it.
    fn candidates(&self, identity: &Identity) -> Vec<ResumeCandidate> {
        lock(&self.entries)
            .iter()
            .rev()
            .filter(|e| e.identity == *identity)
            .map(|e| e.candidate.clone())
            .collect()
    }

    /// Indexes what a completion wrote, drops the entries found damaged, marks the one
    /// resumed as used, and deletes the least recently used files past the budget.
    fn after(&self, identity: Identity, path: PathBuf, outcome: &TurnOutcome) {
        let mut entries = lock(&self.entries);
        for (id, why) in &outcome.rejected {
            tracing::warn!(checkpoint = id, "dropping a prompt-cache checkpoint: {why}");
            if let Some(at) = entries.iter().position(|e| e.candidate.id == *id) {
                let gone = entries.remove(at);
                let _ = gone.map(|e| std::fs::remove_file(e.candidate.path));
            }
        }
        if let Some(id) = outcome.resumed_from
            && let Some(at) = entries.iter().position(|e| e.candidate.id == id)
            && let Some(used) = entries.remove(at)
        {
            entries.push_back(used);
        }
        if let Some(written) = &outcome.checkpoint {
            entries.push_back(Entry {
                candidate: ResumeCandidate {
                    id: self.next.fetch_add(1, Ordering::Relaxed) as i64,
                    path,
                    sha256: written.file.sha256.clone(),
                    tokens: written.tokens.clone(),
                    signature: Some(written.file.signature.clone()),
                },
                identity,
                bytes: written.file.bytes,
            });
        }
        let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
        let budget = self.budget.load(Ordering::Relaxed);
        while entries.len() > 1 && (total > budget || entries.len() > MOST_ENTRIES) {
            let Some(oldest) = entries.pop_front() else { break };
            total -= oldest.bytes;
            let _ = std::fs::remove_file(&oldest.candidate.path);
        }
    }

    fn file(&self) -> PathBuf {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("{}-{n}.safetensors", std::process::id()))
    }
}

/// The events of a completion in flight ([`Chat::complete`]). Dropping it before the end
/// cancels the completion (a client that went away).
#[derive(Debug)]
pub struct CompletionStream {
    events: mpsc::UnboundedReceiver<ReplyEvent>,
    cancel: Arc<AtomicBool>,
    cache: Arc<PromptCache>,
    identity: Identity,
    file: PathBuf,
    ended: bool,
}

impl CompletionStream {
    /// The next event: text, a note that it waits for room, then `Done` (with the outcome and
    /// its statistics) or `Failed`; `None` after those. (That the completion was admitted is
    /// not passed on: a refusal comes as `Failed`, before any other event.)
    pub async fn next(&mut self) -> Option<ReplyEvent> {
        if self.ended {
            return None;
        }
        let mut event = self.events.recv().await;
        while let Some(ReplyEvent::Admitted) = event {
            event = self.events.recv().await;
        }
        match &event {
            Some(ReplyEvent::Done(outcome)) => {
                self.ended = true;
                self.cache.after(self.identity.clone(), self.file.clone(), outcome);
            }
            Some(ReplyEvent::Failed { .. } | ReplyEvent::StoppedWaiting) => self.ended = true,
            None => {
                self.ended = true;
                return Some(ReplyEvent::Failed {
                    message: "the engine stopped in the middle of a reply".into(),
                    kind: crate::view::ErrorKind::Internal,
                });
            }
            _ => {}
        }
        event
    }

    /// Stops the completion after its current token (it then ends with `Done`).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

impl Drop for CompletionStream {
    fn drop(&mut self) {
        if !self.ended {
            self.cancel();
        }
    }
}

impl Chat {
    /// How many completions are running: started and not yet ended by the engine (one whose
    /// client went away counts until the engine has stopped it).
    pub fn completions_running(&self) -> usize {
        lock(&self.prompt_cache.running).iter().filter(|f| f.strong_count() > 0).count()
    }

    /// How the loaded model writes tool calls (from its chat template); `None` when no model is
    /// loaded.
    pub fn tool_syntax(&self) -> Option<engine::tools::ToolSyntax> {
        lock(&self.engine_info).as_ref().map(|info| info.tool_syntax)
    }

    /// Starts answering `completion` with the loaded model, beside the app's replies (it joins
    /// their batch where it can). Refused at once when no model is loaded or one is loading.
    pub async fn complete(&self, completion: Completion) -> Result<CompletionStream> {
        if lock(&self.loading).is_some() {
            return Err(Error::Busy("a model is loading; ask again when it has loaded".into()));
        }
        let (Some(model), Some(identity)) = (self.loaded(), self.identity()) else {
            return Err(Error::ModelMissing("no model is loaded".into()));
        };
        let cache = self.prompt_cache.clone();
        let file = cache.file();
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| {
                Error::Invalid(format!("cannot create the prompt cache {}: {e}", dir.display()))
            })?;
        }
        let turn = Turn {
            sampling: completion.sampling,
            max_tokens: completion.max_tokens.unwrap_or(model.max_context as usize),
            stop_strings: completion.stop,
            thinking: completion.thinking,
            tools: completion.tools,
            constraint: completion.constraint,
            resume: if self.checkpoints { cache.candidates(&identity) } else { Vec::new() },
            checkpoint_to: self.checkpoints.then(|| file.clone()),
            // The folder is cleared when the next process opens it.
            checkpoint_durability: engine::kv_file::Durability::Cached,
            ..Turn::new(completion.prompt)
        };
        let turn = Turn { memory_share: Some(self.app_settings().await?.memory_share), ..turn };
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut running = lock(&cache.running);
            running.retain(|flag| flag.strong_count() > 0);
            running.push(Arc::downgrade(&cancel));
        }
        let events = self.engine.reply(turn, cancel.clone())?;
        Ok(CompletionStream { events, cancel, cache, identity, file, ended: false })
    }
}
