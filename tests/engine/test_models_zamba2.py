"""Zyphra Zamba2 (models/zamba2.py: Mamba2 layers, the hybrid ones first running one of a few
shared transformer blocks over [hidden | embeddings]) against HF transformers.

Tiny random models: six Mamba2 layers (8 heads of 16 on 2 groups, state 16, conv 4), layers 1,
3 and 5 hybrid, running 2 shared blocks in turn (block 0 at layers 1 and 5) with rank-8 adapters
per application on q / k / v and gate_up, rope, tied embeddings; also with no attention
adapters and no rope, grouped-query attention, biases (add_bias_linear), one mixer group
(replicated under TP) and a time_step_min clamp that bites in prefill scans; with untied
embeddings, where transformers 5 unties the blocks too: each hybrid layer runs its own copy of
its block, with that block's adapters (once refused); and with one block for all three
applications, from a checkpoint holding every layer's (equal) copy under a tied config.
`LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on prompts
of 1 to 70 tokens, whole and in prefill chunks of 16, on the CPU backend and the Triton one (on four
layers, the one block at both hybrid layers). Tied, the blocks are one module each, untied one a
hybrid layer (HF's parameter count either way); each application has its own KV; forks (n = 3)
continue their parent's state, prefix caching resumes from state snapshots with the outputs of an
engine without it, TP=2 gives the one-process results, and a LoRA adapter on the mixers' and hybrid
layers' own projections gives HF's tokens on the merged model. Refused: per-layer copies of a block
that differ under a tied config (HF unties them with a warning), attention adapters with fewer KV
heads than heads (HF cannot run those either), and LoRA on a projection of a block that runs at
several layers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hf_reference import assert_lora_matches_hf_merged, assert_tp_matches_one_process
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_runs_match_hf,
    assert_snapshots_keep_outputs,
    copy_with_equal_blocks,
    random_prompts,
    tie_embeddings,
    tiny_dirs,
)

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.models.hybrid import is_hybrid, layer_types, num_kv_layers
from paged_engine.models.zamba2 import Zamba2ForCausalLM
from paged_engine.testing import tiny_config, write_lora_adapter

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

_PLAIN = {
    "use_shared_attention_adapter": False,
    "use_mem_rope": False,
    "num_key_value_heads": 2,
    "add_bias_linear": True,  # in_proj / out_proj, gate_up / down
    "mamba_ngroups": 1,  # replicated on every TP rank, its norm's squares summed across them
    "time_step_min": 0.5,  # softplus(dt) reaches ~0.3 to ~3 in these models
}
# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "zamba2": ("zamba2", {}),
    "zamba2-plain": ("zamba2", _PLAIN),
    "zamba2-untied": ("zamba2", {"tie_word_embeddings": False}),  # blocks untied too
    "zamba2-oneblock": ("zamba2", {"num_mem_blocks": 1, "tie_word_embeddings": False}),
    # for the interpreted Triton kernels (each layer costs seconds a step): four layers, the one
    # tied block at both hybrid layers, each application with its own adapters and KV
    "zamba2-short": (
        "zamba2",
        {
            "num_hidden_layers": 4,
            "layers_block_type": ["linear_attention", "hybrid"] * 2,
            "num_mem_blocks": 1,
        },
    ),
}


@pytest.fixture(scope="module")
def zamba2_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.fixture(scope="module")
def oneblock_dir(zamba2_dirs, tmp_path_factory):
    """The untied one-block model with every layer's copy of the block equal under a tied
    config (HF ties the three equal copies; we load them into one module)."""
    src = zamba2_dirs("zamba2-oneblock")
    config = transformers.AutoConfig.from_pretrained(src)
    hybrid = [i for i, t in enumerate(config.layers_block_type) if t == "hybrid"]
    # block j % num_mem_blocks at the j-th hybrid layer: each copy as that block's first one
    first = {layer: hybrid[j % config.num_mem_blocks] for j, layer in enumerate(hybrid)}
    path = tmp_path_factory.mktemp("zamba2-oneblock-shared")
    return tie_embeddings(copy_with_equal_blocks(src, path, "shared_transformer", first))


@pytest.mark.parametrize(
    ("name", "runs"),
    [
        # (backend, prefill budget): chunks of 16 carry KV and state across them; the Triton
        # kernels (paged_kernels, interpreted) on shorter prompts
        pytest.param("zamba2", [("cpu", None), ("cpu", 16)], id="zamba2-cpu"),
        pytest.param("zamba2-short", [("triton", 16)], id="zamba2-triton"),
        pytest.param("zamba2-plain", [("cpu", 16)], id="zamba2-plain-cpu"),
        # untied: a block a hybrid layer (refused before)
        pytest.param("zamba2-untied", [("cpu", 16)], id="zamba2-untied-cpu"),
        pytest.param("zamba2-oneblock", [("cpu", None)], id="zamba2-oneblock-cpu"),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, runs, zamba2_dirs, request):
    path = (
        request.getfixturevalue("oneblock_dir") if name == "zamba2-oneblock" else zamba2_dirs(name)
    )
    assert_runs_match_hf(name, path, runs, _check_layout)


def _check_layout(llm: LLM, hf) -> None:
    """Tied, one module per shared block, run at each of its layers; untied, a block a hybrid
    layer (HF's parameters either way); a state pool per layer, KV per hybrid layer (its own
    paged attention)."""
    model = llm.llm_engine.model_runner.model
    layers = model.model.layers
    config = hf.config
    hybrid = [i for i, t in enumerate(config.layers_block_type) if t == "hybrid"]
    assert hybrid == list(range(1, len(layers), 2))
    blocks = [layers[i].shared_transformer for i in hybrid]
    n = config.num_mem_blocks if config.tie_word_embeddings else len(hybrid)
    assert all(blocks[j] is blocks[j % n] for j in range(len(hybrid)))
    assert len({id(b) for b in blocks}) == n
    assert len({id(layers[i].attn) for i in hybrid}) == len(hybrid)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    assert model.model.kv_index == [
        hybrid.index(i) if i in hybrid else -1 for i in range(len(layers))
    ]
    assert len(llm.llm_engine.model_runner.states.layers) == len(layers)


def test_layer_types_and_refusals():
    config = tiny_config("zamba2")
    lin, hyb = "linear_attention", "hybrid"
    assert layer_types(config) == [lin, hyb] * 3
    assert is_hybrid(config) and num_kv_layers(config) == 3
    # older configs say "mamba" / "hybrid"
    older = SimpleNamespace(layers_block_type=["mamba", "hybrid", "mamba"])
    assert is_hybrid(older) and num_kv_layers(older) == 1
    # HF's k / v adapters are 2 * hidden wide: fewer KV heads cannot take them
    with pytest.raises(ValueError, match="use_shared_attention_adapter needs num_key_value"):
        Zamba2ForCausalLM(tiny_config("zamba2", num_key_value_heads=2))


def test_tied_distinct_blocks_are_refused(zamba2_dirs, tmp_path):
    # each layer's own copy of the one block, the config tying them: one module cannot serve
    # them (HF unties them, warning that the config should say untied)
    same = {1: 1, 3: 3, 5: 5}
    src = zamba2_dirs("zamba2-oneblock")
    path = tie_embeddings(copy_with_equal_blocks(src, tmp_path, "shared_transformer", same))
    with pytest.raises(ValueError, match=r"differ, but both belong to one shared block .* set tie"):
        LLM(model=str(path), dtype="float32", max_model_len=128)


def test_forks_and_prefix_cache_keep_outputs(zamba2_dirs):
    llm = LLM(model=str(zamba2_dirs("zamba2")), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)
    del llm
    # untied: the tied tiny head (embeddings of std 0.5, logits ~4x an untied head's) magnifies
    # the float noise of scanning in other chunks (~1e-4) past what the check allows
    assert_snapshots_keep_outputs(zamba2_dirs("zamba2-untied"))


@pytest.mark.parametrize("name", ["zamba2", "zamba2-plain", "zamba2-untied"])
def test_tensor_parallel_matches_one_process(name, zamba2_dirs):
    # attention heads (and the adapters' B rows), MLP halves and mixer heads over 2 ranks. The
    # all-reduces sum in another order and the recurrent state carries that through 48 tokens:
    # up to 1.9e-4 apart on an AVX-512 EPYC (within 1e-4 on other CPUs); tokens identical.
    prompts = random_prompts(5, (5, 23, 40))
    assert_tp_matches_one_process(zamba2_dirs(name), prompts, 8, 128, abs_tol=5e-4)


def test_lora_matches_hf_merged_and_shared_blocks_refuse_it(zamba2_dirs, tmp_path):
    """An adapter on every layer's own projections (the mixers' in_proj / out_proj, the hybrid
    layers' linear) gives HF's tokens on the merged model. One on a shared block's projection
    names each application's module, which here are one module: refused, not merged."""
    path = zamba2_dirs("zamba2")
    prompt = random_prompts(11, (23,))[0]
    targets = ("in_proj", "out_proj", "linear")
    assert_lora_matches_hf_merged(path, tmp_path, prompt, 8, 5, targets=targets)
    adapter = write_lora_adapter(tmp_path / "q", path, rank=4, target_modules=("q_proj",))
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match=r"shared_transformer\.self_attn\.qkv_proj .* twice"):
        llm.generate(
            [{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("q", 1, str(adapter))
        )
