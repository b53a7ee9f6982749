"""GLM-4.5 (`Glm4MoeForCausalLM`) and its DeepSeek-style MoE block (layers/deepseek_moe.py).

The router against HF's GLM-4-MoE, DeepSeek-V3, DeepSeek-V2 and Mistral 4 routers (group-limited
top-k, correction bias, renormalization, scaling; Mistral 4's in bfloat16 too); the whole block
against HF's blocks, also as two tensor-parallel shards; dense / MoE layers as HF places them;
both checkpoint layouts, with multi-token-prediction layers skipped; `LLM.generate` against HF
`generate` (greedy tokens identical, top-5 logprobs within 1e-3, float32), at
tensor_parallel_size=2 too, and with a LoRA adapter on the shared experts against HF with it
merged. The tiny model
(testing.py) exercises groups, a random correction bias, routed_scaling_factor, a dense first
layer, shared experts, partial rotary, q / k norms and q / k / v biases.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import assert_lora_matches_hf_merged, assert_matches, hf_greedy, load_hf_model

import paged_kernels
from paged_engine import LLM, SamplingParams
from paged_engine.layers import fused_moe as moe_layer
from paged_engine.layers.deepseek_moe import DeepseekMoe, grouped_topk, is_dense_layer
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.models.glm4_moe import Glm4MoeForCausalLM
from paged_engine.models.llama import LlamaForCausalLM
from paged_engine.models.utils import load_named_weights
from paged_engine.testing import (
    tiny_config,
    write_tiny_model,
)

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
TOP = 5


def _hf_configs() -> dict[str, object]:
    """HF configs whose routers differ: GLM grouped / plain, DeepSeek-V3, both V2 methods,
    Mistral 4 (softmax, top-2-sum groups, renormalized)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    moe = {"hidden_size": 64, "moe_intermediate_size": 16, "intermediate_size": 32}
    return {
        "glm4_moe": tiny_config("glm4_moe"),
        "glm4_moe_plain": tiny_config(
            "glm4_moe", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0
        ),
        "deepseek_v3": DeepseekV3Config(
            **moe,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
        "deepseek_v2_greedy": DeepseekV2Config(
            **moe, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=1.5
        ),
        "deepseek_v2_grouped": DeepseekV2Config(
            **moe,
            n_routed_experts=16,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
        "mistral4": tiny_config(
            "mistral4", **moe, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=1.5
        ),
    }


def _hf_block(name: str, config):
    """HF's MoE block of `config` with random weights (and correction bias)."""
    if name.startswith("glm4_moe"):
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as block_cls
    elif name == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as block_cls
    elif name == "mistral4":
        from transformers.models.mistral4.modeling_mistral4 import Mistral4MoE as block_cls
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as block_cls
    block = block_cls(config).eval()
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for _, t in sorted([*block.named_parameters(), *block.named_buffers()]):
            std = t.shape[-1] ** -0.5 if t.dim() > 1 else 0.2  # the bias: 0.2
            t.copy_(torch.randn(t.shape, generator=gen) * std)
    return block


def _load_block(ours: DeepseekMoe, hf_block) -> None:
    """HF's in-memory block (fused experts) into ours, by name through the Llama rules."""
    load_named_weights(ours, hf_block.state_dict().items(), stacked=LlamaForCausalLM.stacked_params)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("name", list(_hf_configs()))
def test_router_matches_hf_routers(name):
    config = _hf_configs()[name]
    hf = _hf_block(name, config)
    ours = DeepseekMoe.from_config(config)
    _load_block(ours, hf)
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, hf_weights, hf_ids = hf.gate(x)
    weights, ids = ours.gate(x)
    want_w, want_ids = _sorted(hf_weights, hf_ids)
    got_w, got_ids = _sorted(weights, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
    assert weights.dtype == torch.float32
    # The features bite: groups exclude experts, the bias moves choices, weights sum to
    # routed_scaling_factor when renormalized.
    gate = ours.gate
    logits = x @ gate.weight.T
    if gate.n_group > gate.topk_group:
        ungrouped = grouped_topk(
            logits, gate.top_k, correction_bias=gate.e_score_correction_bias, sigmoid=gate.sigmoid
        )[1]
        assert not torch.equal(ungrouped.sort(-1).values, got_ids)
    if gate.e_score_correction_bias is not None:
        unbiased = grouped_topk(
            logits, gate.top_k, n_group=gate.n_group, topk_group=gate.topk_group
        )[1]
        assert not torch.equal(unbiased.sort(-1).values, got_ids)
    if gate.renormalize:
        sums = weights.sum(-1)
        torch.testing.assert_close(sums, torch.full_like(sums, gate.scale))


def test_mistral4_router_in_bfloat16_matches_hf():
    """HF's Mistral 4 router scores in the model dtype (no float32 weight or softmax): so does
    ours, choosing HF's experts and weights in bfloat16."""
    config = _hf_configs()["mistral4"]
    hf = _hf_block("mistral4", config).to(torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the loader builds models under the model dtype
    try:
        ours = DeepseekMoe.from_config(config)
    finally:
        torch.set_default_dtype(default)
    _load_block(ours, hf)
    assert ours.gate.weight.dtype == torch.bfloat16
    x = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16)
    _, hf_weights, hf_ids = hf.gate(x)
    want_w, want_ids = _sorted(hf_weights, hf_ids)
    got_w, got_ids = _sorted(*ours.gate(x))
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w.float())


@pytest.mark.parametrize("name", list(_hf_configs()))
def test_block_and_its_tensor_parallel_shards_match_hf(name):
    """One process, and two ranks' partial sums (what the all-reduce adds) against HF."""
    config = _hf_configs()[name]
    hf = _hf_block(name, config)
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)
    ours = DeepseekMoe.from_config(config)
    _load_block(ours, hf)
    torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)
    parts = []
    for rank in range(2):
        shard = DeepseekMoe.from_config(config, tp_rank=rank, tp_size=2)
        _load_block(shard, hf)
        parts.append(shard.partial_sum(x))
    torch.testing.assert_close(parts[0] + parts[1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not paged_kernels.triton_available(), reason="needs triton")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton's interpreter runs only without a GPU (set there)"
)
def test_block_on_the_triton_kernels_matches_hf(monkeypatch):
    """The CUDA path's MoE kernels (run in Triton's interpreter) with scaled, grouped weights."""
    config = _hf_configs()["glm4_moe"]
    hf = _hf_block("glm4_moe", config)
    ours = DeepseekMoe.from_config(config)
    _load_block(ours, hf)
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(moe_layer, "TRITON_ON_CPU", True)
    calls = []
    kernel = paged_kernels.fused_moe

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_kernels, "fused_moe", counted)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-4, rtol=1e-4)
    assert calls


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="topk_group=5"):
        Glm4MoeForCausalLM(tiny_config("glm4_moe", topk_group=5))
    with pytest.raises(ValueError, match="n_group=3"):
        Glm4MoeForCausalLM(tiny_config("glm4_moe", n_group=3))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):  # 2 groups of 2 reachable
        Glm4MoeForCausalLM(tiny_config("glm4_moe", num_experts_per_tok=5))
    with pytest.raises(ValueError, match="hidden_act='silu'"):
        Glm4MoeForCausalLM(tiny_config("glm4_moe", hidden_act="gelu"))


@pytest.mark.parametrize("dense", [0, 1, 2])
def test_dense_layers_follow_hf(dense):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    config = tiny_config("glm4_moe", first_k_dense_replace=dense)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    ours = Glm4MoeForCausalLM(config)
    want = [not isinstance(layer.mlp, Glm4MoeMoE) for layer in hf.model.layers]
    got = [not isinstance(layer.mlp, DeepseekMoe) for layer in ours.model.layers]
    assert got == want == [is_dense_layer(config, i) for i in range(3)]
    assert want.count(True) == dense


def _mtp_tensors(config) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer as GLM-4.5 checkpoints append it (layer num_hidden_layers)."""
    h, layer = config.hidden_size, f"model.layers.{config.num_hidden_layers}"
    return {
        f"{layer}.eh_proj.weight": torch.randn(h, 2 * h),
        f"{layer}.enorm.weight": torch.ones(h),
        f"{layer}.hnorm.weight": torch.ones(h),
        f"{layer}.shared_head.norm.weight": torch.ones(h),
        f"{layer}.self_attn.q_proj.weight": torch.randn(4 * 32, h),
        f"{layer}.mlp.gate.e_score_correction_bias": torch.randn(config.n_routed_experts),
        f"{layer}.mlp.experts.0.gate_proj.weight": torch.randn(config.moe_intermediate_size, h),
        f"{layer}.mlp.shared_experts.down_proj.weight": torch.randn(h, 32),
    }


def write_glm4_moe(path: Path, seed: int) -> Path:
    """The tiny GLM-4.5 (write_tiny_model randomizes its correction biases, HF buffers) with
    an MTP layer in its checkpoint."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(path, "glm4_moe", seed=seed)
    file = path / "model.safetensors"
    state = load_file(str(file))
    biases = sorted(n for n in state if n.endswith("e_score_correction_bias"))
    assert len(biases) == 2 and all(state[n].any() for n in biases)
    config = transformers.AutoConfig.from_pretrained(path)
    state.update(_mtp_tensors(config))
    save_file(state, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_glm4_moe(tmp_path_factory.mktemp("glm4_moe"), seed=1)


def _load(path: Path):
    resolved = resolve_model(str(path))
    return load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")


def test_checkpoint_layouts_load_the_same_and_skip_mtp_layers(tiny, tmp_path):
    """Per-expert names (save_pretrained's) and transformers 5's fused experts give the same
    parameters; the MTP layer's tensors are skipped, the correction biases loaded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(".experts.7.down_proj." in n for n in names)
    assert any(n.startswith("model.layers.3.") for n in names)
    per_expert = dict(_load(tiny).named_parameters())
    assert not any(".layers.3." in n for n in per_expert)
    bias = per_expert["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    hf = load_hf_model(tiny)
    state = {n: t.detach().clone().contiguous() for n, t in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    fused = tmp_path / "fused"
    shutil.copytree(tiny, fused)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    fused_params = dict(_load(fused).named_parameters())
    assert per_expert.keys() == fused_params.keys()
    for name, p in per_expert.items():
        assert torch.equal(p, fused_params[name]), name


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_tokens_and_logprobs_match_hf(tiny):
    hf = load_hf_model(tiny)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(tiny), dtype="float32", max_model_len=128, block_size=16)
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches("glm4_moe", out, ref)
    assert llm.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_on_shared_experts_matches_hf_merged(tiny, tmp_path, tp):
    """An adapter on down_proj (the dense MLP's and the shared experts', whose partial sum
    leaves the reduce to the block): its delta counts once, at any tensor_parallel_size. At
    TP=2 this is also the model's TP check (heads, routed and shared experts split; one
    all-reduce per MoE block) against HF."""
    prompt = [random.Random(6).randrange(3, 512) for _ in range(20)]
    assert_lora_matches_hf_merged(tiny, tmp_path, prompt, MAX_TOKENS, TOP, tp=tp)


# Architectures built from GLM-4.5's MoE: (tiny arch, transformers config class, seed)
GLM_FAMILY = {
    # the MoE in every layer (its config has no first_k_dense_replace), whole-head rope
    "solar_open": ("SolarOpenConfig", 3),
    # gated attention without q / k norms (q_gate_proj), a dense layer, then MoE layers
    "minicpm5_moe": ("MiniCPM5MoeConfig", 4),
}


@pytest.mark.parametrize("arch", list(GLM_FAMILY))
def test_glm_family_matches_hf(arch, tmp_path):
    """HF's greedy tokens and top-5 logprobs for the architectures on GLM-4.5's MoE."""
    config_cls, seed = GLM_FAMILY[arch]
    if not hasattr(transformers, config_cls):
        pytest.skip(f"this transformers has no {config_cls}")
    path = write_tiny_model(tmp_path, arch, seed=seed)
    hf = load_hf_model(path)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    if arch == "solar_open":
        assert not any(is_dense_layer(llm.llm_engine.hf_config, i) for i in range(2))
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(arch, out, ref)
