//! Speculative decoding: a draft method proposes tokens, the target verifies them in one window
//! and keeps what it would have generated anyway.
//!
//! A round is a transaction on the target's caches ([`crate::cache::Cache::spec_round_begin`]):
//! the verify window `[bonus, d1 .. dk]` is appended in one forward pass, the target picks its
//! own token at every position with its own sampler (greedy: the argmax; sampling: one draw
//! from its seeded stream per emitted token, so the output equals non-speculative output at
//! the same seed: mlx-vlm's rule), a draft is accepted while
//! it equals that pick, and the caches roll back to the kept positions. The target's pick at
//! the first mismatch (or after the last draft) is the next round's bonus token. Rounds run
//! in the one decode path, a row of a [`crate::batch::Batch`] that verifies
//! ([`crate::batch::speculate`] for a reply alone).
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

use serde::{Deserialize, Serialize};

pub use crate::models::{DraftMethod, Target};

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

/// The most tokens decoded plainly between two rounds after drafts kept failing.
pub(crate) const MAX_BACKOFF: usize = 64;
