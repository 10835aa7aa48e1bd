//! How a model is loaded: values the caller passes, never process-wide switches. The defaults
//! are what each backend ran fastest in measurements (`docs/benchmarks.md`); every field can be
//! set for an A/B run (`quince bench --kernels`, `--stacked`, `--compile`, …).

use cache::backend::KernelOptions;

/// What [`crate::registry::load_model`] and the families' loaders take.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Which kernels the forward passes run ([`cache::backend::Ops`]).
    pub kernels: KernelOptions,
    /// Stack the projections that read one input (q/k/v, gate/up) into one product. `None`:
    /// where the backend has kernels of Quince's (they take the stacked output as it is); a
    /// compiled step elsewhere would split it by gathers, 3 % slower on the CPU than separate
    /// products.
    pub stacked_projections: Option<bool>,
    /// Compile the one-token decode step. `None`: everywhere but CUDA, where op by op with
    /// Quince's kernels decoded faster.
    pub compiled_decode: Option<bool>,
}

impl LoadOptions {
    /// Whether the decode step is compiled: as asked, else everywhere but CUDA.
    pub fn compiles_decode(&self) -> bool {
        self.compiled_decode.unwrap_or(mlx::Backend::current() != mlx::Backend::Cuda)
    }

    /// Whether projections are stacked: as asked, else where kernels of Quince's run
    /// (`with_kernels`).
    pub fn stacks_projections(&self, with_kernels: bool) -> bool {
        self.stacked_projections.unwrap_or(with_kernels)
    }
}
