//! Gemma 4 text (dense): `gemma4` checkpoints (text path of the multimodal model) and
//! `gemma4_text`. Ported from mlx-vlm 0.7.10 `models/gemma4/language.py` and mlx-lm 0.32.2
//! `models/gemma4_text.py`; see `shared/reference/engine.md` §1.
//!
//! Per-layer embeddings (PLE), sliding and full layers with their own rope (proportional on
//! full layers), q/k/v norms with attention scale 1, KV-shared tail layers that attend their
//! donor's read, double-wide MLPs on shared layers, `attention_k_eq_v`, `layer_scalar`, final
//! logit softcapping and a tied head, and the mixture-of-experts block of 26B-A4B (a router
//! and experts beside each layer's MLP, as mlx-lm's `Router`/`SwitchGLU`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use mlx::fast::{RopeFrequencies, RopeOffset, rope, rope_by_ops};
use mlx::{Array, ops};
use serde::Deserialize;
use serde_json::Value;

use crate::cache::{
    AttentionCache, AttentionRead, DecodeFetch, PlainCache, RotatingCache, TraceCache,
};
use crate::checkpoint::{Matrix, ModelDir, Weights};
use crate::compiled::DecodeGraphs;
use crate::error::{Error, Result};
use crate::fused;
use crate::models::gemma4_vision::{Gemma4Vision, VisionConfig};
use crate::models::{Model, Phase, Rows};
use crate::nn::{Activations, Embedding, Linear, RmsNorm, Stacked};

/// Rope settings of one layer type (`rope_parameters.<layer type>`).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    /// `default` or `proportional`.
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
    /// θ.
    pub rope_theta: f64,
    /// Fraction of each head's dimensions that rotate (proportional rope).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Frequency factor (proportional rope).
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

/// Rotary embedding of one layer type.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    /// Periods for proportional rope (`inf` for the pairs that do not rotate).
    freqs: Option<Array>,
}

impl Rope {
    pub(crate) fn new(params: &RopeParameters, dims: i32, traditional: bool) -> Result<Rope> {
        let freqs = if params.rope_type == "proportional" {
            // As mlx-lm's ProportionalRoPE: rotated = int(dims · factor_partial), periods
            // factor · θ^(2i/dims) for the rotated pairs, infinite for the rest.
            let rotated = (f64::from(dims) * params.partial_rotary_factor.unwrap_or(1.0)) as i32;
            let factor = params.factor.unwrap_or(1.0);
            let mut periods: Vec<f32> = (0..rotated / 2)
                .map(|i| {
                    (factor * params.rope_theta.powf(f64::from(2 * i) / f64::from(dims))) as f32
                })
                .collect();
            periods.resize((dims / 2) as usize, f32::INFINITY);
            Some(Array::from_slice(&periods, &[dims / 2])?)
        } else {
            None
        };
        Ok(Rope { dims, traditional, base: params.rope_theta as f32, freqs })
    }

    /// The rotation as the fused decode kernel takes it.
    fn spec(&self) -> fused::RopeSpec<'_> {
        fused::RopeSpec {
            traditional: self.traditional,
            base: self.base,
            freqs: self.freqs.as_ref(),
        }
    }

    /// Rotates `x` for positions starting `delta` after `position`.
    fn apply(&self, x: &Array, position: &Position, delta: i32) -> Result<Array> {
        let frequencies = match &self.freqs {
            Some(f) => RopeFrequencies::Custom(f),
            None => RopeFrequencies::Base(self.base),
        };
        let offset = match position {
            Position::At(p) => RopeOffset::Fixed(p + delta),
            Position::Traced(p) if delta == 0 => RopeOffset::Array(p),
            Position::Traced(_) => {
                return Err(Error::InvalidRequest(
                    "a traced decode step has one position per row".into(),
                ));
            }
        };
        if matches!(position, Position::Traced(_)) && mlx::Backend::current() == mlx::Backend::Cpu {
            // On the CPU the fused call is a composition with slices, which a shapeless
            // compiled step cannot replay; this one gathers instead, bit for bit the same.
            return Ok(rope_by_ops(x, self.dims, self.traditional, frequencies, 1.0, offset)?);
        }
        Ok(rope(x, self.dims, self.traditional, frequencies, 1.0, offset)?)
    }
}

/// Where a forward pass's new positions start.
#[derive(Debug, Clone)]
pub(crate) enum Position {
    /// At this absolute position.
    At(i32),
    /// At the int32 scalar a compiled decode step takes as an input.
    Traced(Array),
}

impl Position {
    /// Where the positions appended to `caches` start: their offset.
    pub(crate) fn of(caches: &[Box<dyn AttentionCache>]) -> Position {
        Position::At(caches.first().map_or(0, |c| c.offset()) as i32)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Attention {
    /// The query projection, then the key and value projections on a layer with its own keys
    /// (the value one absent with `attention_k_eq_v`): one stacked product.
    proj: Stacked,
    /// `None` on KV-shared layers.
    kv: Option<KeyValue>,
    o_proj: Linear,
    q_norm: RmsNorm,
    heads: i32,
    pub(crate) head_dim: i32,
    pub(crate) sliding: bool,
}

#[derive(Debug, Clone)]
struct KeyValue {
    /// `attention_k_eq_v`: values are the raw `k_proj` output (no `v_proj`).
    k_eq_v: bool,
    k_norm: RmsNorm,
    v_norm: RmsNorm,
    kv_heads: i32,
}

#[derive(Debug, Clone)]
struct Mlp {
    /// `gate_proj` and `up_proj`, stacked.
    gate_up: Stacked,
    down_proj: Linear,
    /// The int32 scalar 1: where `up` starts in the stacked output, in widths.
    one: Array,
}

#[derive(Debug, Clone)]
struct PerLayerInput {
    gate: Linear,
    projection: Linear,
    post_norm: RmsNorm,
    /// This layer's index into the per-layer inputs, as an int32 scalar.
    index: Array,
    layer: i32,
}

/// The mixture-of-experts block of a layer (mlx-lm `Router`, `Experts`/`SwitchGLU`): each
/// token goes to its `top_k` best-scored experts, whose GeGLU outputs, weighted by the softmax
/// of their scores times a per-expert scale, are summed next to the dense MLP's.
#[derive(Debug, Clone)]
struct Moe {
    /// RMS norm with `router.scale · hidden^-½` as its weight.
    router_norm: RmsNorm,
    router: Linear,
    /// `[experts]`.
    per_expert_scale: Array,
    /// `[experts, width, hidden]`, `[experts, width, hidden]`, `[experts, hidden, width]`.
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    top_k: i32,
    /// int32 `[experts - top_k, experts)`: where the top k sit after the partition.
    last_k: Array,
    /// `pre_feedforward_layernorm_2`: the experts' input.
    pre_norm: RmsNorm,
    /// `post_feedforward_layernorm_1`, on the dense MLP's output.
    post_norm_mlp: RmsNorm,
    /// `post_feedforward_layernorm_2`, on the experts' output.
    post_norm_experts: RmsNorm,
    /// The rows the expert products read for the last routes' shape (see
    /// [`Moe::row_indices`]).
    rows: RefCell<Option<RouteRows>>,
}

#[derive(Debug, Clone)]
pub(crate) struct DecoderLayer {
    pub(crate) attention: Attention,
    mlp: Mlp,
    moe: Option<Moe>,
    pub(crate) input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    per_layer: Option<PerLayerInput>,
    layer_scalar: Array,
}

#[derive(Debug, Clone)]
struct Ple {
    embed: Embedding,
    model_projection: Linear,
    projection_norm: RmsNorm,
    width: i32,
}

/// The Gemma 4 text decoder with its tied head.
#[derive(Debug)]
pub struct Gemma4Text {
    config: Gemma4TextConfig,
    embed_tokens: Embedding,
    ple: Option<Ple>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// For each layer, the layer whose keys and values it attends (itself unless shared).
    kv_source: Vec<usize>,
    /// Index of the first KV-shared layer (= number of caches).
    first_shared: usize,
    rope_sliding: Rope,
    rope_full: Rope,
    activations: Activations,
    /// Scalars of the forward pass, made once in the model's dtype.
    constants: Constants,
    vision: Option<Gemma4Vision>,
    image_token_id: Option<u32>,
    boi_eoi: Option<(u32, u32)>,
    /// `use_bidirectional_attention == "vision"`: image blocks attend both ways in prefill.
    bidirectional_vision: bool,
    /// The final-normed hidden state of the last forward pass's rows (a handle into its graph:
    /// no extra work), for drafters that read it.
    last_hidden: std::cell::RefCell<Option<Array>>,
    /// The compiled decode steps traced so far.
    decode_graphs: DecodeGraphs,
}

#[derive(Debug, Clone)]
struct Constants {
    embed_scale: Array,
    ple_token_scale: Array,
    ple_projection_scale: Array,
    ple_input_scale: Array,
    softcap: Option<Array>,
}

impl Gemma4Text {
    /// Loads a `gemma4` or `gemma4_text` checkpoint directory.
    pub fn load(path: impl AsRef<Path>) -> Result<Gemma4Text> {
        let dir = ModelDir::open(path)?;
        Gemma4Text::from_dir(&dir)
    }

    /// Builds the model from an opened directory.
    pub fn from_dir(dir: &ModelDir) -> Result<Gemma4Text> {
        let (config, mut prefix) = Gemma4TextConfig::from_checkpoint_config(&dir.config)?;
        // Hugging Face layout of the multimodal checkpoint: `model.language_model.*`.
        if prefix == "language_model.model." && !dir.tensors.keys().any(|k| k.starts_with(&prefix))
        {
            prefix = "model.language_model.".into();
        }
        let w = dir.weights(&prefix)?;
        let c = &config;
        let hidden = c.hidden_size;
        let layers_n = c.num_hidden_layers;
        let first_shared = layers_n - c.num_kv_shared_layers;
        let embed_tokens = Embedding::new(w.matrix("embed_tokens", c.vocab_size, hidden)?);

        let ple = if c.hidden_size_per_layer_input > 0 {
            let width = c.hidden_size_per_layer_input;
            let total = layers_n as i32 * width;
            Some(Ple {
                embed: Embedding::new(w.matrix(
                    "embed_tokens_per_layer",
                    c.vocab_size_per_layer_input.unwrap_or(c.vocab_size),
                    total,
                )?),
                model_projection: Linear::new(w.matrix(
                    "per_layer_model_projection",
                    total,
                    hidden,
                )?),
                projection_norm: RmsNorm::new(
                    w.get("per_layer_projection_norm.weight", &[width])?,
                    c.rms_norm_eps,
                ),
                width,
            })
        } else {
            None
        };

        let mut layers = Vec::with_capacity(layers_n);
        let mut kv_source: Vec<usize> = (0..layers_n).collect();
        let mut last_of_type: HashMap<&str, usize> = HashMap::new();
        for (i, kind) in c.layer_types.iter().enumerate() {
            let kind = kind.as_str();
            if i < first_shared {
                last_of_type.insert(kind, i);
            } else {
                kv_source[i] = *last_of_type.get(kind).ok_or_else(|| Error::Config {
                    file: "config.json".into(),
                    message: format!(
                        "KV-shared layer {i} ({kind}) has no earlier {kind} layer to share from"
                    ),
                })?;
            }
            layers.push(load_layer(&w, c, i, i >= first_shared)?);
        }
        let norm = RmsNorm::new(w.get("norm.weight", &[hidden])?, c.rms_norm_eps);
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            let root = Weights::from_prefix_parent(dir, &prefix)?;
            Some(Linear::new(root.matrix("lm_head", c.vocab_size, hidden)?))
        };
        let sliding_dims = c.head_dim;
        let full_dims = c.global_head_dim.unwrap_or(c.head_dim);
        let rope_sliding =
            Rope::new(&c.rope_parameters["sliding_attention"], sliding_dims, c.rope_traditional)
                .or_else(|_| {
                    Rope::new(
                        &c.rope_parameters["full_attention"],
                        sliding_dims,
                        c.rope_traditional,
                    )
                })?;
        let rope_full = match c.rope_parameters.get("full_attention") {
            Some(p) => Rope::new(p, full_dims, c.rope_traditional)?,
            None => rope_sliding.clone(),
        };
        // The activation dtype follows the weights (f32, bf16; a quantized checkpoint's scales).
        let dtype = match &embed_tokens.table_dtype() {
            Some(d) => *d,
            None => mlx::Dtype::Float32,
        };
        let scalar = |v: f64| mlx::Array::scalar_as(v, dtype);
        let ple_width = f64::from(config.hidden_size_per_layer_input.max(1));
        let constants = Constants {
            embed_scale: scalar(f64::from(config.hidden_size).sqrt())?,
            ple_token_scale: scalar(ple_width.sqrt())?,
            ple_projection_scale: scalar(f64::from(config.hidden_size).powf(-0.5))?,
            ple_input_scale: scalar(2f64.powf(-0.5))?,
            softcap: match config.final_logit_softcapping {
                Some(c) if c > 0.0 => Some(scalar(f64::from(c))?),
                _ => None,
            },
        };
        let top = &dir.config;
        let id = |key: &str| top.get(key).and_then(Value::as_u64).map(|v| v as u32);
        let vision = match top.get("vision_config") {
            Some(v)
                if !v.is_null()
                    && dir
                        .tensors
                        .contains_key("vision_tower.patch_embedder.input_proj.weight") =>
            {
                let vc: VisionConfig =
                    serde_json::from_value(v.clone()).map_err(|e| Error::Config {
                        file: "config.json".into(),
                        message: format!("vision_config: {e}"),
                    })?;
                Some(Gemma4Vision::load(&dir.weights("")?, vc, config.hidden_size)?)
            }
            _ => None,
        };
        let bidirectional_vision = dir
            .config
            .get("text_config")
            .and_then(|t| t.get("use_bidirectional_attention"))
            .and_then(Value::as_str)
            == Some("vision");
        let boi_eoi = id("boi_token_id").zip(id("eoi_token_id"));
        Ok(Gemma4Text {
            vision,
            image_token_id: id("image_token_id"),
            boi_eoi,
            bidirectional_vision,
            last_hidden: std::cell::RefCell::new(None),
            decode_graphs: DecodeGraphs::default(),
            activations: Activations::new()?,
            constants,
            config,
            embed_tokens,
            ple,
            layers,
            norm,
            lm_head,
            kv_source,
            first_shared,
            rope_sliding,
            rope_full,
        })
    }

    /// The parsed text config.
    pub fn config(&self) -> &Gemma4TextConfig {
        &self.config
    }

    /// What a compiled decode graph owns: the text model's weights (shared handles, nothing is
    /// copied) without its vision tower, graphs or state.
    fn tracing_twin(&self) -> Result<Gemma4Text> {
        Ok(Gemma4Text {
            config: self.config.clone(),
            embed_tokens: self.embed_tokens.clone(),
            ple: self.ple.clone(),
            layers: self.layers.clone(),
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            kv_source: self.kv_source.clone(),
            first_shared: self.first_shared,
            rope_sliding: self.rope_sliding.clone(),
            rope_full: self.rope_full.clone(),
            activations: Activations::new()?,
            constants: self.constants.clone(),
            vision: None,
            image_token_id: None,
            boi_eoi: None,
            bidirectional_vision: false,
            last_hidden: std::cell::RefCell::new(None),
            decode_graphs: DecodeGraphs::new(false),
        })
    }

    /// The compiled decode step for caches whose slots are `fetches` (see [`crate::compiled`]):
    /// inputs `[token [1, 1], position, slot inputs…]`, outputs `[logits, last hidden, two per
    /// slot…]`.
    fn decode_graph(&self, fetches: Vec<DecodeFetch>) -> Result<mlx::Compiled> {
        let twin = self.tracing_twin()?;
        // Buffer slots keep their shapes from step to step (and hold custom kernels, whose
        // shapes MLX cannot infer): traced with shapes. Otherwise shapeless.
        let shapeless = !fetches.contains(&DecodeFetch::Buffer);
        Ok(mlx::compile(move |inputs: &[Array]| twin.traced_decode(inputs, &fetches), shapeless)?)
    }

    /// The body of a compiled decode step, run by MLX while it traces.
    fn traced_decode(&self, inputs: &[Array], fetches: &[DecodeFetch]) -> mlx::Result<Vec<Array>> {
        let shapeless = !fetches.contains(&DecodeFetch::Buffer);
        let _tracing = shapeless.then(crate::cache::tracing_step);
        let traced = || -> Result<Vec<Array>> {
            let wanted = 2 + fetches.iter().map(|f| f.inputs()).sum::<usize>();
            if inputs.len() != wanted {
                return Err(Error::InvalidRequest(format!(
                    "a decode step of {} slots takes {wanted} inputs, got {}",
                    fetches.len(),
                    inputs.len()
                )));
            }
            let mut next = 2;
            let mut traces: Vec<Box<dyn AttentionCache>> = Vec::with_capacity(fetches.len());
            for &fetch in fetches {
                let slot = inputs[next..next + fetch.inputs()].to_vec();
                next += fetch.inputs();
                traces.push(Box::new(TraceCache::new(fetch, slot)));
            }
            let token = &inputs[0];
            let h = self.embed_tokens.forward(token)?.multiply(&self.constants.embed_scale)?;
            let position = Position::Traced(inputs[1].clone());
            let logits = self.run(token, h, &mut traces, &Append::Decode, Rows::All, position)?;
            let hidden = self.last_hidden.borrow_mut().take().ok_or_else(|| {
                Error::InvalidRequest("the decode step left no hidden state".into())
            })?;
            let mut outputs = vec![logits, hidden];
            for trace in &traces {
                outputs.extend(trace.buffers());
            }
            Ok(outputs)
        };
        traced().map_err(|e| mlx::Error::from_message(e.to_string()))
    }

    /// Per-layer inputs `[B, T, layers, width]` for token ids and the scaled embeddings.
    fn per_layer_inputs(&self, ple: &Ple, tokens: &Array, h: &Array) -> Result<Array> {
        let shape = tokens.shape();
        let n = self.layers.len() as i32;
        let full = [shape[0], shape[1], n, ple.width];
        let c = &self.constants;
        let token_part = ple.embed.forward(tokens)?.multiply(&c.ple_token_scale)?.reshape(&full)?;
        let context =
            ple.model_projection.forward(h)?.multiply(&c.ple_projection_scale)?.reshape(&full)?;
        let context = ple.projection_norm.forward(&context)?;
        Ok(context.add(&token_part)?.multiply(&c.ple_input_scale)?)
    }
}

impl Weights<'_> {
    fn from_prefix_parent<'d>(dir: &'d ModelDir, prefix: &str) -> Result<Weights<'d>> {
        // `language_model.model.` → `language_model.`; `model.` → ``.
        let trimmed = prefix.trim_end_matches('.');
        let parent = match trimmed.rfind('.') {
            Some(i) => &prefix[..=i],
            None => "",
        };
        dir.weights(parent)
    }
}

pub(crate) fn load_layer(
    w: &Weights<'_>,
    c: &Gemma4TextConfig,
    i: usize,
    shared: bool,
) -> Result<DecoderLayer> {
    let p = format!("layers.{i}.");
    let hidden = c.hidden_size;
    let eps = c.rms_norm_eps;
    let sliding = c.layer_types[i] == "sliding_attention";
    let head_dim = if sliding { c.head_dim } else { c.global_head_dim.unwrap_or(c.head_dim) };
    let k_eq_v = c.attention_k_eq_v && !sliding;
    let kv_heads = match (k_eq_v, c.num_global_key_value_heads) {
        (true, Some(n)) => n,
        _ => c.num_key_value_heads,
    };
    let heads = c.num_attention_heads;
    let a = format!("{p}self_attn.");
    let mut projections = vec![w.matrix(&format!("{a}q_proj"), heads * head_dim, hidden)?];
    let kv = if shared {
        None
    } else {
        projections.push(w.matrix(&format!("{a}k_proj"), kv_heads * head_dim, hidden)?);
        if !k_eq_v {
            projections.push(w.matrix(&format!("{a}v_proj"), kv_heads * head_dim, hidden)?);
        }
        Some(KeyValue {
            k_eq_v,
            k_norm: RmsNorm::new(w.get(&format!("{a}k_norm.weight"), &[head_dim])?, eps),
            v_norm: RmsNorm::unscaled(eps),
            kv_heads,
        })
    };
    let attention = Attention {
        proj: Stacked::new(projections)?,
        kv,
        o_proj: Linear::new(w.matrix(&format!("{a}o_proj"), hidden, heads * head_dim)?),
        q_norm: RmsNorm::new(w.get(&format!("{a}q_norm.weight"), &[head_dim])?, eps),
        heads,
        head_dim,
        sliding,
    };
    let width =
        if shared && c.use_double_wide_mlp { 2 * c.intermediate_size } else { c.intermediate_size };
    let m = format!("{p}mlp.");
    let mlp = Mlp {
        gate_up: Stacked::new(vec![
            w.matrix(&format!("{m}gate_proj"), width, hidden)?,
            w.matrix(&format!("{m}up_proj"), width, hidden)?,
        ])?,
        down_proj: Linear::new(w.matrix(&format!("{m}down_proj"), hidden, width)?),
        one: Array::scalar(1i32)?,
    };
    let norm = |name: &str| -> Result<RmsNorm> {
        Ok(RmsNorm::new(w.get(&format!("{p}{name}.weight"), &[hidden])?, eps))
    };
    let per_layer = if c.hidden_size_per_layer_input > 0 {
        let width = c.hidden_size_per_layer_input;
        Some(PerLayerInput {
            gate: Linear::new(w.matrix(&format!("{p}per_layer_input_gate"), width, hidden)?),
            projection: Linear::new(w.matrix(
                &format!("{p}per_layer_projection"),
                hidden,
                width,
            )?),
            post_norm: norm("post_per_layer_input_norm")?,
            index: Array::scalar(i as i32)?,
            layer: i as i32,
        })
    } else {
        None
    };
    let moe = if c.enable_moe_block { Some(load_moe(w, c, &p, &norm)?) } else { None };
    Ok(DecoderLayer {
        attention,
        mlp,
        moe,
        input_layernorm: norm("input_layernorm")?,
        post_attention_layernorm: norm("post_attention_layernorm")?,
        pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
        post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
        per_layer,
        layer_scalar: w.get(&format!("{p}layer_scalar"), &[1])?,
    })
}

/// A layer's router and experts: mlx-lm's names (`experts.switch_glu.{gate,up,down}_proj`,
/// dense or quantized) or Hugging Face's (`experts.gate_up_proj` `[experts, 2·width, hidden]`
/// and `experts.down_proj`, dense).
fn load_moe(
    w: &Weights<'_>,
    c: &Gemma4TextConfig,
    p: &str,
    norm: &dyn Fn(&str) -> Result<RmsNorm>,
) -> Result<Moe> {
    let hidden = c.hidden_size;
    let (experts, top_k) = (c.num_experts.unwrap_or(0), c.top_k_experts.unwrap_or(0));
    let width = c.moe_intermediate_size.unwrap_or(0);
    let r = format!("{p}router.");
    let scale = w.get(&format!("{r}scale"), &[hidden])?;
    // As mlx-lm: the scale times hidden^-½ (a Python float, so in the scale's dtype).
    let norm_weight = scale.multiply_scalar(f64::from(hidden).powf(-0.5))?;
    let x = format!("{p}experts.");
    let (gate, up, down) = if w.contains(&format!("{x}gate_up_proj")) {
        let joined = w.get(&format!("{x}gate_up_proj"), &[experts, 2 * width, hidden])?;
        let half =
            |from: i32| joined.slice(&[0, from, 0], &[experts, from + width, hidden], &[1, 1, 1]);
        (
            Matrix::Dense(half(0)?),
            Matrix::Dense(half(width)?),
            Matrix::Dense(w.get(&format!("{x}down_proj"), &[experts, hidden, width])?),
        )
    } else {
        let s = format!("{x}switch_glu.");
        (
            w.matrices(&format!("{s}gate_proj"), &[experts], width, hidden)?,
            w.matrices(&format!("{s}up_proj"), &[experts], width, hidden)?,
            w.matrices(&format!("{s}down_proj"), &[experts], hidden, width)?,
        )
    };
    Ok(Moe {
        router_norm: RmsNorm::new(norm_weight, c.rms_norm_eps),
        router: Linear::new(w.matrix(&format!("{r}proj"), experts, hidden)?),
        per_expert_scale: w.get(&format!("{r}per_expert_scale"), &[experts])?,
        gate,
        up,
        down,
        top_k,
        last_k: Array::from_slice(&((experts - top_k)..experts).collect::<Vec<i32>>(), &[top_k])?,
        pre_norm: norm("pre_feedforward_layernorm_2")?,
        post_norm_mlp: norm("post_feedforward_layernorm_1")?,
        post_norm_experts: norm("post_feedforward_layernorm_2")?,
        rows: RefCell::new(None),
    })
}

/// Which row of its input each routed product reads, `[B, L, k]` for routes `[B, L, k]`.
#[derive(Debug, Clone)]
struct RouteRows {
    /// The token's row, `b·L + l` (the gate and up products read `[B, L, 1, 1, H]`).
    token: Array,
    /// The route's own row, `(b·L + l)·k + j` (the down product reads `[B, L, k, 1, W]`).
    route: Array,
}

/// Token batches at least this large (token count × `top_k`) are sorted by expert before the
/// expert products, as mlx-lm does (same rows, read in expert order).
const SORT_ROUTES_FROM: usize = 64;

impl Moe {
    /// The dense MLP's output `mlp` `[B, L, H]` combined with the experts' for the residual
    /// stream `h`: `post₁(mlp) + post₂(experts(pre₂(h)))`.
    fn forward(&self, h: &Array, mlp: &Array, act: &Activations) -> Result<Array> {
        let (routes, weights) = self.route(h)?;
        let experts = self.experts(&self.pre_norm.forward(h)?, &routes, &weights, act)?;
        Ok(self.post_norm_mlp.forward(mlp)?.add(&self.post_norm_experts.forward(&experts)?)?)
    }

    /// The `top_k` experts of each token `[B, L, k]` and their weights.
    fn route(&self, h: &Array) -> Result<(Array, Array)> {
        let scores = self.router.forward(&self.router_norm.forward(h)?)?;
        let partitioned = scores.argpartition(-self.top_k, -1)?;
        // The last k: a view, or in a traced (shapeless) step a gather, which can infer its
        // shape where a slice cannot.
        let routes = if crate::cache::tracing() {
            partitioned.take(&self.last_k, -1)?
        } else {
            let s = scores.shape();
            let n = s.len();
            let mut start = vec![0; n];
            start[n - 1] = s[n - 1] - self.top_k;
            partitioned.slice(&start, &s, &vec![1; n])?
        };
        let weights = scores.take_along_axis(&routes, -1)?.softmax(&[-1], false)?;
        let weights = weights.multiply(&self.per_expert_scale.take(&routes, 0)?)?;
        Ok((routes, weights))
    }

    /// mlx-lm's `SwitchGLU` then the weighted sum over the `k` experts: `[B, L, H]`.
    fn experts(
        &self,
        x: &Array,
        routes: &Array,
        weights: &Array,
        act: &Activations,
    ) -> Result<Array> {
        let x = x.expand_dims(&[-2, -3])?; // [B, L, 1, 1, H]
        let sorted = routes.size() >= SORT_ROUTES_FROM;
        let y = if sorted {
            // Rows in expert order (each token's row once per route), products, then back.
            let flat = routes.flatten(0, -1)?;
            let order = flat.argsort(0)?;
            let back = order.argsort(0)?;
            let rows = x
                .flatten(0, -3)?
                .take(&order.floor_divide(&order.scalar_like(f64::from(self.top_k))?)?, 0)?;
            let by_expert = flat.take(&order, 0)?;
            let y = self.glu(&rows, None, &by_expert, true, act)?.take(&back, 0)?;
            let mut shape = routes.shape();
            shape.extend(y.shape()[1..].iter().copied());
            y.reshape(&shape)?
        } else {
            let rows = self.row_indices(routes)?;
            self.glu(&x, rows.as_ref(), routes, false, act)?
        };
        let y = y.squeeze(&[-2])?; // [B, L, k, H]
        Ok(weights.expand_dims(&[-1])?.multiply(&y)?.sum(&[-2], false)?)
    }

    /// The rows the expert products read (see [`RouteRows`]), evaluated constants made once per
    /// routes' shape. Without them MLX makes the same indices in every gathered product (an
    /// `Arange` and a `Reshape` in each, a `Broadcast` in two: 8 ops a layer per step). `None` inside a
    /// traced step, whose shapes are not fixed: MLX's own indices then.
    fn row_indices(&self, routes: &Array) -> Result<Option<RouteRows>> {
        if crate::cache::tracing() {
            return Ok(None);
        }
        let shape = routes.shape();
        if let Some(rows) = self.rows.borrow().as_ref().filter(|r| r.route.shape() == shape) {
            return Ok(Some(rows.clone()));
        }
        let (b, l, k) = (shape[0], shape[1], shape[2]);
        let count = |n: i32| ops::arange(0.0, f64::from(n), 1.0, routes.dtype());
        let rows = RouteRows {
            token: count(b * l)?.reshape(&[b, l, 1])?.broadcast_to(&shape)?,
            route: count(b * l * k)?.reshape(&shape)?,
        };
        mlx::eval(&[&rows.token, &rows.route])?;
        *self.rows.borrow_mut() = Some(rows.clone());
        Ok(Some(rows))
    }

    fn glu(
        &self,
        x: &Array,
        rows: Option<&RouteRows>,
        routes: &Array,
        sorted: bool,
        act: &Activations,
    ) -> Result<Array> {
        let token = rows.map(|r| &r.token);
        let up = gather_product(&self.up, x, token, routes, sorted)?;
        let gate = gather_product(&self.gate, x, token, routes, sorted)?;
        gather_product(&self.down, &act.geglu(&gate, &up)?, rows.map(|r| &r.route), routes, sorted)
    }
}

/// `x · Wₑᵀ` with `Wₑ` the matrix of `stack` that `routes` names for each row of `x` (the row
/// `rows` names, or MLX's broadcast of the batch when `None`).
fn gather_product(
    stack: &Matrix,
    x: &Array,
    rows: Option<&Array>,
    routes: &Array,
    sorted: bool,
) -> Result<Array> {
    Ok(match stack {
        Matrix::Dense(w) => x.gather_matmul(&w.swapaxes(-1, -2)?, rows, Some(routes), sorted)?,
        Matrix::Quantized(q) => q.gather_matmul(x, rows, Some(routes), true, sorted)?,
    })
}

impl Attention {
    /// Returns the output and, for a layer with its own cache, the read KV-sharing layers use.
    /// Keys and values come from every row of `x`; queries from its last `query_rows` rows
    /// (all of them outside a last-row-only prefill).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        x: &Array,
        query_rows: i32,
        rope: &Rope,
        position: &Position,
        cache: Option<&mut Box<dyn AttentionCache>>,
        shared: Option<&AttentionRead>,
        append: &Append<'_>,
    ) -> Result<(Array, Option<AttentionRead>)> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let joined = self.proj.forward_joined(x)?;
        let fused = match &joined {
            Some(joined) if l == 1 && query_rows == 1 => {
                self.fused_heads(joined, rope, position)?
            }
            _ => None,
        };
        let (q, new_kv) = match fused {
            Some(heads) => (heads.q, heads.kv),
            None => {
                let parts = match &joined {
                    Some(joined) => self.proj.split(joined)?,
                    None => self.proj.forward(x)?,
                };
                self.heads_by_ops(&parts, query_rows, rope, position)?
            }
        };
        let (read, own) = match (&self.kv, shared, new_kv) {
            (Some(_), _, Some((k, v))) => {
                let cache = cache.ok_or_else(|| {
                    Error::InvalidRequest("a layer with keys and values needs a cache".into())
                })?;
                // A decode step on CUDA writes its keys and values inside the attention
                // kernel (no slice update, no slice).
                let in_buffer = match append {
                    Append::Decode if crate::cache::buffer_reads_ready(&q, &k)? => {
                        cache.append_decode_in_buffer(&k, &v)?
                    }
                    _ => None,
                };
                let read = match (in_buffer, append) {
                    (Some(read), _) => read,
                    (None, Append::Window) => cache.append_window(&k, &v)?,
                    (None, Append::Decode) => cache.append_decode(&k, &v)?,
                    (None, Append::Bidirectional(flags)) => {
                        cache.append_bidirectional(&k, &v, flags)?
                    }
                };
                (read.clone(), Some(read))
            }
            (None, Some(donor), _) => (donor.written()?, None),
            _ => {
                return Err(Error::InvalidRequest(
                    "KV-shared layer without its donor's read".into(),
                ));
            }
        };
        let out = read.attend(&q, 1.0)?; // q_norm/k_norm replace the 1/sqrt(d) scale
        let width = self.heads * self.head_dim;
        let out = if query_rows == 1 {
            out.reshape(&[b, 1, width])? // one row: [B, H, 1, D] is already in [B, 1, H·D] order
        } else {
            out.transpose(&[0, 2, 1, 3])?.reshape(&[b, query_rows, width])?
        };
        Ok((self.o_proj.forward(&out)?, own))
    }
}

impl Attention {
    /// Queries, keys and values of one position by the fused kernel (CUDA), from the stacked
    /// projection; `None` where it does not run.
    fn fused_heads(
        &self,
        joined: &Array,
        rope: &Rope,
        position: &Position,
    ) -> Result<Option<fused::Heads>> {
        if rope.dims != self.head_dim {
            return Ok(None);
        }
        let (kv_heads, values_at, k_norm) = match &self.kv {
            Some(kv) => {
                let values_at = if kv.k_eq_v { self.heads } else { self.heads + kv.kv_heads };
                (kv.kv_heads, values_at, &kv.k_norm)
            }
            None => (0, self.heads, &self.q_norm),
        };
        let layout = fused::HeadsLayout {
            head_dim: self.head_dim,
            q_heads: self.heads,
            kv_heads,
            values_at,
            q_norm: &self.q_norm,
            k_norm,
        };
        let position = match position {
            Position::At(p) => position_array(*p)?,
            Position::Traced(p) => p.clone(),
        };
        fused::decode_heads(joined, &layout, &rope.spec(), &position)
    }

    /// Queries (from the last `query_rows` rows) and, on a layer with its own keys, keys and
    /// values, by MLX ops from each projection's output `parts`.
    fn heads_by_ops(
        &self,
        parts: &[Array],
        query_rows: i32,
        rope: &Rope,
        position: &Position,
    ) -> Result<(Array, Option<(Array, Array)>)> {
        let raw_q = &parts[0];
        let s = raw_q.shape();
        let (b, l) = (s[0], s[1]);
        let raw_q = if query_rows < l {
            raw_q.slice(&[0, l - query_rows, 0], &[b, l, s[2]], &[1, 1, 1])?
        } else {
            raw_q.clone()
        };
        let q = heads_first(&raw_q, self.heads, self.head_dim, |q| self.q_norm.forward(q))?;
        let q = rope.apply(&q, position, l - query_rows)?; // [B, H, Lq, D]
        let Some(kv) = &self.kv else { return Ok((q, None)) };
        let (raw_k, raw_v) = match parts {
            [_, k] if kv.k_eq_v => (k, k), // attention_k_eq_v: values from k_proj, before k_norm
            [_, k, v] => (k, v),
            _ => {
                return Err(Error::InvalidRequest(format!(
                    "an attention layer with {} projections",
                    parts.len()
                )));
            }
        };
        let k = heads_first(raw_k, kv.kv_heads, self.head_dim, |k| kv.k_norm.forward(k))?;
        let k = rope.apply(&k, position, 0)?;
        let v = heads_first(raw_v, kv.kv_heads, self.head_dim, |v| kv.v_norm.forward(v))?;
        Ok((q, Some((k, v))))
    }
}

thread_local! {
    /// The last position [`position_array`] made, which the other layers of its step reuse.
    static POSITION: std::cell::RefCell<Option<(i32, Array)>> =
        const { std::cell::RefCell::new(None) };
}

/// `p` as an int32 scalar array, one array for all the layers of a step.
fn position_array(p: i32) -> Result<Array> {
    POSITION.with(|cell| {
        let mut last = cell.borrow_mut();
        if let Some((at, array)) = last.as_ref()
            && *at == p
        {
            return Ok(array.clone());
        }
        let array = crate::cache::step_position(p)?;
        *last = Some((p, array.clone()));
        Ok(array)
    })
}

/// A projection `[B, L, H·D]` as heads `[B, H, L, D]`, with `norm` applied over `D`. For one
/// position a single reshape gives the same order (no transpose node: a decode step runs a few
/// hundred fewer ops, and on CUDA each op costs host time).
fn heads_first(
    x: &Array,
    heads: i32,
    head_dim: i32,
    norm: impl FnOnce(&Array) -> Result<Array>,
) -> Result<Array> {
    let s = x.shape();
    let (b, l) = (s[0], s[1]);
    if l == 1 {
        norm(&x.reshape(&[b, heads, 1, head_dim])?)
    } else {
        Ok(norm(&x.reshape(&[b, l, heads, head_dim])?)?.transpose(&[0, 2, 1, 3])?)
    }
}

impl DecoderLayer {
    /// Everything after attention: the residual, the MLP, the per-layer input (`per_layer`:
    /// the per-layer inputs of every layer, `[B, T, L, W]`) and the layer scalar. Returns the
    /// new residual and, when `next` is given, that norm of it (the next layer's input norm,
    /// or the final one), fused with the last residual add where the backend allows.
    pub(crate) fn finish(
        &self,
        h: Array,
        attn: &Array,
        per_layer: Option<&Array>,
        act: &Activations,
        next: Option<&RmsNorm>,
    ) -> Result<(Array, Option<Array>)> {
        let (h, ff_in) = fused::residual_norm(
            &h,
            attn,
            &self.post_attention_layernorm,
            None,
            Some(&self.pre_feedforward_layernorm),
        )?;
        let ff_in = ff_in.ok_or_else(|| Error::InvalidRequest("no MLP input".into()))?;
        let ff = self.mlp.forward(&ff_in, act)?;
        let ff = match &self.moe {
            Some(moe) => moe.forward(&h, &ff, act)?,
            None => ff,
        };
        let scalar = Some(&self.layer_scalar);
        match (&self.per_layer, per_layer) {
            (Some(pl), Some(inputs)) => {
                let (h, _) =
                    fused::residual_norm(&h, &ff, &self.post_feedforward_layernorm, None, None)?;
                let gate =
                    fused::geglu_at(&pl.gate.forward(&h)?, inputs, pl.layer, &pl.index, act)?;
                fused::residual_norm(
                    &h,
                    &pl.projection.forward(&gate)?,
                    &pl.post_norm,
                    scalar,
                    next,
                )
            }
            _ => fused::residual_norm(&h, &ff, &self.post_feedforward_layernorm, scalar, next),
        }
    }
}

impl Mlp {
    fn forward(&self, x: &Array, act: &Activations) -> Result<Array> {
        let joined = self.gate_up.forward_joined(x)?;
        let fused = match &joined {
            Some(joined) => fused::geglu_halves(joined, &self.one)?,
            None => None,
        };
        let hidden = match (fused, joined) {
            (Some(hidden), _) => hidden,
            (None, Some(joined)) => {
                let parts = self.gate_up.split(&joined)?;
                act.geglu(&parts[0], &parts[1])?
            }
            (None, None) => {
                let parts = self.gate_up.forward(x)?;
                act.geglu(&parts[0], &parts[1])?
            }
        };
        self.down_proj.forward(&hidden)
    }
}

impl Gemma4Text {
    /// The decoder over embeddings `h` `[1, T, H]`; `ple_ids` are the ids the per-layer token
    /// embeddings read.
    fn run(
        &self,
        ple_ids: &Array,
        mut h: Array,
        caches: &mut [Box<dyn AttentionCache>],
        append: &Append<'_>,
        rows: Rows,
        position: Position,
    ) -> Result<Array> {
        if caches.len() != self.first_shared {
            return Err(Error::InvalidRequest(format!(
                "Gemma 4 needs {} caches, got {}",
                self.first_shared,
                caches.len()
            )));
        }
        let per_layer = match &self.ple {
            Some(ple) => Some(self.per_layer_inputs(ple, ple_ids, &h)?),
            None => None,
        };
        let mut per_layer = per_layer;
        let mut position = position;
        let length = h.dim(1)?;
        // With only the last row wanted, the last layer that writes a cache takes keys and
        // values from every row but queries from the last one; from there on only that row
        // flows (KV-sharing layers, the head).
        let trim_at =
            if rows == Rows::Last && length > 1 { Some(self.first_shared - 1) } else { None };
        let mut reads: Vec<Option<AttentionRead>> = Vec::with_capacity(self.layers.len());
        // Each layer hands the next its normed input (fused with its last residual add).
        let mut normed_next: Option<Array> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut query_rows = h.dim(1)?;
            if trim_at == Some(i) {
                query_rows = 1;
            }
            let rope = if layer.attention.sliding { &self.rope_sliding } else { &self.rope_full };
            let cache = if i < self.first_shared { caches.get_mut(i) } else { None };
            let shared = if i >= self.first_shared {
                reads.get(self.kv_source[i]).and_then(Option::as_ref)
            } else {
                None
            };
            let normed = match normed_next.take() {
                Some(normed) => normed,
                None => layer.input_layernorm.forward(&h)?,
            };
            let (attn, own) = layer
                .attention
                .forward(&normed, query_rows, rope, &position, cache, shared, append)?;
            reads.push(own);
            if trim_at == Some(i) {
                (h, per_layer) = last_rows(&h, per_layer.as_ref())?;
                if let Position::At(p) = &mut position {
                    *p += length - 1;
                }
            }
            let next = match self.layers.get(i + 1) {
                Some(next) => &next.input_layernorm,
                None => &self.norm,
            };
            (h, normed_next) =
                layer.finish(h, &attn, per_layer.as_ref(), &self.activations, Some(next))?;
        }
        let h = match normed_next {
            Some(normed) => normed,
            None => self.norm.forward(&h)?,
        };
        // Drafters that read the target's final hidden state take it from here.
        *self.last_hidden.borrow_mut() = Some(h.clone());
        let logits = match &self.lm_head {
            Some(head) => head.forward(&h)?,
            None => self.embed_tokens.as_linear(&h)?,
        };
        match &self.constants.softcap {
            Some(c) => Ok(logits.divide(c)?.tanh()?.multiply(c)?),
            None => Ok(logits),
        }
    }
}

impl Model for Gemma4Text {
    fn new_caches(&self) -> Result<Vec<Box<dyn AttentionCache>>> {
        (0..self.first_shared)
            .map(|i| -> Result<Box<dyn AttentionCache>> {
                if self.config.layer_types[i] == "sliding_attention" {
                    Ok(Box::new(RotatingCache::new(self.config.sliding_window)?))
                } else {
                    Ok(Box::new(PlainCache::new()))
                }
            })
            .collect()
    }

    fn forward_rows(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn AttentionCache>],
        phase: Phase,
        rows: Rows,
    ) -> Result<Array> {
        let h = self.embed_tokens.forward(tokens)?.multiply(&self.constants.embed_scale)?;
        let append = match phase {
            Phase::Window => Append::Window,
            Phase::Decode => Append::Decode,
        };
        let position = Position::of(caches);
        self.run(tokens, h, caches, &append, rows, position)
    }

    fn forward_decode(
        &self,
        token: &Array,
        caches: &mut [Box<dyn AttentionCache>],
    ) -> Result<Array> {
        let position = caches.first().map_or(0, |c| c.offset());
        let compiled = self
            .decode_graphs
            .step(caches, token, position, 2, |fetches| self.decode_graph(fetches))?;
        match compiled {
            Some(mut outputs) => {
                let hidden = outputs.pop();
                *self.last_hidden.borrow_mut() = hidden;
                outputs.pop().ok_or_else(|| Error::InvalidRequest("no logits".into()))
            }
            None => self.forward(token, caches, Phase::Decode),
        }
    }

    fn decode_graphs(&self) -> Option<&DecodeGraphs> {
        Some(&self.decode_graphs)
    }

    fn forward_multimodal(
        &self,
        tokens: &[u32],
        images: &[Array],
        caches: &mut [Box<dyn AttentionCache>],
        rows: Rows,
    ) -> Result<Array> {
        let ids = token_array(tokens)?;
        let mut h = self.embed_tokens.forward(&ids)?.multiply(&self.constants.embed_scale)?;
        let flags: Vec<bool> = tokens.iter().map(|&t| Some(t) == self.image_token_id).collect();
        let slots = flags.iter().filter(|&&f| f).count();
        let provided: i32 = images.iter().map(|f| f.dim(0)).sum::<mlx::Result<i32>>()?;
        if slots != provided as usize {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {slots} image tokens but the images give {provided} features"
            )));
        }
        let mut ple_ids = ids.clone();
        if slots > 0 {
            // Scatter the features, in order, into the image-token rows: gather from
            // [token embeddings; features] with an index per position (a copy, no arithmetic).
            let t = tokens.len() as i32;
            let mut next = t;
            let index: Vec<i32> = flags
                .iter()
                .enumerate()
                .map(|(i, &f)| {
                    if f {
                        next += 1;
                        next - 1
                    } else {
                        i as i32
                    }
                })
                .collect();
            let features: Vec<Array> =
                images.iter().map(|f| f.astype(h.dtype())).collect::<mlx::Result<_>>()?;
            let mut all = vec![h.squeeze(&[0])?];
            all.extend(features);
            let joined = ops::concatenate(&all.iter().collect::<Vec<_>>(), 0)?;
            h = joined.take(&Array::from_slice(&index, &[t])?, 0)?.expand_dims(&[0])?;
            // The per-layer token embeddings see the pad id at image positions.
            let masked: Vec<u32> =
                tokens.iter().zip(&flags).map(|(&tok, &f)| if f { 0 } else { tok }).collect();
            ple_ids = token_array(&masked)?;
        }
        let append = if slots > 0 && self.bidirectional_vision {
            Append::Bidirectional(&flags)
        } else {
            Append::Window
        };
        let position = Position::of(caches);
        self.run(&ple_ids, h, caches, &append, rows, position)
    }

    fn encode_image(&self, pixels: &Array) -> Result<Array> {
        match &self.vision {
            Some(vision) => vision.encode(pixels),
            None => Err(Error::InvalidRequest("this checkpoint has no vision tower".into())),
        }
    }

    fn image_token_id(&self) -> Option<u32> {
        self.vision.as_ref().and(self.image_token_id)
    }

    fn boi_eoi(&self) -> Option<(u32, u32)> {
        self.boi_eoi
    }

    fn decode_weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.attention;
                let mut mlp = l.mlp.gate_up.nbytes() + l.mlp.down_proj.nbytes();
                if let Some(moe) = &l.moe {
                    // A token reads the router and its top_k experts' share of the stacks.
                    let stacks = moe.gate.nbytes() + moe.up.nbytes() + moe.down.nbytes();
                    let experts = moe.per_expert_scale.size().max(1);
                    mlp += moe.router.nbytes() + stacks * moe.top_k as usize / experts;
                }
                let ple =
                    l.per_layer.as_ref().map_or(0, |p| p.gate.nbytes() + p.projection.nbytes());
                a.proj.nbytes() + a.o_proj.nbytes() + mlp + ple
            })
            .sum();
        let ple = self.ple.as_ref().map_or(0, |p| p.model_projection.nbytes());
        let head = self.lm_head.as_ref().map_or_else(|| self.embed_tokens.nbytes(), Linear::nbytes);
        layers + ple + head
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size as usize
    }

    fn max_context(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn assistant_rows(&self) -> Option<&dyn crate::speculative::AssistantRows> {
        Some(self)
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        match &self.config.eos_token_id {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(items)) => {
                items.iter().filter_map(Value::as_u64).map(|v| v as u32).collect()
            }
            _ => Vec::new(),
        }
    }
}

impl crate::speculative::AssistantRows for Gemma4Text {
    fn hidden_size(&self) -> usize {
        self.config.hidden_size as usize
    }

    fn head_dims(&self) -> (i32, i32) {
        (self.config.head_dim, self.config.global_head_dim.unwrap_or(self.config.head_dim))
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        Ok(self.embed_tokens.forward(ids)?.multiply(&self.constants.embed_scale)?)
    }

    fn donor_kv(&self, caches: &[Box<dyn AttentionCache>]) -> Result<crate::speculative::DonorKv> {
        // The last layer of each type attends its donor's cache (or its own).
        let last_of = |sliding: bool| {
            self.layers
                .iter()
                .rposition(|l| l.attention.sliding == sliding)
                .map(|i| self.kv_source[i])
        };
        let read = |layer: Option<usize>| -> Result<Option<crate::speculative::KeyValues>> {
            match layer.and_then(|i| caches.get(i)) {
                Some(cache) => cache.stored(),
                None => Ok(None),
            }
        };
        Ok(crate::speculative::DonorKv {
            sliding: read(last_of(true))?,
            full: read(last_of(false))?,
        })
    }

    fn last_hidden(&self) -> Option<Array> {
        self.last_hidden.borrow().clone()
    }
}

/// How a forward pass appends to the caches.
#[derive(Debug)]
pub(crate) enum Append<'a> {
    Window,
    Decode,
    /// A window whose image blocks (runs of flags) attend bidirectionally.
    Bidirectional(&'a [bool]),
}

/// The last position of `h` `[B, T, H]` and of the per-layer inputs `[B, T, L, W]`.
fn last_rows(h: &Array, per_layer: Option<&Array>) -> Result<(Array, Option<Array>)> {
    let s = h.shape();
    let h = h.slice(&[0, s[1] - 1, 0], &[s[0], s[1], s[2]], &[1, 1, 1])?;
    let per_layer = match per_layer {
        Some(p) => {
            let t = p.shape();
            Some(p.slice(&[0, t[1] - 1, 0, 0], &[t[0], t[1], t[2], t[3]], &[1, 1, 1, 1])?)
        }
        None => None,
    };
    Ok((h, per_layer))
}

/// Token ids `[1, T]` as an int32 array.
pub fn token_array(tokens: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&ids, &[1, ids.len() as i32])?)
}
