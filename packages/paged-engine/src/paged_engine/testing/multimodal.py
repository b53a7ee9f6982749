"""Tiny vision-language models (LLaVA, Qwen2-VL, Idefics3, Gemma 3, Mistral 3, InternVL),
each with its processor files and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paged_engine.testing.models import _save_random, tiny_config
from paged_engine.testing.tiny_archs import _COMMON, _LLAMA_LIKE, TINY_VOCAB_SIZE
from paged_engine.testing.tokenizer import build_tiny_tokenizer

# OpenAI-style parts ({"type": "image"} / {"type": "text", "text": ...}), as HF's templates take.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_tiny_llava(
    path: str | Path,
    *,
    text: str = "llama",
    vision: str = "clip",
    seed: int = 0,
    image_size: int = 30,
    patch_size: int = 6,
    grid_pinpoints: list[list[int]] | None = None,
    onevision: str | None = None,
    **config_overrides: Any,
) -> Path:
    """A tiny random `LlavaForConditionalGeneration` checkpoint with its processor (image
    processor, tokenizer with an `<image>` token, chat template) and return its path. `text`:
    a tiny arch with a Llama-style decoder ("llama", "mistral", "qwen2"); `vision`: "clip" or
    "siglip"; `grid_pinpoints` ([height, width] pairs, multiples of image_size) makes it a
    `LlavaNextForConditionalGeneration` (anyres tiles, image_newline) instead, and with
    `onevision` (a vision_aspect_ratio such as "anyres_max_1") a
    `LlavaOnevisionForConditionalGeneration` (its processor saved as image processor and
    tokenizer: LlavaOnevisionProcessor needs torchvision);
    `config_overrides` go to the wrapper's config (vision_feature_layer, ...)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text_config = tiny_config(text, vocab_size=len(tokenizer)).to_dict()
    vision_fields = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    square = {"height": image_size, "width": image_size}
    if vision == "clip":
        vision_config = transformers.CLIPVisionConfig(**vision_fields, projection_dim=32)
        sizes = {"size": {"shortest_edge": image_size}, "crop_size": square}
        image_processor = transformers.CLIPImageProcessor(**sizes)
    elif vision == "siglip":
        vision_config = transformers.SiglipVisionConfig(**vision_fields)
        sizes = {"size": square}
        image_processor = transformers.SiglipImageProcessor(**sizes)
    else:
        raise ValueError(f"vision must be 'clip' or 'siglip', got {vision!r}")
    fields = {
        "text_config": text_config,
        "vision_config": vision_config.to_dict(),
        "image_token_id": image_id,
        **_COMMON,
        **config_overrides,
    }
    if onevision is not None:
        assert grid_pinpoints is not None, "OneVision tiles by grid_pinpoints"
        image_processor = transformers.LlavaOnevisionImageProcessor(
            size=square,
            image_grid_pinpoints=grid_pinpoints,
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
        )
        config = transformers.LlavaOnevisionConfig(
            **fields, image_grid_pinpoints=grid_pinpoints, vision_aspect_ratio=onevision
        )
        _save_random(transformers.LlavaOnevisionForConditionalGeneration, config, seed, path)
        image_processor.save_pretrained(path)
        tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
        transformers.GenerationConfig(**_COMMON).save_pretrained(path)
        return path
    if grid_pinpoints is None:
        config = transformers.LlavaConfig(**fields)
        model_cls, processor_cls = (
            transformers.LlavaForConditionalGeneration,
            transformers.LlavaProcessor,
        )
    else:
        if vision == "siglip":  # SigLIP's processor has no crop: square views by resizing
            sizes["crop_size"] = square
        image_processor = transformers.LlavaNextImageProcessor(
            **sizes,
            image_grid_pinpoints=grid_pinpoints,
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
        )
        config = transformers.LlavaNextConfig(**fields, image_grid_pinpoints=grid_pinpoints)
        model_cls, processor_cls = (
            transformers.LlavaNextForConditionalGeneration,
            transformers.LlavaNextProcessor,
        )
    _save_random(model_cls, config, seed, path)
    strategy = config.vision_feature_select_strategy
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1 if vision == "clip" else 0,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    processor.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_qwen2_vl(
    path: str | Path,
    *,
    version: str = "2",
    seed: int = 0,
    patch_size: int = 4,
    **vision_overrides: Any,
) -> Path:
    """A tiny random `Qwen2VLForConditionalGeneration` (version "2"),
    `Qwen2_5_VLForConditionalGeneration` ("2.5"), `Qwen3VLForConditionalGeneration` ("3":
    interleaved M-RoPE, deepstack after the first 2 layers) or
    `Qwen3VLMoeForConditionalGeneration` ("3-moe"), `Qwen3_5ForConditionalGeneration` ("3.5")
    or `Qwen3_5MoeForConditionalGeneration` ("3.5-moe") checkpoint with its image processor
    (`patch_size`-pixel patches merged 2 x 2) and tokenizer (Qwen's vision tokens, a chat
    template) and return its path; `vision_overrides` go to the vision config."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    ids = dict(zip(vision_tokens, tokenizer.convert_tokens_to_ids(vision_tokens), strict=True))
    # head_dim 16: M-RoPE sections of 2, 3, 3 frequencies (temporal, height, width)
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    text = {**_LLAMA_LIKE, "vocab_size": len(tokenizer), "rope_parameters": rope, **_COMMON}
    vision: dict[str, Any] = {"patch_size": patch_size, "spatial_merge_size": 2}
    vision |= {"temporal_patch_size": 2, "depth": 3, "num_heads": 4}
    if version == "2":
        vision |= {"embed_dim": 32, "hidden_size": text["hidden_size"], "mlp_ratio": 2}
        config_cls, model_cls = (
            transformers.Qwen2VLConfig,
            transformers.Qwen2VLForConditionalGeneration,
        )
    elif version == "2.5":
        vision |= {"hidden_size": 32, "intermediate_size": 48}
        vision |= {"out_hidden_size": text["hidden_size"], "fullatt_block_indexes": [1]}
        vision |= {"window_size": 4 * patch_size}  # windows of 2 x 2 merged patches
        config_cls = transformers.Qwen2_5_VLConfig
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif version in ("3.5", "3.5-moe"):  # a hybrid decoder, Qwen3-VL's tower, no deepstack
        moe = version == "3.5-moe"
        text = tiny_config("qwen3_5_moe" if moe else "qwen3_5", vocab_size=len(tokenizer))
        text = {**text.to_dict(), **_COMMON}
        text["rope_parameters"] = {  # 4 rotary frequencies, interleaved sections
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        vision |= {"hidden_size": 32, "intermediate_size": 48, "num_position_embeddings": 16}
        vision |= {"out_hidden_size": text["hidden_size"]}
        name = "Qwen3_5Moe" if moe else "Qwen3_5"
        config_cls = getattr(transformers, f"{name}Config")
        model_cls = getattr(transformers, f"{name}ForConditionalGeneration")
    elif version in ("3", "3-moe"):
        rope["mrope_interleaved"] = True
        vision |= {"hidden_size": 32, "intermediate_size": 48, "num_position_embeddings": 16}
        vision |= {"out_hidden_size": text["hidden_size"], "deepstack_visual_indexes": [0, 2]}
        text["head_dim"] = 16
        if version == "3":
            config_cls = transformers.Qwen3VLConfig
            model_cls = transformers.Qwen3VLForConditionalGeneration
        else:
            text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
            text["decoder_sparse_step"] = 1
            config_cls = transformers.Qwen3VLMoeConfig
            model_cls = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        raise ValueError(
            f"version must be '2', '2.5', '3', '3-moe', '3.5' or '3.5-moe', got {version!r}"
        )
    config = config_cls(
        text_config=text,
        vision_config={**vision, **vision_overrides},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        **_COMMON,
    )
    _save_random(model_cls, config, seed, path)
    factor = patch_size * 2
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
    )
    # the image processor and tokenizer apart: Qwen2VLProcessor needs its video processor,
    # which needs torchvision (its settings are written as it saves them)
    image_processor.save_pretrained(path)
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": patch_size,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
    }
    if version.startswith("3"):  # Qwen3-VL's: the size bounds a whole video, frames sampled
        video |= {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 16 * 64 * factor**2},
            "fps": 2,
            "min_frames": 4,
            "max_frames": 32,
            "do_sample_frames": True,
        }
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def write_tiny_idefics3(
    path: str | Path,
    *,
    arch: str = "idefics3",
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    scale_factor: int = 2,
    longest_edge: int = 96,
) -> Path:
    """A tiny random `Idefics3ForConditionalGeneration` (arch "idefics3") or
    `SmolVLMForConditionalGeneration` ("smolvlm") checkpoint with its image processor (tiles of
    `image_size` pixels, images resized to at most `longest_edge`) and tokenizer (the image,
    tile and row / column tokens, a chat template) and return its path. Idefics3 also gets
    its processor (SmolVLM's needs torchvision for its video processor)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    specials = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *grid]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = tiny_config("llama", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": image_size, "patch_size": patch_size}
    fields = {
        "text_config": text,
        "vision_config": vision,
        "scale_factor": scale_factor,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        **_COMMON,
    }
    processor_kwargs = {
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": image_size},
        "size": {"longest_edge": longest_edge},
    }
    if arch == "idefics3":
        config = transformers.Idefics3Config(**fields)
        model_cls = transformers.Idefics3ForConditionalGeneration
        image_processor = transformers.Idefics3ImageProcessor(**processor_kwargs)
    elif arch == "smolvlm":
        config = transformers.SmolVLMConfig(**fields)
        model_cls = transformers.SmolVLMForConditionalGeneration
        image_processor = transformers.SmolVLMImageProcessor(**processor_kwargs)
    else:
        raise ValueError(f"arch must be 'idefics3' or 'smolvlm', got {arch!r}")
    _save_random(model_cls, config, seed, path)
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    if arch == "idefics3":
        seq_len = (image_size // patch_size) ** 2 // scale_factor**2
        transformers.Idefics3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_len=seq_len,
            chat_template=IDEFICS3_CHAT_TEMPLATE,
        ).save_pretrained(path)
    else:
        image_processor.save_pretrained(path)
        tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def write_tiny_gemma3(
    path: str | Path,
    *,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 4,
    mm_tokens_per_image: int = 16,
    **text_overrides: Any,
) -> Path:
    """A tiny random `Gemma3ForConditionalGeneration` checkpoint (the tiny Gemma 3 text model,
    sliding window 8, so an image's run is longer than the window; a SigLIP tower of
    `image_size` pixels in `patch_size` patches pooled to `mm_tokens_per_image` rows) with its
    processor (image processor, tokenizer with Gemma 3's image tokens, chat template) and
    return its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = [*GEMMA3_IMAGE_TOKENS.values(), "<start_of_turn>", "<end_of_turn>"]
    base.add_special_tokens({"additional_special_tokens": specials})
    base.save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, extra_special_tokens=GEMMA3_IMAGE_TOKENS
    )
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_IMAGE_TOKENS.items()}
    text = tiny_config("gemma3", vocab_size=len(tokenizer), **text_overrides).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": image_size, "patch_size": patch_size}
    vision |= {"model_type": "siglip_vision_model", "vision_use_head": False}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        **_COMMON,
    )
    _save_random(transformers.Gemma3ForConditionalGeneration, config, seed, path)
    pil = getattr(transformers, "Gemma3ImageProcessorPil", transformers.Gemma3ImageProcessor)
    image_processor = pil(  # pan-and-scan off, its settings scaled down as a real config has them
        size={"height": image_size, "width": image_size},
        do_pan_and_scan=False,
        pan_and_scan_min_crop_size=image_size // 4,
        pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    ).save_pretrained(path)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


MISTRAL3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}"
)


def write_tiny_mistral3(
    path: str | Path,
    *,
    arch: str = "mistral3",
    seed: int = 0,
    patch_size: int = 4,
    longest_edge: int = 64,
) -> Path:
    """A tiny random `Mistral3ForConditionalGeneration` (arch "mistral3": a Pixtral tower,
    patches merged 2 x 2) or Pixtral-12B-style `LlavaForConditionalGeneration` ("llava": a
    Pixtral tower, no merge) checkpoint with its processor (Pixtral's image processor: images
    resized to at most `longest_edge` pixels; a tokenizer with [IMG], [IMG_BREAK], [IMG_END]
    and a chat template; PixtralProcessor itself needs torchvision) and return its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]}
    )
    text = tiny_config("mistral", vocab_size=len(tokenizer)).to_dict()
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}
    vision |= {"patch_size": patch_size, "image_size": longest_edge}
    image_id = tokenizer.convert_tokens_to_ids("[IMG]")
    if arch == "mistral3":
        merge = 2
        config = transformers.Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=image_id,
            spatial_merge_size=merge,
            **_COMMON,
        )
        model_cls = transformers.Mistral3ForConditionalGeneration
    elif arch == "llava":
        merge = 1
        config = transformers.LlavaConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=image_id,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            **_COMMON,
        )
        model_cls = transformers.LlavaForConditionalGeneration
    else:
        raise ValueError(f"arch must be 'mistral3' or 'llava', got {arch!r}")
    _save_random(model_cls, config, seed, path)
    image_processor = transformers.PixtralImageProcessor(
        patch_size={"height": patch_size, "width": patch_size},
        size={"longest_edge": longest_edge},
    )
    # the image processor and tokenizer apart: PixtralProcessor needs torchvision
    image_processor.save_pretrained(path)
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_internvl(
    path: str | Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 4
) -> Path:
    """A tiny random `InternVLForConditionalGeneration` checkpoint (a Qwen2 decoder, tiles of
    `image_size` pixels, pixel shuffle by 0.5: (image_size / patch_size)^2 / 4 rows a tile)
    with its image processor (up to 4 tiles and a thumbnail) and tokenizer (<img>, </img>,
    <IMG_CONTEXT>, a chat template; InternVLProcessor itself needs torchvision) and return
    its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = ["<img>", "</img>", "<IMG_CONTEXT>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = tiny_config("qwen2", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": [image_size] * 2}
    vision |= {"patch_size": [patch_size] * 2}
    config = transformers.InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        downsample_ratio=0.5,
        **_COMMON,
    )
    _save_random(transformers.InternVLForConditionalGeneration, config, seed, path)
    transformers.GotOcr2ImageProcessor(
        size={"height": image_size, "width": image_size}, min_patches=1, max_patches=4
    ).save_pretrained(path)
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path
