//! Gemma 3's config (`gemma3_text`, or the `text_config` of a `gemma3` checkpoint), read the
//! way mlx-lm 0.32.2 and mlx-vlm 0.7.10 read it and mapped onto the Gemma decoder's
//! [`Gemma4TextConfig`]. Absent keys take the values of the Hugging Face / mlx-vlm defaults.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

use crate::gemma4::RopeParameters;
use crate::gemma4::config::Gemma4TextConfig;
use cache::{Error, Result};

#[derive(Debug, Clone, Deserialize)]
struct RopeScaling {
    #[serde(alias = "type")]
    rope_type: String,
    #[serde(default)]
    factor: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
struct TextConfig {
    hidden_size: i32,
    intermediate_size: i32,
    num_hidden_layers: usize,
    #[serde(default = "default_heads")]
    num_attention_heads: i32,
    #[serde(default = "default_kv_heads")]
    num_key_value_heads: i32,
    #[serde(default = "default_head_dim")]
    head_dim: i32,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    #[serde(default)]
    vocab_size: Option<i32>,
    /// Global layers' θ (mlx-lm, transformers); mlx-vlm reads `rope_global_base_freq`.
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_global_base_freq: Option<f64>,
    #[serde(default = "default_local_base")]
    rope_local_base_freq: f64,
    #[serde(default)]
    rope_scaling: Option<RopeScaling>,
    #[serde(default)]
    rope_traditional: bool,
    #[serde(default = "default_qpas")]
    query_pre_attn_scalar: f64,
    #[serde(default = "default_window")]
    sliding_window: usize,
    #[serde(default = "default_pattern")]
    sliding_window_pattern: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: usize,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    use_bidirectional_attention: Option<bool>,
    #[serde(default)]
    eos_token_id: Option<Value>,
}

fn default_heads() -> i32 {
    8
}
fn default_kv_heads() -> i32 {
    4
}
fn default_head_dim() -> i32 {
    256
}
fn default_eps() -> f32 {
    1e-6
}
fn default_local_base() -> f64 {
    10_000.0
}
fn default_qpas() -> f64 {
    256.0
}
fn default_window() -> usize {
    4096
}
fn default_pattern() -> usize {
    6
}
fn default_max_positions() -> usize {
    131_072
}

fn config_error(message: String) -> Error {
    Error::Config { file: "config.json".into(), message }
}

/// The decoder config of a `gemma3` or `gemma3_text` checkpoint's `config.json`, and the
/// tensor prefix of its text weights.
pub fn text_config(config: &Value) -> Result<(Gemma4TextConfig, String)> {
    let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or_default();
    let (text, at, prefix) = match model_type {
        "gemma3" => (
            config
                .get("text_config")
                .cloned()
                .ok_or_else(|| config_error("missing key `text_config`".into()))?,
            "text_config.",
            "language_model.model.",
        ),
        "gemma3_text" => (config.clone(), "", "model."),
        other => {
            return Err(Error::Unsupported {
                key: "model_type".into(),
                value: other.into(),
                reason: "supported: gemma3, gemma3_text".into(),
            });
        }
    };
    let c: TextConfig =
        serde_json::from_value(text).map_err(|e| config_error(format!("{at}: {e}")))?;
    if c.use_bidirectional_attention == Some(true) {
        return Err(Error::Unsupported {
            key: format!("{at}use_bidirectional_attention"),
            value: "true".into(),
            reason: "an embedding model, not a chat model".into(),
        });
    }
    if let Some(cap) = c.attn_logit_softcapping {
        return Err(Error::Unsupported {
            key: format!("{at}attn_logit_softcapping"),
            value: cap.to_string(),
            reason: "attention logit softcapping is not implemented (null in Gemma 3 releases)"
                .into(),
        });
    }
    if c.sliding_window_pattern == 0 {
        return Err(config_error(format!("{at}sliding_window_pattern must be positive")));
    }
    // mlx-lm and mlx-vlm read the pattern (every pattern-th layer is global) and ignore
    // `layer_types`; where a config has both, they must agree.
    let layer_types: Vec<String> = (0..c.num_hidden_layers)
        .map(|i| {
            if (i + 1) % c.sliding_window_pattern == 0 {
                "full_attention"
            } else {
                "sliding_attention"
            }
            .to_string()
        })
        .collect();
    if let Some(given) = &c.layer_types
        && given != &layer_types
    {
        return Err(config_error(format!(
            "{at}layer_types disagrees with sliding_window_pattern {}",
            c.sliding_window_pattern
        )));
    }
    let full = match &c.rope_scaling {
        None => None,
        Some(s) if s.rope_type == "default" => None,
        Some(s) if s.rope_type == "linear" => match s.factor {
            Some(f) if f > 0.0 => Some(f),
            _ => return Err(config_error(format!("{at}rope_scaling needs a positive factor"))),
        },
        Some(s) => {
            return Err(Error::Unsupported {
                key: format!("{at}rope_scaling.rope_type"),
                value: s.rope_type.clone(),
                reason: "default or linear".into(),
            });
        }
    };
    let theta = |t: f64| RopeParameters {
        rope_type: "default".into(),
        rope_theta: t,
        partial_rotary_factor: None,
        factor: None,
    };
    let global_theta = c.rope_global_base_freq.or(c.rope_theta).unwrap_or(1_000_000.0);
    let mut full_rope = theta(global_theta);
    if let Some(factor) = full {
        full_rope.rope_type = "linear".into();
        full_rope.factor = Some(factor);
    }
    let rope_parameters = HashMap::from([
        ("sliding_attention".to_string(), theta(c.rope_local_base_freq)),
        ("full_attention".to_string(), full_rope),
    ]);
    // mlx-lm's gemma3 wrapper takes the top-level vocabulary; both default to 262208.
    let vocab_size = c
        .vocab_size
        .or_else(|| config.get("vocab_size").and_then(Value::as_i64).map(|v| v as i32))
        .unwrap_or(262_208);
    let parsed = Gemma4TextConfig {
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads,
        num_global_key_value_heads: None,
        head_dim: c.head_dim,
        global_head_dim: None,
        vocab_size,
        rms_norm_eps: c.rms_norm_eps,
        layer_types,
        sliding_window: c.sliding_window,
        rope_parameters,
        rope_traditional: c.rope_traditional,
        attention_k_eq_v: false,
        num_kv_shared_layers: 0,
        hidden_size_per_layer_input: 0,
        vocab_size_per_layer_input: None,
        use_double_wide_mlp: false,
        // mlx never applies a final softcap to Gemma 3, whatever the config says.
        final_logit_softcapping: None,
        enable_moe_block: false,
        num_experts: None,
        top_k_experts: None,
        moe_intermediate_size: None,
        // Gemma 3's head is untied exactly when the checkpoint holds one, whatever the config
        // says (`Variant::GEMMA3.head_from_checkpoint`, as mlx-lm decides).
        tie_word_embeddings: true,
        max_position_embeddings: c.max_position_embeddings,
        eos_token_id: c.eos_token_id.or_else(|| config.get("eos_token_id").cloned()),
        attention_scale: Some(c.query_pre_attn_scalar.powf(-0.5) as f32),
    };
    Ok((parsed, prefix.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_makes_every_sixth_layer_global_and_rope_scaling_is_linear() {
        let config = serde_json::json!({
            "model_type": "gemma3", "eos_token_id": [1, 106],
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                "num_hidden_layers": 8, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "sliding_window": 1024}
        });
        let (c, prefix) = text_config(&config).unwrap();
        assert_eq!(prefix, "language_model.model.");
        let globals: Vec<usize> =
            (0..8).filter(|&i| c.layer_types[i] == "full_attention").collect();
        assert_eq!(globals, [5]);
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (8, 4, 256));
        assert_eq!(c.vocab_size, 262_208);
        let full = &c.rope_parameters["full_attention"];
        assert_eq!(
            (full.rope_type.as_str(), full.factor, full.rope_theta),
            ("linear", Some(8.0), 1e6)
        );
        assert_eq!(c.rope_parameters["sliding_attention"].rope_theta, 1e4);
        assert_eq!(c.attention_scale, Some(1.0 / 16.0));
        assert_eq!(c.eos_token_id, Some(serde_json::json!([1, 106])));
    }

    #[test]
    fn what_is_not_implemented_is_refused_by_its_key() {
        let base = serde_json::json!({"model_type": "gemma3_text", "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 2});
        let with = |key: &str, value: Value| {
            let mut c = base.clone();
            c[key] = value;
            text_config(&c).unwrap_err().to_string()
        };
        assert!(
            with("rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 2}))
                .contains("rope_scaling.rope_type")
        );
        assert!(
            with("attn_logit_softcapping", serde_json::json!(50.0))
                .contains("attn_logit_softcapping")
        );
        assert!(
            with("use_bidirectional_attention", serde_json::json!(true))
                .contains("use_bidirectional_attention")
        );
        assert!(
            with("layer_types", serde_json::json!(["full_attention", "full_attention"]))
                .contains("layer_types")
        );
    }
}
