"""Checking and loading the heads that draft from the target's features: EAGLE-3 heads
({"method": "eagle3", "model": ...}: models/llama_eagle3.py, both checkpoint layouts), EAGLE-1
heads ({"method": "eagle", ...}: models/llama_eagle.py, minicpm_eagle.py, deepseek_eagle.py)
and the target's own MTP layer ({"method": "mtp"}: models/mtp.py, mimo_mtp.py, mtp_more.py).
Errors are ValueErrors naming speculative_config.

A head runs at the target's positions, below max_model_len (drafts never pass it: the
planner's room), so its plain ropes hold max_model_len rows where the target's do
(`head_ropes`: not for a target whose prompts may carry M-RoPE positions).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from paged_engine.layers.rotary import rope_context_len
from paged_engine.loader import ResolvedModel, load_hf_config, multi_axis_positions, resolve_model

if TYPE_CHECKING:
    from torch import nn

    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def head_ropes(runner: ModelRunner) -> contextlib.AbstractContextManager[None]:
    """Where a head for `runner`'s target is built: its ropes serve max_model_len and, as the
    target's (loader.load_model), stop there unless the target has M-RoPE positions."""
    bounded = not multi_axis_positions(runner.hf_config)
    return rope_context_len(runner.config.max_model_len, bounded_positions=bounded)


def vocab_size(hf_config) -> int:
    return int(getattr(hf_config, "vocab_size", 0) or 0)


def reach_max_model_len(hf_config, max_model_len: int | None) -> None:
    """A head runs at every position the target does, so its rope tables must reach them;
    heads ship with their training length (often 2,048)."""
    max_len = int(max_model_len or 0)
    if int(getattr(hf_config, "max_position_embeddings", 0) or 0) < max_len:
        hf_config.max_position_embeddings = max_len


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


def resolve_draft(name: str, config) -> ResolvedModel:
    """A draft model or head as the target is resolved: at speculative_config.revision, through
    the engine's download_dir and hf_token."""
    from paged_engine.spec_decode.config import SpeculativeConfig

    revision = None
    if config.speculative_config is not None:
        revision = SpeculativeConfig.from_dict(config.speculative_config).revision
    return resolve_model(name, revision, config.download_dir, token=config.hf_token)


def configured_num_tokens(name: str, config) -> int | None:
    """The draft count a speculators checkpoint proposes (`speculators_config.proposal_methods
    [0].speculative_tokens`), None where it names none or cannot be read."""
    try:
        resolved = resolve_draft(name, config)
        raw = json.loads((resolved.path / "config.json").read_text())
        k = raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return k if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 16 else None


def is_eagle3_head(name: str, config) -> bool:
    """Whether `name` holds an EAGLE-3 head (either layout); False where it cannot be read."""
    from paged_engine.models.llama_eagle3 import is_eagle3_config

    try:
        head = load_eagle3_config(resolve_draft(name, config), config.trust_remote_code)
        return is_eagle3_config(head)
    except (OSError, ValueError):
        return False


def check_eagle3_head(name: str, target_hf_config, config) -> None:
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
        resolved = resolve_draft(name, config)
        head_config = load_eagle3_config(resolved, config.trust_remote_code)
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
    head_vocab, target_vocab = vocab_size(head_config), vocab_size(target_hf_config)
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
    from paged_engine.loader import building_in, checkpoint_weights, init_dummy_weights
    from paged_engine.models.llama_eagle3 import Eagle3LlamaForCausalLM, aux_layer_ids
    from paged_engine.spec_decode.eagle import Eagle3Runner

    config = runner.config
    resolved = resolve_draft(name, runner.config)
    hf_config = load_eagle3_config(resolved, config.trust_remote_code)
    dtype = next(runner.model.parameters()).dtype
    reach_max_model_len(hf_config, config.max_model_len)
    logger.info("loading the EAGLE-3 head %s", name)
    with building_in(dtype, runner.device), head_ropes(runner):
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


def check_eagle_head(name: str, target_hf_config, config) -> None:
    """Raise ValueError unless `name` is an EAGLE-1 head for this target: a Llama-style config
    (not an EAGLE-3 one) with the target's vocab_size and hidden size."""
    from paged_engine.models.llama_eagle3 import is_eagle3_config

    where = f"speculative_config.model={name!r}"
    try:
        resolved = resolve_draft(name, config)
        head_config = load_eagle3_config(resolved, config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load the EAGLE head ({e})") from None
    if is_eagle3_config(head_config):
        raise ValueError(f"{where} is an EAGLE-3 head: use method 'eagle3'")
    for key in ("vocab_size", "hidden_size"):
        head, target = getattr(head_config, key, None), getattr(target_hf_config, key, None)
        if head != target:
            raise ValueError(
                f"{where}: the head's {key} {head} differs from the target's {target}; an "
                "EAGLE head is trained for one target"
            )
    from paged_engine.models.deepseek_eagle import deepseek_eagle_kind

    try:  # DeepSeek-V3 / Mistral Large 3 heads: what paged does not serve, by name
        deepseek_eagle_kind(resolved.path, head_config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def attach_eagle_head(runner: ModelRunner, name: str) -> None:
    """Load the EAGLE-1 head `name` on the runner's device in the target's dtype as
    `runner.draft`, over the target's embedding and LM head."""
    from paged_engine.loader import building_in, checkpoint_weights, init_dummy_weights
    from paged_engine.models.llama_eagle import EagleLlamaHead
    from paged_engine.models.minicpm_eagle import EagleMiniCPMHead, is_minicpm_eagle_config
    from paged_engine.spec_decode.eagle import FinalHiddenRunner

    config, target = runner.config, runner.model
    resolved = resolve_draft(name, runner.config)
    hf_config = load_hf_config(resolved, config.trust_remote_code)
    reach_max_model_len(hf_config, config.max_model_len)
    dtype = next(target.parameters()).dtype
    logger.info("loading the EAGLE head %s", name)
    from paged_engine.models.deepseek_eagle import attach_deepseek_eagle_head, deepseek_eagle_kind

    if deepseek_eagle_kind(resolved.path, hf_config) is not None:  # DeepSeek-V3 / Large 3 layers
        attach_deepseek_eagle_head(runner, resolved, hf_config)
        return
    with building_in(dtype, runner.device), head_ropes(runner):
        minicpm = is_minicpm_eagle_config(hf_config)  # vLLM's EagleMiniCPMForCausalLM
        head = (EagleMiniCPMHead if minicpm else EagleLlamaHead)(hf_config)
    if config.load_format == "dummy":
        init_dummy_weights(head, config.seed)
    else:
        head.load_weights(
            checkpoint_weights(resolved, hf_config, dtype, runner.device, config.load_format, {})
        )
    if getattr(head, "shares_target_embedding", True):  # a MiniCPM head may bring its own
        head.embed_tokens = target.get_submodule(target.embed_path)
    if getattr(head, "shares_target_head", True):
        head.lm_head = target.get_submodule(target.head_name)
    runner.draft = FinalHiddenRunner(head.eval().requires_grad_(False), hf_config, runner)


def check_mtp(target_hf_config) -> None:
    """Raise ValueError (naming speculative_config) unless the target has an MTP layer paged
    runs: DeepSeek-style models (models/deepseek_v2.py: V3, R1), GLM-4.5 / 4.6
    (models/glm4_moe.py), Qwen3-Next / Qwen3.5 (models/qwen3_next.py), MiMo-7B
    (models/mimo_mtp.py), ERNIE 4.5 MoE and LongCat-Flash (models/mtp_more.py) whose config
    declares one."""
    from paged_engine.models import get_model_class
    from paged_engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from paged_engine.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
    from paged_engine.models.glm4_moe import Glm4MoeForCausalLM
    from paged_engine.models.llama_variants import MiMoForCausalLM
    from paged_engine.models.longcat_flash import LongcatFlashForCausalLM
    from paged_engine.models.mtp import num_mtp_layers
    from paged_engine.models.qwen3_next import Qwen3_5ForCausalLM

    families = (
        DeepseekV2ForCausalLM,
        Glm4MoeForCausalLM,
        Qwen3_5ForCausalLM,
        MiMoForCausalLM,
        Ernie4_5_MoeForCausalLM,
        LongcatFlashForCausalLM,
    )

    arch = ", ".join(getattr(target_hf_config, "architectures", None) or ["this model"])
    try:
        cls = get_model_class(target_hf_config)
    except ValueError:
        cls = None
    if cls is None or not issubclass(cls, families):
        raise ValueError(
            f"speculative_config method 'mtp' runs the MTP layers of DeepSeek-V3-style, "
            f"GLM-4.5, Qwen3-Next / Qwen3.5, MiMo-7B, ERNIE 4.5 MoE, LongCat-Flash and openPangu "
            f"MoE models; {arch} is not one"
        )
    if num_mtp_layers(target_hf_config) < 1:
        raise ValueError(
            f"speculative_config method 'mtp': {arch} has no MTP layer (its config declares "
            "none: num_nextn_predict_layers / mtp_num_hidden_layers 0 or absent)"
        )
    from paged_engine.models.mtp_more import check_more_mtp

    check_more_mtp(target_hf_config)


def load_mtp_layer(
    runner: ModelRunner,
    resolved: ResolvedModel,
    quantization: str | None,
    make: Callable[[], nn.Module],
    weight_name: Callable[[str], str | None],
) -> nn.Module:
    """`make()` built on the runner's device and dtype (rope sized to max_model_len), its
    weights the target checkpoint's tensors `weight_name` maps (to the layer's names; None:
    not the layer's) or dummy ones, quantized as the target's are (before any sharing)."""
    from paged_engine.loader import building_in, checkpoint_weights, init_dummy_weights
    from paged_engine.packed_codes import KEEP_CODES

    config, hf_config = runner.config, runner.hf_config
    dtype = next(runner.model.parameters()).dtype
    with building_in(dtype, runner.device), head_ropes(runner):
        head = make()
    if config.load_format == "dummy":
        init_dummy_weights(head, config.seed)
    else:
        weights = checkpoint_weights(
            resolved,
            hf_config,
            dtype,
            runner.device,
            config.load_format,
            {},
            names=lambda name: weight_name(name) is not None,
        )
        head.load_weights((weight_name(n) or n, w) for n, w in weights)
    if quantization is not None and quantization != KEEP_CODES:
        from paged_engine.layers.quantization import quantize_model

        quantize_model(head, quantization)
    return head


def attach_mtp_head(runner: ModelRunner, resolved: ResolvedModel, quantization: str | None):
    """Build the target's first MTP layer on the runner's device and dtype, load it from the
    target's own checkpoint (its tensors only) and set `runner.draft`; the target's embedding
    and LM head serve where the checkpoint has no copies of its own."""
    from paged_engine.models.mimo_mtp import attach_mimo_mtp_head, is_mimo_mtp
    from paged_engine.models.mtp import (
        DeepseekMtpHead,
        Qwen3NextMtpHead,
        is_qwen_mtp,
        mtp_cache_config,
        mtp_weight_name,
    )
    from paged_engine.spec_decode.eagle import FinalHiddenRunner

    if is_mimo_mtp(runner.hf_config):  # reads the target's pre-norm stream: its own runner
        attach_mimo_mtp_head(runner, resolved, quantization)
        return
    from paged_engine.models.openpangu_mtp import attach_openpangu_mtp_head, is_openpangu_mtp

    if is_openpangu_mtp(runner.hf_config):  # openPangu: its pre-norm stream, sandwich norms
        attach_openpangu_mtp_head(runner, resolved, quantization)
        return
    from paged_engine.models.mtp_more import attach_more_mtp_head, more_mtp_family

    if more_mtp_family(runner.hf_config) is not None:  # ERNIE 4.5 MoE, LongCat-Flash
        attach_more_mtp_head(runner, resolved, quantization)
        return
    config, hf_config, target = runner.config, runner.hf_config, runner.model
    logger.info("loading the target's MTP layer")
    qwen = is_qwen_mtp(hf_config)
    head_cls = Qwen3NextMtpHead if qwen else DeepseekMtpHead
    head = load_mtp_layer(
        runner,
        resolved,
        quantization,
        lambda: head_cls(hf_config, type(target)),
        lambda name: mtp_weight_name(hf_config, name),
    )
    if config.load_format == "dummy" and not qwen:  # dummy weights: no copies of its own
        head.shares_target_embedding = head.shares_target_head = True
    # The target's embedding and LM head where the layer has none of its own (Qwen's never).
    embed, lm_head = target.get_submodule(target.embed_path), target.get_submodule(target.head_name)
    if qwen:
        head.embed_tokens, head.lm_head = embed, lm_head
    else:
        if head.shares_target_embedding:
            head.embed_tokens = embed
        if head.shares_target_head:
            head.shared_head.head = lm_head
    runner.draft = FinalHiddenRunner(
        head.eval().requires_grad_(False), mtp_cache_config(hf_config), runner
    )
