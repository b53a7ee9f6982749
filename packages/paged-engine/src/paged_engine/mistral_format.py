"""Mistral AI's native checkpoint format (vLLM's `config_format="mistral"` /
`load_format="mistral"`): `params.json` as the config, `consolidated*.safetensors` as the weights.

    config = mistral_hf_config(path)          # MistralConfig / MixtralConfig / Mistral4Config
    weights = mistral_weights(path)           # (HF name, tensor), as model.safetensors holds them

params.json names the text model's shape Mistral's way (dim, n_layers, n_heads, ...); each field
is mapped to its transformers name, and a field paged does not map (quantization, ...) is
refused by name rather than ignored; multi-head latent attention (Mistral Large 3) becomes a
Mistral4Config with its own tensor names (mistral_large3.py); a `vision_encoder` section
(Pixtral, Mistral Small 3.x, Large 3) becomes the HF wrapper paged serves images through
(mistral_vision.py), a `multimodal` section with a Whisper encoder (Voxtral) the one it serves
audio through (mistral_audio.py).
The tensors are renamed (`layers.N.attention.wq` -> `model.layers.N.self_attn.q_proj`, ...), and
wq / wk rows are permuted: Mistral's rotary embedding rotates adjacent pairs (rows 2i, 2i+1 of
a head), HF's rotates the two halves (rows i, i + head_dim/2), so row 2i + j of a head becomes
row j * head_dim/2 + i (the same permutation transformers' conversion script applies).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PARAMS_FILE = "params.json"
_CONSOLIDATED = "consolidated*.safetensors"

# params.json name -> transformers name; the value is taken as it is
_RENAMED = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "tied_embeddings": "tie_word_embeddings",
}
# read below with their own rules
_HANDLED = {
    "rope_theta",
    "sliding_window",
    "max_position_embeddings",
    "max_seq_len",
    "moe",
    "yarn",
    "dtype",
    "model_type",
    "activation",
    "quantization",
    "max_batch_size",  # mistral_inference's runtime batch limit: changes no output
    "vision_encoder",  # Pixtral / Mistral Small 3.x: mistral_vision.py
    "multimodal",  # Voxtral's whisper_model_args: mistral_audio.py
}
_REFUSED = {  # field -> why; checked before the generic "not mapped" refusal
    "llama_4_scaling": "Llama-4 attention scaling without MLA (Large 3's: mistral_large3.py)",
}
_MOE_FIELDS = {"num_experts": "num_local_experts", "num_experts_per_tok": "num_experts_per_tok"}
# yarn field -> (rope_parameters name, type), as vLLM maps them
_YARN_FIELDS = {
    "factor": ("factor", float),
    "original_max_position_embeddings": ("original_max_position_embeddings", int),
    "beta": ("beta_fast", float),
    "alpha": ("beta_slow", float),
}
_DEFAULT_MAX_POSITIONS = 128_000  # vLLM's, where params.json names no length
# Where params.json names none (Mistral 7B v0.1's): its HF config's value and transformers'
# Mistral default; mistral_inference would take 1e6, so a warning says which is used
_DEFAULT_ROPE_THETA = 10_000.0
_ST_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def config_format_of(path: Path, config_format: str) -> str:
    """The config format of a checkpoint directory, "hf" or "mistral": "auto" takes config.json
    where there is one, else params.json (as vLLM does). `config_format`: EngineConfig's,
    checked there."""
    if config_format != "auto":
        return config_format
    if not (path / "config.json").is_file() and (path / PARAMS_FILE).is_file():
        return "mistral"
    return "hf"


def read_params(path: Path) -> dict[str, Any]:
    file = path / PARAMS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"config_format='mistral' but {path} has no {PARAMS_FILE}")
    params = json.loads(file.read_text())
    if not isinstance(params, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return params


def native_section(path: Path, section: str) -> bool:
    """Whether `path` is a native checkpoint read from params.json (no config.json: vLLM's
    "auto" reading) whose params.json has a non-null `section`; an unreadable params.json is
    False here (the config read reports it)."""
    if config_format_of(Path(path), "auto") != "mistral":
        return False
    try:
        params = json.loads((Path(path) / PARAMS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(params, dict) and params.get(section) is not None


def mistral_hf_config(path: Path):
    """The config paged serves for params.json: the text model's (MistralForCausalLM, or
    MixtralForCausalLM with a `moe` section); with a `vision_encoder` / `multimodal` section,
    the text config of its HF wrapper (multimodal_text.py), images through multimodal/pixtral.py,
    audio through multimodal/voxtral.py. ValueError naming each field it cannot map."""
    text, wrapper = mistral_configs(path)
    if wrapper is None:
        return text
    from paged_engine.models.multimodal_text import text_only_config

    return text_only_config(wrapper)  # (tied or not as params.json says)


def mistral_wrapper_config(path: Path):
    """The HF wrapper config (LlavaConfig / Mistral3Config, mistral_vision.py; VoxtralConfig,
    mistral_audio.py) of a params.json with a `vision_encoder` / `multimodal` section, else
    None."""
    return mistral_configs(path)[1]


def mistral_configs(path: Path) -> tuple[Any, Any]:
    """(the text model's transformers config, its vision / audio wrapper's or None)."""
    import transformers

    from paged_engine.mistral_audio import AUDIO_FIELD, audio_wrapper_config
    from paged_engine.mistral_large3 import MLA_FIELDS, is_mla, mla_config
    from paged_engine.mistral_vision import VISION_FIELD, vision_wrapper_config

    params = {k: v for k, v in read_params(path).items() if v is not None}
    mla_fields = MLA_FIELDS if is_mla(params) else set()  # Mistral Large 3
    for field, why in _REFUSED.items():
        if field in params and field not in mla_fields:
            raise ValueError(
                f"{PARAMS_FILE} field {field!r} ({why}) is not supported in Mistral's native "
                "format; serve the repo's Hugging Face files (config_format='hf')"
            )
    unknown = sorted(set(params) - set(_RENAMED) - _HANDLED - mla_fields)
    if unknown:
        raise ValueError(
            f"{PARAMS_FILE} fields {unknown} are not mapped by paged and may change the model; "
            "serve the repo's Hugging Face files (config_format='hf')"
        )
    if params.get("quantization"):
        raise ValueError(
            f"{PARAMS_FILE} field 'quantization' is not supported in Mistral's native format"
        )
    if params.get("model_type", "transformer") != "transformer":
        raise ValueError(f"{PARAMS_FILE} model_type {params['model_type']!r} is not supported")
    if params.get("activation", "silu") != "silu":
        raise ValueError(f"{PARAMS_FILE} activation {params['activation']!r} is not supported")
    kwargs: dict[str, Any] = {new: params[old] for old, new in _RENAMED.items() if old in params}
    if "head_dim" not in kwargs:
        kwargs["head_dim"] = params["dim"] // params["n_heads"]
    kwargs.setdefault("tie_word_embeddings", False)
    lengths = [params[k] for k in ("max_position_embeddings", "max_seq_len") if k in params]
    kwargs["max_position_embeddings"] = min(lengths, default=_DEFAULT_MAX_POSITIONS)
    kwargs["rope_parameters"] = _rope(params)
    kwargs.update(_sliding(params.get("sliding_window"), params["n_layers"]))
    kwargs["dtype"] = params.get("dtype") or _checkpoint_dtype(path)
    moe = params.get("moe")
    if mla_fields:
        text = mla_config(params, kwargs, PARAMS_FILE)
    elif moe:
        extra = sorted(set(moe) - set(_MOE_FIELDS))
        if extra:
            raise ValueError(f"{PARAMS_FILE} moe fields {extra} are not supported")
        kwargs.update({new: moe[old] for old, new in _MOE_FIELDS.items() if old in moe})
        text = transformers.MixtralConfig(architectures=["MixtralForCausalLM"], **kwargs)
    else:
        text = transformers.MistralConfig(architectures=["MistralForCausalLM"], **kwargs)
    media = [f for f in (VISION_FIELD, AUDIO_FIELD) if f in params]
    if not media:
        return text, None
    if mla_fields and media == [VISION_FIELD]:  # Large 3: Mistral Small 4's HF wrapper
        return text, vision_wrapper_config(params[VISION_FIELD], text)
    if moe or len(media) > 1:
        both = ["moe"] * bool(moe) + media
        raise ValueError(f"{PARAMS_FILE} fields {both} together: not supported")
    if media == [AUDIO_FIELD]:
        return text, audio_wrapper_config(params[AUDIO_FIELD], text, path)
    return text, vision_wrapper_config(params[VISION_FIELD], text)


def _rope(params: dict[str, Any]) -> dict[str, Any]:
    if "rope_theta" not in params:
        logger.warning("%s names no rope_theta: using %s", PARAMS_FILE, _DEFAULT_ROPE_THETA)
    theta = float(params.get("rope_theta", _DEFAULT_ROPE_THETA))
    yarn = dict(params.get("yarn") or {})
    if not yarn:
        return {"rope_type": "default", "rope_theta": theta}
    rope: dict[str, Any] = {"rope_type": "yarn", "rope_theta": theta, "mscale_all_dim": 1}
    for old, (new, cast) in _YARN_FIELDS.items():
        if old in yarn:
            rope[new] = cast(yarn.pop(old))
    if not yarn.pop("apply_scale", True):  # no magnitude correction
        rope["attention_factor"] = 1.0
    if yarn:
        raise ValueError(f"{PARAMS_FILE} yarn fields {sorted(yarn)} are not supported")
    return rope


def _sliding(window: int | list | None, layers: int) -> dict[str, Any]:
    """sliding_window: an int (every layer), or a per-layer pattern repeated over the layers
    (None: full attention) -> transformers' int window plus layer_types."""
    if window is None:
        return {"sliding_window": None}  # MistralConfig would default to 4096
    if isinstance(window, int):
        return {"sliding_window": window}
    sizes = {w for w in window if w is not None}
    if not isinstance(window, list) or not window or len(sizes) > 1 or layers % len(window):
        raise ValueError(
            f"{PARAMS_FILE} sliding_window {window!r}: expected an int or a pattern of one "
            "window size (and None) that divides the layer count"
        )
    pattern = window * (layers // len(window))
    types = ["full_attention" if w is None else "sliding_attention" for w in pattern]
    return {"sliding_window": next(iter(sizes), None), "layer_types": types}


def consolidated_files(path: Path) -> list[Path]:
    files = sorted(path.glob(_CONSOLIDATED))
    if not files:
        raise FileNotFoundError(
            f"load_format='mistral' but {path} has no {_CONSOLIDATED} (Mistral's native weights)"
        )
    return files


def _checkpoint_dtype(path: Path) -> str | None:
    """The first floating tensor's dtype in the consolidated weights (what dtype="auto"
    serves, as a config.json's `dtype` would say); None where there are none."""
    from paged_engine.loader import safetensors_header

    for file in sorted(path.glob(_CONSOLIDATED)):
        with open(file, "rb") as f:
            header, _ = safetensors_header(f)
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] in _ST_FLOAT_DTYPES:
                return _ST_FLOAT_DTYPES[info["dtype"]]
    return None


# Mistral module name (after `layers.N.`) -> HF's
_LAYER_NAMES = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.gate": "block_sparse_moe.gate",  # Mixtral's router
}
_TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight)$")
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w[123])$")


def hf_name(name: str) -> str:
    """The HF name of a consolidated tensor; ValueError for one paged does not know."""
    from paged_engine.mistral_large3 import mla_module_name

    module, _, kind = name.rpartition(".")
    if kind == "weight" and module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.weight"
    match = _LAYER.fullmatch(name)
    if match is not None:
        layer, sub = match.group(1), match.group(2)
        if sub in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[sub]}.weight"
        mla = mla_module_name(sub)  # Mistral Large 3's MLA / DeepSeek-MoE modules
        if mla is not None:
            return f"model.layers.{layer}.{mla}.weight"
        expert = _EXPERT.fullmatch(sub)
        if expert is not None:  # Mixtral's experts keep Mistral's w1 / w2 / w3 names in HF
            return f"model.layers.{layer}.block_sparse_moe.experts.{expert[1]}.{expert[2]}.weight"
    raise ValueError(f"load_format='mistral': unknown tensor {name!r} in the consolidated weights")


def rotate_half_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """wq / wk [heads * head_dim, dim] from Mistral's interleaved rotary pairs to HF's halves:
    row 2i + j of each head -> row j * head_dim / 2 + i."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _head_counts(path: Path) -> tuple[int, int, int | None, tuple[int, int] | None]:
    """(query heads, KV heads, vision tower heads or None, the audio encoder's
    (max_source_positions, dim) or None) from params.json, else config.json
    (load_format='mistral' with an HF config)."""
    from paged_engine.mistral_audio import audio_positions

    if (path / PARAMS_FILE).is_file():
        params = read_params(path)
        vision = params.get("vision_encoder") or {}
        tower = vision.get("num_attention_heads") if isinstance(vision, dict) else None
        heads = params["n_heads"]
        return heads, params.get("n_kv_heads") or heads, tower, audio_positions(params)
    config = json.loads((path / "config.json").read_text())
    vision = config.get("vision_config")  # (PixtralVisionConfig's 16 heads where unsaved)
    tower = vision.get("num_attention_heads", 16) if isinstance(vision, dict) else None
    audio = config.get("audio_config") or {}  # (VoxtralEncoderConfig's defaults where unsaved)
    positions = (audio.get("max_source_positions", 1500), audio.get("hidden_size", 1280))
    positions = positions if audio else None
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads") or heads, tower, positions


def mistral_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) of the consolidated weights, wq / wk rows (the vision tower's too)
    permuted to HF's rotary layout; streamed file by file. With a vision tower / an audio
    encoder the names are as transformers saves its HF wrapper (language_model.model.*,
    vision_tower.*, audio_tower.*, ...); the audio encoder's positions (not in the checkpoint)
    come last."""
    from paged_engine.loader import mmap_safetensors
    from paged_engine.mistral_audio import POSITIONS, audio_hf_name, sinusoid_positions
    from paged_engine.mistral_vision import rotary_vision_weight, vision_hf_name, wrapped_text_name

    files = consolidated_files(path)
    heads, kv_heads, tower_heads, audio = _head_counts(path)
    wrapped = tower_heads is not None or audio is not None
    encoder_seen = False
    for file in files:
        for name, tensor in mmap_safetensors(file):
            moved = audio_hf_name(name)  # (Whisper's tower has no rotary rows to permute)
            if moved is not None:
                if audio is None:
                    raise ValueError(
                        f"load_format='mistral': audio tensor {name!r} but the config has no "
                        "audio encoder"
                    )
                encoder_seen |= moved.startswith("audio_tower.")
                yield moved, tensor
                continue
            vision = vision_hf_name(name)
            if vision is not None:
                if tower_heads is None:
                    raise ValueError(
                        f"load_format='mistral': vision tensor {name!r} but the config has no "
                        "vision encoder"
                    )
                if rotary_vision_weight(vision):
                    tensor = rotate_half_rows(tensor, tower_heads)
                yield vision, tensor
                continue
            new = hf_name(name)
            if new.endswith("self_attn.q_proj.weight"):
                tensor = rotate_half_rows(tensor, heads)
            elif new.endswith("self_attn.k_proj.weight"):
                tensor = rotate_half_rows(tensor, kv_heads)
            yield (wrapped_text_name(new) if wrapped else new), tensor
    if audio is not None and encoder_seen:
        yield POSITIONS, sinusoid_positions(*audio)
