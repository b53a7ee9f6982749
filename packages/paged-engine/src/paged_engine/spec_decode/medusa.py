"""Medusa heads (speculative_config={"method": "medusa", "model": HEADS,
"num_speculative_tokens": k}): vLLM's `Medusa` model (model_executor/models/medusa.py) and its
`MedusaProposer` (v1/spec_decode/medusa.py); Cai et al. 2024, github.com/FasterDecoding/Medusa.

Head i (0-based) reads the target's final normed hidden state h_p (its LM head's input at
position p), runs `num_hidden_layers` residual blocks x <- x + SiLU(W x + b) and its own LM head,
and guesses the token at p + 2 + i: the target's LM head gives p + 1, which the step samples.
All drafts of a row come from that one hidden state of the last position the target verified:
nothing runs autoregressively, so the heads cache nothing and the runner keeps one [D] vector a
sequence between steps (spec_decode/last_hidden.py). Only the first k heads are built and loaded
(vLLM sets num_heads to k the same way).

A drafting row whose own token sits at c needs h_{c-1}: the target's last verified position of
its previous step. A row without it (a fan-out's sibling, a sequence the worker dropped and got
back) proposes its own token k times, point masses: acceptance may drop, outputs never change.
Drafts are drawn like every worker proposer's (spec_decode/draft_model.py `_sample`: the row's
sampling settings, q kept for exact verification; draft_sample_method="greedy" takes the argmax,
vLLM's only mode).

Checkpoints (config.json plus *.safetensors, *.bin, or FasterDecoding's medusa_lm_head.pt):
  vLLM's layout      config hidden_size, vocab_size, num_heads, num_hidden_layers,
                     truncated_vocab_size, original_lm_head, medusa_fc_bias, logit_scale;
                     tensors blocks.{i}.layers.{j}.weight / .bias, lm_heads.{i}.weight (one
                     shared LM head as lm_heads.0 or lm_head with original_lm_head), token_map;
                     an optional "medusa_heads." prefix
  FasterDecoding's   config medusa_num_heads, medusa_num_layers (vLLM's config renames them);
                     tensors {i}.{j}.linear.weight / .bias (blocks, which always have a bias
                     there) and {i}.{num_layers}.weight (head i's LM head)
A width or vocabulary the config leaves out is the target's (the tensors' shapes are checked).
truncated_vocab_size < vocab_size (vLLM's token_map): the LM heads score only token_map's ids
(full-vocabulary rows are cut down to them at load), every other id gets -inf.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paged_engine.spec_decode.draft_model import DraftProposal, store_draft
from paged_engine.spec_decode.last_hidden import LastHiddenRunner

if TYPE_CHECKING:
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.loader import ResolvedModel
    from paged_engine.worker.input_batch import CachedSeq
    from paged_engine.worker.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)


# ---- config -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int  # residual blocks per head (0: the LM head reads h directly)
    truncated_vocab_size: int  # == vocab_size unless the heads score token_map's ids only
    original_lm_head: bool  # one LM head shared by every head
    fc_bias: bool
    logit_scale: float = 1.0


def read_medusa_config(path: Path) -> dict[str, Any] | None:
    """config.json of a Medusa checkpoint (vLLM's `model_type: "medusa"` or FasterDecoding's
    `medusa_num_heads`), None for anything else."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    return raw if raw.get("model_type") == "medusa" or "medusa_num_heads" in raw else None


def medusa_config(raw: dict[str, Any], target_hf_config) -> MedusaConfig:
    """The heads' config from their config.json (either layout); ValueError naming a field."""

    def field(keys: tuple[str, ...], default: Any) -> Any:
        return next((raw[k] for k in keys if raw.get(k) is not None), default)

    def count(name: str, v: Any, least: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"the Medusa config's {name} must be an int >= {least}, got {v!r}")
        return v

    vocab = count("vocab_size", field(("vocab_size",), target_hf_config.vocab_size), 1)
    truncated = count("truncated_vocab_size", field(("truncated_vocab_size",), vocab), 1)
    if truncated > vocab:
        raise ValueError(
            f"the Medusa config's truncated_vocab_size {truncated} exceeds its vocab_size {vocab}"
        )
    return MedusaConfig(
        hidden_size=count("hidden_size", field(("hidden_size",), target_hf_config.hidden_size), 1),
        vocab_size=vocab,
        num_heads=count("num_heads", field(("num_heads", "medusa_num_heads"), None), 1),
        num_hidden_layers=count(
            "num_hidden_layers", field(("num_hidden_layers", "medusa_num_layers"), 1), 0
        ),
        truncated_vocab_size=truncated,
        original_lm_head=bool(raw.get("original_lm_head", False)),
        fc_bias=bool(raw.get("medusa_fc_bias", "medusa_num_heads" in raw)),
        logit_scale=float(raw.get("logit_scale") or 1.0),
    )


# ---- the heads ----------------------------------------------------------------------------------
class _ResidualBlock(nn.Module):
    def __init__(self, width: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=bias) for _ in range(num_layers))

    def forward(self, x: Tensor) -> Tensor:  # [T, D] -> [T, D]
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


_FD_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")  # FasterDecoding's blocks
_FD_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")  # ... and its LM heads ({i}.{num_layers})
_HEAD_INDEX = re.compile(r"(?:blocks|lm_heads)\.(\d+)\.")


class MedusaHeads(nn.Module):
    """The first `num_heads` heads; `logits(i, h)` is head i's [T, vocab_size] fp32 scores."""

    def __init__(self, config: MedusaConfig, num_heads: int) -> None:
        super().__init__()
        self.config = config
        d, rows = config.hidden_size, config.truncated_vocab_size
        self.blocks = nn.ModuleList(
            _ResidualBlock(d, config.num_hidden_layers, config.fc_bias) for _ in range(num_heads)
        )
        if config.original_lm_head:
            self.lm_head = nn.Linear(d, rows, bias=False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(d, rows, bias=False) for _ in range(num_heads))
        # row r of the LM heads scores token token_map[r] (vLLM's truncated vocabulary)
        self.token_map: Tensor | None = None
        if rows < config.vocab_size:
            self.token_map = torch.arange(rows, dtype=torch.int64)

    def logits(self, i: int, h: Tensor) -> Tensor:  # h: [T, D] -> [T, vocab_size] fp32
        head = self.lm_head if self.config.original_lm_head else self.lm_heads[i]
        out = head(self.blocks[i](h)).float() * self.config.logit_scale
        if self.token_map is None:
            return out
        full = out.new_full((out.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.token_map, out)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Either layout's tensors (module docstring); the heads past the first `num_heads`
        are skipped. ValueError naming a missing or unexpected tensor, or a wrong shape."""
        from paged_engine.models.utils import load_named_weights

        cfg, num_heads = self.config, len(self.blocks)
        kept: dict[str, Tensor] = {}
        token_map: Tensor | None = None
        for name, w in weights:
            name = name.removeprefix("medusa_heads.").removeprefix("medusa_head.")
            if m := _FD_BLOCK.fullmatch(name):
                name = f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
            elif (m := _FD_HEAD.fullmatch(name)) and int(m[2]) == cfg.num_hidden_layers:
                name = f"lm_heads.{m[1]}.weight"
            name = re.sub(r"^(blocks\.\d+\.layers\.\d+)\.linear\.", r"\1.", name)
            if name == "token_map":
                token_map = w
                continue
            if cfg.original_lm_head and name in ("lm_heads.0.weight", "lm_head.weight"):
                name = "lm_head.weight"
            elif cfg.original_lm_head and name.startswith("lm_heads."):
                continue  # per-head copies of the one shared head
            if (m := _HEAD_INDEX.match(name)) and int(m[1]) >= num_heads:
                continue
            kept[name] = w
        if self.token_map is not None:
            if token_map is None:
                raise ValueError(
                    f"truncated_vocab_size {cfg.truncated_vocab_size} < vocab_size "
                    f"{cfg.vocab_size} but the Medusa checkpoint has no token_map"
                )
            ids = token_map.to(torch.int64).reshape(-1)
            bad = ids.numel() != cfg.truncated_vocab_size
            if bad or int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
                raise ValueError(
                    f"the Medusa token_map must hold {cfg.truncated_vocab_size} ids below "
                    f"vocab_size {cfg.vocab_size}, got {tuple(token_map.shape)}"
                )
            self.token_map = ids.to(self.token_map.device)
            for name, w in kept.items():  # full-vocabulary LM heads: token_map's rows
                if name.startswith("lm_head") and w.shape[0] == cfg.vocab_size:
                    kept[name] = w[ids]
        return load_named_weights(self, kept.items())


def head_tensors(resolved: ResolvedModel, load_format: str) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors: FasterDecoding's medusa_lm_head.pt where nothing else is."""
    from paged_engine.loader import iter_weights

    path = resolved.path
    pt = path / "medusa_lm_head.pt"
    others = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if load_format in ("auto", "pt") and pt.is_file() and not others:
        yield from torch.load(pt, map_location="cpu", weights_only=True).items()
    else:
        yield from iter_weights(resolved, load_format)


# ---- the proposer -------------------------------------------------------------------------------
class MedusaRunner(LastHiddenRunner):
    """Each step's drafts from the Medusa heads (see the module docstring)."""

    def propose(
        self, sched: SchedulerOutput, cached: list[CachedSeq], inputs: StepInputs
    ) -> DraftProposal:
        plan = self._drafting_rows(sched, inputs)
        if plan is None:
            return DraftProposal({}, None, {})
        r = self.runner
        drafting, nd, c = plan.index, plan.num_drafts, plan.positions  # draft j goes to c + j
        k = int(nd.max())
        tokens = plan.own.unsqueeze(1).repeat(1, k)  # rows the heads cannot serve repeat it
        live, feat = plan.served, plan.hidden  # (live: indices into `drafting`)
        probs: Tensor | None = None
        if feat is not None:
            for j in range(1, k + 1):  # head j - 1 guesses draft j
                keep = nd[live] >= j
                if not keep.any():
                    break
                if not keep.all():
                    feat, live = feat[r._to_dev(np.flatnonzero(keep))], live[keep]
                live_d = r._to_dev(live)
                logits = self.model.logits(j - 1, feat)
                prior = tokens[:, : j - 1].index_select(0, live_d)
                tok, q = self._sample(logits, cached, drafting[live], inputs, c[live] + j, prior)
                probs = store_draft(tokens, probs, j, live_d, tok, q)
        return self._finish_rows(sched, inputs, plan, tokens, probs)


# ---- checking and loading -----------------------------------------------------------------------
def _config_of(name: str, config, target_hf_config) -> MedusaConfig:
    from paged_engine.spec_decode.head_loader import resolve_draft

    where = f"speculative_config.model={name!r}"
    try:
        raw = read_medusa_config(resolve_draft(name, config).path)
        if raw is None:
            raise ValueError(
                "no Medusa config.json (model_type 'medusa', or FasterDecoding's medusa_num_heads)"
            )
        return medusa_config(raw, target_hf_config)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot load the Medusa heads ({e})") from None


def is_medusa_heads(name: str, config) -> bool:
    """Whether `name` holds Medusa heads (vLLM tells them by model_type); False where it
    cannot be read."""
    from paged_engine.spec_decode.head_loader import resolve_draft

    try:
        return read_medusa_config(resolve_draft(name, config).path) is not None
    except (OSError, ValueError):
        return False


def medusa_num_heads(name: str, config, target_hf_config) -> int:
    """num_speculative_tokens left out: one draft a head, at most 16."""
    return min(16, _config_of(name, config, target_hf_config).num_heads)


def check_medusa_heads(name: str, k: int, target_hf_config, config) -> None:
    """Raise ValueError unless `name` holds at least k Medusa heads for this target: its
    hidden_size and vocab_size."""
    cfg = _config_of(name, config, target_hf_config)
    where = f"speculative_config.model={name!r}"
    for key in ("hidden_size", "vocab_size"):
        head, target = getattr(cfg, key), int(getattr(target_hf_config, key))
        if head != target:
            raise ValueError(
                f"{where}: the Medusa heads' {key} {head} differs from the target's {target}; "
                "Medusa heads are trained for one target"
            )
    if k > cfg.num_heads:
        raise ValueError(
            f"speculative_config.num_speculative_tokens={k} exceeds the Medusa heads' "
            f"num_heads={cfg.num_heads} ({where}): one draft a head"
        )


def attach_medusa_heads(runner: ModelRunner, name: str, k: int) -> None:
    """Load the first k Medusa heads of `name` on the runner's device in the target's dtype
    as `runner.draft`."""
    from paged_engine.loader import building_in, init_dummy_weights
    from paged_engine.spec_decode.head_loader import resolve_draft

    config = runner.config
    cfg = _config_of(name, config, runner.hf_config)
    resolved = resolve_draft(name, config)
    dtype = next(runner.model.parameters()).dtype
    logger.info("loading %d Medusa heads of %s", k, name)
    with building_in(dtype, runner.device):
        heads = MedusaHeads(cfg, k)
    if config.load_format == "dummy":
        init_dummy_weights(heads, config.seed)
    else:
        try:
            heads.load_weights(head_tensors(resolved, config.load_format))
        except ValueError as e:
            raise ValueError(f"speculative_config.model={name!r}: {e}") from None
    if heads.token_map is not None:
        heads.token_map = heads.token_map.to(runner.device)
    runner.draft = MedusaRunner(heads.eval().requires_grad_(False), cfg, runner)
