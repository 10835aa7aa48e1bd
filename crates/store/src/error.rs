//! The store's error type.

/// What can go wrong with the database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// SQLite or the connection failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed to apply.
    #[error("database migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// The row asked for does not exist.
    #[error("{what} {id} not found")]
    NotFound {
        /// `conversation`, `message`, …
        what: &'static str,
        /// Its id.
        id: i64,
    },
    /// A request breaks the store's rules (a parent in another conversation, …).
    #[error("{0}")]
    Invalid(String),
    /// A stored value is not what the schema allows (an unknown role or state).
    #[error("unexpected stored value: {0}")]
    Unexpected(String),
    /// The integrity check failed.
    #[error("the database is damaged: {0}")]
    Corrupt(String),
}

/// `Result` with the store's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
