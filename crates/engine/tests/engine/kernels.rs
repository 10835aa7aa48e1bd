//! Quince's kernels (`engine::backend`, CUDA) against the MLX ops they replace. The kernels
//! run only on MLX's CUDA backend: there (the engine test binary run against MLX-CUDA, see
//! `docs/testing.md`) these tests compare kernel and ops and check that the kernels ran; on any
//! other backend they check that the kernel set is empty and the MLX route gives its numbers.

use engine::KernelOptions;
use engine::backend::{Heads, HeadsLayout, Ops, RopeSpec, mlx as routes};
use engine::nn::{Activations, RmsNorm};
use mlx::{Array, Dtype, random};

fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&random::key(seed).unwrap()))
        .unwrap()
        .astype(dtype)
        .unwrap()
}

fn f32(x: &Array) -> Array {
    x.astype(Dtype::Float32).unwrap()
}

fn max_abs(x: &Array) -> f32 {
    f32(x).abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

/// Checks `got` against `want`: in f32 to 1e-5 of the largest value; in bf16 to two units in
/// the last place of the largest value (a sum of squares added in another order can move a
/// norm by one f32 ulp, and that can round a bf16 result the other way).
fn assert_close(got: &Array, want: &Array, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let scale = max_abs(want).max(1.0);
    let diff = max_abs(&f32(got).subtract(&f32(want)).unwrap());
    let allowed = if want.dtype() == Dtype::Float32 { 1e-5 } else { 2.0 * 2f32.powi(-7) } * scale;
    assert!(diff <= allowed, "{what}: {diff} > {allowed}");
}

fn cuda() -> bool {
    mlx::Backend::current() == mlx::Backend::Cuda
}

/// The backend's kernels, as a model loads them by default.
fn kernels() -> Ops {
    Ops::new(&KernelOptions::default())
}

/// Runs `f` with the backend's kernels `ops` and then with MLX's ops.
fn on_and_off<T>(ops: &Ops, f: impl Fn(&Ops) -> T) -> (T, T) {
    (f(ops), f(&Ops::mlx()))
}

/// Checks that `kernel` ran on CUDA, and that nothing of Quince's exists elsewhere.
fn assert_ran(ops: &Ops, kernel: &str) {
    let used = ops.kernels_in_use();
    if cuda() {
        assert!(used.contains(&kernel), "{kernel} did not run ({used:?})");
    } else {
        assert!(!ops.has_kernels() && used.is_empty(), "no kernel of Quince's off CUDA");
    }
}

/// RMS norm over the last axis in f32 from plain ops (`x · rsqrt(mean(x²) + eps) · w`): a
/// reference independent of `fast::rms_norm`, so the test also fails on the CPU when the
/// route is wrong.
fn plain_norm(x: &Array, w: &Array) -> Array {
    let mean = f32(x).square().unwrap().mean(&[-1], true).unwrap();
    let n = mean.add_scalar(1e-6).unwrap().rsqrt().unwrap();
    f32(x).multiply(&n).unwrap().multiply(&f32(w)).unwrap()
}

/// `got` against an f32 reference: 1e-5 of the largest value in f32, a few bf16 roundings in
/// bf16 (each op of the route rounds once).
fn assert_near_reference(got: &Array, reference: &Array, what: &str) {
    let scale = max_abs(reference).max(1.0);
    let diff = max_abs(&f32(got).subtract(reference).unwrap());
    let allowed = if got.dtype() == Dtype::Float32 { 1e-5 } else { 4.0 * 2f32.powi(-8) } * scale;
    assert!(diff <= allowed, "{what}: {diff} from the reference > {allowed}");
}

#[test]
fn residual_norm_equals_its_mlx_ops() {
    let ops = kernels();
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        for (rows, d) in [(1, 2560), (3, 320), (2, 64)] {
            let h = normal(&[rows, 1, d], 1, dtype);
            let x = normal(&[rows, 1, d], 2, dtype).multiply_scalar(3.0).unwrap();
            let a = RmsNorm::new(normal(&[d], 3, dtype), 1e-6);
            let b = RmsNorm::new(normal(&[d], 4, dtype), 1e-6);
            let scalar = Array::from_slice(&[0.625f32], &[1]).unwrap().astype(dtype).unwrap();
            for scale in [None, Some(&scalar)] {
                for next in [None, Some(&b)] {
                    let what = format!(
                        "{dtype:?} {rows}×{d} scale {} next {}",
                        scale.is_some(),
                        next.is_some()
                    );
                    let (on, off) =
                        on_and_off(&ops, |ops| ops.residual_norm(&h, &x, &a, scale, next).unwrap());
                    assert_close(&on.0, &off.0, &format!("{what}: sum"));
                    let mut sum = f32(&h).add(&plain_norm(&x, a.weight().unwrap())).unwrap();
                    if let Some(s) = scale {
                        sum = sum.multiply(&f32(s)).unwrap();
                    }
                    assert_near_reference(&off.0, &sum, &format!("{what}: sum"));
                    if let (Some(normed), Some(b)) = (&off.1, next) {
                        let want = plain_norm(&off.0, b.weight().unwrap());
                        assert_near_reference(normed, &want, &format!("{what}: norm"));
                    }
                    assert_eq!(on.1.is_some(), next.is_some(), "{what}: a norm only when asked");
                    if let (Some(n_on), Some(n_off)) = (&on.1, &off.1) {
                        assert_close(n_on, n_off, &format!("{what}: norm"));
                    }
                }
            }
        }
    }
    assert_ran(&ops, "quince_residual_norm");
}

#[test]
fn geglu_kernels_equal_their_mlx_ops() {
    let ops = kernels();
    let act = Activations::new().unwrap();
    let one = Array::scalar(1i32).unwrap();
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        for (rows, w) in [(1, 10240), (2, 1000)] {
            let joined = normal(&[rows, 1, 2 * w], 5, dtype).multiply_scalar(2.0).unwrap();
            let halves = routes::split_last(&joined, &[w, w]).unwrap();
            let want = act.geglu(&halves[0], &halves[1]).unwrap();
            assert!(Ops::mlx().geglu_halves(&joined, &one).unwrap().is_none(), "MLX: no kernel");
            match ops.geglu_halves(&joined, &one).unwrap() {
                Some(got) => assert_close(&got, &want, &format!("halves {dtype:?} {rows}×{w}")),
                None => assert!(!cuda(), "the GEGLU kernel refused {dtype:?} {rows}×{w} on CUDA"),
            }
        }
        let (layers, w) = (5, 256);
        let inputs = normal(&[2, 1, layers, w], 6, dtype);
        let gate = normal(&[2, 1, w], 7, dtype).multiply_scalar(2.0).unwrap();
        for layer in [0, 3, layers - 1] {
            let index = Array::scalar(layer).unwrap();
            let (on, off) =
                on_and_off(&ops, |ops| ops.geglu_at(&gate, &inputs, layer, &index, &act).unwrap());
            assert_close(&on, &off, &format!("layer {layer} {dtype:?}"));
        }
    }
    assert_ran(&ops, "quince_geglu");
}

#[test]
fn decode_heads_equal_their_mlx_ops() {
    let ops = kernels();
    // Gemma 4 E4B's shapes: sliding heads of 256 (8 query, 2 key-value), full heads of 512
    // with values from the raw keys, and a KV-shared layer (queries only).
    let cases = [(256, 8, 2, 10), (512, 8, 1, 8), (256, 8, 0, 8)];
    let proportional: Vec<f32> = (0..256)
        .map(|i| if i < 64 { 1e6f32.powf(i as f32 / 256.0) } else { f32::INFINITY })
        .collect();
    let periods = Array::from_slice(&proportional, &[256]).unwrap();
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        for (d, q_heads, kv_heads, values_at) in cases {
            let heads_in = q_heads + 2 * kv_heads;
            let proj = normal(&[2, 1, heads_in * d], 8, dtype).multiply_scalar(4.0).unwrap();
            let q_norm = RmsNorm::new(normal(&[d], 9, dtype), 1e-6);
            let k_norm = RmsNorm::new(normal(&[d], 10, dtype), 1e-6);
            let layout = HeadsLayout {
                head_dim: d,
                q_heads,
                kv_heads,
                values_at,
                q_norm: &q_norm,
                k_norm: &k_norm,
            };
            let freqs = (d == 512).then_some(&periods);
            for traditional in [false, true] {
                let rope = RopeSpec { traditional, base: 10_000.0, freqs };
                for position in [0, 1234] {
                    let what = format!(
                        "{dtype:?} {q_heads}/{kv_heads} heads of {d}, traditional {traditional}, position {position}"
                    );
                    let want: Heads =
                        routes::decode_heads(&proj, &layout, &rope, position).unwrap();
                    let got = ops
                        .decode_heads(&proj, &layout, &rope, &Array::scalar(position).unwrap())
                        .unwrap();
                    let Some(got) = got else {
                        assert!(!cuda(), "{what}: the kernel refused the inputs on CUDA");
                        continue;
                    };
                    assert_close(&got.q, &want.q, &format!("{what}: q"));
                    assert_eq!(got.kv.is_some(), kv_heads > 0, "{what}: keys only with key heads");
                    if let (Some((k, v)), Some((wk, wv))) = (&got.kv, &want.kv) {
                        assert_close(k, wk, &format!("{what}: k"));
                        assert_close(v, wv, &format!("{what}: v"));
                    }
                }
            }
        }
    }
    assert_ran(&ops, "quince_decode_heads");
}

/// The 4-bit matrix-vector kernel against MLX's product on E4B's shapes (o_proj and the
/// k/v projection), one row and four, and through `Linear` as a decode step calls it. On
/// CUDA the kernel must run and agree within bf16 rounding of the largest output (it sums in
/// its own order); shapes it does not take, and a kernel set without it, give MLX's product
/// bit for bit.
#[test]
fn four_bit_kernel_matches_mlx_products() {
    let ops = kernels();
    for (n, k) in [(2560, 2048), (512, 2560)] {
        let w = normal(&[n, k], 40, Dtype::Bfloat16).multiply_scalar(0.02).unwrap();
        let q = mlx::quantized::quantize(&w, 64, 4).unwrap();
        let linear = engine::nn::Linear::new(engine::checkpoint::Matrix::Quantized(q.clone()));
        for rows in [1, 4] {
            let x = normal(&[1, rows, k], 41, Dtype::Bfloat16);
            let want = q.matmul(&x, true).unwrap();
            for got in [ops.quantized_matmul(&x, &q).unwrap(), linear.forward(&x, &ops).unwrap()] {
                assert_eq!(got.shape(), vec![1, rows, n]);
                let scale = max_abs(&want);
                let diff = max_abs(&f32(&got).subtract(&f32(&want)).unwrap());
                assert!(diff <= 1e-2 * scale, "{n}x{k}, {rows} rows: {diff} > 1e-2 · {scale}");
            }
        }
    }
    assert_ran(&ops, "quince_qmv4");
    let exactly_mlx = |ops: &Ops, x: &Array, q: &mlx::quantized::QuantizedMatrix| {
        let got = ops.quantized_matmul(x, q).unwrap();
        assert!(
            got.array_equal(&q.matmul(x, true).unwrap(), false).unwrap().item::<bool>().unwrap()
        );
    };
    // Shapes it does not take (a width that is no multiple of 512, 8 rows) go to MLX.
    let q = mlx::quantized::quantize(&normal(&[64, 640], 42, Dtype::Bfloat16), 64, 4).unwrap();
    exactly_mlx(&ops, &normal(&[1, 640], 43, Dtype::Bfloat16), &q);
    let q = mlx::quantized::quantize(&normal(&[64, 512], 44, Dtype::Bfloat16), 64, 4).unwrap();
    exactly_mlx(&ops, &normal(&[8, 512], 45, Dtype::Bfloat16), &q);
    // Switched off, it never runs.
    let without = Ops::new(&KernelOptions { quantized_matvec: false, ..KernelOptions::default() });
    let x = normal(&[1, 1, 2048], 46, Dtype::Bfloat16);
    let q = mlx::quantized::quantize(&normal(&[64, 2048], 47, Dtype::Bfloat16), 64, 4).unwrap();
    exactly_mlx(&without, &x, &q);
    assert!(!without.kernels_in_use().contains(&"quince_qmv4"));
}

/// A short window attended by MLX's ops (the route CUDA takes for a verify round's windows)
/// against MLX's fused attention, on every backend: grouped heads, L = 5 queries over 37 keys,
/// under the causal mask, bool masks of every shape the route takes, and an additive mask; in
/// f32 to 1e-5, in bf16 within its rounding. A mask shape it does not take is left to the
/// fused route.
#[test]
fn short_windows_by_ops_equal_mlx_fused_attention() {
    use mlx::fast::{AttentionMask, scaled_dot_product_attention};
    let (b, heads, kv_heads, length, keys, dim) = (2, 4, 2, 5, 37, 32);
    let scale = (dim as f32).powf(-0.5);
    let visible = |shape: &[i32], seed: u64| {
        // About one key in four hidden, never a whole row (the last key is always seen).
        let some = normal(shape, seed, Dtype::Float32).gt(&Array::scalar(-0.7f32).unwrap());
        let columns = mlx::ops::arange(0.0, f64::from(keys), 1.0, Dtype::Int32).unwrap();
        let last = columns.eq(&Array::scalar(keys - 1).unwrap()).unwrap();
        some.unwrap().logical_or(&last).unwrap()
    };
    let by_ops = Ops::new(&KernelOptions { window_by_ops: true, ..KernelOptions::default() });
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let q = normal(&[b, heads, length, dim], 60, dtype);
        let k = normal(&[b, kv_heads, keys, dim], 61, dtype);
        let v = normal(&[b, kv_heads, keys, dim], 62, dtype);
        let additive = normal(&[b, 1, length, keys], 63, Dtype::Float32).astype(dtype).unwrap();
        let masks = [
            visible(&[length, keys], 64),
            visible(&[b, 1, length, keys], 65),
            visible(&[b, heads, length, keys], 66),
            additive,
        ];
        let mut cases = vec![("causal", AttentionMask::Causal), ("none", AttentionMask::None)];
        for (name, m) in ["[L, S]", "[B, 1, L, S]", "[B, Hq, L, S]", "additive"].iter().zip(&masks)
        {
            cases.push((name, AttentionMask::Array(m)));
        }
        for (name, mask) in cases {
            let got = routes::attend_window_by_ops(&q, &k, &v, scale, mask).unwrap().unwrap();
            let want = scaled_dot_product_attention(&q, &k, &v, scale, mask, None).unwrap();
            assert_close(&got, &want, &format!("{dtype:?}, {name}"));
            let routed = by_ops.attend_window(&q, &k, &v, scale, mask).unwrap();
            assert_close(&routed, &want, &format!("{dtype:?}, {name}, through Ops"));
        }
        let other = visible(&[b, 1, 1, keys], 67);
        let left = routes::attend_window_by_ops(&q, &k, &v, scale, AttentionMask::Array(&other));
        assert!(left.unwrap().is_none(), "a [B, 1, 1, S] mask is the fused route's");
    }
}
