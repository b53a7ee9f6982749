"""Kimi-VL (`KimiVLForConditionalGeneration`, the Hub's remote code: multimodal/kimi_vl.py,
models/kimi_vl_config.py) against HF's Kimi_K25ForConditionalGeneration on the same weights.

The reference: a tiny random Kimi K2.5 checkpoint in transformers' form whose tower is what
the remote MoonViT hard-codes (gelu_pytorch_tanh, rope theta 10000, LayerNorm eps 1e-5 in the
projector; 4-pixel patches, a 4 x 4 position grid every image resamples, 2 x 2 merge) and whose
decoder is DeepSeek-V3 as Kimi-VL-A3B has it (no q bottleneck, an untied head), written again
in the Hub's Kimi-VL layout: `vision_tower.*` as transformers saves it (the Hub's MoonViT names,
wqkv in pairwise rope order), `multi_modal_projector.{pre_norm, linear_1, linear_2}`,
`language_model.{model, lm_head}.*`; config.json with media_placeholder_token_id,
vision_config (moonvit: init_pos_emb_height / width) and text_config; the remote processor's
preprocessor_config.json (in_token_limit 20 patches, pad_input). The difference between the
two, written out: none in the maths (config names, weight names, the processor's resize rule).

HF's inputs: the remote processor's steps as its source writes them (PIL bicubic to
int(W * s) x int(H * s) when over in_token_limit, a black canvas to multiples of 8 pixels,
/ 255, mean / std, row-major patches), the grid checked against vLLM's get_num_image_tokens,
each <|media_pad|> repeated once per merge block. paged on the remote dir must give HF's prompt
ids, greedy tokens and top-5 logprobs (1e-3, float32) for one image, two, and text alone; the
chat path writes vLLM's placeholder; bad config values are refused by name.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from image_checks import check_matches_hf, engine, greedy, hf_cases, hf_refs, noise_image
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_k25")
Image = pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

MEDIA = ["<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]
IMAGE = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"
PROMPT = f"<|im_user|>user<|im_middle|>{IMAGE}What is in it?<|im_end|><|im_assistant|>"
TWO = f"<|im_user|>user<|im_middle|>{IMAGE} and {IMAGE}Which?<|im_end|><|im_assistant|>"
TEXT = "<|im_user|>user<|im_middle|>Say something about the sea.<|im_end|><|im_assistant|>"
ROLES = ["<|im_user|>", "<|im_middle|>", "<|im_end|>", "<|im_assistant|>"]
MEAN, STD = [0.48, 0.45, 0.4], [0.27, 0.26, 0.28]
PROCESSOR = {  # the remote KimiVLImageProcessor's file, scaled down
    "image_processor_type": "KimiVLImageProcessor",
    "patch_size": 4,
    "in_token_limit": 20,
    "merge_kernel_size": [2, 2],
    "pad_input": True,
    "image_mean": MEAN,
    "image_std": STD,
}
CHAT_TEMPLATE = (  # string content: the chat path writes vLLM's placeholder
    "{% for m in messages %}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)


def write_pair(root, seed: int = 3):
    """(transformers' K2.5 dir, the same weights in Kimi-VL's remote layout)."""
    hf, remote = root / "hf", root / "remote"
    hf.mkdir(parents=True)
    tokenizer, ids = tokenizer_with([*MEDIA, *ROLES], seed)
    text = tiny_config("deepseek_v3", vocab_size=len(tokenizer), max_position_embeddings=512)
    text = {**text.to_dict(), "tie_word_embeddings": False}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 800000.0}  # A3B's
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 2, "patch_size": 4, "pos_emb_height": 4}
    vision |= {"pos_emb_width": 4, "merge_kernel_size": [2, 2]}
    vision |= {"hidden_act": "gelu_pytorch_tanh"}
    vision |= {"rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
    config = transformers.Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=32,
        projection_layer_norm_eps=1e-5,
        image_token_id=ids["<|media_pad|>"],
        tie_word_embeddings=False,
        **_COMMON,
    )
    _save_random(transformers.Kimi_K25ForConditionalGeneration, config, seed, hf)
    finish_checkpoint(hf, tokenizer, CHAT_TEMPLATE)
    remote.mkdir()
    finish_checkpoint(remote, tokenizer, CHAT_TEMPLATE)
    (remote / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    _write_remote(hf, remote, ids["<|media_pad|>"])
    return hf, remote


def _remote_name(name: str) -> str:
    name = name.removeprefix("model.")
    for ours, hub in (
        ("mm_projector.proj.0.", "multi_modal_projector.linear_1."),
        ("mm_projector.proj.2.", "multi_modal_projector.linear_2."),
        ("mm_projector.pre_norm.", "multi_modal_projector.pre_norm."),
        ("language_model.blocks.", "language_model.model.layers."),  # (5.25's save quirk)
        ("language_model.model.blocks.", "language_model.model.layers."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if name.startswith(ours):
            return hub + name.removeprefix(ours)
    if name.startswith(("language_model.model.", "language_model.lm_head.")):
        return name
    if name.startswith("language_model."):
        return "language_model.model." + name.removeprefix("language_model.")
    assert name.startswith("vision_tower."), name
    return name


def _write_remote(hf, remote, pad: int) -> None:
    state = safetensors.load_file(str(hf / "model.safetensors"))
    out = {_remote_name(n): t.contiguous() for n, t in state.items()}
    safetensors.save_file(out, str(remote / "model.safetensors"), metadata={"format": "pt"})
    got = json.loads((hf / "config.json").read_text())
    v = got["vision_config"]
    vision = {k: v[k] for k in ("patch_size", "num_attention_heads", "num_hidden_layers")}
    vision |= {k: v[k] for k in ("hidden_size", "intermediate_size", "merge_kernel_size")}
    vision |= {"init_pos_emb_height": 4, "init_pos_emb_width": 4, "model_type": "moonvit"}
    text = {**got["text_config"], "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    del text["rope_parameters"]  # the Hub's text_config: rope_theta, rope_scaling null
    text |= {"rope_theta": 800000.0, "rope_scaling": None}
    config = {
        "architectures": ["KimiVLForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_vl.KimiVLConfig"},
        "model_type": "kimi_vl",
        "media_placeholder_token_id": pad,
        "ignore_index": -100,
        "vision_config": vision,
        "text_config": text,
        **_COMMON,
    }
    (remote / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("kimi-vl"))


def _remote_pixels(image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The remote processor's rescale / pad / normalize / patchify on one PIL image."""
    w, h = image.size
    p, limit = PROCESSOR["patch_size"], PROCESSOR["in_token_limit"]
    if (w // p) * (h // p) > limit:
        s = math.sqrt(limit / ((w // p) * (h // p)))
        image = image.resize((int(w * s), int(h * s)), Image.Resampling.BICUBIC)
    w, h = image.size
    pw, ph = (8 - w % 8) % 8, (8 - h % 8) % 8
    canvas = Image.new("RGB", (w + pw, h + ph), (0, 0, 0))
    canvas.paste(image, (0, 0))
    x = torch.from_numpy(np.asarray(canvas, dtype=np.float32) / 255).permute(2, 0, 1)
    x = (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    gh, gw = x.shape[1] // p, x.shape[2] // p
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
    return patches, (1, gh, gw)


def _vllm_tokens(width: int, height: int) -> int:
    """vLLM's KimiVLProcessingInfo.get_num_image_tokens, written out."""
    p, limit = PROCESSOR["patch_size"], PROCESSOR["in_token_limit"]
    if (width // p) * (height // p) > limit:
        s = math.sqrt(limit / ((width // p) * (height // p)))
        width, height = int(width * s), int(height * s)
    return math.ceil(height / 8) * math.ceil(width / 8)


def _hf_inputs(hf, text: str, images: list) -> tuple[list[int], dict]:
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, {}
    done = [_remote_pixels(i) for i in images]
    for image, (_, grid) in zip(images, done, strict=True):
        assert grid[1] * grid[2] // 4 == _vllm_tokens(*image.size)
    pad, runs = tok.convert_tokens_to_ids("<|media_pad|>"), iter(g[1] * g[2] // 4 for _, g in done)
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == pad else [t]
    pixels = torch.cat([p for p, _ in done])
    return expanded, {"pixel_values": pixels, "image_grid_thw": torch.tensor([g for _, g in done])}


def test_matches_hf_k25_on_the_same_weights(pair):
    """40 x 56: over the 20-patch limit, scaled down then padded; 13 x 9 and 30 x 22: padded
    up (3 x 2 and 7 x 5 patches), under the limit; text alone."""
    hf, remote = pair
    cases = hf_cases(PROMPT, TEXT, TWO, ((40, 56), (13, 9), (30, 22)))
    refs = hf_refs(
        load_hf_vlm(transformers.Kimi_K25ForConditionalGeneration, hf),
        cases,
        lambda *case: _hf_inputs(hf, *case),
    )
    check_matches_hf(remote, cases, refs, "kimi_vl")


def test_encoder_matches_hf_features(pair):
    """The tower and projector alone on the remote names: each image's rows equal HF's
    get_image_features (1e-5), which the remote activation and rope theta must match."""
    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.kimi_vl import KimiVLImageEncoder

    hf, remote = pair
    model = load_hf_vlm(transformers.Kimi_K25ForConditionalGeneration, hf)
    ours = KimiVLImageEncoder(remote_config(remote))
    ours.load_weights(safetensors.load_file(str(remote / "model.safetensors")).items())
    done = [_remote_pixels(noise_image(5, (24, 40))), _remote_pixels(noise_image(6, (16, 8)))]
    images = [ImageInput(p, 0, g[1] * g[2] // 4, str(i), g) for i, (p, g) in enumerate(done)]
    with torch.no_grad():
        got = ours.encode(images)
        want = model.model.get_image_features(
            torch.cat([p for p, _ in done]), torch.tensor([g for _, g in done])
        ).pooler_output
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_processor_is_the_remote_rule(pair):
    """Our processor's pixels and grids are the remote steps' (bit for bit up to float32
    rounding) for images over and under in_token_limit, wide and tall."""
    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.kimi_vl import KimiVLImageProcessor

    _, remote = pair
    config = remote_config(remote)
    assert config.architectures == ["KimiVLForConditionalGeneration"]
    ours = KimiVLImageProcessor(PROCESSOR, config)
    for seed, size in enumerate([(40, 56), (13, 9), (90, 8), (8, 90), (17, 17), (64, 64)]):
        image = noise_image(seed, size)
        out = ours([image])
        want, grid = _remote_pixels(image)
        assert out["image_grid_thw"].tolist() == [list(grid)]
        torch.testing.assert_close(out["pixel_values"], want, atol=1e-6, rtol=0)


def test_chat_writes_vllm_placeholder(pair):
    """LLM.chat with an image part (string content): vLLM's get_placeholder_str, expanded."""
    _, remote = pair
    llm = engine(remote)
    try:
        image = noise_image(9, (24, 16))
        msg = [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": image},
                    {"type": "text", "text": "What is in it?"},
                ],
            }
        ]
        out = llm.chat(msg, greedy(n=2), use_tqdm=False)[0]
        plain = llm.generate(
            {
                "prompt": f"<|im_user|>user<|im_middle|>{IMAGE}\nWhat is in it?<|im_end|>"
                "<|im_assistant|>",
                "multi_modal_data": {"image": image},
            },
            greedy(n=2),
            use_tqdm=False,
        )[0]
        assert out.prompt_token_ids == plain.prompt_token_ids
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()


def test_refusals(pair, tmp_path):
    """Config values and requests the path does not serve, refused by name."""
    from paged_engine.models.kimi_vl_config import kimi_vl_config
    from paged_engine.multimodal.kimi_vl import KimiVLImageProcessor

    _, remote = pair
    raw = json.loads((remote / "config.json").read_text())
    for where, name, value in [
        ("text_config", "topk_method", "greedy"),
        ("text_config", "scoring_func", "softmax"),
        ("text_config", "model_type", "deepseek_v2"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad[where][name] = value
        with pytest.raises(ValueError, match=name):
            kimi_vl_config(bad)
    config = kimi_vl_config(raw)
    for name, value in [("pad_input", False), ("patch_size", 8), ("merge_kernel_size", [1, 1])]:
        with pytest.raises(ValueError, match=name):
            KimiVLImageProcessor({**PROCESSOR, name: value}, config)
    llm = engine(remote)
    try:
        image = noise_image(1, (16, 16))
        with pytest.raises(ValueError, match="mm_processor_kwargs"):
            llm.generate(
                {
                    "prompt": PROMPT,
                    "multi_modal_data": {"image": image},
                    "mm_processor_kwargs": {"in_token_limit": 9},
                },
                greedy(n=1),
                use_tqdm=False,
            )
        out = llm.generate(
            {"prompt": PROMPT, "multi_modal_data": {"image": image}}, greedy(n=1), use_tqdm=False
        )  # the engine serves on
        assert len(out[0].outputs[0].token_ids) == 1
    finally:
        llm.llm_engine.shutdown()
