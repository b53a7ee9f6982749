"""Apertus 1.5 (text) against HF transformers.

`LLM.generate` on a tiny random Apertus 1.5 (tiny_config "apertus1p5": Apertus' xIELU MLP,
q / k norms and Llama 3 rope, an LM head pruned to the first 383 of 512 ids) gives HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on prompts holding ids past the
pruned head (they embed by the full table); with a tied head (transformers ties the whole
embedding) it matches too. The released `Apertus1p5ForConditionalGeneration` checkpoints
(tiny: real random image and audio tokenizers) serve their language model text-only and match
HF's wrapper on prompts with image / audio code ids and the placeholders; images and audio are
refused. Also: the pruned ids are never sampled and score -inf, TP=2 gives the one-process
results (the 383 head rows split unevenly), and a bad `output_vocab_size` is refused by name.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import (
    _COMMON,
    _save_random,
    build_tiny_tokenizer,
    tiny_config,
    write_tiny_model,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.apertus1p5")

HEAD_ROWS = 383  # tiny_config's output_vocab_size
# the wrapper's vocabulary: text below 384, image codes 384-447, audio codes 448-511
IMAGE_OFFSET, AUDIO_OFFSET, CODEBOOK = 384, 448, 64
IMAGE_ID, AUDIO_ID = 5, 6  # placeholder ids (embed as their own rows without media)
MAX_TOKENS, TOP = 8, 5


def _engine(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **kw)


def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("apertus1p5"), "apertus1p5", seed=1)


@pytest.fixture(scope="module")
def wrapper_dir(tmp_path_factory) -> Path:
    """A tiny random Apertus1p5ForConditionalGeneration checkpoint: the tiny text model, a
    one-stage image tokenizer and a WavTokenizer encoder whose codes fill the vocabulary."""
    path = tmp_path_factory.mktemp("apertus1p5_wrapper")
    config = transformers.Apertus1p5Config(
        text_config=tiny_config("apertus1p5").to_dict(),
        vision_config={
            "codebook_size": CODEBOOK,
            "embed_dim": 8,
            "latent_channels": 8,
            "base_channels": 32,
            "channel_multiplier": [1, 1],
            "num_res_blocks": 1,
            "attn_resolutions": [],
            "resolution": 32,
        },
        audio_config={
            "model_type": "wavtokenizer_encoder",
            "num_filters": 8,
            "upsampling_ratios": [2, 2],
            "hidden_size": 16,
            "codebook_size": CODEBOOK,
            "codebook_dim": 16,
            "num_lstm_layers": 1,
        },
        image_token_id=IMAGE_ID,
        audio_token_id=AUDIO_ID,
        image_token_offset=IMAGE_OFFSET,
        audio_token_offset=AUDIO_OFFSET,
        **_COMMON,
    )
    _save_random(transformers.Apertus1p5ForConditionalGeneration, config, 2, path)
    build_tiny_tokenizer(512, 0).save_pretrained(path)
    return path


def _media_prompts(seed: int, n: int) -> list[list[int]]:
    """Text prompts with image and audio code ids and both placeholders among the text ids."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        p = [rng.randrange(3, IMAGE_OFFSET) for _ in range(rng.randint(12, 30))]
        for token in (IMAGE_ID, AUDIO_ID, *(rng.randrange(IMAGE_OFFSET, 512) for _ in range(6))):
            p.insert(rng.randrange(len(p)), token)
        prompts.append(p)
    return prompts


def test_greedy_tokens_and_logprobs_match_hf(tmp_path):
    # random_token_prompts draws ids 3-511: past the 383 head rows too
    assert_tiny_case_matches_hf("apertus1p5", "apertus1p5", {}, tmp_path)


def test_tied_head_is_the_whole_embedding(tmp_path):
    """transformers ties lm_head to the full embedding whatever output_vocab_size says."""
    overrides = {"tie_word_embeddings": True}
    assert_tiny_case_matches_hf("apertus1p5_tied", "apertus1p5", overrides, tmp_path)


def test_pruned_ids_are_never_sampled_and_score_minus_inf(text_dir):
    llm = _engine(text_dir, seed=0)
    prompt = [3, 400, 7, 511, 9]
    params = SamplingParams(temperature=1.5, max_tokens=64, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    for out in outs:
        assert max(out.outputs[0].token_ids) < HEAD_ROWS
        scores = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        assert [s == float("-inf") for s in scores] == [True, False, True, False]


def test_wrapper_matches_hf_text_only(wrapper_dir):
    hf = transformers.Apertus1p5ForConditionalGeneration.from_pretrained(
        wrapper_dir, dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = _media_prompts(7, 3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    for out, ref in zip(_greedy(_engine(wrapper_dir), prompts), refs, strict=True):
        assert_matches("apertus1p5 wrapper", out, ref)


@pytest.mark.parametrize(
    ("media", "message"),
    [("image", "multi_modal_data is not supported"), ("audio", "takes no audio")],
)
def test_wrapper_refuses_media(wrapper_dir, media, message):
    llm = _engine(wrapper_dir)
    prompt = {"prompt_token_ids": [3, IMAGE_ID, 7], "multi_modal_data": {media: object()}}
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)


def test_tp2_matches_one_process(text_dir):
    assert_tp_matches_one_process(text_dir, random_token_prompts(5, 3), 6, 128)


@pytest.mark.parametrize("rows", [0, 513])
def test_bad_output_vocab_size_is_refused(rows):
    from paged_engine.models.apertus1p5 import head_rows

    with pytest.raises(ValueError, match="output_vocab_size"):
        head_rows(SimpleNamespace(vocab_size=512, output_vocab_size=rows))
