"""Gemma 4 with its assistant drafting (speculative_config method "gemma4_assistant").

- Every step's drafts (k = 3) equal what transformers' own candidate generator
  (`SinglePositionMultiTokenCandidateGenerator` over `Gemma4AssistantForCausalLM`) proposes after
  its target prefilled the verified prefix, and the first step's draft logits match it within
  1e-3; with the LM head and with the masked centroid embedder. The target (tiny "gemma4": KV
  sharing, per-layer inputs) lends its last sliding layer's KV from layer 3 and its last full
  layer's from layer 2; prompts longer than the assistant's window + 1 (9) and shorter.
- Greedy output token-identical to the plain engine (logprobs within 1e-4), k in {1, 3}.
- An assistant that agrees with the target by construction gets every draft accepted.
- The method from the assistant's config where none is given; refusals by name: a vocab or
  backbone width other than the target's, a target that is not Gemma 4, a checkpoint that is
  not an assistant.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from draft_heads import assert_greedy_identical_with_drafts, record_drafts, run_llm

from paged_engine import LLM, SamplingParams
from paged_engine.models.gemma4_assistant import Gemma4AssistantForCausalLM
from paged_engine.spec_decode.gemma4_assistant import Gemma4AssistantRunner
from paged_engine.testing import _randomize, tiny_config, write_tiny_model

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

pytest.importorskip("transformers.models.gemma4_assistant")

PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] + [3] * 6},
    {"prompt_token_ids": list(range(100, 113))},
    {"prompt_token_ids": [7, 300, 41, 9, 2]},
]


def _spec(assistant: Path, k: int) -> dict:
    return {"method": "gemma4_assistant", "model": str(assistant), "num_speculative_tokens": k}


def write_assistant(
    path: Path, target: Path, *, seed: int = 1, ordered: bool = False, agree: bool = False, **text
) -> Path:
    """A tiny assistant for `target`: two layers (sliding window 8, then full), width 32 over
    the target's 64; `ordered`: the centroid embedder (16 centroids, top 4) over a random
    token order; `agree`: `agreeing_target`'s drafter (width 64, no attention or MLP output,
    `pre_projection` passing the token embedding, the target's final norm and embedding as its
    own), whose every draft is the target's next token."""
    from safetensors.torch import load_file
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    tc = json.loads((target / "config.json").read_text())
    fields = {
        "hidden_size": 64 if agree else 32,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "num_kv_shared_layers": 2,
        "vocab_size": tc["vocab_size"],
        **text,
    }
    config = Gemma4AssistantConfig(
        text_config=tiny_config("gemma4", **fields),
        backbone_hidden_size=tc["hidden_size"],
        num_centroids=16,
        centroid_intermediate_top_k=4,
        use_ordered_embeddings=ordered,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).float().eval()
    with torch.no_grad():
        _randomize(model, seed)
        if ordered:
            gen = torch.Generator().manual_seed(seed)
            perm = torch.randperm(config.text_config.vocab_size, generator=gen)
            model.masked_embedding.token_ordering.copy_(perm)
        if agree:
            w = load_file(target / "model.safetensors")
            eye = torch.eye(tc["hidden_size"])
            model.pre_projection.weight.copy_(torch.cat([eye, torch.zeros_like(eye)], dim=1))
            model.model.norm.weight.copy_(w["model.norm.weight"])
            model.model.embed_tokens.weight.copy_(w["model.embed_tokens.weight"])
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return path


def agreeing_target(path: Path) -> Path:
    """The tiny "gemma4" with no attention, MLP or per-layer-input output and a final norm
    weight of both signs: its next token is a function of the current one only (the final
    norm of its scaled embedding through the tied head), not the current token itself."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(path, "gemma4")
    w = load_file(path / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight", "per_layer_projection.weight")):
            w[name] = torch.zeros_like(w[name])
    gen = torch.Generator().manual_seed(3)
    w["model.norm.weight"] = torch.randn(w["model.norm.weight"].shape, generator=gen)
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("g4a") / "target", "gemma4")


class ReferenceAssistant:
    """transformers' Gemma 4 target and assistant in float32, drafting as `generate` does."""

    def __init__(self, target: Path, assistant: Path, k: int) -> None:
        from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

        kw = {"dtype": torch.float32, "attn_implementation": "eager"}
        self.target = AutoModelForCausalLM.from_pretrained(target, **kw).eval()
        self.assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant, **kw).eval()
        self.assistant.generation_config.num_assistant_tokens = k

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[list[int], torch.Tensor]:
        """The drafts and their logits [k, V] after the target prefilled seq[:c] and picked
        seq[c] (transformers' first drafting round)."""
        from transformers import GenerationConfig
        from transformers.generation.candidate_generator import (
            SinglePositionMultiTokenCandidateGenerator,
        )

        out = self.target(
            torch.tensor([seq[:c]]), output_hidden_states=True, return_shared_kv_states=True
        )
        gen = SinglePositionMultiTokenCandidateGenerator(
            assistant_model=self.assistant,
            target_model_input_embeddings=self.target.get_input_embeddings(),
            generation_config=GenerationConfig(max_length=c + 64),
        )
        ids = torch.tensor([seq[: c + 1]])
        mask = {"attention_mask": torch.ones_like(ids)}
        cand, logits = gen.get_candidates(ids, mask, out, False, 0)
        return cand[0, c + 1 :].tolist(), logits[0]


@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "centroids"])
def test_drafts_match_transformers(target, ordered, monkeypatch, tmp_path):
    assistant = write_assistant(tmp_path / "assistant", target, ordered=ordered)
    seen = record_drafts(monkeypatch, Gemma4AssistantRunner)
    logits: list[torch.Tensor] = []
    compute = Gemma4AssistantForCausalLM.compute_logits

    def recording(self, hidden):
        out = compute(self, hidden)
        logits.append(out.detach().clone())
        return out

    monkeypatch.setattr(Gemma4AssistantForCausalLM, "compute_logits", recording)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    _, outs = run_llm(target, PROMPTS, params, speculative_config=_spec(assistant, 3))
    ref = ReferenceAssistant(target, assistant, 3)
    full = {
        tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + list(o.outputs[0].token_ids)
        for p, o in zip(PROMPTS, outs)
    }
    # the first drafting step: every prompt right after its prefill, passes 1..3 in row order
    assert [c for _, c, _ in seen[:3]] == [len(p["prompt_token_ids"]) for p in PROMPTS]
    for i, (prompt, c, _) in enumerate(seen[:3]):
        _, ref_logits = ref.drafts(full[prompt], c)
        got = torch.stack([logits[j][i] for j in range(3)])
        torch.testing.assert_close(got, ref_logits, atol=1e-3, rtol=0)
    checked = 0
    for prompt, c, got in seen:
        seq = full[prompt]
        if c + 1 < len(seq):
            assert got == ref.drafts(seq, c)[0][: len(got)], (len(prompt), c)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(target, k, tmp_path):
    assistant = write_assistant(tmp_path / "assistant", target, seed=2)
    assert_greedy_identical_with_drafts(target, PROMPTS, _spec(assistant, k), 12)


def test_an_agreeing_assistant_is_accepted(tmp_path):
    target = agreeing_target(tmp_path / "target")
    assistant = write_assistant(tmp_path / "assistant", target, agree=True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    llm, outs = run_llm(target, PROMPTS, params, speculative_config=_spec(assistant, 3))
    # the target never repeats its token, so a row's own token repeated (what a row the
    # drafter cannot serve proposes) is never accepted
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(a != b for seq in tokens for a, b in itertools.pairwise(seq))
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_method_from_the_config_and_refusals(target, tmp_path):
    assistant = write_assistant(tmp_path / "assistant", target)
    llm = LLM(
        str(target), speculative_config={"model": str(assistant), "num_speculative_tokens": 2}
    )
    assert llm.llm_engine.config.speculative_config["method"] == "gemma4_assistant"
    vocab = write_assistant(tmp_path / "vocab", target, vocab_size=256)
    with pytest.raises(ValueError, match=r"vocab_size 256 differs from the target's 512"):
        LLM(str(target), speculative_config=_spec(vocab, 2))
    narrow = write_tiny_model(tmp_path / "narrow", "gemma4", hidden_size=32)
    with pytest.raises(ValueError, match=r"backbone_hidden_size 64 differs from the target's"):
        LLM(str(narrow), speculative_config=_spec(assistant, 2))
    llama = write_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match=r"drafts for Gemma 4 text models .*LlamaForCausalLM"):
        LLM(str(llama), speculative_config=_spec(assistant, 2))
    with pytest.raises(ValueError, match=r"needs a Gemma4AssistantForCausalLM"):
        LLM(str(target), speculative_config=_spec(llama, 2))
