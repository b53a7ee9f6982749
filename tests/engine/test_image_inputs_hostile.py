"""Awkward images on every image layout: a 1-pixel image, a 1 x 300 strip, a palette image
and a huge one give an answer or a ValueError naming multi_modal_data (HF's processor refuses
some, e.g. Qwen's aspect-ratio bound), never a crash, and the engine serves on."""

from __future__ import annotations

import numpy as np
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine import testing as tiny

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

MODELS = {
    "llava": (tiny.write_tiny_llava, {}, "USER: <image>\nhi ASSISTANT:"),
    "llava-next": (
        tiny.write_tiny_llava,
        {"grid_pinpoints": [[30, 60], [60, 30], [60, 60]]},
        "USER: <image>\nhi ASSISTANT:",
    ),
    "qwen2-vl": (tiny.write_tiny_qwen2_vl, {}, "<|vision_start|><|image_pad|><|vision_end|>hi"),
    "idefics3": (tiny.write_tiny_idefics3, {}, "User:<image>hi"),
    "mistral3": (tiny.write_tiny_mistral3, {}, "[INST][IMG]hi[/INST]"),
    "internvl": (tiny.write_tiny_internvl, {}, "<IMG_CONTEXT>\nhi"),
    "gemma3": (tiny.write_tiny_gemma3, {}, "<start_of_turn>user\n<start_of_image>hi"),
}


def _images():
    rng = np.random.default_rng(0)

    def noise(h: int, w: int):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    return {
        "1x1": noise(1, 1),
        "1x300": noise(1, 300),
        "palette": noise(40, 50).convert("P"),
        "rgba": noise(40, 50).convert("RGBA"),
        "huge": noise(1500, 1100),
    }


@pytest.mark.parametrize("kind", list(MODELS))
def test_awkward_images_answer_or_refuse_cleanly(tmp_path, kind):
    write, kw, prompt = MODELS[kind]
    path = write(tmp_path, **kw)
    llm = LLM(model=str(path), dtype="float32", max_model_len=1024, max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    answered = 0
    for name, image in _images().items():
        request = {"prompt": prompt, "multi_modal_data": {"image": image}}
        if kind == "gemma3":  # its crops too (pan-and-scan of the strip and the huge one)
            request["mm_processor_kwargs"] = {"do_pan_and_scan": True}
        try:
            out = llm.generate([request], params, use_tqdm=False)[0]
        except ValueError as e:
            assert "multi_modal_data" in str(e), (name, e)
            continue
        assert len(out.outputs[0].token_ids) == 2, name
        answered += 1
    assert answered >= 3  # the 1-pixel, palette and transparent ones at least
    assert len(llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
