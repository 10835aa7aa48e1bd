// mlx::core::compile over a Rust closure. The closure is called while MLX traces the function
// (once per new input signature); an error it returns is thrown as rust::Error and surfaces
// from compiled_call as a Rust error.
#include "mlx-sys/src/lib.rs.h"

namespace quince {

namespace mx = ::mlx::core;

std::unique_ptr<CompiledFn> compile(rust::Box<RustClosure> closure, bool shapeless) {
  // std::function must be copyable; rust::Box is move-only, so share it.
  auto shared = std::make_shared<rust::Box<RustClosure>>(std::move(closure));
  std::function<std::vector<Array>(const std::vector<Array>&)> traced =
      [shared](const std::vector<Array>& inputs) -> std::vector<Array> {
    auto outputs = call_rust_closure(**shared, inputs);
    return std::move(*outputs);
  };
  return std::make_unique<CompiledFn>(CompiledFn{mx::compile(std::move(traced), shapeless)});
}

std::unique_ptr<std::vector<Array>> compiled_call(const CompiledFn& f,
                                                  const std::vector<Array>& inputs) {
  return boxed_vec(f.fn(inputs));
}

void set_compile_enabled(bool enabled) {
  if (enabled) {
    mx::enable_compile();
  } else {
    mx::disable_compile();
  }
}

}  // namespace quince
