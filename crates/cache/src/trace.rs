//! The stand-in a cache's slot puts in a traced (compiled) decode step: the model appends to
//! it as to the real cache, and what it would store becomes the step's outputs.

use mlx::Array;

use super::kv;
use super::{
    AttentionCache, AttentionRead, Cache, CacheState, DecodeFetch, ReadMask, SlotKind, check_append,
};
use crate::backend::Ops;
use crate::error::{Error, Result};

/// The stand-in for one cache in a traced decode step ([`crate::compiled`]): the model appends
/// its one position to it as to the real cache; the step's outputs are what the cache would
/// then store ([`TraceCache::buffers`]).
#[derive(Debug)]
pub struct TraceCache {
    kind: SlotKind,
    inputs: Vec<Array>,
    ops: Ops,
    /// Set by the append: the slot's outputs.
    outputs: Vec<Array>,
}

impl TraceCache {
    /// A slot of `kind` over its closure `inputs`, read with `ops` (a shapeless step's).
    pub fn new(kind: SlotKind, inputs: Vec<Array>, ops: &Ops) -> TraceCache {
        TraceCache { kind, inputs, ops: ops.clone(), outputs: Vec::new() }
    }
}

fn trace_only() -> Error {
    Error::InvalidRequest("a traced decode step only appends one decode position".into())
}

impl Cache for TraceCache {
    fn offset(&self) -> usize {
        0
    }
    fn signature(&self) -> String {
        format!("trace({})", self.kind.key())
    }
    fn bytes_per_token(&self) -> usize {
        0
    }
    fn stored_positions(&self) -> usize {
        0
    }
    fn buffers(&self) -> Vec<Array> {
        self.outputs.clone()
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
    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }
    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }
}

impl AttentionCache for TraceCache {
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        check_append(keys, values, true)?;
        let codec = &self.kind.codec;
        let new = codec.encode_kv(keys, values)?;
        let (stored, rest) = self.inputs.split_at(self.kind.outputs());
        let parts = match self.kind.fetch {
            DecodeFetch::Concat => kv::concat_positions(stored, &new)?,
            DecodeFetch::Ring => stored
                .iter()
                .zip(&new)
                .map(|(buffer, n)| Ok(buffer.slice_update_dynamic(n, &rest[0], &[2])?))
                .collect::<Result<Vec<_>>>()?,
            DecodeFetch::Rows => stored
                .iter()
                .zip(&new)
                .map(|(buffer, n)| Ok(buffer.put_along_axis(&rest[0], n, 2)?))
                .collect::<Result<Vec<_>>>()?,
        };
        self.outputs = parts.clone();
        match self.kind.fetch {
            // Each row sees the slots it has filled, the new one included.
            DecodeFetch::Rows => {
                let mask = ReadMask::Array(rest[1].clone());
                Ok(AttentionRead::masked(parts, codec, mask, &self.ops))
            }
            // Every stored position is visible to the new one: a ring only takes part once
            // full, when it holds exactly the window.
            DecodeFetch::Concat | DecodeFetch::Ring => {
                Ok(AttentionRead::one_query(parts, codec, &self.ops))
            }
        }
    }
    fn append_window(&mut self, _: &Array, _: &Array) -> Result<AttentionRead> {
        Err(trace_only())
    }
    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        Err(trace_only())
    }
}
