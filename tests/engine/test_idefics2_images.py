"""Images through Idefics2 checkpoints (multimodal/idefics2.py) against HF transformers.

A tiny random `Idefics2ForConditionalGeneration` over the tiny Mistral decoder (sliding window
32: shorter than the prompts, long enough that their last token sees back through every view
over two layers): a SigLIP-style tower of 4-pixel patches
with an 8 x 8 position table, images resized to 24..48 pixels a side (so views are not square
and their grids are bucketed into the table), do_image_splitting (4 crops and the whole
image, padded to one size by HF, each run here at its own), a perceiver resampler of 2 layers
(8 latents, 4 query heads over 2 key / value heads). `LLM.generate` with `multi_modal_data`
must give Idefics2Processor's prompt ids (its <fake_token_around_image> merge and the space
it adds after one) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32).
Then the engine's paths against the plain run, TP=2, the server's chat path, and bad input.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches, hf_greedy
from image_checks import (
    WIDE_TALL_SMALL,
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_tensor_parallel,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import (
    _COMMON,
    IDEFICS3_CHAT_TEMPLATE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.idefics2")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
LATENTS = 8
PROMPT = "<|im_start|>User:<image>What is in it?<end_of_utterance>\nAssistant:"
TWO = "<|im_start|>User:<image>and <image>\nWhich is brighter?<end_of_utterance>\nAssistant:"
ADJACENT = "<|im_start|>User:<image><image>Same?<end_of_utterance>\nAssistant:"
TEXT = "<|im_start|>User:Say something about the sea.<end_of_utterance>\nAssistant:"


def write_tiny(path: Path, seed: int) -> Path:
    """A tiny random Idefics2ForConditionalGeneration with its Idefics2Processor (PIL image
    processor, do_image_splitting on) saved, and return its path."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = tiny_config("mistral", vocab_size=len(tokenizer), sliding_window=32).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": 32, "patch_size": 4}
    perceiver = {"hidden_size": 64, "rms_norm_eps": 1e-5, "resampler_n_latents": LATENTS}
    perceiver |= {"resampler_depth": 2, "resampler_n_heads": 4, "resampler_head_dim": 16}
    perceiver |= {"num_key_value_heads": 2}
    config = transformers.Idefics2Config(
        text_config=text,
        vision_config=vision,
        perceiver_config=perceiver,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        **_COMMON,
    )
    _save_random(transformers.Idefics2ForConditionalGeneration, config, seed, path)
    image_processor = transformers.Idefics2ImageProcessorPil(
        size={"shortest_edge": 24, "longest_edge": 48}, do_image_splitting=True
    )
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    transformers.Idefics2Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=LATENTS,
        chat_template=IDEFICS3_CHAT_TEMPLATE,
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("idefics2"), seed=3)


def _hf_inputs(path: Path, text: str, images: list, split: bool = True):
    processor = transformers.AutoProcessor.from_pretrained(path)
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    processor.image_processor.do_image_splitting = split  # what its text follows
    out = processor(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
    keys = ("pixel_values", "pixel_attention_mask")
    return out["input_ids"][0].tolist(), {k: out[k] for k in keys}


@pytest.fixture(scope="module")
def model(path):
    return load_hf_vlm(transformers.Idefics2ForConditionalGeneration, path)


def test_images_match_hf(path, model):
    # wide: views of other shapes than the whole; tall; small
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    assert refs[0][0].count(model.config.image_token_id) == 5 * LATENTS
    check_matches_hf(path, cases, refs, "idefics2")


def test_unsplit_and_adjacent_images_match_hf(path, model):
    """mm_processor_kwargs do_image_splitting=False: one view an image (also with do_pad off:
    no pixel_attention_mask); two <image>s side by side share a <fake_token_around_image>, as
    HF's text merge leaves them."""
    llm = engine(path)
    images = [noise_image(4, (60, 30)), noise_image(5, (30, 30))]
    ids, extra = _hf_inputs(path, ADJACENT, images, split=False)
    assert ids.count(model.config.image_token_id) == 2 * LATENTS
    ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
    prompt = {"prompt": ADJACENT, "multi_modal_data": {"image": images}}
    kwargs = {"mm_processor_kwargs": {"do_image_splitting": False}}
    (out,) = llm.generate([{**prompt, **kwargs}], greedy(), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert_matches("idefics2 unsplit", out, ref)
    unpadded = {"mm_processor_kwargs": {"do_image_splitting": False, "do_pad": False}}
    (again,) = llm.generate([{**prompt, **unpadded}], greedy(), use_tqdm=False)
    assert_matches("idefics2 unpadded (no pixel_attention_mask)", again, ref)


def test_engine_paths_match_the_plain_run(path):
    """The engine's paths through the views against its plain run (image_checks); one image
    short, features, a wrong kind and too many images: ValueErrors, the engine serving."""
    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(path, prompts, TWO)
    pics = prompts[-1]["multi_modal_data"]["image"]
    for bad, match in [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 <image> placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(8, 64)}}, "embeddings"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a.png"}}, "PIL.Image"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        engine(path, limit_mm_per_prompt={"image": 1}).generate(
            [prompts[-1]], greedy(0), use_tqdm=False
        )
    out = cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_tensor_parallel_matches_one_process(path):
    """TP=2 gives the one-process tokens and logprobs, with chunks through the views."""
    prompts = [
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(11, (30, 70)), noise_image(12, (30, 30))]},
        }
    ]
    check_tensor_parallel(path, prompts, chunk=24)


def test_server_chat_gives_the_offline_tokens(path):
    """A chat request with a data: URL image part: the offline tokens and prompt ids of the
    chat template's prompt; two images over --limit-mm-per-prompt a 400 naming messages."""
    llm = engine(path, num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 1})
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    check_chat_data_url(llm, question, noise_image(5, (40, 72)), over_limit=True)
