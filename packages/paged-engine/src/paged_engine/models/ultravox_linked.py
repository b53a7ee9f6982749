"""The repositories an Ultravox config names: `text_model_id` (the language model) and
`audio_model_id` (the Whisper model whose encoder is the tower), as fixie-ai's releases write
them (e.g. "meta-llama/Llama-3.2-1B-Instruct" and "openai/whisper-large-v3-turbo"), their own
safetensors holding the projector and whatever training changed (a fine-tuned tower, a merged
language model).

Each id resolves as paged resolves a model (loader.resolve_model, hub.py): a local directory
(what transformers' from_pretrained also takes), or a Hub id in huggingface_hub's cache,
downloading what is missing, with the Ultravox checkpoint's own Hub settings: the engine's
`download_dir` (the cache, as vLLM's loader fetches the ids' weights into it) and `hf_token`
(gated text models: meta-llama's), HF_HUB_OFFLINE and HF_ENDPOINT as for any model. As in
vLLM, the Ultravox repo's `revision` does not apply to them (they live in their own repos:
their default branch). The settings travel on the checkpoint's loader.ResolvedModel: the
loader records them per linked id (`remember_hub`) where it reads the checkpoint's config,
tokenizer or weights, since the config reader (UltravoxConfig, built inside
AutoConfig.from_pretrained) cannot be handed them. One resolution per id, settings and process
(`linked_dir`).

- Configs (`linked_config`, from UltravoxConfig): the id's config.json read as its own class
  becomes text_config / audio_config, over any inline one (fixie's UltravoxConfig and vLLM's
  read the id's; fixie's saves drop the inline copy).
- Weights (`with_linked_weights`, the loader's stream): after the Ultravox checkpoint's own
  tensors, the language model's under `language_model.` and the Whisper model's encoder under
  `audio_tower.` (`[model.]encoder.X` -> `audio_tower.X`; its decoder and `proj_out` dropped by
  name, never read). A tensor the Ultravox checkpoint has is not read again from the other
  repo: its own wins, as in fixie's from_pretrained (the ids' models built first, the
  checkpoint loaded over them). vLLM's DefaultModelLoader streams the other repos after the
  checkpoint with no such check, so there the last copy written (the base model's) is kept.
- Host files: a checkpoint without tokenizer files takes text_model_id's tokenizer
  (`tokenizer_dir`); one without preprocessor_config.json, audio_model_id's feature extractor
  (multimodal/ultravox.py), as fixie's processor builds its audio processor from that id.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from paged_engine.loader import ResolvedModel

MODEL_TYPE = "ultravox"
TEXT, AUDIO = "text_model_id", "audio_model_id"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

Weights = Iterator[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True, slots=True)
class HubSettings:
    """How a linked id resolves: the naming checkpoint's download_dir and Hub token."""

    download_dir: str | None = None
    token: str | bool | None = dataclasses.field(default=None, repr=False)


# linked id -> the settings of the Ultravox checkpoint naming it (this process; the last one
# recorded wins where two checkpoints name the same id with different settings)
_HUBS: dict[str, HubSettings] = {}


def remember_hub(resolved: ResolvedModel) -> None:
    """Record `resolved`'s download_dir and token for the ids its Ultravox config names (none
    for any other checkpoint): every later resolution of those ids in this process uses them."""
    dirs = resolved.download_dir
    hub = HubSettings(None if dirs is None else str(dirs), resolved.token)
    for model_id in _linked_ids(resolved.path).values():
        if isinstance(model_id, str):
            _HUBS[model_id] = hub


@functools.lru_cache(maxsize=16)
def _resolved(model_id: str, weights: bool, hub: HubSettings) -> ResolvedModel:
    from paged_engine.loader import resolve_model

    return resolve_model(model_id, None, hub.download_dir, weights=weights, token=hub.token)


def linked_dir(field: str, model_id: Any, weights: bool = False) -> Path:
    """The local directory of the repo `field` (text_model_id / audio_model_id) names;
    `weights`: its weight files fetched too. ValueError naming the field when it cannot be
    resolved (no such path, not in the cache offline, a download that failed)."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"Ultravox: {field}={model_id!r} must be a model id or a directory")
    try:
        resolved = _resolved(model_id, weights, _HUBS.get(model_id, HubSettings()))
    except (OSError, ValueError) as error:
        raise ValueError(f"Ultravox: {field}={model_id!r} cannot be loaded: {error}") from error
    if resolved.is_gguf:
        raise ValueError(
            f"Ultravox: {field}={model_id!r} is a GGUF model; the linked model must be a "
            "transformers checkpoint (config.json and safetensors / bin weights)"
        )
    return resolved.path


def linked_config(field: str, model_id: Any) -> Any:
    """The config of the model `field` names (its own class: LlamaConfig, WhisperConfig...);
    remote code never runs."""
    from transformers import AutoConfig

    path = linked_dir(field, model_id)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Ultravox: {field}={model_id!r}: its config.json cannot be read ({error})"
        ) from error


def _linked_ids(path: Path) -> dict[str, str]:
    """{field: id} of an Ultravox checkpoint's config.json; {} for any other checkpoint."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        return {}
    return {f: data[f] for f in (TEXT, AUDIO) if data.get(f) is not None}


def _text_names(name: str) -> str | None:
    return "language_model." + name


def _audio_names(name: str) -> str | None:
    """A Whisper checkpoint's encoder tensors under the tower's names; None for the rest."""
    name = name.removeprefix("model.")
    return "audio_tower." + name.removeprefix("encoder.") if name.startswith("encoder.") else None


_NAMES = {TEXT: _text_names, AUDIO: _audio_names}


def with_linked_weights(resolved: ResolvedModel, weights: Weights) -> Weights:
    """`weights` (the checkpoint `resolved`) and then, for an Ultravox checkpoint naming other
    repos, their tensors it lacks (see the module doc); `weights` itself for any other."""
    from paged_engine.loader import ResolvedModel, iter_weights

    ids = _linked_ids(resolved.path)
    if not ids:
        return weights
    remember_hub(resolved)  # (a worker process: the settings came with `resolved`)
    linked = [(f, linked_dir(f, ids[f], weights=True)) for f in (TEXT, AUDIO) if f in ids]

    def stream() -> Weights:
        own: set[str] = set()
        for name, tensor in weights:
            own.add(name)
            yield name, tensor
        for field, where in linked:
            rename = _NAMES[field]
            for name, tensor in iter_weights(ResolvedModel(ids[field], where)):
                ours = rename(name)
                if ours is not None and ours not in own:  # the checkpoint's own copy won
                    yield ours, tensor

    return stream()


def tokenizer_dir(resolved: ResolvedModel) -> Path:
    """`resolved.path`, or text_model_id's directory for an Ultravox checkpoint without
    tokenizer files of its own."""
    path = resolved.path
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        return path
    ids = _linked_ids(path)
    if TEXT not in ids:
        return path
    remember_hub(resolved)
    return linked_dir(TEXT, ids[TEXT])
