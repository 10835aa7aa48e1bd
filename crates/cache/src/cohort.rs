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
//! Gated DeltaNet state pads too ([`RecurrentCache`]'s cohort window): a padded position
//! neither decays nor updates the state, and each row's convolution tail ends at its own last
//! position, so each row leaves with the state its own positions leave. Other state (a
//! multimodal model's position shifts) does not take part: its rows prefill alone.

use std::cell::RefCell;
use std::rc::Rc;

use mlx::Array;

use super::{
    AttentionCache, AttentionRead, Cache, CacheState, GatedDeltaCache, GatedDeltaLayer,
    RecurrentCache, check_append,
};
use crate::error::{Error, Result};

/// What one layer's window left for [`Cohort::finalize`].
#[derive(Debug)]
enum Left {
    /// An attention layer's `[B, H, T, D]` keys and values.
    Window(Array, Array),
    /// A recurrent layer's rows, each its own cache after its positions.
    Rows(Vec<RecurrentCache>),
}

type Slot = Rc<RefCell<Option<Left>>>;

/// The cohort's layers for one batched prefill window. See the module docs.
#[derive(Debug)]
pub struct Cohort {
    layers: Vec<Box<dyn Cache>>,
    left: Vec<Slot>,
    lengths: Rc<[usize]>,
}

impl Cohort {
    /// Stands `fresh` (one empty storage per layer, what each row's own would be) in for the
    /// rows of a cohort, row `b` holding its first `lengths[b]` positions of the window.
    /// Refused for state that neither attention nor gated DeltaNet, or that holds positions
    /// already.
    pub fn prepare(fresh: Vec<Box<dyn Cache>>, lengths: &[usize]) -> Result<Cohort> {
        let lengths: Rc<[usize]> = lengths.into();
        let mut layers = Vec::with_capacity(fresh.len());
        let mut left = Vec::with_capacity(fresh.len());
        for mut cache in fresh {
            let signature = cache.signature();
            let shifts = cache.as_positions_mut().is_some();
            let stand = if shifts || cache.offset() > 0 {
                None
            } else if cache.as_attention().is_some() {
                Some(Stand::Attention(cache))
            } else {
                cache.take_recurrent().map(Stand::Recurrent)
            };
            let Some(stand) = stand else {
                return Err(Error::InvalidRequest(format!(
                    "a {signature} cache does not prefill in a padded cohort (fresh attention \
                     and gated DeltaNet state do)"
                )));
            };
            let slot = Slot::default();
            left.push(Rc::clone(&slot));
            let lengths = Rc::clone(&lengths);
            layers.push(Box::new(CohortCache { stand, lengths, left: slot }) as Box<dyn Cache>);
        }
        Ok(Cohort { layers, left, lengths })
    }

    /// The layers the model appends the cohort's window to.
    pub fn layers(&mut self) -> &mut [Box<dyn Cache>] {
        &mut self.layers
    }

    /// Fills `rows` (row `b`: one fresh storage per layer, of the storages given to
    /// [`Cohort::prepare`]) with each row's first `lengths[b]` positions of the window, as
    /// appending them alone fills them. A row of length 0 stays empty.
    pub fn finalize(self, rows: &mut [Vec<Box<dyn Cache>>]) -> Result<()> {
        let lengths = &self.lengths;
        if rows.len() != lengths.len() {
            return Err(Error::InvalidRequest(format!(
                "{} rows with {} lengths",
                rows.len(),
                lengths.len()
            )));
        }
        drop(self.layers);
        for (layer, slot) in self.left.iter().enumerate() {
            let (keys, values) = match slot.borrow_mut().take() {
                Some(Left::Window(keys, values)) => (keys, values),
                Some(Left::Rows(own)) => {
                    for (b, cache) in own.into_iter().enumerate() {
                        let row = rows[b].get_mut(layer).ok_or_else(|| {
                            Error::InvalidRequest(format!("row {b} has no cache for layer {layer}"))
                        })?;
                        if row.signature() != cache.signature() {
                            return Err(Error::InvalidRequest(format!(
                                "row {b}'s layer {layer} is {}, not {}",
                                row.signature(),
                                cache.signature()
                            )));
                        }
                        *row = Box::new(cache);
                    }
                    continue;
                }
                None => {
                    return Err(Error::InvalidRequest(format!(
                        "layer {layer} of the cohort appended no window"
                    )));
                }
            };
            for (b, (caches, &length)) in rows.iter_mut().zip(lengths.iter()).enumerate() {
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

/// A layer's fresh storage standing in for every row of a cohort, keeping what the window
/// left for [`Cohort::finalize`].
#[derive(Debug)]
struct CohortCache {
    stand: Stand,
    lengths: Rc<[usize]>,
    left: Slot,
}

#[derive(Debug)]
enum Stand {
    Attention(Box<dyn Cache>),
    Recurrent(RecurrentCache),
}

impl CohortCache {
    fn inner(&self) -> &dyn Cache {
        match &self.stand {
            Stand::Attention(cache) => cache.as_ref(),
            Stand::Recurrent(cache) => cache,
        }
    }

    /// Keeps what the window left; a second window is refused.
    fn keep(&self, left: Left) -> Result<()> {
        let mut slot = self.left.borrow_mut();
        if slot.is_some() {
            return Err(one_window());
        }
        *slot = Some(left);
        Ok(())
    }
}

fn one_window() -> Error {
    Error::InvalidRequest("a prefill cohort appends one window, then its rows go their ways".into())
}

impl Cache for CohortCache {
    fn offset(&self) -> usize {
        self.inner().offset()
    }
    fn signature(&self) -> String {
        format!("cohort({})", self.inner().signature())
    }
    fn bytes_per_token(&self) -> usize {
        self.inner().bytes_per_token()
    }
    fn stored_positions(&self) -> usize {
        self.inner().stored_positions()
    }
    fn max_append(&self) -> Option<usize> {
        self.inner().max_append()
    }
    fn buffers(&self) -> Vec<Array> {
        self.inner().buffers()
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
        matches!(self.stand, Stand::Attention(_)).then_some(self as &dyn AttentionCache)
    }
    fn as_attention_mut(&mut self) -> Option<&mut dyn AttentionCache> {
        match self.stand {
            Stand::Attention(_) => Some(self),
            Stand::Recurrent(_) => None,
        }
    }
    fn as_gated_delta_mut(&mut self) -> Option<&mut dyn GatedDeltaCache> {
        match self.stand {
            Stand::Recurrent(_) => Some(self),
            Stand::Attention(_) => None,
        }
    }
    /// A cohort does not batch: its rows do, once finalized.
    fn empty_rows(&self, _layout: super::RowLayout) -> Option<Box<dyn Cache>> {
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
        self.keep(Left::Window(keys.clone(), values.clone()))?;
        match &mut self.stand {
            Stand::Attention(cache) => {
                super::attention_of(cache.as_mut())?.append_window(keys, values)
            }
            Stand::Recurrent(_) => Err(one_window()),
        }
    }

    /// What the window's layer lends the layers that share its keys and values.
    fn donor_read(&self) -> Result<Option<AttentionRead>> {
        self.inner().as_attention().map_or(Ok(None), |a| a.donor_read())
    }
}

impl GatedDeltaCache for CohortCache {
    fn recur_decode(
        &mut self,
        _: &Array,
        _: &Array,
        _: &Array,
        _: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        Err(one_window())
    }

    /// The cohort's window, each row padded on the right after its own positions.
    fn recur_window(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        let Stand::Recurrent(cache) = &self.stand else {
            return Err(one_window());
        };
        let (y, rows) = cache.cohort_window(qkv, a, b, &self.lengths, layer)?;
        self.keep(Left::Rows(rows))?;
        Ok(y)
    }

    fn recur_window_padded(
        &mut self,
        _: &Array,
        _: &Array,
        _: &Array,
        _: &[usize],
        _: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        Err(one_window())
    }
}
