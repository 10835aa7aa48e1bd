//! Affine quantization: error bounds per bit width, quantized matmuls vs dequantize + matmul.

use mlx::quantized::quantize;
use mlx::{Array, Dtype, ops, random};

use crate::common::{assert_close, values};

fn weights(rows: i32, cols: i32, seed: u64) -> Array {
    random::normal(&[rows, cols], Dtype::Float32, 0.0, 1.0, Some(&random::key(seed).unwrap()))
        .unwrap()
}

/// The largest |w − dequantize(quantize(w))| and the bound it must respect per group:
/// one quantization step, (max − min) / (2^bits − 1).
fn worst_error_over_step(w: &Array, deq: &Array, group: usize, bits: i32) -> f32 {
    let (w, deq) = (values(w), values(deq));
    let levels = ((1u32 << bits) - 1) as f32;
    w.chunks(group)
        .zip(deq.chunks(group))
        .map(|(wg, dg)| {
            let max = wg.iter().copied().fold(f32::MIN, f32::max);
            let min = wg.iter().copied().fold(f32::MAX, f32::min);
            let step = (max - min) / levels;
            let err = wg.iter().zip(dg).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            err / step
        })
        .fold(0.0, f32::max)
}

#[test]
fn dequantize_error_is_within_one_step_for_every_width_and_group() {
    let w = weights(8, 256, 7);
    let mut mean_errors = Vec::new();
    for bits in [2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            let q = quantize(&w, group, bits).unwrap();
            assert_eq!(q.weight.dtype(), Dtype::Uint32, "packed words");
            assert_eq!(q.weight.shape(), vec![8, 256 * bits / 32], "{bits}-bit packing");
            assert_eq!(q.scales.shape(), vec![8, 256 / group]);
            assert_eq!(q.biases.shape(), vec![8, 256 / group]);
            let deq = q.dequantize().unwrap();
            assert_eq!(deq.shape(), w.shape());
            let ratio = worst_error_over_step(&w, &deq, group as usize, bits);
            assert!(ratio <= 1.0 + 1e-4, "{bits}-bit/{group}: error is {ratio} steps");
            if group == 64 {
                let err = w.subtract(&deq).unwrap().abs().unwrap().mean_all(false).unwrap();
                mean_errors.push((bits, err.item::<f32>().unwrap()));
            }
        }
    }
    // More bits, less error: each width strictly better than the one below it.
    for pair in mean_errors.windows(2) {
        assert!(pair[1].1 < pair[0].1, "mean error should fall with bits: {mean_errors:?}");
    }
    // 8-bit affine on N(0,1) data: error well under 1% of the range.
    assert!(mean_errors.last().map(|e| e.1).unwrap_or(1.0) < 0.01, "{mean_errors:?}");
}

#[test]
fn quantized_matmul_equals_dequantize_then_matmul() {
    let x = weights(3, 256, 1);
    for bits in [4, 8] {
        // A linear layer's weight [out, in]: x @ Wᵀ.
        let w = weights(48, 256, 2);
        let q = quantize(&w, 64, bits).unwrap();
        let expected = x.matmul(&q.dequantize().unwrap().transpose(&[]).unwrap()).unwrap();
        assert_close(&q.matmul(&x, true).unwrap(), &expected, 1e-3);
        // Without transpose: W is [in, out], quantized along `out`.
        let w = weights(256, 64, 3);
        let q = quantize(&w, 32, bits).unwrap();
        let expected = x.matmul(&q.dequantize().unwrap()).unwrap();
        assert_close(&q.matmul(&x, false).unwrap(), &expected, 1e-3);
    }
}

#[test]
fn a_batch_of_single_rows_is_each_row_alone() {
    // A batch's decode step `[B, 1, K]` is folded into `[B, K]` rows: every row's output is
    // bit for bit what it gets alone, and the shape comes back.
    let q = quantize(&weights(48, 256, 2), 64, 4).unwrap();
    let x = weights(4, 256, 5).reshape(&[4, 1, 256]).unwrap();
    let batch = q.matmul(&x, true).unwrap();
    assert_eq!(batch.shape(), [4, 1, 48]);
    for b in 0..4 {
        let row = x.slice(&[b, 0, 0], &[b + 1, 1, 256], &[1, 1, 1]).unwrap();
        let alone = q.matmul(&row, true).unwrap();
        let got = batch.slice(&[b, 0, 0], &[b + 1, 1, 48], &[1, 1, 1]).unwrap();
        let same = got.array_equal(&alone, false).unwrap().item::<bool>().unwrap();
        assert!(same, "row {b} differs from its solo product");
    }
}

#[test]
fn gather_qmm_picks_matrices_by_index() {
    // Three stacked expert matrices [3, 16, 128]; four tokens routed to experts 2, 0, 1, 2.
    let experts =
        random::normal(&[3, 16, 128], Dtype::Float32, 0.0, 1.0, Some(&random::key(5).unwrap()))
            .unwrap();
    let q = quantize(&experts, 64, 4).unwrap();
    let deq = q.dequantize().unwrap();
    let x = random::normal(&[4, 1, 128], Dtype::Float32, 0.0, 1.0, Some(&random::key(6).unwrap()))
        .unwrap();
    let route = [2u32, 0, 1, 2];
    let indices = Array::from_slice(&route, &[4]).unwrap();
    let out = q.gather_matmul(&x, None, Some(&indices), true, false).unwrap();
    assert_eq!(out.shape(), vec![4, 1, 16]);
    let mut rows = Vec::new();
    for (token, &expert) in route.iter().enumerate() {
        let t = token as i32;
        let xi = x.slice(&[t, 0, 0], &[t + 1, 1, 128], &[1, 1, 1]).unwrap();
        let e = expert as i32;
        let we = deq.slice(&[e, 0, 0], &[e + 1, 16, 128], &[1, 1, 1]).unwrap();
        rows.push(xi.matmul(&we.swapaxes(-1, -2).unwrap()).unwrap());
    }
    let expected = ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0).unwrap();
    assert_close(&out, &expected, 1e-3);
}
