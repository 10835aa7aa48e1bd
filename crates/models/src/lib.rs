//! Models: the [`Model`] trait every family implements, what a forward pass appends with
//! ([`Phase`]) and returns ([`Rows`]), and the ports a model offers draft methods
//! ([`TargetPort`], [`DraftMethod`]). Each family is one folder (`gemma4/`) and one entry in
//! [`registry`].
//!
//! Beside the families: model folders read strictly ([`checkpoint`]: every tensor read or
//! dropped for a named reason), the layers they share ([`nn`]), the vision trait and image
//! decoding ([`vision`]), and how a model is loaded ([`LoadOptions`]). The crate builds on the
//! cache stack (`cache`) and knows no turn, batch or tokenizer: the `engine` crate drives it.

#![deny(missing_docs)]

pub mod checkpoint;
pub mod gemma3;
pub mod gemma4;
pub mod nn;
mod options;
pub mod qwen3_5;
pub mod registry;
pub mod tokens;
pub mod vision;

pub use options::LoadOptions;

use mlx::Array;

use crate::vision::Vision;
use cache::backend::Ops;
use cache::compiled::DecodeGraphs;
use cache::kv_file::Attachment;
use cache::{AttentionCache, AttentionRead, Cache, CachePlan, GatedDeltaCache, GatedDeltaLayer};
use cache::{Error, Result};

/// Which cache phase a forward pass appends with: the name of the cache method every layer
/// calls ([`Phase::append`], [`Phase::recur`]). The caller names it; nothing infers it from a
/// length, a shape or a mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase<'a> {
    /// Several new positions, causal among themselves (prefill chunks, verify windows).
    Window,
    /// Exactly one new position.
    Decode,
    /// Decided positions (a drafter replaying what a round kept), causal among themselves,
    /// each read with a one-position read's arithmetic: bit for bit what as many decode steps
    /// give ([`cache::CommittedAttentionCache`]).
    Committed,
    /// A window whose runs of flagged positions (one flag per new position: image blocks) see
    /// each other in both directions (Gemma 4's image prompts,
    /// [`cache::BidirectionalAttentionCache`]).
    Bidirectional(&'a [bool]),
}

impl Phase<'_> {
    /// Appends `keys`/`values` `[B, Hkv, L, D]` to `cache` with this phase's method: the read
    /// of what the new positions see. A storage without the method refuses, named.
    pub fn append(
        self,
        cache: &mut dyn AttentionCache,
        keys: &Array,
        values: &Array,
    ) -> Result<AttentionRead> {
        let lacks = |cache: &dyn AttentionCache, what: &str| {
            Error::InvalidRequest(format!(
                "{what} need a storage that has them, not {}",
                cache.signature()
            ))
        };
        match self {
            Phase::Window => cache.append_window(keys, values),
            Phase::Decode => cache.append_decode(keys, values),
            Phase::Committed => match cache.committed() {
                Some(committed) => committed.append_committed(keys, values),
                None => Err(lacks(cache, "committed spans")),
            },
            Phase::Bidirectional(flags) => match cache.bidirectional() {
                Some(both_ways) => both_ways.append_bidirectional(keys, values, flags),
                None => Err(lacks(cache, "images' bidirectional reads")),
            },
        }
    }

    /// Runs gated DeltaNet's recurrence over `S` new positions (`qkv` `[B, S, ·]`, `a`, `b`
    /// `[B, S, Hv]`) with this phase's method: the recurrence's `[B, S, Hv, Dv]`. A committed
    /// span runs one decode step per position; a bidirectional window is refused (the
    /// recurrence reads in order).
    pub fn recur(
        self,
        cache: &mut dyn GatedDeltaCache,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        match self {
            Phase::Window => cache.recur_window(qkv, a, b, layer),
            Phase::Decode => cache.recur_decode(qkv, a, b, layer),
            Phase::Committed => {
                let at = |x: &Array, i: i32| -> Result<Array> {
                    let mut start = vec![0; x.ndim()];
                    let mut stop = x.shape();
                    start[1] = i;
                    stop[1] = i + 1;
                    Ok(x.slice(&start, &stop, &vec![1; start.len()])?)
                };
                let steps = (0..qkv.dim(1)?)
                    .map(|i| cache.recur_decode(&at(qkv, i)?, &at(a, i)?, &at(b, i)?, layer))
                    .collect::<Result<Vec<_>>>()?;
                Ok(mlx::ops::concatenate(&steps.iter().collect::<Vec<_>>(), 1)?)
            }
            Phase::Bidirectional(_) => Err(Error::InvalidRequest(
                "a gated DeltaNet recurrence reads in order: it has no bidirectional window".into(),
            )),
        }
    }
}

/// Which rows of logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every position (`[B, T, V]`).
    All,
    /// Only the last position (`[B, 1, V]`): prefill needs nothing else, and rows that feed no
    /// cache are dropped early (before KV-sharing layers and the head).
    Last,
    /// No logits: the final-normed hidden state `[B, T, H]` of every position, for a caller
    /// that takes only some positions to the head ([`Model::logits`]): a verify window whose
    /// rows propose drafts of different lengths reads the head only at its own positions.
    Hidden,
}

/// A causal language model over the cache stack.
pub trait Model: std::fmt::Debug {
    /// The op routes its passes and caches run (chosen at load).
    fn ops(&self) -> &Ops;
    /// Per layer that keeps state, the storage its caches use: the family's rule over its
    /// config (KV-sharing layers keep none, so this can be shorter than the layer list).
    fn cache_plan(&self) -> CachePlan;
    /// Fresh caches for one sequence, one per layer of `plan` (refused when the plan does not
    /// fit the model).
    fn new_caches(&self, plan: &CachePlan) -> Result<Vec<Box<dyn Cache>>>;
    /// Fresh caches under the model's own [`Model::cache_plan`].
    fn fresh_caches(&self) -> Result<Vec<Box<dyn Cache>>> {
        self.new_caches(&self.cache_plan())
    }
    /// Logits `[B, T, vocab]` for token ids `[B, T]` appended to `caches` with `phase`.
    fn forward(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase,
    ) -> Result<Array> {
        self.forward_rows(tokens, caches, phase, Rows::All)
    }
    /// One decode step: logits `[B, 1, vocab]` for `tokens` `[B, 1]` appended to `caches` (one
    /// sequence's, or a batch's rows). A model with a compiled step ([`cache::compiled`]) runs
    /// it here when it can; the result is the same as [`Model::forward`] with
    /// [`Phase::Decode`].
    fn forward_decode(&self, tokens: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array> {
        self.forward(tokens, caches, Phase::Decode)
    }
    /// The model's compiled decode graphs (to read their counters), when it has a compiled
    /// step.
    fn decode_graphs(&self) -> Option<&DecodeGraphs> {
        None
    }
    /// [`Model::forward`] returning only `rows` of logits (or, for [`Rows::Hidden`], the
    /// final-normed hidden state instead).
    fn forward_rows(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase,
        rows: Rows,
    ) -> Result<Array>;
    /// The model's vision tower, preprocessing and image tokens, when it takes images.
    fn vision(&self) -> Option<&dyn Vision> {
        None
    }
    /// Logits for a prompt whose image-token positions take the given image features (in
    /// order, each from [`Vision::encode`]: `[n_i, hidden]`, or `[rows, cols, hidden]` for a
    /// model that places soft tokens on the image's grid), appended as one window with the
    /// model's image-block attention rule.
    fn forward_multimodal(
        &self,
        tokens: &[u32],
        images: &[Array],
        caches: &mut [Box<dyn Cache>],
        rows: Rows,
    ) -> Result<Array> {
        let _ = (tokens, images, caches, rows);
        Err(Error::InvalidRequest("this model does not take images".into()))
    }
    /// Weight bytes one decode step reads (every matrix a token passes through and the output
    /// head; embedding tables give one row and are left out), for a bandwidth roofline. 0 when
    /// the model does not say.
    fn decode_weight_bytes(&self) -> usize {
        0
    }
    /// Logits `[…, vocab]` of final-normed hidden rows `[…, H]` (what a pass with
    /// [`Rows::Hidden`] returns, or any rows taken from it): the output head and whatever
    /// the family applies after it, exactly as a pass returning logits applies them.
    fn logits(&self, hidden: &Array) -> Result<Array>;
    /// Vocabulary size of the output head.
    fn vocab_size(&self) -> usize;
    /// Longest sequence the model supports.
    fn max_context(&self) -> usize;
    /// Token ids that end a reply according to the config (`eos_token_id`).
    fn eos_token_ids(&self) -> Vec<u32>;
    /// The final-normed hidden state `[B, T, H]` of the rows the last forward pass returned
    /// logits for (every row, or the last: [`Rows`]), on a model whose ports lend it to
    /// drafters ([`TargetPort::AssistantRows`], [`TargetPort::RecurrentMtp`]); `None` on
    /// others, and before any pass.
    fn last_hidden(&self) -> Option<Array> {
        None
    }
    /// The Gemma 4 assistant's port, when this model provides it.
    fn assistant_rows(&self) -> Option<&dyn AssistantRows> {
        None
    }
    /// The port a recurrent multi-token-prediction head reads, when this model provides it.
    fn recurrent_mtp(&self) -> Option<&dyn RecurrentMtpRows> {
        None
    }
    /// Whether this model provides a port draft methods read.
    fn provides(&self, port: TargetPort) -> bool {
        match port {
            TargetPort::AssistantRows => self.assistant_rows().is_some(),
            TargetPort::RecurrentMtp => self.recurrent_mtp().is_some(),
            TargetPort::HiddenLayerTaps => false,
        }
    }
}

/// What a draft method may read from the target's live state (the upstream seed's
/// `TargetView` ports). A method names the ports it reads and is refused before it allocates
/// anything when the target lacks one ([`target_lacks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetPort {
    /// The Gemma 4 assistant's reads: the target's embedding, its last donor reads per layer
    /// type, and its final hidden state.
    AssistantRows,
    /// Hidden states of chosen target layers and the embedding/head projection.
    HiddenLayerTaps,
    /// The final hidden layer, the embedding and the head of a recurrent MTP head.
    RecurrentMtp,
}

impl TargetPort {
    /// The port's name as the seed spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TargetPort::AssistantRows => "assistantRows",
            TargetPort::HiddenLayerTaps => "hiddenLayerTaps",
            TargetPort::RecurrentMtp => "recurrentMtp",
        }
    }
}

/// The refusal for a target that does not provide a port a method reads.
pub fn target_lacks(port: TargetPort) -> Error {
    Error::InvalidRequest(format!("the target model does not provide {}", port.as_str()))
}

/// What the target's last sliding and last full attention layers attend, lent as reads (the
/// seed's donor attention): every stored position, no mask. Either is absent when the target
/// has no layer of that type.
#[derive(Debug, Clone, Default)]
pub struct DonorReads {
    /// The last sliding-window layer's.
    pub sliding: Option<AttentionRead>,
    /// The last full-attention layer's.
    pub full: Option<AttentionRead>,
}

/// The [`TargetPort::AssistantRows`] port: what the Gemma 4 assistant reads from its target.
pub trait AssistantRows {
    /// The target's residual width.
    fn hidden_size(&self) -> usize;
    /// Head dimensions of the target's sliding and full attention layers.
    fn head_dims(&self) -> (i32, i32);
    /// The target's input embedding of `ids` `[B, T]`, scaled as the target scales it.
    fn embed(&self, ids: &Array) -> Result<Array>;
    /// Reads of every stored position of row `row` of the last layer of each type (its
    /// donor's cache), from `caches`: a single sequence's (row 0) or a batch's layers.
    fn donor_reads(&self, caches: &[Box<dyn Cache>], row: usize) -> Result<DonorReads>;
}

/// The [`TargetPort::RecurrentMtp`] port: what a recurrent multi-token-prediction head (Qwen3.5's
/// MTP) reads from its target: the embedding and the output head (the hidden state of every
/// position the target computes comes with each pass: [`Target::hidden`]).
pub trait RecurrentMtpRows {
    /// The target's residual width.
    fn hidden_size(&self) -> usize;
    /// The target's input embedding of `ids` `[B, T]`.
    fn embed(&self, ids: &Array) -> Result<Array>;
    /// The target's output head over final-normed hidden states.
    fn logits(&self, hidden: &Array) -> Result<Array>;
}

/// The target as a method drafting for one of its rows sees it: its caches hold every
/// conversation token of the row but the bonus.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// The target model.
    pub model: &'a dyn Model,
    /// The caches the row lives in: a single sequence's, or a batch's layers.
    pub caches: &'a [Box<dyn Cache>],
    /// The row's index in them (0 for a single sequence).
    pub row: usize,
    /// The target's final-normed hidden states of the row's positions in its last forward
    /// pass, `[1, T, H]`, with the position of the first; given after each pass (the prompt's
    /// last one to [`DraftMethod::start`], each step's to [`DraftMethod::settle`]) to a method
    /// that reads a port, `None` otherwise.
    pub hidden: Option<(usize, &'a Array)>,
}

impl Target<'_> {
    /// Positions the row's caches hold.
    pub fn offset(&self) -> usize {
        cache::stack_row_offset(self.caches, self.row)
    }

    /// [`Target::hidden`], or the refusal of a method that needs it.
    pub fn hidden(&self) -> Result<(usize, &Array)> {
        self.hidden.ok_or_else(|| {
            Error::InvalidRequest("the target has run no forward pass to draft from".into())
        })
    }
}

/// A source of draft tokens.
pub trait DraftMethod: std::fmt::Debug {
    /// `draft`, `lookup`, `assistant`.
    fn name(&self) -> &'static str;
    /// The target ports this method reads.
    fn ports(&self) -> &'static [TargetPort] {
        &[]
    }
    /// Checks that the method can serve `target` (its ports, its vocabulary), before any
    /// draft-side allocation.
    fn bind(&mut self, target: &dyn Model) -> Result<()>;
    /// A new generation: `context` is every token the target's caches hold after the prompt's
    /// prefill (the whole conversation so far), the target's hidden state that of the
    /// prompt's last position. Returns how many of those tokens the method computed (a draft
    /// model's prefill of what its caches lacked; 0 for a method that keeps no state of the
    /// conversation).
    fn start(&mut self, target: Target<'_>, context: &[u32]) -> Result<usize>;
    /// Up to `max` tokens to follow `context` (the conversation so far), whose last token (the
    /// bonus) the target has not appended yet. Fewer, or none, when the method has nothing
    /// worth verifying.
    fn propose(&mut self, target: Target<'_>, context: &[u32], max: usize) -> Result<Vec<u32>>;
    /// Whether the method expects to propose once the token after `context` is known: a
    /// batch asks before it reads a token a pipelined step sampled ahead, so that a step no
    /// row drafts in is built without waiting for it. `false` gives up that step's drafts;
    /// the default, `true`, reads the token first.
    fn drafts_after_unread(&self, _context: &[u32]) -> bool {
        true
    }
    /// After each forward pass of the target over the row, a round (its verify window
    /// appended and rolled back to what it kept) or a plain decode step: the target kept the
    /// first `accepted` drafts, and the pass's row `accepted` produced the next bonus.
    fn settle(&mut self, target: Target<'_>, accepted: usize) -> Result<()>;
    /// After a generation: the method's state to keep with the target's checkpoint at
    /// `tokens` (the conversation as the next turn's prompt starts: what this generation saw,
    /// its reply possibly re-rendered). `None` when it keeps nothing worth saving.
    fn checkpoint(&mut self, _tokens: &[u32]) -> Result<Option<Attachment>> {
        Ok(None)
    }
    /// Before a generation that resumes from a checkpoint holding `tokens`: that
    /// checkpoint's attachments. A method takes state it wrote and can use, so that
    /// [`DraftMethod::start`] computes only what it lacks, and ignores the rest.
    fn resume(&mut self, _attachments: &[Attachment], _tokens: &[u32]) -> Result<()> {
        Ok(())
    }
    /// The same drafter with state of its own, for another conversation decoding at the same
    /// time (a row of the engine's batch): what it loaded (a draft model's weights) is
    /// shared, its conversation state starts empty.
    fn fork(&self) -> Box<dyn DraftMethod>;
}
