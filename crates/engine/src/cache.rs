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
//! Recurrent (gated DeltaNet) and latent (MLA) state join as capabilities of their own beside
//! `as_attention_mut`, so generation, checkpoints and rounds keep working on `dyn Cache`.
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
//! Storages: [`PlainCache`] (growable) and [`RotatingCache`] (sliding window ring). Rows of a
//! batch: [`CacheRows`], each row in its own storage, a round resolved per row ([`Keep`]).

mod plain;
mod plan;
mod read;
mod rotating;
mod rows;
mod trace;

use std::collections::BTreeMap;

use mlx::Array;

pub use plain::PlainCache;
pub use plan::{CachePlan, Storage};
pub use read::AttentionRead;
pub(crate) use read::{ReadMask, overlay_mask};
pub use rotating::RotatingCache;
pub use rows::{CacheRows, Keep};
pub(crate) use trace::TraceCache;

use crate::error::{Error, Result};

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
/// `keys`/`values`, every position visible, read with `ops`.
pub(crate) fn block_read(
    stored: Option<AttentionRead>,
    keys: &Array,
    values: &Array,
    ops: &crate::backend::Ops,
) -> Result<AttentionRead> {
    check_append(keys, values, false)?;
    let (k, v) = match stored {
        Some(stored) => (
            mlx::ops::concatenate(&[&stored.keys, keys], 2)?,
            mlx::ops::concatenate(&[&stored.values, values], 2)?,
        ),
        None => (keys.clone(), values.clone()),
    };
    Ok(AttentionRead::all_visible(k, v, ops))
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
    /// inputs `[keys, values]` (the stored positions), outputs the same with the new one.
    Concat,
    /// The step writes the new position into the full ring at a dynamic slot and reads the
    /// whole ring: inputs `[ring keys, ring values, slot]` (`slot` an int32 scalar), outputs
    /// the updated ring. The cache hands its buffers over, so the write happens in place.
    Ring,
}

impl DecodeFetch {
    /// Number of closure inputs a slot of this kind feeds.
    pub fn inputs(self) -> usize {
        match self {
            DecodeFetch::Concat => 2,
            DecodeFetch::Ring => 3,
        }
    }

    /// Number of graph outputs a slot of this kind takes back.
    pub fn outputs(self) -> usize {
        2
    }
}

/// One cache's part of a compiled decode step: how it is read and written, and its inputs.
#[derive(Debug)]
pub struct DecodeSlot {
    /// The kind of step.
    pub fetch: DecodeFetch,
    /// The closure inputs, [`DecodeFetch::inputs`] of them.
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
    /// one position) and advances the offset by one.
    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()>;
    /// After a failed step: takes back what [`CompiledDecodeCache::begin_decode_step`] handed
    /// over; the cache is as before.
    fn abort_decode_step(&mut self, slot: DecodeSlot);
}

/// A cache's saved state: only valid positions, in temporal order, plus metadata.
#[derive(Debug, Clone, Default)]
pub struct CacheState {
    /// `keys` and `values` `[B, H, N, D]`.
    pub tensors: BTreeMap<String, Array>,
    /// `signature`, `offset` and storage-specific entries, as strings.
    pub metadata: BTreeMap<String, String>,
}

impl CacheState {
    pub(crate) fn number(&self, key: &str) -> Result<usize> {
        self.metadata
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::InvalidRequest(format!("cache state has no numeric `{key}`")))
    }
}

/// The offset every cache of a stack is at (the first one's; 0 for none).
pub fn stack_offset(caches: &[Box<dyn Cache>]) -> usize {
    caches.first().map_or(0, |c| c.offset())
}

/// The attention storage of a layer's cache, or an error naming what it holds instead.
pub fn attention_of(cache: &mut dyn Cache) -> Result<&mut dyn AttentionCache> {
    let signature = cache.signature();
    cache.as_attention_mut().ok_or_else(|| {
        Error::InvalidRequest(format!("an attention layer needs keys and values, not {signature}"))
    })
}

/// The stored keys and values a compiled decode step gives back for one slot.
pub(crate) fn step_outputs(outputs: Vec<Array>) -> Result<(Array, Array)> {
    let [keys, values]: [Array; 2] = outputs.try_into().map_err(|o: Vec<Array>| {
        Error::InvalidRequest(format!("a decode step gives a cache 2 outputs, not {}", o.len()))
    })?;
    Ok((keys, values))
}

/// The slot of a one-position-per-step storage with `keys`/`values` holding at least `len`
/// stored positions from slot 0: the stored prefix, for a [`DecodeFetch::Concat`] step.
pub(crate) fn concat_slot(keys: &Array, values: &Array, len: usize) -> Result<DecodeSlot> {
    let prefix = |a: &Array| -> Result<Array> {
        let s = a.shape();
        if s[2] as usize == len {
            return Ok(a.clone());
        }
        Ok(a.slice(&[0, 0, 0, 0], &[s[0], s[1], len as i32, s[3]], &[1, 1, 1, 1])?)
    };
    Ok(DecodeSlot { fetch: DecodeFetch::Concat, inputs: vec![prefix(keys)?, prefix(values)?] })
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

/// Bytes one position of `[B, H, N, D]` keys and values takes for one row (0 before any).
pub(crate) fn bytes_per_position(keys: Option<&Array>, values: Option<&Array>) -> usize {
    let per = |a: &Array| {
        let s = a.shape();
        (s[1] * s[3]) as usize * a.dtype().size()
    };
    match (keys, values) {
        (Some(k), Some(v)) => per(k) + per(v),
        _ => 0,
    }
}

pub(crate) fn state_of(signature: String, offset: usize, keys: Array, values: Array) -> CacheState {
    let mut state = CacheState::default();
    state.tensors.insert("keys".into(), keys);
    state.tensors.insert("values".into(), values);
    state.metadata.insert("signature".into(), signature);
    state.metadata.insert("offset".into(), offset.to_string());
    state
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
