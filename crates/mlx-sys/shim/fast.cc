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

namespace {
// The launch configuration of a call as integers: everything the primitive (its generated
// source, grid and block) depends on. Built into one buffer per thread, so a call that finds
// its primitive allocates nothing for its key.
const std::vector<int64_t>& launch_key(const std::vector<Array>& inputs,
                                       rust::Slice<const uint8_t> output_dtypes,
                                       rust::Slice<const int32_t> grid,
                                       rust::Slice<const int32_t> threadgroup,
                                       rust::Slice<const uint8_t> template_kinds,
                                       rust::Slice<const int32_t> template_values) {
  if (grid.size() != 3 || threadgroup.size() != 3 ||
      template_kinds.size() != template_values.size()) {
    throw std::invalid_argument("[custom_kernel_call] mismatched argument lengths");
  }
  thread_local std::vector<int64_t> key;
  key.clear();
  for (size_t i = 0; i < template_values.size(); ++i) {
    key.push_back(template_kinds[i]);
    key.push_back(template_values[i]);
  }
  for (size_t i = 0; i < 3; ++i) {
    key.push_back(grid[i]);
    key.push_back(threadgroup[i]);
  }
  for (const auto& in : inputs) {
    key.push_back(static_cast<int64_t>(in.dtype().val()));
    key.push_back(static_cast<int64_t>(in.ndim()));
  }
  for (uint8_t d : output_dtypes) {
    key.push_back(d);
  }
  // A primitive runs on the stream it was made on: one per stream (a thread's default stream
  // is that thread's alone, and a decode loop may build on a shared one).
  key.push_back(mx::default_stream(mx::default_device()).index);
  return key;
}

std::vector<mx::Shape> output_shapes_of(rust::Slice<const int32_t> output_shapes,
                                        rust::Slice<const int32_t> output_ranks) {
  std::vector<mx::Shape> shapes;
  shapes.reserve(output_ranks.size());
  size_t at = 0;
  for (int32_t rank : output_ranks) {
    if (rank < 0 || at + static_cast<size_t>(rank) > output_shapes.size()) {
      throw std::invalid_argument("[custom_kernel_call] output shapes do not match their ranks");
    }
    shapes.emplace_back(output_shapes.begin() + at, output_shapes.begin() + at + rank);
    at += static_cast<size_t>(rank);
  }
  return shapes;
}

std::vector<mx::Dtype> output_dtypes_of(rust::Slice<const uint8_t> output_dtypes) {
  std::vector<mx::Dtype> dtypes;
  dtypes.reserve(output_dtypes.size());
  for (uint8_t d : output_dtypes) {
    dtypes.push_back(to_mlx(static_cast<Dtype>(d)));
  }
  return dtypes;
}
}  // namespace

size_t LaunchKeyHash::operator()(const std::vector<int64_t>& key) const noexcept {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the values
  for (int64_t v : key) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ull;
  }
  return static_cast<size_t>(h);
}

std::unique_ptr<std::vector<Array>> custom_kernel_cached(
    const CustomKernelFn& kernel, const std::vector<Array>& inputs,
    rust::Slice<const int32_t> output_shapes, rust::Slice<const int32_t> output_ranks,
    rust::Slice<const uint8_t> output_dtypes, rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> threadgroup, rust::Slice<const uint8_t> template_kinds,
    rust::Slice<const int32_t> template_values) {
  if (output_ranks.size() != output_dtypes.size()) {
    throw std::invalid_argument("[custom_kernel_call] mismatched argument lengths");
  }
  const auto& key =
      launch_key(inputs, output_dtypes, grid, threadgroup, template_kinds, template_values);
  auto hit = kernel.primitives.find(key);
  if (hit == kernel.primitives.end()) {
    return nullptr;
  }
  return boxed_vec(Array::make_arrays(output_shapes_of(output_shapes, output_ranks),
                                      output_dtypes_of(output_dtypes), hit->second, inputs));
}

std::unique_ptr<std::vector<Array>> custom_kernel_call(
    const CustomKernelFn& kernel, const std::vector<Array>& inputs,
    rust::Slice<const int32_t> output_shapes, rust::Slice<const int32_t> output_ranks,
    rust::Slice<const uint8_t> output_dtypes, rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> threadgroup, rust::Slice<const rust::String> template_names,
    rust::Slice<const uint8_t> template_kinds, rust::Slice<const int32_t> template_values) {
  if (template_names.size() != template_kinds.size()) {
    throw std::invalid_argument("[custom_kernel_call] mismatched argument lengths");
  }
  if (auto cached = custom_kernel_cached(kernel, inputs, output_shapes, output_ranks,
                                         output_dtypes, grid, threadgroup, template_kinds,
                                         template_values)) {
    return cached;
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
  auto outputs = kernel.fn(inputs, output_shapes_of(output_shapes, output_ranks),
                           output_dtypes_of(output_dtypes), {grid[0], grid[1], grid[2]},
                           {threadgroup[0], threadgroup[1], threadgroup[2]}, args,
                           std::nullopt, false, {});
  if (!outputs.empty() && outputs[0].has_primitive()) {
    kernel.primitives.emplace(
        launch_key(inputs, output_dtypes, grid, threadgroup, template_kinds, template_values),
        outputs[0].primitive_ptr());
  }
  return boxed_vec(std::move(outputs));
}

}  // namespace quince
