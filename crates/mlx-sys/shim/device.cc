// Devices, backend facts and memory accounting.
#include "mlx-sys/src/lib.rs.h"

#include <cstdlib>

#include "mlx/backend/cuda/cuda.h"
#include "mlx/backend/gpu/device_info.h"
#include "mlx/backend/metal/metal.h"

#include <unistd.h>

namespace quince {

namespace mx = ::mlx::core;

namespace {
mx::Device::DeviceType to_type(DeviceKind kind) {
  return kind == DeviceKind::Gpu ? mx::Device::gpu : mx::Device::cpu;
}
}  // namespace

rust::String mlx_version() { return rust::String(mx::version()); }

rust::String backend_name() {
  if (mx::cu::is_available()) return "cuda";
  if (mx::metal::is_available()) return "metal";
  return "cpu";
}

bool is_available(DeviceKind kind) { return mx::is_available(mx::Device(to_type(kind))); }

DeviceKind default_device_kind() {
  return mx::default_device().type == mx::Device::gpu ? DeviceKind::Gpu : DeviceKind::Cpu;
}

void set_default_device(DeviceKind kind) { mx::set_default_device(mx::Device(to_type(kind))); }

void synchronize() { mx::synchronize(); }

int32_t new_shared_gpu_stream() { return mx::new_thread_unsafe_stream(mx::Device::gpu).index; }

int32_t default_gpu_stream() { return mx::default_stream(mx::Device::gpu).index; }

void set_default_gpu_stream(int32_t index) {
  mx::set_default_stream(mx::Stream(index, mx::Device::gpu));
}

void synchronize_gpu_stream(int32_t index) {
  mx::synchronize(mx::Stream(index, mx::Device::gpu));
}

rust::Vec<StringPair> device_info(DeviceKind kind) {
  rust::Vec<StringPair> out;
  const auto& info = mx::device_info(mx::Device(to_type(kind)));
  for (const auto& [key, value] : info) {
    std::string text;
    if (std::holds_alternative<std::string>(value)) {
      text = std::get<std::string>(value);
    } else {
      text = std::to_string(std::get<size_t>(value));
    }
    out.push_back(StringPair{rust::String(key), rust::String(text)});
  }
  return out;
}

size_t system_memory_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<size_t>(pages) * static_cast<size_t>(page_size);
}

bool metal_kernels_available() { return mx::metal::is_available(); }
bool cuda_kernels_available() { return mx::cu::is_available(); }

bool set_env_default(rust::Str name, rust::Str value) {
  std::string key(name);
  if (std::getenv(key.c_str()) != nullptr) return false;
  if (setenv(key.c_str(), std::string(value).c_str(), /* overwrite */ 0) != 0) {
    throw std::runtime_error("[set_env_default] could not set " + key);
  }
  return true;
}

size_t get_active_memory() { return mx::get_active_memory(); }
size_t get_peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t get_cache_memory() { return mx::get_cache_memory(); }
size_t get_memory_limit() { return mx::get_memory_limit(); }
size_t set_memory_limit(size_t limit) { return mx::set_memory_limit(limit); }
size_t set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }
size_t set_wired_limit(size_t limit) { return mx::set_wired_limit(limit); }
void clear_cache() { mx::clear_cache(); }

}  // namespace quince
