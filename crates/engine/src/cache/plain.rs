//! A growable key/value buffer: every position ever appended stays visible.

use mlx::{Array, ops};

use super::{
    AttentionCache, AttentionRead, BidirectionalAttentionCache, BlockAttentionCache, Cache,
    CacheState, CommittedAttentionCache, CompiledDecodeCache, DecodeFetch, DecodeSlot, ReadMask,
    check_append, check_signature, concat_slot, overlay_mask, state_of, state_tensor, step_outputs,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// Buffers grow in steps of this many positions (as mlx-lm's `KVCache` does), so decode
/// writes in place most of the time.
const STEP: i32 = 256;

/// Keys and values in buffers `[B, H, capacity, D]`, valid up to the offset.
#[derive(Debug, Default)]
pub struct PlainCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    /// The offset when the armed speculative round began.
    round: Option<usize>,
    /// What its reads run.
    ops: Ops,
}

impl PlainCache {
    /// An empty cache read with MLX's ops.
    pub fn new() -> PlainCache {
        PlainCache::default()
    }

    /// An empty cache whose reads run `ops`.
    pub fn with_ops(ops: &Ops) -> PlainCache {
        PlainCache { ops: ops.clone(), ..PlainCache::default() }
    }

    /// Writes `keys`/`values` at the offset, growing the buffers when needed, and returns the
    /// valid prefix `[.., :offset + L, ..]`.
    fn write(&mut self, keys: &Array, values: &Array, length: usize) -> Result<(Array, Array)> {
        let start = self.offset as i32;
        let end = start + length as i32;
        let (mut kbuf, mut vbuf) = self.reserve(keys, values, end)?;
        let kshape = keys.shape();
        let vshape = values.shape();
        kbuf = kbuf.slice_update(
            keys,
            &[0, 0, start, 0],
            &[kshape[0], kshape[1], end, kshape[3]],
            &[1, 1, 1, 1],
        )?;
        vbuf = vbuf.slice_update(
            values,
            &[0, 0, start, 0],
            &[vshape[0], vshape[1], end, vshape[3]],
            &[1, 1, 1, 1],
        )?;
        let read_k = kbuf.slice(&[0, 0, 0, 0], &bounds(&kbuf, end)?, &[1, 1, 1, 1])?;
        let read_v = vbuf.slice(&[0, 0, 0, 0], &bounds(&vbuf, end)?, &[1, 1, 1, 1])?;
        self.keys = Some(kbuf);
        self.values = Some(vbuf);
        self.offset += length;
        Ok((read_k, read_v))
    }
}

impl PlainCache {
    /// The buffers, grown (in steps of [`STEP`] positions) to hold at least `end` positions;
    /// new buffers shaped like `keys`/`values` when there are none.
    fn reserve(&self, keys: &Array, values: &Array, end: i32) -> Result<(Array, Array)> {
        let start = self.offset as i32;
        let (mut kbuf, mut vbuf) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) => (k.clone(), v.clone()),
            _ => (empty_like(keys, 0)?, empty_like(values, 0)?),
        };
        let capacity = kbuf.dim(2)?;
        if end > capacity {
            let grow = (end - capacity + STEP - 1) / STEP * STEP;
            let valid_k = kbuf.slice(&[0, 0, 0, 0], &bounds(&kbuf, start)?, &[1, 1, 1, 1])?;
            let valid_v = vbuf.slice(&[0, 0, 0, 0], &bounds(&vbuf, start)?, &[1, 1, 1, 1])?;
            kbuf = ops::concatenate(&[&valid_k, &empty_like(keys, capacity - start + grow)?], 2)?;
            vbuf = ops::concatenate(&[&valid_v, &empty_like(values, capacity - start + grow)?], 2)?;
        }
        Ok((kbuf, vbuf))
    }
}

/// `[B, H, n, D]` zeros shaped like `like` along every axis but 2.
fn empty_like(like: &Array, n: i32) -> Result<Array> {
    let s = like.shape();
    Ok(ops::zeros(&[s[0], s[1], n, s[3]], like.dtype())?)
}

/// Slice bounds covering positions `..end` of a `[B, H, N, D]` buffer.
fn bounds(buffer: &Array, end: i32) -> Result<Vec<i32>> {
    let s = buffer.shape();
    Ok(vec![s[0], s[1], end, s[3]])
}

impl Cache for PlainCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn signature(&self) -> String {
        "plain".into()
    }

    fn bytes_per_token(&self) -> usize {
        super::bytes_per_position(self.keys.as_ref(), self.values.as_ref())
    }

    fn stored_positions(&self) -> usize {
        self.offset
    }

    fn buffers(&self) -> Vec<Array> {
        self.keys.iter().chain(&self.values).cloned().collect()
    }

    fn state(&self) -> Result<CacheState> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Err(Error::InvalidRequest("an empty cache has no state to save".into()));
        };
        let end = self.offset as i32;
        let keys = k.slice(&[0, 0, 0, 0], &bounds(k, end)?, &[1, 1, 1, 1])?;
        let values = v.slice(&[0, 0, 0, 0], &bounds(v, end)?, &[1, 1, 1, 1])?;
        Ok(state_of(self.signature(), self.offset, keys, values))
    }

    fn restore(&mut self, state: &CacheState) -> Result<()> {
        if self.round.is_some() {
            return Err(super::round_error("no restore inside a round"));
        }
        check_signature(state, &self.signature())?;
        let offset = state.number("offset")?;
        let keys = state_tensor(state, "keys")?;
        let values = state_tensor(state, "values")?;
        if keys.dim(2)? as usize != offset || values.dim(2)? as usize != offset {
            return Err(Error::InvalidRequest(format!(
                "plain cache state holds {} positions, offset says {offset}",
                keys.dim(2)?
            )));
        }
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        self.offset = offset;
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
        self.offset -= n;
        Ok(n)
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(super::round_error("a round is already armed"));
        }
        self.round = Some(self.offset);
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        self.round.take().map(|_| ()).ok_or_else(|| super::round_error("commit without a round"))
    }

    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        let start = self.round.ok_or_else(|| super::round_error("rollback without a round"))?;
        let appended = self.offset - start;
        if keep > appended {
            return Err(super::round_error(&format!(
                "cannot keep {keep} of the {appended} positions appended"
            )));
        }
        // Positions past the offset are never read and the next append overwrites them.
        self.offset = start + keep;
        self.round = None;
        Ok(())
    }

    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }

    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }
}

impl AttentionCache for PlainCache {
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let length = check_append(keys, values, true)?;
        let (k, v) = self.write(keys, values, length)?;
        Ok(AttentionRead::one_query(k, v, &self.ops))
    }

    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let length = check_append(keys, values, false)?;
        let (k, v) = self.write(keys, values, length)?;
        let mask = if length == 1 { ReadMask::None } else { ReadMask::Causal };
        Ok(AttentionRead::masked(k, v, mask, &self.ops))
    }

    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        let end = self.offset as i32;
        let keys = k.slice(&[0, 0, 0, 0], &bounds(k, end)?, &[1, 1, 1, 1])?;
        let values = v.slice(&[0, 0, 0, 0], &bounds(v, end)?, &[1, 1, 1, 1])?;
        Ok(Some(AttentionRead::one_query(keys, values, &self.ops)))
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
        super::block_read(self.donor_read()?, keys, values, &self.ops)
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
        let (k, v) = self.write(keys, values, length)?;
        Ok(AttentionRead::masked(k, v, ReadMask::Array(mask), &self.ops))
    }
}

impl CompiledDecodeCache for PlainCache {
    fn begin_decode_step(&mut self) -> Result<Option<DecodeSlot>> {
        match (&self.keys, &self.values) {
            (Some(k), Some(v)) if self.round.is_none() => Ok(Some(concat_slot(k, v, self.offset)?)),
            _ => Ok(None),
        }
    }

    fn end_decode_step(&mut self, fetch: DecodeFetch, outputs: Vec<Array>) -> Result<()> {
        let (keys, values) = step_outputs(outputs)?;
        if fetch != DecodeFetch::Concat {
            return Err(Error::InvalidRequest("a plain cache is read by concatenation".into()));
        }
        // The step's read is the stored positions: it becomes the buffer (no spare capacity;
        // the next uncompiled write grows it).
        self.keys = Some(keys);
        self.values = Some(values);
        self.offset += 1;
        Ok(())
    }

    fn abort_decode_step(&mut self, _slot: DecodeSlot) {}
}
