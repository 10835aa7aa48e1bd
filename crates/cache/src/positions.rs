//! [`PositionCache`]: where a multimodal-RoPE model's text positions stand relative to its
//! token offsets.
//!
//! Qwen3.5 gives an image's soft tokens positions on its grid (time, row, column), so an image
//! of `r × c` soft tokens spans `max(r, c)` positions, not `r · c`, and the text after it
//! continues from there: its rope position is its offset plus a shift (mlx-vlm's `rope_deltas`,
//! negative after an image). That shift belongs to the sequence, like the keys its attention
//! layers store, so it lives in the stack beside them: it is saved in checkpoints, trimmed with
//! the offset (a trim back before an image restores the shift before it) and rolled back with
//! speculative rounds.

use mlx::Array;

use super::{BatchRows, Cache, CacheState, check_signature, round_error};
use crate::error::{Error, Result};

/// A sequence's rope shift: from each offset in `changes` on, positions are the offset plus
/// that change's shift (0 before the first).
#[derive(Debug, Default)]
pub struct PositionCache {
    offset: usize,
    /// `(offset, shift)`: from `offset` on, the shift is `shift`. Offsets increase.
    changes: Vec<(usize, i64)>,
    /// The offset a speculative round began at.
    round: Option<usize>,
}

impl PositionCache {
    /// An empty sequence (shift 0).
    pub fn new() -> PositionCache {
        PositionCache::default()
    }

    /// The shift of the next appended position: its rope position minus its offset.
    pub fn shift(&self) -> i64 {
        self.changes.last().map_or(0, |&(_, s)| s)
    }

    /// The rope position of the next appended position.
    pub fn next_position(&self) -> i64 {
        self.offset as i64 + self.shift()
    }

    /// Records `n` appended positions that leave the shift as it is (text).
    pub fn advance(&mut self, n: usize) {
        self.offset += n;
    }

    /// Records `n` appended positions after which the next position is `next_position` (a
    /// window holding an image).
    pub fn advance_to(&mut self, n: usize, next_position: i64) {
        self.offset += n;
        let shift = next_position - self.offset as i64;
        if shift != self.shift() {
            self.changes.push((self.offset, shift));
        }
    }
}

impl Cache for PositionCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn signature(&self) -> String {
        "rope_positions".into()
    }

    fn bytes_per_token(&self) -> usize {
        0
    }

    fn stored_positions(&self) -> usize {
        0
    }

    fn buffers(&self) -> Vec<Array> {
        Vec::new()
    }

    fn state(&self) -> Result<CacheState> {
        let mut state = CacheState::default();
        state.metadata.insert("signature".into(), self.signature());
        state.metadata.insert("offset".into(), self.offset.to_string());
        let changes: Vec<String> = self.changes.iter().map(|(o, s)| format!("{o}:{s}")).collect();
        state.metadata.insert("shifts".into(), changes.join(","));
        Ok(state)
    }

    fn restore(&mut self, state: &CacheState) -> Result<()> {
        if self.round.is_some() {
            return Err(round_error("no restore inside a round"));
        }
        check_signature(state, &self.signature())?;
        let offset = state.number("offset")?;
        let bad = |entry: &str| Error::InvalidRequest(format!("rope shift entry `{entry}`"));
        let mut changes = Vec::new();
        for entry in state.metadata.get("shifts").map_or("", String::as_str).split(',') {
            if entry.is_empty() {
                continue;
            }
            let (at, shift) = entry.split_once(':').ok_or_else(|| bad(entry))?;
            let at: usize = at.parse().map_err(|_| bad(entry))?;
            let shift: i64 = shift.parse().map_err(|_| bad(entry))?;
            if at > offset || changes.last().is_some_and(|&(last, _)| last >= at) {
                return Err(bad(entry));
            }
            changes.push((at, shift));
        }
        self.offset = offset;
        self.changes = changes;
        Ok(())
    }

    fn as_positions_mut(&mut self) -> Option<&mut PositionCache> {
        Some(self)
    }

    fn empty_rows(&self, _layout: super::RowLayout) -> Option<Box<dyn Cache>> {
        Some(Box::new(PositionRows::default()))
    }

    fn take_positions(&mut self) -> Option<PositionCache> {
        Some(std::mem::take(self))
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    fn trim(&mut self, n: usize) -> Result<usize> {
        if self.round.is_some() {
            return Err(round_error("no trim inside a round"));
        }
        let n = n.min(self.offset);
        self.offset -= n;
        // A change after the new offset was made by a window that is now (partly) gone.
        while self.changes.last().is_some_and(|&(at, _)| at > self.offset) {
            self.changes.pop();
        }
        Ok(n)
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(round_error("a round is already armed"));
        }
        self.round = Some(self.offset);
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        self.round.take().ok_or_else(|| round_error("commit without a round"))?;
        Ok(())
    }

    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        let start = self.round.ok_or_else(|| round_error("rollback without a round"))?;
        let appended = self.offset - start;
        if keep > appended {
            return Err(round_error(&format!(
                "cannot keep {keep} of the {appended} positions appended"
            )));
        }
        self.round = None;
        self.offset = start + keep;
        while self.changes.last().is_some_and(|&(at, _)| at > self.offset) {
            self.changes.pop();
        }
        Ok(())
    }
}

/// The position shifts of a batch's rows, each row's its own [`PositionCache`]: a batched pass
/// rotates row `r` from [`PositionRows::next_positions`]`[r]`. Batched passes append text
/// (a row's images are prefilled before it joins), so an append advances every row alike; a
/// speculative round is each row's own, resolved with one keep count per row.
#[derive(Debug, Default)]
pub struct PositionRows {
    rows: Vec<PositionCache>,
    /// Whether a round is armed.
    round: bool,
}

impl PositionRows {
    /// Each row's next rope position.
    pub fn next_positions(&self) -> Vec<i64> {
        self.rows.iter().map(PositionCache::next_position).collect()
    }

    /// Records `n` text positions appended to every row.
    pub fn advance(&mut self, n: usize) {
        self.rows.iter_mut().for_each(|r| r.advance(n));
    }
}

impl BatchRows for PositionRows {
    fn batch_size(&self) -> usize {
        self.rows.len()
    }

    fn merge_row(&mut self, mut row: Box<dyn Cache>) -> Result<()> {
        if self.round {
            return Err(round_error("rows join outside a round"));
        }
        let signature = row.signature();
        let row = row.take_positions().ok_or_else(|| {
            Error::InvalidRequest(format!("a batch of rope positions cannot take {signature}"))
        })?;
        if row.round.is_some() {
            return Err(round_error("a row joins outside a round"));
        }
        self.rows.push(row);
        Ok(())
    }

    fn extract_row(&mut self, row: usize) -> Result<Box<dyn Cache>> {
        if self.round {
            return Err(round_error("rows leave outside a round"));
        }
        if row >= self.rows.len() {
            return Err(Error::InvalidRequest(format!(
                "row {row} of a batch of {}",
                self.rows.len()
            )));
        }
        Ok(Box::new(self.rows.remove(row)))
    }

    fn rollback_rows(&mut self, keep: &[usize]) -> Result<()> {
        if !self.round {
            return Err(round_error("rollback without a round"));
        }
        if keep.len() != self.rows.len() {
            return Err(round_error(&format!(
                "{} keep counts for {} rows",
                keep.len(),
                self.rows.len()
            )));
        }
        if let Some((row, _)) =
            self.rows.iter().zip(keep).find(|(r, k)| r.round.is_some_and(|s| r.offset - s < **k))
        {
            return Err(round_error(&format!(
                "a row cannot keep more than it appended ({} positions)",
                row.offset - row.round.unwrap_or(row.offset)
            )));
        }
        for (row, &k) in self.rows.iter_mut().zip(keep) {
            row.spec_round_rollback(k)?;
        }
        self.round = false;
        Ok(())
    }
}

/// Whole-batch persistence, trims and rounds are refused: a row leaves the batch for them.
impl Cache for PositionRows {
    fn offset(&self) -> usize {
        self.rows.iter().map(Cache::offset).max().unwrap_or(0)
    }

    fn signature(&self) -> String {
        "rows(rope_positions)".into()
    }

    fn bytes_per_token(&self) -> usize {
        0
    }

    fn stored_positions(&self) -> usize {
        0
    }

    fn buffers(&self) -> Vec<Array> {
        Vec::new()
    }

    fn row_offsets(&self) -> Option<Vec<usize>> {
        Some(self.rows.iter().map(Cache::offset).collect())
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.round {
            return Err(round_error("a round is already armed"));
        }
        for row in &mut self.rows {
            row.spec_round_begin()?;
        }
        self.round = true;
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        if !self.round {
            return Err(round_error("commit without a round"));
        }
        for row in &mut self.rows {
            row.spec_round_commit()?;
        }
        self.round = false;
        Ok(())
    }

    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        self.rollback_rows(&vec![keep; self.rows.len()])
    }

    fn as_position_rows_mut(&mut self) -> Option<&mut PositionRows> {
        Some(self)
    }

    super::rows_cache_methods!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_shifts_what_follows_and_a_trim_before_it_undoes_the_shift() {
        let mut p = PositionCache::new();
        p.advance(9);
        assert_eq!(p.next_position(), 9);
        // A window of 56 positions holding a 6×9 image block (54 soft tokens between its
        // markers) spans positions 9 to 19: the text after it continues at 20.
        p.advance_to(56, 20);
        assert_eq!((p.offset(), p.shift(), p.next_position()), (65, -45, 20));
        p.advance(5);
        assert_eq!(p.next_position(), 25);
        let saved = p.state().unwrap();
        p.trim(5).unwrap();
        assert_eq!(p.next_position(), 20, "a trim within the text keeps the shift");
        p.trim(10).unwrap();
        assert_eq!((p.offset(), p.shift()), (55, 0), "a trim into the image drops its shift");
        let mut q = PositionCache::new();
        q.restore(&saved).unwrap();
        assert_eq!((q.offset(), q.next_position()), (70, 25));
    }

    #[test]
    fn rows_roll_back_each_its_own_count() {
        let mut rows = PositionRows::default();
        for (text, image_end) in [(3, 7), (5, 2)] {
            let mut p = PositionCache::new();
            p.advance_to(text, image_end);
            rows.merge_row(Box::new(p)).unwrap();
        }
        rows.spec_round_begin().unwrap();
        rows.advance(3);
        assert!(rows.merge_row(Box::new(PositionCache::new())).is_err(), "no join in a round");
        assert!(rows.rollback_rows(&[1, 4]).is_err(), "a row keeps at most what it appended");
        rows.rollback_rows(&[1, 3]).unwrap();
        assert_eq!(rows.row_offsets(), Some(vec![4, 8]));
        assert_eq!(rows.next_positions(), vec![8, 5]);
        assert!(rows.rollback_rows(&[0, 0]).is_err(), "no round armed");
    }

    #[test]
    fn a_rolled_back_round_keeps_the_shift_of_its_kept_positions() {
        let mut p = PositionCache::new();
        p.advance_to(10, 4);
        p.spec_round_begin().unwrap();
        p.advance(4);
        p.spec_round_rollback(1).unwrap();
        assert_eq!((p.offset(), p.next_position()), (11, 5));
        assert!(p.spec_round_rollback(0).is_err(), "no round armed");
    }
}
