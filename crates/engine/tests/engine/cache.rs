//! Every storage's attention output equals a naive recompute over the full history, for
//! random sequences of window appends, decode appends and trims; state save/restore is exact.

use engine::cache::{AttentionCache, Cache, PlainCache, RotatingCache};
use mlx::{Array, Dtype, ops, random};
use proptest::prelude::*;

const B: i32 = 1;
const HKV: i32 = 2;
const HQ: i32 = 4;
const D: i32 = 4;

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

fn normal(shape: &[i32], seed: u64) -> Array {
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

fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    a.subtract(b).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap()
}

/// Runs `steps` on `cache`, checking each read; returns how many appends were checked.
fn run(cache: &mut dyn AttentionCache, window: Option<usize>, steps: &[Step], seed: u64) -> usize {
    let mut keys: Vec<Array> = Vec::new(); // one [B, HKV, 1, D] per position
    let mut values: Vec<Array> = Vec::new();
    let mut checked = 0;
    for (n, step) in steps.iter().enumerate() {
        let seed = seed * 1000 + n as u64 * 3;
        let length = match step {
            Step::Trim(t) => {
                if cache.is_trimmable() {
                    let trimmed = cache.trim(*t).unwrap();
                    assert_eq!(trimmed, (*t).min(keys.len()));
                    keys.truncate(keys.len() - trimmed);
                    values.truncate(values.len() - trimmed);
                } else {
                    assert!(cache.trim(*t).is_err(), "an evicted ring refuses to trim");
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
            Step::Bidirectional(flags) => cache.append_bidirectional(&k, &v, flags).unwrap(),
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
        let want = naive(&q, &keys, &values, first, window, flags);
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-5, "step {n} ({step:?}) differs by {diff}: steps {steps:?}");
        checked += 1;
    }
    checked
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn plain_cache_matches_naive_attention(steps in steps(), seed in 0u64..1000) {
        run(&mut PlainCache::new(), None, &steps, seed);
    }

    #[test]
    fn rotating_cache_matches_naive_windowed_attention(steps in steps(), window in 1usize..8, seed in 0u64..1000) {
        run(&mut RotatingCache::new(window).unwrap(), Some(window), &steps, seed);
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
