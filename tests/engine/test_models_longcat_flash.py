"""LongCat-Flash (`LongcatFlashForCausalLM`) against HF transformers.

`LLM.generate` on a tiny random LongCat-Flash (tiny_config "longcat_flash": 2 layers of two MLA
sublayers each, so 4 latent caches; LoRA scalings away from 1 on queries and latents; YaRN x4
with mscale_all_dim; a shortcut MoE whose softmax router picks 3 of 4 experts + 2 zero experts,
with a correction bias and routed_scaling_factor 1.7) gives HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32). Also: TP=2 gives the one-process results, and the config fields
this support refuses are refused by name.
"""

from __future__ import annotations

import pytest
from hf_reference import assert_tiny_case_matches_hf, assert_tp_matches_one_process

from paged_engine.testing import tiny_config, write_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("transformers.models.longcat_flash")


def test_longcat_flash_matches_hf(tmp_path) -> None:
    assert_tiny_case_matches_hf("longcat_flash", "longcat_flash", {}, tmp_path, num_prompts=4)


def test_longcat_flash_without_zero_experts_matches_hf(tmp_path) -> None:
    overrides = {"zero_expert_num": 0, "moe_topk": 2, "rope_parameters": None}
    assert_tiny_case_matches_hf("longcat_flash_plain", "longcat_flash", overrides, tmp_path)


def test_longcat_flash_tp2_matches_one_process(tmp_path) -> None:
    path = write_tiny_model(tmp_path, "longcat_flash", seed=1)
    prompts = [[5, 9, 33, 200, 17, 44, 71, 8, 90, 12], [300, 4, 77, 150]]
    assert_tp_matches_one_process(path, prompts, max_tokens=6, max_model_len=64)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"router_bias": True}, "router_bias"),
        ({"head_dim": 16}, "head_dim"),
        ({"qk_head_dim": 32}, "qk_head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_longcat_flash_refuses_by_name(overrides: dict, field: str) -> None:
    from paged_engine.models.longcat_flash import LongcatFlashForCausalLM

    config = tiny_config("longcat_flash", **overrides)
    with pytest.raises(ValueError, match=field):
        LongcatFlashForCausalLM(config)


def test_longcat_flash_skips_mtp_weights(tmp_path) -> None:
    """The released checkpoints carry multi-token-prediction weights (`model.mtp.*`) that HF
    skips on load; so do we, and the outputs stay the same."""
    import torch
    from safetensors.torch import load_file, save_file

    from paged_engine import LLM, SamplingParams

    path = write_tiny_model(tmp_path, "longcat_flash", seed=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": [5, 9, 33, 200, 17, 44]}]

    def run() -> list:
        llm = LLM(model=str(path), dtype="float32", max_model_len=64)
        out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
        return [out.token_ids, [sorted(d) for d in out.logprobs]]

    before = run()
    tensors = load_file(path / "model.safetensors")
    tensors["model.mtp.layers.0.self_attn.q_a_proj.weight"] = torch.ones(32, 64)
    tensors["model.mtp.norm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert run() == before
