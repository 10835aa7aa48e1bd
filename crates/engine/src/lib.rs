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
pub mod fused;
pub mod generate;
pub mod kv_file;
pub mod models;
pub mod nn;
pub mod sampling;
pub mod speculative;
pub mod tokenizer;
pub mod vision;

pub use error::{Error, Result};

/// Ops per CUDA graph Quince runs MLX-CUDA with (MLX's default on an H200 is 30).
pub const CUDA_GRAPH_OPS: u32 = 100;

/// Applies the MLX settings Quince runs with, each only where the environment does not set it
/// already: call at the start of `main`, before any MLX op. Today one: [`CUDA_GRAPH_OPS`]
/// (a decode step is a couple of thousand small ops, and on CUDA their batching into graphs is
/// host time per token; A/B figures in the README).
/// Returns the variables it set, so that a child process meant to run MLX as shipped (the
/// reference in `quince bench --compare`) can drop them.
pub fn configure_mlx() -> Result<Vec<&'static str>> {
    let mut set = Vec::new();
    if mlx::device::default_cuda_graph_ops(CUDA_GRAPH_OPS)? {
        set.push(mlx::device::CUDA_GRAPH_OPS_VAR);
    }
    Ok(set)
}
