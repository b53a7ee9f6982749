"""Pangu Pro MoE (PanguProMoEForCausalLM, remote code; models/pangu_pro_moe.py) against a
reference composed from transformers: HF Llama with attention_bias (q / k / v / o biases) whose
MLPs are replaced by a MoGE block built from transformers' Qwen2MoeMLP experts and routed in
plain torch as vllm-ascend's pangu_moe.py does (softmax over all experts, the best of each of
k contiguous groups, times router_scale, no renormalization; an ungated shared expert). The
reference's tensors are saved under the release's names with its config.json (model_type
PanGuMoE) and served through paged: greedy tokens identical, top-5 logprobs within 1e-3
(float32). The test checks that its prompts route some token differently from a global top-k.

Also: the switches without a reference refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import hf_greedy, load_hf_model, random_token_prompts
from torch import nn

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP  # noqa: E402

EXPERTS, GROUPS = 8, 2  # num_experts, num_experts_per_tok: 2 groups of 4 experts
MOE_SIZE, SHARED_SIZE = 32, 48


class ReferenceMoGE(nn.Module):
    """The MoGE MLP in plain torch over transformers' expert MLPs, under the release's names
    (`gate`, `router_scale`, `experts.M`, `shared_expert`). `differs` counts tokens whose
    grouped choice is not the global top-k."""

    def __init__(self, config, gen: torch.Generator) -> None:
        super().__init__()
        h = config.hidden_size
        self.gate = nn.Linear(h, EXPERTS, bias=False)
        self.router_scale = nn.Parameter(torch.empty(1, EXPERTS))
        self.experts = nn.ModuleList(Qwen2MoeMLP(config, MOE_SIZE) for _ in range(EXPERTS))
        self.shared_expert = Qwen2MoeMLP(config, SHARED_SIZE)
        with torch.no_grad():
            for name, p in self.named_parameters():
                std = 1.5 if name == "gate.weight" else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            self.router_scale.copy_(torch.rand(1, EXPERTS, generator=gen) + 0.5)
        self.differs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        size = EXPERTS // GROUPS
        out = self.shared_expert(flat)
        chosen = []
        for g in range(GROUPS):
            weight, local = probs[:, g * size : (g + 1) * size].max(dim=-1)
            expert = local + g * size
            chosen.append(expert)
            weight = weight * self.router_scale[0, expert]
            for e in range(EXPERTS):
                rows = (expert == e).nonzero().squeeze(1)
                if rows.numel():
                    y = self.experts[e](flat[rows]) * weight[rows, None]
                    out = out.index_add(0, rows, y.to(out.dtype))
        grouped = torch.stack(chosen, dim=1).sort(dim=1).values
        top = probs.topk(GROUPS, dim=-1).indices.sort(dim=1).values
        self.differs += int((grouped != top).any(dim=1).sum())
        return out.reshape(x.shape)


def _write_pangu(tmp_path: Path, seed: int) -> tuple[Path, nn.Module]:
    """A tiny HF Llama (biased attention) with MoGE MLPs, saved as a Pangu Pro MoE release."""
    path = write_tiny_model(tmp_path, "llama", seed=seed, attention_bias=True, rope_theta=5e5)
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(seed)
    for layer in hf.model.layers:
        layer.mlp = ReferenceMoGE(hf.config, gen)
    hf.eval()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    src = json.loads((path / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    keep += ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps")
    keep += ("bos_token_id", "eos_token_id", "pad_token_id")
    config = {
        "architectures": ["PanguProMoEForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_pangu_moe.PanGuMoEConfig",
            "AutoModelForCausalLM": "modeling_pangu_moe.PanGuMoEForCausalLM",
        },
        "model_type": "PanGuMoE",
        **{k: src[k] for k in keep},
        "hidden_act": "silu",
        "rope_theta": 5e5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "num_experts": EXPERTS,
        "num_experts_per_tok": GROUPS,
        "moe_intermediate_size": MOE_SIZE,
        "shared_expert_intermediate_size": SHARED_SIZE,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path, hf


def test_pangu_pro_moe_matches_reference(tmp_path):
    path, hf = _write_pangu(tmp_path, seed=31)
    prompts = random_token_prompts(31, 2)
    refs = [hf_greedy(hf, p, 6, 5) for p in prompts]
    # the grouped choice must matter on these inputs (else global top-k would pass too)
    assert sum(layer.mlp.differs for layer in hf.model.layers) > 0
    llm = LLM(model=str(path), dtype="float32", max_model_len=96, block_size=16)
    assert_llm_matches("pangu_pro_moe", llm, prompts, refs)


_SIZES = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2}
_SIZES |= {"num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("mlp_only_layers", [0]),
        ("sandwich_norm", True),
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("num_experts_per_tok", 3),
        ("head_dim", 32),
        ("hidden_act", "gelu"),
    ],
)
def test_pangu_pro_moe_refuses(name, value, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    config = {"architectures": ["PanguProMoEForCausalLM"], "model_type": "PanGuMoE", **_SIZES}
    (tmp_path / "config.json").write_text(json.dumps({**config, name: value}))
    with pytest.raises(ValueError, match=name):
        remote_config(tmp_path)
