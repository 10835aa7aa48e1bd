//! A process killed with SIGKILL while a reply streams leaves a database that opens cleanly,
//! keeps every committed message, and shows the partial reply as stopped.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use store::{MessageState, Role, Store};

#[tokio::test]
async fn sigkill_mid_reply_keeps_what_was_committed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("quince.db");
    let mut child = Command::new(env!("CARGO_BIN_EXE_quince-store-writer"))
        .arg(&path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let mut words = line.split_whitespace().skip(1).map(|w| w.parse::<i64>().unwrap());
    let (reply_id, chat_id) = (words.next().unwrap(), words.next().unwrap());
    // Let it write a while longer, then kill it mid-update (SIGKILL: no cleanup at all).
    std::thread::sleep(std::time::Duration::from_millis(150));
    child.kill().unwrap();
    child.wait().unwrap();

    let store = Store::open(&path).await.unwrap();
    store.check_integrity().await.unwrap();
    let path_msgs = store.path_to(reply_id).await.unwrap();
    assert_eq!(path_msgs.len(), 2);
    assert_eq!((path_msgs[0].role, path_msgs[0].state), (Role::User, MessageState::Complete));
    assert_eq!(path_msgs[0].content, "Tell me a long story.");
    let reply = &path_msgs[1];
    assert_eq!(reply.state, MessageState::Stopped, "a reply cut off by a crash is marked stopped");
    let words: Vec<&str> = reply.content.split_whitespace().collect();
    assert!(words.len() > 20, "the committed part of the reply survived: {} words", words.len());
    for (n, word) in words.iter().enumerate() {
        assert_eq!(*word, format!("word{n}"), "the saved text is a clean prefix");
    }
    assert_eq!(store.conversation(chat_id).await.unwrap().current_leaf_id, Some(reply_id));
    // The store keeps working: the conversation continues after the stopped reply.
    let next = store
        .append_message(chat_id, Some(reply_id), Role::User, "go on", MessageState::Complete)
        .await
        .unwrap();
    assert_eq!(store.path_to(next.id).await.unwrap().len(), 3);
}
