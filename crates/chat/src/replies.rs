//! Replies: a user message stored and answered, a reply regenerated, a message edited (each a
//! new branch of the message tree), and stopping the reply in flight. A reply is written to the
//! store while it streams, so a crash loses at most the last few pieces.

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
pub(crate) enum Pending<'a> {
    /// A text message with its images.
    Message(TurnMessage),
    /// Token ids of a raw conversation.
    Tokens(&'a [u32]),
}

impl Chat {
    /// The prompt of a reply to `path` (the stored branch, root first) and `pending`: token
    /// ids in a raw conversation, else the messages with their images and the system prompt.
    async fn prompt_of(
        &self,
        chat: &store::Conversation,
        path: &[store::Message],
        pending: Option<Pending<'_>>,
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
            stored.push(message);
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

    /// Refuses, before anything is stored, a reply whose KV cache would pass the memory limit
    /// (the user then picks a smaller KV cache or a new chat, and sends the same text). The
    /// reply answers the branch ending at `parent` and `pending`. Other refusals (a prompt over
    /// the context) are the reply's own: the message is stored and the reply records the error,
    /// as it does while a model loads, when nothing can be checked before.
    async fn check_reply(
        &self,
        conversation: i64,
        parent: Option<i64>,
        pending: Option<Pending<'_>>,
    ) -> Result<()> {
        if lock(&self.loading).is_some() || lock(&self.loaded).is_none() {
            return Ok(());
        }
        let chat = self.store.conversation(conversation).await?;
        let path = match parent {
            Some(parent) => self.store.path_to(parent).await?,
            None => Vec::new(),
        };
        let prompt = self.prompt_of(&chat, &path, pending).await?;
        let settings = settings_of(&chat.settings);
        let turn = Turn {
            max_tokens: settings.max_tokens as usize,
            max_soft_tokens: settings.max_soft_tokens as usize,
            thinking: Some(settings.thinking),
            kv: settings.kv,
            memory_share: Some(self.app_settings().await?.memory_share),
            ..Turn::new(prompt)
        };
        match self.engine.check(turn).await {
            Err(error) if error.kind() == ErrorKind::OutOfMemory => Err(error),
            _ => Ok(()),
        }
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
    /// the stored reply. Nothing is stored when no model is loaded or loading, or an image is
    /// missing. While a model loads, the message is stored at once and answered when the load
    /// ends ([`StreamEvent::Waiting`] meanwhile); if the load fails, the message stays,
    /// unanswered, for [`Chat::answer`].
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
        let message = TurnMessage {
            role: "user".into(),
            text: text.into(),
            images: paths.clone(),
            ..TurnMessage::default()
        };
        self.check_reply(conversation, chat.current_leaf_id, Some(Pending::Message(message)))
            .await?;
        let user = self
            .store
            .append_message(
                conversation,
                chat.current_leaf_id,
                Role::User,
                text,
                MessageState::Complete,
            )
            .await?;
        for (position, (file, path)) in files.iter().zip(&paths).enumerate() {
            let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            let mime = attachment_mime(file);
            let sha = file.split('.').next().unwrap_or_default();
            self.store
                .add_attachment(user.id, file, mime, bytes as i64, sha, position as i64)
                .await?;
        }
        if chat.title.is_empty() || chat.title == NEW_TITLE {
            self.store.rename_conversation(conversation, &title_from(text)).await?;
        }
        self.store.set_model(conversation, &model).await?;
        let user = self.thread_message(self.store.message(user.id).await?).await?;
        self.reply_to(conversation, user.id, files.len(), Some(user), &mut on_event).await
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
        self.check_reply(conversation, chat.current_leaf_id, Some(Pending::Tokens(ids))).await?;
        let user = self
            .store
            .append_message(
                conversation,
                chat.current_leaf_id,
                Role::User,
                &join_ids(ids),
                MessageState::Complete,
            )
            .await?;
        let user = self.thread_message(user).await?;
        self.reply_to(conversation, user.id, 0, Some(user), &mut on_event).await
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
        self.check_reply(old.conversation_id, Some(parent), None).await?;
        self.reply_to(old.conversation_id, parent, images, None, &mut on_event).await
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
        self.check_reply(user.conversation_id, Some(user.id), None).await?;
        self.reply_to(user.conversation_id, user.id, images, None, &mut on_event).await
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
        let message = TurnMessage {
            role: "user".into(),
            text: text.into(),
            images: files,
            ..TurnMessage::default()
        };
        self.check_reply(old.conversation_id, old.parent_id, Some(Pending::Message(message)))
            .await?;
        let edited = self
            .store
            .append_message(
                old.conversation_id,
                old.parent_id,
                Role::User,
                text,
                MessageState::Complete,
            )
            .await?;
        for a in attachments {
            self.store
                .add_attachment(edited.id, &a.path, &a.mime, a.bytes, &a.sha256, a.position)
                .await?;
        }
        let user = self.thread_message(self.store.message(edited.id).await?).await?;
        self.reply_to(old.conversation_id, edited.id, images, Some(user), &mut on_event).await
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

    /// Answers the stored user message `user` (with `images` images), once the model is
    /// loaded.
    async fn reply_to(
        &self,
        conversation: i64,
        user: i64,
        images: usize,
        user_view: Option<ThreadMessage>,
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
        let result =
            match self.model_when_loaded(images, &cancel, user_view.as_ref(), on_event).await {
                Ok(_) => self.reply_inner(conversation, user, user_view, cancel, on_event).await,
                Err(error) => {
                    if !matches!(error, Error::Cancelled) {
                        on_event(StreamEvent::Failed { message: error.to_string(), reply: None });
                    }
                    Err(error)
                }
            };
        lock(&self.running).remove(&conversation);
        result
    }

    async fn reply_inner(
        &self,
        conversation: i64,
        user: i64,
        user_view: Option<ThreadMessage>,
        cancel: Arc<AtomicBool>,
        on_event: &mut impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let chat = self.store.conversation(conversation).await?;
        let path = self.store.path_to(user).await?;
        let settings = settings_of(&chat.settings);
        let (raw, ignore_eos) = extras(&chat.settings);
        let prompt = self.prompt_of(&chat, &path, None).await?;
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
        let reply = self
            .store
            .append_message(conversation, Some(user), Role::Assistant, "", MessageState::Streaming)
            .await?;
        let checkpoint_file = format!("{conversation}/{}.safetensors", reply.id);
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
        if let Some(generation) = lock(&self.running).get_mut(&conversation) {
            generation.reply = Some(reply.id);
        }
        let placeholder = self.thread_message(reply.clone()).await?;
        on_event(StreamEvent::Started { user: user_view, reply: placeholder });
        let mut events = self.engine.reply(turn, cancel)?;
        let mut text = String::new();
        let mut pending = 0;
        while let Some(event) = events.recv().await {
            match event {
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
        }
        self.store.finish_reply(reply.id, &text, MessageState::Error, None).await?;
        Err(Error::Engine("the engine stopped in the middle of a reply".into()))
    }
}
