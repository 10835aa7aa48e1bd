//! A resumed turn, phase by phase, repeated in one process: reading the checkpoint, evaluating
//! the restored caches, and prefilling a new turn to its first token. The first repeat pays
//! for whatever the device compiles on first use; later ones show the steady state.
//!
//!     cargo run --release -p engine --example resume_probe -- MODEL_DIR CHECKPOINT [REPEATS]

use std::time::Instant;

use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest};
use engine::kv_file::{self, Identity};

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (model_dir, checkpoint) = match (args.get(1), args.get(2)) {
        (Some(m), Some(c)) => (std::path::PathBuf::from(m), std::path::PathBuf::from(c)),
        _ => return Err("usage: resume_probe MODEL_DIR CHECKPOINT [REPEATS]".into()),
    };
    let repeats: usize = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(3);
    let model = engine::registry::load_model(&model_dir, &engine::LoadOptions::default())?;
    let identity = Identity {
        model_id: model_dir.canonicalize()?.to_string_lossy().into_owned(),
        config_hash: kv_file::sha256_hex(&std::fs::read(model_dir.join("config.json"))?),
    };
    let sha256 = kv_file::digest_file(&checkpoint)?;
    let turn: Vec<u32> = (0..32).map(|i| 1000 + i * 17).collect();
    for r in 0..repeats {
        let mut caches = model.fresh_caches()?;
        let t = Instant::now();
        let tokens = kv_file::read(&checkpoint, &sha256, &identity, &mut caches)?.tokens;
        let read = ms(t);
        let t = Instant::now();
        let buffers: Vec<mlx::Array> = caches.iter().flat_map(|c| c.buffers()).collect();
        mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
        let eval = ms(t);
        let t = Instant::now();
        let mut first = None;
        generate(&*model, &mut caches, &GenerateRequest::new(turn.clone(), 2), |_| {
            first.get_or_insert_with(|| ms(t));
            Flow::Continue
        })?;
        let step = ms(t) - first.unwrap_or_default();
        println!(
            "run {r}: {} tokens; read {read:.1} ms, caches eval {eval:.1} ms, 32-token prefill to first token {:.1} ms, next token {step:.1} ms",
            tokens.len(),
            first.unwrap_or_default()
        );
    }
    Ok(())
}
