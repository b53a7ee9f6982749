"""Config fields a model type's transformers code never reads, set to the value it runs with.

A config.json may carry a field its model type's transformers modeling ignores (GLM-4's
`mlp_bias`, Mistral's `attention_bias`, ...): HF then builds what the table below says whatever
the file holds, and so does paged. `with_effective_fields` writes those values onto the loaded
config (loader.py: on load and again after hf_overrides), so every model, layer and worker reads
the effective value and no model special-cases the flag. The rope analogue, a
partial_rotary_factor that transformers' rope never reads, is layers/rotary.py
WHOLE_HEAD_ROPE_MODEL_TYPES.

Only whole-field overrides live here. A model whose transformers code reads a field for some
projections only keeps that split in its own layer flags: GLM-4's, GLM-4.5's and dots.llm1's
q / k / v biases follow `attention_bias` while o_proj never has one (models/glm4.py,
models/glm4_moe.py `o_bias`).
"""

from __future__ import annotations

from typing import Any

_NO_BIASES: dict[str, Any] = {"attention_bias": False, "mlp_bias": False}
_NO_ATTENTION_BIAS: dict[str, Any] = {"attention_bias": False}
_NO_MLP_BIAS: dict[str, Any] = {"mlp_bias": False}

# model_type -> {field: the value transformers' modeling effectively uses}. Types transformers
# lacks (remote-code releases, paged's own text-config types) follow the release's own code.
IGNORED_FIELDS: dict[str, dict[str, Any]] = {
    # no biases anywhere in attention or MLP
    "mistral": _NO_BIASES,
    "ministral": _NO_BIASES,
    "ministral3": _NO_BIASES,
    "voxtral_realtime_text": _NO_BIASES,
    "phi3": _NO_BIASES,
    "phi3_v": _NO_BIASES,  # remote code: Phi-3's decoder
    "phi4_multimodal": _NO_BIASES,
    "exaone4": _NO_BIASES,
    # attention without biases; the MLP reads mlp_bias (CWM's) or has no such field
    "cwm": _NO_ATTENTION_BIAS,
    "mixtral": _NO_ATTENTION_BIAS,
    "minimax": _NO_ATTENTION_BIAS,
    "minimax_text_01": _NO_ATTENTION_BIAS,  # the MiniMax-01 release's config (remote code)
    "minimax_m1": _NO_ATTENTION_BIAS,  # the MiniMax-M1 release's config (remote code)
    "minimax_m2": _NO_ATTENTION_BIAS,
    "lfm2": _NO_ATTENTION_BIAS,  # LFM3's attention reads it
    "lfm2_moe": _NO_ATTENTION_BIAS,
    "nemotron_h": _NO_ATTENTION_BIAS,  # its layer flags are fixed too (models/nemotron_h.py)
    "deepseek_v4": _NO_ATTENTION_BIAS,  # its MLA reads no such field (models/deepseek_v4.py)
    "exaone_moe": _NO_ATTENTION_BIAS,
    "kolibri1": _NO_ATTENTION_BIAS,
    "kolibri1_1": _NO_ATTENTION_BIAS,
    # MLPs (dense, shared and routed experts) without biases; attention reads attention_bias
    "olmo": _NO_MLP_BIAS,
    "glm": _NO_MLP_BIAS,  # Helium's MLP reads it
    "glm4": _NO_MLP_BIAS,
    "glm4v_text": _NO_MLP_BIAS,  # GLM-4.1V / 4.6V's decoder
    "glm_ocr_text": _NO_MLP_BIAS,
    "chatglm": _NO_MLP_BIAS,  # remote code: its MLP biases are add_bias_linear's (chatglm.py)
    # DeepSeek-style MoE models (layers/deepseek_moe.py): DeepSeek-V2's MLPs read mlp_bias
    "deepseek_v3": _NO_MLP_BIAS,
    "deepseek_v32": _NO_MLP_BIAS,
    "dots1": _NO_MLP_BIAS,
    "glm4_moe": _NO_MLP_BIAS,
    "glm4_moe_lite": _NO_MLP_BIAS,
    "glm_moe_dsa": _NO_MLP_BIAS,
    "kimi_linear": _NO_MLP_BIAS,
    "minicpm5_moe": _NO_MLP_BIAS,
    "mistral4": _NO_MLP_BIAS,
    "solar_open": _NO_MLP_BIAS,
    "axk1": _NO_MLP_BIAS,
    "axk2": _NO_MLP_BIAS,
    "hy_v4": _NO_MLP_BIAS,
    "bailing_hybrid": _NO_MLP_BIAS,
}


def with_effective_fields(config):
    """`config` (an HF config, changed in place and returned) with each field its model type's
    transformers code never reads set to the value that code runs with."""
    for name, value in IGNORED_FIELDS.get(getattr(config, "model_type", None), {}).items():
        setattr(config, name, value)
    return config
