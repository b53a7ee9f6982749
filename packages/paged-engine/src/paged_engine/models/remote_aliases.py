"""Hub checkpoints that ship their own (remote) model code, served by our classes without
running it: their config.json is read as JSON and translated here into a config our model class
reads, whatever `trust_remote_code` says (vLLM's registry maps the same names; it parses RW /
MPT configs itself and runs the others' remote config code).

    config.json architecture       model_type                   our class
    RWForCausalLM                  RefinedWeb / RefinedWebModel FalconForCausalLM (falcon.py)
    StableLMEpochForCausalLM       stablelm_epoch               StableLmForCausalLM (stablelm.py)
    QWenLMHeadModel                qwen                         QWenLMHeadModel (qwen_v1.py)
      (with a `visual` section)    qwen                         QwenVLForConditionalGeneration
                                                                (Qwen-VL v1: models/
                                                                qwen_vl_v1_config.py; images:
                                                                multimodal/qwen_vl_v1.py)
    BaichuanForCausalLM,           baichuan                     models/baichuan.py
      BaiChuanForCausalLM
    TeleChat2ForCausalLM,          telechat                     models/telechat2.py
      TeleChatForCausalLM
    Phi3VForCausalLM               phi3_v                       Phi-3's (models/phi3v_config.py;
                                                                images: multimodal/phi3v.py)
    KimiVLForConditionalGeneration kimi_vl                      DeepSeek-V3's (config:
                                                                models/kimi_vl_config.py;
                                                                images: multimodal/kimi_vl.py)
    Phi4MMForCausalLM              phi4mm                       transformers' Phi4Multimodal
                                                                (models/phi4mm_config.py; the
                                                                rest: multimodal/phi4mm_remote.py)
    LightOnOCRForConditionalGeneration  mistral3                LightOnOcr's (vLLM's name;
                                                                models/hub_vlm_configs.py)
    InternS1ForConditionalGeneration  interns1                  InternVL's (models/
                                                                hub_vlm_configs.py)
    Ovis2_5                        ovis2_5                      transformers' Ovis2_5 (models/
                                                                ovis2_5_hub.py; images:
                                                                multimodal/ovis2_5_hub.py)
    NewModel,                      new                          models/gte.py (GTE v1.5 / mGTE)
      NewForSequenceClassification
    NomicBertModel (GPT-2 names)   nomic_bert                   models/nomic_bert.py
    XLMRobertaModel (rotary)       xlm-roberta                  models/jina_embeddings_v3.py
    LlamaBidirectionalModel,       llama_bidirec                models/llama_bidirectional.py
      LlamaBidirectionalForSequenceClassification
    BailingMoeForCausalLM,         bailing_moe (v1), or         models/bailing_moe.py (GLM-4.5's
      BailingMoeV2ForCausalLM      bailing_moe_v2               decoder under Ling's names)
    (any; llava around qwen2_vl)   llava                        Tarsier2ForConditionalGeneration:
                                                                Qwen2-VL's (tarsier2_config.py)
    TeleFLMForCausalLM             (Tele-FLM's)                 models/llama_remote.py
    PanguEmbeddedForCausalLM       PanguEmbedded                models/llama_remote.py
    PanguProMoEForCausalLM         PanGuMoE                     models/pangu_pro_moe.py (MoGE
                                                                routing, a shared expert)
    PanguUltraMoEForCausalLM,      pangu_ultra_moe (any)        models/openpangu_moe.py (MLA,
      PanguProMoEV2ForCausalLM                                  sigmoid routing, sandwich norms)
    DeepseekForCausalLM            deepseek                     models/deepseek_v1.py
    ArcticForCausalLM              arctic                       models/arctic.py
    Grok1ModelForCausalLM,         grok-1 (any)                 models/grok1.py
      Grok1ForCausalLM
    DeepseekOCRForCausalLM         deepseek_vl_v2               DeepSeek-OCR-2's decoder (config:
                                                                models/deepseek_ocr_v1_config.py;
                                                                images: deepseek_ocr_v1.py)
    DotsOCRForCausalLM             dots_ocr                     Qwen2's (config: models/
                                                                dots_ocr_config.py; images:
                                                                multimodal/dots_ocr.py)
    OpenCUAForConditionalGeneration opencua                     Qwen2's at 1-D positions (config:
                                                                models/opencua_config.py;
                                                                images: multimodal/opencua.py)
    MiniCPMV                       minicpmv                     Qwen2 / Qwen3 (config: models/
                                                                minicpmv_remote_config.py;
                                                                images: minicpmv_remote.py)
    MiniCPMO                       minicpmo                     Qwen2 (config: models/
                                                                minicpmo_remote_config.py;
                                                                audio: minicpmo_remote.py)
    MiDashengLMModel               midashenglm                  Qwen2 (config: models/
                                                                midashenglm_config.py;
                                                                audio: midashenglm.py)
    MoonshotKimiaForCausalLM       kimi_audio                   Qwen2 (config: models/
                                                                kimi_audio_config.py;
                                                                audio: kimi_audio.py)
    ChatGLMModel (with a           chatglm                      ChatGLM's (GLM-4V: config
      vision_config)                                            models/glm4v_remote_config.py;
                                                                images: glm4v_remote.py)
    DeepseekVLV2ForCausalLM        deepseek_vl_v2               DeepSeek-V2's, MHA or MLA (config:
                                                                models/deepseek_vl2_config.py;
                                                                images: deepseek_vl2.py)
    MolmoForCausalLM               molmo                        Qwen2's or OLMo 2's under the
                                                                release's names (config: models/
                                                                molmo_v1_config.py; decoder:
                                                                models/molmo_v1.py; images:
                                                                multimodal/molmo_v1.py); MolmoE
                                                                (block_type "moe"): OLMoE's
                                                                (models/molmoe_config.py,
                                                                molmoe.py)
    NemotronH_Nano_VL_V2           NemotronH_Nano_VL_V2         Nemotron-H's (config: models/
                                                                nemotron_nano_vl_config.py;
                                                                images: nemotron_nano_vl.py)
    Llama_Nemotron_Nano_VL         Llama_Nemotron_Nano_VL       Llama's (config: models/
                                                                nemotron_vl_v1_config.py;
                                                                images: nemotron_vl_v1.py)
    SolarForCausalLM               solar                        models/solar.py (Llama with
                                                                block skip connections)
    OuroForCausalLM                ouro                         models/ouro.py (a looped stack)
    MiniMaxVL01ForConditionalGeneration  minimax_vl_01          LLaVA-NeXT's, MiniMax-Text-01
                                                                (models/minimax_vl_01_config.py;
                                                                images: minimax_vl_01.py)
    BeeForConditionalGeneration    bee                          LLaVA-OneVision's, Qwen3 (config:
                                                                models/bee_config.py; images:
                                                                multimodal/bee.py)
    JAISLMHeadModel                jais                         models/jais.py (GPT-2 with SwiGLU,
                                                                ALiBi, muP scalars)
    Plamo2ForCausalLM              plamo2                       models/plamo2.py (Mamba-style mixers
                                                                among sliding-window attention)
    Plamo3ForCausalLM              plamo3                       models/plamo3.py (sliding-window and
                                                                full attention, sandwich norms)
    IsaacForConditionalGeneration  isaac                        Qwen3 with M-RoPE (config: models/
                                                                isaac_config.py; images:
                                                                multimodal/isaac.py)
    Step3TextForCausalLM,          step3_text / step3_vl        models/step3_text.py (MFA attention,
      Step3VLForConditionalGeneration                           MoE with a shared expert; the VL
                                                                release's config models/
                                                                step3_vl_config.py, images
                                                                multimodal/step3_vl.py)
    KeyeForConditionalGeneration   Keye                         Qwen3 with M-RoPE (config: models/
                                                                keye_config.py; images:
                                                                multimodal/keye.py)
    KeyeVL1_5ForConditionalGeneration  the same                 the same (Keye-VL-1.5: its
                                                                merged-row projector, images)
    HCXVisionForCausalLM           hyperclovax_vlm              Llama's or HyperCLOVA X's, text
                                                                only (config: models/
                                                                hcx_vision_v1_config.py)

Qwen2_5OmniModel (Qwen2.5-Omni-7B's config.json, the preview's class name) is read by
transformers and renamed Qwen2_5OmniForConditionalGeneration, which the text, image, video and
audio tables know (this module is asked before transformers wherever the engine reads the
checkpoint's config). MPTForCausalLM and PhiMoEForCausalLM need no translation (transformers
reads their model types "mpt" / "phimoe"): models/__init__.py maps the names alone. A
falcon-7b / 40b checkpoint already re-saved with model_type "falcon" loads through transformers
as it is.

The translation keeps `architectures` as config.json has it (the registry maps each name) and
sets the field names our classes read; a field of the wrong type fails with a ValueError naming
it. The family modules' translations share the readers here: `field`, `common_fields`,
`refuse_unless`, `llama_fields` (a Llama-shaped decoder's sizes), `qwen2_text_fields` (a remote
VLM's flat Qwen2 text fields), `qwen3_text_fields` (the same for Qwen3, its M-RoPE left to the
caller), `tower_fields` (vision_config of one tower type) and `vocab_token_id`.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from typing import Any

from transformers import FalconConfig, PretrainedConfig, StableLmConfig

RawConfig = dict[str, Any]


def field(raw: RawConfig, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """raw[name] checked against `kind` (an int is a float too), `default` when absent or
    null; ValueError naming the field otherwise."""
    value = raw.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"config.json field {name!r} is required")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"config.json field {name!r} must be {expected}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and int in kinds:
        raise ValueError(f"config.json field {name!r} must be positive, got {value!r}")
    return value


def common_fields(raw: RawConfig) -> RawConfig:
    """What every translation carries over as it is: ids, dtype, the architecture names."""
    keep = ("architectures", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
    out = {k: raw[k] for k in keep if raw.get(k) is not None}
    if "torch_dtype" in out:
        out["dtype"] = out.pop("torch_dtype")
    return out


def refuse_unless(raw: RawConfig, arch: str, name: str, allowed: tuple[Any, ...]) -> None:
    """ValueError naming `name` when config.json sets it to a value outside `allowed` (None in
    `allowed`: the field may be absent or null)."""
    if raw.get(name) in allowed:
        return
    wanted = " or ".join(repr(a) for a in allowed if a is not None)
    only = f" (only {wanted})" if wanted else ""
    raise ValueError(f"{arch}: config.json field {name!r}={raw[name]!r} is not supported{only}")


def llama_fields(raw: RawConfig, max_positions: int, rms_norm_eps: float) -> RawConfig:
    """common_fields plus a Llama-shaped decoder's sizes under their own names (kv heads default
    to the heads; `max_positions` / `rms_norm_eps` the family's defaults); ValueError when the
    heads do not divide hidden_size or the kv heads the heads."""
    heads = field(raw, "num_attention_heads", int)
    hidden = field(raw, "hidden_size", int)
    kv_heads = field(raw, "num_key_value_heads", int, heads)
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"config.json fields 'num_attention_heads' ({heads}) and 'num_key_value_heads' "
            f"({kv_heads}) must divide hidden_size ({hidden}) and num_attention_heads"
        )
    return {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        "intermediate_size": field(raw, "intermediate_size", int),
        "num_hidden_layers": field(raw, "num_hidden_layers", int),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": field(raw, "max_position_embeddings", int, max_positions),
        "rms_norm_eps": field(raw, "rms_norm_eps", float, rms_norm_eps),
    }


def vocab_token_id(
    raw: RawConfig, name: str, default: int | None, vocab_size: int, arch: str
) -> int:
    """raw[name] (`default` when absent; None: required), a token id below `vocab_size`;
    ValueError naming the field otherwise."""
    token = field(raw, name, int, default)
    if token >= vocab_size:
        raise ValueError(
            f"{arch}: config.json field {name}={token!r} is not supported: below vocab_size "
            f"{vocab_size}"
        )
    return token


def _flat_text_fields(raw: RawConfig, arch: str, max_positions: int) -> RawConfig:
    """The fields a remote VLM's flat Qwen2 / Qwen3 config.json shares: sizes, full attention
    (use_sliding_window refused by name), rms_norm_eps 1e-6, the special token ids."""
    if raw.get("use_sliding_window"):
        raise ValueError(
            f"{arch}: config.json field use_sliding_window=True is not supported: false (full "
            "attention)"
        )
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    fields: RawConfig = {k: field(raw, k, int) for k in (*names, "num_attention_heads")}
    heads = fields["num_attention_heads"]
    return {
        **fields,
        "num_key_value_heads": field(raw, "num_key_value_heads", int, heads),
        "rms_norm_eps": field(raw, "rms_norm_eps", float, 1e-6),
        "max_position_embeddings": field(raw, "max_position_embeddings", int, max_positions),
        "use_sliding_window": False,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"),
        "pad_token_id": raw.get("pad_token_id"),
    }


def qwen2_text_fields(raw: RawConfig, arch: str) -> RawConfig:
    """A remote VLM's flat config.json as Qwen2Config / Qwen3Config keyword arguments: full
    attention, default RoPE (rope_scaling and use_sliding_window refused by name), the release
    defaults (rms_norm_eps 1e-6, 32768 positions, rope_theta 1e6)."""
    if raw.get("rope_scaling") is not None:
        raise ValueError(
            f"{arch}: config.json field rope_scaling={raw['rope_scaling']!r} is not supported: null"
        )
    return {
        **_flat_text_fields(raw, arch, 32768),
        "hidden_act": raw.get("hidden_act", "silu"),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": field(raw, "rope_theta", float, 1000000.0),
        },
    }


def qwen3_text_fields(raw: RawConfig, arch: str, max_positions: int) -> RawConfig:
    """A remote VLM's flat Qwen3 config.json as Qwen3Config keyword arguments without the rope
    (the caller sets its M-RoPE after construction): full attention (use_sliding_window refused
    by name), head_dim hidden_size / heads unless given, rms_norm_eps 1e-6."""
    fields = _flat_text_fields(raw, arch, max_positions)
    derived = fields["hidden_size"] // fields["num_attention_heads"]
    return {
        **fields,
        "head_dim": field(raw, "head_dim", int, derived),
        "hidden_act": field(raw, "hidden_act", str, "silu"),
        "attention_bias": bool(raw.get("attention_bias", False)),
    }


def tower_fields(raw: RawConfig, arch: str, tower_type: str) -> RawConfig:
    """config.json's vision_config: a dict whose model_type (`tower_type` where absent) is
    `tower_type`; ValueError naming the field otherwise."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(
            f"{arch}: config.json field vision_config={vision!r} is not supported: a dict (the "
            f"{tower_type} tower's fields)"
        )
    kind = vision.get("model_type", tower_type)
    if kind != tower_type:
        raise ValueError(
            f"{arch}: config.json field vision_config.model_type={kind!r} is not supported: "
            f"{tower_type!r}"
        )
    return vision


def rw_config(raw: RawConfig) -> PretrainedConfig:
    """Falcon's first release (RW: falcon-7b / 40b / rw-1b): n_head / n_layer / n_head_kv for
    the head and layer counts; "RefinedWeb" (40b) is the new decoder architecture (grouped KV
    heads, two parallel norms), "RefinedWebModel" (7b, rw) the old one. RW's own defaults:
    parallel_attn, bias and alibi off, multi-query on."""
    kind = raw.get("model_type")
    if kind not in ("RefinedWeb", "RefinedWebModel"):
        raise ValueError(
            f"config.json field 'model_type' of RWForCausalLM must be RefinedWeb or "
            f"RefinedWebModel, got {kind!r}"
        )
    heads = field(raw, "n_head", int)
    new_arch = kind == "RefinedWeb"
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": field(raw, "hidden_size", int),
        "num_attention_heads": heads,
        "num_hidden_layers": field(raw, "n_layer", int),
        "layer_norm_epsilon": field(raw, "layer_norm_epsilon", float, 1e-5),
        "new_decoder_architecture": new_arch,
        "num_kv_heads": field(raw, "n_head_kv", int, 1) if new_arch else heads,
        "multi_query": field(raw, "multi_query", bool, True),
        "parallel_attn": field(raw, "parallel_attn", bool, False),
        "bias": field(raw, "bias", bool, False),
        "alibi": field(raw, "alibi", bool, False),
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, True),
    }
    if raw.get("apply_residual_connection_post_layernorm"):
        raise ValueError(
            "config.json field 'apply_residual_connection_post_layernorm' is not supported"
        )
    return FalconConfig(**fields)


def stablelm_epoch_config(raw: RawConfig) -> PretrainedConfig:
    """StableLM-3B-4E1T's remote config: rope_pct / norm_eps for transformers'
    partial_rotary_factor / layer_norm_eps; the rest under transformers' names already."""
    fields = {
        **common_fields(raw),
        "partial_rotary_factor": field(raw, "rope_pct", float, 0.25),
        "layer_norm_eps": field(raw, "norm_eps", float, 1e-5),
        "use_qkv_bias": field(raw, "use_qkv_bias", bool, False),
        "qk_layernorm": field(raw, "qk_layernorm", bool, False),
        "use_parallel_residual": field(raw, "use_parallel_residual", bool, False),
        "rope_theta": field(raw, "rope_theta", float, 10000.0),
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, False),
        "hidden_act": field(raw, "hidden_act", str, "silu"),
    }
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        fields[name] = field(raw, name, int)
    fields["num_attention_heads"] = field(raw, "num_attention_heads", int)
    fields["num_key_value_heads"] = field(
        raw, "num_key_value_heads", int, fields["num_attention_heads"]
    )
    fields["max_position_embeddings"] = field(raw, "max_position_embeddings", int, 4096)
    return StableLmConfig(**fields)


# config.json architecture -> its translation, "module:function" under paged_engine.models (the
# family modules import `field` from here)
REMOTE_CONFIGS: dict[str, str] = {
    "RWForCausalLM": "remote_aliases:rw_config",
    "StableLMEpochForCausalLM": "remote_aliases:stablelm_epoch_config",
    "QWenLMHeadModel": "qwen_v1:qwen_v1_config",
    # Qwen-VL v1: config.json names QWenLMHeadModel (a `visual` section tells it apart)
    "QwenVLForConditionalGeneration": "qwen_vl_v1_config:qwen_vl_v1_config",
    "BaichuanForCausalLM": "baichuan:baichuan_config",
    "BaiChuanForCausalLM": "baichuan:baichuan_config",
    "TeleChat2ForCausalLM": "telechat2:telechat2_config",
    "TeleChatForCausalLM": "telechat2:telechat2_config",
    "NewModel": "gte:new_config",
    "NewForSequenceClassification": "gte:new_config",
    "NewForTokenClassification": "gte:new_config",  # gte-multilingual-base; embeds as GteNewModel
    "NomicBertModel": "nomic_bert:nomic_config",  # None for transformers' own names
    "XLMRobertaModel": "jina_embeddings_v3:jina_config",  # None unless rotary (Jina v3)
    "Phi3VForCausalLM": "phi3v_config:phi3v_config",
    "KimiVLForConditionalGeneration": "kimi_vl_config:kimi_vl_config",
    "Phi4MMForCausalLM": "phi4mm_config:phi4mm_config",
    "LightOnOCRForConditionalGeneration": "hub_vlm_configs:lighton_ocr_config",  # vLLM's name
    "InternS1ForConditionalGeneration": "hub_vlm_configs:intern_s1_config",
    "Ovis2_5": "ovis2_5_hub:ovis2_5_hub_config",  # Ovis2.5-2B / -9B (remote code)
    "BailingMoeForCausalLM": "bailing_moe:bailing_moe_config",  # Ling v1
    "BailingMoeV2ForCausalLM": "bailing_moe:bailing_moe_v2_config",  # Ling / Ring 2.0
    "LlamaBidirectionalModel": "llama_bidirectional:llama_bidirectional_config",
    "LlamaBidirectionalForSequenceClassification": (
        "llama_bidirectional:llama_bidirectional_classifier_config"
    ),
    "TeleFLMForCausalLM": "llama_remote:teleflm_config",
    "PanguEmbeddedForCausalLM": "llama_remote:pangu_embedded_config",
    "DeepseekForCausalLM": "deepseek_v1:deepseek_v1_config",  # DeepSeek-MoE v1
    "ArcticForCausalLM": "arctic:arctic_config",
    "Grok1ModelForCausalLM": "grok1:grok1_config",  # hpcai-tech/grok-1's name
    "Grok1ForCausalLM": "grok1:grok1_config",
    "DeepseekOCRForCausalLM": "deepseek_ocr_v1_config:deepseek_ocr_v1_config",  # DeepSeek-OCR
    "DotsOCRForCausalLM": "dots_ocr_config:dots_ocr_config",  # rednote-hilab/dots.ocr
    "MiniCPMV": "minicpmv_remote_config:minicpmv_remote_config",  # MiniCPM-V 2.6 / 4.5
    "MiniCPMO": "minicpmo_remote_config:minicpmo_remote_config",  # MiniCPM-o 2.6
    "MiDashengLMModel": "midashenglm_config:midashenglm_config",  # mispeech/midashenglm-7b
    "DeepseekVLV2ForCausalLM": "deepseek_vl2_config:deepseek_vl2_config",  # DeepSeek-VL2
    "MolmoForCausalLM": "molmo_v1_config:molmo_v1_config",  # Molmo v1 (7B-D, 72B, 7B-O), MolmoE-1B
    "NemotronH_Nano_VL_V2": "nemotron_nano_vl_config:nemotron_nano_vl_config",  # Nano VL 12B v2
    "Llama_Nemotron_Nano_VL": "nemotron_vl_v1_config:nemotron_vl_v1_config",  # Nano VL 8B v1
    "SolarForCausalLM": "solar:solar_config",  # upstage/solar-pro-preview-instruct
    "OuroForCausalLM": "ouro:ouro_config",  # ByteDance/Ouro-1.4B / 2.6B
    "MiniMaxVL01ForConditionalGeneration": "minimax_vl_01_config:minimax_vl_01_config",
    "BeeForConditionalGeneration": "bee_config:bee_config",  # Open-Bee/Bee-8B-RL / -SFT
    "JAISLMHeadModel": "jais:jais_config",  # inceptionai/jais-13b / 30b, jais-family
    "Plamo2ForCausalLM": "plamo2:plamo2_config",  # pfnet/plamo-2-1b / 8b
    "Plamo3ForCausalLM": "plamo3:plamo3_config",  # pfnet/plamo-3-nict-2b-base / 8b / 31b
    "GLM4VForCausalLM": "glm4v_remote_config:glm4v_remote_config",  # THUDM/glm-4v-9b
    "OpenCUAForConditionalGeneration": "opencua_config:opencua_config",  # xlangai/OpenCUA-7B
    "IsaacForConditionalGeneration": "isaac_config:isaac_config",  # PerceptronAI/Isaac-0.1
    "KeyeForConditionalGeneration": "keye_config:keye_config",  # Kwai-Keye/Keye-VL-8B-Preview
    "KeyeVL1_5ForConditionalGeneration": "keye_config:keye_vl1_5_config",  # Keye-VL-1.5, images
    "PanguProMoEForCausalLM": "pangu_pro_moe:pangu_pro_moe_config",  # Pangu Pro MoE 72B-A16B
    "PanguUltraMoEForCausalLM": "openpangu_moe:openpangu_moe_config",  # openPangu-Ultra-MoE-718B
    "PanguProMoEV2ForCausalLM": "openpangu_moe:openpangu_moe_config",  # openPangu Pro MoE V2
    "Step3TextForCausalLM": "step3_text:step3_text_config",  # StepFun Step3's decoder
    "Step3VLForConditionalGeneration": "step3_vl_config:step3_vl_config",  # stepfun-ai/step3
    # HyperCLOVAX-SEED-Vision-Instruct-3B (text only: models/hcx_vision_v1_config.py)
    "HCXVisionForCausalLM": "hcx_vision_v1_config:hcx_vision_v1_config",
    "MoonshotKimiaForCausalLM": "kimi_audio_config:kimi_audio_config",  # Kimi-Audio-7B(-Instruct)
}

# remote VLMs whose placeholder id is the release tokenizer's token (vLLM looks it up): a
# config.json without image_token_id gets the id the checkpoint's tokenizer files give it
PLACEHOLDER_TOKENS = {
    "MiniCPMV": "<unk>",
    "MiniCPMO": "<unk>",
    "DeepseekOCRForCausalLM": "<image>",
    "DeepseekVLV2ForCausalLM": "<image>",
    "Llama_Nemotron_Nano_VL": "<image>",
    "OpenCUAForConditionalGeneration": "<|media_placeholder|>",
    "IsaacForConditionalGeneration": "<|image_pad|>",
    "MoonshotKimiaForCausalLM": "<|im_kimia_text_blank|>",  # (its audio placeholder)
}


@functools.lru_cache(maxsize=16)  # a load asks 3-4 times; tokenizer.json can be MBs
def saved_token_id(path: Path, text: str) -> int | None:
    """The id of token `text` in the tokenizer files saved in `path` (tokenizer.json's added
    tokens or vocab, else tokenizer_config.json's added_tokens_decoder); None if not found."""
    try:
        fast = json.loads((Path(path) / "tokenizer.json").read_text())
        for added in fast.get("added_tokens") or ():
            if added.get("content") == text and isinstance(added.get("id"), int):
                return added["id"]
        vocab = (fast.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
            return vocab[text]
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    try:
        slow = json.loads((Path(path) / "tokenizer_config.json").read_text())
        for key, added in (slow.get("added_tokens_decoder") or {}).items():
            if isinstance(added, dict) and added.get("content") == text:
                return int(key)
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return None


# model types transformers reads itself: a checkpoint re-saved in transformers' format
_TRANSFORMERS_TYPES = {"RWForCausalLM": "falcon", "StableLMEpochForCausalLM": "stablelm"}

# releases whose config transformers reads, named by a class transformers renamed since: the
# name every table here knows (Qwen/Qwen2.5-Omni-7B's config.json names the preview's class)
RENAMED = {"Qwen2_5OmniModel": "Qwen2_5OmniForConditionalGeneration"}


def remote_config(path: Path) -> PretrainedConfig | None:
    """The translated (or renamed) config of a checkpoint in `path` whose config.json names one
    of the architectures above; None for any other checkpoint (transformers reads it)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    raw = json.loads(file.read_text())
    from paged_engine.models.tarsier2_config import is_tarsier2, tarsier2_config

    if is_tarsier2(raw):  # LLaVA around Qwen2-VL, whatever its architectures say
        return tarsier2_config(raw)
    archs = raw.get("architectures") or []
    if any(a in RENAMED for a in archs):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        config.architectures = [RENAMED.get(a, a) for a in archs]
        return config
    arch = next((a for a in archs if a in REMOTE_CONFIGS), None)
    if arch is None and "ChatGLMModel" in archs and raw.get("vision_config") is not None:
        arch = "GLM4VForCausalLM"  # GLM-4V: ChatGLM's config.json with a vision_config
    # (a config.json without model_type, Grok-1's, is translated too)
    if arch is None or (raw.get("model_type") or arch) == _TRANSFORMERS_TYPES.get(arch):
        return None
    if arch == "QWenLMHeadModel" and raw.get("visual") is not None:  # Qwen-VL, as vLLM's qwen.py
        arch = "QwenVLForConditionalGeneration"
    if arch in PLACEHOLDER_TOKENS and raw.get("image_token_id") is None:
        token = saved_token_id(path, PLACEHOLDER_TOKENS[arch])
        if token is not None:
            raw = {**raw, "image_token_id": token}
    if arch == "MoonshotKimiaForCausalLM":  # Kimi-Audio: its tower's config is in a subfolder
        raw = {**raw, "_checkpoint": str(path)}
    module, function = REMOTE_CONFIGS[arch].split(":")
    translate = getattr(importlib.import_module(f"paged_engine.models.{module}"), function)
    config = translate(raw)
    # dtype="auto" serves in the release's dtype, whatever the translation kept (a translation
    # may also answer None: transformers reads the checkpoint itself)
    saved = raw.get("dtype") or raw.get("torch_dtype")
    kept = getattr(config, "__dict__", {})
    if (
        config is not None
        and saved is not None
        and not (kept.get("dtype") or kept.get("torch_dtype"))
    ):
        config.dtype = saved
    return config
