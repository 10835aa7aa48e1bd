//! Quince's store: conversations, their message tree, and attachments, in one SQLite file
//! (WAL, foreign keys on) through sqlx, with migrations embedded in the binary.
//!
//! - A conversation holds messages in a **tree**: every message but the first has a real
//!   `parent_id` foreign key; siblings are branches (an edited user message, a regenerated
//!   reply). [`Store::path_to`] reads one branch root to tip; the conversation remembers the tip
//!   the user looks at ([`Store::set_current_leaf`]).
//! - Deleting a conversation deletes its messages and their attachments (cascades); deleting a
//!   message deletes its subtree.
//! - A reply is written while it streams ([`Store::update_reply`] commits each piece). A process
//!   killed mid-reply leaves the last committed text; [`Store::open`] marks such replies
//!   `stopped`, so nothing is lost and nothing pretends to be complete.
//!
//! ```no_run
//! # async fn demo() -> store::Result<()> {
//! let store = store::Store::open("quince.db").await?;
//! let chat = store.create_conversation("New chat", Some("gemma-4-e2b")).await?;
//! let question = store.append_message(chat.id, None, store::Role::User, "Hi!", store::MessageState::Complete).await?;
//! let reply = store.append_message(chat.id, Some(question.id), store::Role::Assistant, "", store::MessageState::Streaming).await?;
//! store.update_reply(reply.id, "Hello").await?;
//! store.finish_reply(reply.id, "Hello there.", store::MessageState::Complete, None).await?;
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

mod error;
mod model;

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

pub use error::{Error, Result};
pub use model::{
    Attachment, Checkpoint, CheckpointAttachment, Conversation, Download, Message, MessageState,
    Role,
};

/// Milliseconds since the Unix epoch; injectable so tests control time.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

fn system_clock() -> Clock {
    Arc::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default()
    })
}

/// A handle to the database. Cheap to clone (a connection pool).
#[derive(Clone)]
pub struct Store {
    pool: SqlitePool,
    clock: Clock,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

// Column lists as macros, so every query stays a literal (sqlx audits dynamic SQL).
macro_rules! conversation_columns {
    () => {
        "id, title, model_id, system_prompt, settings, current_leaf_id, created_at, updated_at"
    };
}
macro_rules! message_columns {
    () => {
        "id, conversation_id, parent_id, role, content, state, stats, created_at"
    };
}

impl Store {
    /// Opens (creating when missing) the database at `path`, applies pending migrations, and
    /// marks replies left `streaming` by a process that died as `stopped`.
    pub async fn open(path: impl AsRef<Path>) -> Result<Store> {
        Store::open_with_clock(path, system_clock()).await
    }

    /// [`Store::open`] with a given clock.
    pub async fn open_with_clock(path: impl AsRef<Path>, clock: Clock) -> Result<Store> {
        let options = SqliteConnectOptions::new()
            .filename(path.as_ref())
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL + NORMAL: a committed transaction survives a process crash; only an OS
            // crash can lose the last ones.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(options).await?;
        Store::from_pool(pool, clock).await
    }

    /// A private in-memory database (tests, previews).
    pub async fn open_in_memory() -> Result<Store> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")?.foreign_keys(true);
        // One connection: every connection to `:memory:` is its own database.
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        Store::from_pool(pool, system_clock()).await
    }

    async fn from_pool(pool: SqlitePool, clock: Clock) -> Result<Store> {
        sqlx::migrate!("./migrations").run(&pool).await?;
        sqlx::query("UPDATE messages SET state = 'stopped' WHERE state = 'streaming'")
            .execute(&pool)
            .await?;
        Ok(Store { pool, clock })
    }

    /// A transaction that takes the write lock up front (`BEGIN IMMEDIATE`): a deferred one that
    /// reads first cannot upgrade once another writer has committed, and fails with "database is
    /// locked" instead of waiting.
    async fn write_transaction(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    fn now(&self) -> i64 {
        (self.clock)()
    }

    /// `PRAGMA integrity_check` and `foreign_key_check`: `Ok` when both find nothing.
    pub async fn check_integrity(&self) -> Result<()> {
        let verdict: String =
            sqlx::query_scalar("PRAGMA integrity_check").fetch_one(&self.pool).await?;
        if verdict != "ok" {
            return Err(Error::Corrupt(verdict));
        }
        let broken = sqlx::query("PRAGMA foreign_key_check").fetch_all(&self.pool).await?;
        if !broken.is_empty() {
            return Err(Error::Corrupt(format!("{} rows break foreign keys", broken.len())));
        }
        Ok(())
    }

    // ---- conversations ----

    /// A new, empty conversation.
    pub async fn create_conversation(
        &self,
        title: &str,
        model_id: Option<&str>,
    ) -> Result<Conversation> {
        let now = self.now();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO conversations (title, model_id, created_at, updated_at) VALUES (?, ?, ?, ?) RETURNING id",
        )
        .bind(title)
        .bind(model_id)
        .bind(now)
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        self.conversation(id).await
    }

    /// One conversation.
    pub async fn conversation(&self, id: i64) -> Result<Conversation> {
        let row = sqlx::query(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations WHERE id = ?"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(Error::NotFound { what: "conversation", id })?;
        Conversation::from_row(&row)
    }

    /// Every conversation, most recently updated first.
    pub async fn conversations(&self) -> Result<Vec<Conversation>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations ORDER BY updated_at DESC, id DESC"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Conversation::from_row).collect()
    }

    /// Conversations whose title or any message contains `query` (case-insensitive for ASCII),
    /// most recently updated first.
    pub async fn search(&self, query: &str) -> Result<Vec<Conversation>> {
        let pattern =
            format!("%{}%", query.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_"));
        let rows = sqlx::query(concat!(
            "SELECT ",
            conversation_columns!(),
            " FROM conversations c WHERE c.title LIKE ?1 ESCAPE '\\' ",
            "OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?1 ESCAPE '\\') ",
            "ORDER BY updated_at DESC, id DESC"
        ))
        .bind(pattern)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Conversation::from_row).collect()
    }

    /// Renames a conversation.
    pub async fn rename_conversation(&self, id: i64, title: &str) -> Result<()> {
        self.update_conversation(id, "title", Some(title)).await
    }

    /// Sets (or clears) the system prompt.
    pub async fn set_system_prompt(&self, id: i64, prompt: Option<&str>) -> Result<()> {
        self.update_conversation(id, "system_prompt", prompt).await
    }

    /// Replaces the settings JSON.
    pub async fn set_settings(&self, id: i64, settings: &serde_json::Value) -> Result<()> {
        self.update_conversation(id, "settings", Some(&settings.to_string())).await
    }

    /// Sets the model the conversation uses.
    pub async fn set_model(&self, id: i64, model_id: &str) -> Result<()> {
        self.update_conversation(id, "model_id", Some(model_id)).await
    }

    async fn update_conversation(
        &self,
        id: i64,
        column: &'static str,
        value: Option<&str>,
    ) -> Result<()> {
        let sql = match column {
            "system_prompt" => {
                "UPDATE conversations SET system_prompt = ?, updated_at = ? WHERE id = ?"
            }
            "title" => "UPDATE conversations SET title = ?, updated_at = ? WHERE id = ?",
            "settings" => "UPDATE conversations SET settings = ?, updated_at = ? WHERE id = ?",
            "model_id" => "UPDATE conversations SET model_id = ?, updated_at = ? WHERE id = ?",
            other => return Err(Error::Invalid(format!("no updatable column {other}"))),
        };
        let done =
            sqlx::query(sql).bind(value).bind(self.now()).bind(id).execute(&self.pool).await?;
        if done.rows_affected() == 0 {
            return Err(Error::NotFound { what: "conversation", id });
        }
        Ok(())
    }

    /// Deletes a conversation with its messages and attachments.
    pub async fn delete_conversation(&self, id: i64) -> Result<()> {
        let done = sqlx::query("DELETE FROM conversations WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 0 {
            return Err(Error::NotFound { what: "conversation", id });
        }
        Ok(())
    }

    /// Makes `leaf` the tip of the branch the conversation shows.
    pub async fn set_current_leaf(&self, conversation: i64, leaf: i64) -> Result<()> {
        let owner = self.message(leaf).await?.conversation_id;
        if owner != conversation {
            return Err(Error::Invalid(format!(
                "message {leaf} belongs to conversation {owner}, not {conversation}"
            )));
        }
        sqlx::query("UPDATE conversations SET current_leaf_id = ?, updated_at = ? WHERE id = ?")
            .bind(leaf)
            .bind(self.now())
            .bind(conversation)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    // ---- messages ----

    /// Adds a message under `parent` (a new branch when the parent already has children) and
    /// makes it the conversation's current tip. The parent must be in the same conversation.
    pub async fn append_message(
        &self,
        conversation: i64,
        parent: Option<i64>,
        role: Role,
        content: &str,
        state: MessageState,
    ) -> Result<Message> {
        let mut tx = self.write_transaction().await?;
        if let Some(parent) = parent {
            let owner: Option<i64> =
                sqlx::query_scalar("SELECT conversation_id FROM messages WHERE id = ?")
                    .bind(parent)
                    .fetch_optional(&mut *tx)
                    .await?;
            match owner {
                None => return Err(Error::NotFound { what: "message", id: parent }),
                Some(owner) if owner != conversation => {
                    return Err(Error::Invalid(format!(
                        "parent message {parent} belongs to conversation {owner}, not {conversation}"
                    )));
                }
                Some(_) => {}
            }
        }
        let now = self.now();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO messages (conversation_id, parent_id, role, content, state, created_at) \
             VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
        )
        .bind(conversation)
        .bind(parent)
        .bind(role.as_str())
        .bind(content)
        .bind(state.as_str())
        .bind(now)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
                Error::NotFound { what: "conversation", id: conversation }
            }
            _ => Error::from(e),
        })?;
        sqlx::query("UPDATE conversations SET current_leaf_id = ?, updated_at = ? WHERE id = ?")
            .bind(id)
            .bind(now)
            .bind(conversation)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.message(id).await
    }

    /// One message.
    pub async fn message(&self, id: i64) -> Result<Message> {
        let row =
            sqlx::query(concat!("SELECT ", message_columns!(), " FROM messages WHERE id = ?"))
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or(Error::NotFound { what: "message", id })?;
        Message::from_row(&row)
    }

    /// Replaces a streaming reply's text (one committed write per call: a crash keeps the last).
    pub async fn update_reply(&self, id: i64, content: &str) -> Result<()> {
        let done =
            sqlx::query("UPDATE messages SET content = ? WHERE id = ? AND state = 'streaming'")
                .bind(content)
                .bind(id)
                .execute(&self.pool)
                .await?;
        if done.rows_affected() == 0 {
            return Err(Error::Invalid(format!("message {id} is not a streaming reply")));
        }
        Ok(())
    }

    /// Ends a reply with its final text, state (`complete`, `stopped` or `error`) and stats.
    pub async fn finish_reply(
        &self,
        id: i64,
        content: &str,
        state: MessageState,
        stats: Option<&serde_json::Value>,
    ) -> Result<()> {
        if state == MessageState::Streaming {
            return Err(Error::Invalid("a finished reply cannot be streaming".into()));
        }
        let done =
            sqlx::query("UPDATE messages SET content = ?, state = ?, stats = ? WHERE id = ?")
                .bind(content)
                .bind(state.as_str())
                .bind(stats.map(serde_json::Value::to_string))
                .bind(id)
                .execute(&self.pool)
                .await?;
        if done.rows_affected() == 0 {
            return Err(Error::NotFound { what: "message", id });
        }
        Ok(())
    }

    /// Messages under `parent` (the first messages when `None`) in creation order: the
    /// branches the UI pages through with `‹ 2/3 ›`.
    pub async fn children(&self, conversation: i64, parent: Option<i64>) -> Result<Vec<Message>> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            message_columns!(),
            " FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id"
        ))
        .bind(conversation)
        .bind(parent)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Message::from_row).collect()
    }

    /// The branch from the first message down to `leaf`, in order.
    pub async fn path_to(&self, leaf: i64) -> Result<Vec<Message>> {
        let rows = sqlx::query(
            "WITH RECURSIVE chain(id, depth) AS (SELECT ?, 0 UNION ALL \
             SELECT m.parent_id, c.depth + 1 FROM messages m JOIN chain c ON m.id = c.id \
             WHERE m.parent_id IS NOT NULL) \
             SELECT messages.id, messages.conversation_id, messages.parent_id, messages.role, \
             messages.content, messages.state, messages.stats, messages.created_at \
             FROM messages JOIN chain ON messages.id = chain.id ORDER BY chain.depth DESC",
        )
        .bind(leaf)
        .fetch_all(&self.pool)
        .await?;
        if rows.is_empty() {
            return Err(Error::NotFound { what: "message", id: leaf });
        }
        rows.iter().map(Message::from_row).collect()
    }

    /// The deepest message reached from `message` by always taking the newest child: where a
    /// branch switch lands.
    pub async fn latest_leaf(&self, message: i64) -> Result<i64> {
        let mut current = message;
        loop {
            let next: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM messages WHERE parent_id = ? ORDER BY id DESC LIMIT 1",
            )
            .bind(current)
            .fetch_optional(&self.pool)
            .await?;
            match next {
                Some(child) => current = child,
                None => return Ok(current),
            }
        }
    }

    /// Deletes a message and everything under it. The conversation's tip moves to the parent
    /// when it was inside the deleted subtree.
    pub async fn delete_message(&self, id: i64) -> Result<()> {
        let message = self.message(id).await?;
        let mut tx = self.write_transaction().await?;
        sqlx::query("DELETE FROM messages WHERE id = ?").bind(id).execute(&mut *tx).await?;
        sqlx::query(
            "UPDATE conversations SET current_leaf_id = COALESCE(current_leaf_id, ?) WHERE id = ?",
        )
        .bind(message.parent_id)
        .bind(message.conversation_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    // ---- attachments ----

    /// Records a file attached to a message (the file itself lives under the app's data folder).
    #[allow(clippy::too_many_arguments)]
    pub async fn add_attachment(
        &self,
        message: i64,
        path: &str,
        mime: &str,
        bytes: i64,
        sha256: &str,
        position: i64,
    ) -> Result<Attachment> {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO attachments (message_id, kind, path, mime, bytes, sha256, position) \
             VALUES (?, 'image', ?, ?, ?, ?, ?) RETURNING id",
        )
        .bind(message)
        .bind(path)
        .bind(mime)
        .bind(bytes)
        .bind(sha256)
        .bind(position)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
                Error::NotFound { what: "message", id: message }
            }
            _ => Error::from(e),
        })?;
        Ok(Attachment {
            id,
            message_id: message,
            path: path.into(),
            mime: mime.into(),
            bytes,
            sha256: sha256.into(),
            position,
        })
    }

    /// A message's attachments in order.
    pub async fn attachments(&self, message: i64) -> Result<Vec<Attachment>> {
        let rows = sqlx::query(
            "SELECT id, message_id, path, mime, bytes, sha256, position FROM attachments WHERE message_id = ? ORDER BY position",
        )
        .bind(message)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Attachment {
                    id: r.try_get("id")?,
                    message_id: r.try_get("message_id")?,
                    path: r.try_get("path")?,
                    mime: r.try_get("mime")?,
                    bytes: r.try_get("bytes")?,
                    sha256: r.try_get("sha256")?,
                    position: r.try_get("position")?,
                })
            })
            .collect()
    }

    /// The attachment paths of every message of a conversation.
    pub async fn conversation_attachment_paths(&self, conversation: i64) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar(
            "SELECT DISTINCT a.path FROM attachments a JOIN messages m ON m.id = a.message_id \
             WHERE m.conversation_id = ?",
        )
        .bind(conversation)
        .fetch_all(&self.pool)
        .await?)
    }

    /// How many attachments refer to `path` (files are shared by content).
    pub async fn attachment_references(&self, path: &str) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT COUNT(*) FROM attachments WHERE path = ?")
            .bind(path)
            .fetch_one(&self.pool)
            .await?)
    }

    // ---- KV checkpoints ----

    /// Indexes a checkpoint whose file is already complete (`id` and the times are ignored).
    pub async fn add_checkpoint(&self, c: &Checkpoint) -> Result<i64> {
        let tokens: Vec<u8> = c.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let now = self.now();
        let done = sqlx::query(
            "INSERT INTO kv_checkpoints (conversation_id, message_id, model_id, config_hash, \
             cache_signature, token_count, prefix_hash, tokens, path, bytes, sha256, created_at, \
             last_used_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(c.conversation_id)
        .bind(c.message_id)
        .bind(&c.model_id)
        .bind(&c.config_hash)
        .bind(&c.cache_signature)
        .bind(c.tokens.len() as i64)
        .bind(&c.prefix_hash)
        .bind(tokens)
        .bind(&c.path)
        .bind(c.bytes)
        .bind(&c.sha256)
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(done.last_insert_rowid())
    }

    /// A conversation's checkpoints written by `model_id` with `config_hash`, longest first.
    pub async fn checkpoints(
        &self,
        conversation: i64,
        model_id: &str,
        config_hash: &str,
    ) -> Result<Vec<Checkpoint>> {
        let rows = sqlx::query(
            "SELECT * FROM kv_checkpoints WHERE conversation_id = ? AND model_id = ? \
             AND config_hash = ? ORDER BY token_count DESC, id DESC",
        )
        .bind(conversation)
        .bind(model_id)
        .bind(config_hash)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Checkpoint::from_row).collect()
    }

    /// Every checkpoint, least recently used first (the eviction order).
    pub async fn checkpoints_by_use(&self) -> Result<Vec<Checkpoint>> {
        let rows = sqlx::query("SELECT * FROM kv_checkpoints ORDER BY last_used_at, id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(Checkpoint::from_row).collect()
    }

    /// The paths of a conversation's checkpoint files.
    pub async fn checkpoint_paths(&self, conversation: i64) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar("SELECT path FROM kv_checkpoints WHERE conversation_id = ?")
            .bind(conversation)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Marks a checkpoint as just used.
    pub async fn touch_checkpoint(&self, id: i64) -> Result<()> {
        sqlx::query("UPDATE kv_checkpoints SET last_used_at = ? WHERE id = ?")
            .bind(self.now())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Indexes a method's state written into a checkpoint's file (`id` is ignored).
    pub async fn add_checkpoint_attachment(&self, a: &CheckpointAttachment) -> Result<i64> {
        let json = |e: serde_json::Error| Error::Unexpected(format!("checkpoint attachment: {e}"));
        let done = sqlx::query(
            "INSERT INTO checkpoint_attachments (checkpoint_id, schema, metadata, tensors) \
             VALUES (?, ?, ?, ?)",
        )
        .bind(a.checkpoint_id)
        .bind(&a.schema)
        .bind(serde_json::to_string(&a.metadata).map_err(json)?)
        .bind(serde_json::to_string(&a.tensors).map_err(json)?)
        .execute(&self.pool)
        .await?;
        Ok(done.last_insert_rowid())
    }

    /// The attachments of a checkpoint, in the order they were added.
    pub async fn checkpoint_attachments(
        &self,
        checkpoint: i64,
    ) -> Result<Vec<CheckpointAttachment>> {
        let rows =
            sqlx::query("SELECT * FROM checkpoint_attachments WHERE checkpoint_id = ? ORDER BY id")
                .bind(checkpoint)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(CheckpointAttachment::from_row).collect()
    }

    /// Removes a checkpoint's row (the caller deletes its file).
    pub async fn delete_checkpoint(&self, id: i64) -> Result<()> {
        sqlx::query("DELETE FROM kv_checkpoints WHERE id = ?").bind(id).execute(&self.pool).await?;
        Ok(())
    }

    // ---- model downloads ----

    /// Records a download's state (`updated_at` is set here).
    pub async fn put_download(&self, d: &Download) -> Result<()> {
        sqlx::query(
            "INSERT INTO downloads (repo, revision, state, total_bytes, done_bytes, error, path, \
             updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(repo) DO UPDATE SET \
             revision = excluded.revision, state = excluded.state, \
             total_bytes = excluded.total_bytes, done_bytes = excluded.done_bytes, \
             error = excluded.error, path = excluded.path, updated_at = excluded.updated_at",
        )
        .bind(&d.repo)
        .bind(&d.revision)
        .bind(&d.state)
        .bind(d.total_bytes)
        .bind(d.done_bytes)
        .bind(&d.error)
        .bind(&d.path)
        .bind(self.now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Every download, most recent first.
    pub async fn downloads(&self) -> Result<Vec<Download>> {
        let rows = sqlx::query("SELECT * FROM downloads ORDER BY updated_at DESC, repo")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(Download::from_row).collect()
    }

    /// Forgets a download.
    pub async fn delete_download(&self, repo: &str) -> Result<()> {
        sqlx::query("DELETE FROM downloads WHERE repo = ?").bind(repo).execute(&self.pool).await?;
        Ok(())
    }

    /// At startup: downloads a quit or a crash interrupted (queued or running) become paused.
    pub async fn pause_interrupted_downloads(&self) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE downloads SET state = 'paused' WHERE state IN ('queued', 'downloading')",
        )
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    // ---- the model library and app settings ----

    /// Adds a model folder to the library (again is a no-op).
    pub async fn add_model_folder(&self, path: &str) -> Result<()> {
        sqlx::query("INSERT OR IGNORE INTO model_folders (path, added_at) VALUES (?, ?)")
            .bind(path)
            .bind(self.now())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Removes a model folder from the library (the folder itself is left alone).
    pub async fn remove_model_folder(&self, path: &str) -> Result<()> {
        sqlx::query("DELETE FROM model_folders WHERE path = ?")
            .bind(path)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The library's folders, in the order they were added.
    pub async fn model_folders(&self) -> Result<Vec<String>> {
        Ok(sqlx::query_scalar("SELECT path FROM model_folders ORDER BY added_at, path")
            .fetch_all(&self.pool)
            .await?)
    }

    /// An app-wide setting.
    pub async fn setting(&self, key: &str) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT value FROM app_settings WHERE key = ?")
            .bind(key)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Sets an app-wide setting.
    pub async fn set_setting(&self, key: &str, value: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO app_settings (key, value) VALUES (?, ?) \
             ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        )
        .bind(key)
        .bind(value)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Counts rows of a table (diagnostics and tests).
    pub async fn count(&self, table: Table) -> Result<i64> {
        let sql = match table {
            Table::Conversations => "SELECT COUNT(*) FROM conversations",
            Table::Messages => "SELECT COUNT(*) FROM messages",
            Table::Attachments => "SELECT COUNT(*) FROM attachments",
        };
        Ok(sqlx::query_scalar(sql).fetch_one(&self.pool).await?)
    }

    /// Closes the pool, waiting for connections to finish.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The store's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// `conversations`.
    Conversations,
    /// `messages`.
    Messages,
    /// `attachments`.
    Attachments,
}
