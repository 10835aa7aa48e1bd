//! The few layers models are built from: linear maps, embeddings, RMS norms.

use mlx::{Array, fast};

use crate::backend::Ops;
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
                indices: crate::backend::mlx::split_indices(&widths)?,
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

    /// The learned weight (`None` for an unscaled norm).
    pub fn weight(&self) -> Option<&Array> {
        self.weight.as_ref()
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// Normalizes the last axis of `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, self.weight.as_ref(), self.eps)?)
    }
}

/// Whether MLX can compile graphs on this machine. On the CPU it builds each fused kernel with
/// the system C++ compiler at run time, and fails when it first *evaluates* one if there is
/// none (a desktop without build tools): probed once with a tiny graph, so that every compiled
/// path (these activations, the compiled decode step) runs op by op instead of failing replies.
pub fn compile_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let probe = || -> mlx::Result<()> {
            let f = mlx::compile(
                |x: &[Array]| Ok(vec![x[0].multiply_scalar(2.0)?.add_scalar(1.0)?.exp()?]),
                false,
            )?;
            let x = Array::from_slice(&[0.5f32, 1.5], &[2])?;
            let y = f.call(&[&x])?;
            mlx::eval(&y.iter().collect::<Vec<_>>())
        };
        match probe() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("MLX cannot compile graphs here; running op by op: {e}");
                false
            }
        }
    })
}

/// Element-wise activations compiled once into fused kernels (as `mlx.nn` compiles its own):
/// one kernel instead of the eight ops the tanh-approximated GELU takes. Op by op where
/// [`compile_available`] says MLX cannot compile.
pub struct Activations {
    compiled: Option<(mlx::Compiled, mlx::Compiled)>,
}

impl std::fmt::Debug for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Activations")
    }
}

impl Activations {
    /// Compiles the activations, traced once per input shape. Not shapeless: a shapeless trace
    /// puts a broadcast before every binary op, which makes the GELU's graph deeper than MLX
    /// fuses into one kernel (its depth limit is 11), so each call would be two kernels; traced
    /// per shape it is one. Same ops in the same order either way, so the same numbers.
    pub fn new() -> Result<Activations> {
        if !compile_available() {
            return Ok(Activations { compiled: None });
        }
        let gelu = mlx::compile(|x: &[Array]| Ok(vec![x[0].gelu_approx()?]), false)?;
        let geglu =
            mlx::compile(|x: &[Array]| Ok(vec![x[0].gelu_approx()?.multiply(&x[1])?]), false)?;
        Ok(Activations { compiled: Some((gelu, geglu)) })
    }

    /// `gelu_approx(x)`.
    pub fn gelu(&self, x: &Array) -> Result<Array> {
        match &self.compiled {
            Some((gelu, _)) => first(gelu.call(&[x])?),
            None => Ok(x.gelu_approx()?),
        }
    }

    /// `gelu_approx(gate) · x`.
    pub fn geglu(&self, gate: &Array, x: &Array) -> Result<Array> {
        match &self.compiled {
            Some((_, geglu)) => first(geglu.call(&[gate, x])?),
            None => Ok(gate.gelu_approx()?.multiply(x)?),
        }
    }
}

fn first(outputs: Vec<Array>) -> Result<Array> {
    outputs
        .into_iter()
        .next()
        .ok_or_else(|| crate::Error::InvalidRequest("compiled function returned nothing".into()))
}
