#!/usr/bin/env bash
# On the GPU machine: decode speed with and without overlapped decoding (`--overlap on|off`),
# alternating in one invocation, with the host's CPU facts and the GPU's own time per step.
# Usage: h200_overlap_ab.sh QUINCE MODEL [PROMPT_TOKENS] [ROUNDS]
Q=$1
MODEL=$2
P=${3:-512}
ROUNDS=${4:-3}
echo "cpus: nproc $(nproc), affinity $(taskset -pc $$ 2>/dev/null | cut -d: -f2)," \
  "cgroup quota $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo unknown)"
bench() {
  "$Q" bench --model "$MODEL" --prompt-tokens "$P" --gen-tokens 128 --repeats 3 "$@" 2>&1 \
    | grep -E "decode \(tok|host ms|graph build|waiting|reading|GPU clock" | tr -s ' ' | tr '\n' ';'
}
for round in $(seq "$ROUNDS"); do
  echo "== round $round, prompt $P"
  echo "overlap on:  $(bench --overlap on)"
  echo "overlap off: $(bench --overlap off)"
done
echo "GPU alone:   $(MLX_MAX_OPS_PER_BUFFER=5000 bench --gpu-clock)"
