//! Recurrent state for one gated DeltaNet layer (Qwen3.5's linear-attention layers): the tail
//! of the causal convolution's input and the delta rule's state, which do not grow with the
//! sequence and cannot be trimmed.
//!
//! The block keeps its projections, norms and gates; it hands this cache its projected inputs
//! and lends the layer's recurrence weights ([`GatedDeltaLayer`]). The cache runs the depthwise
//! convolution over its stored tail, the layer's glue into heads, and the gated delta rule
//! (mlx-lm 0.32.2's `gated_delta_ops`, op for op), and replaces both states.
//!
//! A speculative round records the state before its first call and each call's inputs to the
//! recurrence; `rollback(keep)` restores the recorded state and replays the first `keep`
//! positions through the same steps, so the cache holds bit for bit what appending only those
//! positions would have left (the upstream seed's `GatedDeltaCache`).

use mlx::{Array, Dtype, ops};

use super::{Cache, CacheState, check_signature, round_error, state_tensor};
use crate::error::{Error, Result};

/// The geometry of one gated DeltaNet layer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    /// Taps of the depthwise convolution (`linear_conv_kernel_dim`).
    pub kernel: usize,
    /// Key heads (`linear_num_key_heads`).
    pub key_heads: usize,
    /// Value heads (`linear_num_value_heads`, a multiple of the key heads).
    pub value_heads: usize,
    /// Width of a key head.
    pub key_dim: usize,
    /// Width of a value head.
    pub value_dim: usize,
}

impl DeltaShape {
    /// Channels of the convolution: queries, keys and values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Bytes of the state of one row: the convolution tail in the activations' dtype and the
    /// recurrent state in float32.
    pub fn state_bytes(&self, dtype_bytes: usize) -> usize {
        (self.kernel - 1) * self.conv_dim() * dtype_bytes
            + self.value_heads * self.value_dim * self.key_dim * 4
    }
}

/// A gated DeltaNet block's heads for one call: `q`, `k` `[B, S, Hk, Dk]` normalized and scaled
/// by the block, `v` `[B, S, Hv, Dv]`.
#[derive(Debug, Clone)]
pub struct DeltaHeads {
    /// Queries.
    pub q: Array,
    /// Keys.
    pub k: Array,
    /// Values.
    pub v: Array,
}

/// What a gated DeltaNet block lends its cache for one call: the recurrence weights and its
/// glue between the convolution and the recurrence.
pub trait GatedDeltaLayer {
    /// The depthwise convolution's weight `[conv_dim, K, 1]` (MLX's channels-last layout).
    fn conv_weight(&self) -> &Array;
    /// `A_log` `[Hv]`.
    fn a_log(&self) -> &Array;
    /// `dt_bias` `[Hv]`.
    fn dt_bias(&self) -> &Array;
    /// The activation of the convolution's output `[B, S, conv_dim]`, its split into heads
    /// and their norms and scale.
    fn heads(&self, convolved: &Array) -> Result<DeltaHeads>;
}

/// A cache that owns a gated DeltaNet layer's state and its recurrence. The method is the
/// phase. `qkv` `[B, S, conv_dim]` is the block's `in_proj_qkv` output before the convolution,
/// `a` and `b` `[B, S, Hv]` the raw `in_proj_a` and `in_proj_b` outputs; the output is the
/// recurrence's `[B, S, Hv, Dv]`, which the block gates and projects.
pub trait GatedDeltaCache: Cache {
    /// One new position (`S` = 1).
    fn recur_decode(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array>;
    /// `S` new positions: prefill chunks, verify windows.
    fn recur_window(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array>;
    /// `S` positions per row of which the first `left_pad[r]` of row `r` are padding (rows
    /// right-justified, as a batch's prefill cohort holds them): padded positions change
    /// neither state, each row's convolution reads its stored tail right before its first
    /// real position and its next tail ends at its last real position. Outputs at padded
    /// positions are unspecified. The offset advances by `S` (the batch's positions; each
    /// row's own count is its layout's). Not inside a speculative round.
    fn recur_window_padded(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        left_pad: &[usize],
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array>;
}

/// The inputs of the recurrence for some positions, as a round keeps them for a replay.
#[derive(Debug, Clone)]
struct Steps {
    /// The convolution's input rows (`qkv`) `[B, S, conv_dim]`.
    qkv: Array,
    /// Queries and keys repeated to the value heads `[B, S, Hv, Dk]`, values `[B, S, Hv, Dv]`.
    q: Array,
    k: Array,
    v: Array,
    /// Decay `[B, S, Hv]` (float32) and `β` `[B, S, Hv]`.
    g: Array,
    beta: Array,
}

impl Steps {
    /// Row `r` of every input.
    fn row(&self, r: i32) -> Result<Steps> {
        Ok(Steps {
            qkv: batch_row(&self.qkv, r)?,
            q: batch_row(&self.q, r)?,
            k: batch_row(&self.k, r)?,
            v: batch_row(&self.v, r)?,
            g: batch_row(&self.g, r)?,
            beta: batch_row(&self.beta, r)?,
        })
    }
}

/// Row `r` of `x` (its first axis), kept as a batch of one.
pub(super) fn batch_row(x: &Array, r: i32) -> Result<Array> {
    let s = x.shape();
    let mut start = vec![0; s.len()];
    let mut stop = s.clone();
    start[0] = r;
    stop[0] = r + 1;
    Ok(x.slice(&start, &stop, &vec![1; s.len()])?)
}

/// What a round goes back to, and what it replays.
#[derive(Debug)]
struct Round {
    conv: Option<Array>,
    state: Option<Array>,
    offset: usize,
    calls: Vec<Steps>,
}

/// [`GatedDeltaCache`]'s storage: the convolution tail `[B, K − 1, conv_dim]` and the
/// recurrent state `[B, Hv, Dv, Dk]` in float32 (mlx-lm's `ArraysCache(size=2)`).
#[derive(Debug)]
pub struct RecurrentCache {
    shape: DeltaShape,
    conv: Option<Array>,
    state: Option<Array>,
    offset: usize,
    round: Option<Round>,
}

impl RecurrentCache {
    /// An empty cache for a layer of `shape`.
    pub fn new(shape: DeltaShape) -> RecurrentCache {
        RecurrentCache { shape, conv: None, state: None, offset: 0, round: None }
    }

    /// A cache holding `conv` `[B, K − 1, conv_dim]` and `state` `[B, Hv, Dv, Dk]` (float32)
    /// at `offset` (both absent: empty).
    pub(super) fn from_parts(
        shape: DeltaShape,
        parts: Option<(Array, Array)>,
        offset: usize,
    ) -> RecurrentCache {
        let (conv, state) = parts.unzip();
        RecurrentCache { shape, conv, state, offset, round: None }
    }

    /// Its geometry.
    pub(super) fn shape(&self) -> DeltaShape {
        self.shape
    }

    /// Its convolution tail and state, `rows` rows of zeros (the tail in `dtype`) when it is
    /// empty.
    pub(super) fn parts_or_zeros(&self, rows: i32, dtype: Dtype) -> Result<(Array, Array)> {
        let (tail, channels) = ((self.shape.kernel - 1) as i32, self.shape.conv_dim() as i32);
        let conv = match &self.conv {
            Some(conv) => conv.clone(),
            None => ops::zeros(&[rows, tail, channels], dtype)?,
        };
        Ok((conv, self.state_or_zeros(rows)?))
    }

    /// Rows in its state (`None` while empty).
    pub(super) fn rows(&self) -> Option<i32> {
        self.conv.as_ref().and_then(|c| c.dim(0).ok())
    }

    /// Whether a round is armed.
    pub(super) fn in_round(&self) -> bool {
        self.round.is_some()
    }

    /// Resolves the armed round keeping the first `keeps[r]` of the positions it appended to
    /// row `r`: each row is then bit for bit what appending only its kept positions leaves
    /// (rows keeping everything keep their state; the others restore the round's and replay
    /// their kept positions). The offset becomes the round's plus the most any row kept (the
    /// batch's count; each row's own count is its layout's).
    pub(super) fn spec_round_rollback_rows(&mut self, keeps: &[usize]) -> Result<()> {
        let Some(round) = self.round.take() else {
            return Err(round_error("rollback without a round"));
        };
        let appended = self.offset - round.offset;
        let rows = self.rows().unwrap_or(0);
        if keeps.len() != rows as usize || keeps.iter().any(|&k| k > appended) {
            self.round = Some(round);
            return Err(round_error(&format!(
                "keep counts {keeps:?} for {rows} rows of {appended} appended positions"
            )));
        }
        if let Some(&first) = keeps.first().filter(|&&k| keeps.iter().all(|&o| o == k)) {
            self.round = Some(round);
            return self.spec_round_rollback(first);
        }
        let dtype = round.calls.first().map_or(Dtype::Float32, |c| c.qkv.dtype());
        let before = RecurrentCache::from_parts(
            self.shape,
            round.conv.clone().zip(round.state.clone()),
            round.offset,
        )
        .parts_or_zeros(rows, dtype)?;
        let (now_conv, now_state) = self.parts_or_zeros(rows, dtype)?;
        let mut convs = Vec::with_capacity(keeps.len());
        let mut states = Vec::with_capacity(keeps.len());
        for (r, &keep) in keeps.iter().enumerate() {
            let r = r as i32;
            if keep == appended {
                convs.push(batch_row(&now_conv, r)?);
                states.push(batch_row(&now_state, r)?);
                continue;
            }
            let (conv, state) = (batch_row(&before.0, r)?, batch_row(&before.1, r)?);
            if keep == 0 {
                convs.push(conv);
                states.push(state);
                continue;
            }
            let steps = kept(&round.calls, keep)?.row(r)?;
            let input = ops::concatenate(&[&conv, &steps.qkv], 1)?;
            let (_, state) = recurrence(&steps, &state)?;
            convs.push(self.tail_of(&input)?);
            states.push(state);
        }
        let join = |parts: &[Array]| -> Result<Array> {
            Ok(ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?)
        };
        self.conv = Some(join(&convs)?);
        self.state = Some(join(&states)?);
        self.offset = round.offset + keeps.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    fn append(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
        decode: bool,
    ) -> Result<Array> {
        let length = self.check(qkv, a, b, decode)?;
        let batch = qkv.dim(0)?;
        self.check_rows(batch)?;
        let input = self.conv_input(qkv)?;
        let channels = self.shape.conv_dim() as i32;
        let convolved = ops::conv1d(&input, layer.conv_weight(), 1, 0, 1, channels)?;
        let heads = layer.heads(&convolved)?;
        let steps = self.steps(qkv.clone(), heads, a, b, layer)?;
        let before = self.state_or_zeros(batch)?;
        let (y, state) = recurrence(&steps, &before)?;
        if let Some(round) = &mut self.round {
            round.calls.push(steps);
        }
        self.conv = Some(self.tail_of(&input)?);
        self.state = Some(state);
        self.offset += length;
        Ok(y)
    }

    /// A padded prefill cohort's window ([`super::Cohort`]) on this fresh cache standing in
    /// for every row: `qkv`, `a`, `b` `[B, S, ·]`, of which row `r`'s first `lengths[r]`
    /// positions are its own and the rest padding on the right. Padded positions change
    /// neither state (they neither decay nor learn; the convolution is causal, so no real
    /// position reads them). Returns the recurrence's output (unspecified at padded positions)
    /// and each row's own cache after its positions: its state, and the convolution tail
    /// ending at its last position, as appending them alone leaves them. This cache is
    /// unchanged.
    pub(super) fn cohort_window(
        &self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        lengths: &[usize],
        layer: &dyn GatedDeltaLayer,
    ) -> Result<(Array, Vec<RecurrentCache>)> {
        if self.offset > 0 || self.round.is_some() {
            return Err(Error::InvalidRequest(
                "a prefill cohort starts from an empty gated DeltaNet cache".into(),
            ));
        }
        let length = self.check(qkv, a, b, false)?;
        let batch = qkv.dim(0)?;
        if lengths.len() != batch as usize || lengths.iter().any(|&n| n > length) {
            return Err(Error::InvalidRequest(format!(
                "row lengths {lengths:?} for {batch} rows of {length} positions"
            )));
        }
        let input = self.conv_input(qkv)?;
        let channels = self.shape.conv_dim() as i32;
        let convolved = ops::conv1d(&input, layer.conv_weight(), 1, 0, 1, channels)?;
        let heads = layer.heads(&convolved)?;
        let mut steps = self.steps(qkv.clone(), heads, a, b, layer)?;
        // At a padded position the state neither decays (g = 1) nor learns (β = 0).
        let flags: Vec<bool> =
            lengths.iter().flat_map(|&n| (0..length).map(move |i| i >= n)).collect();
        let padded = crate::uploads::bools(&flags, &[batch, length as i32, 1])?;
        steps.g = ops::where_(&padded, &steps.g.scalar_like(1.0)?, &steps.g)?;
        steps.beta = ops::where_(&padded, &steps.beta.scalar_like(0.0)?, &steps.beta)?;
        let (y, state) = recurrence(&steps, &self.state_or_zeros(batch)?)?;
        let tail = (self.shape.kernel - 1) as i32;
        let rows = lengths
            .iter()
            .enumerate()
            .map(|(r, &n)| -> Result<RecurrentCache> {
                if n == 0 {
                    return Ok(RecurrentCache::new(self.shape));
                }
                let (r, n) = (r as i32, n as i32);
                // Input row `K − 1 + i` is position `i`: the tail ends at position `n − 1`.
                let conv = input.slice(&[r, n, 0], &[r + 1, n + tail, channels], &[1, 1, 1])?;
                let parts = (conv.contiguous()?, batch_row(&state, r)?);
                Ok(RecurrentCache::from_parts(self.shape, Some(parts), n as usize))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((y, rows))
    }

    /// [`GatedDeltaCache::recur_window_padded`].
    fn append_padded(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        left_pad: &[usize],
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        if self.round.is_some() {
            return Err(round_error("no padded window inside a round"));
        }
        let length = self.check(qkv, a, b, false)?;
        let batch = qkv.dim(0)?;
        if left_pad.len() != batch as usize || left_pad.iter().any(|&p| p > length) {
            return Err(Error::InvalidRequest(format!(
                "left padding {left_pad:?} for {batch} rows of {length} positions"
            )));
        }
        self.check_rows(batch)?;
        // Each row's convolution input: its padding (zeros), its stored tail, its real rows.
        let unpadded = self.conv_input(qkv)?;
        let tail = (self.shape.kernel - 1) as i32;
        let channels = self.shape.conv_dim() as i32;
        let s = length as i32;
        let rows = (0..batch)
            .map(|r| -> Result<Array> {
                let pad = left_pad[r as usize] as i32;
                let row = unpadded.slice(&[r, 0, 0], &[r + 1, tail + s, channels], &[1, 1, 1])?;
                if pad == 0 {
                    return Ok(row);
                }
                let stored = row.slice(&[0, 0, 0], &[1, tail, channels], &[1, 1, 1])?;
                let real = row.slice(&[0, tail + pad, 0], &[1, tail + s, channels], &[1, 1, 1])?;
                let zeros = ops::zeros(&[1, pad, channels], qkv.dtype())?;
                Ok(ops::concatenate(&[&zeros, &stored, &real], 1)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let input = ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?;
        let convolved = ops::conv1d(&input, layer.conv_weight(), 1, 0, 1, channels)?;
        let heads = layer.heads(&convolved)?;
        let mut steps = self.steps(qkv.clone(), heads, a, b, layer)?;
        // At a padded position the state neither decays (g = 1) nor learns (β = 0).
        let flags: Vec<bool> =
            left_pad.iter().flat_map(|&p| (0..length).map(move |i| i < p)).collect();
        let padded = crate::uploads::bools(&flags, &[batch, s, 1])?;
        steps.g = ops::where_(&padded, &steps.g.scalar_like(1.0)?, &steps.g)?;
        steps.beta = ops::where_(&padded, &steps.beta.scalar_like(0.0)?, &steps.beta)?;
        let before = self.state_or_zeros(batch)?;
        let (y, state) = recurrence(&steps, &before)?;
        self.conv = Some(self.tail_of(&input)?);
        self.state = Some(state);
        self.offset += length;
        Ok(y)
    }

    /// The recurrence's inputs from the block's heads and gates: `β = σ(b)`, the decay
    /// `g = exp(−exp(A_log) · softplus(a + dt_bias))` in float32, and queries and keys repeated
    /// to the value heads (each key head serves `Hv / Hk` consecutive value heads).
    fn steps(
        &self,
        qkv: Array,
        heads: DeltaHeads,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Steps> {
        let beta = b.sigmoid()?;
        let softplus =
            a.add(layer.dt_bias())?.logaddexp(&Array::scalar(0.0f32)?.astype(a.dtype())?)?;
        let g =
            layer.a_log().astype(Dtype::Float32)?.exp()?.negative()?.multiply(&softplus)?.exp()?;
        let repeat = (self.shape.value_heads / self.shape.key_heads) as i32;
        let spread =
            |x: &Array| -> Result<Array> {
                if repeat == 1 {
                    return Ok(x.clone());
                }
                let s = x.shape();
                Ok(x.expand_dims(&[3])?
                    .broadcast_to(&[s[0], s[1], s[2], repeat, s[3]])?
                    .reshape(&[s[0], s[1], s[2] * repeat, s[3]])?)
            };
        Ok(Steps { qkv, q: spread(&heads.q)?, k: spread(&heads.k)?, v: heads.v, g, beta })
    }

    /// The convolution's input: the stored tail (zeros before the first append), then `qkv`.
    fn conv_input(&self, qkv: &Array) -> Result<Array> {
        let conv = match &self.conv {
            Some(conv) => conv.clone(),
            None => {
                let (tail, channels) =
                    ((self.shape.kernel - 1) as i32, self.shape.conv_dim() as i32);
                ops::zeros(&[qkv.dim(0)?, tail, channels], qkv.dtype())?
            }
        };
        Ok(ops::concatenate(&[&conv, qkv], 1)?)
    }

    /// The last `K − 1` rows of a convolution input, in a buffer of their own: the next tail.
    fn tail_of(&self, input: &Array) -> Result<Array> {
        let s = input.shape();
        let tail = (self.shape.kernel - 1) as i32;
        Ok(input.slice(&[0, s[1] - tail, 0], &s, &[1, 1, 1])?.contiguous()?)
    }

    fn state_or_zeros(&self, batch: i32) -> Result<Array> {
        match &self.state {
            Some(state) => Ok(state.clone()),
            None => {
                let s = &self.shape;
                Ok(ops::zeros(
                    &[batch, s.value_heads as i32, s.value_dim as i32, s.key_dim as i32],
                    Dtype::Float32,
                )?)
            }
        }
    }

    /// Refuses an append of another number of rows than the state holds.
    fn check_rows(&self, batch: i32) -> Result<()> {
        if let Some(conv) = self.conv.as_ref().filter(|c| c.dim(0).ok() != Some(batch)) {
            return Err(Error::InvalidRequest(format!(
                "a gated DeltaNet cache of {} rows appended {batch}",
                conv.dim(0)?
            )));
        }
        Ok(())
    }

    fn check(&self, qkv: &Array, a: &Array, b: &Array, decode: bool) -> Result<usize> {
        let (q, a, b) = (qkv.shape(), a.shape(), b.shape());
        let heads = self.shape.value_heads as i32;
        if q.len() != 3
            || q[2] != self.shape.conv_dim() as i32
            || a != [q[0], q[1], heads]
            || b != a
        {
            return Err(Error::InvalidRequest(format!(
                "a gated DeltaNet append needs qkv [B, S, {}] and a, b [B, S, {heads}], got {q:?}, \
                 {a:?} and {b:?}",
                self.shape.conv_dim()
            )));
        }
        if decode && q[1] != 1 {
            return Err(Error::InvalidRequest(format!("a decode append of {} positions", q[1])));
        }
        if q[1] == 0 {
            return Err(Error::InvalidRequest("an append of no positions".into()));
        }
        Ok(q[1] as usize)
    }
}

/// The gated delta rule over `steps`, one position at a time from `state`: for each value
/// head, `S ← g·S`, `δ = β·(v − S·k)`, `S ← S + δ ⊗ k`, `y = S·q`. Returns `y`
/// `[B, n, Hv, Dv]` for its `n` positions, in the queries' dtype, and the state after them. Each
/// position runs one compiled step (as mlx-lm compiles `_gated_delta_step_ops`), or the same
/// ops one by one where MLX cannot compile.
fn recurrence(steps: &Steps, state: &Array) -> Result<(Array, Array)> {
    let n = steps.q.dim(1)? as usize;
    // Each input split once into its `n` positions (one op each, not one slice per position);
    // the step squeezes the position axis itself.
    let positions = |x: &Array| -> Result<Vec<Array>> {
        Ok(if n == 1 { vec![x.clone()] } else { x.split_equal(n as i32, 1)? })
    };
    let (q, k, v) = (positions(&steps.q)?, positions(&steps.k)?, positions(&steps.v)?);
    let (g, beta) = (positions(&steps.g)?, positions(&steps.beta)?);
    let mut state = state.clone();
    let mut ys = Vec::with_capacity(n);
    STEP.with(|compiled| -> Result<()> {
        for t in 0..n {
            let inputs = [&q[t], &k[t], &v[t], &g[t], &beta[t], &state];
            let mut out = match compiled {
                Some(step) => step.call(&inputs)?,
                None => step(&inputs.map(Array::clone))?,
            };
            state =
                out.pop().ok_or_else(|| Error::InvalidRequest("a step without state".into()))?;
            ys.push(
                out.pop().ok_or_else(|| Error::InvalidRequest("a step without output".into()))?,
            );
        }
        Ok(())
    })?;
    let ys: Vec<&Array> = ys.iter().collect();
    Ok((if n == 1 { ys[0].clone() } else { ops::concatenate(&ys, 1)? }, state))
}

thread_local! {
    /// [`step`] compiled once per thread (traced per input shape), or `None` where MLX cannot
    /// compile.
    static STEP: Option<mlx::Compiled> = crate::pointwise::compile_available()
        .then(|| mlx::compile(step, false).ok())
        .flatten();
}

/// One position of the recurrence: `[q, k, v, g, β, S]` (`q`, `k` `[B, 1, Hv, Dk]`, `v`
/// `[B, 1, Hv, Dv]`, `g`, `β` `[B, 1, Hv]`, `S` `[B, Hv, Dv, Dk]`) to `[y, S']` (`y`
/// `[B, 1, Hv, Dv]`), op for op mlx-lm's `_gated_delta_step_ops` on the squeezed position.
/// Always called with those six.
fn step(x: &[Array]) -> mlx::Result<Vec<Array>> {
    let one = |a: &Array| a.squeeze(&[1]);
    let (q, k, v, g, beta) = (one(&x[0])?, one(&x[1])?, one(&x[2])?, one(&x[3])?, one(&x[4])?);
    let state = x[5].multiply(&g.expand_dims(&[-1, -2])?)?;
    let k = k.expand_dims(&[-2])?;
    let memory = state.multiply(&k)?.sum(&[-1], false)?;
    let delta = v.subtract(&memory)?.multiply(&beta.expand_dims(&[-1])?)?;
    let state = state.add(&k.multiply(&delta.expand_dims(&[-1])?)?)?;
    let y = state.multiply(&q.expand_dims(&[-2])?)?.sum(&[-1], false)?.astype(q.dtype())?;
    Ok(vec![y.expand_dims(&[1])?, state])
}

/// The first `keep` positions of the calls a round recorded, as one span.
fn kept(calls: &[Steps], keep: usize) -> Result<Steps> {
    let join = |pick: fn(&Steps) -> &Array| -> Result<Array> {
        let parts: Vec<&Array> = calls.iter().map(pick).collect();
        let joined = if parts.len() == 1 { parts[0].clone() } else { ops::concatenate(&parts, 1)? };
        let mut stop = joined.shape();
        stop[1] = keep as i32;
        Ok(joined.slice(&vec![0; stop.len()], &stop, &vec![1; stop.len()])?)
    };
    Ok(Steps {
        qkv: join(|s| &s.qkv)?,
        q: join(|s| &s.q)?,
        k: join(|s| &s.k)?,
        v: join(|s| &s.v)?,
        g: join(|s| &s.g)?,
        beta: join(|s| &s.beta)?,
    })
}

impl Cache for RecurrentCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn signature(&self) -> String {
        let s = &self.shape;
        format!(
            "gated_delta(kernel={},key_heads={},value_heads={},key_dim={},value_dim={})",
            s.kernel, s.key_heads, s.value_heads, s.key_dim, s.value_dim
        )
    }

    fn bytes_per_token(&self) -> usize {
        0
    }

    fn stored_positions(&self) -> usize {
        0
    }

    fn buffers(&self) -> Vec<Array> {
        self.conv.iter().chain(&self.state).cloned().collect()
    }

    fn state(&self) -> Result<CacheState> {
        let (Some(conv), Some(recurrent)) = (&self.conv, &self.state) else {
            return Err(Error::InvalidRequest("an empty cache has no state to save".into()));
        };
        let mut state = CacheState::default();
        state.tensors.insert("conv".into(), conv.clone());
        state.tensors.insert("recurrent".into(), recurrent.clone());
        state.metadata.insert("signature".into(), self.signature());
        state.metadata.insert("offset".into(), self.offset.to_string());
        Ok(state)
    }

    fn restore(&mut self, state: &CacheState) -> Result<()> {
        if self.round.is_some() {
            return Err(round_error("no restore inside a round"));
        }
        check_signature(state, &self.signature())?;
        let offset = state.number("offset")?;
        let conv = state_tensor(state, "conv")?;
        let recurrent = state_tensor(state, "recurrent")?;
        let s = &self.shape;
        let rows = conv.dim(0)?;
        let expected = (
            vec![rows, s.kernel as i32 - 1, s.conv_dim() as i32],
            vec![rows, s.value_heads as i32, s.value_dim as i32, s.key_dim as i32],
        );
        if (conv.shape(), recurrent.shape()) != expected || recurrent.dtype() != Dtype::Float32 {
            return Err(Error::InvalidRequest(format!(
                "gated DeltaNet state of shapes {:?} and {:?} ({:?}), expected {expected:?} \
                 (float32)",
                conv.shape(),
                recurrent.shape(),
                recurrent.dtype()
            )));
        }
        self.conv = Some(conv.clone());
        self.state = Some(recurrent.clone());
        self.offset = offset;
        Ok(())
    }

    fn is_trimmable(&self) -> bool {
        false
    }

    fn trim(&mut self, n: usize) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        Err(Error::InvalidRequest(
            "recurrent (gated DeltaNet) state cannot drop positions; resume from a checkpoint at \
             an exact token boundary"
                .into(),
        ))
    }

    fn spec_round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(round_error("a round is already armed"));
        }
        self.round = Some(Round {
            conv: self.conv.clone(),
            state: self.state.clone(),
            offset: self.offset,
            calls: Vec::new(),
        });
        Ok(())
    }

    fn spec_round_commit(&mut self) -> Result<()> {
        self.round.take().ok_or_else(|| round_error("commit without a round"))?;
        Ok(())
    }

    fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        let round = self.round.take().ok_or_else(|| round_error("rollback without a round"))?;
        let appended = self.offset - round.offset;
        if keep > appended {
            self.round = Some(round);
            return Err(round_error(&format!(
                "cannot keep {keep} of the {appended} positions appended"
            )));
        }
        if keep == appended {
            return Ok(());
        }
        self.conv = round.conv;
        self.state = round.state;
        self.offset = round.offset;
        if keep == 0 {
            return Ok(());
        }
        let steps = kept(&round.calls, keep)?;
        let input = self.conv_input(&steps.qkv)?;
        let before = self.state_or_zeros(steps.qkv.dim(0)?)?;
        let (_, state) = recurrence(&steps, &before)?;
        self.conv = Some(self.tail_of(&input)?);
        self.state = Some(state);
        self.offset += keep;
        Ok(())
    }

    fn as_gated_delta_mut(&mut self) -> Option<&mut dyn GatedDeltaCache> {
        Some(self)
    }

    fn empty_rows(&self, _layout: super::RowLayout) -> Option<Box<dyn Cache>> {
        Some(Box::new(super::RecurrentRows::new(self.shape)))
    }

    fn take_recurrent(&mut self) -> Option<RecurrentCache> {
        Some(std::mem::replace(self, RecurrentCache::new(self.shape)))
    }
}

impl GatedDeltaCache for RecurrentCache {
    fn recur_decode(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        self.append(qkv, a, b, layer, true)
    }

    fn recur_window(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        self.append(qkv, a, b, layer, false)
    }

    fn recur_window_padded(
        &mut self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        left_pad: &[usize],
        layer: &dyn GatedDeltaLayer,
    ) -> Result<Array> {
        self.append_padded(qkv, a, b, left_pad, layer)
    }
}
