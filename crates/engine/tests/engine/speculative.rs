//! Speculative decoding gives exactly the tokens plain decoding gives (greedy, and sampled at
//! the same seed), for every draft method, on the tiny `dense` checkpoint whose sliding window
//! (6) is far shorter than the output, with and without an image in the prompt.

use std::path::PathBuf;

use engine::batch::generate;
use engine::cache::{KvFormat, KvLayers, KvOptions};
use engine::generate::{Flow, GenerateRequest, Generation, StopReason};
use engine::models::gemma4::Gemma4Assistant;
use engine::models::gemma4::processor::preprocess;
use engine::models::{Model, TargetPort};
use engine::sampling::SamplingParams;
use engine::speculative::draft_model::DraftModel;
use engine::speculative::lookup::PromptLookup;
use engine::speculative::{DraftLength, DraftMethod, SpecStats, Target};
use engine::vision::image::load_rgb;
use mlx::{Array, Dtype};

fn golden(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(path)
}

fn load(name: &str) -> Box<dyn Model> {
    engine::registry::load_model(golden(&format!("gemma4/{name}")), &engine::LoadOptions::default())
        .unwrap()
}

/// A draft model whose state is kept with checkpoints.
fn draft_model(dir: &std::path::Path) -> DraftModel {
    DraftModel::from_folder(test_support::load(dir), dir).unwrap()
}

fn plain(model: &dyn Model, request: &GenerateRequest) -> Generation {
    plain_with(model, request, &KvOptions::full())
}

/// Caches for `model` under a KV choice.
fn caches_with(model: &dyn Model, kv: &KvOptions) -> Vec<Box<dyn engine::cache::Cache>> {
    model.new_caches(&model.cache_plan().with_kv(kv).unwrap()).unwrap()
}

fn plain_with(model: &dyn Model, request: &GenerateRequest, kv: &KvOptions) -> Generation {
    let mut caches = caches_with(model, kv);
    generate(model, &mut caches, request, |_| Flow::Continue).unwrap()
}

/// A speculative generation's tokens, stop reason and counts.
#[derive(Debug)]
struct Speculated {
    tokens: Vec<u32>,
    stop_reason: StopReason,
    spec: Option<SpecStats>,
}

impl From<(Generation, SpecStats)> for Speculated {
    fn from((generation, spec): (Generation, SpecStats)) -> Speculated {
        Speculated {
            tokens: generation.tokens,
            stop_reason: generation.stop_reason,
            spec: Some(spec),
        }
    }
}

fn speculative(
    model: &dyn Model,
    request: &GenerateRequest,
    method: &mut dyn DraftMethod,
    length: DraftLength,
) -> (Speculated, usize) {
    speculative_with(model, request, method, length, &KvOptions::full())
}

fn speculative_with(
    model: &dyn Model,
    request: &GenerateRequest,
    method: &mut dyn DraftMethod,
    length: DraftLength,
    kv: &KvOptions,
) -> (Speculated, usize) {
    let mut caches = caches_with(model, kv);
    let reply = engine::batch::speculate(model, &mut caches, &[], request, method, length, |_| {
        Flow::Continue
    })
    .unwrap();
    (reply.into(), caches[0].offset())
}

/// A prompt that repeats itself, so prompt lookup has matches to propose.
fn text_prompt() -> Vec<u32> {
    let phrase = [17u32, 230, 45, 301, 9, 77, 412, 5];
    (0..5).flat_map(|i| phrase.iter().map(move |&t| t + i % 2)).collect()
}

fn image_request(model: &dyn Model, max_tokens: usize) -> GenerateRequest {
    let golden_ids = mlx::io::load_safetensors(golden("vision/vision.safetensors"))
        .unwrap()
        .tensors["single.ids"]
        .astype(Dtype::Int32)
        .unwrap()
        .to_vec::<i32>()
        .unwrap();
    let tokens: Vec<u32> = golden_ids.into_iter().map(|t| t as u32).collect();
    let rgb = load_rgb(&golden("vision/images/rgb_640x480.png")).unwrap();
    let vision = model.vision().unwrap();
    let image: Array = vision.encode(&preprocess(&rgb, 70).unwrap().pixels).unwrap();
    GenerateRequest { images: vec![image], ..GenerateRequest::new(tokens, max_tokens) }
}

fn methods() -> Vec<(&'static str, Box<dyn DraftMethod>)> {
    vec![
        ("lookup", Box::new(PromptLookup::default())),
        // The same weights in 8 bits: a draft that agrees often, not always.
        ("draft q8", Box::new(DraftModel::new(load("dense_q8")))),
        // Another model with the same vocabulary: a draft that is mostly wrong.
        ("draft k_eq_v", Box::new(DraftModel::new(load("k_eq_v")))),
        // The assistant, reading this target's keys, values and hidden state.
        ("assistant", Box::new(assistant())),
    ]
}

#[test]
fn greedy_output_is_plain_output_for_every_method() {
    let model = load("dense");
    let text = GenerateRequest::new(text_prompt(), 128);
    let image = image_request(model.as_ref(), 128);
    for (what, request) in [("text", &text), ("image", &image)] {
        let want = plain(model.as_ref(), request);
        for (name, mut method) in methods() {
            for length in
                [DraftLength { max: 4, adaptive: true }, DraftLength { max: 3, adaptive: false }]
            {
                let (got, offset) = speculative(model.as_ref(), request, method.as_mut(), length);
                assert_eq!(got.tokens, want.tokens, "{what}, {name}, {length:?}");
                assert_eq!(got.stop_reason, want.stop_reason, "{what}, {name}, {length:?}");
                let spec = got.spec.clone().unwrap();
                assert!(spec.proposed > 0 && spec.rounds > 0, "{what}, {name}: nothing verified");
                // The caches hold the prompt and every token but the last, as after plain decoding.
                assert_eq!(offset, request.prompt.len() + got.tokens.len() - 1, "{what}, {name}");
            }
        }
    }
}

/// On encoded KV storage (every layer, the KV-shared ones reading a quantized donor), each
/// method still returns plain greedy's tokens on the same storage, a conversion reached in the
/// middle of the reply included (rounds stop at it), and with an image in the prompt (its
/// block appended bidirectionally into 4-bit storage).
#[test]
fn greedy_output_is_plain_output_on_quantized_kv() {
    let model = load("dense");
    let four = KvOptions {
        format: KvFormat::Affine { bits: 4, group_size: 32 },
        quantized_start: 0,
        layers: KvLayers::All,
    };
    let image = image_request(model.as_ref(), 48);
    let want = plain_with(model.as_ref(), &image, &four);
    assert_ne!(want.tokens, plain(model.as_ref(), &image).tokens);
    for (name, mut method) in methods() {
        let length = DraftLength { max: 4, adaptive: true };
        let (got, _) = speculative_with(model.as_ref(), &image, method.as_mut(), length, &four);
        assert_eq!(got.tokens, want.tokens, "image on 4-bit KV, {name}");
    }
    let request = GenerateRequest::new(text_prompt(), 64);
    let formats = [
        (KvFormat::Affine { bits: 4, group_size: 32 }, 0),
        (KvFormat::turbo(3.0).unwrap(), 0),
        (KvFormat::Affine { bits: 8, group_size: 32 }, request.prompt.len() + 13),
        (KvFormat::turbo(3.5).unwrap(), request.prompt.len() + 7),
    ];
    for (format, start) in formats {
        let kv = KvOptions { format, quantized_start: start, layers: KvLayers::All };
        let want = plain_with(model.as_ref(), &request, &kv);
        assert_ne!(
            want.tokens,
            plain(model.as_ref(), &request).tokens,
            "{format:?}: the storage changes this random model's greedy"
        );
        for (name, mut method) in methods() {
            let length = DraftLength { max: 4, adaptive: true };
            let (got, offset) =
                speculative_with(model.as_ref(), &request, method.as_mut(), length, &kv);
            assert_eq!(got.tokens, want.tokens, "{format:?} from {start}, {name}");
            assert!(got.spec.unwrap().rounds > 0, "{format:?}, {name}: nothing verified");
            assert_eq!(offset, request.prompt.len() + got.tokens.len() - 1);
        }
    }
}

#[test]
fn a_draft_equal_to_the_target_is_always_accepted() {
    let model = load("dense");
    let request = GenerateRequest::new(text_prompt(), 64);
    let want = plain(model.as_ref(), &request);
    let mut method = DraftModel::new(load("dense"));
    let (got, _) =
        speculative(model.as_ref(), &request, &mut method, DraftLength { max: 4, adaptive: false });
    assert_eq!(got.tokens, want.tokens);
    let spec = got.spec.unwrap();
    assert_eq!(spec.accepted, spec.proposed, "{spec:?}");
    // 1 bonus + rounds of 4 drafts and the target's own token: 63 tokens in 13 rounds (the
    // last one drafts only what the budget leaves).
    assert_eq!(spec.rounds, 13, "{spec:?}");
    assert!((spec.acceptance_rate() - 1.0).abs() < 1e-12);
}

#[test]
fn sampled_output_is_plain_sampled_output_at_the_same_seed() {
    let model = load("dense");
    let sampling = SamplingParams { temperature: 0.8, seed: 1234, ..SamplingParams::default() };
    let text =
        GenerateRequest { sampling: sampling.clone(), ..GenerateRequest::new(text_prompt(), 128) };
    let image = GenerateRequest { sampling, ..image_request(model.as_ref(), 128) };
    for (what, request) in [("text", &text), ("image", &image)] {
        let want = plain(model.as_ref(), request);
        let other_seed = GenerateRequest {
            sampling: SamplingParams { seed: 99, ..request.sampling.clone() },
            ..request.clone()
        };
        assert_ne!(plain(model.as_ref(), &other_seed).tokens, want.tokens, "the seed matters");
        for (name, mut method) in methods() {
            let (got, _) =
                speculative(model.as_ref(), request, method.as_mut(), DraftLength::default());
            assert_eq!(got.tokens, want.tokens, "{what}, {name}");
        }
    }
}

#[test]
fn stops_and_budgets_end_a_round_where_plain_decoding_ends() {
    let model = load("dense");
    let want = plain(model.as_ref(), &GenerateRequest::new(text_prompt(), 40));
    // A stop token in the middle of an accepted run, and a budget that ends mid-round.
    let stop = want.tokens[17];
    let first_stop = want.tokens.iter().position(|&t| t == stop).unwrap();
    for max_tokens in [1, 2, 7, 40] {
        let request = GenerateRequest {
            stop_tokens: vec![stop],
            ..GenerateRequest::new(text_prompt(), max_tokens)
        };
        let mut method = DraftModel::new(load("dense"));
        let (got, offset) =
            speculative(model.as_ref(), &request, &mut method, DraftLength::default());
        let n = (first_stop + 1).min(max_tokens);
        assert_eq!(got.tokens, want.tokens[..n], "max {max_tokens}");
        assert_eq!(offset, request.prompt.len() + n - 1);
    }
    // The callback's stop, as a user's Stop button.
    let request = GenerateRequest::new(text_prompt(), 40);
    let mut caches = model.fresh_caches().unwrap();
    let mut seen = 0;
    let got = engine::batch::speculate(
        model.as_ref(),
        &mut caches,
        &[],
        &request,
        &mut DraftModel::new(load("dense")),
        DraftLength::default(),
        |_| {
            seen += 1;
            if seen == 10 { Flow::Stop } else { Flow::Continue }
        },
    )
    .map(Speculated::from)
    .unwrap();
    assert_eq!(got.tokens, want.tokens[..10]);
    assert_eq!(caches[0].offset(), request.prompt.len() + 9);
}

/// A draft model with another vocabulary: only its vocabulary is ever asked for.
#[derive(Debug)]
struct OtherVocabulary;

impl Model for OtherVocabulary {
    fn ops(&self) -> &engine::backend::Ops {
        panic!("a refused draft model ran");
    }
    fn cache_plan(&self) -> engine::cache::CachePlan {
        panic!("caches planned for a refused draft model");
    }
    fn new_caches(
        &self,
        _: &engine::cache::CachePlan,
    ) -> engine::Result<Vec<Box<dyn engine::cache::Cache>>> {
        panic!("caches made for a refused draft model");
    }
    fn forward_rows(
        &self,
        _: &Array,
        _: &mut [Box<dyn engine::cache::Cache>],
        _: engine::models::Phase,
        _: engine::models::Rows,
    ) -> engine::Result<Array> {
        panic!("a refused draft model ran");
    }
    fn logits(&self, _: &Array) -> engine::Result<Array> {
        panic!("a refused draft model ran");
    }
    fn vocab_size(&self) -> usize {
        262_144
    }
    fn max_context(&self) -> usize {
        1024
    }
    fn eos_token_ids(&self) -> Vec<u32> {
        Vec::new()
    }
}

/// A method reading a port no model provides yet.
#[derive(Debug)]
struct NeedsHiddenLayerTaps;

impl DraftMethod for NeedsHiddenLayerTaps {
    fn name(&self) -> &'static str {
        "needs-hidden-layer-taps"
    }
    fn ports(&self) -> &'static [TargetPort] {
        &[TargetPort::HiddenLayerTaps]
    }
    fn bind(&mut self, _: &dyn Model) -> engine::Result<()> {
        panic!("bound to a target that lacks its port");
    }
    fn start(&mut self, _: Target<'_>, _: &[u32]) -> engine::Result<usize> {
        panic!("started on a target that lacks its port");
    }
    fn propose(&mut self, _: Target<'_>, _: &[u32], _: usize) -> engine::Result<Vec<u32>> {
        unreachable!()
    }
    fn settle(&mut self, _: Target<'_>, _: usize) -> engine::Result<()> {
        unreachable!()
    }
    fn fork(&self) -> Box<dyn DraftMethod> {
        unreachable!()
    }
}

#[test]
fn a_target_without_a_port_or_with_another_vocabulary_is_refused_up_front() {
    let model = load("dense");
    let request = GenerateRequest::new(text_prompt(), 8);
    // The refusal's message; the target's caches stay untouched.
    let refusal = |target: &dyn Model, method: &mut dyn DraftMethod| -> String {
        let mut caches =
            if target.vocab_size() == 512 { model.fresh_caches().unwrap() } else { Vec::new() };
        let err = engine::batch::speculate(
            target,
            &mut caches,
            &[],
            &request,
            method,
            DraftLength::default(),
            |_| Flow::Continue,
        )
        .unwrap_err();
        assert!(caches.iter().all(|c| c.offset() == 0), "nothing ran");
        err.to_string()
    };
    let err = refusal(model.as_ref(), &mut NeedsHiddenLayerTaps);
    assert!(err.contains("does not provide hiddenLayerTaps"), "{err}");
    let err = refusal(model.as_ref(), &mut DraftModel::new(Box::new(OtherVocabulary)));
    assert!(err.contains("vocabulary"), "{err}");
    // The assistant reads a port this model does not provide.
    let err = refusal(&OtherVocabulary, &mut assistant());
    assert!(err.contains("does not provide assistantRows"), "{err}");
}

/// The Gemma 4 assistant, recording what it proposes; optionally replacing its drafts with
/// `schedule[round % len]` right ones (the golden greedy tokens) and wrong ones after, as the
/// golden's oracle run does, so that rounds accept 0–3 drafts.
#[derive(Debug)]
struct Recorded {
    inner: Gemma4Assistant,
    proposals: Vec<Vec<u32>>,
    oracle: Option<(Vec<usize>, Vec<u32>, usize)>, // schedule, greedy continuation, prompt length
}

impl DraftMethod for Recorded {
    fn name(&self) -> &'static str {
        "assistant"
    }
    fn ports(&self) -> &'static [TargetPort] {
        self.inner.ports()
    }
    fn bind(&mut self, target: &dyn Model) -> engine::Result<()> {
        self.inner.bind(target)
    }
    fn start(&mut self, target: Target<'_>, context: &[u32]) -> engine::Result<usize> {
        self.inner.start(target, context)
    }
    fn propose(
        &mut self,
        target: Target<'_>,
        context: &[u32],
        max: usize,
    ) -> engine::Result<Vec<u32>> {
        let drafts = self.inner.propose(target, context, max)?;
        let round = self.proposals.len();
        self.proposals.push(drafts.clone());
        Ok(match &self.oracle {
            None => drafts,
            Some((schedule, greedy, prompt)) => {
                let emitted = context.len() - prompt;
                let right = schedule[round % schedule.len()];
                (0..drafts.len())
                    .map(|j| {
                        let want = greedy[emitted + j];
                        if j < right { want } else { (want + 1) % 512 }
                    })
                    .collect()
            }
        })
    }
    fn settle(&mut self, target: Target<'_>, accepted: usize) -> engine::Result<()> {
        self.inner.settle(target, accepted)
    }
    fn fork(&self) -> Box<dyn DraftMethod> {
        unreachable!("a recording drafts for one generation")
    }
}

fn assistant() -> Gemma4Assistant {
    let dir = engine::checkpoint::ModelDir::open(golden("assistant/assistant")).unwrap();
    Gemma4Assistant::from_dir(&dir, &engine::LoadOptions::default()).unwrap()
}

fn int_rows(value: &serde_json::Value) -> Vec<Vec<u32>> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_i64().unwrap())
                .filter(|&t| t >= 0)
                .map(|t| t as u32)
                .collect()
        })
        .collect()
}

fn ints(value: &serde_json::Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn the_assistant_drafts_what_mlx_vlm_drafts_every_round() {
    let golden_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden("assistant/golden.json")).unwrap())
            .unwrap();
    let target =
        engine::registry::load_model(golden("assistant/target"), &engine::LoadOptions::default())
            .unwrap();
    let prompt = ints(&golden_json["prompt"]);
    let greedy = ints(&golden_json["greedy"]);
    let request = GenerateRequest::new(prompt.clone(), greedy.len());
    assert_eq!(plain(target.as_ref(), &request).tokens, greedy, "the target is mlx-vlm's");
    for (oracle, drafts_key, accepted_key) in [
        (false, "round_drafts", "round_accepted"),
        (true, "oracle_round_drafter_drafts", "oracle_round_accepted"),
    ] {
        let want_drafts = int_rows(&golden_json[drafts_key]);
        let want_accepted = ints(&golden_json[accepted_key]);
        let mut method = Recorded {
            inner: assistant(),
            proposals: Vec::new(),
            oracle: oracle.then(|| {
                let schedule =
                    ints(&golden_json["oracle_schedule"]).into_iter().map(|n| n as usize).collect();
                (schedule, greedy.clone(), prompt.len())
            }),
        };
        let (got, _) = speculative(
            target.as_ref(),
            &request,
            &mut method,
            DraftLength { max: 3, adaptive: false },
        );
        assert_eq!(got.tokens, greedy, "oracle {oracle}");
        let spec = got.spec.unwrap();
        // mlx-vlm drafts one token past what the budget can emit in its last rounds; every
        // round before is the same round.
        let rounds = method.proposals.len();
        assert!(
            rounds + 2 >= want_drafts.len() && rounds <= want_drafts.len(),
            "{rounds} rounds, mlx-vlm {}",
            want_drafts.len()
        );
        for (i, (ours, theirs)) in method.proposals.iter().zip(&want_drafts).enumerate() {
            assert!(
                !ours.is_empty() && theirs.starts_with(ours),
                "oracle {oracle}, round {i}: {ours:?} vs mlx-vlm {theirs:?}"
            );
        }
        if oracle {
            // Each round accepts what the schedule makes right, within what was drafted: the
            // rounds mlx-vlm ran with the same drafts accepted the same.
            let schedule = ints(&golden_json["oracle_schedule"]);
            let mut expected = 0;
            for (i, proposal) in method.proposals.iter().enumerate() {
                let accepted = (schedule[i % schedule.len()] as usize).min(proposal.len());
                if proposal.len() == want_drafts[i].len() {
                    assert_eq!(accepted, want_accepted[i] as usize, "round {i}");
                }
                expected += accepted;
            }
            assert_eq!(spec.accepted, expected, "{spec:?}");
        } else {
            assert_eq!(spec.accepted, 0, "random weights: the drafts never match");
        }
    }
}

/// Drafts that are always wrong.
#[derive(Debug)]
struct AlwaysWrong;

impl DraftMethod for AlwaysWrong {
    fn name(&self) -> &'static str {
        "always-wrong"
    }
    fn bind(&mut self, _: &dyn Model) -> engine::Result<()> {
        Ok(())
    }
    fn start(&mut self, _: Target<'_>, _: &[u32]) -> engine::Result<usize> {
        Ok(0)
    }
    fn propose(&mut self, _: Target<'_>, _: &[u32], max: usize) -> engine::Result<Vec<u32>> {
        // Token 0 (padding) is never a pick of this model.
        Ok(vec![0; max])
    }
    fn settle(&mut self, _: Target<'_>, _: usize) -> engine::Result<()> {
        Ok(())
    }
    fn fork(&self) -> Box<dyn DraftMethod> {
        Box::new(AlwaysWrong)
    }
}

#[test]
fn failing_drafts_back_off_to_plain_decoding_and_stop_where_it_stops() {
    let model = load("dense");
    let sampled = SamplingParams { temperature: 0.8, seed: 5, ..SamplingParams::default() };
    for sampling in [SamplingParams::default(), sampled] {
        let request = GenerateRequest { sampling, ..GenerateRequest::new(text_prompt(), 100) };
        let want = plain(model.as_ref(), &request);
        let (got, offset) =
            speculative(model.as_ref(), &request, &mut AlwaysWrong, DraftLength::default());
        assert_eq!(got.tokens, want.tokens);
        assert_eq!(offset, request.prompt.len() + 99);
        let spec = got.spec.unwrap();
        assert_eq!(spec.accepted, 0);
        // Four drafts, then two, then one; then rounds of one draft between plain runs of
        // 2, 4, 8, 16, 32, 64 tokens: far fewer rounds than tokens.
        assert!(spec.rounds < 15, "{spec:?}");
        // Stopped by the callback in the middle of a plain run: the caches end where plain
        // decoding's would.
        for stop_at in [7, 30, 61] {
            let mut caches = model.fresh_caches().unwrap();
            let mut seen = 0;
            let got = engine::batch::speculate(
                model.as_ref(),
                &mut caches,
                &[],
                &request,
                &mut AlwaysWrong,
                DraftLength::default(),
                |_| {
                    seen += 1;
                    if seen == stop_at { Flow::Stop } else { Flow::Continue }
                },
            )
            .map(Speculated::from)
            .unwrap();
            assert_eq!(got.tokens, want.tokens[..stop_at]);
            let held = caches[0].offset();
            // Plain decoding builds the step after a token before reading it, so a stop may
            // leave that token appended too; never more.
            let base = request.prompt.len() + stop_at - 1;
            assert!(held == base || held == base + 1, "stop at {stop_at}: {held}");
        }
    }
}

#[test]
fn a_draft_model_computes_only_what_its_caches_lack_across_turns_and_restarts() {
    use engine::kv_file::{self, Identity};
    let model = load("dense");
    let draft_dir = golden("gemma4/dense_q8");
    let length = DraftLength::default();
    let run = |draft: &mut DraftModel, caches: &mut Vec<_>, earlier: &[u32], prompt: Vec<u32>| {
        let request = GenerateRequest::new(prompt, 24);
        engine::batch::speculate(model.as_ref(), caches, earlier, &request, draft, length, |_| {
            Flow::Continue
        })
        .map(Speculated::from)
        .unwrap()
    };
    // Turn 1: the draft model computes the whole prompt.
    let mut draft = draft_model(&draft_dir);
    let mut caches = model.fresh_caches().unwrap();
    let first = run(&mut draft, &mut caches, &[], text_prompt());
    assert_eq!(first.spec.as_ref().unwrap().context_computed, text_prompt().len());
    // Turn 2 continues the conversation on the same caches: the draft model computes only
    // what it has not seen (the new tokens, and the last round's tokens it never appended).
    let mut earlier = text_prompt();
    earlier.extend_from_slice(&first.tokens[..first.tokens.len() - 1]);
    let mut second_prompt = vec![*first.tokens.last().unwrap()];
    second_prompt.extend([88u32, 19, 230, 45, 301, 9]);
    let second = run(&mut draft, &mut caches, &earlier, second_prompt.clone());
    let computed = second.spec.as_ref().unwrap().context_computed;
    assert!(
        computed >= second_prompt.len() && computed <= second_prompt.len() + length.max + 1,
        "turn 2 computed {computed} of {} tokens",
        earlier.len() + second_prompt.len()
    );
    let mut conversation = earlier.clone();
    conversation.extend_from_slice(&second_prompt);
    let whole = plain(model.as_ref(), &GenerateRequest::new(conversation.clone(), 24));
    assert_eq!(second.tokens, whole.tokens, "the continued turn is the plain reply");

    // The draft's caches go into the target's checkpoint file and come back in a new process
    // (a fresh DraftModel): turn 3 computes only what the attachment does not hold.
    conversation.extend_from_slice(&second.tokens[..second.tokens.len() - 1]);
    let attachment = draft.checkpoint(&conversation).unwrap().expect("a draft attachment");
    assert_eq!(attachment.schema, engine::speculative::draft_model::SCHEMA);
    let count: usize = attachment.metadata["token_count"].parse().unwrap();
    assert!(count > conversation.len() - length.max - 2 && count <= conversation.len());
    let identity = Identity { model_id: "dense".into(), config_hash: "test".into() };
    let dir = tempfile::tempdir().unwrap();
    let written = kv_file::write(
        &dir.path().join("turn2.safetensors"),
        &caches,
        &conversation,
        &identity,
        std::slice::from_ref(&attachment),
    )
    .unwrap();
    assert_eq!(written.attachments.len(), 1);
    assert!(written.attachments[0].tensors.iter().all(|n| n.starts_with("attachment.")));
    let mut restored = model.fresh_caches().unwrap();
    let contents = kv_file::read(&written.path, &written.sha256, &identity, &mut restored).unwrap();
    assert_eq!(contents.tokens, conversation);
    let [read_back] = &contents.attachments[..] else { panic!("{:?}", contents.attachments) };
    assert_eq!(read_back.metadata, attachment.metadata);
    for (name, array) in &attachment.tensors {
        let same =
            read_back.tensors[name].array_equal(array, false).unwrap().item::<bool>().unwrap();
        assert!(same, "attachment tensor {name} changed on disk");
    }
    let third_prompt = vec![*second.tokens.last().unwrap(), 412, 5, 17, 230];
    let mut whole_third = conversation.clone();
    whole_third.extend_from_slice(&third_prompt);
    let want = plain(model.as_ref(), &GenerateRequest::new(whole_third.clone(), 24));
    let mut fresh = draft_model(&draft_dir);
    fresh.resume(&contents.attachments, &contents.tokens).unwrap();
    assert_eq!(fresh.held().len(), count);
    let third = run(&mut fresh, &mut restored, &conversation, third_prompt.clone());
    assert_eq!(third.tokens, want.tokens, "the resumed turn is the plain reply");
    assert_eq!(third.spec.as_ref().unwrap().context_computed, whole_third.len() - count);

    // Another draft model's attachment is ignored: it computes everything.
    let mut other = draft_model(&golden("gemma4/k_eq_v"));
    other.resume(&contents.attachments, &contents.tokens).unwrap();
    assert!(other.held().is_empty());
    let mut restored = model.fresh_caches().unwrap();
    kv_file::read(&written.path, &written.sha256, &identity, &mut restored).unwrap();
    let again = run(&mut other, &mut restored, &conversation, third_prompt);
    assert_eq!(again.tokens, want.tokens);
    assert_eq!(again.spec.unwrap().context_computed, whole_third.len());
}
