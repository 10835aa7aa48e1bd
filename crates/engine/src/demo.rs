//! The untrained demo model: a tiny Gemma 4 with a vision tower and random weights, paired
//! with a real tokenizer, for tests that chat through every stage (template, vision, prefill,
//! decode) on weights that take seconds to write. Its replies are gibberish by construction;
//! the library labels it "Demo (untrained)". The app ships the trained demo instead
//! (tests/models/: same family, weights learned from English text).
//!
//! Weights come from a fixed-seed xorshift generator, so the same files come out on every
//! machine; the 262k-row embedding table is affine-quantized (4-bit, group 64) to keep the
//! folder near 10 MB.

use std::collections::BTreeMap;
use std::path::Path;

use mlx::{Array, Dtype};
use serde_json::{Value, json};

use crate::{Error, Result};

/// Name the app shows for the demo model.
pub const DISPLAY_NAME: &str = "Demo (untrained)";

const HIDDEN: i32 = 64;
const VOCAB: i32 = 262_208; // Gemma 3's 262,145 ids rounded up, as the real checkpoints pad it
const VISION_HIDDEN: i32 = 32;

struct Rng(u64);

impl Rng {
    /// A normal sample (Box–Muller over xorshift64*).
    fn normal(&mut self) -> f32 {
        let mut uniform = || {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (u1, u2) = (uniform(), uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

fn config(tokenizer_config: &Value, ids: &dyn Fn(&str) -> Result<u32>) -> Result<Value> {
    let token = |key: &str| -> Result<u32> {
        let name =
            tokenizer_config.get(key).and_then(Value::as_str).ok_or_else(|| Error::Config {
                file: "tokenizer_config.json".into(),
                message: format!("missing key `{key}`"),
            })?;
        ids(name)
    };
    let layer_types =
        ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"];
    Ok(json!({
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "image_token_id": token("image_token")?,
        "boi_token_id": token("boi_token")?,
        "eoi_token_id": token("eoi_token")?,
        "bos_token_id": token("bos_token")?,
        "eos_token_id": [1, token("eos_token")?],
        "pad_token_id": 0,
        "vocab_size": VOCAB,
        "audio_config": null,
        "quantization": {"group_size": 64, "bits": 4, "mode": "affine"},
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "num_global_key_value_heads": 1,
            "head_dim": 32,
            "global_head_dim": 64,
            "vocab_size": VOCAB,
            "rms_norm_eps": 1e-6,
            "layer_types": layer_types,
            "sliding_window": 512,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25}
            },
            "attention_k_eq_v": false,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
            "use_double_wide_mlp": false,
            "final_logit_softcapping": 30.0,
            "enable_moe_block": false,
            "tie_word_embeddings": true,
            "use_bidirectional_attention": "vision",
            "max_position_embeddings": 32768
        },
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": VISION_HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "position_embedding_size": 256,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
            "standardize": false,
            "use_clipped_linears": false
        }
    }))
}

/// Every tensor of the demo model with its shape: `(name, shape, is_norm_weight)`.
fn tensors() -> Vec<(String, Vec<i32>, bool)> {
    let mut out = Vec::new();
    let mut add = |name: String, shape: &[i32], norm: bool| out.push((name, shape.to_vec(), norm));
    let t = "language_model.model.";
    add(format!("{t}embed_tokens.weight"), &[VOCAB, HIDDEN], false);
    add(format!("{t}norm.weight"), &[HIDDEN], true);
    for i in 0..4 {
        let p = format!("{t}layers.{i}.");
        let d = if i == 3 { 64 } else { 32 };
        for (name, shape) in [
            ("self_attn.q_proj.weight", [2 * d, HIDDEN]),
            ("self_attn.k_proj.weight", [d, HIDDEN]),
            ("self_attn.v_proj.weight", [d, HIDDEN]),
            ("self_attn.o_proj.weight", [HIDDEN, 2 * d]),
            ("mlp.gate_proj.weight", [128, HIDDEN]),
            ("mlp.up_proj.weight", [128, HIDDEN]),
            ("mlp.down_proj.weight", [HIDDEN, 128]),
        ] {
            add(format!("{p}{name}"), &shape, false);
        }
        add(format!("{p}self_attn.q_norm.weight"), &[d], true);
        add(format!("{p}self_attn.k_norm.weight"), &[d], true);
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            add(format!("{p}{norm}.weight"), &[HIDDEN], true);
        }
        add(format!("{p}layer_scalar"), &[1], true);
    }
    let v = "vision_tower.";
    add(format!("{v}patch_embedder.input_proj.weight"), &[VISION_HIDDEN, 768], false);
    add(format!("{v}patch_embedder.position_embedding_table"), &[2, 256, VISION_HIDDEN], false);
    for i in 0..2 {
        let p = format!("{v}encoder.layers.{i}.");
        for name in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            add(
                format!("{p}self_attn.{name}.linear.weight"),
                &[VISION_HIDDEN, VISION_HIDDEN],
                false,
            );
        }
        add(format!("{p}self_attn.q_norm.weight"), &[16], true);
        add(format!("{p}self_attn.k_norm.weight"), &[16], true);
        add(format!("{p}mlp.gate_proj.linear.weight"), &[64, VISION_HIDDEN], false);
        add(format!("{p}mlp.up_proj.linear.weight"), &[64, VISION_HIDDEN], false);
        add(format!("{p}mlp.down_proj.linear.weight"), &[VISION_HIDDEN, 64], false);
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            add(format!("{p}{norm}.weight"), &[VISION_HIDDEN], true);
        }
    }
    add("embed_vision.embedding_projection.weight".into(), &[HIDDEN, VISION_HIDDEN], false);
    out
}

/// Writes the demo model to `out` (config, weights, tokenizer files copied from
/// `tokenizer_dir`, which must hold `tokenizer.json` and `tokenizer_config.json` with image
/// tokens, as the Gemma 3 tokenizer's do). Deterministic: same bytes every time.
pub fn write(out: &Path, tokenizer_dir: &Path) -> Result<()> {
    let tokenizer =
        crate::tokenizer::Tokenizer::from_dir(tokenizer_dir)?.ok_or_else(|| Error::Config {
            file: "tokenizer.json".into(),
            message: format!("no tokenizer.json in {}", tokenizer_dir.display()),
        })?;
    let tokenizer_config =
        crate::checkpoint::read_json(&tokenizer_dir.join("tokenizer_config.json"))?;
    let ids = |name: &str| -> Result<u32> {
        tokenizer.token_id(name).ok_or_else(|| Error::Config {
            file: "tokenizer.json".into(),
            message: format!("token {name} is not in the vocabulary"),
        })
    };
    let config = config(&tokenizer_config, &ids)?;
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut weights = BTreeMap::new();
    for (name, shape, norm) in tensors() {
        let n: i32 = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| if norm { 1.0 + 0.1 * rng.normal() } else { 0.05 * rng.normal() })
            .collect();
        let array = Array::from_slice(&values, &shape)?.astype(Dtype::Bfloat16)?;
        if name.ends_with("embed_tokens.weight") {
            let q = mlx::quantized::quantize(&array, 64, 4)?;
            let module = name.trim_end_matches(".weight");
            weights.insert(format!("{module}.weight"), q.weight);
            weights.insert(format!("{module}.scales"), q.scales);
            weights.insert(format!("{module}.biases"), q.biases);
        } else {
            weights.insert(name, array);
        }
    }
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "mlx".to_string());
    metadata.insert("quince_demo".to_string(), "untrained".to_string());
    mlx::io::save_safetensors(out.join("model.safetensors"), &weights, &metadata)?;
    let write = |name: &str, text: String| -> Result<()> {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|source| Error::Io { path, source })
    };
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| Error::Config { file: "config.json".into(), message: e.to_string() })?;
    write("config.json", text)?;
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        let from = tokenizer_dir.join(name);
        std::fs::copy(&from, out.join(name)).map_err(|source| Error::Io { path: from, source })?;
    }
    Ok(())
}
