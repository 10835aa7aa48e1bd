//! `gelu(gate) · up` reading the two halves of a stacked projection, or one layer's slice of
//! the per-layer inputs, in one kernel.

use std::rc::Rc;

use mlx::fast::{CudaKernel, Launch, TemplateArg};
use mlx::{Array, Dtype};

use super::{Spec, check_probe, probe_values, worst};
use crate::error::{Error, Result};
use crate::pointwise::Activations;

const GEGLU_THREADS: i32 = 256;

/// `gelu_approx(a) · b` over rows of `W`: `a` is row `r` of `gate` (stride `A_STRIDE`), `b`
/// the `W` values at `side + r · B_STRIDE + at[0] · W`. Every step of MLX's tanh GELU rounds
/// to `T`, as its compiled kernel does.
const GEGLU_SOURCE: &str = r"
    constexpr int THREADS = 256;
    const long long r = blockIdx.y;
    const int e = blockIdx.x * THREADS + threadIdx.x;
    if (e >= W) {
      return;
    }
    const T x = gate[r * A_STRIDE + e];
    const T u = side[r * B_STRIDE + static_cast<long long>(at[0]) * W + e];
    const T cube = static_cast<T>(pow(static_cast<float>(x), 3.0f));
    const T inner = x + cube * static_cast<T>(0.044715f);
    const T t = static_cast<T>(tanh(static_cast<float>(inner * static_cast<T>(0.7978845608028654f))));
    const T g = (x * static_cast<T>(0.5f)) * (t + static_cast<T>(1.0f));
    out[r * W + e] = g * u;
";

pub(super) static SPEC: Spec = Spec {
    name: "quince_geglu",
    inputs: &["gate", "side", "at"],
    outputs: &["out"],
    source: GEGLU_SOURCE,
    probe,
};

/// The kernel over `gate` and `side` (see [`GEGLU_SOURCE`]); `None` where it does not take them.
#[allow(clippy::too_many_arguments)]
pub(super) fn by_kernel(
    gate: &Array,
    side: &Array,
    at: &Array,
    width: i32,
    a_stride: i32,
    b_stride: i32,
    out_shape: &[i32],
    kernel: impl FnOnce() -> Option<Rc<CudaKernel>>,
) -> Result<Option<Array>> {
    let dtype = gate.dtype();
    if side.dtype() != dtype || at.dtype() != Dtype::Int32 || at.size() != 1 {
        return Ok(None);
    }
    let Some(kernel) = kernel() else { return Ok(None) };
    let rows = (gate.size() / a_stride as usize) as i32;
    let blocks = (width + GEGLU_THREADS - 1) / GEGLU_THREADS;
    let outputs = kernel.call(
        &[gate, side, at],
        &[(out_shape, dtype)],
        Launch { grid: [blocks * GEGLU_THREADS, rows, 1], threadgroup: [GEGLU_THREADS, 1, 1] },
        &[
            ("T", TemplateArg::Dtype(dtype)),
            ("W", TemplateArg::Int(width)),
            ("A_STRIDE", TemplateArg::Int(a_stride)),
            ("B_STRIDE", TemplateArg::Int(b_stride)),
        ],
    )?;
    Ok(outputs.into_iter().next())
}

fn probe(kernel: &Rc<CudaKernel>) -> Result<()> {
    let act = Activations::new()?;
    let w = 300;
    let joined = probe_values(&[2, 1, 2 * w], 0.6)?;
    let one = Array::scalar(1i32)?;
    let Some(got) =
        by_kernel(&joined, &joined, &one, w, 2 * w, 2 * w, &[2, 1, w], || Some(Rc::clone(kernel)))?
    else {
        return Err(Error::InvalidRequest("the GEGLU probe's inputs were refused".into()));
    };
    let halves = crate::backend::mlx::split_last(&joined, &[w, w])?;
    let want = act.geglu(&halves[0], &halves[1])?;
    check_probe("GEGLU", worst(&got, &want)?)
}
