//! The chat layer's error type: what a front end shows, in words.

/// What can go wrong handling a chat command.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The engine refused (bad checkpoint, prompt too long, bad image, …).
    #[error(transparent)]
    Model(#[from] engine::Error),
    /// The database refused.
    #[error(transparent)]
    Store(#[from] store::Error),
    /// MLX failed.
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    /// The engine thread is gone or could not start.
    #[error("{0}")]
    Engine(String),
    /// The request does not make sense (no model loaded, a message of another conversation, …).
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// The error as a message-only copy (errors cross threads as text).
    pub(crate) fn clone_message(&self) -> Error {
        Error::Invalid(self.to_string())
    }
}

/// `Result` with the chat layer's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
