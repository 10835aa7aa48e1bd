//! safetensors: round trip with metadata, the file format checked byte for byte, bad files.

use std::collections::BTreeMap;

use mlx::io::{load_safetensors, save_safetensors};
use mlx::{Array, Dtype, ops};

use crate::common::assert_same;

#[test]
fn round_trip_keeps_arrays_dtypes_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    let mut tensors = BTreeMap::new();
    let f32s = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[3, 4]).unwrap();
    tensors.insert("layers.0.keys".to_string(), f32s.clone());
    tensors.insert("layers.0.values".to_string(), f32s.astype(Dtype::Bfloat16).unwrap());
    tensors.insert("half".to_string(), f32s.astype(Dtype::Float16).unwrap());
    tensors.insert("ids".to_string(), Array::from_slice(&[5i32, -3, 7], &[3]).unwrap());
    tensors.insert("flags".to_string(), Array::from_slice(&[true, false], &[2]).unwrap());
    tensors.insert("bytes".to_string(), Array::from_slice(&[0u8, 255], &[2]).unwrap());
    let mut metadata = BTreeMap::new();
    metadata.insert("offset".to_string(), "12".to_string());
    metadata.insert("signature".to_string(), "plain:bf16:window=none".to_string());
    save_safetensors(&path, &tensors, &metadata).unwrap();

    let loaded = load_safetensors(&path).unwrap();
    assert_eq!(loaded.tensors.len(), tensors.len());
    for (name, original) in &tensors {
        let back = &loaded.tensors[name];
        assert_eq!(back.dtype(), original.dtype(), "{name}");
        assert_eq!(back.to_bytes().unwrap(), original.to_bytes().unwrap(), "{name} bit-identical");
    }
    let metadata_back: BTreeMap<_, _> = loaded.metadata.into_iter().collect();
    assert_eq!(metadata_back, metadata);

    // The file itself, read without MLX: u64 header length, JSON header, raw data.
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header["layers.0.values"]["dtype"], "BF16");
    assert_eq!(header["layers.0.keys"]["dtype"], "F32");
    assert_eq!(header["flags"]["dtype"], "BOOL");
    assert_eq!(header["layers.0.keys"]["shape"], serde_json::json!([3, 4]));
    assert_eq!(header["__metadata__"]["offset"], "12");
    let offsets = &header["ids"]["data_offsets"];
    let start = 8 + header_len + offsets[0].as_u64().unwrap() as usize;
    let raw: Vec<i32> = bytes[start..start + 12]
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(raw, vec![5, -3, 7]);
}

#[test]
fn reads_files_written_by_another_implementation() {
    // The op fixtures were written by the Python script's own minimal writer.
    let loaded = load_safetensors(crate::common::fixture_path()).unwrap();
    assert_eq!(
        loaded.metadata.get("generator").map(String::as_str),
        Some("tests/golden/ops/make_fixtures.py")
    );
    let bf = &loaded.tensors["bf16.a"];
    assert_eq!(bf.dtype(), Dtype::Bfloat16);
    assert_same(&bf.astype(Dtype::Float32).unwrap(), &loaded.tensors["astype.bf16_roundtrip"]);
}

#[test]
fn bad_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = load_safetensors(dir.path().join("nope.safetensors")).expect_err("missing file");
    assert!(!missing.message().is_empty());

    let corrupt = dir.path().join("corrupt.safetensors");
    let mut bytes = 40u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"a\": {\"dtype\": \"F32\", \"shape\": [2");
    std::fs::write(&corrupt, &bytes).unwrap();
    let err = load_safetensors(&corrupt).expect_err("truncated header");
    assert!(!err.message().is_empty(), "{err}");

    let huge = dir.path().join("huge-header.safetensors");
    std::fs::write(&huge, u64::MAX.to_le_bytes()).unwrap();
    assert!(load_safetensors(&huge).is_err(), "a header length past the file is refused");
}
