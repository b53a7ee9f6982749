"""Images through Llama 3.2 Vision checkpoints (models/mllama.py, multimodal/mllama.py) against HF.

A tiny random `MllamaForConditionalGeneration` (text: 3 layers, layer 1 cross-attending, GQA;
vision: 16-pixel tiles of 8-pixel patches, 5 rows a tile, up to 2 tiles, 2 local layers both
kept as intermediate features, 1 gated global layer; every gate nonzero) and its
MllamaProcessor: `LLM.generate` with `multi_modal_data` must give HF `generate`'s greedy
tokens and top-5 logprobs (1e-3, float32) for text before the image (HF's fully masked rows:
attention over every image row, no MLP branch), an image first, two adjacent images of
different tile counts, and a text-only prompt (the cross-attention layers skipped), in one
batch. Then chunked prefill through the first image token, prefix caching (hits need the same
images; a text-only prompt's blocks never serve an image prompt), tensor parallelism (TP=2
against one process, with two KV heads split and one replicated), the server's chat path and
the refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy
from image_checks import (
    check_chat_data_url,
    check_chunks_and_prefix_hits,
    check_matches_hf,
    check_tensor_parallel,
    engine,
    greedy,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, saved_tokenizer

from paged_engine.testing import _COMMON, _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

IMAGE = "<|image|>"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tiny_mllama(path: Path, seed: int = 0, kv_heads: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = saved_tokenizer(path, [IMAGE], TEMPLATE, seed, image_token=IMAGE)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_global_layers": 1, "attention_heads": 4, "image_size": 16, "patch_size": 8}
    vision |= {"max_num_tiles": 2, "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}
    vision |= {"intermediate_layers_indices": [0, 1], "vision_output_dim": 96}
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3}
    text |= {"num_attention_heads": 4, "num_key_value_heads": kv_heads}
    text |= {"cross_attention_layers": [1]}
    text |= {"vocab_size": len(tokenizer), "max_position_embeddings": 512, **_COMMON}
    config = transformers.MllamaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        tie_word_embeddings=False,
    )
    _save_random(transformers.MllamaForConditionalGeneration, config, seed, path)
    images = transformers.MllamaImageProcessor(size={"height": 16, "width": 16}, max_image_tiles=2)
    processor = transformers.MllamaProcessor(image_processor=images, tokenizer=tokenizer)
    return finish_checkpoint(path, processor)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_mllama(tmp_path_factory.mktemp("mllama"), seed=3)


@pytest.fixture(scope="module")
def bos(path) -> str:
    return transformers.AutoTokenizer.from_pretrained(path).bos_token


def _hf_refs(path, cases):
    model = load_hf_vlm(transformers.MllamaForConditionalGeneration, path)
    processor = transformers.AutoProcessor.from_pretrained(path)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        extra = {k: out[k] for k in out if k not in ("input_ids", "attention_mask")}
        return out["input_ids"][0].tolist(), extra

    return hf_refs(model, cases, inputs)  # greedy()'s 8 tokens


def test_images_match_hf(path, bos):
    """Text before the image (a 2-tile image), an image first (a 1-tile one), a text-only
    prompt, two adjacent images: one batch, HF's prompt ids, tokens and logprobs; HF's ids as
    prompt_token_ids give the same tokens."""
    cases = [
        (f"{bos}describe the {IMAGE}picture in a few words", [noise_image(1, (20, 40))]),
        (f"{IMAGE}{bos}what is it?", [noise_image(2, (30, 16))]),
        (f"{bos}a text-only prompt about the sea", []),
    ]
    check_matches_hf(path, cases, _hf_refs(path, cases), "mllama")
    two = [
        (f"{bos}compare {IMAGE}{IMAGE}these", [noise_image(3, (16, 16)), noise_image(4, (40, 20))])
    ]
    ((ids, ref),) = _hf_refs(path, two)
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    prompts = [{"prompt": two[0][0], "multi_modal_data": {"image": two[0][1]}}, cases[0][0]]
    out = llm.generate(prompts, greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert_matches("mllama, two images", out, ref)


def test_the_image_changes_the_answer(path, bos):
    """Another image moves the logprobs of the rows after it and of the rows before it (HF's
    fully masked rows read every image row), so the HF match depends on both."""
    llm = engine(path)

    def first(text: str, seed: int) -> dict:
        prompt = {"prompt": text, "multi_modal_data": {"image": noise_image(seed, (20, 40))}}
        params = greedy(5, 1)
        params.prompt_logprobs = 1
        return llm.generate([prompt], params, use_tqdm=False)[0]

    text = f"{bos}some words first {IMAGE}then the question"
    a, b = first(text, 5), first(text, 6)
    before = text.split(IMAGE)[0]
    n = len(llm.get_tokenizer().encode(before))
    for lo, hi in ((1, n), (n + 1, len(a.prompt_token_ids))):
        diff = max(
            abs(x[t].logprob - y[t].logprob)
            for x, y, t in zip(
                a.prompt_logprobs[lo:hi], b.prompt_logprobs[lo:hi], a.prompt_token_ids[lo:hi]
            )
        )
        assert diff > 1e-4, (lo, hi)


def test_chunks_and_prefix_cache(path, bos):
    """5-token chunks (through the first image token and the masked rows before it) give the
    plain tokens; the same image again hits the prefix cache, another image does not; a
    text-only prompt's cached blocks never serve an image prompt with the same text."""
    pre = f"{bos}a longer preamble so that the prompt fills more than one block "
    prompts = [
        {"prompt": f"{pre}{IMAGE}tell me", "multi_modal_data": {"image": noise_image(i, (30, 20))}}
        for i in range(3)
    ]
    params = greedy(0, 6)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 5, lambda proc: proc.images.image_token_id
    )
    other = cached.generate(prompts[2:], params, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0  # (every block is keyed by the image: no hit at all)
    text_only = cached.generate([f"{pre}{IMAGE}tell me"], params, use_tqdm=False)[0]
    assert text_only.num_cached_tokens == 0
    again = engine(path, enable_prefix_caching=True)
    run(again, [prompts[0]["prompt"]])  # the same ids, text only, cached first
    got = again.generate(prompts[:1], params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0
    assert_same_greedy(plain[:1], [got.outputs[0]])


def test_chat_image_url(path):
    """The server's chat path: an image_url part gives the offline tokens and prompt."""
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    check_chat_data_url(engine(path), question, noise_image(12, (40, 72)))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tensor_parallel_matches_one_process(path, bos, kv_heads, tmp_path):
    """TP=2 (gloo) gives the one-process greedy tokens and logprobs for one image (text before
    it), two images and a text-only prompt in one batch, prefill chunked at 8 tokens (through
    the images and the masked rows). Each rank holds two of the four query heads of every
    layer and, with two KV heads, one of them; with one KV head, that head replicated. The
    tower runs whole on both ranks."""
    if kv_heads != 2:
        path = write_tiny_mllama(tmp_path / "mqa", seed=4, kv_heads=kv_heads)
    pics = [noise_image(3, (16, 16)), noise_image(4, (40, 20))]
    prompts = [
        {"prompt": f"{bos}describe the {IMAGE}picture", "multi_modal_data": {"image": pics[1]}},
        {"prompt": f"{bos}compare {IMAGE}{IMAGE}these", "multi_modal_data": {"image": pics}},
        f"{bos}a text-only prompt about the sea",
    ]
    check_tensor_parallel(path, prompts, 8, limit_mm_per_prompt={"image": 2})


def test_bad_input_refused(path, bos):
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    one, two = noise_image(9, (20, 20)), [noise_image(10, (20, 20))] * 2
    for bad, match in [
        ({"prompt": f"{bos}{IMAGE}a{IMAGE}b", "multi_modal_data": {"image": two}}, "one run"),
        ({"prompt": f"{bos}{IMAGE}{IMAGE}b", "multi_modal_data": {"image": one}}, "image"),
        ({"prompt": f"{bos}no token", "multi_modal_data": {"image": one}}, "image"),
        ({"prompt": f"{bos}{IMAGE}b", "multi_modal_data": {"image": torch.zeros(4, 64)}}, "embed"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    out = llm.generate(
        [{"prompt": f"{bos}{IMAGE}b", "multi_modal_data": {"image": one}}], greedy(0, 3)
    )
    assert len(out[0].outputs[0].token_ids) == 3
    default = engine(path)  # one image a prompt unless told
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        default.generate([{"prompt": f"{bos}{IMAGE}{IMAGE}b", "multi_modal_data": {"image": two}}])
    for kw, match in [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not split"),
        ({"enable_lora": True}, "enable_lora"),
        ({"max_model_len": 1024}, "max_position_embeddings"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine(path, **kw)
