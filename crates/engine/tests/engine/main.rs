//! Integration tests of the engine: the cache stack against a naive recompute, and Gemma 4
//! against the reference libraries' golden outputs.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

mod batch;
mod cache;
mod cache_rounds;
mod constrain;
mod errors;
mod gated_delta;
mod gemma3;
mod gemma4;
mod kernels;
mod kv;
mod kv_file;
mod qwen3_5;
mod slot_rows;
mod speculative;
mod tokenizer;
mod vision;
