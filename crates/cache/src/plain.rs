//! A growable key/value buffer: every position ever appended stays visible.

use mlx::Array;

use super::kv::{self, KvEncoding, Precision};
use super::{
    AttentionCache, AttentionRead, BidirectionalAttentionCache, BlockAttentionCache, Cache,
    CacheState, CommittedAttentionCache, CompiledDecodeCache, DecodeFetch, DecodeSlot, ReadMask,
    check_append, check_signature, concat_slot, overlay_mask,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// Buffers grow in steps of this many positions (as mlx-lm's `KVCache` does), so decode
/// writes in place most of the time.
const STEP: usize = 256;

/// Keys and values in buffers `[B, H, capacity, ·]` (one per part of the codec they are
/// stored in), valid up to the offset.
#[derive(Debug)]
pub struct PlainCache {
    parts: Option<Vec<Array>>,
    offset: usize,
    /// The armed speculative round.
    round: Option<Round>,
    precision: Precision,
    /// What its reads run.
    ops: Ops,
}

/// What a round goes back to. Inside a round a due conversion waits for its end, so the
/// positions a rollback drops never held quantized neighbours they would not have had.
#[derive(Debug)]
struct Round {
    offset: usize,
}

impl Default for PlainCache {
    fn default() -> PlainCache {
        PlainCache::encoded(KvEncoding::full(), &Ops::mlx())
    }
}

impl PlainCache {
    /// An empty cache read with MLX's ops.
    pub fn new() -> PlainCache {
        PlainCache::default()
    }

    /// An empty cache whose reads run `ops`.
    pub fn with_ops(ops: &Ops) -> PlainCache {
        PlainCache::encoded(KvEncoding::full(), ops)
    }

    /// An empty cache of `encoding` whose reads run `ops`.
    pub fn encoded(encoding: KvEncoding, ops: &Ops) -> PlainCache {
        PlainCache {
            parts: None,
            offset: 0,
            round: None,
            precision: Precision::new(encoding),
            ops: ops.clone(),
        }
    }

    /// The storage a row of shared buffers leaves as.
    pub(crate) fn from_slots(row: super::SlotRow) -> PlainCache {
        PlainCache {
            parts: row.parts,
            offset: row.offset,
            round: None,
            precision: row.precision,
            ops: row.ops,
        }
    }

    /// Encodes `keys`/`values`, writes them at the offset (growing the buffers when needed)
    /// and returns the valid prefix.
    fn write(&mut self, keys: &Array, values: &Array, length: usize) -> Result<Vec<Array>> {
        if self.round.is_some() {
            self.precision.check_round_append(self.offset, length)?;
        }
        let new = self.precision.codec().encode_kv(keys, values)?;
        let end = self.offset + length;
        let buffers = self.reserve(&new, end)?;
        let buffers = kv::write_positions(&buffers, &new, self.offset)?;
        let read = kv::positions(&buffers, 0, end)?;
        self.parts = Some(buffers);
        self.offset = end;
        Ok(read)
    }

    /// The buffers, grown (in steps of [`STEP`] positions) to hold at least `end` positions;
    /// new ones shaped like `new` when there are none.
    fn reserve(&self, new: &[Array], end: usize) -> Result<Vec<Array>> {
        let Some(buffers) = &self.parts else {
            return kv::zero_positions(new, 0).and_then(|empty| self.grown(&empty, end));
        };
        self.grown(buffers, end)
    }

    fn grown(&self, buffers: &[Array], end: usize) -> Result<Vec<Array>> {
        let capacity = kv::position_count(buffers)?;
        if end <= capacity {
            return Ok(buffers.to_vec());
        }
        let grow = (end - capacity).div_ceil(STEP) * STEP;
        let valid = kv::positions(buffers, 0, self.offset)?;
        kv::concat_positions(&valid, &kv::zero_positions(buffers, capacity - self.offset + grow)?)
    }

    /// Applies a due conversion (outside rounds).
    fn settle(&mut self) -> Result<()> {
        if self.round.is_some() || !self.precision.due(self.offset) {
            return Ok(());
        }
        if let Some(parts) = &self.parts {
            let valid = kv::positions(parts, 0, self.offset)?;
            self.parts = Some(self.precision.convert(&valid, self.offset)?);
        }
        Ok(())
    }

    /// The valid positions' parts, `None` while empty.
    fn valid(&self) -> Result<Option<Vec<Array>>> {
        match &self.parts {
            Some(parts) => Ok(Some(kv::positions(parts, 0, self.offset)?)),
            None => Ok(None),
        }
    }
}

impl Cache for PlainCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn signature(&self) -> String {
        format!("plain{}", self.precision.encoding().signature())
    }

    fn bytes_per_token(&self) -> usize {
        self.parts.as_deref().map_or(0, kv::bytes_per_position)
    }

    fn stored_positions(&self) -> usize {
        self.offset
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
        let Some(parts) = self.valid()? else {
            return Err(Error::InvalidRequest("an empty cache has no state to save".into()));
        };
        let mut state =
            CacheState::of(self.signature(), self.offset, self.precision.codec(), parts);
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
        if kv::position_count(&parts)? != offset {
            return Err(Error::InvalidRequest(format!(
                "plain cache state holds {} positions, offset says {offset}",
                kv::position_count(&parts)?
            )));
        }
        self.parts = Some(parts);
        self.offset = offset;
        self.precision = precision;
        Ok(())
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    fn trim(&mut self, n: usize) -> Result<usize> {
        if self.round.is_some() {
            return Err(super::round_error("no trim inside a round"));
        }
        let n = n.min(self.offset);
        let floor = self.minimum_reusable_offset();
        if self.offset - n < floor {
            return Err(Error::InvalidRequest(format!(
                "a cache converted at {floor} positions cannot be trimmed to {}",
                self.offset - n
            )));
        }
        self.offset -= n;
        Ok(n)
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(super::round_error("a round is already armed"));
        }
        self.round = Some(Round { offset: self.offset });
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        self.round.take().ok_or_else(|| super::round_error("commit without a round"))?;
        self.settle()
    }

    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        let start = self.round.as_ref().map(|r| r.offset);
        let start = start.ok_or_else(|| super::round_error("rollback without a round"))?;
        let appended = self.offset - start;
        if keep > appended {
            return Err(super::round_error(&format!(
                "cannot keep {keep} of the {appended} positions appended"
            )));
        }
        // Positions past the offset are never read and the next append overwrites them.
        self.offset = start + keep;
        self.round = None;
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
        // The filled slots only: the growth room past them is not the row's.
        let parts = self.valid().ok()?;
        let empty = PlainCache::encoded(self.precision.encoding(), &self.ops);
        let this = std::mem::replace(self, empty);
        Some(super::SlotRow {
            parts,
            offset: this.offset,
            stored: this.offset,
            cursor: this.offset,
            window: None,
            precision: this.precision,
            ops: this.ops,
        })
    }
}

impl AttentionCache for PlainCache {
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let length = check_append(keys, values, true)?;
        let parts = self.write(keys, values, length)?;
        let read = AttentionRead::one_query(parts, self.precision.codec(), &self.ops);
        self.settle()?;
        Ok(read)
    }

    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let length = check_append(keys, values, false)?;
        let parts = self.write(keys, values, length)?;
        let mask = if length == 1 { ReadMask::None } else { ReadMask::Causal };
        let read = AttentionRead::masked(parts, self.precision.codec(), mask, &self.ops);
        self.settle()?;
        Ok(read)
    }

    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        Ok(self
            .valid()?
            .map(|parts| AttentionRead::one_query(parts, self.precision.codec(), &self.ops)))
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

impl CommittedAttentionCache for PlainCache {}

impl BlockAttentionCache for PlainCache {
    fn read_block(&self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        super::block_read(self.donor_read()?, keys, values, self.precision.codec(), &self.ops)
    }
}

impl BidirectionalAttentionCache for PlainCache {
    fn append_bidirectional(
        &mut self,
        keys: &Array,
        values: &Array,
        flags: &[bool],
    ) -> Result<AttentionRead> {
        let length = check_append(keys, values, false)?;
        super::check_flags(flags, length)?;
        let mask = overlay_mask(self.offset, flags, None)?;
        let parts = self.write(keys, values, length)?;
        let read =
            AttentionRead::masked(parts, self.precision.codec(), ReadMask::Array(mask), &self.ops);
        self.settle()?;
        Ok(read)
    }
}

impl CompiledDecodeCache for PlainCache {
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>> {
        match &self.parts {
            Some(parts) if self.round.is_none() => {
                Ok(Some(concat_slot(parts, self.offset, self.precision.codec())?))
            }
            _ => Ok(None),
        }
    }

    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()> {
        if fetch != DecodeFetch::Concat {
            return Err(Error::InvalidRequest("a plain cache is read by concatenation".into()));
        }
        super::step_outputs(&outputs, self.precision.codec())?;
        // The step's read is the stored positions: it becomes the buffer (no spare capacity;
        // the next uncompiled write grows it).
        self.parts = Some(outputs);
        self.offset += 1;
        self.settle()
    }

    fn abort_decode_step(&mut self, _slot: DecodeSlot) {}
}
