# python3 tests/bench/window_attention_probe.py (GPU machine). A verify round attends a short
# window of queries over a key length that is new every round: MLX's fused attention (on CUDA
# through cuDNN, a graph built per new shape) against the same window by MLX's ops (Quince's
# `window_by_ops` route), and one query for scale. Per head size and window length: the slowest
# and the median call over 60 consecutive key lengths, each new to the process.
import time

import mlx.core as mx


def by_ops(q, k, v, scale, mask):
    group = q.shape[1] // k.shape[1]
    k = mx.repeat(k, group, axis=1)
    v = mx.repeat(v, group, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True) @ v


print("mlx", mx.__version__, mx.default_device())
for dim in (32, 64, 256):
    for length in (1, 5):
        for route in ("fused", "ops"):
            times = []
            for keys in range(130, 190):
                q = mx.random.normal((1, 4, length, dim)).astype(mx.bfloat16)
                k = mx.random.normal((1, 2, keys, dim)).astype(mx.bfloat16)
                v = mx.random.normal((1, 2, keys, dim)).astype(mx.bfloat16)
                mask = mx.arange(keys)[None, :] <= (keys - length + mx.arange(length))[:, None]
                mx.eval(q, k, v, mask)
                t = time.perf_counter()
                if route == "fused":
                    causal = "causal" if length > 1 else None
                    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=causal)
                else:
                    out = by_ops(q, k, v, dim**-0.5, mask)
                mx.eval(out)
                times.append((time.perf_counter() - t) * 1e3)
            times.sort()
            print(
                f"head {dim:3d}, {length} queries, {route:5s}: slowest {times[-1]:7.2f} ms, "
                f"median {times[len(times) // 2]:6.3f} ms",
                flush=True,
            )
