//! The chat layer's error type: what a front end shows, in words, with a kind
//! ([`ErrorKind`]) so the UI can offer the right way out.

use crate::view::{CommandError, ErrorKind};

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
    /// A download or search failed.
    #[error(transparent)]
    Hub(#[from] hub::Error),
    /// Networking is turned off.
    #[error(
        "Networking is off (Settings → Network): Quince makes no connection. Turn it on to \
         search or download models."
    )]
    Offline,
    /// The engine thread is gone or could not start.
    #[error("{0}")]
    Engine(String),
    /// The request does not make sense (a message of another conversation, …).
    #[error("{0}")]
    Invalid(String),
    /// No model is loaded, or the model folder is gone.
    #[error("{0}")]
    ModelMissing(String),
    /// An image cannot be used.
    #[error("{0}")]
    BadImage(String),
    /// Something is already running.
    #[error("{0}")]
    Busy(String),
    /// The user cancelled it.
    #[error("cancelled")]
    Cancelled,
    /// A failure that crossed a thread as text, with its kind.
    #[error("{message}")]
    Reported {
        /// Its kind.
        kind: ErrorKind,
        /// Its message.
        message: String,
    },
}

impl Error {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        use engine::Error as E;
        match self {
            Error::Model(E::KvMemory { .. }) => ErrorKind::OutOfMemory,
            Error::Model(E::ContextOverflow { .. } | E::PromptTooLong { .. }) => {
                ErrorKind::PromptTooLong
            }
            Error::Model(E::Cancelled) => ErrorKind::Cancelled,
            Error::Model(E::InvalidImage { .. }) => ErrorKind::BadImage,
            Error::Model(E::InvalidRequest(_)) => ErrorKind::Invalid,
            Error::Model(E::Mlx(_)) | Error::Mlx(_) | Error::Engine(_) => ErrorKind::Internal,
            Error::Model(_) => ErrorKind::ModelLoad,
            Error::Store(store::Error::NotFound { .. }) => ErrorKind::NotFound,
            Error::Store(_) => ErrorKind::Internal,
            Error::Invalid(_) => ErrorKind::Invalid,
            Error::ModelMissing(_) => ErrorKind::ModelMissing,
            Error::BadImage(_) => ErrorKind::BadImage,
            Error::Busy(_) => ErrorKind::Busy,
            Error::Cancelled => ErrorKind::Cancelled,
            Error::Reported { kind, .. } => *kind,
            Error::Offline => ErrorKind::Offline,
            Error::Hub(e) => match e {
                hub::Error::Unauthorized { .. } => ErrorKind::Unauthorized,
                hub::Error::NotFound { .. } => ErrorKind::NotFound,
                hub::Error::NoSpace { .. } | hub::Error::DiskFull { .. } => ErrorKind::DiskFull,
                hub::Error::Cancelled => ErrorKind::Cancelled,
                hub::Error::Io { .. } => ErrorKind::Internal,
                hub::Error::Network { .. }
                | hub::Error::Http { .. }
                | hub::Error::Corrupt { .. }
                | hub::Error::Protocol(_) => ErrorKind::Network,
            },
        }
    }

    /// The error as a message-only copy that keeps its kind (errors cross threads as text).
    pub(crate) fn clone_message(&self) -> Error {
        Error::Reported { kind: self.kind(), message: self.to_string() }
    }

    /// The error as front ends receive it.
    pub fn to_command_error(&self) -> CommandError {
        CommandError { kind: self.kind(), message: self.to_string() }
    }
}

/// `Result` with the chat layer's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
