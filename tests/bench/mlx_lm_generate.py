"""The reference half of `quince bench --compare`: mlx-lm's generate_step on the same checkpoint
and the same synthetic prompt, timed the way `quince bench` times itself.

Prints one JSON line: prompt_tokens, generated_tokens, ttft_ms, prefill_tok_s, decode_tok_s,
peak_mem_bytes, each the median of --repeats runs after a full-length warm-up. Keep the prompt formula in step with crates/cli/src/bench.rs (`synthetic_prompt`).

With --kv-bits, generate_step quantizes the KV cache (`kv_bits`, `kv_group_size`,
`quantized_kv_start`). `--kv-layers all` is mlx-lm as shipped (on Gemma 4 its sliding-window
caches raise "RotatingKVCache Quantization NYI"); `--kv-layers full` converts only the
full-attention `KVCache`s, what mlx-lm can quantize. When mlx-lm cannot run the storage, the line
is `{"error": ...}`.
"""

import argparse
from pathlib import Path
import json
import statistics
import time

import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [3 + (i * 7919 + 13) % (vocab - 3) for i in range(n)]


def full_layers_only(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    """mlx-lm's maybe_quantize_kv_cache, for plain KVCache entries alone."""
    if kv_bits is None:
        return
    for i, c in enumerate(prompt_cache):
        if type(c) is KVCache and c.offset >= quantized_kv_start:
            prompt_cache[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


def run(model, prompt: list[int], gen: int, kv: dict) -> dict:
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    count = 0
    steps = generate_step(mx.array(prompt), model, max_tokens=gen, prefill_step_size=512, **kv)
    for _token, _ in steps:
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    ttft = first - start
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": count,
        "ttft_ms": ttft * 1e3,
        "prefill_tok_s": len(prompt) / ttft,
        "decode_tok_s": (count - 1) / (end - first) if count > 1 else 0.0,
        "peak_mem_bytes": mx.get_peak_memory(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-bits", type=int)
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--quantized-kv-start", type=int, default=0)
    parser.add_argument("--kv-layers", choices=["all", "full"], default="all")
    args = parser.parse_args()
    kv = {}
    if args.kv_bits is not None:
        kv = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                  quantized_kv_start=args.quantized_kv_start)
        if args.kv_layers == "full":
            # The module (the package's `generate` attribute is the function of that name).
            sys.modules["mlx_lm.generate"].maybe_quantize_kv_cache = full_layers_only
    model, config = load_model(Path(args.model))
    text = config.get("text_config", config)
    vocab = text.get("vocab_size", config.get("vocab_size"))
    prompt = synthetic_prompt(args.prompt_tokens, vocab)
    try:
        run(model, prompt, 4, kv)  # warm-up at full length (kernels for every shape), as quince bench does
        runs = [run(model, prompt, args.gen_tokens, kv) for _ in range(args.repeats)]
    except Exception as e:  # noqa: BLE001 (the storage mlx-lm cannot run is the finding)
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(json.dumps({"error": f"{type(e).__name__}: {first_line}"}))
        sys.exit(0)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    median["decode_tok_s_runs"] = [r["decode_tok_s"] for r in runs]
    print(json.dumps(median))


if __name__ == "__main__":
    main()
