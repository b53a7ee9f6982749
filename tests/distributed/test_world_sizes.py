"""World sizes other than 2: how pipeline stages split an uneven layer count (vLLM's rule), which
shapes are refused before any rank starts, and two real worlds of 3 and 4 gloo ranks (KV heads
replicated over TP=4 with a padded vocabulary and a tied head; PP=3 over 4 layers) that give the
single-process engine's outputs."""

from __future__ import annotations

import itertools
import random

import pytest
from torchrun_generate import run_two_nodes

from paged_engine import LLM, SamplingParams
from paged_engine.distributed.parallel_state import (
    check_model_parallelism,
    stage_layers,
    stage_sizes,
)
from paged_engine.layers.linear import QKVParallelLinear
from paged_engine.models.utils import PPMissingLayer
from paged_engine.testing import tiny_config, write_tiny_model

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("layers", "stages", "sizes"),
    [
        (3, 2, [2, 1]),
        (6, 3, [2, 2, 2]),
        (4, 3, [1, 2, 1]),  # one extra layer: the middle stage, not the embedding's
        (5, 3, [2, 2, 1]),
        (8, 3, [3, 3, 2]),
        (5, 4, [1, 1, 2, 1]),
        (7, 4, [2, 2, 2, 1]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_uneven_layers_go_to_the_stages_before_the_last(layers, stages, sizes):
    assert stage_sizes(layers, stages) == sizes
    bounds = [stage_layers(layers, r, stages) for r in range(stages)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous
    assert [end - start for start, end in bounds] == sizes


def test_shapes_no_world_size_can_split_are_refused_by_name():
    llama = tiny_config("llama")  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4"):
        check_model_parallelism(llama, 3, 1)
    gqa = tiny_config(
        "llama", hidden_size=96, num_attention_heads=12, num_key_value_heads=3, intermediate_size=96
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=4 and the model's 3 KV heads"):
        check_model_parallelism(gqa, 4, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2"):
        check_model_parallelism(llama, 1, 3)
    # every width divides 3 but the shared expert's
    moe = tiny_config(
        "qwen2_moe",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
    )
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=64"):
        check_model_parallelism(moe, 3, 1)
    # a layer built at such a size anyway names the option too
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must be a multiple"):
        QKVParallelLinear(64, 16, 4, 3, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide this layer's num_h"):
        QKVParallelLinear(64, 16, 4, 2, tp_rank=0, tp_size=3)


def test_every_layers_kv_head_count_is_checked_before_any_rank_starts():
    """Gemma 4's full layers have their own KV head count (num_global_key_value_heads): the
    check reads each layer's, whether or not the config allows a global read (the loader's
    does; a bare one raises on it)."""
    arch = {"architectures": ["Gemma4ForCausalLM"]}
    gemma4 = tiny_config("gemma4_moe", **arch)  # 4 heads; sliding layers 2 KV heads, full 1
    check_model_parallelism(gemma4, 2, 1)
    check_model_parallelism(gemma4, 4, 1)
    for allow_global in (False, True):
        odd = tiny_config("gemma4_moe", num_global_key_value_heads=3, **arch)
        odd.allow_global_per_layer_attribute_access = allow_global
        with pytest.raises(ValueError, match="tensor_parallel_size=2 and the model's 3 KV heads"):
            check_model_parallelism(odd, 2, 1)


def _outputs(path, probes=(), **kwargs):
    """(greedy tokens and logprobs of three random prompts, each probe's per-rank results:
    `llm.collective_rpc(probe)`)."""
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, **kwargs)
    try:
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randint(3, 24))]}
            for _ in range(3)
        ]
        sp = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        ranks = [llm.collective_rpc(probe) for probe in probes]
    finally:
        llm.llm_engine.shutdown()
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return got, ranks


def _built_layers(worker) -> list[int]:
    """The decoder layers this rank built (the others are another stage's)."""
    layers = worker.model_runner.model.model.layers
    return [i for i, layer in enumerate(layers) if not isinstance(layer, PPMissingLayer)]


def _assert_same(got, want):
    for (g_tokens, g_lps), (w_tokens, w_lps) in zip(got, want, strict=True):
        assert g_tokens == w_tokens
        assert g_lps == pytest.approx(w_lps, abs=1e-4)


@pytest.mark.slow
def test_tp4_replicates_a_single_kv_head_with_a_padded_vocab_and_tied_head(tmp_path):
    # 4 query heads over 4 ranks, 1 KV head on each; 509 = 4 * 128 - 3 ids; tied embeddings
    path = write_tiny_model(tmp_path, "qwen3", seed=3, num_key_value_heads=1, vocab_size=509)
    want, _ = _outputs(path)
    got, (built,) = _outputs(path, (_built_layers,), tensor_parallel_size=4)
    _assert_same(got, want)
    assert built == [[0, 1]] * 4


@pytest.mark.slow
def test_pp3_over_four_layers_gives_the_middle_stage_two(tmp_path):
    path = write_tiny_model(tmp_path, "llama", seed=3, num_hidden_layers=4)
    want, _ = _outputs(path)
    got, (built,) = _outputs(path, (_built_layers,), pipeline_parallel_size=3)
    _assert_same(got, want)
    assert built == [[0], [1, 2], [3]]


@pytest.mark.slow
def test_every_torchrun_node_names_the_shape_it_refuses(tmp_path):
    """Two torchrun "nodes" of one rank each, TP=2 over 3 KV heads: each node's rank raises the
    same ValueError itself (not only rank 0, while the other waits on a vanished rendezvous)."""
    model = write_tiny_model(
        tmp_path / "model",
        "llama",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=96,
    )
    codes, logs = run_two_nodes(str(model), str(tmp_path / "out.json"), 2, 1, timeout=180)
    assert codes == [1, 1]
    for log in logs:
        assert "ValueError: tensor_parallel_size=2 and the model's 3 KV heads" in log, log
