"""sentence-transformers' Dense modules: the projections an embedding model's `modules.json`
lists after its Pooling module (EmbeddingGemma's 2_Dense 768 -> 3072 and 3_Dense 3072 -> 768,
LaBSE's tanh Dense), applied to every embedding after pooling and before the Normalize module.

    modules.json: [{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}, ...]
        (sentence-transformers >= 5.4: "sentence_transformers.base.modules.dense.Dense")
    2_Dense/config.json: in_features, out_features, bias (default true), activation_function
    2_Dense/model.safetensors (or pytorch_model.bin): linear.weight [out, in], linear.bias

As vLLM (`try_get_dense_modules` and `_load_st_projector`): the Dense modules run in the order
modules.json lists them, each `act(x @ W.T + b)` in float32, on the pooled vector of an `embed`
request and on every row of a `token_embed` one, before the Matryoshka cut and the
normalization. The activations run are vLLM's for `torch.nn.modules.*` names: Identity, Tanh,
ReLU, GELU (erf), SiLU, Sigmoid; any other (a custom class, or none named) is refused by name,
and so are a missing weight file, a shape that disagrees with the config, and a chain whose
widths do not follow on from the pooled hidden size (vLLM skips such layers; the embeddings
would differ), NaN or inf in the weights.

modules.json itself is read here for every reader (`st_modules`): a list of objects whose
`type` and `path` are strings, each path inside the model directory, else ValueError naming
the entry and field; `check_st_modules` refuses a module paged does not run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# a Dense module's `type`: as sentence-transformers < 5.4 writes it, and as later versions do
DENSE = ("sentence_transformers.models.Dense", "sentence_transformers.base.modules.dense.Dense")
# sentence-transformers modules (their `type`'s last part) paged runs as they are written
ST_SERVED = ("Transformer", "Pooling", "Dense", "Normalize")
_TORCH_MODULES = "torch.nn.modules."
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "tanh": torch.tanh,
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}


def st_modules(model_dir: Path) -> list[dict]:
    """modules.json's entries ([] without the file); ValueError naming the file and field when
    it is not what sentence-transformers reads: a list (or vLLM's {"modules": [...]}) of
    objects, each with a `type` and a `path` relative to the model directory, inside it."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"modules.json cannot be read ({error})") from None
    shape = type(modules).__name__
    if isinstance(modules, dict):  # the shape vLLM also reads: {"modules": [...]}
        modules, shape = modules.get("modules"), 'object without a "modules" list'
    if not isinstance(modules, list):
        raise ValueError(f"modules.json: expected a list of modules, got {shape}")
    for i, entry in enumerate(modules):
        if not isinstance(entry, dict):
            raise ValueError(f"modules.json[{i}]: expected an object, got {entry!r}")
        for key in ("type", "path"):
            if not isinstance(entry.get(key), str):
                raise ValueError(
                    f"modules.json[{i}].{key}: expected a string, got {entry.get(key)!r}"
                )
        folder = Path(entry["path"])
        if folder.is_absolute() or ".." in folder.parts:
            raise ValueError(
                f"modules.json[{i}].path={entry['path']!r}: a module's folder must lie inside "
                "the model directory"
            )
    return modules


def check_st_modules(model_dir: Path | None, arch: str) -> None:
    """ValueError naming a module of modules.json that paged does not run (its embeddings
    would differ): only Transformer, Pooling, Dense and Normalize are."""
    if model_dir is None:
        return
    for module in st_modules(model_dir):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in ST_SERVED or (kind == "Dense" and module["type"] not in DENSE):
            raise ValueError(
                f"{arch}: modules.json lists sentence-transformers module {module['type']!r}"
                f" ({module['path']}), which paged does not run: its embeddings would "
                f"differ; only {list(ST_SERVED)} are supported"
            )


class DenseLayer(nn.Module):
    """One Dense module: act(x @ W.T + b), float32; `where` names it in errors."""

    def __init__(self, where: str, config: dict, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.where = where
        self.register_buffer("weight", weight.float())  # [out, in]
        self.register_buffer("bias", None if bias is None else bias.float())
        self.act = _activation(where, config.get("activation_function"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.act(F.linear(x, self.weight, self.bias))


class DenseStack(nn.Module):
    """The Dense modules in modules.json's order: [N, hidden] -> [N, out_features]."""

    def __init__(self, layers: list[DenseLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.out_features = int(layers[-1].weight.shape[0])

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def project(self, rows: list[list[float]]) -> list[list[float]]:
        """The host's form (pooling.py keeps embeddings as lists of floats)."""
        return self(torch.tensor(rows, dtype=torch.float32)).tolist()


def load_dense_stack(model_dir: Path | None, hidden_size: int) -> DenseStack | None:
    """The Dense modules of the sentence-transformers files in `model_dir` (None: none listed);
    ValueError naming the file and field paged cannot run exactly."""
    if model_dir is None:
        return None
    entries = [m for m in st_modules(model_dir) if m["type"] in DENSE]
    layers: list[DenseLayer] = []
    width = hidden_size  # what the pooling hands the first Dense module
    for entry in entries:
        folder = entry["path"]
        where = f"{folder or '.'}/config.json"
        try:
            config = json.loads((model_dir / folder / "config.json").read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{where}: a Dense module's config cannot be read ({error})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{where}: expected an object, got {type(config).__name__}")
        n_in, n_out = config.get("in_features"), config.get("out_features")
        if n_in != width or not isinstance(n_out, int) or n_out < 1:
            raise ValueError(
                f"{where}: in_features={n_in!r}, out_features={n_out!r}: this Dense module "
                f"takes the {width} values before it"
            )
        weight, bias = _dense_weights(model_dir / folder, where, bool(config.get("bias", True)))
        if tuple(weight.shape) != (n_out, n_in) or (bias is not None and bias.shape != (n_out,)):
            raise ValueError(
                f"{where}: the weights' shapes {tuple(weight.shape)} do not match "
                f"in_features={n_in}, out_features={n_out}"
            )
        if not all(bool(t.isfinite().all()) for t in (weight, bias) if t is not None):
            raise ValueError(f"{where}: the Dense module's weights hold NaN or inf values")
        layers.append(DenseLayer(where, config, weight, bias))
        width = n_out
    return DenseStack(layers) if layers else None


def _activation(where: str, name: object) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's reading of a `torch.nn.modules.*` class name (the last part, lower case)."""
    key = name.lower().rsplit(".", 1)[-1] if isinstance(name, str) else None
    if not (isinstance(name, str) and name.startswith(_TORCH_MODULES)) or key not in _ACTIVATIONS:
        raise ValueError(
            f"{where}: activation_function={name!r} is not supported; paged runs "
            f"{_TORCH_MODULES}<Identity | Tanh | ReLU | GELU | SiLU | Sigmoid> (vLLM's)"
        )
    return _ACTIVATIONS[key]


def _dense_weights(
    folder: Path, where: str, bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`linear.weight` / `linear.bias` (or vLLM's other spellings: no prefix, `dense.`) from
    the module's model.safetensors, else its pytorch_model.bin."""
    state: dict[str, torch.Tensor] | None = None
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if state is None:
        raise ValueError(f"{where}: no model.safetensors or pytorch_model.bin beside it")
    for prefix in ("linear.", "", "dense."):
        if prefix + "weight" in state:
            b = state.get(prefix + "bias")
            if bias and b is None:
                raise ValueError(f"{where}: bias=true, but its weights have no {prefix}bias")
            return state[prefix + "weight"], b if bias else None
    raise ValueError(f"{where}: its weights have no linear.weight")
