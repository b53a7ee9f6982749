"""`LoRAModel`: adapter slots on a loaded model, and packing an adapter into them.

An adapter names modules as the base model's HF checkpoint does (`model.layers.0.self_attn.q_proj`).
Each name is routed exactly as that module's weight would be when the model loads: through the
model's `rename_weight`, `convert_lora_b` (its `convert_weight`: a fused HF module split by output
rows) and `stacked_params` rules, to one of our linear layers and a sub-projection of it (q / k /
v of a fused qkv_proj, gate / up of gate_up_proj). The layer's own `weight_loader` then cuts this
rank's shard out of B (column-parallel layers) or A (row-parallel layers), so an adapter loads
the same way at any tensor-parallel size. A vision-language wrapper's names (served text-only:
models/multimodal_text.py) are mapped first, as its weights are; its vision tower's modules are
not loaded (the tower never runs). Under pipeline parallelism a stage holds slots only on its
own decoder layers (the others are `PPMissingLayer`s here) and packs only their modules; the
stage holding a module checks it, and every rank learns of a failure
(executor/multiproc.py `add_lora`).

A linear layer that loads through a loader of its own (the hybrid mixers' input projections:
segments regrouped or cut one by one, or a layer built at this rank's size with tp_size 1)
declares how its LoRA B loads: `lora_segments` {shard id: (sub-projection, full output rows)}
and `lora_b_loader` (its weight's loader, which cuts B's rows as it cuts the weight's). A layer
with a loader of its own and no `lora_b_loader` is refused, never adapted with the wrong rows.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.lora.adapter import PeftAdapter
from paged_engine.lora.layers import LoRAMapping, LoRAWeights
from paged_engine.models.multimodal_text import text_model_weights
from paged_engine.models.utils import PPMissingLayer

logger = logging.getLogger(__name__)

# One adapter packed for this rank: layer name -> (a [S*R, in_local], b [out_local, S*R]).
PackedAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _segments(layer: LinearBase) -> dict | None:
    """A layer's own LoRA layout, {shard id: (sub-projection, full rows)} (module docstring)."""
    return getattr(layer, "lora_segments", None)


def _segment(layer: LinearBase, shard_id) -> tuple[int, int]:
    segments = _segments(layer)
    assert segments is not None
    if shard_id not in segments:
        raise ValueError(f"{type(layer).__name__} has no part {shard_id!r}")
    return segments[shard_id]


def _num_subs(layer: LinearBase) -> int:
    segments = _segments(layer)
    if segments is not None:
        return 1 + max(sub for sub, _ in segments.values())
    if isinstance(layer, QKVParallelLinear):
        return 3
    if isinstance(layer, MergedColumnParallelLinear):
        return len(layer.output_sizes)
    return 1


def _full_rows(layer: LinearBase, shard_id) -> int:
    """Output rows of the whole (unsharded) sub-projection `shard_id` of `layer`."""
    if _segments(layer) is not None:
        return _segment(layer, shard_id)[1]
    if isinstance(layer, QKVParallelLinear):
        if shard_id == "q":
            return layer.num_heads * layer.head_dim * layer.tp_size
        return layer.num_kv_heads * layer.head_dim * layer.tp_size // layer.kv_replicas
    if isinstance(layer, MergedColumnParallelLinear) and shard_id is not None:
        return layer.output_sizes[int(shard_id)]
    if isinstance(layer, RowParallelLinear):
        return layer.out_local
    return layer.out_local * layer.tp_size


def _sub_index(layer: LinearBase, shard_id) -> int:
    if _segments(layer) is not None:
        return _segment(layer, shard_id)[0]
    if isinstance(layer, QKVParallelLinear):
        return {"q": 0, "k": 1, "v": 2}[shard_id]
    if isinstance(layer, MergedColumnParallelLinear):
        return 0 if shard_id is None else int(shard_id)
    return 0


class LoRAModel:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_rank: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.max_rank = max_rank
        self.dtype = dtype
        self.mapping = LoRAMapping(max_loras, max_tokens, device)
        self.layers: dict[str, LinearBase] = {}
        # Layers whose weight loads through a loader of their own that says nothing of LoRA.
        self.unroutable: set[str] = set()
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                own = getattr(getattr(module, "weight", None), "weight_loader", None)
                if (
                    own is not None
                    and own != module.weight_loader
                    and not hasattr(module, "lora_b_loader")
                ):
                    self.unroutable.add(name)
                module.lora = LoRAWeights(
                    self.mapping,
                    num_subs=_num_subs(module),
                    max_rank=max_rank,
                    in_local=module.in_local,
                    out_local=module.out_local,
                    row_parallel=isinstance(module, RowParallelLinear),
                    tp_size=module.tp_size,
                    dtype=dtype,
                )
                self.layers[name] = module
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no layer LoRA can adapt")
        mib = sum(m.lora.nbytes() for m in self.layers.values()) / 2**20
        logger.info(
            "LoRA: %d slots of rank <= %d on %d linear layers (%.1f MiB)",
            max_loras,
            max_rank,
            len(self.layers),
            mib,
        )

    # ---- packing ----------------------------------------------------------------------------
    def _route(self, module: str, b: torch.Tensor):
        """(layer name, sub-projection, shard id, B rows of it) for each piece of one adapter
        module this rank holds: none for a piece in another pipeline stage's layers (that stage
        checks and loads it); None for a module of a vision-language wrapper's vision tower,
        which is not served."""
        model = self.model
        name = f"{module}.weight"
        config = getattr(model, "config", None)
        if config is not None:  # a VLM wrapper's language-model names, as the loader maps them
            mapped = list(text_model_weights([(name, b)], config))
            if not mapped:
                return None
            ((name, b),) = mapped
        name = model.rename_weight(name)
        routed = []
        for pname, piece in model.convert_lora_b(name, b):
            rule = next((r for r in model.stacked_params if r[1] in pname), None)
            shard_id = None
            if rule is not None:
                pname, shard_id = pname.replace(rule[1], rule[0]), rule[2]
            layer_name = pname.removesuffix(".weight")
            layer = self.layers.get(layer_name)
            if layer is None and _on_other_stage(model, layer_name):
                continue
            if ".experts." in pname:
                raise ValueError(
                    f"module {module!r} is a mixture-of-experts expert: LoRA on experts is not "
                    "supported (the attention projections and dense MLPs take it)"
                )
            if layer is None or not pname.endswith(".weight"):
                raise ValueError(
                    f"module {module!r} is not a linear layer of {type(model).__name__} that "
                    "LoRA can adapt (supported: the attention and MLP projections, and the "
                    "linear mixers' input and output projections)"
                )
            if layer_name in self.unroutable:
                raise ValueError(
                    f"module {module!r} loads its weight in a layout of its own that LoRA "
                    "cannot follow: it cannot be adapted"
                )
            routed.append((layer_name, _sub_index(layer, shard_id), shard_id, piece))
        return routed

    @torch.no_grad()
    def pack(self, adapter: PeftAdapter) -> PackedAdapter:
        """This rank's slot contents for `adapter`; ValueError (naming lora_request) when a
        module does not fit the model."""
        packed: PackedAdapter = {}
        seen: set[tuple[str, int]] = set()
        r_max = self.max_rank
        vision: list[str] = []
        for module, lm in adapter.modules.items():
            try:
                routed = self._route(module, lm.b.to(torch.float32) * lm.scale)
                if routed is None:
                    vision.append(module)
                    continue
                r = lm.a.shape[0]
                for layer_name, sub, shard_id, b in routed:
                    if (layer_name, sub) in seen:
                        raise ValueError(f"it adapts {layer_name} (part {sub}) twice")
                    seen.add((layer_name, sub))
                    layer = self.layers[layer_name]
                    rows = _full_rows(layer, shard_id)
                    w = layer.lora
                    n_in = layer.in_local * (layer.tp_size if w.row_parallel else 1)
                    if b.shape[0] != rows or lm.a.shape[1] != n_in:
                        raise ValueError(
                            f"lora_A {tuple(lm.a.shape)} and {b.shape[0]} lora_B rows do not fit "
                            f"a layer of {n_in} inputs and {rows} outputs"
                        )
                    if layer_name not in packed:
                        packed[layer_name] = (
                            torch.zeros(w.a.shape[1:], dtype=self.dtype),
                            torch.zeros(w.b.shape[1:], dtype=self.dtype),
                        )
                    a_pack, b_pack = packed[layer_name]
                    cols = slice(sub * r_max, (sub + 1) * r_max)
                    a_full = F.pad(lm.a.to(torch.float32), (0, 0, 0, r_max - r))  # [R, in]
                    b_full = F.pad(b, (0, r_max - r))  # [out_rows, R]
                    if w.row_parallel:  # A is cut along its input; B is whole
                        layer.weight_loader(a_pack[cols], a_full)
                        _copy(b_pack[:, cols], b_full)
                    else:  # B is cut along its output rows, by the layer's sharding
                        _copy(a_pack[cols], a_full)
                        load_b = getattr(layer, "lora_b_loader", layer.weight_loader)
                        if shard_id is None:
                            load_b(b_pack[:, cols], b_full)
                        else:
                            load_b(b_pack[:, cols], b_full, shard_id)
            except (ValueError, KeyError, RuntimeError) as e:  # RuntimeError: a bad reshape
                raise ValueError(
                    f"lora_request: the adapter at {adapter.path!r} does not fit the model: "
                    f"module {module!r}: {e}"
                ) from e
        if vision:
            logger.info(
                "LoRA adapter %s: %d modules of the vision tower (%s, ...) are not loaded: the "
                "model is served text-only",
                adapter.path,
                len(vision),
                vision[0],
            )
        for layer_name, (a, b) in packed.items():  # lora_alpha / r * B past the dtype's range
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(
                    f"lora_request: the adapter at {adapter.path!r} does not fit the model: "
                    f"its scaled weights of {layer_name} overflow {self.dtype}"
                )
        return packed

    # ---- slots ------------------------------------------------------------------------------
    @torch.no_grad()
    def load_slot(self, slot: int, packed: PackedAdapter) -> None:
        """Slot `slot` of every layer holds `packed` (zeros where the adapter has nothing)."""
        for name, layer in self.layers.items():
            w = layer.lora
            if name in packed:
                a, b = packed[name]
                w.a[slot].copy_(a, non_blocking=True)
                w.b[slot].copy_(b, non_blocking=True)
            else:
                w.a[slot].zero_()
                w.b[slot].zero_()

    def nbytes(self) -> int:
        return sum(layer.lora.nbytes() for layer in self.layers.values())


def _on_other_stage(model: nn.Module, name: str) -> bool:
    """Whether module path `name` runs through a `PPMissingLayer`: a decoder layer that another
    pipeline stage builds (vLLM's LoRA manager likewise wraps only the layers a stage owns)."""
    module: nn.Module | None = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None or not isinstance(module, nn.Module):
            return False
        if isinstance(module, PPMissingLayer):
            return True
    return False


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)
