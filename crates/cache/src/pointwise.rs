//! The per-position layers models share: RMS norms and the GELU activations. They read no
//! weight matrix and take no [`crate::backend::Ops`]: the backends' kernels take them as
//! inputs (`backend` depends on this module, never the other way round).

use mlx::{Array, fast};

use crate::error::Result;

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
