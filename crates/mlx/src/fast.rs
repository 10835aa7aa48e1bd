//! Fused kernels (`mlx::core::fast`): norms, rotary embeddings, attention.

use mlx_sys::ffi;

use crate::array::Array;
use crate::error::{Result, check};

/// Null for `None`, else the bridge handle behind `a`.
pub(crate) fn opt_ptr(a: Option<&Array>) -> *const ffi::Array {
    a.map_or(std::ptr::null(), |a| a.raw() as *const ffi::Array)
}

/// RMS normalization over the last axis: `x / sqrt(mean(x²) + eps) · weight`.
#[track_caller]
#[allow(unsafe_code)]
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `weight`, which outlives the call.
    check(unsafe { ffi::rms_norm(x.raw(), opt_ptr(weight), eps) }).map(Array::wrap)
}

/// Layer normalization over the last axis, with optional affine `weight` and `bias`.
#[track_caller]
#[allow(unsafe_code)]
pub fn layer_norm(
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    // SAFETY: each pointer is null or borrows an argument that outlives the call.
    check(unsafe { ffi::layer_norm(x.raw(), opt_ptr(weight), opt_ptr(bias), eps) }).map(Array::wrap)
}

/// Where a rotary embedding takes its frequencies from.
#[derive(Debug, Clone, Copy)]
pub enum RopeFrequencies<'a> {
    /// `base^(-2i/dims)` for `i` in `0..dims/2`.
    Base(f32),
    /// Explicit per-pair *periods* (MLX divides positions by them), `dims/2` values, as used for
    /// scaled or proportional rope.
    Custom(&'a Array),
}

/// The position of the first row of `x`: a constant or an array (a scalar, or one offset per
/// batch row) so a compiled decode step can take the position as an input.
#[derive(Debug, Clone, Copy)]
pub enum RopeOffset<'a> {
    /// A fixed offset.
    Fixed(i32),
    /// An `int32` scalar or `[B]` vector of offsets.
    Array(&'a Array),
}

/// Rotary position embedding of the first `dims` features of `x` (`[..., L, D]`), positions
/// `offset..offset+L` scaled by `scale`. `traditional` rotates adjacent pairs `(2i, 2i+1)`;
/// otherwise the halves `(i, i + dims/2)` as most checkpoints do.
#[track_caller]
#[allow(unsafe_code)]
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    frequencies: RopeFrequencies<'_>,
    scale: f32,
    offset: RopeOffset<'_>,
) -> Result<Array> {
    let (base, freqs) = match frequencies {
        RopeFrequencies::Base(base) => (base, None),
        RopeFrequencies::Custom(freqs) => (0.0, Some(freqs)),
    };
    let freqs = opt_ptr(freqs);
    // SAFETY: `freqs` is null or borrows an argument that outlives the call.
    let result = match offset {
        RopeOffset::Fixed(offset) => unsafe {
            ffi::rope_int_offset(x.raw(), dims, traditional, base, scale, offset, freqs)
        },
        RopeOffset::Array(offset) => unsafe {
            ffi::rope(x.raw(), dims, traditional, base, scale, offset.raw(), freqs)
        },
    };
    check(result).map(Array::wrap)
}

/// The mask an attention call applies.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` of `L` sees keys up to `S - L + i` (queries are the last `L` positions).
    Causal,
    /// A bool mask (true = attend) or an additive float mask, broadcastable to `[B, H, L, S]`.
    Array(&'a Array),
}

/// `softmax(q·kᵀ·scale + mask)·v` with MLX's fused kernel. `q` is `[B, Hq, L, D]`, `k` and `v`
/// are `[B, Hkv, S, D]` with `Hq` a multiple of `Hkv` (grouped-query attention needs no
/// repeat). `sinks`, when given, is one logit per head that joins each softmax.
#[track_caller]
#[allow(unsafe_code)]
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, array) = match mask {
        AttentionMask::None => ("", None),
        AttentionMask::Causal => ("causal", None),
        AttentionMask::Array(m) => ("", Some(m)),
    };
    // SAFETY: each pointer is null or borrows an argument that outlives the call.
    check(unsafe {
        ffi::scaled_dot_product_attention(
            q.raw(),
            k.raw(),
            v.raw(),
            scale,
            mode,
            opt_ptr(array),
            opt_ptr(sinks),
        )
    })
    .map(Array::wrap)
}
