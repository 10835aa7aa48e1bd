//! The one decode path: every reply is a row of a [`Batch`], decoded with the others one
//! forward pass per step; a reply alone is a batch of one ([`generate`], [`speculate`]).
//!
//! A request joins after its own prefill ([`Batch::join`] runs it alone, with its images and
//! from whatever prefix its caches hold, such as a restored KV checkpoint), so a long prompt
//! never stalls the rows already decoding for more than its own prefill. Requests that arrive
//! together and start fresh prefill as one padded cohort instead ([`Batch::join_together`],
//! [`crate::cache::Cohort`]). From then on every [`Batch::step`] appends each row's next token
//! in one batched pass: each layer's state is a batch of rows
//! ([`crate::cache::BatchRows`], made by [`crate::cache::Cache::empty_rows`]): full-precision
//! keys and values in [`crate::cache::SlotRows`], one buffer per part shared by every row, each
//! row in the slots its own storage would use, while every row keeps its keys and values in one
//! full-precision storage (drafting rows verify in those buffers too); else (encoded storage,
//! or rows of different storages: full precision beside 4-bit, TurboQuant, …) each row in its
//! own storage, in [`crate::cache::CacheRows`]; rows move between the two as they join and
//! leave. Both resolve a speculative round per row. Gated DeltaNet state sits in [`crate::cache::RecurrentRows`], one
//! recurrence for every row, and a multimodal-RoPE model's position shifts in
//! [`crate::cache::PositionRows`]. The model rotates each row at its own position
//! ([`crate::cache::Cache::row_offsets`]). A decode step runs the model's compiled step where
//! it has one: for a lone row, and for rows sharing buffers (a graph per row count). Steps
//! are pipelined: a pass is built on the tokens the last one sampled before they are read,
//! unless a row's penalties read them first or one drafts this step (a drafting row asks its
//! method first whether it expects to propose after the unread token,
//! [`DraftMethod::drafts_after_unread`], and a batch [`Batch::gating_rounds`] runs rounds only
//! while they pay). Each row samples its own
//! logits with its own [`Sampler`] (seed, temperature, penalties, output grammar), stops on
//! its own stop tokens and token budget, and leaves the batch when it ends or is cancelled
//! ([`Batch::cancel`]), taking its caches with it as ordinary single-sequence caches, ready
//! to checkpoint.
//!
//! Rows draft with methods of their own ([`Batch::join_drafting`]: prompt lookup, a draft
//! model, a drafter reading the target's own state: Gemma 4's assistant, Qwen3.5's MTP head,
//! each reading its row of the batch, [`Target`]); a step in which one drafts verifies every
//! row's drafts in one window pass, each row picking its tokens with its own sampler and
//! keeping its own count ([`crate::cache::BatchRows::rollback_rows`]), as mlx-vlm's rule makes
//! speculative output equal plain output (greedy, or sampled at the same seed: `speculative`
//! module docs).
//!
//! What a row generates does not depend on the other rows: the engine's tests hold batched
//! greedy and seeded sampling to the same requests run alone, token for token, and a row's
//! caches when it leaves to the solo run's, bit for bit.

use std::time::Instant;

use mlx::Array;

use crate::cache::{BatchRows, Cache, Cohort, RowLayout, stack_max_append, stack_offset};
use crate::generate::{Flow, GenerateRequest, Generation, GenerationStats, StopReason};
use crate::models::{Model, Phase, Rows, target_lacks};
use crate::sampling::Sampler;
use crate::speculative::{DraftLength, DraftMethod, MAX_BACKOFF, Pace, SpecStats, Target};
use crate::{Error, Result};

/// Identifies a request in a batch (the caller's choice, unique among the rows).
pub type RowId = u64;

/// What a step tells of each token as a row emits it ([`Batch::step_with`]); [`Flow::Stop`]
/// ends that row after it.
pub type OnToken<'a> = dyn FnMut(RowId, u32) -> Flow + 'a;

/// A request that arrives with others ([`Batch::join_together`]): its id, its caches and
/// the request, as [`Batch::join`] takes them.
pub type Arriving = (RowId, Vec<Box<dyn Cache>>, GenerateRequest);

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
/// before it was read: what a reply alone leaves in its caches ([`generate`]).
#[derive(Debug)]
pub struct Finished {
    /// The row.
    pub id: RowId,
    /// The tokens, why it ended, its timings.
    pub generation: Generation,
    /// The row's caches, one per layer: ordinary single-sequence caches.
    pub caches: Vec<Box<dyn Cache>>,
    /// Its drafts' counts, when it drafted ([`Batch::join_drafting`]).
    pub spec: Option<SpecStats>,
    /// The method it drafted with, holding its state of the conversation (a draft model's
    /// caches), ready to checkpoint ([`DraftMethod::checkpoint`]).
    pub drafter: Option<Box<dyn DraftMethod>>,
}

/// A row's draft method: its own (a fork), or lent for one generation ([`speculate`]).
#[derive(Debug)]
enum Method<'m> {
    Owned(Box<dyn DraftMethod>),
    Lent(&'m mut dyn DraftMethod),
}

impl Method<'_> {
    fn get(&mut self) -> &mut dyn DraftMethod {
        match self {
            Method::Owned(method) => method.as_mut(),
            Method::Lent(method) => *method,
        }
    }

    fn as_ref(&self) -> &dyn DraftMethod {
        match self {
            Method::Owned(method) => method.as_ref(),
            Method::Lent(method) => &**method,
        }
    }

    /// The method, when the row owns it (to checkpoint its state with the row's).
    fn into_owned(self) -> Option<Box<dyn DraftMethod>> {
        match self {
            Method::Owned(method) => Some(method),
            Method::Lent(_) => None,
        }
    }
}

/// A row that drafts with a method of its own and verifies its drafts with the other rows'.
#[derive(Debug)]
struct Drafting<'m> {
    method: Method<'m>,
    pace: Pace,
    /// The whole conversation as the method sees it: earlier turns, the prompt, the reply.
    context: Vec<u32>,
    stats: SpecStats,
    /// Whether the method reads the target's hidden rows ([`Target::hidden`]).
    reads_hidden: bool,
}

/// One request decoding in the batch.
#[derive(Debug)]
struct Row<'m> {
    id: RowId,
    sampler: Sampler,
    stop_tokens: Vec<u32>,
    max_tokens: usize,
    /// The prompt and the generated ids (what penalties look at).
    history: Vec<u32>,
    tokens: Vec<u32>,
    stats: GenerationStats,
    /// When its prefill began.
    started: Instant,
    /// When its first token came.
    first_at: Instant,
    /// The next token, sampled (lazily) by a pass that appended the last emitted one; `None`
    /// while the last emitted token is not appended yet.
    ahead: Option<Array>,
    drafting: Option<Drafting<'m>>,
    /// Its caches' storages, layer by layer, as it joined.
    storage: Vec<String>,
}

impl<'m> Row<'m> {
    /// Whether the token sampled ahead may be appended before it is read: no penalty reads it
    /// first, and the row goes on after it (it is not the row's last allowed token).
    fn may_append_ahead(&self) -> bool {
        !self.sampler.params().penalizes() && self.tokens.len() + 1 < self.max_tokens
    }

    /// Whether the row may draft this step: it drafts, is not decoding plainly for now, and,
    /// when its last token is still unread (sampled ahead by a pipelined step), its method
    /// expects to propose after it ([`DraftMethod::drafts_after_unread`]): otherwise the step
    /// appends that token unread, as a plain step does, instead of waiting for it.
    fn may_draft(&self) -> bool {
        let unread = self.ahead.is_some();
        self.drafting.as_ref().is_some_and(|d| {
            d.pace.backoff == 0 && (!unread || d.method.as_ref().drafts_after_unread(&d.context))
        })
    }

    /// A step in which the row decodes plainly: one fewer left before it drafts again.
    fn pass_plainly(&mut self) {
        if let Some(d) = &mut self.drafting {
            d.pace.backoff = d.pace.backoff.saturating_sub(1);
        }
    }

    /// Records `token`, tells `on_token` of it (unless it is a stop token, which ends the row
    /// whatever it answers); the reason when the row ends with it.
    fn emit(&mut self, token: u32, on_token: &mut OnToken<'_>) -> Option<StopReason> {
        if self.tokens.is_empty() {
            self.first_at = Instant::now();
            let secs = (self.first_at - self.started).as_secs_f64();
            self.stats.ttft_ms = secs * 1e3;
            self.stats.prefill_tok_s = self.stats.prompt_tokens as f64 / secs;
        }
        self.tokens.push(token);
        self.history.push(token);
        if let Some(drafting) = &mut self.drafting {
            drafting.context.push(token);
        }
        if self.stop_tokens.contains(&token) {
            Some(StopReason::StopToken)
        } else if on_token(self.id, token) == Flow::Stop {
            Some(StopReason::Stopped)
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
        let (spec, drafter) = match self.drafting {
            Some(d) => (Some(d.stats), d.method.into_owned()),
            None => (None, None),
        };
        Ok(Finished { id: self.id, generation, caches, spec, drafter })
    }

    /// This step's drafts: none for a row that does not draft or decodes plainly for now,
    /// else its method's, at most what the row's budget and `room` (positions the caches take
    /// before a KV conversion) leave after the bonus token.
    fn propose(&mut self, target: Target<'_>, room: usize) -> Result<Vec<u32>> {
        let remaining = self.max_tokens.saturating_sub(self.tokens.len());
        let Some(drafting) = &mut self.drafting else {
            return Ok(Vec::new());
        };
        if drafting.pace.backoff > 0 {
            drafting.pace.backoff -= 1;
            return Ok(Vec::new());
        }
        let most = remaining.saturating_sub(1).min(room).min(drafting.pace.k());
        if most == 0 {
            return Ok(Vec::new());
        }
        let mut drafts = drafting.method.get().propose(target, &drafting.context, most)?;
        drafts.truncate(most);
        Ok(drafts)
    }

    /// Adds one step's timings: the host time building and submitting its pass (`build` of
    /// it building the graph) and the time spent waiting for this row's token.
    fn add_step_times(&mut self, host_ms: f64, build_ms: f64) {
        self.stats.decode_host_ms += host_ms;
        self.stats.decode_build_ms += build_ms;
    }
}

/// Milliseconds since `start`.
fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// A request of a padded prefill cohort ([`Batch::join_together`]), checked.
struct Arrival {
    /// Its place among the requests that arrived together.
    index: usize,
    id: RowId,
    caches: Vec<Box<dyn Cache>>,
    request: GenerateRequest,
    sampler: Sampler,
}

/// Rows decoding together. See the module docs.
#[derive(Debug)]
pub struct Batch<'m> {
    model: &'m dyn Model,
    /// One batch of rows per cache layer (empty before the first row joins).
    layers: Vec<Box<dyn Cache>>,
    rows: Vec<Row<'m>>,
    /// The layout the layers keep their rows in: shared buffers while every row keeps its keys
    /// and values in one storage ([`RowLayout::Shared`], drafting rows too), else each row in
    /// its own storage ([`RowLayout::Separate`]). Rows move between them as they join and leave.
    layout: RowLayout,
    /// How a verify round reads the output head.
    verify_head: VerifyHead,
    /// Whether rounds run only while they pay ([`Batch::gating_rounds`]).
    gate: Option<RoundGate>,
    /// Where the last step's time went.
    last_step: StepTimes,
}

/// Decides whether a batch's next step may be a verify round, from what its rounds and its
/// plain steps have cost ([`Batch::gating_rounds`]): a round costs every row of the batch
/// (a window pass, and the wait for its picks before the next pass is built), so it pays only
/// when the tokens it emits a row beat the plain steps the same time would have decoded.
/// While rounds do not pay the rows decode plainly, for 2, 4, … up to [`MAX_BACKOFF`] steps
/// before a round is tried again.
#[derive(Debug, Clone, Default)]
struct RoundGate {
    /// Moving means: a plain step built on unread tokens after another plain step (what
    /// decoding costs a step: building its pass, then waiting for the pass before), a round
    /// (building its window, and waiting for it), and the tokens a round emits a row.
    plain_ms: Option<f64>,
    round_ms: Option<f64>,
    round_yield: Option<f64>,
    /// Plain steps left before rounds may run again.
    wait: usize,
    /// Rounds in a row that did not pay.
    misses: u32,
    last_was_plain: bool,
}

/// The weight of the newest sample in [`RoundGate`]'s moving means.
const GATE_WEIGHT: f64 = 0.25;

impl RoundGate {
    fn allows(&self) -> bool {
        self.wait == 0
    }

    /// After a step: a round that emitted `yield_per_row` tokens a row on average, or a plain
    /// step (`None`).
    fn observe(&mut self, step: &StepTimes, yield_per_row: Option<f64>) {
        let mean = |m: &mut Option<f64>, x: f64| {
            *m = Some(m.map_or(x, |m| m + GATE_WEIGHT * (x - m)));
        };
        match yield_per_row {
            Some(tokens) => {
                // Not its wait for the tokens of the pass before: each plain step waits for
                // the one before it too, so that pass is counted once, with its own token.
                mean(&mut self.round_ms, step.total_ms - step.read_ms);
                mean(&mut self.round_yield, tokens);
                self.last_was_plain = false;
                match self.pays() {
                    Some(false) => {
                        self.misses += 1;
                        self.wait = (1usize << self.misses.min(8)).min(MAX_BACKOFF);
                    }
                    Some(true) => self.misses = 0,
                    // No plain step measured yet: two, to measure one after the other.
                    None => self.wait = 2,
                }
            }
            None => {
                if self.last_was_plain && !step.waited {
                    mean(&mut self.plain_ms, step.total_ms);
                }
                self.last_was_plain = true;
                self.wait = self.wait.saturating_sub(1);
            }
        }
    }

    /// Whether rounds pay as measured so far: a round's tokens a row against the plain steps
    /// its time would have decoded; `None` before both were measured.
    fn pays(&self) -> Option<bool> {
        let (plain, round, tokens) = (self.plain_ms?, self.round_ms?, self.round_yield?);
        Some(tokens * plain >= round)
    }
}

/// Where one [`Batch::step`]'s time went on the host, in milliseconds (to see what a verify
/// round costs beside a plain step: `quince bench-batch --verbose`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Whether the step was a verify round (a window pass over drafts).
    pub round: bool,
    /// The rows the step's pass ran over.
    pub rows: usize,
    /// Drafts the round kept, over all its rows.
    pub kept: usize,
    /// Whether the step read the tokens sampled ahead by the step before it built its pass
    /// (to propose drafts after them, or for a row's penalties), instead of building on them
    /// unread while that step's pass still runs.
    pub waited: bool,
    /// Waiting for the tokens sampled ahead by the step before (a drafting batch reads them
    /// before it proposes; a plain step reads them while its own pass runs).
    pub read_ms: f64,
    /// The drafting methods' proposals.
    pub propose_ms: f64,
    /// Building the pass's graph (the model's forward, op by op or compiled; a plain step's
    /// sampling too).
    pub build_ms: f64,
    /// Handing a plain step's pass to the device (`async_eval`; on the CPU most of a plain
    /// step's time shows here).
    pub submit_ms: f64,
    /// A round's output head and picks: its products and the wait for the pass to finish.
    pub pick_ms: f64,
    /// A round's rollback of what each row drops, and its methods learning what it kept.
    pub settle_ms: f64,
    /// The whole step.
    pub total_ms: f64,
}

/// How a verify round takes its rows' positions to the output head (only a row's own
/// positions ever reach it). The choice changes no pick, only what a round costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyHead {
    /// Every position in one product: where a product of several rows costs little more than
    /// one (a GPU, reading the head's weights once for all of them).
    Window,
    /// Position by position, only while the row's drafts match: where the head's arithmetic
    /// is the cost and grows with every row (the CPU), a round then reads the head once per
    /// token it emits, as decode steps do, and saves the rest of the pass.
    ByPosition,
}

impl VerifyHead {
    /// What the backend this thread runs is measured to favour (`docs/benchmarks.md`,
    /// "Drafting in a batch"): by position on the CPU, the window elsewhere.
    pub fn for_backend() -> VerifyHead {
        match mlx::Backend::current() {
            mlx::Backend::Cpu => VerifyHead::ByPosition,
            mlx::Backend::Cuda | mlx::Backend::Metal => VerifyHead::Window,
        }
    }
}

impl<'m> Batch<'m> {
    /// An empty batch over `model`, reading verify rounds' heads as the backend favours
    /// ([`VerifyHead::for_backend`]).
    pub fn new(model: &'m dyn Model) -> Batch<'m> {
        Batch::with_verify_head(model, VerifyHead::for_backend())
    }

    /// An empty batch over `model` that reads verify rounds' heads as `verify_head` says.
    pub fn with_verify_head(model: &'m dyn Model, verify_head: VerifyHead) -> Batch<'m> {
        Batch {
            model,
            layers: Vec::new(),
            rows: Vec::new(),
            layout: RowLayout::Shared,
            verify_head,
            gate: None,
            last_step: StepTimes::default(),
        }
    }

    /// The batch runs verify rounds only while they pay, as measured on its own steps: while a
    /// round costs more time than the plain steps that would emit its tokens, rows decode
    /// plainly (trying a round again after 2, 4, … steps). The tokens are the same either way;
    /// only which steps are rounds depends on the timings. Off by default.
    pub fn gating_rounds(mut self, on: bool) -> Batch<'m> {
        self.gate = on.then(RoundGate::default);
        self
    }

    /// Where the last step's time went.
    pub fn last_step_times(&self) -> StepTimes {
        self.last_step
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
    /// next [`Batch::step`], whatever the other rows draft with and whatever storage their
    /// caches use. A request the batch cannot take (state that does not batch, a duplicate id)
    /// is refused before its prefill, and the batch is unchanged.
    pub fn join(
        &mut self,
        id: RowId,
        caches: Vec<Box<dyn Cache>>,
        request: &GenerateRequest,
    ) -> Result<Vec<BatchEvent>> {
        self.admit(id, caches, request, None)
    }

    /// [`Batch::join`] for a row that drafts with `method` (its own: a fork of a drafter, see
    /// [`DraftMethod::fork`]): each step the
    /// method proposes what follows the row's conversation (`earlier`, the tokens `caches` held
    /// before the prompt, then the prompt and the reply so far), as many as `length` allows,
    /// and the row keeps the drafts its own picks confirm: the same tokens as decoding
    /// plainly, greedy or sampled at the same seed. A method that reads the target's own state
    /// ([`DraftMethod::ports`]: an assistant, an MTP head) reads the row's own part of it; a
    /// target that lacks a port the method reads is refused before anything runs.
    pub fn join_drafting(
        &mut self,
        id: RowId,
        caches: Vec<Box<dyn Cache>>,
        request: &GenerateRequest,
        earlier: &[u32],
        method: Box<dyn DraftMethod>,
        length: DraftLength,
    ) -> Result<Vec<BatchEvent>> {
        self.join_with(id, caches, request, earlier, Method::Owned(method), length)
    }

    /// [`Batch::join_drafting`] with a method owned or lent.
    fn join_with(
        &mut self,
        id: RowId,
        caches: Vec<Box<dyn Cache>>,
        request: &GenerateRequest,
        earlier: &[u32],
        mut method: Method<'m>,
        length: DraftLength,
    ) -> Result<Vec<BatchEvent>> {
        if length.max == 0 {
            return Err(Error::InvalidRequest(
                "a speculative round drafts at least one token".into(),
            ));
        }
        let m = method.get();
        if let Some(&port) = m.ports().iter().find(|&&p| !self.model.provides(p)) {
            return Err(target_lacks(port));
        }
        m.bind(self.model)?;
        let drafting = Drafting {
            stats: SpecStats { method: m.name().into(), ..SpecStats::default() },
            reads_hidden: !m.ports().is_empty(),
            method,
            pace: Pace::new(length),
            context: earlier.iter().chain(&request.prompt).copied().collect(),
        };
        self.admit(id, caches, request, Some(drafting))
    }

    fn admit(
        &mut self,
        id: RowId,
        mut caches: Vec<Box<dyn Cache>>,
        request: &GenerateRequest,
        mut drafting: Option<Drafting<'m>>,
    ) -> Result<Vec<BatchEvent>> {
        self.check_joins(id, &caches)?;
        let mut sampler =
            Sampler::constrained(request.sampling.clone(), request.constraint.clone())?;
        let (logits, start) = crate::generate::start(self.model, &mut caches, request)?;
        if let Some(d) = &mut drafting
            && request.max_tokens > 0
        {
            // The method's own prefill of the conversation (a draft model's caches), from
            // the target's pass over the prompt's last token.
            let hidden = match d.reads_hidden {
                true => self.model.last_hidden(),
                false => None,
            };
            let target = Target {
                model: self.model,
                caches: &caches,
                row: 0,
                hidden: hidden.as_ref().map(|h| (stack_offset(&caches).saturating_sub(1), h)),
            };
            d.stats.context_computed = d.method.get().start(target, &d.context)?;
        }
        let first = match request.max_tokens {
            0 => None,
            _ => Some(sampler.sample(&logits, &request.prompt)?.item::<u32>()?),
        };
        let mut row = self.row(id, sampler, request, start, drafting);
        let Some(token) = first else {
            return Ok(vec![BatchEvent::Finished(row.finish(StopReason::MaxTokens, caches)?)]);
        };
        let mut events = vec![BatchEvent::Token { id, token }];
        if let Some(reason) = row.emit(token, &mut |_, _| Flow::Continue) {
            events.push(BatchEvent::Finished(row.finish(reason, caches)?));
            return Ok(events);
        }
        self.enter(row, caches)?;
        Ok(events)
    }

    /// A row for `request`, whose prefill began at `started`.
    fn row(
        &self,
        id: RowId,
        sampler: Sampler,
        request: &GenerateRequest,
        started: Instant,
        drafting: Option<Drafting<'m>>,
    ) -> Row<'m> {
        Row {
            id,
            sampler,
            stop_tokens: request.stop_tokens.clone(),
            max_tokens: request.max_tokens,
            history: request.prompt.clone(),
            tokens: Vec::new(),
            stats: GenerationStats {
                prompt_tokens: request.prompt.len(),
                ..GenerationStats::default()
            },
            started,
            first_at: started,
            ahead: None,
            drafting,
            storage: Vec::new(),
        }
    }

    /// `row` decodes with the others from the next step, its caches merged into the layers
    /// (moved to the layout the rows need with it first).
    fn enter(&mut self, mut row: Row<'m>, caches: Vec<Box<dyn Cache>>) -> Result<()> {
        row.storage = caches.iter().map(|c| c.signature()).collect();
        self.rows.push(row);
        let layout = self.layout_needed();
        let merged = self.relayout(layout).and_then(|()| {
            if self.layers.is_empty() {
                self.layers = caches
                    .iter()
                    .map(|c| c.empty_rows(self.layout).ok_or_else(|| unbatched(c.as_ref())))
                    .collect::<Result<_>>()?;
            }
            for (layer, cache) in self.layers.iter_mut().zip(caches) {
                rows_of(layer.as_mut())?.merge_row(cache)?;
            }
            Ok(())
        });
        if merged.is_err() {
            self.rows.pop();
        }
        merged
    }

    /// The layout the rows need ([`Batch::layout`]).
    fn layout_needed(&self) -> RowLayout {
        let mixed = self.rows.windows(2).any(|w| w[0].storage != w[1].storage);
        if mixed { RowLayout::Separate } else { RowLayout::Shared }
    }

    /// Moves every layer's rows to `layout`: each row leaves its layer as its own storage and
    /// joins a new one, bit for bit what it held.
    fn relayout(&mut self, layout: RowLayout) -> Result<()> {
        if layout == self.layout {
            return Ok(());
        }
        self.layout = layout;
        if self.layers.iter().any(|l| l.as_batch_rows().is_none_or(|r| r.batch_size() == 0)) {
            // No row to move: the next row to join makes the layers afresh.
            self.layers.clear();
            return Ok(());
        }
        for layer in &mut self.layers {
            let rows = rows_of(layer.as_mut())?;
            let held =
                (0..rows.batch_size()).map(|_| rows.extract_row(0)).collect::<Result<Vec<_>>>()?;
            let first = held.first().ok_or_else(|| unbatched(layer.as_ref()))?;
            let mut moved = first.empty_rows(layout).ok_or_else(|| unbatched(first.as_ref()))?;
            for row in held {
                rows_of(moved.as_mut())?.merge_row(row)?;
            }
            *layer = moved;
        }
        Ok(())
    }

    /// Joins requests that arrive together, each `(id, caches, request)` as [`Batch::join`]
    /// takes it, and returns each one's result in order. Those that start fresh (empty
    /// caches), without images, with a prompt whose every token but the last fits one prefill
    /// chunk, prefill as one padded cohort ([`Cohort`]): one batched window over their prompts
    /// but the last token, padded on the right, after which each row holds what its own
    /// prefill holds there; their last prompt tokens are then appended by the next
    /// [`Batch::step`] with the other rows', which samples their first tokens (reported by
    /// the steps, as every other token). A model whose state does not pad (a multimodal-RoPE
    /// model's position shifts), and every other request, join one by one as [`Batch::join`]
    /// joins them. A request refused is refused alone; the others join.
    pub fn join_together(&mut self, requests: Vec<Arriving>) -> Vec<Result<Vec<BatchEvent>>> {
        let pads = self.model.fresh_caches().is_ok_and(|fresh| Cohort::prepare(fresh, &[]).is_ok());
        let fits = |caches: &[Box<dyn Cache>], r: &GenerateRequest| {
            let room = stack_max_append(caches).unwrap_or(usize::MAX);
            pads && r.images.is_empty()
                && r.max_tokens > 0
                && caches.iter().all(|c| c.offset() == 0)
                && r.prompt.len().saturating_sub(1) <= r.prefill_step.max(1).min(room)
        };
        let together = requests.iter().filter(|(_, c, r)| fits(c, r)).count();
        let mut results: Vec<Result<Vec<BatchEvent>>> = Vec::with_capacity(requests.len());
        let mut cohort: Vec<Arrival> = Vec::new();
        for (index, (id, caches, request)) in requests.into_iter().enumerate() {
            results.push(Ok(Vec::new()));
            if together < 2 || !fits(&caches, &request) {
                results[index] = self.join(id, caches, &request);
                continue;
            }
            let checked = self
                .check_joins(id, &caches)
                .and_then(|()| {
                    let prompt = &request.prompt;
                    crate::generate::check_prompt(self.model, 0, prompt, request.max_tokens)
                })
                .and_then(|()| {
                    Sampler::constrained(request.sampling.clone(), request.constraint.clone())
                });
            match checked {
                Ok(_) if cohort.iter().any(|a| a.id == id) => {
                    results[index] =
                        Err(Error::InvalidRequest(format!("row {id} joins twice at once")));
                }
                Ok(sampler) => cohort.push(Arrival { index, id, caches, request, sampler }),
                Err(e) => results[index] = Err(e),
            }
        }
        if cohort.len() == 1 {
            let Arrival { index, id, caches, request, .. } = cohort.remove(0);
            results[index] = self.join(id, caches, &request);
        } else if !cohort.is_empty() {
            let indices: Vec<usize> = cohort.iter().map(|a| a.index).collect();
            if let Err(e) = self.prefill_cohort(cohort) {
                for index in indices {
                    results[index] =
                        Err(Error::InvalidRequest(format!("the padded prefill failed: {e}")));
                }
            }
        }
        results
    }

    /// Prefills `cohort`'s prompts but their last tokens in one padded window, and enters its
    /// rows with their last prompt tokens still to append. When the padded pass fails, none
    /// of them joins.
    fn prefill_cohort(&mut self, mut cohort: Vec<Arrival>) -> Result<()> {
        mlx::device::memory::reset_peak()?;
        let started = Instant::now();
        let heads: Vec<usize> = cohort.iter().map(|a| a.request.prompt.len() - 1).collect();
        let width = heads.iter().copied().max().unwrap_or(0);
        let mut caches: Vec<Vec<Box<dyn Cache>>> =
            cohort.iter_mut().map(|a| std::mem::take(&mut a.caches)).collect();
        if width > 0 {
            let mut ids = Vec::with_capacity(cohort.len() * width);
            for (arrival, &head) in cohort.iter().zip(&heads) {
                ids.extend_from_slice(&arrival.request.prompt[..head]);
                // Right padding: read only by its own queries, whose outputs nobody reads.
                ids.extend(std::iter::repeat_n(0, width - head));
            }
            let ids = Array::from_slice(&ids, &[cohort.len() as i32, width as i32])?;
            let mut padded = Cohort::prepare(self.model.fresh_caches()?, &heads)?;
            self.model.forward_rows(&ids, padded.layers(), Phase::Window, Rows::Last)?;
            padded.finalize(&mut caches)?;
            let buffers: Vec<Array> = caches.iter().flatten().flat_map(|c| c.buffers()).collect();
            mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
        }
        for (arrival, caches) in cohort.into_iter().zip(caches) {
            let Arrival { id, request, sampler, .. } = arrival;
            let row = self.row(id, sampler, &request, started, None);
            self.enter(row, caches)?;
        }
        Ok(())
    }

    /// One decode step for every row: one forward pass appends each row's next token and
    /// samples the one after it. Steps are pipelined as mlx-lm's are: the pass is built on the
    /// tokens the previous pass sampled before they are read, and those tokens are read (and
    /// reported) while it runs. A row whose next token is its last, or whose penalties read it
    /// first, has every row read before the pass instead. A step in which a row may draft
    /// reads every token first and verifies the drafts in one window pass. Rows that end
    /// leave the batch ([`BatchEvent::Finished`]).
    pub fn step(&mut self) -> Result<Vec<BatchEvent>> {
        self.step_with(&mut |_, _| Flow::Continue)
    }

    /// [`Batch::step`], telling `on_token` of each token as it is emitted: [`Flow::Stop`] ends
    /// that row right after that token ([`StopReason::Stopped`]), even inside a verify window
    /// whose later drafts it would have kept (a user's stop, a stop string), so that it holds
    /// what it would hold had it stopped there decoding alone.
    pub fn step_with(&mut self, on_token: &mut OnToken<'_>) -> Result<Vec<BatchEvent>> {
        let started = Instant::now();
        self.last_step = StepTimes::default();
        let gate_allows = self.gate.as_ref().is_none_or(RoundGate::allows);
        let events = if gate_allows && self.rows.iter().any(Row::may_draft) {
            self.verify_step(on_token)
        } else {
            self.rows.iter_mut().for_each(Row::pass_plainly);
            self.decode_step(on_token)
        };
        self.last_step.total_ms = ms_since(started);
        if let Some(gate) = &mut self.gate {
            let step = &self.last_step;
            let tokens_a_row = step.round.then(|| 1.0 + step.kept as f64 / step.rows as f64);
            gate.observe(step, tokens_a_row);
        }
        events
    }

    /// [`Batch::step`] appending one token to every row.
    fn decode_step(&mut self, on_token: &mut OnToken<'_>) -> Result<Vec<BatchEvent>> {
        let mut events = Vec::with_capacity(2 * self.rows.len());
        if !self.rows.iter().all(|r| r.ahead.is_none() || r.may_append_ahead()) {
            let reading = Instant::now();
            self.read_ahead(&mut events, on_token)?;
            self.last_step.read_ms += ms_since(reading);
        }
        if self.rows.is_empty() {
            return Ok(events);
        }
        let host = Instant::now();
        let feeds = self
            .rows
            .iter()
            .map(|r| match &r.ahead {
                Some(ahead) => Ok(ahead.reshape(&[1, 1])?),
                // The last token emitted (or of the prompt, for a row of a padded cohort).
                None => Ok(Array::from_slice(&[r.history.last().copied().unwrap_or(0)], &[1, 1])?),
            })
            .collect::<Result<Vec<_>>>()?;
        let ids = match feeds.as_slice() {
            [one] => one.clone(),
            _ => mlx::ops::concatenate(&feeds.iter().collect::<Vec<_>>(), 0)?,
        };
        let batch = feeds.len() as i32;
        self.last_step.rows = feeds.len();
        let starts = self.row_offsets();
        // Through the model's compiled step where it has one for these rows.
        let logits = self.model.forward_decode(&ids, &mut self.layers)?;
        let vocab = logits.dim(-1)?;
        let logits = logits.reshape(&[batch, vocab])?;
        let mut sampled = Vec::with_capacity(self.rows.len());
        for (b, row) in self.rows.iter_mut().enumerate() {
            let own = match batch {
                1 => logits.clone(),
                _ => logits.slice(&[b as i32, 0], &[b as i32 + 1, vocab], &[1, 1])?,
            };
            sampled.push(row.sampler.sample(&own, &row.history)?);
        }
        let rows = self.rows.len();
        self.settle_all(&starts, &vec![0; rows], &vec![1; rows], &[])?;
        let build_ms = ms_since(host);
        self.last_step.build_ms += build_ms;
        mlx::async_eval(&sampled.iter().collect::<Vec<_>>())?;
        let host_ms = ms_since(host);
        self.last_step.submit_ms += host_ms - build_ms;
        // The tokens this pass appended unread are read now, while it runs.
        let mut ended = Vec::new();
        for (b, (row, next)) in self.rows.iter_mut().zip(sampled).enumerate() {
            row.add_step_times(host_ms, build_ms);
            if let Some(ahead) = row.ahead.replace(next) {
                let waited = Instant::now();
                let token = ahead.item::<u32>()?;
                let waited = ms_since(waited);
                row.stats.decode_wait_ms += waited;
                self.last_step.read_ms += waited;
                events.push(BatchEvent::Token { id: row.id, token });
                if let Some(reason) = row.emit(token, on_token) {
                    ended.push((b, reason));
                }
            }
        }
        self.leave_all(&ended, &mut events)?;
        Ok(events)
    }

    /// Each row's offset in the layers (where its next appended position goes).
    fn row_offsets(&self) -> Vec<usize> {
        crate::cache::stack_row_offsets(&self.layers).unwrap_or_default()
    }

    /// After a pass that appended `lengths[b]` positions to row `b` from `starts[b]` (a verify
    /// window's, or one token) and kept `accepted[b]` of its drafts: each drafting row's method
    /// but those of the rows `ending` learns what the round kept, with the target's hidden
    /// rows of its positions when it reads them.
    fn settle_all(
        &mut self,
        starts: &[usize],
        accepted: &[usize],
        lengths: &[usize],
        ending: &[usize],
    ) -> Result<()> {
        let reads = |r: &Row<'_>| r.drafting.as_ref().is_some_and(|d| d.reads_hidden);
        let hidden = match self.rows.iter().any(reads) {
            true => self.model.last_hidden(),
            false => None,
        };
        for (b, row) in self.rows.iter_mut().enumerate() {
            let Some(drafting) = row.drafting.as_mut().filter(|_| !ending.contains(&b)) else {
                continue;
            };
            let own = match (&hidden, drafting.reads_hidden) {
                (Some(h), true) => {
                    let s = h.shape();
                    let (b, t) = (b as i32, lengths[b] as i32);
                    Some(h.slice(&[b, 0, 0], &[b + 1, t, s[2]], &[1, 1, 1])?)
                }
                _ => None,
            };
            let target = Target {
                model: self.model,
                caches: &self.layers,
                row: b,
                hidden: own.as_ref().map(|h| (starts[b], h)),
            };
            drafting.method.get().settle(target, accepted[b])?;
        }
        Ok(())
    }

    /// [`Batch::step`] when a row may draft: every row proposes its drafts; when none does, a
    /// plain decode step; else one window pass appends every row's last token and its drafts
    /// (a row with fewer repeats its last token after them) in a round, each row picks its
    /// tokens from its own positions with its own sampler, emits its accepted drafts and its
    /// own next token, and keeps just those positions ([`BatchRows::rollback_rows`]).
    fn verify_step(&mut self, on_token: &mut OnToken<'_>) -> Result<Vec<BatchEvent>> {
        let mut events = Vec::with_capacity(2 * self.rows.len());
        let reading = Instant::now();
        self.read_ahead(&mut events, on_token)?;
        self.last_step.read_ms = ms_since(reading);
        if self.rows.is_empty() {
            return Ok(events);
        }
        let proposing = Instant::now();
        let room = stack_max_append(&self.layers).map_or(usize::MAX, |r| r.saturating_sub(1));
        let (model, layers) = (self.model, &self.layers);
        let drafts: Vec<Vec<u32>> = self
            .rows
            .iter_mut()
            .enumerate()
            .map(|(row, r)| r.propose(Target { model, caches: layers, row, hidden: None }, room))
            .collect::<Result<_>>()?;
        self.last_step.propose_ms = ms_since(proposing);
        let longest = drafts.iter().map(Vec::len).max().unwrap_or(0);
        if longest == 0 {
            events.extend(self.decode_step(on_token)?);
            return Ok(events);
        }
        self.last_step.round = true;
        let host = Instant::now();
        let width = longest + 1;
        let mut window = Vec::with_capacity(self.rows.len() * width);
        for (row, drafts) in self.rows.iter().zip(&drafts) {
            // A row's last token (its last prompt token, for a row of a padded cohort) is not
            // appended yet.
            let bonus = row.history.last().copied().unwrap_or(0);
            window.push(bonus);
            window.extend_from_slice(drafts);
            window.extend(std::iter::repeat_n(bonus, longest - drafts.len()));
        }
        let batch = self.rows.len();
        let starts = self.row_offsets();
        let ids = Array::from_slice(&window, &[batch as i32, width as i32])?;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            if let Err(e) = layer.spec_round_begin() {
                disarm(&mut self.layers[..i], batch);
                return Err(e);
            }
        }
        let picked = self.pick_all(&ids, &drafts);
        let picks = match picked {
            Ok(picks) => picks,
            Err(e) => {
                disarm(&mut self.layers, batch);
                return Err(e);
            }
        };
        let mut keep = Vec::with_capacity(batch);
        let mut accepted_each = Vec::with_capacity(batch);
        let mut ended = Vec::new();
        for (b, ((row, drafts), picks)) in self.rows.iter_mut().zip(&drafts).zip(picks).enumerate()
        {
            // picks[i] is the row's token after its window[..=i]; drafts hold while equal.
            let accepted = drafts.iter().zip(&picks).take_while(|(d, p)| d == p).count();
            if let Some(drafting) = &mut row.drafting
                && !drafts.is_empty()
            {
                drafting.stats.rounds += 1;
                drafting.stats.proposed += drafts.len();
                drafting.stats.accepted += accepted;
                drafting.pace.after_round(drafts.len(), accepted);
            }
            let mut emitted = 0;
            for &token in &picks[..=accepted] {
                emitted += 1;
                events.push(BatchEvent::Token { id: row.id, token });
                if let Some(reason) = row.emit(token, on_token) {
                    ended.push((b, reason));
                    break;
                }
            }
            // The row keeps its last token and the drafts before its last emitted token
            // (the next last token, not appended yet).
            keep.push(emitted);
            accepted_each.push(accepted);
        }
        self.last_step.rows = batch;
        self.last_step.kept = accepted_each.iter().sum();
        let settling = Instant::now();
        for layer in &mut self.layers {
            rows_of(layer.as_mut())?.rollback_rows(&keep)?;
        }
        // The methods learn what the round kept, as a lone generation's would (a row that
        // ends leaves with its method as the round left it: its checkpoint closes it).
        let lengths: Vec<usize> = drafts.iter().map(|d| d.len() + 1).collect();
        let ending: Vec<usize> = ended.iter().map(|&(b, _)| b).collect();
        self.settle_all(&starts, &accepted_each, &lengths, &ending)?;
        self.last_step.settle_ms = ms_since(settling);
        let host_ms = ms_since(host);
        for row in &mut self.rows {
            row.add_step_times(host_ms, host_ms);
        }
        self.leave_all(&ended, &mut events)?;
        Ok(events)
    }

    /// One window pass over `ids` `[B, L]` and each row's picks from its own positions (its
    /// last token and its `drafts`): a row's pick after each position, in order, while its
    /// drafts match (the pick after a draft that does not is its last). Only those positions
    /// reach the output head (a padded position's vocabulary product would cost as much as
    /// any), read in stages of [`VerifyHead`] positions: the whole window at once, or position
    /// by position, so that a position after a mismatch never reaches it. Greedy rows take one
    /// argmax per stage, read back once; the others draw one by one with their own samplers,
    /// so each sampler's stream advances once per emitted token.
    fn pick_all(&mut self, ids: &Array, drafts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
        let building = Instant::now();
        let hidden = self.model.forward_rows(ids, &mut self.layers, Phase::Window, Rows::Hidden)?;
        self.last_step.build_ms = ms_since(building);
        let picking = Instant::now();
        let (batch, width, size) =
            (hidden.dim(0)? as usize, hidden.dim(1)? as usize, hidden.dim(2)?);
        let hidden = hidden.reshape(&[(batch * width) as i32, size])?;
        let stage = match self.verify_head {
            VerifyHead::Window => width,
            VerifyHead::ByPosition => 1,
        };
        let mut picks: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let mut open = vec![true; batch];
        for from in (0..width).step_by(stage) {
            // Each open row's positions in this stage: [from, to).
            let spans: Vec<(usize, usize)> = (0..batch)
                .filter(|&b| open[b])
                .map(|b| (b, (from + stage).min(drafts[b].len() + 1)))
                .filter(|&(_, to)| from < to)
                .collect();
            if spans.is_empty() {
                break;
            }
            let at: Vec<u32> = spans
                .iter()
                .flat_map(|&(b, to)| (from..to).map(move |p| (b * width + p) as u32))
                .collect();
            let rows = match at.len() == batch * width {
                true => hidden.clone(),
                false => hidden.take(&Array::from_slice(&at, &[at.len() as i32])?, 0)?,
            };
            let logits = self.model.logits(&rows)?; // [at.len(), V]
            let argmax = match spans.iter().any(|&(b, _)| self.rows[b].sampler.is_argmax()) {
                true => logits.argmax(-1, false)?.to_vec::<u32>()?,
                false => Vec::new(),
            };
            let vocab = logits.dim(1)?;
            let mut i = 0;
            for &(b, to) in &spans {
                let row = &mut self.rows[b];
                for p in from..to {
                    let pick = match row.sampler.is_argmax() {
                        true => argmax[i + p - from],
                        false => {
                            let at = (i + p - from) as i32;
                            let logits = logits.slice(&[at, 0], &[at + 1, vocab], &[1, 1])?;
                            let seen: Vec<u32> =
                                row.history.iter().chain(&picks[b]).copied().collect();
                            row.sampler.sample(&logits, &seen)?.item::<u32>()?
                        }
                    };
                    picks[b].push(pick);
                    if drafts[b].get(p) != Some(&pick) {
                        open[b] = false;
                        break;
                    }
                }
                i += to - from;
            }
        }
        self.last_step.pick_ms = ms_since(picking);
        Ok(picks)
    }

    /// Reads and reports every token sampled ahead; the rows that end with it leave, the
    /// others wait for a pass to append it.
    fn read_ahead(
        &mut self,
        events: &mut Vec<BatchEvent>,
        on_token: &mut OnToken<'_>,
    ) -> Result<()> {
        let mut ended = Vec::new();
        for (b, row) in self.rows.iter_mut().enumerate() {
            if let Some(ahead) = row.ahead.take() {
                self.last_step.waited = true;
                let token = ahead.item::<u32>()?;
                events.push(BatchEvent::Token { id: row.id, token });
                if let Some(reason) = row.emit(token, on_token) {
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
        if self.rows.is_empty() && row.ahead.is_some() {
            // The last row leaves with a pass built ahead still running: wait for it, so
            // nothing of the batch computes after it has emptied.
            mlx::device::synchronize()?;
        }
        // The rows left may share buffers again (no row drafts, one storage); with none left,
        // the next row to join makes the layers afresh, in the layout it needs.
        if self.rows.is_empty() {
            self.layers.clear();
        }
        let layout = self.layout_needed();
        self.relayout(layout)?;
        row.finish(reason, caches)
    }

    /// Refuses a row the batch cannot take, before anything runs.
    fn check_joins(&self, id: RowId, caches: &[Box<dyn Cache>]) -> Result<()> {
        if self.rows.iter().any(|r| r.id == id) {
            return Err(Error::InvalidRequest(format!("row {id} is already in the batch")));
        }
        if let Some(other) = caches.iter().find(|c| c.empty_rows(RowLayout::Separate).is_none()) {
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
        // A row keeps whatever storage its caches use; the kind of state each layer keeps
        // (keys and values, or recurrent state, or rope shifts) is the model's.
        for (layer, cache) in self.layers.iter().zip(caches) {
            if layer.as_attention().is_some() != cache.as_attention().is_some() {
                return Err(Error::InvalidRequest(format!(
                    "a row of {} cannot join a layer of {}",
                    cache.signature(),
                    layer.signature()
                )));
            }
        }
        Ok(())
    }
}

/// Ends an armed round on `layers` keeping nothing: what a failed window leaves.
fn disarm(layers: &mut [Box<dyn Cache>], batch: usize) {
    for layer in layers {
        if let Some(rows) = layer.as_batch_rows_mut() {
            let _ = rows.rollback_rows(&vec![0; batch]);
        }
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

/// A reply alone: a batch of one row. Prefills `request.prompt` on `caches` (fresh, or holding
/// a prefix the prompt continues) and decodes, streaming each token to `on_token`, which may
/// stop it after that token. `caches` hold the row's state afterwards (every position but the
/// last token, or all of them when a pipelined pass appended it before it was read).
pub fn generate(
    model: &dyn Model,
    caches: &mut Vec<Box<dyn Cache>>,
    request: &GenerateRequest,
    on_token: impl FnMut(u32) -> Flow,
) -> Result<Generation> {
    crate::generate::check_prompt(
        model,
        stack_offset(caches),
        &request.prompt,
        request.max_tokens,
    )?;
    let mut batch = Batch::new(model);
    let joined = batch.join(0, std::mem::take(caches), request);
    let finished = run_alone(&mut batch, joined, on_token)?;
    *caches = finished.caches;
    Ok(finished.generation)
}

/// [`generate`] with a draft method, in a batch of one: the same tokens (greedy,
/// or sampled at the same seed), fewer target passes when drafts are accepted. `earlier` are
/// the tokens `caches` already hold (a resumed conversation), so that the method sees the
/// whole conversation. Returns the generation and the method's counts; the method keeps its
/// state of the conversation (a draft model's caches, ready to checkpoint).
pub fn speculate(
    model: &dyn Model,
    caches: &mut Vec<Box<dyn Cache>>,
    earlier: &[u32],
    request: &GenerateRequest,
    method: &mut dyn DraftMethod,
    length: DraftLength,
    on_token: impl FnMut(u32) -> Flow,
) -> Result<(Generation, SpecStats)> {
    if stack_offset(caches) != earlier.len() {
        return Err(Error::InvalidRequest(format!(
            "the caches hold {} positions, not the {} earlier tokens given",
            stack_offset(caches),
            earlier.len()
        )));
    }
    crate::generate::check_prompt(model, earlier.len(), &request.prompt, request.max_tokens)?;
    let mut batch = Batch::new(model);
    let lent = Method::Lent(method);
    let joined = batch.join_with(0, std::mem::take(caches), request, earlier, lent, length);
    let finished = run_alone(&mut batch, joined, on_token)?;
    *caches = finished.caches;
    let spec = finished.spec.unwrap_or_default();
    Ok((finished.generation, spec))
}

/// Steps a batch holding one row (joined with `joined`'s events) until the row ends,
/// streaming its tokens to `on_token`; [`Flow::Stop`] cancels it after that token.
fn run_alone(
    batch: &mut Batch<'_>,
    joined: Result<Vec<BatchEvent>>,
    mut on_token: impl FnMut(u32) -> Flow,
) -> Result<Finished> {
    // The first token comes with the join; the steps tell of theirs as they emit them.
    for event in joined? {
        match event {
            BatchEvent::Token { token, .. } => {
                if on_token(token) == Flow::Stop
                    && let Some(finished) = batch.cancel(0)?
                {
                    return Ok(finished);
                }
            }
            BatchEvent::Finished(finished) => return Ok(finished),
        }
    }
    loop {
        let events = batch.step_with(&mut |_, token| on_token(token))?;
        for event in events {
            if let BatchEvent::Finished(finished) = event {
                return Ok(finished);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(total_ms: f64, round: bool, waited: bool) -> StepTimes {
        StepTimes { round, waited, total_ms, ..StepTimes::default() }
    }

    /// Rounds run until measured against plain steps; while one costs more than the plain
    /// steps that would emit its tokens the rows decode plainly for 2, 4, … steps, and a
    /// round that pays lets them run again.
    #[test]
    fn the_gate_lets_rounds_run_while_they_pay() {
        let mut gate = RoundGate::default();
        assert!(gate.allows());
        // A round of 2 tokens a row for 25 ms, before any plain step: two plain steps follow,
        // the second measured (the first reads no token sampled ahead).
        gate.observe(&step(25.0, true, true), Some(2.0));
        assert!(!gate.allows());
        gate.observe(&step(4.0, false, false), None);
        gate.observe(&step(10.0, false, false), None);
        assert_eq!(gate.plain_ms, Some(10.0));
        assert!(gate.allows());
        // 25 ms for 2 tokens a row, against 10 ms a token: not paying, 2 plain steps; then
        // again, 4.
        gate.observe(&step(25.0, true, true), Some(2.0));
        assert_eq!(gate.pays(), Some(false));
        for _ in 0..2 {
            assert!(!gate.allows());
            gate.observe(&step(10.0, false, false), None);
        }
        assert!(gate.allows());
        gate.observe(&step(25.0, true, true), Some(2.0));
        assert_eq!(gate.wait, 4);
        // A plain step that waited for its tokens measures nothing; a round's wait for the
        // pass before it is not its cost.
        gate.observe(&step(40.0, false, true), None);
        assert_eq!(gate.plain_ms, Some(10.0));
        for _ in 0..3 {
            gate.observe(&step(10.0, false, false), None);
        }
        // Rounds that keep 3 drafts a row for 20 ms (after 8 ms waiting for the pass before)
        // pay: they run on, step after step.
        for _ in 0..6 {
            assert!(gate.allows());
            let round = StepTimes { read_ms: 8.0, ..step(28.0, true, true) };
            gate.observe(&round, Some(4.0));
        }
        assert!(gate.round_ms.is_some_and(|ms| ms < 21.0), "{:?}", gate.round_ms);
        assert_eq!(gate.pays(), Some(true));
        assert_eq!((gate.wait, gate.misses), (0, 0));
    }
}
