//! Array operations: arithmetic, comparisons, shapes, indexing, reductions, creation.
//!
//! Most ops are methods on [`Array`] so they chain (`x.matmul(&w)?.add(&b)?`); ops over
//! several arrays (`concatenate`, `stack`, `einsum`, `where_`) and constructors (`zeros`,
//! `arange`, `tri`, …) are free functions. Every op is lazy and returns at once; shape and
//! dtype errors are reported here, at the call, as [`crate::Error::Mlx`].

use mlx_sys::ffi;

use crate::array::{Array, Dtype, from_vector, to_vector};
use crate::error::{Result, check};

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, other: &Array) -> Result<Array> {
                    check(ffi::binary(ffi::BinaryOp::$op, self.raw(), other.raw())).map(Array::wrap)
                }
            )*
        }
    };
}

binary_methods! {
    /// `self + other`, broadcasting.
    add => Add;
    /// `self - other`, broadcasting.
    subtract => Subtract;
    /// `self * other`, broadcasting.
    multiply => Multiply;
    /// `self / other`, broadcasting (true division).
    divide => Divide;
    /// `self ** other`, broadcasting.
    power => Power;
    /// Element-wise maximum.
    maximum => Maximum;
    /// Element-wise minimum.
    minimum => Minimum;
    /// Element-wise remainder (sign of the divisor, as Python's `%`).
    remainder => Remainder;
    /// Element-wise floor division.
    floor_divide => FloorDivide;
    /// `self == other` (bool).
    eq => Equal;
    /// `self != other` (bool).
    ne => NotEqual;
    /// `self < other` (bool).
    lt => Less;
    /// `self <= other` (bool).
    le => LessEqual;
    /// `self > other` (bool).
    gt => Greater;
    /// `self >= other` (bool).
    ge => GreaterEqual;
    /// Logical and.
    logical_and => LogicalAnd;
    /// Logical or.
    logical_or => LogicalOr;
    /// Element-wise `&` of integers.
    bitwise_and => BitwiseAnd;
    /// Element-wise `|` of integers.
    bitwise_or => BitwiseOr;
    /// Element-wise `self << other` (integers).
    left_shift => LeftShift;
    /// Element-wise `self >> other` (integers).
    right_shift => RightShift;
    /// `log(e^self + e^other)`, computed stably (`softplus(x)` is `x.logaddexp(0)`).
    logaddexp => LogAddExp;
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self) -> Result<Array> {
                    check(ffi::unary(ffi::UnaryOp::$op, self.raw())).map(Array::wrap)
                }
            )*
        }
    };
}

unary_methods! {
    /// `-self`.
    negative => Negative;
    /// Absolute value.
    abs => Abs;
    /// `e^x`.
    exp => Exp;
    /// Natural logarithm.
    log => Log;
    /// `ln(1 + x)`.
    log1p => Log1p;
    /// Square root.
    sqrt => Sqrt;
    /// `1 / sqrt(x)`.
    rsqrt => Rsqrt;
    /// `x * x`.
    square => Square;
    /// Sine.
    sin => Sin;
    /// Cosine.
    cos => Cos;
    /// Hyperbolic tangent.
    tanh => Tanh;
    /// Logistic sigmoid `1 / (1 + e^-x)`.
    sigmoid => Sigmoid;
    /// Error function.
    erf => Erf;
    /// Floor.
    floor => Floor;
    /// Ceiling.
    ceil => Ceil;
    /// `1 / x`.
    reciprocal => Reciprocal;
    /// Logical not.
    logical_not => LogicalNot;
    /// The same values with gradients stopped (identity in inference).
    stop_gradient => StopGradient;
    /// The same values in a buffer of their own, row-major (a slice stops holding its source).
    contiguous => Contiguous;
}

macro_rules! reduce_methods {
    ($($(#[$doc:meta])* $name:ident, $all:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
                    check(ffi::reduce(ffi::ReduceOp::$op, self.raw(), axes, keepdims)).map(Array::wrap)
                }

                #[doc = concat!("[`Array::", stringify!($name), "`] over every axis.")]
                #[track_caller]
                pub fn $all(&self, keepdims: bool) -> Result<Array> {
                    check(ffi::reduce_all(ffi::ReduceOp::$op, self.raw(), keepdims)).map(Array::wrap)
                }
            )*
        }
    };
}

reduce_methods! {
    /// Sum over `axes`.
    sum, sum_all => Sum;
    /// Mean over `axes`.
    mean, mean_all => Mean;
    /// Maximum over `axes`.
    max, max_all => Max;
    /// Minimum over `axes`.
    min, min_all => Min;
    /// Product over `axes`.
    prod, prod_all => Prod;
    /// `log(sum(exp(x)))` over `axes`, computed stably.
    logsumexp, logsumexp_all => LogSumExp;
    /// Whether every element over `axes` is true.
    all, all_all => All;
    /// Whether any element over `axes` is true.
    any, any_all => Any;
}

impl Array {
    /// A scalar of this array's dtype when it is floating point (MLX's weak typing for Python
    /// scalars: `bf16_array * 0.5` stays `bf16`), else `float32` for non-integral values.
    #[track_caller]
    pub fn scalar_like(&self, value: f64) -> Result<Array> {
        let dtype = self.dtype();
        let target = if dtype.is_float() || value.fract() == 0.0 { dtype } else { Dtype::Float32 };
        Array::scalar_as(value, target)
    }

    /// `self + value` with the scalar in this array's dtype (see [`Array::scalar_like`]).
    #[track_caller]
    pub fn add_scalar(&self, value: f64) -> Result<Array> {
        self.add(&self.scalar_like(value)?)
    }

    /// `self * value` with the scalar in this array's dtype (see [`Array::scalar_like`]).
    #[track_caller]
    pub fn multiply_scalar(&self, value: f64) -> Result<Array> {
        self.multiply(&self.scalar_like(value)?)
    }

    /// Index of the maximum along `axis`.
    #[track_caller]
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        check(ffi::argmax(self.raw(), axis, keepdims)).map(Array::wrap)
    }

    /// Index of the minimum along `axis`.
    #[track_caller]
    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        check(ffi::argmin(self.raw(), axis, keepdims)).map(Array::wrap)
    }

    /// Matrix product with NumPy's batching and broadcasting rules.
    #[track_caller]
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        check(ffi::matmul(self.raw(), other.raw())).map(Array::wrap)
    }

    /// Batched matrix product that picks its operands by index (mixture-of-experts routing):
    /// `rhs_indices` selects one matrix of `other`'s batch for each batch entry of `self`,
    /// `lhs_indices` one of `self`'s. `sorted_indices` promises `rhs_indices` is sorted.
    #[track_caller]
    #[allow(unsafe_code)]
    pub fn gather_matmul(
        &self,
        other: &Array,
        lhs_indices: Option<&Array>,
        rhs_indices: Option<&Array>,
        sorted_indices: bool,
    ) -> Result<Array> {
        use crate::array::opt_ptr;
        // SAFETY: each pointer is null or borrows an argument that outlives the call.
        check(unsafe {
            ffi::gather_mm(
                self.raw(),
                other.raw(),
                opt_ptr(lhs_indices),
                opt_ptr(rhs_indices),
                sorted_indices,
            )
        })
        .map(Array::wrap)
    }

    /// A copy converted to `dtype`.
    #[track_caller]
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        check(ffi::astype(self.raw(), dtype.to_ffi())).map(Array::wrap)
    }

    /// The same elements in `shape` (one entry may be `-1`).
    #[track_caller]
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        check(ffi::reshape(self.raw(), shape)).map(Array::wrap)
    }

    /// Permutes the axes; an empty `axes` reverses them.
    #[track_caller]
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        if axes.is_empty() {
            return check(ffi::transpose_all(self.raw())).map(Array::wrap);
        }
        check(ffi::transpose(self.raw(), axes)).map(Array::wrap)
    }

    /// Swaps two axes.
    #[track_caller]
    pub fn swapaxes(&self, axis1: i32, axis2: i32) -> Result<Array> {
        check(ffi::swapaxes(self.raw(), axis1, axis2)).map(Array::wrap)
    }

    /// Inserts size-1 axes at `axes`.
    #[track_caller]
    pub fn expand_dims(&self, axes: &[i32]) -> Result<Array> {
        check(ffi::expand_dims(self.raw(), axes)).map(Array::wrap)
    }

    /// Removes size-1 axes (`axes` empty: all of them).
    #[track_caller]
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        check(ffi::squeeze(self.raw(), axes)).map(Array::wrap)
    }

    /// Broadcasts to `shape`.
    #[track_caller]
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        check(ffi::broadcast_to(self.raw(), shape)).map(Array::wrap)
    }

    /// Merges axes `start..=end` into one.
    #[track_caller]
    pub fn flatten(&self, start_axis: i32, end_axis: i32) -> Result<Array> {
        check(ffi::flatten(self.raw(), start_axis, end_axis)).map(Array::wrap)
    }

    /// Splits axis `axis` into `shape` (whose product is its size); the other axes, whatever
    /// their sizes, untouched (usable in a shapeless compiled graph, as `flatten` is).
    #[track_caller]
    pub fn unflatten(&self, axis: i32, shape: &[i32]) -> Result<Array> {
        check(ffi::unflatten(self.raw(), axis, shape)).map(Array::wrap)
    }

    /// Splits into `sections` equal parts along `axis`.
    #[track_caller]
    pub fn split_equal(&self, sections: i32, axis: i32) -> Result<Vec<Array>> {
        let parts = check(ffi::split_sections(self.raw(), sections, axis))?;
        from_vector(&parts)
    }

    /// Splits along `axis` before each of `indices`.
    #[track_caller]
    pub fn split_at(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        let parts = check(ffi::split_indices(self.raw(), indices, axis))?;
        from_vector(&parts)
    }

    /// `self[start:stop:strides]` with static bounds, one entry per axis.
    #[track_caller]
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        check(ffi::slice(self.raw(), start, stop, strides)).map(Array::wrap)
    }

    /// A slice of `sizes` along `axes` starting at the positions held in the array `start`
    /// (evaluated on the device: no host sync, so it can sit inside a compiled graph).
    #[track_caller]
    pub fn slice_dynamic(&self, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
        check(ffi::slice_dynamic(self.raw(), start.raw(), axes, sizes)).map(Array::wrap)
    }

    /// A copy of `self` with `self[start:stop:strides] = update`.
    #[track_caller]
    pub fn slice_update(
        &self,
        update: &Array,
        start: &[i32],
        stop: &[i32],
        strides: &[i32],
    ) -> Result<Array> {
        check(ffi::slice_update(self.raw(), update.raw(), start, stop, strides)).map(Array::wrap)
    }

    /// A copy of `self` with `update` written along `axes` at the positions held in `start`.
    #[track_caller]
    pub fn slice_update_dynamic(
        &self,
        update: &Array,
        start: &Array,
        axes: &[i32],
    ) -> Result<Array> {
        check(ffi::slice_update_dynamic(self.raw(), update.raw(), start.raw(), axes))
            .map(Array::wrap)
    }

    /// Gathers entries at `indices` along `axis`.
    #[track_caller]
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        check(ffi::take(self.raw(), indices.raw(), axis)).map(Array::wrap)
    }

    /// Gathers entries at `indices` of the flattened array.
    #[track_caller]
    pub fn take_flat(&self, indices: &Array) -> Result<Array> {
        check(ffi::take_flat(self.raw(), indices.raw())).map(Array::wrap)
    }

    /// Gathers along `axis` with `indices` of the same rank (NumPy `take_along_axis`).
    #[track_caller]
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        check(ffi::take_along_axis(self.raw(), indices.raw(), axis)).map(Array::wrap)
    }

    /// A copy with `values` written at `indices` along `axis`.
    #[track_caller]
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        check(ffi::put_along_axis(self.raw(), indices.raw(), values.raw(), axis)).map(Array::wrap)
    }

    /// The Walsh–Hadamard transform along the last axis (Sylvester order, a power-of-two
    /// width), times `scale` (MLX's default `1/√n` when `None`).
    #[track_caller]
    pub fn hadamard_transform(&self, scale: Option<f32>) -> Result<Array> {
        check(ffi::hadamard_transform(self.raw(), scale.unwrap_or(f32::NAN))).map(Array::wrap)
    }

    /// Softmax over `axes`; `precise` accumulates in `f32` for half-precision inputs.
    #[track_caller]
    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        check(ffi::softmax(self.raw(), axes, precise)).map(Array::wrap)
    }

    /// Indices that partition `axis` around its `kth` smallest element.
    #[track_caller]
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        check(ffi::argpartition(self.raw(), kth, axis)).map(Array::wrap)
    }

    /// The values partitioned around the `kth` smallest element along `axis`.
    #[track_caller]
    pub fn partition(&self, kth: i32, axis: i32) -> Result<Array> {
        check(ffi::partition(self.raw(), kth, axis)).map(Array::wrap)
    }

    /// The `k` largest values along `axis` (unordered, as MLX returns them).
    #[track_caller]
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        check(ffi::topk(self.raw(), k, axis)).map(Array::wrap)
    }

    /// Sorted ascending along `axis`.
    #[track_caller]
    pub fn sort(&self, axis: i32) -> Result<Array> {
        check(ffi::sort(self.raw(), axis)).map(Array::wrap)
    }

    /// Indices that sort ascending along `axis`.
    #[track_caller]
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        check(ffi::argsort(self.raw(), axis)).map(Array::wrap)
    }

    /// Cumulative sum along `axis`.
    #[track_caller]
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        check(ffi::cumsum(self.raw(), axis, reverse, inclusive)).map(Array::wrap)
    }

    /// Lower triangle (elements above diagonal `k` set to zero) of the last two axes.
    #[track_caller]
    pub fn tril(&self, k: i32) -> Result<Array> {
        check(ffi::tril(self.raw(), k)).map(Array::wrap)
    }

    /// Upper triangle (elements below diagonal `k` set to zero) of the last two axes.
    #[track_caller]
    pub fn triu(&self, k: i32) -> Result<Array> {
        check(ffi::triu(self.raw(), k)).map(Array::wrap)
    }

    /// Pads `axes` with `low[i]` elements before and `high[i]` after, filled with `value`.
    #[track_caller]
    pub fn pad(&self, axes: &[i32], low: &[i32], high: &[i32], value: &Array) -> Result<Array> {
        check(ffi::pad(self.raw(), axes, low, high, value.raw())).map(Array::wrap)
    }

    /// Clamps into `[min, max]`.
    #[track_caller]
    pub fn clip(&self, min: &Array, max: &Array) -> Result<Array> {
        check(ffi::clip(self.raw(), min.raw(), max.raw())).map(Array::wrap)
    }

    /// Whether `self` and `other` have the same shape and values (a bool scalar).
    #[track_caller]
    pub fn array_equal(&self, other: &Array, equal_nan: bool) -> Result<Array> {
        check(ffi::array_equal(self.raw(), other.raw(), equal_nan)).map(Array::wrap)
    }

    /// `|self - other| <= atol + rtol * |other|`, element-wise.
    #[track_caller]
    pub fn isclose(&self, other: &Array, rtol: f64, atol: f64) -> Result<Array> {
        check(ffi::isclose(self.raw(), other.raw(), rtol, atol)).map(Array::wrap)
    }

    /// GELU with the tanh approximation, as `mlx.nn.gelu_approx` and Gemma use:
    /// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`.
    #[track_caller]
    pub fn gelu_approx(&self) -> Result<Array> {
        let x = self;
        let inner = x.add(&x.power(&x.scalar_like(3.0)?)?.multiply_scalar(0.044715)?)?;
        let t = inner.multiply_scalar((2.0 / std::f64::consts::PI).sqrt())?.tanh()?;
        x.multiply_scalar(0.5)?.multiply(&t.add_scalar(1.0)?)
    }

    /// SiLU (swish): `x · sigmoid(x)`.
    #[track_caller]
    pub fn silu(&self) -> Result<Array> {
        self.multiply(&self.sigmoid()?)
    }
}

/// `beta · c + alpha · (a @ b)` in one op.
#[track_caller]
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    check(ffi::addmm(c.raw(), a.raw(), b.raw(), alpha, beta)).map(Array::wrap)
}

/// Joins arrays along an existing `axis`.
#[track_caller]
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    check(ffi::concatenate(&to_vector(arrays.iter().copied()), axis)).map(Array::wrap)
}

/// Joins arrays along a new `axis`.
#[track_caller]
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    check(ffi::stack(&to_vector(arrays.iter().copied()), axis)).map(Array::wrap)
}

/// `x` where `condition` holds, else `y` (broadcasting).
#[track_caller]
pub fn where_(condition: &Array, x: &Array, y: &Array) -> Result<Array> {
    check(ffi::where_(condition.raw(), x.raw(), y.raw())).map(Array::wrap)
}

/// Einstein summation, e.g. `einsum("ij,jk->ik", &[&a, &b])`.
#[track_caller]
pub fn einsum(subscripts: &str, operands: &[&Array]) -> Result<Array> {
    check(ffi::einsum(subscripts, &to_vector(operands.iter().copied()))).map(Array::wrap)
}

/// 1-D convolution. `input` is `[N, L, C_in]`, `weight` `[C_out, K, C_in / groups]`
/// (MLX's channels-last layout); `groups == C_in == C_out` gives a depthwise convolution.
#[track_caller]
pub fn conv1d(
    input: &Array,
    weight: &Array,
    stride: i32,
    padding: i32,
    dilation: i32,
    groups: i32,
) -> Result<Array> {
    check(ffi::conv1d(input.raw(), weight.raw(), stride, padding, dilation, groups))
        .map(Array::wrap)
}

/// `[start, start + step, …)` up to `stop` (exclusive).
#[track_caller]
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    check(ffi::arange(start, stop, step, dtype.to_ffi())).map(Array::wrap)
}

/// Zeros of `shape`.
#[track_caller]
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    check(ffi::zeros(shape, dtype.to_ffi())).map(Array::wrap)
}

/// Ones of `shape`.
#[track_caller]
pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
    check(ffi::ones(shape, dtype.to_ffi())).map(Array::wrap)
}

/// `shape` filled with `value` (broadcast), as `dtype`.
#[track_caller]
pub fn full(shape: &[i32], value: &Array, dtype: Dtype) -> Result<Array> {
    check(ffi::full(shape, value.raw(), dtype.to_ffi())).map(Array::wrap)
}

/// An `n × m` matrix with ones at and below diagonal `k`, zeros elsewhere.
#[track_caller]
pub fn tri(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<Array> {
    check(ffi::tri(n, m, k, dtype.to_ffi())).map(Array::wrap)
}
