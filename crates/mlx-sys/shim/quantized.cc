// Affine quantization: quantize / dequantize / quantized_matmul / gather_qmm.
#include "mlx-sys/src/lib.rs.h"

namespace quince {

namespace mx = ::mlx::core;

std::unique_ptr<std::vector<Array>> quantize(const Array& w, int32_t group_size, int32_t bits) {
  return boxed_vec(mx::quantize(w, group_size, bits, "affine"));
}

std::unique_ptr<Array> dequantize(const Array& w, const Array& scales, const Array* biases,
                                  int32_t group_size, int32_t bits) {
  return boxed(mx::dequantize(w, scales, opt(biases), group_size, bits, "affine"));
}

std::unique_ptr<Array> quantized_matmul(const Array& x, const Array& w, const Array& scales,
                                        const Array* biases, bool transpose, int32_t group_size,
                                        int32_t bits) {
  return boxed(
      mx::quantized_matmul(x, w, scales, opt(biases), transpose, group_size, bits, "affine"));
}

std::unique_ptr<Array> gather_qmm(const Array& x, const Array& w, const Array& scales,
                                  const Array* biases, const Array* lhs_indices,
                                  const Array* rhs_indices, bool transpose, int32_t group_size,
                                  int32_t bits, bool sorted_indices) {
  return boxed(mx::gather_qmm(x, w, scales, opt(biases), opt(lhs_indices), opt(rhs_indices),
                              transpose, group_size, bits, "affine", std::nullopt,
                              sorted_indices));
}

}  // namespace quince
