// The C++ side of the mlx-sys bridge: declarations for the shim functions (one .cc per area).
// Every function is a thin call into mlx::core; cxx turns exceptions into Rust errors for the
// functions declared `-> Result` in src/lib.rs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace quince {

using Array = ::mlx::core::array;

// `mlx::core::compile` returns a std::function; we keep it behind an opaque handle.
struct CompiledFn {
  std::function<std::vector<Array>(const std::vector<Array>&)> fn;
};

// A custom GPU kernel (`mlx::core::fast::cuda_kernel`), also a std::function.
// Hashes a custom kernel's launch key (`custom_kernel_call`).
struct LaunchKeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept;
};

struct CustomKernelFn {
  ::mlx::core::fast::CustomKernelFunction fn;
  // The primitive of each launch configuration seen so far (template arguments, grid, block,
  // input and output dtypes and ranks, stream), keyed by those values as integers: MLX's
  // function builds the kernel's whole source string on every call, several µs of host time;
  // a later call with the same configuration makes its outputs from the same (immutable)
  // primitive instead.
  mutable std::unordered_map<std::vector<int64_t>, std::shared_ptr<::mlx::core::Primitive>,
                             LaunchKeyHash>
      primitives;
};

struct SafetensorsData {
  std::unordered_map<std::string, Array> arrays;
  std::unordered_map<std::string, std::string> metadata;
};

struct RustClosure;
enum class Dtype : uint8_t;
enum class BinaryOp : uint8_t;
enum class UnaryOp : uint8_t;
enum class ReduceOp : uint8_t;
enum class DeviceKind : uint8_t;
struct StringPair;

// Conversions shared by the .cc files.
::mlx::core::Dtype to_mlx(Dtype dtype);
Dtype from_mlx(::mlx::core::Dtype dtype);
::mlx::core::Shape to_shape(rust::Slice<const int32_t> shape);
std::vector<int> to_ints(rust::Slice<const int32_t> values);
inline std::unique_ptr<Array> boxed(Array a) {
  return std::make_unique<Array>(std::move(a));
}
inline std::optional<Array> opt(const Array* a) {
  return a ? std::optional<Array>(*a) : std::nullopt;
}
std::unique_ptr<std::vector<Array>> boxed_vec(std::vector<Array> v);

// array.cc
std::unique_ptr<Array> array_from_bytes(rust::Slice<const uint8_t> data,
                                        rust::Slice<const int32_t> shape, Dtype dtype);
std::unique_ptr<Array> array_scalar_f64(double value, Dtype dtype);
std::unique_ptr<Array> array_scalar_i64(int64_t value, Dtype dtype);
std::unique_ptr<Array> array_scalar_bool(bool value);
std::unique_ptr<Array> array_clone(const Array& a);
size_t array_ndim(const Array& a);
rust::Vec<int32_t> array_shape(const Array& a);
size_t array_size(const Array& a);
size_t array_nbytes(const Array& a);
Dtype array_dtype(const Array& a);
size_t array_id(const Array& a);
rust::String array_to_string(const Array& a);
void array_copy_to(const Array& a, rust::Slice<uint8_t> out);
void eval(const std::vector<Array>& arrays);
void async_eval(const std::vector<Array>& arrays);
void array_wait(const Array& a);
rust::Vec<rust::String> graph_census(const std::vector<Array>& arrays);
void eval_one(const Array& a);
std::unique_ptr<std::vector<Array>> vec_new();
void vec_push(std::vector<Array>& v, const Array& a);
std::unique_ptr<Array> vec_get(const std::vector<Array>& v, size_t index);

// ops.cc
std::unique_ptr<Array> binary(BinaryOp op, const Array& a, const Array& b);
std::unique_ptr<Array> unary(UnaryOp op, const Array& a);
std::unique_ptr<Array> reduce(ReduceOp op, const Array& a, rust::Slice<const int32_t> axes,
                              bool keepdims);
std::unique_ptr<Array> reduce_all(ReduceOp op, const Array& a, bool keepdims);
std::unique_ptr<Array> argmax(const Array& a, int32_t axis, bool keepdims);
std::unique_ptr<Array> argmin(const Array& a, int32_t axis, bool keepdims);
std::unique_ptr<Array> matmul(const Array& a, const Array& b);
std::unique_ptr<Array> gather_mm(const Array& a, const Array& b, const Array* lhs_indices,
                                 const Array* rhs_indices, bool sorted_indices);
std::unique_ptr<Array> addmm(const Array& c, const Array& a, const Array& b, float alpha,
                             float beta);
std::unique_ptr<Array> astype(const Array& a, Dtype dtype);
std::unique_ptr<Array> reshape(const Array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> transpose(const Array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> transpose_all(const Array& a);
std::unique_ptr<Array> swapaxes(const Array& a, int32_t axis1, int32_t axis2);
std::unique_ptr<Array> expand_dims(const Array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> squeeze(const Array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> broadcast_to(const Array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> flatten(const Array& a, int32_t start_axis, int32_t end_axis);
std::unique_ptr<Array> unflatten(const Array& a, int32_t axis, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> concatenate(const std::vector<Array>& arrays, int32_t axis);
std::unique_ptr<Array> stack(const std::vector<Array>& arrays, int32_t axis);
std::unique_ptr<std::vector<Array>> split_sections(const Array& a, int32_t sections, int32_t axis);
std::unique_ptr<std::vector<Array>> split_indices(const Array& a,
                                                  rust::Slice<const int32_t> indices, int32_t axis);
std::unique_ptr<Array> slice(const Array& a, rust::Slice<const int32_t> start,
                             rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
std::unique_ptr<Array> slice_dynamic(const Array& a, const Array& start,
                                     rust::Slice<const int32_t> axes,
                                     rust::Slice<const int32_t> sizes);
std::unique_ptr<Array> slice_update(const Array& src, const Array& update,
                                    rust::Slice<const int32_t> start,
                                    rust::Slice<const int32_t> stop,
                                    rust::Slice<const int32_t> strides);
std::unique_ptr<Array> slice_update_dynamic(const Array& src, const Array& update,
                                            const Array& start, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> take(const Array& a, const Array& indices, int32_t axis);
std::unique_ptr<Array> take_flat(const Array& a, const Array& indices);
std::unique_ptr<Array> take_along_axis(const Array& a, const Array& indices, int32_t axis);
std::unique_ptr<Array> put_along_axis(const Array& a, const Array& indices, const Array& values,
                                      int32_t axis);
std::unique_ptr<Array> where_(const Array& condition, const Array& x, const Array& y);
std::unique_ptr<Array> softmax(const Array& a, rust::Slice<const int32_t> axes, bool precise);
std::unique_ptr<Array> hadamard_transform(const Array& a, float scale);
std::unique_ptr<Array> argpartition(const Array& a, int32_t kth, int32_t axis);
std::unique_ptr<Array> partition(const Array& a, int32_t kth, int32_t axis);
std::unique_ptr<Array> topk(const Array& a, int32_t k, int32_t axis);
std::unique_ptr<Array> sort(const Array& a, int32_t axis);
std::unique_ptr<Array> argsort(const Array& a, int32_t axis);
std::unique_ptr<Array> cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive);
std::unique_ptr<Array> arange(double start, double stop, double step, Dtype dtype);
std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, Dtype dtype);
std::unique_ptr<Array> ones(rust::Slice<const int32_t> shape, Dtype dtype);
std::unique_ptr<Array> full(rust::Slice<const int32_t> shape, const Array& value, Dtype dtype);
std::unique_ptr<Array> tri(int32_t n, int32_t m, int32_t k, Dtype dtype);
std::unique_ptr<Array> tril(const Array& a, int32_t k);
std::unique_ptr<Array> triu(const Array& a, int32_t k);
std::unique_ptr<Array> pad(const Array& a, rust::Slice<const int32_t> axes,
                           rust::Slice<const int32_t> low, rust::Slice<const int32_t> high,
                           const Array& value);
std::unique_ptr<Array> conv1d(const Array& input, const Array& weight, int32_t stride,
                              int32_t padding, int32_t dilation, int32_t groups);
std::unique_ptr<Array> einsum(rust::Str subscripts, const std::vector<Array>& operands);
std::unique_ptr<Array> array_equal(const Array& a, const Array& b, bool equal_nan);
std::unique_ptr<Array> isclose(const Array& a, const Array& b, double rtol, double atol);
std::unique_ptr<Array> clip(const Array& a, const Array& min, const Array& max);

// quantized.cc
std::unique_ptr<std::vector<Array>> quantize(const Array& w, int32_t group_size, int32_t bits);
std::unique_ptr<Array> dequantize(const Array& w, const Array& scales, const Array* biases,
                                  int32_t group_size, int32_t bits);
std::unique_ptr<Array> quantized_matmul(const Array& x, const Array& w, const Array& scales,
                                        const Array* biases, bool transpose, int32_t group_size,
                                        int32_t bits);
std::unique_ptr<Array> gather_qmm(const Array& x, const Array& w, const Array& scales,
                                  const Array* biases, const Array* lhs_indices,
                                  const Array* rhs_indices, bool transpose, int32_t group_size,
                                  int32_t bits, bool sorted_indices);

// fast.cc
std::unique_ptr<Array> rms_norm(const Array& x, const Array* weight, float eps);
std::unique_ptr<Array> layer_norm(const Array& x, const Array* weight, const Array* bias,
                                  float eps);
std::unique_ptr<Array> rope(const Array& x, int32_t dims, bool traditional, float base,
                            float scale, const Array& offset, const Array* freqs);
std::unique_ptr<Array> rope_int_offset(const Array& x, int32_t dims, bool traditional, float base,
                                       float scale, int32_t offset, const Array* freqs);
std::unique_ptr<Array> scaled_dot_product_attention(const Array& queries, const Array& keys,
                                                    const Array& values, float scale,
                                                    rust::Str mask_mode, const Array* mask,
                                                    const Array* sinks);

std::unique_ptr<CustomKernelFn> cuda_kernel(rust::Str name,
                                            rust::Slice<const rust::String> input_names,
                                            rust::Slice<const rust::String> output_names,
                                            rust::Str source, rust::Str header,
                                            bool ensure_row_contiguous);
std::unique_ptr<std::vector<Array>> custom_kernel_cached(
    const CustomKernelFn& kernel, const std::vector<Array>& inputs,
    rust::Slice<const int32_t> output_shapes, rust::Slice<const int32_t> output_ranks,
    rust::Slice<const uint8_t> output_dtypes, rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> threadgroup, rust::Slice<const uint8_t> template_kinds,
    rust::Slice<const int32_t> template_values);
std::unique_ptr<std::vector<Array>> custom_kernel_call(
    const CustomKernelFn& kernel, const std::vector<Array>& inputs,
    rust::Slice<const int32_t> output_shapes, rust::Slice<const int32_t> output_ranks,
    rust::Slice<const uint8_t> output_dtypes, rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> threadgroup, rust::Slice<const rust::String> template_names,
    rust::Slice<const uint8_t> template_kinds, rust::Slice<const int32_t> template_values);

// random.cc
std::unique_ptr<Array> random_key(uint64_t seed);
void random_seed(uint64_t seed);
std::unique_ptr<Array> random_split(const Array& key, int32_t num);
std::unique_ptr<Array> random_uniform(float low, float high, rust::Slice<const int32_t> shape,
                                      Dtype dtype, const Array* key);
std::unique_ptr<Array> random_normal(rust::Slice<const int32_t> shape, Dtype dtype, float loc,
                                     float scale, const Array* key);
std::unique_ptr<Array> random_categorical(const Array& logits, int32_t axis, const Array* key);

// compile.cc
std::unique_ptr<CompiledFn> compile(rust::Box<RustClosure> closure, bool shapeless);
std::unique_ptr<std::vector<Array>> compiled_call(const CompiledFn& f,
                                                  const std::vector<Array>& inputs);
void set_compile_enabled(bool enabled);

// io.cc
std::unique_ptr<SafetensorsData> load_safetensors(rust::Str path);
rust::Vec<rust::String> safetensors_names(const SafetensorsData& data);
std::unique_ptr<Array> safetensors_get(const SafetensorsData& data, rust::Str name);
rust::Vec<StringPair> safetensors_metadata(const SafetensorsData& data);
void save_safetensors(rust::Str path, rust::Slice<const rust::String> names,
                      const std::vector<Array>& arrays, rust::Slice<const StringPair> metadata);

// device.cc
rust::String mlx_version();
rust::String backend_name();
bool is_available(DeviceKind kind);
DeviceKind default_device_kind();
void set_default_device(DeviceKind kind);
int32_t new_shared_gpu_stream();
int32_t default_gpu_stream();
void set_default_gpu_stream(int32_t index);
void synchronize_gpu_stream(int32_t index);
void synchronize();
rust::Vec<StringPair> device_info(DeviceKind kind);
size_t system_memory_bytes();
bool metal_kernels_available();
bool cuda_kernels_available();
bool set_env_default(rust::Str name, rust::Str value);
size_t get_active_memory();
size_t get_peak_memory();
void reset_peak_memory();
size_t get_cache_memory();
size_t get_memory_limit();
size_t set_memory_limit(size_t limit);
size_t set_cache_limit(size_t limit);
size_t set_wired_limit(size_t limit);
void clear_cache();

}  // namespace quince
