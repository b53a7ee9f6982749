"""Keye-VL-1.5 (`KeyeVL1_5ForConditionalGeneration`, remote code; models/keye_config.py,
multimodal/keye.py) against test_keye_vl.py's reference with its projector swapped, on a tiny
random checkpoint.

The checkpoint: test_keye_vl.py's (Qwen3 LM, PaddleOCR-VL's tower under `visual.vision_model.*`,
`mlp_AR.*`), its architectures Keye-VL-1.5's and its `mlp_AR.pre_norm` replaced by a random
LayerNorm over the merged row (4 x 32 wide), as vLLM's keye_vl1_5.py builds it.

The reference: test_keye_vl.py's (HF Paddle's tower and get_rope_index, HF's Qwen3 layers at the
M-RoPE positions) with HF Paddle's projector replaced by `_MergedRowReference`, written here in
plain torch: each image's 2 x 2 blocks of tower rows concatenated (row-major blocks, a block's
patches row-major), LayerNorm (eps 1e-5) over each concatenated row, linear, GELU, linear.
`LLM.generate` must give its ids, tokens and top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches
from image_checks import check_config_refused, engine, greedy, noise_image
from test_keye_vl import PAD, PROMPT, TEXT, TWO, _reference, write_tiny_keye

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.paddleocr_vl")

ARCH = "KeyeVL1_5ForConditionalGeneration"
WIDTH = 32 * 4  # the tower's width x the 2 x 2 merge


class _MergedRowReference(torch.nn.Module):
    """HF Paddle's projector call (rows of all images, their grids) with the norm after the
    merge."""

    def __init__(self, projector: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.linear_1, self.linear_2 = projector.linear_1, projector.linear_2
        self.weight, self.bias = weight, bias

    def forward(self, rows: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        out = []
        for x, (t, h, w) in zip(rows.split(grids.prod(1).tolist()), grids.tolist(), strict=True):
            blocks = x.reshape(t, h // 2, 2, w // 2, 2, -1).permute(0, 1, 3, 2, 4, 5)
            merged = blocks.reshape(t * (h // 2) * (w // 2), -1)
            normed = F.layer_norm(merged, (merged.shape[-1],), self.weight, self.bias, 1e-5)
            out.append(self.linear_2(F.gelu(self.linear_1(normed))))
        return torch.cat(out)


def write_tiny_keye_vl1_5(path: Path, seed: int = 0):
    """The checkpoint (see the module) and its parts: (raw config, Qwen3 LM, HF Paddle model
    whose projector is the reference's)."""
    from safetensors.torch import load_file, save_file

    raw, lm, paddle = write_tiny_keye(path, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    weight = 1 + 0.5 * torch.randn(WIDTH, generator=gen)
    bias = 0.2 * torch.randn(WIDTH, generator=gen)
    state = load_file(path / "model.safetensors")
    state.update({"mlp_AR.pre_norm.weight": weight, "mlp_AR.pre_norm.bias": bias})
    save_file(state, path / "model.safetensors")
    raw = {**raw, "architectures": [ARCH], "model_type": "KeyeVL1_5"}
    (path / "config.json").write_text(json.dumps(raw))
    paddle.model.projector = _MergedRowReference(paddle.model.projector, weight, bias)
    return raw, lm, paddle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("keye_vl1_5")
    return path, *write_tiny_keye_vl1_5(path, seed=9)


def test_images_and_text_match_the_reference(tiny):
    """Text, one image and two give the reference's ids, tokens and logprobs; a video is
    refused by name (Keye-VL-1.5's slow / fast frames are not served)."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny[0])
    images = [noise_image(1, (20, 28)), noise_image(2, (900, 400)), noise_image(3, (5, 30))]
    cases = [(PROMPT, images[:1]), (TEXT, []), (TWO, images[1:])]
    refs = [_reference(tiny, tok, text, imgs) for text, imgs in cases]
    assert [r[0].count(tok.convert_tokens_to_ids(PAD)) for r in refs] == [8, 0, 66]
    llm = engine(tiny[0])
    prompts = [{"prompt": t, "multi_modal_data": {"image": m}} if m else t for t, m in cases]
    for (ids, ref, _), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False)):
        assert out.prompt_token_ids == ids
        assert_matches("Keye-VL-1.5", out, ref)
    with pytest.raises(ValueError, match="video"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [images[0]]}}, greedy())


def test_preview_checkpoint_as_1_5_refused(tmp_path):
    """The Preview's per-patch pre_norm [32] under a Keye-VL-1.5 config.json fails at load
    naming the tensor."""
    preview = tmp_path / "preview"
    preview.mkdir()
    raw, _, _ = write_tiny_keye(preview, seed=3)
    check_config_refused(preview, tmp_path / "as_1_5", {**raw, "architectures": [ARCH]}, "pre_norm")
