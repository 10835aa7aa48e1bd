"""Next-turn TTFT of a reopened long conversation: resumed from its KV checkpoint vs a cold
re-prefill of the whole conversation, in one run, side by side.

Every measurement is a fresh `quince chat` process (a reopened app): the resumed runs start from
a copy of the same data folder (the conversation and its checkpoint on disk); the cold runs send
the same whole conversation with checkpoints off. TTFT is measured inside quince from the start of
the turn: reading and verifying the checkpoint, restoring it, prefilling the new tokens, and the
first sampled token (model loading is excluded from both).

    python tests/bench/resume.py --quince target/release/quince --model target/demo-model
"""

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return [3 + (i * 7919 + seed) % (vocab - 3) for i in range(n)]


def chat(quince: str, data: Path, model: str, tokens: list[int], extra: list[str]) -> dict:
    out = subprocess.run(
        [quince, "chat", "--data-dir", str(data), "--conversation", "long", "--model", model,
         "--tokens", ",".join(map(str, tokens)), "--max-tokens", "8", "--ignore-eos", "--json", *extra],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quince", default="target/release/quince")
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, default=8192, help="tokens already in the conversation")
    p.add_argument("--turn", type=int, default=32, help="tokens of the new user turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    vocab = json.loads((Path(a.model) / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    history, turn = ids(a.context, vocab, 13), ids(a.turn, vocab, 101)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        first = chat(a.quince, base, a.model, history, [])
        reply = first["token_ids"]
        checkpoint = Path(first["checkpoint"])
        resumed, cold = [], []
        for r in range(a.repeats):
            # A reopened conversation: the same folder each time, the next turn from its checkpoint.
            data = tmp / f"resumed{r}"
            shutil.copytree(base, data)
            resumed.append(chat(a.quince, data, a.model, turn, []))
            # The same conversation, cold: everything prefilled from nothing.
            cold.append(chat(a.quince, tmp / f"cold{r}", a.model, history + reply + turn,
                             ["--no-checkpoints"]))
        # Each path is deterministic; resumed and cold agree exactly in f32 (the tests hold them
        # to it). In bf16 a position's keys depend on the shape of the prefill chunk that made
        # them, so on random weights (near-flat logits) greedy picks may part: report it.
        assert all(x["token_ids"] == resumed[0]["token_ids"] for x in resumed), "resumed runs differ"
        same = resumed[0]["token_ids"] == cold[0]["token_ids"]
        med = lambda rows, key: statistics.median(x[key] for x in rows)
        result = {
            "model": a.model,
            "conversation_tokens": len(history) + len(reply) + len(turn),
            "checkpoint_bytes": checkpoint.stat().st_size,
            "resumed": {"ttft_ms": med(resumed, "ttft_ms"), "restore_ms": med(resumed, "restore_ms"),
                        "reused_tokens": resumed[0]["reused_tokens"],
                        "prefilled_tokens": resumed[0]["prefilled_tokens"],
                        "ttft_ms_runs": [x["ttft_ms"] for x in resumed]},
            "cold": {"ttft_ms": med(cold, "ttft_ms"), "prefilled_tokens": cold[0]["prefilled_tokens"],
                     "ttft_ms_runs": [x["ttft_ms"] for x in cold]},
        }
        result["ratio"] = result["resumed"]["ttft_ms"] / result["cold"]["ttft_ms"]
        result["same_tokens"] = same
    same = result["same_tokens"]
    if a.json:
        print(json.dumps(result))
        return
    print(f"next-turn TTFT, {result['conversation_tokens']}-token conversation, {a.model}")
    print(f"  checkpoint file: {result['checkpoint_bytes'] / 2**20:.1f} MiB; medians of {a.repeats} fresh processes")
    print(f"  {'':10} {'TTFT ms':>10} {'reused':>8} {'prefilled':>10}")
    r, c = result["resumed"], result["cold"]
    print(f"  {'resumed':10} {r['ttft_ms']:>10.1f} {r['reused_tokens']:>8} {r['prefilled_tokens']:>10}")
    print(f"  {'cold':10} {c['ttft_ms']:>10.1f} {0:>8} {c['prefilled_tokens']:>10}")
    print(f"  of which finding, verifying and restoring the checkpoint: {r['restore_ms']:.1f} ms")
    print(f"  ratio resumed/cold: {result['ratio']:.3f}  (same greedy tokens: {'yes' if same else 'no'})")


if __name__ == "__main__":
    main()
