"""StepFun Step3's decoder (`Step3TextForCausalLM`, remote code; models/step3_text.py) against a
reference composed here: transformers has no Step3 class (its `step3p7` is Step 3.5 / 3.7
Flash: gated heads, sigmoid routing), so the reference is HF Llama's exact pieces (its RMSNorm
and rotary helpers) wired under the release's tensor names, with plain torch for the rest as
vLLM's step3_text.py computes it: MFA attention (q = wq(inter_norm(q_proj(x))), one KV head),
softmax top-k routing (renormalized when norm_expert_weight) over per-layer expert stacks, an
ungated shared expert, dense layers outside moe_layers_enum, an untied head. Its weights are
written with the release's names and config.json fields, served by paged and compared: greedy
tokens identical, top-5 logprobs within 1e-3 (float32).

    text   Step3TextForCausalLM, moe_layers_enum "1,2" (layer 0 dense), renormalized routing
    vl     Step3VLForConditionalGeneration: the same decoder under text_config, vision weights
           beside it (dropped), unnormalized routing, a list moe_layers_enum; images refused

Also: the config switches models/step3_text.py does not serve are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_parity import assert_llm_matches
from hf_reference import Greedy, greedy_over_logits, random_token_prompts
from torch import nn

from paged_engine import LLM
from paged_engine.testing import _COMMON, TINY_VOCAB_SIZE, _randomize, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

VOCAB = TINY_VOCAB_SIZE
# Step3's text fields as the release writes them, at tiny sizes (heads * head_dim != hidden)
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_attention_groups": 1,
    "head_dim": 32,
    "share_q_dim": 48,
    "max_seq_len": 128,
    "max_position_embedding": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "share_expert_dim": 40,
    "moe_layers_enum": "1,2",
    "norm_expert_weight": True,
}


class _Layer(nn.Module):
    def __init__(self, c: dict, moe: bool):
        super().__init__()
        d, hd, sq, eps = c["hidden_size"], c["head_dim"], c["share_q_dim"], c["rms_norm_eps"]
        self.input_layernorm, self.post_attention_layernorm = (
            LlamaRMSNorm(d, eps),
            LlamaRMSNorm(d, eps),
        )
        a = self.self_attn = nn.Module()
        a.q_proj, a.k_proj, a.v_proj = (nn.Linear(d, n, bias=False) for n in (sq, hd, hd))
        a.inter_norm = LlamaRMSNorm(sq, eps)
        a.wq = nn.Linear(sq, c["num_attention_heads"] * hd, bias=False)
        a.o_proj = nn.Linear(c["num_attention_heads"] * hd, d, bias=False)
        if moe:
            e, i = c["moe_num_experts"], c["moe_intermediate_size"]
            self.moe = nn.Module()
            self.moe.gate = nn.Linear(d, e, bias=False)
            # the release's stacks: `moe.{gate,up}_proj.weight` [E, I, D], down [E, D, I]
            for name, shape in (
                ("gate_proj", (e, i, d)),
                ("up_proj", (e, i, d)),
                ("down_proj", (e, d, i)),
            ):
                setattr(self.moe, name, nn.Module())
                getattr(self.moe, name).weight = nn.Parameter(torch.empty(shape))
            self.share_expert = _mlp(d, c["share_expert_dim"])
        else:
            self.mlp = _mlp(d, c["intermediate_size"])


def _mlp(d: int, inner: int) -> nn.Module:
    m = nn.Module()
    m.gate_proj, m.up_proj = nn.Linear(d, inner, bias=False), nn.Linear(d, inner, bias=False)
    m.down_proj = nn.Linear(inner, d, bias=False)
    return m


def _swiglu(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


class Step3Reference(nn.Module):
    """Step3's decoder under the release's names, recomputing the whole sequence each step."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        moe = {int(i) for i in str(c["moe_layers_enum"]).strip("[]").split(",")}
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, c["hidden_size"])
        layers = [_Layer(c, i in moe) for i in range(c["num_hidden_layers"])]
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], VOCAB, bias=False)

    def _moe(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:  # [S, D]
        m = layer.moe
        probs = m.gate(x).float().softmax(-1)
        w, ids = probs.topk(self.c["moe_top_k"], dim=-1)
        if self.c["norm_expert_weight"]:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        gate, up, down = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
        for e in range(gate.shape[0]):
            y = F.linear(F.silu(F.linear(x, gate[e])) * F.linear(x, up[e]), down[e])
            out = out + (w * (ids == e)).sum(-1, keepdim=True) * y
        return out + _swiglu(layer.share_expert, x)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [S] -> [S, V]
        c, seq = self.c, ids.shape[0]
        heads, hd = c["num_attention_heads"], c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.arange(seq).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, S, hd]
        cos, sin = emb.cos(), emb.sin()
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            a, h = layer.self_attn, layer.input_layernorm(x)
            q = a.wq(a.inter_norm(a.q_proj(h))).view(seq, heads, hd).transpose(0, 1)[None]
            k = a.k_proj(h).view(1, 1, seq, hd)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            scores = (q @ k.transpose(-1, -2)) * hd**-0.5  # the one KV head serves every head
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            out = (probs @ a.v_proj(h)[None, None]).squeeze(0).transpose(0, 1).reshape(seq, -1)
            x = x + a.o_proj(out)
            h = layer.post_attention_layernorm(x)
            x = x + (self._moe(layer, h) if hasattr(layer, "moe") else _swiglu(layer.mlp, h))
        return self.lm_head(self.model.norm(x))

    def greedy(self, prompt: list[int], steps: int, top: int = 5) -> Greedy:
        return greedy_over_logits(self.logits, prompt, steps, top)


def _text(case: str) -> dict:
    if case == "text":
        return dict(TEXT)
    return {**TEXT, "moe_layers_enum": [1, 2], "norm_expert_weight": False}


def _config(case: str) -> dict:
    text = {**_text(case), "model_type": "step3_text", "architectures": ["Step3TextForCausalLM"]}
    if case == "text":
        return {**text, "torch_dtype": "float32", **_COMMON}
    return {
        "architectures": ["Step3VLForConditionalGeneration"],
        "model_type": "step3_vl",
        "text_config": text,
        "vision_config": {"hidden_size": 16, "output_hidden_size": 16, "num_hidden_layers": 1},
        "image_token_id": 128001,
        "understand_projector_stride": 1,
        "projector_bias": True,
        "torch_dtype": "float32",
        **_COMMON,
    }


def _write(path: Path, case: str, seed: int) -> Step3Reference:
    """The reference of `case` with random weights, saved to `path` as the release would be."""
    ref = Step3Reference(_text(case)).eval()
    with torch.no_grad():
        _randomize(ref, seed)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if case == "vl":  # the tower's weights beside the decoder: never loaded by paged
        state["vision_model.embeddings.patch_embedding.weight"] = torch.randn(16, 3, 2, 2)
        state["vit_downsampler.weight"] = torch.randn(16, 16, 2, 2)
        state["vit_downsampler2.weight"] = torch.randn(32, 16, 3, 3)
        state["vit_large_projector.weight"] = torch.randn(64, 32)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_config(case)))
    build_tiny_tokenizer(VOCAB, seed).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return ref


@pytest.mark.parametrize("case", ["text", "vl"])
def test_step3_matches_reference(case, tmp_path):
    seed = 31 if case == "text" else 32
    ref = _write(tmp_path, case, seed)
    prompts = random_token_prompts(seed, 2)
    refs = [ref.greedy(p, 6) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=96, block_size=16)
    assert_llm_matches(f"step3-{case}", llm, prompts, refs)
    assert llm.get_stats().num_used_blocks == 0
    if case == "vl":  # no Step3 tower: an image is refused, naming it
        from PIL import Image

        request = {
            "prompt_token_ids": prompts[0],
            "multi_modal_data": {"image": Image.new("RGB", (8, 8))},
        }
        with pytest.raises(ValueError, match="multi_modal_data is not supported"):
            llm.generate([request], use_tqdm=False)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_attention_groups", 2),
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("hidden_act", "gelu"),
        ("moe_layers_enum", "1,7"),
        ("moe_top_k", 5),
    ],
)
def test_step3_refuses_unserved_switches(name, value, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps({**_config("text"), name: value}))
    with pytest.raises(ValueError, match=name):
        remote_config(tmp_path)
