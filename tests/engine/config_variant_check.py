"""What the config-variant audits share (test_config_variants*.py, test_config_sweep.py): a tiny
checkpoint under changed config fields is served by `LLM` (float32) and compared with HF
transformers' greedy tokens and top-3 logprobs on the same weights (hf_reference.assert_matches),
or refused at load by a ValueError naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import assert_matches, hf_greedy, load_hf_model

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

MAX_TOKENS = 5
# the second pass of `serve_and_compare(passes=2)` reads the first pass's cached blocks
CHUNKED_PREFIX_CACHE = {
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 16,
    "enable_prefix_caching": True,
}


def hf_refs(
    path: Path,
    lengths: tuple[int, ...],
    *,
    max_tokens: int = MAX_TOKENS,
    seed: int | None = None,
    use_cache: bool = True,
) -> tuple[list[list[int]], list]:
    """Random prompts of `lengths` (seeded by `seed`, default len(lengths)) and HF's greedy
    continuation of each, with top-3 logprobs."""
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(len(lengths) if seed is None else seed)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    return prompts, [hf_greedy(hf, p, max_tokens, 3, use_cache=use_cache) for p in prompts]


def serve_and_compare(
    name: str,
    path: Path,
    prompts: list[list[int]],
    refs: list,
    *,
    max_tokens: int = MAX_TOKENS,
    passes: int = 1,
    **engine_kwargs: Any,
) -> None:
    """`prompts` served `passes` times by one engine, each output matching its HF reference;
    no block held afterwards."""
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    try:
        for _ in range(passes):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for out, ref in zip(outs, refs, strict=True):
                assert_matches(name, out, ref)
        assert llm.get_stats().num_used_blocks == 0
    finally:
        llm.llm_engine.shutdown()


def assert_refused(
    tmp_path: Path, arch: str, overrides: dict[str, Any], edits: dict[str, Any], match: str
) -> None:
    """A tiny `arch` checkpoint built with `overrides`, its config.json then given `edits`
    (fields HF's config class would not keep), is refused at load naming `match`."""
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    if edits:
        config = json.loads((path / "config.json").read_text())
        config.update(edits)
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
