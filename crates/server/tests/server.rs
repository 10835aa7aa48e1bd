//! The local server on the demo model (random weights, the real Gemma 3 tokenizer and
//! template), over loopback: replies equal the engine's own alone, also with 8 clients at
//! once; the prompt cache; the error shapes; streaming's wire format.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::path::{Path, PathBuf};
use std::time::Duration;

use chat::Chat;
use engine::generate::Flow;
use engine::sampling::SamplingParams;
use engine::tokenizer::Tokenizer;
use engine::turn::{ChatModel, Drafters, Prompt, Turn, TurnMessage};
use serde_json::{Value, json};
use server::{ServeOptions, Server};

const KEY: &str = "test-key";

struct Fixture {
    _dir: tempfile::TempDir,
    model: PathBuf,
    chat: Chat,
    server: Server,
}

async fn fixture(options: impl FnOnce(&mut ServeOptions)) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = test_support::demo_model(&dir.path().join("demo"));
    let chat = Chat::open(dir.path().join("data")).await.unwrap().with_hf_cache(None);
    chat.load_model(&model, |_| {}).await.unwrap();
    let mut serve = ServeOptions { port: 0, ..ServeOptions::new(KEY) };
    options(&mut serve);
    let server = Server::start(chat.clone(), serve).await.unwrap();
    Fixture { _dir: dir, model, chat, server }
}

impl Fixture {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.base_url())
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let response = reqwest::Client::new()
            .post(self.url(path))
            .bearer_auth(KEY)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap())
    }

    /// The raw text of a (streamed) reply to `body`, sent with `header: KEY`.
    async fn post_text(&self, path: &str, header: &str, body: &Value) -> String {
        let value = if header == "authorization" { format!("Bearer {KEY}") } else { KEY.into() };
        let response = reqwest::Client::new()
            .post(self.url(path))
            .header(header, value)
            .json(body)
            .send()
            .await
            .unwrap();
        response.text().await.unwrap()
    }

    async fn stop(self) {
        self.server.stop().await;
        self.chat.shutdown();
    }
}

/// The engine's own greedy reply to one user message, alone, on this thread.
fn alone(model: &Path, prompts: &[String], max_tokens: usize) -> Vec<String> {
    let loaded = engine::registry::load_model(model, &Default::default()).unwrap();
    let chat = ChatModel::new(model, loaded, Tokenizer::from_dir(model).unwrap()).unwrap();
    prompts
        .iter()
        .map(|p| {
            let turn = Turn {
                max_tokens,
                sampling: SamplingParams::default(),
                ..Turn::new(Prompt::Messages(vec![TurnMessage::text("user", p)]))
            };
            let mut drafters = Drafters::default();
            chat.answer(&turn, &mut drafters, |_| Flow::Continue).unwrap().text
        })
        .collect()
}

fn chat_body(prompt: &str, max_tokens: usize) -> Value {
    json!({ "model": "demo", "messages": [{ "role": "user", "content": prompt }],
            "max_tokens": max_tokens, "temperature": 0 })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_replies_equal_the_engine_alone_also_with_eight_clients_at_once() {
    let f = fixture(|_| {}).await;
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Question {i}: {}", "tell me about quinces. ".repeat(1 + i % 3)))
        .collect();
    let want = alone(&f.model, &prompts, 12);
    // One after another, then all at once (they decode together in the engine's batch).
    let (status, first) = f.post("/chat/completions", &chat_body(&prompts[0], 12)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["choices"][0]["message"]["content"], want[0].as_str());
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["completion_tokens"], 12);
    let bodies: Vec<Value> = prompts.iter().map(|p| chat_body(p, 12)).collect();
    let at_once =
        futures_util::future::join_all(bodies.iter().map(|b| f.post("/chat/completions", b))).await;
    for (i, (status, reply)) in at_once.iter().enumerate() {
        assert_eq!(*status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["message"]["content"], want[i].as_str(), "client {i}");
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_extends_the_last_resumes_from_its_checkpoint() {
    let f = fixture(|_| {}).await;
    let question = "Where do quinces grow? ".repeat(8);
    let (_, first) = f.post("/chat/completions", &chat_body(&question, 6)).await;
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap();
    let next = json!({ "messages": [
        { "role": "user", "content": question },
        { "role": "assistant", "content": answer },
        { "role": "user", "content": "And when are they ripe?" } ],
        "max_tokens": 6, "temperature": 0 });
    let (status, second) = f.post("/chat/completions", &next).await;
    assert_eq!(status, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= first_prompt, "cached {cached} of the first prompt's {first_prompt}");
    // The same reply as from a cold start: a fresh server without the prompt cache.
    let cold = {
        let g = fixture(|_| {}).await;
        let (_, cold) = g.post("/chat/completions", &next).await;
        g.stop().await;
        cold
    };
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(second["choices"][0]["message"], cold["choices"][0]["message"]);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_end_with_done_and_carry_usage_when_asked() {
    let f = fixture(|_| {}).await;
    let want = alone(&f.model, &["Stream to me.".to_string()], 5).remove(0);
    let mut body = chat_body("Stream to me.", 5);
    body["stream"] = json!(true);
    body["stream_options"] = json!({ "include_usage": true });
    let text = f.post_text("/chat/completions", "authorization", &body).await;
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, want);
    let finish: Vec<&Value> =
        chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 5);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_take_openai_and_anthropic_shapes() {
    let f = fixture(|o| o.max_body_bytes = 64 << 10).await;
    let client = reqwest::Client::new();
    // No key, a wrong key: 401 on both APIs, each in its own shape.
    let none = client.get(f.url("/models")).send().await.unwrap();
    assert_eq!(none.status(), 401);
    let body: Value = none.json().await.unwrap();
    assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    let wrong = client.post(f.url("/messages")).header("x-api-key", "nope").send().await.unwrap();
    assert_eq!(wrong.status(), 401);
    let body: Value = wrong.json().await.unwrap();
    assert_eq!(
        (body["type"].as_str(), body["error"]["type"].as_str()),
        (Some("error"), Some("authentication_error")),
        "{body}"
    );
    // A malformed body, an unknown route, a body over the limit.
    let malformed = client
        .post(f.url("/chat/completions"))
        .bearer_auth(KEY)
        .body("{\"messages\": [")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), 400);
    let body: Value = malformed.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("not valid"), "{body}");
    let missing = client.get(f.url("/engines")).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(missing.status(), 404);
    let huge = chat_body(&"x".repeat(100 << 10), 4);
    let (status, body) = f.post("/chat/completions", &huge).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "request_too_large");
    // What the server does not offer, and what the model cannot take.
    let mut two = chat_body("Hi", 4);
    two["n"] = json!(2);
    let (status, body) = f.post("/chat/completions", &two).await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("n must be 1"), "{body}");
    let bad_image = json!({ "messages": [{ "role": "user", "content": [
        { "type": "text", "text": "What is this?" },
        { "type": "image_url", "image_url": { "url": "data:image/png;base64,aGVsbG8=" } } ] }],
        "max_tokens": 4 });
    let (status, body) = f.post("/chat/completions", &bad_image).await;
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_image")), "{body}");
    let remote = json!({ "messages": [{ "role": "user", "content": [
        { "type": "image_url", "image_url": { "url": "https://example.com/a.png" } } ] }] });
    let (status, body) = f.post("/chat/completions", &remote).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("data URLs"), "{body}");
    let context = f.chat.loaded().unwrap().max_context as usize;
    let long = chat_body(&"quince ".repeat(context + 16), 4);
    let f_big = fixture(|_| {}).await;
    let (status, body) = f_big.post("/chat/completions", &long).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{body}"
    );
    f_big.stop().await;
    // The server still answers after all of them.
    let (status, _) = f.post("/chat/completions", &chat_body("Still there?", 2)).await;
    assert_eq!(status, 200);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_answer_as_the_engine_does_and_stream_their_events() {
    let f = fixture(|_| {}).await;
    let want = alone(&f.model, &["Hello, Claude-shaped client.".to_string()], 6).remove(0);
    let body = json!({ "model": "demo", "max_tokens": 6, "temperature": 0,
        "messages": [{ "role": "user", "content": [
            { "type": "text", "text": "Hello, Claude-shaped client." } ] }] });
    let (status, reply) = f.post("/messages", &body).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["type"], "message");
    assert_eq!(reply["content"][0]["text"], want.as_str());
    assert_eq!(reply["stop_reason"], "max_tokens");
    assert_eq!(reply["usage"]["output_tokens"], 6);
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let text = f.post_text("/messages", "x-api-key", &streaming).await;
    let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{text}");
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    let streamed: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|v| v["delta"]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, want);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_frees_its_row() {
    let f = fixture(|_| {}).await;
    let mut body = chat_body("Talk for a long time.", 100_000);
    body["stream"] = json!(true);
    let mut response = reqwest::Client::new()
        .post(f.url("/chat/completions"))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("chat.completion.chunk"));
    assert_eq!(f.chat.completions_running(), 1);
    drop(response);
    // The engine stops the reply within a step or two of noticing; the demo decodes the whole
    // context in minutes here.
    let freed = tokio::time::timeout(Duration::from_secs(60), async {
        while f.chat.completions_running() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(freed.is_ok(), "the row of a client that went away is freed");
    let (status, _) = f.post("/chat/completions", &chat_body("A short one.", 3)).await;
    assert_eq!(status, 200);
    f.stop().await;
}
