"""Checking and loading the draft model of speculative_config={"model": ...}.

The draft proposes token ids that the target verifies, so both must speak the same vocabulary:
the same vocab_size and, where the draft ships a tokenizer, the same token -> id map. It runs
over every position the target runs, so it must reach max_model_len. Errors are ValueErrors
naming speculative_config.model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from paged_engine.loader import load_hf_config, load_model, load_tokenizer, resolve_model
from paged_engine.models.utils import CONTEXT_LENGTH_KEYS

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _vocab_size(hf_config) -> int:
    return int(getattr(hf_config, "vocab_size", 0) or 0)


def check_draft_model(
    name: str, target_hf_config, target_tokenizer, max_model_len: int, trust_remote_code: bool
) -> None:
    """Raise ValueError unless draft `name` can draft for the target (see the module doc)."""
    where = f"speculative_config.model={name!r}"
    try:
        resolved = resolve_model(name)
        draft_config = load_hf_config(resolved, trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load the draft model ({e})") from None
    from paged_engine.models.hybrid import is_hybrid

    if is_hybrid(draft_config):  # its drafts would need a recurrent state of their own
        raise ValueError(
            f"{where}: a draft model with a recurrent state (hybrid or state-space) is not "
            "supported; pick a transformer draft"
        )
    draft_vocab, target_vocab = _vocab_size(draft_config), _vocab_size(target_hf_config)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"{where}: the draft's vocab_size {draft_vocab} differs from the target's "
            f"{target_vocab}; a draft model must share the target's tokenizer and vocabulary"
        )
    lengths = (getattr(draft_config, k, None) for k in CONTEXT_LENGTH_KEYS)
    limit = next((v for v in lengths if isinstance(v, int) and v > 0), None)
    if limit is not None and limit < max_model_len:
        raise ValueError(
            f"{where}: the draft's maximum context length {limit} is below max_model_len="
            f"{max_model_len}; lower max_model_len or pick a draft that reaches it"
        )
    try:
        draft_tokenizer = load_tokenizer(resolved, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        logger.warning("%s has no tokenizer of its own: checked by vocab_size only", where)
        return
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"{where}: the draft's tokenizer maps tokens to ids differently from the target's; "
            "a draft model must share the target's tokenizer"
        )


def attach_draft_model(runner: ModelRunner, quantization: str | None) -> None:
    """Load the draft of the runner's speculative_config, if it names one, built like the
    target (same dtype, device, load format, and `quantization`: the target's as the worker
    resolved it), as `runner.draft`."""
    from paged_engine.spec_decode.config import SpeculativeConfig
    from paged_engine.spec_decode.draft_model import DraftModelRunner

    config = runner.config
    if config.speculative_config is None:
        return
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if not spec.uses_draft_model:
        return
    assert spec.model is not None
    resolved = resolve_model(spec.model)
    hf_config = load_hf_config(resolved, config.trust_remote_code)
    logger.info("loading the draft model %s", spec.model)
    model = load_model(
        resolved,
        hf_config,
        dtype=next(runner.model.parameters()).dtype,
        device=runner.device,
        load_format=config.load_format,
        seed=config.seed,
        quantization=quantization,
        max_model_len=config.max_model_len,
    )
    runner.draft = DraftModelRunner(model.eval(), hf_config, runner)
