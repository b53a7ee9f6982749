"""GPT-BigCode, Falcon, GPT-J, GPT-Neo, BLOOM and MPT against HF transformers.

`LLM.generate` on tiny random models, saved as HF saves them, must give HF `generate`'s greedy
tokens and the same top-5 logprobs (1e-3, float32), per variant: GPT-BigCode with multi-query
attention (one KV head) and without (per-head rows in `c_attn`); Falcon's new decoder
architecture (grouped KV rows per group, ln_attn / ln_mlp), 7B's layout (multi-query, one
LayerNorm, parallel attention), Falcon-11B's (new architecture, one LayerNorm) and RW's (ALiBi,
biases, sequential layer, multi-head); GPT-J (parallel layer, interleaved rotary on part of each
head, LM-head bias); BLOOM (ALiBi with 6 heads, two past the largest power of two, and the
embedding LayerNorm); MPT (its own ALiBi slope order for 6 heads, bias-free layers; also with
q / k / v clamped and a softmax scale of its own); GPT-Neo (unscaled scores, a global and a
local layer, window 8 < every prompt). Multi-query GPT-BigCode and grouped-KV Falcon
also at TP=2, where the lone KV head is replicated and the KV groups split.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
FALCON_7B = {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True}
FALCON_RW = {
    "new_decoder_architecture": False,
    "multi_query": False,
    "num_kv_heads": 4,  # HF's multi-head layout reads it: every head
    "parallel_attn": False,
    "alibi": True,
    "bias": True,
}
CASES = {
    "gpt_bigcode": ("gpt_bigcode", {}),
    "gpt_bigcode_mha": ("gpt_bigcode", {"multi_query": False}),
    "falcon_40b": ("falcon", {}),
    "falcon_11b": ("falcon", {"num_ln_in_parallel_attn": 1, "bias": True}),
    "falcon_7b": ("falcon", FALCON_7B),
    "falcon_rw": ("falcon", FALCON_RW),
    "gptj": ("gptj", {}),
    "bloom": ("bloom", {}),
    "mpt": ("mpt", {}),
    "mpt_clip_scale": ("mpt", {"attn_config": {"clip_qkv": 0.5, "softmax_scale": 0.2}}),
    "gpt_neo": ("gpt_neo", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("gpt_bigcode", {}), ("falcon", {}), ("falcon", FALCON_RW)],
    ids=["gpt_bigcode_multi_query", "falcon_grouped_kv", "falcon_rw_alibi"],
)
def test_tensor_parallel_matches_one_process(arch, overrides, tmp_path):
    """TP=2 (gloo): BigCode's one KV head on both ranks; Falcon's two KV groups one a rank;
    Falcon-RW's ALiBi slopes split with the heads."""
    path = write_tiny_model(tmp_path, arch, seed=2, **overrides)
    assert_tp_matches_one_process(path, random_token_prompts(4, 2), MAX_TOKENS, max_model_len=64)


@pytest.mark.parametrize(
    ("arch", "overrides", "kv_heads"),
    [
        ("falcon", {"new_decoder_architecture": False, "multi_query": True}, 1),
        ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, 2),
        ("gpt_bigcode", {"multi_query": True}, 1),
    ],
)
def test_loaded_config_names_its_kv_heads(arch, overrides, kv_heads, tmp_path):
    """The engine process's config carries `num_key_value_heads` (the KV cache's size, the TP
    checks), set by the loader from Falcon's / GPT-BigCode's own fields."""
    from paged_engine.distributed.parallel_state import check_model_parallelism
    from paged_engine.loader import load_hf_config, resolve_model
    from paged_engine.worker.cache_engine import num_cpu_blocks

    path = write_tiny_model(tmp_path / arch, arch, seed=1, **overrides)
    config = load_hf_config(resolve_model(str(path)))
    assert config.num_key_value_heads == kv_heads
    check_model_parallelism(config, 2, 1)  # one KV head replicated, or two split
    # the CPU pool is sized from the same count
    per_head = num_cpu_blocks(config, 16, torch.float32, 1.0) * kv_heads
    assert per_head == num_cpu_blocks(config, 16, torch.float32, 1.0 * kv_heads)


def test_bloom_bare_model_checkpoint_names(tmp_path):
    """BLOOM checkpoints saved from the bare model (bigscience/bloom-560m) name weights without
    `transformer.` and hold no LM head: they load as the full model's do."""
    import shutil

    from safetensors.torch import load_file, save_file

    from paged_engine.loader import load_hf_config, load_model, resolve_model

    full = write_tiny_model(tmp_path / "full", "bloom", seed=3)
    bare = tmp_path / "bare"
    shutil.copytree(full, bare)
    weights = load_file(full / "model.safetensors")
    renamed = {
        k.removeprefix("transformer."): v for k, v in weights.items() if k.startswith("transf")
    }
    assert len(renamed) == len(weights) - ("lm_head.weight" in weights)
    save_file(renamed, bare / "model.safetensors", metadata={"format": "pt"})
    models = []
    for path in (full, bare):
        resolved = resolve_model(str(path))
        models.append(
            load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")
        )
    ours, theirs = (dict(m.named_parameters()) for m in models)
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name


def test_mpt_context_length_and_refusals(tmp_path):
    """MPT's context length is its `max_seq_len` (StoryWriter's 65536, not the 2048 default);
    configs transformers would run differently from what they ask are refused by name."""
    from paged_engine.engine.llm_engine import _max_positions
    from paged_engine.models.mpt import MptForCausalLM
    from paged_engine.testing import tiny_config

    assert _max_positions(tiny_config("mpt", max_seq_len=65536)) == 65536
    for key, value in (("attn_type", "multiquery_attention"), ("qk_ln", True), ("alibi", False)):
        with pytest.raises(ValueError, match=f"attn_config.{key}"):
            MptForCausalLM(tiny_config("mpt", attn_config={key: value}))
