//! MLX's own route for every op a backend may replace: what runs on Metal and the CPU, on CUDA
//! wherever Quince's kernels do not apply, and what the kernels' probes and tests compare with.
//! The types here are the ops' interfaces, shared with the kernels.

use mlx::{Array, Dtype};

use crate::error::{Error, Result};
use crate::pointwise::RmsNorm;

/// Query heads and, for a layer with its own, key and value heads, each `[B, H, 1, D]`.
#[derive(Debug, Clone)]
pub struct Heads {
    /// Queries, normed and rotated.
    pub q: Array,
    /// Keys (normed, rotated) and values (normed).
    pub kv: Option<(Array, Array)>,
}

/// Rotary embedding as the heads kernel applies it (MLX's `fast::rope` with scale 1 over the
/// whole head).
#[derive(Debug, Clone, Copy)]
pub struct RopeSpec<'a> {
    /// Rotate interleaved pairs instead of halves.
    pub traditional: bool,
    /// θ, when `freqs` is `None`.
    pub base: f32,
    /// Periods per pair (f32 `[D/2]`), replacing θ.
    pub freqs: Option<&'a Array>,
}

/// Where the heads of a stacked projection are, in units of the head size `D`.
#[derive(Debug, Clone, Copy)]
pub struct HeadsLayout<'a> {
    /// Head size.
    pub head_dim: i32,
    /// Query heads, at the start of the projection.
    pub q_heads: i32,
    /// Key heads (0 for a layer without its own keys), right after the queries; as many value
    /// heads follow.
    pub kv_heads: i32,
    /// First projection head the values are read from: `q_heads + kv_heads` after the keys,
    /// or `q_heads` for values taken from the raw keys (`attention_k_eq_v`).
    pub values_at: i32,
    /// Query norm.
    pub q_norm: &'a RmsNorm,
    /// Key norm (any norm when `kv_heads` is 0).
    pub k_norm: &'a RmsNorm,
}

/// `h + norm_a(x)`, times `scale` when given, and `next` of that sum when given: the sum and
/// its norm.
pub fn residual_norm(
    h: &Array,
    x: &Array,
    norm_a: &RmsNorm,
    scale: Option<&Array>,
    next: Option<&RmsNorm>,
) -> Result<(Array, Option<Array>)> {
    let mut sum = h.add(&norm_a.forward(x)?)?;
    if let Some(s) = scale {
        sum = sum.multiply(s)?;
    }
    let normed = next.map(|n| n.forward(&sum)).transpose()?;
    Ok((sum, normed))
}

/// The query, key and value heads of one position from a stacked projection `proj`
/// `[B, 1, N]` by MLX ops (slices, per-head norms, `fast::rope` at `position`): the route the
/// heads kernel replaces, for its probe and tests.
pub fn decode_heads(
    proj: &Array,
    layout: &HeadsLayout<'_>,
    rope: &RopeSpec<'_>,
    position: i32,
) -> Result<Heads> {
    let s = proj.shape();
    let (b, d) = (s[0], layout.head_dim);
    let heads = |at: i32, n: i32, norm: &RmsNorm, rotate: bool| -> Result<Array> {
        let part = proj.slice(&[0, 0, at * d], &[b, 1, (at + n) * d], &[1, 1, 1])?;
        let normed = norm.forward(&part.reshape(&[b, n, 1, d])?)?;
        if !rotate {
            return Ok(normed);
        }
        let frequencies = match rope.freqs {
            Some(f) => mlx::fast::RopeFrequencies::Custom(f),
            None => mlx::fast::RopeFrequencies::Base(rope.base),
        };
        Ok(mlx::fast::rope(
            &normed,
            d,
            rope.traditional,
            frequencies,
            1.0,
            mlx::fast::RopeOffset::Fixed(position),
        )?)
    };
    let q = heads(0, layout.q_heads, layout.q_norm, true)?;
    if layout.kv_heads == 0 {
        return Ok(Heads { q, kv: None });
    }
    let k = heads(layout.q_heads, layout.kv_heads, layout.k_norm, true)?;
    let v =
        heads(layout.values_at, layout.kv_heads, &RmsNorm::unscaled(layout.q_norm.eps()), false)?;
    Ok(Heads { q, kv: Some((k, v)) })
}

/// The last axis of `x` split into parts of `sizes`, as views.
pub fn split_last(x: &Array, sizes: &[i32]) -> Result<Vec<Array>> {
    let s = x.shape();
    let axis = s.len() - 1;
    let mut parts = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in sizes {
        let mut start = vec![0; s.len()];
        let mut stop = s.clone();
        start[axis] = at;
        stop[axis] = at + n;
        parts.push(x.slice(&start, &stop, &vec![1; s.len()])?);
        at += n;
    }
    Ok(parts)
}

/// The index arrays a shapeless step gathers the parts of [`split_last`] by, one int32 range per
/// part, evaluated (a trace captures them as constants).
pub fn split_indices(sizes: &[i32]) -> Result<Vec<Array>> {
    let mut at = 0;
    let mut indices = Vec::with_capacity(sizes.len());
    for &n in sizes {
        indices.push(mlx::ops::arange(f64::from(at), f64::from(at + n), 1.0, Dtype::Int32)?);
        at += n;
    }
    mlx::eval(&indices.iter().collect::<Vec<_>>())?;
    Ok(indices)
}

/// Attends one query position `q` `[B, Hq, 1, D]` over `k`, `v` `[B, Hkv, S, D]` with no mask,
/// in the fewest nodes MLX allows: its fused kernel where it has one for the head size, else
/// the query heads sharing a KV head as the rows of one product (six nodes instead of the
/// twelve MLX's own fallback records, with its arithmetic: scores in the input dtype, precise
/// softmax, and no op at all for a scale of 1).
pub fn attend_one(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let (heads, dim) = (q.dim(1)?, q.dim(3)?);
    let kv_heads = k.dim(1)?;
    let group = if kv_heads > 0 { heads / kv_heads } else { 0 };
    let fused = match mlx::Backend::current() {
        mlx::Backend::Metal => matches!(dim, 64 | 96 | 128 | 256) && group <= 32,
        mlx::Backend::Cuda => matches!(dim, 64 | 96 | 128),
        mlx::Backend::Cpu => false,
    };
    if fused && group > 0 && heads % kv_heads == 0 {
        return Ok(mlx::fast::scaled_dot_product_attention(
            q,
            k,
            v,
            scale,
            mlx::fast::AttentionMask::None,
            None,
        )?);
    }
    attend_one_by_ops(q, k, v, scale, None)
}

/// Attends a short window of `L` query positions `q` `[B, Hq, L, D]` over `k`, `v`
/// `[B, Hkv, S, D]` under `mask` by MLX's ops: the query heads sharing a KV head and their
/// positions as the rows of one product, scores in the input dtype, hidden keys at −∞, a
/// precise softmax (the arithmetic of MLX's own fallback). The causal mask hides from query
/// `i` the keys after `S − L + i`; an array mask is bool (true = visible) or additive, shaped
/// `[L, S]` or `[B, 1 or Hq, L, S]`. `None` for a mask of another shape (the caller's fused
/// route takes it).
pub fn attend_window_by_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: mlx::fast::AttentionMask<'_>,
) -> Result<Option<Array>> {
    let s = q.shape();
    let (b, heads, length, dim) = (s[0], s[1], s[2], s[3]);
    let (kv_heads, keys) = (k.dim(1)?, k.dim(2)?);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::InvalidRequest(format!(
            "{heads} query heads cannot share {kv_heads} key-value heads"
        )));
    }
    let group = heads / kv_heads;
    // [B, Hkv, group, L, S] after the product; a mask broadcasts against that.
    let mask = match mask {
        mlx::fast::AttentionMask::None => None,
        mlx::fast::AttentionMask::Causal => {
            let columns = mlx::ops::arange(0.0, f64::from(keys), 1.0, Dtype::Int32)?;
            let last =
                mlx::ops::arange(f64::from(keys - length), f64::from(keys), 1.0, Dtype::Int32)?;
            let visible = columns.reshape(&[1, keys])?.le(&last.reshape(&[length, 1])?)?;
            Some(visible)
        }
        mlx::fast::AttentionMask::Array(m) => match m.shape().as_slice() {
            [l, n] if *l == length && *n == keys => Some(m.clone()),
            [mb, 1, l, n] if *l == length && *n == keys => Some(m.reshape(&[*mb, 1, 1, *l, *n])?),
            [mb, h, l, n] if *h == heads && *l == length && *n == keys => {
                Some(m.reshape(&[*mb, kv_heads, group, *l, *n])?)
            }
            _ => return Ok(None),
        },
    };
    let mut rows = q.reshape(&[b, kv_heads, group * length, dim])?;
    if scale != 1.0 {
        rows = rows.multiply_scalar(f64::from(scale))?;
    }
    let mut scores =
        rows.matmul(&k.swapaxes(-1, -2)?)?.reshape(&[b, kv_heads, group, length, keys])?;
    if let Some(mask) = mask {
        scores = match mask.dtype() {
            Dtype::Bool => {
                let hidden = Array::scalar(f32::NEG_INFINITY)?.astype(scores.dtype())?;
                mlx::ops::where_(&mask, &scores, &hidden)?
            }
            _ => scores.add(&mask.astype(scores.dtype())?)?,
        };
    }
    let weights = scores.softmax(&[-1], true)?.reshape(&[b, kv_heads, group * length, keys])?;
    Ok(Some(weights.matmul(v)?.reshape(&[b, heads, length, dim])?))
}

/// [`attend_one`]'s route by ops, under `mask` (bool `[B, 1, 1, S]`, true = visible) when
/// given: hidden keys score −∞ before the softmax. Every shape in it follows its inputs', so a
/// shapeless compiled step may run it at any `S`.
pub fn attend_one_by_ops(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Option<&Array>,
) -> Result<Array> {
    let s = q.shape();
    let (b, heads, dim) = (s[0], s[1], s[3]);
    let kv_heads = k.dim(1)?;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::InvalidRequest(format!(
            "{heads} query heads cannot share {kv_heads} key-value heads"
        )));
    }
    let group = heads / kv_heads;
    let mut rows = q.reshape(&[b, kv_heads, group, dim])?;
    if scale != 1.0 {
        rows = rows.multiply_scalar(f64::from(scale))?;
    }
    let mut scores = rows.matmul(&k.swapaxes(-1, -2)?)?;
    if let Some(mask) = mask {
        let hidden = Array::scalar(f32::NEG_INFINITY)?.astype(scores.dtype())?;
        scores = mlx::ops::where_(mask, &scores, &hidden)?;
    }
    let weights = scores.softmax(&[-1], true)?;
    Ok(weights.matmul(v)?.reshape(&[b, heads, 1, dim])?)
}
