"""Xiaomi MiMo-V2-Flash against HF transformers.

`LLM.generate` on a tiny random MiMo-V2-Flash (tiny_config "mimo_v2_flash": full and sliding
layers with a window of 8 under the prompts' lengths, sliding layers with twice the KV heads and
attention sinks, q / k heads of 32 and value heads of 16 scaled by 0.5, a YaRN rope over half of
each head on the full layers and a default rope over HF's default 0.334 on the sliding ones,
dense and MoE layers with a grouped sigmoid router scaled by 2.5) gives HF `generate`'s greedy
tokens and top-5 logprobs (1e-3, float32), with the checkpoint's multi-token-prediction tensors
skipped as HF skips them; so does a variant with q / k / v biases, value heads as wide as the
keys, no value scale, one expert group without renormalization and a tied head, and the model
with a LoRA adapter on q / k / v / o (HF's merged model) at TP=1 and 2. Also: TP=2 gives the
one-process results (the full layers' single KV head replicated on both ranks, the sinks split
with their heads), each layer's KV cache has its own head count, and speculative_config method
"mtp" is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import (
    assert_lora_matches_hf_merged,
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import tiny_config, write_tiny_model

pytest.importorskip("transformers.models.mimo_v2_flash")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS, TOP = 10, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model with multi-token-prediction tensors (`model.mtp.*`) added, as the
    release's checkpoints carry them (HF ignores them on load)."""
    path = write_tiny_model(tmp_path_factory.mktemp("mimo_v2_flash"), "mimo_v2_flash", seed=1)
    file = str(path / "model.safetensors")
    weights = safetensors_torch.load_file(file)
    gen = torch.Generator().manual_seed(3)
    for name, shape in (("enorm.weight", (64,)), ("eh_proj.weight", (64, 128))):
        weights[f"model.mtp.layers.0.{name}"] = torch.randn(shape, generator=gen)
    safetensors_torch.save_file(weights, file, metadata={"format": "pt"})
    return path


def test_greedy_tokens_and_logprobs_match_hf(model_dir):
    hf = load_hf_model(model_dir)
    prompts = random_token_prompts("mimo_v2_flash", 3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("mimo_v2_flash", out, ref)
    assert llm.get_stats().num_used_blocks == 0


def test_variant_matches_hf(tmp_path):
    overrides = {
        "attention_bias": True,
        "v_head_dim": 32,
        "attention_value_scale": None,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 500.0},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 1.0,
            },
        },
    }
    assert_tiny_case_matches_hf("mimo_v2_flash_variant", "mimo_v2_flash", overrides, tmp_path)


def test_values_wider_than_keys_match_hf(tmp_path):
    """v_head_dim 48 over q / k heads of 32 (HF runs it): queries and keys padded with zeros
    to the cache's heads of 48, scores still scaled by 32^-0.5; at TP=2 too."""
    overrides = {"v_head_dim": 48}
    assert_tiny_case_matches_hf("mimo_v2_flash_wide_v", "mimo_v2_flash", overrides, tmp_path)
    from paged_engine.models import kv_cache_layout

    config = tiny_config("mimo_v2_flash", **overrides)
    config.architectures = ["MiMoV2FlashForCausalLM"]
    assert kv_cache_layout(config) == [(1, 48), (2, 48), (2, 48), (1, 48)]
    prompts = random_token_prompts("mimo_v2_flash_wide_v_tp", 2)
    assert_tp_matches_one_process(tmp_path, prompts, max_tokens=6, max_model_len=128)


def test_tp2_matches_one_process(model_dir):
    prompts = random_token_prompts("mimo_v2_flash_tp", 3)
    assert_tp_matches_one_process(model_dir, prompts, max_tokens=8, max_model_len=128)


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_on_attention_matches_hf_merged(model_dir, tmp_path, tp):
    """Adapters on q / k / v / o: the v part loads into the narrower value rows (on both ranks
    at TP=2, where the full layers' one KV head is replicated)."""
    prompt = random_token_prompts("mimo_v2_flash_lora", 1)[0]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert_lora_matches_hf_merged(model_dir, tmp_path, prompt, 6, TOP, tp=tp, targets=targets)


def test_kv_cache_layout_per_layer_type():
    from paged_engine.models import kv_cache_layout

    config = tiny_config("mimo_v2_flash")
    config.architectures = ["MiMoV2FlashForCausalLM"]
    # full, sliding, sliding, full: one KV head on full layers, two on sliding ones
    assert kv_cache_layout(config) == [(1, 32), (2, 32), (2, 32), (1, 32)]


def test_mtp_speculation_is_refused(model_dir):
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="method 'mtp'"):
        LLM(model=str(model_dir), dtype="float32", max_model_len=128, speculative_config=spec)
