//! The one command surface every front end (the Tauri app, the CLI, a future local server)
//! uses: conversations in the [`store`], replies from the [`engine`] running on its own actor
//! thread ([`Engine`]), the model [`library`], joined here. Every value a front end receives is
//! one of the [`view`] types, whose TypeScript declarations are generated.
//!
//! A reply is written to the store while it streams (every few pieces, and at the end with its
//! statistics), so a crash loses at most the last few tokens and the store marks it stopped.
//! One reply per conversation runs at a time; [`Chat::stop`] ends it after the current token.
//!
//! Images are imported first ([`Chat::import_attachment`]): checked to decode, then copied into
//! the app's attachment folder under their SHA-256, so a message keeps its images even when the
//! user's original file moves.

#![deny(missing_docs)]

mod actor;
pub mod downloads;
mod error;
pub mod library;
pub mod view;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use actor::{
    Engine, ModelInfo, ReplyEvent, ReplyRequest, ResumeCandidate, TurnMessage, WrittenCheckpoint,
};
/// The MLX settings every front end applies at start, before any MLX op.
pub use engine::configure_mlx;
use engine::kv_file::Identity;
use engine::sampling::SamplingParams;
pub use error::{Error, Result};
use sha2::Digest;
use store::{MessageState, Role, Store};
use view::{
    AttachmentView, BranchInfo, ConversationDetail, ConversationSummary, LoadEvent, LoadedModel,
    ModelEntry, ModelSource, ModelsState, PendingAttachment, ReplyStats, Settings, StreamEvent,
    ThreadMessage,
};

/// Titles longer than this are cut (at a character boundary) with an ellipsis.
const TITLE_CHARS: usize = 48;
/// A streaming reply is saved after this many new pieces.
const SAVE_EVERY: usize = 8;
/// The title of a conversation nobody has written in yet.
const NEW_TITLE: &str = "New chat";
/// Largest image accepted, bytes.
pub const MAX_IMAGE_BYTES: usize = 50 << 20;
/// The app setting holding the checkpoint disk budget in bytes.
pub const CHECKPOINT_BUDGET: &str = "checkpoint_budget_bytes";
/// Default disk budget for KV checkpoints.
pub const DEFAULT_CHECKPOINT_BUDGET: u64 = 10 << 30;
/// The app setting holding the last model loaded.
const LAST_MODEL: &str = "last_model";

/// The app's state: the store, the engine, the library, and the replies in flight.
#[derive(Debug, Clone)]
pub struct Chat {
    store: Store,
    engine: Engine,
    data_dir: PathBuf,
    demo_model: Option<PathBuf>,
    hf_cache: Option<PathBuf>,
    /// Replies in flight, by conversation.
    running: Arc<Mutex<HashMap<i64, Generation>>>,
    loaded: Arc<Mutex<Option<LoadedModel>>>,
    loading: Arc<Mutex<Option<Arc<AtomicBool>>>>,
    /// The loaded model's checkpoint identity.
    identity: Arc<Mutex<Option<Identity>>>,
    /// Most bytes of checkpoint files kept; the least recently used go first.
    checkpoint_budget: u64,
    /// Whether replies resume from and write KV checkpoints.
    checkpoints: bool,
    /// Model downloads in this process.
    downloads: Arc<downloads::Registry>,
}

/// A reply in flight.
#[derive(Debug)]
struct Generation {
    /// The reply's id: the generation's id, once the reply is stored.
    reply: Option<i64>,
    /// Set to stop it after the current token.
    stop: Arc<AtomicBool>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Chat {
    /// Opens (or creates) the app data in `data_dir`: `quince.sqlite3` and `attachments/`,
    /// and starts the engine thread.
    pub async fn open(data_dir: impl AsRef<Path>) -> Result<Chat> {
        let data_dir = data_dir.as_ref().to_path_buf();
        std::fs::create_dir_all(data_dir.join("attachments")).map_err(|e| {
            Error::Invalid(format!("cannot create the data folder {}: {e}", data_dir.display()))
        })?;
        remove_partial_files(&data_dir.join("checkpoints"));
        let store = Store::open(data_dir.join("quince.sqlite3")).await?;
        let checkpoint_budget = store
            .setting(CHECKPOINT_BUDGET)
            .await?
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_CHECKPOINT_BUDGET);
        // Downloads a quit or a crash interrupted are paused; their bytes wait on disk.
        store.pause_interrupted_downloads().await?;
        Ok(Chat {
            store,
            engine: Engine::start()?,
            data_dir,
            demo_model: None,
            hf_cache: library::hf_cache_dir(),
            running: Arc::default(),
            loaded: Arc::default(),
            loading: Arc::default(),
            identity: Arc::default(),
            checkpoint_budget,
            checkpoints: true,
            downloads: Arc::default(),
        })
    }

    /// Stops the engine (freeing the model) and waits for it: call before the process exits
    /// while other handles may still be alive.
    pub fn shutdown(&self) {
        self.engine.shutdown();
    }

    /// Sets the demo model folder shipped with the app (listed first, the default when no
    /// other model was used).
    pub fn with_demo_model(mut self, path: PathBuf) -> Chat {
        self.demo_model = Some(path);
        self
    }

    /// Sets the Hugging Face cache folder to scan (default: [`library::hf_cache_dir`]);
    /// `None` scans nothing.
    pub fn with_hf_cache(mut self, dir: Option<PathBuf>) -> Chat {
        self.hf_cache = dir;
        self
    }

    /// The store, for plain reads and edits.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Where the database and the attachments live.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Sets the disk budget for KV checkpoint files for this session (the stored setting
    /// [`CHECKPOINT_BUDGET`], else 10 GiB).
    pub fn with_checkpoint_budget(mut self, bytes: u64) -> Chat {
        self.checkpoint_budget = bytes;
        self
    }

    /// Turns KV checkpoints off (every turn re-prefills the whole conversation) or on.
    pub fn with_checkpoints(mut self, enabled: bool) -> Chat {
        self.checkpoints = enabled;
        self
    }

    /// The folder of KV checkpoint files (`<conversation>/<reply>.safetensors`).
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.data_dir.join("checkpoints")
    }

    /// The folder of imported images.
    pub fn attachments_dir(&self) -> PathBuf {
        self.data_dir.join("attachments")
    }

    // ---- conversations ----

    /// Conversations, most recent first; with a query, those whose title or messages hold it.
    pub async fn conversations(&self, query: Option<&str>) -> Result<Vec<ConversationSummary>> {
        let rows = match query.map(str::trim).filter(|q| !q.is_empty()) {
            Some(q) => self.store.search(q).await?,
            None => self.store.conversations().await?,
        };
        Ok(rows
            .into_iter()
            .map(|c| ConversationSummary {
                id: c.id,
                title: c.title,
                model_id: c.model_id,
                updated_at: c.updated_at,
            })
            .collect())
    }

    /// A new, empty conversation with default settings.
    pub async fn create_conversation(&self) -> Result<ConversationDetail> {
        let model = lock(&self.loaded).as_ref().map(|m| m.name.clone());
        let c = self.store.create_conversation(NEW_TITLE, model.as_deref()).await?;
        let settings = serde_json::to_value(Settings::default()).unwrap_or_default();
        self.store.set_settings(c.id, &settings).await?;
        self.conversation(c.id).await
    }

    /// A conversation with its current branch.
    pub async fn conversation(&self, id: i64) -> Result<ConversationDetail> {
        let c = self.store.conversation(id).await?;
        let mut messages = Vec::new();
        if let Some(leaf) = c.current_leaf_id {
            for m in self.store.path_to(leaf).await? {
                messages.push(self.thread_message(m).await?);
            }
        }
        Ok(ConversationDetail {
            id: c.id,
            title: c.title,
            model_id: c.model_id,
            system_prompt: c.system_prompt.unwrap_or_default(),
            settings: settings_of(&c.settings),
            messages,
        })
    }

    /// Renames a conversation.
    pub async fn rename(&self, id: i64, title: &str) -> Result<()> {
        let title = title.trim();
        if title.is_empty() {
            return Err(Error::Invalid("a title cannot be empty".into()));
        }
        Ok(self.store.rename_conversation(id, title).await?)
    }

    /// Deletes a conversation, its messages, and the image files no other message uses.
    pub async fn delete(&self, id: i64) -> Result<()> {
        if lock(&self.running).contains_key(&id) {
            return Err(Error::Busy("stop the reply before deleting the conversation".into()));
        }
        let files = self.store.conversation_attachment_paths(id).await?;
        let checkpoints = self.store.checkpoint_paths(id).await?;
        self.store.delete_conversation(id).await?;
        for file in checkpoints {
            let _ = std::fs::remove_file(self.checkpoints_dir().join(file));
        }
        let _ = std::fs::remove_dir(self.checkpoints_dir().join(id.to_string()));
        for file in files {
            if self.store.attachment_references(&file).await? == 0 {
                let _ = std::fs::remove_file(self.attachments_dir().join(&file));
            }
        }
        Ok(())
    }

    /// Sets the system prompt ("" clears it).
    pub async fn set_system_prompt(&self, id: i64, prompt: &str) -> Result<()> {
        let prompt = Some(prompt).filter(|p| !p.trim().is_empty());
        Ok(self.store.set_system_prompt(id, prompt).await?)
    }

    /// Sets the sampling settings.
    pub async fn set_settings(&self, id: i64, settings: &Settings) -> Result<()> {
        if !(0.0..=5.0).contains(&settings.temperature)
            || !(0.0..=1.0).contains(&settings.top_p)
            || settings.max_tokens == 0
        {
            return Err(Error::Invalid(
                "temperature must be 0–5, top-p 0–1, and max tokens at least 1".into(),
            ));
        }
        match &settings.speculation {
            view::Speculation::Draft { model }
                if !Path::new(model).join("config.json").is_file() =>
            {
                return Err(Error::Invalid(format!(
                    "no model at {model}: a draft model is a model folder with a config.json"
                )));
            }
            view::Speculation::Assistant { model }
                if model_type(Path::new(model)).as_deref() != Some("gemma4_assistant") =>
            {
                return Err(Error::Invalid(format!(
                    "no Gemma 4 assistant at {model}: its config.json must say \
                     model_type gemma4_assistant"
                )));
            }
            _ => {}
        }
        let mut value = self.store.conversation(id).await?.settings;
        merge(&mut value, serde_json::to_value(settings).unwrap_or_default());
        Ok(self.store.set_settings(id, &value).await?)
    }

    /// Sets the options the CLI uses: `raw_tokens` (turns are token ids, verbatim, no
    /// template) and `ignore_eos`. A conversation with text messages cannot become raw.
    pub async fn set_raw_options(&self, id: i64, raw_tokens: bool, ignore_eos: bool) -> Result<()> {
        let c = self.store.conversation(id).await?;
        let (was_raw, _) = extras(&c.settings);
        if raw_tokens != was_raw && c.current_leaf_id.is_some() {
            return Err(Error::Invalid(
                "a conversation's messages are either all text or all token ids".into(),
            ));
        }
        let mut value = c.settings;
        merge(
            &mut value,
            serde_json::json!({ "raw_tokens": raw_tokens, "ignore_eos": ignore_eos }),
        );
        Ok(self.store.set_settings(id, &value).await?)
    }

    /// Shows the branch through `message` (one of a `‹ 2/3 ›` set): its newest leaf becomes
    /// the conversation's tip.
    pub async fn switch_branch(&self, message: i64) -> Result<ConversationDetail> {
        let m = self.store.message(message).await?;
        let leaf = self.store.latest_leaf(message).await?;
        self.store.set_current_leaf(m.conversation_id, leaf).await?;
        self.conversation(m.conversation_id).await
    }

    async fn thread_message(&self, m: store::Message) -> Result<ThreadMessage> {
        let siblings: Vec<i64> = self
            .store
            .children(m.conversation_id, m.parent_id)
            .await?
            .into_iter()
            .map(|s| s.id)
            .collect();
        let index = siblings.iter().position(|&s| s == m.id).unwrap_or(0) as u32;
        let attachments = self
            .store
            .attachments(m.id)
            .await?
            .into_iter()
            .map(|a| AttachmentView { file: a.path, mime: a.mime, bytes: a.bytes as u64 })
            .collect();
        let error = m.stats.as_ref().and_then(|s| s.get("error")).map(|e| match e.as_str() {
            Some(text) => text.to_string(),
            None => e.to_string(),
        });
        let stats = m.stats.and_then(|s| serde_json::from_value::<ReplyStats>(s).ok());
        Ok(ThreadMessage {
            id: m.id,
            parent_id: m.parent_id,
            role: m.role,
            content: m.content,
            state: m.state,
            stats,
            error,
            attachments,
            branch: BranchInfo { index, count: siblings.len() as u32, siblings },
            created_at: m.created_at,
        })
    }

    // ---- attachments ----

    /// Checks that `bytes` are an image the engine can read, and copies them into the
    /// attachment folder as `<sha256>.<ext>`.
    pub async fn import_attachment(&self, bytes: &[u8], name: &str) -> Result<PendingAttachment> {
        if bytes.len() > MAX_IMAGE_BYTES {
            return Err(Error::BadImage(format!(
                "{name} is {} MB; images up to {} MB are accepted",
                bytes.len() >> 20,
                MAX_IMAGE_BYTES >> 20
            )));
        }
        let rgb = engine::vision::image::decode_rgb(bytes).map_err(|e| {
            Error::BadImage(format!("{name} is not an image Quince can read ({e})"))
        })?;
        let (mime, ext) = match image_format(bytes) {
            Some(format) => format,
            None => {
                return Err(Error::BadImage(format!(
                    "{name} is not a PNG, JPEG, WebP, GIF or BMP image"
                )));
            }
        };
        let sha: String = sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
        let file = format!("{sha}.{ext}");
        let path = self.attachments_dir().join(&file);
        if !path.is_file() {
            // Write then rename, so a crash never leaves a half file under the final name.
            let partial = self.attachments_dir().join(format!("{file}.partial"));
            std::fs::write(&partial, bytes)
                .and_then(|()| std::fs::rename(&partial, &path))
                .map_err(|e| Error::Invalid(format!("cannot save {name}: {e}")))?;
        }
        Ok(PendingAttachment {
            file,
            mime: mime.into(),
            bytes: bytes.len() as u64,
            width: rgb.width(),
            height: rgb.height(),
            name: name.to_string(),
        })
    }

    fn attachment_path(&self, file: &str) -> Result<PathBuf> {
        let path = self.attachments_dir().join(file);
        if !is_attachment_name(file) || !path.is_file() {
            return Err(Error::BadImage(format!(
                "the attachment {file} is missing; attach the image again"
            )));
        }
        Ok(path)
    }

    // ---- replies ----

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
        let mut messages = Vec::new();
        if let Some(system) = chat.system_prompt.as_deref().filter(|s| !s.trim().is_empty()) {
            messages.push(TurnMessage {
                role: "system".into(),
                text: system.into(),
                images: Vec::new(),
            });
        }
        let path = self.store.path_to(user).await?;
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
        let settings = settings_of(&chat.settings);
        let (raw, ignore_eos) = extras(&chat.settings);
        let raw_prompt = if raw {
            let mut ids = Vec::new();
            for m in &path {
                ids.extend(parse_ids(&m.content)?);
            }
            Some(ids)
        } else {
            None
        };
        let reply = self
            .store
            .append_message(conversation, Some(user), Role::Assistant, "", MessageState::Streaming)
            .await?;
        let checkpoint_file = format!("{conversation}/{}.safetensors", reply.id);
        let request = ReplyRequest {
            messages,
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
            raw_prompt,
            ignore_eos,
            speculation: match &settings.speculation {
                view::Speculation::Off => actor::Speculation::Off,
                view::Speculation::Lookup => actor::Speculation::Lookup,
                view::Speculation::Draft { model } => actor::Speculation::Draft(model.into()),
                view::Speculation::Assistant { model } => {
                    actor::Speculation::Assistant(model.into())
                }
            },
        };
        if let Some(generation) = lock(&self.running).get_mut(&conversation) {
            generation.reply = Some(reply.id);
        }
        let placeholder = self.thread_message(reply.clone()).await?;
        on_event(StreamEvent::Started { user: user_view, reply: placeholder });
        let mut events = self.engine.reply(request, cancel)?;
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
                ReplyEvent::Done {
                    reused_tokens,
                    resumed_from,
                    checkpoint,
                    rejected,
                    tokens,
                    prefill_tok_s,
                    restore_ms,
                    stop_reason,
                    prompt_tokens,
                    generated_tokens,
                    ttft_ms,
                    decode_tok_s,
                    peak_mem_bytes,
                    spec,
                } => {
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
                    let state = if stop_reason == "stopped" {
                        MessageState::Stopped
                    } else {
                        MessageState::Complete
                    };
                    let stats = ReplyStats {
                        stop_reason,
                        reused_tokens: reused_tokens as u32,
                        resumed: resumed_from.is_some(),
                        prompt_tokens: prompt_tokens as u32,
                        generated_tokens: generated_tokens as u32,
                        ttft_ms,
                        decode_tok_s,
                        peak_mem_bytes: peak_mem_bytes as u64,
                        spec: spec.map(|s| view::SpecView {
                            acceptance_rate: s.acceptance_rate(),
                            mean_accepted_length: s.mean_accepted_length(),
                            method: s.method,
                            rounds: s.rounds as u32,
                            proposed: s.proposed as u32,
                            accepted: s.accepted as u32,
                            context_computed: s.context_computed as u32,
                        }),
                    };
                    let mut stats = serde_json::to_value(&stats).unwrap_or_default();
                    // Kept for the CLI, beyond what the UI shows.
                    merge(
                        &mut stats,
                        serde_json::json!({
                            "token_ids": tokens,
                            "prefill_tok_s": prefill_tok_s,
                            "restore_ms": restore_ms,
                        }),
                    );
                    if raw {
                        text = join_ids(&tokens);
                    }
                    self.store.finish_reply(reply.id, &text, state, Some(&stats)).await?;
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

    /// Indexes the checkpoint a reply wrote, marks the one it resumed from as used, drops
    /// the ones found damaged, and keeps the files within the disk budget.
    async fn after_reply(
        &self,
        conversation: i64,
        reply: i64,
        file: &str,
        written: Option<Box<WrittenCheckpoint>>,
        resumed_from: Option<i64>,
        rejected: Vec<(i64, String)>,
    ) -> Result<()> {
        for (id, why) in rejected {
            tracing::warn!(checkpoint = id, "discarding a KV checkpoint: {why}");
            self.drop_checkpoint(id).await?;
        }
        if let Some(id) = resumed_from {
            self.store.touch_checkpoint(id).await?;
        }
        let identity = lock(&self.identity).clone();
        let (Some(written), Some(identity)) = (written, identity) else { return Ok(()) };
        let attachments = written.file.attachments.clone();
        let new = self
            .store
            .add_checkpoint(&store::Checkpoint {
                id: 0,
                conversation_id: conversation,
                message_id: reply,
                model_id: identity.model_id,
                config_hash: identity.config_hash,
                cache_signature: written.file.signature,
                prefix_hash: engine::kv_file::tokens_hash(&written.tokens),
                tokens: written.tokens,
                path: file.to_string(),
                bytes: written.file.bytes as i64,
                sha256: written.file.sha256,
                created_at: 0,
                last_used_at: 0,
            })
            .await?;
        for a in attachments {
            self.store
                .add_checkpoint_attachment(&store::CheckpointAttachment {
                    id: 0,
                    checkpoint_id: new,
                    schema: a.schema,
                    metadata: a.metadata,
                    tensors: a.tensors,
                })
                .await?;
        }
        self.enforce_checkpoint_budget(new).await
    }

    /// Deletes the least recently used checkpoints (never `keep`) until the files fit the
    /// budget.
    async fn enforce_checkpoint_budget(&self, keep: i64) -> Result<()> {
        let all = self.store.checkpoints_by_use().await?;
        let mut total: u64 = all.iter().map(|c| c.bytes as u64).sum();
        for c in all {
            if total <= self.checkpoint_budget {
                break;
            }
            if c.id == keep {
                continue;
            }
            tracing::info!(checkpoint = c.id, bytes = c.bytes, "evicting a KV checkpoint");
            self.store.delete_checkpoint(c.id).await?;
            let _ = std::fs::remove_file(self.checkpoints_dir().join(&c.path));
            total -= c.bytes as u64;
        }
        Ok(())
    }

    async fn drop_checkpoint(&self, id: i64) -> Result<()> {
        let found = self.store.checkpoints_by_use().await?.into_iter().find(|c| c.id == id);
        self.store.delete_checkpoint(id).await?;
        if let Some(c) = found {
            let _ = std::fs::remove_file(self.checkpoints_dir().join(c.path));
        }
        Ok(())
    }

    // ---- models ----

    /// The library (demo model, added folders, the Hugging Face cache) and what is loaded.
    pub async fn models(&self) -> Result<ModelsState> {
        let mut models = Vec::new();
        if let Some(demo) = &self.demo_model {
            models.push(library::describe(demo, ModelSource::Demo, library::DEMO_NAME.into()));
        }
        for folder in self.store.model_folders().await? {
            let path = PathBuf::from(&folder);
            let name = library::display_name(&path);
            models.push(library::describe(&path, ModelSource::Folder, name));
        }
        if let Some(cache) = &self.hf_cache {
            for entry in library::scan_hf_cache(cache) {
                if !models.iter().any(|m| m.path == entry.path) {
                    models.push(entry);
                }
            }
        }
        let last = self.store.setting(LAST_MODEL).await?;
        let usable = |path: &str| models.iter().any(|m| m.path == path && m.problem.is_none());
        let default_model = last
            .filter(|p| usable(p))
            .or_else(|| models.iter().find(|m| m.problem.is_none()).map(|m| m.path.clone()));
        Ok(ModelsState { loaded: lock(&self.loaded).clone(), models, default_model })
    }

    /// Adds a model folder to the library; refused (and not added) when it cannot be loaded.
    pub async fn add_model_folder(&self, path: &Path) -> Result<ModelEntry> {
        let entry = library::describe(path, ModelSource::Folder, library::display_name(path));
        if let Some(problem) = &entry.problem {
            return Err(Error::Reported {
                kind: view::ErrorKind::ModelLoad,
                message: format!("{} cannot be added: {problem}", path.display()),
            });
        }
        self.store.add_model_folder(&entry.path).await?;
        Ok(entry)
    }

    /// Removes a folder from the library (its files stay).
    pub async fn remove_model_folder(&self, path: &str) -> Result<()> {
        Ok(self.store.remove_model_folder(path).await?)
    }

    /// The model in the engine.
    pub fn loaded(&self) -> Option<LoadedModel> {
        lock(&self.loaded).clone()
    }

    /// Loads the model at `path` into the engine, reporting stages; [`Chat::cancel_load`]
    /// stops it (the previous model stays). One load at a time.
    pub async fn load_model(
        &self,
        path: &Path,
        mut on_event: impl FnMut(LoadEvent),
    ) -> Result<LoadedModel> {
        if model_type(path).is_some_and(|t| library::DRAFTERS.contains(&t.as_str())) {
            return Err(Error::Invalid(format!(
                "{} is a Gemma 4 assistant drafter, not a chat model: load the model it was made \
                 for, then choose the assistant under Speculative decoding in the chat's settings",
                path.display()
            )));
        }
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut loading = lock(&self.loading);
            if loading.is_some() {
                return Err(Error::Busy("a model is already loading".into()));
            }
            *loading = Some(cancel.clone());
        }
        let (progress, mut stages) = tokio::sync::mpsc::unbounded_channel();
        let load = self.engine.load(path.to_path_buf(), progress, cancel);
        tokio::pin!(load);
        let result = loop {
            tokio::select! {
                result = &mut load => break result,
                Some((stage, done, total)) = stages.recv() => {
                    on_event(LoadEvent::Progress { stage, done, total });
                }
            }
        };
        *lock(&self.loading) = None;
        let info = result?;
        let model = LoadedModel {
            path: info.path.to_string_lossy().into_owned(),
            name: if self.demo_model.as_deref() == Some(path) {
                library::DEMO_NAME.into()
            } else {
                library::display_name(path)
            },
            vision: info.vision,
            max_context: info.max_context as u32,
        };
        *lock(&self.loaded) = Some(model.clone());
        *lock(&self.identity) = Some(info.identity.clone());
        self.store.set_setting(LAST_MODEL, &model.path).await?;
        on_event(LoadEvent::Done { model: model.clone() });
        Ok(model)
    }

    /// Cancels the model load in progress; false when none is.
    pub fn cancel_load(&self) -> bool {
        match lock(&self.loading).as_ref() {
            Some(flag) => {
                flag.store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }
}

/// Deletes checkpoint files a killed process left half-written (they never got an index row).
fn remove_partial_files(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            remove_partial_files(&path);
        } else if entry.file_name().to_string_lossy().starts_with(".partial-") {
            tracing::info!(file = %path.display(), "removing a half-written checkpoint");
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The options beyond [`Settings`] in a conversation's settings JSON: (raw_tokens, ignore_eos).
fn extras(value: &serde_json::Value) -> (bool, bool) {
    let flag = |key: &str| value.get(key).and_then(serde_json::Value::as_bool).unwrap_or(false);
    (flag("raw_tokens"), flag("ignore_eos"))
}

/// Overlays the keys of `update` (an object) on `value`.
fn merge(value: &mut serde_json::Value, update: serde_json::Value) {
    if !value.is_object() {
        *value = serde_json::json!({});
    }
    if let (Some(target), serde_json::Value::Object(update)) = (value.as_object_mut(), update) {
        target.extend(update);
    }
}

/// Token ids as a raw turn's stored text: `1,2,3`.
pub fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// The ids of a raw turn's stored text.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    text.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().map_err(|_| Error::Invalid(format!("{t:?} is not a token id"))))
        .collect()
}

/// The settings stored as JSON, with defaults for what is missing or malformed.
/// The `model_type` in a folder's `config.json`, if it has one.
fn model_type(folder: &Path) -> Option<String> {
    let config = std::fs::read_to_string(folder.join("config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&config).ok()?;
    config.get("model_type")?.as_str().map(str::to_string)
}

fn settings_of(value: &serde_json::Value) -> Settings {
    serde_json::from_value(value.clone()).unwrap_or_default()
}

/// The MIME type and file extension of image bytes, from their magic number.
fn image_format(bytes: &[u8]) -> Option<(&'static str, &'static str)> {
    match bytes {
        [0x89, b'P', b'N', b'G', ..] => Some(("image/png", "png")),
        [0xFF, 0xD8, 0xFF, ..] => Some(("image/jpeg", "jpg")),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => {
            Some(("image/webp", "webp"))
        }
        [b'G', b'I', b'F', b'8', ..] => Some(("image/gif", "gif")),
        [b'B', b'M', ..] => Some(("image/bmp", "bmp")),
        _ => None,
    }
}

/// Whether `file` can name an imported attachment: letters, digits and dots, not starting with
/// a dot, so it can never leave the attachment folder.
pub fn is_attachment_name(file: &str) -> bool {
    !file.is_empty()
        && !file.starts_with('.')
        && file.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
}

/// The MIME type of an attachment file name (from the extension it was imported with).
pub fn attachment_mime(file: &str) -> &'static str {
    match file.rsplit('.').next() {
        Some("jpg") => "image/jpeg",
        Some("webp") => "image/webp",
        Some("gif") => "image/gif",
        Some("bmp") => "image/bmp",
        _ => "image/png",
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
