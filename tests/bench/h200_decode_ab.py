# On the GPU machine: python3 tests/bench/h200_decode_ab.py QUINCE MODEL [ROUNDS]
#
# Decode tok/s of quince (op by op and compiled) and mlx-lm under MLX-CUDA's default graph
# batching (30 ops per CUDA graph on sm90) and under Quince's (engine::CUDA_GRAPH_OPS), arm by
# arm in interleaved rounds so that drifts of the shared machine fall on every arm alike.
# Prints each arm's runs and median. Each run is itself the median of 3 generations.
import json
import os
import statistics
import subprocess
import sys

quince, model = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
common = ["--model", model, "--prompt-tokens", "512", "--gen-tokens", "128", "--repeats", "3"]
arms = []
for ops in ("30", "100"):
    env = {"MLX_MAX_OPS_PER_BUFFER": ops}
    arms.append((f"quince op by op, graphs of {ops}", env, [quince, "bench", *common, "--no-compile", "--json"]))
    arms.append((f"quince compiled, graphs of {ops}", env, [quince, "bench", *common, "--compile", "--json"]))
    arms.append((f"mlx-lm, graphs of {ops}", env, ["python3", "tests/bench/mlx_lm_generate.py", *common]))

runs = {name: [] for name, _, _ in arms}
for r in range(rounds):
    for name, env, cmd in arms:
        out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=200)
        try:
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])
            print(f"{name}: {runs[name][-1]:.1f} tok/s", flush=True)
        except Exception:  # a failed run is shown, not fatal
            print(f"{name}: failed: {out.stderr[-400:]}", flush=True)
    print(f"round {r + 1} done", flush=True)
for name, values in runs.items():
    if values:
        print(f"{name:32} median {statistics.median(values):7.1f} tok/s  runs {[round(v, 1) for v in values]}")
