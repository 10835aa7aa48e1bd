//! Gemma 4's text config: `text_config` of a `gemma4` checkpoint or the whole config of a
//! `gemma4_text` one, parsed field for field, and refused at load where it asks for what this
//! engine does not implement.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

use cache::{Error, Result};

/// What differs between the Gemma decoders this folder runs: Gemma 4's own, and Gemma 3's
/// (`models::gemma3` maps its config onto [`Gemma4TextConfig`] and picks [`Variant::GEMMA3`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// The family, for messages.
    pub family: &'static str,
    /// Norms scale by `1 + w` (Gemma 3; the loader adds the 1 in the weight's dtype, as
    /// mlx-lm computes it), not by `w`.
    pub norm_offset: bool,
    /// Values are normed (without a weight) before attention.
    pub value_norm: bool,
    /// Each layer's output is multiplied by its `layer_scalar`.
    pub layer_scalar: bool,
    /// The embedding scale `√hidden` is rounded to bfloat16 first, whatever the model's dtype
    /// (mlx-lm and mlx-vlm's Gemma 3).
    pub embed_scale_bf16: bool,
    /// The model lends the Gemma 4 assistant its reads ([`crate::AssistantRows`]).
    pub assistant_port: bool,
    /// The output head is untied exactly when the checkpoint holds `lm_head.weight`, whatever
    /// `tie_word_embeddings` says (mlx-lm's Gemma 3 `sanitize`); otherwise the config decides.
    pub head_from_checkpoint: bool,
}

impl Variant {
    /// Gemma 4.
    pub const GEMMA4: Variant = Variant {
        family: "Gemma 4",
        norm_offset: false,
        value_norm: true,
        layer_scalar: true,
        embed_scale_bf16: false,
        assistant_port: true,
        head_from_checkpoint: false,
    };
    /// Gemma 3.
    pub const GEMMA3: Variant = Variant {
        family: "Gemma 3",
        norm_offset: true,
        value_norm: false,
        layer_scalar: false,
        embed_scale_bf16: true,
        assistant_port: false,
        head_from_checkpoint: true,
    };

    /// The norm of a stored weight, as this variant scales by it.
    pub(crate) fn norm(&self, weight: mlx::Array, eps: f32) -> Result<crate::nn::RmsNorm> {
        let weight = if self.norm_offset { weight.add_scalar(1.0)? } else { weight };
        Ok(crate::nn::RmsNorm::new(weight, eps))
    }
}

/// Rope settings of one layer type (`rope_parameters.<layer type>`).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    /// `default` or `proportional` (Gemma 4), `linear` (Gemma 3's global layers).
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
    /// θ.
    pub rope_theta: f64,
    /// Fraction of each head's dimensions that rotate (proportional rope).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Frequency factor (proportional rope), or the position divisor (`linear`).
    #[serde(default)]
    pub factor: Option<f64>,
}

fn default_rope_type() -> String {
    "default".into()
}

/// `text_config` of a `gemma4` checkpoint, or the whole config of a `gemma4_text` one.
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma4TextConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// MLP width (doubled on KV-shared layers when `use_double_wide_mlp`).
    pub intermediate_size: i32,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: i32,
    /// Key/value heads of sliding layers (and full layers unless `attention_k_eq_v`).
    pub num_key_value_heads: i32,
    /// Key/value heads of full layers with `attention_k_eq_v`.
    #[serde(default)]
    pub num_global_key_value_heads: Option<i32>,
    /// Head dimension of sliding layers.
    pub head_dim: i32,
    /// Head dimension of full layers.
    #[serde(default)]
    pub global_head_dim: Option<i32>,
    /// Vocabulary.
    pub vocab_size: i32,
    /// RMS norm epsilon.
    pub rms_norm_eps: f32,
    /// `sliding_attention` / `full_attention` per layer.
    pub layer_types: Vec<String>,
    /// Keys visible to a query on sliding layers, itself included.
    pub sliding_window: usize,
    /// Rope per layer type.
    pub rope_parameters: HashMap<String, RopeParameters>,
    /// Rotate interleaved pairs instead of halves.
    #[serde(default)]
    pub rope_traditional: bool,
    /// Full layers take values from the raw `k_proj` output.
    #[serde(default)]
    pub attention_k_eq_v: bool,
    /// The last N layers reuse a donor's keys and values.
    #[serde(default)]
    pub num_kv_shared_layers: usize,
    /// Per-layer embedding width (0: no PLE).
    #[serde(default)]
    pub hidden_size_per_layer_input: i32,
    /// Per-layer embedding vocabulary.
    #[serde(default)]
    pub vocab_size_per_layer_input: Option<i32>,
    /// KV-shared layers get a doubled MLP.
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    /// `tanh(x / c) · c` on the logits.
    #[serde(default)]
    pub final_logit_softcapping: Option<f32>,
    /// Each layer adds a mixture-of-experts block beside its MLP (26B-A4B).
    #[serde(default)]
    pub enable_moe_block: bool,
    /// Experts per MoE layer.
    #[serde(default)]
    pub num_experts: Option<i32>,
    /// Experts each token is routed to.
    #[serde(default)]
    pub top_k_experts: Option<i32>,
    /// Hidden width of one expert's GeGLU.
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    /// The LM head is the embedding table.
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Context length.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// End-of-sequence id(s).
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    /// The attention scale; absent for Gemma 4, whose q/k norms replace `1/√d` (scale 1).
    #[serde(skip)]
    pub attention_scale: Option<f32>,
}

fn default_true() -> bool {
    true
}

fn default_max_positions() -> usize {
    131_072
}

impl Gemma4TextConfig {
    /// Parses the text config out of a checkpoint's `config.json` (`gemma4` or `gemma4_text`),
    /// refusing what this engine does not implement with the key that asks for it.
    pub fn from_checkpoint_config(config: &Value) -> Result<(Gemma4TextConfig, String)> {
        let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or_default();
        let (text, prefix_key) = match model_type {
            "gemma4" => {
                let text = config.get("text_config").ok_or_else(|| Error::Config {
                    file: "config.json".into(),
                    message: "missing key `text_config`".into(),
                })?;
                (text.clone(), "text_config.")
            }
            "gemma4_text" => (config.clone(), ""),
            other => {
                return Err(Error::Unsupported {
                    key: "model_type".into(),
                    value: other.into(),
                    reason: "supported: gemma4, gemma4_text".into(),
                });
            }
        };
        let mut parsed: Gemma4TextConfig = serde_json::from_value(text).map_err(|e| {
            Error::Config { file: "config.json".into(), message: format!("{prefix_key}: {e}") }
        })?;
        if parsed.eos_token_id.is_none() {
            parsed.eos_token_id = config.get("eos_token_id").cloned();
        }
        if parsed.enable_moe_block {
            let positive = |key: &str, v: Option<i32>| -> Result<i32> {
                match v {
                    Some(n) if n > 0 => Ok(n),
                    _ => Err(Error::Config {
                        file: "config.json".into(),
                        message: format!(
                            "{prefix_key}enable_moe_block needs a positive {prefix_key}{key}"
                        ),
                    }),
                }
            };
            let experts = positive("num_experts", parsed.num_experts)?;
            let top_k = positive("top_k_experts", parsed.top_k_experts)?;
            positive("moe_intermediate_size", parsed.moe_intermediate_size)?;
            if top_k > experts {
                return Err(Error::Config {
                    file: "config.json".into(),
                    message: format!(
                        "{prefix_key}top_k_experts ({top_k}) exceeds num_experts ({experts})"
                    ),
                });
            }
        }
        if parsed.layer_types.len() != parsed.num_hidden_layers {
            return Err(Error::Config {
                file: "config.json".into(),
                message: format!(
                    "{prefix_key}layer_types has {} entries for {} layers",
                    parsed.layer_types.len(),
                    parsed.num_hidden_layers
                ),
            });
        }
        for (i, kind) in parsed.layer_types.iter().enumerate() {
            if kind != "sliding_attention" && kind != "full_attention" {
                return Err(Error::Unsupported {
                    key: format!("{prefix_key}layer_types[{i}]"),
                    value: kind.clone(),
                    reason: "sliding_attention or full_attention".into(),
                });
            }
            let Some(rope) = parsed.rope_parameters.get(kind) else {
                return Err(Error::Config {
                    file: "config.json".into(),
                    message: format!("missing key `{prefix_key}rope_parameters.{kind}`"),
                });
            };
            if rope.rope_type != "default" && rope.rope_type != "proportional" {
                return Err(Error::Unsupported {
                    key: format!("{prefix_key}rope_parameters.{kind}.rope_type"),
                    value: rope.rope_type.clone(),
                    reason: "default or proportional".into(),
                });
            }
        }
        if parsed.num_kv_shared_layers >= parsed.num_hidden_layers {
            return Err(Error::Config {
                file: "config.json".into(),
                message: format!(
                    "{prefix_key}num_kv_shared_layers must be below num_hidden_layers"
                ),
            });
        }
        let prefix = if model_type == "gemma4" { "language_model.model." } else { "model." };
        Ok((parsed, prefix.into()))
    }
}
