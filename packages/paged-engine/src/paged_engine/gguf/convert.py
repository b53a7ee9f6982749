"""GGUF (llama.cpp naming) -> HF: config from metadata, tensor names, and undoing the Q/K
row permutation llama.cpp applies to Llama checkpoints for its interleaved-pair RoPE."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from paged_engine.gguf.reader import GGUFFile

# GGUF architecture -> (HF architectures[0], HF config class name, undo Q/K permutation?)
GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", True),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_SKIP = ("rope_freqs.weight",)  # Llama 3.1 rope factors: read into config.rope_freq_factors


def _arch(f: GGUFFile) -> tuple[str, tuple[str, str, bool]]:
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHS)}")
    return arch, GGUF_ARCHS[arch]


def gguf_to_hf_config(f: GGUFFile):
    """An HF PretrainedConfig built from the file's `<arch>.*` and tokenizer metadata."""
    import transformers

    arch, (hf_arch, config_cls, _) = _arch(f)

    def meta(key: str, default=None):
        return f.get(f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = int(meta("vocab_size", len(tokens) if tokens else 0))
    if not vocab:
        vocab = f.tensors["token_embd.weight"].shape[0]
    kwargs = dict(
        architectures=[hf_arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=f.get("tokenizer.ggml.padding_token_id"),
    )
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    if meta("rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    head_dim = meta("attention.key_length")
    if head_dim is not None and int(head_dim) != hidden // heads:
        kwargs["head_dim"] = int(head_dim)
    if "rope_freqs.weight" in f.tensors:  # Llama 3.1 scaling, baked into per-freq divisors
        kwargs["rope_freq_factors"] = f.tensor("rope_freqs.weight").float().tolist()
    config = getattr(transformers, config_cls)(**kwargs)
    # transformers >= 5 reads rope settings from rope_parameters, older versions from these.
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:  # pragma: no cover - transformers 4.x
        config.rope_theta = rope["rope_theta"]
        config.rope_scaling = rope if rope["rope_type"] != "default" else None
    return config


def hf_tensor_name(name: str) -> str | None:
    """HF name of a llama.cpp tensor name; None for tensors we do not load."""
    if name in _SKIP:
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {name!r}")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows (0, 2, 4, .., 1, 3, ..) -> HF's halves."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def gguf_weights(f: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, dequantized CPU tensor) for every tensor of a supported GGUF model."""
    arch, (_, _, permuted) = _arch(f)
    heads = int(f.get(f"{arch}.attention.head_count"))
    kv_heads = int(f.get(f"{arch}.attention.head_count_kv", heads))
    for name in f.tensors:
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            continue
        w = f.tensor(name)
        if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_qk(w, heads)
        elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_qk(w, kv_heads)
        yield hf_name, w
