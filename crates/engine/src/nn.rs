//! The few layers models are built from: linear maps, embeddings, RMS norms.

use mlx::{Array, fast};

use crate::checkpoint::Matrix;
use crate::error::Result;

/// `y = x · Wᵀ` for a weight stored `[out, in]`, dense or quantized.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Matrix,
    /// `Wᵀ` of a dense weight, made once (a view, no copy) so each call is one matmul node.
    transposed: Option<Array>,
}

impl Linear {
    /// Wraps a `[out, in]` matrix.
    pub fn new(weight: Matrix) -> Linear {
        let transposed = match &weight {
            Matrix::Dense(w) => w.transpose(&[]).ok(),
            Matrix::Quantized(_) => None,
        };
        Linear { weight, transposed }
    }

    /// Bytes of the weight, read once per product.
    pub fn nbytes(&self) -> usize {
        self.weight.nbytes()
    }

    /// Applies the map to the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match (&self.weight, &self.transposed) {
            (Matrix::Dense(_), Some(wt)) => x.matmul(wt)?,
            (Matrix::Dense(w), None) => x.matmul(&w.transpose(&[])?)?,
            (Matrix::Quantized(q), _) => q.matmul(x, true)?,
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

    /// Bytes of the whole table (what it costs as an output head).
    pub fn nbytes(&self) -> usize {
        self.table.nbytes()
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

    /// The dtype activations computed from this table have (the table's, or the scales' of a
    /// quantized one).
    pub fn table_dtype(&self) -> Option<mlx::Dtype> {
        Some(match &self.table {
            Matrix::Dense(w) => w.dtype(),
            Matrix::Quantized(q) => q.scales.dtype(),
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

/// Element-wise activations compiled once into fused kernels (as `mlx.nn` compiles its own):
/// one kernel instead of the eight ops the tanh-approximated GELU takes.
pub struct Activations {
    gelu: mlx::Compiled,
    geglu: mlx::Compiled,
}

impl std::fmt::Debug for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Activations")
    }
}

impl Activations {
    /// Compiles the activations (shapeless: one trace serves every shape).
    pub fn new() -> Result<Activations> {
        let gelu = mlx::compile(|x: &[Array]| Ok(vec![x[0].gelu_approx()?]), true)?;
        let geglu =
            mlx::compile(|x: &[Array]| Ok(vec![x[0].gelu_approx()?.multiply(&x[1])?]), true)?;
        Ok(Activations { gelu, geglu })
    }

    /// `gelu_approx(x)`.
    pub fn gelu(&self, x: &Array) -> Result<Array> {
        first(self.gelu.call(&[x])?)
    }

    /// `gelu_approx(gate) · x`.
    pub fn geglu(&self, gate: &Array, x: &Array) -> Result<Array> {
        first(self.geglu.call(&[gate, x])?)
    }
}

fn first(outputs: Vec<Array>) -> Result<Array> {
    outputs
        .into_iter()
        .next()
        .ok_or_else(|| crate::Error::InvalidRequest("compiled function returned nothing".into()))
}
