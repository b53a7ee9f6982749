"""The chat-template content format (vLLM's `chat_template_content_format`) and the media
placeholder text a template of string content gets.

A chat template takes each message's content in one of two forms (vLLM: entrypoints/chat_utils.py
parses, renderers/hf.py detects):

    "openai"  a list of parts, {"type": "text", "text": ...} / {"type": "image"} / "video" /
              "audio": the template writes each media part's placeholder itself (Qwen2-VL's,
              LLaVA-NeXT's, Gemma 3's templates)
    "string"  one string: the message's media parts become the model's placeholder text, each
              the text does not hold already, one per line before the text parts (themselves
              joined by newlines) (InternVL2's, MiniCPM-V's, Phi-3.5-vision's, old LLaVA's,
              Ultravox's Llama 3 templates)

"auto" reads the template (`detect_content_format`, cached per template text): one with a loop
over a message's content (`{% for part in message['content'] %}`, the message a loop variable
over `messages` or over a name set from it, filters, tests and slices seen through) takes
"openai", any other "string"; a template that does not parse counts as "string", as in vLLM.

A modality's placeholder text (`MediaPlaceholders`, built from the engine's image, video and
audio processors) is `FORMS[kind][modality]` where the family has a row (vLLM's
`get_placeholder_str` per model, formerly chat_utils' `_placeholder_str`): "{token}" stands for
the family's prompt token (its processor's marker, decoded), "{n}" for the item's number in the
prompt (1-based, per modality); None writes nothing (a processor that puts the media where no
marker is: BLIP-2, Fuyu, PaliGemma). A family without a row writes its prompt token, as vLLM
does for LLaVA's (the decoded image_token_index). Kinds are archs.image_kind's (images and
videos) and audio_archs.audio_kind's (audio).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

FORMATS = ("auto", "string", "openai")
MODALITIES = ("image", "video", "audio")
# the text parts vLLM's string form joins: part type -> the key holding its text
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}

_QWEN = "<|vision_start|>{token}<|vision_end|>"
# kind -> modality -> placeholder form, where it is more than the family's prompt token
FORMS: dict[str, dict[str, str | None]] = {
    "qwen2_vl": {"image": _QWEN, "video": _QWEN},  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5
    "qwen_omni": {"image": _QWEN, "video": _QWEN},  # Qwen2.5-Omni / Qwen3-Omni: <|IMAGE|> ...
    "glm4v": {
        "image": "<|begin_of_image|>{token}<|end_of_image|>",
        "video": "<|begin_of_video|>{token}<|end_of_video|>",
    },
    "glm_ocr": {"image": "<|begin_of_image|>{token}<|end_of_image|>"},
    "internvl_chat": {"image": "<image>", "video": "<video>"},  # the Hub's InternVL2 / 2.5
    "h2ovl": {"image": "<image>"},  # H2OVL-Mississippi (InternVL-Chat's marker)
    "nvlm_d": {"image": "<image>"},  # NVLM-D (vLLM's placeholder)
    "minimax_vl_01": {"image": "<image>"},  # MiniMax-VL-01 (vLLM's placeholder)
    "ovis2_5_hub": {"image": "<image>"},  # Ovis2.5's Hub release (vLLM's placeholder)
    "isaac": {"image": "<image>"},  # Isaac (vLLM's placeholder: config.vision_token)
    "keye": {"image": _QWEN},  # Keye-VL (vLLM's placeholder)
    "minicpmv_remote": {"image": "(<image>./</image>)"},  # MiniCPM-V 2.6 / 4.5 (vLLM's)
    "minicpmo_remote": {"audio": "(<audio>./</audio>)"},  # MiniCPM-o 2.6 (vLLM's)
    "qwen_vl_v1": {"image": "Picture {n}: <img></img>"},  # Qwen-VL v1 (vLLM's)
    "glm4v_remote": {"image": "<|begin_of_image|><|endoftext|><|end_of_image|>"},  # (vLLM's)
    "dots_ocr": {"image": "<|img|>{token}<|endofimg|>"},  # dots.ocr (vLLM's placeholder)
    "nemotron_nano_vl": {"image": "<image>"},  # Nemotron Nano VL v2 (vLLM's placeholder)
    "nemotron_vl_v1": {"image": "<image>"},  # Llama Nemotron Nano VL v1 (vLLM's placeholder)
    "internvl": {"video": "<video>"},  # HF's InternVL: images <IMG_CONTEXT> (its token)
    "aria": {"image": "<|fim_prefix|>{token}<|fim_suffix|>"},
    "blip2": {"image": None},
    "fuyu": {"image": None},
    "paligemma": {"image": None},
    "phi4mm": {"image": "<|image|>", "audio": "<|audio|>"},  # transformers' Phi-4-mm: its tokens
    "qwen2_audio": {"audio": "Audio {n}: <|audio_bos|>{token}<|audio_eos|>"},
    "ultravox": {"audio": "<|audio|>"},  # (its token may lie past the vocabulary: the text)
    "midashenglm": {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"},  # MiDashengLM (vLLM's)
    "kimi_audio": {"audio": "<|im_media_begin|><|im_kimia_text_blank|><|im_media_end|>"},  # vLLM's
    "phi3v": {"image": "<|image_{n}|>"},  # Phi-3 / 3.5-vision (vLLM's get_placeholder_str)
    "phi4mm_remote": {"image": "<|image_{n}|>", "audio": "<|audio_{n}|>"},  # Phi4MMForCausalLM
    "kimi_vl": {"image": "<|media_start|>image<|media_content|>{token}<|media_end|>"},
    "clip_embed": {"image": None},  # CLIP / SigLIP embeddings: an image prompt is text-less
    "siglip_embed": {"image": None},
}

# vLLM's chat template fallbacks (transformers_utils/chat_templates/registry.py) for kinds whose
# checkpoints ship none: template_basic.jinja, every message's content one after the other.
_BASIC = "{%- for message in messages -%}{{- message['content'] -}}{%- endfor -%}"
FALLBACK_TEMPLATES: dict[str, str] = {"clip_embed": _BASIC, "siglip_embed": _BASIC}


def fallback_template(images: Any) -> str | None:
    """The chat template vLLM falls back to for the engine's image processor's kind (None: no
    fallback, or no image processor)."""
    return FALLBACK_TEMPLATES.get(getattr(images, "kind", None) or "")


def check_format(fmt: Any, param: str) -> str:
    """`fmt` if it is one of FORMATS; ValueError naming `param` otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"{param} must be 'auto', 'string' or 'openai', got {fmt!r}")
    return fmt


def resolve_content_format(given: str, template: Any) -> str:
    """ "string" or "openai": `given`, or where it is "auto" what `template` takes (a template
    text; a tokenizer's dict of named templates: its "default"; None: "string")."""
    if given != "auto":
        return given
    if isinstance(template, dict):
        template = template.get("default")
    return detect_content_format(template) if isinstance(template, str) else "string"


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """ "openai" where the Jinja `template` loops over a message's content, else "string"."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        # transformers' environment: its {% generation %} tag and loop controls parse
        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception as e:
        logger.warning("the chat template does not parse (%s): taking string content", e)
        return "string"
    return "openai" if _loops_over_content(ast) else "string"


def _loops_over_content(ast: Any) -> bool:
    from jinja2 import nodes

    def reads(node: Any, names: set[str], key: str | None = None) -> bool:
        """Whether `node` is one of `names` (or its [key] / .key), seen through filters,
        tests and slices (`messages | selectattr(...)`, `messages[1:]`)."""
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            node = node.node
        if key is not None:
            if isinstance(node, nodes.Getattr) and node.attr == key:
                return reads(node.node, names)
            if (
                isinstance(node, nodes.Getitem)
                and isinstance(node.arg, nodes.Const)
                and node.arg.value == key
            ):
                return reads(node.node, names)
            return False
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names

    # `messages` and every name set from it, to a fixed point
    lists = {"messages"}
    grown = True
    while grown:
        grown = False
        for a in ast.find_all(nodes.Assign):
            name = a.target.name if isinstance(a.target, nodes.Name) else None
            if name is not None and name not in lists and reads(a.node, lists):
                lists.add(name)
                grown = True
    loops = list(ast.find_all(nodes.For))
    messages = {
        f.target.name for f in loops if isinstance(f.target, nodes.Name) and reads(f.iter, lists)
    }
    return any(reads(f.iter, messages, "content") for f in loops)


@dataclass(frozen=True, slots=True)
class MediaPlaceholders:
    """Each modality's placeholder form ("{n}": the item's number); a modality absent or None
    writes no text."""

    forms: dict[str, str | None]

    def text(self, modality: str, n: int) -> str | None:
        form = self.forms.get(modality)
        return None if form is None else form.replace("{n}", str(n))


def media_placeholders(
    tokenizer: Any, images: Any = None, videos: Any = None, audios: Any = None
) -> MediaPlaceholders:
    """The placeholder forms of the engine's processors (InputProcessor.images / .videos /
    .audios; None where the model takes no such media)."""
    from paged_engine.multimodal.archs import KINDS as IMAGE_KINDS
    from paged_engine.multimodal.audio_archs import audio_kind

    def token(tid: int) -> str:
        return tokenizer.decode([int(tid)])

    forms: dict[str, str | None] = {}
    if images is not None:
        forms["image"] = _form(images.kind, "image", lambda: token(images.layout.marker))
    if videos is not None:
        archs = getattr(videos.config, "architectures", None) or []
        kind = next((IMAGE_KINDS[a] for a in archs if a in IMAGE_KINDS), "")
        named = getattr(videos, "placeholder", None)  # the family's prompt text for a video
        forms["video"] = _form(kind, "video", lambda: named or token(videos.video_token_id))
    if audios is not None:
        kind = audio_kind(audios.config) or ""
        forms["audio"] = _form(kind, "audio", lambda: token(audios.placeholder))
    return MediaPlaceholders(forms)


def _form(kind: str, modality: str, prompt_token: Any) -> str | None:
    row = FORMS.get(kind, {})
    if modality in row and row[modality] is None:
        return None
    form = row.get(modality) or "{token}"
    return form.replace("{token}", prompt_token()) if "{token}" in form else form


def string_content(messages: list[dict], placeholders: MediaPlaceholders) -> list[dict]:
    """`messages` in vLLM's "string" form: a message's list of parts (text and split_media's
    {"type": "image" / "video" / "audio"}) becomes one string, each media item's placeholder
    the text does not hold already first (a modality's items together, modalities in the order
    met, as vLLM's tracker keeps them), one a line, then the text parts joined by newlines.
    Items are numbered per modality across the conversation, in the order split_media collects
    them, so the placeholders and multi_modal_data agree. ValueError where a message's text
    holds more of a placeholder than it has items (vLLM's check)."""
    counts: Counter[str] = Counter()
    out = []
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m, dict) else None
        if not isinstance(parts, list):
            out.append(m)
            continue
        texts: list[str] = []
        wanted: dict[str, list[str]] = {}  # modality -> its placeholders (modalities as met)
        for p in parts:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in MODALITIES:
                counts[kind] += 1
                text = placeholders.text(kind, counts[kind])
                if text:
                    wanted.setdefault(kind, []).append(text)
            elif kind in _TEXT_KEYS:
                texts.append(str(p.get(_TEXT_KEYS[kind], "")))
            else:
                raise ValueError(
                    f"messages[{i}].content: a part of type {kind!r} has no string form (text, "
                    "refusal, thinking, image, video and audio parts do)"
                )
        flat = [t for group in wanted.values() for t in group]
        out.append({**m, "content": _joined(flat, "\n".join(texts), f"messages[{i}]")})
    return out


def _joined(wanted: list[str], text: str, param: str) -> str:
    missing: list[str] = []
    for placeholder, count in Counter(wanted).items():  # (first-seen order)
        written = text.count(placeholder)
        if written > count:
            raise ValueError(
                f"{param}.content: the text holds {written} {placeholder!r} placeholder(s) but "
                f"the message has {count} such item(s)"
            )
        missing += [placeholder] * (count - written)
    return "\n".join([*missing, text] if text else missing)
