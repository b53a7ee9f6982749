"""Images of the Qwen2.5-Omni and Qwen3-Omni thinkers: Qwen2.5-VL's and Qwen3-VL's image paths
with the thinker's own names.

    Qwen2_5OmniThinkerForConditionalGeneration     Qwen2.5-VL's tower (multimodal/
                                                   qwen2_vl_vision.py), q / k / v apart
    Qwen3OmniMoeThinkerForConditionalGeneration    Qwen3-VL's tower with deepstack (multimodal/
                                                   qwen3_vl_vision.py), mergers named as
                                                   Qwen2-VL's (ln_q, mlp.0, mlp.2)

What differs from the model each builds on, as transformers runs it:
- Tower weights: Qwen2.5-Omni's attention has separate `attn.q` / `attn.k` / `attn.v` (fused
  here into Qwen2.5-VL's `attn.qkv`, rows q | k | v); Qwen3-Omni's deepstack mergers are
  `merger_list.j` and every merger names its norm `ln_q` and its linears `mlp.0` / `mlp.2`
  (Qwen3-VL: `deepstack_merger_list.j`, `norm`, `linear_fc1` / `linear_fc2`). The thinker saves
  them as `visual.*` (transformers 5), `thinker.visual.*` in the whole model's checkpoints.
- Prompt: an image is <|vision_bos|> (Qwen3-Omni: <|vision_start|>), a run of <|IMAGE|>
  (<|image_pad|>), one per merged patch, then the end token: Qwen2-VL's run layout.
- M-RoPE positions (get_rope_index): the bos token takes the next text position, the image
  start + (t * position_id_per_seconds, h, w) with t = 0 (an image is one temporal patch), the
  eos token start + max(h, w): Qwen2-VL's table (multimodal/mrope.py). Rotary sections:
  Qwen2.5-Omni's contiguous, Qwen3-Omni's always interleaved (its text rotary ignores the flag).
- Qwen3-Omni's decoder adds deepstack row j to the image rows after its layer j, as Qwen3-VL's.

Refused by name: a text_config.rope_parameters without `mrope_section` (transformers then falls
back to [16, 24, 24] / [24, 20, 20], which a checkpoint's own head size need not fit: the Hub's
configs set it); `mrope_interleaved` other than what the thinker's rotary does (Qwen3-Omni:
interleaved, Qwen2.5-Omni: contiguous); image features given with a grid of t != 1
(layouts_qwen.OmniLayout: the processor's images are one temporal patch). Audio runs through the
thinker's audio tower (omni_audio.py); videos run as runs of video tokens this encoder reads
frame by frame, with Omni's temporal step and M-RoPE table (omni_video.py); the talker's speech
output is not served. The whole models' classes (Qwen2_5OmniForConditionalGeneration,
Qwen3OmniMoeForConditionalGeneration) run as their thinker: its config (`thinker_config`), its
text model (models/text_wrappers.py) and its towers under `thinker.`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from paged_engine.multimodal import qwen2_vl
from paged_engine.multimodal.qwen2_vl import Qwen3ImageEncoder, QwenImageEncoder

QWEN2_5_OMNI = "Qwen2_5OmniThinkerForConditionalGeneration"
QWEN3_OMNI = "Qwen3OmniMoeThinkerForConditionalGeneration"

# Qwen3-Omni's merger names -> Qwen3-VL's (multimodal/qwen3_vl_vision.py)
_QWEN3_MERGER = (
    (re.compile(r"^merger_list\."), "deepstack_merger_list."),
    (re.compile(r"\.ln_q\."), ".norm."),
    (re.compile(r"\.mlp\.0\."), ".linear_fc1."),
    (re.compile(r"\.mlp\.2\."), ".linear_fc2."),
)
_QKV = re.compile(r"^(blocks\.\d+\.attn\.)([qkv])\.(weight|bias)$")


def check_config(config: Any) -> None:
    """ValueError naming the field where the thinker's images could not run as HF runs them."""
    qwen2_vl.check_config(config)  # M-RoPE sections covering half the rotary dims
    from paged_engine.layers.rotary import mrope_section

    interleaved = QWEN3_OMNI in (config.architectures or ())
    found = mrope_section(config.text_config)
    assert found is not None  # (checked above)
    if found[1] != interleaved:
        raise ValueError(
            f"text_config.rope_parameters mrope_interleaved={found[1]}: "
            f"{config.architectures[0]}'s text rotary is always "
            f"{'interleaved' if interleaved else 'contiguous'}"
        )


def _visual(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower's tensors with the name inside `visual.` (thinker / whole-model prefixes off)."""
    for name, tensor in weights:
        inner = name.removeprefix("thinker.").removeprefix("model.")
        if inner.startswith("visual."):
            yield inner.removeprefix("visual."), tensor


def _fused_qkv(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each block's attn.q / k / v (weight, bias) as one attn.qkv tensor, rows q | k | v."""
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        found = _QKV.match(name)
        if found is None:
            yield name, tensor
            continue
        prefix, which, kind = found.groups()
        group = parts.setdefault((prefix, kind), {})
        group[which] = tensor
        if len(group) == 3:
            del parts[(prefix, kind)]
            yield f"{prefix}qkv.{kind}", torch.cat([group["q"], group["k"], group["v"]])
    if parts:
        (prefix, kind), group = next(iter(parts.items()))
        missing = sorted(set("qkv") - set(group))
        raise ValueError(f"visual.{prefix}{missing[0]}.{kind} is missing from the checkpoint")


def _visual_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Names as qwen2_vl_vision._load_visual takes them (`visual.` again in front)."""
    return ((f"visual.{name}", tensor) for name, tensor in weights)


class Qwen2_5OmniImageEncoder(QwenImageEncoder):
    """Qwen2.5-Omni: Qwen2.5-VL's tower; q / k / v fused at load."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.visual.load_weights(_visual_names(_fused_qkv(_visual(weights))))


class Qwen3OmniImageEncoder(Qwen3ImageEncoder):
    """Qwen3-Omni: Qwen3-VL's tower and deepstack rows; mergers renamed at load."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _visual(weights):
                if name.startswith(("merger.", "merger_list.")):
                    for pattern, new in _QWEN3_MERGER:
                        name = pattern.sub(new, name)
                yield name, tensor

        return self.visual.load_weights(_visual_names(renamed()))


def build_encoder(config: Any) -> nn.Module:
    """The thinker's image encoder (tower and projector)."""
    if QWEN3_OMNI in (config.architectures or ()):
        return Qwen3OmniImageEncoder(config)
    return Qwen2_5OmniImageEncoder(config)


# the whole model (thinker, talker, vocoder) -> its thinker
_WHOLE = {
    "Qwen2_5OmniForConditionalGeneration": QWEN2_5_OMNI,
    "Qwen3OmniMoeForConditionalGeneration": QWEN3_OMNI,
}


def thinker_config(config: Any) -> Any:
    """A whole Omni model's config -> its thinker_config named as the thinker (what its images
    read); any other config as it is."""
    arch = next((a for a in config.architectures or () if a in _WHOLE), None)
    if arch is None:
        return config
    thinker = copy.copy(config.thinker_config)
    thinker.architectures = [_WHOLE[arch]]
    return thinker
