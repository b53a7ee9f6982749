"""More vision-language wrappers served text-only (models/multimodal_text.py) against HF.

As tests/engine/test_models_vlm_text.py: a tiny random wrapper (`*ForConditionalGeneration`,
a one-layer vision tower included) saved by transformers; `LLM.generate` on text prompts must
give the wrapper's HF `generate` greedy tokens and top-5 logprobs (1e-3, float32). The cases
make the mapping's details bite: Command A Vision's wrapper drops the text model's logit_scale
(0.5 in the tiny Cohere 2 config) while Aya Vision's applies it; Kimi K2.5's DeepSeek-V3
decoder (a dense layer before MoE ones) is tied by the wrapper's flag, not its text config's;
EXAONE 4.5's text positions stay 1-D (sliding window 8, llama3 rope); MiniCPM-V's M-RoPE
sections are the plain rope on text; Ovis 2.5 loads in its Hub naming (`llm.`,
`visual_tokenizer.`, `vte.`: what transformers 5 saves) and in transformers 5's in-memory one.
"""

from __future__ import annotations

import pytest
import torch
from hf_parity import assert_serves_like_hf, checkpoint_dirs, load_hf_as_saved, write_hf_checkpoint
from hf_reference import assert_tp_matches_one_process
from test_models_vlm_text import (
    _LLAMA_LIKE,
    _QWEN_VISION,
    _SMALL_VISION,
    _generate,
    _prompts,
    _rename,
    _text,
)

from paged_engine.loader import load_hf_config, resolve_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS = 10


def _siglip() -> dict:
    return {**_SMALL_VISION, "model_type": "siglip_vision_model"}


def _aya_vision(**top) -> tuple[str, object]:
    # the wrapper multiplies its logits by text_config.logit_scale (0.5), as Cohere2 does
    config = transformers.AyaVisionConfig(
        text_config=_text("cohere2"),
        vision_config=_siglip(),
        image_token_index=500,
        alignment_intermediate_size=64,
        **top,
    )
    return "AyaVisionForConditionalGeneration", config


def _cohere2_vision(**top) -> tuple[str, object]:
    # logit_scale 0.5 in the text config, which this wrapper does not apply
    config = transformers.Cohere2VisionConfig(
        text_config=_text("cohere2"),
        vision_config=_siglip(),
        image_token_id=500,
        alignment_intermediate_size=64,
        **top,
    )
    return "Cohere2VisionForConditionalGeneration", config


def _exaone4_5(**top) -> tuple[str, object]:
    vision = {**_QWEN_VISION, "fullatt_block_indexes": [0], "window_size": 56}
    vision |= {"num_key_value_heads": 2}
    config = transformers.Exaone4_5_Config(
        text_config=_text("exaone4"),
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        **top,
    )
    return "Exaone4_5_ForConditionalGeneration", config


def _hunyuan_vl(**top) -> tuple[str, object]:
    """HunyuanOCR: Hunyuan's dense decoder (q / k norms after rope) with its "xdrope" rope,
    dynamic NTK by alpha 1000 over four M-RoPE axes of 4 frequencies each (head_dim 32)."""
    rope = {
        "rope_type": "xdrope",
        "rope_theta": 10_000.0,
        "alpha": 1000.0,
        "factor": 1.0,
        "mrope_section": [4, 4, 4, 4],
    }
    text = transformers.HunYuanVLTextConfig(
        **{**_LLAMA_LIKE, "max_position_embeddings": 256},
        head_dim=32,
        attention_bias=True,
        rope_parameters=rope,
        tie_word_embeddings=False,
    ).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "out_hidden_size": 64,
        "text_hidden_size": 64,
        "max_image_size": 64,
        "min_image_size": 32,
    }
    config = transformers.HunYuanVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=500,
        im_start_id=501,
        im_end_id=502,
        im_newline_id=503,
        **top,
    )
    return "HunYuanVLForConditionalGeneration", config


def _idefics2(**top) -> tuple[str, object]:
    perceiver = {
        "hidden_size": 64,
        "resampler_n_latents": 4,
        "resampler_depth": 1,
        "resampler_n_heads": 2,
        "resampler_head_dim": 16,
        "num_key_value_heads": 1,
    }
    config = transformers.Idefics2Config(
        text_config=_text("mistral"),  # sliding window 32
        vision_config=_SMALL_VISION,
        perceiver_config=perceiver,
        image_token_id=500,
        **top,
    )
    return "Idefics2ForConditionalGeneration", config


def _kimi_k25(**top) -> tuple[str, object]:
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
    }
    config = transformers.Kimi_K25Config(
        text_config=_text("deepseek_v3", tie_word_embeddings=False),
        vision_config=vision,
        projection_hidden_size=32,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        **top,
    )
    return "Kimi_K25ForConditionalGeneration", config


def _lfm3_vl(**top) -> tuple[str, object]:
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    config = transformers.Lfm3VlConfig(
        text_config=_text("lfm3"),
        vision_config=vision,
        projector_hidden_size=64,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        **top,
    )
    return "Lfm3VlForConditionalGeneration", config


def _minicpmv(version: str, **top) -> tuple[str, object]:
    text = _text("qwen3_5")
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    vision = {**_SMALL_VISION, "num_hidden_layers": 2, "insert_layer_id": 0}
    name = f"MiniCPMV{version}"
    config = getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        image_size=28,
        image_token_id=500,
        video_token_id=501,
        **top,
    )
    return f"{name}ForConditionalGeneration", config


def _ovis2_5(**top) -> tuple[str, object]:
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "vocab_size": 64,
        "window_size": 56,
    }
    config = transformers.Ovis2_5Config(
        text_config=_text("qwen3", tie_word_embeddings=False),
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        image_start_token_id=502,
        image_end_token_id=503,
        video_start_token_id=504,
        video_end_token_id=505,
        **top,
    )
    return "Ovis2_5ForConditionalGeneration", config


_GLM_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "image_size": 28,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _glm4v(name: str, **top) -> tuple[str, object]:
    """GLM-4.1V (`Glm4v`) or GLM-4.6V (`Glm46V`): GLM-4's decoder, interleaved partial rope
    (8 of head_dim 16's dims: M-RoPE sections 1, 1, 2 of its 4 frequencies)."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [1, 1, 2],
    }
    text = transformers.Glm4vTextConfig(**_LLAMA_LIKE, rope_parameters=rope).to_dict()
    config = getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config={**_GLM_VISION, "model_type": "glm4v_vision"},
        image_token_id=500,
        video_token_id=501,
        image_start_token_id=502,
        image_end_token_id=503,
        video_start_token_id=504,
        video_end_token_id=505,
        **top,
    )
    return f"{name}ForConditionalGeneration", config


def _glm4v_moe(**top) -> tuple[str, object]:
    """GLM-4.5V: GLM-4.5's MoE decoder (a dense first layer, sigmoid router with a correction
    bias, shared expert), NeoX partial rope; use_qk_norm True in its text config, which the
    wrapper's attention does not read."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [1, 1, 2],
    }
    text = transformers.Glm4vMoeTextConfig(
        **{**_LLAMA_LIKE, "num_hidden_layers": 3},
        rope_parameters=rope,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.0,
    ).to_dict()
    text["use_qk_norm"] = True
    config = transformers.Glm4vMoeConfig(
        text_config=text,
        vision_config={**_GLM_VISION, "model_type": "glm4v_moe_vision"},
        image_token_id=500,
        video_token_id=501,
        image_start_token_id=502,
        image_end_token_id=503,
        video_start_token_id=504,
        video_end_token_id=505,
        **top,
    )
    return "Glm4vMoeForConditionalGeneration", config


_OMNI_AUDIO = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "output_dim": 64,
    "n_window": 4,
    "max_source_positions": 32,
}


def _qwen2_5_omni(whole: bool, **top) -> tuple[str, object]:
    """Qwen2.5-Omni's thinker: a Qwen2 decoder with M-RoPE (sections 2, 3, 3 of head_dim 16)
    and sliding-window layers (8 tokens) from layer 1; the whole model without its talker."""
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    text = transformers.Qwen2_5OmniTextConfig(
        **_LLAMA_LIKE,
        rope_parameters=rope,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        tie_word_embeddings=False,
    ).to_dict()
    vision = {**_QWEN_VISION, "fullatt_block_indexes": [0], "window_size": 56}
    thinker = transformers.Qwen2_5OmniThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=_OMNI_AUDIO,
        audio_token_index=500,
        image_token_index=501,
        video_token_index=502,
        audio_start_token_id=503,
        audio_end_token_id=504,
        vision_start_token_id=505,  # read by the thinker's rope index (not a config field)
        **top,
    )
    if not whole:
        return "Qwen2_5OmniThinkerForConditionalGeneration", thinker
    config = transformers.Qwen2_5OmniConfig(
        thinker_config=thinker.to_dict(), enable_audio_output=False
    )
    return "Qwen2_5OmniForConditionalGeneration", config


def _qwen3_omni(whole: bool, **top) -> tuple[str, object]:
    """Qwen3-Omni's thinker: Qwen3-MoE (layer 1 dense, top-k unnormalized) with interleaved
    M-RoPE."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    text = transformers.Qwen3OmniMoeTextConfig(
        **{**_LLAMA_LIKE, "num_hidden_layers": 3},
        head_dim=32,
        rope_parameters=rope,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ).to_dict()
    vision = {**_QWEN_VISION, "depth": 2, "num_position_embeddings": 16}
    vision["deepstack_visual_indexes"] = [0]
    audio = {**_OMNI_AUDIO, "downsample_hidden_size": 16, "n_window_infer": 8}
    thinker = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        audio_token_id=500,
        image_token_id=501,
        video_token_id=502,
        audio_start_token_id=503,
        vision_start_token_id=505,
        **top,
    )
    if not whole:
        return "Qwen3OmniMoeThinkerForConditionalGeneration", thinker
    config = transformers.Qwen3OmniMoeConfig(
        thinker_config=thinker.to_dict(), enable_audio_output=False
    )
    return "Qwen3OmniMoeForConditionalGeneration", config


# name -> (builder of (wrapper class name, config), the text class we serve it with)
CASES = {
    "aya_vision": (lambda: _aya_vision(), "Cohere2ForCausalLM"),
    "cohere2_vision": (lambda: _cohere2_vision(), "Cohere2ForCausalLM"),
    "exaone4_5": (lambda: _exaone4_5(), "Exaone4ForCausalLM"),
    "glm4v": (lambda: _glm4v("Glm4v"), "Glm4ForCausalLM"),
    "glm46v": (lambda: _glm4v("Glm46V", tie_word_embeddings=True), "Glm4ForCausalLM"),
    "glm4v_moe": (lambda: _glm4v_moe(), "Glm4MoeForCausalLM"),
    "hunyuan_vl": (lambda: _hunyuan_vl(tie_word_embeddings=True), "HunYuanVLTextForCausalLM"),
    "idefics2": (lambda: _idefics2(), "MistralForCausalLM"),
    # the text config says untied, the wrapper's flag (True) ties lm_head to the embeddings
    "kimi_k25": (lambda: _kimi_k25(tie_word_embeddings=True), "DeepseekV3ForCausalLM"),
    "lfm3_vl": (lambda: _lfm3_vl(), "Lfm3ForCausalLM"),
    "minicpmv4_6": (lambda: _minicpmv("4_6"), "Qwen3_5ForCausalLM"),
    "minicpmv4_7": (lambda: _minicpmv("4_7"), "Qwen3_5ForCausalLM"),
    "ovis2_5": (lambda: _ovis2_5(), "Qwen3ForCausalLM"),
    "qwen2_5_omni_thinker": (lambda: _qwen2_5_omni(False), "Qwen2ForCausalLM"),
    "qwen2_5_omni": (lambda: _qwen2_5_omni(True), "Qwen2ForCausalLM"),
    "qwen3_omni_thinker": (lambda: _qwen3_omni(False), "Qwen3MoeForCausalLM"),
    "qwen3_omni": (lambda: _qwen3_omni(True), "Qwen3MoeForCausalLM"),
}


def write_tiny_wrapper(path, name: str, seed: int = 0):
    """A tiny random wrapper checkpoint (as transformers saves it), tokenizer and generation
    config in `path`; skipped where the installed transformers lacks the wrapper."""
    if not hasattr(transformers, _CONFIGS[name]):
        pytest.skip(f"transformers {transformers.__version__} has no {_CONFIGS[name]}")
    cls_name, config = CASES[name][0]()
    write_hf_checkpoint(path, getattr(transformers, cls_name), config, seed)
    if config.model_type in ("qwen2_5_omni", "qwen3_omni_moe"):  # the whole Omni model
        torch.save({}, path / "spk_dict.pt")  # loads its talker's speakers
    return path


_CONFIGS = {
    "aya_vision": "AyaVisionConfig",
    "cohere2_vision": "Cohere2VisionConfig",
    "exaone4_5": "Exaone4_5_Config",
    "glm4v": "Glm4vConfig",
    "glm46v": "Glm46VConfig",
    "glm4v_moe": "Glm4vMoeConfig",
    "hunyuan_vl": "HunYuanVLConfig",
    "idefics2": "Idefics2Config",
    "kimi_k25": "Kimi_K25Config",
    "lfm3_vl": "Lfm3VlConfig",
    "minicpmv4_6": "MiniCPMV4_6Config",
    "minicpmv4_7": "MiniCPMV4_7Config",
    "ovis2_5": "Ovis2_5Config",
    "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerConfig",
    "qwen2_5_omni": "Qwen2_5OmniConfig",
    "qwen3_omni_thinker": "Qwen3OmniMoeThinkerConfig",
    "qwen3_omni": "Qwen3OmniMoeConfig",
}


@pytest.fixture(scope="module")
def wrapper_dirs(tmp_path_factory):
    """name -> a tiny wrapper checkpoint, written once per module."""
    return checkpoint_dirs(tmp_path_factory, lambda path, name: write_tiny_wrapper(path, name, 1))


def _assert_matches_hf_wrapper(name: str, path) -> None:
    hf = load_hf_as_saved(path)
    # the whole Omni model has no forward of its own: its generate, without audio output,
    # is its thinker's
    ref_model = hf.thinker if hasattr(hf, "thinker") else hf
    llm = assert_serves_like_hf(name, path, _prompts(name), MAX_TOKENS, hf=ref_model)
    model = llm.llm_engine.model_runner.model
    assert model.tie_word_embeddings == bool(ref_model.config.tie_word_embeddings)


@pytest.mark.parametrize("name", list(CASES))
def test_text_only_generation_matches_hf_wrapper(name, wrapper_dirs):
    path = wrapper_dirs(name)
    config = load_hf_config(resolve_model(path))
    assert config.architectures == [CASES[name][1]]
    _assert_matches_hf_wrapper(name, path)


# transformers 5 saves Ovis 2.5 in its Hub naming (the language model under `llm.`, the visual
# tokenizer under `visual_tokenizer.`, its embedding table as `vte.`); rewritten into the
# in-memory naming (`model.language_model.`, `model.vision_tower.`, ...), it loads alike.
_OVIS_MEMORY_NAMING = [
    ("llm.model.", "model.language_model."),
    ("llm.lm_head.", "lm_head."),
    ("visual_tokenizer.vit.vision_model.", "model.vision_tower."),
    ("visual_tokenizer.head.", "model.multi_modal_projector.visual_tokenizer."),
    ("vte.", "model.multi_modal_projector.visual_embeddings_table."),
]


def test_ovis_either_naming_loads(wrapper_dirs, tmp_path):
    original = wrapper_dirs("ovis2_5")
    saved = set(safetensors_torch.load_file(str(original / "model.safetensors")))
    assert {"llm.lm_head.weight", "vte.weight"} <= saved
    path = write_tiny_wrapper(tmp_path, "ovis2_5", seed=1)
    _rename(path, _OVIS_MEMORY_NAMING)
    names = set(safetensors_torch.load_file(str(path / "model.safetensors")))
    assert "lm_head.weight" in names and not any(n.startswith(("llm.", "vte.")) for n in names)
    prompts = _prompts("ovis-naming", 2)
    hf = load_hf_as_saved(original)
    assert_serves_like_hf("ovis2_5 in-memory naming", path, prompts, MAX_TOKENS, hf=hf)


def test_omni_talker_and_vocoder_dropped(wrapper_dirs, tmp_path):
    """The whole Omni model's checkpoint also holds its talker and vocoder (speech output):
    dropped by name, the thinker's outputs unchanged."""
    from test_models_vlm_text import _outputs_equal

    original = wrapper_dirs("qwen2_5_omni")
    path = write_tiny_wrapper(tmp_path, "qwen2_5_omni", seed=1)
    file = path / "model.safetensors"
    state = safetensors_torch.load_file(str(file))
    extra = ("talker.model.layers.0.mlp.up_proj.weight", "token2wav.code2wav_dit_model.x")
    state |= {n: torch.randn(4, 4) for n in extra}
    safetensors_torch.save_file(state, str(file), metadata={"format": "pt"})
    prompts = _prompts("omni-talker", 2)
    _, want = _generate(original, prompts)
    _, got = _generate(path, prompts)
    _outputs_equal(got, want)


def test_refused_text_configs():
    from paged_engine.models.multimodal_text import text_only_config

    _, config = _qwen3_omni(True)
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    assert text_only_config(config).architectures == ["Qwen3MoeForCausalLM"]
    config.thinker_config.text_config.sliding_window = 8  # HF's cache would keep only 8
    with pytest.raises(ValueError, match=r"text_config\.sliding_window is set"):
        text_only_config(config)
    _, config = _glm4v("Glm4v")
    config.architectures = ["Glm4vForConditionalGeneration"]
    text = text_only_config(config)
    assert text.attention_bias is True  # the wrapper's q / k / v always have biases
    config.text_config.head_dim = 32  # 64 // 4 = 16 is what the attention uses
    with pytest.raises(ValueError, match=r"text_config.head_dim 32"):
        text_only_config(config)


@pytest.mark.parametrize("name", ["qwen3_omni", "kimi_k25"])
def test_tensor_parallel_matches_one_process(name, wrapper_dirs):
    """TP=2: the worker processes read the thinker's text config (Qwen3-Omni's sub-config)
    and map the wrapper's own names (Kimi K2.5's `blocks`) as the first process does."""
    assert_tp_matches_one_process(wrapper_dirs(name), _prompts("tp", 2), 6, max_model_len=64)


def test_multi_modal_data_is_refused(wrapper_dirs):
    from paged_engine import LLM, SamplingParams

    llm = LLM(model=str(wrapper_dirs("kimi_k25")), dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
