"""Builds a random-weight Qwen3.5 text checkpoint at real model dimensions with mlx-lm, for
speed benchmarks (`quince bench --compare`) on a GPU. The weights are MLX's default init in
bf16 (A_log and dt_bias as mlx-lm initialises them), optionally affine-quantized (group 64)
through mlx-lm's own quantize_model, and saved with mlx-lm's save_model/save_config, so both
engines load exactly the same files.

With --mtp-out DIR it also writes a one-layer multi-token-prediction head at the same
dimensions (mlx-vlm's `qwen3_5_mtp` drafter, MLX's default init in bf16), for timing what the
head costs (`quince bench-spec --drafter DIR`): on random weights its drafts are almost never
accepted.

Usage: python tests/bench/make_qwen3_5_checkpoint.py --dims 9b --bits 4 --out DIR [--mtp-out DIR]
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_5 import Model, ModelArgs
from mlx_lm.utils import quantize_model, save_config, save_model

DIMS = {
    # Qwen/Qwen3.5-9B as its published description gives it: 32 layers (every 4th full
    # attention: 16 heads of 256, 4 KV heads, a quarter rotated, theta 1e7), gated DeltaNet
    # with 16 key heads and 32 value heads of 128, intermediate 12288, vocabulary 248,320.
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False),
    # A small shape for checking this script on a CPU.
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, vocab_size=4096, tie_word_embeddings=False),
}


def config_for(name: str) -> dict:
    text = {
        "model_type": "qwen3_5_text",
        **DIMS[name],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True, "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "eos_token_id": 1,
    }
    return {"model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"], "eos_token_id": 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", choices=sorted(DIMS), default="9b")
    parser.add_argument("--bits", type=int, default=4, help="0 keeps bf16")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mtp-out", help="also write an MTP head here")
    args = parser.parse_args()
    start = time.perf_counter()
    config = config_for(args.dims)
    model = Model(ModelArgs.from_dict(config))
    # A_log stays float32, as mlx-lm's cast predicate keeps it.
    model.set_dtype(mx.bfloat16, lambda dtype: mx.issubdtype(dtype, mx.floating))
    for layer in model.language_model.model.layers:
        if layer.is_linear:
            layer.linear_attn.A_log = layer.linear_attn.A_log.astype(mx.float32)
    mx.eval(model.parameters())
    if args.bits:
        model, config = quantize_model(model, config, 64, args.bits,
                                       quant_predicate=model.quant_predicate)
    out = Path(args.out)
    save_model(out, model)
    save_config(config, out / "config.json")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**30:.2f} GiB) in {time.perf_counter() - start:.1f} s")
    if args.mtp_out:
        write_mtp(config_for(args.dims), Path(args.mtp_out))


def write_mtp(config: dict, out: Path) -> None:
    """A one-layer MTP head for the target of `config`, as mlx-vlm's splitter writes one:
    model_type qwen3_5_mtp, the target's text_config, block size 4."""
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as MtpConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
    text = dict(config["text_config"], mtp_num_hidden_layers=1)
    cfg = {"model_type": "qwen3_5_mtp", "text_config": text, "block_size": 4}
    drafter = Qwen3_5MTPDraftModel(MtpConfig.from_dict(json.loads(json.dumps(cfg))))
    drafter.set_dtype(mx.bfloat16)
    weights = dict(sorted(tree_flatten(drafter.parameters())))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
