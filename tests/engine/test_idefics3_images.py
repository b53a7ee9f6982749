"""Images through Idefics3 / SmolVLM checkpoints (multimodal/idefics3.py) against HF.

Tiny random checkpoints (32-pixel tiles of 8-pixel patches, pixel shuffle by 2: 4 rows a
tile): `LLM.generate` with `multi_modal_data` must give HF's prompt (each image's tiles with
their row / column tokens, then the whole image) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32) for tiled, untiled and several images. Then the engine's own paths
against the plain run (chunks through tiles, prefix-cache hits, images processed ahead), the
tower's position ids against transformers' bucketing, and bad input.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    check_engine_paths,
    check_matches_hf,
    greedy,
    hf_cases,
    hf_refs,
    path_prompts,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import write_tiny_idefics3

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

PROMPT = "<|im_start|>User:<image>What is in it?<end_of_utterance>\nAssistant:"
TWO = "<|im_start|>User:<image>and<image>Which is brighter?<end_of_utterance>\nAssistant:"
TEXT = "<|im_start|>User:Say something about the sea.<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache = {}

    def make(arch: str = "idefics3"):
        if arch not in cache:
            cache[arch] = write_tiny_idefics3(tmp_path_factory.mktemp(arch), arch=arch, seed=3)
        return cache[arch]

    return make


def _hf_inputs(path, arch: str, text: str, images: list) -> tuple[list[int], dict]:
    """HF's prompt ids and pixel inputs: Idefics3's own processor; SmolVLM's layout function
    (its processor needs torchvision for its video processor)."""
    if arch == "idefics3":
        processor = transformers.AutoProcessor.from_pretrained(path)
        if not images:
            return processor.tokenizer.encode(text, add_special_tokens=False), {}
        out = processor(text=text, images=[images], return_tensors="pt")
        keys = ("pixel_values", "pixel_attention_mask")
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys}
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = image_processor(images=[images], return_tensors="pt", return_row_col_info=True)
    parts = text.split("<image>")
    for i, (rows, cols) in enumerate(zip(out["rows"][0], out["cols"][0], strict=True)):
        seg = get_image_prompt_string(
            rows, cols, 4, "<fake_token_around_image>", "<image>", "<global-img>"
        )
        parts[i] += seg
    ids = tok.encode("".join(parts), add_special_tokens=False)
    return ids, {
        "pixel_values": out["pixel_values"],
        "pixel_attention_mask": out["pixel_attention_mask"],
    }


@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_images_match_hf(dirs, arch):
    path = dirs(arch)
    cls = getattr(
        transformers, f"{'Idefics3' if arch == 'idefics3' else 'SmolVLM'}ForConditionalGeneration"
    )
    model = load_hf_vlm(cls, path)
    # 2 x 3 tiles; tall; small
    cases = hf_cases(PROMPT, TEXT, TWO, ((50, 90), (96, 40), (20, 24)))
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, arch, *case))
    check_matches_hf(path, cases, refs, arch)


def test_tower_position_ids_are_transformers_buckets():
    """A full grid's bucketed ids, as transformers' embeddings compute them for an all-ones
    patch mask, for grid sides where float rounding could move a bucket."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from paged_engine.multimodal.vision_transformer import _bucketed_position_ids

    seen: list[torch.Tensor] = []
    for side in (3, 7, 24, 27, 32, 35, 48, 64):
        config = transformers.Idefics3VisionConfig(
            hidden_size=8, image_size=side * 2, patch_size=2, num_attention_heads=2
        )
        emb = Idefics3VisionEmbeddings(config)
        seen.clear()
        emb.position_embedding.register_forward_hook(lambda m, args, out: seen.append(args[0]))
        mask = torch.ones(1, side, side, dtype=torch.bool)
        emb(torch.zeros(1, 3, side * 2, side * 2), mask)
        assert torch.equal(seen[0][0], _bucketed_position_ids(side)), side


def test_engine_paths_match_the_plain_run(dirs):
    """The engine's paths through tiles against its plain run (image_checks); one placeholder
    short, or features instead of images, a ValueError naming multi_modal_data."""
    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(dirs(), prompts, TWO)
    pics = prompts[-1]["multi_modal_data"]["image"]
    for bad, match in [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(4, 64)}}, "embeddings"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    assert (
        len(cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0].outputs[0].token_ids) == 8
    )
