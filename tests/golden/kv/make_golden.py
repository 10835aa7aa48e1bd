"""Golden parity fixtures for Quince's encoded KV storages, produced by the reference libraries.

Reference: mlx 0.32.4 (CPU), mlx-lm 0.32.2, mlx-vlm 0.7.10 (pins in tests/reference/).
See SCHEMA.md next to this script for what each file holds.

Usage: python tests/golden/kv/make_golden.py [--out DIR] [--check]
  --out DIR  where to write (default: next to this script)
  --check    regenerate into a temporary folder and compare with the files in --out, and the
             codebook table the engine embeds with a fresh one; exit 1 on a mismatch.

- affine/: mlx-lm's Gemma 4 model (the `k_eq_v` checkpoint of tests/golden/gemma4, which has no
  KV-shared layers) driven step by step with its own caches, each full-attention `KVCache`
  converted by `to_quantized(group_size, bits)` after the forward call in which its offset reaches
  `quantized_kv_start`, as `maybe_quantize_kv_cache` does (mlx-lm's `generate_step` cannot run
  Gemma 4 with `kv_bits`: its sliding layers raise "RotatingKVCache Quantization NYI").
- turbo/: mlx-vlm's `TurboQuantKVCache` (MSE codec) on random keys and values: the packed codes
  and norms it stores, the rotation signs and codebooks, and its attention outputs for a decode
  query and for a causal window.
- crates/cache/src/turbo/codebooks.rs: mlx-vlm's Lloyd-Max codebooks as f32 bit patterns,
  which the engine embeds (numpy's float32 arithmetic makes them impossible to re-derive exactly).
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import mlx.core as mx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "gemma4"))
import make_golden as g4  # noqa: E402  (the shared helpers)

from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402
from mlx_vlm import turboquant as tq  # noqa: E402
from mlx_vlm.models.base import scaled_dot_product_attention as vlm_sdpa  # noqa: E402

CODEBOOKS_RS = ROOT / "crates/cache/src/turbo/codebooks.rs"
CODEBOOK_DIMS = [16, 32, 64, 128, 256, 512, 1024]
CODEBOOK_BITS = [1, 2, 3, 4]

GREEDY_TOKENS = 48
# (bits, group_size, quantized_kv_start): start 0 converts after the prefill; 44 and 60 are
# reached during decoding (the prompt is 40 tokens).
AFFINE_CASES = [(4, 32, 0), (4, 64, 0), (8, 32, 0), (8, 64, 0), (4, 64, 44), (8, 32, 60)]

# (key dim, tokens, kv heads, query heads, bits, dtype)
TURBO_CASES = [
    (32, 9, 1, 2, 3.0, "float32"),
    (64, 9, 1, 2, 4.0, "float32"),
    (64, 13, 2, 4, 3.0, "float32"),
    (64, 13, 2, 4, 3.5, "float32"),
    (64, 7, 1, 1, 2.5, "float32"),
    (256, 11, 2, 4, 3.0, "bfloat16"),
    (512, 6, 1, 2, 4.0, "bfloat16"),
]
WINDOW = 5  # query rows of the causal window read


def affine_goldens(log) -> dict:
    folder = HERE.parent / "gemma4" / "k_eq_v"
    model = g4.load_lm(folder)
    prompt = g4.make_prompt(g4.CHECKPOINTS["k_eq_v"]["prompt_seed"])
    out = {"prompt": mx.array(prompt.astype(np.uint32))}
    for bits, group, start in AFFINE_CASES:
        cache = model.make_cache()

        def convert():
            for i, c in enumerate(cache):
                if type(c) is KVCache and c.offset >= start:
                    cache[i] = c.to_quantized(group_size=group, bits=bits)

        model(mx.array(prompt[None, :-1]), cache=cache)
        convert()
        mx.eval([c.state for c in cache])
        token = mx.array(prompt[None, -1:])
        tokens, logits = [], []
        for _ in range(GREEDY_TOKENS):
            row = model(token, cache=cache)[0, -1].astype(mx.float32)
            convert()
            mx.eval(row)
            logits.append(row)
            tokens.append(int(mx.argmax(row).item()))
            token = mx.array([[tokens[-1]]])
        quantized = sum(isinstance(c, QuantizedKVCache) for c in cache)
        if quantized != 2:
            raise SystemExit(f"affine {bits}/{group}/{start}: {quantized} quantized caches, not 2")
        name = f"b{bits}_g{group}_s{start}"
        out[f"{name}.tokens"] = mx.array(np.array(tokens, dtype=np.uint32))
        out[f"{name}.logits"] = mx.stack(logits)
        log(f"affine {name}: first tokens {tokens[:6]}")
    return out


def turbo_goldens(log) -> dict:
    out = {}
    for i, (dim, tokens, kv_heads, heads, bits, dtype) in enumerate(TURBO_CASES):
        rng = np.random.RandomState(300 + i)
        dt = getattr(mx, dtype)
        k = mx.array(rng.standard_normal((1, kv_heads, tokens, dim)).astype(np.float32)).astype(dt)
        v = mx.array(rng.standard_normal((1, kv_heads, tokens, dim)).astype(np.float32)).astype(dt)
        q1 = mx.array(rng.standard_normal((1, heads, 1, dim)).astype(np.float32)).astype(dt)
        qw = mx.array(rng.standard_normal((1, heads, WINDOW, dim)).astype(np.float32)).astype(dt)
        scale = float(dim) ** -0.5
        cache = tq.TurboQuantKVCache(bits=bits)
        ks, vs = cache.update_and_fetch(k, v)
        decode = vlm_sdpa(q1, ks, vs, cache, scale=scale, mask=None)
        window = vlm_sdpa(qw, ks, vs, cache, scale=scale, mask="causal")
        kstate, vstate = cache.state
        name = f"case{i}"
        out[f"{name}.keys"] = k
        out[f"{name}.values"] = v
        out[f"{name}.query"] = q1
        out[f"{name}.window_query"] = qw
        out[f"{name}.key_codes"] = kstate.indices
        out[f"{name}.key_norms"] = kstate.norms
        out[f"{name}.value_codes"] = vstate.indices
        out[f"{name}.value_norms"] = vstate.norms
        out[f"{name}.decode"] = decode
        out[f"{name}.window"] = window
        out[f"{name}.bits"] = mx.array([cache.key_bits, cache.value_bits], dtype=mx.float32)
        log(f"turbo {name}: D={dim} bits={bits} K{cache.key_bits:g}/V{cache.value_bits:g}")
    for dim in sorted({c[0] for c in TURBO_CASES}):
        for seed in (0, 1):
            out[f"signs.{dim}.{seed}"] = tq._rht_sign_vector(dim, seed)
    return out


def codebooks_rs() -> str:
    lines = [
        "//! mlx-vlm 0.7.10's TurboQuant codebooks (`mlx_vlm.turboquant._codebook(dim, bits)`) as",
        "//! f32 bit patterns, ascending. Generated by `tests/golden/kv/make_golden.py`; do not edit.",
        "",
        "/// `(head dim, bits, codebook)` for the dims and bits TurboQuant storage takes.",
        "#[rustfmt::skip]",
        "pub(super) const CODEBOOKS: &[(usize, u8, &[u32])] = &[",
    ]
    for dim in CODEBOOK_DIMS:
        for bits in CODEBOOK_BITS:
            words = np.array(tq._codebook(dim, bits)).view(np.uint32)
            body = ", ".join(f"0x{w:08x}" for w in words)
            lines.append(f"    ({dim}, {bits}, &[{body}]),")
    lines.append("];")
    return "\n".join(lines) + "\n"


def generate(out: Path, log=print) -> None:
    (out / "affine").mkdir(parents=True, exist_ok=True)
    (out / "turbo").mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "affine" / "golden.safetensors"), affine_goldens(log),
                        metadata={"checkpoint": "tests/golden/gemma4/k_eq_v"})
    mx.save_safetensors(str(out / "turbo" / "golden.safetensors"), turbo_goldens(log),
                        metadata={"window": str(WINDOW)})
    if out == HERE:
        CODEBOOKS_RS.write_text(codebooks_rs())
        log(f"wrote {CODEBOOKS_RS.relative_to(ROOT)}")


def check(out: Path) -> int:
    rc = g4.check_folders(out, ["affine", "turbo"], generate, "kv-golden-", Path(__file__))
    if CODEBOOKS_RS.read_text() != codebooks_rs():
        print(f"GOLDEN CHECK FAILED: {CODEBOOKS_RS.relative_to(ROOT)} differs from mlx-vlm's codebooks")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(g4.cli(__doc__, HERE, generate, check))
