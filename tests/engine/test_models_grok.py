"""xAI's Grok-1 (`Grok1ModelForCausalLM` / `Grok1ForCausalLM`, models/grok1.py), a remote-code
release, against transformers in float32: greedy tokens identical, top-5 logprobs within 1e-3.

Grok-1 has no transformers class. Its reference is HF Gemma 2 (four norms a layer in Grok's
order, soft-capped scores scaled by query_pre_attn_scalar^-0.5 = head_dim^-0.5, an embedding
scale) with transformers' own modules swapped in: MixtralRMSNorm for the (1 + w) norms, and in
place of each dense MLP a MixtralSparseMoeBlock (softmax top-2, renormalized) of exact-GELU
experts whose router soft-caps its logits first, as vLLM's Grok1MoE does (the glue below). The
scalars go into the Grok checkpoint's weights exactly (powers of two): the embedding by
sqrt(hidden) / embedding_multiplier_scale, o_proj by 1 / attn_output_multiplier, the LM head by
1 / output_multiplier_scale (tied: chosen so that Gemma 2's tied head is Grok's head times the
output scale). The checkpoint is then written under the release's names and config.json fields.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_parity import assert_serves_like_hf, save_hf_checkpoint
from hf_reference import random_token_prompts
from safetensors.torch import save_file

from paged_engine.testing import _randomize, tiny_config
from paged_kernels.reference import moe_activation

transformers = pytest.importorskip("transformers")


def _grok_reference(fields: dict, tied: bool, seed: int):
    """HF Gemma 2 rewired as Grok-1 (module docstring), random float32 weights."""
    import torch.nn.functional as F
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralRMSNorm,
        MixtralSparseMoeBlock,
        MixtralTopKRouter,
    )

    class CappedRouter(MixtralTopKRouter):
        """vLLM's Grok1MoE routing: cap * tanh(logits / cap), then Mixtral's softmax top-k
        renormalized."""

        def __init__(self, config, cap: float) -> None:
            super().__init__(config)
            self.cap = cap

        def forward(self, hidden_states):
            logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            logits = self.cap * torch.tanh(logits / self.cap)
            top, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
            return logits, top / top.sum(dim=-1, keepdim=True), ids

    attn_cap = fields.get("attn_logit_softcapping", 30.0)
    config = tiny_config(
        "gemma2",
        layer_types=["full_attention"] * 2,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=None,
        rms_norm_eps=fields["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": fields.get("rope_theta", 1e4)},
        tie_word_embeddings=tied,
    )
    moe = tiny_config("mixtral", hidden_act="gelu")  # hidden 64, 4 experts of 32, top-2
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config)
    d, eps = config.hidden_size, config.rms_norm_eps
    for layer in model.model.layers:
        layer.mlp = MixtralSparseMoeBlock(moe)
        layer.mlp.gate = CappedRouter(moe, fields.get("router_logit_softcapping", 30.0))
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(layer, f"{norm}_layernorm", MixtralRMSNorm(d, eps))
    model.model.norm = MixtralRMSNorm(d, eps)
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        _randomize(model, seed)
    return model, config, moe


def _grok_tensors(model, fields: dict, inter: int, tied: bool) -> dict[str, torch.Tensor]:
    """The reference's tensors under the release's names, its scalars folded out exactly."""
    hidden = model.config.hidden_size
    norms = {
        ".input_layernorm.weight": ".pre_attn_norm.scale",
        ".post_attention_layernorm.weight": ".post_attn_norm.scale",
        ".pre_feedforward_layernorm.weight": ".pre_moe_norm.scale",
        ".post_feedforward_layernorm.weight": ".post_moe_norm.scale",
    }
    out = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        if name == "model.embed_tokens.weight":
            w = w * (math.sqrt(hidden) / fields["embedding_multiplier_scale"])
        elif name == "lm_head.weight":
            if tied:
                continue
            w = w / fields["output_multiplier_scale"]
        elif name == "model.norm.weight":
            name = "model.norm.scale"
        elif name.endswith(".mlp.experts.gate_up_proj"):
            for m in range(w.shape[0]):
                base = name.replace(".mlp.experts.gate_up_proj", f".moe_block.experts.{m}.")
                out[base + "linear.weight"] = w[m, :inter].contiguous()
                out[base + "linear_v.weight"] = w[m, inter:].contiguous()
            continue
        elif name.endswith(".mlp.experts.down_proj"):
            for m in range(w.shape[0]):
                base = name.replace(".mlp.experts.down_proj", f".moe_block.experts.{m}.")
                out[base + "linear_1.weight"] = w[m].contiguous()
            continue
        elif name.endswith(".self_attn.o_proj.weight"):
            w = w / fields.get("attn_output_multiplier", 1.0)
        for theirs, ours in norms.items():
            name = name.replace(theirs, ours)
        name = name.replace(".self_attn.", ".attn.").replace(".mlp.gate.", ".moe_block.gate.")
        out[name] = w
    return out


# name: (architecture, tied, the config.json fields that differ)
CASES = {
    # hpcai-tech/grok-1's field names (num_experts, max_attn_value), vLLM's default caps (30)
    "hpcai": (
        "Grok1ModelForCausalLM",
        True,
        {
            "attn_output_multiplier": 0.125,
            "max_attn_value": 30.0,
            "num_experts": 4,
            # tied: Gemma 2's head (the embedding) = (8 / 2) * 0.25 * its embedding
            "embedding_multiplier_scale": 2.0,
            "output_multiplier_scale": 0.25,
            "rms_norm_eps": 0.5,  # large: the norms after o_proj do not hide its multiplier
        },
    ),
    # vLLM's field names, caps that bite, another rope base, an untied head
    "capped": (
        "Grok1ForCausalLM",
        False,
        {
            "attn_output_multiplier": 4.0,
            "attn_logit_softcapping": 0.5,
            "router_logit_softcapping": 0.25,
            "num_local_experts": 4,
            "embedding_multiplier_scale": 16.0,
            "output_multiplier_scale": 0.5,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-3,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grok1(case, tmp_path):
    arch, tied, fields = CASES[case]
    seed = 13
    hf, src, moe = _grok_reference(fields, tied, seed)
    path = save_hf_checkpoint(hf, tmp_path / "grok", seed)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    config = {
        "architectures": [arch],
        "auto_map": {"AutoConfig": "configuration_grok1.Grok1Config"},
        "vocab_size": src.vocab_size,
        "hidden_size": src.hidden_size,
        "intermediate_size": moe.intermediate_size,
        "num_hidden_layers": src.num_hidden_layers,
        "num_attention_heads": src.num_attention_heads,
        "num_key_value_heads": src.num_key_value_heads,
        "max_position_embeddings": src.max_position_embeddings,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "pad_token_id": 0,
        "bos_token_id": src.bos_token_id,
        "eos_token_id": src.eos_token_id,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        **fields,
    }
    state = _grok_tensors(hf, fields, moe.intermediate_size, tied)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    llm = assert_serves_like_hf(f"grok-1 {case}", path, random_token_prompts(13, 2), hf=hf)
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == "Grok1ForCausalLM"
    assert model.tie_word_embeddings == tied
    # the experts' GELU is the exact one HF's experts run (tanh's is within the 1e-3 above)
    gate, up = torch.linspace(-4, 4, 64), torch.linspace(1, 2, 64)
    ours = moe_activation(gate, up, model.model.layers[0].moe_block.experts.activation)
    torch.testing.assert_close(ours, hf.model.layers[0].mlp.experts.act_fn(gate) * up)


GOOD = {
    "architectures": ["Grok1ModelForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
}

BAD = [
    ({"residual_moe": True}, "residual_moe"),  # Grok-2
    # xai-org/grok-2's shape: transformers would read model_type "git" as GIT's config
    ({"architectures": ["Grok1ForCausalLM"], "model_type": "git", "residual_moe": 1}, "residual"),
    ({"moe_intermediate_size": 16}, "moe_intermediate_size"),  # Grok-2
    ({"final_logit_softcapping": 50.0}, "final_logit_softcapping"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"moe_router_renormalize": False}, "moe_router_renormalize"),
    ({"max_attn_value": 20.0}, "max_attn_value"),
    ({"head_dim": 32}, "head_dim"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"embedding_multiplier_scale": "big"}, "embedding_multiplier_scale"),
]


@pytest.mark.parametrize(("bad", "match"), BAD)
def test_bad_config_fields_are_named(bad, match, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps(GOOD))
    config = remote_config(tmp_path)  # the good config translates, with vLLM's defaults
    assert config.attn_logit_softcapping == config.router_logit_softcapping == 30.0
    assert config.attn_output_multiplier == 1.0 and config.tie_word_embeddings
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, **bad}))
    with pytest.raises(ValueError, match=match):
        remote_config(tmp_path)


def test_a_null_model_type_is_translated_as_an_absent_one(tmp_path):
    """hpcai-tech's config.json has no model_type; one written as null reads the same."""
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps({**GOOD, "model_type": None}))
    assert remote_config(tmp_path).attn_logit_softcapping == 30.0
