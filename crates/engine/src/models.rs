//! Models: the [`Model`] trait and one module per architecture.

pub mod gemma4;
pub mod gemma4_vision;

use mlx::Array;

use std::path::Path;

use crate::cache::AttentionCache;
use crate::checkpoint::ModelDir;
use crate::error::{Error, Result};

/// Which cache phase a forward pass appends with (the phase is never inferred from a length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Several new positions, causal among themselves (prefill chunks, verify windows).
    Window,
    /// Exactly one new position.
    Decode,
}

/// Which rows of logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every position (`[B, T, V]`).
    All,
    /// Only the last position (`[B, 1, V]`): prefill needs nothing else, and rows that feed no
    /// cache are dropped early (before KV-sharing layers and the head).
    Last,
}

/// A causal language model over the cache stack.
pub trait Model: std::fmt::Debug {
    /// Fresh caches for one sequence, one per layer that stores keys and values (KV-sharing
    /// layers have none, so this can be shorter than the layer list).
    fn new_caches(&self) -> Result<Vec<Box<dyn AttentionCache>>>;
    /// Logits `[B, T, vocab]` for token ids `[B, T]` appended to `caches` with `phase`.
    fn forward(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn AttentionCache>],
        phase: Phase,
    ) -> Result<Array> {
        self.forward_rows(tokens, caches, phase, Rows::All)
    }
    /// One decode step: logits `[1, 1, vocab]` for `token` `[1, 1]` appended to `caches`. A
    /// model with a compiled step ([`crate::compiled`]) runs it here when it can; the result is
    /// the same as [`Model::forward`] with [`Phase::Decode`].
    fn forward_decode(
        &self,
        token: &Array,
        caches: &mut [Box<dyn AttentionCache>],
    ) -> Result<Array> {
        self.forward(token, caches, Phase::Decode)
    }
    /// The model's compiled decode graphs (to switch them off, or read their counters), when
    /// it has a compiled step.
    fn decode_graphs(&self) -> Option<&crate::compiled::DecodeGraphs> {
        None
    }
    /// [`Model::forward`] returning only `rows` of logits.
    fn forward_rows(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn AttentionCache>],
        phase: Phase,
        rows: Rows,
    ) -> Result<Array>;
    /// Logits for a prompt whose image-token positions take the given image features (in
    /// order, `[n_i, hidden]` each, from [`Model::encode_image`]), appended as one window with
    /// the model's image-block attention rule.
    fn forward_multimodal(
        &self,
        tokens: &[u32],
        images: &[Array],
        caches: &mut [Box<dyn AttentionCache>],
        rows: Rows,
    ) -> Result<Array> {
        let _ = (tokens, images, caches, rows);
        Err(Error::InvalidRequest("this model does not take images".into()))
    }
    /// Soft-token features `[n, hidden]` of one preprocessed image (`[3, H, W]` in [0, 1]).
    fn encode_image(&self, pixels: &Array) -> Result<Array> {
        let _ = pixels;
        Err(Error::InvalidRequest("this model does not take images".into()))
    }
    /// The token id image features replace, when the model has a vision tower.
    fn image_token_id(&self) -> Option<u32> {
        None
    }
    /// Begin- and end-of-image token ids.
    fn boi_eoi(&self) -> Option<(u32, u32)> {
        None
    }
    /// Weight bytes one decode step reads (every matrix a token passes through and the output
    /// head; embedding tables give one row and are left out), for a bandwidth roofline. 0 when
    /// the model does not say.
    fn decode_weight_bytes(&self) -> usize {
        0
    }
    /// Vocabulary size of the output head.
    fn vocab_size(&self) -> usize;
    /// Longest sequence the model supports.
    fn max_context(&self) -> usize;
    /// Token ids that end a reply according to the config (`eos_token_id`).
    fn eos_token_ids(&self) -> Vec<u32>;
    /// The Gemma 4 assistant's port, when this model provides it.
    fn assistant_rows(&self) -> Option<&dyn crate::speculative::AssistantRows> {
        None
    }
    /// Whether this model provides a port draft methods read.
    fn provides(&self, port: crate::speculative::TargetPort) -> bool {
        match port {
            crate::speculative::TargetPort::AssistantRows => self.assistant_rows().is_some(),
            _ => false,
        }
    }
}

/// Loads the model a checkpoint directory holds, chosen by its `model_type`.
pub fn load(path: impl AsRef<Path>) -> Result<Box<dyn Model>> {
    let dir = ModelDir::open(path)?;
    let model_type =
        dir.config.get("model_type").and_then(serde_json::Value::as_str).unwrap_or_default();
    match model_type {
        "gemma4" | "gemma4_text" => Ok(Box::new(gemma4::Gemma4Text::from_dir(&dir)?)),
        other => Err(Error::Unsupported {
            key: "model_type".into(),
            value: other.into(),
            reason: "supported: gemma4, gemma4_text".into(),
        }),
    }
}
