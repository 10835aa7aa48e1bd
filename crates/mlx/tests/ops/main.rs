#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test
//! Integration tests of the `mlx` crate, one module per op family.
//!
//! Expected values come from `tests/golden/ops/ops.safetensors`, written by
//! `tests/golden/ops/make_fixtures.py` from NumPy formulas (see that script), or are
//! hand-computed in the test.

mod arithmetic;
mod common;
mod compile;
mod device;
mod errors;
mod fast;
mod io;
mod quantized;
mod random;
mod reductions;
mod shapes;
