//! [`CachePlan`]: which storage each layer with state gets, decided by the model from its config
//! (the family's rule) and built in one place, so a new storage is one file and one
//! [`Storage`] variant here.

use super::{Cache, PlainCache, RotatingCache};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// One layer's storage and its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Every position, in a growing buffer ([`PlainCache`]).
    Plain,
    /// The last `window` positions, in a ring ([`RotatingCache`]).
    Rotating {
        /// Keys a query sees, itself included.
        window: usize,
    },
}

impl Storage {
    /// An empty cache of this storage whose reads run `ops`.
    pub fn build(self, ops: &Ops) -> Result<Box<dyn Cache>> {
        Ok(match self {
            Storage::Plain => Box::new(PlainCache::with_ops(ops)),
            Storage::Rotating { window } => Box::new(RotatingCache::new(window)?.with_ops(ops)),
        })
    }
}

/// Per layer that keeps state, in layer order, its storage (KV-sharing layers keep none, so a
/// plan can be shorter than the model's layer list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachePlan {
    layers: Vec<Storage>,
}

impl CachePlan {
    /// A plan of these storages, one per layer with state.
    pub fn new(layers: Vec<Storage>) -> CachePlan {
        CachePlan { layers }
    }

    /// Each layer's storage.
    pub fn layers(&self) -> &[Storage] {
        &self.layers
    }

    /// Fresh caches, one per layer, reading with `ops`; `expected` is how many layers the
    /// model keeps state for (a plan of another length is refused).
    pub fn build(&self, ops: &Ops, expected: usize) -> Result<Vec<Box<dyn Cache>>> {
        if self.layers.len() != expected {
            return Err(Error::InvalidRequest(format!(
                "a cache plan of {} layers for a model that keeps state in {expected}",
                self.layers.len()
            )));
        }
        self.layers.iter().map(|s| s.build(ops)).collect()
    }
}
