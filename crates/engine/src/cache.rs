//! The attention cache stack: caches own their attention reads.
//!
//! A model hands each layer's new keys and values to its cache through a method named for the
//! phase (`append_window` for prefill chunks and verify windows, `append_decode` for one new
//! token) and gets back an [`AttentionRead`]. The read attends queries over exactly the
//! positions that phase may see, with the kernel and mask the cache chose from its own offset
//! and sliding window: callers never see stored keys and values and never build masks.
//!
//! Invariants every storage keeps:
//! - keys arrive with the positional encoding of the positions they occupy, which start at the
//!   cache's offset; after an append the offset has advanced by the appended length;
//! - the phase is the method name, never inferred from a length;
//! - a rejected append (an error) leaves the cache unchanged;
//! - a read owns its handles and stays valid after later appends (holding it across the next
//!   append may make that append copy its buffer instead of writing in place), except a
//!   *buffer read* ([`AttentionCache::append_decode_in_buffer`], CUDA decode): it names slots
//!   of the live buffers and is valid for its own step only (the layers of that step, KV-sharing
//!   ones included). Whatever a cache hands out that outlives a step (`stored`, `state`) makes
//!   its next in-buffer write copy the buffers first;
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

mod one_query;
mod plain;
mod rotating;
mod rows;
mod step_ints;

use std::cell::OnceCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use mlx::Array;
use mlx::fast::{AttentionMask, scaled_dot_product_attention};

pub use one_query::{
    DecodeAttention, buffer_reads, buffer_reads_on, decode_attention, set_buffer_reads,
    set_decode_attention, split_reads_above,
};
pub(crate) use one_query::{buffer_reads_ready, buffer_steps_ready, tracing, tracing_step};
pub use plain::PlainCache;
pub use rotating::RotatingCache;
pub use rows::{CacheRows, Keep};
pub(crate) use step_ints::position as step_position;
pub use step_ints::{device_step_ints, set_device_step_ints};

/// The stored keys and values a compiled decode step gives back for one slot.
pub(crate) fn step_outputs(outputs: Vec<Array>) -> Result<(Array, Array)> {
    let [keys, values]: [Array; 2] = outputs.try_into().map_err(|o: Vec<Array>| {
        Error::InvalidRequest(format!("a decode step gives a cache 2 outputs, not {}", o.len()))
    })?;
    Ok((keys, values))
}

/// The slot of a one-position-per-step storage at `offset` with `keys`/`values` holding at
/// least `len` stored positions from slot 0: the stored prefix, for a
/// [`DecodeFetch::Concat`] step.
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

use crate::error::{Error, Result};

/// What a cache's attention read masks.
#[derive(Debug, Clone)]
pub(crate) enum ReadMask {
    /// Every stored position is visible to every query.
    None,
    /// Bottom-right aligned causal: query `i` of `L` sees keys `..= S - L + i`.
    Causal,
    /// An explicit bool mask `[L, S]` (true = visible).
    Array(Array),
}

/// Attention over the positions one phase-named append may see. Owns its handles.
#[derive(Debug, Clone)]
pub struct AttentionRead {
    keys: Array,
    values: Array,
    mask: ReadMask,
    /// Set for a buffer read: `keys`/`values` are the cache's whole buffers.
    buffer: Option<BufferRead>,
}

/// The slots a buffer read attends (see [`AttentionCache::append_decode_in_buffer`]).
#[derive(Debug, Clone)]
struct BufferRead {
    /// int32 `[n, skip]`: slots `0..n` but `skip` (−1 for none).
    bounds: Array,
    /// The new position (`[B, Hkv, 1, D]` keys and values), attended too and written into
    /// slot `skip` by the attention kernel.
    fresh: Option<(Array, Array)>,
    /// The slots valid once it is written (what the step's KV-sharing layers read), and their
    /// bounds, made once for all of those layers.
    after: i32,
    after_bounds: Rc<OnceCell<Array>>,
}

/// A storage's part of a decode step by buffer read: its whole buffers (grown to hold the new
/// position, owned by the cache alone), the read's `[n, skip]` and the slots valid after.
#[derive(Debug)]
pub(crate) struct BufferStep {
    pub(crate) keys: Array,
    pub(crate) values: Array,
    pub(crate) read: (i32, i32),
    pub(crate) after: i32,
}

impl BufferStep {
    /// The step's read, with the new position `fresh`.
    pub(crate) fn into_read(self, fresh: (Array, Array)) -> Result<AttentionRead> {
        let bounds = step_ints::pair(self.read.0, self.read.1)?;
        let buffer = BufferRead {
            bounds,
            fresh: Some(fresh),
            after: self.after,
            after_bounds: Rc::new(OnceCell::new()),
        };
        Ok(AttentionRead::buffered(self.keys, self.values, buffer))
    }

    /// The step's [`DecodeFetch::Buffer`] slot for a compiled step.
    pub(crate) fn into_slot(self) -> Result<DecodeSlot> {
        let bounds = Array::from_slice(&[self.read.0, self.read.1], &[2])?;
        let after = Array::from_slice(&[self.after, -1], &[2])?;
        Ok(DecodeSlot {
            fetch: DecodeFetch::Buffer,
            inputs: vec![self.keys, self.values, bounds, after],
        })
    }
}

impl AttentionRead {
    pub(crate) fn new(keys: Array, values: Array, mask: ReadMask) -> AttentionRead {
        AttentionRead { keys, values, mask, buffer: None }
    }

    fn buffered(keys: Array, values: Array, buffer: BufferRead) -> AttentionRead {
        AttentionRead { keys, values, mask: ReadMask::None, buffer: Some(buffer) }
    }

    /// The read KV-sharing layers of the same step take: a buffer read's slots once the new
    /// position is written (the kernel that writes it runs first: their queries depend on its
    /// output); any other read as it is.
    pub fn written(&self) -> Result<AttentionRead> {
        let Some(buffer) = &self.buffer else { return Ok(self.clone()) };
        if buffer.fresh.is_none() {
            return Ok(self.clone());
        }
        let bounds = match buffer.after_bounds.get() {
            Some(bounds) => bounds.clone(),
            None => {
                let bounds = step_ints::pair(buffer.after, -1)?;
                buffer.after_bounds.set(bounds.clone()).ok();
                bounds
            }
        };
        let written = BufferRead {
            bounds,
            fresh: None,
            after: buffer.after,
            after_bounds: buffer.after_bounds.clone(),
        };
        Ok(AttentionRead::buffered(self.keys.clone(), self.values.clone(), written))
    }

    /// Attends queries `q` `[B, Hq, L, D]` (positional encoding applied; `Hq` a multiple of the
    /// stored heads) → `[B, Hq, L, D]`. Callable any number of times: KV-sharing layers attend
    /// a donor's read with their own queries. `L` may be smaller than the appended length: the
    /// queries are then the *last* `L` positions of the phase (a prefill that only needs the
    /// last row's logits).
    pub fn attend(&self, q: &Array, scale: f32) -> Result<Array> {
        if let Some(buffer) = &self.buffer {
            if q.dim(2)? != 1 {
                return Err(Error::InvalidRequest(
                    "a decode step's buffer read takes one query position".into(),
                ));
            }
            let keys = one_query::Keys::Buffer {
                k: &self.keys,
                v: &self.values,
                bounds: &buffer.bounds,
                fresh: buffer.fresh.as_ref().map(|(k, v)| (k, v)),
            };
            return one_query::attend_buffer(q, keys, scale);
        }
        let trimmed;
        let mask = match &self.mask {
            ReadMask::None => AttentionMask::None,
            ReadMask::Causal => AttentionMask::Causal,
            ReadMask::Array(m) => {
                // `[L, S]`, or `[B, 1, L, S]` for a batch of rows: queries on the next-to-last axis.
                let shape = m.shape();
                let axis = shape.len() - 2;
                let (rows, queries) = (shape[axis], q.dim(2)?);
                if queries < rows {
                    let mut start = vec![0; shape.len()];
                    start[axis] = rows - queries;
                    trimmed = m.slice(&start, &shape, &vec![1; shape.len()])?;
                    AttentionMask::Array(&trimmed)
                } else {
                    AttentionMask::Array(m)
                }
            }
        };
        if matches!(mask, AttentionMask::None) && q.dim(2)? == 1 {
            return one_query::attend_one(q, &self.keys, &self.values, scale);
        }
        Ok(scaled_dot_product_attention(q, &self.keys, &self.values, scale, mask, None)?)
    }

    /// Number of key positions the read covers.
    pub fn len(&self) -> Result<usize> {
        match &self.buffer {
            Some(b) if b.after >= 0 => Ok(b.after as usize),
            _ => Ok(self.keys.dim(2)? as usize),
        }
    }

    /// Whether the read covers no position.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
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

/// What every cache shares: position bookkeeping, identity, persistence, trimming.
pub trait Cache: std::fmt::Debug {
    /// Positions appended so far (the absolute position of the next one).
    fn offset(&self) -> usize;
    /// The storage and its geometry, e.g. `plain` or `rotating(window=512)`.
    fn signature(&self) -> String;
    /// Bytes one more position costs (keys and values, all heads, one row); 0 before the
    /// first append fixes the dimensions.
    fn bytes_per_token(&self) -> usize;
    /// The stored buffers, to evaluate after a prefill chunk (as mlx-lm evaluates its caches'
    /// state) without computing logits nobody reads.
    fn buffers(&self) -> Vec<Array>;
    /// Keys and values `[B, H, N, D]` of every stored position, in slot order (a full ring's
    /// oldest position is not first): what a drafter that attends the target's keys without a
    /// mask reads. `None` while empty.
    fn stored(&self) -> Result<Option<(Array, Array)>>;
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
    /// A buffer read (CUDA, [`AttentionCache::append_decode_in_buffer`]): inputs `[keys
    /// buffer, values buffer, bounds of the read, bounds after the write]`, no outputs (the
    /// attention kernel writes the new position into the buffers). The shapes stay the same
    /// from step to step, so the graph is traced with shapes, and holds Quince's kernels.
    Buffer,
}

impl DecodeFetch {
    /// Number of closure inputs a slot of this kind feeds.
    pub fn inputs(self) -> usize {
        match self {
            DecodeFetch::Concat => 2,
            DecodeFetch::Ring => 3,
            DecodeFetch::Buffer => 4,
        }
    }

    /// Number of graph outputs a slot of this kind takes back.
    pub fn outputs(self) -> usize {
        match self {
            DecodeFetch::Concat | DecodeFetch::Ring => 2,
            DecodeFetch::Buffer => 0,
        }
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

/// A key/value cache that owns its attention reads. See the module docs for the invariants.
pub trait AttentionCache: Cache {
    /// Decode: one new position (`L` = 1). The query sees every stored position up to and
    /// including the new one, limited to the sliding window.
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead>;
    /// Decode, as [`AttentionCache::append_decode`], for a step whose attention runs as the
    /// one-query kernel (CUDA, where [`buffer_reads_on`] and the kernel works): the read is a *buffer read*
    /// and the kernel writes the new position into the buffer itself, so the step has no
    /// slice-update op and no slice (a write in place, which MLX ops would only do by
    /// donation). `None` where this cache does not (inside a speculative round, a storage
    /// without it); the caller then appends by `append_decode`.
    fn append_decode_in_buffer(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<Option<AttentionRead>> {
        let _ = (keys, values);
        Ok(None)
    }
    /// Window: `L` new positions, causal within the window; query `i` sees the earlier
    /// positions and window positions `0..=i`, limited to the sliding window.
    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead>;
    /// Bidirectional window: as [`AttentionCache::append_window`], except that positions of
    /// one image block — a maximal run of consecutive `flags` set (`flags.len() == L`) — see
    /// each other in both directions, regardless of order and of the sliding window
    /// (mlx-vlm's rule for Gemma 4: `causal ∧ window ∨ same block`). Works at any offset; a
    /// block must not be split across appends.
    fn append_bidirectional(
        &mut self,
        keys: &Array,
        values: &Array,
        flags: &[bool],
    ) -> Result<AttentionRead>;

    /// Compiled decode, before the step: this cache's slot for a one-token step, or `None`
    /// when it cannot take part now (empty, inside a speculative round, or a storage without
    /// a compiled step); the step then runs uncompiled. A [`DecodeFetch::Ring`] slot takes the
    /// cache's buffers: the caller ends the step with [`AttentionCache::end_decode_step`] or
    /// gives them back with [`AttentionCache::abort_decode_step`].
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>> {
        Ok(None)
    }

    /// Compiled decode by buffer reads (CUDA): this cache's [`DecodeFetch::Buffer`] slot, or
    /// `None` when it cannot take part (as [`AttentionCache::begin_decode_step`]). The offset
    /// advances at [`AttentionCache::end_decode_step`].
    fn begin_buffer_step(&mut self) -> Result<Option<DecodeSlot>> {
        Ok(None)
    }

    /// Compiled decode, after the step: adopts the step's outputs for this slot (the stored
    /// positions or ring after appending one position) and advances the offset by one.
    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()> {
        let _ = (fetch, outputs);
        Err(Error::InvalidRequest("this cache takes no part in compiled decode".into()))
    }

    /// Compiled decode, after a failed step: takes back what
    /// [`AttentionCache::begin_decode_step`] handed over; the cache is as before.
    fn abort_decode_step(&mut self, slot: DecodeSlot) {
        let _ = slot;
    }
}

/// The stand-in a cache's slot puts in the traced decode graph: the model appends to it as to
/// the real cache, and what it would store becomes the step's outputs.
#[derive(Debug)]
pub(crate) struct TraceCache {
    fetch: DecodeFetch,
    inputs: Vec<Array>,
    /// Set by the append: the slot's outputs.
    pub(crate) outputs: Vec<Array>,
}

impl TraceCache {
    pub(crate) fn new(fetch: DecodeFetch, inputs: Vec<Array>) -> TraceCache {
        TraceCache { fetch, inputs, outputs: Vec::new() }
    }
}

impl Cache for TraceCache {
    fn offset(&self) -> usize {
        0
    }
    fn signature(&self) -> String {
        format!("trace({:?})", self.fetch)
    }
    fn bytes_per_token(&self) -> usize {
        0
    }
    fn buffers(&self) -> Vec<Array> {
        self.outputs.clone()
    }
    fn stored(&self) -> Result<Option<(Array, Array)>> {
        Err(trace_only())
    }
    fn state(&self) -> Result<CacheState> {
        Err(trace_only())
    }
    fn restore(&mut self, _: &CacheState) -> Result<()> {
        Err(trace_only())
    }
    fn is_trimmable(&self) -> bool {
        false
    }
    fn trim(&mut self, _: usize) -> Result<usize> {
        Err(trace_only())
    }
    fn spec_round_begin(&mut self) -> Result<()> {
        Err(trace_only())
    }
    fn spec_round_commit(&mut self) -> Result<()> {
        Err(trace_only())
    }
    fn spec_round_rollback(&mut self, _: usize) -> Result<()> {
        Err(trace_only())
    }
}

impl AttentionCache for TraceCache {
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        check_append(keys, values, true)?;
        let (k, v) = match self.fetch {
            DecodeFetch::Buffer => {
                return Err(Error::InvalidRequest(
                    "a buffer slot of a traced step is read by the attention kernel".into(),
                ));
            }
            DecodeFetch::Concat => (
                mlx::ops::concatenate(&[&self.inputs[0], keys], 2)?,
                mlx::ops::concatenate(&[&self.inputs[1], values], 2)?,
            ),
            DecodeFetch::Ring => (
                self.inputs[0].slice_update_dynamic(keys, &self.inputs[2], &[2])?,
                self.inputs[1].slice_update_dynamic(values, &self.inputs[2], &[2])?,
            ),
        };
        self.outputs = vec![k.clone(), v.clone()];
        // Every stored position is visible to the new one: a ring only takes part once full,
        // when it holds exactly the window.
        Ok(AttentionRead::new(k, v, ReadMask::None))
    }
    fn append_decode_in_buffer(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<Option<AttentionRead>> {
        check_append(keys, values, true)?;
        let [kbuf, vbuf, bounds, after] = self.inputs.as_slice() else {
            return Ok(None);
        };
        if self.fetch != DecodeFetch::Buffer {
            return Ok(None);
        }
        let after_bounds = Rc::new(OnceCell::from(after.clone()));
        let buffer = BufferRead {
            bounds: bounds.clone(),
            fresh: Some((keys.clone(), values.clone())),
            after: -1,
            after_bounds,
        };
        Ok(Some(AttentionRead::buffered(kbuf.clone(), vbuf.clone(), buffer)))
    }
    fn append_window(&mut self, _: &Array, _: &Array) -> Result<AttentionRead> {
        Err(trace_only())
    }
    fn append_bidirectional(&mut self, _: &Array, _: &Array, _: &[bool]) -> Result<AttentionRead> {
        Err(trace_only())
    }
}

fn trace_only() -> Error {
    Error::InvalidRequest("a traced decode step only appends one decode position".into())
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

/// Block id per position: the index of its run of consecutive `flags`, or −1.
pub(crate) fn block_ids(flags: &[bool]) -> Vec<i32> {
    let mut ids = Vec::with_capacity(flags.len());
    let mut next = 0;
    for (i, &f) in flags.iter().enumerate() {
        if !f {
            ids.push(-1);
        } else {
            if i == 0 || !flags[i - 1] {
                next += 1;
            }
            ids.push(next - 1);
        }
    }
    ids
}

/// `[L, prior + L]` bool: query `i` (at column `prior + i`) sees column `j` when `j ≤ prior + i`
/// and `prior + i − j < window` (no window: `None`), or when both are new positions in the same
/// block.
pub(crate) fn overlay_mask(prior: usize, flags: &[bool], window: Option<usize>) -> Result<Array> {
    let blocks = block_ids(flags);
    let length = flags.len();
    let total = prior + length;
    let mut visible = Vec::with_capacity(length * total);
    for i in 0..length {
        let q = prior + i;
        for j in 0..total {
            let causal = j <= q && window.is_none_or(|w| q - j < w);
            let same = j >= prior && blocks[i] >= 0 && blocks[i] == blocks[j - prior];
            visible.push(causal || same);
        }
    }
    Ok(Array::from_slice(&visible, &[length as i32, total as i32])?)
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
