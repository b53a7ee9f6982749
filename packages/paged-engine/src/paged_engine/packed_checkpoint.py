"""Integer weights packed into int32 words (GPTQ, AWQ, llm-compressor's W4A16 / W8A16),
unpacked and dequantized to the model dtype as they load, so any architecture runs them with
its unquantized layers.

Each quantized linear layer `X` arrives as several tensors (in any order, maybe split across
files); once a layer's set is complete it leaves the stream as one `X.weight` [N, K]:

    gptq    X.qweight int32 [K * b / 32, N]  (input rows packed: row k is bits
                                              b * (k % (32 / b)) of word k // (32 / b))
            X.qzeros  int32 [G, N * b / 32]  (output columns packed the same way)
            X.scales  [G, N],  X.g_idx int32 [K] (group of each input row; read with desc_act)
            W[n, k] = (q[k, n] - z[g, n]) * s[g, n],  g = g_idx[k] with desc_act, else k // (K / G);
            checkpoint_format "gptq" (v1, the usual) stores z - 1, "gptq_v2" stores z
    awq     X.qweight int32 [K, N / 8],  X.qzeros int32 [G, N / 8],  X.scales [G, N]
            (4 bits; the eight columns of a word in AWQ's order: nibble i holds column
            8 j + (0, 2, 4, 6, 1, 3, 5, 7)[i] of word j)
            W[n, k] = (q[k, n] - z[k // (K / G), n]) * s[k // (K / G), n]
    compressed-tensors, format "pack-quantized" (llm-compressor's W4A16 / W8A16):
            X.weight_packed int32 [N, K * b / 32] (value + 2**(b-1), input columns packed),
            X.weight_shape [2], X.weight_scale [N, G] (or [N, 1]: per channel),
            X.weight_zero_point int32 [N * b / 32, G] (asymmetric schemes; packed along rows,
            offset alike), X.weight_g_idx [K] (actorder "group")
            W[n, k] = (q[n, k] - z[n, g]) * s[n, g]

b is 2, 4 or 8 (GPTQ also 3: 32 values in 3 words, unpack_rows). The dequantized weights take
the model dtype's memory (no 4-bit kernel keeps them packed yet). Layers left unquantized (the
LM head, `modules_to_not_convert`, GPTQModel's `dynamic` exclusions) arrive as plain `X.weight`
and pass through; a `dynamic` "+:" override gives the layers its pattern matches (by checkpoint
name) other bits. A release whose config.json has no quantization_config but a
quantize_config.json (AutoGPTQ) or quant_config.json (AutoAWQ) beside it takes its scheme from
there (`sidecar_quant_config`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

PACKED_METHODS = ("gptq", "awq")
_BITS = (2, 4, 8)
_GPTQ_BITS = (2, 3, 4, 8)  # 3-bit: AutoGPTQ's bit stream (unpack_rows)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds this column of its 8


def _get(obj, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


@dataclass(frozen=True)
class PackedScheme:
    """How one checkpoint packs its quantized layers."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    required: tuple[str, ...]  # the suffixes of one layer's tensors ("qweight", ...)
    dropped: tuple[str, ...] = ()  # suffixes read and ignored (g_idx without desc_act)
    zero_offset: int = 0  # added to a stored zero point (GPTQ v1: 1)
    # GPTQModel's `dynamic` "+:" overrides: (pattern, bits), the first re.match of a layer's
    # checkpoint name wins
    overrides: tuple[tuple[re.Pattern[str], int], ...] = ()
    # the config's inputs per scale group (-1: one group a row), checked against each layer's
    # scales; None where the config names none for every layer alike
    group_size: int | None = None

    def bits_of(self, layer: str) -> int:
        """The bits of the layer named `layer` (its checkpoint prefix)."""
        return next((bits for pattern, bits in self.overrides if pattern.match(layer)), self.bits)


def _group_size(value, what: str) -> int | None:
    """A config's group_size: a positive integer or -1 (one group a row); None if unset."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"{what} group_size {value!r} is not a positive integer or -1")
    return value


def packed_scheme(config) -> PackedScheme | None:
    """The checkpoint's packed-integer scheme, or None when its weights are not packed ints.
    Raises ValueError naming what is unsupported (5-bit, AWQ's GEMV layout, ...)."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = _get(quant, "quant_method")
    if method == "gptq":
        bits = _bits(_get(quant, "bits", 4), "gptq", _GPTQ_BITS)
        fmt = _get(quant, "checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"gptq checkpoint_format {fmt!r} is not supported: only 'gptq' and 'gptq_v2'"
            )
        pack_dtype = _get(quant, "pack_dtype") or "int32"
        if pack_dtype != "int32":
            raise ValueError(f"gptq pack_dtype {pack_dtype!r} is not supported: only 'int32'")
        desc_act = bool(_get(quant, "desc_act", False))
        overrides = []
        for pattern, override in (_get(quant, "dynamic") or {}).items():
            # "-:pattern" leaves those modules unquantized (their plain weights load as they
            # are); "+:pattern" / "pattern" gives them other bits (their group size is read
            # from their scales; sym changes nothing stored)
            pattern = str(pattern)
            if pattern.startswith("-:"):
                continue
            override = override or {}
            what = f"gptq `dynamic` override {pattern!r}"
            if bool(_get(override, "desc_act", desc_act)) != desc_act:
                raise ValueError(f"{what}: a per-module desc_act is not supported")
            try:
                compiled = re.compile(pattern.removeprefix("+:"))
            except re.error as e:
                raise ValueError(f"{what}: not a regular expression: {e}") from e
            overrides.append((compiled, _bits(_get(override, "bits", bits), what, _GPTQ_BITS)))
        return PackedScheme(
            "gptq",
            bits,
            ("qweight", "qzeros", "scales") + (("g_idx",) if desc_act else ()),
            () if desc_act else ("g_idx",),
            zero_offset=1 if fmt == "gptq" else 0,
            overrides=tuple(overrides),
            group_size=_group_size(_get(quant, "group_size"), "gptq"),
        )
    if method == "awq":
        bits = _get(quant, "bits", _get(quant, "w_bit", 4))
        if bits != 4:
            raise ValueError(f"awq with {bits}-bit weights is not supported: only 4-bit")
        version = str(_get(quant, "version", "gemm") or "gemm").lower()
        if version != "gemm":
            raise ValueError(
                f"awq version {version!r} is not supported: only the GEMM layout ('gemm')"
            )
        if _get(quant, "zero_point", True) is False:
            raise ValueError("awq without zero points (zero_point=false) is not supported")
        group = _get(quant, "group_size", _get(quant, "q_group_size"))
        return PackedScheme(
            "awq", 4, ("qweight", "qzeros", "scales"), group_size=_group_size(group, "awq")
        )
    if method == "compressed-tensors" and _get(quant, "format") == "pack-quantized":
        groups = list((_get(quant, "config_groups") or {}).items())
        schemes, sizes = set(), set()
        for name, group in groups:
            weights = _get(group, "weights") or {}
            if _get(weights, "type", "int") != "int":
                raise ValueError(
                    f"compressed-tensors group {name!r}: pack-quantized "
                    f"{_get(weights, 'type')!r} weights are not supported, only int"
                )
            schemes.add(
                (
                    _bits(_get(weights, "num_bits", 4), f"compressed-tensors group {name!r}"),
                    _get(weights, "symmetric", True) is not False,
                    _get(weights, "actorder") == "group",
                )
            )
            strategy = _get(weights, "strategy")
            what = f"compressed-tensors group {name!r}"
            if strategy in ("channel", "tensor"):
                sizes.add(-1)
            elif strategy == "group":
                sizes.add(_group_size(_get(weights, "group_size"), what))
            else:  # another strategy (unset, block): its scales' shape is not checked
                sizes.add(None)
        if len(schemes) != 1:
            raise ValueError(
                "compressed-tensors pack-quantized: config groups with different bits, "
                "symmetry or activation order are not supported"
                if schemes
                else "compressed-tensors pack-quantized: no config group names its weights"
            )
        ((bits, symmetric, g_idx),) = schemes
        required = ("weight_packed", "weight_scale", "weight_shape")
        required += (() if symmetric else ("weight_zero_point",)) + (
            ("weight_g_idx",) if g_idx else ()
        )
        dropped = () if g_idx else ("weight_g_idx",)
        # a symmetric scheme's zero points, where a writer kept them, are all zero
        return PackedScheme(
            "compressed-tensors",
            bits,
            required,
            dropped + (("weight_zero_point",) if symmetric else ()),
            # groups of different sizes (targets apart): not checked
            group_size=sizes.pop() if len(sizes) == 1 else None,
        )
    return None


def sidecar_quant_config(config, path: str | Path) -> None:
    """Give `config` the quantization_config that early GPTQ / AWQ releases kept beside
    config.json instead of in it (AutoGPTQ's quantize_config.json, AutoAWQ's
    quant_config.json), when it has none: quant_method as written, else "awq" for AutoAWQ's
    keys (w_bit, q_group_size), else "gptq"."""
    if getattr(config, "quantization_config", None) is not None:
        return
    for filename in ("quantize_config.json", "quant_config.json"):
        file = Path(path) / filename
        if not file.is_file():
            continue
        quant = json.loads(file.read_text())
        if not isinstance(quant, dict):
            raise ValueError(f"{filename}: expected a JSON object, got {type(quant).__name__}")
        awq = "w_bit" in quant or "q_group_size" in quant or filename == "quant_config.json"
        quant.setdefault("quant_method", "awq" if awq else "gptq")
        config.quantization_config = quant
        return


def _bits(bits, what: str, supported: tuple[int, ...] = _BITS) -> int:
    if bits not in supported:
        raise ValueError(f"{what}: {bits}-bit weights are not supported: only {supported}")
    return int(bits)


def unpack_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [ceil(rows * bits / 32), C] whose word r holds rows r * (32 / bits) + i in bits
    [bits * i, bits * (i + 1)) -> int32 [rows, C] of values in [0, 2**bits). 3 bits: each
    3 words hold 32 rows as one little-endian 96-bit stream (row i at bit 3 i; rows 10 and 21
    straddle two words), AutoGPTQ's layout."""
    if bits == 3:
        return _unpack_rows_3bit(packed, rows)
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[-1])[:rows]


def _unpack_rows_3bit(packed: torch.Tensor, rows: int) -> torch.Tensor:
    if packed.shape[0] % 3:
        raise ValueError(f"3-bit words of {tuple(packed.shape)}: not whole runs of 3 words")
    words = (packed.to(torch.int64) & 0xFFFFFFFF).unflatten(0, (-1, 3))  # [R / 3, 3, C]
    values = []
    for i in range(32):
        word, shift = divmod(3 * i, 32)
        v = words[:, word] >> shift
        if shift > 29:  # its high bits open the next word
            v = v | (words[:, word + 1] << (32 - shift))
        values.append(v & 7)
    return torch.stack(values, dim=1).flatten(0, 1)[:rows].to(torch.int32)


def unpack_cols(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The same packing along columns: int32 [R, ceil(cols * bits / 32)] -> int32 [R, cols]."""
    return unpack_rows(packed.t(), bits, cols).t()


def _groups(k: int, num_groups: int, g_idx: torch.Tensor | None, name: str) -> torch.Tensor:
    """The group of each of the k input rows: g_idx, else contiguous groups of k / num_groups."""
    if g_idx is not None:
        g = g_idx.to(torch.long).reshape(-1)
        if g.numel() != k or (k and (int(g.min()) < 0 or int(g.max()) >= num_groups)):
            raise ValueError(
                f"{name}: g_idx does not give each of {k} inputs one of {num_groups} groups"
            )
        return g
    if num_groups < 1 or k % num_groups:
        raise ValueError(f"{name}: {num_groups} scale groups do not divide {k} inputs")
    return torch.arange(k, device="cpu").div_(k // num_groups, rounding_mode="floor")


def _check_group_size(scheme: PackedScheme, k: int, num_groups: int, name: str) -> None:
    """The layer's scale groups are those the config's group_size makes of its k inputs."""
    size = scheme.group_size
    if size is None or any(pattern.match(name) for pattern, _ in scheme.overrides):
        return  # a `dynamic` override may give the layer its own group size
    want = 1 if size == -1 else -(-k // size)
    if num_groups != want:
        raise ValueError(
            f"{name}: scales of {num_groups} groups for {k} inputs, but quantization_config "
            f"group_size {size} makes {want}"
        )


@dataclass(frozen=True)
class LayerCodes:
    """One layer's integers: W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = groups[k]."""

    q: torch.Tensor  # int32 [N, K], in [0, 2**bits)
    zero: torch.Tensor  # int32 [N, G]
    scale: torch.Tensor  # float32 [N, G]
    groups: torch.Tensor  # long [K]

    def dense(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        g = self.groups
        return (self.q - self.zero[:, g]).to(torch.float32) * self.scale[:, g]


def _words(n: int, bits: int) -> int:
    """The int32 words that pack n values of `bits` bits (3 bits: runs of 32 in 3 words)."""
    return -(-n // 32) * 3 if bits == 3 else -(-n * bits // 32)


def _check_parts(parts: dict[str, torch.Tensor], name: str) -> None:
    """Packed words and group indices are integers; scales are finite floats."""
    for suffix, t in parts.items():
        if suffix in ("scales", "weight_scale"):
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}.{suffix}: {t.dtype} scales must be finite floats")
        elif suffix != "weight_shape" and (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"{name}.{suffix}: packed integers stored as {t.dtype}")


def _check_dropped(name: str, t: torch.Tensor) -> None:
    """A tensor the scheme reads and ignores must be what ignoring it assumes: a g_idx in
    input order (contiguous groups: no act-order), a symmetric scheme's zero points all 0."""
    suffix = name.rpartition(".")[2]
    if suffix in ("g_idx", "weight_g_idx"):
        g = t.reshape(-1).to(torch.long)
        if g.numel() > 1 and bool((g[1:] < g[:-1]).any()):
            field = "desc_act" if suffix == "g_idx" else "actorder"
            raise ValueError(
                f"{name}: the groups are in activation order, but quantization_config "
                f"{field} does not say so"
            )
    elif suffix == "weight_zero_point" and t.to(torch.float32).count_nonzero():
        raise ValueError(
            f"{name}: nonzero zero points, but quantization_config says the weights are symmetric"
        )


def layer_codes(scheme: PackedScheme, parts: dict[str, torch.Tensor], name: str) -> LayerCodes:
    """One layer's tensors (by suffix, on one device) -> its codes, zero points and scales."""
    bits = scheme.bits_of(name)
    _check_parts(parts, name)
    if scheme.method in ("gptq", "awq"):
        scales = parts["scales"].to(torch.float32)  # [G, N]
        qweight, qzeros = parts["qweight"], parts["qzeros"]
        if scales.dim() != 2 or qweight.dim() != 2 or qzeros.dim() != 2:
            raise ValueError(
                f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                f"scales {tuple(scales.shape)} are not all matrices"
            )
        n = scales.shape[1]
        words = _words(n, bits)
        if scheme.method == "gptq":
            k = qweight.shape[0] * 32 // bits
            if qzeros.shape[1] != words:
                raise ValueError(
                    f"{name}: qzeros {tuple(qzeros.shape)} is not {words} words of {bits}-bit "
                    f"zero points a row for scales {tuple(scales.shape)}"
                )
            q = unpack_rows(qweight, bits, k)  # [K, N]
            zeros = unpack_cols(qzeros, bits, n)  # [G, N]
        else:
            if qweight.shape[1] != words or qzeros.shape[1] != words:
                raise ValueError(
                    f"{name}: qweight {tuple(qweight.shape)} and qzeros {tuple(qzeros.shape)} "
                    f"are not {words} words a row for scales {tuple(scales.shape)}"
                )
            k = qweight.shape[0]
            order = torch.tensor(_AWQ_ORDER, device=qweight.device)
            # unpack_cols gives nibble i of word j at column 8 j + i: put it at its column
            inverse = torch.argsort(order)
            cols = (torch.arange(qweight.shape[1] * 8, device=qweight.device) // 8) * 8
            take = cols + inverse.repeat(qweight.shape[1])
            q = unpack_cols(qweight, 4, qweight.shape[1] * 8)[:, take][:, :n]
            zeros = unpack_cols(qzeros, 4, qzeros.shape[1] * 8)[:, take][:, :n]
        if q.shape[1] != n or zeros.shape != scales.shape:
            raise ValueError(
                f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                f"scales {tuple(scales.shape)} do not describe one {bits}-bit weight"
            )
        _check_group_size(scheme, k, scales.shape[0], name)
        groups = _groups(k, scales.shape[0], parts.get("g_idx"), name).to(q.device)
        return LayerCodes(q.t(), (zeros + scheme.zero_offset).t(), scales.t(), groups)
    # compressed-tensors pack-quantized: signed values stored plus 2**(bits-1); q and the zero
    # point are kept as stored (their difference is the signed one's)
    shape = [int(v) for v in parts["weight_shape"].reshape(-1).tolist()]
    if len(shape) != 2:
        raise ValueError(f"{name}: weight_shape {shape} is not [out, in]")
    n, k = shape
    offset = 1 << (bits - 1)
    packed = parts["weight_packed"]
    # each row padded to whole words, no more (a wider row is another bit width's)
    if packed.dim() != 2 or packed.shape[0] != n or packed.shape[1] != _words(k, bits):
        raise ValueError(
            f"{name}: weight_packed {tuple(packed.shape)} does not hold [{n}, {k}] in "
            f"{bits}-bit values"
        )
    q = unpack_cols(packed, bits, k)  # [N, K]
    scale = parts["weight_scale"].to(torch.float32)
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1)
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    if scale.shape[0] != n:
        raise ValueError(f"{name}: weight_scale {tuple(scale.shape)} for [{n}, {k}]")
    if "weight_zero_point" in parts:
        stored = parts["weight_zero_point"]
        zero = unpack_rows(stored, bits, n)  # [N, G]
        if zero.shape != scale.shape or stored.shape[0] != _words(n, bits):
            raise ValueError(f"{name}: weight_zero_point does not match weight_scale")
    else:  # symmetric: the signed zero
        zero = torch.full(scale.shape, offset, dtype=torch.int32, device=q.device)
    _check_group_size(scheme, k, scale.shape[1], name)
    groups = _groups(k, scale.shape[1], parts.get("weight_g_idx"), name).to(q.device)
    return LayerCodes(q, zero, scale.contiguous(), groups)


def keeps_codes(scheme: PackedScheme | None) -> bool:
    """Whether the scheme's layers can run from their codes (packed_codes.py): 4-bit without
    activation order (a layer whose groups are not runs of a multiple of 32 inputs, or of
    other bits by a `dynamic` override, still loads dense)."""
    return (
        scheme is not None
        and scheme.bits == 4
        and "g_idx" not in scheme.required
        and "weight_g_idx" not in scheme.required
    )


def _codes_weight(codes: LayerCodes, dtype: torch.dtype):
    """The layer as a CodesWeight when its groups are contiguous runs of a multiple of 32
    inputs (what Int4Linear can hold exactly), else None."""
    from paged_engine.layers.quantization import INT4_GROUP
    from paged_engine.packed_codes import CodesWeight

    k = codes.q.shape[1]
    num_groups = codes.scale.shape[1]
    group = k // num_groups
    if k % num_groups or group % INT4_GROUP:
        return None
    contiguous = torch.arange(k, device=codes.groups.device) // group
    if not torch.equal(codes.groups, contiguous):  # act-order
        return None
    return CodesWeight(codes.q.to(torch.uint8), codes.zero, codes.scale, group, dtype)


def unpack_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme: PackedScheme | None,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_codes: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream with every packed layer's tensors (in any order) joined and yielded
    as `X.weight` in `dtype`, dequantized on `device`; everything else passed on. A layer
    missing one of its tensors is an error naming it. With `keep_codes`, a 4-bit layer in
    contiguous groups of a multiple of 32 inputs comes as a packed_codes.CodesWeight."""
    if scheme is None:
        yield from weights
        return
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, suffix = name.rpartition(".")
        if suffix in scheme.dropped:
            _check_dropped(name, t)
            continue
        if suffix not in scheme.required:
            yield name, t
            continue
        parts = waiting.setdefault(prefix, {})
        parts[suffix] = t
        if len(parts) == len(scheme.required):
            del waiting[prefix]
            on_device = {s: v.to(device) for s, v in parts.items()}
            codes = layer_codes(scheme, on_device, prefix)
            four = scheme.bits_of(prefix) == 4
            kept = _codes_weight(codes, dtype) if keep_codes and four else None
            yield prefix + ".weight", codes.dense().to(dtype) if kept is None else kept
    if waiting:
        lost = [
            f"{p} (has {', '.join(sorted(parts))}; needs {', '.join(scheme.required)})"
            for p, parts in sorted(waiting.items())
        ]
        raise ValueError(f"{scheme.method} checkpoint: incomplete layers: {'; '.join(lost)}")
