//! The stand-in a cache's slot puts in a traced (compiled) decode step: the model appends to
//! it as to the real cache, and what it would store becomes the step's outputs.

use mlx::Array;

use super::{AttentionCache, AttentionRead, Cache, CacheState, DecodeFetch, check_append};
use crate::backend::Ops;
use crate::error::{Error, Result};

#[derive(Debug)]
pub(crate) struct TraceCache {
    fetch: DecodeFetch,
    inputs: Vec<Array>,
    ops: Ops,
    /// Set by the append: the slot's outputs.
    outputs: Vec<Array>,
}

impl TraceCache {
    /// A slot of kind `fetch` over its closure `inputs`, read with `ops` (a shapeless step's).
    pub(crate) fn new(fetch: DecodeFetch, inputs: Vec<Array>, ops: &Ops) -> TraceCache {
        TraceCache { fetch, inputs, ops: ops.clone(), outputs: Vec::new() }
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
        format!("trace({:?})", self.fetch)
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
        let (k, v) = match self.fetch {
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
        Ok(AttentionRead::one_query(k, v, &self.ops))
    }
    fn append_window(&mut self, _: &Array, _: &Array) -> Result<AttentionRead> {
        Err(trace_only())
    }
    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        Err(trace_only())
    }
}
