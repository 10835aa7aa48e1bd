//! The Gemma 4 text decoder: per-layer embeddings (PLE), sliding and full layers, KV-shared
//! tail layers, final logit softcapping and a tied head, over the cache stack; its compiled
//! decode step; and the port the Gemma 4 assistant drafts through.

use std::cell::RefCell;
use std::collections::HashMap;

use mlx::{Array, ops};
use serde_json::Value;

use super::attention::{Context, Position, Rope};
use super::config::{Gemma4TextConfig, Variant};
use super::layer::{DecoderLayer, load_layer};
use super::processor::Gemma4Images;
use super::vision::{Gemma4Vision, VisionConfig};
use crate::checkpoint::{ModelDir, Weights};
use crate::nn::{Activations, Embedding, Linear, RmsNorm};
use crate::options::LoadOptions;
use crate::vision::Vision;
use crate::{AssistantRows, DonorReads, Model, Phase, Rows};
use cache::backend::Ops;
use cache::compiled::DecodeGraphs;
use cache::{Cache, CachePlan, KvShape, SlotKind, Storage, TraceCache, attention_of};
use cache::{Error, Result};

#[derive(Debug, Clone)]
struct Ple {
    embed: Embedding,
    model_projection: Linear,
    projection_norm: RmsNorm,
    width: i32,
}

/// What a decoder is built from: the text config, where its tensors are, its [`Variant`], and
/// its images (the family's vision port, and whether image blocks attend both ways).
pub(crate) struct Parts {
    pub(crate) config: Gemma4TextConfig,
    pub(crate) prefix: String,
    pub(crate) variant: Variant,
    pub(crate) images: Option<Box<dyn Vision>>,
    pub(crate) bidirectional_vision: bool,
}

/// The Gemma text decoder with its head: Gemma 4's, and Gemma 3's (see [`Variant`]).
#[derive(Debug)]
pub struct Gemma4Text {
    /// The weights of the text path (what a compiled decode step captures).
    decoder: Decoder,
    activations: Activations,
    /// The vision tower with its image tokens, on a checkpoint that has one.
    images: Option<Box<dyn Vision>>,
    /// `use_bidirectional_attention == "vision"`: image blocks attend both ways in prefill.
    bidirectional_vision: bool,
    /// The final-normed hidden state of the last forward pass's rows (a handle into its graph:
    /// no extra work), for drafters that read it.
    last_hidden: RefCell<Option<Array>>,
    /// The compiled decode steps traced so far.
    decode_graphs: DecodeGraphs,
    /// The op routes its passes and caches run.
    ops: Ops,
}

/// The text path's weights and geometry.
#[derive(Debug, Clone)]
struct Decoder {
    config: Gemma4TextConfig,
    variant: Variant,
    embed_tokens: Embedding,
    ple: Option<Ple>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// For each layer, the layer whose keys and values it attends (itself unless shared).
    kv_source: Vec<usize>,
    /// Index of the first KV-shared layer (= number of caches).
    first_shared: usize,
    rope_sliding: Rope,
    rope_full: Rope,
    /// Scalars of the forward pass, made once in the model's dtype.
    constants: Constants,
}

#[derive(Debug, Clone)]
struct Constants {
    embed_scale: Array,
    ple_token_scale: Array,
    ple_projection_scale: Array,
    ple_input_scale: Array,
    softcap: Option<Array>,
}

impl Gemma4Text {
    /// Builds the model from an opened `gemma4` or `gemma4_text` checkpoint directory.
    pub fn from_dir(dir: &ModelDir, options: &LoadOptions) -> Result<Gemma4Text> {
        let ops = Ops::new(&options.kernels);
        let (config, prefix) = Gemma4TextConfig::from_checkpoint_config(&dir.config)?;
        let top = &dir.config;
        let images: Option<Box<dyn Vision>> = match top.get("vision_config") {
            Some(v)
                if !v.is_null()
                    && dir.contains("vision_tower.patch_embedder.input_proj.weight") =>
            {
                let vc: VisionConfig =
                    serde_json::from_value(v.clone()).map_err(|e| Error::Config {
                        file: "config.json".into(),
                        message: format!("vision_config: {e}"),
                    })?;
                let tower = Gemma4Vision::load(&dir.weights("")?, vc, config.hidden_size, &ops)?;
                Some(Box::new(Gemma4Images::new(tower, top)?))
            }
            _ => None,
        };
        let bidirectional_vision = top
            .get("text_config")
            .and_then(|t| t.get("use_bidirectional_attention"))
            .and_then(Value::as_str)
            == Some("vision");
        let parts =
            Parts { config, prefix, variant: Variant::GEMMA4, images, bidirectional_vision };
        Gemma4Text::build(dir, parts, ops, options)
    }

    /// The decoder of `parts` over the weights of `dir`, its passes run by `ops`.
    pub(crate) fn build(
        dir: &ModelDir,
        parts: Parts,
        ops: Ops,
        options: &LoadOptions,
    ) -> Result<Gemma4Text> {
        let Parts { config, mut prefix, variant, images, bidirectional_vision } = parts;
        let stack = options.stacks_projections(ops.has_kernels());
        // Hugging Face layout of the multimodal checkpoint: `model.language_model.*`.
        if prefix == "language_model.model." && !dir.names().any(|k| k.starts_with(&prefix)) {
            prefix = "model.language_model.".into();
        }
        let w = dir.weights(&prefix)?;
        let c = &config;
        let hidden = c.hidden_size;
        let layers_n = c.num_hidden_layers;
        let first_shared = layers_n - c.num_kv_shared_layers;
        let embed_tokens = Embedding::new(w.matrix("embed_tokens", c.vocab_size, hidden)?);

        let ple = if c.hidden_size_per_layer_input > 0 {
            let width = c.hidden_size_per_layer_input;
            let total = layers_n as i32 * width;
            Some(Ple {
                embed: Embedding::new(w.matrix(
                    "embed_tokens_per_layer",
                    c.vocab_size_per_layer_input.unwrap_or(c.vocab_size),
                    total,
                )?),
                model_projection: Linear::new(w.matrix(
                    "per_layer_model_projection",
                    total,
                    hidden,
                )?),
                projection_norm: RmsNorm::new(
                    w.get("per_layer_projection_norm.weight", &[width])?,
                    c.rms_norm_eps,
                ),
                width,
            })
        } else {
            None
        };

        let mut layers = Vec::with_capacity(layers_n);
        let mut kv_source: Vec<usize> = (0..layers_n).collect();
        let mut last_of_type: HashMap<&str, usize> = HashMap::new();
        for (i, kind) in c.layer_types.iter().enumerate() {
            let kind = kind.as_str();
            if i < first_shared {
                last_of_type.insert(kind, i);
            } else {
                kv_source[i] = *last_of_type.get(kind).ok_or_else(|| Error::Config {
                    file: "config.json".into(),
                    message: format!(
                        "KV-shared layer {i} ({kind}) has no earlier {kind} layer to share from"
                    ),
                })?;
            }
            layers.push(load_layer(&w, c, &variant, i, i >= first_shared, stack)?);
        }
        let norm = variant.norm(w.get("norm.weight", &[hidden])?, c.rms_norm_eps)?;
        let root = Weights::from_prefix_parent(dir, &prefix)?;
        let tied = if variant.head_from_checkpoint {
            !root.contains("lm_head.weight")
        } else {
            c.tie_word_embeddings
        };
        let lm_head = if tied {
            None
        } else {
            Some(Linear::new(root.matrix("lm_head", c.vocab_size, hidden)?))
        };
        let sliding_dims = c.head_dim;
        let full_dims = c.global_head_dim.unwrap_or(c.head_dim);
        let rope_sliding =
            Rope::new(&c.rope_parameters["sliding_attention"], sliding_dims, c.rope_traditional)
                .or_else(|_| {
                    Rope::new(
                        &c.rope_parameters["full_attention"],
                        sliding_dims,
                        c.rope_traditional,
                    )
                })?;
        let rope_full = match c.rope_parameters.get("full_attention") {
            Some(p) => Rope::new(p, full_dims, c.rope_traditional)?,
            None => rope_sliding.clone(),
        };
        // The activation dtype follows the weights (f32, bf16; a quantized checkpoint's scales).
        let dtype = match &embed_tokens.table_dtype() {
            Some(d) => *d,
            None => mlx::Dtype::Float32,
        };
        let scalar = |v: f64| mlx::Array::scalar_as(v, dtype);
        let ple_width = f64::from(config.hidden_size_per_layer_input.max(1));
        let embed_scale = f64::from(config.hidden_size).sqrt();
        let constants = Constants {
            embed_scale: if variant.embed_scale_bf16 {
                Array::scalar_as(embed_scale, mlx::Dtype::Bfloat16)?.astype(dtype)?
            } else {
                scalar(embed_scale)?
            },
            ple_token_scale: scalar(ple_width.sqrt())?,
            ple_projection_scale: scalar(f64::from(config.hidden_size).powf(-0.5))?,
            ple_input_scale: scalar(2f64.powf(-0.5))?,
            softcap: match config.final_logit_softcapping {
                Some(c) if c > 0.0 => Some(scalar(f64::from(c))?),
                _ => None,
            },
        };
        let decoder = Decoder {
            constants,
            config,
            variant,
            embed_tokens,
            ple,
            layers,
            norm,
            lm_head,
            kv_source,
            first_shared,
            rope_sliding,
            rope_full,
        };
        Ok(Gemma4Text {
            decoder,
            images,
            bidirectional_vision,
            last_hidden: RefCell::new(None),
            decode_graphs: DecodeGraphs::new(options.compiles_decode()),
            ops,
            activations: Activations::new()?,
        })
    }

    /// The parsed text config.
    pub fn config(&self) -> &Gemma4TextConfig {
        &self.decoder.config
    }

    /// The decoder over `h`, keeping the final hidden state for drafters.
    fn run(
        &self,
        ple_ids: &Array,
        h: Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase<'_>,
        rows: Rows,
        position: Position,
    ) -> Result<Array> {
        let pass = Pass { ops: &self.ops, act: &self.activations, phase, rows };
        let (logits, hidden) = self.decoder.run(&pass, ple_ids, h, caches, position)?;
        *self.last_hidden.borrow_mut() = Some(hidden);
        Ok(logits)
    }

    /// The scaled token embeddings `[B, T, H]` of `ids`.
    fn embed_ids(&self, ids: &Array) -> Result<Array> {
        self.decoder.embed(ids)
    }

    /// The compiled decode step for caches whose slots are `fetches` (see [`cache::compiled`]):
    /// inputs `[tokens [B, 1], positions, slot inputs…]`, outputs `[logits, last hidden, each
    /// slot's parts…]`. The graph owns the decoder's weights (shared handles, nothing is
    /// copied) and runs a shapeless step's ops.
    fn decode_graph(&self, fetches: Vec<SlotKind>) -> Result<mlx::Compiled> {
        let decoder = self.decoder.clone();
        let act = Activations::new()?;
        let step = move |inputs: &[Array]| {
            traced_decode(&decoder, &act, inputs, &fetches)
                .map_err(|e| mlx::Error::from_message(e.to_string()))
        };
        Ok(mlx::compile(step, true)?)
    }
}

/// The body of a compiled decode step, run by MLX while it traces.
fn traced_decode(
    decoder: &Decoder,
    act: &Activations,
    inputs: &[Array],
    fetches: &[SlotKind],
) -> Result<Vec<Array>> {
    let wanted = 2 + fetches.iter().map(|f| f.inputs()).sum::<usize>();
    if inputs.len() != wanted {
        return Err(Error::InvalidRequest(format!(
            "a decode step of {} slots takes {wanted} inputs, got {}",
            fetches.len(),
            inputs.len()
        )));
    }
    let ops = Ops::shapeless();
    let mut next = 2;
    let mut traces: Vec<Box<dyn Cache>> = Vec::with_capacity(fetches.len());
    for kind in fetches {
        let slot = inputs[next..next + kind.inputs()].to_vec();
        next += kind.inputs();
        traces.push(Box::new(TraceCache::new(kind.clone(), slot, &ops)));
    }
    let token = &inputs[0];
    let h = decoder.embed(token)?;
    // One row at the scalar position, or each row at its own.
    let position = match token.dim(0)? {
        1 => Position::Traced(inputs[1].clone()),
        _ => Position::Rows(inputs[1].clone()),
    };
    let pass = Pass { ops: &ops, act, phase: Phase::Decode, rows: Rows::All };
    let (logits, hidden) = decoder.run(&pass, token, h, &mut traces, position)?;
    let mut outputs = vec![logits, hidden];
    for trace in &traces {
        outputs.extend(trace.buffers());
    }
    Ok(outputs)
}

/// What one forward pass runs with.
struct Pass<'a> {
    ops: &'a Ops,
    act: &'a Activations,
    phase: Phase<'a>,
    rows: Rows,
}

impl Decoder {
    /// The scaled token embeddings `[B, T, H]` of `ids`.
    fn embed(&self, ids: &Array) -> Result<Array> {
        Ok(self.embed_tokens.forward(ids)?.multiply(&self.constants.embed_scale)?)
    }

    /// Per-layer inputs `[B, T, layers, width]` for token ids and the scaled embeddings.
    fn per_layer_inputs(&self, ple: &Ple, tokens: &Array, h: &Array, ops: &Ops) -> Result<Array> {
        let shape = tokens.shape();
        let n = self.layers.len() as i32;
        let full = [shape[0], shape[1], n, ple.width];
        let c = &self.constants;
        let token_part = ple.embed.forward(tokens)?.multiply(&c.ple_token_scale)?.reshape(&full)?;
        let context = ple
            .model_projection
            .forward(h, ops)?
            .multiply(&c.ple_projection_scale)?
            .reshape(&full)?;
        let context = ple.projection_norm.forward(&context)?;
        Ok(context.add(&token_part)?.multiply(&c.ple_input_scale)?)
    }
}

impl Weights<'_> {
    pub(super) fn from_prefix_parent<'d>(dir: &'d ModelDir, prefix: &str) -> Result<Weights<'d>> {
        // `language_model.model.` → `language_model.`; `model.` → ``.
        let trimmed = prefix.trim_end_matches('.');
        let parent = match trimmed.rfind('.') {
            Some(i) => &prefix[..=i],
            None => "",
        };
        dir.weights(parent)
    }
}

impl Decoder {
    /// The decoder over embeddings `h` `[1, T, H]`; `ple_ids` are the ids the per-layer token
    /// embeddings read. Returns the logits (the hidden state again for [`Rows::Hidden`]) and
    /// the final-normed hidden state.
    fn run(
        &self,
        pass: &Pass<'_>,
        ple_ids: &Array,
        mut h: Array,
        caches: &mut [Box<dyn Cache>],
        position: Position,
    ) -> Result<(Array, Array)> {
        let (ops, phase, rows) = (pass.ops, pass.phase, pass.rows);
        if caches.len() != self.first_shared {
            return Err(Error::InvalidRequest(format!(
                "{} needs {} caches, got {}",
                self.variant.family,
                self.first_shared,
                caches.len()
            )));
        }
        let per_layer = match &self.ple {
            Some(ple) => Some(self.per_layer_inputs(ple, ple_ids, &h, ops)?),
            None => None,
        };
        let mut per_layer = per_layer;
        let mut position = position;
        let length = h.dim(1)?;
        // With only the last row wanted, the last layer that writes a cache takes keys and
        // values from every row but queries from the last one; from there on only that row
        // flows (KV-sharing layers, the head).
        let trim_at =
            if rows == Rows::Last && length > 1 { Some(self.first_shared - 1) } else { None };
        let mut reads: Vec<Option<cache::AttentionRead>> = Vec::with_capacity(self.layers.len());
        // Each layer hands the next its normed input (fused with its last residual add).
        let mut normed_next: Option<Array> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut query_rows = h.dim(1)?;
            if trim_at == Some(i) {
                query_rows = 1;
            }
            let rope = if layer.attention.sliding { &self.rope_sliding } else { &self.rope_full };
            let cache = match caches.get_mut(i) {
                Some(cache) if i < self.first_shared => Some(attention_of(cache.as_mut())?),
                _ => None,
            };
            let shared = if i >= self.first_shared {
                reads.get(self.kv_source[i]).and_then(Option::as_ref)
            } else {
                None
            };
            let normed = match normed_next.take() {
                Some(normed) => normed,
                None => layer.input_layernorm.forward(&h)?,
            };
            let context = Context { rope, position: &position, cache, shared, phase, ops };
            let (attn, own) = layer.attention.forward(&normed, query_rows, context)?;
            reads.push(own);
            if trim_at == Some(i) {
                (h, per_layer) = last_rows(&h, per_layer.as_ref())?;
                position = position.advanced(length - 1)?;
            }
            let next = match self.layers.get(i + 1) {
                Some(next) => &next.input_layernorm,
                None => &self.norm,
            };
            (h, normed_next) =
                layer.finish(h, &attn, per_layer.as_ref(), pass.act, Some(next), ops)?;
        }
        let h = match normed_next {
            Some(normed) => normed,
            None => self.norm.forward(&h)?,
        };
        if rows == Rows::Hidden {
            return Ok((h.clone(), h));
        }
        Ok((self.logits(&h, ops)?, h))
    }

    /// The head over final-normed hidden rows, soft-capped where the config says.
    fn logits(&self, h: &Array, ops: &Ops) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(h, ops)?,
            None => self.embed_tokens.as_linear(h, ops)?,
        };
        Ok(match &self.constants.softcap {
            Some(c) => logits.divide(c)?.tanh()?.multiply(c)?,
            None => logits,
        })
    }
}

impl Model for Gemma4Text {
    fn ops(&self) -> &Ops {
        &self.ops
    }

    fn cache_plan(&self) -> CachePlan {
        let decoder = &self.decoder;
        let layers = &decoder.config.layer_types[..decoder.first_shared];
        let storage = |kind: &String| match kind.as_str() {
            "sliding_attention" => Storage::rotating(decoder.config.sliding_window),
            _ => Storage::plain(),
        };
        let dtype_bytes = decoder.constants.embed_scale.dtype().size();
        let shapes = decoder.layers[..decoder.first_shared]
            .iter()
            .map(|layer| KvShape {
                kv_heads: layer.attention.kv_heads() as usize,
                head_dim: layer.attention.head_dim as usize,
                dtype_bytes,
            })
            .collect();
        CachePlan::new(layers.iter().map(storage).collect(), shapes)
    }

    fn new_caches(&self, plan: &CachePlan) -> Result<Vec<Box<dyn Cache>>> {
        plan.build(&self.ops, self.decoder.first_shared)
    }

    fn forward_rows(
        &self,
        tokens: &Array,
        caches: &mut [Box<dyn Cache>],
        phase: Phase,
        rows: Rows,
    ) -> Result<Array> {
        let h = self.embed_ids(tokens)?;
        let position = Position::of(caches)?;
        self.run(tokens, h, caches, phase, rows, position)
    }

    fn forward_decode(&self, tokens: &Array, caches: &mut [Box<dyn Cache>]) -> Result<Array> {
        let positions = Position::of(caches)?.input()?;
        let compiled = self
            .decode_graphs
            .step(caches, tokens, &positions, 2, |fetches| self.decode_graph(fetches))?;
        match compiled {
            Some(mut outputs) => {
                let hidden = outputs.pop();
                *self.last_hidden.borrow_mut() = hidden;
                outputs.pop().ok_or_else(|| Error::InvalidRequest("no logits".into()))
            }
            None => self.forward(tokens, caches, Phase::Decode),
        }
    }

    fn decode_graphs(&self) -> Option<&DecodeGraphs> {
        Some(&self.decode_graphs)
    }

    fn vision(&self) -> Option<&dyn Vision> {
        self.images.as_deref()
    }

    fn forward_multimodal(
        &self,
        tokens: &[u32],
        images: &[Array],
        caches: &mut [Box<dyn Cache>],
        rows: Rows,
    ) -> Result<Array> {
        let image_token = self.images.as_ref().map(|v| v.image_token());
        let ids = crate::tokens::ids(tokens)?;
        let mut h = self.embed_ids(&ids)?;
        let flags: Vec<bool> = tokens.iter().map(|&t| Some(t) == image_token).collect();
        let slots = flags.iter().filter(|&&f| f).count();
        let provided: i32 = images.iter().map(|f| f.dim(0)).sum::<mlx::Result<i32>>()?;
        if slots != provided as usize {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {slots} image tokens but the images give {provided} features"
            )));
        }
        let mut ple_ids = ids.clone();
        if slots > 0 {
            // Scatter the features, in order, into the image-token rows: gather from
            // [token embeddings; features] with an index per position (a copy, no arithmetic).
            let t = tokens.len() as i32;
            let mut next = t;
            let index: Vec<i32> = flags
                .iter()
                .enumerate()
                .map(|(i, &f)| {
                    if f {
                        next += 1;
                        next - 1
                    } else {
                        i as i32
                    }
                })
                .collect();
            let features: Vec<Array> =
                images.iter().map(|f| f.astype(h.dtype())).collect::<mlx::Result<_>>()?;
            let mut all = vec![h.squeeze(&[0])?];
            all.extend(features);
            let joined = ops::concatenate(&all.iter().collect::<Vec<_>>(), 0)?;
            h = joined.take(&Array::from_slice(&index, &[t])?, 0)?.expand_dims(&[0])?;
            // The per-layer token embeddings see the pad id at image positions.
            let masked: Vec<u32> =
                tokens.iter().zip(&flags).map(|(&tok, &f)| if f { 0 } else { tok }).collect();
            ple_ids = crate::tokens::ids(&masked)?;
        }
        let phase = if slots > 0 && self.bidirectional_vision {
            Phase::Bidirectional(&flags)
        } else {
            Phase::Window
        };
        let position = Position::of(caches)?;
        self.run(&ple_ids, h, caches, phase, rows, position)
    }

    fn decode_weight_bytes(&self) -> usize {
        let layers: usize = self.decoder.layers.iter().map(DecoderLayer::decode_weight_bytes).sum();
        let ple = self.decoder.ple.as_ref().map_or(0, |p| p.model_projection.nbytes());
        let head = self
            .decoder
            .lm_head
            .as_ref()
            .map_or_else(|| self.decoder.embed_tokens.nbytes(), Linear::nbytes);
        layers + ple + head
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        self.decoder.logits(hidden, &self.ops)
    }

    fn vocab_size(&self) -> usize {
        self.decoder.config.vocab_size as usize
    }

    fn max_context(&self) -> usize {
        self.decoder.config.max_position_embeddings
    }

    fn assistant_rows(&self) -> Option<&dyn AssistantRows> {
        self.decoder.variant.assistant_port.then_some(self as &dyn AssistantRows)
    }

    fn last_hidden(&self) -> Option<Array> {
        self.last_hidden.borrow().clone()
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        match &self.decoder.config.eos_token_id {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(items)) => {
                items.iter().filter_map(Value::as_u64).map(|v| v as u32).collect()
            }
            _ => Vec::new(),
        }
    }
}

impl AssistantRows for Gemma4Text {
    fn hidden_size(&self) -> usize {
        self.decoder.config.hidden_size as usize
    }

    fn head_dims(&self) -> (i32, i32) {
        (
            self.decoder.config.head_dim,
            self.decoder.config.global_head_dim.unwrap_or(self.decoder.config.head_dim),
        )
    }

    fn embed(&self, ids: &Array) -> Result<Array> {
        self.embed_ids(ids)
    }

    fn donor_reads(&self, caches: &[Box<dyn Cache>], row: usize) -> Result<DonorReads> {
        // The last layer of each type attends its donor's cache (or its own).
        let last_of = |sliding: bool| {
            self.decoder
                .layers
                .iter()
                .rposition(|l| l.attention.sliding == sliding)
                .map(|i| self.decoder.kv_source[i])
        };
        let read = |layer: Option<usize>| match layer.and_then(|i| caches.get(i)) {
            Some(cache) => cache::donor_read(cache.as_ref(), row),
            None => Ok(None),
        };
        Ok(DonorReads { sliding: read(last_of(true))?, full: read(last_of(false))? })
    }
}

/// The last position of `h` `[B, T, H]` and of the per-layer inputs `[B, T, L, W]`.
fn last_rows(h: &Array, per_layer: Option<&Array>) -> Result<(Array, Option<Array>)> {
    let s = h.shape();
    let h = h.slice(&[0, s[1] - 1, 0], &[s[0], s[1], s[2]], &[1, 1, 1])?;
    let per_layer = match per_layer {
        Some(p) => {
            let t = p.shape();
            Some(p.slice(&[0, t[1] - 1, 0, 0], &[t[0], t[1], t[2], t[3]], &[1, 1, 1, 1])?)
        }
        None => None,
    };
    Ok((h, per_layer))
}
