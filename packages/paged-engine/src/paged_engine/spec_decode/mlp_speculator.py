"""IBM's MLP speculator (fms-extras `MLPSpeculator`, checkpoints such as
ibm-ai-platform/llama3-8b-accelerator: config.json `model_type` "mlp_speculator",
architectures ["MLPSpeculatorPreTrainedModel"]), for speculative_config={"method":
"mlp_speculator", "model": SPECULATOR, "num_speculative_tokens": k}. vLLM's counterpart is
vllm/model_executor/models/mlp_speculator.py; the math follows it (and fms-extras).

The speculator has n_predict stages and no attention, so no KV cache: a drafting row whose own
token is t_c at position c reads the target's final (normed) hidden state h at c - 1, the state
that predicted t_c, and runs stage j = 0 .. k - 1 on the token before it:

    s_0 = h                                      (scale_input: s_0 = ln0(h) / sqrt(2), ln0
                                                  without scale or shift)
    s_j+1 = gelu(ln_j(proj_j(s_j) + emb_j(x_j) * emb_weight / state_weight))
    draft j + 1 ~ head_j(s_j+1)                  x_0 = t_c, x_j+1 = draft j + 1

with state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight**2) *
inner_dim / 2) and ln_j an RMS norm (eps 1e-6) with a weight and a bias. `tie_weights` shares
emb, head and ln across stages and proj across stages 1.. (stage 0's reads the target's width
`emb_dim`, the others `inner_dim`; inner_dim 0 means emb_dim). Drafts are sampled with the row's
settings from each stage's logits, as vLLM's sampler draws them, and verified as every draft is
(spec_decode/rejection_sampler.py). `top_k_tokens_per_head` and `n_candidates` (a candidate
tree) are read by neither vLLM nor paged.

The feature at c - 1 is what the previous step's forward left (spec_decode/last_hidden.py keeps
each row's last verified position); a row without it (right after a prefix-cache hit or a swap,
a row whose step also runs prompt tokens) proposes its own token again, a point mass the
verifier accepts with the target's probability of it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from paged_engine.models.utils import default_weight_loader
from paged_engine.spec_decode.draft_model import DraftProposal, store_draft
from paged_engine.spec_decode.last_hidden import LastHiddenRunner

if TYPE_CHECKING:
    from collections.abc import Iterable

    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.worker.input_batch import CachedSeq
    from paged_engine.worker.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)

ARCHITECTURE = "MLPSpeculatorPreTrainedModel"
MODEL_TYPE = "mlp_speculator"


@dataclass(frozen=True, slots=True)
class MLPSpeculatorConfig:
    """config.json's fields that shape the speculator (vLLM's MLPSpeculatorConfig names)."""

    vocab_size: int
    emb_dim: int  # the target's hidden size, which stage 0 reads
    inner_dim: int  # the stages' width (config 0: emb_dim)
    n_predict: int  # stages: at most this many drafts a step
    tie_weights: bool = False
    scale_input: bool = False

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> MLPSpeculatorConfig:
        """Checked field by field; a ValueError names `where` and the field."""
        defaults = {"vocab_size": 32000, "emb_dim": 4096, "inner_dim": 0, "n_predict": 3}  # vLLM's
        ints = {key: raw.get(key, default) for key, default in defaults.items()}
        for key, v in ints.items():
            low = 0 if key == "inner_dim" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{where}: config.json's {key} must be an int >= {low}, got {v!r}")
        flags = {k: raw.get(k, False) for k in ("tie_weights", "scale_input")}
        for key, v in flags.items():
            if not isinstance(v, bool):
                raise ValueError(f"{where}: config.json's {key} must be a bool, got {v!r}")
        if flags["tie_weights"] and ints["n_predict"] < 2:
            raise ValueError(f"{where}: tie_weights needs n_predict >= 2 (one stage ties nothing)")
        ints["inner_dim"] = ints["inner_dim"] or ints["emb_dim"]
        return cls(**ints, **flags)


def _raw_config(name: str, config) -> dict[str, Any]:
    from paged_engine.spec_decode.head_loader import resolve_draft

    raw = json.loads((resolve_draft(name, config).path / "config.json").read_text())
    if not isinstance(raw, dict):
        raise ValueError("config.json is not an object")
    return raw


def is_mlp_speculator(name: str, config) -> bool:
    """Whether `name`'s config.json is an MLP speculator's; False where it cannot be read."""
    try:
        raw = _raw_config(name, config)
    except (OSError, ValueError):
        return False
    return raw.get("model_type") == MODEL_TYPE or ARCHITECTURE in (raw.get("architectures") or [])


def load_speculator_config(name: str, config) -> MLPSpeculatorConfig:
    """The speculator's config (ValueError naming speculative_config.model where it is none)."""
    where = f"speculative_config.model={name!r}"
    try:
        raw = _raw_config(name, config)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read the MLP speculator's config.json ({e})") from None
    archs = raw.get("architectures") or []
    if raw.get("model_type") != MODEL_TYPE and ARCHITECTURE not in archs:
        raise ValueError(
            f"{where}: method 'mlp_speculator' needs an MLP speculator (model_type "
            f"{MODEL_TYPE!r}, architectures [{ARCHITECTURE!r}]), got {archs}"
        )
    return MLPSpeculatorConfig.from_json(raw, where)


def check_mlp_speculator(name: str, target_hf_config, num_tokens: int, config) -> None:
    """Raise ValueError unless `name` is an MLP speculator for this target: emb_dim the
    target's hidden size, the target's vocab_size, num_tokens <= n_predict (vLLM refuses more:
    each draft has a stage of its own)."""
    where = f"speculative_config.model={name!r}"
    cfg = load_speculator_config(name, config)
    text = target_hf_config
    if hasattr(text, "get_text_config"):  # a VLM's language model's
        text = text.get_text_config()
    hidden, vocab = getattr(text, "hidden_size", None), getattr(text, "vocab_size", None)
    if cfg.emb_dim != hidden:
        raise ValueError(
            f"{where}: the speculator's emb_dim {cfg.emb_dim} differs from the target's "
            f"hidden_size {hidden}; an MLP speculator is trained for one target"
        )
    if cfg.vocab_size != vocab:
        raise ValueError(
            f"{where}: the speculator's vocab_size {cfg.vocab_size} differs from the target's "
            f"{vocab}"
        )
    if num_tokens > cfg.n_predict:
        raise ValueError(
            f"speculative_config.num_speculative_tokens={num_tokens} exceeds the MLP "
            f"speculator's n_predict={cfg.n_predict} (one stage per draft)"
        )


class SpeculatorNorm(nn.Module):
    """fms-extras' LayerNormParameterized as the speculator uses it: an RMS norm (no mean
    taken out) with an optional elementwise weight and bias."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            x = x * self.weight + self.bias
        return x


class MLPSpeculator(nn.Module):
    """The stages (see the module docstring); weights as fms-extras names them: emb.{j},
    proj.{j}, head.{j}, ln.{j} (weight, bias)."""

    def __init__(self, cfg: MLPSpeculatorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n, d, v = cfg.n_predict, cfg.inner_dim, cfg.vocab_size

        def stages(make, first: nn.Module | None = None) -> nn.ModuleList:
            """n stages of `make()`'s modules (tied: one module in every slot), stage 0's
            `first` where given."""
            if cfg.tie_weights:
                mods = [make()] * n
            else:
                mods = [make() if j or first is None else first for j in range(n)]
            if first is not None:
                mods[0] = first
            return nn.ModuleList(mods)

        self.emb = stages(lambda: nn.Embedding(v, d))
        self.proj = stages(
            lambda: nn.Linear(d, d, bias=False), nn.Linear(cfg.emb_dim, d, bias=False)
        )
        self.head = stages(lambda: nn.Linear(d, v, bias=False))
        self.ln = stages(lambda: SpeculatorNorm(d))
        self.ln0 = SpeculatorNorm(cfg.emb_dim, affine=False) if cfg.scale_input else None
        state_weight = 0.5 ** (0.5 / n)
        emb_weight = math.sqrt((1 - state_weight**2) * (d / 2))
        self.emb_scale = emb_weight / state_weight  # the ln after it absorbs state_weight

    def start(self, hidden: Tensor) -> Tensor:
        """Stage 0's input state from the target's final hidden states [R, emb_dim]."""
        if self.ln0 is not None:
            return self.ln0(hidden) / math.sqrt(2)
        return hidden

    def stage(self, j: int, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Stage j over states [R, *] and the tokens before its drafts [R]: (the next state
        [R, inner_dim], logits [R, V])."""
        x = self.proj[j](state) + self.emb[j](tokens) * self.emb_scale
        state = nn.functional.gelu(self.ln[j](x))
        return state, self.head[j](state)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """fms-extras' tensors (a `speculator.` prefix dropped; tied stages' copies read into
        the one module); ValueError naming a missing or misshapen tensor."""
        params = dict(self.named_parameters())  # tied: emb.0, proj.0, proj.1, head.0, ln.0
        loaded: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("speculator.")
            kind, _, rest = name.partition(".")
            j, _, leaf = rest.partition(".")
            if self.cfg.tie_weights and j.isdigit():
                j = str(min(int(j), 1)) if kind == "proj" else "0"
            target = params.get(f"{kind}.{j}.{leaf}")
            if target is None:
                continue
            try:
                default_weight_loader(target, w)  # the shape checked, then copied
            except ValueError as e:
                raise ValueError(f"MLP speculator tensor {name}: {e}") from e
            loaded.add(f"{kind}.{j}.{leaf}")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"MLP speculator checkpoint lacks {missing}")


class MLPSpeculatorRunner(LastHiddenRunner):
    """The speculator's proposals (see the module docstring)."""

    def propose(
        self, sched: SchedulerOutput, cached: list[CachedSeq], inputs: StepInputs
    ) -> DraftProposal:
        plan = self._drafting_rows(sched, inputs)
        if plan is None:
            return DraftProposal({}, None, {})
        r = self.runner
        drafting, nd, c, own = plan.index, plan.num_drafts, plan.positions, plan.own
        k = int(nd.max())
        tokens = own.unsqueeze(1).repeat(1, k)  # rows the speculator cannot serve repeat it
        probs: Tensor | None = None
        live = plan.served  # indices into `drafting`
        if plan.hidden is not None:
            state = self.model.start(plan.hidden)
            prev = own.index_select(0, r._to_dev(live))
            for j in range(1, k + 1):  # draft j from stage j - 1
                want = np.flatnonzero(nd[live] >= j)  # into live: rows that want draft j
                if want.size == 0:
                    break
                if want.size < live.size:
                    keep = r._to_dev(want)
                    state, prev, live = (
                        state.index_select(0, keep),
                        prev.index_select(0, keep),
                        live[want],
                    )
                state, logits = self.model.stage(j - 1, state, prev)
                at = r._to_dev(live)
                prior = tokens[:, : j - 1].index_select(0, at)
                prev, q = self._sample(
                    logits.float(), cached, drafting[live], inputs, c[live] + j, prior
                )
                probs = store_draft(tokens, probs, j, at, prev, q)
        return self._finish_rows(sched, inputs, plan, tokens, probs)


def attach_mlp_speculator(runner: ModelRunner, name: str) -> None:
    """Load the speculator `name` on the runner's device in the target's dtype and set
    `runner.draft`."""
    from paged_engine.loader import building_in, init_dummy_weights, iter_weights
    from paged_engine.spec_decode.head_loader import resolve_draft

    config = runner.config
    cfg = load_speculator_config(name, config)
    dtype = next(runner.model.parameters()).dtype
    logger.info("loading the MLP speculator %s", name)
    with building_in(dtype, runner.device):
        model = MLPSpeculator(cfg)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        model.load_weights(iter_weights(resolve_draft(name, config), config.load_format))
    runner.draft = MLPSpeculatorRunner(model.eval().requires_grad_(False), cfg, runner)
