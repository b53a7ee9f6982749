"""Inkling (models/inkling.py) against HF transformers.

Tiny random models (tiny_config "inkling": two sliding layers with a window of 8 and their own
head geometry around a full layer whose relative bias reaches 12 keys back and whose q and bias
are log-scaled past position 4, all shorter than the prompts; a dense layer and two MoE layers
whose shared experts sit in the routing softmax, a route scale and learned global scales; four
short convolutions per layer; a mup logit divisor of 3 and a head padded past
`unpadded_vocab_size`), and the same stack all dense without log scaling: `LLM.generate` must
give HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on prompts of 1 to 70
tokens, whole and in prefill chunks of 16, on the CPU backend, the torch one and the Triton one
(which runs the convolutions and KV writes; the relative-bias attention is torch on every
backend). Every layer holds both a KV cache and recurrent conv state. Forks (n = 3) continue
their parent's state, beam search gives HF's beams, prefix caching resumes from state snapshots
with the outputs of an engine without it, TP=2 gives the one-process results, and a stack
without a full layer is refused naming layer_types.
"""

from __future__ import annotations

import pytest
from hf_reference import assert_tp_matches_one_process
from hybrid_checks import (
    assert_beam_search_matches_hf,
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_snapshots_keep_outputs,
    random_prompts,
    tiny_dirs,
)

from paged_engine import LLM
from paged_engine.models.hybrid import is_hybrid, num_kv_layers
from paged_engine.testing import tiny_config, write_tiny_model

pytest.importorskip("transformers.models.inkling")

# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "inkling": ("inkling", {}),
    "inkling-dense": ("inkling", {"mlp_layer_types": ["dense"] * 3, "log_scaling_n_floor": None}),
}


@pytest.fixture(scope="module")
def inkling_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("inkling", "cpu", None),
        ("inkling", "cpu", 16),  # prefill chunks of 16: KV and conv state carry across them
        ("inkling-dense", "cpu", None),
        ("inkling", "torch", 16),
        ("inkling", "triton", 16),  # paged_kernels' Triton kernels (interpreted)
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, inkling_dirs):
    llm = assert_greedy_matches_hf(name, inkling_dirs(name), backend, budget)
    runner = llm.llm_engine.model_runner
    # 4 conv states a layer (k, v, attention output, MLP output) and a KV cache a layer
    assert len(runner.states.layers) == 12 and runner.model.model.kv_index == [0, 1, 2]


def test_every_layer_holds_kv_and_state():
    config = tiny_config("inkling")
    assert is_hybrid(config) and num_kv_layers(config) == 3


def test_forks_and_prefix_cache_keep_outputs(inkling_dirs):
    path = inkling_dirs("inkling")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)
    del llm
    assert_snapshots_keep_outputs(path)


def test_beam_search_matches_hf(inkling_dirs):
    assert_beam_search_matches_hf(inkling_dirs("inkling"))


def test_tensor_parallel_matches_one_process(inkling_dirs):
    path = inkling_dirs("inkling")
    assert_tp_matches_one_process(path, random_prompts(5, (5, 23, 40)), 8, 128)


def test_all_sliding_stack_is_refused(tmp_path):
    path = write_tiny_model(tmp_path, "inkling", layer_types=["hybrid_sliding"] * 3)
    with pytest.raises(ValueError, match="layer_types"):
        LLM(model=str(path), dtype="float32", max_model_len=64)
