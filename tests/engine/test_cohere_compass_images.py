"""Images through Cohere Compass (`CohereCompassForConditionalGeneration`: Qwen3-VL's tower and
deepstack, multimodal/qwen2_vl.py, into models/cohere_compass.py's decoder) against HF.

A tiny random checkpoint (4-pixel patches merged 2 x 2, deepstack rows after layers 0 and 2;
sliding layers with M-RoPE sections [2, 1, 1], global ones with transformers' default
[24, 20, 20] read over 8 frequencies, each type its own theta): `LLM.generate` with
`multi_modal_data` must give HF's placeholder runs and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32), with HF's interleaved M-RoPE positions over the images. Then chunked
prefill through the images with prefix-cache hits gives the plain run's results, and videos are
refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _COMMON, _quiet_progress, _randomize, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.cohere_compass")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
SPECIAL = ["<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>"]
VISION = "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"
PROMPT = f"user: {VISION}What is in it? Tell me. assistant:"
TWO = f"user: {VISION} and {VISION}Which is brighter? assistant:"
TEXT = "user: Say something about the sea. assistant:"


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def write_tiny_compass_vl(path: Path, seed: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(512, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    ids = dict(zip(SPECIAL, tokenizer.convert_tokens_to_ids(SPECIAL), strict=True))
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 500.0,
                "mrope_section": [2, 1, 1],
            },
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "logit_scale": 0.5,
        **_COMMON,
    }
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 4,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 2],
    }
    config = transformers.CohereCompassConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|IMAGE_PAD|>"],
        video_token_id=ids["<|VIDEO_PAD|>"],
        vision_start_token_id=ids["<|VISION_START|>"],
        vision_end_token_id=ids["<|VISION_END|>"],
        **_COMMON,
    )
    torch.manual_seed(seed)
    model = transformers.CohereCompassForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    factor = 8  # patch 4 x merge 2
    transformers.Qwen2VLImageProcessor(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def compass(tmp_path_factory) -> Path:
    return write_tiny_compass_vl(tmp_path_factory.mktemp("compass-vl"))


class _HF:
    """HF's wrapper with the prompt built as its processor builds it: each <|IMAGE_PAD|>
    repeated once per merged patch, pixels and grids from the checkpoint's image processor."""

    def __init__(self, path: Path) -> None:
        cls = transformers.CohereCompassForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.pad = self.model.config.image_token_id

    def greedy(self, text: str, images: list):
        ids = self.tok.encode(text, add_special_tokens=False)
        if not images:
            return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5)
        out = self.images(images=images, return_tensors="pt")
        runs = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
        expanded: list[int] = []
        for t in ids:
            expanded += [t] * next(runs) if t == self.pad else [t]
        extra = {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": torch.tensor([[int(t == self.pad) for t in expanded]]),
        }
        return expanded, hf_greedy(self.model, expanded, MAX_TOKENS, 5, **extra)


def _params(top: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=top)


def _prompts(cases) -> list:
    return [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]


CASES = [
    (PROMPT, [_image(1, (40, 56))]),
    (TEXT, []),
    (TWO, [_image(2, (72, 24)), _image(3, (33, 47))]),  # tall; resized to the patch grid
]


def test_images_match_hf(compass):
    hf = _HF(compass)
    refs = [hf.greedy(text, images) for text, images in CASES]
    llm = LLM(model=str(compass), dtype="float32", block_size=16, max_model_len=512)
    outs = llm.generate(_prompts(CASES), _params(), use_tqdm=False)
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("compass-vl", out, ref)


def test_chunks_through_images_and_prefix_hits_match_plain(compass):
    prompts = _prompts([CASES[0], CASES[2], CASES[0]])
    kw = {"model": str(compass), "dtype": "float32", "max_model_len": 512}
    plain = LLM(block_size=16, enable_prefix_caching=False, **kw)
    want = [o.outputs[0] for o in plain.generate(prompts, _params(0), use_tqdm=False)]
    chunked = LLM(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, **kw)
    got = [o.outputs[0] for o in chunked.generate(prompts, _params(0), use_tqdm=False)]
    assert_same_greedy(want, got)


def test_videos_are_refused(compass):
    llm = LLM(model=str(compass), dtype="float32", max_model_len=512)
    frames = np.zeros((4, 16, 16, 3), dtype=np.uint8)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"video": frames}}
    with pytest.raises(ValueError, match="video"):
        llm.generate([prompt], _params(), use_tqdm=False)


def test_config_names_the_wrapper(compass):
    config = json.loads((compass / "config.json").read_text())
    assert config["architectures"] == ["CohereCompassForConditionalGeneration"]
