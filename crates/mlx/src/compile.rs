//! `compile`: trace a Rust closure over arrays once, then replay the fused graph.
//!
//! MLX calls the closure while tracing (the first call, and again for each new input shape or
//! dtype unless `shapeless`). The closure must be a pure function of its inputs: arrays it
//! captures become constants of the compiled graph.

use cxx::UniquePtr;
use mlx_sys::{RustClosure, ffi};

use crate::array::{Array, from_vector, to_vector};
use crate::error::{Result, check};

/// A compiled function of arrays.
pub struct Compiled {
    inner: UniquePtr<ffi::CompiledFn>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled")
    }
}

/// Compiles `f`. With `shapeless`, one trace serves inputs of any shape (only valid when the
/// graph's ops do not depend on shapes, e.g. element-wise chains).
#[track_caller]
pub fn compile<F>(f: F, shapeless: bool) -> Result<Compiled>
where
    F: Fn(&[Array]) -> Result<Vec<Array>> + Send + 'static,
{
    let closure = RustClosure::new(Box::new(move |inputs| {
        let inputs = from_vector(inputs).map_err(|e| e.to_string())?;
        let outputs = f(&inputs).map_err(|e| e.to_string())?;
        Ok(to_vector(outputs.iter()))
    }));
    let inner = check(ffi::compile(Box::new(closure), shapeless))?;
    Ok(Compiled { inner })
}

impl Compiled {
    /// Runs the compiled graph on `inputs` (lazily, like any op). An error returned by the
    /// closure during tracing comes back here as [`crate::Error::Mlx`].
    #[track_caller]
    pub fn call(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        let function = self
            .inner
            .as_ref()
            .unwrap_or_else(|| unreachable!("compile returns an error instead of a null handle"));
        let outputs = check(ffi::compiled_call(function, &to_vector(inputs.iter().copied())))?;
        from_vector(&outputs)
    }
}
