//! Gemma attention: a stacked q/k/v projection, per-head q/k norms and Gemma 4's value norm
//! (scale 1 there; Gemma 3 scales by `query_pre_attn_scalar^-½`), rope per layer type
//! (proportional on Gemma 4's full layers, linear scaling on Gemma 3's), `attention_k_eq_v`,
//! and KV-shared layers that attend their donor's read.

use std::cell::OnceCell;

use mlx::Array;
use mlx::fast::{RopeFrequencies, RopeOffset};

use super::config::RopeParameters;
use crate::Phase;
use crate::nn::{Linear, RmsNorm, Stacked};
use cache::backend::{HeadsLayout, Ops, RopeSpec};
use cache::{AttentionCache, AttentionRead, Cache};
use cache::{Error, Result};

/// Rotary embedding of one layer type.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    /// Positions are multiplied by this (`1 / factor` for linear scaling).
    scale: f32,
    /// Periods for proportional rope (`inf` for the pairs that do not rotate).
    freqs: Option<Array>,
}

impl Rope {
    pub(crate) fn new(params: &RopeParameters, dims: i32, traditional: bool) -> Result<Rope> {
        // Linear scaling (Gemma 3's global layers): positions divided by the factor.
        let scale = if params.rope_type == "linear" {
            (1.0 / params.factor.unwrap_or(1.0)) as f32
        } else {
            1.0
        };
        let freqs = if params.rope_type == "proportional" {
            // As mlx-lm's ProportionalRoPE: rotated = int(dims · factor_partial), periods
            // factor · θ^(2i/dims) for the rotated pairs, infinite for the rest.
            let rotated = (f64::from(dims) * params.partial_rotary_factor.unwrap_or(1.0)) as i32;
            let factor = params.factor.unwrap_or(1.0);
            let mut periods: Vec<f32> = (0..rotated / 2)
                .map(|i| {
                    (factor * params.rope_theta.powf(f64::from(2 * i) / f64::from(dims))) as f32
                })
                .collect();
            periods.resize((dims / 2) as usize, f32::INFINITY);
            Some(Array::from_slice(&periods, &[dims / 2])?)
        } else {
            None
        };
        Ok(Rope { dims, traditional, base: params.rope_theta as f32, scale, freqs })
    }

    /// The rotation as the fused decode kernel takes it.
    fn spec(&self) -> RopeSpec<'_> {
        RopeSpec { traditional: self.traditional, base: self.base, freqs: self.freqs.as_ref() }
    }

    /// Rotates `x` for positions starting `delta` after `position`.
    fn apply(&self, x: &Array, position: &Position, delta: i32, ops: &Ops) -> Result<Array> {
        let frequencies = match &self.freqs {
            Some(f) => RopeFrequencies::Custom(f),
            None => RopeFrequencies::Base(self.base),
        };
        let shifted;
        let offset = match position {
            Position::At { at, .. } => RopeOffset::Fixed(at + delta),
            Position::Traced(p) | Position::Rows(p) if delta == 0 => RopeOffset::Array(p),
            Position::Rows(p) => {
                shifted = p.add(&Array::scalar(delta)?)?;
                RopeOffset::Array(&shifted)
            }
            Position::Traced(_) => {
                return Err(Error::InvalidRequest(
                    "a traced decode step has one position per row".into(),
                ));
            }
        };
        ops.rope(x, self.dims, self.traditional, frequencies, self.scale, offset)
    }
}

/// Where a forward pass's new positions start.
#[derive(Debug, Clone)]
pub(crate) enum Position {
    /// At this absolute position; `scalar` is it as an int32 array, made once for every layer
    /// of the pass that asks.
    At { at: i32, scalar: OnceCell<Array> },
    /// At the int32 scalar a compiled decode step takes as an input.
    Traced(Array),
    /// Each row of a batch at its own position: an int32 `[B]`.
    Rows(Array),
}

impl Position {
    /// At absolute position `at`.
    pub(crate) fn at(at: i32) -> Position {
        Position::At { at, scalar: OnceCell::new() }
    }

    /// Where the positions appended to `caches` start: their offset, or each row's in a batch.
    pub(crate) fn of(caches: &[Box<dyn Cache>]) -> Result<Position> {
        match cache::stack_row_offsets(caches) {
            Some(rows) if rows.len() > 1 => {
                let rows: Vec<i32> = rows.iter().map(|&o| o as i32).collect();
                Ok(Position::Rows(Array::from_slice(&rows, &[rows.len() as i32])?))
            }
            // A single sequence, or a batch of one row: at its offset.
            _ => Ok(Position::at(cache::stack_offset(caches) as i32)),
        }
    }

    /// `delta` positions later.
    pub(crate) fn advanced(&self, delta: i32) -> Result<Position> {
        Ok(match self {
            Position::At { at, .. } => Position::at(at + delta),
            Position::Rows(p) => Position::Rows(p.add(&Array::scalar(delta)?)?),
            traced => traced.clone(),
        })
    }

    /// The position as a compiled decode step takes it: an int32 scalar for one sequence, or
    /// `[B]` for a batch's rows.
    pub(crate) fn input(&self) -> Result<Array> {
        match self {
            Position::Rows(rows) => Ok(rows.clone()),
            one => one.scalar(),
        }
    }

    /// The position as an int32 scalar array.
    fn scalar(&self) -> Result<Array> {
        match self {
            Position::Traced(p) => Ok(p.clone()),
            Position::Rows(_) => {
                Err(Error::InvalidRequest("a batch's rows are at positions of their own".into()))
            }
            Position::At { at, scalar } => {
                if let Some(made) = scalar.get() {
                    return Ok(made.clone());
                }
                let made = Array::scalar(*at)?;
                let _ = scalar.set(made.clone());
                Ok(made)
            }
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Attention {
    /// The query projection, then the key and value projections on a layer with its own keys
    /// (the value one absent with `attention_k_eq_v`): one stacked product.
    pub(super) proj: Stacked,
    /// `None` on KV-shared layers.
    pub(super) kv: Option<KeyValue>,
    pub(super) o_proj: Linear,
    pub(super) q_norm: RmsNorm,
    pub(super) heads: i32,
    pub(crate) head_dim: i32,
    pub(crate) sliding: bool,
    /// The attention scale (1 where the q/k norms replace `1/√d`).
    pub(super) scale: f32,
}

#[derive(Debug, Clone)]
pub(super) struct KeyValue {
    /// `attention_k_eq_v`: values are the raw `k_proj` output (no `v_proj`).
    pub(super) k_eq_v: bool,
    pub(super) k_norm: RmsNorm,
    /// Gemma 4 norms the values (without a weight); Gemma 3 does not.
    pub(super) v_norm: Option<RmsNorm>,
    pub(super) kv_heads: i32,
}

/// What one layer's attention reads besides its input.
pub(crate) struct Context<'a, 'b> {
    pub(crate) rope: &'a Rope,
    pub(crate) position: &'a Position,
    /// The layer's own cache (layers with keys and values).
    pub(crate) cache: Option<&'b mut dyn AttentionCache>,
    /// The donor's read (KV-sharing layers).
    pub(crate) shared: Option<&'a AttentionRead>,
    pub(crate) phase: Phase<'a>,
    pub(crate) ops: &'a Ops,
}

impl Attention {
    /// Key/value heads of a layer with its own keys (0 on a KV-shared layer).
    pub(crate) fn kv_heads(&self) -> i32 {
        self.kv.as_ref().map_or(0, |kv| kv.kv_heads)
    }

    /// Returns the output and, for a layer with its own cache, the read KV-sharing layers use.
    /// Keys and values come from every row of `x`; queries from its last `query_rows` rows
    /// (all of them outside a last-row-only prefill).
    pub(crate) fn forward(
        &self,
        x: &Array,
        query_rows: i32,
        at: Context<'_, '_>,
    ) -> Result<(Array, Option<AttentionRead>)> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let ops = at.ops;
        let joined = self.proj.forward_joined(x, ops)?;
        let fused = match &joined {
            Some(joined) if l == 1 && query_rows == 1 => {
                self.decode_heads(joined, at.rope, at.position, ops)?
            }
            _ => None,
        };
        let (q, new_kv) = match fused {
            Some(heads) => (heads.q, heads.kv),
            None => {
                let parts = match &joined {
                    Some(joined) => self.proj.split(joined, ops)?,
                    None => self.proj.forward(x, ops)?,
                };
                self.heads_by_ops(&parts, query_rows, at.rope, at.position, ops)?
            }
        };
        let (read, own) = match (&self.kv, at.shared, new_kv) {
            (Some(_), _, Some((k, v))) => {
                let cache = at.cache.ok_or_else(|| {
                    Error::InvalidRequest("a layer with keys and values needs a cache".into())
                })?;
                let read = at.phase.append(cache, &k, &v)?;
                (read.clone(), Some(read))
            }
            (None, Some(donor), _) => (donor.clone(), None),
            _ => {
                return Err(Error::InvalidRequest(
                    "KV-shared layer without its donor's read".into(),
                ));
            }
        };
        let out = read.attend(&q, self.scale)?;
        let width = self.heads * self.head_dim;
        let out = if query_rows == 1 {
            out.reshape(&[b, 1, width])? // one row: [B, H, 1, D] is already in [B, 1, H·D] order
        } else {
            out.transpose(&[0, 2, 1, 3])?.reshape(&[b, query_rows, width])?
        };
        Ok((self.o_proj.forward(&out, ops)?, own))
    }

    /// Queries, keys and values of one position by the backend's kernel, from the stacked
    /// projection; `None` where none runs.
    fn decode_heads(
        &self,
        joined: &Array,
        rope: &Rope,
        position: &Position,
        ops: &Ops,
    ) -> Result<Option<cache::backend::Heads>> {
        // The kernel rotates whole heads at scale 1 and norms the values.
        let plain_values = self.kv.as_ref().is_some_and(|kv| kv.v_norm.is_none());
        let batched = matches!(position, Position::Rows(_));
        if rope.dims != self.head_dim
            || rope.scale != 1.0
            || plain_values
            || batched
            || !ops.has_kernels()
        {
            return Ok(None);
        }
        let (kv_heads, values_at, k_norm) = match &self.kv {
            Some(kv) => {
                let values_at = if kv.k_eq_v { self.heads } else { self.heads + kv.kv_heads };
                (kv.kv_heads, values_at, &kv.k_norm)
            }
            None => (0, self.heads, &self.q_norm),
        };
        let layout = HeadsLayout {
            head_dim: self.head_dim,
            q_heads: self.heads,
            kv_heads,
            values_at,
            q_norm: &self.q_norm,
            k_norm,
        };
        ops.decode_heads(joined, &layout, &rope.spec(), &position.scalar()?)
    }

    /// Queries (from the last `query_rows` rows) and, on a layer with its own keys, keys and
    /// values, by MLX ops from each projection's output `parts`.
    fn heads_by_ops(
        &self,
        parts: &[Array],
        query_rows: i32,
        rope: &Rope,
        position: &Position,
        ops: &Ops,
    ) -> Result<(Array, Option<(Array, Array)>)> {
        let raw_q = &parts[0];
        let s = raw_q.shape();
        let (b, l) = (s[0], s[1]);
        let raw_q = if query_rows < l {
            raw_q.slice(&[0, l - query_rows, 0], &[b, l, s[2]], &[1, 1, 1])?
        } else {
            raw_q.clone()
        };
        let q = heads_first(&raw_q, self.heads, self.head_dim, |q| self.q_norm.forward(q))?;
        let q = rope.apply(&q, position, l - query_rows, ops)?; // [B, H, Lq, D]
        let Some(kv) = &self.kv else { return Ok((q, None)) };
        let (raw_k, raw_v) = match parts {
            [_, k] if kv.k_eq_v => (k, k), // attention_k_eq_v: values from k_proj, before k_norm
            [_, k, v] => (k, v),
            _ => {
                return Err(Error::InvalidRequest(format!(
                    "an attention layer with {} projections",
                    parts.len()
                )));
            }
        };
        let k = heads_first(raw_k, kv.kv_heads, self.head_dim, |k| kv.k_norm.forward(k))?;
        let k = rope.apply(&k, position, 0, ops)?;
        let v = heads_first(raw_v, kv.kv_heads, self.head_dim, |v| match &kv.v_norm {
            Some(norm) => norm.forward(v),
            None => Ok(v.clone()),
        })?;
        Ok((q, Some((k, v))))
    }
}

/// A projection `[B, L, H·D]` as heads `[B, H, L, D]`, with `norm` applied over `D`. For one
/// position a single reshape gives the same order (no transpose node: a decode step runs a few
/// hundred fewer ops, and on CUDA each op costs host time).
fn heads_first(
    x: &Array,
    heads: i32,
    head_dim: i32,
    norm: impl FnOnce(&Array) -> Result<Array>,
) -> Result<Array> {
    let s = x.shape();
    let (b, l) = (s[0], s[1]);
    if l == 1 {
        norm(&x.reshape(&[b, heads, 1, head_dim])?)
    } else {
        Ok(norm(&x.reshape(&[b, l, heads, head_dim])?)?.transpose(&[0, 2, 1, 3])?)
    }
}
