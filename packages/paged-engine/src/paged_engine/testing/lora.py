"""Random LoRA adapters in PEFT's format for a tiny model, and merging one into the HF model
(the reference an adapter's outputs are compared with)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_target_layers(model: torch.nn.Module, targets: tuple[str, ...]):
    """(name, in, out, conv1d) of the HF model's linear layers whose last name part is a target
    (GPT-2's Conv1D layers store their weight as [in, out])."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        if isinstance(module, torch.nn.Linear):
            found.append((name, module.in_features, module.out_features, False))
        elif type(module).__name__ == "Conv1D":
            found.append((name, module.weight.shape[0], module.weight.shape[1], True))
    return found


def _lora_shape_model(model_dir: Path) -> torch.nn.Module:
    """The HF model of `model_dir`, for its layer names and shapes: loaded when the dir has
    weights, else built from config.json on the meta device (no memory, any size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir {model_dir} has no config.json")
    weights = [*model_dir.glob("*.safetensors"), *model_dir.glob("pytorch_model*.bin")]
    if weights:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def write_lora_adapter(
    path: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: tuple[str, ...] = LORA_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) with
    random A and B for the HF model in `model_dir` (B is not zero, unlike a fresh PEFT adapter,
    so the adapter changes the outputs). `model_dir` may hold only config.json (a
    `load_format="dummy"` model): layer names and shapes then come from the model built on the
    meta device, which allocates no weights."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = _lora_shape_model(Path(model_dir))
    layers = _lora_target_layers(model, tuple(target_modules))
    if not layers:
        raise ValueError(f"no layer of {type(model).__name__} matches {target_modules}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, n_in, n_out, _ in layers:
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * n_in**-0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * rank**-0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n, *_ in layers}),
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": any(conv for *_, conv in layers),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


@torch.no_grad()
def merge_lora_adapter(model: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """Add an adapter's scale * B @ A to the weights of an HF model (the reference a LoRA
    engine must match: W' = W + scale * B A, or its transpose for GPT-2's Conv1D)."""
    from paged_engine.lora.adapter import read_peft_adapter

    adapter = read_peft_adapter(str(adapter_dir), max_rank=1 << 16)
    modules = dict(model.named_modules())
    for name, lm in adapter.modules.items():
        layer = modules[name]
        delta = lm.scale * (lm.b.double() @ lm.a.double())
        if type(layer).__name__ == "Conv1D":
            delta = delta.t()
        layer.weight += delta.to(layer.weight.dtype)
    return model
