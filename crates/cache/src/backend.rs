//! The ops a forward pass runs where a backend has kernels faster than MLX's general ones, or
//! where a shapeless compiled step needs other ops than a plain pass: [`Ops`], chosen once at
//! load from the model's [`KernelOptions`] and passed to every layer and cache.
//!
//! Model and cache code call `ops.residual_norm(…)`, `ops.attend_one(…)`, … and never ask which
//! backend runs: Quince's CUDA kernels (`backend/cuda/`) where the backend is CUDA and the options allow
//! them, MLX's own route ([`mlx`]) everywhere else, and wherever a kernel does not take its
//! inputs. A new backend's kernels are one more folder implementing the same trait.

mod cuda;
mod kernels;
pub mod mlx;

use std::rc::Rc;

use ::mlx::Array;
use ::mlx::fast::{RopeFrequencies, RopeOffset};
use ::mlx::quantized::QuantizedMatrix;

use self::kernels::Kernels;
pub use self::mlx::{Heads, HeadsLayout, RopeSpec};
use crate::error::Result;
use crate::pointwise::{Activations, RmsNorm};

/// The op routes one model (and its caches) run. Cheap to clone: the kernels are shared.
#[derive(Debug, Clone)]
pub struct Ops {
    kernels: Option<Rc<dyn Kernels>>,
    shapeless: bool,
}

impl Default for Ops {
    /// MLX's built-in ops only.
    fn default() -> Ops {
        Ops::mlx()
    }
}

impl Ops {
    /// MLX's built-in ops only.
    pub fn mlx() -> Ops {
        Ops { kernels: None, shapeless: false }
    }

    /// What `options` choose on the backend this thread runs: Quince's kernels where the
    /// backend has them and the options allow, MLX's ops elsewhere.
    pub fn new(options: &KernelOptions) -> Ops {
        let kernels: Option<Rc<dyn Kernels>> = match (::mlx::Backend::current(), options.custom) {
            (::mlx::Backend::Cuda, true) => Some(Rc::new(cuda::CudaKernels::new(*options))),
            _ => None,
        };
        Ops { kernels, shapeless: false }
    }

    /// The ops of a shapeless compiled step (the body MLX traces once and replays at any
    /// length): MLX's, with gathers where a slice's output shape could not be inferred.
    pub fn shapeless() -> Ops {
        Ops { kernels: None, shapeless: true }
    }

    /// Whether these are a shapeless step's ops.
    pub fn is_shapeless(&self) -> bool {
        self.shapeless
    }

    /// Whether a kernel of Quince's may run (the backend has them and the options allow).
    pub fn has_kernels(&self) -> bool {
        self.kernels.is_some()
    }

    /// The kernels built and probed so far that passed (for tests: the kernels really ran).
    pub fn kernels_in_use(&self) -> Vec<&'static str> {
        self.kernels.as_ref().map(|k| k.in_use()).unwrap_or_default()
    }

    /// `x · Wᵀ` for a quantized `W` stored `[out, in]`.
    pub fn quantized_matmul(&self, x: &Array, q: &QuantizedMatrix) -> Result<Array> {
        if let Some(k) = &self.kernels
            && let Some(y) = k.quantized_matmul(x, q)?
        {
            return Ok(y);
        }
        Ok(q.matmul(x, true)?)
    }

    /// `h + norm_a(x)`, times `scale` when given, and `next` of that sum when given: the sum
    /// and its norm, over the last axis of `[..., D]` rows.
    pub fn residual_norm(
        &self,
        h: &Array,
        x: &Array,
        norm_a: &RmsNorm,
        scale: Option<&Array>,
        next: Option<&RmsNorm>,
    ) -> Result<(Array, Option<Array>)> {
        if let Some(k) = &self.kernels
            && let Some(out) = k.residual_norm(h, x, norm_a, scale, next)?
        {
            return Ok(out);
        }
        mlx::residual_norm(h, x, norm_a, scale, next)
    }

    /// The query, key and value heads `[B, H, 1, D]` of one position from a stacked projection
    /// `proj` `[B, 1, N]`, normed and rotated to `position` (an int32 scalar), by a kernel;
    /// `None` where none runs: then the caller takes the heads by MLX ops from the projection's
    /// parts.
    pub fn decode_heads(
        &self,
        proj: &Array,
        layout: &HeadsLayout<'_>,
        rope: &RopeSpec<'_>,
        position: &Array,
    ) -> Result<Option<Heads>> {
        match &self.kernels {
            Some(k) => k.decode_heads(proj, layout, rope, position),
            None => Ok(None),
        }
    }

    /// `gelu_approx(gate) · up` where `joined` `[..., 2W]` holds `gate` then `up` (a stacked
    /// projection; `one` is the int32 scalar 1), by a kernel; `None` where none runs (then the
    /// caller splits `joined` and calls [`Activations::geglu`]).
    pub fn geglu_halves(&self, joined: &Array, one: &Array) -> Result<Option<Array>> {
        match &self.kernels {
            Some(k) => k.geglu_halves(joined, one),
            None => Ok(None),
        }
    }

    /// `gelu_approx(gate) · inputs[..., layer, :]` for per-layer inputs `[B, T, L, W]` and a
    /// gate `[B, T, W]`; `index` is `layer` as an int32 scalar.
    pub fn geglu_at(
        &self,
        gate: &Array,
        inputs: &Array,
        layer: i32,
        index: &Array,
        act: &Activations,
    ) -> Result<Array> {
        if let Some(k) = &self.kernels
            && let Some(out) = k.geglu_at(gate, inputs, index)?
        {
            return Ok(out);
        }
        let s = inputs.shape();
        let slice = if self.shapeless {
            inputs.take(index, 2)?
        } else {
            // A view: two ops that record no kernel.
            let one = inputs.slice(&[0, 0, layer, 0], &[s[0], s[1], layer + 1, s[3]], &[1; 4])?;
            one.reshape(&[s[0], s[1], s[3]])?
        };
        act.geglu(gate, &slice)
    }

    /// The last axis of `x` split into parts of `sizes`: views, or in a shapeless step gathers
    /// by `indices` (from [`mlx::split_indices`]).
    pub fn split_last(&self, x: &Array, sizes: &[i32], indices: &[Array]) -> Result<Vec<Array>> {
        if self.shapeless {
            let axis = x.ndim() as i32 - 1;
            return indices.iter().map(|index| Ok(x.take(index, axis)?)).collect();
        }
        mlx::split_last(x, sizes)
    }

    /// The last `count` entries along the last axis of `x`: a view, or in a shapeless step a
    /// gather by `indices` (the int32 positions `[n − count, n)`).
    pub fn last_along(&self, x: &Array, count: i32, indices: &Array) -> Result<Array> {
        if self.shapeless {
            return Ok(x.take(indices, -1)?);
        }
        let s = x.shape();
        let n = s.len();
        let mut start = vec![0; n];
        start[n - 1] = s[n - 1] - count;
        Ok(x.slice(&start, &s, &vec![1; n])?)
    }

    /// Rotary embedding of the last `dims` of `x`'s heads at `offset`. A shapeless step on the
    /// CPU rotates by gathers (`mlx::fast::rope_by_ops`, bit for bit MLX's CPU fallback, whose
    /// slices a shapeless graph cannot replay).
    pub fn rope(
        &self,
        x: &Array,
        dims: i32,
        traditional: bool,
        frequencies: RopeFrequencies<'_>,
        scale: f32,
        offset: RopeOffset<'_>,
    ) -> Result<Array> {
        if self.shapeless && ::mlx::Backend::current() == ::mlx::Backend::Cpu {
            return Ok(::mlx::fast::rope_by_ops(x, dims, traditional, frequencies, scale, offset)?);
        }
        Ok(::mlx::fast::rope(x, dims, traditional, frequencies, scale, offset)?)
    }

    /// Attention for one query position `q` `[B, Hq, 1, D]` over `k`, `v` `[B, Hkv, S, D]`
    /// (views in any strides), no mask.
    pub fn attend_one(&self, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        if let Some(kernels) = &self.kernels
            && let Some(out) = kernels.attend_one(q, k, v, scale)?
        {
            return Ok(out);
        }
        mlx::attend_one(q, k, v, scale)
    }

    /// Attention for one query position per row, `q` `[B, Hq, 1, D]`, over `k`, `v`
    /// `[B, Hkv, S, D]` under `mask` (bool `[B, 1, 1, S]`, true = visible): rows of a batch
    /// whose shared buffers hold slots a row has not filled. By MLX's ops, whose shapes a
    /// shapeless compiled step infers again when `S` changes (MLX's fused attention's own
    /// fallback keeps the length it was traced with).
    pub fn attend_one_masked(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        mask: &Array,
    ) -> Result<Array> {
        mlx::attend_one_by_ops(q, k, v, scale, Some(mask))
    }

    /// Attention of a window of query positions `q` `[B, Hq, L, D]` over `k`, `v`
    /// `[B, Hkv, S, D]` under `mask`: the backend's route where it has one for the window (on
    /// CUDA, short windows by MLX's ops, [`KernelOptions::window_by_ops`]), else MLX's fused
    /// attention.
    pub fn attend_window(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        mask: ::mlx::fast::AttentionMask<'_>,
    ) -> Result<Array> {
        if let Some(kernels) = &self.kernels
            && let Some(out) = kernels.attend_window(q, k, v, scale, mask)?
        {
            return Ok(out);
        }
        Ok(::mlx::fast::scaled_dot_product_attention(q, k, v, scale, mask, None)?)
    }

    /// Keys past which a one-query read runs split, in kernels of their own that are compiled
    /// on first use (a stall of a second or two): a warm-up that decodes past it builds them
    /// before the first reply. `None` where no read splits.
    pub fn split_reads_above(&self) -> Option<usize> {
        self.kernels.as_ref().and_then(|k| k.split_reads_above())
    }

    /// The GPU's clock in ns (a `uint64` scalar) read once `after` is written, from inside the
    /// stream: a diagnostic for timing GPU work (`quince bench --gpu-clock`). `None` where the
    /// backend has no such kernel.
    pub fn gpu_clock(&self, after: &Array) -> Result<Option<Array>> {
        match &self.kernels {
            Some(k) => k.gpu_clock(after),
            None => Ok(None),
        }
    }
}

/// Quince's own kernels, on a backend that has them (today CUDA, `backend/cuda/`). Off, or on
/// another backend, MLX's built-in ops run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOptions {
    /// Any kernel of Quince's at all (`false`: MLX's ops only, the reference route).
    pub custom: bool,
    /// The fused decode kernels: residual adds with their norms, the q/k/v heads of one
    /// position, the gated activations.
    pub fused_decode: bool,
    /// The 4-bit matrix-vector kernel for products of up to 7 rows.
    pub quantized_matvec: bool,
    /// Short windows of queries (a verify round's) attended by MLX's ops instead of MLX's
    /// fused attention, which on CUDA builds a cuDNN graph for every new key length. Off by
    /// default: once CUDA's kernels are compiled the two cost the same (`docs/benchmarks.md`,
    /// "Drafting in a batch").
    pub window_by_ops: bool,
}

impl Default for KernelOptions {
    fn default() -> KernelOptions {
        KernelOptions {
            custom: true,
            fused_decode: true,
            quantized_matvec: true,
            window_by_ops: false,
        }
    }
}

impl KernelOptions {
    /// MLX's built-in ops only.
    pub fn mlx() -> KernelOptions {
        KernelOptions {
            custom: false,
            fused_decode: false,
            quantized_matvec: false,
            window_by_ops: false,
        }
    }
}
