"""GGUF (llama.cpp naming) -> HF checkpoint tensors: names, and undoing what llama.cpp's
converter did to them (archs.py): the Llama q/k row permutation, Gemma's +1 on norm weights,
experts merged into one [E, ...] tensor, and the hybrids' (Qwen3-Next / Qwen3.5 / LFM2) own
changes: A = -exp(A_log), squeezed conv weights, split in_proj_qkvz, tiled value heads; the
Mamba2 hybrids' (Granite 4.0-H, Nemotron-H) [H, 1] A / D, [groups, n] gated norm and split fused
gate / up projections; Mamba's / Mamba2's (the same as their hybrids'), and so Falcon-H1's
(Mamba2's; its folded multipliers stay folded) and Jamba's (Mamba's, merged experts); Apertus's
xIELU scalars, which the converter moved into metadata arrays, come back as HF's tensors;
Falcon's fused query_key_value goes back to its per-KV-group layout, DBRX's experts to HF's
stacked [E x ff, d] parameters, Llama 4's and gpt-oss's to HF's fused x @ W tensors, DeepSeek's
split kv_b (attn_k_b / attn_v_b) to its kv_b_proj;
Nemotron's +1 on norm weights as Gemma's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from paged_engine.gguf.archs import GGUF_ARCHS, MAMBA2_FAMILIES, GGUFArch, gguf_arch
from paged_engine.gguf.hf_config import _kv_heads, _Meta, gguf_to_hf_config, main_layers
from paged_engine.gguf.reader import GGUFFile

__all__ = ["GGUF_ARCHS", "gguf_to_hf_config", "gguf_weights", "hf_tensor_name", "unpermute_qk"]

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Read into the config instead: Llama 3.1's rope factors, Phi-3's longrope factors.
_SKIP = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# blk.<layer>.<part>[.<expert>][.<weight|bias>] (a part may hold dots: shortconv.in_proj;
# some parameters have no suffix: ssm_a)
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([\w.]+?)(?:\.(\d+))?(?:\.(weight|bias))?$")
_EXPERT_PARTS = {"ffn_gate": 1, "ffn_up": 2, "ffn_down": 3}  # index into GGUFArch.experts
EXPERT_SLOT = "{}"  # where the expert index goes in a merged expert tensor's HF name


def _split(name: str) -> tuple[str, str, str | None, str | None] | None:
    """(layer, part, expert, kind) of a `blk.*` tensor name; None for other names."""
    m = _LAYER_RE.match(name)
    return None if m is None else m.groups()


def hf_tensor_name(name: str, spec: GGUFArch = GGUF_ARCHS["llama"]) -> str | None:
    """HF name of a llama.cpp tensor name; None for tensors we do not load (or that load folded
    into another one). A merged expert tensor (`ffn_*_exps`, [E, ...]) gets EXPERT_SLOT where
    the expert index goes."""
    if name in _SKIP:
        return None
    if name in spec.global_names:
        return spec.global_names[name]
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    groups = _split(name)
    if groups is None:
        raise ValueError(f"unknown GGUF tensor {name!r}")
    layer, part, expert, kind = groups
    prefix = f"{spec.prefix}.{layer}"
    key = part if kind is None else f"{part}.{kind}"
    if expert is None and key in spec.params:
        return f"{prefix}.{spec.params[key]}"
    if kind is None:
        raise ValueError(f"unknown GGUF tensor {name!r} for {spec.hf_arch}")
    if spec.experts is not None:
        block = spec.experts[0]
        if part == "ffn_gate_inp":
            return f"{prefix}.{block}.gate.{kind}"
        merged = part.removesuffix("_exps")
        if merged != part and merged in _EXPERT_PARTS:
            expert = EXPERT_SLOT
        if expert is not None and merged in _EXPERT_PARTS:
            return f"{prefix}.{block}.experts.{expert}.{spec.experts[_EXPERT_PARTS[merged]]}.{kind}"
    if expert is not None or part not in spec.layer_names:
        raise ValueError(f"unknown GGUF tensor {name!r} for {spec.hf_arch}")
    module = spec.layer_names[part]
    return None if module is None else f"{prefix}.{module}.{kind}"


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows (0, 2, 4, .., 1, 3, ..) -> HF's halves."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def untile_heads(w: torch.Tensor, dim: int, groups: int, per_group: int, size: int) -> torch.Tensor:
    """Value heads along `dim` from llama.cpp's tiled order (head j of every group, for
    j = 0, 1, ..) back to HF's grouped one (all heads of group 0, then group 1, ..); `size`
    entries per head."""
    dim %= w.dim()
    shape = list(w.shape)
    tiled = w.reshape(*shape[:dim], per_group, groups, size, *shape[dim + 1 :])
    return tiled.transpose(dim, dim + 1).reshape(shape)


@dataclass(frozen=True, slots=True)
class _LinearAttn:
    """Gated-delta-net sizes from `<arch>.ssm.*` (Qwen3NextModel.set_gguf_parameters)."""

    k_heads: int  # ssm.group_count
    v_heads: int  # ssm.time_step_rank
    k_dim: int  # ssm.state_size
    v_dim: int  # ssm.inner_size / v_heads

    @classmethod
    def read(cls, f: GGUFFile, arch: str) -> _LinearAttn:
        def key(name: str) -> int:
            value = f.get(f"{arch}.ssm.{name}")
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.ssm.{name}")
            return int(value)

        v_heads = key("time_step_rank")
        return cls(key("group_count"), v_heads, key("state_size"), key("inner_size") // v_heads)


def _qwen3next_qkvz(qkv: torch.Tensor, z: torch.Tensor, g: _LinearAttn) -> torch.Tensor:
    """HF's in_proj_qkvz (per key head: q, k, its value heads' v, their z) from llama.cpp's
    attn_qkv ([all q; all k; all v]) and attn_gate (z)."""
    hidden = qkv.shape[1]
    qk = g.k_heads * g.k_dim
    parts = (qkv[:qk], qkv[qk : 2 * qk], qkv[2 * qk :], z)
    per_head = [p.reshape(g.k_heads, -1, hidden) for p in parts]
    return torch.cat(per_head, dim=1).reshape(-1, hidden)


def _untile_qwen35(part: str, w: torch.Tensor, g: _LinearAttn) -> torch.Tensor:
    """Undo _LinearAttentionVReorderBase's grouped -> tiled value-head order (one part)."""
    per = g.v_heads // g.k_heads
    if part == "attn_qkv":  # v rows only
        qk = 2 * g.k_heads * g.k_dim
        return torch.cat([w[:qk], untile_heads(w[qk:], 0, g.k_heads, per, g.v_dim)])
    if part == "attn_gate":
        return untile_heads(w, 0, g.k_heads, per, g.v_dim)
    if part in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):  # one row / entry per head
        return untile_heads(w, 0, g.k_heads, per, 1)
    if part == "ssm_conv1d":  # [C, K] (squeezed); q, k channels then v
        qk = 2 * g.k_heads * g.k_dim
        return torch.cat([w[:qk], untile_heads(w[qk:], 0, g.k_heads, per, g.v_dim)])
    if part == "ssm_out":  # the input columns
        return untile_heads(w, 1, g.k_heads, per, g.v_dim)
    return w


def _restore(spec: GGUFArch, part: str, w: torch.Tensor, g: _LinearAttn | None) -> torch.Tensor:
    """A hybrid's tensor as HF has it (see archs.py), after name-independent loading."""
    if spec.family == "qwen35" and g is not None and g.k_heads != g.v_heads:
        w = _untile_qwen35(part, w, g)
    if part == "ssm_a":  # stored as A = -exp(A_log) (Mamba2: [H, 1]; Mamba, Jamba: [inner, state])
        a_log = torch.log(-w.double()).float()
        return a_log if spec.family in ("mamba", "jamba") else a_log.reshape(-1)
    if spec.family in MAMBA2_FAMILIES and part in ("ssm_d", "ssm_norm"):  # [H, 1], [G, n]
        return w.reshape(-1)
    if part in ("ssm_conv1d", "shortconv.conv") and w.dim() == 2:  # [C, K] -> HF's [C, 1, K]
        return w.unsqueeze(1)
    if part == "ffn_gate_inp_shexp" and w.dim() == 1:  # HF's [1, H]
        return w.unsqueeze(0)
    return w


def falcon_qkv(w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Falcon's query_key_value rows (weight or bias) from llama.cpp's [all q; all k; all v]
    back to HF's per-KV-group [its q heads.., k, v] (FalconModel.modify_tensors' inverse)."""
    head_dim = w.shape[0] // (heads + 2 * kv_heads)
    rest = w.shape[1:]
    q = w[: heads * head_dim].reshape(kv_heads, heads // kv_heads, head_dim, *rest)
    k = w[heads * head_dim : (heads + kv_heads) * head_dim].reshape(kv_heads, 1, head_dim, *rest)
    v = w[(heads + kv_heads) * head_dim :].reshape(kv_heads, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(w.shape)


def _dbrx_experts(part: str, w: torch.Tensor) -> torch.Tensor:
    """DBRX's stacked experts as HF keeps them, [E x ff, d]: gate / up stored [E, ff, d], down
    (w2) stored [E, d, ff] (DbrxModel.modify_tensors' permute)."""
    if part == "ffn_down_exps":
        w = w.transpose(1, 2)
    return w.reshape(-1, w.shape[-1])


# Apertus: xIELU's per-layer scalars (ApertusModel.modify_tensors' metadata arrays; gguf-py's
# keys carry no arch prefix: `xielu.alpha_p`) -> HF's `mlp.act_fn.<name>` tensors, of HF's
# shapes ([1] for the alphas, [] for beta and eps). llama.cpp also takes one value for all layers.
_XIELU = {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()}


def _xielu_weights(f: GGUFFile, arch: str, spec: GGUFArch) -> Iterator[tuple[str, torch.Tensor]]:
    layers = int(f.get(f"{arch}.block_count") or 0)
    for name, shape in _XIELU.items():
        key = f"xielu.{name}"
        values = f.get(key, f.get(f"{arch}.{key}"))
        if isinstance(values, (int, float)) and not isinstance(values, bool):
            values = [values] * layers
        if not isinstance(values, list) or len(values) != layers:
            raise ValueError(
                f"GGUF metadata {key}: expected one value per layer ({layers}), got {values!r}"
            )
        for i, v in enumerate(values):
            t = torch.tensor(float(v), dtype=torch.float32).reshape(shape)
            yield f"{spec.prefix}.{i}.mlp.act_fn.{name}", t


def _with_partner(
    f: GGUFFile, name: str, partner: str, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` (the file's tensor `name`) and the tensor `partner` the converter split from the same
    HF tensor, both in the wider of their dtypes: the halves may be stored as different types
    (llama-quantize --tensor-type, say an F16 gate and a Q8_0 up), and the wider holds both
    exactly. A file without `partner` is a ValueError naming both."""
    if partner not in f.tensors:
        raise ValueError(f"GGUF file has {name} but lacks {partner}")
    other = f.tensor(partner)
    dtype = torch.promote_types(w.dtype, other.dtype)
    return w.to(dtype), other.to(dtype)


def _gpt_oss_experts(f: GGUFFile, layer: str, part: str, kind: str, w: torch.Tensor):
    """gpt-oss's experts as HF holds them: the converter split gate_up_proj's interleaved
    columns (gate, up, gate, up, ...) into ffn_gate_exps / ffn_up_exps [E, I, H] and stored
    down_proj [E, I, H] transposed; biases alike ([E, 2I] -> two [E, I]; down's [E, H] as is)."""
    if part == "ffn_down_exps":
        return w.transpose(1, 2).contiguous() if kind == "weight" else w
    w, up = _with_partner(f, f"blk.{layer}.{part}.{kind}", f"blk.{layer}.ffn_up_exps.{kind}", w)
    if kind == "bias":  # [E, I] x 2 -> [E, 2I]
        return torch.stack([w, up], dim=-1).reshape(w.shape[0], -1)
    pair = torch.stack([w, up], dim=2)  # [E, I, 2, H]
    return pair.reshape(w.shape[0], -1, w.shape[2]).transpose(1, 2).contiguous()


def _llama4_experts(f: GGUFFile, layer: str, part: str, w: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts as HF holds them (x @ W): ffn_gate_exps and ffn_up_exps [E, I, H]
    back into gate_up_proj [E, H, 2I] (gate columns first), ffn_down_exps [E, H, I] into
    down_proj [E, I, H] (Llama4Model.modify_tensors' split and transposes)."""
    if part == "ffn_down_exps":
        return w.transpose(1, 2).contiguous()
    w, up = _with_partner(f, f"blk.{layer}.{part}.weight", f"blk.{layer}.ffn_up_exps.weight", w)
    return torch.cat([w, up], dim=1).transpose(1, 2).contiguous()


def _deepseek2_kv_b(f: GGUFFile, layer: str, k_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [H * (nope + v), kv_lora] from attn_k_b [H, kv_lora, nope] and attn_v_b
    [H, v, kv_lora] (DeepseekV2Model.modify_tensors' split, undone): per head its key rows,
    then its value rows."""
    stem = f"blk.{layer}"
    k_b, v_b = _with_partner(f, f"{stem}.attn_k_b.weight", f"{stem}.attn_v_b.weight", k_b)
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return kv_b.reshape(-1, kv_b.shape[-1])


def _check_experts(f: GGUFFile, blocks: int) -> None:
    """No expert is held twice (a merged tensor beside an old per-expert one), and every layer
    with a router (`ffn_gate_inp`) holds its experts' up and down matrices, and
    their gate where the file has gated experts: merged (`ffn_up_exps`) or one tensor per
    expert (`ffn_up.<e>`, e below the router's rows). A missing part would leave the model's
    fused expert weights partly unset, with no error from the weight loader."""
    names = f.tensors
    for name in names:  # one expert's tensor beside the merged one: two values for it
        groups = _split(name)
        if groups is not None and groups[2] is not None and groups[1] in _EXPERT_PARTS:
            merged = f"blk.{groups[0]}.{groups[1]}_exps.{groups[3]}"
            if merged in names:
                raise ValueError(
                    f"GGUF tensors {merged!r} and {name!r} both hold expert {groups[2]}"
                )
    parts = ["ffn_up", "ffn_down"]
    if any(".ffn_gate_exps." in n or ".ffn_gate.0." in n for n in names):
        parts.append("ffn_gate")
    for layer in range(blocks):
        router = names.get(f"blk.{layer}.ffn_gate_inp.weight")
        if router is None:
            continue
        experts = router.shape[0]
        for part in parts:
            merged = f"blk.{layer}.{part}_exps.weight"
            single = [f"blk.{layer}.{part}.{e}.weight" for e in range(experts)]
            if merged not in names and not all(n in names for n in single):
                raise ValueError(
                    f"GGUF file has the router blk.{layer}.ffn_gate_inp.weight but lacks "
                    f"{merged} (or {part}.<e> for each of its {experts} experts)"
                )


def gguf_weights(f: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, dequantized CPU tensor) for every tensor of a supported GGUF model;
    merged expert tensors come out one expert at a time (views, no copy)."""
    arch, spec = gguf_arch(f)
    meta = _Meta(f, arch)
    heads = meta.get_int("attention.head_count", 0)  # 0: Mamba, Mamba2
    kv_heads = _kv_heads(meta, heads)  # per layer: LFM2's 0 on conv layers left out
    linear = _LinearAttn.read(f, arch) if spec.family in ("qwen3next", "qwen35") else None
    blocks = meta.get_int("block_count")
    layers = main_layers(f, arch)  # blocks past it: multi-token-prediction layers, not loaded
    _check_experts(f, blocks)
    sources: dict[str, str] = {}  # HF name -> the GGUF tensor it came from
    for name in f.tensors:
        groups = _split(name)
        if groups is not None and int(groups[0]) >= blocks:
            # llama.cpp refuses tensors it does not load; a dropped layer would run silently
            raise ValueError(
                f"GGUF tensor {name!r} is past {arch}.block_count={blocks} (layers 0..{blocks - 1})"
            )
        if groups is not None and int(groups[0]) >= layers:
            continue  # a multi-token-prediction layer's tensor (blk.N.nextn.* and the rest)
        hf_name = hf_tensor_name(name, spec)
        if hf_name is None:
            continue
        if sources.setdefault(hf_name, name) != name:  # two GGUF names of one HF tensor
            raise ValueError(f"GGUF tensors {sources[hf_name]!r} and {name!r} both hold {hf_name}")
        w = f.tensor(name)
        part = "" if groups is None else groups[1]
        if spec.permute_qk and part in ("attn_q", "attn_k"):
            n = heads if part == "attn_q" else kv_heads
            if w.dim() > 2 or n <= 0 or w.shape[0] % (2 * n):
                raise ValueError(
                    f"GGUF tensor {name!r} of shape {tuple(w.shape)} is not {n} heads of rotary "
                    f"pairs ({arch}.attention.head_count{'_kv' if part == 'attn_k' else ''})"
                )
        if spec.permute_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_qk(w, heads)
        elif spec.permute_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_qk(w, kv_heads)
        elif spec.norm_offset and name.endswith("norm.weight") and part not in spec.plain_norms:
            # Stored as float32(w + 1). For stored values >= 0.5 (Gemma's norms) the float32
            # subtraction is exact, so the model's 1 + w equals the stored value bit for bit.
            w = w.float() - spec.norm_offset
        if spec.family:
            w = _restore(spec, part, w, linear)
        if spec.family == "falcon" and part == "attn_qkv":
            w = falcon_qkv(w, heads, kv_heads)
        elif spec.family == "dbrx" and part.endswith("_exps"):
            w = _dbrx_experts(part, w)
        elif spec.family == "gpt_oss" and part in ("ffn_gate_exps", "ffn_down_exps"):
            w = _gpt_oss_experts(f, groups[0], part, groups[3], w)
        elif spec.family == "llama4" and part in ("ffn_gate_exps", "ffn_down_exps"):
            w = _llama4_experts(f, groups[0], part, w)
        elif spec.family == "deepseek2" and part == "attn_k_b":
            w = _deepseek2_kv_b(f, groups[0], w)
        if spec.family == "qwen3next" and part == "attn_qkv":
            assert linear is not None
            gate = f"blk.{groups[0]}.attn_gate.weight"
            if gate not in f.tensors:
                raise ValueError(f"GGUF file has {name} but lacks {gate}")
            w = _qwen3next_qkvz(w, f.tensor(gate), linear)
        if part in spec.fold:  # HF's fused tensor, stored as two (Granite's [gate; up])
            other, dim = spec.fold[part]
            w, rest = _with_partner(f, name, f"blk.{groups[0]}.{other}.{groups[3]}", w)
            w = torch.cat([w, rest], dim=dim)
        if EXPERT_SLOT in hf_name:
            for e in range(w.shape[0]):
                yield hf_name.format(e), w[e]
        else:
            yield hf_name, w
    if spec.family == "apertus":
        yield from _xielu_weights(f, arch, spec)
    # (last, before the weight loader's own missing-weights check, which names HF parameters)
    absent = sorted(set(range(blocks)) - {int(g[0]) for g in map(_split, f.tensors) if g})
    if absent:  # the model was built with layers no tensor fills
        raise ValueError(
            f"GGUF {arch}.block_count={blocks}, but the file has no blk.{absent[0]}.* tensors"
        )
