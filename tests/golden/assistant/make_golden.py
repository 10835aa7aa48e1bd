"""Golden parity fixtures for Gemma 4 assistant (MTP) speculative decoding, produced by mlx-vlm.

Reference: mlx 0.32.4 (CPU), mlx-lm 0.32.2, mlx-vlm 0.7.10 (pins in tests/reference/).
See SCHEMA.md next to this script for what each folder and tensor holds.

Usage: python tests/golden/assistant/make_golden.py [--out DIR] [--check]
  --out DIR  where to write (default: next to this script)
  --check    regenerate into a temporary folder and compare with the files in --out
             (floats within 1e-5 absolute, integers and every .json exactly); exit 1 on mismatch.

Two checkpoints are built with the helpers of tests/golden/gemma4/make_golden.py (imported, not
copied): a tiny `gemma4` target (the `dense` recipe with sliding_window 128, so the sliding ring
never wraps over prompt 40 + 64 generated tokens) and a tiny `gemma4_assistant` drafter for it.
Both are saved in the mlx-community layout, reloaded through the libraries' loaders (strict;
the drafter through mlx_vlm.speculative.drafters.load_drafter, which must say kind "mtp"), and
the goldens come from the reloaded models: plain greedy, mlx-vlm's MTP speculative greedy with
block size 4 (must equal plain greedy), and what the drafter proposed and saw in every round.
"""

import copy
import importlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import mlx.core as mx
from mlx.utils import tree_unflatten

HERE = Path(__file__).resolve().parent


def _import_gemma4_helpers():
    """tests/golden/gemma4/make_golden.py under its own module name (this file is also
    called make_golden.py, so a plain `import make_golden` could pick up this script)."""
    path = HERE.parent / "gemma4" / "make_golden.py"
    spec = importlib.util.spec_from_file_location("gemma4_make_golden", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


g = _import_gemma4_helpers()

from mlx_vlm.generate import generate_step as vlm_generate_step  # noqa: E402
from mlx_vlm.speculative.drafters import load_drafter  # noqa: E402
from mlx_vlm.speculative.drafters import gemma4_assistant as assistant_pkg  # noqa: E402

ASSISTANT_MODULE = importlib.import_module(
    "mlx_vlm.speculative.drafters.gemma4_assistant.gemma4_assistant")

REFERENCE = g.REFERENCE
VOCAB = g.VOCAB
PROMPT_LEN = g.PROMPT_LEN          # 40
GREEDY_TOKENS = g.GREEDY_TOKENS    # 64
CHECK_ATOL = g.CHECK_ATOL          # 1e-5

TARGET_SEED = 11
ASSISTANT_SEED = 12
TOKEN_ORDERING_SEED = 13
PROMPT_SEED = 111
SLIDING_WINDOW = 128
BLOCK_SIZE = 4                     # verify block [bonus, d1, d2, d3]: 3 drafts per round
NUM_CENTROIDS = 16
CENTROID_TOP_K = 4
LAYER_TYPE_ORDER = ("sliding_attention", "full_attention")
ORACLE_SCHEDULE = (3, 1, 0, 2)     # accepted drafts per round in the oracle run (cycled)

GENERATED = ["target", "assistant", "golden.safetensors", "golden.json"]


# ---------------------------------------------------------------------------------------------
# Configs


def target_config() -> dict:
    """The `dense` checkpoint of tests/golden/gemma4 with sliding_window 128."""
    return g.gemma4_config(g.text_config(
        sliding_window=SLIDING_WINDOW, attention_k_eq_v=False, num_kv_shared_layers=2))


def assistant_config(target: dict) -> dict:
    """Every key of mlx-vlm's Gemma4AssistantConfig, and a gemma4_text text_config built from
    g.text_config with the drafter's sizes. Head dims and rope equal the target's."""
    tt = target["text_config"]
    text = g.text_config(sliding_window=SLIDING_WINDOW, attention_k_eq_v=False,
                         num_kv_shared_layers=2)
    text.update({
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window_pattern": 2,
        "num_attention_heads": 2,
        "head_dim": tt["head_dim"],                  # 32 = target sliding head dim
        "global_head_dim": tt["global_head_dim"],    # 64 = target full head dim
        "num_key_value_heads": 1,
        "num_global_key_value_heads": 1,
        "num_kv_shared_layers": 2,                   # every layer reads the target's K/V
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": False,
        "intermediate_size": 64,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "sliding_window": SLIDING_WINDOW,
        "rope_parameters": copy.deepcopy(tt["rope_parameters"]),
        "rms_norm_eps": tt["rms_norm_eps"],
        "final_logit_softcapping": None,
        "enable_moe_block": False,
    })
    assert text["head_dim"] == 32 and text["global_head_dim"] == 64
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": tt["hidden_size"],   # 64
        "use_ordered_embeddings": True,
        "num_centroids": NUM_CENTROIDS,
        "centroid_intermediate_top_k": CENTROID_TOP_K,
        "tie_word_embeddings": True,
        "block_size": BLOCK_SIZE,
        "target_layer_ids": [],
        "text_config": text,
    }


# ---------------------------------------------------------------------------------------------
# Building checkpoints


def build_target(folder: Path) -> dict:
    config = target_config()
    model = g.build_gemma4(config)
    model.update(tree_unflatten(list(g.random_weights(model, TARGET_SEED).items())))
    g.write_checkpoint(folder, config, model, "mlx_vlm")
    return config


def build_assistant(folder: Path, target: dict) -> dict:
    """random_weights(seed 12) over the drafter's parameters sorted by name (the draw for
    masked_embedding.token_ordering is consumed and discarded), then token_ordering =
    RandomState(13).permutation(512) as int32 (what the drafter's sanitize casts it to)."""
    config = assistant_config(target)
    cfg = copy.deepcopy(config)
    cfg["text_config"] = assistant_pkg.TextConfig.from_dict(cfg["text_config"])
    model = assistant_pkg.Model(assistant_pkg.ModelConfig.from_dict(cfg))
    weights = g.random_weights(model, ASSISTANT_SEED)
    assert "masked_embedding.token_ordering" in weights
    weights["masked_embedding.token_ordering"] = mx.array(
        np.random.RandomState(TOKEN_ORDERING_SEED).permutation(VOCAB).astype(np.int32))
    model.update(tree_unflatten(list(weights.items())))
    g.write_checkpoint(folder, config, model, "mlx_vlm")
    return config


def load_assistant(folder: Path):
    with g.Captured():
        drafter, kind = load_drafter(str(folder))
    if kind != "mtp":
        raise RuntimeError(f"load_drafter returned kind {kind!r}, expected 'mtp'")
    if type(drafter).__name__ != "Gemma4AssistantDraftModel":
        raise RuntimeError(f"load_drafter returned {type(drafter).__name__}")
    g.assert_loaded_matches_file(drafter, folder)
    return drafter


# ---------------------------------------------------------------------------------------------
# Speculative run with the drafter's inputs and outputs recorded


class Recorder:
    """Wraps the loaded drafter's draft_block (instance attribute shadows the method) and the
    module-level make_drafter_masks it calls, to record each round's inputs and drafts."""

    def __init__(self, drafter, oracle=None):
        """oracle: None, or (greedy tokens, accept schedule). With an oracle, the drafter still
        runs (its drafts are recorded as drafter_drafts) but draft_block returns the greedy
        continuation for the first schedule[i % len] drafts of round i and a wrong token
        (greedy + 1 mod vocab) after that, so the target accepts exactly that many."""
        self.drafter = drafter
        self.oracle = oracle
        self.rounds = []
        self._mask_calls = None

    def __enter__(self):
        orig_block = self.drafter.draft_block
        orig_masks = ASSISTANT_MODULE.make_drafter_masks
        self._orig_masks = orig_masks
        d = self.drafter

        def make_drafter_masks(shared_kv_states, query_len, query_offset, sliding_window,
                               dtype=mx.float32, kv_valid_len=None):
            masks = orig_masks(shared_kv_states, query_len, query_offset, sliding_window,
                               dtype, kv_valid_len)
            if self._mask_calls is not None:
                self._mask_calls.append({
                    "query_len": int(query_len),
                    "query_offset": int(query_offset),
                    "sliding_window": int(sliding_window),
                    "kv_valid_len": int(kv_valid_len),
                    "mask_is_none": {k: masks[k] is None for k in LAYER_TYPE_ORDER},
                })
            return masks

        def draft_block(last_bonus, hidden, cache, block_size, sampler,
                        token_dtype=mx.int32, **kwargs):
            shared = d._shared_kv
            rec = {
                "bonus": int(last_bonus) if isinstance(last_bonus, int)
                else int(mx.array(last_bonus).reshape(-1).item()),
                "hidden": np.array(hidden.astype(mx.float32)).reshape(-1),
                "hidden_shape": list(hidden.shape),
                "block_size": int(block_size),
                "kwargs": dict(kwargs),
                "position": int(d._position) if isinstance(d._position, int)
                else int(mx.array(d._position).reshape(-1).item()),
                "kv_offset": int(d._kv_offset),
                "kv_valid_len": int(d._kv_valid_len) if not isinstance(d._kv_valid_len, mx.array)
                else int(d._kv_valid_len.reshape(-1).item()),
                "shared_kv_shapes": {k: [list(shared[k][0].shape), list(shared[k][1].shape)]
                                     for k in sorted(shared)},
                "shared_kv": {k: (np.array(shared[k][0]), np.array(shared[k][1]))
                              for k in shared},
            }
            self._mask_calls = []
            out = orig_block(last_bonus, hidden, cache, block_size, sampler, token_dtype,
                             **kwargs)
            mx.eval(out)
            rec["mask_calls"] = self._mask_calls
            self._mask_calls = None
            rec["drafter_drafts"] = [int(t) for t in np.array(out).reshape(-1)]
            if self.oracle is not None:
                greedy, schedule = self.oracle
                emitted = rec["kv_valid_len"] - PROMPT_LEN + 1  # tokens emitted so far
                want = schedule[len(self.rounds) % len(schedule)]
                true = [int(t) for t in greedy[emitted:emitted + block_size - 1]]
                forced = [t if j < want else (t + 1) % VOCAB for j, t in enumerate(true)]
                out = mx.array([forced], dtype=token_dtype)
            rec["drafts"] = [int(t) for t in np.array(out).reshape(-1)]
            self.rounds.append(rec)
            return out

        self.drafter.draft_block = draft_block
        ASSISTANT_MODULE.make_drafter_masks = make_drafter_masks
        return self

    def __exit__(self, *exc):
        ASSISTANT_MODULE.make_drafter_masks = self._orig_masks
        del self.drafter.draft_block
        return False


def speculative_greedy(target, drafter, prompt: np.ndarray, oracle=None):
    with Recorder(drafter, oracle) as rec:
        tokens = [int(t) for t, _ in vlm_generate_step(
            mx.array(prompt)[None], target, None, None, temperature=0.0,
            max_tokens=GREEDY_TOKENS, draft_model=drafter, draft_kind="mtp",
            draft_block_size=BLOCK_SIZE)]
    return np.array(tokens, dtype=np.int32), rec.rounds, list(drafter.accept_lens), \
        list(drafter.draft_lens)


def plain_vlm_generate(target, prompt: np.ndarray) -> np.ndarray:
    """Cross-check: mlx-vlm's own generate_step without a drafter, temperature 0."""
    return np.array([int(t) for t, _ in vlm_generate_step(
        mx.array(prompt)[None], target, None, None, temperature=0.0,
        max_tokens=GREEDY_TOKENS)], dtype=np.int32)


def run_and_validate(target, drafter, prompt, greedy, oracle):
    """One speculative run; checks spec == greedy, one draft_block call per recorded round,
    block size 4 except where the remaining budget is smaller, greedy=True drafting, and that
    each round's bonus, position and accepted count agree with the greedy tokens."""
    spec, rounds, accept_lens, draft_lens = speculative_greedy(target, drafter, prompt, oracle)
    tag = "oracle " if oracle is not None else ""
    if not np.array_equal(spec, greedy):
        raise RuntimeError(f"{tag}speculative greedy != plain greedy:\n{spec}\n{greedy}")
    R = len(rounds)
    if len(accept_lens) != R or len(draft_lens) != R:
        raise RuntimeError(f"{R} draft_block calls but {len(accept_lens)} recorded rounds")
    counts = [len(r["drafts"]) for r in rounds]
    accepted = [int(a) for a in accept_lens]
    if counts != [r["block_size"] - 1 for r in rounds] or counts != draft_lens:
        raise RuntimeError(f"draft counts {counts} vs block sizes / draft_lens {draft_lens}")
    # Round r starts after `emitted` tokens (the first bonus is greedy[0]); its drafts are
    # compared with the greedy tokens at the same places: the accepted prefix must match and
    # the first rejected draft must differ.
    emitted = 1
    for i, (r, a) in enumerate(zip(rounds, accepted)):
        budget = GREEDY_TOKENS - emitted
        if r["block_size"] != min(BLOCK_SIZE, budget + 1):
            raise RuntimeError(f"{tag}round {i}: block size {r['block_size']}")
        if r["kwargs"] != {"greedy": True}:
            raise RuntimeError(f"{tag}round {i}: draft_block kwargs {r['kwargs']}")
        if r["bonus"] != int(greedy[emitted - 1]):
            raise RuntimeError(f"{tag}round {i}: bonus {r['bonus']} != greedy[{emitted - 1}]")
        if r["position"] != PROMPT_LEN + emitted - 2 or r["kv_valid_len"] != r["position"] + 1:
            raise RuntimeError(f"{tag}round {i}: position {r['position']}, emitted {emitted}")
        ref = list(greedy[emitted:emitted + counts[i]])
        for j, dtok in enumerate(r["drafts"][:a + 1]):
            if (j < a) != (dtok == int(ref[j])):
                raise RuntimeError(f"{tag}round {i}: accepted {a} inconsistent with drafts "
                                   f"{r['drafts']} vs greedy {ref}")
        if oracle is not None and a != min(counts[i], ORACLE_SCHEDULE[i % len(ORACLE_SCHEDULE)]):
            raise RuntimeError(f"oracle round {i}: accepted {a}")
        emitted += min(a + 1, budget)
    if emitted != GREEDY_TOKENS:
        raise RuntimeError(f"{tag}rounds cover {emitted} tokens")
    return spec, rounds, accepted, counts


# ---------------------------------------------------------------------------------------------
# Goldens


def goldens(out: Path, notes: dict):
    prompt = g.make_prompt(PROMPT_SEED)
    target = g.load_vlm(out / "target")
    g.assert_loaded_matches_file(target, out / "target")
    lm_model = g.load_lm(out / "target")
    g.assert_loaded_matches_file(lm_model, out / "target",
                                 prefix_filter=lambda k: k.startswith("language_model."))
    drafter = load_assistant(out / "assistant")

    # Plain greedy: mlx-vlm text model with its own caches (make_golden.py's vlm_greedy),
    # cross-checked against mlx-lm's generate_step and mlx-vlm's generate_step.
    greedy, _ = g.vlm_greedy(target, prompt)
    lm_greedy, _ = g.greedy(lm_model, prompt)
    if not np.array_equal(lm_greedy, greedy):
        raise RuntimeError("mlx-lm greedy differs from mlx-vlm greedy")
    if not np.array_equal(plain_vlm_generate(target, prompt), greedy):
        raise RuntimeError("mlx-vlm generate_step (no drafter) differs from greedy")

    spec, rounds, accepted, counts = run_and_validate(target, drafter, prompt, greedy, None)
    # Second run through the same round loop, with the drafts replaced by the oracle schedule
    # (the real drafter still runs on the inputs the loop gives it, and is recorded).
    o_spec, o_rounds, o_accepted, o_counts = run_and_validate(
        target, drafter, prompt, greedy, (greedy, ORACLE_SCHEDULE))

    # Round-1 drafter inputs against an independent target forward: the hidden is the final
    # norm output at the last prompt position, the shared K/V the caches of the last
    # non-shared layer of each type (layers 3 sliding / 2 full) after the prompt.
    lm = target.language_model
    first = rounds[0]
    full_hidden = np.array(lm.model(mx.array(prompt)[None]).astype(mx.float32))[0, -1]
    notes["first_hidden_vs_final_norm"] = float(np.abs(first["hidden"] - full_hidden).max())
    if notes["first_hidden_vs_final_norm"] > CHECK_ATOL:
        raise RuntimeError("round-1 hidden is not the final-normed target hidden")
    first_logits = lm.logits_from_hidden(mx.array(first["hidden"])[None, None])
    if int(mx.argmax(first_logits[0, -1]).item()) != int(greedy[0]):
        raise RuntimeError("round-1 hidden does not produce the first bonus token")
    cache = lm.make_cache()
    lm(mx.array(prompt)[None], cache=cache)
    donors = {}
    for t in LAYER_TYPE_ORDER:
        idx = max(i for i in range(lm.model.first_kv_shared_layer_idx)
                  if lm.config.layer_types[i] == t)
        k, v = cache[idx].state[:2]
        donors[t] = idx
        sk, sv = first["shared_kv"][t]
        n = sk.shape[-2]
        diff = max(float(np.abs(np.array(k[..., :n, :]) - sk).max()),
                   float(np.abs(np.array(v[..., :n, :]) - sv).max()))
        notes[f"first_shared_kv_{t}_vs_layer{idx}_cache"] = diff
        if n != PROMPT_LEN or diff > CHECK_ATOL:
            raise RuntimeError(f"round-1 {t} K/V ({n} keys) differ from layer {idx} cache")
    notes["donor_layers"] = donors

    # Every position the oracle run drafts from was also drafted from by the main run (which
    # advances one token per round), through a different history of verify blocks; the drafter
    # inputs and outputs there must agree.
    by_pos = {r["position"]: r for r in rounds}
    hid_diff, same_drafts = 0.0, True
    for r in o_rounds:
        m = by_pos[r["position"]]
        if r["bonus"] != m["bonus"] or r["shared_kv_shapes"] != m["shared_kv_shapes"]:
            raise RuntimeError(f"oracle round at {r['position']}: inputs differ from main run")
        hid_diff = max(hid_diff, float(np.abs(r["hidden"] - m["hidden"]).max()))
        for t in LAYER_TYPE_ORDER:
            for a, b in zip(r["shared_kv"][t], m["shared_kv"][t]):
                hid_diff = max(hid_diff, float(np.abs(a - b).max()))
        n = min(len(r["drafter_drafts"]), len(m["drafter_drafts"]))
        same_drafts &= r["drafter_drafts"][:n] == m["drafter_drafts"][:n]
    notes["oracle_vs_main_inputs"] = hid_diff
    notes["oracle_vs_main_drafts_equal"] = same_drafts
    if hid_diff > CHECK_ATOL or not same_drafts:
        raise RuntimeError("oracle-run drafter inputs/outputs differ from the main run's")

    def per_round(rs, cnts, acc, prefix):
        drafts = np.full((len(rs), BLOCK_SIZE - 1), -1, dtype=np.int32)
        mine = np.full((len(rs), BLOCK_SIZE - 1), -1, dtype=np.int32)
        for i, r in enumerate(rs):
            drafts[i, :cnts[i]] = r["drafts"]
            mine[i, :cnts[i]] = r["drafter_drafts"]
        t = {
            f"{prefix}round_drafts": drafts,
            f"{prefix}round_draft_counts": np.array(cnts, dtype=np.int32),
            f"{prefix}round_accepted": np.array(acc, dtype=np.int32),
            f"{prefix}round_bonus": np.array([r["bonus"] for r in rs], dtype=np.int32),
            f"{prefix}round_positions": np.array([r["position"] for r in rs], dtype=np.int32),
            f"{prefix}round_hidden": np.stack([r["hidden"] for r in rs]).astype(np.float32),
        }
        if prefix:
            t[f"{prefix}round_drafter_drafts"] = mine
        else:
            assert np.array_equal(mine, drafts)
        s = {k: v.tolist() for k, v in t.items() if not k.endswith("round_hidden")}
        s[f"{prefix}num_rounds"] = len(rs)
        s[f"{prefix}round_kv_lens"] = [
            {lt: r["shared_kv_shapes"][lt][0][2] for lt in LAYER_TYPE_ORDER} for r in rs]
        s[f"{prefix}round_draft_steps"] = [
            [{"query_offset": m["query_offset"], "kv_valid_len": m["kv_valid_len"],
              "mask_is_none": m["mask_is_none"]} for m in r["mask_calls"]] for r in rs]
        return t, s

    main_t, main_s = per_round(rounds, counts, accepted, "")
    oracle_t, oracle_s = per_round(o_rounds, o_counts, o_accepted, "oracle_")
    tensors = {
        "prompt": prompt.astype(np.int32),
        "greedy": greedy.astype(np.int32),
        "spec_greedy": spec.astype(np.int32),
        "oracle_spec_greedy": o_spec.astype(np.int32),
        "first_hidden": first["hidden"].astype(np.float32),
        "first_shared_k_sliding": first["shared_kv"]["sliding_attention"][0],
        "first_shared_v_sliding": first["shared_kv"]["sliding_attention"][1],
        "first_shared_k_full": first["shared_kv"]["full_attention"][0],
        "first_shared_v_full": first["shared_kv"]["full_attention"][1],
        **main_t,
        **oracle_t,
    }
    summary = {
        "generator": "tests/golden/assistant/make_golden.py",
        **REFERENCE,
        "prompt": tensors["prompt"].tolist(),
        "greedy": tensors["greedy"].tolist(),
        "spec_greedy": tensors["spec_greedy"].tolist(),
        "spec_greedy_equals_greedy": True,
        "oracle_spec_greedy": tensors["oracle_spec_greedy"].tolist(),
        "oracle_spec_greedy_equals_greedy": True,
        "oracle_schedule": list(ORACLE_SCHEDULE),
        "block_size": BLOCK_SIZE,
        "first_position": first["position"],
        "first_kv_offset": first["kv_offset"],
        "first_kv_valid_len": first["kv_valid_len"],
        "first_hidden_shape": first["hidden_shape"],
        "first_shared_kv_shapes": first["shared_kv_shapes"],
        "shared_kv_donor_layers": donors,
        **main_s,
        **oracle_s,
    }
    return tensors, summary


def generate(out: Path, log=print) -> dict:
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "assistant"):
        if (out / name).exists():
            shutil.rmtree(out / name)
    target = build_target(out / "target")
    build_assistant(out / "assistant", target)
    notes = {}
    tensors, summary = goldens(out, notes)
    meta = {"format": "mlx", "generator": "tests/golden/assistant/make_golden.py",
            **REFERENCE}
    mx.save_safetensors(str(out / "golden.safetensors"),
                        {k: mx.array(v) for k, v in sorted(tensors.items())}, metadata=meta)
    with open(out / "golden.json", "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
    notes["rounds"] = summary["num_rounds"]
    notes["accepted"] = sum(summary["round_accepted"])
    notes["drafted"] = sum(summary["round_draft_counts"])
    notes["oracle_rounds"] = summary["oracle_num_rounds"]
    notes["oracle_accepted"] = sum(summary["oracle_round_accepted"])
    notes["first_position"] = summary["first_position"]
    notes["seconds"] = round(time.time() - t0, 2)
    log("assistant: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in notes.items()))
    return notes


# ---------------------------------------------------------------------------------------------
# --check


def compare_json(new: Path, old: Path, errors: list) -> None:
    if not old.exists():
        errors.append(f"{old}: missing")
    elif json.loads(new.read_text()) != json.loads(old.read_text()):
        errors.append(f"{old}: content differs from a fresh generation")


def check(out: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="assistant-golden-") as tmp:
        tmp = Path(tmp)
        generate(tmp, log=lambda s: print("  regenerated " + s))
        errors = []
        for name in GENERATED:
            new, old = tmp / name, out / name
            if new.is_dir():
                new_files = sorted(p.name for p in new.iterdir())
                old_files = sorted(p.name for p in old.iterdir()) if old.is_dir() else []
                if new_files != old_files:
                    errors.append(f"{old}: files {old_files}, expected {new_files}")
                    continue
                pairs = [(new / f, old / f) for f in new_files]
            else:
                pairs = [(new, old)]
            for a, b in pairs:
                if not b.exists():
                    errors.append(f"{b}: missing")
                elif a.name.endswith(".json"):
                    compare_json(a, b, errors)
                elif a.name.endswith(".safetensors"):
                    g.compare_tensors(a, b, errors)
                else:
                    errors.append(f"{b}: unexpected file")
    return g.report(errors, out, Path(__file__))


if __name__ == "__main__":
    sys.exit(g.cli(__doc__, HERE, generate, check))
