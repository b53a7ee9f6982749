"""MiniMax-01 (models/minimax.py, layers/lightning_attention.py) against HF transformers:
lightning attention layers (a decaying [D, D] state per head, slopes by head and layer, a norm
over all heads, a sigmoid output gate) around an attention layer (with and without a sliding
window), post-norm
residuals weighted by six factors, a Mixtral MoE in every layer.

The tiny model (lightning, attention, lightning, lightning; transformers' prefill blocks of 4
tokens): `LLM.generate` gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32)
on prompts of 1 to 70 tokens, whole and in prefill chunks of 16, and on the Triton kernels
(interpreted); beams carry their own state; prefix caching from state snapshots and preemption
keep the outputs; TP=2 gives the one-process results; a release-style checkpoint (MiniMax's own
config names, `attn_type_list`, `layernorm_*` factors, trust_remote_code) is the same model."""

from __future__ import annotations

import json
import shutil

import pytest
from hf_reference import assert_matches, assert_tp_matches_one_process, hf_greedy, load_hf_model
from hybrid_checks import (
    assert_beam_search_matches_hf,
    assert_greedy_matches_hf,
    assert_preemption_keeps_outputs,
    assert_snapshots_keep_outputs,
    random_prompts,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers.models.minimax")


@pytest.fixture(scope="module")
def minimax_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("minimax"), "minimax", seed=1)


@pytest.mark.parametrize(
    ("backend", "budget"),
    [
        ("cpu", None),
        ("cpu", 16),  # prefill chunks of 16: the state carries across them
        ("triton", 16),  # paged_kernels' Triton kernels (interpreted on the CPU)
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(backend, budget, minimax_dir):
    assert_greedy_matches_hf("minimax", minimax_dir, backend, budget)


def test_beam_search_matches_hf(minimax_dir):
    # transformers' MiniMaxCache does not reorder its lightning states with the beams: its
    # uncached beam search is the reference
    assert_beam_search_matches_hf(minimax_dir, use_cache=False)


def test_prefix_cache_resumes_from_state_snapshots(minimax_dir):
    assert_snapshots_keep_outputs(minimax_dir)


def test_preemption_keeps_outputs(minimax_dir):
    assert_preemption_keeps_outputs(minimax_dir)


def test_sliding_window_matches_hf_without_cache(tmp_path):
    """A window of 4 on the attention layer, against transformers' forward over the whole
    sequence each step: its cached generate slides differently in this hybrid (it disagrees
    with its own uncached forward from the 4th token on), so the uncached one is the model."""
    path = write_tiny_model(tmp_path, "minimax", seed=1, sliding_window=4)
    hf = load_hf_model(path)
    prompts = random_prompts(9, (5, 23))
    refs = [hf_greedy(hf, p, 8, 5, use_cache=False) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate(token_requests(prompts), params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_matches(f"minimax-sliding-{i}", out, ref)


def test_tensor_parallel_matches_one_process(minimax_dir):
    assert_tp_matches_one_process(minimax_dir, random_prompts(5, (5, 23)), 6, 128)


# The releases' config class, as their repositories ship it (loaded with trust_remote_code).
_RELEASE_CONFIG = """
from transformers import PretrainedConfig


class MiniMaxText01Config(PretrainedConfig):
    model_type = "minimax_text_01"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""

_RELEASE_NAMES = {
    "linear_attn_alpha_factor": "layernorm_linear_attention_alpha",
    "linear_attn_beta_factor": "layernorm_linear_attention_beta",
    "full_attn_alpha_factor": "layernorm_full_attention_alpha",
    "full_attn_beta_factor": "layernorm_full_attention_beta",
    "mlp_alpha_factor": "layernorm_mlp_alpha",
    "mlp_beta_factor": "layernorm_mlp_beta",
}


def _release_copy(src, dst, **changes):
    """The tiny checkpoint with the releases' config: their class, names and layer list."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    types = config.pop("layer_types")
    for ours, theirs in _RELEASE_NAMES.items():
        config[theirs] = config.pop(ours)
    config.update(
        architectures=["MiniMaxText01ForCausalLM"],
        model_type="minimax_text_01",
        auto_map={"AutoConfig": "configuration_minimax_text_01.MiniMaxText01Config"},
        attn_type_list=[0 if t == "linear_attention" else 1 for t in types],
        postnorm=True,
        shared_intermediate_size=0,
    )
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "configuration_minimax_text_01.py").write_text(_RELEASE_CONFIG)
    return dst


def _greedy(path, prompts, **kw):
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, **kw)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(token_requests(prompts), params, use_tqdm=False)]


def test_release_config_names_load_the_same_model(minimax_dir, tmp_path):
    prompts = random_prompts(3, (5, 23))
    ours = _greedy(minimax_dir, prompts)
    release = _greedy(
        _release_copy(minimax_dir, tmp_path / "release"), prompts, trust_remote_code=True
    )
    for a, b in zip(ours, release, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"postnorm": False}, "postnorm"),
        ({"shared_intermediate_size": 16}, "shared_intermediate_size"),
    ],
)
def test_release_features_it_does_not_run_are_refused(minimax_dir, tmp_path, change, match):
    path = _release_copy(minimax_dir, tmp_path / "release", **change)
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", max_model_len=128, trust_remote_code=True)
