//! The Qwen3.5 text decoder: gated DeltaNet layers with every `full_attention_interval`-th
//! layer gated full attention, a dense MLP or routed experts after each, and the head.

use std::cell::RefCell;

use mlx::Array;
use serde_json::Value;

use super::config::TextConfig;
use super::layers::{Append, Attention, DeltaNet, Mlp, Moe, NormLoader, wrong_cache};
use crate::backend::Ops;
use crate::cache::{Cache, CachePlan, KvShape, Storage};
use crate::checkpoint::{ModelDir, Weights};
use crate::error::{Error, Result};
use crate::models::{Model, Phase, RecurrentMtpRows, Rows};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::options::LoadOptions;

#[derive(Debug, Clone)]
enum Mixer {
    Attention(Attention),
    Delta(DeltaNet),
}

#[derive(Debug, Clone)]
enum Feedforward {
    Dense(Mlp),
    Experts(Box<Moe>),
}

/// One decoder layer: its mixer (gated attention or gated DeltaNet), then its feedforward.
#[derive(Debug, Clone)]
pub(super) struct Layer {
    mixer: Mixer,
    feedforward: Feedforward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl Layer {
    /// Layer `p` (its tensors' prefix, e.g. `layers.3.`) of `config`: gated DeltaNet when
    /// `linear`, else gated attention.
    pub(super) fn load(
        w: &Weights<'_>,
        config: &TextConfig,
        p: &str,
        linear: bool,
        norms: NormLoader,
    ) -> Result<Layer> {
        let h = config.hidden_size;
        let mixer = if linear {
            Mixer::Delta(DeltaNet::load(w, config, &format!("{p}linear_attn."), norms.hf_layout)?)
        } else {
            Mixer::Attention(Attention::load(w, config, &format!("{p}self_attn."), &norms)?)
        };
        let feedforward = if config.is_moe() {
            Feedforward::Experts(Box::new(Moe::load(w, config, &format!("{p}mlp."))?))
        } else {
            Feedforward::Dense(Mlp::load(w, &format!("{p}mlp."), h, config.intermediate_size)?)
        };
        Ok(Layer {
            mixer,
            feedforward,
            input_layernorm: norms.offset(w, &format!("{p}input_layernorm.weight"), h)?,
            post_attention_layernorm: norms.offset(
                w,
                &format!("{p}post_attention_layernorm.weight"),
                h,
            )?,
        })
    }

    /// `h` through the layer, appending to its `cache` (layer `i`, for messages) with `append`.
    pub(super) fn forward(
        &self,
        i: usize,
        h: &Array,
        cache: &mut dyn Cache,
        append: Append,
        ops: &Ops,
    ) -> Result<Array> {
        let normed = self.input_layernorm.forward(h)?;
        let signature = cache.signature();
        let mixed = match &self.mixer {
            Mixer::Attention(attention) => {
                let cache = cache
                    .as_attention_mut()
                    .ok_or_else(|| wrong_cache(i, "full attention", &signature))?;
                attention.forward(&normed, cache, append, ops)?
            }
            Mixer::Delta(delta) => {
                let cache = cache
                    .as_gated_delta_mut()
                    .ok_or_else(|| wrong_cache(i, "gated DeltaNet", &signature))?;
                delta.forward(&normed, cache, append, ops)?
            }
        };
        let h = h.add(&mixed)?;
        let normed = self.post_attention_layernorm.forward(&h)?;
        let out = match &self.feedforward {
            Feedforward::Dense(mlp) => mlp.forward(&normed, ops)?,
            Feedforward::Experts(moe) => moe.forward(&normed, ops)?,
        };
        Ok(h.add(&out)?)
    }

    /// The storage and geometry of its cache.
    pub(super) fn storage(&self, dtype_bytes: usize) -> (Storage, KvShape) {
        match &self.mixer {
            Mixer::Delta(delta) => (
                Storage::gated_delta(delta.shape),
                KvShape { kv_heads: 0, head_dim: 0, dtype_bytes },
            ),
            Mixer::Attention(attention) => (
                Storage::plain(),
                KvShape {
                    kv_heads: attention.kv_heads() as usize,
                    head_dim: attention.head_dim as usize,
                    dtype_bytes,
                },
            ),
        }
    }
}

/// Qwen3.5 (dense and MoE), text path.
#[derive(Debug)]
pub struct Qwen35Text {
    config: TextConfig,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    ops: Ops,
    /// The final-normed hidden rows of every forward pass since a drafter last took them, each
    /// with its first row's position, while one keeps them (`None`: not kept).
    kept_hidden: RefCell<Option<Vec<(usize, Array)>>>,
}

impl Qwen35Text {
    /// Builds the model from an opened checkpoint: the mlx-community layout
    /// (`language_model.model.*`, `language_model.lm_head`) or Hugging Face's
    /// (`model.language_model.*`, `lm_head`; norms stored as `w − 1`, the convolution as
    /// `[C, 1, K]`).
    pub fn load(dir: &ModelDir, options: &LoadOptions) -> Result<Qwen35Text> {
        let config = TextConfig::from_checkpoint_config(&dir.config)?;
        let ops = Ops::new(&options.kernels);
        let (model_prefix, head_prefix) =
            ["language_model.model.", "model.language_model.", "model."]
                .into_iter()
                .find(|p| dir.tensors.contains_key(&format!("{p}embed_tokens.weight")))
                .map(|p| {
                    let head = if p == "language_model.model." { "language_model." } else { "" };
                    (p, head)
                })
                .ok_or_else(|| Error::MissingTensor {
                    name: "language_model.model.embed_tokens.weight".into(),
                    dir: dir.path.clone(),
                })?;
        let w = dir.weights(model_prefix)?;
        let hf_layout = hf_layout(dir, &config);
        let norms = NormLoader { hf_layout, eps: config.rms_norm_eps };
        let h = config.hidden_size;
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::load(&w, &config, &format!("layers.{i}."), config.is_linear(i), norms))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            let head = dir.weights(head_prefix)?;
            Some(Linear::new(head.matrix("lm_head", config.vocab_size, h)?))
        };
        Ok(Qwen35Text {
            embed_tokens: Embedding::new(w.matrix("embed_tokens", config.vocab_size, h)?),
            norm: norms.offset(&w, "norm.weight", h)?,
            layers,
            lm_head,
            ops,
            config,
            kept_hidden: RefCell::new(None),
        })
    }

    /// The config it was built from.
    pub fn config(&self) -> &TextConfig {
        &self.config
    }

    fn head(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h, &self.ops),
            None => self.embed_tokens.as_linear(h, &self.ops),
        }
    }

    fn dtype_bytes(&self) -> usize {
        self.norm.weight().map_or(4, |w| w.dtype().size())
    }
}

/// Whether the checkpoint is in Hugging Face's layout: its convolution kernels are stored
/// `[C, 1, K]` (mlx-lm's own test for its sanitize).
fn hf_layout(dir: &ModelDir, config: &TextConfig) -> bool {
    dir.tensors.iter().any(|(name, t)| {
        name.ends_with("conv1d.weight")
            && t.dim(-1).ok() != Some(1)
            && config.linear_conv_kernel_dim != 1
    })
}

impl Model for Qwen35Text {
    fn ops(&self) -> &Ops {
        &self.ops
    }

    fn cache_plan(&self) -> CachePlan {
        let dtype_bytes = self.dtype_bytes();
        let (storages, shapes) = self.layers.iter().map(|layer| layer.storage(dtype_bytes)).unzip();
        CachePlan::new(storages, shapes)
    }

    fn new_caches(&self, plan: &CachePlan) -> Result<Vec<Box<dyn Cache>>> {
        plan.build(&self.ops, self.layers.len())
    }

    fn forward_rows(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase,
        rows: Rows,
    ) -> Result<Array> {
        if caches.len() != self.layers.len() {
            return Err(Error::InvalidRequest(format!(
                "Qwen3.5 needs {} caches, got {}",
                self.layers.len(),
                caches.len()
            )));
        }
        let append = match phase {
            Phase::Window => Append::Window,
            Phase::Decode => Append::Decode,
        };
        let ops = &self.ops;
        let position = crate::cache::stack_offset(caches);
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            h = layer.forward(i, &h, cache.as_mut(), append, ops)?;
        }
        // Passes that return every row (decode steps, verify windows, a prompt's last token)
        // keep them for a multi-token-prediction head; prefill chunks, which return only
        // their last row, keep none (the head starts from the prompt's last token).
        let kept = rows == Rows::All && self.kept_hidden.borrow().is_some();
        if kept {
            // The norm is row by row: norming every row, then slicing, is the same.
            let normed = self.norm.forward(&h)?;
            if let Some(rows) = self.kept_hidden.borrow_mut().as_mut() {
                rows.push((position, normed.clone()));
            }
            h = normed;
        }
        if rows == Rows::Last && h.dim(1)? > 1 {
            let s = h.shape();
            h = h.slice(&[0, s[1] - 1, 0], &s, &[1, 1, 1])?;
        }
        let h = if kept { h } else { self.norm.forward(&h)? };
        self.head(&h)
    }

    fn decode_weight_bytes(&self) -> usize {
        0
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size as usize
    }

    fn max_context(&self) -> usize {
        self.config.max_position_embeddings
    }

    fn recurrent_mtp(&self) -> Option<&dyn RecurrentMtpRows> {
        Some(self)
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        match &self.config.eos_token_id {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(items)) => {
                items.iter().filter_map(Value::as_u64).map(|v| v as u32).collect()
            }
            _ => Vec::new(),
        }
    }
}

impl RecurrentMtpRows for Qwen35Text {
    fn hidden_size(&self) -> usize {
        self.config.hidden_size as usize
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        self.embed_tokens.forward(ids)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        self.head(hidden)
    }

    fn keep_hidden(&self, on: bool) {
        *self.kept_hidden.borrow_mut() = on.then(Vec::new);
    }

    fn take_hidden(&self) -> Vec<(usize, Array)> {
        self.kept_hidden.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default()
    }
}
