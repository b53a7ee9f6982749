"""PerceptionLM and FastVLM served text-only (models/text_wrappers.py rows) against HF.

Both wrappers build their vision tower with timm (`vision_config.model_type` "timm_wrapper":
Meta's PE for PerceptionLM, FastViTHD for FastVLM), which the test environment does not hold.
So the reference is HF's real wrapper class built with a stand-in tower (its module-level
`AutoModel` answers the timm config with a tiny conv, named as timm's patch embedding is)
while every other part is transformers' own: the projector (PerceptionLM's reads
`vision_config.model_args["embed_dim"]`, FastVLM's `vision_config.hidden_size`), the Llama /
Qwen2 language model and lm_head. The checkpoint is what save_pretrained writes from it, its
config.json the real timm_wrapper one. On text prompts `LLM.generate` must give the wrapper's
HF `generate` greedy tokens and top-5 logprobs (1e-3, float32), also with chunked prefill and
prefix-cache hits; images are refused by name (multi_modal_data): paged does not run the timm
towers.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_parity import assert_llm_matches, assert_serves_like_hf, save_hf_checkpoint
from hf_reference import hf_greedy
from torch import nn

from paged_engine import LLM, SamplingParams
from paged_engine.loader import load_hf_config, resolve_model
from paged_engine.testing import _COMMON, _randomize

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.perception_lm")
pytest.importorskip("transformers.models.fast_vlm")

MAX_TOKENS, TOP, VOCAB = 8, 5, 512
IMAGE, VIDEO = 500, 501  # the wrappers' placeholder ids (never in a text prompt)
_TEXT = {
    **_COMMON,
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


class _StandInTower(nn.Module):
    """Where HF builds a TimmWrapperModel: one conv under timm's patch-embedding names."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.timm_model = nn.Module()
        self.timm_model.patch_embed = nn.Module()
        self.timm_model.patch_embed.proj = nn.Conv2d(3, width, 4, 4)


class _AutoModelShim:
    """The modeling module's `AutoModel`: the stand-in for timm configs, HF's for the rest."""

    def __init__(self, width: int) -> None:
        self.width = width

    def from_config(self, config, **kw):
        if config.model_type == "timm_wrapper":
            return _StandInTower(self.width)
        return transformers.AutoModel.from_config(config, **kw)


def _perception_lm():
    vision = {
        "model_type": "timm_wrapper",
        "architecture": "vit_pe_core_large_patch14_336",
        "model_args": {"embed_dim": 32, "depth": 1, "num_heads": 2, "img_size": [28, 28]},
    }
    config = transformers.PerceptionLMConfig(
        text_config={**_TEXT, "model_type": "llama"},
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        projector_pooling_ratio=2,
    )
    return config, "perception_lm", 32


def _fast_vlm(tied: bool = False):
    vision = {
        "model_type": "timm_wrapper",
        "architecture": "fastvit_mci3",
        "hidden_size": 48,
        "do_pooling": True,
        "global_pool": "avg",
        "model_args": {"inference_mode": True},
    }
    text = {**_TEXT, "model_type": "qwen2", "tie_word_embeddings": tied}
    config = transformers.FastVlmConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, tie_word_embeddings=tied
    )
    return config, "fast_vlm", 48


# name -> (config builder, wrapper class, our text class)
CASES = {
    "perception_lm": (_perception_lm, "PerceptionLMForConditionalGeneration", "Llama"),
    "fast_vlm": (_fast_vlm, "FastVlmForConditionalGeneration", "Qwen2"),
    "fast_vlm_tied": (lambda: _fast_vlm(True), "FastVlmForConditionalGeneration", "Qwen2"),
}


def _hf_wrapper(name: str, monkeypatch, seed: int = 1):
    """HF's wrapper of case `name` (stand-in tower), random weights, float32, eval."""
    import importlib

    build, cls_name, _ = CASES[name]
    config, family, width = build()
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    monkeypatch.setattr(modeling, "AutoModel", _AutoModelShim(width))
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).to(torch.float32)
    _randomize(model, seed)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def wrappers(tmp_path_factory):
    """name -> (HF wrapper, its checkpoint dir), built once per module."""
    cache: dict[str, tuple] = {}

    def make(name: str):
        if name not in cache:
            with pytest.MonkeyPatch.context() as mp:
                hf = _hf_wrapper(name, mp)
                cache[name] = (hf, save_hf_checkpoint(hf, tmp_path_factory.mktemp(name), 1))
        return cache[name]

    return make


def _prompts(seed: str, n: int = 2, lo: int = 12, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, IMAGE) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)


@pytest.mark.parametrize("name", list(CASES))
def test_text_only_generation_matches_hf_wrapper(name, wrappers):
    hf, path = wrappers(name)
    config = load_hf_config(resolve_model(path))
    assert config.architectures == [f"{CASES[name][2]}ForCausalLM"]
    assert "vision_tower.timm_model.patch_embed.proj.weight" in {
        k.removeprefix("model.") for k in hf.state_dict()
    }  # the stand-in tower is saved and must be dropped by name
    llm = assert_serves_like_hf(name, path, _prompts(name), MAX_TOKENS, hf=hf)
    tied = hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert llm.llm_engine.model_runner.model.tie_word_embeddings == tied


def test_chunked_prefill_and_prefix_hits_match_hf(wrappers):
    """PerceptionLM: 8-token chunks and a prompt sharing two cached blocks with an earlier one
    give HF's continuations; images are refused by name and the engine keeps serving."""
    hf, path = wrappers("perception_lm")
    base = _prompts("chunks", n=1, lo=40, hi=40)[0]
    prompts = [base, base[:32] + _prompts("tail", n=1, lo=9, hi=9)[0]]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        max_num_seqs=1,
    )
    for prompt, ref in zip(prompts, refs, strict=True):  # one at a time: the second hits
        out = assert_llm_matches("perception_lm chunked", llm, [prompt], [ref])[0]
    assert out.num_cached_tokens == 32
    image = torch.zeros(3, 28, 28)
    bad = {"prompt_token_ids": [5, IMAGE, 6], "multi_modal_data": {"image": image}}
    video = {"prompt_token_ids": [5, VIDEO, 6], "multi_modal_data": {"video": [image, image]}}
    for prompt in (bad, video):
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate([prompt], _params(), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], _params(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == refs[0].tokens
