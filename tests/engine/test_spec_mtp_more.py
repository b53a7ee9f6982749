"""Speculative decoding with ERNIE 4.5 MoE's and LongCat-Flash's own MTP layers
(models/mtp_more.py): exact, and the layer drafts what it should.

The tiny targets are transformers' models with the MTP tensors added under the releases' names:
ERNIE's `model.mtp_{emb_norm,hidden_norm,linear_proj,block}.0.*` (the block: dense layer 0's
tensors plus noise), LongCat's `model.mtp.*` (`layers.0.{enorm.m, hnorm.m, eh_proj}`, an MLA +
dense-MLP block from layer 0's first sublayer plus noise, `norm`, optionally its own
`embed_tokens`).

- Greedy: token-identical to plain decoding (logprobs within 1e-4), k in {1, 2}.
- The drafts are the layer's: every step's drafts 1 and 2 equal, teacher-forced, ERNIE:
  transformers' own `MtpModel` (what `generate(use_mtp=True)` drafts with), its second pass on
  its own output; LongCat: transformers' LongcatFlashMLA / MLP / RMSNorm composed as vLLM's
  layer (the rest in plain torch).
- A layer built to agree with its target has every draft accepted (exact counts).
- Refused by name: a config declaring no MTP layer, a checkpoint lacking the layer's tensors,
  ERNIE's use_bias.
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
from paged_engine.spec_decode.eagle import FinalHiddenRunner
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py


def _noisy(w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return w + torch.randn(w.shape, generator=gen) * 0.3 * float(w.std() or 0.1)


def _norm_weight(d: int, gen: torch.Generator) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(d, generator=gen)


def _save(path: Path, weights: dict, config_fields: dict) -> None:
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **config_fields}))


def write_ernie_target(path: Path, *, seed: int = 0, mtp: bool = True) -> Path:
    """A tiny ERNIE 4.5 MoE (3 layers, MoE from layer 1) with its MTP layer as released."""
    path = write_tiny_model(path, "ernie4_5_moe", seed=seed, use_bias=False)
    w = load_file(path / "model.safetensors")
    d = w["model.embed_tokens.weight"].shape[1]
    gen = torch.Generator().manual_seed(seed + 1)
    if mtp:
        for name, t in list(w.items()):
            if name.startswith("model.layers.0."):  # dense
                w["model.mtp_block.0." + name[len("model.layers.0.") :]] = _noisy(t, gen)
        w["model.mtp_emb_norm.0.weight"] = _norm_weight(d, gen)
        w["model.mtp_hidden_norm.0.weight"] = _norm_weight(d, gen)
        w["model.mtp_linear_proj.0.weight"] = (
            torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5
        )
    w["model.norm.weight"] = _norm_weight(d, gen)  # the MTP layer's post-norm too
    _save(path, w, {"num_nextn_predict_layers": int(mtp)})
    return path


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    return write_ernie_target(tmp_path_factory.mktemp("ernie-mtp") / "target")


@pytest.mark.parametrize("k", [1, 2])
def test_ernie_greedy_is_token_identical(ernie, k):
    assert_greedy_identical_with_drafts(ernie, MTP_PROMPTS, mtp_spec(k), 16)


class _OverFinalHidden:
    """A reference MTP layer over transformers' target (`self.target`): its `run(tokens,
    feats)` -> (logits, features) teacher-forced over the target's final hidden states."""

    target: torch.nn.Module

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        hidden = self.target.model(torch.tensor([seq[:c]])).last_hidden_state[0]
        return teacher_forced_drafts(self.run, hidden, seq, c)


class ReferenceErnieMtp(_OverFinalHidden):
    """transformers' MtpModel for the target (the MTP layer with the target's final norm as its
    post-norm and the target's embedding and head), teacher-forced; its positions are ours
    plus one, as transformers' assisted decoding feeds it."""

    def __init__(self, target_dir: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_layers import MtpModel

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.mtp = MtpModel.from_pretrained(self.target).eval()

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor):
        pos = torch.arange(1, len(next_tokens) + 1)[None]
        out = self.mtp.forward_layer(
            0, feats[None], pos, None, input_ids=torch.tensor([next_tokens])
        )
        return self.mtp._project_to_logits(out)[0], out[0]


def test_ernie_drafts_are_the_layers_teacher_forced_predictions(ernie, monkeypatch):
    reference = ReferenceErnieMtp(ernie).drafts
    assert_drafts_match_reference(
        monkeypatch, FinalHiddenRunner, ernie, MTP_PROMPTS, mtp_spec(2), reference
    )


# ---- LongCat-Flash ------------------------------------------------------------------------------
def write_longcat_target(path: Path, *, own_embed: bool = False, mtp: bool = True) -> Path:
    """A tiny LongCat-Flash (2 layers of two MLA sublayers) with its MTP layer as released under
    `model.mtp.*`; its config leaves num_nextn_predict_layers out (1, as vLLM reads it)."""
    path = write_tiny_model(path, "longcat_flash")
    w = load_file(path / "model.safetensors")
    vocab, d = w["model.embed_tokens.weight"].shape
    gen = torch.Generator().manual_seed(7)
    if mtp:
        src, dst = "model.layers.0.", "model.mtp.layers.0."
        for name, t in list(w.items()):
            if not name.startswith(src):
                continue
            rest = name[len(src) :]
            for ours, theirs in (
                ("input_layernorm.0.", "input_layernorm."),
                ("post_attention_layernorm.0.", "post_attention_layernorm."),
                ("self_attn.0.", "self_attn."),
                ("mlps.0.", "transformer_layer.mlp."),
            ):
                if rest.startswith(ours):
                    w[dst + theirs + rest[len(ours) :]] = _noisy(t, gen)
        w[dst + "enorm.m.weight"] = _norm_weight(d, gen)
        w[dst + "hnorm.m.weight"] = _norm_weight(d, gen)
        w[dst + "eh_proj.weight"] = torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5
        w["model.mtp.norm.weight"] = _norm_weight(d, gen)
        if own_embed:
            w["model.mtp.embed_tokens.weight"] = torch.randn((vocab, d), generator=gen) * 0.5
    _save(path, w, {})
    return path


@pytest.fixture(scope="module", params=["shared-embed", "own-embed"])
def longcat(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"longcat-mtp-{request.param}") / "target"
    return write_longcat_target(path, own_embed=request.param == "own-embed")


@pytest.mark.parametrize("k", [1, 2])
def test_longcat_greedy_is_token_identical(longcat, k):
    assert_greedy_identical_with_drafts(longcat, MTP_PROMPTS, mtp_spec(k), 16)


class ReferenceLongcatMtp(_OverFinalHidden):
    """vLLM's LongCat MTP layer: transformers' LongcatFlashMLA, LongcatFlashMLP and rotary
    embedding as the block (pre-norm, residuals), the rest in plain torch."""

    def __init__(self, target_dir: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.longcat_flash.modeling_longcat_flash import (
            LongcatFlashMLA,
            LongcatFlashMLP,
            LongcatFlashRotaryEmbedding,
        )

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        config = self.target.config
        config._attn_implementation = "eager"
        w = load_file(target_dir / "model.safetensors")
        prefix = "model.mtp.layers.0."
        own = {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}

        def part(p: str) -> dict:
            return {k[len(p) :]: v for k, v in own.items() if k.startswith(p)}

        self.attn = LongcatFlashMLA(config, 0).eval()
        self.attn.load_state_dict(part("self_attn."))
        self.mlp = LongcatFlashMLP(config).eval()
        self.mlp.load_state_dict(part("transformer_layer.mlp."))
        self.rotary = LongcatFlashRotaryEmbedding(config)
        self.w, self.eps = own, config.rms_norm_eps
        self.final = w["model.mtp.norm.weight"]
        self.embed = w.get("model.mtp.embed_tokens.weight", w["model.embed_tokens.weight"])
        self.head = w["lm_head.weight"]

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor):
        n = len(next_tokens)
        pos = torch.arange(n)[None]
        e = self.embed[torch.tensor(next_tokens)]  # nothing zeroed at position 0
        x = torch.cat(
            [
                rms(e, self.w["enorm.m.weight"], self.eps),
                rms(feats, self.w["hnorm.m.weight"], self.eps),
            ],
            -1,
        )
        x = (x @ self.w["eh_proj.weight"].T)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a, _ = self.attn(
            rms(x, self.w["input_layernorm.weight"], self.eps),
            position_embeddings=self.rotary(x, pos),
            attention_mask=mask,
        )
        x = x + a
        x = x + self.mlp(rms(x, self.w["post_attention_layernorm.weight"], self.eps))
        out = rms(x[0], self.final, self.eps)
        return out @ self.head.T, out


def test_longcat_drafts_are_the_layers_teacher_forced_predictions(longcat, monkeypatch):
    reference = ReferenceLongcatMtp(longcat).drafts
    assert_drafts_match_reference(
        monkeypatch, FinalHiddenRunner, longcat, MTP_PROMPTS, mtp_spec(2), reference
    )


# ---- both ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["ernie", "longcat"])
def test_a_layer_that_agrees_with_its_target_has_every_draft_accepted(family, tmp_path):
    """Attention and MLP outputs zeroed everywhere (LongCat's zero experts only rescale the
    stream, which the final norm undoes): the target's next token is a function of its current
    one, and an MTP layer that reads only the embedding (its projection [I | 0]) and norms it
    as the target does predicts it; so every draft (k = 2: the second pass on its own draft
    too) is accepted, and the output stays the plain engine's."""
    write = write_ernie_target if family == "ernie" else write_longcat_target
    path = write(tmp_path / "agree")
    w = load_file(path / "model.safetensors")
    d = w["model.embed_tokens.weight"].shape[1]
    proj = (
        "model.mtp_linear_proj.0.weight"
        if family == "ernie"
        else "model.mtp.layers.0.eh_proj.weight"
    )
    for name in w:
        if "o_proj" in name or "down_proj" in name:
            w[name] = torch.zeros_like(w[name])
        elif "norm" in name and "q_a_" not in name and "kv_a_" not in name:
            w[name] = torch.ones_like(w[name])
    w[proj] = torch.cat([torch.eye(d), torch.zeros(d, d)], 1)
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    assert_every_draft_accepted(path, MTP_PROMPTS[:2], mtp_spec(2))


def test_count_defaults_and_refusals(tmp_path):
    one = SamplingParams(max_tokens=4)
    lc = write_longcat_target(tmp_path / "lc")  # num_nextn_predict_layers absent: 1
    llm, _ = run_llm(lc, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(None))
    assert llm.llm_engine.config.speculative_config["num_speculative_tokens"] == 1
    bare = write_longcat_target(tmp_path / "lc-bare", mtp=False)
    with pytest.raises(ValueError, match=r"model\.mtp\.\* lacks"):
        run_llm(bare, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"has no MTP layer"):
        run_llm(bare, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    none = write_ernie_target(tmp_path / "ernie-none", mtp=False)
    with pytest.raises(ValueError, match=r"has no MTP layer .*num_nextn_predict_layers"):
        run_llm(none, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"model\.mtp_\*\.0 lacks"):
        run_llm(none, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
    biased = write_ernie_target(tmp_path / "ernie-bias")
    config = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**config, "use_bias": True}))
    with pytest.raises(ValueError, match=r"MTP layer with use_bias true"):
        run_llm(biased, MTP_PROMPTS[:1], one, speculative_config=mtp_spec(1))
