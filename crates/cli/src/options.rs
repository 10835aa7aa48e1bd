//! The load options every command that runs a model takes (`engine::LoadOptions`), as flags:
//! the defaults are each backend's fastest, and each flag exists for A/B runs.

use engine::{KernelOptions, LoadOptions};

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

impl Switch {
    fn on(self) -> bool {
        self == Switch::On
    }

    /// `on` or `off`, as the JSON reports name it.
    pub fn word(on: bool) -> &'static str {
        if on { "on" } else { "off" }
    }
}

/// Which kernels the forward passes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kernels {
    /// Quince's kernels where the backend has them (CUDA), MLX's elsewhere.
    Quince,
    /// MLX's built-in ops only.
    Mlx,
}

/// Flags of [`LoadOptions`].
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Which kernels the forward passes run (`mlx`: MLX's built-in ops only, for A/B runs).
    #[arg(long, value_enum, default_value = "quince")]
    kernels: Kernels,
    /// Quince's fused decode kernels for the norms, residual adds, rotary embeddings and gated
    /// activations of a decode step (CUDA; `off` for A/B runs).
    #[arg(long, value_enum, default_value = "on")]
    decode_fusion: Switch,
    /// Quince's 4-bit matrix-vector kernel for products of up to 7 rows (CUDA; `off` for A/B
    /// runs).
    #[arg(long, value_enum, default_value = "on")]
    quantized_kernel: Switch,
    /// Stack the projections that read one input into one product (default: where Quince's
    /// kernels run).
    #[arg(long, value_enum)]
    stacked: Option<Switch>,
    /// Decode without the compiled step.
    #[arg(long, conflicts_with = "compile")]
    no_compile: bool,
    /// Decode with the compiled step even on CUDA (where it is off by default).
    #[arg(long)]
    compile: bool,
}

impl LoadArgs {
    /// The options these flags ask for.
    pub fn options(&self) -> LoadOptions {
        let kernels = match self.kernels {
            Kernels::Mlx => KernelOptions::mlx(),
            Kernels::Quince => KernelOptions {
                custom: true,
                fused_decode: self.decode_fusion.on(),
                quantized_matvec: self.quantized_kernel.on(),
            },
        };
        let compiled_decode = match (self.compile, self.no_compile) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        };
        LoadOptions { kernels, stacked_projections: self.stacked.map(Switch::on), compiled_decode }
    }
}
