"""Llama 4 against HF transformers.

`LLM.generate` on tiny random models must give HF `generate`'s greedy tokens and the same top-5
logprobs (1e-3, float32). The tiny model (paged_engine.testing "llama4") has chunked rope layers
(chunks of 12 keys: prompts of 12-40 tokens and their continuations cross several), a NoPE layer
whose query temperature grows from position 3 on, MoE layers whose router scales the experts'
inputs, and dense MLPs of their own size; the second case routes each token to two experts
under Scout's llama3 rope scaling. Also: a checkpoint with one matrix per expert loads as the
fused one, TP=2 equals one process, and the layer kinds follow HF's config defaults when a
config.json omits them.
"""

from __future__ import annotations

import shutil

import pytest
from hf_reference import (
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    engine_greedy,
    random_token_prompts,
)

from paged_engine.models.llama4 import Llama4ForCausalLM, chunked_layers, moe_layers, rope_layers
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SCOUT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama4": {},
    "llama4_top2_llama3_rope": {"num_experts_per_tok": 2, "rope_parameters": SCOUT_ROPE},
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, "llama4", CASES[case], tmp_path)


def test_per_expert_checkpoint_loads_like_the_fused_one(tmp_path):
    """The fused experts rewritten as one HF Linear matrix per expert and projection (the
    layout of quantized checkpoints): the same tokens and logprobs."""
    path = write_tiny_model(tmp_path / "fused", "llama4", seed=3)
    split = tmp_path / "split"
    shutil.copytree(path, split)
    state = safetensors_torch.load_file(str(path / "model.safetensors"))
    out = {}
    for name, w in state.items():
        if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I]: x @ W
            stem, half = name.removesuffix("gate_up_proj"), w.shape[-1] // 2
            for e in range(w.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = w[e, :, :half].T.contiguous()
                out[f"{stem}{e}.up_proj.weight"] = w[e, :, half:].T.contiguous()
        elif name.endswith(".experts.down_proj"):  # [E, I, H]
            stem = name.removesuffix("down_proj")
            for e in range(w.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = w[e].T.contiguous()
        else:
            out[name] = w
    safetensors_torch.save_file(out, str(split / "model.safetensors"))
    prompts = random_token_prompts(3, 2)
    fused, per_expert = (
        engine_greedy(prompts, 6, model=str(m), max_model_len=64) for m in (path, split)
    )
    assert_same_greedy(fused, per_expert, abs_tol=1e-5)


def test_tensor_parallel_matches_one_process(tmp_path):
    """Heads, the dense MLPs, experts and shared expert split over 2 ranks (top-2 routing)."""
    path = write_tiny_model(tmp_path, "llama4", seed=2, num_experts_per_tok=2)
    assert_tp_matches_one_process(path, random_token_prompts(7, 2), 8, max_model_len=64)


@pytest.mark.parametrize(
    "fields",
    [
        {},  # HF's defaults: NoPE every 4th layer, MoE everywhere, chunked rope layers
        {"no_rope_layer_interval": 2, "interleave_moe_layer_step": 2},
        {"attention_chunk_size": None},  # no chunking at all
        {"no_rope_layers": [1, 0, 0, 1, 1, 1], "moe_layers": [0, 5]},
    ],
)
def test_layer_kinds_follow_hf_defaults(fields):
    """Our reading of a config.json without the derived fields equals HF's __post_init__."""
    hf = transformers.Llama4TextConfig(num_hidden_layers=6, **fields)
    raw = transformers.Llama4TextConfig(num_hidden_layers=6, **fields)
    for derived in ("no_rope_layers", "moe_layers", "layer_types"):
        setattr(raw, derived, fields.get(derived))  # as a config.json that omits them reads
    for config in (hf, raw):
        assert rope_layers(config) == [bool(f) for f in hf.no_rope_layers]
        assert moe_layers(config) == set(hf.moe_layers)
        assert chunked_layers(config) == [t == "chunked_attention" for t in hf.layer_types]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"attention_chunk_size": 0}, "attention_chunk_size"),
        ({"attention_chunk_size": -8}, "attention_chunk_size"),
    ],
)
def test_bad_layer_configs_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        Llama4ForCausalLM(tiny_config("llama4", **fields))
