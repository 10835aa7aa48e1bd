//! Raw `cxx` bridge over MLX's C++ API. Use the `mlx` crate instead: it wraps every function
//! here in a safe, typed API.
//!
//! Layout of the bridge:
//! - shared enums (`Dtype`, `BinaryOp`, `UnaryOp`, `ReduceOp`, `DeviceKind`) and one shared
//!   struct (`StringPair`) that both languages see;
//! - `extern "Rust"`: the closure type that `compile` calls back into;
//! - `extern "C++"`: the opaque `Array` (an alias of `mlx::core::array`, a ref-counted handle),
//!   the opaque results of `compile` and `load_safetensors`, and the shim functions, one C++
//!   file per area under `shim/`.
//!
//! **Every function that can throw returns `Result`.** MLX reports bad shapes, dtypes and
//! arguments by throwing C++ exceptions; a throwing function not declared `-> Result` would call
//! `std::terminate` and abort the app. Only pure accessors of an existing array (`array_ndim`,
//! `array_dtype`, …) are declared infallible.
//!
//! Optional arrays are passed as `*const Array` (null for "none"), which makes those functions
//! `unsafe`: the caller promises the pointer is null or points to a live `Array`.

// Generated code: the unsafe fns' contract is stated once above (null or a live `Array`), and
// the argument lists mirror MLX's own signatures.
#[allow(clippy::missing_safety_doc, clippy::too_many_arguments)]
#[cxx::bridge(namespace = "quince")]
pub mod ffi {
    /// Element types, in MLX's order. `Complex64` exists so every MLX array maps to a value.
    #[repr(u8)]
    enum Dtype {
        Bool,
        Uint8,
        Uint16,
        Uint32,
        Uint64,
        Int8,
        Int16,
        Int32,
        Int64,
        Float16,
        Float32,
        Float64,
        Bfloat16,
        Complex64,
    }

    /// Element-wise binary operations (with NumPy broadcasting).
    #[repr(u8)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        Power,
        Maximum,
        Minimum,
        Remainder,
        FloorDivide,
        Equal,
        NotEqual,
        Less,
        LessEqual,
        Greater,
        GreaterEqual,
        LogicalAnd,
        LogicalOr,
        BitwiseAnd,
        BitwiseOr,
        LeftShift,
        RightShift,
        LogAddExp,
    }

    /// Element-wise unary operations.
    #[repr(u8)]
    enum UnaryOp {
        Negative,
        Abs,
        Exp,
        Log,
        Log1p,
        Sqrt,
        Rsqrt,
        Square,
        Sin,
        Cos,
        Tanh,
        Sigmoid,
        Erf,
        Floor,
        Ceil,
        Reciprocal,
        LogicalNot,
        StopGradient,
        Contiguous,
    }

    /// Reductions over a set of axes.
    #[repr(u8)]
    enum ReduceOp {
        Sum,
        Mean,
        Max,
        Min,
        Prod,
        LogSumExp,
        All,
        Any,
    }

    /// Device kinds MLX knows.
    #[repr(u8)]
    enum DeviceKind {
        Cpu,
        Gpu,
    }

    /// A string key and value (safetensors metadata, device info).
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct StringPair {
        key: String,
        value: String,
    }

    extern "Rust" {
        /// A Rust closure that `compile` traces; see `call_rust_closure`.
        type RustClosure;

        /// Called from C++ each time MLX traces a compiled function. An `Err` becomes a C++
        /// exception that unwinds through MLX back to the caller of `compiled_call`.
        fn call_rust_closure(
            closure: &RustClosure,
            inputs: &CxxVector<Array>,
        ) -> Result<UniquePtr<CxxVector<Array>>>;
    }

    unsafe extern "C++" {
        include!("mlx-sys/shim/shim.h");

        /// `mlx::core::array`: a reference-counted handle to a lazily evaluated array.
        type Array;
        /// A compiled function (`std::function` returned by `mlx::core::compile`).
        type CompiledFn;
        /// A custom GPU kernel (`mlx::core::fast::cuda_kernel`).
        type CustomKernelFn;
        /// The arrays and metadata of a loaded safetensors file.
        type SafetensorsData;

        // ---- array.cc: creation, inspection, evaluation ----
        fn array_from_bytes(data: &[u8], shape: &[i32], dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn array_scalar_f64(value: f64, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn array_scalar_i64(value: i64, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn array_scalar_bool(value: bool) -> Result<UniquePtr<Array>>;
        fn array_clone(a: &Array) -> UniquePtr<Array>;
        fn array_ndim(a: &Array) -> usize;
        fn array_shape(a: &Array) -> Vec<i32>;
        fn array_size(a: &Array) -> usize;
        fn array_nbytes(a: &Array) -> usize;
        fn array_dtype(a: &Array) -> Dtype;
        fn array_id(a: &Array) -> usize;
        fn array_to_string(a: &Array) -> Result<String>;
        /// Evaluates `a`, makes it row-contiguous and copies its bytes into `out`
        /// (whose length must equal `nbytes`).
        fn array_copy_to(a: &Array, out: &mut [u8]) -> Result<()>;
        fn eval(arrays: &CxxVector<Array>) -> Result<()>;
        fn async_eval(arrays: &CxxVector<Array>) -> Result<()>;
        /// The primitive names of the nodes that evaluating `arrays` would run, one per node
        /// not yet scheduled (a multi-output node once).
        fn graph_census(arrays: &CxxVector<Array>) -> Vec<String>;
        fn eval_one(a: &Array) -> Result<()>;
        /// Waits until `a` (already scheduled by an `async_eval`) is computed, without
        /// scheduling anything: no stream is touched, so any thread may wait.
        fn array_wait(a: &Array) -> Result<()>;
        fn vec_new() -> UniquePtr<CxxVector<Array>>;
        fn vec_push(v: Pin<&mut CxxVector<Array>>, a: &Array);
        fn vec_get(v: &CxxVector<Array>, index: usize) -> Result<UniquePtr<Array>>;

        // ---- ops.cc: arithmetic, shapes, indexing, reductions, creation ----
        fn binary(op: BinaryOp, a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn unary(op: UnaryOp, a: &Array) -> Result<UniquePtr<Array>>;
        fn reduce(
            op: ReduceOp,
            a: &Array,
            axes: &[i32],
            keepdims: bool,
        ) -> Result<UniquePtr<Array>>;
        fn reduce_all(op: ReduceOp, a: &Array, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn argmin(a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn matmul(a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        unsafe fn gather_mm(
            a: &Array,
            b: &Array,
            lhs_indices: *const Array,
            rhs_indices: *const Array,
            sorted_indices: bool,
        ) -> Result<UniquePtr<Array>>;
        fn addmm(
            c: &Array,
            a: &Array,
            b: &Array,
            alpha: f32,
            beta: f32,
        ) -> Result<UniquePtr<Array>>;
        fn astype(a: &Array, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn reshape(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn transpose(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn transpose_all(a: &Array) -> Result<UniquePtr<Array>>;
        fn swapaxes(a: &Array, axis1: i32, axis2: i32) -> Result<UniquePtr<Array>>;
        fn expand_dims(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn squeeze(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn broadcast_to(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn flatten(a: &Array, start_axis: i32, end_axis: i32) -> Result<UniquePtr<Array>>;
        fn unflatten(a: &Array, axis: i32, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn concatenate(arrays: &CxxVector<Array>, axis: i32) -> Result<UniquePtr<Array>>;
        fn stack(arrays: &CxxVector<Array>, axis: i32) -> Result<UniquePtr<Array>>;
        fn split_sections(
            a: &Array,
            sections: i32,
            axis: i32,
        ) -> Result<UniquePtr<CxxVector<Array>>>;
        fn split_indices(
            a: &Array,
            indices: &[i32],
            axis: i32,
        ) -> Result<UniquePtr<CxxVector<Array>>>;
        fn slice(
            a: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_dynamic(
            a: &Array,
            start: &Array,
            axes: &[i32],
            sizes: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_update(
            src: &Array,
            update: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_update_dynamic(
            src: &Array,
            update: &Array,
            start: &Array,
            axes: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn take(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn take_flat(a: &Array, indices: &Array) -> Result<UniquePtr<Array>>;
        fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn put_along_axis(
            a: &Array,
            indices: &Array,
            values: &Array,
            axis: i32,
        ) -> Result<UniquePtr<Array>>;
        fn where_(condition: &Array, x: &Array, y: &Array) -> Result<UniquePtr<Array>>;
        fn softmax(a: &Array, axes: &[i32], precise: bool) -> Result<UniquePtr<Array>>;
        /// `mx::hadamard_transform` along the last axis; `scale` NaN means MLX's default.
        fn hadamard_transform(a: &Array, scale: f32) -> Result<UniquePtr<Array>>;
        fn argpartition(a: &Array, kth: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn partition(a: &Array, kth: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn topk(a: &Array, k: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn sort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn argsort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool)
        -> Result<UniquePtr<Array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn zeros(shape: &[i32], dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn ones(shape: &[i32], dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn full(shape: &[i32], value: &Array, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn tri(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn tril(a: &Array, k: i32) -> Result<UniquePtr<Array>>;
        fn triu(a: &Array, k: i32) -> Result<UniquePtr<Array>>;
        fn pad(
            a: &Array,
            axes: &[i32],
            low: &[i32],
            high: &[i32],
            value: &Array,
        ) -> Result<UniquePtr<Array>>;
        fn conv1d(
            input: &Array,
            weight: &Array,
            stride: i32,
            padding: i32,
            dilation: i32,
            groups: i32,
        ) -> Result<UniquePtr<Array>>;
        fn einsum(subscripts: &str, operands: &CxxVector<Array>) -> Result<UniquePtr<Array>>;
        fn array_equal(a: &Array, b: &Array, equal_nan: bool) -> Result<UniquePtr<Array>>;
        fn isclose(a: &Array, b: &Array, rtol: f64, atol: f64) -> Result<UniquePtr<Array>>;
        fn clip(a: &Array, min: &Array, max: &Array) -> Result<UniquePtr<Array>>;

        // ---- quantized.cc: affine quantization ----
        /// Returns `[w_q, scales, biases]`.
        fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<UniquePtr<CxxVector<Array>>>;
        unsafe fn dequantize(
            w: &Array,
            scales: &Array,
            biases: *const Array,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn quantized_matmul(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: *const Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn gather_qmm(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: *const Array,
            lhs_indices: *const Array,
            rhs_indices: *const Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            sorted_indices: bool,
        ) -> Result<UniquePtr<Array>>;

        // ---- fast.cc: fused kernels ----
        fn cuda_kernel(
            name: &str,
            input_names: &[String],
            output_names: &[String],
            source: &str,
            header: &str,
            ensure_row_contiguous: bool,
        ) -> Result<UniquePtr<CustomKernelFn>>;
        /// The outputs of a launch whose configuration was launched before (its primitive is
        /// reused), or null: then `custom_kernel_call`, which also takes the template names.
        #[allow(clippy::too_many_arguments)]
        fn custom_kernel_cached(
            kernel: &CustomKernelFn,
            inputs: &CxxVector<Array>,
            output_shapes: &[i32],
            output_ranks: &[i32],
            output_dtypes: &[u8],
            grid: &[i32],
            threadgroup: &[i32],
            template_kinds: &[u8],
            template_values: &[i32],
        ) -> Result<UniquePtr<CxxVector<Array>>>;
        #[allow(clippy::too_many_arguments)]
        fn custom_kernel_call(
            kernel: &CustomKernelFn,
            inputs: &CxxVector<Array>,
            output_shapes: &[i32],
            output_ranks: &[i32],
            output_dtypes: &[u8],
            grid: &[i32],
            threadgroup: &[i32],
            template_names: &[String],
            template_kinds: &[u8],
            template_values: &[i32],
        ) -> Result<UniquePtr<CxxVector<Array>>>;
        unsafe fn rms_norm(x: &Array, weight: *const Array, eps: f32) -> Result<UniquePtr<Array>>;
        unsafe fn layer_norm(
            x: &Array,
            weight: *const Array,
            bias: *const Array,
            eps: f32,
        ) -> Result<UniquePtr<Array>>;
        /// `base` is used when `freqs` is null; `offset` is an int scalar array or a per-batch
        /// vector of offsets.
        unsafe fn rope(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: &Array,
            freqs: *const Array,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn rope_int_offset(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: i32,
            freqs: *const Array,
        ) -> Result<UniquePtr<Array>>;
        /// `mask_mode` is `""` (none or array mask) or `"causal"`; `mask` is null or a bool /
        /// additive mask broadcastable to `[B, H, L, S]`.
        unsafe fn scaled_dot_product_attention(
            queries: &Array,
            keys: &Array,
            values: &Array,
            scale: f32,
            mask_mode: &str,
            mask: *const Array,
            sinks: *const Array,
        ) -> Result<UniquePtr<Array>>;

        // ---- random.cc ----
        fn random_key(seed: u64) -> Result<UniquePtr<Array>>;
        fn random_seed(seed: u64) -> Result<()>;
        fn random_split(key: &Array, num: i32) -> Result<UniquePtr<Array>>;
        unsafe fn random_uniform(
            low: f32,
            high: f32,
            shape: &[i32],
            dtype: Dtype,
            key: *const Array,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_normal(
            shape: &[i32],
            dtype: Dtype,
            loc: f32,
            scale: f32,
            key: *const Array,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_categorical(
            logits: &Array,
            axis: i32,
            key: *const Array,
        ) -> Result<UniquePtr<Array>>;

        // ---- compile.cc ----
        fn compile(closure: Box<RustClosure>, shapeless: bool) -> Result<UniquePtr<CompiledFn>>;
        fn compiled_call(
            f: &CompiledFn,
            inputs: &CxxVector<Array>,
        ) -> Result<UniquePtr<CxxVector<Array>>>;
        fn set_compile_enabled(enabled: bool) -> Result<()>;

        // ---- io.cc: safetensors ----
        fn load_safetensors(path: &str) -> Result<UniquePtr<SafetensorsData>>;
        fn safetensors_names(data: &SafetensorsData) -> Vec<String>;
        fn safetensors_get(data: &SafetensorsData, name: &str) -> Result<UniquePtr<Array>>;
        fn safetensors_metadata(data: &SafetensorsData) -> Vec<StringPair>;
        fn save_safetensors(
            path: &str,
            names: &[String],
            arrays: &CxxVector<Array>,
            metadata: &[StringPair],
        ) -> Result<()>;

        // ---- device.cc: devices, streams, memory, build facts ----
        fn mlx_version() -> String;
        fn backend_name() -> String;
        fn is_available(kind: DeviceKind) -> Result<bool>;
        fn default_device_kind() -> Result<DeviceKind>;
        fn set_default_device(kind: DeviceKind) -> Result<()>;
        fn synchronize() -> Result<()>;
        /// A new GPU stream that any thread may evaluate on (MLX's default streams belong to
        /// the thread that made them); returns its index.
        fn new_shared_gpu_stream() -> Result<i32>;
        /// The index of this thread's default GPU stream.
        fn default_gpu_stream() -> Result<i32>;
        /// Makes GPU stream `index` this thread's default: the ops it builds run there.
        fn set_default_gpu_stream(index: i32) -> Result<()>;
        /// Waits for everything scheduled on GPU stream `index`.
        fn synchronize_gpu_stream(index: i32) -> Result<()>;
        fn device_info(kind: DeviceKind) -> Result<Vec<StringPair>>;
        /// Physical RAM of the host (sysconf), 0 when unknown.
        fn system_memory_bytes() -> usize;
        fn metal_kernels_available() -> bool;
        fn cuda_kernels_available() -> bool;
        /// Sets the environment variable `name` to `value` unless it is set (`setenv` without
        /// overwrite); true when it set it. For MLX's settings read from the environment on
        /// first use.
        fn set_env_default(name: &str, value: &str) -> Result<bool>;
        fn get_active_memory() -> Result<usize>;
        fn get_peak_memory() -> Result<usize>;
        fn reset_peak_memory() -> Result<()>;
        fn get_cache_memory() -> Result<usize>;
        fn get_memory_limit() -> Result<usize>;
        fn set_memory_limit(limit: usize) -> Result<usize>;
        fn set_cache_limit(limit: usize) -> Result<usize>;
        fn set_wired_limit(limit: usize) -> Result<usize>;
        fn clear_cache() -> Result<()>;
    }

    impl UniquePtr<Array> {}
    impl CxxVector<Array> {}
}

pub use ffi::*;

/// The closure behind a compiled function. Built by the `mlx` crate; C++ only holds it.
pub struct RustClosure {
    #[allow(clippy::type_complexity)]
    call: Box<
        dyn Fn(
                &cxx::CxxVector<ffi::Array>,
            ) -> Result<cxx::UniquePtr<cxx::CxxVector<ffi::Array>>, String>
            + Send
            + 'static,
    >,
}

impl RustClosure {
    /// Wraps `call`, which receives the traced inputs and returns the outputs (or an error
    /// message that MLX will see as an exception).
    #[allow(clippy::type_complexity)]
    pub fn new(
        call: Box<
            dyn Fn(
                    &cxx::CxxVector<ffi::Array>,
                ) -> Result<cxx::UniquePtr<cxx::CxxVector<ffi::Array>>, String>
                + Send
                + 'static,
        >,
    ) -> Self {
        Self { call }
    }
}

fn call_rust_closure(
    closure: &RustClosure,
    inputs: &cxx::CxxVector<ffi::Array>,
) -> Result<cxx::UniquePtr<cxx::CxxVector<ffi::Array>>, String> {
    // A panic must not cross into C++ (it would abort): turn it into an error instead.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (closure.call)(inputs))) {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(format!("panic inside a compiled closure: {what}"))
        }
    }
}

// SAFETY: `Array` is `mlx::core::array`, a handle around a `std::shared_ptr` whose reference
// count is atomic; moving a handle to another thread is sound. Concurrent *use* of one graph
// from several threads is not, which is why the safe wrapper is `Send` but not `Sync`.
unsafe impl Send for ffi::Array {}

// SAFETY: `CompiledFn` owns a `std::function` whose state (the traced graph in MLX's compiler
// cache) is arrays and shared pointers; moving it to another thread is as sound as moving an
// array handle. Calling it concurrently with other MLX work is not, which is why the safe
// wrapper is `Send` but not `Sync` (and the engine runs MLX on one thread).
unsafe impl Send for ffi::CompiledFn {}

// SAFETY: as for `CompiledFn`: a `std::function` holding the kernel's name and source.
unsafe impl Send for ffi::CustomKernelFn {}
