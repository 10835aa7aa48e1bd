-- Conversations, their message tree, and attachments. Forward-only: later changes add files.

CREATE TABLE conversations (
    id              INTEGER PRIMARY KEY,
    title           TEXT    NOT NULL DEFAULT '',
    model_id        TEXT,
    system_prompt   TEXT,
    -- Sampling settings as JSON (temperature, top_p, ...), owned by the chat layer.
    settings        TEXT    NOT NULL DEFAULT '{}',
    -- The tip of the branch the user is looking at.
    current_leaf_id INTEGER REFERENCES messages(id) ON DELETE SET NULL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);

CREATE TABLE messages (
    id              INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    -- NULL for the first message; siblings (same parent) are branches.
    parent_id       INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    role            TEXT    NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content         TEXT    NOT NULL,
    state           TEXT    NOT NULL CHECK (state IN ('complete', 'streaming', 'stopped', 'error')),
    -- Reply statistics as JSON (TTFT, tokens/s, token counts), NULL for user messages.
    stats           TEXT,
    created_at      INTEGER NOT NULL
);
CREATE INDEX messages_by_conversation ON messages(conversation_id);
CREATE INDEX messages_by_parent ON messages(parent_id);

CREATE TABLE attachments (
    id          INTEGER PRIMARY KEY,
    message_id  INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    kind        TEXT    NOT NULL CHECK (kind IN ('image')),
    -- Relative to the app's attachment folder.
    path        TEXT    NOT NULL,
    mime        TEXT    NOT NULL,
    bytes       INTEGER NOT NULL,
    sha256      TEXT    NOT NULL,
    position    INTEGER NOT NULL
);
CREATE INDEX attachments_by_message ON attachments(message_id);
