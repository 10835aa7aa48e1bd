//! Replies: a user message stored and answered, a reply regenerated, a message edited (each a
//! new branch of the message tree), and stopping the reply in flight. A reply is written to the
//! store while it streams, so a crash loses at most the last few pieces.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use engine::generate::StopReason;
use engine::sampling::SamplingParams;
use engine::turn::{Prompt, ResumeCandidate, Turn, TurnMessage, TurnOutcome};
use store::{MessageState, Role};

use crate::view::{LoadedModel, StreamEvent, ThreadMessage};
use crate::{
    Chat, Error, Generation, NEW_TITLE, ReplyEvent, Result, SAVE_EVERY, attachment_mime, extras,
    join_ids, lock, merge, parse_ids, settings_of, title_from,
};

impl Chat {
    fn require_model(&self, images: usize) -> Result<LoadedModel> {
        let loaded = lock(&self.loaded).clone().ok_or_else(|| {
            Error::ModelMissing("No model is loaded. Pick one in the model library.".into())
        })?;
        if images > 0 && !loaded.vision {
            return Err(Error::Invalid(format!("{} does not take images", loaded.name)));
        }
        Ok(loaded)
    }

    /// Adds a user message (with imported images, see [`Chat::import_attachment`]) under the
    /// conversation's current tip and generates the reply, streaming [`StreamEvent`]s. Returns
    /// the stored reply. Nothing is stored when no model is loaded or an image is missing.
    pub async fn send(
        &self,
        conversation: i64,
        text: &str,
        files: &[String],
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        let model = self.require_model(files.len())?;
        if text.trim().is_empty() && files.is_empty() {
            return Err(Error::Invalid("the message is empty".into()));
        }
        let paths = files.iter().map(|f| self.attachment_path(f)).collect::<Result<Vec<_>>>()?;
        let chat = self.store.conversation(conversation).await?;
        if extras(&chat.settings).0 {
            return Err(Error::Invalid("this conversation takes token ids, not text".into()));
        }
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
        self.store.set_model(conversation, &model.name).await?;
        let user = self.thread_message(self.store.message(user.id).await?).await?;
        self.reply_to(conversation, user.id, Some(user), &mut on_event).await
    }

    /// Appends token ids, verbatim, as the next turn of a raw conversation (see
    /// [`Chat::set_raw_options`]) and generates the reply (stored as its ids).
    pub async fn send_tokens(
        &self,
        conversation: i64,
        ids: &[u32],
        mut on_event: impl FnMut(StreamEvent),
    ) -> Result<ThreadMessage> {
        self.require_model(0)?;
        if ids.is_empty() {
            return Err(Error::Invalid("no token ids to send".into()));
        }
        let chat = self.store.conversation(conversation).await?;
        if !extras(&chat.settings).0 {
            return Err(Error::Invalid("this conversation takes text, not token ids".into()));
        }
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
        self.reply_to(conversation, user.id, Some(user), &mut on_event).await
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
        self.require_model(self.store.attachments(parent).await?.len())?;
        self.reply_to(old.conversation_id, parent, None, &mut on_event).await
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
        self.require_model(attachments.len())?;
        if text.trim().is_empty() && attachments.is_empty() {
            return Err(Error::Invalid("the message is empty".into()));
        }
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
        self.reply_to(old.conversation_id, edited.id, Some(user), &mut on_event).await
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

    async fn reply_to(
        &self,
        conversation: i64,
        user: i64,
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
        let result = self.reply_inner(conversation, user, user_view, cancel, on_event).await;
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
        let prompt = if raw {
            let mut ids = Vec::new();
            for m in &path {
                ids.extend(parse_ids(&m.content)?);
            }
            Prompt::Tokens { ids, images: Vec::new() }
        } else {
            let mut messages = Vec::new();
            if let Some(system) = chat.system_prompt.as_deref().filter(|s| !s.trim().is_empty()) {
                messages.push(TurnMessage::text("system", system));
            }
            for m in &path {
                let images = self
                    .store
                    .attachments(m.id)
                    .await?
                    .into_iter()
                    .map(|a| self.attachments_dir().join(a.path))
                    .collect();
                messages.push(TurnMessage {
                    role: m.role.as_str().to_string(),
                    text: m.content.clone(),
                    images,
                });
            }
            Prompt::Messages(messages)
        };
        // Checkpoints of this branch's earlier nodes, by this very model, longest first.
        let identity = lock(&self.identity).clone().filter(|_| self.checkpoints);
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
