"""NVLM-D (`NVLM_D`, the Hub's remote code: multimodal/nvlm_d.py over
multimodal/internvl_chat.py) against HF's InternVLForConditionalGeneration on the same weights.

The checkpoint: a tiny random InternVL in transformers' form (a Qwen2 decoder; 32-pixel tiles
of 4-pixel patches, 16 rows a tile, up to 4 tiles and a thumbnail) whose projector is NVLM-D's,
as vLLM's nvlm_d.py builds it: linear_1 from the shuffled features to the LLM's
intermediate_size and linear_2 back to its hidden size, both without bias (HF's own projector
module with those two layers swapped in). Its image token is <|vision_pad|>; "<image>" and the
tile tags are plain text. test_internvl_chat_remote's to_remote writes it in the Hub's layout,
renamed NVLM_D.

The prompt rule, written out literally from vLLM's NVLMProcessor.get_image_repl and its
BaseInternVLProcessor (the text's "<image>" replaced, then the whole text tokenized): one tile
(a 1 x 1 grid, no thumbnail added) is tagged <tile_global_thumbnail>; a grid of n tiles and its
thumbnail are <tile_1> .. <tile_n>, <tile_global_thumbnail>, each before its run of 16
<|vision_pad|>, all inside <Image> ... </Image>. paged on the remote dir must give HF's prompt
ids, greedy tokens and top-5 logprobs (1e-3, float32) for one image, two (one of them a single
tile), an image after a space (the tags tokenized with the text around them) and text alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from image_checks import check_engine_matches_hf, engine, greedy, hf_refs, noise_image
from test_internvl_chat_remote import assert_chat_matches, save_tiling_processor, to_remote
from vlm_checkpoints import chatml_template, finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.multimodal import nvlm_d
from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

PAD, MARKER = "<|vision_pad|>", "<image>"
R = PAD * 16  # one tile's run
# vLLM's replacement text for an image of one tile, and of a 3 x 1 grid and its thumbnail
ONE_TILE = "<Image><tile_global_thumbnail>" + R + "</Image>"
FOUR_TILES = (
    "<Image><tile_1>" + R + "<tile_2>" + R + "<tile_3>" + R + "<tile_global_thumbnail>" + R
) + "</Image>"
TILES = {1: ONE_TILE, 4: FOUR_TILES}
WIDE, SQUARE = (32, 96), (30, 30)  # (h, w): a 3 x 1 grid + thumbnail; one tile
PROMPT = f"<|im_start|>user\n{MARKER}\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
SPACED = f"<|im_start|>user\nLook: {MARKER}\nand say.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{MARKER}\nand {MARKER}\nWhich?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


def _write_hf(path, seed: int):
    """transformers' InternVL checkpoint (a tokenizer with <|vision_pad|> its only special
    token, its GotOcr2 tiling processor) and HF's model of it with NVLM-D's projector swapped
    in; the saved weights hold that projector (what to_remote writes as mlp1)."""
    path.mkdir(parents=True)
    tokenizer, ids = tokenizer_with([PAD], seed)
    # a plain token " <": as Qwen2's BPE merges " <" (its pre-tokenizer keeps them together),
    # the text before "<Image>" changes its tokens, so the pieces alone tokenize otherwise
    tokenizer.add_tokens([" <"])
    text = tiny_config("qwen2", vocab_size=len(tokenizer))
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": [32, 32], "patch_size": [4, 4]}
    vision |= {"attention_bias": True, "use_qk_norm": True}
    config = transformers.InternVLConfig(
        text_config=text.to_dict(), vision_config=vision, image_token_id=ids[PAD], **_COMMON
    )
    _save_random(transformers.InternVLForConditionalGeneration, config, seed, path)
    save_tiling_processor(path)
    finish_checkpoint(path, tokenizer, chatml_template(MARKER + "\n"))
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, path)
    width, inner, hidden = 32 * 4, text.intermediate_size, text.hidden_size
    assert inner != hidden  # NVLM-D's sizes differ from InternVL's
    gen = torch.Generator().manual_seed(seed)
    projector = model.model.multi_modal_projector
    projector.linear_1 = torch.nn.Linear(width, inner, bias=False)
    projector.linear_2 = torch.nn.Linear(inner, hidden, bias=False)
    with torch.no_grad():
        for layer, fan_in in ((projector.linear_1, width), (projector.linear_2, inner)):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * fan_in**-0.5)
    state = safetensors.load_file(str(path / "model.safetensors"))
    state = {n: t for n, t in state.items() if not n.startswith("multi_modal_projector.linear_")}
    for name in ("linear_1", "linear_2"):  # (transformers 5.25 saves them without `model.`)
        state[f"multi_modal_projector.{name}.weight"] = getattr(projector, name).weight
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model


def _inputs(hf, text: str, images: list) -> tuple[list[int], dict]:
    """vLLM's prompt ids (each "<image>" replaced by the literal text of its tile count, the
    whole text tokenized) and HF's tiles."""
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    processor = transformers.AutoImageProcessor.from_pretrained(hf)
    out = processor(images=images, return_tensors="pt", crop_to_patches=True)
    for tiles in out["num_patches"].tolist():
        text = text.replace(MARKER, TILES[tiles], 1)
    return tok.encode(text, add_special_tokens=False), {"pixel_values": out["pixel_values"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvlm_d")
    model = _write_hf(root / "hf", seed=11)
    remote = to_remote(root / "hf", root / "remote")
    config = json.loads((remote / "config.json").read_text())
    config |= {"architectures": ["NVLM_D"], "model_type": "NVLM_D", "template": "chatml"}
    (remote / "config.json").write_text(json.dumps(config))
    return root / "hf", remote, model


def test_tile_tags_are_vllms():
    """The replacement text of one tile and of a grid with its thumbnail, as vLLM writes it."""
    assert nvlm_d.image_text(1, 16) == ONE_TILE
    assert nvlm_d.image_text(4, 16) == FOUR_TILES


def test_matches_hf(dirs):
    """One image (4 tiles), text alone, two images (4 tiles and 1), an image after a space:
    HF's ids, tokens and logprobs; the same images with those ids given are taken as they
    are, and so are the two images processed ahead (a tile an `ImageInput`); LLM.chat's image
    part gives the first prompt's ids and tokens."""
    hf, remote, model = dirs
    wide, square = noise_image(1, WIDE), noise_image(2, SQUARE)
    cases = [(PROMPT, [wide]), (TEXT, []), (TWO, [wide, square]), (SPACED, [square])]
    refs = hf_refs(model, cases, lambda *case: _inputs(hf, *case))
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert refs[3][0] != tok.encode(SPACED.split(MARKER)[0], add_special_tokens=False) + (
        tok.encode(ONE_TILE + SPACED.split(MARKER)[1], add_special_tokens=False)
    )  # the space before "<Image>" merges with it: the pieces alone tokenize otherwise
    llm = engine(remote)
    check_engine_matches_hf(llm, cases, refs, "nvlm_d")
    images = llm.llm_engine.input_processor.images
    expanded, done = images.process(tok.encode(TWO, add_special_tokens=False), [wide, square])
    assert expanded == refs[2][0] and [m.length for m in done] == [16] * 5
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(done)}}
    (out,) = llm.generate([ahead], greedy(), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == refs[2][1].tokens
    assert_chat_matches(llm, wide, refs[0])


def test_refusals(dirs):
    """Image embeddings, a prompt holding <|vision_pad|> of its own and a marker count that
    differs from the images: ValueErrors naming them, the engine serving on."""
    _, remote, _ = dirs
    llm = engine(remote)
    image = noise_image(3, SQUARE)
    bad = [
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(16, 64)}}, "embeddings"),
        ({"prompt": PROMPT.replace(MARKER, PAD), "multi_modal_data": {"image": image}}, PAD),
        ({"prompt": TWO, "multi_modal_data": {"image": image}}, "2 <image> placeholder"),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match.replace("|", r"\|")):
            llm.generate([prompt], greedy(0), use_tqdm=False)
    (out,) = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], greedy(0))
    assert out.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids(PAD)) == 16
