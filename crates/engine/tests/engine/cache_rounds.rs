//! Speculative rounds on every storage, in one row or resolved per row in a batch, leave each
//! storage exactly as appending only the kept positions (by decode steps) would; a batch's read
//! is each row's own read. Every layout runs with every encoding (see `cache.rs`).

use engine::cache::{AttentionCache, CacheRows, Keep, PlainCache, RotatingCache};
use mlx::Array;
use proptest::prelude::*;

use crate::cache::{D, HKV, HQ, bitwise_equal, encodings, max_diff, normal, plain, ring};

/// One speculative round: `length` positions appended as one verify window or as a drafter's
/// decode steps, then `keep` of them kept (commit when all are kept and `commit`).
#[derive(Debug, Clone)]
struct Round {
    length: usize,
    keep: usize,
    as_window: bool,
    commit: bool,
}

fn rounds() -> impl Strategy<Value = Vec<Round>> {
    prop::collection::vec(
        (1usize..7, 0usize..7, any::<bool>(), any::<bool>()).prop_map(
            |(length, keep, as_window, commit)| Round {
                length,
                keep: keep.min(length),
                as_window,
                commit,
            },
        ),
        1..10,
    )
}

/// Rows of `x` `[rows, H, L, D]`, for B > 1 checks.
fn sized(shape: [i32; 4], seed: u64, rows: i32) -> Array {
    normal(&[rows, shape[1], shape[2], shape[3]], seed)
}

/// Runs `rounds` on `speculative` and appends only the kept positions, one decode step each,
/// to `plain`; after every round both hold the same offset, the same saved state, the same
/// slots (rings) and give bit-identical reads to the next decode step.
fn rounds_match_kept_decodes(
    make: &dyn Fn() -> Box<dyn AttentionCache>,
    prefix: usize,
    rounds: &[Round],
    rows: i32,
    seed: u64,
    compare_slots: bool,
) {
    let mut speculative = make();
    let mut reference = make();
    let (k, v) = (
        sized([1, HKV, prefix as i32, D], seed, rows),
        sized([1, HKV, prefix as i32, D], seed + 1, rows),
    );
    speculative.append_window(&k, &v).unwrap();
    reference.append_window(&k, &v).unwrap();
    for (n, round) in rounds.iter().enumerate() {
        let seed = seed * 100 + n as u64 * 7;
        // A round never crosses a KV conversion (the speculative loop drafts up to it).
        let most = speculative.max_append().unwrap_or(usize::MAX);
        let round =
            &Round { length: round.length.min(most), keep: round.keep.min(most), ..round.clone() };
        if round.length < rounds[n].length {
            let crossing = sized([1, HKV, most as i32 + 1, D], seed + 9, rows);
            speculative.spec_round_begin().unwrap();
            assert!(
                speculative.append_window(&crossing, &crossing).is_err(),
                "a round refuses to cross the conversion"
            );
            speculative.spec_round_rollback(0).unwrap();
        }
        let l = round.length as i32;
        let k = sized([1, HKV, l, D], seed, rows);
        let v = sized([1, HKV, l, D], seed + 1, rows);
        let at = |a: &Array, i: i32| {
            a.slice(&[0, 0, i, 0], &[rows, HKV, i + 1, D], &[1, 1, 1, 1]).unwrap()
        };
        speculative.spec_round_begin().unwrap();
        assert!(speculative.spec_round_begin().is_err(), "one round at a time");
        if round.as_window {
            speculative.append_window(&k, &v).unwrap();
        } else {
            for i in 0..l {
                speculative.append_decode(&at(&k, i), &at(&v, i)).unwrap();
            }
        }
        assert!(speculative.trim(1).is_err(), "no trim inside a round");
        assert!(
            speculative.spec_round_rollback(round.length + 1).is_err(),
            "cannot keep more than appended"
        );
        if round.commit && round.keep == round.length {
            speculative.spec_round_commit().unwrap();
        } else {
            speculative.spec_round_rollback(round.keep).unwrap();
        }
        assert!(speculative.spec_round_commit().is_err(), "the round is over");
        for i in 0..round.keep as i32 {
            reference.append_decode(&at(&k, i), &at(&v, i)).unwrap();
        }
        let context = format!("round {n} {round:?} of {rounds:?}, prefix {prefix}, rows {rows}");
        assert_same_storage(speculative.as_ref(), reference.as_ref(), compare_slots, &context);
        let (k1, v1, q) = (
            sized([1, HKV, 1, D], seed + 3, rows),
            sized([1, HKV, 1, D], seed + 4, rows),
            sized([1, HQ, 1, D], seed + 5, rows),
        );
        let x = speculative.append_decode(&k1, &v1).unwrap().attend(&q, 0.5).unwrap();
        let y = reference.append_decode(&k1, &v1).unwrap().attend(&q, 0.5).unwrap();
        assert!(bitwise_equal(&x, &y), "the next read differs: {context}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn plain_rounds_leave_what_the_kept_decodes_leave(rounds in rounds(), kv in encodings(), prefix in 1usize..9, rows in 1i32..3, seed in 0u64..1000) {
        rounds_match_kept_decodes(&|| plain(kv), prefix, &rounds, rows, seed, false);
    }

    #[test]
    fn ring_rounds_leave_what_the_kept_decodes_leave(rounds in rounds(), window in 1usize..8, kv in encodings(), prefix in 1usize..9, rows in 1i32..3, seed in 0u64..1000) {
        rounds_match_kept_decodes(&|| ring(window, kv), prefix, &rounds, rows, seed, true);
    }
}

/// One round over a batch of rows: `length` positions appended to every row (one window or
/// decode steps), then `keeps[b]` of them kept in row `b` (one count for all when `uniform`).
#[derive(Debug, Clone)]
struct RowRound {
    length: usize,
    keeps: Vec<usize>,
    uniform: bool,
    as_window: bool,
    commit: bool,
}

fn row_rounds() -> impl Strategy<Value = Vec<RowRound>> {
    prop::collection::vec(
        (
            1usize..6,
            prop::collection::vec(0usize..6, 4),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(length, keeps, uniform, as_window, commit)| {
                let mut keeps: Vec<usize> = keeps.into_iter().map(|k| k.min(length)).collect();
                if commit {
                    keeps = vec![length; 4];
                } else if uniform {
                    keeps = vec![keeps[0]; 4];
                }
                RowRound { length, keeps, uniform: uniform || commit, as_window, commit }
            }),
        1..8,
    )
}

/// Row `b` of `[B, H, L, D]` at positions `from..to`.
fn row_at(x: &Array, b: i32, from: i32, to: i32) -> Array {
    let s = x.shape();
    x.slice(&[b, 0, from, 0], &[b + 1, s[1], to, s[3]], &[1, 1, 1, 1]).unwrap()
}

/// Row `b`'s saved state and slots equal its reference's, bit for bit.
fn assert_same_storage(
    row: &dyn AttentionCache,
    reference: &dyn AttentionCache,
    slots: bool,
    context: &str,
) {
    assert_eq!(row.offset(), reference.offset(), "{context}");
    let (a, b) = (row.state().unwrap(), reference.state().unwrap());
    assert_eq!(a.metadata, b.metadata, "{context}");
    for (name, tensor) in &a.tensors {
        assert!(bitwise_equal(tensor, &b.tensors[name]), "{name} differs: {context}");
    }
    if slots {
        for (x, y) in row.buffers().iter().zip(reference.buffers()) {
            assert!(bitwise_equal(x, &y), "ring slots differ: {context}");
        }
    }
}

/// A batch whose rows start at their own lengths (`prefixes`) runs `rounds`, each resolved
/// with one keep count per row; beside it, one single-sequence cache per row appends only that
/// row's kept positions, one decode step each. After every round each row's storage equals its
/// reference bit for bit, and the batch's next decode read gives each row what its reference's
/// read gives (bit for bit for a row the read does not pad, within 1e-6 for a padded one).
fn rows_match_their_kept_decodes(
    make: &dyn Fn() -> Box<dyn AttentionCache>,
    prefixes: &[usize],
    rounds: &[RowRound],
    seed: u64,
    slots: bool,
) {
    let rows = prefixes.len() as i32;
    let mut batch = CacheRows::new();
    let mut references: Vec<Box<dyn AttentionCache>> = Vec::new();
    for (b, &prefix) in prefixes.iter().enumerate() {
        let (k, v) = (
            normal(&[1, HKV, prefix as i32, D], seed + 10 * b as u64),
            normal(&[1, HKV, prefix as i32, D], seed + 10 * b as u64 + 1),
        );
        let mut row = make();
        row.append_window(&k, &v).unwrap();
        batch.merge_rows(vec![row]).unwrap();
        let mut reference = make();
        reference.append_window(&k, &v).unwrap();
        references.push(reference);
    }
    assert_eq!(batch.row_offsets(), prefixes);
    for (n, round) in rounds.iter().enumerate() {
        let seed = seed * 100 + n as u64 * 7;
        // A round never crosses a row's KV conversion.
        let most = batch.max_append().unwrap_or(usize::MAX);
        let round = &RowRound {
            length: round.length.min(most),
            keeps: round.keeps.iter().map(|k| (*k).min(most)).collect(),
            ..round.clone()
        };
        let l = round.length as i32;
        let (k, v) = (normal(&[rows, HKV, l, D], seed), normal(&[rows, HKV, l, D], seed + 1));
        batch.spec_round_begin().unwrap();
        assert!(batch.spec_round_begin().is_err(), "one round at a time");
        if round.as_window {
            batch.append_window(&k, &v).unwrap();
        } else {
            for i in 0..l {
                batch.append_decode(&row_at_all(&k, i), &row_at_all(&v, i)).unwrap();
            }
        }
        assert!(batch.filter_rows(&[0]).is_err(), "no row changes inside a round");
        assert!(batch.extract_row(0).is_err(), "no row changes inside a round");
        let keeps = &round.keeps[..rows as usize];
        let mut too_many = keeps.to_vec();
        too_many[rows as usize - 1] = round.length + 1;
        assert!(batch.spec_round_rollback(Keep::Each(&too_many)).is_err(), "keep ≤ appended");
        assert!(batch.spec_round_rollback(Keep::Each(&keeps[1..])).is_err(), "one count per row");
        if round.commit {
            batch.spec_round_commit().unwrap();
        } else if round.uniform {
            batch.spec_round_rollback(Keep::All(keeps[0])).unwrap();
        } else {
            batch.spec_round_rollback(Keep::Each(keeps)).unwrap();
        }
        assert!(batch.spec_round_commit().is_err(), "the round is over");
        let context = format!("round {n} {round:?} of {rounds:?}, prefixes {prefixes:?}");
        for (b, reference) in references.iter_mut().enumerate() {
            for i in 0..keeps[b] as i32 {
                reference
                    .append_decode(&row_at(&k, b as i32, i, i + 1), &row_at(&v, b as i32, i, i + 1))
                    .unwrap();
            }
            assert_same_storage(
                batch.row(b).unwrap(),
                reference.as_ref(),
                slots,
                &format!("row {b}, {context}"),
            );
        }
        assert_eq!(batch.row_offsets(), references.iter().map(|r| r.offset()).collect::<Vec<_>>());

        let pads = batch.left_pad().unwrap();
        let (k1, v1, q) = (
            normal(&[rows, HKV, 1, D], seed + 3),
            normal(&[rows, HKV, 1, D], seed + 4),
            normal(&[rows, HQ, 1, D], seed + 5),
        );
        let x = batch.append_decode(&k1, &v1).unwrap().attend(&q, 0.5).unwrap();
        for (b, reference) in references.iter_mut().enumerate() {
            let b32 = b as i32;
            let y = reference
                .append_decode(&row_at(&k1, b32, 0, 1), &row_at(&v1, b32, 0, 1))
                .unwrap()
                .attend(&row_at(&q, b32, 0, 1), 0.5)
                .unwrap();
            let xb = row_at(&x, b32, 0, 1);
            // One row of a batched read is the row's own read bit for bit on the CPU, and a
            // padded row's within 1e-6. MLX's CUDA attention tiles a batch differently (on the
            // H200 a padded row's read was 8.8e-5 off), so there both are equal within 5e-4.
            let cuda = mlx::Backend::current() == mlx::Backend::Cuda;
            if pads[b] == 0 && !cuda {
                assert!(bitwise_equal(&xb, &y), "row {b}'s next read differs: {context}");
            } else {
                let diff = max_diff(&xb, &y);
                let tolerance = if cuda { 5e-4 } else { 1e-6 };
                assert!(diff <= tolerance, "row {b}'s read is off by {diff}: {context}");
            }
        }
    }
    // Rows leave the batch as ordinary caches, in any order.
    let last = prefixes.len() - 1;
    batch.filter_rows(&[last, 0]).unwrap();
    assert_eq!(batch.row_offsets(), vec![references[last].offset(), references[0].offset()]);
    let row = batch.extract_row(1).unwrap();
    assert_same_storage(
        row.as_attention().unwrap(),
        references[0].as_ref(),
        slots,
        "extracted row 0",
    );
    assert_eq!(batch.batch_size(), 1);
}

/// Position `i` of every row of `[B, H, L, D]`.
fn row_at_all(x: &Array, i: i32) -> Array {
    let s = x.shape();
    x.slice(&[0, 0, i, 0], &[s[0], s[1], i + 1, s[3]], &[1, 1, 1, 1]).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn plain_rows_keep_what_each_rows_kept_decodes_keep(rounds in row_rounds(), kv in encodings(), prefixes in prop::collection::vec(1usize..9, 2..5), seed in 0u64..1000) {
        rows_match_their_kept_decodes(&|| plain(kv), &prefixes, &rounds, seed, false);
    }

    #[test]
    fn ring_rows_keep_what_each_rows_kept_decodes_keep(rounds in row_rounds(), window in 1usize..8, kv in encodings(), prefixes in prop::collection::vec(1usize..9, 2..5), seed in 0u64..1000) {
        rows_match_their_kept_decodes(&|| ring(window, kv), &prefixes, &rounds, seed, true);
    }
}

/// A batch's window read gives each row what the row's own cache gives, rows of different
/// lengths (left-padded in the read), a ring that has wrapped and a row of the other storage
/// (a plain row among rings, a ring among plain rows) included; a batch refuses an append of
/// the wrong row count, and is unchanged after.
#[test]
fn a_batch_window_read_is_each_rows_own_read() {
    for make in [&|| Box::new(PlainCache::new()) as Box<dyn AttentionCache>, &|| {
        Box::new(RotatingCache::new(4).unwrap()) as Box<dyn AttentionCache>
    }] as [&dyn Fn() -> Box<dyn AttentionCache>; 2]
    {
        let other: &dyn Fn() -> Box<dyn AttentionCache> = &|| {
            if make().signature() == "plain" {
                Box::new(RotatingCache::new(4).unwrap())
            } else {
                Box::new(PlainCache::new())
            }
        };
        let prefixes = [2, 9, 5, 3];
        let mut batch = CacheRows::new();
        let mut own = Vec::new();
        for (b, &n) in prefixes.iter().enumerate() {
            let (k, v) =
                (normal(&[1, HKV, n, D], 40 + b as u64), normal(&[1, HKV, n, D], 50 + b as u64));
            let storage = if b == 3 { other } else { make };
            let mut row = storage();
            row.append_window(&k, &v).unwrap();
            batch.merge_rows(vec![row]).unwrap();
            let mut twin = storage();
            twin.append_window(&k, &v).unwrap();
            own.push(twin);
        }
        let wrong = normal(&[2, HKV, 3, D], 60);
        assert!(batch.append_window(&wrong, &wrong).is_err(), "one slice per row");
        assert_eq!(batch.row_offsets(), vec![2, 9, 5, 3]);

        let (k, v, q) =
            (normal(&[4, HKV, 3, D], 61), normal(&[4, HKV, 3, D], 62), normal(&[4, HQ, 3, D], 63));
        let x = batch.append_window(&k, &v).unwrap().attend(&q, 0.5).unwrap();
        for (b, twin) in own.iter_mut().enumerate() {
            let b = b as i32;
            let y = twin
                .append_window(&row_at(&k, b, 0, 3), &row_at(&v, b, 0, 3))
                .unwrap()
                .attend(&row_at(&q, b, 0, 3), 0.5)
                .unwrap();
            let diff = max_diff(&row_at(&x, b, 0, 3), &y);
            assert!(diff <= 1e-6, "{}: row {b} differs by {diff}", twin.signature());
        }
        assert_eq!(batch.row_offsets(), vec![5, 12, 8, 6]);
    }
}
