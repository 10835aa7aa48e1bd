#!/usr/bin/env bash
# On the GPU machine: decode speed by decode-attention route (Quince's one-query kernel, MLX ops
# as rows), op by op and compiled, against mlx-lm in the same invocation.
# Usage: h200_attention_ab.sh QUINCE MODEL [PROMPT_TOKENS] [ROUNDS]
Q=$1
MODEL=$2
P=${3:-512}
ROUNDS=${4:-2}
bench() {
  "$Q" bench --model "$MODEL" --prompt-tokens "$P" --gen-tokens 128 --repeats 3 "$@" 2>&1 \
    | grep -E "decode \(tok|TTFT|host time" | tr -s ' ' | tr '\n' ';'
}
for round in $(seq "$ROUNDS"); do
  echo "== round $round, prompt $P"
  echo "kernel, op by op: $(bench)"
  echo "rows, op by op:   $(bench --no-compile --decode-attention rows)"
  echo "compiled (rows):  $(bench --compile)"
  echo "mlx-lm:           $(python3 tests/bench/mlx_lm_generate.py --model "$MODEL" --prompt-tokens "$P" --gen-tokens 128 --repeats 3 2>/dev/null | tail -1)"
done
