//! Qwen3.5's multi-token-prediction head as a drafter (`qwen3_5_mtp`, as mlx-vlm 0.7.10's
//! splitter writes it from a checkpoint's `mtp.*` tensors): for the target position `p` it
//! reads the embedding of token `p + 1` and the target's final-normed hidden state at `p`,
//! joins them (`fc` over the two normed halves), runs its own decoder layer (gated attention
//! over its own KV cache, then the MLP or experts) and predicts token `p + 2` through the
//! target's head.
//!
//! Rounds follow mlx-vlm's `Qwen3_5MTPDraftModel`: a generation starts the head from the
//! target's pass over the prompt's last token (the bonus with that token's hidden state, at
//! the head's position 0; mlx-vlm's prefill keeps no earlier hidden state). The first draft
//! of a round comes from the
//! pass that caught up with the target (the last pair is the bonus token with the target's
//! hidden state before it); each further draft feeds the previous draft with the head's own
//! output as a stand-in for the target's hidden state, appending that position. After the
//! target verifies, the stand-in positions of accepted drafts stay; the rest are trimmed, and
//! the next round first appends the positions the target computed, with its hidden states.
//! Drafts are greedy (the target's own pick decides what is kept, so a reply is the one plain
//! decoding gives whatever the drafts).

use mlx::{Array, ops};
use serde_json::Value;

use super::config::TextConfig;
use super::layers::{NormLoader, RopeAt};
use super::text::Layer;
use crate::checkpoint::ModelDir;
use crate::nn::{Linear, RmsNorm};
use crate::options::LoadOptions;
use crate::{DraftMethod, Phase, RecurrentMtpRows, Target, TargetPort, target_lacks};
use cache::backend::Ops;
use cache::{Cache, CachePlan, KvShape, Storage};
use cache::{Error, Result};

/// The drafter.
#[derive(Debug)]
pub struct Qwen35Mtp {
    fc: Linear,
    pre_fc_norm_embedding: RmsNorm,
    pre_fc_norm_hidden: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
    ops: Ops,
    hidden_size: usize,
    /// One cache per layer; its offset counts the pairs appended.
    caches: Vec<Box<dyn Cache>>,
    /// The target position of the caches' first pair.
    base: usize,
    /// The target's hidden rows not yet read, each with its first position.
    rows: Vec<(usize, Array)>,
    /// The open round: stand-in pairs appended while drafting.
    drafted: Option<usize>,
}

/// The registry's loader for `qwen3_5_mtp` drafters.
pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Box<dyn DraftMethod>> {
    Ok(Box::new(Qwen35Mtp::load(dir, options)?))
}

impl Qwen35Mtp {
    /// Loads a drafter folder: `config.json` with the target's `text_config` (and its
    /// `mtp_num_hidden_layers`), its tensors at the top level (mlx-vlm's split) or under `mtp.`
    /// (a Hugging Face checkpoint's, whose (1 + w) norms are stored as w − 1).
    pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Qwen35Mtp> {
        let config = TextConfig::from_checkpoint_config(&dir.config)?;
        let depth = dir
            .config
            .get("text_config")
            .and_then(|t| t.get("mtp_num_hidden_layers"))
            .and_then(Value::as_u64)
            .unwrap_or(1) as usize;
        let hf_layout = !dir.contains("fc.weight");
        let prefix = if hf_layout { "mtp." } else { "" };
        let w = dir.weights(prefix)?;
        let norms = NormLoader { hf_layout, eps: config.rms_norm_eps };
        let h = config.hidden_size;
        let layers = (0..depth)
            .map(|i| Layer::load(&w, &config, &format!("layers.{i}."), false, norms))
            .collect::<Result<Vec<_>>>()?;
        if layers.is_empty() {
            return Err(Error::Unsupported {
                key: "mtp_num_hidden_layers".into(),
                value: "0".into(),
                reason: "at least one layer".into(),
            });
        }
        Ok(Qwen35Mtp {
            fc: Linear::new(w.matrix("fc", h, 2 * h)?),
            pre_fc_norm_embedding: norms.offset(&w, "pre_fc_norm_embedding.weight", h)?,
            pre_fc_norm_hidden: norms.offset(&w, "pre_fc_norm_hidden.weight", h)?,
            norm: norms.offset(&w, "norm.weight", h)?,
            layers,
            ops: Ops::new(&options.kernels),
            hidden_size: h as usize,
            caches: Vec::new(),
            base: 0,
            rows: Vec::new(),
            drafted: None,
        })
    }

    /// Target positions the caches cover.
    fn covered(&self) -> usize {
        self.base + self.caches.first().map_or(0, |c| c.offset())
    }

    fn reset(&mut self, base: usize) -> Result<()> {
        let dtype_bytes = self.norm.weight().map_or(4, |w| w.dtype().size());
        let (storages, shapes): (Vec<Storage>, Vec<KvShape>) =
            self.layers.iter().map(|l| l.storage(dtype_bytes)).unzip();
        self.caches = CachePlan::new(storages, shapes).build(&self.ops, self.layers.len())?;
        self.base = base;
        self.drafted = None;
        Ok(())
    }

    /// The head's final-normed output `[1, T, H]` for the pairs (`tokens`, `hidden`), appended
    /// to its caches in `phase`: the positions a round decided are a committed span (each read
    /// as one query reads: the arithmetic of a draft step, and of mlx-vlm's head replaying one
    /// position), a draft step a decode step.
    fn forward(
        &mut self,
        port: &dyn RecurrentMtpRows,
        tokens: &[u32],
        hidden: &Array,
        phase: Phase<'_>,
    ) -> Result<Array> {
        let ids = crate::tokens::ids(tokens)?;
        let embedded = self.pre_fc_norm_embedding.forward(&port.embed(&ids)?)?;
        let joined = ops::concatenate(&[&embedded, &self.pre_fc_norm_hidden.forward(hidden)?], -1)?;
        let mut h = self.fc.forward(&joined, &self.ops)?;
        for (i, (layer, cache)) in self.layers.iter().zip(self.caches.iter_mut()).enumerate() {
            // The head's own positions: its cache's offset (as mlx-vlm's drafter rotates).
            let start = RopeAt::Start(cache.offset() as i32);
            h = layer.forward(i, &h, cache.as_mut(), phase, start, &self.ops)?;
        }
        self.norm.forward(&h)
    }

    /// The target's hidden rows for positions `from..to` (the latest pass over each), or
    /// `None` when one is missing.
    fn hidden_rows(&self, from: usize, to: usize) -> Result<Option<Array>> {
        let mut parts = Vec::new();
        let mut at = from;
        while at < to {
            let Some((start, rows)) =
                self.rows.iter().rev().find(|(s, r)| *s <= at && at < end_of(*s, r))
            else {
                return Ok(None);
            };
            let end = end_of(*start, rows).min(to);
            let s = rows.shape();
            let (a, b) = ((at - start) as i32, (end - start) as i32);
            parts.push(rows.slice(&[0, a, 0], &[s[0], b, s[2]], &[1, 1, 1])?);
            at = end;
        }
        let parts: Vec<&Array> = parts.iter().collect();
        Ok(Some(if parts.len() == 1 { parts[0].clone() } else { ops::concatenate(&parts, 1)? }))
    }

    /// Where the newest kept rows that reach `to` start (the target's last pass).
    fn newest_rows_before(&self, to: usize) -> usize {
        self.rows.iter().rev().find(|(s, r)| *s < to && to <= end_of(*s, r)).map_or(to, |(s, _)| *s)
    }

    fn greedy(port: &dyn RecurrentMtpRows, h: &Array) -> Result<u32> {
        let logits = port.logits(h)?;
        let v = logits.dim(-1)?;
        Ok(logits
            .reshape(&[-1, v])?
            .argmax(-1, false)?
            .to_vec::<u32>()?
            .last()
            .copied()
            .unwrap_or(0))
    }

    fn last_row(h: &Array) -> Result<Array> {
        let s = h.shape();
        Ok(h.slice(&[0, s[1] - 1, 0], &s, &[1, 1, 1])?)
    }
}

/// The position after the last of `rows` `[B, T, H]` kept from `start`.
fn end_of(start: usize, rows: &Array) -> usize {
    start + rows.dim(1).unwrap_or(0) as usize
}

fn port<'a>(target: &Target<'a>) -> Result<&'a dyn RecurrentMtpRows> {
    target.model.recurrent_mtp().ok_or_else(|| target_lacks(TargetPort::RecurrentMtp))
}

impl DraftMethod for Qwen35Mtp {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn ports(&self) -> &'static [TargetPort] {
        &[TargetPort::RecurrentMtp]
    }

    fn bind(&mut self, target: &dyn crate::Model) -> Result<()> {
        let port = target.recurrent_mtp().ok_or_else(|| target_lacks(TargetPort::RecurrentMtp))?;
        if port.hidden_size() != self.hidden_size {
            return Err(Error::InvalidRequest(format!(
                "this MTP head reads a hidden state of {}, the target has {}",
                self.hidden_size,
                port.hidden_size()
            )));
        }
        Ok(())
    }

    fn start(&mut self, target: Target<'_>, _context: &[u32]) -> Result<usize> {
        // The head catches up when it is first asked to draft, once the bonus is known.
        let (at, hidden) = target.hidden()?;
        self.rows = vec![(at, hidden.clone())];
        self.caches.clear();
        self.drafted = None;
        Ok(0)
    }

    fn propose(&mut self, target: Target<'_>, context: &[u32], max: usize) -> Result<Vec<u32>> {
        let port = port(&target)?;
        let Some(bonus_at) = context.len().checked_sub(1) else { return Ok(Vec::new()) };
        if max == 0 || bonus_at == 0 {
            return Ok(Vec::new());
        }
        // Catch up: the pairs (token p + 1, hidden p) for the positions the caches lack, the
        // last one the bonus with the hidden state before it. A fresh head starts from the
        // target's last pass, as mlx-vlm's does (after the prompt, that is the prompt's last
        // token alone: its prefill keeps no earlier hidden state).
        let mut from = self.covered();
        if self.caches.is_empty() || self.hidden_rows(from, bonus_at)?.is_none() {
            from = self.newest_rows_before(bonus_at);
            if from >= bonus_at {
                return Ok(Vec::new());
            }
            self.reset(from)?;
        }
        let hidden = self
            .hidden_rows(from, bonus_at)?
            .ok_or_else(|| Error::InvalidRequest("the target's hidden rows are missing".into()))?;
        let h = self.forward(port, &context[from + 1..=bonus_at], &hidden, Phase::Committed)?;
        self.rows.retain(|(s, r)| end_of(*s, r) > bonus_at);
        let mut h = Self::last_row(&h)?;
        let mut token = Self::greedy(port, &h)?;
        let mut drafts = vec![token];
        while drafts.len() < max {
            h = self.forward(port, &[token], &h, Phase::Decode)?;
            token = Self::greedy(port, &h)?;
            drafts.push(token);
        }
        self.drafted = Some(drafts.len() - 1);
        Ok(drafts)
    }

    fn fork(&self) -> Box<dyn DraftMethod> {
        Box::new(Qwen35Mtp {
            fc: self.fc.clone(),
            pre_fc_norm_embedding: self.pre_fc_norm_embedding.clone(),
            pre_fc_norm_hidden: self.pre_fc_norm_hidden.clone(),
            norm: self.norm.clone(),
            layers: self.layers.clone(),
            ops: self.ops.clone(),
            hidden_size: self.hidden_size,
            caches: Vec::new(),
            base: 0,
            rows: Vec::new(),
            drafted: None,
        })
    }

    fn settle(&mut self, target: Target<'_>, accepted: usize) -> Result<()> {
        let (at, hidden) = target.hidden()?;
        // A later pass over the same positions (after a rollback) supersedes.
        self.rows.push((at, hidden.clone()));
        if let Some(drafted) = self.drafted.take() {
            let drop = drafted - accepted.min(drafted);
            for cache in &mut self.caches {
                cache.trim(drop)?;
            }
        }
        Ok(())
    }
}
