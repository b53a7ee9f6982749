"""Gemma 4 with its assistant drafting (speculative_config={"method": "gemma4_assistant",
"model": ASSISTANT, "num_speculative_tokens": k}): models/gemma4_assistant.py's drafter, run as
transformers' `SinglePositionMultiTokenCandidateGenerator` runs it.

A drafting row whose own token is t_c at position c (the target has computed [0, c)) runs k
passes, all at position c and all over the target's own paged cache (no KV of the drafter's,
nothing written):

    pass 1   [embed(t_c), the target's final hidden state at c - 1] -> draft 1
    pass j   [embed(draft j - 1), post_projection of pass j - 1's state] -> draft j

each attending over the keys before c of the target's last sliding and last full layer that
compute KV (the cache the target's KV-shared layers read). The feature at c - 1 is what the
previous step's forward left (spec_decode/last_hidden.py keeps each row's last verified
position); a row without it (the step right after a prefix-cache hit or a swap, a row whose
step also runs prompt tokens) proposes its own token again, a point mass.

transformers, after a partially rejected round, still shows the drafter the target's KV of the
rejected drafts (it cuts the cache at the accepted length + 1, and the sliding cache not at
all); here the drafter sees exactly the verified positions, so the two agree after a prefill and
after a round that accepted every draft. Drafts change no output either way: the target
verifies them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.spec_decode.draft_model import DraftProposal, store_draft
from paged_engine.spec_decode.last_hidden import LastHiddenRunner

if TYPE_CHECKING:
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.worker.input_batch import CachedSeq
    from paged_engine.worker.model_runner import ModelRunner, StepInputs

ARCHITECTURE = "Gemma4AssistantForCausalLM"


class Gemma4AssistantRunner(LastHiddenRunner):
    """The drafter's proposals (see the module docstring); `kv_ids`: the indexes in the
    target's `kv_caches` of its last sliding and last full KV layers."""

    def __init__(self, model, hf_config, runner: ModelRunner, kv_ids: tuple[int, ...]) -> None:
        super().__init__(model, hf_config, runner)
        self.kv_ids = kv_ids

    def propose(
        self, sched: SchedulerOutput, cached: list[CachedSeq], inputs: StepInputs
    ) -> DraftProposal:
        plan = self._drafting_rows(sched, inputs)
        if plan is None:
            return DraftProposal({}, None, {})
        r = self.runner
        drafting, nd, c, own = plan.index, plan.num_drafts, plan.positions, plan.own
        k = int(nd.max())
        tokens = own.unsqueeze(1).repeat(1, k)  # rows the drafter cannot serve repeat it
        live, feature = plan.served, plan.hidden  # (live: indices into `drafting`)
        probs: torch.Tensor | None = None
        if feature is not None:
            assert r.cache is not None
            # one query a row at kernel position c - 1: the keys [0, c); RoPE at c itself
            md, _ = self._metadata(inputs.rows[drafting[live]], np.ones_like(live), c[live])
            positions = r._to_dev(c[live])
            kv = [r.cache.kv_caches[i] for i in self.kv_ids]
            ids = own.index_select(0, r._to_dev(live))
            for j in range(1, k + 1):
                want = np.flatnonzero(nd[live] >= j)  # into live: rows that want draft j
                if want.size == 0:
                    break
                normed, feature = self.model(ids, positions, kv, md, feature)
                rows = live[want]
                logits = self.model.compute_logits(normed.index_select(0, r._to_dev(want)))
                at = r._to_dev(rows)
                prior = tokens[:, : j - 1].index_select(0, at)
                tok, q = self._sample(logits, cached, drafting[rows], inputs, c[rows] + j, prior)
                probs = store_draft(tokens, probs, j, at, tok, q)
                ids = tokens[:, j - 1].index_select(0, r._to_dev(live))
        return self._finish_rows(sched, inputs, plan, tokens, probs)


def _store_layers(target_hf_config) -> dict[str, int]:
    """Layer type -> the target's last layer of that type that computes its own KV (what
    transformers' `shared_kv_states` holds for it)."""
    from paged_engine.models.gemma2 import gemma_layer_types
    from paged_engine.models.gemma4 import kv_sources

    types = gemma_layer_types(target_hf_config, 6)
    sources = kv_sources(target_hf_config)
    return {t: sources[max(i for i, u in enumerate(types) if u == t)] for t in set(types)}


def is_gemma4_assistant(name: str, config) -> bool:
    """Whether `name`'s config names a Gemma 4 assistant; False where it cannot be read."""
    from paged_engine.loader import load_hf_config
    from paged_engine.spec_decode.head_loader import resolve_draft

    try:
        hf_config = load_hf_config(resolve_draft(name, config), config.trust_remote_code)
    except (OSError, ValueError):
        return False
    return ARCHITECTURE in (getattr(hf_config, "architectures", None) or [])


def check_gemma4_assistant(name: str, target_hf_config, config) -> None:
    """Raise ValueError (naming speculative_config) unless `name` is a Gemma 4 assistant for
    this target: a Gemma 4 text target, one stage, the target's vocabulary, features of the
    target's width, every assistant layer type among the target's."""
    from paged_engine.loader import load_hf_config
    from paged_engine.models import get_model_class
    from paged_engine.models.gemma2 import gemma_layer_types
    from paged_engine.models.gemma4 import Gemma4ForCausalLM
    from paged_engine.models.gemma4_assistant import assistant_text_config
    from paged_engine.spec_decode.head_loader import resolve_draft, vocab_size

    where = f"speculative_config.model={name!r}"
    arch = ", ".join(getattr(target_hf_config, "architectures", None) or ["this model"])
    try:
        cls = get_model_class(target_hf_config)
    except ValueError:
        cls = None
    if cls is None or not issubclass(cls, Gemma4ForCausalLM):
        raise ValueError(
            f"speculative_config method 'gemma4_assistant' drafts for Gemma 4 text models "
            f"(Gemma4ForCausalLM); {arch} is not one"
        )
    if config.pipeline_parallel_size > 1:
        raise ValueError(
            "speculative_config method 'gemma4_assistant' does not support pipeline "
            "parallelism (the drafter reads the target's last layers' caches and its final "
            "hidden state on one stage)"
        )
    try:
        assistant = load_hf_config(resolve_draft(name, config), config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load the assistant ({e})") from None
    archs = list(getattr(assistant, "architectures", None) or [])
    if ARCHITECTURE not in archs:
        raise ValueError(f"{where}: method 'gemma4_assistant' needs a {ARCHITECTURE}, got {archs}")
    try:
        text = assistant_text_config(assistant)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    mine, target = vocab_size(text), vocab_size(target_hf_config)
    if mine != target:
        raise ValueError(
            f"{where}: the assistant's vocab_size {mine} differs from the target's {target}"
        )
    width, hidden = int(assistant.backbone_hidden_size), int(target_hf_config.hidden_size)
    if width != hidden:
        raise ValueError(
            f"{where}: the assistant's backbone_hidden_size {width} differs from the target's "
            f"hidden_size {hidden}"
        )
    missing = sorted(set(gemma_layer_types(text, 6)) - set(_store_layers(target_hf_config)))
    if missing:
        raise ValueError(f"{where}: the assistant has {missing} layers, the target has none")


def attach_gemma4_assistant(runner: ModelRunner, name: str) -> None:
    """Load the assistant `name` on the runner's device in the target's dtype, point it at
    the target's embedding and KV layers, and set `runner.draft`."""
    from paged_engine.loader import (
        building_in,
        checkpoint_weights,
        init_dummy_weights,
        load_hf_config,
    )
    from paged_engine.models.gemma4_assistant import LAYER_TYPES, Gemma4AssistantForCausalLM
    from paged_engine.spec_decode.head_loader import head_ropes, resolve_draft

    config, target = runner.config, runner.model
    resolved = resolve_draft(name, config)
    hf_config = load_hf_config(resolved, config.trust_remote_code)
    dtype = next(target.parameters()).dtype
    with building_in(dtype, runner.device), head_ropes(runner):
        head = Gemma4AssistantForCausalLM(hf_config)
    if config.load_format == "dummy":
        init_dummy_weights(head, config.seed)
    else:
        head.load_weights(
            checkpoint_weights(resolved, hf_config, dtype, runner.device, config.load_format, {})
        )
    inner = target.model
    stores = _store_layers(runner.hf_config)
    own = [i for i, s in enumerate(inner.sources) if s == i]  # layers in kv_caches order
    head.attach_target(
        inner.embed_input_ids, {t: inner.layers[i].self_attn.attn for t, i in stores.items()}
    )
    # a type the assistant lacks (so never reads) points at any of the target's KV layers
    fallback = next(iter(stores.values()))
    kv_ids = tuple(own.index(stores.get(t, fallback)) for t in LAYER_TYPES)
    runner.draft = Gemma4AssistantRunner(
        head.eval().requires_grad_(False), hf_config, runner, kv_ids
    )
