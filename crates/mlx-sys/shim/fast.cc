// Fused kernels from mlx::core::fast: norms, rope, scaled dot-product attention.
#include "mlx-sys/src/lib.rs.h"

namespace quince {

namespace mx = ::mlx::core;

std::unique_ptr<Array> rms_norm(const Array& x, const Array* weight, float eps) {
  return boxed(mx::fast::rms_norm(x, opt(weight), eps));
}

std::unique_ptr<Array> layer_norm(const Array& x, const Array* weight, const Array* bias,
                                  float eps) {
  return boxed(mx::fast::layer_norm(x, opt(weight), opt(bias), eps));
}

namespace {
// MLX takes either a base or explicit frequencies, never both.
std::optional<float> rope_base(float base, const Array* freqs) {
  return freqs ? std::nullopt : std::optional<float>(base);
}
}  // namespace

std::unique_ptr<Array> rope(const Array& x, int32_t dims, bool traditional, float base,
                            float scale, const Array& offset, const Array* freqs) {
  return boxed(mx::fast::rope(x, dims, traditional, rope_base(base, freqs), scale, offset,
                              opt(freqs)));
}

std::unique_ptr<Array> rope_int_offset(const Array& x, int32_t dims, bool traditional, float base,
                                       float scale, int32_t offset, const Array* freqs) {
  return boxed(mx::fast::rope(x, dims, traditional, rope_base(base, freqs), scale, offset,
                              opt(freqs)));
}

std::unique_ptr<Array> scaled_dot_product_attention(const Array& queries, const Array& keys,
                                                    const Array& values, float scale,
                                                    rust::Str mask_mode, const Array* mask,
                                                    const Array* sinks) {
  return boxed(mx::fast::scaled_dot_product_attention(
      queries, keys, values, scale, std::string(mask_mode), opt(mask), opt(sinks)));
}

}  // namespace quince
