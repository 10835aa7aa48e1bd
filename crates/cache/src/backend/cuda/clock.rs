//! The GPU's global nanosecond timer read from inside the stream: a diagnostic for timing a
//! stretch of GPU work (`quince bench --gpu-clock`).

use std::rc::Rc;

use mlx::fast::{CudaKernel, Launch};
use mlx::{Array, Dtype};

use super::Spec;
use crate::error::{Error, Result};

/// One thread reads the GPU's global nanosecond timer. The input is not read: it only orders
/// the launch after the op that wrote it.
const CLOCK_SOURCE: &str = r#"
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    now[0] = t;
"#;

pub(super) static SPEC: Spec = Spec {
    name: "quince_gpu_clock",
    inputs: &["after"],
    outputs: &["now"],
    source: CLOCK_SOURCE,
    probe,
};

/// The GPU's clock in ns (a `uint64` scalar) read once `after` is written.
pub(super) fn by_kernel(kernel: &CudaKernel, after: &Array) -> Result<Array> {
    let out = kernel.call(
        &[after],
        &[(&[], Dtype::Uint64)],
        Launch { grid: [1, 1, 1], threadgroup: [1, 1, 1] },
        &[],
    )?;
    out.into_iter()
        .next()
        .ok_or_else(|| Error::InvalidRequest("the clock kernel returned no output".into()))
}

fn probe(kernel: &Rc<CudaKernel>) -> Result<()> {
    let first = by_kernel(kernel, &Array::scalar(0i32)?)?;
    let second = by_kernel(kernel, &first)?;
    mlx::eval(&[&first, &second])?;
    let (a, b) = (first.item::<u64>()?, second.item::<u64>()?);
    if a == 0 || b < a {
        return Err(Error::InvalidRequest(format!("the GPU clock read {a} then {b}")));
    }
    Ok(())
}
