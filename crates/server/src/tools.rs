//! Tools and output formats, for both APIs: the request's tools checked and rendered, a call
//! the reply must make turned into a grammar, the calls read from the reply as it streams.

use chat::Completion;
use engine::constrain::Constraint;
use engine::tools::{ToolCall, ToolCallParser, ToolEvent, ToolSyntax};
use serde_json::{Value, json};

use crate::Shared;
use crate::error::ApiError;

/// Whether and which tool the reply calls.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Choice {
    /// Tools are not offered.
    None,
    /// The model decides.
    Auto,
    /// It must call one.
    Required,
    /// It must call this one.
    Named(String),
}

/// The tools of a request, as OpenAI's function definitions, checked: each has a name.
pub(crate) fn checked(tools: Vec<Value>) -> Result<Vec<Value>, ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function");
        let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
        if tool.get("type").and_then(Value::as_str) != Some("function") || name.is_none() {
            return Err(ApiError::invalid(format!(
                "tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
            )));
        }
        let parameters = function.and_then(|f| f.get("parameters"));
        if parameters.is_some_and(|p| !p.is_object()) {
            return Err(ApiError::invalid(format!(
                "tools[{i}].function.parameters is not an object"
            )));
        }
    }
    Ok(tools)
}

/// Offers `tools` to `completion` as `choice` says: rendered into the prompt, and for a call
/// the reply must make, a grammar in the model's own syntax it keeps to. The parser of the reply's calls when tools
/// are offered.
pub(crate) fn offer(
    shared: &Shared,
    completion: &mut Completion,
    tools: Vec<Value>,
    choice: Choice,
) -> Result<Calls, ApiError> {
    if tools.is_empty() || choice == Choice::None {
        if matches!(choice, Choice::Required | Choice::Named(_)) {
            return Err(ApiError::invalid("tool_choice asks for a call but no tools are given"));
        }
        return Ok(Calls { parser: None, made: 0 });
    }
    let syntax = shared.chat.tool_syntax().unwrap_or(ToolSyntax::Hermes);
    let name = match &choice {
        Choice::Required => Some(None),
        Choice::Named(name) => Some(Some(name.as_str())),
        Choice::None | Choice::Auto => None,
    };
    if let Some(name) = name {
        if completion.constraint.is_some() {
            return Err(ApiError::invalid(
                "a response format and a required tool call cannot be asked for together",
            ));
        }
        completion.constraint = Some(Constraint::ToolCall { name: name.map(str::to_string) });
    }
    completion.tools = tools.clone();
    Ok(Calls { parser: Some(ToolCallParser::new(syntax, tools)), made: 0 })
}

/// The calls read from a reply as it streams (none when no tools were offered: all text).
#[derive(Debug)]
pub(crate) struct Calls {
    parser: Option<ToolCallParser>,
    made: usize,
}

impl Calls {
    /// What the reply's next piece of text holds.
    pub(crate) fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let events = match &mut self.parser {
            Some(parser) => parser.push(text),
            None => vec![ToolEvent::Text(text.to_string())],
        };
        self.count(events)
    }

    /// What was held back, at the reply's end.
    pub(crate) fn finish(&mut self) -> Vec<ToolEvent> {
        let events = self.parser.take().map(ToolCallParser::finish).unwrap_or_default();
        self.count(events)
    }

    /// How many calls were read.
    pub(crate) fn made(&self) -> usize {
        self.made
    }

    fn count(&mut self, events: Vec<ToolEvent>) -> Vec<ToolEvent> {
        self.made += events.iter().filter(|e| matches!(e, ToolEvent::Call(_))).count();
        events.into_iter().filter(|e| !matches!(e, ToolEvent::Text(t) if t.is_empty())).collect()
    }

    /// A whole reply: its text outside calls, and its calls.
    pub(crate) fn read(mut self, text: &str) -> (String, Vec<ToolCall>) {
        let mut events = self.push(text);
        events.extend(self.finish());
        let mut content = String::new();
        let mut calls = Vec::new();
        for event in events {
            match event {
                ToolEvent::Text(t) => content.push_str(&t),
                ToolEvent::Call(call) => calls.push(call),
            }
        }
        (content, calls)
    }
}

/// A call in the shape templates read (OpenAI's, arguments an object).
pub(crate) fn template_call(id: &str, name: &str, arguments: Value) -> Value {
    json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } })
}

/// `response_format` (OpenAI): the constraint it asks for. The JSON is compact (no
/// whitespace between tokens; a schema's own `x-guidance` options say otherwise), so a reply
/// cannot spend its tokens on blank lines.
pub(crate) fn response_format(format: Option<Value>) -> Result<Option<Constraint>, ApiError> {
    let Some(format) = format else { return Ok(None) };
    let compact = |schema: Value| Some(Constraint::JsonSchema(engine::constrain::compact(schema)));
    match format.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(compact(json!({ "type": "object" }))),
        Some("json_schema") => match format.pointer("/json_schema/schema") {
            Some(schema) if schema.is_object() => Ok(compact(schema.clone())),
            _ => Err(ApiError::invalid(
                "response_format json_schema needs json_schema.schema, a JSON schema object",
            )),
        },
        Some(other) => Err(ApiError::invalid(format!(
            "response_format type {other:?} is not text, json_object or json_schema"
        ))),
    }
}
