//! `compile`: compiled closures equal uncompiled ones, trace once per signature, and report
//! closure errors and panics as errors.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use mlx::{Array, Dtype, compile};

use crate::common::{assert_close, values};

fn block(inputs: &[Array]) -> mlx::Result<Vec<Array>> {
    let (x, w) = (&inputs[0], &inputs[1]);
    let h = x.matmul(w)?.add_scalar(1.0)?.gelu_approx()?;
    Ok(vec![h.softmax(&[-1], false)?, h.sum_all(false)?])
}

#[test]
fn compiled_equals_uncompiled_and_traces_once() {
    let traces = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&traces);
    let compiled = compile(
        move |inputs: &[Array]| {
            counter.fetch_add(1, Ordering::SeqCst);
            block(inputs)
        },
        false,
    )
    .unwrap();
    for seed in 0..3u64 {
        let key = mlx::random::key(seed).unwrap();
        let x = mlx::random::normal(&[4, 8], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
        let w = mlx::random::normal(
            &[8, 5],
            Dtype::Float32,
            0.0,
            1.0,
            Some(&mlx::random::key(seed + 10).unwrap()),
        )
        .unwrap();
        let got = compiled.call(&[&x, &w]).unwrap();
        let want = block(&[x.clone(), w.clone()]).unwrap();
        assert_eq!(got.len(), 2);
        assert_close(&got[0], &want[0], 1e-6);
        assert_close(&got[1], &want[1], 1e-4);
    }
    assert_eq!(traces.load(Ordering::SeqCst), 1, "same shapes: traced once, replayed after");
    // A new shape traces again (not shapeless).
    let x = mlx::ops::ones(&[2, 8], Dtype::Float32).unwrap();
    let w = mlx::ops::ones(&[8, 5], Dtype::Float32).unwrap();
    let got = compiled.call(&[&x, &w]).unwrap();
    assert_close(&got[0], &block(&[x, w]).unwrap()[0], 1e-6);
    assert_eq!(traces.load(Ordering::SeqCst), 2);
}

#[test]
fn shapeless_compile_serves_every_shape() {
    let compiled = compile(
        |inputs: &[Array]| Ok(vec![inputs[0].multiply(&inputs[0])?.add_scalar(2.0)?.tanh()?]),
        true,
    )
    .unwrap();
    for shape in [vec![4], vec![2, 3], vec![1, 5, 2]] {
        let n: i32 = shape.iter().product();
        let x = mlx::ops::arange(0.0, f64::from(n), 1.0, Dtype::Float32)
            .unwrap()
            .multiply_scalar(0.1)
            .unwrap()
            .reshape(&shape)
            .unwrap();
        let got = &compiled.call(&[&x]).unwrap()[0];
        assert_eq!(got.shape(), shape);
        let expected: Vec<f32> = values(&x).iter().map(|v| (v * v + 2.0).tanh()).collect();
        let actual = values(got);
        for (a, e) in actual.iter().zip(&expected) {
            assert!((a - e).abs() < 1e-6, "{actual:?} vs {expected:?}");
        }
    }
}

#[test]
fn closure_errors_and_panics_come_back_as_errors() {
    let failing =
        compile(|inputs: &[Array]| Ok(vec![inputs[0].matmul(&inputs[0])?]), false).unwrap();
    let x = mlx::ops::ones(&[2, 3], Dtype::Float32).unwrap();
    let err = failing.call(&[&x]).expect_err("[2,3] @ [2,3] cannot multiply");
    assert!(err.message().contains("matmul"), "MLX's message comes through: {err}");

    let panicking =
        compile(|_: &[Array]| -> mlx::Result<Vec<Array>> { panic!("boom") }, false).unwrap();
    let err = panicking.call(&[&x]).expect_err("a panic is an error, not an abort");
    assert!(err.message().contains("boom"), "{err}");

    // MLX is still usable afterwards.
    assert_eq!(x.sum_all(false).unwrap().item::<f32>().unwrap(), 6.0);
}

#[test]
fn graph_census_counts_each_pending_node_once() {
    let x = Array::from_slice(&[0.5f32, 1.5, 2.5, 3.5], &[4]).unwrap();
    let a = x.multiply_scalar(2.0).unwrap(); // Multiply, and a Broadcast of the scalar
    let census = |arrays: &[&Array]| mlx::graph_census(arrays);
    assert_eq!(census(&[&a]).get("Multiply"), Some(&1));
    // A multi-output node is one node, however many of its outputs are asked for.
    let parts = a.split_equal(2, 0).unwrap();
    let split = census(&[&parts[0], &parts[1]]);
    assert_eq!(split.values().sum::<usize>(), census(&[&a]).values().sum::<usize>() + 1);
    // Two calls of one compiled function share its primitive and are still two nodes, each
    // with its own inputs counted (telling nodes apart by primitive would stop at the first).
    let f = compile(|x: &[Array]| Ok(vec![x[0].multiply(&x[1])?.tanh()?]), true).unwrap();
    let b = a.exp().unwrap();
    let y1 = f.call(&[&a, &a]).unwrap().remove(0);
    let y2 = f.call(&[&y1, &b]).unwrap().remove(0);
    let both = census(&[&y2]);
    let compiled: usize =
        both.iter().filter(|(name, _)| name.starts_with("Compiled")).map(|(_, n)| n).sum();
    assert_eq!(compiled, 2, "{both:?}");
    assert_eq!(both.get("Exp"), Some(&1), "{both:?}");
    assert_eq!(both.get("Multiply"), Some(&1), "{both:?}");
    // Evaluated nodes are done: nothing is left to count.
    mlx::eval(&[&y2]).unwrap();
    assert!(census(&[&y2]).is_empty());
}
