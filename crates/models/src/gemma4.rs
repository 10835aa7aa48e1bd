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

use crate::DraftMethod;
use crate::Model;
use crate::checkpoint::{ModelDir, text_part, under};
use crate::options::LoadOptions;
use cache::Result;

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

/// Why a Gemma 4 checkpoint may hold `name` unread: what mlx-lm 0.32.2 (`gemma4_text`,
/// `gemma4`) and mlx-vlm 0.7.10 (`gemma4`) drop too ([`crate::checkpoint::Unread`]).
pub fn unread(name: &str, config: &Value) -> Option<&'static str> {
    if name.contains("self_attn.rotary_emb") {
        return Some("rotary tables: computed from the config");
    }
    if under(name, "audio_tower.") || under(name, "embed_audio.") {
        return Some("the audio tower: Quince takes no audio");
    }
    let vision = ["vision_tower.", "embed_vision.", "multi_modal_projector.", "vision_embedder."]
        .iter()
        .any(|m| under(name, m));
    if vision && !takes_images(config) {
        return Some("a vision tower the config has no vision_config for (a text-only load)");
    }
    let clip = ["input_max", "input_min", "output_max", "output_min"]
        .iter()
        .any(|b| name.ends_with(&format!(".{b}")));
    let clips = config
        .get("vision_config")
        .and_then(|v| v.get("use_clipped_linears"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if clip && !(under(name, "vision_tower.") && clips) {
        return Some("clipping bounds of linears that do not clip (use_clipped_linears)");
    }
    let shared_kv = text_part(name).and_then(|rest| {
        let (layer, rest) = rest.strip_prefix("layers.")?.split_once('.')?;
        let kv = ["self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm."];
        kv.iter().any(|m| rest.starts_with(m)).then_some(layer.parse::<usize>().ok()?)
    });
    if let Some(layer) = shared_kv
        && let Ok((c, _)) = Gemma4TextConfig::from_checkpoint_config(config)
        && layer >= c.num_hidden_layers - c.num_kv_shared_layers
        && layer < c.num_hidden_layers
    {
        return Some("keys and values of a KV-sharing layer: it reads its donor's");
    }
    None
}

/// Why a Gemma 4 assistant checkpoint may hold `name` unread (mlx-vlm 0.7.10's
/// `gemma4_assistant` drops the same).
pub fn assistant_unread(name: &str, config: &Value) -> Option<&'static str> {
    let tied = config.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(true);
    (name == "lm_head.weight" && tied)
        .then_some("an output head tied to the embedding (tie_word_embeddings)")
}
