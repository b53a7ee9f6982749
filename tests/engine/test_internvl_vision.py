"""InternVL image encoder (multimodal/internvl.py) against transformers' get_image_features.

Tiny random InternVLForConditionalGeneration (vision: 32 wide, 32 x 32 tiles of 4 x 4 patches,
so 8 x 8 patches and a CLS token; text: a tiny Qwen2), its weights taken as save_pretrained
writes them (`vision_tower.X`, `multi_modal_projector.X`: transformers 5.24 saves the legacy
names) and as the state dict names them (`model.vision_tower.X`), next to the language model's
tensors, loaded through `load_weights`. Two images of 3 and 1 tiles in one `encode` call must
match HF's `pooler_output` for the 4 tiles batched (1e-4, float32). Cases: HF's defaults
(LayerNorm, no qk norm, layer -1 with use_mean_pooling), RMSNorm + qk norm + q/k/v bias reading
layer -2 (layer 3 never built), use_mean_pooling False at -1 (the tower's final `layernorm`) with
downsample_ratio 0.25, and the last layer by its positive index (HF skips `layernorm` there).
Also: missing / unexpected tensors and unsupported configs are ValueErrors naming them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_engine.multimodal.internvl import InternVLImageEncoder, patch_tokens

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TILES = [3, 1]  # tiles of the two images
_VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 8
    "intermediate_size": 48,
    "image_size": [32, 32],
    "patch_size": [4, 4],
}


def _config(layer=-1, ratio=0.5, **vision):
    text = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return transformers.InternVLConfig(
        vision_config={**_VISION, **vision},
        text_config=text.to_dict(),
        downsample_ratio=ratio,
        vision_feature_layer=layer,
    )


def _hf_model(config) -> torch.nn.Module:
    model = transformers.InternVLForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("cls_token", "position_embeddings")):
                p.copy_(noise * 0.5)
            elif name.endswith(("lambda_1", "lambda_2")):  # layer scale
                p.copy_(0.1 + noise * 0.05)
            elif p.dim() >= 2:  # N(0, 1/fan_in): activations keep their scale
                p.copy_(noise * p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:  # norm weights
                p.copy_(1.0 + noise * 0.1)
            if config.vision_config.use_qk_norm and (".q_proj." in name or ".k_proj." in name):
                p.mul_(0.03)  # q, k rms ~ 0.03: the qk norms' eps (1e-6, not 1e-3) shows
    return model.eval()


def _tiles() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, 3, 32, 32, generator=gen) for n in TILES]


def _hf_features(model, tiles: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF's rows per image: every tile in one batch, each image's tiles flattened in order."""
    with torch.no_grad():
        out = model.get_image_features(pixel_values=torch.cat(tiles))
    return [rows.flatten(0, 1) for rows in out.pooler_output.split(TILES)]


CASES = {  # name: (config, tower layers built, final layernorm built)
    "default": (dict(), 2, False),
    "rms-qk-bias-skip-last": (
        dict(
            layer=-2,
            num_hidden_layers=3,
            norm_type="rms_norm",
            use_qk_norm=True,
            attention_bias=True,
            layer_norm_eps=1e-3,
        ),
        2,
        False,
    ),
    "final-layernorm-ratio-quarter": (dict(use_mean_pooling=False, ratio=0.25), 2, True),
    "last-by-index": (dict(layer=2, use_mean_pooling=False, hidden_act="gelu_new"), 2, False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(config, saved tensors (bare names), state dict (`model.` names), HF's rows, built)."""
    kwargs, built, final_norm = CASES[request.param]
    config = _config(**kwargs)
    model = _hf_model(config)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        saved.update(safetensors_torch.load_file(file))
    expected = _hf_features(model, _tiles())
    return config, saved, model.state_dict(), expected, (built, final_norm)


def _images() -> list[SimpleNamespace]:
    return [SimpleNamespace(pixel_values=x) for x in _tiles()]


@pytest.mark.parametrize("source", ["saved", "state_dict"])
def test_matches_hf(case, source):
    config, saved, state, expected, _ = case
    weights = saved if source == "saved" else state
    prefix = "" if source == "saved" else "model."
    assert f"{prefix}vision_tower.embeddings.cls_token" in weights  # the names as written
    assert f"{prefix}multi_modal_projector.layer_norm.weight" in weights
    ours = InternVLImageEncoder(config)
    loaded = ours.load_weights(weights.items())
    assert loaded == set(dict(ours.named_parameters()))
    with torch.no_grad():
        out = ours.encode(_images())
    n = patch_tokens(config)
    assert len(out) == len(expected) == len(TILES)
    for rows, want, tiles in zip(out, expected, TILES):
        assert rows.shape == (tiles * n, 64) == want.shape
        assert want.abs().mean() > 0.1  # not a near-zero comparison
        torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)


def test_module_dtype(case):
    config, saved, _, expected, _ = case
    ours = InternVLImageEncoder(config)
    ours.load_weights(saved.items())
    ours.to(torch.bfloat16)
    with torch.no_grad():
        out = ours.encode(_images())
    for rows, want in zip(out, expected):
        assert rows.dtype == torch.bfloat16
        torch.testing.assert_close(rows.float(), want, rtol=0.1, atol=0.1)


def test_layers_after_the_one_read_are_not_built(case):
    config, _, _, _, (built, final_norm) = case
    tower = InternVLImageEncoder(config).vision_tower
    assert len(tower.encoder.layer) == built
    assert (tower.layernorm is not None) == final_norm


def test_patch_tokens():
    assert patch_tokens(_config()) == 16  # (32 / 4)^2 / 4
    assert patch_tokens(_config(ratio=0.25)) == 4
    assert patch_tokens(_config(ratio=1.0)) == 64
    assert patch_tokens(transformers.InternVLConfig()) == 256  # 448 / 14 = 32 a side
    with pytest.raises(ValueError, match=r"downsample_ratio=0\.3"):
        patch_tokens(_config(ratio=0.3))
    with pytest.raises(ValueError, match=r"downsample_ratio=0\.0625"):  # 8 patches a side
        patch_tokens(_config(ratio=0.0625))
    with pytest.raises(ValueError, match=r"vision_config\.image_size=30"):
        patch_tokens(_config(image_size=[30, 30]))


def test_load_errors_name_the_tensor(case):
    config, _, state, _, _ = case
    weights = list(state.items())
    name = "model.vision_tower.encoder.layer.1.attention.projection_layer.bias"
    missing = [(n, t) for n, t in weights if n != name]
    with pytest.raises(ValueError, match=r"missing weights .*layer\.1\.attention\.projection"):
        InternVLImageEncoder(config).load_weights(missing)
    for extra in ("model.multi_modal_projector.extra.weight", "vision_tower.extra.weight"):
        with pytest.raises(ValueError, match=rf"unexpected weights .*{extra[-12:]}"):
            InternVLImageEncoder(config).load_weights([*weights, (extra, torch.zeros(3))])
    # passed over: the language model, mask_token, an unused final layernorm
    ignored = [
        ("language_model.model.norm.weight", torch.zeros(3)),
        ("vision_tower.embeddings.mask_token", torch.zeros(1, 1, 32)),
    ]
    InternVLImageEncoder(config).load_weights([*weights, *ignored])


def test_unsupported_config():
    with pytest.raises(ValueError, match=r"vision_feature_layer=\[-2, -1\]"):
        InternVLImageEncoder(_config(layer=[-2, -1]))
    for layer in (3, -4):
        with pytest.raises(ValueError, match=rf"vision_feature_layer={layer}"):
            InternVLImageEncoder(_config(layer=layer))
    InternVLImageEncoder(_config(layer=-3))  # the embeddings' output: no layer built
    config = _config()
    config.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='full'"):
        InternVLImageEncoder(config)
    config = _config()
    config.vision_config.norm_type = "batch_norm"
    with pytest.raises(ValueError, match=r"vision_config\.norm_type='batch_norm'"):
        InternVLImageEncoder(config)
    with pytest.raises(ValueError, match=r"vision_config\.image_size=\[32, 16\]"):
        InternVLImageEncoder(_config(image_size=[32, 16]))
    with pytest.raises(ValueError, match=r"vision_config\.patch_size=\[4, 2\]"):
        InternVLImageEncoder(_config(patch_size=[4, 2]))
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act='nope'"):
        InternVLImageEncoder(_config(hidden_act="nope"))
    config = _config()
    config.projector_hidden_act = "nope"
    with pytest.raises(ValueError, match=r"projector_hidden_act='nope'"):
        InternVLImageEncoder(config)
    with pytest.raises(ValueError, match=r"vision_config\.num_attention_heads=5"):
        InternVLImageEncoder(_config(num_attention_heads=5))
    config = transformers.LlavaConfig()
    with pytest.raises(ValueError, match=r"vision_config\.model_type='clip_vision_model'"):
        InternVLImageEncoder(config)


def test_encode_checks_the_tile_shape():
    ours = InternVLImageEncoder(_config())
    assert ours.encode([]) == []
    for shape in [(3, 32, 32), (1, 3, 28, 28), (0, 3, 32, 32)]:
        with pytest.raises(ValueError, match=r"expected \[tiles, 3, 32, 32\]"):
            ours.encode([SimpleNamespace(pixel_values=torch.zeros(shape))])
