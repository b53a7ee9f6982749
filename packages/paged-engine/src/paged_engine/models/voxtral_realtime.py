"""Voxtral Realtime's decoder (VoxtralRealtimeTextModel): Mistral with each layer's MLP input
scaled by a delay conditioning, folded into the weights at load.

    HF, per layer:  y = post_attention_layernorm(x) * (1 + ada_rms_norm(t_cond))
                    ada_rms_norm(t) = linear2(gelu(linear1(t)))   (no biases, 32 wide)
                    t_cond = cat(cos(d * f), sin(d * f)), f_i = 10000^(-i / (D / 2)),
                    d = num_delay_tokens (config.default_num_delay_tokens: HF's fallback,
                    the value mistral_common's processor also passes for the released model)

t_cond does not depend on the tokens, so the scale is one [D] vector a layer:
post_attention_layernorm.weight * (1 + scale) is the same RMSNorm. The rest is
MistralForCausalLM (sliding window from text_config.sliding_window). vLLM computes t_cond every
forward and passes it down; the fold gives the same numbers with Mistral's layers untouched.
The audio added to the token embeddings comes from multimodal/voxtral_realtime.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from paged_engine.models.mistral import MistralForCausalLM

DELAY = "default_num_delay_tokens"  # carried from the wrapper's config (text_wrappers.py)
_ADA = ".ada_rms_norm."
_NORM = ".post_attention_layernorm.weight"


def time_embedding(delay: float, dim: int) -> torch.Tensor:
    """HF's VoxtralRealtimeTimeEmbedding of one time value: [dim] float32."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angle = delay * freq
    return torch.cat((angle.cos(), angle.sin()))


class VoxtralRealtimeTextForCausalLM(MistralForCausalLM):
    def __init__(self, config) -> None:
        if getattr(config, DELAY, None) is None:
            raise ValueError(f"config.{DELAY} is unset: the decoder's delay conditioning needs it")
        super().__init__(config)
        self.t_cond = time_embedding(float(getattr(config, DELAY)), config.hidden_size)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return super().load_weights(self._folded(weights), strict)

    def _folded(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights` with each layer's ada_rms_norm folded into its post_attention_layernorm
        (both held back until the stream ends: their order in the files is free)."""
        ada: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> linear1 / linear2
        norms: dict[str, torch.Tensor] = {}  # layer prefix -> norm weight
        for name, w in weights:
            if _ADA in name:
                prefix, rest = name.split(_ADA)
                ada.setdefault(prefix, {})[rest.removesuffix(".weight")] = w
            elif name.endswith(_NORM):
                norms[name.removesuffix(_NORM)] = w
            else:
                yield name, w
        if set(ada) != set(norms) or any(len(a) != 2 for a in ada.values()):
            raise ValueError(
                "Voxtral Realtime: each layer needs ada_rms_norm.linear1 / linear2 and "
                "post_attention_layernorm together (a partial update cannot be folded)"
            )
        t = self.t_cond
        for prefix, w in norms.items():
            a = ada[prefix]
            scale = F.linear(F.gelu(F.linear(t, a["linear1"].float())), a["linear2"].float())
            yield prefix + _NORM, (w.float() * (1 + scale)).to(w.dtype)
