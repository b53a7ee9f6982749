"""Speculative decoding with MiMo-7B's own MTP layer (models/mimo_mtp.py): exact, and the
layer drafts what vLLM's MiMo MTP layer computes.

The tiny target is transformers' Qwen2 saved as a MiMo release: architectures
["MiMoForCausalLM"], `num_nextn_predict_layers`, untied LM head, and the MTP layers under the
release's names `model.mtp_layers.{i}.*` (a Qwen2 decoder block, `token_layernorm`,
`hidden_layernorm`, `input_proj`, `final_layernorm`). Its model_type stays "qwen2": the
release's "mimo" is read by its remote config code (a Qwen2Config with the layer count), which
needs trust_remote_code.

- Greedy: token-identical to plain decoding (logprobs within 1e-4), k in {1, 2}.
- The drafts are the layer's: every step's drafts 1 and 2 equal a reference built from
  transformers' Qwen2DecoderLayer (the checkpoint's mtp_layers.0 block) with the rest in plain
  torch, run over the target's pre-norm final hidden states, teacher-forced. With two MTP
  layers in the checkpoint the first serves every pass, as in vLLM.
- A layer that agrees with its target by construction has every draft accepted.
- Without num_speculative_tokens the layer count serves; refused by name: a count above the
  layer count that is not a multiple of it (as vLLM), a checkpoint declaring no MTP layer, one
  missing the layer's tensors, a sliding-window config (no MiMo-7B release has one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draft_heads import (
    MTP_PROMPTS,
    assert_drafts_match_reference,
    assert_every_draft_accepted,
    assert_greedy_identical_with_drafts,
    mtp_spec,
    rms,
    run_llm,
    teacher_forced_drafts,
)

from paged_engine import SamplingParams
from paged_engine.spec_decode.eagle import FeatureHeadRunner
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

_OWN = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


def write_mimo_target(path: Path, num_mtp: int = 1, *, seed: int = 0) -> Path:
    """A tiny Qwen2 saved as MiMo-7B is released, with `num_mtp` MTP layers: each a decoder
    block (layer 1's tensors plus noise), its three norms and input_proj [D, 2D]."""
    path = write_tiny_model(
        path, "qwen2", seed=seed, tie_word_embeddings=False, num_nextn_predict_layers=num_mtp
    )
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["MiMoForCausalLM"]}))
    weights = load_file(path / "model.safetensors")
    d = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    extra = {}
    for i in range(num_mtp):
        dst = f"model.mtp_layers.{i}."
        for name, w in weights.items():
            if name.startswith("model.layers.1."):
                noise = torch.randn(w.shape, generator=gen) * 0.3 * float(w.std() or 0.1)
                extra[dst + name[len("model.layers.1.") :]] = w + noise
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            extra[f"{dst}{norm}.weight"] = 1.0 + 0.2 * torch.randn(d, generator=gen)
        extra[f"{dst}input_proj.weight"] = torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_mimo_target(tmp_path_factory.mktemp("mimo-mtp") / "target")


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_is_token_identical(target, k):
    assert_greedy_identical_with_drafts(target, MTP_PROMPTS, mtp_spec(k), 16)


# ---- the reference: transformers' Qwen2 decoder layer, the rest in plain torch -----------------
class ReferenceMiMoMtp:
    """MiMo's MTP layer 0 over the target's pre-norm final hidden states (vLLM's
    MiMoMultiTokenPredictorLayer): the block is transformers' Qwen2DecoderLayer."""

    def __init__(self, target_dir: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen2.modeling_qwen2 import (
            Qwen2DecoderLayer,
            Qwen2RotaryEmbedding,
        )

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        config = self.target.config
        w = load_file(target_dir / "model.safetensors")
        prefix = "model.mtp_layers.0."
        own = {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
        self.block = Qwen2DecoderLayer(config, 0).eval()
        self.block.load_state_dict({k: v for k, v in own.items() if not k.startswith(_OWN)})
        self.rotary = Qwen2RotaryEmbedding(config)
        self.w, self.eps = own, config.rms_norm_eps
        self.embed, self.head = w["model.embed_tokens.weight"], w["lm_head.weight"]
        self._pre_norm: list[torch.Tensor] = []
        self.target.model.norm.register_forward_pre_hook(
            lambda _, args: self._pre_norm.append(args[0])
        )

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor):
        """(logits, the next pass's feature) of entries p = 0..n-1 at positions p."""
        n = len(next_tokens)
        pos = torch.arange(n)
        e = self.embed[torch.tensor(next_tokens)].clone()
        e[pos == 0] = 0  # no token precedes position 0
        h = rms(feats, self.w["hidden_layernorm.weight"], self.eps)
        x = torch.cat([h, rms(e, self.w["token_layernorm.weight"], self.eps)], -1)  # feature 1st
        x = (x @ self.w["input_proj.weight"].T)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.block(
            x,
            attention_mask=mask,
            position_ids=pos[None],
            position_embeddings=self.rotary(x, pos[None]),
        )
        out = rms(
            (out[0] if isinstance(out, tuple) else out)[0],
            self.w["final_layernorm.weight"],
            self.eps,
        )
        return out @ self.head.T, out

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        """Drafts 1 and 2 of a step whose row runs its own token seq[c] at position c."""
        self._pre_norm.clear()
        self.target.model(torch.tensor([seq[:c]]))
        hidden = self._pre_norm[-1][0]  # [c, D]: the stream entering the final norm
        return teacher_forced_drafts(self.run, hidden, seq, c)


@pytest.mark.parametrize("num_mtp", [1, 2])
def test_drafts_are_the_layers_teacher_forced_predictions(num_mtp, monkeypatch, tmp_path):
    path = write_mimo_target(tmp_path / "target", num_mtp, seed=num_mtp)
    reference = ReferenceMiMoMtp(path).drafts
    assert_drafts_match_reference(
        monkeypatch, FeatureHeadRunner, path, MTP_PROMPTS, mtp_spec(2), reference
    )


def test_a_layer_that_agrees_with_its_target_has_every_draft_accepted(tmp_path):
    """Attention and MLP outputs zeroed everywhere: the target's next token is a function of
    its current one, and an MTP layer that reads only the embedding (input_proj = [0 | I]) and
    norms it as the target does predicts it; so every draft (k = 2: the layer's second pass
    on its own draft too) is accepted, and the output stays the plain engine's. (Prompts of
    more than one token: at position 0 the layer reads a zeroed embedding.)"""
    path = write_mimo_target(tmp_path / "agree")
    w = load_file(path / "model.safetensors")
    d = w["model.norm.weight"].shape[0]
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
        if name.endswith(("model.norm.weight", "token_layernorm.weight", "final_layernorm.weight")):
            w[name] = torch.ones_like(w[name])
    w["model.mtp_layers.0.input_proj.weight"] = torch.cat([torch.zeros(d, d), torch.eye(d)], 1)
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    assert_every_draft_accepted(path, MTP_PROMPTS[:2], mtp_spec(2))


def test_count_defaults_and_refusals(target, tmp_path):
    one = SamplingParams(max_tokens=4)
    llm, _ = run_llm(target, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(None))
    assert llm.llm_engine.config.speculative_config["num_speculative_tokens"] == 1
    two = write_mimo_target(tmp_path / "two", 2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 must be a multiple of .* 2"):
        run_llm(two, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(3))
    none = write_mimo_target(tmp_path / "none", 0)
    with pytest.raises(ValueError, match=r"has no MTP layer .*num_nextn_predict_layers"):
        run_llm(none, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"model\.mtp_layers\.0\.\* lacks"):
        run_llm(none, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    config = json.loads((target / "config.json").read_text())
    sliding = write_mimo_target(tmp_path / "sliding")
    (sliding / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ValueError, match=r"MTP layer with use_sliding_window"):
        run_llm(sliding, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
