"""Gemma 3n text models (`Gemma3nForCausalLM`, and the language model of
`Gemma3nForConditionalGeneration`, models/multimodal_text.py): E2B and E4B.

Gemma 4's attention (models/gemma4.py: q / k norms scaled by `weight`, values normed without
one, attention scale 1, per-type ropes, the last `num_kv_shared_layers` layers reading an
earlier layer's KV) and its per-layer inputs (PLE), inside a layer of another shape, each piece
as transformers runs it:

    AltUp      the residual stream is A = `altup_num_inputs` streams [A, T, D]. Before a layer,
               each stream is predicted from all of them: pred_j = x_j + sum_i c_ji x_i, the
               A x A coefficients a linear map of r = tanh(router(norm(x_a) / D)) (a the
               `altup_active_idx` stream). The layer runs on pred_a alone; its output y
               corrects every stream: x_j = pred_j + (y - pred_a) * (1 + k_j), k a linear map
               of r recomputed from y. Stream 0 enters as the scaled embedding, the others as
               its projections rescaled to its RMS; at the end they project back (stream 0
               as is, the others rescaled to stream 0's RMS), are averaged, and normed.
    Laurel     beside attention, x + norm(right(left(x))) of rank `laurel_rank`; the layer's
               attention output and it are summed as (x + norm(attn) + laurel) / sqrt(2)
    MLP        `intermediate_size` per layer; where `activation_sparsity_pattern` gives p > 0,
               the gate keeps what exceeds mean + std * Phi^-1(p) over its row (relu(g - cut),
               a statistical top-(1 - p)) before the tanh-GELU
    PLE        after the MLP, the corrected active stream (times `correct_output_scale` with
               `altup_correct_scale`) goes through gate -> GELU -> x input_l -> projection ->
               norm, and is added to streams 1.. (not 0); per-layer token ids past
               `vocab_size_per_layer_input` (the media tokens) read row 0
    tokens     the wrapper embeds its vision and audio token ids (ids from a tower's
               `vocab_offset`) with that tower's embedder (row -> norm -> projection -> unit
               norm), not the text table: kept here when multimodal_text.py passes them on
               (`MEDIA_EMBEDDERS`); the towers themselves are not loaded

Not supported, refused by name: pipeline parallelism (the A streams and the KV-shared layers
stay on one stage).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.gemma4 import (
    Gemma4Attention,
    Gemma4ForCausalLM,
    _rope,
    kv_sources,
    layer_geometry,
)
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers

# Set by multimodal_text.py on a wrapper's text config: [(attribute, vocab_offset, vocab_size,
# hidden_size, rms_norm_eps)] of the towers' token embedders, in the wrapper's order.
MEDIA_EMBEDDERS = "gemma3n_media_embedders"
EVERY = 5  # without config.layer_types, every 5th layer is a full one


def _per_layer(config, name: str, default) -> list:
    """A config value given per layer or once for all layers, as a list per layer."""
    value = cfg_get(config, name, default)
    n = config.num_hidden_layers
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"config.{name} has {len(value)} entries for {n} layers")
        return list(value)
    return [value] * n


class Gemma3nMLP(nn.Module):
    """down(gelu_tanh(sparsify(gate(x))) * up(x)); `sparsity` p > 0 keeps the gate's values
    above mean + std * Phi^-1(p) over the whole (all TP ranks') row, shifted down by it."""

    def __init__(self, config, intermediate: int, sparsity: float) -> None:
        super().__init__()
        d = config.hidden_size
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"config.activation_sparsity_pattern: {sparsity} is not in [0, 1)")
        self.gate_up_proj = MergedColumnParallelLinear(d, [intermediate, intermediate], bias=False)
        self.down_proj = RowParallelLinear(intermediate, d, bias=False)
        self.act_fn = get_act_fn(cfg_get(config, "hidden_activation", "gelu_pytorch_tanh"))
        self.intermediate = intermediate
        self.tp_size = self.down_proj.tp_size
        # Phi^-1(p), as HF computes it (float32, then the activations' dtype)
        normal = torch.distributions.Normal(0.0, 1.0)
        self.std_multiplier = float(normal.icdf(torch.tensor(sparsity))) if sparsity else None

    def _sparsify(self, gate: torch.Tensor) -> torch.Tensor:  # [T, I / tp]
        assert self.std_multiplier is not None
        if self.tp_size == 1:
            mean = gate.mean(-1, keepdim=True)
            std = gate.std(-1, keepdim=True, unbiased=False)
        else:  # moments over the whole row: sums from every rank's slice
            sums = tp_all_reduce(torch.stack([gate.sum(-1), gate.square().sum(-1)], dim=-1))
            moments = sums / self.intermediate
            mean = moments[:, :1]
            std = (moments[:, 1:] - mean.square()).clamp_min(0).sqrt()
        multiplier = torch.tensor(self.std_multiplier, dtype=gate.dtype, device=gate.device)
        return torch.relu(gate - (mean + std * multiplier))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.std_multiplier is not None:
            gate = self._sparsify(gate)
        return self.down_proj(self.act_fn(gate) * up)


class Gemma3nAltUp(nn.Module):
    """AltUp's predict and correct steps over the streams [A, T, D] (see the module doc)."""

    def __init__(self, config) -> None:
        super().__init__()
        d, a = config.hidden_size, int(config.altup_num_inputs)
        self.streams, self.active = a, int(cfg_get(config, "altup_active_idx", 0))
        self.correct_output_scale = nn.Parameter(torch.zeros(d))
        self.correction_coefs = nn.Linear(a, a, bias=False)
        self.prediction_coefs = nn.Linear(a, a * a, bias=False)
        self.modality_router = nn.Linear(d, a, bias=False)
        self.router_norm = Olmo2RMSNorm(d, float(cfg_get(config, "rms_norm_eps", 1e-6)))
        self.router_scale = 1.0 / d

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, A]
        routed = self.modality_router(self.router_norm(x) * self.router_scale)
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:  # [A, T, D] -> [A, T, D]
        t, a = streams.shape[1], self.streams
        coefs = self.prediction_coefs(self._modalities(streams[self.active])).view(t, a, a)
        # pred[j] = x[j] + sum_i coefs[:, j, i] x[i]
        return streams + torch.einsum("tji,itd->jtd", coefs, streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """predictions [A, T, D] corrected by the layer's output `activated` [T, D]."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, A]
        innovation = activated - predictions[self.active]
        return predictions + coefs.t().unsqueeze(-1) * innovation


class Gemma3nLaurel(nn.Module):
    """x + norm(right(left(x))): a low-rank residual beside attention."""

    def __init__(self, config) -> None:
        super().__init__()
        d, rank = config.hidden_size, int(config.laurel_rank)
        self.linear_left = nn.Linear(d, rank, bias=False)
        self.linear_right = nn.Linear(rank, d, bias=False)
        self.post_laurel_norm = Olmo2RMSNorm(d, float(cfg_get(config, "rms_norm_eps", 1e-6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nLayer(nn.Module):
    def __init__(self, config, attn: Gemma4Attention, mlp: Gemma3nMLP) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-6))
        p = int(config.hidden_size_per_layer_input)
        self.self_attn, self.mlp = attn, mlp
        self.altup, self.laurel = Gemma3nAltUp(config), Gemma3nLaurel(config)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", Olmo2RMSNorm(d, eps))
        self.per_layer_input_gate = nn.Linear(d, p, bias=False)
        self.per_layer_projection = nn.Linear(p, d, bias=False)
        self.post_per_layer_input_norm = Olmo2RMSNorm(d, eps)
        self.act_fn = get_act_fn(cfg_get(config, "hidden_activation", "gelu_pytorch_tanh"))
        self.correct_scale = bool(cfg_get(config, "altup_correct_scale", True))

    def forward(self, positions, streams, kv_cache, md, ple_input) -> torch.Tensor:
        """streams [A, T, D], ple_input [T, P] -> streams [A, T, D]."""
        predictions = self.altup.predict(streams)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn = self.post_attention_layernorm(self.self_attn(positions, normed, kv_cache, md))
        x = (active + attn + laurel) / math.sqrt(2)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale.to(first.dtype)
        h = self.act_fn(self.per_layer_input_gate(first)) * ple_input
        h = self.post_per_layer_input_norm(self.per_layer_projection(h))
        return torch.cat([corrected[:1], corrected[1:] + h])


class Gemma3nMediaEmbedder(nn.Module):
    """A tower's token ids -> text embeddings: row (id - offset) -> RMSNorm -> projection to
    the text width -> unit RMSNorm (HF's Gemma3nMultimodalEmbedder on token ids)."""

    def __init__(self, offset: int, size: int, width: int, eps: float, text_width: int) -> None:
        super().__init__()
        self.offset, self.size = offset, size
        self.embedding = nn.Embedding(size, width)
        self.hard_embedding_norm = Olmo2RMSNorm(width, eps)
        self.embedding_projection = nn.Linear(width, text_width, bias=False)
        self.post_norm = UnitRMSNorm(eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D] (every row)
        # the tower's `size` rows embedded once (128 in the release), then looked up: cheaper
        # than projecting every token's row when a step holds more tokens than that
        table = self.post_norm(
            self.embedding_projection(self.hard_embedding_norm(self.embedding.weight))
        )
        return table[(input_ids - self.offset).clamp(0, self.size - 1)]


class Gemma3nModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-6))
        n, p = config.num_hidden_layers, int(config.hidden_size_per_layer_input)
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "Gemma 3n does not support pipeline parallelism (its AltUp streams and KV-shared "
                "layers stay on one stage)"
            )
        types = gemma_layer_types(config, EVERY)
        geometry = layer_geometry(config)
        self.sources = kv_sources(config, EVERY)
        sizes = _per_layer(config, "intermediate_size", None)
        sparsity = _per_layer(config, "activation_sparsity_pattern", 0.0)
        window = cfg_get(config, "sliding_window", None)
        ropes: dict[tuple[str, int], RotaryEmbedding] = {}

        def build(i: int) -> Gemma3nLayer:
            kind, (head_dim, kv_heads) = types[i], geometry[i]
            if (kind, head_dim) not in ropes:
                ropes[kind, head_dim] = _rope(config, kind, head_dim)
            attn = Gemma4Attention(
                config,
                head_dim,
                kv_heads,
                ropes[kind, head_dim],
                window if kind == "sliding_attention" else None,
                kv_shared=self.sources[i] != i,
            )
            return Gemma3nLayer(config, attn, Gemma3nMLP(config, int(sizes[i]), float(sparsity[i])))

        self.layers, self.stage = make_layers(n, build)
        self.ropes = nn.ModuleList(ropes.values())  # registered once; the layers share them
        for i, source in enumerate(self.sources):
            if source != i:
                self.layers[i].self_attn.attn.set_kv_source(self.layers[source].self_attn.attn)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        # HF multiplies by the scale rounded to the weights' dtype (bf16: sqrt(2048) -> 45.25)
        self.register_buffer("embed_scale", torch.tensor(d**0.5), persistent=False)
        self.streams = int(config.altup_num_inputs)
        self.altup_projections = nn.ModuleList(
            nn.Linear(d, d, bias=False) for _ in range(self.streams - 1)
        )
        self.altup_unembed_projections = nn.ModuleList(
            nn.Linear(d, d, bias=False) for _ in range(self.streams - 1)
        )
        self.ple_dim, self.ple_vocab = p, int(config.vocab_size_per_layer_input)
        self.embed_tokens_per_layer = VocabParallelEmbedding(self.ple_vocab, n * p)
        # HF's scales as buffers, rounded to the weights' dtype as its are
        self.register_buffer("ple_embed_scale", torch.tensor(p**0.5), persistent=False)
        self.register_buffer("ple_projection_scale", torch.tensor(d**-0.5), persistent=False)
        self.register_buffer("ple_input_scale", torch.rsqrt(torch.tensor(2.0)), persistent=False)
        self.per_layer_model_projection = nn.Linear(d, n * p, bias=False)
        self.per_layer_projection_norm = Olmo2RMSNorm(p, eps)
        self.media: list[str] = []  # the embedders' attribute names, in the wrapper's order
        for name, offset, size, width, media_eps in getattr(config, MEDIA_EMBEDDERS, None) or ():
            setattr(self, name, Gemma3nMediaEmbedder(offset, size, width, media_eps, d))
            self.media.append(name)
        self.norm = Olmo2RMSNorm(d, eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        """The scaled token embedding, media token ids through their tower's embedder (HF's
        input embedding: prompt_embeds rows go after it)."""
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        # HF's order: each embedder takes the ids from its offset on (audio's after vision's)
        for name in self.media:
            embedder = getattr(self, name)
            x = torch.where((input_ids >= embedder.offset).unsqueeze(-1), embedder(input_ids), x)
        return x

    def _ple_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: the token's per-layer embedding and the projected embedding x."""
        t, p = x.shape[0], self.ple_dim
        ids = torch.where(input_ids < self.ple_vocab, input_ids, 0)  # media ids: row 0
        tok = self.embed_tokens_per_layer(ids)
        tok = (tok * self.ple_embed_scale.to(tok.dtype)).view(t, -1, p)
        proj = self.per_layer_model_projection(x) * self.ple_projection_scale.to(x.dtype)
        proj = self.per_layer_projection_norm(proj.view(t, -1, p))
        return (proj + tok) * self.ple_input_scale.to(x.dtype)

    @staticmethod
    def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """x with each row's RMS set to `target` [T, 1] (HF clamps the mean square at 1e-5)."""
        return x * target / x.square().mean(-1, keepdim=True).clamp_min(1e-5).sqrt()

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the embedded tokens with prompt_embeds / image rows put in (one stage only)
        x = self.embed_input_ids(input_ids) if hidden is None else hidden
        ple = self._ple_inputs(input_ids, x)
        target = x.square().mean(-1, keepdim=True).sqrt()
        streams = torch.stack(
            [x, *(self._rescaled(proj(x), target) for proj in self.altup_projections)]
        )
        for i, layer in enumerate(self.layers):
            streams = layer(positions, streams, kv_caches[self.sources[i]], md, ple[:, i])
        target = streams[0].square().mean(-1, keepdim=True).sqrt()
        unembedded = [
            self._rescaled(proj(streams[j + 1]), target)
            for j, proj in enumerate(self.altup_unembed_projections)
        ]
        return self.norm(torch.stack([streams[0], *unembedded]).mean(0))


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 4's shell (KV-shared layers' weights, cache layout, soft-capped logits) over the
    Gemma 3n decoder."""

    global_every = EVERY
    # the soft-token path of the towers' embedders (images, audio), not loaded
    ignored_weights = (*Gemma4ForCausalLM.ignored_weights, "soft_embedding_norm.weight")

    def __init__(self, config) -> None:
        CausalLMBase.__init__(self, config, Gemma3nModel(config))
        self.final_soft_cap = cfg_get(config, "final_logit_softcapping", None)
        self.values_from_keys: set[int] = set()  # every layer has its own value projection
