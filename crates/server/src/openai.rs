//! OpenAI's routes: `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`,
//! non-streaming and streaming (server-sent events ending with `data: [DONE]`).

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use chat::{Completion, ReplyEvent};
use engine::sampling::SamplingParams;
use engine::tools::{ToolCall, ToolEvent};
use engine::turn::{Prompt, TurnMessage, TurnOutcome, TurnStats};
use futures_util::Stream;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::{ApiError, parse_body};
use crate::run::{self, Running, finish_reason, new_id, now_secs};
use crate::tools::{self, Calls, Choice};
use crate::{AppState, Shared, content};

/// `GET /v1/models`: the loaded model.
pub(crate) async fn models(State(shared): AppState) -> Response {
    let data: Vec<Value> = shared
        .chat
        .loaded()
        .map(|m| json!({ "id": model_id(&m), "object": "model", "created": 0, "owned_by": "quince" }))
        .into_iter()
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

/// The id clients see for the loaded model: its folder's name.
pub(crate) fn model_id(model: &chat::view::LoadedModel) -> String {
    PathBuf::from(&model.path)
        .file_name()
        .map_or_else(|| model.name.clone(), |n| n.to_string_lossy().into_owned())
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// The fields both completion routes share.
#[derive(Debug, Deserialize)]
struct Options {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    stop: Option<Stop>,
    seed: Option<u64>,
    n: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

impl Options {
    /// The completion of `prompt` these options ask for; refuses what is not offered.
    fn completion(self, prompt: Prompt) -> Result<Completion, ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(format!(
                "n = {n}: this server returns one choice per request (n must be 1)"
            )));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        let top_p = self.top_p.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid("temperature must be between 0 and 2"));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid("top_p must be above 0 and at most 1"));
        }
        let stop = self.stop.map(Stop::into_vec).unwrap_or_default();
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop takes up to 4 non-empty strings"));
        }
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        if max_tokens == Some(0) {
            return Err(ApiError::invalid("max_tokens must be at least 1"));
        }
        Ok(Completion {
            sampling: SamplingParams {
                temperature,
                top_p,
                seed: self.seed.unwrap_or_else(run::random_seed),
                ..SamplingParams::default()
            },
            max_tokens,
            stop,
            ..Completion::new(prompt)
        })
    }
}

/// A chat message.
#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<MessageContent>,
    /// An assistant message's calls.
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallIn>>,
    /// A `tool` message's call.
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// A call in an earlier assistant message.
#[derive(Debug, Deserialize)]
struct ToolCallIn {
    #[serde(default)]
    id: Option<String>,
    function: FunctionIn,
}

#[derive(Debug, Deserialize)]
struct FunctionIn {
    name: String,
    /// A JSON string, as OpenAI sends it (an object is taken too).
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Debug, Deserialize)]
struct ImageUrl {
    url: String,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(flatten)]
    options: Options,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function":
/// {"name": …}}`; auto when tools are given, none when not.
fn tool_choice(choice: Option<Value>) -> Result<Choice, ApiError> {
    match choice {
        None => Ok(Choice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(Choice::None),
            "auto" => Ok(Choice::Auto),
            "required" => Ok(Choice::Required),
            other => Err(ApiError::invalid(format!(
                "tool_choice {other:?} is not none, auto, required or a function"
            ))),
        },
        Some(named) => named
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(|n| Choice::Named(n.to_string()))
            .ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice is not {\"type\": \"function\", \"function\": {\"name\": …}}",
                )
            }),
    }
}

/// The messages as the engine takes them: roles checked, images imported.
async fn turn_messages(
    shared: &Shared,
    messages: Vec<Message>,
) -> Result<Vec<TurnMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages is empty"));
    }
    let mut out: Vec<TurnMessage> = Vec::with_capacity(messages.len());
    let mut images = 0;
    for message in messages {
        let role = match message.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::invalid(format!(
                    "role {other:?} is not one this server takes (system, developer, user, \
                     assistant, tool)"
                )));
            }
        };
        let mut turn = TurnMessage::text(role, "");
        turn.tool_call_id = message.tool_call_id;
        for (i, call) in message.tool_calls.unwrap_or_default().into_iter().enumerate() {
            let arguments = match call.function.arguments {
                Some(Value::String(s)) if s.trim().is_empty() => json!({}),
                Some(Value::String(s)) => serde_json::from_str(&s).map_err(|e| {
                    ApiError::invalid(format!(
                        "tool_calls[{i}].function.arguments is not JSON: {e}"
                    ))
                })?,
                Some(other) => other,
                None => json!({}),
            };
            let id = call.id.unwrap_or_else(|| format!("call_{i}"));
            turn.tool_calls.push(tools::template_call(&id, &call.function.name, arguments));
        }
        match message.content {
            None => {}
            Some(MessageContent::Text(text)) => turn.text = text,
            Some(MessageContent::Parts(parts)) => {
                for part in parts {
                    match part {
                        Part::Text { text } => content::push_text(&mut turn, &text),
                        Part::ImageUrl { image_url } => {
                            images += 1;
                            let bytes = content::data_url_bytes(&image_url.url, images);
                            content::push_image(&shared.chat, &mut turn, images, bytes).await?;
                        }
                    }
                }
            }
        }
        out.push(turn);
    }
    if out.last().is_some_and(|m| m.role == "assistant") {
        return Err(ApiError::invalid(
            "the last message is the assistant's: the server answers a user message",
        ));
    }
    Ok(out)
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(shared): AppState,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match chat_inner(shared, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn chat_inner(
    shared: Arc<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse_body(body)?;
    let model = loaded_id(&shared)?;
    let tool_list = tools::checked(request.tools.unwrap_or_default())?;
    let choice = tool_choice(request.tool_choice)?;
    let constraint = tools::response_format(request.response_format)?;
    let messages = turn_messages(&shared, request.messages).await?;
    let stream = request.options.stream;
    let include_usage = request.options.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let mut completion = request.options.completion(Prompt::Messages(messages))?;
    completion.constraint = constraint;
    let calls = tools::offer(&shared, &mut completion, tool_list, choice)?;
    let running = run::start(&shared, completion).await?;
    let id = new_id("chatcmpl-");
    if stream {
        return Ok(sse(chat_chunks(running, calls, id, model, include_usage)));
    }
    let outcome = running.finish().await?;
    let (content, made) = calls.read(&outcome.text);
    let mut message = json!({ "role": "assistant", "content": content });
    let mut finish = finish_reason(outcome.stats.stop_reason);
    if !made.is_empty() {
        let made: Vec<Value> = made.into_iter().map(|c| openai_call(&c, None)).collect();
        if content.trim().is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = Value::Array(made);
        finish = "tool_calls";
    }
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": now_secs(),
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": null,
        }],
        "usage": usage(&outcome.stats),
    }))
    .into_response())
}

/// A call as OpenAI returns it (arguments a JSON string); `index` in a streamed delta.
fn openai_call(call: &ToolCall, index: Option<usize>) -> Value {
    let mut out = json!({
        "id": new_id("call_"),
        "type": "function",
        "function": { "name": call.name, "arguments": call.arguments.to_string() },
    });
    if let Some(index) = index {
        out["index"] = json!(index);
    }
    out
}

/// The loaded model's id; 503 when none is loaded.
/// Any model name is answered by the loaded model, as LM Studio does with one loaded.
pub(crate) fn loaded_id(shared: &Shared) -> Result<String, ApiError> {
    shared.chat.loaded().map(|m| model_id(&m)).ok_or_else(|| {
        ApiError::from_kind(chat::view::ErrorKind::ModelMissing, "no model is loaded")
    })
}

/// OpenAI's `usage`, with the prompt tokens restored from the prompt cache.
pub(crate) fn usage(stats: &TurnStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": { "cached_tokens": stats.reused_tokens },
    })
}

fn sse(events: impl Stream<Item = Value> + Send + 'static) -> Response {
    use futures_util::StreamExt;
    let events = events
        .map(|value| Ok::<_, Infallible>(Event::default().data(value.to_string())))
        .chain(futures_util::stream::once(async {
            Ok::<_, Infallible>(Event::default().data("[DONE]"))
        }));
    Sse::new(events).into_response()
}

/// A streamed reply's chunks: the role, each piece of text and each tool call as it is read,
/// the finish reason, and `usage` when asked for. A failure after the first chunk ends the
/// stream with an error object.
fn chat_chunks(
    running: Running,
    mut calls: Calls,
    id: String,
    model: String,
    include_usage: bool,
) -> impl Stream<Item = Value> + Send {
    let chunk = move |delta: Value, finish: Option<&str>| {
        json!({
            "id": id, "object": "chat.completion.chunk", "created": now_secs(), "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": null }],
        })
    };
    let deltas = |events: Vec<ToolEvent>, made_before: usize| -> Vec<Value> {
        let mut index = made_before;
        events
            .into_iter()
            .map(|event| match event {
                ToolEvent::Text(text) => json!({ "content": text }),
                ToolEvent::Call(call) => {
                    index += 1;
                    json!({ "tool_calls": [openai_call(&call, Some(index - 1))] })
                }
            })
            .collect()
    };
    stream_of(running, move |step| match step {
        Step::Start => vec![chunk(json!({ "role": "assistant", "content": "" }), None)],
        Step::Text(text) => {
            let before = calls.made();
            let events = calls.push(&text);
            deltas(events, before).into_iter().map(|d| chunk(d, None)).collect()
        }
        Step::Done(outcome) => {
            let before = calls.made();
            let events = calls.finish();
            let mut out: Vec<Value> =
                deltas(events, before).into_iter().map(|d| chunk(d, None)).collect();
            let finish = match calls.made() {
                0 => finish_reason(outcome.stats.stop_reason),
                _ => "tool_calls",
            };
            out.push(chunk(json!({}), Some(finish)));
            if include_usage {
                let mut last = chunk(json!({}), None);
                last["choices"] = json!([]);
                last["usage"] = usage(&outcome.stats);
                out.push(last);
            }
            out
        }
        Step::Failed(error) => vec![error.openai_body()],
    })
}

/// What a streamed reply has reached.
pub(crate) enum Step<'a> {
    Start,
    Text(String),
    Done(&'a TurnOutcome),
    Failed(ApiError),
}

/// The values `render` makes of a completion's steps, in order; the completion is cancelled
/// when the stream is dropped (the client went away).
pub(crate) fn stream_of(
    running: Running,
    mut render: impl FnMut(Step<'_>) -> Vec<Value> + Send + 'static,
) -> impl Stream<Item = Value> + Send {
    use futures_util::StreamExt;
    let start = render(Step::Start);
    let state = (Some(running), render);
    let rest = futures_util::stream::unfold(state, |(running, mut render)| async move {
        let mut running = running?;
        let values = match running.next().await {
            Some(ReplyEvent::Text { text }) if text.is_empty() => Vec::new(),
            Some(ReplyEvent::Text { text }) => render(Step::Text(text)),
            Some(ReplyEvent::Queued { .. } | ReplyEvent::Admitted) => Vec::new(),
            Some(ReplyEvent::Done(outcome)) => {
                let values = render(Step::Done(&outcome));
                return Some((values, (None, render)));
            }
            Some(ReplyEvent::Failed { message, kind }) => {
                let values = render(Step::Failed(ApiError::from_kind(kind, message)));
                return Some((values, (None, render)));
            }
            Some(ReplyEvent::StoppedWaiting) | None => return None,
        };
        Some((values, (Some(running), render)))
    });
    futures_util::stream::iter(start).chain(rest.flat_map(futures_util::stream::iter))
}

/// `POST /v1/completions`: a raw prompt (text, or token ids), no template.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: RawPrompt,
    #[serde(flatten)]
    options: Options,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawPrompt {
    Text(String),
    Ids(Vec<u32>),
}

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(shared): AppState,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match completions_inner(shared, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    }
}

async fn completions_inner(
    shared: Arc<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_body(body)?;
    let model = loaded_id(&shared)?;
    let prompt = match request.prompt {
        RawPrompt::Text(text) if text.is_empty() => {
            return Err(ApiError::invalid("prompt is empty"));
        }
        RawPrompt::Ids(ids) if ids.is_empty() => return Err(ApiError::invalid("prompt is empty")),
        RawPrompt::Text(text) => Prompt::Text(text),
        RawPrompt::Ids(ids) => Prompt::Tokens { ids, images: Vec::new() },
    };
    let stream = request.options.stream;
    let include_usage = request.options.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let mut completion = request.options.completion(prompt)?;
    // A raw completion is text to continue: it ends at its length, not at a turn's end.
    completion.max_tokens = completion.max_tokens.or(Some(16));
    let running = run::start(&shared, completion).await?;
    let id = new_id("cmpl-");
    let created = now_secs();
    if stream {
        let chunk = move |text: &str, finish: Option<&str>| {
            json!({ "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{ "index": 0, "text": text, "finish_reason": finish,
                                  "logprobs": null }] })
        };
        return Ok(sse(stream_of(running, move |step| match step {
            Step::Start => Vec::new(),
            Step::Text(text) => vec![chunk(&text, None)],
            Step::Done(outcome) => {
                let mut last = chunk("", Some(finish_reason(outcome.stats.stop_reason)));
                if include_usage {
                    last["usage"] = usage(&outcome.stats);
                }
                vec![last]
            }
            Step::Failed(error) => vec![error.openai_body()],
        })));
    }
    let outcome = running.finish().await?;
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{ "index": 0, "text": outcome.text,
                      "finish_reason": finish_reason(outcome.stats.stop_reason),
                      "logprobs": null }],
        "usage": usage(&outcome.stats),
    }))
    .into_response())
}
