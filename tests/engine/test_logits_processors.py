"""Custom logits processors (`LLM(logits_processors=[...])`, vLLM's interface).

- Batch indices: processors that force a per-request token see each sequence at its index
  through arrivals, finishes, condensing moves, n > 1 and preemption (a wrong index forces
  another request's token); requests without arguments decode as without processors.
- Per-request callables (AdapterLogitsProcessor) read the live output and prompt ids.
- Argmax-invariant processors run on the random rows' path only.
- Each request's params are checked when it arrives (ValueError, the engine serves on);
  what is refused is refused by name; TP = 2 equals one process.
- The bookkeeping itself against a reference, over random arrivals and finishes.
"""

from __future__ import annotations

import random

import pytest
import torch
from custom_logits_processors import ForceToken, NoPromptTokens, NoRepeat, TopTwo

from paged_engine import LLM, SamplingParams
from paged_engine.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    apply_batch_update,
)
from paged_engine.worker.logits_processors import CustomLogitsProcessors

pytest.importorskip("transformers")


def _llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(path), dtype="float32", block_size=8, **kw)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randint(2, 30))]}
        for _ in range(n)
    ]


def _forcing_params(n: int, seed: int = 0) -> list[SamplingParams]:
    """Every other request forces its own token; lengths differ, so requests finish at
    different steps and the batch condenses."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        args = {"target_token": 100 + i} if i % 2 == 0 else None
        out.append(
            SamplingParams(
                temperature=0 if i % 3 else 0.9,
                seed=i,
                max_tokens=rng.randint(3, 20),
                ignore_eos=True,
                extra_args=args,
            )
        )
    return out


@pytest.mark.parametrize("spec", ["class", "name", "dotted"])
def test_forced_tokens_follow_their_requests(tiny_llama_dir, spec):
    processor = {
        "class": ForceToken,
        "name": "custom_logits_processors:ForceToken",
        "dotted": "custom_logits_processors.ForceToken",
    }[spec]
    prompts, params = _prompts(12), _forcing_params(12)
    params[3] = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    params[4] = SamplingParams(
        n=2, temperature=0.8, seed=4, max_tokens=7, ignore_eos=True, extra_args={"target_token": 7}
    )
    # four sequences at a time: arrivals fill freed indices, finishes condense the batch
    kw = {"max_num_seqs": 4, "num_gpu_blocks_override": 14, "max_model_len": 64}
    plain = _llm(tiny_llama_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama_dir, logits_processors=[processor], **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for p, o, ref in zip(params, got, plain):
        target = (p.extra_args or {}).get("target_token")
        for c, r in zip(o.outputs, ref.outputs):
            if target is None:
                assert c.token_ids == r.token_ids  # untouched requests decode as without
            else:
                assert set(c.token_ids) == {target}
        assert len(o.outputs) == p.n


def test_per_request_callables_read_the_live_ids(tiny_llama_dir):
    """NoRepeat bans every token the sequence has output so far (its live output ids: a
    stale list would let repeats through); NoPromptTokens bans the prompt's tokens (the
    three-argument form, returning a new row)."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 8}, {"prompt_token_ids": [40, 41] * 9}] * 2
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, extra_args=a)
        for a in ({"no_repeat": True}, {"no_repeat": True}, {"no_prompt_tokens": True}, None)
    ]
    plain = _llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama_dir, logits_processors=[NoRepeat, NoPromptTokens])
    got = llm.generate(prompts, params, use_tqdm=False)
    for o in got[:2]:
        ids = o.outputs[0].token_ids
        assert len(set(ids)) == len(ids) == 40
    assert len(set(plain[0].outputs[0].token_ids)) < 40  # the model alone repeats
    assert not set(got[2].outputs[0].token_ids) & {40, 41}
    assert got[3].outputs[0].token_ids == plain[3].outputs[0].token_ids


def test_argmax_invariant_processors_run_for_random_rows_only(tiny_llama_dir):
    TopTwo.calls = 0
    prompts = _prompts(4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    plain = _llm(tiny_llama_dir).generate(prompts, greedy, use_tqdm=False)
    llm = _llm(tiny_llama_dir, logits_processors=[TopTwo])
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert TopTwo.calls == 0  # never on an all-greedy step
    sampled = SamplingParams(temperature=1.5, seed=1, max_tokens=24, ignore_eos=True, logprobs=1)
    for o in llm.generate(prompts, sampled, use_tqdm=False):
        c = o.outputs[0]
        assert all(lp[t].rank <= 2 for t, lp in zip(c.token_ids, c.logprobs))
    assert TopTwo.calls > 0


def test_params_are_checked_on_arrival(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, logits_processors=[ForceToken])
    bad = SamplingParams(max_tokens=4, extra_args={"target_token": "x"})
    with pytest.raises(ValueError, match="target_token"):
        llm.generate(["hi"], bad, use_tqdm=False)
    ok = SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"target_token": 9})
    (out,) = llm.generate(["hi"], ok, use_tqdm=False)
    assert out.outputs[0].token_ids == [9] * 4


def test_refusals(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"logits_processors\[1\].*NotAProcessor.*subclass"):
        _llm(
            tiny_llama_dir, logits_processors=[ForceToken, "custom_logits_processors:NotAProcessor"]
        )
    with pytest.raises(ValueError, match=r"logits_processors\[0\]='nowhere:X' cannot be loaded"):
        _llm(tiny_llama_dir, logits_processors=["nowhere:X"])
    with pytest.raises(ValueError, match="speculative_config"):
        _llm(
            tiny_llama_dir,
            logits_processors=[ForceToken],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="async_scheduling=True"):
        _llm(tiny_llama_dir, logits_processors=[ForceToken], async_scheduling=True)
    with pytest.raises(ValueError, match="AdapterLogitsProcessor"):
        SamplingParams(logits_processors=[lambda ids, row: row])  # vLLM v0's per request


def test_tensor_parallel_matches_one_process(tiny_llama_dir):
    prompts, params = _prompts(6, seed=2), _forcing_params(6, seed=2)
    params[1] = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, extra_args={"no_repeat": True}
    )
    procs = ["custom_logits_processors:ForceToken", NoRepeat]
    one = _llm(tiny_llama_dir, logits_processors=procs).generate(prompts, params, use_tqdm=False)
    two = _llm(tiny_llama_dir, logits_processors=procs, tensor_parallel_size=2).generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert set(one[0].outputs[0].token_ids) == {100}


class _Mirror(LogitsProcessor):
    """Keeps {index: tag} from BatchUpdates alone, as a processor must."""

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.tags: dict[int, int] = {}
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.tags, batch_update, lambda p, prompt, out: p.extra_args["tag"])
        if batch_update is not None:
            self.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@pytest.mark.parametrize("seed", range(4))
def test_batch_indices_against_a_reference(seed):
    """Random arrivals and finishes: after each update a processor that knows only the
    BatchUpdates maps every index to the sequence there, indices are dense, moves are
    one-way and freed indices are refilled lowest first."""
    rng = random.Random(seed)
    procs = CustomLogitsProcessors([_Mirror], None, torch.device("cpu"))
    mirror = procs.procs[0]
    live: list[int] = []
    next_id = 0
    for _ in range(200):
        for seq_id in rng.sample(live, rng.randint(0, len(live))):
            procs.remove(seq_id)
            live.remove(seq_id)
        for _ in range(rng.randint(0, 3)):
            params = SamplingParams(extra_args={"tag": next_id})
            procs.add(next_id, params, [1], [])
            live.append(next_id)
            next_id += 1
        procs.update()
        assert sorted(procs.seq_at) == sorted(live) and None not in procs.seq_at
        assert mirror.tags == dict(enumerate(procs.seq_at))
        assert all(procs.index[s] == i for i, s in enumerate(procs.seq_at))
        if live:
            assert mirror.batch_size == len(live)


def test_moves_are_one_way():
    procs = CustomLogitsProcessors([_Mirror], None, torch.device("cpu"))
    seen: list[BatchUpdate | None] = []
    procs.procs[0].update_state = seen.append  # type: ignore[method-assign]
    for s in range(4):
        procs.add(s, SamplingParams(), [], [])
    procs.update()
    procs.remove(0)
    procs.remove(2)
    procs.update()
    update = seen[-1]
    assert update is not None and update.batch_size == 2
    assert list(update.removed) == [0, 2] and not update.added
    assert list(update.moved) == [(3, 0, MoveDirectionality.UNIDIRECTIONAL)]
    procs.update()
    assert seen[-1] is None  # nothing changed
