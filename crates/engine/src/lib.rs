//! Quince's inference engine over MLX: the one decode path (every reply a row of a batch,
//! drafting or not), the turn API, sampling and constrained decoding, tokenizers and chat
//! templates, tools. No Tauri, no SQL. It runs on two crates below it, re-exported here under
//! the paths the engine has always given them: `cache` (the cache stack, KV checkpoint files,
//! the op routes: [`cache`], [`backend`], [`kv_file`], …) and `models` (checkpoints, the
//! `Model` trait, the families, the registry: [`models`], [`registry`], [`checkpoint`], …).
//!
//! # The flow of one reply
//!
//! 1. [`registry::load_model`] reads a checkpoint's `config.json` ([`checkpoint::ModelDir`]),
//!    finds its family by `model_type` and loads it with [`LoadOptions`]: the kernels its
//!    passes run ([`backend::Ops`]), stacked projections, compiled decode. A
//!    [`turn::ChatModel`] pairs the model with its tokenizer.
//! 2. [`turn::ChatModel::answer`] takes a [`turn::Turn`]: renders the conversation with the
//!    chat template ([`tokenizer`]) and the model's image preprocessor ([`vision::Vision`]),
//!    restores the best KV checkpoint offered ([`kv_file`]), or makes fresh caches from the
//!    model's [`cache::CachePlan`].
//! 3. The reply is a row of a [`batch::Batch`] (the one decode path; alone, a batch of one:
//!    [`batch::generate`], [`batch::speculate`]): its prompt prefilled through window appends,
//!    then decoded with the other rows one pass per step, compiled where the caches allow (a
//!    lone row, or rows sharing buffers: [`compiled`]); rows that draft verify their drafts
//!    together in windows and roll their caches back to what each kept.
//! 4. The turn brings the caches to the next turn's boundary and writes its checkpoint.
//!
//! # Where to start reading
//!
//! [`cache`]: its traits carry the invariants the rest relies on (the phase is the method
//! name; caches own their attention reads; signatures are explicit; a round is a transaction).
//! Then [`models`] (the `Model` trait and the ports drafters read), one family
//! ([`models::gemma4`]), [`batch`], [`turn`].
//!
//! ```no_run
//! use engine::LoadOptions;
//! use engine::generate::Flow;
//! use engine::turn::{ChatModel, Drafters, Prompt, Turn, TurnEvent, TurnMessage};
//! # fn main() -> engine::Result<()> {
//! let chat = ChatModel::load("path/to/gemma-4-e2b-it-4bit".as_ref(), &LoadOptions::default())?;
//! let turn = Turn::new(Prompt::Messages(vec![TurnMessage::text("user", "Hello!")]));
//! let reply = chat.answer(&turn, &mut Drafters::default(), |TurnEvent::Token { text, .. }| {
//!     print!("{text}");
//!     Flow::Continue
//! })?;
//! println!("\n{:?} after {} tokens", reply.stats.stop_reason, reply.tokens.len());
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

pub mod batch;
pub mod constrain;
pub mod demo;
pub mod generate;
pub mod memory;
pub mod messages;
pub mod sampling;
pub mod speculative;
pub mod tokenizer;
pub mod tools;
pub mod turn;

// The layers below, under the paths the engine has always given them.
pub use cache::backend::KernelOptions;
pub use cache::{self, Error, Result, backend, compiled, kv_file, pointwise, units};
pub use models::{self, LoadOptions, checkpoint, nn, registry, tokens, vision};

/// Ops per CUDA graph Quince runs MLX-CUDA with (MLX's default on an H200 is 30).
pub const CUDA_GRAPH_OPS: u32 = 100;

/// Applies the MLX settings Quince runs with, each only where the environment does not set it
/// already: call at the start of `main`, before any MLX op. Today one: [`CUDA_GRAPH_OPS`]
/// (a decode step is several hundred small ops, and on CUDA their batching into graphs is host
/// time per token; figures in `docs/benchmarks.md`). Returns the variables it set, so that a
/// child process meant to run MLX as shipped (the reference in `quince bench --compare`) can
/// drop them.
pub fn configure_mlx() -> Result<Vec<&'static str>> {
    let mut set = Vec::new();
    if mlx::device::default_cuda_graph_ops(CUDA_GRAPH_OPS)? {
        set.push(mlx::device::CUDA_GRAPH_OPS_VAR);
    }
    Ok(set)
}
