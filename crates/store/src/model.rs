//! Rows as Rust values.

use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::error::{Error, Result};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A system prompt.
    System,
    /// The person.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    fn parse(text: &str) -> Result<Role> {
        match text {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            other => Err(Error::Unexpected(format!("role {other:?}"))),
        }
    }
}

/// Where a message stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "lowercase")]
pub enum MessageState {
    /// Written in full.
    Complete,
    /// A reply being generated.
    Streaming,
    /// A reply stopped early (by the user, or by a process that died while writing it).
    Stopped,
    /// A reply that failed.
    Error,
}

impl MessageState {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Complete => "complete",
            MessageState::Streaming => "streaming",
            MessageState::Stopped => "stopped",
            MessageState::Error => "error",
        }
    }

    fn parse(text: &str) -> Result<MessageState> {
        match text {
            "complete" => Ok(MessageState::Complete),
            "streaming" => Ok(MessageState::Streaming),
            "stopped" => Ok(MessageState::Stopped),
            "error" => Ok(MessageState::Error),
            other => Err(Error::Unexpected(format!("state {other:?}"))),
        }
    }
}

/// A conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    /// Row id.
    pub id: i64,
    /// Title shown in the list.
    pub title: String,
    /// The model it talks to.
    pub model_id: Option<String>,
    /// Its system prompt.
    pub system_prompt: Option<String>,
    /// Sampling settings.
    pub settings: serde_json::Value,
    /// The branch tip on screen.
    pub current_leaf_id: Option<i64>,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms of the last change.
    pub updated_at: i64,
}

impl Conversation {
    pub(crate) fn from_row(row: &SqliteRow) -> Result<Conversation> {
        let settings: String = row.try_get("settings")?;
        Ok(Conversation {
            id: row.try_get("id")?,
            title: row.try_get("title")?,
            model_id: row.try_get("model_id")?,
            system_prompt: row.try_get("system_prompt")?,
            settings: serde_json::from_str(&settings)
                .map_err(|e| Error::Unexpected(format!("settings: {e}")))?,
            current_leaf_id: row.try_get("current_leaf_id")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
        })
    }
}

/// A message of the tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Row id.
    pub id: i64,
    /// Its conversation.
    pub conversation_id: i64,
    /// The message it answers or follows (`None` for the first).
    pub parent_id: Option<i64>,
    /// Who wrote it.
    pub role: Role,
    /// Its text.
    pub content: String,
    /// Complete, streaming, stopped or error.
    pub state: MessageState,
    /// Reply statistics.
    pub stats: Option<serde_json::Value>,
    /// Unix ms.
    pub created_at: i64,
}

impl Message {
    pub(crate) fn from_row(row: &SqliteRow) -> Result<Message> {
        let role: String = row.try_get("role")?;
        let state: String = row.try_get("state")?;
        let stats: Option<String> = row.try_get("stats")?;
        Ok(Message {
            id: row.try_get("id")?,
            conversation_id: row.try_get("conversation_id")?,
            parent_id: row.try_get("parent_id")?,
            role: Role::parse(&role)?,
            content: row.try_get("content")?,
            state: MessageState::parse(&state)?,
            stats: stats
                .map(|s| serde_json::from_str(&s))
                .transpose()
                .map_err(|e| Error::Unexpected(format!("stats: {e}")))?,
            created_at: row.try_get("created_at")?,
        })
    }
}

/// A file attached to a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// Row id.
    pub id: i64,
    /// Its message.
    pub message_id: i64,
    /// Path relative to the attachment folder.
    pub path: String,
    /// MIME type.
    pub mime: String,
    /// File size.
    pub bytes: i64,
    /// SHA-256 of the file, hex.
    pub sha256: String,
    /// Order among the message's attachments.
    pub position: i64,
}

/// A KV checkpoint's index row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Row id.
    pub id: i64,
    /// Its conversation.
    pub conversation_id: i64,
    /// The message-tree node its state ends at.
    pub message_id: i64,
    /// The model it was written by.
    pub model_id: String,
    /// SHA-256 of that model's config.
    pub config_hash: String,
    /// The cache stack's geometry.
    pub cache_signature: String,
    /// The token ids its caches hold.
    pub tokens: Vec<u32>,
    /// SHA-256 of those ids.
    pub prefix_hash: String,
    /// File path, relative to the checkpoint folder.
    pub path: String,
    /// File size.
    pub bytes: i64,
    /// SHA-256 of the file.
    pub sha256: String,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms of the last restore (or the write).
    pub last_used_at: i64,
}

impl Checkpoint {
    pub(crate) fn from_row(row: &SqliteRow) -> Result<Checkpoint> {
        let blob: Vec<u8> = row.try_get("tokens")?;
        Ok(Checkpoint {
            id: row.try_get("id")?,
            conversation_id: row.try_get("conversation_id")?,
            message_id: row.try_get("message_id")?,
            model_id: row.try_get("model_id")?,
            config_hash: row.try_get("config_hash")?,
            cache_signature: row.try_get("cache_signature")?,
            tokens: blob
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            prefix_hash: row.try_get("prefix_hash")?,
            path: row.try_get("path")?,
            bytes: row.try_get("bytes")?,
            sha256: row.try_get("sha256")?,
            created_at: row.try_get("created_at")?,
            last_used_at: row.try_get("last_used_at")?,
        })
    }
}

/// A generation method's state attached to a checkpoint: its index row (the tensors live in
/// the checkpoint's file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointAttachment {
    /// Row id.
    pub id: i64,
    /// Its checkpoint.
    pub checkpoint_id: i64,
    /// Its layout, e.g. `quince-draft-kv/1`.
    pub schema: String,
    /// Its string entries.
    pub metadata: std::collections::BTreeMap<String, String>,
    /// The names of its tensors in the file.
    pub tensors: Vec<String>,
}

impl CheckpointAttachment {
    pub(crate) fn from_row(row: &SqliteRow) -> Result<CheckpointAttachment> {
        let json = |column: &str| -> Result<String> { Ok(row.try_get(column)?) };
        let bad = |e: serde_json::Error| Error::Unexpected(format!("checkpoint attachment: {e}"));
        Ok(CheckpointAttachment {
            id: row.try_get("id")?,
            checkpoint_id: row.try_get("checkpoint_id")?,
            schema: row.try_get("schema")?,
            metadata: serde_json::from_str(&json("metadata")?).map_err(bad)?,
            tensors: serde_json::from_str(&json("tensors")?).map_err(bad)?,
        })
    }
}

/// A model download's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Download {
    /// `org/name`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    /// `queued`, `downloading`, `paused`, `failed` or `done`.
    pub state: String,
    /// Bytes of all its files (0 until known).
    pub total_bytes: i64,
    /// Bytes on disk when last recorded.
    pub done_bytes: i64,
    /// Why it failed.
    pub error: Option<String>,
    /// The snapshot folder once done.
    pub path: Option<String>,
    /// Unix ms of the last change.
    pub updated_at: i64,
}

impl Download {
    pub(crate) fn from_row(row: &SqliteRow) -> Result<Download> {
        Ok(Download {
            repo: row.try_get("repo")?,
            revision: row.try_get("revision")?,
            state: row.try_get("state")?,
            total_bytes: row.try_get("total_bytes")?,
            done_bytes: row.try_get("done_bytes")?,
            error: row.try_get("error")?,
            path: row.try_get("path")?,
            updated_at: row.try_get("updated_at")?,
        })
    }
}
