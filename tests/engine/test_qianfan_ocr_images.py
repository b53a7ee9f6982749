"""Images through Qianfan-OCR checkpoints (multimodal/qianfan_ocr.py) against HF transformers.

A tiny random `QianfanOCRForConditionalGeneration` (a Qwen3 decoder; 32-pixel tiles of 4-pixel
patches, pixel shuffle by 0.5: 16 rows a tile; up to 4 tiles and a thumbnail): `LLM.generate`
with `multi_modal_data` must give HF's prompt (each <IMG_CONTEXT> as <img>, 16 per tile,
</img>: QianfanOCRProcessor's rule for its "<image>" marker, written out here because the
processor's image half needs torchvision) and HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32) for a wide, a tall and a small image. Then chunked prefill and prefix caching
through the tiles, the tower's last layer read through its final LayerNorm, and refusals.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    WIDE_TALL_SMALL,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tiled_context_inputs, tokenizer_with

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qianfan_ocr import MARKER, QianfanOCRImageEncoder
from paged_engine.testing import INTERNVL_CHAT_TEMPLATE, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

CTX = "<IMG_CONTEXT>"
PROMPT = f"<|im_start|>user\n{CTX}\nRead the text.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{CTX}\nand {CTX}\nWhich is longer?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


def write_tiny_qianfan_ocr(path, *, seed: int = 0, **vision_overrides) -> object:
    """A tiny random Qianfan-OCR checkpoint (2 tower layers, hidden 32) with GotOcr2's tiling
    image processor and a tokenizer holding <img>, </img>, <IMG_CONTEXT>."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(["<img>", "</img>", CTX, "<image>"], seed)
    text = tiny_config("qwen3", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": [32, 32], "patch_size": [4, 4]}
    config = transformers.QianfanOCRConfig(
        text_config=text,
        vision_config=vision | vision_overrides,
        image_token_id=ids[CTX],
        downsample_ratio=0.5,
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
    )
    _save_random(transformers.QianfanOCRForConditionalGeneration, config, seed, path)
    transformers.GotOcr2ImageProcessor(
        size={"height": 32, "width": 32}, min_patches=1, max_patches=4
    ).save_pretrained(path)
    return finish_checkpoint(path, tokenizer, INTERNVL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_qianfan_ocr(tmp_path_factory.mktemp("qianfan_ocr"), seed=3)


def test_images_match_hf(path):
    model = load_hf_vlm(transformers.QianfanOCRForConditionalGeneration, path)
    # wide: 2 tiles and the thumbnail; tall; small: one tile
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    refs = hf_refs(model, cases, lambda *case: tiled_context_inputs(path, *case))
    check_matches_hf(path, cases, refs, "qianfan_ocr")


def test_image_markers_match_hf_processor(path):
    """ "<image>" in the text (QianfanOCRProcessor's marker, its chat template's) becomes the
    processor's ids, and gives HF's tokens; one image and two in a prompt."""
    model = load_hf_vlm(transformers.QianfanOCRForConditionalGeneration, path)
    names = {"start_image_token": "<img>", "end_image_token": "</img>"}
    tok = transformers.AutoTokenizer.from_pretrained(
        path, extra_special_tokens=names | {"context_image_token": CTX}
    )
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    processor = transformers.QianfanOCRProcessor(image_processor, tok, image_seq_length=16)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(images=images, text=[text], return_tensors="pt")
        return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"]}

    wide, tall = noise_image(1, (40, 90)), noise_image(2, (100, 30))
    cases = [
        (PROMPT.replace(CTX, MARKER), [tall]),
        (TWO.replace(CTX, MARKER), [wide, noise_image(3, (20, 24))]),
    ]
    check_matches_hf(path, cases, hf_refs(model, cases, inputs), "qianfan_ocr")


def test_engine_paths_and_refusals(path):
    """Chunks through the tiles and a prefix-cache hit against the plain run (image_checks);
    one tile an image by mm_processor_kwargs; bad input a ValueError by name, nothing lost."""
    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(path, prompts, TWO)
    images = cached.llm_engine.input_processor.images
    one_tile = {**prompts[0], "mm_processor_kwargs": {"crop_to_patches": False}}
    out = cached.generate([one_tile], greedy(0), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(images.image_token_id) == 16
    pics = prompts[-1]["multi_modal_data"]["image"]
    many = {**prompts[0], "mm_processor_kwargs": {"max_patches": 10**6}}
    cases = [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(4, 63)}}, "hidden size"),
        (many, "max_patches"),
        ({"prompt": TWO.replace(CTX, MARKER), "multi_modal_data": {"image": pics[:1]}}, MARKER),
    ]
    check_refused(path, cached, cases, prompts)


def test_last_layer_reads_the_final_norm(tmp_path):
    """use_mean_pooling False: HF's hidden_states[num_hidden_layers] is last_hidden_state
    (after the tower's LayerNorm); the encoder reads it there, as HF's image features."""

    path = write_tiny_qianfan_ocr(tmp_path / "m", seed=4, use_mean_pooling=False)
    model = load_hf_vlm(transformers.QianfanOCRForConditionalGeneration, path)
    tiles = torch.randn(3, 3, 32, 32)
    for layer in (-1, 2):
        model.config.vision_feature_layer = layer
        config = transformers.AutoConfig.from_pretrained(path, vision_feature_layer=layer)
        encoder = QianfanOCRImageEncoder(config)
        with torch.no_grad():
            want = model.model.get_image_features(
                pixel_values=tiles,
                vision_feature_layer=layer,
                vision_feature_select_strategy="default",
            ).pooler_output
            encoder.load_weights(model.state_dict().items())
            got = encoder.encode([ImageInput(tiles, 0, 48, "x", (3,))])[0]
        torch.testing.assert_close(got, want.flatten(0, 1), rtol=1e-5, atol=1e-5)


def test_refuses_by_name(tmp_path):
    """What the encoder does not run is a ValueError naming the field."""

    config = transformers.QianfanOCRConfig(
        text_config=tiny_config("qwen3").to_dict(),
        vision_config={"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1},
    )
    for field, value, match in [
        ("vision_feature_select_strategy", "full", "vision_feature_select_strategy"),
        ("downsample_ratio", 0.3, "downsample_ratio"),
        ("vision_feature_layer", 5, "vision_feature_layer"),
    ]:
        old = getattr(config, field)
        setattr(config, field, value)
        with pytest.raises(ValueError, match=match):
            QianfanOCRImageEncoder(config)
        setattr(config, field, old)
    config.vision_config.norm_type = "batch_norm"
    with pytest.raises(ValueError, match="norm_type"):
        QianfanOCRImageEncoder(config)
