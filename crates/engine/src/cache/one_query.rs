//! Attention for one query position (a decode step) over a read's keys and values, by the
//! cheapest route the backend offers.
//!
//! A decode step on a fast GPU is bound by the host time MLX spends recording each op, not by
//! the GPU. Measured on an H200 with MLX-CUDA 0.32.4 (`tests/bench/op_cost.py`, host µs per
//! op): an add 2.8, an RMS norm 2.7, a 4-bit matrix-vector product 3.5, but a matrix product
//! that MLX hands to cuBLASLt 15–19 (it builds descriptors, asks for a heuristic and captures
//! the call into the graph every time), and Gemma 4's heads of 256 and 512 have no fused MLX
//! kernel on CUDA. So on CUDA one step of attention is one kernel of ours,
//! [`DecodeAttention::Kernel`]: each block owns a query head, each warp an interleaved
//! share of the keys with an online softmax in f32, and the block merges its warps. Past
//! [`SPLIT_ABOVE`] keys the read is split across blocks of [`CHUNK`] keys and a second kernel
//! merges their partial softmaxes (with one block per head, a long read would keep only a few
//! of the GPU's multiprocessors busy). The keys and values are read through their strides (a
//! read's valid prefix of a larger buffer is a view, not a copy).

use std::cell::{Cell, OnceCell};
use std::sync::atomic::{AtomicU8, Ordering};

use mlx::Array;
use mlx::fast::{CudaKernel, Launch, TemplateArg};

use crate::error::{Error, Result};

/// How a decode step attends on CUDA (elsewhere MLX ops always): a process-wide choice, for
/// A/B runs (`quince bench --decode-attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeAttention {
    /// Quince's one-query kernel where the backend is CUDA and the head size allows it.
    Kernel,
    /// MLX ops: the query heads sharing a KV head as the rows of two matrix products.
    Rows,
}

static DECODE_ATTENTION: AtomicU8 = AtomicU8::new(0);

/// Chooses how decode steps attend from now on (all threads).
pub fn set_decode_attention(choice: DecodeAttention) {
    let code = match choice {
        DecodeAttention::Kernel => 0,
        DecodeAttention::Rows => 1,
    };
    DECODE_ATTENTION.store(code, Ordering::Relaxed);
}

/// The current choice (see [`set_decode_attention`]).
pub fn decode_attention() -> DecodeAttention {
    match DECODE_ATTENTION.load(Ordering::Relaxed) {
        0 => DecodeAttention::Kernel,
        _ => DecodeAttention::Rows,
    }
}

thread_local! {
    static TRACING: Cell<bool> = const { Cell::new(false) };
}

/// Marks the current thread as tracing a compiled decode step until dropped. MLX cannot
/// infer a custom kernel's output shape, which a shapeless graph needs, so a traced step
/// attends through MLX ops.
pub(crate) struct TracingStep(bool);

/// Whether this thread is tracing a compiled decode step (see [`tracing_step`]).
pub(crate) fn tracing() -> bool {
    TRACING.get()
}

pub(crate) fn tracing_step() -> TracingStep {
    TracingStep(TRACING.replace(true))
}

impl Drop for TracingStep {
    fn drop(&mut self) {
        TRACING.set(self.0);
    }
}

/// Attends one query position `q` `[B, Hq, 1, D]` over `k`, `v` `[B, Hkv, S, D]` with no mask.
pub(crate) fn attend_one(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let backend = mlx::Backend::current();
    if backend == mlx::Backend::Cuda
        && decode_attention() == DecodeAttention::Kernel
        && !TRACING.get()
        && kernel_applies(q, k)?
        && let Some(out) = one_query_kernel(q, k, v, scale)?
    {
        return Ok(out);
    }
    if fused_one_query(q, k)? {
        return Ok(mlx::fast::scaled_dot_product_attention(
            q,
            k,
            v,
            scale,
            mlx::fast::AttentionMask::None,
            None,
        )?);
    }
    one_query_rows(q, k, v, scale)
}

/// Whether MLX 0.32 runs attention for one query position as its fused kernel on this backend
/// (its vector kernel's head sizes); otherwise it expands the op into a dozen nodes.
fn fused_one_query(q: &Array, k: &Array) -> Result<bool> {
    let (heads, dim) = (q.dim(1)?, q.dim(3)?);
    let group = heads / k.dim(1)?.max(1); // query heads per KV head
    Ok(match mlx::Backend::current() {
        mlx::Backend::Metal => matches!(dim, 64 | 96 | 128 | 256) && group <= 32,
        mlx::Backend::Cuda => matches!(dim, 64 | 96 | 128),
        mlx::Backend::Cpu => false,
    })
}

fn group_rows(q: &Array, k: &Array) -> Result<(i32, i32, i32, i32)> {
    let s = q.shape();
    let (b, heads, dim) = (s[0], s[1], s[3]);
    let kv_heads = k.dim(1)?;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::InvalidRequest(format!(
            "{heads} query heads cannot share {kv_heads} key-value heads"
        )));
    }
    Ok((b, heads, kv_heads, dim))
}

/// Attention for one query position, in the fewest nodes MLX allows where its fused kernel
/// does not apply (Gemma 4's heads of 256 and 512 on CUDA, 512 on Metal, anything on the
/// CPU): the query heads sharing a KV head become the rows of one product, so there is no
/// broadcast, no expand and no reshape back, and a scale of 1 is no op at all. Six nodes
/// instead of MLX's twelve. The arithmetic is MLX's own fallback's (scores in the input dtype,
/// precise softmax).
fn one_query_rows(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let (b, heads, kv_heads, dim) = group_rows(q, k)?;
    let mut rows = q.reshape(&[b, kv_heads, heads / kv_heads, dim])?;
    if scale != 1.0 {
        rows = rows.multiply_scalar(f64::from(scale))?;
    }
    let scores = rows.matmul(&k.swapaxes(-1, -2)?)?.softmax(&[-1], true)?;
    Ok(scores.matmul(v)?.reshape(&[b, heads, 1, dim])?)
}

/// Head sizes the kernel takes: a multiple of the warp, at most 512 (the block's shared
/// memory holds one accumulator row per warp).
fn kernel_applies(q: &Array, k: &Array) -> Result<bool> {
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

const WARPS: i32 = 16;
const MAX_HEAD_DIM: i32 = 512;

/// Keys per block when a read is split across blocks (flash decoding): with one block per
/// query head, a long read keeps only a handful of the GPU's multiprocessors busy (E4B's full
/// layers have 8 query heads), so past [`SPLIT_ABOVE`] keys each block takes `CHUNK` of them
/// and a second kernel merges the blocks' partial softmaxes.
const CHUNK: i32 = 256;
/// Reads longer than this are split (shorter ones cost a few µs in one pass; a split costs
/// one more op of host time).
const SPLIT_ABOVE: i32 = 1024;

/// What the one-pass and split kernels share, after the lines that set `bh` (the block's
/// row·head) and its keys `[begin, end)`: block = one (row, query head), 16 warps; warp `w`
/// takes keys `begin + w, begin + w + 16, …`; lane `l` holds dims `l, l + 32, …` (each load of
/// a key row is 32 consecutive elements across the warp). Scores and the softmax are f32, an
/// online softmax per warp; the warps are then merged to the block's maximum score `top` and
/// denominator `total`, and `warp_num(d)` gives dim `d`'s weighted sum relative to `top`.
const ATTEND_KEYS: &str = r"
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
    for (int t = begin + warp; t < end; t += WARPS) {
        const InT* kr = kb + static_cast<long long>(t) * k_strides[2];
        const InT* vr = vb + static_cast<long long>(t) * v_strides[2];
        float vv[PER];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            s += qv[i] * static_cast<float>(kr[(i * 32 + lane) * k_strides[3]]);
            vv[i] = static_cast<float>(vr[(i * 32 + lane) * v_strides[3]]);
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

/// The one-pass kernel and the split pair.
struct Kernels {
    whole: CudaKernel,
    split: CudaKernel,
    merge: CudaKernel,
}

thread_local! {
    /// The kernels once they compiled and gave the right answers on this thread's device;
    /// `None` after a failed probe (then decode attends through MLX ops, with one warning).
    static KERNEL: OnceCell<Option<Kernels>> = const { OnceCell::new() };
}

fn declare() -> Result<Kernels> {
    let strided = |name: &str, outputs: &[&str], head: &str, tail: &str| -> Result<CudaKernel> {
        let source = format!("{head}{ATTEND_KEYS}{tail}");
        Ok(CudaKernel::with_layout(name, &["q", "k", "v"], outputs, &source, "", false)?)
    };
    Ok(Kernels {
        whole: strided("quince_one_query_attention", &["out"], WHOLE_HEAD, WHOLE_TAIL)?,
        split: strided("quince_one_query_split", &["sums", "stats"], SPLIT_HEAD, SPLIT_TAIL)?,
        merge: CudaKernel::new(
            "quince_one_query_merge",
            &["sums", "stats"],
            &["out"],
            MERGE_SOURCE,
        )?,
    })
}

/// Attends in one pass up to `split_above` keys, else in blocks of `chunk` keys and a merge.
fn launch(
    kernels: &Kernels,
    (q, k, v): (&Array, &Array, &Array),
    scale: f32,
    chunk: i32,
    split_above: i32,
) -> Result<Array> {
    let (b, heads, _kv_heads, dim) = group_rows(q, k)?;
    let threads = WARPS * 32;
    let keys = k.dim(2)?;
    let first = |outputs: Vec<Array>| {
        outputs.into_iter().next().ok_or_else(|| {
            Error::InvalidRequest("the one-query kernel returned no output".to_string())
        })
    };
    let common = [
        ("InT", TemplateArg::Dtype(q.dtype())),
        ("D", TemplateArg::Int(dim)),
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
    ];
    if keys <= split_above {
        let outputs = kernels.whole.call(
            &[q, k, v],
            &[(&[b, heads, 1, dim], q.dtype())],
            Launch { grid: [b * heads * threads, 1, 1], threadgroup: [threads, 1, 1] },
            &common,
        )?;
        return first(outputs);
    }
    let splits = (keys + chunk - 1) / chunk;
    let rows = b * heads;
    let mut template = common.to_vec();
    template.push(("CHUNK", TemplateArg::Int(chunk)));
    let parts = kernels.split.call(
        &[q, k, v],
        &[(&[rows, splits, dim], mlx::Dtype::Float32), (&[rows, splits, 2], mlx::Dtype::Float32)],
        Launch { grid: [rows * splits * threads, 1, 1], threadgroup: [threads, 1, 1] },
        &template,
    )?;
    let [sums, stats] = <[Array; 2]>::try_from(parts).map_err(|_| {
        Error::InvalidRequest("the split attention kernel returned the wrong outputs".into())
    })?;
    let merged = kernels.merge.call(
        &[&sums, &stats],
        &[(&[b, heads, 1, dim], q.dtype())],
        Launch { grid: [rows * 128, 1, 1], threadgroup: [128, 1, 1] },
        &[("OutT", TemplateArg::Dtype(q.dtype())), ("D", TemplateArg::Int(dim))],
    )?;
    first(merged)
}

/// Compiles the kernels and runs them on a tiny input whose answer is known, so that a device
/// or driver that cannot build them costs a warning, not a reply. Key `t` and value `t` are
/// rows of `t` and the query is a row of 1/32, so the scores are 0, 1 and 2 and the output is
/// `(e + 2e²) / (1 + e + e²)`: in one pass, and split in chunks of 2 keys (unequal splits
/// with different maxima, which the merge must rescale).
fn probe() -> Result<Kernels> {
    let kernels = declare()?;
    let rows = mlx::ops::arange(0.0, 3.0, 1.0, mlx::Dtype::Float32)?
        .reshape(&[1, 1, 3, 1])?
        .broadcast_to(&[1, 1, 3, 32])?
        .add_scalar(0.0)?;
    let q = mlx::ops::ones(&[1, 2, 1, 32], mlx::Dtype::Float32)?.multiply_scalar(1.0 / 32.0)?;
    let e = std::f32::consts::E;
    let want = (e + 2.0 * e * e) / (1.0 + e + e * e);
    for (chunk, split_above) in [(CHUNK, SPLIT_ABOVE), (2, 0)] {
        let out = launch(&kernels, (&q, &rows, &rows), 1.0, chunk, split_above)?;
        let worst = out.add_scalar(-f64::from(want))?.abs()?.max_all(false)?.item::<f32>()?;
        if worst > 1e-5 {
            return Err(Error::InvalidRequest(format!(
                "the probe (chunks of {chunk} keys) is off by {worst}"
            )));
        }
    }
    Ok(kernels)
}

/// Quince's one-query attention kernels (CUDA only): `q` `[B, Hq, 1, D]`, `k`/`v`
/// `[B, Hkv, S, D]` in any strides → `[B, Hq, 1, D]`, in one pass, or split across blocks
/// past [`SPLIT_ABOVE`] keys. `None` when the kernels do not work on this device (see
/// [`probe`]).
fn one_query_kernel(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Option<Array>> {
    KERNEL.with(|cell| {
        let kernels = cell.get_or_init(|| match probe() {
            Ok(kernels) => Some(kernels),
            Err(e) => {
                tracing::warn!(
                    "the one-query attention kernel is off, decode attends by MLX ops: {e}"
                );
                None
            }
        });
        kernels
            .as_ref()
            .map(|kernels| launch(kernels, (q, k, v), scale, CHUNK, SPLIT_ABOVE))
            .transpose()
    })
}
