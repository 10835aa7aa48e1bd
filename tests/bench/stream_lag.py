"""When does MLX-CUDA's GPU run a decode-like step, against when the host submitted it?

    python3 tests/bench/stream_lag.py [--ops 150,600] [--steps 100]

Plain MLX, no Quince: each step is a chain of `--ops` adds (one kernel each) on a small vector that
starts from the previous step's token and ends in an argmax token, submitted with
`mx.async_eval` and read back after the next step is submitted (the decode loop's pattern).
A one-thread kernel reads the GPU's `%globaltimer` when the step starts and when its token is
written; the GPU clock is placed on the host's by reading it synchronously a few times. Prints
medians in ms: host submission, GPU span (start read to end read), when the GPU starts the
step after its submission started, when it ends against the end of the submission, and the
step. Run it under different `MLX_MAX_OPS_PER_BUFFER` values to see what batching does. CUDA
only.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

CLOCK = mx.fast.cuda_kernel(
    name="stream_lag_clock",
    input_names=["after"],
    output_names=["now"],
    source="""
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        now[0] = t;
    """,
)

def clock(after):
    return CLOCK(
        inputs=[after],
        output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
        grid=(1, 1, 1),
        threadgroup=(1, 1, 1),
    )[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="150,600")
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    x = mx.random.normal((4096,))
    one = mx.array(1.0)
    mx.eval(x, one)
    y = mx.array(0, dtype=mx.uint32)
    mx.eval(y)
    # GPU clock minus host clock lies in [low, high].
    low, high = -(2**63), 2**63
    for _ in range(8):
        before = time.time_ns()
        c = clock(y).item()
        after = time.time_ns()
        low, high = max(low, c - after), min(high, c - before)
    offset = (low + high) // 2
    out = {"offset_uncertainty_ms": (high - low) / 1e6}
    for ops in [int(v) for v in a.ops.split(",")]:

        def step(y):
            t0 = clock(y)
            h = x + y.astype(mx.float32)
            for _ in range(ops):
                h = h + one
            nxt = mx.argmax(h).astype(mx.uint32)
            return nxt, t0, clock(nxt)

        rows = []
        mx.async_eval(y)
        for i in range(a.steps + 10):
            build = time.time_ns()
            nxt, t0, t1 = step(y)
            submit = time.time_ns()
            mx.async_eval(t0, t1)
            submitted = time.time_ns()
            y.item()
            done = time.time_ns()
            if i >= 10:
                rows.append((build, submit, submitted, t0, t1, done))
            y = nxt
        mx.eval(y)
        f = {k: [] for k in ["build", "submit", "gpu_span", "gpu_start_lag", "gpu_end_after_submit", "step"]}
        for i, (build, submit, submitted, t0, t1, _) in enumerate(rows):
            g0, g1 = t0.item() - offset, t1.item() - offset
            f["build"].append((submit - build) / 1e6)
            f["submit"].append((submitted - submit) / 1e6)
            f["gpu_span"].append((g1 - g0) / 1e6)
            f["gpu_start_lag"].append((g0 - submit) / 1e6)
            f["gpu_end_after_submit"].append((g1 - submitted) / 1e6)
            if i + 1 < len(rows):
                f["step"].append((rows[i + 1][0] - build) / 1e6)
        out[f"ops_{ops}"] = {k: round(statistics.median(v), 3) for k, v in f.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
