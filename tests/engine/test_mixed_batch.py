"""Mixed batches: every per-request feature sharing one batch must leave each request's output
as it is when the request is served alone, and leave nothing behind.

One seed draws a few dozen requests over a tiny llama (greedy, seeded, n > 1, best_of, beam
search, logprobs and prompt logprobs, penalties, logit_bias, min_tokens, stop strings and stop
token ids, bad_words, allowed_token_ids, structured outputs, two LoRA adapters, prompts sharing
heads for prefix-cache hits, prompts that run into max_model_len). Each request is first served
alone, one at a time, on an engine of the configuration under test; then all of them together
(about half streamed as deltas), and again with a random third aborted mid-flight. Tokens,
texts and finish reasons must be identical, logprobs (the sampled tokens' and the top-k's)
within 1e-4; once idle the engine holds no block and no per-request state (engine_state.py's
structures, the draft planner's, the LoRA users).

CONFIGS: prefix caching and chunked prefill off; small per-step budgets; pools small enough to
preempt (recompute, swap, a CPU prefix-cache tier); async scheduling; priority scheduling; an
fp8 KV cache with 8-token blocks; tensor parallelism over 2 ranks (MultiprocExecutor); one LoRA
slot for two adapters; speculation (n-gram, suffix decoding, a draft model), also async and
preempting. A test through AsyncLLM adds consumers that leave early (which aborts).

Seeded requests under speculation match only where nothing can change the drafts a row is
offered (`_exact_seeded`): the rejection rule is exact in distribution, and a row's drafts
depend on the token budget left in its step, on free blocks and (suffix decoding) on other
requests' outputs; greedy requests match everywhere. The adapters keep alpha == rank: with
alpha 4x the rank, batch-shaped float32 GEMMs in the LoRA path moved a logprob by 2e-4 once.

`python tests/engine/test_mixed_batch.py CONFIG[,CONFIG|all|async-llm] FIRST COUNT [REQUESTS]`
runs more seeds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from paged_engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from paged_engine.core.scheduler import SchedulerStuckError
from paged_engine.sampling_params import RequestOutputKind, StructuredOutputsParams

MAX_MODEL_LEN = 128
LO, HI = 3, 200  # prompt tokens: the tiny vocabulary less its specials
MAX_STEPS = 4000
ABS_TOL = 1e-4
STATS = False
DTYPE = "float32"
COUNT = 24

CONSTRAINTS = (
    {"choice": ["yes", "no", "maybe"]},
    {"regex": r"[a-z]{2,4}-[0-9]{2}"},
    {
        "json": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "integer"}},
            "required": ["k", "v"],
        },
        "disable_any_whitespace": True,
    },
)

LORAS: list[dict[str, Any]] = [dict(rank=4, alpha=4, seed=0), dict(rank=8, alpha=8, seed=1)]
BASE: dict[str, Any] = {
    "enable_lora": True,
    "max_loras": 2,
    "max_lora_rank": 8,
    "cpu_num_threads": 1,  # (tiny tensors: threads only contend)
}
# name -> engine options on top of BASE
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-cache-no-chunk": {"enable_prefix_caching": False, "enable_chunked_prefill": False},
    "chunked": {"max_num_batched_tokens": 24, "max_num_seqs": 6},
    "preempt": {"num_gpu_blocks_override": 14, "max_num_batched_tokens": 48},
    "swap": {"num_gpu_blocks_override": 14, "preemption_mode": "swap", "swap_space": 0.01},
    "async": {"async_scheduling": True, "num_gpu_blocks_override": 20},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "suffix": {"speculative_config": {"method": "suffix", "num_speculative_tokens": 3}},
    "async-ngram": {
        "async_scheduling": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        "num_gpu_blocks_override": 16,
    },
    "async-draft": {
        "async_scheduling": True,
        "speculative_config": {"model": "<draft>", "num_speculative_tokens": 2},
        "max_num_batched_tokens": 24,
    },
    "priority": {
        "scheduling_policy": "priority",
        "num_gpu_blocks_override": 13,
        "max_num_seqs": 5,
    },
    # fp8 KV cache (alone and in the batch the same quantized cache), 8-token blocks, and a CPU
    # tier for the prefix cache behind a small pool
    "fp8-kv": {"kv_cache_dtype": "fp8", "block_size": 8, "num_gpu_blocks_override": 28},
    "cpu-offload": {
        "cpu_offload_gib": 0.01,
        "num_gpu_blocks_override": 14,
        "max_loras": 1,
        "max_cpu_loras": 1,
    },
    "tp2": {"tensor_parallel_size": 2, "num_gpu_blocks_override": 16},
    "draft": {"speculative_config": {"model": "<draft>", "num_speculative_tokens": 2}},
    # everything tight at once: one LoRA slot for two adapters, few rows, a small budget
    "tight": {
        "num_gpu_blocks_override": 12,
        "max_num_batched_tokens": 20,
        "max_num_seqs": 3,
        "max_loras": 1,
    },
    "tight-async": {
        "num_gpu_blocks_override": 12,
        "max_num_batched_tokens": 20,
        "max_num_seqs": 4,
        "max_loras": 1,
        "async_scheduling": True,
        "preemption_mode": "swap",
        "swap_space": 0.01,
    },
    "ngram-tight": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
        "num_gpu_blocks_override": 12,
        "max_num_batched_tokens": 20,
        "max_num_seqs": 4,
    },
    "suffix-preempt": {
        "speculative_config": {"method": "suffix", "num_speculative_tokens": 4},
        "num_gpu_blocks_override": 13,
        "max_num_batched_tokens": 32,
    },
    "draft-preempt": {
        "speculative_config": {"model": "<draft>", "num_speculative_tokens": 3},
        "num_gpu_blocks_override": 13,
        "max_num_batched_tokens": 32,
    },
}


@dataclass
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams | BeamSearchParams
    lora: LoRARequest | None = None
    abort_at: int | None = None  # the step before which it is aborted (abort runs only)
    priority: int = 0  # with scheduling_policy="priority"


@dataclass
class Result:
    tokens: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # each sampled token's
    prompt_logprobs: list[float] = field(default_factory=list)  # each prompt token's
    top: list[list[dict[int, float]]] = field(default_factory=list)  # each sampled position's
    prompt_top: list[dict[int, float]] = field(default_factory=list)
    refused: str | None = None  # add_request's ValueError
    done: bool = False


@dataclass
class Model:
    path: str
    draft: str
    adapters: list[LoRARequest]
    texts: list[str]  # single-token texts, for stop strings and bad words


def write_models(root: Path) -> Model:
    from paged_engine.testing import write_lora_adapter, write_tiny_model

    path = write_tiny_model(root / "model", "llama", seed=3)
    draft = write_tiny_model(root / "draft", "llama", seed=4)
    for f in path.glob("tokenizer*"):  # (the tokenizer is trained per seed: share the target's)
        shutil.copy(f, draft / f.name)
    adapters = [
        LoRARequest(f"a{k}", k + 1, str(write_lora_adapter(root / f"a{k}", path, **kw)))
        for k, kw in enumerate(LORAS)
    ]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    texts = [t for t in (tok.decode([i]) for i in range(LO, HI)) if t.strip()]
    return Model(str(path), str(draft), adapters, texts)


def draw_jobs(rng: random.Random, model: Model, count: int) -> list[Job]:
    heads = [[rng.randrange(LO, HI) for _ in range(rng.randint(17, 40))] for _ in range(2)]
    jobs = []
    for i in range(count):
        tail = [rng.randrange(LO, HI) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.5:
            prompt = rng.choice(heads)[: rng.randint(8, 40)] + tail
        else:  # repeats: n-gram and suffix drafts find matches
            prompt = tail * rng.randint(1, 3)
        if rng.random() < 0.1:  # runs into max_model_len
            prompt = (prompt * 8)[: MAX_MODEL_LEN - rng.randint(2, 12)]
        else:
            prompt = prompt[:80]
        lora = rng.choice([None, None, *model.adapters])
        job = Job(f"r{i}", prompt, _draw_params(rng, model), lora, priority=rng.randint(0, 3))
        jobs.append(job)
    return jobs


def _draw_params(rng: random.Random, model: Model) -> SamplingParams | BeamSearchParams:
    max_tokens = rng.randint(1, 24)
    kind = rng.random()
    if kind < 0.08:
        return BeamSearchParams(beam_width=rng.randint(2, 3), max_tokens=max_tokens)
    p: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.8}
    if kind < 0.5:
        p["temperature"] = 0.0
        p["n"] = rng.choice([1, 1, 1, 2])
    else:
        p.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 30))
        p["n"] = rng.choice([1, 1, 2, 3])
        if rng.random() < 0.2:
            p["best_of"] = p["n"] + rng.randint(0, 2)
        if rng.random() < 0.3:
            p["top_k"] = rng.randint(2, 30)
        if rng.random() < 0.3:
            p["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.2:
            p["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.4:
        p["logprobs"] = rng.choice([0, 2, 5])
    if rng.random() < 0.2:
        p["prompt_logprobs"] = rng.choice([0, 3])

    def toks(k: int) -> list[int]:
        return [rng.randrange(LO, HI) for _ in range(k)]

    if rng.random() < 0.2:
        p["presence_penalty"] = rng.uniform(-1, 1.5)
    if rng.random() < 0.2:
        p["frequency_penalty"] = rng.uniform(-1, 1.5)
    if rng.random() < 0.2:
        p["repetition_penalty"] = rng.choice([0.8, 1.2, 1.5])
    if rng.random() < 0.2:
        p["logit_bias"] = {t: rng.choice([-100.0, -3.0, 4.0, 100.0]) for t in toks(3)}
    if rng.random() < 0.2:
        p["min_tokens"] = rng.randint(0, max_tokens)
        p["ignore_eos"] = False
    if rng.random() < 0.15:  # one or two tokens' texts
        p["stop"] = [rng.choice(model.texts) + rng.choice(["", *model.texts]) for _ in range(2)]
        p["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.15:
        p["stop_token_ids"] = toks(4)
    if rng.random() < 0.15:
        p["structured_outputs"] = StructuredOutputsParams(**rng.choice(CONSTRAINTS))
        p.pop("logit_bias", None)  # (a -100 bias could forbid every token the grammar allows)
    else:
        if rng.random() < 0.1:
            p["bad_words"] = [rng.choice(model.texts).strip() for _ in range(2)]
        if rng.random() < 0.1:
            p["allowed_token_ids"] = toks(rng.randint(2, 30))
    return SamplingParams(**p)


def engine(model: Model, name: str) -> LLM:
    options = dict(BASE) | CONFIGS[name]
    spec = options.get("speculative_config")
    if spec is not None and spec.get("model") == "<draft>":
        options["speculative_config"] = dict(spec, model=model.draft)
    return LLM(model=model.path, dtype=DTYPE, max_model_len=MAX_MODEL_LEN, seed=0, **options)


def drive(
    llm: LLM, jobs: list[Job], aborts: bool = False, stream: set[str] | None = None
) -> dict[str, Result]:
    """Add every job, step to idle (aborting jobs at their abort_at step when `aborts`); the
    finished jobs' results. Jobs named in `stream` come as deltas, joined here."""
    eng = llm.llm_engine
    stream = stream or set()
    ranked = eng.config.scheduling_policy == "priority"
    results: dict[str, Result] = {}
    for job in jobs:
        params = job.params
        if job.request_id in stream:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        try:
            eng.add_request(
                job.request_id,
                {"prompt_token_ids": job.prompt},
                params,
                final_only=job.request_id not in stream,
                lora_request=job.lora,
                priority=job.priority if ranked else 0,
            )
        except ValueError as e:  # (n > max_num_seqs): refused alone as in a batch
            results[job.request_id] = Result(refused=str(e))
    pending = sorted((j for j in jobs if aborts and j.abort_at is not None), key=_abort_step)
    step = 0
    while eng.has_unfinished_requests() or eng.can_step():
        while pending and _abort_step(pending[0]) <= step:
            eng.abort_request(pending.pop(0).request_id)
        try:
            outs = eng.step()
        except SchedulerStuckError as e:  # outgrew the pool alone: fails alone (a 400 served)
            assert e.request_ids, e
            eng.abort_request(e.request_ids)
            for rid in e.request_ids:
                results[rid] = Result(refused="outgrew the pool")
            outs = []
        for out in outs:
            if results.get(out.request_id, Result()).refused is not None:
                continue
            r = results.setdefault(out.request_id, Result())
            _add(r, out, out.request_id in stream)
            r.done = out.finished
        step += 1
        assert step < MAX_STEPS, "not idle after MAX_STEPS steps"
    for job in pending:  # finished before its abort: aborting it now must be harmless
        eng.abort_request(job.request_id)
    return {k: r for k, r in results.items() if r.done or r.refused is not None}


def _abort_step(job: Job) -> int:
    return job.abort_at if job.abort_at is not None else -1


def _add(r: Result, out: Any, delta: bool) -> None:
    """Take `out` into `r`: in place of what it held (in its order), or a delta appended by
    completion index."""
    if not delta:
        r.tokens, r.texts, r.finish, r.logprobs, r.top = [], [], [], [], []
    for k, c in enumerate(out.outputs):
        if delta:
            k = c.index
        while len(r.tokens) <= k:
            r.tokens.append([])
            r.texts.append("")
            r.finish.append(None)
            r.logprobs.append([])
            r.top.append([])
        r.tokens[k] += list(c.token_ids)
        r.texts[k] += c.text
        r.finish[k] = c.finish_reason
        lps = c.logprobs or []
        r.logprobs[k] += [lp[t].logprob for lp, t in zip(lps, c.token_ids)]
        r.top[k] += [{t: x.logprob for t, x in lp.items()} for lp in lps]
    if getattr(out, "prompt_logprobs", None):
        ids = out.prompt_token_ids
        r.prompt_logprobs = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])]
        r.prompt_top = [{t: x.logprob for t, x in lp.items()} for lp in out.prompt_logprobs[1:]]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=ABS_TOL) for x, y in zip(a, b))


def _same_top(a: dict[int, float], b: dict[int, float]) -> bool:
    """Equal top-k logprob dicts: the same tokens with close values, but for tokens tied (within
    ABS_TOL) at the cut."""
    if not _close([a[t] for t in a if t in b], [b[t] for t in a if t in b]):
        return False
    edge = min(min(a.values(), default=0.0), min(b.values(), default=0.0))
    odd = [v for t, v in a.items() if t not in b] + [v for t, v in b.items() if t not in a]
    return len(a) == len(b) and all(abs(v - edge) <= ABS_TOL for v in odd)


def compare(job: Job, got: Result, want: Result, exact_seeded: bool) -> list[str]:
    if got.refused != want.refused:
        return [f"{job.request_id}: refused {got.refused!r}, alone {want.refused!r}"]
    seeded = isinstance(job.params, SamplingParams) and job.params.temperature > 0
    if seeded and not exact_seeded:
        if len(got.tokens) != len(want.tokens):
            return [f"{job.request_id}: {len(got.tokens)} completions, want {len(want.tokens)}"]
        return []
    where = f"{job.request_id} {_describe(job)}"
    if got.tokens != want.tokens:
        return [f"{where}:\n  tokens {got.tokens}\n  alone  {want.tokens}"]
    problems = []
    if got.texts != want.texts or got.finish != want.finish:
        problems.append(f"{where}: {got.texts, got.finish} != {want.texts, want.finish}")
    flat = [x for row in got.logprobs for x in row], [x for row in want.logprobs for x in row]
    if not _close(*flat) or not _close(got.prompt_logprobs, want.prompt_logprobs):
        problems.append(f"{where}: logprobs {got.logprobs, got.prompt_logprobs}")
        problems.append(f"  alone {want.logprobs, want.prompt_logprobs}")
    tops = [t for row in got.top for t in row] + got.prompt_top
    want_tops = [t for row in want.top for t in row] + want.prompt_top
    if len(tops) != len(want_tops) or not all(map(_same_top, tops, want_tops)):
        problems.append(f"{where}: top logprobs {tops} != {want_tops}")
    return problems


def _describe(job: Job) -> str:
    """`job`'s params less their defaults."""
    params = job.params
    beam = isinstance(params, BeamSearchParams)
    default = type(params)(**({"beam_width": 2, "max_tokens": 16} if beam else {}))
    fields = {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if f.init and getattr(params, f.name) != getattr(default, f.name)
    }
    return f"{type(params).__name__}{fields} lora={job.lora and job.lora.lora_name}"


def leftovers(llm: LLM) -> dict[str, object]:
    """engine_state.leftovers, plus the speculation planner's and LoRA's per-request state."""
    from engine_state import leftovers as engine_leftovers  # tests/engine_state.py

    eng = llm.llm_engine
    left = engine_leftovers(eng)
    extra: dict[str, Any] = {"scheduler.adapters_held": eng.scheduler.adapters_held}
    planner = eng.draft_planner
    if planner is not None:
        extra |= {"planner._backoff": planner._backoff, "planner._texts": planner._texts}
        if planner.suffix is not None:
            extra["suffix._texts"] = planner.suffix._texts
    if eng.lora_registry is not None:
        extra["lora in_use"] = eng.lora_registry.in_use()
    return left | {k: len(v) for k, v in extra.items() if len(v)}


def _exact_seeded(options: dict[str, Any]) -> bool:
    """Whether seeded requests must match token for token: always without speculation; with
    it, a row's drafts depend on the step's token budget left and on free blocks (which rows
    draft), and suffix decoding drafts from other requests' outputs, so only where none of
    those can differ between a request alone and in the batch."""
    spec = options.get("speculative_config")
    if spec is None:
        return True
    tight = "max_num_batched_tokens" in options or "num_gpu_blocks_override" in options
    return spec.get("method") != "suffix" and not tight


def run(model: Model, name: str, seed: int, count: int = COUNT) -> list[str]:
    """One seed of config `name`: problems found (empty: none)."""
    rng = random.Random(f"{name} {seed}")
    jobs = draw_jobs(rng, model, count)
    llm = engine(model, name)
    try:
        alone: dict[str, Result] = {}
        problems: list[str] = []
        for job in jobs:
            alone |= drive(llm, [job])
            left = leftovers(llm)
            if left:
                problems.append(f"after {job.request_id} alone: {left}")
        exact_seeded = _exact_seeded(CONFIGS[name])
        # about half streamed as deltas (best_of > n only comes whole, as in vLLM)
        stream = {
            j.request_id
            for j in jobs
            if isinstance(j.params, SamplingParams)
            and (j.params.best_of or j.params.n) == j.params.n
            and rng.random() < 0.5
        }
        mixed = drive(llm, jobs, stream=stream)
        for job in jobs:
            if job.request_id not in mixed:
                problems.append(f"{job.request_id}: no final output")
                continue
            problems += compare(job, mixed[job.request_id], alone[job.request_id], exact_seeded)
        left = leftovers(llm)
        if left:
            problems.append(f"after the mixed batch: {left}")
        for job in jobs:  # a third aborted at random steps; the others as alone
            job.abort_at = rng.randint(0, 30) if rng.random() < 0.35 else None
        cut = drive(llm, jobs, aborts=True, stream=stream)
        for job in jobs:
            if job.abort_at is None:
                got = cut.get(job.request_id)
                if got is None:
                    problems.append(f"{job.request_id}: no final output in the abort run")
                else:
                    problems += compare(job, got, alone[job.request_id], exact_seeded)
        left = leftovers(llm)
        if left:
            problems.append(f"after the abort run: {left}")
        if STATS:
            eng = llm.llm_engine
            planner = eng.draft_planner
            print(
                f"  preemptions {eng.scheduler.num_preemptions}"
                f" swaps {eng.scheduler.num_swap_preemptions}"
                f" cache hits {eng.block_manager.prefix_cache_hits}"
                + (
                    f" drafts {planner.num_draft_tokens} accepted {planner.num_accepted_tokens}"
                    if planner
                    else ""
                )
            )
        return problems
    finally:
        llm.llm_engine.shutdown()


def run_async(model: Model, seed: int, count: int = COUNT) -> list[str]:
    """The same through AsyncLLM (its engine thread, one generator per request, all at once):
    a third of the consumers leave early (which aborts their requests); the others' outputs
    are as alone, and the idle engine holds nothing."""
    from paged_engine.engine.async_llm import AsyncLLM

    rng = random.Random(f"async-llm {seed}")
    jobs = [j for j in draw_jobs(rng, model, count) if isinstance(j.params, SamplingParams)]
    for job in jobs:
        job.abort_at = rng.randint(0, 6) if rng.random() < 0.35 else None
    options = dict(BASE) | {"async_scheduling": True, "num_gpu_blocks_override": 16}
    llm = LLM(model=model.path, dtype=DTYPE, max_model_len=MAX_MODEL_LEN, seed=0, **options)
    try:
        alone = {}
        for job in jobs:
            alone |= drive(llm, [job])
    finally:
        llm.llm_engine.shutdown()
    engine = AsyncLLM(model.path, dtype=DTYPE, max_model_len=MAX_MODEL_LEN, seed=0, **options)

    async def consume(job: Job) -> Result | None:
        delta = rng.random() < 0.5 and (job.params.best_of or job.params.n) == job.params.n
        kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
        params = dataclasses.replace(job.params, output_kind=kind)
        r = Result()
        k = 0
        prompt = {"prompt_token_ids": job.prompt}
        async for out in engine.generate(prompt, params, job.request_id, lora_request=job.lora):
            if job.abort_at is not None and k >= job.abort_at:
                return None  # (leaving the loop aborts the request)
            _add(r, out, delta)
            k += 1
        return r

    async def main() -> tuple[list[Result | None], dict[str, object]]:
        results = await asyncio.gather(*(consume(j) for j in jobs))
        for _ in range(200):  # the early leavers' aborts reach the engine thread after them
            left = await engine._call(lambda e: leftovers(SimpleNamespace(llm_engine=e)))
            if not left and not engine._streams:
                break
            await asyncio.sleep(0.01)
        return results, left | ({"AsyncLLM._streams": 1} if engine._streams else {})

    try:
        results, left = asyncio.run(main())
    finally:
        engine.shutdown()
    problems = [f"left behind: {left}"] if left else []
    for job, got in zip(jobs, results, strict=True):
        if got is not None:
            problems += compare(job, got, alone[job.request_id], exact_seeded=True)
    return problems


def test_async_llm_mixed_batch_with_consumers_leaving(model):
    problems = run_async(model, seed=0)
    assert not problems, "\n".join(problems)


def test_find_stop_matches_only_stops_ending_in_the_new_text():
    """Each stop string's own length bounds how far back a match may start: a short stop that
    lies wholly in text checked before (or skipped under min_tokens) is no match, whatever the
    other stops' lengths (vLLM's check_stop_strings)."""
    from paged_engine.engine.detokenizer import find_stop

    assert find_stop("abcde", 1, ["a", "zzzzzz"], False) is None
    assert find_stop("abcde", 1, ["a"], False) is None
    assert find_stop("abcde", 2, ["d", "zzzzzz"], False) == (3, "d")
    assert find_stop("abcde", 1, ["cde", "a"], True) == (5, "cde")  # straddles old and new


def test_min_tokens_with_stops_of_two_lengths_streams_as_it_ends(model):
    """min_tokens skips stop strings in the first tokens' text; once checks start, a short stop
    there must not match because a longer stop string widens the look-back. Found by the mixed
    batch: a streamed request ('�' and '<|im_end|>' as stops, min_tokens=7) sent text that the
    same request served whole had cut to ''."""
    llm = engine(model, "default")
    try:
        prompt = [40 + k for k in range(12)]
        plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        (whole,) = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)
        text = whole.outputs[0].text
        tok = llm.get_tokenizer()
        ids = whole.outputs[0].token_ids
        min_tokens = 4
        seen = len(tok.decode(ids[:min_tokens]))  # text the checks skip
        first = text[0]
        assert first.strip() and seen > 0
        # the stop matches only at or after `seen` (its earlier occurrences are skipped)
        at = text.find(first, seen)
        want = text if at < 0 else text[:at]
        stops = [first, "\x00" * 16]  # the second never matches; it only widens the window
        job = Job(
            "s",
            prompt,
            SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, stop=stops, min_tokens=min_tokens
            ),
        )
        final = drive(llm, [job])["s"]
        streamed = drive(llm, [job], stream={"s"})["s"]
        assert final.texts == [want]
        assert streamed.texts == final.texts
        assert streamed.tokens == final.tokens
    finally:
        llm.llm_engine.shutdown()


def test_n_request_preempted_before_its_fan_out_lands_shares_its_prompt_again(model):
    """Async scheduling: an n=3 request's last prefill step is in flight (its sample forks it
    into 3 sequences when it lands) when two decodes crossing a block boundary preempt it. Once
    forked it must recompute as a forked request (the first sequence computes the prompt, the
    others share its blocks): recomputing each copy needs 3 x 8 blocks, more than the pool's
    19, and the scheduler failed it as too big for the pool, though alone it fits. Found by
    the mixed batch (config "async", 36 requests, seed 30)."""
    rng = random.Random(7)
    prompt = [rng.randrange(LO, HI) for _ in range(119)]  # 8 blocks: 7 full + 7 tokens
    fork = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    others = [Job(f"a{k}", [rng.randrange(LO, HI) for _ in range(80)], long) for k in range(2)]
    llm = LLM(
        model=model.path,
        dtype=DTYPE,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        async_scheduling=True,
        num_gpu_blocks_override=20,
        cpu_num_threads=1,
    )
    try:
        # 80-token prompts fill 5 blocks each: their first decodes need a 6th each, with b's
        # prefill (8 blocks) in flight and 18 of 19 blocks taken (first: no prefix-cache hits)
        mixed = drive(llm, [*others, Job("b", prompt, fork)])
        assert llm.llm_engine.scheduler.num_preemptions
        assert not leftovers(llm)
        alone = drive(llm, [Job("b", prompt, fork)])["b"]
        assert mixed["b"].refused is None
        assert mixed["b"].tokens == alone.tokens
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    return write_models(tmp_path_factory.mktemp("mixed"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_batch_matches_each_request_alone(model, name):
    problems = run(model, name, seed=0)
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    import tempfile

    m = write_models(Path(tempfile.mkdtemp()))
    STATS = True
    COUNT = int(sys.argv[4]) if len(sys.argv) > 4 else COUNT
    if sys.argv[1] == "async-llm":
        for s in range(int(sys.argv[2]), int(sys.argv[2]) + int(sys.argv[3])):
            found = run_async(m, s, COUNT)
            print("async-llm", s, "ok" if not found else "\n".join(found[:6]), flush=True)
        sys.exit(0)
    names = list(CONFIGS) if sys.argv[1] == "all" else sys.argv[1].split(",")
    bad = 0
    for n in names:
        for s in range(int(sys.argv[2]), int(sys.argv[2]) + int(sys.argv[3])):
            found = run(m, n, s, COUNT)
            bad += bool(found)
            print(n, s, "ok" if not found else "\n".join(found[:6]), flush=True)
    sys.exit(1 if bad else 0)
