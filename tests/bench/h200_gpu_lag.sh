#!/usr/bin/env bash
# On the GPU machine: what bounds a Quince decode step (docs/benchmarks.md, "What bounds a
# step"). Plain MLX first (tests/bench/stream_lag.py, one line per kind of op), then Quince's
# own timeline (`quince bench --gpu-clock`: the step's token input depends on its start read,
# so the read times the whole step) with each suspect switched in turn, in one invocation:
# Quince's 4-bit matrix-vector kernel (--quantized-kernel), graph sizes, the fused decode
# kernels (--decode-fusion), all of Quince's kernels (--kernels mlx), and MLX-CUDA's graphs
# (MLX_USE_CUDA_GRAPHS=0 launches kernels directly; a larger MLX_CUDA_GRAPH_CACHE_SIZE rules
# out graph re-instantiation from cache eviction).
# Usage: h200_gpu_lag.sh QUINCE MODEL [PROMPT_TOKENS]
Q=$1
MODEL=$2
P=${3:-512}
for kind in add host_scalars qmv custom; do
  echo "plain MLX, $kind, 100 ops per graph: $(MLX_MAX_OPS_PER_BUFFER=100 timeout 60 \
    python3 tests/bench/stream_lag.py --ops 600 --steps 60 --kind "$kind" 2>&1 | tail -1)"
done
timeline() {
  timeout 120 "$Q" bench --model "$MODEL" --prompt-tokens "$P" --gen-tokens 128 --repeats 2 \
    --gpu-clock "$@" 2>&1 | grep -E "decode \(tok|read back|rror|hrash" | tr -s ' ' | tr '\n' ';'
}
echo "quince default:               $(timeline)"
echo "quince --quantized-kernel off: $(timeline --quantized-kernel off)"
echo "quince 200 ops per graph:     $(MLX_MAX_OPS_PER_BUFFER=200 timeline)"
echo "quince one graph per step:    $(MLX_MAX_OPS_PER_BUFFER=5000 timeline)"
echo "quince --decode-fusion off:   $(timeline --decode-fusion off)"
echo "quince --kernels mlx:          $(timeline --kernels mlx)"
echo "quince MLX_USE_CUDA_GRAPHS=0: $(MLX_USE_CUDA_GRAPHS=0 timeline)"
echo "quince graph cache 4000:      $(MLX_CUDA_GRAPH_CACHE_SIZE=4000 timeline)"
echo "quince default again:         $(timeline)"
