//! Host arrays a forward pass uploads once. Every layer of one pass that stores its positions
//! in buffers shared by a batch's rows asks for the same index arrays and masks (the same rows,
//! cursors and lengths); each is made by the first layer that asks and handed to the others,
//! so the pass holds one node and the device one copy of it instead of one per layer.
//!
//! The last few arrays made on this thread are kept with their contents; an array is reused
//! only when shape and contents are equal, so sharing never changes what a layer reads.

use std::cell::RefCell;

use mlx::{Array, Dtype, Element};

use crate::error::Result;

/// How many arrays are kept: a pass asks for at most a handful (a decode mask; a window's
/// slots, history and mask, per kind of row).
const KEPT: usize = 8;

/// An upload made: its shape, element type and bytes, and the array.
struct Made {
    shape: Vec<i32>,
    dtype: Dtype,
    bytes: Vec<u8>,
    array: Array,
}

thread_local! {
    /// The arrays made last, newest last.
    static MADE: RefCell<Vec<Made>> = const { RefCell::new(Vec::new()) };
}

/// `data` as an int32 array of `shape`, the array made earlier when one holds the same.
pub(crate) fn ints(data: &[i32], shape: &[i32]) -> Result<Array> {
    shared(data, shape)
}

/// `data` as a bool array of `shape`, the array made earlier when one holds the same.
pub(crate) fn bools(data: &[bool], shape: &[i32]) -> Result<Array> {
    shared(data, shape)
}

fn shared<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
    let mut bytes = Vec::new();
    T::extend_bytes(data, &mut bytes);
    let found = MADE.with_borrow(|made| {
        made.iter()
            .rev()
            .find(|m| m.dtype == T::DTYPE && m.shape == shape && m.bytes == bytes)
            .map(|m| m.array.clone())
    });
    if let Some(array) = found {
        return Ok(array);
    }
    let array = Array::from_bytes(&bytes, shape, T::DTYPE)?;
    MADE.with_borrow_mut(|made| {
        if made.len() == KEPT {
            made.remove(0);
        }
        made.push(Made { shape: shape.to_vec(), dtype: T::DTYPE, bytes, array: array.clone() });
    });
    Ok(array)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_contents_share_one_array_and_any_difference_makes_another() {
        let a = ints(&[3, 1, 4, 1], &[2, 1, 2, 1]).unwrap();
        let again = ints(&[3, 1, 4, 1], &[2, 1, 2, 1]).unwrap();
        assert_eq!(a.id(), again.id());
        let other_shape = ints(&[3, 1, 4, 1], &[1, 1, 4, 1]).unwrap();
        assert_ne!(a.id(), other_shape.id());
        assert_eq!(other_shape.shape(), vec![1, 1, 4, 1]);
        let other_data = ints(&[3, 1, 4, 2], &[2, 1, 2, 1]).unwrap();
        assert_eq!(other_data.to_vec::<i32>().unwrap(), vec![3, 1, 4, 2]);
        let mask = bools(&[true, false], &[1, 2]).unwrap();
        assert_eq!(bools(&[true, false], &[1, 2]).unwrap().id(), mask.id());
        assert_eq!(
            bools(&[false, true], &[1, 2]).unwrap().to_vec::<bool>().unwrap(),
            [false, true]
        );
        // A full record forgets its oldest array.
        for i in 0..KEPT as i32 {
            ints(&[100 + i], &[1]).unwrap();
        }
        assert_ne!(ints(&[3, 1, 4, 1], &[2, 1, 2, 1]).unwrap().id(), a.id());
    }
}
