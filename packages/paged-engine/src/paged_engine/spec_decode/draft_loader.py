"""Checking and loading the draft model of speculative_config={"model": ...}; the heads that
read the target's features (EAGLE-3, EAGLE-1, MTP) are spec_decode/head_loader.py's, and
`resolve_speculative_config` picks between them.

The draft proposes token ids that the target verifies, so both must speak the same vocabulary:
the same vocab_size and, where the draft ships a tokenizer, the same token -> id map. It runs
over every position the target runs, so it must reach max_model_len. Errors are ValueErrors
naming speculative_config.model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from paged_engine.distributed.parallel_state import single_stage
from paged_engine.loader import (
    ResolvedModel,
    load_hf_config,
    load_model,
    load_tokenizer,
)
from paged_engine.models.utils import CONTEXT_LENGTH_KEYS
from paged_engine.spec_decode.head_loader import (
    attach_eagle3_head,
    attach_eagle_head,
    attach_mtp_head,
    check_eagle3_head,
    check_eagle_head,
    check_mtp,
    configured_num_tokens,
    is_eagle3_head,
    resolve_draft,
    vocab_size,
)

if TYPE_CHECKING:
    from paged_engine.spec_decode.config import SpeculativeConfig
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_speculative_config(config, target_hf_config, target_tokenizer) -> None:
    """Complete `config.speculative_config` from the models where the user left it to them
    ({"model": HEAD} without a method: an EAGLE-3 head says so by its config, an EAGLE-1 head
    by "eagle-" in its name; no num_speculative_tokens: a
    speculators checkpoint's own count, or the MTP layer count), then check the draft, head or
    MTP layer against the target. ValueErrors name speculative_config."""
    from paged_engine.models.mtp import num_mtp_layers
    from paged_engine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(config.speculative_config)
    given = config.speculative_config if isinstance(config.speculative_config, dict) else {}
    if spec.model is not None and "method" not in given:
        # As vLLM tells them: an EAGLE-3 head by its config, an EAGLE-1 head by its name.
        method = None
        if is_eagle3_head(spec.model, config):
            method = "eagle3"
        elif "eagle-" in spec.model.lower():
            method = "eagle"
        else:  # a Gemma 4 assistant by its architecture
            from paged_engine.spec_decode.gemma4_assistant import is_gemma4_assistant

            method = "gemma4_assistant" if is_gemma4_assistant(spec.model, config) else None
            from paged_engine.spec_decode.mlp_speculator import is_mlp_speculator

            if method is None and is_mlp_speculator(spec.model, config):  # by its model_type
                method = "mlp_speculator"
            from paged_engine.spec_decode.medusa import is_medusa_heads

            if method is None and is_medusa_heads(spec.model, config):  # by its model_type
                method = "medusa"
        if method is not None:
            config.speculative_config = {**given, "method": method}
            spec = SpeculativeConfig.from_dict(config.speculative_config)
            spec.check_pipeline(config.pipeline_parallel_size)  # a head told by its checkpoint
    if spec.is_mtp:
        check_mtp(target_hf_config)
    if spec.num_speculative_tokens == 0:  # left to the model's config
        if spec.is_mtp:
            k = num_mtp_layers(target_hf_config)
        elif spec.is_mlp_speculator:  # one draft per stage, as vLLM defaults it
            from paged_engine.spec_decode.mlp_speculator import load_speculator_config

            assert spec.model is not None
            k = load_speculator_config(spec.model, config).n_predict
        elif spec.is_medusa:  # one draft a head
            from paged_engine.spec_decode.medusa import medusa_num_heads

            assert spec.model is not None
            k = medusa_num_heads(spec.model, config, target_hf_config)
        else:
            assert spec.model is not None
            k = configured_num_tokens(spec.model, config)
        if k is None:
            raise ValueError(
                "speculative_config.num_speculative_tokens is required: "
                f"speculative_config.model={spec.model!r} does not propose a count of its "
                "own (speculators_config.proposal_methods)"
            )
        config.speculative_config = {**config.speculative_config, "num_speculative_tokens": k}
        spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.is_mtp:  # every pass runs the first layer; vLLM asks for whole rounds of layers
        k, layers = spec.num_speculative_tokens, num_mtp_layers(target_hf_config)
        if k > layers and k % layers:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={k} must be a multiple of the "
                f"target's MTP layer count {layers} (num_nextn_predict_layers / "
                "mtp_num_hidden_layers) when above it"
            )
    if spec.is_eagle3:
        assert spec.model is not None
        check_eagle3_head(spec.model, target_hf_config, config)
    elif spec.is_eagle:
        assert spec.model is not None
        check_eagle_head(spec.model, target_hf_config, config)
    elif spec.is_gemma4_assistant:
        from paged_engine.spec_decode.gemma4_assistant import check_gemma4_assistant

        assert spec.model is not None
        check_gemma4_assistant(spec.model, target_hf_config, config)
    elif spec.is_mlp_speculator:
        from paged_engine.spec_decode.mlp_speculator import check_mlp_speculator

        assert spec.model is not None
        check_mlp_speculator(spec.model, target_hf_config, spec.num_speculative_tokens, config)
    elif spec.is_medusa:
        from paged_engine.spec_decode.medusa import check_medusa_heads

        assert spec.model is not None
        check_medusa_heads(spec.model, spec.num_speculative_tokens, target_hf_config, config)
    elif spec.model is not None:
        check_draft_model(spec.model, target_hf_config, target_tokenizer, config)
    if spec.max_model_len is not None and spec.max_model_len < config.max_model_len:
        raise ValueError(
            f"speculative_config.max_model_len={spec.max_model_len} is below max_model_len="
            f"{config.max_model_len}: the draft runs over every position the target does"
        )
    if spec.draft_tensor_parallel_size == 1 and config.tensor_parallel_size > 1:
        logger.info(
            "speculative_config.draft_tensor_parallel_size=1: the draft runs sharded like the "
            "target (tensor_parallel_size=%d), the same tokens",
            config.tensor_parallel_size,
        )


def check_draft_model(name: str, target_hf_config, target_tokenizer, config) -> None:
    """Raise ValueError unless draft `name` can draft for the target (see the module doc)."""
    where = f"speculative_config.model={name!r}"
    max_model_len, trust_remote_code = config.max_model_len, config.trust_remote_code
    try:
        resolved = resolve_draft(name, config)
        draft_config = load_hf_config(resolved, trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load the draft model ({e})") from None
    from paged_engine.models.hybrid import is_hybrid

    if is_hybrid(draft_config):  # its drafts would need a recurrent state of their own
        raise ValueError(
            f"{where}: a draft model with a recurrent state (hybrid or state-space) is not "
            "supported; pick a transformer draft"
        )
    draft_vocab, target_vocab = vocab_size(draft_config), vocab_size(target_hf_config)
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


def attach_draft_model(
    runner: ModelRunner, quantization: str | None, resolved: ResolvedModel
) -> None:
    """Load the draft of the runner's speculative_config, if it names one, built like the
    target (same dtype, device, load format, and `quantization`: the target's as the worker
    resolved it), as `runner.draft`."""
    from paged_engine.spec_decode.config import SpeculativeConfig

    config = runner.config
    if config.speculative_config is None:
        return
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if not spec.uses_draft_model:
        return
    if not runner.parallel.is_last_stage:  # the last stage proposes: it has the features
        return
    with single_stage():  # the proposer is whole there: every layer built and loaded
        try:
            _attach(runner, quantization, resolved, spec)
        except (ValueError, OSError) as e:
            # a checkpoint that does not fit its config (a weight's shape, a missing weight, no
            # weight files) is the user's speculative_config.model: the error names it
            if spec.model is None or (isinstance(e, ValueError) and "speculative_config" in str(e)):
                raise
            raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from e


def _attach(
    runner: ModelRunner, quantization: str | None, resolved: ResolvedModel, spec: SpeculativeConfig
) -> None:
    from paged_engine.spec_decode.draft_model import DraftModelRunner

    config = runner.config
    if spec.is_mtp:
        attach_mtp_head(runner, resolved, quantization)
        return
    assert spec.model is not None
    if spec.is_eagle3:
        attach_eagle3_head(runner, spec.model)
        return
    if spec.is_eagle:
        attach_eagle_head(runner, spec.model)
        return
    if spec.is_gemma4_assistant:
        from paged_engine.spec_decode.gemma4_assistant import attach_gemma4_assistant

        attach_gemma4_assistant(runner, spec.model)
        return
    if spec.is_mlp_speculator:
        from paged_engine.spec_decode.mlp_speculator import attach_mlp_speculator

        attach_mlp_speculator(runner, spec.model)
        return
    if spec.is_medusa:
        from paged_engine.spec_decode.medusa import attach_medusa_heads

        attach_medusa_heads(runner, spec.model, spec.num_speculative_tokens)
        return
    resolved = resolve_draft(spec.model, config)
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
