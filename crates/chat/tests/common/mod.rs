//! What the chat tests share.

use std::sync::{Arc, Mutex};

use chat::view::StreamEvent;

/// What several replies streamed, in order, as (conversation, `text` | `queued` | `done` |
/// `other`).
#[derive(Clone, Default)]
pub struct StreamLog(Arc<Mutex<Vec<(i64, &'static str)>>>);

impl StreamLog {
    /// A stream callback recording conversation `c`'s events.
    pub fn recorder(&self, c: i64) -> impl FnMut(StreamEvent) + Send + 'static {
        let log = self.0.clone();
        move |e: StreamEvent| {
            let kind = match e {
                StreamEvent::Text { .. } => "text",
                StreamEvent::Done { .. } => "done",
                StreamEvent::Queued { .. } => "queued",
                _ => "other",
            };
            log.lock().unwrap().push((c, kind));
        }
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<(i64, &'static str)> {
        self.0.lock().unwrap().clone()
    }
}
