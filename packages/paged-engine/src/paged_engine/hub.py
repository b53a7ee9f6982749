"""Hub ids -> a local snapshot directory, downloading what is missing (as vLLM does).

    path = hub_snapshot("Qwen/Qwen3-0.6B", revision=None, cache_dir=None)

Only what the engine reads is fetched: config and tokenizer files plus safetensors weights
(`*.bin` / `*.pt` only when the repo has no safetensors). huggingface_hub does the rest:
the standard cache (HF_HOME / HF_HUB_CACHE, or `cache_dir`), `HF_TOKEN` for gated and private
repos, `HF_ENDPOINT`, its own tqdm progress bars, and, when the Hub cannot be reached, the
snapshot already in the cache for that revision. `HF_HUB_OFFLINE=1` never touches the network.
Every failure is one FileNotFoundError that says what was tried and how to fix it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# Config, generation config, tokenizer (fast, sentencepiece, tiktoken, BPE vocab/merges,
# Mistral's tekken.json), chat templates and the custom code trust_remote_code may run.
_METADATA_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py"]
_SAFETENSORS_PATTERNS = ["*.safetensors"]
# Mistral's native weights (params.json is among the metadata): fetched instead of the HF-named
# ones for config_format / load_format "mistral", or where a repo has no others; never both.
_MISTRAL_PATTERNS = ["consolidated*.safetensors"]
_TORCH_PATTERNS = ["*.bin", "*.pt"]
_TRUE = ("1", "on", "yes", "true")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (also when set after it was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def hub_snapshot(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    weights: bool = True,
    token: str | bool | None = None,
    mistral: bool = False,
) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default branch if None); with
    `weights=False` (a tokenizer from another repo) only its config and tokenizer files;
    `mistral`: Mistral's native weights instead of the HF-named ones."""
    from huggingface_hub import constants, snapshot_download

    offline = hub_offline()
    cache = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")

    def download(patterns: list[str], ignore: list[str] | None = _MISTRAL_PATTERNS) -> Path:
        return Path(
            snapshot_download(
                repo_id=repo_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=patterns,
                ignore_patterns=ignore,
                local_files_only=offline,
                token=token,
            )
        )

    try:
        if not offline:
            logger.info("resolving %s on the Hugging Face Hub (cache %s)", where, cache)
        if weights and mistral:
            return download(_METADATA_PATTERNS + _MISTRAL_PATTERNS, ignore=None)
        path = download(_METADATA_PATTERNS + (_SAFETENSORS_PATTERNS if weights else []))
        if weights and (path / "params.json").is_file() and not any(path.glob("*.safetensors")):
            # A Mistral-only repo (no HF-named weights): its consolidated ones are the weights.
            path = download(_METADATA_PATTERNS + _MISTRAL_PATTERNS, ignore=None)
        if weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.gguf")):
            # No safetensors in this repo: its PyTorch pickles are the weights.
            path = download(_METADATA_PATTERNS + _TORCH_PATTERNS)
    except Exception as error:  # huggingface_hub's errors; `from None`: its traceback is long
        raise FileNotFoundError(_explain(repo_id, revision, cache, offline, error)) from None
    return path


def _explain(
    repo_id: str, revision: str | None, cache: Path, offline: bool, error: Exception
) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    rev = f" --revision {revision}" if revision else ""
    fetch = f"`hf download {repo_id}{rev}` (huggingface_hub's CLI)"
    if offline:
        return (
            f"model {where} is not a local path and is not in the Hugging Face hub cache "
            f"({cache}), and HF_HUB_OFFLINE=1 forbids downloading it. Fetch it first with "
            f"{fetch} on a machine with internet into this cache, unset HF_HUB_OFFLINE, or pass "
            "a local directory."
        )
    if isinstance(error, GatedRepoError):
        return (
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its license on the "
            "model page, then set HF_TOKEN (or run `hf auth login`) to a token with access."
        )
    if isinstance(error, RevisionNotFoundError):
        return (
            f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub "
            "(a branch, tag or commit hash)."
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"model {repo_id!r} is not a local path and was not found on the Hugging Face Hub "
            "(a private repo needs HF_TOKEN set to a token with access)."
        )
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"model {where} is not a local path and is not in the Hugging Face hub cache ({cache}); "
        f"downloading it from the Hub failed ({reason}). Check the network (or HF_ENDPOINT and "
        f"proxy settings), fetch it first with {fetch}, or pass a local directory."
    )
