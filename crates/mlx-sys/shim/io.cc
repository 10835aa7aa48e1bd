// safetensors load (lazy: arrays read from the file when evaluated) and save, with metadata.
#include "mlx-sys/src/lib.rs.h"

#include <stdexcept>

namespace quince {

namespace mx = ::mlx::core;

std::unique_ptr<SafetensorsData> load_safetensors(rust::Str path) {
  auto [arrays, metadata] = mx::load_safetensors(std::string(path));
  auto data = std::make_unique<SafetensorsData>();
  data->arrays = std::move(arrays);
  data->metadata = std::move(metadata);
  return data;
}

rust::Vec<rust::String> safetensors_names(const SafetensorsData& data) {
  rust::Vec<rust::String> names;
  names.reserve(data.arrays.size());
  for (const auto& [name, _] : data.arrays) names.push_back(rust::String(name));
  return names;
}

std::unique_ptr<Array> safetensors_get(const SafetensorsData& data, rust::Str name) {
  auto it = data.arrays.find(std::string(name));
  if (it == data.arrays.end()) {
    throw std::out_of_range("[safetensors] no tensor named '" + std::string(name) + "'");
  }
  return boxed(it->second);
}

rust::Vec<StringPair> safetensors_metadata(const SafetensorsData& data) {
  rust::Vec<StringPair> out;
  for (const auto& [key, value] : data.metadata) {
    out.push_back(StringPair{rust::String(key), rust::String(value)});
  }
  return out;
}

void save_safetensors(rust::Str path, rust::Slice<const rust::String> names,
                      const std::vector<Array>& arrays, rust::Slice<const StringPair> metadata) {
  if (names.size() != arrays.size()) {
    throw std::invalid_argument("[save_safetensors] names and arrays differ in length");
  }
  std::unordered_map<std::string, Array> map;
  for (size_t i = 0; i < names.size(); ++i) {
    auto [_, inserted] = map.insert({std::string(names[i]), arrays[i]});
    if (!inserted) {
      throw std::invalid_argument("[save_safetensors] duplicate tensor name '" +
                                  std::string(names[i]) + "'");
    }
  }
  std::unordered_map<std::string, std::string> meta;
  for (const auto& pair : metadata) meta[std::string(pair.key)] = std::string(pair.value);
  mx::save_safetensors(std::string(path), std::move(map), std::move(meta));
}

}  // namespace quince
