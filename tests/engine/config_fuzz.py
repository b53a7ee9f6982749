"""A randomized model-configuration parity run against HF transformers: one seed draws a family
and a tiny config whose fields take the values real Hub configs of that family use
(config_draws.py: MHA / GQA / MQA, explicit head_dim, biases, tied heads, rope bases and every
scaling the family's HF code takes, sliding windows and layer_types, softcaps, MoE routing
fields, DeepSeek's MLA shapes; config_draws_hybrid.py: the hybrid and state-space families'
layer patterns and Mamba2 / DeltaNet / conv fields), writes random weights, and serves 2-3
prompts of random lengths (some past the window, longrope's past its original context) through
`LLM`: greedy tokens must be HF's and each token's logprob within 1e-3 (float32).

Half the seeds rewrite config.json as older Hub configs spell it (`to_hub_layout`; hybrids'
layer patterns too: `to_hub_layer_names`), which both loaders must read alike. A config paged
refuses must be refused with a ValueError naming a drawn field (else a failure); a draw HF
itself cannot build or run is skipped and counted.

test_config_fuzz.py runs a few seeds in the suite; `python tests/engine/config_fuzz.py FIRST
COUNT [FAMILIES|all]` runs many, one line a seed and a summary.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from config_draws import FAMILIES, FULL, WINDOW
from config_draws_hybrid import to_hub_layer_names

MAX_MODEL_LEN = 128
PER_TYPE_ROPE = ("gemma3_text", "olmo3")  # families whose HF config keeps a rope per layer type
NULL_HEAD_DIM = ("llama", "mistral", "mixtral")  # HF classes whose head_dim may be null
# transformers 5.25's RecurrentGemma runs a 1-token prompt as a decode step on the state its
# modules kept from the previous sequence: its prompts are drawn 2 tokens long at least
SHORTEST_PROMPT = {"recurrent_gemma": 2}


def context_len(config: dict[str, Any], family: str) -> int:
    """The longest sequence paged serves for `config` (as vLLM derives it): max_position_embeddings,
    stretched by a linear (x factor) or yarn (original x factor) scaling (not per-layer-type
    ropes: layers/rotary.py scaled_context_limit); at most MAX_MODEL_LEN."""
    limit = config.get("max_position_embeddings", MAX_MODEL_LEN)  # (Mamba's configs: none)
    scaling = config.get("rope_scaling") or {}
    if family in PER_TYPE_ROPE:  # a rope per layer type: not stretched
        scaling = {}
    if scaling.get("rope_type") == "linear":
        limit = max(limit, int(limit * scaling["factor"]))
    elif scaling.get("rope_type") == "yarn":
        orig = scaling.get("original_max_position_embeddings", limit)
        limit = max(limit, int(orig * scaling["factor"]))
    return min(limit, MAX_MODEL_LEN)


def draw(seed: int, families: list[str]) -> tuple[str, dict[str, Any], list[int], int, int]:
    """(family, config overrides, prompt lengths, tokens per prompt, max_model_len) of one
    seed."""
    rng = random.Random(seed)
    family = rng.choice(families)
    config = FAMILIES[family][1](rng)
    max_tokens = rng.randint(3, 8)
    scaling = config.get("rope_scaling") or {}
    orig = scaling.get("original_max_position_embeddings")
    orig = orig or config.get("original_max_position_embeddings")
    max_len = context_len(config, family)
    shortest = SHORTEST_PROMPT.get(family, 1)
    if scaling.get("rope_type") == "longrope" and orig < max_len:
        shortest = orig + 1
    longest = max_len - max_tokens
    lengths = [
        rng.randint(shortest, max(shortest, min(longest, rng.choice((20, 60, longest)))))
        for _ in range(rng.randint(2, 3))
    ]
    return family, config, lengths, max_tokens, max_len


def to_hub_layout(path: Path, rng: random.Random) -> list[str]:
    """config.json spelled as older Hub configs spell it: rope_theta at the top and the scaling
    (if any) as rope_scaling (maybe under its old key `type`), Gemma 3's rope_local_base_freq
    and sliding_window_pattern; maybe without num_key_value_heads (MHA), head_dim (when it is
    hidden / heads) or tie_word_embeddings (the family's default then). The edits made."""
    import transformers

    config = json.loads((path / "config.json").read_text())
    edits = []
    rope = config.pop("rope_parameters", None)
    if isinstance(rope, dict) and FULL in rope:  # Gemma 3, OLMo 3: one rope per layer type
        if config["model_type"] in ("gemma3_text", "gemma3n_text"):
            config["rope_local_base_freq"] = rope[WINDOW]["rope_theta"]
        rope = rope[FULL]  # (OLMo 3's sliding layers: the full ones' base, unscaled)
    if isinstance(rope, dict):
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        if rope["rope_type"] != "default":
            if rng.random() < 0.3:
                rope = {"type": rope.pop("rope_type"), **rope}
                edits.append("type")
            config["rope_scaling"] = rope
    if config["model_type"] == "gpt_neox" and "rope_theta" in config:  # NeoX's own names
        config["rotary_emb_base"] = config.pop("rope_theta")
        config["rotary_pct"] = config.pop("partial_rotary_factor")
        edits.append("rotary_pct")
    types = config.get("layer_types")
    for n in range(2, 7):
        want = [FULL if (i + 1) % n == 0 else WINDOW for i in range(len(types or []))]
        if config["model_type"] == "gemma3_text" and types == want and rng.random() < 0.7:
            del config["layer_types"]
            config["sliding_window_pattern"] = n
            edits.append(f"sliding_window_pattern {n}")
            break
    # a field left out means the HF class's default: leave out only what equals it
    default = transformers.AutoConfig.for_model(config["model_type"])
    heads = config.get("num_attention_heads", 0)  # (Mamba's configs: no attention)
    probe = transformers.AutoConfig.for_model(
        config["model_type"], hidden_size=4096, num_attention_heads=64
    )
    # an omitted num_key_value_heads follows the heads
    mha = getattr(probe, "num_key_value_heads", None) == 64
    if mha and config.get("num_key_value_heads") == heads and rng.random() < 0.5:
        del config["num_key_value_heads"]
        edits.append("no num_key_value_heads")
    plain = heads and config.get("head_dim") == config["hidden_size"] // heads
    if config["model_type"] in NULL_HEAD_DIM and plain and rng.random() < 0.4:
        config["head_dim"] = None
        edits.append("head_dim null")
    if config["tie_word_embeddings"] == default.tie_word_embeddings and rng.random() < 0.5:
        del config["tie_word_embeddings"]
        edits.append("no tie_word_embeddings")
    edits += to_hub_layer_names(config, rng)  # hybrids' layer patterns
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return edits


def _named_fields(config: dict[str, Any]) -> set[str]:
    names = set(config) | {"rope_scaling", "rope_parameters", "rope_type"}
    return names | {k for k in config.get("rope_scaling") or {} if k != "factor"}


def run_seed(seed: int, families: list[str], workdir: Path) -> tuple[str, str, str]:
    """(family, outcome: ok / refused / skip / FAIL, detail) of one seed."""
    import torch
    from hf_reference import hf_greedy, load_hf_model

    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_model

    family, config, lengths, max_tokens, max_len = draw(seed, families)
    layout_rng = random.Random(f"layout {seed}")
    hub_layout = layout_rng.random() < 0.5
    desc = f"{family} {config} prompts {lengths} x{max_tokens} (max_model_len {max_len})"
    path = workdir / f"seed{seed}"
    try:  # HF builds, saves, reloads and runs the draw, or the draw is skipped
        write_tiny_model(path, FAMILIES[family][0], seed=seed, **config)
        if hub_layout:
            desc += f" hub-layout {to_hub_layout(path, layout_rng)}"
        hf = load_hf_model(path)
        gen = torch.Generator().manual_seed(seed)
        prompts = [
            torch.randint(3, config["vocab_size"], (n,), generator=gen).tolist() for n in lengths
        ]
        refs = [hf_greedy(hf, p, max_tokens) for p in prompts]
    except Exception as e:  # HF's own refusal of the draw
        return family, "skip", f"{desc}: HF: {type(e).__name__}: {str(e)[:200]}"
    try:
        llm = LLM(
            model=str(path),
            dtype="float32",
            max_model_len=max_len,
            block_size=16,
            num_gpu_blocks_override=64,
        )
    except ValueError as e:
        named = any(f in str(e) for f in _named_fields(config))
        return (
            family,
            "refused" if named else "FAIL",
            f"{desc}: {'' if named else 'unnamed '}ValueError: {e}",
        )
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    problems = []
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        got = out.outputs[0]
        lps = [e[t].logprob for e, t in zip(got.logprobs, got.token_ids)]
        if got.token_ids != ref.tokens:
            problems.append(f"prompt {i}: tokens {got.token_ids} != HF {ref.tokens}")
        elif max(abs(a - b) for a, b in zip(lps, ref.logprobs)) > 1e-3:
            err = max(abs(a - b) for a, b in zip(lps, ref.logprobs))
            problems.append(f"prompt {i}: logprobs off by {err:.2e}")
    return (
        family,
        "FAIL" if problems else "ok",
        f"{desc}: {'; '.join(problems)}" if problems else desc,
    )


def main(first: int, count: int, families: list[str]) -> int:
    import logging
    import shutil

    from transformers.utils import logging as hf_logging

    logging.getLogger("paged_engine").setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    counts: dict[str, int] = {"ok": 0, "refused": 0, "skip": 0, "FAIL": 0}
    with tempfile.TemporaryDirectory(prefix="config_fuzz") as tmp:
        for seed in range(first, first + count):
            try:
                _, outcome, detail = run_seed(seed, families, Path(tmp))
            except Exception as e:  # a crash of ours is a finding too
                import traceback

                traceback.print_exc()
                outcome, detail = "FAIL", f"raised {e!r}"
            counts[outcome] += 1
            print(f"seed {seed} {outcome} {detail}", flush=True)
            shutil.rmtree(Path(tmp) / f"seed{seed}", ignore_errors=True)
    print(f"{count} seeds: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts["FAIL"]


if __name__ == "__main__":
    names = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else list(FAMILIES)
    sys.exit(1 if main(int(sys.argv[1]), int(sys.argv[2]), names) else 0)
