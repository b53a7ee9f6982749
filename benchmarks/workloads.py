"""The benchmark workloads of MISSION.md, generated exactly as their sources do.

nano-vllm:  random.seed(0); 256 prompts of randint(100, 1024) tokens drawn from randint(0, 10000);
            then, in a second pass, max_tokens = randint(100, 1024) per request; temperature 0.6,
            ignore_eos. Sum of max_tokens = 133,966.
fixed:      vLLM's throughput benchmark with random prompts: fixed input / output lengths
            (1024 in, 128 out, 1000 prompts), temperature 1.0, top_p 1.0, ignore_eos.

Scaled-down versions (CPU) keep the recipe and only change the bounds; `Workload.scaled` says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

NANO_VLLM_OUTPUT_TOKENS = 133_966  # sum of max_tokens of the full nano-vllm workload


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]
    temperature: float
    top_p: float = 1.0
    scaled: str = ""  # empty for the published workload, else how it was scaled down
    params: dict = field(default_factory=dict)  # the generator's arguments, for the report

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> str:
        p = self.params
        text = (
            f"{self.name}: {self.num_requests} requests, input {_span(p['input_len'])} tokens, "
            f"output {_span(p['output_len'])} tokens"
        )
        return text + (" (scaled down from the published size)" if self.scaled else "")


def nano_vllm(
    num_requests: int = 256,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    max_token_id: int = 10000,
    seed: int = 0,
) -> Workload:
    """nano-vllm's bench.py workload; the defaults are the published one."""
    random.seed(seed)
    prompts = [
        [random.randint(0, max_token_id) for _ in range(random.randint(*input_len))]
        for _ in range(num_requests)
    ]
    # second pass, as in the original: lengths are drawn after all prompts
    max_tokens = [random.randint(*output_len) for _ in range(num_requests)]
    params = dict(num_requests=num_requests, input_len=input_len, output_len=output_len, seed=seed)
    default = (num_requests, input_len, output_len) == (256, (100, 1024), (100, 1024))
    return Workload(
        name="nano-vllm",
        requests=[Request(p, m) for p, m in zip(prompts, max_tokens)],
        temperature=0.6,
        scaled="" if default else _scaled_note(params),
        params=params,
    )


def fixed_length(
    num_requests: int = 1000,
    input_len: int = 1024,
    output_len: int = 128,
    max_token_id: int = 10000,
    seed: int = 0,
) -> Workload:
    """vLLM's throughput workload: random prompts of fixed length, fixed output length."""
    random.seed(seed)
    prompts = [
        [random.randint(0, max_token_id) for _ in range(input_len)] for _ in range(num_requests)
    ]
    params = dict(num_requests=num_requests, input_len=input_len, output_len=output_len, seed=seed)
    default = (num_requests, input_len, output_len) == (1000, 1024, 128)
    return Workload(
        name="fixed-length",
        requests=[Request(p, output_len) for p in prompts],
        temperature=1.0,
        top_p=1.0,
        scaled="" if default else _scaled_note(params),
        params=params,
    )


def _span(v: int | tuple[int, int]) -> str:
    if isinstance(v, (tuple, list)) and v[0] != v[1]:
        return f"{v[0]}-{v[1]}"
    return str(v[0] if isinstance(v, (tuple, list)) else v)


def _scaled_note(params: dict) -> str:
    return (
        f"{params['num_requests']} requests, input {_span(params['input_len'])}, "
        f"output {_span(params['output_len'])}"
    )


def standard(smoke: bool, device: str, max_token_id: int = 10000) -> list[Workload]:
    """The two throughput workloads at the size this run can afford."""
    if device == "cuda" and not smoke:
        return [nano_vllm(max_token_id=max_token_id), fixed_length(max_token_id=max_token_id)]
    if device == "cuda":  # smoke on a GPU: same recipe, a tenth of the size
        return [
            nano_vllm(32, max_token_id=max_token_id),
            fixed_length(100, max_token_id=max_token_id),
        ]
    if smoke:  # 2-core CPU: minutes, not hours
        return [
            nano_vllm(8, (16, 64), (8, 24), max_token_id=max_token_id),
            fixed_length(8, 64, 16, max_token_id=max_token_id),
        ]
    return [
        nano_vllm(32, (32, 256), (32, 128), max_token_id=max_token_id),
        fixed_length(32, 256, 64, max_token_id=max_token_id),
    ]
