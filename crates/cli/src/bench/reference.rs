//! The reference's half of `quince bench --compare`, in its own process: mlx-lm (or mlx-vlm
//! with an image) through the scripts in `tests/bench/`.

use anyhow::{Context, bail};

use super::BenchArgs;

/// The reference's half of `quince bench --compare` at one prompt length, in its own process.
/// With a KV choice the reference has (`kv`, see [`crate::options::KvArgs::reference_flags`]);
/// a reference that cannot run it reports `{"error": …}` instead of figures.
pub(super) fn run(
    args: &BenchArgs,
    prompt_tokens: usize,
    kv: &[String],
) -> anyhow::Result<serde_json::Value> {
    let python = args.python.clone().unwrap_or_else(super::ops::default_python);
    let mut command = std::process::Command::new(&python);
    for var in crate::MLX_SETTINGS.get().into_iter().flatten() {
        command.env_remove(var);
    }
    match &args.image {
        Some(image) => {
            command
                .arg("tests/bench/mlx_vlm_image.py")
                .arg("--image")
                .arg(image)
                .args(["--max-soft-tokens", &args.max_soft_tokens.to_string()]);
        }
        None => {
            command.arg(&args.reference_script);
        }
    }
    let output = command
        .arg("--model")
        .arg(&args.model)
        .args(["--prompt-tokens", &prompt_tokens.to_string()])
        .args(["--gen-tokens", &args.gen_tokens.to_string()])
        .args(["--repeats", &args.repeats.to_string()])
        .args(kv)
        .output()
        .with_context(|| {
            format!("running {} {}", python.display(), args.reference_script.display())
        })?;
    if !output.status.success() {
        bail!("the reference benchmark failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .context("parsing the reference benchmark's JSON")
}
