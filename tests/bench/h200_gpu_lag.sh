#!/usr/bin/env bash
# On the GPU machine: what makes the GPU start a Quince decode step milliseconds after MLX
# launched it (README, "The GPU starts a step long after MLX launched it"). Plain MLX first
# (tests/bench/stream_lag.py, one line per kind of op), then Quince's own timeline
# (`quince bench --gpu-clock`) with each suspect switched in turn, in one invocation.
# Usage: h200_gpu_lag.sh QUINCE MODEL [PROMPT_TOKENS]
Q=$1
MODEL=$2
P=${3:-512}
for kind in add host_scalars qmv custom; do
  for ops in 30 100; do
    echo "plain MLX, $kind, $ops ops per graph: $(MLX_MAX_OPS_PER_BUFFER=$ops timeout 60 \
      python3 tests/bench/stream_lag.py --ops 600 --steps 60 --kind "$kind" 2>&1 | tail -1)"
  done
done
timeline() {
  timeout 120 "$Q" bench --model "$MODEL" --prompt-tokens "$P" --gen-tokens 128 --repeats 2 \
    --gpu-clock "$@" 2>&1 | grep -E "decode \(tok|read back|rror" | tr -s ' ' | tr '\n' ';'
}
echo "quince default:              $(timeline)"
echo "quince --device-step-ints on: $(timeline --device-step-ints on)"
echo "quince --decode-fusion off:  $(timeline --decode-fusion off)"
echo "quince --buffer-reads off:   $(timeline --buffer-reads off)"
echo "quince default again:        $(timeline)"
