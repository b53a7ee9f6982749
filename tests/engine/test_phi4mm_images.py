"""Images through Phi-4-multimodal checkpoints (multimodal/phi4mm.py, phi4mm_processor.py)
against HF.

A tiny random `Phi4MultimodalForCausalLM` (its flat config: a Phi-3 decoder with 3/4 partial
rotary and GQA; a SigLIP-style tower of 64-pixel views in 2-pixel patches, so 32 x 32 patches
pooled to HF's 16 x 16 rows a view, feature_layer -2; a conformer audio tower, tested in
test_phi4mm_audio.py), its image processor's settings scaled down (64-pixel crops, dynamic_hd
6) beside the feature extractor's in one preprocessor_config.json.
transformers' Phi4MultimodalImageProcessor needs torchvision: where it is missing the engine's
torch copy feeds both sides, its crop layout, patch mask and token count checked against the
transformers class's own functions (compiled from its source). `LLM.generate` with
`multi_modal_data` must give HF's expanded prompt ids (each <|image|> repeated num_img_tokens
times) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32); the encoder's rows
equal HF's image embedding at the placeholders. Then the engine's paths, bad input, refusals
by name (configs), the server's chat path, and a PEFT LoRA adapter per
request (the way the checkpoint's vision-lora is served) against HF on the merged weights.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_reference import hf_greedy
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    engine,
    greedy,
    noise_image,
    usual_refusals,
)

from paged_engine.multimodal.torch_processors import torchvision_available

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.phi4_multimodal")
pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
SIDE, PATCH = 64, 2
IMAGE, AUDIO = "<|image|>", "<|audio|>"
PROMPT = f"<|user|>{IMAGE}Describe it.<|end|><|assistant|>"
TWO = f"<|user|>{IMAGE} and {IMAGE}Which is brighter?<|end|><|assistant|>"
TEXT = "<|user|>Say something about the sea.<|end|><|assistant|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROCESSOR = {  # image and audio settings in one file, as the Hub's checkpoint keeps them
    "image_processor_type": "Phi4MultimodalImageProcessor",
    "size": {"height": SIDE, "width": SIDE},
    "patch_size": PATCH,
    "dynamic_hd": 6,
    "feature_extractor_type": "Phi4MultimodalFeatureExtractor",
    "audio_compression_rate": 8,
    "audio_downsample_rate": 1,
    "feature_size": 80,
    "sampling_rate": 16000,
}


def write_tiny_phi4mm(path: Path, seed: int = 0, **vision_overrides) -> Path:
    from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(seed=seed)
    marks = [IMAGE, AUDIO, "<|user|>", "<|assistant|>", "<|end|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": marks})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    image, audio = tokenizer.convert_tokens_to_ids([IMAGE, AUDIO])
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 2, "image_size": SIDE, "patch_size": PATCH}
    vision |= {"crop_size": SIDE, "image_token_id": image, **vision_overrides}
    audio_config = {"hidden_size": 32, "intermediate_size": 48, "num_blocks": 1}
    audio_config |= {"num_attention_heads": 2, "ext_pw_out_channel": 32}
    audio_config |= {"depthwise_separable_out_channel": 32, "nemo_conv_channels": 32}
    audio_config |= {"audio_token_id": audio, "chunk_size": 4, "left_chunk": 1}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    config = transformers.Phi4MultimodalConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        original_max_position_embeddings=8192,
        rope_parameters=rope,
        vision_config=vision,
        audio_config=audio_config,
        **_COMMON,
    )
    _save_random(transformers.Phi4MultimodalForCausalLM, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_phi4mm(tmp_path_factory.mktemp("phi4mm"), seed=4)


def _engine(path, **kw):
    return engine(path, **{"max_model_len": 4096, **kw})


@pytest.fixture(autouse=True)
def _long_prompts(monkeypatch):
    """image_checks' engines with room for Phi-4's runs (545 tokens and more an image)."""
    import image_checks

    monkeypatch.setattr(image_checks, "engine", _engine)


def _processor(path):
    from paged_engine.multimodal.phi4mm_processor import Phi4MMTorchProcessor
    from paged_engine.multimodal.torch_processors import saved_settings

    return Phi4MMTorchProcessor(saved_settings(path), transformers.AutoConfig.from_pretrained(path))


def _hf_model(path):
    model = transformers.Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    return model


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    """HF's prompt ids (each <|image|> repeated num_img_tokens times, as
    Phi4MultimodalProcessor does) and the image inputs: transformers' image processor where it
    imports, else ours."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, {}
    if torchvision_available():
        out = transformers.AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    else:
        out = _processor(path)(images=images, return_tensors="pt")
    mark = tok.convert_tokens_to_ids(IMAGE)
    runs = iter(int(n) for n in out["num_img_tokens"])
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == mark else [t]
    keys = ("image_pixel_values", "image_sizes", "image_attention_mask")
    return expanded, {k: out[k] for k in keys}


# (40, 300): 5 x 1 crops, padded; (30, 500): 8 x 1 past dynamic_hd 6 -> the closest ratio (6, 1);
# (20, 30): one crop, 22 pixel rows of padding; (100, 150): 3 x 2 crops
CASES = [
    (PROMPT, [(1, (40, 300))]),
    (TEXT, []),
    (TWO, [(2, (20, 30)), (3, (100, 150))]),
    (PROMPT, [(5, (30, 500))]),
]


def test_images_match_hf(path):
    model = _hf_model(path)
    cases = [(text, [noise_image(s, size) for s, size in imgs]) for text, imgs in CASES]
    refs = []
    for text, images in cases:
        ids, extra = _hf_inputs(path, text, images)
        refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5, **extra)))
    assert len(refs[0][0]) - len(refs[1][0]) > 545  # the global view's 16 x 17 + 1 + crops
    check_matches_hf(path, cases, refs, "phi4mm")


def test_encoder_rows_match_hf(path):
    """The encoder alone: each image's rows equal HF's image embedding at its placeholders
    (padded crops, a 3 x 2 grid, the extensor rows' order)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    model = _hf_model(path)
    config = model.config
    encoder = build_encoder(config).float()
    encoder.load_weights(load_file(path / "model.safetensors").items())
    text, images = TWO, [noise_image(2, (20, 30)), noise_image(3, (100, 150))]
    ids, extra = _hf_inputs(path, text, images)
    llm_images = _engine(path).llm_engine.input_processor.images
    tok = transformers.AutoTokenizer.from_pretrained(path)
    _, placed = llm_images.process(tok.encode(text, add_special_tokens=False), images)
    assert [m.image_size for m in placed] == [(1, 1, 21, 32), (2, 3, 64, 96)]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        base = model.model.embed_tokens(input_ids)
        want = model.model.embed_tokens_extend.image_embed(input_ids, base, **extra)
        got = torch.cat(encoder.encode(placed))
    mark = input_ids[0] == config.vision_config.image_token_id
    torch.testing.assert_close(got, want[0, mark], atol=2e-5, rtol=1e-5)
    assert float(encoder.sub_img_feature_extensor.detach().abs().sum()) > 0  # its rows count


def _hf_methods():
    """Phi4MultimodalImageProcessor's layout methods compiled from its source (the class
    imports torchvision), bound to one object."""
    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    file = Path(root, "models", "phi4_multimodal", "image_processing_phi4_multimodal.py")
    cls = next(
        n
        for n in ast.parse(file.read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "Phi4MultimodalImageProcessor"
    )
    names = ("find_closest_aspect_ratio", "_get_crop_layout", "_get_crop_attention_mask")
    names += ("_get_num_image_tokens",)
    nodes = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    namespace = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "<phi4mm>", "exec"), namespace)
    hf = SimpleNamespace()
    for name in names:
        setattr(hf, name, namespace[name].__get__(hf))
    return hf


def test_crop_layout_and_tokens_follow_transformers():
    """Our crop grid, resized size, padding mask and num_img_tokens equal the transformers
    class's for many sizes (grids within and past dynamic_hd, ties, extreme ratios refused)."""
    from paged_engine.multimodal.phi4mm import image_tokens
    from paged_engine.multimodal.phi4mm_processor import fit

    hf = _hf_methods()
    sizes = [(40, 300), (30, 500), (20, 30), (100, 150), (64, 64), (1, 1), (448, 448)]
    sizes += [(500, 31), (127, 129), (900, 1600), (3000, 20), (65, 64), (300, 40)]
    for side, patch, most in [(64, 2, 6), (448, 14, 36), (448, 14, 4), (62, 2, 12)]:
        m = side // patch
        for h, w in sizes:
            try:
                (wc, hc), new, pad = hf._get_crop_layout(h, w, side, max_num=most)
            except ValueError:
                with pytest.raises(ValueError, match="aspect ratio"):
                    fit(h, w, side, most)
                continue
            assert fit(h, w, side, most) == ((hc, wc), (new[1], new[0]))
            mask = hf._get_crop_attention_mask((wc, hc), pad, patch, m)
            size = (hc, wc, int(mask[:, 0].sum()), int(mask[0, :].sum()))
            assert mask.sum() == size[2] * size[3]  # a padded grid: the rectangle of size
            if math.ceil(m / 2) == 16:  # HF counts 16 x 16 pooled rows a view
                assert image_tokens(size, m) == hf._get_num_image_tokens(mask, m)


def test_padding_is_white_and_the_global_view_sees_it(path):
    """A 20 x 30 image in one 64-pixel crop: resized to 42 x 64 and padded white below (1.0
    once normalized by 0.5 / 0.5), its mask's last 11 patch rows 0; the global view is the
    padded crop resized (the same size here: the crop itself)."""
    out = _processor(path)(images=[noise_image(2, (20, 30))], return_tensors="pt")
    pixels, mask = out["image_pixel_values"][0], out["image_attention_mask"][0]
    assert tuple(pixels.shape) == (2, 3, SIDE, SIDE) and out["image_sizes"].tolist() == [[64, 64]]
    assert torch.all(pixels[1, :, 42:] == 1.0) and not torch.all(pixels[1, :, 41] == 1.0)
    assert mask[1, :21].all() and not mask[1, 21:].any() and mask[0].all()
    torch.testing.assert_close(pixels[0], pixels[1])


def test_torch_processor_matches_transformers(path):
    """Where torchvision imports: transformers' pixels, masks and sizes equal ours."""
    if not torchvision_available():
        pytest.skip("transformers' Phi4MultimodalImageProcessor needs torchvision")
    images = [noise_image(7, (40, 300)), noise_image(8, (30, 500)), noise_image(9, (64, 64))]
    hf = transformers.AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    ours = _processor(path)(images=images, return_tensors="pt")
    for key in ("image_sizes", "image_attention_mask", "num_img_tokens"):
        assert torch.equal(torch.as_tensor(hf[key]), torch.as_tensor(ours[key])), key
    torch.testing.assert_close(hf["image_pixel_values"], ours["image_pixel_values"], atol=1e-6)


def test_engine_paths_and_refusals(path):
    """image_checks' paths (128-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input and image features of the wrong width are ValueErrors naming
    what is wrong, and the engine serves on (images with audio: test_phi4mm_mixed.py)."""
    sizes = [(30, 80), (50, 65), (70, 50)]
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(i, s)}}
        for i, s in enumerate(sizes)
    ]
    prompts.append(
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(7, (16, 90)), noise_image(8, (64, 64))]},
        }
    )
    cached = check_engine_paths(path, prompts, TWO, chunk=128)
    one = noise_image(9, (20, 20))
    refused = usual_refusals(PROMPT, TWO, one)
    refused += [
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(5, 48)}}, "hidden size"),
    ]
    check_refused(path, cached, refused, prompts)


def test_chat_data_url_gives_the_offline_tokens(path):
    question = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    want = check_chat_data_url(_engine(path), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT


def test_config_refusals(path, tmp_path):
    """A view that pools to other than HF's 16 x 16, and a feature_layer past the tower, are
    refused naming the field."""
    from paged_engine.multimodal.phi4mm import check_config

    config = transformers.AutoConfig.from_pretrained(path)
    config.vision_config.patch_size = 4
    with pytest.raises(ValueError, match=r"vision_config\.image_size"):
        check_config(config)
    config = transformers.AutoConfig.from_pretrained(path)
    config.vision_config.feature_layer = 5
    with pytest.raises(ValueError, match=r"vision_config\.feature_layer"):
        check_config(config)
    config = transformers.AutoConfig.from_pretrained(path)
    config.vision_config.crop_size = 32
    with pytest.raises(ValueError, match="crop_size"):
        check_config(config)


def _write_adapter(path: Path, out: Path, rank: int = 4, alpha: float = 8.0) -> dict:
    """A PEFT LoRA directory on every decoder projection (the modules the checkpoint's
    vision-lora adapts) at `out`; returns the base weights merged with it."""
    from safetensors.torch import load_file, save_file

    base = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    tensors, merged = {}, dict(base)
    for name, w in base.items():
        if not name.startswith("model.layers.") or not name.endswith("proj.weight"):
            continue
        module = name.removesuffix(".weight")
        a = torch.randn(rank, w.shape[1], generator=gen) * 0.3
        b = torch.randn(w.shape[0], rank, generator=gen) * 0.3
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = w + (alpha / rank) * b @ a
    assert len(tensors) == 2 * 4 * 2  # qkv_proj, o_proj, gate_up_proj, down_proj; 2 layers
    out.mkdir()
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none"}
    config["target_modules"] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    (out / "adapter_config.json").write_text(json.dumps(config))
    return merged


def test_lora_adapter_per_request_matches_hf_merged(path, tmp_path):
    """The way the checkpoint's vision-lora is served (vLLM: --enable-lora, a LoRARequest per
    request): an adapter on the decoder's fused qkv_proj / gate_up_proj and o_proj / down_proj
    gives HF's tokens and logprobs on the weights merged with it; a request without it stays
    the base model's."""
    import shutil

    from hf_reference import assert_matches
    from safetensors.torch import save_file

    from paged_engine.lora.request import LoRARequest

    merged_dir = tmp_path / "merged"
    shutil.copytree(path, merged_dir)
    merged = _write_adapter(path, tmp_path / "vision-lora")
    save_file(merged, merged_dir / "model.safetensors", metadata={"format": "pt"})
    images = [noise_image(1, (40, 100))]
    ids, extra = _hf_inputs(path, PROMPT, images)
    want = hf_greedy(_hf_model(merged_dir), ids, MAX_TOKENS, 5, **extra)
    llm = _engine(path, enable_lora=True, max_lora_rank=8)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": images}}
    lora = LoRARequest("vision", 1, str(tmp_path / "vision-lora"))
    got, plain = (
        llm.generate([prompt], greedy(), use_tqdm=False, lora_request=r)[0] for r in (lora, None)
    )
    assert got.prompt_token_ids == ids
    assert_matches("phi4mm+lora", got, want)
    base = hf_greedy(_hf_model(path), ids, MAX_TOKENS, 5, **extra)
    assert plain.outputs[0].token_ids == base.tokens != want.tokens
