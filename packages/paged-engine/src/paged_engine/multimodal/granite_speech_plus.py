"""Granite Speech Plus (GraniteSpeechPlusForConditionalGeneration): Granite Speech whose
projector reads the conformer's last rows beside some of its intermediate ones.

    features [L, 160] (multimodal/granite_speech.py's MelFeatures, the same extractor)
    -> the CTC conformer of multimodal/granite_speech_encoder.py, keeping the outputs of the
        blocks in encoder_config.cat_hidden_layers (0: input_linear's output; i: block i's)
    -> [exported..., last] concatenated on the feature axis: [L, hidden_dim * (k + 1)]
    -> the same windowed Q-Former projector, whose encoder_hidden_size is that width
    -> n = ceil(L / window_size) * (window_size // downsample_rate) rows

Everything else is Granite Speech's: the host side (GraniteSpeechAudio: features, the
<|audio|> runs, the transcription prompt), the text model (Granite, the wrapper's logits) and
the weight names. As transformers runs it (GraniteSpeechPlusCTCEncoder.forward), the layers
are exported in layer order whatever the list's order, and block num_layers // 2's export
carries the CTC head's added distribution (HF adds it in place into the exported tensor).

Refused by name: a cat_hidden_layers index outside [0, num_layers) or repeated (HF's config
refuses the first; with the second its projector's width would not match what it reads), a
projector encoder_hidden_size other than hidden_dim * (len(cat_hidden_layers) + 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged_engine.multimodal.granite_speech_encoder import (
    CTCEncoder,
    GraniteSpeechEncoder,
    Projector,
)


def exported_layers(config: Any) -> tuple[int, ...]:
    """config.encoder_config.cat_hidden_layers checked against the projector: sorted indices."""
    c = config.encoder_config
    layers = list(getattr(c, "cat_hidden_layers", None) or [])
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < c.num_layers:
            raise ValueError(
                f"config.encoder_config.cat_hidden_layers: {i!r} is not a layer index in "
                f"[0, num_layers {c.num_layers})"
            )
    if len(set(layers)) != len(layers):
        raise ValueError(f"config.encoder_config.cat_hidden_layers {layers} repeats an index")
    width = c.hidden_dim * (len(layers) + 1)
    got = config.projector_config.encoder_hidden_size
    if got != width:
        raise ValueError(
            f"config.projector_config.encoder_hidden_size {got} must be encoder hidden_dim "
            f"{c.hidden_dim} * (len(cat_hidden_layers) + 1) = {width}"
        )
    return tuple(sorted(layers))


class PlusCTCEncoder(CTCEncoder):
    """The conformer, returning [B, T, D * (k + 1)]: the k exported outputs, then the last."""

    def __init__(self, c: Any, exported: tuple[int, ...]) -> None:
        super().__init__(c)
        self.exported = frozenset(exported)

    def forward(self, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        t = features.shape[1]
        rows = (
            torch.arange(t, device=features.device)[None, :]
            < torch.tensor(lengths, device=features.device)[:, None]
        )
        x = self.input_linear(features)
        kept = [x] if 0 in self.exported else []
        mid = len(self.layers) // 2
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x, rows)
            if i == mid:  # before the export: HF's in-place add reaches the exported tensor
                x = x + self.out_mid(torch.softmax(self.out(x), dim=-1))
            if i in self.exported:
                kept.append(x)
        return torch.cat([*kept, x], dim=-1)


class GraniteSpeechPlusEncoder(GraniteSpeechEncoder):
    """Granite Speech's encode / load_weights over the widened conformer output."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # the same two modules, the conformer widened
        self.encoder = PlusCTCEncoder(config.encoder_config, exported_layers(config))
        self.projector = Projector(config)
