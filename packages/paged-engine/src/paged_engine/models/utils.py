"""Shared plumbing for models/*.py: the `*ForCausalLM` shell and weight loading."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state, stage_layers
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import ParallelLMHead
from paged_engine.layers.rotary import get_rope
from paged_engine.quantized_checkpoint import DEQUANTIZED, check_checkpoint_quantization
from paged_engine.tied_weights import TiedHeadStream

# (fragment of our param name, fragment of the HF name, shard id for the param's weight_loader)
StackedRule = tuple[str, str, str | int | tuple[int, int]]

# HF's separate q_proj / k_proj / v_proj into our fused qkv_proj (Llama family, OPT).
QKV_PROJ_RULES: tuple[StackedRule, ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded_weight.shape)}"
        )
    param.data.copy_(loaded_weight)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Iterable[StackedRule] = (),
    skip: Callable[[str], bool] = lambda name: False,
    rename: Callable[[str], str] = lambda name: name,
    convert: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None,
    strict: bool = True,
) -> set[str]:
    """Copy HF-named tensors into `model`'s parameters; returns the names of those loaded.

    Each HF name goes through `rename`, then `convert` (which may split one tensor into several,
    e.g. a fused qkv), then `skip`; `stacked` rules route it to a fused parameter's
    `weight_loader` with a shard id. Raises ValueError naming unexpected weights, weights that
    fill what an earlier one filled (two names for one parameter or shard: the last would win),
    and missing ones when `strict` (a whole checkpoint; False: an update of some of the weights).
    """
    params = dict(model.named_parameters())
    stacked = list(stacked)
    loaded: set[str] = set()
    shards: dict[str, dict] = {}  # parameter -> {shard id loaded (None: whole): its HF name}
    fused_by: dict[str, str] = {}  # fused parameter -> the rule target (r[0]) that routed there
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        items = convert(name, tensor) if convert is not None else ((name, tensor),)
        for name, w in items:
            if skip(name):
                continue
            rule = next((r for r in stacked if r[1] in name), None)
            if rule is None:
                pname, shard_id = name, None
            else:
                pname, shard_id = name.replace(rule[1], rule[0]), rule[2]
            param = params.get(pname)
            if param is None:
                # A bias of zeros adds nothing: GPTQ writers keep one on layers without a bias.
                if not (pname.endswith(".bias") and not torch.any(w)):
                    unexpected.append(hf_name)
                continue
            got = shards.setdefault(pname, {})
            # a whole tensor overlaps every shard; a shard overlaps the whole and itself
            earlier = got.get(shard_id) or (got.get(None) if shard_id is not None else None)
            if earlier is None and shard_id is None and got:
                earlier = next(iter(got.values()))
            loader = getattr(param, "weight_loader", default_weight_loader)
            # a second tensor for what is loaded: an equal copy (a module shared under two
            # names, as Phi-3-vision's `wte` and its embedding) is passed over, another refused
            target = param if earlier is None else nn.Parameter(param.detach().clone(), False)
            with torch.no_grad():
                # `w` as read (maybe another dtype, maybe a view of the mapped file): loaders
                # copy_ their slice, which converts only that slice.
                try:
                    if shard_id is None:
                        loader(target, w)
                    else:
                        loader(target, w, shard_id)
                except (ValueError, RuntimeError) as e:  # RuntimeError: a narrow out of range
                    if earlier is not None:
                        raise _twice(model, earlier, hf_name, pname, shard_id) from e
                    raise ValueError(
                        f"cannot load weight {hf_name!r} of shape {list(w.shape)} into {pname!r} "
                        f"of shape {list(param.shape)}: {e}"
                    ) from e
            if earlier is not None:
                if target.device.type != "meta" and torch.equal(target, param):
                    continue
                raise _twice(model, earlier, hf_name, pname, shard_id)
            loaded.add(pname)
            got[shard_id] = hf_name
            if rule is not None:
                fused_by[pname] = rule[0]
    missing = sorted(n for n in params if n not in loaded) if strict else []
    if strict:  # a fused weight some of whose shards never came (a checkpoint lacking k_proj)
        missing += _missing_shards(params, shards, fused_by, stacked)
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"unexpected weights {_short(unexpected)}")
        if missing:
            parts.append(f"missing weights {_short(missing)}")
        raise ValueError(f"{type(model).__name__}: checkpoint does not match: " + "; ".join(parts))
    return loaded


def _twice(model: nn.Module, earlier: str, hf_name: str, pname: str, shard_id) -> ValueError:
    """The refusal of a second, different checkpoint tensor for what `earlier` loaded."""
    what = (
        f"holds {hf_name!r} twice (in two files?)"
        if earlier == hf_name
        else f"weights {earlier!r} and {hf_name!r} both load {pname!r}"
    )
    shard = "" if shard_id is None else f" (shard {shard_id!r})"
    return ValueError(f"{type(model).__name__}: checkpoint {what}{shard}, with other values")


def _missing_shards(
    params: dict[str, nn.Parameter],
    shards: dict[str, dict],
    fused_by: dict[str, str],
    stacked: list[StackedRule],
) -> list[str]:
    """`name (shard ...)` of each fused parameter loaded shard by shard that lacks a shard: the
    ones its `shard_ids` name (a MoE layer's experts: every expert's gate and up, or up alone
    for non-gated experts, and down; one left out would run on uninitialized memory), else the
    ones the rules routing into it name (a qkv / gate_up `.weight` or `.bias`: a bias lacking
    q_proj.bias would run on uninitialized rows). A whole tensor (shard id None) fills it all."""
    out = []
    for pname, got in shards.items():
        if None in got:
            continue
        want = getattr(params[pname], "shard_ids", None)
        if want is None:
            want = {r[2] for r in stacked if r[0] == fused_by[pname]}
        if want - set(got):
            out.append(f"{pname} (shards {sorted(map(str, want - set(got)))})")
    return out


def _short(names: list[str], limit: int = 12) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# The decoder-layer index in our parameter names (model.layers.3., transformer.h.3., ...).
_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter name belongs to, None for one outside the layers."""
    match = _LAYER_INDEX.search(name)
    return None if match is None else int(match.group(1))


class PPMissingLayer(nn.Identity):
    """A decoder layer that another pipeline stage holds: no parameters, never called."""


@dataclass(frozen=True, slots=True)
class StageLayers:
    """This rank's slice [start, end) of a decoder stack, and whether it ends the model."""

    start: int
    end: int
    is_last: bool

    def layers(self, stack: nn.ModuleList) -> Iterable[nn.Module]:
        return (stack[i] for i in range(self.start, self.end))


def make_layers(
    num_layers: int, build: Callable[[int], nn.Module]
) -> tuple[nn.ModuleList, StageLayers]:
    """The decoder stack with this pipeline stage's layers built and the others left as
    `PPMissingLayer` (so layer i keeps its checkpoint name at any pipeline size)."""
    state = get_parallel_state()
    start, end = stage_layers(num_layers, state.pp_rank, state.pp_size)
    stack = nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )
    return stack, StageLayers(start, end, state.is_last_stage)


# config fields that name a model's context length, in the order they are read (MPT: max_seq_len)
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
)


def cfg_get(config, name: str, default):
    """getattr with a default that also replaces an explicit None."""
    value = getattr(config, name, None)
    return default if value is None else value


def check_heads_span_hidden(config, family: str) -> None:
    """Refuse a `head_dim` whose heads do not make up hidden_size, for families whose HF
    attention sizes some projection as hidden x hidden (transformers fails on, or ignores, it)."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(
            f"{family} with head_dim={head_dim} x num_attention_heads="
            f"{config.num_attention_heads} != hidden_size={config.hidden_size} is not supported"
        )


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) in HF's op order (Gemma 2 / 3's and nanochat's final logits);
    `cap` None or 0: the logits as they are."""
    return torch.tanh(logits / cap) * cap if cap else logits


def sub_cfg_get(config, name: str, key: str, default=None):
    """A field of a sub-config (DBRX's attn_config / ffn_config, MPT's attn_config: a config
    object or a dict), `default` when it is missing or None."""
    sub = getattr(config, name, None)
    value = sub.get(key) if isinstance(sub, dict) else getattr(sub, key, None)
    return default if value is None else value


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window of one decoder layer, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


class FeatureHead(nn.Module):
    """A draft head that reads the target's features (EAGLE-1 / EAGLE-3 heads, MTP layers;
    spec_decode/eagle.py runs them). `forward(input_ids, positions, kv_caches, md, feature)`
    gives (the logits' input, the next pass's feature), each [T, D]; `compute_logits` maps the
    first to [T, V] float32; `combine` maps what the target gave to the first pass's feature
    (as it is, unless a head projects it)."""

    def combine(self, feature: torch.Tensor) -> torch.Tensor:
        return feature

    def load_own_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        where: str,
        *,
        stacked: Iterable[StackedRule] = (),
        skip: Callable[[str], bool] = lambda name: False,
        optional: frozenset[str] = frozenset(),
    ) -> set[str]:
        """Load the head's tensors, already in our names (`load_named_weights`, not strict);
        ValueError "`where` lacks [...]" naming (the first 8 of) the parameters the weights
        did not give, but those in `optional` (parts the target may lend: embedding, head)."""
        loaded = load_named_weights(self, weights, stacked=stacked, skip=skip, strict=False)
        missing = sorted(n for n, _ in self.named_parameters() if n not in loaded | optional)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(f"{where} lacks {missing[:8]}{more}")
        return loaded


def deepseek_rope(config) -> nn.Module:
    """DeepseekModel's default rope: over qk_rope_head_dim, GPT-J pairs unless the config's
    `rope_interleave` (HF's V3 option) is false (NeoX halves)."""
    interleave = bool(getattr(config, "rope_interleave", True))
    return get_rope(config, config.qk_rope_head_dim, is_neox_style=not interleave)


def mla_rope(config, family) -> nn.Module:
    """The rope a DeepSeek-family model's layers share (`family`: its DeepseekV2ForCausalLM
    subclass): `family.build_rope(config)`, else `deepseek_rope`."""
    rope = family.build_rope(config)
    return deepseek_rope(config) if rope is None else rope


class CausalLMBase(nn.Module):
    """The shell of an HF `*ForCausalLM`: a decoder stack and an LM head, maybe tied.

    Subclasses name their HF submodules in the class attributes (checkpoints load by name), build
    the decoder stack and hand it to `__init__`, and override `rename_weight` / `convert_weight`
    only where their checkpoints' names or layouts differ from our parameters.
    """

    inner_name: ClassVar[str] = "model"  # attribute holding the decoder stack
    embed_path: ClassVar[str] = "model.embed_tokens"  # the token embedding the head may tie to
    head_name: ClassVar[str] = "lm_head"
    head_bias: ClassVar[bool] = False  # the LM head adds a bias of its own (Phi), tied or not
    tie_default: ClassVar[bool] = False  # HF's default when the config omits tie_word_embeddings
    # False: HF never ties the head (an empty _tied_weights_keys: Nemotron-H, Kimi Linear), so
    # tie_word_embeddings is ignored and the checkpoint's lm_head is served
    ties_head: ClassVar[bool] = True
    stacked_params: ClassVar[tuple[StackedRule, ...]] = ()
    # (checkpoint substring, ours): replaced in every weight name, in this order
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    ignored_weights: ClassVar[tuple[str, ...]] = ()  # suffixes of HF buffers we recompute
    # False: the cache holds something an fp8 cache cannot (worker/kv_scales.py refuses it at
    # start, saying `fp8_kv_refusal`)
    fp8_kv_cache: ClassVar[bool] = True
    fp8_kv_refusal: ClassVar[str] = ""
    # The checkpoint quantizations (quantization_config.quant_method) this model loads: by
    # default the weight-quantized ones the loader dequantizes (quantized_checkpoint.py).
    checkpoint_quantizations: ClassVar[tuple[str, ...]] = DEQUANTIZED

    def __init__(self, config, inner: nn.Module) -> None:
        super().__init__()
        check_checkpoint_quantization(config, self.checkpoint_quantizations)
        self.config = config
        setattr(self, self.inner_name, inner)
        embed = self.get_submodule(self.embed_path)
        # The decoder's output is as wide as the token embedding (OPT projects back to it), which
        # is what lets the head share the embedding's weight.
        head = ParallelLMHead(config.vocab_size, embed.weight.shape[1], bias=self.head_bias)
        tie = bool(getattr(config, "tie_word_embeddings", self.tie_default))
        self.tie_word_embeddings = tie and self.ties_head
        if self.tie_word_embeddings:
            head.tie_to(embed)
        # Registered after the decoder, so the shared weight is named after the embedding.
        setattr(self, self.head_name, head)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (k, v) per layer
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, hidden_size] from the previous pipeline stage
    ) -> torch.Tensor:
        """The last stage's hidden [T, D] (D the token embedding's width); an earlier stage's
        output [T, hidden_size] for the next stage."""
        inner = getattr(self, self.inner_name)
        return inner(input_ids, positions, kv_caches, attn_metadata, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return getattr(self, self.head_name)(hidden)

    def rename_weight(self, name: str) -> str:
        """A checkpoint name -> our parameter's name (or a shard of it, for `convert_weight`):
        `renames` applied in order."""
        for theirs, ours in self.renames:
            name = name.replace(theirs, ours)
        return name

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """One renamed checkpoint tensor -> the (name, tensor) pairs to load."""
        return ((name, w),)

    def convert_lora_b(self, name: str, b: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A LoRA B matrix [out, r] of the module whose weight is `name` -> (name, rows) pairs,
        split like the weight (lora/model.py). `convert_weight` splits weights by output rows,
        which is right for B too unless a model stores weights transposed."""
        return self.convert_weight(name, b)

    def num_decoder_layers(self) -> int:
        """The decoder layers pipeline stages split, which weight names index."""
        return self.config.num_hidden_layers

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """Load HF-named tensors; returns our parameter names loaded. `strict=False` takes a
        subset (a weight update: the rest keep their values)."""
        # A tied head has no parameter of its own: a checkpoint's copy is dropped, or, in a
        # whole checkpoint without the embedding, loads as the embedding (tied_weights.py)
        tied_head = f"{self.head_name}.weight" if self.tie_word_embeddings else None
        rename = self.rename_weight
        if tied_head is not None and strict:
            tied = TiedHeadStream(rename, tied_head, f"{self.embed_path}.weight")
            weights, rename = tied.weights(weights), tied.rename
        ignored = self.ignored_weights
        state = get_parallel_state()
        start, end = stage_layers(self.num_decoder_layers(), state.pp_rank, state.pp_size)

        def skip(name: str) -> bool:
            if name == tied_head or name.endswith(ignored):
                return True
            layer = layer_index(name)  # another pipeline stage's layer
            return layer is not None and not start <= layer < end

        return load_named_weights(
            self,
            weights,
            stacked=self.stacked_params,
            rename=rename,
            convert=self.convert_weight,
            skip=skip,
            strict=strict,
        )
