"""Multi-LoRA under pipeline parallelism (2 gloo stages on the CPU): each stage packs only the
adapter modules of its own decoder layers, every stage loads and drops an adapter together, and
each step's token -> slot mapping reaches every stage. The outputs are the single process's:
identical greedy tokens, logprobs within 1e-4, with two adapters of different ranks (one on a
few modules only) and the base model in one batch, and adapters added while steps are in flight.

An adapter only a later stage (or another TP shard) cannot pack fails its call on rank 0 with a
ValueError naming lora_request, and no rank keeps it; the engine serves on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.testing import write_lora_adapter, write_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ENGINE = {
    "dtype": "float32",
    "max_model_len": 128,
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": 8,
    "max_num_batched_tokens": 32,  # prompts spread over steps: two micro-batches in flight
    "max_num_seqs": 8,
}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _summary(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def _bad_copy(src: Path, dst: Path, key: str, transform) -> Path:
    """`src` adapter with tensor `key` replaced by transform(tensor)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    tensors[key] = transform(tensors[key])
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def _run(path: Path, prompts, loras, late: LoRARequest, **kwargs):
    """Greedy outputs of `prompts` run with `loras`, then of prompts[0] run with `late` (an
    adapter first named while another request's steps are in flight) beside prompts[1]."""
    llm = LLM(str(path), **ENGINE, **kwargs)
    engine = llm.llm_engine
    try:
        outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        engine.add_request("early", prompts[1], GREEDY, lora_request=loras[1])
        engine.step()  # in flight on the stages while `late` loads
        engine.add_request("late", prompts[0], GREEDY, lora_request=late)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [_summary(o) for o in outs], _summary(done["late"]), _summary(done["early"])
    finally:
        engine.shutdown()


def _same(got, want) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def test_adapters_under_pipeline_parallelism_match_one_process(tmp_path):
    model = write_tiny_model(tmp_path / "m", "llama", seed=3)
    a = write_lora_adapter(tmp_path / "a", model, rank=4, seed=1)
    b = write_lora_adapter(
        tmp_path / "b", model, rank=8, seed=2, target_modules=("q_proj", "v_proj", "down_proj")
    )
    c = write_lora_adapter(tmp_path / "c", model, rank=2, seed=5, target_modules=("o_proj",))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    la, lb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    loras = [la, lb, None, lb, la]
    late = LoRARequest("c", 3, str(c))
    want, want_late, want_early = _run(model, prompts, loras, late)
    assert want_late[0] != want[0][0]  # adapters c and a differ on one prompt
    _same(want_early, want[1])  # b alone is b in a batch

    # Stage 0 (layer 0) packs this one; stage 1 (layer 1) cannot: A is one input too wide.
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    bad = _bad_copy(a, tmp_path / "bad", key, lambda t: torch.cat([t, t[:, :1]], dim=1))
    llm = LLM(str(model), **ENGINE, pipeline_parallel_size=2)
    engine = llm.llm_engine
    try:
        with pytest.raises(ValueError, match=r"lora_request: .*layers\.1\.mlp\.down_proj"):
            llm.generate(prompts[:1], GREEDY, lora_request=LoRARequest("bad", 9, str(bad)))
        assert engine.list_loras() == set()
        # Every stage dropped it: the id loads again, from a good directory.
        outs = llm.generate(prompts, GREEDY, lora_request=[*loras[:4], LoRARequest("a", 9, str(a))])
        got = [_summary(o) for o in outs]
    finally:
        engine.shutdown()
    for g, w in zip(got, want, strict=True):
        _same(g, w)

    got, got_late, got_early = _run(model, prompts, loras, late, pipeline_parallel_size=2)
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    _same(got_late, want_late)
    _same(got_early, want_early)


def test_adapter_only_another_tensor_parallel_rank_cannot_pack_is_refused(tmp_path):
    # B's last row of q belongs to rank 1's shard; scaled into float32 it overflows there
    # only, so rank 0 packs its part and rank 1 must report, not leave the world.
    model = write_tiny_model(tmp_path / "m", "llama", seed=3)
    a = write_lora_adapter(tmp_path / "a", model, rank=4, seed=1)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def overflow(t: torch.Tensor) -> torch.Tensor:
        t = t.to(torch.float64)
        t[-1, 0] = 1e39
        return t

    bad = _bad_copy(a, tmp_path / "bad", key, overflow)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    llm = LLM(str(model), **ENGINE, tensor_parallel_size=2)
    engine = llm.llm_engine
    try:
        with pytest.raises(ValueError, match=r"lora_request: .*overflow"):
            llm.generate(prompts, GREEDY, lora_request=LoRARequest("bad", 1, str(bad)))
        assert engine.list_loras() == set()
        outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, str(a)))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    finally:
        engine.shutdown()
