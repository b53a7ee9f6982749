"""EmbeddingGemma 2 (google/embeddinggemma-2; transformers' `EmbeddingGemma2Model` /
`EmbeddingGemma2TextModel`, vLLM's `EmbeddingGemma2Model`): a Gemma 4 text stack run as an
encoder, its token outputs projected to `embedding_dim`; text, images and audio.

The release's config.json names `EmbeddingGemma2Model` (model_type "embedding_gemma2"): a text
model in `text_config` ("embedding_gemma2_text") with Gemma 4's vision and audio towers beside
it. models/text_wrappers.py serves it through its text model (this file's class, weights under
`language_model.`); a checkpoint of the text model alone (`EmbeddingGemma2TextModel`, no
prefix) loads too. Images and audio take Gemma 4's paths (multimodal/archs.py and
audio_archs.py "gemma4": its towers, `embed_vision` / `embed_audio`, the processor's
<|image> <|image|> x N <image|> and <|audio> <|audio|> x n <audio|> runs), their rows handed to
`forward` as `hidden`, as transformers merges them into `inputs_embeds`. Video (vLLM serves it
too) is refused by name: EmbeddingGemma 2's video processor samples and formats frames
otherwise than Gemma 4's, and transformers' needs torchvision to be checked against.

The layers are Gemma 4's (models/gemma4.py `Gemma4Layer` / `Gemma4Attention`: weight-only RMS
norms, q / k norms, a weightless v norm, attention scale 1, wider full layers from
`per_layer_config`, a tanh-GELU gated MLP, each layer's output times its `layer_scalar`),
with these differences, each as transformers runs it:

    attention  bidirectional in every layer (`BidirectionalAttention`, models/gemma3_encoder.py;
               no KV cache: engine/encoder.py runs each sequence whole in one step); a sliding
               layer sees |i - j| <= sliding_window (an inclusive radius, unlike the causal
               Gemmas' exclusive bound; vLLM hands its encoder attention sliding_window + 1)
    rope       "default" for both layer types (theta per type, over the layer's head size)
    PLE        projection-only: the per-layer inputs [T, L, P] are RMSNorm_P(proj(embeds) *
               hidden^-0.5) of the input rows (media rows included), no token table, no
               1 / sqrt(2) blend; each layer's block is Gemma 4's (HF: `ple_block.`, renamed)
    output     after the final norm, `embedding_projection` [hidden -> embedding_dim] per token

Pooling, when the model directory has no sentence-transformers files: the mean of the tokens,
normalized (vLLM's default for `EmbeddingGemma2Model`; projecting each token then averaging is
projecting the average). Config values outside this are refused with a ValueError naming the
field (`check_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.rotary import RotaryEmbedding, plain_rope, rope_config
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.gemma3_encoder import BidirectionalAttention, NoCacheEncoder
from paged_engine.models.gemma4 import Gemma4Attention, Gemma4Layer, layer_geometry
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.sequence_classifier import ZeroLogits
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get

ARCH = "EmbeddingGemma2TextModel"


def check_config(config) -> None:
    """Refuse (ValueError naming the field) what the encoder below does not compute as HF."""
    window = getattr(config, "sliding_window", None)
    types = gemma_layer_types(config, 6)
    if "sliding_attention" in types and (not isinstance(window, int) or window < 0):
        raise ValueError(
            f"{ARCH}: text_config.sliding_window={window!r} must be an integer radius >= 0"
        )
    if int(cfg_get(config, "hidden_size_per_layer_input", 0)) < 1:
        raise ValueError(f"{ARCH}: text_config.hidden_size_per_layer_input must be >= 1")
    for kind in sorted(set(types)):
        _, scaling, partial = rope_config(config, kind)
        rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if rope_type != "default" or partial != 1.0:
            raise ValueError(
                f"{ARCH}: text_config.rope_parameters[{kind!r}] rope_type={rope_type!r} "
                f"(partial_rotary_factor={partial}) is not supported: only 'default'"
            )


class EmbeddingGemma2Stack(nn.Module):
    """Scaled token embedding, projection-only PLE, Gemma 4 layers attending both ways, final
    norm and `embedding_projection`."""

    def __init__(self, config) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-6))
        n, p = config.num_hidden_layers, int(config.hidden_size_per_layer_input)
        types, geometry = gemma_layer_types(config, 6), layer_geometry(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        # HF multiplies by sqrt(d) rounded to the weights' dtype (bf16: sqrt(512) -> 22.625)
        self.register_buffer("embed_scale", torch.tensor(d**0.5), persistent=False)
        ropes: dict[tuple[str, int], RotaryEmbedding] = {}
        layers = []
        for kind, (head_dim, kv_heads) in zip(types, geometry, strict=True):
            if (kind, head_dim) not in ropes:
                theta = rope_config(config, kind)[0]
                ropes[kind, head_dim] = plain_rope(
                    head_dim,
                    head_dim,
                    int(config.max_position_embeddings),
                    theta,
                    is_neox_style=True,
                )
            # the causal Attention's window is an exclusive bound: radius + 1
            window = int(config.sliding_window) + 1 if kind == "sliding_attention" else None
            attn = Gemma4Attention(
                config, head_dim, kv_heads, ropes[kind, head_dim], window, kv_shared=False
            )
            attn.attn = BidirectionalAttention(attn.attn)
            layers.append(Gemma4Layer(config, attn, double_mlp=False))
        self.layers = nn.ModuleList(layers)
        self.ropes = nn.ModuleList(ropes.values())  # registered once; the layers share them
        self.ple_dim = p
        self.ple = nn.Module()  # HF's `ple.` names
        self.ple.per_layer_model_projection = nn.Linear(d, n * p, bias=False)
        self.ple.per_layer_projection_norm = Olmo2RMSNorm(p, eps)
        self.norm = Olmo2RMSNorm(d, eps)
        self.embedding_projection = nn.Linear(d, int(config.embedding_dim), bias=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        """The scaled token embedding (media rows replace some of it: worker/image_embeds.py)."""
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the scaled embedding with media rows in (worker/), else computed here
        x = self.embed_input_ids(input_ids) if hidden is None else hidden  # [T, D]
        # per-layer inputs [T, L, P] projected from the input rows alone (no token table)
        ple = self.ple.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        ple = self.ple.per_layer_projection_norm(ple.view(x.shape[0], -1, self.ple_dim))
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None, md, ple[:, i])
        return self.embedding_projection(self.norm(x))  # [T, embedding_dim]


class EmbeddingGemma2TextModel(NoCacheEncoder, CausalLMBase):
    """The encoder: pooling only, no KV cache, no LM head (`ZeroLogits`)."""

    pooling_only = "a base model without an LM head"
    default_pooler_config: ClassVar[dict] = {"pooling_type": "MEAN", "normalize": True}
    stacked_params = (
        *QKV_PROJ_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_config(config)
        super().__init__(config, EmbeddingGemma2Stack(config))
        self.lm_head = ZeroLogits(config.vocab_size)
        self.tie_word_embeddings = False  # no head to tie

    @staticmethod
    def pooled_width(config) -> int:
        """The width of the rows pooled (engine/llm_engine.py): `embedding_dim`, not hidden."""
        return int(config.embedding_dim)

    def rename_weight(self, name: str) -> str:
        # the text model saved alone has no prefix; the wrapper's `language_model.` is
        # mapped to `model.` by models/multimodal_text.py
        name = name if name.startswith("model.") else "model." + name
        return name.replace(".ple_block.", ".")

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return super().load_weights(((n, w) for n, w in weights if n != "lm_head.weight"), strict)
