"""BART / mBART (models/bart.py, engine/encoder_prompt.py) against HF.

Tiny random BartForConditionalGeneration, MBartForConditionalGeneration and BartModel
checkpoints (d_model 32, 4 heads, 2 layers a stack, a random final_logits_bias) saved with a
tiny tokenizer. `LLM.generate` over encoder prompts of different lengths in one batch, in each
of vLLM 0.10's prompt forms (a plain prompt = the encoder prompt, the decoder prompt then
[decoder_start_token_id, bos_token_id]; {"encoder_prompt", "decoder_prompt"}), must give HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32) with the same decoder prompt and
what HF's generation config adds beyond vLLM turned off (forced BOS / EOS, beams, n-gram
blocking, min_length). Then a long decoder prompt chunked through prefill with the prefix cache
on (a second encoder prompt must not reuse the first's decoder KV), and bad input refused by
name while the engine keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import Greedy, assert_matches, hf_generate_enc_dec
from image_checks import greedy
from vlm_checkpoints import tiny_bart_fields

transformers = pytest.importorskip("transformers")

from paged_engine import LLM, SamplingParams  # noqa: E402
from paged_engine.inputs import zip_enc_dec_prompts  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
)

START = EOS_ID  # as BART's: the decoder starts from </s>
DEFAULT_DECODER = [START, BOS_ID]  # vLLM's default decoder prompt


def write_tiny(path: Path, kind: str = "bart", seed: int = 5, max_positions: int = 64) -> Path:
    """A tiny random checkpoint of `kind` ("bart", "mbart" or "bart_model") at `path`."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    arch, cfg_cls, model_cls = {
        "bart": ("BartForConditionalGeneration", "BartConfig", "BartForConditionalGeneration"),
        "mbart": ("MBartForConditionalGeneration", "MBartConfig", "MBartForConditionalGeneration"),
        "bart_model": ("BartModel", "BartConfig", "BartModel"),
    }[kind]
    config = getattr(transformers, cfg_cls)(
        **tiny_bart_fields(len(tokenizer), max_positions),
        scale_embedding=kind == "mbart",
        architectures=[arch],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    _randomize(model, seed)
    if hasattr(model, "final_logits_bias"):
        with torch.no_grad():
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape) * 0.5)
    with _quiet_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_model(path: Path, kind: str = "bart"):
    cls = "MBartForConditionalGeneration" if kind == "mbart" else "BartForConditionalGeneration"
    return getattr(transformers, cls).from_pretrained(path).float().eval()


def hf_generate(model, enc: list[int], dec: list[int] = DEFAULT_DECODER, n: int = 8) -> Greedy:
    """HF generate's greedy tokens for one encoder prompt and decoder prompt, with what vLLM
    does not apply turned off."""
    return hf_generate_enc_dec(
        model, n, input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])
    )


def engine(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def prompt_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("bart"))


@pytest.fixture(scope="module")
def hf(tiny):
    return hf_model(tiny)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return engine(tiny, enable_prefix_caching=True)


def test_matches_hf_batched(tiny, hf, llm):
    encs = [prompt_ids(1, 5), prompt_ids(2, 17), prompt_ids(3, 40), prompt_ids(4, 64)]
    text = "the quick brown fox"
    text_ids = llm.get_tokenizer().encode(text)
    dec_text = " jumps over"  # a text decoder prompt: tokenized as the engine's prompts are
    dec_text_ids = [START, *llm.get_tokenizer().encode(dec_text)]
    explicit = [START, BOS_ID, 9, 33]  # its start token given: nothing prepended
    bare = [7, 11]  # vLLM prepends the start token (not <s>)
    refs = [
        hf_generate(hf, encs[0]),
        hf_generate(hf, encs[1]),
        hf_generate(hf, encs[2], explicit),
        hf_generate(hf, encs[3], [START, *bare]),
        hf_generate(hf, text_ids),
        hf_generate(hf, text_ids, dec_text_ids),
    ]
    assert refs[0].tops != refs[1].tops  # the encoder prompt decides
    prompts = [
        encs[0],
        {"prompt_token_ids": encs[1]},
        {"encoder_prompt": {"prompt_token_ids": encs[2]}, "decoder_prompt": explicit},
        {"encoder_prompt": encs[3], "decoder_prompt": {"prompt_token_ids": bare}},
        text,
        {"encoder_prompt": {"prompt": text}, "decoder_prompt": dec_text},
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    want_dec = [DEFAULT_DECODER, DEFAULT_DECODER, explicit, [START, *bare], DEFAULT_DECODER]
    want_dec.append(dec_text_ids)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.prompt_token_ids == want_dec[i]
        assert_matches(f"bart prompt {i}", out, ref)
    # as vLLM: the decoder prompt's text (None for the default)
    assert (outs[4].prompt, outs[5].prompt) == (None, dec_text)
    # and the encoder prompt's text (None for ids) and ids, as vLLM 0.10's RequestOutput
    enc_ids = [*encs, text_ids, text_ids]
    enc_texts = [None] * 4 + [text, text]
    for i, out in enumerate(outs):
        assert (out.encoder_prompt, out.encoder_prompt_token_ids) == (enc_texts[i], enc_ids[i])
    assert llm.get_stats().num_used_blocks == 0


def test_truncate_prompt_tokens(hf, llm):
    """truncate_prompt_tokens cuts the encoder prompt to its last k ids (-1: the encoder's
    max_position_embeddings), as vLLM cut the one text a completion gives; a decoder prompt
    longer than k is refused by name."""
    enc = prompt_ids(15, 30)
    text = "the quick brown fox jumps over the lazy dog"
    text_ids = llm.get_tokenizer().encode(text)
    assert len(text_ids) > 6

    def cut(k: int) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, truncate_prompt_tokens=k
        )

    outs = llm.generate([enc, text], cut(6), use_tqdm=False)
    assert_matches("bart truncated", outs[0], hf_generate(hf, enc[-6:], n=6))
    assert (outs[0].encoder_prompt_token_ids, outs[1].encoder_prompt_token_ids) == (
        enc[-6:],
        text_ids[-6:],
    )
    assert outs[1].encoder_prompt is None  # the text no longer matches the ids
    assert outs[0].prompt_token_ids == DEFAULT_DECODER  # the decoder prompt is not cut
    long = prompt_ids(16, 70)  # longer than the encoder's 64 positions: cut to them
    out = llm.generate([long], cut(-1), use_tqdm=False)[0]
    assert out.encoder_prompt_token_ids == long[-64:]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=3 would cut the decoder prompt"):
        llm.generate([{"encoder_prompt": enc, "decoder_prompt": [9, 8, 7]}], cut(3), use_tqdm=False)


def test_prefix_cache_and_chunked_prefill(tiny, hf, llm):
    """A 40-token decoder prompt chunked at 16 a step, the prefix cache on: the same encoder
    prompt again reuses its decoder blocks; another encoder prompt with the same decoder ids
    must not (its cross-attention differs: its own HF tokens)."""
    dec = [START, *prompt_ids(9, 39)]
    encs = [prompt_ids(5, 12), prompt_ids(6, 30)]
    refs = [hf_generate(hf, e, dec, n=6) for e in encs]
    chunked = engine(
        tiny, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16
    )
    cached = []
    for e, ref in [(encs[0], refs[0]), (encs[0], refs[0]), (encs[1], refs[1])]:
        req = {"encoder_prompt": e, "decoder_prompt": dec}
        out = chunked.generate([req], greedy(n=6), use_tqdm=False)[0]
        assert_matches("bart chunked", out, ref)
        cached.append(out.num_cached_tokens)
    assert cached == [0, 32, 0]  # two full blocks again for the same encoder prompt only
    cross = chunked.llm_engine.model_runner.cross
    assert cross.encoded == 3  # each request's encoder prompt encoded (the slot freed between)


def test_mbart_and_base_model(tmp_path):
    """mBART (pre-norm, final layer norms, scaled embeddings) and a BartModel checkpoint (no
    "model." prefix, no final_logits_bias: a zero bias), against HF."""
    for kind in ("mbart", "bart_model"):
        path = write_tiny(tmp_path / kind, kind, seed=7)
        hf = hf_model(path, kind)
        encs = [prompt_ids(11, 9), prompt_ids(12, 26)]
        refs = [hf_generate(hf, e, n=6) for e in encs]
        prompts = zip_enc_dec_prompts(encs) if kind == "mbart" else encs  # (vLLM's helper)
        outs = engine(path).generate(prompts, greedy(n=6), use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            assert_matches(kind, out, ref)


@pytest.mark.slow  # (two spawned ranks: most of its ~7 s)
def test_tensor_parallel(tiny, hf):
    """TP=2: each rank's heads of both stacks (the encoder's reduced by its out_proj / fc2)."""
    encs = [prompt_ids(13, 7), prompt_ids(14, 33)]
    refs = [hf_generate(hf, e, n=6) for e in encs]
    tp = engine(tiny, tensor_parallel_size=2)
    try:
        outs = tp.generate(encs, greedy(n=6), use_tqdm=False)
    finally:
        tp.llm_engine.shutdown()
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("bart tp=2", out, ref)


def test_refused(tiny, llm):
    cases = [
        ("", r"encoder_prompt must not be empty"),
        ({"encoder_prompt": [], "decoder_prompt": None}, r"encoder_prompt must not be empty"),
        (prompt_ids(1, 65), r"encoder_prompt is too long.*max_position_embeddings"),
        ([5, TINY_VOCAB_SIZE], r"encoder_prompt token ids must be ints"),
        ({"encoder_prompt": [5], "decoder_prompt": [-1]}, r"decoder_prompt token ids"),
        ({"prompt": "hi", "multi_modal_data": {}}, r"encoder_prompt: 'multi_modal_data'"),
        ({"encoder_prompt": [5], "extra": 1}, r"'encoder_prompt' and 'decoder_prompt'"),
        ({"encoder_prompt": 3}, r"encoder_prompt must be a str"),
    ]
    for prompt, why in cases:
        with pytest.raises(ValueError, match=why):
            llm.generate([prompt], greedy(), use_tqdm=False)
    out = llm.generate([prompt_ids(1, 5)], greedy(), use_tqdm=False)  # still serving
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(tiny, max_model_len=65)
