"""Speculative decoding with an EAGLE-3 head: exact, and the head drafts what it should.

- Greedy with a random head (drafts almost always rejected, a draft vocabulary smaller than
  the target's through d2t): token-identical to plain decoding, logprobs within 1e-4.
- The drafts are the head's: every step's drafts 1 and 2 equal a plain-torch EAGLE-3 forward
  over transformers' hidden states of the target (the features of layers 2, L // 2, L - 3),
  teacher-forced on the sequence so far.
- A target that repeats its last token and a head that reads it back: every draft accepted,
  the plain engine's tokens.
- Sampled, n > 1, preemption: each emitted token's logprob is the target's on the sequence
  recomputed from scratch; blocks all free.
- What is refused, by name.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from draft_heads import (
    assert_drafts_teacher_forced,
    assert_greedy_identical_with_drafts,
    assert_same_greedy,
    eagle3_head_forward,
    full_sequences,
    record_drafts,
    run_llm,
)

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.eagle import Eagle3Runner
from paged_engine.testing import write_tiny_eagle3_head, write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

LAYERS = 7  # default aux ids (2, 3, 4)
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
    {"prompt_token_ids": [40, 41] * 9},
    {"prompt_token_ids": list(range(100, 137))},
    {"prompt_token_ids": [7]},
]


def _spec(head, k: int) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def _make_pair(tmp_path_factory, arch: str):
    d = tmp_path_factory.mktemp(f"eagle3-{arch}")
    target = write_tiny_model(d / "target", arch, num_hidden_layers=LAYERS)
    # trained on 32 positions: the engine's head still runs at every position the target does
    head = write_tiny_eagle3_head(
        d / "head", target, draft_vocab_size=256, seed=1, max_position_embeddings=32
    )
    return target, head


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek_v3"])
def pair(request, tmp_path_factory):
    """A 7-layer target and a random head (a 256-token draft vocabulary)."""
    return _make_pair(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return _make_pair(tmp_path_factory, "llama")


_run = run_llm


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical(pair, k):
    """Llama, Qwen3 and DeepSeek-V3 (MLA, MoE) targets."""
    target, head = pair
    assert_greedy_identical_with_drafts(target, PROMPTS, _spec(head, k), 20)


# ---- the reference: transformers' target features, a plain-torch head -------------------------
def _rope(x, positions, theta):  # x [H, T, hd], NeoX halves
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()  # [T, hd / 2]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class ReferenceHead:
    def __init__(self, head_dir, target_dir):
        from transformers import AutoModelForCausalLM

        self.w = load_file(head_dir / "model.safetensors")
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.embed = self.target.get_input_embeddings().weight.detach()
        layers = self.target.config.num_hidden_layers
        self.ids = (2, layers // 2, layers - 3)

    @torch.no_grad()
    def features(self, tokens: list[int]) -> torch.Tensor:
        out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        return torch.cat([out.hidden_states[i][0] for i in self.ids], dim=-1)

    @torch.no_grad()
    def run(self, next_tokens: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over entries p = 0..n-1 (token p + 1, feature p) at positions p: (logits
        over the target vocabulary, pre-norm outputs)."""
        pos, theta = torch.arange(len(next_tokens)), self.cfg["rope_theta"]

        def rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _rope(q, pos, theta), _rope(k, pos, theta)

        emb = self.embed[torch.tensor(next_tokens)]
        small, pre = eagle3_head_forward(self.w, self.cfg, emb, feats, rotate)
        logits = torch.full((len(next_tokens), self.embed.shape[0]), -math.inf)
        logits[:, torch.arange(small.shape[1]) + self.w["d2t"]] = small
        return logits, pre

    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        """Drafts 1 and 2 of a step whose row runs its own token seq[c] at position c."""
        feats = self.features(seq[:c]) @ self.w["fc.weight"].T  # target features at [0, c)
        logits, pre = self.run(seq[1 : c + 1], feats)
        d1 = int(logits[-1].argmax())
        logits2, _ = self.run([*seq[1 : c + 1], d1], torch.cat([feats, pre[-1:]]))
        return d1, int(logits2[-1].argmax())


def test_drafts_are_the_heads_teacher_forced_predictions(pair, monkeypatch):
    _check_drafts(*pair, monkeypatch)


def test_chunked_prefill_drafts_are_teacher_forced(llama_pair, monkeypatch):
    """Prompts prefilled 16 tokens a step (chunks beside other rows' decode steps): each step's
    first pass runs the head over the chunk the target ran the step before, so the drafts
    still equal the reference teacher-forced on the whole sequence."""
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]} for n in (61, 5, 40)]
    _check_drafts(*llama_pair, monkeypatch, prompts, max_num_batched_tokens=16, max_num_seqs=4)


def test_norm_before_residual(llama_pair, monkeypatch, tmp_path):
    """A head whose stream starts at the normed feature (speculators' default)."""
    target, _ = llama_pair
    head = write_tiny_eagle3_head(tmp_path / "head", target, seed=2, norm_before_residual=True)
    _check_drafts(target, head, monkeypatch)


def test_speculators_layout(llama_pair, tmp_path):
    """The same head in the speculators layout, named without a method: the same drafts (the
    engine tells an EAGLE-3 head by its config, as vLLM does)."""
    target, _ = llama_pair
    kw = {"draft_vocab_size": 256, "seed": 3}
    authors = write_tiny_eagle3_head(tmp_path / "a", target, **kw)
    spec_layout = write_tiny_eagle3_head(tmp_path / "s", target, speculators=True, **kw)
    assert "speculators_model_type" in json.loads((spec_layout / "config.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=12)
    runs = []
    for cfg in (_spec(authors, 2), {"model": str(spec_layout), "num_speculative_tokens": 2}):
        llm, outs = _run(target, PROMPTS, params, speculative_config=cfg)
        stats = llm.get_stats()
        runs.append(
            (_tokens(outs), stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens)
        )
    assert runs[0] == runs[1]
    # without a count: the speculators checkpoint's own (3), as vLLM reads it
    llm3, outs3 = _run(target, PROMPTS, params, speculative_config=_spec(authors, 3))
    llm, outs = _run(target, PROMPTS, params, speculative_config={"model": str(spec_layout)})
    assert _tokens(outs) == _tokens(outs3)
    assert llm.get_stats().spec_decode_num_draft_tokens == (
        llm3.get_stats().spec_decode_num_draft_tokens
    )
    with pytest.raises(ValueError, match=r"num_speculative_tokens is required"):
        LLM(str(target), speculative_config={"method": "eagle3", "model": str(authors)})
    unknown = tmp_path / "s" / "config.json"
    raw = json.loads(unknown.read_text())
    unknown.write_text(json.dumps({**raw, "speculators_model_type": "mlp"}))
    with pytest.raises(ValueError, match="speculators checkpoint of type 'mlp'"):
        LLM(str(target), speculative_config=_spec(spec_layout, 2))


def _check_drafts(target, head, monkeypatch, prompts=PROMPTS[:3], **engine) -> None:
    seen = record_drafts(monkeypatch, Eagle3Runner)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    _, outs = _run(target, prompts, params, speculative_config=_spec(head, 2), **engine)
    assert_drafts_teacher_forced(seen, prompts, outs, ReferenceHead(head, target).drafts, 6)


# ---- a head that is always right ------------------------------------------------------------
def _repeating_pair(d, scale: float):
    """A target whose layers add nothing (o_proj, down_proj zero) and whose head is `scale`
    times its embedding: it repeats its last token. The head reads the stream entering layer 2
    (the embedding of token p) and answers it through the same head: position p's guess for
    token p + 2 is token p, with the target's own logits."""
    target = write_tiny_model(d / "target", "llama", num_hidden_layers=LAYERS)
    w = load_file(target / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    w["lm_head.weight"] = scale * w["model.embed_tokens.weight"]
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    dim = w["model.embed_tokens.weight"].shape[1]
    fc = torch.zeros(dim, 3 * dim)
    fc[:, :dim] = torch.eye(dim)
    exact = {
        "fc.weight": fc,
        "midlayer.self_attn.o_proj.weight": torch.zeros(dim, dim),
        "midlayer.mlp.down_proj.weight": torch.zeros(dim, 128),
        "norm.weight": torch.ones(dim),
        "lm_head.weight": w["lm_head.weight"].clone(),
    }
    head = write_tiny_eagle3_head(d / "head", target, weights=exact)
    return target, head


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    return _repeating_pair(tmp_path_factory.mktemp("eagle3-repeat"), 1.0)


@pytest.mark.parametrize("k", [2, 4])
def test_an_exact_head_has_every_draft_accepted(repeating, k):
    target, head = repeating
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    _, plain = _run(target, PROMPTS, params)
    assert all(
        set(o.outputs[0].token_ids) == {p["prompt_token_ids"][-1]} for o, p in zip(plain, PROMPTS)
    )
    llm, spec = _run(target, PROMPTS, params, speculative_config=_spec(head, k))
    assert _tokens(spec) == _tokens(plain)
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_acceptance_rate == 1.0
    # after the prompt's token, each of the 16 left: steps of k drafts + 1, the last one plain
    assert stats.spec_decode_num_drafts == len(PROMPTS) * math.ceil(15 / (k + 1))
    assert stats.spec_decode_mean_acceptance_length > k
    assert stats.num_used_blocks == 0


# ---- sampling, n > 1, preemption ------------------------------------------------------------
def _assert_logprobs_recomputed(path, outs) -> None:
    """Each emitted token's logprob equals its prompt logprob when the sequence is run again
    from scratch: no step read a rejected draft's KV or another sequence's."""
    prompts, recorded = [], []
    for o in outs:
        for c in o.outputs:
            prompts.append({"prompt_token_ids": list(o.prompt_token_ids) + list(c.token_ids)})
            recorded.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    _, again = _run(path, prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for r, got in zip(again, recorded):
        ids, plp = r.prompt_token_ids, r.prompt_logprobs
        start = len(ids) - len(got)
        want = [plp[i][ids[i]].logprob for i in range(start, len(ids))]
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sampled_n_and_preemption(repeating, mode):
    """Seeded sampled requests (n = 1 and n = 3; the fan-out's siblings start with nothing
    kept and propose point masses) and greedy ones on a pool too small for them: preempted
    mid-speculation. Greedy outputs are plain decoding's, every sampled token's logprob is the
    target's, drafts are both accepted and rejected, and no block leaks."""
    target, head = repeating
    prompts = [{"prompt_token_ids": [i + 3, 2 * i + 50, 400 - i] * (1 + i % 3)} for i in range(8)]
    params = []
    for i in range(len(prompts)):
        common = {"max_tokens": 14 + i, "logprobs": 0, "ignore_eos": True}
        if i % 2:
            params.append(
                SamplingParams(temperature=12.0, n=1 + 2 * (i % 4 == 1), seed=i, **common)
            )
        else:
            params.append(SamplingParams(temperature=0, **common))
    kwargs = {"num_gpu_blocks_override": 12, "max_num_seqs": 10, "max_model_len": 96}
    kwargs |= {"preemption_mode": mode, "swap_space": 0.05}
    llm, spec = _run(target, prompts, params, speculative_config=_spec(head, 3), **kwargs)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_used_blocks == 0
    greedy = [i for i in range(len(prompts)) if i % 2 == 0]
    _, plain = _run(target, [prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [_tokens([spec[i]]) for i in greedy] == [_tokens([o]) for o in plain]
    sampled = [spec[i] for i in range(len(prompts)) if i % 2]
    assert all(
        len(c.token_ids) == params[2 * j + 1].max_tokens
        for j, o in enumerate(sampled)
        for c in o.outputs
    )
    _assert_logprobs_recomputed(target, sampled)


def test_tensor_parallel_matches(repeating, tmp_path):
    """TP = 2 (two processes, gloo): the head runs sharded on both ranks over the replicated
    streams. A head that reads the right feature but whose attention and MLP add noise
    (drafts partly accepted, every part of it counting): greedy tokens and acceptance equal
    one process's."""
    target, _ = repeating
    w = load_file(target / "model.safetensors")
    dim = w["model.embed_tokens.weight"].shape[1]
    fc = torch.zeros(dim, 3 * dim)
    fc[:, :dim] = torch.eye(dim)
    gen = torch.Generator().manual_seed(9)
    noisy = {
        "fc.weight": fc,
        "midlayer.self_attn.o_proj.weight": torch.randn(dim, dim, generator=gen) * 0.12,
        "midlayer.mlp.down_proj.weight": torch.randn(dim, 128, generator=gen) * 0.08,
        "lm_head.weight": w["model.embed_tokens.weight"].clone(),
    }
    head = write_tiny_eagle3_head(tmp_path / "head", target, weights=noisy)
    prompts = [{"prompt_token_ids": [i + 3, 7 * i + 20, 300 - i]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm, outs = _run(
            target, prompts, params, speculative_config=_spec(head, 3), tensor_parallel_size=tp
        )
        stats = llm.get_stats()
        runs.append(
            (
                _tokens(outs),
                stats.spec_decode_num_draft_tokens,
                stats.spec_decode_num_accepted_tokens,
            )
        )
        llm.llm_engine.shutdown()
    assert runs[0] == runs[1]
    assert 0 < runs[0][2] < runs[0][1]


# ---- refusals ---------------------------------------------------------------------------------
def test_what_eagle3_refuses(llama_pair, tmp_path):
    target, head = llama_pair
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*EAGLE-3 head"):
        LLM(str(target), speculative_config=_spec(target, 2))  # a plain model is no head
    wide = write_tiny_model(tmp_path / "wide", "llama", num_hidden_layers=LAYERS, hidden_size=96)
    with pytest.raises(ValueError, match=r"features of width 64, the target's hidden size is 96"):
        LLM(str(wide), speculative_config=_spec(head, 2))
    other_vocab = write_tiny_model(
        tmp_path / "vocab", "llama", num_hidden_layers=LAYERS, vocab_size=600
    )
    with pytest.raises(ValueError, match="vocab_size 512 differs from the target's 600"):
        LLM(str(other_vocab), speculative_config=_spec(head, 2))
    shallow = write_tiny_model(tmp_path / "shallow", "llama")  # 2 layers: no (2, 1, -1)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(str(shallow), speculative_config=_spec(head, 2))
    gpt2 = write_tiny_model(tmp_path / "gpt2", "gpt2", n_layer=LAYERS, n_embd=64)
    with pytest.raises(ValueError, match="Llama decoder stack"):
        LLM(str(gpt2), speculative_config=_spec(head, 2))
    with pytest.raises(ValueError, match=r"speculative_config\.model must name"):
        LLM(str(target), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    last_only = write_tiny_eagle3_head(
        tmp_path / "last-only", target, eagle_config={"use_aux_hidden_state": False}
    )
    with pytest.raises(ValueError, match="use_aux_hidden_state is false"):
        LLM(str(target), speculative_config=_spec(last_only, 2))


def test_beam_rows_keep_nothing(llama_pair, monkeypatch):
    """Beam-search rows never draft: the head never runs over them, and they decode as
    without speculation."""
    target, head = llama_pair
    runs: list[int] = []
    forward = Eagle3Runner._forward_head

    def counting(self, ids, *args):
        runs.append(int(ids.shape[0]))
        return forward(self, ids, *args)

    monkeypatch.setattr(Eagle3Runner, "_forward_head", counting)
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=10)
    _, plain = _run(target, PROMPTS[:2], beams)
    llm, spec = _run(target, PROMPTS[:2], beams, speculative_config=_spec(head, 2))
    assert _tokens(spec) == _tokens(plain)
    assert runs == [] and llm.get_stats().spec_decode_num_drafts == 0
    greedy = SamplingParams(temperature=0, max_tokens=10)
    _run(target, PROMPTS[:1], greedy, speculative_config=_spec(head, 2))
    assert runs  # the same head runs for rows that draft


def test_penalized_drafts_count_the_drafts_before_them(tmp_path_factory, monkeypatch):
    """Frequency-penalized greedy rows on the repeating target with a lead of 1-3 logits (a
    tenth of the embedding as both heads): the target repeats a token until the penalty moves
    it on. The exact head reads the token it was run at, so its drafts can be wrong only
    after the sequence has left that token: at the switch itself its penalties, counting the
    drafts before it as outputs, move it to the target's next token. Tokens as plain."""
    target, head = _repeating_pair(tmp_path_factory.mktemp("eagle3-soft"), 0.1)
    seen = record_drafts(monkeypatch, Eagle3Runner)
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.6, logprobs=1
    )
    _, plain = _run(target, PROMPTS, params)
    llm, spec = _run(target, PROMPTS, params, speculative_config=_spec(head, 4))
    assert_same_greedy(spec, plain)
    full = full_sequences(PROMPTS, plain)
    switches = 0
    for prompt, c, drafts in seen:
        seq = full[prompt]
        for j, d in enumerate(drafts[: len(seq) - c - 1]):
            moved = any(t != seq[c] for t in seq[c + 1 : c + 1 + j])
            assert moved or d == seq[c + 1 + j], (prompt[-1], c, j, drafts, seq[c : c + 6])
            switches += not moved and d != seq[c]
    assert switches >= 3  # drafts that moved on with the target
    stats = llm.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
