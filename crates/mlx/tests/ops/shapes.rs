//! Reshaping, joining, splitting, slicing, gathers, padding and creation.

use mlx::{Array, Dtype, ops};

use crate::common::{assert_close, assert_same, fx};

fn iota(shape: &[i32]) -> Array {
    let n: i32 = shape.iter().product();
    ops::arange(0.0, f64::from(n), 1.0, Dtype::Float32).unwrap().reshape(shape).unwrap()
}

#[test]
fn reshape_transpose_expand_squeeze() {
    let x = iota(&[2, 3, 4]);
    let r = x.reshape(&[4, -1]).unwrap();
    assert_eq!(r.shape(), vec![4, 6]);
    let t = x.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(t.shape(), vec![4, 2, 3]);
    // t[i, j, k] = x[j, k, i] = 12j + 4k + i; element [1, 1, 2] = 12 + 8 + 1
    let flat = t.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(flat[6 + 3 + 2], 21.0);
    let e = x.expand_dims(&[0, 3]).unwrap();
    assert_eq!(e.shape(), vec![1, 2, 3, 1, 4]);
    assert_eq!(e.squeeze(&[]).unwrap().shape(), vec![2, 3, 4]);
    assert_eq!(e.squeeze(&[3]).unwrap().shape(), vec![1, 2, 3, 4]);
    assert_eq!(x.flatten(1, 2).unwrap().shape(), vec![2, 12]);
    assert_same(&fx("index.x").transpose(&[]).unwrap(), &fx("index.transpose"));
    assert_eq!(x.swapaxes(0, 2).unwrap().shape(), vec![4, 3, 2]);
    assert_eq!(
        ops::ones(&[3, 1], Dtype::Float32).unwrap().broadcast_to(&[2, 3, 4]).unwrap().shape(),
        vec![2, 3, 4]
    );
}

#[test]
fn concatenate_stack_split() {
    let x = fx("index.x");
    let x2 = x.multiply_scalar(2.0).unwrap();
    assert_same(&ops::concatenate(&[&x, &x2], 0).unwrap(), &fx("index.concat0"));
    assert_same(&ops::stack(&[&x, &x2], 1).unwrap(), &fx("index.stack1"));
    let parts = x.split_equal(2, 1).unwrap();
    assert_eq!(parts.len(), 2);
    assert_same(&parts[1], &x.slice(&[0, 3], &[4, 6], &[1, 1]).unwrap());
    let parts = x.split_at(&[1, 4], 1).unwrap();
    let widths: Vec<i32> = parts.iter().map(|p| p.dim(1).unwrap()).collect();
    assert_eq!(widths, vec![1, 3, 2]);
    assert_same(&ops::concatenate(&parts.iter().collect::<Vec<_>>(), 1).unwrap(), &x);
}

#[test]
fn slices_static_and_dynamic() {
    let x = fx("index.x");
    assert_same(&x.slice(&[1, 0], &[4, 6], &[2, 3]).unwrap(), &fx("index.slice_1_4_2__0_6_3"));
    let update = fx("index.update");
    let expected = fx("index.slice_update_1_2");
    assert_same(&x.slice_update(&update, &[1, 2], &[3, 5], &[1, 1]).unwrap(), &expected);
    // The same write with the start held in an array (as a compiled decode step does it).
    let start = Array::from_slice(&[1i32, 2], &[2]).unwrap();
    assert_same(&x.slice_update_dynamic(&update, &start, &[0, 1]).unwrap(), &expected);
    assert_same(
        &x.slice_dynamic(&start, &[0, 1], &[2, 3]).unwrap(),
        &update
            .multiply_scalar(0.0)
            .unwrap()
            .add(&x.slice(&[1, 2], &[3, 5], &[1, 1]).unwrap())
            .unwrap(),
    );
    // slice_update leaves the source untouched (values semantics).
    assert_same(&x, &fx("index.x"));
}

#[test]
fn gathers_and_where() {
    let (x, idx, along) = (fx("index.x"), fx("index.idx"), fx("index.along"));
    assert_same(&x.take(&idx, 1).unwrap(), &fx("index.take_axis1"));
    assert_same(&x.take(&idx, 0).unwrap(), &fx("index.take_axis0"));
    assert_same(&x.take_along_axis(&along, 1).unwrap(), &fx("index.take_along_axis1"));
    let flat = x.take_flat(&Array::from_slice(&[0i32, 7], &[2]).unwrap()).unwrap();
    let all = x.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(flat.to_vec::<f32>().unwrap(), vec![all[0], all[7]]);
    let zero = x.scalar_like(0.0).unwrap();
    let cond = x.gt(&zero).unwrap();
    assert_same(
        &ops::where_(&cond, &x, &x.scalar_like(-1.0).unwrap()).unwrap(),
        &fx("index.where"),
    );
    let put = ops::zeros(&[2, 3], Dtype::Float32)
        .unwrap()
        .put_along_axis(
            &Array::from_slice(&[2i32, 0], &[2, 1]).unwrap(),
            &Array::from_slice(&[5.0f32, 6.0], &[2, 1]).unwrap(),
            1,
        )
        .unwrap();
    assert_eq!(put.to_vec::<f32>().unwrap(), vec![0.0, 0.0, 5.0, 6.0, 0.0, 0.0]);
}

#[test]
fn pad_and_constructors() {
    let x = fx("index.x");
    let seven = Array::scalar(7.0f32).unwrap();
    assert_same(&x.pad(&[0, 1], &[1, 0], &[0, 2], &seven).unwrap(), &fx("index.pad"));
    assert_same(&ops::arange(2.0, 11.0, 3.0, Dtype::Float32).unwrap(), &fx("create.arange_2_11_3"));
    let ints = ops::arange(0.0, 5.0, 1.0, Dtype::Int32).unwrap();
    assert_eq!(ints.dtype(), Dtype::Int32);
    assert_same(&ints, &fx("create.arange_i32"));
    assert_same(&ops::tri(4, 6, 1, Dtype::Float32).unwrap(), &fx("index.tri_4_6_1"));
    assert_eq!(ops::zeros(&[2, 2], Dtype::Int64).unwrap().to_vec::<i64>().unwrap(), vec![0; 4]);
    assert_eq!(ops::ones(&[3], Dtype::Uint8).unwrap().to_vec::<u8>().unwrap(), vec![1; 3]);
    let full = ops::full(&[2, 2], &Array::scalar(1.5f32).unwrap(), Dtype::Bfloat16).unwrap();
    assert_eq!(full.dtype(), Dtype::Bfloat16);
    assert_eq!(crate::common::values(&full), vec![1.5; 4]);
    let lower = ops::ones(&[3, 3], Dtype::Float32).unwrap().tril(0).unwrap();
    assert_eq!(lower.to_vec::<f32>().unwrap(), vec![1., 0., 0., 1., 1., 0., 1., 1., 1.]);
    let upper = ops::ones(&[2, 2], Dtype::Float32).unwrap().triu(1).unwrap();
    assert_eq!(upper.to_vec::<f32>().unwrap(), vec![0., 1., 0., 0.]);
}

#[test]
fn conv1d_dense_and_depthwise() {
    let x = fx("conv1d.x");
    assert_close(
        &ops::conv1d(&x, &fx("conv1d.w_depthwise"), 1, 0, 1, 4).unwrap(),
        &fx("conv1d.depthwise"),
        1e-5,
    );
    assert_close(
        &ops::conv1d(&x, &fx("conv1d.w_dense"), 2, 1, 1, 1).unwrap(),
        &fx("conv1d.dense_s2_p1"),
        1e-5,
    );
}
