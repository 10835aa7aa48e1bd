"""The reference half of `quince bench --image … --compare`: mlx-vlm's generate_step on the
same checkpoint, image and prompt shape, timed the same way: TTFT counts loading and
preprocessing the image, the vision tower, the prefill and the first token.

Prompt: [bos, boi, image × n, eoi] + the synthetic text ids of quince bench (for Qwen3.5:
[2, vision_start, image × n, vision_end] + the same text, the image sized by the processor of
mlx-vlm's qwen3_5 within n · (patch · merge)² pixels, as Quince reads the budget). Prints one
JSON line with the medians of --repeats runs after a warm-up.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_vlm.generate import generate_step
from mlx_vlm.models.base import to_mlx
from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
from mlx_vlm.utils import load_image, load_model


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [3 + (i * 7919 + 13) % (vocab - 3) for i in range(n)]


def gemma4_inputs(config, image: str, soft: int, text: list[int]):
    pixels = to_mlx(Gemma4ImageProcessor()(load_image(image), max_soft_tokens=soft)[0])["pixel_values"]
    h, w = pixels.shape[-2:]
    n = (h // 48) * (w // 48)
    image_id, boi, eoi = config["image_token_id"], config["boi_token_id"], config["eoi_token_id"]
    ids = [config.get("bos_token_id", 2), boi] + [image_id] * n + [eoi] + text
    mm = [1 if t == image_id else 0 for t in ids]
    return ids, n, pixels, {"mm_token_type_ids": mx.array(mm)[None]}


def qwen3_5_inputs(config, folder: Path, image: str, soft: int, text: list[int]):
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (Qwen3VLImageProcessor,
                                                             _qwen_vl_image_kwargs)
    settings = _qwen_vl_image_kwargs(str(folder))
    processor = Qwen3VLImageProcessor(**settings)
    factor = processor.patch_size * processor.merge_size
    out = processor([load_image(image)], max_pixels=min(soft * factor * factor,
                                                        processor.max_pixels))
    grid = out["image_grid_thw"]
    n = int(grid[0].prod()) // processor.merge_size ** 2
    image_id = config["image_token_id"]
    ids = [2, config["vision_start_token_id"]] + [image_id] * n + [config["vision_end_token_id"]]
    return ids + text, n, mx.array(out["pixel_values"]), {"image_grid_thw": mx.array(grid)}


def run(model, config, folder: Path, image: str, soft: int, text: list[int], gen: int) -> dict:
    mx.reset_peak_memory()
    start = time.perf_counter()
    if config["model_type"].startswith("qwen3_5"):
        ids, n, pixels, extra = qwen3_5_inputs(config, folder, image, soft, text)
    else:
        ids, n, pixels, extra = gemma4_inputs(config, image, soft, text)
    first, count = None, 0
    for _token, _ in generate_step(mx.array(ids)[None], model, pixels, None, temperature=0.0,
                                   max_tokens=gen, **extra):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {
        "prompt_tokens": len(ids),
        "image_tokens": n,
        "generated_tokens": count,
        "ttft_ms": (first - start) * 1e3,
        "prefill_tok_s": len(ids) / (first - start),
        "decode_tok_s": (count - 1) / (end - first) if count > 1 else 0.0,
        "peak_mem_bytes": mx.get_peak_memory(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--max-soft-tokens", type=int, default=280)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="text tokens after the image")
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_model(Path(args.model))
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    text = synthetic_prompt(args.prompt_tokens, vocab)
    folder = Path(args.model)
    run(model, config, folder, args.image, args.max_soft_tokens, text, 4)  # warm-up
    runs = [run(model, config, folder, args.image, args.max_soft_tokens, text, args.gen_tokens)
            for _ in range(args.repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    median["decode_tok_s_runs"] = [r["decode_tok_s"] for r in runs]
    print(json.dumps(median))


if __name__ == "__main__":
    main()
