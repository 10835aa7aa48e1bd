//! A draft model: a smaller model with the target's tokenizer proposes tokens by greedy
//! decoding on its own caches, which roll back with the target's acceptance.

use std::path::Path;
use std::rc::Rc;

use mlx::Array;

use super::{DraftMethod, Target};
use crate::cache::Cache;
use crate::kv_file::Attachment;
use crate::models::{Model, Phase, Rows};
use crate::{Error, Result};

/// The [`Attachment`] schema of a draft model's caches kept with a target checkpoint.
pub const SCHEMA: &str = "quince-draft-kv/1";

/// A draft model and its caches, kept between generations: a new generation computes only
/// the conversation tokens the caches do not already hold (from the last generation, or from
/// the attachment of the checkpoint it resumes from). Its forks ([`DraftMethod::fork`]) share
/// its weights, each with caches of its own.
#[derive(Debug)]
pub struct DraftModel {
    model: Rc<dyn Model>,
    /// What its attachments are keyed by (SHA-256 of its `config.json`); empty: never saved.
    identity: String,
    caches: Vec<Box<dyn Cache>>,
    /// The conversation tokens the caches hold (committed).
    held: Vec<u32>,
    /// The open round: the tokens appended before the drafts, and the drafts proposed.
    round: Option<(Vec<u32>, Vec<u32>)>,
    /// Positions per prefill chunk.
    pub prefill_step: usize,
}

impl DraftModel {
    /// Wraps a loaded model (its state is never kept with checkpoints: it has no identity).
    pub fn new(model: Box<dyn Model>) -> DraftModel {
        DraftModel {
            model: Rc::from(model),
            identity: String::new(),
            caches: Vec::new(),
            held: Vec::new(),
            round: None,
            prefill_step: 512,
        }
    }

    /// Wraps the model loaded from `folder`, whose state is kept with checkpoints (keyed by
    /// the SHA-256 of its `config.json`).
    pub fn from_folder(model: Box<dyn Model>, folder: &Path) -> Result<DraftModel> {
        let mut draft = DraftModel::new(model);
        let config = folder.join("config.json");
        let bytes = std::fs::read(&config).map_err(|source| Error::Io { path: config, source })?;
        draft.identity = crate::kv_file::sha256_hex(&bytes);
        Ok(draft)
    }

    /// Conversation tokens the caches hold.
    pub fn held(&self) -> &[u32] {
        &self.held
    }

    /// Fresh, empty caches.
    fn reset(&mut self) -> Result<()> {
        self.caches = self.model.fresh_caches()?;
        self.held.clear();
        self.round = None;
        Ok(())
    }

    /// Ends a round the generation left open (it stopped before settling): the caches keep
    /// the pending tokens and the drafts that `conversation` went on with. Where that fails,
    /// the caches start over.
    fn close_round(&mut self, conversation: &[u32]) -> Result<()> {
        if let Some((pending, drafted)) = self.round.take() {
            // The caches hold every draft but the last.
            let appended = &drafted[..drafted.len().saturating_sub(1)];
            let after = conversation.get(self.held.len() + pending.len()..).unwrap_or_default();
            let kept =
                if conversation[self.held.len().min(conversation.len())..].starts_with(&pending) {
                    common_prefix(appended, after)
                } else {
                    0
                };
            let closed = self
                .caches
                .iter_mut()
                .try_for_each(|c| c.spec_round_rollback(pending.len() + kept));
            match closed {
                Ok(()) => {
                    self.held.extend_from_slice(&pending);
                    self.held.extend_from_slice(&appended[..kept]);
                }
                Err(_) => self.reset()?,
            }
        }
        Ok(())
    }

    /// Drops held positions after the first `keep`; false when the storages cannot.
    fn cut_to(&mut self, keep: usize) -> Result<bool> {
        let drop = self.held.len() - keep;
        if drop > 0 {
            if !self.caches.iter().all(|c| c.is_trimmable()) {
                return Ok(false);
            }
            for cache in &mut self.caches {
                cache.trim(drop)?;
            }
            self.held.truncate(keep);
        }
        Ok(true)
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
    crate::tokens::ids(tokens)
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

    fn start(&mut self, _target: Target<'_>, context: &[u32]) -> Result<usize> {
        if context.len() >= self.model.max_context() {
            return Err(Error::InvalidRequest(format!(
                "the conversation ({} tokens) is longer than the draft model's context of {}",
                context.len(),
                self.model.max_context()
            )));
        }
        // Keep what the caches share with this conversation.
        self.close_round(context)?;
        let shared = common_prefix(&self.held, context);
        if self.caches.is_empty() || !self.cut_to(shared)? {
            self.reset()?;
        }
        let fresh = &context[self.held.len()..];
        for chunk in fresh.chunks(self.prefill_step.max(1)) {
            self.model.forward_rows(&ids(chunk)?, &mut self.caches, Phase::Window, Rows::Last)?;
            let buffers: Vec<Array> = self.caches.iter().flat_map(|c| c.buffers()).collect();
            mlx::eval(&buffers.iter().collect::<Vec<_>>())?;
        }
        let computed = fresh.len();
        self.held = context.to_vec();
        Ok(computed)
    }

    fn propose(&mut self, _target: Target<'_>, context: &[u32], max: usize) -> Result<Vec<u32>> {
        if self.round.is_some() {
            return Err(Error::InvalidRequest("draft model: propose before settling".into()));
        }
        if !context.starts_with(&self.held) {
            return Err(Error::InvalidRequest(
                "draft model: the context does not extend what it holds".into(),
            ));
        }
        let pending = &context[self.held.len()..];
        if pending.is_empty() || max == 0 {
            return Ok(Vec::new());
        }
        if self.held.len() + pending.len() + max >= self.model.max_context() {
            return Ok(Vec::new());
        }
        for cache in self.caches.iter_mut() {
            cache.spec_round_begin()?;
        }
        self.round = Some((pending.to_vec(), Vec::new()));
        // The committed tokens the caches lack (the bonus, and the last draft after a round
        // that accepted them all: decided, so read as decode steps read), then greedy steps,
        // built lazily and evaluated once.
        let logits = self.model.forward_rows(
            &ids(pending)?,
            &mut self.caches,
            Phase::Committed,
            Rows::Last,
        )?;
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
        self.round = Some((pending.to_vec(), tokens.clone()));
        Ok(tokens)
    }

    fn settle(&mut self, _target: Target<'_>, accepted: usize) -> Result<()> {
        let Some((pending, drafted)) = self.round.take() else {
            return Ok(());
        };
        // The caches hold the pending tokens and every draft but the last.
        let drafts_kept = accepted.min(drafted.len().saturating_sub(1));
        for cache in self.caches.iter_mut() {
            cache.spec_round_rollback(pending.len() + drafts_kept)?;
        }
        self.held.extend_from_slice(&pending);
        self.held.extend_from_slice(&drafted[..drafts_kept]);
        Ok(())
    }

    fn fork(&self) -> Box<dyn DraftMethod> {
        Box::new(DraftModel {
            model: Rc::clone(&self.model),
            identity: self.identity.clone(),
            caches: Vec::new(),
            held: Vec::new(),
            round: None,
            prefill_step: self.prefill_step,
        })
    }

    fn checkpoint(&mut self, tokens: &[u32]) -> Result<Option<Attachment>> {
        self.close_round(tokens)?;
        if self.identity.is_empty() || self.caches.is_empty() {
            return Ok(None);
        }
        // The caches may hold the reply as generated where the checkpoint holds it
        // re-rendered: keep the shared prefix (the next generation computes the rest).
        let shared = common_prefix(&self.held, tokens);
        if shared == 0 || !self.cut_to(shared)? {
            return Ok(None);
        }
        let mut attachment = Attachment { schema: SCHEMA.into(), ..Attachment::default() };
        crate::kv_file::save_stack(
            &self.caches,
            "layer.",
            &mut attachment.tensors,
            &mut attachment.metadata,
        )?;
        attachment.metadata.insert("model".into(), self.identity.clone());
        attachment.metadata.insert("token_count".into(), shared.to_string());
        Ok(Some(attachment))
    }

    fn resume(&mut self, attachments: &[Attachment], tokens: &[u32]) -> Result<()> {
        let Some(found) = attachments.iter().find(|a| a.schema == SCHEMA) else {
            return Ok(());
        };
        let count = found.metadata.get("token_count").and_then(|n| n.parse::<usize>().ok());
        let Some(count) = count.filter(|&n| n > 0 && n <= tokens.len()) else {
            return Ok(());
        };
        if found.metadata.get("model") != Some(&self.identity)
            || self.identity.is_empty()
            || (self.round.is_none()
                && common_prefix(&self.held, tokens) >= count
                && !self.caches.is_empty())
        {
            // Another draft model's, or no better than what the caches hold already.
            return Ok(());
        }
        let mut caches = self.model.fresh_caches()?;
        let restored =
            crate::kv_file::restore_stack(&mut caches, "layer.", &found.tensors, &found.metadata);
        match restored {
            Ok(()) if caches.iter().all(|c| c.offset() == count) => {
                self.caches = caches;
                self.held = tokens[..count].to_vec();
                self.round = None;
            }
            // The next start computes the conversation instead.
            Ok(()) => tracing::warn!("a draft attachment whose caches disagree on the offset"),
            Err(e) => tracing::warn!("a draft attachment that does not restore: {e}"),
        }
        Ok(())
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
