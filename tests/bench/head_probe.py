# .venv/bin/python tests/bench/head_probe.py: what the trained demo's output projection (the tied
# 4-bit embedding, 262,208 x 128, groups of 64) costs on this machine's MLX at 1, 2 and 5 rows (a
# decode step's and a verify window's), with bf16 activations and scales (as the demo runs) and
# with float32 ones. Medians of 5 after one untimed call.
import time

import mlx.core as mx

VOCAB, HIDDEN = 262_208, 128
print("mlx", mx.__version__, mx.default_device())
weight = mx.random.normal((VOCAB, HIDDEN)) * 0.02
for dtype in (mx.bfloat16, mx.float32):
    wq, scales, biases = mx.quantize(weight.astype(dtype), group_size=64, bits=4)
    mx.eval(wq, scales, biases)
    for rows in (1, 2, 5):
        x = mx.random.normal((rows, HIDDEN)).astype(dtype)
        mx.eval(x)

        def head():
            return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)

        mx.eval(head())
        times = []
        for _ in range(5):
            t = time.perf_counter()
            mx.eval(head())
            times.append((time.perf_counter() - t) * 1e3)
        ms = sorted(times)[2]
        print(f"{str(dtype):>16} {rows} rows: {ms:8.1f} ms ({ms / rows:.1f} ms a row)", flush=True)
