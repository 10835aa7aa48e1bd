//! A padded prefill cohort: fresh requests that arrive together prefill their prompts in one
//! batched window, padded on the right, and come out as the single-sequence caches their own
//! prefill would leave (the seed's `PaddedPrefillCache`: `preparePrefill`, `finalizePrefill`).
//!
//! [`Cohort::prepare`] stands a layer's fresh storage in for every row: the window `[B, H, T,
//! D]` appends through it, so each row's queries read positions `0..T` of its own row under the
//! storage's own mask (causal, and its sliding window if it has one). A row's query at
//! position `i` reads only positions up to `i`, all its own, so the padding after a row's last
//! position is read only by the padding's own queries, whose outputs nobody reads.
//! [`Cohort::finalize`] then appends each row's own first positions' keys and values to a
//! fresh storage of its own: what appending its prompt alone stores (an encoded storage
//! encodes them as it would alone), whatever the storage did with the padded window.
//!
//! Only attention state pads this way: a recurrence would carry the padding into its state.

use std::cell::RefCell;
use std::rc::Rc;

use mlx::Array;

use super::{AttentionCache, AttentionRead, Cache, CacheState, check_append};
use crate::error::{Error, Result};

/// What one layer's window appended: `[B, H, T, D]` keys and values.
type Window = Rc<RefCell<Option<(Array, Array)>>>;

/// The cohort's layers for one batched prefill window. See the module docs.
#[derive(Debug)]
pub struct Cohort {
    layers: Vec<Box<dyn Cache>>,
    windows: Vec<Window>,
}

impl Cohort {
    /// Stands `fresh` (one empty storage per layer, what each row's own would be) in for every
    /// row of the cohort. Refused for state that is not attention (a recurrence) or that holds
    /// positions already.
    pub fn prepare(fresh: Vec<Box<dyn Cache>>) -> Result<Cohort> {
        if let Some(other) = fresh.iter().find(|c| c.as_attention().is_none() || c.offset() > 0) {
            return Err(Error::InvalidRequest(format!(
                "a {} cache does not prefill in a padded cohort (fresh attention state does)",
                other.signature()
            )));
        }
        let windows: Vec<Window> = fresh.iter().map(|_| Rc::default()).collect();
        let layers = fresh
            .into_iter()
            .zip(&windows)
            .map(|(inner, window)| {
                Box::new(CohortCache { inner, window: Rc::clone(window) }) as Box<dyn Cache>
            })
            .collect();
        Ok(Cohort { layers, windows })
    }

    /// The layers the model appends the cohort's window to.
    pub fn layers(&mut self) -> &mut [Box<dyn Cache>] {
        &mut self.layers
    }

    /// Fills `rows` (row `b`: one fresh storage per layer, of the storages given to
    /// [`Cohort::prepare`]) with each row's first `lengths[b]` positions of the window, as
    /// appending them alone fills them. A row of length 0 stays empty.
    pub fn finalize(self, rows: &mut [Vec<Box<dyn Cache>>], lengths: &[usize]) -> Result<()> {
        if rows.len() != lengths.len() {
            return Err(Error::InvalidRequest(format!(
                "{} rows with {} lengths",
                rows.len(),
                lengths.len()
            )));
        }
        drop(self.layers);
        for (layer, window) in self.windows.iter().enumerate() {
            let Some((keys, values)) = window.borrow_mut().take() else {
                return Err(Error::InvalidRequest(format!(
                    "layer {layer} of the cohort appended no window"
                )));
            };
            for (b, (caches, &length)) in rows.iter_mut().zip(lengths).enumerate() {
                if length == 0 {
                    continue;
                }
                let own = |x: &Array| -> Result<Array> {
                    let s = x.shape();
                    let b = b as i32;
                    Ok(x.slice(&[b, 0, 0, 0], &[b + 1, s[1], length as i32, s[3]], &[1; 4])?)
                };
                let cache = caches.get_mut(layer).ok_or_else(|| {
                    Error::InvalidRequest(format!("row {b} has no cache for layer {layer}"))
                })?;
                let cache = super::attention_of(cache.as_mut())?;
                // The read is never evaluated: only what the storage keeps is.
                cache.append_window(&own(&keys)?, &own(&values)?)?;
            }
        }
        Ok(())
    }
}

/// A layer's fresh storage standing in for every row of a cohort, keeping the window's keys
/// and values for [`Cohort::finalize`].
#[derive(Debug)]
struct CohortCache {
    inner: Box<dyn Cache>,
    window: Window,
}

fn one_window() -> Error {
    Error::InvalidRequest("a prefill cohort appends one window, then its rows go their ways".into())
}

impl Cache for CohortCache {
    fn offset(&self) -> usize {
        self.inner.offset()
    }
    fn signature(&self) -> String {
        format!("cohort({})", self.inner.signature())
    }
    fn bytes_per_token(&self) -> usize {
        self.inner.bytes_per_token()
    }
    fn stored_positions(&self) -> usize {
        self.inner.stored_positions()
    }
    fn max_append(&self) -> Option<usize> {
        self.inner.max_append()
    }
    fn buffers(&self) -> Vec<Array> {
        self.inner.buffers()
    }
    fn state(&self) -> Result<CacheState> {
        Err(one_window())
    }
    fn restore(&mut self, _: &CacheState) -> Result<()> {
        Err(one_window())
    }
    fn is_trimmable(&self) -> bool {
        false
    }
    fn trim(&mut self, _: usize) -> Result<usize> {
        Err(one_window())
    }
    fn spec_round_begin(&mut self) -> Result<()> {
        Err(one_window())
    }
    fn spec_round_commit(&mut self) -> Result<()> {
        Err(one_window())
    }
    fn spec_round_rollback(&mut self, _: usize) -> Result<()> {
        Err(one_window())
    }
    fn as_attention(&self) -> Option<&dyn AttentionCache> {
        Some(self)
    }
    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        Some(self)
    }
    /// A cohort does not batch: its rows do, once finalized.
    fn empty_rows(&self, _rounds: super::Rounds) -> Option<Box<dyn Cache>> {
        None
    }
}

impl AttentionCache for CohortCache {
    fn append_decode(&mut self, _: &Array, _: &Array) -> Result<AttentionRead> {
        Err(one_window())
    }

    /// The cohort's window, every row from position 0: read by the storage as it reads a
    /// first window.
    fn append_window(&mut self, keys: &Array, values: &Array) -> Result<AttentionRead> {
        check_append(keys, values, false)?;
        let mut window = self.window.borrow_mut();
        if window.is_some() {
            return Err(one_window());
        }
        *window = Some((keys.clone(), values.clone()));
        super::attention_of(self.inner.as_mut())?.append_window(keys, values)
    }

    /// What the window's layer lends the layers that share its keys and values.
    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        self.inner.as_attention().map_or(Ok(None), |a| a.donor_read())
    }
}
