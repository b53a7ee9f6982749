"""Checkpoints whose tensors contradict config.json's `tie_word_embeddings=True`, served as
transformers 5 loads them (tied_weights.py): both tensors with other values -> untied; equal
values -> tied, one tensor; only the head -> tied, the embedding taking the head's values;
neither -> refused by name (HF: random values).

Each case is an untied tiny checkpoint (Llama; Gemma, whose embedding is scaled by
sqrt(hidden); VLM wrappers served text-only: LLaVA around Llama, Gemma 3, Qwen2-VL, InternVL
around Qwen2, their config.json tying by its top-level flag) rewritten: config.json ties,
model.safetensors holds the case's tensors. HF's `from_pretrained` of the same directory (the
wrapper's *ForConditionalGeneration) is the reference (greedy tokens, top-5 logprobs).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_parity import assert_serves_like_hf, checkpoint_dirs, load_hf_as_saved, write_hf_checkpoint
from hf_reference import assert_tp_matches_one_process, random_token_prompts
from safetensors.torch import load_file, save_file
from test_config_variants_nested import _gemma3, _internvl, _llava, _prompts, _qwen_vl

from paged_engine import LLM, SamplingParams
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.testing import write_tiny_model
from paged_engine.tied_weights import same_values

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
FAMILIES = ("llama", "gemma")
# wrapper -> its builder with a head of its own
WRAPPERS = {
    "llava-llama": lambda: _llava("Llava", "llama", {}, tie_word_embeddings=False),
    "gemma3": lambda: _gemma3({}, tie_word_embeddings=False),
    "qwen2_vl": lambda: _qwen_vl("2", {}, {"mrope_section": [2, 3, 3]}, tie_word_embeddings=False),
    "internvl-qwen2": lambda: _internvl("qwen2", {}, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> dict[str, Path]:
    """family -> a tiny checkpoint with its own (random, different) embedding and head."""
    return {
        f: write_tiny_model(tmp_path_factory.mktemp(f), f, tie_word_embeddings=False, seed=3)
        for f in FAMILIES
    }


def embed_and_head(tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    """The checkpoint names of the token embedding and the head (a wrapper's as transformers
    saved them: `language_model.model.` / `language_model.lm_head.` for LLaVA, say)."""
    (embed,) = (n for n in tensors if n.endswith("embed_tokens.weight"))
    (head,) = (n for n in tensors if n.endswith(HEAD))
    return embed, head


def tied_case(src: Path, dst: Path, case: str) -> Path:
    """`src` copied to `dst` with config.json tying the head (its top-level flag) and
    model.safetensors holding `case`'s tensors: "differ" (both, as written), "equal" (the head
    a copy of the embedding), "head_only", "neither"."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    embed, head = embed_and_head(tensors)
    if case == "equal":
        tensors[head] = tensors[embed].clone()  # equal values, storage of its own
    elif case == "head_only":
        del tensors[embed]
    elif case == "neither":
        del tensors[embed], tensors[head]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return dst


def paged_model(path: Path) -> torch.nn.Module:
    resolved = resolve_model(str(path))
    config = load_hf_config(resolved)
    return load_model(resolved, config, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("case", ["differ", "equal", "head_only"])
@pytest.mark.parametrize("family", FAMILIES)
def test_serves_as_transformers_loads(untied, tmp_path, family, case):
    path = tied_case(untied[family], tmp_path / case, case)
    hf = load_hf_as_saved(path)
    ckpt = load_file(untied[family] / "model.safetensors")
    # what transformers 5 made of it (the reference's premise)
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied == (case != "differ")
    want_head = ckpt[EMBED] if case == "equal" else ckpt[HEAD]
    assert torch.equal(hf.lm_head.weight, want_head)
    assert_serves_like_hf(f"{family}/{case}", path, random_token_prompts(family, 2), hf=hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_tying_follows_the_checkpoint(untied, tmp_path, family, caplog):
    ckpt = load_file(untied[family] / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="paged_engine.tied_weights"):
        model = paged_model(tied_case(untied[family], tmp_path / "differ", "differ"))
    assert "NOT tied" in caplog.text
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not model.tie_word_embeddings and not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, ckpt[HEAD])
    assert torch.equal(model.model.embed_tokens.weight, ckpt[EMBED])

    model = paged_model(tied_case(untied[family], tmp_path / "equal", "equal"))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # no second copy
    assert model.tie_word_embeddings

    model = paged_model(tied_case(untied[family], tmp_path / "head_only", "head_only"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, ckpt[HEAD])


@pytest.mark.parametrize("family", FAMILIES)
def test_neither_tensor_is_refused(untied, tmp_path, family):
    path = tied_case(untied[family], tmp_path / "neither", "neither")
    with pytest.raises(ValueError, match=r"missing weights model\.embed_tokens\.weight"):
        paged_model(path)


@pytest.mark.parametrize("case", ["differ", "head_only"])
def test_tensor_parallel_matches_one_process(untied, tmp_path, case):
    """Each rank decides alike (the whole tensors compared) and loads its head shard."""
    path = tied_case(untied["llama"], tmp_path / case, case)
    assert_tp_matches_one_process(path, random_token_prompts(case, 2), 6, 64)


@pytest.mark.parametrize("shared", [False, True])
def test_bin_checkpoint(untied, tmp_path, shared):
    """A pytorch_model.bin holding both tensors: torch.save writes a tied pair as one storage
    (tied, nothing compared); two storages of other values untie."""
    path = tied_case(untied["llama"], tmp_path / "bin", "differ")
    tensors = load_file(path / "model.safetensors")
    if shared:
        tensors[HEAD] = tensors[EMBED]
    torch.save(tensors, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    model = paged_model(path)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == shared
    assert torch.equal(model.lm_head.weight, tensors[HEAD])


def test_reload_keeps_the_untied_head(untied, tmp_path):
    """An untied head takes updates of its own; reload_weights (the worker's config, flipped
    at load) reloads both tensors."""
    path = tied_case(untied["llama"], tmp_path / "differ", "differ")
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": random_token_prompts("reload", 1)[0]}

    def tokens() -> list[int]:
        llm.reset_prefix_cache()
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    before = tokens()
    embed = load_file(path / "model.safetensors")[EMBED]
    # the embedding as the head: the tokens of the (wrong) tied model
    assert llm.collective_rpc("update_weights", args=([(HEAD, embed)],)) == [1]
    assert tokens() != before
    llm.collective_rpc("reload_weights")
    assert tokens() == before


def test_same_values_compares_in_the_model_dtype():
    a = torch.randn(5000, 8)  # more rows than one comparison chunk
    b = a.clone()
    assert same_values(a, b, torch.float32)
    b[4999, 7] += 1e-6 * max(1.0, abs(b[4999, 7].item()))  # below bfloat16's precision
    assert not same_values(a, b, torch.float32)
    assert same_values(a, b, torch.bfloat16)
    assert same_values(a, a.view(5000, 8), torch.float32)  # one storage: nothing read
    assert not same_values(a, a[:, :4], torch.float32)
    codes = torch.randint(0, 255, (4, 4), dtype=torch.uint8)
    assert same_values(codes, codes.clone(), torch.bfloat16)
    assert not same_values(codes, codes.to(torch.int8), torch.bfloat16)


@pytest.fixture(scope="module")
def untied_wrappers(tmp_path_factory) -> Callable[[str], Path]:
    """wrapper -> a tiny random wrapper checkpoint with its own head, as transformers saves it."""
    return checkpoint_dirs(
        tmp_path_factory, lambda path, name: write_hf_checkpoint(path, *WRAPPERS[name](), seed=3)
    )


@pytest.mark.parametrize("case", ["differ", "equal", "head_only"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_serves_as_transformers_loads(untied_wrappers, tmp_path, wrapper, case):
    """A wrapper served text-only decides on its language model's tensors as a causal LM does
    (not by whether the checkpoint names a head at all)."""
    src = untied_wrappers(wrapper)
    path = tied_case(src, tmp_path / case, case)
    hf = load_hf_as_saved(path)
    ckpt = load_file(src / "model.safetensors")
    embed, head = embed_and_head(ckpt)
    hf_embed = hf.get_input_embeddings().weight
    assert (hf.lm_head.weight is hf_embed) == (case != "differ")  # the reference's premise
    assert torch.equal(hf.lm_head.weight, ckpt[embed if case == "equal" else head])
    llm = assert_serves_like_hf(f"{wrapper}/{case}", path, _prompts(wrapper), hf=hf)
    model = llm.llm_engine.model_runner.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (case != "differ")
    assert model.tie_word_embeddings == (case != "differ")
    if case == "head_only":
        assert torch.equal(model.model.embed_tokens.weight, ckpt[head])


def test_wrapper_neither_tensor_is_refused(untied_wrappers, tmp_path):
    path = tied_case(untied_wrappers("llava-llama"), tmp_path / "neither", "neither")
    with pytest.raises(ValueError, match=r"missing weights model\.embed_tokens\.weight"):
        paged_model(path)


@pytest.mark.parametrize("hf_weights_beside", [True, False])
def test_wrapper_mistral_consolidated_head(tmp_path, hf_weights_beside):
    """Mistral Small 3.x's repo: a config.json without a top-level flag (Mistral3Config reads
    it as tied) beside consolidated weights holding a head of other values, loaded with
    load_format="mistral": that head is served, as transformers serves the HF weights' head."""
    import transformers
    from test_mistral_format_vision import write_hf, write_native

    hf_dir = write_hf(tmp_path / "hf", "mistral3")
    tensors = load_file(hf_dir / "model.safetensors")
    embed, head = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"
    assert head not in tensors  # tied when written
    tensors[head] = torch.randn_like(tensors[embed])
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    del config["tie_word_embeddings"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    native = write_native(hf_dir, tmp_path / "native")
    shutil.copy(hf_dir / "config.json", native)
    if hf_weights_beside:
        shutil.copy(hf_dir / "model.safetensors", native)
    hf = load_hf_as_saved(hf_dir)
    assert hf.lm_head.weight is not hf.get_input_embeddings().weight  # the premise

    assert transformers.AutoConfig.from_pretrained(native).tie_word_embeddings  # the flag
    resolved = resolve_model(str(native))
    text = load_hf_config(resolved)
    model = load_model(resolved, text, dtype=torch.float32, device="cpu", load_format="mistral")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors[head])
    assert torch.equal(model.model.embed_tokens.weight, tensors[embed])
