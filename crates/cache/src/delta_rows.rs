//! [`RecurrentRows`]: the batched layout of gated DeltaNet state. Every row's convolution tail
//! and recurrent state sit in one batch buffer (`[B, K − 1, conv_dim]` and `[B, Hv, Dv, Dk]`),
//! so one recurrence serves every row, and each row keeps its own offset. Rows join
//! ([`RecurrentRows::merge_rows`]) from serial caches, leave as serial caches
//! ([`RecurrentRows::extract_row`]) or are dropped ([`RecurrentRows::filter_rows`]); a prefill
//! cohort appends right-justified behind each row's left padding; a speculative round keeps
//! its own count per row. Whatever the other rows do, an extracted row holds bit for bit what
//! the same appends to it alone would hold: the state is the same size at every length, so
//! rows need no padding once they hold state, and a row's keep is resolved by replaying only
//! that row.

use mlx::{Array, ops};

use super::gated_delta::batch_row;
use super::{
    BatchRows, Cache, CacheState, DeltaShape, GatedDeltaCache, GatedDeltaLayer, Keep,
    RecurrentCache, round_error,
};
use crate::error::{Error, Result};

/// Rows of gated DeltaNet state in one batch. See the module docs.
#[derive(Debug)]
pub struct RecurrentRows {
    /// The batch buffer (its own offset counts the batch's appended positions).
    batch: RecurrentCache,
    /// Each row's own offset.
    offsets: Vec<usize>,
    /// Each row's offset when the armed round began.
    round: Option<Vec<usize>>,
}

impl RecurrentRows {
    /// An empty batch of layers of `shape`.
    pub fn new(shape: DeltaShape) -> RecurrentRows {
        RecurrentRows { batch: RecurrentCache::new(shape), offsets: Vec::new(), round: None }
    }

    /// Rows in the batch.
    pub fn batch_size(&self) -> usize {
        self.offsets.len()
    }

    /// Each row's offset.
    pub fn row_offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Bytes the batch's state takes in total (`dtype_bytes` per convolution value): the same
    /// at every length.
    pub fn projected_bytes(&self, dtype_bytes: usize) -> usize {
        self.batch_size() * self.batch.shape().state_bytes(dtype_bytes)
    }

    fn outside_round(&self, what: &str) -> Result<()> {
        if self.round.is_some() || self.batch.in_round() {
            return Err(round_error(&format!("no {what} inside a round")));
        }
        Ok(())
    }

    /// Appends the rows of each serial cache (one row each, or a batch of rows at one offset)
    /// after the existing ones. Each must have the batch's geometry; an empty cache joins as a
    /// row of zeros at offset 0.
    pub fn merge_rows(&mut self, rows: Vec<RecurrentCache>) -> Result<()> {
        self.outside_round("merge rows")?;
        let shape = self.batch.shape();
        if let Some(other) = rows.iter().find(|r| r.shape() != shape) {
            return Err(Error::InvalidRequest(format!(
                "a gated DeltaNet row of {:?} joins a batch of {shape:?}",
                other.shape()
            )));
        }
        if rows.is_empty() {
            return Ok(());
        }
        // The tail's dtype: the batch's, else the first joining row's with state.
        let dtype = self
            .batch
            .buffers()
            .into_iter()
            .chain(rows.iter().flat_map(|r| r.buffers()))
            .next()
            .map_or(mlx::Dtype::Float32, |c| c.dtype());
        let mut convs = Vec::new();
        let mut states = Vec::new();
        if self.batch_size() > 0 {
            let (conv, state) = self.batch.parts_or_zeros(self.batch_size() as i32, dtype)?;
            convs.push(conv);
            states.push(state);
        }
        let mut offsets = self.offsets.clone();
        for row in &rows {
            let n = row.rows().unwrap_or(1);
            let (conv, state) = row.parts_or_zeros(n, dtype)?;
            convs.push(conv);
            states.push(state);
            offsets.extend(std::iter::repeat_n(row.offset(), n as usize));
        }
        let conv = ops::concatenate(&convs.iter().collect::<Vec<_>>(), 0)?;
        let state = ops::concatenate(&states.iter().collect::<Vec<_>>(), 0)?;
        let batch_offset = offsets.iter().copied().max().unwrap_or(0);
        self.batch = RecurrentCache::from_parts(shape, Some((conv, state)), batch_offset);
        self.offsets = offsets;
        Ok(())
    }

    /// Removes row `row` and returns it as a serial cache at its own offset.
    pub fn extract_row(&mut self, row: usize) -> Result<RecurrentCache> {
        self.outside_round("extract a row")?;
        if row >= self.batch_size() {
            return Err(Error::InvalidRequest(format!(
                "row {row} of a batch of {}",
                self.batch_size()
            )));
        }
        let shape = self.batch.shape();
        let (conv, state) =
            self.batch.parts_or_zeros(self.batch_size() as i32, mlx::Dtype::Float32)?;
        let r = row as i32;
        let extracted = RecurrentCache::from_parts(
            shape,
            Some((batch_row(&conv, r)?.contiguous()?, batch_row(&state, r)?.contiguous()?)),
            self.offsets[row],
        );
        let rest: Vec<usize> = (0..self.batch_size()).filter(|&i| i != row).collect();
        self.filter_rows(&rest)?;
        Ok(extracted)
    }

    /// Keeps only the rows listed, in the order listed (each once).
    pub fn filter_rows(&mut self, keep: &[usize]) -> Result<()> {
        self.outside_round("filter rows")?;
        let mut seen = vec![false; self.batch_size()];
        for &row in keep {
            if row >= seen.len() || std::mem::replace(&mut seen[row], true) {
                return Err(Error::InvalidRequest(format!(
                    "rows {keep:?} of a batch of {}",
                    self.batch_size()
                )));
            }
        }
        let shape = self.batch.shape();
        let offsets: Vec<usize> = keep.iter().map(|&r| self.offsets[r]).collect();
        let parts = if keep.is_empty() {
            None
        } else {
            let (conv, state) =
                self.batch.parts_or_zeros(self.batch_size() as i32, mlx::Dtype::Float32)?;
            let index = crate::uploads::ints(
                &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
                &[keep.len() as i32],
            )?;
            Some((conv.take(&index, 0)?, state.take(&index, 0)?))
        };
        let batch_offset = offsets.iter().copied().max().unwrap_or(0);
        self.batch = RecurrentCache::from_parts(shape, parts, batch_offset);
        self.offsets = offsets;
        Ok(())
    }

    fn check_rows(&self, qkv: &Array) -> Result<()> {
        let rows = qkv.dim(0)? as usize;
        if rows != self.batch_size() || rows == 0 {
            return Err(Error::InvalidRequest(format!(
                "an append of {rows} rows to a batch of {}",
                self.batch_size()
            )));
        }
        Ok(())
    }

    /// One new position for every row.
    pub fn recur_decode(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        self.check_rows(qkv)?;
        let y = self.batch.recur_decode(qkv, a, b, layer)?;
        self.offsets.iter_mut().for_each(|o| *o += 1);
        Ok(y)
    }

    /// `S` new positions for every row (a verify window).
    pub fn recur_window(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        self.check_rows(qkv)?;
        let y = self.batch.recur_window(qkv, a, b, layer)?;
        let s = qkv.dim(1)? as usize;
        self.offsets.iter_mut().for_each(|o| *o += s);
        Ok(y)
    }

    /// `S` positions per row, row `r` right-justified behind `left_pad[r]` padded ones (a
    /// prefill cohort): padded positions change neither state, and each row's offset advances
    /// by its real positions. Outside a round.
    pub fn recur_window_padded(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        left_pad: &[usize],
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        self.check_rows(qkv)?;
        let y = self.batch.recur_window_padded(qkv, a, b, left_pad, layer)?;
        let s = qkv.dim(1)? as usize;
        for (o, &pad) in self.offsets.iter_mut().zip(left_pad) {
            *o += s - pad;
        }
        Ok(y)
    }

    /// Arms a round over every row.
    pub fn spec_round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(round_error("a round is already armed"));
        }
        self.batch.spec_round_begin()?;
        self.round = Some(self.offsets.clone());
        Ok(())
    }

    /// Keeps every position the round appended.
    pub fn spec_round_commit(&mut self) -> Result<()> {
        self.round.take().ok_or_else(|| round_error("commit without a round"))?;
        self.batch.spec_round_commit()
    }

    /// Keeps the first `keep` positions the round appended to each row (one count for every
    /// row, or one per row); each row is then as if only those had been appended to it.
    pub fn spec_round_rollback(&mut self, keep: Keep<'_>) -> Result<()> {
        let Some(begun) = self.round.clone() else {
            return Err(round_error("rollback without a round"));
        };
        let keeps = match keep {
            Keep::All(n) => vec![n; self.batch_size()],
            Keep::Each(counts) => counts.to_vec(),
        };
        self.batch.spec_round_rollback_rows(&keeps)?;
        self.round = None;
        for ((o, start), k) in self.offsets.iter_mut().zip(begun).zip(keeps) {
            *o = start + k;
        }
        Ok(())
    }
}

impl BatchRows for RecurrentRows {
    fn batch_size(&self) -> usize {
        RecurrentRows::batch_size(self)
    }

    fn merge_row(&mut self, mut row: Box<dyn Cache>) -> Result<()> {
        let signature = row.signature();
        let row = row.take_recurrent().ok_or_else(|| {
            Error::InvalidRequest(format!("a batch of gated DeltaNet rows cannot take {signature}"))
        })?;
        self.merge_rows(vec![row])
    }

    fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>> {
        Ok(Box::new(RecurrentRows::extract_row(self, row)?))
    }

    fn rollback_rows(&mut self, keep: &[usize]) -> Result<()> {
        self.spec_round_rollback(Keep::Each(keep))
    }
}

/// A batch is one layer's state in a batched forward pass: one recurrence serves every row,
/// each at its own offset ([`Cache::row_offsets`]). Persistence and trims are refused: a row
/// leaves the batch ([`RecurrentRows::extract_row`]) to be saved.
impl Cache for RecurrentRows {
    /// The longest row's offset.
    fn offset(&self) -> usize {
        self.offsets.iter().copied().max().unwrap_or(0)
    }

    fn signature(&self) -> String {
        format!("rows({})", self.batch.signature())
    }

    fn bytes_per_token(&self) -> usize {
        0
    }

    fn stored_positions(&self) -> usize {
        0
    }

    fn buffers(&self) -> Vec<Array> {
        self.batch.buffers()
    }

    fn row_offsets(&self) -> Option<Vec<usize>> {
        Some(self.offsets.clone())
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        RecurrentRows::spec_round_begin(self)
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        RecurrentRows::spec_round_commit(self)
    }

    /// The same count for every row ([`RecurrentRows::spec_round_rollback`] takes one per row).
    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        RecurrentRows::spec_round_rollback(self, Keep::All(keep))
    }

    fn as_gated_delta_mut(&mut self) -> Option<&mut dyn GatedDeltaCache> {
        Some(self)
    }

    super::rows_cache_methods!();
}

impl GatedDeltaCache for RecurrentRows {
    fn recur_decode(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        RecurrentRows::recur_decode(self, qkv, a, b, layer)
    }

    fn recur_window(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        RecurrentRows::recur_window(self, qkv, a, b, layer)
    }

    fn recur_window_padded(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        left_pad: &[usize],
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        RecurrentRows::recur_window_padded(self, qkv, a, b, left_pad, layer)
    }
}
