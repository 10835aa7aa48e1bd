-- The model library's folders and small app-wide settings (the last model loaded, ...).

CREATE TABLE model_folders (
    path     TEXT    PRIMARY KEY,
    added_at INTEGER NOT NULL
);

CREATE TABLE app_settings (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
