-- KV checkpoints: cache-state files on disk, one per message-tree node, indexed here. A row is
-- inserted only after its file is complete and renamed into place.

CREATE TABLE kv_checkpoints (
    id              INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    -- The node the cache state ends at (the reply it was written after).
    message_id      INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    model_id        TEXT    NOT NULL,
    config_hash     TEXT    NOT NULL,
    -- The cache stack's geometry (each layer's storage signature, joined with ';').
    cache_signature TEXT    NOT NULL,
    token_count     INTEGER NOT NULL,
    -- SHA-256 of the token ids, and the ids themselves (little-endian u32) for prefix matching.
    prefix_hash     TEXT    NOT NULL,
    tokens          BLOB    NOT NULL,
    -- Relative to the app's checkpoint folder.
    path            TEXT    NOT NULL,
    bytes           INTEGER NOT NULL,
    sha256          TEXT    NOT NULL,
    created_at      INTEGER NOT NULL,
    last_used_at    INTEGER NOT NULL
);
CREATE INDEX kv_checkpoints_by_conversation ON kv_checkpoints(conversation_id);
CREATE INDEX kv_checkpoints_by_use ON kv_checkpoints(last_used_at);

-- Generation-method state attached to a checkpoint (shaped like the seed's
-- CheckpointAttachment: a schema string, metadata, and the names of its tensors in the file).
CREATE TABLE checkpoint_attachments (
    id            INTEGER PRIMARY KEY,
    checkpoint_id INTEGER NOT NULL REFERENCES kv_checkpoints(id) ON DELETE CASCADE,
    schema        TEXT    NOT NULL,
    metadata      TEXT    NOT NULL DEFAULT '{}',
    tensors       TEXT    NOT NULL DEFAULT '[]'
);
CREATE INDEX checkpoint_attachments_by_checkpoint ON checkpoint_attachments(checkpoint_id);
