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
        config.pooler_config = sentence_transformers_pooling(model_dir) or dict(
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


_ST_MODES = (
    ("pooling_mode_cls_token", "CLS"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_lasttoken", "LAST"),
)


def sentence_transformers_pooling(model_dir: Path | None) -> dict | None:
    """The pooler_config a sentence-transformers model directory describes, or None (no such
    files, or a pooling mode paged does not run: max, weighted mean)."""
    if model_dir is None or not (model_dir / "modules.json").is_file():
        return None
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
        types = [str(m.get("type", "")) for m in modules]
        pooling = next(m for m in modules if str(m.get("type", "")).endswith("Pooling"))
        cfg = json.loads((model_dir / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
        return None
    chosen = [mode for key, mode in _ST_MODES if cfg.get(key)]
    if len(chosen) != 1:
        return None
    return {"pooling_type": chosen[0], "normalize": any(t.endswith("Normalize") for t in types)}
