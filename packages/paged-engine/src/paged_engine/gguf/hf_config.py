"""An HF PretrainedConfig from a GGUF file's `<arch>.*` metadata (key names: gguf-py's
constants.py), with llama.cpp's defaults where its converter leaves a key out."""

from __future__ import annotations

import math
from typing import Any

from paged_engine.gguf.archs import GGUFArch, gguf_arch
from paged_engine.gguf.reader import GGUFFile

_MISSING = object()


class _Meta:
    """`<arch>.<key>` lookups; a missing required key or a bad value is a ValueError naming it."""

    def __init__(self, f: GGUFFile, arch: str) -> None:
        self.f, self.arch = f, arch

    def get(self, key: str, default: Any = _MISSING) -> Any:
        full = f"{self.arch}.{key}"
        value = self.f.get(full)
        if value is None:
            if default is _MISSING:
                raise ValueError(f"GGUF metadata lacks {full}")
            return default
        return value

    def get_int(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if value is None or _is_int(value):
            return value
        # per-layer, all equal: one entry per block (llama.cpp's rule for per-layer arrays)
        blocks = self.f.get(f"{self.arch}.block_count")
        if (
            isinstance(value, list)
            and len(value) == blocks
            and len(set(value)) == 1
            and _is_int(value[0])
        ):
            return value[0]
        raise ValueError(
            f"GGUF metadata {self.arch}.{key}: expected an integer or one equal integer per "
            f"layer ({blocks}), got {value!r}"
        )

    def get_float(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return None if value is None else float(value)
        raise ValueError(f"GGUF metadata {self.arch}.{key}: expected a number, got {value!r}")

    def rope_base(self, key: str = "rope.freq_base") -> float:
        """A rope base (default 10000): positive and finite (0 or inf leaves every frequency
        0 or 1, a negative one NaN angles)."""
        value = self.get_float(key, 1e4)
        if not 0 < value < math.inf:
            raise ValueError(f"GGUF metadata {self.arch}.{key}={value!r} must be positive")
        return value


def _is_int(value: Any) -> bool:
    """An integer GGUF value (a bool is its own GGUF type, not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def gguf_to_hf_config(f: GGUFFile):
    """An HF PretrainedConfig built from the file's `<arch>.*` and tokenizer metadata."""
    import transformers

    arch, spec = gguf_arch(f)
    meta = _Meta(f, arch)
    if spec.family in ("mamba", "mamba2"):  # no attention: head_count 0
        return _state_space(meta, f, spec)
    if spec.family in _OWN_CONFIGS:  # config classes with their own field names
        return _OWN_CONFIGS[spec.family](meta, f, spec)
    hidden = meta.get_int("embedding_length")
    heads = meta.get_int("attention.head_count")
    if heads <= 0:  # (state-space families, whose head_count is 0, returned above)
        raise ValueError(
            f"{f.path}: GGUF metadata {arch}.attention.head_count={heads} is not positive"
        )
    layers = main_layers(f, arch)
    head_dim = meta.get_int("attention.key_length", hidden // heads)
    # (DeepSeek's MLA: the MQA form's lengths differ by design; _deepseek2 reads the real ones)
    if spec.family != "deepseek2" and meta.get_int("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF metadata {arch}.attention.value_length differs from key_length")
    if "token_embd.weight" not in f.tensors:
        raise ValueError("GGUF file lacks the tensor token_embd.weight")
    kwargs: dict[str, Any] = dict(
        architectures=[spec.hf_arch],
        # the embedding's rows: llama.cpp keeps HF's padded vocab (Qwen) or trims it (Gemma 3)
        vocab_size=f.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        # MoE models without dense layers may leave it out (_moe fills it in); Nemotron-H's is
        # per layer (_nemotron_h reads it)
        intermediate_size=None
        if spec.family == "nemotron_h"
        else meta.get_int("feed_forward_length", None if spec.experts is not None else _MISSING),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(meta, heads),
        head_dim=head_dim,
        max_position_embeddings=meta.get_int("context_length", 2048),
        rms_norm_eps=meta.get_float("attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
    )
    if not spec.family:
        _check_shapes(meta, f, kwargs, spec)
    # (Nemotron-H and Jamba have no positional encoding: their rope keys are not read)
    rope = None if spec.family in ("nemotron_h", "jamba") else _rope(meta, f, head_dim)
    if spec.experts is not None and spec.family in ("", "qwen3next", "qwen35"):
        kwargs.update(_moe(meta, f, arch, layers))
    if spec.family in ("qwen3next", "qwen35"):
        _qwen_hybrid(meta, f, kwargs, layers)
    if spec.family == "lfm2":
        _lfm2(meta, f, kwargs, layers, moe=spec.experts is not None)
    if spec.family == "granitehybrid":
        rope = _granite_hybrid(meta, f, kwargs, layers, rope)
    if spec.family == "nemotron_h":
        _nemotron_h(meta, f, kwargs, layers)
        rope = None  # no positional encoding at all
    if spec.family == "falcon_h1":
        _falcon_h1(meta, f, kwargs, layers)
    if spec.family == "jamba":
        _jamba(meta, f, kwargs, layers)
        rope = None  # no positional encoding at all
    if spec.family in _MORE:
        _MORE[spec.family](meta, f, kwargs, layers)
    if spec.family == "deepseek2" and rope is not None:
        rope.pop("partial_rotary_factor", None)  # rope.dimension_count is qk_rope_head_dim
        # DeepseekV2Model writes 0.1 * mscale_all_dim (the released configs' mscale equals it)
        log_mul = meta.get_float("rope.scaling.yarn_log_multiplier", 0.0)
        if rope["rope_type"] == "yarn" and log_mul:
            rope["mscale"] = rope["mscale_all_dim"] = round(log_mul / 0.1, 6)
    if arch in ("gemma2", "gemma3"):
        rope = _gemma(meta, arch, kwargs, rope)
    if arch == "phi3":
        rope = _phi3(meta, f, kwargs, rope)
    if "rope_freqs.weight" in f.tensors:  # Llama 3.1 scaling, baked into per-freq divisors
        kwargs["rope_freq_factors"] = f.tensor("rope_freqs.weight").float().tolist()
    config = getattr(transformers, spec.config_cls)(**kwargs)
    _check_whole_head_rope(meta, config, rope)
    # Set after construction: transformers >= 5 reads rope settings from rope_parameters (one
    # dict per layer type for Gemma 3), older versions from rope_theta / rope_scaling.
    if rope is None:
        pass
    elif hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:  # pragma: no cover - transformers 4.x
        flat = rope.get("full_attention", rope)
        config.rope_theta = flat["rope_theta"]
        config.rope_scaling = flat if flat["rope_type"] != "default" else None
        config.partial_rotary_factor = flat.get("partial_rotary_factor", 1.0)
        if "sliding_attention" in rope:
            config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
    return config


def _check_shapes(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], spec: GGUFArch) -> None:
    """A plain transformer's sizes against its first layer's tensors, as llama.cpp checks each
    tensor's shape: a ValueError naming the key and the tensor, before a model of other sizes
    is built."""
    head_dim = kwargs["head_dim"]
    moe = spec.experts is not None
    # (Phi-3's ffn_up is [gate; up] fused, 2 x feed_forward_length: checked with a gate only)
    gated = "blk.0.ffn_gate.weight" in f.tensors
    ffn = kwargs["intermediate_size"] if gated and not moe else None
    experts = meta.get_int("expert_count", None) if moe else None
    want = {  # tensor: (dim, size (None: not checked), the key it comes from)
        "token_embd.weight": (1, kwargs["hidden_size"], "embedding_length"),
        "blk.0.attn_q.weight": (
            0,
            kwargs["num_attention_heads"] * head_dim,
            "attention.head_count / key_length",
        ),
        "blk.0.attn_k.weight": (
            0,
            kwargs["num_key_value_heads"] * head_dim,
            "attention.head_count_kv / key_length",
        ),
        "blk.0.ffn_up.weight": (0, ffn, "feed_forward_length"),
        "blk.0.ffn_gate_inp.weight": (0, experts, "expert_count"),
    }
    for name, (dim, size, key) in want.items():
        info = f.tensors.get(name)
        if size is None or info is None:
            continue
        if len(info.shape) != 2 or info.shape[dim] != size:
            raise ValueError(
                f"GGUF tensor {name} has shape {list(info.shape)}, but {meta.arch}.{key} "
                f"makes its {'rows' if dim == 0 else 'columns'} {size}"
            )


def _check_whole_head_rope(meta: _Meta, config: Any, rope: dict[str, Any] | None) -> None:
    """rope.dimension_count below the head size on a model whose rope turns whole heads
    (transformers' and ours ignore the fraction, llama.cpp's graph turns only those dims or,
    for Llama, refuses the file): a ValueError naming the key instead of another model."""
    from paged_engine.layers.rotary import WHOLE_HEAD_ROPE_MODEL_TYPES

    partial = None if rope is None else rope.get("partial_rotary_factor")
    if partial is not None and config.model_type in WHOLE_HEAD_ROPE_MODEL_TYPES:
        raise ValueError(
            f"GGUF metadata {meta.arch}.rope.dimension_count={meta.get('rope.dimension_count')} "
            f"is not the head size {config.head_dim}: {config.model_type} rotates whole heads"
        )


def main_layers(f: GGUFFile, arch: str) -> int:
    """The decoder layers the model runs: block_count less the multi-token-prediction layers
    a file may append (`nextn_predict_layers`: GLM-4.7-Flash's converter exports its MTP
    layer), which are not loaded."""
    meta = _Meta(f, arch)
    return meta.get_int("block_count") - meta.get_int("nextn_predict_layers", 0)


def _kv_heads(meta: _Meta, heads: int) -> int:
    """attention.head_count_kv: one value, or one per layer where attention layers agree and
    other layers (LFM2's short-conv ones) hold 0."""
    value = meta.get("attention.head_count_kv", heads)
    ok = _is_int(value) or (isinstance(value, list) and value and all(map(_is_int, value)))
    if not ok:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.head_count_kv: expected an integer or one per "
            f"layer, got {value!r}"
        )
    if isinstance(value, list):
        kv = {v for v in value if v > 0}
        if len(kv) > 1:
            raise ValueError(
                f"GGUF metadata {meta.arch}.attention.head_count_kv differs across layers: "
                f"{value!r}"
            )
        return kv.pop() if kv else heads
    return value


def _rope(meta: _Meta, f: GGUFFile, head_dim: int) -> dict[str, Any]:
    """rope_parameters: base, partial rotary (rope.dimension_count), linear / YaRN scaling."""
    theta = meta.rope_base()
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    dims = meta.get_int("rope.dimension_count", head_dim)
    if dims < 0 or dims % 2 or dims > head_dim:  # ggml's rope turns pairs within one head
        raise ValueError(
            f"GGUF metadata {meta.arch}.rope.dimension_count={dims} must be even, not negative "
            f"and at most the head size {head_dim}"
        )
    if dims != head_dim:
        rope["partial_rotary_factor"] = dims / head_dim
    kind = meta.get("rope.scaling.type", "none")
    if kind == "linear":
        rope.update(rope_type="linear", factor=meta.get_float("rope.scaling.factor"))
    elif kind == "yarn":
        rope.update(
            rope_type="yarn",
            factor=meta.get_float("rope.scaling.factor"),
            original_max_position_embeddings=meta.get_int("rope.scaling.original_context_length"),
        )
        for key in ("beta_fast", "beta_slow"):
            value = meta.get_float(f"rope.scaling.yarn_{key}", None)
            if value is not None:
                rope[key] = value
    elif kind != "none":
        raise ValueError(
            f"GGUF metadata {meta.arch}.rope.scaling.type={kind!r} is not supported "
            "(none, linear, yarn)"
        )
    return rope


def _moe(meta: _Meta, f: GGUFFile, arch: str, layers: int) -> dict[str, Any]:
    experts, used = meta.get_int("expert_count"), meta.get_int("expert_used_count")
    if arch == "llama":  # Mixtral: every layer sparse, experts of feed_forward_length
        return {
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "sliding_window": meta.get_int("attention.sliding_window", None),
        }
    # Qwen3-MoE. The experts' size: the key, else the merged tensors' rows.
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    size = meta.get_int("expert_feed_forward_length", None)
    if size is None:
        if not sparse or f"blk.{sparse[0]}.ffn_gate_exps.weight" not in f.tensors:
            raise ValueError(f"GGUF metadata lacks {arch}.expert_feed_forward_length")
        size = f.tensors[f"blk.{sparse[0]}.ffn_gate_exps.weight"].shape[1]
    out = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": size,
        "intermediate_size": meta.get_int("feed_forward_length", size),
        # llama.cpp renormalizes the top-k weights unless the file says otherwise; its
        # qwen2moe graph never does
        "norm_topk_prob": arch != "qwen2moe" and bool(meta.get("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in sparse],
    }
    # Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE: a gated shared expert (Qwen2MoeModel writes its
    # width)
    shared = meta.get_int("expert_shared_feed_forward_length", None)
    if shared is None and sparse and f"blk.{sparse[0]}.ffn_up_shexp.weight" in f.tensors:
        shared = f.tensors[f"blk.{sparse[0]}.ffn_up_shexp.weight"].shape[0]
    if shared is not None:
        out["shared_expert_intermediate_size"] = shared
    return out


def _qwen_hybrid(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Qwen3-Next / Qwen3.5: the gated delta net's sizes (ssm.*, Qwen3NextModel's mapping) and
    which layers are full attention: every full_attention_interval-th (llama.cpp's default 4)."""
    k_heads, v_heads = meta.get_int("ssm.group_count"), meta.get_int("ssm.time_step_rank")
    inner = meta.get_int("ssm.inner_size")
    if v_heads <= 0 or inner % v_heads or v_heads % k_heads:
        raise ValueError(
            f"GGUF metadata {meta.arch}.ssm.*: inner_size {inner}, time_step_rank {v_heads}, "
            f"group_count {k_heads} do not describe whole value heads grouped by key heads"
        )
    interval = meta.get_int("full_attention_interval", 4)
    if interval < 1:
        raise ValueError(f"GGUF metadata {meta.arch}.full_attention_interval={interval!r}")
    types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
             for i in range(layers)]  # fmt: skip
    for i, kind in enumerate(types):  # the tensors must agree
        if (f"blk.{i}.ssm_out.weight" in f.tensors) != (kind == "linear_attention"):
            raise ValueError(
                f"GGUF layer {i} does not match {meta.arch}.full_attention_interval={interval}"
            )
    kwargs.update(
        layer_types=types,
        full_attention_interval=interval,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=meta.get_int("ssm.state_size"),
        linear_value_head_dim=inner // v_heads,
        linear_conv_kernel_dim=meta.get_int("ssm.conv_kernel"),
    )


def _lfm2(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int, moe: bool) -> None:
    """LFM2 / LFM2-MoE: conv layers are those with 0 kv heads (LFM2Model's per-layer
    head_count_kv); feed_forward_length is already the adjusted MLP width."""
    kv = meta.get("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != layers:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.head_count_kv: expected one entry per layer "
            f"(0 for conv layers), got {kv!r}"
        )
    types = ["conv" if int(n) == 0 else "full_attention" for n in kv]
    conv = [i for i, t in enumerate(types) if t == "conv"]
    kwargs.update(
        layer_types=types,
        conv_L_cache=meta.get_int("shortconv.l_cache"),
        conv_bias=bool(conv) and f"blk.{conv[0]}.shortconv.in_proj.bias" in f.tensors,
        norm_eps=kwargs["rms_norm_eps"],
        block_auto_adjust_ff_dim=False,
    )
    if not moe:
        return
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    size = meta.get_int("expert_feed_forward_length", None)
    if size is None:
        if not sparse:
            raise ValueError(f"GGUF metadata lacks {meta.arch}.expert_feed_forward_length")
        size = f.tensors[f"blk.{sparse[0]}.ffn_gate_exps.weight"].shape[1]
    kwargs.update(
        num_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        moe_intermediate_size=size,
        num_dense_layers=meta.get_int("leading_dense_block_count", sparse[0] if sparse else layers),
        use_expert_bias=bool(sparse) and f"blk.{sparse[0]}.exp_probs_b.bias" in f.tensors,
        # LFM2MoeModel writes neither; llama.cpp then renormalizes and does not scale
        norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
        routed_scaling_factor=meta.get_float("expert_weights_scale", 1.0),
    )


def _mamba2(meta: _Meta, f: GGUFFile, layers: list[int]) -> dict[str, Any]:
    """The Mamba2 mixer's sizes from ssm.* (GraniteHybridModel.set_gguf_parameters: time_step_rank
    is the head count, inner_size heads x head_dim); biases from the first Mamba layer's
    tensors."""
    heads, inner = meta.get_int("ssm.time_step_rank"), meta.get_int("ssm.inner_size")
    groups = meta.get_int("ssm.group_count", 1)
    if heads <= 0 or inner % heads or groups <= 0 or heads % groups:
        raise ValueError(
            f"GGUF metadata {meta.arch}.ssm.*: inner_size {inner}, time_step_rank {heads}, "
            f"group_count {groups} do not describe whole heads in whole groups"
        )
    first = layers[0] if layers else None
    return {
        "heads": heads,
        "head_dim": inner // heads,
        "inner": inner,
        "groups": groups,
        "state": meta.get_int("ssm.state_size"),
        "conv": meta.get_int("ssm.conv_kernel"),
        "conv_bias": first is not None and f"blk.{first}.ssm_conv1d.bias" in f.tensors,
        "proj_bias": first is not None and f"blk.{first}.ssm_in.bias" in f.tensors,
    }


def _state_space(meta: _Meta, f: GGUFFile, spec: GGUFArch):
    """Mamba / Falcon Mamba ("mamba") and Mamba2 ("mamba2") (MambaModel / Mamba2Model
    .set_gguf_parameters): every block a mixer, sized by ssm.* (inner_size = expand x hidden;
    Mamba: time_step_rank is dt_proj's rank, Mamba2: the head count); head_count and
    feed_forward_length are 0 and context_length an arbitrary 2**20, none of them HF's. The
    biases from the first layer's tensors; a missing `output` is a tied head. What the format
    does not carry stays at the config class's default: residual_in_fp32, Falcon Mamba's
    mixer_rms_eps (llama.cpp normalizes dt, B and C with the layer eps), Mamba2's time_step_limit
    (llama.cpp clamps nothing) and chunk_size."""
    import transformers

    arch = meta.arch
    if "token_embd.weight" not in f.tensors:
        raise ValueError("GGUF file lacks the tensor token_embd.weight")
    hidden, layers = meta.get_int("embedding_length"), meta.get_int("block_count")
    inner = meta.get_int("ssm.inner_size")
    if hidden <= 0 or inner % hidden:
        raise ValueError(
            f"GGUF metadata {arch}.ssm.inner_size={inner} is no whole multiple of "
            f"embedding_length={hidden} (the config's expand)"
        )
    kwargs: dict[str, Any] = dict(
        architectures=[spec.hf_arch],
        vocab_size=f.tensors["token_embd.weight"].shape[0],  # the converter pads only the vocab
        hidden_size=hidden,
        num_hidden_layers=layers,
        state_size=meta.get_int("ssm.state_size"),
        conv_kernel=meta.get_int("ssm.conv_kernel"),
        expand=inner // hidden,
        layer_norm_epsilon=meta.get_float("attention.layer_norm_rms_epsilon"),
        use_conv_bias=_has_bias(f, "ssm_conv1d"),
        use_bias=_has_bias(f, "ssm_in"),
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
    )
    if spec.family == "mamba":
        kwargs["time_step_rank"] = meta.get_int("ssm.time_step_rank")
    else:
        mamba = _mamba2(meta, f, [])
        kwargs.update(
            num_heads=mamba["heads"], head_dim=mamba["head_dim"], n_groups=mamba["groups"]
        )
    return getattr(transformers, spec.config_cls)(**kwargs)


def _has_bias(f: GGUFFile, part: str) -> bool:
    """Whether the first layer's `part` has a bias (all layers alike)."""
    return f"blk.0.{part}.bias" in f.tensors


def _has(f: GGUFFile, layer: int, part: str) -> bool:
    return f"blk.{layer}.{part}.weight" in f.tensors


def _granite_hybrid(
    meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int, rope: dict[str, Any]
) -> dict[str, Any]:
    """Granite 4.0-H (GraniteHybridModel): Mamba layers are those with 0 kv heads (per-layer
    head_count_kv) and an ssm_in; GraniteModel's multipliers from attention.scale,
    embedding_scale, residual_scale and logit_scale (each written only when set; llama.cpp then
    scales by 1, attention by 1 / sqrt(head_dim)); rope only where rope.scaling.finetuned says so
    (the converter's use_rope, False for every GraniteMoeHybrid checkpoint)."""
    kv = meta.get("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != layers:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.head_count_kv: expected one entry per layer "
            f"(0 for Mamba layers), got {kv!r}"
        )
    types = []
    for i, n in enumerate(kv):
        kind = "full_attention" if int(n) > 0 else "linear_attention"
        if _has(f, i, "ssm_in") != (kind == "linear_attention"):
            raise ValueError(
                f"GGUF layer {i} does not match {meta.arch}.attention.head_count_kv[{i}]={n}"
            )
        types.append(kind)
    mamba = _mamba2(meta, f, [i for i, t in enumerate(types) if t != "full_attention"])
    hidden = kwargs["hidden_size"]
    if mamba["inner"] % hidden:
        raise ValueError(
            f"GGUF metadata {meta.arch}.ssm.inner_size={mamba['inner']} is no whole multiple of "
            f"embedding_length={hidden} (GraniteMoeHybrid's mamba_expand)"
        )
    experts = meta.get_int("expert_count", 0)
    shared = meta.get_int("expert_shared_feed_forward_length", None)
    if shared is None:  # the shared MLP's (or a dense model's only MLP's) width
        gate = "ffn_gate_shexp" if experts else "ffn_gate"
        if not _has(f, 0, gate):
            raise ValueError(f"GGUF metadata lacks {meta.arch}.expert_shared_feed_forward_length")
        shared = f.tensors[f"blk.0.{gate}.weight"].shape[0]
    # GraniteModel's converter drops head_dim: hidden / heads, as HF's Granite computes it
    head_dim = kwargs.pop("head_dim")
    if head_dim != hidden // kwargs["num_attention_heads"]:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.key_length={head_dim} is not "
            "embedding_length / head_count, which GraniteMoeHybrid assumes"
        )
    attn = [i for i, t in enumerate(types) if t == "full_attention"]
    kwargs.update(_granite_multipliers(meta, head_dim))
    kwargs.update(
        layer_types=types,
        num_local_experts=experts,
        num_experts_per_tok=meta.get_int("expert_used_count", 0) if experts else 0,
        shared_intermediate_size=shared,
        mamba_n_heads=mamba["heads"],
        mamba_d_head=mamba["head_dim"],
        mamba_n_groups=mamba["groups"],
        mamba_d_state=mamba["state"],
        mamba_d_conv=mamba["conv"],
        mamba_expand=mamba["inner"] // hidden,
        mamba_conv_bias=mamba["conv_bias"],
        mamba_proj_bias=mamba["proj_bias"],
        attention_bias=bool(attn) and f"blk.{attn[0]}.attn_q.bias" in f.tensors,
        position_embedding_type="rope" if meta.get("rope.scaling.finetuned", False) else None,
    )
    if kwargs["position_embedding_type"] is None:
        return {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    return rope


def _granite_multipliers(meta: _Meta, head_dim: int) -> dict[str, float]:
    """GraniteModel's multipliers: attention.scale, embedding_scale, residual_scale and
    logit_scale, each written only when set (truthy); without one llama.cpp scales by 1, and
    attention by 1 / sqrt(head_dim)."""
    scale = meta.get_float("attention.scale", None)
    return dict(
        attention_multiplier=scale if scale else head_dim**-0.5,
        embedding_multiplier=meta.get_float("embedding_scale", 0.0) or 1.0,
        residual_multiplier=meta.get_float("residual_scale", 0.0) or 1.0,
        logits_scaling=meta.get_float("logit_scale", 0.0) or 1.0,
    )


def _granite(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Granite 3.x dense (GraniteModel): Llama's layout, head_dim hidden / heads (the converter
    drops the config's), the multipliers from the metadata, biases from the tensors."""
    head_dim = kwargs.pop("head_dim")
    if head_dim != kwargs["hidden_size"] // kwargs["num_attention_heads"]:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.key_length={head_dim} is not "
            "embedding_length / head_count, which Granite assumes"
        )
    kwargs.update(_granite_multipliers(meta, head_dim), attention_bias=_has_bias(f, "attn_q"))
    if meta.arch == "granite":
        kwargs["mlp_bias"] = _has_bias(f, "ffn_up")


def _granite_moe(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Granite MoE (GraniteMoeModel): Granite's attention, every layer's experts
    feed_forward_length wide; the shared MLP's width from expert_shared_feed_forward_length
    (else its gate's rows), 0 without one (plain GraniteMoe)."""
    _granite(meta, f, kwargs, layers)
    shared = meta.get_int("expert_shared_feed_forward_length", None)
    if shared is None:
        shared = (
            f.tensors["blk.0.ffn_gate_shexp.weight"].shape[0] if _has(f, 0, "ffn_gate_shexp") else 0
        )
    kwargs.update(
        num_local_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        shared_intermediate_size=shared,
    )


def _olmo2(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """OLMo 2 (Olmo2Model). OLMo 3 files share the arch and add a sliding window; its layers'
    ropes (scaled on the full layers only, in HF) are not worked out for them yet, so such a file
    is refused rather than run as OLMo 2."""
    if meta.get("attention.sliding_window", None) is not None:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.sliding_window is set: an OLMo 3 file, which "
            "is not supported as GGUF yet (load its HF checkpoint instead)"
        )


def _seed_oss(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Seed-OSS (SeedOssModel): its three bias switches from the tensors present."""
    kwargs.update(
        attention_bias=_has_bias(f, "attn_q"),
        attention_out_bias=_has_bias(f, "attn_output"),
        mlp_bias=_has_bias(f, "ffn_up"),
    )


def _glm4(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """GLM-4 (Glm4Model): q / k / v biases from the tensors; the partial rotary factor comes
    from rope.dimension_count (_rope)."""
    kwargs["attention_bias"] = _has_bias(f, "attn_q")


# llama.cpp's SmolLM3 graph skips rope on layer il where (il + 1) % 4 == 0 (no GGUF key)
_SMOLLM3_NOPE_STEP = 4


def _smollm3(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """SmolLM3 (SmolLM3Model): Llama's layout with the NoPE layers llama.cpp assumes, every 4th
    (HF's `no_rope_layers`, 1 where a layer rotates); biases from the tensors."""
    step = _SMOLLM3_NOPE_STEP
    kwargs.update(
        no_rope_layer_interval=step,
        no_rope_layers=[int((i + 1) % step != 0) for i in range(layers)],
        attention_bias=_has_bias(f, "attn_q"),
        mlp_bias=_has_bias(f, "ffn_up"),
    )


def _nemotron_h(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Nemotron-H / Nemotron 3 (NemotronHModel): each block one mixer. llama.cpp tells them by
    per-layer head_count_kv (attention) and feed_forward_length (MLP / MoE), both 0 on Mamba
    blocks; we read the kind off the tensors each block holds (NemotronHModel writes 0 for a
    dense model's MLP blocks when its config lists the blocks instead of giving a pattern string)
    and check the kv heads against it."""
    kv = meta.get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    if len(kv) != layers:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.head_count_kv has {len(kv)} entries for "
            f"{layers} layers"
        )
    types = []
    for i in range(layers):
        if _has(f, i, "ssm_in"):
            kind = "linear_attention"
        elif _has(f, i, "attn_q"):
            kind = "full_attention"
        elif _has(f, i, "ffn_gate_inp"):
            kind = "moe"
        elif _has(f, i, "ffn_up"):
            kind = "mlp"
        else:
            raise ValueError(
                f"GGUF layer {i} holds neither ssm_in, attn_q, ffn_gate_inp nor ffn_up"
            )
        if (int(kv[i]) > 0) != (kind == "full_attention"):
            raise ValueError(
                f"GGUF layer {i} ({kind}) does not match {meta.arch}.attention.head_count_kv[{i}]"
                f"={kv[i]}"
            )
        types.append(kind)
    mamba = _mamba2(meta, f, [i for i, t in enumerate(types) if t == "linear_attention"])
    eps = meta.get_float("attention.layer_norm_rms_epsilon", None) or meta.get_float(
        "attention.layer_norm_epsilon", 1e-5
    )
    mlp = [i for i, t in enumerate(types) if t == "mlp"]
    attn = [i for i, t in enumerate(types) if t == "full_attention"]
    if mlp:  # the MLP blocks' width (feed_forward_length's nonzero entries)
        kwargs["intermediate_size"] = f.tensors[f"blk.{mlp[0]}.ffn_up.weight"].shape[0]
    else:  # MoE blocks only: NemotronHConfig's default stands
        del kwargs["intermediate_size"]
    kwargs.update(
        layers_block_type=types,
        mamba_num_heads=mamba["heads"],
        mamba_head_dim=mamba["head_dim"],
        n_groups=mamba["groups"],
        ssm_state_size=mamba["state"],
        conv_kernel=mamba["conv"],
        use_conv_bias=mamba["conv_bias"],
        use_bias=mamba["proj_bias"],
        mlp_bias=bool(mlp) and f"blk.{mlp[0]}.ffn_up.bias" in f.tensors,
        attention_bias=bool(attn) and f"blk.{attn[0]}.attn_q.bias" in f.tensors,
        rms_norm_eps=eps,
        layer_norm_epsilon=eps,
    )
    moe = [i for i, t in enumerate(types) if t == "moe"]
    if not moe:
        return
    size = meta.get_int("expert_feed_forward_length", None)
    if size is None:
        size = f.tensors[f"blk.{moe[0]}.ffn_up_exps.weight"].shape[1]
    shared = meta.get_int("expert_shared_feed_forward_length", None)
    if shared is None:
        shared = f.tensors[f"blk.{moe[0]}.ffn_up_shexp.weight"].shape[0]
    latent = meta.get_int("moe_latent_size", None)
    if latent is None and _has(f, moe[0], "ffn_latent_down"):
        latent = f.tensors[f"blk.{moe[0]}.ffn_latent_down.weight"].shape[0]
    kwargs.update(
        n_routed_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        moe_intermediate_size=size,
        moe_shared_expert_intermediate_size=shared,
        n_shared_experts=meta.get_int("expert_shared_count", 1),
        moe_latent_size=latent,
        # llama.cpp's defaults where NemotronHModel wrote nothing
        norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
        routed_scaling_factor=meta.get_float("expert_weights_scale", 1.0),
        n_group=meta.get_int("expert_group_count", 1),
        topk_group=meta.get_int("expert_group_used_count", 1),
        mlp_bias=f"blk.{moe[0]}.ffn_up_shexp.bias" in f.tensors,
    )


def _falcon_h1(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Falcon-H1 (FalconH1Model: Mamba2Model's ssm.* keys, then attention keys over them): every
    layer holds attention and a Mamba2 mixer of ssm.inner_size (mamba_d_ssm) in time_step_rank
    heads; the gated norm only where the checkpoint had one (mamba_rms_norm), applied after the
    gate as llama.cpp does (mamba_norm_before_gate False). The converter folds every multiplier
    into a weight and writes none, so they load as 1; biases from the first layer's tensors."""
    lacking = [i for i in range(layers) if not _has(f, i, "ssm_in")]
    if lacking:
        raise ValueError(
            f"GGUF layer {lacking[0]} lacks ssm_in (every Falcon-H1 layer holds a Mamba2 mixer)"
        )
    mamba = _mamba2(meta, f, list(range(layers)))
    kwargs.update(
        mamba_d_ssm=mamba["inner"],
        mamba_n_heads=mamba["heads"],
        mamba_d_head=mamba["head_dim"],
        mamba_n_groups=mamba["groups"],
        mamba_d_state=mamba["state"],
        mamba_d_conv=mamba["conv"],
        mamba_conv_bias=mamba["conv_bias"],
        mamba_proj_bias=mamba["proj_bias"],
        mamba_rms_norm=_has(f, 0, "ssm_norm"),
        mamba_norm_before_gate=False,
        projectors_bias=_has_bias(f, "ssm_out"),
        attention_bias=_has_bias(f, "attn_q"),
        mlp_bias=_has_bias(f, "ffn_up"),
        embedding_multiplier=1.0,
        lm_head_multiplier=1.0,
        key_multiplier=1.0,
        attention_in_multiplier=1.0,
        attention_out_multiplier=1.0,
        ssm_in_multiplier=1.0,
        ssm_out_multiplier=1.0,
        ssm_multipliers=[1.0] * 5,
        mlp_multipliers=[1.0, 1.0],
    )


def _every(picked: list[int], layers: int, what: str) -> tuple[int, int]:
    """(period, offset) such that the layers i with i % period == offset are `picked`, offset <
    period (JambaConfig's attn_layer_* / expert_layer_*); none picked: offset = layers."""
    if not picked:
        return layers + 1, layers
    offset = picked[0]
    period = picked[1] - offset if len(picked) > 1 else max(offset + 1, layers - offset)
    if offset >= period or [i for i in range(layers) if i % period == offset] != picked:
        raise ValueError(
            f"GGUF {what} layers {picked} are not every n-th layer from one below n, as "
            "JambaConfig lays them out"
        )
    return period, offset


def _jamba(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Jamba (JambaModel): attention layers are those with kv heads in the per-layer
    head_count_kv (0 on Mamba layers, which hold ssm_in), MoE layers those with a router; both
    evenly spaced as JambaConfig's periods and offsets say. The Mamba (v1) mixer from ssm.*
    (inner_size = mamba_expand x hidden, time_step_rank = dt rank); experts as wide as the MLPs
    (feed_forward_length); attention with hidden / heads per head and no rope."""
    kv = meta.get("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != layers:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.head_count_kv: expected one entry per layer "
            f"(0 for Mamba layers), got {kv!r}"
        )
    for i, n in enumerate(kv):
        if _has(f, i, "ssm_in") != (int(n) == 0):
            raise ValueError(
                f"GGUF layer {i} does not match {meta.arch}.attention.head_count_kv[{i}]={n}"
            )
    attn = [i for i, n in enumerate(kv) if int(n) > 0]
    sparse = [i for i in range(layers) if _has(f, i, "ffn_gate_inp")]
    attn_period, attn_offset = _every(attn, layers, "attention")
    expert_period, expert_offset = _every(sparse, layers, "MoE")
    head_dim = kwargs.pop("head_dim")  # not a JambaConfig field: hidden / heads
    hidden = kwargs["hidden_size"]
    if head_dim != hidden // kwargs["num_attention_heads"]:
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.key_length={head_dim} is not "
            "embedding_length / head_count, which Jamba assumes"
        )
    ff = kwargs["intermediate_size"] = meta.get_int("feed_forward_length")
    for i in sparse:
        size = f.tensors[f"blk.{i}.ffn_gate_exps.weight"].shape[1]
        if size != ff:
            raise ValueError(
                f"GGUF layer {i}'s experts are {size} wide, not feed_forward_length={ff} "
                "(Jamba's experts and MLPs share intermediate_size)"
            )
    inner = meta.get_int("ssm.inner_size")
    if inner % hidden:
        raise ValueError(
            f"GGUF metadata {meta.arch}.ssm.inner_size={inner} is no whole multiple of "
            f"embedding_length={hidden} (Jamba's mamba_expand)"
        )
    experts = _largest(meta.get("expert_count", 1 if not sparse else _MISSING))
    mamba = [i for i in range(layers) if i not in attn]
    first = mamba[0] if mamba else 0
    kwargs.update(
        attn_layer_period=attn_period,
        attn_layer_offset=attn_offset,
        expert_layer_period=expert_period,
        expert_layer_offset=expert_offset,
        num_experts=experts,
        num_experts_per_tok=_largest(meta.get("expert_used_count", 1 if not sparse else _MISSING)),
        mamba_d_state=meta.get_int("ssm.state_size"),
        mamba_d_conv=meta.get_int("ssm.conv_kernel"),
        mamba_expand=inner // hidden,
        mamba_dt_rank=meta.get_int("ssm.time_step_rank"),
        mamba_conv_bias=f"blk.{first}.ssm_conv1d.bias" in f.tensors,
        mamba_proj_bias=f"blk.{first}.ssm_in.bias" in f.tensors,
    )


def _largest(value: Any) -> int:
    """An integer key, or the largest entry of a per-layer one."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def _exaone4(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """EXAONE 4 (Exaone4Model): with attention.sliding_window, the sliding layers from the
    per-layer attention.sliding_window_pattern (true = sliding; an integer n: every n-th layer
    global), every 4th global when the file has no pattern; the global layers do not rotate
    (the model decides that from layer_types). Without a window every layer is global.
    llama.cpp itself windows only 64-layer files (the 32B; 4096 and every 4th layer global when
    the keys are missing) and runs other files' layers all global; we follow the file's keys,
    as HF does the checkpoint's config."""
    window = meta.get_int("attention.sliding_window", 4096 if layers == 64 else None)
    if not window:
        kwargs.update(sliding_window=None, layer_types=["full_attention"] * layers)
        return
    kwargs.update(sliding_window=window, layer_types=_sliding_layer_types(meta, layers, 4))


def _sliding_layer_types(meta: _Meta, layers: int, period: int) -> list[str]:
    """layer_types from attention.sliding_window_pattern as llama.cpp writes it: a per-layer
    list of is-sliding flags, or an integer n (`period` when absent): every n-th layer global."""
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"GGUF metadata {meta.arch}.attention.sliding_window_pattern has {len(pattern)} "
                f"entries for {layers} layers"
            )
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and pattern >= 1:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise ValueError(f"GGUF metadata {meta.arch}.attention.sliding_window_pattern={pattern!r}")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _apertus(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Apertus (ApertusModel): the MLP's activation is xIELU (its scalars: convert.py)."""
    kwargs.update(hidden_act="xielu", attention_bias=_has_bias(f, "attn_q"))


def _arcee(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Arcee AFM (ArceeModel): Llama's layout with a relu^2 MLP; biases from the tensors."""
    kwargs.update(
        hidden_act="relu2",
        attention_bias=_has_bias(f, "attn_q"),
        mlp_bias=_has_bias(f, "ffn_up"),
    )


def _experts_width(meta: _Meta, f: GGUFFile, sparse: list[int], key: str) -> int:
    """The experts' width: `key`, else the first MoE layer's merged gate rows."""
    size = meta.get_int(key, None)
    if size is None:
        if not sparse or f"blk.{sparse[0]}.ffn_gate_exps.weight" not in f.tensors:
            raise ValueError(f"GGUF metadata lacks {meta.arch}.{key}")
        size = f.tensors[f"blk.{sparse[0]}.ffn_gate_exps.weight"].shape[1]
    return size


def _sparse(f: GGUFFile, layers: int) -> list[int]:
    return [i for i in range(layers) if _has(f, i, "ffn_gate_inp")]


def _olmoe(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """OLMoE (OlmoeModel, llama.cpp's OLMoE graph): every layer MoE, experts of
    feed_forward_length, softmax routing never renormalized, no q/k/v clamp."""
    kwargs.update(
        num_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        intermediate_size=_experts_width(meta, f, _sparse(f, layers), "feed_forward_length"),
        norm_topk_prob=False,
        clip_qkv=None,
    )


def _sigmoid_gating(meta: _Meta) -> None:
    func = meta.get_int("expert_gating_func", 2)
    if func != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ValueError(
            f"GGUF metadata {meta.arch}.expert_gating_func={func}: only sigmoid (2) is supported"
        )


def _minimax_m2(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """MiniMax-M2 (MiniMaxM2Model): every layer MoE with sigmoid scores, the router bias and
    renormalized top-k weights; experts of expert_feed_forward_length; partial rotary of
    rope.dimension_count (HF's rotary_dim)."""
    _sigmoid_gating(meta)
    kwargs.update(
        num_local_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        intermediate_size=_experts_width(meta, f, _sparse(f, layers), "expert_feed_forward_length"),
        rotary_dim=meta.get_int("rope.dimension_count", kwargs["head_dim"]),
        scoring_func="sigmoid",
        use_routing_bias=True,
    )


def _hunyuan(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Hunyuan (HunYuanModel / HunYuanMoEModel): rope.freq_base is already the NTK-alpha base
    (the plain rope rotates with it); MoE: every layer, softmax routing renormalized, experts
    of expert_feed_forward_length and one shared MLP of expert_shared_feed_forward_length."""
    kwargs["attention_bias"] = _has_bias(f, "attn_q")
    sparse = _sparse(f, layers)
    if not sparse:
        return
    shared = meta.get_int("expert_shared_feed_forward_length", None)
    if shared is None:
        shared = f.tensors[f"blk.{sparse[0]}.ffn_up_shexp.weight"].shape[0]
    kwargs.update(
        num_experts=meta.get_int("expert_count"),
        moe_topk=meta.get_int("expert_used_count"),
        moe_intermediate_size=_experts_width(meta, f, sparse, "expert_feed_forward_length"),
        intermediate_size=shared,  # HF sizes the shared MLP by intermediate_size
        num_shared_expert=1,
    )


def _dots1(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """dots.llm1 (Dots1Model): leading_dense_block_count dense layers, then MoE layers with
    sigmoid scores, the router bias and expert_shared_count shared experts; llama.cpp routes
    without groups and attends without a window, so the config has neither."""
    _sigmoid_gating(meta)
    sparse = _sparse(f, layers)
    kwargs.update(
        n_routed_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        moe_intermediate_size=_experts_width(meta, f, sparse, "expert_feed_forward_length"),
        first_k_dense_replace=meta.get_int(
            "leading_dense_block_count", sparse[0] if sparse else layers
        ),
        n_shared_experts=meta.get_int("expert_shared_count", 1),
        routed_scaling_factor=meta.get_float("expert_weights_scale", 1.0),
        norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
        n_group=1,
        topk_group=1,
        sliding_window=None,
        layer_types=["full_attention"] * layers,
        attention_bias=_has_bias(f, "attn_q"),
    )


def _nemotron(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Nemotron (NemotronModel): LayerNorm1P with attention.layer_norm_epsilon, an ungated
    relu^2 MLP; partial rotary from rope.dimension_count (the generic rope)."""
    kwargs.pop("rms_norm_eps")
    kwargs.update(
        norm_eps=meta.get_float("attention.layer_norm_epsilon", 1e-5),
        hidden_act="relu2",
        attention_bias=_has_bias(f, "attn_q"),
        mlp_bias=_has_bias(f, "ffn_up"),
    )


def _ernie4_5(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """ERNIE 4.5 (Ernie4_5Model): one bias switch for every projection, from the tensors."""
    kwargs["use_bias"] = _has_bias(f, "attn_q")


# what llama.cpp's gpt-oss graph hard-codes: the SwiGLU clamp and every even layer sliding
_GPT_OSS_SWIGLU_LIMIT = 7.0


def _gpt_oss(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """gpt-oss (GptOssModel): experts expert_feed_forward_length wide in every layer, the even
    layers sliding over attention.sliding_window and the SwiGLU limit as llama.cpp runs them (no
    key records either), q / k / v / o biases from the tensors. YaRN comes from rope.scaling.*
    (_rope) without `truncate`: the correction range is truncated, as llama.cpp computes it
    (OpenAI's checkpoints say truncate: false)."""
    kwargs.update(
        num_local_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        intermediate_size=meta.get_int("expert_feed_forward_length"),
        sliding_window=meta.get_int("attention.sliding_window"),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        attention_bias=_has_bias(f, "attn_q"),
        swiglu_limit=_GPT_OSS_SWIGLU_LIMIT,
    )


# what llama.cpp's llama4 graph hard-codes (no key): the attention chunk, the NoPE step, the
# NoPE layers' query temperature, and q/k norms off for the 128-expert model alone
_LLAMA4_CHUNK = 8192
_LLAMA4_NOPE_STEP = 4
_LLAMA4_FLOOR_SCALE, _LLAMA4_ATTN_SCALE = 8192, 0.1
_LLAMA4_NO_QK_NORM_EXPERTS = 128


def _llama4(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """Llama 4 (Llama4Model): dense MLPs of feed_forward_length, experts of
    expert_feed_forward_length on the layers holding a router; chunked rope layers, NoPE every
    4th with the query temperature, as llama.cpp runs them; attention.sliding_window 0
    (MobileLLM): no chunks and no temperature, rope on every layer but the last (llama.cpp's
    NoPE step becomes the layer count)."""
    experts, sparse = meta.get_int("expert_count", 0), _sparse(f, layers)
    dense = kwargs["intermediate_size"]
    chunked = meta.get_int("attention.sliding_window", None) != 0
    step = _LLAMA4_NOPE_STEP if chunked else layers
    rope = [int((i + 1) % step != 0) for i in range(layers)]
    kwargs.update(
        num_local_experts=experts,
        num_experts_per_tok=meta.get_int("expert_used_count", 1),
        intermediate_size=_experts_width(meta, f, sparse, "expert_feed_forward_length")
        if experts
        else dense,
        intermediate_size_mlp=dense,
        interleave_moe_layer_step=meta.get_int("interleave_moe_layer_step", 1),
        moe_layers=sparse,
        no_rope_layers=rope,
        attention_chunk_size=_LLAMA4_CHUNK if chunked else None,
        layer_types=["chunked_attention" if chunked and r else "full_attention" for r in rope],
        attn_temperature_tuning=chunked,
        floor_scale=_LLAMA4_FLOOR_SCALE,
        attn_scale=_LLAMA4_ATTN_SCALE,
        use_qk_norm=experts != _LLAMA4_NO_QK_NORM_EXPERTS,
        attention_bias=_has_bias(f, "attn_q"),
    )


def _deepseek2(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """DeepSeek-V2 / V3 (DeepseekV2Model): MLA sizes from kv_lora_rank, key_length_mla,
    value_length_mla and rope.dimension_count (the file's head_count_kv 1 and key / value
    lengths are the MQA form llama.cpp runs); a low-rank q only where the tensors hold one;
    leading dense layers, then MoE layers with shared experts; expert groups and their top-k
    when the file has them (else 1, no group limit); the gating (V2 softmax, V3 sigmoid) chose
    the class (archs.gguf_arch)."""
    heads = kwargs["num_attention_heads"]
    rope_dims = meta.get_int("rope.dimension_count")
    groups = meta.get_int("expert_group_count", 1)
    kwargs.update(
        num_key_value_heads=heads,
        head_dim=rope_dims,
        kv_lora_rank=meta.get_int("attention.kv_lora_rank"),
        q_lora_rank=meta.get_int("attention.q_lora_rank") if _has(f, 0, "attn_q_a") else None,
        qk_rope_head_dim=rope_dims,
        qk_nope_head_dim=meta.get_int("attention.key_length_mla") - rope_dims,
        v_head_dim=meta.get_int("attention.value_length_mla"),
        n_routed_experts=meta.get_int("expert_count"),
        num_experts_per_tok=meta.get_int("expert_used_count"),
        n_shared_experts=meta.get_int("expert_shared_count", 0),
        moe_intermediate_size=meta.get_int("expert_feed_forward_length"),
        first_k_dense_replace=meta.get_int("leading_dense_block_count", 0),
        routed_scaling_factor=meta.get_float("expert_weights_scale", 1.0),
        norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
        n_group=groups,
        topk_group=meta.get_int("expert_group_used_count", groups),
    )
    if kwargs["architectures"] == ["DeepseekV2ForCausalLM"]:
        kwargs["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"


def _starcoder2(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], layers: int) -> None:
    """StarCoder2 (StarCoder2Model): LayerNorms of attention.layer_norm_epsilon, biases from the
    tensors, no sliding window (none recorded; llama.cpp attends to the whole context)."""
    kwargs.pop("rms_norm_eps")
    kwargs.update(
        norm_epsilon=meta.get_float("attention.layer_norm_epsilon", 1e-5),
        use_bias=_has_bias(f, "attn_q"),
        sliding_window=None,
    )


_MORE = {
    "exaone4": _exaone4,
    "apertus": _apertus,
    "arcee": _arcee,
    "granite": _granite,
    "granitemoe": _granite_moe,
    "smollm3": _smollm3,
    "seed_oss": _seed_oss,
    "olmo2": _olmo2,
    "glm4": _glm4,
    "starcoder2": _starcoder2,
    "ernie4_5": _ernie4_5,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "deepseek2": _deepseek2,
    "olmoe": _olmoe,
    "minimax_m2": _minimax_m2,
    "hunyuan": _hunyuan,
    "dots1": _dots1,
    "nemotron": _nemotron,
}


def _common(meta: _Meta, f: GGUFFile) -> dict[str, Any]:
    """(hidden, heads, kv heads, layers) and what every config takes from the file."""
    if "token_embd.weight" not in f.tensors:
        raise ValueError("GGUF file lacks the tensor token_embd.weight")
    heads = meta.get_int("attention.head_count")
    return dict(
        hidden=meta.get_int("embedding_length"),
        heads=heads,
        kv=_kv_heads(meta, heads),
        layers=meta.get_int("block_count"),
        vocab_size=f.tensors["token_embd.weight"].shape[0],
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
    )


def _ffn_width(meta: _Meta, f: GGUFFile) -> int:
    """The MLP's width off the first layer's ffn_up rows (Falcon's and StarCoder's converters
    write 4 x hidden as feed_forward_length, whatever the checkpoint's)."""
    if "blk.0.ffn_up.weight" in f.tensors:
        return f.tensors["blk.0.ffn_up.weight"].shape[0]
    return meta.get_int("feed_forward_length")


def _falcon_config(meta: _Meta, f: GGUFFile, spec: GGUFArch):
    """Falcon (FalconModel): 7B's layout (multi-query, one norm) when head_count_kv is 1 and
    layers have no attn_norm_2, else the new decoder architecture with head_count_kv groups and
    one or two norms; always parallel attention, no ALiBi (llama.cpp has neither sequential
    layers nor ALiBi for Falcon); biases from the tensors; rope base 10000 unless written."""
    import transformers

    c = _common(meta, f)
    two_norms = "blk.0.attn_norm_2.weight" in f.tensors
    new_arch = c["kv"] != 1 or two_norms
    kwargs: dict[str, Any] = dict(
        architectures=[spec.hf_arch],
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_kv_heads=c["kv"] if new_arch else None,
        new_decoder_architecture=new_arch,
        multi_query=True,  # (ignored by the new architecture)
        num_ln_in_parallel_attn=2 if two_norms else 1,
        parallel_attn=True,
        alibi=False,
        bias=_has_bias(f, "attn_qkv"),
        ffn_hidden_size=_ffn_width(meta, f),
        layer_norm_epsilon=meta.get_float("attention.layer_norm_epsilon", 1e-5),
        max_position_embeddings=meta.get_int("context_length", 2048),
        tie_word_embeddings=c["tie_word_embeddings"],
        bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"],
        pad_token_id=c["pad_token_id"],
    )
    config = transformers.FalconConfig(**kwargs)
    theta = meta.rope_base()
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:  # pragma: no cover - transformers 4.x
        config.rope_theta = theta
    return config


def _starcoder_config(meta: _Meta, f: GGUFFile, spec: GGUFArch):
    """StarCoder / GPT-BigCode (StarCoderModel): multi-query when head_count_kv is 1; the
    learned positions' rows are n_positions."""
    import transformers

    c = _common(meta, f)
    if c["kv"] not in (1, c["heads"]):
        raise ValueError(
            f"GGUF metadata {meta.arch}.attention.head_count_kv={c['kv']}: GPT-BigCode has "
            "one KV head or one per head"
        )
    if "position_embd.weight" not in f.tensors:
        raise ValueError("GGUF file lacks the tensor position_embd.weight")
    return transformers.GPTBigCodeConfig(
        architectures=[spec.hf_arch],
        vocab_size=c["vocab_size"],
        n_embd=c["hidden"],
        n_layer=c["layers"],
        n_head=c["heads"],
        n_inner=_ffn_width(meta, f),
        n_positions=f.tensors["position_embd.weight"].shape[0],
        multi_query=c["kv"] == 1,
        layer_norm_epsilon=meta.get_float("attention.layer_norm_epsilon", 1e-5),
        tie_word_embeddings=c["tie_word_embeddings"],
        bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"],
        pad_token_id=c["pad_token_id"],
    )


def _dbrx_config(meta: _Meta, f: GGUFFile, spec: GGUFArch):
    """DBRX (DbrxModel): every layer MoE, softmax routing with the top-k weights renormalized
    (llama.cpp's, HF's moe_normalize_expert_weights 1), experts of feed_forward_length
    (else the stacked gate's rows), q/k/v clamped at attention.clamp_kqv."""
    import transformers

    c = _common(meta, f)
    experts = meta.get_int("expert_count")
    ff = meta.get_int("feed_forward_length", None)
    if ff is None:
        ff = f.tensors["blk.0.ffn_gate_exps.weight"].shape[1]
    theta = meta.rope_base()
    clip = meta.get_float("attention.clamp_kqv", None)
    config = transformers.DbrxConfig(
        architectures=[spec.hf_arch],
        vocab_size=c["vocab_size"],
        d_model=c["hidden"],
        n_heads=c["heads"],
        n_layers=c["layers"],
        max_seq_len=meta.get_int("context_length", 2048),
        attn_config={"kv_n_heads": c["kv"], "clip_qkv": clip or None, "rope_theta": theta},
        ffn_config={
            "ffn_hidden_size": ff,
            "moe_num_experts": experts,
            "moe_top_k": meta.get_int("expert_used_count"),
            "moe_normalize_expert_weights": 1.0,
        },
        tie_word_embeddings=c["tie_word_embeddings"],
        bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"],
        pad_token_id=c["pad_token_id"],
    )
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


_OWN_CONFIGS = {"falcon": _falcon_config, "starcoder": _starcoder_config, "dbrx": _dbrx_config}


# layers of the largest Gemma 2 / 3 (27B), whose attention scale llama.cpp takes from
# hidden / heads instead of head_dim (gemma_pytorch's config; HF's query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma(meta: _Meta, arch: str, kwargs: dict[str, Any], rope: dict[str, Any]) -> dict:
    layers, hidden, heads = (
        kwargs["num_hidden_layers"],
        kwargs["hidden_size"],
        kwargs["num_attention_heads"],
    )
    scale = meta.get_float("attention.scale", None)
    if scale is not None:
        kwargs["query_pre_attn_scalar"] = scale**-2
    elif layers == _GEMMA_27B_LAYERS[arch]:
        kwargs["query_pre_attn_scalar"] = hidden // heads
    else:
        kwargs["query_pre_attn_scalar"] = kwargs["head_dim"]
    # every 2nd layer global in Gemma 2, every 6th in Gemma 3, unless the file says otherwise
    kwargs["layer_types"] = _sliding_layer_types(meta, layers, 2 if arch == "gemma2" else 6)
    if arch == "gemma2":
        kwargs["sliding_window"] = meta.get_int("attention.sliding_window", 4096)
        kwargs["attn_logit_softcapping"] = meta.get_float("attn_logit_softcapping", 50.0)
        kwargs["final_logit_softcapping"] = meta.get_float("final_logit_softcapping", 30.0)
        return rope
    kwargs["sliding_window"] = meta.get_int("attention.sliding_window", None)
    kwargs["attn_logit_softcapping"] = None
    kwargs["final_logit_softcapping"] = meta.get_float("final_logit_softcapping", None)
    # Gemma 3: the sliding layers rotate with their own unscaled base
    local = {"rope_type": "default", "rope_theta": meta.rope_base("rope.freq_base_swa")}
    return {"full_attention": rope, "sliding_attention": local}


def _phi3(meta: _Meta, f: GGUFFile, kwargs: dict[str, Any], rope: dict[str, Any]) -> dict:
    # llama.cpp writes sliding_window 0 for Phi-4 (no window)
    kwargs["sliding_window"] = meta.get_int("attention.sliding_window", 0) or None
    original = meta.get_int("rope.scaling.original_context_length", None)
    if original is not None:
        kwargs["original_max_position_embeddings"] = original
    if "rope_factors_long.weight" not in f.tensors:
        return rope
    if original is None:
        raise ValueError(
            f"GGUF metadata lacks {meta.arch}.rope.scaling.original_context_length "
            "(the file has longrope factors)"
        )
    return {
        **rope,
        "rope_type": "longrope",
        "long_factor": f.tensor("rope_factors_long.weight").float().tolist(),
        "short_factor": f.tensor("rope_factors_short.weight").float().tolist(),
        "original_max_position_embeddings": original,
    }
