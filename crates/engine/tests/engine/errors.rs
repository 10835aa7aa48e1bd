//! Bad checkpoints and requests give clear errors that name what is wrong.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use engine::Error;
use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest};
use mlx::Array;
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

fn golden(folder: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(folder)
}

/// A copy of the golden checkpoint `folder` (config, index, preprocessor settings) whose
/// tensors `edit` changes.
fn with_tensors(
    folder: &str,
    edit: impl FnOnce(&mut BTreeMap<String, Array>),
) -> (tempfile::TempDir, PathBuf) {
    let source = golden(folder);
    let dir = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".json") {
            fs::copy(&path, dir.path().join(&name)).unwrap();
        }
    }
    let file = mlx::io::load_safetensors(source.join("model.safetensors")).unwrap();
    let mut tensors: BTreeMap<String, Array> = file.tensors.into_iter().collect();
    edit(&mut tensors);
    let metadata: BTreeMap<String, String> = file.metadata.into_iter().collect();
    mlx::io::save_safetensors(dir.path().join("model.safetensors"), &tensors, &metadata).unwrap();
    let path = dir.path().to_path_buf();
    (dir, path)
}

/// Loads a model or a drafter folder, by its family.
fn load(path: &Path) -> engine::Result<()> {
    let options = engine::LoadOptions::default();
    match engine::registry::inspect(path)?.is_drafter() {
        true => engine::registry::load_drafter(path, &options).map(drop),
        false => engine::registry::load_model(path, &options).map(drop),
    }
}

/// Every family and drafter, in each layout the goldens hold: a tensor the model does not
/// know refuses the load, named (with every other such tensor), and so does a missing one.
#[test]
fn a_tensor_the_model_does_not_use_or_lacks_is_refused_by_name_in_every_family() {
    // (golden folder, a tensor the model needs)
    let cases = [
        ("gemma4/dense", "language_model.model.norm.weight"),
        ("gemma4/dense", "vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"),
        ("gemma4/moe_q4", "model.layers.1.router.scale"),
        ("gemma4/text_only", "model.layers.0.self_attn.q_norm.weight"),
        ("gemma3/text", "model.norm.weight"),
        ("gemma3/text_untied_q4", "lm_head.biases"),
        ("gemma3/vlm", "multi_modal_projector.mm_input_projection_weight"),
        ("qwen3_5/dense", "language_model.model.layers.0.linear_attn.A_log"),
        ("qwen3_5/dense_hf", "model.language_model.layers.3.self_attn.q_norm.weight"),
        ("qwen3_5/moe_q4", "language_model.model.layers.0.mlp.shared_expert_gate.biases"),
        ("qwen3_5/vision", "vision_tower.merger.linear_fc2.weight"),
        ("qwen3_5/mtp", "pre_fc_norm_hidden.weight"),
        ("assistant/assistant", "masked_embedding.centroids.weight"),
    ];
    for (folder, needed) in cases {
        let (_dir, path) = with_tensors(folder, |_| {});
        load(&path).unwrap_or_else(|e| panic!("{folder}: an unchanged copy loads: {e}"));

        let (_dir, path) = with_tensors(folder, |t| {
            let any = t.values().next().unwrap().clone();
            t.insert("model.bogus.weight".into(), any.clone());
            t.insert("zz_extra".into(), any);
        });
        let err = load(&path).expect_err(folder);
        match &err {
            Error::UnusedTensors { names, .. } => {
                assert_eq!(names, &["model.bogus.weight", "zz_extra"], "{folder}")
            }
            other => panic!("{folder}: expected the unused tensors named, got {other:?}"),
        }
        assert!(err.to_string().contains("model.bogus.weight, zz_extra"), "{err}");

        let (_dir, path) = with_tensors(folder, |t| {
            assert!(t.remove(needed).is_some(), "{folder} holds {needed}");
        });
        let err = load(&path).expect_err(folder);
        assert!(
            matches!(&err, Error::MissingTensor { name, .. } if name == needed),
            "{folder}: expected {needed} named missing, got {err:?}"
        );
    }
}

/// What the reference drops is left unread without a word: rotary tables, a KV-sharing layer's
/// keys and values, an audio tower, a tied head, a Qwen3.5 target's MTP layers, and a vision
/// tower the config does not enable. The same tensors where the model reads them are not
/// excused: a vision tower the config enables must be whole.
#[test]
fn what_the_reference_drops_loads_and_nothing_more() {
    let any = || Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let dropped = [
        ("gemma4/dense", "language_model.model.layers.0.self_attn.rotary_emb.inv_freq"),
        ("gemma4/dense", "language_model.model.layers.5.self_attn.k_proj.weight"),
        ("gemma4/dense", "language_model.model.layers.4.self_attn.k_norm.weight"),
        ("gemma4/dense", "audio_tower.layers.0.weight"),
        ("gemma4/dense", "embed_audio.embedding_projection.weight"),
        ("gemma4/dense", "vision_tower.encoder.layers.0.mlp.up_proj.input_max"),
        ("gemma4/text_only", "model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"),
        ("gemma3/text", "vision_tower.vision_model.post_layernorm.weight"),
        ("qwen3_5/dense", "language_model.mtp.fc.weight"),
        ("qwen3_5/dense_hf", "mtp.layers.0.input_layernorm.weight"),
        ("qwen3_5/moe", "language_model.lm_head.weight"),
        ("qwen3_5/dense", "model.visual.blocks.0.norm1.weight"),
        ("assistant/assistant", "lm_head.weight"),
    ];
    for (folder, name) in dropped {
        let (_dir, path) = with_tensors(folder, |t| {
            assert!(t.insert(name.into(), any()).is_none(), "{folder} has no {name} yet");
        });
        load(&path).unwrap_or_else(|e| panic!("{folder} with {name}: {e}"));
    }
    let refused = [
        // Layer 3 is the last to keep its own keys and values (2 of 6 layers share).
        ("gemma4/dense", "language_model.model.layers.3.self_attn.k_proj.bias"),
        ("gemma4/dense", "vision_tower.encoder.layers.0.mlp.extra.weight"),
        ("gemma3/vlm", "vision_tower.vision_model.extra.weight"),
        ("qwen3_5/vision", "vision_tower.blocks.0.extra.weight"),
        ("qwen3_5/mtp", "lm_head.weight"),
    ];
    for (folder, name) in refused {
        let (_dir, path) = with_tensors(folder, |t| {
            t.insert(name.into(), any());
        });
        let err = load(&path).expect_err(name);
        assert!(
            matches!(&err, Error::UnusedTensors { names, .. } if names == &[name]),
            "{folder}: {err:?}"
        );
    }
}

/// A draft model is loaded as a model is: a tensor it does not use fails the reply that asks
/// for it, named, with the way out.
#[test]
fn a_draft_model_with_a_tensor_it_does_not_use_is_refused_by_name() {
    use engine::speculative::Speculation;
    use engine::turn::{ChatModel, Drafters, Prompt, Turn};
    let (_dir, draft) = with_tensors("gemma4/dense_q4", |t| {
        let any = t.values().next().unwrap().clone();
        t.insert("model.bogus.weight".into(), any);
    });
    let chat = ChatModel::load(&golden("gemma4/dense"), &engine::LoadOptions::default()).unwrap();
    let mut drafters = Drafters::new(engine::LoadOptions::default());
    let turn = Turn {
        max_tokens: 4,
        speculation: Speculation::Draft { model: draft },
        ..Turn::new(Prompt::Tokens { ids: vec![2, 40, 41, 42], images: Vec::new() })
    };
    let err = chat.answer(&turn, &mut drafters, |_| Flow::Continue).unwrap_err();
    assert!(matches!(err, Error::Drafter { .. }), "{err:?}");
    assert!(err.to_string().contains("model.bogus.weight"), "{err}");
    assert!(err.to_string().contains("turn speculative decoding off"), "{err}");
}
