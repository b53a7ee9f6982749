"""Ultravox's linked repos (models/ultravox_linked.py) resolve with the engine's Hub settings:
`download_dir` and `hf_token` reach huggingface_hub's snapshot_download for text_model_id and
audio_model_id (config, tokenizer and weights), the Ultravox repo's `revision` does not (vLLM
fetches the ids at their default branch). No network: snapshot_download is replaced by a fake
that records its arguments and answers with the local directories test_ultravox_releases
writes. Local-directory ids never reach the Hub, whatever the settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
from image_checks import engine
from test_ultravox_audio import tiny_ultravox
from test_ultravox_releases import write_release

from paged_engine.models import ultravox_linked

IDS = {"text_model_id": "fixie-test/tiny-llama", "audio_model_id": "fixie-test/tiny-whisper"}
TOKEN = "hf_linked_test_token"


@pytest.fixture(autouse=True)
def _fresh_resolutions(monkeypatch):
    """No resolution cached or settings recorded by another test (nor left for the next)."""
    monkeypatch.setattr(ultravox_linked, "_HUBS", {})
    ultravox_linked._resolved.cache_clear()
    yield
    ultravox_linked._resolved.cache_clear()


def _release(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """A projector-only release (its tokenizer and feature extractor not its own) and the
    local directories its ids stand for."""
    ref = tiny_ultravox(seed=6)
    path = write_release(ref, tmp_path, ("multi_modal_projector.",), other_seed=7)
    data = json.loads((path / "config.json").read_text())
    local = {f: Path(data[f]) for f in IDS}
    return path, local


def test_hub_ids_resolve_with_download_dir_and_token(tmp_path, monkeypatch) -> None:
    path, local = _release(tmp_path)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **IDS}))
    calls: list[dict] = []

    def fake_snapshot_download(**kwargs) -> str:
        calls.append(kwargs)
        field = next(f for f, i in IDS.items() if i == kwargs["repo_id"])
        return str(local[field])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    cache = tmp_path / "cache"
    llm = engine(path, download_dir=str(cache), hf_token=TOKEN, revision="v-ultravox")
    assert {c["repo_id"] for c in calls} == set(IDS.values())
    for call in calls:
        assert (call["cache_dir"], call["token"], call["revision"]) == (str(cache), TOKEN, None)
    for repo in IDS.values():  # the weights were fetched (not only config / tokenizer files)
        assert any("*.safetensors" in c["allow_patterns"] for c in calls if c["repo_id"] == repo)
    assert llm.llm_engine.tokenizer.vocab_size > 0  # text_model_id's tokenizer


def test_local_directory_ids_never_reach_the_hub(tmp_path, monkeypatch) -> None:
    path, _ = _release(tmp_path)

    def no_hub(**kwargs) -> str:
        raise AssertionError(f"snapshot_download({kwargs.get('repo_id')!r}) for a local id")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    engine(path, download_dir=str(tmp_path / "cache"), hf_token=TOKEN)
