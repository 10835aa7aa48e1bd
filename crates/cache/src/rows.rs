//! A batch of rows, each kept in its own storage: the row layout that verification and
//! batching need (rows at their own offsets, joined, extracted, filtered, and a speculative
//! round resolved with one keep count per row).
//!
//! Every row is a single-sequence cache of its own storage (plain, ring, quantized, …; rows of
//! different storages batch together), so each row is exactly what that storage would be for
//! its sequence alone, whatever the other rows do: a per-row rollback is each row's own
//! rollback, and an extracted row is an ordinary cache. An
//! append hands each row its slice of the batch; the read then stacks the rows' reads, each
//! left-padded to the longest with padding no query sees (the seed's `leftPad`).
//!
//! A batch is itself a layer's [`Cache`] in a batched forward pass (the engine's batch): it
//! reports each row's offset ([`Cache::row_offsets`]) so the model rotates each row at its
//! own position, and a batch of one row takes part in a compiled decode step through its row.
//!
//! The cost of keeping rows apart: a batch of more than one row copies every row's visible keys
//! and values into the stacked read at each append, several ops per row and layer. Full
//! precision rows decode and verify in shared buffers instead ([`super::SlotRows`], a few ops
//! per layer whatever the row count); this layout is what encoded storage batches in, and rows
//! of different storages. A batch of one row reads straight from its storage.

use mlx::{Array, Dtype, ops};

use super::{
    AttentionCache, AttentionRead, BatchRows, Cache, CacheState, ReadMask, check_append,
    round_error,
};
use crate::error::{Error, Result};

/// How many positions of a speculative round each row keeps.
#[derive(Debug, Clone, Copy)]
pub enum Keep<'a> {
    /// The same count for every row.
    All(usize),
    /// One count per row, in row order.
    Each(&'a [usize]),
}

/// Rows of one batch, each in its own storage. See the module docs.
#[derive(Debug, Default)]
pub struct CacheRows {
    /// Every row's cache, each an attention storage ([`Cache::as_attention`]).
    rows: Vec<Box<dyn Cache>>,
    /// Each row's offset when the armed round began.
    round: Option<Vec<usize>>,
}

impl CacheRows {
    /// An empty batch; rows join with [`CacheRows::merge_rows`].
    pub fn new() -> CacheRows {
        CacheRows::default()
    }

    /// Number of rows.
    pub fn batch_size(&self) -> usize {
        self.rows.len()
    }

    /// Each row's offset: the position its next appended token takes.
    pub fn row_offsets(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.offset()).collect()
    }

    /// Padding positions the next read puts before each row's stored ones, so that every row
    /// ends at the same column (before the append: the append adds the same count to each).
    pub fn left_pad(&self) -> Result<Vec<usize>> {
        let stored: Vec<usize> = self.rows.iter().map(|r| r.stored_positions()).collect();
        let longest = stored.iter().copied().max().unwrap_or(0);
        Ok(stored.iter().map(|s| longest - s).collect())
    }

    /// Row `row`'s storage.
    pub fn row(&self, row: usize) -> Option<&dyn AttentionCache> {
        self.rows.get(row).and_then(|r| r.as_attention())
    }

    /// Appends `rows` after the existing ones: attention storage of any kind (each row reads
    /// its own: rows of different storages, full-precision beside quantized, batch too);
    /// outside a round only.
    pub fn merge_rows(&mut self, rows: Vec<Box<dyn Cache>>) -> Result<()> {
        self.outside_round("merge rows")?;
        if let Some(other) = rows.iter().find(|r| r.as_attention().is_none()) {
            return Err(Error::InvalidRequest(format!(
                "a batch of attention rows cannot take {}",
                other.signature()
            )));
        }
        self.rows.extend(rows);
        Ok(())
    }

    /// Removes row `row` and returns it: an ordinary single-sequence cache. Outside a round.
    pub fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>> {
        self.outside_round("extract a row")?;
        self.check_row(row)?;
        Ok(self.rows.remove(row))
    }

    /// Keeps only the rows listed, in the order listed (each once). Outside a round.
    pub fn filter_rows(&mut self, keep: &[usize]) -> Result<()> {
        self.outside_round("filter rows")?;
        let mut seen = vec![false; self.rows.len()];
        for &row in keep {
            self.check_row(row)?;
            if std::mem::replace(&mut seen[row], true) {
                return Err(Error::InvalidRequest(format!("row {row} listed twice")));
            }
        }
        let mut rows: Vec<Option<Box<dyn Cache>>> =
            std::mem::take(&mut self.rows).into_iter().map(Some).collect();
        self.rows = keep.iter().filter_map(|&row| rows[row].take()).collect();
        Ok(())
    }

    /// The most positions the next append may add to every row (the least of the rows'
    /// [`super::Cache::max_append`]; `None`: any number).
    pub fn max_append(&self) -> Option<usize> {
        self.rows.iter().filter_map(|r| r.max_append()).min()
    }

    /// Arms a round on every row.
    pub fn spec_round_begin(&mut self) -> Result<()> {
        self.outside_round("begin a round")?;
        for (i, row) in self.rows.iter_mut().enumerate() {
            if let Err(e) = row.spec_round_begin() {
                // Disarm the rows already armed: nothing was appended, nothing changes.
                for armed in &mut self.rows[..i] {
                    armed.spec_round_rollback(0)?;
                }
                return Err(e);
            }
        }
        self.round = Some(self.row_offsets());
        Ok(())
    }

    /// Keeps every position the round appended, in every row.
    pub fn spec_round_commit(&mut self) -> Result<()> {
        if self.round.take().is_none() {
            return Err(round_error("commit without a round"));
        }
        self.rows.iter_mut().try_for_each(|r| r.spec_round_commit())
    }

    /// Keeps the first `keep` positions each row appended in the round. Afterwards every row
    /// is exactly as if only its kept positions had been appended, one decode step each. A
    /// count above what a row appended is refused before any row changes.
    pub fn spec_round_rollback(&mut self, keep: Keep<'_>) -> Result<()> {
        let starts = self.round.as_ref().ok_or_else(|| round_error("rollback without a round"))?;
        let counts = match keep {
            Keep::All(n) => vec![n; self.rows.len()],
            Keep::Each(counts) if counts.len() == self.rows.len() => counts.to_vec(),
            Keep::Each(counts) => {
                return Err(round_error(&format!(
                    "{} keep counts for {} rows",
                    counts.len(),
                    self.rows.len()
                )));
            }
        };
        for (row, ((cache, start), keep)) in self.rows.iter().zip(starts).zip(&counts).enumerate() {
            let appended = cache.offset() - start;
            if *keep > appended {
                return Err(round_error(&format!(
                    "row {row} cannot keep {keep} of the {appended} positions appended"
                )));
            }
        }
        self.round = None;
        self.rows.iter_mut().zip(counts).try_for_each(|(row, keep)| row.spec_round_rollback(keep))
    }

    fn append(&mut self, keys: &Array, values: &Array, decode: bool) -> Result<AttentionRead> {
        let length = check_append(keys, values, decode)?;
        let batch = keys.dim(0)? as usize;
        if batch != self.rows.len() {
            return Err(Error::InvalidRequest(format!(
                "an append of {batch} rows to a batch of {}",
                self.rows.len()
            )));
        }
        if let [row] = self.rows.as_mut_slice() {
            let row = super::attention_of(row.as_mut())?;
            return if decode {
                row.append_decode(keys, values)
            } else {
                row.append_window(keys, values)
            };
        }
        if self.round.is_some() && self.max_append().is_some_and(|most| length > most) {
            return Err(round_error(&format!(
                "{length} positions would cross a row's KV conversion (at most {:?})",
                self.max_append()
            )));
        }
        // Every row's storage takes appends of the batch's one shape (the model's heads), so a
        // bad append fails on the first row, before any row has changed.
        let mut reads = Vec::with_capacity(batch);
        for (b, row) in self.rows.iter_mut().enumerate() {
            let row = super::attention_of(row.as_mut())?;
            let (k, v) = (row_of(keys, b)?, row_of(values, b)?);
            reads.push(if decode {
                row.append_decode(&k, &v)?
            } else {
                row.append_window(&k, &v)?
            });
        }
        stack_reads(&reads, length)
    }

    fn outside_round(&self, what: &str) -> Result<()> {
        match self.round {
            Some(_) => Err(round_error(&format!("cannot {what} inside a round"))),
            None => Ok(()),
        }
    }

    fn check_row(&self, row: usize) -> Result<()> {
        if row >= self.rows.len() {
            return Err(Error::InvalidRequest(format!(
                "row {row} of a batch of {}",
                self.rows.len()
            )));
        }
        Ok(())
    }
}

/// A batch is one layer's cache in a batched forward pass: the model appends every row's keys
/// and values at once and reads back the stacked, left-padded read; each row's new positions
/// start at its own offset ([`Cache::row_offsets`]). Whole-batch calls that would mean a
/// different thing per row (persistence, trims) are refused: a row leaves the batch
/// ([`CacheRows::extract_row`]) to be saved or trimmed.
impl Cache for CacheRows {
    /// The longest row's offset (each row's: [`Cache::row_offsets`]).
    fn offset(&self) -> usize {
        self.rows.iter().map(|r| r.offset()).max().unwrap_or(0)
    }

    /// `rows(…)` of the rows' storages, each named once.
    fn signature(&self) -> String {
        let mut storages: Vec<String> = Vec::new();
        for row in &self.rows {
            let signature = row.signature();
            if !storages.contains(&signature) {
                storages.push(signature);
            }
        }
        format!("rows({})", storages.join("|"))
    }

    /// What one more position costs the costliest row.
    fn bytes_per_token(&self) -> usize {
        self.rows.iter().map(|r| r.bytes_per_token()).max().unwrap_or(0)
    }

    /// The longest row's stored positions.
    fn stored_positions(&self) -> usize {
        self.rows.iter().map(|r| r.stored_positions()).max().unwrap_or(0)
    }

    fn max_append(&self) -> Option<usize> {
        CacheRows::max_append(self)
    }

    fn row_offsets(&self) -> Option<Vec<usize>> {
        Some(CacheRows::row_offsets(self))
    }

    fn buffers(&self) -> Vec<Array> {
        self.rows.iter().flat_map(|r| r.buffers()).collect()
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        CacheRows::spec_round_begin(self)
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        CacheRows::spec_round_commit(self)
    }

    /// The same count for every row ([`CacheRows::spec_round_rollback`] takes one per row).
    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        CacheRows::spec_round_rollback(self, Keep::All(keep))
    }

    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }

    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }

    super::rows_cache_methods!();
}

impl BatchRows for CacheRows {
    fn batch_size(&self) -> usize {
        CacheRows::batch_size(self)
    }

    fn row_donor_read(&self, row: usize) -> Result<Option<AttentionRead>> {
        self.check_row(row)?;
        self.row(row).map_or(Ok(None), |r| r.donor_read())
    }

    fn merge_row(&mut self, row: Box<dyn Cache>) -> Result<()> {
        self.merge_rows(vec![row])
    }

    fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>> {
        CacheRows::extract_row(self, row)
    }

    fn rollback_rows(&mut self, keep: &[usize]) -> Result<()> {
        self.spec_round_rollback(Keep::Each(keep))
    }
}

impl AttentionCache for CacheRows {
    /// Decode: one new position per row (`[B, H, 1, D]`, `B` the batch size).
    fn append_decode(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        self.append(keys, values, true)
    }

    /// Window: `L` new positions per row, causal within the window.
    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        self.append(keys, values, false)
    }

    /// A batch of one row takes part in a compiled decode step through its row's storage (a
    /// lone reply decodes as fast as it would outside a batch); a batch of more rows runs op
    /// by op.
    fn compiled(&mut self) -> Option<&mut dyn super::CompiledDecodeCache> {
        match self.rows.as_mut_slice() {
            [row] if self.round.is_none() => row.as_attention_mut()?.compiled(),
            _ => None,
        }
    }

    /// Refused: a drafter reads one sequence's keys and values.
    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        Err(Error::InvalidRequest("a batch of rows has no donor read: extract the row".into()))
    }
}

/// Row `b` of `[B, H, L, D]`, as `[1, H, L, D]`.
fn row_of(x: &Array, b: usize) -> Result<Array> {
    let s = x.shape();
    let b = b as i32;
    Ok(x.slice(&[b, 0, 0, 0], &[b + 1, s[1], s[2], s[3]], &[1, 1, 1, 1])?)
}

/// One read over the rows' reads: keys and values `[B, H, S, D]` with each row left-padded to
/// the longest, and a bool mask `[B, 1, L, S]` that hides the padding and keeps each row's own
/// mask over its positions.
fn stack_reads(reads: &[AttentionRead], length: usize) -> Result<AttentionRead> {
    let codec = |r: &AttentionRead| r.codec.name();
    if reads.windows(2).any(|w| codec(&w[0]) != codec(&w[1])) {
        // Rows on both sides of their KV conversion: each row reads its own storage.
        return AttentionRead::per_row(reads.to_vec())
            .ok_or_else(|| Error::InvalidRequest("a batch of no rows".into()));
    }
    let lens = reads.iter().map(|r| r.len()).collect::<Result<Vec<_>>>()?;
    let longest = lens.iter().copied().max().unwrap_or(0);
    let masks = reads.iter().map(AttentionRead::mask).collect::<Result<Vec<_>>>()?;
    // One zero for every padding: each padded part is one op.
    let zero = Array::scalar(0.0f32)?;
    let rows = reads
        .iter()
        .zip(&lens)
        .map(|(read, &len)| left_pad(&read.parts, longest - len, &zero))
        .collect::<Result<Vec<_>>>()?;
    // Part by part, the rows stacked on the batch axis.
    let parts = (0..rows.first().map_or(0, Vec::len))
        .map(|p| Ok(ops::concatenate(&rows.iter().map(|r| &r[p]).collect::<Vec<_>>(), 0)?))
        .collect::<Result<Vec<_>>>()?;
    let mask = if masks.iter().all(|m| !matches!(m, ReadMask::Array(_))) {
        // Every row's mask is a rule (a decode step's, a window's causal one): the whole
        // batch's mask is made on the host, one array.
        let mut visible = Vec::with_capacity(reads.len() * length * longest);
        for (mask, &len) in masks.iter().zip(&lens) {
            visible.extend(rule_mask(mask, length, len, longest - len));
        }
        crate::uploads::bools(&visible, &[reads.len() as i32, 1, length as i32, longest as i32])?
    } else {
        let rows = masks
            .iter()
            .zip(&lens)
            .map(|(mask, &len)| row_mask(mask, length, len, longest - len))
            .collect::<Result<Vec<_>>>()?;
        ops::stack(&rows.iter().collect::<Vec<_>>(), 0)?.expand_dims(&[1])?
    };
    // The rows' reads share their storage's codec and ops (one signature per batch).
    let first = reads.first().ok_or_else(|| Error::InvalidRequest("a batch of no rows".into()))?;
    Ok(AttentionRead::masked(parts, &first.codec, ReadMask::Array(mask), first.ops()))
}

/// `[1, H, N, ·]` parts with `pad` positions of `zero` put first.
fn left_pad(parts: &[Array], pad: usize, zero: &Array) -> Result<Vec<Array>> {
    if pad == 0 {
        return Ok(parts.to_vec());
    }
    parts.iter().map(|p| Ok(p.pad(&[2], &[pad as i32], &[0], zero)?)).collect()
}

/// A rule mask (none, or bottom-right causal) over a row's `len` positions behind `pad`
/// hidden ones, as `L × (pad + len)` bools, row-major: query `i` sees its `j ≤ len − L + i`.
fn rule_mask(mask: &ReadMask, queries: usize, len: usize, pad: usize) -> Vec<bool> {
    let causal = matches!(mask, ReadMask::Causal);
    let total = pad + len;
    let mut visible = Vec::with_capacity(queries * total);
    for i in 0..queries {
        for j in 0..total {
            visible.push(j >= pad && (!causal || j - pad + queries <= len + i));
        }
    }
    visible
}

/// A row's mask `[L, pad + len]` as bools: the padding hidden, the row's own mask after it.
fn row_mask(mask: &ReadMask, queries: usize, len: usize, pad: usize) -> Result<Array> {
    let own = match mask {
        ReadMask::Array(m) => {
            if m.dtype() != Dtype::Bool || m.shape() != [queries as i32, len as i32] {
                return Err(Error::InvalidRequest(format!(
                    "a row read's mask {:?} {:?} is not a bool [{queries}, {len}]",
                    m.dtype(),
                    m.shape()
                )));
            }
            if pad == 0 {
                return Ok(m.clone());
            }
            let hidden = ops::zeros(&[queries as i32, pad as i32], Dtype::Bool)?;
            return Ok(ops::concatenate(&[&hidden, m], 1)?);
        }
        rule => rule,
    };
    let visible = rule_mask(own, queries, len, pad);
    crate::uploads::bools(&visible, &[queries as i32, (pad + len) as i32])
}
