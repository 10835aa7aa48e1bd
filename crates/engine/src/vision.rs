//! Images for vision models: decoding with clear errors and bounded memory
//! ([`image::load_rgb`]), PIL-exact bicubic resampling ([`image::resize_bicubic`]) and Gemma 4's
//! preprocessing ([`gemma4::preprocess`]).

pub mod gemma4;
pub mod image;
