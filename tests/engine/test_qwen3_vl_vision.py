"""Qwen3-VL / Qwen3-VL-MoE vision encoder (multimodal/qwen3_vl_vision.py) against HF's.

Tiny random towers built by transformers (Qwen3VLVisionModel, Qwen3VLMoeVisionModel), their
weights saved under either prefix (`model.visual.`: transformers 5's save_pretrained;
`visual.`: older checkpoints) next to unrelated tensors, loaded through `load_weights`: the
merged output (HF's `pooler_output`) and every deepstack feature (`deepstack_features`) must match
to 1e-4 in float32 on three images in one call. The learned position grid is 4x4, so each image
grid (8x12, 6x4, and a 2-frame 4x6) resamples it bilinearly. Also: a missing or unexpected tensor
and unsupported config fields are ValueErrors naming them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_engine.multimodal.qwen3_vl_vision import Qwen3VisionEncoder

transformers = pytest.importorskip("transformers")

GRIDS = [(1, 8, 12), (1, 6, 4), (2, 4, 6)]  # (t, h, w) in patches
_CONFIG = {
    "depth": 3,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 48,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 24,
    "num_position_embeddings": 16,  # a 4x4 grid
    "deepstack_visual_indexes": [0, 2],
}


def _hf_tower(variant: str) -> torch.nn.Module:
    if variant == "qwen3_vl":
        from transformers.models.qwen3_vl import modeling_qwen3_vl as hf
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

        model = hf.Qwen3VLVisionModel(Qwen3VLVisionConfig(**_CONFIG))
    else:
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
            Qwen3VLMoeVisionConfig,
        )

        model = hf.Qwen3VLMoeVisionModel(Qwen3VLMoeVisionConfig(**_CONFIG))
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


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def tower(request):
    """(HF tower, its state dict, pixel_values, HF's merged output, HF's deepstack features)."""
    hf_model = _hf_tower(request.param)
    gen = torch.Generator().manual_seed(1)
    rows = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(rows, 3 * 2 * 4 * 4, generator=gen)
    with torch.no_grad():
        out = hf_model(pixels, torch.tensor(GRIDS))
    return hf_model, hf_model.state_dict(), pixels, out.pooler_output, out.deepstack_features


@pytest.mark.parametrize("prefix", ["model.visual.", "visual."])
def test_matches_hf(tower, prefix):
    hf_model, state, pixels, expected, expected_deep = tower
    ours = Qwen3VisionEncoder(hf_model.config)
    assert (ours.out_dim, ours.merge, ours.num_deepstack) == (24, 2, 2)
    others = [("model.language_model.embed_tokens.weight", torch.zeros(3)), ("lm_head.w", None)]
    weights = [(prefix + name, t) for name, t in state.items()] + others
    loaded = ours.load_weights(weights)
    assert loaded == set(dict(ours.named_parameters()))
    with torch.no_grad():
        merged, deep = ours(pixels, GRIDS)
    rows = sum(t * h * w for t, h, w in GRIDS) // 4
    assert merged.shape == (rows, 24) and expected.shape == merged.shape
    assert expected.abs().mean() > 0.1  # not a near-zero comparison
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    assert len(deep) == len(expected_deep) == 2
    for ours_j, hf_j in zip(deep, expected_deep):
        assert ours_j.shape == (rows, 24) and hf_j.abs().mean() > 0.1
        torch.testing.assert_close(ours_j, hf_j, rtol=1e-4, atol=1e-4)


def test_load_errors_name_the_tensor(tower):
    hf_model, state, _, _, _ = tower
    weights = [("model.visual." + name, t) for name, t in state.items()]
    gone = "model.visual.deepstack_merger_list.1.norm.weight"
    missing = [(n, t) for n, t in weights if n != gone]
    with pytest.raises(ValueError, match=r"missing weights .*deepstack_merger_list\.1\.norm\.w"):
        Qwen3VisionEncoder(hf_model.config).load_weights(missing)
    extra = weights + [("model.visual.blocks.7.mlp.linear_fc1.weight", torch.zeros(48, 32))]
    with pytest.raises(ValueError, match=r"unexpected weights .*visual\.blocks\.7\.mlp\.linear"):
        Qwen3VisionEncoder(hf_model.config).load_weights(extra)


def _config(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{"model_type": "qwen3_vl_vision", **_CONFIG, **changes})


def test_unsupported_config():
    Qwen3VisionEncoder(_config())  # the baseline builds
    with pytest.raises(ValueError, match=r"vision_config\.model_type='qwen2_vl'"):
        Qwen3VisionEncoder(_config(model_type="qwen2_vl"))
    with pytest.raises(ValueError, match=r"vision_config\.patch_size"):
        Qwen3VisionEncoder(_config(patch_size=[4, 4]))
    for indexes in ([2, 0], [0, 3], [1, 1]):
        with pytest.raises(ValueError, match=r"vision_config\.deepstack_visual_indexes"):
            Qwen3VisionEncoder(_config(deepstack_visual_indexes=indexes))
    with pytest.raises(ValueError, match=r"vision_config\.rope_parameters\.rope_type"):
        Qwen3VisionEncoder(_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act='nope'"):
        Qwen3VisionEncoder(_config(hidden_act="nope"))
