//! Qwen3.5's text config: `text_config` of a `qwen3_5` / `qwen3_5_moe` checkpoint (or the
//! whole config of a text-only one), with mlx-lm 0.32.2's defaults, refused at load where it
//! asks for what this engine does not implement.

use serde::Deserialize;
use serde_json::Value;

use cache::{Error, Result};

/// The keys of `text_config` that Quince reads; see mlx-lm's `qwen3_5.TextModelArgs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct TextConfig {
    /// Residual width.
    pub hidden_size: i32,
    /// Width of a dense MLP.
    pub intermediate_size: i32,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Query heads of a full-attention layer.
    pub num_attention_heads: i32,
    /// Key/value heads of a full-attention layer.
    pub num_key_value_heads: i32,
    /// Head width of a full-attention layer (`hidden_size / num_attention_heads` when absent).
    pub head_dim: Option<i32>,
    /// Epsilon of every RMS norm.
    pub rms_norm_eps: f32,
    /// Vocabulary.
    pub vocab_size: i32,
    /// Longest context.
    pub max_position_embeddings: usize,
    /// Value heads of a gated DeltaNet layer.
    pub linear_num_value_heads: i32,
    /// Key heads of a gated DeltaNet layer.
    pub linear_num_key_heads: i32,
    /// Width of a DeltaNet key head.
    pub linear_key_head_dim: i32,
    /// Width of a DeltaNet value head.
    pub linear_value_head_dim: i32,
    /// Taps of the depthwise convolution.
    pub linear_conv_kernel_dim: i32,
    /// The head is the embedding table.
    pub tie_word_embeddings: bool,
    /// Biases on the attention projections (refused).
    pub attention_bias: bool,
    /// Every this-many-th layer is full attention.
    pub full_attention_interval: usize,
    /// Hugging Face's explicit list (`linear_attention` / `full_attention`); it must agree
    /// with `full_attention_interval`, which mlx-lm reads.
    pub layer_types: Option<Vec<String>>,
    /// Routed experts (0: a dense MLP).
    pub num_experts: i32,
    /// Experts per token.
    pub num_experts_per_tok: i32,
    /// Layers between expert layers (1 only).
    pub decoder_sparse_step: i32,
    /// Width of the shared expert.
    pub shared_expert_intermediate_size: i32,
    /// Width of a routed expert.
    pub moe_intermediate_size: i32,
    /// The top-k routing weights are renormalized.
    pub norm_topk_prob: bool,
    /// Layers without experts (none only).
    pub mlp_only_layers: Vec<usize>,
    /// Rope settings.
    pub rope_parameters: Option<RopeParameters>,
    /// Rope base, when `rope_parameters` lacks it.
    pub rope_theta: Option<f64>,
    /// Share of each head that rotates, when `rope_parameters` lacks it.
    pub partial_rotary_factor: Option<f64>,
    /// The MLP activation (silu only).
    pub hidden_act: Option<String>,
    /// Attention output gate (true only).
    pub attn_output_gate: Option<bool>,
    /// Token ids that end a reply.
    pub eos_token_id: Option<Value>,
}

impl Default for TextConfig {
    fn default() -> TextConfig {
        TextConfig {
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: None,
            rms_norm_eps: 1e-6,
            vocab_size: 151936,
            max_position_embeddings: 131072,
            linear_num_value_heads: 64,
            linear_num_key_heads: 16,
            linear_key_head_dim: 192,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            tie_word_embeddings: false,
            attention_bias: false,
            full_attention_interval: 4,
            layer_types: None,
            num_experts: 0,
            num_experts_per_tok: 0,
            decoder_sparse_step: 1,
            shared_expert_intermediate_size: 0,
            moe_intermediate_size: 0,
            norm_topk_prob: true,
            mlp_only_layers: Vec::new(),
            rope_parameters: None,
            rope_theta: None,
            partial_rotary_factor: None,
            hidden_act: None,
            attn_output_gate: None,
            eos_token_id: None,
        }
    }
}

/// `rope_parameters` (`rope_type` or mlx-lm's rewritten `type`; `mrope_section` splits the
/// rotated pairs between time, height and width positions, which are equal for text).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RopeParameters {
    /// `default` only.
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    /// Rope base, when `rope_parameters` lacks it.
    pub rope_theta: Option<f64>,
    /// Share of each head that rotates, when `rope_parameters` lacks it.
    pub partial_rotary_factor: Option<f64>,
    /// Rotated pairs per position axis (time, height, width).
    pub mrope_section: Option<Vec<i32>>,
    /// Whether those sections interleave.
    pub mrope_interleaved: Option<bool>,
}

impl TextConfig {
    /// The text config of a checkpoint's `config.json`: its `text_config`, or the whole of it.
    pub fn from_checkpoint_config(config: &Value) -> Result<TextConfig> {
        let text = config.get("text_config").unwrap_or(config);
        let mut parsed: TextConfig = serde_json::from_value(text.clone()).map_err(|e| {
            Error::Config { file: "config.json".into(), message: format!("text_config: {e}") }
        })?;
        if parsed.eos_token_id.is_none() {
            parsed.eos_token_id = config.get("eos_token_id").cloned();
        }
        parsed.validate()?;
        Ok(parsed)
    }

    /// Head width of the full-attention layers.
    pub fn head_dim(&self) -> i32 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether layer `i` is a gated DeltaNet layer (else gated full attention).
    pub fn is_linear(&self, i: usize) -> bool {
        !(i + 1).is_multiple_of(self.full_attention_interval.max(1))
    }

    /// The rope base.
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(100000.0)
    }

    /// Dimensions of each head that rotate: `int(head_dim · partial_rotary_factor)`.
    pub fn rotary_dims(&self) -> i32 {
        let factor = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.partial_rotary_factor)
            .or(self.partial_rotary_factor)
            .unwrap_or(0.25);
        (f64::from(self.head_dim()) * factor) as i32
    }

    /// Rotary frequency pairs turned by time, row and column positions (multimodal rope;
    /// mlx-vlm's default where the config has none).
    pub fn mrope_section(&self) -> [i32; 3] {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.mrope_section.as_deref())
            .and_then(|s| <[i32; 3]>::try_from(s).ok())
            .unwrap_or([11, 11, 10])
    }

    /// Whether the layers have routed experts.
    pub fn is_moe(&self) -> bool {
        self.num_experts > 0
    }

    fn validate(&self) -> Result<()> {
        let refuse = |key: &str, value: String, reason: &str| Error::Unsupported {
            key: key.into(),
            value,
            reason: reason.into(),
        };
        if self.attention_bias {
            return Err(refuse(
                "attention_bias",
                "true".into(),
                "Qwen3.5 projections have no bias",
            ));
        }
        if self.attn_output_gate == Some(false) {
            return Err(refuse("attn_output_gate", "false".into(), "Qwen3.5 gates its attention"));
        }
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(refuse("hidden_act", act.into(), "silu"));
        }
        if let Some(kind) = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_type.as_deref())
            .filter(|k| *k != "default")
        {
            return Err(refuse("rope_parameters.rope_type", kind.into(), "default"));
        }
        if self.full_attention_interval == 0 {
            return Err(refuse("full_attention_interval", "0".into(), "at least 1"));
        }
        if let Some(types) = &self.layer_types {
            for (i, kind) in types.iter().enumerate() {
                let expected =
                    if self.is_linear(i) { "linear_attention" } else { "full_attention" };
                if kind != expected || types.len() != self.num_hidden_layers {
                    return Err(refuse(
                        "layer_types",
                        format!("{kind} at layer {i}"),
                        &format!(
                            "every full_attention_interval-th layer ({}) full attention, the \
                             others linear attention",
                            self.full_attention_interval
                        ),
                    ));
                }
            }
        }
        if self.linear_num_key_heads <= 0
            || self.linear_num_value_heads % self.linear_num_key_heads.max(1) != 0
        {
            return Err(refuse(
                "linear_num_value_heads",
                self.linear_num_value_heads.to_string(),
                &format!("a multiple of linear_num_key_heads ({})", self.linear_num_key_heads),
            ));
        }
        if self.linear_conv_kernel_dim < 1 {
            return Err(refuse(
                "linear_conv_kernel_dim",
                self.linear_conv_kernel_dim.to_string(),
                "at least 1",
            ));
        }
        if self.is_moe() {
            if self.decoder_sparse_step != 1 {
                return Err(refuse(
                    "decoder_sparse_step",
                    self.decoder_sparse_step.to_string(),
                    "1 (experts on every layer, as Qwen3.5-MoE has them)",
                ));
            }
            if !self.mlp_only_layers.is_empty() {
                return Err(refuse(
                    "mlp_only_layers",
                    format!("{:?}", self.mlp_only_layers),
                    "none (experts on every layer)",
                ));
            }
            if self.num_experts_per_tok <= 0 || self.num_experts_per_tok > self.num_experts {
                return Err(refuse(
                    "num_experts_per_tok",
                    self.num_experts_per_tok.to_string(),
                    &format!("between 1 and num_experts ({})", self.num_experts),
                ));
            }
        }
        if self.rotary_dims() % 2 != 0 || self.rotary_dims() > self.head_dim() {
            return Err(refuse(
                "partial_rotary_factor",
                self.rotary_dims().to_string(),
                "an even number of rotated dimensions within head_dim",
            ));
        }
        Ok(())
    }
}
