"""DeepSeek-MoE v1 (`DeepseekForCausalLM`, models/deepseek_v1.py) and Snowflake Arctic
(`ArcticForCausalLM`, models/arctic.py), remote-code releases, against transformers in float32:
greedy tokens identical, top-5 logprobs within 1e-3.

DeepSeek v1 is HF Qwen2-MoE with no q / k / v biases, whose shared-expert gate is zeroed
(sigmoid(0) = 1/2) and whose shared expert's down_proj is halved when written in DeepSeek's
layout (ungated: the same sum, exactly); its dense layers are Qwen2-MoE's `mlp_only_layers`.

Arctic has no transformers class. Its reference is HF Mixtral with transformers' own modules
swapped in per arctic.py's layout: a dense Qwen2MoeMLP of intermediate_size on the layers that
are not MoE layers, and on MoE layers with the residual a Qwen2MoeMLP of hidden_size after its
own MixtralRMSNorm, the layer's forward rewired as vLLM's ArcticDecoderLayer (the MoE reads
the pre-attention input). Both checkpoints are then written in the releases' tensor names and
config.json fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_serves_like_hf, save_hf_checkpoint
from hf_reference import load_hf_model, random_token_prompts
from safetensors.torch import load_file, save_file

from paged_engine.testing import _randomize, tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")


def _write(path: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


# name: (config.json's layer fields, norm_topk_prob, rope_scaling)
DEEPSEEK = {
    # deepseek-moe-16b's layout: one dense layer first, then MoE, 2 shared experts
    "16b": (
        {"first_k_dense_replace": 1, "moe_layer_freq": 1, "n_shared_experts": 2},
        False,
        None,
    ),
    # every other layer, no shared experts, renormalized, linear rope scaling
    "freq2": (
        {"first_k_dense_replace": 0, "moe_layer_freq": 2, "n_shared_experts": None},
        True,
        {"type": "linear", "factor": 2.0},
    ),
}


@pytest.mark.parametrize("case", sorted(DEEPSEEK))
def test_deepseek_v1(case, tmp_path):
    moe, norm, rope = DEEPSEEK[case]
    layers, moe_size = 3, 32
    dense = [
        i
        for i in range(layers)
        if i < moe["first_k_dense_replace"] or i % moe["moe_layer_freq"] != 0
    ]
    shared = moe["n_shared_experts"] or 0
    overrides = {
        "num_hidden_layers": layers,
        "qkv_bias": False,
        "mlp_only_layers": dense,
        "decoder_sparse_step": 1,
        "norm_topk_prob": norm,
        "moe_intermediate_size": moe_size,
        "shared_expert_intermediate_size": max(shared, 1) * moe_size,
    }
    if rope is not None:
        overrides["rope_parameters"] = {
            "rope_type": rope["type"],
            "factor": rope["factor"],
            "rope_theta": 10000.0,
        }
    path = write_tiny_model(tmp_path, "qwen2_moe", seed=11, **overrides)
    state = load_file(str(path / "model.safetensors"))
    for name in list(state):
        if name.endswith("shared_expert_gate.weight") or (
            not shared and ".shared_expert.down_proj." in name
        ):
            state[name] = torch.zeros_like(state[name])  # gate 1/2; no shared expert: 0
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = load_hf_model(path)
    src = json.loads((path / "config.json").read_text())

    out = {}
    for name, w in state.items():
        if ".shared_expert_gate." in name or (not shared and ".shared_expert." in name):
            continue
        if ".shared_expert.down_proj." in name:
            w = w / 2  # exact: DeepSeek's shared experts are ungated
        out[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = w
    config = {
        "architectures": ["DeepseekForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig"},
        "model_type": "deepseek",
        "attention_bias": False,
        "aux_loss_alpha": 0.001,
        "bos_token_id": src["bos_token_id"],
        "eos_token_id": src["eos_token_id"],
        "hidden_act": "silu",
        "hidden_size": src["hidden_size"],
        "intermediate_size": src["intermediate_size"],
        "max_position_embeddings": src["max_position_embeddings"],
        "moe_intermediate_size": moe_size,
        "n_routed_experts": src["num_experts"],
        "norm_topk_prob": norm,
        "num_attention_heads": src["num_attention_heads"],
        "num_experts_per_tok": src["num_experts_per_tok"],
        "num_hidden_layers": layers,
        "num_key_value_heads": src["num_key_value_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": src["rms_norm_eps"],
        "rope_scaling": rope,
        "rope_theta": 10000,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": src["vocab_size"],
        **moe,
    }
    _write(path, out, config)
    llm = assert_serves_like_hf(f"deepseek-v1 {case}", path, random_token_prompts(11, 2), hf=hf)
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == "DeepseekForCausalLM"
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert [k == "LlamaMLP" for k in kinds] == [i in dense for i in range(layers)]


def _arctic_hf(freq: int, residual: bool, layers: int, seed: int):
    """HF Mixtral rewired into Arctic's layout (module docstring), random float32 weights."""
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralDecoderLayer,
        MixtralForCausalLM,
        MixtralRMSNorm,
    )
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP

    class ArcticLayer(MixtralDecoderLayer):
        def __init__(self, config, i: int) -> None:
            super().__init__(config, i)
            hidden, moe = config.hidden_size, (i + 1) % freq == 0
            if not moe:
                self.mlp = Qwen2MoeMLP(config, config.intermediate_size)
            self.residual = residual and moe
            if self.residual:
                self.residual_layernorm = MixtralRMSNorm(hidden, config.rms_norm_eps)
                self.residual_mlp = Qwen2MoeMLP(config, hidden)

        def forward(self, hidden_states, **kwargs):
            if not self.residual:
                return super().forward(hidden_states, **kwargs)
            x = hidden_states
            h = x + self.self_attn(hidden_states=self.input_layernorm(x), **kwargs)[0]
            res = self.residual_mlp(self.residual_layernorm(h))
            return h + res + self.mlp(self.post_attention_layernorm(x))  # MoE reads x

    config = tiny_config("mixtral", num_hidden_layers=layers, num_key_value_heads=2)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    model.model.layers = torch.nn.ModuleList(ArcticLayer(config, i) for i in range(layers))
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        _randomize(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, config


def _arctic_tensors(model, inter: int) -> dict[str, torch.Tensor]:
    """The HF reference's tensors under Arctic's names (experts split per expert as w1 / w3 /
    w2, the dense MLPs' projections as w1 / w3 / w2)."""
    out = {}
    proj = ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        moe = name.replace(".mlp.experts.", ".block_sparse_moe.experts.")
        if name.endswith(".mlp.experts.gate_up_proj"):
            for m in range(w.shape[0]):
                out[moe.replace("gate_up_proj", f"{m}.w1.weight")] = w[m, :inter].contiguous()
                out[moe.replace("gate_up_proj", f"{m}.w3.weight")] = w[m, inter:].contiguous()
            continue
        if name.endswith(".mlp.experts.down_proj"):
            for m in range(w.shape[0]):
                out[moe.replace("down_proj", f"{m}.w2.weight")] = w[m].contiguous()
            continue
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        if ".mlp." in name or ".residual_mlp." in name:
            name = name.replace(".mlp.", ".block_sparse_moe.mlp.")
            for ours, theirs in proj:
                name = name.replace(ours, theirs)
        out[name] = w
    return out


# name: (moe_layer_frequency, residual fields as config.json has them)
ARCTIC = {
    "instruct": (1, {"use_residual": True, "parallel_attn_mlp_res": True}),  # the Hub's
    "freq2-res": (2, {"parallel_attn_mlp_res": True}),  # a dense layer, then MoE + residual
    "freq2": (2, {"use_residual": False}),  # a dense layer, then a plain MoE layer
}


@pytest.mark.parametrize("case", sorted(ARCTIC))
def test_arctic(case, tmp_path):
    freq, residual = ARCTIC[case]
    layers, seed = 2, 12
    hf, src = _arctic_hf(freq, any(residual.values()), layers, seed)
    path = save_hf_checkpoint(hf, tmp_path / "arctic", seed)
    config = {
        "architectures": ["ArcticForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_arctic.ArcticConfig"},
        "model_type": "arctic",
        "bos_token_id": src.bos_token_id,
        "eos_token_id": src.eos_token_id,
        "enable_expert_tensor_parallelism": False,
        "hidden_act": "silu",
        "hidden_size": src.hidden_size,
        "intermediate_size": src.intermediate_size,
        "max_position_embeddings": src.max_position_embeddings,
        "moe_eval_capacity_factor": 1,
        "moe_layer_frequency": freq,
        "moe_min_capacity": 0,
        "moe_token_dropping": True,
        "moe_train_capacity_factor": 1,
        "num_attention_heads": src.num_attention_heads,
        "num_experts_per_tok": src.num_experts_per_tok,
        "num_hidden_layers": layers,
        "num_key_value_heads": src.num_key_value_heads,
        "num_local_experts": src.num_local_experts,
        "quantization": None,
        "rms_norm_eps": src.rms_norm_eps,
        "rope_theta": src.rope_parameters["rope_theta"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": src.vocab_size,
        **residual,
    }
    _write(path, _arctic_tensors(hf, src.intermediate_size), config)
    llm = assert_serves_like_hf(f"arctic {case}", path, random_token_prompts(12, 2), hf=hf)
    model = llm.llm_engine.model_runner.model
    kinds = [type(layer).__name__ for layer in model.model.layers]
    want = "ArcticResidualLayer" if any(residual.values()) else "MoeDecoderLayer"
    assert kinds[-1] == want


BAD = [
    ("DeepseekForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("DeepseekForCausalLM", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("DeepseekForCausalLM", {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ("DeepseekForCausalLM", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("ArcticForCausalLM", {"quantization": {"q_bits": 8}}, "'quantization'"),
    ("ArcticForCausalLM", {"quantization_config": {"quant_method": "deepspeedfp"}}, "quantiz"),
    ("ArcticForCausalLM", {"use_residual": True, "parallel_attn_mlp_res": False}, "disagree"),
    ("ArcticForCausalLM", {"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ("ArcticForCausalLM", {"sliding_window": 4096}, "sliding_window"),
]


@pytest.mark.parametrize(("arch", "bad", "match"), BAD)
def test_bad_config_fields_are_named(arch, bad, match, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    raw = {
        "architectures": [arch],
        "model_type": "deepseek" if arch.startswith("Deepseek") else "arctic",
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "n_routed_experts": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert remote_config(tmp_path) is not None  # the good config translates
    (tmp_path / "config.json").write_text(json.dumps({**raw, **bad}))
    with pytest.raises(ValueError, match=match):
        remote_config(tmp_path)
