"""Tiny causal LMs, classifiers and encoders: HF configs from `tiny_archs`, weights of the HF
class itself (randomized so logits differ clearly), saved with the tiny tokenizer."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from paged_engine.testing.tiny_archs import (
    _ARCH_DEFAULTS,
    _COMMON,
    BOS_ID,
    EOS_ID,
    MORE_TINY_ARCHS,
    SUPPORTED_TINY_ARCHS,
    TINY_VOCAB_SIZE,
)
from paged_engine.testing.tokenizer import build_tiny_tokenizer


def tiny_config(arch: str, **config_overrides: Any):
    """The HF config of a tiny `arch` model (see SUPPORTED_TINY_ARCHS)."""
    import transformers

    if arch not in _ARCH_DEFAULTS:
        known = SUPPORTED_TINY_ARCHS + MORE_TINY_ARCHS
        raise ValueError(f"unknown tiny arch {arch!r}; supported: {known}")
    cls_name, defaults = _ARCH_DEFAULTS[arch]
    kwargs = {"vocab_size": TINY_VOCAB_SIZE, **_COMMON, **defaults, **config_overrides}
    # a copy: configs may edit nested dicts (rope_parameters) in place, and the defaults serve
    # every later call
    return getattr(transformers, cls_name)(**copy.deepcopy(kwargs))


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits differ clearly between tokens (HF init is tiny)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.dim() >= 2:
            std = p.shape[-1] ** -0.5 if "emb" not in name and "wte" not in name else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif name.endswith("rg_lru.recurrent_param"):  # RG-LRU decays a^(8 r) near 0.8-0.99
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 4.0)
        else:  # norm weights
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    for name, b in sorted(model.named_buffers()):
        # routing balance biases: DeepSeek-V3's, LFM2-MoE's (buffers)
        if name.endswith(("e_score_correction_bias", "expert_bias", "balancing_biases")):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
        elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (saved)
            b.copy_(1.0 + torch.randn(b.shape, generator=gen) * 0.3)
        elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: k distinct experts a token
            experts = model.get_submodule(name.rsplit(".", 1)[0]).num_experts
            b.copy_(torch.rand(b.shape[0], experts, generator=gen).argsort(-1)[:, : b.shape[1]])


def _save_random(model_cls: Any, config: Any, seed: int, path: Path) -> None:
    """A `model_cls(config)` in float32 with `_randomize`'s weights, saved to `path`."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)


class _quiet_progress:
    """Silence transformers' "Writing model shards" progress bar for one save."""

    def __enter__(self) -> None:
        from transformers.utils import logging

        self.was_enabled = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging

        if self.was_enabled:
            logging.enable_progress_bar()


def _register_causal_lm(config) -> None:
    """Map `config`'s class to its `*ForCausalLM` in transformers' AutoModelForCausalLM where
    transformers maps none (Mistral 4: only its pretraining and image-text-to-text classes), so
    tiny models build and load through the Auto class (exist_ok: a no-op once mapped)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    name = type(config).__name__.removesuffix("Config") + "ForCausalLM"
    transformers.AutoModelForCausalLM.register(
        type(config), getattr(transformers, name), exist_ok=True
    )


def write_tiny_model(
    path: str | Path, arch: str, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a complete tiny HF-format model directory for `arch` and return its path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    _register_causal_lm(config)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except TypeError:  # transformers < 4.56 only knows torch_dtype
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    tokenizer = build_tiny_tokenizer(config.vocab_size, seed)
    tokenizer.save_pretrained(path)
    GenerationConfig(**_COMMON).save_pretrained(path)
    if not (path / "model.safetensors").exists():  # pragma: no cover - sharded by accident
        raise RuntimeError(f"expected {path / 'model.safetensors'} to be written")
    return path


def write_tiny_classifier(
    path: str | Path,
    arch: str,
    *,
    num_labels: int = 3,
    seed: int = 0,
    kind: str = "Sequence",
    **config_overrides: Any,
) -> Path:
    """Write a tiny HF `*ForSequenceClassification` model directory (transformers' class for
    `arch`'s config, random weights including the `score` head) and return its path;
    `kind="Token"`: its `*ForTokenClassification` (the same head, on every token)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, num_labels=num_labels, **config_overrides)
    stem = type(config).__name__.removesuffix("Config")
    cls = getattr(transformers, f"{stem}For{kind}Classification", None)
    if cls is None:
        raise ValueError(f"transformers has no {stem}For{kind}Classification")
    config.architectures = [cls.__name__]
    _save_random(cls, config, seed, path)
    build_tiny_tokenizer(config.vocab_size, seed).save_pretrained(path)
    return path


# Encoder-only architectures (models/bert.py) -> their transformers config class.
ENCODER_CONFIGS = {
    "BertModel": "BertConfig",
    "BertForSequenceClassification": "BertConfig",
    "XLMRobertaModel": "XLMRobertaConfig",
    "XLMRobertaForSequenceClassification": "XLMRobertaConfig",
    "ModernBertModel": "ModernBertConfig",
    "ModernBertForSequenceClassification": "ModernBertConfig",
    "RobertaForMaskedLM": "RobertaConfig",
    "BertForMaskedLM": "BertConfig",
    "BertForTokenClassification": "BertConfig",
    "RobertaForTokenClassification": "RobertaConfig",
    "XLMRobertaForTokenClassification": "XLMRobertaConfig",
    "ModernBertForTokenClassification": "ModernBertConfig",
    # no paged class: served by the Transformers backend (models/transformers_backend/encoder.py)
    "ElectraModel": "ElectraConfig",
    "ElectraForSequenceClassification": "ElectraConfig",
}


def write_tiny_encoder(
    path: str | Path, arch: str, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a tiny BERT / XLM-RoBERTa model directory (`arch`: an ENCODER_CONFIGS key; random
    weights, the tiny tokenizer, [CLS] = BOS and [SEP] = EOS ids) and return its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 130,
        **_COMMON,
        "sep_token_id": EOS_ID,
        "cls_token_id": BOS_ID,
        **config_overrides,
    }
    config = getattr(transformers, ENCODER_CONFIGS[arch])(**kwargs)
    config.architectures = [arch]
    _save_random(getattr(transformers, arch), config, seed, path)
    build_tiny_tokenizer(config.vocab_size, seed).save_pretrained(path)
    return path


# LLaVA's chat form: "USER: <image>\nWhat is this?\nASSISTANT:"; content may be a string or


def tiny_model_info(path: str | Path) -> dict[str, Any]:
    """config.json of a tiny model dir (handy in benchmarks)."""
    return json.loads((Path(path) / "config.json").read_text())
