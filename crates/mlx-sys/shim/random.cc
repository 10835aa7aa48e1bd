// Random numbers from explicit keys (or MLX's global key when none is given).
#include "mlx-sys/src/lib.rs.h"

namespace quince {

namespace mx = ::mlx::core;

std::unique_ptr<Array> random_key(uint64_t seed) { return boxed(mx::random::key(seed)); }
void random_seed(uint64_t seed) { mx::random::seed(seed); }
std::unique_ptr<Array> random_split(const Array& key, int32_t num) {
  return boxed(mx::random::split(key, num));
}
std::unique_ptr<Array> random_uniform(float low, float high, rust::Slice<const int32_t> shape,
                                      Dtype dtype, const Array* key) {
  return boxed(mx::random::uniform(Array(low), Array(high), to_shape(shape), to_mlx(dtype),
                                   opt(key)));
}
std::unique_ptr<Array> random_normal(rust::Slice<const int32_t> shape, Dtype dtype, float loc,
                                     float scale, const Array* key) {
  return boxed(mx::random::normal(to_shape(shape), to_mlx(dtype), loc, scale, opt(key)));
}
std::unique_ptr<Array> random_categorical(const Array& logits, int32_t axis, const Array* key) {
  return boxed(mx::random::categorical(logits, axis, opt(key)));
}

}  // namespace quince
