"""truncate_prompt_tokens on TEXT prompts is applied by the tokenizer, as vLLM's renderer does
(TokenizeParams.get_encode_kwargs: tokenizer.encode(text, truncation=True, max_length=k)), so
the special tokens it adds ([CLS] ... [SEP] / BOS) stay; token-id prompts are sliced. References
are the HF tokenizer's own truncation on a tiny BERT-like encoder (cut on the right: pooling-only)
and a tiny decoder with a BOS (cut on the left)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.testing import BOS_ID, EOS_ID, SPECIAL_TOKENS

KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 64}
TEXT = "hello world this is a fairly long sentence of words about the capital of France"
QUERY, DOC = "what is the capital of France", "the capital of France is Paris, a large old city"
LONG = " ".join(["one two three four five six seven"] * 20)  # well over max_model_len tokens


def with_specials(path: Path, *, pair: bool) -> Path:
    """`path`'s tokenizer made to add its special tokens as BERT does (`pair`: [CLS] A [SEP]
    and [CLS] A [SEP] B [SEP], with BOS / EOS as [CLS] / [SEP]) or as Llama does (BOS A)."""
    from tokenizers.processors import TemplateProcessing

    bos, eos = SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID]
    tok = AutoTokenizer.from_pretrained(path)
    if pair:
        post = TemplateProcessing(
            single=f"{bos} $A {eos}",
            pair=f"{bos} $A {eos} $B:1 {eos}:1",
            special_tokens=[(bos, BOS_ID), (eos, EOS_ID)],
        )
    else:
        post = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS_ID)])
    tok.backend_tokenizer.post_processor = post
    tok.save_pretrained(path)
    return path


def hf_cut(path: Path, text: str, k: int, side: str, **kw) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path, truncation_side=side)
    return tok(text, truncation=True, max_length=k, **kw)["input_ids"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[Path, LLM]:
    from paged_engine.testing import write_tiny_encoder

    path = with_specials(
        write_tiny_encoder(tmp_path_factory.mktemp("bert"), "BertModel"), pair=True
    )
    return path, LLM(model=str(path), **KW)


@pytest.fixture(scope="module")
def cross(tmp_path_factory) -> tuple[Path, LLM]:
    from paged_engine.testing import write_tiny_encoder

    raw = write_tiny_encoder(
        tmp_path_factory.mktemp("ce"), "BertForSequenceClassification", num_labels=1
    )
    path = with_specials(raw, pair=True)
    return path, LLM(model=str(path), **KW)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> tuple[Path, LLM]:
    from paged_engine.testing import write_tiny_model

    path = with_specials(write_tiny_model(tmp_path_factory.mktemp("dec"), "llama"), pair=False)
    return path, LLM(model=str(path), **KW)


def test_embed_and_encode_keep_cls_and_sep(bert) -> None:
    path, llm = bert
    for k in (6, 9):
        want = hf_cut(path, TEXT, k, "right")
        assert want[0] == BOS_ID and want[-1] == EOS_ID and len(want) == k
        (out,) = llm.embed(TEXT, truncate_prompt_tokens=k, use_tqdm=False)
        assert out.prompt_token_ids == want
        (enc,) = llm.encode(
            {"prompt": TEXT}, PoolingParams(task="embed", truncate_prompt_tokens=k), use_tqdm=False
        )
        assert enc.prompt_token_ids == want
        (ref,) = llm.embed({"prompt_token_ids": want}, use_tqdm=False)
        assert out.outputs.embedding == pytest.approx(ref.outputs.embedding, abs=1e-6)


def test_embed_all_that_fit_and_token_ids(bert) -> None:
    path, llm = bert
    (out,) = llm.embed(LONG, truncate_prompt_tokens=-1, use_tqdm=False)
    assert out.prompt_token_ids == hf_cut(path, LONG, KW["max_model_len"], "right")
    assert out.prompt_token_ids[-1] == EOS_ID
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT)
    (sliced,) = llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=6, use_tqdm=False)
    assert sliced.prompt_token_ids == ids[:6]  # token ids: vLLM slices them
    # fewer than the special tokens: HF leaves it whole, then vLLM's slice keeps the first
    (one,) = llm.embed(TEXT, truncate_prompt_tokens=1, use_tqdm=False)
    assert one.prompt_token_ids == [BOS_ID]


def test_embed_without_special_tokens(bert) -> None:
    path, llm = bert
    kwargs = {"add_special_tokens": False}
    (out,) = llm.embed(TEXT, truncate_prompt_tokens=5, tokenization_kwargs=kwargs, use_tqdm=False)
    assert out.prompt_token_ids == hf_cut(path, TEXT, 5, "right", add_special_tokens=False)


def test_classify_and_score_cut_by_the_tokenizer(cross) -> None:
    path, llm = cross
    (cls,) = llm.classify(TEXT, truncate_prompt_tokens=7, use_tqdm=False)
    assert cls.prompt_token_ids == hf_cut(path, TEXT, 7, "right")
    tok = AutoTokenizer.from_pretrained(path, truncation_side="right")
    for k in (10, 14):
        want = tok(QUERY, text_pair=DOC, truncation=True, max_length=k)["input_ids"]
        assert len(want) == k and want.count(EOS_ID) == 2  # both [SEP]s kept
        (out,) = llm.score(QUERY, DOC, truncate_prompt_tokens=k, use_tqdm=False)
        assert out.prompt_token_ids == want
        params = PoolingParams(truncate_prompt_tokens=k)
        (via,) = llm.score(QUERY, DOC, pooling_params=params, use_tqdm=False)
        assert via.prompt_token_ids == want
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.score(QUERY, DOC, truncate_prompt_tokens=65, use_tqdm=False)


def test_generate_keeps_bos_and_cuts_the_start(decoder) -> None:
    path, llm = decoder
    k = 7
    want = hf_cut(path, TEXT, k, "left")
    assert want[0] == BOS_ID and len(want) == k
    assert want[1:] == AutoTokenizer.from_pretrained(path).encode(TEXT)[-(k - 1) :]
    sp = SamplingParams(max_tokens=1, truncate_prompt_tokens=k)
    (out,) = llm.generate(TEXT, sp, use_tqdm=False)
    assert out.prompt_token_ids == want
    assert out.prompt == TEXT  # vLLM keeps the prompt's text
    for kwargs in ({"add_special_tokens": True}, {"truncation_side": "left"}):
        (again,) = llm.generate(TEXT, sp, use_tqdm=False, tokenization_kwargs=kwargs)
        assert again.prompt_token_ids == want
    (right,) = llm.generate(
        TEXT, sp, use_tqdm=False, tokenization_kwargs={"truncation_side": "right"}
    )
    assert right.prompt_token_ids == hf_cut(path, TEXT, k, "right")
    assert llm.get_tokenizer().truncation_side == "left"  # the override was per call
    (cut,) = llm.generate(
        TEXT,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        tokenization_kwargs={"truncation": True, "max_length": k},
    )
    assert cut.prompt_token_ids == want
    ids = AutoTokenizer.from_pretrained(path).encode(TEXT)
    (sliced,) = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    assert sliced.prompt_token_ids == ids[-k:]  # token ids: sliced, BOS gone as in vLLM
