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
//!
//! Three kinds of launch ([`Keys`]): all positions of `k`/`v`; a *bounded* read of a cache's
//! whole buffers, its slots given on the device; and an *appending* read, which also attends a
//! decode step's new position and writes it into the buffers (a buffer read, see
//! `AttentionCache::append_decode_in_buffer`), so the step needs no slice update and no slice.

use std::cell::{Cell, OnceCell};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

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

/// Keys past which a one-query read runs split (its own kernels, which MLX compiles on their
/// first use, a stall of a second or two): `Some` on CUDA with the kernel chosen, `None`
/// where no read splits. A warm-up that decodes past it builds them before the first reply.
pub fn split_reads_above() -> Option<usize> {
    (mlx::Backend::current() == mlx::Backend::Cuda && decode_attention() == DecodeAttention::Kernel)
        .then_some(SPLIT_ABOVE as usize)
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

/// What every one-query kernel shares, after the lines that set `bh` (the block's row·head),
/// its buffer slots `[begin, end)` and a slot to `skip` (−1 for none): block = one (row, query
/// head), 16 warps; lane `l` holds dims `l, l + 32, …` (each load of a key row is 32
/// consecutive elements across the warp). `visit(key, value, key stride, value stride)` adds
/// one key to the warp's online softmax (f32).
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

/// The appending kernels' extra key: the new position (`k_new`, `v_new` `[B, Hkv, 1, D]`, not
/// yet in the buffers), visited first by warp 0 of the block that starts at slot 0.
const VISIT_NEW: &str = r"
    const int group = heads / k_shape[1];
    const InT* kn = k_new + b * k_new_strides[0] + kv * k_new_strides[1];
    const InT* vn = v_new + b * v_new_strides[0] + kv * v_new_strides[1];
    if (begin == 0 && warp == 0) {
        visit(kn, vn, k_new_strides[3], v_new_strides[3]);
    }
";

/// The keys of the buffer (warp `w` takes slots `begin + w, begin + w + 16, …`), then the
/// warps merged to the block's maximum score `top` and denominator `total`; `warp_num(d)`
/// gives dim `d`'s weighted sum relative to `top`.
const ATTEND_LOOP: &str = r"
    for (int t = begin + warp; t < end; t += WARPS) {
        if (t != skip) {
            visit(kb + static_cast<long long>(t) * k_strides[2],
                  vb + static_cast<long long>(t) * v_strides[2], k_strides[3], v_strides[3]);
        }
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

/// The appending kernels' write: the first query head of each KV head, in the block that
/// starts at slot 0, stores the new position into slot `skip` of the buffers (which no block
/// of the launch reads: a full ring's oldest position is out of the new query's window).
const WRITE_NEW: &str = r"
    if (h % group == 0 && begin == 0 && skip >= 0) {
        InT* kw = const_cast<InT*>(kb) + static_cast<long long>(skip) * k_strides[2];
        InT* vw = const_cast<InT*>(vb) + static_cast<long long>(skip) * v_strides[2];
        for (int d = threadIdx.x; d < D; d += WARPS * 32) {
            kw[d * k_strides[3]] = kn[d * k_new_strides[3]];
            vw[d * v_strides[3]] = vn[d * v_new_strides[3]];
        }
    }
";

/// The one-pass kernel: one block per (row, query head) over all its keys; the output is
/// rounded once to the input dtype.
const WHOLE_HEAD: &str = r"
    const int bh = blockIdx.x;
    const int begin = 0;
    const int end = k_shape[2];
    const int skip = -1;
";
/// The one-pass kernel over a buffer's slots `[0, bounds[0])` but `bounds[1]`.
const WHOLE_BOUNDED_HEAD: &str = r"
    const int bh = blockIdx.x;
    const int begin = 0;
    const int end = bounds[0];
    const int skip = bounds[1];
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
    const int skip = -1;
";
/// The split pass over a buffer's slots `[0, bounds[0])` but `bounds[1]`; the number of
/// splits is the launch's (its outputs' second axis), so a split may have no slot to read.
const SPLIT_BOUNDED_HEAD: &str = r"
    const int keys = bounds[0];
    const int splits = gridDim.x / (q_shape[0] * q_shape[1]);
    const int bh = blockIdx.x / splits;
    const int split = blockIdx.x - bh * splits;
    const int begin = split * CHUNK;
    const int end = min(keys, begin + CHUNK);
    const int skip = bounds[1];
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

/// Which keys a launch reads besides its query.
#[derive(Clone, Copy)]
pub(crate) enum Keys<'a> {
    /// Every position of `k`/`v` `[B, Hkv, S, D]` (views in any strides).
    All { k: &'a Array, v: &'a Array },
    /// Slots `[0, n)` of buffers `k`/`v` `[B, Hkv, capacity, D]` but one, as `bounds` says on
    /// the device (int32 `[n, skip]`, `skip` −1 for none). With `fresh` (`[B, Hkv, 1, D]` keys
    /// and values of a new position), that position is attended too and written into slot
    /// `skip`: a decode step's cache write and its attention in one launch. The launch (one
    /// pass or split, the number of splits) follows the capacity, not `n`, so one recorded
    /// graph serves every step until the buffer grows.
    Buffer { k: &'a Array, v: &'a Array, bounds: &'a Array, fresh: Option<(&'a Array, &'a Array)> },
}

impl<'a> Keys<'a> {
    fn k(&self) -> &'a Array {
        match *self {
            Keys::All { k, .. } | Keys::Buffer { k, .. } => k,
        }
    }

    /// Positions the launch is sized for (a buffer's capacity plus the new position).
    fn count(&self) -> Result<i32> {
        Ok(match *self {
            Keys::All { k, .. } => k.dim(2)?,
            Keys::Buffer { k, fresh, .. } => k.dim(2)? + i32::from(fresh.is_some()),
        })
    }
}

/// A one-pass kernel and a split pass for one kind of [`Keys`].
struct Pair {
    whole: CudaKernel,
    split: CudaKernel,
}

/// The kernels of every kind of [`Keys`], and the merge the split passes share.
struct Kernels {
    all: Pair,
    bounded: Pair,
    appending: Pair,
    merge: CudaKernel,
}

thread_local! {
    /// The kernels once they compiled and gave the right answers on this thread's device;
    /// `None` after a failed probe (then decode attends through MLX ops, with one warning).
    static KERNEL: OnceCell<Option<Kernels>> = const { OnceCell::new() };
}

fn declare() -> Result<Kernels> {
    let pair = |name: &str, inputs: &[&str], heads: (&str, &str), middle: &str, write: &str| {
        let kernel = |kind: &str, outputs: &[&str], head: &str, tail: &str| {
            let source = format!("{head}{ATTEND_SETUP}{middle}{ATTEND_LOOP}{write}{tail}");
            CudaKernel::with_layout(&format!("{name}_{kind}"), inputs, outputs, &source, "", false)
        };
        Ok::<Pair, Error>(Pair {
            whole: kernel("whole", &["out"], heads.0, WHOLE_TAIL)?,
            split: kernel("split", &["sums", "stats"], heads.1, SPLIT_TAIL)?,
        })
    };
    let bounded = (WHOLE_BOUNDED_HEAD, SPLIT_BOUNDED_HEAD);
    Ok(Kernels {
        all: pair("quince_one_query", &["q", "k", "v"], (WHOLE_HEAD, SPLIT_HEAD), "", "")?,
        bounded: pair("quince_one_query_bounded", &["q", "k", "v", "bounds"], bounded, "", "")?,
        appending: pair(
            "quince_one_query_appending",
            &["q", "k", "v", "k_new", "v_new", "bounds"],
            bounded,
            VISIT_NEW,
            WRITE_NEW,
        )?,
        merge: CudaKernel::new(
            "quince_one_query_merge",
            &["sums", "stats"],
            &["out"],
            MERGE_SOURCE,
        )?,
    })
}

/// Attends in one pass up to `split_above` positions, else in blocks of `chunk` slots and a
/// merge.
fn launch(
    kernels: &Kernels,
    q: &Array,
    keys: Keys<'_>,
    scale: f32,
    chunk: i32,
    split_above: i32,
) -> Result<Array> {
    let (b, heads, _kv_heads, dim) = group_rows(q, keys.k())?;
    let threads = WARPS * 32;
    let first = |outputs: Vec<Array>| {
        outputs.into_iter().next().ok_or_else(|| {
            Error::InvalidRequest("the one-query kernel returned no output".to_string())
        })
    };
    let (pair, inputs): (&Pair, Vec<&Array>) = match keys {
        Keys::All { k, v } => (&kernels.all, vec![q, k, v]),
        Keys::Buffer { k, v, bounds, fresh: None } => (&kernels.bounded, vec![q, k, v, bounds]),
        Keys::Buffer { k, v, bounds, fresh: Some((k_new, v_new)) } => {
            (&kernels.appending, vec![q, k, v, k_new, v_new, bounds])
        }
    };
    let slots = keys.k().dim(2)?;
    let common = [
        ("InT", TemplateArg::Dtype(q.dtype())),
        ("D", TemplateArg::Int(dim)),
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
    ];
    if keys.count()? <= split_above {
        let outputs = pair.whole.call(
            &inputs,
            &[(&[b, heads, 1, dim], q.dtype())],
            Launch { grid: [b * heads * threads, 1, 1], threadgroup: [threads, 1, 1] },
            &common,
        )?;
        return first(outputs);
    }
    // At least one split, which also takes a new position.
    let splits = ((slots + chunk - 1) / chunk).max(1);
    let rows = b * heads;
    let mut template = common.to_vec();
    template.push(("CHUNK", TemplateArg::Int(chunk)));
    let parts = pair.split.call(
        &inputs,
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

/// Compiles the kernels and runs them on tiny inputs whose answer is known, so that a device
/// or driver that cannot build them costs a warning, not a reply. Key `t` and value `t` are
/// rows of `t` and the query is a row of 1/32, so scores 0, 1 and 2 give
/// `(e + 2e²) / (1 + e + e²)`: in one pass, and split in chunks of 2 slots (unequal splits
/// with different maxima, which the merge must rescale). The bounded kernels read slots 0, 1
/// and 3 of a buffer `[0, 1, 9, 2]` (not slot 2); the appending ones slots 0 and 1 of
/// `[0, 1, 9]` and a new position of 2, which they must write into slot 2 (split, the second
/// split has no slot left to read).
fn probe() -> Result<Kernels> {
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
    let check = |what: &str, out: &Array| -> Result<()> {
        let worst = out.add_scalar(-f64::from(want))?.abs()?.max_all(false)?.item::<f32>()?;
        if worst > 1e-5 {
            return Err(Error::InvalidRequest(format!("the probe ({what}) is off by {worst}")));
        }
        Ok(())
    };
    let plain = rows(&[0.0, 1.0, 2.0])?;
    let bounded = rows(&[0.0, 1.0, 9.0, 2.0])?;
    let bounds = Array::from_slice(&[4i32, 2], &[2])?;
    for (chunk, split_above) in [(CHUNK, SPLIT_ABOVE), (2, 0)] {
        let at = format!("chunks of {chunk}");
        let all = Keys::All { k: &plain, v: &plain };
        check(&format!("{at}, all"), &launch(&kernels, &q, all, 1.0, chunk, split_above)?)?;
        let read = Keys::Buffer { k: &bounded, v: &bounded, bounds: &bounds, fresh: None };
        check(&format!("{at}, bounded"), &launch(&kernels, &q, read, 1.0, chunk, split_above)?)?;
        let (kbuf, vbuf) = (rows(&[0.0, 1.0, 9.0])?, rows(&[0.0, 1.0, 9.0])?);
        kbuf.eval()?;
        vbuf.eval()?;
        let new = rows(&[2.0])?;
        let slot = Array::from_slice(&[3i32, 2], &[2])?;
        let fresh = Some((&new, &new));
        let read = Keys::Buffer { k: &kbuf, v: &vbuf, bounds: &slot, fresh };
        let out = launch(&kernels, &q, read, 1.0, chunk, split_above)?;
        check(&format!("{at}, appending"), &out)?;
        out.eval()?;
        for buffer in [&kbuf, &vbuf] {
            let written = buffer.slice(&[0, 0, 2, 0], &[1, 1, 3, 32], &[1, 1, 1, 1])?;
            let worst = written.add_scalar(-2.0)?.abs()?.max_all(false)?.item::<f32>()?;
            if worst != 0.0 {
                return Err(Error::InvalidRequest(format!(
                    "the appending probe ({at}) did not write the new position: off by {worst}"
                )));
            }
        }
    }
    Ok(kernels)
}

/// Runs `f` with the one-query kernels, `None` when they do not work on this device (see
/// [`probe`]; probed on first use).
fn with_kernels<T>(f: impl FnOnce(Option<&Kernels>) -> T) -> T {
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
        f(kernels.as_ref())
    })
}

/// Quince's one-query attention kernels (CUDA only): `q` `[B, Hq, 1, D]`, `k`/`v`
/// `[B, Hkv, S, D]` in any strides → `[B, Hq, 1, D]`, in one pass, or split across blocks
/// past [`SPLIT_ABOVE`] keys. `None` when the kernels do not work on this device.
fn one_query_kernel(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Option<Array>> {
    with_kernels(|kernels| {
        kernels
            .map(|kernels| launch(kernels, q, Keys::All { k, v }, scale, CHUNK, SPLIT_ABOVE))
            .transpose()
    })
}

static BUFFER_READS_ON: AtomicBool = AtomicBool::new(true);

/// Turns buffer reads (a decode step's cache write inside its attention kernel, CUDA) on or
/// off for all threads from now on: on by default; off, a decode step writes by MLX's slice
/// update and reads a slice (for A/B runs, `quince bench --buffer-reads`).
pub fn set_buffer_reads(on: bool) {
    BUFFER_READS_ON.store(on, Ordering::Relaxed);
}

/// Whether buffer reads are on (see [`set_buffer_reads`]).
pub fn buffer_reads_on() -> bool {
    BUFFER_READS_ON.load(Ordering::Relaxed)
}

/// Whether a decode step may write its keys and values inside the attention kernel
/// ([`attend_buffer`]): on CUDA, with the kernel chosen and working, outside a traced step,
/// for queries `q` `[B, Hq, 1, D]` and new keys `k` `[B, Hkv, 1, D]` the kernel takes.
pub(crate) fn buffer_reads_ready(q: &Array, k: &Array) -> Result<bool> {
    if mlx::Backend::current() != mlx::Backend::Cuda
        || !buffer_reads_on()
        || decode_attention() != DecodeAttention::Kernel
        || TRACING.get()
        || !kernel_applies(q, k)?
    {
        return Ok(false);
    }
    Ok(with_kernels(|kernels| kernels.is_some()))
}

/// Whether a compiled decode step can read its caches by buffer reads
/// ([`crate::cache::DecodeFetch::Buffer`]): on CUDA, buffer reads on, the kernel chosen and
/// working (probed now if it was not yet).
pub(crate) fn buffer_steps_ready() -> bool {
    mlx::Backend::current() == mlx::Backend::Cuda
        && buffer_reads_on()
        && decode_attention() == DecodeAttention::Kernel
        && !TRACING.get()
        && with_kernels(|kernels| kernels.is_some())
}

thread_local! {
    static BUFFER_READS: Cell<usize> = const { Cell::new(0) };
}

/// How many buffer reads (one-query kernels over a cache's whole buffers, most of them
/// writing a decode step's keys and values) this thread has built: what tests and
/// benchmarks check to know the path ran.
pub fn buffer_reads() -> usize {
    BUFFER_READS.get()
}

/// Attends `q` `[B, Hq, 1, D]` over a buffer read ([`Keys::Buffer`]) with the kernel; only
/// after [`buffer_reads_ready`] said yes.
pub(crate) fn attend_buffer(q: &Array, keys: Keys<'_>, scale: f32) -> Result<Array> {
    BUFFER_READS.set(BUFFER_READS.get() + 1);
    with_kernels(|kernels| match kernels {
        Some(kernels) => launch(kernels, q, keys, scale, CHUNK, SPLIT_ABOVE),
        None => Err(Error::InvalidRequest(
            "a buffer read needs the one-query attention kernel, which is off".into(),
        )),
    })
}
