"""Rotary position embedding (RoPE) with explicit positions.

Supports partial rotary (only the first `rotary_dim` of each head rotates: GPT-NeoX, Phi-4),
NeoX style (rotate halves) or GPT-J style (rotate interleaved pairs), and HF's frequency
scalings `linear`, `llama3`, `dynamic` (NTK), `yarn` and `longrope`, each computed as
transformers' `ROPE_INIT_FUNCTIONS` does (the same float32 ops, so the same bits). cos/sin are
precomputed in float32 for the positions a rope serves (`get_rope`: the engine's max_model_len
where positions are proven below it, else max_position_embeddings or a static scaling's
context), times the scaling's attention factor (yarn, longrope), as HF scales its cos/sin.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from paged_engine.layers.norm import GemmaRMSNorm, RMSNorm

# The engine's max_model_len while a model is built (`rope_context_len`): the longest sequence
# the ropes serve, which picks longrope's factor set. None: the config's max_position_embeddings.
_CONTEXT_LEN: ContextVar[int | None] = ContextVar("rope_context_len", default=None)
# Set where the builder proves that every position a plain rope built now turns is below it
# (the engine's max_model_len over 1-D sequence positions): `get_rope` then holds only that many
# rows. None: the table spans the config's positions.
_POSITION_LIMIT: ContextVar[int | None] = ContextVar("rope_position_limit", default=None)


@contextmanager
def rope_context_len(max_model_len: int | None, bounded_positions: bool = False) -> Iterator[None]:
    """Ropes built inside serve sequences of at most `max_model_len` tokens. With
    `bounded_positions` the caller also vouches that every position a plain rope (one of
    `get_rope` that is not M-RoPE) turns is below `max_model_len`, so its tables stop there."""
    token = _CONTEXT_LEN.set(max_model_len)
    limit = _POSITION_LIMIT.set(max_model_len if bounded_positions else None)
    try:
        yield
    finally:
        _POSITION_LIMIT.reset(limit)
        _CONTEXT_LEN.reset(token)


def plain_rope_rows(rows: int) -> int:
    """Rows a plain (1-D) rope built now needs of the `rows` its config allows: the engine's
    max_model_len where the builder bounds positions (`rope_context_len`), else `rows`."""
    limit = _POSITION_LIMIT.get()
    return rows if limit is None else min(rows, limit)


def plain_rope(
    head_dim: int, rotary_dim: int, max_position: int, base: float, **kwargs: Any
) -> RotaryEmbedding:
    """A RotaryEmbedding over 1-D positions for the models that build their own (per layer
    type, proportional), its tables bounded as `get_rope`'s (`plain_rope_rows`)."""
    rows = plain_rope_rows(max_position)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, num_positions=rows, **kwargs)


def context_len_or(default: int) -> int:
    """The longest sequence ropes built now serve (`rope_context_len`), else `default`."""
    value = _CONTEXT_LEN.get()
    return default if value is None else value


# rope_type -> the scaling-dict keys it cannot do without
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
    "longrope": ("short_factor", "long_factor"),
}


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], old_ctx: float
) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth band between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _dynamic_ntk_base(base: float, factor: float, dim: int, seq_len: int, max_pos: int) -> float:
    """Dynamic NTK: the base grows with the sequence length past `max_pos` (unchanged up to it)."""
    seq_len = max(seq_len, max_pos)
    return base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def _yarn_inv_freq(
    dim: int, base: float, scaling: dict[str, Any], factor: float, old_ctx: float
) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) below a band of dimensions, extrapolated (kept)
    above it, a linear ramp between; the band from beta_fast / beta_slow rotations."""
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times in old_ctx
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def scaled_inv_freq(
    rotary_dim: int,
    base: float,
    scaling: dict[str, Any] | None,
    max_position: int,
    context_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] float32, cos/sin factor) of one rope config.

    `max_position` is the config's `max_position_embeddings`; `context_len` the longest
    sequence the tables serve (default `max_position`), which picks longrope's factor set and
    dynamic NTK's base (HF picks per forward by the sequence's length; a precomputed table needs
    one choice, see `RotaryEmbedding`).
    """
    context_len = max_position if context_len is None else context_len
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    scaling = scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return 1.0 / (base**exps), 1.0
    if rope_type not in _REQUIRED_KEYS:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r}; supported: default, "
            + ", ".join(_REQUIRED_KEYS)
        )
    missing = [k for k in _REQUIRED_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {', '.join(missing)}")
    if scaling.get("factor") is not None and not float(scaling["factor"]) > 0:  # (NaN too)
        raise ValueError(f"rope_scaling factor={scaling['factor']!r} must be positive")
    # The pre-training context (HF's standardize_rope_params defaults it to max_position).
    old_ctx = scaling.get("original_max_position_embeddings") or max_position
    if rope_type == "linear":
        return 1.0 / (base**exps) / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(1.0 / (base**exps), scaling, float(old_ctx)), 1.0
    if rope_type == "dynamic":
        factor = float(scaling["factor"])
        grown = _dynamic_ntk_base(base, factor, rotary_dim, context_len, max_position)
        return 1.0 / (grown**exps), 1.0
    # yarn and longrope: `factor` defaults to the context extension of the config
    factor = scaling.get("factor")
    factor = max_position / old_ctx if factor is None else float(factor)
    attention_factor = scaling.get("attention_factor")
    if rope_type == "yarn":
        if attention_factor is None:
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention_factor = _yarn_mscale(factor)
        inv_freq = _yarn_inv_freq(rotary_dim, base, scaling, factor, float(old_ctx))
        return inv_freq, float(attention_factor)
    # longrope (Phi-3 / Phi-4): per-frequency divisors, the long set past the original context
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
        )
    ext = scaling["long_factor"] if context_len > old_ctx else scaling["short_factor"]
    if len(ext) != rotary_dim // 2:
        raise ValueError(
            f"rope_scaling {'long' if context_len > old_ctx else 'short'}_factor has "
            f"{len(ext)} entries; expected rotary_dim / 2 = {rotary_dim // 2}"
        )
    ext_factors = torch.tensor([float(f) for f in ext], dtype=torch.float32)
    return 1.0 / (ext_factors * base**exps), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, num_positions or max_position) and the rotation of q
    and k heads.

    longrope: HF uses the short factors while a sequence is at most
    `original_max_position_embeddings` long, and the long ones for all its positions once it is
    longer (its generate recomputes the whole cache at the switch). A paged cache cannot rewrite
    the keys it holds, so one set serves every sequence, chosen as vLLM does: the long set when
    sequences may grow past the original context (`context_len` exceeds it), else the short set.
    That equals HF for every sequence in the short case, and in the long case for every sequence
    once it is longer than the original context. `get_rope` sets `context_len` to the engine's
    max_model_len (`rope_context_len`, set by the loader), as vLLM does. dynamic NTK: HF keeps
    the base for sequences up to `max_position` (all a table that long serves).
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        freq_factors: list[float] | None = None,
        context_len: int | None = None,
        num_positions: int | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"rotary dims {rotary_dim} (head_dim {head_dim} x the config's "
                "partial_rotary_factor / rotary_pct) must be even and at most head_dim"
            )
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.is_neox_style = is_neox_style
        # float32 like the HF reference, so angles agree bit-for-bit at long positions
        inv_freq, attention_factor = scaled_inv_freq(
            rotary_dim, base, rope_scaling, max_position, context_len
        )
        self.attention_factor = attention_factor
        if freq_factors is not None:  # GGUF `rope_freqs`: per-frequency divisors (Llama 3.1)
            if len(freq_factors) != len(inv_freq):
                raise ValueError(f"{len(freq_factors)} rope freq factors for {len(inv_freq)} freqs")
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        # the table's rows: max_position, or more where a static scaling extends the context
        rows = num_positions or max_position
        if rows <= 0:
            raise ValueError(f"max_position_embeddings={rows}: a rope needs positive positions")
        try:
            positions = torch.arange(rows, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [P, rotary_dim/2]
            cos, sin = freqs.cos(), freqs.sin()
        except (RuntimeError, MemoryError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
            if "memory" not in str(e).lower():
                raise
            raise ValueError(
                f"the rope tables of {rows:,} positions do not fit in memory: pass a smaller "
                "max_model_len (by default the config's max_position_embeddings)"
            ) from e
        if attention_factor != 1.0:  # yarn / longrope scale q and k through cos and sin
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; cos, sin: [T, 1, rotary_dim/2] float32
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.is_neox_style:
            out = torch.cat((o1, o2), dim=-1)
        else:
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((out.to(x.dtype), rest), dim=-1)

    def begin_forward(self, positions: torch.Tensor) -> None:
        """Mark the start of a forward over `positions` (the model calls it first thing in
        every forward, so a table never outlives its positions): the first `rotate_heads` call
        gathers the tables once for all layers; layers whose rope kernel runs (rotate_qkv_)
        never ask for them.

        NeoX style over the whole head: out = x * [cos, cos] + swap_halves(x) * [-sin, sin],
        the same products and sums as `_rotate` (x1*cos + x2*(-sin) == x1*cos - x2*sin exactly).
        """
        full_neox = self.is_neox_style and self.rotary_dim == self.head_dim
        self._positions = positions if full_neox else None
        self._tables = None

    _positions: torch.Tensor | None = None
    _tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def has_tables(self, positions: torch.Tensor) -> bool:
        """Whether `rotate_heads` can rotate heads at `positions` (marked by begin_forward)."""
        return self._positions is positions

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """x: [T, N, D] (q and k heads side by side, maybe a strided view) -> rotated [T, N, D]
        in x's dtype, or None when `begin_forward` did not mark `positions`."""
        if not self.has_tables(positions):
            return None
        if self._tables is None:
            cos, sin = self.cos[positions], self.sin[positions]  # [T, D/2]
            self._tables = (
                torch.cat((cos, cos), dim=-1).unsqueeze(1),  # [T, 1, D] float32
                torch.cat((-sin, sin), dim=-1).unsqueeze(1),
            )
        cos, sin = self._tables
        t, n, d = x.shape
        xf = x.float()
        swapped = xf.view(t, n, 2, d // 2).flip(2).view(t, n, d)  # [x2, x1]
        return (xf * cos + swapped * sin).to(x.dtype)

    # paged_kernels.rope_qk_ where the Triton backend runs (triton_layers.py): rotate_qkv_
    kernel: Callable[..., torch.Tensor] | None = None

    def rotate_qkv_(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        kv_write: dict[str, Any] | None = None,
    ) -> bool:
        """With the kernel set, in one kernel: (q_norm / k_norm on each head, then) rotate the
        q and k heads of qkv [T, (Hq + 2 Hkv) * D] in place, the same values as the norms and
        `forward`; with `kv_write` (Attention.fused_kv_write) the same launch stores the rotated
        k heads and the v heads in the paged cache. False, qkv and cache untouched, without the
        kernel, where the rows are not dense, or where the norms are not a pair of RMSNorms of
        one kind (eps, weight offset, rounding: Llama's / Qwen3's, or Gemma 3's) over one head
        each."""
        if self.kernel is None or qkv.dim() != 2 or qkv.stride(1) != 1:
            return False
        weights: dict = {}
        norms = [n for n in (q_norm, k_norm) if n is not None]
        if norms:
            if len(norms) != 2 or not all(_head_norm(n, self.head_dim) for n in norms):
                return False
            q, k = norms
            kind = (q.eps, q.weight_offset, q.round_before_weight)
            if (k.eps, k.weight_offset, k.round_before_weight) != kind:
                return False
            weights = dict(
                q_weight=q.weight,
                k_weight=k.weight,
                eps=q.eps,
                weight_offset=q.weight_offset,
                round_before_weight=q.round_before_weight,
            )
        self.kernel(
            qkv,
            positions,
            self.cos,
            self.sin,
            num_q_heads,
            num_kv_heads,
            self.head_dim,
            is_neox_style=self.is_neox_style,
            **weights,
            **(kv_write or {}),
        )
        return True

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H*D]
        k: torch.Tensor,  # [T, Hkv*D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        t = q.shape[0]
        q = self._rotate(q.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        k = self._rotate(k.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        return q, k


class RowsRotaryEmbedding(RotaryEmbedding):
    """A rope whose tokens may carry several position rows ([n, T], an image's axes): [T]
    positions are the plain rope, every fast path of RotaryEmbedding included; [n, T] ones
    decline the fused rotation (the runner runs those steps eagerly) and turn q / k by
    `forward_rows`."""

    def rotate_qkv_(self, positions: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        return positions.dim() == 1 and super().rotate_qkv_(positions, *args, **kwargs)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        return self.forward_rows(positions, q, k)

    def forward_rows(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class MRotaryEmbedding(RowsRotaryEmbedding):
    """Qwen-VL's M-RoPE: each token has three positions (temporal, height, width), and each
    rotary frequency is turned by one of them:

        positions [3, T]  ->  cos / sin [T, rotary_dim/2]: frequency f reads row section(f)

    Qwen2-VL / 2.5-VL: three contiguous blocks of `mrope_section` sizes, block i row i.
    Qwen3-VL (`interleaved`): f % 3 == 1 reads height for f < 3 * sections[1], f % 3 == 2
    width for f < 3 * sections[2], every other frequency the temporal row.

    Text tokens have one position in all three rows, so a [T] tensor of positions means that
    position everywhere: the plain rope, every fast path of RotaryEmbedding included (the
    runner passes [3, T] only for steps that run an image's positions, and runs those eagerly).
    """

    def __init__(
        self, *args: Any, mrope_section: list[int], interleaved: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        rows = section_rows(mrope_section, interleaved, self.rotary_dim)  # [rotary_dim/2]
        self.register_buffer("section_row", rows, persistent=False)

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = positions[self.section_row].T  # [T, rotary_dim/2]: frequency f's position
        return self.cos.gather(0, index), self.sin.gather(0, index)

    def begin_forward(self, positions: torch.Tensor) -> None:
        if positions.dim() == 1:
            super().begin_forward(positions)
            return
        cos, sin = self._gather(positions)
        full_neox = self.is_neox_style and self.rotary_dim == self.head_dim
        self._positions = positions if full_neox else None
        self._tables = (
            (
                torch.cat((cos, cos), dim=-1).unsqueeze(1),
                torch.cat((-sin, sin), dim=-1).unsqueeze(1),
            )
            if full_neox
            else None
        )

    def forward_rows(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._gather(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        t = q.shape[0]
        q = self._rotate(q.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        k = self._rotate(k.view(t, -1, self.head_dim), cos, sin).reshape(t, -1)
        return q, k


def section_rows(sections: list[int], interleaved: bool, rotary_dim: int) -> torch.Tensor:
    """The position row (0 temporal, 1 height, 2 width) of each of the rotary_dim / 2
    frequencies; ValueError unless contiguous sections cover them exactly (interleaved ones
    are read as transformers reads them, whatever their sum)."""
    half = rotary_dim // 2
    if len(sections) != 3 or (not interleaved and sum(sections) != half):
        raise ValueError(
            f"mrope_section={sections} must be three sizes summing to {half} (half the rotary dims)"
        )
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    f = torch.arange(half)
    rows = torch.zeros(half, dtype=torch.int64)
    rows[(f % 3 == 1) & (f < 3 * sections[1])] = 1
    rows[(f % 3 == 2) & (f < 3 * sections[2])] = 2
    return rows


def mrope_section(config: Any) -> tuple[list[int], bool] | None:
    """Qwen-VL's M-RoPE (sections, interleaved), None for any other rope."""
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(config, key, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            sections = [int(n) for n in params["mrope_section"]]
            return sections, bool(params.get("mrope_interleaved"))
    return None


def _head_norm(norm: RMSNorm, head_dim: int) -> bool:
    """An RMSNorm the rope kernel can run: RMSNorm's or Gemma's forward (their roundings are
    `round_before_weight`'s), one weight row of head_dim."""
    return type(norm) in (RMSNorm, GemmaRMSNorm) and norm.weight.shape == (head_dim,)


_LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_config(
    config: Any, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from an HF config of any age.

    transformers >= 5 keeps all of it in `rope_parameters`, one dict per layer type where those
    differ (Gemma 3: `{"sliding_attention": ..., "full_attention": ...}`; pass `layer_type`);
    older versions use `rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq` (its
    sliding layers' unscaled base) and (GPT-NeoX) `rotary_emb_base` / `rotary_pct`.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    nested = [t for t in _LAYER_TYPES if isinstance(params.get(t), dict)]
    if nested:
        if layer_type not in nested:
            raise ValueError(
                f"config.rope_parameters is given per layer type ({', '.join(nested)}); "
                f"no entry for layer_type={layer_type!r}"
            )
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return float(config.rope_local_base_freq), None, 1.0  # Gemma 3, transformers < 5
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params:
        params = dict(legacy)
    theta = params.get("rope_theta")
    if theta is None:
        theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", None)
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial = getattr(config, "partial_rotary_factor", None) or getattr(
            config, "rotary_pct", None
        )
    rope_type = params.get("rope_type") or params.get("type")
    if rope_type in ("su", "yarn") and getattr(config, "model_type", None) == "phi3":
        rope_type = params["rope_type"] = "longrope"  # Phi-3's early names for longrope
    scaling = params if rope_type not in (None, "default") else None
    # Phi-3 keeps the pre-training length beside the scaling dict. A top-level value wins over
    # the dict's in one global rope dict (transformers' standardize_rope_params, vLLM's
    # patch_rope_parameters); a per-layer-type dict keeps its own.
    original = getattr(config, "original_max_position_embeddings", None)
    if (
        scaling is not None
        and original is not None
        and (not nested or scaling.get("original_max_position_embeddings") is None)
    ):
        scaling["original_max_position_embeddings"] = original
    return float(theta or 10000.0), scaling, float(partial or 1.0)


# Model types whose transformers rope rotates whole heads whatever partial_rotary_factor says
# (each computes its default frequencies over head_dim) and fails on it with a scaled rope (the
# shared scaled-rope functions honour it, so cos / sin come out narrower than the heads).
WHOLE_HEAD_ROPE_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "ministral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "olmo2",
        "olmoe",
        "granite",
        "granitemoe",
        "granitemoeshared",
        "granitemoehybrid",
        "phimoe",
        "hunyuan_v1_moe",
        "ernie4_5_moe",
        "deepseek_v2",
        "deepseek_v3",
        "lfm2",
        "lfm2_moe",
        "falcon_h1",
        "zamba2",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gpt_oss",
        "starcoder2",
        "exaone4",
        "smollm3",
        "cohere",
        "cohere2",
        "falcon",
        "olmo3",
        "seed_oss",
        "ernie4_5",
        "helium",
        "hunyuan_v1_dense",
        "minicpm3",
        "ministral3",
        "granite_swa",
        "granitemoe_swa",
        "hyperclovax",
        "afmoe",
        "beam",
        "ergo",
        "dory",
        "bitnet",
        "exaone",
        "exaone_moe",
        "cwm",
        "bailing_hybrid",
        "olmo",
        "olmo_hybrid",
        "flex_olmo",
        "minicpm5_moe",
        "vaultgemma",
        "llama4_text",
        "nanochat",
        "cohere2_moe",
        "jetmoe",
        "minimax",
        "dots1",
        "jais2",
        "internlm3",
        "hy_v3",
        "kolibri1",
        "kolibri1_1",
        "flint",
        "lara_mini",
    }
)


def _hf_rotary_factor(config: Any, scaling: dict[str, Any] | None, partial: float) -> float:
    """The fraction of each head the rope turns, as transformers' model of `config` turns it:
    1 for a WHOLE_HEAD_ROPE_MODEL_TYPES model whatever partial_rotary_factor says (default
    rope, Hunyuan's alpha); such a model with another scaled rope and partial_rotary_factor < 1
    (which transformers cannot run) is refused by name."""
    model_type = getattr(config, "model_type", None)
    if partial == 1.0 or model_type not in WHOLE_HEAD_ROPE_MODEL_TYPES:
        return partial
    # Hunyuan's alpha NTK rope (get_rope) turns whole heads too
    alpha = str(model_type).startswith("hunyuan") and scaling is not None and scaling.get("alpha")
    if scaling is not None and not alpha:
        kind = scaling.get("rope_type") or scaling.get("type")
        raise ValueError(
            f"config partial_rotary_factor={partial} with a {kind!r} rope scaling is not "
            f"supported for model_type {model_type!r}: its rope turns whole heads"
        )
    return 1.0


def get_rope(
    config: Any,
    head_dim: int,
    is_neox_style: bool = True,
    layer_type: str | None = None,
    base: float | None = None,
) -> RotaryEmbedding:
    """The rope of `config` (of its `layer_type` layers where ropes differ by layer type;
    `base` in place of the config's rope_theta where a layer has its own).

    A "dynamic" scaling with an `alpha` in Hunyuan's checkpoints is NTK by a fixed alpha, a
    static table: base = rope_theta * alpha ** (d / (d - 2)), d the rotary dims (other models'
    dynamic rope ignores an `alpha`, as transformers does)."""
    theta, scaling, partial = rope_config(config, layer_type)
    partial = _hf_rotary_factor(config, scaling, partial)
    theta = theta if base is None else float(base)
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    hunyuan = str(getattr(config, "model_type", "")).startswith("hunyuan")
    if kind == "dynamic" and hunyuan and scaling.get("alpha"):  # type: ignore[union-attr]
        dims = int(head_dim * partial)
        theta, scaling = theta * float(scaling["alpha"]) ** (dims / (dims - 2)), None
    max_position = int(config.max_position_embeddings)
    context_len = _CONTEXT_LEN.get()
    # a yarn / linear table runs as far as the engine's max_model_len (scaled_context_limit)
    rows = max(max_position, context_len or 0) if kind in _STATIC_SCALINGS else max_position
    section = mrope_section(config)
    if section is None:
        # Invariant (rope_context_len's caller): every position this rope turns is below the
        # limit. Row p's angles are p * inv_freq whatever the table's length, so these rows
        # are the longer table's first ones (the scaling above still reads max_position and
        # context_len). M-RoPE positions run past max_model_len (video time, shifted text):
        # those tables keep every row.
        rows = plain_rope_rows(rows)
    if section is not None and not section[1] and sum(section[0]) * 2 != int(head_dim * partial):
        section = None  # sections that do not cover the rotary dims: text only, a plain rope
    extra: dict[str, Any] = {}
    if section is not None:
        extra = {"mrope_section": section[0], "interleaved": section[1]}
    return (RotaryEmbedding if section is None else MRotaryEmbedding)(
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        max_position=max_position,
        base=theta,
        is_neox_style=is_neox_style,
        rope_scaling=scaling,
        freq_factors=getattr(config, "rope_freq_factors", None),
        context_len=None if context_len is None else min(context_len, max_position),
        num_positions=rows,
        **extra,
    )


# Scalings whose angles do not depend on the sequence's length: a table serves any position.
_STATIC_SCALINGS = ("yarn", "linear")


def scaled_context_limit(config: Any) -> int | None:
    """The context a yarn or linear rope scaling stretches the model to, as vLLM derives it:
    yarn original_max_position_embeddings x factor, linear max_position_embeddings x factor;
    None for other ropes (llama3 and longrope configs state their whole context already;
    dynamic NTK changes its angles with the length) and for per-layer-type ropes."""
    try:
        _, scaling, _ = rope_config(config)
    except ValueError:  # rope_parameters per layer type (Gemma 3)
        return None
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    max_position = getattr(config, "max_position_embeddings", None)
    if kind not in _STATIC_SCALINGS or not isinstance(max_position, int):
        return None
    assert scaling is not None
    factor = scaling.get("factor")
    if kind == "linear":
        return int(max_position * float(factor)) if factor else None
    old_ctx = scaling.get("original_max_position_embeddings") or max_position
    return int(old_ctx * float(factor)) if factor else None


def is_dynamic_ntk(config: Any) -> bool:
    """A dynamic NTK rope: HF grows its base with each sequence's length past
    max_position_embeddings, which no fixed table serves; paged serves it up to that length."""
    try:
        _, scaling, _ = rope_config(config)
    except ValueError:  # rope_parameters per layer type
        return False
    return bool(scaling) and (scaling.get("rope_type") or scaling.get("type")) == "dynamic"


def longrope_default_context(config: Any) -> int | None:
    """A longrope config's original_max_position_embeddings, vLLM's default max_model_len for
    it: at that length the short factors serve every sequence, as HF's do; a longer default
    puts every sequence on the long factors (RotaryEmbedding). None for other ropes."""
    try:
        _, scaling, _ = rope_config(config)
    except ValueError:  # rope_parameters per layer type (Gemma 3)
        return None
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    original = scaling.get("original_max_position_embeddings") if kind == "longrope" else None
    return int(original) if original else None
