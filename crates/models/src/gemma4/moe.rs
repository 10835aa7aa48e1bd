//! The mixture-of-experts block of Gemma 4 26B-A4B, beside each layer's dense MLP: mlx-lm's
//! `Router` and `SwitchGLU`, with its expert-sorted route for large token batches.

use std::cell::RefCell;

use mlx::{Array, ops};

use super::config::Gemma4TextConfig;
use crate::checkpoint::{Matrix, Weights};
use crate::nn::{Activations, Linear, RmsNorm, gather_product};
use cache::Result;
use cache::backend::Ops;

/// The mixture-of-experts block of a layer (mlx-lm `Router`, `Experts`/`SwitchGLU`): each
/// token goes to its `top_k` best-scored experts, whose GeGLU outputs, weighted by the softmax
/// of their scores times a per-expert scale, are summed next to the dense MLP's.
#[derive(Debug, Clone)]
pub(super) struct Moe {
    /// RMS norm with `router.scale · hidden^-½` as its weight.
    router_norm: RmsNorm,
    router: Linear,
    /// `[experts]`.
    per_expert_scale: Array,
    /// `[experts, width, hidden]`, `[experts, width, hidden]`, `[experts, hidden, width]`.
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    top_k: i32,
    /// int32 `[experts - top_k, experts)`: where the top k sit after the partition.
    last_k: Array,
    /// `pre_feedforward_layernorm_2`: the experts' input.
    pre_norm: RmsNorm,
    /// `post_feedforward_layernorm_1`, on the dense MLP's output.
    post_norm_mlp: RmsNorm,
    /// `post_feedforward_layernorm_2`, on the experts' output.
    post_norm_experts: RmsNorm,
    /// The rows the expert products read for the last routes' shape (see
    /// [`Moe::row_indices`]).
    rows: RefCell<Option<RouteRows>>,
}

/// A layer's router and experts: mlx-lm's names (`experts.switch_glu.{gate,up,down}_proj`,
/// dense or quantized) or Hugging Face's (`experts.gate_up_proj` `[experts, 2·width, hidden]`
/// and `experts.down_proj`, dense).
pub(super) fn load_moe(
    w: &Weights<'_>,
    c: &Gemma4TextConfig,
    p: &str,
    norm: &dyn Fn(&str) -> Result<RmsNorm>,
) -> Result<Moe> {
    let hidden = c.hidden_size;
    let (experts, top_k) = (c.num_experts.unwrap_or(0), c.top_k_experts.unwrap_or(0));
    let width = c.moe_intermediate_size.unwrap_or(0);
    let r = format!("{p}router.");
    let scale = w.get(&format!("{r}scale"), &[hidden])?;
    // As mlx-lm: the scale times hidden^-½ (a Python float, so in the scale's dtype).
    let norm_weight = scale.multiply_scalar(f64::from(hidden).powf(-0.5))?;
    let x = format!("{p}experts.");
    let (gate, up, down) = if w.contains(&format!("{x}gate_up_proj")) {
        let joined = w.get(&format!("{x}gate_up_proj"), &[experts, 2 * width, hidden])?;
        let half =
            |from: i32| joined.slice(&[0, from, 0], &[experts, from + width, hidden], &[1, 1, 1]);
        (
            Matrix::Dense(half(0)?),
            Matrix::Dense(half(width)?),
            Matrix::Dense(w.get(&format!("{x}down_proj"), &[experts, hidden, width])?),
        )
    } else {
        let s = format!("{x}switch_glu.");
        (
            w.matrices(&format!("{s}gate_proj"), &[experts], width, hidden)?,
            w.matrices(&format!("{s}up_proj"), &[experts], width, hidden)?,
            w.matrices(&format!("{s}down_proj"), &[experts], hidden, width)?,
        )
    };
    Ok(Moe {
        router_norm: RmsNorm::new(norm_weight, c.rms_norm_eps),
        router: Linear::new(w.matrix(&format!("{r}proj"), experts, hidden)?),
        per_expert_scale: w.get(&format!("{r}per_expert_scale"), &[experts])?,
        gate,
        up,
        down,
        top_k,
        last_k: Array::from_slice(&((experts - top_k)..experts).collect::<Vec<i32>>(), &[top_k])?,
        pre_norm: norm("pre_feedforward_layernorm_2")?,
        post_norm_mlp: norm("post_feedforward_layernorm_1")?,
        post_norm_experts: norm("post_feedforward_layernorm_2")?,
        rows: RefCell::new(None),
    })
}

/// Which row of its input each routed product reads, `[B, L, k]` for routes `[B, L, k]`.
#[derive(Debug, Clone)]
struct RouteRows {
    /// The token's row, `b·L + l` (the gate and up products read `[B, L, 1, 1, H]`).
    token: Array,
    /// The route's own row, `(b·L + l)·k + j` (the down product reads `[B, L, k, 1, W]`).
    route: Array,
}

/// Token batches at least this large (token count × `top_k`) are sorted by expert before the
/// expert products, as mlx-lm does (same rows, read in expert order).
const SORT_ROUTES_FROM: usize = 64;

impl Moe {
    /// Weight bytes one token reads: the router and its `top_k` experts' share of the stacks.
    pub(super) fn decode_weight_bytes(&self) -> usize {
        let stacks = self.gate.nbytes() + self.up.nbytes() + self.down.nbytes();
        let experts = self.per_expert_scale.size().max(1);
        self.router.nbytes() + stacks * self.top_k as usize / experts
    }

    /// The dense MLP's output `mlp` `[B, L, H]` combined with the experts' for the residual
    /// stream `h`: `post₁(mlp) + post₂(experts(pre₂(h)))`.
    pub(super) fn forward(
        &self,
        h: &Array,
        mlp: &Array,
        act: &Activations,
        ops: &Ops,
    ) -> Result<Array> {
        let (routes, weights) = self.route(h, ops)?;
        let experts = self.experts(&self.pre_norm.forward(h)?, &routes, &weights, act, ops)?;
        Ok(self.post_norm_mlp.forward(mlp)?.add(&self.post_norm_experts.forward(&experts)?)?)
    }

    /// The `top_k` experts of each token `[B, L, k]` and their weights.
    fn route(&self, h: &Array, ops: &Ops) -> Result<(Array, Array)> {
        let scores = self.router.forward(&self.router_norm.forward(h)?, ops)?;
        let partitioned = scores.argpartition(-self.top_k, -1)?;
        let routes = ops.last_along(&partitioned, self.top_k, &self.last_k)?;
        let weights = scores.take_along_axis(&routes, -1)?.softmax(&[-1], false)?;
        let weights = weights.multiply(&self.per_expert_scale.take(&routes, 0)?)?;
        Ok((routes, weights))
    }

    /// mlx-lm's `SwitchGLU` then the weighted sum over the `k` experts: `[B, L, H]`.
    fn experts(
        &self,
        x: &Array,
        routes: &Array,
        weights: &Array,
        act: &Activations,
        ops: &Ops,
    ) -> Result<Array> {
        let x = x.expand_dims(&[-2, -3])?; // [B, L, 1, 1, H]
        let sorted = routes.size() >= SORT_ROUTES_FROM;
        let y = if sorted {
            // Rows in expert order (each token's row once per route), products, then back.
            let flat = routes.flatten(0, -1)?;
            let order = flat.argsort(0)?;
            let back = order.argsort(0)?;
            let rows = x
                .flatten(0, -3)?
                .take(&order.floor_divide(&order.scalar_like(f64::from(self.top_k))?)?, 0)?;
            let by_expert = flat.take(&order, 0)?;
            let y = self.glu(&rows, None, &by_expert, true, act)?.take(&back, 0)?;
            let mut shape = routes.shape();
            shape.extend(y.shape()[1..].iter().copied());
            y.reshape(&shape)?
        } else {
            let rows = self.row_indices(routes, ops)?;
            self.glu(&x, rows.as_ref(), routes, false, act)?
        };
        let y = y.squeeze(&[-2])?; // [B, L, k, H]
        Ok(weights.expand_dims(&[-1])?.multiply(&y)?.sum(&[-2], false)?)
    }

    /// The rows the expert products read (see [`RouteRows`]), evaluated constants made once per
    /// routes' shape. Without them MLX makes the same indices in every gathered product (an
    /// `Arange` and a `Reshape` in each, a `Broadcast` in two: 8 ops a layer per step). `None` inside a
    /// traced step, whose shapes are not fixed: MLX's own indices then.
    fn row_indices(&self, routes: &Array, ops: &Ops) -> Result<Option<RouteRows>> {
        if ops.is_shapeless() {
            return Ok(None);
        }
        let shape = routes.shape();
        if let Some(rows) = self.rows.borrow().as_ref().filter(|r| r.route.shape() == shape) {
            return Ok(Some(rows.clone()));
        }
        let (b, l, k) = (shape[0], shape[1], shape[2]);
        let count = |n: i32| ops::arange(0.0, f64::from(n), 1.0, routes.dtype());
        let rows = RouteRows {
            token: count(b * l)?.reshape(&[b, l, 1])?.broadcast_to(&shape)?,
            route: count(b * l * k)?.reshape(&shape)?,
        };
        mlx::eval(&[&rows.token, &rows.route])?;
        *self.rows.borrow_mut() = Some(rows.clone());
        Ok(Some(rows))
    }

    fn glu(
        &self,
        x: &Array,
        rows: Option<&RouteRows>,
        routes: &Array,
        sorted: bool,
        act: &Activations,
    ) -> Result<Array> {
        let token = rows.map(|r| &r.token);
        let up = gather_product(&self.up, x, token, routes, sorted)?;
        let gate = gather_product(&self.gate, x, token, routes, sorted)?;
        gather_product(&self.down, &act.geglu(&gate, &up)?, rows.map(|r| &r.route), routes, sorted)
    }
}
