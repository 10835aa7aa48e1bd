//! Bad requests come back as `Err` with MLX's message and the caller's location; nothing aborts.

use mlx::quantized::quantize;
use mlx::{Array, Dtype, Error, ops};

#[test]
fn shape_mismatch_is_an_error_with_mlx_message_and_location() {
    let a = ops::ones(&[2, 3], Dtype::Float32).unwrap();
    let b = ops::ones(&[4, 5], Dtype::Float32).unwrap();
    let err = a.matmul(&b).expect_err("[2,3] @ [4,5]");
    match &err {
        Error::Mlx { what, location } => {
            assert!(what.contains("matmul"), "MLX's own message: {what}");
            assert!(location.file().ends_with("errors.rs"), "attributed to the caller: {location}");
        }
        other => panic!("expected an MLX error, got {other:?}"),
    }
    assert!(err.to_string().contains("errors.rs"), "Display names the call site: {err}");
}

#[test]
fn many_kinds_of_bad_input_are_errors() {
    let a = ops::ones(&[2, 3], Dtype::Float32).unwrap();
    assert!(a.reshape(&[4, 2]).is_err(), "6 elements do not fill 4x2");
    assert!(a.add(&ops::ones(&[4], Dtype::Float32).unwrap()).is_err(), "no broadcast of 3 and 4");
    assert!(ops::concatenate(&[&a, &ops::ones(&[2, 4], Dtype::Float32).unwrap()], 0).is_err());
    assert!(a.transpose(&[0, 0]).is_err(), "repeated axis");
    assert!(a.sum(&[5], false).is_err(), "axis out of range");
    assert!(a.slice(&[0], &[1], &[1]).is_err(), "one bound per axis");
    assert!(Array::from_slice(&[1.0f32, 2.0], &[3]).is_err(), "2 values for 3 slots");
    assert!(matches!(a.to_vec::<i32>(), Err(Error::DtypeMismatch { .. })));
    assert!(a.item::<f32>().is_err(), "item() of six elements");
    assert!(a.dim(2).is_err());
    let w = ops::ones(&[4, 128], Dtype::Float32).unwrap();
    assert!(quantize(&w, 64, 7).is_err(), "7 bits is not a supported width");
    assert!(quantize(&w, 48, 4).is_err(), "48 is not a supported group size");
    let q = ops::ones(&[1, 2, 3, 8], Dtype::Float32).unwrap();
    let k = ops::ones(&[1, 2, 3, 16], Dtype::Float32).unwrap();
    let attention = mlx::fast::scaled_dot_product_attention(
        &q,
        &k,
        &k,
        1.0,
        mlx::fast::AttentionMask::None,
        None,
    );
    assert!(attention.is_err(), "head dims 8 vs 16");
    // After all of that MLX still computes.
    assert_eq!(a.sum_all(false).unwrap().item::<f32>().unwrap(), 6.0);
}
