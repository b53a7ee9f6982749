"""Speculative decoding with an EAGLE-1 head for MiniCPM (models/minicpm_eagle.py, vLLM's
`EagleMiniCPMForCausalLM`).

- The target: a tiny Granite checkpoint served as `MiniCPMForCausalLM` (its config with
  MiniCPM's scale_emb / scale_depth / dim_model_base only; test_models_llama_variants.py checks
  that pairing against HF Granite).
- Greedy with speculation token-identical to plain decoding (logprobs within 1e-4), k in {1, 3}.
- Every step's drafts 1 and 2 equal the head run in torch (transformers' Granite decoder layers,
  whose residual and attention scalars are MiniCPM's, over fc([norm1(embed * scale_emb),
  norm2(feature)]), divided by hidden / dim_model_base, through the LM head without a norm) on
  transformers' target features, teacher-forced; the head's scalars differ from the target's,
  and the head's own embedding / LM head serve when its checkpoint has them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from draft_heads import (
    EAGLE_PROMPTS,
    assert_drafts_match_reference,
    assert_greedy_identical_with_drafts,
    eagle_spec,
    full_sequences,
    rms,
    run_llm,
    teacher_forced_drafts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.eagle import FinalHiddenRunner
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

LAYERS, HIDDEN, HEADS = 2, 64, 4
# the head's own MiniCPM scalars (the target's: scale_emb 12, scale_depth 1.4, base 16)
HEAD_SCALARS = {"scale_emb": 3.0, "scale_depth": 1.7, "dim_model_base": 32}


def write_minicpm_target(path: Path) -> Path:
    granite = {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 1.4 / LAYERS**0.5,
        "attention_multiplier": (HIDDEN // HEADS) ** -0.5,
        "logits_scaling": HIDDEN / 16,
    }
    path = write_tiny_model(path, "granite", seed=5, **granite)
    data = json.loads((path / "config.json").read_text())
    for name in granite:
        data.pop(name, None)
    data |= {"model_type": "llama", "architectures": ["MiniCPMForCausalLM"]}
    data |= {"scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 16}
    (path / "config.json").write_text(json.dumps(data))
    return path


def write_minicpm_eagle_head(
    path: Path, target: Path, *, own: bool = False, mup: int | None = None, arch: str = ""
) -> Path:
    """A head in vLLM's layout (`model.fc`, `model.input_norm1/2`, `model.eagle_layers.{i}`,
    an unused `model.norm`); `own`: with its own `model.embed_tokens` and `lm_head`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    path.mkdir(parents=True, exist_ok=True)
    tc = json.loads((target / "config.json").read_text())
    v, d = int(tc["vocab_size"]), HIDDEN
    extra = {} if mup is None else {"mup_denominator": mup}
    config = LlamaConfig(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        **HEAD_SCALARS,
        **extra,
    )
    config.architectures = [arch or "MiniCPMForCausalLM"]
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    out = {"model.fc.weight": torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5}
    for name in ("input_norm1", "input_norm2", "norm"):
        out[f"model.{name}.weight"] = 1.0 + torch.randn(d, generator=gen) * 0.1
    for name, t in sorted(LlamaDecoderLayer(config, 0).state_dict().items()):
        scale = t.shape[-1] ** -0.5 if t.dim() >= 2 else 0.1
        w = torch.randn(t.shape, generator=gen) * scale
        out[f"model.eagle_layers.0.{name}"] = w if t.dim() >= 2 else 1.0 + w
    if own:
        # rows small enough that rms_norm_eps counts in input_norm1: scale_emb shows through it
        out["model.embed_tokens.weight"] = torch.randn((v, d), generator=gen) * 0.003
        out["lm_head.weight"] = torch.randn((v, d), generator=gen) * d**-0.5
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors")
    return path


class ReferenceMiniCPMEagle:
    """The head in torch with transformers' Granite layers, over transformers' Granite target."""

    def __init__(self, head_dir: Path, target_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, GraniteConfig, LlamaConfig
        from transformers.models.granite.modeling_granite import (
            GraniteDecoderLayer,
            GraniteRotaryEmbedding,
        )

        hc = LlamaConfig.from_pretrained(head_dir)
        self.w = w = load_file(head_dir / "model.safetensors")
        granite_cfg = json.loads((target_dir / "config.json").read_text())
        granite_cfg |= {"model_type": "granite", "architectures": ["GraniteForCausalLM"]}
        granite_cfg |= {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 1.4 / LAYERS**0.5,
            "attention_multiplier": (HIDDEN // HEADS) ** -0.5,
            "logits_scaling": HIDDEN / 16,
        }
        granite_cfg.pop("model_type")
        self.target = AutoModelForCausalLM.from_pretrained(
            target_dir, config=GraniteConfig(**granite_cfg), dtype=torch.float32
        ).eval()
        self.embed = w.get("model.embed_tokens.weight", self.target.get_input_embeddings().weight)
        self.head = w.get("lm_head.weight", self.target.get_output_embeddings().weight)
        denominator = getattr(hc, "mup_denominator", None) or hc.num_hidden_layers
        lc = GraniteConfig(
            **{k: getattr(hc, k) for k in ("hidden_size", "intermediate_size", "rms_norm_eps")},
            num_attention_heads=hc.num_attention_heads,
            num_key_value_heads=hc.num_key_value_heads,
            max_position_embeddings=hc.max_position_embeddings,
            residual_multiplier=hc.scale_depth / math.sqrt(denominator),
            attention_multiplier=(hc.hidden_size // hc.num_attention_heads) ** -0.5,
        )
        self.layer = GraniteDecoderLayer(lc, 0).eval()
        prefix = "model.eagle_layers.0."
        self.layer.load_state_dict(
            {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}
        )
        self.rotary = GraniteRotaryEmbedding(lc)
        self.cfg = hc

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        w, n, eps = self.w, len(next_tokens), self.cfg.rms_norm_eps
        e = self.embed[torch.tensor(next_tokens)].detach() * self.cfg.scale_emb
        e, f = (
            rms(e, w["model.input_norm1.weight"], eps),
            rms(feats, w["model.input_norm2.weight"], eps),
        )
        x = (torch.cat([e, f], -1) @ w["model.fc.weight"].T)[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(
            x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, pos)
        )
        x = out[0] if isinstance(out, tuple) else out
        return x[0] / (self.cfg.hidden_size / self.cfg.dim_model_base)

    @torch.no_grad()
    def first_logits(self, seq: list[int], c: int) -> torch.Tensor:
        """The head's logits [V] for draft 1 of the step whose row runs seq[c] at c."""
        out = self.target(torch.tensor([seq[:c]]), output_hidden_states=True)
        return self.run(seq[1 : c + 1], out.hidden_states[-1][0])[-1] @ self.head.detach().T

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        out = self.target(torch.tensor([seq[:c]]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # the final normed hidden states (the LM head's input)
        return teacher_forced_drafts(self.run, hidden, seq, c, self.head.detach())


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_minicpm_target(tmp_path_factory.mktemp("minicpm") / "target")


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(target, tmp_path, k):
    head = write_minicpm_eagle_head(tmp_path / "head", target)
    assert_greedy_identical_with_drafts(target, EAGLE_PROMPTS, eagle_spec(head, k), 16)


@pytest.mark.parametrize(
    "variant",
    [{}, {"own": True}, {"mup": 3, "arch": "EagleMiniCPMForCausalLM"}],
    ids=["shared", "own", "mup"],
)
def test_drafts_are_the_heads_teacher_forced_predictions(target, variant, monkeypatch, tmp_path):
    head = write_minicpm_eagle_head(tmp_path / "head", target, **variant)
    reference = ReferenceMiniCPMEagle(head, target).drafts
    assert_drafts_match_reference(
        monkeypatch, FinalHiddenRunner, target, EAGLE_PROMPTS, eagle_spec(head, 2), reference
    )


def test_refusals(target, tmp_path):
    head = write_minicpm_eagle_head(tmp_path / "head", target)
    raw = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(raw | {"num_experts": 4}))
    with pytest.raises(ValueError, match="'num_experts' > 0"):
        LLM(str(target), speculative_config=eagle_spec(head, 2))
    (head / "config.json").write_text(json.dumps(raw | {"hidden_act": "fatrelu"}))
    with pytest.raises(ValueError, match="'hidden_act'='fatrelu' is not supported"):
        LLM(str(target), speculative_config=eagle_spec(head, 2))
    (head / "config.json").write_text(json.dumps(raw))
    w = load_file(head / "model.safetensors")
    save_file({k: v for k, v in w.items() if "input_norm2" not in k}, head / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"MiniCPM EAGLE checkpoint lacks \['input_norm2.weight'\]"
    ):
        LLM(str(target), speculative_config=eagle_spec(head, 2))


def test_sampled_drafts_carry_the_heads_probabilities(target, monkeypatch, tmp_path):
    """A sampled request's q of draft 1 is softmax of the head's logits: their scale
    (hidden / dim_model_base) shows here, never in a greedy draft; so does scale_emb, with the
    head's own embedding rows small enough for rms_norm_eps to count."""
    head = write_minicpm_eagle_head(tmp_path / "head", target, own=True)
    seen: list[tuple[tuple, int, torch.Tensor]] = []
    propose = FinalHiddenRunner.propose

    def recording(self, sched, cached, inputs):
        proposal = propose(self, sched, cached, inputs)
        for c, start in zip(cached, sched.start_positions):
            if c.seq_id in proposal.tokens and proposal.probs is not None:
                q = proposal.probs[proposal.offsets[c.seq_id]].clone()
                seen.append((tuple(c.token_ids[: c.num_prompt_tokens]), start, q))
        return proposal

    monkeypatch.setattr(FinalHiddenRunner, "propose", recording)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    _, outs = run_llm(target, EAGLE_PROMPTS[:2], params, speculative_config=eagle_spec(head, 1))
    full = full_sequences(EAGLE_PROMPTS[:2], outs)
    reference = ReferenceMiniCPMEagle(head, target)
    checked = 0
    for prompt, c, q in seen:
        seq = full[prompt]
        if c + 1 >= len(seq):
            continue
        want = torch.softmax(reference.first_logits(seq, c), -1)
        torch.testing.assert_close(q, want, atol=1e-5, rtol=1e-4)
        checked += 1
    assert checked >= 4
