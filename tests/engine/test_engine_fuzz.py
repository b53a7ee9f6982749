"""Randomized engine runs (engine_fuzz.py): every scheduling feature at once on a tiny pool,
requests arriving, aborted, paused and put to sleep at random steps. Each request that is not
aborted must come out as a roomy engine makes it, and the idle engine must hold nothing.
Requests draw LoRA adapters, structured outputs, logits shaping and prompt embeds on top
(fuzz_features.py).

The seeds here are a sample; `python tests/engine/engine_fuzz.py FIRST COUNT [MODELS|all]
[--faults]` runs more. Ad hoc: 150 llama seeds and 60 of each model passed; with faults, 80 of
each (gemma2 seed 62 found stale drafts left by a failed plan). With the feature draws: 60 seeds
each of llama, mistral-window and gemma2, and 60 llama seeds with faults, passed; qwen3_next
0-45 passed but for the repetition penalty over an embedded prompt, whose reference now runs
the embeds too (the penalty counts the prompt's tokens; an embedded prompt has none).
DeepSeek-V2 (latent attention), gpt-oss (sinks, windows) and LLaVA (images) joined later:
seeds 80-159 of each of those two and 80-139 of LLaVA passed, with faults 80-139 of the two
and 80-109 of LLaVA; the first six kinds passed 120-139 again, with faults 120-134.
"""

from __future__ import annotations

import pytest
from engine_fuzz import Model, prepare, run_seed

# (llama 0: custom logits processors; 5: LoRA under speculation; 11: prompt embeds; every seed
# draws structured outputs and logits shaping on top)
CASES = [("llama", s) for s in (0, 1, 2, 3, 4, 5, 11)] + [
    ("mistral-window", 0),
    ("mistral-window", 1),
    ("gemma2", 2),
    ("qwen3_next", 0),
    ("qwen3_next", 3),
    ("mamba2", 1),
    ("qwen3_moe", 0),
    ("deepseek_v2", 111),  # swap, n-gram drafts, LoRA, prompt embeds, async, prefix cache
    ("gpt_oss", 89),  # swap, chunked prefill, LoRA, custom logits processors, prefix cache
    ("llava", 1),  # images beside swap, chunked prefill, n-gram drafts, async, prefix cache
]
# with one host-side failure injected (engine_fuzz.FAULTS): planning or applying a step raises
# once; the isolation recomputes or fails the requests involved, the others match
FAULT_CASES = [
    ("llama", 10),
    ("llama", 13),
    ("llama", 25),
    ("gemma2", 62),
    ("qwen3_next", 1),
    ("mamba2", 12),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> engine_fuzz.Model (its reference engine and adapters), built on first use."""
    built: dict[str, Model] = {}

    def get(name: str) -> Model:
        if name not in built:
            built[name] = prepare(name, str(tmp_path_factory.mktemp(name)))
        return built[name]

    return get


@pytest.mark.parametrize(("name", "seed"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_random_run_matches_the_roomy_engine(models, name, seed):
    options, problems = run_seed(models(name), seed)
    assert not problems, f"{name} seed {seed} {options}:\n" + "\n".join(problems)


@pytest.mark.parametrize(("name", "seed"), FAULT_CASES, ids=[f"{n}-{s}" for n, s in FAULT_CASES])
def test_a_host_failure_loses_only_the_requests_involved(models, name, seed):
    options, problems = run_seed(models(name), seed, faults=True)
    assert not problems, f"{name} seed {seed} {options}:\n" + "\n".join(problems)
