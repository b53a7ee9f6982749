"""What an engine changes to serve an encoder-only model (models/bert.py).

Each sequence attends to all of itself, so it must run whole in one step and compute every
position: chunked prefill and prefix caching are off (CUDA graphs too: nothing decodes).
Encoders only pool (embeddings, classification, cross-encoder scores). Their pooling comes from
sentence-transformers' files when the model directory has them (`modules.json`, the Pooling
module's `config.json`: CLS, mean or last token; a Normalize module), else the [CLS] token,
normalized, as vLLM pools BERT (a class's `default_pooler_config` where vLLM's differs);
a classifier pools what its head reads (the [CLS] token, or ModernBERT's
`classifier_pooling="mean"`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from paged_engine.models.st_modules import check_st_modules, st_modules

logger = logging.getLogger(__name__)


def encoder_class(hf_config: Any) -> type | None:
    """The encoder model class for this config, or None for any other model."""
    from paged_engine.models import get_model_class

    try:
        cls = get_model_class(hf_config)
    except ValueError:
        return None
    return cls if getattr(cls, "is_encoder", False) else None


def encoder_engine_config(config: Any, hf_config: Any, model_dir: Path | None) -> type | None:
    """Refuse (ValueError naming the option) or turn off what an encoder cannot run with, and
    pick its pooling; returns the encoder's model class, None for any other model."""
    cls = encoder_class(hf_config)
    if cls is None:
        return None
    arch = ", ".join(getattr(hf_config, "architectures", None) or ["this model"])
    unsupported = {
        "tensor_parallel_size > 1": config.tensor_parallel_size > 1,
        "pipeline_parallel_size > 1": config.pipeline_parallel_size > 1,
        "speculative_config": config.speculative_config is not None,
        "compilation_config (torch.compile)": bool(config.compilation_level),
        "enable_lora": bool(config.enable_lora),
    }
    for what, on in unsupported.items():
        if on:
            raise ValueError(f"{what} is not supported for encoder-only models ({arch})")
    config.enable_chunked_prefill = False  # a sequence attends to all of itself: one step
    config.enable_prefix_caching = False  # every position runs: no cached blocks
    config.enforce_eager = True  # it never decodes: no decode graphs to capture
    classifier = arch.endswith("ForSequenceClassification")
    # a class whose every row is its pooled vector (SPLADE) pools its own way: ST files hold
    # other modules (SpladePooling); any other embedding model runs each of its modules or none
    own_pooling = getattr(cls, "pooled_rows", False)
    if not classifier:
        sentence_transformers_max_len(config, hf_config, model_dir)
        if not own_pooling:
            check_st_modules(model_dir, arch)
    if classifier:
        reads = getattr(cls, "classifier_pooling_type", lambda c: "CLS")(hf_config)
        given = (config.pooler_config or {}).get("pooling_type", reads)
        if str(given).upper() != reads:
            raise ValueError(
                f"pooler_config: {arch}'s classification head reads the {reads} pooling of "
                f"the sequence; pooling_type {given!r} is not supported"
            )
        config.pooler_config = {**(config.pooler_config or {}), "pooling_type": reads}
    elif hasattr(cls, "config_pooling_type"):  # the pooling its config names (vLLM's rule)
        reads = cls.config_pooling_type(hf_config)
        given = (config.pooler_config or {}).get("pooling_type", reads)
        if str(given).upper() != reads:
            raise ValueError(
                f"pooler_config: {arch} pools as its config.json's `pooling` says ({reads}); "
                f"pooling_type {given!r} is not supported"
            )
        config.pooler_config = {"normalize": True, **(config.pooler_config or {})}
        config.pooler_config["pooling_type"] = reads
    elif config.pooler_config is None:
        st = None if own_pooling else sentence_transformers_pooling(model_dir)
        config.pooler_config = st or dict(
            getattr(cls, "default_pooler_config", {"pooling_type": "CLS", "normalize": True})
        )
        logger.info("%s: pooling %s", arch, config.pooler_config)
    return cls


def encoder_sep_token(hf_config: Any, tokenizer: Any) -> None:
    """BERT's token types need the [SEP] id (models/bert.py): the tokenizer's, when the config
    names none (not for a class that reads only config.json's ids: SPLADE, models/splade.py);
    a class's own `read_tokenizer` instead where it has one (GritLM's pattern tokens)."""
    cls = encoder_class(hf_config)
    if hasattr(cls, "read_tokenizer"):
        cls.read_tokenizer(hf_config, tokenizer)
        return
    if getattr(cls, "config_token_ids_only", False):
        return
    if getattr(hf_config, "sep_token_id", None) is None:
        sep = getattr(tokenizer, "sep_token_id", None)
        if isinstance(sep, int):
            hf_config.sep_token_id = sep


# sentence-transformers' pooling modes: the ones paged pools (its pooling_type), then the
# others, which it refuses; the legacy per-mode flags of a Pooling config.json (ST < 5.4)
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_OTHER_MODES = ("max", "mean_sqrt_len_tokens", "weightedmean")
_ST_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def sentence_transformers_pooling(model_dir: Path | None) -> dict | None:
    """The pooler_config a sentence-transformers model directory describes, or None (no
    modules.json, or no Pooling module in it); ValueError naming the file and field when its
    Pooling config cannot be read or pools other than one of cls / mean / lasttoken (max,
    mean_sqrt_len_tokens, weightedmean, several modes concatenated, none at all): served
    another way, its embeddings would differ (pass pooler_config to choose one)."""
    if model_dir is None:
        return None
    modules = st_modules(model_dir)
    pooling = next((m for m in modules if m["type"].endswith("Pooling")), None)
    if pooling is None:
        return None
    where = f"{pooling['path'] or '.'}/config.json"
    try:
        cfg = json.loads((model_dir / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: the Pooling module's config cannot be read ({error})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected an object, got {type(cfg).__name__}")
    if "pooling_mode" in cfg:  # sentence-transformers >= 5.4: one name, or a list of them
        field, given = "pooling_mode", cfg["pooling_mode"]
        modes = [given] if isinstance(given, str) else given
    else:
        field = "pooling_mode_*"
        modes = [mode for key, mode in _ST_FLAGS.items() if cfg.get(key)]
    if not (isinstance(modes, list) and len(modes) == 1 and modes[0] in _ST_MODES):
        raise ValueError(
            f"{where}: {field} selects {modes!r}; paged pools one of {list(_ST_MODES)} "
            f"(not {list(_ST_OTHER_MODES)}, several at once, or none): pass pooler_config "
            "to choose the pooling"
        )
    return {
        "pooling_type": _ST_MODES[modes[0]],
        "normalize": any(m["type"].endswith("Normalize") for m in modules),
    }


# the files sentence-transformers saves its Transformer module's settings in (vLLM's list)
_ST_SETTINGS = tuple(
    f"sentence_{name}_config.json"
    for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet")
)


def _st_settings(model_dir: Path | None) -> tuple[str, dict] | None:
    """(file name, contents) of sentence-transformers' settings file, None without one (or
    with one that is not an object: sentence-transformers' defaults then)."""
    if model_dir is None:
        return None
    name = next((n for n in _ST_SETTINGS if (model_dir / n).is_file()), None)
    if name is None:
        return None
    try:
        settings = json.loads((model_dir / name).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{name} cannot be read ({error})") from None
    return (name, settings) if isinstance(settings, dict) else None


def sentence_transformers_lower_case(model_dir: Path | None) -> bool:
    """do_lower_case of sentence-transformers' settings file: its text prompts are lowercased
    before they are tokenized (as sentence-transformers and vLLM do)."""
    found = _st_settings(model_dir)
    if found is None or found[1].get("do_lower_case") in (None, False):
        return False
    name, settings = found
    if settings["do_lower_case"] is not True:
        raise ValueError(
            f"{name}: do_lower_case must be true or false, got {settings['do_lower_case']!r}"
        )
    return True


def sentence_transformers_max_len(config: Any, hf_config: Any, model_dir: Path | None) -> None:
    """max_seq_length of sentence-transformers' settings file, as vLLM reads it: the model's
    context length (max_model_len when none is given, kept within the model's positions);
    a larger max_model_len is refused by name. ValueError naming the file and field when it
    is not a positive int."""
    found = _st_settings(model_dir)
    if found is None or "max_seq_length" not in found[1]:
        return  # sentence-transformers' own default: the model's length
    name, settings = found
    n = settings["max_seq_length"]
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: max_seq_length must be a positive int, got {n!r}")
    from paged_engine.engine.llm_engine import _max_positions

    if config.max_model_len is None:
        config.max_model_len = min(n, _max_positions(hf_config) or n)
    elif config.max_model_len > n:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds max_seq_length={n} of {name} "
            "(the longest input the model was trained for)"
        )
