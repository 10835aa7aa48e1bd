//! Images for vision models: decoding with clear errors and bounded memory
//! ([`image::load_rgb`]), PIL-exact bicubic and bilinear resampling ([`image::resize_bicubic`], [`image::resize_bilinear`]), and the
//! [`Vision`] port a model with a vision tower offers: its own preprocessing, its image tokens
//! and its encoder.

pub mod image;

use ::image::RgbImage;
use mlx::Array;

use cache::Result;

/// Soft tokens in one image's features (`[n, hidden]`, or `[rows, cols, hidden]` on a grid).
pub fn soft_tokens(features: &Array) -> usize {
    let s = features.shape();
    s[..s.len().saturating_sub(1)].iter().map(|&d| d as usize).product()
}

/// An image ready for a vision tower.
#[derive(Debug)]
pub struct PreparedImage {
    /// `[3, H, W]` float32 in [0, 1], channel-first.
    pub pixels: Array,
    /// Resized height.
    pub height: u32,
    /// Resized width.
    pub width: u32,
    /// Soft tokens the image becomes in the prompt.
    pub soft_tokens: usize,
    /// The resized 8-bit image the pixels were made from.
    pub resized: RgbImage,
}

/// What a model with a vision tower offers front ends and the turn: how it sizes and encodes
/// an image, and how an image sits in its prompt.
pub trait Vision: std::fmt::Debug {
    /// Soft-token budgets per image it supports.
    fn budgets(&self) -> &[usize];
    /// Resizes and scales `image` the way the model's reference preprocessor does, for a budget
    /// of `max_soft_tokens` (one of [`Vision::budgets`]).
    fn prepare(&self, image: &RgbImage, max_soft_tokens: usize) -> Result<PreparedImage>;
    /// Soft-token features of one prepared image's pixels: `[n, hidden]`, or `[rows, cols,
    /// hidden]` for a model whose positions follow the image's grid (Qwen3.5's multimodal rope).
    fn encode(&self, pixels: &Array) -> Result<Array>;
    /// The token id image features replace in the prompt.
    fn image_token(&self) -> u32;
    /// The tokens an image of `soft_tokens` takes in a prompt (its markers and its image
    /// tokens), for prompts built without a chat template.
    fn image_block(&self, soft_tokens: usize) -> Vec<u32>;
    /// A rendered prompt with each image the chat template marked expanded into its block of
    /// `soft_tokens[i]` image tokens; an error when the template marked another number of
    /// images than were given.
    fn expand(&self, tokens: &[u32], soft_tokens: &[usize]) -> Result<Vec<u32>>;
    /// For a model whose processor writes the image block into the prompt's text (so that it
    /// merges with the text around it when tokenized), the rendered prompt `rendered` with
    /// each image the chat template marked expanded, its markers spelled as `token_text`
    /// (the tokenizer's text of one token id) spells them; `None` for a model that expands
    /// token ids ([`Vision::expand`]).
    fn expand_text(
        &self,
        rendered: &str,
        soft_tokens: &[usize],
        token_text: &dyn Fn(u32) -> Result<String>,
    ) -> Option<Result<String>> {
        let _ = (rendered, soft_tokens, token_text);
        None
    }
}

/// Runs of `image_token` in `tokens`, as `(start, length)`.
pub fn image_runs(tokens: &[u32], image_token: u32) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] == image_token {
            let start = i;
            while i < tokens.len() && tokens[i] == image_token {
                i += 1;
            }
            runs.push((start, i - start));
        } else {
            i += 1;
        }
    }
    runs
}
