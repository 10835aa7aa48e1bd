//! Compiled decode: a model's one-token step traced once and replayed.
//!
//! A decode step is hundreds of small ops, and on a GPU most of its time is the cost of
//! launching them, not the work. [`mlx::compile()`] traces the step once and replays it with
//! element-wise chains fused into single kernels. What stops a plain trace from being reused
//! is everything that changes between steps: the position the rotary embedding starts at, how
//! many positions each cache holds, where a ring writes. So each of those is a closure input:
//!
//! - the position is an int32 array, not a number baked into the graph (one per row in a
//!   batch);
//! - each cache declares its slot ([`CompiledDecodeCache::begin_decode_step`]):
//!   [`DecodeFetch::Concat`](crate::DecodeFetch::Concat) — the step reads `concat(stored,
//!   new)`, which then becomes what the cache stores (a growing buffer and a filling ring);
//!   [`DecodeFetch::Ring`](crate::DecodeFetch::Ring) — the step writes the new position into
//!   the full ring at a slot given as an array and reads the whole ring, in place because the
//!   cache hands its buffers over; [`DecodeFetch::Rows`](crate::DecodeFetch::Rows) — rows of
//!   a batch sharing buffers ([`crate::SlotRows`]): each row's new position goes to its own
//!   slot (an array), in place, and each row reads the buffers under a mask (an array) that
//!   hides the slots it has not filled;
//! - the graph is shapeless, so one trace serves every length of stored positions; its body
//!   runs [`crate::backend::Ops::shapeless`] (MLX's ops, gathers where a slice's shape could
//!   not be inferred; a custom kernel's output shape cannot be either, so none runs in it).
//!
//! One graph is traced per row count and sequence of slot kinds and codecs (in practice two
//! per row count, model and KV format: while the sliding windows fill, and after; rows sharing
//! buffers one) and kept by the model for every later step and generation. A step that cannot
//! be compiled (a cache inside a speculative round, an empty cache, rows each in its own
//! storage, a storage without a compiled step) runs uncompiled; a graph that fails to build or
//! run switches compiled decode off for the model and the step runs uncompiled, with a warning,
//! so a reply never fails for it. Whether a model compiles at all is a load option
//! (the models' `LoadOptions::compiled_decode`).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use mlx::{Array, Compiled};

use crate::error::Result;
use crate::{Cache, CompiledDecodeCache, DecodeSlot, SlotKind};

/// Compiled-decode counters of one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeGraphStats {
    /// Graphs built (one per sequence of slot kinds seen).
    pub graphs: usize,
    /// Decode steps that ran compiled.
    pub steps: usize,
    /// Of those, steps of two or more rows (a batch's rows sharing buffers).
    pub batched: usize,
    /// Decode steps that ran uncompiled (compiled decode off, or a cache could not take part).
    pub uncompiled: usize,
}

/// A model's compiled decode graphs, by slot kinds. A clone is empty (and off): it is what a
/// model's tracing twin carries.
#[derive(Debug)]
pub struct DecodeGraphs {
    graphs: RefCell<HashMap<String, Compiled>>,
    enabled: Cell<bool>,
    stats: Cell<DecodeGraphStats>,
}

impl Clone for DecodeGraphs {
    fn clone(&self) -> Self {
        DecodeGraphs::new(false)
    }
}

impl DecodeGraphs {
    /// No graphs yet; compiled decode `enabled` or not (never where MLX cannot compile:
    /// [`crate::pointwise::compile_available`]).
    pub fn new(enabled: bool) -> DecodeGraphs {
        DecodeGraphs {
            graphs: RefCell::new(HashMap::new()),
            enabled: Cell::new(enabled && crate::pointwise::compile_available()),
            stats: Cell::new(DecodeGraphStats::default()),
        }
    }

    /// Whether decode steps try the compiled path.
    pub fn enabled(&self) -> bool {
        self.enabled.get()
    }

    /// The counters so far.
    pub fn stats(&self) -> DecodeGraphStats {
        self.stats.get()
    }

    fn count(&self, f: impl FnOnce(&mut DecodeGraphStats)) {
        let mut stats = self.stats.get();
        f(&mut stats);
        self.stats.set(stats);
    }

    /// Runs one compiled decode step for `tokens` `[B, 1]` at `positions` (an int32 scalar for
    /// one row, `[B]` for rows at positions of their own) over `caches`, with the graph `build`
    /// traces for the row count and the caches' slot kinds (built on first use). The graph's
    /// inputs are `[tokens, positions, slot inputs…]`; its outputs are the model's `extra`
    /// outputs followed by each slot's. Returns the model's outputs, or `None` when the step
    /// must run uncompiled (the caches are then untouched).
    pub fn step(
        &self,
        caches: &mut [Box<dyn Cache>],
        tokens: &Array,
        positions: &Array,
        extra: usize,
        build: impl FnOnce(Vec<SlotKind>) -> Result<Compiled>,
    ) -> Result<Option<Vec<Array>>> {
        if !self.enabled.get() {
            self.count(|s| s.uncompiled += 1);
            return Ok(None);
        }
        // A graph per row count: the rows are in the shapes of what the step broadcasts.
        let rows = tokens.dim(0)?;
        let mut slots: Vec<DecodeSlot> = Vec::with_capacity(caches.len());
        for cache in caches.iter_mut() {
            let slot = match compiled_of(cache.as_mut()) {
                Some(cache) => cache.begin_decode_step(),
                None => Ok(None),
            };
            match slot {
                Ok(Some(slot)) => slots.push(slot),
                other => {
                    give_back(caches, slots);
                    other?;
                    self.count(|s| s.uncompiled += 1);
                    return Ok(None);
                }
            }
        }
        let kinds: Vec<SlotKind> = slots.iter().map(|s| s.kind.clone()).collect();
        let key =
            format!("{rows}:{}", kinds.iter().map(SlotKind::key).collect::<Vec<_>>().join(","));
        let outputs = self.call(&key, kinds, tokens, positions, &slots, build);
        let outputs = match outputs {
            Ok(outputs)
                if outputs.len()
                    == extra + slots.iter().map(|s| s.kind.outputs()).sum::<usize>() =>
            {
                outputs
            }
            failed => {
                let why = match failed {
                    Ok(outputs) => format!("{} outputs for {} slots", outputs.len(), slots.len()),
                    Err(e) => e.to_string(),
                };
                tracing::warn!("compiled decode is off for this model: {why}");
                self.enabled.set(false);
                give_back(caches, slots);
                self.count(|s| s.uncompiled += 1);
                return Ok(None);
            }
        };
        // The slots' inputs go now, so that a ring's buffer is referenced by the graph alone
        // and its write happens in place.
        let kinds: Vec<SlotKind> = slots.into_iter().map(|s| s.kind).collect();
        let mut rest = outputs.into_iter();
        let model: Vec<Array> = rest.by_ref().take(extra).collect();
        for (cache, kind) in caches.iter_mut().zip(kinds) {
            let outputs = rest.by_ref().take(kind.outputs()).collect();
            match compiled_of(cache.as_mut()) {
                Some(cache) => cache.end_decode_step(kind.fetch, outputs)?,
                None => {
                    return Err(crate::Error::InvalidRequest("a slot without its cache".into()));
                }
            }
        }
        self.count(|s| {
            s.steps += 1;
            s.batched += usize::from(rows > 1);
        });
        Ok(Some(model))
    }

    fn call(
        &self,
        key: &str,
        kinds: Vec<SlotKind>,
        tokens: &Array,
        positions: &Array,
        slots: &[DecodeSlot],
        build: impl FnOnce(Vec<SlotKind>) -> Result<Compiled>,
    ) -> Result<Vec<Array>> {
        if !self.graphs.borrow().contains_key(key) {
            let graph = build(kinds)?;
            self.graphs.borrow_mut().insert(key.to_string(), graph);
            self.count(|s| s.graphs += 1);
        }
        let mut inputs: Vec<&Array> = vec![tokens, positions];
        inputs.extend(slots.iter().flat_map(|s| s.inputs.iter()));
        let graphs = self.graphs.borrow();
        let graph = graphs.get(key).ok_or_else(|| {
            crate::Error::InvalidRequest(format!("no decode graph for slots {key}"))
        })?;
        Ok(graph.call(&inputs)?)
    }
}

/// A cache's compiled-decode capability, when it has one.
fn compiled_of(cache: &mut dyn Cache) -> Option<&mut dyn CompiledDecodeCache> {
    cache.as_attention_mut()?.compiled()
}

/// Hands every begun slot back to its cache, leaving the caches as before the step.
fn give_back(caches: &mut [Box<dyn Cache>], slots: Vec<DecodeSlot>) {
    for (cache, slot) in caches.iter_mut().zip(slots) {
        if let Some(cache) = compiled_of(cache.as_mut()) {
            cache.abort_decode_step(slot);
        }
    }
}
