"""RoPE scalings at positions past the original context: tiny models whose
original_max_position_embeddings / max_position_embeddings is 16-32 generate to ~100 positions,
where short prompts never reach, and must give HF's greedy tokens and logprobs.

Pinned choices where HF cannot be followed token for token (layers/rotary.py):
- dynamic NTK: HF's angles up to max_position_embeddings (its base grows only past it); a
  max_model_len past max_position_embeddings is refused (vLLM would serve it with a base fixed
  at max_position_embeddings x factor, numbers HF gives no sequence).
- longrope: one factor set per engine, vLLM's choice: the long set for every sequence once
  max_model_len exceeds original_max_position_embeddings (HF switches per sequence length).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches, edited_checkpoint, hf_greedy, load_hf_model

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0}
# Phi-3: head_dim 16 x partial_rotary_factor 0.75 = 12 rotary dims, 6 factors a set
_PHI3 = {
    "max_position_embeddings": 96,
    "original_max_position_embeddings": 24,
    "sliding_window": None,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 3.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 7.0, 12.0],
    },
}


def _prompt(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _assert_engine_matches(
    path: Path,
    hf,
    prompt: list[int],
    max_tokens: int,
    max_model_len: int,
) -> None:
    """`prompt` twice, one after the other (the second from the prefix cache), prefilled 16
    tokens a step, gives `hf`'s greedy tokens and top-5 logprobs (2e-4; the top 5, not only the
    chosen token's, as a tiny model may be sure of its choice: Gemma 3's log p = 0 each step)."""
    ref = hf_greedy(hf, prompt, max_tokens, top=5)
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=max_model_len,
        block_size=16,
        max_num_batched_tokens=16,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        request = {"prompt_token_ids": prompt}
        outs = [llm.generate([request], params, use_tqdm=False)[0] for _ in range(2)]
    finally:
        llm.llm_engine.shutdown()
    assert outs[1].num_cached_tokens >= (len(prompt) - 1) // 16 * 16  # its full blocks
    for i, out in enumerate(outs):
        assert_matches(f"request {i}", out, ref, abs_tol=2e-4)


# (arch, config overrides, max_model_len): every sequence runs to max_model_len - 1 tokens,
# 3-4x past the original context the scaling stretches
_CASES = {
    "llama-linear": ("llama", {"max_position_embeddings": 24, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}}, 96),
    "llama-yarn-mscale": ("llama", {"max_position_embeddings": 24, "rope_parameters": {
        **_YARN, "mscale": 1.0, "mscale_all_dim": 0.707}}, 96),
    "qwen2-yarn-attention-factor": ("qwen2", {"max_position_embeddings": 96, "rope_parameters": {
        **_YARN, "original_max_position_embeddings": 24, "attention_factor": 1.3}}, 96),
    "llama-llama3-big-theta": ("llama", {"max_position_embeddings": 96, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e8, "factor": 8.0,
        "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0}}, 96),
    "glm4-yarn-partial-untruncated": ("glm4", {"max_position_embeddings": 24, "rope_parameters": {
        **_YARN, "partial_rotary_factor": 0.5, "truncate": False, "beta_fast": 16.0,
        "beta_slow": 2.0}}, 96),
    "deepseek_v3-yarn-mla": ("deepseek_v3", {"max_position_embeddings": 96, "rope_parameters": {
        **_YARN, "original_max_position_embeddings": 24, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.707}}, 96),
    # linear x8 on the full-attention layer only
    "gemma3-linear-global": ("gemma3", {"max_position_embeddings": 96}, 96),
    # yarn on the full-attention layer, the sliding one unscaled
    "olmo3-yarn-full-layers": ("olmo3", {"max_position_embeddings": 96, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2,
        "original_max_position_embeddings": 24}}, 96),
    # a prompt past the original context: HF's long factors from the first token, as ours
    "phi3-longrope-partial": ("phi3", _PHI3, 96),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_CASES))
def test_scaled_rope_matches_hf_past_original_context(case: str, tmp_path: Path) -> None:
    arch, overrides, max_model_len = _CASES[case]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompt = _prompt(case, 40)
    _assert_engine_matches(path, load_hf_model(path), prompt, max_model_len - 41, max_model_len)


def test_top_level_original_context_wins_over_the_scaling_dicts(tmp_path: Path) -> None:
    """A config-level original_max_position_embeddings beside a yarn dict holding another value:
    transformers (standardize_rope_params) and vLLM (patch_rope_parameters) read the top-level
    one, for the yarn ramp and the stretched context (16 x 4 = 64 positions)."""
    saved = write_tiny_model(
        tmp_path / "saved",
        "llama",
        seed=1,
        max_position_embeddings=32,
        rope_parameters={**_YARN, "original_max_position_embeddings": 32},
    )
    path = edited_checkpoint(saved, tmp_path / "edited", original_max_position_embeddings=16)
    _assert_engine_matches(path, load_hf_model(path), _prompt("top-level", 30), 33, 64)
    with pytest.raises(ValueError, match=r"max_model_len=65 exceeds .* context length 64"):
        LLM(model=str(path), dtype="float32", max_model_len=65)


def test_stretched_context_bound_and_its_last_position(tmp_path: Path) -> None:
    """yarn x4 over 24 positions serves max_model_len 96 and no more; a prompt of 95 tokens
    reads the table's last row HF's way."""
    path = write_tiny_model(
        tmp_path, "llama", seed=1, max_position_embeddings=24, rope_parameters=dict(_YARN)
    )
    _assert_engine_matches(path, load_hf_model(path), _prompt("last-row", 95), 1, 96)
    with pytest.raises(ValueError, match=r"max_model_len=97 exceeds .* stretched by its rope"):
        LLM(model=str(path), dtype="float32", max_model_len=97)


def test_dynamic_ntk_follows_hf_up_to_max_position_and_refuses_past_it(tmp_path: Path) -> None:
    """Dynamic NTK: HF's base stays unscaled while a sequence fits max_position_embeddings (48
    here), so a sequence filling it equals HF; past it HF grows the base per length, which no
    fixed table serves, so a longer max_model_len is refused."""
    rope = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 4.0}
    path = write_tiny_model(
        tmp_path, "llama", seed=1, max_position_embeddings=48, rope_parameters=rope
    )
    _assert_engine_matches(path, load_hf_model(path), _prompt("dynamic", 20), 28, 48)
    refusal = r"max_model_len=49 exceeds .* max_position_embeddings=48; its dynamic NTK rope"
    with pytest.raises(ValueError, match=refusal):
        LLM(model=str(path), dtype="float32", max_model_len=49)


def test_longrope_factor_set_follows_max_model_len(tmp_path: Path) -> None:
    """A sequence that starts inside Phi-3's original context (24) and grows past it: with
    max_model_len 24 the short factors throughout (HF's for every such sequence); with
    max_model_len 96 the long factors for every position from the first token (vLLM's
    choice), which is HF with its short set replaced by the long one."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = write_tiny_model(tmp_path, "phi3", seed=1, **_PHI3)
    hf = load_hf_model(path)
    prompt = _prompt("longrope", 12)
    _assert_engine_matches(path, hf, prompt, 12, 24)
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=25)
    rotary = hf.model.rotary_emb
    assert not torch.equal(rotary.original_inv_freq, long_inv_freq)
    rotary.original_inv_freq.copy_(long_inv_freq)
    rotary.inv_freq.copy_(long_inv_freq)
    _assert_engine_matches(path, hf, prompt, 40, 96)
