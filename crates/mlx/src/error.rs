//! The one error type of this crate.

use std::panic::Location;

/// What can go wrong when calling MLX.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// MLX threw: bad shapes, dtypes or arguments, I/O failures in `load`/`save`, errors
    /// returned by a compiled closure. `what` is MLX's own message; `location` is the Rust call
    /// that made the failing request.
    #[error("{what} (called at {location})")]
    Mlx {
        /// The C++ exception's `what()`.
        what: String,
        /// Where in Rust the failing call was made.
        location: &'static Location<'static>,
    },
    /// `to_vec`/`item` asked for a Rust element type that differs from the array's dtype.
    #[error("array has dtype {actual:?}, not {expected:?} (called at {location})")]
    DtypeMismatch {
        /// The dtype the caller's element type stands for.
        expected: crate::Dtype,
        /// The array's dtype.
        actual: crate::Dtype,
        /// Where in Rust the call was made.
        location: &'static Location<'static>,
    },
    /// A Rust-side argument check failed before MLX was called.
    #[error("{message} (called at {location})")]
    InvalidArgument {
        /// What was wrong.
        message: String,
        /// Where in Rust the call was made.
        location: &'static Location<'static>,
    },
}

impl Error {
    /// MLX's message, or this crate's, without the location.
    pub fn message(&self) -> &str {
        match self {
            Error::Mlx { what, .. } => what,
            Error::InvalidArgument { message, .. } => message,
            Error::DtypeMismatch { .. } => "dtype mismatch",
        }
    }

    /// The Rust call site the error is attributed to.
    pub fn location(&self) -> &'static Location<'static> {
        match self {
            Error::Mlx { location, .. }
            | Error::DtypeMismatch { location, .. }
            | Error::InvalidArgument { location, .. } => location,
        }
    }

    /// An error with this message, for a compiled closure that fails for reasons of its own
    /// (it comes back from [`crate::Compiled::call`] as [`Error::Mlx`] carrying the message).
    #[track_caller]
    pub fn from_message(message: impl Into<String>) -> Self {
        Error::invalid(message)
    }

    #[track_caller]
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidArgument { message: message.into(), location: Location::caller() }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Turns a bridge result into ours, attributing a C++ exception to the caller's location.
#[track_caller]
pub(crate) fn check<T>(result: std::result::Result<T, cxx::Exception>) -> Result<T> {
    match result {
        Ok(value) => Ok(value),
        Err(e) => Err(Error::Mlx { what: e.what().to_string(), location: Location::caller() }),
    }
}
