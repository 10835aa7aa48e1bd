"""What one MLX op costs in a decode-shaped graph, by kind: host time to record it and wall time.

For each kind, builds `--ops` independent ops of that kind on E4B decode shapes (bf16), submits
them with one `mx.async_eval` (the host records every kernel; that is what a decode step pays)
and waits. Prints one JSON line per kind: build_us (Python graph building, per op), submit_us
(host time of async_eval, per op), wall_us (build + submit + wait, per op). Medians of --repeats.

Growing key lengths (`--grow`) give every attention op a new key length, as decoding does; a
fixed length repeats one shape (what a full sliding window sees).

Usage: python tests/bench/op_cost.py [--ops 200] [--repeats 5] [--keys 512] [--grow]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx


def kinds(keys: int, grow: bool):
    dt = mx.bfloat16
    x = mx.random.normal((1, 1, 2560)).astype(dt)
    w = mx.random.normal((2048, 2560)).astype(dt)
    wq, sq, bq = mx.quantize(w, group_size=64, bits=4)
    norm_w = mx.ones((2560,), dt)
    q_heads = mx.random.normal((1, 8, 1, 256)).astype(dt)
    q_rows = mx.random.normal((1, 2, 4, 256)).astype(dt)
    q5 = mx.random.normal((1, 2, 4, 1, 256)).astype(dt)
    k = mx.random.normal((1, 2, keys, 256)).astype(dt)
    v = mx.random.normal((1, 2, keys, 256)).astype(dt)
    vt = mx.contiguous(v.swapaxes(-1, -2))
    p_rows = mx.softmax(mx.random.normal((1, 2, 4, keys)).astype(dt), axis=-1)
    p5 = p_rows.reshape(1, 2, 4, 1, keys)
    mx.eval(x, wq, sq, bq, norm_w, q_heads, q_rows, q5, k, v, vt, p_rows, p5)
    geglu = mx.compile(lambda g, u: (0.5 * g * (1 + mx.tanh(0.7978845608 * (g + 0.044715 * g**3)))) * u,
                       shapeless=True)
    geglu_shaped = mx.compile(
        lambda g, u: (0.5 * g * (1 + mx.tanh(0.7978845608 * (g + 0.044715 * g**3)))) * u)
    scale = 256 ** -0.5

    def n(i):
        return keys - (i % 128) if grow else keys

    def kk(i):
        return k[:, :, : n(i)] if grow else k

    def vv(i):
        return v[:, :, : n(i)] if grow else v

    def vtt(i):
        return vt[..., : n(i)] if grow else vt

    def pr(i):
        return p_rows[..., : n(i)] if grow else p_rows

    def pp5(i):
        return p5[..., : n(i)] if grow else p5

    copy_kernel = mx.fast.cuda_kernel(
        name="op_cost_copy", input_names=["inp"], output_names=["out"],
        source="auto i = cooperative_groups::this_grid().thread_rank(); if (i < inp_shape[2]) out[i] = inp[i];",
    ) if mx.cuda.is_available() else None

    def custom(i):
        return copy_kernel(inputs=[x], grid=(2560, 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[x.shape], output_dtypes=[x.dtype])[0]

    made = {
        "add": lambda i: x + x,
        "reshape (view)": lambda i: x.reshape(1, 1, 10, 256),
        "rms_norm": lambda i: mx.fast.rms_norm(x, norm_w, 1e-6),
        "quantized_matmul 2560->2048": lambda i: mx.quantized_matmul(x, wq, sq, bq, True, 64, 4),
        "rope": lambda i: mx.fast.rope(q_heads, 256, traditional=False, base=10000.0, scale=1.0, offset=keys),
        "compiled geglu": lambda i: geglu(x, x),
        "compiled geglu (shaped)": lambda i: geglu_shaped(x, x),
        "softmax precise": lambda i: mx.softmax(pr(i), axis=-1, precise=True),
        "scores: rows (M=4) @ k^T": lambda i: q_rows @ kk(i).swapaxes(-1, -2),
        "scores: per head (M=1) @ k^T": lambda i: q5 @ mx.expand_dims(kk(i), 2).swapaxes(-1, -2),
        "p@v: rows (M=4)": lambda i: pr(i) @ vv(i),
        "p@v: per head (M=1)": lambda i: pp5(i) @ mx.expand_dims(vv(i), 2),
        "p@v: v^T stored, gemv (N=1)": lambda i: mx.expand_dims(vtt(i), 2) @ pp5(i).swapaxes(-1, -2),
        "p@v: multiply + sum": lambda i: (pr(i)[..., None] * mx.expand_dims(vv(i), 2)).sum(axis=-2),
        "sdpa (mlx fast, L=1)": lambda i: mx.fast.scaled_dot_product_attention(
            q_heads, kk(i), vv(i), scale=scale, mask=None),
        "slice_update one position": lambda i: mx.slice_update(
            k, q_heads[:, :2], mx.array([0, 0, keys - 1, 0]), [0, 1, 2, 3]),
    }
    if copy_kernel is not None:
        made["custom kernel (copy 2560)"] = custom
    return made


def measure(make, ops: int) -> tuple[float, float, float]:
    start = time.perf_counter()
    outs = [make(i) for i in range(ops)]
    built = time.perf_counter()
    mx.async_eval(outs)
    submitted = time.perf_counter()
    mx.synchronize()
    done = time.perf_counter()
    return ((built - start) * 1e6 / ops, (submitted - built) * 1e6 / ops, (done - start) * 1e6 / ops)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--only", help="comma-separated substrings of the kinds to run")
    parser.add_argument("--grow", action="store_true", help="a new key length for every op")
    args = parser.parse_args()
    only = args.only.split(",") if args.only else None
    for name, make in kinds(args.keys, args.grow).items():
        if only and not any(o in name for o in only):
            continue
        measure(make, args.ops)  # warm: kernels, plans, allocator
        runs = [measure(make, args.ops) for _ in range(args.repeats)]
        row = {"kind": name, "keys": args.keys, "grow": args.grow}
        for i, field in enumerate(("build_us", "submit_us", "wall_us")):
            row[field] = round(statistics.median(r[i] for r in runs), 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
