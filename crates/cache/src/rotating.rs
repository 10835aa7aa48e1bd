//! A sliding-window ring: the last `window` positions, overwritten in place when full.
//!
//! Layout: buffers `[B, H, window, D]`. While fewer than `window` positions are stored they sit
//! in temporal order at `0..len`; once full, `cursor` points at the oldest position, which the
//! next decode overwrites. A window append reads the stored positions in temporal order plus
//! the new ones (so every new query sees a full window of history) and keeps the last
//! `window` of them.

use mlx::{Array, Dtype, ops};

use super::kv::{self, KvEncoding, Precision};
use super::{
    AttentionCache, AttentionRead, BidirectionalAttentionCache, BlockAttentionCache, Cache,
    CacheState, CommittedAttentionCache, CompiledDecodeCache, DecodeFetch, DecodeSlot, ReadMask,
    SlotKind, check_append, check_signature, concat_slot, overlay_mask,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// Keys and values of the last `window` positions, in the parts of the codec they are stored
/// in.
#[derive(Debug)]
pub struct RotatingCache {
    window: usize,
    parts: Option<Vec<Array>>,
    /// Stored positions, at most `window`.
    len: usize,
    /// Where the next decode writes: `len` until full, then the oldest slot.
    cursor: usize,
    offset: usize,
    /// The armed speculative round.
    round: Option<Round>,
    precision: Precision,
    /// What its reads run.
    ops: Ops,
}

/// What an armed round goes back to: the ring as it was, and every position appended since
/// (encoded: a due conversion waits for the round's end, so the codec does not change inside
/// it).
#[derive(Debug)]
struct Round {
    parts: Option<Vec<Array>>,
    len: usize,
    cursor: usize,
    offset: usize,
    appended: Vec<Vec<Array>>,
}

impl RotatingCache {
    /// An empty ring for a sliding window of `window` positions (a key is visible to a query
    /// `window − 1` positions later, not `window`).
    pub fn new(window: usize) -> Result<RotatingCache> {
        RotatingCache::encoded(window, KvEncoding::full(), &Ops::mlx())
    }

    /// An empty ring of `encoding` whose reads run `ops`.
    pub fn encoded(window: usize, encoding: KvEncoding, ops: &Ops) -> Result<RotatingCache> {
        if window == 0 {
            return Err(Error::InvalidRequest(
                "a sliding window needs at least one position".into(),
            ));
        }
        Ok(RotatingCache {
            window,
            parts: None,
            len: 0,
            cursor: 0,
            offset: 0,
            round: None,
            precision: Precision::new(encoding),
            ops: ops.clone(),
        })
    }

    /// The ring a row of shared buffers leaves as: its slots as they were in the batch.
    pub(crate) fn from_slots(row: super::SlotRow) -> Result<RotatingCache> {
        let window =
            row.window.ok_or_else(|| Error::InvalidRequest("a plain row is not a ring".into()))?;
        Ok(RotatingCache {
            window,
            parts: row.parts,
            len: row.stored,
            cursor: row.cursor,
            offset: row.offset,
            round: None,
            precision: row.precision,
            ops: row.ops,
        })
    }

    /// This ring with its reads run by `ops`.
    pub fn with_ops(mut self, ops: &Ops) -> RotatingCache {
        self.ops = ops.clone();
        self
    }

    /// The sliding window length.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The last `n` stored positions of `buffers` in temporal order (`n <= len`).
    fn recent(&self, buffers: &[Array], n: usize) -> Result<Option<Vec<Array>>> {
        if n == 0 {
            return Ok(None);
        }
        let ordered = if self.len < self.window || self.cursor == 0 {
            kv::positions(buffers, self.len - n, self.len)?
        } else {
            // Full ring: oldest at `cursor`. Temporal order is [cursor..window] ++ [0..cursor].
            let tail = kv::positions(buffers, self.cursor, self.window)?;
            let head = kv::positions(buffers, 0, self.cursor)?;
            let all = kv::concat_positions(&tail, &head)?;
            kv::positions(&all, self.window - n, self.window)?
        };
        Ok(Some(ordered))
    }

    /// The stored positions in temporal order, `None` while empty.
    fn temporal(&self) -> Result<Option<Vec<Array>>> {
        match &self.parts {
            Some(parts) => self.recent(parts, self.len),
            None => Ok(None),
        }
    }

    /// Buffers with all `window` slots holding `entries` (`n <= window` positions) at `0..n`.
    fn buffer_from(&self, entries: &[Array]) -> Result<Vec<Array>> {
        let n = kv::position_count(entries)?;
        if n == self.window {
            return Ok(entries.to_vec());
        }
        kv::concat_positions(entries, &kv::zero_positions(entries, self.window - n)?)
    }

    /// Stores `new` (encoded, `L` positions) in the slots `L` decode steps would write: the
    /// ring keeps the last `window` positions, position `p` in slot `(cursor + p − offset) mod
    /// window`. What a speculative round's appends store, so that the ring after a commit or
    /// a rollback is the ring of plain decoding.
    fn ring_append(&mut self, new: &[Array]) -> Result<()> {
        let length = kv::position_count(new)?;
        if let Some(buffers) = &self.parts
            && length < self.window
        {
            // A compiled step before the ring fills stores exactly the positions it holds,
            // which a write into the ring pads out first.
            let buffers = self.buffer_from(buffers)?;
            // Into the slots from the cursor on, wrapping to slot 0: what `length` decode
            // steps write, in one or two updates.
            let first = length.min(self.window - self.cursor);
            let head = kv::positions(new, 0, first)?;
            let mut out = kv::write_positions(&buffers, &head, self.cursor)?;
            if first < length {
                out = kv::write_positions(&out, &kv::positions(new, first, length)?, 0)?;
            }
            self.parts = Some(out);
            self.len = (self.len + length).min(self.window);
            self.cursor = (self.cursor + length) % self.window;
            self.offset += length;
            return Ok(());
        }
        let keep = (self.len + length).min(self.window);
        // Stored positions that survive, oldest first, then the new ones.
        let survivors = keep.saturating_sub(length).min(self.len);
        let joined = match &self.parts {
            Some(buffers) if survivors > 0 => {
                let old = self
                    .recent(buffers, survivors)?
                    .ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
                kv::concat_positions(&old, new)?
            }
            _ => new.to_vec(),
        };
        let total = kv::position_count(&joined)?;
        let temporal = kv::positions(&joined, total - keep, total)?;
        let cursor = if keep == self.window { (self.cursor + length) % self.window } else { keep };
        let buffers = if keep == self.window {
            ring_layout(&temporal, cursor)?
        } else {
            self.buffer_from(&temporal)?
        };
        self.parts = Some(buffers);
        self.len = keep;
        self.cursor = cursor;
        self.offset += length;
        Ok(())
    }

    /// Records an append of the armed round.
    fn record(&mut self, new: &[Array]) {
        if let Some(round) = &mut self.round {
            round.appended.push(new.to_vec());
        }
    }

    /// Applies a due conversion (outside rounds): every slot of the ring at once.
    fn settle(&mut self) -> Result<()> {
        if self.round.is_some() || !self.precision.due(self.offset) {
            return Ok(());
        }
        if let Some(parts) = &self.parts {
            let parts = parts.clone();
            self.parts = Some(self.precision.convert(&parts, self.offset)?);
        }
        Ok(())
    }
}

impl Cache for RotatingCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn signature(&self) -> String {
        format!("rotating(window={}){}", self.window, self.precision.encoding().signature())
    }

    fn bytes_per_token(&self) -> usize {
        self.parts.as_deref().map_or(0, kv::bytes_per_position)
    }

    fn stored_positions(&self) -> usize {
        self.len
    }

    fn max_append(&self) -> Option<usize> {
        self.precision.max_append(self.offset)
    }

    fn minimum_reusable_offset(&self) -> usize {
        self.precision.minimum_reusable_offset()
    }

    fn buffers(&self) -> Vec<Array> {
        self.parts.clone().unwrap_or_default()
    }

    fn state(&self) -> Result<CacheState> {
        let Some(parts) = self.temporal()? else {
            return Err(Error::InvalidRequest("an empty cache has no state to save".into()));
        };
        let mut state =
            CacheState::of(self.signature(), self.offset, self.precision.codec(), parts);
        state.metadata.insert("window".into(), self.window.to_string());
        // Where the oldest position sits in a full ring, so a restore rebuilds the same
        // physical layout (and attention sums in the same order: bit-identical reads).
        state.metadata.insert("cursor".into(), self.cursor.to_string());
        self.precision.save(&mut state.metadata);
        Ok(state)
    }

    fn restore(&mut self, state: &CacheState) -> Result<()> {
        if self.round.is_some() {
            return Err(super::round_error("no restore inside a round"));
        }
        check_signature(state, &self.signature())?;
        let offset = state.number("offset")?;
        let precision = self.precision.restored(state, offset)?;
        let parts = state.parts(precision.codec())?;
        let len = kv::position_count(&parts)?;
        if len > self.window || len > offset || (len < self.window && len != offset) {
            return Err(Error::InvalidRequest(format!(
                "rotating cache state of {len} positions does not fit window {} at offset {offset}",
                self.window
            )));
        }
        let cursor = if len == self.window {
            state.number("cursor").unwrap_or(0) % self.window
        } else {
            len % self.window
        };
        self.parts = Some(self.buffer_from(&ring_layout(&parts, cursor)?)?);
        self.len = len;
        self.cursor = cursor;
        self.offset = offset;
        self.precision = precision;
        Ok(())
    }

    fn is_trimmable(&self) -> bool {
        // Trimming is exact only while nothing has been evicted.
        self.len == self.offset
    }

    fn trim(&mut self, n: usize) -> Result<usize> {
        if self.round.is_some() {
            return Err(super::round_error("no trim inside a round"));
        }
        if !self.is_trimmable() {
            return Err(Error::InvalidRequest(format!(
                "a sliding-window cache that evicted positions cannot be trimmed (offset {}, window {})",
                self.offset, self.window
            )));
        }
        let n = n.min(self.offset);
        let floor = self.minimum_reusable_offset();
        if self.offset - n < floor {
            return Err(Error::InvalidRequest(format!(
                "a cache converted at {floor} positions cannot be trimmed to {}",
                self.offset - n
            )));
        }
        self.len -= n;
        self.offset -= n;
        self.cursor = self.len % self.window;
        Ok(n)
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(super::round_error("a round is already armed"));
        }
        self.round = Some(Round {
            parts: self.parts.clone(),
            len: self.len,
            cursor: self.cursor,
            offset: self.offset,
            appended: Vec::new(),
        });
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        // The round's appends already stored their positions where decode steps would have.
        self.round.take().ok_or_else(|| super::round_error("commit without a round"))?;
        self.settle()
    }

    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        let Some(round) = &self.round else {
            return Err(super::round_error("rollback without a round"));
        };
        let appended = self.offset - round.offset;
        if keep > appended {
            return Err(super::round_error(&format!(
                "cannot keep {keep} of the {appended} positions appended"
            )));
        }
        let kept = match round.appended.split_first() {
            Some((first, rest)) if keep > 0 => {
                let mut all = first.clone();
                for more in rest {
                    all = kv::concat_positions(&all, more)?;
                }
                Some(kv::positions(&all, 0, keep)?)
            }
            _ => None,
        };
        let Some(round) = self.round.take() else {
            return Err(super::round_error("rollback without a round"));
        };
        // Back to the ring before the round, then the kept positions into their decode slots.
        self.parts = round.parts;
        self.len = round.len;
        self.cursor = round.cursor;
        self.offset = round.offset;
        if let Some(kept) = kept {
            self.ring_append(&kept)?;
        }
        self.settle()
    }

    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }

    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }

    fn empty_rows(&self, layout: super::RowLayout) -> Option<Box<dyn Cache>> {
        Some(super::slot_rows::kv_rows(self.precision.encoding(), layout))
    }

    fn take_slots(&mut self) -> Option<super::SlotRow> {
        if self.round.is_some() || !self.precision.encoding().format.is_full() {
            return None;
        }
        let parts = match &self.parts {
            Some(parts) => Some(kv::positions(parts, 0, self.len).ok()?),
            None => None,
        };
        let empty =
            RotatingCache::encoded(self.window, self.precision.encoding(), &self.ops).ok()?;
        let this = std::mem::replace(self, empty);
        Some(super::SlotRow {
            parts,
            offset: this.offset,
            stored: this.len,
            cursor: this.cursor,
            window: Some(this.window),
            precision: this.precision,
            ops: this.ops,
        })
    }
}

impl AttentionCache for RotatingCache {
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        check_append(keys, values, true)?;
        if self.round.is_some() {
            self.precision.check_round_append(self.offset, 1)?;
        }
        let new = self.precision.codec().encode_kv(keys, values)?;
        let buffers = match &self.parts {
            Some(parts) => self.buffer_from(parts)?,
            None => kv::zero_positions(&new, self.window)?,
        };
        let buffers = kv::write_positions(&buffers, &new, self.cursor)?;
        let len = (self.len + 1).min(self.window);
        // Every stored position is inside the window of the newest one: no mask. Attention is
        // order-free once keys carry their rotary positions, so the ring needs no unrolling.
        let read = kv::positions(&buffers, 0, len)?;
        self.parts = Some(buffers);
        self.len = len;
        self.cursor = (self.cursor + 1) % self.window;
        self.offset += 1;
        self.record(&new);
        let read = AttentionRead::one_query(read, self.precision.codec(), &self.ops);
        self.settle()?;
        Ok(read)
    }

    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        self.append_span(keys, values, None)
    }

    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        let Some(parts) = &self.parts else {
            return Ok(None);
        };
        let slots = kv::positions(parts, 0, self.len)?;
        Ok(Some(AttentionRead::one_query(slots, self.precision.codec(), &self.ops)))
    }

    fn bidirectional(&mut self) -> Option<&mut dyn BidirectionalAttentionCache> {
        Some(self)
    }

    fn compiled(&mut self) -> Option<&mut dyn CompiledDecodeCache> {
        Some(self)
    }

    fn committed(&mut self) -> Option<&mut dyn CommittedAttentionCache> {
        Some(self)
    }

    fn block(&self) -> Option<&dyn BlockAttentionCache> {
        Some(self)
    }
}

impl CommittedAttentionCache for RotatingCache {}

impl BlockAttentionCache for RotatingCache {
    fn read_block(&self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        super::block_read(self.donor_read()?, keys, values, self.precision.codec(), &self.ops)
    }
}

impl BidirectionalAttentionCache for RotatingCache {
    fn append_bidirectional(
        &mut self,
        keys: &Array,
        values: &Array,
        flags: &[bool],
    ) -> Result<AttentionRead> {
        let length = check_append(keys, values, false)?;
        super::check_flags(flags, length)?;
        self.append_span(keys, values, Some(flags))
    }
}

impl CompiledDecodeCache for RotatingCache {
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>> {
        if self.round.is_some() {
            return Ok(None);
        }
        let Some(parts) = &self.parts else {
            return Ok(None);
        };
        if self.len < self.window {
            // Filling: positions sit in order at 0..len, the new one goes after them.
            return Ok(Some(concat_slot(parts, self.len, self.precision.codec())?));
        }
        let slot = Array::from_slice(&[self.cursor as i32], &[1])?;
        let Some(mut inputs) = self.parts.take() else {
            return Ok(None);
        };
        inputs.push(slot);
        let kind = SlotKind { fetch: DecodeFetch::Ring, codec: self.precision.codec().clone() };
        Ok(Some(DecodeSlot { kind, inputs }))
    }

    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()> {
        super::step_outputs(&outputs, self.precision.codec())?;
        self.parts = Some(outputs);
        if fetch == DecodeFetch::Concat {
            self.len += 1;
        }
        self.cursor = (self.cursor + 1) % self.window;
        self.offset += 1;
        self.settle()
    }

    fn abort_decode_step(&mut self, slot: DecodeSlot) {
        if slot.kind.fetch == DecodeFetch::Ring {
            let mut inputs = slot.inputs;
            inputs.pop();
            self.parts = Some(inputs);
        }
    }
}

impl RotatingCache {
    /// A window append, with the image-block overlay when `flags` is given.
    fn append_span(
        &mut self,
        keys: &Array,
        values: &Array,
        flags: Option<&[bool]>,
    ) -> Result<AttentionRead> {
        let length = check_append(keys, values, false)?;
        if self.round.is_some() {
            self.precision.check_round_append(self.offset, length)?;
        }
        let new = self.precision.codec().encode_kv(keys, values)?;
        // History every new query may need: the last window − 1 stored positions.
        let prior_len = self.len.min(self.window - 1);
        let full = match &self.parts {
            Some(parts) if prior_len > 0 => {
                let prior = self
                    .recent(parts, prior_len)?
                    .ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
                kv::concat_positions(&prior, &new)?
            }
            _ => new.clone(),
        };
        let total = prior_len + length;
        let mask = match flags {
            Some(flags) => ReadMask::Array(overlay_mask(prior_len, flags, Some(self.window))?),
            None if total <= self.window => {
                if length == 1 {
                    ReadMask::None
                } else {
                    ReadMask::Causal
                }
            }
            None => ReadMask::Array(shared_window_mask(length, prior_len, self.window)?),
        };
        let codec = self.precision.codec().clone();
        if self.round.is_some() {
            // Inside a round, positions go where decode steps would put them.
            self.ring_append(&new)?;
            self.record(&new);
            return Ok(AttentionRead::masked(full, &codec, mask, &self.ops));
        }
        let keep = total.min(self.window);
        let kept = kv::positions(&full, total - keep, total)?;
        self.parts = Some(self.buffer_from(&kept)?);
        self.len = keep;
        self.cursor = keep % self.window;
        self.offset += length;
        let read = AttentionRead::masked(full, &codec, mask, &self.ops);
        self.settle()?;
        Ok(read)
    }
}

/// Entries in temporal order laid out as a full ring whose oldest slot is `cursor`.
fn ring_layout(temporal: &[Array], cursor: usize) -> Result<Vec<Array>> {
    if cursor == 0 {
        return Ok(temporal.to_vec());
    }
    let n = kv::position_count(temporal)?;
    let split = n - cursor; // temporal[..split] goes to slots cursor.., the rest to 0..cursor
    let older = kv::positions(temporal, 0, split)?;
    let newer = kv::positions(temporal, split, n)?;
    kv::concat_positions(&newer, &older)
}

/// A window mask's geometry: new positions, prior positions, window.
type MaskKey = (usize, usize, usize);

thread_local! {
    /// The last window mask made, with its geometry: every sliding layer of one forward pass
    /// appends with the same geometry, so they share one mask (one node in the graph).
    static LAST_MASK: std::cell::RefCell<Option<(MaskKey, Array)>> =
        const { std::cell::RefCell::new(None) };
}

/// [`window_mask`], made once for a run of appends with the same geometry.
fn shared_window_mask(length: usize, prior: usize, window: usize) -> Result<Array> {
    let key = (length, prior, window);
    if let Some(mask) =
        LAST_MASK.with_borrow(|m| m.as_ref().filter(|(k, _)| *k == key).map(|(_, a)| a.clone()))
    {
        return Ok(mask);
    }
    let mask = window_mask(length, prior, window)?;
    LAST_MASK.with_borrow_mut(|m| *m = Some((key, mask.clone())));
    Ok(mask)
}

/// `[L, P + L]` bool: query `i` (at column `P + i`) sees column `j` when `j <= P + i` and
/// `P + i − j < window`.
fn window_mask(length: usize, prior: usize, window: usize) -> Result<Array> {
    let q = ops::arange(prior as f64, (prior + length) as f64, 1.0, Dtype::Int32)?
        .reshape(&[length as i32, 1])?;
    let k = ops::arange(0.0, (prior + length) as f64, 1.0, Dtype::Int32)?
        .reshape(&[1, (prior + length) as i32])?;
    let causal = q.ge(&k)?;
    let within = q.subtract(&k)?.lt(&Array::scalar(window as i32)?)?;
    Ok(causal.logical_and(&within)?)
}
