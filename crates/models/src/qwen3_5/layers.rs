//! Qwen3.5's blocks: gated full attention, the gated DeltaNet block, the SwiGLU MLP and the
//! mixture of experts with its gated shared expert, as mlx-lm 0.32.2 computes them
//! (`models/qwen3_5.py`, `qwen3_next.py`, `gated_delta.py`).

use mlx::fast::{RopeFrequencies, RopeOffset};
use mlx::{Array, Dtype, fast};

use super::config::TextConfig;
use crate::Phase;
use crate::checkpoint::{Matrix, Weights};
use crate::nn::{Linear, RmsNorm, gather_product};
use cache::backend::Ops;
use cache::{AttentionCache, DeltaHeads, DeltaShape, GatedDeltaCache, GatedDeltaLayer};
use cache::{Error, Result};

/// Where a pass's positions are rotated to: consecutive positions from one start (text, the
/// fast rope), or explicit cosines and sines `[1, 1, T, rotary_dims]` of each position's
/// multimodal angles (a window holding an image).
#[derive(Debug, Clone, Copy)]
pub(super) enum RopeAt<'a> {
    Start(i32),
    Table {
        cos: &'a Array,
        sin: &'a Array,
    },
    /// Each row of a batch from its own position: int32 `[B]`.
    Rows(&'a Array),
}

/// Gated full attention: `q_proj` gives queries and an output gate per head, q/k norms,
/// partial rope, and `o_proj(attention ⊙ σ(gate))`.
#[derive(Debug, Clone)]
pub(super) struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i32,
    kv_heads: i32,
    pub(super) head_dim: i32,
    rotary_dims: i32,
    rope_theta: f32,
}

impl Attention {
    pub(super) fn load(
        w: &Weights<'_>,
        c: &TextConfig,
        p: &str,
        norm: &NormLoader,
    ) -> Result<Attention> {
        let (h, d) = (c.hidden_size, c.head_dim());
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        Ok(Attention {
            q_proj: Linear::new(w.matrix(&format!("{p}q_proj"), 2 * heads * d, h)?),
            k_proj: Linear::new(w.matrix(&format!("{p}k_proj"), kv_heads * d, h)?),
            v_proj: Linear::new(w.matrix(&format!("{p}v_proj"), kv_heads * d, h)?),
            o_proj: Linear::new(w.matrix(&format!("{p}o_proj"), h, heads * d)?),
            q_norm: norm.offset(w, &format!("{p}q_norm.weight"), d)?,
            k_norm: norm.offset(w, &format!("{p}k_norm.weight"), d)?,
            heads,
            kv_heads,
            head_dim: d,
            rotary_dims: c.rotary_dims(),
            rope_theta: c.rope_theta() as f32,
        })
    }

    pub(super) fn kv_heads(&self) -> i32 {
        self.kv_heads
    }

    pub(super) fn forward(
        &self,
        x: &Array,
        cache: &mut dyn AttentionCache,
        phase: Phase,
        rope_at: RopeAt<'_>,
        ops: &Ops,
    ) -> Result<Array> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let d = self.head_dim;
        let joined = self.q_proj.forward(x, ops)?.reshape(&[b, l, self.heads, 2 * d])?;
        let queries = joined.slice(&[0, 0, 0, 0], &[b, l, self.heads, d], &[1; 4])?;
        let gate = joined.slice(&[0, 0, 0, d], &[b, l, self.heads, 2 * d], &[1; 4])?.reshape(&[
            b,
            l,
            self.heads * d,
        ])?;
        let heads_first = |x: Array, heads: i32| -> Result<Array> {
            Ok(x.reshape(&[b, l, heads, d])?.transpose(&[0, 2, 1, 3])?)
        };
        let keys = self.k_proj.forward(x, ops)?.reshape(&[b, l, self.kv_heads, d])?;
        let values = heads_first(self.v_proj.forward(x, ops)?, self.kv_heads)?;
        let queries = self.q_norm.forward(&queries)?.transpose(&[0, 2, 1, 3])?;
        let keys = self.k_norm.forward(&keys)?.transpose(&[0, 2, 1, 3])?;
        let rope = |x: &Array| -> Result<Array> {
            match rope_at {
                RopeAt::Start(start) => ops.rope(
                    x,
                    self.rotary_dims,
                    false,
                    RopeFrequencies::Base(self.rope_theta),
                    1.0,
                    RopeOffset::Fixed(start),
                ),
                RopeAt::Table { cos, sin } => rotate_table(x, self.rotary_dims, cos, sin),
                RopeAt::Rows(starts) => ops.rope(
                    x,
                    self.rotary_dims,
                    false,
                    RopeFrequencies::Base(self.rope_theta),
                    1.0,
                    RopeOffset::Array(starts),
                ),
            }
        };
        let (queries, keys) = (rope(&queries)?, rope(&keys)?);
        let read = phase.append(cache, &keys, &values)?;
        let out = read.attend(&queries, (f64::from(d)).powf(-0.5) as f32)?;
        let out = out.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, self.heads * d])?;
        self.o_proj.forward(&out.multiply(&gate.sigmoid()?)?, ops)
    }
}

/// `x` `[B, H, T, D]` with its first `dims` rotated by `cos` and `sin` (`[1, 1, T, dims]`) as
/// mlx-vlm applies multimodal rope: `x·cos + rotate_half(x)·sin` in the table's dtype, cast
/// back, the rest of each head passed through.
fn rotate_table(x: &Array, dims: i32, cos: &Array, sin: &Array) -> Result<Array> {
    let s = x.shape();
    let (b, h, t, d) = (s[0], s[1], s[2], s[3]);
    let rot = x.slice(&[0, 0, 0, 0], &[b, h, t, dims], &[1; 4])?;
    let rotated =
        rot.multiply(cos)?.add(&crate::nn::rotate_half(&rot)?.multiply(sin)?)?.astype(x.dtype())?;
    if dims == d {
        return Ok(rotated);
    }
    let pass = x.slice(&[0, 0, 0, dims], &[b, h, t, d], &[1; 4])?;
    Ok(mlx::ops::concatenate(&[&rotated, &pass], -1)?)
}

/// A gated DeltaNet block: its projections, the recurrence weights it lends the cache, and
/// the gated norm over each value head.
#[derive(Debug, Clone)]
pub(super) struct DeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    out_proj: Linear,
    conv_weight: Array,
    a_log: Array,
    dt_bias: Array,
    norm: RmsNorm,
    pub(super) shape: DeltaShape,
}

impl DeltaNet {
    pub(super) fn load(
        w: &Weights<'_>,
        c: &TextConfig,
        p: &str,
        hf_layout: bool,
    ) -> Result<DeltaNet> {
        let shape = DeltaShape {
            kernel: c.linear_conv_kernel_dim as usize,
            key_heads: c.linear_num_key_heads as usize,
            value_heads: c.linear_num_value_heads as usize,
            key_dim: c.linear_key_head_dim as usize,
            value_dim: c.linear_value_head_dim as usize,
        };
        let h = c.hidden_size;
        let (conv, kernel) = (shape.conv_dim() as i32, shape.kernel as i32);
        let value_width = (shape.value_heads * shape.value_dim) as i32;
        let hv = shape.value_heads as i32;
        let conv_weight = if hf_layout {
            // Hugging Face stores the depthwise kernel as [C, 1, K].
            w.get(&format!("{p}conv1d.weight"), &[conv, 1, kernel])?.swapaxes(1, 2)?
        } else {
            w.get(&format!("{p}conv1d.weight"), &[conv, kernel, 1])?
        };
        Ok(DeltaNet {
            in_proj_qkv: Linear::new(w.matrix(&format!("{p}in_proj_qkv"), conv, h)?),
            in_proj_z: Linear::new(w.matrix(&format!("{p}in_proj_z"), value_width, h)?),
            in_proj_b: Linear::new(w.matrix(&format!("{p}in_proj_b"), hv, h)?),
            in_proj_a: Linear::new(w.matrix(&format!("{p}in_proj_a"), hv, h)?),
            out_proj: Linear::new(w.matrix(&format!("{p}out_proj"), h, value_width)?),
            conv_weight,
            a_log: w.get(&format!("{p}A_log"), &[hv])?,
            dt_bias: w.get(&format!("{p}dt_bias"), &[hv])?,
            // The gated norm scales by w in both layouts.
            norm: RmsNorm::new(
                w.get(&format!("{p}norm.weight"), &[shape.value_dim as i32])?,
                c.rms_norm_eps,
            ),
            shape,
        })
    }

    pub(super) fn forward(
        &self,
        x: &Array,
        cache: &mut dyn GatedDeltaCache,
        phase: Phase,
        ops: &Ops,
    ) -> Result<Array> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let (hv, dv) = (self.shape.value_heads as i32, self.shape.value_dim as i32);
        let qkv = self.in_proj_qkv.forward(x, ops)?;
        let z = self.in_proj_z.forward(x, ops)?.reshape(&[b, l, hv, dv])?;
        let beta_in = self.in_proj_b.forward(x, ops)?;
        let a = self.in_proj_a.forward(x, ops)?;
        let out = phase.recur(cache, &qkv, &a, &beta_in, self)?;
        // mlx-lm's gated RMSNorm: rms_norm(y)·w, then silu(z)·that in float32, cast back.
        let normed = self.norm.forward(&out)?;
        let gated = z
            .astype(Dtype::Float32)?
            .silu()?
            .multiply(&normed.astype(Dtype::Float32)?)?
            .astype(out.dtype())?;
        self.out_proj.forward(&gated.reshape(&[b, l, hv * dv])?, ops)
    }
}

impl GatedDeltaLayer for DeltaNet {
    fn conv_weight(&self) -> &Array {
        &self.conv_weight
    }

    fn a_log(&self) -> &Array {
        &self.a_log
    }

    fn dt_bias(&self) -> &Array {
        &self.dt_bias
    }

    /// SiLU, the split into query, key and value heads, and mlx-lm's `normalize_qk`: an L2
    /// norm (eps 1e-6 on the sum of squares, i.e. `eps / Dk` on the mean) with `Dk^-½` folded
    /// in, applied twice to the queries.
    fn heads(&self, convolved: &Array) -> Result<DeltaHeads> {
        let s = convolved.shape();
        let (b, l) = (s[0], s[1]);
        let shape = &self.shape;
        let (hk, dk) = (shape.key_heads as i32, shape.key_dim as i32);
        let (hv, dv) = (shape.value_heads as i32, shape.value_dim as i32);
        let out = convolved.silu()?;
        let keys_width = hk * dk;
        let part = |from: i32, to: i32, heads: i32, dim: i32| -> Result<Array> {
            Ok(out.slice(&[0, 0, from], &[b, l, to], &[1, 1, 1])?.reshape(&[b, l, heads, dim])?)
        };
        let q = part(0, keys_width, hk, dk)?;
        let k = part(keys_width, 2 * keys_width, hk, dk)?;
        let v = part(2 * keys_width, 2 * keys_width + hv * dv, hv, dv)?;
        let inv_scale = f64::from(dk).powf(-0.5);
        let eps = (1e-6 * inv_scale * inv_scale) as f32;
        let q = fast::rms_norm(&q, None, eps)?.multiply_scalar(inv_scale * inv_scale)?;
        let k = fast::rms_norm(&k, None, eps)?.multiply_scalar(inv_scale)?;
        Ok(DeltaHeads { q, k, v })
    }
}

/// `down(silu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
pub(super) struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    pub(super) fn load(w: &Weights<'_>, p: &str, hidden: i32, width: i32) -> Result<Mlp> {
        Ok(Mlp {
            gate_proj: Linear::new(w.matrix(&format!("{p}gate_proj"), width, hidden)?),
            up_proj: Linear::new(w.matrix(&format!("{p}up_proj"), width, hidden)?),
            down_proj: Linear::new(w.matrix(&format!("{p}down_proj"), hidden, width)?),
        })
    }

    pub(super) fn forward(&self, x: &Array, ops: &Ops) -> Result<Array> {
        let gate = self.gate_proj.forward(x, ops)?;
        let up = self.up_proj.forward(x, ops)?;
        self.down_proj.forward(&gate.silu()?.multiply(&up)?, ops)
    }
}

/// Routed experts (softmax over every expert, the top k renormalized) plus a shared expert
/// scaled by its own sigmoid gate (mlx-lm's `Qwen3NextSparseMoeBlock`).
#[derive(Debug, Clone)]
pub(super) struct Moe {
    router: Linear,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    shared: Mlp,
    shared_gate: Linear,
    top_k: i32,
    normalize: bool,
}

/// Above this many routed rows, rows are sorted by expert before the gathered products (as
/// mlx-lm's `SwitchGLU` does from 64).
const SORT_ROUTES_FROM: usize = 64;

impl Moe {
    pub(super) fn load(w: &Weights<'_>, c: &TextConfig, p: &str) -> Result<Moe> {
        let (h, experts, width) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        let (gate, up, down) = if w.contains(&format!("{p}experts.gate_up_proj")) {
            // Hugging Face: one [E, 2·I, H] tensor for gate and up, [E, H, I] for down.
            let joined = w.get(&format!("{p}experts.gate_up_proj"), &[experts, 2 * width, h])?;
            let half =
                |from: i32| joined.slice(&[0, from, 0], &[experts, from + width, h], &[1, 1, 1]);
            (
                Matrix::Dense(half(0)?),
                Matrix::Dense(half(width)?),
                Matrix::Dense(w.get(&format!("{p}experts.down_proj"), &[experts, h, width])?),
            )
        } else {
            let s = format!("{p}switch_mlp.");
            (
                w.matrices(&format!("{s}gate_proj"), &[experts], width, h)?,
                w.matrices(&format!("{s}up_proj"), &[experts], width, h)?,
                w.matrices(&format!("{s}down_proj"), &[experts], h, width)?,
            )
        };
        Ok(Moe {
            router: Linear::new(w.matrix(&format!("{p}gate"), experts, h)?),
            gate,
            up,
            down,
            shared: Mlp::load(
                w,
                &format!("{p}shared_expert."),
                h,
                c.shared_expert_intermediate_size,
            )?,
            shared_gate: Linear::new(w.matrix(&format!("{p}shared_expert_gate"), 1, h)?),
            top_k: c.num_experts_per_tok,
            normalize: c.norm_topk_prob,
        })
    }

    pub(super) fn forward(&self, x: &Array, ops: &Ops) -> Result<Array> {
        let k = self.top_k;
        let gates = self.router.forward(x, ops)?.softmax(&[-1], true)?;
        let partitioned = gates.argpartition(-k, -1)?;
        let s = partitioned.shape();
        let last = s.len() - 1;
        let mut start = vec![0; s.len()];
        start[last] = s[last] - k;
        let routes = partitioned.slice(&start, &s, &vec![1; s.len()])?;
        let mut scores = gates.take_along_axis(&routes, -1)?;
        if self.normalize {
            scores = scores.divide(&scores.sum(&[-1], true)?)?;
        }
        let y = self.experts(x, &routes)?;
        let y = y.multiply(&scores.expand_dims(&[-1])?)?.sum(&[-2], false)?;
        let shared = self.shared.forward(x, ops)?;
        let shared = self.shared_gate.forward(x, ops)?.sigmoid()?.multiply(&shared)?;
        Ok(y.add(&shared)?)
    }

    /// Each row through its `k` experts' SwiGLU: `[B, L, k, H]`.
    fn experts(&self, x: &Array, routes: &Array) -> Result<Array> {
        let x = x.expand_dims(&[-2, -3])?; // [B, L, 1, 1, H]
        let k = f64::from(self.top_k);
        let glu = |x: &Array, routes: &Array, sorted: bool| -> Result<Array> {
            let up = gather_product(&self.up, x, None, routes, sorted)?;
            let gate = gather_product(&self.gate, x, None, routes, sorted)?;
            gather_product(&self.down, &gate.silu()?.multiply(&up)?, None, routes, sorted)
        };
        let y = if routes.size() >= SORT_ROUTES_FROM {
            let flat = routes.flatten(0, -1)?;
            let order = flat.argsort(0)?;
            let back = order.argsort(0)?;
            let rows = x.flatten(0, -3)?.take(&order.floor_divide(&order.scalar_like(k)?)?, 0)?;
            let y = glu(&rows, &flat.take(&order, 0)?, true)?.take(&back, 0)?;
            let mut shape = routes.shape();
            shape.extend(y.shape()[1..].iter().copied());
            y.reshape(&shape)?
        } else {
            glu(&x, routes, false)?
        };
        Ok(y.squeeze(&[-2])?)
    }
}

/// Loads the RMS norms whose stored weight is `w − 1` in the Hugging Face layout (they scale
/// by `1 + w` there, by `w` in MLX's), adding the 1 back in the weight's dtype as mlx-lm's
/// sanitize does.
#[derive(Debug, Clone, Copy)]
pub(super) struct NormLoader {
    pub(super) hf_layout: bool,
    pub(super) eps: f32,
}

impl NormLoader {
    pub(super) fn offset(&self, w: &Weights<'_>, name: &str, width: i32) -> Result<RmsNorm> {
        let weight = w.get(name, &[width])?;
        let weight = if self.hf_layout { weight.add_scalar(1.0)? } else { weight };
        Ok(RmsNorm::new(weight, self.eps))
    }
}

/// The error for a layer handed a cache of the other kind.
pub(super) fn wrong_cache(layer: usize, wants: &str, signature: &str) -> Error {
    Error::InvalidRequest(format!("layer {layer} is {wants} and needs its state, not {signature}"))
}
