"""When does MLX-CUDA's GPU run a decode-like step, against when the host submitted it?

    python3 tests/bench/stream_lag.py [--ops 150,600] [--steps 100] [--kind add|host_scalars|qmv|custom]

Plain MLX, no Quince: each step is a chain of `--ops` one-kernel ops on a 4096 vector that
starts from the previous step's token and ends in an argmax token, submitted with
`mx.async_eval` and read back after the next step is submitted (the decode loop's pattern).
A one-thread kernel reads the GPU's `%globaltimer` when the step starts and when its token is
written; the GPU clock is placed on the host's by reading it synchronously a few times. Prints
medians in ms: host submission, GPU span (start read to end read), when the GPU starts the
step after its submission started, when it ends against the end of the submission, and the
step. Run it under different `MLX_MAX_OPS_PER_BUFFER` values to see what batching does. CUDA
only. The op (`--kind`): `add` adds a scalar made once; `host_scalars` adds a scalar made from
host data for each op (what MLX-CUDA keeps in its pool of managed pages); `qmv` multiplies by
a 4-bit 4096x4096 matrix (MLX's quantized matrix-vector product); `custom` runs a one-line
`cuda_kernel` (what Quince's fused kernels go through).
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

STEP = mx.fast.cuda_kernel(
    name="stream_lag_step",
    input_names=["x"],
    output_names=["y"],
    source="""
        uint i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < N) { y[i] = x[i] * 0.5f + 1.0f; }
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
    ap.add_argument("--kind", default="add", choices=["add", "host_scalars", "qmv", "custom"])
    a = ap.parse_args()
    n = 4096
    x = mx.random.normal((n,))
    one = mx.array(1.0)
    w, scales, biases = mx.quantize(mx.random.normal((n, n)) / 64.0, group_size=64, bits=4)
    mx.eval(x, one, w, scales, biases)

    def op(h):
        if a.kind == "host_scalars":
            return h + mx.array(1.0)
        if a.kind == "qmv":
            p = mx.quantized_matmul(h[None], w, scales, biases, transpose=True, group_size=64, bits=4)
            return p[0]
        if a.kind == "custom":
            return STEP(
                inputs=[h],
                template=[("N", n)],
                output_shapes=[(n,)],
                output_dtypes=[mx.float32],
                grid=(n, 1, 1),
                threadgroup=(256, 1, 1),
            )[0]
        return h + one

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
    out = {"offset_uncertainty_ms": (high - low) / 1e6, "kind": a.kind}
    for ops in [int(v) for v in a.ops.split(",")]:

        def step(y):
            t0 = clock(y)
            # The chain reads the start clock (times 0): otherwise nothing orders the read
            # before the work, and MLX and CUDA graphs run it late.
            h = x + y.astype(mx.float32) + t0.astype(mx.float32) * 0.0
            for _ in range(ops):
                h = op(h)
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
