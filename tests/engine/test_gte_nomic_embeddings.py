"""GTE (models/gte.py), Nomic BERT (models/nomic_bert.py) and jina-embeddings-v3
(models/jina_embeddings_v3.py) rotary encoders against transformers' GteModel / NomicBertModel /
JinaEmbeddingsV3Model (and their sequence classifiers) on the same weights, as transformers saves
them and as the Hub's remote-code releases name their configs and tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from torch.nn.functional import normalize

from paged_engine import LLM, PoolingParams
from paged_engine.testing import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

PROMPTS = [
    [BOS_ID, *range(5, 40), EOS_ID],
    [BOS_ID, 5, 6, 7, EOS_ID],
    [BOS_ID, *range(50, 71), EOS_ID],
]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 64}
BASE, NTK = 1000.0, 2.0  # GTE's Hub rope: theta and its fixed NTK factor
HEAD_DIM = 8  # hidden 32 over 4 heads


def write_tiny(path: Path, arch: str, **overrides) -> Path:
    """A tiny random transformers `arch` checkpoint (Hub tensor names) with the tiny tokenizer."""
    family = arch.split("For")[0].removesuffix("Model")  # Gte, NomicBert, JinaEmbeddingsV3
    kwargs = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "max_position_embeddings": 128,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        **overrides,
    }
    config = getattr(transformers, f"{family}Config")(**kwargs)
    config.architectures = [arch]
    _save_random(getattr(transformers, arch), config, 0, path)
    build_tiny_tokenizer(config.vocab_size, 0).save_pretrained(path)
    return path


def as_release(src: Path, dst: Path, config: dict, prefix: tuple[str, str] | None = None) -> Path:
    """`src`'s weights and tokenizer under the release's config.json (and backbone prefix)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if prefix is not None:
        tensors = load_file(dst / "model.safetensors")
        old, new = prefix
        renamed = {
            (new + k.removeprefix(old) if k.startswith(old) else k): v for k, v in tensors.items()
        }
        save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def new_config(arch: str, **extra) -> dict:
    """Alibaba-NLP/new-impl's config.json fields for the tiny model."""
    return {
        "architectures": [arch],
        "model_type": "new",
        "auto_map": {"AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"},
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "hidden_act": "gelu",
        "max_position_embeddings": 128,
        "type_vocab_size": 0,
        "layer_norm_eps": 1e-12,
        "position_embedding_type": "rope",
        "rope_theta": BASE,
        "rope_scaling": {"type": "ntk", "factor": NTK},
        "layer_norm_type": "layer_norm",
        "pack_qkv": True,
        "logn_attention_scale": False,
        "pad_token_id": PAD_ID,
        **extra,
    }


def nomic_release_config(**extra) -> dict:
    """nomic-embed-text-v1.5's config.json fields (GPT-2 names) for the tiny model."""
    return {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "activation_function": "swiglu",
        "vocab_size": TINY_VOCAB_SIZE - 12,  # padded to a multiple of 64, as the release
        "pad_vocab_size_multiple": 64,
        "n_embd": 32,
        "n_head": 4,
        "n_layer": 2,
        "n_inner": 48,
        "n_positions": 128,
        "layer_norm_epsilon": 1e-12,
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "type_vocab_size": 2,
        "matryoshka_dimensions": [32, 16, 8],
        **extra,
    }


# the fixed NTK rope as transformers' "linear" rope: theta base * s, frequencies / s^(2/d)
NTK_AS_LINEAR = {
    "rope_type": "linear",
    "rope_theta": BASE * NTK,
    "factor": NTK ** (2 / HEAD_DIM),
}


def hf_hidden(path: Path, arch: str, ids: list[int]) -> torch.Tensor:
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("kind", ["gte", "gte-release", "nomic", "nomic-release"])
def test_embeddings_match_hf(tmp_path, kind) -> None:
    if kind.startswith("gte"):
        arch = "GteModel"
        extra = (
            {"rope_parameters": NTK_AS_LINEAR, "type_vocab_size": 0} if "release" in kind else {}
        )
        path = ref = write_tiny(tmp_path / "hf", arch, **extra)
        if "release" in kind:
            path = as_release(ref, tmp_path / "new", new_config("NewModel"))
    else:
        arch = "NomicBertModel"
        path = ref = write_tiny(tmp_path / "hf", arch)
        if "release" in kind:
            path = as_release(ref, tmp_path / "nomic", nomic_release_config())
    model = getattr(transformers, arch).from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    # a small token budget: several steps, each sequence whole in one
    llm = LLM(model=str(path), max_num_batched_tokens=64, **KW)
    assert llm.llm_engine.config.enable_chunked_prefill is False
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, hidden):  # default: [CLS], normalized (vLLM's choice)
        assert out.outputs.embedding == pytest.approx(normalize(h[0], dim=-1).tolist(), abs=1e-4)
    raw = PoolingParams(normalize=False)
    mean = LLM(model=str(path), pooler_config={"pooling_type": "MEAN"}, **KW)
    for out, h in zip(mean.embed(PROMPTS, use_tqdm=False, pooling_params=raw), hidden):
        assert out.outputs.embedding == pytest.approx(h.mean(0).tolist(), abs=1e-4)
    # the first 6 tokens alone (a pooling runner truncates on the right, as vLLM's)
    cut = mean.embed(PROMPTS[:1], use_tqdm=False, pooling_params=raw, truncate_prompt_tokens=6)
    want = hf_hidden(ref, arch, PROMPTS[0][:6]).mean(0)
    assert cut[0].outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    if kind == "gte-release":  # gte-multilingual-base's config names its sparse-weight head
        multi = as_release(ref, tmp_path / "multi", new_config("NewForTokenClassification"))
        as_model = LLM(model=str(multi), hf_overrides={"architectures": ["GteNewModel"]}, **KW)
        got = as_model.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding
        assert got == pytest.approx(normalize(hidden[0][0], dim=-1).tolist(), abs=1e-4)
    if kind == "nomic-release":  # v1.5's Matryoshka sizes carry over from config.json
        small = mean.embed(PROMPTS[:1], use_tqdm=False, pooling_params=PoolingParams(dimensions=8))
        assert small[0].outputs.embedding == pytest.approx(
            normalize(hidden[0].mean(0)[:8], dim=-1).tolist(), abs=1e-4
        )
        with pytest.raises(ValueError, match="dimensions"):
            mean.embed(PROMPTS[:1], use_tqdm=False, pooling_params=PoolingParams(dimensions=12))


RERANKERS = {
    "gte": "GteForSequenceClassification",
    "gte-release": "GteForSequenceClassification",
    "nomic": "NomicBertForSequenceClassification",
    "jina": "JinaEmbeddingsV3ForSequenceClassification",
}


@pytest.mark.parametrize("kind", list(RERANKERS))
def test_rerankers_match_hf(tmp_path, kind) -> None:
    arch = RERANKERS[kind]
    path = ref = write_tiny(tmp_path / "hf", arch, num_labels=1)
    if kind == "gte-release":  # gte-multilingual-reranker-base: the backbone under `new.`
        config = new_config("NewForSequenceClassification", num_labels=1, type_vocab_size=1)
        del config["rope_scaling"]  # the multilingual releases: no rope scaling
        config["rope_theta"] = 160000.0  # transformers' default theta, as ref was written
        path = as_release(ref, tmp_path / "new", config, prefix=("gte.", "new."))
    model = getattr(transformers, arch).from_pretrained(ref, dtype=torch.float32).eval()
    llm = LLM(model=str(path), **KW)
    first, second = [BOS_ID, 10, 11, EOS_ID], [12, 13, 14, 15, EOS_ID]
    got = llm.score([first], [second], use_tqdm=False)[0]
    with torch.no_grad():
        want = model(torch.tensor([got.prompt_token_ids])).logits[0, 0].sigmoid().item()
    assert got.prompt_token_ids == first + second
    assert got.outputs.score == pytest.approx(want, abs=1e-4)
    off = PoolingParams(use_activation=False)
    for out, p in zip(llm.classify(PROMPTS, use_tqdm=False, pooling_params=off), PROMPTS):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0]
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-4)


def test_release_variants_paged_does_not_run_are_refused_by_name(tmp_path) -> None:
    gte = write_tiny(tmp_path / "gte", "GteModel")
    nomic = write_tiny(tmp_path / "nomic", "NomicBertModel")
    cases = [
        (
            gte,
            new_config("NewModel", rope_scaling={"type": "dynamic", "factor": 2.0}),
            "rope_scaling",
        ),
        (gte, new_config("NewModel", logn_attention_scale=True), "logn_attention_scale"),
        (nomic, nomic_release_config(rotary_emb_interleaved=True), "rotary_emb_interleaved"),
        (nomic, nomic_release_config(rotary_emb_fraction=0.5), "rotary_emb_fraction"),
        (nomic, nomic_release_config(qkv_proj_bias=True), "qkv_proj_bias"),
        (nomic, nomic_release_config(moe_every_n_layers=2), "moe_every_n_layers"),
    ]
    for i, (src, config, name) in enumerate(cases):
        with pytest.raises(ValueError, match=name):
            LLM(model=str(as_release(src, tmp_path / f"bad{i}", config)), **KW)
    yarn = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 2.0}
    bad = as_release(
        gte,
        tmp_path / "yarn",
        {**json.loads((gte / "config.json").read_text()), "rope_parameters": yarn},
    )
    with pytest.raises(ValueError, match="rope_parameters"):
        LLM(model=str(bad), **KW)


TASKS = ["retrieval.query", "text-matching"]


def as_jina_release(src: Path, dst: Path, seed: int = 1) -> Path:
    """`src` (transformers' JinaEmbeddingsV3Model) as the Hub release: under `roberta.`, each
    linear / embedding weight split into an `original` and per-task LoRA factors whose
    text-matching adapter merges back to `src`'s weight."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, w in load_file(dst / "model.safetensors").items():
        if w.ndim != 2:
            out[f"roberta.{name}"] = w
            continue
        base = f"roberta.{name.removesuffix('.weight')}.parametrizations.weight"
        rows, cols = w.shape
        if "embeddings" in name:  # A [tasks, vocab, r], B [tasks, r, dim]: delta = A @ B
            a, b = torch.randn(2, rows, 4, generator=gen), torch.randn(2, 4, cols, generator=gen)
            delta = a[1] @ b[1]
        else:  # A [tasks, r, in], B [tasks, out, r]: delta = B @ A
            a, b = torch.randn(2, 4, cols, generator=gen), torch.randn(2, rows, 4, generator=gen)
            delta = b[1] @ a[1]
        out[f"{base}.original"] = w - delta / 4  # scale lora_alpha / lora_rank = 1 / 4
        out[f"{base}.0.lora_A"], out[f"{base}.0.lora_B"] = a, b
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    release = {
        "architectures": ["XLMRobertaModel"],
        "model_type": "xlm-roberta",
        "position_embedding_type": "rotary",
        "rotary_emb_base": 20000.0,
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "hidden_act": "gelu",
        "max_position_embeddings": 128,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "lora_adaptations": TASKS,
        "lora_rank": 4,
        "lora_alpha": 1,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    (dst / "config.json").write_text(json.dumps(release))
    return dst


@pytest.mark.parametrize("release", [False, True])
def test_jina_v3_embeddings_match_hf(tmp_path, release) -> None:
    arch = "JinaEmbeddingsV3Model"
    path = ref = write_tiny(tmp_path / "hf", arch, type_vocab_size=1)
    if release:
        path = as_jina_release(ref, tmp_path / "release")
    hidden = [hf_hidden(ref, arch, p) for p in PROMPTS]
    llm = LLM(model=str(path), pooler_config={"pooling_type": "MEAN", "normalize": True}, **KW)
    for out, h in zip(llm.embed(PROMPTS, use_tqdm=False), hidden):
        want = normalize(h.mean(0), dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    if release:  # another task's adapter gives other weights; an unknown task is refused
        query = LLM(model=str(path), hf_overrides={"lora_task": "retrieval.query"}, **KW)
        got = query.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding
        assert got != pytest.approx(normalize(hidden[0][0], dim=-1).tolist(), abs=1e-2)
        with pytest.raises(ValueError, match="lora_task"):
            LLM(model=str(path), hf_overrides={"lora_task": "classification"}, **KW)
