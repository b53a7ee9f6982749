"""Images through GLM-4.1V / GLM-4.5V / GLM-4.6V checkpoints (multimodal/glm4v.py) against HF.

Tiny random checkpoints of the three wrappers (`Glm4v`: GLM-4's decoder, interleaved partial
M-RoPE; `Glm4vMoe`: GLM-4.5's MoE decoder with a dense first layer, NeoX partial M-RoPE;
`Glm46V`: GLM-4.1V's parts under its own wrapper), one tower: 4-pixel patches merged 2 x 2, a
4 x 4 learned position grid that every image's grid resamples (bicubic), qkv biases on (off for
GLM-4.5V), RMSNorm eps 0.05 (apart from the merger's fixed 1e-5), M-RoPE sections 2, 1, 1 of 4
rotary frequencies (theta 100: height and width turn fast ones). The tower's rows equal HF's
image features (1e-5); `LLM.generate` with `multi_modal_data` must give Glm4vProcessor's prompt
ids (one <|image|> per merged patch) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32), the M-RoPE table HF's get_rope_index. Then the engine's paths (chunks through images,
prefix-cache hits, images processed ahead, image_embeds), TP=2 and PP=2, the server's chat path
with a data: URL, bad input and refused configs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    engine,
    greedy,
    grid_path_prompts,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
)
from vlm_checkpoints import (
    finish_checkpoint,
    load_hf_vlm,
    processor_without_video,
    save_grid_image_processor,
    tokenizer_with,
)

from paged_engine.testing import _COMMON, _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm4v")
pytest.importorskip("transformers.models.glm4v_moe")

IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
PROMPT = f"[gMASK]<sop><|user|>\n{IMAGE}What is in it? Tell me.<|assistant|>\n"
TWO = f"[gMASK]<sop><|user|>\n{IMAGE} and {IMAGE}Which is brighter?<|assistant|>\n"
TEXT = "[gMASK]<sop><|user|>\nSay something about the sea.<|assistant|>\n"
_SPECIAL = [
    "[gMASK]",
    "<sop>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
]
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# 8 of head_dim 16's dims rotate: 4 frequencies (1, 0.32, 0.1, 0.03), sections 2, 1, 1 so
# that height and width turn frequencies fast enough to tell their rows apart
_ROPE = {
    "rope_type": "default",
    "rope_theta": 100.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
}
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    **_COMMON,
}
_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 48,  # the merger's gated width
    "out_hidden_size": 64,  # the text hidden size; also the blocks' MLP width
    "image_size": 16,  # a 4 x 4 position grid
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "rms_norm_eps": 0.05,  # large enough to tell from the merger LayerNorm's 1e-5
    "hidden_act": "silu",
}
ARCHS = {"glm4v": "Glm4v", "glm4v_moe": "Glm4vMoe", "glm46v": "Glm46V"}


def write_tiny_glm4v(path: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random `{ARCHS[arch]}ForConditionalGeneration` checkpoint with its image
    processor (4-pixel patches merged 2 x 2, 8 to 48 merged patches an image) and tokenizer
    (GLM's image tokens, a chat template)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(_SPECIAL, seed)
    text = {**_TEXT, "vocab_size": len(tokenizer), "rope_parameters": _ROPE}
    vision = dict(_VISION)
    if arch == "glm4v_moe":
        text |= {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8}
        text |= {"num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32}
        text |= {"routed_scaling_factor": 2.0, "use_qk_norm": True}  # the wrapper: no norms
        vision |= {"model_type": "glm4v_moe_vision", "attention_bias": False}
    else:
        vision |= {"model_type": "glm4v_vision", "attention_bias": True}
    name = ARCHS[arch]
    config = getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        **_COMMON,
    )
    _save_random(getattr(transformers, f"{name}ForConditionalGeneration"), config, seed, path)
    # (the PIL one: transformers' default needs torchvision)
    image_cls = getattr(transformers, "Glm4vImageProcessorPil", transformers.Glm4vImageProcessor)
    save_grid_image_processor(image_cls, path, 2, 2 * 4 * 4)  # frames x patch x patch pixels
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(arch: str = "glm4v") -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_glm4v(tmp_path_factory.mktemp(arch), arch, seed=3)
        return cache[arch]

    return make


def _processor(path: Path):
    return processor_without_video(transformers.Glm4vProcessor, path)


def _hf_inputs(processor, text: str, images: list) -> tuple[list[int], dict]:
    keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
    return processor_inputs(processor, text, images, keys)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_images_match_hf(glm_dirs, arch):
    path = glm_dirs(arch)
    model = load_hf_vlm(getattr(transformers, f"{ARCHS[arch]}ForConditionalGeneration"), path)
    processor = _processor(path)
    cases = hf_cases(PROMPT, TEXT, TWO)  # the two images resized to the grid
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(processor, *case))
    check_matches_hf(path, cases, refs, arch)


@pytest.mark.parametrize("arch", ["glm4v", "glm4v_moe"])
def test_tower_matches_hf_features(glm_dirs, arch):
    """The encoder's rows equal HF's get_image_features (1e-5: the merger's exact GELU, every
    norm's eps)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    path = glm_dirs(arch)
    cls = getattr(transformers, f"{ARCHS[arch]}ForConditionalGeneration")
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    pixels = _processor(path).image_processor(images=images, return_tensors="pt")
    encoder = build_encoder(model.config).float()
    encoder.load_weights(load_file(path / "model.safetensors").items())
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    with torch.no_grad():
        want = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        got = encoder.visual(pixels["pixel_values"], grids)
    torch.testing.assert_close(got, torch.cat(want.pooler_output), atol=1e-5, rtol=0)


def test_mrope_table_equals_hf_rope_index(glm_dirs):
    path = glm_dirs()
    model = transformers.Glm4vForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    images = [noise_image(4, (24, 72)), noise_image(5, (48, 40))]
    ids, extra = _hf_inputs(_processor(path), TWO, images)
    want, delta = model.model.get_rope_index(
        torch.tensor([ids]), extra["mm_token_type_ids"], extra["image_grid_thw"]
    )
    llm = engine(path)
    processor = llm.llm_engine.input_processor.images
    expanded, done = processor.process(llm.get_tokenizer().encode(TWO), images)
    assert expanded == ids
    table = processor.positions(len(ids), done)
    assert table.table.tolist() == want[:, 0].tolist()
    assert table.delta == int(delta) < 0


def test_engine_paths_match_the_plain_run(glm_dirs):
    """image_checks' paths on GLM-4.5V (8-token chunks through the images, prefix-cache hits,
    images processed ahead); vLLM's image_embeds with HF's features give the images' answer;
    bad input is a ValueError naming what is wrong, and the engine serves on."""
    path = glm_dirs("glm4v_moe")
    prompts = grid_path_prompts(PROMPT, TWO, narrow=8)
    cached = check_engine_paths(path, prompts, TWO)

    model = transformers.Glm4vMoeForConditionalGeneration.from_pretrained(path)
    images = [noise_image(8, (40, 56)), noise_image(9, (24, 64))]
    pixels = _processor(path).image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        feats = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
    data = {
        "image_embeds": torch.cat(feats.pooler_output),
        "image_grid_thw": pixels["image_grid_thw"],
    }
    raw, embedded = (
        {"prompt": TWO, "multi_modal_data": {"image": value}} for value in (images, data)
    )
    want, got = cached.generate([raw, embedded], greedy(0), use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids

    one = noise_image(10, (32, 32))
    for bad, match in [
        ({"prompt": TWO, "multi_modal_data": {"image": one}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a cat"}}, "PIL.Image.Image"),
        (
            {"prompt": PROMPT, "multi_modal_data": {"video": [one, one]}},
            r"0 <\|video\|> placeholder",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    limited = engine(path, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        limited.generate([prompts[-1]], greedy(0), use_tqdm=False)
    assert len(cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_matches_one_process(glm_dirs, parallel):
    """TP=2 (the tower on every rank, the decoder's heads and experts split) and PP=2 (every
    stage rotates by the M-RoPE table) give the one-process tokens."""
    path = glm_dirs("glm4v_moe")
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (32, 48))] * 2}}]
    one = [o.outputs[0] for o in engine(path).generate(prompts, greedy(0), use_tqdm=False)]
    llm = engine(path, **{parallel: 2})
    try:
        two = [o.outputs[0] for o in llm.generate(prompts, greedy(0), use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_refused_configs(glm_dirs):
    """What the image path cannot run as HF runs it is a ValueError naming the field."""
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.layouts_qwen import QwenLayout

    config = transformers.AutoConfig.from_pretrained(glm_dirs())
    config.text_config.rope_parameters.pop("mrope_section")  # HF: [8, 12, 12] silently
    with pytest.raises(ValueError, match="mrope_section=None"):
        QwenLayout(config, config.image_token_id, None)
    config = transformers.AutoConfig.from_pretrained(glm_dirs())
    config.vision_config.patch_size = [4, 4]
    with pytest.raises(ValueError, match=r"vision_config\.patch_size"):
        build_encoder(config)
    config.vision_config.patch_size, config.vision_config.image_size = 4, 2
    with pytest.raises(ValueError, match=r"vision_config\.image_size=2"):
        build_encoder(config)


def test_chat_data_url_gives_the_offline_tokens(glm_dirs):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|image|> expanded by the image's grid)."""
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    want = check_chat_data_url(engine(glm_dirs("glm46v")), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT.replace("What is in it? Tell me.", "What is it?")
