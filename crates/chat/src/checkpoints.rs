//! KV checkpoints in the store: indexing what a reply wrote, dropping damaged ones, and keeping
//! the files within the disk budget (least recently used first).

use std::path::{Path, PathBuf};

use engine::turn::WrittenCheckpoint;

use crate::{Chat, Result};

impl Chat {
    /// the ones found damaged, and keeps the files within the disk budget.
    pub(crate) async fn after_reply(
        &self,
        conversation: i64,
        reply: i64,
        file: &str,
        written: Option<WrittenCheckpoint>,
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
        let identity = self.identity();
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

    /// The file of the checkpoint written at the end of `reply`, when one was kept.
    pub async fn checkpoint_file(&self, reply: i64) -> Result<Option<PathBuf>> {
        let all = self.store.checkpoints_by_use().await?;
        let found = all.into_iter().find(|c| c.message_id == reply);
        Ok(found.map(|c| self.checkpoints_dir().join(c.path)))
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
}

/// Deletes checkpoint files a killed process left half-written (they never got an index row).
pub(crate) fn remove_partial_files(dir: &Path) {
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
