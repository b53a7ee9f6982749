"""What RL rollout loops call between generations (vLLM's names): `collective_rpc` on every
worker, the Worker's `update_weights` (HF-named tensors copied into the running model, whole or
partial) and `reset_prefix_cache`. After an update the engine generates what a fresh engine on
the new weights generates, and HF on them; under tensor parallelism too."""

from __future__ import annotations

import pytest
from hf_reference import hf_greedy, load_hf_model
from safetensors.torch import load_file

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model
from paged_engine.worker.worker import RpcError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 33, 80, 9] * 4, [7, 7, 100, 3], [12, 40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two checkpoints of one architecture: the engine starts on `a` and is updated to `b`."""
    root = tmp_path_factory.mktemp("weights")
    a = write_tiny_model(root / "a", "llama", seed=0)
    b = write_tiny_model(root / "b", "llama", seed=1)
    return a, b, load_file(str(b / "model.safetensors"))


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _fail(worker, message: str) -> None:
    raise ValueError(message)


def test_update_weights_then_generate_like_a_fresh_engine(models):
    a, b, b_weights = models
    llm = LLM(str(a), dtype="float32", max_model_len=64)
    before = _tokens(llm)  # also fills the prefix cache with a's KV
    updated = llm.collective_rpc("update_weights", args=(list(b_weights.items()),))
    assert updated == [len(dict(llm.llm_engine.model_runner.model.named_parameters()))]
    assert llm.reset_prefix_cache()
    hits = llm.get_stats().prefix_cache_hits
    after = _tokens(llm)
    assert llm.get_stats().prefix_cache_hits == hits  # nothing stale was served
    assert after != before
    assert after == _tokens(LLM(str(b), dtype="float32", max_model_len=64))
    hf_b = load_hf_model(b)
    assert after == [hf_greedy(hf_b, p, GREEDY.max_tokens).tokens for p in PROMPTS]
    # A partial update (one layer's MLP) changes only what it touches: back to a's weights
    # everywhere but there gives neither a's nor b's tokens.
    a_weights = load_file(str(a / "model.safetensors"))
    part = [(k, v) for k, v in a_weights.items() if not k.startswith("model.layers.0.mlp.")]
    assert llm.collective_rpc("update_weights", args=(part,)) == [
        len(dict(llm.llm_engine.model_runner.model.named_parameters())) - 2  # gate_up, down
    ]
    llm.reset_prefix_cache()
    mixed = _tokens(llm)
    assert mixed != after and mixed != before


def test_collective_rpc_functions_failures_and_bad_updates(models):
    a, _, b_weights = models
    llm = LLM(str(a), dtype="float32", max_model_len=64)
    assert llm.collective_rpc(getattr, args=("device",)) == [llm.llm_engine.device]
    # vLLM's apply_model: a function of the model itself (a lambda with one rank)
    total = sum(p.numel() for p in llm.llm_engine.model_runner.model.parameters())
    assert llm.apply_model(lambda model: sum(p.numel() for p in model.parameters())) == [total]
    with pytest.raises(RpcError, match="failed on rank 0: ValueError: boom"):
        llm.collective_rpc(_fail, args=("boom",))
    with pytest.raises(RpcError, match="checkpoint does not match"):
        llm.collective_rpc("update_weights", args=([("model.nonexistent.weight", b_weights[
            "model.norm.weight"])],))  # fmt: skip
    # The prefix cache stays while a request is unfinished.
    llm.llm_engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    assert not llm.reset_prefix_cache()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert llm.reset_prefix_cache()
    assert len(_tokens(llm)) == len(PROMPTS)  # still serving
    int8 = LLM(str(a), dtype="float32", max_model_len=64, quantization="int8")
    with pytest.raises(RpcError, match="quantization='int8'"):
        int8.collective_rpc("update_weights", args=(list(b_weights.items()),))


def _num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_update_weights_under_tensor_parallelism(models):
    a, b, b_weights = models
    llm = LLM(str(a), dtype="float32", max_model_len=64, tensor_parallel_size=2)
    try:
        assert llm.collective_rpc(getattr, args=("device",)) == [llm.llm_engine.device] * 2
        with pytest.raises(ValueError, match="must pickle"):
            llm.collective_rpc(lambda worker: worker.device)
        shards = llm.apply_model(_num_parameters)  # each rank's shard of the model
        assert len(shards) == 2 and shards[0] == shards[1] > 0
        assert len(llm.collective_rpc("update_weights", args=(list(b_weights.items()),))) == 2
        assert llm.reset_prefix_cache()
        got = _tokens(llm)
    finally:
        llm.llm_engine.shutdown()
    assert got == _tokens(LLM(str(b), dtype="float32", max_model_len=64))


@pytest.mark.parametrize("tp", [1, 2])
def test_worker_extension_methods_run_on_every_rank(models, tp):
    """worker_extension_cls (vLLM's): the class's methods join each rank's worker, so
    collective_rpc runs them by name; one that updates weights changes the outputs alike on
    every rank. A class redefining a worker method, or one that cannot load, is refused."""
    a, _, _ = models
    llm = LLM(
        str(a),
        dtype="float32",
        max_model_len=64,
        tensor_parallel_size=tp,
        worker_extension_cls="worker_extensions.WeightTools",
    )
    try:
        sums = llm.collective_rpc("param_sum")
        assert len(sums) == tp and all(s != 0 for s in sums)
        before = _tokens(llm)
        counts = llm.collective_rpc("scale_norms", args=(0.0,))
        assert len(set(counts)) == 1 and counts[0] > 0
        assert llm.reset_prefix_cache()
        assert _tokens(llm) != before  # every norm zeroed: another model
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match=r"redefines the worker's \['execute_model'\]"):
        LLM(str(a), max_model_len=64, worker_extension_cls="worker_extensions.Clashing")
    with pytest.raises(ValueError, match=r"worker_extension_cls='nowhere\.X' cannot be loaded"):
        LLM(str(a), max_model_len=64, worker_extension_cls="nowhere.X")
