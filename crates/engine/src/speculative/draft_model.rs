//! A draft model: a smaller model with the target's tokenizer proposes tokens by greedy
//! decoding on its own caches, which roll back with the target's acceptance.

use std::path::Path;

use mlx::Array;

use super::{DraftMethod, Target};
use crate::cache::AttentionCache;
use crate::error::{Error, Result};
use crate::models::{Model, Phase, Rows};

/// A draft model and its caches.
#[derive(Debug)]
pub struct DraftModel {
    model: Box<dyn Model>,
    caches: Vec<Box<dyn AttentionCache>>,
    /// Conversation tokens the caches hold (committed).
    synced: usize,
    /// The open round: tokens appended before the drafts, and drafts proposed.
    round: Option<(usize, usize)>,
    /// Positions per prefill chunk.
    pub prefill_step: usize,
}

impl DraftModel {
    /// Wraps a loaded model.
    pub fn new(model: Box<dyn Model>) -> DraftModel {
        DraftModel { model, caches: Vec::new(), synced: 0, round: None, prefill_step: 512 }
    }

    /// Loads the model in `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<DraftModel> {
        Ok(DraftModel::new(crate::models::load(path)?))
    }

    /// Checks that two model folders share a tokenizer: the same `tokenizer.json` when both
    /// have one.
    pub fn check_same_tokenizer(target: &Path, draft: &Path) -> Result<()> {
        let read = |dir: &Path| std::fs::read(dir.join("tokenizer.json")).ok();
        match (read(target), read(draft)) {
            (Some(a), Some(b)) if a != b => Err(Error::InvalidRequest(format!(
                "the draft model in {} has another tokenizer than the target: a draft model must \
                 share the target's tokenizer.json",
                draft.display()
            ))),
            _ => Ok(()),
        }
    }
}

fn ids(tokens: &[u32]) -> Result<Array> {
    crate::models::gemma4::token_array(tokens)
}

impl DraftMethod for DraftModel {
    fn name(&self) -> &'static str {
        "draft"
    }

    fn bind(&mut self, target: &dyn Model) -> Result<()> {
        if self.model.vocab_size() != target.vocab_size() {
            return Err(Error::InvalidRequest(format!(
                "the draft model's vocabulary of {} tokens is not the target's {}: a draft model \
                 must use the target's tokenizer",
                self.model.vocab_size(),
                target.vocab_size()
            )));
        }
        Ok(())
    }

    fn start(&mut self, _target: Target<'_>, context: &[u32]) -> Result<()> {
        if context.len() >= self.model.max_context() {
            return Err(Error::InvalidRequest(format!(
                "the conversation ({} tokens) is longer than the draft model's context of {}",
                context.len(),
                self.model.max_context()
            )));
        }
        self.caches = self.model.new_caches()?;
        self.round = None;
        for chunk in context.chunks(self.prefill_step.max(1)) {
            self.model.forward_rows(&ids(chunk)?, &mut self.caches, Phase::Window, Rows::Last)?;
            let buffers: Vec<Array> = self.caches.iter().flat_map(|c| c.buffers()).collect();
            mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
        }
        self.synced = context.len();
        Ok(())
    }

    fn propose(&mut self, _target: Target<'_>, context: &[u32], max: usize) -> Result<Vec<u32>> {
        if self.round.is_some() {
            return Err(Error::InvalidRequest("draft model: propose before settling".into()));
        }
        let pending = context.get(self.synced..).unwrap_or_default();
        if pending.is_empty() || max == 0 {
            return Ok(Vec::new());
        }
        if self.synced + pending.len() + max >= self.model.max_context() {
            return Ok(Vec::new());
        }
        for cache in self.caches.iter_mut() {
            cache.spec_round_begin()?;
        }
        self.round = Some((pending.len(), 0));
        // The committed tokens the caches lack (the bonus, and the last draft after a round
        // that accepted them all), then greedy steps, built lazily and evaluated once.
        let phase = if pending.len() == 1 { Phase::Decode } else { Phase::Window };
        let logits =
            self.model.forward_rows(&ids(pending)?, &mut self.caches, phase, Rows::Last)?;
        let v = logits.dim(-1)?;
        let mut next = logits.reshape(&[1, v])?.argmax(-1, false)?;
        let mut drafts = vec![next.clone()];
        for _ in 1..max {
            let step =
                self.model.forward(&next.reshape(&[1, 1])?, &mut self.caches, Phase::Decode)?;
            next = step.reshape(&[1, v])?.argmax(-1, false)?;
            drafts.push(next.clone());
        }
        let all = mlx::ops::concatenate(&drafts.iter().collect::<Vec<_>>(), 0)?;
        let tokens = all.to_vec::<u32>()?;
        self.round = Some((pending.len(), tokens.len()));
        Ok(tokens)
    }

    fn settle(&mut self, _target: Target<'_>, accepted: usize) -> Result<()> {
        let Some((pending, drafted)) = self.round.take() else {
            return Ok(());
        };
        // The caches hold the pending tokens and every draft but the last.
        let keep = pending + accepted.min(drafted.saturating_sub(1));
        for cache in self.caches.iter_mut() {
            cache.spec_round_rollback(keep)?;
        }
        self.synced += keep;
        Ok(())
    }
}
