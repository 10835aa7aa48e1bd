//! Reductions, softmax, sorting, partitions, top-k, cumulative sums.

use mlx::{Array, Dtype};

use crate::common::{assert_close, assert_same, fx, values};

#[test]
fn sums_means_extrema() {
    let x = fx("reduce.x");
    assert_close(&x.sum(&[1], false).unwrap(), &fx("reduce.sum_1"), 1e-5);
    assert_close(&x.mean(&[0, 2], false).unwrap(), &fx("reduce.mean_02"), 1e-6);
    assert_same(&x.max(&[2], true).unwrap(), &fx("reduce.max_2_keep"));
    assert_same(&x.min_all(false).unwrap(), &fx("reduce.min_all"));
    assert_close(&x.logsumexp(&[-1], false).unwrap(), &fx("reduce.logsumexp_last"), 1e-5);
    let counts = Array::from_slice(&[true, false, true, true], &[2, 2]).unwrap();
    assert_eq!(counts.all(&[1], false).unwrap().to_vec::<bool>().unwrap(), vec![false, true]);
    assert!(counts.any_all(false).unwrap().item::<bool>().unwrap());
    let p = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    assert_eq!(p.prod_all(false).unwrap().item::<f32>().unwrap(), 24.0);
}

#[test]
fn softmax_rows_sum_to_one() {
    let x = fx("reduce.x");
    let s = x.softmax(&[-1], false).unwrap();
    assert_close(&s, &fx("reduce.softmax_last"), 1e-6);
    let precise = x.astype(Dtype::Bfloat16).unwrap().softmax(&[-1], true).unwrap();
    assert_eq!(precise.dtype(), Dtype::Bfloat16);
    assert_close(&precise, &fx("reduce.softmax_last"), 1e-2);
}

#[test]
fn argmax_sort_argsort() {
    let x = fx("reduce.x");
    assert_same(&x.argmax(1, false).unwrap(), &fx("reduce.argmax_1"));
    assert_eq!(x.argmax(1, false).unwrap().dtype(), Dtype::Uint32);
    assert_same(&x.sort(-1).unwrap(), &fx("reduce.sort_last"));
    assert_same(&x.argsort(-1).unwrap(), &fx("reduce.argsort_last"));
    let y = Array::from_slice(&[3.0f32, -1.0, 2.0], &[3]).unwrap();
    assert_eq!(y.argmin(0, false).unwrap().item::<u32>().unwrap(), 1);
}

#[test]
fn argpartition_and_topk() {
    let x = fx("reduce.x");
    let k = 3; // the 3 largest of the last axis (length 4)
    let n = x.dim(-1).unwrap();
    let idx = x.argpartition(n - k, -1).unwrap();
    let picked = x.take_along_axis(&idx, -1).unwrap();
    // Everything before the pivot is ≤ it, everything after is ≥ it.
    let rows = values(&picked);
    for row in rows.chunks(n as usize) {
        let pivot = row[(n - k) as usize];
        assert!(row[..(n - k) as usize].iter().all(|&v| v <= pivot), "{row:?}");
        assert!(row[(n - k) as usize..].iter().all(|&v| v >= pivot), "{row:?}");
    }
    let top = x.topk(k, -1).unwrap().sort(-1).unwrap();
    assert_same(&top, &fx("reduce.topk3_sorted"));
    let part = x.partition(n - k, -1).unwrap();
    assert_same(&part.sort(-1).unwrap(), &fx("reduce.sort_last"));
}

#[test]
fn cumulative_sums() {
    let x = fx("reduce.x");
    assert_close(&x.cumsum(1, false, true).unwrap(), &fx("reduce.cumsum_1"), 1e-5);
    assert_close(
        &x.cumsum(1, true, false).unwrap(),
        &fx("reduce.cumsum_1_reverse_exclusive"),
        1e-5,
    );
}
