"""Checks shared by the hybrid models' tests (test_models_hybrid.py, test_models_lfm2.py): tiny
model directories per case, HF parity of greedy tokens and logprobs, forks against n = 1, and
prefix caching from state snapshots against an engine without it."""

from __future__ import annotations

import random

import pytest
from hf_reference import assert_matches, hf_greedy, load_hf_model

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

MAX_TOKENS = 10
# The interpreted Triton kernels' runs, where every token of every step costs: in prefill chunks
# of 16, a prompt of 16 + 4 tokens (two KV blocks; the second chunk spans a whole conv window
# past the carried one) beside one of a single token, then two decode steps (the second reading
# the state the first wrote).
TRITON_PROMPT_LENS = (20, 1)
TRITON_MAX_TOKENS = 3
TOP = 5
# Nemotron 3's MoE blocks on a tiny Nemotron-H: DeepSeek-V3's router over 2 groups, non-gated
# relu^2 experts and shared experts (write_tiny_model overrides)
NEMOTRON_MOE = {
    "layers_block_type": ["mamba", "moe", "attention", "mamba", "moe"],
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
}


def random_prompts(seed: int, lengths=(5, 23, 70, 1)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def token_requests(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tiny_dirs(tmp_path_factory, cases: dict[str, tuple[str, dict]]):
    """name -> the directory of `cases[name]` = (tiny arch, config overrides), written once."""
    cache = {}

    def make(name: str):
        if name not in cache:
            arch, overrides = cases[name]
            cache[name] = write_tiny_model(tmp_path_factory.mktemp(name), arch, seed=1, **overrides)
        return cache[name]

    return make


def assert_greedy_matches_hf(name, path, backend: str, budget: int | None) -> LLM:
    """HF generate's greedy tokens and top-5 logprobs (1e-3, float32) on prompts of 1 to 70
    tokens, MAX_TOKENS each (on the interpreted Triton kernels, which walk tokens one by one:
    prompts of 20 and 1 tokens, 3 tokens each, still chunked prefills and decode steps), whole
    or in prefill chunks of `budget`. Returns the engine."""
    triton = backend == "triton"
    prompts = random_prompts(7, TRITON_PROMPT_LENS if triton else (5, 23, 70, 1))
    max_tokens = TRITON_MAX_TOKENS if triton else MAX_TOKENS
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, max_tokens, TOP) for p in prompts]
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, attention_backend=backend, **kw)
    config = llm.llm_engine.config
    assert config.enable_prefix_caching and config.prefix_state_snapshots == config.max_num_seqs
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(token_requests(prompts), params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_matches(f"{name}-{i}", out, ref)
    return llm


def assert_beam_search_matches_hf(path, **generate_kw) -> None:
    """Beam search (width 3, 6 tokens) gives HF's beams on prompts of 5 and 23 tokens: each
    beam carries its own recurrent state (a new beam copies its parent's row). `generate_kw`:
    more arguments of HF's generate."""
    import torch

    from paged_engine import BeamSearchParams

    hf = load_hf_model(path)
    prompts = random_prompts(11, (5, 23))
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    for prompt, out in zip(prompts, llm.beam_search(token_requests(prompts), params), strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                num_beams=3,
                num_return_sequences=3,
                max_new_tokens=6,
                do_sample=False,
                length_penalty=1.0,
                early_stopping=False,
                **generate_kw,
            )
        assert [s.tokens[len(prompt) :] for s in out.sequences] == [
            r[len(prompt) :].tolist() for r in ref
        ]


def mixed_params(count: int, max_tokens: int) -> list[SamplingParams]:
    """Greedy and seeded sampling; n = 3 requests fork (and, preempted, share their prefix
    again)."""
    return [
        SamplingParams(
            temperature=1.0 if i % 2 == 0 else 0,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=True,
            n=3 if i % 3 == 0 else 1,
        )
        for i in range(count)
    ]


def assert_preemption_keeps_outputs(path) -> None:
    """Requests sharing a system prompt, in waves (later waves resume from earlier snapshots),
    greedy and sampled, n = 3 among them, preempted (recompute) in a pool of 24 blocks, with
    async scheduling off and on: the outputs of an engine without prefix caching, and no state
    row leaked."""
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [
        system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(14)
    ]
    params = mixed_params(len(prompts), 20)

    def run(**kw):
        llm = LLM(model=str(path), dtype="float32", max_model_len=128, **kw)
        outs = []
        for lo in range(0, len(prompts), 7):
            wave = slice(lo, lo + 7)
            outs += llm.generate(token_requests(prompts[wave]), params[wave], use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], llm.llm_engine.scheduler

    want, _ = run(prefix_state_snapshots=0)
    for async_scheduling in (False, True):
        got, scheduler = run(
            num_gpu_blocks_override=24,
            max_num_batched_tokens=32,
            async_scheduling=async_scheduling,
            prefix_state_snapshots=8,  # auto would fit none in 24 blocks
        )
        slots = scheduler.state_slots
        assert scheduler.num_preemptions > 0 and slots.snapshot_hits > 0
        assert got == want
        assert slots.num_free == slots.num_slots


def assert_chat_turns_keep_outputs(path) -> None:
    """Six chats sharing a system prompt, three turns, each turn one `generate` of every chat's
    history plus a new message; greedy and seeded answers of 18-40 tokens (one stops early on a
    token id, one is n = 2). With prefix caching (sync; async with preemption in a pool of 40
    blocks and prefill chunks of 32) the answers equal those of an engine without it, and later
    turns resume past the previous prompt (at a decode snapshot) where the model allows it."""
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(20)]

    def run(**kw):
        llm = LLM(model=str(path), dtype="float32", max_model_len=256, **kw)
        chats = [list(system) for _ in range(6)]
        answers, resumed = [], 0
        prompt_lens = [0] * len(chats)  # each chat's previous prompt
        turn_rng = random.Random(6)
        for turn in range(3):
            for chat in chats:
                chat += [turn_rng.randrange(3, 500) for _ in range(turn_rng.randrange(3, 12))]
            params = [
                SamplingParams(
                    temperature=0 if i % 2 else 0.8,
                    seed=10 * turn + i,
                    max_tokens=18 + 4 * i,
                    ignore_eos=True,
                    stop_token_ids=[7] if i == 4 else None,
                    n=2 if i == 5 else 1,
                )
                for i in range(len(chats))
            ]
            outs = llm.generate(token_requests(chats), params, use_tqdm=False)
            for i, (chat, out) in enumerate(zip(chats, outs, strict=True)):
                answers.append([c.token_ids for c in out.outputs])
                # past the previous prompt's last full block: a decode snapshot
                resumed += out.num_cached_tokens > prompt_lens[i] // 16 * 16 > 0
                prompt_lens[i] = len(chat)
                chat += out.outputs[0].token_ids
        return answers, resumed, llm.llm_engine.scheduler

    want, _, _ = run(prefix_state_snapshots=0)
    for kw in (
        {},
        {
            "async_scheduling": True,
            "num_gpu_blocks_override": 40,
            "max_num_batched_tokens": 32,
            "prefix_state_snapshots": 8,
        },
    ):
        got, resumed, scheduler = run(**kw)
        assert got == want, kw
        slots = scheduler.state_slots
        assert slots.num_free == slots.num_slots and not slots._held
        assert (slots.decode_snapshots > 0) is slots.past_prompt
        if not kw:
            assert (resumed > 0) is slots.past_prompt


def assert_greedy_forks_equal_one(llm: LLM) -> list:
    """n = 3 greedy samples each equal the single greedy output; returns the requests."""
    reqs = token_requests(random_prompts(3, (5, 23, 40)))
    one = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    three = llm.generate(reqs, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
    for a, b in zip(one, three, strict=True):
        assert [c.token_ids for c in b.outputs] == [a.outputs[0].token_ids] * 3
    return reqs


def _chat_workload(llm: LLM, params: SamplingParams) -> list:
    """One request at a time: a system prompt with four user messages (the second request
    leaves a snapshot where the prompts diverge, the next ones resume there), the first prompt
    again, and the first conversation's next turn."""
    rng = random.Random(3)
    system = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(n)] for n in (13, 7, 21, 5)]
    prompts.append(prompts[0])
    outs = []
    for prompt in prompts:
        outs += llm.generate(token_requests([prompt]), params, use_tqdm=False)
    turn = prompts[0] + list(outs[0].outputs[0].token_ids) + [7, 8, 9]
    return outs + llm.generate(token_requests([turn]), params, use_tqdm=False)


# block_size 16: the system prompt's 2 full blocks, then the first prompt's 3; the next turn
# resumes at the first answer's decode snapshot (53 prompt + 11 computed output tokens: 4 blocks)
CHAT_HITS = [0, 0, 32, 32, 48, 64]
# ... for a model whose prompt tokens update the state their own way (Mamba2 with a dt limit):
# no decode snapshots, so the next turn resumes where the first prompt's last full block ends
PROMPT_CHAT_HITS = [0, 0, 32, 32, 48, 48]


def assert_snapshots_keep_outputs(path, hits: list[int] | str | None = "auto", **kw) -> LLM:
    """The chat workload with prefix caching (engine options `kw`) gives the tokens and
    logprobs (1e-4) of an engine without it, taking `hits` tokens from the cache per request
    ("auto": CHAT_HITS, or PROMPT_CHAT_HITS for a model that snapshots prompt tokens only;
    None: not checked); no state row is left taken. Returns the engine."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    plain = LLM(model=str(path), dtype="float32", max_model_len=256, prefix_state_snapshots=0)
    assert plain.llm_engine.config.enable_prefix_caching is False
    want = _chat_workload(plain, params)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, **kw)
    got = _chat_workload(llm, params)
    slots = llm.llm_engine.scheduler.state_slots
    if hits == "auto":
        hits = CHAT_HITS if slots.past_prompt else PROMPT_CHAT_HITS
    if hits is not None:
        assert [o.num_cached_tokens for o in got] == hits
        assert slots.snapshot_hits == sum(map(bool, hits))
    else:
        assert slots.snapshot_hits > 0
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, i
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys(), i
            for t in x:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4), i
    assert slots.num_free == slots.num_slots
    return llm


def assert_runs_match_hf(name, path, runs, check=None) -> None:
    """For each (backend, prefill budget or None) in `runs`, an engine with a pool of 64 blocks
    gives HF generate's greedy tokens and top-5 logprobs (1e-3, float32) on prompts of 1 to 70
    tokens, MAX_TOKENS each (interpreted Triton: TRITON_PROMPT_LENS, TRITON_MAX_TOKENS each); HF
    runs each prompt once. `check(llm, hf)` then looks at each engine."""
    hf = load_hf_model(path)
    refs = {}
    for backend, budget in runs:
        triton = backend == "triton"  # interpreted: shorter prompts, fewer tokens
        prompts = random_prompts(7, TRITON_PROMPT_LENS if triton else (5, 23, 70, 1))
        max_tokens = TRITON_MAX_TOKENS if triton else MAX_TOKENS
        for p in prompts:
            if (tuple(p), max_tokens) not in refs:
                refs[tuple(p), max_tokens] = hf_greedy(hf, p, max_tokens, TOP)
        kw = {} if budget is None else {"max_num_batched_tokens": budget}
        llm = LLM(
            model=str(path),
            dtype="float32",
            max_model_len=128,
            attention_backend=backend,
            num_gpu_blocks_override=64,
            **kw,
        )
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
        outs = llm.generate(token_requests(prompts), params, use_tqdm=False)
        for i, (out, p) in enumerate(zip(outs, prompts, strict=True)):
            assert_matches(f"{name}-{backend}-{budget}-{i}", out, refs[tuple(p), max_tokens])
        if check is not None:
            check(llm, hf)
        del llm


def copy_with_equal_blocks(src, dst, block: str, first: dict[int, int]):
    """A copy of the checkpoint directory `src` at `dst` in which every layer i's copy of a
    shared block (tensors `model.layers.{i}.{block}.*`) is layer first[i]'s. Returns `dst`."""
    import re

    import safetensors.torch

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    shared = re.compile(rf"model\.layers\.(\d+)\.{re.escape(block)}\.(.*)")
    tensors = safetensors.torch.load_file(dst / "model.safetensors")
    for name in tensors:
        match = shared.fullmatch(name)
        if match is not None:
            layer, rest = first[int(match.group(1))], match.group(2)
            tensors[name] = tensors[f"model.layers.{layer}.{block}.{rest}"].clone()
    safetensors.torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def tie_embeddings(path):
    """The checkpoint directory `path` rewritten in place as a tied model's: its config ties the
    embeddings (and with them, in transformers 5, the copies of a shared block), lm_head.weight
    dropped. Returns `path`."""
    import json

    import safetensors.torch

    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    tensors.pop("lm_head.weight", None)
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
