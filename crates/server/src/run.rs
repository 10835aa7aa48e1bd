//! One completion through the engine, for either API: started (waiting in line up to the
//! queue timeout), then streamed or collected.

use chat::{Completion, CompletionStream, ReplyEvent};
use engine::generate::StopReason;
use engine::turn::TurnOutcome;

use crate::Shared;
use crate::error::ApiError;

/// A completion that has begun to run (or ended at once).
#[derive(Debug)]
pub(crate) struct Running {
    stream: CompletionStream,
    /// The first event after any wait, not yet handed out.
    first: Option<ReplyEvent>,
}

/// Starts `completion`. A request that must wait for room waits up to the queue timeout, then
/// gets a 503; one the engine refuses before any text (a prompt over the context, a bad
/// image) gets its error here, before a stream's headers go out.
pub(crate) async fn start(shared: &Shared, completion: Completion) -> Result<Running, ApiError> {
    let mut stream = shared.chat.complete(completion).await.map_err(|e| ApiError::from_chat(&e))?;
    let mut event = stream.next().await;
    if let Some(ReplyEvent::Queued { reason }) = &event {
        let reason = reason.clone();
        event = match tokio::time::timeout(shared.queue_timeout, stream.next()).await {
            Ok(event) => event,
            Err(_) => {
                // Dropping the stream stops the waiting completion.
                return Err(ApiError::unavailable(format!(
                    "the server is busy and no room came within {} s ({reason}); try again",
                    shared.queue_timeout.as_secs()
                )));
            }
        };
    }
    match event {
        Some(ReplyEvent::Failed { message, kind }) => Err(ApiError::from_kind(kind, message)),
        Some(ReplyEvent::StoppedWaiting) | None => {
            Err(ApiError::unavailable("the completion was stopped before it ran"))
        }
        first => Ok(Running { stream, first }),
    }
}

impl Running {
    /// The next event: text, then `Done` or `Failed`; `None` after those.
    pub(crate) async fn next(&mut self) -> Option<ReplyEvent> {
        match self.first.take() {
            Some(event) => Some(event),
            None => self.stream.next().await,
        }
    }

    /// Runs to the end: the outcome (its text is the whole reply).
    pub(crate) async fn finish(mut self) -> Result<Box<TurnOutcome>, ApiError> {
        while let Some(event) = self.next().await {
            match event {
                ReplyEvent::Done(outcome) => return Ok(outcome),
                ReplyEvent::Failed { message, kind } => {
                    return Err(ApiError::from_kind(kind, message));
                }
                ReplyEvent::StoppedWaiting => {
                    return Err(ApiError::unavailable("the completion was stopped"));
                }
                ReplyEvent::Text { .. } | ReplyEvent::Queued { .. } | ReplyEvent::Admitted => {}
            }
        }
        Err(ApiError::from_kind(chat::view::ErrorKind::Internal, "the reply ended without an end"))
    }
}

/// OpenAI's `finish_reason` (a stop string ends a reply as a stop token does).
pub(crate) fn finish_reason(reason: StopReason) -> &'static str {
    match reason {
        StopReason::MaxTokens => "length",
        StopReason::StopToken | StopReason::Stopped => "stop",
    }
}

/// Seconds since the epoch, for the `created` fields.
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A fresh id with `prefix`: the time in microseconds and a counter.
pub(crate) fn new_id(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    format!("{prefix}{micros:x}{n:x}")
}

/// A seed for a request that names none (each such request samples differently).
pub(crate) fn random_seed() -> u64 {
    let mut bytes = [0u8; 8];
    if getrandom::fill(&mut bytes).is_err() {
        return std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    }
    u64::from_le_bytes(bytes)
}
