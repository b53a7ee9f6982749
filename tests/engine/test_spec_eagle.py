"""Speculative decoding with an EAGLE-1 head: exact, and the head drafts what it should.

- Greedy token-identical to plain decoding (logprobs within 1e-4) on Llama, Qwen3 and GPT-2
  targets (an EAGLE-1 head reads only the final hidden state: any target serves), k in {1, 3}.
- Every step's drafts 1 and 2 equal transformers' own Llama decoder layer (its input norm taken
  out, as EAGLE's first layer has none) over fc([embedding, feature]) with the target's final
  hidden states from transformers, through the target's LM head without a norm, teacher-forced;
  with and without fc's bias, with HASS's input norms, with two layers.
- A head named "...EAGLE-..." without a method is taken as one (vLLM's rule); refusals by name.
"""

from __future__ import annotations

import json

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

from paged_engine import LLM
from paged_engine.spec_decode.eagle import FinalHiddenRunner
from paged_engine.testing import write_tiny_eagle3_head, write_tiny_eagle_head, write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"eagle-{request.param}")
    target = write_tiny_model(d / "target", request.param)
    return target, write_tiny_eagle_head(d / "head", target, seed=1)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(pair, k):
    target, head = pair
    assert_greedy_identical_with_drafts(target, EAGLE_PROMPTS, eagle_spec(head, k), 16)


class ReferenceEagle:
    """The head as transformers' Llama layers run it, over transformers' target."""

    def __init__(self, head_dir, target_dir):
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        self.cfg = cfg = LlamaConfig.from_pretrained(head_dir)
        self.w = w = load_file(head_dir / "model.safetensors")
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.embed = self.target.get_input_embeddings().weight.detach()
        self.head = self.target.get_output_embeddings().weight.detach()
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            layer = LlamaDecoderLayer(cfg, i).eval()
            if i == 0:
                layer.input_layernorm = torch.nn.Identity()
            prefix = f"layers.{i}."
            layer.load_state_dict(
                {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
            )
            self.layers.append(layer)
        self.rotary = LlamaRotaryEmbedding(cfg)

    def _final_hidden(self, tokens: list[int]) -> torch.Tensor:
        out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        return out.hidden_states[-1][0]  # the final normed hidden states (the LM head's input)

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        w, n = self.w, len(next_tokens)
        e = self.embed[torch.tensor(next_tokens)]
        if self.cfg.add_para_norm:
            e = rms(e, w["embedding_layernorm.weight"], self.cfg.rms_norm_eps)
            feats = rms(feats, w["hidden_states_layernorm.weight"], self.cfg.rms_norm_eps)
        x = torch.cat([e, feats], -1) @ w["fc.weight"].T + w.get("fc.bias", 0.0)
        x = x[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, pos)
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x[0]

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        return teacher_forced_drafts(self.run, self._final_hidden(seq[:c]), seq, c, self.head)


@pytest.mark.parametrize(
    "variant", [{}, {"bias": False}, {"para_norm": True}, {"num_layers": 2}], ids=str
)
def test_drafts_are_the_heads_teacher_forced_predictions(variant, monkeypatch, tmp_path):
    target = write_tiny_model(tmp_path / "target", "llama")
    head = write_tiny_eagle_head(tmp_path / "head", target, seed=2, **variant)
    reference = ReferenceEagle(head, target).drafts
    assert_drafts_match_reference(
        monkeypatch, FinalHiddenRunner, target, EAGLE_PROMPTS, eagle_spec(head, 2), reference
    )


def test_method_from_the_name_and_refusals(tmp_path):
    target = write_tiny_model(tmp_path / "target", "llama")
    head = write_tiny_eagle_head(tmp_path / "EAGLE-tiny-llama", target)
    llm = LLM(str(target), speculative_config={"model": str(head), "num_speculative_tokens": 2})
    assert llm.llm_engine.config.speculative_config["method"] == "eagle"
    wide = write_tiny_model(tmp_path / "wide", "llama", hidden_size=96)
    with pytest.raises(ValueError, match=r"hidden_size 64 differs from the target's 96"):
        LLM(str(wide), speculative_config=eagle_spec(head, 2))
    eagle3 = write_tiny_eagle3_head(tmp_path / "e3", target)
    with pytest.raises(ValueError, match=r"is an EAGLE-3 head: use method 'eagle3'"):
        LLM(str(target), speculative_config=eagle_spec(eagle3, 2))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((head / "config.json").read_text())
    from safetensors.torch import save_file

    w = load_file(head / "model.safetensors")
    save_file({k: v for k, v in w.items() if k != "fc.weight"}, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"EAGLE checkpoint lacks \['fc.weight'\]"):
        LLM(str(target), speculative_config=eagle_spec(broken, 2))
    assert json.loads((head / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
