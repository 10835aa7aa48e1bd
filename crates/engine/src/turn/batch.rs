//! Turns answered together: each turn is opened as [`ChatModel::answer`] opens it (rendered,
//! restored from its checkpoint, its images encoded), joins a [`Batch`] after its own prefill,
//! decodes among the others, and is closed as `answer` closes it (its checkpoint written at
//! the turn's boundary). What each turn streams and returns is what `answer` gives it alone.
//!
//! Admission: a turn joins only when its KV cache, projected at its longest reply, fits the
//! memory limit beside what the rows hold and may still take ([`crate::memory::check_kv`]). A
//! turn that fits alone but not beside them is not joined ([`Joined::Waits`]): the caller
//! keeps it and asks again once a row has left. A turn that would not fit even alone is
//! refused, as [`ChatModel::answer`] refuses it.

use std::collections::HashMap;

use super::{ChatModel, Drafters, Opened, ReplyText, Turn, TurnEvent, TurnOutcome};
use crate::batch::{Batch, BatchEvent, Finished, RowId};
use crate::cache::KvOptions;
use crate::error::{Error, Result};
use crate::generate::Flow;
use crate::memory::{Beside, Fit};
use crate::speculative::{DraftMethod, Speculation};

/// The callback a turn streams its events to; [`Flow::Stop`] ends the turn after that token.
type OnEvent<'c> = Box<dyn FnMut(TurnEvent) -> Flow + 'c>;

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
    /// decoding may still take. Join it again once one of them has ended.
    Waits {
        /// Its projected KV bytes.
        needed: u64,
        /// What the limit leaves it beside the turns decoding.
        available: u64,
    },
}

/// Turns of one model decoding together. See the module docs.
pub struct TurnBatch<'c> {
    chat: &'c ChatModel,
    batch: Batch<'c>,
    rows: HashMap<RowId, Row<'c>>,
    /// The KV storage every row's caches use (one per batch).
    kv: Option<KvOptions>,
}

impl std::fmt::Debug for TurnBatch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnBatch").field("rows", &self.batch.ids()).finish()
    }
}

impl<'c> TurnBatch<'c> {
    /// No turns yet.
    pub fn new(chat: &'c ChatModel) -> TurnBatch<'c> {
        TurnBatch { chat, batch: Batch::new(chat.model()), rows: HashMap::new(), kv: None }
    }

    /// Turns decoding now.
    pub fn len(&self) -> usize {
        self.batch.len()
    }

    /// Whether no turn is decoding.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    /// Whether `turn` can join now: it decodes in batches ([`ChatModel::batches`]) and keeps
    /// its keys and values as the turns in the batch do. A turn of another KV storage waits
    /// for the batch to empty (its rows could not share the batch's layers), and so does a
    /// turn that drafts (by prompt lookup or a draft model) when the batch's first turn did
    /// not (its rows share buffers that resolve no rounds). A plain turn joins a batch that
    /// verifies, drafting nothing; turns of one batch may draft with different methods.
    pub fn takes(&self, turn: &Turn) -> bool {
        let drafts = turn.speculation != Speculation::Off;
        self.chat.batches(turn)
            && (self.is_empty() || (self.kv == Some(turn.kv) && (!drafts || self.batch.verifies())))
    }

    /// Opens `turn`, prefills it alone and streams its first token to `on_event`; the turn then
    /// decodes with the others at each [`TurnBatch::step`]. A turn that drafts gets its own
    /// fork of the drafter `drafters` keeps loaded (a draft model's weights are shared, its
    /// caches are the turn's, restored from the turn's checkpoint as [`ChatModel::answer`]
    /// restores them). A turn whose KV cache fits only once other turns end is not opened
    /// ([`Joined::Waits`]). A turn the batch does not take ([`ChatModel::batches`]) or that
    /// fails to open (an unreadable image, a prompt over the context, a KV cache over the
    /// memory limit even alone, a drafter that does not load) is refused, and the other turns
    /// are unaffected.
    pub fn join(
        &mut self,
        id: RowId,
        turn: &Turn,
        drafters: &mut Drafters,
        on_event: impl FnMut(TurnEvent) -> Flow + 'c,
    ) -> Result<Joined> {
        if !self.takes(turn) {
            return Err(Error::InvalidRequest(
                "this turn cannot join the batch (an assistant model, drafts in a batch that \
                 does not verify, or another KV storage than the batch's)"
                    .into(),
            ));
        }
        if self.rows.contains_key(&id) {
            return Err(Error::InvalidRequest(format!("turn {id} is already in the batch")));
        }
        let drafts = turn.speculation != Speculation::Off;
        if self.is_empty() && drafts != self.batch.verifies() {
            // The first turn decides whether rows verify drafts.
            self.batch = match drafts {
                true => Batch::verifying(self.chat.model()),
                false => Batch::new(self.chat.model()),
            };
        }
        let admitted = self.chat.admit(turn, self.beside())?;
        if let Fit::AfterOthers { needed, available } = admitted.fit {
            return Ok(Joined::Waits { needed, available });
        }
        let mut method = drafters.fork(self.chat, &turn.speculation)?;
        let mut opened = self.chat.open(turn, admitted)?;
        if let (Some(m), Some((_, contents))) = (method.as_deref_mut(), &opened.resumed) {
            // The method's own state kept with the checkpoint (a draft model's caches).
            m.resume(&contents.attachments, &contents.tokens)?;
        }
        let caches = std::mem::take(&mut opened.caches);
        let reply = ReplyText::new(self.chat, turn, opened.started);
        let row = Row { turn: turn.clone(), opened, reply, on_event: Box::new(on_event) };
        let request = row.opened.request.clone();
        // The tokens the caches held before the prompt (a restored checkpoint's).
        let earlier = row.opened.prompt[..row.opened.prompt.len() - request.prompt.len()].to_vec();
        self.rows.insert(id, row);
        let joined = match method {
            Some(method) => {
                self.batch.join_drafting(id, caches, &request, &earlier, method, turn.draft_length)
            }
            None => self.batch.join(id, caches, &request),
        };
        let events = match joined {
            Ok(events) => events,
            Err(e) => {
                self.rows.remove(&id);
                return Err(e);
            }
        };
        if self.batch.len() == 1 {
            self.kv = Some(turn.kv);
        }
        let mut outcomes = self.route(events)?;
        match outcomes.pop() {
            Some((_, outcome)) => Ok(Joined::Ended(Box::new(outcome?))),
            None => Ok(Joined::Decoding),
        }
    }

    /// The KV memory of the turns decoding: what their caches hold, and what each may still
    /// take (its projection at its longest reply, less its projection now).
    pub fn beside(&self) -> Beside {
        let growth = self
            .rows
            .iter()
            .filter_map(|(&id, row)| {
                let (generated, budget) = self.batch.progress(id)?;
                let now = row.opened.prompt.len() + generated;
                let plan = &row.opened.plan;
                let most = plan.projected_bytes(now + budget.saturating_sub(generated));
                Some(most.saturating_sub(plan.projected_bytes(now)) as u64)
            })
            .sum();
        Beside { held: self.batch.kv_bytes(), growth }
    }

    /// One decode step for every turn; returns the turns that ended, each with its outcome
    /// (or what failed in closing it). An error here is the batch's own (the forward pass
    /// failed): every turn in it is lost, and the caller fails them all ([`TurnBatch::ids`]).
    pub fn step(&mut self) -> Result<Vec<(RowId, Result<TurnOutcome>)>> {
        let events = self.batch.step()?;
        self.route(events)
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
