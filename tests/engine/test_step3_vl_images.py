"""Step3-VL's images (`Step3VLForConditionalGeneration`, remote code: stepfun-ai/step3;
models/step3_vl_config.py, multimodal/step3_vl.py, multimodal/step3_vl_encoder.py) against a
reference composed here from vLLM's step3_vl.py rules, on a tiny random checkpoint.

transformers has no Step3-VL class, and no layer of its computes Step3's ViT layer (the norms
come AFTER each sublayer, inside the residual: x + norm1(attn(x)); CLIP / SigLIP norm before),
so the reference tower wires transformers' CLIPAttention (separate q / k / v with biases,
head_dim^-0.5, no mask) and CLIPMLP (quick_gelu) into that residual, with plain torch for the
rest: the patch conv (biased), the class row, the position table resized to a 504 view's grid
(bicubic, antialiased), the 3 extra copies of row 0 the layers also attend to, the 2 x 2 /
stride 2 and 3 x 3 / stride 2 convs, the projector. The checkpoint holds it under the release's
names (the attention fused as `qkv_proj`), beside models/test_models_step3_text.py's decoder.

    layout   each image's views and <patch_newline> flags for sizes worked out by hand from
             vLLM's ImagePatcher (SIZES: no patches, a thin image padded square, a row of
             windows, a column with newlines, 504 windows over 728 pixels with newlines
             between rows, windows past a short side), the token counts vLLM's
             get_num_image_tokens gives and the prompt ids the processor makes
    pixels   the views of three images against PIL crops / resizes written out here
    rows     each view's rows from the engine's encoder = the reference's (float32, 1e-5)
    tokens   8 greedy steps of the reference decoder over the merged embeddings (patch rows,
             then the global rows, at the <im_patch> runs) = LLM.generate's (top-5 logprobs
             within 1e-3), one image with patches and two images in one prompt
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, greedy_over_logits
from image_checks import engine, greedy, noise_image
from test_models_step3_text import TEXT, Step3Reference
from torch import nn
from vlm_checkpoints import finish_checkpoint, tokenizer_with

from paged_engine.testing import _COMMON, _randomize

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

SPECIAL = [
    "<im_patch>",
    "<patch_start>",
    "<patch_end>",
    "<patch_newline>",
    "<im_start>",
    "<im_end>",
]
VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "output_hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 728,
    "patch_size": 14,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
LONG = {"max_position_embedding": 1024, "max_seq_len": 1024}  # an image's prompt is 171+ tokens
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
F_, T_ = False, True
# (width, height) -> (patch windows, <patch_newline> after each); worked out from vLLM's rules:
#   40 x 30   long <= 728, ratio 1.33 <= 1.5: no window
#   40 x 8    short < 32 and ratio 5 > 4: padded to 40 x 40 -> no window
#   64 x 32   ratio 2: window 32; sides 64, 32 -> 2 x 1 windows, one row
#   20 x 50   ratio 2.5: window 20; height 2.5 windows -> 3 (60); one column of 3 rows
#   1000 x 600  long > 728, ratio <= 4: window 504; 1.98 -> 2 (1008), 1.19 -> 1 (504)
#   1600 x 300  ratio 5.3 > 4: window 300; 5.33 -> 6 (1800), 1 -> 300: one row of 6
#   800 x 1200  window 504; 1.59 -> 2 (1008), 2.38 -> 3 (1512): 3 rows of 2
#   1000 x 300  window 504; 1008 x 300: 2 windows reaching past the bottom (black)
SIZES = {
    (40, 30): (0, []),
    (40, 8): (0, []),
    (64, 32): (2, [F_, F_]),
    (20, 50): (3, [T_, T_, F_]),
    (1000, 600): (2, [F_, F_]),
    (1600, 300): (6, [F_] * 6),
    (800, 1200): (6, [F_, T_, F_, T_, F_, F_]),
    (1000, 300): (2, [F_, F_]),
}


class _Layer(nn.Module):
    def __init__(self, clip) -> None:
        super().__init__()
        from transformers.models.clip.modeling_clip import CLIPMLP, CLIPAttention

        self.attn, self.mlp = CLIPAttention(clip), CLIPMLP(clip)
        self.ln1 = nn.LayerNorm(clip.hidden_size, eps=clip.layer_norm_eps)
        self.ln2 = nn.LayerNorm(clip.hidden_size, eps=clip.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ln1(self.attn(x)[0])
        return x + self.ln2(self.mlp(x))


class Tower(nn.Module):
    """The reference tower, downsamplers and projector (module doc)."""

    def __init__(self, text_hidden: int) -> None:
        super().__init__()
        v = VISION
        d, o, p = v["hidden_size"], v["output_hidden_size"], v["patch_size"]
        clip = transformers.CLIPVisionConfig(
            **{
                k: v[k]
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "hidden_act",
                    "layer_norm_eps",
                )
            }
        )
        clip._attn_implementation = "eager"
        self.grid = v["image_size"] // p
        self.patch = nn.Conv2d(3, d, p, stride=p)
        self.cls = nn.Parameter(torch.empty(d))
        self.pos = nn.Embedding(self.grid**2 + 1, d)
        self.layers = nn.ModuleList(_Layer(clip) for _ in range(v["num_hidden_layers"]))
        self.down1 = nn.Conv2d(d, o, 2, stride=2)
        self.down2 = nn.Conv2d(o, 2 * o, 3, stride=2, padding=1)
        self.proj = nn.Linear(2 * o, text_hidden)

    def rows(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, S, S] -> [n, text hidden]
        with torch.no_grad():
            x = self.patch(pixels[None]).flatten(2).transpose(1, 2)[0]  # [g*g, D]
            g = int(len(x) ** 0.5)
            table = self.pos.weight
            if g != self.grid:
                grid = table[1:].T.reshape(1, -1, self.grid, self.grid)
                grid = F.interpolate(grid, (g, g), mode="bicubic", antialias=True)
                table = torch.cat([table[:1], grid[0].reshape(len(table[0]), -1).T])
            x = torch.cat([self.cls[None], x]) + table
            x = torch.cat([x[:1], x[:1], x[:1], x])[None]
            for layer in self.layers:
                x = layer(x)
            x = x[0, 4:].T.reshape(1, -1, g, g)
            x = self.down2(self.down1(x))
            return self.proj(x[0].flatten(1).T)

    def release_state(self) -> dict[str, torch.Tensor]:
        e, out = "vision_model.embeddings.", {}
        out[e + "class_embedding"] = self.cls.detach()[None]  # vLLM's [1, D]
        out[e + "position_embedding.weight"] = self.pos.weight.detach()
        for k in ("weight", "bias"):
            out[e + "patch_embedding." + k] = getattr(self.patch, k).detach()
            out["vit_downsampler." + k] = getattr(self.down1, k).detach()
            out["vit_downsampler2." + k] = getattr(self.down2, k).detach()
            out["vit_large_projector." + k] = getattr(self.proj, k).detach()
            for i, layer in enumerate(self.layers):
                pre, a = f"vision_model.transformer.layers.{i}.", layer.attn
                qkv = [getattr(getattr(a, n), k) for n in ("q_proj", "k_proj", "v_proj")]
                out[pre + "self_attn.qkv_proj." + k] = torch.cat(qkv).detach()
                out[pre + "self_attn.out_proj." + k] = getattr(a.out_proj, k).detach()
                out[pre + "mlp.fc1." + k] = getattr(layer.mlp.fc1, k).detach()
                out[pre + "mlp.fc2." + k] = getattr(layer.mlp.fc2, k).detach()
                out[pre + "layer_norm1." + k] = getattr(layer.ln1, k).detach()
                out[pre + "layer_norm2." + k] = getattr(layer.ln2, k).detach()
        return out


def _raw(vocab: int, image_token: int, **over) -> dict:
    text = {**TEXT, "vocab_size": vocab, "model_type": "step3_text", **LONG}
    return {
        "architectures": ["Step3VLForConditionalGeneration"],
        "model_type": "step3_vl",
        "text_config": text,
        "vision_config": VISION,
        "image_token_id": image_token,
        "understand_projector_stride": 2,
        "projector_bias": True,
        "torch_dtype": "float32",
        **_COMMON,
        **over,
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, tokenizer, special ids, decoder reference, tower reference)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("step3_vl")
    tok, ids = tokenizer_with(SPECIAL, 5)
    vocab = len(tok) + 3
    lm = Step3Reference(TEXT).eval()
    lm.model.embed_tokens = nn.Embedding(vocab, TEXT["hidden_size"])
    lm.lm_head = nn.Linear(TEXT["hidden_size"], vocab, bias=False)
    tower = Tower(TEXT["hidden_size"]).eval()
    with torch.no_grad():
        _randomize(lm, 5)
        _randomize(tower, 6)
        tower.cls.normal_(0, 0.5, generator=torch.Generator().manual_seed(7))
    state = {**lm.state_dict(), **tower.release_state()}
    save_file({k: v.contiguous().clone() for k, v in state.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(_raw(vocab, ids["<im_patch>"])))
    finish_checkpoint(path, tok)
    return path, tok, ids, lm, tower


def _expected_ids(ids: dict[str, int], ends: list[bool]) -> list[int]:
    """vLLM's replacement of one "<im_patch>" (its _get_image_repl_features)."""
    pad, out = ids["<im_patch>"], []
    for newline in ends:
        out += [ids["<patch_start>"], *[pad] * 81, ids["<patch_end>"]]
        out += [ids["<patch_newline>"]] if newline else []
    return [*out, ids["<im_start>"], *[pad] * 169, ids["<im_end>"]]


def _image(size: tuple[int, int], seed: int):
    return noise_image(seed, (size[1], size[0]))  # noise_image takes (height, width)


def _processor(tiny):
    from paged_engine.multimodal.processor import ImageProcessor, wrapper_config

    path, tok = tiny[:2]
    return ImageProcessor(path, wrapper_config(path), tokenizer=tok)


def test_layout_matches_vllm_rules(tiny):
    from paged_engine.multimodal.step3_vl import num_tokens, plan

    ids = tiny[2]
    proc = _processor(tiny)
    prompt = [5, ids["<im_patch>"], 9]
    for i, ((w, h), (patches, ends)) in enumerate(SIZES.items()):
        _, corners, flags, _ = plan(w, h)
        assert (len(corners), flags) == (patches, ends), (w, h)
        # vLLM's get_num_image_tokens: patches * (81 + 2) + 169 + 2 + newline rows
        assert num_tokens(w, h) == patches * 83 + 171 + sum(ends), (w, h)
        out, images = proc.process(prompt, [_image((w, h), i)])
        assert out == [5, *_expected_ids(ids, ends), 9], (w, h)
        assert [m.length for m in images] == [81] * patches + [169]
        assert [tuple(m.pixel_values.shape) for m in images] == [(3, 504, 504)] * patches + [
            (3, 728, 728)
        ]
        assert all(
            out[m.offset : m.offset + m.length] == [ids["<im_patch>"]] * m.length for m in images
        )
    # a thin strip padded square past MOST_PIXELS (6000 x 6000) is refused, naming the image
    with pytest.raises(ValueError, match="padded square"):
        proc.process(prompt, [_image((8, 6000), 3)])


def _norm(image, side: int) -> torch.Tensor:
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255
    x = (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    return F.interpolate(x[None], (side, side), mode="bilinear", antialias=True)[0]


def test_views_are_vllm_crops(tiny):
    proc = _processor(tiny)
    resample = Image.Resampling.BILINEAR
    tall = _image((20, 50), 1)  # -> 20 x 60, three 20 x 20 windows down
    grown = tall.resize((20, 60), resample)
    thin = _image((40, 8), 2)  # -> pasted on a black 40 x 40
    square = Image.new("RGB", (40, 40))
    square.paste(thin, (0, 0))
    wide = _image((1000, 300), 3)  # -> 1008 x 300, two 504 windows (black below 300)
    wider = wide.resize((1008, 300), resample)
    cases = [
        (tall, [grown.crop((0, 20 * i, 20, 20 * i + 20)) for i in range(3)], tall),
        (thin, [], square),
        (wide, [wider.crop((504 * i, 0, 504 * i + 504, 504)) for i in range(2)], wide),
    ]
    for image, crops, whole in cases:
        _, images = proc.process([1, proc.image_token_id], [image])
        want = [_norm(c, 504) for c in crops] + [_norm(whole, 728)]
        for m, x in zip(images, want, strict=True):
            torch.testing.assert_close(m.pixel_values, x, atol=1e-5, rtol=0)


def test_rows_match_reference(tiny):
    from vlm_checkpoints import encoder_from_checkpoint

    from paged_engine.multimodal.processor import wrapper_config

    path, _, ids, _, tower = tiny
    encoder = encoder_from_checkpoint(path, wrapper_config(path))
    _, images = _processor(tiny).process([ids["<im_patch>"]], [_image((64, 32), 4)])
    with torch.no_grad():
        got = encoder.encode(images)
    for m, rows in zip(images, got, strict=True):
        want = tower.rows(m.pixel_values)
        assert rows.shape == want.shape == (m.length, TEXT["hidden_size"])
        # rows of magnitude ~700 (random weights): float32 rounding of a 2708-row attention
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


class _Merged(nn.Module):
    """The token table with each view's reference rows put at its run (vLLM's merge)."""

    def __init__(self, table: nn.Embedding, rows: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.table, self.rows = table, rows

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        x = self.table(seq)
        for at, r in self.rows.items():
            x[at : at + len(r)] = r
        return x


def _reference(tiny, prompt: list[int], images: list) -> tuple[list[int], object]:
    """(the expanded prompt ids, the reference decoder's greedy continuation over them)."""
    _, _, ids, lm, tower = tiny
    out, placed = _processor(tiny).process(prompt, images)
    assert [t for t in out if t not in ids.values()] == [t for t in prompt if t not in ids.values()]
    table = lm.model.embed_tokens
    lm.model.embed_tokens = _Merged(table, {m.offset: tower.rows(m.pixel_values) for m in placed})
    try:
        with torch.no_grad():
            return out, greedy_over_logits(lm.logits, out, 8)
    finally:
        lm.model.embed_tokens = table


def test_generation_matches_reference(tiny):
    path, _, ids, _, _ = tiny
    pad = ids["<im_patch>"]
    one = ([3, 7, pad, 11, 12], [_image((20, 50), 8)])
    two = ([4, pad, 6, pad, 9], [_image((40, 30), 9), _image((64, 32), 10)])
    llm = engine(path, max_model_len=1024)
    for n, (prompt, images) in enumerate((one, two)):
        want_ids, ref = _reference(tiny, prompt, images)
        request = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
        out = llm.generate([request], greedy(), use_tqdm=False)[0]
        assert out.prompt_token_ids == want_ids
        assert_matches(f"step3-vl-{n}", out, ref)


def test_unserved_fields_named(tiny, tmp_path):
    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.archs import supported_tower

    path = tiny[0]
    vocab = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
    bad = {**VISION, "hidden_act": "relu"}
    (tmp_path / "config.json").write_text(json.dumps(_raw(vocab, 1, vision_config=bad)))
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act"):
        remote_config(tmp_path)
    # vLLM's default stride 1 makes 676 rows of the global view, not its 169 placeholders:
    # the tower is not run (text only), the reason naming the field
    (tmp_path / "config.json").write_text(json.dumps(_raw(vocab, 1, understand_projector_stride=1)))
    config = remote_config(tmp_path)
    assert not supported_tower(config)
    assert "understand_projector_stride=1" in config.vision_config.model_type
    assert supported_tower(remote_config(path))


def test_engine_paths(tiny):
    """Chunks ending inside the views' runs, a prefix-cache hit on the same image, images
    processed ahead (and refused one token off): the plain run's tokens."""
    from image_checks import check_engine_paths, path_prompts

    two = "x<im_patch> and<im_patch> y"
    llm = check_engine_paths(tiny[0], path_prompts("a<im_patch> b", two), two, chunk=64)
    # refused by name: vLLM's image_embeds input, any mm_processor_kwargs (vLLM's take none)
    pad = tiny[2]["<im_patch>"]
    embeds = {"prompt_token_ids": [3, pad], "multi_modal_data": {"image": torch.zeros(169, 64)}}
    with pytest.raises(ValueError, match="image embeddings are not supported"):
        llm.generate([embeds], greedy(0), use_tqdm=False)
    kwargs = {
        "prompt_token_ids": [3, pad],
        "multi_modal_data": {"image": _image((40, 30), 1)},
        "mm_processor_kwargs": {"size": 504},
    }
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['size'\]"):
        llm.generate([kwargs], greedy(0), use_tqdm=False)
