//! The ops a backend may run as kernels of its own, each answering `None` where its kernel does
//! not take the inputs (then [`super::Ops`] runs MLX's route, [`super::mlx`]).

use mlx::Array;
use mlx::quantized::QuantizedMatrix;

use super::mlx::{Heads, HeadsLayout, RopeSpec};
use crate::error::Result;
use crate::pointwise::RmsNorm;

/// A backend's kernel set (one per model, made at load from its options).
pub(crate) trait Kernels: std::fmt::Debug {
    /// The kernels built and probed so far that passed.
    fn in_use(&self) -> Vec<&'static str>;
    /// `x · Wᵀ` for a quantized `W`.
    fn quantized_matmul(&self, x: &Array, q: &QuantizedMatrix) -> Result<Option<Array>>;
    /// See [`super::Ops::residual_norm`].
    fn residual_norm(
        &self,
        h: &Array,
        x: &Array,
        norm_a: &RmsNorm,
        scale: Option<&Array>,
        next: Option<&RmsNorm>,
    ) -> Result<Option<(Array, Option<Array>)>>;
    /// See [`super::Ops::decode_heads`].
    fn decode_heads(
        &self,
        proj: &Array,
        layout: &HeadsLayout<'_>,
        rope: &RopeSpec<'_>,
        position: &Array,
    ) -> Result<Option<Heads>>;
    /// See [`super::Ops::geglu_halves`].
    fn geglu_halves(&self, joined: &Array, one: &Array) -> Result<Option<Array>>;
    /// See [`super::Ops::geglu_at`].
    fn geglu_at(&self, gate: &Array, inputs: &Array, index: &Array) -> Result<Option<Array>>;
    /// See [`super::Ops::attend_one`].
    fn attend_one(&self, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Option<Array>>;
    /// See [`super::Ops::attend_window`].
    fn attend_window(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        mask: mlx::fast::AttentionMask<'_>,
    ) -> Result<Option<Array>>;
    /// See [`super::Ops::split_reads_above`].
    fn split_reads_above(&self) -> Option<usize>;
    /// See [`super::Ops::gpu_clock`].
    fn gpu_clock(&self, after: &Array) -> Result<Option<Array>>;
}
