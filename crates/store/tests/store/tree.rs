//! Schema, the message tree and branches, cascades, search, concurrent writers.

use store::{Error, MessageState, Role, Store, Table};

use crate::fresh;

#[tokio::test]
async fn migrations_build_the_schema_from_empty_and_reopening_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let store = fresh(&dir).await;
    store.check_integrity().await.unwrap();
    for table in [Table::Conversations, Table::Messages, Table::Attachments] {
        assert_eq!(store.count(table).await.unwrap(), 0);
    }
    let chat = store.create_conversation("kept", None).await.unwrap();
    store.close().await;
    // Opening again applies nothing new and keeps the data.
    let store = Store::open(dir.path().join("quince.db")).await.unwrap();
    assert_eq!(store.conversation(chat.id).await.unwrap().title, "kept");
}

#[tokio::test]
async fn messages_form_a_tree_with_branches() {
    let dir = tempfile::tempdir().unwrap();
    let store = fresh(&dir).await;
    let chat = store.create_conversation("tree", Some("demo")).await.unwrap();
    let q1 = store
        .append_message(chat.id, None, Role::User, "2+2?", MessageState::Complete)
        .await
        .unwrap();
    let a1 = store
        .append_message(chat.id, Some(q1.id), Role::Assistant, "4", MessageState::Complete)
        .await
        .unwrap();
    let q2 = store
        .append_message(chat.id, Some(a1.id), Role::User, "and 3+3?", MessageState::Complete)
        .await
        .unwrap();
    // Regenerate the first answer: a sibling of a1.
    let a1b = store
        .append_message(chat.id, Some(q1.id), Role::Assistant, "four", MessageState::Complete)
        .await
        .unwrap();
    // Edit the first question: a sibling root.
    let q1b = store
        .append_message(chat.id, None, Role::User, "2+3?", MessageState::Complete)
        .await
        .unwrap();

    let roots = store.children(chat.id, None).await.unwrap();
    assert_eq!(
        roots.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![q1.id, q1b.id],
        "two branches at the root"
    );
    let answers = store.children(chat.id, Some(q1.id)).await.unwrap();
    assert_eq!(answers.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), vec!["4", "four"]);

    let path = store.path_to(q2.id).await.unwrap();
    assert_eq!(path.iter().map(|m| m.id).collect::<Vec<_>>(), vec![q1.id, a1.id, q2.id]);
    assert_eq!(store.path_to(a1b.id).await.unwrap().len(), 2);
    // The newest message became the conversation's tip; switching branches moves it.
    assert_eq!(store.conversation(chat.id).await.unwrap().current_leaf_id, Some(q1b.id));
    assert_eq!(store.latest_leaf(q1.id).await.unwrap(), a1b.id, "the newest child at each step");
    assert_eq!(store.latest_leaf(a1.id).await.unwrap(), q2.id);
    store.set_current_leaf(chat.id, q2.id).await.unwrap();
    assert_eq!(store.conversation(chat.id).await.unwrap().current_leaf_id, Some(q2.id));

    // Parents must exist and belong to the same conversation.
    let other = store.create_conversation("other", None).await.unwrap();
    let err = store
        .append_message(other.id, Some(q1.id), Role::User, "x", MessageState::Complete)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
    let err = store
        .append_message(chat.id, Some(999_999), Role::User, "x", MessageState::Complete)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { what: "message", .. }), "{err}");
    let err = store
        .append_message(999_999, None, Role::User, "x", MessageState::Complete)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { what: "conversation", .. }), "{err}");
    assert!(store.set_current_leaf(other.id, q1.id).await.is_err());
}

#[tokio::test]
async fn replies_stream_then_finish_with_stats() {
    let dir = tempfile::tempdir().unwrap();
    let store = fresh(&dir).await;
    let chat = store.create_conversation("stream", None).await.unwrap();
    let q = store
        .append_message(chat.id, None, Role::User, "hi", MessageState::Complete)
        .await
        .unwrap();
    let r = store
        .append_message(chat.id, Some(q.id), Role::Assistant, "", MessageState::Streaming)
        .await
        .unwrap();
    store.update_reply(r.id, "Hel").await.unwrap();
    store.update_reply(r.id, "Hello").await.unwrap();
    assert_eq!(store.message(r.id).await.unwrap().content, "Hello");
    let stats = serde_json::json!({"ttft_ms": 12.5, "decode_tok_s": 40.0, "generated_tokens": 2});
    store.finish_reply(r.id, "Hello!", MessageState::Complete, Some(&stats)).await.unwrap();
    let done = store.message(r.id).await.unwrap();
    assert_eq!((done.content.as_str(), done.state), ("Hello!", MessageState::Complete));
    assert_eq!(done.stats, Some(stats));
    assert!(store.update_reply(r.id, "more").await.is_err(), "a finished reply no longer streams");
    assert!(store.finish_reply(r.id, "x", MessageState::Streaming, None).await.is_err());
}

#[tokio::test]
async fn deleting_cascades_through_messages_and_attachments() {
    let dir = tempfile::tempdir().unwrap();
    let store = fresh(&dir).await;
    let keep = store.create_conversation("keep", None).await.unwrap();
    let kq = store
        .append_message(keep.id, None, Role::User, "stay", MessageState::Complete)
        .await
        .unwrap();
    let chat = store.create_conversation("doomed", None).await.unwrap();
    let q = store
        .append_message(chat.id, None, Role::User, "look", MessageState::Complete)
        .await
        .unwrap();
    store.add_attachment(q.id, "att/1.png", "image/png", 1234, "ab", 0).await.unwrap();
    store.add_attachment(q.id, "att/2.png", "image/png", 99, "cd", 1).await.unwrap();
    let a = store
        .append_message(chat.id, Some(q.id), Role::Assistant, "seen", MessageState::Complete)
        .await
        .unwrap();
    let q2 = store
        .append_message(chat.id, Some(a.id), Role::User, "again", MessageState::Complete)
        .await
        .unwrap();
    store.add_attachment(q2.id, "att/3.png", "image/png", 5, "ef", 0).await.unwrap();
    assert_eq!(
        store.attachments(q.id).await.unwrap().iter().map(|x| x.position).collect::<Vec<_>>(),
        vec![0, 1]
    );

    // Deleting a message takes its subtree and their attachments; the tip moves up.
    store.delete_message(a.id).await.unwrap();
    assert!(matches!(store.message(q2.id).await, Err(Error::NotFound { .. })));
    assert_eq!(store.attachments(q2.id).await.unwrap().len(), 0);
    assert_eq!(store.conversation(chat.id).await.unwrap().current_leaf_id, Some(q.id));

    store.delete_conversation(chat.id).await.unwrap();
    assert_eq!(
        store.count(Table::Messages).await.unwrap(),
        1,
        "only the other conversation's message"
    );
    assert_eq!(store.count(Table::Attachments).await.unwrap(), 0);
    assert_eq!(store.message(kq.id).await.unwrap().content, "stay");
    assert!(matches!(store.delete_conversation(chat.id).await, Err(Error::NotFound { .. })));
    assert!(
        store.add_attachment(q.id, "x", "image/png", 1, "00", 0).await.is_err(),
        "no attachment without its message"
    );
    store.check_integrity().await.unwrap();
}

#[tokio::test]
async fn conversations_rename_search_and_order_by_activity() {
    let dir = tempfile::tempdir().unwrap();
    let store = fresh(&dir).await;
    let cooking = store.create_conversation("Cooking", None).await.unwrap();
    let travel = store.create_conversation("Travel plans", None).await.unwrap();
    store
        .append_message(
            cooking.id,
            None,
            Role::User,
            "How long to boil an egg?",
            MessageState::Complete,
        )
        .await
        .unwrap();
    assert_eq!(
        store.conversations().await.unwrap()[0].id,
        cooking.id,
        "most recent activity first"
    );
    store.rename_conversation(travel.id, "Trip to Kyoto").await.unwrap();
    assert_eq!(store.conversations().await.unwrap()[0].title, "Trip to Kyoto");
    let found = store.search("EGG").await.unwrap();
    assert_eq!(
        found.iter().map(|c| c.id).collect::<Vec<_>>(),
        vec![cooking.id],
        "message text, any case"
    );
    assert_eq!(store.search("kyoto").await.unwrap().len(), 1, "titles too");
    assert!(store.search("100%").await.unwrap().is_empty(), "LIKE wildcards are escaped");
    store.set_system_prompt(cooking.id, Some("You are a chef.")).await.unwrap();
    store.set_settings(cooking.id, &serde_json::json!({"temperature": 0.7})).await.unwrap();
    store.set_model(cooking.id, "gemma-4-e4b").await.unwrap();
    let c = store.conversation(cooking.id).await.unwrap();
    assert_eq!(c.system_prompt.as_deref(), Some("You are a chef."));
    assert_eq!(c.settings["temperature"], 0.7);
    assert_eq!(c.model_id.as_deref(), Some("gemma-4-e4b"));
    assert!(matches!(store.rename_conversation(9999, "x").await, Err(Error::NotFound { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_on_one_file_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("quince.db");
    let first = Store::open(&path).await.unwrap();
    // A second, independent pool on the same file: two writers as two app windows would be.
    let second = Store::open(&path).await.unwrap();
    let mut tasks = Vec::new();
    for (w, store) in
        [first.clone(), second.clone(), first.clone(), second.clone()].into_iter().enumerate()
    {
        tasks.push(tokio::spawn(async move {
            let chat = store.create_conversation(&format!("writer {w}"), None).await.unwrap();
            let mut parent = None;
            for i in 0..25 {
                let m = store
                    .append_message(
                        chat.id,
                        parent,
                        Role::User,
                        &format!("{w}-{i}"),
                        MessageState::Complete,
                    )
                    .await
                    .unwrap();
                parent = Some(m.id);
            }
            (chat.id, parent.unwrap())
        }));
    }
    for task in tasks {
        let (chat, leaf) = task.await.unwrap();
        let path = first.path_to(leaf).await.unwrap();
        assert_eq!(path.len(), 25, "every message of writer chat {chat} is there, in order");
        assert!(path.windows(2).all(|w| w[1].parent_id == Some(w[0].id)));
    }
    assert_eq!(first.count(Table::Messages).await.unwrap(), 100);
    first.check_integrity().await.unwrap();
}
