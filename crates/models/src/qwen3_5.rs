//! Qwen3.5 and Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): hybrid decoders whose layers are mostly
//! gated DeltaNet (a causal depthwise convolution, then the gated delta rule over a recurrent
//! state, [`cache::RecurrentCache`]) with gated full attention every
//! `full_attention_interval`-th layer, and a dense MLP or routed experts with a shared expert.
//! Ported from mlx-lm 0.32.2 (`models/qwen3_5.py`, `qwen3_5_moe.py`, `qwen3_next.py`,
//! `gated_delta.py`); `tests/golden/qwen3_5` pins it against mlx-lm's own model.
//!
//! Its multi-token-prediction head drafts for it ([`mtp`], a `qwen3_5_mtp` drafter folder).
//! A checkpoint with a vision tower takes images ([`vision`], [`processor`]): mlx-vlm 0.7.10's
//! `qwen3_5`, whose soft tokens take multimodal rope positions on the image's grid.

pub mod config;
mod layers;
pub mod mtp;
pub mod processor;
pub mod text;
pub mod vision;

use serde_json::Value;

use crate::Model;
use crate::checkpoint::{ModelDir, under};
use crate::options::LoadOptions;
use cache::Result;
pub use mtp::Qwen35Mtp;
pub use text::Qwen35Text;

/// The registry's loader for `qwen3_5` and `qwen3_5_moe` checkpoints.
pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Box<dyn Model>> {
    Ok(Box::new(Qwen35Text::load(dir, options)?))
}

/// Whether a checkpoint takes images: it has a vision tower.
pub fn takes_images(config: &Value) -> bool {
    config.get("vision_config").is_some_and(|v| !v.is_null())
}

/// Why a Qwen3.5 checkpoint may hold `name` unread: what mlx-lm 0.32.2 (`qwen3_5`,
/// `qwen3_5_moe`) drops too ([`crate::checkpoint::Unread`]).
pub fn unread(name: &str, config: &Value) -> Option<&'static str> {
    if name.split('.').any(|part| part == "mtp") {
        return Some(
            "the multi-token-prediction head: the model loads without it, and it drafts from \
             its own qwen3_5_mtp folder",
        );
    }
    let vision = under(name, "vision_tower.") || under(name, "visual.");
    if vision && !takes_images(config) {
        return Some("a vision tower the config has no vision_config for (a text-only load)");
    }
    let head = name == "lm_head.weight" || name == "language_model.lm_head.weight";
    let tied =
        config::TextConfig::from_checkpoint_config(config).is_ok_and(|c| c.tie_word_embeddings);
    (head && tied).then_some("an output head tied to the embedding (tie_word_embeddings)")
}
