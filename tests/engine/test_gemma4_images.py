"""Images through Gemma 4 checkpoints (multimodal/gemma4.py) against HF transformers.

A tiny random `Gemma4ForConditionalGeneration`: the tiny Gemma 4 text model (sliding window 8,
shorter than an image's run; per-layer inputs; KV-shared layers) with
use_bidirectional_attention="vision", and a 2-layer tower of 2-pixel patches pooled 3 x 3 with
grouped KV heads, clipped projections (bounds that bite), standardized output and a rope base
of 50; the image processor keeps each image's aspect ratio within 70 soft tokens. `LLM.generate`
with `multi_modal_data` must give Gemma4Processor's prompt ids and HF `generate`'s greedy tokens
and top-5 logprobs (1e-3, float32). Then the engine's paths against its plain run, TP=2, the
server's chat path with a data: URL, and bad input.

Images: transformers saves Gemma4ImageProcessor whichever class (torchvision or PIL) saved it,
and loads its torchvision class where torchvision imports, else its PIL class (which resamples
otherwise, up to 2 / 255 apart). The engine runs transformers' torchvision class where it
imports, else its torch copy of it (multimodal/torch_processors.py); HF's model reads the
engine's pixels (Gemma4Processor's ids and positions). The copy is checked within 2 / 255 of
the PIL class, and where torchvision imports bit for bit against transformers' class over a
range of sizes and aspect ratios.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import assert_same_greedy
from image_checks import (
    WIDE_TALL_SMALL,
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_tensor_parallel,
    check_vision_fields_refused,
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
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")
pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Gemma4ImageProcessorPil"):
    pytest.skip("transformers lacks Gemma 4's image processor", allow_module_level=True)

TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
PROMPT = "<|bos|><|turn>user\nWhat is in it?<|image|><turn|>\n<|turn>model\n"
# the image within the last token's sliding window (8): the full layers' causal image rows reach
# the logits through the sliding layer after them
NEAR = "<|bos|>Look:<|image|>\n"
TWO = "<|bos|><|turn>user\n<|image|> and <|image|>\nWhich is brighter?<turn|>\n<|turn>model\n"
TEXT = "<|bos|><|turn>user\nSay something about the sea.<turn|>\n<|turn>model\n"
SOFT_TOKENS = 70  # the image processor's max_soft_tokens (its smallest allowed)


def write_tiny_gemma4_vlm(path: Path, seed: int = 0) -> Path:
    """The checkpoint of the module doc, with its image processor and tokenizer (HF's
    Gemma4Processor needs a video processor, i.e. torchvision: `hf_processor` builds it
    without one)."""
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = [*TOKENS.values(), "<|video|>", "<|turn>", "<turn|>"]
    base.add_special_tokens({"additional_special_tokens": specials})
    base.save_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=TOKENS)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
    vocab = len(tok)  # the per-layer table covers the special tokens too
    text = tiny_config(
        "gemma4",
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        use_bidirectional_attention="vision",
    ).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 2,
        "pooling_kernel_size": 3,
        "position_embedding_size": 64,
        "use_clipped_linears": True,
        "standardize": True,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 50.0},
    }
    config = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        **_COMMON,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # buffers HF leaves empty or unbounded: values that change outputs
        for name, b in model.named_buffers():
            if name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape, generator=gen))
            elif name.endswith("std_scale"):
                b.copy_(1 + 0.3 * torch.randn(b.shape, generator=gen))
            elif name.endswith(("_max", "_min")):
                b.fill_(1.5 if name.endswith("_max") else -1.5)
    with _quiet_progress():
        model.save_pretrained(path)
    pil = transformers.Gemma4ImageProcessorPil
    pil(patch_size=2, pooling_kernel_size=3, max_soft_tokens=SOFT_TOKENS).save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


class _NoVideoProcessor(transformers.Gemma4Processor):
    """Gemma4Processor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, name, arg):
        if name == "video_processor" and arg is None:
            return None
        return super().check_argument_for_proper_class(name, arg)


def hf_processor(path):
    return _NoVideoProcessor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=transformers.AutoImageProcessor.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        video_processor=None,
        image_seq_length=SOFT_TOKENS,
    )


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gemma4_vlm(tmp_path_factory.mktemp("gemma4"), seed=3)


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    processor = hf_processor(path)
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    out = processor(text=[text], images=[images], return_tensors="pt")
    keys = ("image_position_ids", "mm_token_type_ids")
    return out["input_ids"][0].tolist(), {k: out[k] for k in keys} | _pixels(path, images, out)


def _pixels(path, images: list, out) -> dict:
    """The engine's pixels for `images` (transformers' torchvision class or the torch copy),
    on the same patch grids as Gemma4Processor's `out`."""
    from paged_engine.multimodal.torch_processors import image_processor

    config = transformers.AutoConfig.from_pretrained(path)
    ours = image_processor(path, config)(images=images, return_tensors="pt")
    assert torch.equal(ours["image_position_ids"], out["image_position_ids"])
    return {"pixel_values": ours["pixel_values"]}


def test_images_match_hf(path):
    """A wide image, text alone, a tall and a small one (each its own grid and run), and an
    image just before the last token; the prompts given as text and as HF's expanded ids."""
    model = load_hf_vlm(transformers.Gemma4ForConditionalGeneration, path)
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    cases.append((NEAR, [noise_image(4, (50, 50))]))
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "gemma4")


def test_engine_paths_and_bad_input(path):
    """Chunks that must move to an image's edges, prefix-cache hits, images processed ahead
    (image_checks); too many images for the prompt, features instead of an image, audio and
    video are ValueErrors naming what is wrong, and so is an image longer than a step's budget;
    the engine keeps serving."""
    prompts = path_prompts(PROMPT, TWO, narrow=0)
    cached = check_engine_paths(path, prompts, TWO, chunk=SOFT_TOKENS + 4)
    pics = prompts[-1]["multi_modal_data"]["image"]
    for bad, match in [
        ({"prompt": PROMPT, "multi_modal_data": {"image": pics}}, "2 image"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(16, 64)}}, "embeddings"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": [0.0] * 160}}, "'audio'"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": [pics[0]] * 2}}, "video"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    out = cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    # a step must hold an image's whole run (it attends both ways): a budget below it is
    # refused when the request comes in, naming multi_modal_data; the engine serves on
    small = engine(path, max_num_batched_tokens=40, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"multi_modal_data.*max_num_batched_tokens=40"):
        small.generate([prompts[2]], greedy(0), use_tqdm=False)
    assert len(small.generate([TEXT], greedy(0), use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_backends_agree(path, backend):
    """The torch reference and the Triton kernel (in its interpreter) give the CPU backend's
    tokens and logprobs: the sliding layers read the images' key ends, the full ones not."""
    prompts = [{"prompt": NEAR, "multi_modal_data": {"image": noise_image(6, (24, 40))}}]
    want = engine(path).generate(prompts, greedy(5, 3), use_tqdm=False)[0].outputs[0]
    got = engine(path, attention_backend=backend).generate(prompts, greedy(5, 3), use_tqdm=False)
    _same_logprobs(want, got[0].outputs[0])


def _same_logprobs(want, got) -> None:
    assert_same_greedy([want], [got])
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert {t: p.logprob for t, p in a.items()} == pytest.approx(
            {t: p.logprob for t, p in b.items()}, abs=1e-4
        )


def test_tensor_parallel_matches_one_process(path):
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (30, 50))] * 2}}]
    check_tensor_parallel(path, prompts, 80)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|image|> expanded by the image's grid)."""
    question = [{"type": "text", "text": "What is in it?"}, {"type": "image"}]
    assert check_chat_data_url(engine(path), question, noise_image(12, (40, 72))).text == PROMPT


def test_config_refusals(path):
    """What the tower does not run is refused by the config field's name."""
    from paged_engine.multimodal.gemma4 import Gemma4ImageEncoder

    cases = [
        ("rope_parameters", {"rope_type": "default", "rope_theta": 1.0}, "rope_type"),
        ("head_dim", 18, "head_dim"),
    ]
    check_vision_fields_refused(path, cases, Gemma4ImageEncoder)


# (height, width): wide, tall, small, square, one pixel thin, larger than the budget
SIZES = [(40, 90), (100, 30), (20, 24), (50, 50), (1, 200), (200, 1), (7, 5), (300, 100)]
SIZES += [(63, 129), (129, 63), (500, 377)]


def test_torch_processor_without_torchvision(path, monkeypatch):
    """With torchvision hidden the checkpoint (its settings name Gemma4ImageProcessor, as
    transformers saves either class) gets the torch copy: each image's positions and soft
    tokens equal transformers' PIL class's, its pixels within 2 / 255 (PIL's bicubic is not
    torchvision's), and the engine's prompt holds its run."""
    from paged_engine.multimodal import gemma4, torch_processors
    from paged_engine.multimodal.processor import ImageProcessor, wrapper_config

    monkeypatch.setattr(torch_processors, "torchvision_available", lambda: False)
    config = wrapper_config(path)
    ours = ImageProcessor(path, config)
    assert type(ours.hf) is gemma4.Gemma4TorchProcessor
    pil = transformers.Gemma4ImageProcessorPil.from_pretrained(path)
    for i, size in enumerate(SIZES):
        image = noise_image(30 + i, size)
        got, want = ours.hf(images=[image]), pil(images=[image], return_tensors="pt")
        for key in ("image_position_ids", "num_soft_tokens_per_image"):
            assert got[key].tolist() == want[key].tolist()
        torch.testing.assert_close(
            got["pixel_values"], want["pixel_values"], atol=2.01 / 255, rtol=0
        )
        prompt = [5, config.image_token_id, 6]
        side = int(config.vision_config.position_embedding_size)
        if int(got["image_position_ids"][0].amax()) >= side:  # a strip past the tower's table
            with pytest.raises(ValueError, match="position table"):
                ours.process(prompt, [image])
            continue
        ids, (placed,) = ours.process(prompt, [image])
        n = int(got["num_soft_tokens_per_image"][0])
        assert ids.count(config.image_token_id) == placed.length == n


def test_torch_processor_matches_transformers(path):
    """Where torchvision imports: the torch copy gives Gemma4ImageProcessor's pixels,
    positions and soft tokens bit for bit, with and without mm_processor_kwargs."""
    from paged_engine.multimodal import torch_processors

    if not torch_processors.torchvision_available():
        pytest.skip("transformers' Gemma4ImageProcessor needs torchvision")
    hf = transformers.AutoImageProcessor.from_pretrained(path)
    assert type(hf).__name__ == "Gemma4ImageProcessor"
    ours = torch_processors.torch_processor(path, transformers.AutoConfig.from_pretrained(path))
    for i, size in enumerate(SIZES):
        image = noise_image(30 + i, size)
        for kw in ({}, {"max_soft_tokens": 140}, {"resample": 2}):
            got, want = ours(images=[image], **kw), hf(images=[image], return_tensors="pt", **kw)
            assert got.keys() == want.keys()
            for key in got:
                assert got[key].dtype == want[key].dtype
                assert torch.equal(got[key], want[key]), (size, kw, key)
