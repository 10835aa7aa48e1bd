"""The reference half of `quince bench --compare`: mlx-lm's generate_step on the same checkpoint
and the same synthetic prompt, timed the way `quince bench` times itself.

Prints one JSON line: prompt_tokens, generated_tokens, ttft_ms, prefill_tok_s, decode_tok_s,
peak_mem_bytes, each the median of --repeats runs after a full-length warm-up. Keep the prompt formula in step with crates/cli/src/bench.rs (`synthetic_prompt`).
"""

import argparse
from pathlib import Path
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [3 + (i * 7919 + 13) % (vocab - 3) for i in range(n)]


def run(model, prompt: list[int], gen: int) -> dict:
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    count = 0
    for _token, _ in generate_step(mx.array(prompt), model, max_tokens=gen, prefill_step_size=512):
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
    args = parser.parse_args()
    model, config = load_model(Path(args.model))
    text = config.get("text_config", config)
    vocab = text.get("vocab_size", config.get("vocab_size"))
    prompt = synthetic_prompt(args.prompt_tokens, vocab)
    run(model, prompt, 4)  # warm-up at full length (kernels for every shape), as quince bench does
    runs = [run(model, prompt, args.gen_tokens) for _ in range(args.repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    median["decode_tok_s_runs"] = [r["decode_tok_s"] for r in runs]
    print(json.dumps(median))


if __name__ == "__main__":
    main()
