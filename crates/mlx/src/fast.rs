//! Fused kernels (`mlx::core::fast`): norms, rotary embeddings, attention.

use mlx_sys::ffi;

use crate::array::{Array, opt_ptr};
use crate::error::{Result, check};

/// RMS normalization over the last axis: `x / sqrt(mean(x²) + eps) · weight`.
#[track_caller]
#[allow(unsafe_code)]
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `weight`, which outlives the call.
    check(unsafe { ffi::rms_norm(x.raw(), opt_ptr(weight), eps) }).map(Array::wrap)
}

/// Layer normalization over the last axis, with optional affine `weight` and `bias`.
#[track_caller]
#[allow(unsafe_code)]
pub fn layer_norm(
    x: &Array,
    weight: Option<&Array>,
    bias: Option<&Array>,
    eps: f32,
) -> Result<Array> {
    // SAFETY: each pointer is null or borrows an argument that outlives the call.
    check(unsafe { ffi::layer_norm(x.raw(), opt_ptr(weight), opt_ptr(bias), eps) }).map(Array::wrap)
}

/// Where a rotary embedding takes its frequencies from.
#[derive(Debug, Clone, Copy)]
pub enum RopeFrequencies<'a> {
    /// `base^(-2i/dims)` for `i` in `0..dims/2`.
    Base(f32),
    /// Explicit per-pair *periods* (MLX divides positions by them), `dims/2` values, as used for
    /// scaled or proportional rope.
    Custom(&'a Array),
}

/// The position of the first row of `x`: a constant or an array (a scalar, or one offset per
/// batch row) so a compiled decode step can take the position as an input.
#[derive(Debug, Clone, Copy)]
pub enum RopeOffset<'a> {
    /// A fixed offset.
    Fixed(i32),
    /// An `int32` scalar or `[B]` vector of offsets.
    Array(&'a Array),
}

/// Rotary position embedding of the first `dims` features of `x` (`[..., L, D]`), positions
/// `offset..offset+L` scaled by `scale`. `traditional` rotates adjacent pairs `(2i, 2i+1)`;
/// otherwise the halves `(i, i + dims/2)` as most checkpoints do.
#[track_caller]
#[allow(unsafe_code)]
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    frequencies: RopeFrequencies<'_>,
    scale: f32,
    offset: RopeOffset<'_>,
) -> Result<Array> {
    let (base, freqs) = match frequencies {
        RopeFrequencies::Base(base) => (base, None),
        RopeFrequencies::Custom(freqs) => (0.0, Some(freqs)),
    };
    let freqs = opt_ptr(freqs);
    // SAFETY: `freqs` is null or borrows an argument that outlives the call.
    let result = match offset {
        RopeOffset::Fixed(offset) => unsafe {
            ffi::rope_int_offset(x.raw(), dims, traditional, base, scale, offset, freqs)
        },
        RopeOffset::Array(offset) => unsafe {
            ffi::rope(x.raw(), dims, traditional, base, scale, offset.raw(), freqs)
        },
    };
    check(result).map(Array::wrap)
}

/// [`rope`] composed from plain ops with the arithmetic of MLX's own fallback (what the fused
/// call runs on the CPU), gathering the rotated halves instead of slicing them: MLX's `Slice`
/// cannot infer output shapes, so a graph that holds one cannot be compiled shapeless, and on
/// the CPU the fused call *is* those slices. A compiled decode step on the CPU uses this.
#[track_caller]
pub fn rope_by_ops(
    x: &Array,
    dims: i32,
    traditional: bool,
    frequencies: RopeFrequencies<'_>,
    scale: f32,
    offset: RopeOffset<'_>,
) -> Result<Array> {
    use crate::{Dtype, ops};
    let shape = x.shape();
    let width = *shape.last().ok_or_else(|| crate::Error::invalid("rope of a scalar"))?;
    if shape.len() < 2 || dims <= 0 || dims > width || dims % 2 != 0 {
        return Err(crate::Error::invalid(format!(
            "rope of {dims} dimensions over an array of shape {shape:?}"
        )));
    }
    let rows = shape[shape.len() - 2];
    let half = dims / 2;
    let offset = match offset {
        RopeOffset::Fixed(o) => Array::scalar(o)?,
        RopeOffset::Array(o) if o.size() > 1 => o.expand_dims(&[-1, -2])?,
        RopeOffset::Array(o) => o.clone(),
    };
    let positions = ops::arange(0.0, f64::from(rows), 1.0, Dtype::Float32)?
        .add(&offset)?
        .multiply(&Array::scalar_as(f64::from(scale), Dtype::Float32)?)?;
    let inv_freqs = match frequencies {
        RopeFrequencies::Custom(f) => f.reciprocal()?,
        RopeFrequencies::Base(base) => ops::arange(0.0, -f64::from(half), -1.0, Dtype::Float32)?
            .multiply(&Array::scalar_as(f64::from(base.ln() / half as f32), Dtype::Float32)?)?
            .exp()?,
    };
    let theta = positions.expand_dims(&[-1])?.multiply(&inv_freqs)?;
    let (cos, sin) = (theta.cos()?.astype(x.dtype())?, theta.sin()?.astype(x.dtype())?);
    let axis = shape.len() as i32 - 1;
    let features = |from: i32, to: i32, step: i32| -> Result<Array> {
        let idx: Vec<i32> = (from..to).step_by(step as usize).collect();
        x.take(&Array::from_slice(&idx, &[idx.len() as i32])?, axis)
    };
    let (x1, x2) = if traditional {
        (features(0, dims, 2)?, features(1, dims, 2)?)
    } else {
        (features(0, half, 1)?, features(half, dims, 1)?)
    };
    let out1 = x1.multiply(&cos)?.subtract(&x2.multiply(&sin)?)?;
    let out2 = x1.multiply(&sin)?.add(&x2.multiply(&cos)?)?;
    let mut out = if traditional {
        let mut rotated = shape.clone();
        if let Some(last) = rotated.last_mut() {
            *last = dims;
        }
        ops::concatenate(&[&out1.expand_dims(&[-1])?, &out2.expand_dims(&[-1])?], -1)?
            .reshape(&rotated)?
    } else {
        ops::concatenate(&[&out1, &out2], -1)?
    };
    if dims < width {
        out = ops::concatenate(&[&out, &features(dims, width, 1)?], -1)?;
    }
    Ok(out)
}

/// The mask an attention call applies.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` of `L` sees keys up to `S - L + i` (queries are the last `L` positions).
    Causal,
    /// A bool mask (true = attend) or an additive float mask, broadcastable to `[B, H, L, S]`.
    Array(&'a Array),
}

/// `softmax(q·kᵀ·scale + mask)·v` with MLX's fused kernel. `q` is `[B, Hq, L, D]`, `k` and `v`
/// are `[B, Hkv, S, D]` with `Hq` a multiple of `Hkv` (grouped-query attention needs no
/// repeat). `sinks`, when given, is one logit per head that joins each softmax.
#[track_caller]
#[allow(unsafe_code)]
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, array) = match mask {
        AttentionMask::None => ("", None),
        AttentionMask::Causal => ("causal", None),
        AttentionMask::Array(m) => ("", Some(m)),
    };
    // SAFETY: each pointer is null or borrows an argument that outlives the call.
    check(unsafe {
        ffi::scaled_dot_product_attention(
            q.raw(),
            k.raw(),
            v.raw(),
            scale,
            mode,
            opt_ptr(array),
            opt_ptr(sinks),
        )
    })
    .map(Array::wrap)
}

/// A compile-time constant of a custom kernel: `constexpr int`, `constexpr bool` or `using`.
#[derive(Debug, Clone, Copy)]
pub enum TemplateArg {
    /// `constexpr int NAME = value;`
    Int(i32),
    /// `constexpr bool NAME = value;`
    Bool(bool),
    /// `using NAME = <the dtype's CUDA type>;`
    Dtype(crate::Dtype),
}

/// A custom CUDA kernel (`mlx::core::fast::cuda_kernel`): `source` is the body of a
/// `__global__` function whose parameters are the named inputs (`const T* name`, plus
/// `name_shape`, `name_strides` or `name_ndim` when the body mentions them) and outputs.
/// Runs only on MLX's CUDA backend.
pub struct CudaKernel {
    inner: cxx::UniquePtr<ffi::CustomKernelFn>,
}

impl std::fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CudaKernel")
    }
}

/// `source` without indentation, blank lines or whole-line `//` comments (line breaks kept, so
/// preprocessor lines and end-of-line comments stay as they were). MLX-CUDA hashes a kernel's
/// whole source on every launch to find its compiled module, so a shorter text is less host
/// time per launch.
fn compact(source: &str) -> String {
    let lines = source.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("//"));
    lines.collect::<Vec<_>>().join("\n")
}

/// How a custom kernel is launched: the grid in threads (as MLX counts it) and the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Threads along x, y, z (the blocks are this divided by `threadgroup`, rounded up).
    pub grid: [i32; 3],
    /// Threads per block along x, y, z.
    pub threadgroup: [i32; 3],
}

impl CudaKernel {
    /// Declares the kernel (nothing is compiled until its first launch). Inputs that are not
    /// row-contiguous are copied before each launch.
    #[track_caller]
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> Result<CudaKernel> {
        CudaKernel::with_layout(name, inputs, outputs, source, "", true)
    }

    /// [`CudaKernel::new`] with a `header` placed before the kernel (device functions,
    /// includes) and, with `row_contiguous` false, inputs passed as they are laid out: the body
    /// then addresses them through `name_strides` (a sliced view costs no copy).
    #[track_caller]
    pub fn with_layout(
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        row_contiguous: bool,
    ) -> Result<CudaKernel> {
        let names = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<Vec<String>>();
        let inner = check(ffi::cuda_kernel(
            name,
            &names(inputs),
            &names(outputs),
            &compact(source),
            &compact(header),
            row_contiguous,
        ))?;
        Ok(CudaKernel { inner })
    }

    /// Builds a launch over `inputs` (lazily, like any op) making outputs of the given shapes
    /// and dtypes. The first call of each launch configuration (template arguments, grid,
    /// block, input and output dtypes) generates the kernel's source; later calls reuse that
    /// call's primitive, so they cost the host no more than a built-in op's graph node.
    #[track_caller]
    pub fn call(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], crate::Dtype)],
        launch: Launch,
        template: &[(&str, TemplateArg)],
    ) -> Result<Vec<Array>> {
        let kernel = self
            .inner
            .as_ref()
            .unwrap_or_else(|| unreachable!("cuda_kernel returns an error instead of a null"));
        let shapes: Vec<i32> = outputs.iter().flat_map(|(s, _)| s.iter().copied()).collect();
        let ranks: Vec<i32> = outputs.iter().map(|(s, _)| s.len() as i32).collect();
        let dtypes: Vec<u8> = outputs.iter().map(|(_, d)| d.to_ffi().repr).collect();
        let (kinds, values): (Vec<u8>, Vec<i32>) = template
            .iter()
            .map(|(_, a)| match a {
                TemplateArg::Int(v) => (0, *v),
                TemplateArg::Bool(v) => (1, i32::from(*v)),
                TemplateArg::Dtype(d) => (2, i32::from(d.to_ffi().repr)),
            })
            .unzip();
        let inputs = crate::array::to_vector(inputs.iter().copied());
        // A configuration launched before needs no template names (no strings to make).
        let cached = check(ffi::custom_kernel_cached(
            kernel,
            &inputs,
            &shapes,
            &ranks,
            &dtypes,
            &launch.grid,
            &launch.threadgroup,
            &kinds,
            &values,
        ))?;
        let result = if cached.is_null() {
            let names: Vec<String> = template.iter().map(|(n, _)| (*n).to_string()).collect();
            check(ffi::custom_kernel_call(
                kernel,
                &inputs,
                &shapes,
                &ranks,
                &dtypes,
                &launch.grid,
                &launch.threadgroup,
                &names,
                &kinds,
                &values,
            ))?
        } else {
            cached
        };
        crate::array::from_vector(&result)
    }
}

#[cfg(test)]
mod tests {
    use super::compact;

    #[test]
    fn compact_keeps_code_and_line_breaks() {
        let source =
            "  // a note\n\n    const int a = 1; // kept\n#pragma unroll\n   for (;;) {}\n";
        assert_eq!(compact(source), "const int a = 1; // kept\n#pragma unroll\nfor (;;) {}");
    }
}
