//! Quince's half of `quince bench`: timed runs at one prompt length, and the op census of a
//! decode step.

use std::collections::BTreeMap;

use anyhow::bail;
use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest};
use engine::models::Model;
use mlx::Array;
use serde_json::json;

use super::{BenchArgs, median, synthetic_prompt};

/// The speed fields `generate --json` and `bench --json` share.
pub(crate) fn stats_json(s: &engine::generate::GenerationStats) -> serde_json::Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "ttft_ms": s.ttft_ms,
        "prefill_tok_s": s.prefill_tok_s,
        "decode_tok_s": s.decode_tok_s,
        "peak_mem_bytes": s.peak_mem_bytes,
    })
}

/// The ops one decode step runs, by primitive (compiled when the model's decode graphs are
/// on): a step built after an 8-token prefill and counted before it is evaluated.
pub(super) fn decode_census(model: &dyn Model) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut caches = model.fresh_caches()?;
    let prompt = synthetic_prompt(8, model.vocab_size() as u32);
    let last = engine::generate::prefill(model, &mut caches, &prompt, 512)?;
    let mut settled: Vec<Array> = caches.iter().flat_map(|c| c.buffers()).collect();
    settled.push(last);
    mlx::eval(&settled.iter().collect::<Vec<_>>())?;
    let token = engine::tokens::ids(&prompt[..1])?;
    let logits = model.forward_decode(&token.reshape(&[1, 1])?, &mut caches)?;
    Ok(mlx::graph_census(&[&logits]))
}

/// Quince's half of `quince bench` at one prompt length: a full-length warm-up, then the
/// medians of `--repeats` runs (and each run's decode speed).
pub(super) fn run(
    model: &dyn Model,
    args: &BenchArgs,
    prompt_tokens: usize,
    kv: &engine::cache::KvOptions,
) -> anyhow::Result<serde_json::Value> {
    let plan = model.cache_plan().with_kv(kv)?;
    let text = synthetic_prompt(prompt_tokens, model.vocab_size() as u32);
    let mut kv_bytes = 0usize;
    // One timed run. With --image, TTFT runs from reading the file to the first token:
    // decoding, preprocessing, the vision tower, the prefill.
    let mut run_once = |gen_tokens: usize| -> anyhow::Result<engine::generate::GenerationStats> {
        let start = std::time::Instant::now();
        let mut request = GenerateRequest::new(text.clone(), gen_tokens);
        if let Some(image) = &args.image {
            let features = crate::logits::encode_images(
                model,
                std::slice::from_ref(image),
                args.max_soft_tokens,
            )?;
            let n = engine::vision::soft_tokens(&features[0]);
            let Some(vision) = model.vision() else { bail!("this model has no vision tower") };
            let mut prompt = vec![2];
            prompt.extend(vision.image_block(n));
            prompt.extend_from_slice(&text);
            request =
                GenerateRequest { images: features, ..GenerateRequest::new(prompt, gen_tokens) };
        }
        let mut first = None;
        let mut caches = model.new_caches(&plan)?;
        let delay = std::time::Duration::from_micros(args.host_delay_us);
        let mut stats = generate(model, &mut caches, &request, |_| {
            if first.is_some() && !delay.is_zero() {
                std::thread::sleep(delay);
            }
            first.get_or_insert_with(std::time::Instant::now);
            Flow::Continue
        })?
        .stats;
        if let Some(first) = first {
            stats.ttft_ms = first.duration_since(start).as_secs_f64() * 1e3;
            stats.prefill_tok_s =
                request.prompt.len() as f64 / first.duration_since(start).as_secs_f64();
        }
        // What the last step read of the caches.
        kv_bytes = 0;
        for cache in &caches {
            kv_bytes += cache.bytes_per_token() * cache.stored_positions();
        }
        Ok(stats)
    };
    // Warm-up at full prompt length: kernels for every shape are built before timing.
    run_once(4)?;
    let profile = super::host_profile::Profile::start(args.host_profile.as_deref())?;
    let mut runs = Vec::new();
    for _ in 0..args.repeats.max(1) {
        runs.push(run_once(args.gen_tokens)?);
    }
    profile.finish(prompt_tokens)?;
    let clocked = if args.gpu_clock { super::gpu_clock::steps(model, args, &text)? } else { None };
    let median = |f: fn(&engine::generate::GenerationStats) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        median(&mut v)
    };
    let s = &engine::generate::GenerationStats {
        prompt_tokens: runs[0].prompt_tokens,
        generated_tokens: runs[0].generated_tokens,
        ttft_ms: median(|s| s.ttft_ms),
        prefill_tok_s: median(|s| s.prefill_tok_s),
        decode_tok_s: median(|s| s.decode_tok_s),
        peak_mem_bytes: median(|s| s.peak_mem_bytes as f64) as usize,
        decode_host_ms: median(|s| s.decode_host_ms),
        decode_build_ms: median(|s| s.decode_build_ms),
        decode_wait_ms: median(|s| s.decode_wait_ms),
    };
    let steps = s.generated_tokens.saturating_sub(1).max(1) as f64;
    let mut ours = stats_json(s);
    // Host time per decode step against the step itself: near 1, the host is the bottleneck.
    ours["host_ms_per_step"] = json!(s.decode_host_ms / steps);
    ours["host_share"] = json!(s.decode_host_ms / steps * s.decode_tok_s / 1e3);
    // Of that, building the graph (ours) against MLX evaluating it.
    ours["build_ms_per_step"] = json!(s.decode_build_ms / steps);
    // The engine thread waiting for tokens: near 0 host-bound, most of a step device-bound.
    ours["wait_ms_per_step"] = json!(s.decode_wait_ms / steps);
    ours["decode_tok_s_runs"] = json!(runs.iter().map(|r| r.decode_tok_s).collect::<Vec<_>>());
    ours["kv_bytes_per_token"] = json!(kv_bytes);
    if let Some(clocked) = clocked {
        ours["gpu_clock"] = clocked;
    }
    Ok(ours)
}
