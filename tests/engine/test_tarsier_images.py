"""Images through Tarsier v1 checkpoints (multimodal/tarsier.py) against HF transformers.

A tiny random `LlavaForConditionalGeneration` (CLIP tower, 30-pixel images of 6-pixel patches:
25 patches under "default") saved with LlavaProcessor, its config.json then renamed
TarsierForConditionalGeneration with `image_newline_idx` / `image_new_idx`, as the releases
have it. The reference is HF's LLaVA on the same weights with vLLM's Tarsier rule written here
in torch: each `<image>` token becomes a run of 5 * (5 + 1) + 1 = 31, and the run's rows are
HF's projected features as a 5 x 5 grid, each grid row followed by the embedding of
image_newline_idx, the whole followed by that of image_new_idx. `LLM.generate` gives those
prompt ids (checked literally too) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32) for one image, two and text alone in one batch; the encoder's rows equal the rule's
for transformers 5's weight names; the engine's own paths; bad input and bad config fields
refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import hf_greedy_with_rows
from image_checks import (
    check_config_refused,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    hf_cases,
    noise_image,
    path_prompts,
    usual_refusals,
)
from test_vipllava_images import PROMPT, TEXT, TWO  # LLaVA 1.5's turns
from vlm_checkpoints import load_hf_vlm

from paged_engine.multimodal.archs import build_encoder, image_kind
from paged_engine.testing import write_tiny_llava

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

NEWLINE, NEW = 100, 101  # the separator ids written into config.json
SIDE, RUN = 5, 5 * (5 + 1) + 1  # patches per grid row (and rows); placeholders an image


def write_tiny_tarsier(path, seed: int = 5):
    """(HF's LLaVA checkpoint, the same as a Tarsier v1 release) under `path`."""
    llava = write_tiny_llava(path / "llava", seed=seed)
    tarsier = path / "tarsier"
    shutil.copytree(llava, tarsier)
    config = json.loads((tarsier / "config.json").read_text())
    config |= {
        "architectures": ["TarsierForConditionalGeneration"],
        "image_newline_idx": NEWLINE,
        "image_new_idx": NEW,
    }
    (tarsier / "config.json").write_text(json.dumps(config))
    return llava, tarsier


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_tiny_tarsier(tmp_path_factory.mktemp("tarsier"))


def tarsier_rows(model, features: torch.Tensor) -> torch.Tensor:
    """vLLM's rule on one image's projected features [25, D]: grid rows each ended by the
    image_newline_idx embedding, then the image_new_idx one -> [31, D]."""
    table = model.get_input_embeddings().weight
    grid = features.view(SIDE, SIDE, -1)
    lines = torch.cat([grid, table[NEWLINE].expand(SIDE, 1, -1)], dim=1).flatten(0, 1)
    return torch.cat([lines, table[NEW][None]])


def expanded(ids: list[int], image: int) -> list[int]:
    """vLLM's prompt replacement: each image token -> a run of RUN image tokens."""
    return [t for x in ids for t in ([image] * RUN if x == image else [x])]


def hf_tarsier_refs(model, processor, cases) -> list:
    image = model.config.image_token_id
    refs = []
    for text, images in cases:
        ids = expanded(processor.tokenizer(text)["input_ids"], image)
        rows = []
        if images:
            pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                features = model.model.get_image_features(pixels).pooler_output
                rows = [tarsier_rows(model, f) for f in features]
        refs.append((ids, hf_greedy_with_rows(model, ids, image, rows)))
    return refs


def test_images_match_hf(paths):
    llava, tarsier = paths
    model = load_hf_vlm(transformers.LlavaForConditionalGeneration, llava)
    processor = transformers.AutoProcessor.from_pretrained(llava)
    cases = hf_cases(PROMPT, TEXT, TWO)
    refs = hf_tarsier_refs(model, processor, cases)
    image = model.config.image_token_id
    assert [ids.count(image) for ids, _ in refs] == [RUN, 0, 2 * RUN]
    # the literal rule: the text around each image untouched, the image a run of 31
    one = processor.tokenizer(PROMPT)["input_ids"]
    at = one.index(image)
    assert refs[0][0] == one[:at] + [image] * 31 + one[at + 1 :]
    check_matches_hf(tarsier, cases, refs, "tarsier")


def test_encoder_rows_are_the_separated_features(paths):
    """transformers 5's names (`model.language_model.embed_tokens.weight`): the encoder's rows
    are the rule's, the separators exactly the embedding rows."""
    llava, tarsier = paths
    model = load_hf_vlm(transformers.LlavaForConditionalGeneration, llava)
    config = transformers.AutoConfig.from_pretrained(tarsier)
    assert image_kind(config) == "tarsier"
    encoder = build_encoder(config).float()
    encoder.load_weights(model.state_dict().items())
    processor = transformers.AutoProcessor.from_pretrained(llava)
    images = [noise_image(1, (40, 56)), noise_image(2, (30, 30))]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        features = model.model.get_image_features(pixels).pooler_output
        want = torch.stack([tarsier_rows(model, f) for f in features])
        got = torch.stack(encoder.encode([_Pixels(p) for p in pixels]))
    assert got.shape == want.shape == (2, RUN, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    table = model.get_input_embeddings().weight
    assert torch.equal(got[:, SIDE], table[NEWLINE].expand(2, -1))
    assert torch.equal(got[:, -1], table[NEW].expand(2, -1))


class _Pixels:  # what LlavaImageEncoder.encode reads of an ImageInput
    def __init__(self, pixel_values: torch.Tensor) -> None:
        self.pixel_values = pixel_values


def test_engine_paths_and_bad_input(paths):
    """Chunks through the runs, prefix-cache hits and images processed ahead against the plain
    run; the usual bad input and image features a ValueError by name, nothing lost."""
    _, tarsier = paths
    prompts = path_prompts(PROMPT, TWO)
    llm = check_engine_paths(tarsier, prompts, TWO)
    features = {"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(25, 64)}}
    cases = [*usual_refusals(PROMPT, TWO, noise_image(3, (30, 30))), (features, "embeddings")]
    check_refused(tarsier, llm, cases, prompts)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
        ({"image_newline_idx": None}, "image_newline_idx"),
        ({"image_new_idx": 513}, "image_new_idx"),
    ],
    ids=["full-26-patches", "no-newline", "new-past-vocab"],
)
def test_bad_config_refused(paths, tmp_path, fields, match):
    _, tarsier = paths
    config = json.loads((tarsier / "config.json").read_text()) | fields
    check_config_refused(tarsier, tmp_path / "bad", config, match)


def test_release_run_is_vllms_601():
    """Tarsier-7b / -34b's tower (CLIP ViT-L/14 at 336 pixels, "default"): 576 patches in 24
    rows, so 576 + 24 + 1 placeholders an image, vLLM's processor's count."""
    from paged_engine.multimodal.tarsier import TarsierLayout

    config = transformers.LlavaConfig(
        vision_config={"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
        text_config={"model_type": "llama", "vocab_size": 32064},
        image_token_index=32000,
        vision_feature_select_strategy="default",
    )
    config.image_newline_idx, config.image_new_idx = 32002, 32003
    assert TarsierLayout(config, 32000, None).fixed == 601
