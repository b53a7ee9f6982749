"""Gemma 3n (text) against HF transformers.

`LLM.generate` on a tiny random Gemma 3n in the E2B / E4B layout (tiny_config "gemma3n": AltUp
over 4 streams, Laurel, per-layer inputs over a table smaller than the vocabulary, MLP widths per
layer with two sparse layers, sliding and full layers with their own rope bases, the last two
layers reading earlier layers' KV) gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32), also on prompts with ids past the per-layer table. The released checkpoints are
`Gemma3nForConditionalGeneration` wrappers: served text-only, their language model loads under
the wrapper's names, the towers are dropped, and the vision / audio token ids embed through the
towers' token embedders as HF's wrapper embeds them (its towers need timm, so the reference is
HF's text model fed the embeddings HF's `Gemma3nMultimodalEmbedder` computes). Also: TP=2 gives
the one-process results (the sparse layers' moments summed over both ranks), the Triton backend
the CPU backend's, and pipeline parallelism, an fp8 KV cache and prompt embeddings are refused
by name.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import (
    Greedy,
    assert_matches,
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    engine_greedy,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _randomize, write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma3n")
safetensors_torch = pytest.importorskip("safetensors.torch")

PLE_VOCAB = 480  # tiny_config's vocab_size_per_layer_input: ids 480-511 are the media ids
VISION, AUDIO = (480, 16, 24), (496, 16, 40)  # (vocab_offset, vocab_size, hidden_size)
MAX_TOKENS, TOP = 8, 5


def _prompts(seed: int, n: int, media: bool) -> list[list[int]]:
    """Random prompts; with `media` each holds ids past the per-layer table (vision's and
    audio's ranges)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        p = [rng.randrange(3, PLE_VOCAB) for _ in range(rng.randint(12, 30))]
        if media:
            for _ in range(4):
                p.insert(rng.randrange(len(p)), rng.randrange(PLE_VOCAB, 512))
        prompts.append(p)
    return prompts


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma3n"), "gemma3n", seed=1)


@pytest.fixture(scope="module")
def wrapper_dir(text_dir, tmp_path_factory) -> Path:
    """`text_dir` as a Gemma3nForConditionalGeneration checkpoint: the language model under
    `model.language_model.`, random vision / audio token embedders, stand-in tower tensors."""
    path = tmp_path_factory.mktemp("gemma3n_wrapper")
    for f in text_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    text = json.loads((text_dir / "config.json").read_text())
    fields = ("vocab_offset", "vocab_size", "hidden_size")
    config = transformers.Gemma3nConfig(
        text_config=text,
        vision_config=dict(zip(fields, VISION, strict=True)),
        audio_config=dict(zip(fields, AUDIO, strict=True)),
    )
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(path)
    state = safetensors_torch.load_file(str(text_dir / "model.safetensors"))
    weights = {
        ("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
        for k, v in state.items()
    }
    for name, embedder in _hf_embedders(config, seed=4):
        weights.update({f"model.{name}.{k}": v for k, v in embedder.state_dict().items()})
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.ones(4, 3, 3, 3)
    weights["model.audio_tower.conformer.0.ffw_layer_start.ffw_layer_1.weight"] = torch.ones(8, 8)
    safetensors_torch.save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _hf_embedders(config, seed: int):
    """HF's token embedders of the wrapper `config` (vision, then audio), random weights."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nMultimodalEmbedder

    out = []
    towers = (("embed_vision", config.vision_config), ("embed_audio", config.audio_config))
    for name, tower in towers:
        embedder = Gemma3nMultimodalEmbedder(tower, config.text_config).float()
        with torch.no_grad():
            _randomize(embedder, seed)
        out.append((name, embedder.eval()))
    return out


def _hf_wrapper_greedy(hf, embedders, prompt: list[int]) -> Greedy:
    """HF's wrapper on a text prompt with media ids, as its forward computes it: the text
    embedding, each tower's ids replaced by its embedder's rows, per-layer inputs from the ids."""
    ids, tokens, chosen, tops = list(prompt), [], [], []
    cap = hf.config.final_logit_softcapping
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            t = torch.tensor([ids])
            x = hf.model.embed_tokens(t)
            for k, (_, e) in enumerate(embedders):  # vision's range ends where audio's starts
                mask = t >= e.vocab_offset
                if k + 1 < len(embedders):
                    mask &= t < embedders[k + 1][1].vocab_offset
                rows = e(input_ids=torch.where(mask, t, e.vocab_offset + e.vocab_size - 1))
                x = torch.where(mask.unsqueeze(-1), rows, x)
            per_layer = hf.model.get_per_layer_inputs(t)
            h = hf.model(inputs_embeds=x, per_layer_inputs=per_layer).last_hidden_state
            logits = hf.lm_head(h[0, -1])
            logits = torch.tanh(logits / cap) * cap
            lp = torch.log_softmax(logits.float(), -1)
            token = int(lp.argmax())
            vals, top_ids = lp.topk(TOP)
            tokens.append(token)
            chosen.append(lp[token].item())
            tops.append(dict(zip(top_ids.tolist(), vals.tolist(), strict=True)))
            ids.append(token)
    return Greedy(tokens, chosen, tops)


def _generate(path: Path, prompts: list[list[int]], **kw):
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_tokens_and_logprobs_match_hf(tmp_path):
    assert_tiny_case_matches_hf("gemma3n", "gemma3n", {}, tmp_path)


def test_ids_past_the_per_layer_table_match_hf(text_dir):
    """Ids 480-511 have rows in the token embedding but none in the per-layer one (row 0)."""
    hf = load_hf_model(text_dir)
    prompts = _prompts(5, 2, media=True)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    for out, ref in zip(_generate(text_dir, prompts), refs, strict=True):
        assert_matches("gemma3n", out, ref)


def test_wrapper_text_only_matches_hf(text_dir, wrapper_dir):
    """The wrapper checkpoint gives the results of HF's wrapper embedding (vision and audio ids
    through the towers' token embedders), on prompts of text ids (the continuations reach media
    ids) and on prompts with media ids."""
    hf = load_hf_model(text_dir)
    config = transformers.AutoConfig.from_pretrained(wrapper_dir)
    embedders = _hf_embedders(config, seed=4)
    media_prompts = _prompts(7, 2, media=True)
    prompts = _prompts(6, 2, media=False) + media_prompts
    refs = [_hf_wrapper_greedy(hf, embedders, p) for p in prompts]
    outs = _generate(wrapper_dir, prompts)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("gemma3n-wrapper", out, ref)
    # the text model's own table would give other results on media ids
    plain = _generate(text_dir, media_prompts)
    assert [o.outputs[0].logprobs for o in plain] != [o.outputs[0].logprobs for o in outs[2:]]


def test_tensor_parallel_matches_one_process(text_dir):
    """TP=2: the sparse layers' gate moments over both ranks' halves of the row."""
    assert_tp_matches_one_process(text_dir, _prompts(8, 2, media=True), 6, max_model_len=64)


def test_triton_backend_matches_cpu_backend(text_dir):
    """The Triton kernels (interpreted here) over the KV-shared and sliding layers, prompts in
    chunks: the CPU backend's tokens and logprobs."""
    # 12 + 12 tokens over a 16-token budget: the second prompt in two chunks, both past the
    # sliding window (8); each token is a program of every launch in the interpreter
    prompts = [p[:12] for p in _prompts(9, 2, media=False)]
    kw = {"model": str(text_dir), "max_model_len": 64, "max_num_batched_tokens": 16}
    cpu, triton = (engine_greedy(prompts, 3, attention_backend=b, **kw) for b in ("cpu", "triton"))
    assert_same_greedy(cpu, triton)


def test_kv_cache_holds_only_the_layers_that_compute_kv(text_dir):
    """Layers 4 and 5 read layers 3's and 2's KV: four caches."""
    llm = LLM(model=str(text_dir), dtype="float32", max_model_len=64)
    assert len(llm.llm_engine.model_runner.cache.kv_caches) == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline_parallel_size": 2}, "Gemma 3n does not support pipeline parallelism"),
        ({"kv_cache_dtype": "fp8"}, "fp8 KV cache is not supported"),
        ({"enable_prompt_embeds": True}, "enable_prompt_embeds: .* per-layer embeddings"),
    ],
)
def test_refusals(kwargs, match, text_dir):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(text_dir), dtype="float32", max_model_len=64, **kwargs)
