"""Records inputs and expected outputs for the `mlx` crate's op tests.

Expected values come from NumPy formulas written here (not from MLX), so the Rust tests check
the binding and MLX against an independent computation. The only MLX-produced values are the
`random.*` entries: MLX's keyed PRNG has no NumPy equivalent, and recording what Python `mlx`
returns for a key checks that our binding passes keys through unchanged.

Usage: python tests/golden/ops/make_fixtures.py [OUT]  (default: next to this script)
Writes ops.safetensors (a minimal writer below; no torch or safetensors package needed).
"""

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

RNG = np.random.default_rng(20261130)
OUT: dict[str, np.ndarray] = {}
DTYPES = {np.float32: "F32", np.float16: "F16", np.int32: "I32", np.uint32: "U32",
          np.int64: "I64", np.bool_: "BOOL", np.uint8: "U8"}
BF16 = set()  # names stored as bfloat16 bits (uint16)


def put(name: str, value, dtype=np.float32) -> None:
    OUT[name] = np.array(value, dtype=dtype, order="C")  # keeps 0-d arrays 0-d


def put_bf16(name: str, value) -> None:
    OUT[name] = to_bf16_bits(np.asarray(value, np.float32))
    BF16.add(name)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (what MLX's astype does)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def randn(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def write_safetensors(path: Path) -> None:
    header, blobs, offset = {}, [], 0
    for name in sorted(OUT):
        arr = OUT[name]
        raw = arr.tobytes()
        dtype = "BF16" if name in BF16 else DTYPES[arr.dtype.type]
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"generator": "tests/golden/ops/make_fixtures.py"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def erf(x):
    return np.vectorize(math.erf)(x.astype(np.float64)).astype(np.float32)


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def arithmetic() -> None:
    a, b = randn(2, 3, 4), randn(3, 1)
    pos = np.abs(randn(2, 3, 4)) + 0.1
    put("binary.a", a)
    put("binary.b", b)
    put("binary.pos", pos)
    put("binary.add", a + b)
    put("binary.subtract", a - b)
    put("binary.multiply", a * b)
    put("binary.divide", a / b)
    put("binary.power", pos ** b)
    put("binary.maximum", np.maximum(a, b))
    put("binary.minimum", np.minimum(a, b))
    put("binary.less", a < b, np.bool_)
    put("binary.greater_equal", a >= b, np.bool_)
    put("unary.exp", np.exp(a))
    put("unary.log", np.log(pos))
    put("unary.tanh", np.tanh(a))
    put("unary.sigmoid", 1 / (1 + np.exp(-a)))
    put("unary.erf", erf(a))
    put("unary.sqrt", np.sqrt(pos))
    put("unary.rsqrt", 1 / np.sqrt(pos))
    put("unary.abs", np.abs(a))
    put("unary.gelu_approx",
        0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))))
    put("unary.silu", a / (1 + np.exp(-a)))

    # bf16 and f16 paths: inputs rounded to the half type, results rounded again.
    ha, hb = randn(4, 8), randn(4, 8)
    put_bf16("bf16.a", ha)
    put_bf16("bf16.b", hb)
    ra, rb = bf16_round(ha), bf16_round(hb)
    put("bf16.add", bf16_round(ra + rb))
    put("bf16.multiply", bf16_round(ra * rb))
    put("bf16.matmul", ra @ rb.T)  # accumulated in f32 then rounded once; compared loosely
    put("f16.a", ha, np.float16)
    put("f16.b", hb, np.float16)
    fa, fb = ha.astype(np.float16), hb.astype(np.float16)
    put("f16.add", (fa + fb).astype(np.float32))
    put("f16.matmul", fa.astype(np.float32) @ fb.astype(np.float32).T)
    put("astype.f32", ha)
    put("astype.bf16_roundtrip", bf16_round(ha))
    put("astype.f16_roundtrip", ha.astype(np.float16).astype(np.float32))


def matmuls() -> None:
    a, b, c = randn(2, 3, 4), randn(4, 5), randn(3, 5)
    put("matmul.a", a)
    put("matmul.b", b)
    put("matmul.c", c)
    put("matmul.ab", a @ b)
    put("addmm.result", 0.5 * c + 2.0 * (a @ b))  # beta=0.5, alpha=2
    x, y = randn(3, 4), randn(4, 2)
    put("einsum.x", x)
    put("einsum.y", y)
    put("einsum.ij_jk", np.einsum("ij,jk->ik", x, y))
    put("einsum.ij_ij", np.einsum("ij,ij->i", x, x))
    put("einsum.bhld_bhsd", np.einsum("bhld,bhsd->bhls", a[None], a[None]))


def reductions() -> None:
    x = randn(3, 5, 4)
    put("reduce.x", x)
    put("reduce.sum_1", x.sum(axis=1))
    put("reduce.mean_02", x.mean(axis=(0, 2)))
    put("reduce.max_2_keep", x.max(axis=2, keepdims=True))
    put("reduce.min_all", x.min())
    m = x.max(axis=-1, keepdims=True)
    put("reduce.logsumexp_last", (np.log(np.exp(x - m).sum(axis=-1)) + m[..., 0]))
    put("reduce.softmax_last", softmax(x, -1))
    put("reduce.argmax_1", x.argmax(axis=1), np.uint32)
    put("reduce.sort_last", np.sort(x, axis=-1))
    put("reduce.argsort_last", np.argsort(x, axis=-1, kind="stable"), np.uint32)
    put("reduce.cumsum_1", np.cumsum(x, axis=1))
    put("reduce.cumsum_1_reverse_exclusive",
        np.flip(np.cumsum(np.flip(x, 1), axis=1), 1) - x)
    put("reduce.topk3_sorted", np.sort(x, axis=-1)[..., -3:])


def indexing() -> None:
    x = randn(4, 6)
    put("index.x", x)
    put("index.slice_1_4_2__0_6_3", x[1:4:2, 0:6:3])
    upd = randn(2, 3)
    put("index.update", upd)
    y = x.copy()
    y[1:3, 2:5] = upd
    put("index.slice_update_1_2", y)
    idx = np.array([3, 0, 2], np.int32)
    put("index.idx", idx, np.int32)
    put("index.take_axis1", x[:, idx])
    put("index.take_axis0", x[idx, :])
    along = RNG.integers(0, 6, size=(4, 2)).astype(np.int32)
    put("index.along", along, np.int32)
    put("index.take_along_axis1", np.take_along_axis(x, along, axis=1))
    cond = x > 0
    put("index.where", np.where(cond, x, -1.0))
    put("index.pad", np.pad(x, ((1, 0), (0, 2)), constant_values=7.0))
    put("index.concat0", np.concatenate([x, x * 2], axis=0))
    put("index.stack1", np.stack([x, x * 2], axis=1))
    put("index.transpose", x.T.copy())
    put("index.tri_4_6_1", np.tri(4, 6, 1))


def conv() -> None:
    # Depthwise 1-D convolution in MLX's layout: input [N, L, C], weight [C_out, K, C_in/groups].
    n, length, c, k = 2, 9, 4, 3
    x, w = randn(n, length, c), randn(c, k, 1)
    out = np.zeros((n, length - k + 1, c), np.float32)
    for t in range(length - k + 1):
        for ch in range(c):
            out[:, t, ch] = (x[:, t:t + k, ch] * w[ch, :, 0]).sum(axis=1)
    put("conv1d.x", x)
    put("conv1d.w_depthwise", w)
    put("conv1d.depthwise", out)
    w2 = randn(5, k, c)  # dense: 4 -> 5 channels, stride 2, padding 1
    xp = np.pad(x, ((0, 0), (1, 1), (0, 0)))
    steps = (length + 2 - k) // 2 + 1
    dense = np.zeros((n, steps, 5), np.float32)
    for i in range(steps):
        window = xp[:, 2 * i:2 * i + k, :]
        dense[:, i, :] = np.einsum("nkc,okc->no", window, w2)
    put("conv1d.w_dense", w2)
    put("conv1d.dense_s2_p1", dense)


def rope_ref(x, dims, traditional, base, scale, offset, freqs=None):
    """Direct formula: positions (offset + t) * scale, angle = pos / period_i."""
    b, h, length, d = x.shape
    half = dims // 2
    if freqs is None:
        inv = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    else:
        inv = 1.0 / freqs.astype(np.float64)
    offsets = np.broadcast_to(np.asarray(offset, np.float64).reshape(-1, 1, 1), (b, 1, 1))
    pos = (offsets + np.arange(length)[None, None, :]) * scale  # [B, 1, L]
    ang = pos[..., None] * inv  # [B, 1, L, half]
    cos, sin = np.cos(ang), np.sin(ang)
    out = x.astype(np.float64).copy()
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = x1 * cos - x2 * sin
        out[..., 1:dims:2] = x1 * sin + x2 * cos
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:dims] = x1 * sin + x2 * cos
    return out.astype(np.float32)


def fast() -> None:
    x = randn(2, 3, 5, 16)
    put("rope.x", x)
    put("rope.default", rope_ref(x, 16, False, 10000.0, 1.0, 3))
    put("rope.traditional", rope_ref(x, 16, True, 10000.0, 1.0, 3))
    put("rope.partial_dims8_scale05", rope_ref(x, 8, False, 500.0, 0.5, 0))
    freqs = (np.arange(1, 9, dtype=np.float32) * 3.5) ** 1.5
    put("rope.freqs", freqs)
    put("rope.custom_freqs", rope_ref(x, 16, False, 0.0, 1.0, 7, freqs))
    put("rope.offsets", np.array([2, 11], np.int32), np.int32)
    put("rope.array_offset", rope_ref(x, 16, False, 10000.0, 1.0, np.array([2, 11])))

    y = randn(3, 7)
    w = randn(7)
    bias = randn(7)
    put("norm.x", y)
    put("norm.w", w)
    put("norm.b", bias)
    put("norm.rms", y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5) * w)
    mu = y.mean(-1, keepdims=True)
    var = ((y - mu) ** 2).mean(-1, keepdims=True)
    put("norm.layer", (y - mu) / np.sqrt(var + 1e-5) * w + bias)
    put("norm.layer_plain", (y - mu) / np.sqrt(var + 1e-5))

    # Attention: q [B, Hq, L, D], k/v [B, Hkv, S, D].
    for hq, hkv, length, s in [(4, 4, 5, 5), (4, 2, 5, 5), (8, 2, 3, 7), (4, 1, 1, 6)]:
        tag = f"sdpa.h{hq}_{hkv}_l{length}_s{s}"
        d = 8
        q, k, v = randn(1, hq, length, d), randn(1, hkv, s, d), randn(1, hkv, s, d)
        scale = 1 / math.sqrt(d)
        rep = hq // hkv
        kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = (q @ kk.transpose(0, 1, 3, 2)) * scale
        put(f"{tag}.q", q)
        put(f"{tag}.k", k)
        put(f"{tag}.v", v)
        put(f"{tag}.none", softmax(scores) @ vv)
        # causal, queries aligned to the end of the keys
        causal = np.arange(length)[:, None] + (s - length) >= np.arange(s)[None, :]
        put(f"{tag}.causal", softmax(np.where(causal, scores, -np.inf)) @ vv)
        boolmask = RNG.random((length, s)) > 0.3
        boolmask[:, 0] = True  # every query sees at least one key
        put(f"{tag}.boolmask", boolmask, np.bool_)
        put(f"{tag}.bool", softmax(np.where(boolmask, scores, -np.inf)) @ vv)
        additive = randn(1, hq, length, s)
        put(f"{tag}.additive_mask", additive)
        put(f"{tag}.additive", softmax(scores + additive) @ vv)


def creation() -> None:
    put("create.arange_2_11_3", np.arange(2, 11, 3), np.float32)
    put("create.arange_i32", np.arange(0, 5), np.int32)


def random_from_mlx() -> None:
    try:
        import mlx.core as mx
    except ImportError:  # numpy-only environments skip the PRNG cross-check values
        return
    key = mx.random.key(42)
    put("random.key42", np.array(key), np.uint32)
    put("random.uniform_key42", np.array(mx.random.uniform(shape=(8,), key=key)))
    put("random.normal_key42", np.array(mx.random.normal(shape=(8,), key=key)))
    k1, k2 = mx.random.split(key)
    put("random.split_key42", np.array(mx.random.split(key, 2)), np.uint32)


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    arithmetic()
    matmuls()
    reductions()
    indexing()
    conv()
    fast()
    creation()
    random_from_mlx()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / "ops.safetensors")
    print(f"wrote {len(OUT)} arrays to {out_dir / 'ops.safetensors'}")


if __name__ == "__main__":
    main()
