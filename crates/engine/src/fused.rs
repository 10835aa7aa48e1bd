//! Fused kernels for the small ops of a decode step on CUDA, each with the MLX ops it
//! replaces as the route everywhere else.
//!
//! On a fast GPU a decode step was bound by host time: MLX-CUDA records every op into a CUDA
//! graph, at 3–5 µs of host time each (`tests/bench/op_cost.py`), and a Gemma 4 E4B step
//! was 1,390 ops (622 with these kernels; on the H200 the host now submits a step in less
//! time than the GPU takes to run it). Each function here does in one kernel what takes two
//! to ten MLX ops:
//!
//! - [`residual_norm`]: `h + norm_a(x)`, times a scalar, and the next norm of the result
//!   (a layer's residual adds with the norm that follows them);
//! - [`decode_heads`]: q/k/v heads out of one stacked projection, with their per-head norms
//!   and rotary embedding, for one position;
//! - [`geglu_halves`], [`geglu_at`]: `gelu(gate) · up` reading the two halves of a stacked
//!   projection, or one layer's slice of the per-layer inputs;
//! - [`quantized_matvec`] (on by default, [`set_quantized_kernel`]): a 4-bit matrix-vector product
//!   that reads each weight once for up to 7 rows (it sums in fp32 in its own order, so its
//!   outputs agree with MLX's within bf16 rounding, not bit for bit).
//!
//! Every kernel keeps MLX's rounding: each op of the route it replaces rounds to the
//! activation dtype where MLX's does (the same values, except where a sum of squares is added
//! in a different order). Each is probed on first use against its MLX route; one that fails
//! to build or to agree is turned off with a warning. The kernels need the CUDA backend, a
//! floating point dtype and row-contiguous rows; a compiled (traced) step always takes the MLX
//! route, because a custom kernel's output shape cannot be inferred in a shapeless graph.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};

use mlx::fast::{CudaKernel, Launch, TemplateArg};
use mlx::quantized::QuantizedMatrix;
use mlx::{Array, Dtype};

use crate::error::{Error, Result};
use crate::nn::{Activations, RmsNorm};

static FUSION_OFF: AtomicBool = AtomicBool::new(false);

/// Turns the fused decode kernels on or off for every thread (on by default; off is MLX ops
/// everywhere, for A/B runs: `quince bench --decode-fusion off`).
pub fn set_decode_fusion(on: bool) {
    FUSION_OFF.store(!on, Ordering::Relaxed);
}

/// Whether the fused kernels are on (see [`set_decode_fusion`]); they still run only on CUDA.
pub fn decode_fusion() -> bool {
    !FUSION_OFF.load(Ordering::Relaxed)
}

/// The kernels built and probed on this thread that passed (for tests: on CUDA a test can
/// check that the kernels it compares really ran).
pub fn kernels_in_use() -> Vec<&'static str> {
    let mut names: Vec<&'static str> =
        BUILT.with(|b| b.borrow().iter().filter(|(_, k)| k.is_some()).map(|(n, _)| *n).collect());
    names.sort_unstable();
    names
}

/// Whether a kernel may run for `x` now.
fn applies(x: &Array) -> bool {
    decode_fusion()
        && mlx::Backend::current() == mlx::Backend::Cuda
        && !crate::cache::tracing()
        && matches!(x.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// A kernel's declaration and the check that it agrees with its MLX route.
struct Spec {
    name: &'static str,
    inputs: &'static [&'static str],
    outputs: &'static [&'static str],
    source: &'static str,
    probe: fn(&Rc<CudaKernel>) -> Result<()>,
}

thread_local! {
    /// Kernels declared and probed on this thread; `None` for one that failed its probe.
    static BUILT: RefCell<HashMap<&'static str, Option<Rc<CudaKernel>>>> =
        RefCell::new(HashMap::new());
}

/// The kernel of `spec`, declared and probed on first use; `None` when it is off.
fn kernel(spec: &Spec) -> Option<Rc<CudaKernel>> {
    if let Some(known) = BUILT.with(|b| b.borrow().get(spec.name).cloned()) {
        return known;
    }
    let built =
        CudaKernel::with_layout(spec.name, spec.inputs, spec.outputs, spec.source, HEADER, true)
            .map_err(Error::from)
            .map(Rc::new)
            .and_then(|k| (spec.probe)(&k).map(|()| k));
    let kept = match built {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::warn!("the fused kernel {} is off, decode uses MLX ops: {e}", spec.name);
            None
        }
    };
    BUILT.with(|b| b.borrow_mut().insert(spec.name, kept.clone()));
    kept
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

// ---------------------------------------------------------------------------------------------
// residual_norm

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

static RESIDUAL: Spec = Spec {
    name: "quince_residual_norm",
    inputs: &["h", "x", "wa", "scale", "wb"],
    outputs: &["h_out", "normed"],
    source: RESIDUAL_SOURCE,
    probe: probe_residual,
};

/// `h + norm_a(x)`, times `scale` when given, and `next` of that sum when given: returns the
/// sum and its norm. Over the last axis of `[..., D]` rows.
pub fn residual_norm(
    h: &Array,
    x: &Array,
    norm_a: &RmsNorm,
    scale: Option<&Array>,
    next: Option<&RmsNorm>,
) -> Result<(Array, Option<Array>)> {
    if applies(h)
        && let Some(out) = residual_by_kernel(h, x, norm_a, scale, next, || kernel(&RESIDUAL))?
    {
        return Ok(out);
    }
    residual_by_ops(h, x, norm_a, scale, next)
}

fn residual_by_ops(
    h: &Array,
    x: &Array,
    norm_a: &RmsNorm,
    scale: Option<&Array>,
    next: Option<&RmsNorm>,
) -> Result<(Array, Option<Array>)> {
    let mut sum = h.add(&norm_a.forward(x)?)?;
    if let Some(s) = scale {
        sum = sum.multiply(s)?;
    }
    let normed = next.map(|n| n.forward(&sum)).transpose()?;
    Ok((sum, normed))
}

/// `None` where the kernel does not take these inputs (then the caller uses MLX ops).
fn residual_by_kernel(
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

fn probe_residual(kernel: &Rc<CudaKernel>) -> Result<()> {
    let d = 320; // not a multiple of the block: the tail is masked
    let h = probe_values(&[2, 1, d], 0.0)?;
    let x = probe_values(&[2, 1, d], 0.3)?;
    let a = RmsNorm::new(probe_values(&[d], 0.5)?, 1e-6);
    let b = RmsNorm::new(probe_values(&[d], 0.9)?, 1e-6);
    let s = Array::from_slice(&[0.75f32], &[1])?;
    let Some((sum, normed)) =
        residual_by_kernel(&h, &x, &a, Some(&s), Some(&b), || Some(Rc::clone(kernel)))?
    else {
        return Err(Error::InvalidRequest("the residual probe's inputs were refused".into()));
    };
    let (want_sum, want_normed) = residual_by_ops(&h, &x, &a, Some(&s), Some(&b))?;
    let normed = normed.ok_or_else(|| Error::InvalidRequest("no normed output".into()))?;
    let want_normed = want_normed.ok_or_else(|| Error::InvalidRequest("no normed sum".into()))?;
    check_probe("residual norm", worst(&sum, &want_sum)?.max(worst(&normed, &want_normed)?))
}

// ---------------------------------------------------------------------------------------------
// decode_heads

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

static HEADS: Spec = Spec {
    name: "quince_decode_heads",
    inputs: &["proj", "qw", "kw", "pos", "freqs"],
    outputs: &["q_out", "k_out", "v_out"],
    source: HEADS_SOURCE,
    probe: probe_heads,
};

/// Query heads and, for a layer with its own, key and value heads, each `[B, H, 1, D]`.
#[derive(Debug, Clone)]
pub struct Heads {
    /// Queries, normed and rotated.
    pub q: Array,
    /// Keys (normed, rotated) and values (normed).
    pub kv: Option<(Array, Array)>,
}

/// Rotary embedding as the heads kernel applies it (MLX's `fast::rope` with scale 1 over the
/// whole head).
#[derive(Debug, Clone, Copy)]
pub struct RopeSpec<'a> {
    /// Rotate interleaved pairs instead of halves.
    pub traditional: bool,
    /// θ, when `freqs` is `None`.
    pub base: f32,
    /// Periods per pair (f32 `[D/2]`), replacing θ.
    pub freqs: Option<&'a Array>,
}

/// Where the heads of a stacked projection are, in units of the head size `D`.
#[derive(Debug, Clone, Copy)]
pub struct HeadsLayout<'a> {
    /// Head size.
    pub head_dim: i32,
    /// Query heads, at the start of the projection.
    pub q_heads: i32,
    /// Key heads (0 for a layer without its own keys), right after the queries; as many value
    /// heads follow.
    pub kv_heads: i32,
    /// First projection head the values are read from: `q_heads + kv_heads` after the keys,
    /// or `q_heads` for values taken from the raw keys (`attention_k_eq_v`).
    pub values_at: i32,
    /// Query norm.
    pub q_norm: &'a RmsNorm,
    /// Key norm (any norm when `kv_heads` is 0).
    pub k_norm: &'a RmsNorm,
}

/// The query, key and value heads `[B, H, 1, D]` of one position from a stacked projection
/// `proj` `[B, 1, N]`, normed and rotated to `position` (an int32 scalar array). `None` where
/// the kernel does not run (not CUDA, a traced step, a shape or dtype it does not take): then
/// the caller goes through MLX ops. `kv` is `None` when `kv_heads` is 0.
pub fn decode_heads(
    proj: &Array,
    layout: &HeadsLayout<'_>,
    rope: &RopeSpec<'_>,
    position: &Array,
) -> Result<Option<Heads>> {
    if !applies(proj) {
        return Ok(None);
    }
    heads_by_kernel(proj, layout, rope, position, || kernel(&HEADS))
}

fn heads_by_kernel(
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

/// The MLX route of [`decode_heads`] (what the model does without the kernel), for probes
/// and tests: slices of the projection, per-head norms, `fast::rope`.
pub fn decode_heads_by_ops(
    proj: &Array,
    layout: &HeadsLayout<'_>,
    rope: &RopeSpec<'_>,
    position: i32,
) -> Result<Heads> {
    let s = proj.shape();
    let (b, d) = (s[0], layout.head_dim);
    let heads = |at: i32, n: i32, norm: &RmsNorm, rotate: bool| -> Result<Array> {
        let part = proj.slice(&[0, 0, at * d], &[b, 1, (at + n) * d], &[1, 1, 1])?;
        let normed = norm.forward(&part.reshape(&[b, n, 1, d])?)?;
        if !rotate {
            return Ok(normed);
        }
        let frequencies = match rope.freqs {
            Some(f) => mlx::fast::RopeFrequencies::Custom(f),
            None => mlx::fast::RopeFrequencies::Base(rope.base),
        };
        Ok(mlx::fast::rope(
            &normed,
            d,
            rope.traditional,
            frequencies,
            1.0,
            mlx::fast::RopeOffset::Fixed(position),
        )?)
    };
    let q = heads(0, layout.q_heads, layout.q_norm, true)?;
    if layout.kv_heads == 0 {
        return Ok(Heads { q, kv: None });
    }
    let k = heads(layout.q_heads, layout.kv_heads, layout.k_norm, true)?;
    let v =
        heads(layout.values_at, layout.kv_heads, &RmsNorm::unscaled(layout.q_norm.eps()), false)?;
    Ok(Heads { q, kv: Some((k, v)) })
}

fn probe_heads(kernel: &Rc<CudaKernel>) -> Result<()> {
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
        let Some(got) = heads_by_kernel(&proj, &layout, &rope, &Array::scalar(position)?, || {
            Some(Rc::clone(kernel))
        })?
        else {
            return Err(Error::InvalidRequest("the heads probe's inputs were refused".into()));
        };
        let want = decode_heads_by_ops(&proj, &layout, &rope, position)?;
        off = off.max(worst(&got.q, &want.q)?);
        if let (Some((k, v)), Some((wk, wv))) = (&got.kv, &want.kv) {
            off = off.max(worst(k, wk)?).max(worst(v, wv)?);
        }
    }
    check_probe("decode heads", off)
}

// ---------------------------------------------------------------------------------------------
// GELU-gated products

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

static GEGLU: Spec = Spec {
    name: "quince_geglu",
    inputs: &["gate", "side", "at"],
    outputs: &["out"],
    source: GEGLU_SOURCE,
    probe: probe_geglu,
};

#[allow(clippy::too_many_arguments)]
fn geglu_by_kernel(
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

/// `gelu_approx(gate) · up` by the kernel where `joined` `[..., 2W]` holds `gate` then `up`
/// (a stacked projection); `one` is the int32 scalar 1 (where `up` starts, in units of `W`).
/// `None` where the kernel does not run: then the caller splits `joined` and calls
/// [`Activations::geglu`].
pub fn geglu_halves(joined: &Array, one: &Array) -> Result<Option<Array>> {
    let s = joined.shape();
    let width = s.last().copied().unwrap_or(0) / 2;
    let mut out_shape = s.clone();
    if let Some(last) = out_shape.last_mut() {
        *last = width;
    }
    if !applies(joined) {
        return Ok(None);
    }
    geglu_by_kernel(joined, joined, one, width, 2 * width, 2 * width, &out_shape, || kernel(&GEGLU))
}

/// `gelu_approx(gate) · inputs[..., layer, :]` for per-layer inputs `[B, T, L, W]` and a
/// gate `[B, T, W]`; `index` is `layer` as an int32 scalar array.
pub fn geglu_at(
    gate: &Array,
    inputs: &Array,
    layer: i32,
    index: &Array,
    act: &Activations,
) -> Result<Array> {
    let s = inputs.shape();
    if s.len() != 4 {
        return Err(Error::InvalidRequest(format!("per-layer inputs of shape {s:?}")));
    }
    let width = s[3];
    if applies(gate)
        && gate.shape() == [s[0], s[1], width]
        && let Some(out) =
            geglu_by_kernel(gate, inputs, index, width, width, s[2] * width, &gate.shape(), || {
                kernel(&GEGLU)
            })?
    {
        return Ok(out);
    }
    let slice = if crate::cache::tracing() {
        // A shapeless compiled step replays a gather; MLX's `Slice` cannot infer its shape.
        inputs.take(index, 2)?
    } else {
        // A view: two ops that record no kernel.
        let one = inputs.slice(&[0, 0, layer, 0], &[s[0], s[1], layer + 1, width], &[1; 4])?;
        one.reshape(&[s[0], s[1], width])?
    };
    act.geglu(gate, &slice)
}

fn probe_geglu(kernel: &Rc<CudaKernel>) -> Result<()> {
    let act = Activations::new()?;
    let w = 300;
    let joined = probe_values(&[2, 1, 2 * w], 0.6)?;
    let one = Array::scalar(1i32)?;
    let Some(got) = geglu_by_kernel(&joined, &joined, &one, w, 2 * w, 2 * w, &[2, 1, w], || {
        Some(Rc::clone(kernel))
    })?
    else {
        return Err(Error::InvalidRequest("the GEGLU probe's inputs were refused".into()));
    };
    let halves = split_last(&joined, &[w, w], &[])?;
    let want = act.geglu(&halves[0], &halves[1])?;
    check_probe("GEGLU", worst(&got, &want)?)
}

// ---------------------------------------------------------------------------------------------
// quantized_matvec

static QMV_ON: AtomicBool = AtomicBool::new(true);

/// Turns Quince's 4-bit matrix-vector kernel on or off for the products of a decode step on
/// CUDA (on by default: on the H200 it took an E4B 4-bit step's GPU time from 6.7 to 5.3 ms;
/// `quince bench --quantized-kernel off` for A/B runs).
pub fn set_quantized_kernel(on: bool) {
    QMV_ON.store(on, Ordering::Relaxed);
}

/// Whether the 4-bit matrix-vector kernel is on (see [`set_quantized_kernel`]).
pub fn quantized_kernel() -> bool {
    QMV_ON.load(Ordering::Relaxed)
}

/// The kernel's body (`crates/engine/src/qmv4.cu`; `tests/bench/qmv_probe.py` times it).
const QMV_SOURCE: &str = include_str!("qmv4.cu");
const QMV_THREADS: i32 = 128;
/// Rows of `x` one launch takes: it reads each weight once for all of them.
const QMV_MAX_ROWS: usize = 7;

static QMV: Spec = Spec {
    name: "quince_qmv4",
    inputs: &["x", "w", "scales", "biases"],
    outputs: &["y"],
    source: QMV_SOURCE,
    probe: probe_qmv,
};

/// `x · Wᵀ` by Quince's kernel for `q` affine 4-bit in groups of 64 with bf16 scales and up to
/// 7 rows of bf16 `x` whose width is a multiple of 512; `None` where it does not run (then the
/// caller uses MLX's product).
pub fn quantized_matvec(x: &Array, q: &QuantizedMatrix) -> Result<Option<Array>> {
    if !quantized_kernel() || !applies(x) {
        return Ok(None);
    }
    qmv_by_kernel(x, q, || kernel(&QMV))
}

fn qmv_by_kernel(
    x: &Array,
    q: &QuantizedMatrix,
    kernel: impl FnOnce() -> Option<Rc<CudaKernel>>,
) -> Result<Option<Array>> {
    let k = x.dim(-1)?;
    let bf16 = |a: &Array| a.dtype() == Dtype::Bfloat16;
    if !bf16(x)
        || !bf16(&q.scales)
        || !bf16(&q.biases)
        || q.bits != 4
        || q.group_size != 64
        || q.weight.ndim() != 2
        || k % 512 != 0
        || q.weight.dim(1)? != k / 8
    {
        return Ok(None);
    }
    let rows = x.size() / k as usize;
    if rows == 0 || rows > QMV_MAX_ROWS {
        return Ok(None);
    }
    let Some(kernel) = kernel() else { return Ok(None) };
    let n = q.weight.dim(0)?;
    let mut out_shape = x.shape();
    if let Some(last) = out_shape.last_mut() {
        *last = n;
    }
    let outputs = kernel.call(
        &[x, &q.weight, &q.scales, &q.biases],
        &[(&out_shape, Dtype::Bfloat16)],
        // One warp per output column.
        Launch { grid: [n * 32, 1, 1], threadgroup: [QMV_THREADS, 1, 1] },
        &[
            ("M", TemplateArg::Int(rows as i32)),
            ("R", TemplateArg::Int(1)),
            ("K", TemplateArg::Int(k)),
            ("N", TemplateArg::Int(n)),
        ],
    )?;
    Ok(outputs.into_iter().next())
}

/// Against the exact product of the same packed matrix (dequantized, in fp32), for one row and
/// for three: within 1 % of the largest output. Not against MLX's product: on the probe's smooth
/// values (outputs that are small sums of large terms) MLX-CUDA's own product differs from this
/// one by ~2 % of the largest output (seen on the H200; bf16 rounding inside its kernel, most
/// likely), and the kernel was refused for it.
fn probe_qmv(kernel: &Rc<CudaKernel>) -> Result<()> {
    let (n, k) = (40, 1024);
    let w = probe_values(&[n, k], 0.2)?.multiply_scalar(0.05)?.astype(Dtype::Bfloat16)?;
    let q = mlx::quantized::quantize(&w, 64, 4)?;
    let exact_w = q.dequantize()?.astype(Dtype::Float32)?.transpose(&[1, 0])?;
    for rows in [1, 3] {
        let x = probe_values(&[rows, k], 0.4)?.astype(Dtype::Bfloat16)?;
        let Some(got) = qmv_by_kernel(&x, &q, || Some(Rc::clone(kernel)))? else {
            return Err(Error::InvalidRequest("the 4-bit product probe was refused".into()));
        };
        let want = x.astype(Dtype::Float32)?.matmul(&exact_w)?;
        let scale = want.abs()?.max_all(false)?.item::<f32>()?;
        let off = worst(&got, &want)?;
        if off > 1e-2 * scale.max(1e-3) {
            return Err(Error::InvalidRequest(format!(
                "the 4-bit product probe is off by {off} (largest output {scale})"
            )));
        }
    }
    Ok(())
}

/// Splits the last axis of `x` into parts of `sizes`: views, or, inside a traced step, gathers
/// by `indices` (one int32 index array per part: MLX's `Slice` cannot infer its output shape
/// in a shapeless graph).
pub fn split_last(x: &Array, sizes: &[i32], indices: &[Array]) -> Result<Vec<Array>> {
    let s = x.shape();
    let axis = s.len() as i32 - 1;
    if crate::cache::tracing() {
        return indices.iter().map(|index| Ok(x.take(index, axis)?)).collect();
    }
    let mut parts = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &n in sizes {
        let mut start = vec![0; s.len()];
        let mut stop = s.clone();
        start[axis as usize] = at;
        stop[axis as usize] = at + n;
        parts.push(x.slice(&start, &stop, &vec![1; s.len()])?);
        at += n;
    }
    Ok(parts)
}

/// The index arrays [`split_last`] gathers by inside a traced step, made once (evaluated:
/// a trace captures them as constants).
pub fn split_indices(sizes: &[i32]) -> Result<Vec<Array>> {
    let mut at = 0;
    let mut indices = Vec::with_capacity(sizes.len());
    for &n in sizes {
        indices.push(mlx::ops::arange(f64::from(at), f64::from(at + n), 1.0, Dtype::Int32)?);
        at += n;
    }
    mlx::eval(&indices.iter().collect::<Vec<_>>())?;
    Ok(indices)
}

// ---------------------------------------------------------------------------------------------
// gpu_clock

/// One thread reads the GPU's global nanosecond timer. The input is not read: it only orders
/// the launch after the op that wrote it.
const CLOCK_SOURCE: &str = r#"
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    now[0] = t;
"#;

static CLOCK: Spec = Spec {
    name: "quince_gpu_clock",
    inputs: &["after"],
    outputs: &["now"],
    source: CLOCK_SOURCE,
    probe: probe_clock,
};

/// The GPU's clock in ns (a `uint64` scalar) read once `after` is written: a diagnostic for
/// timing a stretch of GPU work from inside the stream (`quince bench --gpu-clock`). `None`
/// off CUDA.
pub fn gpu_clock(after: &Array) -> Result<Option<Array>> {
    if mlx::Backend::current() != mlx::Backend::Cuda {
        return Ok(None);
    }
    let Some(k) = kernel(&CLOCK) else { return Ok(None) };
    clock_by(&k, after).map(Some)
}

fn clock_by(kernel: &CudaKernel, after: &Array) -> Result<Array> {
    let out = kernel.call(
        &[after],
        &[(&[], Dtype::Uint64)],
        Launch { grid: [1, 1, 1], threadgroup: [1, 1, 1] },
        &[],
    )?;
    out.into_iter()
        .next()
        .ok_or_else(|| Error::InvalidRequest("the clock kernel returned no output".into()))
}

fn probe_clock(kernel: &Rc<CudaKernel>) -> Result<()> {
    let first = clock_by(kernel, &Array::scalar(0i32)?)?;
    let second = clock_by(kernel, &first)?;
    mlx::eval(&[&first, &second])?;
    let (a, b) = (first.item::<u64>()?, second.item::<u64>()?);
    if a == 0 || b < a {
        return Err(Error::InvalidRequest(format!("the GPU clock read {a} then {b}")));
    }
    Ok(())
}
