"""Images through BLIP-2 checkpoints (multimodal/blip2.py) against HF.

A tiny random `Blip2ForConditionalGeneration`: BLIP-2's ViT on 16-pixel images in 4-pixel
patches (17 rows with the CLS), a 2-layer Q-Former (cross-attention in layer 0 only; its text
half saved too, as use_qformer_text_input writes it) over 8 query tokens, an OPT decoder (and
a Llama one). `LLM.generate` with `multi_modal_data` must give Blip2Processor's prompt ids (8
"<image>" before the BOS) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32);
two images (HF's model fills its image tokens in order; its processor writes one image's run)
as lone "<image>" tokens or, unmarked, both runs first. Then the engine's paths (chunks through
the queries, prefix-cache hits, images processed ahead), bad input, and the Flan-T5 variant
refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import hf_greedy
from image_checks import (
    check_engine_paths,
    check_matches_hf,
    check_refused,
    engine,
    greedy,
    noise_image,
    path_prompts,
    usual_refusals,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, saved_tokenizer

from paged_engine.multimodal.blip2 import Blip2ImageEncoder
from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")

SIDE, PATCH, QUERIES = 16, 4, 8
IMAGE = "<image>"
ONE = "Question: what is shown in the picture here? Answer:"  # no image token: vLLM's form
TWO = f"{IMAGE} left, {IMAGE} right: which one is brighter? Answer:"
TEXT = "Question: say something about the sea. Answer:"


def _configs(tokenizer, text_type: str) -> dict:
    text = tiny_config(text_type, vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": SIDE, "patch_size": PATCH}
    qformer = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    qformer |= {"num_attention_heads": 4, "cross_attention_frequency": 2}
    qformer |= {"use_qformer_text_input": True}
    return {"text_config": text, "vision_config": vision, "qformer_config": qformer}


def write_tiny_blip2(path, text_type: str = "opt", seed: int = 0):
    """A tiny random BLIP-2 checkpoint (text model `text_type`) with its processor."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = saved_tokenizer(path, [IMAGE], None, seed)  # (Blip2Processor adds its own)
    config = transformers.Blip2Config(
        **_configs(tokenizer, text_type),
        num_query_tokens=QUERIES,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        **_COMMON,
    )
    _save_random(transformers.Blip2ForConditionalGeneration, config, seed, path)
    images = transformers.BlipImageProcessor(size={"height": SIDE, "width": SIDE})
    processor = transformers.Blip2Processor(
        image_processor=images, tokenizer=tokenizer, num_query_tokens=QUERIES
    )
    return finish_checkpoint(path, processor)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_blip2(tmp_path_factory.mktemp("blip2"), seed=3)


class _ByIds:
    """HF's BLIP-2 with hf_greedy's call (its generate takes pixel_values first)."""

    def __init__(self, model) -> None:
        self.model = model

    def generate(self, ids, **kw):
        return self.model.generate(input_ids=ids, **kw)


def _refs(model, path, cases: list) -> list:
    """(HF's ids, HF's greedy run) of each (text, images): one image through Blip2Processor;
    several with each lone "<image>" expanded to its run, or the runs first where the text has
    none (what HF's model reads; its processor writes one run)."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    tid = model.config.image_token_id
    refs = []
    for text, images in cases:
        out = processor(text=[text], images=images, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        if len(images) > 1:
            plain = processor.tokenizer.encode(text)
            runs = [tid] * QUERIES
            ids = [t for x in plain for t in (runs if x == tid else [x])]
            ids = ids if tid in plain else runs * len(images) + plain
        pixels = out["pixel_values"]
        refs.append((ids, hf_greedy(_ByIds(model), ids, 8, 5, pixel_values=pixels)))
    return refs


@pytest.mark.parametrize("text_type", ["opt", "llama"])
def test_images_match_hf(path, tmp_path, text_type):
    """OPT: one image (Blip2Processor's ids), two images as lone tokens and unmarked (runs
    first); Llama: one image. Then HF's expanded ids as prompt_token_ids."""
    if text_type != "opt":
        path = write_tiny_blip2(tmp_path / text_type, text_type, seed=4)
    model = load_hf_vlm(transformers.Blip2ForConditionalGeneration, path)
    cases = [(ONE, [noise_image(1, (40, 56))])]
    if text_type == "opt":
        two = [noise_image(2, (72, 24)), noise_image(3, (33, 47))]
        cases += [(TWO, two), (TEXT, two[::-1])]
    refs = _refs(model, path, cases)
    assert refs[0][0][: QUERIES + 1].count(model.config.image_token_id) == QUERIES  # first
    check_matches_hf(path, cases, refs, f"blip2-{text_type}")


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (5-token chunks through the query rows, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""
    prompts = path_prompts(ONE, TWO)
    cached = check_engine_paths(path, prompts, TWO, chunk=5)
    one = noise_image(9, (20, 20))
    refused = usual_refusals(f"{IMAGE} {ONE}", TWO, one)
    rows = torch.zeros(QUERIES, 48)  # not the text's hidden size
    refused.append(({"prompt": ONE, "multi_modal_data": {"image": rows}}, "hidden size"))
    check_refused(path, cached, refused, prompts)


def test_image_embeds_and_text_alone(path):
    """vLLM's image embeddings (the projected query rows) give the images' tokens; a prompt
    without an image is the text model's run."""
    llm = engine(path)
    image = noise_image(5, (30, 30))
    (want,) = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": image}}], greedy(0))
    encoder = llm.llm_engine.model_runner.images.encoder
    ids, (placed,) = llm.llm_engine.input_processor.images.process(
        llm.get_tokenizer().encode(ONE), [image]
    )
    with torch.no_grad():
        (rows,) = encoder.encode([placed])
    (got,) = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": rows}}], greedy(0))
    assert got.prompt_token_ids == ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    (text,) = llm.generate([TEXT], greedy(0))
    assert IMAGE not in llm.get_tokenizer().decode(text.prompt_token_ids)


def test_unsupported_configs_refused(path, tmp_path):
    """An encoder-decoder text_config (BLIP-2's Flan-T5 checkpoints) and an OPT token embedding
    narrower than the image rows are refused by name."""
    config = transformers.AutoConfig.from_pretrained(path)
    config.text_config.word_embed_proj_dim = 16
    with pytest.raises(ValueError, match="word_embed_proj_dim=16"):
        Blip2ImageEncoder(config)
    config = json.loads((path / "config.json").read_text())
    config["text_config"] = {"model_type": "t5", "d_model": 32, "vocab_size": 600}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_text((path / name).read_text())
    with pytest.raises(ValueError, match="'t5' \\(an encoder-decoder"):
        engine(tmp_path)
