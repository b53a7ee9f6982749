"""Qwen4-Exp (text) against HF transformers.

`LLM.generate` on a tiny random Qwen4-Exp (tiny_config "qwen4_exp": 3 hyper-connection streams,
linear / linear + PLE / indexed / linear + PLE layers, QSA keeping 2 blocks of 4 keys of prompts
up to 40 tokens, sigmoid-gated DeltaNet output, partial M-RoPE, top-2 experts unnormalized) gives
HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32): on random prompts, on prompts
holding eos tokens (PLE's n-grams stop at them) and prompts shorter than the n-gram context, and
through the `Qwen4ExpForConditionalGeneration` wrapper served text-only, with chunked prefill
splitting the prompts. TP=2 gives the one-process results.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import EOS_ID, write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen4_exp")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS, TOP = 8, 5


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("qwen4_exp"), "qwen4_exp", seed=1)


def _eos_prompts(seed: int) -> list[list[int]]:
    """Prompts with eos tokens inside (one twice in a row) and one shorter than the n-grams."""
    rng = random.Random(seed)
    prompts = []
    for n in (30, 21, 38):
        p = [rng.randrange(3, 512) for _ in range(n)]
        for _ in range(3):
            p.insert(rng.randrange(1, len(p)), EOS_ID)
        prompts.append(p)
    prompts[1][5:7] = [EOS_ID, EOS_ID]
    prompts.append([rng.randrange(3, 512)])
    return prompts


def _generate(path: Path, prompts: list[list[int]], **kw) -> list:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_stats().num_used_blocks == 0
    return outs


def test_matches_hf(tmp_path):
    assert_tiny_case_matches_hf("qwen4_exp", "qwen4_exp", {}, tmp_path)


def test_eos_and_short_prompts_match_hf(text_dir):
    prompts = _eos_prompts(3)
    hf = load_hf_model(text_dir)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    # chunked prefill splits the prompts: the PLE context and conv window carry over chunks
    for kw in ({}, {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}):
        for out, ref in zip(_generate(text_dir, prompts, **kw), refs, strict=True):
            assert_matches(f"qwen4_exp eos {kw}", out, ref)


@pytest.fixture(scope="module")
def wrapper_dir(text_dir, tmp_path_factory) -> Path:
    """`text_dir` as a Qwen4ExpForConditionalGeneration checkpoint: the language model under
    `model.language_model.`, a stand-in vision tensor under `model.visual.`."""
    path = tmp_path_factory.mktemp("qwen4_exp_wrapper")
    for f in text_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    text = json.loads((text_dir / "config.json").read_text())
    config = transformers.Qwen4ExpConfig(text_config=text).to_dict()
    config["architectures"] = ["Qwen4ExpForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(config))
    weights = safetensors_torch.load_file(str(text_dir / "model.safetensors"))
    renamed = {
        (f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(4, 8)
    safetensors_torch.save_file(renamed, str(path / "model.safetensors"))
    return path


def test_wrapper_served_text_only(text_dir, wrapper_dir):
    prompts = _eos_prompts(5)[:2]
    hf = load_hf_model(text_dir)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    for out, ref in zip(_generate(wrapper_dir, prompts), refs, strict=True):
        assert_matches("qwen4_exp wrapper", out, ref)


def test_tensor_parallel_matches_one_process(text_dir):
    assert_tp_matches_one_process(text_dir, _eos_prompts(7)[:3], MAX_TOKENS, 128)


def test_prompt_embeds_refused(text_dir):
    # the n-gram per-layer embeddings hash the token ids, which rows given as embeddings lack
    with pytest.raises(ValueError, match=r"enable_prompt_embeds: .*n-gram"):
        LLM(model=str(text_dir), dtype="float32", max_model_len=128, enable_prompt_embeds=True)
