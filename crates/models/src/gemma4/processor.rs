//! Gemma 4's images: mlx-vlm 0.7.10's preprocessing (an aspect-preserving resize to the largest
//! size whose 48-px multiples fit the patch budget, PIL bicubic, values times `1/255` in float32; the
//! tower maps them to [−1, 1]), the image block `boi, image × n, eoi`, and the tower, as the
//! [`Vision`] port.

use ::image::RgbImage;
use mlx::Array;
use serde_json::Value;

use super::vision::Gemma4Vision;
use crate::vision::image::resize_bicubic;
use crate::vision::{PreparedImage, Vision};
use cache::{Error, Result};

/// Soft-token budgets Gemma 4 supports per image.
pub const SOFT_TOKEN_BUDGETS: [usize; 5] = [70, 140, 280, 560, 1120];

/// Patch side in pixels.
pub const PATCH: u32 = 16;
/// Pooling kernel side: 3×3 patches make one soft token.
pub const POOL: u32 = 3;

/// The resized size for an image of `width × height` under `max_soft_tokens`.
pub fn target_size(width: u32, height: u32, max_soft_tokens: usize) -> (u32, u32) {
    let side = PATCH * POOL; // 48
    let max_patches = (max_soft_tokens * (POOL * POOL) as usize) as f64;
    let (w, h) = (f64::from(width), f64::from(height));
    let factor = (max_patches * f64::from(PATCH * PATCH) / (h * w)).sqrt();
    let fit = |x: f64| ((factor * x / f64::from(side)).floor() as u32) * side;
    let (mut tw, mut th) = (fit(w), fit(h));
    // A side that rounds to nothing becomes one cell, and the other side follows the aspect
    // ratio in whole cells, capped at the budget (the reference's rule; the aspect ratio is
    // not kept there).
    let cap = max_soft_tokens as u32 * side;
    if th == 0 && tw == 0 {
        (tw, th) = (side, side);
    } else if th == 0 {
        th = side;
        tw = ((width / height.max(1)) * side).min(cap);
    } else if tw == 0 {
        tw = side;
        th = ((height / width.max(1)) * side).min(cap);
    }
    (tw, th)
}

/// Resizes and scales `image` for a budget of `max_soft_tokens` (one of
/// [`SOFT_TOKEN_BUDGETS`]), as mlx-vlm does.
pub fn preprocess(image: &RgbImage, max_soft_tokens: usize) -> Result<PreparedImage> {
    if !SOFT_TOKEN_BUDGETS.contains(&max_soft_tokens) {
        return Err(Error::InvalidRequest(format!(
            "max soft tokens must be one of {SOFT_TOKEN_BUDGETS:?}, got {max_soft_tokens}"
        )));
    }
    let (width, height) = target_size(image.width(), image.height(), max_soft_tokens);
    let resized = resize_bicubic(image, width, height);
    let pixels = rescale(&resized)?;
    let soft_tokens = ((height / (PATCH * POOL)) * (width / (PATCH * POOL))) as usize;
    Ok(PreparedImage { pixels, height, width, soft_tokens, resized })
}

/// HWC u8 → CHW f32 `[3, H, W]` as mlx-vlm's `Gemma4ImageProcessor` rescales:
/// `image.astype(float32) * (1 / 255)`, a float32 product. (A division by 255 differs in the
/// last bit for about half of the byte values, which a tower and a decoder amplify past 1e-4
/// in the logits.)
pub fn rescale(image: &RgbImage) -> Result<Array> {
    let (w, h) = (image.width() as i32, image.height() as i32);
    let hwc = Array::from_slice(image.as_raw(), &[h, w, 3])?;
    Ok(hwc
        .astype(mlx::Dtype::Float32)?
        .multiply(&Array::scalar(1.0f32 / 255.0)?)?
        .transpose(&[2, 0, 1])?)
}

/// Expands a rendered prompt for its images: after the i-th begin-of-image token `boi` (which
/// the chat template writes once per image part) come `image × counts[i]` and `eoi`. Errors
/// when the template placed a different number of images than were given.
pub fn expand_image_tokens(
    tokens: &[u32],
    image: u32,
    boi: u32,
    eoi: u32,
    counts: &[usize],
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(tokens.len() + counts.iter().sum::<usize>() + counts.len());
    let mut next = counts.iter();
    for &t in tokens {
        out.push(t);
        if t == boi {
            let Some(&n) = next.next() else {
                return Err(Error::InvalidRequest(
                    "the chat template placed more images than were given".into(),
                ));
            };
            out.extend(std::iter::repeat_n(image, n));
            out.push(eoi);
        }
    }
    if next.next().is_some() {
        return Err(Error::InvalidRequest(format!(
            "{} images were given but the chat template placed fewer (no begin-of-image token)",
            counts.len()
        )));
    }
    Ok(out)
}

/// The image block `boi, image × soft_tokens, eoi` (for prompts built without a template).
pub fn image_block(image: u32, boi: u32, eoi: u32, soft_tokens: usize) -> Vec<u32> {
    let mut block = vec![boi];
    block.extend(std::iter::repeat_n(image, soft_tokens));
    block.push(eoi);
    block
}

/// The vision tower with the checkpoint's image token ids.
#[derive(Debug)]
pub(crate) struct Gemma4Images {
    tower: Gemma4Vision,
    image: u32,
    boi: u32,
    eoi: u32,
}

impl Gemma4Images {
    /// The tower, with the ids the top-level config names (`image_token_id`, `boi_token_id`,
    /// `eoi_token_id`).
    pub(crate) fn new(tower: Gemma4Vision, config: &Value) -> Result<Gemma4Images> {
        let id = |key: &str| {
            config.get(key).and_then(Value::as_u64).map(|v| v as u32).ok_or_else(|| Error::Config {
                file: "config.json".into(),
                message: format!("a checkpoint with a vision tower needs `{key}`"),
            })
        };
        Ok(Gemma4Images {
            tower,
            image: id("image_token_id")?,
            boi: id("boi_token_id")?,
            eoi: id("eoi_token_id")?,
        })
    }
}

impl Vision for Gemma4Images {
    fn budgets(&self) -> &[usize] {
        &SOFT_TOKEN_BUDGETS
    }

    fn prepare(&self, image: &RgbImage, max_soft_tokens: usize) -> Result<PreparedImage> {
        preprocess(image, max_soft_tokens)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_sizes_follow_the_reference() {
        // engine.md §2.2: 640×480 at 280 → 912×672, 266 soft tokens.
        assert_eq!(target_size(640, 480, 280), (912, 672));
        // A side that rounds to nothing: one cell, the other capped at the budget.
        assert_eq!(target_size(4000, 20, 70), (3360, 48));
        assert_eq!(target_size(1, 1, 70), (384, 384));
    }

    #[test]
    fn image_tokens_expand_after_each_begin_of_image() {
        let out = expand_image_tokens(&[2, 7, 9, 8, 9, 3], 5, 9, 10, &[2, 1]).unwrap();
        assert_eq!(out, vec![2, 7, 9, 5, 5, 10, 8, 9, 5, 10, 3]);
        assert!(expand_image_tokens(&[2, 9, 9], 5, 9, 10, &[1]).is_err(), "two slots, one image");
        assert!(expand_image_tokens(&[2, 3], 5, 9, 10, &[1]).is_err(), "no slot for the image");
        assert_eq!(expand_image_tokens(&[2, 3], 5, 9, 10, &[]).unwrap(), vec![2, 3]);
    }
}
