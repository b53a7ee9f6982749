"""Aria (multimodal/aria.py, models/aria.py) against HF.

A tiny random `AriaForConditionalGeneration`: an Idefics3-style tower of 70-pixel patches (crops
of 980 pixels: a 14 x 14 grid, 8 queries; of 490: 7 x 7, 4 queries), the cross-attention
projector, a MoE decoder (4 routed experts, top 2, 2 shared); AriaImageProcessor with a small
min_image_size, so a crop's valid box (pixel_mask) leaves whole patch rows and columns out.
`LLM.generate` with `multi_modal_data` must give AriaProcessor's prompt ids (crops x queries
image tokens an image) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32),
also with split_image (mm_processor_kwargs). Then the crops' pixels and boxes against HF's
processor, the encoder's rows against HF's image features (vision_feature_layer -1 and -2), the
engine's paths (chunks through crops, prefix-cache hits, images processed ahead, image
embeddings), bad input, the server's chat path with a data: URL, config refusals, and
`AriaTextForCausalLM` alone (HF parity, transformers 5's names, TP=2).
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_matches,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    engine,
    greedy,
    noise_image,
    path_prompts,
)

from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.aria")
pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
IMAGE = "<|img|>"
PROMPT = f"User: {IMAGE}Describe it.\nAssistant:"
TWO = f"User: {IMAGE} and {IMAGE}Which is brighter?\nAssistant:"
TEXT = "User: Say something about the sea.\nAssistant:"
SPLIT = {"split_image": True, "max_image_size": 490}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|img|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
TEXT_CONFIG = {
    "model_type": "aria_text",
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "moe_num_experts": 4,
    "moe_topk": 2,
    "moe_num_shared_experts": 2,
    **_COMMON,
}


def write_tiny_aria(path, seed: int = 0):
    """A tiny random Aria checkpoint with its processor (AriaProcessor)."""
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(seed=seed)
    base.add_special_tokens({"additional_special_tokens": [IMAGE]})
    base.chat_template = CHAT_TEMPLATE
    base.save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, extra_special_tokens={"image_token": IMAGE}
    )
    vision = {"model_type": "idefics3_vision", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 4}
    vision |= {"patch_size": 70, "image_size": 980}
    config = transformers.AriaConfig(
        text_config={**TEXT_CONFIG, "vocab_size": len(tokenizer)},
        vision_config=vision,
        projector_patch_to_query_dict={49: 4, 196: 8},
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE),
        **_COMMON,
    )
    _save_random(transformers.AriaForConditionalGeneration, config, seed, path)
    from transformers.models.aria.image_processing_pil_aria import AriaImageProcessorPil

    # saved at 490: AriaProcessor passes its own max_image_size=980 over it (as the engine must)
    images = AriaImageProcessorPil(min_image_size=70, max_image_size=490)
    transformers.AriaProcessor(
        image_processor=images, tokenizer=tokenizer, size_conversion={490: 4, 980: 8}
    ).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_aria(tmp_path_factory.mktemp("aria"), seed=5)


@pytest.fixture(scope="module")
def hf(path):
    model = transformers.AriaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval(), transformers.AutoProcessor.from_pretrained(path)


def _hf_inputs(processor, text: str, images: list, **kwargs) -> tuple[list[int], dict]:
    out = processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
    extra = {k: out[k] for k in ("pixel_values", "pixel_mask") if k in out}
    return out["input_ids"][0].tolist(), extra


def test_images_match_hf(path, hf):
    """One image (wide: its crop's lower patch rows padding), text alone, two images (tall;
    small); split_image at 490 (two crops, full boxes, as mm_processor_kwargs)."""
    model, processor = hf
    cases = [
        (PROMPT, [noise_image(1, (50, 90))]),
        (TEXT, []),
        (TWO, [noise_image(2, (96, 40)), noise_image(3, (20, 24))]),
    ]
    refs = []
    for text, images in cases:
        ids, extra = _hf_inputs(processor, text, images)
        refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5, **extra)))
    assert refs[2][0].count(model.config.image_token_id) == 2 * 8
    check_matches_hf(path, cases, refs, "aria")

    image = noise_image(4, (60, 130))
    ids, extra = _hf_inputs(processor, PROMPT, [image], **SPLIT)
    assert extra["pixel_values"].shape[0] == 2 and ids.count(model.config.image_token_id) == 8
    ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}, "mm_processor_kwargs": SPLIT}
    (out,) = engine(path).generate([prompt], greedy(), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert_matches("aria split", out, ref)


def test_crops_and_rows_match_hf(path, hf):
    """The processed crops hold HF's pixel values, their image_size HF's pixel_mask box, and
    the encoder's rows equal HF's image features (vision_feature_layer -1, then -2)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    model, processor = hf
    images = engine(path).llm_engine.input_processor.images
    pics = [noise_image(2, (96, 40)), noise_image(3, (20, 24)), noise_image(1, (50, 90))]
    text = f"{IMAGE} {IMAGE} {IMAGE}"
    _, placed = images.process(processor.tokenizer.encode(text), pics)
    out = processor.image_processor(images=pics, max_image_size=980, return_tensors="pt")
    assert len(placed) == 3
    for m, pixels, mask in zip(placed, out["pixel_values"], out["pixel_mask"], strict=True):
        assert torch.equal(m.pixel_values, pixels)
        h, w = m.image_size[1:]
        assert m.image_size[0] == 980 and int(mask.sum()) == h * w and bool(mask[:h, :w].all())
    assert len({m.image_size for m in placed}) == 3  # three valid boxes, none full
    weights = load_file(path / "model.safetensors")
    for layer in (-1, -2):
        model.config.vision_feature_layer = layer
        encoder = build_encoder(model.config).float()
        encoder.load_weights(weights.items())
        with torch.no_grad():
            want = model.model.get_image_features(
                out["pixel_values"], out["pixel_mask"], vision_feature_layer=layer
            ).pooler_output
            got = torch.stack(encoder.encode(placed))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    model.config.vision_feature_layer = -1


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks: a crop's run each, prefix-cache hits, images
    processed ahead); the encoder's rows of an image given as image embeddings (vLLM's
    features input) give the image's tokens; bad input is a ValueError naming what is wrong,
    and the engine serves on."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(path, prompts, TWO)
    images = cached.llm_engine.input_processor.images
    picture = noise_image(5, (30, 50))
    _, (placed,) = images.process(cached.get_tokenizer().encode(PROMPT), [picture])
    encoder = build_encoder(images.config).float()
    encoder.load_weights(load_file(path / "model.safetensors").items())
    with torch.no_grad():
        (rows,) = encoder.encode([placed])
    as_image, as_rows = (
        cached.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": x}}], greedy(0), use_tqdm=False
        )[0]
        for x in (picture, rows)
    )
    assert as_rows.prompt_token_ids == as_image.prompt_token_ids
    assert as_rows.outputs[0].token_ids == as_image.outputs[0].token_ids
    one = noise_image(9, (20, 20))
    bad_size = {"prompt": PROMPT, "multi_modal_data": {"image": one}}
    refused = [
        ({"prompt": TWO, "multi_modal_data": {"image": [one]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a cat"}}, "PIL.Image.Image"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(8, 48)}}, "hidden size"),
        ({**bad_size, "mm_processor_kwargs": {"max_image_size": 600}}, "490 or 980"),
        ({**bad_size, "mm_processor_kwargs": {"patch_size": 14}}, "mm_processor_kwargs"),
    ]
    check_refused(path, cached, refused, prompts)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|img|> expanded to 8)."""
    question = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT


def test_config_refusals(path):
    """A tower other than idefics3_vision, a list of feature layers, a crop size whose patch
    count projector_patch_to_query_dict lacks: ValueErrors naming the field."""
    from paged_engine.multimodal.archs import build_encoder

    for field, value in [("model_type", "siglip_vision_model"), ("vision_feature_layer", [-1])]:
        config = transformers.AutoConfig.from_pretrained(path)
        setattr(config.vision_config if field == "model_type" else config, field, value)
        with pytest.raises(ValueError, match=field):
            build_encoder(config)
    config = transformers.AutoConfig.from_pretrained(path)
    config.projector_patch_to_query_dict = {49: 4}
    with pytest.raises(ValueError, match="projector_patch_to_query_dict"):
        build_encoder(config)(torch.zeros(1, 3, 980, 980), (980, 980))


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("aria_text")
    config = transformers.AriaTextConfig(**TEXT_CONFIG, vocab_size=512)
    _save_random(transformers.AriaTextForCausalLM, config, 7, path)
    build_tiny_tokenizer(seed=7).save_pretrained(path)
    return path


def test_text_model_matches_hf(text_path):
    """AriaTextForCausalLM alone: HF's greedy tokens and top-5 logprobs; transformers 5's
    in-memory names (fused `gate_up_proj` / `down_proj`, `router`) load as the checkpoint's."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(2)]
    hf = load_hf_model(text_path)
    refs = [hf_greedy(hf, p, MAX_TOKENS, 5) for p in prompts]
    outs = engine(text_path).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False
    )
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("aria_text", out, ref)
    assert_hf_names_load_like_checkpoint(text_path, ".mlp.experts.gate_up_proj", ".router.weight")


def test_text_model_tensor_parallel(text_path):
    """TP=2 (gloo): the routed and shared experts split over two ranks, one all-reduce."""
    prompt = [random.Random(5).randrange(3, 512) for _ in range(24)]
    assert_tp_matches_one_process(text_path, [prompt], MAX_TOKENS, 64)
