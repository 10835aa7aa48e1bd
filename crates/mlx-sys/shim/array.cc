// Creation, inspection and evaluation of arrays, plus the conversions the other files share.
#include "mlx-sys/src/lib.rs.h"

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "mlx/primitives.h"

namespace quince {

namespace mx = ::mlx::core;

mx::Dtype to_mlx(Dtype dtype) {
  switch (dtype) {
    case Dtype::Bool: return mx::bool_;
    case Dtype::Uint8: return mx::uint8;
    case Dtype::Uint16: return mx::uint16;
    case Dtype::Uint32: return mx::uint32;
    case Dtype::Uint64: return mx::uint64;
    case Dtype::Int8: return mx::int8;
    case Dtype::Int16: return mx::int16;
    case Dtype::Int32: return mx::int32;
    case Dtype::Int64: return mx::int64;
    case Dtype::Float16: return mx::float16;
    case Dtype::Float32: return mx::float32;
    case Dtype::Float64: return mx::float64;
    case Dtype::Bfloat16: return mx::bfloat16;
    case Dtype::Complex64: return mx::complex64;
  }
  throw std::invalid_argument("unknown dtype code");
}

Dtype from_mlx(mx::Dtype dtype) {
  switch (dtype.val()) {
    case mx::Dtype::Val::bool_: return Dtype::Bool;
    case mx::Dtype::Val::uint8: return Dtype::Uint8;
    case mx::Dtype::Val::uint16: return Dtype::Uint16;
    case mx::Dtype::Val::uint32: return Dtype::Uint32;
    case mx::Dtype::Val::uint64: return Dtype::Uint64;
    case mx::Dtype::Val::int8: return Dtype::Int8;
    case mx::Dtype::Val::int16: return Dtype::Int16;
    case mx::Dtype::Val::int32: return Dtype::Int32;
    case mx::Dtype::Val::int64: return Dtype::Int64;
    case mx::Dtype::Val::float16: return Dtype::Float16;
    case mx::Dtype::Val::float32: return Dtype::Float32;
    case mx::Dtype::Val::float64: return Dtype::Float64;
    case mx::Dtype::Val::bfloat16: return Dtype::Bfloat16;
    case mx::Dtype::Val::complex64: return Dtype::Complex64;
  }
  return Dtype::Float32;  // unreachable: the switch covers every MLX dtype
}

mx::Shape to_shape(rust::Slice<const int32_t> shape) {
  return mx::Shape(shape.begin(), shape.end());
}

std::vector<int> to_ints(rust::Slice<const int32_t> values) {
  return std::vector<int>(values.begin(), values.end());
}

std::unique_ptr<std::vector<Array>> boxed_vec(std::vector<Array> v) {
  return std::make_unique<std::vector<Array>>(std::move(v));
}

namespace {
template <typename T>
Array from_typed(const uint8_t* data, mx::Shape shape, mx::Dtype dtype) {
  // The bytes are host memory in the element type's own layout; MLX copies them.
  return Array(reinterpret_cast<const T*>(data), std::move(shape), dtype);
}
}  // namespace

std::unique_ptr<Array> array_from_bytes(rust::Slice<const uint8_t> data,
                                        rust::Slice<const int32_t> shape, Dtype dtype) {
  auto mdtype = to_mlx(dtype);
  auto mshape = to_shape(shape);
  size_t count = 1;
  for (auto d : mshape) {
    if (d < 0) throw std::invalid_argument("[array] negative dimension in shape");
    count *= static_cast<size_t>(d);
  }
  if (count * mx::size_of(mdtype) != data.size()) {
    std::ostringstream msg;
    msg << "[array] " << data.size() << " bytes do not hold " << count << " elements of "
        << mdtype;
    throw std::invalid_argument(msg.str());
  }
  const uint8_t* p = data.data();
  switch (mdtype.val()) {
    case mx::Dtype::Val::bool_: return boxed(from_typed<bool>(p, mshape, mdtype));
    case mx::Dtype::Val::uint8: return boxed(from_typed<uint8_t>(p, mshape, mdtype));
    case mx::Dtype::Val::uint16: return boxed(from_typed<uint16_t>(p, mshape, mdtype));
    case mx::Dtype::Val::uint32: return boxed(from_typed<uint32_t>(p, mshape, mdtype));
    case mx::Dtype::Val::uint64: return boxed(from_typed<uint64_t>(p, mshape, mdtype));
    case mx::Dtype::Val::int8: return boxed(from_typed<int8_t>(p, mshape, mdtype));
    case mx::Dtype::Val::int16: return boxed(from_typed<int16_t>(p, mshape, mdtype));
    case mx::Dtype::Val::int32: return boxed(from_typed<int32_t>(p, mshape, mdtype));
    case mx::Dtype::Val::int64: return boxed(from_typed<int64_t>(p, mshape, mdtype));
    case mx::Dtype::Val::float16: return boxed(from_typed<mx::float16_t>(p, mshape, mdtype));
    case mx::Dtype::Val::float32: return boxed(from_typed<float>(p, mshape, mdtype));
    case mx::Dtype::Val::float64: return boxed(from_typed<double>(p, mshape, mdtype));
    case mx::Dtype::Val::bfloat16: return boxed(from_typed<mx::bfloat16_t>(p, mshape, mdtype));
    case mx::Dtype::Val::complex64: return boxed(from_typed<mx::complex64_t>(p, mshape, mdtype));
  }
  throw std::invalid_argument("[array] unsupported dtype");
}

std::unique_ptr<Array> array_scalar_f64(double value, Dtype dtype) {
  // MLX converts the value to `dtype` element-wise, like a C++ static_cast.
  return boxed(Array(value, to_mlx(dtype)));
}

std::unique_ptr<Array> array_scalar_i64(int64_t value, Dtype dtype) {
  return boxed(Array(value, to_mlx(dtype)));
}

std::unique_ptr<Array> array_scalar_bool(bool value) { return boxed(Array(value)); }

std::unique_ptr<Array> array_clone(const Array& a) { return std::make_unique<Array>(a); }
size_t array_ndim(const Array& a) { return a.ndim(); }
rust::Vec<int32_t> array_shape(const Array& a) {
  rust::Vec<int32_t> out;
  out.reserve(a.ndim());
  for (auto d : a.shape()) out.push_back(d);
  return out;
}
size_t array_size(const Array& a) { return a.size(); }
size_t array_nbytes(const Array& a) { return a.nbytes(); }
Dtype array_dtype(const Array& a) { return from_mlx(a.dtype()); }
size_t array_id(const Array& a) { return a.id(); }

rust::String array_to_string(const Array& a) {
  std::ostringstream out;
  out << a;
  return rust::String(out.str());
}

void array_copy_to(const Array& a, rust::Slice<uint8_t> out) {
  // Wait for `a` itself. A dense row-major result is read in place: adding an op here would
  // queue it behind work scheduled after `a` (the next decode step) and wait for that too.
  Array c = a;
  c.eval();
  if (!(c.flags().row_contiguous && c.data_size() == c.size())) {
    c = mx::contiguous(c, false);
    c.eval();
  }
  if (out.size() != c.nbytes()) {
    throw std::invalid_argument("[array_copy_to] output buffer has the wrong length");
  }
  if (c.nbytes() > 0) std::memcpy(out.data(), c.data<uint8_t>(), c.nbytes());
}

void eval(const std::vector<Array>& arrays) { mx::eval(arrays); }
void async_eval(const std::vector<Array>& arrays) { mx::async_eval(arrays); }

void array_wait(const Array& a) {
  Array handle = a;  // shares the node; `wait` is not const
  handle.wait();
}
void eval_one(const Array& a) { mx::eval({a}); }

rust::Vec<rust::String> graph_census(const std::vector<Array>& arrays) {
  rust::Vec<rust::String> names;
  std::unordered_set<std::uintptr_t> seen;
  std::vector<mx::array> stack(arrays.begin(), arrays.end());
  while (!stack.empty()) {
    mx::array a = stack.back();
    stack.pop_back();
    if (a.status() != mx::array::Status::unscheduled || !a.has_primitive()) continue;
    if (!seen.insert(a.id()).second) continue;
    // Siblings (the other outputs of a multi-output node) are the same node. Nodes are told
    // apart by array, not by primitive: compiled functions share one primitive across calls.
    for (const auto& sibling : a.siblings()) seen.insert(sibling.id());
    names.push_back(rust::String(a.primitive().name()));
    for (const auto& input : a.inputs()) stack.push_back(input);
  }
  return names;
}

std::unique_ptr<std::vector<Array>> vec_new() { return std::make_unique<std::vector<Array>>(); }
void vec_push(std::vector<Array>& v, const Array& a) { v.push_back(a); }
std::unique_ptr<Array> vec_get(const std::vector<Array>& v, size_t index) {
  if (index >= v.size()) throw std::out_of_range("[vec_get] index out of range");
  return boxed(v[index]);
}

}  // namespace quince
