//! Qwen3.5's vision tower: Qwen3-VL's encoder without its deepstack taps, as mlx-vlm 0.7.10
//! runs it (`models/qwen3_vl/vision.py`, which `models/qwen3_5/vision.py` reuses).
//!
//! An image arrives as rows of flattened patches (`[C, T, P, P]` each, the still image
//! repeated over the `T` temporal frames), in merge order: each 2×2 block of neighbouring
//! patches is consecutive. The patch convolution is a linear map of those rows; a learned
//! position table (a square grid) is bilinearly interpolated to the image's grid and added;
//! pre-norm blocks (LayerNorm, attention over every patch with a 2-D rotary embedding of the
//! patch's row and column, a tanh-GELU MLP) follow; the merger norms each patch, joins each
//! 2×2 block into one row and maps it through a GELU MLP to the text width: one soft token per
//! block.

use mlx::{Array, Dtype};
use serde::Deserialize;

use crate::checkpoint::Weights;
use crate::nn::{Embedding, LayerNorm, Linear, rotate_half};
use cache::backend::Ops;
use cache::{Error, Result};

/// `vision_config` of a `qwen3_5` checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct VisionConfig {
    /// Encoder blocks.
    pub depth: usize,
    /// Encoder width.
    pub hidden_size: i32,
    /// MLP width.
    pub intermediate_size: i32,
    /// The text width soft tokens are mapped to.
    pub out_hidden_size: i32,
    /// Attention heads.
    pub num_heads: i32,
    /// Patch side in pixels.
    #[serde(default = "default_patch")]
    pub patch_size: i32,
    /// Side of the block of patches merged into one soft token.
    #[serde(default = "default_merge")]
    pub spatial_merge_size: i32,
    /// Frames per patch (a still image is repeated over them).
    #[serde(default = "default_temporal")]
    pub temporal_patch_size: i32,
    /// Rows of the learned position table (a square grid).
    pub num_position_embeddings: i32,
    /// Colour channels.
    #[serde(default = "default_channels")]
    pub in_channels: i32,
    /// Blocks whose output feeds the decoder's early layers (Qwen3-VL); Qwen3.5 has none.
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<usize>,
}

fn default_patch() -> i32 {
    16
}

fn default_merge() -> i32 {
    2
}

fn default_temporal() -> i32 {
    2
}

fn default_channels() -> i32 {
    3
}

/// LayerNorm epsilon of every norm in the tower (fixed in mlx-vlm).
const EPS: f32 = 1e-6;

/// A linear map with a bias.
#[derive(Debug)]
struct Affine {
    linear: Linear,
    bias: Array,
}

impl Affine {
    fn load(w: &Weights<'_>, module: &str, rows: i32, cols: i32) -> Result<Affine> {
        Ok(Affine {
            linear: Linear::new(w.matrix(module, rows, cols)?),
            bias: w.get(&format!("{module}.bias"), &[rows])?,
        })
    }

    fn forward(&self, x: &Array, ops: &Ops) -> Result<Array> {
        Ok(self.linear.forward(x, ops)?.add(&self.bias)?)
    }
}

#[derive(Debug)]
struct Block {
    norm1: LayerNorm,
    qkv: Affine,
    proj: Affine,
    norm2: LayerNorm,
    fc1: Affine,
    fc2: Affine,
}

/// The tower and its merger.
#[derive(Debug)]
pub struct QwenVision {
    config: VisionConfig,
    /// The patch convolution as a map of flattened patch rows (`C, T, P, P` order):
    /// `[C·T·P·P, hidden]`.
    patch_t: Array,
    patch_bias: Array,
    positions: Embedding,
    /// Side of the position table's grid.
    side: i32,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Affine,
    merger_fc2: Affine,
    ops: Ops,
}

impl QwenVision {
    /// Loads the tower from `w` (prefix `vision_tower.` in mlx-vlm's layout, `model.visual.`
    /// in Hugging Face's).
    pub fn load(
        w: &Weights<'_>,
        config: VisionConfig,
        text_hidden: i32,
        ops: &Ops,
    ) -> Result<Self> {
        let c = &config;
        let bad = |message: String| Error::Config { file: "config.json".into(), message };
        if !c.deepstack_visual_indexes.is_empty() {
            return Err(Error::Unsupported {
                key: "vision_config.deepstack_visual_indexes".into(),
                value: format!("{:?}", c.deepstack_visual_indexes),
                reason: "none (Qwen3.5's tower has no deepstack taps)".into(),
            });
        }
        if c.out_hidden_size != text_hidden {
            return Err(bad(format!(
                "vision_config.out_hidden_size {} is not the text width {text_hidden}",
                c.out_hidden_size
            )));
        }
        let side = (f64::from(c.num_position_embeddings).sqrt()) as i32;
        if side * side != c.num_position_embeddings || c.hidden_size % c.num_heads != 0 {
            return Err(bad(format!(
                "vision_config: {} position embeddings are not a square grid, or {} heads do \
                 not divide width {}",
                c.num_position_embeddings, c.num_heads, c.hidden_size
            )));
        }
        let (hv, p, t, ch) = (c.hidden_size, c.patch_size, c.temporal_patch_size, c.in_channels);
        let name = "patch_embed.proj.weight";
        let conv = w.tensor(name)?;
        // mlx-vlm stores the 3-D convolution [hv, T, P, P, C]; Hugging Face [hv, C, T, P, P].
        let conv = match conv.shape().as_slice() {
            [o, a, b, d, e] if *o == hv && *a == t && *b == p && *d == p && *e == ch => {
                conv.transpose(&[0, 4, 1, 2, 3])?
            }
            [o, e, a, b, d] if *o == hv && *e == ch && *a == t && *b == p && *d == p => conv,
            other => {
                return Err(bad(format!(
                    "vision_tower.{name} has shape {other:?}, not [{hv}, {t}, {p}, {p}, {ch}]"
                )));
            }
        };
        let patch_t = conv.reshape(&[hv, ch * t * p * p])?.transpose(&[])?;
        let patch_bias = w.get("patch_embed.proj.bias", &[hv])?;
        let positions = Embedding::new(w.matrix("pos_embed", c.num_position_embeddings, hv)?);
        let blocks = (0..c.depth)
            .map(|i| {
                let b = format!("blocks.{i}.");
                let affine =
                    |name: &str, rows, cols| Affine::load(w, &format!("{b}{name}"), rows, cols);
                Ok(Block {
                    norm1: LayerNorm::load(w, &format!("{b}norm1"), hv, EPS)?,
                    qkv: affine("attn.qkv", 3 * hv, hv)?,
                    proj: affine("attn.proj", hv, hv)?,
                    norm2: LayerNorm::load(w, &format!("{b}norm2"), hv, EPS)?,
                    fc1: affine("mlp.linear_fc1", c.intermediate_size, hv)?,
                    fc2: affine("mlp.linear_fc2", hv, c.intermediate_size)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = hv * c.spatial_merge_size * c.spatial_merge_size;
        Ok(QwenVision {
            merger_norm: LayerNorm::load(w, "merger.norm", hv, EPS)?,
            merger_fc1: Affine::load(w, "merger.linear_fc1", merged, merged)?,
            merger_fc2: Affine::load(w, "merger.linear_fc2", c.out_hidden_size, merged)?,
            patch_t,
            patch_bias,
            positions,
            side,
            blocks,
            config,
            ops: ops.clone(),
        })
    }

    /// The tower's config.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Rows of flattened patches `[gh·gw, C·T·P·P]` (merge order) of normalized pixels
    /// `[C, H, W]` whose sides are multiples of the patch side times the merge size, as the
    /// reference processor lays them out.
    pub fn patches(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let (p, m, t) = (c.patch_size, c.spatial_merge_size, c.temporal_patch_size);
        let s = pixels.shape();
        if s.len() != 3 || s[0] != c.in_channels || s[1] % (p * m) != 0 || s[2] % (p * m) != 0 {
            return Err(Error::InvalidRequest(format!(
                "vision input must be [{}, H, W] with sides multiples of {}, got {s:?}",
                c.in_channels,
                p * m
            )));
        }
        let (gh, gw) = (s[1] / p, s[2] / p);
        // [C, gh/m, m, P, gw/m, m, P] → [gh/m, gw/m, m, m, C, P, P], then T copies of each
        // patch (the processor's temporal axis sits between C and the patch's pixels).
        let blocks = pixels
            .reshape(&[c.in_channels, gh / m, m, p, gw / m, m, p])?
            .transpose(&[1, 4, 2, 5, 0, 3, 6])?
            .reshape(&[gh * gw, c.in_channels, 1, p * p])?;
        let repeated = blocks.broadcast_to(&[gh * gw, c.in_channels, t, p * p])?;
        Ok(repeated.reshape(&[gh * gw, c.in_channels * t * p * p])?)
    }

    /// Soft-token features `[gh/m, gw/m, out_hidden]` (one per merged block, on the block
    /// grid) of normalized pixels `[C, H, W]`.
    pub fn encode(&self, pixels: &Array) -> Result<Array> {
        let c = &self.config;
        let (p, m) = (c.patch_size, c.spatial_merge_size);
        let rows = self.patches(pixels)?;
        let s = pixels.shape();
        let (gh, gw) = (s[1] / p, s[2] / p);
        let n = gh * gw;
        let dtype = self.patch_bias.dtype();
        let embedded =
            mlx::ops::addmm(&self.patch_bias, &rows.astype(dtype)?, &self.patch_t, 1.0, 1.0)?;
        let mut h = embedded.add(&self.interpolated_positions(gh, gw)?)?;
        let heads = c.num_heads;
        let d = c.hidden_size / heads;
        let (cos, sin) = self.rotary(gh, gw)?;
        let scale = (f64::from(d)).powf(-0.5) as f32;
        for block in &self.blocks {
            let x = block.norm1.forward(&h)?;
            // [n, 3, heads, d] → q, k, v each [1, heads, n, d].
            let qkv = block.qkv.forward(&x, &self.ops)?.reshape(&[n, 3, heads, d])?;
            let part = |i: i32| -> Result<Array> {
                Ok(qkv
                    .slice(&[0, i, 0, 0], &[n, i + 1, heads, d], &[1; 4])?
                    .reshape(&[1, n, heads, d])?)
            };
            let rotate = |x: Array| -> Result<Array> {
                let rotated =
                    x.multiply(&cos)?.add(&rotate_half(&x)?.multiply(&sin)?)?.astype(x.dtype())?;
                Ok(rotated.transpose(&[0, 2, 1, 3])?)
            };
            let q = rotate(part(0)?)?;
            let k = rotate(part(1)?)?;
            let v = part(2)?.transpose(&[0, 2, 1, 3])?;
            let attn = mlx::fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                scale,
                mlx::fast::AttentionMask::None,
                None,
            )?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[n, c.hidden_size])?;
            h = h.add(&block.proj.forward(&attn, &self.ops)?)?;
            let x = block.norm2.forward(&h)?;
            let inner = block.fc1.forward(&x, &self.ops)?.gelu_approx()?;
            h = h.add(&block.fc2.forward(&inner, &self.ops)?)?;
        }
        let merged = self.merger_norm.forward(&h)?.reshape(&[n / (m * m), -1])?;
        let inner = gelu(&self.merger_fc1.forward(&merged, &self.ops)?)?;
        let out = self.merger_fc2.forward(&inner, &self.ops)?;
        Ok(out.reshape(&[gh / m, gw / m, c.out_hidden_size])?)
    }

    /// The position table interpolated bilinearly to a `gh × gw` grid (mlx-vlm's
    /// `fast_pos_embed_interpolate`), in merge order: `[gh·gw, hidden]`.
    fn interpolated_positions(&self, gh: i32, gw: i32) -> Result<Array> {
        let side = self.side;
        let m = self.config.spatial_merge_size;
        // MLX's linspace(0, side − 1, n): (i / (n − 1)) · (side − 1) in f32.
        let axis = |n: i32| -> Vec<(i32, i32, f32)> {
            (0..n)
                .map(|i| {
                    let x =
                        if n == 1 { 0.0 } else { (i as f32 / (n - 1) as f32) * (side - 1) as f32 };
                    let lo = x as i32;
                    let hi = (lo + 1).min(side - 1);
                    (lo, hi, x - lo as f32)
                })
                .collect()
        };
        let (hs, ws) = (axis(gh), axis(gw));
        let count = (gh * gw) as usize;
        let mut ids: [Vec<i32>; 4] = Default::default();
        let mut weights: [Vec<f32>; 4] = Default::default();
        for &(h0, h1, dh) in &hs {
            for &(w0, w1, dw) in &ws {
                let corners = [
                    (h0, w0, (1.0 - dh) * (1.0 - dw)),
                    (h0, w1, (1.0 - dh) * dw),
                    (h1, w0, dh * (1.0 - dw)),
                    (h1, w1, dh * dw),
                ];
                for (k, (r, col, weight)) in corners.into_iter().enumerate() {
                    ids[k].push(r * side + col);
                    weights[k].push(weight);
                }
            }
        }
        let ids: Vec<i32> = ids.concat();
        let table = self.positions.forward(&Array::from_slice(&ids, &[4, count as i32])?)?;
        let weights =
            Array::from_slice(&weights.concat(), &[4, count as i32, 1])?.astype(table.dtype())?;
        let weighted = table.multiply(&weights)?;
        let corner = |k: i32| -> Result<Array> {
            let hidden = weighted.dim(-1)?;
            Ok(weighted
                .slice(&[k, 0, 0], &[k + 1, count as i32, hidden], &[1, 1, 1])?
                .squeeze(&[0])?)
        };
        let sum = corner(0)?.add(&corner(1)?)?.add(&corner(2)?)?.add(&corner(3)?)?;
        let hidden = sum.dim(-1)?;
        Ok(sum
            .reshape(&[gh / m, m, gw / m, m, hidden])?
            .transpose(&[0, 2, 1, 3, 4])?
            .reshape(&[gh * gw, hidden])?)
    }

    /// Cosines and sines `[1, n, 1, d]` of each patch's rotary angles: its row's angles, then
    /// its column's, over half the head width, repeated twice.
    fn rotary(&self, gh: i32, gw: i32) -> Result<(Array, Array)> {
        let m = self.config.spatial_merge_size;
        let d = self.config.hidden_size / self.config.num_heads;
        let dim = d / 2;
        // 1 / 10000^(arange(0, dim, 2) / dim), as mlx-vlm's VisionRotaryEmbedding.
        let exponents = mlx::ops::arange(0.0, f64::from(dim), 2.0, Dtype::Float32)?
            .divide(&Array::scalar(dim as f32)?)?;
        let inv_freq = Array::scalar(10000.0f32)?.power(&exponents)?.reciprocal()?;
        let longest = gh.max(gw);
        let seq = mlx::ops::arange(0.0, f64::from(longest), 1.0, Dtype::Float32)?;
        let table = seq.reshape(&[longest, 1])?.multiply(&inv_freq.reshape(&[1, -1])?)?;
        let mut rows = Vec::with_capacity((gh * gw) as usize);
        let mut cols = Vec::with_capacity((gh * gw) as usize);
        for br in 0..gh / m {
            for bc in 0..gw / m {
                for ir in 0..m {
                    for ic in 0..m {
                        rows.push(br * m + ir);
                        cols.push(bc * m + ic);
                    }
                }
            }
        }
        let n = gh * gw;
        let take =
            |ids: &[i32]| -> Result<Array> { Ok(table.take(&Array::from_slice(ids, &[n])?, 0)?) };
        let angles = mlx::ops::concatenate(&[&take(&rows)?, &take(&cols)?], -1)?;
        let doubled = mlx::ops::concatenate(&[&angles, &angles], -1)?.reshape(&[1, n, 1, d])?;
        Ok((doubled.cos()?, doubled.sin()?))
    }
}

/// GELU with the exact error function, as `mlx.nn.gelu`: `x · (1 + erf(x / √2)) / 2`.
fn gelu(x: &Array) -> Result<Array> {
    let inner = x.divide(&x.scalar_like(std::f64::consts::SQRT_2)?)?.erf()?;
    Ok(x.multiply(&inner.add_scalar(1.0)?)?.divide(&x.scalar_like(2.0)?)?)
}
