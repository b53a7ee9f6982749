"""Bee-8B (`BeeForConditionalGeneration`, remote code: models/bee_config.py, multimodal/bee.py)
against HF transformers.

The reference is transformers' LlavaOnevisionForConditionalGeneration over a tiny Qwen3 text
model (transformers takes any text_config), its projector swapped for Bee's written here in
plain torch (pre_norm LayerNorm, linear to 4 x the text width, exact GELU, linear back: vLLM's
BeeMultiModalProjector). The checkpoint is then saved under Bee's config.json (model_type
"bee", architectures, auto_map, image_token_index) and a preprocessor_config.json naming the
release's own processor class, as the Hub's are. `LLM.generate` must give HF's placeholder
counts (HF OneVision's own rule, vLLM's Bee count) and HF's greedy tokens and top-5 logprobs
for single images of several sizes, two images (each tiled, as vLLM's Bee processor does) and
text alone; configurations Bee's path does not run are refused by name.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy
from torch import nn

from paged_engine import LLM, SamplingParams
from paged_engine.models.bee_config import bee_config
from paged_engine.testing import write_tiny_llava

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 6
PROMPT = "USER: <image>\nWhat is in it? Tell me about the colors.\nASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich one is brighter?\nASSISTANT:"
TEXT = "USER: Say something about the sea.\nASSISTANT:"
PINPOINTS = [[30, 60], [60, 30], [60, 60], [90, 90]]
ASPECT = "anyres_max_1"  # a 2 x 2 or 3 x 3 tile map is scaled down, as HF's interpolate does
ROWS = 25  # a 30-pixel view of 6-pixel patches, "full" strategy (SigLIP: no CLS)


class RefBeeProjector(nn.Module):
    """Bee's projector in plain torch (vLLM's BeeMultiModalProjector, its names)."""

    def __init__(self, vision: int, text: int) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(vision, eps=1e-6)
        self.linear_1 = nn.Linear(vision, 4 * text)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(4 * text, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.pre_norm(x))))


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def bee(tmp_path_factory):
    """(path, HF reference model, HF image processor, tokenizer) of a tiny Bee checkpoint."""
    path = write_tiny_llava(
        tmp_path_factory.mktemp("bee"),
        text="qwen3",
        vision="siglip",
        seed=3,
        grid_pinpoints=PINPOINTS,
        onevision=ASPECT,
        vision_feature_select_strategy="full",
    )
    model = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    )
    config = model.config
    projector = RefBeeProjector(config.vision_config.hidden_size, config.text_config.hidden_size)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # weights far from init, so a wrong norm / width / act shows
        for name, p in projector.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(noise * p.shape[1] ** -0.5)
            else:
                p.copy_(noise * 0.3 + (1.0 if name == "pre_norm.weight" else 0.0))
    model.model.multi_modal_projector = projector
    model.save_pretrained(path)
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["BeeForConditionalGeneration"]
    raw["model_type"] = "bee"
    raw["auto_map"] = {
        "AutoConfig": "configuration_bee.BeeConfig",
        "AutoModel": "modeling_bee.BeeForConditionalGeneration",
    }
    (path / "config.json").write_text(json.dumps(raw))
    saved = json.loads((path / "preprocessor_config.json").read_text())
    saved["image_processor_type"] = "BeeImageProcessor"  # the release's class, not transformers'
    saved["auto_map"] = {"AutoImageProcessor": "image_processing_bee.BeeImageProcessor"}
    (path / "preprocessor_config.json").write_text(json.dumps(saved))
    model.eval().generation_config.eos_token_id = None
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, model, image_processor, tok


def _count(image_processor, size: tuple[int, int]) -> int:
    """HF LlavaOnevisionProcessor's placeholders for an image of `size` (h, w) alone."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    rule = SimpleNamespace(  # HF's counting, without its torchvision video half
        image_processor=image_processor, num_image_tokens=ROWS, vision_aspect_ratio=ASPECT
    )
    rule._get_unpadded_features = lambda *a: LlavaOnevisionProcessor._get_unpadded_features(
        rule, *a
    )
    return LlavaOnevisionProcessor._get_number_of_features(rule, *size, 30, 30)


def _expand(tok, text: str, counts: list[int]) -> list[int]:
    parts = text.split("<image>")
    runs = ["<image>" * n for n in counts]
    return tok.encode("".join(p + r for p, r in zip(parts, [*runs, ""], strict=True)))


def test_bee_matches_hf(bee):
    path, model, image_processor, tok = bee
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_model_len=512)
    cases = [[(40, 52)], [(90, 90)], [(20, 90)], [(40, 52), (64, 30)], []]
    for sizes in cases:
        images = [_image(i + 1, s) for i, s in enumerate(sizes)]
        text = {0: TEXT, 1: PROMPT, 2: TWO}[len(sizes)]
        ids = _expand(tok, text, [_count(image_processor, s) for s in sizes])
        extra = {}
        if images:  # a flat list: each image tiled (batch_num_images 1 each)
            out = image_processor(images=images, return_tensors="pt")
            extra = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
        ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
        prompt = {"prompt": text, **({"multi_modal_data": {"image": images}} if images else {})}
        got = llm.generate([prompt], _greedy())
        assert got[0].prompt_token_ids == ids, f"bee {sizes}: placeholder runs differ from HF"
        assert_matches(f"bee {sizes}", got[0], ref)


def test_bee_text_only_and_projector(bee):
    """Served text-only (towers dropped: models/text_wrappers.py's row) it is HF's text path;
    Bee's projector equals the reference's to float32 rounding (exact GELU, its eps)."""
    from paged_engine.multimodal.bee import BeeProjector

    path, model, _, tok = bee
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=16,
        max_model_len=256,
        limit_mm_per_prompt={"image": 0},
    )
    ids = tok.encode(TEXT)
    got = llm.generate([{"prompt_token_ids": ids}], _greedy())
    assert_matches("bee text-only", got[0], hf_greedy(model, ids, MAX_TOKENS, 5))
    ref = model.model.multi_modal_projector
    ours = BeeProjector(model.config, 1)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(
        2, 7, model.config.vision_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(3 * x), ref(3 * x), rtol=0, atol=1e-6)


def _raw(**changes) -> dict:
    raw = {
        "architectures": ["BeeForConditionalGeneration"],
        "model_type": "bee",
        "text_config": {"model_type": "qwen3", "hidden_size": 32},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
        "image_token_index": 5,
        "image_grid_pinpoints": PINPOINTS,
        "vision_aspect_ratio": ASPECT,
    }
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            raw[outer] = {**raw[outer], inner: value}
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"text_config.model_type": "llama"}, r"text_config\.model_type"),
        ({"vision_config.model_type": "clip_vision_model"}, r"vision_config\.model_type"),
        ({"vision_feature_layer": [-1, -2]}, "vision_feature_layer"),
        ({"image_token_index": None}, "image_token_index"),
    ],
    ids=["text", "tower", "layers", "token"],
)
def test_bee_config_refused(changes, match):
    assert bee_config(_raw()).vision_aspect_ratio == ASPECT
    with pytest.raises(ValueError, match=match):
        bee_config(_raw(**changes))


def test_bee_saved_settings_refused(bee, tmp_path):
    from paged_engine.multimodal.bee import BeeLayout

    path = bee[0]
    config = bee_config(json.loads((path / "config.json").read_text()))
    layout = BeeLayout(config, config.image_token_id, None)
    with pytest.raises(ValueError, match=r"no preprocessor_config\.json"):
        layout.read_saved(tmp_path)
    saved = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**saved, "image_grid_pinpoints": [[30, 60]]})
    )
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        layout.read_saved(tmp_path)
