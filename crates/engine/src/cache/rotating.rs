//! A sliding-window ring: the last `window` positions, overwritten in place when full.
//!
//! Layout: buffers `[B, H, window, D]`. While fewer than `window` positions are stored they sit
//! in temporal order at `0..len`; once full, `cursor` points at the oldest position, which the
//! next decode overwrites. A window append reads the stored positions in temporal order plus
//! the new ones (so every new query sees a full window of history) and keeps the last
//! `window` of them.

use mlx::{Array, Dtype, ops};

use super::{
    AttentionCache, AttentionRead, BidirectionalAttentionCache, BlockAttentionCache, Cache,
    CacheState, CommittedAttentionCache, CompiledDecodeCache, DecodeFetch, DecodeSlot, ReadMask,
    check_append, check_signature, concat_slot, overlay_mask, state_of, state_tensor, step_outputs,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// Keys and values of the last `window` positions.
#[derive(Debug)]
pub struct RotatingCache {
    window: usize,
    keys: Option<Array>,
    values: Option<Array>,
    /// Stored positions, at most `window`.
    len: usize,
    /// Where the next decode writes: `len` until full, then the oldest slot.
    cursor: usize,
    offset: usize,
    /// The armed speculative round.
    round: Option<Round>,
    /// What its reads run.
    ops: Ops,
}

/// What an armed round goes back to: the ring as it was, and every position appended since.
#[derive(Debug)]
struct Round {
    keys: Option<Array>,
    values: Option<Array>,
    len: usize,
    cursor: usize,
    offset: usize,
    appended_keys: Vec<Array>,
    appended_values: Vec<Array>,
}

impl RotatingCache {
    /// An empty ring for a sliding window of `window` positions (a key is visible to a query
    /// `window − 1` positions later, not `window`).
    pub fn new(window: usize) -> Result<RotatingCache> {
        if window == 0 {
            return Err(Error::InvalidRequest(
                "a sliding window needs at least one position".into(),
            ));
        }
        Ok(RotatingCache {
            window,
            keys: None,
            values: None,
            len: 0,
            cursor: 0,
            offset: 0,
            round: None,
            ops: Ops::mlx(),
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

    /// The last `n` stored positions in temporal order (`n <= len`).
    fn recent(&self, buffer: &Array, n: usize) -> Result<Option<Array>> {
        if n == 0 {
            return Ok(None);
        }
        let s = buffer.shape();
        let span = |from: usize, to: usize| {
            buffer.slice(&[0, 0, from as i32, 0], &[s[0], s[1], to as i32, s[3]], &[1, 1, 1, 1])
        };
        let ordered = if self.len < self.window || self.cursor == 0 {
            span(self.len - n, self.len)?
        } else {
            // Full ring: oldest at `cursor`. Temporal order is [cursor..window] ++ [0..cursor].
            let tail = span(self.cursor, self.window)?;
            let head = span(0, self.cursor)?;
            let all = ops::concatenate(&[&tail, &head], 2)?;
            all.slice(
                &[0, 0, (self.window - n) as i32, 0],
                &[s[0], s[1], self.window as i32, s[3]],
                &[1, 1, 1, 1],
            )?
        };
        Ok(Some(ordered))
    }

    /// A zeroed `[B, H, window, D]` buffer shaped like `like` on the other axes.
    fn empty_like(&self, like: &Array) -> Result<Array> {
        let s = like.shape();
        Ok(ops::zeros(&[s[0], s[1], self.window as i32, s[3]], like.dtype())?)
    }

    /// A `[B, H, window, D]` buffer holding `entries` (`[B, H, n, D]`, n <= window) at `0..n`.
    fn buffer_from(&self, entries: &Array) -> Result<Array> {
        let s = entries.shape();
        let n = s[2];
        let w = self.window as i32;
        if n == w {
            return Ok(entries.clone());
        }
        let zeros = ops::zeros(&[s[0], s[1], w - n, s[3]], entries.dtype())?;
        Ok(ops::concatenate(&[entries, &zeros], 2)?)
    }

    /// `buffer` with all `window` slots: a compiled decode step before the ring fills stores
    /// exactly the positions it holds, which a write into the ring pads out first.
    fn full_size(&self, buffer: &Array) -> Result<Array> {
        if buffer.dim(2)? as usize == self.window {
            return Ok(buffer.clone());
        }
        self.buffer_from(buffer)
    }

    /// Stores `keys`/`values` (`[B, H, L, D]`) in the slots `L` decode steps would write: the
    /// ring keeps the last `window` positions, position `p` in slot `(cursor + p − offset) mod
    /// window`. What a speculative round's appends store, so that the ring after a commit or
    /// a rollback is the ring of plain decoding.
    fn ring_append(&mut self, keys: &Array, values: &Array) -> Result<()> {
        let length = keys.dim(2)? as usize;
        if let (Some(kbuf), Some(vbuf)) = (&self.keys, &self.values)
            && length < self.window
        {
            let (kbuf, vbuf) = (&self.full_size(kbuf)?, &self.full_size(vbuf)?);
            // Into the slots from the cursor on, wrapping to slot 0: what `length` decode
            // steps write, in one or two updates.
            let first = length.min(self.window - self.cursor);
            let at = self.cursor as i32;
            let write = |buffer: &Array, new: &Array| -> Result<Array> {
                let s = new.shape();
                let part = |from: usize, to: usize| {
                    new.slice(
                        &[0, 0, from as i32, 0],
                        &[s[0], s[1], to as i32, s[3]],
                        &[1, 1, 1, 1],
                    )
                };
                let head = if first == length { new.clone() } else { part(0, first)? };
                let mut out = buffer.slice_update(
                    &head,
                    &[0, 0, at, 0],
                    &[s[0], s[1], at + first as i32, s[3]],
                    &[1, 1, 1, 1],
                )?;
                if first < length {
                    let rest = (length - first) as i32;
                    out = out.slice_update(
                        &part(first, length)?,
                        &[0, 0, 0, 0],
                        &[s[0], s[1], rest, s[3]],
                        &[1, 1, 1, 1],
                    )?;
                }
                Ok(out)
            };
            let (kbuf, vbuf) = (write(kbuf, keys)?, write(vbuf, values)?);
            self.keys = Some(kbuf);
            self.values = Some(vbuf);
            self.len = (self.len + length).min(self.window);
            self.cursor = (self.cursor + length) % self.window;
            self.offset += length;
            return Ok(());
        }
        let keep = (self.len + length).min(self.window);
        // Stored positions that survive, oldest first, then the new ones.
        let survivors = keep.saturating_sub(length).min(self.len);
        let latest = |buffer: Option<&Array>, new: &Array| -> Result<Array> {
            let joined = match buffer {
                Some(b) if survivors > 0 => {
                    let old = self
                        .recent(b, survivors)?
                        .ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
                    ops::concatenate(&[&old, new], 2)?
                }
                _ => new.clone(),
            };
            let s = joined.shape();
            Ok(joined.slice(&[0, 0, s[2] - keep as i32, 0], &s, &[1, 1, 1, 1])?)
        };
        let temporal_k = latest(self.keys.as_ref(), keys)?;
        let temporal_v = latest(self.values.as_ref(), values)?;
        let cursor = if keep == self.window { (self.cursor + length) % self.window } else { keep };
        let (kbuf, vbuf) = if keep == self.window {
            (ring_layout(&temporal_k, cursor)?, ring_layout(&temporal_v, cursor)?)
        } else {
            (self.buffer_from(&temporal_k)?, self.buffer_from(&temporal_v)?)
        };
        self.keys = Some(kbuf);
        self.values = Some(vbuf);
        self.len = keep;
        self.cursor = cursor;
        self.offset += length;
        Ok(())
    }

    /// Records an append of the armed round.
    fn record(&mut self, keys: &Array, values: &Array) {
        if let Some(round) = &mut self.round {
            round.appended_keys.push(keys.clone());
            round.appended_values.push(values.clone());
        }
    }
}

impl Cache for RotatingCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn signature(&self) -> String {
        format!("rotating(window={})", self.window)
    }

    fn bytes_per_token(&self) -> usize {
        super::bytes_per_position(self.keys.as_ref(), self.values.as_ref())
    }

    fn stored_positions(&self) -> usize {
        self.len
    }

    fn buffers(&self) -> Vec<Array> {
        self.keys.iter().chain(&self.values).cloned().collect()
    }

    fn state(&self) -> Result<CacheState> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Err(Error::InvalidRequest("an empty cache has no state to save".into()));
        };
        let keys =
            self.recent(k, self.len)?.ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
        let values =
            self.recent(v, self.len)?.ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
        let mut state = state_of(self.signature(), self.offset, keys, values);
        state.metadata.insert("window".into(), self.window.to_string());
        // Where the oldest position sits in a full ring, so a restore rebuilds the same
        // physical layout (and attention sums in the same order: bit-identical reads).
        state.metadata.insert("cursor".into(), self.cursor.to_string());
        Ok(state)
    }

    fn restore(&mut self, state: &CacheState) -> Result<()> {
        if self.round.is_some() {
            return Err(super::round_error("no restore inside a round"));
        }
        check_signature(state, &self.signature())?;
        let offset = state.number("offset")?;
        let keys = state_tensor(state, "keys")?;
        let values = state_tensor(state, "values")?;
        let len = keys.dim(2)? as usize;
        if len > self.window
            || len > offset
            || values.dim(2)? as usize != len
            || (len < self.window && len != offset)
        {
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
        self.keys = Some(self.buffer_from(&ring_layout(keys, cursor)?)?);
        self.values = Some(self.buffer_from(&ring_layout(values, cursor)?)?);
        self.len = len;
        self.cursor = cursor;
        self.offset = offset;
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
            keys: self.keys.clone(),
            values: self.values.clone(),
            len: self.len,
            cursor: self.cursor,
            offset: self.offset,
            appended_keys: Vec::new(),
            appended_values: Vec::new(),
        });
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        // The round's appends already stored their positions where decode steps would have.
        self.round.take().map(|_| ()).ok_or_else(|| super::round_error("commit without a round"))
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
        let kept = |parts: &[Array]| -> Result<Option<Array>> {
            if keep == 0 {
                return Ok(None);
            }
            let all = ops::concatenate(&parts.iter().collect::<Vec<_>>(), 2)?;
            let s = all.shape();
            Ok(Some(all.slice(&[0, 0, 0, 0], &[s[0], s[1], keep as i32, s[3]], &[1, 1, 1, 1])?))
        };
        let kept_keys = kept(&round.appended_keys)?;
        let kept_values = kept(&round.appended_values)?;
        let Some(round) = self.round.take() else {
            return Err(super::round_error("rollback without a round"));
        };
        // Back to the ring before the round, then the kept positions into their decode slots.
        self.keys = round.keys;
        self.values = round.values;
        self.len = round.len;
        self.cursor = round.cursor;
        self.offset = round.offset;
        if let (Some(k), Some(v)) = (kept_keys, kept_values) {
            self.ring_append(&k, &v)?;
        }
        Ok(())
    }

    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }

    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }
}

impl AttentionCache for RotatingCache {
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        check_append(keys, values, true)?;
        let (kbuf, vbuf) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) => (self.full_size(k)?, self.full_size(v)?),
            _ => (self.empty_like(keys)?, self.empty_like(values)?),
        };
        let at = self.cursor as i32;
        let (ks, vs) = (keys.shape(), values.shape());
        let kbuf =
            kbuf.slice_update(keys, &[0, 0, at, 0], &[ks[0], ks[1], at + 1, ks[3]], &[1, 1, 1, 1])?;
        let vbuf = vbuf.slice_update(
            values,
            &[0, 0, at, 0],
            &[vs[0], vs[1], at + 1, vs[3]],
            &[1, 1, 1, 1],
        )?;
        let len = (self.len + 1).min(self.window);
        // Every stored position is inside the window of the newest one: no mask. Attention is
        // order-free once keys carry their rotary positions, so the ring needs no unrolling.
        let (read_k, read_v) = if len < self.window {
            let end = len as i32;
            (
                kbuf.slice(&[0, 0, 0, 0], &[ks[0], ks[1], end, ks[3]], &[1, 1, 1, 1])?,
                vbuf.slice(&[0, 0, 0, 0], &[vs[0], vs[1], end, vs[3]], &[1, 1, 1, 1])?,
            )
        } else {
            (kbuf.clone(), vbuf.clone())
        };
        self.keys = Some(kbuf);
        self.values = Some(vbuf);
        self.len = len;
        self.cursor = (self.cursor + 1) % self.window;
        self.offset += 1;
        self.record(keys, values);
        Ok(AttentionRead::one_query(read_k, read_v, &self.ops))
    }

    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        self.append_span(keys, values, None)
    }

    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        let slots = |b: &Array| -> Result<Array> {
            if self.len == self.window {
                return Ok(b.clone());
            }
            let s = b.shape();
            Ok(b.slice(&[0, 0, 0, 0], &[s[0], s[1], self.len as i32, s[3]], &[1, 1, 1, 1])?)
        };
        Ok(Some(AttentionRead::one_query(slots(k)?, slots(v)?, &self.ops)))
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
        super::block_read(self.donor_read()?, keys, values, &self.ops)
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
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        if self.len < self.window {
            // Filling: positions sit in order at 0..len, the new one goes after them.
            return Ok(Some(concat_slot(k, v, self.len)?));
        }
        let slot = Array::from_slice(&[self.cursor as i32], &[1])?;
        let (Some(k), Some(v)) = (self.keys.take(), self.values.take()) else {
            return Ok(None);
        };
        Ok(Some(DecodeSlot { fetch: DecodeFetch::Ring, inputs: vec![k, v, slot] }))
    }

    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()> {
        let (keys, values) = step_outputs(outputs)?;
        self.keys = Some(keys);
        self.values = Some(values);
        if fetch == DecodeFetch::Concat {
            self.len += 1;
        }
        self.cursor = (self.cursor + 1) % self.window;
        self.offset += 1;
        Ok(())
    }

    fn abort_decode_step(&mut self, slot: DecodeSlot) {
        if slot.fetch == DecodeFetch::Ring {
            let mut inputs = slot.inputs.into_iter();
            self.keys = inputs.next();
            self.values = inputs.next();
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
        // History every new query may need: the last window − 1 stored positions.
        let prior_len = self.len.min(self.window - 1);
        let (full_k, full_v) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) if prior_len > 0 => {
                let pk = self
                    .recent(k, prior_len)?
                    .ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
                let pv = self
                    .recent(v, prior_len)?
                    .ok_or_else(|| Error::InvalidRequest("empty ring".into()))?;
                (ops::concatenate(&[&pk, keys], 2)?, ops::concatenate(&[&pv, values], 2)?)
            }
            _ => (keys.clone(), values.clone()),
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
        if self.round.is_some() {
            // Inside a round, positions go where decode steps would put them.
            self.ring_append(keys, values)?;
            self.record(keys, values);
            return Ok(AttentionRead::masked(full_k, full_v, mask, &self.ops));
        }
        let keep = total.min(self.window);
        let (fs, vs) = (full_k.shape(), full_v.shape());
        let from = (total - keep) as i32;
        let kept_k =
            full_k.slice(&[0, 0, from, 0], &[fs[0], fs[1], total as i32, fs[3]], &[1, 1, 1, 1])?;
        let kept_v =
            full_v.slice(&[0, 0, from, 0], &[vs[0], vs[1], total as i32, vs[3]], &[1, 1, 1, 1])?;
        let kbuf = self.buffer_from(&kept_k)?;
        let vbuf = self.buffer_from(&kept_v)?;
        self.keys = Some(kbuf);
        self.values = Some(vbuf);
        self.len = keep;
        self.cursor = keep % self.window;
        self.offset += length;
        Ok(AttentionRead::masked(full_k, full_v, mask, &self.ops))
    }
}

/// Entries in temporal order laid out as a full ring whose oldest slot is `cursor`.
fn ring_layout(temporal: &Array, cursor: usize) -> Result<Array> {
    if cursor == 0 {
        return Ok(temporal.clone());
    }
    let s = temporal.shape();
    let n = s[2];
    let split = n - cursor as i32; // temporal[..split] goes to slots cursor.., the rest to 0..cursor
    let older = temporal.slice(&[0, 0, 0, 0], &[s[0], s[1], split, s[3]], &[1, 1, 1, 1])?;
    let newer = temporal.slice(&[0, 0, split, 0], &[s[0], s[1], n, s[3]], &[1, 1, 1, 1])?;
    Ok(ops::concatenate(&[&newer, &older], 2)?)
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
