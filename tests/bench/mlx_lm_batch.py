"""The reference half of `quince bench-batch --compare`: mlx-lm's BatchGenerator (continuous
batching) on the same checkpoint and per-stream prompts, timed the way `quince bench-batch`
times itself.

Per stream count: every stream inserted at once, greedy, --gen-tokens each. decode_tok_s is
the tokens after each stream's first over the time from the first generated token until the
last stream ends; step_ms_p50/p99 are the times of the generation steps after that;
first_tokens_ms is the time from the insert until every stream has its first token (the
generator prefills the streams inserted together as one padded batch). Medians
over --repeats runs after a warm-up at the largest count. Keep the prompt formula in step with
crates/cli/src/bench/batch.rs (`stream_prompt`).

Prints one JSON line:
{"rows": [{streams, decode_tok_s, step_ms_p50, step_ms_p99, first_tokens_ms, tokens}]}.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model


def stream_prompt(n: int, vocab: int, s: int) -> list[int]:
    return [3 + (i * 7919 + 13 + 101 * s) % (vocab - 3) for i in range(n)]


def vocab_size(model) -> int:
    args = model.args
    text = getattr(args, "text_config", None)
    if isinstance(text, dict) and "vocab_size" in text:
        return text["vocab_size"]
    return args.vocab_size


def run_once(model, vocab: int, streams: int, prompt_tokens: int, gen: int):
    generator = BatchGenerator(
        model,
        max_tokens=gen,
        prefill_batch_size=streams,
        completion_batch_size=max(streams, 32),
        prefill_step_size=512,
    )
    prompts = [stream_prompt(prompt_tokens, vocab, s) for s in range(streams)]
    inserted = time.perf_counter()
    uids = generator.insert(prompts, [gen] * streams)
    tokens = {uid: [] for uid in uids}
    first = None
    steps = []
    last = None
    while True:
        responses = generator.next_generated()
        now = time.perf_counter()
        if not responses:
            break
        if first is None:
            first = now
        else:
            steps.append((now - last) * 1e3)
        last = now
        for r in responses:
            tokens[r.uid].append(r.token)
    generator.close()
    decoded = sum(max(len(t) - 1, 0) for t in tokens.values())
    rate = decoded / (last - first) if last and first and last > first else 0.0
    first_tokens_ms = ((first or inserted) - inserted) * 1e3
    return rate, steps, first_tokens_ms, [tokens[u] for u in uids]


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[round((len(values) - 1) * p)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model(Path(args.model))
    vocab = vocab_size(model)
    counts = [int(s) for s in args.streams.split(",")]
    run_once(model, vocab, max(counts), args.prompt_tokens, args.gen_tokens)  # warm-up
    rows = []
    for streams in counts:
        rates, steps, firsts, tokens = [], [], [], []
        for _ in range(args.repeats):
            rate, run_steps, first_ms, tokens = run_once(
                model, vocab, streams, args.prompt_tokens, args.gen_tokens
            )
            rates.append(rate)
            firsts.append(first_ms)
            steps.extend(run_steps)
        rows.append(
            {
                "streams": streams,
                "decode_tok_s": statistics.median(rates),
                "step_ms_p50": percentile(steps, 0.5),
                "step_ms_p99": percentile(steps, 0.99),
                "first_tokens_ms": statistics.median(firsts),
                "tokens": tokens,
            }
        )
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
