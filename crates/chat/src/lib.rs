//! The one command surface every front end (the Tauri app, the CLI, a future local server)
//! uses: conversations in the [`store`], replies from the [`engine`] running on its own actor
//! thread ([`Engine`]), joined here.
//!
//! A reply is written to the store while it streams (every few pieces, and at the end with its
//! statistics), so a crash loses at most the last few tokens and the store marks it stopped.
//! One reply per conversation runs at a time; [`Chat::stop`] ends it after the current token.

#![deny(missing_docs)]

mod actor;
mod error;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub use actor::{Engine, ModelInfo, ReplyEvent, ReplyRequest};
use engine::sampling::SamplingParams;
pub use error::{Error, Result};
use sha2::Digest;
use store::{MessageState, Role, Store};

/// Titles longer than this are cut (at a character boundary) with an ellipsis.
const TITLE_CHARS: usize = 48;
/// A streaming reply is saved after this many new pieces.
const SAVE_EVERY: usize = 8;

/// The app's state: the store, the engine, and the replies in flight.
#[derive(Debug, Clone)]
pub struct Chat {
    store: Store,
    engine: Engine,
    running: Arc<Mutex<HashMap<i64, Arc<AtomicBool>>>>,
}

impl Chat {
    /// Opens the store at `db` and starts the engine thread.
    pub async fn open(db: impl AsRef<Path>) -> Result<Chat> {
        Ok(Chat {
            store: Store::open(db).await?,
            engine: Engine::start()?,
            running: Arc::default(),
        })
    }

    /// The store, for plain reads and edits (list, rename, delete, search).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Loads a model folder into the engine.
    pub async fn load_model(&self, path: PathBuf) -> Result<ModelInfo> {
        self.engine.load(path).await
    }

    /// Adds a user message (with image files) under the conversation's current tip and
    /// generates the reply, streaming its events to `on_event`. Returns the reply as stored.
    pub async fn send(
        &self,
        conversation: i64,
        text: &str,
        images: &[PathBuf],
        on_event: impl FnMut(&ReplyEvent),
    ) -> Result<store::Message> {
        let chat = self.store.conversation(conversation).await?;
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
        for (position, path) in images.iter().enumerate() {
            let data = std::fs::read(path).map_err(|e| {
                Error::Invalid(format!("cannot read the image {}: {e}", path.display()))
            })?;
            let digest = sha2::Sha256::digest(&data);
            let sha256: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            let mime = match path
                .extension()
                .and_then(|e| e.to_str())
                .map(str::to_ascii_lowercase)
                .as_deref()
            {
                Some("jpg" | "jpeg") => "image/jpeg",
                Some("webp") => "image/webp",
                Some("gif") => "image/gif",
                Some("bmp") => "image/bmp",
                _ => "image/png",
            };
            self.store
                .add_attachment(
                    user.id,
                    &path.to_string_lossy(),
                    mime,
                    data.len() as i64,
                    &sha256,
                    position as i64,
                )
                .await?;
        }
        if chat.title.is_empty() || chat.title == "New chat" {
            self.store.rename_conversation(conversation, &title_from(text)).await?;
        }
        self.reply_to(conversation, user.id, on_event).await
    }

    /// A new reply to the same user message as `reply` (a sibling branch).
    pub async fn regenerate(
        &self,
        reply: i64,
        on_event: impl FnMut(&ReplyEvent),
    ) -> Result<store::Message> {
        let old = self.store.message(reply).await?;
        let parent = old
            .parent_id
            .ok_or_else(|| Error::Invalid("the first message has nothing to answer".into()))?;
        self.reply_to(old.conversation_id, parent, on_event).await
    }

    /// Replaces a user message by a new version (a sibling branch) and answers it.
    pub async fn edit(
        &self,
        message: i64,
        text: &str,
        on_event: impl FnMut(&ReplyEvent),
    ) -> Result<store::Message> {
        let old = self.store.message(message).await?;
        if old.role != Role::User {
            return Err(Error::Invalid("only user messages can be edited".into()));
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
        for a in self.store.attachments(old.id).await? {
            self.store
                .add_attachment(edited.id, &a.path, &a.mime, a.bytes, &a.sha256, a.position)
                .await?;
        }
        self.reply_to(old.conversation_id, edited.id, on_event).await
    }

    /// Stops the conversation's reply in flight, if any (it is kept, marked stopped).
    pub fn stop(&self, conversation: i64) -> bool {
        let running = self.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match running.get(&conversation) {
            Some(flag) => {
                flag.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    async fn reply_to(
        &self,
        conversation: i64,
        user: i64,
        mut on_event: impl FnMut(&ReplyEvent),
    ) -> Result<store::Message> {
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut running = self.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if running.contains_key(&conversation) {
                return Err(Error::Invalid(
                    "a reply is already being generated in this conversation".into(),
                ));
            }
            running.insert(conversation, cancel.clone());
        }
        let result = self.reply_inner(conversation, user, cancel, &mut on_event).await;
        self.running.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(&conversation);
        result
    }

    async fn reply_inner(
        &self,
        conversation: i64,
        user: i64,
        cancel: Arc<AtomicBool>,
        on_event: &mut impl FnMut(&ReplyEvent),
    ) -> Result<store::Message> {
        let chat = self.store.conversation(conversation).await?;
        let mut messages = Vec::new();
        if let Some(system) = chat.system_prompt.as_deref().filter(|s| !s.trim().is_empty()) {
            messages.push(("system".to_string(), system.to_string()));
        }
        for m in self.store.path_to(user).await? {
            messages.push((m.role.as_str().to_string(), m.content));
        }
        let images = self
            .store
            .attachments(user)
            .await?
            .into_iter()
            .map(|a| PathBuf::from(a.path))
            .collect();
        let settings = &chat.settings;
        let number = |key: &str| settings.get(key).and_then(serde_json::Value::as_f64);
        let request = ReplyRequest {
            messages,
            images,
            sampling: SamplingParams {
                temperature: number("temperature").unwrap_or(0.7) as f32,
                top_p: number("top_p").unwrap_or(1.0) as f32,
                top_k: number("top_k").unwrap_or(0.0) as usize,
                seed: number("seed").unwrap_or(0.0) as u64,
                ..SamplingParams::default()
            },
            max_tokens: number("max_tokens").unwrap_or(1024.0) as usize,
            max_soft_tokens: number("max_soft_tokens").unwrap_or(280.0) as usize,
        };
        let reply = self
            .store
            .append_message(conversation, Some(user), Role::Assistant, "", MessageState::Streaming)
            .await?;
        let mut events = self.engine.reply(request, cancel)?;
        let mut text = String::new();
        let mut pending = 0;
        while let Some(event) = events.recv().await {
            on_event(&event);
            match &event {
                ReplyEvent::Text { text: piece } => {
                    text.push_str(piece);
                    pending += 1;
                    if pending >= SAVE_EVERY {
                        self.store.update_reply(reply.id, &text).await?;
                        pending = 0;
                    }
                }
                ReplyEvent::Done { stop_reason, .. } => {
                    let state = if stop_reason == "stopped" {
                        MessageState::Stopped
                    } else {
                        MessageState::Complete
                    };
                    let stats = serde_json::to_value(&event).unwrap_or_default();
                    self.store.finish_reply(reply.id, &text, state, Some(&stats)).await?;
                    return Ok(self.store.message(reply.id).await?);
                }
                ReplyEvent::Failed { message } => {
                    let stats = serde_json::json!({ "error": message });
                    self.store
                        .finish_reply(reply.id, &text, MessageState::Error, Some(&stats))
                        .await?;
                    return Ok(self.store.message(reply.id).await?);
                }
            }
        }
        self.store.finish_reply(reply.id, &text, MessageState::Error, None).await?;
        Err(Error::Engine("the engine stopped in the middle of a reply".into()))
    }
}

/// A conversation title from its first message: the first line, cut to a few words.
fn title_from(text: &str) -> String {
    let line = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("New chat");
    if line.chars().count() <= TITLE_CHARS {
        return line.to_string();
    }
    let cut: String = line.chars().take(TITLE_CHARS).collect();
    format!("{}…", cut.trim_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn titles_come_from_the_first_line() {
        assert_eq!(title_from("\n  How do I boil an egg?\nThanks"), "How do I boil an egg?");
        let long = title_from(&"word ".repeat(30));
        assert!(long.ends_with('…') && long.chars().count() <= TITLE_CHARS + 1, "{long}");
        assert_eq!(title_from("   "), "New chat");
    }
}
