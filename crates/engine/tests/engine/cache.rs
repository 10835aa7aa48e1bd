//! Every storage's attention output equals a naive recompute over the full history (over the
//! same quantized values, for encoded storages), for random sequences of window appends,
//! decode appends and trims; state save/restore is exact; speculative rounds, in one row or
//! resolved per row in a batch, leave each storage exactly as appending only the kept
//! positions would (`cache_rounds.rs`). Every layout runs with every encoding: full precision,
//! affine 4 and 8 bits, TurboQuant 3 and 3.5 bits, converted after the first append or at a
//! later start.

use engine::backend::Ops;
use engine::cache::{AttentionCache, Cache, KvEncoding, KvFormat, PlainCache, RotatingCache};
use mlx::{Array, Dtype, ops, random};
use proptest::prelude::*;

pub(crate) const B: i32 = 1;
pub(crate) const HKV: i32 = 2;
pub(crate) const HQ: i32 = 4;
pub(crate) const D: i32 = 32;

/// The formats the property tests run.
pub(crate) fn formats() -> Vec<KvFormat> {
    vec![
        KvFormat::Full,
        KvFormat::Affine { bits: 4, group_size: 32 },
        KvFormat::Affine { bits: 8, group_size: 32 },
        KvFormat::turbo(3.0).unwrap(),
        KvFormat::turbo(3.5).unwrap(),
    ]
}

/// A format and a start offset (0: converted after the first append).
pub(crate) fn encodings() -> impl Strategy<Value = KvEncoding> {
    (0..formats().len(), prop_oneof![Just(0usize), 1usize..12])
        .prop_map(|(f, start)| KvEncoding { format: formats()[f], start })
}

pub(crate) fn plain(kv: KvEncoding) -> Box<dyn AttentionCache> {
    Box::new(PlainCache::encoded(kv, &Ops::mlx()))
}

pub(crate) fn ring(window: usize, kv: KvEncoding) -> Box<dyn AttentionCache> {
    Box::new(RotatingCache::encoded(window, kv, &Ops::mlx()).unwrap())
}

#[derive(Debug, Clone)]
enum Step {
    Window(usize),
    Decode,
    Trim(usize),
    /// A window whose flagged runs are image blocks.
    Bidirectional(Vec<bool>),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            (1usize..7).prop_map(Step::Window),
            Just(Step::Decode),
            Just(Step::Decode),
            (1usize..4).prop_map(Step::Trim),
            prop::collection::vec(any::<bool>(), 1..9).prop_map(Step::Bidirectional),
        ],
        1..14,
    )
}

pub(crate) fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

/// softmax(q kᵀ · scale + mask) v over the full history, with query `i` at absolute position
/// `first + i` seeing key `j` when `j <= first + i` and `first + i − j < window`, or when both
/// are new positions in the same run of `flags`.
fn naive(
    q: &Array,
    keys: &[Array],
    values: &[Array],
    first: usize,
    window: Option<usize>,
    flags: Option<&[bool]>,
) -> Array {
    let k = ops::concatenate(&keys.iter().collect::<Vec<_>>(), 2).unwrap();
    let v = ops::concatenate(&values.iter().collect::<Vec<_>>(), 2).unwrap();
    let s = k.dim(2).unwrap();
    let rep = HQ / HKV;
    let expand = |a: &Array| {
        a.expand_dims(&[2])
            .unwrap()
            .broadcast_to(&[B, HKV, rep, s, D])
            .unwrap()
            .reshape(&[B, HQ, s, D])
            .unwrap()
    };
    let (k, v) = (expand(&k), expand(&v));
    let l = q.dim(2).unwrap() as usize;
    // Run index per new position (−1 outside runs), computed independently of the engine.
    let mut run = vec![-1i32; l];
    if let Some(flags) = flags {
        let mut id = -1;
        for i in 0..l {
            if flags[i] {
                if i == 0 || !flags[i - 1] {
                    id += 1;
                }
                run[i] = id;
            }
        }
    }
    let mut visible = Vec::new();
    for i in 0..l {
        let p = first + i;
        for j in 0..s as usize {
            let causal = j <= p && window.is_none_or(|w| p - j < w);
            let same = j >= first && run[i] >= 0 && run[i] == run[j - first];
            visible.push(causal || same);
        }
    }
    let mask = Array::from_slice(&visible, &[l as i32, s]).unwrap();
    let scores = q.matmul(&k.swapaxes(-1, -2).unwrap()).unwrap().multiply_scalar(0.5).unwrap();
    let scores =
        ops::where_(&mask, &scores, &scores.scalar_like(f64::NEG_INFINITY).unwrap()).unwrap();
    scores.softmax(&[-1], true).unwrap().matmul(&v).unwrap()
}

pub(crate) fn bitwise_equal(a: &Array, b: &Array) -> bool {
    a.shape() == b.shape() && a.array_equal(b, false).unwrap().item::<bool>().unwrap()
}

pub(crate) fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    a.subtract(b).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

/// Runs `steps` on `cache` (of `kv`), checking each read against a naive recompute over the
/// history as the cache holds it: in full precision before its conversion, every position
/// through the format after; returns how many appends were checked.
fn run(
    cache: &mut dyn AttentionCache,
    window: Option<usize>,
    kv: KvEncoding,
    steps: &[Step],
    seed: u64,
) -> usize {
    let mut keys: Vec<Array> = Vec::new(); // one [B, HKV, 1, D] per position
    let mut values: Vec<Array> = Vec::new();
    // Where the cache converted (the model's own account, not the cache's).
    let mut converted: Option<usize> = kv.format.is_full().then_some(0);
    let mut checked = 0;
    for (n, step) in steps.iter().enumerate() {
        let seed = seed * 1000 + n as u64 * 3;
        let length = match step {
            Step::Trim(t) => {
                let trimmed = (*t).min(keys.len());
                let floor = converted.unwrap_or(0);
                if cache.is_trimmable() && keys.len() - trimmed >= floor {
                    assert_eq!(cache.trim(*t).unwrap(), trimmed);
                    keys.truncate(keys.len() - trimmed);
                    values.truncate(values.len() - trimmed);
                } else {
                    assert!(
                        cache.trim(*t).is_err(),
                        "an evicted ring or a converted prefix refuses"
                    );
                }
                assert_eq!(cache.offset(), keys.len());
                continue;
            }
            Step::Window(l) => *l,
            Step::Bidirectional(flags) => flags.len(),
            Step::Decode => 1,
        };
        let k = normal(&[B, HKV, length as i32, D], seed);
        let v = normal(&[B, HKV, length as i32, D], seed + 1);
        let q = normal(&[B, HQ, length as i32, D], seed + 2);
        let first = keys.len();
        let read = match step {
            Step::Decode => cache.append_decode(&k, &v).unwrap(),
            Step::Bidirectional(flags) => cache
                .bidirectional()
                .expect("attention storages take image blocks")
                .append_bidirectional(&k, &v, flags)
                .unwrap(),
            _ => cache.append_window(&k, &v).unwrap(),
        };
        for i in 0..length as i32 {
            keys.push(k.slice(&[0, 0, i, 0], &[B, HKV, i + 1, D], &[1, 1, 1, 1]).unwrap());
            values.push(v.slice(&[0, 0, i, 0], &[B, HKV, i + 1, D], &[1, 1, 1, 1]).unwrap());
        }
        assert_eq!(cache.offset(), keys.len(), "offset advances by the appended length");
        let got = read.attend(&q, 0.5).unwrap();
        let flags = match step {
            Step::Bidirectional(flags) => Some(flags.as_slice()),
            _ => None,
        };
        let (seen_k, seen_v) = match converted {
            Some(_) if !kv.format.is_full() => round_trip(kv.format, &keys, &values),
            _ => (keys.clone(), values.clone()),
        };
        let want = naive(&q, &seen_k, &seen_v, first, window, flags);
        let diff = max_diff(&got, &want);
        let tolerance = if converted.is_some() && !kv.format.is_full() { 1e-4 } else { 1e-5 };
        assert!(diff < tolerance, "step {n} ({step:?}) differs by {diff}: {kv:?}, steps {steps:?}");
        if converted.is_none() && keys.len() >= kv.start {
            converted = Some(keys.len());
        }
        assert_eq!(cache.minimum_reusable_offset(), converted.unwrap_or(0), "{kv:?}");
        checked += 1;
    }
    checked
}

/// Each position through `format` and back, one position at a time (so the naive recompute
/// does not share the cache's batching of positions).
fn round_trip(format: KvFormat, keys: &[Array], values: &[Array]) -> (Vec<Array>, Vec<Array>) {
    keys.iter().zip(values).map(|(k, v)| format.round_trip(k, v).unwrap()).unzip()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn plain_cache_matches_naive_attention(steps in steps(), kv in encodings(), seed in 0u64..1000) {
        run(plain(kv).as_mut(), None, kv, &steps, seed);
    }

    #[test]
    fn rotating_cache_matches_naive_windowed_attention(steps in steps(), window in 1usize..8, kv in encodings(), seed in 0u64..1000) {
        run(ring(window, kv).as_mut(), Some(window), kv, &steps, seed);
    }
}

#[test]
fn a_read_stays_valid_after_later_appends() {
    let mut cache = PlainCache::new();
    let k = normal(&[B, HKV, 3, D], 1);
    let v = normal(&[B, HKV, 3, D], 2);
    let q = normal(&[B, HQ, 3, D], 3);
    let read = cache.append_window(&k, &v).unwrap();
    let before = read.attend(&q, 0.5).unwrap();
    before.eval().unwrap();
    for s in 0..5 {
        cache
            .append_decode(&normal(&[B, HKV, 1, D], 10 + s), &normal(&[B, HKV, 1, D], 20 + s))
            .unwrap();
    }
    assert_eq!(max_diff(&read.attend(&q, 0.5).unwrap(), &before), 0.0, "a read owns its handles");
}

#[test]
fn state_round_trip_continues_identically() {
    for window in [None, Some(3usize), Some(5)] {
        let make = || -> Box<dyn AttentionCache> {
            match window {
                None => Box::new(PlainCache::new()),
                Some(w) => Box::new(RotatingCache::new(w).unwrap()),
            }
        };
        let mut original = make();
        original.append_window(&normal(&[B, HKV, 4, D], 1), &normal(&[B, HKV, 4, D], 2)).unwrap();
        original.append_decode(&normal(&[B, HKV, 1, D], 3), &normal(&[B, HKV, 1, D], 4)).unwrap();
        original.append_decode(&normal(&[B, HKV, 1, D], 5), &normal(&[B, HKV, 1, D], 6)).unwrap();
        let state = original.state().unwrap();
        assert_eq!(state.metadata["offset"], "6");
        assert_eq!(state.metadata["signature"], original.signature());
        let stored = state.tensors["keys"].dim(2).unwrap() as usize;
        assert_eq!(stored, window.map_or(6, |w| w.min(6)), "only valid positions are saved");
        let mut restored = make();
        restored.restore(&state).unwrap();
        assert_eq!(restored.offset(), 6);
        for s in 0..4u64 {
            let (k, v, q) = (
                normal(&[B, HKV, 1, D], 50 + s),
                normal(&[B, HKV, 1, D], 60 + s),
                normal(&[B, HQ, 1, D], 70 + s),
            );
            let a = original.append_decode(&k, &v).unwrap().attend(&q, 0.5).unwrap();
            let b = restored.append_decode(&k, &v).unwrap().attend(&q, 0.5).unwrap();
            assert_eq!(max_diff(&a, &b), 0.0, "{window:?}: restored state reads bit-identically");
        }
        let (k, v, q) =
            (normal(&[B, HKV, 3, D], 80), normal(&[B, HKV, 3, D], 81), normal(&[B, HQ, 3, D], 82));
        let a = original.append_window(&k, &v).unwrap().attend(&q, 0.5).unwrap();
        let b = restored.append_window(&k, &v).unwrap().attend(&q, 0.5).unwrap();
        assert_eq!(max_diff(&a, &b), 0.0);
    }
}

#[test]
fn a_mismatched_state_is_refused_and_bad_appends_leave_the_cache_unchanged() {
    let mut plain = PlainCache::new();
    plain.append_window(&normal(&[B, HKV, 2, D], 1), &normal(&[B, HKV, 2, D], 2)).unwrap();
    let state = plain.state().unwrap();
    let mut ring = RotatingCache::new(4).unwrap();
    assert!(ring.restore(&state).is_err(), "a plain state does not restore into a ring");
    assert_eq!(ring.offset(), 0);
    let before = plain.offset();
    assert!(
        plain.append_decode(&normal(&[B, HKV, 2, D], 3), &normal(&[B, HKV, 2, D], 4)).is_err(),
        "decode takes one position"
    );
    assert!(
        plain.append_window(&normal(&[B, HKV, 2, D], 3), &normal(&[B, HKV, 3, D], 4)).is_err(),
        "keys and values disagree"
    );
    assert_eq!(plain.offset(), before, "a rejected append changes nothing");
    assert_eq!(plain.signature(), "plain");
    assert_eq!(ring.signature(), "rotating(window=4)");
    assert_eq!(plain.bytes_per_token(), (2 * HKV * D * 4) as usize);
}

/// Attention of one query position in f32 by element-wise products and sums: no matrix
/// product, which MLX-CUDA may run in TF32, so the reference is exact on every backend.
fn exact_attention(q: &Array, k: &Array, v: &Array, scale: f32) -> Array {
    let (heads, dim) = (q.dim(1).unwrap(), q.dim(3).unwrap());
    let (kv_heads, len) = (k.dim(1).unwrap(), k.dim(2).unwrap());
    let group = heads / kv_heads;
    let q = q.reshape(&[1, kv_heads, group, 1, dim]).unwrap();
    let k = k.reshape(&[1, kv_heads, 1, len, dim]).unwrap();
    let v = v.reshape(&[1, kv_heads, 1, len, dim]).unwrap();
    let scores =
        q.multiply(&k).unwrap().sum(&[-1], false).unwrap().multiply_scalar(f64::from(scale));
    let p = scores.unwrap().softmax(&[-1], true).unwrap().expand_dims(&[-1]).unwrap();
    p.multiply(&v).unwrap().sum(&[-2], false).unwrap().reshape(&[1, heads, 1, dim]).unwrap()
}

/// A decode read (one query, no mask) equals exact attention whichever ops the cache was
/// built with: Quince's kernels (on CUDA the one-query kernel, elsewhere MLX's op route, as
/// there are no kernels) and MLX's own. The keys are a read's valid prefix of a larger buffer
/// (a strided view), the kernel's case.
#[test]
fn a_decode_read_equals_exact_attention_with_either_ops() {
    use engine::KernelOptions;
    use engine::backend::Ops;
    let cases = [
        (Dtype::Float32, 8, 2, 256, 9),
        (Dtype::Float32, 8, 2, 512, 700),
        (Dtype::Bfloat16, 8, 2, 512, 9),
        (Dtype::Bfloat16, 8, 2, 256, 1100),
        (Dtype::Float32, 4, 4, 64, 33),
        (Dtype::Float32, 8, 1, 512, 4100), // split across blocks, an uneven last block
    ];
    let cuda = mlx::Backend::current() == mlx::Backend::Cuda;
    for (name, ops) in [("quince", Ops::new(&KernelOptions::default())), ("mlx", Ops::mlx())] {
        for (dtype, heads, kv_heads, dim, len) in cases {
            let mut cache = PlainCache::with_ops(&ops);
            let kv = |seed| normal(&[1, kv_heads, len, dim], seed).astype(dtype).unwrap();
            let (k, v) = (kv(1), kv(2));
            let at = |x: &Array, from, to| {
                x.slice(&[0, 0, from, 0], &[1, kv_heads, to, dim], &[1; 4]).unwrap()
            };
            cache.append_window(&at(&k, 0, len - 1), &at(&v, 0, len - 1)).unwrap();
            let read = cache.append_decode(&at(&k, len - 1, len), &at(&v, len - 1, len)).unwrap();
            let q = normal(&[1, heads, 1, dim], 3).astype(dtype).unwrap();
            let f32 = |x: &Array| x.astype(Dtype::Float32).unwrap();
            for scale in [1.0, 0.0625] {
                let ours = read.attend(&q, scale).unwrap();
                let mlx = |q: &Array, k: &Array, v: &Array| {
                    mlx::fast::scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        scale,
                        mlx::fast::AttentionMask::None,
                        None,
                    )
                    .unwrap()
                };
                assert_eq!(ours.shape(), vec![1, heads, 1, dim]);
                assert_eq!(ours.dtype(), dtype);
                // Against the exact (f32) attention; in bf16 MLX itself rounds the scores and
                // the weights, so a route may be as far off as MLX's own bf16 result, plus
                // one rounding of the output.
                let exact = exact_attention(&f32(&q), &f32(&k), &f32(&v), scale);
                let diff = max_diff(&f32(&ours), &exact);
                let allowed = if dtype == Dtype::Float32 {
                    // MLX-CUDA's attention may run its products in TF32 (10-bit mantissa);
                    // Quince's kernel and every CPU route are f32 throughout.
                    if cuda && !ops.has_kernels() { 2e-2 } else { 1e-5 }
                } else {
                    max_diff(&f32(&mlx(&q, &k, &v)), &exact) + 8e-3
                };
                assert!(
                    diff <= allowed,
                    "{name} {dtype:?} {heads}/{kv_heads} heads of {dim}, {len} keys, \
                     scale {scale}: {diff} > {allowed}"
                );
            }
        }
    }
}

/// Long one-query reads split only where Quince's CUDA kernel runs them, which is what the
/// app's warm-up decodes past; everywhere else, and with MLX's ops, there is nothing to warm.
#[test]
fn split_reads_apply_only_to_the_cuda_kernel() {
    use engine::KernelOptions;
    use engine::backend::Ops;
    let on_cuda = mlx::Backend::current() == mlx::Backend::Cuda;
    match Ops::new(&KernelOptions::default()).split_reads_above() {
        Some(keys) => assert!(on_cuda && keys >= 512, "{keys}"),
        None => assert!(!on_cuda),
    }
    assert_eq!(Ops::mlx().split_reads_above(), None);
    assert_eq!(Ops::new(&KernelOptions::mlx()).split_reads_above(), None);
}

/// A committed span reads each of its positions as a decode step would, bit for bit, and
/// leaves the storage as those decode steps leave it; a block read sees the stored context
/// (a ring's window) and the whole block, and stores nothing.
#[test]
fn committed_spans_are_decode_steps_and_block_reads_store_nothing() {
    use engine::cache::{BlockAttentionCache, CommittedAttentionCache};
    type Make = fn() -> Box<dyn AttentionCache>;
    let makers: [(&str, Option<usize>, Make); 3] = [
        ("plain", None, || Box::new(PlainCache::new())),
        ("ring 3", Some(3), || Box::new(RotatingCache::new(3).unwrap())),
        ("ring 8", Some(8), || Box::new(RotatingCache::new(8).unwrap())),
    ];
    for (name, window, make) in makers {
        for prefix in [1usize, 2, 5] {
            let (k0, v0) =
                (normal(&[B, HKV, prefix as i32, D], 1), normal(&[B, HKV, prefix as i32, D], 2));
            let (k, v) = (normal(&[B, HKV, 4, D], 3), normal(&[B, HKV, 4, D], 4));
            let q = normal(&[B, HQ, 4, D], 5);
            let (mut span, mut steps) = (make(), make());
            span.append_window(&k0, &v0).unwrap();
            steps.append_window(&k0, &v0).unwrap();
            let committed: &mut dyn CommittedAttentionCache = span.committed().unwrap();
            let read = committed.append_committed(&k, &v).unwrap();
            let out = read.attend(&q, 0.5).unwrap();
            // The last two queries alone (a pass that needs only the last rows) read as the
            // whole span's last two.
            let last = q.slice(&[0, 0, 2, 0], &[B, HQ, 4, D], &[1; 4]).unwrap();
            let tail_out = out.slice(&[0, 0, 2, 0], &[B, HQ, 4, D], &[1; 4]).unwrap();
            assert!(bitwise_equal(&read.attend(&last, 0.5).unwrap(), &tail_out), "{name}");
            let at = |x: &Array, i: i32, heads: i32| {
                x.slice(&[0, 0, i, 0], &[B, heads, i + 1, D], &[1; 4]).unwrap()
            };
            for i in 0..4 {
                let read = steps.append_decode(&at(&k, i, HKV), &at(&v, i, HKV)).unwrap();
                let want = read.attend(&at(&q, i, HQ), 0.5).unwrap();
                assert!(
                    bitwise_equal(&at(&out, i, HQ), &want),
                    "{name}, prefix {prefix}: query {i}"
                );
            }
            assert_eq!(span.offset(), steps.offset());
            for (x, y) in span.buffers().iter().zip(steps.buffers()) {
                assert!(bitwise_equal(x, &y), "{name}: the span stores what the steps store");
            }

            // A block of 3 over what is stored now.
            let (bk, bv) = (normal(&[B, HKV, 3, D], 6), normal(&[B, HKV, 3, D], 7));
            let bq = normal(&[B, HQ, 3, D], 8);
            let before = span.offset();
            let block: &dyn BlockAttentionCache = span.block().unwrap();
            let got = block.read_block(&bk, &bv).unwrap().attend(&bq, 0.5).unwrap();
            assert_eq!(span.offset(), before, "a block read appends nothing");
            let history_k = ops::concatenate(&[&k0, &k], 2).unwrap();
            let history_v = ops::concatenate(&[&v0, &v], 2).unwrap();
            let total = prefix as i32 + 4;
            let kept = window.map_or(total, |w| (w as i32).min(total));
            let tail = |x: &Array| {
                x.slice(&[0, 0, total - kept, 0], &[B, HKV, total, D], &[1; 4]).unwrap()
            };
            let keys = [tail(&history_k)]
                .into_iter()
                .chain((0..3).map(|i| at(&bk, i, HKV)))
                .collect::<Vec<_>>();
            let values = [tail(&history_v)]
                .into_iter()
                .chain((0..3).map(|i| at(&bv, i, HKV)))
                .collect::<Vec<_>>();
            // Every key visible to every query: `naive` with the whole block as one image run
            // past a history it sees entirely.
            let want = naive(&bq, &keys, &values, kept as usize, None, Some(&[true, true, true]));
            let diff = max_diff(&got, &want);
            assert!(diff < 1e-5, "{name}, prefix {prefix}: block read off by {diff}");
            // The next decode is unaffected.
            let (dk, dv) = (normal(&[B, HKV, 1, D], 9), normal(&[B, HKV, 1, D], 10));
            let dq = normal(&[B, HQ, 1, D], 11);
            let a = span.append_decode(&dk, &dv).unwrap().attend(&dq, 0.5).unwrap();
            let b = steps.append_decode(&dk, &dv).unwrap().attend(&dq, 0.5).unwrap();
            assert!(bitwise_equal(&a, &b), "{name}: the block left the cache alone");
        }
    }
}
