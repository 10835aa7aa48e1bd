//! Continuous batching ([`engine::batch::Batch`]) against the same requests run alone: rows
//! of different lengths join at different steps, decode together, end at their own budgets,
//! and generate what [`generate`] generates for each alone, greedy and sampled at fixed seeds,
//! on the tiny Gemma 4 checkpoints (dense with and without an image, MoE, 4-bit), Gemma 3's
//! and Qwen3.5's (dense, MoE, with a vision tower).

use std::collections::BTreeMap;

use engine::batch::generate;
use engine::batch::{Batch, BatchEvent, Finished, RowId, VerifyHead};
use engine::cache::Cache;
use engine::generate::{Flow, GenerateRequest};
use engine::models::Model;
use engine::sampling::SamplingParams;
use engine::speculative::DraftMethod;
use engine::speculative::lookup::PromptLookup;
use mlx::Array;
use proptest::prelude::*;

use super::gemma4::golden_at;
use super::vision::{ids, prompt_images, tensors};

/// A golden checkpoint's folder, `family/name` under `tests/golden` (`gemma4/dense`).
fn checkpoint(path: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(path)
}

fn load(path: &str) -> Box<dyn Model> {
    engine::registry::load_model(checkpoint(path), &engine::LoadOptions::default()).unwrap()
}

/// Four requests over `prompt`: different lengths, budgets and (when `sampled`) seeds.
fn requests(prompt: &[u32], sampled: bool) -> Vec<GenerateRequest> {
    [(40, 12), (9, 20), (27, 7), (3, 16)]
        .iter()
        .enumerate()
        .map(|(i, &(len, max_tokens))| {
            let len = len.min(prompt.len());
            let mut request =
                GenerateRequest::new(prompt[prompt.len() - len..].to_vec(), max_tokens);
            if sampled {
                request.sampling = SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    seed: 7 + i as u64,
                    ..SamplingParams::default()
                };
            }
            request
        })
        .collect()
}

fn alone(model: &dyn Model, request: &GenerateRequest) -> (Vec<u32>, Vec<Box<dyn Cache>>) {
    let mut caches = model.fresh_caches().unwrap();
    let reply = generate(model, &mut caches, request, |_| Flow::Continue).unwrap();
    (reply.tokens, caches)
}

/// Each row's streamed tokens and its finished record, by id.
type Rows = BTreeMap<RowId, (Vec<u32>, Finished)>;

/// Runs `requests` through one batch, request `i` joining before step `joins[i]` (with
/// `together`, the requests of one step join at once, [`Batch::join_together`]); returns each
/// row's streamed tokens and its finished record, by id, and what each join reported.
fn batched_with(
    model: &dyn Model,
    requests: &[GenerateRequest],
    joins: &[usize],
    together: bool,
) -> (Rows, BTreeMap<RowId, usize>) {
    let mut batch = Batch::new(model);
    let mut streamed: BTreeMap<RowId, Vec<u32>> = BTreeMap::new();
    let mut finished: BTreeMap<RowId, Finished> = BTreeMap::new();
    let mut record = |events: Vec<BatchEvent>, streamed: &mut BTreeMap<RowId, Vec<u32>>| {
        for event in events {
            match event {
                BatchEvent::Token { id, token } => streamed.entry(id).or_default().push(token),
                BatchEvent::Finished(f) => {
                    assert!(finished.insert(f.id, f).is_none(), "a row finishes once");
                }
            }
        }
    };
    let mut most = 1;
    let mut joined = BTreeMap::new();
    for step in 0.. {
        let arriving = requests.iter().enumerate().filter(|(i, _)| joins[*i] == step);
        let arriving: Vec<engine::batch::Arriving> =
            arriving.map(|(i, r)| (i as RowId, model.fresh_caches().unwrap(), r.clone())).collect();
        let ids: Vec<RowId> = arriving.iter().map(|(id, ..)| *id).collect();
        let results = match together {
            true => batch.join_together(arriving),
            false => arriving.into_iter().map(|(id, c, r)| batch.join(id, c, &r)).collect(),
        };
        for (id, events) in ids.into_iter().zip(results) {
            let events = events.unwrap();
            joined.insert(id, events.len());
            record(events, &mut streamed);
        }
        most = most.max(batch.len());
        if batch.is_empty() && step > *joins.iter().max().unwrap() {
            break;
        }
        record(batch.step().unwrap(), &mut streamed);
    }
    assert!(most >= 3, "rows overlapped (at most {most} at once)");
    let rows =
        finished.into_iter().map(|(id, f)| (id, (streamed.remove(&id).unwrap(), f))).collect();
    (rows, joined)
}

/// [`batched_with`], each request joining alone.
fn batched(
    model: &dyn Model,
    requests: &[GenerateRequest],
    joins: &[usize],
) -> BTreeMap<RowId, (Vec<u32>, Finished)> {
    batched_with(model, requests, joins, false).0
}

fn assert_batched_equals_alone(model: &dyn Model, requests: &[GenerateRequest], what: &str) {
    let joins = [0, 2, 3, 5];
    let before = model.decode_graphs().map(|g| g.stats());
    let rows = batched(model, requests, &joins);
    if let (Some(before), Some(after)) = (before, model.decode_graphs().map(|g| g.stats())) {
        // The first row decodes alone for two steps, and the last to end alone after the
        // others left: those steps run compiled, as a reply outside a batch does.
        assert!(after.steps > before.steps, "a lone row's steps ran compiled: {after:?}");
    }
    assert_rows_equal_alone(model, requests, &rows, what);
}

/// Each row generated and streamed what its request generates alone, and left holding bit for
/// bit what the solo run's caches hold.
fn assert_rows_equal_alone(
    model: &dyn Model,
    requests: &[GenerateRequest],
    rows: &BTreeMap<RowId, (Vec<u32>, Finished)>,
    what: &str,
) {
    assert_eq!(rows.len(), requests.len(), "{what}: every row finished");
    for (i, request) in requests.iter().enumerate() {
        let (want, solo_caches) = alone(model, request);
        let (streamed, finished) = &rows[&(i as RowId)];
        assert_eq!(streamed, &want, "{what}: row {i} streamed what it generates alone");
        assert_eq!(finished.generation.tokens, want, "{what}: row {i}");
        assert_eq!(finished.generation.stats.prompt_tokens, request.prompt.len());
        // The row leaves as an ordinary cache holding bit for bit what the solo run's holds
        // (on the CPU: its batched matmuls and reads give each row its own result exactly).
        for (layer, (ours, solo)) in finished.caches.iter().zip(&solo_caches).enumerate() {
            assert_eq!(ours.signature(), solo.signature(), "{what}: row {i} layer {layer}");
            assert_eq!(ours.offset(), solo.offset(), "{what}: row {i} layer {layer}");
            assert!(ours.row_offsets().is_none(), "an extracted row is a single sequence");
            let (a, b) = (ours.state().unwrap(), solo.state().unwrap());
            assert_eq!(a.metadata, b.metadata, "{what}: row {i} layer {layer}");
            assert_eq!(a.tensors.len(), b.tensors.len(), "{what}: row {i} layer {layer}");
            for (name, tensor) in &a.tensors {
                let d = test_support::max_diff(tensor, &b.tensors[name]);
                assert_eq!(d, 0.0, "{what}: row {i} layer {layer} {name}");
            }
        }
    }
}

#[test]
fn batched_greedy_and_seeded_sampling_equal_each_request_alone() {
    for name in ["gemma4/dense", "gemma4/moe", "gemma4/dense_q4", "gemma3/text"] {
        let model = load(name);
        let prompt = golden_at(&checkpoint(name)).prompt;
        for sampled in [false, true] {
            let what = format!("{name}, {}", if sampled { "sampled" } else { "greedy" });
            assert_batched_equals_alone(model.as_ref(), &requests(&prompt, sampled), &what);
        }
    }
}

/// Rows sharing buffers decode through the model's compiled step, a graph per row count
/// (every step of two or more rows compiled, none falling back), across a plain buffer's
/// growth (a 250-token prompt decoding past the 256 slots its rows start with) and sliding
/// windows that wrap (6 and 8 positions): each row generates, greedy and seeded, what it
/// generates alone and leaves holding bit for bit what the solo run holds.
#[test]
fn rows_sharing_buffers_decode_compiled_and_equal_each_alone() {
    for name in ["gemma4/dense", "gemma4/k_eq_v"] {
        let model = load(name);
        let graphs = model.decode_graphs().expect("Gemma 4 has a compiled decode step");
        assert!(graphs.enabled(), "{name}: compiled decode is on by default off CUDA");
        let prompt = golden_at(&checkpoint(name)).prompt;
        let long: Vec<u32> = prompt.iter().copied().cycle().take(250).collect();
        for sampled in [false, true] {
            let mut requests = requests(&prompt, sampled);
            requests[0].prompt = long.clone();
            requests[0].max_tokens = 14;
            let what = format!("{name}, {}", if sampled { "sampled" } else { "greedy" });
            let before = graphs.stats();
            let rows = batched(model.as_ref(), &requests, &[0, 2, 3, 5]);
            let after = graphs.stats();
            assert!(after.batched > before.batched, "{what}: rows ran compiled: {after:?}");
            assert_eq!(after.uncompiled, before.uncompiled, "{what}: none fell back: {after:?}");
            assert_rows_equal_alone(model.as_ref(), &requests, &rows, &what);
        }
    }
}

/// Requests that arrive together prefill as one padded cohort (one batched window over their
/// prompts but the last token, padded on the right) beside a row already decoding: each
/// generates what it generates alone, greedy and seeded, and leaves holding bit for bit what
/// the solo run holds (its first token comes from the next step, which appends its last
/// prompt token with the other rows'). Qwen3.5's gated DeltaNet state pads too; its model
/// with a vision tower keeps rope shifts, which do not: its requests join one by one, each
/// reporting its first token at once.
#[test]
fn requests_that_arrive_together_prefill_as_one_padded_cohort_and_equal_each_alone() {
    for name in [
        "gemma4/dense",
        "gemma4/moe",
        "gemma4/dense_q4",
        "gemma3/text",
        "qwen3_5/dense",
        "qwen3_5/moe",
        "qwen3_5/vision",
    ] {
        let model = load(name);
        let vocab = model.vocab_size() as u32;
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % vocab.min(200)).collect();
        for sampled in [false, true] {
            let what = format!("{name}, {}", if sampled { "sampled" } else { "greedy" });
            let requests = requests(&prompt, sampled);
            // Row 0 decodes alone for a step; rows 1–3 (9, 27 and 3 prompt tokens) arrive
            // together.
            let (rows, joined) = batched_with(model.as_ref(), &requests, &[0, 1, 1, 1], true);
            assert_rows_equal_alone(model.as_ref(), &requests, &rows, &what);
            let padded = name != "qwen3_5/vision";
            for id in 1..4 {
                // A row of the cohort reports nothing when it joins; a row joining alone
                // reports its first token.
                assert_eq!(joined[&id] == 0, padded, "{what}: row {id} joined {}", joined[&id]);
            }
        }
    }
}

/// Qwen3.5's rows: gated DeltaNet state in one batch buffer beside its attention rows, and on
/// the checkpoint with a vision tower each row's rope shift; each row generates what it does
/// alone and leaves holding bit for bit what the solo run holds, and a row with an image
/// generates mlx-vlm's greedy reply among rows without.
#[test]
fn qwen3_5_rows_batch_recurrent_state_and_equal_each_request_alone() {
    for name in ["qwen3_5/dense", "qwen3_5/moe", "qwen3_5/vision"] {
        let model = load(name);
        let vocab = model.vocab_size() as u32;
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % vocab.min(200)).collect();
        for sampled in [false, true] {
            let what = format!("{name}, {}", if sampled { "sampled" } else { "greedy" });
            assert_batched_equals_alone(model.as_ref(), &requests(&prompt, sampled), &what);
        }
    }
    // A row with an image decodes with its positions shifted after it (mlx-vlm's rope delta),
    // among text rows that have none: mlx-vlm's greedy reply.
    let model = load("qwen3_5/vision");
    let golden = super::qwen3_5::vision_golden();
    let tokens = super::qwen3_5::ints(&golden["prompt"]);
    let images = super::qwen3_5::prompt_features(model.as_ref());
    let text: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 200).collect();
    let mut requests = requests(&text, false);
    requests[1] = GenerateRequest { images, ..GenerateRequest::new(tokens, 48) };
    assert_batched_equals_alone(model.as_ref(), &requests, "qwen3_5/vision with an image");
    let rows = batched(model.as_ref(), &requests, &[0, 2, 3, 5]);
    let want = super::qwen3_5::ints(&golden["greedy"]);
    assert_eq!(rows[&1].1.generation.tokens, want, "mlx-vlm's greedy");
}

/// A row whose prompt holds an image prefills alone with its image and then decodes among
/// text rows; what it generates is the reference's greedy reply to that prompt.
#[test]
fn a_row_with_an_image_decodes_among_text_rows() {
    let model = load("gemma4/dense");
    let golden = tensors("vision.safetensors");
    let tokens = ids(&golden["single.ids"]);
    let images: Vec<Array> = prompt_images(model.as_ref(), "single");
    let text = golden_at(&checkpoint("gemma4/dense")).prompt;
    let mut requests = requests(&text, false);
    requests[1] = GenerateRequest { images, ..GenerateRequest::new(tokens, 32) };
    assert_batched_equals_alone(model.as_ref(), &requests, "dense with an image");
    let rows = batched(model.as_ref(), &requests, &[0, 2, 3, 5]);
    assert_eq!(rows[&1].1.generation.tokens, ids(&golden["single.greedy"]), "mlx-vlm's greedy");
}

/// A cancelled row leaves at once with what it generated so far; the others go on and still
/// generate what they generate alone. A row with a duplicate id is refused before its
/// prefill, and the batch is unchanged.
#[test]
fn a_cancelled_row_leaves_at_once_and_bad_joins_change_nothing() {
    let model = load("gemma4/dense");
    let prompt = golden_at(&checkpoint("gemma4/dense")).prompt;
    let requests = requests(&prompt, false);
    let mut batch = Batch::new(model.as_ref());
    for (i, request) in requests.iter().enumerate().take(3) {
        batch.join(i as RowId, model.fresh_caches().unwrap(), request).unwrap();
    }
    // The first step appends each first token and samples the next ahead; the second reads
    // those while it runs.
    batch.step().unwrap();
    batch.step().unwrap();
    assert_eq!(batch.len(), 3);
    let cancelled = batch.cancel(1).unwrap().expect("row 1 is in the batch");
    assert_eq!(cancelled.generation.stop_reason, engine::generate::StopReason::Stopped);
    assert_eq!(cancelled.generation.tokens.len(), 2, "its first token and the one read since");
    assert_eq!(batch.ids(), vec![0, 2], "its row is free before the next step");
    assert!(batch.cancel(1).unwrap().is_none());

    assert!(batch.join(0, model.fresh_caches().unwrap(), &requests[3]).is_err(), "duplicate id");
    assert_eq!(batch.ids(), vec![0, 2]);

    let mut rest: BTreeMap<RowId, Vec<u32>> = BTreeMap::new();
    while !batch.is_empty() {
        for event in batch.step().unwrap() {
            if let BatchEvent::Finished(f) = event {
                rest.insert(f.id, f.generation.tokens);
            }
        }
    }
    for id in [0, 2] {
        assert_eq!(rest[&id], alone(model.as_ref(), &requests[id as usize]).0, "row {id}");
    }
}

/// The trained demo the app ships (`make demo-model` unpacks it into target/demo-model): it
/// goes on with a pattern its prompt repeats, so its rows accept drafts.
fn trained_demo(name: &str) -> Box<dyn Model> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target").join(name);
    assert!(dir.join("model.safetensors").exists(), "run `make demo-model` first");
    engine::registry::load_model(dir, &engine::LoadOptions::default()).unwrap()
}

/// A prompt that repeats itself, so prompt lookup has matches to propose.
fn repeating_prompt() -> Vec<u32> {
    let phrase = [17u32, 230, 45, 301, 9, 77, 412, 5];
    (0..5).flat_map(|i| phrase.iter().map(move |&t| t + i % 2)).collect()
}

/// Rows that draft (two by prompt lookup, one with a draft model on caches of its own) verify
/// their drafts together in a batch that verifies: one window pass a step, each row keeping
/// what its own picks confirm. Greedy and sampled at fixed seeds, joining at different steps
/// beside a row that does not draft, each row generates what it generates alone by plain
/// decoding, and its caches hold its prompt and every token but the last, as plain decoding
/// leaves them.
#[test]
fn drafting_rows_verify_together_and_equal_each_request_alone() {
    use engine::speculative::DraftLength;
    use engine::speculative::draft_model::DraftModel;
    // Each target with its draft model: a quantized copy of itself (many drafts are kept),
    // or for the demo the small model trained beside it.
    for (name, drafter) in [
        ("demo", "demo-drafter"),
        ("gemma4/dense", "gemma4/dense_q4"),
        ("gemma4/moe", "gemma4/moe_q4"),
        ("gemma3/text", "gemma3/text_q4"),
        // The tiny Qwen3.5's 4-bit copy guesses nothing of it: itself, then.
        ("qwen3_5/dense", "qwen3_5/dense"),
    ] {
        let (model, drafter) = match name {
            "demo" => (trained_demo("demo-model"), DraftModel::new(trained_demo(drafter))),
            name => (load(name), DraftModel::new(load(drafter))),
        };
        // The demo's vocabulary makes each of its positions costly on the CPU: greedy only,
        // and shorter replies.
        let samplings: &[bool] = if name == "demo" { &[false] } else { &[false, true] };
        for &sampled in samplings {
            let what = format!("{name}, {}", if sampled { "sampled" } else { "greedy" });
            let mut requests = requests(&repeating_prompt(), sampled);
            for r in &mut requests {
                r.max_tokens += if name == "demo" { 16 } else { 24 };
            }
            let joins = [0, 1, 3, 4];
            let mut batch = Batch::new(model.as_ref());
            let mut rounds = 0;
            let mut streamed: BTreeMap<RowId, Vec<u32>> = BTreeMap::new();
            let mut finished: BTreeMap<RowId, Finished> = BTreeMap::new();
            let mut record = |events: Vec<BatchEvent>| {
                for event in events {
                    match event {
                        BatchEvent::Token { id, token } => {
                            streamed.entry(id).or_default().push(token)
                        }
                        BatchEvent::Finished(f) => assert!(finished.insert(f.id, f).is_none()),
                    }
                }
            };
            for step in 0.. {
                for (i, request) in requests.iter().enumerate() {
                    if joins[i] != step {
                        continue;
                    }
                    let caches = model.fresh_caches().unwrap();
                    // Row 1 drafts with the draft model, row 2 decodes plainly, the others
                    // draft by prompt lookup, looking up every token (sampled, the random
                    // checkpoints rarely continue a match).
                    let method: Box<dyn DraftMethod> = match i {
                        1 => drafter.fork(),
                        _ => Box::new(PromptLookup::waiting_for_every_token()),
                    };
                    let (id, length) = (i as RowId, DraftLength::default());
                    let events = match i {
                        2 => batch.join(id, caches, request),
                        _ => batch.join_drafting(id, caches, request, &[], method, length),
                    };
                    record(events.unwrap());
                }
                if batch.is_empty() && step > 4 {
                    break;
                }
                record(batch.step().unwrap());
                // Where the step's time went: a round picks, a plain step does not, and the
                // parts add up to no more than the whole.
                let t = batch.last_step_times();
                rounds += usize::from(t.round);
                assert_eq!(t.round, t.pick_ms > 0.0, "{what}: {t:?}");
                assert!(!t.round || t.build_ms > 0.0, "{what}: {t:?}");
                let parts = t.read_ms + t.propose_ms + t.build_ms + t.submit_ms + t.pick_ms;
                assert!(parts + t.settle_ms <= t.total_ms, "{what}: {t:?}");
            }
            assert!(rounds > 0, "{what}: rounds ran");
            let (mut proposed, mut accepted) = (0, 0);
            let mut drafted = None;
            for (i, request) in requests.iter().enumerate() {
                let (want, _) = alone(model.as_ref(), request);
                let f = &finished[&(i as RowId)];
                assert_eq!(streamed[&(i as RowId)], want, "{what}: row {i} streamed");
                assert_eq!(f.generation.tokens, want, "{what}: row {i}");
                let held = request.prompt.len() + want.len() - 1;
                for cache in &f.caches {
                    assert_eq!(cache.offset(), held, "{what}: row {i} caches");
                }
                match (i, &f.spec) {
                    (2, spec) => assert!(spec.is_none(), "the plain row drafted nothing"),
                    (1, Some(spec)) => {
                        assert_eq!(spec.method, "draft");
                        assert_eq!(spec.context_computed, request.prompt.len(), "{what}");
                        let method = f.drafter.as_ref().map(|d| d.name());
                        assert_eq!(method, Some("draft"), "{what}: the row's draft model left");
                        drafted = Some(spec.clone());
                    }
                    (_, Some(spec)) => {
                        proposed += spec.proposed;
                        accepted += spec.accepted;
                    }
                    (_, None) => panic!("{what}: row {i} has no draft counts"),
                }
            }
            assert!(proposed > 0, "{what}: drafts were verified");
            // A draft model always proposes; greedy, a quantized copy of the target (or the
            // demo's drafter) guesses much of it (the random checkpoints sample almost
            // uniformly, which no greedy drafter guesses).
            let drafted = drafted.unwrap();
            assert!(drafted.proposed > 0, "{what}: {drafted:?}");
            assert!(sampled || drafted.accepted > 0, "{what}: {drafted:?}");
            // The random checkpoints rarely repeat themselves; the trained demo does.
            if name == "demo" {
                assert!(accepted > 0, "{what}: drafts were kept");
            }
        }
    }
}

/// A prompt-lookup row waits for the token a pipelined step sampled ahead only where the
/// conversation's last n-gram has an earlier match for that token to continue: over text
/// that repeats nothing its steps are built on unread tokens, as a plain row's are (they all
/// waited before), and it still generates what it generates alone; over text that repeats,
/// it waits, drafts and verifies.
#[test]
fn lookup_rows_wait_for_a_token_only_to_continue_a_match() {
    use engine::speculative::DraftLength;
    // A random checkpoint over distinct tokens, and the trained demo quoting a fortune.
    let distinct: Vec<u32> = (0..24).map(|i| 3 + 7 * i).collect();
    let demo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/demo-model");
    let tokenizer = engine::tokenizer::Tokenizer::from_dir(&demo).unwrap().unwrap();
    let fortune = "Adding features does not necessarily increase functionality -- it just \
                   makes the manuals thicker.\n\n";
    let quoting = tokenizer.encode(&format!("{fortune}{fortune}Adding features does"), true);
    for (model, prompt, repeats) in [
        (load("gemma4/dense"), distinct, false),
        (trained_demo("demo-model"), quoting.unwrap(), true),
    ] {
        let request = GenerateRequest::new(prompt.clone(), 12);
        let mut batch = Batch::new(model.as_ref());
        let method = Box::new(PromptLookup::default());
        let mut tokens = Vec::new();
        let mut keep = |events: Vec<BatchEvent>| {
            for event in events {
                if let BatchEvent::Token { token, .. } = event {
                    tokens.push(token);
                }
            }
        };
        keep(
            batch
                .join_drafting(
                    0,
                    model.fresh_caches().unwrap(),
                    &request,
                    &[],
                    method,
                    DraftLength::default(),
                )
                .unwrap(),
        );
        let (mut unread, mut rounds) = (0, 0);
        while !batch.is_empty() {
            keep(batch.step().unwrap());
            let t = batch.last_step_times();
            unread += usize::from(!t.waited && !t.round);
            rounds += usize::from(t.round);
        }
        let (want, _) = alone(model.as_ref(), &request);
        assert_eq!(tokens, want, "repeats: {repeats}");
        match repeats {
            false => assert!(unread > 0, "steps built on unread tokens: {unread}"),
            true => assert!(rounds > 0, "rounds: {rounds}"),
        }
    }
}

/// Rows join whatever the batch's rows do: one that drafts joins rows decoding plainly (the
/// rows move to their own storages while it verifies, and back to shared buffers when it
/// leaves), and rows keeping their keys and values in 4-bit or TurboQuant storage join rows in
/// full precision; each generates what it generates alone and leaves holding bit for bit what
/// the solo run holds; a drafting row joins the batch once it has emptied. A drafter reading a
/// port the target lacks (the assistant on Qwen3.5) is refused before any prefill.
#[test]
fn rows_join_whatever_the_others_draft_with_and_store_their_keys_in() {
    use engine::cache::{KvFormat, KvOptions};
    use engine::speculative::DraftLength;
    let model = load("gemma4/dense");
    let prompt = golden_at(&checkpoint("gemma4/dense")).prompt;
    let requests = requests(&prompt, false);
    let storages = [
        KvOptions::full(),
        KvOptions::full(),
        KvOptions { format: KvFormat::Affine { bits: 4, group_size: 32 }, ..KvOptions::default() },
        KvOptions { format: KvFormat::turbo(3.0).unwrap(), ..KvOptions::default() },
    ];
    let caches = |i: usize| model.new_caches(&model.cache_plan().with_kv(&storages[i]).unwrap());
    let mut batch = Batch::new(model.as_ref());
    let mut streamed: BTreeMap<RowId, Vec<u32>> = BTreeMap::new();
    let mut finished: BTreeMap<RowId, Finished> = BTreeMap::new();
    let mut record = |events: Vec<BatchEvent>| {
        for event in events {
            match event {
                BatchEvent::Token { id, token } => streamed.entry(id).or_default().push(token),
                BatchEvent::Finished(f) => assert!(finished.insert(f.id, f).is_none()),
            }
        }
    };
    // Row 0 decodes plainly; row 1 joins drafting by prompt lookup; rows 2 and 3 join with
    // their keys and values quantized.
    for (i, request) in requests.iter().enumerate() {
        let (id, c) = (i as RowId, caches(i).unwrap());
        let events = match i {
            1 => {
                let lookup = Box::new(PromptLookup::default());
                batch.join_drafting(id, c, request, &[], lookup, DraftLength::default())
            }
            _ => batch.join(id, c, request),
        };
        record(events.unwrap());
        record(batch.step().unwrap());
    }
    while !batch.is_empty() {
        record(batch.step().unwrap());
    }
    // A batch emptied by plain rows takes a drafting row next (its layers made afresh in the
    // layout it needs).
    let mut again = Batch::new(model.as_ref());
    record(again.join(8, caches(0).unwrap(), &requests[3]).unwrap());
    while !again.is_empty() {
        record(again.step().unwrap());
    }
    let lookup = Box::new(PromptLookup::default());
    let length = DraftLength::default();
    record(again.join_drafting(9, caches(0).unwrap(), &requests[0], &[], lookup, length).unwrap());
    while !again.is_empty() {
        record(again.step().unwrap());
    }
    assert_eq!(finished[&9].generation.tokens, finished[&0].generation.tokens, "row 9 = row 0");
    for (i, request) in requests.iter().enumerate() {
        let mut solo = caches(i).unwrap();
        let want = generate(model.as_ref(), &mut solo, request, |_| Flow::Continue).unwrap();
        let f = &finished[&(i as RowId)];
        assert_eq!(streamed[&(i as RowId)], want.tokens, "row {i} streamed");
        assert_eq!(f.generation.tokens, want.tokens, "row {i}");
        for (layer, (ours, theirs)) in f.caches.iter().zip(&solo).enumerate() {
            assert_eq!(ours.signature(), theirs.signature(), "row {i} layer {layer}");
            let (a, b) = (ours.state().unwrap(), theirs.state().unwrap());
            assert_eq!(a.metadata, b.metadata, "row {i} layer {layer}");
            for (name, tensor) in &a.tensors {
                let d = test_support::max_diff(tensor, &b.tensors[name]);
                assert_eq!(d, 0.0, "row {i} layer {layer} {name}");
            }
        }
    }
    let model = load("qwen3_5/dense");
    let mut batch = Batch::new(model.as_ref());
    let request = GenerateRequest::new(repeating_prompt(), 8);
    let caches = model.fresh_caches().unwrap();
    let length = DraftLength::default();
    let err = batch.join_drafting(0, caches, &request, &[], assistant(), length).unwrap_err();
    assert!(err.to_string().contains("does not provide assistantRows"), "{err}");
    assert!(batch.is_empty());
}

/// The Gemma 4 assistant of the tiny assistant pair, loaded as the registry loads drafters.
fn assistant() -> Box<dyn DraftMethod> {
    engine::registry::load_drafter(checkpoint("assistant/assistant"), &Default::default()).unwrap()
}

/// A drafter whose proposals (still made, so it reads the target as it would) are replaced by
/// the reply's own next tokens, right for the first `schedule[round % len]` and wrong after,
/// so that rounds keep the counts the schedule asks.
#[derive(Debug)]
struct Forced {
    inner: Box<dyn DraftMethod>,
    /// The reply plain decoding gives, after `prompt` tokens of context.
    reply: Vec<u32>,
    prompt: usize,
    schedule: Vec<usize>,
    rounds: usize,
}

impl DraftMethod for Forced {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn ports(&self) -> &'static [engine::models::TargetPort] {
        self.inner.ports()
    }
    fn bind(&mut self, target: &dyn Model) -> engine::Result<()> {
        self.inner.bind(target)
    }
    fn start(&mut self, t: engine::models::Target<'_>, context: &[u32]) -> engine::Result<usize> {
        self.inner.start(t, context)
    }
    fn propose(
        &mut self,
        target: engine::models::Target<'_>,
        context: &[u32],
        max: usize,
    ) -> engine::Result<Vec<u32>> {
        let own = self.inner.propose(target, context, max)?;
        let right = self.schedule[self.rounds % self.schedule.len()];
        self.rounds += 1;
        let at = context.len() - self.prompt;
        Ok((0..own.len())
            .map(|j| {
                let want = self.reply.get(at + j).copied().unwrap_or(0);
                if j < right { want } else { want ^ 1 }
            })
            .collect())
    }
    fn settle(
        &mut self,
        target: engine::models::Target<'_>,
        accepted: usize,
    ) -> engine::Result<()> {
        self.inner.settle(target, accepted)
    }
    fn fork(&self) -> Box<dyn DraftMethod> {
        unreachable!("forced drafts are made per row")
    }
}

/// A target, its drafter, how rows 0–3 decode, and whether row 1 holds an image.
type Case = (&'static str, Box<dyn DraftMethod>, [Drafts; 4], bool);

/// How a row of [`every_drafter_and_state_kind_verify_in_one_batch_and_equal_each_alone`]
/// decodes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Drafts {
    Plainly,
    ByLookup,
    /// With the batch's drafter (a draft model, an assistant, an MTP head).
    ByDrafter,
}

/// Rows drafting with every kind of method verify together in one batch that verifies, each
/// with its own draft length and keep count: prompt lookup, a draft model, the Gemma 4
/// assistant (reading its row of the target's donor caches and hidden state), Qwen3.5's MTP
/// head (reading its row's hidden states beside gated DeltaNet state), and a Qwen3.5 row with
/// an image (its rope shifts in rows that take rounds), beside rows decoding plainly and
/// joining at different steps; the assistant's and the MTP head's drafts are forced right or
/// wrong ([`Forced`]) so that every keep count occurs. Greedy and sampled at fixed seeds, each
/// row streams what it streams alone (a batch of one, as `quince generate` runs it) and what
/// plain decoding gives, and leaves holding bit for bit what the solo run's caches hold.
#[test]
fn every_drafter_and_state_kind_verify_in_one_batch_and_equal_each_alone() {
    use engine::speculative::DraftLength;
    use engine::speculative::draft_model::DraftModel;
    let cases: [Case; 3] = [
        (
            "assistant/target",
            assistant(),
            [Drafts::Plainly, Drafts::ByDrafter, Drafts::ByLookup, Drafts::ByDrafter],
            false,
        ),
        (
            "qwen3_5/dense",
            engine::registry::load_drafter(checkpoint("qwen3_5/mtp"), &Default::default()).unwrap(),
            [Drafts::ByDrafter, Drafts::ByLookup, Drafts::Plainly, Drafts::ByDrafter],
            false,
        ),
        (
            "qwen3_5/vision",
            Box::new(DraftModel::new(load("qwen3_5/vision"))),
            [Drafts::ByLookup, Drafts::ByDrafter, Drafts::ByDrafter, Drafts::Plainly],
            true,
        ),
    ];
    for (n, (name, drafter, kinds, image)) in cases.into_iter().enumerate() {
        let model = load(name);
        for sampled in [false, true] {
            // Both ways of reading the head, greedy and sampled, against the solo runs' (a
            // batch of one reads it as the backend favours).
            let head = [VerifyHead::Window, VerifyHead::ByPosition][(n + sampled as usize) % 2];
            let what = format!("{name}, {}", if sampled { "sampled" } else { "greedy" });
            let mut requests = requests(&repeating_prompt(), sampled);
            for r in &mut requests {
                r.max_tokens += 16;
            }
            if image {
                let tokens = super::qwen3_5::ints(&super::qwen3_5::vision_golden()["prompt"]);
                let images = super::qwen3_5::prompt_features(model.as_ref());
                requests[1] = GenerateRequest {
                    images,
                    sampling: requests[1].sampling.clone(),
                    ..GenerateRequest::new(tokens, 24)
                };
            }
            let plain: Vec<Vec<u32>> =
                requests.iter().map(|r| alone(model.as_ref(), r).0).collect();
            let method = |i: usize| -> Option<Box<dyn DraftMethod>> {
                match kinds[i] {
                    Drafts::Plainly => None,
                    Drafts::ByLookup => Some(Box::new(PromptLookup::default())),
                    Drafts::ByDrafter if drafter.ports().is_empty() => Some(drafter.fork()),
                    Drafts::ByDrafter => Some(Box::new(Forced {
                        inner: drafter.fork(),
                        reply: plain[i].clone(),
                        prompt: requests[i].prompt.len(),
                        schedule: vec![2, 0, 1, 3],
                        rounds: 0,
                    })),
                }
            };
            let joins = [0, 1, 3, 4];
            let mut batch = Batch::with_verify_head(model.as_ref(), head);
            let mut streamed: BTreeMap<RowId, Vec<u32>> = BTreeMap::new();
            let mut finished: BTreeMap<RowId, Finished> = BTreeMap::new();
            let mut record = |events: Vec<BatchEvent>| {
                for event in events {
                    match event {
                        BatchEvent::Token { id, token } => {
                            streamed.entry(id).or_default().push(token)
                        }
                        BatchEvent::Finished(f) => assert!(finished.insert(f.id, f).is_none()),
                    }
                }
            };
            let length = |i: usize| DraftLength { max: 2 + i, adaptive: i.is_multiple_of(2) };
            let mut most = 0;
            for step in 0.. {
                for (i, request) in requests.iter().enumerate().filter(|(i, _)| joins[*i] == step) {
                    let (id, caches) = (i as RowId, model.fresh_caches().unwrap());
                    let events = match method(i) {
                        None => batch.join(id, caches, request),
                        Some(m) => batch.join_drafting(id, caches, request, &[], m, length(i)),
                    };
                    record(events.unwrap());
                }
                most = most.max(batch.len());
                if batch.is_empty() && step > 4 {
                    break;
                }
                record(batch.step().unwrap());
            }
            assert!(most >= 3, "{what}: rows overlapped (at most {most} at once)");
            let mut proposed = 0;
            for (i, request) in requests.iter().enumerate() {
                let plain = &plain[i];
                // Alone: a batch of one, with a method of the same kind.
                let mut solo = model.fresh_caches().unwrap();
                let solo_tokens = match method(i) {
                    None => {
                        generate(model.as_ref(), &mut solo, request, |_| Flow::Continue)
                            .unwrap()
                            .tokens
                    }
                    Some(mut m) => {
                        engine::batch::speculate(
                            model.as_ref(),
                            &mut solo,
                            &[],
                            request,
                            m.as_mut(),
                            length(i),
                            |_| Flow::Continue,
                        )
                        .unwrap()
                        .0
                        .tokens
                    }
                };
                let f = &finished[&(i as RowId)];
                assert_eq!(streamed[&(i as RowId)], solo_tokens, "{what}: row {i} streamed");
                assert_eq!(&f.generation.tokens, plain, "{what}: row {i} = plain decoding");
                assert_eq!(&solo_tokens, plain, "{what}: row {i} alone = plain decoding");
                assert_eq!(f.spec.is_some(), kinds[i] != Drafts::Plainly, "{what}: row {i}");
                proposed += f.spec.as_ref().map_or(0, |s| s.proposed);
                if kinds[i] == Drafts::ByDrafter {
                    // Forced drafts keep every count; a greedy draft model of the target keeps
                    // most of a greedy reply.
                    let spec = f.spec.as_ref().unwrap();
                    let forced = !drafter.ports().is_empty();
                    assert!(spec.accepted > 0 || (sampled && !forced), "{what}: row {i} {spec:?}");
                    assert!(!forced || spec.accepted < spec.proposed, "{what}: row {i} {spec:?}");
                }
                for (layer, (ours, theirs)) in f.caches.iter().zip(&solo).enumerate() {
                    assert_eq!(ours.signature(), theirs.signature(), "{what}: row {i} {layer}");
                    let (a, b) = (ours.state().unwrap(), theirs.state().unwrap());
                    assert_eq!(a.metadata, b.metadata, "{what}: row {i} layer {layer}");
                    for (t, tensor) in &a.tensors {
                        let d = test_support::max_diff(tensor, &b.tensors[t]);
                        assert_eq!(d, 0.0, "{what}: row {i} layer {layer} {t}");
                    }
                }
            }
            assert!(proposed > 0, "{what}: drafts were verified");
        }
    }
}

/// Turns that arrive together ([`TurnBatch::join_all`]) and start fresh prefill as one padded
/// cohort and write checkpoints: each gives what it gives alone, the same tokens and
/// checkpoint files with the same bytes; nothing streams before the first step (their first
/// tokens come with it).
#[test]
fn turns_that_arrive_together_prefill_as_a_cohort_and_equal_each_alone() {
    use std::cell::Cell;
    use std::rc::Rc;

    use engine::turn::{ChatModel, Drafters, Joined, Prompt, Turn, TurnBatch};
    let chat =
        ChatModel::load(&checkpoint("gemma4/dense"), &engine::LoadOptions::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let turn = |i: u32, len: u32, max_tokens: usize, name: &str| Turn {
        max_tokens,
        checkpoint_to: Some(tmp.path().join(name)),
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
    let turns: Vec<Turn> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(len, max))| turn(i as u32, len, max, &format!("together{i}.safetensors")))
        .collect();
    let streamed = Rc::new(Cell::new(0));
    let mut batch = TurnBatch::new(&chat);
    let group = turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let streamed = Rc::clone(&streamed);
            let on_event: engine::turn::OnEvent<'_> = Box::new(move |_| {
                streamed.set(streamed.get() + 1);
                Flow::Continue
            });
            (i as u64, t, batch.admit(t).unwrap(), on_event)
        })
        .collect();
    for joined in batch.join_all(group, &mut drafters) {
        assert!(matches!(joined.unwrap(), Joined::Decoding));
    }
    assert_eq!(streamed.get(), 0, "the cohort's first tokens come with the first step");
    assert_eq!(batch.len(), 3);
    let mut together = BTreeMap::new();
    while !batch.is_empty() {
        for (id, outcome) in batch.step().unwrap() {
            together.insert(id, outcome.unwrap());
        }
    }
    for (i, want) in alone.iter().enumerate() {
        let got = &together[&(i as u64)];
        assert_eq!(got.tokens, want.tokens, "turn {i}");
        assert_eq!(got.stats.prompt_tokens, want.stats.prompt_tokens, "turn {i}");
        let (a, b) = (got.checkpoint.as_ref().unwrap(), want.checkpoint.as_ref().unwrap());
        assert_eq!(a.tokens, b.tokens, "turn {i}: the checkpoint's boundary");
        assert_eq!(a.file.sha256, b.file.sha256, "turn {i}: the checkpoint's bytes");
    }
}

/// A row of [`random_joins_leaves_drafts_and_keeps_leave_every_row_as_alone`].
#[derive(Debug, Clone)]
struct RandomRow {
    join: usize,
    prompt: usize,
    max_tokens: usize,
    /// 0: plainly; 1: prompt lookup; 2: the assistant, its drafts forced to `schedule`.
    method: u8,
    draft: DraftLengthArg,
    schedule: Vec<usize>,
    sampled: bool,
    /// Cancelled after this many steps in the batch, if it is still there.
    cancel: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct DraftLengthArg(usize, bool);

fn random_row() -> impl Strategy<Value = RandomRow> {
    (
        0usize..5,
        2usize..30,
        1usize..14,
        0u8..3,
        (1usize..6, any::<bool>()),
        prop::collection::vec(0usize..6, 1..5),
        any::<bool>(),
        prop::option::weighted(0.3, 1usize..8),
    )
        .prop_map(
            |(join, prompt, max_tokens, method, (max, adaptive), schedule, sampled, cancel)| {
                RandomRow {
                    join,
                    prompt,
                    max_tokens,
                    method,
                    draft: DraftLengthArg(max, adaptive),
                    schedule,
                    sampled,
                    cancel,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Rows joining and leaving (ending, or cancelled) at random steps of one batch that
    /// verifies, decoding plainly or drafting (prompt lookup; the assistant, its drafts forced
    /// right or wrong so that each round keeps the count a random schedule asks), with random
    /// draft lengths: every row streams, and leaves holding bit for bit, what it would alone
    /// (a batch of one stopped where the row was), whether rounds read the head over the
    /// whole window or position by position.
    #[test]
    fn random_joins_leaves_drafts_and_keeps_leave_every_row_as_alone(
        rows in prop::collection::vec(random_row(), 2..5),
        by_position in any::<bool>(),
    ) {
        use engine::speculative::DraftLength;
        let model = load("assistant/target");
        let drafter = assistant();
        let text = repeating_prompt();
        let request = |r: &RandomRow, i: usize| {
            let mut request = GenerateRequest::new(text[..r.prompt.min(text.len())].to_vec(), r.max_tokens);
            if r.sampled {
                request.sampling =
                    SamplingParams { temperature: 0.9, seed: 11 + i as u64, ..SamplingParams::default() };
            }
            request
        };
        let plain: Vec<Vec<u32>> = rows.iter().enumerate().map(|(i, r)| alone(model.as_ref(), &request(r, i)).0).collect();
        let method = |r: &RandomRow, i: usize| -> Option<Box<dyn DraftMethod>> {
            match r.method {
                0 => None,
                1 => Some(Box::new(PromptLookup::default())),
                _ => Some(Box::new(Forced {
                    inner: drafter.fork(),
                    reply: plain[i].clone(),
                    prompt: r.prompt.min(text.len()),
                    schedule: r.schedule.clone(),
                    rounds: 0,
                })),
            }
        };
        let length = |r: &RandomRow| DraftLength { max: r.draft.0, adaptive: r.draft.1 };
        let head = if by_position { VerifyHead::ByPosition } else { VerifyHead::Window };
        let mut batch = Batch::with_verify_head(model.as_ref(), head);
        let mut streamed: BTreeMap<RowId, Vec<u32>> = BTreeMap::new();
        let mut finished: BTreeMap<RowId, Finished> = BTreeMap::new();
        let record = |events: Vec<BatchEvent>,
                      streamed: &mut BTreeMap<RowId, Vec<u32>>,
                      finished: &mut BTreeMap<RowId, Finished>| {
            for event in events {
                match event {
                    BatchEvent::Token { id, token } => streamed.entry(id).or_default().push(token),
                    BatchEvent::Finished(f) => assert!(finished.insert(f.id, f).is_none()),
                }
            }
        };
        let mut steps_in: BTreeMap<RowId, usize> = BTreeMap::new();
        let mut cancelled = Vec::new();
        for step in 0.. {
            for (i, r) in rows.iter().enumerate().filter(|(_, r)| r.join == step) {
                let (id, caches) = (i as RowId, model.fresh_caches().unwrap());
                let events = match method(r, i) {
                    None => batch.join(id, caches, &request(r, i)),
                    Some(m) => batch.join_drafting(id, caches, &request(r, i), &[], m, length(r)),
                };
                record(events.unwrap(), &mut streamed, &mut finished);
            }
            if batch.is_empty() && step > 5 {
                break;
            }
            record(batch.step().unwrap(), &mut streamed, &mut finished);
            for id in batch.ids() {
                let steps = steps_in.entry(id).or_default();
                *steps += 1;
                if rows[id as usize].cancel == Some(*steps) {
                    let f = batch.cancel(id).unwrap().unwrap();
                    cancelled.push(id);
                    assert!(finished.insert(id, f).is_none());
                }
            }
        }
        for (i, r) in rows.iter().enumerate() {
            let id = i as RowId;
            let mut f = finished.remove(&id).unwrap();
            let got = &streamed[&id];
            prop_assert_eq!(&f.generation.tokens, got, "row {} streamed what it generated", i);
            // Alone, stopped where the row was.
            let stop_at = if cancelled.contains(&id) { got.len() } else { usize::MAX };
            let mut seen = 0;
            let on_token = |_| {
                seen += 1;
                if seen >= stop_at { Flow::Stop } else { Flow::Continue }
            };
            let mut solo = model.fresh_caches().unwrap();
            let solo_tokens = match method(r, i) {
                None => generate(model.as_ref(), &mut solo, &request(r, i), on_token).unwrap().tokens,
                Some(mut m) => {
                    engine::batch::speculate(model.as_ref(), &mut solo, &[], &request(r, i), m.as_mut(), length(r), on_token)
                        .unwrap()
                        .0
                        .tokens
                }
            };
            prop_assert_eq!(got, &solo_tokens, "row {} tokens", i);
            prop_assert_eq!(&plain[i][..got.len()], &got[..], "row {} = plain decoding", i);
            for (layer, (ours, theirs)) in f.caches.iter_mut().zip(solo.iter_mut()).enumerate() {
                // A row stopped by its caller holds its last token when a pass had appended it
                // before it was read (a pipelined step), alone as in a batch; which step read
                // it may differ. What both hold is the same.
                if cancelled.contains(&id) {
                    let (a, b) = (ours.offset(), theirs.offset());
                    prop_assert!(a.abs_diff(b) <= 1, "row {} layer {}: {} and {}", i, layer, a, b);
                    if a > b { ours.trim(1).unwrap(); }
                    if b > a { theirs.trim(1).unwrap(); }
                }
                let (a, b) = (ours.state().unwrap(), theirs.state().unwrap());
                prop_assert_eq!(&a.metadata, &b.metadata, "row {} layer {}", i, layer);
                for (t, tensor) in &a.tensors {
                    prop_assert_eq!(test_support::max_diff(tensor, &b.tensors[t]), 0.0, "row {} layer {} {}", i, layer, t);
                }
            }
        }
    }
}
