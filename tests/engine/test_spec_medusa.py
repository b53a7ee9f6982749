"""Speculative decoding with Medusa heads: exact, and the heads draft what they should.

- Random heads in vLLM's and FasterDecoding's layouts (2 residual layers with biases, 4 heads
  of which k = 3 run): greedy token-identical to plain decoding (logprobs within 1e-4), and
  every step's drafts 1 and 2 equal plain-torch heads over transformers' final normed hidden
  state of the position before the row's own token.
- A target that counts (t -> t + 1) and heads built so head i answers t + 2 + i: every draft
  accepted (vLLM's layout, FasterDecoding's, a token_map with truncated or full-vocabulary
  rows); one original_lm_head shared by all heads, or a second head negated: exactly draft 1 of
  each proposal accepted (per-position counts).
- Seeded sampled requests (n = 2 siblings start with nothing kept) beside greedy ones on a pool
  small enough to preempt: greedy outputs are plain decoding's, every sampled token's logprob is
  the target's recomputed from scratch, no block leaks.
- Async scheduling drafts and emits what synchronous scheduling does.
- Method and draft count read from the checkpoint (vLLM's model_type rule); refusals by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from draft_heads import (
    assert_drafts_teacher_forced,
    assert_greedy_identical_with_drafts,
    record_drafts,
    run_llm,
)

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.medusa import MedusaRunner
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
    {"prompt_token_ids": [40, 41] * 9},
    {"prompt_token_ids": list(range(100, 137))},
    {"prompt_token_ids": [7]},
]

# (blocks [(W, b or None)] per layer, LM head rows [V, D]) per head
Heads = list[tuple[list[tuple[torch.Tensor, torch.Tensor | None]], torch.Tensor]]


def _spec(heads: Path, k: int) -> dict:
    return {"method": "medusa", "model": str(heads), "num_speculative_tokens": k}


def _random_heads(target: Path, num_heads: int, num_layers: int, seed: int) -> Heads:
    w = load_file(target / "model.safetensors")
    vocab, d = w["lm_head.weight"].shape
    gen = torch.Generator().manual_seed(seed)
    out: Heads = []
    for _ in range(num_heads):
        blocks = [
            (torch.randn(d, d, generator=gen) * d**-0.5, torch.randn(d, generator=gen) * 0.1)
            for _ in range(num_layers)
        ]
        out.append((blocks, torch.randn(vocab, d, generator=gen) * d**-0.5))
    return out


def _write_heads(
    path: Path,
    heads: Heads,
    layout: str = "vllm",
    token_map: torch.Tensor | None = None,
    full_rows: bool = False,
    original_lm_head: bool = False,
) -> Path:
    """The heads as a checkpoint: vLLM's layout (config with model_type "medusa",
    model.safetensors) or FasterDecoding's (medusa_num_* config, medusa_lm_head.pt). A
    `token_map` keeps only its ids' rows unless `full_rows` (vLLM cuts them at load)."""
    path.mkdir(parents=True, exist_ok=True)
    num_layers = len(heads[0][0])
    vocab, d = heads[0][1].shape
    bias = heads[0][0][0][1] is not None if num_layers else False
    tensors: dict[str, torch.Tensor] = {}
    for i, (blocks, lm) in enumerate(heads):
        rows = lm if token_map is None or full_rows else lm[token_map]
        for j, (weight, b) in enumerate(blocks):
            pre = f"{i}.{j}.linear" if layout == "fasterdecoding" else f"blocks.{i}.layers.{j}"
            tensors[f"{pre}.weight"] = weight
            if b is not None:
                tensors[f"{pre}.bias"] = b
        name = f"{i}.{num_layers}" if layout == "fasterdecoding" else f"lm_heads.{i}"
        if not original_lm_head or i == 0:
            tensors[f"{name}.weight"] = rows
    if layout == "fasterdecoding":
        config = {"medusa_num_heads": len(heads), "medusa_num_layers": num_layers}
        torch.save({k: v.clone() for k, v in tensors.items()}, path / "medusa_lm_head.pt")
    else:
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": d,
            "vocab_size": vocab,
            "num_heads": len(heads),
            "num_hidden_layers": num_layers,
            "medusa_fc_bias": bias,
            "original_lm_head": original_lm_head,
        }
        if token_map is not None:
            config["truncated_vocab_size"] = token_map.numel()
            tensors["token_map"] = token_map
        save_file({k: v.clone() for k, v in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return path


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


# ---- random heads: exact, and the drafts are the heads' ---------------------------------------
@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("medusa")
    target = write_tiny_model(d / "target", "llama")
    return target, _random_heads(target, num_heads=4, num_layers=2, seed=1)


def _reference(target: Path, heads: Heads):
    """drafts(seq, c): heads 0 and 1 over transformers' final normed hidden state of
    seq[:c] (the position before the row's own token seq[c])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    @torch.no_grad()
    def drafts(seq: list[int], c: int) -> tuple[int, int]:
        out = model(torch.tensor([seq[:c]]), output_hidden_states=True)
        h = out.hidden_states[-1][0, -1]
        guesses = []
        for blocks, lm in heads[:2]:
            x = h
            for weight, b in blocks:
                x = x + F.silu(x @ weight.T + b)
            guesses.append(int((x @ lm.T).argmax()))
        return guesses[0], guesses[1]

    return drafts


@pytest.mark.parametrize("layout", ["vllm", "fasterdecoding"])
def test_greedy_identical_and_drafts_are_the_heads(random_pair, layout, monkeypatch, tmp_path):
    target, heads = random_pair
    path = _write_heads(tmp_path / "heads", heads, layout)
    assert_greedy_identical_with_drafts(target, PROMPTS[:3], _spec(path, 3), 12)
    seen = record_drafts(monkeypatch, MedusaRunner)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    _, outs = run_llm(target, PROMPTS[:3], params, speculative_config=_spec(path, 3))
    assert_drafts_teacher_forced(seen, PROMPTS[:3], outs, _reference(target, heads), 6)


# ---- a counting target: known acceptance -------------------------------------------------------
@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """A target whose layers add nothing (h_p is the normed embedding of token p) and whose LM
    head row v is the embedding of v - 1: it answers token t with t + 1. Its embedding, and its
    plain greedy outputs."""
    d = tmp_path_factory.mktemp("medusa-count")
    target = write_tiny_model(d / "target", "llama")
    w = load_file(target / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    embed = w["model.embed_tokens.weight"]
    w["lm_head.weight"] = embed.roll(1, dims=0)
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    _, plain = run_llm(target, PROMPTS, _COUNT_PARAMS)
    for o, p in zip(plain, PROMPTS):
        last = p["prompt_token_ids"][-1]
        assert list(o.outputs[0].token_ids) == [last + 1 + j for j in range(17)]
    return target, embed, _tokens(plain)


_COUNT_PARAMS = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)


def _exact_heads(embed: torch.Tensor, num_heads: int, bias: bool) -> Heads:
    """Zero blocks (the identity: x + SiLU(0)), then head i answers token t with t + 2 + i."""
    d = embed.shape[1]
    block = (torch.zeros(d, d), torch.zeros(d) if bias else None)
    return [([block], embed.roll(2 + i, dims=0)) for i in range(num_heads)]


def _token_map(vocab: int) -> torch.Tensor:
    """Every third id and the ids the prompts count through, shuffled."""
    keep = set(range(0, vocab, 3))
    for p in PROMPTS:
        keep |= set(range(p["prompt_token_ids"][-1], p["prompt_token_ids"][-1] + 20))
    ids = torch.tensor(sorted(keep))
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize(
    "variant", ["vllm", "fasterdecoding", "original_lm_head", "token_map", "token_map_full_rows"]
)
def test_exact_heads_have_every_draft_accepted(counting, variant, tmp_path):
    target, embed, plain = counting
    fd = variant == "fasterdecoding"
    heads = _exact_heads(embed, 3, bias=fd)
    kwargs: dict = {"layout": "fasterdecoding" if fd else "vllm"}
    if variant.startswith("token_map"):
        kwargs |= {"token_map": _token_map(embed.shape[0]), "full_rows": "full" in variant}
    kwargs["original_lm_head"] = variant == "original_lm_head"
    k = 3
    path = _write_heads(tmp_path / "heads", heads, **kwargs)
    llm, spec = run_llm(target, PROMPTS, _COUNT_PARAMS, speculative_config=_spec(path, k))
    assert _tokens(spec) == plain
    stats = llm.get_stats()
    assert stats.num_used_blocks == 0
    n = stats.spec_decode_num_drafts
    if variant == "original_lm_head":  # head 0's LM head serves all: t + 2 each time
        assert stats.spec_decode_num_accepted_tokens == n == len(PROMPTS) * 8
        assert list(stats.spec_decode_num_accepted_tokens_per_pos) == [n, 0, 0]
        return
    assert stats.spec_decode_acceptance_rate == 1.0
    # after the prompt's token, each of the 16 left: steps of k drafts + 1, the last one plain
    assert n == len(PROMPTS) * math.ceil(15 / (k + 1))
    assert list(stats.spec_decode_num_accepted_tokens_per_pos) == [n] * 3


def test_a_negated_second_head_has_draft_one_accepted(counting, tmp_path):
    target, embed, plain = counting
    heads = _exact_heads(embed, 2, bias=False)
    heads[1] = (heads[1][0], -heads[1][1])  # guesses the token least like t + 3
    path = _write_heads(tmp_path / "heads", heads)
    llm, spec = run_llm(target, PROMPTS, _COUNT_PARAMS, speculative_config=_spec(path, 2))
    assert _tokens(spec) == plain
    stats = llm.get_stats()
    n = stats.spec_decode_num_drafts
    assert n == len(PROMPTS) * 8  # 2 tokens a step from the second: 1 + 8 * 2 = 17
    assert stats.spec_decode_num_accepted_tokens == n
    assert list(stats.spec_decode_num_accepted_tokens_per_pos) == [n, 0]


# ---- sampling, n > 1, preemption ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sampled_n_and_preemption(counting, mode, tmp_path):
    target, embed, _ = counting
    path = _write_heads(tmp_path / "heads", _exact_heads(embed, 3, bias=False))
    prompts = [{"prompt_token_ids": [i + 3, 2 * i + 50, 400 - i] * (1 + i % 3)} for i in range(8)]
    params = []
    for i in range(len(prompts)):
        common = {"max_tokens": 14 + i, "logprobs": 0, "ignore_eos": True}
        if i % 2:
            n = 1 + 2 * (i % 4 == 1)
            params.append(SamplingParams(temperature=12.0, n=n, seed=i, **common))
        else:
            params.append(SamplingParams(temperature=0, **common))
    kwargs = {"num_gpu_blocks_override": 12, "max_num_seqs": 10, "max_model_len": 96}
    kwargs |= {"preemption_mode": mode, "swap_space": 0.05}
    llm, spec = run_llm(target, prompts, params, speculative_config=_spec(path, 3), **kwargs)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_used_blocks == 0
    greedy = list(range(0, len(prompts), 2))
    _, plain = run_llm(target, [prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [_tokens([spec[i]]) for i in greedy] == [_tokens([o]) for o in plain]
    # each sampled token's logprob is the target's on the sequence run again from scratch
    again, recorded = [], []
    for o in (spec[i] for i in range(1, len(prompts), 2)):
        for c in o.outputs:
            again.append({"prompt_token_ids": list(o.prompt_token_ids) + list(c.token_ids)})
            recorded.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    check = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    _, outs = run_llm(target, again, check)
    for r, got in zip(outs, recorded):
        ids, plp = r.prompt_token_ids, r.prompt_logprobs
        start = len(ids) - len(got)
        assert got == pytest.approx(
            [plp[i][ids[i]].logprob for i in range(start, len(ids))], abs=1e-4
        )


def test_async_scheduling_equals_sync(counting, tmp_path):
    """Async scheduling: the same rows draft the same tokens, the same tokens come out."""
    target, embed, _ = counting
    path = _write_heads(tmp_path / "heads", _exact_heads(embed, 2, bias=False))
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=3.0, seed=4, max_tokens=12, ignore_eos=True, logprobs=0),
    ]
    runs = []
    for async_scheduling in (False, True):
        llm, outs = run_llm(
            target,
            PROMPTS[:2],
            params,
            speculative_config=_spec(path, 2),
            async_scheduling=async_scheduling,
        )
        stats = llm.get_stats()
        counts = (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
        runs.append((_tokens(outs), counts))
    assert runs[0] == runs[1]
    assert runs[0][1][1] > 0


# ---- config ------------------------------------------------------------------------------------
def test_method_and_count_from_the_checkpoint_and_refusals(random_pair, tmp_path):
    target, heads = random_pair
    path = _write_heads(tmp_path / "heads", heads[:2])
    llm = LLM(str(target), max_model_len=64, speculative_config={"model": str(path)})
    spec = llm.llm_engine.config.speculative_config
    assert (spec["method"], spec["num_speculative_tokens"]) == ("medusa", 2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 exceeds .* num_heads=2"):
        LLM(str(target), speculative_config=_spec(path, 3))
    with pytest.raises(ValueError, match=r"speculative_config.model must name .* 'medusa'"):
        LLM(str(target), speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    wide = write_tiny_model(tmp_path / "wide", "llama", hidden_size=96)
    with pytest.raises(ValueError, match=r"heads' hidden_size 64 differs from the target's 96"):
        LLM(str(wide), speculative_config=_spec(path, 2))
    with pytest.raises(ValueError, match=r"cannot load the Medusa heads \(no Medusa config"):
        LLM(str(target), speculative_config=_spec(target, 2))
    cut = _write_heads(tmp_path / "cut", heads[:2], token_map=torch.arange(8))
    w = load_file(path / "model.safetensors")  # no token_map, and a bias short
    del w["blocks.1.layers.1.bias"]
    save_file(w, cut / "model.safetensors")
    with pytest.raises(ValueError, match=r"no token_map"):
        LLM(str(target), speculative_config=_spec(cut, 2))
    bad = dict(json.loads((path / "config.json").read_text()), truncated_vocab_size=None)
    (cut / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"missing weights blocks.1.layers.1.bias"):
        LLM(str(target), speculative_config=_spec(cut, 2))
