# The verify-window question on CUDA: what a Gemma 4 forward of T tokens costs in mlx-lm itself.
# python3 tests/bench/window_probe.py CHECKPOINT_DIR   (run on the GPU machine; figures in README)
# mlx-lm's own Gemma 4 on the E4B checkpoint: what a forward of T tokens costs after a
# 256-token prompt, T = 1..9 (a decode step is T=1; a verify window of k drafts is T=k+1).
import sys, time
import mlx.core as mx
from pathlib import Path
from mlx_lm.utils import load_model
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache, can_trim_prompt_cache

model, _ = load_model(Path(sys.argv[1]))
cache = make_prompt_cache(model)
prompt = mx.array([[(i * 7919) % 200000 + 1000 for i in range(256)]])
mx.eval(model(prompt, cache=cache))
print("trimmable:", can_trim_prompt_cache(cache))
def run(T, iters=30):
    ids = mx.array([[1234 + t for t in range(T)]])
    times = []
    for i in range(iters + 5):
        t = time.perf_counter()
        logits = model(ids, cache=cache)
        mx.eval(logits.argmax(-1))
        times.append(time.perf_counter() - t)
        trim_prompt_cache(cache, T)
    times = sorted(times[5:])
    return times[len(times) // 2] * 1e3
base = run(1)
print(f"T=1 {base:.2f} ms")
for T in range(2, 10):
    ms = run(T)
    print(f"T={T} {ms:.2f} ms  {ms / base:.2f}x")
