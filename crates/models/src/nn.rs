//! The few layers models are built from: linear maps, embeddings, RMS and layer norms.

use mlx::Array;

use crate::checkpoint::{Matrix, Weights};
use cache::Result;
use cache::backend::Ops;

/// A LayerNorm with a weight and a bias (vision towers).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    /// `{module}.weight` and `{module}.bias`, both `[width]`.
    pub fn load(w: &Weights<'_>, module: &str, width: i32, eps: f32) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: w.get(&format!("{module}.weight"), &[width])?,
            bias: w.get(&format!("{module}.bias"), &[width])?,
            eps,
        })
    }

    /// Normalizes the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(mlx::fast::layer_norm(x, Some(&self.weight), Some(&self.bias), self.eps)?)
    }
}

/// `[-x2, x1]` of `x`'s two halves along the last axis (rotary embeddings applied from
/// explicit cosines and sines).
pub fn rotate_half(x: &Array) -> Result<Array> {
    let s = x.shape();
    let last = s.len() - 1;
    let half = s[last] / 2;
    let mut start = vec![0; s.len()];
    let mut mid = s.clone();
    mid[last] = half;
    let x1 = x.slice(&start, &mid, &vec![1; s.len()])?;
    start[last] = half;
    let x2 = x.slice(&start, &s, &vec![1; s.len()])?;
    Ok(mlx::ops::concatenate(&[&x2.negative()?, &x1], -1)?)
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

    /// Bytes of the weight, read once per product.
    pub fn nbytes(&self) -> usize {
        self.weight.nbytes()
    }

    /// Applies the map to the last axis of `x`.
    pub fn forward(&self, x: &Array, ops: &Ops) -> Result<Array> {
        Ok(match (&self.weight, &self.transposed) {
            (Matrix::Dense(_), Some(wt)) => x.matmul(wt)?,
            (Matrix::Dense(w), None) => x.matmul(&w.transpose(&[])?)?,
            (Matrix::Quantized(q), _) => ops.quantized_matmul(x, q)?,
        })
    }
}

/// Linear maps of the same input computed as one product where their weights stack (one
/// matrix-vector product instead of several: on a GPU each op is host time per token), when
/// the model is loaded with stacked projections ([`crate::LoadOptions::stacked_projections`]).
#[derive(Debug, Clone)]
pub struct Stacked {
    /// The stacked map, when the weights allowed it.
    joined: Option<Linear>,
    /// The maps one by one otherwise.
    parts: Vec<Linear>,
    /// Output width of each map.
    widths: Vec<i32>,
    /// Where each map's outputs are in the joined output, for a traced step's gathers.
    indices: Vec<Array>,
}

impl Stacked {
    /// `parts` (each `[out, in]`, the same `in`), stacked into one matrix when `stack` is set
    /// and their weights allow it.
    pub fn new(parts: Vec<Matrix>, stack: bool) -> Result<Stacked> {
        let widths = parts.iter().map(Matrix::rows).collect::<Result<Vec<_>>>()?;
        let joined = if stack { Matrix::stack_rows(&parts)? } else { None };
        Ok(match joined {
            Some(joined) => Stacked {
                joined: Some(Linear::new(joined)),
                parts: Vec::new(),
                indices: cache::backend::mlx::split_indices(&widths)?,
                widths,
            },
            None => Stacked {
                joined: None,
                parts: parts.into_iter().map(Linear::new).collect(),
                indices: Vec::new(),
                widths,
            },
        })
    }

    /// Output width of each map.
    pub fn widths(&self) -> &[i32] {
        &self.widths
    }

    /// Bytes of all the weights.
    pub fn nbytes(&self) -> usize {
        self.joined.as_ref().map_or(0, Linear::nbytes)
            + self.parts.iter().map(Linear::nbytes).sum::<usize>()
    }

    /// The outputs side by side on the last axis (`[..., Σ widths]`), or `None` when the maps
    /// are not stacked.
    pub fn forward_joined(&self, x: &Array, ops: &Ops) -> Result<Option<Array>> {
        self.joined.as_ref().map(|j| j.forward(x, ops)).transpose()
    }

    /// Each map's output.
    pub fn forward(&self, x: &Array, ops: &Ops) -> Result<Vec<Array>> {
        match self.forward_joined(x, ops)? {
            Some(joined) => self.split(&joined, ops),
            None => self.parts.iter().map(|p| p.forward(x, ops)).collect(),
        }
    }

    /// Each map's output out of the joined one.
    pub fn split(&self, joined: &Array, ops: &Ops) -> Result<Vec<Array>> {
        ops.split_last(joined, &self.widths, &self.indices)
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
    pub fn as_linear(&self, x: &Array, ops: &Ops) -> Result<Array> {
        Linear::new(self.table.clone()).forward(x, ops)
    }
}

/// `x · Wₑᵀ` with `Wₑ` the matrix of `stack` that `routes` names for each row of `x` (the row
/// `rows` names, or MLX's broadcast of the batch when `None`).
pub(crate) fn gather_product(
    stack: &Matrix,
    x: &Array,
    rows: Option<&Array>,
    routes: &Array,
    sorted: bool,
) -> Result<Array> {
    Ok(match stack {
        Matrix::Dense(w) => x.gather_matmul(&w.swapaxes(-1, -2)?, rows, Some(routes), sorted)?,
        Matrix::Quantized(q) => q.gather_matmul(x, rows, Some(routes), true, sorted)?,
    })
}

pub use cache::pointwise::{Activations, RmsNorm, compile_available};
