"""Tiny speculative-decoding drafts beside a tiny target: EAGLE / EAGLE-3 heads and an MTP
target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from paged_engine.testing.models import write_tiny_model


def write_tiny_eagle3_head(
    path: str | Path,
    target: str | Path,
    *,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    embed: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
    speculators: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write an EAGLE-3 head for the tiny model at `target` in the EAGLE authors' layout
    (models/llama_eagle3.py): config.json (LlamaForCausalLMEagle3) and model.safetensors with
    `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` / `t2d`, and `embed_tokens` if `embed`.
    Random weights; `draft_vocab_size` < the target's keeps a random sorted subset of its ids.
    `weights` replace the random ones by name (the authors' names). `speculators`: the same
    head in the speculators layout (the layer's config under `transformer_layer_config`, the
    head's fields beside it, `layers.0.*` for `midlayer.*`)."""
    import json

    from safetensors.torch import save_file

    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tc = json.loads((target / "config.json").read_text())
    d, vocab = int(tc["hidden_size"]), int(tc["vocab_size"])
    heads = int(tc["num_attention_heads"])
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = int(tc.get("head_dim") or d // heads)
    inter = int(tc.get("intermediate_size") or 2 * d)
    dv = draft_vocab_size or vocab
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(tc.get("max_position_embeddings") or 1024),
        "rms_norm_eps": float(tc.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(tc.get("rope_theta") or 10000.0),
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "tie_word_embeddings": False,
        **config_overrides,
    }
    if speculators:
        head_keys = ("draft_vocab_size", "target_hidden_size", "norm_before_residual")
        head_keys += ("eagle_aux_hidden_state_layer_ids",)
        layer = {k: v for k, v in config.items() if k not in head_keys and k != "architectures"}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "norm_before_residual": False,
            **{k: config[k] for k in head_keys if k in config},
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": str(target), "architectures": tc["architectures"]},
            },
        }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn((rows, cols), generator=gen) * cols**-0.5

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(d, generator=gen) * 0.1

    out = {
        "midlayer.self_attn.q_proj.weight": mat(heads * head_dim, 2 * d),
        "midlayer.self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.o_proj.weight": mat(d, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": mat(inter, d),
        "midlayer.mlp.up_proj.weight": mat(inter, d),
        "midlayer.mlp.down_proj.weight": mat(d, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "fc.weight": mat(d, 3 * d),
        "norm.weight": norm(),
        "lm_head.weight": mat(dv, d) * 4.0,
    }
    ids = (
        torch.arange(vocab) if dv == vocab else torch.randperm(vocab, generator=gen)[:dv].sort()[0]
    )
    out["d2t"] = ids - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    if embed:
        out["embed_tokens.weight"] = torch.randn((vocab, d), generator=gen) * 0.5
    out.update(weights or {})
    if speculators:
        out = {k.replace("midlayer.", "layers.0."): v for k, v in out.items()}
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors")
    return path


def write_tiny_eagle_head(
    path: str | Path,
    target: str | Path,
    *,
    seed: int = 0,
    bias: bool = True,
    para_norm: bool = False,
    num_layers: int = 1,
) -> Path:
    """Write an EAGLE-1 head for the tiny model at `target` in the EAGLE authors' layout
    (models/llama_eagle.py): a Llama config of the target's width and vocabulary, and
    model.safetensors with `fc.weight` (+ `fc.bias`), `layers.{i}.*` without
    `layers.0.input_layernorm`, and (HASS, `para_norm`) `embedding_layernorm` /
    `hidden_states_layernorm`. Random weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tc = json.loads((target / "config.json").read_text())
    d = int(tc.get("hidden_size") or tc.get("n_embd"))
    config = LlamaConfig(
        vocab_size=int(tc["vocab_size"]),
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        add_para_norm=para_norm,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {
        "fc.weight": torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5,
    }
    if bias:
        out["fc.bias"] = torch.randn(d, generator=gen) * 0.1
    if para_norm:
        for name in ("embedding_layernorm", "hidden_states_layernorm"):
            out[f"{name}.weight"] = 1.0 + torch.randn(d, generator=gen) * 0.1
    for i in range(num_layers):
        layer = LlamaDecoderLayer(config, i)
        for name, t in sorted(layer.state_dict().items()):
            if i == 0 and name.startswith("input_layernorm."):
                continue  # EAGLE's first layer has no input norm
            if t.dim() >= 2:
                w = torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5
            else:
                w = 1.0 + torch.randn(t.shape, generator=gen) * 0.1
            out[f"layers.{i}.{name}"] = w
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors")
    return path


def write_tiny_mtp_target(
    path: str | Path,
    arch: str = "deepseek_v3",
    *,
    seed: int = 0,
    own_embed: bool = True,
    own_head: bool = True,
) -> Path:
    """A tiny target with one multi-token-prediction layer in its checkpoint, laid out as its
    family ships it (models/mtp.py). `deepseek_v3` (3 layers): `num_nextn_predict_layers: 1`
    and `model.layers.3.*`: a MoE decoder block (layer 1's tensors plus noise), `enorm`,
    `hnorm`, `eh_proj`, `shared_head.norm` and, if asked, copies of the embedding and head of
    its own (`embed_tokens`, `shared_head.head`). `qwen3_next` (4 hybrid layers):
    `mtp_num_hidden_layers: 1` and `mtp.*`: `layers.0` (full-attention layer 2's tensors plus
    noise), `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`. Random weights."""
    from safetensors.torch import load_file, save_file

    deepseek = arch in ("deepseek_v3", "glm4_moe")  # model.layers.{L}.* (both: layer 1 MoE)
    if not deepseek and arch != "qwen3_next":
        raise ValueError(f"no tiny MTP layout for {arch!r}: deepseek_v3, glm4_moe or qwen3_next")
    extra_config = {"num_nextn_predict_layers" if deepseek else "mtp_num_hidden_layers": 1}
    path = write_tiny_model(path, arch, seed=seed, **extra_config)
    weights = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed + 1)
    src = "model.layers.1." if deepseek else "model.layers.2."
    dst = f"model.layers.{layers}." if deepseek else "mtp."
    block = dst if deepseek else "mtp.layers.0."
    extra = {}
    for name, w in weights.items():
        if name.startswith(src):
            noise = torch.randn(w.shape, generator=gen) * (0.3 * float(w.float().std() or 0.1))
            extra[block + name[len(src) :]] = (w + noise.to(w.dtype)).contiguous()
    d = weights["model.embed_tokens.weight"].shape[1]
    vocab = weights["model.embed_tokens.weight"].shape[0]
    if deepseek:
        norms, fc = ("enorm", "hnorm", "shared_head.norm"), "eh_proj"
    else:  # (1 + w) norms
        norms, fc = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"), "fc"
    for norm in norms:
        extra[f"{dst}{norm}.weight"] = torch.randn(d, generator=gen) * 0.1 + (
            1.0 if deepseek else 0.0
        )
    extra[f"{dst}{fc}.weight"] = torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5
    if deepseek and own_embed:
        extra[f"{dst}embed_tokens.weight"] = torch.randn((vocab, d), generator=gen) * 0.5
    if deepseek and own_head:
        extra[f"{dst}shared_head.head.weight"] = torch.randn((vocab, d), generator=gen) * d**-0.5
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    return path
