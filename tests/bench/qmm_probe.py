# python3 tests/bench/qmm_probe.py (GPU machine). Where does a verify window's extra time go on CUDA? Quantized matmuls of Gemma 4 E4B shapes
# (8 layers' worth) at M rows, vs M separate one-row calls, and SDPA masks for a 5-token window.
import time
import mlx.core as mx

def bench(f, iters=40):
    for _ in range(5):
        mx.eval(f())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) / iters * 1e3

D, F = 2560, 10240
shapes = [(F, D), (F, D), (D, F), (2048, D), (512, D), (512, D), (D, 2048)]
layers = []
for _ in range(8):
    layers.append([mx.quantize(mx.random.normal((o, i)).astype(mx.bfloat16) * 0.02, group_size=64, bits=4) for o, i in shapes])
mx.eval(layers)
print("mlx", mx.__version__, mx.default_device())
print("M  rows-at-once ms  one-row-calls ms  (8 layers of E4B projections, 4-bit)")
for M in [1, 2, 3, 4, 5, 6, 8, 9, 16, 32]:
    xs = {n: mx.random.normal((1, M, n)).astype(mx.bfloat16) for n in (D, F, 2048)}
    mx.eval(xs)
    def together():
        return [mx.quantized_matmul(xs[w.shape[1] * 8], w, s, b, transpose=True, group_size=64, bits=4)
                for L in layers for (w, s, b) in L]
    def split():
        return [mx.quantized_matmul(xs[w.shape[1] * 8][:, r:r + 1], w, s, b, transpose=True, group_size=64, bits=4)
                for L in layers for (w, s, b) in L for r in range(M)]
    print(f"{M:<3}{bench(together):>10.3f}{bench(split):>18.3f}")

print("SDPA, 8 query heads, 2 kv heads, dim 256, 5-token window")
for N in [512, 2048, 8192]:
    q = mx.random.normal((1, 8, 5, 256)).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, N, 256)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, N, 256)).astype(mx.bfloat16)
    arr = mx.tril(mx.ones((5, N), dtype=mx.bool_), k=N - 5)
    q1 = q[:, :, :1]
    mx.eval(q, k, v, arr, q1)
    f1 = lambda: [mx.fast.scaled_dot_product_attention(q1, k, v, scale=1.0) for _ in range(42)]
    fc = lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal") for _ in range(42)]
    fa = lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=arr) for _ in range(42)]
    print(f"N={N:<5} one query {bench(f1):.3f} ms  causal {bench(fc):.3f} ms  array mask {bench(fa):.3f} ms  (42 layers)")
