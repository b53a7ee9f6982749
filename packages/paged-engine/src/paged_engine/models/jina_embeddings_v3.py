"""jina-embeddings-v3 (transformers' `JinaEmbeddingsV3Model` /
`JinaEmbeddingsV3ForSequenceClassification`; the Hub release is an `XLMRobertaModel` whose
config says `position_embedding_type="rotary"`, run by remote code, vLLM's `JinaRobertaModel`).
XLM-RoBERTa's post-norm layer on GTE's rotary stack (models/gte.py: `RopeBertModel`) with
biases everywhere and an ungated MLP:

    h = LN(word[ids] + token_type[0])
    per layer: h = norm1(h + out_proj attn(rope(q), rope(k), v))        [q | k | v] = Wqkv h
               h = norm2(h + fc2(gelu(fc1 h)))

Checkpoint names are the release's (`emb_ln`, `encoder.layers.N.mixer.Wqkv`, `mlp.fc1`...), which
transformers' `save_pretrained` writes too, under `roberta.` in a task model and in the release.

The release keeps task LoRA adapters beside each linear and embedding weight
(`<module>.parametrizations.weight.original`, `.0.lora_A`, `.0.lora_B`, one adapter per
`lora_adaptations` entry). As vLLM, one adapter is merged at load, `text-matching` unless
`hf_overrides={"lora_task": ...}` names another: W + (lora_alpha / lora_rank) * B[t] @ A[t]
for a linear weight, W + scale * A[t] @ B[t] for an embedding table (the release stores
those factors the other way round). A checkpoint without adapters loads as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import JinaEmbeddingsV3Config, PretrainedConfig

from paged_engine.models.bert import RobertaClassificationHead
from paged_engine.models.gte import RopeBertModel
from paged_engine.models.remote_aliases import common_fields, field

_RENAMES = (
    ("emb_ln.", "embeddings.LayerNorm."),
    ("encoder.layers.", "encoder.layer."),
    (".mixer.Wqkv.", ".attention.qkv_proj."),
    (".mixer.out_proj.", ".attention.o_proj."),
    (".norm1.", ".attn_ln."),
    (".norm2.", ".mlp_ln."),
    (".mlp.fc1.", ".mlp.up_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
)
_LORA = ".parametrizations.weight."
DEFAULT_TASK = "text-matching"


class JinaEmbeddingsV3Model(RopeBertModel):
    """jina-embeddings-v3's encoder: embeddings pooled from its final hidden states."""

    prefix = "roberta"
    prefixes = ("roberta.",)
    gated = False

    def rename_weight(self, name: str) -> str:
        name = super().rename_weight(name)
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name

    def task_index(self) -> tuple[int, float]:
        """The merged adapter's index in `lora_adaptations` and its scale alpha / rank."""
        tasks = list(getattr(self.config, "lora_adaptations", None) or [])
        task = getattr(self.config, "lora_task", None) or DEFAULT_TASK
        if task not in tasks:
            raise ValueError(f"lora_task={task!r} is not one of lora_adaptations {tasks}")
        rank = float(getattr(self.config, "lora_rank", 4))
        return tasks.index(task), float(getattr(self.config, "lora_alpha", 1)) / rank

    def merge_lora(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parametrized weight with the chosen task's adapter merged in, named plainly."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in weights:
            if _LORA not in name:
                yield name, w
                continue
            base, part = name.split(_LORA)
            parts = pending.setdefault(base, {})
            parts[part] = w
            if {"original", "0.lora_A", "0.lora_B"} <= parts.keys():
                del pending[base]
                t, scale = self.task_index()
                a, b = parts["0.lora_A"][t].float(), parts["0.lora_B"][t].float()
                delta = a @ b if "embeddings" in base else b @ a  # [out, in] / [vocab, dim]
                w0 = parts["original"]
                yield f"{base}.weight", (w0.float() + scale * delta).to(w0.dtype)
        if pending:
            base, parts = next(iter(pending.items()))
            raise ValueError(f"checkpoint: {base}{_LORA}* lacks {sorted(parts)} 's siblings")

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return super().load_weights(self.merge_lora(weights), strict=strict)


class JinaEmbeddingsV3ForSequenceClassification(JinaEmbeddingsV3Model):
    """With RoBERTa's head: out_proj(tanh(dense(h[CLS])))."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config)  # dense, out_proj: HF's names

    def skip_weight(self, name: str) -> bool:
        return super().skip_weight(name) and not name.startswith("classifier.")

    def rename_weight(self, name: str) -> str:
        return name if name.startswith("classifier.") else super().rename_weight(name)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, labels]
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_rows)))


def jina_config(raw: dict[str, Any]) -> PretrainedConfig | None:
    """The release's XLM-RoBERTa config.json with rotary positions as transformers'
    JinaEmbeddingsV3Config (architecture JinaEmbeddingsV3Model, its adapters' fields kept);
    None for any other XLM-RoBERTa (models/bert.py's absolute positions)."""
    if raw.get("position_embedding_type") != "rotary":
        return None
    if raw.get("rotary_emb_interleaved"):
        raise ValueError("config.json field 'rotary_emb_interleaved'=True is not supported")
    hidden, heads = field(raw, "hidden_size", int), field(raw, "num_attention_heads", int)
    if raw.get("rotary_emb_dim") not in (None, hidden // heads):
        raise ValueError(
            f"config.json field 'rotary_emb_dim'={raw['rotary_emb_dim']!r} is not supported "
            f"(the whole head, {hidden // heads})"
        )
    fields = {
        **common_fields(raw),
        "architectures": ["JinaEmbeddingsV3Model"],
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        "num_hidden_layers": field(raw, "num_hidden_layers", int),
        "num_attention_heads": heads,
        "intermediate_size": field(raw, "intermediate_size", int),
        "hidden_act": field(raw, "hidden_act", str, "gelu"),
        "max_position_embeddings": field(raw, "max_position_embeddings", int, 8194),
        "type_vocab_size": field(raw, "type_vocab_size", int, 1),
        "layer_norm_eps": field(raw, "layer_norm_eps", float, 1e-5),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": field(raw, "rotary_emb_base", float, 10000.0),
        },
    }
    config = JinaEmbeddingsV3Config(**fields)
    keep = ("lora_adaptations", "lora_rank", "lora_alpha", "lora_task", "matryoshka_dimensions")
    for name in keep:
        if raw.get(name) is not None:
            setattr(config, name, raw[name])
    return config


JINA_EMBEDDINGS_V3: dict[str, type[nn.Module]] = {
    "JinaEmbeddingsV3Model": JinaEmbeddingsV3Model,
    "JinaEmbeddingsV3ForSequenceClassification": JinaEmbeddingsV3ForSequenceClassification,
}
