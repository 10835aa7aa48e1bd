//! Gemma 3's images as the [`Vision`] port: the preprocessing of its Hugging Face processor
//! as mlx-vlm 0.7.10 runs it (`Gemma3ImageProcessor`: a square PIL bilinear resize to
//! `image_size`, values scaled to [0, 1]; the tower maps them to [−1, 1]), a fixed number of
//! soft tokens per image, and the image block `"\n\n" boi image×n eoi "\n\n"`, which
//! `Gemma3Processor` writes into the prompt's text (its newlines merge with the text around it
//! when tokenized).

use ::image::RgbImage;
use mlx::Array;
use serde_json::Value;

use super::vision::Gemma3Vision;
use crate::gemma4::processor::{expand_image_tokens, image_block};
use crate::vision::image::resize_bilinear;
use crate::vision::{PreparedImage, Vision};
use cache::{Error, Result};

/// The tower with the checkpoint's image token ids.
#[derive(Debug)]
pub struct Gemma3Images {
    tower: Gemma3Vision,
    budgets: [usize; 1],
    image: u32,
    boi: u32,
    eoi: u32,
}

impl Gemma3Images {
    /// The tower, with the ids the top-level config names (`image_token_index`,
    /// `boi_token_index`, `eoi_token_index`; Gemma 3's ids where absent).
    pub fn new(tower: Gemma3Vision, config: &Value) -> Gemma3Images {
        let id = |key: &str, default: u32| {
            config.get(key).and_then(Value::as_u64).map_or(default, |v| v as u32)
        };
        Gemma3Images {
            budgets: [tower.tokens()],
            tower,
            image: id("image_token_index", 262_144),
            boi: id("boi_token_index", 255_999),
            eoi: id("eoi_token_index", 256_000),
        }
    }

    /// Resizes and scales `image` as the reference preprocessor does.
    pub fn preprocess(&self, image: &RgbImage) -> Result<PreparedImage> {
        let side = self.tower.image_size();
        let resized = resize_bilinear(image, side, side);
        let hwc = Array::from_slice(resized.as_raw(), &[side as i32, side as i32, 3])?;
        let pixels = hwc
            .astype(mlx::Dtype::Float32)?
            .divide(&Array::scalar(255.0f32)?)?
            .transpose(&[2, 0, 1])?;
        Ok(PreparedImage {
            pixels,
            height: side,
            width: side,
            soft_tokens: self.tower.tokens(),
            resized,
        })
    }

    /// The tower and projector.
    pub fn tower(&self) -> &Gemma3Vision {
        &self.tower
    }
}

/// `rendered` with each `boi` replaced by the image block of `soft_tokens[i]` image tokens,
/// as `Gemma3Processor` rewrites the prompt's text; an error when the template marked another
/// number of images than were given.
pub fn expand_text(
    rendered: &str,
    [boi, image, eoi]: [&str; 3],
    soft_tokens: &[usize],
) -> Result<String> {
    let pieces: Vec<&str> = rendered.split(boi).collect();
    if pieces.len() - 1 != soft_tokens.len() {
        return Err(Error::InvalidRequest(format!(
            "{} images were given but the chat template placed {}",
            soft_tokens.len(),
            pieces.len() - 1
        )));
    }
    let mut out = String::with_capacity(rendered.len() + soft_tokens.iter().sum::<usize>() * 20);
    out.push_str(pieces[0]);
    for (piece, &n) in pieces[1..].iter().zip(soft_tokens) {
        out.push_str("\n\n");
        out.push_str(boi);
        out.push_str(&image.repeat(n));
        out.push_str(eoi);
        out.push_str("\n\n");
        out.push_str(piece);
    }
    Ok(out)
}

impl Vision for Gemma3Images {
    fn budgets(&self) -> &[usize] {
        &self.budgets
    }

    /// Gemma 3 has one image size: the budget does not apply.
    fn prepare(&self, image: &RgbImage, _max_soft_tokens: usize) -> Result<PreparedImage> {
        self.preprocess(image)
    }

    fn encode(&self, pixels: &Array) -> Result<Array> {
        self.tower.encode(pixels)
    }

    fn image_token(&self) -> u32 {
        self.image
    }

    fn image_block(&self, soft_tokens: usize) -> Vec<u32> {
        image_block(self.image, self.boi, self.eoi, soft_tokens)
    }

    fn expand(&self, tokens: &[u32], soft_tokens: &[usize]) -> Result<Vec<u32>> {
        expand_image_tokens(tokens, self.image, self.boi, self.eoi, soft_tokens)
    }

    fn expand_text(
        &self,
        rendered: &str,
        soft_tokens: &[usize],
        token_text: &dyn Fn(u32) -> Result<String>,
    ) -> Option<Result<String>> {
        let name = |id: u32| -> Result<String> {
            let text = token_text(id)?;
            if text.is_empty() {
                return Err(Error::InvalidRequest(format!(
                    "the tokenizer has no text for image token id {id}"
                )));
            }
            Ok(text)
        };
        let names = (|| Ok::<_, Error>([name(self.boi)?, name(self.image)?, name(self.eoi)?]))();
        Some(
            names.and_then(|[boi, image, eoi]| {
                expand_text(rendered, [&boi, &image, &eoi], soft_tokens)
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_begin_of_image_becomes_its_block_with_newlines() {
        let out = expand_text("<t>user\n<B>hi<B>", ["<B>", "<I>", "<E>"], &[2, 1]).unwrap();
        assert_eq!(out, "<t>user\n\n\n<B><I><I><E>\n\nhi\n\n<B><I><E>\n\n");
        assert!(expand_text("<B>", ["<B>", "<I>", "<E>"], &[]).is_err(), "a slot, no image");
        assert!(expand_text("x", ["<B>", "<I>", "<E>"], &[1]).is_err(), "an image, no slot");
    }
}
