"""Speculative decoding with EAGLE-1 heads of DeepSeek-V3 layers (models/deepseek_eagle.py):
vLLM's `EagleDeepSeekMTPModel` (a DeepSeek-V3 config.json head) and
`EagleMistralLarge3ForCausalLM` (a Mistral Large 3 head in Mistral's native format).

- Targets: a tiny DeepSeek-V3, and a tiny Mistral Large 3 in the native format (an HF Mistral 4
  rewritten by test_mistral_large3_format.write_native, the same network).
- Greedy with speculation token-identical to plain decoding (logprobs within 1e-4).
- Every step's drafts 1 and 2 equal the head run in torch, teacher-forced: transformers' own
  decoder layers (DeepSeek: layers L and L + 1 of an HF DeepSeek-V3 with L + 2 layers, so layer
  L + i's MLP is dense or MoE by its index L + i, as vLLM builds them; Mistral: the HF Mistral 4
  head's own layers) over fc([enorm(embed), hnorm(feature)]) (DeepSeek) or fc([embed, feature])
  (Mistral), then the final norm and the target's LM head, on transformers' target features.
- Refusals by name: another hidden size or vocabulary, DeepSeek-V3.2, an HF-format Mistral 4
  head, a checkpoint without its fc.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from draft_heads import (
    EAGLE_PROMPTS,
    assert_drafts_match_reference,
    assert_greedy_identical_with_drafts,
    eagle_spec,
    rms,
    teacher_forced_drafts,
)
from test_mistral_large3_format import _ROPE, write_native

from paged_engine import LLM
from paged_engine.spec_decode.eagle import FinalHiddenRunner
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

HEAD_LAYERS = 2


def _randn(gen: torch.Generator, *shape: int, scale: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def _fc_and_norms(d: int, seed: int, norms: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"fc.weight": _randn(gen, d, 2 * d, scale=(2 * d) ** -0.5)}
    for name in ("enorm", "hnorm", "norm") if norms else ():
        out[f"{name}.weight"] = 1.0 + _randn(gen, d, scale=0.1)
    return out


def _split_experts(sub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts -> per-expert matrices (vLLM's checkpoint names)."""
    out = {}
    for name, w in sub.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            base = name.removesuffix("gate_up_proj")
            for e, rows in enumerate(w):
                gate, up = rows.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate.clone()
                out[f"{base}{e}.up_proj.weight"] = up.clone()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            base = name.removesuffix("down_proj")
            for e, rows in enumerate(w):
                out[f"{base}{e}.down_proj.weight"] = rows.clone()
        else:
            out[name] = w
    return out


def write_deepseek_eagle_head(path: Path, target: Path, seed: int) -> Path:
    """A DeepSeek-V3 EAGLE head for `target` (L layers), vLLM's layout: its layers are layers
    L and L + 1 of a tiny HF DeepSeek-V3 of L + 2 layers (saved beside it as `hf`) whose
    first_k_dense_replace is L + 1: layer L dense, L + 1 MoE."""
    tc = json.loads((target / "config.json").read_text())
    n = int(tc["num_hidden_layers"])
    hf = write_tiny_model(
        path / "hf",
        "deepseek_v3",
        seed=seed,
        num_hidden_layers=n + HEAD_LAYERS,
        first_k_dense_replace=n + 1,
    )
    head = path / "head"
    head.mkdir()
    config = json.loads((hf / "config.json").read_text())
    config |= {"num_hidden_layers": HEAD_LAYERS, "architectures": ["DeepseekV3ForCausalLM"]}
    (head / "config.json").write_text(json.dumps(config))
    w = load_file(hf / "model.safetensors")
    out = _fc_and_norms(int(config["hidden_size"]), seed, norms=True)
    for i in range(HEAD_LAYERS):
        prefix = f"model.layers.{n + i}."
        layer = {f"layers.{i}.{k[len(prefix) :]}": v for k, v in w.items() if k.startswith(prefix)}
        out |= _split_experts(layer)
    out["embed_tokens.weight"] = w["model.embed_tokens.weight"]  # a copy: the target's serves
    save_file(out, head / "model.safetensors")
    return head


def _write_mistral4(path: Path, seed: int, **fields) -> Path:
    """A tiny HF Mistral 4 (the network of a Mistral Large 3) with one expert group."""
    return write_tiny_model(
        path,
        "mistral4",
        seed=seed,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.5,
        rope_parameters=dict(_ROPE),
        **fields,
    )


def write_mistral_eagle_head(path: Path, seed: int) -> Path:
    """A Mistral Large 3 EAGLE head in the native format: a tiny HF Mistral 4 of two layers
    (dense, then MoE; saved as `hf`) rewritten as Large 3 ships, plus `eagle_linear.weight`."""
    hf = _write_mistral4(path / "hf", seed, num_hidden_layers=HEAD_LAYERS, first_k_dense_replace=1)
    head = write_native(hf, path / "head")
    d = int(json.loads((hf / "config.json").read_text())["hidden_size"])
    w = load_file(head / "consolidated.safetensors")
    w["eagle_linear.weight"] = _fc_and_norms(d, seed, norms=False)["fc.weight"]
    save_file(w, head / "consolidated.safetensors")
    return head


@pytest.fixture(scope="module", params=["deepseek", "mistral"])
def pair(request, tmp_path_factory):
    """(the target served, its HF twin for the reference, the head)."""
    d = tmp_path_factory.mktemp(f"eagle-{request.param}")
    if request.param == "deepseek":
        target = write_tiny_model(d / "target", "deepseek_v3", seed=3)
        return target, target, write_deepseek_eagle_head(d / "ds", target, seed=4)
    hf_target = _write_mistral4(d / "hf-target", 1)
    target = write_native(hf_target, d / "target")
    return target, hf_target, write_mistral_eagle_head(d / "ml3", seed=5)


def test_greedy_is_token_identical(pair):
    target, _, head = pair
    assert_greedy_identical_with_drafts(target, EAGLE_PROMPTS, eagle_spec(head, 3), 12)


class ReferenceHead:
    """The head in torch over transformers' decoder layers and target features."""

    def __init__(self, head_dir: Path, hf_target: Path):
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float32).eval()
        self.embed = self.target.get_input_embeddings().weight.detach()
        self.head = self.target.get_output_embeddings().weight.detach()
        hf = AutoModelForCausalLM.from_pretrained(head_dir.parent / "hf", dtype=torch.float32)
        self.rotary, self.eps = hf.model.rotary_emb, hf.config.rms_norm_eps
        self.native = (head_dir / "params.json").is_file()
        if self.native:  # Mistral: the HF head's layers and norm, `eagle_linear` as fc
            self.layers, norm = list(hf.model.layers), hf.model.norm.weight.detach()
            w = load_file(head_dir / "consolidated.safetensors")
            self.w = {"fc.weight": w["eagle_linear.weight"], "norm.weight": norm}
        else:  # DeepSeek: the HF model's last layers (indices L, L + 1), fc and norms
            self.layers = list(hf.model.layers)[-HEAD_LAYERS:]
            self.w = load_file(head_dir / "model.safetensors")

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        w, n = self.w, len(next_tokens)
        e = self.embed[torch.tensor(next_tokens)]
        if not self.native:
            e, feats = rms(e, w["enorm.weight"], self.eps), rms(feats, w["hnorm.weight"], self.eps)
        x = (torch.cat([e, feats], -1) @ w["fc.weight"].T)[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, pos)
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return rms(x[0], w["norm.weight"], self.eps)

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        hidden = self.target.model(torch.tensor([seq[:c]])).last_hidden_state[0]
        return teacher_forced_drafts(self.run, hidden, seq, c, self.head)


def test_drafts_are_the_heads_teacher_forced_predictions(pair, monkeypatch):
    target, hf_target, head = pair
    reference = ReferenceHead(head, hf_target).drafts
    assert_drafts_match_reference(
        monkeypatch, FinalHiddenRunner, target, EAGLE_PROMPTS, eagle_spec(head, 2), reference
    )


def _edit_config(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **fields}))
    return dst


def test_refusals_by_name(tmp_path):
    target = write_tiny_model(tmp_path / "target", "deepseek_v3", seed=3)
    head = write_deepseek_eagle_head(tmp_path / "ds", target, seed=4)
    wide = write_tiny_model(tmp_path / "wide", "deepseek_v3", hidden_size=96)
    with pytest.raises(ValueError, match=r"head's hidden_size 64 differs from the target's 96"):
        LLM(str(wide), speculative_config=eagle_spec(head, 2))
    vocab = _edit_config(head, tmp_path / "vocab", vocab_size=1000)
    with pytest.raises(ValueError, match=r"head's vocab_size 1000 differs from the target's"):
        LLM(str(target), speculative_config=eagle_spec(vocab, 2))
    v32 = _edit_config(head, tmp_path / "v32", model_type="deepseek_v32")
    with pytest.raises(ValueError, match=r"model_type 'deepseek_v32'.*not supported"):
        LLM(str(target), speculative_config=eagle_spec(v32, 2))
    broken = tmp_path / "broken"
    shutil.copytree(head, broken)
    w = load_file(head / "model.safetensors")
    save_file({k: v for k, v in w.items() if k != "fc.weight"}, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"EAGLE checkpoint lacks \['fc.weight'\]"):
        LLM(str(target), speculative_config=eagle_spec(broken, 2))
    hf_mistral = write_tiny_model(tmp_path / "m4", "mistral4")
    with pytest.raises(ValueError, match=r"Mistral 4 EAGLE head in Hugging Face's format"):
        LLM(
            str(write_tiny_model(tmp_path / "m4t", "mistral4")),
            speculative_config=eagle_spec(hf_mistral, 2),
        )
