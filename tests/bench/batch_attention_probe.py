# python3 tests/bench/batch_attention_probe.py (GPU machine). What a batched decode step's
# attention costs on MLX-CUDA at B rows: Gemma 4 E4B's heads (8 query, 2 key-value; dim 256 on
# sliding layers, 512 on global ones) over 576 keys, 42 layers' worth per call, with no mask
# (every row the same length) and with the left-padding mask a batch of unequal rows needs.
import time

import mlx.core as mx


def timed(f, iters=30):
    for _ in range(3):
        mx.eval(f())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


print("mlx", mx.__version__, mx.default_device())
N = 576
for D in (256, 512):
    for B in (1, 2, 4, 8, 16):
        q = mx.random.normal((B, 8, 1, D)).astype(mx.bfloat16)
        k = mx.random.normal((B, 2, N, D)).astype(mx.bfloat16)
        v = mx.random.normal((B, 2, N, D)).astype(mx.bfloat16)
        pad = mx.arange(N)[None, :] >= (mx.arange(B)[:, None] * 7)
        mask = pad[:, None, None, :]
        mx.eval(q, k, v, mask)
        plain = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0) for _ in range(42)])
        masked = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
                                for _ in range(42)])
        print(f"D={D} B={B:<2} no mask {plain:7.3f} ms  padding mask {masked:7.3f} ms  (42 layers)", flush=True)
