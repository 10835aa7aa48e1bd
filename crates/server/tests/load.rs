//! A load test on loopback, bounded in time: 16 clients send 128 requests between them (16
//! prompts of 10 to 100 tokens, 2 to 4 tokens each, half streamed), and every eighth request is
//! abandoned after its first piece. Every request is answered or abandoned as asked, none is lost or mixed up:
//! each reply equals the engine's own reply to the same request alone, and an abandoned one
//! what had arrived of it. Prints the latencies (run with `--nocapture` to see them).
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use chat::Chat;
use engine::generate::Flow;
use engine::sampling::SamplingParams;
use engine::tokenizer::Tokenizer;
use engine::turn::{ChatModel, Drafters, Prompt, Turn, TurnMessage};
use serde_json::{Value, json};
use server::{ServeOptions, Server};

const KEY: &str = "load-key";
const CLIENTS: usize = 16;
const REQUESTS: usize = 128;

fn prompt(i: usize) -> String {
    format!("Request family {i}. {}", "Quinces ripen late in autumn. ".repeat(1 + (i * 5) % 13))
}

/// Request `n`: (its prompt, its max_tokens, streamed, abandoned after its first piece).
fn request(n: usize) -> (usize, usize, bool, bool) {
    (n % 16, 2 + (n / 16) % 3, n.is_multiple_of(2), n % 8 == 3)
}

/// The engine's own greedy replies, alone, for every (prompt, max_tokens) the load sends.
fn alone(model: &Path) -> HashMap<(usize, usize), String> {
    let loaded = engine::registry::load_model(model, &Default::default()).unwrap();
    let chat = ChatModel::new(model, loaded, Tokenizer::from_dir(model).unwrap()).unwrap();
    let mut out = HashMap::new();
    for n in 0..REQUESTS {
        let (p, max_tokens, _, _) = request(n);
        out.entry((p, max_tokens)).or_insert_with(|| {
            let turn = Turn {
                max_tokens,
                sampling: SamplingParams::default(),
                ..Turn::new(Prompt::Messages(vec![TurnMessage::text("user", &prompt(p))]))
            };
            chat.answer(&turn, &mut Drafters::default(), |_| Flow::Continue).unwrap().text
        });
    }
    out
}

/// What one request got: its full text, or (abandoned) what arrived before it was.
struct Got {
    n: usize,
    text: String,
    abandoned: bool,
    latency: Duration,
}

async fn send(base: &str, n: usize) -> Got {
    let (p, max_tokens, stream, abandon) = request(n);
    let body = json!({ "messages": [{ "role": "user", "content": prompt(p) }],
                       "max_tokens": max_tokens, "temperature": 0, "stream": stream || abandon });
    let started = Instant::now();
    let mut response = reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "request {n}");
    if !(stream || abandon) {
        let reply: Value = response.json().await.unwrap();
        let text = reply["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        return Got { n, text, abandoned: false, latency: started.elapsed() };
    }
    let (mut buffer, mut text, mut pieces) = (String::new(), String::new(), 0);
    while let Some(bytes) = response.chunk().await.unwrap() {
        buffer.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return Got { n, text, abandoned: false, latency: started.elapsed() };
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str()
                && !piece.is_empty()
            {
                text.push_str(piece);
                pieces += 1;
            }
            if abandon && pieces >= 1 {
                return Got { n, text, abandoned: true, latency: started.elapsed() };
            }
        }
    }
    panic!("request {n}'s stream ended without [DONE]");
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_send_128_requests_and_none_is_lost_or_mixed_up() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_support::demo_model(&dir.path().join("demo"));
    let want = alone(&model);
    let chat = Chat::open(dir.path().join("data")).await.unwrap().with_hf_cache(None);
    chat.load_model(&model, |_| {}).await.unwrap();
    let server = Server::start(chat.clone(), ServeOptions { port: 0, ..ServeOptions::new(KEY) })
        .await
        .unwrap();
    let base = server.base_url();
    let started = Instant::now();
    let clients = (0..CLIENTS).map(|c| {
        let base = base.clone();
        tokio::spawn(async move {
            let mut got = Vec::new();
            for n in (c..REQUESTS).step_by(CLIENTS) {
                got.push(send(&base, n).await);
            }
            got
        })
    });
    let all =
        tokio::time::timeout(Duration::from_secs(600), futures_util::future::join_all(clients))
            .await
            .expect("the load ends within its bound");
    let wall = started.elapsed();
    let mut got: Vec<Got> = all.into_iter().flat_map(Result::unwrap).collect();
    got.sort_by_key(|g| g.n);
    assert_eq!(got.iter().map(|g| g.n).collect::<Vec<_>>(), (0..REQUESTS).collect::<Vec<_>>());
    for g in &got {
        let (p, max_tokens, _, abandon) = request(g.n);
        let alone = &want[&(p, max_tokens)];
        assert!(abandon || !g.abandoned, "request {} was not to be abandoned", g.n);
        if g.abandoned {
            assert!(alone.starts_with(&g.text), "request {}: {:?} vs {alone:?}", g.n, g.text);
        } else {
            assert_eq!(&g.text, alone, "request {}", g.n);
        }
    }
    // The abandoned replies' rows are freed.
    tokio::time::timeout(Duration::from_secs(60), async {
        while chat.completions_running() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("every row is freed");
    let mut latencies: Vec<f64> =
        got.iter().filter(|g| !g.abandoned).map(|g| g.latency.as_secs_f64() * 1e3).collect();
    let answered = latencies.len();
    eprintln!(
        "load: {REQUESTS} requests from {CLIENTS} clients in {:.1} s, {answered} answered, \
         {} abandoned; latency p50 {:.0} ms, p99 {:.0} ms",
        wall.as_secs_f64(),
        REQUESTS - answered,
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
    );
    server.stop().await;
    chat.shutdown();
}
