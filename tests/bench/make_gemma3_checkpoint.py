"""Builds a random-weight Gemma 3 text checkpoint (`gemma3_text`) at real model dimensions with
mlx-lm, for speed benchmarks (`quince bench --compare`) on a GPU: MLX's default init in bf16,
optionally affine-quantized (group 64) by mlx-lm's quantize_model, saved with mlx-lm's own
savers, so both engines load the same files.

Usage: python tests/bench/make_gemma3_checkpoint.py --dims 4b --bits 4 --out DIR
"""

import argparse
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gemma3_text import Model, ModelArgs
from mlx_lm.utils import quantize_model, save_config, save_model

DIMS = {
    # google/gemma-3-4b-it's text model: 34 layers (5 sliding : 1 global), linear rope ×1/8.
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               query_pre_attn_scalar=256, sliding_window=1024,
               rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # google/gemma-3-1b-it: 26 layers, no rope scaling.
    "1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
               num_attention_heads=4, num_key_value_heads=1, head_dim=256,
               query_pre_attn_scalar=256, sliding_window=512, rope_scaling=None),
    # A small shape for checking this script on a CPU.
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                  query_pre_attn_scalar=64, sliding_window=64, rope_scaling=None),
}


def config_for(name: str) -> dict:
    return {
        "model_type": "gemma3_text",
        **DIMS[name],
        "vocab_size": 262208 if name != "small" else 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", choices=sorted(DIMS), default="4b")
    parser.add_argument("--bits", type=int, default=4, help="0 keeps bf16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    config = config_for(args.dims)
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if args.bits:
        model, config = quantize_model(model, config, 64, args.bits)
    out = Path(args.out)
    save_model(out, model)
    save_config(config, out / "config.json")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**30:.2f} GiB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
