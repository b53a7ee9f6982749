"""A randomized engine run: one seed draws an engine configuration (a tiny KV pool, swap or
recompute preemption, chunked prefill, prefix caching, async scheduling, n-gram speculation)
and a stream of requests (greedy, seeded, n > 1, beam search, logprobs, prompt logprobs, stop
tokens, min tokens) that arrive and are aborted at random steps. Every request that is not
aborted must come out as a roomy engine (no preemption, no chunking, no cache) makes it, and
once idle every per-request structure of the engine is empty and every block free.

A second stream of the seed draws the per-request features on top (fuzz_features.py): LoRA
adapters, structured outputs, logits shaping, custom logits processors, prompts given as their
tokens' embeddings (which must give the tokens' outputs) and, on the vision-language model,
images.

MODELS: full attention, sliding windows (all layers, interleaved, beside sinks), recurrent
state (hybrid, pure), MoE, latent attention (DeepSeek-V2's MLA) and a VLM (LLaVA).

test_engine_fuzz.py runs a few seeds in the suite; `python tests/engine/engine_fuzz.py FIRST
COUNT [MODELS|all] [--faults]` runs many (how the bugs it caught were found).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from fuzz_events import InjectedFault, apply_event, draw_events
from fuzz_features import (
    REFERENCE_FEATURES,
    VOCAB_HI,
    VOCAB_LO,
    draw_image,
    draw_job_features,
    feature_options,
    reference_embeds,
    shape_params,
    start_reference,
    token_embedder,
    write_adapters,
)

from paged_engine import LLM, BeamSearchParams, LoRARequest, PoolingParams, SamplingParams
from paged_engine.core.scheduler import SchedulerStuckError
from paged_engine.core.step_isolation import RequestFailedError

MAX_MODEL_LEN = 96
MAX_STEPS = 3000  # a run that has not finished by then is stuck
HEADS = 3  # shared prompt heads: prefix-cache hits, copy-on-write across requests
# (tiny arch, config overrides): plain attention, sliding windows (blocks outside the window
# freed), interleaved windows, hybrids with recurrent state (state slots, prefix snapshots), MoE,
# latent attention (MLA), sinks
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 20}),
    "gemma2": ("gemma2", {"sliding_window": 20}),
    "qwen3_next": ("qwen3_next", {}),
    "mamba2": ("mamba2", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    # multi-head latent attention: one latent KV cache a layer (its own block layout), MoE
    "deepseek_v2": ("deepseek_v2", {}),
    # attention sinks, a 20-token window every other layer, YaRN, MoE
    "gpt_oss": ("gpt_oss", {"sliding_window": 20}),
    # a vision-language model (paged_engine.testing.write_tiny_llava): image prompts
    "llava": ("llava", {}),
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
    image_token: int | None = None  # the image placeholder's id, on a vision-language model


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
    image: Any = None  # an image its prompt's first token stands for (a PIL image)
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
        shape = None if xrng is None else lambda p: shape_params(xrng, p, options, texts)
        params = _params(rng, speculative, texts, shape)
        job = Job(f"r{i}", _prompt(rng, heads), params, arrive, abort, priority=rng.randint(0, 3))
        if xrng is not None and model is not None:
            draw_job_features(xrng, job, model, options)
            draw_image(xrng, job, model)
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
            if job.image is not None:
                prompt["multi_modal_data"] = {"image": job.image}
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
                apply_event(engine, event)
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
    from paged_engine.testing import write_tiny_llava, write_tiny_model

    arch, overrides = MODELS[name]
    if arch == "llava":
        path = str(write_tiny_llava(f"{root}/model", seed=3, **overrides))
    else:
        path = str(write_tiny_model(f"{root}/model", arch, seed=3, **overrides))
    adapters = write_adapters(root, path)
    features = set(REFERENCE_FEATURES) - ({"lora"} if not adapters else set())
    reference, features = start_reference(
        path,
        features,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
    )
    embed = token_embedder(path) if "prompt_embeds" in features else None
    image_token = None
    if arch == "llava":
        image_token = reference.get_tokenizer().convert_tokens_to_ids("<image>")
    return Model(path, reference, features, adapters, embed, image_token)


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
        Job(
            j.request_id,
            j.prompt,
            j.params,
            0,
            lora=j.lora,
            embeds=reference_embeds(j),
            image=j.image,
        )
        for j in jobs
        if j.abort is None
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
