//! Gemma 4's vision tower and its projection into the text model. Ported from mlx-vlm 0.7.10 `models/gemma4/vision.py` and `gemma4.py`
//! (`MultimodalEmbedder`).
//!
//! Patches of 16×16 pixels are embedded with learned x/y position tables, run through
//! bidirectional encoder blocks with a 2-D rope (x rotates the first half of each head, y the
//! second, θ = 100), pooled 3×3 into soft tokens, scaled by √Hv, and projected to the text width.

use mlx::{Array, Dtype, ops};
use serde::Deserialize;

use crate::checkpoint::{Matrix, Weights};
use crate::nn::{Linear, RmsNorm};
use cache::backend::Ops;
use cache::{Error, Result};

/// `vision_config` of a `gemma4` checkpoint.
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
    /// Key/value heads.
    pub num_key_value_heads: i32,
    /// Head dimension.
    pub head_dim: i32,
    /// Patch side in pixels.
    pub patch_size: i32,
    /// Pooling kernel side.
    pub pooling_kernel_size: i32,
    /// Rows of the x and y position tables.
    pub position_embedding_size: i32,
    /// RMS norm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    /// `{"rope_theta": …}`.
    pub rope_parameters: serde_json::Value,
    /// Affine standardization of the pooled output.
    #[serde(default)]
    pub standardize: bool,
    /// Linear layers clamp their inputs and outputs to stored bounds.
    #[serde(default)]
    pub use_clipped_linears: bool,
}

fn default_eps() -> f32 {
    1e-6
}

/// A linear layer with optional input/output clamping (`ClippableLinear`).
#[derive(Debug)]
struct ClippedLinear {
    linear: Linear,
    /// (input min, input max, output min, output max).
    bounds: Option<[Array; 4]>,
}

impl ClippedLinear {
    fn load(
        w: &Weights<'_>,
        module: &str,
        rows: i32,
        cols: i32,
        clipped: bool,
    ) -> Result<ClippedLinear> {
        let linear = Linear::new(w.matrix(&format!("{module}.linear"), rows, cols)?);
        let bounds = if clipped {
            let b = |name: &str| w.get(&format!("{module}.{name}"), &[]);
            Some([b("input_min")?, b("input_max")?, b("output_min")?, b("output_max")?])
        } else {
            None
        };
        Ok(ClippedLinear { linear, bounds })
    }

    fn forward(&self, x: &Array, ops: &Ops) -> Result<Array> {
        match &self.bounds {
            Some([imin, imax, omin, omax]) => {
                let y = self.linear.forward(&x.clip(imin, imax)?, ops)?;
                Ok(y.clip(omin, omax)?)
            }
            None => self.linear.forward(x, ops),
        }
    }
}

#[derive(Debug)]
struct Block {
    q_proj: ClippedLinear,
    k_proj: ClippedLinear,
    v_proj: ClippedLinear,
    o_proj: ClippedLinear,
    q_norm: Array,
    k_norm: Array,
    gate_proj: ClippedLinear,
    up_proj: ClippedLinear,
    down_proj: ClippedLinear,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

/// The vision tower plus `embed_vision`.
#[derive(Debug)]
pub struct Gemma4Vision {
    config: VisionConfig,
    input_proj: Linear,
    position_table: Array,
    blocks: Vec<Block>,
    standardize: Option<(Array, Array)>,
    projection: Linear,
    projection_norm: RmsNorm,
    theta: f32,
    ops: Ops,
}

impl Gemma4Vision {
    /// Loads `vision_tower.*` and `embed_vision.*` from `root` (weights at the checkpoint's top
    /// level), projecting to `text_hidden` features.
    pub fn load(
        root: &Weights<'_>,
        config: VisionConfig,
        text_hidden: i32,
        ops: &Ops,
    ) -> Result<Gemma4Vision> {
        let c = &config;
        let hv = c.hidden_size;
        let patch_dim = 3 * c.patch_size * c.patch_size;
        let clipped = c.use_clipped_linears;
        let input_proj =
            Linear::new(root.matrix("vision_tower.patch_embedder.input_proj", hv, patch_dim)?);
        let position_table = root.get(
            "vision_tower.patch_embedder.position_embedding_table",
            &[2, c.position_embedding_size, hv],
        )?;
        let mut blocks = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("vision_tower.encoder.layers.{i}.");
            let a = format!("{p}self_attn.");
            let (q, kv) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
            let norm = |name: &str| -> Result<RmsNorm> {
                Ok(RmsNorm::new(root.get(&format!("{p}{name}.weight"), &[hv])?, c.rms_norm_eps))
            };
            blocks.push(Block {
                q_proj: ClippedLinear::load(root, &format!("{a}q_proj"), q, hv, clipped)?,
                k_proj: ClippedLinear::load(root, &format!("{a}k_proj"), kv, hv, clipped)?,
                v_proj: ClippedLinear::load(root, &format!("{a}v_proj"), kv, hv, clipped)?,
                o_proj: ClippedLinear::load(root, &format!("{a}o_proj"), hv, q, clipped)?,
                q_norm: root.get(&format!("{a}q_norm.weight"), &[c.head_dim])?,
                k_norm: root.get(&format!("{a}k_norm.weight"), &[c.head_dim])?,
                gate_proj: ClippedLinear::load(
                    root,
                    &format!("{p}mlp.gate_proj"),
                    c.intermediate_size,
                    hv,
                    clipped,
                )?,
                up_proj: ClippedLinear::load(
                    root,
                    &format!("{p}mlp.up_proj"),
                    c.intermediate_size,
                    hv,
                    clipped,
                )?,
                down_proj: ClippedLinear::load(
                    root,
                    &format!("{p}mlp.down_proj"),
                    hv,
                    c.intermediate_size,
                    clipped,
                )?,
                input_layernorm: norm("input_layernorm")?,
                post_attention_layernorm: norm("post_attention_layernorm")?,
                pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
                post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            });
        }
        let standardize = if c.standardize {
            Some((
                root.get("vision_tower.std_bias", &[hv])?,
                root.get("vision_tower.std_scale", &[hv])?,
            ))
        } else {
            None
        };
        let projection = Linear::new(
            match root.matrix("embed_vision.embedding_projection", text_hidden, hv)? {
                Matrix::Dense(w) => Matrix::Dense(w),
                q => q,
            },
        );
        let theta =
            c.rope_parameters.get("rope_theta").and_then(serde_json::Value::as_f64).ok_or_else(
                || Error::Config {
                    file: "config.json".into(),
                    message: "missing key `vision_config.rope_parameters.rope_theta`".into(),
                },
            )? as f32;
        Ok(Gemma4Vision {
            projection_norm: RmsNorm::unscaled(c.rms_norm_eps),
            config,
            input_proj,
            position_table,
            blocks,
            standardize,
            projection,
            theta,
            ops: ops.clone(),
        })
    }

    /// Features `[n_soft, text_hidden]` for one image's pixels `[3, H, W]` in [0, 1]
    /// (H and W multiples of patch × pool).
    pub fn encode(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let s = pixels.shape();
        let (p, k) = (c.patch_size, c.pooling_kernel_size);
        if s.len() != 3 || s[0] != 3 || s[1] % (p * k) != 0 || s[2] % (p * k) != 0 {
            return Err(Error::InvalidRequest(format!(
                "vision input must be [3, H, W] in multiples of {}, got {s:?}",
                p * k
            )));
        }
        let (ph, pw) = (s[1] / p, s[2] / p);
        let n = ph * pw;
        let dtype = self.position_table.dtype();
        // Patchify: [1, C, pH, p, pW, p] → [1, pH, pW, p, p, C] → [1, n, p·p·C].
        let patches = pixels
            .reshape(&[1, 3, ph, p, pw, p])?
            .transpose(&[0, 2, 4, 3, 5, 1])?
            .reshape(&[1, n, 3 * p * p])?;
        let patches =
            patches.subtract(&Array::scalar(0.5f32)?)?.multiply(&Array::scalar(2.0f32)?)?;
        let ops = &self.ops;
        let mut h = self.input_proj.forward(&patches.astype(dtype)?, ops)?;
        // Positions: x = column, y = row, row-major.
        let xs: Vec<i32> = (0..n).map(|i| i % pw).collect();
        let ys: Vec<i32> = (0..n).map(|i| i / pw).collect();
        let (xs, ys) = (Array::from_slice(&xs, &[n])?, Array::from_slice(&ys, &[n])?);
        let table_x = self
            .position_table
            .slice(&[0, 0, 0], &[1, c.position_embedding_size, c.hidden_size], &[1, 1, 1])?
            .squeeze(&[0])?;
        let table_y = self
            .position_table
            .slice(&[1, 0, 0], &[2, c.position_embedding_size, c.hidden_size], &[1, 1, 1])?
            .squeeze(&[0])?;
        let position = lookup(&table_x, &xs, c.position_embedding_size)?.add(&lookup(
            &table_y,
            &ys,
            c.position_embedding_size,
        )?)?;
        h = h.add(&position.expand_dims(&[0])?)?;
        let (cos_x, sin_x, cos_y, sin_y) = self.rope_tables(&xs, &ys, dtype)?;
        for block in &self.blocks {
            let normed = block.input_layernorm.forward(&h)?;
            let attn = self.attention(block, &normed, n, [&cos_x, &sin_x, &cos_y, &sin_y])?;
            h = h.add(&block.post_attention_layernorm.forward(&attn)?)?;
            let x = block.pre_feedforward_layernorm.forward(&h)?;
            let gate = block.gate_proj.forward(&x, ops)?.gelu_approx()?;
            let up = block.up_proj.forward(&x, ops)?;
            let ff = block.down_proj.forward(&gate.multiply(&up)?, ops)?;
            h = h.add(&block.post_feedforward_layernorm.forward(&ff)?)?;
        }
        // 3×3 average pooling as a one-hot matmul (the reference's arithmetic), then × √Hv.
        let (kx, ky) = (pw / k, ph / k);
        let length = kx * ky;
        let kernel: Vec<i32> = (0..n).map(|i| (i % pw) / k + kx * ((i / pw) / k)).collect();
        let kernel = Array::from_slice(&kernel, &[1, n, 1])?;
        let slots =
            ops::arange(0.0, f64::from(length), 1.0, Dtype::Int32)?.reshape(&[1, 1, length])?;
        let weights =
            kernel.eq(&slots)?.astype(Dtype::Float32)?.divide(&Array::scalar((k * k) as f32)?)?;
        let pooled = ops::einsum("bLl,bLd->bld", &[&weights, &h])?.astype(h.dtype())?;
        let mut pooled = pooled.multiply(&pooled.scalar_like(f64::from(c.hidden_size).sqrt())?)?;
        if let Some((bias, scale)) = &self.standardize {
            pooled = pooled.subtract(bias)?.multiply(scale)?;
        }
        let projected = self.projection.forward(&self.projection_norm.forward(&pooled)?, ops)?;
        Ok(projected.squeeze(&[0])?)
    }

    /// cos/sin `[1, n, 1, D/2]` for the x and y halves of each head.
    fn rope_tables(
        &self,
        xs: &Array,
        ys: &Array,
        dtype: Dtype,
    ) -> Result<(Array, Array, Array, Array)> {
        let channels = 2 * (self.config.head_dim / 4);
        let half = channels / 2;
        let exponents = ops::arange(0.0, f64::from(half), 1.0, Dtype::Float32)?
            .multiply(&Array::scalar(2.0f32 / channels as f32)?)?;
        let timescale = Array::scalar(self.theta)?.power(&exponents)?;
        let table = |pos: &Array| -> Result<(Array, Array)> {
            let angles = pos.astype(Dtype::Float32)?.reshape(&[-1, 1])?.divide(&timescale)?;
            let (cos, sin) = (angles.cos()?, angles.sin()?);
            let dup = |t: &Array| -> Result<Array> {
                Ok(ops::concatenate(&[t, t], -1)?.astype(dtype)?.expand_dims(&[0, 2])?)
            };
            Ok((dup(&cos)?, dup(&sin)?))
        };
        let (cx, sx) = table(xs)?;
        let (cy, sy) = table(ys)?;
        Ok((cx, sx, cy, sy))
    }

    fn attention(&self, block: &Block, x: &Array, n: i32, rope: [&Array; 4]) -> Result<Array> {
        let c = &self.config;
        let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let ops = &self.ops;
        let q = block.q_proj.forward(x, ops)?.reshape(&[1, n, heads, d])?;
        let k = block.k_proj.forward(x, ops)?.reshape(&[1, n, kv_heads, d])?;
        let v = block.v_proj.forward(x, ops)?.reshape(&[1, n, kv_heads, d])?;
        let q = rope_2d(&f32_norm(&q, Some(&block.q_norm), c.rms_norm_eps)?, rope)?
            .transpose(&[0, 2, 1, 3])?;
        let k = rope_2d(&f32_norm(&k, Some(&block.k_norm), c.rms_norm_eps)?, rope)?
            .transpose(&[0, 2, 1, 3])?;
        let v = f32_norm(&v, None, c.rms_norm_eps)?.transpose(&[0, 2, 1, 3])?;
        // Every patch of the image sees every other: no mask.
        let out = mlx::fast::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            1.0,
            mlx::fast::AttentionMask::None,
            None,
        )?;
        let out = out.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, heads * d])?;
        block.o_proj.forward(&out, ops)
    }
}

/// Rows of a position table; positions past its end contribute zero, as the reference's
/// one-hot product gives (without materializing the one-hot matrix).
fn lookup(table: &Array, positions: &Array, size: i32) -> Result<Array> {
    let last = Array::scalar(size - 1)?;
    let clamped = positions.minimum(&last)?;
    let rows = table.take(&clamped, 0)?;
    let inside = positions.lt(&Array::scalar(size)?)?.expand_dims(&[1])?;
    Ok(ops::where_(&inside, &rows, &rows.scalar_like(0.0)?)?)
}

/// RMS norm computed in f32 (`VisionRMSNorm`): `x · rsqrt(mean(x²) + eps) · weight`.
fn f32_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let xf = x.astype(Dtype::Float32)?;
    let var = xf.power(&Array::scalar(2.0f32)?)?.mean(&[-1], true)?;
    let mut normed = xf.multiply(&var.add(&Array::scalar(eps)?)?.rsqrt()?)?;
    if let Some(w) = weight {
        normed = normed.multiply(&w.astype(Dtype::Float32)?)?;
    }
    Ok(normed.astype(x.dtype())?)
}

/// The 2-D rope: the first half of each head rotates by x, the second by y, each with
/// rotate-half inside its own half. `x` is `[1, n, H, D]`.
fn rope_2d(x: &Array, [cos_x, sin_x, cos_y, sin_y]: [&Array; 4]) -> Result<Array> {
    let s = x.shape();
    let d = s[3];
    let channels = 2 * (d / 4);
    let part =
        |from: i32, to: i32| x.slice(&[0, 0, 0, from], &[s[0], s[1], s[2], to], &[1, 1, 1, 1]);
    let rotate = |p: &Array, cos: &Array, sin: &Array| -> Result<Array> {
        let half = p.dim(-1)? / 2;
        let ps = p.shape();
        let x1 = p.slice(&[0, 0, 0, 0], &[ps[0], ps[1], ps[2], half], &[1, 1, 1, 1])?;
        let x2 = p.slice(&[0, 0, 0, half], &[ps[0], ps[1], ps[2], 2 * half], &[1, 1, 1, 1])?;
        let rotated = ops::concatenate(&[&x2.negative()?, &x1], -1)?;
        Ok(p.multiply(cos)?.add(&rotated.multiply(sin)?)?)
    };
    let xpart = rotate(&part(0, channels)?, cos_x, sin_x)?;
    let ypart = rotate(&part(channels, 2 * channels)?, cos_y, sin_y)?;
    Ok(ops::concatenate(&[&xpart, &ypart], -1)?)
}
