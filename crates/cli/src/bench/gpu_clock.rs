//! `quince bench --gpu-clock`: decode steps timed by the GPU's own clock (CUDA), unread and
//! read back as the decode loop reads them.

use engine::batch::generate;
use engine::cache::Cache;
use engine::generate::{Flow, GenerateRequest};
use engine::models::Model;
use mlx::Array;
use serde_json::json;

use super::{BenchArgs, median};

/// `--gpu-clock`: greedy decode steps after `prompt`, each bracketed by two reads of the GPU
/// clock, first none read back until the end (`gpu_ms_per_step`, `gpu_gap_ms`), then as the
/// single-thread decode loop runs them (each token read once the next step is submitted),
/// placed on the host's clock (`timeline`). `None` off CUDA.
pub(super) fn steps(
    model: &dyn Model,
    args: &BenchArgs,
    prompt: &[u32],
) -> anyhow::Result<Option<serde_json::Value>> {
    let mut caches = model.fresh_caches()?;
    let first = generate(model, &mut caches, &GenerateRequest::new(prompt.to_vec(), 1), |_| {
        Flow::Continue
    })?;
    let mut y = engine::tokens::ids(&first.tokens)?;
    // One step after `y`, with the clock read when the step starts (once `y` is written) and
    // when its token is. The step reads its token through the start read (`y + 0·t0`): a read
    // that nothing depends on may run anywhere in the step, and MLX and CUDA graphs put it late
    // (which made earlier "start lag" figures, read without that dependency, meaningless).
    let step = |y: &Array, caches: &mut [Box<dyn Cache>]| {
        let Some(t0) = model.ops().gpu_clock(y)? else { return anyhow::Ok(None) };
        let zero = t0.astype(y.dtype())?.multiply_scalar(0.0)?.reshape(&[1, 1])?;
        let logits = model.forward_decode(&y.reshape(&[1, 1])?.add(&zero)?, caches)?;
        let v = logits.dim(-1)?;
        let next = logits.reshape(&[v])?.argmax(0, false)?.astype(mlx::Dtype::Uint32)?;
        let Some(t1) = model.ops().gpu_clock(&next)? else { return Ok(None) };
        Ok(Some((next, t0, t1)))
    };
    let mut clocks = Vec::with_capacity(args.gen_tokens);
    let start = std::time::Instant::now();
    for _ in 0..args.gen_tokens {
        let Some((next, t0, t1)) = step(&y, &mut caches)? else { return Ok(None) };
        mlx::async_eval(&[&t0, &t1])?;
        clocks.push((t0, t1));
        y = next;
    }
    y.eval()?;
    let wall_ms = start.elapsed().as_secs_f64() * 1e3 / args.gen_tokens as f64;
    let mut spans = Vec::new();
    let mut gaps = Vec::new();
    let mut last_end: Option<u64> = None;
    for (t0, t1) in &clocks {
        let (a, b) = (t0.item::<u64>()?, t1.item::<u64>()?);
        spans.push(b.saturating_sub(a) as f64 / 1e6);
        if let Some(end) = last_end {
            gaps.push(a.saturating_sub(end) as f64 / 1e6);
        }
        last_end = Some(b);
    }
    let timeline = read_timeline(model.ops(), args, &mut caches, y, &step)?;
    Ok(Some(json!({
        "steps": args.gen_tokens,
        "gpu_ms_per_step": median(&mut spans),
        "gpu_gap_ms": median(&mut gaps),
        "wall_ms_per_step": wall_ms,
        "timeline": timeline,
    })))
}

/// The host's clock in ns since the epoch.
fn host_ns() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// The decode steps of [`steps`] read as the decode loop reads them, with
/// the GPU's clock placed on the host's: the offset between the two is bounded by reading the
/// GPU clock synchronously a few times (`offset_uncertainty_ms` is the bound's width). All
/// figures are medians in ms: building and submitting a step, the GPU's start read after the
/// submission started (`gpu_start_lag`), the span between the reads, the end read against the
/// end of the submission (`gpu_end_after_submit`), and the host having the token after the GPU
/// wrote it (`token_after_gpu_end`). The step's token input depends on its start read, so the
/// read runs before the step's work.
#[allow(clippy::type_complexity)]
fn read_timeline(
    ops: &engine::backend::Ops,
    args: &BenchArgs,
    caches: &mut [Box<dyn Cache>],
    mut y: Array,
    step: &dyn Fn(&Array, &mut [Box<dyn Cache>]) -> anyhow::Result<Option<(Array, Array, Array)>>,
) -> anyhow::Result<serde_json::Value> {
    let (mut low, mut high) = (i128::MIN, i128::MAX);
    for _ in 0..8 {
        let before = host_ns();
        let Some(c) = ops.gpu_clock(&y)? else { return Ok(json!(null)) };
        let gpu = i128::from(c.item::<u64>()?);
        let after = host_ns();
        // The read ran between `before` and `after` on the host's clock.
        low = low.max(gpu - after);
        high = high.min(gpu - before);
    }
    let offset = (low + high) / 2;
    struct Row {
        build: i128,
        submit: i128,
        submitted: i128,
        t0: Array,
        t1: Array,
        read_start: i128,
        read_done: i128,
    }
    let mut rows: Vec<Row> = Vec::with_capacity(args.gen_tokens);
    mlx::async_eval(&[&y])?;
    for _ in 0..args.gen_tokens {
        let build = host_ns();
        let Some((next, t0, t1)) = step(&y, caches)? else { return Ok(json!(null)) };
        let submit = host_ns();
        mlx::async_eval(&[&t0, &t1])?;
        let submitted = host_ns();
        y.item::<u32>()?;
        let read_done = host_ns();
        rows.push(Row { build, submit, submitted, t0, t1, read_start: submitted, read_done });
        y = next;
    }
    y.eval()?;
    let ms = |ns: i128| ns as f64 / 1e6;
    let mut figures: [(&str, Vec<f64>); 8] = Default::default();
    let names = [
        "build",
        "submit",
        "gpu_start_lag",
        "gpu_span",
        "gpu_end_after_submit",
        "read_wait",
        "token_after_gpu_end",
        "step",
    ];
    for (slot, name) in figures.iter_mut().zip(names) {
        slot.0 = name;
    }
    for (i, row) in rows.iter().enumerate() {
        let t0 = i128::from(row.t0.item::<u64>()?) - offset;
        let t1 = i128::from(row.t1.item::<u64>()?) - offset;
        figures[0].1.push(ms(row.submit - row.build));
        figures[1].1.push(ms(row.submitted - row.submit));
        figures[2].1.push(ms(t0 - row.submit));
        figures[3].1.push(ms(t1 - t0));
        figures[4].1.push(ms(t1 - row.submitted));
        // This step's token is read in the next row, after the next step is submitted.
        if let Some(next) = rows.get(i + 1) {
            figures[5].1.push(ms(next.read_done - next.read_start));
            figures[6].1.push(ms(next.read_done - t1));
            figures[7].1.push(ms(next.build - row.build));
        }
    }
    let mut out = json!({ "offset_uncertainty_ms": ms(high - low) });
    for (name, mut values) in figures {
        out[name] = json!(median(&mut values));
    }
    Ok(out)
}
