//! The Qwen3.5 text decoder: gated DeltaNet layers with every `full_attention_interval`-th
//! layer gated full attention, a dense MLP or routed experts after each, and the head.

use std::cell::RefCell;

use mlx::Array;
use serde_json::Value;

use super::config::TextConfig;
use super::layers::{Attention, DeltaNet, Mlp, Moe, NormLoader, RopeAt, wrong_cache};
use super::processor::{ImageSettings, QwenImages};
use super::vision::{QwenVision, VisionConfig};
use crate::checkpoint::{ModelDir, Weights};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::options::LoadOptions;
use crate::vision::Vision;
use crate::{Model, Phase, RecurrentMtpRows, Rows};
use cache::backend::Ops;
use cache::{Cache, CachePlan, KvShape, PositionCache, Storage};
use cache::{Error, Result};

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

    /// `h` through the layer, appending to its `cache` (layer `i`, for messages) in `phase`.
    pub(super) fn forward(
        &self,
        i: usize,
        h: &Array,
        cache: &mut dyn Cache,
        phase: Phase,
        rope_at: RopeAt<'_>,
        ops: &Ops,
    ) -> Result<Array> {
        let normed = self.input_layernorm.forward(h)?;
        let signature = cache.signature();
        let mixed = match &self.mixer {
            Mixer::Attention(attention) => {
                let cache = cache
                    .as_attention_mut()
                    .ok_or_else(|| wrong_cache(i, "full attention", &signature))?;
                attention.forward(&normed, cache, phase, rope_at, ops)?
            }
            Mixer::Delta(delta) => {
                let cache = cache
                    .as_gated_delta_mut()
                    .ok_or_else(|| wrong_cache(i, "gated DeltaNet", &signature))?;
                delta.forward(&normed, cache, phase, ops)?
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
    /// The final-normed hidden rows of the last forward pass ([`Model::last_hidden`]).
    last_hidden: RefCell<Option<Array>>,
    /// The vision tower with its preprocessing, on a checkpoint that has one. Its caches then
    /// end with a [`PositionCache`] (where positions stand after the images).
    images: Option<QwenImages>,
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
                .find(|p| dir.contains(&format!("{p}embed_tokens.weight")))
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
        let images = load_images(dir, &config, &ops)?;
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
            last_hidden: RefCell::new(None),
            images,
        })
    }

    /// The config it was built from.
    pub fn config(&self) -> &TextConfig {
        &self.config
    }

    /// The vision tower and its preprocessing, on a checkpoint that has one.
    pub fn images(&self) -> Option<&QwenImages> {
        self.images.as_ref()
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

    /// Checks the stack's length: one cache per layer, and a [`PositionCache`] after them on a
    /// model with images.
    fn check_caches(&self, caches: &[Box<dyn Cache>]) -> Result<()> {
        let expected = self.layers.len() + usize::from(self.images.is_some());
        if caches.len() != expected {
            return Err(Error::InvalidRequest(format!(
                "Qwen3.5 needs {expected} caches, got {}",
                caches.len()
            )));
        }
        Ok(())
    }

    /// The stack's position cache (on a model with images).
    fn positions<'c>(
        &self,
        caches: &'c mut [Box<dyn Cache>],
    ) -> Result<Option<&'c mut PositionCache>> {
        if self.images.is_none() {
            return Ok(None);
        }
        let last = caches.last_mut().and_then(|c| c.as_positions_mut());
        last.map(Some).ok_or_else(|| {
            Error::InvalidRequest("Qwen3.5 with images needs a position cache last".into())
        })
    }

    /// Each row's next rope position when `caches` hold a batch of rows (its offset, shifted
    /// by its images on a model with images); `None` for a single sequence.
    fn row_positions(&self, caches: &mut [Box<dyn Cache>]) -> Result<Option<Vec<i32>>> {
        let Some(offsets) = cache::stack_row_offsets(caches) else {
            return Ok(None);
        };
        if self.images.is_none() {
            return Ok(Some(offsets.iter().map(|&o| o as i32).collect()));
        }
        let rows = caches.last_mut().and_then(|c| c.as_position_rows_mut()).ok_or_else(|| {
            Error::InvalidRequest("a batch of Qwen3.5 rows with images needs position rows".into())
        })?;
        Ok(Some(rows.next_positions().iter().map(|&p| p as i32).collect()))
    }

    /// `h` `[B, T, H]` through every layer (appending in `phase`, rotated at `rope_at`), then
    /// the head over `rows`.
    fn run(
        &self,
        mut h: Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase,
        rope_at: RopeAt<'_>,
        rows: Rows,
    ) -> Result<Array> {
        let ops = &self.ops;
        for (i, (layer, cache)) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            h = layer.forward(i, &h, cache.as_mut(), phase, rope_at, ops)?;
        }
        if rows == Rows::Last && h.dim(1)? > 1 {
            let s = h.shape();
            h = h.slice(&[0, s[1] - 1, 0], &s, &[1, 1, 1])?;
        }
        let h = self.norm.forward(&h)?;
        // Kept for a multi-token-prediction head, which reads the rows it returns.
        *self.last_hidden.borrow_mut() = Some(h.clone());
        match rows {
            Rows::Hidden => Ok(h),
            Rows::All | Rows::Last => self.head(&h),
        }
    }

    /// Cosines and sines `[1, 1, T, rotary_dims]` (in `dtype`) of multimodal positions
    /// `[time, row, column]` (`T` each), as mlx-vlm's interleaved MRoPE computes them: rotary
    /// frequency `i` turns with the row position when `i % 3 == 1` and `i < 3·sections[1]`,
    /// with the column when `i % 3 == 2` and `i < 3·sections[2]`, else with time.
    fn mrope_table(&self, positions: &[Vec<i64>; 3], dtype: mlx::Dtype) -> Result<(Array, Array)> {
        let dims = self.config.rotary_dims();
        let freqs = (dims / 2) as usize;
        let sections = self.config.mrope_section();
        let axis = |i: usize| -> usize {
            if i % 3 == 1 && i < 3 * sections[1] as usize {
                1
            } else if i % 3 == 2 && i < 3 * sections[2] as usize {
                2
            } else {
                0
            }
        };
        let t = positions[0].len();
        let mut angles = Vec::with_capacity(t * freqs);
        let axes: Vec<usize> = (0..freqs).map(axis).collect();
        for (time, (row, col)) in positions[0].iter().zip(positions[1].iter().zip(&positions[2])) {
            let at = [*time, *row, *col];
            angles.extend(axes.iter().map(|&a| at[a] as f32));
        }
        // 1 / base^(arange(0, dims, 2) / dims), as mlx-vlm's compute_inv_freq.
        let exponents = mlx::ops::arange(0.0, f64::from(dims), 2.0, mlx::Dtype::Float32)?
            .divide(&Array::scalar(dims as f32)?)?;
        let inv_freq =
            Array::scalar(self.config.rope_theta() as f32)?.power(&exponents)?.reciprocal()?;
        let angles = Array::from_slice(&angles, &[t as i32, freqs as i32])?
            .multiply(&inv_freq.reshape(&[1, -1])?)?;
        let emb =
            mlx::ops::concatenate(&[&angles, &angles], -1)?.reshape(&[1, 1, t as i32, dims])?;
        Ok((emb.cos()?.astype(dtype)?, emb.sin()?.astype(dtype)?))
    }
}

/// The vision tower of a checkpoint that has one (`vision_config` and the tower's weights in
/// mlx-vlm's layout, `vision_tower.*`, or Hugging Face's, `model.visual.*`).
fn load_images(dir: &ModelDir, config: &TextConfig, ops: &Ops) -> Result<Option<QwenImages>> {
    let Some(v) = dir.config.get("vision_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(prefix) = ["vision_tower.", "model.visual."]
        .into_iter()
        .find(|p| dir.contains(&format!("{p}patch_embed.proj.weight")))
    else {
        return Ok(None);
    };
    let vc: VisionConfig = serde_json::from_value(v.clone()).map_err(|e| Error::Config {
        file: "config.json".into(),
        message: format!("vision_config: {e}"),
    })?;
    let tower = QwenVision::load(&dir.weights(prefix)?, vc, config.hidden_size, ops)?;
    let settings = ImageSettings::read(&dir.path)?;
    Ok(Some(QwenImages::new(tower, settings, &dir.config)))
}

/// Whether the checkpoint is in Hugging Face's layout: its convolution kernels are stored
/// `[C, 1, K]` (mlx-lm's own test for its sanitize).
fn hf_layout(dir: &ModelDir, config: &TextConfig) -> bool {
    dir.names().any(|name| {
        name.ends_with("conv1d.weight")
            && dir.shape(name).and_then(|s| s.last().copied()) != Some(1)
            && config.linear_conv_kernel_dim != 1
    })
}

impl Model for Qwen35Text {
    fn ops(&self) -> &Ops {
        &self.ops
    }

    fn cache_plan(&self) -> CachePlan {
        let dtype_bytes = self.dtype_bytes();
        let (mut storages, mut shapes): (Vec<_>, Vec<_>) =
            self.layers.iter().map(|layer| layer.storage(dtype_bytes)).unzip();
        if self.images.is_some() {
            storages.push(Storage::positions());
            shapes.push(KvShape { kv_heads: 0, head_dim: 0, dtype_bytes });
        }
        CachePlan::new(storages, shapes)
    }

    fn new_caches(&self, plan: &CachePlan) -> Result<Vec<Box<dyn Cache>>> {
        plan.build(&self.ops, self.layers.len() + usize::from(self.images.is_some()))
    }

    fn forward_rows(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase,
        rows: Rows,
    ) -> Result<Array> {
        self.check_caches(caches)?;
        let length = tokens.dim(1)? as usize;
        let h = self.embed_tokens.forward(tokens)?;
        // A batch: each row from its own position (a lone row's as a single sequence's).
        if let Some(starts) = self.row_positions(caches)? {
            let array = Array::from_slice(&starts, &[starts.len() as i32])?;
            let rope_at = match starts.as_slice() {
                [start] => RopeAt::Start(*start),
                _ => RopeAt::Rows(&array),
            };
            let logits = self.run(h, caches, phase, rope_at, rows)?;
            if let Some(p) = caches.last_mut().and_then(|c| c.as_position_rows_mut()) {
                p.advance(length);
            }
            return Ok(logits);
        }
        let start = match self.positions(caches)? {
            Some(p) => p.next_position(),
            None => cache::stack_offset(caches) as i64,
        };
        let logits = self.run(h, caches, phase, RopeAt::Start(start as i32), rows)?;
        if let Some(p) = self.positions(caches)? {
            p.advance(length);
        }
        Ok(logits)
    }

    fn vision(&self) -> Option<&dyn Vision> {
        self.images.as_ref().map(|i| i as &dyn Vision)
    }

    /// Image features replace the image tokens' embeddings; each image's soft tokens take
    /// positions on its grid (`[rows, cols, hidden]` features), from where the text before it
    /// stands, and the text after it continues from the image's largest position plus one
    /// (mlx-vlm's `get_rope_index`).
    fn forward_multimodal(
        &self,
        tokens: &[u32],
        images: &[Array],
        caches: &mut [Box<dyn Cache>],
        rows: Rows,
    ) -> Result<Array> {
        let Some(vision) = &self.images else {
            return Err(Error::InvalidRequest("this model does not take images".into()));
        };
        self.check_caches(caches)?;
        let length = tokens.len();
        let ids = Array::from_slice(tokens, &[1, length as i32])?;
        let runs = crate::vision::image_runs(tokens, vision.image_token());
        if runs.len() != images.len() {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {} image blocks but {} images were given",
                runs.len(),
                images.len()
            )));
        }
        if runs.is_empty() {
            return self.forward_rows(&ids, caches, Phase::Window, rows);
        }
        let embedded = self.embed_tokens.forward(&ids)?;
        let hidden = embedded.dim(-1)?;
        let text = |from: usize, to: usize| -> Result<Array> {
            Ok(embedded.slice(&[0, from as i32, 0], &[1, to as i32, hidden], &[1, 1, 1])?)
        };
        let mut pieces = Vec::new();
        let mut positions: [Vec<i64>; 3] = Default::default();
        let mut next = self.positions(caches)?.map_or(0, |p| p.next_position());
        let mut at = 0;
        let text_run = |positions: &mut [Vec<i64>; 3], next: &mut i64, n: usize| {
            for _ in 0..n {
                for axis in positions.iter_mut() {
                    axis.push(*next);
                }
                *next += 1;
            }
        };
        for (i, (&(start, len), features)) in runs.iter().zip(images).enumerate() {
            let s = features.shape();
            let (grid_rows, grid_cols) = match s.as_slice() {
                [r, c, h] if (r * c) as usize == len && *h == hidden => (*r, *c),
                _ => {
                    return Err(Error::InvalidRequest(format!(
                        "image {} has features of shape {s:?} but its block in the prompt has                          {len} soft tokens of width {hidden}",
                        i + 1
                    )));
                }
            };
            if start > at {
                pieces.push(text(at, start)?);
                text_run(&mut positions, &mut next, start - at);
            }
            pieces.push(features.reshape(&[1, len as i32, hidden])?.astype(embedded.dtype())?);
            for r in 0..i64::from(grid_rows) {
                for c in 0..i64::from(grid_cols) {
                    positions[0].push(next);
                    positions[1].push(next + r);
                    positions[2].push(next + c);
                }
            }
            next += i64::from(grid_rows.max(grid_cols));
            at = start + len;
        }
        if at < length {
            pieces.push(text(at, length)?);
            text_run(&mut positions, &mut next, length - at);
        }
        let h = mlx::ops::concatenate(&pieces.iter().collect::<Vec<_>>(), 1)?;
        let (cos, sin) = self.mrope_table(&positions, embedded.dtype())?;
        let logits =
            self.run(h, caches, Phase::Window, RopeAt::Table { cos: &cos, sin: &sin }, rows)?;
        if let Some(p) = self.positions(caches)? {
            p.advance_to(length, next);
        }
        Ok(logits)
    }

    fn decode_weight_bytes(&self) -> usize {
        0
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        self.head(hidden)
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

    fn last_hidden(&self) -> Option<Array> {
        self.last_hidden.borrow().clone()
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
}
