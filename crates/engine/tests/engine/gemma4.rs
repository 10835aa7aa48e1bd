//! Gemma 4 text against the reference: logits of mlx-lm 0.32.2 / mlx-vlm 0.7.10 and their
//! greedy continuation, recorded by `tests/golden/gemma4/make_golden.py` on tiny random-weight
//! checkpoints (f32, 4-bit, 8-bit, `attention_k_eq_v`, `gemma4_text`, MoE). Every checkpoint's
//! sliding window (6 or 8) is shorter than its 40-token prompt.

use std::path::PathBuf;

use engine::generate::{Flow, GenerateRequest, generate};
use engine::models::gemma4::token_array;
use engine::models::{self, Model, Phase};
use mlx::{Array, ops};

fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/gemma4").join(name)
}

struct Golden {
    prompt: Vec<u32>,
    logits: Array,
    greedy: Vec<u32>,
}

fn golden(name: &str) -> Golden {
    let file = mlx::io::load_safetensors(golden_dir(name).join("golden.safetensors")).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        file.tensors[key]
            .astype(mlx::Dtype::Int32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(|t| t as u32)
            .collect()
    };
    Golden { prompt: ids("prompt"), logits: file.tensors["logits"].clone(), greedy: ids("greedy") }
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape(), "logit shapes");
    a.subtract(b).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

fn full_logits(model: &dyn Model, prompt: &[u32]) -> Array {
    let mut caches = model.new_caches().unwrap();
    let logits = model.forward(&token_array(prompt).unwrap(), &mut caches, Phase::Window).unwrap();
    logits.reshape(&[prompt.len() as i32, -1]).unwrap()
}

fn incremental_logits(model: &dyn Model, prompt: &[u32]) -> Array {
    let mut caches = model.new_caches().unwrap();
    let mut rows = vec![
        model.forward(&token_array(&prompt[..1]).unwrap(), &mut caches, Phase::Window).unwrap(),
    ];
    for &t in &prompt[1..] {
        rows.push(model.forward(&token_array(&[t]).unwrap(), &mut caches, Phase::Decode).unwrap());
    }
    ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)
        .unwrap()
        .reshape(&[prompt.len() as i32, -1])
        .unwrap()
}

fn chunked_logits(model: &dyn Model, prompt: &[u32], chunk: usize) -> Array {
    let mut caches = model.new_caches().unwrap();
    let rows: Vec<Array> = prompt
        .chunks(chunk)
        .map(|c| model.forward(&token_array(c).unwrap(), &mut caches, Phase::Window).unwrap())
        .collect();
    ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)
        .unwrap()
        .reshape(&[prompt.len() as i32, -1])
        .unwrap()
}

fn greedy(model: &dyn Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut caches = model.new_caches().unwrap();
    let request = GenerateRequest { prefill_step: 16, ..GenerateRequest::new(prompt.to_vec(), n) };
    generate(model, &mut caches, &request, |_| Flow::Continue).unwrap().tokens
}

fn check(name: &str, tolerance: f32) {
    let model = models::load(golden_dir(name)).unwrap();
    let g = golden(name);
    assert_eq!(g.prompt.len(), 40);
    let full = max_diff(&full_logits(model.as_ref(), &g.prompt), &g.logits);
    assert!(full <= tolerance, "{name}: full-sequence logits differ by {full} > {tolerance}");
    let incremental = max_diff(&incremental_logits(model.as_ref(), &g.prompt), &g.logits);
    assert!(
        incremental <= tolerance,
        "{name}: incremental logits differ by {incremental} > {tolerance}"
    );
    let chunked = max_diff(&chunked_logits(model.as_ref(), &g.prompt, 7), &g.logits);
    assert!(
        chunked <= tolerance,
        "{name}: 7-token chunked prefill differs by {chunked} > {tolerance}"
    );
    assert_eq!(
        greedy(model.as_ref(), &g.prompt, g.greedy.len()),
        g.greedy,
        "{name}: greedy tokens"
    );
}

#[test]
fn dense_f32_matches_the_reference() {
    check("dense", 1e-4);
}

#[test]
fn k_eq_v_matches_the_reference() {
    check("k_eq_v", 1e-4);
}

#[test]
fn text_only_checkpoint_matches_the_reference() {
    check("text_only", 1e-4);
}

#[test]
fn four_bit_matches_the_reference() {
    check("dense_q4", 1e-3);
}

#[test]
fn eight_bit_matches_the_reference() {
    check("dense_q8", 1e-3);
}

/// The mixture-of-experts block (26B-A4B's layout at toy size: 4 experts, 2 per token): a
/// 40-token prefill routes 78 rows, so mlx-lm's sorted route runs there and the unsorted one
/// in every decode step.
#[test]
fn mixture_of_experts_matches_the_reference() {
    check("moe", 1e-4);
}

/// The same with 4-bit experts (quantized expert products) and the router at 8 bits.
#[test]
fn four_bit_mixture_of_experts_matches_the_reference() {
    check("moe_q4", 1e-3);
}

/// Compiled decode against the uncompiled step on the same caches' history: from a 3-token
/// prompt the sliding windows (6 or 8) fill and then wrap during the 40 decoded tokens, so
/// both slot layouts run (filling rings read by concatenation, then rings written in place).
/// Every step's logits agree, the greedy picks are the same, the caches end holding the same
/// positions, and the two graphs are traced once and reused by a second generation. On CUDA
/// the step reads its caches by buffer reads (written in place by Quince's attention kernel):
/// one graph, traced with shapes, for every slot layout.
#[test]
fn compiled_decode_matches_the_uncompiled_step() {
    let graph_count = if mlx::Backend::current() == mlx::Backend::Cuda { 1 } else { 2 };
    for (name, tolerance) in
        [("dense", 1e-5), ("k_eq_v", 1e-5), ("dense_q4", 1e-4), ("moe_q4", 1e-4)]
    {
        let model = models::load(golden_dir(name)).unwrap();
        let graphs = model.decode_graphs().expect("Gemma 4 has a compiled decode step");
        graphs.set_enabled(true);
        let prompt = golden(name).prompt[..3].to_vec();
        let (mut compiled, mut plain) = (model.new_caches().unwrap(), model.new_caches().unwrap());
        let ids = token_array(&prompt).unwrap();
        model.forward(&ids, &mut compiled, Phase::Window).unwrap();
        let last = model.forward(&ids, &mut plain, Phase::Window).unwrap();
        let mut token = last
            .argmax(-1, false)
            .unwrap()
            .astype(mlx::Dtype::Int32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap()[2];
        for step in 0..40 {
            let t = token_array(&[token as u32]).unwrap();
            let a = model.forward_decode(&t, &mut compiled).unwrap();
            let b = model.forward(&t, &mut plain, Phase::Decode).unwrap();
            let diff = max_diff(&a, &b);
            assert!(diff <= tolerance, "{name}: step {step} logits differ by {diff}");
            let pick = |x: &Array| {
                x.argmax(-1, false)
                    .unwrap()
                    .astype(mlx::Dtype::Int32)
                    .unwrap()
                    .to_vec::<i32>()
                    .unwrap()[0]
            };
            assert_eq!(pick(&a), pick(&b), "{name}: step {step} greedy pick");
            token = pick(&b);
        }
        let stats = graphs.stats();
        let counts = (stats.graphs, stats.steps, stats.uncompiled);
        assert_eq!(counts, (graph_count, 40, 0), "{name}: {stats:?}");
        for (i, (c, p)) in compiled.iter().zip(&plain).enumerate() {
            assert_eq!(c.offset(), p.offset(), "{name}: cache {i} offset");
            let (c, p) = (c.state().unwrap(), p.state().unwrap());
            for (key, tensor) in &c.tensors {
                let diff = max_diff(tensor, &p.tensors[key]);
                assert!(diff <= tolerance, "{name}: cache {i} {key} differs by {diff}");
            }
        }

        // Whole generations, compiled and not: the same tokens, and no new graph.
        let on = greedy(model.as_ref(), &prompt, 48);
        graphs.set_enabled(false);
        let off = greedy(model.as_ref(), &prompt, 48);
        graphs.set_enabled(true);
        assert_eq!(on, off, "{name}: greedy tokens with and without compiled decode");
        let after = graphs.stats();
        assert_eq!(after.graphs, graph_count, "{name}: a later generation reuses the graphs");
        assert_eq!(after.steps, 40 + 47, "{name}: {after:?}");
    }
}

/// Overlapped decoding (CUDA: an evaluator thread records step *t+1* while the engine thread
/// builds step *t+2*) gives the single-thread loop's tokens, stop reasons and caches: over a
/// sliding window that wraps, ending on a stop token, on the token limit (1, 2 and many), and
/// for a second turn on the same caches, which also checks that the loop leaves the caches'
/// in-kernel writes finished and the thread's own stream in place.
#[test]
fn overlapped_decode_matches_the_single_thread_loop() {
    if mlx::Backend::current() != mlx::Backend::Cuda {
        eprintln!("skipped: overlapped decoding runs on CUDA only");
        return;
    }
    let run = |model: &dyn Model, prompt: &[u32], n: usize, stop: &[u32], overlap: bool| {
        engine::generate::set_overlapped_decode(overlap);
        let mut caches = model.new_caches().unwrap();
        let request = GenerateRequest {
            prefill_step: 16,
            stop_tokens: stop.to_vec(),
            ..GenerateRequest::new(prompt.to_vec(), n)
        };
        let loops = engine::generate::overlapped_loops();
        let first = generate(model, &mut caches, &request, |_| Flow::Continue).unwrap();
        let ran = engine::generate::overlapped_loops() > loops;
        assert_eq!(ran, overlap && n > 1, "the overlapped loop ran: {ran}");
        // A second turn on the same caches.
        let next = GenerateRequest { stop_tokens: Vec::new(), ..request.clone() };
        let second = generate(model, &mut caches, &next, |_| Flow::Continue).unwrap();
        engine::generate::set_overlapped_decode(false);
        (first.tokens, format!("{:?}", first.stop_reason), second.tokens, caches)
    };
    for name in ["dense", "dense_q4"] {
        let model = models::load(golden_dir(name)).unwrap();
        let prompt = golden(name).prompt[..5].to_vec();
        let (all, ..) = run(model.as_ref(), &prompt, 40, &[], true);
        for (n, stop) in [(40, vec![]), (40, vec![all[12]]), (1, vec![]), (2, vec![])] {
            let on = run(model.as_ref(), &prompt, n, &stop, true);
            let off = run(model.as_ref(), &prompt, n, &stop, false);
            let case = format!("{name}, {n} tokens, stop {stop:?}");
            assert_eq!((&on.0, &on.1, &on.2), (&off.0, &off.1, &off.2), "{case}: tokens");
            if !stop.is_empty() {
                assert!(on.0.len() <= 13 && on.0.last() == stop.first(), "{case}: {:?}", on.0);
            }
            for (i, (a, b)) in on.3.iter().zip(&off.3).enumerate() {
                assert_eq!(a.offset(), b.offset(), "{case}: cache {i} offset");
                let (a, b) = (a.state().unwrap(), b.state().unwrap());
                for (key, tensor) in &a.tensors {
                    let diff = max_diff(tensor, &b.tensors[key]);
                    assert!(diff == 0.0, "{case}: cache {i} {key} differs by {diff}");
                }
            }
        }
    }
}

/// A model with stacked projections and the fused decode kernels (`engine::fused`) gives the
/// logits and greedy tokens of one with separate projections decoding by MLX ops, on
/// checkpoints with per-layer inputs, KV sharing, `attention_k_eq_v` and 4-bit weights. The
/// stacked model decodes as its backend does by default: on CUDA op by op through the kernels,
/// its caches written inside the attention kernel (buffer reads, counted), elsewhere (where
/// the kernels never run) as a compiled step that splits the stacked outputs by gathers. The
/// other writes its caches by MLX's slice update. (The switches are process-wide: nextest runs
/// each test in its own process.)
#[test]
fn stacked_and_fused_decode_matches_separate_projections_by_mlx_ops() {
    for (name, tolerance) in [("dense", 1e-4), ("k_eq_v", 1e-4), ("dense_q4", 1e-4)] {
        engine::nn::set_stacked_projections(Some(true));
        let stacked = models::load(golden_dir(name)).unwrap();
        engine::nn::set_stacked_projections(Some(false));
        let separate = models::load(golden_dir(name)).unwrap();
        engine::nn::set_stacked_projections(None);
        separate.decode_graphs().expect("Gemma 4 has a compiled decode step").set_enabled(false);
        let prompt = golden(name).prompt[..3].to_vec();
        let (mut a_caches, mut b_caches) =
            (stacked.new_caches().unwrap(), separate.new_caches().unwrap());
        let ids = token_array(&prompt).unwrap();
        let a = stacked.forward(&ids, &mut a_caches, Phase::Window).unwrap();
        let b = separate.forward(&ids, &mut b_caches, Phase::Window).unwrap();
        assert!(max_diff(&a, &b) <= tolerance, "{name}: prefill logits differ");
        let pick = |x: &Array| {
            let picks = x.argmax(-1, false).unwrap().astype(mlx::Dtype::Int32).unwrap();
            *picks.to_vec::<i32>().unwrap().last().unwrap()
        };
        let mut token = pick(&b);
        let buffer_reads = engine::cache::buffer_reads();
        for step in 0..24 {
            let t = token_array(&[token as u32]).unwrap();
            engine::fused::set_decode_fusion(true);
            let a = stacked.forward_decode(&t, &mut a_caches).unwrap();
            engine::fused::set_decode_fusion(false);
            engine::cache::set_buffer_reads(false);
            let b = separate.forward_decode(&t, &mut b_caches).unwrap();
            engine::cache::set_buffer_reads(true);
            engine::fused::set_decode_fusion(true);
            let diff = max_diff(&a, &b);
            assert!(diff <= tolerance, "{name}: step {step} logits differ by {diff}");
            assert_eq!(pick(&a), pick(&b), "{name}: step {step} greedy pick");
            token = pick(&b);
        }
        if mlx::Backend::current() == mlx::Backend::Cuda {
            let used = engine::fused::kernels_in_use();
            for kernel in ["quince_decode_heads", "quince_geglu", "quince_residual_norm"] {
                assert!(used.contains(&kernel), "{name}: {kernel} did not run ({used:?})");
            }
            // Every layer of every step: its own cache's write and read in one kernel, or a
            // KV-sharing layer's read of the written buffers.
            let config = std::fs::read_to_string(golden_dir(name).join("config.json")).unwrap();
            let config: serde_json::Value = serde_json::from_str(&config).unwrap();
            let text = config.get("text_config").unwrap_or(&config);
            let layers = text["num_hidden_layers"].as_u64().unwrap() as usize;
            let reads = engine::cache::buffer_reads() - buffer_reads;
            assert_eq!(reads, 24 * layers, "{name}: decode steps attended by buffer reads");
        }
    }
}
