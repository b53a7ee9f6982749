"""Image processors transformers runs on torchvision, in torch alone where torchvision is missing.

transformers 5 builds some checkpoints' image processors on torchvision only (no PIL class to
fall back to): Llama4ImageProcessor, Cohere2VisionImageProcessor, Kimi_K25ImageProcessor,
Molmo2ImageProcessor (its copy in multimodal/molmo2_processor.py),
Phi4MultimodalImageProcessor (its copy in multimodal/phi4mm_processor.py),
Lfm2VlImageProcessor (its copy in multimodal/lfm2_vl_processor.py),
MiniMaxM3VLImageProcessor (its copy in multimodal/minimax_m3_vl.py),
Inkling2ImageProcessor (its copy in multimodal/inkling2_vl.py),
MiniCPMOcrImageProcessor (its copy in multimodal/minicpm_ocr.py),
NemotronH_Omni_Reasoning_V3ImageProcessor (its copy in multimodal/nemotron_h_omni_processor.py).
Gemma4ImageProcessor has a PIL class, which transformers takes without torchvision, but it
resamples otherwise (up to 2 / 255 apart). Where torchvision is missing, `image_processor` gives
our copy of the torchvision class's steps (`PROCESSORS`: each copy sits beside its model,
in multimodal/llama4.py, aya_vision.py, kimi_k25.py, gemma4.py), called as transformers' is
(`processor(images=[...], return_tensors="pt", **kwargs)`, the same output keys and dtypes,
`valid_kwargs` for mm_processor_kwargs), from the checkpoint's saved settings
(preprocessor_config.json, or processor_config.json's "image_processor") over the class's
defaults. The saved image_processor_type picks the copy (transformers saves the base name,
whichever class saved it); where it names none, or a class transformers lacks (remote code),
the config's model_type does. Every other checkpoint, and every checkpoint where torchvision
imports, gets transformers' AutoImageProcessor.

The steps as torchvision runs them on the CPU (`resize`, `normalize`):
    image -> RGB uint8 [3, H, W] (contiguous)
    resize: the same size returns the image as it is; else F.interpolate with antialias on the
        uint8 batch where torchvision does (bicubic always; bilinear on AVX2 / AVX-512 / arm64
        CPUs), else in float32, then clamped (bicubic) and rounded back to uint8; resample
        NEAREST (0) -> "nearest-exact" without antialias, BILINEAR (2), BICUBIC (3); others
        refused by name (resample)
    normalize: rescale fused into mean and std in float32 (mean * (1 / rescale_factor)), then
        (x.float() - mean) / std; Llama 4 alone rescales and normalizes in bfloat16
"""

from __future__ import annotations

import importlib
import json
import platform
from pathlib import Path
from typing import Any, ClassVar, TypedDict

import numpy as np
import torch
import torch.nn.functional as F

from paged_engine.multimodal.inputs import to_rgb

_MODES = {0: "nearest-exact", 2: "bilinear", 3: "bicubic"}  # PILImageResampling -> interpolate


def torchvision_available() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def saved_settings(path: Path) -> dict[str, Any]:
    """The image processor's settings saved with the checkpoint ({} where none are)."""
    pre, proc = Path(path) / "preprocessor_config.json", Path(path) / "processor_config.json"
    if pre.exists():
        return json.loads(pre.read_text())
    if proc.exists():
        return json.loads(proc.read_text()).get("image_processor", {})
    return {}


def to_uint8(image: Any) -> torch.Tensor:
    """A PIL image as RGB uint8 [3, H, W], contiguous (transformers' process_image; a
    transparent image over white, as its convert_to_rgb puts it)."""
    return torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1).contiguous()


def _native_uint8(mode: str) -> bool:
    """Whether torchvision resizes uint8 in place of float32 on this CPU (its rule)."""
    if mode == "bilinear":
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or (
            platform.machine() in ("aarch64", "arm64")
        )
    return True  # bicubic; nearest-exact takes uint8 everywhere


def resize(x: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize(x, size, antialias=True) of a CPU uint8
    batch x [N, 3, H, W] (or one image [3, H, W])."""
    if resample not in _MODES:
        raise ValueError(
            f"the image processor's resample={resample!r} is not supported without torchvision: "
            f"one of {sorted(_MODES)} (nearest, bilinear, bicubic)"
        )
    size = (int(size[0]), int(size[1]))
    if tuple(x.shape[-2:]) == size:
        return x
    mode = _MODES[resample]
    batch = x.reshape(-1, *x.shape[-3:])
    native = _native_uint8(mode)
    y = F.interpolate(
        batch if native else batch.float(),
        size=size,
        mode=mode,
        align_corners=None if mode == "nearest-exact" else False,
        antialias=mode != "nearest-exact",
    )
    if not native:
        y = (y.clamp_(0, 255) if mode == "bicubic" else y).round_().to(torch.uint8)
    return y.reshape(*x.shape[:-2], *size)


def normalize(x: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """TorchvisionBackend.rescale_and_normalize: float32, the rescale fused into mean / std."""
    if s["do_normalize"]:
        mean, std = torch.tensor(s["image_mean"]), torch.tensor(s["image_std"])
        if s["do_rescale"]:
            mean, std = mean * (1.0 / s["rescale_factor"]), std * (1.0 / s["rescale_factor"])
        return (x.float() - mean[:, None, None]) / std[:, None, None]
    if s["do_rescale"]:
        return x * s["rescale_factor"]
    return x


def square_size(s: dict[str, Any], name: str) -> int:
    size = s["size"]
    if (
        not isinstance(size, dict)
        or size.get("height") is None
        or size["height"] != size.get("width")
    ):
        raise ValueError(f"{name}'s size={size!r} is not supported: equal height and width")
    return int(size["height"])


class ProcessorKwargs(TypedDict, total=False):
    """The call arguments every copy takes (transformers' ImagesKwargs they all use); each
    copy's valid_kwargs adds its own."""

    do_resize: bool
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: list[float]
    image_std: list[float]
    do_convert_rgb: bool


class TorchImageProcessor:
    """A transformers image processor's call in torch alone. Subclasses give `name` (the
    transformers class), `defaults` (its class attributes), `valid_kwargs` (a TypedDict of the
    arguments a call takes) and `preprocess` (uint8 images, the call's settings -> output)."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]
    valid_kwargs: ClassVar[type]

    def __init__(self, settings: dict[str, Any], config: Any = None) -> None:
        self.settings = {
            **self.defaults,
            **{k: v for k, v in settings.items() if k in self.defaults},
        }
        self.config = config
        self.check(self.settings)

    @property
    def size(self) -> Any:
        return self.settings.get("size")

    def check(self, s: dict[str, Any]) -> None:
        """ValueError naming a setting these steps do not run."""
        if s.get("resample") is not None and s["resample"] not in _MODES:
            raise ValueError(
                f"{self.name}'s resample={s['resample']!r} is not supported without "
                "torchvision: nearest (0), bilinear (2) or bicubic (3)"
            )

    def __call__(self, images: Any, return_tensors: str | None = "pt", **kwargs: Any) -> Any:
        known = set(self.valid_kwargs.__annotations__)
        bad = sorted(k for k in kwargs if k not in known)
        if bad:
            raise ValueError(f"{self.name} (torch copy) takes no argument {bad[0]!r}")
        s = {**self.settings, **kwargs}
        self.check(s)
        flat = [i for x in images for i in x] if isinstance(images[0], list) else list(images)
        return self.preprocess([self.load_image(i) for i in flat], s)

    def load_image(self, image: Any) -> torch.Tensor:
        """One PIL image as RGB uint8 [3, H, W] (`to_uint8`; a family whose processor puts
        transparency over another background overrides this)."""
        return to_uint8(image)

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


# transformers' torchvision-only image processor -> (module, class) of ours, each beside its model
PROCESSORS: dict[str, tuple[str, str]] = {
    "Llama4ImageProcessor": ("llama4", "Llama4TorchProcessor"),
    "Cohere2VisionImageProcessor": ("aya_vision", "Cohere2VisionTorchProcessor"),
    "Kimi_K25ImageProcessor": ("kimi_k25", "KimiImageProcessor"),
    "Gemma4ImageProcessor": ("gemma4", "Gemma4TorchProcessor"),
    "Gemma4UnifiedImageProcessor": ("gemma4_unified", "Gemma4UnifiedTorchProcessor"),
    "Molmo2ImageProcessor": ("molmo2_processor", "Molmo2TorchProcessor"),
    "Phi4MultimodalImageProcessor": ("phi4mm_processor", "Phi4MMTorchProcessor"),
    "Lfm2VlImageProcessor": ("lfm2_vl_processor", "Lfm2VlTorchProcessor"),
    "MiniMaxM3VLImageProcessor": ("minimax_m3_vl", "MiniMaxM3ImageProcessor"),
    "Inkling2ImageProcessor": ("inkling2_vl", "Inkling2TorchProcessor"),
    "MiniCPMOcrImageProcessor": ("minicpm_ocr", "MiniCPMOcrTorchProcessor"),
    "NemotronH_Omni_Reasoning_V3ImageProcessor": (
        "nemotron_h_omni_processor",
        "NemotronOmniTorchProcessor",
    ),
}
# where the saved settings name no processor: transformers' choice by the config's model_type
_BY_MODEL_TYPE = {
    "llama4": "Llama4ImageProcessor",
    "cohere2_vision": "Cohere2VisionImageProcessor",
    "kimi_k25": "Kimi_K25ImageProcessor",
    "gemma4": "Gemma4ImageProcessor",
    "gemma4_unified": "Gemma4UnifiedImageProcessor",
    "molmo2": "Molmo2ImageProcessor",
    "phi4_multimodal": "Phi4MultimodalImageProcessor",
    "lfm2_vl": "Lfm2VlImageProcessor",
    "minimax_m3_vl": "MiniMaxM3VLImageProcessor",
    "inkling2": "Inkling2ImageProcessor",
    "inkling2_loop": "Inkling2ImageProcessor",
    "minicpm_ocr": "MiniCPMOcrImageProcessor",
    "nemotron_h_omni": "NemotronH_Omni_Reasoning_V3ImageProcessor",
}


def torch_processor(path: Path, config: Any) -> TorchImageProcessor | None:
    """Our torch copy of the checkpoint's image processor where there is one (whether or not
    torchvision imports), else None. The saved image_processor_type names it; where it names
    none or a class transformers lacks (remote code), the config's model_type does."""
    import transformers

    settings = saved_settings(path)
    name = str(settings.get("image_processor_type") or "").removesuffix("Fast")
    if name not in PROCESSORS and (not name or not hasattr(transformers, name)):
        name = _BY_MODEL_TYPE.get(getattr(config, "model_type", ""), "")
    if name not in PROCESSORS:
        return None
    module, cls = PROCESSORS[name]
    found = getattr(importlib.import_module(f"paged_engine.multimodal.{module}"), cls)
    return found(settings, config)


def image_processor(path: Path, config: Any) -> Any:
    """The checkpoint's image processor: transformers' where it can be built, ours where
    transformers' needs the missing torchvision."""
    from paged_engine.mistral_vision import native_image_processor, native_vision

    if native_vision(path):  # Mistral's native Pixtral: no processor file, its settings
        return native_image_processor(Path(path))
    if "Tarsier2ForConditionalGeneration" in (getattr(config, "architectures", None) or ()):
        from paged_engine.models.tarsier2_config import tarsier2_image_processor

        return tarsier2_image_processor(path)  # its size as min / max pixels, remapped
    if not torchvision_available():
        ours = torch_processor(path, config)
        if ours is not None:
            return ours
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)
