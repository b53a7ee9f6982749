"""Hostile inputs found while probing the remote-code VLM kinds (DeepSeek-OCR v1, DeepSeek-VL2,
MiniCPM-V / -o, Molmo v1, Nemotron Nano VL, dots.ocr, Qwen-VL v1, Pixtral / Voxtral in Mistral's
format) whose cause was shared: an image processed ahead (a server's `ImageInput`) whose pixels
were changed after processing but kept their hash was cached under the hash of the image it
named, so every later request for that image, anyone's, was answered from the changed pixels.
Its hash is now taken from what it carries. The kind-specific cases sit in each kind's own
test (0 x 0 images: test_deepseek_ocr_v1, test_qwen_vl_v1; a 10**6-pixel Pixtral image_size:
test_image_inputs_hostile's TAMPERED; sampling rates: test_audio_io)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from image_checks import noise_image

from paged_engine import LLM, SamplingParams
from paged_engine import testing as tiny

pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

PROMPT = "USER: <image>\nhi ASSISTANT:"


def test_changed_pixels_under_a_kept_hash_do_not_reach_other_requests(tmp_path):
    path = tiny.write_tiny_llava(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    image = noise_image(0, (40, 50))
    honest = {"prompt": PROMPT, "multi_modal_data": {"image": image}}

    def answers(first_tampered: bool) -> tuple[list, list]:
        llm = LLM(model=str(path), dtype="float32", max_model_len=512)
        ids, done = llm.llm_engine.input_processor.images.process(
            llm.get_tokenizer().encode(PROMPT), image
        )
        zeroed = [
            dataclasses.replace(m, pixel_values=torch.zeros_like(m.pixel_values)) for m in done
        ]
        tampered = {"prompt_token_ids": ids, "multi_modal_data": {"image": zeroed}}
        order = [tampered, honest] if first_tampered else [honest, tampered]
        outs = [llm.generate([r], params, use_tqdm=False)[0].outputs[0] for r in order]
        llm.llm_engine.shutdown()
        return outs if first_tampered else outs[::-1]  # (tampered, honest)

    def logprobs(out) -> list[float]:
        return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]

    tampered_first, honest_after = answers(True)
    tampered_after, honest_first = answers(False)
    assert honest_after.token_ids == honest_first.token_ids  # not the zeroed pixels' rows
    assert logprobs(honest_after) == pytest.approx(logprobs(honest_first), abs=1e-5)
    assert logprobs(tampered_after) == pytest.approx(logprobs(tampered_first), abs=1e-5)
    assert logprobs(tampered_after) != pytest.approx(logprobs(honest_first), abs=1e-5)
