"""Speculative decoding with the target's own MTP layer (DeepSeek-V3's, Qwen3-Next's): exact,
and the layer drafts what it should.

- Greedy: token-identical to plain decoding (logprobs within 1e-4), k in {1, 2}, with the
  layer's own embedding and head or the target's.
- The drafts are the layer's: every step's drafts 1 and 2 equal transformers' own decoder
  layer of the family (the checkpoint's MTP block loaded as the last layer of a model one layer
  longer) run over the projected [embedding, target hidden] with the final hidden states
  transformers gives for the sequence, teacher-forced.
- Tensor parallelism (TP = 2): the plain engine's greedy tokens.
- Without num_speculative_tokens the layer count serves; what is refused, by name.
"""

from __future__ import annotations

import json
import shutil

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
    token_ids,
)

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.eagle import FinalHiddenRunner
from paged_engine.testing import write_tiny_model, write_tiny_mtp_target

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py


@pytest.fixture(
    scope="module", params=["deepseek-own", "deepseek-shared", "glm4_moe", "qwen3_next"]
)
def target(request, tmp_path_factory):
    """DeepSeek-V3 whose MTP layer carries its embedding and head (own) or uses the target's
    (shared); GLM-4.5 (GQA with partial rope and q/k norms over DeepSeek's MoE); Qwen3-Next (4
    hybrid layers: Gated DeltaNet and gated attention; `mtp.*`)."""
    path = tmp_path_factory.mktemp(f"mtp-{request.param}") / "target"
    if request.param in ("glm4_moe", "qwen3_next"):
        return write_tiny_mtp_target(path, request.param)
    own = request.param == "deepseek-own"
    return write_tiny_mtp_target(path, own_embed=own, own_head=own)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_is_token_identical(target, k):
    assert_greedy_identical_with_drafts(target, MTP_PROMPTS, mtp_spec(k), 16)


# ---- the reference: transformers' DeepSeek-V3 layer --------------------------------------------
class ReferenceMtp:
    """The MTP layer as transformers runs its decoder layer: the checkpoint's MTP block loaded
    as layer L of an (L + 1)-layer model of the target's family (a full-attention layer for
    Qwen3-Next), the rest in plain torch."""

    def __init__(self, target_dir, tmp_path):
        from transformers import AutoModelForCausalLM

        config = json.loads((target_dir / "config.json").read_text())
        self.layer = layer = config["num_hidden_layers"]
        self.qwen = "layer_types" in config
        self.eps = config["rms_norm_eps"]
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        w = load_file(target_dir / "model.safetensors")
        longer = tmp_path / "longer"
        longer.mkdir()
        longer_config = {**config, "num_hidden_layers": layer + 1}
        if self.qwen:  # mtp.layers.0 as model.layers.L, a full-attention layer
            longer_config["layer_types"] = [*config["layer_types"], "full_attention"]
            own = {k[len("mtp.") :]: v for k, v in w.items() if k.startswith("mtp.")}
            block = {
                f"model.layers.{layer}.{k[len('layers.0.') :]}": v.clone()
                for k, v in own.items()
                if k.startswith("layers.0.")
            }
            save_file({**w, **block}, longer / "model.safetensors")
        else:
            own = {k[len(f"model.layers.{layer}.") :]: v for k, v in w.items()}
            shutil.copy(target_dir / "model.safetensors", longer / "model.safetensors")
        (longer / "config.json").write_text(json.dumps(longer_config))
        full = AutoModelForCausalLM.from_pretrained(longer, dtype=torch.float32).eval()
        self.block, self.rotary = full.model.layers[layer], full.model.rotary_emb
        self.w = own
        self.embed = own.get("embed_tokens.weight", w["model.embed_tokens.weight"])
        self.head = own.get("shared_head.head.weight", w["lm_head.weight"])

    def _norm(self, x, name):  # DeepSeek's RMSNorm, Qwen3-Next's (1 + w) one
        w = self.w[name]
        return rms(x, 1.0 + w if self.qwen else w, self.eps)

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor):
        """(logits, the next pass's feature) of entries p = 0..n-1 at positions p."""
        n = len(next_tokens)
        pos = torch.arange(n)
        e = self.embed[torch.tensor(next_tokens)].clone()
        if self.qwen:
            x = (
                torch.cat(
                    [
                        self._norm(e, "pre_fc_norm_embedding.weight"),
                        self._norm(feats, "pre_fc_norm_hidden.weight"),
                    ],
                    -1,
                )
                @ self.w["fc.weight"].T
            )
        else:
            e[pos == 0] = 0  # DeepSeek's layer sees no token before position 0
            x = torch.cat([self._norm(e, "enorm.weight"), self._norm(feats, "hnorm.weight")], -1)
            x = x @ self.w["eh_proj.weight"].T
        x = x[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, pos[None])
        out = self.block(
            x, attention_mask=mask, position_ids=pos[None], position_embeddings=cos_sin
        )
        pre = (out[0] if isinstance(out, tuple) else out)[0]
        if self.qwen:  # the normed output is both the logits' input and the next feature
            normed = self._norm(pre, "norm.weight")
            return normed @ self.head.T, normed
        return self._norm(pre, "shared_head.norm.weight") @ self.head.T, pre

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        """Drafts 1 and 2 of a step whose row runs its own token seq[c] at position c."""
        hidden = self.target.model(torch.tensor([seq[:c]])).last_hidden_state[0]
        return teacher_forced_drafts(self.run, hidden, seq, c)


def test_drafts_are_the_layers_teacher_forced_predictions(target, monkeypatch, tmp_path):
    reference = ReferenceMtp(target, tmp_path).drafts
    assert_drafts_match_reference(
        monkeypatch, FinalHiddenRunner, target, MTP_PROMPTS, mtp_spec(2), reference
    )


def test_tensor_parallel_matches(target):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, plain = run_llm(target, MTP_PROMPTS, params)
    llm, spec = run_llm(
        target, MTP_PROMPTS, params, speculative_config=mtp_spec(1), tensor_parallel_size=2
    )
    assert token_ids(spec) == token_ids(plain)
    assert llm.get_stats().spec_decode_num_draft_tokens > 0
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_tiny_mtp_target(tmp_path_factory.mktemp("mtp-refusals") / "target")


def test_count_defaults_and_refusals(deepseek, tmp_path):
    target = deepseek
    llm, _ = run_llm(
        target, MTP_PROMPTS[:1], SamplingParams(max_tokens=4), speculative_config=mtp_spec(None)
    )
    assert llm.llm_engine.config.speculative_config["num_speculative_tokens"] == 1
    for alias in ("deepseek_mtp", "qwen3_next_mtp"):  # vLLM's per-family names: "mtp"
        llm = LLM(str(target), speculative_config={"method": alias, "num_speculative_tokens": 1})
        assert llm.llm_engine.config.speculative_config["method"] == alias
        llm.generate(MTP_PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)
        assert llm.get_stats().spec_decode_num_draft_tokens > 0  # the MTP layer drafted
    with pytest.raises(ValueError, match=r"speculative_config\.model is given with method 'mtp'"):
        LLM(str(target), speculative_config={**mtp_spec(1), "model": str(target)})
    llama = write_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(
        ValueError, match=r"method 'mtp' runs the MTP layers of DeepSeek-V3-style, GLM-4.5"
    ):
        LLM(str(llama), speculative_config=mtp_spec(1))
    plain = write_tiny_model(tmp_path / "ds", "deepseek_v3", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"has no MTP layer"):
        LLM(str(plain), speculative_config=mtp_spec(1))
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"model\.layers\.3 lacks"):
        LLM(str(plain), speculative_config=mtp_spec(1))
