//! The Gemma 4 assistant drafter (`gemma4_assistant` checkpoints), after mlx-vlm 0.7.10
//! `speculative/drafters/gemma4_assistant`.
//!
//! A few Gemma 4 decoder layers with queries only: they attend the target's own keys and
//! values (the cache the target's last layer of each type reads), so the assistant keeps no
//! cache. Each draft step reads `[target_embed(token) ; hidden]`, projects it down
//! (`pre_projection`), runs the layers with the query rotated at one fixed position (the last
//! position in the target's cache, as mlx-vlm does: §0.5), normalizes, projects back up
//! (`post_projection`: the next step's `hidden`) and picks the next token from its own tied
//! embedding table, through the centroid-masked head when `use_ordered_embeddings` is set.
//!
//! The first round's `hidden` is the target's final-normed hidden state at the last prompt
//! position; later rounds take it at the verify row that produced the round's bonus token.
//! Every draft is greedy (acceptance compares it with the target's own pick).

use std::rc::Rc;

use mlx::{Array, Dtype, ops};
use serde::Deserialize;

use super::attention::{Context, Position, Rope};
use super::config::{Gemma4TextConfig, Variant};
use super::layer::{DecoderLayer, load_layer};
use crate::checkpoint::ModelDir;
use crate::nn::{Activations, Embedding, Linear, RmsNorm};
use crate::options::LoadOptions;
use crate::{DraftMethod, Phase, Target};
use crate::{Model, TargetPort, target_lacks};
use cache::backend::Ops;
use cache::{Error, Result};

/// The top level of a `gemma4_assistant` config.
#[derive(Debug, Clone, Deserialize)]
struct AssistantConfig {
    backbone_hidden_size: i32,
    #[serde(default)]
    use_ordered_embeddings: bool,
    #[serde(default = "default_centroids")]
    num_centroids: i32,
    #[serde(default = "default_top_k")]
    centroid_intermediate_top_k: i32,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
    /// Drafts per round plus one, as trained.
    #[serde(default = "default_block")]
    block_size: usize,
    text_config: Gemma4TextConfig,
}

fn default_centroids() -> i32 {
    2048
}
fn default_top_k() -> i32 {
    32
}
fn default_true() -> bool {
    true
}
fn default_block() -> usize {
    4
}

/// The centroid-masked head: only the tokens of the `top_k` best-scoring clusters compete.
#[derive(Debug)]
struct MaskedHead {
    centroids: Linear,
    /// `[clusters, vocab / clusters]` token ids per cluster.
    ordering: Array,
    clusters: i32,
    top_k: i32,
}

/// The Gemma 4 assistant as a draft method: its weights, shared by its forks, and the target
/// hidden state its next round starts from.
#[derive(Debug)]
pub struct Gemma4Assistant {
    w: Rc<Weights>,
    /// The target hidden state the next round starts from (`[1, 1, H_target]`).
    hidden: Option<Array>,
}

/// What an assistant checkpoint loads.
#[derive(Debug)]
struct Weights {
    config: AssistantConfig,
    embed_tokens: Embedding,
    lm_head: Option<Linear>,
    masked: Option<MaskedHead>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    pre_projection: Linear,
    post_projection: Linear,
    rope_sliding: Rope,
    rope_full: Rope,
    activations: Activations,
    ops: Ops,
}

impl Gemma4Assistant {
    /// Builds the drafter from an opened `gemma4_assistant` checkpoint directory.
    pub fn from_dir(dir: &ModelDir, options: &LoadOptions) -> Result<Gemma4Assistant> {
        let ops = Ops::new(&options.kernels);
        let stack = options.stacks_projections(ops.has_kernels());
        let model_type = dir.config.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        if model_type != "gemma4_assistant" {
            return Err(Error::Unsupported {
                key: "model_type".into(),
                value: model_type.into(),
                reason: "an assistant drafter is a gemma4_assistant checkpoint".into(),
            });
        }
        let config: AssistantConfig = serde_json::from_value(dir.config.clone())
            .map_err(|e| Error::Config { file: "config.json".into(), message: e.to_string() })?;
        let c = &config.text_config;
        if c.layer_types.len() != c.num_hidden_layers {
            return Err(Error::Config {
                file: "config.json".into(),
                message: format!(
                    "text_config.layer_types has {} entries for {} layers",
                    c.layer_types.len(),
                    c.num_hidden_layers
                ),
            });
        }
        for kind in &c.layer_types {
            if !c.rope_parameters.contains_key(kind) {
                return Err(Error::Config {
                    file: "config.json".into(),
                    message: format!("missing key `text_config.rope_parameters.{kind}`"),
                });
            }
        }
        let w = dir.weights("model.")?;
        let top = dir.weights("")?;
        let hidden = c.hidden_size;
        let embed_tokens = Embedding::new(w.matrix("embed_tokens", c.vocab_size, hidden)?);
        let layers = (0..c.num_hidden_layers)
            .map(|i| load_layer(&w, c, &Variant::GEMMA4, i, true, stack))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(w.get("norm.weight", &[hidden])?, c.rms_norm_eps);
        let backbone = config.backbone_hidden_size;
        let pre_projection = Linear::new(top.matrix("pre_projection", hidden, 2 * backbone)?);
        let post_projection = Linear::new(top.matrix("post_projection", backbone, hidden)?);
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(Linear::new(top.matrix("lm_head", c.vocab_size, hidden)?))
        };
        let masked = if config.use_ordered_embeddings {
            let clusters = config.num_centroids;
            if clusters <= 0 || c.vocab_size % clusters != 0 {
                return Err(Error::Config {
                    file: "config.json".into(),
                    message: format!(
                        "num_centroids {clusters} does not divide the vocabulary of {}",
                        c.vocab_size
                    ),
                });
            }
            let ordering = top
                .get("masked_embedding.token_ordering", &[c.vocab_size])?
                .astype(Dtype::Int32)?
                .reshape(&[clusters, c.vocab_size / clusters])?;
            Some(MaskedHead {
                centroids: Linear::new(top.matrix(
                    "masked_embedding.centroids",
                    clusters,
                    hidden,
                )?),
                ordering,
                clusters,
                top_k: config.centroid_intermediate_top_k.clamp(1, clusters),
            })
        } else {
            None
        };
        let sliding_dims = c.head_dim;
        let full_dims = c.global_head_dim.unwrap_or(c.head_dim);
        let rope_for = |kind: &str, dims: i32| -> Result<Rope> {
            let params = c
                .rope_parameters
                .get(kind)
                .or_else(|| c.rope_parameters.values().next())
                .ok_or_else(|| Error::Config {
                    file: "config.json".into(),
                    message: "text_config.rope_parameters is empty".into(),
                })?;
            Rope::new(params, dims, c.rope_traditional)
        };
        let rope_sliding = rope_for("sliding_attention", sliding_dims)?;
        let rope_full = rope_for("full_attention", full_dims)?;
        let w = Weights {
            activations: Activations::new()?,
            config,
            embed_tokens,
            lm_head,
            masked,
            layers,
            norm,
            pre_projection,
            post_projection,
            rope_sliding,
            rope_full,
            ops,
        };
        Ok(Gemma4Assistant { w: Rc::new(w), hidden: None })
    }

    /// Drafts per round the checkpoint was trained for (`block_size − 1`).
    pub fn trained_drafts(&self) -> usize {
        self.w.config.block_size.saturating_sub(1).max(1)
    }

    /// The greedy token for the assistant's normed hidden `h` `[1, 1, H]`, as `[1]` ids.
    fn pick(&self, h: &Array) -> Result<Array> {
        let Some(head) = &self.w.masked else {
            let logits = match &self.w.lm_head {
                Some(lm_head) => lm_head.forward(h, &self.w.ops)?,
                None => self.w.embed_tokens.as_linear(h, &self.w.ops)?,
            };
            return Ok(logits.reshape(&[1, -1])?.argmax(-1, false)?);
        };
        // The top-k clusters by centroid score, their tokens, and those tokens' logits.
        let scores = head.centroids.forward(h, &self.w.ops)?.reshape(&[head.clusters])?;
        let kth = head.clusters - head.top_k;
        let top = scores.argpartition(kth, -1)?.slice(&[kth], &[head.clusters], &[1])?;
        let candidates = head.ordering.take(&top, 0)?.reshape(&[-1])?; // [top_k · V/C]
        let rows = self.w.embed_tokens.forward(&candidates)?; // [top_k · V/C, H]
        let width = h.dim(-1)?;
        let logits = h.reshape(&[1, width])?.matmul(&rows.transpose(&[1, 0])?)?;
        let best = logits.argmax(-1, false)?; // [1]
        Ok(candidates.take(&best, 0)?.astype(Dtype::Uint32)?)
    }
}

impl DraftMethod for Gemma4Assistant {
    fn name(&self) -> &'static str {
        "assistant"
    }

    fn ports(&self) -> &'static [TargetPort] {
        &[TargetPort::AssistantRows]
    }

    fn bind(&mut self, target: &dyn Model) -> Result<()> {
        let rows =
            target.assistant_rows().ok_or_else(|| target_lacks(TargetPort::AssistantRows))?;
        let refuse = |message: String| Err(Error::InvalidRequest(message));
        if rows.hidden_size() != self.w.config.backbone_hidden_size as usize {
            return refuse(format!(
                "the assistant was trained for a target of width {}, this one is {}",
                self.w.config.backbone_hidden_size,
                rows.hidden_size()
            ));
        }
        if target.vocab_size() != self.w.config.text_config.vocab_size as usize {
            return refuse(format!(
                "the assistant's vocabulary of {} tokens is not the target's {}",
                self.w.config.text_config.vocab_size,
                target.vocab_size()
            ));
        }
        let (sliding, full) = rows.head_dims();
        for (i, layer) in self.w.layers.iter().enumerate() {
            let want = if layer.attention.sliding { sliding } else { full };
            if layer.attention.head_dim != want {
                return refuse(format!(
                    "assistant layer {i} has head dimension {}, the target's matching layers {want}",
                    layer.attention.head_dim
                ));
            }
        }
        Ok(())
    }

    fn start(&mut self, target: Target<'_>, _context: &[u32]) -> Result<usize> {
        // The prefill's last row: the position that produced the first bonus token. Its seed
        // (that hidden state, the bonus, the position) comes from the target's prefill, which
        // every generation runs, a resumed one included (at least one new token), so there
        // is nothing to keep with a checkpoint.
        self.hidden = None;
        self.settle_at(target, None)?;
        Ok(0)
    }

    fn fork(&self) -> Box<dyn DraftMethod> {
        Box::new(Gemma4Assistant { w: Rc::clone(&self.w), hidden: None })
    }

    fn propose(&mut self, target: Target<'_>, context: &[u32], max: usize) -> Result<Vec<u32>> {
        let rows =
            target.model.assistant_rows().ok_or_else(|| target_lacks(TargetPort::AssistantRows))?;
        let (Some(&bonus), Some(hidden)) = (context.last(), self.hidden.clone()) else {
            return Ok(Vec::new());
        };
        let held = target.offset();
        if max == 0 || held == 0 {
            return Ok(Vec::new());
        }
        // The query stays at the last position the target's caches hold (mlx-vlm's choice).
        let position = Position::at(held as i32 - 1);
        let donors = rows.donor_reads(target.caches, target.row)?;
        let (sliding, full) = (donors.sliding, donors.full);
        let ops = &self.w.ops;
        let mut token = Array::from_slice(&[bonus], &[1])?;
        let mut h_prev = hidden;
        let mut drafts = Vec::with_capacity(max);
        for _ in 0..max {
            let embedded = rows.embed(&token.reshape(&[1, 1])?)?;
            let x = ops::concatenate(&[&embedded, &h_prev.astype(embedded.dtype())?], -1)?;
            let mut h = self.w.pre_projection.forward(&x, ops)?;
            for layer in &self.w.layers {
                let (kv, rope) = if layer.attention.sliding {
                    (sliding.as_ref(), &self.w.rope_sliding)
                } else {
                    (full.as_ref(), &self.w.rope_full)
                };
                let kv = kv.ok_or_else(|| {
                    Error::InvalidRequest(
                        "the target has no layer of a type the assistant attends".into(),
                    )
                })?;
                let normed = layer.input_layernorm.forward(&h)?;
                let context = Context {
                    rope,
                    position: &position,
                    cache: None,
                    shared: Some(kv),
                    phase: Phase::Decode,
                    ops,
                };
                let (attn, _) = layer.attention.forward(&normed, 1, context)?;
                (h, _) = layer.finish(h, &attn, None, &self.w.activations, None, ops)?;
            }
            let h = self.w.norm.forward(&h)?;
            h_prev = self.w.post_projection.forward(&h, ops)?;
            token = self.pick(&h)?;
            drafts.push(token.clone());
        }
        let all = ops::concatenate(&drafts.iter().collect::<Vec<_>>(), 0)?;
        Ok(all.to_vec::<u32>()?)
    }

    fn settle(&mut self, target: Target<'_>, accepted: usize) -> Result<()> {
        self.settle_at(target, Some(accepted))
    }
}

impl Gemma4Assistant {
    /// Takes the target's final-normed hidden state at row `row` of the row's positions in
    /// its last forward pass (the last one when `None`).
    fn settle_at(&mut self, target: Target<'_>, row: Option<usize>) -> Result<()> {
        let (_, hidden) = target.hidden()?;
        let s = hidden.shape();
        let t = s[1];
        let row = row.map_or(t - 1, |r| r as i32);
        if row >= t {
            return Err(Error::InvalidRequest(format!("row {row} of a forward pass of {t} rows")));
        }
        self.hidden = Some(hidden.slice(&[0, row, 0], &[s[0], row + 1, s[2]], &[1, 1, 1])?);
        Ok(())
    }
}
