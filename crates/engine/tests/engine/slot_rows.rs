//! Rows sharing one buffer per part ([`SlotRows`], the batched layout of full-precision plain
//! and ring storage) against one single-sequence cache per row: rows that join at their own
//! lengths, decode together, verify drafts in speculative rounds and leave read what their own
//! caches read and leave holding what their own caches hold, slot for slot.

use engine::cache::{AttentionCache, BatchRows, Cache, PlainCache, RotatingCache, SlotRows};
use mlx::Array;
use proptest::prelude::*;

use crate::cache::{D, HKV, HQ, bitwise_equal, max_diff, normal};

/// Row `b` of `[B, H, L, D]`.
fn row(x: &Array, b: usize) -> Array {
    let s = x.shape();
    let b = b as i32;
    x.slice(&[b, 0, 0, 0], &[b + 1, s[1], s[2], s[3]], &[1, 1, 1, 1]).unwrap()
}

fn attention(cache: &mut dyn Cache) -> &mut dyn AttentionCache {
    cache.as_attention_mut().unwrap()
}

/// `storage`'s cache after a prefill of `prefix` positions drawn from `seed`.
fn prefilled(window: Option<usize>, prefix: usize, seed: u64) -> Box<dyn Cache> {
    let mut cache: Box<dyn Cache> = match window {
        None => Box::new(PlainCache::new()),
        Some(w) => Box::new(RotatingCache::new(w).unwrap()),
    };
    let n = prefix as i32;
    let (k, v) = (normal(&[1, HKV, n, D], seed), normal(&[1, HKV, n, D], seed + 1));
    attention(cache.as_mut()).append_window(&k, &v).unwrap();
    cache
}

/// Two caches hold the same positions in the same slots, bit for bit.
fn assert_same(ours: &dyn Cache, theirs: &dyn Cache, context: &str) {
    assert_eq!(ours.signature(), theirs.signature(), "{context}");
    assert_eq!(ours.offset(), theirs.offset(), "{context}");
    assert_eq!(ours.stored_positions(), theirs.stored_positions(), "{context}");
    let (a, b) = (ours.state().unwrap(), theirs.state().unwrap());
    assert_eq!(a.metadata, b.metadata, "{context}");
    for (name, tensor) in &a.tensors {
        assert!(bitwise_equal(tensor, &b.tensors[name]), "{name} differs: {context}");
    }
    // The filled slots, in slot order (a ring's physical layout).
    let filled = |c: &dyn Cache| -> Vec<Array> {
        let n = c.stored_positions() as i32;
        c.buffers()
            .iter()
            .map(|p| {
                let s = p.shape();
                p.slice(&[0, 0, 0, 0], &[s[0], s[1], n, s[3]], &[1, 1, 1, 1]).unwrap()
            })
            .collect()
    };
    for (x, y) in filled(ours).iter().zip(filled(theirs)) {
        assert!(bitwise_equal(x, &y), "slots differ: {context}");
    }
}

/// Requests `(prefix, joins before step, leaves after step)` on `window`'s storage: every step
/// decodes one position for every row in the batch, each row's attention output equals its own
/// cache's; a leaving row is its own cache's twin; after the last step the rest leave too.
fn rows_read_and_leave_as_their_own(
    window: Option<usize>,
    rows: &[(usize, usize, usize)],
    seed: u64,
) {
    let mut batch = SlotRows::new();
    // In row order: (request, the request's own cache).
    let mut inside: Vec<(usize, Box<dyn Cache>)> = Vec::new();
    let last = rows.iter().map(|r| r.2).max().unwrap();
    for step in 0..=last {
        for (i, &(prefix, join, _)) in rows.iter().enumerate() {
            if join == step {
                let s = seed * 31 + i as u64 * 7;
                batch.merge_row(prefilled(window, prefix, s)).unwrap();
                inside.push((i, prefilled(window, prefix, s)));
            }
        }
        assert_eq!(batch.batch_size(), inside.len());
        assert_eq!(batch.is_shared(), inside.len() > 1, "two rows or more share buffers");
        let offsets: Vec<usize> = inside.iter().map(|(_, c)| c.offset()).collect();
        assert_eq!(batch.row_offsets(), offsets, "step {step}");
        if !inside.is_empty() {
            let b = inside.len() as i32;
            let s = seed * 1000 + step as u64 * 3;
            let (k, v, q) = (
                normal(&[b, HKV, 1, D], s),
                normal(&[b, HKV, 1, D], s + 1),
                normal(&[b, HQ, 1, D], s + 2),
            );
            let x = batch.append_decode(&k, &v).unwrap().attend(&q, 0.5).unwrap();
            for (r, (i, own)) in inside.iter_mut().enumerate() {
                let y = attention(own.as_mut())
                    .append_decode(&row(&k, r), &row(&v, r))
                    .unwrap()
                    .attend(&row(&q, r), 0.5)
                    .unwrap();
                assert!(
                    bitwise_equal(&row(&x, r), &y),
                    "{window:?} step {step}: request {i}'s read differs from its own cache's"
                );
            }
        }
        // Rows leaving after this step, highest row first.
        for r in (0..inside.len()).rev() {
            let i = inside[r].0;
            if rows[i].2 == step {
                let mut ours = batch.extract_row(r).unwrap();
                let (_, mut theirs) = inside.remove(r);
                assert_same(ours.as_ref(), theirs.as_ref(), &format!("{window:?} request {i}"));
                assert!(ours.row_offsets().is_none(), "an extracted row is a single sequence");
                // It goes on as its own cache would.
                let (k, v, q) = (
                    normal(&[1, HKV, 1, D], 9),
                    normal(&[1, HKV, 1, D], 10),
                    normal(&[1, HQ, 1, D], 11),
                );
                let x = attention(ours.as_mut())
                    .append_decode(&k, &v)
                    .unwrap()
                    .attend(&q, 0.5)
                    .unwrap();
                let y = attention(theirs.as_mut())
                    .append_decode(&k, &v)
                    .unwrap()
                    .attend(&q, 0.5)
                    .unwrap();
                assert!(bitwise_equal(&x, &y), "request {i} decodes on as its own cache");
                assert_same(ours.as_ref(), theirs.as_ref(), &format!("request {i}, one step on"));
            }
        }
    }
    assert_eq!(batch.batch_size(), 0);
}

fn schedules() -> impl Strategy<Value = Vec<(usize, usize, usize)>> {
    prop::collection::vec(
        (1usize..14, 0usize..6, 0usize..8)
            .prop_map(|(prefix, join, stay)| (prefix, join, join + stay)),
        1..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn plain_rows_in_shared_buffers_read_and_leave_as_their_own(rows in schedules(), seed in 0u64..1000) {
        rows_read_and_leave_as_their_own(None, &rows, seed);
    }

    #[test]
    fn ring_rows_in_shared_buffers_read_and_leave_as_their_own(rows in schedules(), window in 1usize..9, seed in 0u64..1000) {
        rows_read_and_leave_as_their_own(Some(window), &rows, seed);
    }
}

/// Plain rows longer than a buffer step grow the shared buffers, and shrink them when the long
/// row leaves.
#[test]
fn shared_plain_buffers_grow_past_a_step_and_shrink_back() {
    rows_read_and_leave_as_their_own(None, &[(255, 0, 3), (3, 0, 6), (600, 1, 2)], 5);
}

/// A row of another storage, a window of several positions over shared rows and speculative
/// rounds are refused, and the batch is unchanged after.
#[test]
fn shared_rows_refuse_what_they_cannot_do_and_change_nothing() {
    let mut batch = SlotRows::new();
    batch.merge_row(prefilled(None, 3, 1)).unwrap();
    batch.merge_row(prefilled(None, 5, 2)).unwrap();
    let err = batch.merge_row(prefilled(Some(4), 3, 3)).unwrap_err().to_string();
    assert!(err.contains("one storage"), "{err}");
    // Keys of another width (another model's checkpoint): refused, the rows kept.
    let mut other: Box<dyn Cache> = Box::new(PlainCache::new());
    let odd = normal(&[1, HKV, 2, D + 2], 6);
    attention(other.as_mut()).append_window(&odd, &odd).unwrap();
    let err = batch.merge_row(other).unwrap_err().to_string();
    assert!(err.contains("cannot join rows shaped"), "{err}");
    let wide = normal(&[2, HKV, 3, D], 4);
    let err = batch.append_window(&wide, &wide).unwrap_err().to_string();
    assert!(err.contains("prefills alone"), "{err}");
    let wrong = normal(&[3, HKV, 1, D], 5);
    assert!(batch.append_decode(&wrong, &wrong).is_err(), "one slice per row");
    // Inside a round, no row joins or leaves, and no row keeps more than was appended.
    batch.spec_round_begin().unwrap();
    assert!(batch.spec_round_begin().is_err(), "one round at a time");
    assert!(batch.merge_row(prefilled(None, 2, 7)).is_err());
    assert!(batch.extract_row(0).is_err());
    assert!(batch.rollback_rows(&[1, 0]).is_err(), "nothing appended");
    assert!(batch.rollback_rows(&[0]).is_err(), "one count per row");
    batch.rollback_rows(&[0, 0]).unwrap();
    assert!(batch.state().is_err(), "a batch is saved row by row");
    assert_eq!(batch.row_offsets(), vec![3, 5]);
    let second = batch.extract_row(1).unwrap();
    assert_same(second.as_ref(), prefilled(None, 5, 2).as_ref(), "untouched row");
    // One row left: a wrong row is refused and the lone row stays as it was.
    let mut other: Box<dyn Cache> = Box::new(PlainCache::new());
    attention(other.as_mut()).append_window(&odd, &odd).unwrap();
    assert!(batch.merge_row(other).is_err());
    assert!(!batch.is_shared());
    let first = batch.extract_row(0).unwrap();
    assert_same(first.as_ref(), prefilled(None, 3, 1).as_ref(), "lone row");
}

/// One round of a batch sharing buffers: `length` positions per row, as one verify window or
/// as decode steps, then row `b` keeps `keeps[b]` of them (all, by a commit, when `commit`).
#[derive(Debug, Clone)]
struct SharedRound {
    length: usize,
    keeps: Vec<usize>,
    as_window: bool,
    commit: bool,
}

fn shared_rounds() -> impl Strategy<Value = Vec<SharedRound>> {
    prop::collection::vec(
        (1usize..7, prop::collection::vec(0usize..7, 5), any::<bool>(), any::<bool>()).prop_map(
            |(length, keeps, as_window, commit)| SharedRound {
                length,
                keeps: keeps.into_iter().map(|k| k.min(length)).collect(),
                as_window,
                commit,
            },
        ),
        1..7,
    )
}

/// Rows of `window`'s storage at their own lengths (`prefixes`) share buffers through
/// `rounds`, a decode step after each; beside them, each row's own cache runs the same round
/// and keeps the same count. Every read a row gets is its own cache's (bit for bit where the
/// read pads nothing: a decode step's; within 1e-6 for a padded window), and every row leaves
/// holding what its own cache holds, slot for slot.
fn shared_rounds_keep_what_each_rows_own_round_keeps(
    window: Option<usize>,
    prefixes: &[usize],
    rounds: &[SharedRound],
    seed: u64,
) {
    let rows = prefixes.len();
    let mut batch = SlotRows::new();
    let mut own: Vec<Box<dyn Cache>> = Vec::new();
    for (b, &prefix) in prefixes.iter().enumerate() {
        batch.merge_row(prefilled(window, prefix, seed + 10 * b as u64)).unwrap();
        own.push(prefilled(window, prefix, seed + 10 * b as u64));
    }
    assert!(batch.is_shared());
    for (n, round) in rounds.iter().enumerate() {
        let context = format!("{window:?} round {n} {round:?} of {rounds:?}, {prefixes:?}");
        let length = round.length.min(batch.max_append().unwrap_or(usize::MAX));
        let keeps: Vec<usize> = round.keeps[..rows].iter().map(|&k| k.min(length)).collect();
        let s = seed * 100 + n as u64 * 7;
        let b32 = rows as i32;
        let l = length as i32;
        let (k, v, q) = (
            normal(&[b32, HKV, l, D], s),
            normal(&[b32, HKV, l, D], s + 1),
            normal(&[b32, HQ, l, D], s + 2),
        );
        batch.spec_round_begin().unwrap();
        own.iter_mut().for_each(|c| c.spec_round_begin().unwrap());
        let at = |x: &Array, b: usize, i: i32, j: i32| {
            let sh = x.shape();
            x.slice(&[b as i32, 0, i, 0], &[b as i32 + 1, sh[1], j, sh[3]], &[1, 1, 1, 1]).unwrap()
        };
        let spans: Vec<(i32, i32)> = match round.as_window {
            true => vec![(0, l)],
            false => (0..l).map(|i| (i, i + 1)).collect(),
        };
        for &(i, j) in &spans {
            let all = |x: &Array| {
                let sh = x.shape();
                x.slice(&[0, 0, i, 0], &[sh[0], sh[1], j, sh[3]], &[1, 1, 1, 1]).unwrap()
            };
            let read = match round.as_window {
                true => batch.append_window(&all(&k), &all(&v)).unwrap(),
                false => batch.append_decode(&all(&k), &all(&v)).unwrap(),
            };
            let x = read.attend(&all(&q), 0.5).unwrap();
            for (b, cache) in own.iter_mut().enumerate() {
                let cache = attention(cache.as_mut());
                let (kb, vb) = (at(&k, b, i, j), at(&v, b, i, j));
                let read = match round.as_window {
                    true => cache.append_window(&kb, &vb).unwrap(),
                    false => cache.append_decode(&kb, &vb).unwrap(),
                };
                let y = read.attend(&at(&q, b, i, j), 0.5).unwrap();
                let xb = at(&x, b, 0, j - i);
                if round.as_window && length > 1 {
                    let diff = max_diff(&xb, &y);
                    assert!(diff <= 1e-6, "row {b}'s window read is off by {diff}: {context}");
                } else {
                    assert!(bitwise_equal(&xb, &y), "row {b}'s read differs: {context}");
                }
            }
        }
        assert!(batch.extract_row(0).is_err(), "no row leaves inside a round");
        if round.commit {
            batch.spec_round_commit().unwrap();
            own.iter_mut().for_each(|c| c.spec_round_commit().unwrap());
        } else {
            batch.rollback_rows(&keeps).unwrap();
            for (c, &keep) in own.iter_mut().zip(&keeps) {
                c.spec_round_rollback(keep).unwrap();
            }
        }
        let offsets: Vec<usize> = own.iter().map(|c| c.offset()).collect();
        assert_eq!(batch.row_offsets(), offsets, "{context}");
        // Each row's slots, as its own storage lends them, are its own cache's.
        for (b, cache) in own.iter().enumerate() {
            let ours = batch.row_donor_read(b).unwrap().unwrap().keys_values().unwrap();
            let theirs =
                cache.as_attention().unwrap().donor_read().unwrap().unwrap().keys_values().unwrap();
            assert!(bitwise_equal(&ours.0, &theirs.0), "row {b}'s keys: {context}");
            assert!(bitwise_equal(&ours.1, &theirs.1), "row {b}'s values: {context}");
        }
        // A decode step after the round reads what each row's own cache reads.
        let (k, v, q) = (
            normal(&[b32, HKV, 1, D], s + 3),
            normal(&[b32, HKV, 1, D], s + 4),
            normal(&[b32, HQ, 1, D], s + 5),
        );
        let x = batch.append_decode(&k, &v).unwrap().attend(&q, 0.5).unwrap();
        for (b, cache) in own.iter_mut().enumerate() {
            let y = attention(cache.as_mut())
                .append_decode(&row(&k, b), &row(&v, b))
                .unwrap()
                .attend(&row(&q, b), 0.5)
                .unwrap();
            assert!(bitwise_equal(&row(&x, b), &y), "row {b}'s next decode differs: {context}");
        }
    }
    for b in (0..rows).rev() {
        let ours = batch.extract_row(b).unwrap();
        let theirs = own.pop().unwrap();
        assert_same(ours.as_ref(), theirs.as_ref(), &format!("{window:?} row {b} leaving"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn plain_rows_in_shared_buffers_keep_what_their_own_rounds_keep(rounds in shared_rounds(), prefixes in prop::collection::vec(1usize..14, 2..5), seed in 0u64..1000) {
        shared_rounds_keep_what_each_rows_own_round_keeps(None, &prefixes, &rounds, seed);
    }

    #[test]
    fn ring_rows_in_shared_buffers_keep_what_their_own_rounds_keep(rounds in shared_rounds(), window in 1usize..9, prefixes in prop::collection::vec(1usize..14, 2..5), seed in 0u64..1000) {
        shared_rounds_keep_what_each_rows_own_round_keeps(Some(window), &prefixes, &rounds, seed);
    }
}
