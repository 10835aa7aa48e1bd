//! Gemma 3: text (`gemma3_text`, and the text path of `gemma3`). Ported from mlx-lm 0.32.2
//! (`models/gemma3_text.py`) and mlx-vlm 0.7.10 (`models/gemma3`).
//!
//! Gemma 3's decoder is Gemma 4's without per-layer inputs, KV sharing, value norms or layer
//! scalars, with norms that scale by `1 + w`, an attention scale of `query_pre_attn_scalar^-½`,
//! linear rope scaling on the global layers and a bfloat16-rounded embedding scale: so it runs
//! on the Gemma 4 decoder under [`Variant::GEMMA3`]. This folder holds what is its own: the
//! [`config`].

pub mod config;

use serde_json::Value;

use crate::backend::Ops;
use crate::checkpoint::ModelDir;
use crate::error::Result;
use crate::models::Model;
use crate::models::gemma4::config::Variant;
use crate::models::gemma4::text::{Gemma4Text, Parts};
use crate::options::LoadOptions;

/// The registry's loader for `gemma3` and `gemma3_text` checkpoints.
pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Box<dyn Model>> {
    let (config, prefix) = config::text_config(&dir.config)?;
    let parts =
        Parts { config, prefix, variant: Variant::GEMMA3, images: None, bidirectional_vision: false };
    Ok(Box::new(Gemma4Text::build(dir, parts, Ops::new(&options.kernels), options)?))
}

/// Whether a `gemma3` config has a vision tower (the library tells without loading).
pub fn takes_images(config: &Value) -> bool {
    config.get("vision_config").is_some_and(|v| !v.is_null())
}
