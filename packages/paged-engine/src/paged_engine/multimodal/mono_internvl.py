"""Mono-InternVL (OpenGVLab/Mono-InternVL-2B: the remote InternVLChatModel whose llm_config
names InternLM2VEForCausalLM; vLLM's internvl.py `is_mono` branch): what sets it apart from
InternVL-Chat, read by multimodal/internvl_chat.py's config reader.

    vision_config   model_type "intern_vit_patch" (InternVisionPatchModel): InternViT's
                    embeddings alone (patch conv, CLS, learned positions) and no layer; served
                    as InternVL's tower with num_hidden_layers 0, its hidden state 0 read
                    (multimodal/internvl.py), CLS dropped, pixel shuffle and mlp1 as InternVL's
    llm_config      InternLM2 with visual experts (models/internlm2_ve.py); its config gets
                    model_type "internlm2_ve" here (InternVL-Chat's text row maps it) and
                    `visual_token_id`, the <IMG_CONTEXT> id whose prompt rows the experts take

Refused by name: a patch vision_config without an InternLM2VE llm_config or the reverse (the
remote model and vLLM build InternViT's layers for any other LLM, and the experts see no image
rows without the patch model's path), select_layer other than -1 (the remote model then reads
a hidden state the patch model does not keep; vLLM ignores the field).
"""

from __future__ import annotations

from typing import Any

import transformers

PATCH_VISION = "intern_vit_patch"  # vision_config.model_type of InternVisionPatchModel
VE_ARCH = "InternLM2VEForCausalLM"  # llm_config.architectures[0]


def is_mono(data: dict[str, Any]) -> bool:
    """Whether a remote InternVLChatModel config.json (`data`) is Mono-InternVL's; ValueError
    naming the field where it is half of it (see the module doc)."""
    vision, llm = data["vision_config"], data["llm_config"]
    patch = vision.get("model_type") == PATCH_VISION
    experts = (llm.get("architectures") or [None])[0] == VE_ARCH
    if patch != experts:
        raise ValueError(
            f"vision_config.model_type={vision.get('model_type')!r} with llm_config."
            f"architectures={llm.get('architectures')!r} is not supported: Mono-InternVL pairs "
            f"{PATCH_VISION!r} with {VE_ARCH!r}, and neither comes without the other"
        )
    if patch and data.get("select_layer", -1) != -1:
        raise ValueError(
            f"select_layer={data['select_layer']!r} is not supported with vision_config."
            f"model_type={PATCH_VISION!r}: -1 (its patch embedding's output)"
        )
    return patch


class InternLM2VEConfig(transformers.LlamaConfig):
    """Mono-InternVL's llm_config (remote code): InternLM2's fields as Llama's, plus
    `visual_token_id`, under a model_type of its own so the text row picks the expert model."""

    model_type = "internlm2_ve"

    def __init__(self, visual_token_id: int | None = None, **kwargs: Any) -> None:
        self.visual_token_id = visual_token_id
        kwargs.pop("model_type", None)  # the remote "internlm2" would shadow ours
        super().__init__(**kwargs)
