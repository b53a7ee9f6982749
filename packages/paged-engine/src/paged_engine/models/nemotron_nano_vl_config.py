"""Nemotron Nano VL v2's remote config (`NemotronH_Nano_VL_V2`: nvidia/NVIDIA-Nemotron-Nano-12B-
v2-VL) read without its remote code (models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM's
nano_nemotron_vl.py / radio.py read it, into the fields multimodal/nemotron_h_omni.py's C-RADIO
tower and projector take (transformers' RadioConfig for the tower):

    config.json                          -> NanoNemotronVLConfig
    llm_config (else text_config)           text_config: NemotronHConfig (model_type nemotron_h)
    vision_config.args.model                hidden_size / layers / heads / MLP width by vLLM's
                                            VIT_TIMM_DIM_BY_NAME (vit_small / base / large /
                                            huge_patch16_224)
    vision_config.patch_size                vision_config.patch_size (== the top-level one)
    vision_config.args.cpe_max_size         max_img_size (the CPE position table's side x patch)
    vision_config.args.teachers,            num_cls_tokens (one per distinct teacher, else 1),
      cls_token_per_teacher,                num_registers (register_multiple - cls % multiple)
      register_multiple
    vision_config.args.qkv_bias / layer_norm_eps    as they are (defaults True / 1e-6)
    vit_hidden_size, projector_hidden_size, downsample_ratio     as they are
    force_image_size, use_thumbnail         the tiles' side, the thumbnail after > 1 tile
    norm_mean / norm_std                    the pixels' normalization (CLIP's by default)
    img_context_token_id                    image_token_id ("<image>": each placeholder)

Refused by name: vision_config.args.min_num_patches (the dynamic-resolution tiler of later
releases), a RADIO model outside the table, qk_normalization, a norm_type other than
layer_norm, a hidden_act other than gelu, initializer_factor other than 1 (vLLM's layer scale
is that constant: the checkpoint's ls1 / ls2 are never read), ps_version other than "v2", a
CPE-less table larger than the tiles' grid (vLLM crops it where transformers resizes),
sound_config (the audio encoder), an img_context_token other than "<image>".
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field, vocab_token_id

ARCH = "NemotronH_Nano_VL_V2"
CONTEXT = "<image>"  # vLLM's IMG_CONTEXT: the prompt's marker and every placeholder
# vLLM's VIT_TIMM_DIM_BY_NAME: (hidden, layers, heads, MLP width)
VIT_DIMS: dict[str, tuple[int, int, int, int]] = {
    "vit_small_patch16_224": (384, 12, 6, 1536),
    "vit_base_patch16_224": (768, 12, 12, 3072),
    "vit_large_patch16_224": (1024, 24, 16, 4096),
    "vit_huge_patch16_224": (1280, 32, 16, 5120),
}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
DEFAULT_TILES = 12  # vLLM's DEFAULT_NUM_TILES (mm_processor_kwargs max_num_tiles overrides)


class NanoNemotronVLConfig(transformers.PretrainedConfig):
    """The wrapper: text_config, vision_config (RadioConfig), projector and tile fields."""

    model_type = "NemotronH_Nano_VL_V2"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"{ARCH}: config.json field {name}={value!r} is not supported: {want}")


def tile_fields(raw: RawConfig, side: int, arch: str) -> dict[str, Any]:
    """The tiling image processor's fields both Nemotron VL releases read alike (tiles of
    `side` pixels, DEFAULT_TILES of them, CLIP's mean / std unless given); ValueError naming a
    norm_mean / norm_std that is not three numbers."""
    mean, std = raw.get("norm_mean") or CLIP_MEAN, raw.get("norm_std") or CLIP_STD
    for name, value in (("norm_mean", mean), ("norm_std", std)):
        if not (isinstance(value, list) and len(value) == 3):
            raise ValueError(
                f"{arch}: config.json field {name}={value!r} is not supported: three floats"
            )
    return {
        "downsample_ratio": field(raw, "downsample_ratio", float, 0.5),
        "force_image_size": side,
        "use_thumbnail": field(raw, "use_thumbnail", bool, True),
        "max_num_tiles": DEFAULT_TILES,
        "norm_mean": [float(v) for v in mean],
        "norm_std": [float(v) for v in std],
    }


def radio_config(vision: RawConfig, patch: int) -> transformers.RadioConfig:
    """transformers' RadioConfig of the remote vision_config (its `args` as vLLM reads them)."""
    args = vision.get("args") or {}
    if not isinstance(args, dict):
        raise _refuse("vision_config.args", args, "a dict (RADIO's arguments)")
    if "min_num_patches" in args:
        raise _refuse(
            "vision_config.args.min_num_patches",
            args["min_num_patches"],
            "absent (the dynamic-resolution tiler is not served; tiles of force_image_size are)",
        )
    name = args.get("model")
    if name not in VIT_DIMS:
        raise _refuse("vision_config.args.model", name, f"one of {sorted(VIT_DIMS)}")
    hidden, layers, heads, mlp = VIT_DIMS[name]
    for key, want in (("qk_normalization", False), ("norm_type", "layer_norm")):
        if args.get(key, want) != want:
            raise _refuse(f"vision_config.args.{key}", args[key], repr(want))
    if args.get("hidden_act", "gelu") != "gelu":
        raise _refuse("vision_config.args.hidden_act", args["hidden_act"], "'gelu'")
    if float(args.get("initializer_factor", 1.0)) != 1.0:
        raise _refuse("vision_config.args.initializer_factor", args["initializer_factor"], "1.0")
    teachers = args.get("teachers") or []
    per_teacher = bool(args.get("cls_token_per_teacher", True))
    cls = len({t["name"] for t in teachers}) if per_teacher and teachers else 1
    multiple = args.get("register_multiple")
    registers = multiple - cls % multiple if multiple else 0
    cpe = field(args, "cpe_max_size", int, 2048)
    table = round(cpe / patch) * patch  # vLLM's max_img_size
    return transformers.RadioConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        mlp_ratio=mlp / hidden,
        patch_size=patch,
        max_img_size=table,
        num_cls_tokens=cls,
        num_registers=registers,
        qkv_bias=bool(args.get("qkv_bias", True)),
        layer_norm_eps=float(args.get("layer_norm_eps", 1e-6)),
        hidden_act="gelu",
    )


def nemotron_nano_vl_config(raw: RawConfig) -> NanoNemotronVLConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    if raw.get("sound_config") is not None:
        raise _refuse("sound_config", "{...}", "absent (the audio encoder is not served)")
    if raw.get("ps_version", "v2") != "v2":
        raise _refuse("ps_version", raw["ps_version"], "'v2' (v1 transposes the grid)")
    if raw.get("img_context_token", CONTEXT) != CONTEXT:
        raise _refuse("img_context_token", raw["img_context_token"], repr(CONTEXT))
    llm = raw.get("llm_config") or raw.get("text_config")
    if not isinstance(llm, dict) or llm.get("model_type") != "nemotron_h":
        got = llm.get("model_type") if isinstance(llm, dict) else llm
        raise _refuse("llm_config.model_type", got, "'nemotron_h'")
    text = transformers.NemotronHConfig(
        **{k: v for k, v in llm.items() if k not in ("auto_map", "_name_or_path", "model_type")}
    )
    vision = raw.get("vision_config") or {}
    patch = field(raw, "patch_size", int, 16)
    if field(vision, "patch_size", int, 16) != patch:
        raise _refuse("vision_config.patch_size", vision["patch_size"], f"{patch} (patch_size)")
    radio = radio_config(vision, patch)
    side = field(raw, "force_image_size", int)
    if side % (2 * patch):
        raise _refuse("force_image_size", side, f"a multiple of 2 x patch_size ({2 * patch})")
    preferred = (vision.get("preferred_resolution") or [224])[0]
    # without CPE (table == the tower's own image_size) vLLM crops a larger table to the grid
    if radio.max_img_size == preferred and radio.max_img_size != side:
        raise _refuse(
            "vision_config.args.cpe_max_size",
            radio.max_img_size,
            f"a CPE table (unlike preferred_resolution {preferred}) or force_image_size {side}",
        )
    token = vocab_token_id(raw, "img_context_token_id", None, int(text.vocab_size), ARCH)
    return NanoNemotronVLConfig(
        architectures=[ARCH],
        text_config=text,
        vision_config=radio,
        vision_hidden_size=field(raw, "vit_hidden_size", int, radio.hidden_size),
        projector_hidden_size=field(raw, "projector_hidden_size", int),
        **tile_fields(raw, side, ARCH),
        image_token_id=token,
        tie_word_embeddings=bool(text.tie_word_embeddings),
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
