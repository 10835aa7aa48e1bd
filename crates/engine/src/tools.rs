//! Tool calls: how a model's chat template writes them, how a reply's calls are found while it
//! streams, and how tools reach a template that has no notion of them.
//!
//! Three syntaxes cover the families Quince runs:
//!
//! - **Hermes** (Qwen 3, and any template without tools of its own): a JSON object
//!   `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`;
//! - **Qwen XML** (Qwen3.5, Qwen3-Coder): `<tool_call><function=NAME><parameter=P>VALUE
//!   </parameter></function></tool_call>`, values typed by the tool's JSON schema;
//! - **Gemma 4**: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>`, bare keys and
//!   `<|"|>` as the string quote.
//!
//! The parsers follow mlx-lm's (`mlx_lm/tool_parsers/`: `json_tools`, `qwen3_coder`,
//! `gemma4`). A template that never mentions `tools` gets them as a system prompt in the
//! Hermes syntax, with earlier calls and their results written as text ([`fallback`]), the way
//! LM Studio's default tool prompt does.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::messages::{Content, Message, Part};

/// A call the model made: a function's name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments.
    pub arguments: Value,
}

/// How a chat template writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// JSON between `<tool_call>` and `</tool_call>`.
    Hermes,
    /// `<function=…>` and `<parameter=…>` blocks between `<tool_call>` and `</tool_call>`.
    QwenXml,
    /// `call:NAME{…}` between `<|tool_call>` and `<tool_call|>`.
    Gemma4,
}

/// Whether a chat template renders tools itself (else they reach it as a system prompt,
/// [`fallback`]).
pub fn renders_tools(template: Option<&str>) -> bool {
    template.is_some_and(|t| t.contains("tools"))
}

impl ToolSyntax {
    /// The syntax a model with chat template `template` writes calls in (Hermes when the
    /// template has none of its own: the one [`fallback`] asks for).
    pub fn of_template(template: Option<&str>) -> ToolSyntax {
        match template {
            Some(t) if renders_tools(template) && t.contains("<|tool_call>") => ToolSyntax::Gemma4,
            Some(t) if renders_tools(template) && t.contains("<function=") => ToolSyntax::QwenXml,
            _ => ToolSyntax::Hermes,
        }
    }

    /// The marker a call starts with.
    pub fn start(self) -> &'static str {
        match self {
            ToolSyntax::Gemma4 => "<|tool_call>",
            ToolSyntax::Hermes | ToolSyntax::QwenXml => "<tool_call>",
        }
    }

    /// The marker a call ends with.
    pub fn end(self) -> &'static str {
        match self {
            ToolSyntax::Gemma4 => "<tool_call|>",
            ToolSyntax::Hermes | ToolSyntax::QwenXml => "</tool_call>",
        }
    }

    /// The calls written between a start and an end marker; `tools` (OpenAI function
    /// definitions) type the Qwen XML values.
    pub fn parse(self, body: &str, tools: &[Value]) -> Result<Vec<ToolCall>, String> {
        match self {
            ToolSyntax::Hermes => parse_hermes(body),
            ToolSyntax::QwenXml => parse_qwen_xml(body, tools),
            ToolSyntax::Gemma4 => parse_gemma4(body),
        }
    }

    /// A call as this syntax writes it, markers included (what the model would have written).
    pub fn write(self, call: &ToolCall) -> String {
        match self {
            ToolSyntax::Hermes | ToolSyntax::QwenXml => format!(
                "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                Value::String(call.name.clone()),
                call.arguments
            ),
            ToolSyntax::Gemma4 => {
                format!(
                    "<|tool_call>call:{}{}<tool_call|>",
                    call.name,
                    gemma4_value(&call.arguments)
                )
            }
        }
    }
}

/// What [`ToolCallParser`] finds in a reply's text.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolEvent {
    /// Text outside calls.
    Text(String),
    /// A complete call.
    Call(ToolCall),
}

/// Finds tool calls in a reply as its text streams: text outside calls passes through (a
/// tail that may begin a start marker is held back), a call is reported once its end marker
/// arrives, and a block that does not parse is passed on as the text it was.
#[derive(Debug)]
pub struct ToolCallParser {
    syntax: ToolSyntax,
    tools: Vec<Value>,
    pending: String,
    inside: bool,
}

impl ToolCallParser {
    /// A parser for `syntax`; `tools` are the request's function definitions.
    pub fn new(syntax: ToolSyntax, tools: Vec<Value>) -> ToolCallParser {
        ToolCallParser { syntax, tools, pending: String::new(), inside: false }
    }

    /// Adds the reply's next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.pending.push_str(text);
        let mut events = Vec::new();
        loop {
            if self.inside {
                let Some(at) = self.pending.find(self.syntax.end()) else { break };
                let body = self.pending[..at].to_string();
                self.pending.drain(..at + self.syntax.end().len());
                self.inside = false;
                self.block(&body, true, &mut events);
            } else if let Some(at) = self.pending.find(self.syntax.start()) {
                text_event(&mut events, self.pending[..at].to_string());
                self.pending.drain(..at + self.syntax.start().len());
                self.inside = true;
            } else {
                let keep = partial_marker(&self.pending, self.syntax.start());
                let cut = self.pending.len() - keep;
                text_event(&mut events, self.pending[..cut].to_string());
                self.pending.drain(..cut);
                break;
            }
        }
        events
    }

    /// The end of the reply: a call cut off before its end marker still counts when it parses
    /// (a model may stop on the marker); anything else held back is text.
    pub fn finish(mut self) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        if self.inside {
            self.block(&rest, false, &mut events);
        } else {
            text_event(&mut events, rest);
        }
        events
    }

    fn block(&self, body: &str, closed: bool, events: &mut Vec<ToolEvent>) {
        match self.syntax.parse(body, &self.tools) {
            Ok(calls) if !calls.is_empty() => events.extend(calls.into_iter().map(ToolEvent::Call)),
            _ => {
                let end = if closed { self.syntax.end() } else { "" };
                text_event(events, format!("{}{body}{end}", self.syntax.start()));
            }
        }
    }
}

fn text_event(events: &mut Vec<ToolEvent>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Text(last)) = events.last_mut() {
        last.push_str(&text);
    } else {
        events.push(ToolEvent::Text(text));
    }
}

/// Bytes at the end of `text` that begin `marker` (held back until the next piece decides).
fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && marker.starts_with(&text[text.len() - k..])
        })
        .unwrap_or(0)
}

fn parse_hermes(body: &str) -> Result<Vec<ToolCall>, String> {
    let value: Value = serde_json::from_str(body.trim()).map_err(|e| e.to_string())?;
    let calls = match value {
        Value::Array(items) => items,
        one => vec![one],
    };
    calls
        .into_iter()
        .map(|call| {
            let name = call.get("name").and_then(Value::as_str).ok_or("a call without a name")?;
            let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
                Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| e.to_string())?,
                Some(v) => v.clone(),
                None => Value::Object(Map::new()),
            };
            Ok(ToolCall { name: name.to_string(), arguments })
        })
        .collect()
}

/// The JSON-schema type of parameter `param` of function `name` among `tools`.
fn parameter_type(tools: &[Value], name: &str, param: &str) -> Option<String> {
    tools
        .iter()
        .filter_map(|t| t.get("function").or(Some(t)))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|f| f.pointer(&format!("/parameters/properties/{param}/type")))
        .and_then(Value::as_str)
        .map(str::to_lowercase)
}

fn parse_qwen_xml(body: &str, tools: &[Value]) -> Result<Vec<ToolCall>, String> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("<function=") {
        let after = &rest[at + "<function=".len()..];
        let close = after.find('>').ok_or("a function tag without '>'")?;
        let name = after[..close].trim().to_string();
        let end = after.find("</function>").ok_or("a function without </function>")?;
        let mut params = &after[close + 1..end];
        let mut arguments = Map::new();
        while let Some(p) = params.find("<parameter=") {
            let after = &params[p + "<parameter=".len()..];
            let close = after.find('>').ok_or("a parameter tag without '>'")?;
            let key = after[..close].trim().to_string();
            let stop = after.find("</parameter>").ok_or("a parameter without </parameter>")?;
            let raw = after[close + 1..stop].strip_prefix('\n').unwrap_or(&after[close + 1..stop]);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            let value = typed_value(raw, parameter_type(tools, &name, &key).as_deref());
            arguments.insert(key, value);
            params = &after[stop + "</parameter>".len()..];
        }
        calls.push(ToolCall { name, arguments: Value::Object(arguments) });
        rest = &after[end + "</function>".len()..];
    }
    if calls.is_empty() {
        return Err("no <function=…> block".into());
    }
    Ok(calls)
}

/// A Qwen XML value as its schema type reads it (mlx-lm's `_convert_param_value`).
fn typed_value(raw: &str, kind: Option<&str>) -> Value {
    if raw.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    let as_json = || serde_json::from_str::<Value>(raw).ok();
    match kind {
        Some("string" | "str" | "text" | "varchar" | "char" | "enum") => Value::String(raw.into()),
        Some(k) if k.starts_with("int") || k.starts_with("num") || k.starts_with("float") => {
            as_json().filter(Value::is_number).unwrap_or_else(|| Value::String(raw.into()))
        }
        Some("boolean" | "bool") => Value::Bool(raw.trim().eq_ignore_ascii_case("true")),
        _ => as_json()
            .filter(|v| kind.is_some() || v.is_object() || v.is_array())
            .unwrap_or_else(|| Value::String(raw.into())),
    }
}

/// Gemma 4's string quote in call arguments.
pub const GEMMA4_QUOTE: &str = "<|\"|>";

fn parse_gemma4(body: &str) -> Result<Vec<ToolCall>, String> {
    let body = body.trim();
    let rest = body.strip_prefix("call:").ok_or("a call without 'call:'")?;
    let brace = rest.find('{').ok_or("a call without arguments")?;
    let name = rest[..brace].trim();
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_' || c == '-') {
        return Err(format!("a bad function name {name:?}"));
    }
    let arguments = serde_json::from_str(&gemma4_to_json(&rest[brace..])?)
        .map_err(|e| format!("arguments: {e}"))?;
    Ok(vec![ToolCall { name: name.to_string(), arguments }])
}

/// Gemma 4's argument notation as JSON: `<|"|>`-quoted strings become JSON strings and bare
/// keys are quoted.
fn gemma4_to_json(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len() + 16);
    let mut rest = text;
    let mut after_open = false; // after '{' or ',' (where a bare key may start)
    while let Some(c) = rest.chars().next() {
        if let Some(inner) = rest.strip_prefix(GEMMA4_QUOTE) {
            let close = inner.find(GEMMA4_QUOTE).ok_or("an unterminated string")?;
            out.push_str(&Value::String(inner[..close].to_string()).to_string());
            rest = &inner[close + GEMMA4_QUOTE.len()..];
            after_open = false;
            continue;
        }
        if after_open && (c.is_alphabetic() || c == '_') {
            let len =
                rest.find(|ch: char| !(ch.is_alphanumeric() || ch == '_')).unwrap_or(rest.len());
            if rest[len..].trim_start().starts_with(':') {
                out.push_str(&Value::String(rest[..len].to_string()).to_string());
                rest = &rest[len..];
                after_open = false;
                continue;
            }
        }
        if !c.is_whitespace() {
            after_open = c == '{' || c == ',';
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    Ok(out)
}

/// A JSON value in Gemma 4's argument notation.
fn gemma4_value(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{GEMMA4_QUOTE}{s}{GEMMA4_QUOTE}"),
        Value::Array(items) => {
            format!("[{}]", items.iter().map(gemma4_value).collect::<Vec<_>>().join(","))
        }
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{k}:{}", gemma4_value(v)))
                .collect::<Vec<_>>()
                .join(",")
        ),
        other => other.to_string(),
    }
}

/// The functions of `tools` a call may go to (only `name` when given): each name with its
/// parameters' schema.
fn callable<'t>(tools: &'t [Value], name: Option<&str>) -> Result<Vec<(&'t str, Value)>, String> {
    let mut out = Vec::new();
    for tool in tools {
        let function = tool.get("function").unwrap_or(tool);
        let Some(tool_name) = function.get("name").and_then(Value::as_str) else { continue };
        if name.is_some_and(|n| n != tool_name) {
            continue;
        }
        let parameters =
            function.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}));
        out.push((tool_name, parameters));
    }
    if out.is_empty() {
        return Err(match name {
            Some(n) => format!("no tool is named {n:?}"),
            None => "no tools to call".into(),
        });
    }
    Ok(out)
}

/// A Lark string literal of `text`.
fn literal(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

impl ToolSyntax {
    /// The grammar (llguidance's Lark) of one call in this syntax to one of `tools` (only
    /// `name` when given), its arguments valid under the tool's schema: what a reply that must
    /// call a tool keeps to. `token` gives the id of a marker that is one token of the
    /// vocabulary (written as that token, as the model would write it, not spelled out).
    ///
    /// Hermes arguments are the schema's JSON. Qwen XML and Gemma 4 write each parameter on
    /// its own: a string as raw text (without `<` or, in Qwen XML, a line break, so the
    /// closing tag ends it), an enum as one of its values, anything else as its JSON; their
    /// calls give every required parameter (Gemma 4's leaves the optional ones out).
    pub fn call_grammar(
        self,
        tools: &[Value],
        name: Option<&str>,
        token: impl Fn(&str) -> Option<u32>,
    ) -> Result<String, String> {
        let functions = callable(tools, name)?;
        let mark = |m: &str| token(m).map_or_else(|| literal(m), |id| format!("<[{id}]>"));
        let (start, end) = (mark(self.start()), mark(self.end()));
        let mut rules = Vec::new();
        let choices: Vec<String> = (0..functions.len()).map(|i| format!("f{i}")).collect();
        match self {
            ToolSyntax::Hermes => {
                let schemas: Vec<Value> = functions
                    .iter()
                    .map(|(tool_name, parameters)| {
                        json!({
                            "type": "object",
                            "properties": {
                                "name": { "const": tool_name },
                                "arguments": parameters,
                            },
                            "required": ["name", "arguments"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let schema = crate::constrain::compact(json!({ "anyOf": schemas }));
                rules.push(format!("start: {start} \"\\n\" call \"\\n\" {end}"));
                rules.push(format!("call: %json {schema}"));
            }
            ToolSyntax::QwenXml => {
                rules.push(format!(
                    "start: {start} \"\\n\" ({}) \"</function>\\n\" {end}",
                    choices.join(" | ")
                ));
                for (i, (tool_name, parameters)) in functions.iter().enumerate() {
                    let mut body = vec![literal(&format!("<function={tool_name}>\n"))];
                    for (j, (key, schema, required)) in
                        parameter_list(parameters).into_iter().enumerate()
                    {
                        let value = value_rule(&schema, "[^<\\n]", "");
                        rules.push(format!("f{i}_v{j}: {value}"));
                        let item = format!(
                            "{} f{i}_v{j} {}",
                            literal(&format!("<parameter={key}>\n")),
                            literal("\n</parameter>\n")
                        );
                        body.push(if required { item } else { format!("({item})?") });
                    }
                    rules.push(format!("f{i}: {}", body.join(" ")));
                }
            }
            ToolSyntax::Gemma4 => {
                let quote = mark(GEMMA4_QUOTE);
                rules.push(format!("start: {start} \"call:\" ({}) {end}", choices.join(" | ")));
                for (i, (tool_name, parameters)) in functions.iter().enumerate() {
                    let mut items = Vec::new();
                    let required =
                        parameter_list(parameters).into_iter().filter(|(_, _, required)| *required);
                    for (j, (key, schema, _)) in required.enumerate() {
                        let value = value_rule(&schema, "[^<]", &quote);
                        rules.push(format!("f{i}_v{j}: {value}"));
                        items.push(format!("{} f{i}_v{j}", literal(&format!("{key}:"))));
                    }
                    let args = if items.is_empty() {
                        literal("{}")
                    } else {
                        format!("\"{{\" {} \"}}\"", items.join(" \",\" "))
                    };
                    rules.push(format!("f{i}: {} {args}", literal(tool_name)));
                }
            }
        }
        Ok(rules.join("\n") + "\n")
    }
}

/// A schema's properties in order: name, schema, whether required.
fn parameter_list(parameters: &Value) -> Vec<(String, Value, bool)> {
    let required: Vec<&str> = parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    parameters
        .get("properties")
        .and_then(Value::as_object)
        .map(|props| {
            props
                .iter()
                .map(|(k, v)| (k.clone(), v.clone(), required.contains(&k.as_str())))
                .collect()
        })
        .unwrap_or_default()
}

/// The grammar of one parameter's value written on its own: an enum as one of its values
/// (strings raw, between `quote`s), a string as characters of the regex class `chars`
/// (up to its `maxLength`) between `quote`s, anything else as its JSON.
fn value_rule(schema: &Value, chars: &str, quote: &str) -> String {
    let quoted = |inner: String| format!("{quote} {inner} {quote}").trim().to_string();
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        let choices: Vec<String> = values
            .iter()
            .map(|v| match v {
                Value::String(s) => quoted(literal(s)),
                other => literal(&other.to_string()),
            })
            .collect();
        return format!("({})", choices.join(" | "));
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("string") => match schema.get("maxLength").and_then(Value::as_u64) {
            Some(most) => quoted(format!("/{chars}{{0,{most}}}/")),
            None => quoted(format!("/{chars}*/")),
        },
        _ => format!("%json {}", crate::constrain::compact(schema.clone())),
    }
}

/// The system prompt that offers `tools` to a model whose template has none of its own
/// (modelled on the text Qwen 3's template writes, compact).
fn fallback_prompt(tools: &[Value]) -> String {
    let mut text = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools {
        text.push('\n');
        text.push_str(&tool.to_string());
    }
    text.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    text
}

/// Messages for a template without tools: the tools as a system prompt (before the first
/// system message's text), each call written into its assistant message in the Hermes syntax,
/// and tool results as a user message of `<tool_response>` blocks (merged with the user
/// messages beside them, so roles still alternate).
pub fn fallback(messages: Vec<Message>, tools: &[Value]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    if !tools.is_empty() {
        out.push(Message::text("system", &fallback_prompt(tools)));
    }
    for mut message in messages {
        let calls = std::mem::take(&mut message.tool_calls);
        message.tool_call_id = None;
        if message.role == "tool" {
            let text = format!("<tool_response>\n{}\n</tool_response>", content_text(&message));
            message = Message::text("user", &text);
        }
        for call in &calls {
            let call = ToolCall {
                name: call
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .into(),
                arguments: call.pointer("/function/arguments").cloned().unwrap_or(Value::Null),
            };
            append_text(&mut message, &format!("\n{}", ToolSyntax::Hermes.write(&call)));
        }
        match out.last_mut() {
            Some(last)
                if last.role == message.role && matches!(last.role.as_str(), "user" | "system") =>
            {
                let text = content_text(&message);
                append_text(last, &format!("\n\n{text}"));
                if let Content::Parts(parts) = message.content {
                    // Images stay with their text, ahead of it.
                    let images = parts.into_iter().filter(|p| matches!(p, Part::Image));
                    if let Content::Parts(own) = &mut last.content {
                        own.extend(images);
                    }
                }
            }
            _ => out.push(message),
        }
    }
    out
}

fn content_text(message: &Message) -> String {
    match &message.content {
        Content::Text(t) => t.clone(),
        Content::Parts(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Part::Text { text } => Some(text.as_str()),
                Part::Image => None,
            })
            .collect::<Vec<_>>()
            .join(""),
    }
}

fn append_text(message: &mut Message, text: &str) {
    match &mut message.content {
        Content::Text(t) => t.push_str(text),
        Content::Parts(parts) => match parts.iter_mut().rev().find_map(|p| match p {
            Part::Text { text } => Some(text),
            Part::Image => None,
        }) {
            Some(last) => last.push_str(text),
            None => parts.push(Part::Text { text: text.trim_start().to_string() }),
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn run(syntax: ToolSyntax, pieces: &[&str], tools: &[Value]) -> Vec<ToolEvent> {
        let mut parser = ToolCallParser::new(syntax, tools.to_vec());
        let mut events = Vec::new();
        for piece in pieces {
            for e in parser.push(piece) {
                text_or_call(&mut events, e);
            }
        }
        for e in parser.finish() {
            text_or_call(&mut events, e);
        }
        events
    }

    fn text_or_call(events: &mut Vec<ToolEvent>, e: ToolEvent) {
        match e {
            ToolEvent::Text(t) => text_event(events, t),
            call => events.push(call),
        }
    }

    fn call(name: &str, arguments: Value) -> ToolEvent {
        ToolEvent::Call(ToolCall { name: name.into(), arguments })
    }

    /// Streamed a character at a time or whole, each syntax gives the same text and calls.
    #[test]
    fn calls_are_found_whatever_the_pieces_the_text_streams_in() {
        let tools = [json!({"type": "function", "function": {"name": "weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}}}}})];
        let cases = [
            (
                ToolSyntax::Hermes,
                "Let me check. <tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>",
                vec![
                    ToolEvent::Text("Let me check. ".into()),
                    call("weather", json!({"city": "Oslo", "days": 2})),
                ],
            ),
            (
                ToolSyntax::QwenXml,
                "<tool_call>\n<function=weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call> done",
                vec![
                    call("weather", json!({"city": "New York", "days": 3, "metric": true})),
                    ToolEvent::Text(" done".into()),
                ],
            ),
            (
                ToolSyntax::Gemma4,
                "<|tool_call>call:weather{city:<|\"|>Rio, {Brazil}<|\"|>,days:4,opts:{metric:false,tags:[<|\"|>a<|\"|>]}}<tool_call|>",
                vec![call(
                    "weather",
                    json!({"city": "Rio, {Brazil}", "days": 4, "opts": {"metric": false, "tags": ["a"]}}),
                )],
            ),
        ];
        for (syntax, text, want) in cases {
            assert_eq!(run(syntax, &[text], &tools), want, "{syntax:?} whole");
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(run(syntax, &pieces, &tools), want, "{syntax:?} by characters");
        }
    }

    /// Text that only looks like the start of a marker, a block that does not parse, and a
    /// call cut off before its end marker.
    #[test]
    fn what_is_not_a_call_stays_text_and_a_call_cut_at_its_end_marker_counts() {
        let h = ToolSyntax::Hermes;
        assert_eq!(
            run(h, &["a <tool", "_x> b <"], &[]),
            vec![ToolEvent::Text("a <tool_x> b <".into())]
        );
        assert_eq!(
            run(h, &["<tool_call>not json</tool_call>!"], &[]),
            vec![ToolEvent::Text("<tool_call>not json</tool_call>!".into())]
        );
        assert_eq!(
            run(h, &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}"], &[]),
            vec![call("f", json!({"x": 1}))]
        );
        assert_eq!(
            run(h, &["<tool_call>{\"name\": "], &[]),
            vec![ToolEvent::Text("<tool_call>{\"name\": ".into())]
        );
    }

    /// What a call writes, each syntax parses back.
    #[test]
    fn a_written_call_parses_back() {
        let made = ToolCall {
            name: "f".into(),
            arguments: json!({"s": "x y", "n": 1.5, "l": [true, null]}),
        };
        for syntax in [ToolSyntax::Hermes, ToolSyntax::Gemma4] {
            let text = syntax.write(&made);
            assert_eq!(
                run(syntax, &[&text], &[]),
                vec![ToolEvent::Call(made.clone())],
                "{syntax:?}"
            );
        }
    }

    /// Without tools of its own a template gets them as a system prompt; calls and results
    /// become text, and a result beside a user message merges with it.
    #[test]
    fn a_template_without_tools_gets_them_as_text() {
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let mut assistant = Message::text("assistant", "Calling.");
        assistant.tool_calls = vec![
            json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}),
        ];
        let mut result = Message::text("tool", "42");
        result.tool_call_id = Some("c1".into());
        let messages = vec![
            Message::text("system", "Be brief."),
            Message::text("user", "Go"),
            assistant,
            result,
            Message::text("user", "Thanks"),
        ];
        let out = fallback(messages, &tools);
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        let text = |i: usize| content_text(&out[i]);
        assert!(
            text(0).starts_with("# Tools") && text(0).ends_with("\n\nBe brief."),
            "{}",
            text(0)
        );
        assert!(text(0).contains(r#"{"type":"function","function":{"name":"f"}}"#), "{}", text(0));
        assert_eq!(
            text(2),
            "Calling.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\":1}}\n</tool_call>"
        );
        assert_eq!(text(3), "<tool_response>\n42\n</tool_response>\n\nThanks");
        assert!(out.iter().all(|m| m.tool_calls.is_empty() && m.tool_call_id.is_none()));
    }

    #[test]
    fn the_syntax_comes_from_the_template() {
        assert_eq!(ToolSyntax::of_template(None), ToolSyntax::Hermes);
        let gemma4 = "{% if tools %}{{ '<|tool_call>' }}{% endif %}";
        assert_eq!(ToolSyntax::of_template(Some(gemma4)), ToolSyntax::Gemma4);
        assert_eq!(ToolSyntax::of_template(Some("tools <function=")), ToolSyntax::QwenXml);
        assert_eq!(ToolSyntax::of_template(Some("tools <tool_call>")), ToolSyntax::Hermes);
        // A template without tools gets the Hermes prompt, whatever else it holds.
        assert_eq!(ToolSyntax::of_template(Some("<|tool_call>")), ToolSyntax::Hermes);
    }
}
