//! Rows sharing one buffer per part: the batched layout of full-precision plain and ring
//! storage (mlx-lm's `BatchKVCache`, with each row where its own storage would keep it).
//!
//! Row `b` of the buffers `[B, H, capacity, ·]` holds, in its first slots, exactly the slots
//! its single-sequence storage holds: a plain row its positions in order, a ring row its ring
//! (the oldest position at its cursor once full). A decode step writes every row's new
//! position into that row's next slot in one scatter per part (one slice update when every
//! row's slot is the same), and reads the first `T` slots of every row, `T` the most any row
//! stores, with a mask that hides the slots a row has not filled: the rows are padded on the
//! right. Each row's visible slots are those its own storage reads, in the same order, so a
//! row attends as it would alone; the padding after them adds exact zeros.
//!
//! A batch of one row keeps that row's own storage, so a lone reply takes part in a compiled
//! decode step as it would outside a batch. A second row joining moves both into the shared
//! buffers (one copy each); when one row is left, it goes back to its own storage.
//!
//! Rows join after their own prefill and leave as single-sequence caches holding bit for bit
//! what the same appends leave in their own storage. Encoded (quantized) storage, and rows of
//! different storages, batch in [`super::CacheRows`] instead, each row in its own storage.
//!
//! A speculative round appends a window of `L` positions to every row in one write per part:
//! row `b`'s positions go to the slots `L` decode steps would write (a plain row's from its
//! cursor on, a ring's wrapping round the window). The read is every row's own read padded:
//! a plain row's stored slots and its new positions on the right; a ring row's last
//! `window − 1` positions in temporal order (one gather from the slots the round is about to
//! write, as its own storage reads them), then its new ones, padded on the left. A rollback
//! keeps `keep[b]` of row `b`'s positions: a plain row just forgets the rest (the slots past
//! its end are never read), a ring row puts back what the round overwrote in the slots of the
//! positions it drops (kept from the write, one update per part). A round over ring rows
//! appends at most `window` positions ([`Cache::max_append`]), so that no slot is written twice.

use mlx::{Array, ops};

use super::kv::{self, Precision};
use super::{
    AttentionCache, AttentionRead, BatchRows, Cache, CacheState, CompiledDecodeCache, DecodeFetch,
    DecodeSlot, ReadMask, SlotKind, check_append, round_error,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// Plain buffers grow in steps of this many positions, as a single plain cache's do.
const STEP: usize = 256;

/// A single-sequence plain or ring storage taken apart ([`Cache::take_slots`]): its filled
/// slots and where it stands. What a row of [`SlotRows`] is made of, and what it leaves as.
#[derive(Debug)]
pub struct SlotRow {
    /// The filled slots `0..stored`, `[1, H, stored, ·]` per part; `None` while empty.
    pub(crate) parts: Option<Vec<Array>>,
    /// Positions appended so far.
    pub(crate) offset: usize,
    /// Filled slots (a plain row's offset; a ring's at most its window).
    pub(crate) stored: usize,
    /// The slot the next position goes to (a plain row's offset; a ring's oldest slot once
    /// full).
    pub(crate) cursor: usize,
    /// The ring's window; `None` for plain storage.
    pub(crate) window: Option<usize>,
    pub(crate) precision: Precision,
    pub(crate) ops: Ops,
}

impl SlotRow {
    /// The single-sequence storage this row is.
    fn into_cache(self) -> Result<Box<dyn Cache>> {
        Ok(match self.window {
            None => Box::new(super::PlainCache::from_slots(self)),
            Some(_) => Box::new(super::RotatingCache::from_slots(self)?),
        })
    }

    /// The row after one more position in its next slot.
    fn advance(&mut self) {
        self.offset += 1;
        match self.window {
            None => {
                self.stored += 1;
                self.cursor += 1;
            }
            Some(window) => {
                self.stored = (self.stored + 1).min(window);
                self.cursor = (self.cursor + 1) % window;
            }
        }
    }
}

/// The batch of rows plain and ring storage of `encoding` make ([`Cache::empty_rows`]): full
/// precision in shared buffers ([`SlotRows`]) unless each row must keep its own storage;
/// encoded storage's rows each keep their own ([`super::CacheRows`]).
pub(crate) fn kv_rows(encoding: kv::KvEncoding, layout: super::RowLayout) -> Box<dyn Cache> {
    match (encoding.format.is_full(), layout) {
        (true, super::RowLayout::Shared) => Box::new(SlotRows::new()),
        _ => Box::new(super::CacheRows::new()),
    }
}

/// Rows of one batch in shared buffers. See the module docs.
#[derive(Debug, Default)]
pub struct SlotRows {
    layout: Layout,
    /// The rows' storage signature, from the first row that joined.
    signature: Option<String>,
    /// Whether a speculative round is armed (a lone row's is its own storage's).
    armed: bool,
}

#[derive(Debug, Default)]
enum Layout {
    #[default]
    Empty,
    /// One row, in its own storage.
    Lone(Box<dyn Cache>),
    Shared(Shared),
}

/// Two or more rows in shared buffers.
#[derive(Debug)]
struct Shared {
    /// `[B, H, capacity, ·]` per part; `None` while every row is empty.
    parts: Option<Vec<Array>>,
    /// Each row's bookkeeping; its `parts` are `None` (they live in the shared buffers).
    rows: Vec<SlotRow>,
    /// The armed speculative round.
    round: Option<Round>,
}

/// What an armed round over shared rows goes back to.
#[derive(Debug)]
struct Round {
    /// Each row's `(offset, stored, cursor)` when the round began.
    starts: Vec<(usize, usize, usize)>,
    /// Positions appended to every row since.
    appended: usize,
    /// A ring's writes, in order: what each overwrote (a plain row's slots past its end hold
    /// nothing it reads).
    writes: Vec<RingWrite>,
}

/// One append of a round into ring rows' slots.
#[derive(Debug)]
struct RingWrite {
    /// The round's count of positions before this append.
    first: usize,
    /// The slot of each row's each new position, `[B, 1, L, 1]`.
    at: Array,
    /// What those slots held before, and what the append wrote there, per part.
    old: Vec<Array>,
    new: Vec<Array>,
}

impl SlotRows {
    /// An empty batch; rows join with [`BatchRows::merge_row`].
    pub fn new() -> SlotRows {
        SlotRows::default()
    }

    /// Number of rows.
    pub fn batch_size(&self) -> usize {
        match &self.layout {
            Layout::Empty => 0,
            Layout::Lone(_) => 1,
            Layout::Shared(shared) => shared.rows.len(),
        }
    }

    /// Whether the rows share buffers now (two or more rows).
    pub fn is_shared(&self) -> bool {
        matches!(self.layout, Layout::Shared(_))
    }

    /// Each row's offset: the position its next appended token takes.
    pub fn row_offsets(&self) -> Vec<usize> {
        match &self.layout {
            Layout::Empty => Vec::new(),
            Layout::Lone(row) => vec![row.offset()],
            Layout::Shared(shared) => shared.rows.iter().map(|r| r.offset).collect(),
        }
    }

    fn check_signature(&self, row: &dyn Cache) -> Result<()> {
        if row.as_attention().is_none() {
            return Err(Error::InvalidRequest(format!(
                "a batch of attention rows cannot take {}",
                row.signature()
            )));
        }
        match &self.signature {
            Some(wanted) if self.batch_size() > 0 && *wanted != row.signature() => {
                Err(Error::InvalidRequest(format!(
                    "a batch holds one storage: {} cannot join {wanted}",
                    row.signature()
                )))
            }
            _ => Ok(()),
        }
    }

    fn append(&mut self, keys: &Array, values: &Array, decode: bool) -> Result<AttentionRead> {
        let length = check_append(keys, values, decode)?;
        let batch = keys.dim(0)? as usize;
        if batch != self.batch_size() {
            return Err(Error::InvalidRequest(format!(
                "an append of {batch} rows to a batch of {}",
                self.batch_size()
            )));
        }
        match &mut self.layout {
            Layout::Empty => Err(Error::InvalidRequest("an append to a batch of no rows".into())),
            Layout::Lone(row) => {
                let row = super::attention_of(row.as_mut())?;
                if decode {
                    row.append_decode(keys, values)
                } else {
                    row.append_window(keys, values)
                }
            }
            Layout::Shared(shared) if shared.round.is_some() && !decode => {
                shared.append_window(keys, values)
            }
            Layout::Shared(_) if length != 1 => Err(Error::InvalidRequest(format!(
                "rows sharing buffers append one position a step outside a speculative round, \
                 not {length}: a row prefills alone and joins"
            ))),
            Layout::Shared(shared) => shared.append_decode(keys, values),
        }
    }
}

impl Shared {
    /// Rows from their taken-apart storage, each padded on the right to the buffers'
    /// capacity and stacked on the batch axis.
    fn of(rows: Vec<SlotRow>) -> Result<Shared> {
        let mut shared = Shared { parts: None, rows: Vec::with_capacity(rows.len()), round: None };
        for row in rows {
            shared.push(row)?;
        }
        Ok(shared)
    }

    /// Slots every row has room for, given the longest row stores `stored`.
    fn capacity_for(window: Option<usize>, stored: usize) -> usize {
        match window {
            Some(window) => window,
            None => stored.div_ceil(STEP).max(1) * STEP,
        }
    }

    fn capacity(&self) -> Result<usize> {
        self.parts.as_deref().map_or(Ok(0), kv::position_count)
    }

    /// The buffers grown on the right to `capacity` slots (as they are when they hold that
    /// many).
    fn grow(parts: &[Array], capacity: usize) -> Result<Vec<Array>> {
        let have = kv::position_count(parts)?;
        if have >= capacity {
            return Ok(parts.to_vec());
        }
        kv::concat_positions(parts, &kv::zero_positions(parts, capacity - have)?)
    }

    /// Adds `row` after the existing rows.
    fn push(&mut self, mut row: SlotRow) -> Result<()> {
        let own = row.parts.take();
        let longest = self.rows.iter().map(|r| r.stored).chain([row.stored]).max().unwrap_or(0);
        let capacity = Shared::capacity_for(row.window, longest).max(self.capacity()?);
        // A row with nothing stored yet holds zero slots shaped like the others'.
        self.parts = match (self.parts.take(), own) {
            (None, None) => None,
            (Some(parts), own) => {
                let own = match own {
                    Some(own) => own,
                    None => zero_rows(&parts, 1, 0)?,
                };
                Some(stack_rows(&Shared::grow(&parts, capacity)?, &Shared::grow(&own, capacity)?)?)
            }
            (None, Some(own)) => {
                let own = Shared::grow(&own, capacity)?;
                Some(match self.rows.len() {
                    0 => own,
                    n => stack_rows(&zero_rows(&own, n, capacity)?, &own)?,
                })
            }
        };
        self.rows.push(row);
        Ok(())
    }

    /// Takes row `b` out with its filled slots.
    fn remove(&mut self, b: usize) -> Result<SlotRow> {
        let mut row = self.rows.remove(b);
        let Some(parts) = self.parts.take() else {
            return Ok(row);
        };
        let batch = self.rows.len() + 1;
        if row.stored > 0 {
            let own = parts.iter().map(|p| batch_rows(p, b, b + 1)).collect::<Result<Vec<_>>>()?;
            row.parts = Some(kv::positions(&own, 0, row.stored)?);
        }
        if self.rows.is_empty() {
            return Ok(row);
        }
        let rest = parts
            .iter()
            .map(|p| {
                let before = (b > 0).then(|| batch_rows(p, 0, b)).transpose()?;
                let after = (b + 1 < batch).then(|| batch_rows(p, b + 1, batch)).transpose()?;
                Ok(match (before, after) {
                    (Some(x), Some(y)) => ops::concatenate(&[&x, &y], 0)?,
                    (Some(x), None) | (None, Some(x)) => x,
                    (None, None) => unreachable!("rows remain"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Plain buffers shrink to what the longest remaining row needs.
        let longest = self.rows.iter().map(|r| r.stored).max().unwrap_or(0);
        let capacity = Shared::capacity_for(row.window, longest);
        self.parts = Some(if capacity < kv::position_count(&rest)? {
            kv::positions(&rest, 0, capacity)?
        } else {
            rest
        });
        Ok(row)
    }

    /// The codec every row stores in.
    fn codec(&self) -> Result<kv::Codec> {
        let first = self.rows.first().ok_or_else(|| Error::InvalidRequest("no rows".into()))?;
        Ok(first.precision.codec().clone())
    }

    /// The slot of a compiled step ([`DecodeFetch::Rows`]): the buffers (grown first where a
    /// row's next slot is past them, and handed over), each row's next slot, and the mask of
    /// the slots each row sees once its new position is written. `None` while no row stores
    /// a position yet; on an error the rows are as before.
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>> {
        let Some(first) = self.rows.first() else {
            return Ok(None);
        };
        let window = first.window;
        let codec = self.codec()?;
        let slots: Vec<i32> = self.rows.iter().map(|r| r.cursor as i32).collect();
        let highest = slots.iter().copied().max().unwrap_or(0) as usize;
        let Some(parts) = &self.parts else {
            return Ok(None);
        };
        let mut inputs = Shared::grow(parts, Shared::capacity_for(window, highest + 1))?;
        let capacity = kv::position_count(&inputs)?;
        let rows = self.rows.len() as i32;
        let mut visible = Vec::with_capacity(self.rows.len() * capacity);
        for row in &self.rows {
            let filled = match row.window {
                Some(window) => (row.stored + 1).min(window),
                None => row.stored + 1,
            };
            visible.extend((0..capacity).map(|j| j < filled));
        }
        inputs.push(Array::from_slice(&slots, &[rows, 1, 1, 1])?);
        inputs.push(Array::from_slice(&visible, &[rows, 1, 1, capacity as i32])?);
        // Handed over: the graph holds the only reference, so its writes happen in place.
        self.parts = None;
        let kind = SlotKind { fetch: DecodeFetch::Rows, codec };
        Ok(Some(DecodeSlot { kind, inputs }))
    }

    /// Every row's new position (`[B, H, 1, D]`) into its next slot; the read of every row's
    /// filled slots.
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let first = self.rows.first().ok_or_else(|| Error::InvalidRequest("no rows".into()))?;
        let (codec, ops_, window) =
            (first.precision.codec().clone(), first.ops.clone(), first.window);
        let new = codec.encode_kv(keys, values)?;
        let slots: Vec<usize> = self.rows.iter().map(|r| r.cursor).collect();
        let highest = slots.iter().copied().max().unwrap_or(0);
        let capacity = Shared::capacity_for(window, highest + 1);
        let buffers = match &self.parts {
            Some(parts) => Shared::grow(parts, capacity)?,
            None => kv::zero_positions(&new, capacity)?,
        };
        self.check_round_room(1)?;
        let at = Slots::new(slots.iter().map(|&s| s as i32).collect(), 1);
        if window.is_some() && self.round.is_some() {
            self.record_ring_write(&buffers, &at, &new)?;
        }
        if let Some(round) = &mut self.round {
            round.appended += 1;
        }
        let buffers = at.write(&buffers, &new)?;
        for row in &mut self.rows {
            row.advance();
        }
        let filled: Vec<usize> = self.rows.iter().map(|r| r.stored).collect();
        let longest = filled.iter().copied().max().unwrap_or(0);
        let read = kv::positions(&buffers, 0, longest)?;
        self.parts = Some(buffers);
        if filled.iter().all(|&f| f == longest) {
            return Ok(AttentionRead::one_query(read, &codec, &ops_));
        }
        let mut visible = Vec::with_capacity(filled.len() * longest);
        for &f in &filled {
            visible.extend((0..longest).map(|j| j < f));
        }
        let mask = crate::uploads::bools(&visible, &[filled.len() as i32, 1, 1, longest as i32])?;
        Ok(AttentionRead::masked(read, &codec, ReadMask::Array(mask), &ops_))
    }
}

impl Shared {
    /// Refuses an append of `length` positions that would take a round over ring rows past
    /// their window (the slots it writes would repeat).
    fn check_round_room(&self, length: usize) -> Result<()> {
        let (Some(round), Some(window)) = (&self.round, self.rows.first().and_then(|r| r.window))
        else {
            return Ok(());
        };
        if round.appended + length > window {
            return Err(round_error(&format!(
                "a round over rows sharing a ring of {window} appends at most {window} positions, \
                 not {}",
                round.appended + length
            )));
        }
        Ok(())
    }

    /// Records what an append of the armed round is about to overwrite in ring rows: the
    /// slots `at` of `buffers`, and what goes there.
    fn record_ring_write(&mut self, buffers: &[Array], at: &Slots, new: &[Array]) -> Result<()> {
        let Some(round) = &mut self.round else {
            return Ok(());
        };
        let at = at.array()?;
        let old =
            buffers.iter().map(|b| Ok(b.take_along_axis(&at, 2)?)).collect::<Result<Vec<_>>>()?;
        round.writes.push(RingWrite { first: round.appended, at, old, new: new.to_vec() });
        Ok(())
    }

    /// Arms a round on every row.
    fn begin_round(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(round_error("a round is already armed"));
        }
        let starts = self.rows.iter().map(|r| (r.offset, r.stored, r.cursor)).collect();
        self.round = Some(Round { starts, appended: 0, writes: Vec::new() });
        Ok(())
    }

    /// Ends the armed round keeping the first `keep[b]` positions row `b` appended: each row
    /// as if only those had been appended, one decode step each. A count above what was
    /// appended is refused before any row changes.
    fn end_round(&mut self, keep: &[usize]) -> Result<()> {
        let round = self.round.as_ref().ok_or_else(|| round_error("rollback without a round"))?;
        if keep.len() != self.rows.len() {
            return Err(round_error(&format!(
                "{} keep counts for {} rows",
                keep.len(),
                self.rows.len()
            )));
        }
        if let Some((row, k)) = keep.iter().enumerate().find(|(_, k)| **k > round.appended) {
            return Err(round_error(&format!(
                "row {row} cannot keep {k} of the {} positions appended",
                round.appended
            )));
        }
        let Some(round) = self.round.take() else {
            return Err(round_error("rollback without a round"));
        };
        // Ring slots of the positions a row drops get back what they held.
        if keep.iter().any(|&k| k < round.appended) {
            for write in &round.writes {
                let length = write.at.dim(2)? as usize;
                let mut kept = Vec::with_capacity(keep.len() * length);
                for &k in keep {
                    kept.extend((0..length).map(|i| write.first + i < k));
                }
                let kept = crate::uploads::bools(&kept, &[keep.len() as i32, 1, length as i32, 1])?;
                let parts =
                    self.parts.take().ok_or_else(|| round_error("a round wrote nothing"))?;
                self.parts = Some(
                    parts
                        .iter()
                        .zip(write.new.iter().zip(&write.old))
                        .map(|(buffer, (new, old))| {
                            let back = ops::where_(&kept, new, old)?;
                            Ok(buffer.put_along_axis(&write.at, &back, 2)?)
                        })
                        .collect::<Result<Vec<_>>>()?,
                );
            }
        }
        for ((row, &(offset, stored, cursor)), &k) in
            self.rows.iter_mut().zip(&round.starts).zip(keep)
        {
            (row.offset, row.stored, row.cursor) = (offset, stored, cursor);
            for _ in 0..k {
                row.advance();
            }
        }
        Ok(())
    }

    /// A round's window: `L` new positions per row (`[B, H, L, D]`) into the slots `L` decode
    /// steps would write; the read of each row's own read, padded (see the module docs).
    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let first = self.rows.first().ok_or_else(|| Error::InvalidRequest("no rows".into()))?;
        let (codec, ops_, window) =
            (first.precision.codec().clone(), first.ops.clone(), first.window);
        let length = keys.dim(2)? as usize;
        self.check_round_room(length)?;
        let new = codec.encode_kv(keys, values)?;
        let batch = self.rows.len();
        let slot = |r: &SlotRow, i: usize| match r.window {
            None => r.cursor + i,
            Some(w) => (r.cursor + i) % w,
        };
        let highest = self.rows.iter().map(|r| slot(r, length - 1)).max().unwrap_or(0);
        let capacity = Shared::capacity_for(window, highest + 1);
        let buffers = match &self.parts {
            Some(parts) => Shared::grow(parts, capacity)?,
            None => kv::zero_positions(&new, capacity)?,
        };
        let at = Slots::new(
            self.rows.iter().flat_map(|r| (0..length).map(move |i| slot(r, i) as i32)).collect(),
            length,
        );
        // A ring row reads its history as its own storage does, before the write.
        let history = match window {
            Some(window) => self.ring_history(&buffers, window)?,
            None => None,
        };
        if window.is_some() {
            self.record_ring_write(&buffers, &at, &new)?;
        }
        if let Some(round) = &mut self.round {
            round.appended += length;
        }
        let written = at.write(&buffers, &new)?;
        let before: Vec<usize> = self.rows.iter().map(|r| r.stored).collect();
        for row in &mut self.rows {
            for _ in 0..length {
                row.advance();
            }
        }
        self.parts = Some(written.clone());
        let rule = if length == 1 { ReadMask::None } else { ReadMask::Causal };
        match (window, history) {
            (None, _) => {
                // A plain row's slots in order, its new positions after them, padded right.
                let ends: Vec<usize> = before.iter().map(|s| s + length).collect();
                let longest = ends.iter().copied().max().unwrap_or(0);
                let read = kv::positions(&written, 0, longest)?;
                if ends.iter().all(|&e| e == longest) {
                    return Ok(AttentionRead::masked(read, &codec, rule, &ops_));
                }
                let mut visible = Vec::with_capacity(batch * length * longest);
                for &start in &before {
                    for i in 0..length {
                        visible.extend((0..longest).map(|j| j <= start + i));
                    }
                }
                let mask = crate::uploads::bools(
                    &visible,
                    &[batch as i32, 1, length as i32, longest as i32],
                )?;
                Ok(AttentionRead::masked(read, &codec, ReadMask::Array(mask), &ops_))
            }
            (Some(_), None) => Ok(AttentionRead::masked(new, &codec, rule, &ops_)),
            (Some(window), Some((prior, priors))) => {
                let read = kv::concat_positions(&prior, &new)?;
                let most = priors.iter().copied().max().unwrap_or(0);
                if priors.iter().all(|&p| p == most) && most + length <= window {
                    return Ok(AttentionRead::masked(read, &codec, rule, &ops_));
                }
                let total = most + length;
                let mut visible = Vec::with_capacity(batch * length * total);
                for &p in &priors {
                    let pad = most - p;
                    for i in 0..length {
                        visible.extend(
                            (0..total).map(|j| {
                                j >= pad && j - pad <= p + i && p + i - (j - pad) < window
                            }),
                        );
                    }
                }
                let mask = crate::uploads::bools(
                    &visible,
                    &[batch as i32, 1, length as i32, total as i32],
                )?;
                Ok(AttentionRead::masked(read, &codec, ReadMask::Array(mask), &ops_))
            }
        }
    }

    /// Each ring row's last `window − 1` stored positions in temporal order (what its own
    /// storage reads before a window's new ones), left-padded to the most any row has, with
    /// each row's count; `None` while no row stores a position.
    fn ring_history(
        &self,
        buffers: &[Array],
        window: usize,
    ) -> Result<Option<(Vec<Array>, Vec<usize>)>> {
        let priors: Vec<usize> = self.rows.iter().map(|r| r.stored.min(window - 1)).collect();
        let most = priors.iter().copied().max().unwrap_or(0);
        if most == 0 {
            return Ok(None);
        }
        let mut at = Vec::with_capacity(self.rows.len() * most);
        for (row, &p) in self.rows.iter().zip(&priors) {
            // The oldest of the row's last `p` positions sits `p` slots before its cursor.
            at.extend(std::iter::repeat_n(0, most - p));
            at.extend((0..p).map(|t| ((row.cursor + window - p + t) % window) as i32));
        }
        let at = crate::uploads::ints(&at, &[self.rows.len() as i32, 1, most as i32, 1])?;
        let prior =
            buffers.iter().map(|b| Ok(b.take_along_axis(&at, 2)?)).collect::<Result<Vec<_>>>()?;
        Ok(Some((prior, priors)))
    }
}

/// The slot of each row's each new position (`B × L`, row-major): where an append writes.
struct Slots {
    at: Vec<i32>,
    length: usize,
    /// `at` as `[B, 1, L, 1]`, made on first use.
    array: std::cell::OnceCell<Array>,
}

impl Slots {
    fn new(at: Vec<i32>, length: usize) -> Slots {
        Slots { at, length, array: std::cell::OnceCell::new() }
    }

    fn array(&self) -> Result<Array> {
        if let Some(array) = self.array.get() {
            return Ok(array.clone());
        }
        let rows = (self.at.len() / self.length) as i32;
        let array = crate::uploads::ints(&self.at, &[rows, 1, self.length as i32, 1])?;
        Ok(self.array.get_or_init(|| array).clone())
    }

    /// `new` (`[B, H, L, ·]` per part) written into `buffers` at these slots: one slice update
    /// when every row's slots are the same run, else one scatter per part.
    fn write(&self, buffers: &[Array], new: &[Array]) -> Result<Vec<Array>> {
        let first = self.at.first().copied().unwrap_or(0);
        let run = self
            .at
            .chunks(self.length)
            .all(|row| row.iter().enumerate().all(|(i, &slot)| slot == first + i as i32));
        if run {
            return kv::write_positions(buffers, new, first as usize);
        }
        let at = self.array()?;
        buffers.iter().zip(new).map(|(buffer, n)| Ok(buffer.put_along_axis(&at, n, 2)?)).collect()
    }
}

/// Zero slots for `rows` rows, `capacity` slots each, shaped like `like`'s parts.
fn zero_rows(like: &[Array], rows: usize, capacity: usize) -> Result<Vec<Array>> {
    like.iter()
        .map(|p| {
            let mut s = p.shape();
            s[0] = rows as i32;
            s[2] = capacity as i32;
            Ok(ops::zeros(&s, p.dtype())?)
        })
        .collect()
}

/// Rows `from..to` of `[B, …]`.
fn batch_rows(x: &Array, from: usize, to: usize) -> Result<Array> {
    let mut start = vec![0; x.ndim()];
    let mut stop = x.shape();
    start[0] = from as i32;
    stop[0] = to as i32;
    Ok(x.slice(&start, &stop, &vec![1; start.len()])?)
}

/// `rows` (`[B, …]` per part) with `row` (`[1, …]`) after them.
fn stack_rows(rows: &[Array], row: &[Array]) -> Result<Vec<Array>> {
    rows.iter().zip(row).map(|(x, y)| Ok(ops::concatenate(&[x, y], 0)?)).collect()
}

/// A batch is one layer's cache in a batched forward pass; see [`super::CacheRows`]'s for what
/// each call means. Whole-batch persistence and trims are refused; rows join and leave outside
/// rounds.
impl Cache for SlotRows {
    /// The longest row's offset (each row's: [`Cache::row_offsets`]).
    fn offset(&self) -> usize {
        self.row_offsets().into_iter().max().unwrap_or(0)
    }

    fn signature(&self) -> String {
        match &self.signature {
            Some(row) => format!("rows({row})"),
            None => "rows".into(),
        }
    }

    /// What one more position costs one row.
    fn bytes_per_token(&self) -> usize {
        match &self.layout {
            Layout::Empty => 0,
            Layout::Lone(row) => row.bytes_per_token(),
            Layout::Shared(shared) => shared.parts.as_deref().map_or(0, kv::bytes_per_position),
        }
    }

    /// The longest row's filled slots.
    fn stored_positions(&self) -> usize {
        match &self.layout {
            Layout::Empty => 0,
            Layout::Lone(row) => row.stored_positions(),
            Layout::Shared(shared) => shared.rows.iter().map(|r| r.stored).max().unwrap_or(0),
        }
    }

    fn row_offsets(&self) -> Option<Vec<usize>> {
        Some(SlotRows::row_offsets(self))
    }

    fn buffers(&self) -> Vec<Array> {
        match &self.layout {
            Layout::Empty => Vec::new(),
            Layout::Lone(row) => row.buffers(),
            Layout::Shared(shared) => shared.parts.clone().unwrap_or_default(),
        }
    }

    /// A ring's window while its rows share buffers (a round writes each slot at most once);
    /// a lone row's own storage's limit.
    fn max_append(&self) -> Option<usize> {
        match &self.layout {
            Layout::Empty => None,
            Layout::Lone(row) => row.max_append(),
            Layout::Shared(shared) => {
                let window = shared.rows.first()?.window?;
                let appended = shared.round.as_ref().map_or(0, |r| r.appended);
                Some(window - appended)
            }
        }
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.armed {
            return Err(round_error("a round is already armed"));
        }
        match &mut self.layout {
            Layout::Empty => return Err(round_error("a round over no rows")),
            Layout::Lone(row) => row.spec_round_begin()?,
            Layout::Shared(shared) => shared.begin_round()?,
        }
        self.armed = true;
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        if !self.armed {
            return Err(round_error("commit without a round"));
        }
        match &mut self.layout {
            Layout::Empty => return Err(round_error("commit without a round")),
            Layout::Lone(row) => row.spec_round_commit()?,
            Layout::Shared(shared) => {
                let appended = shared.round.as_ref().map_or(0, |r| r.appended);
                shared.end_round(&vec![appended; shared.rows.len()])?;
            }
        }
        self.armed = false;
        Ok(())
    }

    /// The same count for every row ([`BatchRows::rollback_rows`] takes one per row).
    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        self.rollback_rows(&vec![keep; self.batch_size()])
    }

    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }

    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }

    super::rows_cache_methods!();
}

impl BatchRows for SlotRows {
    fn batch_size(&self) -> usize {
        SlotRows::batch_size(self)
    }

    /// A shared row lends its filled slots, as its own storage lends them.
    fn row_donor_read(&self, b: usize) -> Result<Option<AttentionRead>> {
        if b >= self.batch_size() {
            return Err(Error::InvalidRequest(format!(
                "row {b} of a batch of {}",
                self.batch_size()
            )));
        }
        match &self.layout {
            Layout::Empty => Ok(None),
            Layout::Lone(row) => row.as_attention().map_or(Ok(None), |a| a.donor_read()),
            Layout::Shared(shared) => {
                let row = &shared.rows[b];
                let Some(parts) = shared.parts.as_ref().filter(|_| row.stored > 0) else {
                    return Ok(None);
                };
                let own =
                    parts.iter().map(|p| batch_rows(p, b, b + 1)).collect::<Result<Vec<_>>>()?;
                let slots = kv::positions(&own, 0, row.stored)?;
                Ok(Some(AttentionRead::one_query(slots, row.precision.codec(), &row.ops)))
            }
        }
    }

    /// A row that cannot be taken apart ([`Cache::take_slots`]: another storage, an armed
    /// round) is refused, and nothing changes.
    fn merge_row(&mut self, mut row: Box<dyn Cache>) -> Result<()> {
        if self.armed {
            return Err(round_error("cannot merge a row inside a round"));
        }
        self.check_signature(row.as_ref())?;
        let signature = row.signature();
        self.layout = match std::mem::take(&mut self.layout) {
            Layout::Empty => Layout::Lone(row),
            Layout::Lone(mut lone) => {
                let Some(new) = row.take_slots() else {
                    self.layout = Layout::Lone(lone);
                    return Err(cannot_share(&signature));
                };
                let Some(first) = lone.take_slots() else {
                    self.layout = Layout::Lone(lone);
                    return Err(cannot_share(&signature));
                };
                if let (Some(a), Some(b)) = (&first.parts, &new.parts)
                    && let Err(e) = check_fit(a, b)
                {
                    self.layout = Layout::Lone(first.into_cache()?);
                    return Err(e);
                }
                Layout::Shared(Shared::of(vec![first, new])?)
            }
            Layout::Shared(mut shared) => {
                let Some(new) = row.take_slots() else {
                    self.layout = Layout::Shared(shared);
                    return Err(cannot_share(&signature));
                };
                if let (Some(a), Some(b)) = (&shared.parts, &new.parts)
                    && let Err(e) = check_fit(a, b)
                {
                    self.layout = Layout::Shared(shared);
                    return Err(e);
                }
                shared.push(new)?;
                Layout::Shared(shared)
            }
        };
        self.signature = Some(signature);
        Ok(())
    }

    fn rollback_rows(&mut self, keep: &[usize]) -> Result<()> {
        if !self.armed {
            return Err(round_error("rollback without a round"));
        }
        match &mut self.layout {
            Layout::Empty => return Err(round_error("rollback without a round")),
            Layout::Lone(row) => match keep {
                [keep] => row.spec_round_rollback(*keep)?,
                _ => {
                    return Err(round_error(&format!("{} keep counts for 1 row", keep.len())));
                }
            },
            Layout::Shared(shared) => shared.end_round(keep)?,
        }
        self.armed = false;
        Ok(())
    }

    fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>> {
        if self.armed {
            return Err(round_error("cannot extract a row inside a round"));
        }
        if row >= self.batch_size() {
            return Err(Error::InvalidRequest(format!(
                "row {row} of a batch of {}",
                self.batch_size()
            )));
        }
        match std::mem::take(&mut self.layout) {
            Layout::Empty => unreachable!("checked: the batch has a row"),
            Layout::Lone(lone) => Ok(lone),
            Layout::Shared(mut shared) => {
                let out = shared.remove(row)?;
                self.layout = if shared.rows.len() == 1 {
                    Layout::Lone(shared.remove(0)?.into_cache()?)
                } else {
                    Layout::Shared(shared)
                };
                out.into_cache()
            }
        }
    }
}

impl AttentionCache for SlotRows {
    /// Decode: one new position per row (`[B, H, 1, D]`, `B` the batch size).
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        self.append(keys, values, true)
    }

    /// A lone row's window; rows sharing buffers take windows of several positions inside a
    /// speculative round (see the module docs), of one position outside.
    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        self.append(keys, values, false)
    }

    /// Refused: a drafter reads one sequence's keys and values.
    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        Err(Error::InvalidRequest("a batch of rows has no donor read: extract the row".into()))
    }

    /// A lone row takes part in a compiled decode step through its own storage; rows sharing
    /// buffers take part together ([`DecodeFetch::Rows`]).
    fn compiled(&mut self) -> Option<&mut dyn CompiledDecodeCache> {
        if self.armed {
            return None;
        }
        if matches!(self.layout, Layout::Shared(_)) {
            return Some(self);
        }
        match &mut self.layout {
            Layout::Lone(row) => row.as_attention_mut()?.compiled(),
            _ => None,
        }
    }
}

/// Rows sharing buffers in a compiled decode step: every row's slot and what it will see are
/// the step's inputs, as a decode append over shared buffers computes them op by op.
impl CompiledDecodeCache for SlotRows {
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>> {
        let Layout::Shared(shared) = &mut self.layout else {
            return Ok(None);
        };
        shared.begin_decode_step()
    }

    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()> {
        let Layout::Shared(shared) = &mut self.layout else {
            return Err(Error::InvalidRequest("a compiled step's rows left the batch".into()));
        };
        if fetch != DecodeFetch::Rows {
            return Err(Error::InvalidRequest("rows sharing buffers are read as rows".into()));
        }
        let codec = shared.codec()?;
        super::step_outputs(&outputs, &codec)?;
        shared.parts = Some(outputs);
        for row in &mut shared.rows {
            row.advance();
        }
        Ok(())
    }

    fn abort_decode_step(&mut self, slot: DecodeSlot) {
        if let Layout::Shared(shared) = &mut self.layout {
            let mut inputs = slot.inputs;
            inputs.truncate(slot.kind.outputs());
            shared.parts = Some(inputs);
        }
    }
}

fn cannot_share(signature: &str) -> Error {
    Error::InvalidRequest(format!(
        "a {signature} cache cannot share a batch's buffers (a full-precision plain or ring \
         cache outside a speculative round can)"
    ))
}

/// Refuses `new` beside `other` when their parts differ in count, heads, width or dtype (a
/// checkpoint of another model): before either is moved into shared buffers.
fn check_fit(other: &[Array], new: &[Array]) -> Result<()> {
    let geometry = |p: &Array| {
        let s = p.shape();
        (s.len(), s.get(1).copied(), s.get(3).copied(), p.dtype())
    };
    if other.len() != new.len() || other.iter().zip(new).any(|(a, b)| geometry(a) != geometry(b)) {
        return Err(Error::InvalidRequest(format!(
            "a row of keys and values shaped {:?} cannot join rows shaped {:?}",
            new.iter().map(|p| p.shape()).collect::<Vec<_>>(),
            other.iter().map(|p| p.shape()).collect::<Vec<_>>()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_row_advances_its_cursor_around_the_window() {
        let mut row = SlotRow {
            parts: None,
            offset: 2,
            stored: 2,
            cursor: 2,
            window: Some(3),
            precision: Precision::new(kv::KvEncoding::full()),
            ops: Ops::mlx(),
        };
        row.advance();
        assert_eq!((row.offset, row.stored, row.cursor), (3, 3, 0));
        row.advance();
        assert_eq!((row.offset, row.stored, row.cursor), (4, 3, 1));
    }
}
