//! Qwen3.5 against the reference: logits of mlx-lm 0.32.2's own `qwen3_5` and `qwen3_5_moe`
//! models and their greedy continuation, recorded by `tests/golden/qwen3_5/make_golden.py` on
//! tiny random-weight checkpoints (f32 and 4-bit): gated DeltaNet layers around gated full
//! attention, two value heads per key head, routed experts with a gated shared expert.

use std::path::PathBuf;

use engine::batch::generate;
use engine::generate::{Flow, GenerateRequest, prefill_multimodal};
use engine::models::qwen3_5::Qwen35Text;
use engine::models::{Model, Phase, Rows};
use engine::sampling::SamplingParams;
use engine::speculative::draft_model::DraftModel;
use engine::speculative::lookup::PromptLookup;
use engine::speculative::{DraftLength, DraftMethod, Speculation};
use engine::turn::{ChatModel, Drafters, Joined, Prompt, ResumeCandidate, Turn, TurnBatch};

use super::gemma4::{check_checkpoint, full_logits, golden_at, max_diff};

fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/qwen3_5").join(name)
}

fn load(name: &str) -> Box<dyn Model> {
    engine::registry::load_model(golden_dir(name), &engine::LoadOptions::default()).unwrap()
}

#[test]
fn dense_f32_matches_the_reference() {
    check_checkpoint(&golden_dir("dense"), 1e-4);
}

#[test]
fn dense_four_bit_matches_the_reference() {
    check_checkpoint(&golden_dir("dense_q4"), 1e-3);
}

/// 8 experts, 2 per token: the 40-token prefill routes 80 rows, so the sorted route runs
/// there and the unsorted one in decode steps.
#[test]
fn mixture_of_experts_matches_the_reference() {
    check_checkpoint(&golden_dir("moe"), 1e-4);
}

/// 4-bit experts, the router and the shared expert's gate at 8 bits (mlx-lm's predicate).
#[test]
fn four_bit_mixture_of_experts_matches_the_reference() {
    check_checkpoint(&golden_dir("moe_q4"), 1e-3);
}

/// The Hugging Face layout of the dense checkpoint (`model.language_model.*`, norms stored as
/// `w − 1`, convolutions `[C, 1, K]`) gives the dense checkpoint's logits.
#[test]
fn the_hugging_face_layout_loads_to_the_same_model() {
    let g = golden_at(&golden_dir("dense"));
    let diff = max_diff(&full_logits(load("dense_hf").as_ref(), &g.prompt), &g.logits);
    assert!(diff <= 1e-4, "HF layout logits differ by {diff}");
}

/// A prompt that repeats itself, so prompt lookup has matches to propose.
fn repeating_prompt() -> Vec<u32> {
    let phrase = [17u32, 230, 45, 301, 9, 77, 412, 5];
    (0..5).flat_map(|i| phrase.iter().map(move |&t| t + i % 2)).collect()
}

/// Prompt lookup, the target's own weights in 4 bits (drafts that agree often, not always),
/// the other hybrid model of the same vocabulary (drafts mostly wrong) and, for the dense
/// target, its MTP head.
fn methods(target: &str) -> Vec<(String, Box<dyn DraftMethod>)> {
    let other = if target == "dense" { "moe" } else { "dense" };
    let mut methods: Vec<(String, Box<dyn DraftMethod>)> = vec![
        // Every token looked up: sampled, the random checkpoint rarely continues a match.
        ("lookup".into(), Box::new(PromptLookup::waiting_for_every_token())),
        (format!("draft {target}_q4"), Box::new(DraftModel::new(load(&format!("{target}_q4"))))),
        (format!("draft {other}"), Box::new(DraftModel::new(load(other)))),
    ];
    if target == "dense" {
        // Its multi-token-prediction head (random weights: drafts mostly wrong).
        let options = engine::LoadOptions::default();
        methods.push((
            "mtp".into(),
            engine::registry::load_drafter(golden_dir("mtp"), &options).unwrap(),
        ));
    }
    methods
}

/// Speculative decoding on hybrid targets (and hybrid drafters) gives exactly plain decoding's
/// tokens, greedy and sampled at the same seed: every rejected draft rolls the recurrent state
/// back by replaying the kept positions.
#[test]
fn speculation_on_hybrid_models_gives_the_plain_tokens() {
    for target in ["dense", "moe"] {
        let model = load(target);
        let greedy = GenerateRequest::new(repeating_prompt(), 64);
        let sampling = SamplingParams { temperature: 0.8, seed: 77, ..SamplingParams::default() };
        let sampled = GenerateRequest { sampling, ..greedy.clone() };
        for (what, request) in [("greedy", &greedy), ("sampled", &sampled)] {
            let mut caches = model.fresh_caches().unwrap();
            let want = generate(model.as_ref(), &mut caches, request, |_| Flow::Continue).unwrap();
            for (name, mut method) in methods(target) {
                let mut caches = model.fresh_caches().unwrap();
                let length = DraftLength { max: 4, adaptive: false };
                let (got, spec) = engine::batch::speculate(
                    model.as_ref(),
                    &mut caches,
                    &[],
                    request,
                    method.as_mut(),
                    length,
                    |_| Flow::Continue,
                )
                .unwrap();
                assert_eq!(got.tokens, want.tokens, "{target}, {what}, {name}");
                assert!(spec.rounds > 0 && spec.proposed > 0, "{target}, {what}, {name}");
                assert!(spec.accepted < spec.proposed, "{target}, {what}, {name}: some rejected");
                assert_eq!(
                    caches[0].offset(),
                    request.prompt.len() + got.tokens.len() - 1,
                    "{target}, {what}, {name}"
                );
            }
        }
    }
}

/// A drafter equal to the target is always accepted: the replayed state is the state.
#[test]
fn a_hybrid_draft_equal_to_the_target_is_always_accepted() {
    let model = load("dense");
    let request = GenerateRequest::new(repeating_prompt(), 40);
    let mut caches = model.fresh_caches().unwrap();
    let want = generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue).unwrap();
    let mut method = DraftModel::new(load("dense"));
    let mut caches = model.fresh_caches().unwrap();
    let length = DraftLength { max: 4, adaptive: false };
    let (got, spec) = engine::batch::speculate(
        model.as_ref(),
        &mut caches,
        &[],
        &request,
        &mut method,
        length,
        |_| Flow::Continue,
    )
    .unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(spec.accepted, spec.proposed, "{spec:?}");
}

/// Through the turn API, as `quince chat` runs turns in separate processes: the first turn
/// writes a checkpoint at its boundary; the second, on a freshly loaded model, resumes from it
/// and answers with the cold run's tokens, plainly and with prompt lookup and a draft model.
#[test]
fn turns_resume_from_checkpoints_after_a_restart_as_cold_runs() {
    let dir = golden_dir("dense");
    let tmp = tempfile::tempdir().unwrap();
    let load_chat = || ChatModel::load(&dir, &engine::LoadOptions::default()).unwrap();
    let mut drafters = Drafters::new(engine::LoadOptions::default());
    let first: Vec<u32> = (0..24).map(|i| (i * 37 % 400) + 3).collect();
    let one = load_chat()
        .answer(
            &Turn {
                max_tokens: 10,
                checkpoint_to: Some(tmp.path().join("turn1.safetensors")),
                ..Turn::new(Prompt::Tokens { ids: first, images: Vec::new() })
            },
            &mut drafters,
            |_| Flow::Continue,
        )
        .unwrap();
    let checkpoint = one.checkpoint.expect("the first turn's checkpoint");
    assert!(checkpoint.file.signature.contains("gated_delta("), "{}", checkpoint.file.signature);
    let mut second = checkpoint.tokens.clone();
    second.extend([41, 97, 203, 7, 350, 41, 97, 203]);
    let prompt = Prompt::Tokens { ids: second, images: Vec::new() };
    let cold = load_chat()
        .answer(&Turn { max_tokens: 24, ..Turn::new(prompt.clone()) }, &mut drafters, |_| {
            Flow::Continue
        })
        .unwrap();
    assert_eq!(cold.stats.reused_tokens, 0);
    let candidate = ResumeCandidate {
        id: 3,
        path: checkpoint.file.path.clone(),
        sha256: checkpoint.file.sha256.clone(),
        tokens: checkpoint.tokens.clone(),
        signature: Some(checkpoint.file.signature.clone()),
    };
    for speculation in [
        Speculation::Off,
        Speculation::Lookup,
        Speculation::Draft { model: golden_dir("dense_q4") },
        Speculation::Assistant { model: golden_dir("mtp") },
    ] {
        let warm = load_chat()
            .answer(
                &Turn {
                    max_tokens: 24,
                    resume: vec![candidate.clone()],
                    speculation: speculation.clone(),
                    ..Turn::new(prompt.clone())
                },
                &mut drafters,
                |_| Flow::Continue,
            )
            .unwrap();
        assert_eq!(warm.resumed_from, Some(3), "{speculation:?}");
        assert_eq!(warm.stats.reused_tokens, checkpoint.tokens.len(), "{speculation:?}");
        assert_eq!(warm.tokens, cold.tokens, "{speculation:?}: resumed = cold");
    }
}

/// Turns answered together in one [`TurnBatch`], each writing a checkpoint (its recurrent state
/// kept at the prompt's boundary while it decodes among the others), give what each gives
/// alone: the same tokens and checkpoint files with the same bytes. The first drafts with a
/// draft model (so the batch verifies, and the plain turns join it drafting nothing): its
/// checkpoint keeps the draft model's caches, as its reply alone keeps them.
#[test]
fn turns_answered_together_equal_each_alone_with_their_checkpoints() {
    let chat = ChatModel::load(&golden_dir("dense"), &engine::LoadOptions::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let turn = |i: u32, len: u32, max_tokens: usize, name: &str| Turn {
        max_tokens,
        checkpoint_to: Some(tmp.path().join(name)),
        speculation: match i {
            0 => Speculation::Draft { model: golden_dir("dense_q4") },
            _ => Speculation::Off,
        },
        ..Turn::new(Prompt::Tokens {
            ids: (0..len).map(|j| (j * 37 + i * 11) % 400 + 3).collect(),
            images: Vec::new(),
        })
    };
    let shapes = [(24, 10), (9, 16), (17, 6)];
    let mut drafters = Drafters::new(engine::LoadOptions::default());
    let alone: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(len, max))| {
            let t = turn(i as u32, len, max, &format!("alone{i}.safetensors"));
            chat.answer(&t, &mut drafters, |_| Flow::Continue).unwrap()
        })
        .collect();
    let mut batch = TurnBatch::new(&chat);
    let mut together = std::collections::BTreeMap::new();
    for (i, &(len, max)) in shapes.iter().enumerate() {
        let t = turn(i as u32, len, max, &format!("together{i}.safetensors"));
        let admission = batch.admit(&t).unwrap();
        match batch.join(i as u64, &t, admission, &mut drafters, |_| Flow::Continue).unwrap() {
            Joined::Decoding => {}
            Joined::Ended(outcome) => {
                together.insert(i as u64, *outcome);
            }
            Joined::Waits { .. } | Joined::Behind(_) => panic!("no memory limit was set"),
        }
        batch.step().unwrap().into_iter().for_each(|(id, outcome)| {
            together.insert(id, outcome.unwrap());
        });
    }
    while !batch.is_empty() {
        for (id, outcome) in batch.step().unwrap() {
            together.insert(id, outcome.unwrap());
        }
    }
    for (i, want) in alone.iter().enumerate() {
        let got = &together[&(i as u64)];
        assert_eq!(got.tokens, want.tokens, "turn {i}");
        assert_eq!(got.stats.spec, want.stats.spec, "turn {i}: the draft counts");
        let attached = got.checkpoint.as_ref().unwrap().file.attachments.len();
        assert_eq!(attached, usize::from(i == 0), "turn {i}: the draft model's caches");
        let (a, b) = (got.checkpoint.as_ref().unwrap(), want.checkpoint.as_ref().unwrap());
        assert_eq!(a.tokens, b.tokens, "turn {i}: the checkpoint's boundary");
        assert!(a.file.signature.contains("gated_delta("), "{}", a.file.signature);
        assert_eq!(a.file.sha256, b.file.sha256, "turn {i}: the checkpoint's bytes");
    }
}

/// The MTP head, with an oracle deciding how many drafts each round gets right (the golden's
/// `forced` drafts, as mlx-vlm verified them): records what the head itself proposed and how
/// many drafts the target accepted.
#[derive(Debug)]
struct Oracle {
    inner: Box<dyn DraftMethod>,
    forced: Vec<Vec<u32>>,
    own: Vec<Vec<u32>>,
    accepted: Vec<usize>,
}

impl DraftMethod for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn ports(&self) -> &'static [engine::models::TargetPort] {
        self.inner.ports()
    }
    fn bind(&mut self, target: &dyn Model) -> engine::Result<()> {
        self.inner.bind(target)
    }
    fn start(
        &mut self,
        target: engine::models::Target<'_>,
        context: &[u32],
    ) -> engine::Result<usize> {
        self.inner.start(target, context)
    }
    fn propose(
        &mut self,
        target: engine::models::Target<'_>,
        context: &[u32],
        max: usize,
    ) -> engine::Result<Vec<u32>> {
        let own = self.inner.propose(target, context, max)?;
        let round = self.own.len();
        self.own.push(own.clone());
        Ok(self.forced.get(round).map_or(own, |f| f[..f.len().min(max)].to_vec()))
    }
    fn settle(
        &mut self,
        target: engine::models::Target<'_>,
        accepted: usize,
    ) -> engine::Result<()> {
        self.accepted.push(accepted);
        self.inner.settle(target, accepted)
    }
    fn fork(&self) -> Box<dyn DraftMethod> {
        unreachable!("an oracle drafts for one generation")
    }
}

/// The MTP drafter (`qwen3_5_mtp`) proposes what mlx-vlm 0.7.10's `Qwen3_5MTPDraftModel`
/// proposes in every round of a greedy generation on the dense target, block size 4, rounds
/// accepting 0 to 3 drafts; the reply is plain greedy's.
#[test]
fn the_mtp_head_drafts_what_mlx_vlm_drafts_every_round() {
    let model = load("dense");
    let file = mlx::io::load_safetensors(golden_dir("mtp").join("golden.safetensors")).unwrap();
    let rows = |k: &str| -> Vec<Vec<u32>> {
        let t = &file.tensors[k];
        let width = t.dim(1).unwrap() as usize;
        let flat = t.astype(mlx::Dtype::Int32).unwrap().to_vec::<i32>().unwrap();
        flat.chunks(width)
            .map(|r| r.iter().filter(|&&x| x >= 0).map(|&x| x as u32).collect())
            .collect()
    };
    let list = |k: &str| test_support::ids(&file.tensors[k]);
    let (drafts, forced, accepted) = (rows("drafts"), rows("forced"), list("accepted"));
    let greedy = list("greedy");
    let drafter =
        engine::registry::load_drafter(golden_dir("mtp"), &engine::LoadOptions::default()).unwrap();
    assert_eq!(drafter.name(), "mtp");
    let mut oracle = Oracle { inner: drafter, forced, own: Vec::new(), accepted: Vec::new() };
    // One more token than the reference generated: its rounds draft min(3, left) where ours
    // leave the last token to the target, so the rounds line up.
    let request = GenerateRequest::new(list("prompt"), greedy.len() + 1);
    let mut caches = model.fresh_caches().unwrap();
    let length = DraftLength { max: 3, adaptive: false };
    let (got, _) = engine::batch::speculate(
        model.as_ref(),
        &mut caches,
        &[],
        &request,
        &mut oracle,
        length,
        |_| Flow::Continue,
    )
    .unwrap();
    assert_eq!(got.tokens[..greedy.len()], greedy[..]);
    assert_eq!(oracle.own.len(), drafts.len(), "rounds");
    for (i, (ours, theirs)) in oracle.own.iter().zip(&drafts).enumerate() {
        assert_eq!(ours, theirs, "round {i}: the head's drafts");
    }
    // Every round but the last is settled (the reply ends in the last one).
    let ours: Vec<u32> = oracle.accepted.iter().map(|&a| a as u32).collect();
    assert_eq!(ours.len() + 1, accepted.len());
    assert_eq!(ours[..], accepted[..ours.len()], "accepted per round");
    assert!(ours.contains(&3) && ours.contains(&0), "rounds accept 0 to 3: {ours:?}");
}

/// A config asking for what the engine does not implement is refused at load, naming the key.
#[test]
fn unsupported_config_keys_are_refused_naming_the_key() {
    let cases: [(&str, &str, serde_json::Value); 5] = [
        ("dense", "attention_bias", serde_json::json!(true)),
        ("dense", "attn_output_gate", serde_json::json!(false)),
        ("dense", "rope_parameters", serde_json::json!({"rope_type": "yarn", "factor": 4.0})),
        ("dense", "layer_types", serde_json::json!(vec!["full_attention"; 8])),
        ("moe", "decoder_sparse_step", serde_json::json!(2)),
    ];
    for (name, key, value) in cases {
        let tmp = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(golden_dir(name)).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
        }
        let path = tmp.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["text_config"][key] = value;
        std::fs::write(&path, config.to_string()).unwrap();
        let error = engine::registry::load_model(tmp.path(), &engine::LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(error.contains(key), "{key}: {error}");
    }
}

// ---------------------------------------------------------------------------------------------
// Vision: mlx-vlm 0.7.10's qwen3_5 on `dense`'s text weights with a tiny tower (`vision`)

pub(super) fn vision_golden() -> std::collections::HashMap<String, mlx::Array> {
    mlx::io::load_safetensors(golden_dir("vision").join("golden.safetensors")).unwrap().tensors
}

fn image_path(name: &str) -> PathBuf {
    golden_dir("../vision/images").join(name)
}

pub(super) fn ints(a: &mlx::Array) -> Vec<u32> {
    a.to_vec::<i32>().unwrap().into_iter().map(|v| v as u32).collect()
}

/// What the script's processor was given: (image, max_pixels) per `pixels_i`.
const PREPROCESS: [(&str, u64); 3] =
    [("rgb_640x480.png", 16384), ("rgb_123x77.bmp", 16384), ("rgba_200x256.png", 71680)];

fn vision_model() -> Qwen35Text {
    let dir = engine::checkpoint::ModelDir::open(golden_dir("vision")).unwrap();
    Qwen35Text::load(&dir, &engine::LoadOptions::default()).unwrap()
}

/// The processor's `pixel_values` bit for bit: smart resize (half-to-even rounding, the pixel
/// budget, scaling up), PIL's bicubic resize, the float32 rescale and normalization, the
/// patch layout in merge order with the temporal copy; and its grid.
#[test]
fn vision_preprocessing_matches_mlx_vlm_byte_for_byte() {
    let model = vision_model();
    let images = model.images().expect("the vision checkpoint has a tower");
    let golden = vision_golden();
    for (i, (name, max_pixels)) in PREPROCESS.iter().enumerate() {
        let rgb = engine::vision::image::load_rgb(&image_path(name)).unwrap();
        let prepared = images.preprocess(&rgb, *max_pixels).unwrap();
        let rows = images.patch_rows(&prepared.pixels).unwrap();
        let want = &golden[&format!("pixels_{i}")];
        assert_eq!(rows.shape(), want.shape(), "{name}");
        assert_eq!(max_diff(&rows, want), 0.0, "{name}: pixel values differ");
        let grid = ints(&golden[&format!("grid_{i}")]);
        assert_eq!(grid, [1, prepared.height / 8, prepared.width / 8], "{name}: grid");
        assert_eq!(prepared.soft_tokens as u32, grid[1] * grid[2] / 4, "{name}: soft tokens");
    }
}

/// The tower's features (patch embedding, interpolated positions, 2-D rotary attention, the
/// merger) within 1e-4 of mlx-vlm's, on its grid of 6 × 9 merged blocks.
#[test]
fn vision_features_match_mlx_vlm() {
    let model = vision_model();
    let images = model.images().expect("a tower");
    let rgb = engine::vision::image::load_rgb(&image_path(PREPROCESS[0].0)).unwrap();
    let prepared = images.preprocess(&rgb, PREPROCESS[0].1).unwrap();
    let features = engine::vision::Vision::encode(images, &prepared.pixels).unwrap();
    assert_eq!(features.shape(), [6, 9, 64]);
    let d = max_diff(&features.reshape(&[54, 64]).unwrap(), &vision_golden()["features"]);
    assert!(d <= 1e-4, "features differ by {d}");
}

pub(super) fn prompt_features(model: &dyn Model) -> Vec<mlx::Array> {
    let vision = model.vision().expect("a tower");
    let rgb = engine::vision::image::load_rgb(&image_path("rgb_640x480.png")).unwrap();
    // A budget of 64 soft tokens is 64 · 16² = 16,384 pixels, the golden's max_pixels.
    vec![vision.encode(&vision.prepare(&rgb, 64).unwrap().pixels).unwrap()]
}

/// A prompt with an image after 9 tokens: logits of one window, of a chunked prefill (blocks
/// whole, chunks after the image continuing from its compact positions), and 48 greedy tokens
/// decoded after it (positions shifted by mlx-vlm's rope delta, −45) equal mlx-vlm's.
#[test]
fn image_prompts_match_mlx_vlm_full_chunked_and_greedy() {
    let model = engine::registry::load_model(golden_dir("vision"), &Default::default()).unwrap();
    let golden = vision_golden();
    let tokens = ints(&golden["prompt"]);
    let want = &golden["logits"];
    let images = prompt_features(model.as_ref());
    let t = tokens.len() as i32;
    let mut caches = model.fresh_caches().unwrap();
    let full = model
        .forward_multimodal(&tokens, &images, &mut caches, Rows::All)
        .unwrap()
        .reshape(&[t, -1])
        .unwrap();
    let d = max_diff(&full, want);
    assert!(d <= 1e-4, "one window differs by {d}");
    let want_last = want.slice(&[t - 1, 0], &[t, 512], &[1, 1]).unwrap();
    for step in [4, 7] {
        let mut caches = model.fresh_caches().unwrap();
        let last = prefill_multimodal(model.as_ref(), &mut caches, &tokens, &images, step).unwrap();
        let d = max_diff(&last, &want_last);
        assert!(d <= 1e-4, "chunks of {step}: {d}");
    }
    let request =
        GenerateRequest { images: images.clone(), ..GenerateRequest::new(tokens.clone(), 48) };
    let mut caches = model.fresh_caches().unwrap();
    let reply = generate(model.as_ref(), &mut caches, &request, |_| Flow::Continue).unwrap();
    assert_eq!(reply.tokens, ints(&golden["greedy"]), "greedy after the image");
}

/// The image in a later turn: the text before it cached first (one window, then decode
/// steps), the image's window appended at offset 9, gives the one-shot prompt's logits.
#[test]
fn an_image_in_a_later_turn_reads_like_the_one_shot_prompt() {
    let model = engine::registry::load_model(golden_dir("vision"), &Default::default()).unwrap();
    let golden = vision_golden();
    let tokens = ints(&golden["prompt"]);
    let want = &golden["logits"];
    let images = prompt_features(model.as_ref());
    let mut caches = model.fresh_caches().unwrap();
    let ids = |t: &[u32]| engine::tokens::ids(t).unwrap();
    let mut rows = vec![
        model.forward_rows(&ids(&tokens[..6]), &mut caches, Phase::Window, Rows::All).unwrap(),
    ];
    for &t in &tokens[6..8] {
        rows.push(model.forward(&ids(&[t]), &mut caches, Phase::Decode).unwrap());
    }
    rows.push(model.forward_multimodal(&tokens[8..], &images, &mut caches, Rows::All).unwrap());
    let all = mlx::ops::concatenate(&rows.iter().collect::<Vec<_>>(), 1).unwrap();
    let d = max_diff(&all.reshape(&[tokens.len() as i32, -1]).unwrap(), want);
    assert!(d <= 1e-4, "later image turn differs by {d}");
}

/// A conversation with an image, checkpointed after its first turn, continues after a restart
/// (a fresh model, the checkpoint restored: the image's position shift with it) with the cold
/// run's tokens, plainly and with prompt lookup.
#[test]
fn image_conversations_resume_from_checkpoints_as_cold_runs() {
    let dir = golden_dir("vision");
    let tmp = tempfile::tempdir().unwrap();
    let load_chat = || ChatModel::load(&dir, &engine::LoadOptions::default()).unwrap();
    let mut drafters = Drafters::new(engine::LoadOptions::default());
    let golden = vision_golden();
    let image = image_path("rgb_640x480.png");
    let first = ints(&golden["prompt"]);
    let turn1 = Turn {
        max_tokens: 8,
        max_soft_tokens: 64,
        checkpoint_to: Some(tmp.path().join("turn1.safetensors")),
        ..Turn::new(Prompt::Tokens { ids: first, images: vec![image.clone()] })
    };
    let one = load_chat().answer(&turn1, &mut drafters, |_| Flow::Continue).unwrap();
    assert_eq!(one.tokens, ints(&golden["greedy"])[..8], "the first turn is mlx-vlm's greedy");
    let checkpoint = one.checkpoint.expect("the first turn's checkpoint");
    assert!(checkpoint.file.signature.ends_with("rope_positions"), "{}", checkpoint.file.signature);
    let mut second = checkpoint.tokens.clone();
    second.extend([41, 97, 203, 7, 350, 41, 97, 203]);
    let prompt = Prompt::Tokens { ids: second, images: vec![image] };
    let turn2 = Turn { max_tokens: 16, max_soft_tokens: 64, ..Turn::new(prompt) };
    let cold = load_chat().answer(&turn2, &mut drafters, |_| Flow::Continue).unwrap();
    assert_eq!(cold.stats.reused_tokens, 0);
    let candidate = ResumeCandidate {
        id: 5,
        path: checkpoint.file.path.clone(),
        sha256: checkpoint.file.sha256.clone(),
        tokens: checkpoint.tokens.clone(),
        signature: Some(checkpoint.file.signature.clone()),
    };
    for speculation in [Speculation::Off, Speculation::Lookup] {
        let warm = load_chat()
            .answer(
                &Turn {
                    resume: vec![candidate.clone()],
                    speculation: speculation.clone(),
                    ..turn2.clone()
                },
                &mut drafters,
                |_| Flow::Continue,
            )
            .unwrap();
        assert_eq!(warm.resumed_from, Some(5), "{speculation:?}");
        assert_eq!(warm.stats.reused_tokens, checkpoint.tokens.len(), "{speculation:?}");
        assert_eq!(warm.tokens, cold.tokens, "{speculation:?}: resumed = cold");
    }
}

/// A turn is admitted once: its image read, its prompt rendered and its memory checked when it
/// is admitted, and it joins with what the admission read: the image's file may be gone by
/// then, and the reply is still mlx-vlm's greedy. Admitting it again reads the file again, and
/// the missing file is named.
#[test]
fn a_turn_is_admitted_once_and_joins_with_what_its_admission_read() {
    let chat = ChatModel::load(&golden_dir("vision"), &engine::LoadOptions::default()).unwrap();
    let golden = vision_golden();
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("photo.png");
    std::fs::copy(image_path("rgb_640x480.png"), &image).unwrap();
    let turn = Turn {
        max_tokens: 8,
        max_soft_tokens: 64,
        ..Turn::new(Prompt::Tokens { ids: ints(&golden["prompt"]), images: vec![image.clone()] })
    };
    let mut batch = TurnBatch::new(&chat);
    let admission = batch.admit(&turn).unwrap();
    assert_eq!(admission.prompt_tokens(), ints(&golden["prompt"]).len());
    assert_eq!(admission.max_tokens(), 8);
    std::fs::remove_file(&image).unwrap();
    let mut drafters = Drafters::new(engine::LoadOptions::default());
    let mut outcome =
        match batch.join(0, &turn, admission, &mut drafters, |_| Flow::Continue).unwrap() {
            Joined::Ended(outcome) => Some(*outcome),
            Joined::Decoding => None,
            other => panic!("no memory limit was set: {other:?}"),
        };
    while outcome.is_none() {
        outcome = batch.step().unwrap().pop().map(|(_, o)| o.unwrap());
    }
    let tokens = outcome.unwrap().tokens;
    assert_eq!(tokens, ints(&golden["greedy"])[..8], "the admitted image's reply");
    let again = batch.admit(&turn).unwrap_err().to_string();
    assert!(again.contains("photo.png"), "names the missing image: {again}");
}
