"""Hostile input on this session's new surfaces: Donut's image prompts, the Transformers backend's
vision-language prompts (paged's processor) and its encoder path's padded batch.

- An image Pillow opened lazily whose file is truncated (Image.open reads only the header) or a
  closed one is a ValueError naming multi_modal_data['image'] (it was an OSError, or PIL's
  bare "Operation on closed image", from inside the processor), on Donut and on the
  Transformers backend's LLaVA, and the engine serves on.
- Donut's extreme strips (1 x 10000, 10000 x 1), which DonutImageProcessor's thumbnail makes 0
  rows, are refused naming multi_modal_data['image'] (it was HF's bare "Size must contain ...").
- The encoder path's padded HF batch: one max-length prompt beside many one-token prompts ran as
  one [B, max L] batch (B x max L rows through every layer, here 85 times the step's tokens);
  each padded call now holds at most the step's own tokens (`padded_groups`), and each
  prompt's embedding is what it gives alone.
"""

from __future__ import annotations

import io

import pytest
import torch
from hf_parity import assert_refused_while_serving
from image_checks import noise_image

pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

from paged_engine import LLM  # noqa: E402
from paged_engine.models.transformers_backend.encoder import padded_groups  # noqa: E402
from paged_engine.testing import BOS_ID, EOS_ID, write_tiny_encoder, write_tiny_llava  # noqa: E402

IMAGE = r"multi_modal_data\['image'\]"


def _truncated():
    """A PNG cut in half, opened as a client's Image.open would (lazily: only its header)."""
    buf = io.BytesIO()
    noise_image(1, (40, 40)).save(buf, "PNG")
    return Image.open(io.BytesIO(buf.getvalue()[: len(buf.getvalue()) // 2]))


def _closed():
    image = noise_image(6, (40, 24))
    image.close()  # PIL: "Operation on closed image"
    return image


def test_donut_undecodable_and_degenerate_images_refused_by_name(tmp_path) -> None:
    from test_donut import write_tiny

    llm = LLM(model=str(write_tiny(tmp_path)), dtype="float32", block_size=16)
    cases = [
        ({"prompt": "hi", "multi_modal_data": {"image": _truncated()}}, rf"{IMAGE}: not an image"),
        ({"prompt": "hi", "multi_modal_data": {"image": _closed()}}, rf"{IMAGE}: not an image"),
        (
            {"prompt": "hi", "multi_modal_data": {"image": noise_image(2, (1, 10000))}},
            rf"{IMAGE} \(10000x1 pixels\): Donut's image processor cannot take it",
        ),
        (
            {"prompt": "hi", "multi_modal_data": {"image": noise_image(3, (10000, 1))}},
            rf"{IMAGE} \(1x10000 pixels\): Donut's image processor",
        ),
    ]
    ok = {"prompt": "hi", "multi_modal_data": {"image": noise_image(4, (40, 24))}}
    assert_refused_while_serving(llm, cases, ok)


def test_transformers_backend_vlm_undecodable_image_refused_by_name(tmp_path) -> None:
    path = write_tiny_llava(tmp_path, vision="clip", seed=3)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, model_impl="transformers")
    prompt = "USER: <image>\nWhat?\nASSISTANT:"
    cases = [
        (
            {"prompt": prompt, "multi_modal_data": {"image": _truncated()}},
            rf"{IMAGE}\[0\]: not an image Pillow can decode",
        )
    ]
    assert_refused_while_serving(
        llm, cases, {"prompt": prompt, "multi_modal_data": {"image": noise_image(5, (30, 30))}}
    )


def test_padded_groups_hold_at_most_the_step_tokens() -> None:
    lengths = [1, 127, 1, 1, 1, 50, 50]
    groups = padded_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[b] for b in g) <= sum(lengths)
    assert padded_groups([9, 9, 9]) == [[0, 1, 2]]  # equal lengths: one batch, no padding


def test_encoder_padded_batch_bounded_by_the_step_tokens(tmp_path) -> None:
    path = write_tiny_encoder(tmp_path, "BertModel", seed=1)
    kw = {"device": "cpu", "dtype": "float32", "max_model_len": 128}
    llm = LLM(str(path), model_impl="transformers", **kw)
    model = llm.llm_engine.model_runner.model
    shapes: list[tuple[int, ...]] = []
    model.get_submodule(model.inner_name).register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    long = [BOS_ID, *range(5, 130), EOS_ID]  # 127 tokens: max_model_len leaves one
    prompts = [long] + [[BOS_ID, 7 + i % 3] for i in range(100)]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    real = sum(len(p) for p in prompts)
    assert shapes and all(b * n <= real for b, n in shapes), (shapes, real)
    got = [torch.tensor(o.outputs.embedding) for o in outs]
    for g, p in zip(got[:3], prompts, strict=False):  # as each gives alone
        (alone,) = llm.embed([{"prompt_token_ids": p}], use_tqdm=False)
        assert torch.allclose(g, torch.tensor(alone.outputs.embedding), atol=1e-5)
