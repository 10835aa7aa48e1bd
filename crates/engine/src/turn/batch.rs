//! Turns answered together: each turn is opened as [`ChatModel::answer`] opens it (rendered,
//! restored from its checkpoint, its images encoded), joins a [`Batch`] after its own prefill,
//! decodes among the others, and is closed as `answer` closes it (its checkpoint written at
//! the turn's boundary). What each turn streams and returns is what `answer` gives it alone.
//!
//! Admission: a turn is admitted once ([`TurnBatch::admit`]: rendered, its images read, its
//! context and memory checked beside the rows) and joins with its [`Admission`]. It joins only
//! when its KV cache, projected at its longest reply, fits the memory limit beside what the
//! rows hold and may still take ([`crate::memory::check_kv`]). A turn that fits alone but not
//! beside them is not joined ([`Joined::Waits`]): the caller keeps it, with its admission, and
//! joins it again once a row has left. A turn that would not fit even alone is refused when it
//! is admitted, as [`ChatModel::answer`] refuses it.

use std::collections::HashMap;

use super::{Admission, ChatModel, Drafters, Opened, ReplyText, Turn, TurnEvent, TurnOutcome};
use crate::batch::{Batch, BatchEvent, Finished, RowId};
use crate::generate::Flow;
use crate::memory::{Beside, Fit};
use crate::speculative::DraftMethod;
use crate::{Error, Result};

/// The callback a turn streams its events to; [`Flow::Stop`] ends the turn after that token.
pub type OnEvent<'c> = Box<dyn FnMut(TurnEvent) -> Flow + 'c>;

/// A turn [`TurnBatch::open`] opened, or why it waits.
enum Opening {
    Waits(Joined),
    Ready(Box<Ready>),
}

/// An opened turn's part before it joins the batch: its caches (what its checkpoint restored,
/// or fresh), what it appends and decodes, the tokens its caches held before the prompt, and
/// its drafter's fork.
struct Ready {
    caches: Vec<Box<dyn crate::cache::Cache>>,
    request: crate::generate::GenerateRequest,
    earlier: Vec<u32>,
    method: Option<Box<dyn DraftMethod>>,
}

/// A turn decoding in the batch.
struct Row<'c> {
    turn: Turn,
    opened: Opened,
    reply: ReplyText<'c>,
    on_event: OnEvent<'c>,
}

/// What [`TurnBatch::join`] did with a turn.
#[derive(Debug)]
pub enum Joined {
    /// It decodes with the others from the next [`TurnBatch::step`].
    Decoding,
    /// It ended with its first token.
    Ended(Box<TurnOutcome>),
    /// Nothing ran: its KV cache fits the memory limit alone but not beside what the turns
    /// decoding may still take. Join it again, with its admission, once one of them has ended.
    Waits {
        /// The turn's admission, to join with again.
        admission: Box<Admission>,
        /// Its projected KV bytes.
        needed: u64,
        /// What the limit leaves it beside the turns decoding.
        available: u64,
    },
    /// Nothing ran: a turn before it in the same [`TurnBatch::join_all`] waits, and turns join
    /// in the order they came. Join it again, with this admission, after that one.
    Behind(Box<Admission>),
}

/// Turns of one model decoding together. See the module docs.
pub struct TurnBatch<'c> {
    chat: &'c ChatModel,
    batch: Batch<'c>,
    rows: HashMap<RowId, Row<'c>>,
}

impl std::fmt::Debug for TurnBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnBatch").field("rows", &self.batch.ids()).finish()
    }
}

impl<'c> TurnBatch<'c> {
    /// No turns yet.
    pub fn new(chat: &'c ChatModel) -> TurnBatch<'c> {
        // Rounds run while they pay: a user's drafting reply never slows the others much.
        let batch = Batch::new(chat.model()).gating_rounds(true);
        TurnBatch { chat, batch, rows: HashMap::new() }
    }

    /// Turns decoding now.
    pub fn len(&self) -> usize {
        self.batch.len()
    }

    /// Whether no turn is decoding.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    /// Admits `turn` beside the turns decoding ([`ChatModel::admit`]): refused when it cannot
    /// run even alone, else what it joins with, now or once it no longer has to wait.
    pub fn admit(&self, turn: &Turn) -> Result<Admission> {
        self.chat.admit(turn, self.beside())
    }

    /// Opens `turn`, admitted as `admission` ([`TurnBatch::admit`]), prefills it alone and
    /// streams its first token to `on_event`; the turn then
    /// decodes with the others at each [`TurnBatch::step`]. A turn that drafts gets its own
    /// fork of the drafter `drafters` keeps loaded (a draft model's weights are shared, its
    /// caches are the turn's, restored from the turn's checkpoint as [`ChatModel::answer`]
    /// restores them). A turn whose KV cache fits only once other turns end is not opened
    /// ([`Joined::Waits`]). Every turn joins, drafting or not, whatever its KV storage (rows
    /// of different storages each keep their own). A turn that fails to open (a damaged
    /// drafter, a failed prefill) is refused, and the other turns are unaffected.
    pub fn join(
        &mut self,
        id: RowId,
        turn: &Turn,
        admission: Admission,
        drafters: &mut Drafters,
        on_event: impl FnMut(TurnEvent) -> Flow + 'c,
    ) -> Result<Joined> {
        match self.open(id, turn, admission, drafters, Box::new(on_event))? {
            Opening::Waits(waits) => Ok(waits),
            Opening::Ready(ready) => self.enter(id, *ready),
        }
    }

    /// [`TurnBatch::join`] for turns that arrive together, each with its result in order.
    /// Those that decode plainly and start fresh (no checkpoint restored, no image) prefill
    /// as one padded cohort ([`Batch::join_together`]); their first tokens come with the
    /// next [`TurnBatch::step`]. The others join one by one. Admission counts the turns of the
    /// group opened before each one beside the turns decoding; once one waits, the turns after
    /// it are not opened ([`Joined::Behind`]).
    pub fn join_all(
        &mut self,
        turns: Vec<(RowId, &Turn, Admission, OnEvent<'c>)>,
        drafters: &mut Drafters,
    ) -> Vec<Result<Joined>> {
        let mut results: Vec<Result<Joined>> = Vec::with_capacity(turns.len());
        let mut together = Vec::new();
        let mut waits = false;
        for (index, (id, turn, admission, on_event)) in turns.into_iter().enumerate() {
            if waits {
                results.push(Ok(Joined::Behind(Box::new(admission))));
                continue;
            }
            // Its place, filled below.
            results.push(Ok(Joined::Decoding));
            results[index] = match self.open(id, turn, admission, drafters, on_event) {
                Err(e) => Err(e),
                Ok(Opening::Waits(joined)) => {
                    waits = true;
                    Ok(joined)
                }
                Ok(Opening::Ready(ready)) if ready.method.is_none() => {
                    together.push((index, id, ready));
                    continue;
                }
                Ok(Opening::Ready(ready)) => self.enter(id, *ready),
            };
        }
        let (places, requests): (Vec<_>, Vec<_>) = together
            .into_iter()
            .map(|(index, id, ready)| ((index, id), (id, ready.caches, ready.request)))
            .unzip();
        let joined = self.batch.join_together(requests);
        for ((index, id), events) in places.into_iter().zip(joined) {
            results[index] = self.entered(id, events);
        }
        results
    }

    /// What [`TurnBatch::join`] does before the turn's prefill: its fit beside the rows, its
    /// drafter's fork and the turn opened from its admission (its checkpoint restored, its
    /// images encoded); the turn is then one of the rows, not decoding yet.
    fn open(
        &mut self,
        id: RowId,
        turn: &Turn,
        admission: Admission,
        drafters: &mut Drafters,
        on_event: OnEvent<'c>,
    ) -> Result<Opening> {
        if self.rows.contains_key(&id) {
            return Err(Error::InvalidRequest(format!("turn {id} is already in the batch")));
        }
        if let Fit::AfterOthers { needed, available } = admission.fit(turn, self.beside())? {
            let admission = Box::new(admission);
            return Ok(Opening::Waits(Joined::Waits { admission, needed, available }));
        }
        let mut method = drafters.fork(self.chat, &turn.speculation)?;
        let mut opened = self.chat.open(turn, admission)?;
        if let (Some(m), Some((_, contents))) = (method.as_deref_mut(), &opened.resumed) {
            // The method's own state kept with the checkpoint (a draft model's caches).
            m.resume(&contents.attachments, &contents.tokens)?;
        }
        let caches = std::mem::take(&mut opened.caches);
        let request = opened.request.clone();
        // The tokens the caches held before the prompt (a restored checkpoint's).
        let earlier = opened.prompt[..opened.prompt.len() - request.prompt.len()].to_vec();
        let reply = ReplyText::new(self.chat, turn, opened.started);
        self.rows.insert(id, Row { turn: turn.clone(), opened, reply, on_event });
        Ok(Opening::Ready(Box::new(Ready { caches, request, earlier, method })))
    }

    /// Prefills an opened turn alone and joins it to the batch.
    fn enter(&mut self, id: RowId, ready: Ready) -> Result<Joined> {
        let Ready { caches, request, earlier, method } = ready;
        let length = self.rows.get(&id).map(|r| r.turn.draft_length).unwrap_or_default();
        let events = match method {
            Some(method) => {
                self.batch.join_drafting(id, caches, &request, &earlier, method, length)
            }
            None => self.batch.join(id, caches, &request),
        };
        self.entered(id, events)
    }

    /// After the batch took (or refused) opened turn `id`: its first events routed, or the turn
    /// dropped.
    fn entered(&mut self, id: RowId, events: Result<Vec<BatchEvent>>) -> Result<Joined> {
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                self.rows.remove(&id);
                return Err(e);
            }
        };
        let mut outcomes = self.route(events)?;
        match outcomes.pop() {
            Some((_, outcome)) => Ok(Joined::Ended(Box::new(outcome?))),
            None => Ok(Joined::Decoding),
        }
    }

    /// The KV memory of the turns decoding: what their caches hold, and what each may still
    /// take (its projection at its longest reply, less its projection now; all of it for a
    /// turn opened that does not decode yet).
    pub fn beside(&self) -> Beside {
        let growth = self
            .rows
            .iter()
            .map(|(&id, row)| {
                let plan = &row.opened.plan;
                let prompt = row.opened.prompt.len();
                let Some((generated, budget)) = self.batch.progress(id) else {
                    return plan.projected_bytes(prompt + row.opened.request.max_tokens) as u64;
                };
                let now = prompt + generated;
                let most = plan.projected_bytes(now + budget.saturating_sub(generated));
                most.saturating_sub(plan.projected_bytes(now)) as u64
            })
            .sum();
        Beside { held: self.batch.kv_bytes(), growth }
    }

    /// One decode step for every turn; returns the turns that ended, each with its outcome
    /// (or what failed in closing it). An error here is the batch's own (the forward pass
    /// failed): every turn in it is lost, and the caller fails them all ([`TurnBatch::ids`]).
    pub fn step(&mut self) -> Result<Vec<(RowId, Result<TurnOutcome>)>> {
        let rows = &mut self.rows;
        // Each token streams to its turn as it is emitted, so that a turn stopped by its
        // callback or a stop string ends right there, inside a verify window too.
        let events = self.batch.step_with(&mut |id, token| match rows.get_mut(&id) {
            Some(row) => row.reply.push(token, &row.opened.stop_tokens, row.on_event.as_mut()),
            None => Flow::Continue,
        })?;
        let ended = events.into_iter().filter_map(|event| match event {
            BatchEvent::Finished(finished) => Some(finished),
            BatchEvent::Token { .. } => None,
        });
        Ok(ended.collect::<Vec<_>>().into_iter().map(|f| (f.id, self.close(f))).collect())
    }

    /// The turns decoding, in row order.
    pub fn ids(&self) -> Vec<RowId> {
        self.batch.ids()
    }

    /// Streams each token to its turn, ends the turns that asked to stop, and closes the turns
    /// that ended.
    fn route(&mut self, events: Vec<BatchEvent>) -> Result<Vec<(RowId, Result<TurnOutcome>)>> {
        let mut stopped = Vec::new();
        let mut ended = Vec::new();
        for event in events {
            match event {
                BatchEvent::Token { id, token } => {
                    let Some(row) = self.rows.get_mut(&id) else { continue };
                    let stop_tokens = &row.opened.stop_tokens;
                    if row.reply.push(token, stop_tokens, row.on_event.as_mut()) == Flow::Stop {
                        stopped.push(id);
                    }
                }
                BatchEvent::Finished(finished) => ended.push(finished),
            }
        }
        for id in stopped {
            // A row that ended in the same step has left already.
            if let Some(finished) = self.batch.cancel(id)? {
                ended.push(finished);
            }
        }
        Ok(ended.into_iter().map(|finished| (finished.id, self.close(finished))).collect())
    }

    fn close(&mut self, finished: Finished) -> Result<TurnOutcome> {
        let Finished { id, generation, caches, spec, mut drafter } = finished;
        let mut row = self
            .rows
            .remove(&id)
            .ok_or_else(|| Error::InvalidRequest(format!("no turn {id} in the batch")))?;
        row.opened.caches = caches;
        let method = drafter.as_deref_mut().map(|m| m as &mut dyn DraftMethod);
        self.chat.close(&row.turn, row.opened, generation, spec, row.reply, method)
    }
}
