"""Find a model (local dir, .gguf file, hub id), build it, and load its weights.

    resolved = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    config = load_hf_config(resolved)
    model = load_model(resolved, config, dtype=resolve_dtype("auto", config), device=device)

Hub ids resolve through huggingface_hub (hub.py): the local cache, downloading what is missing
unless HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from paged_engine.bnb_checkpoint import bnb_scheme, unpack_bnb_weights
from paged_engine.checkpoint_checks import check_config, check_config_size, check_disjoint
from paged_engine.config_ignored import with_effective_fields
from paged_engine.layers.linear import deferred_weights
from paged_engine.layers.rotary import rope_context_len
from paged_engine.load_progress import count_weights, track_weights
from paged_engine.models import get_model_class
from paged_engine.models.multimodal_text import (
    MARKER,
    processor_chat_template,
    text_model_weights,
    text_only_config,
)
from paged_engine.packed_checkpoint import (
    keeps_codes,
    packed_scheme,
    sidecar_quant_config,
    unpack_weights,
)
from paged_engine.packed_codes import KEEP_CODES, CodesLoad
from paged_engine.quantized_checkpoint import (
    checkpoint_block_size,
    dequantize_weights,
    quant_method,
)
from paged_engine.worker.kv_scales import split_kv_scales

logger = logging.getLogger(__name__)

# "mistral": params.json / consolidated*.safetensors (mistral_format.py)
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy", "mistral")
_HUB_ID = re.compile(r"^[\w.\-]+(/[\w.\-]+)?$")


@dataclass(slots=True)
class ResolvedModel:
    name: str  # what the user asked for
    path: Path  # directory holding config / tokenizer / weights (the .gguf's folder for GGUF)
    gguf_file: Path | None = None
    # the Hub settings it was resolved with: the repos its config names (Ultravox's
    # text_model_id / audio_model_id, models/ultravox_linked.py) resolve with them too
    download_dir: str | Path | None = None
    token: str | bool | None = field(default=None, repr=False)

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model(
    model: str | Path,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    weights: bool = True,
    token: str | bool | None = None,
    mistral: bool = False,
) -> ResolvedModel:
    """A local HF-format dir, a .gguf file (or a dir holding exactly one), or a hub id
    (`revision`: branch, tag or commit; `download_dir`: a cache other than the standard one;
    `weights=False`: a tokenizer-only use, so a hub download skips the weight files; `token`:
    a Hub token other than HF_TOKEN's; `mistral`: a hub download fetches Mistral's native
    params.json / consolidated weights instead of the HF-named ones)."""
    name = str(model)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a model directory")
        return ResolvedModel(name, path.parent.resolve(), path.resolve())
    if path.is_dir():
        return _resolve_dir(name, path.resolve(), download_dir, token)
    from paged_engine.default_model import DEFAULT_MODEL_NAME, default_model_path

    if name in (DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}-GGUF"):
        gguf_file = default_model_path()
        return ResolvedModel(name, gguf_file.parent, gguf_file)
    if not _HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    from paged_engine.hub import hub_snapshot

    path = hub_snapshot(name, revision, download_dir, weights, token, mistral=mistral)
    return _resolve_dir(name, path, download_dir, token)


def _resolve_dir(
    name: str, path: Path, download_dir: str | Path | None = None, token: str | bool | None = None
) -> ResolvedModel:
    if (path / "config.json").is_file() or (path / "params.json").is_file():  # HF / Mistral
        return ResolvedModel(name, path, download_dir=download_dir, token=token)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(name, path, ggufs[0])
    if len(ggufs) > 1:
        listed = ", ".join(g.name for g in ggufs)
        raise ValueError(f"{path} holds several .gguf files ({listed}); pass one file path")
    raise FileNotFoundError(f"{path} has neither config.json, params.json nor a .gguf file")


def load_hf_config(
    resolved: ResolvedModel, trust_remote_code: bool = False, config_format: str = "auto"
):
    """The transformers PretrainedConfig (built from GGUF metadata for .gguf models, from
    params.json for Mistral's native format: `config_format`, mistral_format.py)."""
    config, source = _load_hf_config(resolved, trust_remote_code, config_format)
    check_config(config, source)  # sizes and head counts, then sizes against the files
    check_config_size(config, resolved, source)
    return config


def _load_hf_config(
    resolved: ResolvedModel, trust_remote_code: bool, config_format: str
) -> tuple[Any, Path]:
    """(config, the file it came from)."""
    try:  # huggingface_hub's strict dataclasses, which transformers 5's config classes use
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older hub: no such validators, nothing to catch
        StrictDataclassError = ()  # type: ignore[assignment,misc]

    if resolved.is_gguf:
        from paged_engine.gguf import gguf_to_hf_config

        try:
            config = gguf_to_hf_config(_open_gguf(resolved.gguf_file))
        except StrictDataclassError as e:  # a value the config class's validators reject
            raise ValueError(f"{resolved.gguf_file}: {e}") from e
        return with_kv_head_count(config), resolved.gguf_file
    from paged_engine.mistral_format import config_format_of, mistral_hf_config

    if config_format_of(resolved.path, config_format) == "mistral":
        return with_kv_head_count(mistral_hf_config(resolved.path)), resolved.path / "params.json"
    from transformers import AutoConfig

    source = resolved.path / "config.json"
    raw = _check_json_object(source) or {}
    quant = raw.get("quantization_config")  # (transformers calls .to_dict() on it, and raises)
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{source}: quantization_config is not a JSON object")

    from paged_engine.models.ultravox_config import register as register_ultravox
    from paged_engine.models.ultravox_linked import remember_hub

    register_ultravox()  # model_type "ultravox" (remote code's) read without remote code
    remember_hub(resolved)  # its linked ids, resolved as the config is read: its hub settings

    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.internvl_chat import chat_config

    # the Hub's remote-code InternVL: its config.json read as InternVLConfig, no remote code;
    # remote-code text families (Qwen v1, Baichuan, RW...): translated (models/remote_aliases.py)
    try:
        config = (
            chat_config(resolved.path)
            or remote_config(resolved.path)
            or AutoConfig.from_pretrained(resolved.path, trust_remote_code=trust_remote_code)
        )
    except StrictDataclassError as e:  # a field the config class's validators reject
        raise ValueError(f"{source}: {e}") from e
    except (KeyError, ZeroDivisionError) as e:  # transformers' own checks (a rope key, heads 0)
        raise ValueError(f"{source}: {type(e).__name__}: {e}") from e
    sidecar_quant_config(config, resolved.path)  # early GPTQ / AWQ releases' quantize_config.json
    # A vision-language wrapper: its text model's config, served text-only (multimodal_text.py)
    return with_kv_head_count(text_only_config(config)), source


def _check_json_object(file: Path) -> dict | None:
    """The UTF-8 JSON object in `file` (None where there is no file); ValueError naming `file`
    where it is anything else."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    return data


def apply_hf_overrides(config, overrides: dict | None):
    """vLLM's `hf_overrides`: each field set on the loaded config; a dict given for a field
    that holds a sub-config (text_config, rope_parameters as a config) updates its fields.
    An `architectures` naming the wrapper the config was already derived from is dropped:
    vLLM's spelling for a release paged reads as that wrapper by its layout (Tarsier2,
    models/tarsier2_config.py); set on the derived text config it would replace the text class.
    A name archs.SERVED_AS serves as that wrapper is kept as `served_as` instead (Mantis)."""
    overrides = dict(overrides or {})
    marker = getattr(config, MARKER, None)
    archs = overrides.get("architectures")
    if archs == [marker]:
        del overrides["architectures"]
    elif isinstance(archs, list) and len(archs) == 1 and marker is not None:
        from paged_engine.multimodal.archs import SERVED_AS

        if SERVED_AS.get(archs[0]) == marker:  # Mantis: LLaVA's model, its own prompt text
            config.served_as = archs[0]  # read by the engine's image side
            del overrides["architectures"]
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)
    return with_effective_fields(config)  # an override of a field transformers never reads


def with_kv_head_count(config):
    """`num_key_value_heads` set where a family names it otherwise (Falcon's `num_kv_heads` /
    `multi_query`, GPT-BigCode's `multi_query`): the KV cache, the TP checks and the models all
    read that one field, in the engine process and in every worker."""
    from paged_engine.models.falcon import falcon_kv_heads
    from paged_engine.models.gpt_bigcode import bigcode_kv_heads

    counts = {"falcon": falcon_kv_heads, "gpt_bigcode": bigcode_kv_heads}
    count = counts.get(getattr(config, "model_type", None))
    if count is not None:
        config.num_key_value_heads = count(config)
    if getattr(config, "model_type", None) == "chatglm":  # its layer / head / vocab counts
        from paged_engine.models.chatglm import with_llama_names

        with_llama_names(config)
    if getattr(config, "per_layer_config", None) is not None:
        # A config whose layers differ (Gemma 4's head sizes): transformers raises on reading a
        # per-layer field globally. Models that differ read each layer's values themselves (and
        # `kv_cache_layout` sizes the cache); elsewhere the global value is the default layer's.
        config.allow_global_per_layer_attribute_access = True
    return with_effective_fields(config)  # fields transformers never reads (config_ignored.py)


def _tokenizer_config(path: Path, trust_remote_code: bool) -> dict[str, Any]:
    """{"config": a bare config} where transformers' own fallback would fail: config.json of a
    model_type it does not know (remote code, not trusted) with a legacy rope_scaling
    (MiniCPM-V 4.0's LongRoPE), which its PreTrainedConfig standardizes before it has set
    max_position_embeddings. The tokenizer reads no rope field; else {}."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    file = path / "config.json"
    raw = json.loads(file.read_text()) if file.is_file() and not trust_remote_code else {}
    if not raw.get("rope_scaling") or raw.get("model_type") in CONFIG_MAPPING:
        return {}
    return {"config": PretrainedConfig(**{k: v for k, v in raw.items() if "rope" not in k})}


_TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


def _check_tokenizer_fields(file: Path, data: dict) -> None:
    """ValueError naming `file` and the field for what transformers would meet with a bare
    TypeError / ValueError at load or on every request: special tokens that are neither text
    nor an AddedToken dict, added_tokens_decoder entries without a decimal id or text content,
    a non-numeric model_max_length, a chat_template that is no template or list of named ones."""
    for key in (*_SPECIAL_TOKENS, "mask_token"):
        value = data.get(key)
        if not (value is None or isinstance(value, (str, dict))):
            raise ValueError(
                f"{file}: {key} must be a string or an AddedToken object, got {value!r:.80}"
            )
        if isinstance(value, dict) and not isinstance(value.get("content"), str):
            raise ValueError(f"{file}: {key} must hold a string 'content', got {value!r:.80}")
    decoder = data.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise ValueError(f"{file}: added_tokens_decoder must be an object of id -> token")
    for key, entry in decoder.items():
        if not (isinstance(key, str) and key.isdecimal()):
            raise ValueError(f"{file}: added_tokens_decoder key {key!r:.80} is not a token id")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(
                f"{file}: added_tokens_decoder[{key!r}] must be an object with a string "
                f"'content', got {entry!r:.80}"
            )
    limit = data.get("model_max_length")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
        raise ValueError(f"{file}: model_max_length must be a number, got {limit!r:.80}")
    template = data.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in template
    )
    # (transformers also takes the dict of name -> template a list becomes)
    named = named or (
        isinstance(template, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items())
    )
    if not (template is None or isinstance(template, str) or named):
        raise ValueError(
            f"{file}: chat_template must be a template string or a list of "
            f'{{"name": ..., "template": ...}} objects, got {template!r:.80}'
        )


def load_tokenizer(resolved: ResolvedModel, trust_remote_code: bool = False):
    """A transformers tokenizer (built from GGUF metadata for .gguf models, from tekken.json for
    Mistral repos and tokenizer.tok.json for Grok-2 repos without HF tokenizer files)."""
    if resolved.is_gguf:
        from paged_engine.gguf import gguf_tokenizer

        return gguf_tokenizer(_open_gguf(resolved.gguf_file))
    from paged_engine.tekken import tekken_only, tekken_tokenizer

    if tekken_only(resolved.path):
        return tekken_tokenizer(resolved.path)
    from paged_engine.grok2_tokenizer import grok2_only, grok2_tokenizer

    if grok2_only(resolved.path):  # Grok-2's tokenizer.tok.json (vLLM's tokenizer_mode "grok2")
        return grok2_tokenizer(resolved.path)
    from transformers import AutoTokenizer

    from paged_engine.models.ultravox_linked import tokenizer_dir

    path = tokenizer_dir(resolved)  # (Ultravox without one: its text_model_id's)
    for name in _TOKENIZER_JSON:  # a broken file named, before transformers' bare error
        data = _check_json_object(path / name)
        if data is not None:
            _check_tokenizer_fields(path / name, data)
    extra = _tokenizer_config(path, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, **extra
        )
    except (ValueError, TypeError) as e:  # tokenizer.json (large: parsed here only on failure)
        _check_json_object(path / "tokenizer.json")
        if isinstance(e, TypeError):  # e.g. a special token dict transformers does not take
            raise ValueError(f"the tokenizer files in {path} cannot be loaded: {e}") from e
        raise
    if getattr(tokenizer, "chat_template", None) is None:  # a VLM's may be its processor's only
        tokenizer.chat_template = processor_chat_template(resolved.path)
    return tokenizer


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path):
    """One parse per file for config, tokenizer and weights (the data stays memory-mapped)."""
    from paged_engine.gguf import GGUFFile

    return GGUFFile(path)


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_DTYPE_SUBS = ("vision_config", "encoder_config")


def _dtype_configs(hf_config) -> Iterator[Any]:
    """The configs that may name the checkpoint's dtype, in vLLM's order: the root, then (read
    only when the root names none) its text, vision and encoder configs."""
    yield hf_config
    get_text = getattr(hf_config, "get_text_config", None)
    subs = (get_text() if get_text else None, *(getattr(hf_config, k, None) for k in _DTYPE_SUBS))
    yield from (sub for sub in subs if sub is not None)


def resolve_dtype(dtype: str | torch.dtype, hf_config) -> torch.dtype:
    """ "auto" = the checkpoint's dtype (config `dtype` / `torch_dtype`), float32 if absent."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # vars(): transformers 5 warns on reading the deprecated `torch_dtype` attribute. A root
        # without one: its text, vision, then encoder config's (vLLM's order; Qwen3-VL writes
        # its dtype in text_config alone).
        cfg = None
        for sub in _dtype_configs(hf_config):
            attrs = sub if isinstance(sub, dict) else vars(sub)
            cfg = attrs.get("dtype") or attrs.get("torch_dtype")
            if cfg:
                break
        if cfg is None:
            return torch.float32
        if isinstance(cfg, torch.dtype):
            return cfg if cfg in _DTYPES.values() else torch.float32
        return _DTYPES.get(str(cfg).removeprefix("torch."), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, float16 or bfloat16")
    return _DTYPES[dtype]


@contextlib.contextmanager
def building_in(dtype: torch.dtype, device: torch.device | str) -> Iterator[None]:
    """Modules built inside are created directly on `device` in `dtype`."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def multi_axis_positions(hf_config) -> bool:
    """Whether the model's prompts may carry M-RoPE position tables (worker/rope_positions.py),
    whose positions run past max_model_len (a video's time axis, text shifted after images):
    an image wrapper whose layout has M-RoPE. Its video processor makes tables exactly then
    (Qwen2-VL's family, GLM-4.1V, the Omni thinkers; Gemma 4's, LLaVA-NeXT-Video's, Kimi
    K2.5's and Ovis2.5's positions are plain), and audio processors never make one (an Omni
    thinker's audio in a video is in its video's table). Otherwise every rope position is a
    sequence position, below max_model_len."""
    from paged_engine.multimodal.archs import KINDS
    from paged_engine.multimodal.layout_table import LAYOUTS

    archs = getattr(hf_config, "architectures", None) or []
    return any(getattr(LAYOUTS.get(KINDS[a]), "mrope", True) for a in archs if a in KINDS)


def load_model(
    resolved: ResolvedModel,
    hf_config,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    max_model_len: int | None = None,
) -> nn.Module:
    """Build the model directly on `device` in `dtype` and fill its weights; `quantization`
    ("int8" / "int4", CPU) then quantizes its linear layers (layers/quantization.py), or
    KEEP_CODES keeps a 4-bit checkpoint's codes (packed_codes.py);
    `max_model_len` (the engine's) picks length-dependent rope scalings (longrope) and, unless
    the model has M-RoPE positions (`multi_axis_positions`), the rope tables' length."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {LOAD_FORMATS}")
    cls = get_model_class(hf_config)
    # A 4-bit checkpoint's codes: kept on CUDA by default, and where int4 is asked for (the
    # layers they cannot serve are quantized by quantize_model below). Linear layers and
    # experts are then built without dense weights; each becomes its codes as they load.
    codes = load_format != "dummy" and (
        quantization == KEEP_CODES
        or (quantization == "int4" and keeps_codes(packed_scheme(hf_config)))
    )
    bounded = not multi_axis_positions(hf_config)
    with (
        building_in(dtype, device),
        rope_context_len(max_model_len, bounded_positions=bounded),
        deferred_weights(codes),
    ):
        model = cls(hf_config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        from paged_engine.tied_weights import untie_differing_head

        # a config tying a head the checkpoint holds with other values: untied, as HF does
        untie_differing_head(model, resolved, hf_config, load_format, dtype)
        # An fp8 KV cache's scales, when the checkpoint has them (worker/kv_scales.py).
        kv_scales: dict[int, dict[str, float]] = {}
        load = CodesLoad(model) if codes else None
        with load.watching() if load is not None else contextlib.nullcontext():
            model.load_weights(
                checkpoint_weights(
                    resolved, hf_config, dtype, device, load_format, kv_scales, keep_codes=codes
                )
            )
        model.checkpoint_kv_scales = kv_scales
        if load is not None:
            kept = len(load.converted)
            left = len({id(module) for module, _ in load.leftovers()})
            logger.info(
                "4-bit checkpoint: %d of %d linear and MoE layers keep its codes", kept, kept + left
            )
            if left:  # a second pass, dense, for the layers the codes could not serve
                load.materialize(device)
                model.load_weights(
                    checkpoint_weights(resolved, hf_config, dtype, device, load_format, {})
                )
                load.drop_placeholders()
    if quantization is not None and quantization != KEEP_CODES:
        from paged_engine.layers.quantization import quantize_model

        quantize_model(model, quantization)
    if quantization is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the dense weights' blocks, before the KV cache is sized
    return model.eval().requires_grad_(False)


def takes_images(resolved: ResolvedModel, hf_config) -> bool:
    """Whether the checkpoint is a wrapper whose images paged runs (multimodal/llava.py)."""
    from paged_engine.models.mllama import ARCH as MLLAMA
    from paged_engine.multimodal.archs import IMAGE_ARCHS

    archs = getattr(hf_config, "architectures", None) or ()  # Mllama: the model itself
    marked = getattr(hf_config, MARKER, None) in IMAGE_ARCHS or MLLAMA in archs
    return marked and not resolved.is_gguf


def takes_audio(resolved: ResolvedModel, hf_config) -> bool:
    """Whether the checkpoint's audio runs (multimodal/audio_archs.py): a wrapper served
    through its text model, or a model of its own (Whisper)."""
    from paged_engine.multimodal.audio_archs import AUDIO_ARCHS

    archs = [getattr(hf_config, MARKER, None), *(getattr(hf_config, "architectures", None) or ())]
    return any(a in AUDIO_ARCHS for a in archs) and not resolved.is_gguf


def load_audio_encoder(
    resolved: ResolvedModel,
    hf_config,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
) -> nn.Module | None:
    """The audio tower and projector of a checkpoint whose audio paged runs, on `device` in
    `dtype`; None for any other checkpoint."""
    from transformers import AutoConfig

    from paged_engine.multimodal.audio_archs import ENCODERS, audio_kind, build_audio_encoder
    from paged_engine.multimodal.qwen_omni import thinker_config

    if not takes_audio(resolved, hf_config):
        return None
    from paged_engine.models.ultravox_config import register as register_ultravox

    register_ultravox()  # (a worker process reads config.json here first)
    from paged_engine.mistral_audio import native_audio_config
    from paged_engine.models.remote_aliases import remote_config

    config = thinker_config(  # (remote_config: a renamed class, Qwen2_5OmniModel)
        native_audio_config(resolved.path)  # Voxtral's params.json: its HF wrapper's
        or remote_config(resolved.path)
        or AutoConfig.from_pretrained(resolved.path, trust_remote_code=trust_remote_code)
    )
    if audio_kind(config) not in ENCODERS:  # the model encodes its clips itself (Whisper)
        return None
    with building_in(dtype, device):
        encoder = build_audio_encoder(config)
    return _loaded_encoder(encoder, resolved, load_format, seed)


def load_image_encoder(
    resolved: ResolvedModel,
    hf_config,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
) -> nn.Module | None:
    """The vision tower and projector of a checkpoint whose images paged runs
    (multimodal/archs.py), on `device` in `dtype`; None for any other checkpoint."""
    from paged_engine.models.transformers_backend.selection import IMPL_FIELD
    from paged_engine.multimodal.archs import ENCODERS, build_encoder, image_kind
    from paged_engine.multimodal.processor import wrapper_config

    if not takes_images(resolved, hf_config):
        return None
    config = wrapper_config(resolved.path, trust_remote_code)
    assert config is not None
    if image_kind(config) not in ENCODERS:  # the model encodes its images itself (Mllama)
        return None
    with building_in(dtype, device):
        if getattr(hf_config, IMPL_FIELD, None) == "transformers":  # HF's tower and projector
            from paged_engine.models.transformers_backend.multimodal import TransformersImageEncoder

            encoder = TransformersImageEncoder(config)
        else:
            encoder = build_encoder(config)
    return _loaded_encoder(encoder, resolved, load_format, seed)


def _loaded_encoder(
    encoder: nn.Module, resolved: ResolvedModel, load_format: str, seed: int
) -> nn.Module:
    """A built media encoder with the checkpoint's weights (random ones for "dummy")."""
    if load_format == "dummy":
        init_dummy_weights(encoder, seed)
    else:
        encoder.load_weights(iter_weights(resolved, load_format))
    return encoder.eval().requires_grad_(False)


def checkpoint_weights(
    resolved: ResolvedModel,
    hf_config,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    kv_scales: dict[int, dict[str, float]] | None = None,
    keep_codes: bool = False,
    names: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as a model's `load_weights` takes them: HF names, a VLM's
    vision weights dropped, bitsandbytes / GPTQ / AWQ / packed integer weights unpacked
    (`keep_codes`: 4-bit layers as packed_codes.CodesWeight) and FP8 / INT8 weights
    dequantized with their scales (also where only hf_quant_config.json named the scheme: the
    tensors' dtypes tell); KV-cache scales go into `kv_scales` instead. `names`: only the
    tensors whose checkpoint name it accepts are read at all (an MTP layer's, say)."""
    if names is not None:  # a few tensors of a large checkpoint: no progress bar
        weights = (w for w in iter_weights(resolved, load_format) if names(w[0]))
    else:
        total = count_weights(resolved, load_format)
        weights = track_weights(iter_weights(resolved, load_format), total, source=resolved.name)
    weights = text_model_weights(weights, hf_config)
    weights = unpack_bnb_weights(weights, bnb_scheme(hf_config), dtype, device)
    weights = unpack_weights(weights, packed_scheme(hf_config), dtype, device, keep_codes)
    ternary = quant_method(hf_config) == "bitnet"
    weights = dequantize_weights(weights, dtype, device, checkpoint_block_size(hf_config), ternary)
    return split_kv_scales(weights, {} if kv_scales is None else kv_scales)


def iter_weights(
    resolved: ResolvedModel, load_format: str = "auto"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) pairs, streamed file by file."""
    load_format = weights_format(resolved, load_format)
    if load_format == "gguf":
        if not resolved.is_gguf:
            raise ValueError(f"load_format='gguf' but {resolved.name!r} is not a .gguf model")
        from paged_engine.gguf import gguf_weights

        return gguf_weights(_open_gguf(resolved.gguf_file))
    if load_format == "mistral":
        from paged_engine.mistral_format import mistral_weights

        return mistral_weights(resolved.path)
    files = _weight_files(resolved.path, load_format)
    weights = _iter_safetensors(files) if load_format == "safetensors" else _iter_pt(files)
    from paged_engine.models.ultravox_linked import with_linked_weights

    # Ultravox's text_model_id / audio_model_id: those repos' tensors it lacks, after its own
    return with_linked_weights(resolved, weights)


def weights_format(resolved: ResolvedModel, load_format: str = "auto") -> str:
    """The format the weights load in: `load_format`, or for "auto" what the files are
    (gguf, safetensors, mistral's consolidated files or pt)."""
    if load_format != "auto":
        return load_format
    if resolved.is_gguf:
        return "gguf"
    # HF-named weights first where a repo has both them and Mistral's consolidated ones
    if any(not f.name.startswith("consolidated") for f in resolved.path.glob("*.safetensors")):
        return "safetensors"
    if any(resolved.path.glob("consolidated*.safetensors")):
        return "mistral"
    fairseq2 = [*resolved.path.glob("model.pt"), *resolved.path.glob("model.*.pt")]
    if any(resolved.path.glob("*.bin")) or fairseq2:
        return "pt"
    raise FileNotFoundError(f"no *.safetensors, *.bin or model.pt weights in {resolved.path}")


def _weight_files(path: Path, load_format: str) -> list[Path]:
    index_name, pattern = {
        "safetensors": ("model.safetensors.index.json", "*.safetensors"),
        "pt": ("pytorch_model.bin.index.json", "*.bin"),
    }[load_format]
    index = path / index_name
    if index.is_file():
        files = [path / s for s in _index_shards(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards missing from {path}: {missing}")
    else:
        # consolidated*: Mistral's native copy of the same weights (load_format="mistral")
        skip = ("training_args", "consolidated")
        files = sorted(f for f in path.glob(pattern) if not f.name.startswith(skip))
    if not files and load_format == "pt":  # fairseq2's model.pt (models/llama_remote.py)
        from paged_engine.models.llama_remote import fairseq2_files

        files = fairseq2_files(path)
    if not files:
        also = " or fairseq2's model.pt" if load_format == "pt" else ""
        raise FileNotFoundError(f"no {pattern}{also} weight files in {path}")
    return files


def _index_shards(index: Path) -> list[str]:
    """The shard files an index's weight_map names: plain relative paths inside the model
    directory (an absolute path or a `..` would read files outside it)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{index}: not a JSON object ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map is not an object of shard file names")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        parts = Path(shard).parts
        if not parts or Path(shard).is_absolute() or ".." in parts or "\\" in shard:
            raise ValueError(f"{index}: shard {shard!r} is not a file inside the model directory")
    return shards


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        yield from mmap_safetensors(file)


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


_MAX_ST_HEADER = 100_000_000  # the safetensors library's own limit, bytes


def safetensors_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    """(JSON header, offset of the tensor data) of a .safetensors file opened at its start: an
    8-byte little-endian header length, then the header mapping names to dtype / shape /
    [begin, end) byte offsets counted from the data. A malformed header (a length past the
    file, not a JSON object, an entry whose offsets leave the data or overlap another's) is a
    ValueError naming the file."""
    name = getattr(f, "name", "<safetensors>")
    start = f.tell()
    size = f.seek(0, 2) - start
    f.seek(start)
    if size < 8:
        raise ValueError(f"{name}: not a safetensors file ({size} bytes, under its 8-byte header)")
    (header_len,) = struct.unpack("<Q", f.read(8))
    if header_len > min(size - 8, _MAX_ST_HEADER):
        raise ValueError(
            f"{name}: safetensors header length {header_len} exceeds the file's {size} bytes "
            f"(or the {_MAX_ST_HEADER}-byte limit)"
        )
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}: safetensors header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: safetensors header is not a JSON object")
    _check_st_entries(name, header, size - 8 - header_len)
    return header, 8 + header_len


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_st_entries(name: str, header: dict[str, Any], data_len: int) -> None:
    """Each tensor entry: a dtype string, a shape of non-negative ints, [begin, end) within
    the `data_len` data bytes; no two entries' bytes overlap."""
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise ValueError(f"{name}: safetensors entry {key!r} lacks a dtype string")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise ValueError(f"{name}: tensor {key!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_uint(o) for o in offsets)
            or not offsets[0] <= offsets[1] <= data_len
        ):
            raise ValueError(
                f"{name}: tensor {key!r} data_offsets {offsets!r} lie outside the file's "
                f"{data_len} data bytes"
            )
        if offsets[0] < offsets[1]:
            spans.append((offsets[0], offsets[1], key))
    check_disjoint(spans, name)


def mmap_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one .safetensors file, each tensor a view of the memory-mapped file.

    Nothing is read until a tensor's bytes are touched, so a tensor-parallel rank that copies
    out its slice reads only the pages of that slice (and ranks on one node share the page
    cache). The format: `safetensors_header`, then the data."""
    with open(file, "rb") as f:
        header, base = safetensors_header(f)
        if f.seek(0, 2) == base:  # no tensor data: nothing to map
            mapped = None
        else:
            # A private (copy-on-write) mapping: writable for torch.frombuffer, never the file.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{file}: tensor {name!r} of shape {list(shape)} and dtype {info['dtype']} "
                f"needs {math.prod(shape) * dtype.itemsize} bytes; its data_offsets hold "
                f"{end - begin}"
            )
        if end == begin:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        assert mapped is not None
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin)
        yield name, flat.view(shape)


def _iter_pt(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(state.get("model_key"), str):  # fairseq2's {"model_key": k, k: state}
            state = state[state["model_key"]]
        yield from state.items()
        del state


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the right shapes: matrices ~ N(0, std), norm weights = 1, biases = 0.

    Drawn on the parameters' device (fast for large models), so a given seed gives the same
    weights on every run on the same kind of device. A parameter with a `dummy_init(param,
    generator)` fills itself (MXFP4 experts: random codes, small scales).
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        fill = getattr(param, "dummy_init", None)  # a layout of its own (MXFP4 bytes)
        if fill is not None:
            fill(param, gen)
        elif param.dim() >= 2:
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:  # 1-D weights are norm scales
            param.fill_(1.0)
