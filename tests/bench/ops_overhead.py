"""The Python half of `quince bench-ops`: the same three measurements through Python `mlx`.

Prints one JSON line: add_eval_us, add_graph_us, chain_us (µs per op) and matmul_ms, each the median of
--repeats runs. Keep it in step with crates/cli/src/bench_ops.rs.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    a = mx.array([1.0, 2.0, 3.0, 4.0], dtype=mx.float32)
    b = mx.array([0.5, 0.5, 0.5, 0.5], dtype=mx.float32)
    mx.eval(a, b)
    for _ in range(100):
        mx.eval(mx.add(a, b))

    eval_runs, graph_runs = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.ops):
            mx.eval(mx.add(a, b))
        eval_runs.append((time.perf_counter() - start) * 1e6 / args.ops)

        start = time.perf_counter()
        for _ in range(args.ops):
            c = mx.add(a, b)
            del c
        graph_runs.append((time.perf_counter() - start) * 1e6 / args.ops)

    chain_runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(10):
            x = a
            for _ in range(1000):
                x = mx.add(x, b)
            mx.eval(x)
        chain_runs.append((time.perf_counter() - start) * 1e6 / 10_000)

    n = args.matmul_size
    x = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(0))
    y = mx.ones((n, n), dtype=mx.float32)
    mx.eval(x, y)
    mx.eval(mx.matmul(x, y))  # warm-up: library handles, kernel selection
    matmul_runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        mx.eval(mx.matmul(x, y))
        matmul_runs.append((time.perf_counter() - start) * 1e3)

    print(
        json.dumps(
            {
                "mlx_version": mx.__version__,
                "device": str(mx.default_device()),
                "add_eval_us": statistics.median(eval_runs),
                "add_graph_us": statistics.median(graph_runs),
                "chain_us": statistics.median(chain_runs),
                "matmul_ms": statistics.median(matmul_runs),
            }
        )
    )


if __name__ == "__main__":
    main()
