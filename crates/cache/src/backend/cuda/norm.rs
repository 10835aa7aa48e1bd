//! `h + norm_a(x)`, times a scalar, and the next norm of the result in one kernel: a layer's
//! residual adds with the norm that follows them.

use std::rc::Rc;

use mlx::Array;
use mlx::fast::{CudaKernel, Launch, TemplateArg};

use super::{Spec, check_probe, first_two, float_bits, probe_values, worst};
use crate::error::{Error, Result};
use crate::pointwise::RmsNorm;

const RESIDUAL_THREADS: i32 = 256;

/// Rows of `D` values, one block each. `SCALE` multiplies the sum by `scale[0]`; `NEXT`
/// writes the normed sum to `normed`. Rounds as MLX's `rms_norm` (x·n rounded, then times the
/// weight), add and multiply do.
const RESIDUAL_SOURCE: &str = r"
    constexpr int THREADS = 256;
    constexpr int PER = (D + THREADS - 1) / THREADS;
    __shared__ float partial[THREADS / 32];
    const float eps = __int_as_float(EPS_BITS);
    const long long base = static_cast<long long>(blockIdx.x) * D;
    float xs[PER];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = i * THREADS + threadIdx.x;
      const float v = e < D ? static_cast<float>(x[base + e]) : 0.f;
      xs[i] = v;
      ss += v * v;
    }
    const float na = rsqrt(quince_block_sum<THREADS>(ss, partial) / D + eps);
    float hs[PER];
    float ss2 = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = i * THREADS + threadIdx.x;
      hs[i] = 0.f;
      if (e < D) {
        const T a = wa[e] * static_cast<T>(xs[i] * na);
        T s = h[base + e] + a;
        if constexpr (SCALE) {
          s = s * scale[0];
        }
        h_out[base + e] = s;
        hs[i] = static_cast<float>(s);
        ss2 += hs[i] * hs[i];
      }
    }
    if constexpr (NEXT) {
      const float nb = rsqrt(quince_block_sum<THREADS>(ss2, partial) / D + eps);
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int e = i * THREADS + threadIdx.x;
        if (e < D) {
          normed[base + e] = wb[e] * static_cast<T>(hs[i] * nb);
        }
      }
    }
";

pub(super) static SPEC: Spec = Spec {
    name: "quince_residual_norm",
    inputs: &["h", "x", "wa", "scale", "wb"],
    outputs: &["h_out", "normed"],
    source: RESIDUAL_SOURCE,
    probe,
};

/// `h + norm_a(x)`, times `scale` when given, and `next` of that sum when given, over the last
/// axis of `[..., D]` rows; `None` where the kernel does not take these inputs (then the caller uses MLX ops).
pub(super) fn by_kernel(
    h: &Array,
    x: &Array,
    norm_a: &RmsNorm,
    scale: Option<&Array>,
    next: Option<&RmsNorm>,
    kernel: impl FnOnce() -> Option<Rc<CudaKernel>>,
) -> Result<Option<(Array, Option<Array>)>> {
    let dtype = h.dtype();
    let d = h.dim(-1)?;
    let same = |a: &Array| a.dtype() == dtype;
    let Some(wa) = norm_a.weight() else { return Ok(None) };
    let wb = match next {
        Some(n) => match n.weight() {
            Some(w) if n.eps() == norm_a.eps() => Some(w),
            _ => return Ok(None),
        },
        None => None,
    };
    if x.shape() != h.shape()
        || !same(x)
        || !same(wa)
        || wa.shape() != [d]
        || wb.is_some_and(|w| !same(w) || w.shape() != [d])
        || scale.is_some_and(|s| !same(s) || s.size() != 1)
        || d > RESIDUAL_THREADS * 16
    {
        return Ok(None);
    }
    let Some(kernel) = kernel() else { return Ok(None) };
    let rows = (h.size() / d as usize) as i32;
    let normed_shape: Vec<i32> = if next.is_some() { h.shape() } else { vec![1] };
    let outputs = kernel.call(
        &[h, x, wa, scale.unwrap_or(wa), wb.unwrap_or(wa)],
        &[(&h.shape(), dtype), (&normed_shape, dtype)],
        Launch { grid: [rows * RESIDUAL_THREADS, 1, 1], threadgroup: [RESIDUAL_THREADS, 1, 1] },
        &[
            ("T", TemplateArg::Dtype(dtype)),
            ("D", TemplateArg::Int(d)),
            ("EPS_BITS", float_bits(norm_a.eps())),
            ("SCALE", TemplateArg::Bool(scale.is_some())),
            ("NEXT", TemplateArg::Bool(next.is_some())),
        ],
    )?;
    let (sum, normed) = first_two(outputs, "residual norm")?;
    Ok(Some((sum, next.map(|_| normed))))
}

fn probe(kernel: &Rc<CudaKernel>) -> Result<()> {
    let d = 320; // not a multiple of the block: the tail is masked
    let h = probe_values(&[2, 1, d], 0.0)?;
    let x = probe_values(&[2, 1, d], 0.3)?;
    let a = RmsNorm::new(probe_values(&[d], 0.5)?, 1e-6);
    let b = RmsNorm::new(probe_values(&[d], 0.9)?, 1e-6);
    let s = Array::from_slice(&[0.75f32], &[1])?;
    let Some((sum, normed)) =
        by_kernel(&h, &x, &a, Some(&s), Some(&b), || Some(Rc::clone(kernel)))?
    else {
        return Err(Error::InvalidRequest("the residual probe's inputs were refused".into()));
    };
    let (want_sum, want_normed) =
        crate::backend::mlx::residual_norm(&h, &x, &a, Some(&s), Some(&b))?;
    let normed = normed.ok_or_else(|| Error::InvalidRequest("no normed output".into()))?;
    let want_normed = want_normed.ok_or_else(|| Error::InvalidRequest("no normed sum".into()))?;
    check_probe("residual norm", worst(&sum, &want_sum)?.max(worst(&normed, &want_normed)?))
}
