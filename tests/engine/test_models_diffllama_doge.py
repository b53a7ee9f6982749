"""DiffLlama and Doge against HF transformers.

Tiny random checkpoints of the real HF classes, saved by transformers and loaded through
paged's loader: `LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32) on 12-40 token prompts.

DiffLlama: differential attention over a cache of twice the KV heads (models/diffllama.py),
lambda's four vectors random (their dot products of either sign), GQA with one value head a
half (4 heads over 2) and with two (8 over 4: the halves' offsets matter), q / k / v / o
biases, a tied head, a linear rope scaling. Also: chunked prefill over cached prefix blocks,
preempted in a small pool, gives the plain engine's results; the cache holds 2 * KV heads; an
odd KV head count is refused by name.

Doge: dynamic mask attention (each key's bias from its cached values, A random of either sign)
keeping a query's 8 keys of highest bias, also one query row at a time; the CDMoE (4 x 4
product-key experts, HF's logits split across a prompt's tokens) with biases and a sliding
window; chunked prefill with prefix caching and preemption (dense) gives the plain engine's
results; too many experts a token and an fp8 KV cache are refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_parity import assert_serves_like_hf, checkpoint_dirs, load_hf_as_saved, write_hf_checkpoint
from hf_reference import assert_chunks_prefix_hits_and_preemption_match_plain, random_token_prompts

from paged_engine import LLM
from paged_engine.testing import _COMMON
from paged_engine.worker.cache_engine import kv_layers

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.diffllama")

VOCAB = 512

_DIFFLLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    **_COMMON,
}


def _diffllama(**over) -> tuple[type, object]:
    config = transformers.DiffLlamaConfig(**{**_DIFFLLAMA, **over})
    return transformers.DiffLlamaForCausalLM, config


_DOGE = {**_DIFFLLAMA, "keep_window_size": 8}


def _doge(**over) -> tuple[type, object]:
    config = transformers.DogeConfig(**{**_DOGE, **over})
    return transformers.DogeForCausalLM, config


# name -> a (class, config) builder
CASES = {
    "diffllama": _diffllama,
    "diffllama-wide": lambda: _diffllama(
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    ),
    # each query keeps its 8 causal keys of highest bias
    "doge": _doge,
    # the CDMoE (16 experts as 4 x 4 product keys, 4 a token), biases, windows of 12 keys
    "doge-moe": lambda: _doge(
        is_moe=True,
        num_experts=16,
        num_experts_per_tok=4,
        attention_bias=True,
        mlp_bias=True,
        keep_window_size=2048,
        sliding_window=12,
    ),
}


@torch.no_grad()
def _small_lambdas(model: torch.nn.Module, seed: int) -> None:
    """lambda_q* / lambda_k* ~ N(0, 0.4): `_randomize` sets 1-D weights near 1, which makes
    lambda = e^(D) - e^(D) + ... and hides the subtraction's precision."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if ".lambda_" in name or name.endswith(".A"):  # Doge's A: biases of either trend
            p.copy_(torch.randn(p.shape, generator=gen) * 0.4)


def write_model(path: Path, name: str, seed: int = 1) -> Path:
    """A tiny random checkpoint of case `name` as transformers saves it, with a tokenizer and
    generation config."""
    cls, config = CASES[name]()
    return write_hf_checkpoint(path, cls, config, seed, adjust=lambda m: _small_lambdas(m, seed))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return checkpoint_dirs(tmp_path_factory, write_model)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name, model_dirs):
    _assert_matches_hf(name, model_dirs(name))


def test_doge_one_query_row_at_a_time_matches_hf(model_dirs, monkeypatch):
    """The dynamic mask attention over blocks of query rows (one row here) gives HF's too."""
    from paged_engine.models import doge

    monkeypatch.setattr(doge, "_MAX_SCORES", 1)
    _assert_matches_hf("doge", model_dirs("doge"))


def _assert_matches_hf(name: str, path: Path) -> None:
    hf = load_hf_as_saved(path)
    assert_serves_like_hf(name, path, random_token_prompts(name, 3), hf=hf)
    if name.startswith("diffllama"):  # what the cache engine allocates a layer: 2 * KV heads
        shape = (2 * hf.config.num_key_value_heads, hf.config.head_dim)
        assert kv_layers(hf.config) == [shape] * hf.config.num_hidden_layers


@pytest.mark.parametrize("name", ["diffllama-wide", "doge"])
def test_chunked_prefill_prefix_cache_and_preemption_match_plain(name, model_dirs):
    """Prefill in chunks of 8 over cached prefix blocks of 4, preempted in a small pool: the
    plain engine's tokens and logprobs."""
    more = random_token_prompts(name, 2)
    assert_chunks_prefix_hits_and_preemption_match_plain(model_dirs(name), more)


def test_diffllama_refusals():
    from paged_engine.models.diffllama import DiffLlamaForCausalLM

    _, config = _diffllama(num_key_value_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DiffLlamaForCausalLM(config)


def test_doge_refusals(model_dirs):
    from paged_engine.models.doge import DogeForCausalLM

    _, config = _doge(is_moe=True, num_experts=16, num_experts_per_tok=17)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        DogeForCausalLM(config)
    with pytest.raises(ValueError, match="dynamic mask"):
        LLM(model=str(model_dirs("doge")), dtype="float32", kv_cache_dtype="fp8")
