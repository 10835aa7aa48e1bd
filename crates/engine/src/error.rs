//! The engine's error type.

use std::path::PathBuf;

/// What can go wrong loading a model or generating with it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An MLX call failed (bad shapes, unreadable tensor data, …).
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    /// A file of the model directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `config.json` (or another JSON file) is malformed or misses a key.
    #[error("{file}: {message}")]
    Config {
        /// The file, e.g. `config.json`.
        file: String,
        /// What is wrong, naming the key.
        message: String,
    },
    /// The checkpoint uses a feature this engine does not implement.
    #[error("unsupported checkpoint feature: {key} = {value} ({reason})")]
    Unsupported {
        /// The config key, e.g. `model_type` or `text_config.enable_moe_block`.
        key: String,
        /// Its value.
        value: String,
        /// What we support instead.
        reason: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("missing tensor {name} in {dir}")]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The model directory.
        dir: PathBuf,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {name} has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        /// The tensor name.
        name: String,
        /// Its shape on disk.
        actual: Vec<i32>,
        /// What the config implies.
        expected: Vec<i32>,
    },
    /// A safetensors shard named by the index is missing, or none exists.
    #[error("missing weights file {path}")]
    MissingShard {
        /// The file that should exist.
        path: PathBuf,
    },
    /// A safetensors file is corrupt (bad header, truncated).
    #[error("corrupt weights file {path}: {message}")]
    CorruptWeights {
        /// The file.
        path: PathBuf,
        /// MLX's message.
        message: String,
    },
    /// The prompt and the requested reply do not fit the model's context.
    #[error(
        "prompt of {prompt_tokens} tokens plus {max_new_tokens} new tokens exceeds the context limit of {limit} tokens"
    )]
    ContextOverflow {
        /// Tokens in the prompt (including any cached prefix).
        prompt_tokens: usize,
        /// Tokens requested.
        max_new_tokens: usize,
        /// The model's context length.
        limit: usize,
    },
    /// A conversation's prompt alone fills the model's context.
    #[error(
        "This conversation is {prompt_tokens} tokens long, more than the model's context of \
         {limit} tokens. Start a new chat, or edit an earlier message to shorten it."
    )]
    PromptTooLong {
        /// Tokens in the rendered prompt, images included.
        prompt_tokens: usize,
        /// The model's context length.
        limit: usize,
    },
    /// The draft method a turn asked for cannot serve this model.
    #[error(
        "The {what} in {} cannot be used: {reason}. Pick another one, or turn speculative \
         decoding off in this conversation's settings.",
        path.display()
    )]
    Drafter {
        /// `draft model` or `assistant`.
        what: &'static str,
        /// Its folder.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The caller cancelled it.
    #[error("cancelled")]
    Cancelled,
    /// An image file cannot be used (unreadable, corrupt, unsupported, too large).
    #[error("cannot use the image {path}: {message}")]
    InvalidImage {
        /// The file.
        path: PathBuf,
        /// Why, in words.
        message: String,
    },
    /// A request argument is invalid (empty prompt, token id out of range, bad sampling value).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}

/// `Result` with the engine's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
