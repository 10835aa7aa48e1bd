"""Builds a random-weight Gemma 4 text checkpoint at real model dimensions with mlx-lm, for
speed benchmarks (`quince bench --compare`) on a GPU. The weights are MLX's default init in
bf16, optionally affine-quantized (group 64) through mlx-lm's own quantize_model, and saved with
mlx-lm's save_model/save_config, so both engines load exactly the same files.

With --vision the checkpoint is a multimodal `gemma4` one built through mlx-vlm: the text model
at --dims, the real Gemma 4 vision tower dimensions (bf16, not quantized, as mlx-vlm's convert
leaves it), and the real special token ids.

With --no-kv-sharing every layer keeps its own keys and values (`num_kv_shared_layers: 0`):
the layout mlx-lm can quantize the KV cache of (its KV-shared layers hand the quantized donor
to fused attention and fail), for comparing KV storages against it.

Usage: python tests/bench/make_gemma4_checkpoint.py --dims e4b --bits 4 [--vision]
  [--no-kv-sharing] --out DIR
"""

import argparse
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.gemma4_text import Model, ModelArgs
from mlx_lm.utils import quantize_model, save_config, save_model


def layer_types(n: int, period: int) -> list[str]:
    """`period - 1` sliding layers then one full layer, repeated; the last layer is full."""
    kinds = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]
    kinds[-1] = "full_attention"
    return kinds


DIMS = {
    # google/gemma-4-E4B: 42 layers (5 sliding : 1 full), 18 KV-shared, PLE 256.
    "e4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
                num_attention_heads=8, num_key_value_heads=2, num_global_key_value_heads=2,
                head_dim=256, global_head_dim=512, num_kv_shared_layers=18,
                hidden_size_per_layer_input=256, use_double_wide_mlp=False, period=6),
    # google/gemma-4-E2B: 35 layers (4 sliding : 1 full), 20 KV-shared, double-wide shared MLPs.
    "e2b": dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
                num_attention_heads=8, num_key_value_heads=1, num_global_key_value_heads=1,
                head_dim=256, global_head_dim=512, num_kv_shared_layers=20,
                hidden_size_per_layer_input=256, use_double_wide_mlp=True, period=5),
    # Gemma 4 26B-A4B's text model as we know its published config (check it against the real
    # config.json before quoting figures for it): 30 layers (5 sliding : 1 full), full layers
    # with k = v, no PLE, and beside each dense MLP 128 experts of width 704, 8 per token.
    "26b-a4b": dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                    num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                    head_dim=256, global_head_dim=512, num_kv_shared_layers=0,
                    hidden_size_per_layer_input=0, use_double_wide_mlp=False, period=6,
                    attention_k_eq_v=True, enable_moe_block=True, num_experts=128,
                    top_k_experts=8, moe_intermediate_size=704),
    # The MoE layout at a CPU-sized shape.
    "small-moe": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1,
                      head_dim=64, global_head_dim=128, num_kv_shared_layers=0,
                      hidden_size_per_layer_input=0, use_double_wide_mlp=False, period=3,
                      attention_k_eq_v=True, enable_moe_block=True, num_experts=8,
                      top_k_experts=2, moe_intermediate_size=128),
    # A small shape for checking this script on a CPU.
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=1, num_global_key_value_heads=1,
                  head_dim=64, global_head_dim=128, num_kv_shared_layers=2,
                  hidden_size_per_layer_input=32, use_double_wide_mlp=True, period=3),
}


def config_for(name: str) -> dict:
    d = dict(DIMS[name])
    period = d.pop("period")
    vocab = 262144 if not name.startswith("small") else 4096
    return {
        "model_type": "gemma4_text",
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        **d,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "layer_types": layer_types(d["num_hidden_layers"], period),
        "sliding_window": 512,
        "rms_norm_eps": 1e-6,
        "rope_traditional": False,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                               "partial_rotary_factor": 0.25},
        },
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }


def vision_config(small: bool) -> dict:
    """google/gemma-4 vision tower: 768 wide, 16 layers, 12 heads of 64, 16-px patches, 3×3 pool."""
    return {
        "model_type": "gemma4_vision",
        "hidden_size": 64 if small else 768,
        "intermediate_size": 128 if small else 3072,
        "num_hidden_layers": 2 if small else 16,
        "num_attention_heads": 2 if small else 12,
        "num_key_value_heads": 2 if small else 12,
        "head_dim": 32 if small else 64,
        "global_head_dim": 32 if small else 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 10240,
        "default_output_length": 280,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "standardize": False,
        "use_clipped_linears": False,
        "use_bidirectional_attention": "vision",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * (2 if small else 16),
        "max_position_embeddings": 131072,
    }


def build_multimodal(name: str, bits: int, out: Path) -> None:
    import mlx_vlm.utils
    from mlx_vlm.models import gemma4 as vlm_gemma4
    from mlx_vlm.quant_utils import quantize_model as vlm_quantize_model
    from mlx_vlm.utils import skip_multimodal_module

    text = config_for(name)
    text["model_type"] = "gemma4_text"
    text["use_bidirectional_attention"] = "vision"
    config = {
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": vision_config(name == "small"),
        "audio_config": None,
        "vocab_size": text["vocab_size"],
        "hidden_size": text["hidden_size"],
        "image_token_id": 258880 if name != "small" else 4000,
        "boi_token_id": 255999 if name != "small" else 4001,
        "eoi_token_id": 258882 if name != "small" else 4002,
        "audio_token_id": 258881 if name != "small" else 4003,
        "video_token_id": 258884 if name != "small" else 4004,
        "vision_soft_tokens_per_image": 280,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    cfg = dict(config)
    cfg["text_config"] = vlm_gemma4.TextConfig.from_dict(text)
    cfg["vision_config"] = vlm_gemma4.VisionConfig.from_dict(config["vision_config"])
    model = vlm_gemma4.Model(vlm_gemma4.ModelConfig.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if bits:
        model_pred = model.quant_predicate

        def predicate(path, module):
            return False if skip_multimodal_module(path) else model_pred(path, module)

        model, config = vlm_quantize_model(model, config, 64, bits, mode="affine", quant_predicate=predicate)
    out.mkdir(parents=True, exist_ok=True)
    mlx_vlm.utils.save_weights(out, model)
    with open(out / "config.json", "w") as f:
        import json

        json.dump(config, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", choices=sorted(DIMS), default="e4b")
    parser.add_argument("--bits", type=int, default=4, help="0 keeps bf16")
    parser.add_argument("--out", required=True)
    parser.add_argument("--vision", action="store_true", help="a multimodal gemma4 checkpoint")
    parser.add_argument("--no-kv-sharing", action="store_true",
                        help="every layer with its own keys and values")
    args = parser.parse_args()
    if args.no_kv_sharing:
        DIMS[args.dims]["num_kv_shared_layers"] = 0
    start = time.perf_counter()
    if args.vision:
        build_multimodal(args.dims, args.bits, Path(args.out))
        size = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
        print(f"wrote {args.out} ({size / 2**30:.2f} GiB) in {time.perf_counter() - start:.1f} s")
        return
    config = config_for(args.dims)
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    if args.bits:
        # The model's own predicate: the MoE router at 8 bits, as mlx-lm's convert does.
        model, config = quantize_model(model, config, 64, args.bits,
                                       quant_predicate=model.quant_predicate)
    out = Path(args.out)
    save_model(out, model)
    save_config(config, out / "config.json")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**30:.2f} GiB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
