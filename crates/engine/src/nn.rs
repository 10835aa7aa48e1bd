//! The few layers models are built from: linear maps, embeddings, RMS norms.

use std::sync::atomic::{AtomicU8, Ordering};

use mlx::{Array, fast};

use crate::checkpoint::Matrix;
use crate::error::Result;

/// Rows a quantized matmul is padded to when it has fewer (0: never padded).
///
/// MLX's CUDA backend runs a quantized matmul of 1–7 rows as one matrix-vector pass per row,
/// and from 8 rows as one tiled matrix-matrix kernel: measured on an H200 (MLX 0.32.4, Gemma 4
/// E4B projections, 4-bit), 5 rows cost 3.3× one row and 8 rows 1.25×. A speculative verify
/// window (2–8 tokens) is therefore padded to 8 rows there. Metal and the CPU pick their
/// kernels otherwise and are left alone.
static PAD_ROWS: AtomicU8 = AtomicU8::new(u8::MAX);

fn pad_rows() -> usize {
    let mut rows = PAD_ROWS.load(Ordering::Relaxed);
    if rows == u8::MAX {
        rows = if mlx::device::Backend::current() == mlx::device::Backend::Cuda { 8 } else { 0 };
        PAD_ROWS.store(rows, Ordering::Relaxed);
    }
    rows as usize
}

/// The rows quantized matmuls of fewer rows are padded to now (0: none).
pub fn quantized_row_padding() -> u8 {
    pad_rows() as u8
}

/// Sets the rows quantized matmuls of fewer rows are padded to (0: none), overriding the
/// backend's default (benchmarks compare both).
pub fn set_quantized_row_padding(rows: u8) {
    PAD_ROWS.store(rows.min(u8::MAX - 1), Ordering::Relaxed);
}

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

    /// Applies the map to the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(match (&self.weight, &self.transposed) {
            (Matrix::Dense(_), Some(wt)) => x.matmul(wt)?,
            (Matrix::Dense(w), None) => x.matmul(&w.transpose(&[])?)?,
            (Matrix::Quantized(q), _) => {
                let shape = x.shape();
                let cols = shape.last().copied().unwrap_or(0);
                let rows: i32 = shape[..shape.len().saturating_sub(1)].iter().product();
                let pad = pad_rows() as i32;
                if rows > 1 && rows < pad {
                    // Zero rows up to the kernel that serves a block of rows at once; their
                    // outputs are dropped.
                    let flat = x.reshape(&[rows, cols])?;
                    let zero = Array::from_slice(&[0.0f32], &[])?.astype(x.dtype())?;
                    let padded = flat.pad(&[0], &[0], &[pad - rows], &zero)?;
                    let y = q.matmul(&padded, true)?;
                    let out = y.dim(-1)?;
                    let mut target = shape.clone();
                    if let Some(last) = target.last_mut() {
                        *last = out;
                    }
                    y.slice(&[0, 0], &[rows, out], &[1, 1])?.reshape(&target)?
                } else {
                    q.matmul(x, true)?
                }
            }
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
