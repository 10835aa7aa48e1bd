//! The q/k/v heads of one position out of one stacked projection, with their per-head norms
//! and rotary embedding, in one kernel.

use std::rc::Rc;

use mlx::fast::{CudaKernel, Launch, TemplateArg};
use mlx::{Array, Dtype};

use super::{Spec, check_probe, float_bits, probe_values, worst};
use crate::backend::mlx::{Heads, HeadsLayout, RopeSpec, decode_heads};
use crate::error::{Error, Result};
use crate::pointwise::RmsNorm;

const HEADS_THREADS: i32 = 128;

/// One block per (row, output head). Head `g` of a row is a query head (`g < HQ`), a key head
/// (`g < HQ + HK`) or a value head, read from projection head `VSRC + g − HQ − HK`. Query and
/// key heads are normed with their weight and rotated; value heads are normed without one.
/// The rotation is MLX's: pairs `(j, j + D/2)` (`(2j, 2j + 1)` when `TRAD`), angle
/// `pos · inv_freq(j)`, rotated in f32 from the rounded norm output.
const HEADS_SOURCE: &str = r"
    constexpr int THREADS = 128;
    constexpr int HALF = D / 2;
    constexpr int PAIRS = (HALF + THREADS - 1) / THREADS;
    constexpr int PER_ROW = HQ + 2 * HK;
    __shared__ float partial[THREADS / 32];
    const float eps = __int_as_float(EPS_BITS);
    const int row = blockIdx.x / PER_ROW;
    const int g = blockIdx.x - row * PER_ROW;
    int src = g;
    const T* w = qw;
    T* dst;
    bool rotate = true;
    if (g < HQ) {
      dst = q_out + (static_cast<long long>(row) * HQ + g) * D;
    } else if (g < HQ + HK) {
      w = kw;
      dst = k_out + (static_cast<long long>(row) * HK + (g - HQ)) * D;
    } else {
      src = VSRC + (g - HQ - HK);
      w = nullptr;
      rotate = false;
      dst = v_out + (static_cast<long long>(row) * HK + (g - HQ - HK)) * D;
    }
    const T* xr = proj + static_cast<long long>(row) * proj_shape[2] + src * D;
    float x1[PAIRS];
    float x2[PAIRS];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const int j = i * THREADS + threadIdx.x;
      x1[i] = 0.f;
      x2[i] = 0.f;
      if (j < HALF) {
        const int e1 = TRAD ? 2 * j : j;
        const int e2 = TRAD ? 2 * j + 1 : j + HALF;
        x1[i] = static_cast<float>(xr[e1]);
        x2[i] = static_cast<float>(xr[e2]);
      }
      ss += x1[i] * x1[i] + x2[i] * x2[i];
    }
    const float n = rsqrt(quince_block_sum<THREADS>(ss, partial) / D + eps);
    const float position = static_cast<float>(pos[0]);
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const int j = i * THREADS + threadIdx.x;
      if (j < HALF) {
        const int e1 = TRAD ? 2 * j : j;
        const int e2 = TRAD ? 2 * j + 1 : j + HALF;
        T a1 = static_cast<T>(x1[i] * n);
        T a2 = static_cast<T>(x2[i] * n);
        if (w != nullptr) {
          a1 = w[e1] * a1;
          a2 = w[e2] * a2;
        }
        if (rotate) {
          float inv_freq;
          if constexpr (CUSTOM) {
            inv_freq = 1.0 / freqs[j];
          } else {
            const float d = static_cast<float>(j) / static_cast<float>(HALF);
            inv_freq = exp2(-d * __int_as_float(BASE_LOG2_BITS));
          }
          const float theta = position * inv_freq;
          const float c = cos(theta);
          const float s = sin(theta);
          const float f1 = static_cast<float>(a1);
          const float f2 = static_cast<float>(a2);
          dst[e1] = static_cast<T>(f1 * c - f2 * s);
          dst[e2] = static_cast<T>(f1 * s + f2 * c);
        } else {
          dst[e1] = a1;
          dst[e2] = a2;
        }
      }
    }
";

pub(super) static SPEC: Spec = Spec {
    name: "quince_decode_heads",
    inputs: &["proj", "qw", "kw", "pos", "freqs"],
    outputs: &["q_out", "k_out", "v_out"],
    source: HEADS_SOURCE,
    probe,
};

/// The heads by the kernel; `None` where it does not take these inputs.
pub(super) fn by_kernel(
    proj: &Array,
    layout: &HeadsLayout<'_>,
    rope: &RopeSpec<'_>,
    position: &Array,
    kernel: impl FnOnce() -> Option<Rc<CudaKernel>>,
) -> Result<Option<Heads>> {
    let dtype = proj.dtype();
    let s = proj.shape();
    let d = layout.head_dim;
    let (hq, hk) = (layout.q_heads, layout.kv_heads);
    let Some(qw) = layout.q_norm.weight() else { return Ok(None) };
    let kw = if hk > 0 {
        match layout.k_norm.weight() {
            Some(w) if layout.k_norm.eps() == layout.q_norm.eps() => w,
            _ => return Ok(None),
        }
    } else {
        qw
    };
    let heads_in = s.last().copied().unwrap_or(0) / d.max(1);
    let values_end = layout.values_at + hk;
    if s.len() != 3
        || s[1] != 1
        || d % 2 != 0
        || d / 2 > HEADS_THREADS * 4
        || heads_in < hq + hk
        || (hk > 0 && values_end > heads_in)
        || qw.dtype() != dtype
        || kw.dtype() != dtype
        || qw.shape() != [d]
        || kw.shape() != [d]
        || position.dtype() != Dtype::Int32
        || rope.freqs.is_some_and(|f| f.dtype() != Dtype::Float32 || f.size() != (d / 2) as usize)
    {
        return Ok(None);
    }
    let Some(kernel) = kernel() else { return Ok(None) };
    let b = s[0];
    let kv_shape: Vec<i32> = if hk > 0 { vec![b, hk, 1, d] } else { vec![1] };
    let outputs = kernel.call(
        // Without periods the kernel never reads `freqs`; the position stands in (a type the
        // discarded branch still compiles with).
        &[proj, qw, kw, position, rope.freqs.unwrap_or(position)],
        &[(&[b, hq, 1, d], dtype), (&kv_shape, dtype), (&kv_shape, dtype)],
        Launch {
            grid: [b * (hq + 2 * hk) * HEADS_THREADS, 1, 1],
            threadgroup: [HEADS_THREADS, 1, 1],
        },
        &[
            ("T", TemplateArg::Dtype(dtype)),
            ("D", TemplateArg::Int(d)),
            ("HQ", TemplateArg::Int(hq)),
            ("HK", TemplateArg::Int(hk)),
            ("VSRC", TemplateArg::Int(layout.values_at)),
            ("TRAD", TemplateArg::Bool(rope.traditional)),
            ("CUSTOM", TemplateArg::Bool(rope.freqs.is_some())),
            ("BASE_LOG2_BITS", float_bits(rope.base.log2())),
            ("EPS_BITS", float_bits(layout.q_norm.eps())),
        ],
    )?;
    let mut outputs = outputs.into_iter();
    let (Some(q), Some(k), Some(v)) = (outputs.next(), outputs.next(), outputs.next()) else {
        return Err(Error::InvalidRequest("the heads kernel returned too few outputs".into()));
    };
    Ok(Some(Heads { q, kv: (hk > 0).then_some((k, v)) }))
}

/// Against the MLX route ([`decode_heads`]) at position 37, with and without custom periods.
fn probe(kernel: &Rc<CudaKernel>) -> Result<()> {
    let d = 64;
    let proj = probe_values(&[2, 1, 5 * d], 0.1)?;
    let (qn, kn) = (
        RmsNorm::new(probe_values(&[d], 0.4)?, 1e-6),
        RmsNorm::new(probe_values(&[d], 0.8)?, 1e-6),
    );
    let layout = HeadsLayout {
        head_dim: d,
        q_heads: 3,
        kv_heads: 1,
        values_at: 4,
        q_norm: &qn,
        k_norm: &kn,
    };
    let freqs = probe_values(&[d / 2], 0.2)?.abs()?.add_scalar(1.0)?.multiply_scalar(40.0)?;
    let mut off = 0f32;
    for rope in [
        RopeSpec { traditional: false, base: 10_000.0, freqs: None },
        RopeSpec { traditional: true, base: 10_000.0, freqs: Some(&freqs) },
    ] {
        let position = 37;
        let Some(got) = by_kernel(&proj, &layout, &rope, &Array::scalar(position)?, || {
            Some(Rc::clone(kernel))
        })?
        else {
            return Err(Error::InvalidRequest("the heads probe's inputs were refused".into()));
        };
        let want = decode_heads(&proj, &layout, &rope, position)?;
        off = off.max(worst(&got.q, &want.q)?);
        if let (Some((k, v)), Some((wk, wv))) = (&got.kv, &want.kv) {
            off = off.max(worst(k, wk)?).max(worst(v, wv)?);
        }
    }
    check_probe("decode heads", off)
}
