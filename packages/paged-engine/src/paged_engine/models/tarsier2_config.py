"""Tarsier2 (omni-research/Tarsier2-Recap-7b, Tarsier2-7b-0115) read as the Qwen2-VL it is.

vLLM serves the release as `Tarsier2ForConditionalGeneration` (its qwen2_vl.py), reached with
`hf_overrides={"architectures": ["Tarsier2ForConditionalGeneration"]}`: config.json is a LLaVA
one (`model_type="llava"`) whose `text_config` is a whole Qwen2-VL config (`model_type=
"qwen2_vl"`: the decoder's fields, M-RoPE, the vision token ids), and vLLM's model takes that
text_config as its Qwen2VLConfig. The weights are LLaVA-named: the Qwen2-VL tower (patch
embedding, blocks, merger) under `vision_tower.`, the decoder under `language_model.model.` and
its head `language_model.lm_head.`; no projector (the tower's merger is it).

`tarsier2_config` builds transformers' `Qwen2VLConfig` from that text_config (flat fields as
transformers 4.4x saved them), with architectures ["Tarsier2ForConditionalGeneration"], which
paged's tables map onto Qwen2-VL: the text model (models/text_wrappers.py, the tower's names
skipped), the image path "qwen2_vl" (multimodal/archs.py; the tower loads `vision_tower.`,
multimodal/qwen2_vl_vision.py). The tower's config is text_config's `vision_config` where it has
one (what vLLM's model reads), else the LLaVA config's own `vision_config` (what vLLM's
processor reads); neither is refused by name, rather than built at Qwen2-VL-7B's defaults.

The layout can only be Tarsier2's (no LLaVA runs a Qwen2-VL text model), so remote_aliases.py
translates it whatever config.json's `architectures` say; the vLLM override then names the
architecture the checkpoint already is (loader.apply_hf_overrides drops such an override
rather than set it on the derived text config). The preprocessor's `size` of {min_pixels,
max_pixels} is read as {shortest_edge, longest_edge}, as vLLM's `Tarsier2ImageProcessor` remaps
it (`tarsier2_image_processor`, asked by multimodal/torch_processors.py).

Videos run through Qwen2-VL's video path (multimodal/qwen_video.py; the row in
multimodal/video_archs.py), as vLLM's `Tarsier2Processor` runs them: its video processor is
transformers' Qwen2VLVideoProcessor built from preprocessor_config.json (the image processor's
settings; any video_preprocessor_config.json is not read), so a frame's pixel bounds are the
images': the file's top-level min_pixels / max_pixels where it has them (the video processor's
override), else its `size` read as the images read it (`Tarsier2VideoProcessor`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, Qwen2VLConfig

from paged_engine.multimodal.qwen_video import QwenVideoProcessor

ARCH = "Tarsier2ForConditionalGeneration"  # vLLM's name for the release
# fields of the text_config that are not Qwen2-VL's settings
_DROPPED = ("architectures", "model_type", "_name_or_path", "auto_map", "transformers_version")


def is_tarsier2(raw: dict[str, Any]) -> bool:
    """Whether a config.json is Tarsier2's: a LLaVA config around a Qwen2-VL text config."""
    text = raw.get("text_config")
    return (
        raw.get("model_type") == "llava"
        and isinstance(text, dict)
        and text.get("model_type") == "qwen2_vl"
    )


def tarsier2_config(raw: dict[str, Any]) -> PretrainedConfig:
    """The release's config.json as transformers' Qwen2VLConfig named `ARCH`."""
    text = copy.deepcopy(raw["text_config"])
    vision = text.pop("vision_config", None) or copy.deepcopy(raw.get("vision_config"))
    if not isinstance(vision, dict):
        raise ValueError(
            f"{ARCH}: config.json has no 'vision_config' (in text_config or at the top level) "
            "to build its Qwen2-VL vision tower from"
        )
    fields = {k: v for k, v in text.items() if k not in _DROPPED}
    if "dtype" not in fields and raw.get("torch_dtype") is not None:
        fields["dtype"] = fields.pop("torch_dtype", None) or raw["torch_dtype"]
    vision = {k: v for k, v in vision.items() if k not in _DROPPED}
    config = Qwen2VLConfig.from_dict({**fields, "vision_config": vision})
    config.architectures = [ARCH]
    return config


def tarsier2_image_processor(path: Path) -> Any:
    """transformers' Qwen2-VL image processor of the release, a `size` given as
    {min_pixels, max_pixels} read as {shortest_edge, longest_edge} (vLLM's remap)."""
    from transformers import AutoImageProcessor

    file = Path(path) / "preprocessor_config.json"
    saved = json.loads(file.read_text()) if file.is_file() else {}
    size = saved.get("size")
    if isinstance(size, dict) and "min_pixels" in size and "max_pixels" in size:
        edges = {"shortest_edge": size["min_pixels"], "longest_edge": size["max_pixels"]}
        return AutoImageProcessor.from_pretrained(path, size=edges)
    return AutoImageProcessor.from_pretrained(path)


def _pixel_bounds(saved: dict[str, Any]) -> dict[str, int] | None:
    """The frame pixel bounds of a preprocessor_config.json, as {shortest_edge, longest_edge}:
    top-level min_pixels / max_pixels over the `size` (either spelling); None without both."""
    size = saved.get("size") if isinstance(saved.get("size"), dict) else {}
    low = saved.get("min_pixels") or size.get("min_pixels") or size.get("shortest_edge")
    high = saved.get("max_pixels") or size.get("max_pixels") or size.get("longest_edge")
    return None if not low or not high else {"shortest_edge": int(low), "longest_edge": int(high)}


class Tarsier2VideoProcessor(QwenVideoProcessor):
    """Qwen2-VL's videos with the settings of the release's image processor (vLLM's
    Tarsier2Processor): patches, normalization and the frame pixel bounds all from
    preprocessor_config.json."""

    def _configure(self, path: Path, config: Any) -> None:
        file = path / "preprocessor_config.json"
        if not file.is_file():
            raise ValueError(f"{ARCH}: {path} has no preprocessor_config.json for its videos")
        saved = json.loads(file.read_text())
        size = _pixel_bounds(saved)
        if size is None:
            raise ValueError(
                f"{ARCH}: preprocessor_config.json gives no min_pixels / max_pixels (or size) "
                "bounding its video frames"
            )
        self.video_token_id = int(config.video_token_id)
        self.tokens_per_second = None  # Qwen2-VL: frame groups' temporal positions step by 1
        self.settings = {
            "patch_size": int(saved.get("patch_size", 14)),
            "merge_size": int(saved.get("merge_size", 2)),
            "temporal_patch_size": int(saved.get("temporal_patch_size", 2)),
            "image_mean": list(saved.get("image_mean", [0.48145466, 0.4578275, 0.40821073])),
            "image_std": list(saved.get("image_std", [0.26862954, 0.26130258, 0.27577711])),
            "rescale_factor": float(saved.get("rescale_factor", 1 / 255)),
            "size": size,
        }
        vision = config.vision_config
        if (int(vision.patch_size), int(vision.temporal_patch_size)) != (
            self.settings["patch_size"],
            self.settings["temporal_patch_size"],
        ):
            raise ValueError(
                f"{ARCH}: preprocessor_config.json's patch_size / temporal_patch_size "
                f"({self.settings['patch_size']}, {self.settings['temporal_patch_size']}) are "
                "not the vision tower's"
            )
