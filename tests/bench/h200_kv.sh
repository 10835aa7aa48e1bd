#!/usr/bin/env bash
# The KV-storage figures of docs/benchmarks.md on a GPU machine, after MLX-CUDA, mlx-lm and
# mlx-vlm are installed there:
#   tests/bench/h200_kv.sh QUINCE speed OUT   E4B dims, 4-bit weights, random: decode speed and
#                                             peak memory at 4K and 32K tokens for each KV
#                                             storage, against mlx-lm in the same invocation
#                                             (SWEEP, REPEATS, GEN override the storages, runs
#                                             and generated tokens)
#   tests/bench/h200_kv.sh QUINCE quality OUT IDS
#                                             the trained demo (tests/models/demo) on held-out
#                                             text (IDS: its token ids, comma-separated): each
#                                             storage against full precision (quince eval)
set -uo pipefail
quince=$1 what=$2 out=$3
case $what in
speed)
  python3 tests/bench/make_gemma4_checkpoint.py --dims e4b --bits 4 --out /tmp/e4b-4bit
  common=(--prompt-tokens 4096,32768 --gen-tokens "${GEN:-64}" --repeats "${REPEATS:-2}" --compare
    --python python3)
  # KV sharing as E4B has it: mlx-lm cannot quantize this model's KV cache at all.
  "$quince" bench --model /tmp/e4b-4bit "${common[@]}" --kv-sweep "${SWEEP:-full,affine8,affine4,turbo3}" \
    | tee "$out/e4b.txt"
  # Without KV sharing mlx-lm quantizes the full-attention layers: both engines do the same.
  python3 tests/bench/make_gemma4_checkpoint.py --dims e4b --bits 4 --no-kv-sharing \
    --out /tmp/e4b-4bit-noshare
  "$quince" bench --model /tmp/e4b-4bit-noshare "${common[@]}" --kv-layers full \
    --kv-sweep full,affine8,affine4 | tee "$out/e4b-noshare.txt"
  ;;
quality)
  ids=$4
  mkdir -p /tmp/demo
  gunzip -c tests/models/demo/model.safetensors.gz > /tmp/demo/model.safetensors
  cp tests/models/demo/config.json /tmp/demo/
  for kv in "--kv-bits 8" "--kv-bits 4" "--kv-bits 3 --kv-scheme turbo" \
    "--kv-bits 3.5 --kv-scheme turbo"; do
    # shellcheck disable=SC2086
    "$quince" eval --model /tmp/demo --tokens "$(cat "$ids")" --context 512 --rows 16 \
      --prompts 0 --prompt-tokens 64 --kv-tokens 512 $kv --json | tee -a "$out/quality.jsonl"
  done
  ;;
esac
