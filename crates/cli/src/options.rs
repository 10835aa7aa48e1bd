//! The load options every command that runs a model takes (`engine::LoadOptions`), as flags:
//! the defaults are each backend's fastest, and each flag exists for A/B runs.

use anyhow::bail;
use engine::cache::{KvFormat, KvLayers, KvOptions};
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
    /// Short windows of queries (a verify round's) attended by MLX's ops instead of its fused
    /// attention, which builds a cuDNN graph per new key length (CUDA; for A/B runs).
    #[arg(long, value_enum, default_value = "off")]
    window_by_ops: Switch,
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
                window_by_ops: self.window_by_ops.on(),
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

/// How keys and values are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvScheme {
    /// Affine quantization per group (mlx-lm's `kv_bits`).
    Affine,
    /// TurboQuant (mlx-vlm's MSE codec).
    Turbo,
}

/// Which layers the KV choice applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvLayerArg {
    /// Every layer with keys and values.
    All,
    /// Full-attention layers only (sliding windows stay in full precision, as mlx-lm does).
    Full,
}

/// Flags of a KV cache choice ([`KvOptions`]) and of the memory guard.
#[derive(Debug, Clone, clap::Args)]
pub struct KvArgs {
    /// Quantize the KV cache to this many bits: 4 or 8 (affine); 2.5, 3, 3.5 or 4 (turbo).
    /// Without it the cache stays in full precision.
    #[arg(long)]
    kv_bits: Option<f64>,
    /// Values per affine quantization group: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    kv_group_size: u16,
    /// Keep the first N positions in full precision; the cache converts after the step that
    /// reaches them.
    #[arg(long, default_value_t = 0)]
    quantized_kv_start: usize,
    /// How the quantized KV cache is encoded.
    #[arg(long, value_enum, default_value = "affine")]
    kv_scheme: KvScheme,
    /// The layers quantized: `full` leaves sliding windows in full precision.
    #[arg(long, value_enum, default_value = "all")]
    kv_layers: KvLayerArg,
    /// Refuse a reply whose projected KV cache would pass this share of the memory MLX
    /// recommends for the device (with what is in use already); 0 turns the check off.
    #[arg(long, default_value_t = engine::memory::DEFAULT_SHARE)]
    memory_share: f64,
}

impl KvArgs {
    /// The KV choice these flags ask for.
    pub fn options(&self) -> anyhow::Result<KvOptions> {
        let format = match (self.kv_bits, self.kv_scheme) {
            (None, _) => KvFormat::Full,
            (Some(bits), KvScheme::Affine) => {
                if bits.fract() != 0.0 || !(bits == 4.0 || bits == 8.0) {
                    bail!("affine KV takes --kv-bits 4 or 8 (for {bits}, try --kv-scheme turbo)");
                }
                KvFormat::Affine { bits: bits as u8, group_size: self.kv_group_size }
            }
            (Some(bits), KvScheme::Turbo) => KvFormat::turbo(bits)?,
        };
        let layers = match self.kv_layers {
            KvLayerArg::All => KvLayers::All,
            KvLayerArg::Full => KvLayers::Full,
        };
        Ok(KvOptions { format, quantized_start: self.quantized_kv_start, layers })
    }

    /// One storage of a sweep, by name: `full`, `affine8`, `affine4` (or `8`, `4`), `turbo3`,
    /// `turbo3.5`, `turbo4`, `turbo2.5`, with these flags' group size, start and layers.
    pub fn named(&self, name: &str) -> anyhow::Result<KvOptions> {
        let name = name.trim();
        let format = match name {
            "full" | "bf16" => KvFormat::Full,
            _ => match name.strip_prefix("turbo") {
                Some(bits) => KvFormat::turbo(bits.parse()?)?,
                None => {
                    let bits: u8 = name.trim_start_matches("affine").parse()?;
                    if bits != 4 && bits != 8 {
                        bail!("unknown KV storage {name:?}: full, affine4, affine8 or turboN");
                    }
                    KvFormat::Affine { bits, group_size: self.kv_group_size }
                }
            },
        };
        Ok(KvOptions { format, ..self.options()? })
    }

    /// The reference's flags for a KV choice (mlx-lm's `kv_bits`, `kv_group_size`,
    /// `quantized_kv_start`), or `None` where the reference has no such storage (TurboQuant).
    pub fn reference_flags(kv: &KvOptions) -> Option<Vec<String>> {
        let layers = match kv.layers {
            KvLayers::All => "all",
            KvLayers::Full => "full",
        };
        match kv.format {
            KvFormat::Full => Some(Vec::new()),
            KvFormat::Affine { bits, group_size } => Some(vec![
                "--kv-bits".into(),
                bits.to_string(),
                "--kv-group-size".into(),
                group_size.to_string(),
                "--quantized-kv-start".into(),
                kv.quantized_start.to_string(),
                "--kv-layers".into(),
                layers.into(),
            ]),
            KvFormat::Turbo { .. } => None,
        }
    }

    /// The memory guard's share (`None`: off).
    pub fn memory_share(&self) -> Option<f64> {
        (self.memory_share > 0.0).then_some(self.memory_share)
    }
}
