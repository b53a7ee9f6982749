"""paged-server's engine options reach the engine config: the CPU ones (--quantization,
--batch-invariant, --cpu-num-threads, -O / --compilation-config), --generation-config,
--override-generation-config, --scheduling-policy, --mamba-ssm-cache-dtype and
--prefix-state-snapshots (the engine validates them)."""

from __future__ import annotations

import pytest

import paged_engine
from paged_server.cli import build_engine, parse_args


def engine_config(monkeypatch: pytest.MonkeyPatch, argv: list[str]):
    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.setdefault("c", config))
    build_engine(parse_args(["m", *argv]))
    return seen["c"]


def test_defaults(monkeypatch):
    config = engine_config(monkeypatch, [])
    assert (config.quantization, config.batch_invariant, config.cpu_num_threads) == (
        None,
        False,
        None,
    )
    assert config.compilation_level == 0


def test_options_are_passed(monkeypatch):
    config = engine_config(monkeypatch, ["-q", "int4", "--cpu-num-threads", "3"])
    assert (config.quantization, config.cpu_num_threads) == ("int4", 3)
    assert engine_config(monkeypatch, ["--batch-invariant"]).batch_invariant is True


def test_bad_values_name_the_option(monkeypatch):
    with pytest.raises(ValueError, match="quantization"):
        engine_config(monkeypatch, ["--quantization", "int2"])


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["-O3"], 3),
        (["-O", "0"], 0),
        (["--compilation-config", "1"], 1),
        (["--compilation-config", '{"level": 3}'], {"level": 3}),
    ],
)
def test_compilation_config_forms(monkeypatch, argv, value):
    assert engine_config(monkeypatch, argv).compilation_config == value


def test_bad_compilation_config(monkeypatch, capsys):
    with pytest.raises(ValueError, match="compilation_config=7"):
        engine_config(monkeypatch, ["-O7"])
    with pytest.raises(SystemExit):
        parse_args(["m", "-O", "fast"])
    assert "--compilation-config" in capsys.readouterr().err


def test_generation_config_and_scheduling_policy(monkeypatch, capsys):
    config = engine_config(monkeypatch, [])
    assert (config.generation_config, config.override_generation_config) == ("auto", None)
    assert config.scheduling_policy == "fcfs"
    argv = [
        "--generation-config",
        "vllm",
        "--override-generation-config",
        '{"temperature": 0.3}',
        "--scheduling-policy",
        "priority",
    ]
    config = engine_config(monkeypatch, argv)
    assert (config.generation_config, config.override_generation_config) == (
        "vllm",
        {"temperature": 0.3},
    )
    assert config.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="override_generation_config has unknown key"):
        engine_config(monkeypatch, ["--override-generation-config", '{"temp": 1}'])
    with pytest.raises(SystemExit):
        parse_args(["m", "--scheduling-policy", "lifo"])
    assert "--scheduling-policy" in capsys.readouterr().err


def test_mamba_ssm_cache_dtype(monkeypatch):
    assert engine_config(monkeypatch, []).mamba_ssm_cache_dtype == "auto"
    config = engine_config(monkeypatch, ["--mamba-ssm-cache-dtype", "float32"])
    assert config.mamba_ssm_cache_dtype == "float32"
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        engine_config(monkeypatch, ["--mamba-ssm-cache-dtype", "fp8"])


def test_prefix_state_snapshots(monkeypatch):
    assert engine_config(monkeypatch, []).prefix_state_snapshots is None
    assert engine_config(monkeypatch, ["--prefix-state-snapshots", "8"]).prefix_state_snapshots == 8
    with pytest.raises(ValueError, match="prefix_state_snapshots"):
        engine_config(monkeypatch, ["--prefix-state-snapshots", "-1"])


@pytest.mark.parametrize(
    ("value", "size"),
    [("1000000", 10**6), ("8Gi", 8 * 2**30), ("8G", 8 * 10**9), ("25.6k", 25600), ("2K", 2048)],
)
def test_kv_cache_memory_bytes(monkeypatch, value, size):
    """vLLM's --kv-cache-memory-bytes with its suffixes (SI decimal, IEC binary)."""
    assert (
        engine_config(monkeypatch, ["--kv-cache-memory-bytes", value]).kv_cache_memory_bytes == size
    )


@pytest.mark.parametrize("value", ["1.5Gi", "8 GB", "-1", "x"])
def test_bad_kv_cache_memory_bytes(monkeypatch, capsys, value):
    with pytest.raises(SystemExit):
        engine_config(monkeypatch, ["--kv-cache-memory-bytes", value])
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err
