"""Granite 4 Vision, Granite Docling, Muse Spark and Muse Glimmer served text-only
(models/text_wrappers.py rows; Muse's decoders: models/muse.py) against HF.

As tests/engine/test_models_vlm_text.py: a tiny random wrapper (vision tower, projectors and
Muse Spark's audio tower included) saved by transformers; `LLM.generate` on text prompts must
give the wrapper's HF `generate` greedy tokens and top-5 logprobs (1e-3, float32). The cases
make the details bite: Granite's four multipliers are not 1 (the wrappers divide by
logits_scaling themselves), Granite Docling ties its head while Granite 4 Vision does not;
Muse's layers mix sliding (window 8) and full attention, rope and NoPE layers, Spark's MLPs
dense and sparse (pooled experts with a per-expert output norm, a sigmoid router with a
balance bias and a scaling factor), and the prompts hold the media placeholder ids, which
the wrappers embed as id 0.
"""

from __future__ import annotations

import random

import pytest
from hf_parity import assert_serves_like_hf, load_hf_as_saved, write_hf_checkpoint
from test_models_vlm_text import _LLAMA_LIKE, PROMPT_IDS, VOCAB

from paged_engine.loader import load_hf_config, resolve_model
from paged_engine.testing import _COMMON

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
IMAGE, VIDEO, AUDIO = 500, 501, 502  # Muse's placeholder ids: embedded as id 0

# Granite's scalars, none of them 1
_GRANITE = {
    **_LLAMA_LIKE,
    "embedding_multiplier": 6.0,
    "logits_scaling": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
}


def _granite4_vision() -> object:
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    return transformers.Granite4VisionConfig(
        text_config=_GRANITE,
        vision_config=vision,
        image_token_index=IMAGE,
        deepstack_layer_map=[[0, 1]],
        downsample_rate="1/2",
        spatial_target_layers=[0, 1, 0, 1],
        image_grid_pinpoints=[[28, 28]],
    )


def _granite_docling() -> object:
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
        "out_hidden_size": 64,
        "scale_factor": 2,
        "deepstack_visual_indexes": [0],
    }
    return transformers.GraniteDoclingConfig(
        text_config=_GRANITE,
        vision_config=vision,
        image_token_id=IMAGE,
        pad_token_id=0,
        density_router_hidden_size=16,
    )


_MUSE_VISION = {
    "patch_size": 14,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
}
# 5 layers: layer_types / layer_rope_theta default to full + NoPE on every 4th counted back
# from the last (layers 0 and 4), sliding + rope elsewhere
_MUSE_TEXT = {
    **_COMMON,
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "sliding_window": 8,
    "final_logit_softcapping": 3.0,
    "qk_scale_factor": 2.5,
    "output_multiplier": 0.7,
    "post_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def _muse_top() -> dict:
    return {
        "image_token_id": IMAGE,
        "video_token_id": VIDEO,
        "out_hidden_size": 128,
        "projector_hidden_size": 64,
    }


def _muse_spark() -> object:
    text = {
        **_MUSE_TEXT,
        "moe_intermediate_size": 24,
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "moe_hidden_size": 48,
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse"],
        "residual_gate_temperature": 0.5,
    }
    audio = {
        "patch_sizes": [4, 2],
        "hidden_sizes": [16, 32],
        "depths": [1, 1],
        "num_hidden_layers": 2,
        "out_hidden_size": 64,
    }
    return transformers.MuseSparkConfig(
        text_config=text,
        vision_config=_MUSE_VISION,
        audio_config=audio,
        audio_token_id=AUDIO,
        **_muse_top(),
    )


def _muse_glimmer() -> object:
    return transformers.MuseGlimmerConfig(
        text_config=_MUSE_TEXT, vision_config=_MUSE_VISION, **_muse_top()
    )


def _muse_glimmer_variant() -> object:
    # HF reads layer_rope_theta as zero / non-zero only (the global rope_theta on every rope
    # layer); a GELU MLP, q / k / v / o biases; the head tied by the wrapper's flag (by default
    # its config has none, and text_config's does not tie)
    text = {
        **_MUSE_TEXT,
        "layer_rope_theta": [500.0, 0, 10000.0, 0, 7.0],
        "layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": True,
    }
    return transformers.MuseGlimmerConfig(
        text_config=text, vision_config=_MUSE_VISION, tie_word_embeddings=True, **_muse_top()
    )


# name -> (config, wrapper class, our text class)
CASES = {
    "granite4_vision": (_granite4_vision, "Granite4VisionForConditionalGeneration", "Granite"),
    "granite_docling": (_granite_docling, "GraniteDoclingForConditionalGeneration", "Granite"),
    "muse_spark": (_muse_spark, "MuseSparkForConditionalGeneration", "MuseSparkText"),
    "muse_glimmer": (_muse_glimmer, "MuseGlimmerForConditionalGeneration", "MuseGlimmerText"),
    "muse_glimmer_variant": (
        _muse_glimmer_variant,
        "MuseGlimmerForConditionalGeneration",
        "MuseGlimmerText",
    ),
}


def write_tiny_wrapper(path, name: str, seed: int = 0):
    make, cls_name, _ = CASES[name]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return write_hf_checkpoint(path, getattr(transformers, cls_name), make(), seed)


def _prompts(name: str) -> list[list[int]]:
    """Prompts of 12-30 ids; Muse's hold the placeholder ids too (embedded as id 0)."""
    rng = random.Random(name)
    prompts = [[rng.choice(PROMPT_IDS) for _ in range(rng.randint(12, 30))] for _ in range(2)]
    if name.startswith("muse"):
        prompts[0][3:5] = [IMAGE, VIDEO]
        prompts[1][-4] = AUDIO if name == "muse_spark" else IMAGE
    return prompts


@pytest.mark.parametrize("name", list(CASES))
def test_text_only_generation_matches_hf_wrapper(name, tmp_path):
    path = write_tiny_wrapper(tmp_path / name, name, seed=1)
    assert load_hf_config(resolve_model(path)).architectures == [f"{CASES[name][2]}ForCausalLM"]
    hf = load_hf_as_saved(path)
    llm = assert_serves_like_hf(name, path, _prompts(name), MAX_TOKENS, hf=hf)
    # tied as HF ties (Muse Spark's wrapper never ties, whatever its config says)
    tied = hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert llm.llm_engine.model_runner.model.tie_word_embeddings == tied


def _muse_text(name: str):
    from paged_engine.models.multimodal_text import text_only_config

    config = CASES[name][0]()
    config.architectures = [CASES[name][1]]
    return text_only_config(config)


def test_muse_config_carries_placeholder_ids():
    text = _muse_text("muse_spark")
    assert text.architectures == ["MuseSparkTextForCausalLM"]
    assert (text.image_token_id, text.video_token_id, text.audio_token_id) == (IMAGE, VIDEO, AUDIO)
    assert getattr(_muse_text("muse_glimmer"), "audio_token_id", None) is None


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("layer_types", ["chunked_attention"] * 5, r"layer_types \['chunked_attention'\]"),
        ("layer_rope_theta", [0.0, 1.0], r"layer_rope_theta needs one entry a layer"),
        ("mlp_layer_types", ["dense", "moe", "sparse", "dense", "sparse"], r"\['moe'\]"),
        ("final_logit_softcapping", 0.0, "final_logit_softcapping"),
        ("sliding_window", None, "need config.sliding_window"),
        ("hidden_act", "gelu", "hidden_act='silu' only"),
        (
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "partial",
        ),
    ],
)
def test_muse_refuses_what_it_cannot_run(field, value, match):
    from paged_engine.models.muse import check_muse_config

    text = _muse_text("muse_spark")
    check_muse_config(text, "MuseSparkTextForCausalLM", spark=True)
    object.__setattr__(text, field, value)
    with pytest.raises(ValueError, match=match):
        check_muse_config(text, "MuseSparkTextForCausalLM", spark=True)


def test_muse_spark_tensor_parallel_matches_one_process(tmp_path):
    """TP=2: heads, the dense MLPs and the experts' intermediate dim split; the pooling
    projections and router replicated, each route all-reduced before its norm."""
    from hf_reference import assert_tp_matches_one_process

    path = write_tiny_wrapper(tmp_path / "muse_spark", "muse_spark", seed=1)
    assert_tp_matches_one_process(path, _prompts("muse_spark"), 6, max_model_len=64)
