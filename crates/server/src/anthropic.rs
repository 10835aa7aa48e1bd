//! Anthropic's `POST /v1/messages`: a system prompt, text and image blocks, stop sequences,
//! non-streaming and streaming (`message_start`, `content_block_start`,
//! `content_block_delta`, … `message_stop`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use chat::Completion;
use engine::generate::StopReason;
use engine::sampling::SamplingParams;
use engine::turn::{Prompt, TurnMessage, TurnStats};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::{ApiError, parse_body};
use crate::openai::{Step, loaded_id, stream_of};
use crate::run::{self, new_id};
use crate::{AppState, Shared, content};

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    max_tokens: usize,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<System>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    tools: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum System {
    Text(String),
    Blocks(Vec<TextBlock>),
}

#[derive(Debug, Deserialize)]
struct TextBlock {
    text: String,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text { text: String },
    Image { source: ImageSource },
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ImageSource {
    Base64 { data: String },
    Url {},
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(shared): AppState,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match inner(shared, body).await {
        Ok(response) => response,
        Err(error) => error.anthropic(),
    }
}

async fn inner(
    shared: Arc<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: MessagesRequest = parse_body(body)?;
    if request.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid("tools are not supported by this server yet"));
    }
    if request.max_tokens == 0 {
        return Err(ApiError::invalid("max_tokens must be at least 1"));
    }
    let model = loaded_id(&shared)?;
    let messages = turn_messages(&shared, request.system, request.messages).await?;
    let temperature = request.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature must be between 0 and 1"));
    }
    let stops = request.stop_sequences.clone();
    let completion = Completion {
        sampling: SamplingParams {
            temperature,
            top_p: request.top_p.unwrap_or(1.0),
            top_k: request.top_k.unwrap_or(0),
            seed: run::random_seed(),
            ..SamplingParams::default()
        },
        max_tokens: Some(request.max_tokens),
        stop: request.stop_sequences,
        ..Completion::new(Prompt::Messages(messages))
    };
    let running = run::start(&shared, completion).await?;
    let id = new_id("msg_");
    if request.stream {
        return Ok(stream(running, id, model, stops));
    }
    let outcome = running.finish().await?;
    let (stop_reason, stop_sequence) = stop_reason(outcome.stats.stop_reason, &stops);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{ "type": "text", "text": outcome.text }],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&outcome.stats),
    }))
    .into_response())
}

/// Anthropic's `stop_reason`, and the stop sequence when it can be named (a reply stopped by
/// one of several is reported as stopped by a stop sequence, not which).
fn stop_reason(reason: StopReason, stops: &[String]) -> (&'static str, Option<String>) {
    match reason {
        StopReason::MaxTokens => ("max_tokens", None),
        StopReason::Stopped if !stops.is_empty() => {
            ("stop_sequence", (stops.len() == 1).then(|| stops[0].clone()))
        }
        StopReason::StopToken | StopReason::Stopped => ("end_turn", None),
    }
}

fn usage(stats: &TurnStats) -> Value {
    json!({
        "input_tokens": stats.prompt_tokens - stats.reused_tokens,
        "cache_read_input_tokens": stats.reused_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": stats.generated_tokens,
    })
}

/// The system prompt and messages as the engine takes them, images imported.
async fn turn_messages(
    shared: &Shared,
    system: Option<System>,
    messages: Vec<Message>,
) -> Result<Vec<TurnMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages is empty"));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    let system = match system {
        Some(System::Text(text)) => text,
        Some(System::Blocks(blocks)) => {
            blocks.into_iter().map(|b| b.text).collect::<Vec<_>>().join("\n")
        }
        None => String::new(),
    };
    if !system.trim().is_empty() {
        out.push(TurnMessage::text("system", &system));
    }
    let mut images = 0;
    for message in messages {
        let role = match message.role.as_str() {
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::invalid(format!(
                    "role {other:?} is not user or assistant (the system prompt goes in `system`)"
                )));
            }
        };
        let mut turn = TurnMessage::text(role, "");
        match message.content {
            Content::Text(text) => turn.text = text,
            Content::Blocks(blocks) => {
                for block in blocks {
                    match block {
                        Block::Text { text } => content::push_text(&mut turn, &text),
                        Block::Image { source } => {
                            images += 1;
                            let bytes = match source {
                                ImageSource::Base64 { data } => {
                                    content::decode_base64(&data, images)
                                }
                                ImageSource::Url {} => Err(ApiError::invalid(format!(
                                    "image {images}: send images as base64; the server \
                                     fetches nothing from the network"
                                ))),
                            };
                            content::push_image(&shared.chat, &mut turn, images, bytes).await?;
                        }
                    }
                }
            }
        }
        out.push(turn);
    }
    if out.last().is_some_and(|m: &TurnMessage| m.role == "assistant") {
        return Err(ApiError::invalid(
            "the last message is the assistant's: prefilled replies are not supported",
        ));
    }
    Ok(out)
}

/// The streamed events, each named by its type.
fn stream(running: run::Running, id: String, model: String, stops: Vec<String>) -> Response {
    use futures_util::StreamExt;
    let events = stream_of(running, move |step| match step {
        Step::Start => vec![
            json!({ "type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": 0, "output_tokens": 0 } } }),
            json!({ "type": "content_block_start", "index": 0,
                    "content_block": { "type": "text", "text": "" } }),
        ],
        Step::Text(text) => vec![json!({ "type": "content_block_delta", "index": 0,
                                         "delta": { "type": "text_delta", "text": text } })],
        Step::Done(outcome) => {
            let (reason, sequence) = stop_reason(outcome.stats.stop_reason, &stops);
            vec![
                json!({ "type": "content_block_stop", "index": 0 }),
                json!({ "type": "message_delta",
                        "delta": { "stop_reason": reason, "stop_sequence": sequence },
                        "usage": usage(&outcome.stats) }),
                json!({ "type": "message_stop" }),
            ]
        }
        Step::Failed(error) => vec![error.anthropic_body()],
    });
    let events = events.map(|value| {
        let name = value["type"].as_str().unwrap_or("error").to_string();
        Ok::<_, Infallible>(Event::default().event(name).data(value.to_string()))
    });
    Sse::new(events).into_response()
}
