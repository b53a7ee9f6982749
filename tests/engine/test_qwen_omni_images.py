"""Images through the Qwen2.5-Omni and Qwen3-Omni thinkers (multimodal/qwen_omni.py) against HF.

Tiny random thinkers (4-pixel patches merged 2 x 2): Qwen2.5-Omni with Qwen2.5-VL's tower (window
attention: windows of 2 x 2 merged patches, one full-attention block; q / k / v apart in the
checkpoint) and contiguous M-RoPE sections; Qwen3-Omni with Qwen3-VL's tower (learned position
grid resampled, deepstack rows after vision blocks 0 and 2 into decoder layers 0 and 1; its
mergers named ln_q / mlp.*), interleaved M-RoPE and a MoE decoder. `LLM.generate` with
`multi_modal_data` must give the processor's placeholder runs (<|IMAGE|> / <|image_pad|> once
per merged patch, as Qwen2_5OmniProcessor / Qwen3OmniMoeProcessor's replace_image_token; their
video processor needs torchvision, so the runs are expanded here by the same rule) and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32); the M-RoPE table equals the
thinker's `get_rope_index`. Then chunks through images, prefix caching, TP=2, the server's chat
path with a data: URL, and bad input refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_tensor_parallel,
    engine,
    greedy,
    noise_image,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen2_5_omni")
pytest.importorskip("transformers.models.qwen3_omni_moe")

from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

MAX_TOKENS = 8
# (bos, eos, image, video, audio, audio bos, audio eos) of each thinker's tokenizer
MARKS = {
    "2.5": ("<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"),
    "3": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_pad|>"),
}
AUDIO_MARKS = ("<|audio_bos|>", "<|audio_eos|>")
CLASSES = {
    "2.5": "Qwen2_5OmniThinkerForConditionalGeneration",
    "3": "Qwen3OmniMoeThinkerForConditionalGeneration",
}


def _template(bos: str, image: str, eos: str) -> str:
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{bos}{image}{eos}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def write_tiny_omni(path: Path, version: str, seed: int = 0, patch_size: int = 4) -> Path:
    """A tiny random thinker checkpoint (version "2.5" or "3") with its image processor and a
    tokenizer holding its vision / audio tokens and a chat template."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    marks = [*MARKS[version], *AUDIO_MARKS]
    tokenizer.add_special_tokens({"additional_special_tokens": marks})
    ids = tokenizer.convert_tokens_to_ids(marks)
    tokenizer.chat_template = _template(marks[0], marks[2], marks[1])
    # head_dim 16: sections of 2, 3, 3 frequencies (temporal, height, width)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000.0}
    rope["mrope_section"] = [2, 3, 3]
    text = {**_LLAMA_LIKE, "vocab_size": len(tokenizer), "rope_parameters": rope, **_COMMON}
    vision = {"patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2}
    vision |= {"depth": 3, "num_heads": 4, "hidden_size": 32, "intermediate_size": 48}
    vision["out_hidden_size"] = text["hidden_size"]
    audio = {"encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 16}
    audio |= {"d_model": 8, "output_dim": text["hidden_size"], "num_mel_bins": 16}
    if version == "2.5":
        vision |= {"fullatt_block_indexes": [1], "window_size": 4 * patch_size}
        keys = ("image_token_index", "video_token_index", "audio_token_index")
        config_cls = transformers.Qwen2_5OmniThinkerConfig
    else:
        rope["mrope_interleaved"] = True
        text |= {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2}
        text |= {"moe_intermediate_size": 32, "decoder_sparse_step": 1, "sliding_window": None}
        vision |= {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 2]}
        audio["downsample_hidden_size"] = 8
        keys = ("image_token_id", "video_token_id", "audio_token_id")
        config_cls = transformers.Qwen3OmniMoeThinkerConfig
    config = config_cls(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        **dict(zip(keys, ids[2:5], strict=True)),
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        audio_start_token_id=ids[5],
        audio_end_token_id=ids[6],
        **_COMMON,
    )
    _save_random(getattr(transformers, CLASSES[version]), config, seed, path)
    factor = patch_size * 2
    images = transformers.Qwen2VLImageProcessor(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
    )
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def _prompts(version: str) -> tuple[str, str, str]:
    bos, eos, image = MARKS[version][:3]
    vision = f"{bos}{image}{eos}"
    user, end = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    one = f"{user}{vision}What is in it? Tell me.{end}"
    two = f"{user}{vision} and {vision}Which is brighter?{end}"
    return one, two, f"{user}Say something about the sea.{end}"


@pytest.fixture(scope="module")
def omni_dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(version: str) -> Path:
        if version not in cache:
            cache[version] = write_tiny_omni(tmp_path_factory.mktemp(f"omni{version}"), version)
        return cache[version]

    return make


class _HF:
    """HF's thinker with the prompt built as its processor builds it."""

    def __init__(self, path: Path, version: str) -> None:
        cls = getattr(transformers, CLASSES[version])
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.pad = self.model.config.image_token_id

    def inputs(self, text: str, images: list) -> tuple[list[int], dict]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if not images:
            return ids, {}
        out = self.images(images=images, return_tensors="pt")
        runs = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
        expanded: list[int] = []
        for t in ids:
            expanded += [t] * next(runs) if t == self.pad else [t]
        return expanded, {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
        }

    def greedy(self, text: str, images: list):
        ids, extra = self.inputs(text, images)
        return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_images_match_hf(omni_dirs, version):
    """Greedy tokens and top-5 logprobs of HF's thinker (one image, text only, two images of
    odd sizes), and the M-RoPE table of the two-image prompt equal to get_rope_index's."""
    path = omni_dirs(version)
    hf = _HF(path, version)
    one, two, text = _prompts(version)
    cases = [
        (one, [noise_image(1, (40, 56))]),
        (text, []),
        (two, [noise_image(2, (72, 24)), noise_image(3, (33, 47))]),  # resized to the grid
    ]
    refs = [hf.greedy(t, imgs) for t, imgs in cases]
    llm = engine(path)
    prompts = [
        {"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in cases
    ]
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(f"omni{version}", out, ref)

    ids, extra = hf.inputs(two, cases[2][1])
    mask = torch.ones(1, len(ids), dtype=torch.long)
    want, delta = hf.model.get_rope_index(
        torch.tensor([ids]), extra["image_grid_thw"], attention_mask=mask
    )
    processor = llm.llm_engine.input_processor.images
    expanded, done = processor.process(hf.tok.encode(two, add_special_tokens=False), cases[2][1])
    assert expanded == ids
    table = processor.positions(len(ids), done)
    np.testing.assert_array_equal(table.table, want[:, 0].numpy())
    assert table.delta == int(delta) < 0


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_engine_paths_match_the_plain_run(omni_dirs, version):
    """8-token chunks through the images (Qwen3-Omni: each chunk's deepstack rows at its own
    image rows), prefix-cache hits, images processed ahead."""
    path = omni_dirs(version)
    one, two, _ = _prompts(version)
    prompts = [
        {"prompt": one, "multi_modal_data": {"image": noise_image(i, (24 + 8 * i, 64 - 8 * i))}}
        for i in range(2)
    ]
    pics = [noise_image(7, (16, 80)), noise_image(8, (40, 40))]
    prompts.append({"prompt": two, "multi_modal_data": {"image": pics}})
    check_engine_paths(path, prompts, two)


def test_tensor_parallel_matches_one_process(omni_dirs):
    path = omni_dirs("3")
    _, two, _ = _prompts("3")
    pics = [noise_image(9, (32, 48)), noise_image(10, (56, 24))]
    check_tensor_parallel(path, [{"prompt": two, "multi_modal_data": {"image": pics}}], None, 8)


def test_chat_data_url_gives_the_offline_tokens(omni_dirs):
    """An image_url part with a data: URL through the server's chat path (the chat template's
    <|vision_bos|><|IMAGE|><|vision_eos|> expanded by the image's 5 x 9 merged grid); two over
    limit_mm_per_prompt one are a 400 naming messages."""
    llm = engine(omni_dirs("2.5"), limit_mm_per_prompt={"image": 1})
    question = [{"type": "image"}, {"type": "text", "text": "What is in it?"}]
    want = check_chat_data_url(llm, question, noise_image(12, (40, 72)), over_limit=True)
    assert want.prompt_ids.count(llm.get_tokenizer().convert_tokens_to_ids("<|IMAGE|>")) == 5 * 9


def test_bad_input_is_refused_by_name(omni_dirs):
    """More images than placeholders, a video or audio where none is taken, image features of
    several temporal patches, and configs whose rotary the thinker would run otherwise:
    ValueErrors naming what is wrong; the engine serves on."""
    path = omni_dirs("2.5")
    llm = engine(path)
    one, _, _ = _prompts("2.5")
    pics = [noise_image(13, (32, 32)), noise_image(14, (32, 32))]
    with pytest.raises(ValueError, match=r"2 image\(s\) but the prompt has 1"):
        llm.generate([{"prompt": one, "multi_modal_data": {"image": pics}}], greedy(0))
    for kind, match in [("audio", "'audio'"), ("video", "'video'")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": one, "multi_modal_data": {kind: np.zeros(16)}}], greedy(0))
    grid = torch.tensor([[2, 4, 4]])  # image features of two temporal patches
    embeds = {"image_embeds": torch.zeros(8, 64), "image_grid_thw": grid}
    with pytest.raises(ValueError, match="one temporal patch"):
        llm.generate([{"prompt": one, "multi_modal_data": {"image": embeds}}], greedy(0))
    assert llm.generate([{"prompt": one, "multi_modal_data": {"image": pics[0]}}], greedy(0))

    from paged_engine.multimodal import qwen_omni

    for version, interleaved in [("2.5", True), ("3", False)]:
        config = transformers.AutoConfig.from_pretrained(omni_dirs(version))
        params = dict(config.text_config.rope_parameters)
        config.text_config.rope_parameters = {**params, "mrope_interleaved": interleaved}
        with pytest.raises(ValueError, match="mrope_interleaved"):
            qwen_omni.check_config(config)
        config.text_config.rope_parameters = {
            k: v for k, v in params.items() if k != "mrope_section"
        }
        with pytest.raises(ValueError, match="mrope_section"):
            qwen_omni.check_config(config)


def test_whole_model_names_load_alike(omni_dirs):
    """The whole model's `thinker.visual.*` names (Qwen2_5OmniForConditionalGeneration's
    checkpoints) load into the same tower as the thinker's `visual.*`; a missing q / k / v is a
    ValueError naming it."""
    from safetensors.torch import load_file

    from paged_engine.multimodal import qwen_omni

    path = omni_dirs("2.5")
    config = transformers.AutoConfig.from_pretrained(path)
    weights = load_file(str(path / "model.safetensors"))
    torch.manual_seed(0)
    pixels = torch.randn(2 * 8 * 8, 3 * 2 * 4 * 4)
    outs = []
    for prefix in ("", "thinker."):
        encoder = qwen_omni.build_encoder(config)
        encoder.load_weights((prefix + n, t) for n, t in weights.items())
        outs.append(encoder.visual(pixels, [(1, 8, 8), (1, 8, 8)]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    dropped = ((n, t) for n, t in weights.items() if n != "visual.blocks.1.attn.k.bias")
    with pytest.raises(ValueError, match=r"visual\.blocks\.1\.attn\.k\.bias"):
        qwen_omni.build_encoder(config).load_weights(dropped)


WHOLE = {
    "2.5": ("Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration"),
    "3": ("Qwen3OmniMoeConfig", "Qwen3OmniMoeForConditionalGeneration"),
}


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_whole_model_takes_images_through_its_thinker(omni_dirs, tmp_path, version):
    """The whole-model class (thinker, talker, vocoder: what most Hub checkpoints are) takes
    images as its thinker: HF's `.thinker` tokens and logprobs on two images."""
    thinker_dir = omni_dirs(version)
    config_cls, model_cls = (getattr(transformers, n) for n in WHOLE[version])
    thinker = transformers.AutoConfig.from_pretrained(thinker_dir)
    config = config_cls(thinker_config=thinker.to_dict(), enable_audio_output=False)
    whole = tmp_path / "whole"
    _save_random(model_cls, config, 0, whole)
    for f in thinker_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            (whole / f.name).write_bytes(f.read_bytes())
    transformers.GenerationConfig(**_COMMON).save_pretrained(whole)
    torch.save({}, whole / "spk_dict.pt")  # Qwen2.5-Omni's loader reads its speakers
    hf = _HF.__new__(_HF)
    hf.model = model_cls.from_pretrained(whole, dtype=torch.float32).eval().thinker
    hf.model.generation_config.eos_token_id = None
    hf.images = transformers.AutoImageProcessor.from_pretrained(whole)
    hf.tok = transformers.AutoTokenizer.from_pretrained(whole)
    hf.pad = hf.model.config.image_token_id
    _, two, _ = _prompts(version)
    pics = [noise_image(2, (72, 24)), noise_image(3, (33, 47))]
    ids, ref = hf.greedy(two, pics)
    request = {"prompt": two, "multi_modal_data": {"image": pics}}
    out = engine(whole).generate([request], greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert_matches(f"whole {version}", out, ref)
