"""Images through Mistral 3 and Pixtral-12B-style LLaVA checkpoints (multimodal/pixtral.py).

Tiny random checkpoints (Pixtral towers with 4-pixel patches; Mistral 3 merges 2 x 2):
`LLM.generate` with `multi_modal_data` must give HF's prompt (each image as lines of [IMG]
ended by [IMG_BREAK], the last by [IMG_END]: transformers' PixtralProcessor rule, written out
here because that class needs torchvision) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32). Then the engine's own paths against the plain run: chunks through
an image's lines, prefix-cache hits, images processed ahead, and bad input.
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
    noise_image,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import write_tiny_mistral3

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

PROMPT = "[INST][IMG]What is in it? Tell me.[/INST]"
TWO = "[INST][IMG] and [IMG]Which is brighter?[/INST]"
TEXT = "[INST]Say something about the sea.[/INST]"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache = {}

    def make(arch: str = "mistral3"):
        if arch not in cache:
            cache[arch] = write_tiny_mistral3(tmp_path_factory.mktemp(arch), arch=arch, seed=2)
        return cache[arch]

    return make


def _hf_inputs(path, merge: int, text: str, images: list) -> tuple[list[int], dict]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    unit = 4 * merge  # what PixtralProcessor hands its image processor as the patch size
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = image_processor(
        images=images, return_tensors="pt", patch_size={"height": unit, "width": unit}
    )
    pieces = text.split("[IMG]")
    for i, (h, w) in enumerate(out["image_sizes"].tolist()):
        lines = ["[IMG]" * (w // unit) + "[IMG_BREAK]" for _ in range(h // unit)]
        lines[-1] = lines[-1].removesuffix("[IMG_BREAK]") + "[IMG_END]"
        pieces[i] += "".join(lines)
    ids = tok.encode("".join(pieces), add_special_tokens=False)
    return ids, {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}


@pytest.mark.parametrize("arch", ["mistral3", "llava"])
def test_images_match_hf(dirs, arch):
    path = dirs(arch)
    name = "Mistral3" if arch == "mistral3" else "Llava"
    model = load_hf_vlm(getattr(transformers, f"{name}ForConditionalGeneration"), path)
    merge = 2 if arch == "mistral3" else 1
    # the two images resized to fit, in units of the patch
    cases = hf_cases(PROMPT, TEXT, TWO, ((40, 56), (90, 30), (17, 33)))
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, merge, *case))
    check_matches_hf(path, cases, refs, arch)


def test_engine_paths_match_the_plain_run(dirs):
    """The engine's paths through an image's lines against its plain run (image_checks;
    5-token chunks: cut inside lines and at breaks); bad input a ValueError naming
    multi_modal_data, nothing lost."""
    prompts = [
        {
            "prompt": PROMPT,
            "multi_modal_data": {"image": noise_image(i, (24 + 12 * i, 64 - 10 * i))},
        }
        for i in range(3)
    ] + [
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(7, (16, 64)), noise_image(8, (40, 40))]},
        }
    ]
    cached = check_engine_paths(dirs(), prompts, TWO, chunk=5)
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
