"""openPangu Ultra MoE / Pro MoE V2 (PanguUltraMoEForCausalLM, PanguProMoEV2ForCausalLM: remote
code; models/openpangu_moe.py) against HF DeepSeek-V3, the same model: MLA, sigmoid top-k routing
(one expert group) with a shared expert, a dense first layer. The tiny HF model's tensors are
saved under the release's names (per-expert `mlp.experts.M.*`; the correction bias, where the
config enables it, as `mlp.e_score_correction_bias`) with a config.json in the release's field
names (attention_kv_lora_dim, num_routed_experts, num_dense_layers, ...) and served through
paged: greedy tokens identical, top-5 logprobs within 1e-3 (float32).

Sandwich norms have no HF class: the reference's decoder layers get two more RMSNorms and a
plain-torch forward (x += post_attention_layernorm(attn(input_layernorm(x))); x +=
post_mlp_layernorm(mlp(pre_mlp_layernorm(x)))), as the release's modeling file runs them.

Also: the switches without a reference refused by name."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import hf_greedy, load_hf_model, random_token_prompts

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm  # noqa: E402

# DeepSeek-V3's field -> the release's (its OpenPanguMoEConfig)
RELEASE_NAMES = {
    "q_lora_rank": "attention_q_lora_dim",
    "kv_lora_rank": "attention_kv_lora_dim",
    "qk_nope_head_dim": "attention_qk_dim",
    "qk_rope_head_dim": "attention_qk_rope_dim",
    "v_head_dim": "attention_v_dim",
    "n_routed_experts": "num_routed_experts",
    "n_shared_experts": "num_shared_experts",
    "first_k_dense_replace": "num_dense_layers",
}
_KEEP = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "norm_topk_prob",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    *RELEASE_NAMES,
)


def _sandwich_forward(self, hidden_states, **kwargs):
    """openPangu's sandwich layer over an HF DeepseekV3DecoderLayer's modules."""
    attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    hidden_states = hidden_states + self.post_attention_layernorm(attn)
    mlp = self.mlp(self.pre_mlp_layernorm(hidden_states))
    return hidden_states + self.post_mlp_layernorm(mlp)


def _release_tensors(state: dict[str, torch.Tensor], bias: bool) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3's tensors under the release's names: fused experts split per expert."""
    out = {}
    for name, w in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = w.chunk(2, dim=1)  # [E, 2I, H]: gate rows, then up rows
            for e in range(w.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e]
                out[f"{base}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(w.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = w[e]
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            if bias:  # the release keeps it beside the router
                out[name.replace("mlp.gate.", "mlp.")] = w
        else:
            out[name] = w
    return {k: v.contiguous() for k, v in out.items()}


def _write_openpangu(
    tmp_path: Path, seed: int, arch: str, *, sandwich: bool, bias: bool, release_names: bool
):
    """A tiny HF DeepSeek-V3 (one expert group), maybe with sandwich norms and a correction
    bias, saved as an openPangu MoE release; returns (path, the reference model)."""
    path = write_tiny_model(
        tmp_path,
        "deepseek_v3",
        seed=seed,
        num_hidden_layers=2,
        n_group=1,
        topk_group=1,
        rope_scaling=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(seed)
    d = hf.config.hidden_size
    for layer in hf.model.layers:
        if not bias and hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.zero_()
        if sandwich:
            for norm in ("pre_mlp_layernorm", "post_mlp_layernorm"):
                module = DeepseekV3RMSNorm(d, eps=hf.config.rms_norm_eps)
                with torch.no_grad():
                    module.weight.copy_(1.0 + 0.3 * torch.randn(d, generator=gen))
                setattr(layer, norm, module)
            layer.forward = types.MethodType(_sandwich_forward, layer)
    hf.eval()
    save_file(
        _release_tensors(hf.state_dict(), bias),
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    src = json.loads((path / "config.json").read_text())
    config = {k: src[k] for k in _KEEP}
    if release_names:
        config = {RELEASE_NAMES.get(k, k): v for k, v in config.items()}
    config |= {
        "architectures": [arch],
        "model_type": "pangu_ultra_moe",
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "sandwich_norm": sandwich,
        "num_mtp_layers": 0,
    }
    if bias:
        config["router_enable_expert_bias"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path, hf


@pytest.mark.parametrize(
    ("arch", "sandwich", "bias", "release_names"),
    [
        ("PanguUltraMoEForCausalLM", True, False, True),
        ("PanguProMoEV2ForCausalLM", False, True, False),
    ],
    ids=["ultra-sandwich", "pro-v2-bias"],
)
def test_openpangu_moe_matches_reference(arch, sandwich, bias, release_names, tmp_path):
    path, hf = _write_openpangu(
        tmp_path, 41, arch, sandwich=sandwich, bias=bias, release_names=release_names
    )
    prompts = random_token_prompts(41, 2)
    refs = [hf_greedy(hf, p, 6, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=96, block_size=16)
    assert type(llm.llm_engine.model_runner.model).__name__ == arch
    assert_llm_matches(arch, llm, prompts, refs)


_SIZES = {
    "architectures": ["PanguUltraMoEForCausalLM"],
    "model_type": "pangu_ultra_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "attention_q_lora_dim": 32,
    "attention_kv_lora_dim": 32,
    "attention_qk_dim": 16,
    "attention_qk_rope_dim": 8,
    "attention_v_dim": 16,
    "num_routed_experts": 8,
    "num_shared_experts": 1,
    "num_dense_layers": 1,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
}


def test_config_reads_either_spelling():
    from paged_engine.models.openpangu_moe import openpangu_moe_config

    ours = openpangu_moe_config({**_SIZES, "num_mtp_layers": 1, "sandwich_norm": True})
    assert (ours.kv_lora_rank, ours.qk_nope_head_dim, ours.v_head_dim) == (32, 16, 16)
    assert (ours.n_routed_experts, ours.first_k_dense_replace) == (8, 1)
    assert ours.num_nextn_predict_layers == 1 and ours.sandwich_norm
    deepseek = {RELEASE_NAMES.get(k, k): v for k, v in _SIZES.items()}
    deepseek = {k: v for k, v in deepseek.items() if k not in RELEASE_NAMES.values()}
    deepseek |= {ours_name: _SIZES[theirs] for ours_name, theirs in RELEASE_NAMES.items()}
    assert openpangu_moe_config(deepseek).to_dict() == openpangu_moe_config(_SIZES).to_dict()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("param_sink_number", 128),
        ("use_mhc", True),
        ("use_mome", True),
        ("index_topk", 64),
        ("interleaved_sliding_window", 4096),
        ("hidden_act", "gelu"),
        ("attention_kv_lora_dim", None),  # no MLA: Pro MoE V2's Llama-style / sink attention
        ("num_experts_per_tok", 9),
    ],
)
def test_openpangu_moe_refuses(name, value, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps({**_SIZES, name: value}))
    with pytest.raises(ValueError, match=name if value is not None else "kv_lora_rank"):
        remote_config(tmp_path)
