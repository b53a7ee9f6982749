"""Speculative decoding with IBM's MLP speculator (speculative_config method "mlp_speculator").

- The module's logits equal a plain-torch forward written from fms-extras' formulation
  (ln(state_weight * proj(s) + emb_weight * emb(x)), GELU, per-stage heads) on random weights
  and inputs: separate stages, tie_weights + scale_input, inner_dim 0 (= emb_dim), and a
  checkpoint whose names carry a `speculator.` prefix.
- Every step's drafts in the engine equal that reference run on transformers' final hidden
  state of the target at c - 1 and the row's own token at c (teacher-forced, k = 3).
- Greedy output token-identical to the plain engine (logprobs within 1e-4), k in {1, 3}.
- A speculator whose drafts are known (the target's next token is a function of the current
  one; the speculator encodes that function, or gets its second stage wrong by one token) gets
  the accepted counts per position expected of it; seeded sampling reproduces and every
  sampled token's logprob is the target's.
- The method and k (n_predict) from config.json where none is given; refusals by name.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from draft_heads import assert_greedy_identical_with_drafts, full_sequences, record_drafts, run_llm

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.mlp_speculator import (
    MLPSpeculator,
    MLPSpeculatorConfig,
    MLPSpeculatorRunner,
)
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9] * 4},
    {"prompt_token_ids": list(range(100, 117))},
    {"prompt_token_ids": [7, 300]},
]
VOCAB, HIDDEN = 512, 64


def _spec(path: Path, k: int) -> dict:
    return {"method": "mlp_speculator", "model": str(path), "num_speculative_tokens": k}


def write_speculator(
    path: Path,
    *,
    n_predict: int = 3,
    emb_dim: int = HIDDEN,
    inner_dim: int = 32,
    vocab_size: int = VOCAB,
    tie_weights: bool = False,
    scale_input: bool = False,
    prefix: str = "",
    seed: int = 0,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A speculator checkpoint as the Hub's accelerators ship it: config.json with their
    fields, model.safetensors with emb/proj/head/ln.{j} (tied stages: equal copies under
    every stage's name). Random weights unless `weights` gives them (by name, no prefix)."""
    path.mkdir(parents=True, exist_ok=True)
    d = inner_dim or emb_dim
    gen = torch.Generator().manual_seed(seed)
    w = {}
    for j in range(n_predict):
        width = emb_dim if j == 0 else d
        w[f"emb.{j}.weight"] = torch.randn(vocab_size, d, generator=gen)
        w[f"proj.{j}.weight"] = torch.randn(d, width, generator=gen) * width**-0.5
        w[f"head.{j}.weight"] = torch.randn(vocab_size, d, generator=gen) * d**-0.5
        w[f"ln.{j}.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
        w[f"ln.{j}.bias"] = 0.1 * torch.randn(d, generator=gen)
    if tie_weights:  # stage 0's emb / head / ln everywhere, stage 1's proj from stage 1 on
        for j in range(1, n_predict):
            for name in ("emb.{}.weight", "head.{}.weight", "ln.{}.weight", "ln.{}.bias"):
                w[name.format(j)] = w[name.format(0)].clone()
            w[f"proj.{j}.weight"] = w["proj.1.weight"].clone()
    w.update(weights or {})
    save_file({prefix + k: v.clone() for k, v in w.items()}, path / "model.safetensors")
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "emb_dim": emb_dim,
        "inner_dim": inner_dim,
        "n_predict": n_predict,
        "n_candidates": n_predict,
        "top_k_tokens_per_head": [1] * n_predict,
        "scale_input": scale_input,
        "tie_weights": tie_weights,
        "vocab_size": vocab_size,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


class Reference:
    """The speculator in plain torch, from fms-extras' formulation (the stage's state and
    token embedding weighted by state_weight and emb_weight before the norm)."""

    def __init__(self, path: Path) -> None:
        self.cfg = cfg = json.loads((path / "config.json").read_text())
        self.w = {
            k.removeprefix("speculator."): v
            for k, v in load_file(path / "model.safetensors").items()
        }
        n, d = cfg["n_predict"], cfg["inner_dim"] or cfg["emb_dim"]
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * d / 2)

    @staticmethod
    def _norm(x, weight=None, bias=None):
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x if weight is None else x * weight + bias

    def logits(self, hidden: torch.Tensor, token: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Each stage's logits [R, V], each stage fed the previous one's argmax."""
        w, out = self.w, []
        state = hidden
        if self.cfg["scale_input"]:
            state = self._norm(state) / math.sqrt(2)
        for j in range(k):
            mixed = self.state_weight * (state @ w[f"proj.{j}.weight"].T)
            mixed = mixed + self.emb_weight * w[f"emb.{j}.weight"][token]
            state = torch.nn.functional.gelu(
                self._norm(mixed, w[f"ln.{j}.weight"], w[f"ln.{j}.bias"])
            )
            out.append(state @ w[f"head.{j}.weight"].T)
            token = out[-1].argmax(-1)
        return out


VARIANTS = {
    "stages": {},
    "tied_scaled": {"tie_weights": True, "scale_input": True},
    "inner_is_emb": {"inner_dim": 0, "scale_input": True},
    "prefixed": {"prefix": "speculator.", "n_predict": 2},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_module_matches_reference(variant, tmp_path):
    path = write_speculator(tmp_path / "spec", seed=3, **VARIANTS[variant])
    raw = json.loads((path / "config.json").read_text())
    model = MLPSpeculator(MLPSpeculatorConfig.from_json(raw, "test"))
    model.load_weights(load_file(path / "model.safetensors").items())
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, HIDDEN, generator=gen) * 2
    token = torch.randint(0, VOCAB, (5,), generator=gen)
    k = raw["n_predict"]
    want = Reference(path).logits(hidden, token, k)
    state, prev = model.start(hidden), token
    for j in range(k):
        state, logits = model.stage(j, state, prev)
        torch.testing.assert_close(logits, want[j], atol=1e-4, rtol=1e-4)
        prev = logits.argmax(-1)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("mlp-spec") / "target", "llama", seed=1)


@pytest.mark.parametrize("variant", ["stages", "tied_scaled"])
def test_drafts_are_the_reference_on_the_targets_hidden_state(
    target, variant, monkeypatch, tmp_path
):
    from transformers import AutoModelForCausalLM

    path = write_speculator(tmp_path / "spec", seed=4, **VARIANTS[variant])
    seen = record_drafts(monkeypatch, MLPSpeculatorRunner)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm, outs = run_llm(target, PROMPTS, params, speculative_config=_spec(path, 3))
    assert len(seen) == llm.get_stats().spec_decode_num_drafts  # no step failed and recovered
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ref = Reference(path)
    finals = {}
    with torch.no_grad():
        for prompt, seq in full_sequences(PROMPTS, outs).items():
            out = hf(torch.tensor([seq]), output_hidden_states=True)
            finals[prompt] = (seq, out.hidden_states[-1][0])  # normed: the LM head's input
        checked = 0
        for prompt, c, drafts in seen:
            seq, hidden = finals[prompt]
            logits = ref.logits(hidden[c - 1 : c], torch.tensor([seq[c]]), len(drafts))
            assert drafts == [int(x.argmax()) for x in logits], (len(prompt), c)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(target, k, tmp_path):
    path = write_speculator(tmp_path / "spec", seed=5, tie_weights=True, scale_input=True)
    assert_greedy_identical_with_drafts(target, PROMPTS, _spec(path, k), 12)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A target without attention or MLP output: its next token is f(current token), f the
    LM head over the final norm of the token's embedding. Returns (path, f)."""
    path = write_tiny_model(tmp_path_factory.mktemp("chain") / "target", "llama", seed=2)
    w = load_file(path / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    e = w["model.embed_tokens.weight"]
    normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-5) * w["model.norm.weight"]
    return path, (normed @ w["lm_head.weight"].T).argmax(-1)


def _knowing(path: Path, stage_maps: list[torch.Tensor]) -> Path:
    """A speculator whose stage j drafts stage_maps[j][x] after token x: no state (proj 0),
    one-hot embeddings (inner_dim = vocab), head j's column x the one-hot of its draft."""
    eye = torch.eye(VOCAB)
    weights = {}
    for j, m in enumerate(stage_maps):
        weights[f"proj.{j}.weight"] = torch.zeros(VOCAB, HIDDEN if j == 0 else VOCAB)
        weights[f"emb.{j}.weight"] = eye
        weights[f"head.{j}.weight"] = eye[m].T.contiguous()
        weights[f"ln.{j}.weight"], weights[f"ln.{j}.bias"] = torch.ones(VOCAB), torch.zeros(VOCAB)
    return write_speculator(path, inner_dim=VOCAB, n_predict=len(stage_maps), weights=weights)


@pytest.mark.parametrize("wrong_stage", [None, 1])
def test_known_drafts_give_the_expected_acceptance(chain, wrong_stage, tmp_path):
    target, f = chain
    maps = [f, f, f]
    if wrong_stage is not None:  # draft 2 is one token off: always rejected, draft 3 unseen
        maps[wrong_stage] = (f + 1) % VOCAB
    path = _knowing(tmp_path / "spec", maps)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    llm, outs = run_llm(target, PROMPTS, params, speculative_config=_spec(path, 3))
    for p, o in zip(PROMPTS, outs):  # the target does follow f
        seq = [p["prompt_token_ids"][-1], *o.outputs[0].token_ids]
        assert len(seq) == 1 + params.max_tokens
        assert all(int(f[a]) == b for a, b in itertools.pairwise(seq))
    stats = llm.get_stats()
    rounds, per_pos = stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens_per_pos
    assert rounds > 0
    if wrong_stage is None:
        # 1 + 3 * 4 tokens in three full rounds; the last token's step drafts nothing
        assert per_pos == [rounds, rounds, rounds] and rounds == 3 * len(PROMPTS)
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    else:
        # two tokens a round (draft 1 and the target's own): 1 + 6 * 2, then one without drafts
        assert per_pos == [rounds, 0, 0] and rounds == 6 * len(PROMPTS)
        assert stats.spec_decode_num_accepted_tokens == rounds


def test_seeded_sampling_reproduces_with_the_targets_logprobs(chain, tmp_path):
    target, f = chain
    path = _knowing(tmp_path / "spec", [f, f])
    params = [
        SamplingParams(temperature=0.3, seed=i, max_tokens=12, logprobs=0, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    llm, first = run_llm(target, PROMPTS, params, speculative_config=_spec(path, 2))
    _, again = run_llm(target, PROMPTS, params, speculative_config=_spec(path, 2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    stats = llm.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # every sampled token's logprob is the target's over the same prefix (no draft leaked in)
    prompts = [
        {"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids)}
        for p, o in zip(PROMPTS, first)
    ]
    _, plain = run_llm(target, prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    for o, r in zip(first, plain):
        got = [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        ids, plp = r.prompt_token_ids, r.prompt_logprobs
        want = [plp[i][ids[i]].logprob for i in range(len(ids) - len(got), len(ids))]
        assert got == pytest.approx(want, abs=1e-4)


def test_method_and_count_from_the_config_and_refusals(target, tmp_path):
    path = write_speculator(tmp_path / "spec", n_predict=2)
    llm = LLM(str(target), max_model_len=128, speculative_config={"model": str(path)})
    spec = llm.llm_engine.config.speculative_config
    assert (spec["method"], spec["num_speculative_tokens"]) == ("mlp_speculator", 2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 exceeds .* n_predict=2"):
        LLM(str(target), speculative_config=_spec(path, 3))
    wide = write_speculator(tmp_path / "wide", emb_dim=96)
    with pytest.raises(ValueError, match=r"emb_dim 96 differs from the target's hidden_size 64"):
        LLM(str(target), speculative_config=_spec(wide, 2))
    vocab = write_speculator(tmp_path / "vocab", vocab_size=256)
    with pytest.raises(ValueError, match=r"vocab_size 256 differs from the target's 512"):
        LLM(str(target), speculative_config=_spec(vocab, 2))
    one = write_speculator(tmp_path / "one", n_predict=1, tie_weights=True)
    with pytest.raises(ValueError, match=r"tie_weights needs n_predict >= 2"):
        LLM(str(target), speculative_config=_spec(one, 1))
    with pytest.raises(ValueError, match=r"needs an MLP speculator .*LlamaForCausalLM"):
        LLM(str(target), speculative_config=_spec(target, 1))
    broken = write_speculator(tmp_path / "broken")
    w = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in w.items() if k != "head.2.weight"}, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks \['head.2.weight'\]"):
        LLM(str(target), speculative_config=_spec(broken, 3))
    save_file({**w, "head.1.weight": w["head.1.weight"][:-1]}, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor head.1.weight: shape mismatch: expected"):
        LLM(str(target), speculative_config=_spec(broken, 3))
