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
mod attachments;
mod checkpoints;
mod completions;
mod conversations;
pub mod downloads;
mod error;
pub mod library;
mod models;
mod replies;
mod settings;
pub mod view;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

pub use actor::{Engine, ModelInfo, ReplyEvent};
pub use attachments::{attachment_mime, is_attachment_name};
pub use completions::{Completion, CompletionStream};
/// The MLX settings every front end applies at start, before any MLX op.
pub use engine::configure_mlx;
pub use error::{Error, Result};
use store::Store;
use view::{LoadedModel, Settings};

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
/// The prompt cache ([`Chat::complete`]) keeps at most this fraction of the checkpoint budget.
const PROMPT_CACHE_SHARE: u64 = 4;
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
    loading: Arc<Mutex<Option<models::Loading>>>,
    /// What the engine told of the loaded model (its checkpoint identity, its tool syntax).
    engine_info: Arc<Mutex<Option<actor::ModelInfo>>>,
    /// Most bytes of checkpoint files kept; the least recently used go first.
    checkpoint_budget: u64,
    /// Whether replies resume from and write KV checkpoints.
    checkpoints: bool,
    /// Model downloads in this process.
    downloads: Arc<downloads::Registry>,
    /// Checkpoints of the completions answered ([`Chat::complete`]).
    prompt_cache: Arc<completions::PromptCache>,
}

/// A reply in flight.
#[derive(Debug)]
struct Generation {
    /// The reply's id: the generation's id, once the reply is stored.
    reply: Option<i64>,
    /// Set to stop it after the current token.
    stop: Arc<AtomicBool>,
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
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
        checkpoints::remove_partial_files(&data_dir.join("checkpoints"));
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
            engine: Engine::start(engine::LoadOptions::default())?,
            demo_model: None,
            hf_cache: library::hf_cache_dir(),
            running: Arc::default(),
            loaded: Arc::default(),
            loading: Arc::default(),
            engine_info: Arc::default(),
            prompt_cache: Arc::new(completions::PromptCache::open(
                data_dir.join("checkpoints").join("prompt-cache"),
                checkpoint_budget / PROMPT_CACHE_SHARE,
            )),
            data_dir,
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
        self.prompt_cache.set_budget(bytes / PROMPT_CACHE_SHARE);
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
}

/// The options beyond [`Settings`] in a conversation's settings JSON: (raw_tokens, ignore_eos).
pub(crate) fn extras(value: &serde_json::Value) -> (bool, bool) {
    let flag = |key: &str| value.get(key).and_then(serde_json::Value::as_bool).unwrap_or(false);
    (flag("raw_tokens"), flag("ignore_eos"))
}

/// Overlays the keys of `update` (an object) on `value`.
pub(crate) fn merge(value: &mut serde_json::Value, update: serde_json::Value) {
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

/// The `model_type` in a folder's `config.json`, if it has one.
pub(crate) fn model_type(folder: &Path) -> Option<String> {
    let config = std::fs::read_to_string(folder.join("config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&config).ok()?;
    config.get("model_type")?.as_str().map(str::to_string)
}

/// The settings stored as JSON, with defaults for what is missing or malformed.
pub(crate) fn settings_of(value: &serde_json::Value) -> Settings {
    serde_json::from_value(value.clone()).unwrap_or_default()
}

/// A conversation title from its first message: the first line, cut to a few words.
pub(crate) fn title_from(text: &str) -> String {
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
