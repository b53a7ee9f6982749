"""InternVLChatModel: the Hub's remote-code InternVL (InternVL2 / 2.5 / 3 / 3.5, what vLLM
serves as `InternVLChatModel`; and Skywork-R1V's `SkyworkR1VChatModel`, the same model and
config under its own names) through InternVL's path in transformers' form.

The remote model is transformers' InternVLForConditionalGeneration (multimodal/internvl.py)
under other names: the same InternViT tower (layer scale, LayerNorm / RMSNorm, optional q / k
RMSNorm), v2 pixel shuffle, LayerNorm -> Linear -> GELU -> Linear projector, and its LLM. Here
its config.json is read into transformers' `InternVLConfig` (whatever trust_remote_code says:
no remote code runs) and its weight names map onto ours at load:

    config.json (remote)                 -> InternVLConfig
    llm_config                              text_config (qwen2 / qwen3 / qwen3_moe / llama;
                                            internlm2 as Llama's fields, `InternLM2Config`)
    vision_config (intern_vit_6b)           vision_config (internvl_vision): qkv_bias ->
                                            attention_bias, qk_normalization -> use_qk_norm,
                                            no final norm (use_mean_pooling, as InternViT)
    select_layer                            vision_feature_layer ("default": CLS dropped)
    downsample_ratio                        downsample_ratio
    "<IMG_CONTEXT>" of the tokenizer        image_token_id
    weights                                 vision_model.* -> vision_tower.* (encoder.layers
                                            -> encoder.layer, attn.qkv split in q, k, v rows,
                                            attn.proj -> projection_layer, ls1 / ls2 ->
                                            lambda_1 / 2, norm1 / 2 -> layernorm_before /
                                            after, class_embedding -> cls_token, ...);
                                            mlp1.{0,1,3} -> multi_modal_projector.{layer_norm,
                                            linear_1, linear_2}; language_model.X -> X
                                            (models/text_wrappers.py's row; InternLM2's
                                            packed wqkv: models/llama_variants.py)

Images: the remote model's dynamic_preprocess is GotOcr2's crop_to_patches (the same grid
search and tie rule, tiles of force_image_size, a thumbnail after a grid of more than one
tile), PIL bicubic, ImageNet mean / std: GotOcr2ImageProcessorPil built from the config's
min_dynamic_patch / max_dynamic_patch / dynamic_image_size (no processor file is read: the
Hub's preprocessor_config.json, where there is one, is a CLIP processor the model never used).
Prompt: "<image>" in the text (vLLM's placeholder, what the chat templates write) or a lone
<IMG_CONTEXT> becomes <img>, a run of <IMG_CONTEXT> per tile, </img> (QianfanLayout's rule).

Mono-InternVL (a patch-embedding vision_config, an InternLM2VE llm_config with visual experts):
multimodal/mono_internvl.py, models/internlm2_ve.py.

Refused by name: ps_version other than "v2" (v1's shuffle is another layout), a
force_image_size other than vision_config.image_size (the remote model interpolates its
position table), use_thumbnail False, q / k norms with a layer_norm_eps other than 1e-6 (ours
use 1e-6, the remote model the tower's eps).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import transformers

from paged_engine.multimodal.internvl import InternVLImageEncoder
from paged_engine.multimodal.layouts import Loaded, Run, _shape_error, _side
from paged_engine.multimodal.mono_internvl import InternLM2VEConfig, is_mono
from paged_engine.multimodal.qianfan_ocr import QianfanLayout, hub_vit_names, split_hub_names

# Skywork-R1V's remote model is InternVL-Chat's under another name (its config fields, weight
# names and tokens the same)
# H2OVL-Mississippi too: its own tiling of one image alone (multimodal/h2ovl.py); NVLM-D
# its own projector, context token and tile tags (multimodal/nvlm_d.py)
ARCHS = ("InternVLChatModel", "SkyworkR1VChatModel", "H2OVLChatModel", "NVLM_D")
CONTEXT = "<IMG_CONTEXT>"
_CONTEXTS = {"NVLM_D": "<|vision_pad|>"}  # arch -> its image context token, where not CONTEXT
_IMAGENET_MEAN = [0.485, 0.456, 0.406]
_IMAGENET_STD = [0.229, 0.224, 0.225]
_QK_NORM_EPS = 1e-6  # internvl.py's q / k RMSNorm eps
_LAYERS = "vision_tower.encoder.layer."
# remote vision field -> transformers' InternVLVisionConfig field
_VISION_FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_channels": "num_channels",
    "hidden_act": "hidden_act",
    "layer_norm_eps": "layer_norm_eps",
    "norm_type": "norm_type",
    "qkv_bias": "attention_bias",
    "qk_normalization": "use_qk_norm",
}
# the remote vision / projector names -> transformers', in order, on `vision_model.` and
# `mlp1.` names only
_NAMES = hub_vit_names((r"\.encoder\.layers\.", ".encoder.layer."))


def chat_config(path: str | Path) -> Any | None:
    """The checkpoint's config as transformers' InternVLConfig when its config.json names
    InternVLChatModel (architectures kept), else None; ValueError naming a field not served."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    arch = next((a for a in data.get("architectures") or () if a in ARCHS), None)
    if arch is None:
        return None
    return internvl_config(data, _context_id(Path(path), _CONTEXTS.get(arch, CONTEXT)))


def internvl_config(data: dict[str, Any], image_token_id: int) -> Any:
    """transformers' InternVLConfig of a remote config.json's fields (see the module doc)."""
    arch = next(a for a in data["architectures"] if a in ARCHS)
    vision, llm = data.get("vision_config"), data.get("llm_config")
    if not isinstance(vision, dict) or not isinstance(llm, dict):
        raise ValueError(f"{arch}: config.json needs vision_config and llm_config")
    if data.get("ps_version", "v1") != "v2":
        raise ValueError(
            f"ps_version={data.get('ps_version')!r} is not supported: 'v2' (v1's pixel "
            "shuffle transposes the grid)"
        )
    size = vision.get("image_size")
    forced = data.get("force_image_size")
    if forced is not None and forced != size:
        raise ValueError(
            f"force_image_size={forced!r} is not supported: only vision_config.image_size "
            f"({size!r}; another size interpolates the position table)"
        )
    if not data.get("use_thumbnail", True):
        raise ValueError("use_thumbnail=False is not supported: InternVL's tiles end with one")
    if vision.get("qk_normalization") and vision.get("layer_norm_eps", 1e-6) != _QK_NORM_EPS:
        raise ValueError(
            f"vision_config.layer_norm_eps={vision['layer_norm_eps']!r} with qk_normalization "
            f"is not supported: {_QK_NORM_EPS} (the q / k norms' eps)"
        )
    low, high = data.get("min_dynamic_patch", 1), data.get("max_dynamic_patch", 12)
    for name, value in (("min_dynamic_patch", low), ("max_dynamic_patch", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not supported: a positive int")
    if low > high:
        raise ValueError(f"min_dynamic_patch={low} is above max_dynamic_patch={high}")
    fields = {ours: vision[theirs] for theirs, ours in _VISION_FIELDS.items() if theirs in vision}
    patch = vision.get("patch_size")
    fields |= {"image_size": [size, size], "patch_size": [patch, patch]}
    fields |= {"use_mean_pooling": True, "use_absolute_position_embeddings": True}
    mono = is_mono(data)  # Mono-InternVL: a patch embedding, no layer (multimodal/mono_internvl.py)
    if mono:
        fields["num_hidden_layers"] = 0
    text: Any = {k: v for k, v in llm.items() if k not in ("auto_map", "_name_or_path")}
    if mono:  # InternLM2 with visual experts on <IMG_CONTEXT> rows
        text = InternLM2VEConfig(**text, visual_token_id=image_token_id)
    elif text.get("model_type") == "internlm2":  # remote code too: Llama's fields, its own type
        text = InternLM2Config(**text)
    elif text.get("model_type") not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"{arch} with an llm_config of model_type {text.get('model_type')!r} is not "
            "supported (served: qwen2, qwen3, qwen3_moe, llama, internlm2)"
        )
    dtype = data.get("dtype") or data.get("torch_dtype")
    config = transformers.InternVLConfig(
        text_config=text,
        vision_config=fields,
        image_token_id=image_token_id,
        downsample_ratio=data.get("downsample_ratio", 0.5),
        vision_feature_layer=data.get("select_layer", -1),
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        **({"dtype": dtype} if dtype else {}),
    )
    config.architectures = [arch]
    # the remote model ties its LLM's head by llm_config alone
    config.tie_word_embeddings = bool(getattr(config.text_config, "tie_word_embeddings", False))
    config.min_dynamic_patch, config.max_dynamic_patch = low, high
    config.dynamic_image_size = bool(data.get("dynamic_image_size", True))
    config.use_msac = bool(data.get("use_msac", False))  # H2OVL's (multimodal/h2ovl.py)
    return config


class InternLM2Config(transformers.LlamaConfig):
    """InternLM2's llm_config (remote code in transformers' eyes): Llama's fields, what
    models/llama_variants.py's InternLM2ForCausalLM reads, under its own model_type."""

    model_type = "internlm2"


def _context_id(path: Path, context: str = CONTEXT) -> int:
    """`context`'s id (<IMG_CONTEXT>; NVLM-D's <|vision_pad|>) among the tokenizer's added
    tokens (tokenizer.json, or tokenizer_config.json's added_tokens_decoder); the remote model
    looks it up the same way."""
    found: dict[str, int] = {}
    file = path / "tokenizer.json"
    if file.is_file():
        found |= {t["content"]: int(t["id"]) for t in json.loads(file.read_text())["added_tokens"]}
    file = path / "tokenizer_config.json"
    if file.is_file():
        decoder = json.loads(file.read_text()).get("added_tokens_decoder") or {}
        found |= {t["content"]: int(i) for i, t in decoder.items()}
    if context not in found:
        raise ValueError(f"{path}: the tokenizer has no {context} token, which InternVL needs")
    return found[context]


def _hf_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower and projector tensors in transformers' names (others pass over unread), a
    fused attn.qkv split in its q, k, v rows."""
    kept = ((n, t) for n, t in weights if n.startswith(("vision_model.", "mlp1.")))
    return split_hub_names(kept, _NAMES)


class InternVLChatImageEncoder(InternVLImageEncoder):
    """InternVL's encoder loading the remote checkpoint's names."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `vision_model.*` and `mlp1.*` tensors (the layers after the one
        read passed over); ValueError naming a missing or unexpected one."""
        built = len(self.vision_tower.encoder.layer)
        return self._load_tower(_hf_names(weights), _LAYERS, built)


class InternVLChatLayout(QianfanLayout):
    """InternVL's tiles and <img> run </img>, "<image>" markers taken; the tiles from the
    config's dynamic-patch settings (`image_processor`: processor.py builds it from the
    config, no processor file needed)."""

    # vLLM's InternVL mm_processor_kwargs: GotOcr2's names for them here
    refused_kwargs: ClassVar[dict[str, str]] = {
        "min_dynamic_patch": "give min_patches (the same bound, GotOcr2's name)",
        "max_dynamic_patch": "give max_patches (the same bound, GotOcr2's name)",
        "dynamic_image_size": "give crop_to_patches (the same switch, GotOcr2's name)",
    }

    def image_processor(self) -> Any:
        side = int(self.config.vision_config.image_size[0])
        return transformers.GotOcr2ImageProcessorPil(
            size={"height": side, "width": side},
            crop_to_patches=self.config.dynamic_image_size,
            min_patches=self.config.min_dynamic_patch,
            max_patches=self.config.max_dynamic_patch,
            image_mean=_IMAGENET_MEAN,
            image_std=_IMAGENET_STD,
        )

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image], crop_to_patches=self.config.dynamic_image_size)
        tiles = out["pixel_values"].float()
        if tiles.dim() != 4 or tuple(tiles.shape) != self.pixel_shape((tiles.shape[0],)):
            side = _side(self.config)
            raise _shape_error(tiles, f"[tiles, 3, {side}, {side}]")
        return tiles, (tiles.shape[0],)
