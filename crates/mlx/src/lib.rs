//! Safe Rust API over [MLX](https://github.com/ml-explore/mlx), the array framework Quince's
//! engine runs on.
//!
//! - [`Array`]: a cheap, reference-counted handle to a node of MLX's lazy graph; ops return
//!   at once and [`Array::eval`] (or any read) computes. Element types: [`Element`].
//! - [`ops`]: arithmetic, comparisons, shapes, indexing, reductions, creation (most are
//!   methods on [`Array`]).
//! - [`fast`]: fused `rms_norm`, `layer_norm`, `rope`, `scaled_dot_product_attention`;
//!   `rope_by_ops` (the CPU fallback's arithmetic without slices, for shapeless graphs); custom
//!   CUDA kernels ([`fast::CudaKernel`]).
//! - [`quantized`]: affine quantization and quantized matmuls.
//! - [`random`]: keyed random numbers. [`compile()`]: traced, fused Rust closures.
//! - [`io`]: safetensors. [`device`]: devices, backend, memory.
//!
//! Every call that reaches MLX returns [`Result`]: MLX reports bad shapes, dtypes and arguments
//! by throwing, and the binding turns each exception into [`Error::Mlx`] carrying MLX's
//! message and the Rust call site.
//!
//! ```
//! use mlx::{Array, ops};
//! # fn main() -> mlx::Result<()> {
//! let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let b = ops::ones(&[2, 2], mlx::Dtype::Float32)?;
//! let c = a.matmul(&b)?.add(&a)?;
//! assert_eq!(c.to_vec::<f32>()?, vec![4.0, 5.0, 10.0, 11.0]);
//! assert!(a.matmul(&ops::ones(&[3, 3], mlx::Dtype::Float32)?).is_err());
//! # Ok(())
//! # }
//! ```

mod array;
pub mod compile;
pub mod device;
mod error;
pub mod fast;
pub mod io;
pub mod ops;
pub mod quantized;
pub mod random;

pub use array::{Array, Dtype, Element, async_eval, eval, graph_census};
pub use compile::{Compiled, compile};
pub use device::{Backend, Device};
pub use error::{Error, Result};
