"""Nemotron (and Jais 2, its decoder with plain LayerNorms), DBRX, InternLM3 and K-EXAONE
(EXAONE-MoE) against HF transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32): Nemotron's LayerNorm1P norms (weight
stored minus 1, biases), relu^2 MLP and partial rotary (also with attention / MLP biases and a
tied head); DBRX's fused Wqkv clamped by clip_qkv (1.5: it bites), bias-free LayerNorms and
stacked experts with 1-norm routing weights (also 3 experts a token, weights divided by their
2-norm); InternLM3 (also with its qkv_bias / bias switches on), its checkpoint naming the
released `InternLM3ForCausalLM`; K-EXAONE's pre-norm layers with EXAONE 4.0's q / k norms,
sliding layers (window 8, shorter than every prompt) beside global NoPE layers and DeepSeek-V3
routing with a shared expert (also with explicit layer_types, dense / sparse layers from
mlp_layer_types, unnormalized ungrouped routing and a tied head). Checkpoints are
save_pretrained's (DBRX's `transformer.blocks.*` names and [E * I, H] expert stacks, K-EXAONE's
per-expert names and `mlp.e_score_correction_bias`); K-EXAONE also loads the fused experts
transformers 5 holds in memory. TP=2 gives the one-process results (DBRX, K-EXAONE). DBRX
takes its rope base from attn_config.rope_theta, as released configs hold it.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_matches,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
TOP = 5
_DBRX_FFN = {"ffn_hidden_size": 32, "moe_num_experts": 8}
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "nemotron": ("nemotron", {}),
    "nemotron-bias-tied": (
        "nemotron",
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    ),
    "jais2": ("jais2", {}),
    "dbrx": ("dbrx", {}),
    # 3 of 8 experts a token, their weights divided by their 2-norm (not summing to 1)
    "dbrx-p2": (
        "dbrx",
        {"ffn_config": {**_DBRX_FFN, "moe_top_k": 3, "moe_normalize_expert_weights": 2.0}},
    ),
    "internlm3": ("internlm3", {}),
    "internlm3-bias": ("internlm3", {"qkv_bias": True, "bias": True}),
    "exaone_moe": ("exaone_moe", {}),
    # Hy3: Qwen3's attention in K-EXAONE's decoder (testing.py); a random correction bias
    "hy_v3": ("hy_v3", {}),
    # layer kinds from an explicit layer_types (not the pattern's); dense / sparse layers
    # interleaved by mlp_layer_types; top-3 of all 8 (one group) not renormalized; tied head
    # (HF's config refuses sliding_window=None)
    "exaone_moe-layer-types": (
        "exaone_moe",
        {
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "mlp_layer_types": ["sparse", "dense", "sparse", "dense"],
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "tie_word_embeddings": True,
        },
    ),
}


def _write(tmp_path, name: str, seed: int):
    arch, overrides = CASES[name]
    path = write_tiny_model(tmp_path, arch, seed=seed, **overrides)
    if arch == "internlm3":  # HF saves its Llama class's name; released checkpoints their own
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        config["architectures"] = ["InternLM3ForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))
    return path


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name, tmp_path):
    needs = {"jais2": "Jais2Config", "hy_v3": "HYV3Config"}.get(name)
    if needs and not hasattr(transformers, needs):
        pytest.skip(f"this transformers has no {needs}")
    path = _write(tmp_path, name, seed=1)
    hf = load_hf_model(path)
    rng = random.Random(name)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(3)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    assert type(llm.llm_engine.model_runner.model).__name__ == (
        type(hf).__name__ if not name.startswith("internlm3") else "InternLM3ForCausalLM"
    )
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(name, out, ref)
    assert llm.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("name", ["dbrx", "exaone_moe"])
def test_tensor_parallel_matches_one_process(name, tmp_path):
    """TP=2 (gloo): DBRX's fused Wqkv split into sharded q / k / v and clamped, its stacked
    experts split over the ranks; K-EXAONE's per-head norms on sharded heads in sliding and NoPE
    layers, the routed and shared experts split over the ranks."""
    path = _write(tmp_path, name, seed=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 50)]
    assert_tp_matches_one_process(path, prompts, max_tokens=MAX_TOKENS, max_model_len=128)


def _load(path):
    resolved = resolve_model(str(path))
    return load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")


def test_exaone_moe_transformers5_names_load_like_the_checkpoint(tmp_path):
    """HF's in-memory state dict (experts fused as `experts.gate_up_proj` / `down_proj`, the
    balance bias as `mlp.gate.e_score_correction_bias`) loads the values the checkpoint's names
    (per expert, `mlp.e_score_correction_bias`) gave."""
    path = _write(tmp_path, "exaone_moe", seed=2)
    assert_hf_names_load_like_checkpoint(
        path, ".experts.gate_up_proj", ".mlp.gate.e_score_correction_bias"
    )


def test_dbrx_rope_base_comes_from_attn_config(tmp_path):
    """Released DBRX configs hold the rope base in attn_config.rope_theta (500000), where
    transformers 5 leaves its `rope_parameters` at the 10000 default: the attn_config value
    wins."""
    path = write_tiny_model(tmp_path, "dbrx", seed=0, rope_parameters=None)
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["attn_config"]["rope_theta"] == 500000.0
    rope = _load(path).model.rotary_emb
    want = RotaryEmbedding(16, 16, 256, 500000.0)
    assert torch.equal(rope.cos, want.cos) and torch.equal(rope.sin, want.sin)
