"""Golden parity fixtures for Qwen3.5 (`qwen3_5`, dense) and Qwen3.5-MoE (`qwen3_5_moe`): tiny
random-weight checkpoints built with mlx-lm's own model classes, and what mlx-lm computes on
them.

Reference: mlx 0.32.4 (CPU), mlx-lm 0.32.2 (pins in tests/reference/).
See SCHEMA.md next to this script for what each folder and tensor holds.

Usage: python tests/golden/qwen3_5/make_golden.py [--out DIR] [--check]
  --out DIR  where to write (default: next to this script)
  --check    regenerate into a temporary folder and compare with the files in --out
             (floats within 1e-5 absolute, integers and config.json exactly); exit 1 on mismatch.

The helpers (checkpoint writing, strict loading, greedy capture, --check) are Gemma 4's script's.
"""

import copy
import io
import json
import shutil
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gemma4"))
import make_golden as g4  # noqa: E402  (the shared helpers)

import mlx_lm.utils  # noqa: E402
from mlx_lm.models import qwen3_5, qwen3_5_moe  # noqa: E402

TEXT = {
    # Every key mlx-lm's TextModelArgs reads, set explicitly. 8 layers with
    # full_attention_interval 4: layers 3 and 7 are gated full attention, the rest gated
    # DeltaNet. Two value heads per key head (Hv/Hk = 2), Dk 32 != Dv 16, head_dim 32 with a
    # quarter of it rotated (8 dims: mrope_section [2, 1, 1] pairs).
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": g4.VOCAB,
    "max_position_embeddings": 32768,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "rope_theta": 100000.0,
        "partial_rotary_factor": 0.25,
    },
    "eos_token_id": 1,
    "bos_token_id": 2,
    "pad_token_id": 0,
}

MOE = {
    # Routed experts on every layer (decoder_sparse_step 1) plus a gated shared expert; a tied
    # head.
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "norm_topk_prob": True,
    "tie_word_embeddings": True,
}


def config(kind: str) -> dict:
    text = copy.deepcopy(TEXT)
    if kind == "qwen3_5_moe":
        text.update(MOE)
        text["model_type"] = "qwen3_5_moe_text"
    return {
        "model_type": kind,
        "architectures": ["Qwen3_5ForConditionalGeneration" if kind == "qwen3_5"
                          else "Qwen3_5MoeForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "eos_token_id": 1,
    }


CHECKPOINTS = {
    "dense": dict(kind="qwen3_5", seed=21, prompt_seed=121),
    "dense_q4": dict(kind="quantized", source="dense", bits=4, group_size=32, prompt_seed=121),
    "moe": dict(kind="qwen3_5_moe", seed=22, prompt_seed=122),
    "moe_q4": dict(kind="quantized", source="moe", bits=4, group_size=32, prompt_seed=122),
    "dense_hf": dict(kind="hf_layout", source="dense", prompt_seed=121),
    "mtp": dict(kind="mtp", source="dense", seed=23, prompt_seed=121),
    "vision": dict(kind="vision", source="dense", seed=24, prompt_seed=121),
}


def random_weights(model, seed: int) -> dict:
    """RandomState(seed) over the parameters sorted by name, float32: RMSNorm weights (mlx
    layout, which scales by w) 1 + 0.1*N; A_log = log U(0.05, 1), so the decay
    exp(-A * softplus(a + dt_bias)) keeps a useful share of the state from step to step;
    dt_bias 1; the depthwise convolution 0.5*N (four taps); everything else 0.05*N."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        parts = name.split(".")
        shape = tuple(p.shape)
        if parts[-1] == "A_log":
            w = np.log(rng.uniform(0.05, 1.0, size=shape))
        elif parts[-1] == "dt_bias":
            w = np.ones(shape)
        elif parts[-1] == "weight" and "conv1d" in parts[-2]:
            w = 0.5 * rng.standard_normal(shape)
        elif parts[-1] == "weight" and "norm" in parts[-2]:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = 0.05 * rng.standard_normal(shape)
        out[name] = mx.array(w.astype(np.float32))
    return out


def build(kind: str, seed: int):
    module = qwen3_5 if kind == "qwen3_5" else qwen3_5_moe
    cfg = config(kind)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.update(tree_unflatten(list(random_weights(model, seed).items())))
    return cfg, model


def quantize(src: Path, bits: int, group_size: int):
    """What `mlx_lm.convert --quantize` does: quantize_model with the model's quant_predicate
    (the MoE router and the shared-expert gate at 8 bits, group 64), on the reloaded model."""
    model = g4.load_lm(src)
    cfg = json.loads((src / "config.json").read_text())
    with redirect_stdout(io.StringIO()):
        model, qconfig = mlx_lm.utils.quantize_model(model, cfg, group_size, bits, mode="affine",
                                                     quant_predicate=model.quant_predicate)
    return qconfig, model


HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
            ".q_norm.weight", ".k_norm.weight")


def write_hf_layout(src: Path, folder: Path) -> None:
    """The f32 dense checkpoint as Hugging Face stores Qwen3.5: `model.language_model.*` and
    `lm_head.weight`, the (1 + w) norms stored as w - 1, the convolution as [C, 1, K] (what
    mlx-lm's sanitize detects and undoes). The gated norm inside DeltaNet scales by w in both
    layouts."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(src / "model.safetensors"))
    out = {}
    for k, v in weights.items():
        if k.startswith("language_model.model."):
            name = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            name = k[len("language_model."):]
        else:
            name = k
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)
        elif any(k.endswith(s) for s in HF_NORMS) and v.ndim == 1:
            v = v - 1.0
        out[name] = v
    mx.save_safetensors(str(folder / "model.safetensors"), dict(sorted(out.items())),
                        metadata={"format": "pt"})
    shutil.copy(src / "config.json", folder / "config.json")


def goldens(name: str, folder: Path, prompt: np.ndarray, notes: dict) -> dict:
    ids = mx.array(prompt)[None]
    model = g4.load_lm(folder)
    g4.assert_loaded_matches_file(model, folder)
    logits = np.array(model(ids).astype(mx.float32)[0])
    tokens, step_logits = g4.greedy(model, prompt)
    notes["prefill_last_vs_step0"] = float(np.abs(step_logits[0] - logits[-1]).max())
    return {"prompt": prompt, "logits": logits, "greedy": tokens, "greedy_logits": step_logits}


def write_goldens(folder: Path, g: dict) -> None:
    meta = {"format": "mlx", "generator": "tests/golden/qwen3_5/make_golden.py", **g4.REFERENCE}
    mx.save_safetensors(str(folder / "golden.safetensors"),
                        {k: mx.array(v) for k, v in sorted(g.items())}, metadata=meta)


def generate(out: Path, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    all_notes = {}
    for name, spec in CHECKPOINTS.items():
        t0 = time.time()
        folder = out / name
        if folder.exists():
            shutil.rmtree(folder)
        notes = {}
        prompt = g4.make_prompt(spec["prompt_seed"])
        if spec["kind"] == "vision":
            build_vision(folder, out / spec["source"], spec["seed"])
            write_goldens(folder, vision_goldens(folder, prompt, notes))
        elif spec["kind"] == "mtp":
            build_mtp(folder, spec["seed"])
            write_goldens(folder, mtp_goldens(folder, out / spec["source"], notes))
        elif spec["kind"] == "hf_layout":
            write_hf_layout(out / spec["source"], folder)
            # mlx-lm reads the Hugging Face layout to the same model, bit for bit.
            model, _ = mlx_lm.utils.load_model(folder, strict=True)
            hf = np.array(model(mx.array(prompt)[None]).astype(mx.float32)[0])
            base = mx.load(str(out / spec["source"] / "golden.safetensors"))["logits"]
            notes["hf_vs_mlx_layout"] = float(np.abs(hf - np.array(base)).max())
            if notes["hf_vs_mlx_layout"] != 0.0:
                raise RuntimeError(f"{name}: the HF layout loads to other logits")
        else:
            if spec["kind"] == "quantized":
                cfg, model = quantize(out / spec["source"], spec["bits"], spec["group_size"])
            else:
                cfg, model = build(spec["kind"], spec["seed"])
            g4.write_checkpoint(folder, cfg, model, "mlx_lm")
            write_goldens(folder, goldens(name, folder, prompt, notes))
        notes["seconds"] = round(time.time() - t0, 2)
        all_notes[name] = notes
        log(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in notes.items()))
    return all_notes


# ---------------------------------------------------------------------------------------------
# The MTP drafter: mlx-vlm's qwen3_5_mtp on the dense target, speculative greedy round by round

MTP_BLOCK = 4  # the bonus and three drafts per round
MTP_TOKENS = 48
MTP_ORACLE = [0, 2, 3, 1, 3, 0, 2, 3]
VISION = {
    # A tiny tower: mlx-vlm's qwen3_5 is a vision-language model; the text path ignores it.
    "model_type": "qwen3_5", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
    "out_hidden_size": 64, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 16, "in_channels": 3,
    "deepstack_visual_indexes": [],
}


def mlx_vlm_target(dense: Path):
    """mlx-vlm's own qwen3_5 model with the dense checkpoint's text weights (its tiny vision
    tower stays at initialisation)."""
    from mlx_vlm.models import qwen3_5 as vq
    cfg = json.loads((dense / "config.json").read_text())
    cfg.update({"vision_config": dict(VISION), "image_token_id": 500, "video_token_id": 501,
                "vision_start_token_id": 502, "vision_end_token_id": 503, "vocab_size": g4.VOCAB})
    cfg["text_config"] = vq.TextConfig.from_dict(cfg["text_config"])
    cfg["vision_config"] = vq.VisionConfig.from_dict(cfg["vision_config"])
    model = vq.Model(vq.ModelConfig.from_dict(cfg))
    weights = mx.load(str(dense / "model.safetensors"))
    model.load_weights(list(weights.items()), strict=False)
    params = dict(tree_flatten(model.parameters()))
    for k, v in weights.items():
        if not mx.array_equal(params[k], v).item():
            raise RuntimeError(f"mlx-vlm's target did not take {k}")
    return model


def build_mtp(folder: Path, seed: int) -> None:
    """A one-layer qwen3_5_mtp drafter for the dense target, saved as mlx-vlm's splitter
    writes one (model_type qwen3_5_mtp, the target's text_config, block_size)."""
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as MtpConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
    text = copy.deepcopy(TEXT)
    text["mtp_num_hidden_layers"] = 1
    cfg = {"model_type": "qwen3_5_mtp", "text_config": text, "block_size": MTP_BLOCK}
    drafter = Qwen3_5MTPDraftModel(MtpConfig.from_dict(copy.deepcopy(cfg)))
    drafter.update(tree_unflatten(list(random_weights(drafter, seed).items())))
    folder.mkdir(parents=True, exist_ok=True)
    weights = dict(sorted(tree_flatten(drafter.parameters())))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    # The index keeps mlx-vlm's loader from globbing golden.safetensors as weights.
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def mtp_goldens(folder: Path, dense: Path, notes: dict) -> dict:
    """Plain greedy and MTP speculative greedy through mlx-vlm's generate_step (block size
    4), with what the drafter proposed in every round and how many the target accepted."""
    from mlx_vlm.generate import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    target = mlx_vlm_target(dense)
    with g4.Captured():
        drafter, kind = load_drafter(str(folder))
    if kind != "mtp" or type(drafter).__name__ != "Qwen3_5MTPDraftModel":
        raise RuntimeError(f"load_drafter gave {type(drafter).__name__} ({kind})")
    prompt = g4.make_prompt(CHECKPOINTS["dense"]["prompt_seed"])
    ids = mx.array(prompt)[None]
    plain = [int(t) for t, _ in generate_step(ids, target, None, None, temperature=0.0,
                                               max_tokens=MTP_TOKENS)]
    reference = mx.load(str(dense / "golden.safetensors"))["greedy"].tolist()
    if plain != reference[:MTP_TOKENS]:
        raise RuntimeError("mlx-vlm's greedy differs from mlx-lm's on the dense checkpoint")
    # Random drafters are almost never right, so an oracle sets how many drafts each round
    # gets right: the drafter still runs (its own drafts are recorded), but the target verifies
    # the greedy continuation for the first ORACLE[i % len] drafts and a wrong token after
    # them, so rounds accept 0 to 3 drafts (and the drafter keeps some of its own positions).
    rounds, own = [], []
    draft_block = drafter.draft_block

    def oracle(*args, **kwargs):
        out = draft_block(*args, **kwargs)
        mx.eval(out)
        mine = [int(t) for t in np.array(out).reshape(-1)]
        emitted = 1 + sum(a + 1 for a in drafter.accept_lens)
        want = MTP_ORACLE[len(rounds) % len(MTP_ORACLE)]
        true = plain[emitted:emitted + len(mine)]
        forced = [t if j < want else (t + 1) % g4.VOCAB for j, t in enumerate(true)]
        own.append(mine)
        rounds.append(forced)
        return mx.array([forced], dtype=out.dtype)

    drafter.draft_block = oracle
    spec = [int(t) for t, _ in generate_step(ids, target, None, None, temperature=0.0,
                                              max_tokens=MTP_TOKENS, draft_model=drafter,
                                              draft_kind="mtp", draft_block_size=MTP_BLOCK)]
    if spec != plain:
        raise RuntimeError("MTP speculative greedy differs from plain greedy")
    accepted = [int(a) for a in drafter.accept_lens]
    if len(accepted) != len(rounds):
        raise RuntimeError(f"{len(rounds)} rounds, {len(accepted)} acceptance counts")
    for i, (a, r) in enumerate(zip(accepted, rounds)):
        if a != min(len(r), MTP_ORACLE[i % len(MTP_ORACLE)]):
            raise RuntimeError(f"round {i}: accepted {a} of {r}")
    notes["rounds"] = len(rounds)
    notes["accepted"] = sum(accepted)
    drafts = np.full((len(rounds), MTP_BLOCK - 1), -1, dtype=np.int32)
    forced = np.full((len(rounds), MTP_BLOCK - 1), -1, dtype=np.int32)
    for i, (mine, f) in enumerate(zip(own, rounds)):
        drafts[i, :len(mine)] = mine
        forced[i, :len(f)] = f
    return {"prompt": prompt, "greedy": np.array(plain, dtype=np.int32), "drafts": drafts,
            "forced": forced, "accepted": np.array(accepted, dtype=np.int32)}


# ---------------------------------------------------------------------------------------------
# Vision: mlx-vlm's qwen3_5 (Qwen3-VL's tower without deepstack) on the dense text weights

TOWER = {
    # Two blocks of width 32 (2 heads of 16), patches of 8 pixels merged 2×2 into one soft
    # token of the text width, a 4×4 table of learned positions interpolated to each grid.
    "model_type": "qwen3_5", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
    "out_hidden_size": 64, "num_heads": 2, "patch_size": 8, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 16, "in_channels": 3,
    "deepstack_visual_indexes": [],
}
IMAGE_IDS = {"image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 502,
             "vision_end_token_id": 503}
PREPROCESSOR = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": 1024, "longest_edge": 262144}}
IMAGES = Path(__file__).resolve().parents[1] / "vision" / "images"
# (image, max_pixels): a downscale to a 12×18 patch grid (54 soft tokens), the one the prompt
# holds; a rounding to the nearest multiple of 16; a portrait that stays within the budget.
PREPROCESS = [("rgb_640x480.png", 16384), ("rgb_123x77.bmp", 16384), ("rgba_200x256.png", 71680)]
VISION_TOKENS = 48


def vision_weights(model, seed: int) -> dict:
    """RandomState(seed) over the tower's parameters sorted by name, float32: LayerNorm weights
    1 + 0.1*N, biases 0.05*N, the patch embedding 0.1*N (its 384 inputs are in [-1, 1]), the
    position table 0.5*N, everything else 0.1*N."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.vision_tower.parameters()), key=lambda kv: kv[0]):
        parts = name.split(".")
        shape = tuple(p.shape)
        if parts[-1] == "bias":
            w = 0.05 * rng.standard_normal(shape)
        elif "norm" in parts[-2]:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif parts[-2] == "pos_embed":
            w = 0.5 * rng.standard_normal(shape)
        else:
            w = 0.1 * rng.standard_normal(shape)
        out["vision_tower." + name] = mx.array(w.astype(np.float32))
    return out


def build_vision(folder: Path, dense: Path, seed: int) -> None:
    """mlx-vlm's qwen3_5 model: `dense`'s text weights and a random tower, saved by mlx-vlm's
    writer with its preprocessor config."""
    from mlx_vlm.models import qwen3_5 as vq
    cfg = json.loads((dense / "config.json").read_text())
    cfg.update({"vision_config": dict(TOWER), **IMAGE_IDS, "vocab_size": g4.VOCAB})
    model = vq.Model(vq.ModelConfig.from_dict(copy.deepcopy(cfg)))
    weights = dict(mx.load(str(dense / "model.safetensors")))
    weights.update(vision_weights(model, seed))
    model.load_weights(list(weights.items()), strict=True)
    g4.write_checkpoint(folder, cfg, model, "mlx_vlm")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")


def vision_goldens(folder: Path, text_prompt: np.ndarray, notes: dict) -> dict:
    """The processor's pixel values and grids, the tower's features, and the full model's logits
    and greedy continuation on a prompt with the first image after 8 text tokens."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor
    from PIL import Image
    model = g4.load_vlm(folder)
    g4.assert_loaded_matches_file(model, folder)
    processor = Qwen3VLImageProcessor(
        patch_size=8, temporal_patch_size=2, merge_size=2,
        min_pixels=PREPROCESSOR["size"]["shortest_edge"])
    out = {}
    for i, (name, max_pixels) in enumerate(PREPROCESS):
        got = processor([Image.open(IMAGES / name)], max_pixels=max_pixels)
        out[f"pixels_{i}"] = got["pixel_values"].astype(np.float32)
        out[f"grid_{i}"] = got["image_grid_thw"][0].astype(np.int32)
    pixels, grid = mx.array(out["pixels_0"]), mx.array(out["grid_0"][None])
    features, _ = model.vision_tower(pixels, grid)
    out["features"] = np.array(features)
    soft = features.shape[0]
    prompt = np.concatenate([text_prompt[:8], [502], np.full(soft, 500), [503],
                             text_prompt[8:20]]).astype(np.int32)
    ids = mx.array(prompt)[None]
    cache = model.language_model.make_cache()
    logits = model(ids, pixel_values=pixels, image_grid_thw=grid, cache=cache).logits
    out["prompt"] = prompt
    out["logits"] = np.array(logits.astype(mx.float32)[0])
    # Decoding after the image: positions continue from the image's compact span (mlx-vlm's
    # rope deltas).
    tokens, y = [], mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(VISION_TOKENS):
        tokens.append(int(y.item()))
        step = model.language_model(y[None], cache=cache).logits
        y = mx.argmax(step[:, -1, :], axis=-1)
    out["greedy"] = np.array(tokens, dtype=np.int32)
    position_ids, deltas = model.language_model.get_rope_index(ids, grid)
    out["positions"] = np.array(position_ids[:, 0, :]).astype(np.int32)
    notes["soft_tokens"] = soft
    notes["rope_delta"] = int(deltas.item())
    return out


def check(out: Path) -> int:
    return g4.check_folders(out, CHECKPOINTS, generate, "qwen3_5-golden-", Path(__file__))


if __name__ == "__main__":
    sys.exit(g4.cli(__doc__, HERE, generate, check))
