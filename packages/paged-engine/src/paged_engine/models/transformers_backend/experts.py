"""Mixture-of-experts checkpoints for the Transformers modeling backend (causal.py).

transformers 5 keeps each layer's experts as two 3D parameters (`experts.gate_up_proj`
[E, 2I, D], gate rows first, and `experts.down_proj` [E, D, I]) where checkpoints keep one linear
per expert, and converts at its own load (its conversion_mapping.py: MergeModulelist +
Concatenate). `ExpertStacker` does the same for HF's two per-expert layouts (`EXPERT_LAYOUTS`:
Mixtral's w1 / w3 / w2 under `block_sparse_moe`, Qwen2-MoE's gate_proj / up_proj / down_proj);
`unsupported_layout` names an MoE model type whose checkpoints transformers converts some other
way (the backend refuses it)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from paged_engine.models.utils import default_weight_loader

MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# transformers' conversion pattern -> the renames it applies before stacking experts
EXPERT_LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".block_sparse_moe.", ".mlp."),),
    "qwen2_moe": (),
}
# one expert's linear in a checkpoint -> (HF's 3D parameter, the half of its rows it fills)
_EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def expert_layout(hf_config) -> str | None:
    """The name of transformers' checkpoint conversion for the config's model type (its
    `_MODEL_TO_CONVERSION_PATTERN`, else the model type where it has a conversion of its own),
    None where transformers converts nothing."""
    from transformers import conversion_mapping

    model_type = getattr(hf_config, "model_type", None)
    aliases = getattr(conversion_mapping, "_MODEL_TO_CONVERSION_PATTERN", {})
    pattern = aliases.get(model_type, model_type)
    if pattern in EXPERT_LAYOUTS:
        return pattern
    return pattern if conversion_mapping.get_checkpoint_conversion_mapping(pattern) else None


def unsupported_layout(hf_config) -> str | None:
    """Why an MoE config's checkpoints cannot load here, None where they can (or it is no MoE)."""
    moe = next((name for name in MOE_FIELDS if getattr(hf_config, name, None)), None)
    layout = expert_layout(hf_config) if moe else None
    if layout is None or layout in EXPERT_LAYOUTS:
        return None
    return (
        f"mixture-of-experts checkpoints of model_type {hf_config.model_type!r} (config.{moe}) "
        f"are not supported: transformers converts them by its {layout!r} mapping "
        f"(only {sorted(EXPERT_LAYOUTS)})"
    )


def expert_renames(hf_config) -> tuple[tuple[str, str], ...]:
    """The renames a checkpoint's expert names need before stacking (Mixtral's block name)."""
    return EXPERT_LAYOUTS.get(expert_layout(hf_config) or "", ())


class ExpertStacker:
    """Copies each expert's checkpoint linear into its slice of HF's stacked parameter and passes
    every other weight on; `complete` says which stacked parameters received every slice."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.pieces: Counter[str] = Counter()  # stacked parameter -> expert slices copied

    def others(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` (renamed) less the expert linears, which are copied in place."""
        for name, w in weights:
            found = _EXPERT_WEIGHT.search(name)
            stacked, half = _EXPERT_PARTS[found[2]] if found else ("", None)
            pname = f"{name[: found.start()]}.experts.{stacked}" if found else ""
            param = self.params.get(pname)
            if param is None:
                yield name, w  # an unexpected name is reported by the base loader
                continue
            dst = param.data[int(found[1])]  # [2I, D] or [D, I]
            if half is not None:
                dst = dst.chunk(2, dim=0)[half]
            try:
                default_weight_loader(dst, w)  # the shape checked, then copied
            except ValueError as e:
                raise ValueError(f"cannot load weight {name!r} into {pname!r}: {e}") from e
            self.pieces[pname] += 1

    def complete(self, strict: bool) -> set[str]:
        """The stacked parameters loaded whole (every one touched when not strict)."""
        done = set()
        for pname, count in self.pieces.items():
            whole = self.params[pname].shape[0] * (2 if pname.endswith(".gate_up_proj") else 1)
            if count == whole or not strict:
                done.add(pname)
        return done
