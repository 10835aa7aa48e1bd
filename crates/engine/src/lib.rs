//! Quince's inference engine over MLX: model directories, the attention cache stack, models,
//! sampling and the generation loop. No Tauri, no SQL.
//!
//! The flow of one reply: [`checkpoint::ModelDir`] opens a checkpoint, a model
//! ([`models::gemma4::Gemma4Text`]) builds its layers from it, [`models::Model::new_caches`]
//! makes one cache per layer that stores keys and values, and [`generate::generate`] prefills
//! the prompt through window appends and decodes token by token, streaming each one; each
//! decode step runs as one compiled graph where the caches allow it ([`compiled`]).
//! [`speculative::generate`] does the same with a draft method, verifying drafts in windows
//! and rolling the caches back to what the target kept: the same tokens, in fewer passes.
//!
//! Start reading at [`cache`]: its traits carry the invariants the rest relies on (the phase
//! is the method name; caches own their attention reads; signatures are explicit).
//!
//! ```no_run
//! use engine::generate::{GenerateRequest, generate, Flow};
//! use engine::models::{Model, gemma4::Gemma4Text};
//! # fn main() -> engine::Result<()> {
//! let model = Gemma4Text::load("path/to/gemma-4-e2b-it-4bit")?;
//! let mut caches = model.new_caches()?;
//! let request = GenerateRequest::new(vec![2, 106, 1645], 32);
//! let reply = generate(&model, &mut caches, &request, |token| { println!("{token}"); Flow::Continue })?;
//! println!("{:?} after {} tokens", reply.stop_reason, reply.tokens.len());
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

pub mod cache;
pub mod checkpoint;
pub mod compiled;
pub mod demo;
mod error;
pub mod generate;
pub mod kv_file;
pub mod models;
pub mod nn;
pub mod sampling;
pub mod speculative;
pub mod tokenizer;
pub mod vision;

pub use error::{Error, Result};
