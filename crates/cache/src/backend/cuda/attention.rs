//! Attention for one query position (a decode step) over a read's keys and values: one kernel
//! of Quince's where MLX-CUDA has no fused kernel for the head size (Gemma 4's 256 and 512) and
//! runs two cuBLASLt products instead, each ~16–19 µs of host time.
//!
//! Each block owns a query head, each warp an interleaved share of the keys with an online
//! softmax in f32, and the block merges its warps. Past [`SPLIT_ABOVE`] keys the read is split
//! across blocks of [`CHUNK`] keys and a second kernel merges their partial softmaxes (flash
//! decoding: with one block per head, a long read would keep only a few of the GPU's
//! multiprocessors busy). Keys and values are read through their strides, so a read's valid
//! prefix of a larger buffer is a view, not a copy.

use mlx::Array;
use mlx::fast::{CudaKernel, Launch, TemplateArg};

use crate::error::{Error, Result};

const WARPS: i32 = 16;
const MAX_HEAD_DIM: i32 = 512;

/// Keys per block when a read is split across blocks.
const CHUNK: i32 = 256;
/// Reads longer than this are split (shorter ones cost a few µs in one pass; a split costs
/// one more op of host time).
pub(super) const SPLIT_ABOVE: i32 = 1024;

/// What every one-query kernel shares, after the lines that set `bh` (the block's row·head) and
/// its key range `[begin, end)`: block = one (row, query head), 16 warps; lane `l` holds dims
/// `l, l + 32, …` (each load of a key row is 32 consecutive elements across the warp).
/// `visit(key, value, key stride, value stride)` adds one key to the warp's online softmax (f32).
const ATTEND_SETUP: &str = r"
    constexpr int WARPS = 16;
    constexpr int PER = D / 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int heads = q_shape[1];
    const int b = bh / heads;
    const int h = bh - b * heads;
    const int kv = h / (heads / k_shape[1]);
    const float scale = __int_as_float(SCALE_BITS);
    const float minus_inf = __int_as_float(0xff800000);
    const InT* qr = q + b * q_strides[0] + h * q_strides[1];
    const InT* kb = k + b * k_strides[0] + kv * k_strides[1];
    const InT* vb = v + b * v_strides[0] + kv * v_strides[1];
    float qv[PER];
    float acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(qr[(i * 32 + lane) * q_strides[3]]) * scale;
        acc[i] = 0.f;
    }
    float m = minus_inf;
    float l = 0.f;
    auto visit = [&](const InT* kr, const InT* vr, long long ks, long long vs) {
        float vv[PER];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            s += qv[i] * static_cast<float>(kr[(i * 32 + lane) * ks]);
            vv[i] = static_cast<float>(vr[(i * 32 + lane) * vs]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, o);
        }
        const float mn = fmaxf(m, s);
        const float c = expf(m - mn);
        const float p = expf(s - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            acc[i] = acc[i] * c + p * vv[i];
        }
        m = mn;
    };
";

/// The keys (warp `w` takes `begin + w, begin + w + 16, …`), then the warps merged to the
/// block's maximum score `top` and denominator `total`; `warp_num(d)` gives dim `d`'s weighted
/// sum relative to `top`.
const ATTEND_LOOP: &str = r"
    for (int t = begin + warp; t < end; t += WARPS) {
        visit(kb + static_cast<long long>(t) * k_strides[2],
              vb + static_cast<long long>(t) * v_strides[2], k_strides[3], v_strides[3]);
    }
    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_acc[WARPS * D];
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        warp_acc[warp * D + i * 32 + lane] = acc[i];
    }
    __syncthreads();
    float top = minus_inf;
    for (int w = 0; w < WARPS; ++w) {
        top = fmaxf(top, warp_max[w]);
    }
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) {
        if (warp_max[w] != minus_inf) {
            total += warp_sum[w] * expf(warp_max[w] - top);
        }
    }
    auto warp_num = [&](int d) {
        float num = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            if (warp_max[w] != minus_inf) {
                num += warp_acc[w * D + d] * expf(warp_max[w] - top);
            }
        }
        return num;
    };
";

/// The one-pass kernel: one block per (row, query head) over all its keys; the output is
/// rounded once to the input dtype.
const WHOLE_HEAD: &str = r"
    const int bh = blockIdx.x;
    const int begin = 0;
    const int end = k_shape[2];
";
const WHOLE_TAIL: &str = r"
    InT* o = out + static_cast<long long>(bh) * D;
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        o[d] = static_cast<InT>(warp_num(d) / total);
    }
";

/// The split pass: block `(row·head, split)` attends keys `[split·CHUNK, …)` and writes its
/// unnormalized sum, its maximum score and its softmax denominator (f32).
const SPLIT_HEAD: &str = r"
    const int keys = k_shape[2];
    const int splits = (keys + CHUNK - 1) / CHUNK;
    const int bh = blockIdx.x / splits;
    const int split = blockIdx.x - bh * splits;
    const int begin = split * CHUNK;
    const int end = min(keys, begin + CHUNK);
";
const SPLIT_TAIL: &str = r"
    const long long part = static_cast<long long>(bh) * splits + split;
    if (threadIdx.x == 0) {
        stats[part * 2] = top;
        stats[part * 2 + 1] = total;
    }
    for (int d = threadIdx.x; d < D; d += WARPS * 32) {
        sums[part * D + d] = warp_num(d);
    }
";

/// The merge pass: block `row·head` rescales its splits' sums to their common maximum and
/// divides by the merged denominator; the output is rounded once to the input dtype.
const MERGE_SOURCE: &str = r"
    const int splits = stats_shape[1];
    const long long bh = blockIdx.x;
    const float* st = stats + bh * splits * 2;
    float top = __int_as_float(0xff800000);
    for (int s = 0; s < splits; ++s) {
        top = fmaxf(top, st[2 * s]);
    }
    float total = 0.f;
    for (int s = 0; s < splits; ++s) {
        total += st[2 * s + 1] * expf(st[2 * s] - top);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.f;
        for (int s = 0; s < splits; ++s) {
            num += sums[(bh * splits + s) * D + d] * expf(st[2 * s] - top);
        }
        out[bh * D + d] = static_cast<OutT>(num / total);
    }
";

/// The one-pass kernel, the split pass and the merge.
pub(super) struct Kernels {
    whole: CudaKernel,
    split: CudaKernel,
    merge: CudaKernel,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("one-query attention kernels")
    }
}

fn declare() -> Result<Kernels> {
    let inputs = ["q", "k", "v"];
    let kernel = |kind: &str, outputs: &[&str], head: &str, tail: &str| {
        let source = format!("{head}{ATTEND_SETUP}{ATTEND_LOOP}{tail}");
        CudaKernel::with_layout(
            &format!("quince_one_query_{kind}"),
            &inputs,
            outputs,
            &source,
            "",
            false,
        )
    };
    Ok(Kernels {
        whole: kernel("whole", &["out"], WHOLE_HEAD, WHOLE_TAIL)?,
        split: kernel("split", &["sums", "stats"], SPLIT_HEAD, SPLIT_TAIL)?,
        merge: CudaKernel::new(
            "quince_one_query_merge",
            &["sums", "stats"],
            &["out"],
            MERGE_SOURCE,
        )?,
    })
}

/// Head sizes the kernel takes: a multiple of the warp, at most 512 (the block's shared memory
/// holds one accumulator row per warp), one query row, keys of the query's dtype.
pub(super) fn applies(q: &Array, k: &Array) -> Result<bool> {
    let dim = q.dim(3)?;
    let dtype_ok =
        matches!(q.dtype(), mlx::Dtype::Float32 | mlx::Dtype::Float16 | mlx::Dtype::Bfloat16);
    Ok(dtype_ok
        && dim % 32 == 0
        && dim <= MAX_HEAD_DIM
        && k.dim(3)? == dim
        && k.dtype() == q.dtype()
        && q.dim(2)? == 1)
}

impl Kernels {
    /// Compiles the kernels and runs them on tiny inputs whose answer is known, so that a device
    /// or driver that cannot build them costs a warning, not a reply. Key `t` and value `t` are
    /// rows of `t` and the query is a row of 1/32, so scores 0, 1 and 2 give
    /// `(e + 2e²) / (1 + e + e²)`: in one pass, and split in chunks of 2 keys (unequal splits
    /// with different maxima, which the merge must rescale).
    pub(super) fn probe() -> Result<Kernels> {
        let kernels = declare()?;
        let rows = |values: &[f32]| -> Result<Array> {
            let n = values.len() as i32;
            Ok(Array::from_slice(values, &[1, 1, n, 1])?
                .broadcast_to(&[1, 1, n, 32])?
                .add_scalar(0.0)?)
        };
        let q = mlx::ops::ones(&[1, 2, 1, 32], mlx::Dtype::Float32)?.multiply_scalar(1.0 / 32.0)?;
        let e = std::f32::consts::E;
        let want = (e + 2.0 * e * e) / (1.0 + e + e * e);
        let keys = rows(&[0.0, 1.0, 2.0])?;
        for (chunk, split_above) in [(CHUNK, SPLIT_ABOVE), (2, 0)] {
            let out = kernels.launch(&q, &keys, &keys, 1.0, chunk, split_above)?;
            let worst = out.add_scalar(-f64::from(want))?.abs()?.max_all(false)?.item::<f32>()?;
            if worst > 1e-5 {
                return Err(Error::InvalidRequest(format!(
                    "the one-query probe (chunks of {chunk}) is off by {worst}"
                )));
            }
        }
        Ok(kernels)
    }

    /// `q` `[B, Hq, 1, D]` over `k`, `v` `[B, Hkv, S, D]` (any strides) → `[B, Hq, 1, D]`.
    pub(super) fn attend(&self, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        self.launch(q, k, v, scale, CHUNK, SPLIT_ABOVE)
    }

    /// Attends in one pass up to `split_above` keys, else in blocks of `chunk` keys and a merge.
    fn launch(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
        chunk: i32,
        split_above: i32,
    ) -> Result<Array> {
        let (b, heads, dim) = (q.dim(0)?, q.dim(1)?, q.dim(3)?);
        let kv_heads = k.dim(1)?;
        if kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::InvalidRequest(format!(
                "{heads} query heads cannot share {kv_heads} key-value heads"
            )));
        }
        let threads = WARPS * 32;
        let first = |outputs: Vec<Array>| {
            outputs.into_iter().next().ok_or_else(|| {
                Error::InvalidRequest("the one-query kernel returned no output".to_string())
            })
        };
        let inputs = [q, k, v];
        let keys = k.dim(2)?;
        let common = [
            ("InT", TemplateArg::Dtype(q.dtype())),
            ("D", TemplateArg::Int(dim)),
            ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
        ];
        if keys <= split_above {
            let outputs = self.whole.call(
                &inputs,
                &[(&[b, heads, 1, dim], q.dtype())],
                Launch { grid: [b * heads * threads, 1, 1], threadgroup: [threads, 1, 1] },
                &common,
            )?;
            return first(outputs);
        }
        let splits = ((keys + chunk - 1) / chunk).max(1);
        let rows = b * heads;
        let mut template = common.to_vec();
        template.push(("CHUNK", TemplateArg::Int(chunk)));
        let parts = self.split.call(
            &inputs,
            &[
                (&[rows, splits, dim], mlx::Dtype::Float32),
                (&[rows, splits, 2], mlx::Dtype::Float32),
            ],
            Launch { grid: [rows * splits * threads, 1, 1], threadgroup: [threads, 1, 1] },
            &template,
        )?;
        let [sums, stats] = <[Array; 2]>::try_from(parts).map_err(|_| {
            Error::InvalidRequest("the split attention kernel returned the wrong outputs".into())
        })?;
        let merged = self.merge.call(
            &[&sums, &stats],
            &[(&[b, heads, 1, dim], q.dtype())],
            Launch { grid: [rows * 128, 1, 1], threadgroup: [128, 1, 1] },
            &[("OutT", TemplateArg::Dtype(q.dtype())), ("D", TemplateArg::Int(dim))],
        )?;
        first(merged)
    }
}
