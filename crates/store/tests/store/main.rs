//! Integration tests of the store, each on a fresh database file.
#![allow(clippy::unwrap_used)] // test code: a failing unwrap is a failing test

mod crash;
mod tree;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// A store on a new file in `dir`, with a clock that advances 1 ms per reading.
pub async fn fresh(dir: &tempfile::TempDir) -> store::Store {
    let tick = Arc::new(AtomicI64::new(1_000));
    let clock: store::Clock = Arc::new(move || tick.fetch_add(1, Ordering::SeqCst));
    store::Store::open_with_clock(dir.path().join("quince.db"), clock).await.unwrap()
}
