"""Images through DeepSeek-VL checkpoints (multimodal/deepseek_vl.py) against HF.

A tiny random `DeepseekVLForConditionalGeneration`: a SigLIP tower of 16-pixel images in 4-pixel
patches (16 rows an image), the MLP aligner, a Llama decoder; DeepSeek-VL's image processor
(longest side resized, padded square with the mean colour). `LLM.generate` with
`multi_modal_data` must give DeepseekVLProcessor's prompt ids (a run of num_image_tokens
<image_placeholder>) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32).
Then the engine's paths (chunks through images, prefix-cache hits, images processed ahead),
bad input, the server's chat path with a data: URL, and the Hub's older tower names.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_paths_and_refusals,
    check_refused,
    check_vision_fields_refused,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
    processor_inputs,
)
from vlm_checkpoints import encoder_from_checkpoint, finish_checkpoint, load_hf_vlm, saved_tokenizer

from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_vl")

SIDE, PATCH = 16, 4
IMAGE = "<image_placeholder>"
PROMPT = f"User: {IMAGE}Describe it.\n\nAssistant:"
TWO = f"User: {IMAGE} and {IMAGE}Which is brighter?\n\nAssistant:"
TEXT = "User: Say something about the sea.\n\nAssistant:"
SIZES = ((40, 58), (90, 30), (17, 33))  # hf_cases' images: wide and tall, padded square
ROWS = torch.zeros(5, 48)  # image embeddings of a width other than the text's hidden size
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image_placeholder>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _tiny_parts(path, seed: int) -> tuple:
    """(the tokenizer saved at `path`, the Llama text config, the SigLIP vision config)."""
    tokenizer = saved_tokenizer(path, [IMAGE], CHAT_TEMPLATE, seed, image_token=IMAGE)
    text = tiny_config("llama", vocab_size=len(tokenizer)).to_dict()
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 4}
    vision |= {"patch_size": PATCH, "image_size": SIDE}
    return tokenizer, text, vision


def write_tiny_deepseek_vl(path, seed: int = 0):
    """A tiny random DeepSeek-VL checkpoint with its processor (DeepseekVLProcessor)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, text, vision = _tiny_parts(path, seed)
    config = transformers.DeepseekVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        **_COMMON,
    )
    _save_random(transformers.DeepseekVLForConditionalGeneration, config, seed, path)
    images = transformers.DeepseekVLImageProcessor(size={"height": SIDE, "width": SIDE})
    processor = transformers.DeepseekVLProcessor(
        image_processor=images, tokenizer=tokenizer, num_image_tokens=(SIDE // PATCH) ** 2
    )
    return finish_checkpoint(path, processor)


def write_tiny_hybrid(path, seed: int = 0):
    """A tiny random DeepSeek-VL hybrid checkpoint: also a SAM tower on 36-pixel images in
    4-pixel patches (a 9 x 9 grid; windows of 4, zero-padded, in layer 0, global layer 1),
    a nonzero high_res_vision_alpha."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, text, vision = _tiny_parts(path, seed)
    high = {"model_type": "sam_vision_model", "hidden_size": 16, "output_channels": 8}
    high |= {"num_hidden_layers": 2, "num_attention_heads": 2, "mlp_dim": 32, "window_size": 4}
    high |= {"image_size": 36, "patch_size": PATCH, "global_attn_indexes": [1]}
    config = transformers.DeepseekVLHybridConfig(
        text_config=text,
        vision_config=vision,
        high_res_vision_config=high,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        **_COMMON,
    )
    _save_random(transformers.DeepseekVLHybridForConditionalGeneration, config, seed, path)
    images = transformers.DeepseekVLHybridImageProcessor(
        size={"height": SIDE, "width": SIDE}, high_res_size={"height": 36, "width": 36}
    )
    processor = transformers.DeepseekVLHybridProcessor(
        image_processor=images, tokenizer=tokenizer, num_image_tokens=(SIDE // PATCH) ** 2
    )
    return finish_checkpoint(path, processor)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_deepseek_vl(tmp_path_factory.mktemp("deepseek_vl"), seed=4)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return write_tiny_hybrid(tmp_path_factory.mktemp("deepseek_vl_hybrid"), seed=6)


def _hf_refs(model, path, cases: list) -> list:
    """hf_refs of `cases` through `path`'s processor (text alone too)."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    keys = ("pixel_values", "high_res_pixel_values")
    return hf_refs(model, cases, lambda *case: processor_inputs(processor, *case, keys, whole=True))


def test_images_match_hf(path):
    """One image, text alone, two images (wide and tall: padded square); then HF's expanded
    ids as prompt_token_ids."""
    model = load_hf_vlm(transformers.DeepseekVLForConditionalGeneration, path)
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    refs = _hf_refs(model, path, cases)
    assert refs[2][0].count(model.config.image_token_id) == 2 * 16
    check_matches_hf(path, cases, refs, "deepseek_vl")


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""
    rows = {"prompt": PROMPT, "multi_modal_data": {"image": ROWS}}
    check_paths_and_refusals(path, PROMPT, TWO, lambda _: [(rows, "hidden size")])


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <image_placeholder> expanded to 16)."""
    question = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT


def test_older_tower_names_load(path, tmp_path):
    """A save with SiglipVisionModel's inner nesting (`model.vision_model.vision_model.X`, as
    transformers 4 wrote) serves the same tokens."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "nested"
    shutil.copytree(path, copy)
    weights = load_file(copy / "model.safetensors")
    tower = "model.vision_model."
    nested = {
        (tower + "vision_model." + k.removeprefix(tower) if k.startswith(tower) else k): v
        for k, v in weights.items()
    }
    save_file(nested, copy / "model.safetensors", metadata={"format": "pt"})
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(13, (40, 56))}}
    want, got = (engine(p).generate([prompt], greedy(0), use_tqdm=False)[0] for p in (path, copy))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_config_refusals(path):
    from paged_engine.multimodal.archs import build_encoder

    cases = [("model_type", "clip_vision_model", "model_type"), ("image_size", 18, "image_size=18")]
    check_vision_fields_refused(path, cases, build_encoder)


def test_hybrid_images_match_hf(hybrid):
    """The hybrid (SAM beside SigLIP): HF's prompt ids, greedy tokens and top-5 logprobs for
    one image, text alone and two images; its encoder's rows equal HF's image features."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.inputs import ImageInput

    model = load_hf_vlm(transformers.DeepseekVLHybridForConditionalGeneration, hybrid)
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    check_matches_hf(hybrid, cases, _hf_refs(model, hybrid, cases), "deepseek_vl_hybrid")
    processor = transformers.AutoProcessor.from_pretrained(hybrid)
    out = processor.image_processor(images=cases[2][1], return_tensors="pt")
    encoder = build_encoder(model.config).float()
    encoder.load_weights(load_file(hybrid / "model.safetensors").items())
    flat = [
        ImageInput(torch.cat([a.flatten(), b.flatten()]), 0, 16, "")
        for a, b in zip(out["pixel_values"], out["high_res_pixel_values"], strict=True)
    ]
    with torch.no_grad():
        want = model.model.get_image_features(out["pixel_values"], out["high_res_pixel_values"])
        got = torch.stack(encoder.encode(flat))
    assert float(encoder.high_res_vision_alpha.detach().abs()) > 0.05  # the tapped branch counts
    torch.testing.assert_close(got, want.pooler_output, atol=1e-5, rtol=0)


def test_hybrid_engine_paths_match_the_plain_run(hybrid):
    """image_checks' paths on the hybrid; the encoder's rows of an image given as image
    embeddings (vLLM's features input) give the image's tokens; bad input refused."""
    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(hybrid, prompts, TWO)
    images = cached.llm_engine.input_processor.images
    _, (placed,) = images.process(cached.get_tokenizer().encode(PROMPT), [noise_image(5, (30, 50))])
    encoder = encoder_from_checkpoint(hybrid, images.config)
    with torch.no_grad():
        (rows,) = encoder.encode([placed])
    as_image, as_rows = (
        cached.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": x}}], greedy(0), use_tqdm=False
        )[0]
        for x in (noise_image(5, (30, 50)), rows)
    )
    assert as_rows.prompt_token_ids == as_image.prompt_token_ids
    assert as_rows.outputs[0].token_ids == as_image.outputs[0].token_ids
    one = noise_image(9, (20, 20))
    refused = [
        ({"prompt": TWO, "multi_modal_data": {"image": [one]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": ROWS}}, "hidden size"),
    ]
    check_refused(hybrid, cached, refused, prompts)
