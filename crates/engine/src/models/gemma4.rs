//! Gemma 4: text (`gemma4_text`, and the text path of `gemma4`), the vision tower and its
//! preprocessing, the mixture-of-experts block of 26B-A4B, and the assistant drafter
//! (`gemma4_assistant`). Ported from mlx-vlm 0.7.10 (`models/gemma4`,
//! `speculative/drafters/gemma4_assistant`) and mlx-lm 0.32.2 (`models/gemma4_text.py`).
//!
//! Files, in reading order: [`config`] (the text config, refused where unsupported),
//! `attention` (rope, q/k/v heads, KV sharing), `layer` (the decoder layer, MLP, per-layer
//! input), `moe`, [`text`] (the decoder, its compiled step, the assistant's port),
//! [`vision`] (the tower), [`processor`] (image preprocessing and tokens), [`assistant`].

pub mod assistant;
mod attention;
pub mod config;
mod layer;
mod moe;
pub mod processor;
pub mod text;
pub mod vision;

use serde_json::Value;

pub use assistant::Gemma4Assistant;
pub use config::{Gemma4TextConfig, RopeParameters};
pub use text::Gemma4Text;

use crate::checkpoint::ModelDir;
use crate::error::Result;
use crate::models::DraftMethod;
use crate::models::Model;
use crate::options::LoadOptions;

/// The registry's loader for `gemma4` and `gemma4_text` checkpoints.
pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Box<dyn Model>> {
    Ok(Box::new(Gemma4Text::from_dir(dir, options)?))
}

/// The registry's loader for `gemma4_assistant` checkpoints.
pub fn load_assistant(dir: &ModelDir, options: &LoadOptions) -> Result<Box<dyn DraftMethod>> {
    Ok(Box::new(Gemma4Assistant::from_dir(dir, options)?))
}

/// Whether a `gemma4` config has a vision tower (the library tells without loading).
pub fn takes_images(config: &Value) -> bool {
    config.get("vision_config").is_some_and(|v| !v.is_null())
}
