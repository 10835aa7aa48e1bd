//! `quince doctor`: the facts of the MLX build this process loaded, and a smoke computation.

use std::io::Write;

use anyhow::Context;
use mlx::fast::{AttentionMask, scaled_dot_product_attention};
use mlx::{Array, Backend, Device, Dtype, device, ops};

/// Arguments of `quince doctor`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Prints the report; fails when MLX cannot run the smoke computation.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let backend = Backend::current();
    let default = Device::default_device()?;
    let gpu = Device::Gpu.is_available()?;
    let info = default.info().unwrap_or_default();
    let memory_size = default.memory_size().unwrap_or(None);

    // A 2×3 @ 3×2 matmul with a hand-computed result.
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let b = Array::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2])?;
    let product = a.matmul(&b)?.to_vec::<f32>()?;
    let product_ok = product == [4.0, 5.0, 10.0, 11.0];

    // Causal attention, 1 batch, 2 heads, 4 positions, head dim 8: fused kernel vs the formula.
    let q =
        mlx::random::normal(&[1, 2, 4, 8], Dtype::Float32, 0.0, 1.0, Some(&mlx::random::key(1)?))?;
    let k =
        mlx::random::normal(&[1, 2, 4, 8], Dtype::Float32, 0.0, 1.0, Some(&mlx::random::key(2)?))?;
    let v =
        mlx::random::normal(&[1, 2, 4, 8], Dtype::Float32, 0.0, 1.0, Some(&mlx::random::key(3)?))?;
    let scale = 1.0 / 8f32.sqrt();
    let fused = scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Causal, None)?;
    let keep = ops::tri(4, 4, 0, Dtype::Bool)?;
    let scores = q.matmul(&k.swapaxes(-1, -2)?)?.multiply_scalar(f64::from(scale))?;
    let scores = ops::where_(&keep, &scores, &scores.scalar_like(f64::NEG_INFINITY)?)?;
    let naive = scores.softmax(&[-1], true)?.matmul(&v)?;
    let sdpa_err = fused.subtract(&naive)?.abs()?.max_all(false)?.item::<f32>()?;
    let sdpa_ok = sdpa_err < 1e-5;

    let active = device::memory::active()?;
    let peak = device::memory::peak()?;
    let cache = device::memory::cache()?;
    let limit = device::memory::limit()?;

    let mut out = std::io::stdout().lock();
    if args.json {
        let report = serde_json::json!({
            "mlx_version": device::version(),
            "backend": backend.name(),
            "default_device": format!("{default:?}").to_lowercase(),
            "gpu_available": gpu,
            "custom_kernels": backend.custom_kernels_available(),
            "device_info": info.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
            "device_memory_bytes": memory_size,
            "memory": {"active": active, "peak": peak, "cache": cache, "limit": limit},
            "matmul": product,
            "matmul_ok": product_ok,
            "sdpa_max_abs_err": sdpa_err,
            "sdpa_ok": sdpa_ok,
        });
        writeln!(out, "{report}")?;
    } else {
        writeln!(out, "MLX            {}", device::version())?;
        writeln!(out, "backend        {}", backend.name())?;
        writeln!(out, "default device {default:?} (gpu available: {gpu})")?;
        writeln!(out, "custom kernels {}", backend.custom_kernels_available())?;
        for (key, value) in &info {
            writeln!(out, "  {key:<24} {value}")?;
        }
        if let Some(bytes) = memory_size {
            writeln!(out, "device memory  {}", gib(bytes as usize))?;
        }
        writeln!(
            out,
            "memory         active {}  peak {}  cache {}  limit {}",
            gib(active),
            gib(peak),
            gib(cache),
            gib(limit)
        )?;
        writeln!(out, "matmul 2x3·3x2 {product:?} {}", verdict(product_ok))?;
        writeln!(
            out,
            "sdpa causal    max |fused − formula| = {sdpa_err:.2e} {}",
            verdict(sdpa_ok)
        )?;
    }
    if !(product_ok && sdpa_ok) {
        return Err(anyhow::anyhow!("MLX smoke computation gave wrong results"))
            .context("quince doctor");
    }
    Ok(())
}

fn gib(bytes: usize) -> String {
    format!("{:.3} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "ok" } else { "WRONG" }
}
