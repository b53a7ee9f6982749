"""HF transformers baselines on the same weights and prompts as paged.

- static:     `model.generate` on fixed batches, left-padded, every batch runs until its longest
              request is done (the baseline the original 14-24x was measured against).
- continuous: transformers' own continuous batching (`ContinuousBatchingManager`, the engine
              behind `model.generate_batch`) on a paged cache. The model loads with
              `attn_implementation="sdpa"`: the manager itself switches it to a paged kernel
              (`paged|sdpa` on 5.17-5.22; 5.23+ run `sdpa` paged and deprecate the prefix), or to
              flash attention where that is installed; the record names what it ran.
              `generate_batch` takes one max_new_tokens for all prompts, so the per-request
              lengths of the nano-vllm workload go through the same manager's `add_request`.
"""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.common import cpu_seconds, now, throughput_record
from benchmarks.models import ModelSpec, load_hf
from benchmarks.workloads import Request, Workload


def _generation_config(wl: Workload, max_new_tokens: int, pad_id: int):
    from transformers import GenerationConfig

    # ignore_eos: no eos id at all, so every request runs to its max tokens
    return GenerationConfig(
        do_sample=True,
        temperature=wl.temperature,
        top_p=wl.top_p,
        top_k=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
    )


def _static_batch(model, reqs: list[Request], wl: Workload, device: str) -> int:
    """One padded batch; returns the tokens generated including padding rows' extra tokens."""
    width = max(len(r.prompt_token_ids) for r in reqs)
    max_new = max(r.max_tokens for r in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros(len(reqs), width, dtype=torch.long)
    for i, r in enumerate(reqs):  # left padding
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        generation_config=_generation_config(wl, max_new, 0),
    )
    assert out.shape[1] == width + max_new, "generation stopped early: ignore_eos not honoured"
    return len(reqs) * max_new


def hf_static(
    spec: ModelSpec, wl: Workload, device: str, batch_size: int = 32, attn: str = "sdpa"
) -> dict:
    """Throughput of static batching; halves the batch size on out-of-memory and starts over."""
    model = load_hf(spec, device, attn)
    model.generation_config.eos_token_id = None  # else generate falls back to it (ignore_eos)
    torch.manual_seed(0)
    with torch.inference_mode():
        _static_batch(model, [Request(wl.requests[0].prompt_token_ids[:8], 4)] * 2, wl, device)
        while True:
            try:
                t0, c0, generated = now(device), cpu_seconds(), 0
                for i in range(0, wl.num_requests, batch_size):
                    generated += _static_batch(model, wl.requests[i : i + batch_size], wl, device)
                elapsed, cpu_s = now(device) - t0, cpu_seconds() - c0
                break
            except torch.OutOfMemoryError:
                if batch_size == 1:
                    raise
                batch_size //= 2
                torch.cuda.empty_cache()
    return throughput_record(
        "hf-static",
        wl,
        elapsed,
        cpu_s,
        batch_size=batch_size,
        tokens_generated_incl_padding=generated,
        attn_implementation=model.config._attn_implementation,
    )


def cb_config(**options):
    """A ContinuousBatchingConfig across versions: `block_size` (5.17) became `page_size` (5.23)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "block_size" in options and "page_size" in fields:
        options["page_size"] = options.pop("block_size")
    unknown = set(options) - fields
    if unknown:
        raise ValueError(f"this transformers has no ContinuousBatchingConfig {sorted(unknown)}")
    return ContinuousBatchingConfig(**options)


def hf_continuous(
    spec: ModelSpec, wl: Workload, device: str, attn: str = "sdpa", **cb_options
) -> dict:
    """Throughput of transformers' continuous batching (warm-up excluded from the timing)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = load_hf(spec, device, attn)
    max_new = max(r.max_tokens for r in wl.requests)
    gen = _generation_config(wl, max_new, 0)
    gen.eos_token_id = -1  # the manager's spelling of "no eos"
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in wl.requests),
        max_generated_length=max_new,
        num_requests=wl.num_requests,
    )
    cbc = cb_config(seed=0, **cb_options)
    # no inference_mode here: the manager's thread updates its cache tensors in place
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cbc, workload_hints=hints
    ) as mgr:
        _drain(mgr, [Request(wl.requests[0].prompt_token_ids[:8], 4)] * 2)  # warm-up
        ran = model.config._attn_implementation  # the manager's pick, restored on exit
        t0, c0 = now(device), cpu_seconds()
        outputs = _drain(mgr, wl.requests)
        elapsed, cpu_s = now(device) - t0, cpu_seconds() - c0
    lengths = [len(o.generated_tokens) for o in outputs]
    if lengths != [r.max_tokens for r in wl.requests]:
        raise RuntimeError("HF continuous batching did not generate the requested tokens")
    return throughput_record(
        "hf-continuous",
        wl,
        elapsed,
        cpu_s,
        attn_implementation=ran,
        cb_config={k: v for k, v in cb_options.items()},
    )


def _drain(mgr, reqs: list[Request], timeout_s: float = 600.0) -> list:
    """Submit `reqs` and wait for all; results in submission order."""
    ids = [
        mgr.add_request(list(r.prompt_token_ids), max_new_tokens=r.max_tokens, eos_token_id=-1)
        for r in reqs
    ]
    done: dict = {}
    while len(done) < len(ids):
        res = mgr.get_result(timeout=timeout_s)
        if res is None:
            raise RuntimeError("HF continuous batching stalled or died")
        if res.error is not None:
            raise RuntimeError(f"HF continuous batching failed: {res.error}")
        if res.is_finished():
            done[res.request_id] = res
    return [done[i] for i in ids]
