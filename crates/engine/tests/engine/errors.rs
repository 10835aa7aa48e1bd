//! Bad checkpoints and requests give clear errors that name what is wrong.

use std::fs;
use std::path::{Path, PathBuf};

use engine::Error;
use engine::generate::{Flow, GenerateRequest, generate};
use serde_json::Value;

/// A copy of the `dense` golden checkpoint in a temp dir, with `edit` applied to its config.
fn checkpoint(edit: impl FnOnce(&mut Value)) -> (tempfile::TempDir, PathBuf) {
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/gemma4/dense");
    let dir = tempfile::tempdir().unwrap();
    for name in ["model.safetensors", "model.safetensors.index.json"] {
        fs::copy(source.join(name), dir.path().join(name)).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&fs::read_to_string(source.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let path = dir.path().to_path_buf();
    (dir, path)
}

fn load_err(path: &Path) -> Error {
    engine::registry::load_model(path, &engine::LoadOptions::default())
        .expect_err("this checkpoint must be refused")
}

#[test]
fn missing_config_key_is_named() {
    let (_dir, path) = checkpoint(|c| {
        c["text_config"].as_object_mut().unwrap().remove("hidden_size");
    });
    let err = load_err(&path);
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert!(err.to_string().contains("hidden_size"), "{err}");
}

#[test]
fn wrong_tensor_shape_names_the_tensor() {
    let (_dir, path) = checkpoint(|c| c["text_config"]["intermediate_size"] = 96.into());
    let err = load_err(&path);
    match &err {
        Error::TensorShape { name, actual, expected } => {
            assert!(name.contains("mlp"), "{name}");
            assert_ne!(actual, expected);
        }
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[test]
fn missing_shard_is_named() {
    let (_dir, path) = checkpoint(|_| {});
    fs::remove_file(path.join("model.safetensors")).unwrap();
    let err = load_err(&path);
    assert!(
        matches!(&err, Error::MissingShard { path } if path.ends_with("model.safetensors")),
        "{err:?}"
    );

    let (_dir, path) = checkpoint(|_| {});
    fs::remove_file(path.join("model.safetensors.index.json")).unwrap();
    fs::remove_file(path.join("model.safetensors")).unwrap();
    assert!(matches!(load_err(&path), Error::MissingShard { .. }), "no weights at all");
}

#[test]
fn unsupported_model_type_and_incomplete_features_are_refused() {
    let (_dir, path) = checkpoint(|c| c["model_type"] = "llama".into());
    let err = load_err(&path);
    assert!(
        matches!(&err, Error::Unsupported { key, value, .. } if key == "model_type" && value == "llama"),
        "{err:?}"
    );

    // A mixture-of-experts block needs its sizes, and its weights.
    let (_dir, path) = checkpoint(|c| c["text_config"]["enable_moe_block"] = true.into());
    let err = load_err(&path);
    assert!(
        matches!(&err, Error::Config { message, .. } if message.contains("text_config.num_experts")),
        "{err:?}"
    );
    let moe = |top_k: i32| {
        checkpoint(move |c| {
            let t = &mut c["text_config"];
            t["enable_moe_block"] = true.into();
            t["num_experts"] = 4.into();
            t["top_k_experts"] = top_k.into();
            t["moe_intermediate_size"] = 8.into();
        })
    };
    let (_dir, path) = moe(5);
    let err = load_err(&path);
    assert!(err.to_string().contains("top_k_experts (5) exceeds num_experts (4)"), "{err}");
    let (_dir, path) = moe(2);
    let err = load_err(&path);
    assert!(
        matches!(&err, Error::MissingTensor { name, .. } if name.ends_with("router.scale")),
        "{err:?}"
    );

    let (_dir, path) = checkpoint(|c| {
        c["text_config"]["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into()
    });
    let err = load_err(&path);
    assert!(err.to_string().contains("rope_parameters.full_attention.rope_type"), "{err}");
}

#[test]
fn corrupt_safetensors_header_is_reported() {
    let (_dir, path) = checkpoint(|_| {});
    let mut bytes = 64u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"language_model.model.norm.weight\": {\"dtype\": \"F3");
    fs::write(path.join("model.safetensors"), bytes).unwrap();
    let err = load_err(&path);
    assert!(
        matches!(&err, Error::CorruptWeights { path, .. } if path.ends_with("model.safetensors")),
        "{err:?}"
    );
}

#[test]
fn prompt_over_the_context_limit_is_refused_before_any_work() {
    let (_dir, path) = checkpoint(|c| c["text_config"]["max_position_embeddings"] = 48.into());
    let model = engine::registry::load_model(&path, &engine::LoadOptions::default()).unwrap();
    let mut caches = model.fresh_caches().unwrap();
    let request = GenerateRequest::new((3..43).collect(), 16);
    let err = generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue)
        .expect_err("40 + 16 > 48");
    assert!(
        matches!(err, Error::ContextOverflow { prompt_tokens: 40, max_new_tokens: 16, limit: 48 }),
        "{err:?}"
    );
    assert_eq!(caches[0].offset(), 0, "nothing was appended");
    let bad_id = GenerateRequest::new(vec![3, 9999], 4);
    assert!(matches!(
        generate(model.as_ref(), &mut caches, &bad_id, |_| Flow::Continue),
        Err(Error::InvalidRequest(_))
    ));
    let empty = GenerateRequest::new(Vec::new(), 4);
    assert!(generate(model.as_ref(), &mut caches, &empty, |_| Flow::Continue).is_err());
    // The model still works after the refusals.
    let ok = GenerateRequest::new(vec![3, 4, 5], 4);
    assert_eq!(
        generate(model.as_ref(), &mut caches, &ok, |_| Flow::Continue).unwrap().tokens.len(),
        4
    );
}

#[test]
fn stop_tokens_and_cancellation_end_generation() {
    let (_dir, path) = checkpoint(|_| {});
    let model = engine::registry::load_model(&path, &engine::LoadOptions::default()).unwrap();
    let prompt: Vec<u32> = (10..30).collect();
    let mut caches = model.fresh_caches().unwrap();
    let free =
        generate(model.as_ref(), &mut caches, &GenerateRequest::new(prompt.clone(), 12), |_| {
            Flow::Continue
        })
        .unwrap();
    assert_eq!(free.tokens.len(), 12);
    // Stop on the third token of the free run.
    let stop = free.tokens[2];
    let first = free.tokens.iter().position(|&t| t == stop).unwrap();
    let request =
        GenerateRequest { stop_tokens: vec![stop], ..GenerateRequest::new(prompt.clone(), 12) };
    let mut caches = model.fresh_caches().unwrap();
    let stopped = generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue).unwrap();
    assert_eq!(stopped.tokens, free.tokens[..=first].to_vec());
    assert_eq!(stopped.stop_reason, engine::generate::StopReason::StopToken);
    // The callback stops after five tokens.
    let mut seen = 0;
    let mut caches = model.fresh_caches().unwrap();
    let cancelled =
        generate(model.as_ref(), &mut caches, &GenerateRequest::new(prompt, 12), |_| {
            seen += 1;
            if seen == 5 { Flow::Stop } else { Flow::Continue }
        })
        .unwrap();
    assert_eq!(cancelled.tokens, free.tokens[..5].to_vec());
    assert_eq!(cancelled.stop_reason, engine::generate::StopReason::Stopped);
}
