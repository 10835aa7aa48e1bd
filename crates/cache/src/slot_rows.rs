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
//! what the same appends leave in their own storage. Speculative rounds, windows of several
//! positions and encoded (quantized) storage batch in [`super::CacheRows`] instead, each row in
//! its own storage.

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
/// precision decodes in shared buffers ([`SlotRows`]); encoded storage's rows, and rows that
/// verify drafts, each keep their own ([`super::CacheRows`]).
pub(crate) fn kv_rows(encoding: kv::KvEncoding, rounds: super::Rounds) -> Box<dyn Cache> {
    match (encoding.format.is_full(), rounds) {
        (true, super::Rounds::No) => Box::new(SlotRows::new()),
        _ => Box::new(super::CacheRows::new()),
    }
}

/// Rows of one batch in shared buffers. See the module docs.
#[derive(Debug, Default)]
pub struct SlotRows {
    layout: Layout,
    /// The rows' storage signature, from the first row that joined.
    signature: Option<String>,
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
            Layout::Shared(_) if length != 1 => Err(Error::InvalidRequest(format!(
                "rows sharing buffers append one position a step, not {length}: a row \
                 prefills alone and joins"
            ))),
            Layout::Shared(shared) => shared.append_decode(keys, values),
        }
    }
}

impl Shared {
    /// Rows from their taken-apart storage, each padded on the right to the buffers'
    /// capacity and stacked on the batch axis.
    fn of(rows: Vec<SlotRow>) -> Result<Shared> {
        let mut shared = Shared { parts: None, rows: Vec::with_capacity(rows.len()) };
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
        let buffers = if slots.iter().all(|&s| s == slots[0]) {
            kv::write_positions(&buffers, &new, slots[0])?
        } else {
            let at: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
            let at = Array::from_slice(&at, &[at.len() as i32, 1, 1, 1])?;
            buffers
                .iter()
                .zip(&new)
                .map(|(buffer, n)| Ok(buffer.put_along_axis(&at, n, 2)?))
                .collect::<Result<Vec<_>>>()?
        };
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
        let mask = Array::from_slice(&visible, &[filled.len() as i32, 1, 1, longest as i32])?;
        Ok(AttentionRead::masked(read, &codec, ReadMask::Array(mask), &ops_))
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
/// each call means. Whole-batch persistence, trims and rounds are refused.
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

    fn spec_round_begin(&mut self) -> Result<()> {
        Err(round_error(
            "rows sharing buffers run no speculative rounds: rows that verify drafts batch each \
             in its own storage (CacheRows)",
        ))
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        Err(round_error("commit without a round"))
    }

    fn spec_round_rollback(&mut self, _keep: usize) -> Result<()> {
        Err(round_error("rollback without a round"))
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

    fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>> {
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

    /// A lone row's window; rows sharing buffers take windows of one position only.
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
