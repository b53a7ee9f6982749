"""EmbeddingGemma 2 (`EmbeddingGemma2Model` / `EmbeddingGemma2TextModel`:
models/embedding_gemma2.py, served through models/text_wrappers.py).

Reference: transformers' own `EmbeddingGemma2Model` (text and a tiny Gemma 4 vision tower) on
random weights, its `last_hidden_state` (already through `embedding_projection`) mean-pooled and
normalized as vLLM pools it; prompts many times longer than the sliding layers' radius, batched
at different lengths; images as transformers' `EmbeddingGemma2Processor` expands them (its ids
checked), the model fed the engine's pixels (transformers' PIL image processor resamples
otherwise, up to 2 / 255 apart: test_gemma4_images.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hf_parity import save_hf_checkpoint, write_hf_checkpoint
from PIL import Image
from transformers.models.embedding_gemma2 import (
    EmbeddingGemma2Config,
    EmbeddingGemma2Model,
    EmbeddingGemma2Processor,
    EmbeddingGemma2TextConfig,
)

from paged_engine import LLM, PoolingParams
from paged_engine.testing import TINY_VOCAB_SIZE, build_tiny_tokenizer

# layer 2 is full (global head 16, one KV head); layers 0, 1, 3 slide with radius 3
TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "sliding_window": 3,
    "hidden_size_per_layer_input": 8,
    "embedding_dim": 24,
    "max_position_embeddings": 128,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
    "global_head_dim": 16,
    "attention_bias": True,  # the release's is False: biases load and add as HF's
    "num_global_key_value_heads": 1,
}
VISION = {  # 2-pixel patches pooled 3 x 3
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 2,
    "pooling_kernel_size": 3,
    "position_embedding_size": 64,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 50.0},
}
AUDIO = {  # a tiny Gemma 4 conformer
    "model_type": "gemma4_audio",
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "subsampling_conv_channels": [16, 8],
    "conv_kernel_size": 5,
    "attention_chunk_size": 4,
    "attention_context_left": 5,
    "attention_context_right": 2,
    "attention_logit_cap": 2.0,
    "output_proj_dims": 24,
    "use_clipped_linears": True,
}
TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
SOFT_TOKENS = 70  # the image processor's max_soft_tokens (its smallest allowed)


def extractor() -> transformers.Gemma4AudioFeatureExtractor:
    return transformers.Gemma4AudioFeatureExtractor(feature_size=16)  # 16 mels


PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71)), [9]]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 128}


def _buffers(model: torch.nn.Module) -> None:
    """Saved buffers the randomizer leaves alone, set where they change outputs: each layer's
    `layer_scalar` away from 1, the audio tower's clip bounds (unbounded) to ones that bite."""
    gen = torch.Generator().manual_seed(3)
    for name, buf in model.named_buffers():
        if name.endswith("layer_scalar"):
            buf.copy_(0.5 + torch.rand(buf.shape, generator=gen))
        elif name.startswith("audio_tower.") and name.endswith(("_max", "_min")):
            buf.fill_(1.0 if name.endswith("_max") else -1.0)


@torch.no_grad()
def hf_rows(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts]


def write_checkpoint(path: Path) -> Path:
    """The tiny `EmbeddingGemma2Model`, its image processor and a tokenizer with the media
    tokens; config.json lists Matryoshka sizes at the top level, as vLLM reads them."""
    base = build_tiny_tokenizer(TINY_VOCAB_SIZE, 1)
    base.add_special_tokens({"additional_special_tokens": [*TOKENS.values(), "<|video|>"]})
    base.save_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=TOKENS)
    ids = {f"{k}_id": tok.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
    ids["eoa_token_index"] = ids.pop("eoa_token_id")  # the config's name for it
    config = EmbeddingGemma2Config(
        text_config={**TEXT, "vocab_size": len(tok)},
        vision_config=VISION,
        audio_config=AUDIO,
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        **ids,
    )
    write_hf_checkpoint(path, EmbeddingGemma2Model, config, adjust=_buffers)
    tok.save_pretrained(path)  # over the plain tokenizer the checkpoint writer saves
    pil = transformers.Gemma4ImageProcessorPil
    pil(patch_size=2, pooling_kernel_size=3, max_soft_tokens=SOFT_TOKENS).save_pretrained(path)
    features = json.loads(extractor().to_json_string())
    processor = {"feature_extractor": features, "audio_seq_length": 750, "audio_ms_per_token": 40}
    (path / "processor_config.json").write_text(json.dumps(processor))
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["EmbeddingGemma2Model"]
    (path / "config.json").write_text(json.dumps({**saved, "matryoshka_dimensions": [24, 16]}))
    return path


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("eg2"))
    model = EmbeddingGemma2Model.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, hf_rows(model, PROMPTS), LLM(str(path), **KW)


def test_embedding_gemma2_matches_hf(wrapper) -> None:
    """Mean pooling, normalized; per-token rows; prompts past the window, batched."""
    _, _, rows, llm = wrapper
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, rows, strict=True):
        want = torch.nn.functional.normalize(h.mean(0), dim=-1)
        assert len(out.outputs.embedding) == TEXT["embedding_dim"]
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    tokens = llm.encode(
        [{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False, pooling_task="token_embed"
    )
    want = torch.nn.functional.normalize(rows[0], dim=-1)
    torch.testing.assert_close(tokens[0].outputs.data, want, atol=1e-4, rtol=1e-4)
    # the embedding is embedding_dim wide (not hidden_size): Matryoshka sizes checked on it
    short = llm.embed(
        [{"prompt_token_ids": PROMPTS[2]}], PoolingParams(dimensions=16), use_tqdm=False
    )
    want = torch.nn.functional.normalize(rows[2].mean(0)[:16], dim=-1)
    assert short[0].outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="dimensions=32"):
        llm.embed([{"prompt_token_ids": [5]}], PoolingParams(dimensions=32), use_tqdm=False)
    # video is not served: refused by name, text still served after
    image = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match=r"multi_modal_data.*video"):
        llm.embed({"prompt": "a", "multi_modal_data": {"video": [image] * 2}}, use_tqdm=False)
    again = llm.embed([{"prompt_token_ids": PROMPTS[1]}], use_tqdm=False)
    assert again[0].outputs.embedding == pytest.approx(outs[1].outputs.embedding, abs=1e-6)


def test_text_model_saved_alone(tmp_path, wrapper) -> None:
    """`EmbeddingGemma2TextModel` saved by itself (no `language_model.` prefix) loads too."""
    _, model, rows, _ = wrapper
    text = model.language_model
    text.config.architectures = ["EmbeddingGemma2TextModel"]
    save_hf_checkpoint(text, tmp_path, seed=1)
    outs = LLM(str(tmp_path), **KW).embed(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]], use_tqdm=False
    )
    for out, h in zip(outs, rows, strict=False):
        want = torch.nn.functional.normalize(h.mean(0), dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)


class _NoVideoProcessor(EmbeddingGemma2Processor):
    """The processor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, name, arg):
        if name == "video_processor" and arg is None:
            return None
        return super().check_argument_for_proper_class(name, arg)


@torch.no_grad()
def test_images_and_audio_match_hf(wrapper) -> None:
    """A wide and a tall image (their own grids and runs), two in one prompt, an audio clip
    with an image, batched with text: the engine's prompt ids are the HF processor's, its
    embeddings HF's within 1e-4."""
    path, model, _, llm = wrapper
    from paged_engine.multimodal.torch_processors import image_processor

    gen = np.random.default_rng(0)
    wide, tall = (
        Image.fromarray(gen.integers(0, 255, s, np.uint8)) for s in [(20, 34, 3), (40, 14, 3)]
    )
    clip = gen.standard_normal(4000).astype(np.float32) * 0.3  # 0.25 s at 16 kHz
    cases = [
        ("<|bos|>Look: <|image|> ok", [wide], None),
        ("A <|image|> and <|image|>.", [tall, wide], None),
        ("Hear <|audio|> see <|image|>", [tall], clip),
    ]
    processor = _NoVideoProcessor(
        feature_extractor=extractor(),
        image_processor=transformers.AutoImageProcessor.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        video_processor=None,
        image_seq_length=SOFT_TOKENS,
    )
    ours = image_processor(path, transformers.AutoConfig.from_pretrained(path))
    prompts = [
        {
            "prompt": t,
            "multi_modal_data": {"image": im} | ({"audio": (a, 16000)} if a is not None else {}),
        }
        for t, im, a in cases
    ]
    outs = llm.embed([*prompts, {"prompt_token_ids": PROMPTS[2]}], use_tqdm=False)
    for out, (text, images, a) in zip(outs, cases, strict=False):
        sound = {} if a is None else {"audio": [a]}
        got = processor(text=[text], images=[images], return_tensors="pt", **sound)
        ids = got["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        pixels = ours(images=images, return_tensors="pt")
        feats = {k: got[k] for k in ("input_features", "input_features_mask") if k in got}
        positions = pixels["image_position_ids"]
        h = model(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            image_position_ids=positions,
            **feats,
        ).last_hidden_state[0]
        want = torch.nn.functional.normalize(h.mean(0), dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "rope_parameters",
        ),
        ({"sliding_window": -1}, "sliding_window"),
        ({"hidden_size_per_layer_input": 0}, "hidden_size_per_layer_input"),
    ],
)
def test_refused_config_values_name_the_field(tmp_path, change, field) -> None:
    config = EmbeddingGemma2TextConfig(**TEXT)
    raw = {**config.to_dict(), **change, "architectures": ["EmbeddingGemma2TextModel"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    build_tiny_tokenizer(TINY_VOCAB_SIZE, 1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=field):
        LLM(str(tmp_path), load_format="dummy", **KW)
