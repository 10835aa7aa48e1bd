//! Broadcasting arithmetic, comparisons, unary math, activations, matmul, dtypes.

use mlx::{Array, Dtype, ops};

use crate::common::{assert_close, assert_same, fx, values};

#[test]
fn binary_ops_broadcast_like_numpy() {
    let (a, b, pos) = (fx("binary.a"), fx("binary.b"), fx("binary.pos"));
    assert_close(&a.add(&b).unwrap(), &fx("binary.add"), 1e-6);
    assert_close(&a.subtract(&b).unwrap(), &fx("binary.subtract"), 1e-6);
    assert_close(&a.multiply(&b).unwrap(), &fx("binary.multiply"), 1e-6);
    assert_close(&a.divide(&b).unwrap(), &fx("binary.divide"), 1e-4);
    assert_close(&pos.power(&b).unwrap(), &fx("binary.power"), 1e-4);
    assert_close(&a.maximum(&b).unwrap(), &fx("binary.maximum"), 0.0);
    assert_close(&a.minimum(&b).unwrap(), &fx("binary.minimum"), 0.0);
    assert_same(&a.lt(&b).unwrap(), &fx("binary.less"));
    assert_same(&a.ge(&b).unwrap(), &fx("binary.greater_equal"));
    assert_eq!(a.lt(&b).unwrap().dtype(), Dtype::Bool, "comparisons give bool");
}

#[test]
fn unary_math_and_activations() {
    let (a, pos) = (fx("binary.a"), fx("binary.pos"));
    assert_close(&a.exp().unwrap(), &fx("unary.exp"), 1e-5);
    assert_close(&pos.log().unwrap(), &fx("unary.log"), 1e-6);
    assert_close(&a.tanh().unwrap(), &fx("unary.tanh"), 1e-6);
    assert_close(&a.sigmoid().unwrap(), &fx("unary.sigmoid"), 1e-6);
    assert_close(&a.erf().unwrap(), &fx("unary.erf"), 1e-6);
    assert_close(&pos.sqrt().unwrap(), &fx("unary.sqrt"), 1e-6);
    assert_close(&pos.rsqrt().unwrap(), &fx("unary.rsqrt"), 1e-5);
    assert_close(&a.abs().unwrap(), &fx("unary.abs"), 0.0);
    assert_close(&a.gelu_approx().unwrap(), &fx("unary.gelu_approx"), 1e-5);
    assert_close(&a.silu().unwrap(), &fx("unary.silu"), 1e-6);
}

#[test]
fn matmul_and_addmm() {
    let (a, b, c) = (fx("matmul.a"), fx("matmul.b"), fx("matmul.c"));
    assert_close(&a.matmul(&b).unwrap(), &fx("matmul.ab"), 1e-5);
    assert_close(&ops::addmm(&c, &a, &b, 2.0, 0.5).unwrap(), &fx("addmm.result"), 1e-5);
}

#[test]
fn hand_computed_matmul() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = Array::from_slice(&[5.0f32, 6.0, 7.0, 8.0], &[2, 2]).unwrap();
    assert_eq!(a.matmul(&b).unwrap().to_vec::<f32>().unwrap(), vec![19.0, 22.0, 43.0, 50.0]);
    let ints = a.astype(Dtype::Int32).unwrap();
    assert!(ints.matmul(&ints).is_err(), "MLX multiplies matrices of floating types only");
}

#[test]
fn einsum_matches_numpy() {
    let (x, y, a) = (fx("einsum.x"), fx("einsum.y"), fx("matmul.a"));
    assert_close(&ops::einsum("ij,jk->ik", &[&x, &y]).unwrap(), &fx("einsum.ij_jk"), 1e-5);
    assert_close(&ops::einsum("ij,ij->i", &[&x, &x]).unwrap(), &fx("einsum.ij_ij"), 1e-5);
    let a4 = a.expand_dims(&[0]).unwrap();
    assert_close(
        &ops::einsum("bhld,bhsd->bhls", &[&a4, &a4]).unwrap(),
        &fx("einsum.bhld_bhsd"),
        1e-5,
    );
}

#[test]
fn bf16_path() {
    let (a, b) = (fx("bf16.a"), fx("bf16.b"));
    assert_eq!(a.dtype(), Dtype::Bfloat16);
    let sum = a.add(&b).unwrap();
    assert_eq!(sum.dtype(), Dtype::Bfloat16, "bf16 + bf16 stays bf16");
    assert_same(&sum, &fx("bf16.add"));
    assert_same(&a.multiply(&b).unwrap(), &fx("bf16.multiply"));
    let product = a.matmul(&b.transpose(&[]).unwrap()).unwrap();
    assert_eq!(product.dtype(), Dtype::Bfloat16);
    // One bf16 rounding of values of magnitude < 8: error ≤ 8 · 2⁻⁸.
    assert_close(&product, &fx("bf16.matmul"), 8.0 / 256.0);
    // Scalars adopt the array's dtype, as Python scalars do in MLX.
    assert_eq!(a.multiply_scalar(0.5).unwrap().dtype(), Dtype::Bfloat16);
    let raw: Vec<half::bf16> = a.to_vec().unwrap();
    assert_eq!(raw.len(), 32);
    assert_eq!(values(&a)[0], raw[0].to_f32());
}

#[test]
fn f16_path() {
    let (a, b) = (fx("f16.a"), fx("f16.b"));
    assert_eq!(a.dtype(), Dtype::Float16);
    assert_close(&a.add(&b).unwrap(), &fx("f16.add"), 4.0 / 1024.0);
    assert_close(&a.matmul(&b.transpose(&[]).unwrap()).unwrap(), &fx("f16.matmul"), 0.02);
    let raw: Vec<half::f16> = a.to_vec().unwrap();
    assert_eq!(raw[1].to_f32(), values(&a)[1]);
}

#[test]
fn astype_round_trips() {
    let x = fx("astype.f32");
    let bf = x.astype(Dtype::Bfloat16).unwrap();
    assert_same(&bf.astype(Dtype::Float32).unwrap(), &fx("astype.bf16_roundtrip"));
    let h = x.astype(Dtype::Float16).unwrap();
    assert_same(&h.astype(Dtype::Float32).unwrap(), &fx("astype.f16_roundtrip"));
    let ints = Array::from_slice(&[1.7f32, -2.2, 3.0], &[3]).unwrap().astype(Dtype::Int32).unwrap();
    assert_eq!(ints.to_vec::<i32>().unwrap(), vec![1, -2, 3], "float → int truncates");
}

#[test]
fn every_element_type_round_trips() {
    fn round_trip<T: mlx::Element + PartialEq + std::fmt::Debug>(values: &[T]) {
        let a = Array::from_slice(values, &[values.len() as i32]).unwrap();
        assert_eq!(a.dtype(), T::DTYPE);
        assert_eq!(a.to_vec::<T>().unwrap(), values);
    }
    round_trip(&[true, false, true]);
    round_trip(&[0u8, 7, 255]);
    round_trip(&[0u32, 7, u32::MAX]);
    round_trip(&[i32::MIN, 0, i32::MAX]);
    round_trip(&[i64::MIN, 0, i64::MAX]);
    round_trip(&[-1.5f32, 0.0, 3.25]);
    round_trip(&[half::f16::from_f32(1.5), half::f16::from_f32(-0.25)]);
    round_trip(&[half::bf16::from_f32(1.5), half::bf16::from_f32(-0.25)]);
    let scalar = Array::scalar(2.5f32).unwrap();
    assert_eq!(scalar.shape(), Vec::<i32>::new());
    assert_eq!(scalar.item::<f32>().unwrap(), 2.5);
    assert_eq!(
        Array::scalar_as(2.75, Dtype::Bfloat16).unwrap().item::<half::bf16>().unwrap().to_f32(),
        2.75
    );
}

#[test]
fn lazy_until_read_and_async_eval() {
    let a = ops::arange(0.0, 6.0, 1.0, Dtype::Float32).unwrap();
    let b = a.multiply(&a).unwrap().sum_all(false).unwrap();
    mlx::async_eval(&[&b]).unwrap();
    assert_eq!(b.item::<f32>().unwrap(), 55.0);
    let c = b.add_scalar(1.0).unwrap();
    mlx::eval(&[&c, &b]).unwrap();
    assert_eq!(c.item::<f32>().unwrap(), 56.0);
}

#[test]
fn evaluated_arrays_move_between_threads() {
    let a = ops::ones(&[3], Dtype::Float32).unwrap();
    a.eval().unwrap();
    let handle = std::thread::spawn(move || a.sum_all(false).unwrap().item::<f32>().unwrap());
    assert_eq!(handle.join().unwrap(), 3.0);
}

#[test]
fn a_pending_graph_from_another_thread_is_an_error_not_an_abort() {
    // MLX streams belong to the thread that made them: a graph built on this thread cannot be
    // evaluated on another. The engine keeps all MLX work on its actor thread for this reason.
    let a = ops::ones(&[3], Dtype::Float32).unwrap().add_scalar(1.0).unwrap();
    let handle = std::thread::spawn(move || a.eval().map_err(|e| e.to_string()));
    let result = handle.join().expect("no panic");
    let message = result.expect_err("the pending graph names this thread's stream");
    assert!(message.contains("Stream"), "{message}");
}

#[test]
fn another_thread_waits_for_a_scheduled_array_and_reads_it() {
    let a = ops::arange(0.0, 100.0, 1.0, Dtype::Float32).unwrap();
    let b = a.multiply(&a).unwrap().sum_all(false).unwrap();
    mlx::async_eval(&[&b]).unwrap();
    // Waiting schedules nothing, so the value is read without this thread's stream.
    let handle = std::thread::spawn(move || {
        b.wait().unwrap();
        b.item::<f32>().unwrap()
    });
    assert_eq!(handle.join().unwrap(), 328_350.0);
}

#[test]
fn gather_mm_picks_matrices_by_index() {
    // Two stacked 2x2 matrices; three 1x2 rows routed to matrices 1, 0, 1.
    let stacked =
        Array::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 2, 2]).unwrap();
    let rows = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 1, 2]).unwrap();
    let route = Array::from_slice(&[1u32, 0, 1], &[3]).unwrap();
    let out = rows.gather_matmul(&stacked, None, Some(&route), false).unwrap();
    assert_eq!(out.shape(), vec![3, 1, 2]);
    // [1 2]·[[2 3][4 5]] = [10 13]; [3 4]·I = [3 4]; [5 6]·[[2 3][4 5]] = [34 45].
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![10.0, 13.0, 3.0, 4.0, 34.0, 45.0]);
    let bad = Array::from_slice(&[0u32, 1], &[2]).unwrap();
    assert!(rows.gather_matmul(&stacked, None, Some(&bad), false).is_err(), "3 rows, 2 indices");
}
