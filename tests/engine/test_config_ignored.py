"""config_ignored.py's table of config fields transformers never reads: a loaded config (and one
after hf_overrides) carries the value transformers runs with, fields transformers reads keep the
file's value, and every entry matches transformers' own modeling code.

Regressions: EXAONE-MoE's and Kolibri 1 / 1.1's attention_bias (transformers' attention has no
biases) asked for bias weights the checkpoints lack; a table entry serves them as HF runs them.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from config_variant_check import hf_refs, serve_and_compare

from paged_engine.config_ignored import IGNORED_FIELDS, with_effective_fields
from paged_engine.loader import apply_hf_overrides, load_hf_config, resolve_model
from paged_engine.models import MODEL_REGISTRY
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import (  # noqa: E402
    CONFIG_MAPPING_NAMES,
    model_type_to_module_name,
)

# model types transformers lacks (remote-code releases) -> the architecture paged serves them as
REMOTE = {
    "chatglm": "ChatGLMForConditionalGeneration",
    "phi3_v": "Phi3ForCausalLM",  # the text model of Phi3VForCausalLM (models/text_wrappers.py)
    "minimax_text_01": "MiniMaxText01ForCausalLM",
    "minimax_m1": "MiniMaxM1ForCausalLM",
}


def _loaded(tmp_path: Path, arch: str, **fields: Any):
    tiny_config(arch, **fields).save_pretrained(tmp_path)
    return load_hf_config(resolve_model(tmp_path))


# (tiny arch, fields written to config.json, the loaded config's values)
LOADS = {
    "mistral-reads-neither": (
        "mistral",
        {"attention_bias": True, "mlp_bias": True},
        {"attention_bias": False, "mlp_bias": False},
    ),
    # GLM-4's q / k / v read attention_bias (o_proj has none: its layer flags); its MLP never
    "glm4-reads-attention_bias-only": (
        "glm4",
        {"attention_bias": True, "mlp_bias": True},
        {"attention_bias": True, "mlp_bias": False},
    ),
    "helium-reads-mlp_bias": ("helium", {"mlp_bias": True}, {"mlp_bias": True}),
    "lfm2-ignores-attention_bias": ("lfm2", {"attention_bias": True}, {"attention_bias": False}),
    "lfm3-reads-attention_bias": ("lfm3", {"attention_bias": True}, {"attention_bias": True}),
    "glm4_moe-ignores-mlp_bias": ("glm4_moe", {"mlp_bias": True}, {"mlp_bias": False}),
    "llama-reads-both": (
        "llama",
        {"attention_bias": True, "mlp_bias": True},
        {"attention_bias": True, "mlp_bias": True},
    ),
}


@pytest.mark.parametrize("case", list(LOADS))
def test_loaded_config_carries_what_transformers_runs(case: str, tmp_path: Path) -> None:
    arch, written, want = LOADS[case]
    config = _loaded(tmp_path, arch, **written)
    assert {name: getattr(config, name) for name in want} == want


def test_hf_overrides_do_not_turn_on_a_field_transformers_never_reads(tmp_path) -> None:
    both = {"attention_bias": True, "mlp_bias": True}
    exaone4 = apply_hf_overrides(_loaded(tmp_path / "exaone4", "exaone4"), both)
    assert (exaone4.attention_bias, exaone4.mlp_bias) == (False, False)
    llama = apply_hf_overrides(_loaded(tmp_path / "llama", "llama"), both)
    assert (llama.attention_bias, llama.mlp_bias) == (True, True)


def test_config_without_the_field_gets_the_effective_value() -> None:
    config = tiny_config("mixtral")  # MixtralConfig declares no attention_bias
    assert with_effective_fields(config).attention_bias is False


_READS = r"config\.{0}\b|[\"']{0}[\"']"  # config.<field>, getattr(config, "<field>")


def _modeling_source(model_type: str) -> str:
    module = model_type_to_module_name(model_type)
    path = f"transformers.models.{module}.modeling_{module}"
    return inspect.getsource(importlib.import_module(path))


@pytest.mark.parametrize(
    ("model_type", "field"),
    [("helium", "mlp_bias"), ("lfm3", "attention_bias"), ("olmo", "attention_bias")],
)
def test_source_check_sees_a_field_transformers_reads(model_type: str, field: str) -> None:
    assert re.search(_READS.format(field), _modeling_source(model_type))


@pytest.mark.parametrize("model_type", sorted(set(IGNORED_FIELDS) - set(REMOTE)))
def test_table_entry_is_a_field_transformers_never_reads(model_type: str) -> None:
    """The type is transformers', and its modeling code reads none of the entry's fields."""
    assert model_type in CONFIG_MAPPING_NAMES
    source = _modeling_source(model_type)
    for field in IGNORED_FIELDS[model_type]:
        assert not re.search(_READS.format(field), source), (model_type, field)


def test_every_table_type_is_served() -> None:
    """Types transformers lacks are the remote-code releases paged serves by name."""
    assert set(IGNORED_FIELDS) - set(CONFIG_MAPPING_NAMES) == set(REMOTE)
    assert all(arch in MODEL_REGISTRY for arch in REMOTE.values())


@pytest.mark.parametrize("arch", ["exaone_moe", "kolibri1", "kolibri1_1"])
def test_attention_bias_transformers_never_reads_serves_as_hf(arch: str, tmp_path) -> None:
    path = write_tiny_model(tmp_path, arch, seed=1, attention_bias=True)
    prompts, refs = hf_refs(path, (7, 70), max_tokens=4, seed=3)
    serve_and_compare(f"{arch}-attention_bias", path, prompts, refs, max_tokens=4)
