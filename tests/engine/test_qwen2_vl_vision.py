"""Qwen2-VL / Qwen2.5-VL vision encoder (multimodal/qwen2_vl_vision.py) against HF's.

Tiny random towers built by transformers, their weights saved under either prefix
(`model.visual.`: transformers 5; `visual.`: transformers 4) next to unrelated tensors, loaded
through `load_weights`: the merged output must match HF's `pooler_output` (1e-4, float32) on
three images in one call. The grids make the details bite: a 2-frame image (attention per
frame), and for Qwen2.5-VL windows of 2x2 merged tokens that fit exactly (HF's empty padding
windows) and partly (5x3 merged tokens). Also: a missing or unexpected tensor and an unsupported
model_type are ValueErrors naming them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_engine.multimodal.qwen2_vl_vision import QwenVisionEncoder

transformers = pytest.importorskip("transformers")

GRIDS = [(1, 8, 12), (1, 10, 6), (2, 4, 6)]  # (t, h, w) in patches
_COMMON = {
    "depth": 3,
    "num_heads": 4,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
}


def _hf_tower(variant: str) -> torch.nn.Module:
    if variant == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as hf
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

        config = Qwen2VLVisionConfig(
            **_COMMON, embed_dim=32, hidden_size=24, mlp_ratio=4, hidden_act="quick_gelu"
        )
        model = hf.Qwen2VisionTransformerPretrainedModel(config)
    else:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig,
        )

        config = Qwen2_5_VLVisionConfig(
            **_COMMON,
            hidden_size=32,
            out_hidden_size=24,
            intermediate_size=48,
            hidden_act="silu",
            window_size=16,  # 2x2 merged tokens
            fullatt_block_indexes=[1],
        )
        model = hf.Qwen2_5_VisionTransformerPretrainedModel(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:  # N(0, 1/fan_in): activations keep their scale
                p.copy_(torch.randn(p.shape, generator=gen) * p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # norm weights
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tower(request):
    """(HF tower, its state dict, pixel_values, HF's merged output)."""
    hf_model = _hf_tower(request.param)
    gen = torch.Generator().manual_seed(1)
    rows = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(rows, 3 * 2 * 4 * 4, generator=gen)
    with torch.no_grad():
        expected = hf_model(pixels, torch.tensor(GRIDS)).pooler_output
    return hf_model, hf_model.state_dict(), pixels, expected


@pytest.mark.parametrize("prefix", ["model.visual.", "visual."])
def test_matches_hf(tower, prefix):
    hf_model, state, pixels, expected = tower
    ours = QwenVisionEncoder(hf_model.config)
    others = [("model.language_model.embed_tokens.weight", torch.zeros(3)), ("lm_head.w", None)]
    weights = [(prefix + name, t) for name, t in state.items()] + others
    loaded = ours.load_weights(weights)
    assert loaded == set(dict(ours.named_parameters()))
    with torch.no_grad():
        out = ours(pixels, GRIDS)
    merged = sum(t * h * w for t, h, w in GRIDS) // 4
    assert out.shape == (merged, 24) and expected.shape == out.shape
    assert expected.abs().mean() > 0.1  # not a near-zero comparison
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_load_errors_name_the_tensor(tower):
    hf_model, state, _, _ = tower
    weights = [("model.visual." + name, t) for name, t in state.items()]
    missing = [(n, t) for n, t in weights if n != "model.visual.blocks.1.attn.qkv.bias"]
    with pytest.raises(ValueError, match=r"missing weights .*blocks\.1\.attn\.qkv\.bias"):
        QwenVisionEncoder(hf_model.config).load_weights(missing)
    extra = weights + [("model.visual.blocks.7.attn.qkv.weight", torch.zeros(96, 32))]
    with pytest.raises(ValueError, match=r"unexpected weights .*visual\.blocks\.7\.attn\.qkv"):
        QwenVisionEncoder(hf_model.config).load_weights(extra)


def test_unsupported_config():
    with pytest.raises(ValueError, match=r"vision_config\.model_type='qwen3_vl'"):
        QwenVisionEncoder(SimpleNamespace(model_type="qwen3_vl"))
    config = SimpleNamespace(model_type="qwen2_vl", embed_dim=32, num_heads=4, depth=1)
    config.patch_size = [4, 4]
    with pytest.raises(ValueError, match=r"vision_config\.patch_size"):
        QwenVisionEncoder(config)
