//! [`AttentionRead`]: attention over the positions one phase-named append may see, with the
//! kernel its cache chose for it, and the masks caches build.

use mlx::Array;
use mlx::fast::{AttentionMask, scaled_dot_product_attention};

use super::kv::Codec;
use crate::backend::Ops;
use crate::error::{Error, Result};

/// What a cache's attention read masks.
#[derive(Debug, Clone)]
pub(crate) enum ReadMask {
    /// Every stored position is visible to every query.
    None,
    /// Bottom-right aligned causal: query `i` of `L` sees keys `..= S - L + i`.
    Causal,
    /// An explicit bool mask `[L, S]`, or `[B, 1, L, S]` for a batch of rows (true = visible).
    Array(Array),
}

/// How a read attends, fixed when its cache builds it.
#[derive(Debug, Clone)]
enum Kernel {
    /// One query position over every key: [`Ops::attend_one`] on full precision (Quince's
    /// kernel on CUDA), the codec's products on encoded storage.
    OneQuery,
    /// Attention under this mask (MLX's fused attention on full precision).
    Masked(ReadMask),
    /// Query `i` of a committed span attends with read `i`: each a one-position read, so the
    /// span keeps a decode step's reduction order.
    PerQuery(Vec<AttentionRead>),
    /// Row `b` of a batch attends with read `b` (rows whose storages hold different codecs:
    /// some converted to their quantized format, some not yet).
    PerRow(Vec<AttentionRead>),
}

/// Attention over the positions one phase-named append may see. Owns its handles.
#[derive(Debug, Clone)]
pub struct AttentionRead {
    /// The stored keys' and values' parts in `codec` (see [`super::kv`]).
    pub(super) parts: Vec<Array>,
    pub(super) codec: Codec,
    kernel: Kernel,
    ops: Ops,
}

impl AttentionRead {
    /// A read of every position of `parts` by one query at a time (a decode step, a window of
    /// one position, a donor's read).
    pub(crate) fn one_query(parts: Vec<Array>, codec: &Codec, ops: &Ops) -> AttentionRead {
        AttentionRead { parts, codec: codec.clone(), kernel: Kernel::OneQuery, ops: ops.clone() }
    }

    /// A read under `mask`; a window of one position with every key visible is a one-query read.
    pub(crate) fn masked(
        parts: Vec<Array>,
        codec: &Codec,
        mask: ReadMask,
        ops: &Ops,
    ) -> AttentionRead {
        let kernel = match mask {
            ReadMask::None => Kernel::OneQuery,
            mask => Kernel::Masked(mask),
        };
        AttentionRead { parts, codec: codec.clone(), kernel, ops: ops.clone() }
    }

    /// A read where every query sees every position of `parts` (a block read: the stored
    /// context and the block itself).
    pub(crate) fn all_visible(parts: Vec<Array>, codec: &Codec, ops: &Ops) -> AttentionRead {
        let kernel = Kernel::Masked(ReadMask::None);
        AttentionRead { parts, codec: codec.clone(), kernel, ops: ops.clone() }
    }

    /// A committed span's read: query `i` attends with `reads[i]`, the one-position read of
    /// its own append. `None` for an empty span.
    pub(crate) fn per_query(reads: Vec<AttentionRead>) -> Option<AttentionRead> {
        let last = reads.last()?;
        let (parts, codec, ops) = (last.parts.clone(), last.codec.clone(), last.ops.clone());
        Some(AttentionRead { parts, codec, kernel: Kernel::PerQuery(reads), ops })
    }

    /// A batch's read where row `b` attends with `reads[b]`. `None` for no rows.
    pub(crate) fn per_row(reads: Vec<AttentionRead>) -> Option<AttentionRead> {
        let first = reads.first()?;
        let (parts, codec, ops) = (first.parts.clone(), first.codec.clone(), first.ops.clone());
        Some(AttentionRead { parts, codec, kernel: Kernel::PerRow(reads), ops })
    }

    /// The mask this read applies (`None` for a one-query read); a committed span's or a
    /// batch's per-row read has none that one array could say.
    pub(crate) fn mask(&self) -> Result<ReadMask> {
        match &self.kernel {
            Kernel::OneQuery => Ok(ReadMask::None),
            Kernel::Masked(mask) => Ok(mask.clone()),
            Kernel::PerQuery(_) | Kernel::PerRow(_) => {
                Err(Error::InvalidRequest("a read of several reads is not a masked read".into()))
            }
        }
    }

    /// The ops it attends with.
    pub(crate) fn ops(&self) -> &Ops {
        &self.ops
    }

    /// The stored keys and values it reads, decoded to floating point (what a naive
    /// recompute over the same stored values attends).
    pub fn keys_values(&self) -> Result<(Array, Array)> {
        self.codec.decode(&self.parts)
    }

    /// Attends queries `q` `[B, Hq, L, D]` (positional encoding applied; `Hq` a multiple of the
    /// stored heads) → `[B, Hq, L, D]`. Callable any number of times: KV-sharing layers attend
    /// a donor's read with their own queries. `L` may be smaller than the appended length: the
    /// queries are then the *last* `L` positions of the phase (a prefill that only needs the
    /// last row's logits).
    pub fn attend(&self, q: &Array, scale: f32) -> Result<Array> {
        let queries = q.dim(2)?;
        let mask = match &self.kernel {
            Kernel::OneQuery if queries == 1 => {
                return self.codec.attend(q, &self.parts, scale, AttentionMask::None, &self.ops);
            }
            Kernel::OneQuery => {
                return Err(Error::InvalidRequest(format!(
                    "a one-query read attends one query position, not {queries}"
                )));
            }
            Kernel::Masked(mask) => mask,
            Kernel::PerQuery(reads) => return attend_each(reads, q, scale),
            Kernel::PerRow(reads) => return attend_rows(reads, q, scale),
        };
        let trimmed;
        let mask = match mask {
            ReadMask::None => AttentionMask::None,
            ReadMask::Causal => AttentionMask::Causal,
            ReadMask::Array(m) => {
                // Queries on the next-to-last axis.
                let shape = m.shape();
                let axis = shape.len() - 2;
                let rows = shape[axis];
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
        // A full-precision read under no mask goes to MLX's fused attention, not the one-query
        // kernel: a block read's queries are many.
        match (&self.codec, mask) {
            (Codec::Full, AttentionMask::None) => {
                let [k, v] = &self.parts[..] else {
                    return Err(Error::InvalidRequest("full keys and values are 2 parts".into()));
                };
                Ok(scaled_dot_product_attention(q, k, v, scale, AttentionMask::None, None)?)
            }
            (_, mask) => self.codec.attend(q, &self.parts, scale, mask, &self.ops),
        }
    }

    /// This read with a block's own `keys`/`values` after its positions, every position
    /// visible to every query (a block read over a cache's donor read).
    pub(crate) fn with_block(&self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        let block = self.codec.encode_kv(keys, values)?;
        let parts = super::kv::concat_positions(&self.parts, &block)?;
        Ok(AttentionRead::all_visible(parts, &self.codec, &self.ops))
    }

    /// Number of key positions the read covers.
    pub fn len(&self) -> Result<usize> {
        super::kv::position_count(&self.parts)
    }

    /// Whether the read covers no position.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

/// Queries `q` `[B, Hq, L, D]`, the last `L` of a committed span, each through its own read.
fn attend_each(reads: &[AttentionRead], q: &Array, scale: f32) -> Result<Array> {
    let shape = q.shape();
    let queries = shape[2] as usize;
    let Some(first) = reads.len().checked_sub(queries) else {
        return Err(Error::InvalidRequest(format!(
            "{queries} queries for a committed span of {}",
            reads.len()
        )));
    };
    let outputs = reads[first..]
        .iter()
        .enumerate()
        .map(|(i, read)| {
            let i = i as i32;
            let one = q.slice(&[0, 0, i, 0], &[shape[0], shape[1], i + 1, shape[3]], &[1; 4])?;
            read.attend(&one, scale)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(mlx::ops::concatenate(&outputs.iter().collect::<Vec<_>>(), 2)?)
}

/// Queries `q` `[B, Hq, L, D]`, row `b` through `reads[b]`.
fn attend_rows(reads: &[AttentionRead], q: &Array, scale: f32) -> Result<Array> {
    let s = q.shape();
    if s[0] as usize != reads.len() {
        return Err(Error::InvalidRequest(format!(
            "{} query rows for a batch of {}",
            s[0],
            reads.len()
        )));
    }
    let outputs = reads
        .iter()
        .enumerate()
        .map(|(b, read)| {
            let b = b as i32;
            let row = q.slice(&[b, 0, 0, 0], &[b + 1, s[1], s[2], s[3]], &[1; 4])?;
            read.attend(&row, scale)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(mlx::ops::concatenate(&outputs.iter().collect::<Vec<_>>(), 0)?)
}

/// Block id per position: the index of its run of consecutive `flags`, or −1.
fn block_ids(flags: &[bool]) -> Vec<i32> {
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
    crate::uploads::bools(&visible, &[length as i32, total as i32])
}
