//! Random numbers from explicit keys, so results are reproducible for a seed.

use mlx_sys::ffi;

use crate::array::opt_ptr;
use crate::array::{Array, Dtype};
use crate::error::{Result, check};

/// A PRNG key (`uint32[2]`) for `seed`.
#[track_caller]
pub fn key(seed: u64) -> Result<Array> {
    check(ffi::random_key(seed)).map(Array::wrap)
}

/// Seeds MLX's global key, used by calls that pass no key.
#[track_caller]
pub fn seed(seed: u64) -> Result<()> {
    check(ffi::random_seed(seed))
}

/// Splits `key` into `num` independent keys, `[num, 2]`.
#[track_caller]
pub fn split(key: &Array, num: i32) -> Result<Array> {
    check(ffi::random_split(key.raw(), num)).map(Array::wrap)
}

/// Uniform samples in `[low, high)`.
#[track_caller]
#[allow(unsafe_code)]
pub fn uniform(
    low: f32,
    high: f32,
    shape: &[i32],
    dtype: Dtype,
    key: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the key pointer is null or borrows an argument that outlives the call.
    check(unsafe { ffi::random_uniform(low, high, shape, dtype.to_ffi(), opt_ptr(key)) })
        .map(Array::wrap)
}

/// Normal samples with mean `loc` and standard deviation `scale`.
#[track_caller]
#[allow(unsafe_code)]
pub fn normal(
    shape: &[i32],
    dtype: Dtype,
    loc: f32,
    scale: f32,
    key: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the key pointer is null or borrows an argument that outlives the call.
    check(unsafe { ffi::random_normal(shape, dtype.to_ffi(), loc, scale, opt_ptr(key)) })
        .map(Array::wrap)
}

/// One sample per row from the categorical distribution given by unnormalized `logits`
/// along `axis` (the axis is removed).
#[track_caller]
#[allow(unsafe_code)]
pub fn categorical(logits: &Array, axis: i32, key: Option<&Array>) -> Result<Array> {
    // SAFETY: the key pointer is null or borrows an argument that outlives the call.
    check(unsafe { ffi::random_categorical(logits.raw(), axis, opt_ptr(key)) }).map(Array::wrap)
}
