"""The hook that runs our torch copies of transformers' torchvision-only image processors
(multimodal/torch_processors.py; the copies beside their models): which checkpoint gets which
processor, what a copy refuses by name, and torchvision's resize rule. The copies' pixels are
checked against transformers' classes (bit for bit, where torchvision imports) in
test_llama4_images.py, test_aya_vision_images.py, test_gemma4_images.py and
test_kimi_k25_images.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from paged_engine.multimodal import torch_processors as tp
from paged_engine.multimodal.aya_vision import Cohere2VisionTorchProcessor
from paged_engine.multimodal.gemma4 import Gemma4TorchProcessor
from paged_engine.multimodal.llama4 import Llama4TorchProcessor

pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")


def _saved(tmp_path, settings: dict, name: str = "preprocessor_config.json"):
    body = settings if name == "preprocessor_config.json" else {"image_processor": settings}
    (tmp_path / name).write_text(json.dumps(body))
    return tmp_path


@pytest.mark.parametrize(
    ("settings", "model_type", "want"),
    [
        ({"image_processor_type": "Llama4ImageProcessorFast"}, "llama4", "Llama4TorchProcessor"),
        (
            {"image_processor_type": "Cohere2VisionImageProcessor"},
            "",
            "Cohere2VisionTorchProcessor",
        ),
        ({"image_processor_type": "Gemma4ImageProcessor"}, "gemma4", "Gemma4TorchProcessor"),
        ({}, "llama4", "Llama4TorchProcessor"),  # no type saved: the model_type's
        ({"image_processor_type": "SomeRemoteProcessor"}, "cohere2_vision", "Cohere2Vision"),
        ({"image_processor_type": "GotOcr2ImageProcessor"}, "cohere2_vision", None),  # PIL twin
        ({"image_processor_type": "SiglipImageProcessor"}, "llava", None),
    ],
)
def test_which_processor(tmp_path, settings, model_type, want):
    config = SimpleNamespace(model_type=model_type)
    for name in ("preprocessor_config.json", "processor_config.json"):
        ours = tp.torch_processor(_saved(tmp_path, settings, name), config)
        (tmp_path / name).unlink()
        assert (want is None) if ours is None else type(ours).__name__.startswith(want)


def test_hook_takes_transformers_where_torchvision_imports(tmp_path, monkeypatch):
    path = _saved(tmp_path, {"image_processor_type": "GotOcr2ImageProcessor"})
    config = SimpleNamespace(model_type="cohere2_vision")
    monkeypatch.setattr(tp, "torchvision_available", lambda: False)
    assert type(tp.image_processor(path, config)).__name__.startswith("GotOcr2ImageProcessor")
    path = _saved(tmp_path, {"image_processor_type": "Cohere2VisionImageProcessor"})
    assert type(tp.image_processor(path, config)) is Cohere2VisionTorchProcessor


def test_refusals_name_the_setting():
    for cls, settings, match in [
        (Llama4TorchProcessor, {"resample": 1}, "resample"),  # LANCZOS
        (Llama4TorchProcessor, {"size": {"height": 32, "width": 48}}, "size"),
        (Llama4TorchProcessor, {"do_resize": False}, "do_resize"),
        (Cohere2VisionTorchProcessor, {"size": {"shortest_edge": 32}}, "size"),
        (Gemma4TorchProcessor, {"max_soft_tokens": 100}, "max_soft_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            cls(settings)
    from image_checks import noise_image

    ours = Llama4TorchProcessor({"size": {"height": 32, "width": 32}})
    with pytest.raises(ValueError, match="crop_to_patches"):
        ours(images=[noise_image(0, (20, 30))], crop_to_patches=True)
    with pytest.raises(ValueError, match="do_rescale"):
        ours(images=[noise_image(0, (20, 30))], do_rescale=False)


def test_mm_processor_kwargs_checked_against_the_copy():
    """The engine's mm_processor_kwargs check reads the copy's valid_kwargs."""
    from paged_engine.multimodal.processor import ImageProcessor

    proc = ImageProcessor.__new__(ImageProcessor)
    proc._hf, proc.layout = Llama4TorchProcessor({}), None  # (a layout with no refused_kwargs)
    assert proc.processor_kwargs({"max_patches": 2}) == {"max_patches": 2}
    with pytest.raises(ValueError, match="mm_processor_kwargs\\['crop_to_patches'\\]"):
        proc.processor_kwargs({"crop_to_patches": True})


def test_resize_follows_torchvision(monkeypatch):
    """The same size is returned as it is; bilinear on a CPU without AVX2 runs in float32 and
    rounds (torchvision's fallback), within one step of the uint8 kernel; nearest-exact keeps
    values."""
    x = torch.randint(0, 256, (2, 3, 17, 23), dtype=torch.uint8)
    assert tp.resize(x, (17, 23), 3) is x
    native = tp.resize(x, (9, 40), 2)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(tp.platform, "machine", lambda: "x86_64")
    fallback = tp.resize(x, (9, 40), 2)
    assert fallback.dtype == torch.uint8 and fallback.shape == (2, 3, 9, 40)
    assert (fallback.int() - native.int()).abs().max() <= 1
    near = tp.resize(x, (34, 46), 0)
    assert set(near.unique().tolist()) <= set(x.unique().tolist())
    with pytest.raises(ValueError, match="resample"):
        tp.resize(x, (8, 8), 4)  # BOX
