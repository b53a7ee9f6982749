"""Zyphra Zamba v1 (models/zamba.py: Mamba v1 layers with heads, layers/zamba_mamba.py, the
hybrid ones first running the one shared transformer block over [hidden | embeddings])
against HF transformers.

Tiny random models: five Mamba layers (2 heads of 64 channels, state 16, conv 4, dt rank 4),
layers 2 and 4 hybrid (HF's fixed layer 2, then attn_layer_period 2 / offset 1), the block's
attention 4 heads of 32 without rope, a GELU MLP, tied embeddings; also with grouped-query
attention of heads narrower than 2D / heads (attention_head_dim), in_proj / out_proj biases,
no conv bias and untied embeddings, where transformers 5 unties the block too: each hybrid
layer runs its own copy (once refused); and that checkpoint with equal copies under a tied
config. `LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32) on prompts of 1 to 70 tokens in one batch, whole and in prefill chunks of 16, on the
CPU backend and the Triton one (interpreted). Tied, the block is one module (HF's parameter
count), untied one a hybrid layer; each application has its own KV; forks (n = 3) continue
their parent's state, prefix caching resumes from state snapshots (after generated tokens
too: no prompt-only dt limit) with the outputs of an engine without it, preempted requests
recompute to the same outputs, and TP=2 (a mixer head, an attention KV head a rank) gives the
one-process results. Refused: per-layer copies of the block that differ under a tied config
(HF unties them with a warning), attention_hidden_size != 2 * hidden, a mixer activation
other than SiLU.
"""

from __future__ import annotations

import pytest
from hf_reference import assert_tp_matches_one_process
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_preemption_keeps_outputs,
    assert_runs_match_hf,
    assert_snapshots_keep_outputs,
    copy_with_equal_blocks,
    random_prompts,
    tie_embeddings,
    tiny_dirs,
)

from paged_engine import LLM
from paged_engine.models.hybrid import is_hybrid, layer_types, num_kv_layers
from paged_engine.models.zamba import ZambaForCausalLM
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "zamba": ("zamba", {}),
    "zamba-plain": (
        "zamba",
        {
            "num_key_value_heads": 2,
            "attention_head_dim": 16,  # not 2 * hidden / heads = 32
            "mamba_proj_bias": True,
            "mamba_conv_bias": False,
            "tie_word_embeddings": False,  # HF then builds and saves per-layer blocks
        },
    ),
}


@pytest.fixture(scope="module")
def zamba_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.fixture(scope="module")
def plain_dir(zamba_dirs):
    """The untied model: each hybrid layer's own (random) copy of the block."""
    return zamba_dirs("zamba-plain")


@pytest.fixture(scope="module")
def tied_copies_dir(zamba_dirs, tmp_path_factory):
    """The untied model with layer 4's copy of the block rewritten as layer 2's under a tied
    config (HF ties the equal copies; we load them into one module)."""
    path = tmp_path_factory.mktemp("zamba-tied-copies")
    src = zamba_dirs("zamba-plain")
    return tie_embeddings(copy_with_equal_blocks(src, path, "shared_transf", {2: 2, 4: 2}))


@pytest.mark.parametrize(
    ("name", "runs"),
    [
        # (backend, prefill budget): chunks of 16 carry KV, conv window and state across them
        pytest.param("zamba", [("cpu", None), ("cpu", 16)], id="zamba-cpu"),
        pytest.param("zamba", [("triton", 16)], id="zamba-triton"),
        # untied: a block a hybrid layer (refused before)
        pytest.param("zamba-plain", [("cpu", 16)], id="zamba-plain-cpu"),
        pytest.param("zamba-tied-copies", [("cpu", None)], id="zamba-tied-copies-cpu"),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, runs, zamba_dirs, request):
    fixture = {"zamba-plain": "plain_dir", "zamba-tied-copies": "tied_copies_dir"}.get(name)
    path = zamba_dirs(name) if fixture is None else request.getfixturevalue(fixture)
    assert_runs_match_hf(name, path, runs, _check_layout)


def _check_layout(llm: LLM, hf) -> None:
    """Tied, one module for the shared block, run at both hybrid layers; untied, a block a
    layer (HF's parameters either way); each its own paged attention and KV; a state pool per
    layer."""
    model = llm.llm_engine.model_runner.model
    layers = model.model.layers
    assert [i for i, t in enumerate(hf.config.layers_block_type) if t == "hybrid"] == [2, 4]
    tied = hf.config.tie_word_embeddings
    assert (layers[2].shared_transf is layers[4].shared_transf) == tied
    assert layers[2].attn is not layers[4].attn
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert model.model.kv_index == [-1, -1, 0, -1, 1]
    assert len(llm.llm_engine.model_runner.states.layers) == 5


def test_layer_types_and_refusals():
    config = tiny_config("zamba")
    lin, hyb = "linear_attention", "hybrid"
    assert layer_types(config) == [lin, lin, hyb, lin, hyb]
    assert is_hybrid(config) and num_kv_layers(config) == 2
    with pytest.raises(ValueError, match="attention_hidden_size=96 must be 2 \\* hidden_size"):
        ZambaForCausalLM(tiny_config("zamba", attention_hidden_size=96))
    with pytest.raises(ValueError, match="supports the 'silu' activation only, got 'gelu'"):
        ZambaForCausalLM(tiny_config("zamba", hidden_mamba_act="gelu"))


def test_tied_distinct_blocks_are_refused(zamba_dirs, tmp_path):
    # each hybrid layer's own copy of the block, the config tying them: one module cannot
    # serve both (HF unties them, warning that the config should say untied)
    path = tie_embeddings(
        copy_with_equal_blocks(zamba_dirs("zamba-plain"), tmp_path, "shared_transf", {2: 2, 4: 4})
    )
    with pytest.raises(ValueError, match=r"differ, but both belong to the shared block .* set tie"):
        LLM(model=str(path), dtype="float32", max_model_len=128)


def test_forks_prefix_cache_and_preemption_keep_outputs(zamba_dirs, plain_dir):
    llm = LLM(model=str(zamba_dirs("zamba")), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)
    del llm
    # untied: a tied tiny head (embeddings of std 0.5) magnifies the float noise of scanning
    # in other chunks past the check's 1e-4. Decode snapshots too (CHAT_HITS).
    llm = assert_snapshots_keep_outputs(plain_dir)
    assert llm.llm_engine.scheduler.state_slots.past_prompt
    del llm
    assert_preemption_keeps_outputs(plain_dir)


def test_tensor_parallel_matches_one_process(plain_dir):
    # attention heads (2 KV heads: one a rank), MLP halves and the 2 mixer heads (one a rank)
    # over 2 ranks: the one-process engine's tokens, logprobs within float noise
    prompts = random_prompts(5, (5, 23, 40))
    assert_tp_matches_one_process(plain_dir, prompts, 8, 128, abs_tol=5e-4)
