//! Gemma 4 text against the reference: logits of mlx-lm 0.32.2 / mlx-vlm 0.7.10 and their
//! greedy continuation, recorded by `tests/golden/gemma4/make_golden.py` on tiny random-weight
//! checkpoints (f32, 4-bit, 8-bit, `attention_k_eq_v`, `gemma4_text`). Every checkpoint's
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
