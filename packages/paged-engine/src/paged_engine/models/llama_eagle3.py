"""EAGLE-3 draft heads for speculative decoding (speculative_config={"method": "eagle3", ...}).

An EAGLE-3 head is one Llama decoder layer that drafts from the target's features instead of
its own stack. At position p it reads the embedding of token p + 1 and a feature of width D:

- pass 1 (from the target): fc(cat(a_1, a_2, a_3)), the target's residual stream entering
  three of its layers at position p (`aux_layer_ids`, vLLM's numbering: id j is the stream
  before layer j, the output of layer j - 1), each [D_target];
- later passes (its own drafts): the head's own pre-norm output at the position before.

The layer: q/k/v read cat(input_layernorm(embedding), hidden_norm(feature)) [2D]; the residual
stream starts at the feature (normed first with `norm_before_residual`); post-attention norm
and a gated MLP as in Llama; `norm` gives the logits' input, the sum before it is the next
feature. Its LM head covers `draft_vocab_size` tokens; draft id i is target id i + d2t[i].

Checkpoints: the EAGLE authors' layout (architectures LlamaForCausalLMEagle3, or vLLM's
Eagle3Qwen2_5vlForCausalLM / Eagle3Qwen3vlForCausalLM for Qwen-VL targets; weights
`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, maybe `embed_tokens`; `t2d` unused). Without an
`embed_tokens` of its own the head shares the target's token embedding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, QKVParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    add_norm,
    llama_head_dim,
)
from paged_engine.models.utils import FeatureHead, cfg_get

# vLLM's registry maps the Qwen-VL names onto the same Llama head (its llama_eagle3.py): heads
# trained for Qwen2.5-VL / Qwen3-VL targets, whose rope config carries `mrope_section` and
# which then turn by the target's M-RoPE positions (spec_decode/mrope_positions.py).
EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
)
# Names of the weights; the head's layer is `layers.0` whatever the checkpoint calls it.
_RENAMES = (("midlayer.", "layers.0."),)


def is_eagle3_config(hf_config) -> bool:
    archs = getattr(hf_config, "architectures", None) or []
    return any(a in EAGLE3_ARCHITECTURES for a in archs)


def reads_aux_streams(hf_config) -> bool:
    """False for a head configured to read the target's last hidden state alone
    (eagle_config.use_aux_hidden_state false), which paged does not run."""
    eagle = cfg_get(hf_config, "eagle_config", None)
    return not isinstance(eagle, dict) or bool(eagle.get("use_aux_hidden_state", True))


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default choice of the target layers whose input streams the head reads."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def aux_layer_ids(hf_config, num_target_layers: int) -> tuple[int, ...]:
    """The checkpoint's `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`),
    else the default; ValueError when an id is not in [1, num_target_layers)."""
    eagle = cfg_get(hf_config, "eagle_config", None) or {}
    ids = cfg_get(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None and isinstance(eagle, dict):
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = default_aux_layer_ids(num_target_layers)
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 1 <= i < num_target_layers]
    if bad or len(ids) != 3:
        raise ValueError(
            f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(ids)} must be "
            f"three layer ids in [1, {num_target_layers}) of a target with {num_target_layers} "
            "layers"
        )
    return ids


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config, rope) -> None:
        super().__init__()
        flags = LlamaForCausalLM.layer_flags(config)
        hidden, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, 0, flags, rope)
        heads = config.num_attention_heads
        kv_heads = cfg_get(config, "num_key_value_heads", heads)
        # q/k/v read the embedding and the feature side by side
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden, llama_head_dim(config), heads, kv_heads, bias=flags["qkv_bias"]
        )
        self.mlp = LlamaMLP(config, flags["mlp_bias"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.norm_before_residual = bool(cfg_get(config, "norm_before_residual", False))

    def forward(
        self, positions, embeds, feature, kv_cache, md
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, the stream before it): their sum is the layer's output."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = self.self_attn(positions, x, kv_cache, md)
        y, residual = add_norm(self.post_attention_layernorm, h, residual)
        return self.mlp(y), residual


class Eagle3LlamaForCausalLM(FeatureHead):
    """The head. `forward` returns (normed, pre-norm) hidden states [T, D]: the logits' input
    and the next pass's feature."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.vocab_size = int(config.vocab_size)
        self.draft_vocab_size = int(cfg_get(config, "draft_vocab_size", None) or config.vocab_size)
        self.target_hidden_size = int(cfg_get(config, "target_hidden_size", None) or hidden)
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, hidden)
        self.fc = ColumnParallelLinear(
            3 * self.target_hidden_size, hidden, bias=False, tp_rank=0, tp_size=1
        )
        self.rotary_emb = get_rope(config, llama_head_dim(config), is_neox_style=True)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, self.rotary_emb)])
        self.norm = RMSNorm(hidden, cfg_get(config, "rms_norm_eps", 1e-6))
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)  # vocab-parallel
        # target id of draft id i = i + d2t[i]; zeros (identity) until a checkpoint's d2t loads
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.shares_target_embedding = False  # set by the loader

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's features [T, 3 * D_target] -> the first pass's feature [T, D]."""
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary_emb.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        h, residual = self.layers[0](positions, embeds, feature, kv_caches[0], md)
        normed, prenorm = add_norm(self.norm, h, residual)
        return normed, prenorm

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, V] float32 over the target's vocabulary: the head's tokens at their
        target ids, every other token at -1e30 (never drawn; finite, so a row whose every head
        token is masked still softmaxes)."""
        small = self.lm_head(normed).float()
        if self.draft_vocab_size == self.vocab_size and not self._offsets:
            return small
        out = small.new_full((small.shape[0], self.vocab_size), -1e30)
        return out.index_copy_(1, self._targets, small)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load an EAGLE-3 checkpoint; ValueError naming what is missing or unexpected."""
        rest: list[tuple[str, torch.Tensor]] = []
        has_d2t = False
        for name, w in weights:
            name = name.removeprefix("model.")
            if name == "t2d":
                continue
            if name == "d2t":
                if tuple(w.shape) != (self.draft_vocab_size,):
                    raise ValueError(
                        f"speculative_config.model: d2t has shape {tuple(w.shape)}, expected "
                        f"({self.draft_vocab_size},) (draft_vocab_size)"
                    )
                self.d2t.copy_(w.to(torch.long))
                has_d2t = True
                continue
            for theirs, ours in _RENAMES:
                name = name.replace(theirs, ours)
            rest.append((name, w))
        loaded = self.load_own_weights(
            rest,
            "speculative_config.model: the EAGLE-3 checkpoint",
            stacked=LlamaForCausalLM.stacked_params,  # q/k/v -> qkv, gate/up -> gate_up
            optional=frozenset({"embed_tokens.weight"}),
        )
        self.shares_target_embedding = "embed_tokens.weight" not in loaded
        if not has_d2t and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                f"speculative_config.model: draft_vocab_size {self.draft_vocab_size} differs "
                f"from vocab_size {self.vocab_size} but the checkpoint has no d2t mapping"
            )
        self.finish_loading()
        return loaded | ({"d2t"} if has_d2t else set())

    def finish_loading(self) -> None:
        """Precompute the draft -> target id map (after d2t is final)."""
        self._targets = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        self._offsets = bool(self.d2t.any())
        if int(self._targets.max()) >= self.vocab_size or int(self._targets.min()) < 0:
            raise ValueError(
                "speculative_config.model: d2t maps draft ids outside the target's vocabulary "
                f"of {self.vocab_size}"
            )

    _targets: torch.Tensor
    _offsets: bool = False
