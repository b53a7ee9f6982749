"""Phi-4-multimodal as the Hub ships it (`Phi4MMForCausalLM`, remote code; vLLM's phi4mm.py
serves only this name) on paged's transformers path (`Phi4MultimodalForCausalLM`:
multimodal/phi4mm.py, phi4mm_audio.py, the decoder models/phi3.py). Its config.json is
translated by models/phi4mm_config.py; this module maps the rest.

Weights (the remote name -> transformers', as convert_phi4_multimodal_weights_to_hf.py and
vLLM's hf_to_vllm_mapper map them):

    *.base_layer.*  (the decoder's PEFT-wrapped projections)   -> the name without it
    *.lora_A.* / *.lora_B.*  (the vision / speech adapters kept beside)   dropped: served per
        request from vision-lora/ and speech-lora/ (LoRARequest), as vLLM serves them
    image_embed.glb_GN / sub_GN          -> global_img_feature_extensor / sub_img_feature_extensor
    image_embed.img_projection.0 / .2    -> img_projection_up / img_projection_down
    audio_embed.audio_projection.speech.0 / .2 -> up_proj_for_speech / down_proj_for_speech
    audio_embed.audio_projection.vision.0 / .2 -> up_proj_for_vision_speech / down_..._speech
    encoders.N.feed_forward_{in,out}.net.0.linear / net.2    -> gate_up_proj / down_proj
    encoders.N.self_attn.linear_{q,k,v} / linear_out         -> {q,k,v}_proj / o_proj

Prompts: the remote processor's numbered tags. Each "<|image_i|>" / "<|audio_i|>" of the
decoded prompt becomes one placeholder id (200010 / 200011), the text between the tags
tokenized piece by piece (the remote processor swaps each tag for its special token and
tokenizes: the same pieces); then the transformers path expands each into its run. A
modality's tags must be 1 .. n in prompt order, one per item (vLLM puts item i at
"<|image_{i+1}|>"; the remote processor takes the items in tag order: they agree then), else a
ValueError naming multi_modal_data. A prompt that holds placeholder ids already (runs from a
processor) is taken as it is. The chat placeholder is vLLM's get_placeholder_str,
"<|image_{n}|>" / "<|audio_{n}|>" (chat_format.py's "phi4mm_remote" row).

Processors: preprocessor_config.json names the remote Phi4MMImageProcessor (`dynamic_hd`; 448
crops of 14-pixel patches, mean / std 0.5 hard-coded) and Phi4MMAudioFeatureExtractor
(`audio_compression_rate`, `audio_downsample_rate`, `audio_feat_stride`): transformers'
Phi4MultimodalImageProcessor (our torch copy, phi4mm_processor.py, without torchvision) and
Phi4MultimodalFeatureExtractor run with those settings (the same steps).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from paged_engine.models.phi4mm_config import AUDIO_TOKEN_ID, CROP, IMAGE_TOKEN_ID, PATCH
from paged_engine.multimodal.phi4mm import Phi4MMImageEncoder, Phi4MMLayout
from paged_engine.multimodal.phi4mm_audio import Phi4MMAudio, Phi4MMAudioEncoder

_TAG = re.compile(r"<\|(image|audio)_(\d+)\|>")
_IMAGE = "model.embed_tokens_extend.image_embed."
_AUDIO = "model.embed_tokens_extend.audio_embed."
# (remote prefix, transformers' prefix) of the embedders' own modules
_RENAMES = (
    (_IMAGE + "glb_GN", _IMAGE + "global_img_feature_extensor"),
    (_IMAGE + "sub_GN", _IMAGE + "sub_img_feature_extensor"),
    (_IMAGE + "img_projection.0.", _IMAGE + "img_projection_up."),
    (_IMAGE + "img_projection.2.", _IMAGE + "img_projection_down."),
    (_AUDIO + "audio_projection.speech.0.", _AUDIO + "up_proj_for_speech."),
    (_AUDIO + "audio_projection.speech.2.", _AUDIO + "down_proj_for_speech."),
    (_AUDIO + "audio_projection.vision.0.", _AUDIO + "up_proj_for_vision_speech."),
    (_AUDIO + "audio_projection.vision.2.", _AUDIO + "down_proj_for_vision_speech."),
)
# the conformer blocks' remote module names -> transformers' (under `audio_embed.encoder.`)
_BLOCK_RULES = (
    (
        re.compile(r"(\.encoders\.\d+\.feed_forward_(?:in|out))\.net\.0\.linear\."),
        r"\1.gate_up_proj.",
    ),
    (re.compile(r"(\.encoders\.\d+\.feed_forward_(?:in|out))\.net\.2\."), r"\1.down_proj."),
    (re.compile(r"(\.encoders\.\d+\.self_attn)\.linear_([qkv])\."), r"\1.\2_proj."),
    (re.compile(r"(\.encoders\.\d+\.self_attn)\.linear_out\."), r"\1.o_proj."),
)
_AUDIO_SETTINGS = {"audio_compression_rate": 8, "audio_downsample_rate": 1, "audio_feat_stride": 1}


def hf_name(name: str) -> str | None:
    """A remote checkpoint name as transformers' (see the module); None: dropped."""
    if ".lora_A." in name or ".lora_B." in name:
        return None
    name = name.replace(".base_layer.", ".")
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith(_AUDIO + "encoder."):
        for rule, new in _BLOCK_RULES:
            name, hits = rule.subn(new, name, count=1)
            if hits:
                break
    return name


def hf_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A remote checkpoint's (name, tensor) pairs under transformers' names, adapters dropped
    (their tensors never read)."""
    for name, tensor in weights:
        mapped = hf_name(name)
        if mapped is not None:
            yield mapped, tensor


class Phi4MMRemoteImageEncoder(Phi4MMImageEncoder):
    """Phi4MMImageEncoder loading the remote names."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(hf_weights(weights))


class Phi4MMRemoteAudioEncoder(Phi4MMAudioEncoder):
    """Phi4MMAudioEncoder loading the remote names."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(hf_weights(weights))


def _count(data: Any) -> int:
    return len(data) if isinstance(data, (list, tuple)) else 1


def tags_to_placeholders(tokenizer: Any, token_ids: list[int], mm_data: dict) -> list[int]:
    """`token_ids` with each numbered tag of a modality in `mm_data` as its lone placeholder
    id (see the module); as they are where they hold placeholder ids already or no tag."""
    if tokenizer is None or IMAGE_TOKEN_ID in token_ids or AUDIO_TOKEN_ID in token_ids:
        return token_ids
    counts = {m: _count(mm_data[m]) for m in ("image", "audio") if m in mm_data}
    bos = getattr(tokenizer, "bos_token_id", None)
    lead = token_ids[:1] if token_ids and bos is not None and token_ids[0] == bos else []
    text = tokenizer.decode(
        token_ids[len(lead) :], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    found = [t for t in _TAG.finditer(text) if t.group(1) in counts]
    if not found:
        return token_ids
    for modality, n in counts.items():
        numbers = [int(t.group(2)) for t in found if t.group(1) == modality]
        if numbers and numbers != list(range(1, n + 1)):
            named = ", ".join(f"<|{modality}_{i}|>" for i in numbers)
            raise ValueError(
                f"multi_modal_data[{modality!r}] has {n} item(s) but the prompt's {modality} "
                f"tags are {named}: write <|{modality}_1|> ... <|{modality}_{n}|>, one per "
                "item, in order"
            )
    out, at = list(lead), 0
    for tag in found:
        out += tokenizer(text[at : tag.start()], add_special_tokens=False).input_ids
        out.append(IMAGE_TOKEN_ID if tag.group(1) == "image" else AUDIO_TOKEN_ID)
        at = tag.end()
    return out + tokenizer(text[at:], add_special_tokens=False).input_ids


def _saved(path: Path) -> dict[str, Any]:
    file = Path(path) / "preprocessor_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


class Phi4MMRemoteLayout(Phi4MMLayout):
    """Phi4MMLayout with the remote processor's settings and numbered tags."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.tokenizer = tokenizer
        self.dynamic_hd = 36  # the remote Phi4MMImageProcessor's default

    def read_saved(self, path: Path) -> None:
        """preprocessor_config.json's dynamic_hd (an int >= 1)."""
        most = _saved(path).get("dynamic_hd", self.dynamic_hd)
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise ValueError(f"{path}/preprocessor_config.json: dynamic_hd={most!r}, an int >= 1")
        self.dynamic_hd = most

    def image_processor(self) -> Any:
        """transformers' Phi4MultimodalImageProcessor with the remote one's settings (our
        torch copy where torchvision is missing)."""
        from paged_engine.multimodal.phi4mm_processor import Phi4MMTorchProcessor
        from paged_engine.multimodal.torch_processors import torchvision_available

        settings = {"size": {"height": CROP, "width": CROP}, "patch_size": PATCH}
        settings |= {"dynamic_hd": self.dynamic_hd}
        if torchvision_available():
            import transformers

            return transformers.Phi4MultimodalImageProcessor(**settings)
        return Phi4MMTorchProcessor(settings, self.config)

    def numbered_tags(self, token_ids: list[int], mm_data: dict) -> list[int]:
        return tags_to_placeholders(self.tokenizer, token_ids, mm_data)


class Phi4MMRemoteAudio(Phi4MMAudio):
    """Phi4MMAudio with the remote feature extractor's settings and numbered tags."""

    def load_extractor(self) -> Any:
        import transformers

        saved = _saved(self.path)
        settings = {k: saved.get(k, v) for k, v in _AUDIO_SETTINGS.items()}
        if settings["audio_feat_stride"] != 1:
            raise ValueError(
                f"{self.path}/preprocessor_config.json: audio_feat_stride="
                f"{settings['audio_feat_stride']!r} is not supported (1: the release's)"
            )
        return transformers.Phi4MultimodalFeatureExtractor(**settings)

    def numbered_tags(self, token_ids: list[int], mm_data: dict) -> list[int]:
        return tags_to_placeholders(self.tokenizer, token_ids, mm_data)
