//! The small int32 arrays a decode step hands its kernels (a read's slot bounds, the position
//! for RoPE), optionally taken as views of tables made on the device once instead of made
//! from host data each step ([`set_device_step_ints`], off by default).
//!
//! Why: MLX-CUDA keeps an array made from host data in managed memory (up to 8 bytes: one
//! shared pool of managed pages), so a step that makes a few dozen of them has the host write
//! pages the GPU may be reading for the steps before. On the H200 the GPU starts a Quince
//! step milliseconds after MLX launched it while plain MLX ops keep up (`quince bench
//! --gpu-clock`, `tests/bench/stream_lag.py`); this is one difference to rule in or out. A
//! view of a device table writes nothing on the host: it is a slice (no kernel) of a buffer
//! computed once by `arange`. Same values, same shapes; pairs outside the tables' patterns
//! are still made from host data.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use mlx::{Array, Dtype};

use crate::error::Result;

/// Rows a growing table gets at least.
const MIN_ROWS: usize = 4096;
/// Different first values a `[a, b < a]` table is kept for (a ring's window, a few per model).
const MAX_RING_TABLES: usize = 8;

#[derive(Default)]
struct Tables {
    /// `[n, 2]`: row `i` is `[i, i]` (a plain read: slots `0..i` but none, write slot `i`; and
    /// the position `i` in column 0).
    diagonal: Option<Array>,
    /// `[n, 2]`: row `i` is `[i, -1]` (slots `0..i`, nothing skipped).
    after: Option<Array>,
    /// By `a`: `[a, 2]`, row `b` is `[a, b]` (a full ring of `a` slots writing slot `b`).
    ring: HashMap<i32, Array>,
}

thread_local! {
    static TABLES: RefCell<Tables> = RefCell::default();
}

static ON: AtomicBool = AtomicBool::new(false);

/// Turns the device tables on or off (the default: every pair made from host data) for all
/// threads from now on (`quince bench --device-step-ints`). Off by default until an A/B run
/// on CUDA shows what they change: they passed the H200's kernel tests, but the one run that
/// was to time them did not finish.
pub fn set_device_step_ints(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether the device tables are on (see [`set_device_step_ints`]).
pub fn device_step_ints() -> bool {
    ON.load(Ordering::Relaxed)
}

/// `0..n` as int32 `[n]`, computed on the device.
fn iota(n: usize) -> Result<Array> {
    Ok(mlx::ops::arange(0.0, n as f64, 1.0, Dtype::Int32)?)
}

/// `[n, 2]` with column 0 `first(i)` and column 1 `second(i)`, evaluated.
fn table(
    n: usize,
    first: impl Fn(&Array) -> Result<Array>,
    second: impl Fn(&Array) -> Result<Array>,
) -> Result<Array> {
    let i = iota(n)?;
    let t = mlx::ops::stack(&[&first(&i)?, &second(&i)?], 1)?;
    t.eval()?;
    Ok(t)
}

/// `c` shaped like `like`.
fn constant(like: &Array, c: i32) -> Result<Array> {
    Ok(mlx::ops::full(&like.shape(), &Array::scalar(c)?, Dtype::Int32)?)
}

/// Row `row` of the table in `slot`, grown (doubling) to hold it.
fn row_of(
    slot: &mut Option<Array>,
    row: usize,
    make: impl Fn(usize) -> Result<Array>,
) -> Result<Array> {
    let rows = match slot {
        Some(t) => t.dim(0)? as usize,
        None => 0,
    };
    if row >= rows {
        *slot = Some(make((row + 1).max(rows * 2).max(MIN_ROWS))?);
    }
    let t = slot.as_ref().expect("made above");
    view(t, row)
}

/// Row `row` of `t` `[n, 2]` as `[2]`, a view.
fn view(t: &Array, row: usize) -> Result<Array> {
    let r = row as i32;
    Ok(t.slice(&[r, 0], &[r + 1, 2], &[1, 1])?.reshape(&[2])?)
}

/// `[a, b]` as int32 `[2]`.
pub(crate) fn pair(a: i32, b: i32) -> Result<Array> {
    if !device_step_ints() {
        return Ok(Array::from_slice(&[a, b], &[2])?);
    }
    from_tables(a, b)
}

/// [`pair`] from the tables where they hold it.
fn from_tables(a: i32, b: i32) -> Result<Array> {
    TABLES.with(|tables| {
        let mut tables = tables.borrow_mut();
        if a >= 0 && a == b {
            return row_of(&mut tables.diagonal, a as usize, |n| {
                table(n, |i| Ok(i.clone()), |i| Ok(i.clone()))
            });
        }
        if a >= 0 && b == -1 {
            return row_of(&mut tables.after, a as usize, |n| {
                table(n, |i| Ok(i.clone()), |i| constant(i, -1))
            });
        }
        if 0 <= b && b < a {
            if let Some(t) = tables.ring.get(&a) {
                return view(t, b as usize);
            }
            if tables.ring.len() < MAX_RING_TABLES {
                let t = table(a as usize, |i| constant(i, a), |i| Ok(i.clone()))?;
                let v = view(&t, b as usize)?;
                tables.ring.insert(a, t);
                return Ok(v);
            }
        }
        Ok(Array::from_slice(&[a, b], &[2])?)
    })
}

/// The int32 scalar `p` (`p ≥ 0`), a view of the diagonal table.
pub(crate) fn position(p: i32) -> Result<Array> {
    if p < 0 || !device_step_ints() {
        return Ok(Array::scalar(p)?);
    }
    position_from_tables(p)
}

fn position_from_tables(p: i32) -> Result<Array> {
    Ok(from_tables(p, p)?.slice(&[0], &[1], &[1])?.reshape(&[])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<i32> {
        a.to_vec::<i32>().unwrap()
    }

    #[test]
    fn pairs_and_positions_hold_their_values() {
        for (a, b) in [
            (0, 0),
            (7, 7),
            (5000, 5000),
            (3, -1),
            (9000, -1),
            (512, 0),
            (512, 511),
            (4, 9),
            (-2, 3),
        ] {
            let p = from_tables(a, b).unwrap();
            assert_eq!(p.shape(), vec![2]);
            assert_eq!(values(&p), vec![a, b], "({a}, {b})");
        }
        for p in [0, 1, 4095, 4096, 12000] {
            let s = position_from_tables(p).unwrap();
            assert_eq!(s.ndim(), 0);
            assert_eq!(s.item::<i32>().unwrap(), p);
        }
    }
}
