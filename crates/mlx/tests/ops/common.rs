//! Fixture loading and comparisons shared by the test modules.

use std::path::PathBuf;
use std::sync::OnceLock;

use mlx::{Array, Dtype};

pub fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/ops/ops.safetensors")
}

/// The fixture array `name` (panics with the name when missing: a test-data bug).
pub fn fx(name: &str) -> Array {
    static FILE: OnceLock<std::collections::HashMap<String, Vec<u8>>> = OnceLock::new();
    // Parse the file once per process; hand each test fresh arrays built from the raw bytes
    // so tests never share graph nodes.
    let raw = FILE.get_or_init(|| {
        let loaded = mlx::io::load_safetensors(fixture_path()).expect("fixture file loads");
        loaded.tensors.iter().map(|(k, v)| (k.clone(), encode(v))).collect()
    });
    let bytes = raw.get(name).unwrap_or_else(|| panic!("fixture {name} missing"));
    decode(bytes)
}

// A small self-describing encoding: dtype code, ndim, dims, data.
fn encode(a: &Array) -> Vec<u8> {
    let mut out = vec![a.dtype() as u8, a.ndim() as u8];
    for d in a.shape() {
        out.extend_from_slice(&d.to_le_bytes());
    }
    out.extend(a.to_bytes().expect("fixture evaluates"));
    out
}

fn decode(bytes: &[u8]) -> Array {
    let dtype = match bytes[0] {
        x if x == Dtype::Bool as u8 => Dtype::Bool,
        x if x == Dtype::Uint8 as u8 => Dtype::Uint8,
        x if x == Dtype::Uint32 as u8 => Dtype::Uint32,
        x if x == Dtype::Int32 as u8 => Dtype::Int32,
        x if x == Dtype::Int64 as u8 => Dtype::Int64,
        x if x == Dtype::Float16 as u8 => Dtype::Float16,
        x if x == Dtype::Bfloat16 as u8 => Dtype::Bfloat16,
        _ => Dtype::Float32,
    };
    let ndim = bytes[1] as usize;
    let shape: Vec<i32> = (0..ndim)
        .map(|i| i32::from_le_bytes(bytes[2 + 4 * i..6 + 4 * i].try_into().expect("4 bytes")))
        .collect();
    Array::from_bytes(&bytes[2 + 4 * ndim..], &shape, dtype).expect("fixture array")
}

/// Values as f32 (converting from any dtype).
pub fn values(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).expect("astype").to_vec::<f32>().expect("to_vec")
}

/// Asserts equal shapes and max |actual − expected| ≤ tol.
#[track_caller]
pub fn assert_close(actual: &Array, expected: &Array, tol: f32) {
    assert_eq!(actual.shape(), expected.shape(), "shapes differ");
    let a = values(actual);
    let e = values(expected);
    let (worst, index) = a
        .iter()
        .zip(&e)
        .enumerate()
        .map(|(i, (x, y))| if x == y { (0.0, i) } else { ((x - y).abs(), i) })
        .fold((0.0f32, 0usize), |acc, x| if x.0 > acc.0 || x.0.is_nan() { x } else { acc });
    assert!(
        worst <= tol,
        "max |actual - expected| = {worst} > {tol} at flat index {index}: {} vs {}",
        a[index],
        e[index]
    );
}

/// Asserts identical shapes and values (exact).
#[track_caller]
pub fn assert_same(actual: &Array, expected: &Array) {
    assert_close(actual, expected, 0.0);
}
