"""Pixtral image encoder (multimodal/pixtral.py) against transformers' get_image_features.

Tiny random Mistral3ForConditionalGeneration (spatial_merge_size 2) and
LlavaForConditionalGeneration with a pixtral tower ("full" strategy), their weights taken as
save_pretrained writes them (`vision_tower.X`: transformers 5.24 saves the legacy names) and as
the state dict names them (`model.vision_tower.X`), next to the language model's tensors, loaded
through `load_weights`. Two images of different, non-square sizes in one `encode` call must
match HF's per-image `pooler_output` (1e-4, float32); HF gets them padded into one batch with
noise in the padding (its tower crops each to image_sizes). The feature layers cover -1, a
skipped last layer (-2: layer 3 never built) and a list with entry 0 (ln_pre's output). The text
config's rms_norm_eps is large so that Mistral3's projector norm must take it, not the tower's.
Also: missing / unexpected tensors and unsupported configs are ValueErrors naming them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_engine.multimodal.pixtral import PixtralImageEncoder, is_pixtral, merge_size, patch_size

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SIZES = [(24, 40), (48, 16)]  # pixels (H, W): multiples of patch 4 * merge 2
_VISION = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,  # head_dim 8
    "patch_size": 4,
    "image_size": 64,
}


def _text_config() -> dict:
    return transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        rms_norm_eps=0.05,  # far from the tower's 1e-5
    ).to_dict()


def _config(kind: str, layer, **extra):
    if kind == "mistral3":
        vision = {**_VISION, "hidden_act": "silu"}
        return transformers.Mistral3Config(
            vision_config=vision,
            text_config=_text_config(),
            spatial_merge_size=2,
            vision_feature_layer=layer,
            **extra,
        )
    extra.setdefault("vision_feature_select_strategy", "full")
    return transformers.LlavaConfig(
        vision_config={**_VISION, "hidden_act": "gelu"},
        text_config=_text_config(),
        vision_feature_layer=layer,
        **extra,
    )


def _hf_model(config) -> torch.nn.Module:
    if config.model_type == "mistral3":
        model = transformers.Mistral3ForConditionalGeneration(config)
    else:
        model = transformers.LlavaForConditionalGeneration(config)
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


def _images() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, w, generator=gen) for h, w in SIZES]


def _hf_features(model, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF's per-image features: the images top-left in a batch padded with noise."""
    height, width = max(h for h, _ in SIZES), max(w for _, w in SIZES)
    batch = torch.randn(len(images), 3, height, width, generator=torch.Generator().manual_seed(2))
    for i, x in enumerate(images):
        batch[i, :, : x.shape[1], : x.shape[2]] = x
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch, image_sizes=torch.tensor(SIZES))
    return list(out.pooler_output)


CASES = {  # name: (wrapper, vision_feature_layer, tower layers built)
    "mistral3-last": ("mistral3", -1, 3),
    "mistral3-skip-last": ("mistral3", -2, 2),
    "llava-last": ("llava", -1, 3),
    "llava-list": ("llava", [0, -2], 2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(config, saved tensors (bare names), state dict (`model.` names), HF's features, layers
    to build)."""
    kind, layer, built = CASES[request.param]
    config = _config(kind, layer)
    model = _hf_model(config)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        saved.update(safetensors_torch.load_file(file))
    return config, saved, model.state_dict(), _hf_features(model, _images()), built


@pytest.mark.parametrize("source", ["saved", "state_dict"])
def test_matches_hf(case, source):
    config, saved, state, expected, _ = case
    weights = saved if source == "saved" else state
    prefix = "" if source == "saved" else "model."
    assert f"{prefix}vision_tower.patch_conv.weight" in weights  # the names as written
    ours = PixtralImageEncoder(config)
    loaded = ours.load_weights(weights.items())
    assert loaded == set(dict(ours.named_parameters()))
    images = [SimpleNamespace(pixel_values=x) for x in _images()]
    with torch.no_grad():
        out = ours.encode(images)
    m, p = merge_size(config), patch_size(config)
    assert len(out) == len(expected) == len(SIZES)
    for rows, want, (h, w) in zip(out, expected, SIZES):
        assert rows.shape == ((h // (p * m)) * (w // (p * m)), 64) == want.shape
        assert want.abs().mean() > 0.1  # not a near-zero comparison
        torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)


def test_module_dtype(case):
    config, saved, _, expected, _ = case
    ours = PixtralImageEncoder(config)
    ours.load_weights(saved.items())
    ours.to(torch.bfloat16)
    images = [SimpleNamespace(pixel_values=x) for x in _images()]
    with torch.no_grad():
        out = ours.encode(images)
    for rows, want in zip(out, expected):
        assert rows.dtype == torch.bfloat16
        torch.testing.assert_close(rows.float(), want, rtol=0.1, atol=0.1)


def test_helpers():
    mistral3, llava = _config("mistral3", -1), _config("llava", -1)
    assert is_pixtral(mistral3) and is_pixtral(llava)
    assert merge_size(mistral3) == 2 and merge_size(llava) == 1
    assert patch_size(mistral3) == patch_size(llava) == 4
    clip = transformers.LlavaConfig(text_config=_text_config())
    assert not is_pixtral(clip)


def test_layers_after_the_deepest_read_are_not_built(case):
    config, _, _, _, built = case
    assert len(PixtralImageEncoder(config).vision_tower.transformer.layers) == built


def test_load_errors_name_the_tensor(case):
    config, _, state, _, _ = case
    weights = list(state.items())
    name = "model.vision_tower.transformer.layers.1.ffn_norm.weight"
    missing = [(n, t) for n, t in weights if n != name]
    with pytest.raises(ValueError, match=r"missing weights .*transformer\.layers\.1\.ffn_norm"):
        PixtralImageEncoder(config).load_weights(missing)
    for extra in ("model.multi_modal_projector.extra.weight", "vision_tower.extra.weight"):
        with pytest.raises(ValueError, match=rf"unexpected weights .*{extra[-12:]}"):
            PixtralImageEncoder(config).load_weights([*weights, (extra, torch.zeros(3))])


def test_unsupported_config():
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='default'"):
        PixtralImageEncoder(_config("llava", -1, vision_feature_select_strategy="default"))
    with pytest.raises(ValueError, match=r"vision_feature_layer=\[-2, -1\]"):
        PixtralImageEncoder(_config("mistral3", [-2, -1]))
    with pytest.raises(ValueError, match=r"vision_feature_layer=4"):
        PixtralImageEncoder(_config("llava", 4))
    clip = transformers.LlavaConfig(text_config=_text_config())
    with pytest.raises(ValueError, match=r"vision_config\.model_type='clip_vision_model'"):
        PixtralImageEncoder(clip)
    config = _config("llava", -1)
    config.vision_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"vision_config\.rope_parameters\.rope_type"):
        PixtralImageEncoder(config)
    config = _config("mistral3", -1)
    config.vision_config.hidden_act = "nope"
    with pytest.raises(ValueError, match=r"vision_config\.hidden_act='nope'"):
        PixtralImageEncoder(config)


def test_image_size_not_a_multiple_is_rejected():
    ours = PixtralImageEncoder(_config("mistral3", -1))
    with pytest.raises(ValueError, match=r"multiples of patch_size \* merge 8"):
        ours.encode([SimpleNamespace(pixel_values=torch.zeros(3, 12, 16))])
