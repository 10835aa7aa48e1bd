//! Affine quantization as MLX stores it: per group of `group_size` values along the last axis,
//! `w ≈ scale · q + bias` with `q` packed `bits` wide into `u32` words.

use mlx_sys::ffi;

use crate::array::opt_ptr;
use crate::array::{Array, from_vector};
use crate::error::{Error, Result, check};

/// A quantized matrix: the packed words and one scale and bias per group.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    /// Packed `u32` words, `[..., rows, cols · bits / 32]`.
    pub weight: Array,
    /// One scale per group, `[..., rows, cols / group_size]`.
    pub scales: Array,
    /// One bias per group, same shape as `scales`.
    pub biases: Array,
    /// Values per group: 32, 64 or 128.
    pub group_size: i32,
    /// Bits per value: 2, 3, 4, 5, 6 or 8.
    pub bits: i32,
}

/// Quantizes `w` along its last axis.
#[track_caller]
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<QuantizedMatrix> {
    let packed = check(ffi::quantize(w.raw(), group_size, bits))?;
    let parts = from_vector(&packed)?;
    let mut parts = parts.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(weight), Some(scales), Some(biases)) => {
            Ok(QuantizedMatrix { weight, scales, biases, group_size, bits })
        }
        _ => Err(Error::invalid("affine quantize returned fewer than three arrays")),
    }
}

impl QuantizedMatrix {
    /// The matrix back in floating point (the dtype of `scales`).
    #[track_caller]
    #[allow(unsafe_code)]
    pub fn dequantize(&self) -> Result<Array> {
        // SAFETY: the biases pointer borrows `self`, which outlives the call.
        check(unsafe {
            ffi::dequantize(
                self.weight.raw(),
                self.scales.raw(),
                opt_ptr(Some(&self.biases)),
                self.group_size,
                self.bits,
            )
        })
        .map(Array::wrap)
    }

    /// `x @ Wᵀ` when `transpose` (the layout of a linear layer's weight), else `x @ W`, without
    /// materializing `W` in floating point.
    ///
    /// For one matrix and several batches of rows, `x`'s leading axes are folded into its rows
    /// first: MLX-CUDA 0.32.4 runs `[B, 1, K]` as B one-row products, each reading the whole
    /// matrix (103 µs for a 10240×2560 4-bit matrix at B = 8 on an H100), where `[B, K]` takes
    /// its matrix-matrix kernel and reads it once (25 µs, what one row costs). A batch's decode
    /// step is that shape. One batch is left as it is (no reshapes in a lone compiled step).
    #[track_caller]
    pub fn matmul(&self, x: &Array, transpose: bool) -> Result<Array> {
        let shape = x.shape();
        let batches: i32 = shape.iter().rev().skip(2).product();
        if self.weight.ndim() == 2 && batches > 1 {
            let k = shape[shape.len() - 1];
            let y = self.matmul_raw(&x.reshape(&[-1, k])?, transpose)?;
            let mut out = shape;
            if let Some(last) = out.last_mut() {
                *last = y.dim(-1)?;
            }
            return y.reshape(&out);
        }
        self.matmul_raw(x, transpose)
    }

    #[track_caller]
    #[allow(unsafe_code)]
    fn matmul_raw(&self, x: &Array, transpose: bool) -> Result<Array> {
        // SAFETY: the biases pointer borrows `self`, which outlives the call.
        check(unsafe {
            ffi::quantized_matmul(
                x.raw(),
                self.weight.raw(),
                self.scales.raw(),
                opt_ptr(Some(&self.biases)),
                transpose,
                self.group_size,
                self.bits,
            )
        })
        .map(Array::wrap)
    }

    /// Batched `quantized_matmul` that picks matrices by index: for `self` holding `E` stacked
    /// matrices `[E, rows, packed]`, `rhs_indices` selects one per batch entry of `x`
    /// (mixture-of-experts routing); `lhs_indices` selects rows of `x` likewise.
    /// `sorted_indices` promises `rhs_indices` is sorted, which enables a faster kernel.
    #[track_caller]
    #[allow(unsafe_code)]
    pub fn gather_matmul(
        &self,
        x: &Array,
        lhs_indices: Option<&Array>,
        rhs_indices: Option<&Array>,
        transpose: bool,
        sorted_indices: bool,
    ) -> Result<Array> {
        // SAFETY: each pointer is null or borrows `self` or an argument outliving the call.
        check(unsafe {
            ffi::gather_qmm(
                x.raw(),
                self.weight.raw(),
                self.scales.raw(),
                opt_ptr(Some(&self.biases)),
                opt_ptr(lhs_indices),
                opt_ptr(rhs_indices),
                transpose,
                self.group_size,
                self.bits,
                sorted_indices,
            )
        })
        .map(Array::wrap)
    }
}
