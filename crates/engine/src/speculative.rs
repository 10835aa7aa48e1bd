//! Speculative decoding: a draft method proposes tokens, the target verifies them in one window
//! and keeps what it would have generated anyway.
//!
//! A round is a transaction on the target's caches ([`crate::cache::Cache::spec_round_begin`]):
//! the verify window `[bonus, d1 .. dk]` is appended in one forward pass, the target picks its
//! own token at every position with its own sampler (greedy: the argmax; sampling: one draw
//! from its seeded stream per emitted token, so the output equals non-speculative output at
//! the same seed: mlx-vlm's rule, `shared/reference/engine.md` §0.4), a draft is accepted while
//! it equals that pick, and the caches roll back to the kept positions. The target's pick at
//! the first mismatch (or after the last draft) is the next round's bonus token.
//!
//! Methods ([`DraftMethod`]) name the target ports they read ([`TargetPort`](crate::models::TargetPort)) and are refused
//! before they allocate anything when the target lacks one ([`crate::models::target_lacks`]):
//! - [`lookup::PromptLookup`]: n-gram matches in the conversation, no model;
//! - [`draft_model::DraftModel`]: a smaller model with the same tokenizer;
//! - drafter families of the registry, such as Gemma 4's assistant
//!   ([`crate::models::gemma4::Gemma4Assistant`]), reading the target's own keys, values and
//!   hidden state through [`TargetPort::AssistantRows`](crate::models::TargetPort::AssistantRows).

pub mod draft_model;
pub mod lookup;

use std::path::PathBuf;

use mlx::Array;
use serde::{Deserialize, Serialize};

use crate::cache::{Cache, stack_max_append, stack_offset};
use crate::error::{Error, Result};
use crate::generate::{
    Decoded, Emitter, Flow, GenerateRequest, Generation, StopReason, decode_loop, decode_step,
    start,
};
pub use crate::models::{DraftMethod, Target};
use crate::models::{Model, Phase, target_lacks};
use crate::sampling::Sampler;

/// How a reply is decoded: plainly, or speculatively with a draft method (the same tokens
/// either way).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(tag = "method", rename_all = "snake_case")]
pub enum Speculation {
    /// One token per step.
    #[default]
    Off,
    /// Drafts from n-gram matches in the conversation (no model).
    Lookup,
    /// Drafts from a smaller model with the same tokenizer.
    Draft {
        /// The draft model's folder.
        model: PathBuf,
    },
    /// Drafts from a drafter made for the loaded model (a Gemma 4 assistant, a Qwen3.5 MTP
    /// head).
    Assistant {
        /// The drafter's folder.
        model: PathBuf,
    },
}

/// How many tokens a round drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftLength {
    /// The most tokens one round drafts.
    pub max: usize,
    /// Adapt between 1 and `max`: two more after a round that accepted every draft, one fewer
    /// after one that did not (`false`: always `max`).
    pub adaptive: bool,
}

impl Default for DraftLength {
    fn default() -> Self {
        DraftLength { max: 4, adaptive: true }
    }
}

/// How many tokens the next round drafts, as [`DraftLength`] adapts it: a round that accepts
/// nothing halves the draft length; after one that accepted nothing at one draft, this many
/// tokens are decoded plainly before the next try, doubling up to [`MAX_BACKOFF`] while
/// drafts keep failing, so that a method that cannot guess the text costs almost nothing.
#[derive(Debug, Clone)]
pub(crate) struct Pace {
    length: DraftLength,
    k: usize,
    /// Tokens to decode plainly before the next round.
    pub(crate) backoff: usize,
    failures: u32,
}

impl Pace {
    pub(crate) fn new(length: DraftLength) -> Pace {
        Pace { length, k: length.max, backoff: 0, failures: 0 }
    }

    /// The most tokens the next round drafts.
    pub(crate) fn k(&self) -> usize {
        self.k
    }

    /// After a round that drafted `drafted` tokens and accepted `accepted` of them.
    pub(crate) fn after_round(&mut self, drafted: usize, accepted: usize) {
        if !self.length.adaptive {
            return;
        }
        self.k = if accepted == drafted {
            (self.k + 2).min(self.length.max)
        } else if accepted == 0 {
            (self.k / 2).max(1)
        } else {
            self.k.saturating_sub(1).max(1)
        };
        if accepted > 0 {
            self.failures = 0;
        } else if drafted == 1 {
            self.failures += 1;
            self.backoff = (1usize << self.failures.min(8)).min(MAX_BACKOFF);
        }
    }
}

/// Counts of one speculative generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
pub struct SpecStats {
    /// The method's name (`lookup`, `draft`, `assistant`).
    pub method: String,
    /// Verify rounds run (steps with no proposal are plain decode steps, not rounds).
    pub rounds: usize,
    /// Draft tokens proposed.
    pub proposed: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Conversation tokens the method computed before its first round (a draft model's
    /// prefill of what its caches did not hold).
    pub context_computed: usize,
}

impl SpecStats {
    /// Accepted / proposed (0 when nothing was proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed == 0 { 0.0 } else { self.accepted as f64 / self.proposed as f64 }
    }

    /// Drafts accepted per round.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.rounds == 0 { 0.0 } else { self.accepted as f64 / self.rounds as f64 }
    }
}

/// [`crate::generate::generate`] with a draft method: the same tokens (greedy, or sampled at
/// the same seed), fewer target forward passes when drafts are accepted. Returns the
/// generation and the method's counts.
///
/// `earlier` are the tokens `caches` already hold (a resumed conversation), so that the method
/// sees the whole conversation.
pub fn generate(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    earlier: &[u32],
    request: &GenerateRequest,
    method: &mut dyn DraftMethod,
    length: DraftLength,
    on_token: impl FnMut(u32) -> Flow,
) -> Result<(Generation, SpecStats)> {
    if length.max == 0 {
        return Err(Error::InvalidRequest("a speculative round drafts at least one token".into()));
    }
    for &port in method.ports() {
        if !model.provides(port) {
            return Err(target_lacks(port));
        }
    }
    method.bind(model)?;
    let result = rounds(model, caches, earlier, request, method, length, on_token);
    method.release(model);
    result
}

/// [`generate`] once the method is bound.
fn rounds(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    earlier: &[u32],
    request: &GenerateRequest,
    method: &mut dyn DraftMethod,
    length: DraftLength,
    on_token: impl FnMut(u32) -> Flow,
) -> Result<(Generation, SpecStats)> {
    let mut sampler = Sampler::new(request.sampling.clone())?;
    let greedy = request.sampling.is_greedy();
    if stack_offset(caches) != earlier.len() {
        return Err(Error::InvalidRequest(format!(
            "the caches hold {} positions, not the {} earlier tokens given",
            stack_offset(caches),
            earlier.len()
        )));
    }
    let (logits, started) = start(model, caches, request)?;
    let mut out = Emitter::new(request, started, on_token);
    let mut stats = SpecStats { method: method.name().into(), ..SpecStats::default() };
    if request.max_tokens == 0 {
        return with_stats(out.finish(StopReason::MaxTokens), stats);
    }
    // The whole conversation, as the method sees it.
    let mut context: Vec<u32> = earlier.iter().chain(&request.prompt).copied().collect();
    stats.context_computed = method.start(Target { model, caches }, &context)?;
    let mut bonus = sampler.sample(&logits, &out.history)?.item::<u32>()?;
    context.push(bonus);
    if let Some(reason) = out.emit(bonus) {
        return with_stats(out.finish(reason), stats);
    }
    let pipelined = !request.sampling.penalizes();
    let mut pace = Pace::new(length);
    let stop_reason = loop {
        if pace.backoff > 0 {
            // Decoded plainly, pipelined.
            let backoff = std::mem::take(&mut pace.backoff);
            let token = Array::from_slice(&[bonus], &[1])?;
            let y = decode_step(model, caches, &mut sampler, &token, &out.history)?;
            let before = out.tokens.len();
            let decoded =
                decode_loop(model, caches, &mut sampler, y, &mut out, backoff, pipelined)?;
            context.extend_from_slice(&out.tokens[before..]);
            match decoded {
                Decoded::Ended(reason) => break reason,
                Decoded::Paused(token) => bonus = token,
            }
            method.settle(Target { model, caches }, 0)?;
            continue;
        }
        // A round never drafts past the token budget: the bonus and k drafts emit at most
        // k + 1 tokens.
        // Nor past a storage's KV conversion: the window `[bonus, drafts…]` ends at it at the
        // latest, so every position is read at the precision decode steps would read it.
        let room = stack_max_append(caches).map_or(usize::MAX, |r| r.saturating_sub(1));
        let budget = out.remaining().saturating_sub(1).min(room);
        let mut drafts = Vec::new();
        if budget > 0 {
            drafts = method.propose(Target { model, caches }, &context, pace.k().min(budget))?;
            drafts.truncate(pace.k().min(budget));
        }
        if drafts.is_empty() {
            // Nothing to verify: a plain decode step.
            let token = Array::from_slice(&[bonus], &[1])?;
            bonus =
                decode_step(model, caches, &mut sampler, &token, &out.history)?.item::<u32>()?;
            context.push(bonus);
            if let Some(reason) = out.emit(bonus) {
                break reason;
            }
            method.settle(Target { model, caches }, 0)?;
            continue;
        }
        let mut window = Vec::with_capacity(drafts.len() + 1);
        window.push(bonus);
        window.extend_from_slice(&drafts);
        for cache in caches.iter_mut() {
            cache.spec_round_begin()?;
        }
        let verified = verify(model, caches, &window, &mut sampler, &out.history, greedy, &drafts);
        let picks = match verified {
            Ok(picks) => picks,
            Err(e) => {
                for cache in caches.iter_mut() {
                    let _ = cache.spec_round_rollback(0);
                }
                return Err(e);
            }
        };
        // picks[i] is the target's token after window[..=i]; drafts are accepted while equal.
        let accepted = drafts.iter().zip(&picks).take_while(|(d, p)| d == p).count();
        stats.rounds += 1;
        stats.proposed += drafts.len();
        stats.accepted += accepted;
        // Emit the accepted drafts and the target's own next token, stopping early if asked.
        let mut emitted = 0;
        let mut ended = None;
        for &token in &picks[..=accepted] {
            emitted += 1;
            context.push(token);
            if let Some(reason) = out.emit(token) {
                ended = Some(reason);
                break;
            }
        }
        // The caches keep the bonus and the drafts before the last emitted token (which is
        // the next bonus, not yet appended).
        for cache in caches.iter_mut() {
            cache.spec_round_rollback(emitted)?;
        }
        if let Some(reason) = ended {
            break reason;
        }
        bonus = picks[accepted];
        method.settle(Target { model, caches }, accepted)?;
        pace.after_round(drafts.len(), accepted);
    };
    with_stats(out.finish(stop_reason), stats)
}

/// The most tokens decoded plainly between two rounds after drafts kept failing.
const MAX_BACKOFF: usize = 64;

fn with_stats(generation: Result<Generation>, stats: SpecStats) -> Result<(Generation, SpecStats)> {
    generation.map(|g| (g, stats))
}

/// Appends the verify window and returns the target's pick after each of its positions. Greedy
/// picks are one argmax over every row; sampled picks are drawn one by one, in order, and only
/// while the drafts match (so the sampler's stream advances once per emitted token).
fn verify(
    model: &dyn Model,
    caches: &mut [Box<dyn Cache>],
    window: &[u32],
    sampler: &mut Sampler,
    history: &[u32],
    greedy: bool,
    drafts: &[u32],
) -> Result<Vec<u32>> {
    let ids = crate::tokens::ids(window)?;
    let logits = model.forward(&ids, caches, Phase::Window)?; // [1, k + 1, V]
    let v = logits.dim(-1)?;
    picks(&logits.reshape(&[window.len() as i32, v])?, sampler, history, greedy, drafts)
}

/// The target's pick after each position of a verify window from its logits `[L, V]`: greedy,
/// one argmax over every position; sampled, drawn one by one in order and only while the
/// drafts match (so the sampler's stream advances once per emitted token).
pub(crate) fn picks(
    logits: &Array,
    sampler: &mut Sampler,
    history: &[u32],
    greedy: bool,
    drafts: &[u32],
) -> Result<Vec<u32>> {
    if greedy {
        return Ok(logits.argmax(-1, false)?.to_vec::<u32>()?);
    }
    let (rows, v) = (logits.dim(0)?, logits.dim(1)?);
    let mut picks = Vec::with_capacity(rows as usize);
    let mut seen = history.to_vec();
    for i in 0..rows {
        let row = logits.slice(&[i, 0], &[i + 1, v], &[1, 1])?;
        let pick = sampler.sample(&row, &seen)?.item::<u32>()?;
        picks.push(pick);
        seen.push(pick);
        if drafts.get(i as usize) != Some(&pick) {
            break;
        }
    }
    Ok(picks)
}
