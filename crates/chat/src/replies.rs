//! Replies: a user message stored and answered, a reply regenerated, a message edited (each a
//! new branch of the message tree), and stopping the reply in flight. A reply is written to the
//! store while it streams, so a crash loses at most the last few pieces.
//!
//! A new message is stored once the engine has admitted its reply ([`ReplyEvent::Admitted`]):
//! a reply refused because its KV cache would pass the memory limit stores nothing (the user
//! picks a smaller KV cache or a new chat, and sends the same text again). Other refusals (a
//! prompt over the context, an unreadable image) are the reply's own: the message is stored
//! and the reply records the error. While a model loads, the message is stored at once and
//! answered when the load ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use engine::generate::StopReason;
use engine::sampling::SamplingParams;
use engine::turn::{Prompt, ResumeCandidate, Turn, TurnMessage, TurnOutcome};
use store::{MessageState, Role};

use crate::models::{LoadStatus, Loading};
use crate::view::{ErrorKind, LoadedModel, StreamEvent, ThreadMessage};
use crate::{
    Chat, Error, Generation, NEW_TITLE, ReplyEvent, Result, SAVE_EVERY, attachment_mime, extras,
    join_ids, lock, merge, parse_ids, settings_of, title_from,
};

/// How often a reply waiting for a model load checks whether it was stopped.
const WAIT_POLL: Duration = Duration::from_millis(100);

fn no_model() -> Error {
    Error::ModelMissing("No model is loaded. Pick one in the model library.".into())
}

/// What a reply will answer beyond the stored messages: a message not stored yet.
pub(crate) enum Pending {
    /// A text message with its images.
    Message(TurnMessage),
    /// Token ids of a raw conversation.
    Tokens(Vec<u32>),
}

impl Pending {
    /// A user message of `text` with its `images`.
    fn user(text: &str, images: Vec<std::path::PathBuf>) -> Pending {
        Pending::Message(TurnMessage {
            role: "user".into(),
            text: text.into(),
            images,
            ..TurnMessage::default()
        })
    }
}

/// A user message to store under `parent` once its reply is admitted.
pub(crate) struct NewMessage {
    parent: Option<i64>,
    /// Its text (a raw conversation's: its ids).
    content: String,
    /// Its images: (file, MIME type, bytes, SHA-256, position).
    attachments: Vec<(String, String, i64, String, i64)>,
    /// The conversation's title, when it has none yet.
    title: Option<String>,
    /// The model answering, recorded on the conversation.
    model: Option<String>,
    /// The message as the prompt reads it.
    pending: Pending,
}

/// The user message a reply answers.
pub(crate) enum Answering {
    /// Stored already.
    Stored(i64),
    /// Stored once the reply is admitted.
    New(Box<NewMessage>),
}

/// A checkpoint file's name, unique within the conversation's folder: chosen before the reply
/// is stored (the reply's turn carries it into the engine).
fn unique_name() -> String {
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{:x}", COUNT.fetch_add(1, Ordering::SeqCst))
}

impl Chat {
    /// The prompt of a reply to `path` (the stored branch, root first) and `pending`: token
    /// ids in a raw conversation, else the messages with their images and the system prompt.
    async fn prompt_of(
        &self,
        chat: &store::Conversation,
        path: &[store::Message],
        pending: Option<&Pending>,
    ) -> Result<Prompt> {
        if extras(&chat.settings).0 {
            let mut ids = Vec::new();
            for m in path {
                ids.extend(parse_ids(&m.content)?);
            }
            if let Some(Pending::Tokens(more)) = pending {
                ids.extend_from_slice(more);
            }
            return Ok(Prompt::Tokens { ids, images: Vec::new() });
        }
        let mut messages = Vec::new();
        if let Some(system) = chat.system_prompt.as_deref().filter(|s| !s.trim().is_empty()) {
            messages.push(TurnMessage::text("system", system));
        }
        let mut stored = Vec::with_capacity(path.len());
        for m in path {
            let images: Vec<_> = self
                .store
                .attachments(m.id)
                .await?
                .into_iter()
                .map(|a| self.attachments_dir().join(a.path))
                .collect();
            stored.push(TurnMessage {
                role: m.role.as_str().to_string(),
                text: m.content.clone(),
                images,
                ..TurnMessage::default()
            });
        }
        if let Some(Pending::Message(message)) = pending {
            stored.push(message.clone());
        }
        for m in stored {
            match messages.last_mut() {
                // Two user messages in a row (the first left unanswered) are one turn: chat
                // templates want the roles to alternate.
                Some(previous) if previous.role == m.role && m.role == Role::User.as_str() => {
                    previous.text = format!("{}\n\n{}", previous.text, m.text);
                    previous.images.extend(m.images);
                }
                _ => messages.push(m),
            }
        }
        Ok(Prompt::Messages(messages))
    }

    /// The loaded model, checked to take `images` images.
    fn require_model(&self, images: usize) -> Result<LoadedModel> {
        let loaded = lock(&self.loaded).clone().ok_or_else(no_model)?;
        if images > 0 && !loaded.vision {
            return Err(Error::Invalid(format!("{} does not take images", loaded.name)));
        }
        Ok(loaded)
    }

    /// The name of the model that will answer: the one loading (a reply waits for it) or
    /// else the one loaded, checked to take `images` images. Refused when there is neither,
    /// before anything is stored.
    fn answering_model(&self, images: usize) -> Result<String> {
        let (name, vision) = match lock(&self.loading).as_ref() {
            Some(loading) => (loading.name.clone(), loading.vision),
            None => {
                let loaded = self.require_model(images)?;
                (loaded.name, loaded.vision)
            }
        };
        if images > 0 && !vision {
            return Err(Error::Invalid(format!("{name} does not take images")));
        }
        Ok(name)
    }

    /// Waits for the model load in flight, if any, telling `on_event` where it stands, then
    /// returns the loaded model. A failed or cancelled load, or `cancel` set while waiting,
    /// ends the wait with an error (what was stored stays).
    async fn model_when_loaded(
        &self,
        images: usize,
        cancel: &AtomicBool,
        user: Option<&ThreadMessage>,
        on_event: &mut impl FnMut(StreamEvent),
    ) -> Result<LoadedModel> {
        let loading = lock(&self.loading).clone();
        if let Some(Loading { name, mut status, .. }) = loading {
            loop {
                let now = status.borrow_and_update().clone();
                match now {
                    LoadStatus::Loaded => break,
                    LoadStatus::Stage { stage, done, total } => {
                        on_event(StreamEvent::Waiting {
                            user: user.cloned(),
                            model: name.clone(),
                            stage,
                            done,
                            total,
                        });
                    }
                    LoadStatus::Failed { kind, message } => {
                        return Err(Error::Reported {
                            kind,
                            message: format!(
                                "{name} did not load ({message}). The message is kept: load a \
                                 model, then press Retry."
                            ),
                        });
                    }
                    LoadStatus::Cancelled => {
                        return Err(Error::Reported {
                            kind: ErrorKind::ModelLoad,
                            message: format!(
                                "Loading {name} was cancelled. The message is kept: load a \
                                 model, then press Retry."
                            ),
                        });
                    }
                }
                loop {
                    if cancel.load(Ordering::SeqCst) {
                        return Err(Error::Cancelled);
                    }
                    match tokio::time::timeout(WAIT_POLL, status.changed()).await {
                        Ok(Ok(())) => break,
                        // The load's caller went away without an outcome.
                        Ok(Err(_)) if matches!(*status.borrow(), LoadStatus::Stage { .. }) => {
                            return Err(Error::Engine("the model load stopped".into()));
                        }
                        Ok(Err(_)) => break,
                        Err(_) => {}
                    }
                }
            }
        }
        self.require_model(images)
    }

    /// Adds a user message (with imported images, see [`Chat::import_attachment`]) under the
    /// conversation's current tip and generates the reply, streaming [`StreamEvent`]s. Returns
    /// the stored reply. Nothing is stored when no model is loaded or loading, an image is
    /// missing, or the reply's KV cache would pass the memory limit (see the module docs).
    /// While a model loads, the message is stored at once and answered when the load ends
    /// ([`StreamEvent::Waiting`] meanwhile); if the load fails, the message stays, unanswered,
    /// for [`Chat::answer`].
    pub async fn send(
        &self,
        conversation: i64,
        text: &str,
        files: &[String],
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let model = self.answering_model(files.len())?;
        if text.trim().is_empty() && files.is_empty() {
            return Err(Error::Invalid("the message is empty".into()));
        }
        let paths = files.iter().map(|f| self.attachment_path(f)).collect::<Result<Vec<_>>>()?;
        let chat = self.store.conversation(conversation).await?;
        if extras(&chat.settings).0 {
            return Err(Error::Invalid("this conversation takes token ids, not text".into()));
        }
        let attachments = files
            .iter()
            .zip(&paths)
            .enumerate()
            .map(|(position, (file, path))| {
                let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
                let sha = file.split('.').next().unwrap_or_default().to_string();
                (
                    file.clone(),
                    attachment_mime(file).to_string(),
                    bytes as i64,
                    sha,
                    position as i64,
                )
            })
            .collect();
        let message = NewMessage {
            parent: chat.current_leaf_id,
            content: text.into(),
            attachments,
            title: (chat.title.is_empty() || chat.title == NEW_TITLE).then(|| title_from(text)),
            model: Some(model),
            pending: Pending::user(text, paths),
        };
        let answering = Answering::New(Box::new(message));
        self.reply_to(conversation, answering, files.len(), &mut on_event).await
    }

    /// Appends token ids, verbatim, as the next turn of a raw conversation (see
    /// [`Chat::set_raw_options`]) and generates the reply (stored as its ids).
    pub async fn send_tokens(
        &self,
        conversation: i64,
        ids: &[u32],
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        self.answering_model(0)?;
        if ids.is_empty() {
            return Err(Error::Invalid("no token ids to send".into()));
        }
        let chat = self.store.conversation(conversation).await?;
        if !extras(&chat.settings).0 {
            return Err(Error::Invalid("this conversation takes text, not token ids".into()));
        }
        let message = NewMessage {
            parent: chat.current_leaf_id,
            content: join_ids(ids),
            attachments: Vec::new(),
            title: None,
            model: None,
            pending: Pending::Tokens(ids.to_vec()),
        };
        self.reply_to(conversation, Answering::New(Box::new(message)), 0, &mut on_event).await
    }

    /// A new reply to the same user message as `reply` (a sibling branch).
    pub async fn regenerate(
        &self,
        reply: i64,
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let old = self.store.message(reply).await?;
        if old.role != Role::Assistant {
            return Err(Error::Invalid("only replies can be regenerated".into()));
        }
        let parent = old
            .parent_id
            .ok_or_else(|| Error::Invalid("the first message has nothing to answer".into()))?;
        let images = self.store.attachments(parent).await?.len();
        self.answering_model(images)?;
        self.reply_to(old.conversation_id, Answering::Stored(parent), images, &mut on_event).await
    }

    /// Answers a stored user message: one left unanswered (its model failed to load, or the
    /// app quit mid-reply) gets its reply, and one already answered gets another (a sibling,
    /// as [`Chat::regenerate`] makes).
    pub async fn answer(
        &self,
        message: i64,
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let user = self.store.message(message).await?;
        if user.role != Role::User {
            return Err(Error::Invalid("only user messages can be answered".into()));
        }
        let images = self.store.attachments(user.id).await?.len();
        self.answering_model(images)?;
        self.reply_to(user.conversation_id, Answering::Stored(user.id), images, &mut on_event).await
    }

    /// Replaces a user message by a new version (a sibling branch, keeping its images) and
    /// answers it.
    pub async fn edit(
        &self,
        message: i64,
        text: &str,
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let old = self.store.message(message).await?;
        if old.role != Role::User {
            return Err(Error::Invalid("only user messages can be edited".into()));
        }
        let attachments = self.store.attachments(old.id).await?;
        let images = attachments.len();
        self.answering_model(images)?;
        if text.trim().is_empty() && attachments.is_empty() {
            return Err(Error::Invalid("the message is empty".into()));
        }
        let files = attachments.iter().map(|a| self.attachments_dir().join(&a.path)).collect();
        let message = NewMessage {
            parent: old.parent_id,
            content: text.into(),
            attachments: attachments
                .into_iter()
                .map(|a| (a.path, a.mime, a.bytes, a.sha256, a.position))
                .collect(),
            title: None,
            model: None,
            pending: Pending::user(text, files),
        };
        let answering = Answering::New(Box::new(message));
        self.reply_to(old.conversation_id, answering, images, &mut on_event).await
    }

    /// Stores `message`, a user message of `conversation`, with its images; its view.
    async fn store_message(
        &self,
        conversation: i64,
        message: &NewMessage,
    ) -> Result<ThreadMessage> {
        let user = self
            .store
            .append_message(
                conversation,
                message.parent,
                Role::User,
                &message.content,
                MessageState::Complete,
            )
            .await?;
        for (file, mime, bytes, sha, position) in &message.attachments {
            self.store.add_attachment(user.id, file, mime, *bytes, sha, *position).await?;
        }
        if let Some(title) = &message.title {
            self.store.rename_conversation(conversation, title).await?;
        }
        if let Some(model) = &message.model {
            self.store.set_model(conversation, model).await?;
        }
        self.thread_message(self.store.message(user.id).await?).await
    }

    /// Stops the conversation's reply in flight, if any (it is kept, marked stopped).
    pub fn stop(&self, conversation: i64) -> bool {
        match lock(&self.running).get(&conversation) {
            Some(generation) => {
                generation.stop.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Stops the generation writing the reply `reply` (the id [`StreamEvent::Started`] gave);
    /// false when that reply is not being generated (it finished, or never started).
    pub fn stop_generation(&self, reply: i64) -> bool {
        let running = lock(&self.running);
        match running.values().find(|g| g.reply == Some(reply)) {
            Some(generation) => {
                generation.stop.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// Answers `answering` (with `images` images), once the model is loaded: a new message
    /// is stored once its reply is admitted, or at once while a model loads.
    async fn reply_to(
        &self,
        conversation: i64,
        answering: Answering,
        images: usize,
        on_event: &mut impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut running = lock(&self.running);
            if running.contains_key(&conversation) {
                return Err(Error::Busy(
                    "a reply is already being generated in this conversation".into(),
                ));
            }
            running.insert(conversation, Generation { reply: None, stop: cancel.clone() });
        }
        let result = self.reply_when_loaded(conversation, answering, images, &cancel, on_event);
        let result = result.await;
        lock(&self.running).remove(&conversation);
        result
    }

    /// [`Chat::reply_to`] once the conversation is marked busy.
    async fn reply_when_loaded(
        &self,
        conversation: i64,
        answering: Answering,
        images: usize,
        cancel: &Arc<AtomicBool>,
        on_event: &mut impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        // Nothing can be admitted while a model loads: the message is kept while it waits.
        let (answering, user_view) = match answering {
            Answering::New(message) if lock(&self.loading).is_some() => {
                let view = self.store_message(conversation, &message).await?;
                (Answering::Stored(view.id), Some(view))
            }
            other => (other, None),
        };
        match self.model_when_loaded(images, cancel, user_view.as_ref(), on_event).await {
            Ok(_) => {
                self.reply_inner(conversation, answering, user_view, cancel.clone(), on_event).await
            }
            Err(error) => {
                if !matches!(error, Error::Cancelled) {
                    on_event(StreamEvent::Failed { message: error.to_string(), reply: None });
                }
                Err(error)
            }
        }
    }

    async fn reply_inner(
        &self,
        conversation: i64,
        answering: Answering,
        mut user_view: Option<ThreadMessage>,
        cancel: Arc<AtomicBool>,
        on_event: &mut impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let chat = self.store.conversation(conversation).await?;
        let (path, new) = match answering {
            Answering::Stored(user) => (self.store.path_to(user).await?, None),
            Answering::New(message) => match message.parent {
                Some(parent) => (self.store.path_to(parent).await?, Some(message)),
                None => (Vec::new(), Some(message)),
            },
        };
        let settings = settings_of(&chat.settings);
        let (raw, ignore_eos) = extras(&chat.settings);
        let prompt = self.prompt_of(&chat, &path, new.as_ref().map(|m| &m.pending)).await?;
        let memory_share = Some(self.app_settings().await?.memory_share);
        // Checkpoints of this branch's earlier nodes, by this very model, longest first.
        let identity = self.identity().filter(|_| self.checkpoints);
        let mut resume = Vec::new();
        if let Some(identity) = &identity {
            let ancestors: Vec<i64> = path.iter().map(|m| m.id).collect();
            for c in self
                .store
                .checkpoints(conversation, &identity.model_id, &identity.config_hash)
                .await?
            {
                if ancestors.contains(&c.message_id) {
                    resume.push(ResumeCandidate {
                        id: c.id,
                        path: self.checkpoints_dir().join(&c.path),
                        sha256: c.sha256,
                        tokens: c.tokens,
                        signature: Some(c.cache_signature),
                    });
                }
            }
        }
        let checkpoint_file = format!("{conversation}/{}.safetensors", unique_name());
        let turn = Turn {
            resume,
            checkpoint_to: identity
                .is_some()
                .then(|| self.checkpoints_dir().join(&checkpoint_file)),
            sampling: SamplingParams {
                temperature: settings.temperature,
                top_p: settings.top_p,
                top_k: settings.top_k as usize,
                seed: settings.seed,
                ..SamplingParams::default()
            },
            max_tokens: settings.max_tokens as usize,
            max_soft_tokens: settings.max_soft_tokens as usize,
            ignore_eos,
            speculation: settings.speculation.clone(),
            kv: settings.kv,
            memory_share,
            thinking: Some(settings.thinking),
            ..Turn::new(prompt)
        };
        let mut events = self.engine.reply(turn, cancel.clone())?;
        // The engine admits the reply, or says why not, before anything else.
        let first = events.recv().await;
        if let Some(ReplyEvent::Failed { kind: ErrorKind::OutOfMemory, message }) = first {
            return Err(Error::Reported { kind: ErrorKind::OutOfMemory, message });
        }
        let user = match (&new, path.last()) {
            (Some(message), _) => match self.store_message(conversation, message).await {
                Ok(view) => {
                    let id = view.id;
                    user_view = Some(view);
                    id
                }
                Err(error) => {
                    // Nothing stored, nothing to answer.
                    cancel.store(true, Ordering::SeqCst);
                    return Err(error);
                }
            },
            (None, Some(user)) => user.id,
            (None, None) => return Err(Error::Invalid("there is no message to answer".into())),
        };
        let reply = self
            .store
            .append_message(conversation, Some(user), Role::Assistant, "", MessageState::Streaming)
            .await?;
        if let Some(generation) = lock(&self.running).get_mut(&conversation) {
            generation.reply = Some(reply.id);
        }
        let placeholder = self.thread_message(reply.clone()).await?;
        on_event(StreamEvent::Started { user: user_view, reply: placeholder });
        let mut text = String::new();
        let mut pending = 0;
        let mut next = first;
        while let Some(event) = next.take() {
            match event {
                ReplyEvent::Admitted => {}
                ReplyEvent::Text { text: piece } => {
                    text.push_str(&piece);
                    on_event(StreamEvent::Text { text: piece });
                    pending += 1;
                    if pending >= SAVE_EVERY {
                        self.store.update_reply(reply.id, &text).await?;
                        pending = 0;
                    }
                }
                ReplyEvent::Queued { reason } => on_event(StreamEvent::Queued { reason }),
                ReplyEvent::StoppedWaiting => {
                    self.store.finish_reply(reply.id, &text, MessageState::Stopped, None).await?;
                    let done = self.thread_message(self.store.message(reply.id).await?).await?;
                    on_event(StreamEvent::Done { reply: done.clone() });
                    return Ok(done);
                }
                ReplyEvent::Done(outcome) => {
                    let TurnOutcome { tokens, stats, resumed_from, checkpoint, rejected, .. } =
                        *outcome;
                    // Checkpoint bookkeeping never costs the reply itself.
                    if let Err(e) = self
                        .after_reply(
                            conversation,
                            reply.id,
                            &checkpoint_file,
                            checkpoint,
                            resumed_from,
                            rejected,
                        )
                        .await
                    {
                        tracing::warn!(reply = reply.id, "KV checkpoint bookkeeping failed: {e}");
                    }
                    let state = if stats.stop_reason == StopReason::Stopped {
                        MessageState::Stopped
                    } else {
                        MessageState::Complete
                    };
                    let mut stored = serde_json::to_value(&stats).unwrap_or_default();
                    // Kept for the CLI, beyond what the UI shows.
                    merge(&mut stored, serde_json::json!({ "token_ids": tokens }));
                    if raw {
                        text = join_ids(&tokens);
                    }
                    self.store.finish_reply(reply.id, &text, state, Some(&stored)).await?;
                    let done = self.thread_message(self.store.message(reply.id).await?).await?;
                    on_event(StreamEvent::Done { reply: done.clone() });
                    return Ok(done);
                }
                ReplyEvent::Failed { message, kind } => {
                    let stats = serde_json::json!({ "error": message });
                    self.store
                        .finish_reply(reply.id, &text, MessageState::Error, Some(&stats))
                        .await?;
                    let failed = self.thread_message(self.store.message(reply.id).await?).await?;
                    on_event(StreamEvent::Failed { message: message.clone(), reply: Some(failed) });
                    return Err(Error::Reported { kind, message });
                }
            }
            next = events.recv().await;
        }
        self.store.finish_reply(reply.id, &text, MessageState::Error, None).await?;
        Err(Error::Engine("the engine stopped in the middle of a reply".into()))
    }
}
