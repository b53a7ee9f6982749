"""RecurrentGemma (models/recurrent_gemma.py: Griffin's recurrent blocks, layers/rg_lru.py, among
local-attention blocks) against HF transformers.

A tiny random model (recurrent, recurrent, attention with a window of 8, recurrent; an RG-LRU
of 96 channels in 4 gate blocks after a conv of width 4; rope over half of each head; logits
soft cap 10): `LLM.generate` gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32) on a batch of prompts of 1 to 70 tokens, whole and in prefill chunks of 16 (the conv
window and the RG-LRU state carry across chunks). Forks (n = 3) continue their parent's state,
prefix caching resumes from state snapshots with the outputs of an engine without it, and
preempted (recomputed) requests keep their outputs.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_matches, hf_greedy, load_hf_model
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_preemption_keeps_outputs,
    assert_snapshots_keep_outputs,
    random_prompts,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

TOP, MAX_TOKENS = 5, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("recurrent_gemma"), "recurrent_gemma", seed=1)


def hf_fresh_greedy(hf, prompt: list[int]):
    """HF's greedy reference from fresh states: HF keeps each recurrent block's conv window and
    RG-LRU state on the module between `generate` calls, and a one-token prompt takes its decode
    path, which reads them (the RG-LRU resets at position 0, the conv window does not)."""
    for layer in hf.model.layers:
        block = layer.temporal_block
        if hasattr(block, "conv1d_state"):
            block.conv1d_state = torch.zeros(1, block.lru_width, block.conv1d_width - 1)
            block.rg_lru.recurrent_states = torch.zeros(1, block.lru_width)
    return hf_greedy(hf, prompt, MAX_TOKENS, TOP)


@pytest.fixture(scope="module")
def hf_refs(model_dir):
    prompts = random_prompts(7, (5, 23, 70, 1))
    hf = load_hf_model(model_dir)
    return prompts, [hf_fresh_greedy(hf, p) for p in prompts], float(hf.model.normalizer)


@pytest.mark.parametrize("budget", [None, 16])
def test_greedy_tokens_and_logprobs_match_hf(budget, model_dir, hf_refs):
    prompts, refs, normalizer = hf_refs
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, **kw)
    config = llm.llm_engine.config
    assert config.enable_prefix_caching and config.prefix_state_snapshots == config.max_num_seqs
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(token_requests(prompts), params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_matches(f"recurrent_gemma-{i}", out, ref)
    # a state layer a recurrent block: the conv window [C, K - 1] and h [C] in float32
    states = llm.llm_engine.model_runner.states
    assert len(states.layers) == 3
    for layer in states.layers:
        assert layer.conv_state.shape[1:] == (96, 3)
        assert layer.ssm_state.shape[1:] == (96,) and layer.ssm_state.dtype == torch.float32
    # sqrt(48) rounded to bfloat16, as HF's normalizer buffer
    model = llm.llm_engine.model_runner.model
    assert model.model.embedding_multiplier == normalizer != 48**0.5
    # only the attention layer holds KV; its window of 8 is the config's attention_window_size
    attn = model.model.layers[2].self_attn.attn
    assert attn.sliding_window == 8


def test_forks_continue_their_parents_state(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)


def test_prefix_cache_resumes_from_state_snapshots(model_dir):
    assert_snapshots_keep_outputs(model_dir)


def test_preemption_keeps_outputs(model_dir):
    assert_preemption_keeps_outputs(model_dir)


def test_unsupported_configs_are_refused(tmp_path):
    from paged_engine.models.recurrent_gemma import check_recurrent_gemma_config
    from paged_engine.testing import tiny_config

    with pytest.raises(ValueError, match="hidden_activation"):
        check_recurrent_gemma_config(tiny_config("recurrent_gemma", hidden_activation="relu"))
    with pytest.raises(ValueError, match="at least one full attention"):  # Hawk: no attention
        path = write_tiny_model(tmp_path, "recurrent_gemma", block_types=["recurrent"])
        LLM(model=str(path), dtype="float32", max_model_len=64)
