//! What front ends see: plain serializable values, with TypeScript declarations generated from
//! them ([`typescript_bindings`]) so the web UI and Rust cannot drift apart. A reply's
//! statistics, stop reason and speculation settings are the engine's own types.

use serde::{Deserialize, Serialize};
use store::{MessageState, Role};
use ts_rs::TS;

/// How a conversation's replies are decoded.
pub use engine::cache::{KvFormat, KvLayers, KvOptions};
/// Why a reply ended.
pub use engine::generate::StopReason;
/// Speculative decoding's counts for one reply.
pub use engine::speculative::SpecStats;
pub use engine::speculative::Speculation;
/// Statistics of a finished reply: the engine's, stored and shown as they are.
pub use engine::turn::TurnStats;

/// An image attached to a sent message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct AttachmentView {
    /// File name inside the app's attachment folder (served as `quince-attachment://`).
    pub file: String,
    /// MIME type.
    pub mime: String,
    /// Size in bytes.
    #[ts(type = "number")]
    pub bytes: u64,
}

/// An image imported into the attachment folder, not sent yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct PendingAttachment {
    /// File name inside the attachment folder (content-addressed: `<sha256>.<ext>`).
    pub file: String,
    /// MIME type.
    pub mime: String,
    /// Size in bytes.
    #[ts(type = "number")]
    pub bytes: u64,
    /// Pixel width.
    pub width: u32,
    /// Pixel height.
    pub height: u32,
    /// The name the user's file had.
    pub name: String,
}

/// Where a message sits among its siblings (the `‹ 2/3 ›` of the UI).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct BranchInfo {
    /// Its index among the siblings, from 0.
    pub index: u32,
    /// How many siblings there are (itself included).
    pub count: u32,
    /// The siblings' ids in creation order.
    #[ts(type = "Array<number>")]
    pub siblings: Vec<i64>,
}

/// A message of the branch on screen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
pub struct ThreadMessage {
    /// Row id.
    #[ts(type = "number")]
    pub id: i64,
    /// The message it follows.
    #[ts(type = "number | null")]
    pub parent_id: Option<i64>,
    /// Who wrote it.
    pub role: Role,
    /// Its text.
    pub content: String,
    /// Complete, streaming, stopped or error.
    pub state: MessageState,
    /// Statistics of a finished reply.
    pub stats: Option<TurnStats>,
    /// Why a reply failed.
    pub error: Option<String>,
    /// Its images.
    pub attachments: Vec<AttachmentView>,
    /// Its siblings.
    pub branch: BranchInfo,
    /// Unix ms.
    #[ts(type = "number")]
    pub created_at: i64,
}

/// Sampling settings of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
#[serde(default)]
pub struct Settings {
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1 disables it).
    pub top_p: f32,
    /// Keep the k most likely tokens (0 disables it).
    pub top_k: u32,
    /// Most tokens per reply.
    pub max_tokens: u32,
    /// Seed of the sampler.
    #[ts(type = "number")]
    pub seed: u64,
    /// Soft tokens per image (Gemma 4: 70, 140, 280, 560 or 1120).
    pub max_soft_tokens: u32,
    /// Speculative decoding.
    pub speculation: Speculation,
    /// How the KV cache is stored (and from which token it is quantized).
    pub kv: KvOptions,
    /// Let a model that can think first do so (its template's `enable_thinking`).
    pub thinking: bool,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            temperature: 0.7,
            top_p: 0.95,
            top_k: 64,
            max_tokens: 1024,
            seed: 0,
            max_soft_tokens: 280,
            speculation: Speculation::Off,
            kv: KvOptions::full(),
            thinking: true,
        }
    }
}

/// A conversation in the list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct ConversationSummary {
    /// Row id.
    #[ts(type = "number")]
    pub id: i64,
    /// Its title.
    pub title: String,
    /// The model it last talked to.
    pub model_id: Option<String>,
    /// Unix ms of the last change.
    #[ts(type = "number")]
    pub updated_at: i64,
}

/// A conversation with the branch on screen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
pub struct ConversationDetail {
    /// Row id.
    #[ts(type = "number")]
    pub id: i64,
    /// Its title.
    pub title: String,
    /// The model it last talked to.
    pub model_id: Option<String>,
    /// Its system prompt ("" for none).
    pub system_prompt: String,
    /// Its sampling settings.
    pub settings: Settings,
    /// The current branch, first message first.
    pub messages: Vec<ThreadMessage>,
}

/// What a reply command streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)] // a few hundred bytes per event, serialized at once
pub enum StreamEvent {
    /// The model is still loading: the reply starts when it is ready. Sent when the wait
    /// begins and at each load stage.
    Waiting {
        /// The user message just stored (absent when regenerating or answering).
        user: Option<ThreadMessage>,
        /// The model being loaded.
        model: String,
        /// The load's current stage, in words.
        stage: String,
        /// Stages done.
        done: u32,
        /// Stages in all.
        total: u32,
    },
    /// The messages are stored: the user's (absent when regenerating) and the empty reply.
    Started {
        /// The user message just stored.
        user: Option<ThreadMessage>,
        /// The reply being written.
        reply: ThreadMessage,
    },
    /// The reply waits for replies running now (in other conversations) to finish before it
    /// starts; it is kept in line and starts on its own. Sent before any text.
    Queued {
        /// Why it waits, in words.
        reason: String,
    },
    /// More reply text.
    Text {
        /// The piece to append.
        text: String,
    },
    /// The reply ended (complete, length or stopped) and is stored.
    Done {
        /// The stored reply.
        reply: ThreadMessage,
    },
    /// The reply failed; the partial text is stored with the error.
    Failed {
        /// Readable message.
        message: String,
        /// The stored reply, when it got that far.
        reply: Option<ThreadMessage>,
    },
}

/// Where a library model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// The small model shipped with the app.
    Demo,
    /// A folder the user added.
    Folder,
    /// Found in the Hugging Face cache.
    HfCache,
}

/// A model in the library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct ModelEntry {
    /// The model folder (its id).
    pub path: String,
    /// Display name.
    pub name: String,
    /// Where it comes from.
    pub source: ModelSource,
    /// Whether it takes images.
    pub vision: bool,
    /// Size of its weights.
    #[ts(type = "number")]
    pub bytes: u64,
    /// Why it cannot be loaded, if it cannot.
    pub problem: Option<String>,
    /// A drafter made for one model (a Gemma 4 assistant, a Qwen3.5 MTP head): chosen for
    /// speculative decoding in a chat's settings, never loaded to chat with.
    #[serde(default)]
    pub drafter: bool,
}

/// The loaded model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct LoadedModel {
    /// Its folder.
    pub path: String,
    /// Display name.
    pub name: String,
    /// Whether it takes images.
    pub vision: bool,
    /// Its context length in tokens.
    pub max_context: u32,
    /// What its KV cache takes per token under each choice the settings offer.
    pub kv_costs: KvCosts,
    /// Whether its chat template turns thinking on and off (the settings offer the switch).
    pub thinking: bool,
}

/// Bytes the whole KV cache of a model takes per token, under each choice the settings
/// offer (4-bit and 8-bit in groups of 64, or the head width where narrower).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, TS)]
pub struct KvCosts {
    /// Full precision.
    #[ts(type = "number")]
    pub full: u64,
    /// Affine 8-bit.
    #[ts(type = "number")]
    pub affine8: u64,
    /// Affine 4-bit.
    #[ts(type = "number")]
    pub affine4: u64,
    /// TurboQuant 3-bit.
    #[ts(type = "number")]
    pub turbo3: u64,
}

/// Settings of the whole app: what new chats start with, and the memory guard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
#[serde(default)]
pub struct AppSettings {
    /// The KV cache new chats start with.
    pub default_kv: KvOptions,
    /// The share of the memory MLX recommends for this device that the model and a reply's
    /// KV cache may fill; a reply that would need more is refused before it starts.
    pub memory_share: f64,
    /// That memory, in bytes (0 where MLX reports none).
    #[ts(type = "number")]
    pub recommended_memory: u64,
}

impl Default for AppSettings {
    fn default() -> AppSettings {
        AppSettings {
            default_kv: KvOptions::full(),
            memory_share: engine::memory::DEFAULT_SHARE,
            recommended_memory: 0,
        }
    }
}

/// The library and what is loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct ModelsState {
    /// Every model found.
    pub models: Vec<ModelEntry>,
    /// The model in the engine.
    pub loaded: Option<LoadedModel>,
    /// What to load when nothing is: the last model used, else the demo model.
    pub default_model: Option<String>,
}

/// Progress of a model load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LoadEvent {
    /// A stage began.
    Progress {
        /// What is happening, in words.
        stage: String,
        /// Stages done.
        done: u32,
        /// Stages in all.
        total: u32,
    },
    /// The model is ready.
    Done {
        /// The loaded model.
        model: LoadedModel,
    },
}

/// What kind of failure a command met, so the UI can offer the right way out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// No model is loaded, or its folder is gone.
    ModelMissing,
    /// The checkpoint could not be loaded.
    ModelLoad,
    /// The conversation does not fit the model's context.
    PromptTooLong,
    /// The reply's KV cache would not fit the memory limit.
    OutOfMemory,
    /// An image cannot be read.
    BadImage,
    /// Something is already running (a reply in this conversation, a model load).
    Busy,
    /// No such conversation or message.
    NotFound,
    /// The request does not make sense.
    Invalid,
    /// The user cancelled it.
    Cancelled,
    /// Networking is turned off in Settings.
    Offline,
    /// The network or the hub failed (a download resumes where it stopped).
    Network,
    /// The hub wants a token with access (a gated or private model).
    Unauthorized,
    /// Not enough disk space.
    DiskFull,
    /// Anything else (a bug, a disk error).
    Internal,
}

/// Whether a model fits this machine's memory: its weights plus the KV cache of a full
/// default context, against the memory the accelerator can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum FitVerdict {
    /// Under 70 % of memory.
    Fits,
    /// 70–90 %: it runs, with little room for anything else.
    Tight,
    /// Over 90 %.
    TooBig,
    /// Its size is not known yet.
    Unknown,
}

/// A memory-fit estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct Fit {
    /// The verdict.
    pub verdict: FitVerdict,
    /// Weights plus KV cache at `context_tokens`.
    #[ts(type = "number")]
    pub needed_bytes: u64,
    /// This machine's memory.
    #[ts(type = "number")]
    pub memory_bytes: u64,
    /// The context the KV estimate is for.
    pub context_tokens: u32,
}

/// Where a download stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, TS)]
#[serde(rename_all = "snake_case")]
pub enum DownloadState {
    /// Waiting for the one before it.
    Queued,
    /// Transferring.
    Downloading,
    /// Stopped by the user, a quit or a crash; resumes from the bytes on disk.
    Paused,
    /// Stopped by an error (see its message); resumes when started again.
    Failed,
    /// Complete and verified.
    Done,
}

/// A model download.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
pub struct DownloadView {
    /// `org/name`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    /// Its state.
    pub state: DownloadState,
    /// Bytes on disk.
    #[ts(type = "number")]
    pub done_bytes: u64,
    /// Bytes of all files (0 until known).
    #[ts(type = "number")]
    pub total_bytes: u64,
    /// The file being transferred.
    pub file: String,
    /// Its bytes on disk.
    #[ts(type = "number")]
    pub file_done: u64,
    /// Its size.
    #[ts(type = "number")]
    pub file_size: u64,
    /// Files complete.
    pub files_done: u32,
    /// Files in all.
    pub files: u32,
    /// Bytes per second.
    pub rate: f64,
    /// Seconds left.
    pub eta_s: Option<f64>,
    /// Why it failed.
    pub error: Option<String>,
    /// The kind of that failure (`unauthorized`: ask for a token).
    pub error_kind: Option<ErrorKind>,
    /// The snapshot folder once done.
    pub path: Option<String>,
}

/// A model to download: recommended, or found by search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, TS)]
pub struct CatalogEntry {
    /// `org/name`.
    pub repo: String,
    /// Display name.
    pub name: String,
    /// One line about it.
    pub description: String,
    /// In the recommended list.
    pub recommended: bool,
    /// A drafter made for one model (for speculative decoding).
    pub drafter: bool,
    /// Takes images.
    pub vision: bool,
    /// Bytes of its weights: exact once its files were listed, else the catalog's estimate.
    #[ts(type = "number | null")]
    pub weight_bytes: Option<u64>,
    /// Whether it fits this machine.
    pub fit: Fit,
    /// Its snapshot folder when it is in the Hugging Face cache already.
    pub local_path: Option<String>,
    /// Its download, when one was started.
    pub download: Option<DownloadView>,
}

/// Network settings: off means no connection at all, ever.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct NetworkSettings {
    /// Search and downloads may use the network (only when the user starts one).
    pub enabled: bool,
    /// The hub (`HF_ENDPOINT` convention; default `https://huggingface.co`).
    pub endpoint: String,
    /// A Hugging Face token is stored.
    pub has_token: bool,
    /// Where tokens are kept: `keychain` or `file` (0600, in the app's data folder).
    pub token_store: String,
    /// The Hugging Face cache downloads go to.
    pub cache_dir: Option<String>,
}

/// What every command rejects with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct CommandError {
    /// The kind of failure.
    pub kind: ErrorKind,
    /// A readable message.
    pub message: String,
}

/// The local server (OpenAI- and Anthropic-compatible), for the settings screen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct LocalServer {
    /// Whether it is serving.
    pub running: bool,
    /// Its base URL while it runs (`http://127.0.0.1:8741/v1`).
    pub url: Option<String>,
    /// The key clients send (`Authorization: Bearer KEY`), kept across launches.
    pub api_key: String,
    /// The port it listens on, or would.
    pub port: u16,
}

/// About the app, for the settings screen and bug reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, TS)]
pub struct AppInfo {
    /// App version.
    pub version: String,
    /// Where conversations and attachments live.
    pub data_dir: String,
    /// Where the logs are.
    pub log_dir: String,
    /// The MLX device.
    pub device: String,
}

/// The TypeScript declarations of every type above, as one file (`ui/src/ipc/bindings.ts`).
pub fn typescript_bindings() -> String {
    let config = ts_rs::Config::default();
    let decls = [
        Role::decl(&config),
        MessageState::decl(&config),
        StopReason::decl(&config),
        TurnStats::decl(&config),
        SpecStats::decl(&config),
        Speculation::decl(&config),
        KvFormat::decl(&config),
        KvLayers::decl(&config),
        KvOptions::decl(&config),
        KvCosts::decl(&config),
        AppSettings::decl(&config),
        AttachmentView::decl(&config),
        PendingAttachment::decl(&config),
        BranchInfo::decl(&config),
        ThreadMessage::decl(&config),
        Settings::decl(&config),
        ConversationSummary::decl(&config),
        ConversationDetail::decl(&config),
        StreamEvent::decl(&config),
        ModelSource::decl(&config),
        ModelEntry::decl(&config),
        LoadedModel::decl(&config),
        ModelsState::decl(&config),
        LoadEvent::decl(&config),
        ErrorKind::decl(&config),
        FitVerdict::decl(&config),
        Fit::decl(&config),
        DownloadState::decl(&config),
        DownloadView::decl(&config),
        CatalogEntry::decl(&config),
        NetworkSettings::decl(&config),
        CommandError::decl(&config),
        AppInfo::decl(&config),
        LocalServer::decl(&config),
    ];
    let mut out = String::from(
        "// Generated from the Rust types in crates/chat/src/view.rs by\n\
         // `cargo test -p chat --test bindings` with UPDATE_BINDINGS=1. Do not edit.\n",
    );
    for decl in decls {
        out.push_str("\nexport ");
        out.push_str(&decl);
        out.push('\n');
    }
    out
}
