"""CodeGen, BioGPT and XGLM against HF transformers.

`LLM.generate` on tiny random models, saved as HF saves them, must give HF `generate`'s greedy
tokens and the same top-5 logprobs (1e-3, float32), per variant: CodeGen with partial rotary
(8 of 16 dims) and its 4-group q | v | k fused rows, untied and tied head (the head's bias
either way); BioGPT and XGLM as released (scaled embeddings, tied head; XGLM's tiny
pad_token_id 2 zeroes position 0's sinusoid row, as HF's table does) and unscaled with an
untied head (XGLM also without a padding row). CodeGen also at TP=2, where the regathered
q / k / v split by heads.
"""

from __future__ import annotations

import pytest
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

UNSCALED_UNTIED = {"scale_embedding": False, "tie_word_embeddings": False}
CASES = {
    "codegen": ("codegen", {}),
    "codegen_tied": ("codegen", {"tie_word_embeddings": True}),
    "biogpt": ("biogpt", {}),
    "biogpt_unscaled_untied": ("biogpt", UNSCALED_UNTIED),
    "xglm": ("xglm", {}),
    "xglm_unscaled_untied_no_pad": ("xglm", {**UNSCALED_UNTIED, "pad_token_id": None}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path, num_prompts=2, max_tokens=8)


def test_codegen_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): each rank gets two of the four heads' q / k / v rows, regathered from
    CodeGen's grouped layout before the split."""
    path = write_tiny_model(tmp_path, "codegen", seed=2)
    assert_tp_matches_one_process(path, random_token_prompts(4, 2), 6, max_model_len=64)


@pytest.mark.parametrize(
    ("arch", "overrides", "match"),
    [
        ("codegen", {"n_embd": 66, "n_head": 6}, "hidden_size=66"),
        ("xglm", {"add_cross_attention": True}, "add_cross_attention"),
        ("biogpt", {"hidden_act": "swish_cubed"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused_by_name(arch, overrides, match):
    from paged_engine.models import MODEL_REGISTRY

    config = tiny_config(arch, **overrides)
    with pytest.raises(ValueError, match=match):
        MODEL_REGISTRY[type(config).__name__.removesuffix("Config") + "ForCausalLM"](config)


def test_codegen_rotary_dim_none_is_refused_with_several_heads():
    """Older transformers let rotary_dim be None (5.25 refuses it in the config): HF's table
    is then hidden_size wide, which fits one head only."""
    from types import SimpleNamespace

    from paged_engine.models.codegen import CodeGenForCausalLM

    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, rotary_dim=None)
    with pytest.raises(ValueError, match="rotary_dim=None"):
        CodeGenForCausalLM(config)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("codegen", ("transformer.h.0.attn.causal_mask", "transformer.h.1.attn.masked_bias")),
        ("xglm", ("model.embed_positions._float_tensor", "model.embed_positions.weights")),
    ],
)
def test_released_checkpoint_buffers_are_ignored(arch, extra, tmp_path):
    """The released checkpoints carry buffers HF recomputes (CodeGen's causal masks, fairseq's
    position placeholders in XGLM's): they load without complaint, the weights as saved."""
    import torch
    from safetensors.torch import load_file

    from paged_engine.loader import load_hf_config, load_model, resolve_model

    path = write_tiny_model(tmp_path, arch, seed=3)
    resolved = resolve_model(str(path))
    model = load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")
    want = {name: p.detach().clone() for name, p in model.named_parameters()}
    weights = load_file(path / "model.safetensors")
    weights.update({name: torch.ones(2, 2) for name in extra})
    model.load_weights(weights.items())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
