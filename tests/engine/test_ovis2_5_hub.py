"""Ovis2.5's Hub release (`Ovis2_5`, remote code; models/ovis2_5_hub.py, multimodal/ovis2_5_hub.py)
served as vLLM serves it, against transformers' Ovis2_5 port on a tiny random checkpoint.

The checkpoint: transformers' Ovis2_5ForConditionalGeneration (a Qwen3 decoder with the 2B's tied
head; a tower of 16-pixel patches whose 4 x 4 position table every image resizes; layers window,
full, window as fullatt_block_indexes "1" gives them, windows of 2 x 2 merged tokens cut at the
edges; a 72-entry visual vocabulary) saved by transformers, which writes the remote's weight names
(llm.*, visual_tokenizer.vit.vision_model.*, visual_tokenizer.head.{0,1}, vte), beside a config.json
in the remote's form (llm_config, vit_config as siglip2_navit, visual_vocab_size), a tokenizer
whose <|image_pad|> is Qwen's id 151655 and a SiglipImageProcessor preprocessor_config.json.

The reference (`_reference`), built from HF's modules and libraries, for a prompt text with
"<image>" in it and its images:
  pixels   the remote's steps: smart resize (transformers' ovis2_5 smart_resize, vLLM's bounds
           448^2 .. 1792^2, factor 32), HF's SiglipImageProcessorPil at that size, patches in
           merge-block order (vLLM's processor's transpose, written out here)
  ids      the text split at "<image>", the pieces tokenized apart, <|image_pad|> x (n + 2)
           between them (n: merged tokens)
  embeds   the text table's rows, each image's run replaced by: HF's image-start indicator row
           (get_visual_indicator_features()[0]), then HF's multi_modal_projector over the input
           of HF's vision_tower.post_layernorm (the last layer's output put back in patch order:
           what the remote's encoder stores as hidden_states[-1] and its visual tokenizer reads),
           then the image-end indicator row ([1])
  tokens   HF's model from those embeds, 8 greedy steps: tokens and top-5 logprobs
`LLM.generate` with the text and images must give those ids and tokens (logprobs within 1e-3,
float32); the same with the ids given. The encoder's rows are checked against the reference's
and shown to differ from the port's own read-out (get_image_features: window order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import Greedy, assert_matches, hf_greedy_from_embeds
from image_checks import engine, greedy, noise_image
from vlm_checkpoints import chatml_template, finish_checkpoint, load_hf_vlm

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.ovis2_5")

PAD, PAD_ID = "<|image_pad|>", 151655
PROMPT = "<|im_start|>user\n<image>\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image> and<image>\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
PATCH, MERGE, MIN_PIXELS, MAX_PIXELS = 16, 2, 448 * 448, 1792 * 1792
SIGLIP = {  # the release's kind of image processor, other settings than its defaults
    "image_processor_type": "SiglipImageProcessor",
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"height": 64, "width": 64},
}
_SAME = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_SAME += ("num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps", "window_size")
VIT = {  # the remote's vit_config (siglip2_navit), tiny
    "model_type": "siglip2_navit",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_channels": 3,
    "num_patches": -1,
    "image_size": 64,
    "patch_size": PATCH,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0,
    "hidden_stride": MERGE,
    "fullatt_block_indexes": "1",
    "temporal_patch_size": 1,
    "window_size": 64,  # 2 x 2 merged tokens
    "preserve_original_pe": True,
    "use_rope": True,
}


def _tokenizer(path: Path, seed: int):
    """testing.py's tiny tokenizer with <|image_pad|> at Qwen's id (its BPE vocab entry moved)."""
    from paged_engine.testing import build_tiny_tokenizer

    base = build_tiny_tokenizer(seed=seed)
    base.add_special_tokens({"additional_special_tokens": [PAD]})
    base.chat_template = chatml_template("<image>\n")
    base.save_pretrained(path)
    data = json.loads((path / "tokenizer.json").read_text())
    data["model"]["vocab"][PAD] = PAD_ID
    next(t for t in data["added_tokens"] if t["content"] == PAD)["id"] = PAD_ID
    (path / "tokenizer.json").write_text(json.dumps(data))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(PAD) == PAD_ID
    return tok


def write_tiny_ovis2_5_hub(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """(the Hub form, transformers' form) of one tiny random checkpoint (see the module)."""
    from paged_engine.testing import _COMMON, _save_random, tiny_config

    hf, hub = root / "hf", root / "hub"
    for p in (hf, hub):
        p.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(hub, seed)
    text = tiny_config("qwen3", vocab_size=PAD_ID + 25, max_position_embeddings=2048).to_dict()
    vision = {  # VIT as the remote runs it, under the port's names
        **{k: VIT[k] for k in _SAME},
        "spatial_merge_size": MERGE,
        "layer_types": ["window_attention", "full_attention", "window_attention"],  # "1"
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},  # the remote's
        "vocab_size": 72,
        "num_visual_indicator_tokens": 4,
    }
    config = transformers.Ovis2_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **_COMMON
    )
    config.architectures = ["Ovis2_5ForConditionalGeneration"]
    _save_random(transformers.Ovis2_5ForConditionalGeneration, config, seed, hf)
    weights = (hf / "model.safetensors").read_bytes()
    (hub / "model.safetensors").write_bytes(weights)  # the remote's names already
    llm = {k: v for k, v in text.items() if k not in ("architectures", "dtype")}
    raw = {
        "architectures": ["Ovis2_5"],
        "model_type": "ovis2_5",
        "auto_map": {"AutoModelForCausalLM": "modeling_ovis2_5.Ovis2_5"},
        "hidden_size": text["hidden_size"],
        "visual_vocab_size": 72,
        "llm_config": {**llm, "tie_word_embeddings": True},
        "vit_config": VIT,
        "torch_dtype": "float32",
    }
    (hub / "config.json").write_text(json.dumps(raw))
    (hub / "preprocessor_config.json").write_text(json.dumps(SIGLIP))
    finish_checkpoint(hub, tok)
    return hub, hf


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_tiny_ovis2_5_hub(tmp_path_factory.mktemp("ovis2_5_hub"), seed=3)


@pytest.fixture(scope="module")
def hf_model(paths):
    return load_hf_vlm(transformers.Ovis2_5ForConditionalGeneration, paths[1])


def _pixels(image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The remote's pixels of one image (see the module): [h * w, 3 * 16 * 16], (1, h, w)."""
    from transformers.models.ovis2_5.image_processing_pil_ovis2_5 import smart_resize

    siglip = transformers.SiglipImageProcessorPil(
        **{k: v for k, v in SIGLIP.items() if k != "image_processor_type"}
    )
    height, width = smart_resize(
        image.height,
        image.width,
        factor=PATCH * MERGE,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    x = siglip.preprocess(image, size={"height": height, "width": width}, return_tensors="pt")
    x = x["pixel_values"][0]  # [3, H, W]
    h, w = height // PATCH, width // PATCH
    x = x.view(3, h // MERGE, MERGE, PATCH, w // MERGE, MERGE, PATCH)
    return x.permute(1, 4, 2, 5, 0, 3, 6).reshape(h * w, -1), (1, h, w)


def _visual_rows(model, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """HF's projector over the input of its tower's post_layernorm (the remote's read-out)."""
    seen = []
    tower = model.model.vision_tower
    hook = tower.post_layernorm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        tower(pixel_values=pixels, grid_thw=torch.tensor([grid]))
    finally:
        hook.remove()
    return model.model.multi_modal_projector(seen[0])


def _rows(model, image) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """(an image's reference rows: start indicator, visual rows, end indicator; its pixels and
    grid)."""
    marks = model.model.multi_modal_projector.get_visual_indicator_features("cpu")
    pixels, grid = _pixels(image)
    with torch.no_grad():
        visual = _visual_rows(model, pixels, grid)
    return torch.cat([marks[:1], visual, marks[1:2]]), pixels, grid


def _reference(model, tok, text: str, images: list) -> tuple[list[int], Greedy]:
    """(the remote's prompt ids, HF's greedy result from its embeds)."""
    pieces = text.split("<image>")
    ids: list[int] = tok.encode(pieces[0], add_special_tokens=False)
    runs = []
    for image, piece in zip(images, pieces[1:], strict=True):
        rows = _rows(model, image)[0]
        runs.append((len(ids), rows))
        ids += [PAD_ID] * len(rows) + tok.encode(piece, add_special_tokens=False)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        for at, rows in runs:
            embeds[0, at : at + len(rows)] = rows
    return ids, hf_greedy_from_embeds(model, embeds)


@pytest.fixture(scope="module")
def llm(paths):
    return engine(paths[0], max_model_len=1024)


def test_images_match_the_remote_reference(paths, hf_model, llm):
    """Text, one image and two through the engine give the reference's ids and tokens (see the
    module); 20 x 28 and 5 x 30 images are widened and scaled up, 900 x 400 scaled down."""
    hub, _ = paths
    tok = transformers.AutoTokenizer.from_pretrained(hub)
    cases = [
        (PROMPT, [noise_image(1, (20, 28))]),
        (TEXT, []),
        (TWO, [noise_image(2, (900, 400)), noise_image(3, (5, 30))]),
    ]
    refs = [_reference(hf_model, tok, text, images) for text, images in cases]
    prompts = [{"prompt": t, "multi_modal_data": {"image": m}} if m else t for t, m in cases]
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("Ovis2_5", out, ref)
    ahead = [  # the remote's ids given: the runs found where they are
        {"prompt_token_ids": ids, "multi_modal_data": {"image": m}}
        for (ids, _), (_, m) in zip(refs, cases, strict=True)
        if m
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[0][1].tokens, refs[2][1].tokens]


def test_encoder_reads_the_tower_in_patch_order(paths, hf_model):
    """The encoder's rows equal the reference's (indicators, visual rows in patch order); the
    port's own get_image_features (window order) differs, so the order is what is tested."""
    from safetensors.torch import load_file

    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.ovis2_5_hub import Ovis2_5HubImageEncoder

    hub, _ = paths
    want, pixels, grid = _rows(hf_model, noise_image(5, (90, 40)))
    ours = Ovis2_5HubImageEncoder(remote_config(hub))
    ours.load_weights(load_file(Path(hub) / "model.safetensors").items())
    with torch.no_grad():
        (got,) = ours.encode([ImageInput(pixels, 0, len(want), "a", grid)])
        port = hf_model.model.get_image_features(
            pixel_values=pixels, image_grid_thw=torch.tensor([grid])
        ).pooler_output[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(port, want[1:-1], atol=1e-3)
    torch.testing.assert_close(port.sort(0).values, want[1:-1].sort(0).values)  # same rows


def test_chat_and_bad_input(llm):
    """The chat template's image part becomes "<image>"; bad input is a ValueError naming it."""
    image = noise_image(9, (40, 40))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = llm.get_tokenizer().apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<image>" in text
    kwargs = {
        "prompt": PROMPT,
        "multi_modal_data": {"image": image},
        "mm_processor_kwargs": {"a": 1},
    }
    bad = [
        ({"prompt": TWO, "multi_modal_data": {"image": image}}, "2 image placeholder"),
        (kwargs, "mm_processor_kwargs"),
        ({"prompt": PROMPT + PAD, "multi_modal_data": {"image": image}}, PAD),
    ]
    for prompt, words in bad:
        with pytest.raises(ValueError, match=words.replace("|", r"\|")):
            llm.generate([prompt], greedy(n=1), use_tqdm=False)
    assert llm.generate([TEXT], greedy(n=1), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("where", "name", "value"),
    [
        ("vit_config", "model_type", "siglip_vision_model"),
        ("vit_config", "num_patches", 256),
        ("vit_config", "preserve_original_pe", False),
        ("vit_config", "use_rope", False),
        ("vit_config", "temporal_patch_size", 2),
        ("vit_config", "fullatt_block_indexes", "0|5"),
        ("llm_config", "model_type", "gemma2"),
        (None, "visual_vocab_size", 4),
        (None, "hidden_size", 48),
    ],
)
def test_config_refusals(where, name, value):
    """A remote switch the releases do not set is refused by the config field's name."""
    from paged_engine.models.ovis2_5_hub import ovis2_5_hub_config

    raw = {
        "architectures": ["Ovis2_5"],
        "hidden_size": 64,
        "visual_vocab_size": 72,
        "llm_config": {"model_type": "qwen3", "hidden_size": 64},
        "vit_config": dict(VIT),
    }
    (raw if where is None else raw[where])[name] = value
    with pytest.raises(ValueError, match=name):
        ovis2_5_hub_config(raw)
