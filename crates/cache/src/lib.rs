//! The cache stack: per layer, the state a model keeps between forward passes, and for
//! attention layers caches that own their attention reads.
//!
//! Every kind of state implements [`Cache`] (position bookkeeping, identity, persistence,
//! trimming, speculative rounds); what it can do beyond that it offers as capabilities, each a
//! trait a caller asks for and is refused cleanly when the storage lacks it, as the upstream
//! seed contracts split them:
//!
//! - [`AttentionCache`] (decode and window appends; [`Cache::as_attention_mut`]),
//! - [`BidirectionalAttentionCache`] (image blocks that attend both ways;
//!   [`AttentionCache::bidirectional`]),
//! - [`CommittedAttentionCache`] (a span of decided tokens read with a decode step's
//!   arithmetic; [`AttentionCache::committed`]),
//! - [`BlockAttentionCache`] (a block attending the stored context and itself without being
//!   stored; [`AttentionCache::block`]),
//! - [`CompiledDecodeCache`] (a slot in a compiled decode step; [`AttentionCache::compiled`]).
//!
//! Recurrent state joins as a capability of its own beside `as_attention_mut`
//! ([`GatedDeltaCache`], [`Cache::as_gated_delta_mut`]), as latent (MLA) state will, so
//! generation, checkpoints and rounds keep working on `dyn Cache`.
//!
//! A model hands a layer's new keys and values to its cache through a method named for the
//! phase (`append_window` for prefill chunks and verify windows, `append_decode` for one new
//! token) and gets back an [`AttentionRead`]. The read attends queries over exactly the
//! positions that phase may see, with the kernel and mask the cache chose from its own offset,
//! sliding window and [`crate::backend::Ops`]: callers never see stored keys and values and never build masks.
//! Which storage each layer gets is a [`CachePlan`] the model decides from its config.
//!
//! Invariants every storage keeps:
//! - keys arrive with the positional encoding of the positions they occupy, which start at the
//!   cache's offset; after an append the offset has advanced by the appended length;
//! - the phase is the method name, never inferred from a length;
//! - a rejected append (an error) leaves the cache unchanged;
//! - a read owns its handles and stays valid after later appends (holding it across the next
//!   append may make that append copy its buffer instead of writing in place);
//! - [`Cache::signature`] names the storage and its geometry; persistence and reuse compare it
//!   and fail closed on a mismatch;
//! - speculation is a transaction ([`Cache::spec_round_begin`], then commit or
//!   `rollback(keep)`): afterwards the cache is exactly as if only the kept positions had been
//!   appended by decode steps, whatever phase appended them inside the round. Plain buffers
//!   move their offset back; a ring restores its snapshot and rewrites the kept positions
//!   into the slots decode steps would have used, so it stays exact after it wraps.
//!
//! Storages: [`PlainCache`] (growable), [`RotatingCache`] (sliding window ring) and
//! [`RecurrentCache`] (a gated DeltaNet layer's convolution tail and recurrent state, which
//! rounds roll back by replaying the kept positions), and beside them [`PositionCache`] (where
//! a multimodal-RoPE model's positions stand after its images). Rows of a
//! batch: [`SlotRows`], full-precision plain or ring rows sharing one buffer per part, a
//! round resolved per row in them; [`CacheRows`], each row in its own storage, a round
//! resolved per row ([`Keep`]); and
//! [`RecurrentRows`], gated DeltaNet rows in one batch buffer.
//!
//! The crate also holds what the caches and the models above them run on and keep: the op
//! routes ([`backend::Ops`], MLX's or Quince's CUDA kernels, chosen at load), the fused
//! element-wise ops ([`pointwise`]), compiled decode graphs ([`compiled`]), the KV checkpoint
//! files a cache stack is saved in ([`kv_file`]), and the engine's error type ([`Error`]).
//! It knows no model and no turn: the `models` crate builds on it, the `engine` crate on both.

#![deny(missing_docs)]

pub mod backend;
pub mod compiled;
mod error;
pub mod kv_file;
pub mod pointwise;
pub mod units;

mod cohort;
mod delta_rows;
mod gated_delta;
mod kv;
mod plain;
mod plan;
mod positions;
mod read;
mod rotating;
mod rows;
mod slot_rows;
mod trace;
mod turbo;
mod uploads;

use std::collections::BTreeMap;

use mlx::Array;

pub use cohort::Cohort;
pub use delta_rows::RecurrentRows;
pub use gated_delta::{DeltaHeads, DeltaShape, GatedDeltaCache, GatedDeltaLayer, RecurrentCache};
pub(crate) use kv::Codec;
pub use kv::{KvEncoding, KvFormat};
pub use plain::PlainCache;
pub use plan::{CachePlan, KvLayers, KvOptions, KvShape, Layout, Storage};
pub use positions::{PositionCache, PositionRows};
pub use read::AttentionRead;
pub(crate) use read::{ReadMask, overlay_mask};
pub use rotating::RotatingCache;
pub use rows::{CacheRows, Keep};
pub use slot_rows::{SlotRow, SlotRows};
pub use trace::TraceCache;

pub use error::{Error, Result};

/// What every layer's state shares: position bookkeeping, identity, persistence, trimming,
/// speculative rounds.
pub trait Cache: std::fmt::Debug {
    /// Positions appended so far (the absolute position of the next one).
    fn offset(&self) -> usize;
    /// The storage and its geometry, e.g. `plain` or `rotating(window=512)`.
    fn signature(&self) -> String;
    /// Bytes one more position costs (all heads, one row); 0 before the first append fixes the
    /// dimensions, and for state that does not grow with the sequence.
    fn bytes_per_token(&self) -> usize;
    /// Positions held now (the offset, or fewer for a ring that evicted).
    fn stored_positions(&self) -> usize;
    /// The most positions the next append may add (`None`: any number): a storage that
    /// changes precision at a start offset splits appends there, so that its boundary lands
    /// on the same position whatever the prefill's chunks or the verify windows.
    fn max_append(&self) -> Option<usize> {
        None
    }
    /// The earliest offset a trim may go back to and still continue as a run of that length
    /// would have (a storage that converted its positions to another precision at some offset
    /// cannot be trimmed below it).
    fn minimum_reusable_offset(&self) -> usize {
        0
    }
    /// The stored buffers, to evaluate after a prefill chunk (as mlx-lm evaluates its caches'
    /// state) without computing logits nobody reads.
    fn buffers(&self) -> Vec<Array>;
    /// The valid positions and metadata, for a checkpoint file.
    fn state(&self) -> Result<CacheState>;
    /// Replaces this cache's contents with a saved state of the same signature.
    fn restore(&mut self, state: &CacheState) -> Result<()>;
    /// Whether [`Cache::trim`] can drop positions now (a ring that evicted cannot).
    fn is_trimmable(&self) -> bool;
    /// Drops the last `n` positions (at most the offset); errors when not trimmable.
    fn trim(&mut self, n: usize) -> Result<usize>;
    /// Arms a speculative round: the appends from here until [`Cache::spec_round_commit`] or
    /// [`Cache::spec_round_rollback`] form one transaction (a verify window, or a drafter's
    /// decode steps). One round at a time; no trim or restore inside it.
    fn spec_round_begin(&mut self) -> Result<()>;
    /// Keeps every position the round appended.
    fn spec_round_commit(&mut self) -> Result<()>;
    /// Keeps the first `keep` positions the round appended and forgets the rest. Afterwards
    /// the cache is exactly as if only those positions had been appended, one decode step
    /// each: the same offset, the same stored positions in the same slots, the same reads.
    fn spec_round_rollback(&mut self, keep: usize) -> Result<()>;
    /// This state as attention storage (keys and values), when it is.
    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        None
    }
    /// [`Cache::as_attention`], to append to.
    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        None
    }
    /// This state as a gated DeltaNet layer's recurrent state, to append to, when it is.
    fn as_gated_delta_mut(&mut self) -> Option<&mut dyn GatedDeltaCache> {
        None
    }
    /// One offset per row, when this cache holds a batch of rows at their own offsets
    /// ([`CacheRows`]); `None` for a single sequence, whose offset is [`Cache::offset`].
    fn row_offsets(&self) -> Option<Vec<usize>> {
        None
    }
    /// This cache as a batch of rows, when it is one.
    fn as_batch_rows(&self) -> Option<&dyn BatchRows> {
        None
    }
    /// This cache as a batch of rows, when it is one (rows joining and leaving).
    fn as_batch_rows_mut(&mut self) -> Option<&mut dyn BatchRows> {
        None
    }
    /// An empty batch of rows of this storage, for a batched forward pass (the engine's batch):
    /// this cache, and others of its signature, join it as rows, in `layout` where the storage
    /// has more than one. Every batch resolves speculative rounds with one keep count per row
    /// ([`BatchRows::rollback_rows`]). `None`: this state does not batch (so).
    fn empty_rows(&self, layout: RowLayout) -> Option<Box<dyn Cache>> {
        // Keys and values batch as rows each in its own storage, which resolves rounds too.
        let _ = layout;
        self.as_attention().map(|_| Box::new(CacheRows::new()) as Box<dyn Cache>)
    }
    /// This cache's contents, taken out as a gated DeltaNet layer's state (leaving it empty),
    /// when it is one: how such a row joins [`RecurrentRows`].
    fn take_recurrent(&mut self) -> Option<RecurrentCache> {
        None
    }
    /// This cache's filled slots and where it stands, taken out (leaving it empty), when it
    /// is full-precision plain or ring storage outside a round: how such a row joins
    /// [`SlotRows`]. `None` leaves it as it is.
    fn take_slots(&mut self) -> Option<SlotRow> {
        None
    }
    /// This cache's contents, taken out as a position shift (leaving it empty), when it is
    /// one: how such a row joins [`PositionRows`].
    fn take_positions(&mut self) -> Option<PositionCache> {
        None
    }
    /// A multimodal-RoPE model's position shift ([`PositionCache`]), when this is one.
    fn as_positions_mut(&mut self) -> Option<&mut PositionCache> {
        None
    }
    /// A batch's position shifts, one per row ([`PositionRows`]), when this is one.
    fn as_position_rows_mut(&mut self) -> Option<&mut PositionRows> {
        None
    }
}

/// What a batch of rows answers when asked to be `what` (saved, restored, trimmed) whole: a
/// row is, one at a time, out of the batch.
pub(crate) fn row_by_row(what: &str) -> Error {
    Error::InvalidRequest(format!(
        "a batch is {what} row by row: a row leaves it for that (extract_row), or joins it \
         restored (merge_row)"
    ))
}

/// The [`Cache`] methods every batch of rows ([`BatchRows`]) answers alike, inside its `impl
/// Cache`: it is saved, restored and trimmed row by row ([`row_by_row`]), is a batch of rows,
/// and does not nest.
macro_rules! rows_cache_methods {
    () => {
        fn state(&self) -> Result<CacheState> {
            Err(super::row_by_row("saved"))
        }

        fn restore(&mut self, _state: &CacheState) -> Result<()> {
            Err(super::row_by_row("restored"))
        }

        fn is_trimmable(&self) -> bool {
            false
        }

        fn trim(&mut self, _n: usize) -> Result<usize> {
            Err(super::row_by_row("trimmed"))
        }

        fn as_batch_rows(&self) -> Option<&dyn BatchRows> {
            Some(self)
        }

        fn as_batch_rows_mut(&mut self) -> Option<&mut dyn BatchRows> {
            Some(self)
        }

        /// A batch does not nest.
        fn empty_rows(&self, _layout: super::RowLayout) -> Option<Box<dyn Cache>> {
            None
        }
    };
}
pub(crate) use rows_cache_methods;

/// How a batch keeps its rows ([`Cache::empty_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLayout {
    /// In one layout for the batch's one storage: full-precision plain and ring rows share
    /// buffers ([`SlotRows`]), decode steps and speculative rounds alike.
    Shared,
    /// Each row in its own storage ([`CacheRows`]): rows of different storages.
    Separate,
}

/// A layer's state for several sequences at once, each at its own offset: the layout a batched
/// forward pass appends to (the engine's batch). Rows join from single-sequence caches of the
/// batch's storage and leave as single-sequence caches holding, bit for bit, what the same
/// appends would have left in them alone.
pub trait BatchRows: Cache {
    /// Rows in the batch.
    fn batch_size(&self) -> usize;
    /// Adds `row`, a single-sequence cache of the batch's storage, after the existing rows.
    /// Outside a round.
    fn merge_row(&mut self, row: Box<dyn Cache>) -> Result<()>;
    /// Removes row `row` and returns it as a single-sequence cache. Outside a round.
    fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>>;
    /// Ends the armed round keeping the first `keep[b]` positions row `b` appended in it: each
    /// row is then as if only its kept positions had been appended, one decode step each. A
    /// count above what a row appended is refused before any row changes.
    fn rollback_rows(&mut self, keep: &[usize]) -> Result<()> {
        let _ = keep;
        Err(round_error("these rows resolve no rounds"))
    }
    /// Row `row`'s donor read ([`AttentionCache::donor_read`]): every position it stores, in
    /// slot order, as its own storage would lend them. `None` for a row storing nothing, and
    /// for rows that are no attention storage.
    fn row_donor_read(&self, row: usize) -> Result<Option<AttentionRead>> {
        let _ = row;
        Ok(None)
    }
}

/// What a drafter reads of a layer's keys and values for row `row` of `cache`: the donor read of
/// a single-sequence storage (row 0), or of that row of a batch.
pub fn donor_read(cache: &dyn Cache, row: usize) -> Result<Option<AttentionRead>> {
    match (cache.as_batch_rows(), cache.as_attention()) {
        (Some(rows), _) => rows.row_donor_read(row),
        (None, Some(attention)) if row == 0 => attention.donor_read(),
        (None, Some(_)) => Err(Error::InvalidRequest(format!("row {row} of a single sequence"))),
        (None, None) => Ok(None),
    }
}

/// A key/value cache that owns its attention reads. See the module docs for the invariants.
pub trait AttentionCache: Cache {
    /// Decode: one new position (`L` = 1). The query sees every stored position up to and
    /// including the new one, limited to the sliding window.
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead>;
    /// Window: `L` new positions, causal within the window; query `i` sees the earlier
    /// positions and window positions `0..=i`, limited to the sliding window.
    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead>;
    /// A read of every stored position, in slot order, with no mask: what a drafter attending
    /// the target's keys and values with its own queries reads (the upstream seed's donor
    /// attention). Appends nothing; `None` while empty.
    fn donor_read(&self) -> Result<Option<AttentionRead>>;
    /// This storage's bidirectional appends, when it has them.
    fn bidirectional(&mut self) -> Option<&mut dyn BidirectionalAttentionCache> {
        None
    }
    /// This storage's part in a compiled decode step, when it has one (else steps over it run
    /// op by op).
    fn compiled(&mut self) -> Option<&mut dyn CompiledDecodeCache> {
        None
    }
    /// This storage's committed-span appends, when it has them.
    fn committed(&mut self) -> Option<&mut dyn CommittedAttentionCache> {
        None
    }
    /// This storage's block reads, when it has them.
    fn block(&self) -> Option<&dyn BlockAttentionCache> {
        None
    }
}

/// A cache composed for committed-token appends (token fill), where every position of the span
/// is already decided.
pub trait CommittedAttentionCache: AttentionCache {
    /// Committed span: `L` decided positions, causal within the span. Each query attends its
    /// own causal prefix with the arithmetic of a one-position read, so the span's outputs are
    /// bit for bit what `L` decode steps would give. Appends as `L` decode appends do; on an
    /// error midway the positions appended so far are trimmed off again where the storage
    /// trims.
    fn append_committed(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let length = check_append(keys, values, false)?;
        let position = |x: &Array, i: i32| -> Result<Array> {
            let s = x.shape();
            Ok(x.slice(&[0, 0, i, 0], &[s[0], s[1], i + 1, s[3]], &[1; 4])?)
        };
        let mut reads = Vec::with_capacity(length);
        for i in 0..length as i32 {
            let read = position(keys, i)
                .and_then(|k| Ok((k, position(values, i)?)))
                .and_then(|(k, v)| self.append_decode(&k, &v));
            match read {
                Ok(read) => reads.push(read),
                Err(error) => {
                    if self.is_trimmable() {
                        self.trim(reads.len())?;
                    }
                    return Err(error);
                }
            }
        }
        AttentionRead::per_query(reads)
            .ok_or_else(|| Error::InvalidRequest("a committed span of no positions".into()))
    }
}

/// A cache composed for block reads: a block's queries attend the stored context plus the
/// block's own keys and values, which are not stored (a diffusion model's canvas pass, a block
/// drafter over its projected context).
pub trait BlockAttentionCache: AttentionCache {
    /// Block read: `keys`/`values` `[B, Hkv, L, D]` are the block's, borrowed and not
    /// appended; the offset does not move. Every query sees every stored position (a ring
    /// stores only its window) and all `L` block positions.
    fn read_block(&self, keys: &Array, values: &Array) -> Result<AttentionRead>;
}

/// A block read over `stored` (a cache's donor read, `None` while empty) and the block's
/// `keys`/`values` (encoded in `codec`), every position visible, read with `ops`.
pub(crate) fn block_read(
    stored: Option<AttentionRead>,
    keys: &Array,
    values: &Array,
    codec: &Codec,
    ops: &crate::backend::Ops,
) -> Result<AttentionRead> {
    check_append(keys, values, false)?;
    match stored {
        Some(stored) => stored.with_block(keys, values),
        None => Ok(AttentionRead::all_visible(codec.encode_kv(keys, values)?, codec, ops)),
    }
}

/// A cache composed for prompts whose media tokens attend each other in both directions
/// (Gemma 4 vision prefill).
pub trait BidirectionalAttentionCache: AttentionCache {
    /// As [`AttentionCache::append_window`], except that positions of one image block — a
    /// maximal run of consecutive `flags` set (`flags.len() == L`) — see each other in both
    /// directions, regardless of order and of the sliding window (mlx-vlm's rule for Gemma 4:
    /// `causal ∧ window ∨ same block`). Works at any offset; a block must not be split across
    /// appends.
    fn append_bidirectional(
        &mut self,
        keys: &Array,
        values: &Array,
        flags: &[bool],
    ) -> Result<AttentionRead>;
}

/// How a cache takes part in a compiled one-token decode step (see [`crate::compiled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeFetch {
    /// The step reads `concat(stored, new)`, which becomes the stored positions after it:
    /// inputs the stored positions' parts (`[keys, values]` in full precision), outputs the
    /// same with the new one.
    Concat,
    /// The step writes the new position into the full ring at a dynamic slot and reads the
    /// whole ring: inputs the ring's parts and the slot (an int32 scalar), outputs the updated
    /// ring. The cache hands its buffers over, so the write happens in place.
    Ring,
    /// Rows sharing buffers (a batch of two or more rows, [`SlotRows`]): the step writes
    /// every row's new position into that row's next slot and reads every slot under a mask
    /// that hides the slots a row has not filled: inputs the buffers' parts `[B, H, capacity,
    /// ·]`, the slots (int32 `[B, 1, 1, 1]`) and the mask (bool `[B, 1, 1, capacity]`),
    /// outputs the updated buffers. The rows hand their buffers over, so the writes happen in
    /// place.
    Rows,
}

/// What a compiled step's graph is traced for, per cache: how the slot is read and written,
/// and the codec its keys and values are stored in (one graph per sequence of kinds).
#[derive(Debug, Clone)]
pub struct SlotKind {
    /// How the slot is read and written.
    pub fetch: DecodeFetch,
    pub(crate) codec: Codec,
}

impl SlotKind {
    /// Number of closure inputs a slot of this kind feeds: the stored parts, and a ring's slot.
    pub fn inputs(&self) -> usize {
        match self.fetch {
            DecodeFetch::Concat => self.outputs(),
            DecodeFetch::Ring => self.outputs() + 1,
            DecodeFetch::Rows => self.outputs() + 2,
        }
    }

    /// Number of graph outputs a slot of this kind takes back: the stored parts.
    pub fn outputs(&self) -> usize {
        2 * self.codec.parts_per_tensor()
    }

    /// A short name for graph keys, e.g. `c:full` or `r:affine4g64`.
    pub fn key(&self) -> String {
        let fetch = match self.fetch {
            DecodeFetch::Concat => 'c',
            DecodeFetch::Ring => 'r',
            DecodeFetch::Rows => 'b',
        };
        format!("{fetch}:{}", self.codec.name())
    }
}

/// One cache's part of a compiled decode step: how it is read and written, and its inputs.
#[derive(Debug)]
pub struct DecodeSlot {
    /// The kind of step.
    pub kind: SlotKind,
    /// The closure inputs, [`SlotKind::inputs`] of them.
    pub inputs: Vec<Array>,
}

/// A storage that can take part in a compiled decode step.
pub trait CompiledDecodeCache: AttentionCache {
    /// This cache's slot for a one-token step, or `None` when it cannot take part now (empty,
    /// inside a speculative round); the step then runs uncompiled. A [`DecodeFetch::Ring`]
    /// slot takes the cache's buffers: the caller ends the step with
    /// [`CompiledDecodeCache::end_decode_step`] or gives them back with
    /// [`CompiledDecodeCache::abort_decode_step`].
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>>;
    /// Adopts the step's outputs for this slot (the stored positions or ring after appending
    /// one position) and advances the offset by one (converting, where due, as a decode append
    /// would).
    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()>;
    /// After a failed step: takes back what [`CompiledDecodeCache::begin_decode_step`] handed
    /// over; the cache is as before.
    fn abort_decode_step(&mut self, slot: DecodeSlot);
}

/// A cache's saved state: only valid positions, in temporal order, plus metadata.
#[derive(Debug, Clone, Default)]
pub struct CacheState {
    /// The stored parts: `keys` and `values` `[B, H, N, D]` in full precision; encoded
    /// storage adds its parts' suffixes (`keys.scales`, …).
    pub tensors: BTreeMap<String, Array>,
    /// `signature`, `offset` and storage-specific entries, as strings.
    pub metadata: BTreeMap<String, String>,
}

impl CacheState {
    /// The state of a storage named `signature` at `offset` holding `parts` in `codec`.
    pub(crate) fn of(
        signature: String,
        offset: usize,
        codec: &Codec,
        parts: Vec<Array>,
    ) -> CacheState {
        let mut state = CacheState::default();
        let names = ["keys", "values"].into_iter().flat_map(|tensor| {
            codec.part_suffixes().iter().map(move |suffix| format!("{tensor}{suffix}"))
        });
        state.tensors.extend(names.zip(parts));
        state.metadata.insert("signature".into(), signature);
        state.metadata.insert("offset".into(), offset.to_string());
        state
    }

    /// The stored parts in `codec`, in order.
    pub(crate) fn parts(&self, codec: &Codec) -> Result<Vec<Array>> {
        let parts = ["keys", "values"]
            .iter()
            .flat_map(|tensor| codec.part_suffixes().iter().map(move |s| format!("{tensor}{s}")))
            .map(|name| state_tensor(self, &name).cloned())
            .collect::<Result<Vec<_>>>()?;
        let n = kv::position_count(&parts)?;
        if parts.iter().any(|p| p.ndim() != 4 || p.dim(2).ok() != Some(n as i32)) {
            return Err(Error::InvalidRequest(format!(
                "cache state parts disagree on their positions ({} parts, {n} positions)",
                parts.len()
            )));
        }
        Ok(parts)
    }

    pub(crate) fn number(&self, key: &str) -> Result<usize> {
        self.metadata
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::InvalidRequest(format!("cache state has no numeric `{key}`")))
    }
}

/// Row `row`'s offset in a stack of caches: the offset of a single sequence (row 0), or that
/// row's in a batch.
pub fn stack_row_offset(caches: &[Box<dyn Cache>], row: usize) -> usize {
    match stack_row_offsets(caches) {
        Some(offsets) => offsets.get(row).copied().unwrap_or(0),
        None => stack_offset(caches),
    }
}

/// Each row's offset in a stack of batched caches ([`Cache::row_offsets`] of the first one);
/// `None` for a single sequence.
pub fn stack_row_offsets(caches: &[Box<dyn Cache>]) -> Option<Vec<usize>> {
    caches.first().and_then(|c| c.row_offsets())
}

/// The offset every cache of a stack is at (the first one's; 0 for none).
pub fn stack_offset(caches: &[Box<dyn Cache>]) -> usize {
    caches.first().map_or(0, |c| c.offset())
}

/// The most positions the next append may add to every cache of a stack (`None`: any
/// number): prefill chunks and verify windows end where a storage converts (see
/// [`Cache::max_append`]).
pub fn stack_max_append(caches: &[Box<dyn Cache>]) -> Option<usize> {
    caches.iter().filter_map(|c| c.max_append()).min()
}

/// The attention storage of a layer's cache, or an error naming what it holds instead.
pub fn attention_of(cache: &mut dyn Cache) -> Result<&mut dyn AttentionCache> {
    let signature = cache.signature();
    cache.as_attention_mut().ok_or_else(|| {
        Error::InvalidRequest(format!("an attention layer needs keys and values, not {signature}"))
    })
}

/// Checks that a compiled decode step gave back one slot's parts in `codec`.
pub(crate) fn step_outputs(outputs: &[Array], codec: &Codec) -> Result<()> {
    if outputs.len() != 2 * codec.parts_per_tensor() {
        return Err(Error::InvalidRequest(format!(
            "a decode step gives a {} cache {} outputs, not {}",
            codec.name(),
            2 * codec.parts_per_tensor(),
            outputs.len()
        )));
    }
    Ok(())
}

/// The slot of a one-position-per-step storage whose `parts` hold at least `len` stored
/// positions from slot 0: the stored prefix, for a [`DecodeFetch::Concat`] step.
pub(crate) fn concat_slot(parts: &[Array], len: usize, codec: &Codec) -> Result<DecodeSlot> {
    Ok(DecodeSlot {
        kind: SlotKind { fetch: DecodeFetch::Concat, codec: codec.clone() },
        inputs: kv::positions(parts, 0, len)?,
    })
}

/// The error for a round call out of order.
pub(crate) fn round_error(what: &str) -> Error {
    Error::InvalidRequest(format!("speculative round: {what}"))
}

/// Checks that a bidirectional append has one flag per new position.
pub(crate) fn check_flags(flags: &[bool], length: usize) -> Result<()> {
    if flags.len() != length {
        return Err(Error::InvalidRequest(format!("{} flags for {length} positions", flags.len())));
    }
    Ok(())
}

/// Checks the shapes of an append: `[B, H, L, D]` keys and values agreeing on `B, H, L`.
pub(crate) fn check_append(keys: &Array, values: &Array, decode: bool) -> Result<usize> {
    let (ks, vs) = (keys.shape(), values.shape());
    if ks.len() != 4 || vs.len() != 4 || ks[..3] != vs[..3] {
        return Err(Error::InvalidRequest(format!(
            "cache append needs [B, H, L, D] keys and values, got {ks:?} and {vs:?}"
        )));
    }
    let length = ks[2] as usize;
    if decode && length != 1 {
        return Err(Error::InvalidRequest(format!(
            "append_decode takes one position, got {length}"
        )));
    }
    if length == 0 {
        return Err(Error::InvalidRequest("append of zero positions".into()));
    }
    Ok(length)
}

pub(crate) fn check_signature(state: &CacheState, signature: &str) -> Result<()> {
    match state.metadata.get("signature") {
        Some(s) if s == signature => Ok(()),
        other => Err(Error::InvalidRequest(format!(
            "cache state signature {other:?} does not match this cache ({signature})"
        ))),
    }
}

pub(crate) fn state_tensor<'a>(state: &'a CacheState, name: &str) -> Result<&'a Array> {
    state
        .tensors
        .get(name)
        .ok_or_else(|| Error::InvalidRequest(format!("cache state has no `{name}` tensor")))
}
