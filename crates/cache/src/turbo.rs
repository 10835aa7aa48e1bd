//! TurboQuant KV storage (the MSE codec of Zandieh et al., "TurboQuant: Online Vector
//! Quantization with Near-optimal Distortion Rate", 2025), code for code as mlx-vlm 0.7.10's
//! `TurboQuantKVCache` stores it:
//!
//! - each head vector `x` (length `D`, a power of two) keeps its norm `‖x‖` as f16 and its
//!   direction `u = x / max(‖x‖, 1e-6)` rotated by a random-sign Hadamard transform,
//!   `r = H(s ⊙ u) / √D`, with `s` the ±1 signs numpy's `default_rng(seed + 7919·D)` draws
//!   (seed 0 for keys, 1 for values, every layer alike);
//! - each coordinate of `r` is coded with a `bits`-wide scalar codebook (Lloyd–Max for the
//!   distribution of one coordinate of a random unit vector): its index is the number of
//!   codebook midpoints below it; the indices are packed LSB-first into u32 words, a code
//!   straddling two words where `bits` does not divide 32;
//! - no QJL stage: the codes are the whole key.
//!
//! Fractional bits split keys and values as mlx-vlm does: 3.5 bits is 3-bit keys and 4-bit
//! values, 2.5 is 2 and 3.
//!
//! Reads stay in the rotated domain: queries (scaled) are rotated by the keys' transform once,
//! scores are products with the keys' codebook values times their norms, and the softmax
//! weights sum the values' codebook values times their norms; the output is un-rotated once per
//! query row (deferred V). mlx-vlm reads a decode query this way; for a window of several
//! queries it dequantizes every stored key and value and runs fused attention in the query's
//! dtype, which Quince does not: every read here takes the rotated route in f32 (the same
//! attention, within rounding, at a fraction of the work).

mod codebooks;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use mlx::fast::AttentionMask;
use mlx::{Array, Dtype, ops};

use crate::error::{Error, Result};

/// The keys' rotation seed (values use the next one), as mlx-vlm's default.
pub(crate) const SEED: u64 = 0;

/// Norms below this are divided by it instead (mlx-vlm's `_EPS`).
const EPS: f32 = 1e-6;

/// TurboQuant's codec: bits for keys and for values, and the tables of each head dimension
/// seen (shared by clones).
#[derive(Debug, Clone)]
pub(crate) struct TurboCodec {
    key_bits: u8,
    value_bits: u8,
    tables: Arc<Mutex<HashMap<TablesKey, Tables>>>,
}

/// Head dimension, bits, seed.
type TablesKey = (usize, u8, u64);

/// One rotation and codebook: what a tensor of head dimension `dim` at `bits` is coded with.
#[derive(Debug, Clone)]
struct Tables {
    /// The ±1 signs, f32 `[D]`.
    signs: Array,
    /// The codebook, f32 `[2^bits]`.
    codebook: Array,
    /// Its midpoints, f32 `[2^bits − 1]`.
    midpoints: Array,
    /// `1/√D`, the Hadamard transform's scale.
    scale: f32,
    layout: Layout,
}

/// The bit layout of packed codes. `bits` words hold 32 codes (mlx-vlm's LSB-first stream
/// cut into groups), so packing and unpacking are shifts between a group's words and its codes,
/// broadcast over `[bits, 32]` tables: no gather over stored positions (a shapeless compiled
/// step replays it at any length, where MLX's gathers keep the traced shape).
#[derive(Debug, Clone)]
struct Layout {
    bits: i32,
    /// Groups of 32 codes in a head vector.
    groups: i32,
    /// Unpacking, per (word, code): shift the word right, then left, mask, keep if 1.
    right: Array,
    left: Array,
    keep: Array,
    mask: Array,
    /// Packing, per (word, code): shift the code left, then right, keep if 1.
    pack_left: Array,
    pack_right: Array,
}

impl TurboCodec {
    /// Parts one tensor is stored in: packed codes `[B, H, N, W]` (u32) and norms
    /// `[B, H, N, 1]` (f16).
    pub(crate) const PARTS: usize = 2;
    /// Their names in a saved state.
    pub(crate) const SUFFIXES: &'static [&'static str] = &["", ".norms"];

    /// A codec of `key_bits` for keys and `value_bits` for values.
    pub(crate) fn new(key_bits: u8, value_bits: u8) -> TurboCodec {
        TurboCodec { key_bits, value_bits, tables: Arc::default() }
    }

    /// Key and value bits of an average of `bits` (2.5, 3, 3.5 or 4), as mlx-vlm's
    /// `resolve_kv_bits` splits a half: floor for keys, ceil for values.
    pub(crate) fn split_bits(bits: f64) -> Result<(u8, u8)> {
        let halves = (bits * 2.0).round();
        if (halves - bits * 2.0).abs() > 1e-6 || !(5.0..=8.0).contains(&halves) {
            return Err(Error::InvalidRequest(format!(
                "TurboQuant KV takes 2.5, 3, 3.5 or 4 bits, not {bits}"
            )));
        }
        let halves = halves as u8;
        Ok((halves / 2, halves.div_ceil(2)))
    }

    /// The key bits and the value bits.
    pub(crate) fn bits(&self) -> (u8, u8) {
        (self.key_bits, self.value_bits)
    }

    /// Checks the bits (2 to 4 each) and that every head dimension is a power of two the
    /// codebooks cover.
    pub(crate) fn validate(key_bits: u8, value_bits: u8, head_dims: &[usize]) -> Result<()> {
        if !(2..=4).contains(&key_bits) || !(2..=4).contains(&value_bits) {
            return Err(Error::InvalidRequest(format!(
                "TurboQuant KV takes 2 to 4 bits for keys and for values, not {key_bits} and {value_bits}"
            )));
        }
        for &dim in head_dims {
            for bits in [key_bits, value_bits] {
                if dim < 32 || codebook(dim, bits).is_none() {
                    return Err(Error::InvalidRequest(format!(
                        "TurboQuant KV needs a power-of-two head dimension from 32 to 1024, not {dim}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Bytes one key and one value of dimension `dim` take, halved (a vector's share): packed
    /// codes plus an f16 norm each.
    pub(crate) fn bytes_per_vector(kb: u8, vb: u8, dim: usize) -> usize {
        let one = |bits: u8| 4 * (dim * bits as usize).div_ceil(32) + 2;
        (one(kb) + one(vb)) / 2
    }

    /// The tables for keys (`value == false`) or values of dimension `dim`.
    fn tables(&self, dim: usize, value: bool) -> Result<Tables> {
        let (bits, seed) = if value { (self.value_bits, SEED + 1) } else { (self.key_bits, SEED) };
        let key = (dim, bits, seed);
        let mut tables = self.tables.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(t) = tables.get(&key) {
            return Ok(t.clone());
        }
        let t = Tables::new(dim, bits, seed)?;
        tables.insert(key, t.clone());
        Ok(t)
    }

    /// Keys (`value == false`) or values `[B, H, L, D]` as `[codes, norms]`.
    pub(crate) fn encode(&self, x: &Array, value: bool) -> Result<Vec<Array>> {
        let t = self.tables(x.dim(3)? as usize, value)?;
        let xf = x.astype(Dtype::Float32)?;
        let norms = xf.square()?.sum(&[-1], true)?.sqrt()?;
        let unit = xf.divide(&norms.maximum(&Array::scalar(EPS)?)?)?;
        let rotated = unit.multiply(&t.signs)?.hadamard_transform(Some(t.scale))?;
        let indices = rotated
            .expand_dims(&[-1])?
            .gt(&t.midpoints)?
            .astype(Dtype::Uint32)?
            .sum(&[-1], false)?
            .astype(Dtype::Uint32)?;
        Ok(vec![t.layout.pack(&indices)?, norms.astype(Dtype::Float16)?])
    }

    /// `[codes, norms]` back to keys or values `[B, H, N, D]` in f32.
    pub(crate) fn decode(&self, parts: &[Array], value: bool) -> Result<Array> {
        let [codes, norms] = parts else {
            return Err(Error::InvalidRequest("TurboQuant storage is 2 parts a tensor".into()));
        };
        let bits = if value { self.value_bits } else { self.key_bits };
        let words = codes.dim(3)? as usize;
        // The one power of two whose codes fill these words.
        let dim = (5..=10)
            .map(|p| 1usize << p)
            .find(|d| (d * bits as usize).div_ceil(32) == words)
            .ok_or_else(|| Error::InvalidRequest(format!("{words} words of {bits}-bit codes")))?;
        let t = self.tables(dim, value)?;
        let unit = t.values(codes)?.hadamard_transform(Some(t.scale))?.multiply(&t.signs)?;
        Ok(norms.astype(Dtype::Float32)?.multiply(&unit)?)
    }

    /// Attention of `q` `[B, Hq, L, D]` over stored keys and values (each `[codes, norms]`)
    /// in the rotated domain (see the module docs); the output in `q`'s dtype.
    pub(crate) fn attend(
        &self,
        q: &Array,
        keys: &[Array],
        values: &[Array],
        scale: f32,
        mask: AttentionMask<'_>,
    ) -> Result<Array> {
        let ([kcodes, knorms], [vcodes, vnorms]) = (keys, values) else {
            return Err(Error::InvalidRequest("TurboQuant storage is 2 parts a tensor".into()));
        };
        let s = q.shape();
        let (b, heads, l, d) = (s[0], s[1], s[2], s[3]);
        let kv_heads = kcodes.dim(1)?;
        let repeats = heads / kv_heads;
        let kt = self.tables(d as usize, false)?;
        let grouped =
            q.multiply_scalar(f64::from(scale))?.reshape(&[b, kv_heads, repeats, l, d])?;
        let rotated = grouped.multiply(&kt.signs)?.hadamard_transform(Some(kt.scale))?;
        // Scores [B, Hkv, R, L, T]: products with the codebook values, times the key norms.
        let kc = kt.values(kcodes)?.expand_dims(&[2])?;
        // Norms [B, Hkv, T, 1] as [B, Hkv, 1, 1, T] (no reshape by T: a shapeless compiled
        // step replays this at every length).
        let norms_row = |n: &Array| -> Result<Array> {
            Ok(n.astype(Dtype::Float32)?.swapaxes(-1, -2)?.expand_dims(&[2])?)
        };
        let mut scores = rotated.matmul(&kc.swapaxes(-1, -2)?)?.multiply(&norms_row(knorms)?)?;
        let lowest = || Array::scalar(Dtype::Float32.lowest() as f32);
        scores = match mask {
            AttentionMask::None => scores,
            AttentionMask::Causal => {
                let kl = scores.dim(-1)?;
                let qi = ops::arange(f64::from(kl - l), f64::from(kl), 1.0, Dtype::Int32)?
                    .reshape(&[l, 1])?;
                let ki = ops::arange(0.0, f64::from(kl), 1.0, Dtype::Int32)?.reshape(&[1, kl])?;
                ops::where_(&qi.ge(&ki)?, &scores, &lowest()?)?
            }
            AttentionMask::Array(m) => {
                let m = if m.ndim() == 4 { m.expand_dims(&[2])? } else { m.clone() };
                if m.dtype() == Dtype::Bool {
                    ops::where_(&m, &scores, &lowest()?)?
                } else {
                    scores.add(&m.astype(Dtype::Float32)?)?
                }
            }
        };
        let weights = scores.softmax(&[-1], false)?.multiply(&norms_row(vnorms)?)?;
        let vt = self.tables(d as usize, true)?;
        let summed = weights.matmul(&vt.values(vcodes)?.expand_dims(&[2])?)?;
        let out = summed.hadamard_transform(Some(vt.scale))?.multiply(&vt.signs)?;
        Ok(out.reshape(&[b, heads, l, d])?.astype(q.dtype())?)
    }
}

/// The embedded codebook of `dim` at `bits`, when there is one.
fn codebook(dim: usize, bits: u8) -> Option<&'static [u32]> {
    codebooks::CODEBOOKS.iter().find(|(d, b, _)| *d == dim && *b == bits).map(|(_, _, c)| *c)
}

impl Tables {
    fn new(dim: usize, bits: u8, seed: u64) -> Result<Tables> {
        let words = codebook(dim, bits).ok_or_else(|| {
            Error::InvalidRequest(format!(
                "no TurboQuant codebook for dimension {dim} at {bits} bits"
            ))
        })?;
        let centroids: Vec<f32> = words.iter().map(|w| f32::from_bits(*w)).collect();
        // As mlx-vlm: (c[i] + c[i+1]) / 2 in f32.
        let mids: Vec<f32> = centroids.windows(2).map(|p| (p[0] + p[1]) / 2.0).collect();
        let n = dim as i32;
        Ok(Tables {
            signs: Array::from_slice(&signs(dim, seed + 7919 * dim as u64), &[n])?,
            codebook: Array::from_slice(&centroids, &[centroids.len() as i32])?,
            midpoints: Array::from_slice(&mids, &[mids.len() as i32])?,
            scale: (1.0 / (dim as f64).sqrt()) as f32,
            layout: Layout::new(dim, bits)?,
        })
    }

    /// Packed codes `[..., W]` → codebook values `[..., D]` (f32).
    fn values(&self, codes: &Array) -> Result<Array> {
        let indices = self.layout.unpack(codes)?;
        Ok(self.codebook.take(&indices.astype(Dtype::Int32)?, 0)?)
    }
}

impl Layout {
    fn new(dim: usize, bits: u8) -> Result<Layout> {
        let b = bits as usize;
        if !dim.is_multiple_of(32) {
            return Err(Error::InvalidRequest(format!(
                "TurboQuant packs head dimensions in multiples of 32, not {dim}"
            )));
        }
        let (mut right, mut left, mut keep) = (vec![], vec![], vec![]);
        let (mut pack_left, mut pack_right) = (vec![], vec![]);
        for w in 0..b {
            let (lo, hi) = (32 * w, 32 * w + 32);
            for i in 0..32 {
                let start = b * i;
                let overlaps = start < hi && start + b > lo;
                // The code's low bits sit in this word from bit `start − lo`; or the word's
                // first bits are the high bits of a code begun in the word before.
                let (r, l) = match (overlaps, start >= lo) {
                    (false, _) => (0, 0),
                    (true, true) => ((start - lo) as u32, 0),
                    (true, false) => (0, (lo - start) as u32),
                };
                right.push(r);
                left.push(l);
                keep.push(u32::from(overlaps));
                pack_left.push(r);
                pack_right.push(l);
            }
        }
        let table = |v: &[u32]| Array::from_slice(v, &[b as i32, 32]);
        Ok(Layout {
            bits: b as i32,
            groups: (dim / 32) as i32,
            right: table(&right)?,
            left: table(&left)?,
            keep: table(&keep)?,
            mask: Array::from_slice(&[(1u32 << b) - 1], &[1])?,
            pack_left: table(&pack_left)?,
            pack_right: table(&pack_right)?,
        })
    }

    /// Words `[..., W]` → indices `[..., D]` (u32).
    fn unpack(&self, codes: &Array) -> Result<Array> {
        let words = codes.unflatten(-1, &[self.groups, self.bits])?.expand_dims(&[-1])?;
        let parts = words
            .right_shift(&self.right)?
            .left_shift(&self.left)?
            .bitwise_and(&self.mask)?
            .multiply(&self.keep)?;
        // A code's parts from two words have disjoint bits: their sum is their union.
        Ok(parts.sum(&[-2], false)?.astype(Dtype::Uint32)?.flatten(-2, -1)?)
    }

    /// Indices `[..., D]` (u32) → words `[..., W]`.
    fn pack(&self, indices: &Array) -> Result<Array> {
        let codes = indices.unflatten(-1, &[self.groups, 32])?.expand_dims(&[-2])?;
        let parts = codes
            .left_shift(&self.pack_left)?
            .right_shift(&self.pack_right)?
            .multiply(&self.keep)?;
        Ok(parts.sum(&[-1], false)?.astype(Dtype::Uint32)?.flatten(-2, -1)?)
    }
}

/// numpy's `default_rng(seed).choice([-1.0, 1.0], size=dim)`: PCG64 seeded through
/// SeedSequence, one 32-bit draw per element (low half of a 64-bit output first), `+1` when its
/// top bit is set.
pub(crate) fn signs(dim: usize, seed: u64) -> Vec<f32> {
    let mut rng = Pcg64::new(seed);
    (0..dim).map(|_| if rng.next_u32() >> 31 == 1 { 1.0 } else { -1.0 }).collect()
}

/// numpy's PCG64 (XSL-RR 128/64).
struct Pcg64 {
    state: u128,
    inc: u128,
    buffered: Option<u32>,
}

const PCG_MULT: u128 = 0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645;

impl Pcg64 {
    fn new(seed: u64) -> Pcg64 {
        let v = seed_sequence(seed);
        let init_state = (u128::from(v[0]) << 64) | u128::from(v[1]);
        let init_seq = (u128::from(v[2]) << 64) | u128::from(v[3]);
        let mut rng = Pcg64 { state: 0, inc: (init_seq << 1) | 1, buffered: None };
        rng.step();
        rng.state = rng.state.wrapping_add(init_state);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        let x = ((s >> 64) as u64) ^ (s as u64);
        x.rotate_right((s >> 122) as u32)
    }

    fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.buffered.take() {
            return high;
        }
        let n = self.next_u64();
        self.buffered = Some((n >> 32) as u32);
        n as u32
    }
}

/// numpy's `SeedSequence(entropy).generate_state(4, uint64)`.
fn seed_sequence(entropy: u64) -> [u64; 4] {
    const INIT_A: u32 = 0x43b0_d7e5;
    const MULT_A: u32 = 0x931e_8875;
    const INIT_B: u32 = 0x8b51_f9dd;
    const MULT_B: u32 = 0x58f3_8ded;
    const MIX_L: u32 = 0xca01_f9dd;
    const MIX_R: u32 = 0x4973_f715;
    let mut words = Vec::new();
    let mut n = entropy;
    while n > 0 {
        words.push(n as u32);
        n >>= 32;
    }
    if words.is_empty() {
        words.push(0);
    }
    let mut hash = INIT_A;
    let mut hashmix = |v: u32| -> u32 {
        let mut v = v ^ hash;
        hash = hash.wrapping_mul(MULT_A);
        v = v.wrapping_mul(hash);
        v ^ (v >> 16)
    };
    let mix = |x: u32, y: u32| -> u32 {
        let r = MIX_L.wrapping_mul(x).wrapping_sub(MIX_R.wrapping_mul(y));
        r ^ (r >> 16)
    };
    let mut pool = [0u32; 4];
    for (i, p) in pool.iter_mut().enumerate() {
        *p = hashmix(words.get(i).copied().unwrap_or(0));
    }
    for s in 0..4 {
        for d in 0..4 {
            if s != d {
                let h = hashmix(pool[s]);
                pool[d] = mix(pool[d], h);
            }
        }
    }
    for &w in words.iter().skip(4) {
        for p in pool.iter_mut() {
            let h = hashmix(w);
            *p = mix(*p, h);
        }
    }
    let mut out = [0u32; 8];
    let mut h = INIT_B;
    for (i, o) in out.iter_mut().enumerate() {
        let mut v = pool[i % 4] ^ h;
        h = h.wrapping_mul(MULT_B);
        v = v.wrapping_mul(h);
        *o = v ^ (v >> 16);
    }
    std::array::from_fn(|i| u64::from(out[2 * i]) | (u64::from(out[2 * i + 1]) << 32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_match_numpy() {
        // Bit i of word i / 64 set where sign i is +1 (numpy 2.4, seed 0 and 1 at dim 64).
        let mask = |signs: &[f32]| {
            signs.iter().enumerate().fold(0u64, |m, (i, s)| if *s > 0.0 { m | 1 << i } else { m })
        };
        assert_eq!(mask(&signs(64, 64 * 7919)), 0x601b_f8ee_3d23_b3c0);
        assert_eq!(mask(&signs(64, 1 + 64 * 7919)), 0x5d98_147a_c5be_444e);
    }

    #[test]
    fn bits_split_as_mlx_vlm() {
        assert_eq!(TurboCodec::split_bits(3.0).unwrap(), (3, 3));
        assert_eq!(TurboCodec::split_bits(3.5).unwrap(), (3, 4));
        assert_eq!(TurboCodec::split_bits(2.5).unwrap(), (2, 3));
        assert_eq!(TurboCodec::split_bits(4.0).unwrap(), (4, 4));
        assert!(TurboCodec::split_bits(3.2).is_err());
        assert!(TurboCodec::split_bits(5.0).is_err());
    }
}
