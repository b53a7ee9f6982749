"""Mixture-of-experts models (Qwen3-MoE, Mixtral) and their MoE layer (layers/fused_moe.py).

The layer against a per-token loop (the grouped torch path, tensor-parallel shards); routing
against HF's routers; checkpoints in both layouts (per-expert, transformers 5's fused);
`LLM.generate` against HF `generate` (greedy tokens identical, logprobs within 1e-3), at
tensor_parallel_size=2 too; and the engine on the CUDA path's Triton kernels (run in the
interpreter here) against the torch path.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from hf_reference import (
    assert_matches,
    assert_same_greedy,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

import paged_kernels
from paged_engine import LLM, SamplingParams
from paged_engine.layers import fused_moe as moe_layer
from paged_engine.layers.fused_moe import FusedMoE, grouped_experts, route
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

HID, INTER = 16, 12  # hidden size, expert intermediate size of the layer tests


def _per_token_reference(x, gate_up, down, weights, ids):
    """The MoE output token by token, choice by choice: the semantics, no grouping."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (4, 1), (6, 6)])
def test_grouped_experts_match_per_token_loop(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + top_k)
    x = torch.randn(tokens, HID, generator=gen)
    gate_up = torch.randn(experts, 2 * INTER, HID, generator=gen) * HID**-0.5
    down = torch.randn(experts, HID, INTER, generator=gen) * INTER**-0.5
    logits = torch.randn(tokens, experts, generator=gen) * 2
    weights, ids = route(logits, top_k, renormalize=bool(tokens % 2))
    want = _per_token_reference(x, gate_up, down, weights, ids)
    got = grouped_experts(x, gate_up, down, weights, ids)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_route_matches_hf_routers():
    """Qwen3-MoE: softmax over all experts, top-k, renormalized iff norm_topk_prob; Mixtral:
    always renormalized (= softmax over the chosen logits)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    routers = [
        (Qwen3MoeTopKRouter(tiny_config("qwen3_moe", norm_topk_prob=True)), True),
        (Qwen3MoeTopKRouter(tiny_config("qwen3_moe", norm_topk_prob=False)), False),
        (MixtralTopKRouter(tiny_config("mixtral")), True),
    ]
    for hf, renormalize in routers:
        torch.nn.init.normal_(hf.weight, std=0.5)
        _, hf_weights, hf_ids = hf(x)
        weights, ids = route(F.linear(x, hf.weight), hf.top_k, renormalize)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=0)
        sums = weights.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) == renormalize


def test_tensor_parallel_shards_sum_to_the_whole_layer():
    """Each rank loads its slice of the intermediate dim (from fused and per-expert tensors
    alike); the ranks' partial outputs add up to the unsharded layer's output."""
    gen = torch.Generator().manual_seed(1)
    e, k = 4, 2
    gate_up = torch.randn(e, 2 * INTER, HID, generator=gen)
    down = torch.randn(e, HID, INTER, generator=gen)
    x = torch.randn(9, HID, generator=gen)
    weights, ids = route(torch.randn(9, e, generator=gen), k, renormalize=True)
    whole = grouped_experts(x, gate_up, down, weights, ids)
    fused_parts, expert_parts = [], []
    for rank in range(2):
        fused = FusedMoE(e, HID, INTER, tp_rank=rank, tp_size=2)
        fused.gate_up_proj.weight_loader(fused.gate_up_proj, gate_up)
        fused.down_proj.weight_loader(fused.down_proj, down)
        fused_parts.append(fused(x, weights, ids))
        per_expert = FusedMoE(e, HID, INTER, tp_rank=rank, tp_size=2)
        for m in range(e):
            gate, up = gate_up[m].chunk(2)
            per_expert.gate_up_proj.weight_loader(per_expert.gate_up_proj, gate, (m, 0))
            per_expert.gate_up_proj.weight_loader(per_expert.gate_up_proj, up, (m, 1))
            per_expert.down_proj.weight_loader(per_expert.down_proj, down[m], m)
        assert torch.equal(per_expert.gate_up_proj, fused.gate_up_proj)
        assert torch.equal(per_expert.down_proj, fused.down_proj)
        expert_parts.append(per_expert(x, weights, ids))
    torch.testing.assert_close(fused_parts[0] + fused_parts[1], whole, atol=1e-4, rtol=1e-5)
    assert torch.equal(expert_parts[0], fused_parts[0])
    with pytest.raises(ValueError, match="expert 1 up: expected shape"):
        fused.gate_up_proj.weight_loader(fused.gate_up_proj, gate_up[1], (1, 1))
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=5"):
        FusedMoE(e, HID, INTER, tp_rank=0, tp_size=5)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        Qwen3MoeForCausalLM(tiny_config("qwen3_moe", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        Qwen3MoeForCausalLM(tiny_config("qwen3_moe", decoder_sparse_step=0))


def test_sparse_layers_follow_hf():
    """decoder_sparse_step and mlp_only_layers pick the same MoE layers as HF's model."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from paged_engine.layers.fused_moe import SparseMoeBlock

    for overrides in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 3]}):
        config = tiny_config("qwen3_moe", num_hidden_layers=4, **overrides)
        hf = transformers.AutoModelForCausalLM.from_config(config)
        ours = Qwen3MoeForCausalLM(config)
        want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
        got = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
        assert got == want and any(want) and not all(want)


# Qwen3-MoE with a dense layer between two sparse ones; Mixtral with no sliding window.
MODELS = {"qwen3_moe": {"num_hidden_layers": 3, "mlp_only_layers": [1]}, "mixtral": {}}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory):
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=1, **MODELS[arch])
    return arch, path


def _fused_copy(path, dst):
    """The checkpoint as transformers 5 models hold it: experts fused, the block named `mlp`."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {name: t.detach().clone().contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    shutil.copytree(path, dst)
    from safetensors.torch import save_file

    save_file(state, str(dst / "model.safetensors"))
    return dst


def _load(path):
    resolved = resolve_model(str(path))
    return load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")


def test_fused_and_per_expert_checkpoints_load_the_same(tiny, tmp_path):
    _, path = tiny
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:  # what save_pretrained wrote
        names = list(f.keys())
    assert any(".experts.3." in name for name in names)
    per_expert = dict(_load(path).named_parameters())
    fused = dict(_load(_fused_copy(path, tmp_path / "fused")).named_parameters())
    assert per_expert.keys() == fused.keys()
    for name, p in per_expert.items():
        assert torch.equal(p, fused[name]), name


def test_quantization_leaves_experts_and_router_dense(tiny):
    """Weight-only quantization converts the linear layers (attention here); the experts and
    the router are plain parameters and keep the model dtype."""
    from paged_engine.layers.fused_moe import SparseMoeBlock

    _, path = tiny
    resolved = resolve_model(str(path))
    config = load_hf_config(resolved)
    model = load_model(resolved, config, dtype=torch.float32, device="cpu", quantization="int8")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and model.model.layers[0].self_attn.qkv_proj.linear_method is not None
    for block in blocks:
        assert block.experts.gate_up_proj.dtype == block.gate.weight.dtype == torch.float32
        x = torch.randn(5, config.hidden_size)
        assert torch.isfinite(block(x)).all()


def test_batch_invariant_mode_is_refused(tiny):
    _, path = tiny
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(model=str(path), dtype="float32", batch_invariant=True)


def test_greedy_tokens_and_logprobs_match_hf(tiny):
    arch, path = tiny
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, block_size=16)
    hf = load_hf_model(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(5)]
    max_tokens = 12
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches(arch, out, hf_greedy(hf, prompt, max_tokens))
    assert llm.get_stats().num_used_blocks == 0


def test_tensor_parallel_matches_one_process(tmp_path):
    """tensor_parallel_size=2 (gloo on the CPU): each rank holds half of every expert."""
    path = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    assert_tp_matches_one_process(path, prompts, max_tokens=10, max_model_len=256)


@pytest.mark.skipif(not paged_kernels.triton_available(), reason="needs triton")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton's interpreter runs only without a GPU (set there)"
)
def test_triton_experts_give_the_torch_paths_tokens(monkeypatch, tmp_path):
    """The CUDA path's kernels (paged_kernels.fused_moe) forced onto CPU tensors, in Triton's
    interpreter: the engine's greedy tokens match the grouped torch path's, logprobs within
    1e-4, and every MoE layer call of that run went through the kernels."""
    calls = {"triton": 0, "torch": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(paged_kernels, "fused_moe", counted("triton", paged_kernels.fused_moe))
    monkeypatch.setattr(moe_layer, "grouped_experts", counted("torch", grouped_experts))
    path = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=2, **MODELS["qwen3_moe"])
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu")
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in (1, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = []
    for path_name in ("torch", "triton"):
        monkeypatch.setattr(moe_layer, "TRITON_ON_CPU", path_name == "triton")
        before = dict(calls)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        ran = {name: calls[name] - before[name] for name in calls}
        assert ran[path_name] > 0 and sum(ran.values()) == ran[path_name], ran
    assert_same_greedy(*runs)
