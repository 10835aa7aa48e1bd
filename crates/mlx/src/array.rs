//! [`Array`], [`Dtype`] and the [`Element`] types that cross between Rust and MLX.

use std::fmt;

use cxx::UniquePtr;
use mlx_sys::ffi;

use crate::error::{Error, Result, check};

/// Element type of an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dtype {
    /// `bool`, one byte per element.
    Bool,
    /// `u8`.
    Uint8,
    /// `u16`.
    Uint16,
    /// `u32`.
    Uint32,
    /// `u64`.
    Uint64,
    /// `i8`.
    Int8,
    /// `i16`.
    Int16,
    /// `i32`.
    Int32,
    /// `i64`.
    Int64,
    /// IEEE half precision ([`half::f16`]).
    Float16,
    /// `f32`.
    Float32,
    /// `f64` (CPU only in MLX).
    Float64,
    /// Brain float ([`half::bf16`]).
    Bfloat16,
    /// Two `f32`s; no Rust element type maps to it here.
    Complex64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::Uint8 | Dtype::Int8 => 1,
            Dtype::Uint16 | Dtype::Int16 | Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Uint32 | Dtype::Int32 | Dtype::Float32 => 4,
            Dtype::Uint64 | Dtype::Int64 | Dtype::Float64 | Dtype::Complex64 => 8,
        }
    }

    /// The lowest finite value of a floating-point type (what an attention mask writes where
    /// it hides a position); `f32`'s for the others.
    pub fn lowest(self) -> f64 {
        match self {
            Dtype::Float16 => -65504.0,
            Dtype::Bfloat16 => -3.389_531_389_251_535_5e38,
            Dtype::Float64 => f64::MIN,
            _ => f64::from(f32::MIN),
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16)
    }

    /// The dtype's name as MLX and safetensors spell it in Python (`float32`, `bfloat16`, …).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::Uint8 => "uint8",
            Dtype::Uint16 => "uint16",
            Dtype::Uint32 => "uint32",
            Dtype::Uint64 => "uint64",
            Dtype::Int8 => "int8",
            Dtype::Int16 => "int16",
            Dtype::Int32 => "int32",
            Dtype::Int64 => "int64",
            Dtype::Float16 => "float16",
            Dtype::Float32 => "float32",
            Dtype::Float64 => "float64",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Complex64 => "complex64",
        }
    }

    pub(crate) fn to_ffi(self) -> ffi::Dtype {
        match self {
            Dtype::Bool => ffi::Dtype::Bool,
            Dtype::Uint8 => ffi::Dtype::Uint8,
            Dtype::Uint16 => ffi::Dtype::Uint16,
            Dtype::Uint32 => ffi::Dtype::Uint32,
            Dtype::Uint64 => ffi::Dtype::Uint64,
            Dtype::Int8 => ffi::Dtype::Int8,
            Dtype::Int16 => ffi::Dtype::Int16,
            Dtype::Int32 => ffi::Dtype::Int32,
            Dtype::Int64 => ffi::Dtype::Int64,
            Dtype::Float16 => ffi::Dtype::Float16,
            Dtype::Float32 => ffi::Dtype::Float32,
            Dtype::Float64 => ffi::Dtype::Float64,
            Dtype::Bfloat16 => ffi::Dtype::Bfloat16,
            Dtype::Complex64 => ffi::Dtype::Complex64,
        }
    }

    pub(crate) fn from_ffi(dtype: ffi::Dtype) -> Dtype {
        match dtype {
            ffi::Dtype::Bool => Dtype::Bool,
            ffi::Dtype::Uint8 => Dtype::Uint8,
            ffi::Dtype::Uint16 => Dtype::Uint16,
            ffi::Dtype::Uint32 => Dtype::Uint32,
            ffi::Dtype::Uint64 => Dtype::Uint64,
            ffi::Dtype::Int8 => Dtype::Int8,
            ffi::Dtype::Int16 => Dtype::Int16,
            ffi::Dtype::Int32 => Dtype::Int32,
            ffi::Dtype::Int64 => Dtype::Int64,
            ffi::Dtype::Float16 => Dtype::Float16,
            ffi::Dtype::Float64 => Dtype::Float64,
            ffi::Dtype::Bfloat16 => Dtype::Bfloat16,
            ffi::Dtype::Complex64 => Dtype::Complex64,
            // Float32, and any code a newer shim might add: the shim maps every MLX dtype.
            _ => Dtype::Float32,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is the element type of some [`Dtype`].
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype of arrays made from this type.
    const DTYPE: Dtype;
    /// Appends the native-endian bytes of `values` to `out`.
    fn extend_bytes(values: &[Self], out: &mut Vec<u8>);
    /// Reads elements back from native-endian bytes (`bytes.len()` is a multiple of the size).
    fn from_bytes(bytes: &[u8]) -> Vec<Self>;
    /// The value as an `f64` (for scalar creation and comparisons in tests).
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($t:ty, $dtype:ident, $n:literal, |$v:ident| $to_f64:expr) => {
        impl Element for $t {
            const DTYPE: Dtype = Dtype::$dtype;
            fn extend_bytes(values: &[Self], out: &mut Vec<u8>) {
                out.reserve(values.len() * $n);
                for v in values {
                    out.extend_from_slice(&v.to_ne_bytes());
                }
            }
            fn from_bytes(bytes: &[u8]) -> Vec<Self> {
                bytes
                    .chunks_exact($n)
                    .map(|c| {
                        let mut raw = [0u8; $n];
                        raw.copy_from_slice(c);
                        <$t>::from_ne_bytes(raw)
                    })
                    .collect()
            }
            fn to_f64(self) -> f64 {
                let $v = self;
                $to_f64
            }
        }
    };
}

element!(u8, Uint8, 1, |v| f64::from(v));
element!(u16, Uint16, 2, |v| f64::from(v));
element!(u32, Uint32, 4, |v| f64::from(v));
element!(u64, Uint64, 8, |v| v as f64);
element!(i8, Int8, 1, |v| f64::from(v));
element!(i16, Int16, 2, |v| f64::from(v));
element!(i32, Int32, 4, |v| f64::from(v));
element!(i64, Int64, 8, |v| v as f64);
element!(f32, Float32, 4, |v| f64::from(v));
element!(f64, Float64, 8, |v| v);
element!(half::f16, Float16, 2, |v| v.to_f64());
element!(half::bf16, Bfloat16, 2, |v| v.to_f64());

impl Element for bool {
    const DTYPE: Dtype = Dtype::Bool;
    fn extend_bytes(values: &[Self], out: &mut Vec<u8>) {
        out.extend(values.iter().map(|&b| u8::from(b)));
    }
    fn from_bytes(bytes: &[u8]) -> Vec<Self> {
        bytes.iter().map(|&b| b != 0).collect()
    }
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
}

/// An n-dimensional array: a cheap, reference-counted handle to a node of MLX's lazy graph.
///
/// Ops build graph nodes and return at once; nothing runs until [`Array::eval`] (or a read
/// such as [`Array::to_vec`]) asks for values. Cloning copies the handle, not the data.
///
/// `Array` is `Send` (the handle's reference count is atomic) but not `Sync`. MLX streams
/// belong to the thread that created them, so a graph must be evaluated on the thread that
/// built it: evaluating a pending array on another thread returns an error. Evaluated arrays
/// can be used anywhere. The engine keeps all MLX work on its actor thread.
pub struct Array {
    pub(crate) inner: UniquePtr<ffi::Array>,
}

impl Array {
    pub(crate) fn wrap(inner: UniquePtr<ffi::Array>) -> Array {
        Array { inner }
    }

    pub(crate) fn raw(&self) -> &ffi::Array {
        // Every `Array` is built by `wrap` from a non-null pointer returned by the shim
        // (cxx returns an error instead of a null `UniquePtr` when C++ throws).
        self.inner.as_ref().unwrap_or_else(|| unreachable!("Array handles are never null"))
    }

    /// An array of `shape` holding `data` (row-major). Errors when the lengths disagree.
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        let mut bytes = Vec::new();
        T::extend_bytes(data, &mut bytes);
        Array::from_bytes(&bytes, shape, T::DTYPE)
    }

    /// An array of `shape` and `dtype` from native-endian bytes (`bf16`/`f16` as their bits).
    #[track_caller]
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        check(ffi::array_from_bytes(bytes, shape, dtype.to_ffi())).map(Array::wrap)
    }

    /// A 0-d array holding `value`.
    #[track_caller]
    pub fn scalar<T: Element>(value: T) -> Result<Array> {
        Array::from_slice(&[value], &[])
    }

    /// A 0-d array of `dtype` holding `value` converted as C++ `static_cast` does.
    #[track_caller]
    pub fn scalar_as(value: f64, dtype: Dtype) -> Result<Array> {
        check(ffi::array_scalar_f64(value, dtype.to_ffi())).map(Array::wrap)
    }

    /// The dimensions.
    pub fn shape(&self) -> Vec<i32> {
        ffi::array_shape(self.raw())
    }

    /// The size of axis `axis` (negative counts from the end).
    #[track_caller]
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let index = if axis < 0 { axis + n } else { axis };
        if index < 0 || index >= n {
            return Err(Error::invalid(format!("axis {axis} is out of range for {n} dimensions")));
        }
        Ok(shape[index as usize])
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        ffi::array_ndim(self.raw())
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        ffi::array_size(self.raw())
    }

    /// Bytes the elements take (size × dtype size).
    pub fn nbytes(&self) -> usize {
        ffi::array_nbytes(self.raw())
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        Dtype::from_ffi(ffi::array_dtype(self.raw()))
    }

    /// An identity for the graph node this handle points to (equal for clones).
    pub fn id(&self) -> usize {
        ffi::array_id(self.raw())
    }

    /// Computes the array's value (and everything it depends on), blocking until done.
    #[track_caller]
    pub fn eval(&self) -> Result<()> {
        check(ffi::eval_one(self.raw()))
    }

    /// Waits until the array, already scheduled by [`async_eval`], is computed. Unlike
    /// [`Array::eval`] it schedules nothing and touches no stream, so a thread other than
    /// the one evaluating may wait (then reading the value evaluates nothing either).
    #[track_caller]
    pub fn wait(&self) -> Result<()> {
        check(ffi::array_wait(self.raw()))
    }

    /// The elements in row-major order. Evaluates the array first. The element type must match
    /// the dtype exactly (use [`Array::astype`] to convert).
    #[track_caller]
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let actual = self.dtype();
        if actual != T::DTYPE {
            return Err(Error::DtypeMismatch {
                expected: T::DTYPE,
                actual,
                location: std::panic::Location::caller(),
            });
        }
        let bytes = self.to_bytes()?;
        Ok(T::from_bytes(&bytes))
    }

    /// The elements' native-endian bytes in row-major order. Evaluates the array first.
    #[track_caller]
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; self.nbytes()];
        check(ffi::array_copy_to(self.raw(), &mut bytes))?;
        Ok(bytes)
    }

    /// The single element of a one-element array.
    #[track_caller]
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::invalid(format!(
                "item() needs exactly one element, the array has {}",
                self.size()
            )));
        }
        let values = self.to_vec::<T>()?;
        values.first().copied().ok_or_else(|| Error::invalid("item() read no element"))
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        Array::wrap(ffi::array_clone(self.raw()))
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Array").field("shape", &self.shape()).field("dtype", &self.dtype()).finish()
    }
}

impl fmt::Display for Array {
    /// MLX's own printout; evaluates the array.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match ffi::array_to_string(self.raw()) {
            Ok(text) => f.write_str(&text),
            Err(e) => write!(f, "<array: {}>", e.what()),
        }
    }
}

/// Evaluates several arrays together (one graph walk), blocking until done.
#[track_caller]
pub fn eval(arrays: &[&Array]) -> Result<()> {
    check(ffi::eval(&to_vector(arrays.iter().copied())))
}

/// Schedules the evaluation of `arrays` and returns at once; a later read or [`eval`] waits.
/// This is how a decode loop builds step *t+1* while step *t* runs.
#[track_caller]
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    check(ffi::async_eval(&to_vector(arrays.iter().copied())))
}

/// How many nodes of each primitive evaluating `arrays` would run, by primitive name (nodes
/// already scheduled or evaluated are left out): the op census of a step before it runs.
/// A multi-output node counts once.
pub fn graph_census(arrays: &[&Array]) -> std::collections::BTreeMap<String, usize> {
    let mut census = std::collections::BTreeMap::new();
    for name in ffi::graph_census(&to_vector(arrays.iter().copied())) {
        *census.entry(name).or_insert(0) += 1;
    }
    census
}

/// Builds the C++ vector the bridge takes for lists of arrays.
/// Null for `None`, else the bridge handle behind `a`.
pub(crate) fn opt_ptr(a: Option<&Array>) -> *const ffi::Array {
    a.map_or(std::ptr::null(), |a| a.raw() as *const ffi::Array)
}

pub(crate) fn to_vector<'a>(
    arrays: impl IntoIterator<Item = &'a Array>,
) -> UniquePtr<cxx::CxxVector<ffi::Array>> {
    let mut vector = ffi::vec_new();
    for a in arrays {
        ffi::vec_push(vector.pin_mut(), a.raw());
    }
    vector
}

/// Reads a C++ vector of arrays back into handles.
#[track_caller]
pub(crate) fn from_vector(vector: &cxx::CxxVector<ffi::Array>) -> Result<Vec<Array>> {
    (0..vector.len()).map(|i| check(ffi::vec_get(vector, i)).map(Array::wrap)).collect()
}
