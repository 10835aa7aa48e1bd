"""Golden parity fixtures for the Gemma 4 text model, produced by the reference libraries.

Reference: mlx 0.32.4 (CPU), mlx-lm 0.32.2, mlx-vlm 0.7.10 (pins in tests/reference/).
See SCHEMA.md next to this script for what each folder and tensor holds.

Usage: python tests/golden/gemma4/make_golden.py [--out DIR] [--check]
  --out DIR  where to write (default: next to this script)
  --check    regenerate into a temporary folder and compare with the files in --out
             (floats within 1e-5 absolute, integers and config.json exactly); exit 1 on mismatch.

Each checkpoint is built from a config dict that sets every key explicitly (mlx-vlm, mlx-lm and
transformers disagree on defaults), filled with numpy RandomState(seed) weights, saved in the
mlx-community layout, loaded back through the libraries' normal loaders (strict), and the goldens
are computed from the reloaded model, so the files on disk are exactly what produced them.
"""

import argparse
import copy
import io
import json
import logging
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import redirect_stdout
from importlib.metadata import version
from pathlib import Path

import numpy as np
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

import mlx_lm.utils
import mlx_vlm.utils
from mlx_lm.generate import generate_step
from mlx_vlm.models import gemma4 as vlm_gemma4
from mlx_vlm.quant_utils import quantize_model as vlm_quantize_model
from mlx_vlm.utils import skip_multimodal_module

HERE = Path(__file__).resolve().parent
REFERENCE = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-vlm": "0.7.10"}

VOCAB = 512
PROMPT_LEN = 40
GREEDY_TOKENS = 64
PROMPT_RANGE = (3, 500)  # [3, 500): never pad 0 / eos 1 / bos 2 / multimodal ids 500..506
F32_AGREEMENT = 1e-5  # mlx-lm vs mlx-vlm logits on the float32 checkpoints
CHECK_ATOL = 1e-5

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]


def text_config(*, sliding_window: int, attention_k_eq_v: bool, num_kv_shared_layers: int) -> dict:
    """Every key of mlx-vlm's TextConfig and mlx-lm's gemma4_text.ModelArgs, plus the HF ones."""
    return {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "head_dim": 32,
        "global_head_dim": 64,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": attention_k_eq_v,
        "num_kv_shared_layers": num_kv_shared_layers,
        "layer_types": list(LAYER_TYPES),
        "sliding_window": sliding_window,
        "sliding_window_pattern": 3,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                               "partial_rotary_factor": 0.25},
        },
        # Top-level rope fallbacks; unused when rope_parameters is given, pinned anyway.
        "partial_rotary_factor": 1.0,
        "global_partial_rotary_factor": 0.25,
        "rope_traditional": False,
        "max_position_embeddings": 131072,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": "vision",
        "enable_moe_block": False,
        "use_second_mlp_block": False,
        "num_experts": None,
        "top_k_experts": None,
        "moe_intermediate_size": None,
        "exact_speculative_verify": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }


def vision_config() -> dict:
    """Tiny vision tower (present so the checkpoint is a complete gemma4 one; text ignores it)."""
    return {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": "vision",
        "layer_types": ["full_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "default_output_length": 4,
        "patch_size": 16,
        "position_embedding_size": 16,
        "pooling_kernel_size": 3,
        "use_clipped_linears": False,
        "standardize": False,
    }


def gemma4_config(text: dict) -> dict:
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision_config(),
        "audio_config": None,
        # mlx-lm's gemma4 wrapper copies this top-level value over text_config.vocab_size.
        "vocab_size": VOCAB,
        "hidden_size": text["hidden_size"],
        "image_token_id": 500,
        "boi_token_id": 501,
        "eoi_token_id": 502,
        "audio_token_id": 503,
        "boa_token_id": 504,
        "eoa_token_id": 505,
        "video_token_id": 506,
        "vision_soft_tokens_per_image": 4,
        "vision_soft_tokens_per_video_frame": 4,
        "audio_soft_tokens_per_image": 4,
        "audio_ms_per_token": 40,
        "ignore_index": -100,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }


def text_only_config() -> dict:
    """Flat gemma4_text config (mlx-lm gemma4_text.ModelArgs)."""
    cfg = text_config(sliding_window=8, attention_k_eq_v=False, num_kv_shared_layers=2)
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    return cfg


def moe_config() -> dict:
    """text_only's layout with Gemma 4's mixture-of-experts block on every layer (the 26B-A4B
    layout at toy size): 4 experts, 2 per token, expert width 32."""
    cfg = text_only_config()
    cfg.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return cfg


# name -> how it is made: "gemma4"/"gemma4_text" from a config and a weight seed, or "quantized"
# from another folder; prompt_seed picks the prompt.
CHECKPOINTS = {
    "dense": dict(kind="gemma4", seed=1, prompt_seed=101,
                  config=lambda: gemma4_config(text_config(
                      sliding_window=6, attention_k_eq_v=False, num_kv_shared_layers=2))),
    "k_eq_v": dict(kind="gemma4", seed=2, prompt_seed=102,
                   config=lambda: gemma4_config(text_config(
                       sliding_window=6, attention_k_eq_v=True, num_kv_shared_layers=0))),
    "dense_q4": dict(kind="quantized", source="dense", bits=4, group_size=32, prompt_seed=101),
    "dense_q8": dict(kind="quantized", source="dense", bits=8, group_size=32, prompt_seed=101),
    "text_only": dict(kind="gemma4_text", seed=3, prompt_seed=103, config=text_only_config),
    "moe": dict(kind="gemma4_text", seed=4, prompt_seed=104, config=moe_config),
    "moe_q4": dict(kind="quantized_text", source="moe", bits=4, group_size=32, prompt_seed=104),
}


# ---------------------------------------------------------------------------------------------
# Building, saving and loading checkpoints


def random_weights(model, seed: int) -> dict:
    """RandomState(seed) normals over the parameters sorted by name: norms and layer_scalar
    1 + 0.1*N, everything else 0.05*N; float32."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        parts = name.split(".")
        is_norm = (parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]) \
            or parts[-1] == "layer_scalar" \
            or (len(parts) > 1 and parts[-2] == "router" and parts[-1] != "proj")
        n = rng.standard_normal(tuple(p.shape))
        w = (1.0 + 0.1 * n) if is_norm else (0.05 * n)
        out[name] = mx.array(w.astype(np.float32))
    return out


def build_gemma4(config: dict):
    cfg = copy.deepcopy(config)
    cfg["text_config"] = vlm_gemma4.TextConfig.from_dict(cfg["text_config"])
    cfg["vision_config"] = vlm_gemma4.VisionConfig.from_dict(cfg["vision_config"])
    return vlm_gemma4.Model(vlm_gemma4.ModelConfig.from_dict(cfg))


def build_gemma4_text(config: dict):
    from mlx_lm.models import gemma4_text
    return gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))


def write_checkpoint(folder: Path, config: dict, model, saver: str) -> None:
    """config.json plus the library's own writer: model.safetensors (metadata format=mlx) and
    model.safetensors.index.json. The index matters: mlx-vlm's loader otherwise globs every
    *.safetensors in the folder and would try to load golden.safetensors as weights."""
    folder.mkdir(parents=True, exist_ok=True)
    if saver == "mlx_vlm":
        mlx_vlm.utils.save_weights(folder, model)
    else:
        mlx_lm.utils.save_model(folder, model)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


class Captured:
    """Collects logging records and warnings while loading; a clean load has none."""

    def __enter__(self):
        self.records = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self.records.append
        logging.getLogger().addHandler(self.handler)
        self.warn_ctx = warnings.catch_warnings(record=True)
        self.warns = self.warn_ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self.warn_ctx.__exit__(*exc)
        logging.getLogger().removeHandler(self.handler)
        msgs = [r.getMessage() for r in self.records] + [str(w.message) for w in self.warns]
        if msgs and exc[0] is None:
            raise RuntimeError("loader emitted warnings: " + "; ".join(msgs))
        return False


def load_vlm(folder: Path):
    with Captured():
        return mlx_vlm.utils.load_model(folder)  # strict=True inside load_model_weights


def load_lm(folder: Path):
    with Captured():
        model, _ = mlx_lm.utils.load_model(folder, strict=True)
    return model


def assert_loaded_matches_file(model, folder: Path, prefix_filter=None) -> None:
    """Every tensor in the file is a parameter of the loaded model with the same value, and the
    model has no parameter the file lacks (so sanitize renamed/dropped nothing)."""
    on_disk = mx.load(str(folder / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    if prefix_filter is not None:
        on_disk = {k: v for k, v in on_disk.items() if prefix_filter(k)}
    missing = sorted(set(on_disk) - set(params))
    extra = sorted(set(params) - set(on_disk))
    if missing or extra:
        raise RuntimeError(f"{folder.name}: file/model key mismatch: not in model {missing[:5]}, "
                           f"not in file {extra[:5]}")
    for k, v in on_disk.items():
        if v.dtype != params[k].dtype or not mx.array_equal(v, params[k]).item():
            raise RuntimeError(f"{folder.name}: {k} differs after reload")


# ---------------------------------------------------------------------------------------------
# Goldens


def make_prompt(seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(*PROMPT_RANGE, size=PROMPT_LEN).astype(np.int32)


def greedy(lm_model, prompt: np.ndarray):
    """64 tokens from mlx_lm.generate.generate_step with the default argmax sampler (no eos stop),
    plus the raw logits of each step, captured by a pass-through logits processor."""
    seen = []

    def capture(tokens, logits):
        seen.append(logits)
        return logits

    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), lm_model, max_tokens=GREEDY_TOKENS,
                                 logits_processors=[capture]):
        tokens.append(tok)
        logprobs.append(lp)
    # generate_step computes one step ahead; the last captured step was never yielded.
    logits = mx.concatenate(seen[:GREEDY_TOKENS], axis=0).astype(mx.float32)
    logprobs = mx.stack(logprobs).astype(mx.float32)
    # The captured logits are exactly what the sampler saw.
    lp_check = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert mx.max(mx.abs(lp_check - logprobs)).item() < 1e-5, "captured logits != logprobs"
    assert np.array_equal(np.array(mx.argmax(logits, axis=-1)), np.array(tokens)), "argmax"
    return np.array(tokens, dtype=np.int32), np.array(logits)


def vlm_greedy(vlm_model, prompt: np.ndarray):
    """Prefill all but the last prompt token, then single-token steps (what generate_step does),
    through mlx-vlm's LanguageModel with its make_cache() caches."""
    cache = vlm_model.make_cache()
    vlm_model.language_model(inputs=mx.array(prompt[:-1])[None], cache=cache)
    tok = mx.array(prompt[-1:])[None]
    tokens, logits = [], []
    for _ in range(GREEDY_TOKENS):
        step = vlm_model.language_model(inputs=tok, cache=cache).logits[0, -1].astype(mx.float32)
        t = int(mx.argmax(step).item())
        tokens.append(t)
        logits.append(np.array(step))
        tok = mx.array([[t]])
    return np.array(tokens, dtype=np.int32), np.stack(logits)


def goldens(name: str, folder: Path, prompt: np.ndarray, kind: str, strict_agree: bool,
            notes: dict) -> dict:
    ids = mx.array(prompt)[None]
    lm_model = load_lm(folder)
    if kind == "gemma4_text":
        assert_loaded_matches_file(lm_model, folder)
    else:
        vlm_model = load_vlm(folder)
        assert_loaded_matches_file(vlm_model, folder)
        assert_loaded_matches_file(lm_model, folder,
                                   prefix_filter=lambda k: k.startswith("language_model."))
        vlm_logits = vlm_model(ids).logits
    lm_logits = lm_model(ids).astype(mx.float32)
    logits = np.array(lm_logits[0])
    if kind != "gemma4_text":
        diff = float(np.abs(np.array(vlm_logits[0]) - logits).max())
        notes["lm_vs_vlm"] = diff
        if strict_agree and diff > F32_AGREEMENT:
            raise RuntimeError(f"{name}: mlx-lm vs mlx-vlm logits differ by {diff}")
    tokens, step_logits = greedy(lm_model, prompt)
    if kind != "gemma4_text":
        # Same greedy loop through mlx-vlm's text model and its own caches (reported; must
        # pick the same tokens).
        vlm_tokens, vlm_step_logits = vlm_greedy(vlm_model, prompt)
        notes["vlm_greedy_equal"] = bool(np.array_equal(vlm_tokens, tokens))
        notes["vlm_decode_vs_lm"] = float(np.abs(vlm_step_logits - step_logits).max())
        if not notes["vlm_greedy_equal"]:
            raise RuntimeError(f"{name}: mlx-vlm greedy differs from mlx-lm greedy")
    # Cross-checks (reported): cached decode vs one full-sequence forward over prompt+greedy.
    notes["prefill_last_vs_step0"] = float(np.abs(step_logits[0] - logits[-1]).max())
    full = np.concatenate([prompt, tokens[:-1]])
    full_logits = np.array(lm_model(mx.array(full)[None]).astype(mx.float32)[0])
    notes["decode_vs_fullseq"] = float(np.abs(full_logits[PROMPT_LEN - 1:] - step_logits).max())
    notes["decode_vs_fullseq_argmax_equal"] = bool(
        np.array_equal(full_logits[PROMPT_LEN - 1:].argmax(-1), tokens))
    return {"prompt": prompt, "logits": logits, "greedy": tokens, "greedy_logits": step_logits}


def write_goldens(folder: Path, g: dict) -> None:
    meta = {"format": "mlx", "generator": "tests/golden/gemma4/make_golden.py",
            **{k: v for k, v in REFERENCE.items()}}
    mx.save_safetensors(str(folder / "golden.safetensors"),
                        {k: mx.array(v) for k, v in sorted(g.items())}, metadata=meta)


def quantize(src_folder: Path, bits: int, group_size: int):
    """What `mlx_vlm.convert --quantize` does: its quantize_model with the convert predicate
    (skip vision/audio modules, else the model's quant_predicate), on the reloaded f32 model."""
    model = load_vlm(src_folder)
    with open(src_folder / "config.json") as f:
        config = json.load(f)
    model_pred = model.quant_predicate

    def predicate(path, module):
        if skip_multimodal_module(path):
            return False
        return model_pred(path, module)

    with redirect_stdout(io.StringIO()):  # "[INFO] Quantized model with ..."
        model, qconfig = vlm_quantize_model(model, config, group_size, bits, mode="affine",
                                            quant_predicate=predicate)
    return qconfig, model


def quantize_text(src_folder: Path, bits: int, group_size: int):
    """What `mlx_lm.convert --quantize` does for a gemma4_text checkpoint: its quantize_model
    with the model's quant_predicate (the MoE router at 8 bits, group 64)."""
    model = load_lm(src_folder)
    with open(src_folder / "config.json") as f:
        config = json.load(f)
    with redirect_stdout(io.StringIO()):
        model, qconfig = mlx_lm.utils.quantize_model(model, config, group_size, bits,
                                                     mode="affine",
                                                     quant_predicate=model.quant_predicate)
    return qconfig, model


def generate(out: Path, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    all_notes = {}
    for name, spec in CHECKPOINTS.items():
        t0 = time.time()
        folder = out / name
        if folder.exists():
            shutil.rmtree(folder)
        notes = {}
        if spec["kind"] == "gemma4":
            config = spec["config"]()
            model = build_gemma4(config)
            model.update(tree_unflatten(list(random_weights(model, spec["seed"]).items())))
            write_checkpoint(folder, config, model, "mlx_vlm")
            g = goldens(name, folder, make_prompt(spec["prompt_seed"]), "gemma4", True, notes)
        elif spec["kind"] == "gemma4_text":
            config = spec["config"]()
            model = build_gemma4_text(config)
            model.update(tree_unflatten(list(random_weights(model, spec["seed"]).items())))
            write_checkpoint(folder, config, model, "mlx_lm")
            g = goldens(name, folder, make_prompt(spec["prompt_seed"]), "gemma4_text", True, notes)
        elif spec["kind"] == "quantized_text":
            qconfig, model = quantize_text(out / spec["source"], spec["bits"], spec["group_size"])
            write_checkpoint(folder, qconfig, model, "mlx_lm")
            g = goldens(name, folder, make_prompt(spec["prompt_seed"]), "gemma4_text", False,
                        notes)
        else:
            qconfig, model = quantize(out / spec["source"], spec["bits"], spec["group_size"])
            write_checkpoint(folder, qconfig, model, "mlx_vlm")
            g = goldens(name, folder, make_prompt(spec["prompt_seed"]), "gemma4", False, notes)
        write_goldens(folder, g)
        notes["seconds"] = round(time.time() - t0, 2)
        all_notes[name] = notes
        log(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in notes.items()))
    return all_notes


# ---------------------------------------------------------------------------------------------
# --check


def compare_tensors(a_path: Path, b_path: Path, errors: list) -> None:
    a, a_meta = mx.load(str(a_path), return_metadata=True)
    b, b_meta = mx.load(str(b_path), return_metadata=True)
    if sorted(a) != sorted(b):
        errors.append(f"{b_path}: tensor names differ: only new {sorted(set(a) - set(b))[:5]}, "
                      f"only committed {sorted(set(b) - set(a))[:5]}")
        return
    if a_meta != b_meta:
        errors.append(f"{b_path}: metadata differs: {a_meta} vs {b_meta}")
    for k in sorted(a):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            errors.append(f"{b_path}:{k}: {x.dtype}{x.shape} vs committed {y.dtype}{y.shape}")
            continue
        if mx.issubdtype(x.dtype, mx.floating):
            d = mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))).item() if x.size else 0
            if not d <= CHECK_ATOL:
                errors.append(f"{b_path}:{k}: max abs diff {d:.3g} > {CHECK_ATOL}")
        elif not mx.array_equal(x, y).item():
            errors.append(f"{b_path}:{k}: integer values differ")


def check_folders(out: Path, names, generate, prefix: str, script: Path) -> int:
    """Regenerates into a temporary folder and compares each of `names` with `out`: the same
    files, JSON equal, tensors within CHECK_ATOL."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        generate(Path(tmp), log=lambda s: print("  regenerated " + s))
        errors = []
        for name in names:
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
                    compare_tensors(new / fname, old / fname, errors)
    return report(errors, out, script)


def check(out: Path) -> int:
    return check_folders(out, CHECKPOINTS, generate, "gemma4-golden-", Path(__file__))


def report(errors: list, out: Path, script: Path) -> int:
    """Prints the outcome of a golden check; 1 when anything differs."""
    if errors:
        print(f"GOLDEN CHECK FAILED: {len(errors)} mismatch(es) between {out} and a fresh run of "
              f"{script.name}:")
        for e in errors:
            print("  " + e)
        print(f"If the reference changed on purpose, regenerate: python {script.relative_to(HERE.parents[2])}")
        return 1
    print(f"golden check ok: {out} matches a fresh generation")
    return 0


def cli(doc: str, default_out: Path, generate, check) -> int:
    """The command line of the golden scripts: `--out DIR` and `--check`, on the pinned
    reference versions, on the CPU."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", type=Path, default=default_out, help="output folder (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temp folder and compare with --out")
    args = ap.parse_args()
    found = {"mlx": version("mlx"), "mlx-lm": version("mlx-lm"), "mlx-vlm": version("mlx-vlm")}
    if found != REFERENCE:
        print(f"reference versions differ: found {found}, pinned {REFERENCE}", file=sys.stderr)
        return 1
    mx.set_default_device(mx.cpu)
    t0 = time.time()
    if args.check:
        rc = check(args.out)
    else:
        generate(args.out)
        rc = 0
    print(f"done in {time.time() - t0:.1f}s")
    return rc


if __name__ == "__main__":
    sys.exit(cli(__doc__, HERE, generate, check))
