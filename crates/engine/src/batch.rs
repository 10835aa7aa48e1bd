//! Continuous batching: several replies decoded together, one forward pass per step.
//!
//! A request joins a [`Batch`] after its own prefill ([`Batch::join`] runs it alone, with its
//! images and from whatever prefix its caches hold, such as a restored KV checkpoint), so a
//! long prompt never stalls the rows already decoding for more than its own prefill. From then
//! on every [`Batch::step`] appends each row's next token in one batched decode pass: each
//! layer's state is a batch of rows of its storage ([`crate::cache::BatchRows`], made by
//! [`crate::cache::Cache::empty_rows`]): full-precision keys and values in
//! [`crate::cache::SlotRows`], one buffer per part shared by every row, each row in the slots
//! its own storage would use (encoded keys and values in [`crate::cache::CacheRows`], each row
//! in its own storage); gated DeltaNet state in
//! [`crate::cache::RecurrentRows`], one recurrence for every row; a multimodal-RoPE model's
//! position shifts in [`crate::cache::PositionRows`]. The model rotates each row at its own
//! position ([`crate::cache::Cache::row_offsets`]). A lone row runs the model's compiled step instead, as a reply
//! outside a batch does. Steps are pipelined as [`crate::generate::generate`]'s are (a pass is
//! built on the tokens the last one sampled before they are read). Each row samples its own
//! logits with its own [`Sampler`] (seed, temperature, penalties), stops on its own stop
//! tokens and token budget, and leaves the batch when it ends or is cancelled
//! ([`Batch::cancel`]), taking its caches with it as ordinary single-sequence caches, ready
//! to checkpoint.
//!
//! What a row generates does not depend on the other rows: the engine's tests hold batched
//! greedy and seeded sampling to the same requests run alone, token for token, and a row's
//! caches when it leaves to the solo run's, bit for bit.

use std::time::Instant;

use mlx::Array;

use crate::cache::{BatchRows, Cache};
use crate::error::{Error, Result};
use crate::generate::{GenerateRequest, Generation, GenerationStats, StopReason};
use crate::models::{Model, Phase};
use crate::sampling::Sampler;

/// Identifies a request in a batch (the caller's choice, unique among the rows).
pub type RowId = u64;

/// What a step or a join reports.
#[derive(Debug)]
pub enum BatchEvent {
    /// Row `id` generated `token`.
    Token {
        /// The row.
        id: RowId,
        /// The token.
        token: u32,
    },
    /// Row `id` ended and left the batch.
    Finished(Finished),
}

/// A request that ended: what it generated and its caches. The caches hold its prompt and its
/// generated tokens but the last, or all of them when a pipelined pass appended the last
/// before it was read: what [`crate::generate::generate`] leaves in its caches.
#[derive(Debug)]
pub struct Finished {
    /// The row.
    pub id: RowId,
    /// The tokens, why it ended, its timings.
    pub generation: Generation,
    /// The row's caches, one per layer: ordinary single-sequence caches.
    pub caches: Vec<Box<dyn Cache>>,
}

/// One request decoding in the batch.
#[derive(Debug)]
struct Row {
    id: RowId,
    sampler: Sampler,
    stop_tokens: Vec<u32>,
    max_tokens: usize,
    /// The prompt and the generated ids (what penalties look at).
    history: Vec<u32>,
    tokens: Vec<u32>,
    stats: GenerationStats,
    /// When its first token came.
    first_at: Instant,
    /// The next token, sampled (lazily) by a pass that appended the last emitted one; `None`
    /// while the last emitted token is not appended yet.
    ahead: Option<Array>,
    /// Whether a pass may append the token sampled ahead before it is read (no penalty reads
    /// it first), as [`crate::generate::generate`] pipelines its steps.
    pipelined: bool,
}

impl Row {
    /// Whether the token sampled ahead may be appended before it is read: the row goes on
    /// after it (it is not the row's last allowed token), as `generate` decides.
    fn may_append_ahead(&self) -> bool {
        self.pipelined && self.tokens.len() + 1 < self.max_tokens
    }

    /// Records `token`; the reason when the row ends with it.
    fn emit(&mut self, token: u32) -> Option<StopReason> {
        self.tokens.push(token);
        self.history.push(token);
        if self.stop_tokens.contains(&token) {
            Some(StopReason::StopToken)
        } else if self.tokens.len() >= self.max_tokens {
            Some(StopReason::MaxTokens)
        } else {
            None
        }
    }

    fn finish(mut self, reason: StopReason, caches: Vec<Box<dyn Cache>>) -> Result<Finished> {
        self.stats.generated_tokens = self.tokens.len();
        let decode_secs = self.first_at.elapsed().as_secs_f64();
        if self.tokens.len() > 1 && decode_secs > 0.0 {
            self.stats.decode_tok_s = (self.tokens.len() - 1) as f64 / decode_secs;
        }
        self.stats.peak_mem_bytes = mlx::device::memory::peak()?;
        let generation = Generation { tokens: self.tokens, stop_reason: reason, stats: self.stats };
        Ok(Finished { id: self.id, generation, caches })
    }
}

/// Rows decoding together. See the module docs.
#[derive(Debug)]
pub struct Batch<'m> {
    model: &'m dyn Model,
    /// One batch of rows per cache layer (empty before the first row joins).
    layers: Vec<Box<dyn Cache>>,
    rows: Vec<Row>,
}

impl<'m> Batch<'m> {
    /// An empty batch over `model`.
    pub fn new(model: &'m dyn Model) -> Batch<'m> {
        Batch { model, layers: Vec::new(), rows: Vec::new() }
    }

    /// Rows decoding now.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no row is decoding.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows' ids, in row order.
    pub fn ids(&self) -> Vec<RowId> {
        self.rows.iter().map(|r| r.id).collect()
    }

    /// Row `id`'s tokens generated so far and its token budget.
    pub fn progress(&self, id: RowId) -> Option<(usize, usize)> {
        self.rows.iter().find(|r| r.id == id).map(|r| (r.tokens.len(), r.max_tokens))
    }

    /// Bytes the rows' caches hold now.
    pub fn kv_bytes(&self) -> u64 {
        self.layers.iter().flat_map(|l| l.buffers()).map(|b| b.nbytes() as u64).sum()
    }

    /// Prefills `request` alone on `caches` (fresh, or holding a prefix the prompt continues)
    /// and samples its first token. Returns that token's event and, when the request ended with
    /// it, its [`BatchEvent::Finished`]; otherwise the row joins the batch and decodes from the
    /// next [`Batch::step`]. A request the batch cannot take (a model whose layers keep state
    /// that does not batch, caches of another storage than the rows', a duplicate id)
    /// is refused before its prefill, and the batch is unchanged.
    pub fn join(
        &mut self,
        id: RowId,
        mut caches: Vec<Box<dyn Cache>>,
        request: &GenerateRequest,
    ) -> Result<Vec<BatchEvent>> {
        self.check_joins(id, &caches)?;
        let mut sampler = Sampler::new(request.sampling.clone())?;
        let (logits, start) = crate::generate::start(self.model, &mut caches, request)?;
        let first = match request.max_tokens {
            0 => None,
            _ => Some(sampler.sample(&logits, &request.prompt)?.item::<u32>()?),
        };
        let elapsed = start.elapsed().as_secs_f64();
        let mut row = Row {
            id,
            sampler,
            stop_tokens: request.stop_tokens.clone(),
            max_tokens: request.max_tokens,
            history: request.prompt.clone(),
            tokens: Vec::new(),
            stats: GenerationStats {
                prompt_tokens: request.prompt.len(),
                ttft_ms: elapsed * 1e3,
                prefill_tok_s: request.prompt.len() as f64 / elapsed,
                ..GenerationStats::default()
            },
            first_at: Instant::now(),
            ahead: None,
            pipelined: request.sampling.repetition_penalty == 1.0
                && request.sampling.presence_penalty == 0.0,
        };
        let Some(token) = first else {
            return Ok(vec![BatchEvent::Finished(row.finish(StopReason::MaxTokens, caches)?)]);
        };
        let mut events = vec![BatchEvent::Token { id, token }];
        if let Some(reason) = row.emit(token) {
            events.push(BatchEvent::Finished(row.finish(reason, caches)?));
            return Ok(events);
        }
        if self.layers.is_empty() {
            self.layers = caches
                .iter()
                .map(|c| c.empty_rows().ok_or_else(|| unbatched(c.as_ref())))
                .collect::<Result<_>>()?;
        }
        for (layer, cache) in self.layers.iter_mut().zip(caches) {
            rows_of(layer.as_mut())?.merge_row(cache)?;
        }
        self.rows.push(row);
        Ok(events)
    }

    /// One decode step for every row: one forward pass appends each row's next token and
    /// samples the one after it. Steps are pipelined as [`crate::generate::generate`]'s are:
    /// the pass is built on the tokens the previous pass sampled before they are read, and
    /// those tokens are read (and reported) while it runs. A row whose next token is its last,
    /// or whose penalties read it first, has every row read before the pass instead. Rows that
    /// end leave the batch ([`BatchEvent::Finished`]).
    pub fn step(&mut self) -> Result<Vec<BatchEvent>> {
        let mut events = Vec::with_capacity(2 * self.rows.len());
        if !self.rows.iter().all(|r| r.ahead.is_none() || r.may_append_ahead()) {
            self.read_ahead(&mut events)?;
        }
        if self.rows.is_empty() {
            return Ok(events);
        }
        let feeds = self
            .rows
            .iter()
            .map(|r| match &r.ahead {
                Some(ahead) => Ok(ahead.reshape(&[1, 1])?),
                None => Ok(Array::from_slice(&[r.tokens.last().copied().unwrap_or(0)], &[1, 1])?),
            })
            .collect::<Result<Vec<_>>>()?;
        let ids = match feeds.as_slice() {
            [one] => one.clone(),
            _ => mlx::ops::concatenate(&feeds.iter().collect::<Vec<_>>(), 0)?,
        };
        let batch = feeds.len() as i32;
        // A lone row decodes through the model's compiled step where it has one.
        let logits = match self.rows.len() {
            1 => self.model.forward_decode(&ids, &mut self.layers)?,
            _ => self.model.forward(&ids, &mut self.layers, Phase::Decode)?,
        };
        let vocab = logits.dim(-1)?;
        let logits = logits.reshape(&[batch, vocab])?;
        let mut sampled = Vec::with_capacity(self.rows.len());
        for (b, row) in self.rows.iter_mut().enumerate() {
            let b = b as i32;
            let own = logits.slice(&[b, 0], &[b + 1, vocab], &[1, 1])?;
            sampled.push(row.sampler.sample(&own, &row.history)?);
        }
        mlx::async_eval(&sampled.iter().collect::<Vec<_>>())?;
        // The tokens this pass appended unread are read now, while it runs.
        let mut ended = Vec::new();
        for (b, (row, next)) in self.rows.iter_mut().zip(sampled).enumerate() {
            if let Some(ahead) = row.ahead.replace(next) {
                let token = ahead.item::<u32>()?;
                events.push(BatchEvent::Token { id: row.id, token });
                if let Some(reason) = row.emit(token) {
                    ended.push((b, reason));
                }
            }
        }
        self.leave_all(&ended, &mut events)?;
        Ok(events)
    }

    /// Reads and reports every token sampled ahead; the rows that end with it leave, the
    /// others wait for a pass to append it.
    fn read_ahead(&mut self, events: &mut Vec<BatchEvent>) -> Result<()> {
        let mut ended = Vec::new();
        for (b, row) in self.rows.iter_mut().enumerate() {
            if let Some(ahead) = row.ahead.take() {
                let token = ahead.item::<u32>()?;
                events.push(BatchEvent::Token { id: row.id, token });
                if let Some(reason) = row.emit(token) {
                    ended.push((b, reason));
                }
            }
        }
        self.leave_all(&ended, events)
    }

    /// Takes the rows `ended` (in row order) out of the batch, reporting each.
    fn leave_all(
        &mut self,
        ended: &[(usize, StopReason)],
        events: &mut Vec<BatchEvent>,
    ) -> Result<()> {
        // Highest rows first, so the lower indices stay valid.
        for &(b, reason) in ended.iter().rev() {
            let finished = self.leave(b, reason)?;
            events.push(BatchEvent::Finished(finished));
        }
        Ok(())
    }

    /// Ends row `id` now (a user's stop, a stop string, a closed connection): it leaves the
    /// batch before the next step, with [`StopReason::Stopped`]. `None` when no row has the id.
    pub fn cancel(&mut self, id: RowId) -> Result<Option<Finished>> {
        match self.rows.iter().position(|r| r.id == id) {
            Some(b) => self.leave(b, StopReason::Stopped).map(Some),
            None => Ok(None),
        }
    }

    /// Takes row `b` out of the batch with its caches.
    fn leave(&mut self, b: usize, reason: StopReason) -> Result<Finished> {
        let caches = self
            .layers
            .iter_mut()
            .map(|layer| rows_of(layer.as_mut())?.extract_row(b))
            .collect::<Result<Vec<_>>>()?;
        let row = self.rows.remove(b);
        row.finish(reason, caches)
    }

    /// Refuses a row the batch cannot take, before anything runs.
    fn check_joins(&self, id: RowId, caches: &[Box<dyn Cache>]) -> Result<()> {
        if self.rows.iter().any(|r| r.id == id) {
            return Err(Error::InvalidRequest(format!("row {id} is already in the batch")));
        }
        if let Some(other) = caches.iter().find(|c| c.empty_rows().is_none()) {
            return Err(unbatched(other.as_ref()));
        }
        if self.layers.is_empty() || self.rows.is_empty() {
            return Ok(());
        }
        if caches.len() != self.layers.len() {
            return Err(Error::InvalidRequest(format!(
                "a row of {} caches joins a batch of {} layers",
                caches.len(),
                self.layers.len()
            )));
        }
        for (layer, cache) in self.layers.iter().zip(caches) {
            let wanted = layer.signature();
            if wanted != format!("rows({})", cache.signature()) {
                return Err(Error::InvalidRequest(format!(
                    "a row of {} cannot join a batch of {wanted}: one KV storage per batch",
                    cache.signature()
                )));
            }
        }
        Ok(())
    }
}

fn rows_of(layer: &mut dyn Cache) -> Result<&mut dyn BatchRows> {
    layer
        .as_batch_rows_mut()
        .ok_or_else(|| Error::InvalidRequest("a batch layer is not a batch of rows".into()))
}

fn unbatched(cache: &dyn Cache) -> Error {
    Error::InvalidRequest(format!(
        "this model keeps {} state, which does not batch: its replies run one at a time",
        cache.signature()
    ))
}
