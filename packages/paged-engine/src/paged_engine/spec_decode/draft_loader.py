"""Checking and loading the draft model of speculative_config={"model": ...}, or the EAGLE-3
head of {"method": "eagle3", "model": ...}.

The draft proposes token ids that the target verifies, so both must speak the same vocabulary:
the same vocab_size and, where the draft ships a tokenizer, the same token -> id map. It runs
over every position the target runs, so it must reach max_model_len. Errors are ValueErrors
naming speculative_config.model.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from paged_engine.loader import (
    ResolvedModel,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_model,
)
from paged_engine.models.utils import CONTEXT_LENGTH_KEYS

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _vocab_size(hf_config) -> int:
    return int(getattr(hf_config, "vocab_size", 0) or 0)


def resolve_speculative_config(config, target_hf_config, target_tokenizer) -> None:
    """Complete `config.speculative_config` from the models where the user left it to them
    ({"model": HEAD} without a method: an EAGLE-3 head says so; no num_speculative_tokens: a
    speculators checkpoint's own count, or the MTP layer count), then check the draft, head or
    MTP layer against the target. ValueErrors name speculative_config."""
    from paged_engine.models.mtp import num_mtp_layers
    from paged_engine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(config.speculative_config)
    given = config.speculative_config if isinstance(config.speculative_config, dict) else {}
    if (
        spec.model is not None
        and "method" not in given
        and is_eagle3_head(spec.model, config.trust_remote_code)
    ):
        config.speculative_config = {**given, "method": "eagle3"}
        spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.is_mtp:
        check_mtp(target_hf_config)
    if spec.num_speculative_tokens == 0:  # left to the model's config
        if spec.is_mtp:
            k = num_mtp_layers(target_hf_config)
        else:
            assert spec.model is not None
            k = configured_num_tokens(spec.model)
        if k is None:
            raise ValueError(
                "speculative_config.num_speculative_tokens is required: "
                f"speculative_config.model={spec.model!r} does not propose a count of its "
                "own (speculators_config.proposal_methods)"
            )
        config.speculative_config = {**config.speculative_config, "num_speculative_tokens": k}
        spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec.is_eagle3:
        assert spec.model is not None
        check_eagle3_head(spec.model, target_hf_config, config.trust_remote_code)
    elif spec.model is not None:
        check_draft_model(
            spec.model,
            target_hf_config,
            target_tokenizer,
            config.max_model_len,
            config.trust_remote_code,
        )


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


def load_eagle3_config(resolved: ResolvedModel, trust_remote_code: bool):
    """The head's config: transformers' for the EAGLE authors' layout, or for a checkpoint in
    the `speculators` layout (config.json with `speculators_model_type` "eagle3", the layer's
    Llama config under `transformer_layer_config`) a LlamaConfig built from it as vLLM reads
    it (`norm_before_residual` defaults to true there). ValueError for another speculators
    algorithm."""
    raw = None
    config_file = resolved.path / "config.json"
    if not resolved.is_gguf and config_file.is_file():
        raw = json.loads(config_file.read_text())
    if not isinstance(raw, dict) or "speculators_model_type" not in raw:
        return load_hf_config(resolved, trust_remote_code)
    kind = raw.get("speculators_model_type")
    layer = raw.get("transformer_layer_config")
    if kind != "eagle3" or not isinstance(layer, dict):
        raise ValueError(
            f"a speculators checkpoint of type {kind!r} (paged runs 'eagle3' ones, with a "
            "transformer_layer_config)"
        )
    if raw.get("norm_before_fc"):
        raise ValueError("norm_before_fc (an RMSNorm before the head's fc) is not supported")
    from transformers import LlamaConfig

    fields = {k: v for k, v in layer.items() if k != "model_type"}
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            fields[key] = raw[key]
    fields["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    fields["architectures"] = ["Eagle3LlamaForCausalLM"]
    return LlamaConfig(**fields)


def configured_num_tokens(name: str) -> int | None:
    """The draft count a speculators checkpoint proposes (`speculators_config.proposal_methods
    [0].speculative_tokens`), None where it names none or cannot be read."""
    try:
        resolved = resolve_model(name)
        raw = json.loads((resolved.path / "config.json").read_text())
        k = raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return k if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16 else None


def is_eagle3_head(name: str, trust_remote_code: bool) -> bool:
    """Whether `name` holds an EAGLE-3 head (either layout); False where it cannot be read."""
    from paged_engine.models.llama_eagle3 import is_eagle3_config

    try:
        return is_eagle3_config(load_eagle3_config(resolve_model(name), trust_remote_code))
    except (OSError, ValueError):
        return False


def check_eagle3_head(name: str, target_hf_config, trust_remote_code: bool) -> None:
    """Raise ValueError unless `name` is an EAGLE-3 head for this target: an EAGLE-3 config,
    the target's vocab_size, features as wide as the target's hidden size, aux layer ids the
    target has."""
    from paged_engine.models.llama_eagle3 import (
        EAGLE3_ARCHITECTURES,
        aux_layer_ids,
        is_eagle3_config,
        reads_aux_streams,
    )

    where = f"speculative_config.model={name!r}"
    try:
        head_config = load_eagle3_config(resolve_model(name), trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load the EAGLE-3 head ({e})") from None
    if not is_eagle3_config(head_config):
        archs = getattr(head_config, "architectures", None)
        raise ValueError(
            f"{where}: method 'eagle3' needs an EAGLE-3 head (architectures "
            f"{list(EAGLE3_ARCHITECTURES)}), got {archs}"
        )
    if not reads_aux_streams(head_config):
        raise ValueError(
            f"{where}: eagle_config.use_aux_hidden_state is false (a head reading only the "
            "target's last hidden state): not supported; EAGLE-3 heads read three layers"
        )
    head_vocab, target_vocab = _vocab_size(head_config), _vocab_size(target_hf_config)
    if head_vocab != target_vocab:
        raise ValueError(
            f"{where}: the head's vocab_size {head_vocab} differs from the target's "
            f"{target_vocab}; an EAGLE-3 head is trained for one target"
        )
    width = getattr(head_config, "target_hidden_size", None) or head_config.hidden_size
    if int(width) != int(target_hf_config.hidden_size):
        raise ValueError(
            f"{where}: the head reads features of width {width}, the target's hidden size is "
            f"{target_hf_config.hidden_size}; an EAGLE-3 head is trained for one target"
        )
    try:
        aux_layer_ids(head_config, int(target_hf_config.num_hidden_layers))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def attach_eagle3_head(runner: ModelRunner, name: str) -> None:
    """Load the EAGLE-3 head `name` on the runner's device in the target's dtype as
    `runner.draft`, sharing the target's token embedding where the head has none."""
    from paged_engine.layers.rotary import rope_context_len
    from paged_engine.loader import building_in, checkpoint_weights, init_dummy_weights
    from paged_engine.models.llama_eagle3 import Eagle3LlamaForCausalLM, aux_layer_ids
    from paged_engine.spec_decode.eagle import Eagle3Runner

    config = runner.config
    resolved = resolve_model(name)
    hf_config = load_eagle3_config(resolved, config.trust_remote_code)
    dtype = next(runner.model.parameters()).dtype
    # The head runs at every position the target does (its rope tables must reach them);
    # heads ship with their training length (often 2,048).
    max_len = int(config.max_model_len or 0)
    if int(getattr(hf_config, "max_position_embeddings", 0) or 0) < max_len:
        hf_config.max_position_embeddings = max_len
    logger.info("loading the EAGLE-3 head %s", name)
    with building_in(dtype, runner.device), rope_context_len(config.max_model_len):
        head = Eagle3LlamaForCausalLM(hf_config)
    if config.load_format == "dummy":
        init_dummy_weights(head, config.seed)
        head.shares_target_embedding = True
        head.finish_loading()
    else:
        head.load_weights(
            checkpoint_weights(resolved, hf_config, dtype, runner.device, config.load_format, {})
        )
    if head.shares_target_embedding:
        head.embed_tokens = runner.model.get_submodule(runner.model.embed_path)
    layers = aux_layer_ids(hf_config, int(runner.hf_config.num_hidden_layers))
    runner.draft = Eagle3Runner(head.eval().requires_grad_(False), hf_config, runner, layers)


def check_mtp(target_hf_config) -> None:
    """Raise ValueError (naming speculative_config) unless the target has an MTP layer paged
    runs: DeepSeek-style models (models/deepseek_v2.py: V3, R1) and Qwen3-Next / Qwen3.5
    (models/qwen3_next.py) whose config declares one."""
    from paged_engine.models import get_model_class
    from paged_engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from paged_engine.models.mtp import num_mtp_layers
    from paged_engine.models.qwen3_next import Qwen3_5ForCausalLM

    arch = ", ".join(getattr(target_hf_config, "architectures", None) or ["this model"])
    try:
        cls = get_model_class(target_hf_config)
    except ValueError:
        cls = None
    if cls is None or not issubclass(cls, (DeepseekV2ForCausalLM, Qwen3_5ForCausalLM)):
        raise ValueError(
            f"speculative_config method 'mtp' runs the MTP layers of DeepSeek-V3-style and "
            f"Qwen3-Next / Qwen3.5 models; {arch} is not one"
        )
    if num_mtp_layers(target_hf_config) < 1:
        raise ValueError(
            f"speculative_config method 'mtp': {arch} has no MTP layer (its config declares "
            "none: num_nextn_predict_layers / mtp_num_hidden_layers 0 or absent)"
        )


def attach_mtp_head(runner: ModelRunner, resolved: ResolvedModel, quantization: str | None):
    """Build the target's first MTP layer on the runner's device and dtype, load it from the
    target's own checkpoint (its tensors only) and set `runner.draft`; the target's embedding
    and LM head serve where the checkpoint has no copies of its own."""
    from paged_engine.layers.rotary import rope_context_len
    from paged_engine.loader import building_in, checkpoint_weights, init_dummy_weights
    from paged_engine.models.mtp import (
        DeepseekMtpHead,
        Qwen3NextMtpHead,
        is_qwen_mtp,
        mtp_cache_config,
        mtp_weight_name,
    )
    from paged_engine.packed_codes import KEEP_CODES
    from paged_engine.spec_decode.eagle import MtpRunner

    config, hf_config, target = runner.config, runner.hf_config, runner.model
    dtype = next(target.parameters()).dtype
    logger.info("loading the target's MTP layer")
    qwen = is_qwen_mtp(hf_config)
    head_cls = Qwen3NextMtpHead if qwen else DeepseekMtpHead
    with building_in(dtype, runner.device), rope_context_len(config.max_model_len):
        head = head_cls(hf_config, type(target))
    if config.load_format == "dummy":
        init_dummy_weights(head, config.seed)
        if not qwen:
            head.shares_target_embedding = head.shares_target_head = True
    else:
        weights = checkpoint_weights(
            resolved,
            hf_config,
            dtype,
            runner.device,
            config.load_format,
            {},
            names=lambda name: mtp_weight_name(hf_config, name) is not None,
        )
        head.load_weights((mtp_weight_name(hf_config, n) or n, w) for n, w in weights)
    if quantization is not None and quantization != KEEP_CODES:
        from paged_engine.layers.quantization import quantize_model

        quantize_model(head, quantization)  # as the target's are, before sharing any of them
    # The target's embedding and LM head where the layer has none of its own (Qwen's never).
    embed, lm_head = target.get_submodule(target.embed_path), target.get_submodule(target.head_name)
    if qwen:
        head.embed_tokens, head.lm_head = embed, lm_head
    else:
        if head.shares_target_embedding:
            head.embed_tokens = embed
        if head.shares_target_head:
            head.shared_head.head = lm_head
    runner.draft = MtpRunner(head.eval().requires_grad_(False), mtp_cache_config(hf_config), runner)


def attach_draft_model(
    runner: ModelRunner, quantization: str | None, resolved: ResolvedModel
) -> None:
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
    if spec.is_mtp:
        attach_mtp_head(runner, resolved, quantization)
        return
    assert spec.model is not None
    if spec.is_eagle3:
        attach_eagle3_head(runner, spec.model)
        return
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
