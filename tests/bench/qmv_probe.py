# python3 tests/bench/qmv_probe.py (GPU machine, MLX-CUDA). Quince's 4-bit matrix-vector kernel
# (crates/cache/src/backend/cuda/qmv4.cu) against mx.quantized_matmul on Gemma 4 E4B shapes:
# error against the dequantized matrix in fp32, and time per matrix with enough distinct matrices
# that the weights come from HBM, not L2. A row of tiny matrices gives each path's per-op floor.
import itertools
import os
import sys
import time

import mlx.core as mx

SRC = open(os.path.join(os.path.dirname(__file__), "../../crates/cache/src/backend/cuda/qmv4.cu")).read()
KERNEL = mx.fast.cuda_kernel(name="qmv4", input_names=["x", "w", "scales", "biases"],
                             output_names=["y"], source=SRC)

def qmv(x, w, s, b, cfg):
    M, K = x.shape
    N = w.shape[0]
    R, tb = cfg["R"], cfg["TB"]
    return KERNEL(inputs=[x, w, s, b], output_shapes=[(M, N)], output_dtypes=[mx.bfloat16],
                  grid=(N // R * 32, 1, 1), threadgroup=(tb, 1, 1),
                  template=[("M", M), ("R", R), ("K", K), ("N", N)])[0]

def timed(f, iters):
    mx.eval(f())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.async_eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) / iters

print("mlx", mx.__version__, mx.default_device())
CONFIGS = {
    "R1": dict(R=1, TB=128),
    "R2": dict(R=2, TB=128),
}
only = sys.argv[1:]  # config names to run (all when empty)
SHAPES = [(10240, 2560, "gate/up"), (2560, 10240, "down"), (2048, 2560, "q"), (512, 2560, "k/v"),
          (2560, 2048, "o"), (262144, 2560, "lm head")]
MS = [1, 2, 4, 8, 16]

# Per-op floor: 64 tiny products in one graph.
tiny = [mx.quantize((mx.random.normal((128, 512)) * 0.02).astype(mx.bfloat16), group_size=64, bits=4) for _ in range(64)]
xt = mx.random.normal((1, 512)).astype(mx.bfloat16)
mx.eval(tiny, xt)
f_mlx = lambda: [mx.quantized_matmul(xt, w, s, b, transpose=True, group_size=64, bits=4) for (w, s, b) in tiny]
print(f"per-op floor (64 products of 128x512): mlx {timed(f_mlx, 50) / 64 * 1e6:.2f} us", end="")
f_q = lambda: [qmv(xt, w, s, b, CONFIGS["R1"]) for (w, s, b) in tiny]
print(f"  quince {timed(f_q, 50) / 64 * 1e6:.2f} us")

totals = {}
for N, K, name in SHAPES:
    count = max(1, min(16, (256 << 20) // (N * K // 2)))  # distinct matrices: ≥ 256 MiB of weights
    mats = [mx.quantize((mx.random.normal((N, K)) * 0.02).astype(mx.bfloat16), group_size=64, bits=4)
            for _ in range(count)]
    mx.eval(mats)
    nbytes = N * K // 2 + 2 * 2 * N * K // 64
    for M in MS:
        x = mx.random.normal((M, K)).astype(mx.bfloat16)
        mx.eval(x)
        w, s, b = mats[0]
        exact = (x.astype(mx.float32) @ mx.dequantize(w, s, b, group_size=64, bits=4).astype(mx.float32).T)
        ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
        scale = mx.abs(exact).max().item()
        err_mlx = (mx.abs(ref.astype(mx.float32) - exact).max() / scale).item()
        iters = 20 if N > 100000 else 40
        t_mlx = timed(lambda: [mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
                               for (w, s, b) in mats], iters) / count
        line = f"{name:8} {N:6}x{K:<5} M={M}  mlx {t_mlx * 1e6:7.1f} us {nbytes / t_mlx / 1e9:6.0f} GB/s err {err_mlx:.1e}"
        totals.setdefault(("mlx", M), {})[name] = t_mlx
        for cname, cfg in CONFIGS.items():
            if only and cname not in only:
                continue
            if N % (4 * cfg["R"]):
                continue
            try:
                out = qmv(x, w, s, b, cfg)
                err = (mx.abs(out.astype(mx.float32) - exact).max() / scale).item()
                t = timed(lambda: [qmv(x, w, s, b, cfg) for (w, s, b) in mats], iters) / count
            except Exception as e:  # a config that fails to build is reported, not fatal
                print(f"  {cname}: {e}")
                continue
            totals.setdefault((cname, M), {})[name] = t
            line += f" | {cname} {t * 1e6:6.1f} us {nbytes / t / 1e9:5.0f} GB/s {err:.1e}"
        print(line, flush=True)
    del mats

# One E4B layer's projections (q, k, v, o, gate, up, down) plus the head shared over 42 layers.
per_layer = {"q": 1, "k/v": 2, "o": 1, "gate/up": 2, "down": 1}
print("estimated 4-bit matmul time per token, E4B (42 layers + head):")
for (cname, M), t in sorted(totals.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    if all(k in t for k in per_layer) and "lm head" in t:
        total = 42 * sum(t[k] * c for k, c in per_layer.items()) + t["lm head"]
        print(f"  M={M} {cname:18} {total * 1e3:6.2f} ms")
