//! Gemma 3: text (`gemma3_text`, and the text path of `gemma3`), the SigLIP vision tower with
//! its projector, and its image preprocessing. Ported from mlx-lm 0.32.2
//! (`models/gemma3_text.py`) and mlx-vlm 0.7.10 (`models/gemma3`).
//!
//! Gemma 3's decoder is Gemma 4's without per-layer inputs, KV sharing, value norms or layer
//! scalars, with norms that scale by `1 + w`, an attention scale of `query_pre_attn_scalar^-½`,
//! linear rope scaling on the global layers and a bfloat16-rounded embedding scale: so it runs
//! on the Gemma 4 decoder under [`Variant::GEMMA3`]. This folder holds what is its own: the
//! [`config`], the [`vision`] tower and the [`processor`].
//!
//! Where the references differ, Quince follows transformers' Gemma 3, which the models were
//! trained with: each image's block of soft tokens attends both ways during prefill (mlx-vlm
//! keeps it causal), and the image features enter the prompt unscaled (mlx-vlm divides them by
//! √`hidden_size` of a top-level key real configs lack, so by √2048, before the text scale
//! multiplies them). `tests/golden/gemma3` pins both against mlx-vlm's own layers.

pub mod config;
pub mod processor;
pub mod vision;

use serde_json::Value;

use crate::Model;
use crate::checkpoint::{ModelDir, under};
use crate::gemma4::config::Variant;
use crate::gemma4::text::{Gemma4Text, Parts};
use crate::options::LoadOptions;
use crate::vision::Vision;
use cache::backend::Ops;
use cache::{Error, Result};
use processor::Gemma3Images;
use vision::{Gemma3Vision, VisionConfig};

/// The registry's loader for `gemma3` and `gemma3_text` checkpoints.
pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Box<dyn Model>> {
    let (config, prefix) = config::text_config(&dir.config)?;
    let top = &dir.config;
    let images: Option<Box<dyn Vision>> = match top.get("vision_config") {
        // A checkpoint converted by mlx-lm keeps `vision_config` but not the tower.
        Some(v)
            if takes_images(top)
                && dir.contains("vision_tower.vision_model.embeddings.patch_embedding.weight") =>
        {
            let vision: VisionConfig = serde_json::from_value(v.clone()).map_err(|e| {
                Error::Config { file: "config.json".into(), message: format!("vision_config: {e}") }
            })?;
            // Transformers puts it at the top level, mlx-vlm in text_config; both default 256.
            let tokens = top
                .get("mm_tokens_per_image")
                .or_else(|| top.get("text_config").and_then(|t| t.get("mm_tokens_per_image")))
                .and_then(Value::as_i64)
                .unwrap_or(256) as i32;
            let tower = Gemma3Vision::load(&dir.weights("")?, vision, config.hidden_size, tokens)?;
            Some(Box::new(Gemma3Images::new(tower, top)))
        }
        _ => None,
    };
    let bidirectional_vision = images.is_some();
    let parts = Parts { config, prefix, variant: Variant::GEMMA3, images, bidirectional_vision };
    Ok(Box::new(Gemma4Text::build(dir, parts, Ops::new(&options.kernels), options)?))
}

/// Whether a `gemma3` config has a vision tower (the library tells without loading).
pub fn takes_images(config: &Value) -> bool {
    config.get("vision_config").is_some_and(|v| !v.is_null())
}

/// Why a Gemma 3 checkpoint may hold `name` unread: what mlx-lm 0.32.2's `gemma3` drops too
/// ([`crate::checkpoint::Unread`]). Its output head is read whenever it is there.
pub fn unread(name: &str, config: &Value) -> Option<&'static str> {
    let vision = ["vision_tower.", "multi_modal_projector."].iter().any(|m| under(name, m));
    (vision && !takes_images(config))
        .then_some("a vision tower the config has no vision_config for (a text-only load)")
}
