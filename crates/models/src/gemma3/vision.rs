//! Gemma 3's vision tower (SigLIP) and its multimodal projector. Ported from mlx-vlm 0.7.10
//! `models/gemma3/vision.py` and `gemma3.py` (`Gemma3MultiModalProjector`).
//!
//! The image, `image_size` square, is cut into patches embedded by a linear map (the patch
//! convolution's weight, flattened) plus a learned position per patch, run through pre-norm
//! encoder blocks (LayerNorm, bidirectional attention with biases, a tanh-GELU MLP), normed,
//! average-pooled to `mm_tokens_per_image` soft tokens, normed again (`1 + w`) and projected to
//! the text width.

use mlx::Array;
use serde::Deserialize;

use crate::checkpoint::{Matrix, Weights};
use crate::nn::LayerNorm;
use cache::{Error, Result};

/// `vision_config` of a `gemma3` checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    /// Encoder width Hv.
    pub hidden_size: i32,
    /// MLP width.
    pub intermediate_size: i32,
    /// Encoder blocks.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: i32,
    /// Patch side in pixels.
    pub patch_size: i32,
    /// Side of the square the image is resized to.
    #[serde(default = "default_image_size")]
    pub image_size: i32,
    /// LayerNorm epsilon of the encoder (and of the projector's norm).
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
}

fn default_image_size() -> i32 {
    224
}

fn default_eps() -> f32 {
    1e-6
}

/// mlx-vlm's `post_layernorm` is an `nn.LayerNorm` with MLX's default epsilon.
const POST_LAYERNORM_EPS: f32 = 1e-5;

/// A float linear map with a bias (the tower is never quantized).
#[derive(Debug)]
struct Affine {
    /// `[in, out]`.
    weight_t: Array,
    bias: Array,
}

impl Affine {
    fn load(w: &Weights<'_>, module: &str, rows: i32, cols: i32) -> Result<Affine> {
        let weight = match w.matrix(module, rows, cols)? {
            Matrix::Dense(weight) => weight,
            Matrix::Quantized(_) => {
                return Err(Error::Config {
                    file: "model.safetensors".into(),
                    message: format!("{module}: a quantized vision tower is not supported"),
                });
            }
        };
        Ok(Affine {
            weight_t: weight.transpose(&[])?,
            bias: w.get(&format!("{module}.bias"), &[rows])?,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        Ok(mlx::ops::addmm(&self.bias, x, &self.weight_t, 1.0, 1.0)?)
    }
}

#[derive(Debug)]
struct Block {
    layer_norm1: LayerNorm,
    q_proj: Affine,
    k_proj: Affine,
    v_proj: Affine,
    out_proj: Affine,
    layer_norm2: LayerNorm,
    fc1: Affine,
    fc2: Affine,
}

/// The tower and the projector.
#[derive(Debug)]
pub struct Gemma3Vision {
    config: VisionConfig,
    /// The patch convolution as a map of flattened patches (row, column, channel): `[P·P·3, Hv]`.
    patch_t: Array,
    patch_bias: Array,
    /// `[patches, Hv]`.
    positions: Array,
    blocks: Vec<Block>,
    post_layernorm: LayerNorm,
    /// `mm_soft_emb_norm` with its 1 added.
    soft_norm: Array,
    /// `mm_input_projection_weight` `[Hv, H]`.
    projection: Array,
    /// Soft tokens per image.
    tokens: i32,
}

impl Gemma3Vision {
    /// Loads the tower (`vision_tower.vision_model.*`) and the projector
    /// (`multi_modal_projector.*`) from the root of a checkpoint's weights, for a text model of
    /// width `text_hidden` and `tokens` soft tokens per image.
    pub fn load(
        w: &Weights<'_>,
        config: VisionConfig,
        text_hidden: i32,
        tokens: i32,
    ) -> Result<Gemma3Vision> {
        let c = &config;
        let (hv, p) = (c.hidden_size, c.patch_size);
        let side = c.image_size / p;
        let pooled = (f64::from(tokens).sqrt()) as i32;
        if c.image_size % p != 0 || pooled * pooled != tokens || side % pooled != 0 {
            return Err(Error::Config {
                file: "config.json".into(),
                message: format!(
                    "vision: {tokens} soft tokens do not pool a {side}×{side} patch grid \
                     (image_size {}, patch_size {p})",
                    c.image_size
                ),
            });
        }
        let t = "vision_tower.vision_model.";
        let conv_name = format!("{t}embeddings.patch_embedding.weight");
        let conv = w.tensor(&conv_name)?;
        // MLX stores the convolution OHWI ([Hv, P, P, 3]); Hugging Face OIHW ([Hv, 3, P, P]).
        let conv = match conv.shape().as_slice() {
            [o, a, b, 3] if *o == hv && *a == p && *b == p => conv,
            [o, 3, a, b] if *o == hv && *a == p && *b == p => conv.transpose(&[0, 2, 3, 1])?,
            other => {
                return Err(Error::Config {
                    file: "model.safetensors".into(),
                    message: format!("{conv_name} has shape {other:?}, not [{hv}, {p}, {p}, 3]"),
                });
            }
        };
        let patch_t = conv.reshape(&[hv, p * p * 3])?.transpose(&[])?;
        let patch_bias = w.get(&format!("{t}embeddings.patch_embedding.bias"), &[hv])?;
        let positions =
            w.get(&format!("{t}embeddings.position_embedding.weight"), &[side * side, hv])?;
        let eps = c.layer_norm_eps;
        let blocks = (0..c.num_hidden_layers)
            .map(|i| {
                let b = format!("{t}encoder.layers.{i}.");
                let affine =
                    |name: &str, rows, cols| Affine::load(w, &format!("{b}{name}"), rows, cols);
                Ok(Block {
                    layer_norm1: LayerNorm::load(w, &format!("{b}layer_norm1"), hv, eps)?,
                    q_proj: affine("self_attn.q_proj", hv, hv)?,
                    k_proj: affine("self_attn.k_proj", hv, hv)?,
                    v_proj: affine("self_attn.v_proj", hv, hv)?,
                    out_proj: affine("self_attn.out_proj", hv, hv)?,
                    layer_norm2: LayerNorm::load(w, &format!("{b}layer_norm2"), hv, eps)?,
                    fc1: affine("mlp.fc1", c.intermediate_size, hv)?,
                    fc2: affine("mlp.fc2", hv, c.intermediate_size)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let post_layernorm =
            LayerNorm::load(w, &format!("{t}post_layernorm"), hv, POST_LAYERNORM_EPS)?;
        let m = "multi_modal_projector.";
        let soft_norm = w.get(&format!("{m}mm_soft_emb_norm.weight"), &[hv])?.add_scalar(1.0)?;
        let projection = w.get(&format!("{m}mm_input_projection_weight"), &[hv, text_hidden])?;
        Ok(Gemma3Vision {
            config,
            patch_t,
            patch_bias,
            positions,
            blocks,
            post_layernorm,
            soft_norm,
            projection,
            tokens,
        })
    }

    /// Side of the square the image is resized to.
    pub fn image_size(&self) -> u32 {
        self.config.image_size as u32
    }

    /// Soft tokens per image.
    pub fn tokens(&self) -> usize {
        self.tokens as usize
    }

    /// The encoder's output after `post_layernorm`, `[1, patches, Hv]`, for pixels
    /// `[3, S, S]` in [0, 1].
    pub fn tower(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let (p, size) = (c.patch_size, c.image_size);
        if pixels.shape() != [3, size, size] {
            return Err(Error::InvalidRequest(format!(
                "vision input must be [3, {size}, {size}], got {:?}",
                pixels.shape()
            )));
        }
        let side = size / p;
        let n = side * side;
        let dtype = self.positions.dtype();
        // [3, S, S] → [1, side, P, side, P, 3] → [1, n, P·P·3], values 2x − 1.
        let patches = pixels
            .reshape(&[1, 3, side, p, side, p])?
            .transpose(&[0, 2, 4, 3, 5, 1])?
            .reshape(&[1, n, p * p * 3])?;
        let patches =
            patches.subtract(&Array::scalar(0.5f32)?)?.multiply(&Array::scalar(2.0f32)?)?;
        let embedded =
            mlx::ops::addmm(&self.patch_bias, &patches.astype(dtype)?, &self.patch_t, 1.0, 1.0)?;
        let mut h = embedded.add(&self.positions.expand_dims(&[0])?)?;
        let heads = c.num_attention_heads;
        let d = c.hidden_size / heads;
        let scale = (f64::from(d)).powf(-0.5) as f32;
        let split = |x: Array| -> Result<Array> {
            Ok(x.reshape(&[1, n, heads, d])?.transpose(&[0, 2, 1, 3])?)
        };
        for block in &self.blocks {
            let x = block.layer_norm1.forward(&h)?;
            let q = split(block.q_proj.forward(&x)?)?;
            let k = split(block.k_proj.forward(&x)?)?;
            let v = split(block.v_proj.forward(&x)?)?;
            // Every patch sees every other: no mask.
            let attn = mlx::fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                scale,
                mlx::fast::AttentionMask::None,
                None,
            )?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[1, n, c.hidden_size])?;
            h = h.add(&block.out_proj.forward(&attn)?)?;
            let x = block.layer_norm2.forward(&h)?;
            h = h.add(&block.fc2.forward(&block.fc1.forward(&x)?.gelu_approx()?)?)?;
        }
        self.post_layernorm.forward(&h)
    }

    /// Soft-token features `[tokens, H]` of pixels `[3, S, S]` in [0, 1].
    pub fn encode(&self, pixels: &Array) -> Result<Array> {
        let h = self.tower(pixels)?;
        let hv = self.config.hidden_size;
        let side = self.config.image_size / self.config.patch_size;
        let pooled = (f64::from(self.tokens).sqrt()) as i32;
        let k = side / pooled;
        // Average pooling k×k over the row-major patch grid, as MLX's AvgPool2d computes it.
        let pooled_grid = h
            .reshape(&[1, pooled, k, pooled, k, hv])?
            .transpose(&[0, 1, 3, 2, 4, 5])?
            .mean(&[3, 4], false)?
            .reshape(&[1, self.tokens, hv])?;
        let normed =
            mlx::fast::rms_norm(&pooled_grid, Some(&self.soft_norm), self.config.layer_norm_eps)?;
        let projected = normed.matmul(&self.projection)?.astype(h.dtype())?;
        Ok(projected.squeeze(&[0])?)
    }
}
