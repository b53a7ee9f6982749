"""Hub ids: the local cache, downloads (stubbed), revisions and the errors when offline.

Nothing here reaches the network: every test either runs with HF_HUB_OFFLINE=1 against a
real cache layout under tmp_path, or replaces huggingface_hub.snapshot_download with a fake
that fills the same layout from a tiny model on disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from paged_engine import LLM, SamplingParams
from paged_engine.loader import load_hf_config, resolve_model


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache; the network is off unless a test stubs the download."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_snapshot(
    cache: Path, repo_id: str, src: Path, ref: str = "main", commit: str = "0"
) -> Path:
    """Lay `src` out as huggingface_hub does: models--org--name/{refs/<ref>, snapshots/<sha>}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    sha = commit * 40 if len(commit) == 1 else commit
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(sha)
    snapshot = repo / "snapshots" / sha
    shutil.copytree(src, snapshot, dirs_exist_ok=True)
    return snapshot


class FakeHub:
    """snapshot_download's stand-in: records each call, copies the matching files of a repo."""

    def __init__(self, cache: Path, repos: dict[str, Path]) -> None:
        self.cache, self.repos, self.calls = cache, repos, []

    def __call__(self, repo_id: str, **kw) -> str:
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append({"repo_id": repo_id, **kw})
        if repo_id not in self.repos:
            response = httpx2.Response(404, request=httpx2.Request("GET", "https://hf.co"))
            raise RepositoryNotFoundError("404 Repository Not Found", response=response)
        src = self.repos[repo_id]
        names = [p.name for p in src.iterdir()]
        keep = set(filter_repo_objects(names, allow_patterns=kw["allow_patterns"]))
        tmp = self.cache.parent / "download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name in keep:
            shutil.copy(src / name, tmp / name)
        ref = kw.get("revision") or "main"
        return str(cache_snapshot(self.cache, repo_id, tmp, ref, commit="a"))


def online_with(monkeypatch, hub: FakeHub) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)


def test_cached_hub_id_resolves_offline(hub_cache, tiny_llama_dir):
    snapshot = cache_snapshot(hub_cache, "some-org/tiny-llama", tiny_llama_dir)
    r = resolve_model("some-org/tiny-llama")
    assert r.path == snapshot and load_hf_config(r).model_type == "llama"


def test_revision_picks_that_snapshot(hub_cache, tiny_llama_dir, tmp_path):
    cache_snapshot(hub_cache, "some-org/tiny-llama", tiny_llama_dir, "main", "0")
    tagged = cache_snapshot(hub_cache, "some-org/tiny-llama", tiny_llama_dir, "v1", "1")
    assert resolve_model("some-org/tiny-llama", revision="v1").path == tagged
    with pytest.raises(FileNotFoundError, match=r"at revision 'v2'.*--revision v2"):
        resolve_model("some-org/tiny-llama", revision="v2")


def test_download_dir_is_the_cache(hub_cache, tiny_llama_dir, tmp_path):
    other = tmp_path / "elsewhere"
    snapshot = cache_snapshot(other, "some-org/tiny-llama", tiny_llama_dir)
    assert resolve_model("some-org/tiny-llama", download_dir=other).path == snapshot
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face hub cache"):
        resolve_model("some-org/tiny-llama")  # not in the standard cache


def test_offline_and_uncached_says_what_was_tried(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after huggingface_hub was imported
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("some-org/not-cached")
    msg = str(e.value)
    assert str(hub_cache) in msg and "HF_HUB_OFFLINE=1 forbids downloading" in msg
    assert "`hf download some-org/not-cached`" in msg and e.value.__cause__ is None


def test_download_fetches_config_tokenizer_and_safetensors_only(
    hub_cache, monkeypatch, tiny_llama_dir, tmp_path
):
    src = tmp_path / "repo"
    shutil.copytree(tiny_llama_dir, src)
    (src / "pytorch_model.bin").write_bytes(b"not wanted")
    (src / "model.gguf").write_bytes(b"not wanted")
    hub = FakeHub(hub_cache, {"org/tiny": src})
    online_with(monkeypatch, hub)
    r = resolve_model("org/tiny", revision="abc", token="hf_secret")
    (call,) = hub.calls
    assert call["revision"] == "abc" and call["local_files_only"] is False
    assert call["token"] == "hf_secret"
    assert "*.safetensors" in call["allow_patterns"] and "*.bin" not in call["allow_patterns"]
    files = {p.name for p in r.path.iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    assert "pytorch_model.bin" not in files and "model.gguf" not in files
    assert load_hf_config(r).model_type == "llama"


def test_a_repo_without_safetensors_gets_its_bin_weights(
    hub_cache, monkeypatch, tiny_llama_dir, tmp_path
):
    import torch
    from safetensors.torch import load_file

    src = tmp_path / "repo"
    shutil.copytree(tiny_llama_dir, src)
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    hub = FakeHub(hub_cache, {"org/pt-only": src})
    online_with(monkeypatch, hub)
    r = resolve_model("org/pt-only")
    assert len(hub.calls) == 2 and "*.bin" in hub.calls[1]["allow_patterns"]
    assert (r.path / "pytorch_model.bin").is_file()


def test_tokenizer_only_skips_weights(hub_cache, monkeypatch, tiny_llama_dir):
    hub = FakeHub(hub_cache, {"org/tiny": tiny_llama_dir})
    online_with(monkeypatch, hub)
    r = resolve_model("org/tiny", weights=False)
    assert len(hub.calls) == 1 and not any(
        "safetensors" in p for p in hub.calls[0]["allow_patterns"]
    )
    assert not any(r.path.glob("*.safetensors")) and (r.path / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "error, expected",
    [
        (LocalEntryNotFoundError("Got: ConnectError: Name or service not known"), "download"),
        ("gated", "HF_TOKEN"),
    ],
)
def test_hub_errors_say_how_to_fix(hub_cache, monkeypatch, error, expected):
    if error == "gated":
        response = httpx2.Response(401, request=httpx2.Request("GET", "https://hf.co"))
        error = GatedRepoError("401 gated", response=response)

    def fail(repo_id, **kw):
        raise error

    online_with(monkeypatch, fail)
    with pytest.raises(FileNotFoundError, match=expected) as e:
        resolve_model("org/unreachable")
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_unknown_repo_mentions_token(hub_cache, monkeypatch, tiny_llama_dir):
    online_with(monkeypatch, FakeHub(hub_cache, {}))
    with pytest.raises(FileNotFoundError, match=r"not found on the Hugging Face Hub.*HF_TOKEN"):
        resolve_model("org/missing")


def test_llm_from_a_hub_id_downloads_and_generates(hub_cache, monkeypatch, tiny_llama_dir):
    """LLM(model=<hub id>, revision=...) gives what LLM(model=<the same files on disk>) gives."""
    hub = FakeHub(hub_cache, {"org/tiny": tiny_llama_dir})
    online_with(monkeypatch, hub)
    params = SamplingParams(temperature=0, max_tokens=6)
    kw = dict(device="cpu", dtype="float32", num_gpu_blocks_override=32, max_model_len=64)
    from_hub = LLM(model="org/tiny", revision="main", **kw).generate([[3, 4, 5]], params)
    assert hub.calls[0]["revision"] == "main"
    local = LLM(model=str(tiny_llama_dir), **kw).generate([[3, 4, 5]], params)
    assert from_hub[0].outputs[0].token_ids == local[0].outputs[0].token_ids
