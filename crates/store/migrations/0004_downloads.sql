-- Model downloads: one row per repo, so a download interrupted by a quit or a crash is listed
-- as paused at the next start and resumes from the bytes in the Hugging Face cache.

CREATE TABLE downloads (
    repo        TEXT    PRIMARY KEY,
    revision    TEXT    NOT NULL,
    -- queued | downloading | paused | failed | done
    state       TEXT    NOT NULL,
    total_bytes INTEGER NOT NULL DEFAULT 0,
    done_bytes  INTEGER NOT NULL DEFAULT 0,
    error       TEXT,
    -- The snapshot folder once done.
    path        TEXT,
    updated_at  INTEGER NOT NULL
);
