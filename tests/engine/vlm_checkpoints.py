"""Pieces the image tests' tiny checkpoints share (test_*_images.py): a tokenizer holding the
family's special tokens, the files saved beside the random weights, HF's processor without
its video half (or its prompt rule written out) and HF's model loaded as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_engine.testing import _COMMON, TINY_VOCAB_SIZE, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")


def tokenizer_with(special: list[str], seed: int) -> tuple[object, dict[str, int]]:
    """testing.py's tiny tokenizer (TINY_VOCAB_SIZE, `seed`) with `special` added as special
    tokens, and each of them -> its id."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer, dict(zip(special, tokenizer.convert_tokens_to_ids(special), strict=True))


def saved_tokenizer(path: Path, special: list[str], template: str, seed: int, **names: str):
    """testing.py's tiny tokenizer (`seed`, its default size) with `special` and the chat
    `template`, saved at `path` and read back with `names` (image_token=...) as the extra
    special tokens a processor looks up."""
    base = build_tiny_tokenizer(seed=seed)
    base.add_special_tokens({"additional_special_tokens": special})
    base.chat_template = template
    base.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=names)


def finish_checkpoint(path: Path, saved, template: str | None = None) -> Path:
    """`saved` (a tokenizer, which takes the chat `template` unless None, or a processor)
    and the tiny models' generation config written to `path`, beside the weights."""
    if template is not None:
        saved.chat_template = template
    saved.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def save_grid_image_processor(cls, path: Path, temporal: int, factor: int) -> None:
    """Qwen2-VL's image processor `cls` (or a sibling of its arguments) saved at `path`:
    4-pixel patches of `temporal` frames merged 2 x 2, images resized to 8 * `factor` to
    48 * `factor` pixels."""
    cls(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=temporal,
        size={"shortest_edge": 8 * factor, "longest_edge": 48 * factor},
    ).save_pretrained(path)


def processor_without_video(cls, path: Path):
    """HF's processor `cls` of `path`'s image processor and tokenizer, its video processor left
    out (it needs torchvision, and the processor's class check looks it up)."""
    with pytest.MonkeyPatch.context() as mp:
        mixin = transformers.ProcessorMixin
        mp.setattr(mixin, "check_argument_for_proper_class", _any_class, raising=False)
        return cls(
            image_processor=transformers.AutoImageProcessor.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        )


def _any_class(self, name: str, value: object) -> None:
    return None


def load_hf_vlm(cls, path: Path):
    """HF's `cls` of `path` in float32, eval mode, generating without EOS (the engine's runs
    use ignore_eos)."""
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def chatml_template(image: str) -> str:
    """A ChatML chat template (`<|im_start|>role\\n ... <|im_end|>\\n` a message, then the
    assistant's header when asked) writing each {"type": "image"} part as `image`."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image + "{% elif part['type'] == 'text' %}"
        "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def encoder_from_checkpoint(path: Path, config):
    """archs.build_encoder's encoder of `config` in float32 with the weights saved at `path`
    (model.safetensors, the checkpoint's own names)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    encoder = build_encoder(config).float()
    encoder.load_weights(load_file(path / "model.safetensors").items())
    return encoder


def tiled_context_inputs(
    path, text: str, images: list, ctx: str = "<IMG_CONTEXT>", per_tile: int = 16
) -> tuple[list[int], dict]:
    """HF's prompt ids and pixels of `text` with `images` for an InternVL-style checkpoint at
    `path`: the i-th `ctx` gets <img>, `per_tile` `ctx` for each of image i's tiles (its image
    processor's crop_to_patches), </img> after it (the processor's rule, written out because
    its image half needs torchvision). Text alone: the tokenizer's ids, nothing more."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = image_processor(images=images, return_tensors="pt", crop_to_patches=True)
    pieces = text.split(ctx)
    for i, tiles in enumerate(out["num_patches"].tolist()):
        pieces[i] += "<img>" + ctx * (per_tile * tiles) + "</img>"
    return tok.encode("".join(pieces), add_special_tokens=False), {
        "pixel_values": out["pixel_values"]
    }


def expand_image_tokens(
    ids: list[int], token: int, counts, start: tuple[int, ...] = (), end: tuple[int, ...] = ()
) -> list[int]:
    """`ids` with the i-th `token` repeated `counts[i]` times (an iterable, one an image, in
    order) and wrapped in the ids `start` and `end`: a processor's expanded prompt."""
    runs = iter(counts)
    expanded: list[int] = []
    for t in ids:
        expanded += [*start, *[t] * next(runs), *end] if t == token else [t]
    return expanded


def tiny_qwen2_text(
    vocab_size: int, hidden_size: int, kv_heads: int = 2, rope_theta: float = 10000.0
) -> dict:
    """A tiny Qwen2 LM's fields, as a remote VLM's flat config.json carries them (and
    Qwen2Config takes them): 2 layers of 4 heads (`kv_heads` KV heads), intermediate 96,
    rms_norm_eps 1e-6, 1024 positions, an untied head."""
    text = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 96}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": kv_heads}
    text |= {"rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": rope_theta}
    return text | {"tie_word_embeddings": False}


def image_run_ids(tokenizer, text: str, marker: str, rows: list) -> list[int]:
    """The prompt ids vLLM makes of `text` for DeepSeek-VL2 / DeepSeek-OCR: the pieces between
    `marker`s tokenized one by one (special tokens on the first alone), the i-th `marker` a run
    of its id as long as `rows[i]` (image i's embedding rows) is."""
    token = tokenizer.convert_tokens_to_ids(marker)
    ids: list[int] = []
    for i, chunk in enumerate(text.split(marker)):
        if i:
            ids += [token] * rows[i - 1].shape[0]
        ids += tokenizer(chunk, add_special_tokens=i == 0).input_ids
    return ids


def tiny_bart_fields(vocab_size: int, max_positions: int) -> dict:
    """A tiny BART's config fields (BartConfig / MBartConfig, Florence-2's text_config):
    d_model 32, 2 layers a stack of 4 heads, FFN 64 (encoder) / 48 (decoder), testing.py's
    BOS / EOS / PAD ids, the decoder starting from </s> as BART's, no forced EOS."""
    from paged_engine.testing import BOS_ID, EOS_ID, PAD_ID

    fields = {"vocab_size": vocab_size, "d_model": 32, "max_position_embeddings": max_positions}
    fields |= {"encoder_layers": 2, "decoder_layers": 2}
    fields |= {"encoder_attention_heads": 4, "decoder_attention_heads": 4}
    fields |= {"encoder_ffn_dim": 64, "decoder_ffn_dim": 48}
    fields |= {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    return fields | {"decoder_start_token_id": EOS_ID, "forced_eos_token_id": None}
