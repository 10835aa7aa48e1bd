//! Tokenizers and chat templates: `tokenizer.json` through the `tokenizers` crate, the Jinja
//! chat template (from `chat_template.jinja` or `tokenizer_config.json`) through `minijinja`
//! with the helpers real templates use, stop tokens, and streaming detokenization with stop
//! strings.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value as JinjaValue, context};
use serde_json::Value;

use crate::checkpoint::read_json;
use crate::constrain::Vocabulary;
use crate::messages::Message;
use crate::tools::ToolSyntax;
use crate::{Error, Result};

/// Markers that end an assistant turn in common chat templates; the ones present in a
/// tokenizer's vocabulary become stop tokens.
const END_OF_TURN_MARKERS: &[&str] =
    &["<end_of_turn>", "<turn|>", "<|im_end|>", "<|eot_id|>", "<|end|>"];

fn template_of(dir: &Path, tokenizer_config: &Value) -> Result<Option<String>> {
    let template_file = dir.join("chat_template.jinja");
    if template_file.is_file() {
        return std::fs::read_to_string(&template_file)
            .map(Some)
            .map_err(|source| Error::Io { path: template_file, source });
    }
    Ok(match tokenizer_config.get("chat_template") {
        Some(Value::String(t)) => Some(t.clone()),
        // A list of named templates: take "default".
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    })
}

/// A tokenizer with its chat template and special tokens.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    file: std::path::PathBuf,
    template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    stop_tokens: Vec<u32>,
    /// How the model writes tool calls, decided from the template at load.
    tool_syntax: ToolSyntax,
    /// The vocabulary as the grammar engine reads it, built on first use.
    vocabulary: std::sync::OnceLock<std::result::Result<Vocabulary, String>>,
}

fn token_string(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn ids_of(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => {
            items.iter().filter_map(Value::as_u64).map(|v| v as u32).collect()
        }
        _ => Vec::new(),
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`,
    /// `generation_config.json` and `config.json` when present) from `dir`. `Ok(None)` when the
    /// directory has no `tokenizer.json` (test checkpoints often have none).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<Tokenizer>> {
        let dir = dir.as_ref();
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| Error::Config { file: "tokenizer.json".into(), message: e.to_string() })?;
        let optional = |name: &str| -> Result<Value> {
            let path = dir.join(name);
            if path.is_file() { read_json(&path) } else { Ok(Value::Null) }
        };
        let tokenizer_config = optional("tokenizer_config.json")?;
        let generation_config = optional("generation_config.json")?;
        let model_config = optional("config.json")?;
        let template = template_of(dir, &tokenizer_config)?;
        let bos_token = token_string(&tokenizer_config, "bos_token");
        let eos_token = token_string(&tokenizer_config, "eos_token");
        let mut stop_tokens = ids_of(generation_config.get("eos_token_id"));
        stop_tokens.extend(ids_of(model_config.get("eos_token_id")));
        stop_tokens
            .extend(ids_of(model_config.get("text_config").and_then(|t| t.get("eos_token_id"))));
        if let Some(eos) = &eos_token
            && let Some(id) = inner.token_to_id(eos)
        {
            stop_tokens.push(id);
        }
        for marker in END_OF_TURN_MARKERS {
            let in_template = template.as_deref().is_some_and(|t| t.contains(marker));
            if in_template && let Some(id) = inner.token_to_id(marker) {
                stop_tokens.push(id);
            }
        }
        stop_tokens.sort_unstable();
        stop_tokens.dedup();
        Ok(Some(Tokenizer {
            inner,
            file,
            tool_syntax: ToolSyntax::of_template(template.as_deref()),
            template,
            bos_token,
            eos_token,
            stop_tokens,
            vocabulary: Default::default(),
        }))
    }

    /// Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (BOS for Gemma).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::InvalidRequest(format!("tokenizing failed: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::InvalidRequest(format!("detokenizing failed: {e}")))
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Ids that end a reply: `eos_token_id` of the configs, the tokenizer's EOS, and the
    /// template's end-of-turn token.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// The vocabulary for constrained decoding (built on first use: a trie of every token's
    /// bytes).
    pub fn vocabulary(&self) -> Result<Vocabulary> {
        let built = self.vocabulary.get_or_init(|| {
            let json = read_json(&self.file).map_err(|e| e.to_string())?;
            // The end-of-turn marker first: what a finished grammar emits.
            let mut stops: Vec<u32> = END_OF_TURN_MARKERS
                .iter()
                .filter_map(|m| self.inner.token_to_id(m))
                .filter(|id| self.stop_tokens.contains(id))
                .collect();
            stops.extend(
                self.stop_tokens
                    .iter()
                    .filter(|id| !stops.contains(id))
                    .copied()
                    .collect::<Vec<_>>(),
            );
            Vocabulary::new(&json, self.inner.clone(), &stops).map_err(|e| e.to_string())
        });
        built.clone().map_err(|message| Error::Config { file: "tokenizer.json".into(), message })
    }

    /// Whether a chat template is available.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat template's source.
    pub fn template(&self) -> Option<&str> {
        self.template.as_deref()
    }

    /// Whether the chat template takes `enable_thinking` (Qwen's: thinking on or off).
    pub fn takes_thinking(&self) -> bool {
        self.template.as_deref().is_some_and(|t| t.contains("enable_thinking"))
    }

    /// Renders the chat template over `messages`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &TemplateOptions::default())
    }

    /// Whether the chat template renders tools itself (else they go in as a system prompt).
    pub fn renders_tools(&self) -> bool {
        crate::tools::renders_tools(self.template.as_deref())
    }

    /// How the model writes tool calls: its template's syntax, or Hermes where the template
    /// renders no tools (the system prompt [`crate::tools::fallback`] writes asks for it).
    pub fn tool_syntax(&self) -> ToolSyntax {
        self.tool_syntax
    }

    /// Renders the chat template over `messages` with `options`.
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        options: &TemplateOptions,
    ) -> Result<String> {
        let template = self
            .template
            .as_deref()
            .ok_or_else(|| Error::InvalidRequest("this tokenizer has no chat template".into()))?;
        let uses_tools = !options.tools.is_empty()
            || messages.iter().any(|m| !m.tool_calls.is_empty() || m.role == "tool");
        if uses_tools && !self.renders_tools() {
            let messages = crate::tools::fallback(messages.to_vec(), &options.tools);
            let options = TemplateOptions { tools: Vec::new(), ..options.clone() };
            return render_template(
                template,
                &messages,
                add_generation_prompt,
                self.bos_token.as_deref(),
                self.eos_token.as_deref(),
                &chrono::Local::now(),
                &options,
            );
        }
        render_template(
            template,
            messages,
            add_generation_prompt,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
            &chrono::Local::now(),
            options,
        )
    }

    /// Renders `messages` and tokenizes the result without adding special tokens (the template
    /// writes its own BOS).
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        options: &TemplateOptions,
    ) -> Result<Vec<u32>> {
        let text = self.render_with(messages, add_generation_prompt, options)?;
        self.encode(&text, false)
    }
}

/// What a chat template is rendered with besides the messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TemplateOptions {
    /// `enable_thinking` (Qwen's templates): `None` leaves it undefined, the template's
    /// default.
    pub enable_thinking: Option<bool>,
    /// The tools the model may call (OpenAI's `{"type": "function", "function": {...}}`):
    /// the template's `tools`, or a system prompt where the template has none
    /// ([`crate::tools::fallback`]).
    pub tools: Vec<Value>,
}

/// Renders a Hugging Face chat template the way `transformers` does (trim_blocks and
/// lstrip_blocks on, loop controls, `raise_exception`, `strftime_now`, `tojson`, Python string
/// methods). `now` is the clock `strftime_now` reads; `options` adds template variables.
pub fn render_template(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
    now: &chrono::DateTime<chrono::Local>,
    options: &TemplateOptions,
) -> Result<String> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_filter("tojson", python_tojson);
    let now = *now;
    env.add_function("strftime_now", move |format: String| -> String {
        now.format(&format).to_string()
    });
    let failed = |e: minijinja::Error| Error::InvalidRequest(format!("chat template: {e:#}"));
    env.add_template("chat", template).map_err(failed)?;
    let tmpl = env.get_template("chat").map_err(failed)?;
    let base = context! {
        messages => JinjaValue::from_serialize(messages),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token.unwrap_or_default(),
        eos_token => eos_token.unwrap_or_default(),
    };
    let base = match options.tools.is_empty() {
        true => base,
        false => context! { tools => JinjaValue::from_serialize(&options.tools), ..base },
    };
    let context = match options.enable_thinking {
        Some(thinking) => context! { enable_thinking => thinking, ..base },
        None => base,
    };
    tmpl.render(context).map_err(failed)
}

/// `tojson` as `transformers` defines it for chat templates: Python's `json.dumps` (keys in
/// their order, `", "` and `": "` between items, non-ASCII as is, `indent=` for a pretty
/// print), not minijinja's compact, HTML-escaped form.
fn python_tojson(
    value: &JinjaValue,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<JinjaValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&pad);
            serde::Serialize::serialize(
                value,
                &mut serde_json::Serializer::with_formatter(&mut out, formatter),
            )
        }
        None => serde::Serialize::serialize(
            value,
            &mut serde_json::Serializer::with_formatter(&mut out, PythonJson),
        ),
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let text = String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(JinjaValue::from_safe_string(text))
}

/// `json.dumps`'s default separators.
struct PythonJson;

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Turns a stream of token ids into text increments and watches for stop strings.
#[derive(Debug)]
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    emitted: usize,
    stop_strings: Vec<String>,
    text: String,
    /// Special tokens written into the text.
    keep: Vec<u32>,
    /// The stop string that ended the text.
    stopped_by: Option<String>,
}

impl<'a> TextStream<'a> {
    /// A stream that stops at any of `stop_strings`.
    pub fn new(tokenizer: &'a Tokenizer, stop_strings: Vec<String>) -> TextStream<'a> {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            emitted: 0,
            stop_strings,
            text: String::new(),
            keep: Vec::new(),
            stopped_by: None,
        }
    }

    /// The stop string that ended the text (the first to appear), if one did.
    pub fn stopped_by(&self) -> Option<&str> {
        self.stopped_by.as_deref()
    }

    /// Also writes these special tokens into the text (a model's tool-call markers, which
    /// the reply's reader needs to see); other special tokens stay out of it.
    pub fn keeping(mut self, special: Vec<u32>) -> TextStream<'a> {
        self.keep = special;
        self
    }

    /// The text of the ids so far: special tokens left out, but for those kept.
    fn decode(&self) -> Result<String> {
        if self.keep.is_empty() {
            return self.tokenizer.decode(&self.ids, true);
        }
        let mut text = String::new();
        for piece in self.ids.split_inclusive(|id| self.keep.contains(id)) {
            match piece.split_last() {
                Some((last, before)) if self.keep.contains(last) => {
                    text.push_str(&self.tokenizer.decode(before, true)?);
                    text.push_str(&self.tokenizer.decode(&[*last], false)?);
                }
                _ => text.push_str(&self.tokenizer.decode(piece, true)?),
            }
        }
        Ok(text)
    }

    /// Adds a token; returns the new text that is safe to show (held back while a multi-byte
    /// character or a possible stop string is incomplete) and whether a stop string appeared.
    pub fn push(&mut self, id: u32) -> Result<(String, bool)> {
        self.ids.push(id);
        let full = self.decode()?;
        let first = self
            .stop_strings
            .iter()
            .filter_map(|s| full.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            self.stopped_by = Some(stop.clone());
            let fresh = full.get(self.emitted..at).unwrap_or_default().to_string();
            self.emitted = at.max(self.emitted);
            self.text = full[..at].to_string();
            return Ok((fresh, true));
        }
        // Hold back an incomplete UTF-8 sequence (decoded as U+FFFD) and any suffix that could
        // still grow into a stop string.
        let mut safe = full.trim_end_matches('\u{FFFD}').len();
        for stop in &self.stop_strings {
            for k in (1..stop.len()).rev() {
                if stop.is_char_boundary(k) && full[..safe].ends_with(&stop[..k]) {
                    safe = safe.min(full.len() - k);
                    break;
                }
            }
        }
        let fresh =
            if safe > self.emitted { full[self.emitted..safe].to_string() } else { String::new() };
        self.emitted = self.emitted.max(safe);
        self.text = full;
        Ok((fresh, false))
    }

    /// The whole text so far (cut at a stop string once one appeared).
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{Content, Part};

    fn render(template: &str, messages: &[Message]) -> Result<String> {
        use chrono::TimeZone;
        let now = chrono::Local
            .with_ymd_and_hms(2026, 11, 30, 9, 5, 0)
            .single()
            .ok_or_else(|| Error::InvalidRequest("bad test date".into()))?;
        render_template(
            template,
            messages,
            true,
            Some("<s>"),
            Some("</s>"),
            &now,
            &TemplateOptions::default(),
        )
    }

    #[test]
    fn helpers_real_templates_use() {
        let messages = [
            Message::text("system", "  Be kind.  "),
            Message::text("user", "hi"),
            Message::text("assistant", "yo"),
        ];
        let template = concat!(
            "{{ bos_token }}{{ strftime_now('%Y-%m-%d') }}|",
            "{% for m in messages %}{% if m.role.startswith('sys') %}{{ m.content.strip() }}{% continue %}{% endif %}",
            "[{{ m.role.upper() }}:{{ m.content | tojson }}]{% if loop.last %}{% break %}{% endif %}{% endfor %}",
            "{% if add_generation_prompt %}>{% endif %}"
        );
        assert_eq!(
            render(template, &messages).unwrap(),
            "<s>2026-11-30|Be kind.[USER:\"hi\"][ASSISTANT:\"yo\"]>"
        );
    }

    #[test]
    fn raise_exception_is_an_error_with_its_message() {
        let err = render("{{ raise_exception('roles must alternate') }}", &[]).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        assert!(render("{% for %}", &[]).is_err(), "a broken template is an error, not a panic");
    }

    #[test]
    fn image_parts_reach_the_template() {
        let parts = Content::Parts(vec![Part::Image, Part::Text { text: "what?".into() }]);
        let template = "{% for p in messages[0].content %}{% if p.type == 'image' %}<img>{% else %}{{ p.text }}{% endif %}{% endfor %}";
        assert_eq!(render(template, &[Message::with("user", parts)]).unwrap(), "<img>what?");
    }
}
