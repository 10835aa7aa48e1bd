//! Qwen3.5's images as the [`Vision`] port: the preprocessing of mlx-vlm 0.7.10's
//! `Qwen3VLImageProcessor` (`smart_resize` to sides that are multiples of the patch side times
//! the merge size within a pixel budget, a PIL bicubic resize, values scaled by `1/255` and
//! normalized per channel), one soft token per merged block of patches, and the image block
//! `<|vision_start|> <|image_pad|>×n <|vision_end|>`, whose single pad the chat template writes
//! and the processor repeats.

use std::path::Path;

use ::image::RgbImage;
use mlx::Array;
use serde_json::Value;

use super::vision::QwenVision;
use crate::checkpoint::read_json;
use crate::gemma4::processor::SOFT_TOKEN_BUDGETS;
use crate::gemma4::processor::rescale;
use crate::vision::image::resize_bicubic;
use crate::vision::{PreparedImage, Vision};
use cache::{Error, Result};

/// What the checkpoint's `preprocessor_config.json` says (mlx-vlm's defaults where absent).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSettings {
    /// Fewest pixels an image is scaled up to.
    pub min_pixels: u64,
    /// Most pixels an image is scaled down to.
    pub max_pixels: u64,
    /// Per-channel mean and standard deviation of the normalization.
    pub mean: [f32; 3],
    /// See `mean`.
    pub std: [f32; 3],
}

impl ImageSettings {
    /// The settings in `dir`'s `preprocessor_config.json` (and `processor_config.json`'s
    /// `image_processor`), as mlx-vlm reads them.
    pub fn read(dir: &Path) -> Result<ImageSettings> {
        let mut raw = serde_json::Map::new();
        for (file, key) in
            [("preprocessor_config.json", None), ("processor_config.json", Some("image_processor"))]
        {
            let path = dir.join(file);
            if !path.exists() {
                continue;
            }
            let json = read_json(&path)?;
            let part = match key {
                Some(k) => json.get(k).cloned().unwrap_or(Value::Null),
                None => json,
            };
            if let Value::Object(map) = part {
                raw.extend(map);
            }
        }
        let number = |v: Option<&Value>| v.and_then(Value::as_u64);
        let size = raw.get("size");
        let mut settings = ImageSettings {
            min_pixels: 56 * 56,
            max_pixels: 14 * 14 * 4 * 1280,
            mean: [0.5; 3],
            std: [0.5; 3],
        };
        if let Some(v) = number(size.and_then(|s| s.get("shortest_edge"))) {
            settings.min_pixels = v;
        }
        if let Some(v) = number(size.and_then(|s| s.get("longest_edge"))) {
            settings.max_pixels = v;
        }
        if let Some(v) = number(raw.get("min_pixels")) {
            settings.min_pixels = v;
        }
        if let Some(v) = number(raw.get("max_pixels")) {
            settings.max_pixels = v;
        }
        let triple = |key: &str| -> Result<Option<[f32; 3]>> {
            let Some(v) = raw.get(key) else { return Ok(None) };
            let values: Vec<f32> = v
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_f64).map(|x| x as f32).collect())
                .unwrap_or_default();
            <[f32; 3]>::try_from(values).map(Some).map_err(|_| Error::Config {
                file: "preprocessor_config.json".into(),
                message: format!("`{key}` must be three numbers"),
            })
        };
        if let Some(mean) = triple("image_mean")? {
            settings.mean = mean;
        }
        if let Some(std) = triple("image_std")? {
            settings.std = std;
        }
        Ok(settings)
    }
}

/// `smart_resize` of Hugging Face's Qwen2-VL processor as mlx-vlm ports it: sides rounded to
/// multiples of `factor` (Python's `round`, half to even), then scaled down into `max_pixels`
/// or up to `min_pixels`, keeping the aspect. `(height, width)`.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32)> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if h.max(w) / h.min(w).max(1.0) > 200.0 {
        return Err(Error::InvalidRequest(format!(
            "the image is {width}×{height}: its aspect ratio must be under 200"
        )));
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// An image's tokens in a prompt: `start`, `image` × soft tokens, `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageTokens {
    /// The pad each soft token takes (`image_token_id`).
    pub image: u32,
    /// `vision_start_token_id`.
    pub start: u32,
    /// `vision_end_token_id`.
    pub end: u32,
}

impl ImageTokens {
    /// The block of an image of `soft_tokens`.
    pub fn block(&self, soft_tokens: usize) -> Vec<u32> {
        let mut block = vec![self.start];
        block.extend(std::iter::repeat_n(self.image, soft_tokens));
        block.push(self.end);
        block
    }

    /// `tokens` with the i-th pad the chat template wrote repeated `soft_tokens[i]` times; an
    /// error when it wrote another number of pads than images were given.
    pub fn expand(&self, tokens: &[u32], soft_tokens: &[usize]) -> Result<Vec<u32>> {
        let placed = tokens.iter().filter(|&&t| t == self.image).count();
        if placed != soft_tokens.len() {
            return Err(Error::InvalidRequest(format!(
                "{} images were given but the chat template placed {placed}",
                soft_tokens.len()
            )));
        }
        let mut out = Vec::with_capacity(tokens.len() + soft_tokens.iter().sum::<usize>());
        let mut next = soft_tokens.iter();
        for &t in tokens {
            match next.clone().next() {
                Some(&n) if t == self.image => {
                    next.next();
                    out.extend(std::iter::repeat_n(self.image, n));
                }
                _ => out.push(t),
            }
        }
        Ok(out)
    }
}

/// The tower with the checkpoint's image token ids and preprocessing settings.
#[derive(Debug)]
pub struct QwenImages {
    tower: QwenVision,
    settings: ImageSettings,
    tokens: ImageTokens,
}

impl QwenImages {
    /// The tower, with the ids the top-level config names (`image_token_id`,
    /// `vision_start_token_id`, `vision_end_token_id`; Qwen3.5's where absent).
    pub fn new(tower: QwenVision, settings: ImageSettings, config: &Value) -> QwenImages {
        let id = |key: &str, default: u32| {
            config.get(key).and_then(Value::as_u64).map_or(default, |v| v as u32)
        };
        QwenImages {
            tower,
            settings,
            tokens: ImageTokens {
                image: id("image_token_id", 248_056),
                start: id("vision_start_token_id", 248_045),
                end: id("vision_end_token_id", 248_046),
            },
        }
    }

    /// The tower.
    pub fn tower(&self) -> &QwenVision {
        &self.tower
    }

    /// Side of the pixel square one soft token covers.
    fn factor(&self) -> u32 {
        let c = self.tower.config();
        (c.patch_size * c.spatial_merge_size) as u32
    }

    /// Resizes and scales `image` for at most `max_pixels` (within the checkpoint's own
    /// bounds), as the reference processor does: pixels `[3, H, W]` in [0, 1].
    pub fn preprocess(&self, image: &RgbImage, max_pixels: u64) -> Result<PreparedImage> {
        let factor = self.factor();
        let (height, width) = smart_resize(
            image.height(),
            image.width(),
            factor,
            self.settings.min_pixels,
            max_pixels,
        )?;
        let resized = resize_bicubic(image, width, height);
        let pixels = rescale(&resized)?;
        let soft_tokens = ((height / factor) * (width / factor)) as usize;
        Ok(PreparedImage { pixels, height, width, soft_tokens, resized })
    }

    /// Pixels in [0, 1] normalized per channel: `(x − mean) / std`, in f32.
    pub fn normalize(&self, pixels: &Array) -> Result<Array> {
        let mean = Array::from_slice(&self.settings.mean, &[3, 1, 1])?;
        let std = Array::from_slice(&self.settings.std, &[3, 1, 1])?;
        Ok(pixels.subtract(&mean)?.divide(&std)?)
    }

    /// The processor's `pixel_values` rows of prepared pixels (`[gh·gw, C·T·P·P]`).
    pub fn patch_rows(&self, pixels: &Array) -> Result<Array> {
        self.tower.patches(&self.normalize(pixels)?)
    }
}

impl Vision for QwenImages {
    /// Qwen's processor sizes by pixels; a budget of soft tokens caps them (`n · factor²`).
    fn budgets(&self) -> &[usize] {
        &SOFT_TOKEN_BUDGETS
    }

    fn prepare(&self, image: &RgbImage, max_soft_tokens: usize) -> Result<PreparedImage> {
        if max_soft_tokens == 0 {
            return Err(Error::InvalidRequest("max soft tokens must be at least 1".into()));
        }
        let factor = u64::from(self.factor());
        let budget = (max_soft_tokens as u64) * factor * factor;
        self.preprocess(image, budget.min(self.settings.max_pixels))
    }

    fn encode(&self, pixels: &Array) -> Result<Array> {
        self.tower.encode(&self.normalize(pixels)?)
    }

    fn image_token(&self) -> u32 {
        self.tokens.image
    }

    fn image_block(&self, soft_tokens: usize) -> Vec<u32> {
        self.tokens.block(soft_tokens)
    }

    fn expand(&self, tokens: &[u32], soft_tokens: &[usize]) -> Result<Vec<u32>> {
        self.tokens.expand(tokens, soft_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_rounds_half_to_even_and_keeps_within_the_budget() {
        // 256 / 16 = 16, 200 / 16 = 12.5 → 12 (Python rounds half to even).
        assert_eq!(smart_resize(256, 200, 16, 1024, 71_680).unwrap(), (256, 192));
        // 480×640 over 16,384 pixels: β = √18.75, sides floor to 96 and 144.
        assert_eq!(smart_resize(480, 640, 16, 1024, 16_384).unwrap(), (96, 144));
        // Scaled up to the minimum.
        assert_eq!(smart_resize(10, 10, 16, 1024, 16_384).unwrap(), (32, 32));
        assert!(smart_resize(4000, 10, 16, 1024, 16_384).is_err(), "aspect over 200");
    }

    #[test]
    fn each_pad_the_template_writes_becomes_its_images_soft_tokens() {
        let images = ImageTokens { image: 9, start: 7, end: 8 };
        assert_eq!(
            images.expand(&[1, 7, 9, 8, 2, 7, 9, 8], &[2, 3]).unwrap(),
            [1, 7, 9, 9, 8, 2, 7, 9, 9, 9, 8]
        );
        assert!(images.expand(&[1, 7, 9, 8], &[2, 3]).is_err(), "two images, one slot");
        assert!(images.expand(&[7, 9, 8, 7, 9, 8], &[2]).is_err(), "one image, two slots");
        assert_eq!(images.block(3), [7, 9, 9, 9, 8]);
    }
}
