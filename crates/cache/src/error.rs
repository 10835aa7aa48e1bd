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
    /// The checkpoint holds tensors the model does not use (a checkpoint of another model, or
    /// converted wrongly): loaded without them it would answer as a different model.
    #[error(
        "{} holds {} this model does not use: {}. The checkpoint was made for another model or \
         converted wrongly, and without them it would not answer as the model it was made from.",
        dir.display(),
        if names.len() == 1 { "a tensor".to_string() } else { format!("{} tensors", names.len()) },
        crate::error::listed(names)
    )]
    UnusedTensors {
        /// The model directory.
        dir: PathBuf,
        /// Every such tensor, sorted.
        names: Vec<String>,
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
    /// The KV cache of the prompt and the longest reply would not fit the memory limit.
    #[error(
        "This reply could need {} of KV cache ({tokens} tokens with {storage}), but only {} is \
         free under the memory limit ({} of the {} MLX recommends for this device, {} of it \
         already in use). Choose a smaller KV cache in the chat settings (4-bit or TurboQuant), \
         lower Max tokens, or start a new chat.",
        crate::units::human(*needed), crate::units::human(*available),
        crate::units::percent(*share), crate::units::human(*recommended),
        crate::units::human(*in_use)
    )]
    KvMemory {
        /// Projected KV bytes of the prompt and `max_tokens`.
        needed: u64,
        /// What the limit leaves: `share × recommended − in_use`.
        available: u64,
        /// The share of the recommended memory a turn may fill.
        share: f64,
        /// The memory MLX recommends for the device.
        recommended: u64,
        /// Memory in use before the turn (the weights, mostly).
        in_use: u64,
        /// Prompt plus reply tokens projected.
        tokens: usize,
        /// The KV choice, in words.
        storage: String,
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

/// The first names of a list, and how many more there are.
fn listed(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

/// `Result` with the engine's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
