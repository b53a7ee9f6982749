"""Ling (models/bailing_moe.py, remote code) against HF transformers: each test writes a tiny HF
model of a mathematically equal architecture, converts its weights into the release's layout
and its config into the release's config.json (architectures, auto_map, model_type), and checks
that `LLM.generate` gives HF's greedy tokens and top-5 logprobs (1e-3, float32).

    Ling 2.0 (BailingMoeV2ForCausalLM) = HF Glm4Moe: sigmoid routing with the expert bias,
        groups, routed_scaling_factor, renormalized; shared experts, a dense first layer,
        q / k RMSNorms, partial rotary, q / k / v biases; an MTP layer in the checkpoint
    Ling v1 (BailingMoeForCausalLM) = HF Qwen2-MoE with shared_expert_gate = 0 and the shared
        expert's down_proj doubled (sigmoid(0) * 2 = 1: an ungated shared expert), the routed
        experts' down_proj times routed_scaling_factor, lm_head normalized per column
        (norm_head); softmax routing, renormalized; a dense first layer (mlp_only_layers)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, hf_greedy, load_hf_model, random_token_prompts

from paged_engine import LLM, SamplingParams
from paged_engine.models.bailing_moe import bailing_moe_config, bailing_moe_v2_config
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

_ATTENTION = (
    (".self_attn.o_proj.", ".attention.dense."),
    (".self_attn.q_norm.", ".attention.query_layernorm."),
    (".self_attn.k_norm.", ".attention.key_layernorm."),
    (".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"),
    (".mlp.shared_expert.", ".mlp.shared_experts."),
)


def _ling_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF model's tensors in Ling's layout: `word_embeddings`, q | k | v rows fused in
    `attention.query_key_value`, `attention.dense`, per-expert matrices, `gate.expert_bias`."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue  # fused with q below
        if name.endswith("shared_expert_gate.weight"):
            continue  # zero in the reference: Ling's shared experts are ungated
        name = name.replace("model.embed_tokens.", "model.word_embeddings.")
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace(".q_proj.", f".{s}_proj.")] for s in "qkv"]
            out[name.replace(".self_attn.q_proj.", ".attention.query_key_value.")] = torch.cat(
                parts
            )
            continue
        for theirs, ours in _ATTENTION:
            name = name.replace(theirs, ours)
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            for e in range(w.shape[0]):
                gate, up = w[e].chunk(2)
                stem = name.removesuffix("gate_up_proj")
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = gate, up
            continue
        if name.endswith(".experts.down_proj"):  # [E, H, I]
            for e in range(w.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = w[e]
            continue
        out[name] = w
    return {k: v.detach().clone() for k, v in out.items()}  # not views of the model


def _write_release(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """The release's checkpoint: its tensors and its remote-code config.json."""
    from safetensors.torch import save_file

    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def _matches(path: Path, hf, case: str) -> None:
    prompts = random_token_prompts(case, 3)
    refs = [hf_greedy(hf, p, 8, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(case, out, ref)


def test_ling_v2_matches_glm4_moe(tmp_path):
    """Ling 2.0's checkpoint and config.json, converted from HF Glm4Moe (the same model)."""
    path = write_tiny_model(tmp_path, "glm4_moe", seed=3)
    hf = load_hf_model(path)
    c = hf.config
    tensors = _ling_tensors(hf.state_dict())
    layers = c.num_hidden_layers  # the MTP layer after the decoder: skipped at load
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.randn(c.hidden_size, 2 * c.hidden_size)
    qkv = tensors["model.layers.1.attention.query_key_value.weight"]
    tensors[f"model.layers.{layers}.attention.query_key_value.weight"] = torch.randn(qkv.shape)
    _write_release(
        path,
        tensors,
        {
            "architectures": ["BailingMoeV2ForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_bailing_moe_v2.BailingMoeV2Config",
                "AutoModelForCausalLM": "modeling_bailing_moe_v2.BailingMoeV2ForCausalLM",
            },
            "model_type": "bailing_moe_v2",
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "use_qkv_bias": True,
            "use_bias": False,
            "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": False,
            "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_parameters["rope_theta"],
            "partial_rotary_factor": c.rope_parameters["partial_rotary_factor"],
            "rope_scaling": None,
            "use_qk_norm": True,
            "use_rmsnorm": True,
            "num_experts": c.n_routed_experts,
            "num_shared_experts": c.n_shared_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "n_group": c.n_group,
            "topk_group": c.topk_group,
            "moe_intermediate_size": c.moe_intermediate_size,
            "first_k_dense_replace": c.first_k_dense_replace,
            "norm_topk_prob": True,
            "routed_scaling_factor": c.routed_scaling_factor,
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "router_dtype": "fp32",
            "num_nextn_predict_layers": 1,
            "embedding_dropout": 0.0,
            "torch_dtype": "float32",
        },
    )
    assert c.attention_bias and c.use_qk_norm and c.first_k_dense_replace == 1 and c.n_group > 1
    _matches(path, hf, "ling_v2")


def test_ling_v1_matches_qwen2_moe(tmp_path):
    """Ling v1's checkpoint and config.json, converted from HF Qwen2-MoE made equal to it."""
    shared, moe_inter, scale = 2, 16, 1.5
    path = write_tiny_model(
        tmp_path,
        "qwen2_moe",
        seed=5,
        num_hidden_layers=2,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared * moe_inter,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        qkv_bias=False,
    )
    hf = load_hf_model(path)
    c = hf.config
    tensors = _ling_tensors(hf.state_dict())
    with torch.no_grad():  # the reference made Ling's model; `tensors` keeps the release's
        mlp = hf.model.layers[1].mlp
        mlp.shared_expert_gate.weight.zero_()
        mlp.shared_expert.down_proj.weight.mul_(2.0)
        mlp.experts.down_proj.mul_(scale)
        hf.lm_head.weight.copy_(F.normalize(hf.lm_head.weight, dim=0, eps=1e-7))
    _write_release(
        path,
        tensors,
        {
            "architectures": ["BailingMoeForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_bailing_moe.BailingMoeConfig",
                "AutoModelForCausalLM": "modeling_bailing_moe.BailingMoeForCausalLM",
            },
            "model_type": "bailing_moe",
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "hidden_act": "silu",
            "use_qkv_bias": False,
            "use_bias": False,
            "norm_head": True,
            "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": False,
            "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_parameters["rope_theta"],
            "rope_scaling": None,
            "num_experts": c.num_experts,
            "num_shared_experts": shared,
            "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": moe_inter,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": scale,
            "embedding_dropout": 0.1,
            "torch_dtype": "bfloat16",
        },
    )
    _matches(path, hf, "ling_v1")


_V2 = {
    "architectures": ["BailingMoeV2ForCausalLM"],
    "model_type": "bailing_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "use_rmsnorm": True,
    "num_experts": 8,
    "num_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
}


def _rotary(config) -> float:
    return config.rope_parameters["partial_rotary_factor"]


def test_ling_config_translation():
    """Ling-1T's rotary_dim and Ling-mini's partial_rotary_factor give the same rope; the
    shared experts' width and the release class defaults (v1's use_bias=True) apply."""
    mini = bailing_moe_v2_config(_V2)
    one_t = {k: v for k, v in _V2.items() if k != "partial_rotary_factor"}
    assert _rotary(bailing_moe_v2_config({**one_t, "rotary_dim": 16})) == 0.5
    assert _rotary(mini) == 0.5 and mini.shared_intermediate_size == 16
    assert mini.rms_norm_eps == 1e-6 and mini.norm_topk_prob and mini.routed_scaling_factor == 1
    shared = {**_V2, "num_shared_experts": 2, "moe_shared_expert_intermediate_size": 24}
    assert bailing_moe_v2_config(shared).shared_intermediate_size == 48
    v1 = {**_V2, "score_function": None, "moe_router_enable_expert_bias": None, "n_group": None}
    assert bailing_moe_config({**v1, "use_bias": False}).score_function == "softmax"
    with pytest.raises(ValueError, match="'use_bias'"):
        bailing_moe_config(v1)  # BailingMoeConfig's default


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_bias": True}, "'use_bias'"),
        ({"hidden_act": "gelu"}, "'hidden_act'"),
        ({"moe_router_enable_expert_bias": False}, "'moe_router_enable_expert_bias'"),
        ({"score_function": "softmax"}, "'moe_router_enable_expert_bias'"),
        (
            {"score_function": "softmax", "moe_router_enable_expert_bias": False},
            "'n_group'",
        ),
        ({"score_function": "tanh"}, "'score_function'"),
        ({"use_rmsnorm": False}, "'use_rmsnorm'"),
        ({"rotary_dim": 16}, "'rotary_dim'"),
        ({"norm_head": True, "tie_word_embeddings": True}, "'norm_head'"),
        ({"num_shared_experts": -1}, "'num_shared_experts'"),
        ({"num_experts": None}, "'num_experts'"),
    ],
)
def test_ling_refuses_by_name(change, named):
    """Settings with no exact reference (or where vLLM and the release code disagree), and
    malformed fields, are a ValueError naming the config.json field."""
    with pytest.raises(ValueError, match=named):
        bailing_moe_v2_config({**_V2, **change})
