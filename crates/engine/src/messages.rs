//! A conversation's messages as chat templates read them (`{"role", "content"}`, with
//! OpenAI-shaped tool calls): what the tokenizer renders and the tool syntaxes write into.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// An image, placed where the template puts image parts.
    Image,
}

/// A chat message as templates see it: `{"role": ..., "content": ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// A string, or a list of parts when the message has images.
    pub content: Content,
    /// An assistant message's calls, OpenAI's shape
    /// (`{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments an
    /// object).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<Value>,
    /// A `tool` message's answer to the call of this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// Message content: plain text or typed parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Text and image parts in order.
    Parts(Vec<Part>),
}

impl Message {
    /// A text message.
    pub fn text(role: &str, text: &str) -> Message {
        Message::with(role, Content::Text(text.into()))
    }

    /// A message of `content`, without tool calls.
    pub fn with(role: &str, content: Content) -> Message {
        Message { role: role.into(), content, tool_calls: Vec::new(), tool_call_id: None }
    }
}
