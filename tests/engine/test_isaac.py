"""Isaac (`IsaacForConditionalGeneration`, remote code; models/isaac_config.py, multimodal/isaac.py,
multimodal/isaac_encoder.py) against a reference composed of transformers' modules and plain
torch, on a tiny random checkpoint.

The checkpoint: transformers' Qwen3ForCausalLM (the remote IsaacForConditionalGeneration is a
Qwen3ForCausalLM: the same weight names) and Siglip2VisionModel (8-pixel patches, a 4 x 4 position
table) saved under the remote's `model.vision_embedding.0.` with the projector's two random
matrices as `model.vision_embedding.{1,3}.weight`, beside a config.json in the remote's flat form
(pixel_shuffle_siglip2 vision_config, pixel shuffle 2, 16 .. 64 patches an image) and a tokenizer
holding <|image_pad|>.

The reference (`_reference`), for a prompt text with "<image>" in it and its images:
  sizes    the remote's fitted sizes, worked out by hand in SIZES (below, up to and within the
           patch bounds)
  pixels   the remote's steps: uint8 bilinear resize, * (1 / 255), (x - 0.5) / 0.5, patches
  rows     HF's Siglip2VisionModel last_hidden_state of the image alone, 2 x 2 blocks row-major
           as one row each, linear -> SiLU -> linear
  ids      the text split at "<image>", the pieces tokenized apart, <|image_pad|> x rows between
  rope     the remote's positions (a running time t; text (t, t, t); an image's tokens (t, r, c);
           the image advances t by one; generated tokens at max + 1 + k) turned into cos / sin
           over sections (8, 4, 4) of the 16 frequencies and given to HF's Qwen3 layers in place
           of its 1-D rotary embedding
  tokens   8 greedy steps of HF's model from those embeds (the whole sequence each step): tokens
           and top-5 logprobs
`LLM.generate` with the text and images must give those ids and tokens (logprobs within 1e-3,
float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import Greedy, assert_matches, hf_greedy_from_embeds
from image_checks import engine, greedy, noise_image
from vlm_checkpoints import chatml_template, finish_checkpoint, saved_tokenizer

transformers = pytest.importorskip("transformers")

PAD = "<|image_pad|>"
PATCH, SHUFFLE, MOST, LEAST = 8, 2, 64, 16
PROMPT = "<|im_start|>user\n<image>\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
# (the first image at time 0: the text after it starts at 1, not at its grid's largest index + 1)
TWO = "<image> and<image>\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
# (height, width) -> the remote's fitted size: 20 x 28 rounds up to 32 x 32 (16 patches, the
# least); 5 x 30 (8 patches rounded) scales up until 16 (16 x 64); 900 x 400 scales down until
# ceil(56.25 s) * ceil(25 s) <= 16 (s = 5 / 56.25: 80 x 48, 60 patches)
SIZES = {(20, 28): (32, 32), (5, 30): (16, 64), (900, 400): (80, 48)}
VISION = {  # the remote's vision_config (pixel_shuffle_siglip2), tiny
    "model_type": "pixel_shuffle_siglip2",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "patch_size": PATCH,
    "num_patches": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "pixel_shuffle_scale_factor": SHUFFLE,
}


def write_tiny_isaac(path: Path, seed: int = 0):
    """The checkpoint (see the module) and its parts: (raw config, LM, tower, fc1, fc2)."""
    from safetensors.torch import save_file

    from paged_engine.testing import _randomize, tiny_config

    tok = saved_tokenizer(path, [PAD], chatml_template("<image>"), seed)
    text = tiny_config("qwen3", vocab_size=tok.convert_tokens_to_ids(PAD) + 8)
    torch.manual_seed(seed)
    lm = transformers.Qwen3ForCausalLM(text).float().eval()
    _randomize(lm, seed)
    siglip = {
        k: v for k, v in VISION.items() if k not in ("model_type", "pixel_shuffle_scale_factor")
    }
    tower = transformers.Siglip2VisionModel(
        transformers.Siglip2VisionConfig(**siglip, vision_use_head=False)
    ).eval()
    _randomize(tower, seed + 1)
    wide = VISION["hidden_size"] * SHUFFLE**2
    gen = torch.Generator().manual_seed(seed + 2)
    fc1 = torch.randn(4 * wide, wide, generator=gen) * wide**-0.5
    fc2 = torch.randn(text.hidden_size, 4 * wide, generator=gen) * (4 * wide) ** -0.5
    state = {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"}  # tied
    for k, v in tower.state_dict().items():  # (no pooling head: the remote's tower has none)
        state["model.vision_embedding.0." + k.removeprefix("vision_model.")] = v
    state["model.vision_embedding.1.weight"], state["model.vision_embedding.3.weight"] = fc1, fc2
    save_file({k: v.contiguous().clone() for k, v in state.items()}, path / "model.safetensors")
    llm = {k: v for k, v in text.to_dict().items() if k not in ("rope_parameters", "dtype")}
    raw = {
        **llm,
        "architectures": ["IsaacForConditionalGeneration"],
        "model_type": "isaac",
        "rope_theta": text.rope_parameters["rope_theta"],
        "vision_config": VISION,
        "video_patch_size": PATCH,
        "vision_max_num_patches": MOST,
        "vision_min_num_patches": LEAST,
        "pixel_shuffle_scale": SHUFFLE,
        "vision_token": "<image>",
        "max_sequence_length": 16384,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(raw))
    finish_checkpoint(path, tok)
    return raw, lm, tower, fc1, fc2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("isaac")
    return path, *write_tiny_isaac(path, seed=4)


def _pixels(image) -> tuple[torch.Tensor, int, int]:
    """The remote's patches of one image at its SIZES size: [h * w, 8 * 8 * 3], h, w."""
    height, width = SIZES[(image.height, image.width)]
    x = torch.from_numpy(np.array(image.convert("RGB")))[None].permute(0, 3, 1, 2)
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    x = (x.permute(0, 2, 3, 1).float() * (1 / 255) - 0.5) / 0.5
    h, w = height // PATCH, width // PATCH
    x = x.reshape(h, PATCH, w, PATCH, 3).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
    return x, h, w


def _rows(tower, fc1, fc2, image) -> tuple[torch.Tensor, int, int]:
    """An image's rows (HF's tower alone, pixel shuffle, projector) and its merged grid."""
    pixels, h, w = _pixels(image)
    with torch.no_grad():
        out = tower(
            pixel_values=pixels[None],
            pixel_attention_mask=torch.ones(1, h * w, dtype=torch.long),
            spatial_shapes=torch.tensor([[h, w]]),
        ).last_hidden_state[0]
    s = SHUFFLE
    x = out.view(h // s, s, w // s, s, -1).permute(0, 2, 1, 3, 4).reshape((h // s) * (w // s), -1)
    return F.silu(x @ fc1.T) @ fc2.T, h // s, w // s


class Mrope(torch.nn.Module):
    """cos / sin of three-row positions (`table` [3, T+]) for HF's Qwen3 layers: `section`
    frequencies turned by the t row, then h, then w (HF's rotary_emb, swapped in)."""

    def __init__(self, inv_freq: torch.Tensor, table: torch.Tensor, section: list[int]) -> None:
        super().__init__()
        self.rows = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.inv_freq, self.table = inv_freq, table

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        pos = self.table[:, : x.shape[1]].float()  # [3, T]
        freqs = pos[self.rows].T * self.inv_freq  # [T, half]: frequency f turned by its row
        emb = torch.cat([freqs, freqs], dim=-1)[None]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def hf_greedy_with_mrope(
    lm, embeds: torch.Tensor, table: torch.Tensor, section: list[int]
) -> Greedy:
    """hf_greedy_from_embeds of HF Qwen3 `lm` with its rotary_emb swapped for `Mrope` over the
    positions `table` [3, T + 8] (restored after)."""
    rope = lm.model.rotary_emb
    lm.model.rotary_emb = Mrope(rope.inv_freq, table, section)
    try:
        return hf_greedy_from_embeds(lm, embeds)
    finally:
        lm.model.rotary_emb = rope


def _reference(tiny, tok, text: str, images: list) -> tuple[list[int], Greedy, list[list[int]]]:
    """(the remote's prompt ids, HF's greedy result from its embeds, its positions)."""
    _, _, lm, tower, fc1, fc2 = tiny
    pad = tok.convert_tokens_to_ids(PAD)
    pieces = text.split("<image>")
    ids: list[int] = tok.encode(pieces[0], add_special_tokens=False)
    t = len(ids)
    pos = [[i, i, i] for i in range(t)]
    runs = []
    for image, piece in zip(images, pieces[1:], strict=True):
        rows, h, w = _rows(tower, fc1, fc2, image)
        runs.append((len(ids), rows))
        pos += [[t, r, c] for r in range(h) for c in range(w)]
        more = tok.encode(piece, add_special_tokens=False)
        ids += [pad] * len(rows) + more
        pos += [[t + 1 + i] * 3 for i in range(len(more))]
        t += 1 + len(more)
    top = max(max(p) for p in pos) + 1
    table = torch.tensor(pos + [[top + k] * 3 for k in range(8)]).T
    with torch.no_grad():
        embeds = lm.get_input_embeddings()(torch.tensor([ids]))
        for at, rows in runs:
            embeds[0, at : at + len(rows)] = rows
    half = lm.model.rotary_emb.inv_freq.shape[0]  # the remote's t / h / w split of frequencies
    return ids, hf_greedy_with_mrope(lm, embeds, table, [half // 2, half // 4, half // 4]), pos


@pytest.fixture(scope="module")
def llm(tiny):
    return engine(tiny[0], max_model_len=512)


def test_images_and_text_match_the_reference(tiny, llm):
    """Text, one image and two through the engine give the reference's ids (each image's run
    of h * w / 4 <|image_pad|>) and tokens; the processor's pixels and the layout's positions
    are the reference's exactly."""
    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.isaac import IsaacImageProcessor, positions

    path = tiny[0]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    images = [noise_image(1, (20, 28)), noise_image(2, (900, 400)), noise_image(3, (5, 30))]
    cases = [(PROMPT, images[:1]), (TEXT, []), (TWO, images[1:])]
    refs = [_reference(tiny, tok, text, imgs) for text, imgs in cases]
    assert [r[0].count(tok.convert_tokens_to_ids(PAD)) for r in refs] == [4, 0, 15 + 4]
    config = remote_config(path)
    process = IsaacImageProcessor(config)
    for image in images:
        want, h, w = _pixels(image)
        got, grid = process.one(image)
        assert grid == (1, h, w) and torch.equal(got, want)
    ids, _, pos = refs[2]
    pad = tok.convert_tokens_to_ids(PAD)
    starts = [i for i in range(len(ids)) if ids[i] == pad and (i == 0 or ids[i - 1] != pad)]
    runs = [
        ImageInput(None, starts[0], 15, "", (1, 10, 6)),
        ImageInput(None, starts[1], 4, "", (1, 2, 8)),
    ]
    table = positions(len(ids), tuple(runs), SHUFFLE)
    assert table.table.T.tolist() == pos
    assert table.delta == max(max(p) for p in pos) + 1 - len(ids)
    prompts = [{"prompt": t, "multi_modal_data": {"image": m}} if m else t for t, m in cases]
    for (ids, ref, _), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False)):
        assert out.prompt_token_ids == ids
        assert_matches("Isaac", out, ref)
    ahead = [  # the expanded ids given: the runs found where they are
        {"prompt_token_ids": ids, "multi_modal_data": {"image": m}}
        for (ids, _, _), (_, m) in zip(refs, cases, strict=True)
        if m
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[0][1].tokens, refs[2][1].tokens]


def test_bad_input_and_config_refused(tiny, llm):
    """A marker count unlike the images', mm_processor_kwargs and config fields the remote's
    model does not run fail with ValueErrors naming them; the engine serves on."""
    from paged_engine.models.isaac_config import isaac_config

    raw = tiny[1]
    bad = [
        ({"prompt": TWO, "multi_modal_data": {"image": [noise_image(1, (20, 28))]}}, "image"),
        (
            {
                "prompt": PROMPT,
                "multi_modal_data": {"image": [noise_image(1, (20, 28))]},
                "mm_processor_kwargs": {"max_num_patches": 9},
            },
            "mm_processor_kwargs",
        ),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], greedy(), use_tqdm=False)
    assert llm.generate([TEXT], greedy(n=2), use_tqdm=False)[0].outputs[0].token_ids
    fields = [
        ({"pixel_shuffle_scale": 1}, "pixel_shuffle_scale"),
        ({"video_patch_size": 16}, "video_patch_size"),
        (
            {"rope_scaling": {"rope_type": "default", "mrope_interleaved": True}},
            "mrope_interleaved",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({"vision_config": {**VISION, "model_type": "siglip_vision_model"}}, "model_type"),
        ({"vision_config": {**VISION, "num_patches": 12}}, "num_patches"),
    ]
    for change, match in fields:
        with pytest.raises(ValueError, match=match):
            isaac_config({**raw, **change})
