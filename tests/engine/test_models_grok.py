"""xAI's Grok-1 (`Grok1ModelForCausalLM` / `Grok1ForCausalLM`) and Grok-2 (`Grok1ForCausalLM`,
model_type "git"), models/grok1.py, remote-code releases, against transformers in float32:
greedy tokens identical, top-5 logprobs within 1e-3.

Grok-1 has no transformers class. Its reference is HF Gemma 2 (four norms a layer in Grok's
order, soft-capped scores scaled by query_pre_attn_scalar^-0.5 = head_dim^-0.5, an embedding
scale) with transformers' own modules swapped in: MixtralRMSNorm for the (1 + w) norms, and in
place of each dense MLP a MixtralSparseMoeBlock (softmax top-2, renormalized) of exact-GELU
experts whose router soft-caps its logits first, as vLLM's Grok1MoE does (the glue below). The
scalars go into the Grok checkpoint's weights exactly (powers of two): the embedding by
sqrt(hidden) / embedding_multiplier_scale, o_proj by 1 / attn_output_multiplier, the LM head by
1 / output_multiplier_scale (tied: chosen so that Gemma 2's tied head is Grok's head times the
output scale). The checkpoint is then written under the release's names and config.json fields.

Grok-2's parts go into the same reference: its residual MoE is the glue `ResidualMoe`, Gemma 2's
own exact-GELU `Gemma2MLP` (intermediate_size) beside the sparse block (moe_intermediate_size,
its router not renormalized), their sum times 1/sqrt(2); its final logit cap is Gemma 2's
final_logit_softcapping at output_multiplier_scale * cap (vLLM caps the raw logits, then
scales: s * c * tanh(x / c) = (s c) * tanh(s x / (s c))). Its checkpoint is written under
Grok-2's names, the expert and dense MLP matrices split over two `*-TP-NNN.safetensors` files
as the release presharded them.
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
    """HF Gemma 2 rewired as Grok-1 / Grok-2 (module docstring), random float32 weights."""
    import torch.nn.functional as F
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
    from transformers.models.mixtral.modeling_mixtral import (
        MixtralRMSNorm,
        MixtralSparseMoeBlock,
        MixtralTopKRouter,
    )

    class CappedRouter(MixtralTopKRouter):
        """vLLM's Grok1MoE routing: cap * tanh(logits / cap), then Mixtral's softmax top-k,
        renormalized or not."""

        def __init__(self, config, cap: float, renormalize: bool) -> None:
            super().__init__(config)
            self.cap, self.renormalize = cap, renormalize

        def forward(self, hidden_states):
            logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            logits = self.cap * torch.tanh(logits / self.cap)
            top, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
            return logits, top / top.sum(dim=-1, keepdim=True) if self.renormalize else top, ids

    class ResidualMoe(torch.nn.Module):
        """vLLM's Grok-2 residual MoE: (moe(x) + dense(x)) / sqrt(2)."""

        def __init__(self, moe: torch.nn.Module, dense: torch.nn.Module) -> None:
            super().__init__()
            self.moe, self.dense = moe, dense

        def forward(self, x):
            return (self.moe(x) + self.dense(x)) * (1 / math.sqrt(2.0))

    attn_cap = fields.get("attn_logit_softcapping", 30.0)
    final_cap = fields.get("final_logit_softcapping")
    residual = fields.get("residual_moe", False)
    config = tiny_config(
        "gemma2",
        layer_types=["full_attention"] * 2,
        attn_logit_softcapping=attn_cap,
        # vLLM's cap before the output scale, as Gemma 2's cap after it (module docstring)
        final_logit_softcapping=final_cap and final_cap * fields["output_multiplier_scale"],
        hidden_activation="gelu",  # the dense MLP's: exact, vLLM's GeluAndMul
        rms_norm_eps=fields["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": fields.get("rope_theta", 1e4)},
        tie_word_embeddings=tied,
    )
    moe = tiny_config("mixtral", hidden_act="gelu")  # hidden 64, 4 experts of 32, top-2
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config)
    d, eps = config.hidden_size, config.rms_norm_eps
    renormalize = fields.get("moe_router_renormalize", not residual)
    for layer in model.model.layers:
        sparse = MixtralSparseMoeBlock(moe)
        sparse.gate = CappedRouter(moe, fields.get("router_logit_softcapping", 30.0), renormalize)
        layer.mlp = ResidualMoe(sparse, Gemma2MLP(config)) if residual else sparse
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(layer, f"{norm}_layernorm", MixtralRMSNorm(d, eps))
    model.model.norm = MixtralRMSNorm(d, eps)
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        _randomize(model, seed)
    return model, config, moe


def _grok_tensors(model, fields: dict, inter: int, tied: bool) -> dict[str, torch.Tensor]:
    """The reference's tensors under the release's names (Grok-2's where `residual_moe`), its
    scalars folded out exactly."""
    hidden = model.config.hidden_size
    grok2 = fields.get("residual_moe", False)
    # Grok-2's norms keep HF's `weight`, its experts are w1 / w3 / w2 (gate, up, down)
    norm = "weight" if grok2 else "scale"
    gate, up, down = ("w1", "w3", "w2") if grok2 else ("linear", "linear_v", "linear_1")
    moe = ".block_sparse_moe." if grok2 else ".moe_block."
    norms = {
        ".input_layernorm.weight": f".pre_attn_norm.{norm}",
        ".post_attention_layernorm.weight": f".post_attn_norm.{norm}",
        ".pre_feedforward_layernorm.weight": f".pre_moe_norm.{norm}",
        ".post_feedforward_layernorm.weight": f".post_moe_norm.{norm}",
    }
    out = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone()
        # the residual MoE's parts: the sparse block where Grok-1's stands, the dense MLP `mlp`
        name = name.replace(".mlp.moe.", ".mlp.").replace(".mlp.dense.", ".dense_mlp.")
        if name == "model.embed_tokens.weight":
            w = w * (math.sqrt(hidden) / fields["embedding_multiplier_scale"])
        elif name == "lm_head.weight":
            if tied:
                continue
            w = w / fields["output_multiplier_scale"]
        elif name == "model.norm.weight":
            name = f"model.norm.{norm}"
        elif name.endswith(".mlp.experts.gate_up_proj"):
            for m in range(w.shape[0]):
                base = name.replace(".mlp.experts.gate_up_proj", f"{moe}experts.{m}.")
                out[base + f"{gate}.weight"] = w[m, :inter].contiguous()
                out[base + f"{up}.weight"] = w[m, inter:].contiguous()
            continue
        elif name.endswith(".mlp.experts.down_proj"):
            for m in range(w.shape[0]):
                base = name.replace(".mlp.experts.down_proj", f"{moe}experts.{m}.")
                out[base + f"{down}.weight"] = w[m].contiguous()
            continue
        elif name.endswith(".self_attn.o_proj.weight"):
            w = w / fields.get("attn_output_multiplier", 1.0)
        for theirs, ours in norms.items():
            name = name.replace(theirs, ours)
        if not grok2:
            name = name.replace(".self_attn.", ".attn.")
        name = name.replace(".mlp.gate.", f"{moe}gate.").replace(".dense_mlp.", ".mlp.")
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
    # xai-org/grok-2's fields (its rope's YaRN fields unused under rope_type "original"), a
    # final cap that bites, the dense MLP wider than the experts
    "grok2": (
        "Grok1ForCausalLM",
        False,
        {
            "model_type": "git",
            "residual_moe": True,
            "moe_intermediate_size": 32,
            "num_local_experts": 4,
            "head_dim": 16,
            "embedding_multiplier_scale": 8.0,  # sqrt(hidden), as the release's
            "output_multiplier_scale": 0.5,
            "final_logit_softcapping": 4.0,
            "attn_logit_softcapping": 30.0,
            "router_logit_softcapping": 30.0,
            "rope_theta": 208533496.0,
            "rope_type": "original",
            "original_max_position_embeddings": 8192,
            "scaling_factor": 16.0,
            "extrapolation_factor": 1.0,
            "attn_factor": 1.0,
            "beta_fast": 8,
            "beta_slow": 1,
            "attn_temperature_len": 1024,
            "sliding_window_size": -1,
            "global_attn_every_n": 1,
            "rms_norm_eps": 0.5,  # large: post_moe_norm does not hide the 1/sqrt(2)
        },
    ),
    # Grok-2's residual MoE with Grok-1's renormalized, capped router and a tied head
    "grok2-renormalized": (
        "Grok1ForCausalLM",
        True,
        {
            "residual_moe": True,
            "moe_intermediate_size": 32,
            "moe_router_renormalize": True,
            "router_logit_softcapping": 0.25,
            "num_local_experts": 4,
            "embedding_multiplier_scale": 2.0,
            "output_multiplier_scale": 0.25,
            "rms_norm_eps": 0.5,
        },
    ),
}


def _write_tp_slices(state: dict[str, torch.Tensor], path) -> None:
    """Grok-2's presharded layout: the expert and dense MLP matrices halved along their
    intermediate dimension into `*-TP-000` / `*-TP-001` files under the same names, the rest in
    `*-TP-common`."""
    common, ranks = {}, ({}, {})
    for name, w in state.items():
        dim = 1 if name.endswith((".w2.weight", ".down_proj.weight")) else 0
        if ".experts." in name or ".mlp." in name:
            for rank, part in zip(ranks, w.chunk(2, dim=dim), strict=True):
                rank[name] = part.contiguous()
        else:
            common[name] = w
    save_file(common, str(path / "pytorch_model-00000-TP-common.safetensors"))
    for r, rank in enumerate(ranks):
        save_file(rank, str(path / f"pytorch_model-{r + 1:05d}-TP-{r:03d}.safetensors"))


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
        # Grok-2's the dense MLP's (its experts': moe_intermediate_size), Grok-1's the experts'
        "intermediate_size": (src if fields.get("residual_moe") else moe).intermediate_size,
        "num_hidden_layers": src.num_hidden_layers,
        "num_attention_heads": src.num_attention_heads,
        "num_key_value_heads": src.num_key_value_heads,
        "max_position_embeddings": src.max_position_embeddings,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "pad_token_id": 0,
        "bos_token_id": src.bos_token_id,
        "eos_token_id": src.eos_token_id,
        "torch_dtype": "float32",
        **fields,
    }
    if fields.get("model_type") != "git":  # Grok-2's release omits it: GitConfig's untied
        config["tie_word_embeddings"] = tied
    state = _grok_tensors(hf, fields, moe.intermediate_size, tied)
    for stale in path.glob("model*.safetensors*"):
        stale.unlink()
    if case == "grok2":
        _write_tp_slices(state, path)
    else:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    llm = assert_serves_like_hf(f"grok {case}", path, random_token_prompts(13, 2), hf=hf)
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == "Grok1ForCausalLM"
    assert model.tie_word_embeddings == tied
    assert (model.model.layers[0].mlp is not None) == fields.get("residual_moe", False)
    # the experts' GELU is the exact one HF's experts run (tanh's is within the 1e-3 above)
    gate, up = torch.linspace(-4, 4, 64), torch.linspace(1, 2, 64)
    ours = moe_activation(gate, up, model.model.layers[0].moe_block.experts.activation)
    sparse = getattr(hf.model.layers[0].mlp, "moe", hf.model.layers[0].mlp)
    torch.testing.assert_close(ours, sparse.experts.act_fn(gate) * up)
    if fields.get("residual_moe"):  # and Grok-2's dense MLP's, HF's Gemma2MLP's exact GELU
        dense = model.model.layers[0].mlp.act_fn(torch.cat((gate, up)))
        torch.testing.assert_close(dense, hf.model.layers[0].mlp.dense.act_fn(gate) * up)


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
    # xai-org/grok-2's shape: transformers would read model_type "git" as GIT's config
    ({"architectures": ["Grok1ForCausalLM"], "model_type": "git", "residual_moe": 1}, "residual"),
    ({"moe_intermediate_size": "wide"}, "moe_intermediate_size"),
    ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
    ({"moe_renormalize": "yes"}, "moe_renormalize"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_type": "yarn"}, "rope_type"),
    ({"sliding_window_size": 4096}, "sliding_window_size"),
    ({"global_attn_every_n": 2}, "global_attn_every_n"),
    ({"attn_logit_softcapping_method": "clip"}, "attn_logit_softcapping_method"),
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


def test_grok2_defaults_and_torn_slices(tmp_path):
    """Grok-2's config.json (model_type "git", residual_moe): an untied head, routing not
    renormalized, the experts moe_intermediate_size wide; a presharded matrix whose slices
    never add up is refused by name."""
    from paged_engine.models.grok1 import join_tp_slices
    from paged_engine.models.remote_aliases import remote_config

    grok2 = {**GOOD, "model_type": "git", "residual_moe": True, "moe_intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(grok2))
    config = remote_config(tmp_path)
    assert not config.tie_word_embeddings and not config.moe_renormalize
    assert (config.moe_intermediate_size, config.intermediate_size) == (16, 32)
    assert config.final_logit_softcapping == 0.0  # absent: no cap
    name = "model.layers.0.block_sparse_moe.experts.0.w2.weight"
    with pytest.raises(ValueError, match="w2"):
        list(join_tp_slices([(name, torch.zeros(64, 8))], {"experts": 16, "mlp": 32}))
