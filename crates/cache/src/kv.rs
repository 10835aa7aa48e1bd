//! How a storage keeps its keys and values: the format a user chooses ([`KvFormat`]), the codec
//! that encodes and attends a format ([`Codec`]), and the precision policy of one cache
//! ([`Precision`]): full precision until a start offset, then the chosen format.
//!
//! Stored keys and values are a list of *parts*, each `[B, H, N, ·]` with positions on axis 2:
//! the keys' parts, then the values' parts. Full precision has one part each; affine
//! quantization three (packed words, scales, biases); TurboQuant two (packed codes, norms). A
//! layout (a growing buffer, a ring) moves positions of every part alike and never looks inside
//! them, so every layout stores every format. Every format encodes each position on its own
//! (groups and rotations run along the head dimension), so encoding positions one at a time or
//! all at once gives the same bytes: what makes a conversion, a rollback or a restore exact.

use mlx::fast::{AttentionMask, scaled_dot_product_attention};
use mlx::quantized::{QuantizedMatrix, quantize};
use mlx::{Array, Dtype, ops};
use serde::{Deserialize, Serialize};

use super::turbo::TurboCodec;
use crate::backend::Ops;
use crate::error::{Error, Result};

/// How keys and values are stored, as a user chooses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "ts", derive(ts_rs::TS))]
#[serde(tag = "scheme", rename_all = "snake_case")]
pub enum KvFormat {
    /// As the model computes them (bf16 on a bf16 model).
    #[default]
    Full,
    /// Affine quantization per group of `group_size` values along the head dimension, as
    /// mlx-lm's `QuantizedKVCache` stores them: `x ≈ scale · q + bias`, `q` packed `bits` wide.
    Affine {
        /// 4 or 8.
        bits: u8,
        /// 32, 64 or 128 (dividing the head dimension).
        group_size: u16,
    },
    /// TurboQuant (MSE codec, as mlx-vlm's `TurboQuantKVCache`): each head vector rotated
    /// by a seeded random-sign Hadamard transform, its coordinates coded with a scalar codebook,
    /// and its norm kept. 3.5 bits on average is 3-bit keys and 4-bit values.
    Turbo {
        /// Bits per key coordinate, 2 to 4.
        key_bits: u8,
        /// Bits per value coordinate, 2 to 4.
        value_bits: u8,
    },
}

impl KvFormat {
    /// TurboQuant at an average of `bits` per coordinate: 2.5, 3, 3.5 or 4 (a half splits as
    /// mlx-vlm does: 3.5 is 3-bit keys and 4-bit values).
    pub fn turbo(bits: f64) -> Result<KvFormat> {
        let (key_bits, value_bits) = TurboCodec::split_bits(bits)?;
        Ok(KvFormat::Turbo { key_bits, value_bits })
    }

    /// Checks the parameters (bits, group size) and, when known, that `head_dims` fit them.
    pub fn validate(&self, head_dims: &[usize]) -> Result<()> {
        match *self {
            KvFormat::Full => Ok(()),
            KvFormat::Affine { bits, group_size } => {
                if !matches!(bits, 4 | 8) {
                    return Err(Error::InvalidRequest(format!(
                        "affine KV takes 4 or 8 bits, not {bits}"
                    )));
                }
                if !matches!(group_size, 32 | 64 | 128) {
                    return Err(Error::InvalidRequest(format!(
                        "affine KV takes groups of 32, 64 or 128, not {group_size}"
                    )));
                }
                if let Some(d) = head_dims.iter().find(|&&d| d % group_size as usize != 0) {
                    return Err(Error::InvalidRequest(format!(
                        "a head dimension of {d} does not split into groups of {group_size}"
                    )));
                }
                Ok(())
            }
            KvFormat::Turbo { key_bits, value_bits } => {
                TurboCodec::validate(key_bits, value_bits, head_dims)
            }
        }
    }

    /// This format for a layer whose heads are `head_dim` wide: affine groups no wider than
    /// the head (a 64-wide group on 32-wide heads becomes 32).
    pub fn for_head_dim(&self, head_dim: usize) -> KvFormat {
        match *self {
            KvFormat::Affine { bits, group_size } if usize::from(group_size) > head_dim => {
                KvFormat::Affine { bits, group_size: head_dim.min(usize::from(u16::MAX)) as u16 }
            }
            format => format,
        }
    }

    /// Keys and values `[B, H, L, D]` as this format stores them, read back in floating point
    /// (what a naive recompute over the same stored values attends).
    pub fn round_trip(&self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let codec = self.codec();
        codec.decode(&codec.encode_kv(keys, values)?)
    }

    /// Whether this is full precision.
    pub fn is_full(&self) -> bool {
        matches!(self, KvFormat::Full)
    }

    /// The name in a storage signature, e.g. `affine(bits=4,group=64)`.
    pub fn signature(&self) -> String {
        match self {
            KvFormat::Full => "full".into(),
            KvFormat::Affine { bits, group_size } => {
                format!("affine(bits={bits},group={group_size})")
            }
            KvFormat::Turbo { key_bits, value_bits } => {
                format!("turbo(k={key_bits},v={value_bits},seed={})", super::turbo::SEED)
            }
        }
    }

    /// Bytes one position of one head takes for a head dimension `dim`, with full-precision
    /// values (and affine scales) of `dtype_bytes` each.
    pub fn bytes_per_vector(&self, dim: usize, dtype_bytes: usize) -> usize {
        match *self {
            KvFormat::Full => dim * dtype_bytes,
            KvFormat::Affine { bits, group_size } => {
                dim * bits as usize / 8 + 2 * (dim / group_size as usize) * dtype_bytes
            }
            KvFormat::Turbo { key_bits, value_bits } => {
                TurboCodec::bytes_per_vector(key_bits, value_bits, dim)
            }
        }
    }

    /// The codec that stores this format.
    pub(crate) fn codec(&self) -> Codec {
        match *self {
            KvFormat::Full => Codec::Full,
            KvFormat::Affine { bits, group_size } => {
                Codec::Affine { bits: bits as i32, group_size: group_size as i32 }
            }
            KvFormat::Turbo { key_bits, value_bits } => {
                Codec::Turbo(TurboCodec::new(key_bits, value_bits))
            }
        }
    }
}

/// A layer's KV policy: full precision until its offset reaches `start`, then `format`
/// (mlx-lm's `quantized_kv_start`). The conversion happens after the append in which the
/// offset reaches `start`, so that append still reads full precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvEncoding {
    /// The format after the start.
    pub format: KvFormat,
    /// Positions kept in full precision first.
    pub start: usize,
}

impl KvEncoding {
    /// Full precision throughout.
    pub fn full() -> KvEncoding {
        KvEncoding::default()
    }

    /// The suffix a storage signature carries: empty for full precision, else e.g.
    /// `+affine(bits=4,group=64,start=0)`.
    pub fn signature(&self) -> String {
        if self.format.is_full() {
            return String::new();
        }
        let format = self.format.signature();
        let inner = format.trim_end_matches(')');
        format!("+{inner},start={})", self.start)
    }
}

/// Encodes keys or values of one format and attends over them. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) enum Codec {
    /// As computed.
    Full,
    /// Affine quantization ([`KvFormat::Affine`]).
    Affine { bits: i32, group_size: i32 },
    /// TurboQuant ([`KvFormat::Turbo`]).
    Turbo(TurboCodec),
}

impl Codec {
    /// Parts one tensor (keys or values) is stored in.
    pub(crate) fn parts_per_tensor(&self) -> usize {
        match self {
            Codec::Full => 1,
            Codec::Affine { .. } => 3,
            Codec::Turbo(_) => TurboCodec::PARTS,
        }
    }

    /// Names of one tensor's parts in a saved state, after `keys` or `values`.
    pub(crate) fn part_suffixes(&self) -> &'static [&'static str] {
        match self {
            Codec::Full => &[""],
            Codec::Affine { .. } => &["", ".scales", ".biases"],
            Codec::Turbo(_) => TurboCodec::SUFFIXES,
        }
    }

    /// The codec's name in a graph key and in errors.
    pub(crate) fn name(&self) -> String {
        match self {
            Codec::Full => "full".into(),
            Codec::Affine { bits, group_size } => format!("affine{bits}g{group_size}"),
            Codec::Turbo(t) => format!("turbo{}v{}", t.bits().0, t.bits().1),
        }
    }

    /// Keys (`value == false`) or values `[B, H, L, D]` as this codec's parts.
    fn encode(&self, x: &Array, value: bool) -> Result<Vec<Array>> {
        match self {
            Codec::Full => Ok(vec![x.clone()]),
            Codec::Affine { bits, group_size } => {
                let q = quantize(x, *group_size, *bits)?;
                Ok(vec![q.weight, q.scales, q.biases])
            }
            Codec::Turbo(t) => t.encode(x, value),
        }
    }

    /// Keys and values `[B, H, L, D]` as this codec's parts: the keys', then the values'.
    pub(crate) fn encode_kv(&self, keys: &Array, values: &Array) -> Result<Vec<Array>> {
        let mut parts = self.encode(keys, false)?;
        parts.extend(self.encode(values, true)?);
        Ok(parts)
    }

    /// Parts of full-precision keys and values (`[keys, values]`) in this codec.
    pub(crate) fn convert(&self, full: &[Array]) -> Result<Vec<Array>> {
        match full {
            [keys, values] => self.encode_kv(keys, values),
            _ => Err(Error::InvalidRequest(format!(
                "a conversion takes full-precision keys and values, not {} parts",
                full.len()
            ))),
        }
    }

    /// Keys and values back in floating point (a test's naive recompute reads these).
    pub(crate) fn decode(&self, parts: &[Array]) -> Result<(Array, Array)> {
        let (keys, values) = self.split(parts)?;
        Ok((self.decode_one(keys, false)?, self.decode_one(values, true)?))
    }

    fn decode_one(&self, parts: &[Array], value: bool) -> Result<Array> {
        match (self, parts) {
            (Codec::Full, [x]) => Ok(x.clone()),
            (Codec::Affine { bits, group_size }, [w, s, b]) => {
                Ok(matrix(w, s, b, *group_size, *bits).dequantize()?)
            }
            (Codec::Turbo(t), parts) => t.decode(parts, value),
            _ => Err(self.parts_error(parts.len())),
        }
    }

    /// The keys' parts and the values' parts.
    pub(crate) fn split<'a>(&self, parts: &'a [Array]) -> Result<(&'a [Array], &'a [Array])> {
        let n = self.parts_per_tensor();
        if parts.len() != 2 * n {
            return Err(self.parts_error(parts.len()));
        }
        Ok(parts.split_at(n))
    }

    fn parts_error(&self, got: usize) -> Error {
        Error::InvalidRequest(format!(
            "{} keys and values are {} parts, not {got}",
            self.name(),
            2 * self.parts_per_tensor()
        ))
    }

    /// Attention of queries `q` `[B, Hq, L, D]` over stored `parts` under `mask`: MLX's fused
    /// attention (or the backend's one-query kernel) on full precision, and on quantized
    /// storage the products read the codes directly.
    pub(crate) fn attend(
        &self,
        q: &Array,
        parts: &[Array],
        scale: f32,
        mask: AttentionMask<'_>,
        ops: &Ops,
    ) -> Result<Array> {
        let (keys, values) = self.split(parts)?;
        match (self, keys, values) {
            (Codec::Full, [k], [v]) => match mask {
                AttentionMask::None if q.dim(2)? == 1 => ops.attend_one(q, k, v, scale),
                // Rows sharing buffers in a compiled step (their length changes under it).
                AttentionMask::Array(m) if ops.is_shapeless() && q.dim(2)? == 1 => {
                    ops.attend_one_masked(q, k, v, scale, m)
                }
                mask if q.dim(2)? > 1 => ops.attend_window(q, k, v, scale, mask),
                mask => Ok(scaled_dot_product_attention(q, k, v, scale, mask, None)?),
            },
            (Codec::Affine { bits, group_size }, [kw, ks, kb], [vw, vs, vb]) => {
                let keys = matrix(kw, ks, kb, *group_size, *bits);
                let values = matrix(vw, vs, vb, *group_size, *bits);
                if quantized_products_run() {
                    return affine_attention(q, &keys, &values, scale, mask);
                }
                // The stored values, dequantized, through the full-precision route.
                let (k, v) = (keys.dequantize()?, values.dequantize()?);
                Codec::Full.attend(q, &[k, v], scale, mask, ops)
            }
            (Codec::Turbo(t), keys, values) => t.attend(q, keys, values, scale, mask),
            _ => Err(self.parts_error(parts.len())),
        }
    }
}

/// Whether attention can read affine storage through quantized products. MLX-CUDA 0.32.4 has
/// no quantized-matmul kernel for attention's batched products, for a decode query as for a
/// window (`No implementation for problem shape: 1x4097x512x8`, and `511x4095x512x8`, on the
/// H200), so there the stored values are dequantized first: the memory saving stays, the reads
/// are full precision's. Every other backend reads the codes, as mlx-lm does.
fn quantized_products_run() -> bool {
    mlx::Backend::current() != mlx::Backend::Cuda
}

fn matrix(w: &Array, s: &Array, b: &Array, group_size: i32, bits: i32) -> QuantizedMatrix {
    QuantizedMatrix { weight: w.clone(), scales: s.clone(), biases: b.clone(), group_size, bits }
}

/// mlx-lm's `quantized_scaled_dot_product_attention`, op for op: queries scaled, grouped per
/// KV head, scores by a quantized product with the packed keys, masked with the dtype's
/// lowest value, a precise softmax, and a quantized product with the packed values.
fn affine_attention(
    q: &Array,
    keys: &QuantizedMatrix,
    values: &QuantizedMatrix,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    let s = q.shape();
    let (b, heads, l, d) = (s[0], s[1], s[2], s[3]);
    let kv_heads = keys.weight.dim(1)?;
    let repeats = heads / kv_heads;
    let mut queries = q.multiply_scalar(f64::from(scale))?;
    let grouped = |m: &QuantizedMatrix| -> Result<QuantizedMatrix> {
        Ok(QuantizedMatrix {
            weight: m.weight.expand_dims(&[-3])?,
            scales: m.scales.expand_dims(&[-3])?,
            biases: m.biases.expand_dims(&[-3])?,
            ..m.clone()
        })
    };
    let (keys, values) = if repeats > 1 {
        queries = queries.reshape(&[b, kv_heads, repeats, l, d])?;
        (grouped(keys)?, grouped(values)?)
    } else {
        (keys.clone(), values.clone())
    };
    let mut scores = keys.matmul(&queries, true)?;
    let lowest = |scores: &Array| scores.scalar_like(scores.dtype().lowest());
    scores = match mask {
        AttentionMask::None => scores,
        AttentionMask::Causal => {
            let shape = scores.shape();
            let (ql, kl) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let qi = ops::arange(f64::from(kl - ql), f64::from(kl), 1.0, Dtype::Int32)?
                .reshape(&[ql, 1])?;
            let ki = ops::arange(0.0, f64::from(kl), 1.0, Dtype::Int32)?.reshape(&[1, kl])?;
            ops::where_(&qi.ge(&ki)?, &scores, &lowest(&scores)?)?
        }
        AttentionMask::Array(m) => {
            // A batch's `[B, 1, L, S]` mask lines up with grouped scores `[B, Hkv, R, L, S]`.
            let m = if repeats > 1 && m.ndim() == 4 { m.expand_dims(&[2])? } else { m.clone() };
            if m.dtype() == Dtype::Bool {
                ops::where_(&m, &scores, &lowest(&scores)?)?
            } else {
                scores.add(&m)?
            }
        }
    };
    let scores = scores.softmax(&[-1], true)?;
    let out = values.matmul(&scores, false)?;
    Ok(if repeats > 1 { out.reshape(&[b, heads, l, d])? } else { out })
}

/// One cache's precision policy: the codec its parts are in now, and the conversion it still
/// owes (see [`KvEncoding`]).
#[derive(Debug, Clone)]
pub(crate) struct Precision {
    encoding: KvEncoding,
    codec: Codec,
    /// The offset at which the parts were converted (none yet: full precision).
    converted_at: Option<usize>,
}

impl Precision {
    /// Full precision now, `encoding`'s format after its start.
    pub(crate) fn new(encoding: KvEncoding) -> Precision {
        Precision { encoding, codec: Codec::Full, converted_at: None }
    }

    /// The policy.
    pub(crate) fn encoding(&self) -> KvEncoding {
        self.encoding
    }

    /// The codec the stored parts are in.
    pub(crate) fn codec(&self) -> &Codec {
        &self.codec
    }

    /// Whether a conversion is still owed.
    fn pending(&self) -> bool {
        !self.encoding.format.is_full() && self.converted_at.is_none()
    }

    /// The most positions one append may add at `offset` so that the conversion lands exactly
    /// at the start: `None` when unlimited.
    pub(crate) fn max_append(&self, offset: usize) -> Option<usize> {
        (self.pending() && offset < self.encoding.start).then(|| self.encoding.start - offset)
    }

    /// Refuses an append of `length` at `offset` inside a speculative round that would cross
    /// the start: a round defers its conversion to its end, so positions past the start would
    /// be read in full precision where decode steps would have read them converted.
    pub(crate) fn check_round_append(&self, offset: usize, length: usize) -> Result<()> {
        if self.pending() && offset + length > self.encoding.start {
            return Err(Error::InvalidRequest(format!(
                "a speculative round of {length} positions at {offset} would cross the KV \
                 conversion at {}",
                self.encoding.start
            )));
        }
        Ok(())
    }

    /// The earliest offset the stored positions can be trimmed back to: once converted, a
    /// shorter prefix would hold quantized positions that its own run kept in full precision.
    pub(crate) fn minimum_reusable_offset(&self) -> usize {
        self.converted_at.unwrap_or(0)
    }

    /// Whether the conversion is due at `offset`: owed, and the offset has reached the start
    /// (after at least one append).
    pub(crate) fn due(&self, offset: usize) -> bool {
        self.pending() && offset > 0 && offset >= self.encoding.start
    }

    /// `full` (`[keys, values]` in full precision, the valid positions) in the policy's
    /// format; from now on the parts are in its codec. On an error nothing changes.
    pub(crate) fn convert(&mut self, full: &[Array], offset: usize) -> Result<Vec<Array>> {
        let codec = self.encoding.format.codec();
        let converted = codec.convert(full)?;
        self.codec = codec;
        self.converted_at = Some(offset);
        Ok(converted)
    }

    /// The metadata a saved state carries (where the parts were converted).
    pub(crate) fn save(&self, metadata: &mut std::collections::BTreeMap<String, String>) {
        if let Some(at) = self.converted_at {
            metadata.insert("converted_at".into(), at.to_string());
        }
    }

    /// The precision of a saved state at `offset` of this policy.
    pub(crate) fn restored(&self, state: &super::CacheState, offset: usize) -> Result<Precision> {
        let mut restored = Precision::new(self.encoding);
        if state.metadata.contains_key("converted_at") {
            let at = state.number("converted_at")?;
            if self.encoding.format.is_full() || at > offset || at < self.encoding.start {
                return Err(Error::InvalidRequest(format!(
                    "a state converted at {at} does not fit its storage at offset {offset}"
                )));
            }
            restored.codec = self.encoding.format.codec();
            restored.converted_at = Some(at);
        } else if restored.due(offset) {
            return Err(Error::InvalidRequest(format!(
                "a state of {offset} positions in full precision passed its start {}",
                self.encoding.start
            )));
        }
        Ok(restored)
    }
}

/// Positions `from..to` of every part.
pub(crate) fn positions(parts: &[Array], from: usize, to: usize) -> Result<Vec<Array>> {
    parts
        .iter()
        .map(|p| {
            let s = p.shape();
            if from == 0 && to as i32 == s[2] {
                return Ok(p.clone());
            }
            let mut start = vec![0; s.len()];
            start[2] = from as i32;
            let mut stop = s.clone();
            stop[2] = to as i32;
            Ok(p.slice(&start, &stop, &vec![1; s.len()])?)
        })
        .collect()
}

/// Every part with `new`'s positions written from slot `at`.
pub(crate) fn write_positions(parts: &[Array], new: &[Array], at: usize) -> Result<Vec<Array>> {
    check_same(parts, new)?;
    parts
        .iter()
        .zip(new)
        .map(|(p, n)| {
            let s = n.shape();
            let mut start = vec![0; s.len()];
            start[2] = at as i32;
            let mut stop = s.clone();
            stop[2] = at as i32 + s[2];
            Ok(p.slice_update(n, &start, &stop, &vec![1; s.len()])?)
        })
        .collect()
}

/// `a`'s positions followed by `b`'s, part by part.
pub(crate) fn concat_positions(a: &[Array], b: &[Array]) -> Result<Vec<Array>> {
    check_same(a, b)?;
    a.iter().zip(b).map(|(x, y)| Ok(ops::concatenate(&[x, y], 2)?)).collect()
}

/// `n` zero positions shaped like each part of `like`.
pub(crate) fn zero_positions(like: &[Array], n: usize) -> Result<Vec<Array>> {
    like.iter()
        .map(|p| {
            let mut s = p.shape();
            s[2] = n as i32;
            Ok(ops::zeros(&s, p.dtype())?)
        })
        .collect()
}

/// Positions held along axis 2 (0 for no parts).
pub(crate) fn position_count(parts: &[Array]) -> Result<usize> {
    match parts.first() {
        Some(p) => Ok(p.dim(2)? as usize),
        None => Ok(0),
    }
}

/// Bytes one position of `parts` takes for one row.
pub(crate) fn bytes_per_position(parts: &[Array]) -> usize {
    parts
        .iter()
        .map(|p| {
            let s = p.shape();
            let per: i32 = s[1] * s[3..].iter().product::<i32>();
            per as usize * p.dtype().size()
        })
        .sum()
}

fn check_same(a: &[Array], b: &[Array]) -> Result<()> {
    if a.len() != b.len() {
        return Err(Error::InvalidRequest(format!(
            "stored keys and values of {} parts meet {} parts",
            a.len(),
            b.len()
        )));
    }
    Ok(())
}
