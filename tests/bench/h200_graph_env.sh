#!/usr/bin/env bash
# On the GPU machine: decode speed of quince (its default decode) and mlx-lm under MLX-CUDA's
# graph settings, each setting in the same invocation. MLX records kernels into CUDA graphs,
# launches one every MLX_MAX_OPS_PER_BUFFER ops (30 on sm90; quince sets 100 unless it is set)
# and keeps up to MLX_CUDA_GRAPH_CACHE_SIZE instantiated graphs (100; all are dropped when it
# overflows) keyed by their topology; MLX_USE_CUDA_GRAPHS=0 launches each kernel directly.
# Usage: h200_graph_env.sh QUINCE MODEL [ROUNDS]
Q=$1
MODEL=$2
ROUNDS=${3:-1}
run() {
  local label=$1
  shift
  local ours ref
  ours=$(env "$@" "$Q" bench --model "$MODEL" --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>&1 | grep -E "decode \(tok|host ms|graph building" | tr -s ' ' | tr '\n' ';')
  ref=$(env "$@" python3 tests/bench/mlx_lm_generate.py --model "$MODEL" --prompt-tokens 512 --gen-tokens 128 --repeats 3 2>/dev/null | tail -1 | python3 -c "import json,sys; print(round(json.load(sys.stdin)['decode_tok_s'], 1))")
  echo "== $label: quince $ours mlx-lm $ref"
}
for round in $(seq "$ROUNDS"); do
  run "default" X=1
  run "graph cache 4000" MLX_CUDA_GRAPH_CACHE_SIZE=4000
  run "ops/graph 100, cache 4000" MLX_MAX_OPS_PER_BUFFER=100 MLX_CUDA_GRAPH_CACHE_SIZE=4000
  run "ops/graph 50" MLX_MAX_OPS_PER_BUFFER=50
  run "ops/graph 200" MLX_MAX_OPS_PER_BUFFER=200
  run "no CUDA graphs" MLX_USE_CUDA_GRAPHS=0
done
