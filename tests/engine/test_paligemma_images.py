"""Images through PaliGemma / PaliGemma 2 checkpoints (multimodal/paligemma.py) against HF.

Tiny random `PaliGemmaForConditionalGeneration`s (Gemma 1 text, and Gemma 2 text with soft-caps
and a sliding window longer than the prompts; a SigLIP tower of 16-pixel images in 4-pixel
patches: 16 rows an image): `LLM.generate` with `multi_modal_data` must give PaliGemmaProcessor's
prompt ids ("<image>" runs, <bos>, the prompt and "\\n") and HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32), HF's prefill letting the whole prompt see itself both ways and
counting positions from 1. Then chunked prefill (the prompt in one step, or refused) and bad
input (text alone: HF's processor refuses it, its model would attend over it both ways).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import assert_same_greedy
from image_checks import check_matches_hf, engine, greedy, hf_refs, noise_image
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer, tiny_config

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

SIDE, PATCH = 16, 4  # 16 placeholders an image
SHORT, LONG = "caption en", "answer en what is in the picture, and which colour is it?"


def write_tiny_paligemma(path, text_type: str, seed: int = 0):
    """A tiny random PaliGemma checkpoint (text model `text_type`) with its processor."""
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(seed=seed)
    base.add_special_tokens({"additional_special_tokens": ["<image>"]})
    base.save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, extra_special_tokens={"image_token": "<image>"}
    )
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text = tiny_config(text_type, vocab_size=len(tokenizer)).to_dict()
    if text_type == "gemma2":
        text |= {"sliding_window": 64, "attn_logit_softcapping": 5.0}
        text |= {"final_logit_softcapping": 3.0}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": SIDE, "patch_size": PATCH}
    vision |= {"model_type": "siglip_vision_model", "vision_use_head": False}
    config = transformers.PaliGemmaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=image_id,
        projection_dim=text["hidden_size"],
        hidden_size=text["hidden_size"],
        tie_word_embeddings=False,
        **_COMMON,
    )
    _save_random(transformers.PaliGemmaForConditionalGeneration, config, seed, path)
    images = transformers.SiglipImageProcessor(size={"height": SIDE, "width": SIDE})
    images.image_seq_length = (SIDE // PATCH) ** 2
    processor = transformers.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    processor.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gemma", "gemma2"])
def path(request, tmp_path_factory):
    return write_tiny_paligemma(tmp_path_factory.mktemp(request.param), request.param, seed=5)


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    processor = transformers.AutoProcessor.from_pretrained(path)
    out = processor(text=[text], images=[images], return_tensors="pt")
    extra = {"pixel_values": out["pixel_values"], "token_type_ids": out["token_type_ids"]}
    return out["input_ids"][0].tolist(), extra


def test_images_match_hf(path):
    """One image, two images (HF's "<image>" form, a prompt ending in "\n"), prompts of
    different lengths in one batch; then HF's expanded ids as prompt_token_ids."""
    model = load_hf_vlm(transformers.PaliGemmaForConditionalGeneration, path)
    cases = [
        (SHORT, [noise_image(1, (40, 90))]),
        (LONG, [noise_image(2, (20, 24))]),
        (f"<image><image>{SHORT}\n", [noise_image(3, (30, 30)), noise_image(4, (50, 20))]),
    ]
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "paligemma")


def test_prefix_attends_both_ways(path):
    """The image's rows see the text after them: marking the prefix causal moves the logprobs
    (so the HF match above depends on the two-way prefix)."""
    prompt = {"prompt": LONG, "multi_modal_data": {"image": noise_image(6, (32, 32))}}
    both = engine(path).generate([prompt], greedy(5, 1), use_tqdm=False)[0]
    causal = engine(path)
    layout = causal.llm_engine.input_processor.images.layout
    finish = layout.finish
    layout.finish = lambda ids, ims: [
        dataclasses.replace(m, prefix_end=0) for m in finish(ids, ims)
    ]
    one_way = causal.generate([prompt], greedy(5, 1), use_tqdm=False)[0]
    first, second = both.outputs[0].logprobs[0], one_way.outputs[0].logprobs[0]
    assert max(abs(first[t].logprob - second[t].logprob) for t in first if t in second) > 1e-3


def test_chunked_prefill_keeps_the_prompt_whole(path):
    """Two 24-token prompts under a 30-token budget: the second waits for a step with room for
    all of it (no 6-token chunk of its prefix), so the tokens and logprobs are the plain run's;
    a 48-token prompt is a ValueError naming max_num_batched_tokens, and the engine serves on."""
    prompts = [
        {"prompt": SHORT, "multi_modal_data": {"image": noise_image(7, (30, 30))}},
        {"prompt": SHORT, "multi_modal_data": {"image": noise_image(8, (20, 40))}},
    ]
    params = greedy(0, 6)
    plain = engine(path).generate(prompts, params, use_tqdm=False)
    llm = engine(path, max_num_batched_tokens=30, enable_chunked_prefill=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same_greedy([o.outputs[0] for o in plain], [o.outputs[0] for o in got])
    long = {"prompt": LONG, "multi_modal_data": {"image": noise_image(7, (30, 30))}}
    with pytest.raises(ValueError, match="max_num_batched_tokens=30"):
        llm.generate([long], params, use_tqdm=False)
    (out,) = llm.generate(prompts[1:], params, use_tqdm=False)
    assert out.outputs[0].token_ids == plain[1].outputs[0].token_ids


def test_prefix_cache_hits_need_the_whole_prompt(path):
    """A hit past the image (block 0 of a 24-token prompt) still lets the rest of the prompt
    see the image rows both ways (the plain run's logprobs), also for the image processed
    ahead; another text with the same image hits nothing (the image's keys and values depend
    on the text after it)."""
    image = noise_image(10, (40, 90))
    first, other = ({"prompt": t, "multi_modal_data": {"image": image}} for t in (SHORT, LONG))
    params = greedy(0, 6)
    plain = engine(path, enable_prefix_caching=False).generate([first], params, use_tqdm=False)
    llm = engine(path, enable_prefix_caching=True)
    llm.generate([first], params, use_tqdm=False)
    (again,) = llm.generate([first], params, use_tqdm=False)
    assert again.num_cached_tokens == 16
    assert_same_greedy([plain[0].outputs[0]], [again.outputs[0]])
    # processed ahead (a server's request thread): the same prompt, hashes and hit
    images = llm.llm_engine.input_processor.images
    ids, placed = images.process(llm.get_tokenizer().encode(SHORT), [image])
    ahead = {"prompt_token_ids": ids, "multi_modal_data": {"image": list(placed)}}
    (done,) = llm.generate([ahead], params, use_tqdm=False)
    assert done.num_cached_tokens == 16 and done.prompt_token_ids == again.prompt_token_ids
    assert done.outputs[0].token_ids == again.outputs[0].token_ids
    (out,) = llm.generate([other], params, use_tqdm=False)
    assert out.num_cached_tokens == 0


def test_bad_input_refused(path):
    llm = engine(path)
    image = noise_image(9, (20, 20))
    for bad, match in [
        ({"prompt": f"{SHORT}<image>", "multi_modal_data": {"image": image}}, "before the text"),
        ({"prompt": SHORT, "multi_modal_data": {"image": torch.zeros(16, 64)}}, "embeddings"),
        (SHORT, "need an image"),  # HF's processor refuses it; HF's model would see it both ways
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    layout = llm.llm_engine.input_processor.images.layout
    layout.window, window = 20, layout.window  # PaliGemma 2's sliding window, shorter than 24
    with pytest.raises(ValueError, match="sliding_window=20"):
        llm.generate([{"prompt": SHORT, "multi_modal_data": {"image": image}}], greedy(0))
    layout.window = window
    out = llm.generate([{"prompt": SHORT, "multi_modal_data": {"image": image}}], greedy(0, 3))
    assert len(out[0].outputs[0].token_ids) == 3
