//! Gemma 4 text against the reference: logits of mlx-lm 0.32.2 / mlx-vlm 0.7.10 and their
//! greedy continuation, recorded by `tests/golden/gemma4/make_golden.py` on tiny random-weight
//! checkpoints (f32, 4-bit, 8-bit, `attention_k_eq_v`, `gemma4_text`, MoE). Every checkpoint's
//! sliding window (6 or 8) is shorter than its 40-token prompt.

use std::path::{Path, PathBuf};

use engine::LoadOptions;
use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest};
use engine::models::{Model, Phase};
use engine::tokens::ids as token_array;
use mlx::{Array, ops};

fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/gemma4").join(name)
}

pub(crate) struct Golden {
    pub(crate) prompt: Vec<u32>,
    pub(crate) logits: Array,
    pub(crate) greedy: Vec<u32>,
}

fn golden(name: &str) -> Golden {
    golden_at(&golden_dir(name))
}

pub(crate) fn golden_at(dir: &Path) -> Golden {
    let file = mlx::io::load_safetensors(dir.join("golden.safetensors")).unwrap();
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

pub(crate) fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape(), "logit shapes");
    a.subtract(b).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

pub(crate) fn full_logits(model: &dyn Model, prompt: &[u32]) -> Array {
    let mut caches = model.fresh_caches().unwrap();
    let logits = model.forward(&token_array(prompt).unwrap(), &mut caches, Phase::Window).unwrap();
    logits.reshape(&[prompt.len() as i32, -1]).unwrap()
}

pub(crate) fn incremental_logits(model: &dyn Model, prompt: &[u32]) -> Array {
    let mut caches = model.fresh_caches().unwrap();
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
    let mut caches = model.fresh_caches().unwrap();
    let rows: Vec<Array> = prompt
        .chunks(chunk)
        .map(|c| model.forward(&token_array(c).unwrap(), &mut caches, Phase::Window).unwrap())
        .collect();
    ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1)
        .unwrap()
        .reshape(&[prompt.len() as i32, -1])
        .unwrap()
}

pub(crate) fn greedy(model: &dyn Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut caches = model.fresh_caches().unwrap();
    let request = GenerateRequest { prefill_step: 16, ..GenerateRequest::new(prompt.to_vec(), n) };
    generate(model, &mut caches, &request, |_| Flow::Continue).unwrap().tokens
}

fn check(name: &str, tolerance: f32) {
    check_checkpoint(&golden_dir(name), tolerance);
}

/// A golden checkpoint folder against its goldens: full-sequence, token-by-token and chunked
/// logits within `tolerance`, and the greedy continuation exactly.
pub(crate) fn check_checkpoint(dir: &Path, tolerance: f32) {
    let name = dir.display();
    let model = engine::registry::load_model(dir, &engine::LoadOptions::default()).unwrap();
    let g = golden_at(dir);
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
/// positions, and the two graphs are traced once and reused by a second generation; a model
/// loaded without compiled decode generates the same tokens.
#[test]
fn compiled_decode_matches_the_uncompiled_step() {
    let compiled_options = LoadOptions { compiled_decode: Some(true), ..LoadOptions::default() };
    let op_by_op = LoadOptions { compiled_decode: Some(false), ..LoadOptions::default() };
    for (name, tolerance) in
        [("dense", 1e-5), ("k_eq_v", 1e-5), ("dense_q4", 1e-4), ("moe_q4", 1e-4)]
    {
        let model = test_support::load_with(&golden_dir(name), &compiled_options);
        let graphs = model.decode_graphs().expect("Gemma 4 has a compiled decode step");
        let prompt = golden(name).prompt[..3].to_vec();
        let (mut compiled, mut plain) =
            (model.fresh_caches().unwrap(), model.fresh_caches().unwrap());
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
        assert_eq!(counts, (2, 40, 0), "{name}: {stats:?}");
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
        let uncompiled = test_support::load_with(&golden_dir(name), &op_by_op);
        let off = greedy(uncompiled.as_ref(), &prompt, 48);
        assert_eq!(uncompiled.decode_graphs().map(|g| g.stats().steps), Some(0), "{name}");
        assert_eq!(on, off, "{name}: greedy tokens with and without compiled decode");
        let after = graphs.stats();
        assert_eq!(after.graphs, 2, "{name}: a later generation reuses the graphs");
        assert_eq!(after.steps, 40 + 47, "{name}: {after:?}");
    }
}

/// A model with stacked projections and Quince's kernels (`engine::backend`) gives the logits
/// and greedy tokens of one with separate projections decoding by MLX's ops, on checkpoints
/// with per-layer inputs, KV sharing, `attention_k_eq_v` and 4-bit weights. On CUDA the first
/// runs the fused kernels and the one-query attention kernel (checked: they
/// ran); elsewhere no kernel exists and the test checks stacking against separate products.
#[test]
fn stacked_and_fused_decode_matches_separate_projections_by_mlx_ops() {
    // As the backend decodes by default: on CUDA op by op through the kernels, elsewhere as a
    // compiled step that splits the stacked outputs by gathers.
    let kernels = LoadOptions { stacked_projections: Some(true), ..LoadOptions::default() };
    let mlx_ops = LoadOptions {
        kernels: engine::KernelOptions::mlx(),
        stacked_projections: Some(false),
        compiled_decode: Some(false),
    };
    // On the CPU the two stay within 1e-4. On CUDA (MLX 0.32.4, H200) they drift further
    // apart: 1.7e-4 after a 3-token prefill of `dense`, 1.0e-3 and then 3.3e-3 in the first
    // decode steps; a bound for CUDA is still to be found.
    let tolerance = 1e-4;
    for name in ["dense", "k_eq_v", "dense_q4"] {
        let stacked = test_support::load_with(&golden_dir(name), &kernels);
        let separate = test_support::load_with(&golden_dir(name), &mlx_ops);
        assert!(!separate.ops().has_kernels());
        let prompt = golden(name).prompt[..3].to_vec();
        let (mut a_caches, mut b_caches) =
            (stacked.fresh_caches().unwrap(), separate.fresh_caches().unwrap());
        let ids = token_array(&prompt).unwrap();
        let a = stacked.forward(&ids, &mut a_caches, Phase::Window).unwrap();
        let b = separate.forward(&ids, &mut b_caches, Phase::Window).unwrap();
        let diff = max_diff(&a, &b);
        assert!(diff <= tolerance, "{name}: prefill logits differ by {diff}");
        let pick = |x: &Array| {
            let picks = x.argmax(-1, false).unwrap().astype(mlx::Dtype::Int32).unwrap();
            *picks.to_vec::<i32>().unwrap().last().unwrap()
        };
        let mut token = pick(&b);
        for step in 0..24 {
            let t = token_array(&[token as u32]).unwrap();
            let a = stacked.forward_decode(&t, &mut a_caches).unwrap();
            let b = separate.forward_decode(&t, &mut b_caches).unwrap();
            let diff = max_diff(&a, &b);
            assert!(diff <= tolerance, "{name}: step {step} logits differ by {diff}");
            assert_eq!(pick(&a), pick(&b), "{name}: step {step} greedy pick");
            token = pick(&b);
        }
        let used = stacked.ops().kernels_in_use();
        if mlx::Backend::current() == mlx::Backend::Cuda {
            for kernel in
                ["quince_decode_heads", "quince_geglu", "quince_residual_norm", "quince_one_query"]
            {
                assert!(used.contains(&kernel), "{name}: {kernel} did not run ({used:?})");
            }
        } else {
            assert!(used.is_empty(), "{name}: no kernel of Quince's runs off CUDA ({used:?})");
        }
    }
}
