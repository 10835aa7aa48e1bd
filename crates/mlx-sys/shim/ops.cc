// Arithmetic, shape, indexing, reduction and creation ops: thin calls into mlx::core.
#include "mlx-sys/src/lib.rs.h"

#include <cmath>
#include <optional>
#include <stdexcept>

namespace quince {

namespace mx = ::mlx::core;

std::unique_ptr<Array> binary(BinaryOp op, const Array& a, const Array& b) {
  switch (op) {
    case BinaryOp::Add: return boxed(mx::add(a, b));
    case BinaryOp::Subtract: return boxed(mx::subtract(a, b));
    case BinaryOp::Multiply: return boxed(mx::multiply(a, b));
    case BinaryOp::Divide: return boxed(mx::divide(a, b));
    case BinaryOp::Power: return boxed(mx::power(a, b));
    case BinaryOp::Maximum: return boxed(mx::maximum(a, b));
    case BinaryOp::Minimum: return boxed(mx::minimum(a, b));
    case BinaryOp::Remainder: return boxed(mx::remainder(a, b));
    case BinaryOp::FloorDivide: return boxed(mx::floor_divide(a, b));
    case BinaryOp::Equal: return boxed(mx::equal(a, b));
    case BinaryOp::NotEqual: return boxed(mx::not_equal(a, b));
    case BinaryOp::Less: return boxed(mx::less(a, b));
    case BinaryOp::LessEqual: return boxed(mx::less_equal(a, b));
    case BinaryOp::Greater: return boxed(mx::greater(a, b));
    case BinaryOp::GreaterEqual: return boxed(mx::greater_equal(a, b));
    case BinaryOp::LogicalAnd: return boxed(mx::logical_and(a, b));
    case BinaryOp::LogicalOr: return boxed(mx::logical_or(a, b));
    case BinaryOp::BitwiseAnd: return boxed(mx::bitwise_and(a, b));
    case BinaryOp::BitwiseOr: return boxed(mx::bitwise_or(a, b));
    case BinaryOp::LeftShift: return boxed(mx::left_shift(a, b));
    case BinaryOp::RightShift: return boxed(mx::right_shift(a, b));
    case BinaryOp::LogAddExp: return boxed(mx::logaddexp(a, b));
  }
  throw std::invalid_argument("unknown binary op");
}

std::unique_ptr<Array> unary(UnaryOp op, const Array& a) {
  switch (op) {
    case UnaryOp::Negative: return boxed(mx::negative(a));
    case UnaryOp::Abs: return boxed(mx::abs(a));
    case UnaryOp::Exp: return boxed(mx::exp(a));
    case UnaryOp::Log: return boxed(mx::log(a));
    case UnaryOp::Log1p: return boxed(mx::log1p(a));
    case UnaryOp::Sqrt: return boxed(mx::sqrt(a));
    case UnaryOp::Rsqrt: return boxed(mx::rsqrt(a));
    case UnaryOp::Square: return boxed(mx::square(a));
    case UnaryOp::Sin: return boxed(mx::sin(a));
    case UnaryOp::Cos: return boxed(mx::cos(a));
    case UnaryOp::Tanh: return boxed(mx::tanh(a));
    case UnaryOp::Sigmoid: return boxed(mx::sigmoid(a));
    case UnaryOp::Erf: return boxed(mx::erf(a));
    case UnaryOp::Floor: return boxed(mx::floor(a));
    case UnaryOp::Ceil: return boxed(mx::ceil(a));
    case UnaryOp::Reciprocal: return boxed(mx::reciprocal(a));
    case UnaryOp::LogicalNot: return boxed(mx::logical_not(a));
    case UnaryOp::StopGradient: return boxed(mx::stop_gradient(a));
    case UnaryOp::Contiguous: return boxed(mx::contiguous(a));
  }
  throw std::invalid_argument("unknown unary op");
}

std::unique_ptr<Array> reduce(ReduceOp op, const Array& a, rust::Slice<const int32_t> axes,
                              bool keepdims) {
  auto ax = to_ints(axes);
  switch (op) {
    case ReduceOp::Sum: return boxed(mx::sum(a, ax, keepdims));
    case ReduceOp::Mean: return boxed(mx::mean(a, ax, keepdims));
    case ReduceOp::Max: return boxed(mx::max(a, ax, keepdims));
    case ReduceOp::Min: return boxed(mx::min(a, ax, keepdims));
    case ReduceOp::Prod: return boxed(mx::prod(a, ax, keepdims));
    case ReduceOp::LogSumExp: return boxed(mx::logsumexp(a, ax, keepdims));
    case ReduceOp::All: return boxed(mx::all(a, ax, keepdims));
    case ReduceOp::Any: return boxed(mx::any(a, ax, keepdims));
  }
  throw std::invalid_argument("unknown reduction");
}

std::unique_ptr<Array> reduce_all(ReduceOp op, const Array& a, bool keepdims) {
  switch (op) {
    case ReduceOp::Sum: return boxed(mx::sum(a, keepdims));
    case ReduceOp::Mean: return boxed(mx::mean(a, keepdims));
    case ReduceOp::Max: return boxed(mx::max(a, keepdims));
    case ReduceOp::Min: return boxed(mx::min(a, keepdims));
    case ReduceOp::Prod: return boxed(mx::prod(a, keepdims));
    case ReduceOp::LogSumExp: return boxed(mx::logsumexp(a, keepdims));
    case ReduceOp::All: return boxed(mx::all(a, keepdims));
    case ReduceOp::Any: return boxed(mx::any(a, keepdims));
  }
  throw std::invalid_argument("unknown reduction");
}

std::unique_ptr<Array> argmax(const Array& a, int32_t axis, bool keepdims) {
  return boxed(mx::argmax(a, axis, keepdims));
}
std::unique_ptr<Array> argmin(const Array& a, int32_t axis, bool keepdims) {
  return boxed(mx::argmin(a, axis, keepdims));
}
std::unique_ptr<Array> matmul(const Array& a, const Array& b) { return boxed(mx::matmul(a, b)); }
std::unique_ptr<Array> gather_mm(const Array& a, const Array& b, const Array* lhs_indices,
                                 const Array* rhs_indices, bool sorted_indices) {
  return boxed(mx::gather_mm(a, b, opt(lhs_indices), opt(rhs_indices), sorted_indices));
}
std::unique_ptr<Array> addmm(const Array& c, const Array& a, const Array& b, float alpha,
                             float beta) {
  return boxed(mx::addmm(c, a, b, alpha, beta));
}
std::unique_ptr<Array> astype(const Array& a, Dtype dtype) {
  return boxed(mx::astype(a, to_mlx(dtype)));
}
std::unique_ptr<Array> reshape(const Array& a, rust::Slice<const int32_t> shape) {
  return boxed(mx::reshape(a, to_shape(shape)));
}
std::unique_ptr<Array> transpose(const Array& a, rust::Slice<const int32_t> axes) {
  return boxed(mx::transpose(a, to_ints(axes)));
}
std::unique_ptr<Array> transpose_all(const Array& a) { return boxed(mx::transpose(a)); }
std::unique_ptr<Array> swapaxes(const Array& a, int32_t axis1, int32_t axis2) {
  return boxed(mx::swapaxes(a, axis1, axis2));
}
std::unique_ptr<Array> expand_dims(const Array& a, rust::Slice<const int32_t> axes) {
  return boxed(mx::expand_dims(a, to_ints(axes)));
}
std::unique_ptr<Array> squeeze(const Array& a, rust::Slice<const int32_t> axes) {
  if (axes.empty()) return boxed(mx::squeeze(a));
  return boxed(mx::squeeze(a, to_ints(axes)));
}
std::unique_ptr<Array> broadcast_to(const Array& a, rust::Slice<const int32_t> shape) {
  return boxed(mx::broadcast_to(a, to_shape(shape)));
}
std::unique_ptr<Array> flatten(const Array& a, int32_t start_axis, int32_t end_axis) {
  return boxed(mx::flatten(a, start_axis, end_axis));
}

std::unique_ptr<Array> unflatten(const Array& a, int32_t axis, rust::Slice<const int32_t> shape) {
  return boxed(mx::unflatten(a, axis, mx::Shape(shape.begin(), shape.end())));
}
std::unique_ptr<Array> concatenate(const std::vector<Array>& arrays, int32_t axis) {
  return boxed(mx::concatenate(arrays, axis));
}
std::unique_ptr<Array> stack(const std::vector<Array>& arrays, int32_t axis) {
  return boxed(mx::stack(arrays, axis));
}
std::unique_ptr<std::vector<Array>> split_sections(const Array& a, int32_t sections,
                                                   int32_t axis) {
  return boxed_vec(mx::split(a, sections, axis));
}
std::unique_ptr<std::vector<Array>> split_indices(const Array& a,
                                                  rust::Slice<const int32_t> indices,
                                                  int32_t axis) {
  return boxed_vec(mx::split(a, to_shape(indices), axis));
}
std::unique_ptr<Array> slice(const Array& a, rust::Slice<const int32_t> start,
                             rust::Slice<const int32_t> stop,
                             rust::Slice<const int32_t> strides) {
  return boxed(mx::slice(a, to_shape(start), to_shape(stop), to_shape(strides)));
}
std::unique_ptr<Array> slice_dynamic(const Array& a, const Array& start,
                                     rust::Slice<const int32_t> axes,
                                     rust::Slice<const int32_t> sizes) {
  return boxed(mx::slice(a, start, to_ints(axes), to_shape(sizes)));
}
std::unique_ptr<Array> slice_update(const Array& src, const Array& update,
                                    rust::Slice<const int32_t> start,
                                    rust::Slice<const int32_t> stop,
                                    rust::Slice<const int32_t> strides) {
  return boxed(
      mx::slice_update(src, update, to_shape(start), to_shape(stop), to_shape(strides)));
}
std::unique_ptr<Array> slice_update_dynamic(const Array& src, const Array& update,
                                            const Array& start,
                                            rust::Slice<const int32_t> axes) {
  return boxed(mx::slice_update(src, update, start, to_ints(axes)));
}
std::unique_ptr<Array> take(const Array& a, const Array& indices, int32_t axis) {
  return boxed(mx::take(a, indices, axis));
}
std::unique_ptr<Array> take_flat(const Array& a, const Array& indices) {
  return boxed(mx::take(a, indices));
}
std::unique_ptr<Array> take_along_axis(const Array& a, const Array& indices, int32_t axis) {
  return boxed(mx::take_along_axis(a, indices, axis));
}
std::unique_ptr<Array> put_along_axis(const Array& a, const Array& indices, const Array& values,
                                      int32_t axis) {
  return boxed(mx::put_along_axis(a, indices, values, axis));
}
std::unique_ptr<Array> where_(const Array& condition, const Array& x, const Array& y) {
  return boxed(mx::where(condition, x, y));
}
std::unique_ptr<Array> softmax(const Array& a, rust::Slice<const int32_t> axes, bool precise) {
  return boxed(mx::softmax(a, to_ints(axes), precise));
}

std::unique_ptr<Array> hadamard_transform(const Array& a, float scale) {
  std::optional<float> s;
  if (!std::isnan(scale)) s = scale;
  return boxed(mx::hadamard_transform(a, s));
}
std::unique_ptr<Array> argpartition(const Array& a, int32_t kth, int32_t axis) {
  return boxed(mx::argpartition(a, kth, axis));
}
std::unique_ptr<Array> partition(const Array& a, int32_t kth, int32_t axis) {
  return boxed(mx::partition(a, kth, axis));
}
std::unique_ptr<Array> topk(const Array& a, int32_t k, int32_t axis) {
  return boxed(mx::topk(a, k, axis));
}
std::unique_ptr<Array> sort(const Array& a, int32_t axis) { return boxed(mx::sort(a, axis)); }
std::unique_ptr<Array> argsort(const Array& a, int32_t axis) {
  return boxed(mx::argsort(a, axis));
}
std::unique_ptr<Array> cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive) {
  return boxed(mx::cumsum(a, axis, reverse, inclusive));
}
std::unique_ptr<Array> arange(double start, double stop, double step, Dtype dtype) {
  return boxed(mx::arange(start, stop, step, to_mlx(dtype)));
}
std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, Dtype dtype) {
  return boxed(mx::zeros(to_shape(shape), to_mlx(dtype)));
}
std::unique_ptr<Array> ones(rust::Slice<const int32_t> shape, Dtype dtype) {
  return boxed(mx::ones(to_shape(shape), to_mlx(dtype)));
}
std::unique_ptr<Array> full(rust::Slice<const int32_t> shape, const Array& value, Dtype dtype) {
  return boxed(mx::full(to_shape(shape), value, to_mlx(dtype)));
}
std::unique_ptr<Array> tri(int32_t n, int32_t m, int32_t k, Dtype dtype) {
  return boxed(mx::tri(n, m, k, to_mlx(dtype)));
}
std::unique_ptr<Array> tril(const Array& a, int32_t k) { return boxed(mx::tril(a, k)); }
std::unique_ptr<Array> triu(const Array& a, int32_t k) { return boxed(mx::triu(a, k)); }
std::unique_ptr<Array> pad(const Array& a, rust::Slice<const int32_t> axes,
                           rust::Slice<const int32_t> low, rust::Slice<const int32_t> high,
                           const Array& value) {
  return boxed(mx::pad(a, to_ints(axes), to_shape(low), to_shape(high), value));
}
std::unique_ptr<Array> conv1d(const Array& input, const Array& weight, int32_t stride,
                              int32_t padding, int32_t dilation, int32_t groups) {
  return boxed(mx::conv1d(input, weight, stride, padding, dilation, groups));
}
std::unique_ptr<Array> einsum(rust::Str subscripts, const std::vector<Array>& operands) {
  return boxed(mx::einsum(std::string(subscripts), operands));
}
std::unique_ptr<Array> array_equal(const Array& a, const Array& b, bool equal_nan) {
  return boxed(mx::array_equal(a, b, equal_nan));
}
std::unique_ptr<Array> isclose(const Array& a, const Array& b, double rtol, double atol) {
  return boxed(mx::isclose(a, b, rtol, atol));
}
std::unique_ptr<Array> clip(const Array& a, const Array& min, const Array& max) {
  return boxed(mx::clip(a, min, max));
}

}  // namespace quince
