"""Golden parity fixtures for Gemma 3 (`gemma3_text`, and the text path of `gemma3`), produced
by the reference libraries.

Reference: mlx 0.32.4 (CPU), mlx-lm 0.32.2, mlx-vlm 0.7.10 (pins in tests/reference/).
See SCHEMA.md next to this script for what each folder and tensor holds.

Usage: python tests/golden/gemma3/make_golden.py [--out DIR] [--check]
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
import tempfile
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
from mlx_lm.models import gemma3_text  # noqa: E402
from mlx_vlm.models import gemma3 as vlm_gemma3  # noqa: E402

F32_AGREEMENT = 1e-5

TEXT = {
    # Every spelling mlx-lm, mlx-vlm and transformers read. hidden 96: sqrt(96) is not exact in
    # bfloat16, so the bf16-rounded embedding scale is tested; query_pre_attn_scalar 48 differs
    # from head_dim, so a 1/sqrt(head_dim) scale would show.
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 96,
    "num_hidden_layers": 6,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": g4.VOCAB,
    "rope_theta": 1000000.0,
    "rope_global_base_freq": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "rope_traditional": False,
    "query_pre_attn_scalar": 48,
    "sliding_window": 6,
    "sliding_window_pattern": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 32768,
    "mm_tokens_per_image": 4,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": 112,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
    "vision_use_head": False,
}


def gemma3_config() -> dict:
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": copy.deepcopy(TEXT),
        "vision_config": copy.deepcopy(VISION),
        # mlx-lm's gemma3 wrapper copies this over text_config.vocab_size.
        "vocab_size": g4.VOCAB,
        "image_token_index": 500,
        "boi_token_index": 501,
        "eoi_token_index": 502,
        "mm_tokens_per_image": 4,
        "pad_token_id": 0,
        "eos_token_id": [1],
        "bos_token_id": 2,
        "ignore_index": -100,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    }


CHECKPOINTS = {
    "text": dict(kind="gemma3_text", seed=11, prompt_seed=111),
    "text_q4": dict(kind="quantized_text", source="text", bits=4, group_size=32, prompt_seed=111),
    "vlm": dict(kind="gemma3", seed=12, prompt_seed=112),
}


def random_weights(model, seed: int) -> dict:
    """RandomState(seed) normals over the parameters sorted by name, float32: 0.1*N for the
    Gemma norms (they scale by 1 + w, so they stay near 1), 1 + 0.1*N for the SigLIP tower's
    LayerNorm weights (they scale by w), 0.05*N for everything else."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        parts = name.split(".")
        n = rng.standard_normal(tuple(p.shape))
        norm_weight = parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]
        if norm_weight and name.startswith("vision_tower."):
            w = 1.0 + 0.1 * n
        elif norm_weight:
            w = 0.1 * n
        else:
            w = 0.05 * n
        out[name] = mx.array(w.astype(np.float32))
    return out


def build_text(seed: int):
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(TEXT))
    weights = random_weights(model, seed)
    weights.pop("lm_head.weight", None)
    weights = model.sanitize(weights)  # no lm_head: tied to the embedding
    model.update(tree_unflatten(list(weights.items())))
    return model


def build_vlm(seed: int):
    cfg = gemma3_config()
    cfg["text_config"] = vlm_gemma3.TextConfig.from_dict(cfg["text_config"])
    cfg["vision_config"] = vlm_gemma3.VisionConfig.from_dict(cfg["vision_config"])
    model = vlm_gemma3.Model(vlm_gemma3.ModelConfig.from_dict(cfg))
    weights = random_weights(model, seed)
    # mlx-vlm ties the head on load whatever the file holds; mlx-lm reads the file's lm_head.
    weights["language_model.lm_head.weight"] = weights["language_model.model.embed_tokens.weight"]
    model.update(tree_unflatten(list(weights.items())))
    return model


def goldens(name: str, folder: Path, prompt: np.ndarray, kind: str, strict: bool,
            notes: dict) -> dict:
    ids = mx.array(prompt)[None]
    lm_model = g4.load_lm(folder)
    if kind == "gemma3":
        vlm_model = g4.load_vlm(folder)
        g4.assert_loaded_matches_file(vlm_model, folder)
        g4.assert_loaded_matches_file(
            lm_model, folder, prefix_filter=lambda k: k.startswith("language_model."))
    else:
        g4.assert_loaded_matches_file(lm_model, folder)
    logits = np.array(lm_model(ids).astype(mx.float32)[0])
    tokens, step_logits = g4.greedy(lm_model, prompt)
    if kind == "gemma3":
        # mlx-vlm's Model.__call__ makes a non-causal mask; its generate path calls the
        # language model, as here.
        vlm_logits = np.array(vlm_model.language_model(ids).logits.astype(mx.float32)[0])
        notes["lm_vs_vlm"] = float(np.abs(vlm_logits - logits).max())
        if strict and notes["lm_vs_vlm"] > F32_AGREEMENT:
            raise RuntimeError(f"{name}: mlx-lm vs mlx-vlm logits differ by {notes['lm_vs_vlm']}")
        vlm_tokens = vlm_greedy(vlm_model, prompt)
        if not np.array_equal(vlm_tokens, tokens):
            raise RuntimeError(f"{name}: mlx-vlm greedy differs from mlx-lm greedy")
    notes["prefill_last_vs_step0"] = float(np.abs(step_logits[0] - logits[-1]).max())
    return {"prompt": prompt, "logits": logits, "greedy": tokens, "greedy_logits": step_logits}


def vlm_greedy(vlm_model, prompt: np.ndarray) -> np.ndarray:
    """The greedy loop through mlx-vlm's language model and its own make_cache() caches."""
    lm = vlm_model.language_model
    cache = lm.make_cache()
    lm(inputs=mx.array(prompt[:-1])[None], cache=cache)
    tok = mx.array(prompt[-1:])[None]
    tokens = []
    for _ in range(g4.GREEDY_TOKENS):
        t = int(mx.argmax(lm(inputs=tok, cache=cache).logits[0, -1]).item())
        tokens.append(t)
        tok = mx.array([[t]])
    return np.array(tokens, dtype=np.int32)


def quantize_text(src: Path, bits: int, group_size: int):
    """What `mlx_lm.convert --quantize` does (Gemma 3 has no quant predicate), on the reloaded
    f32 model (quantize_model changes the model it is given)."""
    model = g4.load_lm(src)
    config = json.loads((src / "config.json").read_text())
    with redirect_stdout(io.StringIO()):
        model, qconfig = mlx_lm.utils.quantize_model(model, config, group_size, bits,
                                                     mode="affine")
    return qconfig, model


def write_goldens(folder: Path, g: dict) -> None:
    meta = {"format": "mlx", "generator": "tests/golden/gemma3/make_golden.py", **g4.REFERENCE}
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
        if spec["kind"] == "gemma3_text":
            g4.write_checkpoint(folder, TEXT, build_text(spec["seed"]), "mlx_lm")
            g = goldens(name, folder, prompt, "gemma3_text", True, notes)
        elif spec["kind"] == "quantized_text":
            qconfig, model = quantize_text(out / spec["source"], spec["bits"], spec["group_size"])
            g4.write_checkpoint(folder, qconfig, model, "mlx_lm")
            g = goldens(name, folder, prompt, "gemma3_text", False, notes)
        else:
            g4.write_checkpoint(folder, gemma3_config(), build_vlm(spec["seed"]), "mlx_vlm")
            g = goldens(name, folder, prompt, "gemma3", True, notes)
        write_goldens(folder, g)
        notes["seconds"] = round(time.time() - t0, 2)
        all_notes[name] = notes
        log(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in notes.items()))
    return all_notes


def check(out: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="gemma3-golden-") as tmp:
        generate(Path(tmp), log=lambda s: print("  regenerated " + s))
        errors = []
        for name in CHECKPOINTS:
            new, old = Path(tmp) / name, out / name
            new_files = sorted(p.name for p in new.iterdir())
            old_files = sorted(p.name for p in old.iterdir()) if old.is_dir() else []
            if new_files != old_files:
                errors.append(f"{old}: files {old_files}, expected {new_files}")
                continue
            for fname in new_files:
                if fname.endswith(".json"):
                    if json.loads((new / fname).read_text()) != json.loads((old / fname).read_text()):
                        errors.append(f"{old / fname}: content differs from a fresh generation")
                elif fname.endswith(".safetensors"):
                    g4.compare_tensors(new / fname, old / fname, errors)
    return g4.report(errors, out, Path(__file__))


if __name__ == "__main__":
    sys.exit(g4.cli(__doc__, HERE, generate, check))
