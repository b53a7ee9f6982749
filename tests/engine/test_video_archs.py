"""multimodal/video_archs.py's table that picks a checkpoint's video processor, and the
placeholders each family of Qwen3VideoProcessor's template finds."""

import inspect
import json
import re

import numpy as np
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.multimodal.archs import KINDS
from paged_engine.multimodal.gemma4_video import Gemma4VideoProcessor
from paged_engine.multimodal.glm4v_video import Glm4vVideoProcessor
from paged_engine.multimodal.llava_next_video import LlavaNextVideoProcessor
from paged_engine.multimodal.omni_video import OmniVideoProcessor
from paged_engine.multimodal.qwen3_video import Qwen3VideoProcessor
from paged_engine.multimodal.qwen_video import QwenVideoProcessor
from paged_engine.multimodal.video_archs import (
    VIDEO_ARCHS,
    VIDEO_PROCESSORS,
    video_processor_class,
)
from paged_engine.testing import write_tiny_qwen2_vl


@pytest.mark.parametrize(
    "arch, cls",
    [
        ("Qwen2VLForConditionalGeneration", QwenVideoProcessor),
        ("Qwen2_5_VLForConditionalGeneration", QwenVideoProcessor),
        ("Qwen3VLMoeForConditionalGeneration", Qwen3VideoProcessor),
        ("Qwen3_5ForConditionalGeneration", Qwen3VideoProcessor),
        ("Glm46VForConditionalGeneration", Glm4vVideoProcessor),
        ("Gemma4ForConditionalGeneration", Gemma4VideoProcessor),
        ("Qwen2_5OmniThinkerForConditionalGeneration", OmniVideoProcessor),
        ("Qwen3OmniMoeForConditionalGeneration", OmniVideoProcessor),
        ("LlavaNextVideoForConditionalGeneration", LlavaNextVideoProcessor),
        ("VipLlavaForConditionalGeneration", None),  # images only
        ("LlavaForConditionalGeneration", None),  # images only
        ("LlamaForCausalLM", None),
    ],
)
def test_each_architecture_gets_its_processor(arch, cls):
    assert video_processor_class([arch]) is cls
    assert video_processor_class(["SomethingElse", arch]) is cls


def test_table_rows_are_image_wrappers_built_one_way():
    # videos run where images do (takes_images gates both), each architecture in one row
    assert set(VIDEO_ARCHS) <= set(KINDS)
    assert len(VIDEO_ARCHS) == len(set(VIDEO_ARCHS))
    for _, cls in VIDEO_PROCESSORS:  # cls(path, config, tokenizer, limit, engine_config)
        inspect.signature(cls).bind("path", "config", "tokenizer", 1, "engine_config")


@pytest.mark.parametrize(
    "cls, name, spans",
    [
        (Qwen3VideoProcessor, "<|video_pad|>", [(1, 4), (5, 6)]),  # the wrapper replaced too
        (Glm4vVideoProcessor, "<|video|>", [(2, 3), (5, 6)]),  # lone tokens only
        (Gemma4VideoProcessor, "<|video|>", [(2, 3), (5, 6)]),
    ],
)
def test_template_finds_each_familys_placeholders(cls, name, spans):
    p = cls.__new__(cls)  # (no checkpoint: only what finding placeholders reads)
    p.video_token_id, p.start_id, p.end_id, p.limit, p.v46 = 5, 1, 2, None, False
    ids = [9, 1, 5, 2, 9, 5]  # a wrapped placeholder, then a lone one
    assert p._spans(ids) == spans
    with pytest.raises(ValueError, match=re.escape(f"1 video(s) but the prompt has 2 {name} ")):
        p.process(ids, [np.zeros((2, 8, 8, 3), np.uint8)])


def test_a_processor_refusing_the_checkpoint_leaves_images_only(tmp_path):
    """The table's builder raising ValueError (saved patches not the tower's): the engine
    starts without videos and refuses one by name, then still serves."""
    path = write_tiny_qwen2_vl(tmp_path, version="3", seed=2)
    saved = json.loads((path / "video_preprocessor_config.json").read_text())
    (path / "video_preprocessor_config.json").write_text(json.dumps({**saved, "patch_size": 8}))
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    try:
        assert llm.llm_engine.input_processor.videos is None
        video = {"video": np.zeros((2, 16, 16, 3), np.uint8)}
        prompt = {
            "prompt": "a <|vision_start|><|video_pad|><|vision_end|>",
            "multi_modal_data": video,
        }
        params = SamplingParams(max_tokens=2, temperature=0)
        with pytest.raises(ValueError, match=r"multi_modal_data\['video'\]: this model takes no"):
            llm.generate(prompt, params, use_tqdm=False)
        (out,) = llm.generate("a b c", params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.shutdown()
