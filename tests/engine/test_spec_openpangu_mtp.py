"""Speculative decoding with openPangu's own MTP layer (models/openpangu_mtp.py): exact, and the
layer drafts what it should.

The tiny target is test_models_openpangu_moe.py's Ultra MoE release (HF DeepSeek-V3 with
sandwich norms and a correction bias, saved under the release's names) with an MTP layer
`model.layers.2.*` (num_mtp_layers 1): enorm, hnorm, eh_proj, shared_head.norm, and a block
from MoE layer 1's tensors plus noise (sandwich norms and `mlp.e_score_correction_bias`
included); embedding and head are the target's.

- Greedy: token-identical to plain decoding (logprobs within 1e-4), k in {1, 2}.
- The drafts are the layer's: every step's drafts 1 and 2 equal a plain-torch run of the layer
  (the reference's block: the HF sandwich layer 1 with the MTP block's weights) over the
  target's final stream BEFORE its final norm (vLLM's OpenPanguModel hands that to its MTP
  layer), teacher-forced.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from draft_heads import (
    MTP_PROMPTS,
    assert_drafts_match_reference,
    assert_greedy_identical_with_drafts,
    mtp_spec,
    rms,
    run_llm,
    teacher_forced_drafts,
)
from test_models_openpangu_moe import _write_openpangu

from paged_engine import SamplingParams
from paged_engine.spec_decode.eagle import FeatureHeadRunner

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

LAYERS = 2  # the tiny target's decoder layers; the MTP layer is model.layers.2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(path, HF reference target, the MTP layer's tensors under their names after L.)"""
    path, hf = _write_openpangu(
        tmp_path_factory.mktemp("openpangu-mtp"),
        43,
        "PanguUltraMoEForCausalLM",
        sandwich=True,
        bias=True,
        release_names=True,
    )
    w = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(43)
    d = w["model.embed_tokens.weight"].shape[1]
    own = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(d, generator=gen),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(d, generator=gen),
        "eh_proj.weight": torch.randn(d, 2 * d, generator=gen) * (2 * d) ** -0.5,
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(d, generator=gen),
    }
    src = f"model.layers.{LAYERS - 1}."
    for name, t in w.items():
        if name.startswith(src):
            noise = torch.randn(t.shape, generator=gen) * 0.3 * float(t.std() or 0.1)
            own[name[len(src) :]] = (t + noise).contiguous()
    mtp = {f"model.layers.{LAYERS}.{k}": v for k, v in own.items()}
    save_file({**w, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 1}))
    return path, hf, own


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_is_token_identical(target, k):
    assert_greedy_identical_with_drafts(target[0], MTP_PROMPTS, mtp_spec(k), 16)


class ReferenceMtp:
    """openPangu's MTP layer in plain torch around the HF sandwich layer (module docstring)."""

    def __init__(self, hf, own: dict[str, torch.Tensor]) -> None:
        self.hf, self.w, self.eps = hf, own, hf.config.rms_norm_eps
        self.block = copy.deepcopy(hf.model.layers[LAYERS - 1])
        experts = hf.config.n_routed_experts
        state = {}
        for name, t in own.items():  # the release's names -> the HF layer's
            if name.startswith("mlp.experts."):
                continue
            state[
                name.replace("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias")
            ] = t
        gate = [own[f"mlp.experts.{e}.gate_proj.weight"] for e in range(experts)]
        up = [own[f"mlp.experts.{e}.up_proj.weight"] for e in range(experts)]
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up)]
        )
        state["mlp.experts.down_proj"] = torch.stack(
            [own[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
        )
        own_keys = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
        state = {k: v for k, v in state.items() if k not in own_keys}
        missing, unexpected = self.block.load_state_dict(state, strict=False)
        assert not unexpected and not [m for m in missing if "rotary" not in m], missing
        self.embed = hf.model.embed_tokens.weight.detach()
        self.head = hf.lm_head.weight.detach()

    @torch.no_grad()
    def stream(self, ids: list[int]) -> torch.Tensor:
        """The target's final stream before its final norm, [n, D]."""
        seen = []
        hook = self.hf.model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
        try:
            self.hf.model(torch.tensor([ids]))
        finally:
            hook.remove()
        return seen[0][0]

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor):
        n = len(next_tokens)
        pos = torch.arange(n)
        e = self.embed[torch.tensor(next_tokens)].clone()
        e[pos == 0] = 0  # no token precedes position 0
        x = torch.cat(
            [
                rms(e, self.w["enorm.weight"], self.eps),
                rms(feats, self.w["hnorm.weight"], self.eps),
            ],
            -1,
        )
        x = (x @ self.w["eh_proj.weight"].T)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.hf.model.rotary_emb(x, pos[None])
        out = self.block(
            x, attention_mask=mask, position_ids=pos[None], position_embeddings=cos_sin
        )
        pre = (out[0] if isinstance(out, tuple) else out)[0]
        return rms(pre, self.w["shared_head.norm.weight"], self.eps) @ self.head.T, pre

    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        hidden = self.stream(seq[:c])
        return teacher_forced_drafts(self.run, hidden, seq, c)


def test_drafts_are_the_layers_teacher_forced_predictions(target, monkeypatch):
    path, hf, own = target
    reference = ReferenceMtp(hf, own).drafts
    assert_drafts_match_reference(
        monkeypatch, FeatureHeadRunner, path, MTP_PROMPTS, mtp_spec(2), reference
    )


def test_refusals(target, tmp_path):
    """No MTP layer declared, and a declared one the checkpoint lacks: refused by name."""
    import shutil

    path = tmp_path / "bare"
    shutil.copytree(target[0], path)
    w = load_file(path / "model.safetensors")
    keep = {k: v for k, v in w.items() if not k.startswith(f"model.layers.{LAYERS}.")}
    save_file(keep, path / "model.safetensors", metadata={"format": "pt"})
    one = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=rf"model\.layers\.{LAYERS} lacks"):
        run_llm(path, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 0}))
    with pytest.raises(ValueError, match="has no MTP layer"):
        run_llm(path, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
