"""Checking a feature-reading draft head (EAGLE-3, MTP) against a reference, teacher-forced.

`assert_drafts_teacher_forced` runs greedy requests through an engine whose head runner's
`propose` is recorded, then compares every step's drafts 1 and 2 with what the reference
predicts for the finished sequence cut at that step: the head's first pass must have run over
the target's features of exactly the positions before it, and its second pass on its own.
The rest: what the EAGLE-1 / MTP test files share (prompts, speculative configs, the
two-pass teacher-forced drafts of a reference, the greedy and every-draft-accepted checks).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def run_llm(path, prompts, params, **kwargs):
    """(LLM, outputs) of a fresh engine (seed 0, max_model_len 256 unless given) over prompts."""
    from paged_engine import LLM

    llm = LLM(str(path), seed=0, **{"max_model_len": 256, **kwargs})
    return llm, llm.generate(prompts, params, use_tqdm=False)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in plain torch (the references' norm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def assert_same_greedy(spec, plain) -> None:
    """Speculative outputs carry the plain engine's tokens and (within 1e-4) logprobs."""
    assert [[c.token_ids for c in o.outputs] for o in spec] == [
        [c.token_ids for c in o.outputs] for o in plain
    ]
    for a, b in zip(spec, plain):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in y.items():
                assert x[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)


def assert_greedy_identical_with_drafts(target, prompts, spec_config, max_tokens: int) -> None:
    """Greedy requests under `spec_config` give the plain engine's tokens and logprobs, with
    drafts proposed and every block back in the pool."""
    from paged_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    _, plain = run_llm(target, prompts, params)
    llm, spec = run_llm(target, prompts, params, speculative_config=spec_config)
    assert_same_greedy(spec, plain)
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.num_used_blocks == 0


def record_drafts(monkeypatch, runner_cls) -> list[tuple[tuple, int, list[int]]]:
    """(prompt, the row's own token position, its drafts) of every drafting row of every step
    of engines built after this call in this process."""
    seen: list[tuple[tuple, int, list[int]]] = []
    propose = runner_cls.propose

    def recording(self, sched, cached, inputs):
        proposal = propose(self, sched, cached, inputs)
        for c, start in zip(cached, sched.start_positions):
            if c.seq_id in proposal.tokens:
                prompt = tuple(c.token_ids[: c.num_prompt_tokens])
                seen.append((prompt, start, list(proposal.tokens[c.seq_id])))
        return proposal

    monkeypatch.setattr(runner_cls, "propose", recording)
    return seen


def full_sequences(prompts: list[dict], outs) -> dict[tuple, list[int]]:
    """Prompt ids -> prompt + first completion's tokens, of each request."""
    return {
        tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + list(o.outputs[0].token_ids)
        for p, o in zip(prompts, outs)
    }


def assert_drafts_teacher_forced(
    seen: list[tuple[tuple, int, list[int]]],
    prompts: list[dict],
    outs,
    reference: Callable[[list[int], int], tuple[int, int]],
    min_checked: int,
) -> None:
    """Every recorded step's drafts 1 and 2 equal `reference(sequence, c)` (drafts 1 and 2 of
    a step whose row runs its own token sequence[c] at position c)."""
    full = full_sequences(prompts, outs)
    checked = 0
    for prompt, c, drafts in seen:
        seq = full[prompt]
        if c + 1 >= len(seq):
            continue
        d1, d2 = reference(seq, c)
        assert drafts[0] == d1, (len(prompt), c)
        if len(drafts) > 1:
            assert drafts[1] == d2, (len(prompt), c)
        checked += 1
    assert checked >= min_checked


# ---- shared by the EAGLE-1 / MTP test files --------------------------------------------------
# A repeat, a long one, and a short one (two tokens: an EAGLE-1 head; one token: an MTP layer,
# which at position 0 reads the prompt's only token).
EAGLE_PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
    {"prompt_token_ids": list(range(100, 137))},
    {"prompt_token_ids": [7, 300]},
]
MTP_PROMPTS = [*EAGLE_PROMPTS[:2], {"prompt_token_ids": [7]}]


def eagle_spec(head, k: int) -> dict:
    """speculative_config of an EAGLE-1 head at `head` drafting k tokens."""
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


def mtp_spec(k: int | None) -> dict:
    """speculative_config of the target's own MTP layer(s); k None: the layer count serves."""
    return {"method": "mtp"} if k is None else {"method": "mtp", "num_speculative_tokens": k}


def token_ids(outs) -> list[list]:
    """Every completion's token ids, per request."""
    return [[c.token_ids for c in o.outputs] for o in outs]


def teacher_forced_drafts(
    step: Callable, feats: torch.Tensor, seq: list[int], c: int, head: torch.Tensor | None = None
) -> tuple[int, int]:
    """Drafts 1 and 2 of a step whose row runs its own token seq[c] at position c, given the
    target's features `feats` [c, D] of positions 0..c-1: position i reads token seq[i + 1]
    and feature i. `step(tokens, feats)` runs the head: (logits, features) per position, or,
    with `head` given, the features only (logits = features @ head.T). Draft 2 is a second pass
    with draft 1 appended, reading the first pass's last feature."""

    def logits_and_out(tokens: list[int], f: torch.Tensor):
        if head is None:
            return step(tokens, f)
        out = step(tokens, f)
        return (out[-1] @ head.T)[None], out

    tokens = seq[1 : c + 1]
    logits, out = logits_and_out(tokens, feats)
    d1 = int(logits[-1].argmax())
    logits2, _ = logits_and_out([*tokens, d1], torch.cat([feats, out[-1:]]))
    return d1, int(logits2[-1].argmax())


def assert_drafts_match_reference(
    monkeypatch, runner_cls, target, prompts: list[dict], spec_config: dict, reference
) -> None:
    """Greedy 10-token requests under `spec_config` with `runner_cls.propose` recorded: every
    step's drafts 1 and 2 are `reference(sequence, c)`'s (assert_drafts_teacher_forced), at
    least 5 steps checked."""
    from paged_engine import SamplingParams

    seen = record_drafts(monkeypatch, runner_cls)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    _, outs = run_llm(target, prompts, params, speculative_config=spec_config)
    assert_drafts_teacher_forced(seen, prompts, outs, reference, 5)


def assert_every_draft_accepted(target, prompts: list[dict], spec_config: dict) -> None:
    """Greedy 12-token requests (ignore_eos) under `spec_config`: the plain engine's tokens,
    drafts proposed, and every one accepted."""
    from paged_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, plain = run_llm(target, prompts, params)
    llm, spec = run_llm(target, prompts, params, speculative_config=spec_config)
    assert token_ids(spec) == token_ids(plain)
    stats = llm.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


# ---- an EAGLE-3 head in plain torch (test_spec_eagle3.py, test_spec_multimodal.py) -------------
def eagle3_head_forward(
    w: dict[str, torch.Tensor],
    cfg: dict,
    emb: torch.Tensor,
    feats: torch.Tensor,
    rotate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head (vLLM's Eagle3LlamaForCausalLM: one `midlayer`, `norm`, `lm_head`; `w`
    its tensors, `cfg` its config.json) over entries p = 0..n-1, causal: emb [n, D] the embedded
    tokens, feats [n, D] the target's features through `fc`. `rotate(q, k)` turns q
    [heads, n, hd] and k [kv_heads, n, hd] by the entries' positions. Returns (logits over the
    head's own vocabulary [n, V_draft], the pre-norm outputs [n, D])."""
    eps, n = cfg["rms_norm_eps"], emb.shape[0]
    heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    x = torch.cat(
        [
            rms(emb, w["midlayer.input_layernorm.weight"], eps),
            rms(feats, w["midlayer.hidden_norm.weight"], eps),
        ],
        dim=-1,
    )

    def proj(name: str, h: int) -> torch.Tensor:  # [h, n, hd]
        return (x @ w[f"midlayer.self_attn.{name}.weight"].T).view(n, h, hd).transpose(0, 1)

    q, k = rotate(proj("q_proj", heads), proj("k_proj", kvh))
    v = proj("v_proj", kvh)
    k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    residual = feats
    if cfg.get("norm_before_residual"):
        residual = rms(feats, w["midlayer.hidden_norm.weight"], eps)
    h = att.transpose(0, 1).reshape(n, -1) @ w["midlayer.self_attn.o_proj.weight"].T + residual
    y = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = y @ w["midlayer.mlp.gate_proj.weight"].T, y @ w["midlayer.mlp.up_proj.weight"].T
    pre = (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T + h
    return rms(pre, w["norm.weight"], eps) @ w["lm_head.weight"].T, pre
