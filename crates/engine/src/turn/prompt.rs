//! A turn's prompt: its images prepared by the model's own preprocessor, the conversation
//! rendered and expanded into token ids, and the boundary the next turn will start from.

use std::path::PathBuf;

use mlx::Array;

use super::{ChatModel, Prompt, TurnMessage};
use crate::error::{Error, Result};
use crate::generate::image_runs;
use crate::models::Model;
use crate::tokenizer::{Content, Message, Part};
use crate::vision::PreparedImage;

/// Every image of the prompt, decoded and sized, in prompt order.
pub(super) fn prepare_images(
    model: &dyn Model,
    prompt: &Prompt,
    max_soft_tokens: usize,
) -> Result<Vec<PreparedImage>> {
    let paths: Vec<&PathBuf> = match prompt {
        Prompt::Messages(messages) => messages.iter().flat_map(|m| &m.images).collect(),
        Prompt::Tokens { images, .. } => images.iter().collect(),
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

/// The prompt's token ids, with the generation prompt when `open`.
pub(super) fn render(
    chat: &ChatModel,
    prompt: &Prompt,
    prepared: &[PreparedImage],
    open: bool,
) -> Result<Vec<u32>> {
    let messages = match prompt {
        Prompt::Tokens { ids, .. } => return Ok(ids.clone()),
        Prompt::Messages(messages) => messages,
    };
    let tokenizer = chat.tokenizer().ok_or_else(|| {
        Error::InvalidRequest(format!(
            "{} has no tokenizer.json: only token ids can be sent to it",
            chat.path().display()
        ))
    })?;
    if !tokenizer.has_chat_template() {
        let last = messages.last().map_or("", |m| m.text.as_str());
        return tokenizer.encode(last, true);
    }
    if prepared.is_empty() {
        return tokenizer.encode_chat(&template_messages(messages), open);
    }
    let vision = chat
        .model()
        .vision()
        .ok_or_else(|| Error::InvalidRequest("this model does not take images".into()))?;
    let counts: Vec<usize> = prepared.iter().map(|p| p.soft_tokens).collect();
    // The template writes its own BOS: no special tokens are added.
    let text = tokenizer.render(&template_messages(messages), open)?;
    match vision.expand_text(&text, &counts, tokenizer) {
        Some(expanded) => tokenizer.encode(&expanded?, false),
        None => vision.expand(&tokenizer.encode(&text, false)?, &counts),
    }
}

/// Messages as chat templates see them: each image a part before the text.
fn template_messages(messages: &[TurnMessage]) -> Vec<Message> {
    messages
        .iter()
        .map(|m| {
            if m.images.is_empty() {
                Message::text(&m.role, &m.text)
            } else {
                let mut parts = vec![Part::Image; m.images.len()];
                parts.push(Part::Text { text: m.text.clone() });
                Message { role: m.role.clone(), content: Content::Parts(parts) }
            }
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
) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Tokens { .. } => Ok(tokens.iter().chain(reply).copied().collect()),
        Prompt::Messages(messages) => {
            let mut turn = messages.clone();
            turn.push(TurnMessage::text("assistant", text));
            render(chat, &Prompt::Messages(turn), prepared, false)
        }
    }
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
