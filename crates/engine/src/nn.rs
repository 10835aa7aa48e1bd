//! The few layers models are built from: linear maps, embeddings, RMS norms.

use mlx::{Array, fast};

use crate::checkpoint::Matrix;
use crate::error::Result;

/// `y = x · Wᵀ` for a weight stored `[out, in]`, dense or quantized.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Matrix,
}

impl Linear {
    /// Wraps a `[out, in]` matrix.
    pub fn new(weight: Matrix) -> Linear {
        Linear { weight }
    }

    /// Applies the map to the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match &self.weight {
            Matrix::Dense(w) => x.matmul(&w.transpose(&[])?)?,
            Matrix::Quantized(q) => q.matmul(x, true)?,
        })
    }
}

/// A token embedding table `[vocab, dim]`, dense or quantized, usable as a tied output head.
#[derive(Debug, Clone)]
pub struct Embedding {
    table: Matrix,
}

impl Embedding {
    /// Wraps a `[vocab, dim]` table.
    pub fn new(table: Matrix) -> Embedding {
        Embedding { table }
    }

    /// Rows of the table for `ids` (any shape of integer ids) → `[..., dim]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.table {
            Matrix::Dense(w) => w.take(ids, 0)?,
            Matrix::Quantized(q) => {
                let rows = mlx::quantized::QuantizedMatrix {
                    weight: q.weight.take(ids, 0)?,
                    scales: q.scales.take(ids, 0)?,
                    biases: q.biases.take(ids, 0)?,
                    group_size: q.group_size,
                    bits: q.bits,
                };
                rows.dequantize()?
            }
        })
    }

    /// The table used as a linear map `dim → vocab` (a tied LM head).
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Linear::new(self.table.clone()).forward(x)
    }
}

/// RMS normalization over the last axis, with the weight used as stored (Gemma 4's
/// convention; Gemma 3 stores `weight − 1`, and its loader adds the 1 back).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Option<Array>,
    eps: f32,
}

impl RmsNorm {
    /// A norm with a learned weight.
    pub fn new(weight: Array, eps: f32) -> RmsNorm {
        RmsNorm { weight: Some(weight), eps }
    }

    /// A norm without a weight (scale 1).
    pub fn unscaled(eps: f32) -> RmsNorm {
        RmsNorm { weight: None, eps }
    }

    /// Normalizes the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, self.weight.as_ref(), self.eps)?)
    }
}
