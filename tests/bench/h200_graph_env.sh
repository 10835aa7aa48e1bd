#!/usr/bin/env bash
# On the GPU machine: decode speed of quince and mlx-lm under MLX-CUDA's graph-batching settings.
# MLX records kernels into CUDA graphs and launches one every MLX_MAX_OPS_PER_BUFFER ops (30 on
# sm90); MLX_USE_CUDA_GRAPHS=0 launches each kernel directly. Usage: h200_graph_env.sh QUINCE MODEL
Q=$1
MODEL=$2
run() {
  local label=$1
  shift
  local ours compiled ref
  ours=$(env "$@" "$Q" bench --model "$MODEL" --prompt-tokens 512 --gen-tokens 128 --repeats 3 --no-compile 2>&1 | grep -E "decode \(tok|host time|ops in" | tr -s ' ' | tr '\n' ';')
  compiled=$(env "$@" "$Q" bench --model "$MODEL" --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>&1 | grep -E "decode \(tok" | tr -s ' ')
  ref=$(env "$@" python3 tests/bench/mlx_lm_generate.py --model "$MODEL" --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>/dev/null | tail -1)
  echo "== $label"
  echo "quince op by op: $ours"
  echo "quince compiled: $compiled"
  echo "mlx-lm: $ref"
}
run "default" X=1
run "ops/graph 100" MLX_MAX_OPS_PER_BUFFER=100
run "ops/graph 400" MLX_MAX_OPS_PER_BUFFER=400 MLX_MAX_MB_PER_BUFFER=4000
run "ops/graph 2000" MLX_MAX_OPS_PER_BUFFER=2000 MLX_MAX_MB_PER_BUFFER=100000
run "no CUDA graphs" MLX_USE_CUDA_GRAPHS=0
# The whole op census of a decode step, op by op and compiled.
"$Q" bench --model "$MODEL" --prompt-tokens 64 --gen-tokens 8 --repeats 1 --no-compile --json > "${OUT:-/tmp}/census_ops.json" 2>/dev/null
"$Q" bench --model "$MODEL" --prompt-tokens 64 --gen-tokens 8 --repeats 1 --json > "${OUT:-/tmp}/census_compiled.json" 2>/dev/null
