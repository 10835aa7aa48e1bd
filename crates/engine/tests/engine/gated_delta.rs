//! The gated DeltaNet state (`RecurrentCache`): a speculative round rolled back to `keep`
//! leaves bit for bit what appending only the kept positions leaves, whatever the calls inside
//! the round (one verify window, or a drafter's decode steps), and the next append reads the
//! same; saved state restores exactly; positions cannot be trimmed.

use engine::Result;
use engine::cache::{
    Cache, DeltaHeads, DeltaShape, GatedDeltaCache, GatedDeltaLayer, Keep, RecurrentCache,
    RecurrentRows,
};
use mlx::{Array, fast};
use proptest::prelude::*;

use crate::cache::{bitwise_equal, normal};

const SHAPE: DeltaShape =
    DeltaShape { kernel: 4, key_heads: 2, value_heads: 4, key_dim: 8, value_dim: 4 };

/// A block's recurrence weights and glue, as Qwen3.5's: SiLU, the split, L2-normed queries
/// and keys.
struct Layer {
    conv: Array,
    a_log: Array,
    dt_bias: Array,
}

impl Layer {
    fn new(seed: u64) -> Layer {
        let hv = SHAPE.value_heads as i32;
        Layer {
            conv: normal(&[SHAPE.conv_dim() as i32, SHAPE.kernel as i32, 1], seed)
                .multiply_scalar(0.5)
                .unwrap(),
            a_log: normal(&[hv], seed + 1).multiply_scalar(0.3).unwrap().add_scalar(-1.0).unwrap(),
            dt_bias: normal(&[hv], seed + 2),
        }
    }
}

impl GatedDeltaLayer for Layer {
    fn conv_weight(&self) -> &Array {
        &self.conv
    }

    fn a_log(&self) -> &Array {
        &self.a_log
    }

    fn dt_bias(&self) -> &Array {
        &self.dt_bias
    }

    fn heads(&self, convolved: &Array) -> Result<DeltaHeads> {
        let s = convolved.shape();
        let (b, l) = (s[0], s[1]);
        let out = convolved.silu()?;
        let (hk, dk) = (SHAPE.key_heads as i32, SHAPE.key_dim as i32);
        let (hv, dv) = (SHAPE.value_heads as i32, SHAPE.value_dim as i32);
        let part = |from: i32, heads: i32, dim: i32| -> Result<Array> {
            Ok(out
                .slice(&[0, 0, from], &[b, l, from + heads * dim], &[1, 1, 1])?
                .reshape(&[b, l, heads, dim])?)
        };
        let norm = |x: Array| -> Result<Array> { Ok(fast::rms_norm(&x, None, 1e-6)?) };
        Ok(DeltaHeads {
            q: norm(part(0, hk, dk)?)?,
            k: norm(part(hk * dk, hk, dk)?)?,
            v: part(2 * hk * dk, hv, dv)?,
        })
    }
}

/// `qkv`, `a` and `b` for `length` positions of `rows` rows.
fn inputs(rows: i32, length: usize, seed: u64) -> (Array, Array, Array) {
    let l = length as i32;
    let hv = SHAPE.value_heads as i32;
    (
        normal(&[rows, l, SHAPE.conv_dim() as i32], seed),
        normal(&[rows, l, hv], seed + 1),
        normal(&[rows, l, hv], seed + 2),
    )
}

fn positions(x: &Array, from: usize, to: usize) -> Array {
    let s = x.shape();
    x.slice(&[0, from as i32, 0], &[s[0], to as i32, s[2]], &[1, 1, 1]).unwrap()
}

fn append(
    cache: &mut RecurrentCache,
    x: &(Array, Array, Array),
    from: usize,
    to: usize,
    decode: bool,
    layer: &Layer,
) -> Array {
    let (qkv, a, b) =
        (positions(&x.0, from, to), positions(&x.1, from, to), positions(&x.2, from, to));
    if decode {
        cache.recur_decode(&qkv, &a, &b, layer).unwrap()
    } else {
        cache.recur_window(&qkv, &a, &b, layer).unwrap()
    }
}

fn same_state(a: &RecurrentCache, b: &RecurrentCache) -> bool {
    let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
    a.offset() == b.offset()
        && ["conv", "recurrent"].iter().all(|k| bitwise_equal(&sa.tensors[*k], &sb.tensors[*k]))
}

/// One round: `calls` appends (each a window or decode steps) of these lengths, then `keep`
/// of all their positions kept.
#[derive(Debug, Clone)]
struct Round {
    calls: Vec<(usize, bool)>,
    keep: usize,
}

fn rounds() -> impl Strategy<Value = Vec<Round>> {
    let call = (1usize..6, any::<bool>());
    prop::collection::vec(
        (prop::collection::vec(call, 1..4), 0usize..16).prop_map(|(calls, keep)| {
            let total: usize = calls.iter().map(|c| c.0).sum();
            Round { calls, keep: keep.min(total) }
        }),
        1..6,
    )
}

/// Runs `rounds` on one cache and, on another, appends only each round's kept positions (one
/// window of them when `kept_as_window`, else one decode step each): after every round the
/// two hold the same state bit for bit, and read the next position the same.
fn rounds_match_kept_appends(
    rounds: &[Round],
    prefix: usize,
    rows: i32,
    kept_as_window: bool,
    seed: u64,
) {
    let layer = Layer::new(seed);
    let mut speculative = RecurrentCache::new(SHAPE);
    let mut reference = RecurrentCache::new(SHAPE);
    let start = inputs(rows, prefix, seed + 10);
    append(&mut speculative, &start, 0, prefix, false, &layer);
    append(&mut reference, &start, 0, prefix, false, &layer);
    for (n, round) in rounds.iter().enumerate() {
        let total: usize = round.calls.iter().map(|c| c.0).sum();
        let x = inputs(rows, total, seed * 100 + n as u64 * 7);
        speculative.spec_round_begin().unwrap();
        let mut at = 0;
        for &(length, steps) in &round.calls {
            if steps {
                for i in at..at + length {
                    append(&mut speculative, &x, i, i + 1, true, &layer);
                }
            } else {
                append(&mut speculative, &x, at, at + length, false, &layer);
            }
            at += length;
        }
        speculative.spec_round_rollback(round.keep).unwrap();
        if round.keep > 0 {
            if kept_as_window {
                append(&mut reference, &x, 0, round.keep, false, &layer);
            } else {
                for i in 0..round.keep {
                    append(&mut reference, &x, i, i + 1, true, &layer);
                }
            }
        }
        assert!(same_state(&speculative, &reference), "round {n}: {round:?}");
        // The next read is the same too (a throwaway round on each).
        let next = inputs(rows, 1, seed + 5000 + n as u64);
        speculative.spec_round_begin().unwrap();
        reference.spec_round_begin().unwrap();
        let a = append(&mut speculative, &next, 0, 1, true, &layer);
        let b = append(&mut reference, &next, 0, 1, true, &layer);
        assert!(bitwise_equal(&a, &b), "round {n}: the next read differs");
        speculative.spec_round_rollback(0).unwrap();
        reference.spec_round_rollback(0).unwrap();
        assert!(same_state(&speculative, &reference), "round {n}: after a rollback to 0");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn rounds_leave_what_the_kept_positions_leave(rounds in rounds(), prefix in 1usize..9, rows in 1i32..3, kept_as_window in any::<bool>(), seed in 0u64..1000) {
        rounds_match_kept_appends(&rounds, prefix, rows, kept_as_window, seed);
    }
}

/// A window and the same positions one decode step at a time leave the same state and read
/// the same outputs (one recurrence, position by position, whatever the phase).
#[test]
fn a_window_equals_its_decode_steps() {
    let layer = Layer::new(3);
    let x = inputs(1, 9, 40);
    let mut window = RecurrentCache::new(SHAPE);
    let mut steps = RecurrentCache::new(SHAPE);
    let y = append(&mut window, &x, 0, 9, false, &layer);
    let ys: Vec<Array> = (0..9).map(|i| append(&mut steps, &x, i, i + 1, true, &layer)).collect();
    assert!(same_state(&window, &steps));
    let joined = mlx::ops::concatenate(&ys.iter().collect::<Vec<_>>(), 1).unwrap();
    assert!(bitwise_equal(&y, &joined));
}

/// Saved state restores into a fresh cache and continues identically; positions cannot be
/// trimmed, and a state of another geometry is refused.
#[test]
fn state_restores_exactly_and_positions_cannot_be_trimmed() {
    let layer = Layer::new(5);
    let x = inputs(1, 12, 50);
    let mut cache = RecurrentCache::new(SHAPE);
    append(&mut cache, &x, 0, 7, false, &layer);
    let saved = cache.state().unwrap();
    let mut restored = RecurrentCache::new(SHAPE);
    restored.restore(&saved).unwrap();
    assert!(same_state(&cache, &restored));
    let a = append(&mut cache, &x, 7, 12, false, &layer);
    let b = append(&mut restored, &x, 7, 12, false, &layer);
    assert!(bitwise_equal(&a, &b));
    assert!(!cache.is_trimmable());
    assert_eq!(cache.trim(0).unwrap(), 0);
    let error = cache.trim(1).unwrap_err().to_string();
    assert!(error.contains("cannot drop positions"), "{error}");
    let mut other = RecurrentCache::new(DeltaShape { value_dim: 8, ..SHAPE });
    assert!(other.restore(&saved).is_err(), "another geometry's state");
    assert!(RecurrentCache::new(SHAPE).state().is_err(), "an empty cache has no state");
}

fn row(x: &Array, r: i32) -> Array {
    let s = x.shape();
    let mut start = vec![0; s.len()];
    let mut stop = s.clone();
    start[0] = r;
    stop[0] = r + 1;
    x.slice(&start, &stop, &vec![1; s.len()]).unwrap()
}

/// Rows of a padded window (each right-justified behind its own left padding, after a shared
/// prefix) hold, row by row, bit for bit what a cache of that row alone holds after appending
/// only its real positions; their outputs at real positions and their next decode step read
/// the same.
fn padded_rows_match_solo_rows(prefix: usize, pads: &[usize], length: usize, seed: u64) {
    let layer = Layer::new(seed);
    let rows = pads.len() as i32;
    let start = inputs(rows, prefix, seed + 10);
    let window = inputs(rows, length, seed + 20);
    let next = inputs(rows, 1, seed + 30);
    let mut batch = RecurrentCache::new(SHAPE);
    if prefix > 0 {
        append(&mut batch, &start, 0, prefix, false, &layer);
    }
    let y = batch.recur_window_padded(&window.0, &window.1, &window.2, pads, &layer).unwrap();
    let y_next = append(&mut batch, &next, 0, 1, true, &layer);
    let state = batch.state().unwrap();
    for (r, &pad) in pads.iter().enumerate() {
        let r = r as i32;
        let pick = |x: &(Array, Array, Array)| (row(&x.0, r), row(&x.1, r), row(&x.2, r));
        let mut solo = RecurrentCache::new(SHAPE);
        if prefix > 0 {
            append(&mut solo, &pick(&start), 0, prefix, false, &layer);
        }
        if pad < length {
            let ys = append(&mut solo, &pick(&window), pad, length, false, &layer);
            let ours =
                positions(&row(&y, r).reshape(&[1, length as i32, -1]).unwrap(), pad, length);
            let want = ys.reshape(&[1, (length - pad) as i32, -1]).unwrap();
            assert!(bitwise_equal(&ours, &want), "row {r} (pad {pad}): window outputs differ");
        }
        let solo_next = append(&mut solo, &pick(&next), 0, 1, true, &layer);
        assert!(bitwise_equal(&row(&y_next, r), &solo_next), "row {r}: the next read differs");
        let solo_state = solo.state().unwrap();
        for key in ["conv", "recurrent"] {
            assert!(
                bitwise_equal(&row(&state.tensors[key], r), &solo_state.tensors[key]),
                "row {r} (pad {pad}): {key} differs"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn padded_positions_change_neither_state(prefix in 0usize..6, length in 1usize..9, pads in prop::collection::vec(0usize..12, 1..4), seed in 0u64..1000) {
        let pads: Vec<usize> = pads.into_iter().map(|p| p.min(length)).collect();
        padded_rows_match_solo_rows(prefix, &pads, length, seed);
    }
}

/// A padded window is refused inside a round, and with padding that does not fit.
#[test]
fn padded_windows_are_refused_inside_rounds_and_when_they_do_not_fit() {
    let layer = Layer::new(9);
    let x = inputs(2, 4, 90);
    let mut cache = RecurrentCache::new(SHAPE);
    assert!(cache.recur_window_padded(&x.0, &x.1, &x.2, &[0], &layer).is_err(), "2 rows, 1 pad");
    assert!(cache.recur_window_padded(&x.0, &x.1, &x.2, &[5, 0], &layer).is_err(), "pad > S");
    cache.spec_round_begin().unwrap();
    assert!(cache.recur_window_padded(&x.0, &x.1, &x.2, &[1, 0], &layer).is_err(), "in a round");
    cache.spec_round_rollback(0).unwrap();
    assert_eq!(cache.offset(), 0, "refusals leave the cache as it was");
}

/// A request of the batching property: its prefix, when it joins, how many steps it stays.
#[derive(Debug, Clone)]
struct Request {
    prefix: usize,
    joins: usize,
    stays: usize,
}

/// What the batch does at each step: a decode step, or a round of a window of `w` with
/// per-row keeps drawn from these numbers.
#[derive(Debug, Clone)]
enum Step {
    Decode,
    Round { window: usize, keeps: Vec<usize> },
}

fn requests() -> impl Strategy<Value = Vec<Request>> {
    prop::collection::vec(
        (1usize..7, 0usize..4, 1usize..6).prop_map(|(prefix, joins, stays)| Request {
            prefix,
            joins,
            stays,
        }),
        1..5,
    )
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            Just(Step::Decode),
            (1usize..5, prop::collection::vec(0usize..5, 5))
                .prop_map(|(window, keeps)| Step::Round { window, keeps }),
        ],
        8..12,
    )
}

/// Requests join a batch after their own prefill, decode and speculate together (each row
/// keeping its own count) and leave: every decode read equals the row's own, and every row
/// that leaves (and every row left at the end) holds bit for bit what the same request run
/// alone holds.
fn batched_rows_match_solo_requests(requests: &[Request], steps: &[Step], seed: u64) {
    let layer = Layer::new(seed);
    // Each request's own stream of positions, and its solo cache.
    let streams: Vec<_> =
        (0..requests.len()).map(|i| inputs(1, 64, seed + 100 * i as u64)).collect();
    let mut solos: Vec<RecurrentCache> =
        requests.iter().map(|_| RecurrentCache::new(SHAPE)).collect();
    let mut at = vec![0usize; requests.len()];
    let mut batch = RecurrentRows::new(SHAPE);
    let mut active: Vec<usize> = Vec::new();
    let mut stayed = vec![0usize; requests.len()];
    let check = |solo: &RecurrentCache, row: &RecurrentCache, what: &str| {
        assert_eq!(solo.offset(), row.offset(), "{what}: offsets");
        assert!(same_state(solo, row), "{what}: state differs");
    };
    let stack = |rows: &[usize], at: &[usize], w: usize| -> (Array, Array, Array) {
        let pick = |k: usize| -> Array {
            let parts: Vec<Array> = rows
                .iter()
                .map(|&i| match k {
                    0 => positions(&streams[i].0, at[i], at[i] + w),
                    1 => positions(&streams[i].1, at[i], at[i] + w),
                    _ => positions(&streams[i].2, at[i], at[i] + w),
                })
                .collect();
            mlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0).unwrap()
        };
        (pick(0), pick(1), pick(2))
    };
    for (t, step) in steps.iter().enumerate() {
        // Joins: each request prefills alone, then its cache joins the batch.
        for (i, r) in requests.iter().enumerate() {
            if r.joins == t {
                append(&mut solos[i], &streams[i], 0, r.prefix, false, &layer);
                let mut joining = RecurrentCache::new(SHAPE);
                append(&mut joining, &streams[i], 0, r.prefix, false, &layer);
                batch.merge_rows(vec![joining]).unwrap();
                at[i] = r.prefix;
                active.push(i);
            }
        }
        if active.is_empty() {
            continue;
        }
        match step {
            Step::Decode => {
                let x = stack(&active, &at, 1);
                let y = batch.recur_decode(&x.0, &x.1, &x.2, &layer).unwrap();
                for (r, &i) in active.iter().enumerate() {
                    let own = append(&mut solos[i], &streams[i], at[i], at[i] + 1, true, &layer);
                    assert!(
                        bitwise_equal(&row(&y, r as i32), &own),
                        "step {t}: row {r} reads otherwise"
                    );
                    at[i] += 1;
                }
            }
            Step::Round { window, keeps } => {
                let x = stack(&active, &at, *window);
                batch.spec_round_begin().unwrap();
                batch.recur_window(&x.0, &x.1, &x.2, &layer).unwrap();
                let keeps: Vec<usize> = active
                    .iter()
                    .enumerate()
                    .map(|(row, _)| keeps[row % keeps.len()].min(*window))
                    .collect();
                batch.spec_round_rollback(Keep::Each(&keeps)).unwrap();
                for (&i, &k) in active.iter().zip(&keeps) {
                    for p in at[i]..at[i] + k {
                        append(&mut solos[i], &streams[i], p, p + 1, true, &layer);
                    }
                    at[i] += k;
                }
            }
        }
        assert_eq!(
            batch.row_offsets(),
            active.iter().map(|&i| solos[i].offset()).collect::<Vec<_>>(),
            "step {t}: offsets"
        );
        // Leaves: requests whose stay is over leave as serial caches.
        for i in active.clone() {
            stayed[i] += 1;
            if stayed[i] >= requests[i].stays {
                let row = active.iter().position(|&a| a == i).unwrap();
                let left = batch.extract_row(row).unwrap();
                active.remove(row);
                check(&solos[i], &left, &format!("request {i} leaving at step {t}"));
            }
        }
    }
    for &i in &active {
        let left = batch.extract_row(0).unwrap();
        check(&solos[i], &left, &format!("request {i} at the end"));
    }
    assert_eq!(batch.batch_size(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn batched_rows_hold_what_requests_hold_alone(requests in requests(), steps in steps(), seed in 0u64..1000) {
        batched_rows_match_solo_requests(&requests, &steps, seed);
    }
}

/// A prefill cohort: rows of different prompt lengths right-justified behind their padding
/// join as one padded window; each row then holds its own prompt's state and offset.
#[test]
fn a_padded_prefill_cohort_holds_each_prompt_alone() {
    let layer = Layer::new(21);
    let lengths = [5usize, 2, 7];
    let s = 7;
    let x = inputs(3, s, 210);
    let pads: Vec<usize> = lengths.iter().map(|l| s - l).collect();
    let mut batch = RecurrentRows::new(SHAPE);
    batch.merge_rows((0..3).map(|_| RecurrentCache::new(SHAPE)).collect()).unwrap();
    batch.recur_window_padded(&x.0, &x.1, &x.2, &pads, &layer).unwrap();
    assert_eq!(batch.row_offsets(), &lengths[..]);
    for (r, &pad) in pads.iter().enumerate().rev() {
        let mut solo = RecurrentCache::new(SHAPE);
        let own = (row(&x.0, r as i32), row(&x.1, r as i32), row(&x.2, r as i32));
        append(&mut solo, &own, pad, s, false, &layer);
        let left = batch.extract_row(r).unwrap();
        assert!(same_state(&solo, &left), "row {r}");
    }
    let mut other = RecurrentRows::new(DeltaShape { kernel: 3, ..SHAPE });
    assert!(other.merge_rows(vec![RecurrentCache::new(SHAPE)]).is_err(), "another geometry");
    assert!(batch.extract_row(0).is_err(), "no rows left");
}
