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

namespace {
std::vector<std::string> strings(rust::Slice<const rust::String> names) {
  std::vector<std::string> out;
  out.reserve(names.size());
  for (const auto& n : names) {
    out.emplace_back(std::string(n));
  }
  return out;
}
}  // namespace

std::unique_ptr<CustomKernelFn> cuda_kernel(rust::Str name,
                                            rust::Slice<const rust::String> input_names,
                                            rust::Slice<const rust::String> output_names,
                                            rust::Str source, rust::Str header,
                                            bool ensure_row_contiguous) {
  return std::make_unique<CustomKernelFn>(CustomKernelFn{mx::fast::cuda_kernel(
      std::string(name), strings(input_names), strings(output_names), std::string(source),
      std::string(header), ensure_row_contiguous),
                                           {}});
}

std::unique_ptr<std::vector<Array>> custom_kernel_call(
    const CustomKernelFn& kernel, const std::vector<Array>& inputs,
    rust::Slice<const int32_t> output_shapes, rust::Slice<const int32_t> output_ranks,
    rust::Slice<const uint8_t> output_dtypes, rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> threadgroup, rust::Slice<const rust::String> template_names,
    rust::Slice<const uint8_t> template_kinds, rust::Slice<const int32_t> template_values) {
  if (grid.size() != 3 || threadgroup.size() != 3 || output_ranks.size() != output_dtypes.size() ||
      template_names.size() != template_kinds.size() ||
      template_names.size() != template_values.size()) {
    throw std::invalid_argument("[custom_kernel_call] mismatched argument lengths");
  }
  std::vector<mx::Shape> shapes;
  size_t at = 0;
  for (int32_t rank : output_ranks) {
    if (rank < 0 || at + static_cast<size_t>(rank) > output_shapes.size()) {
      throw std::invalid_argument("[custom_kernel_call] output shapes do not match their ranks");
    }
    shapes.emplace_back(output_shapes.begin() + at, output_shapes.begin() + at + rank);
    at += static_cast<size_t>(rank);
  }
  std::vector<mx::Dtype> dtypes;
  for (uint8_t d : output_dtypes) {
    dtypes.push_back(to_mlx(static_cast<Dtype>(d)));
  }
  // Everything the primitive (its generated source, grid and block) depends on.
  std::string key;
  key.reserve(128);
  auto put = [&key](int64_t v) {
    key += std::to_string(v);
    key += ',';
  };
  for (size_t i = 0; i < template_values.size(); ++i) {
    put(template_kinds[i]);
    put(template_values[i]);
  }
  for (size_t i = 0; i < 3; ++i) {
    put(grid[i]);
    put(threadgroup[i]);
  }
  for (const auto& in : inputs) {
    put(static_cast<int64_t>(in.dtype().val()));
    put(static_cast<int64_t>(in.ndim()));
  }
  for (size_t i = 0; i < dtypes.size(); ++i) {
    put(static_cast<int64_t>(dtypes[i].val()));
  }
  // A primitive runs on the stream it was made on: one per stream (a thread's default stream
  // is that thread's alone, and a decode loop may build on a shared one).
  put(mx::default_stream(mx::default_device()).index);
  auto& cache = kernel.primitives;
  if (auto hit = cache.find(key); hit != cache.end()) {
    return boxed_vec(Array::make_arrays(std::move(shapes), dtypes, hit->second, inputs));
  }
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> args;
  for (size_t i = 0; i < template_names.size(); ++i) {
    std::string name(template_names[i]);
    switch (template_kinds[i]) {
      case 0: args.emplace_back(name, static_cast<int>(template_values[i])); break;
      case 1: args.emplace_back(name, template_values[i] != 0); break;
      case 2:
        args.emplace_back(name, to_mlx(static_cast<Dtype>(template_values[i])));
        break;
      default: throw std::invalid_argument("[custom_kernel_call] unknown template argument kind");
    }
  }
  auto outputs = kernel.fn(inputs, shapes, dtypes, {grid[0], grid[1], grid[2]},
                          {threadgroup[0], threadgroup[1], threadgroup[2]}, args, std::nullopt,
                          false, {});
  if (!outputs.empty() && outputs[0].has_primitive()) {
    cache.emplace(std::move(key), outputs[0].primitive_ptr());
  }
  return boxed_vec(std::move(outputs));
}

}  // namespace quince
