"""Gemma 4's assistant drafter (`Gemma4AssistantForCausalLM`, transformers' gemma4_assistant),
run by spec_decode/gemma4_assistant.py for speculative_config={"method": "gemma4_assistant"}.

A small Gemma 4 decoder (models/gemma4.py's layers) in which every layer is KV-shared: it has
queries and no keys or values of its own and cross-attends over the TARGET's cache, each layer
over the target's last layer of its type that computes KV (transformers' `shared_kv_states`,
the "store" layers). Each piece as transformers runs it:

    input      [the target's scaled embedding of token c, a feature of position c - 1] ->
               `pre_projection` (2 * backbone_hidden_size -> hidden_size); the feature is the
               target's final normed hidden state, at later passes `post_projection` of the
               assistant's own last normed state
    position   every pass queries at the position c of the row's own token (q RoPE at c); the
               attention sees the target's keys before c: full layers all of [0, c), sliding
               ones the last `sliding_window` + 1 of them (transformers' flipped bidirectional
               window is inclusive: |i - j| <= W)
    output     logits from the final norm's output through `lm_head` (tied to the assistant's
               own `embed_tokens`), no soft-cap; with `use_ordered_embeddings` a masked
               centroid embedder instead: the top `centroid_intermediate_top_k` of
               `num_centroids` centroid logits pick vocab_size / num_centroids tokens each
               (`token_ordering`), those get their lm_head logits and every other token the
               least of them minus 1 (transformers takes that minimum over the whole batch,
               here per row: the same for one sequence, and a row's logits never depend on
               its neighbours)

Refused by name (ValueError): text_config with `hidden_size_per_layer_input`,
`vocab_size_per_layer_input`, `enable_moe_block` or `use_double_wide_mlp` (transformers
refuses them too), a vocab_size not divisible by `num_centroids`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.gemma4 import Gemma4Attention, Gemma4Layer, _rope, layer_geometry
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import FeatureHead, cfg_get, load_named_weights

LAYER_TYPES = ("sliding_attention", "full_attention")


def assistant_text_config(config):
    """The assistant's decoder config, checked (see the module docstring)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config.text_config
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if int(cfg_get(text, key, 0) or 0):
            raise ValueError(
                f"Gemma 4 assistant: text_config.{key} must be 0 (no per-layer inputs)"
            )
    for key in ("enable_moe_block", "use_double_wide_mlp"):
        if bool(getattr(text, key, False)):
            raise ValueError(f"Gemma 4 assistant: text_config.{key} must be false")
    return text


class CentroidEmbedder(nn.Module):
    """transformers' masked embedder: logits of the tokens of the top-k centroids only."""

    def __init__(self, config, hidden: int, vocab: int) -> None:
        super().__init__()
        self.num_centroids = int(config.num_centroids)
        self.top_k = int(config.centroid_intermediate_top_k)
        if vocab % self.num_centroids:
            raise ValueError(
                f"Gemma 4 assistant: vocab_size {vocab} is not divisible by num_centroids "
                f"{self.num_centroids}"
            )
        self.vocab = vocab
        self.centroids = nn.Linear(hidden, self.num_centroids, bias=False)
        # token ids of centroid i: token_ordering[i * (V / C) : (i + 1) * (V / C)]
        self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.int64))

    def forward(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        top = torch.topk(self.centroids(h), self.top_k, dim=-1).indices  # [N, k]
        ids = self.token_ordering.view(self.num_centroids, -1)[top].flatten(1)  # [N, k * V / C]
        picked = torch.einsum("nd,nkd->nk", h, lm_head[ids])
        floor = picked.min(dim=-1, keepdim=True).values - 1.0
        out = floor.expand(-1, self.vocab).clone()
        return out.scatter_(1, ids, picked).float()


class Gemma4AssistantForCausalLM(FeatureHead):
    """`forward(ids, positions, kv_caches, md, feature)` -> (normed, next feature) [T, D] and
    [T, backbone]; kv_caches: the target's caches of its last sliding and full KV layers, in
    `LAYER_TYPES` order. `embed` (the target's scaled embedding) and `kv_sources` (the target's
    `Attention` of those layers, whose fp8 scales the reads use) are set by the loader."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text = assistant_text_config(config)
        d, eps = text.hidden_size, float(cfg_get(text, "rms_norm_eps", 1e-6))
        backbone = int(config.backbone_hidden_size)
        self.types = gemma_layer_types(text, 6)
        window = cfg_get(text, "sliding_window", None)
        ropes: dict[tuple[str, int], RotaryEmbedding] = {}
        layers = []
        for kind, (head_dim, kv_heads) in zip(self.types, layer_geometry(text)):
            if (kind, head_dim) not in ropes:
                ropes[(kind, head_dim)] = _rope(text, kind, head_dim)
            sliding = kind == "sliding_attention" and window is not None
            attn = Gemma4Attention(
                text,
                head_dim,
                kv_heads,
                ropes[(kind, head_dim)],
                int(window) + 1 if sliding else None,
                kv_shared=True,
            )
            layers.append(Gemma4Layer(text, attn, double_mlp=False))
        self.layers = nn.ModuleList(layers)
        self.ropes = nn.ModuleList(ropes.values())
        self.norm = Olmo2RMSNorm(d, eps)
        self.pre_projection = nn.Linear(2 * backbone, d, bias=False)
        self.post_projection = nn.Linear(d, backbone, bias=False)
        self.vocab_size = int(text.vocab_size)
        self.lm_head = nn.Linear(d, self.vocab_size, bias=False)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        self.masked_embedding = None
        if getattr(config, "use_ordered_embeddings", False):
            self.masked_embedding = CentroidEmbedder(config, d, self.vocab_size)
        self.__dict__["embed"] = None  # Callable[[Tensor], Tensor]: not a submodule of ours

    def attach_target(self, embed: Callable[[torch.Tensor], torch.Tensor], sources) -> None:
        """Read the target's embedding and, per layer type, the cache of `sources[type]`
        (an `Attention`); ValueError where a layer's KV geometry differs from its source's."""
        self.__dict__["embed"] = embed
        for i, (kind, layer) in enumerate(zip(self.types, self.layers)):
            source: Attention = sources[kind]
            try:
                layer.self_attn.attn.set_kv_source(source)
            except ValueError:
                mine = layer.self_attn.attn
                raise ValueError(
                    f"Gemma 4 assistant layer {i} ({kind}) reads {mine.num_kv_heads} KV heads "
                    f"of size {mine.head_dim}; the target's have {source.num_kv_heads} of "
                    f"{source.head_dim}"
                ) from None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]: the rows' own token positions c
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,  # one query a row, seeing the target's keys [0, c)
        feature: torch.Tensor,  # [T, backbone]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed is not None
        embeds = self.embed(input_ids).to(feature.dtype)
        x = self.pre_projection(torch.cat([embeds, feature], dim=-1))
        for kind, layer in zip(self.types, self.layers):
            x = layer(positions, x, kv_caches[LAYER_TYPES.index(kind)], md, None)
        h = self.norm(x)
        return h, self.post_projection(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        if self.masked_embedding is not None:
            return self.masked_embedding(hidden, self.lm_head.weight)
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers' names: `model.*` (the decoder; its `embed_tokens` is the tied LM
        head), `lm_head`, `pre_projection`, `post_projection`, `masked_embedding.*`."""

        def rename(name: str) -> str:
            name = name.removeprefix("model.")
            if name == "embed_tokens.weight":
                return "lm_head.weight" if self.tied else name
            return name.replace(".self_attn.q_proj.", ".self_attn.q_heads.")

        def skip(name: str) -> bool:
            return name.endswith("inv_freq") or name == "embed_tokens.weight"

        ordering: list[torch.Tensor] = []

        def params_only() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if name == "masked_embedding.token_ordering":  # a buffer
                    ordering.append(w)
                else:
                    yield name, w

        loaded = load_named_weights(
            self,
            params_only(),
            stacked=((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)),
            rename=rename,
            skip=skip,
            strict=False,
        )
        missing = sorted(n for n, _ in self.named_parameters() if n not in loaded)
        if self.masked_embedding is not None:
            if not ordering:
                missing.append("masked_embedding.token_ordering")
            else:
                self.masked_embedding.token_ordering.copy_(ordering[0].long())
        if missing:
            raise ValueError(f"speculative_config.model: the assistant checkpoint lacks {missing}")
        return loaded
