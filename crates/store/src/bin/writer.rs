//! `quince-store-writer DB`: opens the store at DB, writes a user message and a reply that
//! streams forever (one committed update every few milliseconds), printing `streaming <id>`
//! once the reply exists. The crash test kills it with SIGKILL mid-reply.

use std::io::Write;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: quince-store-writer DB")?;
    let store = store::Store::open(&path).await?;
    let chat = store.create_conversation("crash test", None).await?;
    let question = store
        .append_message(
            chat.id,
            None,
            store::Role::User,
            "Tell me a long story.",
            store::MessageState::Complete,
        )
        .await?;
    let reply = store
        .append_message(
            chat.id,
            Some(question.id),
            store::Role::Assistant,
            "",
            store::MessageState::Streaming,
        )
        .await?;
    let mut text = String::new();
    let mut announced = false;
    for n in 0u64.. {
        text.push_str(&format!("word{n} "));
        store.update_reply(reply.id, &text).await?;
        if !announced && n >= 20 {
            let mut out = std::io::stdout().lock();
            writeln!(out, "streaming {} {}", reply.id, chat.id)?;
            out.flush()?;
            announced = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    Ok(())
}
