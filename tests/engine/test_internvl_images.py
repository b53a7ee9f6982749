"""Images through InternVL checkpoints (multimodal/internvl.py) against HF transformers.

A tiny random `InternVLForConditionalGeneration` (32-pixel tiles of 4-pixel patches, pixel
shuffle by 0.5: 16 rows a tile; up to 4 tiles and a thumbnail): `LLM.generate` with
`multi_modal_data` must give HF's prompt (each <IMG_CONTEXT> as <img>, 16 per tile, </img>:
InternVLProcessor's rule, written out here because that class needs torchvision) and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32). Then the engine's own paths
against the plain run and bad input.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    WIDE_TALL_SMALL,
    check_engine_paths,
    check_matches_hf,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
)
from vlm_checkpoints import load_hf_vlm, tiled_context_inputs

from paged_engine.testing import write_tiny_internvl

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

CTX = "<IMG_CONTEXT>"
PROMPT = f"<|im_start|>user\n{CTX}\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{CTX}\nand {CTX}\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_internvl(tmp_path_factory.mktemp("internvl"), seed=2)


def test_images_match_hf(path):
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, path)
    # wide: 2 tiles and the thumbnail; tall; small: one tile
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    refs = hf_refs(model, cases, lambda *case: tiled_context_inputs(path, *case))
    check_matches_hf(path, cases, refs, "internvl")


def test_engine_paths_match_the_plain_run(path):
    """The engine's paths through the tiles against its plain run (image_checks);
    mm_processor_kwargs (one tile an image); bad input a ValueError naming multi_modal_data,
    nothing lost."""
    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(path, prompts, TWO)
    images = cached.llm_engine.input_processor.images
    one_tile = {**prompts[0], "mm_processor_kwargs": {"crop_to_patches": False}}
    out = cached.generate([one_tile], greedy(0), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(images.image_token_id) == 16
    pics = prompts[-1]["multi_modal_data"]["image"]
    for bad, match in [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(4, 63)}}, "hidden size"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    assert (
        len(cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0].outputs[0].token_ids) == 8
    )


def test_image_features_give_the_image_answer(path):
    """vLLM's image_embeds for InternVL: the encoder's own features of an image, given as a
    tensor, become <img>, a run of their rows, </img>: the image's prompt and tokens; so do
    HF's expanded ids, and the features processed ahead."""
    llm = engine(path)
    image = noise_image(1, (40, 90))
    params = greedy(0)
    (want,) = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], params)
    images = llm.llm_engine.input_processor.images
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    _, done = images.process(ids, [image])
    with torch.no_grad():
        (feats,) = llm.llm_engine.model_runner.images.encoder.encode(list(done))
    for prompt in (
        {"prompt": PROMPT, "multi_modal_data": {"image": feats}},
        {"prompt_token_ids": want.prompt_token_ids, "multi_modal_data": {"image": [feats]}},
    ):
        (got,) = llm.generate([prompt], params)
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    expanded, ahead = images.process(ids, feats)
    (got,) = llm.generate(
        [{"prompt_token_ids": expanded, "multi_modal_data": {"image": list(ahead)}}], params
    )
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
