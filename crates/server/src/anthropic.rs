//! Anthropic's `POST /v1/messages`: a system prompt, text and image blocks, tools (`tool_use`
//! and `tool_result` blocks), stop sequences, non-streaming and streaming (`message_start`, `content_block_start`,
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
use engine::tools::{ToolCall, ToolEvent};
use engine::turn::{Prompt, TurnMessage, TurnOutcome, TurnStats};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::{ApiError, parse_body};
use crate::openai::{Step, loaded_id, stream_of};
use crate::run::{self, new_id};
use crate::tools::{self, Calls, Choice};
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
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
}

/// A tool: `{"name", "description", "input_schema"}`.
#[derive(Debug, Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ToolChoice {
    Auto {},
    Any {},
    Tool { name: String },
    None {},
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
    Text {
        text: String,
    },
    Image {
        source: ImageSource,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<ToolResultContent>,
        #[serde(default)]
        is_error: bool,
    },
}

/// A tool result's content: text, or text blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ToolResultContent {
    Text(String),
    Blocks(Vec<Value>),
}

impl ToolResultContent {
    fn text(self) -> String {
        match self {
            ToolResultContent::Text(t) => t,
            ToolResultContent::Blocks(blocks) => blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
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
    if request.max_tokens == 0 {
        return Err(ApiError::invalid("max_tokens must be at least 1"));
    }
    let model = loaded_id(&shared)?;
    let messages = turn_messages(&shared, request.system, request.messages).await?;
    let temperature = request.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature must be between 0 and 1"));
    }
    let offered: Vec<Value> = request
        .tools
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            // OpenAI's order (name, description, parameters): the same tools render alike.
            let mut function = serde_json::Map::new();
            function.insert("name".into(), json!(t.name));
            if let Some(description) = t.description {
                function.insert("description".into(), json!(description));
            }
            let parameters = t.input_schema.unwrap_or_else(|| json!({ "type": "object" }));
            function.insert("parameters".into(), parameters);
            json!({ "type": "function", "function": function })
        })
        .collect();
    let offered = tools::checked(offered)?;
    let choice = match request.tool_choice {
        None | Some(ToolChoice::Auto {}) => Choice::Auto,
        Some(ToolChoice::Any {}) => Choice::Required,
        Some(ToolChoice::Tool { name }) => Choice::Named(name),
        Some(ToolChoice::None {}) => Choice::None,
    };
    let mut completion = Completion {
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
    let calls = tools::offer(&shared, &mut completion, offered, choice)?;
    let running = run::start(&shared, completion).await?;
    let id = new_id("msg_");
    if request.stream {
        return Ok(stream(running, calls, id, model));
    }
    let outcome = running.finish().await?;
    let (mut reason, sequence) = stop_reason(&outcome);
    let (text, made) = calls.read(&outcome.text);
    let mut content = Vec::new();
    if !text.is_empty() || made.is_empty() {
        content.push(json!({ "type": "text", "text": text }));
    }
    for call in &made {
        content.push(tool_use(call));
    }
    if !made.is_empty() {
        reason = "tool_use";
    }
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(&outcome.stats),
    }))
    .into_response())
}

/// A call as a `tool_use` block.
fn tool_use(call: &ToolCall) -> Value {
    json!({ "type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": call.arguments })
}

/// Anthropic's `stop_reason`, and the stop sequence that ended the reply.
fn stop_reason(outcome: &TurnOutcome) -> (&'static str, Option<String>) {
    match (outcome.stats.stop_reason, &outcome.stop_string) {
        (StopReason::MaxTokens, _) => ("max_tokens", None),
        (_, Some(sequence)) => ("stop_sequence", Some(sequence.clone())),
        (StopReason::StopToken | StopReason::Stopped, None) => ("end_turn", None),
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
        // Tool results go first, each its own `tool` message; the text after them is the
        // user's.
        let mut results = Vec::new();
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
                        Block::ToolUse { id, name, input } => {
                            turn.tool_calls.push(tools::template_call(&id, &name, input));
                        }
                        Block::ToolResult { tool_use_id, content, is_error } => {
                            let mut text = content.map(ToolResultContent::text).unwrap_or_default();
                            if is_error {
                                text = format!("Error: {text}");
                            }
                            let mut result = TurnMessage::text("tool", &text);
                            result.tool_call_id = Some(tool_use_id);
                            results.push(result);
                        }
                    }
                }
            }
        }
        let only_results = !results.is_empty() && turn.text.is_empty() && turn.images.is_empty();
        out.extend(results);
        if !only_results {
            out.push(turn);
        }
    }
    if out.last().is_some_and(|m: &TurnMessage| m.role == "assistant") {
        return Err(ApiError::invalid(
            "the last message is the assistant's: prefilled replies are not supported",
        ));
    }
    Ok(out)
}

/// The content blocks of a streamed message: the index of the one open, and whether it is a
/// text block (a `tool_use` block closes as soon as it is written).
struct Blocks {
    index: usize,
    text_open: bool,
}

impl Blocks {
    /// The events of what the reply's next piece holds: text into the open text block (one
    /// opened after a call), each call a `tool_use` block with its input in one
    /// `input_json_delta`.
    fn events(&mut self, events: Vec<ToolEvent>) -> Vec<Value> {
        let mut out = Vec::new();
        for event in events {
            match event {
                ToolEvent::Text(text) => {
                    if !self.text_open {
                        self.index += 1;
                        self.text_open = true;
                        out.push(json!({ "type": "content_block_start", "index": self.index,
                                         "content_block": { "type": "text", "text": "" } }));
                    }
                    out.push(json!({ "type": "content_block_delta", "index": self.index,
                                     "delta": { "type": "text_delta", "text": text } }));
                }
                ToolEvent::Call(call) => {
                    out.extend(self.close());
                    self.index += 1;
                    let mut start = tool_use(&call);
                    start["input"] = json!({});
                    out.push(json!({ "type": "content_block_start", "index": self.index,
                                     "content_block": start }));
                    out.push(json!({ "type": "content_block_delta", "index": self.index,
                                     "delta": { "type": "input_json_delta",
                                                "partial_json": call.arguments.to_string() } }));
                    out.push(json!({ "type": "content_block_stop", "index": self.index }));
                }
            }
        }
        out
    }

    /// The stop of the text block open, if one is.
    fn close(&mut self) -> Option<Value> {
        let open = std::mem::replace(&mut self.text_open, false);
        open.then(|| json!({ "type": "content_block_stop", "index": self.index }))
    }
}

/// The streamed events, each named by its type.
fn stream(running: run::Running, mut calls: Calls, id: String, model: String) -> Response {
    use futures_util::StreamExt;
    let mut blocks = Blocks { index: 0, text_open: true };
    let events = stream_of(running, move |step| match step {
        Step::Start => vec![
            json!({ "type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": 0, "output_tokens": 0 } } }),
            json!({ "type": "content_block_start", "index": 0,
                    "content_block": { "type": "text", "text": "" } }),
        ],
        Step::Text(text) => blocks.events(calls.push(&text)),
        Step::Done(outcome) => {
            let mut out = blocks.events(calls.finish());
            out.extend(blocks.close());
            let (mut reason, sequence) = stop_reason(outcome);
            if calls.made() > 0 {
                reason = "tool_use";
            }
            out.extend([
                json!({ "type": "message_delta",
                        "delta": { "stop_reason": reason, "stop_sequence": sequence },
                        "usage": usage(&outcome.stats) }),
                json!({ "type": "message_stop" }),
            ]);
            out
        }
        Step::Failed(error) => vec![error.anthropic_body()],
    });
    let events = events.map(|value| {
        let name = value["type"].as_str().unwrap_or("error").to_string();
        Ok::<_, Infallible>(Event::default().event(name).data(value.to_string()))
    });
    Sse::new(events).into_response()
}
