//! A Gemma decoder layer (Gemma 4's, and Gemma 3's through its [`Variant`]): attention, the residual stream with its four norms, the GeGLU
//! MLP (doubled on KV-shared layers with `use_double_wide_mlp`), the mixture-of-experts block
//! beside it on 26B-A4B, the per-layer input (PLE) and the layer scalar.

use mlx::Array;

use super::attention::{Attention, KeyValue};
use super::config::{Gemma4TextConfig, Variant};
use super::moe::{Moe, load_moe};
use crate::checkpoint::Weights;
use crate::nn::{Activations, Linear, RmsNorm, Stacked};
use cache::backend::Ops;
use cache::{Error, Result};

#[derive(Debug, Clone)]
pub(super) struct Mlp {
    /// `gate_proj` and `up_proj`, stacked.
    pub(super) gate_up: Stacked,
    pub(super) down_proj: Linear,
    /// The int32 scalar 1: where `up` starts in the stacked output, in widths.
    one: Array,
}

#[derive(Debug, Clone)]
pub(super) struct PerLayerInput {
    pub(super) gate: Linear,
    pub(super) projection: Linear,
    post_norm: RmsNorm,
    /// This layer's index into the per-layer inputs, as an int32 scalar.
    index: Array,
    layer: i32,
}

#[derive(Debug, Clone)]
pub(crate) struct DecoderLayer {
    pub(crate) attention: Attention,
    pub(super) mlp: Mlp,
    pub(super) moe: Option<Moe>,
    pub(crate) input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    pub(super) per_layer: Option<PerLayerInput>,
    layer_scalar: Option<Array>,
}

pub(crate) fn load_layer(
    w: &Weights<'_>,
    c: &Gemma4TextConfig,
    variant: &Variant,
    i: usize,
    shared: bool,
    stack: bool,
) -> Result<DecoderLayer> {
    let p = format!("layers.{i}.");
    let hidden = c.hidden_size;
    let eps = c.rms_norm_eps;
    let sliding = c.layer_types[i] == "sliding_attention";
    let head_dim = if sliding { c.head_dim } else { c.global_head_dim.unwrap_or(c.head_dim) };
    let k_eq_v = c.attention_k_eq_v && !sliding;
    let kv_heads = match (k_eq_v, c.num_global_key_value_heads) {
        (true, Some(n)) => n,
        _ => c.num_key_value_heads,
    };
    let heads = c.num_attention_heads;
    let a = format!("{p}self_attn.");
    let mut projections = vec![w.matrix(&format!("{a}q_proj"), heads * head_dim, hidden)?];
    let kv = if shared {
        None
    } else {
        projections.push(w.matrix(&format!("{a}k_proj"), kv_heads * head_dim, hidden)?);
        if !k_eq_v {
            projections.push(w.matrix(&format!("{a}v_proj"), kv_heads * head_dim, hidden)?);
        }
        Some(KeyValue {
            k_eq_v,
            k_norm: variant.norm(w.get(&format!("{a}k_norm.weight"), &[head_dim])?, eps)?,
            v_norm: variant.value_norm.then(|| RmsNorm::unscaled(eps)),
            kv_heads,
        })
    };
    let attention = Attention {
        proj: Stacked::new(projections, stack)?,
        kv,
        o_proj: Linear::new(w.matrix(&format!("{a}o_proj"), hidden, heads * head_dim)?),
        q_norm: variant.norm(w.get(&format!("{a}q_norm.weight"), &[head_dim])?, eps)?,
        heads,
        head_dim,
        sliding,
        scale: c.attention_scale.unwrap_or(1.0),
    };
    let width =
        if shared && c.use_double_wide_mlp { 2 * c.intermediate_size } else { c.intermediate_size };
    let m = format!("{p}mlp.");
    let mlp = Mlp {
        gate_up: Stacked::new(
            vec![
                w.matrix(&format!("{m}gate_proj"), width, hidden)?,
                w.matrix(&format!("{m}up_proj"), width, hidden)?,
            ],
            stack,
        )?,
        down_proj: Linear::new(w.matrix(&format!("{m}down_proj"), hidden, width)?),
        one: Array::scalar(1i32)?,
    };
    let norm = |name: &str| -> Result<RmsNorm> {
        variant.norm(w.get(&format!("{p}{name}.weight"), &[hidden])?, eps)
    };
    let per_layer = if c.hidden_size_per_layer_input > 0 {
        let width = c.hidden_size_per_layer_input;
        Some(PerLayerInput {
            gate: Linear::new(w.matrix(&format!("{p}per_layer_input_gate"), width, hidden)?),
            projection: Linear::new(w.matrix(
                &format!("{p}per_layer_projection"),
                hidden,
                width,
            )?),
            post_norm: norm("post_per_layer_input_norm")?,
            index: Array::scalar(i as i32)?,
            layer: i as i32,
        })
    } else {
        None
    };
    let moe = if c.enable_moe_block { Some(load_moe(w, c, &p, &norm)?) } else { None };
    Ok(DecoderLayer {
        attention,
        mlp,
        moe,
        input_layernorm: norm("input_layernorm")?,
        post_attention_layernorm: norm("post_attention_layernorm")?,
        pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
        post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
        per_layer,
        layer_scalar: if variant.layer_scalar {
            Some(w.get(&format!("{p}layer_scalar"), &[1])?)
        } else {
            None
        },
    })
}

impl DecoderLayer {
    /// Weight bytes one decode step reads in this layer.
    pub(super) fn decode_weight_bytes(&self) -> usize {
        let a = &self.attention;
        let mut mlp = self.mlp.gate_up.nbytes() + self.mlp.down_proj.nbytes();
        if let Some(moe) = &self.moe {
            mlp += moe.decode_weight_bytes();
        }
        let ple = self.per_layer.as_ref().map_or(0, |p| p.gate.nbytes() + p.projection.nbytes());
        a.proj.nbytes() + a.o_proj.nbytes() + mlp + ple
    }

    /// Everything after attention: the residual, the MLP, the per-layer input (`per_layer`:
    /// the per-layer inputs of every layer, `[B, T, L, W]`) and the layer scalar. Returns the
    /// new residual and, when `next` is given, that norm of it (the next layer's input norm,
    /// or the final one), fused with the last residual add where the backend allows.
    pub(crate) fn finish(
        &self,
        h: Array,
        attn: &Array,
        per_layer: Option<&Array>,
        act: &Activations,
        next: Option<&RmsNorm>,
        ops: &Ops,
    ) -> Result<(Array, Option<Array>)> {
        let (h, ff_in) = ops.residual_norm(
            &h,
            attn,
            &self.post_attention_layernorm,
            None,
            Some(&self.pre_feedforward_layernorm),
        )?;
        let ff_in = ff_in.ok_or_else(|| Error::InvalidRequest("no MLP input".into()))?;
        let ff = self.mlp.forward(&ff_in, act, ops)?;
        let ff = match &self.moe {
            Some(moe) => moe.forward(&h, &ff, act, ops)?,
            None => ff,
        };
        let scalar = self.layer_scalar.as_ref();
        match (&self.per_layer, per_layer) {
            (Some(pl), Some(inputs)) => {
                let (h, _) =
                    ops.residual_norm(&h, &ff, &self.post_feedforward_layernorm, None, None)?;
                let gate = pl.gate.forward(&h, ops)?;
                let gate = ops.geglu_at(&gate, inputs, pl.layer, &pl.index, act)?;
                ops.residual_norm(
                    &h,
                    &pl.projection.forward(&gate, ops)?,
                    &pl.post_norm,
                    scalar,
                    next,
                )
            }
            _ => ops.residual_norm(&h, &ff, &self.post_feedforward_layernorm, scalar, next),
        }
    }
}

impl Mlp {
    fn forward(&self, x: &Array, act: &Activations, ops: &Ops) -> Result<Array> {
        let joined = self.gate_up.forward_joined(x, ops)?;
        let fused = match &joined {
            Some(joined) => ops.geglu_halves(joined, &self.one)?,
            None => None,
        };
        let hidden = match (fused, joined) {
            (Some(hidden), _) => hidden,
            (None, Some(joined)) => {
                let parts = self.gate_up.split(&joined, ops)?;
                act.geglu(&parts[0], &parts[1])?
            }
            (None, None) => {
                let parts = self.gate_up.forward(x, ops)?;
                act.geglu(&parts[0], &parts[1])?
            }
        };
        self.down_proj.forward(&hidden, ops)
    }
}
