"""A randomized engine run: one seed draws an engine configuration (a tiny KV pool, swap or
recompute preemption, chunked prefill, prefix caching, async scheduling, n-gram speculation)
and a stream of requests (greedy, seeded, n > 1, beam search, logprobs, prompt logprobs, stop
tokens, min tokens) that arrive and are aborted at random steps. Every request that is not
aborted must come out as a roomy engine (no preemption, no chunking, no cache) makes it, and
once idle every per-request structure of the engine is empty and every block free.

A second stream of the seed (`random.Random(f"features {seed}")`, so the first stream and the
seeds it found stay as they were) draws the per-request features on top: LoRA adapters (where
the model takes them), structured outputs (choice, regex, a JSON schema), logits shaping
(penalties, logit_bias, allowed_token_ids, bad_words, min_p, custom logits processors) and
prompts given as their tokens' embeddings (which must give the tokens' outputs).

test_engine_fuzz.py runs a few seeds in the suite; `python tests/engine/engine_fuzz.py FIRST
COUNT` runs many (how the bugs it caught were found).
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_engine import (
    LLM,
    BeamSearchParams,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from paged_engine.core.scheduler import SchedulerStuckError
from paged_engine.core.step_isolation import RequestFailedError

MAX_MODEL_LEN = 96
VOCAB_LO, VOCAB_HI = 3, 200  # prompt tokens: the tiny model's vocabulary, less its specials
MAX_STEPS = 3000  # a run that has not finished by then is stuck
HEADS = 3  # shared prompt heads: prefix-cache hits, copy-on-write across requests
# (tiny arch, config overrides): plain attention, sliding windows (blocks outside the window
# freed), interleaved windows, hybrids with recurrent state (state slots, prefix snapshots), MoE
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 20}),
    "gemma2": ("gemma2", {"sliding_window": 20}),
    "qwen3_next": ("qwen3_next", {}),
    "mamba2": ("mamba2", {}),
    "qwen3_moe": ("qwen3_moe", {}),
}


# host code a fault is injected into (it raises on its k-th call once armed): mid-schedule, a
# block allocation with others already made; after a step ran, applying its results
FAULTS = ("allocate_slots", "apply")


class InjectedFault(RuntimeError):
    pass


# structured outputs the tiny byte-level tokenizer can spell
CONSTRAINTS = (
    {"choice": ["yes", "no", "maybe"]},
    {"regex": r"[a-z]{3}-[0-9]{2}"},
    {"regex": r"(ab|cd){2,5}x"},
    {
        "json": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        },
        "disable_any_whitespace": True,
    },
)
# the reference engine's features: every one a seed may draw (what the model refuses dropped)
REFERENCE_FEATURES: dict[str, dict[str, Any]] = {
    "lora": {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8},
    "prompt_embeds": {"enable_prompt_embeds": True},
    "logits_processors": {
        "logits_processors": [
            "custom_logits_processors:ForceToken",
            "custom_logits_processors:NoRepeat",
        ]
    },
}


@dataclass
class Model:
    """One model a seed runs on: its directory, the roomy reference engine (with every feature
    of REFERENCE_FEATURES it takes), its LoRA adapters and its token embedding."""

    path: str
    reference: LLM
    features: set[str]
    adapters: list[LoRARequest]
    embed: Any = None  # token ids -> their input embeddings (HF's), with prompt_embeds


@dataclass
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams | BeamSearchParams | PoolingParams
    arrive: int  # the step before which it is added
    abort: int | None = None  # the step before which it is aborted (None: never)
    # add_request's ValueError (n > max_num_seqs), or the scheduler's stuck error naming it (its
    # sequences outgrew the pool): it fails alone with a clear error, nothing else is lost
    refused: str | None = None
    failed_by: BaseException | None = None  # a RequestFailedError's cause: only a fault's
    priority: int = 0  # with scheduling_policy="priority"
    lora: LoRARequest | None = None
    embeds: Any = None  # the prompt given as its tokens' embeddings (None: as its tokens)
    outputs: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    embedding: Any = None  # a pooling job's vector


def engine_options(rng: random.Random) -> dict[str, Any]:
    """Engine kwargs for one run: small enough to preempt, chunk and share."""
    options: dict[str, Any] = {
        "num_gpu_blocks_override": rng.randint(MAX_MODEL_LEN // 16 + 2, 24),
        "max_num_seqs": rng.randint(1, 8),
        "enable_prefix_caching": rng.random() < 0.6,
        "async_scheduling": rng.random() < 0.5,
    }
    if rng.random() < 0.6:
        options["max_num_batched_tokens"] = rng.randint(MAX_MODEL_LEN, 2 * MAX_MODEL_LEN)
        if rng.random() < 0.5:  # chunked prefill: a budget below the longest prompts
            options["max_num_batched_tokens"] = rng.randint(8, 40)
    if rng.random() < 0.4:
        options["preemption_mode"] = "swap"
        options["swap_space"] = 0.01
    if rng.random() < 0.3:
        k = rng.randint(1, 3)
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k}
    if rng.random() < 0.3:
        options["scheduling_policy"] = "priority"
    if rng.random() < 0.3:
        options["enable_sleep_mode"] = True
    return options


def feature_options(xrng: random.Random, model: Model, options: dict[str, Any]) -> dict[str, Any]:
    """The per-request features' engine options, drawn from the seed's second stream."""
    extra: dict[str, Any] = {}
    if "lora" in model.features and xrng.random() < 0.5:
        extra.update(enable_lora=True, max_loras=xrng.randint(1, 2))
        extra["max_lora_rank"] = xrng.choice([8, 16])
    if "prompt_embeds" in model.features and xrng.random() < 0.4:
        extra["enable_prompt_embeds"] = True
    # (refused with speculation and async scheduling: they read each step's tokens)
    sync = "speculative_config" not in options and not options["async_scheduling"]
    if "logits_processors" in model.features and sync and xrng.random() < 0.5:
        extra |= REFERENCE_FEATURES["logits_processors"]
    return extra


def _shaping(
    xrng: random.Random, params: dict[str, Any], options: dict[str, Any], texts: list[str]
) -> None:
    """Add structured outputs and logits shaping to a SamplingParams' kwargs."""
    if xrng.random() < 0.2:
        params["structured_outputs"] = StructuredOutputsParams(**xrng.choice(CONSTRAINTS))

    def tokens(k: int) -> list[int]:
        return [xrng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(k)]

    if xrng.random() < 0.15:
        params["repetition_penalty"] = xrng.choice([0.8, 1.3])
    if xrng.random() < 0.15:
        params["presence_penalty"] = xrng.uniform(-1, 1)
    if xrng.random() < 0.15:
        params["frequency_penalty"] = xrng.uniform(-1, 1)
    if xrng.random() < 0.15:
        params["logit_bias"] = {t: xrng.choice([-100, -5, 5, 100]) for t in tokens(3)}
    if "structured_outputs" not in params:  # (a constraint they contradict has no token left)
        if xrng.random() < 0.1:
            params["allowed_token_ids"] = tokens(xrng.randint(1, 30))
        if xrng.random() < 0.1:
            params["bad_words"] = [xrng.choice(texts).strip() for _ in range(2)]
    if params.get("temperature", 1.0) > 0 and xrng.random() < 0.3:
        params["min_p"] = xrng.choice([0.05, 0.2])
    if "logits_processors" in options and xrng.random() < 0.3:
        args = xrng.choice([{"target_token": tokens(1)[0]}, {"no_repeat": True}])
        params["extra_args"] = args


def draw_events(
    rng: random.Random, options: dict[str, Any], faults: bool = False
) -> dict[int, list[tuple]]:
    """step -> engine calls made before it: prefix-cache resets, pauses of every mode and
    (with sleep mode) sleeps that give the KV cache back, each resumed a few steps later; with
    `faults`, one host-side failure armed (FAULTS) that the driver survives as paged-server
    does: every request in flight fails, the engine serves on."""
    events: dict[int, list[tuple]] = {}
    if faults:
        at = rng.randint(0, 40)
        events.setdefault(at, []).append(("fault", rng.choice(FAULTS), rng.randint(1, 3)))
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, 60)
        kind = rng.choice(
            ["reset", "pause", "sleep" if options.get("enable_sleep_mode") else "pause"]
        )
        if kind == "reset":
            events.setdefault(at, []).append(("reset",))
            continue
        mode = rng.choice(["keep", "wait", "abort"])
        events.setdefault(at, []).append((kind, mode))
        events.setdefault(at + rng.randint(0, 5), []).append(
            ("wake" if kind == "sleep" else "resume",)
        )
    return events


def _prompt(rng: random.Random, heads: list[list[int]]) -> list[int]:
    tail = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(1, 40))]
    if rng.random() < 0.5:
        return (rng.choice(heads) + tail)[: MAX_MODEL_LEN - 24]
    # repeats, so n-gram speculation finds drafts
    return (tail * rng.randint(1, 3))[: MAX_MODEL_LEN - 24]


def _params(
    rng: random.Random,
    speculative: bool,
    texts: list[str],
    shape: Any = None,  # adds the second stream's draws to a SamplingParams' kwargs
) -> SamplingParams | BeamSearchParams | PoolingParams:
    kind = rng.random()
    max_tokens = rng.randint(1, 20)
    if kind > 0.92:
        return PoolingParams(task="embed")
    if kind < 0.12 and not speculative:
        return BeamSearchParams(beam_width=rng.randint(2, 3), max_tokens=max_tokens)
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "ignore_eos": rng.random() < 0.7,
        "logprobs": rng.choice([None, None, 0, 2]),
    }
    if rng.random() < 0.2:
        params["prompt_logprobs"] = rng.choice([0, 1])
    if rng.random() < 0.2:
        params["stop_token_ids"] = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(5)]
    if rng.random() < 0.2:
        params["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.2:  # stop strings: token texts (the output ends inside or at one)
        params["stop"] = [rng.choice(texts)[: rng.randint(1, 2)] for _ in range(2)]
    if kind < 0.55:
        params["temperature"] = 0.0
        params["n"] = rng.choice([1, 1, 1, 2])
    else:  # seeded: each draw depends only on (seed, sample index, position)
        params.update(temperature=0.9, seed=rng.randrange(1 << 30), n=rng.choice([1, 2, 3]))
        if rng.random() < 0.5:
            params["top_k"] = rng.randint(2, 20)
        if rng.random() < 0.3:
            params["top_p"] = 0.8
    if shape is not None:
        shape(params)
    return SamplingParams(**params)


def draw_jobs(
    rng: random.Random,
    speculative: bool,
    texts: list[str],
    xrng: random.Random | None = None,
    model: Model | None = None,
    options: dict[str, Any] | None = None,
) -> list[Job]:
    """The requests of a run; with `xrng`, each also draws the features `options` enable
    (an adapter, shaping params, its prompt as embeddings) from that stream."""
    heads = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(16, 40))]]
    heads += [heads[0][: rng.randint(4, 30)] for _ in range(HEADS - 1)]
    options = options or {}
    jobs = []
    for i in range(rng.randint(6, 16)):
        arrive = rng.choice([0, 0, rng.randint(0, 40)])
        abort = arrive + rng.randint(0, 30) if rng.random() < 0.15 else None
        shape = None if xrng is None else lambda p: _shaping(xrng, p, options, texts)
        params = _params(rng, speculative, texts, shape)
        job = Job(f"r{i}", _prompt(rng, heads), params, arrive, abort, priority=rng.randint(0, 3))
        if xrng is not None and model is not None:
            if options.get("enable_lora"):
                job.lora = xrng.choice([None, *model.adapters])
            if options.get("enable_prompt_embeds") and xrng.random() < 0.4:
                if isinstance(params, SamplingParams):
                    # an embedded prompt has no tokens: none to score, none that the repetition
                    # penalty (which counts the prompt's tokens) could find (llama 21, 42, 46, 57)
                    job.params = dataclasses.replace(
                        params, prompt_logprobs=None, repetition_penalty=1.0
                    )
                job.embeds = model.embed(job.prompt)
        jobs.append(job)
    return jobs


def drive(llm: LLM, jobs: list[Job], events: dict[int, list[tuple]] | None = None) -> int:
    """Step `llm`'s engine through `jobs` (arrivals, aborts and `events` at their steps when
    `events` is given, else all at once); fill each job's outputs; return the steps taken."""
    engine = llm.llm_engine
    ranked = engine.config.scheduling_policy == "priority"

    def priority(job: Job) -> int:
        return job.priority if ranked else 0

    with_events = events is not None
    events = dict(events or {})
    by_id = {job.request_id: job for job in jobs}
    arrivals = sorted(jobs, key=lambda j: j.arrive) if with_events else list(jobs)
    aborts = sorted((j for j in jobs if j.abort is not None and with_events), key=lambda j: j.abort)
    step = 0
    while arrivals or events or engine.has_unfinished_requests() or engine.can_step():
        while arrivals and (not with_events or arrivals[0].arrive <= step):
            job = arrivals.pop(0)
            prompt: dict[str, Any] = {"prompt_token_ids": job.prompt}
            if job.embeds is not None:
                prompt = {"prompt_embeds": job.embeds}
            try:
                engine.add_request(
                    job.request_id,
                    prompt,
                    job.params,
                    final_only=True,
                    lora_request=job.lora,
                    priority=priority(job),
                )
            except ValueError as e:
                job.refused = str(e)
        while aborts and aborts[0].abort <= step:
            engine.abort_request(aborts.pop(0).request_id)
        for event in events.pop(step, []):
            before = set(engine.output_processor.states)
            try:
                _apply_event(engine, event)
            except RequestFailedError as e:  # raised by a "wait" pause once paused
                for rid in e.request_ids:
                    by_id[rid].finish_reasons = ["abort"]
                    by_id[rid].failed_by = e.cause
            if event[0] in ("pause", "sleep") and event[1] == "abort":
                for rid in before:  # (an aborted pooling request has no output to say so)
                    by_id[rid].finish_reasons = by_id[rid].finish_reasons or ["abort"]
        if engine.is_paused() and not any(at > step for at in events):
            raise AssertionError("paused with no resume ahead")  # (draw_events resumes all)
        try:
            outs = engine.step()
        except SchedulerStuckError as e:  # fails alone, as paged-server fails it (a 400)
            if not e.request_ids:
                raise
            for rid in e.request_ids:
                by_id[rid].refused = str(e)
            engine.abort_request(e.request_ids)
            outs = []
        except RequestFailedError as e:  # failed alone (paged-server answers them with an error)
            for rid in e.request_ids:
                by_id[rid].finish_reasons = ["abort"]
                by_id[rid].failed_by = e.cause
            outs = []
        _collect(by_id, outs)
        step += 1
        if step > MAX_STEPS:
            raise AssertionError(f"not finished after {MAX_STEPS} steps")
    return step


def _apply_event(engine: Any, event: tuple) -> list[Any]:
    """Make one engine call; what a "wait" pause's steps produced is returned by a later
    step, so nothing to collect here but for symmetry."""
    kind = event[0]
    if kind == "reset":
        engine.reset_prefix_cache()
    elif kind == "pause":
        engine.pause_generation(mode=event[1])
    elif kind == "resume":
        if not engine.sleep_mode.asleep:  # (a sleep's wake_up resumes)
            engine.resume_generation()
    elif kind == "sleep":
        engine.sleep(level=1, mode=event[1])
    elif kind == "wake":
        engine.wake_up()
    elif kind == "fault":
        _arm(engine, event[1], event[2])
    return []


def _arm(engine: Any, target: str, k: int) -> None:
    """Make `target` raise InjectedFault on its k-th call from now, once."""
    owner = engine.block_manager if target == "allocate_slots" else engine.engine_core
    name = "allocate_slots" if target == "allocate_slots" else "_apply"
    real = getattr(owner, name)
    calls = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            setattr(owner, name, real)  # once
            raise InjectedFault(f"injected into {target}")
        return real(*args, **kwargs)

    setattr(owner, name, faulty)


def _collect(by_id: dict[str, Job], outs: list[Any]) -> None:
    for out in outs:
        if not out.finished:
            continue
        job = by_id[out.request_id]
        if isinstance(out.outputs, list):
            job.outputs = [list(c.token_ids) for c in out.outputs]
            job.logprobs = [_chosen(c) for c in out.outputs]
            job.finish_reasons = [c.finish_reason for c in out.outputs]
        else:  # a pooling output
            job.embedding = out.outputs.data
            job.finish_reasons = ["stop"]


def _chosen(completion: Any) -> list[float]:
    """The logprob of each sampled token, where logprobs were asked for."""
    if not completion.logprobs:
        return []
    return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]


def compare(jobs: list[Job], reference: list[Job], speculative: bool) -> list[str]:
    """What differs between a fuzzed run's outputs and the reference's (aborted jobs skipped:
    they may or may not have finished first; seeded draws under speculation are only equal in
    distribution)."""
    problems = []
    for job, ref in zip(jobs, reference):
        if job.abort is not None or job.refused is not None or "abort" in job.finish_reasons:
            continue  # (a pause in "abort" mode aborts what is in flight)
        if not job.finish_reasons:
            problems.append(f"{job.request_id}: never finished")
            continue
        if isinstance(job.params, PoolingParams):
            if not torch.allclose(job.embedding, ref.embedding, atol=1e-4):
                problems.append(f"{job.request_id}: embedding differs")
            continue
        seeded = isinstance(job.params, SamplingParams) and job.params.temperature > 0
        if speculative and seeded:
            if len(job.outputs) != len(ref.outputs):
                problems.append(
                    f"{job.request_id}: {len(job.outputs)} outputs, want {len(ref.outputs)}"
                )
            continue
        if job.outputs != ref.outputs:
            problems.append(f"{job.request_id} ({job.params}): {job.outputs} != {ref.outputs}")
            continue
        for got, want in zip(job.logprobs, ref.logprobs):
            if len(got) != len(want) or any(
                not math.isclose(a, b, abs_tol=1e-3) for a, b in zip(got, want)
            ):
                problems.append(f"{job.request_id}: logprobs {got} != {want}")
    return problems


def prepare(name: str, root: str) -> Model:
    """Write model `name` (MODELS) and its LoRA adapters under `root`; start its reference
    engine with every feature of REFERENCE_FEATURES the model takes."""
    from paged_engine.testing import write_lora_adapter, write_tiny_model

    arch, overrides = MODELS[name]
    path = str(write_tiny_model(f"{root}/model", arch, seed=3, **overrides))
    adapters: list[LoRARequest] = []
    try:  # every projection / attention only, ranks 2-8 (REFERENCE_FEATURES' max_lora_rank)
        for k, (rank, kw) in enumerate(
            [
                (4, {}),
                (8, {"use_rslora": True, "alpha": 8}),
                (2, {"target_modules": ("q_proj", "v_proj")}),
            ]
        ):
            adapter = write_lora_adapter(f"{root}/lora{k}", path, rank=rank, seed=k, **kw)
            adapters.append(LoRARequest(f"a{k}", k + 1, str(adapter)))
    except ValueError:  # no layer the adapters target
        adapters = []
    features = set(REFERENCE_FEATURES) - ({"lora"} if not adapters else set())
    while True:
        options = {k: v for f in features for k, v in REFERENCE_FEATURES[f].items()}
        try:
            reference = LLM(
                model=path,
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
                enable_prefix_caching=False,
                **options,
            )
            break
        except ValueError as e:  # refused by name: drop that feature
            named = [f for f in features if any(k in str(e) for k in REFERENCE_FEATURES[f])]
            if not named:
                raise
            features -= set(named)
    embed = None
    if "prompt_embeds" in features:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        table = hf.get_input_embeddings()

        def embed(ids: list[int]) -> torch.Tensor:
            with torch.no_grad():
                return table(torch.tensor([ids]))[0]

    return Model(path, reference, features, adapters, embed)


def run_seed(model: Model, seed: int, faults: bool = False) -> tuple[dict[str, Any], list[str]]:
    """One fuzzed run of `model` against its roomy reference engine; (its engine options, the
    problems found). An engine that refuses the drawn options by name is no problem."""
    from engine_state import leftovers  # tests/engine_state.py

    rng, xrng = random.Random(seed), random.Random(f"features {seed}")
    options = engine_options(rng)
    events = draw_events(rng, options, faults)
    options |= feature_options(xrng, model, options)
    speculative = "speculative_config" in options
    reference_llm = model.reference
    tokenizer = reference_llm.get_tokenizer()
    texts = [t for t in (tokenizer.decode([i]) for i in range(VOCAB_LO, VOCAB_HI)) if t.strip()]
    jobs = draw_jobs(rng, speculative, texts, xrng, model, options)
    reference = [
        Job(j.request_id, j.prompt, j.params, 0, lora=j.lora) for j in jobs if j.abort is None
    ]
    drive(reference_llm, reference)
    by_id = {j.request_id: j for j in reference}
    try:
        llm = LLM(model=model.path, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, **options)
    except ValueError as e:
        return options | {"refused": str(e)}, []
    try:
        drive(llm, jobs, events)
        kept = [j for j in jobs if j.abort is None]
        problems = compare(kept, [by_id[j.request_id] for j in kept], speculative)
        problems += [  # the engine failed a request on its own: a bug the run tripped
            f"{j.request_id} failed: {j.failed_by!r}"
            for j in jobs
            if j.failed_by is not None and not isinstance(j.failed_by, InjectedFault)
        ]
        left = leftovers(llm.llm_engine)
        if left:
            problems.append(f"left behind once idle: {left}")
    finally:
        llm.llm_engine.shutdown()
    return options, problems


def main(first: int, count: int, names: list[str], faults: bool = False) -> int:
    import tempfile

    failed = 0
    for name in names:
        model = prepare(name, tempfile.mkdtemp())
        print(f"{name}: features {sorted(model.features)}")
        for seed in range(first, first + count):
            try:
                options, problems = run_seed(model, seed, faults)
            except Exception as e:  # a crash is a finding too
                import traceback

                traceback.print_exc()
                options, problems = {}, [f"raised {e!r}"]
            if problems:
                failed += 1
                print(f"{name} seed {seed} {options}:")
                for p in problems[:5]:
                    print("   ", p)
            else:
                print(f"{name} seed {seed} ok {options.get('refused', '')}")
    return failed


if __name__ == "__main__":
    names = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] != "all" else list(MODELS)
    faults = "--faults" in sys.argv
    sys.exit(1 if main(int(sys.argv[1]), int(sys.argv[2]), names, faults) else 0)
