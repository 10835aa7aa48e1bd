//! Quince's CUDA kernels, for the small ops of a decode step, where MLX-CUDA records each op
//! into a CUDA graph at 3–5 µs of host time and has no fused kernel for Gemma 4's head sizes.
//! Each kernel does in one launch what takes MLX two to ten ops:
//!
//! - [`attention`]: one query position over a read's keys (one pass, or split past 1,024 keys);
//! - [`norm`]: a residual add with its norm and the norm that follows;
//! - [`heads`]: the q/k/v heads of one position with their norms and rotary embedding;
//! - [`geglu`]: `gelu(gate) · up` over a stacked projection or one layer's per-layer input;
//! - [`qmv4`]: a 4-bit matrix-vector product for up to 7 rows;
//! - [`clock`]: the GPU's timer, a diagnostic.
//!
//! Every kernel keeps MLX's rounding step by step (except [`qmv4`], which sums in fp32 in its
//! own order). Each is compiled and probed on first use against its MLX route; one that fails
//! to build or to agree is turned off with a warning and MLX's route runs. The kernels take
//! floating point inputs with row-contiguous rows; a shapeless compiled step never holds them
//! (a custom kernel's output shape cannot be inferred), so its [`super::Ops`] have none.

mod attention;
mod clock;
mod geglu;
mod heads;
mod norm;
mod qmv4;

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use mlx::fast::{CudaKernel, TemplateArg};
use mlx::quantized::QuantizedMatrix;
use mlx::{Array, Dtype};

use super::kernels::Kernels;
use super::mlx::{Heads, HeadsLayout, RopeSpec};
use crate::backend::KernelOptions;
use crate::error::{Error, Result};
use crate::pointwise::RmsNorm;

/// A kernel's declaration and the check that it agrees with its MLX route.
pub(super) struct Spec {
    name: &'static str,
    inputs: &'static [&'static str],
    outputs: &'static [&'static str],
    source: &'static str,
    probe: fn(&Rc<CudaKernel>) -> Result<()>,
}

/// The kernels one model runs: those its options allow, each built and probed on first use.
pub(crate) struct CudaKernels {
    options: KernelOptions,
    /// Kernels declared and probed so far; `None` for one that failed its probe.
    built: RefCell<HashMap<&'static str, Option<Rc<CudaKernel>>>>,
    attention: OnceCell<Option<attention::Kernels>>,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels").field("options", &self.options).finish_non_exhaustive()
    }
}

impl CudaKernels {
    pub(super) fn new(options: KernelOptions) -> CudaKernels {
        CudaKernels { options, built: RefCell::default(), attention: OnceCell::new() }
    }

    /// The kernel of `spec`, declared and probed on first use; `None` when it is off.
    fn kernel(&self, spec: &Spec) -> Option<Rc<CudaKernel>> {
        if let Some(known) = self.built.borrow().get(spec.name) {
            return known.clone();
        }
        let built = CudaKernel::with_layout(
            spec.name,
            spec.inputs,
            spec.outputs,
            spec.source,
            HEADER,
            true,
        )
        .map_err(Error::from)
        .map(Rc::new)
        .and_then(|k| (spec.probe)(&k).map(|()| k));
        let kept = match built {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!("the CUDA kernel {} is off, MLX's ops run instead: {e}", spec.name);
                None
            }
        };
        self.built.borrow_mut().insert(spec.name, kept.clone());
        kept
    }

    /// Whether the fused decode kernels may run on `x`.
    fn fuses(&self, x: &Array) -> bool {
        self.options.fused_decode && floating(x)
    }

    fn attention(&self) -> Option<&attention::Kernels> {
        self.attention
            .get_or_init(|| match attention::Kernels::probe() {
                Ok(kernels) => Some(kernels),
                Err(e) => {
                    tracing::warn!("the one-query attention kernel is off, MLX's ops run: {e}");
                    None
                }
            })
            .as_ref()
    }
}

/// The longest window (query positions) attended by MLX's ops instead of its fused attention,
/// which MLX-CUDA runs through cuDNN for more than one query: a cuDNN graph is built for every
/// new key length, and a verify window's key length is new every round.
const WINDOW_BY_OPS_MAX: i32 = 16;

fn floating(x: &Array) -> bool {
    matches!(x.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

impl Kernels for CudaKernels {
    fn in_use(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> =
            self.built.borrow().iter().filter(|(_, k)| k.is_some()).map(|(n, _)| *n).collect();
        if self.attention.get().is_some_and(Option::is_some) {
            names.push("quince_one_query");
        }
        names.sort_unstable();
        names
    }

    fn quantized_matmul(&self, x: &Array, q: &QuantizedMatrix) -> Result<Option<Array>> {
        if !self.options.quantized_matvec || !floating(x) {
            return Ok(None);
        }
        qmv4::by_kernel(x, q, || self.kernel(&qmv4::SPEC))
    }

    fn residual_norm(
        &self,
        h: &Array,
        x: &Array,
        norm_a: &RmsNorm,
        scale: Option<&Array>,
        next: Option<&RmsNorm>,
    ) -> Result<Option<(Array, Option<Array>)>> {
        if !self.fuses(h) {
            return Ok(None);
        }
        norm::by_kernel(h, x, norm_a, scale, next, || self.kernel(&norm::SPEC))
    }

    fn decode_heads(
        &self,
        proj: &Array,
        layout: &HeadsLayout<'_>,
        rope: &RopeSpec<'_>,
        position: &Array,
    ) -> Result<Option<Heads>> {
        if !self.fuses(proj) {
            return Ok(None);
        }
        heads::by_kernel(proj, layout, rope, position, || self.kernel(&heads::SPEC))
    }

    fn geglu_halves(&self, joined: &Array, one: &Array) -> Result<Option<Array>> {
        if !self.fuses(joined) {
            return Ok(None);
        }
        let s = joined.shape();
        let width = s.last().copied().unwrap_or(0) / 2;
        let mut out_shape = s.clone();
        if let Some(last) = out_shape.last_mut() {
            *last = width;
        }
        let kernel = || self.kernel(&geglu::SPEC);
        geglu::by_kernel(joined, joined, one, width, 2 * width, 2 * width, &out_shape, kernel)
    }

    fn geglu_at(&self, gate: &Array, inputs: &Array, index: &Array) -> Result<Option<Array>> {
        let s = inputs.shape();
        if !self.fuses(gate) || s.len() != 4 || gate.shape() != [s[0], s[1], s[3]] {
            return Ok(None);
        }
        let width = s[3];
        let kernel = || self.kernel(&geglu::SPEC);
        geglu::by_kernel(gate, inputs, index, width, width, s[2] * width, &gate.shape(), kernel)
    }

    fn attend_one(&self, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Option<Array>> {
        if !attention::applies(q, k)? {
            return Ok(None);
        }
        self.attention().map(|kernels| kernels.attend(q, k, v, scale)).transpose()
    }

    fn attend_window(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        mask: mlx::fast::AttentionMask<'_>,
    ) -> Result<Option<Array>> {
        if !self.options.window_by_ops || q.dim(2)? > WINDOW_BY_OPS_MAX {
            return Ok(None);
        }
        super::mlx::attend_window_by_ops(q, k, v, scale, mask)
    }

    fn split_reads_above(&self) -> Option<usize> {
        Some(attention::SPLIT_ABOVE as usize)
    }

    fn gpu_clock(&self, after: &Array) -> Result<Option<Array>> {
        self.kernel(&clock::SPEC).map(|k| clock::by_kernel(&k, after)).transpose()
    }
}

/// Device helpers shared by the kernels.
const HEADER: &str = r"
template <int THREADS>
__device__ float quince_block_sum(float v, float* partial) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    partial[threadIdx.x >> 5] = v;
  }
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    total += partial[w];
  }
  return total;
}
";

fn float_bits(v: f32) -> TemplateArg {
    TemplateArg::Int(v.to_bits() as i32)
}

fn first_two(mut outputs: Vec<Array>, what: &str) -> Result<(Array, Array)> {
    if outputs.len() < 2 {
        return Err(Error::InvalidRequest(format!("the {what} kernel returned too few outputs")));
    }
    let second = outputs.swap_remove(1);
    Ok((outputs.swap_remove(0), second))
}

/// Worst absolute difference between two arrays, in f32.
fn worst(a: &Array, b: &Array) -> Result<f32> {
    let d = a.astype(Dtype::Float32)?.subtract(&b.astype(Dtype::Float32)?)?;
    Ok(d.abs()?.max_all(false)?.item::<f32>()?)
}

/// Deterministic probe values `[shape]` in about [-2, 2] (no random state is touched).
fn probe_values(shape: &[i32], seed: f64) -> Result<Array> {
    let n: i32 = shape.iter().product();
    let i = mlx::ops::arange(0.0, f64::from(n), 1.0, Dtype::Float32)?;
    Ok(i.multiply_scalar(0.7 + seed)?.sin()?.multiply_scalar(2.0)?.reshape(shape)?)
}

fn check_probe(name: &str, worst: f32) -> Result<()> {
    if worst > 1e-4 {
        return Err(Error::InvalidRequest(format!("the {name} probe is off by {worst}")));
    }
    Ok(())
}
