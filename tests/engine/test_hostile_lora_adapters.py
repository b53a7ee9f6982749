"""Broken or hostile LoRA adapters (lora/adapter.py) are refused when loaded, with a ValueError
naming the adapter and the field, and the request served beside one keeps its tokens.

- `lora_alpha` written as a JSON integer past float's range raised a raw OverflowError.
- An adapter_model.bin that is not a {name: tensor} dict raised a raw AttributeError.
- Weights for a module that adapter_config.json's target_modules / exclude_modules /
  layers_to_transform leave out were served; PEFT builds no LoRA layer there and drops them,
  so the engine's output silently differed from PEFT's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.testing.lora import write_lora_adapter

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = [[5, 6, 7], [8, 9, 10]]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    llm = LLM(
        str(tiny_llama_dir), enable_lora=True, max_lora_rank=8, max_model_len=64, dtype="float32"
    )
    root = tmp_path_factory.mktemp("good")
    good = LoRARequest("good", 1, str(write_lora_adapter(root / "good", tiny_llama_dir, rank=4)))
    yield llm, good, _generate(llm, [good, None])
    llm.llm_engine.shutdown()


def _generate(llm: LLM, loras: list) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _config(change: Callable[[dict], dict | str]) -> Callable[[Path], None]:
    def mutate(path: Path) -> None:
        cfg = change(json.loads((path / "adapter_config.json").read_text()))
        (path / "adapter_config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))

    return mutate


def _alpha_past_float(cfg: dict) -> str:
    return json.dumps({**cfg, "lora_alpha": 0}).replace(
        '"lora_alpha": 0', '"lora_alpha": 1' + "0" * 400
    )


def _bin(obj: object) -> Callable[[Path], None]:
    def mutate(path: Path) -> None:
        (path / "adapter_model.safetensors").unlink()
        torch.save(obj, path / "adapter_model.bin")

    return mutate


_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

BAD = {
    "lora_alpha past float": (_config(_alpha_past_float), "lora_alpha"),
    "tensor not in target_modules": (
        _config(lambda c: {**c, "target_modules": ["q_proj"]}),
        "target_modules",
    ),
    "target_modules regex": (
        _config(lambda c: {**c, "target_modules": r".*\.q_proj"}),
        "target_modules",
    ),
    "exclude_modules": (_config(lambda c: {**c, "exclude_modules": ["v_proj"]}), "v_proj"),
    "layers_to_transform": (_config(lambda c: {**c, "layers_to_transform": [0]}), "layers.1."),
    "bad regex": (_config(lambda c: {**c, "target_modules": "(["}), "target_modules"),
    "layers_to_transform str": (
        _config(lambda c: {**c, "layers_to_transform": "0"}),
        "layers_to_transform",
    ),
    # adapter_model.bin unpickles to any object: these raised AttributeError
    ".bin of a list": (_bin([torch.zeros(2, 64)]), "adapter_model.bin"),
    ".bin of a tensor": (_bin(torch.zeros(2, 64)), "adapter_model.bin"),
    ".bin with an int key": (_bin({5: torch.zeros(2, 64)}), "adapter_model.bin"),
    ".bin with int values": (_bin({_Q_A: 3, _Q_A.replace("_A", "_B"): 4}), "adapter_model.bin"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused_and_the_other_request_keeps_its_tokens(
    case: str, setup, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    llm, good, ref = setup
    mutate, fragment = BAD[case]
    path = write_lora_adapter(tmp_path / "bad", tiny_llama_dir, rank=2, seed=1)
    mutate(path)
    bad = LoRARequest("bad", 7, str(path))
    with pytest.raises(ValueError, match="lora_request: the adapter at") as info:
        _generate(llm, [good, bad])
    assert fragment in str(info.value), str(info.value)
    assert 7 not in llm.llm_engine.list_loras()
    assert _generate(llm, [good, None]) == ref


def _as_bin(path: Path) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    _bin(tensors)(path)


GOOD = {  # legal forms PEFT loads every tensor of: served like the plain adapter
    "target_modules names a module the model lacks": _config(
        lambda c: {**c, "target_modules": [*c["target_modules"], "nonexistent_proj"]}
    ),
    "no target_modules": _config(lambda c: {k: v for k, v in c.items() if k != "target_modules"}),
    "target_modules regex of all": _config(lambda c: {**c, "target_modules": r".*_proj"}),
    "layers_to_transform all": _config(lambda c: {**c, "layers_to_transform": [0, 1]}),
    "adapter_model.bin": _as_bin,
}


@pytest.mark.parametrize("case", list(GOOD))
def test_consistent_adapter_forms_are_served(
    case: str, setup, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    llm, good, ref = setup
    plain = write_lora_adapter(tmp_path / "plain", tiny_llama_dir, rank=2, seed=1)
    variant = write_lora_adapter(tmp_path / "variant", tiny_llama_dir, rank=2, seed=1)
    GOOD[case](variant)
    want = _generate(llm, [good, LoRARequest("plain", 8, str(plain))])
    got = _generate(llm, [good, LoRARequest("variant", 9, str(variant))])
    assert got == want and got[0] == ref[0]
    assert want[1] != ref[1]  # the adapter changes the tokens
