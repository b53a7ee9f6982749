"""Images through ViP-LLaVA checkpoints (multimodal/vipllava.py) against HF transformers.

A tiny random `VipLlavaForConditionalGeneration` (a CLIP tower of 3 layers read at -2, 1 and -1,
CLS dropped from each, concatenated; the projector's layernorm before its MLP) saved with
LlavaProcessor as the real checkpoints are: `LLM.generate` with `multi_modal_data` gives HF's
prompt ids and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32), a text prompt
in the batch; the encoder's rows equal HF's get_image_features for a single int feature layer
and a SigLIP tower too. Then the engine's paths against its plain run (chunks through the
images, prefix-cache hits, images processed ahead) and bad input refused by name.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    check_engine_paths,
    check_matches_hf,
    check_refused,
    engine,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
    processor_inputs,
    usual_refusals,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.multimodal.archs import build_encoder, image_kind
from paged_engine.testing import _COMMON, LLAVA_CHAT_TEMPLATE, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

PROMPT = "USER: <image>\nWhat is in it? Tell me about the colors.\nASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich one is brighter?\nASSISTANT:"
TEXT = "USER: Say something about the sea.\nASSISTANT:"


def write_tiny_vipllava(path, *, vision: str = "clip", layers=(-2, 1, -1), seed: int = 4):
    """A tiny random ViP-LLaVA checkpoint (30-pixel images, 6-pixel patches) with LlavaProcessor
    (its image processor, a tokenizer holding <image>, LLaVA's chat template)."""
    tokenizer, ids = tokenizer_with(["<image>"], seed)
    fields = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
    fields |= {"num_attention_heads": 4, "image_size": 30, "patch_size": 6}
    square = {"height": 30, "width": 30}
    if vision == "clip":
        tower = transformers.CLIPVisionConfig(**fields, projection_dim=32)
        images = transformers.CLIPImageProcessor(size={"shortest_edge": 30}, crop_size=square)
    else:
        tower = transformers.SiglipVisionConfig(**fields)
        images = transformers.SiglipImageProcessor(size=square)
    config = transformers.VipLlavaConfig(
        text_config=tiny_config("llama", vocab_size=len(tokenizer)).to_dict(),
        vision_config=tower.to_dict(),
        image_token_index=ids["<image>"],
        vision_feature_layer=layers,
        projector_layernorm_eps=1e-5,
        **_COMMON,
    )
    _save_random(transformers.VipLlavaForConditionalGeneration, config, seed, path)
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=6,
        vision_feature_select_strategy="default",  # HF's model drops the first token
        num_additional_image_tokens=int(vision == "clip"),
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return finish_checkpoint(path, processor)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_vipllava(tmp_path_factory.mktemp("vipllava"))


def test_images_match_hf(path):
    model = load_hf_vlm(transformers.VipLlavaForConditionalGeneration, path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    cases = hf_cases(PROMPT, TEXT, TWO)
    refs = hf_refs(
        model, cases, lambda t, imgs: processor_inputs(processor, t, imgs, ("pixel_values",))
    )
    assert all(ids.count(model.config.image_token_id) in (0, 25, 50) for ids, _ in refs)
    check_matches_hf(path, cases, refs, "vipllava")


@pytest.mark.parametrize(
    ("vision", "layers"), [("clip", -2), ("siglip", (0, -1))], ids=["clip-int", "siglip"]
)
def test_encoder_rows_equal_hf_image_features(tmp_path, vision, layers):
    """One int feature layer (CLS dropped) and a SigLIP tower (no CLS: a real patch dropped,
    as HF does): the encoder's rows are HF's projected features."""
    path = write_tiny_vipllava(tmp_path, vision=vision, layers=layers, seed=6)
    model = load_hf_vlm(transformers.VipLlavaForConditionalGeneration, path)
    assert image_kind(model.config) == "vipllava"
    encoder = build_encoder(model.config).float()
    encoder.load_weights(model.state_dict().items())
    processor = transformers.AutoProcessor.from_pretrained(path)
    images = [noise_image(1, (40, 56)), noise_image(2, (30, 30))]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = model.model.get_image_features(pixels).pooler_output
        got = torch.stack(encoder.encode([_Pixels(p) for p in pixels]))
    assert got.shape == want.shape == (2, 25 - int(vision == "siglip"), 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class _Pixels:  # what LlavaImageEncoder.encode reads of an ImageInput
    def __init__(self, pixel_values: torch.Tensor) -> None:
        self.pixel_values = pixel_values


def test_engine_paths_and_bad_input(path):
    """Chunks through the images, prefix-cache hits and images processed ahead against the
    plain run; the usual bad input a ValueError by name (wrong image counts, not an image, a
    video on an image model), nothing lost."""
    prompts = path_prompts(PROMPT, TWO)
    llm = check_engine_paths(path, prompts, TWO)
    cases = usual_refusals(PROMPT, TWO, noise_image(3, (30, 30)))
    check_refused(path, llm, cases, prompts)
    assert engine(path).llm_engine.input_processor.videos is None
