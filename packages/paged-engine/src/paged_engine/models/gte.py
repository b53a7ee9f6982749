"""GTE v1.5 / multilingual (`GteModel`, `GteForSequenceClassification`; the Hub's remote-code
`NewModel` / `NewForSequenceClassification`, vLLM's `GteNewModel` /
`GteNewForSequenceClassification`): Alibaba's gte-base-en-v1.5, gte-large-en-v1.5,
gte-multilingual-base and gte-multilingual-reranker-base, Snowflake's arctic-embed-m-v2.0.
An encoder as models/bert.py's (whole sequences in one step, no KV cache, pooling only) with
rotary positions, a fused qkv and a gated MLP in BERT's post-norm layer:

    h = LN(word[ids] + token_type[0])            (no token-type table when type_vocab_size=0)
    per layer: h = attn_ln(h + o_proj attn(rope(q), rope(k), v))        [q | k | v] = qkv_proj h
               h = mlp_ln(h + down_proj(act(gate) * up))                [up | gate] = up_gate_proj h

Attention is bidirectional with NeoX rotary embeddings over the whole head. The checkpoint names
are the Hub's, which transformers' `save_pretrained` also writes (it maps them to its own
q / k / v / up / gate modules on load); a task model's backbone sits under `new.` (the Hub's)
or `gte.` (transformers'). gte-multilingual-base's config.json names its sparse-weight head
(`NewForTokenClassification`): its config is read here too, and it embeds as vLLM runs it, with
`hf_overrides={"architectures": ["GteNewModel"]}`. `RopeBertModel` is the stack Nomic BERT and
jina-embeddings-v3 share (models/nomic_bert.py, models/jina_embeddings_v3.py), each family
mapping its own names onto it.

The rope comes from `rope_parameters` (transformers' port: "default" or "linear"); the Hub's
config.json (`rope_theta`, `rope_scaling={"type": "ntk", "factor": s}`) is translated by
`new_config`: the remote code's fixed NTK scaling, base * s with every frequency divided by
s ** (2 / head_dim), is exactly a "linear" rope of factor s ** (2 / head_dim) over theta
base * s. The classifier is BERT's: classifier(tanh(pooler.dense(h[CLS]))).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import GteConfig, PretrainedConfig

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.models.bert import (
    EncoderShell,
    activation,
    rope_tables,
    rotary_encoder_attention,
    sequence_bounds,
)
from paged_engine.models.remote_aliases import common_fields, field
from paged_engine.models.utils import load_named_weights


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies from `rope_parameters` ("default" or "linear")."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise ValueError(
            f"rope_parameters: rope_type {kind!r} is not supported for this encoder "
            "('default' or 'linear')"
        )
    exps = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv = 1.0 / (float(params["rope_theta"]) ** exps)
    return inv / float(params.get("factor", 1.0)) if kind == "linear" else inv


class RopeBertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        types = int(getattr(config, "type_vocab_size", 0) or 0)
        self.token_type_embeddings = nn.Embedding(types, h) if types > 0 else None
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        x = self.word_embeddings(ids)
        if self.token_type_embeddings is not None:  # every token has type 0, as HF's default
            x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class RopeBertAttention(nn.Module):
    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv_proj = nn.Linear(h, 3 * h, bias=bias)
        self.o_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x, cos, sin, bounds: list[tuple[int, int]]) -> torch.Tensor:
        return self.o_proj(
            rotary_encoder_attention(self.qkv_proj(x), self.num_heads, cos, sin, bounds)
        )


class RopeBertMLP(nn.Module):
    """Gated: down_proj(act(gate_proj x) * up_proj x), up / gate unbiased (GTE's and Nomic's
    releases); else down_proj(act(up_proj x)), up biased as down (Jina v3's fc1 / fc2)."""

    def __init__(self, config, act: str, act_field: str, bias: bool, gated: bool) -> None:
        super().__init__()
        h, inner = config.hidden_size, int(config.intermediate_size)
        self.up_proj = nn.Linear(h, inner, bias=bias and not gated)
        self.gate_proj = nn.Linear(h, inner, bias=False) if gated else None
        self.down_proj = nn.Linear(inner, h, bias=bias)
        self.act = activation(act, act_field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class RopeBertLayer(nn.Module):
    def __init__(self, config, bias: bool, gated: bool, act: str, act_field: str) -> None:
        super().__init__()
        self.attention = RopeBertAttention(config, bias)
        self.attn_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = RopeBertMLP(config, act, act_field, bias, gated)
        self.mlp_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, cos, sin, bounds) -> torch.Tensor:
        x = self.attn_ln(x + self.attention(x, cos, sin, bounds))
        return self.mlp_ln(x + self.mlp(x))


class RopeBertEncoder(nn.Module):
    def __init__(self, config, bias: bool, gated: bool, act: str, act_field: str) -> None:
        super().__init__()
        n = config.num_hidden_layers
        self.layer = nn.ModuleList(
            RopeBertLayer(config, bias, gated, act, act_field) for _ in range(n)
        )


class RopeBertModel(EncoderShell):
    """The post-norm rotary stack under GTE's Hub names; a family sets its biases, MLP kind,
    activation and `rename_weight` (checkpoint name -> ours)."""

    prefix: ClassVar[str] = "new"
    prefixes: ClassVar[tuple[str, ...]] = ("new.", "gte.")  # a task model's backbone
    bias: ClassVar[bool] = True  # qkv_proj, o_proj, down_proj (and an ungated up_proj)
    gated: ClassVar[bool] = True

    def __init__(self, config) -> None:
        super().__init__(config)
        act, act_field = self.activation_name(config)
        self.embeddings = RopeBertEmbeddings(config)
        self.encoder = RopeBertEncoder(config, self.bias, self.gated, act, act_field)
        head_dim = config.hidden_size // config.num_attention_heads
        self.register_buffer("inv_freq", rope_inv_freq(config, head_dim), persistent=False)

    @staticmethod
    def activation_name(config) -> tuple[str, str]:
        """The MLP's activation and the config field that names it."""
        return getattr(config, "hidden_act", "gelu"), "hidden_act"

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bounds = sequence_bounds(attn_metadata)
        x = self.embeddings(input_ids)
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, cos, sin, bounds)
        return x

    def rename_weight(self, name: str) -> str:
        for p in self.prefixes:
            name = name.removeprefix(p)
        return name

    def split_fused(self, name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """GTE's `up_gate_proj` rows: [up | gate]."""
        if name.endswith("mlp.up_gate_proj.weight"):
            up, gate = w.chunk(2, dim=0)
            base = name.removesuffix("up_gate_proj.weight")
            yield base + "up_proj.weight", up
            yield base + "gate_proj.weight", gate
        else:
            yield name, w

    def skip_weight(self, name: str) -> bool:
        """Tensors no module here reads: an MLM head, a pooler no head of this class uses,
        buffers some releases save (position ids, rope frequencies)."""
        buffers = name.endswith(("position_ids", "token_type_ids", "inv_freq"))
        return buffers or name.startswith(("lm_head.", "pooler.", "classifier.", "cls."))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return load_named_weights(
            self,
            weights,
            rename=self.rename_weight,
            convert=self.split_fused,
            skip=self.skip_weight,
            strict=strict,
        )


class GteModel(RopeBertModel):
    """GTE's encoder: embeddings pooled from its final hidden states."""


class BertClassifierHead:
    """Mixin (before a RopeBertModel subclass): BERT's sequence-classification head,
    classifier(tanh(pooler.dense(h[CLS]))), under HF's `pooler.*` / `classifier.*` names;
    shared by GTE's and Nomic BERT's `*ForSequenceClassification`."""

    def __init__(self, config) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(h, h)
        self.classifier = nn.Linear(h, int(config.num_labels))

    def skip_weight(self, name: str) -> bool:
        return super().skip_weight(name) and not name.startswith(("pooler.", "classifier."))

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, labels]
        return self.classifier(torch.tanh(self.pooler.dense(cls_rows)))


class GteForSequenceClassification(BertClassifierHead, GteModel):
    """GTE with BERT's head (gte-multilingual-reranker-base)."""


def new_config(raw: dict[str, Any]) -> PretrainedConfig:
    """The Hub's remote `NewConfig` (Alibaba-NLP/new-impl) as transformers' GteConfig; the
    variants the remote code has and this stack does not are refused by field name."""
    expected = {
        "position_embedding_type": "rope",
        "layer_norm_type": "layer_norm",
        "pack_qkv": True,
        "logn_attention_scale": False,
        "logn_attention_clip1": False,
    }
    for name, want in expected.items():
        if raw.get(name, want) != want:
            raise ValueError(
                f"config.json field {name!r}={raw[name]!r} is not supported for GTE ({want!r})"
            )
    hidden, heads = field(raw, "hidden_size", int), field(raw, "num_attention_heads", int)
    head_dim = hidden // heads
    base = field(raw, "rope_theta", float, 10000.0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else None
        if kind != "ntk" or scaling.get("mixed_b") is not None:
            raise ValueError(
                f"config.json field 'rope_scaling'={scaling!r} is not supported for GTE "
                "(the fixed NTK scaling, {'type': 'ntk', 'factor': s}, only)"
            )
        s = field(scaling, "factor", float)
        rope = {"rope_type": "linear", "rope_theta": base * s, "factor": s ** (2 / head_dim)}
    types = raw.get("type_vocab_size", 0) or 0
    if not isinstance(types, int) or types < 0:
        raise ValueError(f"config.json field 'type_vocab_size' must be >= 0, got {types!r}")
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        "num_hidden_layers": field(raw, "num_hidden_layers", int),
        "num_attention_heads": heads,
        "intermediate_size": field(raw, "intermediate_size", int),
        "hidden_act": field(raw, "hidden_act", str, "gelu"),
        "max_position_embeddings": field(raw, "max_position_embeddings", int, 8192),
        "type_vocab_size": types,
        "layer_norm_eps": field(raw, "layer_norm_eps", float, 1e-12),
        "rope_parameters": rope,
    }
    for name in ("num_labels", "id2label", "label2id", "problem_type"):
        if raw.get(name) is not None:
            fields[name] = raw[name]
    if "id2label" in fields:
        fields["id2label"] = {int(k): v for k, v in fields["id2label"].items()}
    return GteConfig(**fields)


GTE: dict[str, type[nn.Module]] = {
    "GteModel": GteModel,
    "GteNewModel": GteModel,
    "NewModel": GteModel,
    "GteForSequenceClassification": GteForSequenceClassification,
    "GteNewForSequenceClassification": GteForSequenceClassification,
    "NewForSequenceClassification": GteForSequenceClassification,
}
